//! Corruption at rest: repairs of dropped chunks, and the background scrub.
//!
//! ```text
//!  forwarder, Fetch server, GPU source, hand-off, scrub
//!        │ Shard::check fails: the store drops the chunk (bitmap persisted, counted, logged)
//!        └──RepairRequest──▶ [repairer] ─▶ 1. the same chunk in the other tier of this host
//!                                          2. the session's source (origin or shardcast://holder)
//!                                          3. sources this host recently used for the model
//!                               │ written back through Shard::write: counted as repaired
//!                               └─▶ outcome to the requester; every session that needs a chunk
//!                                   that cannot be repaired fails (its forwarder stops, nothing
//!                                   bad is sent, and no healthy next hop is skipped)
//!  [scrub] every chunk not verified within `reverify_after`, at `scrub_rate` bytes/s,
//!          while no chunks move through the host (it yields to transfers: `DataPath`)
//! ```
//!
//! Both tasks are spawned by [`Node::new`](crate::chain::Node::new) when it runs inside a
//! tokio runtime. They run a `Repairer`: the store, the repair queue and sources, the
//! chain's `Fetcher` (to fetch chunk spans from a source), the session table (to fail
//! the sessions that need a chunk that cannot be repaired) and the wire's byte counters
//! (the scrub waits while chunks move) — nothing else of the node.
//! They hold only a weak reference to it (the node holds the strong one), and stop on
//! cancellation.
//! Bounds: at most [`QUEUE`] requests wait (more are answered "queue full" at once),
//! [`PARALLEL`] repairs run at a time, and at most [`SOURCES_PER_MODEL`] sources are
//! remembered for each of at most [`MODELS`] models.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use shardcast_protocol::{DataTier, ModelDigest};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::chain::{Fetcher, SessionError, Sessions, ShardSession};
use crate::store::{Check, Quiet, Shard, ShardStore, StoreError};
use crate::wire::ByteCounters;

/// Repair requests that may wait. Rationale: corruption is rare; a burst beyond this (a
/// whole file overwritten) is answered at once and found again by the next read or scrub.
pub const QUEUE: usize = 1024;
/// Repairs running at once: each may read from an origin or a peer.
pub const PARALLEL: usize = 2;
/// Sources remembered per model (most recent first).
pub const SOURCES_PER_MODEL: usize = 4;
/// Models whose sources are remembered (oldest forgotten first).
pub const MODELS: usize = 1024;
/// Pause of the scrub after a pass that found nothing idle to re-hash.
const SCRUB_IDLE: Duration = Duration::from_secs(1);
/// How long no chunk may have moved through this host before the scrub hashes again.
/// Rationale: the scrub is background work; while a transfer runs, the chunks arriving are
/// hashed on arrival and those leaving are checked by the next hop or before they are
/// served, so the scrub would only take cores from the transfer (on the 2-vCPU host it
/// hashed 64 MB/s beside every receiver of an emulated chain, a third of each one's
/// BLAKE3 work).
const SCRUB_QUIET: Duration = Duration::from_secs(1);
/// Bytes on the data connections below which they count as quiet: keepalives and
/// acknowledgements, not chunks.
const SCRUB_QUIET_BYTES: u64 = 256 << 10;
/// How often a yielding scrub looks at the data path again.
const SCRUB_YIELD_TICK: Duration = Duration::from_millis(250);

/// The result of a repair: `Err` names what could not be repaired and why.
pub type RepairOutcome = Result<(), RepairError>;

/// Why a repair did not happen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RepairError {
    /// The request was not queued: [`QUEUE`] requests wait already (or the repairer is gone).
    #[error("the repair queue is full")]
    QueueFull,
    /// The repairer stopped before it answered.
    #[error("the repairer stopped")]
    Stopped,
    /// The copy was removed from the store before the repair ran.
    #[error("the copy was removed from the store")]
    Removed,
    /// No copy in the other tier and no source had the chunks.
    #[error(
        "chunks {chunks:?} of shard {shard} are corrupt at rest here and could not be repaired ({})",
        not_repaired_from(.sources)
    )]
    Unrepairable {
        /// The chunks still missing.
        chunks: Vec<u32>,
        /// Their shard.
        shard: u32,
        /// The sources tried (none: nothing to repair from).
        sources: Vec<String>,
    },
}

