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
//! name, a derived profile re-estimated at new load or execution rates) or new parameters
//! (a smaller GPU joined, a slower NIC, a new `--partition-link-rate`) computes a new table,
//! which replaces the least recently used one. Registering a model with a profile computes
//! its default table (P = 8, the smallest GPU, queues up to 64) at once.
//!
//! Rates ([`PartitionConfig`]): the link between partitions is `--partition-link-rate`, else
//! the slowest NIC rate the up hosts report ([`slowest_nic`]: GPU hosts when some report
//! GPUs, since partitions run there and hand activations to one another), else
//! `--default-nic-rate`, else the thesis' 10 Gbit/s ([`link_rate`]). A derived profile's
//! load and execution times are estimated at `--partition-load-rate` and
//! `--partition-exec-rate` (default: the T5-3B calibration of [`Bandwidths::default`]); a
//! stored derived profile is re-estimated at the current rates each time it is used, so a
//! changed rate never serves times (or tables) computed at the old one.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use crate::ops::{PartitionPlanAnswer, PartitionPlanQuery};
use serde::{Deserialize, Serialize};
use shardcast_policies::partition::{self, PartitionPlan, PlanTable};
use shardcast_policies::profile::{self, Bandwidths, ModelProfile};
use tracing::{info, warn};

use crate::error::PartitionError;
use crate::state::{StateError, StateStore, Table};

/// Plan tables kept per model.
pub const TABLES_KEPT: usize = 4;

/// `P` when a request does not say.
pub const DEFAULT_MAX_PARTITIONS: usize = 8;

/// Per-GPU memory budget when no host reports its GPUs.
pub const DEFAULT_GPU_MEMORY: u64 = 16 << 30;

/// Partition planning's rates, from the controller's `--partition-*-rate` settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartitionConfig {
    /// Bytes/s on the link carrying activations between partitions; `None`: from the
    /// hosts' NIC rates ([`link_rate`]).
    pub link_bps: Option<u64>,
    /// Bytes/s along the load path (storage or host memory → GPU), for profiles derived
    /// from a tensor index.
    pub load_bps: f64,
    /// Execution seconds per weight byte of one request, for derived profiles.
    pub exec_s_per_byte: f64,
}

impl Default for PartitionConfig {
    /// The link from the hosts' NICs; load and execution rates from the thesis'
    /// calibration ([`Bandwidths::default`]).
    fn default() -> Self {
        let bw = Bandwidths::default();
        Self {
            link_bps: None,
            load_bps: bw.load_bps,
            exec_s_per_byte: bw.exec_s_per_byte,
        }
    }
}

impl PartitionConfig {
    /// The rates profiles are derived at, with the link at `link_bps`.
    pub fn bandwidths(&self, link_bps: f64) -> Bandwidths {
        Bandwidths {
            load_bps: self.load_bps,
            exec_s_per_byte: self.exec_s_per_byte,
            link_bps,
        }
    }
}

/// Where the link rate of a plan table came from (the `"link"` of `GetPartitionPlan`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkSource {
    /// `--partition-link-rate`.
    Setting,
    /// The slowest NIC rate the hosts report ([`slowest_nic`]).
    HostNics,
    /// `--default-nic-rate`: no up host reports a NIC rate.
    DefaultNicRate,
    /// The thesis' 10 Gbit/s ([`Bandwidths::default`]): nothing else is known.
    Thesis,
}

/// What [`slowest_nic`] needs to know of one host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostLink {
    /// The host is up.
    pub up: bool,
    /// Its reported NIC rate, bytes/s (0: unknown).
    pub nic_bps: u64,
    /// GPUs it reports.
    pub gpus: usize,
}

/// The slowest NIC among the up hosts that report one (a rate of 0 is unknown, not slow):
/// among those with GPUs when any has GPUs (partitions run on GPU hosts and hand their
/// activations to one another, so the slowest of their links bounds a plan), else among
/// all. `None` when no up host reports a rate.
pub fn slowest_nic(hosts: impl IntoIterator<Item = HostLink>) -> Option<u64> {
    let known: Vec<HostLink> = hosts
        .into_iter()
        .filter(|h| h.up && h.nic_bps > 0)
        .collect();
    let gpu_hosts = known.iter().filter(|h| h.gpus > 0).map(|h| h.nic_bps).min();
    gpu_hosts.or_else(|| known.iter().map(|h| h.nic_bps).min())
}

