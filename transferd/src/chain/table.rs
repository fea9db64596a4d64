//! The session table of a host ([`Sessions`]): hop sessions by (session, shard, first chunk
//! of the range), head sessions by id, and whether the host drains; and the store's refusals
//! of a model's data per (model, tier) ([`StoreFailures`]).
//!
//! Both are cheap-to-clone handles on shared state. The roles that join, head or end
//! sessions are given [`Sessions`]; the one path that stores chunks (`session::Intake`) is
//! given [`StoreFailures`]. No role other than these reaches another session. Outside the
//! chain, [`Sessions`] shows only draining, the unfinished sessions, a head session by id
//! and ending the sessions of a model or of a rotten chunk (the daemon's drain, the agent
//! API, the repairer); inserting, looking up and removing hop sessions stay in the chain.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use shardcast_protocol::{DataTier, ModelDigest, SessionId};
use tokio::sync::watch;
use tracing::warn;

use super::{HeadSession, SessionError, SessionKey, ShardSession};
use crate::store::Shard;

/// The hop and head sessions on this host, and whether it drains. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Sessions(Arc<Tables>);

struct Tables {
    /// Hop sessions by (session, shard, first chunk of the range): a striped shard has one
    /// per stripe.
    hops: Mutex<HashMap<SessionKey, Arc<ShardSession>>>,
    heads: Mutex<HashMap<SessionId, Arc<HeadSession>>>,
    /// Set once the host drains ([`Sessions::start_draining`]): it finishes the sessions it
    /// has and starts no new one.
    draining: watch::Sender<bool>,
}

impl Default for Sessions {
    fn default() -> Self {
        Self(Arc::new(Tables {
            hops: Mutex::default(),
            heads: Mutex::default(),
            draining: watch::Sender::new(false),
        }))
    }
}

impl Sessions {
    /// Starts draining; `true` the first time.
    pub(crate) fn start_draining(&self) -> bool {
        !self.0.draining.send_replace(true)
    }

    /// Whether the host is draining.
    pub(crate) fn draining(&self) -> bool {
        *self.0.draining.borrow()
    }

    /// Follows [`Self::draining`].
    pub(crate) fn watch_draining(&self) -> watch::Receiver<bool> {
        self.0.draining.subscribe()
    }

    /// Hop sessions and head sessions' shards that have not finished.
    pub(crate) fn unfinished(&self) -> usize {
        self.count_where(|s| s.outcome().is_none())
    }

    /// The hop sessions and head sessions' parts here that satisfy `hit` (each is asked once).
    fn count_where(&self, hit: impl Fn(&ShardSession) -> bool) -> usize {
        let hop = self
            .0
            .hops
            .lock()
            .map(|m| m.values().filter(|s| hit(s)).count())
            .unwrap_or(0);
        let head = self
            .0
            .heads
            .lock()
            .map(|m| {
                m.values()
                    .flat_map(|h| h.parts.iter())
                    .filter(|s| hit(s))
                    .count()
            })
            .unwrap_or(0);
        hop + head
    }

    /// Whether a session that has not finished sends or receives model `model` here.
    pub(crate) fn model_busy(&self, model: &ModelDigest) -> bool {
        self.any_unfinished(|s| s.model == *model)
    }

    /// Whether an unfinished hop session, or an unfinished part of a head session, here
    /// satisfies `hit`.
    fn any_unfinished(&self, hit: impl Fn(&ShardSession) -> bool) -> bool {
        self.count_where(|s| s.outcome().is_none() && hit(s)) > 0
    }

    /// Whether an unfinished hop or head session here receives shard `shard` of `model`
    /// (its copy may still grow). A holder that answers a `Fetch` with part of the span and
    /// receives nothing says so ([`ErrorCode::NotReceiving`]).
    ///
    /// [`ErrorCode::NotReceiving`]: shardcast_protocol::ErrorCode::NotReceiving
    pub(super) fn receives(&self, model: &ModelDigest, shard: u32) -> bool {
        self.any_unfinished(|s| s.model == *model && s.shard_index() == shard)
    }

    /// Stops the origin reads of the unfinished sessions here, other than `fed`, that write
    /// into `fed`'s shard: a peer feeds that shard now ([`ShardSession::yield_origin_read`]).
    /// Returns how many were stopped.
    pub(crate) fn yield_origin_reads(&self, fed: &ShardSession) -> usize {
        self.count_where(|s| {
            !std::ptr::eq(s, fed)
                && Arc::ptr_eq(&s.shard, &fed.shard)
                && s.outcome().is_none()
                && s.yield_origin_read()
        })
    }

    /// Fails every unfinished session here that forwards from `shard` and needs one of
    /// `chunks`. Returns how many were failed.
    pub(crate) fn fail_needing(
        &self,
        shard: &Arc<Shard>,
        chunks: &[u32],
        why: &SessionError,
    ) -> usize {
        self.fail_where(why, |s| {
            Arc::ptr_eq(&s.shard, shard) && chunks.iter().any(|c| (s.start..s.end).contains(c))
        })
    }

