//! Durable controller state behind a small trait: the embedded redb file by default,
//! etcd ([`crate::etcd::EtcdStore`]) for several controller replicas.
//!
//! The controller keeps six tables: registered models (JSON records), their manifests (raw
//! canonical bytes), hosts' last reports, plans (JSON records, in flight and finished),
//! each model's last use, and each model's partition-plan tables.
//! Every write is one committed transaction; a crash loses at most the write in progress.
//!
//! What is kept where: `models` (versioned `ModelRecord`s), `manifests` (canonical bytes by
//! digest), `hosts` (each host's last report when it changes, and its GPU bookings and
//! pending evictions: versioned `StoredHost`s), `plans` (versioned `StoredPlan`s; in flight
//! ones queued at most once a second through the write-behind, the end committed at once; a
//! new leader resumes the running ones), `usage` and `partition_plans`. Only in memory,
//! rebuilt after a restart or a take-over: host liveness, the autoscaler's per-model state
//! and counters, agent connections, plan watchers. [`RedbStore`] is the embedded default
//! (`state.redb` under `--state-dir`, one replica); `put_many` is one transaction there and
//! fenced batches on etcd.

use std::path::Path;

use redb::{Database, ReadableTable, TableDefinition};

/// The tables of the controller's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Table {
    /// Model name → `ModelRecord` (JSON).
    Models,
    /// Hex digest → canonical manifest bytes.
    Manifests,
    /// Host id → last `HostReport` (JSON) and GPU reservations.
    Hosts,
    /// Plan id → `PlanRecord` (JSON).
    Plans,
    /// Model digest → its last use, seconds since the epoch (decimal text), for LRU
    /// eviction across restarts.
    Usage,
    /// Model name → its stored partition-plan tables (JSON `ptables::StoredPlans`).
    PartitionPlans,
}

impl Table {
    /// The table's name (redb table, etcd key segment).
    pub fn name(self) -> &'static str {
        match self {
            Self::Models => "models",
            Self::Manifests => "manifests",
            Self::Hosts => "hosts",
            Self::Plans => "plans",
            Self::Usage => "usage",
            Self::PartitionPlans => "partition_plans",
        }
    }

    /// The table called `name` (an etcd key segment), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    fn def(self) -> TableDefinition<'static, &'static str, &'static [u8]> {
        TableDefinition::new(self.name())
    }

    /// Every table.
    pub const ALL: [Self; 6] = [
        Self::Models,
        Self::Manifests,
        Self::Hosts,
        Self::Plans,
        Self::Usage,
        Self::PartitionPlans,
    ];
}

/// Why the state store failed.
#[derive(Debug, thiserror::Error)]
#[error("controller state store: {0}")]
pub struct StateError(String);

impl StateError {
    fn from<E: std::fmt::Display>(e: E) -> Self {
        Self(e.to_string())
    }

    /// An error from anything printable (encoding a record).
    pub(crate) fn from_display<E: std::fmt::Display>(e: E) -> Self {
        Self(e.to_string())
    }
}

/// A key-value store of byte values in a few named tables.
pub trait StateStore: Send + Sync + 'static {
    /// Inserts or replaces `key` in `table`.
    fn put(&self, table: Table, key: &str, value: &[u8]) -> Result<(), StateError>;
    /// Removes `key` (absent is fine).
    fn delete(&self, table: Table, key: &str) -> Result<(), StateError>;
    /// One value.
    fn get(&self, table: Table, key: &str) -> Result<Option<Vec<u8>>, StateError>;
    /// Every entry of `table`, in key order.
    fn list(&self, table: Table) -> Result<Vec<(String, Vec<u8>)>, StateError>;
    /// Inserts or replaces several keys, in one transaction where the store has them (the
    /// default writes them one by one; etcd commits fenced batches of at most its
    /// `--max-txn-ops`, each atomic). A key given twice takes its last value. Used by
    /// `write_behind`.
    fn put_many(&self, writes: &[(Table, String, Vec<u8>)]) -> Result<(), StateError> {
        for (table, key, value) in writes {
            self.put(*table, key, value)?;
        }
        Ok(())
    }
}

/// The embedded default: one redb file.
pub struct RedbStore {
    db: Database,
}