/// The link rate between partitions, bytes/s, and where it came from: `configured`
/// (`--partition-link-rate`), else the hosts' `slowest_nic`, else `default_nic_bps`
/// (`--default-nic-rate`; 0: none), else the thesis' 10 Gbit/s.
pub fn link_rate(
    configured: Option<u64>,
    slowest_nic: Option<u64>,
    default_nic_bps: u64,
) -> (f64, LinkSource) {
    match (configured, slowest_nic) {
        (Some(bps), _) if bps > 0 => (bps as f64, LinkSource::Setting),
        (_, Some(bps)) if bps > 0 => (bps as f64, LinkSource::HostNics),
        _ if default_nic_bps > 0 => (default_nic_bps as f64, LinkSource::DefaultNicRate),
        _ => (Bandwidths::default().link_bps, LinkSource::Thesis),
    }
}

/// The version of [`StoredPlans`] records written now.
pub const PLANS_RECORD_VERSION: &str = "1";

fn plans_record_version() -> String {
    PLANS_RECORD_VERSION.to_string()
}

/// What is stored for one model (table `partition_plans`), versioned: records written
/// before versions have none and read as version 1 (the same shape).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredPlans {
    /// [`PLANS_RECORD_VERSION`].
    #[serde(default = "plans_record_version")]
    pub version: String,
    /// Digest of the model the derived profile was read from.
    pub digest: String,
    /// The profile derived from a holder's tensor index (none with a registered profile).
    pub derived: Option<ModelProfile>,
    /// (profile, table) pairs, least recently used first.
    pub tables: Vec<(ModelProfile, PlanTable)>,
}

impl Default for StoredPlans {
    fn default() -> Self {
        Self {
            version: plans_record_version(),
            digest: String::new(),
            derived: None,
            tables: Vec::new(),
        }
    }
}

impl StoredPlans {
    /// Reads a stored record; a version this controller does not know is an error naming
    /// it (the tables are then computed again: they are a cache).
    pub fn read(bytes: &[u8]) -> Result<Self, crate::error::RecordError> {
        let p: Self = serde_json::from_slice(bytes)?;
        if p.version != PLANS_RECORD_VERSION {
            return Err(crate::error::RecordError::UnknownVersion {
                what: "partition-plan",
                found: p.version,
                reads: format!("{PLANS_RECORD_VERSION:?}"),
            });
        }
        Ok(p)
    }
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
            match StoredPlans::read(&bytes) {
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
        let decoded = bytes.map(StoredPlans::read);
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

/// What partition planning needs to know of a model from the registry and inventory.
#[derive(Debug, Clone)]
pub struct PartitionInputs {
    /// Model name.
    pub name: String,
    /// Manifest digest.
    pub digest: String,
    /// Its registered profile.
    pub profile: Option<ModelProfile>,
    /// A live host holding it in memory (to read its tensor index from).
    pub holder: Option<String>,
    /// The smallest GPU memory any host reports.
    pub smallest_gpu: Option<u64>,
    /// The slowest NIC rate the up hosts report ([`slowest_nic`]).
    pub slowest_nic: Option<u64>,
    /// The NIC rate assumed for hosts that report none (`--default-nic-rate`; 0: none).
    pub default_nic_bps: u64,
}

/// A model's profile and the cluster's figures its plans depend on.
#[derive(Debug, Clone)]
pub struct ModelPlanning {
    /// The model's name.
    pub name: String,
    /// Its profile: the registered one, else derived (estimated at the configured rates).
    pub profile: ModelProfile,
    /// The smallest GPU memory any host reports.
    pub smallest_gpu: Option<u64>,
    /// The link rate between partitions, bytes/s ([`link_rate`]).
    pub link_bps: f64,
    /// Where `link_bps` came from.
    pub link_from: LinkSource,
}

/// What the partition-plan service needs from the rest of the controller.
pub trait ModelSource: Send + Sync + 'static {
    /// The model's name, digest, registered profile, a holder, the smallest GPU and the
    /// hosts' NIC rates.
    fn partition_inputs(&self, key: &str) -> Result<PartitionInputs, PartitionError>;
    /// (name, bytes) of each tensor of `digest` as `host`'s hand-off describes them.
    fn tensor_index(
        &self,
        host: &str,
        digest: &str,
    ) -> impl Future<Output = Result<Vec<(String, u64)>, PartitionError>> + Send;
}

/// The partition-plan service: answers `GetPartitionPlan` and the plans bursts and the
/// autoscaler use, from the tables kept in the state store.
pub struct PartitionTables<M> {
    src: Arc<M>,
    store: Arc<dyn StateStore>,
    kept: PlanStore,
    cfg: PartitionConfig,
}

impl<M: ModelSource> PartitionTables<M> {
    /// The tables `store` holds, over `src`, planned at `cfg`'s rates.
    pub fn restore(
        src: Arc<M>,
        store: Arc<dyn StateStore>,
        cfg: PartitionConfig,
    ) -> Result<Self, StateError> {
        let kept = PlanStore::restore(store.as_ref())?;
        Ok(Self {
            src,
            store,
            kept,
            cfg,
        })
    }

