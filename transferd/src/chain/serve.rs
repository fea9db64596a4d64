//! The data port's connections: accepted (TCP and QUIC) and admitted against the
//! connection caps, then the TLS handshake and `Hello` in the connection's task, then an
//! upstream's `Open` (see `upstream`) or `Fetch` requests (the pull server). The daemon
//! runs the accept loops ([`Server::accept_tcp`], [`Server::accept_quic`]).
//!
//! [`Server`] is the role. It is given the peer links (the TLS handshake, `Hello`, framing),
//! the [`Receiver`] an `Open` is handed to, the store and a repair queue handle (for
//! `Fetch`: it reads verified chunks and queues the rotten ones for repair), the counters,
//! the shutdown token, the connection caps (QUIC streams are admitted here) and its part of
//! the tuning (handshake and idle timeouts, `sendfile`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardcast_identity::{Identity, Peer};
use shardcast_protocol::{ErrorCode, Frame, FrameType, HostId, ModelDigest};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use super::handshake::Links;
use super::upstream::Receiver;
use super::{CHECK_AHEAD, ChainConfig, ChainError, NodeStats};
use crate::limits::ConnLimits;
use crate::repair::{RepairHandle, RepairRequest};
use crate::store::{Check, ShardStore, StoreError};
use crate::transport::Quic;
use crate::transport::quic::QuicStream;
use crate::wire::Halves;
use crate::wire::{Conn, FileRegion};

/// Serves the data port's connections. See the module docs.
pub(crate) struct Server {
    links: Links,
    receiver: Arc<Receiver>,
    store: ShardStore,
    repairs: RepairHandle,
    stats: Arc<NodeStats>,
    cancel: CancellationToken,
    conn_limits: Arc<ConnLimits>,
    /// The longest a peer may take over the TLS handshake and `Hello`.
    handshake_timeout: Duration,
    /// A peer silent this long (between frames or mid-frame) is dropped.
    peer_idle_timeout: Duration,
    /// Send payloads from the store's files (plaintext TCP).
    sendfile: bool,
}

