//! Interference-aware GPU choice for a request whose model may need loading (Torpor §5.3,
//! Algorithm 1).
//!
//! Rules, first match wins; among equals the lowest GPU index (then the lowest source
//! index) wins, so the answer is deterministic:
//!
//! 1. an idle GPU that already holds the model: run there, no load (Alg. 1 line 8);
//! 2. else, if some GPU holds the model (busy), the fastest NVLink pair from a holder to an
//!    idle GPU with room: copy GPU-to-GPU, off the PCIe switches (line 11);
//! 3. else load from host over PCIe onto an idle GPU with room whose PCIe-switch neighbours
//!    are not loading (line 13), or failing that are loading only light models (line 15);
//! 4. else any idle GPU with room (line 17);
//! 5. `None` when no idle GPU has room: the caller queues the request or evicts first
//!    ([`crate::evict::choose_gpu_evictions`]).
//!
//! "Available" in Algorithm 1 is `idle` here, and a load target must also have
//! `free_bytes ≥ bytes` (Torpor evicts before loading; here eviction is the caller's step).

use serde::{Deserialize, Serialize};

use crate::evict::Heaviness;

/// One GPU of a host and its links.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuNode {
    /// GPU index on the host.
    pub index: u32,
    /// The PCIe switch it hangs off; GPUs with the same switch share host-to-GPU bandwidth.
    pub pcie_switch: u32,
    /// NVLink peers and the link's bandwidth in GB/s. A link may be listed on one side or
    /// both; the larger figure is used.
    pub nvlink: Vec<(u32, f64)>,
}

/// A host's GPU topology.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Topology {
    /// The host's GPUs.
    pub gpus: Vec<GpuNode>,
}

impl Topology {
    /// NVLink bandwidth between two GPUs in GB/s, `None` without a link.
    pub fn nvlink_gbps(&self, a: u32, b: u32) -> Option<f64> {
        let side = |from: u32, to: u32| {
            self.node(from)
                .into_iter()
                .flat_map(|n| n.nvlink.iter())
                .filter(|(peer, gbps)| *peer == to && *gbps > 0.0)
                .map(|(_, gbps)| *gbps)
                .max_by(f64::total_cmp)
        };
        match (side(a, b), side(b, a)) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        }
    }

    /// The node for a GPU index.
    pub fn node(&self, index: u32) -> Option<&GpuNode> {
        self.gpus.iter().find(|n| n.index == index)
    }

    /// The other GPUs on the same PCIe switch; `None` when the GPU is not in the topology.
    pub fn pcie_neighbours(&self, index: u32) -> Option<Vec<u32>> {
        let switch = self.node(index)?.pcie_switch;
        Some(
            self.gpus
                .iter()
                .filter(|n| n.pcie_switch == switch && n.index != index)
                .map(|n| n.index)
                .collect(),
        )
    }
}

/// What one GPU is doing now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuLoadState {
    /// GPU index on the host.
    pub gpu: u32,
    /// Not executing a request (Algorithm 1's "available").
    pub idle: bool,
    /// Free memory, bytes.
    pub free_bytes: u64,
    /// Models resident on it.
    pub holds: Vec<String>,
    /// The model it is loading over PCIe now, if any, with its heaviness.
    pub loading: Option<(String, Heaviness)>,
}

/// Where the chosen GPU gets the model from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum ChoiceSource {
    /// The GPU holds the model already.
    AlreadyHolds,
    /// Copy from another GPU over NVLink.
    NvlinkFrom {
        /// The GPU to copy from.
        gpu: u32,
        /// The link's bandwidth, GB/s.
        gbps: f64,
    },
    /// Load from host memory over PCIe.
    Pcie,
}

/// The chosen GPU, where the model comes from, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuChoice {
    /// The GPU to run on.
    pub gpu: u32,
    /// Where the model comes from.
    pub source: ChoiceSource,
    /// Which rule picked it, for logs.
    pub reason: String,
}