    /// One stored record changed (a follower's view, `crate::ha`): `None` deleted it.
    pub fn apply_stored(&self, name: &str, bytes: Option<&[u8]>) {
        self.kept.apply_stored(name, bytes);
    }

    /// A model's profile: the registered one, else one derived from the tensor index of a
    /// live host holding it (marked estimated, at the configured load and execution rates;
    /// a stored one is re-estimated at them). With the model's name, the smallest GPU
    /// memory reported in the cluster and the link rate between partitions.
    pub async fn model_profile(&self, key: &str) -> Result<ModelPlanning, PartitionError> {
        let m = self.src.partition_inputs(key)?;
        let (link_bps, link_from) = link_rate(self.cfg.link_bps, m.slowest_nic, m.default_nic_bps);
        let bw = self.cfg.bandwidths(link_bps);
        let profile: ModelProfile = match m.profile.clone() {
            Some(p) => p,
            None => match self.kept.derived(&m.name, &m.digest) {
                Some(mut p) => {
                    // Stored at the rates of its day: the weights are what it keeps.
                    p.estimate_times(&bw);
                    p
                }
                None => {
                    let host = m
                        .holder
                        .as_deref()
                        .ok_or_else(|| PartitionError::NoProfileSource(m.name.clone()))?;
                    let tensors = self.src.tensor_index(host, &m.digest).await?;
                    if tensors.is_empty() {
                        return Err(PartitionError::NoTensors(m.name.clone()));
                    }
                    let p = profile::profile_from_tensors(&m.name, &tensors, &bw);
                    self.kept
                        .set_derived(self.store.as_ref(), &m.name, &m.digest, &p);
                    p
                }
            },
        };
        Ok(ModelPlanning {
            name: m.name,
            profile,
            smallest_gpu: m.smallest_gpu,
            link_bps,
            link_from,
        })
    }

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
    ) -> Result<(String, ModelProfile, PlanTable, bool), PartitionError> {
        let (m, table, stored) = self
            .planned(model, max_partitions, gpu_memory, max_queue)
            .await?;
        Ok((m.name, m.profile, table, stored))
    }

    /// [`plan_table`](Self::plan_table), with where the link rate came from.
    async fn planned(
        &self,
        model: &str,
        max_partitions: usize,
        gpu_memory: Option<u64>,
        max_queue: u32,
    ) -> Result<(ModelPlanning, PlanTable, bool), PartitionError> {
        let m = self.model_profile(model).await?;
        let gpu_memory = gpu_memory.unwrap_or(m.smallest_gpu.unwrap_or(DEFAULT_GPU_MEMORY));
        // Keyed by the link rate too: another rate (a slower host joined, a new setting)
        // never gets a table computed at the old one.
        if let Some(t) = self.kept.table(
            &m.name,
            &m.profile,
            max_partitions,
            gpu_memory,
            m.link_bps,
            max_queue,
        ) {
            return Ok((m, t, true));
        }
        let started = std::time::Instant::now();
        let table = partition::precompute(
            &m.profile,
            max_partitions,
            gpu_memory,
            m.link_bps,
            max_queue,
        )
        .map_err(|e| PartitionError::Unplannable(e.to_string()))?;
        info!(
            model = %m.name,
            max_partitions,
            gpu_memory,
            max_queue,
            link_bps = m.link_bps,
            link_from = ?m.link_from,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "partition plans computed and stored"
        );
        self.kept
            .put_table(self.store.as_ref(), &m.name, &m.profile, &table);
        Ok((m, table, false))
    }

