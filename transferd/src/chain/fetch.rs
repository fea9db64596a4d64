//! Fetching chunks into a session from an origin (range reads) or from another holder
//! (`Fetch`): used by recovery, by a head that does not hold its shard, by imports and by
//! repairs.
//!
//! [`Fetcher`] is the role; it is given the peer links (to dial holders), the store, an
//! [`Intake`] (to store and count chunks), the repair sources (it notes where it fetched
//! from) and its part of the tuning (the origin allow-list, parallelism, timeouts). It
//! reaches no session table and sends to no downstream.
//!
//! `Fetcher::fetch_model` fetches a whole model (an import with `fetch`),
//! `Fetcher::adopt_staged` moves a kept import into the store shard by shard, and
//! `Fetcher::fetch_spans` fetches chunk ranges in a given order (whole-model imports,
//! partition-first loads, repairs); `Fetcher::pull_while_progressing` pulls from a holder
//! above for as long as it has something new (recovery, a bypassed head): until a pull
//! brings nothing new a few times in a row, or at once when the holder answers
//! `NotReceiving` (its copy lacks part of the span and nothing feeds it: a copy left by a
//! restart or a failed session).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use shardcast_protocol::{
    DataTier, ErrorCode, Frame, Hop, HopTransport, HostId, Manifest, SessionId, VerifiedChunk,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

use super::handshake::Links;
use super::outcome::FetchError;
use super::session::{ChunkFrom, Incoming, Intake};
use super::{ChainConfig, ChainError, ShardSession, read_timeout};
use crate::origin::{self, Origin, OriginAccess};
use crate::repair::Repairs;
use crate::store::ShardStore;
use crate::wire::Conn;

/// Pulls in a row that bring nothing new before a holder is left for the next source.
/// Rationale: a live holder above that is itself still receiving has new chunks at every
/// pull; four empty pulls a quarter stall timeout apart (about a stall timeout in all) mean
/// it is starved too.
const EMPTY_PULLS: u32 = 4;

/// The longest one try of [`Fetcher::until_origin_answers`] waits for the origin's answer
/// (the HTTP origin's connect limit), and the longest it waits in all.
const ORIGIN_PROBE_LIMIT: Duration = Duration::from_secs(30);

/// Tries of the origin [`Fetcher::until_origin_answers`] keeps in flight at once.
const ORIGIN_PROBES: usize = 16;

/// How a holder ended its answer to one `Fetch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pulled {
    /// `Done`: it sent every chunk of the span it holds; it may hold more later.
    All,
    /// `NotReceiving`: it sent what it holds and receives none of the rest.
    NoMore,
}

/// Fetches chunks into sessions from origins and holders. See the module docs.
pub(crate) struct Fetcher {
    links: Links,
    intake: Intake,
    store: ShardStore,
    repairs: Arc<Repairs>,
    /// The origin allow-list.
    origins: OriginAccess,
    /// Concurrent range reads from an origin.
    origin_parallel: usize,
    /// The longest wait for a holder answering `Fetch` from a `shardcast://` source.
    idle_timeout: Duration,
    /// A holder above that answers nothing for this long is left for the next source.
    stall_timeout: Duration,
}

impl Fetcher {
    pub(super) fn new(
        links: Links,
        intake: Intake,
        store: ShardStore,
        repairs: Arc<Repairs>,
        cfg: &ChainConfig,
    ) -> Self {
        Self {
            links,
            intake,
            store,
            repairs,
            origins: cfg.origins.clone(),
            origin_parallel: cfg.origin_parallel,
            idle_timeout: cfg.idle_timeout,
            stall_timeout: cfg.stall_timeout,
        }
    }