/// Chooses the GPU for a request to `model` (`bytes` on GPU, of the given heaviness) by
/// Torpor's Algorithm 1; see the module docs for the rules.
pub fn choose_gpu(
    topo: &Topology,
    states: &[GpuLoadState],
    model: &str,
    bytes: u64,
    heaviness: Heaviness,
) -> Option<GpuChoice> {
    let holds = |s: &GpuLoadState| s.holds.iter().any(|h| h == model);

    // Rule 1: an idle GPU holding the model.
    if let Some(s) = states
        .iter()
        .filter(|s| s.idle && holds(s))
        .min_by_key(|s| s.gpu)
    {
        return Some(GpuChoice {
            gpu: s.gpu,
            source: ChoiceSource::AlreadyHolds,
            reason: format!(
                "GPU {} is idle and holds {model}: run without loading (Torpor Alg. 1 rule 1)",
                s.gpu
            ),
        });
    }

    let targets: Vec<&GpuLoadState> = states
        .iter()
        .filter(|s| s.idle && s.free_bytes >= bytes && !holds(s))
        .collect();
    if targets.is_empty() {
        return None;
    }

    // Rule 2: fastest NVLink pair from a (busy) holder to an idle GPU with room.
    let mut best: Option<(f64, u32, u32)> = None;
    for src in states.iter().filter(|s| holds(s)) {
        for dst in &targets {
            let Some(gbps) = topo.nvlink_gbps(src.gpu, dst.gpu) else {
                continue;
            };
            let better = match best {
                None => true,
                Some((b, d, s)) => gbps
                    .total_cmp(&b)
                    .then_with(|| d.cmp(&dst.gpu))
                    .then_with(|| s.cmp(&src.gpu))
                    .is_gt(),
            };
            if better {
                best = Some((gbps, dst.gpu, src.gpu));
            }
        }
    }
    if let Some((gbps, dst, src)) = best {
        return Some(GpuChoice {
            gpu: dst,
            source: ChoiceSource::NvlinkFrom { gpu: src, gbps },
            reason: format!(
                "{model} is held only by busy GPUs; copy GPU {src} → GPU {dst} over the fastest \
                 NVLink ({gbps} GB/s) instead of PCIe (Torpor Alg. 1 rule 2)"
            ),
        });
    }

    // Rules 3 and 4: load over PCIe, avoiding switches where a neighbour is loading.
    let loading_of = |gpu: u32| {
        states
            .iter()
            .find(|s| s.gpu == gpu)
            .and_then(|s| s.loading.as_ref())
    };
    let tier = |t: &GpuLoadState| -> u8 {
        let Some(neighbours) = topo.pcie_neighbours(t.gpu) else {
            return 2;
        };
        let loads: Vec<Heaviness> = neighbours
            .iter()
            .filter_map(|n| loading_of(*n).map(|(_, h)| *h))
            .collect();
        if loads.is_empty() {
            0
        } else if loads.iter().all(|h| *h == Heaviness::Light) {
            1
        } else {
            2
        }
    };
    let chosen = targets.iter().min_by_key(|t| (tier(t), t.gpu))?;
    let why = match tier(chosen) {
        0 => "no GPU on its PCIe switch is loading (Torpor Alg. 1 line 13)",
        1 => "its PCIe-switch neighbours are loading only light models (Torpor Alg. 1 line 15)",
        _ => {
            "every idle GPU with room shares a switch with a non-light load; any GPU (Torpor Alg. 1 line 17)"
        }
    };
    let nvlink_note = if states.iter().any(holds) {
        "holders have no NVLink to an idle GPU with room; "
    } else {
        ""
    };
    Some(GpuChoice {
        gpu: chosen.gpu,
        source: ChoiceSource::Pcie,
        reason: format!(
            "{nvlink_note}load {model} ({heaviness:?}, {bytes} bytes) from host onto GPU {} over PCIe: {why}",
            chosen.gpu
        ),
    })
}
