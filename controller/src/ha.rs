//! High availability: several `shardcast-controller` replicas on one etcd, one leader.
//!
//! * **Election.** Each replica holds an etcd lease (TTL `--lease-ttl-ms`, 3 s by default)
//!   and, every `--campaign-ms`, tries one transaction: "if the leader key does not exist,
//!   create it with my address, attached to my lease". The winner leads until its lease
//!   ends; a replica that is killed stops renewing, etcd deletes the key when the lease
//!   expires, and the next campaign round elsewhere wins.
//! * **Leader.** Runs the full controller: [`Services::open`] loads the state from etcd
//!   and resumes the plans in flight, as after a restart. Its writes are fenced on the
//!   leader key's create revision ([`crate::etcd`]).
//! * **Stepping down.** The leader renews its lease every TTL/6. When no renewal has
//!   succeeded for 2/3 of the TTL (etcd unreachable, partitioned, or the lease is gone) it
//!   stops acting at once, before etcd can have expired the lease: it refuses writes,
//!   clears its write fence, and cancels its plan runners, sweeper, scraper and expiry
//!   loop. Then it campaigns again like any follower.
//! * **Followers.** Serve reads from a read-only view of the stored state
//!   ([`Services::open_read_only`]: no runner or loop starts), reloaded whenever etcd's
//!   revision has moved (checked every campaign round). Every write — including
//!   heartbeats, so that the leader's inventory is the one placement uses — is refused:
//!   gRPC `UNAVAILABLE` with the leader's address in the message and in the
//!   `x-shardcast-leader` metadata key, HTTP 503 with a JSON body and the same header.
//!   Clients given every replica's address follow the hint
//!   (`shardcast_identity::failover`).
//!
//! With the embedded redb store there is one replica and it always leads; the same
//! [`Slot`] and services are used, so the two modes share one code path.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::Router;
use axum::body::Body;
use axum::response::IntoResponse;
use shardcast_identity::Permission;
use shardcast_identity::grpc::Gate;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;
use tracing::{info, warn};

use crate::etcd::{Campaign, EtcdStore, LeaderInfo};
use crate::services::{Config, Services};
use crate::state::StateStore;

/// Metadata key (gRPC) and header (HTTP) naming the leader's address on a refusal.
pub const LEADER_HEADER: &str = shardcast_identity::failover::LEADER_HEADER;

/// The controller the API serves now, with its HTTP routes.
pub struct Active {
    /// The leader's controller, or a follower's read-only view.
    pub ctl: Arc<Services>,
    http: Router,
}

impl Active {
    /// Wraps `ctl` and builds its routes.
    pub fn new(ctl: Arc<Services>) -> Arc<Self> {
        Arc::new(Self {
            http: crate::http::router(ctl.clone()),
            ctl,
        })
    }
}

/// Where the API finds the current [`Active`]; swapped on a change of role or view.
pub type Slot = Arc<ArcSwap<Active>>;

/// This replica's role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Runs the controller and takes writes.
    Leader,
    /// Serves reads; `leader` is who leads, when known.
    Follower {
        /// The leader's record.
        leader: Option<LeaderInfo>,
    },
}

/// This replica's identity and role, shared by the gates and the status route.
#[derive(Clone)]
pub struct Replica {
    id: String,
    role: watch::Receiver<Role>,
}

impl Replica {
    /// A replica called `id` whose role is published on `role`.
    pub fn new(id: impl Into<String>, role: watch::Receiver<Role>) -> Self {
        Self {
            id: id.into(),
            role,
        }
    }

    /// The single replica of an embedded store: always the leader.
    pub fn solo() -> Self {
        let (_tx, rx) = watch::channel(Role::Leader);
        Self::new("solo", rx)
    }

    /// The role now.
    pub fn role(&self) -> Role {
        self.role.borrow().clone()
    }

    /// Whether this replica leads now.
    pub fn is_leader(&self) -> bool {
        *self.role.borrow() == Role::Leader
    }

    /// Why a write is refused here, and the leader's record when known.
    fn refusal(&self) -> (String, Option<LeaderInfo>) {
        match self.role() {
            Role::Leader => (String::new(), None),
            Role::Follower { leader: Some(l) } => (
                format!(
                    "controller replica {} is not the leader: send writes to the leader {} at {} (gRPC) / {} (HTTP)",
                    self.id, l.id, l.grpc, l.http
                ),
                Some(l),
            ),
            Role::Follower { leader: None } => (
                format!(
                    "controller replica {} is not the leader and no leader is elected now (etcd unreachable or an election in progress): retry shortly",
                    self.id
                ),
                None,
            ),
        }
    }

    /// `GET /v1/replica`: this replica's id and role, and the leader.
    fn status_json(&self) -> serde_json::Value {
        match self.role() {
            Role::Leader => serde_json::json!({"id": self.id, "role": "leader", "leader": null}),
            Role::Follower { leader } => {
                serde_json::json!({"id": self.id, "role": "follower", "leader": leader})
            }
        }
    }
}

