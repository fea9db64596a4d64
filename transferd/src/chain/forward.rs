//! The forwarder: one per session, sending the session's chunks to the first downstream hop
//! that works, failing over down the list. The decisions are the [`SendWindow`]'s; this
//! loop reads chunks, writes frames and feeds back what the downstream answers.
//!
//! A downstream is given up when it refuses, closes, or stalls (no answer or no drained write
//! within `stall_timeout`); the forwarder sends `Keepalive`s when it has nothing to send.
//! The `Open` it sends lists this host and the live holders above it. After `AlreadyFed`
//! twice it stops, and a head then pulls the rest from the hop below instead of the origin.
//! It reads through `Shard::read_checked`, re-hashing up to `CHECK_AHEAD` (4) chunks ahead of
//! the socket; a chunk that fails is never sent but repaired and sent afterwards.
//!
//! [`Forwarder`] is given the peer links (to dial the next hop), the counters, a repair
//! queue handle, the fault injection (tests), the shutdown token and its part of the tuning
//! (the send window, timeouts, `sendfile`). It reads the one session it forwards; it reaches
//! no session table, no store-failure record and no origin.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use std::collections::HashMap;

use bytes::{Bytes, BytesMut};
use shardcast_protocol::pieces::{piece_count, piece_span};
use shardcast_protocol::{ChunkSet, ErrorCode, Frame, Hop, PIECES_VERSION, PieceCv, SessionHeader};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use super::handshake::Links;
use super::outcome::{ForwardError, HopFailure};
use super::pieces::MAX_PIECING;
use super::proto::{
    Answer, LocalCopy, Repair, SendOutcome, SendWindow, SendWindowConfig, Transmit,
};
use super::session::ForwardState;
use super::{
    CHECK_AHEAD, ChainConfig, ChainError, Faults, NodeStats, ShardSession, now, read_timeout,
    sleep_until,
};
use crate::repair::{RepairHandle, RepairRequest};
use crate::store::Shard;
use crate::store::{Check, StoreError};
use crate::wire::{Conn, FileRegion};

/// Sends sessions' chunks down the chain. See the module docs.
pub(super) struct Forwarder {
    links: Links,
    stats: Arc<NodeStats>,
    repairs: RepairHandle,
    faults: Arc<Faults>,
    cancel: CancellationToken,
    /// The send window's tuning.
    window: SendWindowConfig,
    /// A downstream that makes no progress for this long is bypassed.
    stall_timeout: Duration,
    /// The longest wait for the downstream's `Accept`.
    idle_timeout: Duration,
    /// Send payloads from the store's files (plaintext TCP).
    sendfile: bool,
    /// Send chunks in verified pieces where their pieces' CVs are known (`super::pieces`).
    pieces: bool,
}

impl Forwarder {
    pub(super) fn new(
        links: Links,
        stats: Arc<NodeStats>,
        repairs: RepairHandle,
        faults: Arc<Faults>,
        cancel: CancellationToken,
        cfg: &ChainConfig,
    ) -> Self {
        Self {
            links,
            stats,
            repairs,
            faults,
            cancel,
            window: cfg.send_window(),
            stall_timeout: cfg.stall_timeout,
            idle_timeout: cfg.idle_timeout,
            sendfile: cfg.sendfile,
            pieces: cfg.pieces,
        }
    }

    /// Starts the session's forwarder to `hops`; its result lands in the session.
    pub(super) fn spawn(self: &Arc<Self>, sess: &Arc<ShardSession>, hops: Vec<Hop>) {
        let this = self.clone();
        let sess = sess.clone();
        let span = info_span!("forward", session = %sess.id, model = %sess.model, shard = sess.shard_index());
        tokio::spawn(
            async move {
                let result = this.forward(&sess, hops).await;
                if let Err(e) = &result {
                    warn!("forwarding ended: {e}");
                }
                sess.forward.send_replace(ForwardState::Finished(result));
            }
            .instrument(span),
        );
    }

