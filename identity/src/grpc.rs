//! Authenticated listeners and clients for the gRPC (and HTTP) APIs.
//!
//! Servers: [`incoming_tcp`] and [`incoming_unix`] turn a listener into a stream of
//! connections, each carrying a [`PeerInfo`] (tonic puts it into every request's
//! extensions, axum hands it to `ConnectInfo`). The accept loop never waits for a
//! handshake: each runs in its own task under a timeout. [`AuthzLayer`] then checks every
//! call against a table of method → [`Permission`] in one place, and answers
//! `UNAUTHENTICATED` / `PERMISSION_DENIED` with a message naming who lacked what.
//!
//! Clients: [`lazy`] and [`connect`] build a tonic channel that connects over TLS (checking the
//! server's identity), a Unix socket, or plaintext where that was allowed.
//!
//! Limits: at most [`MAX_PENDING_HANDSHAKES`] handshakes in flight per listener and
//! [`MAX_PENDING_HANDSHAKES_PER_ADDR`] per source address other than loopback; each
//! [`AuthedIo`] holds its peer's place, at most [`MAX_CONNECTIONS_PER_PEER`] connections per
//! identity (or per address without one); [`SERVER_KEEPALIVE`] for the servers' HTTP/2
//! pings. [`bind_unix`] takes a [`SocketAccess`] (0600, or 0660 for a group whose members
//! are read-only `LocalGroup` peers). [`authorize`] is the one check for both APIs (counted
//! in [`AuthzStats`] by role, logged with the identity); [`GateLayer`] runs a check before
//! every call, and [`AuthzLayer`] is its gRPC gate over a method → permission table
//! ([`MethodAuthz`]).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio::sync::mpsc;
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint, Uri};
use tracing::{debug, warn};

use crate::role::{Peer, Permission, Role};
use crate::tls::{Alpn, Expect, TlsContext};

/// Time allowed to establish an outgoing connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// A TCP connect that has had no answer for this long is joined by another attempt.
/// Rationale: Linux sends a lost SYN again after 1 s and then 2 s more, so one lost SYN (or
/// SYN-ACK) made a connect take 1 s and two took 3 s, past the 2 s a forwarder gives a new
/// hop, which was then skipped as dead although it was alive (the emulated cluster at 10 %
/// loss, docs/BENCHMARKS.md). Hosts of one cluster answer a SYN within a millisecond;
/// 250 ms is RFC 8305's connection attempt delay.
pub const CONNECT_ATTEMPT_DELAY: Duration = Duration::from_millis(250);
/// Connection attempts at most, [`CONNECT_ATTEMPT_DELAY`] apart (new SYNs at 0, 250 and
/// 500 ms, each retransmitted by the kernel as usual).
pub const CONNECT_ATTEMPTS: usize = 3;
/// Handshakes in progress per listener; beyond it new connections wait in the kernel's
/// backlog. Rationale: bounds the tasks and memory a connection flood can pin.
pub const MAX_PENDING_HANDSHAKES: usize = 256;
/// Handshakes in progress from one source address per listener; a connection beyond it is
/// closed at once, before its handshake (counted: `TlsStats::handshakes_over_addr_limit`).
/// Rationale: a peer holding many unfinished handshakes takes at most this many of the
/// listener's [`MAX_PENDING_HANDSHAKES`], so the cluster's own connections from other
/// addresses are not queued behind it. `127.0.0.1` and `::1` are exempt (local tooling and
/// test swarms connect from there by the thousand; a local attacker has other means).
pub const MAX_PENDING_HANDSHAKES_PER_ADDR: usize = 32;

/// How often a gRPC server pings each client connection (HTTP/2 `PING`), and how long it
/// waits for the answer before closing it: a peer that died, was stopped or was cut off
/// gives its connection and descriptor back within 40 s instead of holding it until the
/// kernel's TCP keep-alive (hours).
pub const SERVER_KEEPALIVE: (Duration, Duration) =
    (Duration::from_secs(30), Duration::from_secs(10));
