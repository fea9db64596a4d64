//! # shardcast-placement
//!
//! Where a model's replicas go and how its bytes get there: pure functions over plain data
//! (no I/O, no clock, no async), so the controller, the tests and the cluster simulator run
//! the same code. The controller builds a [`HostInfo`] per host from heartbeats, calls
//! [`plan`], sends each [`ChainPlan`] to its chain head, and calls [`reserve`] on its own
//! view so that a second plan made before the next heartbeats does not double-book.
//!
//! Based on the Flashpoint thesis, §5.2 (remote memory pooling, hierarchical sourcing,
//! Pareto-optimal greedy placement, burst download sharing) and ch. 6 (chained transfers).
//!
//! ## The algorithm
//!
//! 1. **Receivers** ([`choose_receivers`], module `receivers`). A host that already holds a
//!    complete copy in the needed tier is a replica at no cost ([`ReceiverKind::Local`]); a
//!    host already receiving the model in a plan in flight joins that transfer
//!    ([`ReceiverKind::Joined`], the thesis' *burst download sharing*, §5.2.4: one download
//!    per host however many GPUs on it wait for the model). For GPU replicas the choice is
//!    the thesis' two-stage Pareto-greedy placement: first every free GPU on hosts that hold
//!    the model in memory (or are receiving it), then ONE GPU on each new host, preferring
//!    hosts in racks that already hold the model; only if that is still short, more GPUs on
//!    the hosts already chosen, round robin.
//! 2. **Sources** (module `chains`), hierarchical: a receiver's own memory tier (that is
//!    `Local`: nothing moves), a peer's memory tier (same rack first), a peer's disk tier,
//!    and last the origin (cloud storage). Hosts still receiving are never sources.
//! 3. **Chains** (module `chains`): receivers are split about evenly over chains (sizes
//!    differ by at most one, none longer than [`PlanParams::max_chain_len`]), each headed by a
//!    source and ordered so that consecutive hops share a rack. With several sources and a
//!    multi-shard model, *striping* (one chain per source, each carrying a byte-balanced
//!    subset of the shards through all receivers) is chosen when its estimate is lower.
//! 4. **Estimates** ([`estimate_chain_s`], module `estimate`): a chain takes about
//!    `bytes / B + (hops - 1) * chunk / B`, `B` its bottleneck rate.
//!
//! ## Example
//!
//! ```
//! use shardcast_placement::*;
//!
//! let host = |id: &str, rack: &str| HostInfo {
//!     id: id.into(),
//!     rack: rack.into(),
//!     up: true,
//!     mem_free: 64 << 30,
//!     gpus: 8,
//!     gpus_free: 8,
//!     ..HostInfo::default()
//! };
//! let model = ModelSpec { key: "9f2c".into(), shard_bytes: vec![4 << 30; 2], chunk_size: 4 << 20 };
//! let mut holder = host("a", "r1");
//! holder.holdings.insert(model.key.clone(), Held { memory: true, ..Held::default() });
//! let mut cluster = vec![holder, host("b", "r1"), host("c", "r2")];
//!
//! let req = PlanRequest { model: &model, target: Target::Replicas(10), tier: Tier::Gpu, in_flight: &[] };
//! let plan = plan(&cluster, &req, &PlanParams::default())?;
//! // All 8 GPUs on `a` (it holds the model in memory), then one GPU on each new host.
//! assert_eq!(plan.receivers[0].gpus, 8);
//! assert_eq!(plan.new_receivers().collect::<Vec<_>>(), ["b", "c"]);
//! // One chain from a's memory tier, in-rack hop first: a -> b -> c.
//! assert_eq!(plan.chains.len(), 1);
//! assert_eq!(plan.chains[0].source, Source::Peer { host: "a".into(), tier: Tier::Memory });
//! assert_eq!(plan.chains[0].hops, ["b", "c"]);
//! reserve(&mut cluster, &model, Tier::Gpu, &plan);
//! # Ok::<(), PlanError>(())
//! ```
//!
//! ## Where this deviates from the thesis' Listing 5.1
//!
//! Listing 5.1 (`get_receivers`) does not do what its prose says, so this crate implements
//! the prose:
//!
//! * `leftover_scale` is never initialised from `scale`, and `fd` is undefined.
//! * The inner `break` runs after the *first* GPU of every host whether or not it was
//!   allocated, so the listing never takes a second GPU on a host, not even on hosts that
//!   already hold the model (stage 1 of the prose: "fully utilize primed GPUs").
//! * It makes one pass over hosts in inventory order, so holders are not visited first; the
//!   prose's two stages need holders first and new hosts second.
//! * When the cluster cannot supply `scale` GPUs it silently returns fewer; here that is
//!   [`PlanError::NotEnoughCapacity`], and before giving up a third stage adds more GPUs on
//!   hosts already chosen (the prose's "distribute across hosts" is a preference, not a
//!   reason to fail).
//! * New hosts are ordered (racks that hold the model first, then most free memory, then id)
//!   rather than taken in inventory order, and every result is deterministic.
//!
//! Goals: fast (well under 1 ms for 1000 hosts × 100 models: each host's holdings are
//! looked up for the one model only), deterministic, never panics on any input.
//! Non-goals: GPU choice inside a host (gpu-loader), eviction, partition plans, network
//! topology beyond racks.

