//! [`ShardSession`]: one shard of a chain session on this host, its RAII gauges, and
//! [`Intake`]: the one path by which a chunk is verified, written and counted
//! (`Intake::store_chunk`), and by which sessions are made (`Intake::new_session`).
//!
//! [`Intake`] holds the counters and the store-failure records and nothing else: every role
//! that stores chunks (an upstream connection, a fetch, a head fill) is given one.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use shardcast_protocol::{
    Frame, Hashed, Hop, HopTransport, HostId, Manifest, ModelDigest, SessionId, VerifiedChunk,
    VerifiedPieces, frame::MAX_UPSTREAM_HOPS,
};
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::outcome::{ForwardError, SessionError};
use super::pieces::PieceRelay;
use super::proto::Verdict;
use super::table::StoreFailures;
use super::{ChainError, MAX_PROGRESS_HOSTS, NodeStats};
use crate::store::{Shard, Written};

/// A chunk on its way into a session's store.
pub(super) enum Incoming {
    /// Bytes from a peer, to verify against the manifest; with their hash when the frame
    /// reader worked it out as they arrived (`FrameReader::take_chunk_hash`).
    Unverified(Bytes, Option<Hashed>),
    /// Verified already (an origin fetch verifies as it reads).
    Verified(VerifiedChunk),
    /// Verified piece by piece as it arrived (`super::pieces`).
    Pieces(VerifiedPieces),
}

/// Where a stored chunk came from (for counters and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ChunkFrom {
    /// An upstream hop of the session.
    Upstream,
    /// A holder answering `Fetch`.
    Holder,
    /// An origin.
    Origin,
    /// The copy this host kept while it read the origin to build the manifest.
    Kept,
}

/// Where a forwarder stands.
#[derive(Debug, Clone)]
pub(super) enum ForwardState {
    Running,
    Finished(Result<(), ForwardError>),
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
    /// How this hop dials the hops below it and the holders it pulls from (the plan's
    /// choice, passed on in every `Open` this hop sends).
    pub transport: HopTransport,
    /// When this host joined the session.
    pub started: Instant,
    pub(super) feeders: watch::Sender<usize>,
    pub(super) progress: broadcast::Sender<Frame>,
    pub(super) hop_progress: Mutex<BTreeMap<String, (u32, u32)>>,
    pub(super) forward: watch::Sender<ForwardState>,
    pub(super) failed: watch::Sender<Option<SessionError>>,
    /// The holders above this hop, nearest first, from the latest `Open` (a failover's
    /// `Open` comes from a hop above a stalled one, so it lists only live hops).
    pub(super) upstream: Mutex<Vec<Hop>>,
    /// Upstream hosts this session found stalled: never asked again by this session.
    pub(super) stalled: Mutex<HashSet<HostId>>,
    /// What last fed the session — an upstream host (`Some`) or a fetch from a holder or
    /// the origin (`None`) — and when.
    pub(super) heard: Mutex<Option<(Option<HostId>, Instant)>>,
    /// Set when the hop below answered `AlreadyFed`: the chain went on without this host
    /// (it was stopped or cut off), and that hop holds or receives what it lacks.
    pub(super) bypassed: watch::Sender<Option<Hop>>,
    /// Downstream hops this session's forwarder gave up on (silent, unreachable, failed),
    /// counted as they go: a head reading the origin takes the first for its own link
    /// (or its hop below) gone, since that hop goes on from the origin after as long (see
    /// `head::fill_watching`).
    pub(super) downstream_lost: watch::Sender<u32>,
    /// Set while this session's recovery reads the origin: a holder above that rejoins
    /// (its link back, or resumed) cancels it and feeds the rest (see
    /// [`ShardSession::yield_origin_read`]).
    pub(super) origin_read: Mutex<Option<CancellationToken>>,
    /// Chunks arriving here in pieces, for the forwarder to send on piece by piece.
    pub(super) pieces: Arc<PieceRelay>,
}

