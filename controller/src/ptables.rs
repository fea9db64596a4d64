//! Partition-plan tables stored with each model (Flashpoint §4.2.2: the plans for every
//! `p ≤ P` and queue length are precomputed, not searched for when a burst needs one).
//!
//! For each model the controller keeps, in memory and in the state store (table
//! `partition_plans`, keyed by model name):
//!
//! * the profile derived from a holder's tensor index when none was registered, so later
//!   plans need no live holder and no RPC;
//! * the last [`TABLES_KEPT`] plan tables, each with the profile it came from.
//!
//! A table is reused only for the same profile and the same parameters (P, GPU memory,
//! link rate, longest queue). A new profile (a re-registration, new weights under the same
//! name) or new parameters (a smaller GPU joined) computes a new table, which replaces the
//! least recently used one. Registering a model with a profile computes its default table
//! (P = 8, the smallest GPU, queues up to 64) at once.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use shardcast_policies::partition::{self, PlanTable};
use shardcast_policies::profile::{Bandwidths, ModelProfile};
use tracing::{info, warn};

use crate::core::Controller;
use crate::error::ApiError;
use crate::state::{StateError, StateStore, Table};

/// Plan tables kept per model.
pub const TABLES_KEPT: usize = 4;

/// `P` when a request does not say.
pub const DEFAULT_MAX_PARTITIONS: usize = 8;

/// Per-GPU memory budget when no host reports its GPUs.
pub const DEFAULT_GPU_MEMORY: u64 = 16 << 30;

/// What is stored for one model.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StoredPlans {
    /// Digest of the model the derived profile was read from.
    pub digest: String,
    /// The profile derived from a holder's tensor index (none with a registered profile).
    pub derived: Option<ModelProfile>,
    /// (profile, table) pairs, least recently used first.
    pub tables: Vec<(ModelProfile, PlanTable)>,
}

/// The longest queue a table covers for a request at `queue`: a power of two, at least 64,
/// so nearby queue lengths share one table.
pub fn table_queue(queue: u32) -> u32 {
    queue
        .max(64)
        .checked_next_power_of_two()
        .unwrap_or(u32::MAX)
}

/// Every model's stored plans.
#[derive(Default)]
pub struct PlanStore(Mutex<HashMap<String, StoredPlans>>);

impl PlanStore {
    /// What `store` holds; an unreadable record is skipped with a warning (its tables are
    /// computed again when needed).
    pub fn restore(store: &dyn StateStore) -> Result<Self, StateError> {
        let mut m = HashMap::new();
        for (name, bytes) in store.list(Table::PartitionPlans)? {
            match serde_json::from_slice::<StoredPlans>(&bytes) {
                Ok(p) => {
                    m.insert(name, p);
                }
                Err(e) => warn!(model = %name, "skipping an unreadable partition-plan record: {e}"),
            }
        }
        Ok(Self(Mutex::new(m)))
    }