/// A gRPC service that serves each call with the service `make` builds over the current
/// controller in the slot.
#[derive(Clone)]
pub struct Switch<S> {
    slot: Slot,
    make: fn(Arc<Services>) -> S,
}

impl<S> Switch<S> {
    /// Serves with `make(current controller)`.
    pub fn new(slot: Slot, make: fn(Arc<Services>) -> S) -> Self {
        Self { slot, make }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Switch<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tower::Service<http::Request<B>> for Switch<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tower::util::Oneshot<S, http::Request<B>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        (self.make)(self.slot.load().ctl.clone()).oneshot(req)
    }
}

/// The HTTP routes of the current controller.
#[derive(Clone)]
struct HttpSwitch(Slot);

impl tower::Service<http::Request<Body>> for HttpSwitch {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = tower::util::Oneshot<Router, http::Request<Body>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        self.0.load().http.clone().oneshot(req)
    }
}

/// The HTTP front end over the slot, with `GET /v1/replica` and the leader gate.
pub fn http_router(slot: Slot, replica: Replica) -> Router {
    let status = replica.clone();
    Router::new()
        .route(
            "/v1/replica",
            axum::routing::get(move || {
                let s = status.status_json();
                async move { axum::Json(s) }
            }),
        )
        .fallback_service(HttpSwitch(slot))
        .layer(shardcast_identity::grpc::GateLayer::gate(LeaderGate(
            replica,
        )))
}

/// Refuses writes on a replica that does not lead, naming the leader.
#[derive(Clone)]
pub struct LeaderGate(pub Replica);

impl<B> Gate<B, tonic::body::Body> for LeaderGate {
    fn admit(&self, req: &mut http::Request<B>) -> Result<(), http::Response<tonic::body::Body>> {
        if crate::auth::permission(req.uri().path()) == Some(Permission::Read) || self.0.is_leader()
        {
            return Ok(());
        }
        let (msg, leader) = self.0.refusal();
        let mut status = tonic::Status::unavailable(msg);
        // Always present on a refusal (empty: no leader known), so clients can tell it
        // from an UNAVAILABLE of the call itself.
        let hint = leader.map(|l| l.grpc).unwrap_or_default();
        if let Ok(v) = hint.parse() {
            status.metadata_mut().insert(LEADER_HEADER, v);
        }
        Err(status.into_http())
    }
}