/// Why no source repaired the chunks.
fn not_repaired_from(sources: &[String]) -> String {
    if sources.is_empty() {
        "no source to repair from".to_string()
    } else {
        format!("not repaired from {}", sources.join(", "))
    }
}

/// Chunks of one shard copy to repair.
pub struct RepairRequest {
    /// The copy whose chunks were dropped.
    pub shard: Arc<Shard>,
    /// The dropped chunks (those verified again by the time the repair runs are skipped).
    pub chunks: Vec<u32>,
    /// A source to try before the remembered ones (the session's fallback).
    pub source: Option<String>,
    /// A session to fail when the chunks cannot be repaired.
    pub session: Option<Arc<ShardSession>>,
    /// Told the outcome.
    pub done: Option<oneshot::Sender<RepairOutcome>>,
}

impl std::fmt::Debug for RepairRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RepairRequest")
            .field("shard", &self.shard)
            .field("chunks", &self.chunks)
            .field("source", &self.source)
            .field("session", &self.session.as_ref().map(|s| s.id))
            .finish()
    }
}

impl RepairRequest {
    /// A request for `chunks` of `shard` with no source, session or answer.
    pub fn new(shard: Arc<Shard>, chunks: Vec<u32>) -> Self {
        Self {
            shard,
            chunks,
            source: None,
            session: None,
            done: None,
        }
    }
}

/// Sends repair requests to the node's repairer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RepairHandle {
    tx: mpsc::Sender<RepairRequest>,
    refused: Arc<AtomicU64>,
}

impl RepairHandle {
    /// Queues `req`; when the queue is full (or the repairer gone) the request's `done` is
    /// answered with an error at once.
    pub fn request(&self, req: RepairRequest) {
        if let Err(e) = self.tx.try_send(req) {
            let req = match e {
                mpsc::error::TrySendError::Full(r) | mpsc::error::TrySendError::Closed(r) => r,
            };
            self.refused.fetch_add(1, Ordering::Relaxed);
            warn!(model = %req.shard.digest(), shard = req.shard.index(), "repair queue full; not repairing now");
            if let Some(done) = req.done {
                let _ = done.send(Err(RepairError::QueueFull));
            }
        }
    }

    /// Queues a repair of `chunks` and waits for its outcome.
    pub async fn repair(&self, shard: Arc<Shard>, chunks: Vec<u32>) -> RepairOutcome {
        let (tx, rx) = oneshot::channel();
        self.request(RepairRequest {
            done: Some(tx),
            ..RepairRequest::new(shard, chunks)
        });
        rx.await.unwrap_or(Err(RepairError::Stopped))
    }
}

/// The node's repair state: the request queue and the sources remembered per model.
#[derive(Debug)]
pub struct Repairs {
    handle: RepairHandle,
    rx: Mutex<Option<mpsc::Receiver<RepairRequest>>>,
    sources: Mutex<KnownSources>,
}

#[derive(Debug, Default)]
struct KnownSources {
    by_model: HashMap<ModelDigest, VecDeque<String>>,
    order: VecDeque<ModelDigest>,
}

impl Default for Repairs {
    fn default() -> Self {
        Self::new()
    }
}

