//! Chain sessions: receive → verify → store → forward, with failover.
//!
//! ```text
//!            upstream conn(s)                     this host                      downstream
//!  head/hop ──Chunk──▶ [handle_upstream] ─verify─▶ ShardStore ─watch─▶ [forwarder] ──Chunk──▶ hop
//!          ◀──Ack/Nack─┘        ▲                    ▲                     │ ◀──Ack/Nack/Progress/Done
//!          ◀──Progress (relayed)┴──── broadcast ─────┼─────────────────────┘
//!                                 [recovery] ─fetch─▶┘ (origin or another holder, when no
//!                                                       upstream is feeding the session)
//! ```
//!
//! One [`ShardSession`] exists per (session id, shard) on each host. It owns the shard's
//! range, the list of hosts below, and three kinds of tasks:
//!
//! * `handle_upstream` (one per upstream connection; more than one when an upstream's
//!   upstream fails over to us): reads `Chunk` frames, verifies each against the manifest,
//!   writes it positionally into the store, answers `Ack` (or `Nack` on a hash mismatch, so
//!   the sender sends it again) and relays `Progress` from below.
//! * the forwarder (one per session): waits on the store's "newly verified" signal and sends
//!   each chunk on as soon as it is here (cut-through), keeping at most `window` chunks
//!   unacknowledged. If the next hop dies or refuses, it connects to the one after it and
//!   resumes from what that hop's `Accept` says it lacks.
//! * the recovery monitor: when no upstream is feeding an incomplete session for
//!   `upstream_grace`, it fetches the missing chunks from the session's fallback source
//!   (an origin URI, or `shardcast://host:port` for another holder).
//!
//! A host that heads a chain (started through the agent API) runs the same forwarder; its
//! chunks come from its store, or from an origin fill task as they arrive.
//!
//! Corruption at rest: the forwarder and the `Fetch` server read chunks through
//! [`Shard::read_checked`](crate::store::Shard::read_checked), which re-hashes a chunk not
//! verified within the store's trust window. A chunk that fails is dropped by the store, never
//! sent, and repaired (`crate::repair`: the other tier, the session's source, known
//! sources); the forwarder sends it once it is verified again. A `Nack` from downstream makes
//! the forwarder re-hash its copy before resending: a bad copy is dropped and repaired rather
//! than resent, and counts nothing against the downstream. A forwarder whose own copy cannot
//! be completed (the session failed) stops without failing over: the downstream hop is not
//! at fault, and its recovery monitor fetches from its fallback source.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use shardcast_identity::{Peer, Role};
use shardcast_protocol::{
    ErrorCode, Frame, Hop, HostId, Manifest, ModelDigest, PROTOCOL_VERSION, SessionHeader,
    SessionId, Tier, VerifiedChunk, plan::PlanClaims,
};
use tokio::net::TcpStream;
use tokio::sync::{broadcast, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

mod proto;

use proto::{
    AfterFill, Answer, Inbound, InboundConfig, InboundFrame, LocalCopy, RecoveryAction,
    RecoveryMonitor, Repair, SendFailure, SendOutcome, SendWindow, SendWindowConfig, Transmit,
    Verdict, Watched,
};

use crate::limits::{ConnLimits, Limits};
use crate::origin::{self, Origin, OriginAccess};
use crate::repair::{RepairRequest, Repairs};
use crate::store::{BindingSource, Check, Shard, ShardStore, StoreError};
use crate::throttle::RateLimiter;
use crate::transport::Transport;
use crate::wire::{BoxStream, ByteCounters, Conn, FrameBudget, WireError};

/// Chunks a sender re-verifies ahead of the one it is sending (when they are not trusted):
/// the hashing of the next chunks overlaps the socket write of this one. Rationale: BLAKE3
/// of a 1 MiB chunk (0.25–0.5 ms on the 2-vCPU host) is about the time to write it at
/// 10 Gbit/s, so a few in parallel keep an idle holder's re-hash off the critical path
/// without taking more than the blocking pool's share of the cores.
const CHECK_AHEAD: u32 = 4;

/// Fetches from the fallback source a hop session tries before it fails. Rationale: one
/// retry covers a transient origin error, a third a holder that is still being filled; more
/// only delays the controller's re-plan of a receiver that cannot finish.
const RECOVERY_ATTEMPTS: u32 = 3;

/// How long a finished head session stays queryable through `GetSession`.
const HEAD_RETENTION: Duration = Duration::from_secs(600);

/// Tuning of chain sessions.
#[derive(Debug, Clone)]
pub struct ChainConfig {
    /// Chunks a sender keeps unacknowledged per downstream connection. Rationale: the
    /// window must cover the bandwidth-delay product plus one chunk of verify+write time at
    /// the receiver; 16 × 1 MiB covers 1 Gbit/s at up to ~100 ms RTT and 10 Gbit/s on a
    /// LAN, while bounding what a dead hop leaves in flight.
    pub window: usize,
    /// How long a hop whose upstream vanished waits for a replacement upstream (the
    /// upstream's upstream failing over to it) before fetching from the fallback source.
    pub upstream_grace: Duration,
    /// Silence from a downstream hop, while chunks or `Done` await its answer, after which
    /// it is treated as dead.
    pub idle_timeout: Duration,
    /// Concurrent range reads when filling from an origin.
    pub origin_parallel: usize,
    /// The origin allow-list, checked for every origin this host opens (fills, a
    /// session's fallback origin, imports). The default allows none.
    pub origins: OriginAccess,
    /// Connection caps and per-phase timeouts of the data port.
    pub limits: Limits,
    /// How often one chunk may be re-sent after `Nack`s before the hop is given up.
    pub max_resends: u32,
    /// Minimum interval between a hop's own `Progress` frames.
    pub progress_interval: Duration,
    /// Chunks a hop verifies and stores concurrently per upstream connection, while it
    /// reads the next ones off the wire. Rationale: measured on loopback (docs/BENCHMARKS.md),
    /// 4 beat 1 and 2: it keeps hashing, the store write and the socket busy at once while
    /// holding only 4 chunks of memory per connection.
    pub pipeline_depth: usize,
}

impl Default for ChainConfig {
    fn default() -> Self {
        Self {
            window: 16,
            upstream_grace: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(30),
            origin_parallel: 8,
            origins: OriginAccess::default(),
            limits: Limits::default(),
            max_resends: 5,
            progress_interval: Duration::from_millis(100),
            pipeline_depth: 4,
        }
    }
}

impl ChainConfig {
    /// The send window's part of the tuning.
    fn send_window(&self) -> SendWindowConfig {
        SendWindowConfig {
            window: self.window,
            idle_timeout: self.idle_timeout,
            max_resends: self.max_resends,
        }
    }

    /// The receiving end's part of the tuning.
    fn inbound(&self) -> InboundConfig {
        InboundConfig {
            pipeline_depth: self.pipeline_depth,
            progress_interval: self.progress_interval,
        }
    }
}

/// Counters of the data plane on one host.
#[derive(Debug, Default)]
pub struct NodeStats {
    /// Chunks verified and stored.
    pub chunks_verified: AtomicU64,
    /// Chunks dropped because their hash did not match.
    pub chunks_corrupt: AtomicU64,
    /// Chunks sent again after a `Nack`.
    pub chunks_resent: AtomicU64,
    /// Sessions in progress.
    pub sessions_active: AtomicU64,
    /// Sessions ever started on this host.
    pub sessions_total: AtomicU64,
    /// Payload bytes fetched from origins.
    pub origin_bytes: AtomicU64,
    /// Times a forwarder skipped a dead or refusing downstream hop.
    pub downstream_failovers: AtomicU64,
    /// Times a hop fetched missing chunks from a fallback source.
    pub upstream_recoveries: AtomicU64,
    /// Data-port connections refused in the TLS handshake (no certificate, another CA,
    /// expired, not a `host`).
    pub tls_refused: AtomicU64,
    /// Peers whose `Hello` host id differed from their certificate's.
    pub identity_mismatch: AtomicU64,
    /// Agent API calls refused by role.
    pub authz: Arc<shardcast_identity::grpc::AuthzStats>,
    /// `Open`s refused for want of a valid plan token (none, forged, expired, another
    /// model, or a host the plan does not name).
    pub sessions_unauthorised: AtomicU64,
    /// `Open`s refused because the host already holds `max_sessions` hop sessions.
    pub sessions_refused: AtomicU64,
    /// `Progress` frames not recorded because a session already tracks
    /// [`MAX_PROGRESS_HOSTS`] hosts below it (a peer inventing host ids).
    pub progress_dropped: AtomicU64,
}

/// Hosts whose relayed progress one session records: no chain has more hops below a host
/// than an `Open` frame may list.
pub const MAX_PROGRESS_HOSTS: usize = shardcast_protocol::frame::MAX_HOPS;

/// Why a chain operation failed. Sent to peers as an `Error` frame, to API callers as a
/// `tonic::Status` (see `agent.rs`).
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// The peer broke the protocol or the stream failed.
    #[error("{0}")]
    Wire(#[from] WireError),
    /// The peer sent an `Error` frame.
    #[error("peer reported {code:?}: {message}")]
    Remote {
        /// Its code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// A request we refuse, with the code to send back.
    #[error("{message}")]
    Refused {
        /// Code for the peer.
        code: ErrorCode,
        /// What is wrong.
        message: String,
    },
    /// The store failed.
    #[error("store: {0}")]
    Store(#[from] crate::store::StoreError),
    /// The peer closed the connection before the exchange finished.
    #[error("peer closed the connection")]
    Closed,
    /// The peer went silent.
    #[error("peer silent for {0:?}")]
    Timeout(Duration),
}

impl ChainError {
    fn refused(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::Refused {
            code,
            message: message.into(),
        }
    }

    fn protocol(message: impl Into<String>) -> Self {
        Self::refused(ErrorCode::ProtocolViolation, message)
    }

    /// The code to send the peer, if the fault is worth telling it about.
    fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Wire(w) => w.code(),
            Self::Refused { code, .. } => Some(*code),
            Self::Store(_) => Some(ErrorCode::Storage),
            Self::Remote { .. } | Self::Closed | Self::Timeout(_) => None,
        }
    }
}

impl From<SendFailure> for ChainError {
    fn from(f: SendFailure) -> Self {
        match f {
            SendFailure::Silent(d) => Self::Timeout(d),
            SendFailure::Rejected { index, times } => Self::refused(
                ErrorCode::Refused,
                format!("chunk {index} rejected {times} times although it verifies here"),
            ),
            SendFailure::EarlyDone => Self::protocol("unexpected Done from downstream"),
        }
    }
}

/// A chunk on its way into a session's store.
enum Incoming {
    /// Bytes from a peer, to verify against the manifest.
    Unverified(Bytes),
    /// Verified already (an origin fetch verifies as it reads).
    Verified(VerifiedChunk),
}

/// Where a stored chunk came from (for counters and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkFrom {
    /// An upstream hop of the session.
    Upstream,
    /// A holder answering `Fetch`.
    Holder,
    /// An origin.
    Origin,
}

