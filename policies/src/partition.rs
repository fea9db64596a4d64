//! Partition plans: cutting a model's layer-group chain into `p` contiguous partitions,
//! each loaded on its own GPU in parallel, to shorten cold starts at the price of
//! activation transfers between partitions (Flashpoint thesis ch. 4, Gillis §IV).
//!
//! # The latency model (Flashpoint eq. 4.1–4.8, with the per-part figures of eq. 4.10)
//!
//! For a plan with partitions `k = 1..=p`, each with load time `l_k`, execution time `e_k`
//! (sums over its groups) and transfer time `n_k = output_bytes(last group of k) / link_bps`
//! (`n_p = 0`):
//!
//! * cold start `C = max_k l_k` — all partitions load in parallel (eq. 4.6 without its
//!   equal-size assumption, as the thesis' solver does in §4.2.3);
//! * inference `I = Σ_k e_k + Σ_k n_k` (eq. 4.2: `I(1) + IN(p)`);
//! * bottleneck `B = max_k max(e_k, n_k)` (eq. 4.3: execution and transfers are separate
//!   pipeline stages — transfers run on the NIC/RDMA while the GPU takes the next request,
//!   Fig. 4.4);
//! * with `G` GPUs the model runs as `r = ⌊G/p⌋` replicas, and the `y`-th queued request
//!   finishes at `T(y) = C + I + B·(⌈y/r⌉ − 1)` (eq. 4.5 + 4.7);
//! * a burst of `x` queued requests has mean latency `T̄(x) = (1/x)·Σ_{y=1..x} T(y)
//!   = C + I + B·w(x, r)` with `w(x, r) = (1/x)·Σ_{y=1..x}(⌈y/r⌉ − 1)` (eq. 4.8).
//!
//! `T(y)` is exact for a flow shop of identical jobs whose stages all start at `C`; when
//! some partitions finish loading earlier it is an upper bound (a request could start on
//! partition 1 before partition p is loaded). The thesis' worked example (Figs. 4.2–4.4) is
//! reproduced exactly: see [`flashpoint_example`].
//!
//! Memory (Gillis eq. 2, with one GPU per partition): each partition's weights must fit in
//! `gpu_memory` bytes.
//!
//! # Seed errata and choices
//!
//! * Eq. 4.8 sums `T(p, x, P)` over `y` — the summand must be `T(p, y, P)`.
//! * Eq. 4.10's DP keeps one best solution per (first layer, last layer, cuts) and combines
//!   left and right halves; the objective mixes maxima (`C`, `B`) and a sum (`IN`), which has
//!   no optimal substructure, so that DP is not exact. [`optimal_plan`] instead runs a DP
//!   over (end group, partitions used) that keeps the Pareto front of
//!   `(C, B, Σ n_k)`; any completion is monotone in all three, so pruning dominated entries
//!   is exact. The final front does not depend on the queue length, so one DP serves every
//!   queue length ([`precompute`]).
//! * §4.2.2's exponential + binary search assumes the best `p` is constant between probed
//!   queue lengths. With the `⌈y/r⌉` of eq. 4.5 and `r = ⌊P/p⌋` differing between `p`s it is
//!   not always: the best `p` can alternate with the parity of `x` (e.g. `p = 1` on 2 GPUs
//!   versus `p = 2`). [`precompute`] implements the thesis' search (exact at every probed
//!   point); [`precompute_exhaustive`] evaluates every queue length (cheap here, since each
//!   evaluation is O(front size) once the DP is done) and is exact everywhere.
//!
//! # The cost model (Gillis §IV-C)
//!
//! Gillis bills every function for its duration (master = the whole latency). Here each
//! GPU is held from the start of the cold start until the request has left it:
//! GPU `k` is billed `C + Σ_{m ≤ k} (e_m + n_m)` seconds, so a cold-started request costs
//! `gpu_seconds = p·C + Σ_k (p − k + 1)·(e_k + n_k)` GPU-seconds, plus
//! [`CostModel::per_gpu_overhead_s`] per GPU, times [`CostModel::price_per_gpu_s`]. No
//! rounding to a billing granularity (Gillis rounds each duration up to 1 or 100 ms).
//! [`cost_optimal`] finds the cheapest plan with at most `max_partitions` partitions whose
//! cold-started single request (`T(1) = C + I`, on `p` GPUs) meets the SLO, exactly: a
//! right-to-left DP over (start group, partitions in the suffix) keeping the Pareto front of
//! `(C, Σ n_k, weighted Σ)` (Gillis uses reinforcement learning because its search space,
//! with intra-layer parallelism, is far larger).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::profile::{LayerGroup, ModelProfile, ProfileError};

/// One partition of a plan: a contiguous run of layer groups on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartitionInfo {
    /// Indices of the layer groups in the partition.
    pub groups: Range<usize>,
    /// Weight bytes of the partition (must fit in one GPU).
    pub weight_bytes: u64,
    /// Seconds to load the partition (`l_k`).
    pub load_s: f64,
    /// Seconds to execute one request through the partition (`e_k`).
    pub exec_s: f64,
    /// Seconds to send the partition's output to the next partition (`n_k`; 0 for the last).
    pub transfer_out_s: f64,
}