    /// Computes and stores a registered model's default table (Flashpoint §4.2.2: plans
    /// are precomputed, not searched for when a burst needs one).
    pub async fn precompute(&self, model: &str) {
        if let Err(e) = self
            .plan_table(model, DEFAULT_MAX_PARTITIONS, None, table_queue(1))
            .await
        {
            warn!(model, "no partition plans for the registered profile: {e}");
        }
    }

    /// `GetPartitionPlan`.
    pub async fn partition_plan(
        &self,
        req: PartitionPlanQuery,
    ) -> Result<PartitionPlanAnswer, PartitionError> {
        let max_p = if req.max_partitions == 0 {
            DEFAULT_MAX_PARTITIONS
        } else {
            req.max_partitions as usize
        };
        let queue = req.queue.max(1);
        let (m, table, stored) = self
            .planned(
                &req.model,
                max_p,
                (req.gpu_memory > 0).then_some(req.gpu_memory),
                table_queue(queue),
            )
            .await?;
        let chosen = table.best_for(queue).cloned();
        let json = serde_json::json!({
            "model": m.name,
            "gpu_memory": table.gpu_memory,
            "link": {"bps": table.link_bps, "from": m.link_from},
            "queue": queue,
            "stored": stored,
            "chosen": chosen,
            "table": table,
            "profile": m.profile,
        });
        Ok(PartitionPlanAnswer {
            json: json.to_string(),
            estimated: m.profile.estimated,
        })
    }

