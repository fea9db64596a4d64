//! What to evict from each tier: GPU memory, host memory, local disk.
//!
//! * **Heaviness** (Torpor §5.3, Table 3–4): a model is *heavy* when loading it over PCIe
//!   takes longer than executing it, so pipelined swapping cannot hide the transfer and it
//!   contends for the PCIe switch; *light* models load in a fraction of their execution time.
//! * **GPU** (Torpor §5.4): evict in two LRU classes — first light models and extra
//!   replicas (another GPU of the host holds the model: it comes back over NVLink), then
//!   the rest, heavy models that are the only GPU copy in the cluster last. Locked models
//!   (being copied to a sibling GPU) are never chosen. [`one_replica_rule`] enforces "once
//!   GPU memory is full, at most one replica per model across a host's GPUs".
//! * **Host memory**: model data before process memory, LRU, in-flight items pinned.
//! * **Disk**: high/low watermarks, LRU.
//! * **Last-copy protection**, every tier: the last copy in the cluster of a registered
//!   model is kept unless its origin can serve it again ([`ClusterCopies::protects`]).
//!
//! Ties are broken by model name (then GPU index), so every answer is deterministic.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How much a model suffers from being loaded over PCIe (Torpor §5.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Heaviness {
    /// Load time well under execution time: swapping is nearly free, evict first.
    Light,
    /// Between the thresholds.
    Medium,
    /// Load time at least the execution time: swapping shows in latency and loads the
    /// PCIe switch; evict last, load over NVLink when possible.
    Heavy,
}

/// Thresholds on the PCIe load slowdown `(bytes / pcie_bps) / exec_s`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HeavinessThresholds {
    /// Slowdown below this is [`Heaviness::Light`]. Default `0.5`: even with the PCIe
    /// switch shared by a neighbour's transfer (half the bandwidth, twice the load time) the
    /// pipelined load still hides under execution.
    pub light_below: f64,
    /// Slowdown at or above this is [`Heaviness::Heavy`]. Default `1.0`: the transfer takes
    /// as long as the execution, so pipelined execution (Torpor §4.3) waits on PCIe — the
    /// Bert-qa case of Torpor Table 4 (43 ms remoted, 144 ms swapped over PCIe).
    pub heavy_at_or_above: f64,
}

impl Default for HeavinessThresholds {
    fn default() -> Self {
        Self {
            light_below: 0.5,
            heavy_at_or_above: 1.0,
        }
    }
}

/// PCIe load slowdown: load time over PCIe divided by execution time.
///
/// Infinite when `exec_s` or `pcie_bps` is not positive (nothing hides the load); `0` for
/// an empty model.
pub fn load_slowdown(weight_bytes: u64, pcie_bps: f64, exec_s: f64) -> f64 {
    if weight_bytes == 0 {
        return 0.0;
    }
    if pcie_bps.is_nan() || pcie_bps <= 0.0 || exec_s.is_nan() || exec_s <= 0.0 {
        return f64::INFINITY;
    }
    // u64 → f64 loses precision only above 2^53 bytes, far beyond any model.
    (weight_bytes as f64 / pcie_bps) / exec_s
}

/// Classifies a model by its PCIe load slowdown ([`load_slowdown`]). A NaN slowdown
/// (NaN inputs) is classed [`Heaviness::Heavy`], the cautious answer.
pub fn heaviness(
    weight_bytes: u64,
    pcie_bps: f64,
    exec_s: f64,
    thresholds: &HeavinessThresholds,
) -> Heaviness {
    let s = load_slowdown(weight_bytes, pcie_bps, exec_s);
    if s < thresholds.light_below {
        Heaviness::Light
    } else if s < thresholds.heavy_at_or_above {
        Heaviness::Medium
    } else {
        Heaviness::Heavy
    }
}

/// Where else a model's bytes live: the input of last-copy protection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterCopies {
    /// Copies of the model in the cluster, this one included, over every tier and host.
    pub copies_in_cluster: u32,
    /// The model is registered (someone may still call it).
    pub registered: bool,
    /// The origin (object store, registry) can serve the model again.
    pub origin_available: bool,
}

impl ClusterCopies {
    /// True when evicting this copy could lose the model: it is registered, this is the
    /// last copy in the cluster, and the origin cannot serve it again.
    pub fn protects(&self) -> bool {
        self.registered && self.copies_in_cluster <= 1 && !self.origin_available
    }
}