#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod chains;
mod estimate;
mod receivers;
mod view;

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

pub use chains::plan_chains;
pub use estimate::estimate_chain_s;
pub use receivers::choose_receivers;

/// Where a copy lives: the domain's one tier, defined in `shardcast_protocol` (floor 0) so
/// the data plane, the controller and placement name the same type.
pub use shardcast_protocol::Tier;

/// What one host holds of one model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    /// A complete verified copy is in the memory tier.
    pub memory: bool,
    /// A complete verified copy is in the disk tier.
    pub disk: bool,
    /// A plan in flight is sending this host the model. Set by [`reserve`]; the controller
    /// clears it when the transfer ends or fails (or the next heartbeat replaces the entry).
    /// Treated like being listed in [`PlanRequest::in_flight`]: the host joins, it is not
    /// sent the model again and it is not a source.
    #[serde(default)]
    pub receiving: bool,
}

/// One host as the controller last saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostInfo {
    /// Host id, unique in the cluster.
    pub id: String,
    /// Rack (top-of-rack switch); `""` = unknown, which never matches another rack.
    pub rack: String,
    /// Zone (failure domain above racks); informational today.
    pub zone: String,
    /// The host is alive (recent heartbeat). Hosts that are down are never chosen.
    pub up: bool,
    /// NIC rate, bytes per second (0 = unknown; estimates use
    /// [`PlanParams::default_nic_bps`]).
    pub nic_bps: u64,
    /// Memory-tier capacity, bytes.
    pub mem_capacity: u64,
    /// Memory-tier bytes free.
    pub mem_free: u64,
    /// Disk-tier capacity, bytes.
    pub disk_capacity: u64,
    /// Disk-tier bytes free.
    pub disk_free: u64,
    /// Total GPUs.
    pub gpus: u32,
    /// GPUs not running a replica.
    pub gpus_free: u32,
    /// Models this host holds: model key (hex digest string) -> what it holds.
    pub holdings: HashMap<String, Held>,
}

/// The model to place.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Model key (hex digest of its manifest), as used in [`HostInfo::holdings`].
    pub key: String,
    /// Size of each shard, bytes; shard `i` is index `i` in [`ChainPlan::shards`].
    pub shard_bytes: Vec<u64>,
    /// Chunk size, bytes: the unit a hop verifies and forwards (chain fill time).
    pub chunk_size: u64,
}

impl ModelSpec {
    /// Total bytes (sum of the shards, saturating).
    pub fn total_bytes(&self) -> u64 {
        self.shard_bytes
            .iter()
            .fold(0u64, |acc, &b| acc.saturating_add(b))
    }
}

/// How many replicas, or where.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// `k` replicas anywhere: `k` hosts for `Memory`/`Disk`, `k` GPU slots for `Gpu`.
    Replicas(u32),
    /// Exactly these hosts (one GPU on each for `Gpu`).
    Hosts(Vec<String>),
}

/// Tuning for chain planning and estimates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlanParams {
    /// Most hops per chain, head not counted. Default 16: past that, one slow or failing
    /// hop stalls too many receivers, and the fill time `(hops - 1) * chunk / B` stops
    /// being negligible next to `S / B`.
    pub max_chain_len: usize,
    /// Expected origin (cloud storage) read rate, bytes/s, per reader. Default 250 Mbit/s,
    /// a typical single-stream object-store read.
    pub origin_bps: u64,
    /// NIC rate used when a host reports 0, bytes/s. Default 10 Gbit/s.
    pub default_nic_bps: u64,
    /// A peer's disk-tier read rate, bytes/s. Default 1 GB/s (one NVMe drive, sequential).
    pub disk_read_bps: u64,
    /// Allow striping shards over several sources. Default true.
    pub stripe: bool,
}