impl RedbStore {
    /// Opens (or creates) the database at `path`.
    pub fn open(path: &Path) -> Result<Self, StateError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| {
                StateError(format!("creating state directory {}: {e}", dir.display()))
            })?;
        }
        let db = Database::create(path)
            .map_err(|e| StateError(format!("opening {}: {e}", path.display())))?;
        // Create every table once so readers never meet a missing one.
        let tx = db.begin_write().map_err(StateError::from)?;
        for t in Table::ALL {
            tx.open_table(t.def()).map_err(StateError::from)?;
        }
        tx.commit().map_err(StateError::from)?;
        Ok(Self { db })
    }
}

impl StateStore for RedbStore {
    fn put(&self, table: Table, key: &str, value: &[u8]) -> Result<(), StateError> {
        let tx = self.db.begin_write().map_err(StateError::from)?;
        {
            let mut t = tx.open_table(table.def()).map_err(StateError::from)?;
            t.insert(key, value).map_err(StateError::from)?;
        }
        tx.commit().map_err(StateError::from)
    }

    /// One transaction (one fsync) for the whole batch.
    fn put_many(&self, writes: &[(Table, String, Vec<u8>)]) -> Result<(), StateError> {
        let tx = self.db.begin_write().map_err(StateError::from)?;
        for (table, key, value) in writes {
            let mut t = tx.open_table(table.def()).map_err(StateError::from)?;
            t.insert(key.as_str(), value.as_slice())
                .map_err(StateError::from)?;
        }
        tx.commit().map_err(StateError::from)
    }

    fn delete(&self, table: Table, key: &str) -> Result<(), StateError> {
        let tx = self.db.begin_write().map_err(StateError::from)?;
        {
            let mut t = tx.open_table(table.def()).map_err(StateError::from)?;
            t.remove(key).map_err(StateError::from)?;
        }
        tx.commit().map_err(StateError::from)
    }

    fn get(&self, table: Table, key: &str) -> Result<Option<Vec<u8>>, StateError> {
        let tx = self.db.begin_read().map_err(StateError::from)?;
        let t = tx.open_table(table.def()).map_err(StateError::from)?;
        Ok(t.get(key)
            .map_err(StateError::from)?
            .map(|v| v.value().to_vec()))
    }

    fn list(&self, table: Table) -> Result<Vec<(String, Vec<u8>)>, StateError> {
        let tx = self.db.begin_read().map_err(StateError::from)?;
        let t = tx.open_table(table.def()).map_err(StateError::from)?;
        let mut out = Vec::new();
        for entry in t.iter().map_err(StateError::from)? {
            let (k, v) = entry.map_err(StateError::from)?;
            out.push((k.value().to_string(), v.value().to_vec()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let s = RedbStore::open(&path).unwrap();
            s.put(Table::Models, "a", b"1").unwrap();
            s.put(Table::Models, "b", b"2").unwrap();
            s.put(Table::Plans, "p", b"x").unwrap();
            s.delete(Table::Models, "a").unwrap();
            s.delete(Table::Models, "missing").unwrap();
        }
        let s = RedbStore::open(&path).unwrap();
        assert_eq!(
            s.list(Table::Models).unwrap(),
            vec![("b".into(), b"2".to_vec())]
        );
        assert_eq!(
            s.get(Table::Plans, "p").unwrap().as_deref(),
            Some(&b"x"[..])
        );
        assert_eq!(s.get(Table::Hosts, "h").unwrap(), None);
    }

    #[test]
    fn put_many_writes_every_table_in_one_go() {
        let dir = tempfile::tempdir().unwrap();
        let s = RedbStore::open(&dir.path().join("state.redb")).unwrap();
        s.put_many(&[
            (Table::Hosts, "h".into(), b"1".to_vec()),
            (Table::Plans, "p".into(), b"2".to_vec()),
            (Table::Hosts, "h".into(), b"3".to_vec()),
        ])
        .unwrap();
        assert_eq!(
            s.get(Table::Hosts, "h").unwrap().as_deref(),
            Some(&b"3"[..])
        );
        assert_eq!(
            s.get(Table::Plans, "p").unwrap().as_deref(),
            Some(&b"2"[..])
        );
    }

    #[test]
    fn table_names_round_trip() {
        for t in Table::ALL {
            assert_eq!(Table::from_name(t.name()), Some(t));
        }
        assert_eq!(Table::from_name("leader"), None);
    }

    #[test]
    fn garbage_file_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        std::fs::write(&path, b"this is not a database").unwrap();
        let err = RedbStore::open(&path).err().expect("must fail");
        assert!(err.to_string().contains("state.redb"), "{err}");
    }
}