impl Repairs {
    /// An empty queue; the repairer takes its receiving end when spawned.
    pub fn new() -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        Self {
            handle: RepairHandle {
                tx,
                refused: Arc::default(),
            },
            rx: Mutex::new(Some(rx)),
            sources: Mutex::default(),
        }
    }

    /// A handle to queue repairs with.
    pub fn handle(&self) -> RepairHandle {
        self.handle.clone()
    }

    /// Repair requests refused because the queue was full (the limit's metric).
    pub fn refused(&self) -> u64 {
        self.handle.refused.load(Ordering::Relaxed)
    }

    /// Queues `req` (see [`RepairHandle::request`]).
    pub fn request(&self, req: RepairRequest) {
        self.handle.request(req);
    }

    /// Remembers `source` (an origin URI or `shardcast://host:port`) as a place to repair
    /// `model` from. Empty sources are ignored.
    pub fn note_source(&self, model: ModelDigest, source: &str) {
        if source.is_empty() {
            return;
        }
        let Ok(mut k) = self.sources.lock() else {
            return;
        };
        if !k.by_model.contains_key(&model) {
            if k.order.len() >= MODELS {
                if let Some(old) = k.order.pop_front() {
                    k.by_model.remove(&old);
                }
            }
            k.order.push_back(model);
        }
        let list = k.by_model.entry(model).or_default();
        list.retain(|s| s != source);
        list.push_front(source.to_string());
        list.truncate(SOURCES_PER_MODEL);
    }

    /// The sources remembered for `model`, most recent first.
    pub fn sources(&self, model: &ModelDigest) -> Vec<String> {
        self.sources
            .lock()
            .ok()
            .and_then(|k| k.by_model.get(model).map(|l| l.iter().cloned().collect()))
            .unwrap_or_default()
    }
}

/// What the repairer and the scrub are given (see the module docs).
pub(crate) struct Repairer {
    store: ShardStore,
    repairs: Arc<Repairs>,
    fetcher: Arc<Fetcher>,
    sessions: Sessions,
    /// The node's data connections' byte counts: the scrub yields while chunks move.
    wire: Arc<ByteCounters>,
}

impl Repairer {
    pub(crate) fn new(
        store: ShardStore,
        repairs: Arc<Repairs>,
        fetcher: Arc<Fetcher>,
        sessions: Sessions,
        wire: Arc<ByteCounters>,
    ) -> Self {
        Self {
            store,
            repairs,
            fetcher,
            sessions,
            wire,
        }
    }
}

/// Whether chunks have moved through this host lately: chunks written into the store (a
/// session, a fetch, an origin read) or more than [`SCRUB_QUIET_BYTES`] on the data
/// connections (sends included), within the last [`SCRUB_QUIET`].
struct DataPath {
    wire: Arc<ByteCounters>,
    store: ShardStore,
    quiet: Quiet,
}

impl DataPath {
    fn new(wire: Arc<ByteCounters>, store: ShardStore) -> Self {
        let now = Self::counts(&wire, &store);
        // Quiet from the start: a restarted daemon scrubs at once.
        let quiet = Quiet::new(SCRUB_QUIET, SCRUB_QUIET_BYTES, now, true);
        Self { wire, store, quiet }
    }

    /// Chunks written, and bytes both ways on the data connections.
    fn counts(wire: &ByteCounters, store: &ShardStore) -> (u64, u64) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let bytes = load(&wire.received).wrapping_add(load(&wire.sent));
        (load(&store.stats().chunks_written), bytes)
    }

    fn quiet(&mut self) -> bool {
        let (chunks, bytes) = Self::counts(&self.wire, &self.store);
        self.quiet.observe(chunks, bytes)
    }
}

/// Spawns the repairer and the scrub for `repairer` (once; later calls do nothing).
pub(crate) fn spawn(repairer: &Arc<Repairer>, cancel: &CancellationToken) {
    let Some(rx) = repairer.repairs.rx.lock().ok().and_then(|mut r| r.take()) else {
        return;
    };
    let weak = Arc::downgrade(repairer);
    tokio::spawn(run_repairer(weak.clone(), rx, cancel.clone()));
    let rate = repairer.store.scrub_rate();
    if rate > 0 {
        info!(rate_bytes_per_s = rate, "scrub started");
        let path = DataPath::new(repairer.wire.clone(), repairer.store.clone());
        tokio::spawn(run_scrub(weak, rate, path, cancel.clone()));
    }
}