/// Test-only fault injection: chunks to corrupt the first time this host sends them.
/// Armed only when the daemon runs with `SHARDCAST_ENABLE_FAULT_INJECTION=1` (see
/// `config.rs`), so production daemons cannot be made to corrupt data by configuration.
#[derive(Debug, Default)]
pub struct Faults {
    corrupt_once: Mutex<HashSet<(u32, u32)>>,
}

impl Faults {
    /// Arms corruption of each `(shard, chunk)` in `chunks`.
    pub fn corrupt_once(chunks: impl IntoIterator<Item = (u32, u32)>) -> Self {
        Self {
            corrupt_once: Mutex::new(chunks.into_iter().collect()),
        }
    }

    fn take(&self, shard: u32, index: u32) -> bool {
        self.corrupt_once
            .lock()
            .map(|mut s| s.remove(&(shard, index)))
            .unwrap_or(false)
    }
}

/// Where a forwarder stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ForwardState {
    Running,
    Finished(Result<(), String>),
}

/// One shard's part of a chain session on this host. See the module docs.
pub struct ShardSession {
    /// The session id.
    pub id: SessionId,
    /// Model version.
    pub model: ModelDigest,
    /// Its manifest.
    pub manifest: Arc<Manifest>,
    /// The shard in the local store.
    pub shard: Arc<Shard>,
    /// Chunk range `start..end`.
    pub start: u32,
    /// One past the last chunk.
    pub end: u32,
    /// Fallback source for missing chunks.
    pub origin: String,
    /// The controller's plan token, passed on in every `Open` this hop sends.
    pub token: Bytes,
    /// When this host joined the session.
    pub started: Instant,
    feeders: watch::Sender<usize>,
    progress: broadcast::Sender<Frame>,
    hop_progress: Mutex<BTreeMap<String, (u32, u32)>>,
    forward: watch::Sender<ForwardState>,
    failed: watch::Sender<Option<String>>,
    write_lock: tokio::sync::Mutex<()>,
}

impl ShardSession {
    fn shard_index(&self) -> u32 {
        self.shard.index()
    }

    /// Chunks of the range verified here.
    pub fn verified(&self) -> u32 {
        // Called after every chunk: use the store's running count for whole-shard ranges
        // (the common case) instead of building a bitmap of the range.
        if self.start == 0 && self.end == self.shard.total_chunks() {
            self.shard.verified_count()
        } else {
            self.shard.verified_set(self.start, self.end).len()
        }
    }

    /// Chunks in the range.
    pub fn total(&self) -> u32 {
        self.end - self.start
    }

    /// Whether every chunk of the range is verified here.
    pub fn complete(&self) -> bool {
        self.verified() == self.total()
    }

    /// Progress of the hosts below, as relayed to this host: host → (verified, total).
    pub fn hop_progress(&self) -> BTreeMap<String, (u32, u32)> {
        self.hop_progress
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default()
    }

    /// `None` while running; `Some(Ok)` when the range is here and the forwarder finished;
    /// `Some(Err)` when it cannot finish.
    pub fn outcome(&self) -> Option<Result<(), String>> {
        if let Some(e) = self.failed.borrow().clone() {
            return Some(Err(e));
        }
        match &*self.forward.borrow() {
            ForwardState::Finished(r) if self.complete() => Some(r.clone()),
            _ => None,
        }
    }

    /// Marks the session failed (it cannot complete here).
    pub(crate) fn fail(&self, why: String) {
        warn!(session = %self.id, shard = self.shard_index(), "session failed: {why}");
        self.failed.send_replace(Some(why));
    }

    /// Waits until [`ShardSession::outcome`] is `Some`.
    pub async fn finished(&self) -> Result<(), String> {
        let mut verified = self.shard.subscribe();
        let mut forward = self.forward.subscribe();
        let mut failed = self.failed.subscribe();
        loop {
            if let Some(r) = self.outcome() {
                return r;
            }
            tokio::select! {
                r = verified.changed() => if r.is_err() { return Err("store closed".into()) },
                r = forward.changed() => if r.is_err() { return Err("forwarder gone".into()) },
                r = failed.changed() => if r.is_err() { return Err("session gone".into()) },
            }
        }
    }

