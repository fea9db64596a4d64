//! Joining a session (plan token, fallback origin policy, session cap, manifest) and
//! receiving from an upstream: frames into the [`Inbound`] machine, chunks through
//! `store_chunk`, its answers back as `Ack`/`Nack`/`Progress`, then `Done` once the session
//! is complete here.
//!
//! `authorize_open`: an `Open` is kept only with a controller-signed plan token that covers
//! it — its model, this host, the sender, and every address it would have this host dial —
//! checked before its manifest is stored; the token is passed on in every `Open` the hop
//! sends. An upstream that sends nothing for `stall_timeout` is dropped, and a second `Open`
//! of a session fed by a live upstream or fetch is answered `AlreadyFed` — unless what feeds
//! it is an origin read, which gives way to the hop above; a new session fed by a peer
//! pauses the origin reads of the shard's other sessions (`Fetcher::fill_yielding`).
//!
//! [`Receiver`] is the role. It is given the peer links (for the plan's CA and this host's
//! id), the session table (to find, admit and reap hop sessions), the store (the manifest,
//! the name binding, the shard), an [`Intake`] (to store and count chunks), the repair
//! sources (it notes the session's fallback), the counters and histograms, the shutdown
//! token, the two roles a joined session starts ([`Forwarder`], [`Recovery`]) and its part
//! of the tuning (the origin allow-list, `max_sessions`, the receiving end's tuning).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use shardcast_protocol::{
    ErrorCode, Frame, HostId, Manifest, ModelDigest, SessionHeader, plan::PlanClaims,
};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::forward::Forwarder;
use super::handshake::Links;
use super::pieces::Assemblies;
use super::proto::{Inbound, InboundConfig, InboundFrame, Stalled, Verdict};
use super::recovery::Recovery;
use super::session::{ActiveSession, ChunkFrom, FeederGuard, Incoming, Intake};
use super::table::Sessions;
use super::{ChainConfig, ChainError, NodeStats, ShardSession, now, sleep_until};
use crate::metrics::DataMetrics;
use crate::origin::OriginAccess;
use crate::repair::Repairs;
use crate::store::{BindingSource, ShardStore};
use crate::wire::Conn;

/// Admits upstreams' sessions and receives their chunks. See the module docs.
pub(super) struct Receiver {
    links: Links,
    sessions: Sessions,
    store: ShardStore,
    intake: Intake,
    repairs: Arc<Repairs>,
    stats: Arc<NodeStats>,
    metrics: DataMetrics,
    cancel: CancellationToken,
    forwarder: Arc<Forwarder>,
    recovery: Arc<Recovery>,
    /// The origin allow-list (a session's fallback origin is checked against it).
    origins: OriginAccess,
    /// Hop sessions this host holds at most.
    max_sessions: usize,
    /// An upstream silent for half of it is no longer a live feed.
    stall_timeout: Duration,
    /// The receiving end's tuning.
    inbound: InboundConfig,
}

