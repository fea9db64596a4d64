//! The controller's operations' typed commands and answers: what the front ends (`crate::grpc`,
//! `crate::http`, through `crate::wire`), the autoscaler and the tier sweeper ask of the
//! controller, in its own types — never the API's protobuf.

use std::sync::Arc;
use std::time::Duration;

use shardcast_placement::{Target, Tier};
use shardcast_protocol::HopTransport;

use crate::inventory::HostView;
use crate::model::ModelRecord;

/// Where a prewarm's receivers read from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Sources {
    /// Peers holding a copy first, the origin for the rest (the default).
    #[default]
    Auto,
    /// Each receiver from the origin, on its own (a baseline to compare against).
    Origin,
}

/// `Prewarm`: make `target` hold the model in `tier`.
#[derive(Debug, Clone)]
pub struct Prewarm {
    /// The model's name (or digest).
    pub model: String,
    /// How many replicas, or which hosts.
    pub target: Target,
    /// The tier the copies land in.
    pub tier: Tier,
    /// Where the receivers read from.
    pub sources: Sources,
    /// How hops dial each other (`None`: the controller's `--transport`).
    pub transport: Option<HopTransport>,
}

/// `ScaleOut`: `replicas` more replicas than exist now.
#[derive(Debug, Clone)]
pub struct ScaleOut {
    /// The model's name (or digest).
    pub model: String,
    /// Replicas to add.
    pub replicas: u32,
    /// The tier.
    pub tier: Tier,
    /// Partitions per replica for a partitioned burst (tier gpu); 0 or 1: whole replicas.
    pub partitions: u32,
    /// How hops dial each other (`None`: the controller's `--transport`).
    pub transport: Option<HopTransport>,
}

/// `Evict`: remove the model's copy in `tier` from `hosts` (every holder when empty).
#[derive(Debug, Clone)]
pub struct EvictModel {
    /// The model's name (or digest).
    pub model: String,
    /// The hosts; empty: every host that holds a copy.
    pub hosts: Vec<String>,
    /// The tier (GPU: the model's GPU slots are released).
    pub tier: Tier,
}

/// What an evict did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Hosts whose copy is gone.
    pub evicted: Vec<String>,
    /// Bytes the hosts freed.
    pub bytes_freed: u64,
    /// Down hosts whose copies go when they heartbeat again.
    pub pending: Vec<String>,
}

/// `RegisterModel`: register `name` from `origin`, reading it through a live host.
#[derive(Debug, Clone, Default)]
pub struct Register {
    /// The model's name (checked here).
    pub name: String,
    /// Its origin (checked against the allow-list).
    pub origin: String,
    /// A profile (JSON of `shardcast_policies::profile::ModelProfile`); empty: none.
    pub profile_json: String,
    /// Chunk size for the manifest (0: the host's default).
    pub chunk_size: u32,
    /// The host that reads the origin (empty: any live host).
    pub via_host: String,
    /// Answer once the registration has started, without waiting for it.
    pub no_wait: bool,
}

/// A registered model, and its manifest where asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelEntry {
    /// The record.
    pub record: ModelRecord,
    /// The encoded manifest (`None`: left out).
    pub manifest: Option<Arc<Vec<u8>>>,
}

/// What `RegisterModel` answers.
#[derive(Debug, Clone, PartialEq)]
pub enum Registered {
    /// The model is registered.
    Done(ModelEntry),
    /// The registration runs (asked not to wait): the name and origin it reads.
    Started {
        /// The model's name.
        name: String,
        /// Its origin.
        origin: String,
    },
}

/// A registration in progress.
#[derive(Debug, Clone, PartialEq)]
pub struct RegistrationJob {
    /// The model's name.
    pub name: String,
    /// Its origin.
    pub origin: String,
    /// The host reading it.
    pub via_host: String,
    /// Seconds since the epoch.
    pub started_at: f64,
}

/// Every registered model, and the registrations in progress.
#[derive(Debug, Clone, PartialEq)]
pub struct Models {
    /// The models (manifests left out).
    pub models: Vec<ModelRecord>,
    /// The registrations in progress, by name.
    pub registering: Vec<RegistrationJob>,
}

/// A host's copy of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The host.
    pub host: String,
    /// It heartbeats.
    pub up: bool,
    /// A complete copy in its memory tier.
    pub memory: bool,
    /// A complete copy in its disk tier.
    pub disk: bool,
    /// Verified bytes in its memory tier.
    pub memory_bytes: u64,
    /// Verified bytes in its disk tier.
    pub disk_bytes: u64,
    /// GPU slots reserved for the model.
    pub gpus: u32,
}

/// Where a model is.
#[derive(Debug, Clone, PartialEq)]
pub struct Whereabouts {
    /// The model.
    pub model: ModelRecord,
    /// The hosts holding any of it.
    pub hosts: Vec<Holder>,
    /// Running plans that move it.
    pub plans: Vec<String>,
}

/// What a heartbeat is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatAnswer {
    /// The heartbeat period the host keeps.
    pub interval: Duration,
    /// The registry's current version of each name the report mentions: (name, digest).
    pub names: Vec<(String, String)>,
    /// Digests with a GPU copy on another host.
    pub gpu_copies_elsewhere: Vec<String>,
    /// When the answer was issued (ms since the epoch).
    pub issued_at_ms: u64,
}

/// A known host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostListing {
    /// Its latest report.
    pub report: HostView,
    /// It heartbeats.
    pub up: bool,
    /// Seconds since its last heartbeat.
    pub last_seen_s: f64,
    /// GPU slots reserved on it.
    pub gpus_reserved: u32,
}

/// `ReportLoad`: a model's load as the platform above sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportLoad {
    /// The model's name (or digest).
    pub model: String,
    /// Requests arriving per second.
    pub arrival_rate: f64,
    /// Requests waiting.
    pub queue_len: u32,
    /// Requests per second one replica serves.
    pub service_rate: f64,
    /// The tier its replicas are counted in.
    pub tier: Tier,
}

/// `GetPartitionPlan`: the partition plans of a model's registered profile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PartitionPlanQuery {
    /// The model's name (or digest).
    pub model: String,
    /// The most partitions (0: the default).
    pub max_partitions: u32,
    /// Per-GPU memory to plan for, bytes (0: the smallest GPU's).
    pub gpu_memory: u64,
    /// Requests waiting, for the plan chosen (at least 1).
    pub queue: u32,
}

/// A partition plan table, as JSON, and whether its profile was estimated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionPlanAnswer {
    /// The table, the plan chosen and the profile it came from (JSON).
    pub json: String,
    /// The profile was estimated from the weights, not measured.
    pub estimated: bool,
}
