//! Head sessions: a chain started through the agent API (`StartChain`), one
//! [`ShardSession`] per (chain, shard), filled from the origin when this host lacks the
//! shard.
//!
//! With `stripes` above 1, each shard is cut into contiguous ranges (`stripe_ranges`), one
//! session per stripe, each with its own forwarder, connection and recovery monitor down the
//! chain; the hops below follow the ranges in the `Open`s.
//!
//! [`Heads`] is the role. It is given the store (the shards it sends), the session table
//! (it holds its head sessions there), an [`Intake`] (to make sessions), the repair sources
//! (it notes the origin), the [`Forwarder`] and [`Fetcher`] its sessions run, the shutdown
//! token, `stripes`, the counters and the upstream grace (a head's origin read that lost its
//! hop below: `fill_watching`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use bytes::Bytes;
use shardcast_protocol::{
    DataTier, ErrorCode, Hop, HopTransport, Manifest, ModelDigest, SessionId,
};
use tracing::{info, warn};

use super::fetch::Fetcher;
use super::forward::Forwarder;
use super::outcome::{FetchError, SessionError};
use super::session::{FeederGuard, Intake};
use super::table::Sessions;
use super::{ChainError, NodeStats, ShardSession, stripe_ranges};
use crate::repair::Repairs;
use crate::store::ShardStore;

/// How long a finished head session stays queryable through `GetSession`.
const HEAD_RETENTION: Duration = Duration::from_secs(600);

/// A head session started through the API: its shard sessions, one per (chain, shard,
/// stripe).
pub struct HeadSession {
    /// Session id.
    pub id: SessionId,
    /// Model version.
    pub model: ModelDigest,
    /// When it started.
    pub started: Instant,
    /// Shard sessions.
    pub parts: Vec<Arc<ShardSession>>,
}

/// One chain of a head session: shards (empty = all) and receivers in order.
#[derive(Debug, Clone)]
pub struct ChainSpec {
    /// Shard indices carried by this chain; empty means all.
    pub shards: Vec<u32>,
    /// Receivers in order.
    pub hops: Vec<Hop>,
}

/// Starts and holds the chains this host heads. See the module docs.
pub(crate) struct Heads {
    store: ShardStore,
    sessions: Sessions,
    intake: Intake,
    repairs: Arc<Repairs>,
    forwarder: Arc<Forwarder>,
    fetcher: Arc<Fetcher>,
    cancel: CancellationToken,
    /// Connections each shard is striped over.
    stripes: super::Stripes,
    /// Counters (a head's origin reads stopped for the loss of the hop below).
    stats: Arc<NodeStats>,
    /// The hops' `upstream_grace`: how often a head whose origin read stopped tries the
    /// origin again (every half of it) before it pulls from the hop below.
    upstream_grace: Duration,
}