impl Receiver {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        links: Links,
        sessions: Sessions,
        store: ShardStore,
        intake: Intake,
        repairs: Arc<Repairs>,
        (stats, metrics): (Arc<NodeStats>, DataMetrics),
        cancel: CancellationToken,
        (forwarder, recovery): (Arc<Forwarder>, Arc<Recovery>),
        cfg: &ChainConfig,
    ) -> Self {
        Self {
            links,
            sessions,
            store,
            intake,
            repairs,
            stats,
            metrics,
            cancel,
            forwarder,
            recovery,
            origins: cfg.origins.clone(),
            max_sessions: cfg.limits.max_sessions,
            stall_timeout: cfg.stall_timeout,
            inbound: cfg.inbound(),
        }
    }

    /// Checks the `Open`'s plan token: signed by the controller (a certificate of the
    /// cluster CA with the `controller` role), not expired, for this model, naming this
    /// host, the sender, and every downstream hop and upstream holder at its address, and
    /// a `shardcast://` fallback at a plan host's address. Nothing of the session, not even
    /// its manifest, is read before this passes. Without TLS (`insecure_plaintext`) there is
    /// no CA to check a signature against, and sessions are accepted as before.
    /// Whether a session here receives shard `shard` of `model` (see
    /// [`Sessions::receives`]): the pull server's answer to a `Fetch` it can serve only in
    /// part depends on it.
    pub(super) fn receives(&self, model: &ModelDigest, shard: u32) -> bool {
        self.sessions.receives(model, shard)
    }

    pub(super) fn authorize_open(
        &self,
        header: &SessionHeader,
        remote: &HostId,
    ) -> Result<Option<PlanClaims>, ChainError> {
        let Some(tls) = self.links.transports().tls() else {
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
        // Every address this session could make us dial (the next hops, the holders above
        // us, a `shardcast://` fallback) must be one the plan names.
        claims
            .authorises(header, self.links.host(), remote, now)
            .map_err(|e| refuse(e.to_string()))?;
        Ok(Some(claims))
    }

    /// Finds the session for `header`, or creates it (and its forwarder and recovery
    /// monitor). `claims` are what [`Self::authorize_open`] found the `Open` authorised for;
    /// `offered` is the manifest that followed it.
    pub(super) fn join_session(
        &self,
        header: &SessionHeader,
        claims: Option<PlanClaims>,
        offered: Option<Manifest>,
        remote: &HostId,
    ) -> Result<Arc<ShardSession>, ChainError> {
        let key = (header.session, header.shard, header.start);
        if let Some(s) = self.sessions.hop(&key) {
            // A hop above a stalled one fails over to us once our upstream has been silent
            // for a stall timeout. An `Open` while our upstream is plainly alive comes from
            // a host that was itself cut off or stopped and is back: a second feed would
            // only halve the live one's bandwidth. It rejoins as a leaf instead.
            // But a holder beats the origin: when what feeds us is an origin read (this
            // host was the one cut off or stopped, and recovered from there), it stops and
            // the hop above feeds the rest.
            if let Some(live) = s.live_feed_besides(remote, self.stall_timeout / 2) {
                if live.is_none() && s.yield_origin_read() {
                    info!(session = %header.session, shard = header.shard, upstream = %remote, "a hop above rejoined: it feeds the rest instead of the origin");
                } else {
                    self.stats
                        .second_upstreams_refused
                        .fetch_add(1, Ordering::Relaxed);
                    let live = live.map_or_else(
                        || "a fetch from the holders above or the origin".to_string(),
                        |w| format!("upstream {w}"),
                    );
                    return Err(ChainError::refused(
                        ErrorCode::AlreadyFed,
                        format!(
                            "session {} shard {} is fed by {live}, which is alive; not taking a second upstream",
                            header.session, header.shard
                        ),
                    ));
                }
            }
            debug!(session = %header.session, shard = header.shard, "joining running session");
            s.set_upstream(&header.upstream);
            return Ok(s);
        }
        // A fallback origin outside this host's policy refuses the session before anything
        // is stored: the peer does not get to make this host read where it says.
        if !header.origin.is_empty() && !header.origin.starts_with("shardcast://") {
            self.origins.check(&header.origin).map_err(|e| {
                ChainError::refused(ErrorCode::Refused, format!("fallback origin: {e}"))
            })?;
        }
        // A draining host finishes the sessions it runs (a new shard or stripe of one of
        // them included) but joins no other: the hop above skips it at once.
        if self.sessions.draining() && !self.sessions.runs(&header.session) {
            self.stats
                .sessions_refused_draining
                .fetch_add(1, Ordering::Relaxed);
            return Err(ChainError::refused(
                ErrorCode::Refused,
                "this host is draining (shutting down): it starts no new session",
            ));
        }
        let held = self.sessions.hops();
        if held >= self.max_sessions {
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
        // this version here from now on (never because a manifest says so), unless a newer
        // statement about the name has reached this host (a replayed old token: refused and
        // counted by the store; the session itself may go on, its chunks are verified).
        if let Some(c) = claims.as_ref()
            && let Some(name) = c.name.as_ref()
            && *name == manifest.name
        {
            self.store
                .bind_name(name, header.model, BindingSource::Plan, c.issued_at_ms)?;
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
            _ => self
                .store
                .shard(&header.model, header.shard, header.tier)
                .inspect_err(|e| {
                    self.intake.note_store_failure(
                        header.model,
                        header.tier,
                        header.session,
                        e.to_string(),
                    );
                })?,
        };
        self.repairs.note_source(header.model, &header.origin);
        // Dropped (and the gauge with it) if another connection created the session first.
        let (sess, active) = self.intake.new_session(
            header.session,
            header.model,
            manifest,
            shard,
            header.start,
            header.end,
            header.origin.clone(),
            (header.token.clone(), header.transport),
        );
        sess.set_upstream(&header.upstream);
        let theirs = self
            .sessions
            .insert_hop(key, &sess)
            .map_err(|()| ChainError::refused(ErrorCode::Internal, "session table poisoned"))?;
        // Another connection may have created it while we were opening the shard.
        if let Some(s) = theirs {
            s.set_upstream(&header.upstream);
            return Ok(s);
        }
        // A peer feeds this shard now: another session here that reads it from the origin
        // (a head cut off for a while, that the controller re-planned from a peer) waits.
        let yielded = self.sessions.yield_origin_reads(&sess);
        if yielded > 0 {
            info!(session = %header.session, shard = header.shard, upstream = %remote, yielded, "a peer feeds this shard: origin reads of other sessions wait");
        }
        self.forwarder.spawn(&sess, header.downstream.clone());
        self.recovery.spawn(&sess);
        self.spawn_reaper(&sess, key, active);
        Ok(sess)
    }

    /// Removes a hop session from the table once it has finished, so a later session id can
    /// reuse nothing stale; the session counts as active until then. Records the session's
    /// time to ready and throughput once its range is verified here.
    fn spawn_reaper(
        &self,
        sess: &Arc<ShardSession>,
        key: super::SessionKey,
        active: ActiveSession,
    ) {
        let (metrics, cancel, sessions) = (
            self.metrics.clone(),
            self.cancel.clone(),
            self.sessions.clone(),
        );
        let sess = sess.clone();
        tokio::spawn(async move {
            // A receiver session's time to ready and throughput (`crate::metrics`), unless
            // it held its range already when it started.
            if !sess.complete() {
                tokio::select! {
                    r = sess.ready() => if r.is_ok() {
                        metrics.session_ready(sess.range_bytes(), sess.started.elapsed());
                    },
                    _ = cancel.cancelled() => {}
                }
            }
            tokio::select! {
                _ = sess.finished() => {}
                _ = cancel.cancelled() => {}
            }
            // Let late joiners (a failover racing completion) still find it for a moment.
            tokio::time::sleep(Duration::from_secs(5)).await;
            sessions.remove_hop(&key);
            drop(active);
        });
    }

    /// Reads chunks from one upstream connection into the session.
    pub(super) async fn handle_upstream(
        &self,
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
            let mut inbound = Inbound::new(shard, sess.start..sess.end, self.inbound, now());
            // Verify+store runs concurrently with reading the next chunks off the wire, so
            // a hop's throughput is bounded by its slowest stage, not their sum.
            let mut pending: futures::stream::FuturesUnordered<
                futures::future::BoxFuture<'static, (u32, Result<Verdict, ChainError>)>,
            > = futures::stream::FuturesUnordered::new();
            // Chunks arriving in pieces on this connection (`super::pieces`).
            let mut assemblies = Assemblies::new(sess.manifest.clone(), sess.pieces.clone());
            let out_of_range = |s: u32, index: u32| {
                ChainError::protocol(format!(
                    "chunk {s}/{index} is outside the session's shard {shard} range {}..{}",
                    sess.start, sess.end
                ))
            };
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
                    frame = conn.reader.read(), if inbound.wants_frame() => match frame.inspect(|_| sess.heard_from(Some(remote)))? {
                        Some(Frame::Chunk { shard: s, index, data }) => {
                            if assemblies.contains(index) {
                                return Err(ChainError::protocol(format!("chunk {index} whole while its pieces arrive")));
                            }
                            inbound.handle_frame(now(), InboundFrame::Chunk { shard: s, index }).map_err(|_| out_of_range(s, index))?;
                            let hashed = conn.reader.take_chunk_hash();
                            let (intake, sess) = (self.intake.clone(), sess.clone());
                            pending.push(Box::pin(async move {
                                (index, intake.store_chunk(&sess, index, Incoming::Unverified(data, hashed), ChunkFrom::Upstream).await)
                            }));
                        }
                        Some(Frame::ChunkHead { shard: s, index, cvs }) => {
                            inbound.handle_frame(now(), InboundFrame::Piece { shard: s, index }).map_err(|_| out_of_range(s, index))?;
                            if let Some((e, answer_now)) = assemblies.head(s, index, &cvs)? {
                                self.stats.chunks_corrupt.fetch_add(1, Ordering::Relaxed);
                                warn!(chunk = index, "refusing a chunk in pieces whose piece hashes do not match the manifest: {e}");
                                if answer_now {
                                    inbound.handle_frame(now(), InboundFrame::Chunk { shard: s, index }).map_err(|_| out_of_range(s, index))?;
                                    pending.push(Box::pin(std::future::ready((index, Ok(Verdict::Corrupt)))));
                                }
                            }
                        }
                        Some(Frame::Piece { shard: s, index, piece, data }) => {
                            inbound.handle_frame(now(), InboundFrame::Piece { shard: s, index }).map_err(|_| out_of_range(s, index))?;
                            let cv = conn.reader.take_piece_cv();
                            let step = assemblies.piece(index, piece, data, cv)?;
                            if let Some(e) = &step.failed {
                                self.stats.chunks_corrupt.fetch_add(1, Ordering::Relaxed);
                                warn!(chunk = index, piece, "dropping chunk whose piece failed verification: {e}");
                            }
                            if let Some(last) = step.last {
                                // The chunk is whole: admitted, stored and answered as a chunk.
                                inbound.handle_frame(now(), InboundFrame::Chunk { shard: s, index }).map_err(|_| out_of_range(s, index))?;
                                match last {
                                    Some(chunk) => {
                                        let (intake, sess, stats) = (self.intake.clone(), sess.clone(), self.stats.clone());
                                        pending.push(Box::pin(async move {
                                            let verdict = intake.store_chunk(&sess, index, Incoming::Pieces(chunk), ChunkFrom::Upstream).await;
                                            sess.pieces.end(index);
                                            if matches!(verdict, Ok(Verdict::Stored)) {
                                                stats.chunks_received_in_pieces.fetch_add(1, Ordering::Relaxed);
                                            }
                                            (index, verdict)
                                        }));
                                    }
                                    None => pending.push(Box::pin(std::future::ready((index, Ok(Verdict::Corrupt))))),
                                }
                            }
                        }
                        Some(Frame::Done) => {
                            let _ = inbound.handle_frame(now(), InboundFrame::Done);
                        }
                        Some(Frame::Keepalive) => {
                            let _ = inbound.handle_frame(now(), InboundFrame::Keepalive);
                        }
                        Some(Frame::Error { code, message }) => return Err(ChainError::Remote { code, message }),
                        Some(other) => return Err(ChainError::protocol(format!("unexpected {:?} in a session", other.ty()))),
                        None => return Err(ChainError::Closed),
                    },
                    p = relayed.recv() => if let Ok(p) = p {
                        conn.writer.send_now(&p).await?;
                    },
                    () = sleep_until(inbound.poll_timeout()) => {
                        if let Some(Stalled(d)) = inbound.handle_timeout(now()) {
                            // Dead, stopped or cut off: drop it, so the hop above it fails
                            // over to us or the recovery monitor pulls from elsewhere.
                            self.stats.upstream_stalls.fetch_add(1, Ordering::Relaxed);
                            sess.note_stalled(remote);
                            warn!(stall_ms = d.as_millis() as u64, "upstream sent nothing (no chunk, no keepalive): stalled; dropping it");
                            return Err(ChainError::Timeout(d));
                        }
                    }
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
            host: self.links.host().clone(),
            shard: sess.shard_index(),
            verified: sess.verified(),
            total: sess.total(),
        }
    }
}
