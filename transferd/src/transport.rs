//! Transports: how a hop reaches the next one. The chain logic only sees a
//! [`BoxStream`] and the [`Peer`] behind it; QUIC will be another variant here.
//!
//! - [`Transport::Tls`] (the default in every configuration): TCP with mutual TLS 1.3 under
//!   the cluster CA. A peer without a valid certificate with the `host` role is refused in
//!   the handshake, before any frame is parsed; the `Hello` host id must then equal the
//!   certificate's name (checked in `chain`), and an outgoing hop must present the host id
//!   the plan names.
//! - [`Transport::InsecureTcp`]: plaintext, only behind `insecure_plaintext = true` on
//!   loopback listeners (benchmarks and quick experiments); peers are [`Peer::Insecure`].

use std::sync::Arc;
use std::time::Duration;

use shardcast_identity::{Alpn, Expect, Identity, Peer, Role, TlsContext};
use shardcast_protocol::HostId;
use tokio::net::{TcpListener, TcpStream};

use crate::wire::BoxStream;

/// How long to wait for a downstream hop to accept a connection before failing over.
/// Rationale: a live transferd on a datacenter network answers a SYN in well under a
/// second; a dead host should not stall the chain for the OS default (minutes).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The byte-stream transport used between hops.
#[derive(Debug, Clone)]
pub enum Transport {
    /// TCP with `TCP_NODELAY` and mutual TLS under the cluster CA.
    Tls(Arc<TlsContext>),
    /// Plain TCP, no authentication (`insecure_plaintext`, loopback only).
    InsecureTcp,
}

impl Transport {
    /// Connects to `addr` (`host:port`). With TLS the server must be a `host`, and exactly
    /// `expect` when the caller knows whom it is reaching.
    pub async fn connect(
        &self,
        addr: &str,
        expect: Option<&HostId>,
    ) -> std::io::Result<(BoxStream, Peer)> {
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("connect to {addr} timed out after {CONNECT_TIMEOUT:?}"),
                )
            })??;
        stream.set_nodelay(true)?;
        match self {
            Self::InsecureTcp => Ok((Box::new(stream), Peer::Insecure)),
            Self::Tls(ctx) => {
                let expect = match expect {
                    Some(h) => Expect::Exactly(
                        Identity::new(Role::Host, h.as_str()).map_err(std::io::Error::other)?,
                    ),
                    None => Expect::Role(Role::Host),
                };
                let (s, id) = ctx
                    .connect(stream, Alpn::Data, &expect)
                    .await
                    .map_err(|e| {
                        std::io::Error::new(
                            std::io::ErrorKind::PermissionDenied,
                            format!("{addr}: {e}"),
                        )
                    })?;
                Ok((Box::new(s), Peer::Cert(id)))
            }
        }
    }

    /// Accepts the next TCP connection on a listener; the caller runs [`Self::secure`]
    /// in the connection's own task (the accept loop never waits on a handshake).
    pub async fn accept(&self, listener: &TcpListener) -> std::io::Result<(TcpStream, String)> {
        let (stream, peer) = listener.accept().await?;
        stream.set_nodelay(true)?;
        Ok((stream, peer.to_string()))
    }

    /// Server side of the handshake on an accepted connection.
    pub async fn secure(
        &self,
        stream: TcpStream,
    ) -> Result<(BoxStream, Peer), shardcast_identity::TlsError> {
        match self {
            Self::InsecureTcp => Ok((Box::new(stream), Peer::Insecure)),
            Self::Tls(ctx) => {
                let (s, id) = ctx.accept(stream, Alpn::Data).await?;
                Ok((Box::new(s), Peer::Cert(id)))
            }
        }
    }

    /// The TLS context, when there is one.
    pub fn tls(&self) -> Option<&Arc<TlsContext>> {
        match self {
            Self::Tls(c) => Some(c),
            Self::InsecureTcp => None,
        }
    }
}