/// One model resident on a GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuModel {
    /// Model name.
    pub model: String,
    /// Bytes it occupies on the GPU.
    pub bytes: u64,
    /// Its [`heaviness`].
    pub heaviness: Heaviness,
    /// Last use, seconds on the controller's clock.
    pub last_used_s: f64,
    /// Being copied to a sibling GPU: must stay until the copy ends.
    pub locked: bool,
    /// GPUs of this host holding the model (this one included).
    pub replicas_on_host: u32,
    /// No other GPU in the cluster holds the model.
    pub only_gpu_copy_in_cluster: bool,
    /// Copies over all tiers, for last-copy protection.
    pub copies: ClusterCopies,
}

/// One GPU's memory and the models on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuState {
    /// GPU index on its host.
    pub gpu: u32,
    /// Memory for models, bytes.
    pub capacity: u64,
    /// Resident models.
    pub models: Vec<GpuModel>,
}

impl GpuState {
    /// Bytes taken by resident models.
    pub fn used_bytes(&self) -> u64 {
        self.models
            .iter()
            .fold(0u64, |acc, m| acc.saturating_add(m.bytes))
    }

    /// Bytes not taken by resident models.
    pub fn free_bytes(&self) -> u64 {
        self.capacity.saturating_sub(self.used_bytes())
    }
}

/// Why nothing (or not enough) can be evicted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EvictError {
    /// The request exceeds the tier's whole capacity; no eviction can help.
    #[error("{tier}: {need_bytes} bytes requested but the tier has only {capacity} bytes in all")]
    LargerThanTier {
        /// The tier, e.g. `GPU 2`.
        tier: String,
        /// Bytes requested.
        need_bytes: u64,
        /// The tier's capacity.
        capacity: u64,
    },
    /// Evicting everything allowed would still not free enough.
    #[error(
        "{tier}: must free {shortfall_bytes} bytes but only {evictable_bytes} bytes can be evicted; kept: {kept}"
    )]
    Insufficient {
        /// The tier, e.g. `GPU 2`.
        tier: String,
        /// Bytes that must be freed.
        shortfall_bytes: u64,
        /// Bytes that eviction may free.
        evictable_bytes: u64,
        /// The items that may not be evicted and why, or `none`.
        kept: String,
    },
}

/// Why an item must stay, if it must.
fn keep_reason(locked_or_pinned: Option<&str>, copies: &ClusterCopies) -> Option<String> {
    if let Some(why) = locked_or_pinned {
        return Some(why.to_owned());
    }
    if copies.protects() {
        return Some(
            "last copy in the cluster of a registered model, origin unavailable".to_owned(),
        );
    }
    None
}