/// A partition plan and its predicted performance (see the module docs for the formulas).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartitionPlan {
    /// Index of the first group of each partition; the first is always 0.
    pub cuts: Vec<usize>,
    /// The partitions, in execution order.
    pub partitions: Vec<PartitionInfo>,
    /// GPUs the plan was evaluated on (`G`).
    pub gpus: usize,
    /// Replicas of the partitioned model those GPUs hold (`r = ⌊G/p⌋`).
    pub replicas: usize,
    /// Queue length the plan was evaluated for (`x`, at least 1).
    pub queue: u32,
    /// Mean end-to-end latency of the `queue` requests, cold start included (`T̄(x)`).
    pub latency_s: f64,
    /// Cold start: the slowest partition's load time (`C`).
    pub cold_start_s: f64,
    /// Inference time of one request: executions plus transfers (`I`).
    pub inference_s: f64,
    /// Slowest pipeline stage, execution or transfer (`B`).
    pub bottleneck_s: f64,
    /// GPU-seconds held by one cold-started request (see the cost model).
    pub gpu_seconds: f64,
}

/// Prices for [`cost_optimal`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Price of one GPU-second (any currency). The cheapest plan does not depend on it as
    /// long as it is positive.
    pub price_per_gpu_s: f64,
    /// Seconds billed per GPU used on top of the held time (process start-up, minimum
    /// billing); 0 by default.
    pub per_gpu_overhead_s: f64,
}

impl Default for CostModel {
    /// An on-demand A10 (the thesis' testbed GPU) at about $0.75 per hour, no overhead.
    fn default() -> Self {
        Self {
            price_per_gpu_s: 0.75 / 3600.0,
            per_gpu_overhead_s: 0.0,
        }
    }
}

/// Why no partition plan could be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PartitionError {
    /// The profile is unusable.
    #[error("invalid profile: {0}")]
    InvalidProfile(#[from] ProfileError),
    /// The link bandwidth is NaN, zero or negative.
    #[error("link bandwidth {0} B/s is not a positive number")]
    InvalidLink(f64),
    /// Zero partitions were asked for.
    #[error("a plan needs at least one partition")]
    ZeroPartitions,
    /// More partitions than layer groups were asked for.
    #[error("{partitions} partitions asked for, but the model has only {groups} layer groups")]
    TooManyPartitions {
        /// Partitions asked for.
        partitions: usize,
        /// Layer groups in the profile.
        groups: usize,
    },
    /// Fewer GPUs than partitions.
    #[error("{partitions} partitions need at least as many GPUs, only {gpus} given")]
    NotEnoughGpus {
        /// Partitions asked for.
        partitions: usize,
        /// GPUs given.
        gpus: usize,
    },
    /// One layer group alone exceeds the GPU memory budget.
    #[error(
        "layer group {index} ({name:?}) has {weight_bytes} B of weights, more than the {gpu_memory} B GPU budget"
    )]
    GroupTooLarge {
        /// Index of the group.
        index: usize,
        /// Name of the group.
        name: String,
        /// Its weight bytes.
        weight_bytes: u64,
        /// The budget.
        gpu_memory: u64,
    },
    /// No split into the asked number of partitions fits the GPU memory budget.
    #[error("no split into {partitions} partitions fits {gpu_memory} B per GPU")]
    NoFeasiblePlan {
        /// Partitions asked for (the maximum, for searches over several counts).
        partitions: usize,
        /// The budget.
        gpu_memory: u64,
    },
}

/// Why [`cost_optimal`] found no plan.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NoPlan {
    /// Plans exist, but even the fastest misses the SLO.
    #[error("no partition plan meets the {slo_s} s SLO: the fastest takes {best_latency_s} s")]
    SloUnreachable {
        /// Latency of the fastest feasible plan (single cold-started request).
        best_latency_s: f64,
        /// The SLO asked for.
        slo_s: f64,
    },
    /// No plan exists at all (invalid input or nothing fits in GPU memory).
    #[error(transparent)]
    Infeasible(#[from] PartitionError),
}

/// The mean wait factor `w(x, r) = (1/x)·Σ_{y=1..x} (⌈y/r⌉ − 1)` of eq. 4.5/4.8.
pub fn wait_factor(queue: u32, replicas: usize) -> f64 {
    let x = u128::from(queue.max(1));
    let r = replicas.max(1) as u128;
    let q = x / r;
    let rem = x % r;
    let sum_ceil = r * q * (q + 1) / 2 + rem * (q + 1);
    (sum_ceil - x) as f64 / x as f64
}

/// `C + I + B·w`, skipping the product when `w = 0` (so an infinite `B` is harmless).
fn objective(cold: f64, inference: f64, bottleneck: f64, wait: f64) -> f64 {
    if wait == 0.0 {
        cold + inference
    } else {
        cold + inference + bottleneck * wait
    }
}

impl PartitionPlan {
    /// Number of partitions (`p`).
    pub fn partition_count(&self) -> usize {
        self.partitions.len()
    }

    /// End-to-end latency of the `position`-th queued request (1-based), `T(y)` of eq. 4.7.
    pub fn request_latency_s(&self, position: u32) -> f64 {
        let y = u64::from(position.max(1));
        let r = self.replicas.max(1) as u64;
        let rounds = y.div_ceil(r) - 1;
        objective(
            self.cold_start_s,
            self.inference_s,
            self.bottleneck_s,
            rounds as f64,
        )
    }

    /// Mean end-to-end latency of a burst of `queue` requests, `T̄(x)` of eq. 4.8.
    pub fn mean_latency_s(&self, queue: u32) -> f64 {
        objective(
            self.cold_start_s,
            self.inference_s,
            self.bottleneck_s,
            wait_factor(queue, self.replicas),
        )
    }