    /// Records a host's relayed progress; false (not recorded) when the table is full.
    fn record_progress(&self, host: &HostId, verified: u32, total: u32) -> bool {
        let Ok(mut m) = self.hop_progress.lock() else {
            return false;
        };
        if let Some(v) = m.get_mut(host.as_str()) {
            *v = (verified, total);
            return true;
        }
        if m.len() >= MAX_PROGRESS_HOSTS {
            return false;
        }
        m.insert(host.to_string(), (verified, total));
        true
    }
}

/// Counts a live feeder (an upstream connection or a fill task) for as long as it lives.
struct FeederGuard(watch::Sender<usize>);

impl FeederGuard {
    fn new(tx: &watch::Sender<usize>) -> Self {
        tx.send_modify(|n| *n += 1);
        Self(tx.clone())
    }
}

impl Drop for FeederGuard {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// A head session started through the API: its shard sessions, one per (chain, shard).
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

/// Everything a host needs to take part in chains; one per daemon.
pub struct Node {
    /// This host's id.
    pub host: HostId,
    /// The local store.
    pub store: ShardStore,
    /// Transport to other hops.
    pub transport: Transport,
    /// Daemon-wide ingress cap.
    pub ingress: RateLimiter,
    /// Daemon-wide egress cap.
    pub egress: RateLimiter,
    /// Wire byte counters.
    pub counters: Arc<ByteCounters>,
    /// Memory for frame bodies in flight on every connection (`cfg.limits.frame_memory`).
    pub frame_budget: Arc<FrameBudget>,
    /// Data-plane counters.
    pub stats: NodeStats,
    /// Tuning.
    pub cfg: ChainConfig,
    /// Fault injection (tests only).
    pub faults: Faults,
    /// Cancelled on shutdown.
    pub cancel: CancellationToken,
    /// Repairs of chunks corrupt at rest, and the sources to repair from.
    pub repairs: Repairs,
    /// Open data-plane connections against their caps (`cfg.limits`).
    pub conn_limits: Arc<ConnLimits>,
    sessions: Mutex<HashMap<(SessionId, u32), Arc<ShardSession>>>,
    heads: Mutex<HashMap<SessionId, Arc<HeadSession>>>,
}

impl Node {
    /// A node with no sessions yet. Inside a tokio runtime this also starts the repairer
    /// and the scrub (`crate::repair`), which stop on `cancel`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        host: HostId,
        store: ShardStore,
        transport: Transport,
        ingress: RateLimiter,
        egress: RateLimiter,
        cfg: ChainConfig,
        faults: Faults,
        cancel: CancellationToken,
    ) -> Arc<Self> {
        let node = Arc::new(Self {
            host,
            store,
            transport,
            ingress,
            egress,
            counters: Arc::default(),
            frame_budget: FrameBudget::new(cfg.limits.frame_memory),
            stats: NodeStats::default(),
            conn_limits: ConnLimits::new(&cfg.limits),
            cfg,
            faults,
            cancel,
            repairs: Repairs::new(),
            sessions: Mutex::default(),
            heads: Mutex::default(),
        });
        if tokio::runtime::Handle::try_current().is_ok() {
            crate::repair::spawn(&node);
        }
        node
    }

    /// Whether a session that has not finished sends or receives model `model` here.
    pub fn model_busy(&self, model: &ModelDigest) -> bool {
        let hop = self.sessions.lock().is_ok_and(|m| {
            m.values()
                .any(|s| s.model == *model && s.outcome().is_none())
        });
        let head = self.heads.lock().is_ok_and(|m| {
            m.values()
                .any(|h| h.model == *model && h.parts.iter().any(|p| p.outcome().is_none()))
        });
        hop || head
    }

    /// Fails every unfinished session on this host that forwards from `shard` and needs one
    /// of `chunks` (they were dropped as corrupt and cannot be repaired), so that none waits
    /// for them forever. Returns how many were failed.
    pub(crate) fn fail_sessions_needing(
        &self,
        shard: &Arc<Shard>,
        chunks: &[u32],
        why: &str,
    ) -> usize {
        let needs = |s: &ShardSession| {
            Arc::ptr_eq(&s.shard, shard)
                && s.outcome().is_none()
                && chunks.iter().any(|c| (s.start..s.end).contains(c))
        };
        let mut hit: Vec<Arc<ShardSession>> = self
            .sessions
            .lock()
            .map(|m| m.values().filter(|s| needs(s)).cloned().collect())
            .unwrap_or_default();
        if let Ok(h) = self.heads.lock() {
            hit.extend(
                h.values()
                    .flat_map(|h| h.parts.iter())
                    .filter(|s| needs(s))
                    .cloned(),
            );
        }
        for s in &hit {
            s.fail(why.to_string());
        }
        hit.len()
    }

    /// A head session by id.
    pub fn head(&self, id: &SessionId) -> Option<Arc<HeadSession>> {
        self.heads.lock().ok()?.get(id).cloned()
    }

    /// Connects to a hop's data port; with TLS the peer must be a `host` (exactly
    /// `expect` when given).
    async fn connect(
        &self,
        addr: &str,
        expect: Option<&HostId>,
    ) -> Result<(Conn, Peer), ChainError> {
        let (stream, peer) = self
            .transport
            .connect(addr, expect)
            .await
            .map_err(WireError::Io)?;
        Ok((self.conn(stream), peer))
    }

    fn conn(&self, stream: BoxStream) -> Conn {
        let mut conn = Conn::new(
            stream,
            self.ingress.clone(),
            self.egress.clone(),
            self.counters.clone(),
            self.frame_budget.clone(),
        );
        conn.writer
            .set_write_timeout(Some(self.cfg.limits.write_timeout));
        conn
    }

    /// Sends our `Hello` and reads the peer's; refuses other protocol versions, and a
    /// `Hello` whose host id is not the one the peer's certificate names.
    async fn handshake(&self, conn: &mut Conn, peer: &Peer) -> Result<HostId, ChainError> {
        let host = self.hello(conn).await?;
        match peer {
            Peer::Cert(id) if id.role == Role::Host && id.name == host.as_str() => Ok(host),
            Peer::Insecure => Ok(host),
            other => {
                self.stats.identity_mismatch.fetch_add(1, Ordering::Relaxed);
                Err(ChainError::refused(
                    ErrorCode::Refused,
                    format!("Hello names host {host}, but the peer is {other}"),
                ))
            }
        }
    }

    async fn hello(&self, conn: &mut Conn) -> Result<HostId, ChainError> {
        let hello = Frame::Hello {
            version: PROTOCOL_VERSION,
            host: self.host.clone(),
        };
        conn.writer.send_now(&hello).await?;
        let timeout = self.cfg.idle_timeout;
        match read_timeout(conn, timeout).await? {
            Frame::Hello { version, host } if version == PROTOCOL_VERSION => Ok(host),
            Frame::Hello { version, .. } => Err(ChainError::refused(
                ErrorCode::UnsupportedVersion,
                format!(
                    "peer speaks protocol version {version}; this host speaks {PROTOCOL_VERSION}"
                ),
            )),
            Frame::Error { code, message } => Err(ChainError::Remote { code, message }),
            other => Err(ChainError::protocol(format!(
                "expected Hello, got {:?}",
                other.ty()
            ))),
        }
    }

