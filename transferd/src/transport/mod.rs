//! Transports: how a hop reaches the next one. The chain logic only sees a stream's
//! [`Halves`] and the [`Peer`] behind it, whichever variant carried it (plaintext TCP as
//! `Halves::tcp`, owned halves, so its sink can `sendfile`).
//!
//! - [`Transport::Tls`] (the default in every configuration): TCP with mutual TLS 1.3 under
//!   the cluster CA. A peer without a valid certificate with the `host` role is refused in
//!   the handshake, before any frame is parsed; the `Hello` host id must then equal the
//!   certificate's name (checked in `chain`), and an outgoing hop must present the host id
//!   the plan names. TCP with `TCP_NODELAY` and a connect timeout. It carries the host's
//!   [`DataMode`]: `tls`, or `authenticate-only` (`connect_clear` / `accept_clear`: the same
//!   mutual handshake, then the bare socket, so payloads may go by `sendfile`); [`explain`]
//!   turns a data-mode mismatch into an error naming `data_mode`. The server handshake runs
//!   in the connection's task.
//! - [`Transport::InsecureTcp`]: plaintext, only behind `insecure_plaintext = true` on
//!   loopback listeners (benchmarks and quick experiments); peers are [`Peer::Insecure`].
//! - [`Transport::Quic`] ([`quic`]): QUIC over UDP on the data port's number, with the same
//!   certificates and checks as TLS; one connection per pair of hosts, a stream per session
//!   and shard. It needs the TLS identity, so a daemon with `insecure_plaintext` has none.
//!
//! A host listens on every transport it has ([`Transports`]); each session's `Open` says
//! which one its hops dial ([`HopTransport`], chosen per cluster by the controller and
//! overridable per plan).
//!
//! Copies on the TLS receive path (issue #28): after the handshake both ends of a `tls`-mode
//! hop take the traffic keys over from rustls and read and write the TLS 1.3 records
//! themselves ([`shardcast_identity::records`], negotiated as ALPN `shardcast-rec/1`, with
//! `shardcast/1` and rustls's own stream as the fallback for a host without it). The
//! kernel copies the socket straight into the frame's body buffer (up to 256 KiB a read,
//! `crate::wire`), and each record is decrypted where it landed, its plaintext moved down
//! behind the previous record's in the same AEAD pass: with BLAKE3 and the store's write,
//! 2 copies and 2 passes per byte on a TLS receiver, as many copies as plaintext. rustls's
//! own stream made 5 copies (a 64 KiB read buffer in front of it, because it reads 4 KiB
//! per call; its record buffer; its plaintext buffer; the frame). A TLS sender makes 2
//! copies and 1 pass (a record buffer, AES-GCM, the kernel's copy), plaintext 1 (none with
//! `sendfile`).

use std::sync::Arc;
use std::time::Duration;

use shardcast_identity::{Expect, Identity, Peer, Role, TlsContext};
use shardcast_protocol::{HopTransport, HostId};
use tokio::net::{TcpListener, TcpStream};

use crate::wire::{BoxStream, Halves};

pub mod quic;

pub use quic::Quic;

/// How long to wait for a downstream hop to accept a connection before failing over.
/// Rationale: a live transferd on a datacenter network answers a SYN in well under a
/// second; a dead host should not stall the chain for the OS default (minutes).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The halves of a `tls`-mode data connection: the record layer's own halves (no lock
/// between them), or rustls's stream split behind tokio's lock for a peer without it.
fn data_halves(conn: shardcast_identity::DataConn) -> Halves {
    match conn {
        shardcast_identity::DataConn::Records(mut read, write) => {
            // The frame reader never asks for more than the rest of the frame it is in.
            read.wake_in_batches();
            Halves {
                read,
                write: Box::new(write),
            }
        }
        shardcast_identity::DataConn::Rustls(s) => Halves::from(Box::new(s) as BoxStream),
    }
}

/// A TCP connection to `addr` with `TCP_NODELAY`, within [`CONNECT_TIMEOUT`].
async fn tcp_connect(addr: &str) -> std::io::Result<TcpStream> {
    shardcast_identity::grpc::tcp_connect(addr, CONNECT_TIMEOUT).await
}

/// Whom a dialled data port must be: a `host`, exactly `expect` when the caller knows
/// whom it is reaching (the plan's hop). Both TLS and QUIC check the server against it.
fn expect_host(expect: Option<&HostId>) -> std::io::Result<Expect> {
    Ok(match expect {
        Some(h) => {
            Expect::Exactly(Identity::new(Role::Host, h.as_str()).map_err(std::io::Error::other)?)
        }
        None => Expect::Role(Role::Host),
    })
}

/// How a host's TCP data port protects what crosses it (`data_mode`). Both ends of a hop
/// must agree: each mode has its own ALPN protocol, so a mismatch fails the handshake with
/// [`shardcast_identity::TlsError::AlpnMismatch`] on both sides.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Deserialize,
    serde::Serialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum DataMode {
    /// Mutual TLS; every byte encrypted (the default).
    #[default]
    Tls,
    /// The mutual-TLS handshake authenticates both ends, then the connection carries frames
    /// unencrypted (and chunk payloads by `sendfile` where enabled); every chunk is still
    /// verified against the manifest. For trusted fabrics (docs/SECURITY.md).
    AuthenticateOnly,
}