    /// Mean latency without pipelining (thesis Fig. 4.3): a replica takes the next request
    /// only when the previous one has left its last partition, so
    /// `T(y) = C + I·⌈y/r⌉`.
    pub fn mean_latency_unpipelined_s(&self, queue: u32) -> f64 {
        self.cold_start_s + self.inference_s * (1.0 + wait_factor(queue, self.replicas))
    }

    /// Cost of one cold-started request: `(gpu_seconds + p·overhead) × price`.
    pub fn cost(&self, model: &CostModel) -> f64 {
        self.billed_gpu_seconds(model) * model.price_per_gpu_s
    }

    fn billed_gpu_seconds(&self, model: &CostModel) -> f64 {
        self.gpu_seconds + self.partitions.len() as f64 * model.per_gpu_overhead_s
    }
}

/// The group chain with prefix sums, shared by the DPs, brute force and evaluation so that
/// they all compute identical figures.
struct Chain<'a> {
    groups: &'a [LayerGroup],
    load: Vec<f64>,
    exec: Vec<f64>,
    weight: Vec<u128>,
    /// `xfer[i]`: seconds to send group `i`'s output over the link.
    xfer: Vec<f64>,
}

impl<'a> Chain<'a> {
    fn new(profile: &'a ModelProfile, link_bps: f64) -> Result<Self, PartitionError> {
        profile.validate()?;
        if link_bps.is_nan() || link_bps <= 0.0 {
            return Err(PartitionError::InvalidLink(link_bps));
        }
        let n = profile.groups.len();
        let mut load = Vec::with_capacity(n + 1);
        let mut exec = Vec::with_capacity(n + 1);
        let mut weight = Vec::with_capacity(n + 1);
        load.push(0.0);
        exec.push(0.0);
        weight.push(0u128);
        for (i, g) in profile.groups.iter().enumerate() {
            load.push(load[i] + g.load_s);
            exec.push(exec[i] + g.exec_s);
            weight.push(weight[i] + u128::from(g.weight_bytes));
        }
        let xfer = profile
            .groups
            .iter()
            .map(|g| g.output_bytes as f64 / link_bps)
            .collect();
        Ok(Self {
            groups: &profile.groups,
            load,
            exec,
            weight,
            xfer,
        })
    }

    fn len(&self) -> usize {
        self.groups.len()
    }

    fn load(&self, r: &Range<usize>) -> f64 {
        self.load[r.end] - self.load[r.start]
    }

    fn exec(&self, r: &Range<usize>) -> f64 {
        self.exec[r.end] - self.exec[r.start]
    }

    fn weight(&self, r: &Range<usize>) -> u128 {
        self.weight[r.end] - self.weight[r.start]
    }

    fn exec_total(&self) -> f64 {
        self.exec[self.len()]
    }

    /// Rejects budgets that a single group already exceeds.
    fn check_groups_fit(&self, gpu_memory: u64) -> Result<(), PartitionError> {
        match self
            .groups
            .iter()
            .enumerate()
            .find(|(_, g)| g.weight_bytes > gpu_memory)
        {
            Some((index, g)) => Err(PartitionError::GroupTooLarge {
                index,
                name: g.name.clone(),
                weight_bytes: g.weight_bytes,
                gpu_memory,
            }),
            None => Ok(()),
        }
    }

    /// Evaluates the plan starting partitions at `cuts` (first 0, strictly increasing).
    fn evaluate(&self, cuts: &[usize], gpus: usize, queue: u32) -> PartitionPlan {
        let n = self.len();
        let p = cuts.len();
        let partitions: Vec<PartitionInfo> = (0..p)
            .map(|k| {
                let end = cuts.get(k + 1).copied().unwrap_or(n);
                let range = cuts[k]..end;
                PartitionInfo {
                    weight_bytes: u64::try_from(self.weight(&range)).unwrap_or(u64::MAX),
                    load_s: self.load(&range),
                    exec_s: self.exec(&range),
                    transfer_out_s: if k + 1 < p { self.xfer[end - 1] } else { 0.0 },
                    groups: range,
                }
            })
            .collect();
        let cold = partitions.iter().map(|q| q.load_s).fold(0.0, f64::max);
        let bottleneck = partitions
            .iter()
            .map(|q| q.exec_s.max(q.transfer_out_s))
            .fold(0.0, f64::max);
        // Same summation orders as the DPs: transfers left to right, the weighted sum right
        // to left.
        let transfers = partitions.iter().fold(0.0, |acc, q| acc + q.transfer_out_s);
        let inference = self.exec_total() + transfers;
        let weighted = partitions
            .iter()
            .rev()
            .enumerate()
            .fold(0.0, |acc, (s, q)| {
                acc + (s + 1) as f64 * (q.exec_s + q.transfer_out_s)
            });
        let replicas = gpus / p.max(1);
        let queue = queue.max(1);
        PartitionPlan {
            cuts: cuts.to_vec(),
            partitions,
            gpus,
            replicas,
            queue,
            latency_s: objective(cold, inference, bottleneck, wait_factor(queue, replicas)),
            cold_start_s: cold,
            inference_s: inference,
            bottleneck_s: bottleneck,
            gpu_seconds: p as f64 * cold + weighted,
        }
    }
}

/// Something kept on a Pareto front: dominated entries are dropped.
trait Dominance {
    /// True when `self` is at least as good as `other` on every criterion.
    fn dominates(&self, other: &Self) -> bool;
}

