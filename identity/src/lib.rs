//! Cluster identity for shardcast: who a peer is, proven by a certificate of the cluster
//! CA, and what it may do.
//!
//! - [`role`]: [`Role`]s (`host`, `controller`, `admin`, `platform`, `read`), the
//!   [`Identity`] a certificate names (`shardcast://role/name`), the [`Permission`] each
//!   operation needs, and the [`Peer`] kinds a listener sees.
//! - [`pki`]: a small CA for quick starts and tests (`shardcast certs init|issue|rotate`).
//! - [`tls`]: mutual TLS configurations from PEM files, reloaded when they change; the
//!   ALPNs of the data port, including the authenticate-only mode's.
//! - [`expiry`]: the certificate's and the CA bundle's `notAfter`, warned about ahead of
//!   time (logged at start, on reload and when it comes close; gauged by the daemons).
//! - [`records`]: `tls`-mode data connections after the handshake: TLS 1.3 application-data
//!   records read and written here with the keys taken from rustls, decrypted in place,
//!   each direction on its own socket half.
//! - [`lowat`]: a data connection's receive low-water mark (`SO_RCVLOWAT`), set by a reader
//!   that asks only for bytes the peer is bound to send, so that a frame's body wakes it
//!   once instead of every few segments.
//! - [`grpc`]: authenticated listeners (TCP + TLS, Unix sockets) and clients for tonic and
//!   axum, the per-method authorisation layer, and the limits on connections per peer and
//!   handshakes per address.
//! - [`http`]: HTTP/1.1 APIs over those listeners (the controller's JSON API, transferd's
//!   admin endpoint): per-route authorisation with certificates or bearer tokens, and
//!   timeouts for clients that stall.
//! - [`token`]: bearer tokens for HTTP clients.
//! - [`plan`]: plan tokens, the controller's signature over a chain's model, hosts and
//!   expiry, checked by every hop.
//! - [`failover`]: one gRPC channel over several controller replicas that follows the
//!   leader (the CLI and transferd's heartbeats).
//! - [`process`]: the process shell both daemons share: logging, the TLS identity or the
//!   insecure mode, the open-file limit, the shutdown signal.
//! - [`otlp`]: the `otlp_endpoint` setting (loopback `http://` only) and, with the `otlp`
//!   feature, the daemons' spans exported as OTLP traces.
//! - [`ready`]: a daemon's readiness (named conditions, drain on shutdown) behind
//!   `/readyz`, `grpc.health.v1` and the `shardcast_ready` gauge.
//!
//! Sockets and files only: no shardcast protocol logic lives here.
//!
//! Goals: every connection authenticated, identity from certificates only, one table of
//! method → permission per API, no plaintext unless the operator asked for it loudly on
//! loopback. Non-goals: revocation lists (short-lived certificates and rotation instead),
//! external identity providers.

pub mod expiry;
pub mod failover;
pub mod grpc;
pub mod http;
pub mod lowat;
pub mod otlp;
pub mod pki;
pub mod plan;
pub mod process;
pub mod ready;
pub mod records;
pub mod role;
pub mod tls;
pub mod token;

pub use role::{Denied, Identity, IdentityError, Peer, Permission, Role};
pub use tls::{Alpn, DataConn, Expect, TlsContext, TlsError, TlsFiles};

/// Whether a plaintext listener on `addr` is acceptable under the insecure setting: only
/// loopback addresses are.
pub fn plaintext_allowed(addr: &std::net::SocketAddr) -> bool {
    addr.ip().is_loopback()
}
