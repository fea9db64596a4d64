//! A host's GPUs as transferd uses them: the backend (CUDA when a driver is present,
//! simulated when asked for, none otherwise), one memory pool per GPU, the loads in flight
//! and the models resident, and their hand-offs.
//!
//! No GPU memory is taken at start: a model's region is allocated on each chosen GPU when
//! its load starts, within the host's [`GpuBudget`], and freed when the model is evicted or
//! its load fails. An inference engine on the same GPU keeps the rest.
//!
//! GPU choice is Torpor's Algorithm 1 (`shardcast_policies::gpu_choice`; siblings by NVLink
//! rate). Room is made by the heavy/light policy (`shardcast_policies::evict`): one replica
//! per model once full, then light and extra replicas, medium, heavy models with a GPU copy
//! on another host (`set_gpu_copies_elsewhere`, from the controller's heartbeat answers;
//! stale after its validity, when every model counts as the only copy), heavy, LRU. A GPU
//! region is never a cluster's last copy (`NOT_A_LAST_COPY`); loading and locked models
//! stay. Loads are idempotent (`start`, whole or partitioned) with states loading,
//! partition-live, resident and failed; `abort` when the data source fails; the hand-off
//! lists a partition's tensors only while a partition is live. [`GpuManager::busy_gpus`]:
//! GPUs without a model region where other processes hold at least [`BUSY_EXTERNAL_SHARE`],
//! chosen only when no other GPU has room. Registrations are kept across loads
//! (`release_unused_registrations`, `registered_host_bytes`) and made ahead of loads
//! (`register_ahead`, [`AheadState`] on / off / stopped for good after a refusal), only while
//! no load is copying (the driver serialises pinning with copies).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{info, warn};

use crate::cuda::{self, CudaOptions};
use crate::device::{Device, DeviceInfo, DeviceKind, GpuError, HostMemory};
use crate::handoff::{Handoff, HandoffDevice, HandoffShard};
use crate::index::{Layout, LoadMap, ShardRange, TensorEntry, tensor_index};
use crate::loader::{
    ChunkSource, HostPath, LoadOptions, LoadProgress, LoadReport, Target, load_map,
};
use crate::lock;
use crate::pool::{GpuPool, PoolError, REGION_ALIGN, Region};
use crate::sim::{self, SimOptions};
use shardcast_policies::evict::{self, ClusterCopies, GpuState, Heaviness};
use shardcast_policies::gpu_choice::{self, GpuLoadState, GpuNode, Topology};

/// Which backend to use.
#[derive(Debug, Clone)]
pub enum BackendChoice {
    /// CUDA if a driver is present, else no GPUs.
    Auto,
    /// CUDA; no driver means no GPUs (reported, not fatal).
    Cuda,
    /// Simulated devices.
    Simulated(SimOptions),
    /// No GPUs.
    None,
}

/// The most GPU memory this host may take on each GPU for model regions: an upper limit,
/// not a reservation (regions are allocated as models load and freed as they are evicted).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GpuBudget {
    /// A share of each GPU's memory, 0.01 to 1.
    Fraction(f64),
    /// Bytes on each GPU (at most its memory), at least one region ([`REGION_ALIGN`]).
    Bytes(u64),
}

impl Default for GpuBudget {
    /// 80% of each GPU: room for a few models while leaving a fifth of the GPU to the
    /// inference engine even when the host's regions fill their budget.
    fn default() -> Self {
        Self::Fraction(0.8)
    }
}

/// A budget that is not one (see [`GpuBudget`]'s `FromStr`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BudgetError(String);

impl GpuBudget {
    /// A share of the GPU, checked to lie in 0.01..=1.
    pub fn fraction(f: f64) -> Result<Self, BudgetError> {
        if (0.01..=1.0).contains(&f) {
            Ok(Self::Fraction(f))
        } else {
            Err(BudgetError(format!(
                "a GPU budget share must be between 0.01 and 1, got {f}"
            )))
        }
    }

    /// Bytes per GPU, checked to be at least one region.
    pub fn bytes(n: u64) -> Result<Self, BudgetError> {
        if n >= REGION_ALIGN {
            Ok(Self::Bytes(n))
        } else {
            Err(BudgetError(format!(
                "a GPU budget must be at least {REGION_ALIGN} bytes (one region), got {n}"
            )))
        }
    }

    /// The budget in bytes on a GPU of `memory_bytes`.
    pub fn bytes_of(&self, memory_bytes: u64) -> u64 {
        match *self {
            Self::Fraction(f) => (memory_bytes as f64 * f.clamp(0.0, 1.0)) as u64,
            Self::Bytes(n) => n.min(memory_bytes),
        }
    }
}

impl std::str::FromStr for GpuBudget {
    type Err = BudgetError;

    /// `0.8` or `80%` (a share of each GPU's memory), or a size per GPU such as `60GiB`.
    fn from_str(s: &str) -> Result<Self, BudgetError> {
        let t = s.trim();
        if let Some(pct) = t.strip_suffix('%') {
            let p: f64 = pct
                .trim()
                .parse()
                .map_err(|_| BudgetError(format!("invalid GPU budget {s:?}: expected e.g. 80%")))?;
            return Self::fraction(p / 100.0);
        }
        if let Ok(f) = t.parse::<f64>() {
            if f > 1.0 {
                return Err(BudgetError(format!(
                    "invalid GPU budget {s:?}: a bare number is a share of the GPU (0.01 to 1); give a size with its unit, e.g. 60GiB"
                )));
            }
            return Self::fraction(f);
        }
        let n = shardcast_protocol::units::parse_size(t)
            .map_err(|e| BudgetError(format!("invalid GPU budget: {e}; or a share, e.g. 0.8")))?;
        Self::bytes(n)
    }
}

impl std::fmt::Display for GpuBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fraction(x) => write!(f, "{}% of each GPU", (x * 10_000.0).round() / 100.0),
            Self::Bytes(n) => write!(f, "{n} bytes per GPU"),
        }
    }
}