    /// Forwards the session's chunks to the first hop of `hops` that works, failing over
    /// down the list. `Err` lists every hop skipped (even when a later one took the range),
    /// or what stopped the forwarder.
    async fn forward(
        &self,
        sess: &Arc<ShardSession>,
        mut hops: Vec<Hop>,
    ) -> Result<(), ForwardError> {
        let mut failures = Vec::new();
        let ended = |failures: Vec<HopFailure>| {
            if failures.is_empty() {
                Ok(())
            } else {
                Err(ForwardError { failures })
            }
        };
        while !hops.is_empty() {
            let hop = hops.remove(0);
            let mut result = self.forward_to(sess, &hop, &hops).await;
            if result.as_ref().is_err_and(ChainError::is_already_fed) {
                // Its upstream may have died a moment ago without it noticing yet: ask once
                // more. If it is still fed, the chain below goes on without us (we are a
                // bypassed host that came back): stop, and complete our own copy as a leaf.
                tokio::time::sleep(self.stall_timeout / 4).await;
                result = self.forward_to(sess, &hop, &hops).await;
                if let Err(e) = &result
                    && e.is_already_fed()
                {
                    warn!(peer = %hop.host, "bypassed while stopped or cut off; rejoining as a leaf: {e}");
                    sess.bypassed.send_replace(Some(hop.clone()));
                    failures.push(HopFailure::Bypassed {
                        host: hop.host.clone(),
                    });
                    return ended(failures);
                }
            }
            let e = match result {
                Ok(()) => return ended(failures),
                Err(e) => e,
            };
            if self.cancel.is_cancelled() {
                return ended(vec![HopFailure::ShuttingDown]);
            }
            // Our own copy cannot be completed or read: the downstream hop is not at
            // fault, so it is not skipped (its recovery monitor takes over).
            let local = sess.failed.borrow().clone();
            let local = match (local, e) {
                (Some(why), _) => Err(HopFailure::Local(why)),
                (None, e @ ChainError::Store(_)) => Err(HopFailure::LocalStore(Arc::new(e))),
                (None, e) => Ok(e),
            };
            let e = match local {
                Ok(e) => e,
                Err(local) => {
                    warn!(peer = %hop.host, "forwarding stopped by a local failure, not failing over: {local}");
                    failures.push(local);
                    return ended(failures);
                }
            };
            self.stats
                .downstream_failovers
                .fetch_add(1, Ordering::Relaxed);
            if e.is_stall() {
                self.stats.downstream_stalls.fetch_add(1, Ordering::Relaxed);
            }
            self.links.forget_path(sess.transport, &hop.addr, &e);
            warn!(peer = %hop.host, addr = %hop.addr, remaining = hops.len(), "downstream hop failed, failing over: {e}");
            sess.downstream_lost.send_modify(|n| *n += 1);
            failures.push(HopFailure::Hop {
                host: hop.host.clone(),
                addr: hop.addr.clone(),
                error: Arc::new(e),
            });
        }
        ended(failures)
    }

