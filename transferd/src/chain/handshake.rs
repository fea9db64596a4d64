//! Connections between hops ([`Links`]): connecting to a hop's data port (over the
//! session's transport) and the `Hello` exchange, bound to the host id of the peer's
//! certificate.
//!
//! [`Links`] is the handle every role that talks to a peer is given: this host's id and
//! data address, the transports, the daemon-wide rate limits, the wire's byte counters and
//! the frame budget. It frames streams into [`Conn`]s; it holds no session.
//!
//! A QUIC `Hello` that fails on a held connection is retried once on a new one (the old
//! connection is forgotten: `forget_path`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardcast_identity::{Peer, Role};
use shardcast_protocol::{
    ErrorCode, Frame, Hop, HopTransport, HostId, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use tracing::debug;

use super::{ChainError, NodeStats, read_timeout};
use crate::throttle::RateLimiter;
use crate::transport::{Transport, Transports};
use crate::wire::Halves;
use crate::wire::{ByteCounters, Conn, FrameBudget, WireError};

/// Whose share of the frame budget a connection's large frames draw on: the peer's
/// certificate identity, or its address on a plaintext (loopback-only) connection.
pub(super) fn budget_key(peer: &Peer, addr: &str) -> String {
    match peer {
        Peer::Cert(id) => id.to_string(),
        other => format!("{other} {addr}"),
    }
}

/// How this host reaches peers and frames their streams. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Links {
    /// This host's id (named in our `Hello` and `Progress`).
    host: HostId,
    /// This host's data address as peers reach it (`None`: unknown, so no hop below is
    /// told to recover from this one).
    advertised: Option<String>,
    transports: Transports,
    ingress: RateLimiter,
    egress: RateLimiter,
    counters: Arc<ByteCounters>,
    frame_budget: Arc<FrameBudget>,
    /// For `identity_mismatch` only.
    stats: Arc<NodeStats>,
    /// `limits.write_timeout`: the longest wait for a write to drain.
    write_timeout: Duration,
    /// The longest wait for the peer's `Hello`.
    idle_timeout: Duration,
    /// Hash chunk payloads as they arrive (`ChainConfig::hash_on_read`).
    hash_on_read: bool,
}

impl Links {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        (host, advertised): (HostId, Option<String>),
        transports: Transports,
        (ingress, egress): (RateLimiter, RateLimiter),
        counters: Arc<ByteCounters>,
        frame_budget: Arc<FrameBudget>,
        stats: Arc<NodeStats>,
        write_timeout: Duration,
        idle_timeout: Duration,
    ) -> Self {
        Self {
            host,
            advertised,
            transports,
            ingress,
            egress,
            counters,
            frame_budget,
            stats,
            write_timeout,
            idle_timeout,
            hash_on_read: false,
        }
    }

    /// This host's id.
    pub(crate) fn host(&self) -> &HostId {
        &self.host
    }

    /// The transports (TCP, and QUIC when bound).
    pub(crate) fn transports(&self) -> &Transports {
        &self.transports
    }

    /// The wire's byte counters.
    pub(crate) fn counters(&self) -> &Arc<ByteCounters> {
        &self.counters
    }

    /// This host as a hop, when its data address is known.
    pub(super) fn own_hop(&self) -> Option<Hop> {
        self.advertised.as_ref().map(|addr| Hop {
            host: self.host.clone(),
            addr: addr.clone(),
        })
    }

    /// Connects to a hop's data port over `kind` and exchanges `Hello`s; with TLS or QUIC
    /// the peer must be a `host` (exactly `expect` when given). Returns the connection and
    /// the host id the peer's `Hello` named (its certificate's).
    pub(super) async fn connect(
        &self,
        kind: HopTransport,
        addr: &str,
        expect: Option<&HostId>,
    ) -> Result<(Conn, HostId), ChainError> {
        let transport = self.transports.get(kind).map_err(WireError::Io)?;
        // A QUIC stream may ride on a held connection whose peer restarted: its `Hello`
        // then fails at once (the stateless reset); one more try dials anew.
        let tries = if matches!(transport, Transport::Quic(_)) {
            2
        } else {
            1
        };
        let mut attempt = 1;
        loop {
            let (stream, peer) = transport
                .connect(addr, expect)
                .await
                .map_err(WireError::Io)?;
            let mut conn = self.conn(stream, &budget_key(&peer, addr));
            match self.handshake(&mut conn, &peer).await {
                Ok(host) => return Ok((conn, host)),
                Err(e) => {
                    self.forget_path(kind, addr, &e);
                    if attempt == tries || !e.is_path_fault() {
                        return Err(e);
                    }
                    debug!(%addr, "Hello over a held QUIC connection failed ({e}); dialling anew");
                    attempt += 1;
                }
            }
        }
    }

    /// After a session's stream to `addr` failed with `e`: when the path itself failed
    /// (silence, a broken stream) rather than the peer refusing, the QUIC connection held to
    /// it is closed, so the next session dials anew instead of reusing a connection to a
    /// peer that died or restarted behind the same address. TCP holds nothing between
    /// sessions.
    pub(super) fn forget_path(&self, kind: HopTransport, addr: &str, e: &ChainError) {
        if e.is_path_fault()
            && let Ok(Transport::Quic(q)) = self.transports.get(kind)
        {
            q.forget(addr);
        }
    }

    /// Whether the streams it frames hash chunk payloads as they arrive
    /// ([`crate::wire::FrameReader::hash_chunks`]); off unless turned on here.
    pub(super) fn with_hash_on_read(mut self, on: bool) -> Self {
        self.hash_on_read = on;
        self
    }

    /// Frames a stream to or from the peer whose share of the frame budget is
    /// `budget_key` ([`budget_key`]).
    pub(super) fn conn(&self, stream: impl Into<Halves>, budget_key: &str) -> Conn {
        let mut conn = Conn::new(
            stream.into(),
            self.ingress.clone(),
            self.egress.clone(),
            self.counters.clone(),
            self.frame_budget.clone(),
        );
        conn.reader.set_peer(budget_key);
        conn.reader.hash_chunks(self.hash_on_read);
        conn.writer.set_write_timeout(Some(self.write_timeout));
        conn
    }

    /// Sends our `Hello` and reads the peer's; refuses other protocol versions, and a
    /// `Hello` whose host id is not the one the peer's certificate names.
    pub(super) async fn handshake(
        &self,
        conn: &mut Conn,
        peer: &Peer,
    ) -> Result<HostId, ChainError> {
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
        let timeout = self.idle_timeout;
        match read_timeout(conn, timeout).await? {
            Frame::Hello { version, host }
                if (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) =>
            {
                conn.peer_version = version;
                Ok(host)
            }
            Frame::Hello { version, .. } => Err(ChainError::refused(
                ErrorCode::UnsupportedVersion,
                format!(
                    "peer speaks protocol version {version}; this host speaks {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
                ),
            )),
            Frame::Error { code, message } => Err(ChainError::Remote { code, message }),
            other => Err(ChainError::protocol(format!(
                "expected Hello, got {:?}",
                other.ty()
            ))),
        }
    }
}