fn insert_pareto<E: Dominance>(front: &mut Vec<E>, candidate: E) {
    if front.iter().any(|e| e.dominates(&candidate)) {
        return;
    }
    front.retain(|e| !candidate.dominates(e));
    front.push(candidate);
}

/// Latency DP entry for the prefix `[0, j)` split into `c` partitions.
#[derive(Debug, Clone, Copy)]
struct PrefixEntry {
    cold: f64,
    bottleneck: f64,
    transfers: f64,
    /// First group of the last partition.
    start: usize,
    /// Index of the predecessor in the front of (start, c − 1).
    prev: usize,
}

impl Dominance for PrefixEntry {
    fn dominates(&self, o: &Self) -> bool {
        self.cold <= o.cold && self.bottleneck <= o.bottleneck && self.transfers <= o.transfers
    }
}

/// Runs the latency DP up to `max_p` partitions; returns, for each `p = 1..=max_p`, the cut
/// sets on the Pareto front of `(C, B, Σ n)` for the whole chain.
fn latency_fronts(chain: &Chain<'_>, max_p: usize, gpu_memory: u64) -> Vec<Vec<Vec<usize>>> {
    let n = chain.len();
    let budget = u128::from(gpu_memory);
    // fronts[c - 1][j]: prefix [0, j) in c partitions.
    let mut fronts: Vec<Vec<Vec<PrefixEntry>>> = Vec::with_capacity(max_p);
    let mut first = vec![Vec::new(); n + 1];
    for (j, front) in first.iter_mut().enumerate().skip(1) {
        let r = 0..j;
        if chain.weight(&r) <= budget {
            front.push(PrefixEntry {
                cold: chain.load(&r),
                bottleneck: chain.exec(&r),
                transfers: 0.0,
                start: 0,
                prev: 0,
            });
        }
    }
    fronts.push(first);
    for c in 2..=max_p {
        let prev = &fronts[c - 2];
        let mut layer = vec![Vec::new(); n + 1];
        for (j, front) in layer.iter_mut().enumerate().skip(c) {
            // Last partition [i, j); it grows as i decreases, so stop once it is too heavy.
            for i in (c - 1..j).rev() {
                let r = i..j;
                if chain.weight(&r) > budget {
                    break;
                }
                let (load, exec, xfer) = (chain.load(&r), chain.exec(&r), chain.xfer[i - 1]);
                for (idx, e) in prev[i].iter().enumerate() {
                    insert_pareto(
                        front,
                        PrefixEntry {
                            cold: e.cold.max(load),
                            bottleneck: e.bottleneck.max(xfer).max(exec),
                            transfers: e.transfers + xfer,
                            start: i,
                            prev: idx,
                        },
                    );
                }
            }
        }
        fronts.push(layer);
    }
    (1..=max_p)
        .map(|p| {
            (0..fronts[p - 1][n].len())
                .map(|idx| {
                    let mut cuts = Vec::with_capacity(p);
                    let (mut c, mut j, mut k) = (p, n, idx);
                    while c >= 1 {
                        let e = fronts[c - 1][j][k];
                        cuts.push(e.start);
                        j = e.start;
                        k = e.prev;
                        c -= 1;
                    }
                    cuts.reverse();
                    cuts
                })
                .collect()
        })
        .collect()
}

/// Input checks shared by [`optimal_plan_on_gpus`] and [`brute_force_plan_on_gpus`].
fn prepare<'a>(
    profile: &'a ModelProfile,
    p: usize,
    gpus: usize,
    gpu_memory: u64,
    link_bps: f64,
) -> Result<Chain<'a>, PartitionError> {
    let chain = Chain::new(profile, link_bps)?;
    if p == 0 {
        return Err(PartitionError::ZeroPartitions);
    }
    if p > chain.len() {
        return Err(PartitionError::TooManyPartitions {
            partitions: p,
            groups: chain.len(),
        });
    }
    if gpus < p {
        return Err(PartitionError::NotEnoughGpus {
            partitions: p,
            gpus,
        });
    }
    chain.check_groups_fit(gpu_memory)?;
    Ok(chain)
}

/// Picks the plan with the lowest mean latency (first one on ties).
fn pick_fastest(plans: impl Iterator<Item = PartitionPlan>) -> Option<PartitionPlan> {
    plans.fold(None, |best: Option<PartitionPlan>, plan| match best {
        Some(b) if b.latency_s <= plan.latency_s => Some(b),
        _ => Some(plan),
    })
}

/// The latency-optimal plan with exactly `p` partitions for a burst of `queue` requests
/// served by one replica of the partitioned model (`p` GPUs): see
/// [`optimal_plan_on_gpus`].
pub fn optimal_plan(
    profile: &ModelProfile,
    p: usize,
    gpu_memory: u64,
    queue: u32,
    link_bps: f64,
) -> Result<PartitionPlan, PartitionError> {
    optimal_plan_on_gpus(profile, p, p, gpu_memory, queue, link_bps)
}