    /// One stored record changed (a follower's view, `crate::ha`): `None` deleted it.
    pub fn apply_stored(&self, name: &str, bytes: Option<&[u8]>) {
        let decoded = bytes.map(serde_json::from_slice::<StoredPlans>);
        let mut m = self.lock();
        match decoded {
            Some(Ok(p)) => {
                m.insert(name.to_string(), p);
            }
            Some(Err(e)) => {
                warn!(model = %name, "skipping an unreadable partition-plan record: {e}");
                m.remove(name);
            }
            None => {
                m.remove(name);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, StoredPlans>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn save(store: &dyn StateStore, name: &str, p: &StoredPlans) {
        let r = serde_json::to_vec(p)
            .map_err(StateError::from_display)
            .and_then(|b| store.put(Table::PartitionPlans, name, &b));
        if let Err(e) = r {
            // Only a cache: the next request computes the table again.
            warn!(model = %name, "storing partition plans: {e}");
        }
    }

    /// The profile derived earlier for `name` at `digest`.
    pub fn derived(&self, name: &str, digest: &str) -> Option<ModelProfile> {
        self.lock()
            .get(name)
            .filter(|p| p.digest == digest)
            .and_then(|p| p.derived.clone())
    }

    /// Stores the profile derived for `name` at `digest`.
    pub fn set_derived(
        &self,
        store: &dyn StateStore,
        name: &str,
        digest: &str,
        profile: &ModelProfile,
    ) {
        let mut m = self.lock();
        let p = m.entry(name.to_string()).or_default();
        p.digest = digest.to_string();
        p.derived = Some(profile.clone());
        Self::save(store, name, p);
    }

    /// A stored table of `name` for exactly this profile and these parameters.
    pub fn table(
        &self,
        name: &str,
        profile: &ModelProfile,
        max_partitions: usize,
        gpu_memory: u64,
        link_bps: f64,
        max_queue: u32,
    ) -> Option<PlanTable> {
        let mut m = self.lock();
        let p = m.get_mut(name)?;
        let i = p.tables.iter().position(|(pr, t)| {
            t.max_partitions == max_partitions
                && t.gpu_memory == gpu_memory
                && t.link_bps == link_bps
                && t.max_queue == max_queue
                && pr == profile
        })?;
        // Most recently used last (not persisted: the order only decides what goes first).
        let hit = p.tables.remove(i);
        let table = hit.1.clone();
        p.tables.push(hit);
        Some(table)
    }

    /// Stores a table computed for `name` from `profile`, dropping the least recently used
    /// beyond [`TABLES_KEPT`] and any computed from another profile.
    pub fn put_table(
        &self,
        store: &dyn StateStore,
        name: &str,
        profile: &ModelProfile,
        table: &PlanTable,
    ) {
        let mut m = self.lock();
        let p = m.entry(name.to_string()).or_default();
        p.tables.retain(|(pr, _)| pr == profile);
        p.tables.push((profile.clone(), table.clone()));
        if p.tables.len() > TABLES_KEPT {
            let extra = p.tables.len() - TABLES_KEPT;
            p.tables.drain(..extra);
        }
        Self::save(store, name, p);
    }
}

impl Controller {
    /// The partition-plan table of `model` for `max_partitions`, `gpu_memory` (`None`: the
    /// smallest GPU reported, else [`DEFAULT_GPU_MEMORY`]) and queues up to `max_queue`:
    /// the stored one when the profile and parameters match, else computed and stored.
    /// Returns the model's name, its profile, the table, and whether it was stored.
    pub async fn plan_table(
        &self,
        model: &str,
        max_partitions: usize,
        gpu_memory: Option<u64>,
        max_queue: u32,
    ) -> Result<(String, ModelProfile, PlanTable, bool), ApiError> {
        let (name, profile, smallest_gpu) = self.model_profile(model).await?;
        let gpu_memory = gpu_memory.unwrap_or(smallest_gpu.unwrap_or(DEFAULT_GPU_MEMORY));
        let link_bps = Bandwidths::default().link_bps;
        if let Some(t) = self.plan_store().table(
            &name,
            &profile,
            max_partitions,
            gpu_memory,
            link_bps,
            max_queue,
        ) {
            return Ok((name, profile, t, true));
        }
        let started = std::time::Instant::now();
        let table =
            partition::precompute(&profile, max_partitions, gpu_memory, link_bps, max_queue)
                .map_err(|e| ApiError::precondition(format!("no partition plan: {e}")))?;
        info!(
            model = %name,
            max_partitions,
            gpu_memory,
            max_queue,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "partition plans computed and stored"
        );
        self.plan_store()
            .put_table(self.store(), &name, &profile, &table);
        Ok((name, profile, table, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardcast_policies::profile::synthetic_t5_3b_like;

    fn table(profile: &ModelProfile, p: usize) -> PlanTable {
        partition::precompute(profile, p, 16 << 30, 1e10, 64).unwrap()
    }

    #[test]
    fn tables_are_reused_for_the_same_profile_and_parameters_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::state::RedbStore::open(&dir.path().join("s.redb")).unwrap();
        let plans = PlanStore::restore(&store).unwrap();
        let a = synthetic_t5_3b_like(12);
        let t = table(&a, 4);
        plans.put_table(&store, "m", &a, &t);
        assert_eq!(plans.table("m", &a, 4, 16 << 30, 1e10, 64), Some(t.clone()));
        // Other parameters, another model, another profile: not stored.
        assert_eq!(plans.table("m", &a, 8, 16 << 30, 1e10, 64), None);
        assert_eq!(plans.table("m", &a, 4, 8 << 30, 1e10, 64), None);
        assert_eq!(plans.table("m", &a, 4, 16 << 30, 1e10, 128), None);
        assert_eq!(plans.table("other", &a, 4, 16 << 30, 1e10, 64), None);
        let b = synthetic_t5_3b_like(14);
        assert_eq!(plans.table("m", &b, 4, 16 << 30, 1e10, 64), None);
        // A new profile replaces the tables of the old one.
        plans.put_table(&store, "m", &b, &table(&b, 4));
        assert_eq!(plans.table("m", &a, 4, 16 << 30, 1e10, 64), None);
        assert!(plans.table("m", &b, 4, 16 << 30, 1e10, 64).is_some());
        // Derived profiles belong to one digest.
        plans.set_derived(&store, "m", "d1", &b);
        assert_eq!(plans.derived("m", "d1"), Some(b.clone()));
        assert_eq!(plans.derived("m", "d2"), None);
        // Everything survives a restart; at most TABLES_KEPT tables, least recently used out.
        for p in 2..=(TABLES_KEPT + 2) {
            plans.put_table(&store, "m", &b, &table(&b, p));
        }
        drop(plans);
        let plans = PlanStore::restore(&store).unwrap();
        assert_eq!(plans.derived("m", "d1"), Some(b.clone()));
        assert_eq!(plans.lock()["m"].tables.len(), TABLES_KEPT);
        assert!(
            plans
                .table("m", &b, TABLES_KEPT + 2, 16 << 30, 1e10, 64)
                .is_some()
        );
        assert_eq!(plans.table("m", &b, 2, 16 << 30, 1e10, 64), None);
    }

    #[test]
    fn an_unreadable_record_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::state::RedbStore::open(&dir.path().join("s.redb")).unwrap();
        store
            .put(Table::PartitionPlans, "bad", b"{not json")
            .unwrap();
        let plans = PlanStore::restore(&store).unwrap();
        assert_eq!(plans.derived("bad", ""), None);
    }

    #[test]
    fn table_queues_are_powers_of_two_from_64() {
        assert_eq!(table_queue(0), 64);
        assert_eq!(table_queue(64), 64);
        assert_eq!(table_queue(65), 128);
        assert_eq!(table_queue(u32::MAX), u32::MAX);
    }
}