    /// Fetches `missing` chunks of the session's shard from `source` into the store:
    /// `shardcast://host:port` pulls from another holder, anything else is an origin URI.
    pub(super) async fn fill(
        &self,
        sess: &ShardSession,
        source: &str,
        missing: Vec<u32>,
    ) -> Result<(), FetchError> {
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
                .pull_from_holder(sess, addr, None, span, self.idle_timeout)
                .await
                .map(drop)
                .map_err(|error| FetchError::Holder {
                    holder: addr.to_string(),
                    error,
                });
        }
        let origin = Origin::parse(source, &self.origins)?;
        self.fill_from(sess, &origin, missing, ChunkFrom::Origin, None)
            .await
    }

    /// Reads what the session lacks from `source` (an origin URI, or a holder as in
    /// [`Self::fill`]) and yields to a peer: the origin read stops, between two chunks,
    /// when a holder starts feeding the session's shard here (a hop above rejoined this
    /// session, or another session of the shard is fed by one: see
    /// [`ShardSession::yield_origin_read`]), and goes on for what is still missing once the
    /// shard has not grown for a stall timeout. The origin is the one source every chain
    /// shares; a host that a peer can feed does not read it twice (a host cut off for a
    /// while read 1.7 × the model from the origin before).
    pub(super) async fn fill_yielding(
        &self,
        sess: &ShardSession,
        source: &str,
    ) -> Result<(), FetchError> {
        loop {
            let missing: Vec<u32> = sess
                .shard
                .verified_set(sess.start, sess.end)
                .missing()
                .collect();
            if missing.is_empty() || source.starts_with("shardcast://") {
                return self.fill(sess, source, missing).await;
            }
            let origin = Origin::parse(source, &self.origins)?;
            let read = sess.origin_read();
            self.fill_from(sess, &origin, missing, ChunkFrom::Origin, Some(&read.token))
                .await?;
            if !read.token.is_cancelled() {
                return Ok(());
            }
            drop(read);
            self.intake.count_origin_yield();
            info!(session = %sess.id, shard = sess.shard_index(), have = sess.verified(), total = sess.total(), "a peer feeds this shard now: the origin read waits while it brings chunks");
            self.wait_while_growing(sess).await;
        }
    }

    /// Whether the origin `source` answers a read of the session's shard's first byte within
    /// `within`: how a recovering hop whose origin read stopped learns that the origin (and
    /// its own link) is back, without reading a chunk from it.
    pub(super) async fn origin_answers(
        &self,
        sess: &ShardSession,
        source: &str,
        within: Duration,
    ) -> bool {
        // Parsed for each try: an HTTP origin gets a client of its own, so each try dials a
        // new connection instead of reusing one that died with the link.
        let Ok(origin) = Origin::parse(source, &self.origins) else {
            return false;
        };
        let Ok(shard) = sess.manifest.shard(sess.shard_index()) else {
            return false;
        };
        let read = origin.read_range(&shard.path, 0, 1);
        match tokio::time::timeout(within, read).await {
            Ok(Ok(_)) => true,
            Ok(Err(e)) => {
                debug!(session = %sess.id, "the origin does not answer yet: {e}");
                false
            }
            Err(_) => false,
        }
    }

    /// Returns once the origin `uri` answers a one-byte read of the session's shard (see
    /// [`Self::origin_answers`]), or after [`ORIGIN_PROBE_LIMIT`]: how a host whose origin
    /// read stalled (its link, or the origin, went away) learns that it may read again, so
    /// that its peers get the first word before it does. A fresh try every half `grace` (a
    /// new connection: one dialled during an outage may wait out TCP's backoff after the
    /// link is back), each waiting up to [`ORIGIN_PROBE_LIMIT`] (a slow origin still
    /// answers one), at most [`ORIGIN_PROBES`] at once. After the limit with no answer the
    /// caller reads the origin anyway, and its own errors and limits end the attempt.
    pub(super) async fn until_origin_answers(
        &self,
        sess: &ShardSession,
        uri: &str,
        grace: Duration,
    ) {
        use futures::StreamExt;
        let origin_back = async {
            let mut tries = futures::stream::FuturesUnordered::new();
            let mut tick = tokio::time::interval((grace / 2).max(Duration::from_millis(10)));
            loop {
                tokio::select! {
                    _ = tick.tick(), if tries.len() < ORIGIN_PROBES => {
                        tries.push(self.origin_answers(sess, uri, ORIGIN_PROBE_LIMIT));
                    }
                    Some(true) = tries.next(), if !tries.is_empty() => return,
                }
            }
        };
        let _ = tokio::time::timeout(ORIGIN_PROBE_LIMIT, origin_back).await;
    }

    /// Returns once the session's range is complete, or the shard has not grown for a
    /// stall timeout.
    pub(super) async fn wait_while_growing(&self, sess: &ShardSession) {
        let mut grown = sess.shard.subscribe();
        while !sess.complete() {
            match tokio::time::timeout(self.stall_timeout, grown.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return,
            }
        }
    }

    /// Fills `missing` chunks of the session from `origin`, each verified and stored as
    /// coming `from` there.
    async fn fill_from(
        &self,
        sess: &ShardSession,
        origin: &Origin,
        missing: Vec<u32>,
        from: ChunkFrom,
        stop: Option<&CancellationToken>,
    ) -> Result<(), FetchError> {
        let (tx, mut rx) = mpsc::channel::<VerifiedChunk>(self.origin_parallel.max(1) * 2);
        // Aborted with this future, wherever it is dropped (a recovery that found a holder
        // again drops it): the range reads in flight stop with it.
        let fetch = {
            let origin = origin.clone();
            let manifest = sess.manifest.clone();
            let shard = sess.shard_index();
            let parallel = self.origin_parallel;
            AbortOnDropHandle::new(tokio::spawn(async move {
                origin::fetch_chunks(&origin, manifest, shard, missing, parallel, tx).await
            }))
        };
        let never = CancellationToken::new();
        let stop = stop.unwrap_or(&never);
        loop {
            // Stops between two chunks, never inside a store.
            let chunk = tokio::select! {
                biased;
                () = stop.cancelled() => return Ok(()),
                chunk = rx.recv() => chunk,
            };
            let Some(chunk) = chunk else { break };
            let index = chunk.index();
            self.intake
                .store_chunk(sess, index, Incoming::Verified(chunk), from)
                .await?;
        }
        Ok(fetch.await??)
    }

    /// Pulls every chunk of `span` (within the session's range) that `addr` holds; the
    /// holder must be host `expect` when given, be connected within twice `patience`, and
    /// send each frame within `patience`.
    async fn pull_from_holder(
        &self,
        sess: &ShardSession,
        addr: &str,
        expect: Option<&HostId>,
        span: std::ops::Range<u32>,
        patience: std::time::Duration,
    ) -> Result<Pulled, ChainError> {
        // A stopped holder's kernel still completes the TCP handshake: bound the set-up too.
        let setup = patience * 2;
        let result = async {
            let connect = self.links.connect(sess.transport, addr, expect);
            let (mut conn, _) = tokio::time::timeout(setup, connect)
                .await
                .map_err(|_| ChainError::Timeout(setup))??;
            self.fetch_over(sess, &mut conn, span, patience).await
        }
        .await;
        if let Err(e) = &result {
            self.links.forget_path(sess.transport, addr, e);
        }
        result
    }

    /// Whether `hop` answers a connection (TLS handshake and `Hello`) within `within`.
    pub(super) async fn reach(&self, transport: HopTransport, hop: &Hop, within: Duration) -> bool {
        let connect = self.links.connect(transport, &hop.addr, Some(&hop.host));
        match tokio::time::timeout(within, connect).await {
            Ok(Ok(_)) => true,
            Ok(Err(e)) => {
                self.links.forget_path(transport, &hop.addr, &e);
                debug!(holder = %hop.host, "not reached: {e}");
                false
            }
            Err(_) => false,
        }
    }

    /// Sends `Fetch` for `span` on `conn` and stores every chunk the holder answers with.
    async fn fetch_over(
        &self,
        sess: &ShardSession,
        conn: &mut Conn,
        span: std::ops::Range<u32>,
        patience: std::time::Duration,
    ) -> Result<Pulled, ChainError> {
        let shard = sess.shard_index();
        let fetch = Frame::Fetch {
            model: sess.model,
            shard,
            start: span.start,
            end: span.end,
        };
        conn.writer.send_now(&fetch).await?;
        loop {
            match read_timeout(conn, patience).await? {
                Frame::Chunk {
                    shard: s,
                    index,
                    data,
                } if s == shard && (sess.start..sess.end).contains(&index) => {
                    // A corrupt one is counted and dropped; what is missing is fetched by
                    // the next recovery attempt.
                    let hashed = conn.reader.take_chunk_hash();
                    self.intake
                        .store_chunk(
                            sess,
                            index,
                            Incoming::Unverified(data, hashed),
                            ChunkFrom::Holder,
                        )
                        .await?;
                }
                Frame::Done => return Ok(Pulled::All),
                Frame::Error {
                    code: ErrorCode::NotReceiving,
                    message,
                } => {
                    debug!(session = %sess.id, "the holder has no more of the span: {message}");
                    return Ok(Pulled::NoMore);
                }
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

    /// Downloads a whole model from an origin into `tier` (the agent's `ImportModel` with
    /// `fetch`).
    pub(crate) async fn fetch_model(
        &self,
        manifest: &Arc<Manifest>,
        origin: &str,
        tier: DataTier,
    ) -> Result<(), FetchError> {
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
                return Err(FetchError::Incomplete { shard: s });
            }
        }
        Ok(())
    }

    /// Moves a model whose bytes were kept while its manifest was built (`staging`) into
    /// `tier`, one shard at a time. A shard the tier does not hold yet is renamed into place
    /// and its chunks marked verified without hashing them a second time (see
    /// [`crate::store::ShardStore::adopt_kept`] for why that is safe: the file is ours and
    /// holds exactly the bytes that were hashed; each chunk is still re-hashed before its
    /// bytes first leave the store). A shard the tier already holds in part, or one whose
    /// rename fails, is topped up from the staged file on the verified path every chunk
    /// takes, and that staged file removed once it is in. `origin` (the real one) is noted
    /// for repairs.
    pub(crate) async fn adopt_staged(
        &self,
        manifest: &Arc<Manifest>,
        staging: &crate::store::Staging,
        origin: &str,
        tier: DataTier,
    ) -> Result<(), FetchError> {
        let model = manifest.digest();
        self.repairs.note_source(model, origin);
        let staged = Origin::staged(staging.path());
        for (s, entry) in manifest.shards.iter().enumerate() {
            let s = s as u32;
            match self.store.adopt_kept(&model, s, tier, staging) {
                Ok(Some(shard)) if shard.is_complete() => {
                    self.intake.count_kept(entry.size);
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(model = %model, shard = s, "cannot move the kept file into place; copying it through verification: {e}");
                }
            }
            let shard = self.store.shard(&model, s, tier)?;
            let total = shard.total_chunks();
            let missing: Vec<u32> = shard.verified_set(0, total).missing().collect();
            if !missing.is_empty() {
                let (sess, _active) = self.intake.new_session(
                    SessionId([0; 16]),
                    model,
                    manifest.clone(),
                    shard.clone(),
                    0,
                    total,
                    String::new(),
                    (Bytes::new(), HopTransport::Tcp),
                );
                self.fill_from(&sess, &staged, missing, ChunkFrom::Kept, None)
                    .await?;
            }
            if !shard.is_complete() {
                return Err(FetchError::KeptIncomplete { shard: s });
            }
            if let Err(e) = staging.remove(&entry.path) {
                warn!(model = %model, shard = s, "removing a staged shard: {e}");
            }
        }
        Ok(())
    }

    /// Downloads the chunks of `spans` (shard, chunk range; clipped to the shard) that this
    /// host does not hold yet, in the order given, into `tier`. `source` is an origin URL or
    /// `shardcast://host:port`, a peer's data listener. Used for whole-model imports and for
    /// partitioned loads (the partition's chunks first, then the rest).
    pub(crate) async fn fetch_spans(
        &self,
        manifest: &Arc<Manifest>,
        source: &str,
        tier: DataTier,
        spans: Vec<(u32, std::ops::Range<u32>)>,
    ) -> Result<(), FetchError> {
        let model = manifest.digest();
        self.repairs.note_source(model, source);
        for (s, range) in spans {
            if s as usize >= manifest.shards.len() {
                return Err(FetchError::NoSuchShard {
                    shard: s,
                    shards: manifest.shards.len(),
                });
            }
            let shard = self.store.shard(&model, s, tier)?;
            let total = shard.total_chunks();
            let (start, end) = (range.start.min(total), range.end.min(total));
            if start >= end {
                continue;
            }
            let missing: Vec<u32> = shard.verified_set(start, end).missing().collect();
            if missing.is_empty() {
                continue;
            }
            let (sess, _active) = self.intake.new_session(
                SessionId([0; 16]),
                model,
                manifest.clone(),
                shard,
                start,
                end,
                source.to_string(),
                (Bytes::new(), HopTransport::Tcp),
            );
            self.fill(&sess, source, missing).await?;
            debug!(model = %model, shard = s, start, end, "chunks fetched");
        }
        Ok(())
    }

    /// Pulls from a holder above for as long as it has something new: a hop above that is
    /// still receiving has more at each pull.
    pub(super) async fn pull_while_progressing(
        &self,
        sess: &ShardSession,
        hop: &Hop,
    ) -> Result<(), FetchError> {
        let mut empty = 0;
        loop {
            let held = sess.shard.verified_set(sess.start, sess.end);
            let mut missing = held.missing();
            let span = match (missing.next(), missing.last()) {
                (Some(first), last) => first..last.unwrap_or(first).saturating_add(1),
                (None, _) => return Ok(()),
            };
            let before = sess.verified();
            // A holder that stops answering for a stall timeout is left for the next source;
            // a long pull that keeps delivering is not cut short.
            let pulled = self
                .pull_from_holder(sess, &hop.addr, Some(&hop.host), span, self.stall_timeout)
                .await
                .map_err(|error| FetchError::Holder {
                    holder: hop.host.to_string(),
                    error,
                })?;
            // The holder receives none of what it lacks: asking again brings nothing.
            if pulled == Pulled::NoMore {
                return Ok(());
            }
            if sess.verified() > before {
                empty = 0;
                continue;
            }
            empty += 1;
            if empty >= EMPTY_PULLS {
                return Ok(());
            }
            tokio::time::sleep(self.stall_timeout / 4).await;
        }
    }
}