impl ShardSession {
    pub(super) fn shard_index(&self) -> u32 {
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
    pub fn outcome(&self) -> Option<Result<(), SessionError>> {
        if let Some(e) = self.failed.borrow().clone() {
            return Some(Err(e));
        }
        match &*self.forward.borrow() {
            ForwardState::Finished(r) if self.complete() => {
                Some(r.clone().map_err(SessionError::Forward))
            }
            _ => None,
        }
    }

    /// Marks the session failed (it cannot complete here).
    pub(crate) fn fail(&self, why: SessionError) {
        warn!(session = %self.id, shard = self.shard_index(), "session failed: {why}");
        self.failed.send_replace(Some(why));
    }

    /// Bytes in the range `start..end` (0 for a range the manifest does not hold).
    pub fn range_bytes(&self) -> u64 {
        let (m, shard) = (&self.manifest, self.shard_index());
        if self.end <= self.start {
            return 0;
        }
        match (
            m.chunk_span(shard, self.start),
            m.chunk_span(shard, self.end - 1),
        ) {
            (Ok((first, _)), Ok((last, len))) => (last + len as u64).saturating_sub(first),
            _ => 0,
        }
    }

    /// Waits until the range is verified here (`Ok`), or the session failed (`Err`); the
    /// forwarder may still be sending below.
    pub async fn ready(&self) -> Result<(), SessionError> {
        let mut verified = self.shard.subscribe();
        let mut failed = self.failed.subscribe();
        loop {
            if let Some(e) = self.failed.borrow().clone() {
                return Err(e);
            }
            if self.complete() {
                return Ok(());
            }
            tokio::select! {
                r = verified.changed() => if r.is_err() { return Err(SessionError::StoreClosed) },
                r = failed.changed() => if r.is_err() { return Err(SessionError::SessionGone) },
            }
        }
    }

    /// Waits until [`ShardSession::outcome`] is `Some`.
    pub async fn finished(&self) -> Result<(), SessionError> {
        let mut verified = self.shard.subscribe();
        let mut forward = self.forward.subscribe();
        let mut failed = self.failed.subscribe();
        loop {
            if let Some(r) = self.outcome() {
                return r;
            }
            tokio::select! {
                r = verified.changed() => if r.is_err() { return Err(SessionError::StoreClosed) },
                r = forward.changed() => if r.is_err() { return Err(SessionError::ForwarderGone) },
                r = failed.changed() => if r.is_err() { return Err(SessionError::SessionGone) },
            }
        }
    }

    /// The holders above this hop, nearest first, as the latest `Open` listed them.
    pub(super) fn set_upstream(&self, hops: &[Hop]) {
        if let Ok(mut u) = self.upstream.lock() {
            *u = hops.to_vec();
        }
    }

    /// Notes a frame from upstream host `host` (`None`: a chunk fetched from a holder or
    /// the origin).
    pub(super) fn heard_from(&self, host: Option<&HostId>) {
        if let Ok(mut h) = self.heard.lock() {
            match h.as_mut() {
                Some((who, at)) if who.as_ref() == host => *at = Instant::now(),
                _ => *h = Some((host.cloned(), Instant::now())),
            }
        }
    }

    /// What fed the session within `within`, if that was not `host`: a live upstream
    /// (`Some(Some(host))`) or a running fetch (`Some(None)`: from a holder or the origin),
    /// which a second upstream would only duplicate.
    pub(super) fn live_feed_besides(
        &self,
        host: &HostId,
        within: std::time::Duration,
    ) -> Option<Option<HostId>> {
        if *self.feeders.borrow() == 0 {
            return None;
        }
        let h = self.heard.lock().ok()?;
        match h.as_ref() {
            Some((who, at)) if at.elapsed() < within && who.as_ref() != Some(host) => {
                Some(who.clone())
            }
            _ => None,
        }
    }

    /// Marks the start of a recovery's origin read: the returned guard holds the token a
    /// rejoining upstream cancels ([`Self::yield_origin_read`]) until it is dropped.
    pub(super) fn origin_read(&self) -> OriginRead<'_> {
        let token = CancellationToken::new();
        if let Ok(mut r) = self.origin_read.lock() {
            *r = Some(token.clone());
        }
        OriginRead { sess: self, token }
    }