/// Connections one peer may hold open on one listener at once: an authenticated identity
/// (a certificate's role and name), or, for a TLS peer that presented none (an HTTP client
/// that sends a bearer token per request), its source address. A connection beyond it is
/// closed right after its handshake and counted (`TlsStats::over_peer_limit`). Rationale: a
/// cluster member needs a handful (the controller holds one channel per agent, a host one
/// to the controller, a CLI one per command), so one compromised host's idle connections
/// cannot take the descriptors every other host's calls need.
pub const MAX_CONNECTIONS_PER_PEER: usize = 64;

/// The open connections of each peer on one listener (see [`MAX_CONNECTIONS_PER_PEER`]).
#[derive(Clone, Default)]
struct PeerLimits(Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>);

/// One connection's place in its peer's count; given back when the connection closes.
struct PeerSlot {
    limits: PeerLimits,
    key: String,
}

impl PeerLimits {
    /// A place for one more connection of `key`, unless it holds `max` already.
    fn take(&self, key: String, max: usize) -> Option<PeerSlot> {
        let mut m = self.0.lock().ok()?;
        let n = m.entry(key.clone()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        drop(m);
        Some(PeerSlot {
            limits: self.clone(),
            key,
        })
    }

    /// Connections `key` holds.
    #[cfg(test)]
    fn held(&self, key: &str) -> usize {
        self.0
            .lock()
            .map_or(0, |m| m.get(key).copied().unwrap_or(0))
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        if let Ok(mut m) = self.limits.0.lock()
            && let Some(n) = m.get_mut(&self.key)
        {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.key);
            }
        }
    }
}

/// `127.0.0.1` or `::1`: exempt from [`MAX_PENDING_HANDSHAKES_PER_ADDR`].
fn is_local_default(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v4) => v4 == std::net::Ipv4Addr::LOCALHOST,
        std::net::IpAddr::V6(v6) => v6 == std::net::Ipv6Addr::LOCALHOST,
    }
}

/// Whom a connection counts against: its certificate's identity, or for a TLS peer without
/// one its source address; `None` (no limit) for plaintext, where every peer is the
/// loopback operator.
fn peer_key(peer: &Peer, addr: &std::net::SocketAddr) -> Option<String> {
    match peer {
        Peer::Cert(id) => Some(format!("{}:{}", id.role, id.name)),
        Peer::Anonymous => Some(format!("addr:{}", addr.ip())),
        _ => None,
    }
}

/// A byte stream of any transport.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// Who is connected, as tonic request extensions and axum `ConnectInfo` carry it.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    /// The authenticated peer.
    pub peer: Peer,
    /// Its socket address (`unix` for a Unix socket).
    pub addr: String,
}

/// A connection with its [`PeerInfo`].
pub struct AuthedIo {
    io: Box<dyn Io>,
    info: PeerInfo,
    on_read: Option<Box<dyn Fn() + Send + Sync>>,
    /// Its place in its peer's connection count, given back when it is dropped.
    _slot: Option<PeerSlot>,
}

impl AuthedIo {
    /// Wraps an established stream.
    pub fn new(io: Box<dyn Io>, info: PeerInfo) -> Self {
        Self {
            io,
            info,
            on_read: None,
            _slot: None,
        }
    }

    /// Calls `f` whenever bytes arrive (the HTTP server's stall clock).
    pub fn on_read(&mut self, f: impl Fn() + Send + Sync + 'static) {
        self.on_read = Some(Box::new(f));
    }

    /// Who is connected.
    pub fn info(&self) -> &PeerInfo {
        &self.info
    }
}

impl Connected for AuthedIo {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

impl AsyncRead for AuthedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if let Some(f) = &self.on_read
            && buf.filled().len() > before
        {
            f();
        }
        r
    }
}

impl AsyncWrite for AuthedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// How a TCP listener authenticates its peers.
#[derive(Clone)]
pub enum TcpSecurity {
    /// Mutual TLS; the client certificate is required.
    Tls(Arc<TlsContext>, Alpn),
    /// TLS where a client certificate is optional (HTTP with bearer tokens); requests
    /// without one are [`Peer::Anonymous`] until a token says otherwise.
    TlsOptionalClient(Arc<TlsContext>),
    /// Plaintext: every peer is [`Peer::Insecure`]. Only where the operator set the loudly
    /// named plaintext setting on a loopback listener.
    Plaintext,
}