/// Manager settings.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// Backend.
    pub backend: BackendChoice,
    /// CUDA options.
    pub cuda: CudaOptions,
    /// The most each GPU's regions may take together. Nothing is allocated at start: a
    /// region is allocated when its model loads and freed when it is evicted, so the rest
    /// of the GPU stays with inference processes.
    pub budget: GpuBudget,
    /// Loader settings. `load.staging_size == 0` means "auto": calibrated at start-up on
    /// CUDA (the elbow of host → device throughput vs. transfer size, Torpor §4.3), 4 MiB on
    /// simulated devices.
    pub load: LoadOptions,
    /// When a new model does not fit a chosen GPU, evict resident models by the GPU
    /// eviction policy (Torpor §5.4: light models and extra replicas first, LRU; locked and
    /// loading models never) instead of refusing the load.
    pub auto_evict: bool,
    /// Register host memory handed to [`GpuManager::register_ahead`] (transferd: the memory
    /// tier's complete shards) while no load runs, so the first GPU load of a model already
    /// in RAM does not pay for pinning it. Only with `load.register_host`.
    pub register_ahead: bool,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            backend: BackendChoice::Auto,
            cuda: CudaOptions::default(),
            budget: GpuBudget::default(),
            load: LoadOptions::default(),
            auto_evict: true,
            register_ahead: true,
        }
    }
}

/// State of a model on the GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadState {
    /// Copies in flight.
    Loading,
    /// A partitioned load whose partition is on every chosen GPU (usable through the
    /// hand-off) while model completion still copies the rest.
    #[serde(rename = "partition-live")]
    PartitionLive,
    /// Every byte on every chosen GPU.
    Resident,
    /// The load failed (the message says why); the regions were freed.
    Failed(String),
}

/// A partitioned load (Flashpoint §4.2.5): the partition's tensors first, then, with
/// completion, the rest of the model in the background until the GPUs hold a full replica.
#[derive(Debug, Clone)]
pub struct PartitionLoad {
    /// Label shown in status and hand-offs (e.g. `2/4 model.layers.8-15`).
    pub label: String,
    /// Byte ranges of the partition's tensors (see [`crate::index::tensor_ranges`]).
    pub ranges: Vec<ShardRange>,
    /// Keep loading until a full replica (else the region holds the partition only).
    pub complete: bool,
    /// The model's tensor index over its full [`Layout`] (the caller read the headers to
    /// pick the ranges); hand-offs list the tensors present from it.
    pub index: Vec<TensorEntry>,
}

/// A partition's progress in [`ModelGpuStatus`].
#[derive(Debug, Clone, Serialize)]
pub struct PartitionStatus {
    /// Label.
    pub label: String,
    /// Bytes of the partition.
    pub bytes: u64,
    /// Seconds from the start until the partition was on every GPU.
    pub live_s: Option<f64>,
    /// Whether the rest of the model follows.
    pub complete: bool,
}

struct ModelLoad {
    name: String,
    gpus: Vec<u32>,
    layout: Layout,
    map: LoadMap,
    partition: Option<PartitionLoad>,
    abort: Option<String>,
    progress: Arc<LoadProgress>,
    state: LoadState,
    report: Option<LoadReport>,
    index: Option<Vec<TensorEntry>>,
    files: Vec<String>,
    started: Instant,
    heaviness: Heaviness,
    last_used: Instant,
}

/// What to load, for [`GpuManager::start`].
#[derive(Debug, Clone)]
pub struct LoadRequest {
    /// Model key (hex digest).
    pub model: String,
    /// Model name.
    pub name: String,
    /// GPUs wanted (0 counts as 1) when `gpus` is empty.
    pub count: usize,
    /// Exactly these GPUs.
    pub gpus: Vec<u32>,
    /// The store files behind the shards (for memory-file hand-offs).
    pub files: Vec<String>,
    /// A partitioned load.
    pub partition: Option<PartitionLoad>,
    /// How much an inference would suffer from loading the model over PCIe (from the
    /// model's profile; `Medium` when unknown). Drives GPU choice and eviction order.
    pub heaviness: Heaviness,
}

/// A model evicted from a GPU to make room, with the reason.
#[derive(Debug, Clone, Serialize)]
pub struct Eviction {
    /// GPU.
    pub gpu: u32,
    /// Model key.
    pub model: String,
    /// Why.
    pub reason: String,
}

/// One model's GPU status.
#[derive(Debug, Clone, Serialize)]
pub struct ModelGpuStatus {
    /// Model key (hex digest).
    pub model: String,
    /// Model name.
    pub name: String,
    /// State.
    pub state: LoadState,
    /// (GPU, bytes landed, total) per chosen GPU.
    pub gpus: Vec<(u32, u64, u64)>,
    /// Seconds since the load started (or its duration once done).
    pub elapsed_s: f64,
    /// Set for a partitioned load.
    pub partition: Option<PartitionStatus>,
    /// How the finished load moved bytes host → GPU (`None` while loading).
    pub host_path: Option<HostPath>,
    /// Why the staging ring ran instead of the registered path.
    pub fallback_reason: Option<String>,
    /// Seconds spent registering the shard mappings (0 on the staging path).
    pub register_s: f64,
    /// Registration segments the finished load copied from (registered path).
    pub segments: usize,
    /// Of those, the ones it found registered already (kept from an earlier load, or
    /// registered ahead): it did not pin them.
    pub segments_reused: usize,
}

/// One GPU's pool, for status.
#[derive(Debug, Clone, Serialize)]
pub struct PoolStatus {
    /// GPU.
    pub gpu: u32,
    /// The most this host may take on it, bytes (a cap, not a reservation).
    pub budget: u64,
    /// Bytes of the live regions (allocated on the device).
    pub used: u64,
    /// Bytes a new region could get now: the budget's room, lowered to the device's free
    /// memory when other processes hold more of it.
    pub free: u64,
    /// The regions, one per model.
    pub regions: Vec<Region>,
}

