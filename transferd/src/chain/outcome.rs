//! Typed outcomes of a chain session on this host: why it cannot complete
//! ([`SessionError`]), why its forwarder ended ([`ForwardError`], one [`HopFailure`] per hop
//! skipped or stop), and why a fetch into it failed ([`FetchError`], [`RecoveryError`]).
//!
//! Callers match on the variants; the `Display` texts are what `GetSession`, the model
//! status and the logs show, and are the messages these outcomes had as strings.

use std::sync::Arc;

use shardcast_protocol::{DataTier, HostId};

use super::ChainError;
use crate::origin::OriginError;
use crate::repair::RepairError;
use crate::store::StoreError;

/// Why a session cannot complete on this host: what [`super::ShardSession::outcome`],
/// [`ready`](super::ShardSession::ready) and [`finished`](super::ShardSession::finished)
/// answer with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SessionError {
    /// The file system refused a chunk (`ENOSPC` on a full tmpfs, `EIO`): the copy cannot
    /// complete here.
    #[error("storing chunk {index} of shard {shard} in the {tier:?} tier: {error}")]
    StoreRefused {
        /// The chunk.
        index: u32,
        /// Its shard.
        shard: u32,
        /// The tier it was written to.
        tier: DataTier,
        /// What the store said.
        error: Arc<StoreError>,
    },
    /// Chunks this host forwards from are corrupt at rest and could not be repaired.
    #[error("{0}")]
    Unrepairable(RepairError),
    /// An evict of the model ended the session (its plans are over).
    #[error("ended by an evict of the model (its plans are over)")]
    Evicted,
    /// The upstream vanished and the session has nowhere else to fetch from.
    #[error("upstream vanished and the session has no fallback source")]
    NoFallback,
    /// Every fetch the recovery monitor made left the session incomplete.
    #[error("recovery failed after {attempts} attempts: {}", recovery_cause(.cause))]
    RecoveryFailed {
        /// Fetches made.
        attempts: u32,
        /// The last fetch's error; `None` when it ended without one but the fallback
        /// source lacked chunks.
        cause: Option<Arc<RecoveryError>>,
    },
    /// A head could not fetch its shard from the origin.
    #[error("origin fetch failed: {0}")]
    OriginFetch(Arc<FetchError>),
    /// A head's origin fetch ended without every chunk of its range.
    #[error("origin did not provide every chunk")]
    OriginIncomplete,
    /// The forwarder ended with hops skipped or stopped (the range is here).
    #[error("{0}")]
    Forward(ForwardError),
    /// The shard's copy was closed while the session waited on it.
    #[error("store closed")]
    StoreClosed,
    /// The forwarder went away without finishing.
    #[error("forwarder gone")]
    ForwarderGone,
    /// The session itself was dropped while waited on.
    #[error("session gone")]
    SessionGone,
}

fn recovery_cause(cause: &Option<Arc<RecoveryError>>) -> String {
    cause
        .as_ref()
        .map_or_else(|| "fallback source lacks chunks".into(), |e| e.to_string())
}

impl SessionError {
    /// Whether the session failed for a cause on this host (its store, its copy at rest,
    /// an evict) rather than for want of a source or because of a hop below.
    pub fn is_local(&self) -> bool {
        matches!(
            self,
            Self::StoreRefused { .. } | Self::Unrepairable(_) | Self::Evicted | Self::StoreClosed
        )
    }

    /// The forwarder's failures, when the session ended because of hops below.
    pub fn forward(&self) -> Option<&ForwardError> {
        match self {
            Self::Forward(f) => Some(f),
            _ => None,
        }
    }
}

/// Why a forwarder did not deliver the range to every hop below: each hop it skipped (or
/// what stopped it), in order. Never empty.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}", join(.failures))]
pub struct ForwardError {
    /// What happened, in order.
    pub failures: Vec<HopFailure>,
}

impl ForwardError {
    /// The hosts below that were skipped (failed, stalled or refused), in order.
    pub fn skipped(&self) -> impl Iterator<Item = &HostId> {
        self.failures.iter().filter_map(|f| match f {
            HopFailure::Hop { host, .. } => Some(host),
            _ => None,
        })
    }

    /// Whether the forwarder stopped because this host shuts down.
    pub fn shutting_down(&self) -> bool {
        self.failures
            .iter()
            .any(|f| matches!(f, HopFailure::ShuttingDown))
    }
}

fn join<T: std::fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// One hop a forwarder skipped, or why it stopped.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HopFailure {
    /// The hop below answered `AlreadyFed` twice: the chain went on without this host,
    /// which completes its own copy as a leaf.
    #[error("bypassed: {host} is fed by a live upstream")]
    Bypassed {
        /// The hop below.
        host: HostId,
    },
    /// This host's session failed: the hop below is not at fault and was not skipped.
    #[error("local: {0}")]
    Local(SessionError),
    /// This host's store failed reading the copy: the hop below was not skipped.
    #[error("local: {0}")]
    LocalStore(Arc<ChainError>),
    /// The hop died, stalled, refused or broke the protocol, and was skipped.
    #[error("{host} ({addr}): {error}")]
    Hop {
        /// Its host id.
        host: HostId,
        /// The address dialled.
        addr: String,
        /// What went wrong.
        error: Arc<ChainError>,
    },
    /// This host shuts down.
    #[error("host is shutting down")]
    ShuttingDown,
}