/// The plan with exactly `p` partitions, each within `gpu_memory` bytes, minimising the
/// mean end-to-end latency `T̄(x) = C + I + B·w(x, ⌊gpus/p⌋)` of `queue` requests (0 counts
/// as 1). Exact: a DP over (end group, partitions) keeping Pareto fronts of
/// `(C, B, Σ n_k)`; O(p·n²·F²) for fronts of size F (F = 1 for uniform layers).
pub fn optimal_plan_on_gpus(
    profile: &ModelProfile,
    p: usize,
    gpus: usize,
    gpu_memory: u64,
    queue: u32,
    link_bps: f64,
) -> Result<PartitionPlan, PartitionError> {
    let chain = prepare(profile, p, gpus, gpu_memory, link_bps)?;
    let fronts = latency_fronts(&chain, p, gpu_memory);
    let last = fronts.last().map(Vec::as_slice).unwrap_or(&[]);
    pick_fastest(last.iter().map(|cuts| chain.evaluate(cuts, gpus, queue))).ok_or(
        PartitionError::NoFeasiblePlan {
            partitions: p,
            gpu_memory,
        },
    )
}

/// Calls `visit` with every set of partition starts (first 0) splitting `n` groups into
/// exactly `p` partitions.
fn for_each_cut_set(n: usize, p: usize, visit: &mut dyn FnMut(&[usize])) {
    fn rec(n: usize, p: usize, cuts: &mut Vec<usize>, visit: &mut dyn FnMut(&[usize])) {
        if cuts.len() == p {
            visit(cuts);
            return;
        }
        let last = cuts.last().copied().unwrap_or(0);
        let remaining = p - cuts.len();
        // The next start leaves at least `remaining - 1` groups for the partitions after it.
        for next in last + 1..=n - remaining {
            cuts.push(next);
            rec(n, p, cuts, visit);
            cuts.pop();
        }
    }
    if p == 0 || p > n {
        return;
    }
    let mut cuts = vec![0];
    rec(n, p, &mut cuts, visit);
}

fn fits(chain: &Chain<'_>, cuts: &[usize], gpu_memory: u64) -> bool {
    let n = chain.len();
    cuts.iter().enumerate().all(|(k, &start)| {
        let end = cuts.get(k + 1).copied().unwrap_or(n);
        chain.weight(&(start..end)) <= u128::from(gpu_memory)
    })
}

/// [`optimal_plan`] by exhaustive search over every cut set (exponential; for tests).
pub fn brute_force_plan(
    profile: &ModelProfile,
    p: usize,
    gpu_memory: u64,
    queue: u32,
    link_bps: f64,
) -> Result<PartitionPlan, PartitionError> {
    brute_force_plan_on_gpus(profile, p, p, gpu_memory, queue, link_bps)
}

/// [`optimal_plan_on_gpus`] by exhaustive search over every cut set (for tests).
pub fn brute_force_plan_on_gpus(
    profile: &ModelProfile,
    p: usize,
    gpus: usize,
    gpu_memory: u64,
    queue: u32,
    link_bps: f64,
) -> Result<PartitionPlan, PartitionError> {
    let chain = prepare(profile, p, gpus, gpu_memory, link_bps)?;
    let mut plans = Vec::new();
    for_each_cut_set(chain.len(), p, &mut |cuts| {
        if fits(&chain, cuts, gpu_memory) {
            plans.push(chain.evaluate(cuts, gpus, queue));
        }
    });
    pick_fastest(plans.into_iter()).ok_or(PartitionError::NoFeasiblePlan {
        partitions: p,
        gpu_memory,
    })
}

/// A run of queue lengths that share the same best plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueRange {
    /// First queue length of the run.
    pub first_queue: u32,
    /// Last queue length of the run (inclusive).
    pub last_queue: u32,
    /// The best plan, evaluated at `first_queue` (use
    /// [`PartitionPlan::mean_latency_s`] for the others).
    pub plan: PartitionPlan,
}

/// Precomputed partition plans for one model (Flashpoint §4.2.2): a pure value, stored with
/// the model and recomputed when its profile changes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanTable {
    /// Model the table was computed for.
    pub model: String,
    /// Largest partition count considered (`P`), also the GPUs each plan is compared on.
    pub max_partitions: usize,
    /// GPU memory budget per partition, bytes.
    pub gpu_memory: u64,
    /// Link bandwidth between partitions, bytes/s.
    pub link_bps: f64,
    /// Largest queue length the ranges cover.
    pub max_queue: u32,
    /// For `p = 1..=P` (index `p − 1`): the Pareto-optimal plans with `p` partitions, each
    /// evaluated at queue length 1 on `P` GPUs. Empty when no `p`-split fits.
    pub candidates: Vec<Vec<PartitionPlan>>,
    /// Best plan per queue length, as consecutive runs covering `1..=max_queue`.
    pub ranges: Vec<QueueRange>,
}

impl PlanTable {
    /// The best plan for `queue` waiting requests (clamped to `1..=max_queue`), or `None`
    /// for a table without ranges (only possible for a hand-made or corrupt value).
    pub fn best_for(&self, queue: u32) -> Option<&PartitionPlan> {
        let queue = queue.clamp(1, self.max_queue.max(1));
        let idx = self.ranges.partition_point(|r| r.last_queue < queue);
        self.ranges.get(idx).map(|r| &r.plan)
    }

    /// The best plan with exactly `p` partitions for `queue` requests on this table's GPUs
    /// (used when the autoscaler adds fewer GPUs than the best plan needs).
    pub fn best_with_partitions(&self, p: usize, queue: u32) -> Option<PartitionPlan> {
        let candidates = self.candidates.get(p.checked_sub(1)?)?;
        let best = candidates
            .iter()
            .fold(None, |best: Option<&PartitionPlan>, c| match best {
                Some(b) if b.mean_latency_s(queue) <= c.mean_latency_s(queue) => Some(b),
                _ => Some(c),
            })?;
        let mut plan = best.clone();
        plan.queue = queue.max(1);
        plan.latency_s = plan.mean_latency_s(queue);
        Some(plan)
    }