    /// Serves one accepted connection (an upstream hop or a puller) until it ends.
    /// Errors are answered with an `Error` frame and logged; they never affect other
    /// connections.
    /// The TLS handshake runs here, in the connection's task: a peer without a valid
    /// certificate is dropped before a single frame is read.
    pub async fn serve_connection(self: Arc<Self>, stream: TcpStream, peer: String) {
        let span = info_span!("conn", %peer, host = tracing::field::Empty);
        let (stream, identity) = match self.transport.secure(stream).await {
            Ok(s) => s,
            Err(e) => {
                self.stats.tls_refused.fetch_add(1, Ordering::Relaxed);
                let _enter = span.enter();
                warn!("refusing connection: {e}");
                return;
            }
        };
        let mut conn = self.conn(stream);
        let result = async {
            let limit = self.cfg.limits.handshake_timeout;
            let remote =
                match tokio::time::timeout(limit, self.handshake(&mut conn, &identity)).await {
                    Ok(r) => r?,
                    Err(_) => {
                        self.counters
                            .handshake_timeouts
                            .fetch_add(1, Ordering::Relaxed);
                        return Err(ChainError::Timeout(limit));
                    }
                };
            tracing::Span::current().record("host", remote.as_str());
            // From here a silent peer (between frames or mid-frame) is dropped.
            conn.reader
                .set_idle_timeout(Some(self.cfg.limits.peer_idle_timeout));
            self.serve_requests(&mut conn, &remote).await
        }
        .instrument(span.clone())
        .await;
        if let Err(e) = result {
            let _enter = span.enter();
            match e.code() {
                Some(code) => {
                    warn!("refusing peer: {e}");
                    let _ = conn
                        .writer
                        .send_now(&Frame::error(code, e.to_string()))
                        .await;
                }
                None => debug!("connection ended: {e}"),
            }
        }
    }

    async fn serve_requests(
        self: &Arc<Self>,
        conn: &mut Conn,
        remote: &HostId,
    ) -> Result<(), ChainError> {
        let mut offered: Option<Manifest> = None;
        loop {
            let Some(frame) = conn.reader.read().await? else {
                return Ok(());
            };
            match frame {
                Frame::Manifest(m) => offered = Some(m),
                Frame::Open(header) => {
                    let sess = self.join_session(&header, offered.take(), remote)?;
                    return self.handle_upstream(conn, sess, remote).await;
                }
                Frame::Fetch {
                    model,
                    shard,
                    start,
                    end,
                } => {
                    self.serve_fetch(conn, model, shard, start, end).await?;
                }
                Frame::Error { code, message } => return Err(ChainError::Remote { code, message }),
                other => {
                    return Err(ChainError::protocol(format!(
                        "expected Manifest, Open or Fetch, got {:?}",
                        other.ty()
                    )));
                }
            }
        }
    }

    /// Checks the `Open`'s plan token: signed by the controller (a certificate of the
    /// cluster CA with the `controller` role), not expired, for this model, naming this
    /// host, the sender and every downstream hop. Without TLS (`insecure_plaintext`) there
    /// is no CA to check a signature against, and sessions are accepted as before.
    fn authorize_open(
        &self,
        header: &SessionHeader,
        remote: &HostId,
    ) -> Result<Option<PlanClaims>, ChainError> {
        let Some(tls) = self.transport.tls() else {
            return Ok(None);
        };
        let refuse = |why: String| {
            self.stats
                .sessions_unauthorised
                .fetch_add(1, Ordering::Relaxed);
            ChainError::refused(
                ErrorCode::Refused,
                format!("session {} not authorised: {why}", header.session),
            )
        };
        if header.token.is_empty() {
            return Err(refuse(
                "no plan token (sessions are started by the controller)".into(),
            ));
        }
        let claims = tls
            .verify_plan(&header.token, rustls::pki_types::UnixTime::now())
            .map_err(|e| refuse(e.to_string()))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        claims
            .authorises(&header.model, &self.host, remote, &header.downstream, now)
            .map_err(refuse)?;
        Ok(Some(claims))
    }

    /// Finds the session for `header`, or creates it (and its forwarder and recovery
    /// monitor).
    fn join_session(
        self: &Arc<Self>,
        header: &SessionHeader,
        offered: Option<Manifest>,
        remote: &HostId,
    ) -> Result<Arc<ShardSession>, ChainError> {
        // Nothing of a session the controller did not authorise is kept: not even its
        // manifest.
        let claims = self.authorize_open(header, remote)?;
        let key = (header.session, header.shard);
        if let Some(s) = self.sessions.lock().ok().and_then(|m| m.get(&key).cloned()) {
            debug!(session = %header.session, shard = header.shard, "joining running session");
            return Ok(s);
        }
        // A fallback origin outside this host's policy refuses the session before anything
        // is stored: the peer does not get to make this host read where it says.
        if !header.origin.is_empty() && !header.origin.starts_with("shardcast://") {
            self.cfg.origins.check(&header.origin).map_err(|e| {
                ChainError::refused(ErrorCode::Refused, format!("fallback origin: {e}"))
            })?;
        }
        let held = self.sessions.lock().map(|m| m.len()).unwrap_or(0);
        if held >= self.cfg.limits.max_sessions {
            self.stats.sessions_refused.fetch_add(1, Ordering::Relaxed);
            return Err(ChainError::refused(
                ErrorCode::Refused,
                format!("this host already holds {held} sessions (max_sessions); retry later"),
            ));
        }
        let manifest = match self.store.manifest(&header.model) {
            Some(m) => m,
            None => match offered {
                Some(m) if m.digest() == header.model => self.store.put_manifest(&m)?,
                Some(m) => {
                    return Err(ChainError::refused(
                        ErrorCode::UnknownModel,
                        format!(
                            "manifest digest {} does not match the session's model {}",
                            m.digest(),
                            header.model
                        ),
                    ));
                }
                None => {
                    return Err(ChainError::refused(
                        ErrorCode::UnknownModel,
                        format!(
                            "model {} is unknown here and no manifest was sent",
                            header.model
                        ),
                    ));
                }
            },
        };
        // The controller signed this plan for its name's current version: the name means
        // this version here from now on (never because a manifest says so).
        if let Some(name) = claims.as_ref().and_then(|c| c.name.as_ref())
            && *name == manifest.name
        {
            self.store
                .bind_name(name, header.model, BindingSource::Plan)?;
        }
        let chunks = manifest
            .shard(header.shard)
            .map_err(|e| ChainError::refused(ErrorCode::NoSuchChunk, e.to_string()))?
            .chunks
            .len() as u32;
        if header.end > chunks || header.start > header.end {
            return Err(ChainError::refused(
                ErrorCode::NoSuchChunk,
                format!(
                    "range {}..{} is outside shard {} ({chunks} chunks)",
                    header.start, header.end, header.shard
                ),
            ));
        }
        let shard = match self.store.existing_shard(&header.model, header.shard) {
            Some(s) if s.tier() == header.tier || s.is_complete() => s,
            _ => self.store.shard(&header.model, header.shard, header.tier)?,
        };
        self.repairs.note_source(header.model, &header.origin);
        let sess = self.new_session(
            header.session,
            header.model,
            manifest,
            shard,
            header.start,
            header.end,
            header.origin.clone(),
            header.token.clone(),
        );
        let mut map = self
            .sessions
            .lock()
            .map_err(|_| ChainError::refused(ErrorCode::Internal, "session table poisoned"))?;
        // Another connection may have created it while we were opening the shard.
        if let Some(s) = map.get(&key) {
            return Ok(s.clone());
        }
        map.insert(key, sess.clone());
        drop(map);
        self.spawn_forwarder(&sess, header.downstream.clone());
        self.spawn_recovery(&sess);
        self.spawn_reaper(&sess, key);
        Ok(sess)
    }

