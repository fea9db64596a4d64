//! Errors, typed per operation: `LookupError` (model, plan), `HostUnavailable`,
//! `AgentError` (`AgentFailure` from the agent's answer), `HeartbeatError`,
//! `RegisterError`, `EvictError`, `PlanRequestError` (`Prewarm`, `ScaleOut`, the core's part
//! of a burst), `PartitionError`, `ScaleOutError` (either), `LoadError` (`ReportLoad`), and
//! for what the controller reads back: `RecordError` (stored model, host, plan and
//! partition-plan records), `PollError` (a receiver's agent silent or failing) and
//! `StartError` (a chain's head unreachable, refusing or silent; a bad stored manifest;
//! signing).
//!
//! [`ApiError`] is what the front ends answer: each operation's error maps to one gRPC
//! code and HTTP status here (`From<…> for ApiError`; 401 unauthenticated, 403 permission
//! denied), and nowhere else, with a message a person can act on; the remaining
//! `ApiError`s are built at the edge (`http`'s body parsing, `wire`'s conversions). A
//! request that fails validation changes nothing: every check runs before any state is
//! written or any transfer starts.

use axum::http::StatusCode;
use tonic::Code;

/// An error answered to an API caller.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// gRPC code.
    pub code: Code,
    /// What went wrong and what to do about it.
    pub message: String,
}

impl ApiError {
    fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    /// Malformed input.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }
    /// Unknown model, host or plan.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }
    /// More than the cluster can take.
    pub fn exhausted(message: impl Into<String>) -> Self {
        Self::new(Code::ResourceExhausted, message)
    }
    /// No live host, or a dependency (origin, agent) cannot be reached.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, message)
    }
    /// The request is valid but the system is not in a state to do it.
    pub fn precondition(message: impl Into<String>) -> Self {
        Self::new(Code::FailedPrecondition, message)
    }
    /// No identity was presented (no client certificate, no valid bearer token).
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(Code::Unauthenticated, message)
    }
    /// The caller's role lacks the permission, or policy forbids the request (an origin
    /// outside the allow-list).
    pub fn permission_denied(message: impl Into<String>) -> Self {
        Self::new(Code::PermissionDenied, message)
    }
    /// A bug or a failing disk.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// The name of the code as in gRPC (`NOT_FOUND`), used in JSON error bodies.
    pub fn code_name(&self) -> &'static str {
        code_name(self.code)
    }

    /// The HTTP status for the HTTP/JSON API.
    pub fn http_status(&self) -> StatusCode {
        match self.code {
            Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::ResourceExhausted => StatusCode::INSUFFICIENT_STORAGE,
            Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

pub use shardcast_protocol::code_name;

impl From<ApiError> for tonic::Status {
    fn from(e: ApiError) -> Self {
        Self::new(e.code, e.message)
    }
}

impl From<crate::state::StateError> for ApiError {
    fn from(e: crate::state::StateError) -> Self {
        Self::internal(e.to_string())
    }
}

/// The body of every error the HTTP API answers: `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// An error's code and message.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// The gRPC code's name in upper case (`NOT_FOUND`, `INVALID_ARGUMENT`, …), matching the
    /// HTTP status (docs/OPERATIONS.md lists them).
    pub code: String,
    /// What went wrong and what to do about it.
    pub message: String,
}

impl axum::response::IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        let status = self.http_status();
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code_name().to_string(),
                message: self.message,
            },
        };
        (status, axum::Json(body)).into_response()
    }
}

// ---- the core's errors, typed per operation ----
//
// The core's operations fail with these; the front ends map them to a gRPC code and an
// HTTP status here (`From<…> for ApiError`), and nowhere else.

/// A model, plan or host asked for by name that is not there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    /// The request named nothing.
    #[error("a model name or digest is required")]
    NoKey,
    /// Not registered.
    #[error("model {0:?} is not registered (register it with `shardcast register {0} <origin>`)")]
    UnknownModel(String),
    /// No such plan.
    #[error("no plan {0:?}")]
    UnknownPlan(String),
}