    /// The best (partition count, candidate index) for `queue`: lowest mean latency, ties to
    /// fewer partitions.
    fn argmin(&self, queue: u32) -> (usize, usize) {
        let mut best = (0, 0);
        let mut best_latency = f64::INFINITY;
        let mut found = false;
        for (pi, cands) in self.candidates.iter().enumerate() {
            for (ci, c) in cands.iter().enumerate() {
                let l = c.mean_latency_s(queue);
                if !found || l < best_latency {
                    best = (pi, ci);
                    best_latency = l;
                    found = true;
                }
            }
        }
        best
    }
}

/// How [`build_table`] finds where the best plan changes.
#[derive(Clone, Copy)]
enum QueueSearch {
    /// Flashpoint §4.2.2: probe 1, 2, 4, …, binary search between differing probes.
    Exponential,
    /// Evaluate every queue length.
    Exhaustive,
}

/// Precomputes the best plan for every partition count `p ≤ max_partitions` and, for queue
/// lengths `1..=max_queue`, the best partition count when `max_partitions` GPUs are
/// available (eq. 4.5: `⌊P/p⌋` replicas), locating the queue lengths where the best plan
/// changes by exponential search (1, 2, 4, …, `max_queue`) plus binary search, as in
/// Flashpoint §4.2.2. Partition counts above the number of groups are skipped.
///
/// Exact at every probed queue length; between two probes with the same best plan the
/// thesis assumes nothing changes, which the `⌈y/r⌉` rounding can violate (module docs).
/// [`precompute_exhaustive`] is exact everywhere.
pub fn precompute(
    profile: &ModelProfile,
    max_partitions: usize,
    gpu_memory: u64,
    link_bps: f64,
    max_queue: u32,
) -> Result<PlanTable, PartitionError> {
    build_table(
        profile,
        max_partitions,
        gpu_memory,
        link_bps,
        max_queue,
        QueueSearch::Exponential,
    )
}

/// [`precompute`], evaluating every queue length in `1..=max_queue` (O(max_queue × number
/// of candidate plans) after the DP): exact everywhere.
pub fn precompute_exhaustive(
    profile: &ModelProfile,
    max_partitions: usize,
    gpu_memory: u64,
    link_bps: f64,
    max_queue: u32,
) -> Result<PlanTable, PartitionError> {
    build_table(
        profile,
        max_partitions,
        gpu_memory,
        link_bps,
        max_queue,
        QueueSearch::Exhaustive,
    )
}

fn build_table(
    profile: &ModelProfile,
    max_partitions: usize,
    gpu_memory: u64,
    link_bps: f64,
    max_queue: u32,
    search: QueueSearch,
) -> Result<PlanTable, PartitionError> {
    let chain = Chain::new(profile, link_bps)?;
    if max_partitions == 0 {
        return Err(PartitionError::ZeroPartitions);
    }
    chain.check_groups_fit(gpu_memory)?;
    let max_p = max_partitions.min(chain.len());
    let gpus = max_partitions;
    let candidates: Vec<Vec<PartitionPlan>> = latency_fronts(&chain, max_p, gpu_memory)
        .iter()
        .map(|sets| {
            sets.iter()
                .map(|cuts| chain.evaluate(cuts, gpus, 1))
                .collect()
        })
        .collect();
    if candidates.iter().all(Vec::is_empty) {
        return Err(PartitionError::NoFeasiblePlan {
            partitions: max_p,
            gpu_memory,
        });
    }
    let max_queue = max_queue.max(1);
    let mut table = PlanTable {
        model: profile.model.clone(),
        max_partitions,
        gpu_memory,
        link_bps,
        max_queue,
        candidates,
        ranges: Vec::new(),
    };

    // Change points: (first queue length, best key) in increasing order.
    let mut changes: Vec<(u32, (usize, usize))> = vec![(1, table.argmin(1))];
    match search {
        QueueSearch::Exhaustive => {
            for x in 2..=max_queue {
                let key = table.argmin(x);
                if changes.last().map(|c| c.1) != Some(key) {
                    changes.push((x, key));
                }
            }
        }
        QueueSearch::Exponential => {
            let mut lo = 1u32;
            let mut lo_key = changes[0].1;
            while lo < max_queue {
                let hi = lo.saturating_mul(2).min(max_queue);
                let hi_key = table.argmin(hi);
                refine(&table, lo, lo_key, hi, hi_key, &mut changes);
                lo = hi;
                lo_key = hi_key;
            }
        }
    }

    table.ranges = changes
        .iter()
        .enumerate()
        .map(|(i, &(first, (pi, ci)))| {
            let last = changes.get(i + 1).map_or(max_queue, |next| next.0 - 1);
            let mut plan = table.candidates[pi][ci].clone();
            plan.queue = first;
            plan.latency_s = plan.mean_latency_s(first);
            QueueRange {
                first_queue: first,
                last_queue: last,
                plan,
            }
        })
        .collect();
    Ok(table)
}

