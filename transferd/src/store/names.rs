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
//! The newest statement wins. The table is persisted (`names.json` in the disk tier's root,
//! replaced atomically) so that a restarted daemon resolves names before its first
//! heartbeat.

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

    /// Binds `name` to `digest`; whether anything changed.
    pub(super) fn bind(
        &mut self,
        name: &ModelName,
        digest: ModelDigest,
        source: BindingSource,
    ) -> bool {
        let new = Binding { digest, source };
        match self.map.get(name.as_str()) {
            Some(b) if b.digest == digest => {
                // Same version: remember the strongest source (the registry's word).
                if b.source != new.source && new.source == BindingSource::Controller {
                    self.map.insert(name.as_str().to_string(), new);
                    return true;
                }
                false
            }
            old => {
                if let Some(old) = old {
                    tracing::info!(
                        model = %name,
                        from = %old.digest,
                        to = %digest,
                        ?source,
                        "name rebound"
                    );
                }
                self.map.insert(name.as_str().to_string(), new);
                true
            }
        }
    }

    /// Applies the controller's registry for `held` (the names this host reported): each
    /// name in `registry` is bound to its version; each reported name absent from it is
    /// unbound, unless a local import bound it (an admin's word on this host, which the
    /// registry has not contradicted). Returns whether anything changed.
    pub(super) fn sync(
        &mut self,
        held: &[ModelName],
        registry: &BTreeMap<ModelName, ModelDigest>,
    ) -> bool {
        let mut changed = false;
        for name in held {
            match registry.get(name) {
                Some(d) => changed |= self.bind(name, *d, BindingSource::Controller),
                None => {
                    let imported = self
                        .map
                        .get(name.as_str())
                        .is_some_and(|b| b.source == BindingSource::Import);
                    if imported {
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
        assert!(t.bind(&n("org/m"), a, BindingSource::Import));
        assert!(!t.bind(&n("org/m"), a, BindingSource::Plan), "same version");
        assert!(t.bind(&n("org/m"), b, BindingSource::Plan));
        assert_eq!(t.get("org/m").unwrap().digest, b);
        // The registry says `a` (a rollback): it wins. A name it does not know goes, unless
        // a local import bound it.
        assert!(t.bind(&n("org/x"), b, BindingSource::Plan));
        assert!(t.bind(&n("org/i"), b, BindingSource::Import));
        let reg = BTreeMap::from([(n("org/m"), a)]);
        assert!(t.sync(&[n("org/m"), n("org/x"), n("org/i")], &reg));
        assert_eq!(t.get("org/i").unwrap().digest, b);
        assert_eq!(
            t.get("org/m"),
            Some(&Binding {
                digest: a,
                source: BindingSource::Controller
            })
        );
        assert!(t.get("org/x").is_none());
        assert!(!t.sync(&[n("org/m")], &reg), "nothing changed");
    }
}