/// The stream of authenticated connections a listener yields.
pub type Incoming = tokio_stream::wrappers::ReceiverStream<Result<AuthedIo, std::io::Error>>;

/// Accepts on `listener` until `cancel` resolves, handshaking each connection in its own
/// task; failed handshakes are logged (debug) and counted in the context's stats.
pub fn incoming_tcp(
    listener: TcpListener,
    security: TcpSecurity,
    cancel: impl std::future::Future<Output = ()> + Send + 'static,
) -> Incoming {
    let (tx, rx) = mpsc::channel(64);
    let pending = Arc::new(tokio::sync::Semaphore::new(MAX_PENDING_HANDSHAKES));
    let limits = PeerLimits::default();
    tokio::spawn(async move {
        tokio::pin!(cancel);
        loop {
            let permit = tokio::select! {
                biased;
                _ = &mut cancel => return,
                p = pending.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            };
            let (stream, addr) = tokio::select! {
                biased;
                _ = &mut cancel => return,
                a = listener.accept() => match a {
                    Ok(a) => a,
                    Err(e) => {
                        warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = stream.set_nodelay(true);
            let ctx = match &security {
                TcpSecurity::Tls(ctx, _) | TcpSecurity::TlsOptionalClient(ctx) => Some(ctx.clone()),
                TcpSecurity::Plaintext => None,
            };
            // One address's unfinished handshakes take a bounded share of the slots.
            let addr_slot = match &ctx {
                Some(ctx) if !is_local_default(addr.ip()) => {
                    match limits.take(
                        format!("pending:{}", addr.ip()),
                        MAX_PENDING_HANDSHAKES_PER_ADDR,
                    ) {
                        Some(slot) => Some(slot),
                        None => {
                            let n = ctx
                                .stats
                                .handshakes_over_addr_limit
                                .fetch_add(1, Ordering::Relaxed)
                                + 1;
                            if n.is_power_of_two() {
                                warn!(peer = %addr, refused = n, "closing a connection before its handshake: {MAX_PENDING_HANDSHAKES_PER_ADDR} from its address are still handshaking");
                            }
                            continue;
                        }
                    }
                }
                _ => None,
            };
            let (tx, security, limits) = (tx.clone(), security.clone(), limits.clone());
            tokio::spawn(async move {
                let _permit = permit;
                let sock = addr;
                let addr = addr.to_string();
                let mut conn = match security {
                    TcpSecurity::Tls(ctx, alpn) => match ctx.accept(stream, alpn).await {
                        Ok((s, id)) => AuthedIo::new(
                            Box::new(s),
                            PeerInfo {
                                peer: Peer::Cert(id),
                                addr,
                            },
                        ),
                        Err(e) => {
                            debug!(peer = %addr, "refused connection: {e}");
                            return;
                        }
                    },
                    TcpSecurity::TlsOptionalClient(ctx) => {
                        match ctx.accept_optional(stream).await {
                            Ok((s, id)) => AuthedIo::new(
                                Box::new(s),
                                PeerInfo {
                                    peer: id.map(Peer::Cert).unwrap_or(Peer::Anonymous),
                                    addr,
                                },
                            ),
                            Err(e) => {
                                debug!(peer = %addr, "refused connection: {e}");
                                return;
                            }
                        }
                    }
                    TcpSecurity::Plaintext => AuthedIo::new(
                        Box::new(stream),
                        PeerInfo {
                            peer: Peer::Insecure,
                            addr,
                        },
                    ),
                };
                drop(addr_slot);
                if let Some(key) = peer_key(&conn.info.peer, &sock) {
                    match limits.take(key, MAX_CONNECTIONS_PER_PEER) {
                        Some(slot) => conn._slot = Some(slot),
                        None => {
                            let n = ctx.as_ref().map_or(1, |c| {
                                c.stats.over_peer_limit.fetch_add(1, Ordering::Relaxed) + 1
                            });
                            // A flood is logged at 1, 2, 4, 8, … refusals, not once each.
                            if n.is_power_of_two() {
                                warn!(
                                    peer = %sock,
                                    refused = n,
                                    "closing a connection: its peer ({:?}) already holds {MAX_CONNECTIONS_PER_PEER} on this listener",
                                    conn.info.peer
                                );
                            } else {
                                debug!(peer = %sock, "closing a connection over its peer's limit");
                            }
                            return;
                        }
                    }
                }
                let _ = tx.send(Ok(conn)).await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Who may connect to a Unix socket, as its file mode says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketAccess {
    /// Mode 0600: this user (and root) only. Such peers are [`Peer::Local`] operators and
    /// hold every permission.
    Owner,
    /// Mode 0660 with this group (gid): its members may connect too, as
    /// [`Peer::LocalGroup`] readers (transferd's admin socket with `store_group`, so
    /// inference processes in the group can get hand-offs).
    Group(u32),
}

impl SocketAccess {
    /// Who a peer with `uid` is on a socket of this kind, in a process running as `me`.
    pub fn peer(self, uid: u32, me: u32) -> Peer {
        match self {
            _ if uid == me || uid == 0 => Peer::Local { uid },
            // The file mode let it connect: a member of the socket's group.
            Self::Group(_) => Peer::LocalGroup { uid },
            Self::Owner => Peer::Anonymous,
        }
    }
}

/// Accepts on a Unix socket: a peer of this process's user (or root) is [`Peer::Local`];
/// any other is what `access` says ([`SocketAccess::peer`]).
pub fn incoming_unix(
    listener: UnixListener,
    access: SocketAccess,
    cancel: impl std::future::Future<Output = ()> + Send + 'static,
) -> Incoming {
    let (tx, rx) = mpsc::channel(64);
    let me = rustix::process::geteuid().as_raw();
    tokio::spawn(async move {
        tokio::pin!(cancel);
        loop {
            let stream = tokio::select! {
                biased;
                _ = &mut cancel => return,
                a = listener.accept() => match a {
                    Ok((s, _)) => s,
                    Err(e) => {
                        warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let peer = match stream.peer_cred() {
                Ok(c) => access.peer(c.uid(), me),
                Err(_) => Peer::Anonymous,
            };
            let conn = AuthedIo::new(
                Box::new(stream),
                PeerInfo {
                    peer,
                    addr: "unix".into(),
                },
            );
            if tx.send(Ok(conn)).await.is_err() {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Binds a Unix socket with the mode `access` names (0600, or 0660 and the group),
/// replacing a stale socket (never another kind of file).
pub fn bind_unix(path: &std::path::Path, access: SocketAccess) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if meta.file_type().is_socket() {
            let _ = std::fs::remove_file(path);
        }
    }
    let l = UnixListener::bind(path)?;
    let mode = match access {
        SocketAccess::Owner => 0o600,
        SocketAccess::Group(gid) => {
            std::os::unix::fs::chown(path, None, Some(gid))?;
            0o660
        }
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(l)
}

/// The peer of a tonic request (anonymous when the server did not record one).
pub fn peer_of<T>(req: &tonic::Request<T>) -> Peer {
    peer_in(req.extensions())
}

pub(crate) fn peer_in(extensions: &http::Extensions) -> Peer {
    extensions
        .get::<PeerInfo>()
        .map(|p| p.peer.clone())
        .unwrap_or(Peer::Anonymous)
}

/// Refusals counted by [`AuthzLayer`] and the HTTP layer
/// ([`crate::http::HttpAuthLayer`]).
#[derive(Debug, Default)]
pub struct AuthzStats {
    /// Calls refused because the peer had no identity.
    pub unauthenticated: AtomicU64,
    /// Calls refused because the peer's role lacks the permission.
    pub denied: AtomicU64,
    /// `denied`, by the refused peer's kind: the roles in [`Role::ALL`] order, then
    /// local socket-group users.
    denied_by: [AtomicU64; Role::ALL.len() + 1],
}

impl AuthzStats {
    /// Counts a refusal of `peer`.
    fn count(&self, peer: &Peer) {
        if matches!(peer, Peer::Anonymous) {
            self.unauthenticated.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.denied.fetch_add(1, Ordering::Relaxed);
        let slot = match peer.identity() {
            Some(id) => Role::ALL.iter().position(|r| *r == id.role),
            None => None,
        };
        self.denied_by[slot.unwrap_or(Role::ALL.len())].fetch_add(1, Ordering::Relaxed);
    }

    /// Denials by the refused peer's kind (`host`, …, `read`, `local`), for metrics.
    pub fn denied_by(&self) -> Vec<(&'static str, u64)> {
        Role::ALL
            .iter()
            .map(|r| r.as_str())
            .chain(["local"])
            .zip(&self.denied_by)
            .map(|(kind, n)| (kind, n.load(Ordering::Relaxed)))
            .collect()
    }
}

/// Why [`authorize`] refused a call; the message names the caller, what it lacked and
/// how to get it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// No identity was presented.
    Unauthenticated(String),
    /// The identity's role lacks the permission.
    Denied(String),
}

/// Checks `peer` for `needed` on `what` (a method or route): a refusal is counted in
/// `stats` and logged with the peer's identity. `hint` tells an anonymous caller how to
/// authenticate.
pub fn authorize(
    stats: &AuthzStats,
    peer: &Peer,
    needed: Permission,
    what: &str,
    hint: &str,
) -> Result<(), Refused> {
    let Err(denied) = peer.authorize(needed) else {
        return Ok(());
    };
    stats.count(peer);
    if matches!(peer, Peer::Anonymous) {
        warn!(%peer, method = what, "refused unauthenticated call");
        Err(Refused::Unauthenticated(format!(
            "{what}: {denied}; {hint}"
        )))
    } else {
        warn!(%peer, method = what, needs = %needed, "refused call");
        Err(Refused::Denied(format!("{what}: {denied}")))
    }
}

/// Maps a gRPC path (`/package.Service/Method`) to what it needs; `None` for paths the
/// table does not know, which only local operators may call.
pub type MethodTable = fn(&str) -> Option<Permission>;

/// An authorisation check run before a service: it lets a request through (after adding
/// what handlers need to its extensions) or answers it instead.
pub trait Gate<ReqB, ResB> {
    /// `Ok` lets `req` through; `Err` is the answer.
    fn admit(&self, req: &mut http::Request<ReqB>) -> Result<(), http::Response<ResB>>;
}

/// A tower layer that runs a [`Gate`] before every call: [`AuthzLayer`] for gRPC,
/// [`crate::http::HttpAuthLayer`] for HTTP.
#[derive(Clone)]
pub struct GateLayer<G>(pub(crate) G);

impl<S, G: Clone> tower::Layer<S> for GateLayer<G> {
    type Service = Gated<S, G>;
    fn layer(&self, inner: S) -> Gated<S, G> {
        Gated {
            inner,
            gate: self.0.clone(),
        }
    }
}

impl<G> GateLayer<G> {
    /// A layer running `gate` before every call (for gates defined outside this crate).
    pub fn gate(gate: G) -> Self {
        Self(gate)
    }
}

/// The service a [`GateLayer`] wraps around the routes.
#[derive(Clone)]
pub struct Gated<S, G> {
    inner: S,
    gate: G,
}

impl<S, G, ReqB, ResB> tower::Service<http::Request<ReqB>> for Gated<S, G>
where
    G: Gate<ReqB, ResB>,
    S: tower::Service<http::Request<ReqB>, Response = http::Response<ResB>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Send + 'static,
    ResB: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<ReqB>) -> Self::Future {
        match self.gate.admit(&mut req) {
            Ok(()) => {
                // Take the service that was driven to readiness; leave a clone behind.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                Box::pin(async move { inner.call(req).await })
            }
            Err(answer) => Box::pin(async move { Ok(answer) }),
        }
    }
}

/// The gRPC [`Gate`]: a table of method → permission.
#[derive(Clone)]
pub struct MethodAuthz {
    table: MethodTable,
    stats: Arc<AuthzStats>,
}

impl<B> Gate<B, tonic::body::Body> for MethodAuthz {
    fn admit(&self, req: &mut http::Request<B>) -> Result<(), http::Response<tonic::body::Body>> {
        let peer = peer_in(req.extensions());
        check_call(self.table, &self.stats, &peer, req.uri().path()).map_err(|s| s.into_http())
    }
}

/// A tower layer that authorises every gRPC call by its path.
pub type AuthzLayer = GateLayer<MethodAuthz>;

impl AuthzLayer {
    /// A layer using `table`, counting into `stats`.
    pub fn new(table: MethodTable, stats: Arc<AuthzStats>) -> Self {
        Self(MethodAuthz { table, stats })
    }
}

/// Checks `peer` for the call at `path`; the `Status` to answer when refused.
pub fn check_call(
    table: MethodTable,
    stats: &AuthzStats,
    peer: &Peer,
    path: &str,
) -> Result<(), tonic::Status> {
    let needed = (table)(path).unwrap_or(Permission::Admin);
    authorize(
        stats,
        peer,
        needed,
        path,
        "present a certificate of the cluster CA",
    )
    .map_err(|r| match r {
        Refused::Unauthenticated(m) => tonic::Status::unauthenticated(m),
        Refused::Denied(m) => tonic::Status::permission_denied(m),
    })
}

/// How a client reaches a service.
#[derive(Clone)]
pub enum ClientSecurity {
    /// Mutual TLS with this member's certificate, expecting the server to be `Expect`.
    Tls(Arc<TlsContext>, Expect),
    /// Plaintext (loopback with the insecure setting, or Unix sockets).
    Plaintext,
}

/// An error in a service address.
#[derive(Debug, thiserror::Error)]
#[error(
    "invalid service address {addr:?}: {reason} (expected host:port, http://host:port or unix:/path)"
)]
pub struct AddrError {
    pub(crate) addr: String,
    pub(crate) reason: String,
}

/// Why [`connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The address is malformed.
    #[error(transparent)]
    Addr(#[from] AddrError),
    /// Nothing answered, or the handshake failed.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
}

enum Target {
    Tcp(String),
    Unix(String),
}

fn target(addr: &str) -> Result<(Endpoint, Target), AddrError> {
    let bad = |reason: String| AddrError {
        addr: addr.to_string(),
        reason,
    };
    if let Some(path) = addr.strip_prefix("unix:") {
        if path.is_empty() {
            return Err(bad("empty socket path".into()));
        }
        return Ok((
            Endpoint::from_static("http://unix.socket"),
            Target::Unix(path.to_string()),
        ));
    }
    let hostport = addr
        .strip_prefix("http://")
        .or_else(|| addr.strip_prefix("https://"))
        .unwrap_or(addr)
        .trim_end_matches('/');
    if hostport.is_empty() || hostport.contains('/') || !hostport.contains(':') {
        return Err(bad("expected host:port".into()));
    }
    let ep = Endpoint::from_shared(format!("http://{hostport}")).map_err(|e| bad(e.to_string()))?;
    Ok((ep, Target::Tcp(hostport.to_string())))
}

/// A TCP connection to `addr` (`host:port`) with `TCP_NODELAY`, within `timeout`: how the
/// API clients here and transferd's data-plane hops dial. An attempt without an answer for
/// [`CONNECT_ATTEMPT_DELAY`] is joined by another, up to [`CONNECT_ATTEMPTS`]: the first
/// to connect is kept and the others are closed; the first error (refused, unreachable: the
/// network's answer, which another attempt would get too) is returned at once.
pub async fn tcp_connect(addr: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    let tcp = tokio::time::timeout(timeout, staggered_connect(addr))
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("connect to {addr} timed out after {timeout:?}"),
            )
        })??;
    tcp.set_nodelay(true)?;
    Ok(tcp)
}

/// The attempts of [`tcp_connect`], without its bound; the attempts still under way when it
/// returns (or is dropped) are aborted with their sockets. The name is resolved once; each
/// attempt tries its addresses in turn, as `TcpStream::connect` does.
async fn staggered_connect(addr: &str) -> std::io::Result<TcpStream> {
    let addrs: Arc<[std::net::SocketAddr]> = tokio::net::lookup_host(addr).await?.collect();
    let mut attempts = tokio::task::JoinSet::new();
    loop {
        if attempts.len() < CONNECT_ATTEMPTS {
            let addrs = addrs.clone();
            attempts.spawn(async move { TcpStream::connect(&addrs[..]).await });
        }
        let more = attempts.len() < CONNECT_ATTEMPTS;
        tokio::select! {
            Some(done) = attempts.join_next() => {
                return done.map_err(|e| std::io::Error::other(format!("connect to {addr}: {e}")))?;
            }
            () = tokio::time::sleep(CONNECT_ATTEMPT_DELAY), if more => {}
            else => return Err(std::io::Error::other(format!("connect to {addr}: no attempt left"))),
        }
    }
}

type Connector = tower::util::BoxCloneSyncService<
    Uri,
    TokioIo<Box<dyn Io>>,
    Box<dyn std::error::Error + Send + Sync>,
>;

fn connector(target: Target, security: ClientSecurity) -> Connector {
    let target = Arc::new(target);
    tower::util::BoxCloneSyncService::new(tower::service_fn(move |_: Uri| {
        let (target, security) = (target.clone(), security.clone());
        async move {
            let io: Box<dyn Io> = match &*target {
                Target::Unix(path) => Box::new(tokio::net::UnixStream::connect(path).await?),
                Target::Tcp(hostport) => {
                    let tcp = tcp_connect(hostport, CONNECT_TIMEOUT).await?;
                    match &security {
                        ClientSecurity::Plaintext => Box::new(tcp),
                        ClientSecurity::Tls(ctx, expect) => {
                            Box::new(ctx.connect(tcp, Alpn::Grpc, expect).await?.0)
                        }
                    }
                }
            };
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(TokioIo::new(io))
        }
    }))
}

/// A channel that connects on first use and reconnects after failures.
pub fn lazy(addr: &str, security: ClientSecurity) -> Result<Channel, AddrError> {
    let (ep, target) = target(addr)?;
    let ep = ep
        .connect_timeout(CONNECT_TIMEOUT + crate::tls::HANDSHAKE_TIMEOUT)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5));
    Ok(ep.connect_with_connector_lazy(connector(target, security)))
}

/// Connects now, so an unreachable or unauthenticated service is reported at once.
pub async fn connect(addr: &str, security: ClientSecurity) -> Result<Channel, ConnectError> {
    let (ep, target) = target(addr)?;
    let ep = ep.connect_timeout(CONNECT_TIMEOUT + crate::tls::HANDSHAKE_TIMEOUT);
    ep.connect_with_connector(connector(target, security))
        .await
        .map_err(|e| ConnectError::Connect {
            addr: addr.to_string(),
            source: e,
        })
}

impl From<crate::tls::TlsError> for std::io::Error {
    fn from(e: crate::tls::TlsError) -> Self {
        Self::new(std::io::ErrorKind::PermissionDenied, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SYN that goes unanswered is joined by another attempt after
    /// [`CONNECT_ATTEMPT_DELAY`] instead of waiting for the kernel's retransmission at 1 s.
    /// The listener's accept queue is full, so Linux drops the first SYN without a word (as
    /// a lossy link would); it is drained 100 ms later, and the second attempt connects.
    #[tokio::test]
    async fn a_connect_whose_syn_is_dropped_is_tried_again_before_the_kernel_would() {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(1).unwrap();
        let addr = listener.local_addr().unwrap();
        // A backlog of 1 holds two connections; the third one's SYN is dropped.
        let fillers = [
            TcpStream::connect(addr).await.unwrap(),
            TcpStream::connect(addr).await.unwrap(),
        ];
        let t0 = std::time::Instant::now();
        let connect =
            tokio::spawn(async move { tcp_connect(&addr.to_string(), CONNECT_TIMEOUT).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut accepted = Vec::new();
        for _ in 0..fillers.len() {
            accepted.push(listener.accept().await.unwrap());
        }
        let tcp = connect.await.unwrap().unwrap();
        let took = t0.elapsed();
        assert!(tcp.nodelay().unwrap());
        // The kernel alone would have sent the SYN again only after 1 s.
        assert!(
            took >= CONNECT_ATTEMPT_DELAY && took < Duration::from_millis(900),
            "connected after {took:?}"
        );
        // Refused is an answer: returned at once, not tried again.
        drop(listener);
        let t0 = std::time::Instant::now();
        let e = tcp_connect(&addr.to_string(), CONNECT_TIMEOUT)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
        assert!(t0.elapsed() < CONNECT_ATTEMPT_DELAY);
    }

    #[test]
    fn a_peer_holds_at_most_its_limit_and_gets_places_back_as_connections_close() {
        let limits = PeerLimits::default();
        let mut held: Vec<PeerSlot> = (0..3)
            .map(|_| limits.take("host:a".into(), 3).unwrap())
            .collect();
        assert!(limits.take("host:a".into(), 3).is_none());
        // Another peer is not affected.
        let b = limits.take("host:b".into(), 3).unwrap();
        assert_eq!((limits.held("host:a"), limits.held("host:b")), (3, 1));
        held.pop();
        assert_eq!(limits.held("host:a"), 2);
        held.push(limits.take("host:a".into(), 3).unwrap());
        drop(held);
        drop(b);
        assert!(
            limits.0.lock().unwrap().is_empty(),
            "entries are removed at 0"
        );
    }

    #[test]
    fn connections_count_against_their_identity_or_their_address() {
        let addr: std::net::SocketAddr = "10.0.0.7:4242".parse().unwrap();
        let id = crate::Identity::new(Role::Host, "h1").unwrap();
        assert_eq!(peer_key(&Peer::Cert(id), &addr).as_deref(), Some("host:h1"));
        assert_eq!(
            peer_key(&Peer::Anonymous, &addr).as_deref(),
            Some("addr:10.0.0.7")
        );
        assert_eq!(peer_key(&Peer::Insecure, &addr), None);
        assert!(is_local_default("127.0.0.1".parse().unwrap()));
        assert!(is_local_default("::1".parse().unwrap()));
        assert!(!is_local_default("127.0.0.9".parse().unwrap()));
        assert!(!is_local_default("10.0.0.7".parse().unwrap()));
    }

    #[test]
    fn socket_peers_by_uid_and_mode() {
        let me = 1000;
        for access in [SocketAccess::Owner, SocketAccess::Group(50)] {
            assert_eq!(access.peer(me, me), Peer::Local { uid: me });
            assert_eq!(access.peer(0, me), Peer::Local { uid: 0 });
        }
        assert_eq!(SocketAccess::Owner.peer(1001, me), Peer::Anonymous);
        let member = SocketAccess::Group(50).peer(1001, me);
        assert_eq!(member, Peer::LocalGroup { uid: 1001 });
        assert!(member.authorize(Permission::Read).is_ok());
        assert!(member.authorize(Permission::DriveAgent).is_err());
    }

    #[test]
    fn denials_are_counted_by_role() {
        let stats = AuthzStats::default();
        let host = Peer::Cert(crate::Identity::new(Role::Host, "h1").unwrap());
        let r = authorize(&stats, &host, Permission::Read, "/metrics", "hint");
        assert!(matches!(r, Err(Refused::Denied(m)) if m.contains("host:h1")));
        let r = authorize(
            &stats,
            &Peer::Anonymous,
            Permission::Read,
            "/metrics",
            "hint",
        );
        assert!(matches!(r, Err(Refused::Unauthenticated(m)) if m.ends_with("hint")));
        let r = authorize(
            &stats,
            &Peer::LocalGroup { uid: 7 },
            Permission::Admin,
            "/x",
            "",
        );
        assert!(r.is_err());
        assert_eq!(stats.unauthenticated.load(Ordering::Relaxed), 1);
        assert_eq!(stats.denied.load(Ordering::Relaxed), 2);
        let by: Vec<_> = stats
            .denied_by()
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .collect();
        assert_eq!(by, vec![("host", 1), ("local", 1)]);
    }
}