/// Binary search for change points in `(lo, hi]` given the best keys at both ends; appends
/// them in increasing order. Equal keys at both ends are taken to mean no change between
/// (the thesis' assumption).
fn refine(
    table: &PlanTable,
    lo: u32,
    lo_key: (usize, usize),
    hi: u32,
    hi_key: (usize, usize),
    changes: &mut Vec<(u32, (usize, usize))>,
) {
    if lo_key == hi_key {
        return;
    }
    if hi - lo <= 1 {
        changes.push((hi, hi_key));
        return;
    }
    let mid = lo + (hi - lo) / 2;
    let mid_key = table.argmin(mid);
    refine(table, lo, lo_key, mid, mid_key, changes);
    refine(table, mid, mid_key, hi, hi_key, changes);
}

/// Cost DP entry for the suffix `[i, n)` split into `s` partitions.
#[derive(Debug, Clone, Copy)]
struct SuffixEntry {
    cold: f64,
    transfers: f64,
    /// `Σ (partitions from k to the end) × (e_k + n_k)` over the suffix's partitions.
    weighted: f64,
    /// End (exclusive) of the suffix's first partition.
    end: usize,
    /// Index of the successor in the front of (end, s − 1).
    next: usize,
}

impl Dominance for SuffixEntry {
    fn dominates(&self, o: &Self) -> bool {
        self.cold <= o.cold && self.transfers <= o.transfers && self.weighted <= o.weighted
    }
}

/// For `p = 1..=max_p`: the cut sets on the Pareto front of `(C, Σ n, weighted Σ)`.
fn cost_fronts(chain: &Chain<'_>, max_p: usize, gpu_memory: u64) -> Vec<Vec<Vec<usize>>> {
    let n = chain.len();
    let budget = u128::from(gpu_memory);
    // fronts[s - 1][i]: suffix [i, n) in s partitions.
    let mut fronts: Vec<Vec<Vec<SuffixEntry>>> = Vec::with_capacity(max_p);
    let mut first = vec![Vec::new(); n + 1];
    for (i, front) in first.iter_mut().enumerate().take(n) {
        let r = i..n;
        if chain.weight(&r) <= budget {
            front.push(SuffixEntry {
                cold: chain.load(&r),
                transfers: 0.0,
                weighted: 0.0 + chain.exec(&r),
                end: n,
                next: 0,
            });
        }
    }
    fronts.push(first);
    for s in 2..=max_p {
        let next_layer = &fronts[s - 2];
        let mut layer = vec![Vec::new(); n + 1];
        for (i, front) in layer.iter_mut().enumerate().take((n + 1).saturating_sub(s)) {
            // First partition [i, j); the rest [j, n) needs s − 1 groups at least.
            // j runs over i + 1..=n − (s − 1).
            for (j, next_front) in next_layer.iter().enumerate().take(n + 2 - s).skip(i + 1) {
                let r = i..j;
                if chain.weight(&r) > budget {
                    break;
                }
                let (load, exec, xfer) = (chain.load(&r), chain.exec(&r), chain.xfer[j - 1]);
                for (idx, e) in next_front.iter().enumerate() {
                    insert_pareto(
                        front,
                        SuffixEntry {
                            cold: e.cold.max(load),
                            transfers: e.transfers + xfer,
                            weighted: e.weighted + s as f64 * (exec + xfer),
                            end: j,
                            next: idx,
                        },
                    );
                }
            }
        }
        fronts.push(layer);
    }
    (1..=max_p)
        .map(|p| {
            (0..fronts[p - 1][0].len())
                .map(|idx| {
                    let mut cuts = Vec::with_capacity(p);
                    let (mut s, mut i, mut k) = (p, 0, idx);
                    while s >= 1 {
                        let e = fronts[s - 1][i][k];
                        cuts.push(i);
                        i = e.end;
                        k = e.next;
                        s -= 1;
                    }
                    cuts
                })
                .collect()
        })
        .collect()
}

/// Chooses among candidate plans (each evaluated for one cold-started request on `p` GPUs):
/// the cheapest meeting the SLO, ties to the faster, then to the earlier.
fn pick_cheapest(
    plans: impl Iterator<Item = PartitionPlan>,
    slo_s: f64,
    cost: &CostModel,
    max_p: usize,
    gpu_memory: u64,
) -> Result<PartitionPlan, NoPlan> {
    let mut best: Option<PartitionPlan> = None;
    let mut fastest: Option<f64> = None;
    for plan in plans {
        fastest = Some(fastest.map_or(plan.latency_s, |f: f64| f.min(plan.latency_s)));
        let meets_slo = plan.latency_s <= slo_s;
        if !meets_slo {
            continue;
        }
        let better = match &best {
            None => true,
            Some(b) => {
                let (pc, bc) = (plan.billed_gpu_seconds(cost), b.billed_gpu_seconds(cost));
                pc < bc || (pc == bc && plan.latency_s < b.latency_s)
            }
        };
        if better {
            best = Some(plan);
        }
    }
    match (best, fastest) {
        (Some(plan), _) => Ok(plan),
        (None, Some(best_latency_s)) => Err(NoPlan::SloUnreachable {
            best_latency_s,
            slo_s,
        }),
        (None, None) => Err(NoPlan::Infeasible(PartitionError::NoFeasiblePlan {
            partitions: max_p,
            gpu_memory,
        })),
    }
}

fn prepare_cost<'a>(
    profile: &'a ModelProfile,
    gpu_memory: u64,
    link_bps: f64,
    max_partitions: usize,
) -> Result<(Chain<'a>, usize), PartitionError> {
    let chain = Chain::new(profile, link_bps)?;
    if max_partitions == 0 {
        return Err(PartitionError::ZeroPartitions);
    }
    chain.check_groups_fit(gpu_memory)?;
    let max_p = max_partitions.min(chain.len());
    Ok((chain, max_p))
}

