//! Write-behind for the state the controller rewrites often and whose newest value alone
//! matters: hosts' last reports (on every heartbeat that changes a host's holdings) and the
//! progress of plans in flight.
//!
//! Measured with 1000 simulated hosts (`shardcast-bench scale`, docs/BENCHMARKS.md): a
//! prewarm of 1000 replicas made ~2000 host-record commits (each receiver's holding
//! appearing, then completing) plus a plan record of 1000 receivers every second, each a
//! redb transaction with an fsync taken under the controller's one state lock, so every
//! heartbeat and status query queued behind the disk: heartbeat p99 went near 1 s, past
//! a third of the 3 s host timeout. Here a write is a map insert (the newest value per key
//! wins) and a task commits what accumulated, every [`BATCH_WINDOW`] at most, in one
//! transaction, off the lock and off the async workers.
//!
//! What a crash can lose: the last [`BATCH_WINDOW`] of such writes. Both kinds are
//! superseded soon anyway: a host reports again within a heartbeat (and a restarted
//! controller gives every host a heartbeat window), a resumed plan polls its receivers.
//! Writes that must be durable before the controller acts on them (a new plan before its
//! chains start, a registered model) use [`WriteBehind::put_now`] or the store directly.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::lock;
use crate::state::{StateError, StateStore, Table};

/// The longest a write waits before it is committed.
pub const BATCH_WINDOW: Duration = Duration::from_millis(50);

/// Pending writes and the task that commits them.
pub struct WriteBehind {
    store: Arc<dyn StateStore>,
    pending: Mutex<HashMap<(Table, String), Vec<u8>>>,
    /// Held while committing, so a [`Self::put_now`] never interleaves with a batch.
    io: Mutex<()>,
    wake: tokio::sync::Notify,
    commits: AtomicU64,
    failures: AtomicU64,
}

impl WriteBehind {
    /// Write-behind over `store`; [`Self::run`] commits.
    pub fn new(store: Arc<dyn StateStore>) -> Arc<Self> {
        Arc::new(Self {
            store,
            pending: Mutex::default(),
            io: Mutex::new(()),
            wake: tokio::sync::Notify::new(),
            commits: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        })
    }

    /// Queues `value` for `key`, replacing a value still queued.
    pub fn put(&self, table: Table, key: &str, value: Vec<u8>) {
        lock(&self.pending).insert((table, key.to_string()), value);
        self.wake.notify_one();
    }

    /// Commits `value` now (dropping a queued older value for the key).
    pub fn put_now(&self, table: Table, key: &str, value: &[u8]) -> Result<(), StateError> {
        let _io = lock(&self.io);
        lock(&self.pending).remove(&(table, key.to_string()));
        self.store.put(table, key, value)
    }