impl HopFailure {
    /// Whether the hop was skipped because it made no progress (silent, or draining no
    /// write) rather than refusing or breaking.
    pub fn is_stall(&self) -> bool {
        matches!(self, Self::Hop { error, .. } if error.is_stall())
    }

    /// Whether the hop answered with an error frame (a refusal) rather than failing.
    pub fn is_refusal(&self) -> bool {
        matches!(self, Self::Hop { error, .. } if matches!(**error, ChainError::Remote { .. }))
    }
}

/// Why fetching chunks into a session (from an origin or a holder), or a whole model or
/// span into the store, failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// A holder (`shardcast://` address, or a hop above by host id) failed.
    #[error("holder {holder}: {error}")]
    Holder {
        /// The holder's address or host id.
        holder: String,
        /// What went wrong.
        #[source]
        error: ChainError,
    },
    /// The origin could not be opened or read.
    #[error(transparent)]
    Origin(#[from] OriginError),
    /// A chunk could not be stored.
    #[error(transparent)]
    Chain(#[from] ChainError),
    /// The shard could not be opened in the store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The origin's fetch task panicked or was cancelled.
    #[error("origin fetch task: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// A span names a shard the model does not have.
    #[error("shard {shard} does not exist (the model has {shards})")]
    NoSuchShard {
        /// The shard asked for.
        shard: u32,
        /// Shards in the model.
        shards: usize,
    },
    /// The origin ended without every chunk of a shard.
    #[error("origin did not provide every chunk of shard {shard}")]
    Incomplete {
        /// The shard.
        shard: u32,
    },
    /// The copy kept while the manifest was built lacks chunks of a shard.
    #[error("the kept copy of shard {shard} is incomplete")]
    KeptIncomplete {
        /// The shard.
        shard: u32,
    },
}

/// Why one recovery attempt left the session incomplete: every source that failed, in the
/// order tried. Never empty.
#[derive(Debug, thiserror::Error)]
#[error("{}", join(.failures))]
pub struct RecoveryError {
    /// One error per failed source.
    pub failures: Vec<FetchError>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardcast_protocol::ErrorCode;
    use std::time::Duration;

    fn hop(host: &str, error: ChainError) -> HopFailure {
        HopFailure::Hop {
            host: HostId::new(host).unwrap(),
            addr: format!("{host}:7000"),
            error: Arc::new(error),
        }
    }

    #[test]
    fn forward_failures_read_as_before_and_match_by_kind() {
        let f = ForwardError {
            failures: vec![
                hop("recv-1", ChainError::Timeout(Duration::from_secs(2))),
                hop(
                    "recv-2",
                    ChainError::Remote {
                        code: ErrorCode::Refused,
                        message: "no".into(),
                    },
                ),
                HopFailure::Bypassed {
                    host: HostId::new("recv-3").unwrap(),
                },
            ],
        };
        assert_eq!(
            f.to_string(),
            "recv-1 (recv-1:7000): peer silent for 2s; recv-2 (recv-2:7000): peer reported \
             Refused: no; bypassed: recv-3 is fed by a live upstream"
        );
        assert!(f.failures[0].is_stall() && !f.failures[0].is_refusal());
        assert!(f.failures[1].is_refusal() && !f.failures[1].is_stall());
        let skipped: Vec<String> = f.skipped().map(ToString::to_string).collect();
        assert_eq!(skipped, ["recv-1", "recv-2"]);
        assert!(!f.shutting_down());
        let e = SessionError::Forward(f);
        assert!(!e.is_local());
        assert!(e.forward().is_some());
    }

    #[test]
    fn session_errors_read_as_before() {
        assert_eq!(
            SessionError::RecoveryFailed {
                attempts: 3,
                cause: None
            }
            .to_string(),
            "recovery failed after 3 attempts: fallback source lacks chunks"
        );
        let cause = RecoveryError {
            failures: vec![
                FetchError::Holder {
                    holder: "recv-1".into(),
                    error: ChainError::Closed,
                },
                FetchError::Incomplete { shard: 2 },
            ],
        };
        let e = SessionError::RecoveryFailed {
            attempts: 3,
            cause: Some(Arc::new(cause)),
        };
        assert_eq!(
            e.to_string(),
            "recovery failed after 3 attempts: holder recv-1: peer closed the connection; \
             origin did not provide every chunk of shard 2"
        );
        assert!(!e.is_local());
        assert!(SessionError::Evicted.is_local());
        assert!(
            SessionError::Evicted
                .to_string()
                .contains("ended by an evict")
        );
        let local = HopFailure::Local(SessionError::OriginIncomplete);
        assert_eq!(
            local.to_string(),
            "local: origin did not provide every chunk"
        );
    }
}
