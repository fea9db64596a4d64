//! HTTP/1.1 APIs over authenticated connections: the controller's JSON API and transferd's
//! admin endpoint are served by [`serve`] and authorised by [`HttpAuthLayer`].
//!
//! - [`serve`] runs hyper's HTTP/1 server on each connection an [`Incoming`] yields (the
//!   TLS handshake already done in its own task), puts the connection's [`PeerInfo`](crate::grpc::PeerInfo) into
//!   every request's extensions
//!   ([`crate::grpc::PeerInfo`]), and closes connections that stall ([`HttpLimits`]): a
//!   request head must arrive whole within `header_timeout` (counted from the
//!   connection's start, or from the first byte after a keep-alive pause), a handler
//!   waiting for request body bytes waits at most `header_timeout` for the next ones, and
//!   a keep-alive connection without a request in progress is closed after
//!   `idle_timeout`. Each such closure is logged and counted ([`HttpStats`]).
//! - [`HttpAuthLayer`] authenticates every request (the client certificate, else an
//!   `Authorization: Bearer` token from the tokens file) and authorises it by a table of
//!   route → [`Permission`]; a refusal is a `401`/`403` with a JSON body
//!   `{"error": {"code", "message"}}` naming who lacked what, logged with the identity
//!   and counted in [`AuthzStats`] (by role).
//!
//! Why not hyper's `header_read_timeout`: hyper starts that timer whenever it waits for a
//! request head, which on a keep-alive connection is as soon as the previous response is
//! written, so it cannot give a short head timeout and a longer keep-alive idle time at
//! once. [`ConnClock`] keeps both, as a pure state machine (events and the time in, the
//! next deadline out) that the connection's task consults.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;
use tracing::{debug, warn};

use crate::grpc::{AuthzStats, Gate, GateLayer, Incoming, Refused, authorize, peer_in};
use crate::role::{Peer, Permission};
use crate::token::Tokens;

/// Default time a client has to send a request head (and the longest pause inside a
/// request body). Rationale: a request head is a few hundred bytes, sent at once by every
/// real client; ten seconds leaves room for a congested link while a slowloris client
/// holds a connection for no longer.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time a keep-alive connection may wait for its next request. Rationale: long
/// enough that a dashboard or scraper polling every few seconds reuses its connection,
/// short enough that idle connections do not pile up.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long an HTTP client may stall.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// A request head must arrive whole within this of the connection's start (or of its
    /// first byte after a keep-alive pause); a handler waits at most this long for the
    /// next bytes of a request body.
    pub header_timeout: Duration,
    /// A connection with no request in progress is closed after this long.
    pub idle_timeout: Duration,
}

impl HttpLimits {
    /// Limits from milliseconds (`None`: the default), each between 100 ms and an hour;
    /// an error names the setting out of range (`names`: the header's, the idle one's).
    pub fn from_millis(
        header_ms: Option<u64>,
        idle_ms: Option<u64>,
        names: [&str; 2],
    ) -> Result<Self, LimitOutOfRange> {
        let d = Self::default();
        let pick = |name: &str, v: Option<u64>, default: Duration| match v {
            None => Ok(default),
            Some(ms) if (100..=3_600_000).contains(&ms) => Ok(Duration::from_millis(ms)),
            Some(ms) => Err(LimitOutOfRange {
                name: name.to_string(),
                ms,
            }),
        };
        Ok(Self {
            header_timeout: pick(names[0], header_ms, d.header_timeout)?,
            idle_timeout: pick(names[1], idle_ms, d.idle_timeout)?,
        })
    }
}

/// A timeout setting of [`HttpLimits::from_millis`] outside 100 ms to an hour.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name} must be between 100 and 3600000, got {ms}")]
pub struct LimitOutOfRange {
    /// The setting's name.
    pub name: String,
    /// Its value in milliseconds.
    pub ms: u64,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// Why a connection was closed for stalling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stall {
    /// The request head did not arrive whole within the header timeout.
    Header,
    /// A handler waited longer than the header timeout for request body bytes.
    Body,
    /// No request came within the idle timeout.
    Idle,
}

impl Stall {
    /// Every kind, for metrics.
    pub const ALL: [Self; 3] = [Self::Header, Self::Body, Self::Idle];

    /// Lower-case name for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Header => "header",
            Self::Body => "body",
            Self::Idle => "idle",
        }
    }
}