/// The host an operation needs cannot do it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostUnavailable {
    /// No transferd has heartbeated recently.
    #[error(
        "no live host: no transferd has heartbeated recently (start transferd with --controller pointing here)"
    )]
    NoLiveHost,
    /// Never heartbeated.
    #[error("host {0:?} is not known to the controller (see `shardcast hosts`)")]
    Unknown(String),
    /// Stopped heartbeating.
    #[error("host {0:?} is down (it stopped heartbeating)")]
    Down(String),
}

/// Why a stored record (a model, host, plan or partition-plan record) cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Not JSON of the record's shape.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    /// A version this controller does not know: named, not guessed.
    #[error("{what} record version {found:?} is not known to this controller (it reads {reads})")]
    UnknownVersion {
        /// The kind of record.
        what: &'static str,
        /// The version found.
        found: String,
        /// The versions it reads.
        reads: String,
    },
    /// A field's value is not one this controller knows.
    #[error("{0}")]
    Invalid(String),
    /// Neither the typed layout nor the legacy one.
    #[error("{typed}; as a legacy record: {legacy}")]
    Neither {
        /// Why the typed layout failed.
        typed: Box<Self>,
        /// Why the legacy layout failed.
        legacy: Box<Self>,
    },
}

/// Why a receiver's status could not be read from its agent.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PollError {
    /// No answer within the poll's time.
    #[error("agent of {host} did not answer within {within:?}")]
    Silent {
        /// The host.
        host: String,
        /// The time allowed.
        within: std::time::Duration,
    },
    /// The agent answered with an error, or could not be reached.
    #[error("agent of {}: {}", .0.host, .0.message)]
    Agent(AgentError),
}

/// Why a chain could not be started at its head.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StartError {
    /// The head is not known, or its agent cannot be reached.
    #[error("{}", .0.message)]
    Unreachable(AgentError),
    /// The head's agent refused or failed.
    #[error("{}: {}", .0.host, .0.message)]
    Refused(AgentError),
    /// The head's agent did not answer in time.
    #[error("agent of {head} did not answer StartChain")]
    Silent {
        /// The head.
        head: String,
    },
    /// The stored manifest does not decode.
    #[error("the stored manifest of {digest} does not decode: {why}")]
    BadManifest {
        /// The model.
        digest: String,
        /// Why.
        why: String,
    },
    /// The plan's digest is not a digest.
    #[error("model digest {digest}: {why}")]
    BadDigest {
        /// The digest as stored.
        digest: String,
        /// Why.
        why: String,
    },
    /// The plan token could not be signed.
    #[error("{0}")]
    Sign(String),
}

/// How a call to a host's agent failed, from the agent's answer (or its absence).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentFailure {
    /// The agent does not know what was asked for (a model it does not hold).
    NotFound,
    /// The agent refused: not allowed (its origin policy, its identity checks).
    Refused,
    /// The agent found the request malformed.
    Invalid,
    /// The agent is not in a state to do it.
    Precondition,
    /// The host is out of room.
    Exhausted,
    /// The agent could not be reached, or its own dependency (an origin) could not.
    Unreachable,
    /// The agent failed.
    Failed,
}

/// A failed call to a host's agent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("host {host}: {message}")]
pub struct AgentError {
    /// The host.
    pub host: String,
    /// How.
    pub failure: AgentFailure,
    /// The agent's message (or the connection's).
    pub message: String,
}

impl AgentError {
    /// The agent could not be reached (no channel, no identity to expect).
    pub fn unreachable(host: &str, why: impl std::fmt::Display) -> Self {
        Self {
            host: host.to_string(),
            failure: AgentFailure::Unreachable,
            message: why.to_string(),
        }
    }
}

/// `Heartbeat`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeartbeatError {
    /// Not a valid host id.
    #[error("host_id: {0}")]
    BadHostId(String),
    /// No address to reach it at.
    #[error("a heartbeat needs data_addr and agent_addr (set `advertise` on the transferd)")]
    NoAddress,
    /// A new host's record could not be stored.
    #[error("storing the host: {0}")]
    Store(String),
}

