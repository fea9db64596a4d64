//! Which version each model name means on this host: the name table.
//!
//! A name resolves only through a binding that an authority made, never from whichever
//! manifest arrived last (a manifest names itself, so any sender could otherwise repoint a
//! name). Bindings come from:
//! * the controller's registry, in each heartbeat's answer (the current version of every
//!   name this host holds or binds; a name the registry does not know is unbound, unless
//!   an import on this host bound it);
//! * a verified plan token whose claims bind the name (the controller signed the plan for
//!   the name's current version);
//! * an `ImportModel` call, which only the `admin` and `controller` roles may make.
//!
//! The newest statement wins, by the controller's clock: each binding keeps the time of
//! the statement that made or last confirmed it (a plan token's `issued_at_ms`, a heartbeat
//! answer's), and an older statement is refused (a plan's, counted and logged; a heartbeat
//! answer that crossed a newer token, skipped). So a host with a valid certificate that
//! replays an old plan token cannot roll a name back. An import (an admin's word on this
//! host) always applies and keeps the newest time seen. Confirmations refresh the time in
//! memory; the file is rewritten only when a binding changes, so after a restart the first
//! heartbeat answer brings the times up to date. The table is persisted (`names.json` in
//! the disk tier's root, replaced atomically) so that a restarted daemon resolves names
//! before its first heartbeat.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use shardcast_protocol::{ModelDigest, ModelName};

use super::StoreError;
use super::beneath::TierDir;

/// File of the table, relative to the disk tier's root.
pub(super) const NAMES_FILE: &str = "names.json";
/// Largest table file read back (about 100 000 names).
const MAX_NAMES_FILE: u64 = 32 << 20;

/// Who made a binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BindingSource {
    /// The controller's registry (a heartbeat's answer).
    Controller,
    /// A verified plan token.
    Plan,
    /// An `ImportModel` call by an admin or the controller.
    Import,
}

/// One binding: `name` means `digest` on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    /// The model version.
    pub digest: ModelDigest,
    /// Who said so.
    pub source: BindingSource,
    /// When the newest statement of it was made (the controller's clock, Unix ms; 0 in a
    /// table written before bindings had times).
    #[serde(default)]
    pub stated_ms: u64,
}

/// A statement about a name older than the binding this host holds: refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "a statement made at {stated_ms} ms is older than the binding held (stated at {held_ms} ms)"
)]
pub struct StaleStatement {
    /// When the refused statement was made.
    pub stated_ms: u64,
    /// When the binding held was stated.
    pub held_ms: u64,
}

/// The table, in memory; [`super::ShardStore`] holds it behind its lock and persists it.
#[derive(Debug, Default)]
pub(super) struct Names {
    map: BTreeMap<String, Binding>,
}