/// Connections closed by a timeout, by [`Stall`] (in [`Stall::ALL`] order).
#[derive(Debug, Default)]
pub struct HttpStats {
    closed: [AtomicU64; 3],
}

impl HttpStats {
    fn count(&self, stall: Stall) {
        self.closed[stall as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Connections closed for each kind of stall.
    pub fn timeouts(&self) -> [(Stall, u64); 3] {
        Stall::ALL.map(|s| (s, self.closed[s as usize].load(Ordering::Relaxed)))
    }
}

/// The deadlines of one HTTP/1 connection: events and the time go in, the next deadline
/// and whether it has passed come out. hyper handles one request at a time on a
/// connection.
#[derive(Debug, Clone)]
pub struct ConnClock {
    limits: HttpLimits,
    /// Requests handed to the service whose response has not been sent.
    in_flight: u32,
    /// When the request head in progress began: the connection's start, or the first
    /// byte after a pause; `None` while idle or busy.
    head_since: Option<Instant>,
    /// When the last response was sent (or the connection started).
    idle_since: Instant,
    /// Since when a handler has been waiting for request body bytes.
    body_wait: Option<Instant>,
}

impl ConnClock {
    /// A connection that starts at `now` and must send its first request head in time.
    pub fn new(limits: HttpLimits, now: Instant) -> Self {
        Self {
            limits,
            in_flight: 0,
            head_since: Some(now),
            idle_since: now,
            body_wait: None,
        }
    }

    /// Bytes arrived. Returns whether the deadline changed (a head began).
    pub fn on_read(&mut self, now: Instant) -> bool {
        if self.in_flight == 0 && self.head_since.is_none() {
            self.head_since = Some(now);
            return true;
        }
        false
    }

    /// A whole request head arrived and went to the service.
    pub fn on_request(&mut self) {
        self.in_flight += 1;
        self.head_since = None;
    }

    /// A handler polled the request body and found no bytes yet.
    pub fn on_body_wait(&mut self, now: Instant) -> bool {
        if self.body_wait.is_none() {
            self.body_wait = Some(now);
            return true;
        }
        false
    }

    /// The request body yielded something, ended or was dropped.
    pub fn on_body_progress(&mut self) {
        self.body_wait = None;
    }

    /// A response was sent (its body finished or was dropped).
    pub fn on_response_end(&mut self, now: Instant) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if self.in_flight == 0 {
            self.idle_since = now;
            self.body_wait = None;
        }
    }

    /// The next deadline and what missing it means; `None` while a handler works (each
    /// bounds its own waits).
    pub fn deadline(&self) -> Option<(Instant, Stall)> {
        if self.in_flight == 0 {
            return Some(match self.head_since {
                Some(t) => (t + self.limits.header_timeout, Stall::Header),
                None => (self.idle_since + self.limits.idle_timeout, Stall::Idle),
            });
        }
        self.body_wait
            .map(|t| (t + self.limits.header_timeout, Stall::Body))
    }

    /// The stall, when the deadline has passed at `now`.
    pub fn expired(&self, now: Instant) -> Option<Stall> {
        self.deadline()
            .filter(|(at, _)| now >= *at)
            .map(|(_, stall)| stall)
    }
}

/// A [`ConnClock`] shared by a connection's byte stream, bodies and task; `wake` tells
/// the task that the deadline may have moved earlier.
struct Watch {
    clock: Mutex<ConnClock>,
    wake: Notify,
}

impl Watch {
    fn update(&self, f: impl FnOnce(&mut ConnClock) -> bool) {
        let moved = match self.clock.lock() {
            Ok(mut c) => f(&mut c),
            Err(_) => false,
        };
        if moved {
            self.wake.notify_one();
        }
    }