    #[allow(clippy::too_many_arguments)]
    fn new_session(
        &self,
        id: SessionId,
        model: ModelDigest,
        manifest: Arc<Manifest>,
        shard: Arc<Shard>,
        start: u32,
        end: u32,
        origin: String,
        token: Bytes,
    ) -> Arc<ShardSession> {
        self.stats.sessions_total.fetch_add(1, Ordering::Relaxed);
        self.stats.sessions_active.fetch_add(1, Ordering::Relaxed);
        Arc::new(ShardSession {
            id,
            model,
            manifest,
            shard,
            start,
            end,
            origin,
            token,
            started: Instant::now(),
            feeders: watch::Sender::new(0),
            progress: broadcast::Sender::new(256),
            hop_progress: Mutex::default(),
            forward: watch::Sender::new(ForwardState::Running),
            failed: watch::Sender::new(None),
            write_lock: tokio::sync::Mutex::new(()),
        })
    }

    /// Removes a hop session from the table once it has finished, so a later session id can
    /// reuse nothing stale; decrements the active-session gauge.
    fn spawn_reaper(self: &Arc<Self>, sess: &Arc<ShardSession>, key: (SessionId, u32)) {
        let node = self.clone();
        let sess = sess.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = sess.finished() => {}
                _ = node.cancel.cancelled() => {}
            }
            // Let late joiners (a failover racing completion) still find it for a moment.
            tokio::time::sleep(Duration::from_secs(5)).await;
            if let Ok(mut m) = node.sessions.lock() {
                m.remove(&key);
            }
            node.stats.sessions_active.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// Reads chunks from one upstream connection into the session.
    async fn handle_upstream(
        self: &Arc<Self>,
        conn: &mut Conn,
        sess: Arc<ShardSession>,
        remote: &HostId,
    ) -> Result<(), ChainError> {
        let span = info_span!("upstream", session = %sess.id, model = %sess.model, shard = sess.shard_index(), peer = %remote);
        async move {
            let guard = FeederGuard::new(&sess.feeders);
            let have = sess.shard.verified_set(sess.start, sess.end);
            info!(have = have.len(), total = sess.total(), "session accepted");
            conn.writer.send_now(&Frame::Accept { have }).await?;
            let mut relayed = sess.progress.subscribe();
            let shard = sess.shard_index();
            let mut inbound = Inbound::new(shard, sess.start..sess.end, self.cfg.inbound());
            // Verify+store runs concurrently with reading the next chunks off the wire, so
            // a hop's throughput is bounded by its slowest stage, not their sum.
            let mut pending = futures::stream::FuturesUnordered::new();
            while inbound.feeding() {
                tokio::select! {
                    biased;
                    _ = self.cancel.cancelled() => return Err(ChainError::refused(ErrorCode::Refused, "host is shutting down")),
                    Some((index, verdict)) = pending.next(), if !pending.is_empty() => {
                        let verdict: Verdict = verdict?;
                        let reply = inbound.handle_verdict(now(), index, verdict, sess.complete());
                        let frame = match reply.verdict {
                            Verdict::Stored => Frame::Ack { shard, index },
                            Verdict::Corrupt => Frame::Nack { shard, index },
                        };
                        conn.writer.send(&frame).await?;
                        if reply.progress {
                            conn.writer.send(&self.own_progress(&sess)).await?;
                        }
                        conn.writer.flush().await?;
                    }
                    frame = conn.reader.read(), if inbound.wants_frame() => match frame? {
                        Some(Frame::Chunk { shard: s, index, data }) => {
                            inbound.handle_frame(InboundFrame::Chunk { shard: s, index }).map_err(|_| {
                                ChainError::protocol(format!(
                                    "chunk {s}/{index} is outside the session's shard {shard} range {}..{}",
                                    sess.start, sess.end
                                ))
                            })?;
                            let (node, sess) = (self.clone(), sess.clone());
                            pending.push(async move {
                                (index, node.store_chunk(&sess, index, Incoming::Unverified(data), ChunkFrom::Upstream).await)
                            });
                        }
                        Some(Frame::Done) => {
                            let _ = inbound.handle_frame(InboundFrame::Done);
                        }
                        Some(Frame::Error { code, message }) => return Err(ChainError::Remote { code, message }),
                        Some(other) => return Err(ChainError::protocol(format!("unexpected {:?} in a session", other.ty()))),
                        None => return Err(ChainError::Closed),
                    },
                    p = relayed.recv() => if let Ok(p) = p {
                        conn.writer.send_now(&p).await?;
                    },
                }
            }
            // The upstream has sent all it will; it is no longer feeding us. If chunks are
            // still missing, the recovery monitor fetches them from the fallback source.
            drop(guard);
            loop {
                tokio::select! {
                    biased;
                    _ = self.cancel.cancelled() => return Err(ChainError::refused(ErrorCode::Refused, "host is shutting down")),
                    r = sess.finished() => {
                        return match r {
                            Ok(()) => {
                                // Relay what is still queued from below (the tail's final
                                // Progress in particular) before our own and Done.
                                while let Ok(p) = relayed.try_recv() {
                                    conn.writer.send(&p).await?;
                                }
                                conn.writer.send(&self.own_progress(&sess)).await?;
                                conn.writer.send_now(&Frame::Done).await?;
                                info!(elapsed_ms = sess.started.elapsed().as_millis() as u64, "session complete");
                                Ok(())
                            }
                            Err(e) => Err(ChainError::refused(ErrorCode::NoSuchChunk, format!("session cannot complete: {e}"))),
                        };
                    }
                    p = relayed.recv() => if let Ok(p) = p {
                        conn.writer.send_now(&p).await?;
                    },
                }
            }
        }
        .instrument(span)
        .await
    }

    fn own_progress(&self, sess: &ShardSession) -> Frame {
        Frame::Progress {
            host: self.host.clone(),
            shard: sess.shard_index(),
            verified: sess.verified(),
            total: sess.total(),
        }
    }

    /// Verifies, stores and counts one chunk of `sess`'s shard: the one path by which
    /// chunks from an upstream, a holder (`Fetch`) and an origin enter the store. Hashing
    /// runs off the I/O threads. `Ok(Verdict::Corrupt)`: it failed verification and was
    /// dropped (a session's sender sends it again).
    async fn store_chunk(
        &self,
        sess: &ShardSession,
        index: u32,
        chunk: Incoming,
        from: ChunkFrom,
    ) -> Result<Verdict, ChainError> {
        let chunk = match chunk {
            Incoming::Verified(chunk) => chunk,
            Incoming::Unverified(data) => {
                let (manifest, shard) = (sess.manifest.clone(), sess.shard_index());
                // BLAKE3 of a chunk takes ~0.3 ms per MiB: hash off the I/O threads.
                let verified =
                    tokio::task::spawn_blocking(move || manifest.verified(shard, index, data))
                        .await
                        .map_err(|e| {
                            ChainError::refused(ErrorCode::Internal, format!("verify task: {e}"))
                        })?;
                match verified {
                    Ok(chunk) => chunk,
                    Err(e) => {
                        self.stats.chunks_corrupt.fetch_add(1, Ordering::Relaxed);
                        warn!(
                            chunk = index,
                            ?from,
                            "dropping chunk that failed verification: {e}"
                        );
                        return Ok(Verdict::Corrupt);
                    }
                }
            }
        };
        let len = chunk.data().len() as u64;
        {
            // Writes to one file serialise on its inode lock in the kernel; queue them here
            // (an async wait) rather than have threads spin on that lock.
            let _serial = sess.write_lock.lock().await;
            sess.shard.write(chunk).await?;
        }
        self.stats.chunks_verified.fetch_add(1, Ordering::Relaxed);
        if from == ChunkFrom::Origin {
            self.stats.origin_bytes.fetch_add(len, Ordering::Relaxed);
        }
        Ok(Verdict::Stored)
    }