    /// The partition plan a burst of `partitions` uses for `model` at `queue` requests,
    /// with the profile it came from.
    pub async fn burst_plan(
        &self,
        model: &str,
        partitions: u32,
        queue: u32,
    ) -> Result<(ModelProfile, PartitionPlan), PartitionError> {
        let (_, profile, table, _) = self
            .plan_table(model, partitions as usize, None, table_queue(queue))
            .await?;
        let plan = table
            .best_with_partitions(partitions as usize, queue.max(1))
            .ok_or_else(|| PartitionError::CannotSplit {
                model: model.to_string(),
                partitions,
                groups: profile.groups.len(),
            })?;
        Ok((profile, plan))
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

    fn host(up: bool, nic_bps: u64, gpus: usize) -> HostLink {
        HostLink { up, nic_bps, gpus }
    }

    #[test]
    fn the_slowest_nic_is_of_the_up_gpu_hosts_reporting_one() {
        let gbit = 1_000_000_000 / 8;
        // The slowest up GPU host bounds; a down host and an unknown (0) rate do not count.
        let hosts = [
            host(true, 400 * gbit, 8),
            host(true, 100 * gbit, 8),
            host(false, 10 * gbit, 8),
            host(true, 0, 8),
        ];
        assert_eq!(slowest_nic(hosts), Some(100 * gbit));
        // Hosts without GPUs run no partitions: a slow storage host does not bound...
        let with_storage = [host(true, 200 * gbit, 8), host(true, 25 * gbit, 0)];
        assert_eq!(slowest_nic(with_storage), Some(200 * gbit));
        // ...unless no host reporting a rate has GPUs.
        let no_gpus = [host(true, 200 * gbit, 0), host(true, 25 * gbit, 0)];
        assert_eq!(slowest_nic(no_gpus), Some(25 * gbit));
        let unknown_gpu = [host(true, 0, 8), host(true, 25 * gbit, 0)];
        assert_eq!(slowest_nic(unknown_gpu), Some(25 * gbit));
        // Nothing known.
        assert_eq!(slowest_nic([host(true, 0, 8), host(false, gbit, 8)]), None);
        assert_eq!(slowest_nic([]), None);
    }

    #[test]
    fn the_link_rate_falls_back_from_the_setting_to_the_hosts_to_the_defaults() {
        let thesis = Bandwidths::default().link_bps;
        assert_eq!(
            link_rate(Some(50e9 as u64), Some(12_500_000_000), 1_250_000_000),
            (50e9, LinkSource::Setting)
        );
        assert_eq!(
            link_rate(None, Some(12_500_000_000), 1_250_000_000),
            (12.5e9, LinkSource::HostNics)
        );
        assert_eq!(
            link_rate(None, None, 3_125_000_000),
            (3.125e9, LinkSource::DefaultNicRate)
        );
        assert_eq!(link_rate(None, Some(0), 0), (thesis, LinkSource::Thesis));
        assert_eq!(link_rate(Some(0), None, 0), (thesis, LinkSource::Thesis));
    }

    /// A model source whose hosts and holder can be changed, counting tensor-index reads.
    struct Source {
        inputs: Mutex<PartitionInputs>,
        index_reads: std::sync::atomic::AtomicUsize,
    }

    impl ModelSource for Source {
        fn partition_inputs(&self, _key: &str) -> Result<PartitionInputs, PartitionError> {
            Ok(self.inputs.lock().unwrap().clone())
        }

        async fn tensor_index(
            &self,
            _host: &str,
            _digest: &str,
        ) -> Result<Vec<(String, u64)>, PartitionError> {
            self.index_reads
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok((0..6u64)
                .map(|i| (format!("model.layers.{i}.mlp.weight"), 64 << 20))
                .collect())
        }
    }

    #[tokio::test]
    async fn a_changed_rate_never_serves_a_table_or_profile_computed_at_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn StateStore> =
            Arc::new(crate::state::RedbStore::open(&dir.path().join("s.redb")).unwrap());
        let src = Arc::new(Source {
            inputs: Mutex::new(PartitionInputs {
                name: "m".into(),
                digest: "d1".into(),
                profile: None,
                holder: Some("h1".into()),
                smallest_gpu: Some(16 << 30),
                slowest_nic: Some(50_000_000_000),
                default_nic_bps: 1_250_000_000,
            }),
            index_reads: Default::default(),
        });
        let tables =
            PartitionTables::restore(src.clone(), store.clone(), Default::default()).unwrap();
        let (_, p1, t1, stored) = tables.plan_table("m", 4, None, 64).await.unwrap();
        assert!(!stored);
        assert_eq!(t1.link_bps, 50e9);
        let calibrated = Bandwidths::default().load_bps;
        assert_eq!(p1.groups[0].load_s, (64 << 20) as f64 / calibrated);
        assert!(tables.plan_table("m", 4, None, 64).await.unwrap().3);
        // A slower GPU host joined: a new table at its rate, not the stored one.
        src.inputs.lock().unwrap().slowest_nic = Some(12_500_000_000);
        let (_, _, t2, stored) = tables.plan_table("m", 4, None, 64).await.unwrap();
        assert!(!stored);
        assert_eq!(t2.link_bps, 12.5e9);
        // The holder is gone and the controller restarts with new rates: the stored derived
        // profile is re-estimated at them (no tensor index needed), and the tables follow.
        src.inputs.lock().unwrap().holder = None;
        let cfg = PartitionConfig {
            link_bps: Some(25_000_000_000),
            load_bps: 40e9,
            exec_s_per_byte: 1.0 / 2e12,
        };
        let tables = PartitionTables::restore(src.clone(), store, cfg).unwrap();
        let (_, p3, t3, stored) = tables.plan_table("m", 4, None, 64).await.unwrap();
        assert!(!stored);
        assert_eq!(t3.link_bps, 25e9);
        assert_eq!(p3.groups[0].load_s, (64 << 20) as f64 / 40e9);
        assert_eq!(p3.groups[0].exec_s, (64 << 20) as f64 / 2e12);
        assert_eq!(src.index_reads.load(std::sync::atomic::Ordering::SeqCst), 1);
        let json = tables
            .partition_plan(PartitionPlanQuery {
                model: "m".into(),
                max_partitions: 4,
                gpu_memory: 0,
                queue: 1,
            })
            .await
            .unwrap()
            .json;
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(
            v["link"],
            serde_json::json!({"bps": 25e9, "from": "setting"})
        );
        assert_eq!(v["stored"], true, "{v}");
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

    #[test]
    fn records_are_versioned_and_unversioned_ones_still_load() {
        let old = serde_json::json!({"digest": "d1", "derived": null, "tables": []});
        let p = StoredPlans::read(old.to_string().as_bytes()).unwrap();
        assert_eq!(p.version, PLANS_RECORD_VERSION);
        let written = serde_json::to_value(StoredPlans::default()).unwrap();
        assert_eq!(written["version"], PLANS_RECORD_VERSION);
        let mut future = old;
        future["version"] = "3".into();
        let e = StoredPlans::read(future.to_string().as_bytes()).unwrap_err();
        assert!(e.to_string().contains("\"3\""), "{e}");
    }
}