fn join_kept(kept: &[(String, String)]) -> String {
    if kept.is_empty() {
        return "none".to_owned();
    }
    kept.iter()
        .map(|(m, why)| format!("{m} ({why})"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Eviction rank on a GPU, lower goes first. Rank 0 is Torpor's first LRU class (light
/// models and extra replicas); ranks 1–3 split its second class so that, with only light
/// and heavy models and no copies on other hosts, the order is exactly Torpor's.
fn gpu_rank(m: &GpuModel) -> u8 {
    match m.heaviness {
        _ if m.replicas_on_host > 1 => 0,
        Heaviness::Light => 0,
        Heaviness::Medium => 1,
        Heaviness::Heavy if !m.only_gpu_copy_in_cluster => 2,
        Heaviness::Heavy => 3,
    }
}

fn lru(a_s: f64, a_name: &str, b_s: f64, b_name: &str) -> Ordering {
    a_s.total_cmp(&b_s).then_with(|| a_name.cmp(b_name))
}

/// Models to evict from one GPU so that `need_bytes` fit, in eviction order.
///
/// Empty when the bytes already fit. Order: light models and extra replicas (LRU), then
/// medium, then heavy models with a GPU copy elsewhere, then heavy models that are the only
/// GPU copy (each LRU). Locked models and protected last copies are never chosen; when the
/// rest cannot free enough, the error names them.
pub fn choose_gpu_evictions(state: &GpuState, need_bytes: u64) -> Result<Vec<String>, EvictError> {
    let tier = format!("GPU {}", state.gpu);
    if need_bytes > state.capacity {
        return Err(EvictError::LargerThanTier {
            tier,
            need_bytes,
            capacity: state.capacity,
        });
    }
    let free = state.free_bytes();
    if free >= need_bytes {
        return Ok(Vec::new());
    }
    let shortfall = need_bytes - free;
    let mut kept = Vec::new();
    let mut candidates: Vec<&GpuModel> = Vec::new();
    for m in &state.models {
        let lock = m.locked.then_some("locked: being copied to a sibling GPU");
        match keep_reason(lock, &m.copies) {
            Some(why) => kept.push((m.model.clone(), why)),
            None => candidates.push(m),
        }
    }
    candidates.sort_by(|a, b| {
        gpu_rank(a)
            .cmp(&gpu_rank(b))
            .then_with(|| lru(a.last_used_s, &a.model, b.last_used_s, &b.model))
    });
    take_until(
        candidates.iter().map(|m| (m.model.as_str(), m.bytes)),
        shortfall,
    )
    .ok_or_else(|| EvictError::Insufficient {
        tier,
        shortfall_bytes: shortfall,
        evictable_bytes: candidates
            .iter()
            .fold(0u64, |acc, m| acc.saturating_add(m.bytes)),
        kept: join_kept(&kept),
    })
}

/// Takes items in order until `need` bytes are covered; `None` if they never are.
fn take_until<'a>(items: impl Iterator<Item = (&'a str, u64)>, need: u64) -> Option<Vec<String>> {
    let mut freed = 0u64;
    let mut out = Vec::new();
    if need == 0 {
        return Some(out);
    }
    for (name, bytes) in items {
        out.push(name.to_owned());
        freed = freed.saturating_add(bytes);
        if freed >= need {
            return Some(out);
        }
    }
    None
}

/// Evictions `(gpu, model)` that leave at most one replica per model across a host's GPUs,
/// applied only once the host's GPU memory is full (Torpor §5.4).
///
/// "Full" means no GPU of the host has room for even the smallest resident model. Of a
/// model's replicas, locked ones are always kept; if none is locked, the most recently used
/// one (lowest GPU index on a tie) is kept. Sorted by GPU, then model.
pub fn one_replica_rule(host_gpus: &[GpuState]) -> Vec<(u32, String)> {
    let Some(smallest) = host_gpus
        .iter()
        .flat_map(|g| g.models.iter().map(|m| m.bytes))
        .min()
    else {
        return Vec::new();
    };
    if host_gpus.iter().any(|g| g.free_bytes() >= smallest) {
        return Vec::new();
    }
    let mut by_model: BTreeMap<&str, Vec<(u32, &GpuModel)>> = BTreeMap::new();
    for g in host_gpus {
        for m in &g.models {
            by_model.entry(&m.model).or_default().push((g.gpu, m));
        }
    }
    let mut out = Vec::new();
    for (name, copies) in by_model {
        if copies.len() < 2 {
            continue;
        }
        let any_locked = copies.iter().any(|(_, m)| m.locked);
        let keep = if any_locked {
            None
        } else {
            copies
                .iter()
                .max_by(|(ga, a), (gb, b)| {
                    a.last_used_s
                        .total_cmp(&b.last_used_s)
                        .then_with(|| gb.cmp(ga))
                })
                .map(|(g, _)| *g)
        };
        for (g, m) in &copies {
            if !m.locked && Some(*g) != keep {
                out.push((*g, name.to_owned()));
            }
        }
    }
    out.sort();
    out
}

/// What a host-memory item is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum TierKind {
    /// Model weights cached in (pinned) host memory: evicted first, refetchable.
    ModelData,
    /// A warm process's memory (runtime, CUDA context snapshot): evicted after model data.
    ProcessMemory,
}

/// One item in host memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TierItem {
    /// Model the item belongs to.
    pub model: String,
    /// Bytes it occupies.
    pub bytes: u64,
    /// Last use, seconds on the controller's clock.
    pub last_used_s: f64,
    /// In flight (being read or written): must stay.
    pub pinned: bool,
    /// Model data or process memory.
    pub kind: TierKind,
    /// Copies over all tiers, for last-copy protection (applied to model data only;
    /// process memory holds no copy of the weights).
    pub copies: ClusterCopies,
}