/// `RegisterModel`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// Not a valid model name.
    #[error("model name {name:?}: {why}")]
    BadName {
        /// As given.
        name: String,
        /// Why not.
        why: String,
    },
    /// The profile does not parse or validate.
    #[error("profile_json: {0}")]
    BadProfile(String),
    /// Not an origin URI this build reads.
    #[error("{0}")]
    OriginInvalid(String),
    /// Outside the origin allow-list.
    #[error("{0}")]
    OriginRefused(String),
    /// No host to read the origin through.
    #[error(transparent)]
    Host(#[from] HostUnavailable),
    /// The name is being registered from another origin.
    #[error("{name} is being registered from {origin} (through {via}); wait for it to end")]
    InProgress {
        /// The model.
        name: String,
        /// The origin of the registration in progress.
        origin: String,
        /// The host reading it.
        via: String,
    },
    /// The host could not read the origin or build the manifest.
    #[error("reading origin {origin} through {agent}")]
    OriginRead {
        /// The origin.
        origin: String,
        /// The host's answer.
        agent: AgentError,
    },
    /// The host's manifest is not what it says.
    #[error("host {via} returned a bad manifest: {why}")]
    BadManifest {
        /// The host.
        via: String,
        /// What is wrong.
        why: String,
    },
    /// The registration's task ended without telling (it panicked).
    #[error("the registration task ended without an outcome")]
    Lost,
    /// The model could not be stored.
    #[error("storing the model: {0}")]
    Store(String),
}

/// `Evict`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvictError {
    /// A malformed request.
    #[error("{0}")]
    Invalid(String),
    /// No such model.
    #[error(transparent)]
    Lookup(#[from] LookupError),
    /// A named host cannot be asked.
    #[error(transparent)]
    Host(#[from] HostUnavailable),
    /// A plan still moves the model to a named host.
    #[error(
        "plan {plan} is still moving the model to {host}; wait for it (shardcast watch {plan})"
    )]
    StillMoving {
        /// The plan.
        plan: String,
        /// The host.
        host: String,
    },
    /// A host failed to evict; those before it did.
    #[error("{first} (evicted from {evicted:?} before this failure)")]
    Partial {
        /// Hosts that evicted.
        evicted: Vec<String>,
        /// The first failure.
        first: AgentError,
    },
    /// A GPU release could not be stored.
    #[error("storing the host: {0}")]
    Store(String),
}

/// `Prewarm`, `ScaleOut` and bursts: making a plan.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanRequestError {
    /// A malformed request.
    #[error("{0}")]
    Invalid(String),
    /// No such model.
    #[error(transparent)]
    Lookup(#[from] LookupError),
    /// No host, or a named one is unknown or down.
    #[error(transparent)]
    Host(#[from] HostUnavailable),
    /// More than the cluster can take.
    #[error("{0}")]
    Capacity(String),
    /// No part of a burst could start.
    #[error("no burst partition of {model} could start: {why}")]
    NothingStarted {
        /// The model.
        model: String,
        /// Each host's failure.
        why: String,
    },
    /// The registry lacks the model's manifest (a damaged state).
    #[error("no manifest for {0}")]
    NoManifest(String),
    /// The plan or a reservation could not be stored.
    #[error("storing the plan: {0}")]
    Store(String),
}

/// A model's profile and partition plans (`GetPartitionPlan`, the plan of a burst).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartitionError {
    /// No such model.
    #[error(transparent)]
    Lookup(#[from] LookupError),
    /// No registered profile and no live holder to derive one from.
    #[error(
        "model {0} has no registered profile and no live host holds it to read its tensor index; prewarm it or register it with a profile"
    )]
    NoProfileSource(String),
    /// The holder's copy has no safetensors tensors.
    #[error(
        "model {0} has no safetensors tensors to derive a profile from; register it with a profile"
    )]
    NoTensors(String),
    /// The holder could not be asked for its tensor index.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The holder's hand-off does not parse.
    #[error("hand-off of {host}: {why}")]
    BadHandoff {
        /// The holder.
        host: String,
        /// What is wrong.
        why: String,
    },
    /// The stored profile does not parse (a damaged state).
    #[error("the stored profile of {name}: {why}")]
    BadStoredProfile {
        /// The model.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// No plan fits (the GPU memory, the profile).
    #[error("no partition plan: {0}")]
    Unplannable(String),
    /// The model has fewer layer groups than partitions asked for.
    #[error(
        "model {model} cannot be split into {partitions} partitions (it has {groups} layer groups)"
    )]
    CannotSplit {
        /// The model.
        model: String,
        /// Asked for.
        partitions: u32,
        /// Its layer groups.
        groups: usize,
    },
}