impl Heads {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        store: ShardStore,
        sessions: Sessions,
        intake: Intake,
        repairs: Arc<Repairs>,
        forwarder: Arc<Forwarder>,
        fetcher: Arc<Fetcher>,
        cancel: CancellationToken,
        stripes: super::Stripes,
        (stats, upstream_grace): (Arc<NodeStats>, Duration),
    ) -> Self {
        Self {
            store,
            sessions,
            intake,
            repairs,
            forwarder,
            fetcher,
            cancel,
            stripes,
            stats,
            upstream_grace,
        }
    }

    /// Starts a chain session headed by this host (the agent API's `StartChain`); its hops
    /// dial each other with `transport`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start_chain(
        &self,
        id: SessionId,
        manifest: Arc<Manifest>,
        origin: String,
        tier: DataTier,
        chains: Vec<ChainSpec>,
        token: Bytes,
        transport: HopTransport,
    ) -> Result<Arc<HeadSession>, ChainError> {
        let model = manifest.digest();
        let nshards = manifest.shards.len() as u32;
        // Validate the whole plan before starting anything: a rejected request changes nothing.
        let mut plan = Vec::new();
        for chain in &chains {
            let shards: Vec<u32> = if chain.shards.is_empty() {
                (0..nshards).collect()
            } else {
                chain.shards.clone()
            };
            for &s in &shards {
                if s >= nshards {
                    return Err(ChainError::refused(
                        ErrorCode::NoSuchChunk,
                        format!("shard {s} is not in the model ({nshards} shards)"),
                    ));
                }
                let held = self.store.existing_shard(&model, s);
                let complete = held.as_ref().is_some_and(|h| h.is_complete());
                if !complete && origin.is_empty() {
                    return Err(ChainError::refused(
                        ErrorCode::NoSuchChunk,
                        format!(
                            "this host does not hold shard {s} completely and no origin was given to fetch it from"
                        ),
                    ));
                }
                plan.push((s, held, chain.hops.clone()));
            }
        }
        if self.sessions.has_head(&id) {
            return Err(ChainError::refused(
                ErrorCode::Refused,
                format!("session {id} already exists"),
            ));
        }
        self.repairs.note_source(model, &origin);
        let mut parts = Vec::new();
        let stripes = self.stripes.per_shard(plan.len());
        for (s, held, hops) in plan {
            let shard = match held {
                Some(h) => h,
                None => self.store.shard(&model, s, tier).inspect_err(|e| {
                    self.intake
                        .note_store_failure(model, tier, id, e.to_string());
                })?,
            };
            // One session per stripe of the shard, each on its own connection.
            for range in stripe_ranges(shard.total_chunks(), stripes) {
                let (sess, active) = self.intake.new_session(
                    id,
                    model,
                    manifest.clone(),
                    shard.clone(),
                    range.start,
                    range.end,
                    origin.clone(),
                    (token.clone(), transport),
                );
                if !sess.complete() {
                    self.spawn_head_fill(&sess, hops.first().cloned());
                }
                self.forwarder.spawn(&sess, hops.clone());
                let watched = sess.clone();
                tokio::spawn(async move {
                    let _ = watched.finished().await;
                    drop(active);
                });
                parts.push(sess);
            }
        }
        let head = Arc::new(HeadSession {
            id,
            model,
            started: Instant::now(),
            parts,
        });
        self.sessions.insert_head(&head);
        // Keep a finished head session queryable (GetSession) for a while, then drop it so
        // a long-running daemon does not accumulate them.
        let (sessions, cancel) = (self.sessions.clone(), self.cancel.clone());
        let finished = head.clone();
        tokio::spawn(async move {
            for part in &finished.parts {
                let _ = part.finished().await;
            }
            tokio::select! {
                _ = tokio::time::sleep(HEAD_RETENTION) => {}
                _ = cancel.cancelled() => {}
            }
            sessions.remove_head(&finished.id);
        });
        info!(session = %id, model = %model, chains = chains.len(), "chain session started");
        Ok(head)
    }

    /// The head does not hold the shard: fetch it from the origin; the forwarder sends each
    /// chunk on as it lands. `below` is the chain's first hop (see [`fill_watching`]).
    fn spawn_head_fill(&self, sess: &Arc<ShardSession>, below: Option<Hop>) {
        let fetcher = self.fetcher.clone();
        let sess = sess.clone();
        let (stats, grace) = (self.stats.clone(), self.upstream_grace);
        tokio::spawn(async move {
            let _guard = FeederGuard::new(&sess.feeders);
            let origin = sess.origin.clone();
            let mut bypassed = sess.bypassed.subscribe();
            let result = tokio::select! {
                r = fill_watching(&fetcher, &sess, &origin, below.as_ref(), (&stats, grace)) => r,
                below = bypassed_by(&mut bypassed) => {
                    rejoin_as_leaf(&fetcher, &sess, below, &origin).await
                }
            };
            if let Err(e) = result {
                sess.fail(SessionError::OriginFetch(Arc::new(e)));
            } else if !sess.complete() {
                sess.fail(SessionError::OriginIncomplete);
            }
        });
    }
}