    /// Stops the recovery's origin read, if one runs, so that an upstream holder can feed
    /// the rest: the origin is the chain's one shared source, and a peer that holds the
    /// shard (or receives it) does not take from it. True if a read was stopped.
    pub(super) fn yield_origin_read(&self) -> bool {
        let Ok(mut r) = self.origin_read.lock() else {
            return false;
        };
        r.take().inspect(CancellationToken::cancel).is_some()
    }

    /// Notes an upstream host as stalled.
    pub(super) fn note_stalled(&self, host: &HostId) {
        if let Ok(mut s) = self.stalled.lock() {
            s.insert(host.clone());
        }
    }

    /// The upstream holders (nearest first) and the hosts found stalled.
    pub(super) fn upstream_view(&self) -> (Vec<Hop>, HashSet<HostId>) {
        let up = self.upstream.lock().map(|u| u.clone()).unwrap_or_default();
        let stalled = self.stalled.lock().map(|s| s.clone()).unwrap_or_default();
        (up, stalled)
    }

    /// The upstream list to send in an `Open` from this host (`me`: this host's hop, when
    /// its data address is known) to `to`: this host, then the live holders above it.
    pub(super) fn upstream_for(&self, me: Option<Hop>, to: &HostId) -> Vec<Hop> {
        let (up, stalled) = self.upstream_view();
        me.into_iter()
            .chain(up)
            .filter(|h| h.host != *to && !stalled.contains(&h.host))
            .take(MAX_UPSTREAM_HOPS)
            .collect()
    }

    /// Records a host's relayed progress; false (not recorded) when the table is full.
    pub(super) fn record_progress(&self, host: &HostId, verified: u32, total: u32) -> bool {
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

/// A recovery's origin read in progress (see [`ShardSession::origin_read`]).
pub(super) struct OriginRead<'a> {
    sess: &'a ShardSession,
    /// Cancelled when an upstream holder rejoins: the read stops between two chunks.
    pub(super) token: CancellationToken,
}

impl Drop for OriginRead<'_> {
    fn drop(&mut self) {
        // One recovery task per session reads the origin at a time: what is set is ours.
        if let Ok(mut r) = self.sess.origin_read.lock() {
            *r = None;
        }
    }
}

/// Counts a live feeder (an upstream connection or a fill task) for as long as it lives.
pub(super) struct FeederGuard(watch::Sender<usize>);

impl FeederGuard {
    pub(super) fn new(tx: &watch::Sender<usize>) -> Self {
        tx.send_modify(|n| *n += 1);
        Self(tx.clone())
    }
}