async fn run_repairer(
    node: Weak<Repairer>,
    mut rx: mpsc::Receiver<RepairRequest>,
    cancel: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(PARALLEL));
    loop {
        let mut req = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            r = rx.recv() => match r {
                Some(r) => r,
                None => return,
            },
        };
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let Some(node) = node.upgrade() else {
            return;
        };
        tokio::spawn(async move {
            let _permit = permit;
            let done = req.done.take();
            let outcome = repair(&node, req).await;
            if let Some(done) = done {
                let _ = done.send(outcome);
            }
        });
    }
}

/// Contiguous runs of ascending chunk indices, as ranges.
fn runs(chunks: &[u32]) -> Vec<std::ops::Range<u32>> {
    let mut out: Vec<std::ops::Range<u32>> = Vec::new();
    for &c in chunks {
        match out.last_mut() {
            Some(r) if r.end == c => r.end = c + 1,
            _ => out.push(c..c.saturating_add(1)),
        }
    }
    out
}

/// Repairs one request; see the module docs for the order of sources.
async fn repair(node: &Repairer, req: RepairRequest) -> RepairOutcome {
    let RepairRequest {
        shard,
        mut chunks,
        source,
        session,
        ..
    } = req;
    chunks.sort_unstable();
    chunks.dedup();
    let missing = |chunks: &mut Vec<u32>| {
        chunks.retain(|&i| i < shard.total_chunks() && !shard.is_verified(i));
    };
    missing(&mut chunks);
    if chunks.is_empty() {
        return Ok(());
    }
    if shard.is_removed() {
        return Err(RepairError::Removed);
    }
    let (digest, index, tier) = (shard.digest(), shard.index(), shard.tier());
    let manifest = shard.manifest().clone();
    info!(model = %digest, shard = index, ?tier, chunks = ?chunks, event = "repair-start", "repairing chunks corrupt at rest");

    // 1. The other tier of this host.
    let other_tier = match tier {
        DataTier::Memory => DataTier::Disk,
        DataTier::Disk => DataTier::Memory,
    };
    if let Some(other) = node.store.tier_shard(&digest, index, other_tier) {
        for &i in &chunks {
            if !other.is_verified(i) {
                continue;
            }
            let (m, o) = (manifest.clone(), other.clone());
            let verified = tokio::task::spawn_blocking(move || {
                let bytes = o.read_raw(i).ok()?;
                match m.verified(index, i, bytes) {
                    Ok(c) => Some(c),
                    Err(_) => {
                        // The other copy rotted too: drop it there as well.
                        let _ = o.check(i, true, Check::Repair);
                        None
                    }
                }
            })
            .await
            .ok()
            .flatten();
            if let Some(chunk) = verified {
                if let Err(e) = shard.write(chunk).await {
                    warn!(model = %digest, shard = index, chunk = i, "repair from the other tier: {e}");
                }
            }
        }
        missing(&mut chunks);
    }

    // 2. and 3. The session's source, then those remembered for the model.
    let mut sources: Vec<String> = source.into_iter().filter(|s| !s.is_empty()).collect();
    for s in node.repairs.sources(&digest) {
        if !sources.contains(&s) {
            sources.push(s);
        }
    }
    for src in &sources {
        if chunks.is_empty() || shard.is_removed() {
            break;
        }
        let spans = runs(&chunks).into_iter().map(|r| (index, r)).collect();
        if let Err(e) = node.fetcher.fetch_spans(&manifest, src, tier, spans).await {
            warn!(model = %digest, shard = index, source = %src, "repair fetch failed: {e}");
        }
        missing(&mut chunks);
    }
    if chunks.is_empty() {
        return Ok(());
    }
    node.store
        .stats()
        .chunks_unrepairable
        .fetch_add(chunks.len() as u64, Ordering::Relaxed);
    let why = not_repaired_from(&sources);
    error!(model = %digest, shard = index, ?tier, chunks = ?chunks, event = "unrepairable", "chunks corrupt at rest could not be repaired: {why}");
    let err = RepairError::Unrepairable {
        chunks: chunks.clone(),
        shard: index,
        sources,
    };
    let failed = SessionError::Unrepairable(err.clone());
    if let Some(sess) = session {
        sess.fail(failed.clone());
    }
    // Sessions that forward this copy would otherwise wait for the chunks forever.
    node.sessions.fail_needing(&shard, &chunks, &failed);
    Err(err)
}