/// The head's origin read, watched for the loss of its hop below. When the forwarder gives
/// up on that hop (silent for a stall timeout, or unreachable), either this host's link is
/// gone or that hop is; in the first case the hop below, fed by no one, goes on from the
/// origin by its own recovery at the same moment. So the origin read stops (its reads in
/// flight would resume with the link and read what that hop reads); once the origin
/// answers again, the head first pulls from the hop below what it holds, and reads the
/// origin only for the rest. Without this the head resumed its origin read the moment its
/// link came back and read again what the hop below had read meanwhile (1.75 × the model
/// from the origin once in CI: a 64 MiB model over a 4-host chain cut at the head). A slow
/// origin is not a trigger (the head keeps its hop below fed with keepalives, so that hop
/// does not go to the origin); a dead hop below costs one dropped round of reads in flight
/// and a failed pull. After a round in which the pull brought nothing, later losses (the
/// forwarder failing over down the rest of the chain) do not stop the read again.
async fn fill_watching(
    fetcher: &Fetcher,
    sess: &ShardSession,
    origin: &str,
    below: Option<&Hop>,
    (stats, grace): (&NodeStats, Duration),
) -> Result<(), FetchError> {
    let Some(below) = below else {
        return fetcher.fill_yielding(sess, origin).await;
    };
    let mut lost = sess.downstream_lost.subscribe();
    lost.borrow_and_update();
    let mut watch = true;
    loop {
        tokio::select! {
            r = fetcher.fill_yielding(sess, origin) => return r,
            r = lost.changed(), if watch => if r.is_err() { watch = false; continue },
        }
        stats
            .head_origin_reads_stopped
            .fetch_add(1, Ordering::Relaxed);
        info!(session = %sess.id, have = sess.verified(), total = sess.total(), below = %below.host, "the head lost its hop below (its link, or that hop, is gone): its origin read stops, and that hop gets the first word once the origin answers again");
        fetcher.until_origin_answers(sess, origin, grace).await;
        info!(session = %sess.id, below = %below.host, "the origin answers: pulling from the hop below before reading it");
        let pulled = pull_from_below(fetcher, sess, below).await;
        if sess.complete() {
            return Ok(());
        }
        if pulled == 0 {
            watch = false;
        }
        lost.borrow_and_update();
    }
}

/// This host was stopped or cut off and the chain went on from the origin without it: the
/// hop `below` holds (or is receiving) the rest. Pulls from it rather than reading the
/// origin a second time; the origin only for what it cannot give.
async fn rejoin_as_leaf(
    fetcher: &Fetcher,
    sess: &ShardSession,
    below: Option<Hop>,
    origin: &str,
) -> Result<(), FetchError> {
    if let Some(hop) = below {
        info!(session = %sess.id, below = %hop.host, "bypassed: pulling the rest from the hop below instead of the origin");
        pull_from_below(fetcher, sess, &hop).await;
    }
    fetcher.fill_yielding(sess, origin).await
}

/// Pulls from the hop `below` for as long as it brings chunks; a failed pull is logged (the
/// origin is read for the rest). Returns the chunks it brought.
async fn pull_from_below(fetcher: &Fetcher, sess: &ShardSession, below: &Hop) -> u32 {
    let before = sess.verified();
    if let Err(e) = fetcher.pull_while_progressing(sess, below).await {
        warn!(session = %sess.id, below = %below.host, "pulling from the hop below failed: {e}");
    }
    let pulled = sess.verified().saturating_sub(before);
    info!(session = %sess.id, below = %below.host, pulled, missing = sess.total() - sess.verified(), "pulled from the hop below; the origin is read for what is missing");
    pulled
}

/// The hop below that answered `AlreadyFed` (see [`ShardSession`]'s `bypassed`); never
/// returns if the session ends first. The watch's lock is not held past the clone.
async fn bypassed_by(rx: &mut tokio::sync::watch::Receiver<Option<Hop>>) -> Option<Hop> {
    let hop = match rx.wait_for(Option::is_some).await {
        Ok(r) => r.clone(),
        Err(_) => None,
    };
    match hop {
        Some(hop) => Some(hop),
        None => std::future::pending().await,
    }
}