    /// Answers a `Fetch` with every requested chunk held verified here, then `Done`.
    async fn serve_fetch(
        &self,
        conn: &mut Conn,
        model: ModelDigest,
        shard: u32,
        start: u32,
        end: u32,
    ) -> Result<(), ChainError> {
        let Some(local) = self.store.existing_shard(&model, shard) else {
            return Err(ChainError::refused(
                ErrorCode::UnknownModel,
                format!("this host holds no copy of model {model} shard {shard}"),
            ));
        };
        let end = end.min(local.total_chunks());
        for index in start..end {
            if local.is_verified(index) {
                let ahead = index.saturating_add(1);
                local.check_ahead(
                    ahead..ahead.saturating_add(CHECK_AHEAD).min(end),
                    Check::Serve,
                );
                let data = match local.read_checked(index, false, Check::Serve).await {
                    Ok(d) => d,
                    // Dropped by the check (or meanwhile): never sent; repaired in the
                    // background. The puller asks another source for what is missing.
                    Err(StoreError::CorruptChunk { .. }) => {
                        self.repairs
                            .request(RepairRequest::new(local.clone(), vec![index]));
                        continue;
                    }
                    Err(StoreError::NotVerified { .. }) => continue,
                    Err(e) => return Err(e.into()),
                };
                conn.writer.send_chunk(shard, index, &data).await?;
            } else if local.is_dropped(index) {
                // Dropped by a check ahead: repaired in the background like the one above.
                self.repairs
                    .request(RepairRequest::new(local.clone(), vec![index]));
            }
        }
        conn.writer.send_now(&Frame::Done).await?;
        Ok(())
    }

    fn spawn_forwarder(self: &Arc<Self>, sess: &Arc<ShardSession>, hops: Vec<Hop>) {
        let node = self.clone();
        let sess = sess.clone();
        let span = info_span!("forward", session = %sess.id, model = %sess.model, shard = sess.shard_index());
        tokio::spawn(
            async move {
                let result = node.forward(&sess, hops).await;
                if let Err(e) = &result {
                    warn!("forwarding ended: {e}");
                }
                sess.forward.send_replace(ForwardState::Finished(result));
            }
            .instrument(span),
        );
    }

