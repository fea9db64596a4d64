//! When each model was last used, for the tier sweeper's least-recently-used order. The
//! core records uses (prewarm, scale-out, load reports); the sweeper reads them and
//! flushes them to the state store.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use tracing::warn;

use crate::lock;
use crate::state::{StateError, StateStore, Table};

/// When each model was last used (prewarmed, scaled, or reported with load), seconds since
/// the epoch. Kept in the state store (table `usage`, flushed by each sweep), so a restarted
/// controller still evicts the least recently used copies first.
#[derive(Default)]
pub struct Usage {
    last: Mutex<HashMap<String, f64>>,
    /// Digests touched since the last flush.
    dirty: Mutex<HashSet<String>>,
}

impl Usage {
    /// The last uses kept in `store`; an unreadable entry is skipped with a warning (it
    /// counts as never used, the oldest).
    pub fn restore(store: &dyn StateStore) -> Result<Self, StateError> {
        let mut last = HashMap::new();
        for (digest, bytes) in store.list(Table::Usage)? {
            match Self::decode(&bytes) {
                Some(t) => {
                    last.insert(digest, t);
                }
                None => warn!(model = %digest, "skipping an unreadable last-use record"),
            }
        }
        Ok(Self {
            last: Mutex::new(last),
            ..Self::default()
        })
    }

    /// A stored last-use record: seconds since the epoch, decimal text.
    fn decode(bytes: &[u8]) -> Option<f64> {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|t| t.is_finite())
    }

    /// One stored record changed (a follower's view, `crate::ha`): `None` deleted it.
    pub fn apply_stored(&self, digest: &str, bytes: Option<&[u8]>) {
        let mut last = lock(&self.last);
        match bytes.map(Self::decode) {
            Some(Some(t)) => {
                last.insert(digest.to_string(), t);
            }
            Some(None) => {
                warn!(model = %digest, "skipping an unreadable last-use record");
                last.remove(digest);
            }
            None => {
                last.remove(digest);
            }
        }
    }

    /// Writes the uses recorded since the last flush.
    pub fn flush(&self, store: &dyn StateStore) -> Result<(), StateError> {
        let dirty: Vec<String> = lock(&self.dirty).drain().collect();
        for (n, digest) in dirty.iter().enumerate() {
            let t = self.last(digest);
            if let Err(e) = store.put(Table::Usage, digest, t.to_string().as_bytes()) {
                // Try again next time.
                lock(&self.dirty).extend(dirty[n..].iter().cloned());
                return Err(e);
            }
        }
        Ok(())
    }

    /// Records a use of `digest` now.
    pub fn touch(&self, digest: &str) {
        let now = crate::clock::now_unix();
        lock(&self.last).insert(digest.to_string(), now);
        lock(&self.dirty).insert(digest.to_string());
    }

    /// Last use of `digest` (0: never recorded).
    pub fn last(&self, digest: &str) -> f64 {
        lock(&self.last).get(digest).copied().unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_uses_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let store = crate::state::RedbStore::open(&path).unwrap();
            let usage = Usage::restore(&store).unwrap();
            usage.touch("a");
            usage.flush(&store).unwrap();
            store.put(Table::Usage, "bad", b"not a time").unwrap();
        }
        let store = crate::state::RedbStore::open(&path).unwrap();
        let usage = Usage::restore(&store).unwrap();
        assert!(usage.last("a") > 1.0e9, "{}", usage.last("a"));
        assert_eq!(usage.last("bad"), 0.0);
        assert_eq!(usage.last("never"), 0.0);
    }
}