impl Default for PlanParams {
    fn default() -> Self {
        Self {
            max_chain_len: 16,
            origin_bps: 250_000_000 / 8,
            default_nic_bps: 10_000_000_000 / 8,
            disk_read_bps: 1_000_000_000,
            stripe: true,
        }
    }
}

impl PlanParams {
    /// The NIC rate estimates use for `host`: its reported rate, or
    /// [`default_nic_bps`](Self::default_nic_bps) when it reports 0.
    pub fn nic_bps(&self, host: &HostInfo) -> u64 {
        view::nic_bps(Some(host), self)
    }

    fn validate(&self) -> Result<(), PlanError> {
        let bad = |what: &str| {
            Err(PlanError::InvalidRequest(format!(
                "{what} must be greater than zero"
            )))
        };
        if self.max_chain_len == 0 {
            bad("max_chain_len")
        } else if self.origin_bps == 0 {
            bad("origin_bps")
        } else if self.default_nic_bps == 0 {
            bad("default_nic_bps")
        } else if self.disk_read_bps == 0 {
            bad("disk_read_bps")
        } else {
            Ok(())
        }
    }
}

/// One placement request.
#[derive(Debug, Clone)]
pub struct PlanRequest<'a> {
    /// The model.
    pub model: &'a ModelSpec,
    /// How many replicas, or where.
    pub target: Target,
    /// The tier the replicas need.
    pub tier: Tier,
    /// Hosts already receiving this model in a plan in flight (download sharing): they must
    /// not be sent the model again; they count as holders for receiver choice.
    pub in_flight: &'a [String],
}

/// Where a chain's data comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The origin (cloud storage): the chain's first hop fetches and forwards.
    Origin,
    /// A peer's complete copy.
    Peer {
        /// The peer's host id.
        host: String,
        /// The tier it reads from: `Memory` or `Disk`.
        tier: Tier,
    },
}

/// One pipelined chain: the source sends to `hops[0]`, which forwards to `hops[1]`, ...
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainPlan {
    /// Where the data comes from.
    pub source: Source,
    /// Receivers in order (head's first hop first). For [`Source::Origin`], the first
    /// receiver fetches from the origin and forwards.
    pub hops: Vec<String>,
    /// Shard indices carried; empty = all shards.
    pub shards: Vec<u32>,
    /// Bytes carried to every hop.
    pub bytes: u64,
    /// Estimated seconds until the last hop holds `bytes`.
    pub estimate_s: f64,
}

/// How a receiver gets its copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReceiverKind {
    /// Already holds a complete copy in the needed tier (memory for `Gpu`): nothing to move.
    Local,
    /// Already receiving it in a plan in flight: it joins that transfer.
    Joined,
    /// Will be sent the model by this plan's chains.
    New,
}

/// A host chosen to hold a replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receiver {
    /// Host id.
    pub host: String,
    /// GPU slots reserved on this host (0 unless the tier is `Gpu`).
    pub gpus: u32,
    /// How it gets its copy.
    pub kind: ReceiverKind,
}

/// The outcome of [`plan`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The chosen receivers, one entry per host: `Local` first, then `Joined`, then `New`.
    pub receivers: Vec<Receiver>,
    /// Chains that move the model to every `New` receiver.
    pub chains: Vec<ChainPlan>,
    /// Max over chains, seconds; 0 if nothing moves.
    pub estimate_s: f64,
}