    /// Forwards the session's chunks to the first hop of `hops` that works, failing over
    /// down the list.
    async fn forward(&self, sess: &Arc<ShardSession>, mut hops: Vec<Hop>) -> Result<(), String> {
        let mut failures = Vec::new();
        while !hops.is_empty() {
            let hop = hops.remove(0);
            match self.forward_to(sess, &hop, &hops).await {
                Ok(()) => {
                    return if failures.is_empty() {
                        Ok(())
                    } else {
                        Err(failures.join("; "))
                    };
                }
                Err(e) => {
                    if self.cancel.is_cancelled() {
                        return Err("host is shutting down".into());
                    }
                    // Our own copy cannot be completed or read: the downstream hop is not at
                    // fault, so it is not skipped (its recovery monitor takes over).
                    let local = sess.failed.borrow().clone();
                    if let Some(why) =
                        local.or_else(|| matches!(e, ChainError::Store(_)).then(|| e.to_string()))
                    {
                        warn!(peer = %hop.host, "forwarding stopped by a local failure, not failing over: {why}");
                        failures.push(format!("local: {why}"));
                        return Err(failures.join("; "));
                    }
                    self.stats
                        .downstream_failovers
                        .fetch_add(1, Ordering::Relaxed);
                    warn!(peer = %hop.host, addr = %hop.addr, remaining = hops.len(), "downstream hop failed, failing over: {e}");
                    failures.push(format!("{} ({}): {e}", hop.host, hop.addr));
                }
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(failures.join("; "))
        }
    }

    async fn forward_to(
        &self,
        sess: &Arc<ShardSession>,
        hop: &Hop,
        rest: &[Hop],
    ) -> Result<(), ChainError> {
        let (mut conn, peer) = self.connect(&hop.addr, Some(&hop.host)).await?;
        let remote = self.handshake(&mut conn, &peer).await?;
        if remote != hop.host {
            return Err(ChainError::refused(
                ErrorCode::Refused,
                format!(
                    "{} answered as host {remote}, expected {}",
                    hop.addr, hop.host
                ),
            ));
        }
        conn.writer
            .send(&Frame::Manifest((*sess.manifest).clone()))
            .await?;
        let header = SessionHeader {
            session: sess.id,
            model: sess.model,
            shard: sess.shard_index(),
            start: sess.start,
            end: sess.end,
            tier: sess.shard.tier(),
            origin: sess.origin.clone(),
            downstream: rest.to_vec(),
            token: sess.token.clone(),
        };
        conn.writer.send_now(&Frame::Open(header)).await?;
        let acked = match read_timeout(&mut conn, self.cfg.idle_timeout).await? {
            Frame::Accept { have } if have.range() == (sess.start..sess.end) => have,
            Frame::Accept { have } => {
                return Err(ChainError::protocol(format!(
                    "Accept covers {:?}, expected {}..{}",
                    have.range(),
                    sess.start,
                    sess.end
                )));
            }
            Frame::Error { code, message } => return Err(ChainError::Remote { code, message }),
            other => {
                return Err(ChainError::protocol(format!(
                    "expected Accept, got {:?}",
                    other.ty()
                )));
            }
        };
        info!(peer = %hop.host, already = acked.len(), "downstream accepted");
        let shard = sess.shard_index();
        let copy: &Shard = &sess.shard;
        let mut window = SendWindow::new(acked, self.cfg.send_window(), now());
        let mut local = sess.shard.subscribe();
        let mut failed = sess.failed.subscribe();
        loop {
            for repair in window.scan_dropped(copy) {
                self.request_repair(sess, repair);
            }
            while let Some(transmit) = window.poll_transmit(copy) {
                let (index, recheck) = match transmit {
                    Transmit::Done => {
                        conn.writer.send(&Frame::Done).await?;
                        continue;
                    }
                    Transmit::Chunk { index, recheck } => (index, recheck),
                };
                // Hash the next chunks (if they need it) while this one is read and sent.
                let ahead = index.saturating_add(1);
                sess.shard.check_ahead(
                    ahead..ahead.saturating_add(CHECK_AHEAD).min(sess.end),
                    Check::Serve,
                );
                let why = if recheck { Check::Nack } else { Check::Serve };
                let mut data = match sess.shard.read_checked(index, recheck, why).await {
                    Ok(d) => d,
                    Err(StoreError::CorruptChunk { .. } | StoreError::NotVerified { .. }) => {
                        if let Some(repair) = window.chunk_unreadable(index) {
                            self.request_repair(sess, repair);
                        }
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                };
                window.chunk_read(index, recheck)?;
                if recheck {
                    self.stats.chunks_resent.fetch_add(1, Ordering::Relaxed);
                }
                if self.faults.take(shard, index) {
                    warn!(chunk = index, "fault injection: corrupting chunk in flight");
                    let mut bad = BytesMut::from(&data[..]);
                    if let Some(b) = bad.first_mut() {
                        *b ^= 0xff;
                    }
                    data = bad.freeze();
                }
                conn.writer.send_chunk(shard, index, &data).await?;
            }
            conn.writer.flush().await?;
            let deadline = window.poll_timeout();
            let answer = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return Err(ChainError::refused(ErrorCode::Refused, "host is shutting down")),
                frame = conn.reader.read() => match frame? {
                    Some(Frame::Ack { index, .. }) => Answer::Ack(index),
                    Some(Frame::Nack { index, .. }) => Answer::Nack(index),
                    Some(p @ Frame::Progress { .. }) => {
                        if let Frame::Progress { host, verified, total, .. } = &p
                            && !sess.record_progress(host, *verified, *total)
                        {
                            self.stats.progress_dropped.fetch_add(1, Ordering::Relaxed);
                        }
                        let _ = sess.progress.send(p);
                        Answer::Progress
                    }
                    Some(Frame::Done) => Answer::Done,
                    Some(Frame::Error { code, message }) => return Err(ChainError::Remote { code, message }),
                    Some(other) => return Err(ChainError::protocol(format!("unexpected {:?} from downstream", other.ty()))),
                    None => return Err(ChainError::Closed),
                },
                r = local.changed(), if window.has_room() => {
                    if r.is_err() {
                        return Err(ChainError::refused(ErrorCode::Internal, "local shard closed"));
                    }
                    continue;
                }
                _ = failed.changed() => {
                    if let Some(why) = sess.failed.borrow().clone() {
                        return Err(ChainError::refused(ErrorCode::NoSuchChunk, format!("cannot forward: {why}")));
                    }
                    continue;
                }
                () = sleep_until(deadline) => {
                    match window.handle_timeout(now()) {
                        Some(SendOutcome::Failed(f)) => return Err(f.into()),
                        _ => continue,
                    }
                }
            };
            match window.handle_answer(now(), answer) {
                None => {}
                Some(SendOutcome::Complete) => {
                    info!(peer = %hop.host, "downstream complete");
                    return Ok(());
                }
                Some(SendOutcome::Failed(f)) => return Err(f.into()),
            }
        }
    }

    /// Asks the repairer for a chunk of the session's copy that failed re-verification;
    /// the session fails if the downstream still needs it and it cannot be repaired.
    fn request_repair(&self, sess: &Arc<ShardSession>, repair: Repair) {
        self.repairs.request(RepairRequest {
            source: Some(sess.origin.clone()),
            session: repair.for_peer.then(|| sess.clone()),
            ..RepairRequest::new(sess.shard.clone(), vec![repair.index])
        });
    }

    /// Watches a hop session: when no upstream is feeding it and it is incomplete, waits
    /// `upstream_grace` for a replacement, then fetches what is missing from the fallback.
    fn spawn_recovery(self: &Arc<Self>, sess: &Arc<ShardSession>) {
        let node = self.clone();
        let sess = sess.clone();
        tokio::spawn(async move {
            let mut feeders = sess.feeders.subscribe();
            let mut monitor = RecoveryMonitor::new(
                node.cfg.upstream_grace,
                RECOVERY_ATTEMPTS,
                !sess.origin.is_empty(),
            );
            while !node.cancel.is_cancelled() {
                let seen = Watched {
                    feeders: *feeders.borrow_and_update(),
                    complete: sess.complete(),
                    failed: sess.failed.borrow().is_some(),
                };
                match monitor.poll(now(), seen) {
                    RecoveryAction::Stop => return,
                    RecoveryAction::Fail(why) => return sess.fail(why),
                    RecoveryAction::Wait(until) => tokio::select! {
                        r = feeders.changed() => if r.is_err() { return },
                        () = sleep_until(until) => {}
                        _ = node.cancel.cancelled() => return,
                    },
                    RecoveryAction::Fetch { attempt } => {
                        node.stats
                            .upstream_recoveries
                            .fetch_add(1, Ordering::Relaxed);
                        let missing: Vec<u32> = sess
                            .shard
                            .verified_set(sess.start, sess.end)
                            .missing()
                            .collect();
                        info!(session = %sess.id, shard = sess.shard_index(), attempt, missing = missing.len(), source = %sess.origin, "no upstream; fetching missing chunks from fallback");
                        let guard = FeederGuard::new(&sess.feeders);
                        let _ = feeders.borrow_and_update();
                        let result = node.fill(&sess, &sess.origin, missing).await;
                        drop(guard);
                        match monitor.fill_finished(result, sess.complete()) {
                            AfterFill::Stop => return,
                            AfterFill::Fail(why) => return sess.fail(why),
                            AfterFill::Retry(Some(e)) => {
                                warn!(session = %sess.id, "recovery attempt failed: {e}");
                            }
                            AfterFill::Retry(None) => {}
                        }
                    }
                }
            }
        });
    }

    /// Fetches `missing` chunks of the session's shard from `source` into the store:
    /// `shardcast://host:port` pulls from another holder, anything else is an origin URI.
    async fn fill(
        &self,
        sess: &ShardSession,
        source: &str,
        missing: Vec<u32>,
    ) -> Result<(), String> {
        if missing.is_empty() {
            return Ok(());
        }
        if let Some(addr) = source.strip_prefix("shardcast://") {
            // Ask only for the span that holds the missing chunks (`missing` is ascending),
            // not the whole range again.
            let span = match (missing.first(), missing.last()) {
                (Some(&first), Some(&last)) => first..last.saturating_add(1),
                _ => return Ok(()),
            };
            return self
                .pull_from_holder(sess, addr, span)
                .await
                .map_err(|e| format!("holder {addr}: {e}"));
        }
        let origin = Origin::parse(source, &self.cfg.origins).map_err(|e| e.to_string())?;
        let (tx, mut rx) = mpsc::channel::<VerifiedChunk>(self.cfg.origin_parallel.max(1) * 2);
        let fetch = {
            let origin = origin.clone();
            let manifest = sess.manifest.clone();
            let shard = sess.shard_index();
            let parallel = self.cfg.origin_parallel;
            tokio::spawn(async move {
                origin::fetch_chunks(&origin, manifest, shard, missing, parallel, tx).await
            })
        };
        while let Some(chunk) = rx.recv().await {
            let index = chunk.index();
            self.store_chunk(sess, index, Incoming::Verified(chunk), ChunkFrom::Origin)
                .await
                .map_err(|e| e.to_string())?;
        }
        match fetch.await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(e) => Err(format!("origin fetch task: {e}")),
        }
    }

    /// Pulls every chunk of `span` (within the session's range) that `addr` holds.
    async fn pull_from_holder(
        &self,
        sess: &ShardSession,
        addr: &str,
        span: std::ops::Range<u32>,
    ) -> Result<(), ChainError> {
        let (mut conn, peer) = self.connect(addr, None).await?;
        self.handshake(&mut conn, &peer).await?;
        let shard = sess.shard_index();
        let fetch = Frame::Fetch {
            model: sess.model,
            shard,
            start: span.start,
            end: span.end,
        };
        conn.writer.send_now(&fetch).await?;
        loop {
            match read_timeout(&mut conn, self.cfg.idle_timeout).await? {
                Frame::Chunk {
                    shard: s,
                    index,
                    data,
                } if s == shard && (sess.start..sess.end).contains(&index) => {
                    // A corrupt one is counted and dropped; what is missing is fetched by
                    // the next recovery attempt.
                    self.store_chunk(sess, index, Incoming::Unverified(data), ChunkFrom::Holder)
                        .await?;
                }
                Frame::Done => return Ok(()),
                Frame::Error { code, message } => return Err(ChainError::Remote { code, message }),
                other => {
                    return Err(ChainError::protocol(format!(
                        "unexpected {:?} answering Fetch",
                        other.ty()
                    )));
                }
            }
        }
    }