    async fn forward_to(
        &self,
        sess: &Arc<ShardSession>,
        hop: &Hop,
        rest: &[Hop],
    ) -> Result<(), ChainError> {
        // A hop that does not even accept within twice the stall timeout is stalled too
        // (a stopped host's kernel still completes the TCP handshake); one that does not
        // finish the TLS handshake and `Hello` within one (`open_downstream`) is, sooner.
        let setup = self.stall_timeout * 2;
        let (mut conn, acked) = tokio::time::timeout(setup, self.open_downstream(sess, hop, rest))
            .await
            .map_err(|_| ChainError::Timeout(setup))??;
        // From here on, a chunk write the downstream does not drain within the stall
        // timeout means it is stalled (its receive buffer is full and it reads nothing).
        conn.writer.set_write_timeout(Some(self.stall_timeout));
        info!(peer = %hop.host, already = acked.len(), "downstream accepted");
        let shard = sess.shard_index();
        let copy: &Shard = &sess.shard;
        let mut window = SendWindow::new(acked, self.window, now());
        let mut local = sess.shard.subscribe();
        let mut failed = sess.failed.subscribe();
        let mut relayed = sess.pieces.subscribe();
        // Pieces only to a peer that takes them (a host of protocol 6 in a rolling upgrade
        // gets whole chunks).
        let pieces = self.pieces && conn.peer_version >= PIECES_VERSION;
        // Chunks whose first pieces went ahead of them while they arrived here, and how
        // many: the rest follows once the chunk is whole.
        let mut sent_ahead: HashMap<u32, usize> = HashMap::new();
        loop {
            for repair in window.scan_dropped(copy) {
                self.request_repair(sess, repair);
            }
            while let Some(transmit) = window.poll_transmit(copy) {
                let (index, recheck) = match transmit {
                    Transmit::Done => {
                        conn.writer.send(&Frame::Done).await?;
                        window.note_sent(now());
                        continue;
                    }
                    Transmit::Chunk { index, recheck } => (index, recheck),
                };
                // Hash the next chunks (if they need it) while this one is read and sent.
                let ahead = index.saturating_add(1);
                sess.shard.check_ahead(
                    ahead..ahead.saturating_add(CHECK_AHEAD).min(sess.end),
                    Check::Send,
                );
                let why = if recheck { Check::Nack } else { Check::Send };
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
                // With `sendfile` on, the payload's place in the store's file, to send it from
                // there (plaintext TCP); not for a chunk corrupted in flight by fault injection.
                let mut file = self
                    .sendfile
                    .then(|| sess.shard.chunk_in_file(index).ok())
                    .flatten()
                    .map(|(file, offset)| FileRegion { file, offset });
                if self.faults.take(shard, index) {
                    warn!(chunk = index, "fault injection: corrupting chunk in flight");
                    data = corrupted(&data);
                    file = None;
                }
                // In pieces where its first ones went ahead, or where its pieces' CVs are
                // known here (not for a re-send after a `Nack`: whole, as simple as can be).
                let cvs = (pieces && !recheck)
                    .then(|| sess.shard.piece_cvs(index))
                    .flatten()
                    .filter(|cvs| cvs.len() == piece_count(data.len()));
                match (sent_ahead.remove(&index), cvs) {
                    (Some(from), _) => {
                        send_pieces(&mut conn, shard, index, &data, from, file.as_ref()).await?;
                    }
                    (None, Some(cvs)) => {
                        send_head(&mut conn, shard, index, &cvs).await?;
                        send_pieces(&mut conn, shard, index, &data, 0, file.as_ref()).await?;
                        self.stats
                            .chunks_sent_in_pieces
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    (None, None) => {
                        conn.writer
                            .send_chunk(shard, index, &data, file.as_ref())
                            .await?;
                    }
                }
                window.note_sent(now());
            }
            // Chunks still arriving here in pieces: their verified pieces go ahead.
            if pieces {
                self.send_ahead(&mut conn, sess, &mut window, &mut sent_ahead)
                    .await?;
            }
            if window.keepalive_due(now()) {
                // Nothing to send (our own upstream is slow or stalled): say we are alive.
                conn.writer.send(&Frame::Keepalive).await?;
                window.note_sent(now());
            }
            conn.writer.flush().await?;
            let deadline = window.poll_timeout();
            let keepalive = window.poll_keepalive();
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
                _ = relayed.changed(), if pieces && window.has_room() => continue,
                _ = failed.changed() => {
                    let why = sess.failed.borrow().clone();
                    if let Some(why) = why {
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
                () = sleep_until(keepalive) => continue,
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

    /// Sends ahead the verified pieces of chunks still arriving here in pieces (at most
    /// [`MAX_PIECING`] chunks at once, while the window has room): a chunk's `ChunkHead`
    /// first, then each piece not sent yet. `sent_ahead` keeps how many pieces of each went;
    /// a chunk whose last piece went is in flight from then on ([`SendWindow::sent_ahead`]).
    async fn send_ahead(
        &self,
        conn: &mut Conn,
        sess: &ShardSession,
        window: &mut SendWindow,
        sent_ahead: &mut HashMap<u32, usize>,
    ) -> Result<(), ChainError> {
        let shard = sess.shard_index();
        while window.has_room() {
            let next = sess.pieces.next(
                |i| {
                    window.unsent(i)
                        && !sess.shard.is_verified(i)
                        && (sent_ahead.contains_key(&i) || sent_ahead.len() < MAX_PIECING)
                },
                |i| sent_ahead.get(&i).copied().unwrap_or(0),
            );
            let Some(r) = next else { break };
            let from = match sent_ahead.get(&r.index) {
                Some(&from) => from,
                None => {
                    send_head(conn, shard, r.index, &r.cvs).await?;
                    self.stats
                        .chunks_sent_in_pieces
                        .fetch_add(1, Ordering::Relaxed);
                    0
                }
            };
            for (p, piece) in r.pieces.iter().enumerate().skip(from) {
                let mut piece = piece.clone();
                if p == 0 && self.faults.take(shard, r.index) {
                    warn!(
                        chunk = r.index,
                        "fault injection: corrupting a piece in flight"
                    );
                    piece = corrupted(&piece);
                }
                conn.writer
                    .send_piece(shard, r.index, p as u32, &piece, None)
                    .await?;
            }
            if r.pieces.len() == r.cvs.len() {
                // Down whole before our own copy: in flight from here on, answered
                // after its last piece like any chunk.
                sent_ahead.remove(&r.index);
                window.sent_ahead(r.index, now());
            } else {
                sent_ahead.insert(r.index, r.pieces.len());
                window.note_sent(now());
            }
        }
        Ok(())
    }

    /// Connects to `hop`, opens the session there and returns what its `Accept` says it
    /// holds.
    ///
    /// The TLS handshake and `Hello` take a live host milliseconds, so one that has not
    /// answered them within the stall timeout is taken as stalled: a hop that fails over
    /// past a stopped host (its kernel still completes the TCP handshake) loses one stall
    /// timeout there, not two. The `Open`'s answer may take longer (the receiver opens the
    /// shard in its store); the caller bounds the whole set-up.
    async fn open_downstream(
        &self,
        sess: &Arc<ShardSession>,
        hop: &Hop,
        rest: &[Hop],
    ) -> Result<(Conn, ChunkSet), ChainError> {
        let connect = self
            .links
            .connect(sess.transport, &hop.addr, Some(&hop.host));
        let (mut conn, remote) = tokio::time::timeout(self.stall_timeout, connect)
            .await
            .map_err(|_| ChainError::Timeout(self.stall_timeout))??;
        if remote != hop.host {
            return Err(ChainError::refused(
                ErrorCode::Refused,
                format!(
                    "{} answered as host {remote}, expected {}",
                    hop.addr, hop.host
                ),
            ));
        }
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
            upstream: sess.upstream_for(self.links.own_hop(), &hop.host),
            transport: sess.transport,
        };
        // The manifest follows the `Open` (protocol v6): the receiver reads it only once the
        // `Open`'s plan token checks out.
        conn.writer.send(&Frame::Open(header)).await?;
        conn.writer
            .send_now(&Frame::Manifest((*sess.manifest).clone()))
            .await?;
        match read_timeout(&mut conn, self.idle_timeout).await? {
            Frame::Accept { have } if have.range() == (sess.start..sess.end) => Ok((conn, have)),
            Frame::Accept { have } => Err(ChainError::protocol(format!(
                "Accept covers {:?}, expected {}..{}",
                have.range(),
                sess.start,
                sess.end
            ))),
            Frame::Error { code, message } => Err(ChainError::Remote { code, message }),
            other => Err(ChainError::protocol(format!(
                "expected Accept, got {:?}",
                other.ty()
            ))),
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
}

/// `data` with its first byte flipped (fault injection: a chunk or piece corrupted in
/// flight).
fn corrupted(data: &Bytes) -> Bytes {
    let mut bad = BytesMut::from(&data[..]);
    if let Some(b) = bad.first_mut() {
        *b ^= 0xff;
    }
    bad.freeze()
}

/// Announces chunk `index` in pieces with their CVs (`ChunkHead`).
async fn send_head(
    conn: &mut Conn,
    shard: u32,
    index: u32,
    cvs: &[PieceCv],
) -> Result<(), ChainError> {
    let head = Frame::ChunkHead {
        shard,
        index,
        cvs: cvs.to_vec(),
    };
    conn.writer.send(&head).await?;
    Ok(())
}

/// Sends pieces `from..` of chunk `index`, whose bytes are `data` (from `file`, where
/// given, at the chunk's place in the store's file), after its `ChunkHead`.
async fn send_pieces(
    conn: &mut Conn,
    shard: u32,
    index: u32,
    data: &Bytes,
    from: usize,
    file: Option<&FileRegion>,
) -> Result<(), ChainError> {
    for p in from..piece_count(data.len()) {
        let Some(span) = piece_span(data.len(), p as u32) else {
            break;
        };
        let region = file.map(|f| FileRegion {
            file: f.file.clone(),
            offset: f.offset + span.start as u64,
        });
        conn.writer
            .send_piece(shard, index, p as u32, &data.slice(span), region.as_ref())
            .await?;
    }
    Ok(())
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
    fn first_verified(&self, range: std::ops::Range<u32>, skip: &ChunkSet) -> Option<u32> {
        Self::first_verified(self, range, |i| skip.contains(i))
    }
}