/// Why a manager operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// No GPUs on this host (the reason, e.g. "no CUDA driver").
    #[error("no GPUs on this host: {0}")]
    NoGpus(String),
    /// More GPUs asked for than exist.
    #[error("{requested} GPUs asked for, this host has {available}")]
    TooMany {
        /// Asked.
        requested: usize,
        /// Present.
        available: usize,
    },
    /// A GPU index that does not exist.
    #[error("GPU {0} does not exist on this host")]
    NoSuchGpu(u32),
    /// Pool error (out of memory, locked).
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The model is not on the GPUs.
    #[error("model {0} is not loaded on any GPU")]
    NotLoaded(String),
    /// Still loading.
    #[error("model {0} is still loading")]
    Busy(String),
    /// Device error.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// The GPUs of one host.
pub struct GpuManager {
    devices: Vec<Arc<dyn Device>>,
    pools: Vec<Mutex<GpuPool>>,
    loads: Mutex<HashMap<String, ModelLoad>>,
    opts: LoadOptions,
    note: String,
    auto_evict: bool,
    epoch: Instant,
    evictions: Mutex<Vec<Eviction>>,
    /// Registering ahead of loads: on, off, or stopped (the device refused it).
    ahead: Mutex<AheadState>,
    /// Models another host holds resident on its GPUs, as the controller last said.
    elsewhere: Mutex<GpuCopiesElsewhere>,
    /// Told of every load that ends ([`GpuManager::observe_loads`]).
    observer: std::sync::OnceLock<LoadObserver>,
}

/// Called once per load that ends: `Some(seconds)` (the load's own elapsed time) when the
/// model became resident, `None` when it failed or was cancelled. Runs on the load's thread.
pub type LoadObserver = Box<dyn Fn(Option<f64>) + Send + Sync>;

/// What the controller last said about GPU copies on other hosts, and until when it holds.
#[derive(Debug, Default)]
struct GpuCopiesElsewhere {
    digests: HashSet<String>,
    /// Past this, the answer is stale (the controller went silent): every model counts as
    /// the only GPU copy again, the cautious default of a host without a controller.
    until: Option<Instant>,
}

/// Whether [`GpuManager::register_ahead`] registers anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AheadState {
    /// Off: by configuration, with no devices, or with `register_host` off.
    Off,
    /// On.
    On,
    /// Stopped after the device refused a registration (the reason); loads still register
    /// what they copy, or fall back to staging.
    Stopped(String),
}

impl std::fmt::Display for AheadState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::On => f.write_str("on"),
            Self::Stopped(why) => write!(f, "stopped: {why}"),
        }
    }
}

/// What one [`GpuManager::register_ahead`] pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AheadReport {
    /// Mappings now registered whole (including those registered before).
    pub complete: usize,
    /// Segments registered by this pass.
    pub segments: usize,
    /// Bytes registered by this pass.
    pub bytes: u64,
    /// The pass stopped early: a load started (or `stop` was set).
    pub paused: bool,
}

/// Evictions remembered for status.
const EVICTIONS_KEPT: usize = 100;

/// The share of a GPU's memory other processes must hold for the GPU to count as busy
/// ([`GpuManager::busy_gpus`]): half, well below what an inference engine takes and well
/// above a CUDA context or a monitoring tool.
pub const BUSY_EXTERNAL_SHARE: f64 = 0.5;

/// The last-copy input of GPU eviction: a GPU region is never a last copy (it serves no
/// chain or reader; the host's tiers or the origin keep the data, and the tiers' own
/// eviction protects last copies).
const NOT_A_LAST_COPY: ClusterCopies = ClusterCopies {
    copies_in_cluster: 2,
    registered: true,
    origin_available: true,
};

impl GpuManager {
    /// Opens the backend. Never fails for lack of GPUs: a host without them gets a manager
    /// with no devices and a note saying why.
    pub fn open(cfg: &ManagerConfig) -> Self {
        let mut opts = cfg.load.clone();
        // Shard mappings stay registered between loads while the memory tier holds them
        // (see `RegistrationCache`): only a mapping's first load pays for pinning it.
        if opts.register_host && opts.registrations.is_none() {
            opts.registrations = Some(crate::loader::RegistrationCache::new());
        }
        let mut calibrated = None;
        let (devices, note): (Vec<Arc<dyn Device>>, String) = match &cfg.backend {
            BackendChoice::None => (Vec::new(), "GPU loading disabled".into()),
            BackendChoice::Simulated(o) => match sim::devices(o) {
                Ok(d) => (
                    d.into_iter().map(|d| d as Arc<dyn Device>).collect(),
                    format!("{} SIMULATED GPUs (not real hardware)", o.gpus),
                ),
                Err(e) => (Vec::new(), format!("simulated GPUs failed: {e}")),
            },
            BackendChoice::Auto | BackendChoice::Cuda => match cuda::devices(&cfg.cuda) {
                Ok(d) if d.is_empty() => (Vec::new(), "CUDA driver present, no devices".into()),
                Ok(d) => {
                    let n = d.len();
                    if opts.staging_size == 0
                        && let Some(first) = d.first()
                    {
                        match cuda::calibrate(first, &cuda::default_sizes(), 64 << 20) {
                            Ok(c) => {
                                info!(
                                    elbow = c.elbow,
                                    write_combined_gbps = c.write_combined_bps / 1e9,
                                    portable_gbps = c.portable_bps / 1e9,
                                    "calibrated the staging size"
                                );
                                calibrated = Some(c.elbow);
                            }
                            Err(e) => warn!("calibration failed, using 4 MiB: {e}"),
                        }
                    }
                    (
                        d.into_iter().map(|d| d as Arc<dyn Device>).collect(),
                        format!("{n} CUDA GPUs"),
                    )
                }
                Err(e) => (Vec::new(), e.to_string()),
            },
        };
        // No memory is allocated here: only each pool's cap is set.
        let pools: Vec<Mutex<GpuPool>> = devices
            .iter()
            .map(|d| {
                let pool = GpuPool::new(d.clone(), cfg.budget.bytes_of(d.info().memory_bytes));
                if pool.budget() == 0 {
                    warn!(
                        gpu = d.info().index,
                        budget = %cfg.budget,
                        "the GPU budget is smaller than one region: no model can load on this GPU"
                    );
                }
                Mutex::new(pool)
            })
            .collect();
        if opts.staging_size == 0 {
            opts.staging_size = calibrated.unwrap_or(4 << 20);
        }
        let ahead = if cfg.register_ahead
            && opts.register_host
            && opts.registrations.is_some()
            && !devices.is_empty()
        {
            AheadState::On
        } else {
            AheadState::Off
        };
        info!(
            gpus = devices.len(),
            staging_size = opts.staging_size,
            register_ahead = %ahead,
            budget = %cfg.budget,
            "{note}; no GPU memory reserved ahead"
        );
        Self {
            devices,
            pools,
            loads: Mutex::default(),
            opts,
            note,
            auto_evict: cfg.auto_evict,
            epoch: Instant::now(),
            evictions: Mutex::default(),
            ahead: Mutex::new(ahead),
            elsewhere: Mutex::default(),
            observer: std::sync::OnceLock::new(),
        }
    }