    /// Commits everything queued in one transaction; returns how many writes. On failure
    /// the writes go back in the queue unless a newer value arrived meanwhile.
    pub fn flush(&self) -> Result<usize, StateError> {
        let _io = lock(&self.io);
        let batch: Vec<(Table, String, Vec<u8>)> = std::mem::take(&mut *lock(&self.pending))
            .into_iter()
            .map(|((t, k), v)| (t, k, v))
            .collect();
        if batch.is_empty() {
            return Ok(0);
        }
        match self.store.put_many(&batch) {
            Ok(()) => {
                self.commits.fetch_add(1, Ordering::Relaxed);
                Ok(batch.len())
            }
            Err(e) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                let mut pending = lock(&self.pending);
                for (t, k, v) in batch {
                    pending.entry((t, k)).or_insert(v);
                }
                Err(e)
            }
        }
    }

    /// Writes queued now.
    pub fn queued(&self) -> usize {
        lock(&self.pending).len()
    }

    /// (batches committed, batches that failed).
    pub fn stats(&self) -> (u64, u64) {
        (
            self.commits.load(Ordering::Relaxed),
            self.failures.load(Ordering::Relaxed),
        )
    }

    /// Commits batches until `cancel`, then once more.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            let stop = tokio::select! {
                _ = cancel.cancelled() => true,
                _ = self.wake.notified() => false,
            };
            if !stop {
                // Let writes accumulate (bounded by the window) into one transaction.
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = tokio::time::sleep(BATCH_WINDOW) => {}
                }
            }
            let me = self.clone();
            match tokio::task::spawn_blocking(move || me.flush()).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => warn!("committing queued state writes (will retry): {e}"),
                Err(e) => warn!("the state writer task failed: {e}"),
            }
            if stop || cancel.is_cancelled() {
                // Writes queued while that batch committed (the last ones before a
                // shutdown) are committed too, not dropped.
                if self.queued() > 0 {
                    let me = self.clone();
                    match tokio::task::spawn_blocking(move || me.flush()).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => warn!("committing the last queued state writes: {e}"),
                        Err(e) => warn!("the state writer task failed: {e}"),
                    }
                }
                return;
            }
            if self.queued() > 0 {
                // A failed batch went back in the queue: try again after a pause.
                tokio::time::sleep(BATCH_WINDOW).await;
                self.wake.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::RedbStore;

    struct Failing;
    impl StateStore for Failing {
        fn put(&self, _: Table, _: &str, _: &[u8]) -> Result<(), StateError> {
            Err(StateError::from_display("disk gone"))
        }
        fn delete(&self, _: Table, _: &str) -> Result<(), StateError> {
            Ok(())
        }
        fn get(&self, _: Table, _: &str) -> Result<Option<Vec<u8>>, StateError> {
            Ok(None)
        }
        fn list(&self, _: Table) -> Result<Vec<(String, Vec<u8>)>, StateError> {
            Ok(Vec::new())
        }
    }

    #[test]
    fn newest_value_wins_and_one_batch_commits_all() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn StateStore> =
            Arc::new(RedbStore::open(&dir.path().join("s.redb")).unwrap());
        let w = WriteBehind::new(store.clone());
        w.put(Table::Hosts, "h1", b"old".to_vec());
        w.put(Table::Hosts, "h1", b"new".to_vec());
        w.put(Table::Plans, "p1", b"x".to_vec());
        assert_eq!(store.get(Table::Hosts, "h1").unwrap(), None, "nothing yet");
        assert_eq!(w.flush().unwrap(), 2);
        assert_eq!(w.stats(), (1, 0));
        assert_eq!(store.get(Table::Hosts, "h1").unwrap().unwrap(), b"new");
        assert_eq!(store.get(Table::Plans, "p1").unwrap().unwrap(), b"x");
        assert_eq!(w.flush().unwrap(), 0);
    }

    #[test]
    fn put_now_supersedes_a_queued_value() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn StateStore> =
            Arc::new(RedbStore::open(&dir.path().join("s.redb")).unwrap());
        let w = WriteBehind::new(store.clone());
        w.put(Table::Plans, "p", b"queued".to_vec());
        w.put_now(Table::Plans, "p", b"now").unwrap();
        assert_eq!(w.flush().unwrap(), 0);
        assert_eq!(store.get(Table::Plans, "p").unwrap().unwrap(), b"now");
    }

    #[test]
    fn a_failed_batch_is_queued_again_without_overwriting_newer_values() {
        let w = WriteBehind::new(Arc::new(Failing));
        w.put(Table::Hosts, "h", b"1".to_vec());
        assert!(w.flush().is_err());
        assert_eq!(w.queued(), 1);
        assert_eq!(w.stats(), (0, 1));
    }

    #[tokio::test]
    async fn the_task_commits_within_the_window_and_on_cancel() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn StateStore> =
            Arc::new(RedbStore::open(&dir.path().join("s.redb")).unwrap());
        let w = WriteBehind::new(store.clone());
        let cancel = CancellationToken::new();
        let task = tokio::spawn(w.clone().run(cancel.clone()));
        w.put(Table::Hosts, "h", b"1".to_vec());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while store.get(Table::Hosts, "h").unwrap().is_none() {
            assert!(tokio::time::Instant::now() < deadline, "never committed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        w.put(Table::Hosts, "h", b"2".to_vec());
        cancel.cancel();
        task.await.unwrap();
        assert_eq!(store.get(Table::Hosts, "h").unwrap().unwrap(), b"2");
    }
}