impl Server {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        links: Links,
        receiver: Arc<Receiver>,
        store: ShardStore,
        repairs: RepairHandle,
        stats: Arc<NodeStats>,
        cancel: CancellationToken,
        conn_limits: Arc<ConnLimits>,
        cfg: &ChainConfig,
    ) -> Self {
        Self {
            links,
            receiver,
            store,
            repairs,
            stats,
            cancel,
            conn_limits,
            handshake_timeout: cfg.limits.handshake_timeout,
            peer_idle_timeout: cfg.limits.peer_idle_timeout,
            sendfile: cfg.sendfile,
        }
    }

    /// Accepts TCP connections on the data port until `cancel`: each is admitted against
    /// the connection caps and served in its own task (the handshake happens inside it).
    pub(crate) async fn accept_tcp(
        self: Arc<Self>,
        listener: TcpListener,
        cancel: CancellationToken,
    ) {
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                accepted = self.links.transports().tcp.accept(&listener) => match accepted {
                    // Admit (connection caps), spawn; the handshake happens inside the task.
                    Ok((stream, peer)) => match crate::limits::admit(&self.conn_limits, &peer) {
                        Ok(permit) => {
                            let me = self.clone();
                            tokio::spawn(async move {
                                me.serve_connection(stream, peer).await;
                                drop(permit);
                            });
                        }
                        Err(e) => warn!(%peer, "refusing connection: {e}"),
                    },
                    Err(e) => {
                        warn!("accept failed: {e}");
                        // Out of file descriptors and the like: back off instead of spinning.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
    }

    /// Accepts QUIC connections until `cancel`: each is admitted against the connection
    /// caps like a TCP one, completes its handshake in its own task, then serves every
    /// stream the peer opens (one per session and shard) as a TCP connection is served.
    pub(crate) async fn accept_quic(self: Arc<Self>, quic: Arc<Quic>, cancel: CancellationToken) {
        loop {
            let incoming = tokio::select! {
                biased;
                _ = cancel.cancelled() => {
                    quic.close();
                    return;
                }
                i = quic.incoming() => match i {
                    Some(i) => i,
                    None => return,
                },
            };
            let peer = incoming.remote_address().to_string();
            let permit = match crate::limits::admit(&self.conn_limits, &peer) {
                Ok(p) => p,
                Err(e) => {
                    warn!(%peer, "refusing QUIC connection: {e}");
                    incoming.refuse();
                    continue;
                }
            };
            let (me, quic) = (self.clone(), quic.clone());
            tokio::spawn(async move {
                match quic.establish(incoming, me.handshake_timeout).await {
                    Ok((conn, id)) => me.serve_quic_connection(&quic, conn, id, peer).await,
                    Err(e) => {
                        me.stats.tls_refused.fetch_add(1, Ordering::Relaxed);
                        warn!(%peer, "refusing QUIC connection: {e}");
                    }
                }
                drop(permit);
            });
        }
    }

    /// Serves one accepted connection (an upstream hop or a puller) until it ends.
    /// Errors are answered with an `Error` frame and logged; they never affect other
    /// connections.
    /// The TLS handshake runs here, in the connection's task: a peer without a valid
    /// certificate is dropped before a single frame is read.
    async fn serve_connection(self: Arc<Self>, stream: TcpStream, peer: String) {
        let tcp = &self.links.transports().tcp;
        let (stream, identity) = match tcp.secure(stream).await {
            Ok(s) => s,
            Err(e) => {
                self.stats.tls_refused.fetch_add(1, Ordering::Relaxed);
                let why = crate::transport::explain(&e, tcp.data_mode());
                warn!(%peer, "refusing connection: {why}");
                return;
            }
        };
        self.serve_stream(stream, identity, peer).await;
    }

    /// Serves the streams a peer opens on an established QUIC connection, each in its own
    /// task like an accepted TCP connection (and admitted against the same caps), until the
    /// connection closes or the daemon stops.
    async fn serve_quic_connection(
        self: Arc<Self>,
        quic: &Quic,
        conn: quinn::Connection,
        identity: Identity,
        peer: String,
    ) {
        loop {
            let (send, recv) = tokio::select! {
                _ = self.cancel.cancelled() => return,
                s = conn.accept_bi() => match s {
                    Ok(s) => s,
                    Err(e) => {
                        debug!(%peer, "QUIC connection ended: {e}");
                        return;
                    }
                },
            };
            quic.stats.streams_accepted.fetch_add(1, Ordering::Relaxed);
            let permit = match crate::limits::admit(&self.conn_limits, &peer) {
                Ok(p) => p,
                Err(e) => {
                    // Dropping the halves resets the stream; the peer sees the refusal.
                    warn!(%peer, "refusing QUIC stream: {e}");
                    continue;
                }
            };
            let (me, identity, peer) = (self.clone(), identity.clone(), peer.clone());
            tokio::spawn(async move {
                let stream = QuicStream::new(send, recv).into();
                me.serve_stream(stream, Peer::Cert(identity), peer).await;
                drop(permit);
            });
        }
    }

    /// Serves one authenticated stream (a TCP connection after its TLS handshake, or a
    /// QUIC stream): the `Hello` exchange, then an upstream's `Open` or `Fetch` requests.
    async fn serve_stream(self: Arc<Self>, stream: Halves, identity: Peer, peer: String) {
        let span = info_span!("conn", %peer, host = tracing::field::Empty);
        let mut conn = self
            .links
            .conn(stream, &super::handshake::budget_key(&identity, &peer));
        let result = async {
            let limit = self.handshake_timeout;
            let handshake = self.links.handshake(&mut conn, &identity);
            let remote = match tokio::time::timeout(limit, handshake).await {
                Ok(r) => r?,
                Err(_) => {
                    self.links
                        .counters()
                        .handshake_timeouts
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(ChainError::Timeout(limit));
                }
            };
            tracing::Span::current().record("host", remote.as_str());
            // From here a silent peer (between frames or mid-frame) is dropped, and the only
            // large frame it may send before its plan token is checked is the `Open`.
            conn.reader.set_idle_timeout(Some(self.peer_idle_timeout));
            conn.reader.admit_large(Some(&[FrameType::Open]));
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

    async fn serve_requests(&self, conn: &mut Conn, remote: &HostId) -> Result<(), ChainError> {
        loop {
            let Some(frame) = conn.reader.read().await? else {
                return Ok(());
            };
            match frame {
                Frame::Open(header) => {
                    // The session's manifest follows its `Open`; it may be large, so it is
                    // read only once the plan token is checked, and chunks only once the
                    // session is joined.
                    let claims = self.receiver.authorize_open(&header, remote)?;
                    conn.reader.admit_large(Some(&[FrameType::Manifest]));
                    let offered = match conn.reader.read().await? {
                        Some(Frame::Manifest(m)) => m,
                        Some(Frame::Error { code, message }) => {
                            return Err(ChainError::Remote { code, message });
                        }
                        Some(other) => {
                            return Err(ChainError::protocol(format!(
                                "expected the session's Manifest after Open, got {:?}",
                                other.ty()
                            )));
                        }
                        None => return Ok(()),
                    };
                    let sess =
                        self.receiver
                            .join_session(&header, claims, Some(offered), remote)?;
                    conn.reader
                        .admit_large(Some(&[FrameType::Chunk, FrameType::Piece]));
                    return self.receiver.handle_upstream(conn, sess, remote).await;
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
                        "expected Open or Fetch, got {:?}",
                        other.ty()
                    )));
                }
            }
        }
    }

    /// Answers a `Fetch` with every requested chunk held verified here, then `Done` — or,
    /// where this copy lacks some of the span and no session here receives the shard (a copy
    /// left by a restart, a failed or ended session), `Error{NotReceiving}`: the puller
    /// learns at once that asking again brings nothing and goes to its next source, where
    /// it used to pull a few more times to find out (PROTOCOL.md §10).
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
                let file = self
                    .sendfile
                    .then(|| local.chunk_in_file(index).ok())
                    .flatten()
                    .map(|(file, offset)| FileRegion { file, offset });
                conn.writer
                    .send_chunk(shard, index, &data, file.as_ref())
                    .await?;
            } else if local.is_dropped(index) {
                // Dropped by a check ahead: repaired in the background like the one above.
                self.repairs
                    .request(RepairRequest::new(local.clone(), vec![index]));
            }
        }
        let lacking = (start..end).filter(|&i| !local.is_verified(i)).count();
        if lacking > 0 && !self.receiver.receives(&model, shard) {
            self.stats
                .fetches_not_receiving
                .fetch_add(1, Ordering::Relaxed);
            debug!(%model, shard, lacking, "answered a Fetch in part; receiving none of the rest");
            conn.writer
                .send_now(&Frame::error(
                    ErrorCode::NotReceiving,
                    format!(
                        "this host lacks {lacking} chunk(s) of shard {shard} {start}..{end} and receives none of them"
                    ),
                ))
                .await?;
            return Ok(());
        }
        conn.writer.send_now(&Frame::Done).await?;
        Ok(())
    }
}