    fn snapshot(&self) -> Option<ConnClock> {
        self.clock.lock().ok().map(|c| c.clone())
    }
}

/// A request body that tells the connection's clock when a handler waits for bytes.
pub struct RequestBody {
    inner: hyper::body::Incoming,
    watch: Arc<Watch>,
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        match r {
            Poll::Pending => self.watch.update(|c| c.on_body_wait(Instant::now())),
            Poll::Ready(_) => self.watch.update(|c| {
                c.on_body_progress();
                false
            }),
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        self.watch.update(|c| {
            c.on_body_progress();
            false
        });
    }
}

/// A response body that tells the connection's clock when it has been sent.
struct ResponseBody<B> {
    inner: B,
    watch: Arc<Watch>,
}

impl<B: Body + Unpin> Body for ResponseBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for ResponseBody<B> {
    fn drop(&mut self) {
        // hyper drops the body once it is written (or the connection is gone).
        self.watch.update(|c| {
            c.on_response_end(Instant::now());
            true
        });
    }
}

/// Serves HTTP/1.1 on every connection of `incoming` with `service` until `cancel`
/// (then each connection finishes its request in progress and closes). Every request
/// carries its connection's [`crate::grpc::PeerInfo`] in its extensions.
pub async fn serve<S, B>(
    mut incoming: Incoming,
    service: S,
    limits: HttpLimits,
    stats: Arc<HttpStats>,
    cancel: CancellationToken,
) where
    S: tower::Service<http::Request<RequestBody>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    loop {
        let conn = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            c = incoming.next() => match c {
                Some(Ok(c)) => c,
                Some(Err(e)) => {
                    warn!("HTTP accept failed: {e}");
                    continue;
                }
                None => return,
            },
        };
        let (service, stats, cancel) = (service.clone(), stats.clone(), cancel.clone());
        tokio::spawn(async move {
            let mut io = conn;
            let info = io.info().clone();
            let watch = Arc::new(Watch {
                clock: Mutex::new(ConnClock::new(limits, Instant::now())),
                wake: Notify::new(),
            });
            io.on_read({
                let watch = watch.clone();
                move || watch.update(|c| c.on_read(Instant::now()))
            });
            let svc = {
                let (watch, info) = (watch.clone(), info.clone());
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let (watch, service) = (watch.clone(), service.clone());
                    watch.update(|c| {
                        c.on_request();
                        true
                    });
                    let mut req = req.map(|inner| RequestBody {
                        inner,
                        watch: watch.clone(),
                    });
                    req.extensions_mut().insert(info.clone());
                    async move {
                        let Ok(resp) = service.oneshot(req).await;
                        Ok::<_, Infallible>(resp.map(|inner| ResponseBody { inner, watch }))
                    }
                })
            };
            let conn = hyper::server::conn::http1::Builder::new()
                // ConnClock bounds request heads (see the module comment).
                .header_read_timeout(None)
                .keep_alive(true)
                .serve_connection(TokioIo::new(io), svc);
            tokio::pin!(conn);
            let mut draining = false;
            loop {
                let deadline = watch.snapshot().and_then(|c| c.deadline());
                let sleep = async {
                    match deadline {
                        Some((at, _)) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            debug!(peer = %info.peer, addr = %info.addr, "HTTP connection ended: {e}");
                        }
                        return;
                    }
                    _ = cancel.cancelled(), if !draining => {
                        conn.as_mut().graceful_shutdown();
                        draining = true;
                    }
                    _ = watch.wake.notified() => {}
                    _ = sleep => {
                        if let Some(stall) = watch.snapshot().and_then(|c| c.expired(Instant::now())) {
                            stats.count(stall);
                            warn!(peer = %info.peer, addr = %info.addr, stall = stall.as_str(), "closing a stalled HTTP connection");
                            // Dropping the connection closes the socket.
                            return;
                        }
                    }
                }
            }
        });
    }
}

/// What each route needs: `None` for public routes (`/healthz`).
pub type RouteTable = fn(&http::Method, &str) -> Option<Permission>;

/// The HTTP [`Gate`]: authenticates a request (see the module comment) and checks it
/// against a table of route → permission, leaving the resolved [`Peer`] in its extensions
/// for handlers that check names (the controller's heartbeats).
#[derive(Clone)]
pub struct RouteAuthz {
    table: RouteTable,
    tokens: Arc<Tokens>,
    stats: Arc<AuthzStats>,
}

/// A tower layer that authenticates and authorises every HTTP request ([`RouteAuthz`]).
pub type HttpAuthLayer = GateLayer<RouteAuthz>;

impl HttpAuthLayer {
    /// A layer using `table`, accepting `tokens` (empty: none), counting into `stats`.
    pub fn new(table: RouteTable, tokens: Arc<Tokens>, stats: Arc<AuthzStats>) -> Self {
        Self(RouteAuthz {
            table,
            tokens,
            stats,
        })
    }
}