    /// Fails every unfinished session of `model` here. Returns how many were failed.
    pub(crate) fn end_of(&self, model: &ModelDigest, why: &SessionError) -> usize {
        self.fail_where(why, |s| s.model == *model)
    }

    /// Fails every unfinished hop or head session for which `hit` holds.
    fn fail_where(&self, why: &SessionError, hit: impl Fn(&ShardSession) -> bool) -> usize {
        let hit = |s: &ShardSession| s.outcome().is_none() && hit(s);
        let mut found: Vec<Arc<ShardSession>> = self
            .0
            .hops
            .lock()
            .map(|m| m.values().filter(|s| hit(s)).cloned().collect())
            .unwrap_or_default();
        if let Ok(h) = self.0.heads.lock() {
            found.extend(
                h.values()
                    .flat_map(|h| h.parts.iter())
                    .filter(|s| hit(s))
                    .cloned(),
            );
        }
        for s in &found {
            s.fail(why.clone());
        }
        found.len()
    }

    /// The hop session under `key`.
    pub(super) fn hop(&self, key: &SessionKey) -> Option<Arc<ShardSession>> {
        self.0.hops.lock().ok().and_then(|m| m.get(key).cloned())
    }

    /// Whether a hop session of session `id` (any shard or stripe) runs here.
    pub(super) fn runs(&self, id: &SessionId) -> bool {
        self.0
            .hops
            .lock()
            .is_ok_and(|m| m.keys().any(|(s, _, _)| s == id))
    }

    /// Hop sessions in the table.
    pub(super) fn hops(&self) -> usize {
        self.0.hops.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// Inserts `sess` under `key` unless one is there already: `Ok(None)` when inserted,
    /// `Ok(Some(theirs))` when another connection created it first, `Err` when the table
    /// is poisoned.
    pub(super) fn insert_hop(
        &self,
        key: SessionKey,
        sess: &Arc<ShardSession>,
    ) -> Result<Option<Arc<ShardSession>>, ()> {
        let mut map = self.0.hops.lock().map_err(|_| ())?;
        if let Some(s) = map.get(&key) {
            return Ok(Some(s.clone()));
        }
        map.insert(key, sess.clone());
        Ok(None)
    }

    /// Removes the hop session under `key`.
    pub(super) fn remove_hop(&self, key: &SessionKey) {
        if let Ok(mut m) = self.0.hops.lock() {
            m.remove(key);
        }
    }

    /// A head session by id.
    pub(crate) fn head(&self, id: &SessionId) -> Option<Arc<HeadSession>> {
        self.0.heads.lock().ok()?.get(id).cloned()
    }

    /// Whether a head session `id` is held.
    pub(super) fn has_head(&self, id: &SessionId) -> bool {
        self.0
            .heads
            .lock()
            .map(|h| h.contains_key(id))
            .unwrap_or(false)
    }

    /// Holds a head session.
    pub(super) fn insert_head(&self, head: &Arc<HeadSession>) {
        if let Ok(mut h) = self.0.heads.lock() {
            h.insert(head.id, head.clone());
        }
    }

    /// Forgets a head session.
    pub(super) fn remove_head(&self, id: &SessionId) {
        if let Ok(mut h) = self.0.heads.lock() {
            h.remove(id);
        }
    }
}

/// Why the store last refused a model's data in a tier (a shard that did not fit, a write
/// the file system failed, such as `ENOSPC` on a tmpfs another process filled), and in which
/// session: reported with the model's status until a new session of the model in that tier
/// starts. Cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct StoreFailures(Arc<Mutex<Refusals>>);

/// (model, tier) → (session, why).
type Refusals = HashMap<(ModelDigest, DataTier), (SessionId, String)>;

impl StoreFailures {
    /// Records why the store refused `model`'s data in `tier` for `session`, and logs it.
    pub(crate) fn note(&self, model: ModelDigest, tier: DataTier, session: SessionId, why: String) {
        warn!(%model, ?tier, %session, "the store refused the model's data: {why}");
        if let Ok(mut m) = self.0.lock() {
            m.insert((model, tier), (session, why));
        }
    }

    /// Why the store last refused `model`'s data, per tier and with the session.
    pub(crate) fn of(&self, model: &ModelDigest) -> Vec<(DataTier, SessionId, String)> {
        self.0
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|((d, _), _)| d == model)
                    .map(|((_, t), (sess, why))| (*t, *sess, why.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A new session of `model` in `tier` starts: an earlier refusal is history.
    pub(crate) fn clear(&self, model: ModelDigest, tier: DataTier) {
        if let Ok(mut m) = self.0.lock() {
            m.remove(&(model, tier));
        }
    }
}
