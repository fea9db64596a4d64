//! The controller's state store in memory: a simulated controller needs durable state no
//! more than it needs real time, and a redb file would cost a commit per plan.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, PoisonError};

use shardcast_controller::state::{StateError, StateStore, Table};

/// Tables of byte values in memory, listed in key order like the real stores.
#[derive(Default)]
pub struct MemStore {
    tables: Mutex<HashMap<Table, BTreeMap<String, Vec<u8>>>>,
}

impl MemStore {
    fn tables(&self) -> std::sync::MutexGuard<'_, HashMap<Table, BTreeMap<String, Vec<u8>>>> {
        self.tables.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl StateStore for MemStore {
    fn put(&self, table: Table, key: &str, value: &[u8]) -> Result<(), StateError> {
        self.tables()
            .entry(table)
            .or_default()
            .insert(key.to_string(), value.to_vec());
        Ok(())
    }

    fn delete(&self, table: Table, key: &str) -> Result<(), StateError> {
        if let Some(t) = self.tables().get_mut(&table) {
            t.remove(key);
        }
        Ok(())
    }

    fn get(&self, table: Table, key: &str) -> Result<Option<Vec<u8>>, StateError> {
        Ok(self.tables().get(&table).and_then(|t| t.get(key).cloned()))
    }

    fn list(&self, table: Table) -> Result<Vec<(String, Vec<u8>)>, StateError> {
        Ok(self
            .tables()
            .get(&table)
            .map(|t| t.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_get_list_delete() {
        let s = MemStore::default();
        s.put(Table::Plans, "b", b"2").unwrap();
        s.put(Table::Plans, "a", b"1").unwrap();
        s.put(Table::Hosts, "a", b"h").unwrap();
        assert_eq!(s.get(Table::Plans, "a").unwrap(), Some(b"1".to_vec()));
        let keys: Vec<String> = s
            .list(Table::Plans)
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(keys, ["a", "b"]);
        s.delete(Table::Plans, "a").unwrap();
        assert_eq!(s.get(Table::Plans, "a").unwrap(), None);
        assert_eq!(s.list(Table::Models).unwrap(), vec![]);
    }
}