impl<ReqB, ResB: From<String>> Gate<ReqB, ResB> for RouteAuthz {
    fn admit(&self, req: &mut http::Request<ReqB>) -> Result<(), http::Response<ResB>> {
        let peer = self.check(req).map_err(Refused::into_response)?;
        req.extensions_mut().insert(peer);
        Ok(())
    }
}

impl RouteAuthz {
    /// Who `req` comes from, or why it is refused.
    pub fn check<B>(&self, req: &http::Request<B>) -> Result<Peer, Refused> {
        let path = req.uri().path();
        let mut peer = peer_in(req.extensions());
        if let Some(value) = req.headers().get(http::header::AUTHORIZATION) {
            let token = value
                .to_str()
                .ok()
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim);
            match token.and_then(|t| self.tokens.lookup(t)) {
                Some(id) if matches!(peer, Peer::Anonymous | Peer::Insecure) => {
                    peer = Peer::Token(id.clone())
                }
                // A certificate (or a local socket peer) outranks a token.
                Some(_) => {}
                None => {
                    self.stats.unauthenticated.fetch_add(1, Ordering::Relaxed);
                    warn!(%peer, path, "refused an unknown bearer token");
                    return Err(Refused::Unauthenticated(format!(
                        "{path}: the bearer token is not valid"
                    )));
                }
            }
        }
        if let Some(needed) = (self.table)(req.method(), path) {
            authorize(
                &self.stats,
                &peer,
                needed,
                path,
                "present a client certificate of the cluster CA or a bearer token",
            )?;
        }
        Ok(peer)
    }
}

impl Refused {
    /// The HTTP answer: `401`/`403` and `{"error": {"code", "message"}}` with the gRPC
    /// code name, as the controller's other API errors.
    pub fn into_response<B: From<String>>(self) -> http::Response<B> {
        let (status, code, message) = match self {
            Self::Unauthenticated(m) => (http::StatusCode::UNAUTHORIZED, "UNAUTHENTICATED", m),
            Self::Denied(m) => (http::StatusCode::FORBIDDEN, "PERMISSION_DENIED", m),
        };
        let body = serde_json::json!({ "error": { "code": code, "message": message } });
        let mut resp = http::Response::new(B::from(format!("{body}\n")));
        *resp.status_mut() = status;
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        if status == http::StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                http::HeaderValue::from_static("Bearer"),
            );
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: HttpLimits = HttpLimits {
        header_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(60),
    };

    fn at(t0: Instant, s: u64) -> Instant {
        t0 + Duration::from_secs(s)
    }

    #[test]
    fn a_new_connection_must_send_its_head_in_time() {
        let t0 = Instant::now();
        let mut c = ConnClock::new(LIMITS, t0);
        c.on_read(at(t0, 1));
        assert_eq!(c.expired(at(t0, 9)), None);
        assert_eq!(c.expired(at(t0, 10)), Some(Stall::Header));
    }

    #[test]
    fn keep_alive_waits_idle_then_times_the_next_head_from_its_first_byte() {
        let t0 = Instant::now();
        let mut c = ConnClock::new(LIMITS, t0);
        c.on_request();
        // The handler works: no deadline.
        assert_eq!(c.deadline(), None);
        c.on_response_end(at(t0, 2));
        assert_eq!(c.expired(at(t0, 61)), None);
        assert_eq!(c.expired(at(t0, 62)), Some(Stall::Idle));
        // A head that starts at 30 s must be whole by 40 s (earlier than the idle limit).
        assert!(c.on_read(at(t0, 30)));
        assert!(!c.on_read(at(t0, 31)));
        assert_eq!(c.deadline(), Some((at(t0, 40), Stall::Header)));
        c.on_request();
        c.on_response_end(at(t0, 41));
        assert_eq!(c.deadline(), Some((at(t0, 101), Stall::Idle)));
    }

    #[test]
    fn a_handler_waits_for_body_bytes_at_most_the_header_timeout() {
        let t0 = Instant::now();
        let mut c = ConnClock::new(LIMITS, t0);
        c.on_request();
        assert!(c.on_body_wait(at(t0, 1)));
        assert!(!c.on_body_wait(at(t0, 5)));
        assert_eq!(c.expired(at(t0, 11)), Some(Stall::Body));
        c.on_body_progress();
        assert_eq!(c.deadline(), None);
        assert!(c.on_body_wait(at(t0, 20)));
        assert_eq!(c.expired(at(t0, 29)), None);
    }
}
