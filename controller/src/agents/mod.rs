//! The port through which the controller reaches the hosts' agents: what it asks a host to
//! do (start a chain, import or load a model, evict a copy) and what it reads back (a
//! model's progress), in the controller's own types.
//!
//! [`Agents`] is the seam between the controller's operations and the transport:
//! [`grpc::GrpcAgents`] reaches each transferd's agent service over mutually authenticated
//! gRPC (the only place the agent protocol's protobuf types are built or read); a
//! simulated datacenter implements the same trait to drive the same operations on a virtual
//! clock. Timeouts are the caller's: the port makes one call and returns its answer.

use std::sync::Arc;

use futures::stream::BoxStream;
use shardcast_placement::Tier;
use shardcast_protocol::DataTier;
use shardcast_protocol::HopTransport;

use crate::error::AgentError;

pub mod grpc;

/// Where a host's agent is: its id and the address its last heartbeat gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentAt {
    /// The host's id (over TLS the agent must prove exactly this identity).
    pub host: String,
    /// `host:port`, or `unix:/path` for a local socket.
    pub addr: String,
}

/// A hop after the head of a chain: the host and the data address the others dial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainHop {
    /// Host id.
    pub host: String,
    /// Its data listener.
    pub addr: String,
}

/// `StartChain`: the head of a chain starts sending (from its copy or the origin) down the
/// hops.
#[derive(Debug, Clone)]
pub struct StartChain {
    /// The session's id (the plan's run), the same on every hop.
    pub session: String,
    /// The model's manifest digest (hex).
    pub model: String,
    /// The encoded manifest.
    pub manifest: Arc<Vec<u8>>,
    /// Where the head reads what it lacks.
    pub origin: String,
    /// The tier the copies land in.
    pub tier: Tier,
    /// The shards this chain carries.
    pub shards: Vec<u32>,
    /// The hops after the head, in order.
    pub hops: Vec<ChainHop>,
    /// The signed plan token (empty in insecure mode).
    pub plan_token: Vec<u8>,
    /// How the hops dial each other.
    pub transport: HopTransport,
}

/// `ImportModel`: the host builds (or is taught) a model's manifest, and may fetch it.
#[derive(Debug, Clone)]
pub struct Import {
    /// The model's name.
    pub name: String,
    /// Its origin.
    pub origin: String,
    /// Chunk size for a manifest built from the origin (0: the agent's default).
    pub chunk_size: u32,
    /// The tier a fetch lands in.
    pub tier: Tier,
    /// Download the model from the origin (returns when the download ends).
    pub fetch: bool,
    /// Keep what is read to build the manifest.
    pub keep: bool,
    /// The manifest to take instead of building one (empty: build it).
    pub manifest: Vec<u8>,
    /// Bind the name to this version on the host (`None`: the agent decides).
    pub bind_name: Option<bool>,
}

/// What an import answered.
#[derive(Debug, Clone, Default)]
pub struct Imported {
    /// The manifest's digest (hex), as the host computed it.
    pub digest: String,
    /// The encoded manifest.
    pub manifest: Vec<u8>,
    /// The host kept the bytes it read.
    pub kept: bool,
    /// The origin pinned to the version read, where the origin names a movable one.
    pub resolved_origin: String,
}

/// A partition of a model for a partitioned burst.
#[derive(Debug, Clone)]
pub struct Partition {
    /// Layer groups, as `shardcast plan` names them.
    pub groups: Vec<String>,
    /// Keep loading the rest of the model once the partition is live.
    pub complete: bool,
    /// Where the host fetches the chunks it lacks (empty: a chain session brings them).
    pub source: String,
    /// Shown in status, e.g. "2/4".
    pub label: String,
}

/// `LoadModel`: the host loads a model it holds onto GPUs.
#[derive(Debug, Clone)]
pub struct Load {
    /// The model's digest (hex).
    pub model: String,
    /// GPUs to load it on.
    pub count: u32,
    /// `light`, `medium` or `heavy` (the eviction class).
    pub heaviness: String,
    /// Load only this partition first.
    pub partition: Option<Partition>,
}

/// `EvictModel`: the host removes its copy of a model from a tier.
#[derive(Debug, Clone)]
pub struct Evict {
    /// The model's digest (hex).
    pub model: String,
    /// The tier.
    pub tier: Tier,
    /// End the sessions still moving the model to the host (no plan wants them).
    pub end_sessions: bool,
}

/// A model on one tier of a host, as its agent reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct TierReport {
    /// The tier (a tier the controller does not know is left out).
    pub tier: DataTier,
    /// Bytes verified there.
    pub bytes_verified: u64,
    /// Every chunk is there and verified.
    pub complete: bool,
    /// Each GPU's load of it: (state, bytes).
    pub gpus: Vec<(String, u64)>,
}

/// A session whose writes the host's store refused.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreFailure {
    /// The tier.
    pub tier: DataTier,
    /// The session.
    pub session: String,
    /// Why.
    pub error: String,
}

/// A model's status on a host.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelReport {
    /// One per tier that holds any of it.
    pub tiers: Vec<TierReport>,
    /// Sessions the store refused.
    pub store_failures: Vec<StoreFailure>,
}

/// The hosts' agents, as the controller reaches them.
#[async_trait::async_trait]
pub trait Agents: Send + Sync {
    /// Starts a chain at `at`, its head. A session the head already runs is not an error.
    async fn start_chain(&self, at: &AgentAt, chain: StartChain) -> Result<(), AgentError>;

    /// Imports a model on `at`.
    async fn import_model(&self, at: &AgentAt, import: Import) -> Result<Imported, AgentError>;

    /// A model's status on `at`; `None` where the host does not know the model.
    async fn model_status(
        &self,
        at: &AgentAt,
        model: &str,
    ) -> Result<Option<ModelReport>, AgentError>;

    /// A model's status on `at` as it changes, until the agent ends the stream.
    async fn watch_model_status(
        &self,
        at: &AgentAt,
        model: &str,
    ) -> Result<BoxStream<'static, ModelReport>, AgentError>;

    /// Loads a model onto GPUs of `at`.
    async fn load_model(&self, at: &AgentAt, load: Load) -> Result<(), AgentError>;

    /// Evicts a model from a tier of `at`; the bytes freed.
    async fn evict_model(&self, at: &AgentAt, evict: Evict) -> Result<u64, AgentError>;

    /// The hand-off document of a model on `at` (JSON, its tensor index among others).
    async fn handoff(&self, at: &AgentAt, model: &str) -> Result<String, AgentError>;
}