    /// Sets what is told of every load that ends (the daemon's metrics). Only the first
    /// call takes effect: `false` when an observer was set already.
    pub fn observe_loads(&self, f: LoadObserver) -> bool {
        self.observer.set(f).is_ok()
    }

    /// Whether registering ahead of loads is on, off or stopped.
    pub fn ahead_state(&self) -> AheadState {
        lock(&self.ahead).clone()
    }

    /// Bytes of host memory kept registered (pinned) for loads.
    pub fn registered_host_bytes(&self) -> u64 {
        self.opts
            .registrations
            .as_ref()
            .map_or(0, |c| c.registered_bytes())
    }

    /// Whether a load is copying (registering now would delay its copies: the driver
    /// serialises pinning with them).
    fn loading(&self) -> bool {
        lock(&self.loads)
            .values()
            .any(|l| l.state == LoadState::Loading)
    }

    /// Registers `memories` (name, memory) with the GPUs and keeps the registrations, segment
    /// by segment as loads cut them, so later loads of them copy without pinning first.
    /// Pauses (returns early, `paused`) when a load is running or `stop` is set; the next
    /// call goes on where this one stopped. A refusal by the device stops registering ahead
    /// for good (logged, and reported by [`GpuManager::ahead_state`]). Blocking: run it off
    /// any async runtime.
    pub fn register_ahead(
        &self,
        memories: &[(String, Arc<dyn HostMemory>)],
        stop: &AtomicBool,
    ) -> AheadReport {
        let mut report = AheadReport::default();
        let (Some(cache), Some(device)) = (self.opts.registrations.as_ref(), self.devices.first())
        else {
            return report;
        };
        if self.ahead_state() != AheadState::On {
            return report;
        }
        let pause = || stop.load(Ordering::Relaxed) || self.loading();
        for (name, memory) in memories {
            if pause() {
                report.paused = true;
                return report;
            }
            match cache.register_ahead(memory, self.opts.register_segment, &**device, &pause) {
                Ok(done) => {
                    report.segments += done.segments;
                    report.bytes += done.bytes;
                    if !done.complete {
                        report.paused = true;
                        return report;
                    }
                    report.complete += 1;
                }
                Err(e) => {
                    let why = format!("registering {name}: {e}");
                    warn!(
                        reason = %why,
                        "registering the memory tier with the GPUs ahead of loads stopped; loads register what they copy"
                    );
                    *lock(&self.ahead) = AheadState::Stopped(why);
                    return report;
                }
            }
        }
        report
    }

    /// Unregisters the host memory kept registered for loads (shard mappings) that nobody
    /// but the manager holds any more (the store dropped the shard); returns the bytes.
    /// Call it now and then: until then those pages stay pinned.
    pub fn release_unused_registrations(&self) -> u64 {
        self.opts.registrations.as_ref().map_or(0, |c| c.sweep())
    }

    /// What the backend found (or why nothing).
    pub fn note(&self) -> &str {
        &self.note
    }