/// The cheapest plan with at most `max_partitions` partitions (each within `gpu_memory`)
/// whose cold-started single request, `T(1) = C + I`, meets `slo_s` — cost per the module
/// docs: `((p·C + Σ_k (p − k + 1)(e_k + n_k)) + p·overhead) × price`. Exact (Pareto DP);
/// equals [`cost_optimal_brute_force`]. The chosen plan's fields are evaluated on `p` GPUs
/// with queue length 1.
pub fn cost_optimal(
    profile: &ModelProfile,
    slo_s: f64,
    gpu_memory: u64,
    link_bps: f64,
    max_partitions: usize,
    cost: &CostModel,
) -> Result<PartitionPlan, NoPlan> {
    let (chain, max_p) = prepare_cost(profile, gpu_memory, link_bps, max_partitions)?;
    let fronts = cost_fronts(&chain, max_p, gpu_memory);
    let plans = fronts
        .iter()
        .flatten()
        .map(|cuts| chain.evaluate(cuts, cuts.len(), 1));
    pick_cheapest(plans, slo_s, cost, max_p, gpu_memory)
}

/// [`cost_optimal`] by exhaustive search over every cut set (exponential; for tests).
pub fn cost_optimal_brute_force(
    profile: &ModelProfile,
    slo_s: f64,
    gpu_memory: u64,
    link_bps: f64,
    max_partitions: usize,
    cost: &CostModel,
) -> Result<PartitionPlan, NoPlan> {
    let (chain, max_p) = prepare_cost(profile, gpu_memory, link_bps, max_partitions)?;
    let mut plans = Vec::new();
    for p in 1..=max_p {
        for_each_cut_set(chain.len(), p, &mut |cuts| {
            if fits(&chain, cuts, gpu_memory) {
                plans.push(chain.evaluate(cuts, p, 1));
            }
        });
    }
    pick_cheapest(plans.into_iter(), slo_s, cost, max_p, gpu_memory)
}

/// Link bandwidth of [`flashpoint_example`]: 1 GB/s, so each 1 GB activation takes 1 s.
pub const FLASHPOINT_EXAMPLE_LINK_BPS: f64 = 1e9;

/// The worked example of Flashpoint Figs. 4.2–4.4: a model whose request takes 4 s on one
/// GPU and whose cold start is 24 s, as two equal halves (12 s load, 2 s execution each)
/// with a 1 s activation transfer between them (1 GB at
/// [`FLASHPOINT_EXAMPLE_LINK_BPS`]). Eight requests wait; two GPUs are available.
///
/// Thesis figures: full model on both GPUs, mean 34 s (24 + (4+8+12+16)/4); two partitions
/// without pipelining, mean 34.5 s (12 + 5·(1+…+8)/8); with pipelining, mean 24 s
/// (12 + (5+7+…+19)/8).
pub fn flashpoint_example() -> ModelProfile {
    let half = |name: &str| LayerGroup {
        name: name.to_owned(),
        weight_bytes: 1_000_000_000,
        load_s: 12.0,
        exec_s: 2.0,
        output_bytes: 1_000_000_000,
    };
    ModelProfile {
        model: "flashpoint-fig-4.2".to_owned(),
        groups: vec![half("first half"), half("second half")],
        estimated: false,
        notes: vec!["Flashpoint thesis Figs. 4.2-4.4 worked example".to_owned()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_factor_matches_direct_sum() {
        for r in 1..6usize {
            for x in 1..40u32 {
                let direct: u64 = (1..=u64::from(x)).map(|y| y.div_ceil(r as u64) - 1).sum();
                let expect = direct as f64 / f64::from(x);
                assert!((wait_factor(x, r) - expect).abs() < 1e-12, "x={x} r={r}");
            }
        }
        assert_eq!(wait_factor(0, 0), 0.0);
    }

    #[test]
    fn flashpoint_worked_example() {
        let profile = flashpoint_example();
        let mem = 2_000_000_000;
        let link = FLASHPOINT_EXAMPLE_LINK_BPS;
        let full = optimal_plan_on_gpus(&profile, 1, 2, mem, 8, link).unwrap();
        assert_eq!(full.replicas, 2);
        assert_eq!(full.cold_start_s, 24.0);
        assert_eq!(full.latency_s, 34.0);
        let split = optimal_plan_on_gpus(&profile, 2, 2, mem, 8, link).unwrap();
        assert_eq!(split.cuts, vec![0, 1]);
        assert_eq!(split.cold_start_s, 12.0);
        assert_eq!(split.inference_s, 5.0);
        assert_eq!(split.bottleneck_s, 2.0);
        assert_eq!(split.latency_s, 24.0);
        assert_eq!(split.mean_latency_unpipelined_s(8), 34.5);
        assert_eq!(full.mean_latency_unpipelined_s(8), 34.0);
        // Fig. 4.4: requests finish 5, 7, …, 19 s after the 12 s cold start.
        for y in 1..=8u32 {
            assert_eq!(
                split.request_latency_s(y),
                12.0 + 5.0 + 2.0 * f64::from(y - 1)
            );
        }
        let table = precompute(&profile, 2, mem, link, 8).unwrap();
        assert_eq!(table.best_for(8).unwrap().partition_count(), 2);
        assert_eq!(table.best_for(8).unwrap().mean_latency_s(8), 24.0);
    }
}
