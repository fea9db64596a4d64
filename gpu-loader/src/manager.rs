//! A host's GPUs as transferd uses them: the backend (CUDA when a driver is present,
//! simulated when asked for, none otherwise), one memory pool per GPU, the loads in flight
//! and the models resident, and their hand-offs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use serde::Serialize;
use tracing::{info, warn};

use crate::cuda::{self, CudaOptions};
use crate::device::{Device, DeviceInfo, DeviceKind, GpuError};
use crate::handoff::{Handoff, HandoffDevice, HandoffShard};
use crate::index::{Layout, LoadMap, ShardRange, TensorEntry, tensor_index};
use crate::loader::{ChunkSource, LoadOptions, LoadProgress, LoadReport, Target, load_map};
use crate::pool::{GpuPool, PoolError, Region};
use crate::sim::{self, SimOptions};

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

/// Manager settings.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// Backend.
    pub backend: BackendChoice,
    /// CUDA options.
    pub cuda: CudaOptions,
    /// Fraction of each GPU's memory reserved for the pool (the rest stays for inference
    /// processes' activations and workspaces).
    pub budget_fraction: f64,
    /// Loader settings. `load.staging_size == 0` means "auto": calibrated at start-up on
    /// CUDA (the elbow of host → device throughput vs. transfer size, Torpor §4.3), 4 MiB on
    /// simulated devices.
    pub load: LoadOptions,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            backend: BackendChoice::Auto,
            cuda: CudaOptions::default(),
            budget_fraction: 0.8,
            load: LoadOptions::default(),
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
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl GpuManager {
    /// Opens the backend. Never fails for lack of GPUs: a host without them gets a manager
    /// with no devices and a note saying why.
    pub fn open(cfg: &ManagerConfig) -> Self {
        let mut opts = cfg.load.clone();
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
        let mut pools = Vec::new();
        let mut kept = Vec::new();
        for d in devices {
            let budget =
                (d.info().memory_bytes as f64 * cfg.budget_fraction.clamp(0.01, 1.0)) as u64;
            match GpuPool::new(d.clone(), budget) {
                Ok(p) => {
                    pools.push(Mutex::new(p));
                    kept.push(d);
                }
                Err(e) => warn!(
                    gpu = d.info().index,
                    "GPU left out: reserving its pool failed: {e}"
                ),
            }
        }
        if opts.staging_size == 0 {
            opts.staging_size = calibrated.unwrap_or(4 << 20);
        }
        info!(
            gpus = kept.len(),
            staging_size = opts.staging_size,
            "{note}"
        );
        Self {
            devices: kept,
            pools,
            loads: Mutex::default(),
            opts,
            note,
        }
    }

    /// What the backend found (or why nothing).
    pub fn note(&self) -> &str {
        &self.note
    }

    /// The devices.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.devices.iter().map(|d| d.info().clone()).collect()
    }

    /// Regions per GPU.
    pub fn regions(&self) -> Vec<(u32, u64, u64, Vec<Region>)> {
        self.pools
            .iter()
            .map(|p| {
                let p = lock(p);
                (p.device().info().index, p.capacity(), p.free(), p.regions())
            })
            .collect()
    }

    fn choose(&self, count: usize, explicit: &[u32]) -> Result<Vec<usize>, ManagerError> {
        if self.devices.is_empty() {
            return Err(ManagerError::NoGpus(self.note.clone()));
        }
        if !explicit.is_empty() {
            return explicit
                .iter()
                .map(|&g| {
                    self.devices
                        .iter()
                        .position(|d| d.info().index == g)
                        .ok_or(ManagerError::NoSuchGpu(g))
                })
                .collect();
        }
        let count = count.max(1);
        if count > self.devices.len() {
            return Err(ManagerError::TooMany {
                requested: count,
                available: self.devices.len(),
            });
        }
        // Most free pool memory first (GPU choice by interference is the controller's
        // policy); ties by index.
        let mut by_free: Vec<(u64, usize)> = self
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| (lock(p).free(), i))
            .collect();
        by_free.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        Ok(by_free.into_iter().take(count).map(|(_, i)| i).collect())
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
        self.start_partition_load(model, name, source, count, explicit, files, None)
    }

    /// [`start_load`](Self::start_load), optionally of a partition first (and the rest
    /// after it when `partition.complete`). A model already loading or resident is not
    /// loaded again, whatever its partition.
    #[allow(clippy::too_many_arguments)]
    pub fn start_partition_load(
        self: &Arc<Self>,
        model: &str,
        name: &str,
        source: Arc<dyn ChunkSource>,
        count: usize,
        explicit: &[u32],
        files: Vec<String>,
        partition: Option<PartitionLoad>,
    ) -> Result<Vec<u32>, ManagerError> {
        {
            let loads = lock(&self.loads);
            if let Some(l) = loads.get(model)
                && l.state != LoadState::Failed(String::new())
                && !matches!(l.state, LoadState::Failed(_))
            {
                return Ok(l.gpus.clone());
            }
        }
        let chosen = self.choose(count, explicit)?;
        let layout = Layout::new(
            &source
                .shards()
                .iter()
                .map(|s| (s.path.clone(), s.size))
                .collect::<Vec<_>>(),
        );
        let map = match &partition {
            Some(p) => LoadMap::partition(&layout, &p.ranges, p.complete),
            None => LoadMap::full(&layout),
        };
        // Reserve every region first; on failure release what was reserved.
        let mut targets = Vec::new();
        for &i in &chosen {
            let r = lock(&self.pools[i]).reserve(model, map.region);
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
                        info!(model = %model, gpus = ?l.gpus, elapsed_s = rep.elapsed_s, partition_s = rep.first_s, "model resident on GPUs");
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
                    live_s: l.progress.first_done_s(),
                    complete: p.complete,
                }),
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

    /// The hand-off of a resident model: IPC handles per GPU plus the tensor index.
    pub fn handoff(&self, model: &str) -> Result<Handoff, ManagerError> {
        let loads = lock(&self.loads);
        let l = loads
            .get(model)
            .ok_or_else(|| ManagerError::NotLoaded(model.to_string()))?;
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