impl DataMode {
    /// The mode's name as configured and reported.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tls => "tls",
            Self::AuthenticateOnly => "authenticate-only",
        }
    }
}

impl std::fmt::Display for DataMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The byte-stream transport used between hops.
#[derive(Debug, Clone)]
pub enum Transport {
    /// TCP with `TCP_NODELAY` and mutual TLS under the cluster CA; in
    /// [`DataMode::AuthenticateOnly`] only the handshake is TLS, the connection continues
    /// as plain TCP.
    Tls(Arc<TlsContext>, DataMode),
    /// Plain TCP, no authentication (`insecure_plaintext`, loopback only).
    InsecureTcp,
    /// QUIC with mutual TLS 1.3 under the cluster CA.
    Quic(Arc<Quic>),
}

/// The transports a host has: TCP always, QUIC when its endpoint is bound.
#[derive(Debug, Clone)]
pub struct Transports {
    /// TCP, with TLS unless `insecure_plaintext`.
    pub tcp: Transport,
    /// QUIC ([`Transport::Quic`]), `None` when off (`quic = false`, or no TLS identity).
    pub quic: Option<Transport>,
}

impl Transports {
    /// The transport a session's hops dial with.
    pub fn get(&self, kind: HopTransport) -> std::io::Result<&Transport> {
        match kind {
            HopTransport::Tcp => Ok(&self.tcp),
            HopTransport::Quic => self.quic.as_ref().ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    "the session asks for QUIC, but this host has no QUIC endpoint (quic = false, or insecure_plaintext)",
                )
            }),
        }
    }

    /// The QUIC endpoint, when there is one.
    pub fn quic(&self) -> Option<&Arc<Quic>> {
        match &self.quic {
            Some(Transport::Quic(q)) => Some(q),
            _ => None,
        }
    }

    /// The TLS context, when there is one.
    pub fn tls(&self) -> Option<&Arc<TlsContext>> {
        self.tcp.tls()
    }

    /// How the TCP data port protects payloads, as status and metrics name it: the
    /// [`DataMode`], or `insecure-plaintext` without TLS.
    pub fn data_mode_name(&self) -> &'static str {
        match &self.tcp {
            Transport::InsecureTcp => "insecure-plaintext",
            t => t.data_mode().as_str(),
        }
    }
}

impl Transport {
    /// Connects to `addr` (`host:port`). With TLS the server must be a `host`, and exactly
    /// `expect` when the caller knows whom it is reaching.
    pub async fn connect(
        &self,
        addr: &str,
        expect: Option<&HostId>,
    ) -> std::io::Result<(Halves, Peer)> {
        match self {
            Self::Quic(q) => q.connect(addr, expect).await.map(|(s, p)| (s.into(), p)),
            Self::InsecureTcp => Ok((Halves::tcp(tcp_connect(addr).await?), Peer::Insecure)),
            Self::Tls(ctx, mode) => {
                let expect = expect_host(expect)?;
                let tcp = tcp_connect(addr).await?;
                let refused = |e: shardcast_identity::TlsError| {
                    std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        format!("{addr}: {}", explain(&e, *mode)),
                    )
                };
                match mode {
                    DataMode::AuthenticateOnly => {
                        let (tcp, id) = ctx.connect_clear(tcp, &expect).await.map_err(refused)?;
                        Ok((Halves::tcp(tcp), Peer::Cert(id)))
                    }
                    DataMode::Tls => {
                        let (conn, id) = ctx.connect_data(tcp, &expect).await.map_err(refused)?;
                        Ok((data_halves(conn), Peer::Cert(id)))
                    }
                }
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
    ) -> Result<(Halves, Peer), shardcast_identity::TlsError> {
        match self {
            Self::InsecureTcp => Ok((Halves::tcp(stream), Peer::Insecure)),
            Self::Tls(ctx, DataMode::AuthenticateOnly) => {
                let (tcp, id) = ctx.accept_clear(stream).await?;
                Ok((Halves::tcp(tcp), Peer::Cert(id)))
            }
            Self::Tls(ctx, DataMode::Tls) => {
                let (conn, id) = ctx.accept_data(stream).await?;
                Ok((data_halves(conn), Peer::Cert(id)))
            }
            Self::Quic(_) => Err(shardcast_identity::TlsError::Handshake(
                std::io::Error::other("a TCP connection reached the QUIC transport"),
            )),
        }
    }

    /// The data mode of TCP hops (`Tls` for QUIC, which always encrypts; meaningless
    /// without TLS).
    pub fn data_mode(&self) -> DataMode {
        match self {
            Self::Tls(_, m) => *m,
            Self::InsecureTcp | Self::Quic(_) => DataMode::Tls,
        }
    }

    /// The TLS context, when there is one.
    pub fn tls(&self) -> Option<&Arc<TlsContext>> {
        match self {
            Self::Tls(c, _) => Some(c),
            Self::InsecureTcp | Self::Quic(_) => None,
        }
    }
}

/// A handshake failure in words an operator can act on: a data-mode mismatch names both
/// modes and the setting.
pub fn explain(e: &shardcast_identity::TlsError, ours: DataMode) -> String {
    match e {
        shardcast_identity::TlsError::AlpnMismatch { .. } => format!(
            "the two ends of this hop use different data modes (this host: data_mode = {ours}; \
             the peer's is the other one): set the same data_mode on every host"
        ),
        other => other.to_string(),
    }
}