/// Host-memory items to evict to free `need_bytes`, in eviction order: model data before
/// process memory, each LRU; pinned items and protected last copies stay.
pub fn choose_memory_evictions(
    items: &[TierItem],
    need_bytes: u64,
) -> Result<Vec<String>, EvictError> {
    let tier = "host memory".to_owned();
    let total = items
        .iter()
        .fold(0u64, |acc, i| acc.saturating_add(i.bytes));
    if need_bytes > total {
        return Err(EvictError::Insufficient {
            tier,
            shortfall_bytes: need_bytes,
            evictable_bytes: evictable(items),
            kept: join_kept(&memory_kept(items)),
        });
    }
    let mut candidates: Vec<&TierItem> =
        items.iter().filter(|i| memory_keep(i).is_none()).collect();
    candidates.sort_by(|a, b| {
        a.kind
            .cmp(&b.kind)
            .then_with(|| lru(a.last_used_s, &a.model, b.last_used_s, &b.model))
    });
    take_until(
        candidates.iter().map(|i| (i.model.as_str(), i.bytes)),
        need_bytes,
    )
    .ok_or_else(|| EvictError::Insufficient {
        tier,
        shortfall_bytes: need_bytes,
        evictable_bytes: evictable(items),
        kept: join_kept(&memory_kept(items)),
    })
}

fn memory_keep(i: &TierItem) -> Option<String> {
    let pin = i.pinned.then_some("pinned: in flight");
    match i.kind {
        TierKind::ModelData => keep_reason(pin, &i.copies),
        TierKind::ProcessMemory => pin.map(str::to_owned),
    }
}

fn memory_kept(items: &[TierItem]) -> Vec<(String, String)> {
    items
        .iter()
        .filter_map(|i| memory_keep(i).map(|why| (i.model.clone(), why)))
        .collect()
}

fn evictable(items: &[TierItem]) -> u64 {
    items
        .iter()
        .filter(|i| memory_keep(i).is_none())
        .fold(0u64, |acc, i| acc.saturating_add(i.bytes))
}

/// One model's files on local disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiskItem {
    /// Model name.
    pub model: String,
    /// Bytes on disk.
    pub bytes: u64,
    /// Last use, seconds on the controller's clock.
    pub last_used_s: f64,
    /// In flight (being written or served to a peer): must stay.
    pub pinned: bool,
    /// Copies over all tiers, for last-copy protection.
    pub copies: ClusterCopies,
}

/// The outcome of a watermark pass over the disk tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WatermarkPlan {
    /// Models to delete, in order (LRU first).
    pub evict: Vec<String>,
    /// Bytes the deletions free.
    pub freed_bytes: u64,
    /// Items passed over on the way and why (pinned, protected last copy).
    pub skipped: Vec<(String, String)>,
    /// Whether usage ends at or below the low watermark (false: only pinned or protected
    /// items are left; the caller should alert).
    pub reaches_low: bool,
}

/// Disk watermark pass: when `used > high·capacity`, delete LRU items until
/// `used ≤ low·capacity`, skipping pinned items and protected last copies.
///
/// `high` and `low` are fractions of `capacity`; `low` is taken as at most `high`. Below the
/// high watermark the plan is empty and `reaches_low` tells whether usage is under `low`.
pub fn disk_watermark_plan(
    items: &[DiskItem],
    used: u64,
    capacity: u64,
    high: f64,
    low: f64,
) -> WatermarkPlan {
    let cap = capacity as f64;
    let low = low.min(high);
    let low_bytes = (low.max(0.0) * cap).floor();
    let mut plan = WatermarkPlan {
        evict: Vec::new(),
        freed_bytes: 0,
        skipped: Vec::new(),
        reaches_low: used as f64 <= low_bytes,
    };
    let above_high = used as f64 > high * cap;
    if !above_high {
        return plan;
    }
    let mut order: Vec<&DiskItem> = items.iter().collect();
    order.sort_by(|a, b| lru(a.last_used_s, &a.model, b.last_used_s, &b.model));
    for item in order {
        if (used.saturating_sub(plan.freed_bytes)) as f64 <= low_bytes {
            break;
        }
        let pin = item.pinned.then_some("pinned: in flight");
        if let Some(why) = keep_reason(pin, &item.copies) {
            plan.skipped.push((item.model.clone(), why));
            continue;
        }
        plan.evict.push(item.model.clone());
        plan.freed_bytes = plan.freed_bytes.saturating_add(item.bytes);
    }
    plan.reaches_low = (used.saturating_sub(plan.freed_bytes)) as f64 <= low_bytes;
    plan
}

/// The models [`disk_watermark_plan`] deletes, LRU first.
pub fn disk_watermark_evictions(
    items: &[DiskItem],
    used: u64,
    capacity: u64,
    high: f64,
    low: f64,
) -> Vec<String> {
    disk_watermark_plan(items, used, capacity, high, low).evict
}