impl<B> Gate<B, Body> for LeaderGate {
    fn admit(&self, req: &mut http::Request<B>) -> Result<(), http::Response<Body>> {
        let read = matches!(
            crate::auth::http_permission(req.method(), req.uri().path()),
            None | Some(Permission::Read)
        );
        if read || self.0.is_leader() {
            return Ok(());
        }
        let (msg, leader) = self.0.refusal();
        let body = serde_json::json!({
            "error": {"code": "unavailable", "message": msg},
            "leader": leader,
        });
        let mut resp = (http::StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
        if let Some(l) = leader
            && let Ok(v) = http::HeaderValue::from_str(&l.http)
        {
            resp.headers_mut().insert(LEADER_HEADER, v);
        }
        Err(resp)
    }
}

/// Timing of the election.
#[derive(Debug, Clone)]
pub struct HaConfig {
    /// What this replica advertises as leader.
    pub me: LeaderInfo,
    /// Lease TTL (etcd rounds it to whole seconds, at least 2 s on etcd 3.4 defaults).
    pub ttl: Duration,
    /// How often a follower campaigns and checks for a newer state.
    pub campaign: Duration,
}

/// The first view, before any election: the stored state, read-only. Retries while etcd
/// is unreachable, for at most `patience`.
/// Also the token that ends the view's own tasks (its write-behind) once it is replaced.
pub async fn first_view(
    cfg: &Config,
    store: Arc<EtcdStore>,
    cancel: &CancellationToken,
    patience: Duration,
) -> anyhow::Result<(Arc<Active>, CancellationToken)> {
    let until = Instant::now() + patience;
    loop {
        let token = cancel.child_token();
        match read_only(cfg, store.clone(), token.clone()).await {
            Ok(a) => return Ok((a, token)),
            Err(e) if Instant::now() < until => {
                warn!("loading the state from etcd: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                anyhow::bail!("loading the state from etcd (gave up after {patience:?}): {e}")
            }
        }
    }
}

async fn read_only(
    cfg: &Config,
    store: Arc<EtcdStore>,
    cancel: CancellationToken,
) -> Result<Arc<Active>, String> {
    let cfg = cfg.clone();
    let store: Arc<dyn StateStore> = store;
    tokio::task::spawn_blocking(move || Services::open_read_only(&cfg, store, cancel))
        .await
        .map_err(|e| e.to_string())?
        .map(Active::new)
        .map_err(|e| e.to_string())
}

/// Runs this replica's election until `cancel`: follows, leads when elected, steps down
/// when its lease cannot be renewed in time, and follows again.
pub async fn run(
    cfg: Config,
    ha: HaConfig,
    store: Arc<EtcdStore>,
    slot: Slot,
    role: watch::Sender<Role>,
    cancel: CancellationToken,
    first_view: CancellationToken,
) {
    // Ends the tasks of the view in the slot when another replaces it.
    let mut view_token = first_view;
    let mut seen_revision = -1;
    let mut lease: Option<i64> = None;
    let mut quiet = Quiet::default();
    'follow: loop {
        let _ = role.send(Role::Follower { leader: None });
        store.set_fence(None);
        // Follow until elected.
        let (revision, lease_id, renewed) = loop {
            tokio::select! {
                _ = cancel.cancelled() => {
                    if let Some(l) = lease { let _ = store.revoke(l).await; }
                    return;
                }
                _ = tokio::time::sleep(ha.campaign) => {}
            }
            match store.revision().await {
                Ok(r) if r != seen_revision => {
                    let token = cancel.child_token();
                    match read_only(&cfg, store.clone(), token.clone()).await {
                        Ok(view) => {
                            slot.store(view);
                            view_token.cancel();
                            view_token = token;
                            seen_revision = r;
                        }
                        Err(e) => {
                            token.cancel();
                            quiet.warn(&format!("reloading the follower's view: {e}"));
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    quiet.warn(&format!("{e}"));
                    let _ = role.send(Role::Follower { leader: None });
                    continue;
                }
            }
            let l = match lease {
                Some(l) => match store.keep_alive(l).await {
                    Ok(()) => l,
                    Err(_) => {
                        lease = None;
                        continue;
                    }
                },
                None => match store.grant(ha.ttl).await {
                    Ok(l) => {
                        lease = Some(l);
                        l
                    }
                    Err(e) => {
                        quiet.warn(&format!("{e}"));
                        continue;
                    }
                },
            };
            // The lease was renewed no earlier than now.
            let renewed = Instant::now();
            match store.campaign(l, &ha.me).await {
                Ok(Campaign::Won { revision }) => break (revision, l, renewed),
                Ok(Campaign::Lost(leader)) => {
                    quiet.reset();
                    role.send_if_modified(|r| {
                        let next = Role::Follower {
                            leader: leader.clone(),
                        };
                        if *r == next {
                            false
                        } else {
                            *r = next;
                            true
                        }
                    });
                }
                Err(e) => quiet.warn(&format!("{e}")),
            }
        };

        // Lead.
        info!(id = %ha.me.id, revision, "elected leader: loading the state and resuming plans in flight");
        store.set_fence(Some(revision));
        let term = cancel.child_token();
        let opened = {
            let (cfg, store, term) = (cfg.clone(), store.clone(), term.clone());
            let store: Arc<dyn StateStore> = store;
            tokio::task::spawn_blocking(move || Services::open(&cfg, store, term)).await
        };
        match opened {
            Ok(Ok(ctl)) => {
                slot.store(Active::new(ctl));
                view_token.cancel();
            }
            other => {
                let e = match other {
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                    Ok(Ok(_)) => String::new(),
                };
                warn!("could not take over as leader: {e}; stepping down");
                term.cancel();
                let _ = store.revoke(lease_id).await;
                lease = None;
                continue 'follow;
            }
        }
        let _ = role.send(Role::Leader);
        info!(id = %ha.me.id, "leading");
        // Stop acting well before etcd could expire the lease: a renewal's lease runs
        // from when etcd received it, which is after we sent it.
        let step_down_after = ha.ttl * 2 / 3;
        let mut renewed = renewed;
        let why = loop {
            let deadline = tokio::time::Instant::from_std(renewed + step_down_after);
            let sent = Instant::now();
            tokio::select! {
                _ = cancel.cancelled() => break "shutting down",
                _ = tokio::time::sleep_until(deadline) => break "the lease could not be renewed in time",
                r = store.keep_alive(lease_id) => match r {
                    Ok(()) => renewed = sent,
                    Err(e) if e.to_string().contains("lease not found") => break "the lease is gone",
                    Err(e) => quiet.warn(&format!("renewing the leader's lease: {e}")),
                },
            }
            tokio::select! {
                _ = cancel.cancelled() => break "shutting down",
                _ = tokio::time::sleep_until(deadline) => break "the lease could not be renewed in time",
                _ = tokio::time::sleep(ha.ttl / 6) => {}
            }
        };
        // Refuse writes first, then stop every runner and loop of this term.
        let _ = role.send(Role::Follower { leader: None });
        store.set_fence(None);
        term.cancel();
        warn!(id = %ha.me.id, "stepped down as leader: {why}");
        let _ = store.revoke(lease_id).await;
        lease = None;
        seen_revision = -1;
        if cancel.is_cancelled() {
            return;
        }
    }
}

/// Logs a repeated failure once until it clears.
#[derive(Default)]
struct Quiet(Option<String>);

impl Quiet {
    fn warn(&mut self, msg: &str) {
        if self.0.as_deref() != Some(msg) {
            warn!("{msg}");
            self.0 = Some(msg.to_string());
        }
    }

    fn reset(&mut self) {
        if self.0.take().is_some() {
            info!("etcd reachable again");
        }
    }
}