impl Drop for FeederGuard {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Holds one unit of [`NodeStats::sessions_active`] for as long as it lives, so the gauge
/// follows whichever task outlives the session's work, however it ends.
pub(super) struct ActiveSession(Arc<NodeStats>);

impl ActiveSession {
    fn new(stats: &Arc<NodeStats>) -> Self {
        stats.sessions_total.fetch_add(1, Ordering::Relaxed);
        stats.sessions_active.fetch_add(1, Ordering::Relaxed);
        Self(stats.clone())
    }
}

impl Drop for ActiveSession {
    fn drop(&mut self) {
        self.0.sessions_active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Makes sessions and stores their chunks: the counters and the store-failure records.
/// Cheap to clone.
#[derive(Clone)]
pub(super) struct Intake {
    stats: Arc<NodeStats>,
    failures: StoreFailures,
}

impl Intake {
    pub(super) fn new(stats: Arc<NodeStats>, failures: StoreFailures) -> Self {
        Self { stats, failures }
    }

    /// Records why the store refused `model`'s data in `tier` for `session`.
    pub(super) fn note_store_failure(
        &self,
        model: ModelDigest,
        tier: shardcast_protocol::DataTier,
        session: SessionId,
        why: String,
    ) {
        self.failures.note(model, tier, session, why);
    }

    /// Counts an origin read that yielded to a peer ([`ShardSession::yield_origin_read`]).
    pub(super) fn count_origin_yield(&self) {
        self.stats
            .origin_reads_yielded
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts bytes stored from a kept copy moved into place whole (not read twice).
    pub(super) fn count_kept(&self, bytes: u64) {
        self.stats.kept_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A new session, and its unit of the active-session gauge: the caller keeps the guard
    /// for as long as the session counts as active.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new_session(
        &self,
        id: SessionId,
        model: ModelDigest,
        manifest: Arc<Manifest>,
        shard: Arc<Shard>,
        start: u32,
        end: u32,
        origin: String,
        (token, transport): (Bytes, HopTransport),
    ) -> (Arc<ShardSession>, ActiveSession) {
        let active = ActiveSession::new(&self.stats);
        self.failures.clear(model, shard.tier());
        let sess = Arc::new(ShardSession {
            id,
            model,
            manifest,
            shard,
            start,
            end,
            origin,
            token,
            transport,
            started: Instant::now(),
            feeders: watch::Sender::new(0),
            progress: broadcast::Sender::new(256),
            hop_progress: Mutex::default(),
            forward: watch::Sender::new(ForwardState::Running),
            failed: watch::Sender::new(None),
            upstream: Mutex::default(),
            stalled: Mutex::default(),
            heard: Mutex::default(),
            bypassed: watch::Sender::new(None),
            downstream_lost: watch::Sender::new(0),
            origin_read: Mutex::default(),
            pieces: Arc::default(),
        });
        (sess, active)
    }

    /// Verifies, stores and counts one chunk of `sess`'s shard: the one path by which
    /// chunks from an upstream, a holder (`Fetch`) and an origin enter the store. Hashing
    /// runs off the I/O threads. `Ok(Verdict::Corrupt)`: it failed verification and was
    /// dropped (a session's sender sends it again).
    pub(super) async fn store_chunk(
        &self,
        sess: &ShardSession,
        index: u32,
        chunk: Incoming,
        from: ChunkFrom,
    ) -> Result<Verdict, ChainError> {
        let len = match &chunk {
            Incoming::Verified(c) => c.data().len(),
            Incoming::Unverified(data, _) => data.len(),
            Incoming::Pieces(c) => c.len(),
        } as u64;
        let written = match chunk {
            // The shard queues writes to its file (`Shard::write`).
            Incoming::Verified(chunk) => sess.shard.write(chunk).await.map(|_| None),
            Incoming::Pieces(chunk) => sess.shard.write_pieces(chunk).await.map(|_| None),
            // BLAKE3 takes ~0.3 ms per MiB: unless the frame reader hashed the bytes as
            // they arrived, hashed off the I/O threads, by the same blocking-pool task
            // that then writes it (the shard serialises the writes).
            Incoming::Unverified(data, hashed) => sess
                .shard
                .verify_and_write_hashed(index, data, hashed)
                .await
                .map(Some),
        };
        match written {
            Ok(None) => {}
            // The file system refused the bytes (ENOSPC on a tmpfs another process filled,
            // EIO): this copy cannot complete here. Said once, with the model's status, and
            // the session ends instead of fetching the same chunks again and again.
            Err(e) => {
                let e = Arc::new(e);
                let why = SessionError::StoreRefused {
                    index,
                    shard: sess.shard_index(),
                    tier: sess.shard.tier(),
                    error: e.clone(),
                };
                self.failures
                    .note(sess.model, sess.shard.tier(), sess.id, why.to_string());
                sess.fail(why);
                return Err(ChainError::Store(e));
            }
            Ok(Some(written)) => {
                if let Written::Corrupt(e) = written {
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
        self.stats.chunks_verified.fetch_add(1, Ordering::Relaxed);
        if from != ChunkFrom::Upstream {
            sess.heard_from(None);
        }
        match from {
            ChunkFrom::Origin => {
                self.stats.origin_bytes.fetch_add(len, Ordering::Relaxed);
            }
            ChunkFrom::Holder => {
                self.stats
                    .chunks_from_holders
                    .fetch_add(1, Ordering::Relaxed);
            }
            ChunkFrom::Kept => {
                self.stats.kept_bytes.fetch_add(len, Ordering::Relaxed);
            }
            ChunkFrom::Upstream => {}
        }
        Ok(Verdict::Stored)
    }
}