/// Re-hashes every idle verified chunk (not verified within `reverify_after`) at `rate`
/// bytes per second, one chunk at a time on the blocking pool; bad chunks are dropped by the
/// check and queued for repair. It yields while chunks move through this host
/// ([`DataPath`]) and goes on where it stopped once they have not for [`SCRUB_QUIET`].
async fn run_scrub(node: Weak<Repairer>, rate: u64, mut path: DataPath, cancel: CancellationToken) {
    let mut next = tokio::time::Instant::now();
    loop {
        let keys = match node.upgrade() {
            Some(n) => n.store.shard_keys(),
            None => return,
        };
        let mut scrubbed = 0u64;
        for (digest, tier, index) in keys {
            let Some(shard) = node
                .upgrade()
                .and_then(|n| n.store.tier_shard(&digest, index, tier))
            else {
                continue;
            };
            for i in 0..shard.total_chunks() {
                if cancel.is_cancelled() {
                    return;
                }
                if shard.is_removed() {
                    break;
                }
                if !shard.needs_check(i) {
                    continue;
                }
                if !path.quiet() && !yield_to_transfers(&mut path, &cancel).await {
                    return;
                }
                if shard.is_removed() || !shard.needs_check(i) {
                    continue;
                }
                let s = shard.clone();
                let r = tokio::task::spawn_blocking(move || s.check(i, false, Check::Scrub)).await;
                scrubbed += 1;
                if let Ok(Err(StoreError::CorruptChunk { .. })) = r {
                    if let Some(n) = node.upgrade() {
                        n.repairs
                            .request(RepairRequest::new(shard.clone(), vec![i]));
                    }
                }
                let len = shard
                    .manifest()
                    .chunk_span(index, i)
                    .map_or(0, |(_, l)| l as u64);
                next += Duration::from_secs_f64(len as f64 / rate as f64);
                // After a stall (a busy blocking pool), do not burst to catch up.
                let now = tokio::time::Instant::now();
                if next + Duration::from_secs(1) < now {
                    next = now;
                }
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep_until(next) => {}
                }
            }
        }
        if scrubbed == 0 {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(SCRUB_IDLE) => {}
            }
        }
    }
}