    /// Starts a chain session headed by this host (the agent API's `StartChain`).
    pub fn start_chain(
        self: &Arc<Self>,
        id: SessionId,
        manifest: Arc<Manifest>,
        origin: String,
        tier: Tier,
        chains: Vec<ChainSpec>,
        token: Bytes,
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
        if self
            .heads
            .lock()
            .map(|h| h.contains_key(&id))
            .unwrap_or(false)
        {
            return Err(ChainError::refused(
                ErrorCode::Refused,
                format!("session {id} already exists"),
            ));
        }
        self.repairs.note_source(model, &origin);
        let mut parts = Vec::new();
        for (s, held, hops) in plan {
            let shard = match held {
                Some(h) => h,
                None => self.store.shard(&model, s, tier)?,
            };
            let end = shard.total_chunks();
            let sess = self.new_session(
                id,
                model,
                manifest.clone(),
                shard,
                0,
                end,
                origin.clone(),
                token.clone(),
            );
            if !sess.complete() {
                self.spawn_head_fill(&sess);
            }
            self.spawn_forwarder(&sess, hops);
            let node = self.clone();
            let watched = sess.clone();
            tokio::spawn(async move {
                let _ = watched.finished().await;
                node.stats.sessions_active.fetch_sub(1, Ordering::Relaxed);
            });
            parts.push(sess);
        }
        let head = Arc::new(HeadSession {
            id,
            model,
            started: Instant::now(),
            parts,
        });
        if let Ok(mut h) = self.heads.lock() {
            h.insert(id, head.clone());
        }
        // Keep a finished head session queryable (GetSession) for a while, then drop it so
        // a long-running daemon does not accumulate them.
        let node = self.clone();
        let finished = head.clone();
        tokio::spawn(async move {
            for part in &finished.parts {
                let _ = part.finished().await;
            }
            tokio::select! {
                _ = tokio::time::sleep(HEAD_RETENTION) => {}
                _ = node.cancel.cancelled() => {}
            }
            if let Ok(mut h) = node.heads.lock() {
                h.remove(&finished.id);
            }
        });
        info!(session = %id, model = %model, chains = chains.len(), "chain session started");
        Ok(head)
    }

    /// The head does not hold the shard: fetch it from the origin; the forwarder sends each
    /// chunk on as it lands.
    fn spawn_head_fill(self: &Arc<Self>, sess: &Arc<ShardSession>) {
        let node = self.clone();
        let sess = sess.clone();
        tokio::spawn(async move {
            let _guard = FeederGuard::new(&sess.feeders);
            let missing: Vec<u32> = sess
                .shard
                .verified_set(sess.start, sess.end)
                .missing()
                .collect();
            let origin = sess.origin.clone();
            if let Err(e) = node.fill(&sess, &origin, missing).await {
                sess.fail(format!("origin fetch failed: {e}"));
            } else if !sess.complete() {
                sess.fail("origin did not provide every chunk".into());
            }
        });
    }

    /// Downloads a whole model from an origin into `tier` (the agent's `ImportModel` with
    /// `fetch`).
    pub async fn fetch_model(
        &self,
        manifest: &Arc<Manifest>,
        origin: &str,
        tier: Tier,
    ) -> Result<(), String> {
        let spans = (0..manifest.shards.len() as u32)
            .map(|s| (s, 0..u32::MAX))
            .collect();
        self.fetch_spans(manifest, origin, tier, spans).await?;
        let model = manifest.digest();
        for s in 0..manifest.shards.len() as u32 {
            let complete = self
                .store
                .existing_shard(&model, s)
                .is_some_and(|sh| sh.is_complete());
            if !complete {
                return Err(format!("origin did not provide every chunk of shard {s}"));
            }
        }
        Ok(())
    }

    /// Downloads the chunks of `spans` (shard, chunk range; clipped to the shard) that this
    /// host does not hold yet, in the order given, into `tier`. `source` is an origin URL or
    /// `shardcast://host:port`, a peer's data listener. Used for whole-model imports and for
    /// partitioned loads (the partition's chunks first, then the rest).
    pub async fn fetch_spans(
        &self,
        manifest: &Arc<Manifest>,
        source: &str,
        tier: Tier,
        spans: Vec<(u32, std::ops::Range<u32>)>,
    ) -> Result<(), String> {
        let model = manifest.digest();
        self.repairs.note_source(model, source);
        for (s, range) in spans {
            if s as usize >= manifest.shards.len() {
                return Err(format!(
                    "shard {s} does not exist (the model has {})",
                    manifest.shards.len()
                ));
            }
            let shard = self
                .store
                .shard(&model, s, tier)
                .map_err(|e| e.to_string())?;
            let total = shard.total_chunks();
            let (start, end) = (range.start.min(total), range.end.min(total));
            if start >= end {
                continue;
            }
            let missing: Vec<u32> = shard.verified_set(start, end).missing().collect();
            if missing.is_empty() {
                continue;
            }
            let sess = self.new_session(
                SessionId([0; 16]),
                model,
                manifest.clone(),
                shard,
                start,
                end,
                source.to_string(),
                Bytes::new(),
            );
            let r = self.fill(&sess, source, missing).await;
            self.stats.sessions_active.fetch_sub(1, Ordering::Relaxed);
            r?;
            debug!(model = %model, shard = s, start, end, "chunks fetched");
        }
        Ok(())
    }
}

/// The sender's own copy, as its send window sees it.
impl LocalCopy for Shard {
    fn is_verified(&self, index: u32) -> bool {
        Self::is_verified(self, index)
    }
    fn is_dropped(&self, index: u32) -> bool {
        Self::is_dropped(self, index)
    }
    fn dropped(&self, range: std::ops::Range<u32>) -> Vec<u32> {
        self.dropped_chunks(range.start, range.end)
    }
}

/// The time the state machines are given: tokio's clock, so paused-time tests drive them.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Sleeps until `deadline`; forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
        None => std::future::pending().await,
    }
}

async fn read_timeout(conn: &mut Conn, timeout: Duration) -> Result<Frame, ChainError> {
    match tokio::time::timeout(timeout, conn.reader.read()).await {
        Err(_) => Err(ChainError::Timeout(timeout)),
        Ok(r) => r?.ok_or(ChainError::Closed),
    }
}

/// Parses the chunk list of `SHARDCAST_FAULT_CORRUPT` (`shard:chunk,shard:chunk`).
pub fn parse_fault_list(s: &str) -> Result<Vec<(u32, u32)>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (a, b) = p
                .trim()
                .split_once(':')
                .ok_or_else(|| format!("{p:?}: expected shard:chunk"))?;
            Ok((
                a.parse().map_err(|_| format!("{p:?}: bad shard"))?,
                b.parse().map_err(|_| format!("{p:?}: bad chunk"))?,
            ))
        })
        .collect()
}

/// A fresh random session id.
pub fn new_session_id() -> SessionId {
    SessionId(rand::random())
}