    /// The devices.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.devices.iter().map(|d| d.info().clone()).collect()
    }

    /// One device, by GPU index (for its allocation counters; tests reach the simulated
    /// device through it).
    pub fn device(&self, gpu: u32) -> Option<Arc<dyn Device>> {
        self.devices.iter().find(|d| d.info().index == gpu).cloned()
    }

    /// GPUs that other processes mostly hold and that hold no model of this manager: at
    /// least [`BUSY_EXTERNAL_SHARE`] of the device's memory is neither free nor this
    /// manager's (an inference engine runs there: vLLM, for one, claims 90% of a GPU by
    /// default). A GPU with a model region is left out: an engine there serves the replica
    /// the controller placed, which its reservation already counts. A device whose free
    /// memory cannot be read counts as not busy. What the host reports as `gpus_busy`, so
    /// that placement does not count these GPUs as free slots.
    pub fn busy_gpus(&self) -> Vec<u32> {
        self.devices
            .iter()
            .filter(|d| {
                if d.allocated_bytes() > 0 {
                    return false;
                }
                let total = d.info().memory_bytes;
                let Ok(free) = d.free_memory() else {
                    return false;
                };
                let others = total
                    .saturating_sub(free)
                    .saturating_sub(d.allocated_bytes());
                total > 0 && others as f64 >= BUSY_EXTERNAL_SHARE * total as f64
            })
            .map(|d| d.info().index)
            .collect()
    }

    /// Each GPU's pool: budget, use and regions.
    pub fn pools(&self) -> Vec<PoolStatus> {
        self.pools
            .iter()
            .map(|p| {
                let p = lock(p);
                PoolStatus {
                    gpu: p.device().info().index,
                    budget: p.budget(),
                    used: p.used(),
                    free: p.free(),
                    regions: p.regions(),
                }
            })
            .collect()
    }

    /// The topology as the GPU-choice policy sees it: PCIe switches numbered in order of
    /// appearance (an unknown switch is a switch of its own), NVLink rates in GB/s (1 when
    /// the rate is unknown).
    fn topology(&self) -> Topology {
        let mut switches: Vec<String> = Vec::new();
        let gpus = self
            .devices
            .iter()
            .map(|d| {
                let info = d.info();
                let switch = if info.pcie_switch.is_empty() {
                    1_000_000 + info.index
                } else {
                    match switches.iter().position(|s| *s == info.pcie_switch) {
                        Some(i) => i as u32,
                        None => {
                            switches.push(info.pcie_switch.clone());
                            (switches.len() - 1) as u32
                        }
                    }
                };
                GpuNode {
                    index: info.index,
                    pcie_switch: switch,
                    nvlink: info
                        .peers
                        .iter()
                        .map(|&(p, bps)| (p, if bps == 0 { 1.0 } else { bps as f64 / 1e9 }))
                        .collect(),
                }
            })
            .collect();
        Topology { gpus }
    }

    /// What each GPU holds and loads now, for the GPU-choice policy. The manager does not
    /// see inference: a GPU counts as idle unless it is loading.
    fn load_states(&self) -> Vec<GpuLoadState> {
        let loads = lock(&self.loads);
        self.pools
            .iter()
            .map(|p| {
                let p = lock(p);
                let gpu = p.device().info().index;
                let on_gpu = |l: &&ModelLoad| l.gpus.contains(&gpu);
                let loading = loads
                    .iter()
                    .find(|(_, l)| on_gpu(l) && l.state == LoadState::Loading)
                    .map(|(k, l)| (k.clone(), l.heaviness));
                GpuLoadState {
                    gpu,
                    idle: loading.is_none(),
                    free_bytes: p.free(),
                    holds: loads
                        .iter()
                        .filter(|(_, l)| on_gpu(l) && l.state == LoadState::Resident)
                        .map(|(k, _)| k.clone())
                        .collect(),
                    loading,
                }
            })
            .collect()
    }

    /// Picks GPUs (indices into `devices`): explicit ones as given; else the first by
    /// Torpor's Algorithm 1 (a GPU whose PCIe-switch neighbour is not loading a heavy
    /// model, …) among the GPUs that are not busy ([`Self::busy_gpus`]), then among all,
    /// falling back to the most free memory when no GPU has room (eviction follows); then
    /// siblings: not busy first, then by NVLink rate to the first, then free memory.
    fn choose(
        &self,
        count: usize,
        explicit: &[u32],
        model: &str,
        bytes: u64,
        heaviness: Heaviness,
    ) -> Result<(Vec<usize>, String), ManagerError> {
        if self.devices.is_empty() {
            return Err(ManagerError::NoGpus(self.note.clone()));
        }
        let pos = |g: u32| self.devices.iter().position(|d| d.info().index == g);
        if !explicit.is_empty() {
            let chosen = explicit
                .iter()
                .map(|&g| pos(g).ok_or(ManagerError::NoSuchGpu(g)))
                .collect::<Result<_, _>>()?;
            return Ok((chosen, "GPUs named in the request".into()));
        }
        let count = count.max(1);
        if count > self.devices.len() {
            return Err(ManagerError::TooMany {
                requested: count,
                available: self.devices.len(),
            });
        }
        let topo = self.topology();
        let states = self.load_states();
        let free = |i: usize| lock(&self.pools[i]).free();
        // GPUs another process mostly holds (an engine runs there) are chosen only when no
        // other GPU will do.
        let busy: HashSet<u32> = self.busy_gpus().into_iter().collect();
        let is_busy = |i: usize| busy.contains(&self.devices[i].info().index);
        let not_busy: Vec<GpuLoadState> = states
            .iter()
            .filter(|s| !busy.contains(&s.gpu))
            .cloned()
            .collect();
        let choice = match gpu_choice::choose_gpu(&topo, &not_busy, model, bytes, heaviness) {
            Some(mut c) if !busy.is_empty() => {
                c.reason = format!("{} (busy GPUs {busy:?} left alone)", c.reason);
                Some(c)
            }
            Some(c) => Some(c),
            None => gpu_choice::choose_gpu(&topo, &states, model, bytes, heaviness),
        };
        let (first, reason) = match choice {
            Some(c) => match pos(c.gpu) {
                Some(i) => (i, c.reason),
                None => (0, "policy chose an unknown GPU; first GPU".into()),
            },
            None => {
                let i = (0..self.devices.len())
                    .max_by(|&a, &b| free(a).cmp(&free(b)).then(b.cmp(&a)))
                    .unwrap_or(0);
                (
                    i,
                    "no GPU has room: the one with the most free memory (eviction follows)".into(),
                )
            }
        };
        let first_gpu = self.devices[first].info().index;
        let mut rest: Vec<usize> = (0..self.devices.len()).filter(|&i| i != first).collect();
        rest.sort_by(|&a, &b| {
            let link = |i: usize| {
                topo.nvlink_gbps(first_gpu, self.devices[i].info().index)
                    .unwrap_or(0.0)
            };
            is_busy(a)
                .cmp(&is_busy(b))
                .then(link(b).total_cmp(&link(a)))
                .then(free(b).cmp(&free(a)))
                .then(a.cmp(&b))
        });
        let mut chosen = vec![first];
        chosen.extend(rest.into_iter().take(count - 1));
        Ok((chosen, reason))
    }

    /// Records which of this host's GPU models another host holds resident on its GPUs
    /// (the controller's answer to a heartbeat), valid for `valid_for`: a heavy model with
    /// a GPU copy elsewhere is evicted before a heavy model that is the only one. Without an
    /// answer, or once it is stale, every model counts as the only GPU copy.
    pub fn set_gpu_copies_elsewhere(
        &self,
        digests: impl IntoIterator<Item = String>,
        valid_for: Duration,
    ) {
        let mut e = lock(&self.elsewhere);
        e.digests = digests.into_iter().collect();
        e.until = Instant::now().checked_add(valid_for);
    }

    /// Whether another host holds `model` resident on its GPUs, as far as this host knows
    /// now.
    pub fn gpu_copy_elsewhere(&self, model: &str) -> bool {
        let e = lock(&self.elsewhere);
        e.until.is_some_and(|t| Instant::now() < t) && e.digests.contains(model)
    }

    /// Makes room for `bytes` on GPU slot `i` by the eviction policy: first the
    /// one-replica-per-model rule once the host's GPUs are full, then light models and
    /// extra replicas, medium, heavy with a GPU copy on another host, heavy that is the
    /// only GPU copy (LRU within each class). Loading and locked models stay. A GPU region
    /// is never the last copy of a model: it serves no chain or reader, and the data stays
    /// in the host's tiers or at the origin, whose own eviction protects last copies; so
    /// last-copy protection ([`NOT_A_LAST_COPY`]) does not apply here.
    fn make_room(
        &self,
        i: usize,
        bytes: u64,
        for_model: &str,
    ) -> Result<Vec<Eviction>, evict::EvictError> {
        let states: Vec<GpuState> = {
            let loads = lock(&self.loads);
            self.pools
                .iter()
                .map(|p| {
                    let p = lock(p);
                    let gpu = p.device().info().index;
                    GpuState {
                        gpu,
                        // What the regions may take now: the budget, or less when other
                        // processes hold the device's memory (so eviction frees enough for
                        // the device to accept the new region).
                        capacity: p.used() + p.free(),
                        models: p
                            .regions()
                            .into_iter()
                            .filter(|r| r.model != for_model)
                            .map(|r| {
                                let l = loads.get(&r.model);
                                evict::GpuModel {
                                    replicas_on_host: l.map_or(1, |l| l.gpus.len() as u32),
                                    heaviness: l.map_or(Heaviness::Medium, |l| l.heaviness),
                                    last_used_s: l.map_or(0.0, |l| {
                                        l.last_used.duration_since(self.epoch).as_secs_f64()
                                    }),
                                    locked: r.locks > 0
                                        || l.is_none_or(|l| l.state == LoadState::Loading),
                                    only_gpu_copy_in_cluster: !self.gpu_copy_elsewhere(&r.model),
                                    copies: NOT_A_LAST_COPY,
                                    bytes: r.len,
                                    model: r.model,
                                }
                            })
                            .collect(),
                    }
                })
                .collect()
        };
        let mut victims: Vec<(u32, String, String)> = evict::one_replica_rule(&states)
            .into_iter()
            .map(|(g, m)| {
                (
                    g,
                    m,
                    "one replica per model once the host's GPUs are full".into(),
                )
            })
            .collect();
        let target = &states[i];
        let mut rest = target.clone();
        rest.models.retain(|m| {
            !victims
                .iter()
                .any(|(g, v, _)| *g == target.gpu && *v == m.model)
        });
        let more = evict::choose_gpu_evictions(&rest, bytes)?;
        for m in more {
            let class = rest
                .models
                .iter()
                .find(|x| x.model == m)
                .map(|x| format!("{:?}", x.heaviness).to_lowercase())
                .unwrap_or_default();
            victims.push((
                target.gpu,
                m,
                format!("{class} model, least recently used, to fit {for_model}"),
            ));
        }
        let mut done = Vec::new();
        for (gpu, model, reason) in victims {
            if self.evict_from(gpu, &model).is_ok() {
                info!(gpu, model = %model, "evicted: {reason}");
                done.push(Eviction { gpu, model, reason });
            }
        }
        let mut ev = lock(&self.evictions);
        ev.extend(done.iter().cloned());
        let n = ev.len();
        if n > EVICTIONS_KEPT {
            ev.drain(..n - EVICTIONS_KEPT);
        }
        Ok(done)
    }

    /// Frees `model`'s region on one GPU (the others keep theirs).
    fn evict_from(&self, gpu: u32, model: &str) -> Result<(), ManagerError> {
        let mut loads = lock(&self.loads);
        if let Some(l) = loads.get(model)
            && l.state == LoadState::Loading
        {
            return Err(ManagerError::Busy(model.to_string()));
        }
        let i = self
            .devices
            .iter()
            .position(|d| d.info().index == gpu)
            .ok_or(ManagerError::NoSuchGpu(gpu))?;
        lock(&self.pools[i]).evict(model)?;
        if let Some(l) = loads.get_mut(model) {
            l.gpus.retain(|&g| g != gpu);
            if l.gpus.is_empty() {
                loads.remove(model);
            }
        }
        Ok(())
    }

    /// Recent evictions made to fit new models, oldest first.
    pub fn evictions(&self) -> Vec<Eviction> {
        lock(&self.evictions).clone()
    }

    /// Starts loading `model` onto `count` GPUs (or the `explicit` ones) from `source`. A
    /// model already loading or resident is not loaded again: the GPUs it is on are
    /// returned. Device out-of-memory is an error and reserves nothing.
    pub fn start_load(
        self: &Arc<Self>,
        model: &str,
        name: &str,
        source: Arc<dyn ChunkSource>,
        count: usize,
        explicit: &[u32],
        files: Vec<String>,
    ) -> Result<Vec<u32>, ManagerError> {
        self.start(
            LoadRequest {
                model: model.to_string(),
                name: name.to_string(),
                count,
                gpus: explicit.to_vec(),
                files,
                partition: None,
                heaviness: Heaviness::Medium,
            },
            source,
        )
    }

    /// Starts a load: the whole model, or a partition first (and the rest after it when
    /// `partition.complete`). GPUs are chosen by the GPU-choice policy unless named; when
    /// the model does not fit a chosen GPU, resident models are evicted by the eviction
    /// policy (see [`ManagerConfig::auto_evict`]). A model already loading or resident is
    /// not loaded again, whatever its partition: its GPUs are returned.
    pub fn start(
        self: &Arc<Self>,
        req: LoadRequest,
        source: Arc<dyn ChunkSource>,
    ) -> Result<Vec<u32>, ManagerError> {
        let LoadRequest {
            model,
            name,
            count,
            gpus: explicit,
            files,
            partition,
            heaviness,
        } = req;
        let (model, name) = (model.as_str(), name.as_str());
        {
            let loads = lock(&self.loads);
            if let Some(l) = loads.get(model)
                && !matches!(l.state, LoadState::Failed(_))
            {
                return Ok(l.gpus.clone());
            }
        }
        let layout = Layout::of_source(source.shards());
        let map = match &partition {
            Some(p) => LoadMap::partition(&layout, &p.ranges, p.complete),
            None => LoadMap::full(&layout),
        };
        let (chosen, why) = self.choose(count, &explicit, model, map.region, heaviness)?;
        // Allocate every region first; on failure free what was allocated.
        let charge = GpuPool::charge(map.region)
            .ok_or_else(|| GpuError::Invalid(format!("a region of {} bytes", map.region)))?;
        let mut targets = Vec::new();
        for &i in &chosen {
            let mut r = lock(&self.pools[i]).reserve(model, map.region);
            if self.auto_evict
                && matches!(
                    r,
                    Err(PoolError::OverBudget { .. } | PoolError::Gpu(GpuError::OutOfMemory { .. }))
                )
            {
                match self.make_room(i, charge, model) {
                    Ok(ev) if !ev.is_empty() => r = lock(&self.pools[i]).reserve(model, map.region),
                    Ok(_) => {}
                    Err(e) => warn!(model, "nothing can be evicted to fit it: {e}"),
                }
            }
            match r {
                Ok(span) => targets.push(Target {
                    device: self.devices[i].clone(),
                    span,
                }),
                Err(e) => {
                    for t in &targets {
                        self.release(t.device.info().index, model);
                    }
                    return Err(e.into());
                }
            }
        }
        // Locked while copies (to siblings) are in flight.
        for &i in &chosen {
            let _ = lock(&self.pools[i]).lock(model);
        }
        let gpus: Vec<u32> = targets.iter().map(|t| t.device.info().index).collect();
        let progress = Arc::new(LoadProgress::with_first(map.bytes, map.first_bytes, &gpus));
        lock(&self.loads).insert(
            model.to_string(),
            ModelLoad {
                name: name.to_string(),
                gpus: gpus.clone(),
                layout: layout.clone(),
                map: map.clone(),
                partition: partition.clone(),
                abort: None,
                progress: progress.clone(),
                state: LoadState::Loading,
                report: None,
                index: None,
                files,
                started: Instant::now(),
                heaviness,
                last_used: Instant::now(),
            },
        );
        let kinds: Vec<DeviceKind> = targets.iter().map(|t| t.device.info().kind).collect();
        info!(
            model,
            ?gpus,
            ?kinds,
            bytes = map.bytes,
            region = map.region,
            partition = partition.as_ref().map(|p| p.label.as_str()),
            choice = %why,
            "GPU load started"
        );
        let me = self.clone();
        let model = model.to_string();
        let opts = self.opts.clone();
        std::thread::Builder::new()
            .name("gpu-load".into())
            .spawn(move || {
                let r = load_map(&*source, &layout, &map, &targets, &opts, &progress);
                for &i in &chosen {
                    lock(&me.pools[i]).unlock(&model);
                }
                let index = r.as_ref().ok().filter(|_| partition.is_none()).and_then(|_| {
                    tensor_index(&layout, |s, off, len| {
                        let mut b = vec![0u8; len];
                        source.read(s, off, &mut b)?;
                        Ok(b)
                    })
                    .map_err(|e| warn!(model = %model, "no tensor index: {e}"))
                    .ok()
                });
                let mut loads = lock(&me.loads);
                let Some(l) = loads.get_mut(&model) else { return };
                match r {
                    Ok(rep) => {
                        if let Some(f) = me.observer.get() {
                            f(Some(rep.elapsed_s));
                        }
                        info!(model = %model, gpus = ?l.gpus, elapsed_s = rep.elapsed_s, partition_s = rep.first_s, host_path = %rep.host_path, register_s = rep.register_s, segments_reused = rep.registrations_reused, numa_node = ?rep.numa_node, "model resident on GPUs");
                        l.state = LoadState::Resident;
                        l.report = Some(rep);
                        l.index = match &l.partition {
                            Some(p) => Some(l.map.remap_index(&l.layout, &p.index, false)),
                            None => index,
                        };
                    }
                    Err(e) => {
                        let why = match (&e, l.abort.take()) {
                            (crate::loader::LoadError::Cancelled, Some(why)) => why,
                            _ => e.to_string(),
                        };
                        if let Some(f) = me.observer.get() {
                            f(None);
                        }
                        warn!(model = %model, "GPU load failed: {why}");
                        l.state = LoadState::Failed(why);
                        let gpus = l.gpus.clone();
                        drop(loads);
                        for g in gpus {
                            me.release(g, &model);
                        }
                    }
                }
            })
            .map_err(|e| GpuError::Invalid(format!("starting the load thread: {e}")))?;
        Ok(gpus)
    }

    fn release(&self, gpu: u32, model: &str) {
        if let Some(i) = self.devices.iter().position(|d| d.info().index == gpu) {
            let _ = lock(&self.pools[i]).evict(model);
        }
    }

    /// Status of every model on the GPUs.
    pub fn status(&self) -> Vec<ModelGpuStatus> {
        let loads = lock(&self.loads);
        let mut out: Vec<ModelGpuStatus> = loads
            .iter()
            .map(|(k, l)| ModelGpuStatus {
                model: k.clone(),
                name: l.name.clone(),
                state: l.visible_state(),
                gpus: l
                    .progress
                    .snapshot()
                    .into_iter()
                    .filter(|(g, _)| l.gpus.contains(g))
                    .map(|(g, b)| (g, b, l.progress.total))
                    .collect(),
                elapsed_s: l
                    .report
                    .as_ref()
                    .map(|r| r.elapsed_s)
                    .unwrap_or_else(|| l.started.elapsed().as_secs_f64()),
                partition: l.partition.as_ref().map(|p| PartitionStatus {
                    label: p.label.clone(),
                    bytes: l.map.first_bytes,
                    // The finished load's own figure (on the clock its elapsed time uses);
                    // while it runs, the progress's.
                    live_s: l
                        .report
                        .as_ref()
                        .map(|r| r.first_s)
                        .or_else(|| l.progress.first_done_s()),
                    complete: p.complete,
                }),
                host_path: l.report.as_ref().map(|r| r.host_path),
                fallback_reason: l.report.as_ref().and_then(|r| r.fallback_reason.clone()),
                register_s: l.report.as_ref().map_or(0.0, |r| r.register_s),
                segments: l.report.as_ref().map_or(0, |r| r.registrations),
                segments_reused: l.report.as_ref().map_or(0, |r| r.registrations_reused),
            })
            .collect();
        out.sort_by(|a, b| a.model.cmp(&b.model));
        out
    }

    /// Stops a load in flight (its data source failed): the load ends `Failed` with `why`
    /// and its regions are freed. A model not loading is left alone.
    pub fn abort(&self, model: &str, why: &str) {
        let mut loads = lock(&self.loads);
        if let Some(l) = loads.get_mut(model)
            && l.state == LoadState::Loading
        {
            l.abort = Some(why.to_string());
            l.progress
                .cancel
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Status of one model.
    pub fn model_status(&self, model: &str) -> Option<ModelGpuStatus> {
        self.status().into_iter().find(|s| s.model == model)
    }

    /// Frees `model`'s regions on every GPU. Refused while it is loading or locked.
    pub fn evict(&self, model: &str) -> Result<Vec<u32>, ManagerError> {
        let mut loads = lock(&self.loads);
        let Some(l) = loads.get(model) else {
            return Err(ManagerError::NotLoaded(model.to_string()));
        };
        if l.state == LoadState::Loading {
            return Err(ManagerError::Busy(model.to_string()));
        }
        let gpus = l.gpus.clone();
        for &g in &gpus {
            if let Some(i) = self.devices.iter().position(|d| d.info().index == g) {
                match lock(&self.pools[i]).evict(model) {
                    Ok(_) | Err(PoolError::Missing(_)) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        loads.remove(model);
        info!(model, ?gpus, "evicted from GPUs");
        Ok(gpus)
    }

    /// The hand-off of a resident model: IPC handles per GPU plus the tensor index. Counts as
    /// a use of the model for eviction's LRU order.
    pub fn handoff(&self, model: &str) -> Result<Handoff, ManagerError> {
        let mut loads = lock(&self.loads);
        let l = loads
            .get_mut(model)
            .ok_or_else(|| ManagerError::NotLoaded(model.to_string()))?;
        l.last_used = Instant::now();
        let l = &*l;
        let state = l.visible_state();
        if !matches!(state, LoadState::Resident | LoadState::PartitionLive) {
            return Err(ManagerError::Busy(model.to_string()));
        }
        let mut devices = Vec::new();
        for &g in &l.gpus {
            let Some(i) = self.devices.iter().position(|d| d.info().index == g) else {
                continue;
            };
            let span = lock(&self.pools[i])
                .span(model)
                .ok_or_else(|| ManagerError::NotLoaded(model.to_string()))?;
            let d = &self.devices[i];
            devices.push(HandoffDevice {
                gpu: g,
                device_kind: d.info().kind,
                name: d.info().name.clone(),
                handle: d.ipc_handle(span)?,
                size: l.map.region,
            });
        }
        Ok(Handoff {
            model: model.to_string(),
            name: l.name.clone(),
            kind: match devices.first().map(|d| d.device_kind) {
                Some(DeviceKind::Cuda) => "cuda-ipc",
                Some(DeviceKind::Simulated) => "simulated",
                None => "memory-file",
            }
            .into(),
            devices,
            // A partition-only region is packed: shard offsets do not apply to it.
            shards: l
                .layout
                .shards
                .iter()
                .filter(|_| l.partition.as_ref().is_none_or(|p| p.complete))
                .zip(l.files.iter().map(Some).chain(std::iter::repeat(None)))
                .map(|(s, f)| HandoffShard {
                    path: s.path.clone(),
                    file: f.cloned().unwrap_or_default(),
                    offset: s.offset,
                    size: s.size,
                })
                .collect(),
            tensors: match (&l.partition, &state) {
                (Some(p), LoadState::PartitionLive) => l.map.remap_index(&l.layout, &p.index, true),
                _ => l.index.clone().unwrap_or_default(),
            },
            // A full replica (completion done) is no longer a partition.
            partition: l
                .partition
                .as_ref()
                .filter(|p| !(p.complete && state == LoadState::Resident))
                .map(|p| p.label.clone()),
        })
    }
}

impl ModelLoad {
    /// The state as seen from outside: a loading partition whose bytes are all on every
    /// GPU is live.
    fn visible_state(&self) -> LoadState {
        if self.state == LoadState::Loading
            && self.partition.is_some()
            && self.progress.first_done_s().is_some()
        {
            LoadState::PartitionLive
        } else {
            self.state.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_as_shares_or_sizes() {
        let parse = |s: &str| s.parse::<GpuBudget>();
        assert_eq!(parse("0.8"), Ok(GpuBudget::Fraction(0.8)));
        assert_eq!(parse(" 50% "), Ok(GpuBudget::Fraction(0.5)));
        assert_eq!(parse("1"), Ok(GpuBudget::Fraction(1.0)));
        assert_eq!(parse("60GiB"), Ok(GpuBudget::Bytes(60 << 30)));
        assert_eq!(parse("2MiB"), Ok(GpuBudget::Bytes(REGION_ALIGN)));
        for bad in [
            "0", "0.001", "80", "101%", "x%", "1MiB", "NaN", "inf", "lots", "",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert!(
            parse("80")
                .unwrap_err()
                .to_string()
                .contains("give a size with its unit")
        );
        assert_eq!(GpuBudget::default(), GpuBudget::Fraction(0.8));
        assert_eq!(GpuBudget::Fraction(0.8).bytes_of(100 << 20), 80 << 20);
        assert_eq!(GpuBudget::Bytes(60 << 30).bytes_of(80 << 30), 60 << 30);
        assert_eq!(GpuBudget::Bytes(60 << 30).bytes_of(40 << 30), 40 << 30);
        assert_eq!(GpuBudget::Fraction(0.7).to_string(), "70% of each GPU");
    }
}