/// Waits until the data path has been quiet for [`SCRUB_QUIET`], with the store's
/// `scrub_yielding` set meanwhile; false when cancelled.
async fn yield_to_transfers(path: &mut DataPath, cancel: &CancellationToken) -> bool {
    let store = path.store.clone();
    let stats = store.stats();
    stats.scrub_yields.fetch_add(1, Ordering::Relaxed);
    stats.scrub_yielding.store(1, Ordering::Relaxed);
    let quiet = loop {
        tokio::select! {
            _ = cancel.cancelled() => break false,
            _ = tokio::time::sleep(SCRUB_YIELD_TICK) => {}
        }
        if path.quiet() {
            break true;
        }
    };
    stats.scrub_yielding.store(0, Ordering::Relaxed);
    quiet
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreConfig;

    #[tokio::test(start_paused = true)]
    async fn the_scrub_waits_while_chunks_move_and_not_for_keepalives() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            ShardStore::open(StoreConfig::new(dir.path().join("m"), dir.path().join("d"))).unwrap();
        let wire = Arc::new(ByteCounters::default());
        let mut path = DataPath::new(wire.clone(), store.clone());
        assert!(
            path.quiet(),
            "a daemon that has moved nothing scrubs at once"
        );
        // A keepalive and an acknowledgement or two: not a transfer.
        wire.sent.fetch_add(64, Ordering::Relaxed);
        wire.received.fetch_add(200, Ordering::Relaxed);
        assert!(path.quiet());
        // Chunks leaving (a source sending, a holder answering a Fetch).
        wire.sent.fetch_add(SCRUB_QUIET_BYTES, Ordering::Relaxed);
        assert!(!path.quiet());
        tokio::time::advance(SCRUB_QUIET - Duration::from_millis(1)).await;
        assert!(
            !path.quiet(),
            "quiet only a full second after the last chunk"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(path.quiet());
        // A chunk written (a session, an origin read): however few bytes crossed the wire.
        store.stats().chunks_written.fetch_add(1, Ordering::Relaxed);
        assert!(!path.quiet());

        // The yield: marked while it waits, counted, and over once quiet for a second.
        let cancel = CancellationToken::new();
        let waiting = tokio::spawn({
            let cancel = cancel.clone();
            async move { yield_to_transfers(&mut path, &cancel).await }
        });
        tokio::time::advance(SCRUB_YIELD_TICK).await;
        tokio::task::yield_now().await;
        assert_eq!(store.stats().scrub_yielding.load(Ordering::Relaxed), 1);
        assert_eq!(store.stats().scrub_yields.load(Ordering::Relaxed), 1);
        assert!(
            waiting.await.unwrap(),
            "quiet again within the paused clock"
        );
        assert_eq!(store.stats().scrub_yielding.load(Ordering::Relaxed), 0);

        // Cancelled while chunks keep moving: it gives up and says so.
        let mut path = DataPath::new(wire.clone(), store.clone());
        wire.sent.fetch_add(SCRUB_QUIET_BYTES, Ordering::Relaxed);
        let stop = CancellationToken::new();
        stop.cancel();
        assert!(!yield_to_transfers(&mut path, &stop).await);
        assert_eq!(store.stats().scrub_yielding.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn unrepairable_reads_as_before() {
        let e = RepairError::Unrepairable {
            chunks: vec![3, 4],
            shard: 1,
            sources: vec![],
        };
        assert_eq!(
            e.to_string(),
            "chunks [3, 4] of shard 1 are corrupt at rest here and could not be repaired \
             (no source to repair from)"
        );
        let e = RepairError::Unrepairable {
            chunks: vec![3],
            shard: 0,
            sources: vec!["file:///a".into(), "shardcast://h:1".into()],
        };
        assert!(
            e.to_string()
                .ends_with("(not repaired from file:///a, shardcast://h:1)"),
            "{e}"
        );
        let failed = SessionError::Unrepairable(e);
        assert!(failed.is_local());
        assert!(failed.to_string().contains("corrupt at rest"));
    }

    #[test]
    fn runs_are_contiguous_ranges() {
        assert_eq!(runs(&[1, 2, 3, 7, 9, 10]), vec![1..4, 7..8, 9..11]);
        assert!(runs(&[]).is_empty());
    }

    #[test]
    fn known_sources_are_bounded_and_most_recent_first() {
        let r = Repairs::new();
        let m = ModelDigest([1; 32]);
        r.note_source(m, "");
        assert!(r.sources(&m).is_empty());
        for i in 0..10 {
            r.note_source(m, &format!("file:///o{i}"));
        }
        r.note_source(m, "file:///o7");
        assert_eq!(
            r.sources(&m),
            vec!["file:///o7", "file:///o9", "file:///o8", "file:///o6"]
        );
        for i in 0..(MODELS as u32 + 5) {
            let mut d = [0u8; 32];
            d[..4].copy_from_slice(&i.to_be_bytes());
            d[31] = 2;
            r.note_source(ModelDigest(d), "file:///x");
        }
        let k = r.sources.lock().unwrap();
        assert_eq!(k.by_model.len(), MODELS);
        assert_eq!(k.order.len(), MODELS);
    }
}