impl Plan {
    /// Ids of the receivers this plan sends the model to.
    pub fn new_receivers(&self) -> impl Iterator<Item = &str> {
        self.receivers
            .iter()
            .filter(|r| r.kind == ReceiverKind::New)
            .map(|r| r.host.as_str())
    }
}

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// The cluster has no host that is up.
    NoLiveHost,
    /// A named host is not in the cluster.
    UnknownHost(String),
    /// A named host is down.
    HostDown(String),
    /// Too few free hosts / GPUs / bytes for the request.
    NotEnoughCapacity {
        /// Replicas (hosts, or GPU slots for `Gpu`) asked for.
        requested: u32,
        /// Replicas that could be placed.
        available: u32,
        /// Which hosts were down or full, and why.
        detail: String,
    },
    /// The request or the parameters make no sense (zero replicas, empty or duplicate host
    /// list, `max_chain_len == 0`, a model with no shards, ...).
    InvalidRequest(String),
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoLiveHost => f.write_str(
                "no live host: every host in the cluster is down or none has reported yet; \
                 check that transferd runs on the hosts and reaches the controller",
            ),
            Self::UnknownHost(h) => write!(
                f,
                "unknown host `{h}`: it is not in the cluster inventory; check the host id"
            ),
            Self::HostDown(h) => write!(
                f,
                "host `{h}` is down (no recent heartbeat); name another host or retry when it \
                 is back"
            ),
            Self::NotEnoughCapacity {
                requested,
                available,
                detail,
            } => write!(
                f,
                "not enough capacity: {requested} replicas requested, {available} can be \
                 placed ({detail}); free memory or GPUs, add hosts, or ask for fewer replicas"
            ),
            Self::InvalidRequest(why) => write!(f, "invalid placement request: {why}"),
        }
    }
}

impl std::error::Error for PlanError {}

fn validate_model(model: &ModelSpec) -> Result<(), PlanError> {
    if model.shard_bytes.is_empty() {
        return Err(PlanError::InvalidRequest(format!(
            "model `{}` has no shards",
            model.key
        )));
    }
    if u32::try_from(model.shard_bytes.len()).is_err() {
        return Err(PlanError::InvalidRequest(format!(
            "model `{}` has more than 2^32 shards",
            model.key
        )));
    }
    Ok(())
}

/// Plans a request: chooses receivers (step 1), then sources and chains for the `New` ones
/// (steps 2 and 3). `Local` and `Joined` receivers are never in a chain.
pub fn plan(
    cluster: &[HostInfo],
    req: &PlanRequest<'_>,
    params: &PlanParams,
) -> Result<Plan, PlanError> {
    params.validate()?;
    validate_model(req.model)?;
    let view = view::ClusterView::new(cluster, &req.model.key, req.in_flight);
    let receivers = receivers::choose(&view, req)?;
    let new: Vec<&str> = receivers
        .iter()
        .filter(|r| r.kind == ReceiverKind::New)
        .map(|r| r.host.as_str())
        .collect();
    let chains = chains::build(&view, req.model, &new, params);
    let estimate_s = chains.iter().map(|c| c.estimate_s).fold(0.0, f64::max);
    Ok(Plan {
        receivers,
        chains,
        estimate_s,
    })
}

/// Reserve resources in the cluster view for a plan (decrement `gpus_free`,
/// `mem_free`/`disk_free` of `New` receivers, mark in-flight) so a second plan made before
/// heartbeats catch up does not double-book.
///
/// `New` receivers lose the model's total bytes from `mem_free` (`Memory`, `Gpu`) or
/// `disk_free` (`Disk`); every receiver loses its reserved GPUs from `gpus_free`; `New` and
/// `Joined` receivers get [`Held::receiving`] set for the model. All arithmetic saturates at
/// zero; receivers not in `cluster` are ignored.
pub fn reserve(cluster: &mut [HostInfo], model: &ModelSpec, tier: Tier, plan: &Plan) {
    let total = model.total_bytes();
    let by_id: HashMap<&str, usize> = {
        let mut m = HashMap::with_capacity(cluster.len());
        for (i, h) in cluster.iter().enumerate() {
            m.entry(h.id.as_str()).or_insert(i);
        }
        m
    };
    let targets: Vec<(usize, &Receiver)> = plan
        .receivers
        .iter()
        .filter_map(|r| by_id.get(r.host.as_str()).map(|&i| (i, r)))
        .collect();
    drop(by_id);
    for (i, r) in targets {
        let Some(host) = cluster.get_mut(i) else {
            continue;
        };
        host.gpus_free = host.gpus_free.saturating_sub(r.gpus);
        if r.kind == ReceiverKind::New {
            match tier {
                Tier::Memory | Tier::Gpu => host.mem_free = host.mem_free.saturating_sub(total),
                Tier::Disk => host.disk_free = host.disk_free.saturating_sub(total),
            }
        }
        if r.kind != ReceiverKind::Local {
            host.holdings
                .entry(model.key.clone())
                .or_default()
                .receiving = true;
        }
    }
}