impl Names {
    /// Reads the table back; a missing file is an empty table. Entries that fail
    /// validation (a bad name) are skipped with a warning.
    pub(super) fn load(disk: &TierDir) -> Result<Self, StoreError> {
        let rel = Path::new(NAMES_FILE);
        let bytes = match disk.read_file(rel, MAX_NAMES_FILE) {
            Ok(b) => b,
            Err(StoreError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self::default());
            }
            Err(e) => return Err(e),
        };
        let raw: BTreeMap<String, Binding> =
            serde_json::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
                path: disk.root().join(rel),
                reason: format!("name table: {e}"),
            })?;
        let map = raw
            .into_iter()
            .filter(|(name, _)| match ModelName::new(name.as_str()) {
                Ok(_) => true,
                Err(e) => {
                    tracing::warn!(%name, error = %e, "skipping a bad name in the name table");
                    false
                }
            })
            .collect();
        Ok(Self { map })
    }

    /// Writes the table.
    pub(super) fn save(&self, disk: &TierDir) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec_pretty(&self.map).map_err(|e| StoreError::Corrupt {
            path: disk.root().join(NAMES_FILE),
            reason: format!("encoding the name table: {e}"),
        })?;
        disk.write_atomic(Path::new(NAMES_FILE), &bytes)
    }

    /// The binding of `name`.
    pub(super) fn get(&self, name: &str) -> Option<&Binding> {
        self.map.get(name)
    }

    /// Binds `name` to `digest` as `source` said at `stated_ms` (the controller's clock);
    /// whether the table changed so that it must be saved. A plan's or the controller's
    /// statement older than the binding held is refused; an import always applies.
    pub(super) fn bind(
        &mut self,
        name: &ModelName,
        digest: ModelDigest,
        source: BindingSource,
        stated_ms: u64,
    ) -> Result<bool, StaleStatement> {
        let held = self.map.get_mut(name.as_str());
        if let Some(b) = &held
            && source != BindingSource::Import
            && stated_ms < b.stated_ms
        {
            return Err(StaleStatement {
                stated_ms,
                held_ms: b.stated_ms,
            });
        }
        match held {
            Some(b) if b.digest == digest => {
                // Same version: a confirmation. Keep the newest time (in memory) and the
                // strongest source (the registry's word), saving only for the latter.
                b.stated_ms = b.stated_ms.max(stated_ms);
                if b.source != source && source == BindingSource::Controller {
                    b.source = source;
                    return Ok(true);
                }
                Ok(false)
            }
            old => {
                let held_ms = old.as_ref().map_or(0, |b| b.stated_ms);
                if let Some(old) = old {
                    tracing::info!(
                        model = %name,
                        from = %old.digest,
                        to = %digest,
                        ?source,
                        "name rebound"
                    );
                }
                let stated_ms = stated_ms.max(held_ms);
                self.map.insert(
                    name.as_str().to_string(),
                    Binding {
                        digest,
                        source,
                        stated_ms,
                    },
                );
                Ok(true)
            }
        }
    }

    /// Applies the controller's registry, as it answered at `stated_ms`, for `held` (the
    /// names this host reported): each name in `registry` is bound to its version; each
    /// reported name absent from it is unbound, unless a local import bound it (an admin's
    /// word on this host, which the registry has not contradicted). A binding stated after
    /// the answer (a plan token that crossed it) is left alone. Returns whether anything
    /// changed.
    pub(super) fn sync(
        &mut self,
        held: &[ModelName],
        registry: &BTreeMap<ModelName, ModelDigest>,
        stated_ms: u64,
    ) -> bool {
        let mut changed = false;
        for name in held {
            match registry.get(name) {
                Some(d) => match self.bind(name, *d, BindingSource::Controller, stated_ms) {
                    Ok(c) => changed |= c,
                    Err(e) => tracing::debug!(model = %name, "registry answer not applied: {e}"),
                },
                None => {
                    let keep = self.map.get(name.as_str()).is_some_and(|b| {
                        b.source == BindingSource::Import || b.stated_ms > stated_ms
                    });
                    if keep {
                        continue;
                    }
                    if let Some(old) = self.map.remove(name.as_str()) {
                        tracing::info!(
                            model = %name,
                            digest = %old.digest,
                            "name unbound: the controller's registry does not know it"
                        );
                        changed = true;
                    }
                }
            }
        }
        changed
    }

    /// Every binding.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&String, &Binding)> {
        self.map.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> ModelName {
        ModelName::new(s).unwrap()
    }

    #[test]
    fn newest_statement_wins_and_registry_unbinds() {
        let mut t = Names::default();
        let (a, b) = (ModelDigest([1; 32]), ModelDigest([2; 32]));
        assert_eq!(t.bind(&n("org/m"), a, BindingSource::Import, 0), Ok(true));
        assert_eq!(
            t.bind(&n("org/m"), a, BindingSource::Plan, 10),
            Ok(false),
            "same version"
        );
        assert_eq!(t.bind(&n("org/m"), b, BindingSource::Plan, 20), Ok(true));
        assert_eq!(t.get("org/m").unwrap().digest, b);
        // The registry says `a` (a rollback): it wins. A name it does not know goes, unless
        // a local import bound it.
        assert_eq!(t.bind(&n("org/x"), b, BindingSource::Plan, 20), Ok(true));
        assert_eq!(t.bind(&n("org/i"), b, BindingSource::Import, 0), Ok(true));
        let reg = BTreeMap::from([(n("org/m"), a)]);
        assert!(t.sync(&[n("org/m"), n("org/x"), n("org/i")], &reg, 30));
        assert_eq!(t.get("org/i").unwrap().digest, b);
        assert_eq!(
            t.get("org/m"),
            Some(&Binding {
                digest: a,
                source: BindingSource::Controller,
                stated_ms: 30,
            })
        );
        assert!(t.get("org/x").is_none());
        assert!(!t.sync(&[n("org/m")], &reg, 31), "nothing changed");
    }

    #[test]
    fn an_older_statement_cannot_move_a_name_back() {
        let mut t = Names::default();
        let (v1, v2) = (ModelDigest([1; 32]), ModelDigest([2; 32]));
        let m = n("org/m");
        assert_eq!(t.bind(&m, v1, BindingSource::Plan, 100), Ok(true));
        assert_eq!(t.bind(&m, v2, BindingSource::Plan, 200), Ok(true));
        // The v1 token replayed: refused, the name stays on v2.
        assert_eq!(
            t.bind(&m, v1, BindingSource::Plan, 100),
            Err(StaleStatement {
                stated_ms: 100,
                held_ms: 200
            })
        );
        assert_eq!(t.get("org/m").unwrap().digest, v2);
        // A rollback the registry made later is a newer statement: it applies.
        assert_eq!(t.bind(&m, v1, BindingSource::Plan, 300), Ok(true));
        assert_eq!(t.get("org/m").unwrap().digest, v1);
        // A confirmation of v1 at 400 (a heartbeat answer: saved only because the source
        // becomes the registry) makes a v2 token of 350 stale; a second confirmation
        // changes nothing to save.
        let registry = BTreeMap::from([(m.clone(), v1)]);
        assert!(t.sync(std::slice::from_ref(&m), &registry, 400));
        assert!(!t.sync(std::slice::from_ref(&m), &registry, 450));
        assert_eq!(t.get("org/m").unwrap().stated_ms, 450);
        assert!(t.bind(&m, v2, BindingSource::Plan, 350).is_err());
        assert!(t.bind(&m, v2, BindingSource::Plan, 420).is_err());
        // A heartbeat answer older than a token that crossed it leaves the token's binding
        // (and does not unbind a name it does not know yet).
        let x = n("org/x");
        assert_eq!(t.bind(&x, v2, BindingSource::Plan, 500), Ok(true));
        assert!(!t.sync(std::slice::from_ref(&x), &BTreeMap::new(), 450));
        assert_eq!(t.get("org/x").unwrap().digest, v2);
        // An import applies whatever the times, and keeps the newest.
        assert_eq!(t.bind(&x, v1, BindingSource::Import, 0), Ok(true));
        assert_eq!(t.get("org/x").unwrap().stated_ms, 500);
        assert!(t.bind(&x, v2, BindingSource::Plan, 499).is_err());
    }
}