/// `ScaleOut`: whole replicas, or a partitioned burst (which needs a partition plan).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScaleOutError {
    /// Making the plan.
    #[error(transparent)]
    Plan(#[from] PlanRequestError),
    /// The burst's partition plan.
    #[error(transparent)]
    Partition(#[from] PartitionError),
}

/// `ReportLoad` (the autoscaler's decision itself is never an error: a failed action is
/// an event).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// A malformed report.
    #[error("{0}")]
    Invalid(String),
    /// No such model.
    #[error(transparent)]
    Lookup(#[from] LookupError),
}

impl From<PartitionError> for ApiError {
    fn from(e: PartitionError) -> Self {
        let m = e.to_string();
        match e {
            PartitionError::Lookup(l) => l.into(),
            PartitionError::Agent(a) => Self::new(Code::Unavailable, format!("{a}")),
            PartitionError::BadHandoff { .. } | PartitionError::BadStoredProfile { .. } => {
                Self::internal(m)
            }
            PartitionError::NoProfileSource(_)
            | PartitionError::NoTensors(_)
            | PartitionError::Unplannable(_)
            | PartitionError::CannotSplit { .. } => Self::precondition(m),
        }
    }
}

impl From<ScaleOutError> for ApiError {
    fn from(e: ScaleOutError) -> Self {
        match e {
            ScaleOutError::Plan(p) => p.into(),
            ScaleOutError::Partition(p) => p.into(),
        }
    }
}

impl From<LoadError> for ApiError {
    fn from(e: LoadError) -> Self {
        match e {
            LoadError::Invalid(m) => Self::invalid(m),
            LoadError::Lookup(l) => l.into(),
        }
    }
}

impl From<PlanRequestError> for ApiError {
    fn from(e: PlanRequestError) -> Self {
        let m = e.to_string();
        match e {
            PlanRequestError::Invalid(_) => Self::invalid(m),
            PlanRequestError::Lookup(l) => l.into(),
            PlanRequestError::Host(h) => h.into(),
            PlanRequestError::Capacity(_) => Self::exhausted(m),
            PlanRequestError::NothingStarted { .. } => Self::unavailable(m),
            PlanRequestError::NoManifest(_) | PlanRequestError::Store(_) => Self::internal(m),
        }
    }
}

impl From<LookupError> for ApiError {
    fn from(e: LookupError) -> Self {
        match e {
            LookupError::NoKey => Self::invalid(e.to_string()),
            _ => Self::not_found(e.to_string()),
        }
    }
}

impl From<HostUnavailable> for ApiError {
    fn from(e: HostUnavailable) -> Self {
        match e {
            HostUnavailable::Unknown(_) => Self::not_found(e.to_string()),
            _ => Self::unavailable(e.to_string()),
        }
    }
}

impl AgentFailure {
    /// The code a caller sees for an agent's failure.
    pub fn code(self) -> Code {
        match self {
            Self::NotFound => Code::NotFound,
            Self::Refused => Code::PermissionDenied,
            Self::Invalid => Code::InvalidArgument,
            Self::Precondition => Code::FailedPrecondition,
            Self::Exhausted => Code::ResourceExhausted,
            Self::Unreachable | Self::Failed => Code::Unavailable,
        }
    }
}

impl From<AgentError> for ApiError {
    fn from(e: AgentError) -> Self {
        Self::new(e.failure.code(), e.to_string())
    }
}

impl From<HeartbeatError> for ApiError {
    fn from(e: HeartbeatError) -> Self {
        match e {
            HeartbeatError::Store(_) => Self::internal(e.to_string()),
            _ => Self::invalid(e.to_string()),
        }
    }
}

impl From<RegisterError> for ApiError {
    fn from(e: RegisterError) -> Self {
        let m = e.to_string();
        match e {
            RegisterError::BadName { .. }
            | RegisterError::BadProfile(_)
            | RegisterError::OriginInvalid(_) => Self::invalid(m),
            RegisterError::OriginRefused(_) => Self::permission_denied(m),
            RegisterError::Host(h) => h.into(),
            RegisterError::InProgress { .. } => Self::new(Code::Aborted, m),
            RegisterError::OriginRead { agent, .. } => Self::new(agent.failure.code(), m),
            RegisterError::BadManifest { .. } | RegisterError::Lost | RegisterError::Store(_) => {
                Self::internal(m)
            }
        }
    }
}

impl From<EvictError> for ApiError {
    fn from(e: EvictError) -> Self {
        let m = e.to_string();
        match e {
            EvictError::Invalid(_) => Self::invalid(m),
            EvictError::Lookup(l) => l.into(),
            EvictError::Host(h) => h.into(),
            EvictError::StillMoving { .. } => Self::precondition(m),
            EvictError::Partial { first, .. } => Self::new(first.failure.code(), m),
            EvictError::Store(_) => Self::internal(m),
        }
    }
}

/// The front ends' conversions of each operation's error: to a gRPC status and to an HTTP
/// response, through [`ApiError`].
macro_rules! at_the_edge {
    ($($e:ty),+) => {$(
        impl From<$e> for tonic::Status {
            fn from(e: $e) -> Self {
                ApiError::from(e).into()
            }
        }

        impl axum::response::IntoResponse for $e {
            fn into_response(self) -> axum::response::Response {
                ApiError::from(self).into_response()
            }
        }
    )+};
}

at_the_edge!(
    LookupError,
    HostUnavailable,
    AgentError,
    HeartbeatError,
    RegisterError,
    EvictError,
    PlanRequestError,
    PartitionError,
    ScaleOutError,
    LoadError
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_operation_error_maps_to_one_code_at_the_edge() {
        let agent = |failure| AgentError {
            host: "h1".into(),
            failure,
            message: "no".into(),
        };
        let cases: Vec<(ApiError, Code)> = vec![
            (LookupError::NoKey.into(), Code::InvalidArgument),
            (LookupError::UnknownModel("m".into()).into(), Code::NotFound),
            (HostUnavailable::NoLiveHost.into(), Code::Unavailable),
            (HostUnavailable::Unknown("h".into()).into(), Code::NotFound),
            (HeartbeatError::NoAddress.into(), Code::InvalidArgument),
            (
                RegisterError::OriginRefused("outside".into()).into(),
                Code::PermissionDenied,
            ),
            (
                RegisterError::InProgress {
                    name: "m".into(),
                    origin: "o".into(),
                    via: "h".into(),
                }
                .into(),
                Code::Aborted,
            ),
            (
                RegisterError::OriginRead {
                    origin: "s3://b/m".into(),
                    agent: agent(AgentFailure::Refused),
                }
                .into(),
                Code::PermissionDenied,
            ),
            (
                PlanRequestError::Capacity("4 hosts".into()).into(),
                Code::ResourceExhausted,
            ),
            (
                PlanRequestError::Lookup(LookupError::UnknownModel("m".into())).into(),
                Code::NotFound,
            ),
            (
                PartitionError::NoProfileSource("m".into()).into(),
                Code::FailedPrecondition,
            ),
            (
                ScaleOutError::Partition(PartitionError::CannotSplit {
                    model: "m".into(),
                    partitions: 8,
                    groups: 4,
                })
                .into(),
                Code::FailedPrecondition,
            ),
            (
                LoadError::Invalid("rate".into()).into(),
                Code::InvalidArgument,
            ),
            (
                EvictError::StillMoving {
                    plan: "p".into(),
                    host: "h".into(),
                }
                .into(),
                Code::FailedPrecondition,
            ),
            (
                EvictError::Partial {
                    evicted: vec!["a".into()],
                    first: agent(AgentFailure::Unreachable),
                }
                .into(),
                Code::Unavailable,
            ),
        ];
        for (e, code) in cases {
            assert_eq!(e.code, code, "{}", e.message);
            assert!(!e.message.is_empty());
        }
        let e: ApiError = RegisterError::OriginRead {
            origin: "s3://b/m".into(),
            agent: agent(AgentFailure::NotFound),
        }
        .into();
        assert_eq!(
            e.message, "reading origin s3://b/m through host h1: no",
            "the message names the origin and the host"
        );
    }
}
