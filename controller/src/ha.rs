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
//!   ([`Services::open_read_only`]: no runner or loop starts), loaded whole once at one
//!   etcd revision ([`crate::etcd::EtcdSnapshot`]) and then kept current by a watch from
//!   the next revision: each put or delete is decoded as a load would and applied to the
//!   view (`apply`), a transaction's changes under one lock. A broken watch (etcd
//!   unreachable or restarted) is resumed from the first revision not seen; only when
//!   etcd has compacted that revision away is the view loaded whole again (and a line
//!   logged). The counts are in `GET /v1/replica` (`view`). Every write — including
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
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::Router;
use axum::body::Body;
use axum::response::IntoResponse;
use shardcast_identity::Permission;
use shardcast_identity::grpc::Gate;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;
use tracing::{info, warn};

use crate::core::{ModelRecord, lock};
use crate::error::{ApiError, RecordError};
use crate::etcd::{Campaign, Change, EtcdSnapshot, EtcdStore, LeaderInfo, WatchEvent, WatchLoss};
use crate::inventory::{HostEntry, StoredHost};
use crate::plan::Plan;
use crate::services::{Config, Services};
use crate::state::{StateStore, Table};

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

/// How a follower's view has kept up with etcd: for `GET /v1/replica` and the benchmarks.
#[derive(Debug, Default)]
pub struct ViewStats {
    /// Whole-state loads: the first view, after leading, after a compaction.
    full_loads: AtomicU64,
    /// Records changed through the watch.
    applied: AtomicU64,
    /// Watches that broke (each resumed from the first revision not seen, at the next
    /// campaign round; attempts while etcd is unreachable count too).
    resumed: AtomicU64,
    /// The etcd revision the view reflects (0: none yet, or leading).
    revision: AtomicI64,
}

impl ViewStats {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "full_loads": self.full_loads.load(Ordering::Relaxed),
            "applied": self.applied.load(Ordering::Relaxed),
            "resumed": self.resumed.load(Ordering::Relaxed),
            "revision": self.revision.load(Ordering::Relaxed),
        })
    }

    /// (whole-state loads, records applied from the watch, watches resumed).
    pub fn counts(&self) -> (u64, u64, u64) {
        (
            self.full_loads.load(Ordering::Relaxed),
            self.applied.load(Ordering::Relaxed),
            self.resumed.load(Ordering::Relaxed),
        )
    }
}

/// This replica's identity and role, shared by the gates and the status route.
#[derive(Clone)]
pub struct Replica {
    id: String,
    role: watch::Receiver<Role>,
    view: Arc<ViewStats>,
}

impl Replica {
    /// A replica called `id` whose role is published on `role` and whose follower view
    /// reports to `view`.
    pub fn new(id: impl Into<String>, role: watch::Receiver<Role>, view: Arc<ViewStats>) -> Self {
        Self {
            id: id.into(),
            role,
            view,
        }
    }

    /// The single replica of an embedded store: always the leader.
    pub fn solo() -> Self {
        let (_tx, rx) = watch::channel(Role::Leader);
        Self::new("solo", rx, Arc::default())
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

    /// `GET /v1/replica`: this replica's id and role, the leader, and how its follower
    /// view kept up (counted over the process's life).
    fn status_json(&self) -> serde_json::Value {
        let view = self.view.json();
        match self.role() {
            Role::Leader => {
                serde_json::json!({"id": self.id, "role": "leader", "leader": null, "view": view})
            }
            Role::Follower { leader } => {
                serde_json::json!({"id": self.id, "role": "follower", "leader": leader, "view": view})
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

/// A follower's view loaded whole, and what the watch needs to follow it.
pub struct FirstView {
    /// Ends the view's own tasks (its write-behind) once another replaces it.
    token: CancellationToken,
    /// The etcd revision it was read at.
    revision: i64,
}

/// The first view, before any election: the stored state at one revision, read-only.
/// Retries while etcd is unreachable, for at most `patience`.
pub async fn first_view(
    cfg: &Config,
    store: Arc<EtcdStore>,
    cancel: &CancellationToken,
    patience: Duration,
    stats: &ViewStats,
) -> anyhow::Result<(Arc<Active>, FirstView)> {
    let until = Instant::now() + patience;
    // Exponential from 250 ms to 2 s, with jitter: replicas that lost etcd together do not
    // come back to it together.
    let mut pauses = {
        use backon::BackoffBuilder as _;
        backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(250))
            .with_factor(2.0)
            .with_max_delay(Duration::from_secs(2))
            .without_max_times()
            .with_jitter()
            .build()
    };
    loop {
        let token = cancel.child_token();
        match load_view(cfg, &store, token.clone()).await {
            Ok((a, revision)) => {
                stats.full_loads.fetch_add(1, Ordering::Relaxed);
                stats.revision.store(revision, Ordering::Relaxed);
                return Ok((a, FirstView { token, revision }));
            }
            Err(e) if Instant::now() < until => {
                token.cancel();
                warn!("loading the state from etcd: {e}; retrying");
                let pause = pauses.next().unwrap_or(Duration::from_secs(2));
                tokio::time::sleep(pause.min(until.saturating_duration_since(Instant::now())))
                    .await;
            }
            Err(e) => {
                token.cancel();
                anyhow::bail!("loading the state from etcd (gave up after {patience:?}): {e}")
            }
        }
    }
}

/// A read-only view of the whole state as etcd holds it now, and the revision it is at.
async fn load_view(
    cfg: &Config,
    store: &Arc<EtcdStore>,
    cancel: CancellationToken,
) -> Result<(Arc<Active>, i64), ViewError> {
    let revision = store.revision().await?;
    let cfg = cfg.clone();
    let snapshot: Arc<dyn StateStore> = Arc::new(EtcdSnapshot::new(store.clone(), revision));
    let view =
        tokio::task::spawn_blocking(move || Services::open_read_only(&cfg, snapshot, cancel))
            .await
            .map_err(|e| ViewError::Task(e.to_string()))?
            .map(Active::new)?;
    Ok((view, revision))
}

/// Why a follower's view could not be loaded or kept current.
#[derive(Debug, thiserror::Error)]
enum ViewError {
    /// etcd did not answer.
    #[error(transparent)]
    Store(#[from] crate::state::StateError),
    /// The state did not load.
    #[error(transparent)]
    Open(#[from] ApiError),
    /// The loading task failed.
    #[error("loading the view: {0}")]
    Task(String),
}

/// A follower's view in the slot and the watch that keeps it current.
struct FollowerView {
    cfg: Config,
    store: Arc<EtcdStore>,
    slot: Slot,
    cancel: CancellationToken,
    stats: Arc<ViewStats>,
    /// Ends the view's tasks and its watch.
    token: CancellationToken,
    /// The first revision the view has not seen; `None`: it must be loaded whole (there
    /// is none, a compaction overtook it, or the slot holds a leader's controller).
    next: Option<i64>,
    watch: Option<mpsc::Receiver<WatchEvent>>,
    /// The view was loaded and no watch has started from it yet (no need to check that
    /// etcd still has its revision).
    fresh: bool,
    /// A broken watch was logged; quiet until it works again.
    broken_logged: bool,
}

impl FollowerView {
    /// Loads the view whole (at one revision) into the slot.
    async fn load(&mut self) -> Result<(), ViewError> {
        let token = self.cancel.child_token();
        match load_view(&self.cfg, &self.store, token.clone()).await {
            Ok((view, revision)) => {
                self.slot.store(view);
                self.token.cancel();
                self.token = token;
                self.next = Some(revision + 1);
                self.watch = None;
                self.fresh = true;
                self.stats.full_loads.fetch_add(1, Ordering::Relaxed);
                self.stats.revision.store(revision, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                token.cancel();
                Err(e)
            }
        }
    }

    /// Starts a watch from the first revision not seen, unless one runs (once per campaign
    /// round at most, so an unreachable etcd is not retried in a loop). Resuming after a
    /// break, it first checks that etcd has not gone back to an older revision (restored
    /// from a backup, or replaced): a watch from a revision that etcd has not reached would
    /// wait, silently, instead of failing; the view is then loaded whole.
    async fn ensure_watch(&mut self) -> Result<(), ViewError> {
        let (None, Some(next)) = (&self.watch, self.next) else {
            return Ok(());
        };
        if !self.fresh {
            let now = self.store.revision().await?;
            if now < next - 1 {
                warn!(
                    now,
                    next,
                    "follower view: etcd's revision is behind the view's (etcd restored or replaced): reloading the whole state"
                );
                self.load().await?;
            }
        }
        if let Some(next) = self.next {
            self.watch = Some(self.store.watch(next, self.token.child_token()));
            self.fresh = false;
        }
        Ok(())
    }

    /// The watch's next event (pending while there is no watch).
    async fn event(&mut self) -> Option<WatchEvent> {
        match &mut self.watch {
            Some(rx) => rx.recv().await,
            None => std::future::pending().await,
        }
    }

    /// Applies one event; whether the leader key was deleted (an election is open).
    fn handle(&mut self, event: Option<WatchEvent>) -> bool {
        let loss = match event {
            Some(WatchEvent::Changes {
                revision,
                changes,
                leader_gone,
            }) => {
                if self.next.is_none() {
                    return false;
                }
                if self.broken_logged {
                    info!(revision, "follower view: the state watch works again");
                    self.broken_logged = false;
                }
                let n = changes.len() as u64;
                apply(&self.slot.load().ctl, changes);
                self.next = Some(revision + 1);
                self.stats.applied.fetch_add(n, Ordering::Relaxed);
                self.stats.revision.store(revision, Ordering::Relaxed);
                return leader_gone;
            }
            Some(WatchEvent::Lost(loss)) => loss,
            None => WatchLoss::Broken("the watch task ended".into()),
        };
        self.watch = None;
        match loss {
            WatchLoss::Compacted { .. } => {
                warn!("follower view: {loss}: reloading the whole state");
                self.next = None;
            }
            WatchLoss::Broken(_) => {
                if !self.broken_logged {
                    warn!(
                        next = ?self.next,
                        "follower view: {loss}; resuming from the first revision not seen"
                    );
                    self.broken_logged = true;
                }
                self.stats.resumed.fetch_add(1, Ordering::Relaxed);
            }
        }
        false
    }

    /// The slot now holds a leader's controller: stop following.
    fn retire(&mut self) {
        self.token.cancel();
        self.watch = None;
        self.next = None;
        self.stats.revision.store(0, Ordering::Relaxed);
    }
}

/// Runs this replica's election until `cancel`: follows, leads when elected, steps down
/// when its lease cannot be renewed in time, and follows again.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    cfg: Config,
    ha: HaConfig,
    store: Arc<EtcdStore>,
    slot: Slot,
    role: watch::Sender<Role>,
    cancel: CancellationToken,
    first: FirstView,
    stats: Arc<ViewStats>,
) {
    let mut view = FollowerView {
        cfg: cfg.clone(),
        store: store.clone(),
        slot: slot.clone(),
        cancel: cancel.clone(),
        stats,
        token: first.token,
        next: Some(first.revision + 1),
        watch: None,
        fresh: true,
        broken_logged: false,
    };
    let metrics = cfg.core.metrics.clone();
    metrics.elected();
    let mut lease: Option<i64> = None;
    let mut quiet = Quiet::default();
    let mut tick = tokio::time::interval(ha.campaign);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // No leader known, etcd failing: said once until it answers again.
    let unreachable = |quiet: &mut Quiet, msg: String| {
        quiet.warn(&msg);
        role.send_if_modified(|r| {
            let next = Role::Follower { leader: None };
            let changed = *r != next;
            *r = next;
            changed
        });
    };
    'follow: loop {
        let _ = role.send(Role::Follower { leader: None });
        store.set_fence(None);
        // Follow until elected.
        let (revision, lease_id, renewed) = loop {
            // The campaign tick first: a stream of changes must not hold the election off.
            tokio::select! {
                biased;
                _ = cancel.cancelled() => {
                    if let Some(l) = lease { let _ = store.revoke(l).await; }
                    view.retire();
                    return;
                }
                _ = tick.tick() => {}
                ev = view.event() => {
                    if view.handle(ev) {
                        // The leader's key is gone: campaign now, not at the next tick.
                        tick.reset_immediately();
                    }
                    continue;
                }
            }
            if view.next.is_none()
                && let Err(e) = view.load().await
            {
                unreachable(&mut quiet, format!("loading the follower's view: {e}"));
                continue;
            }
            if let Err(e) = view.ensure_watch().await {
                unreachable(&mut quiet, format!("watching the state: {e}"));
                continue;
            }
            let l = match lease {
                Some(l) => match store.keep_alive(l).await {
                    Ok(()) => l,
                    Err(e) => {
                        lease = None;
                        unreachable(&mut quiet, format!("{e}"));
                        continue;
                    }
                },
                None => match store.grant(ha.ttl).await {
                    Ok(l) => {
                        lease = Some(l);
                        l
                    }
                    Err(e) => {
                        unreachable(&mut quiet, format!("{e}"));
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
                Err(e) => unreachable(&mut quiet, format!("{e}")),
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
                view.retire();
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
        metrics.became_leader();
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
        metrics.stepped_down();
        warn!(id = %ha.me.id, "stepped down as leader: {why}");
        let _ = store.revoke(lease_id).await;
        lease = None;
        if cancel.is_cancelled() {
            return;
        }
        // The slot holds this term's controller until the next round loads a view.
    }
}

/// One record of a change, decoded off the state lock.
enum Record {
    Model(String, Option<ModelRecord>),
    Manifest(String, Option<Arc<Vec<u8>>>),
    Host(String, Option<StoredHost>),
    Plan(String, Option<Plan>),
    Usage(String, Option<Vec<u8>>),
    PartitionPlans(String, Option<Vec<u8>>),
}

impl Record {
    /// Decodes as [`Services::open_read_only`] does; an unreadable record counts as
    /// gone (a load would skip it), with a warning.
    fn decode(c: Change) -> Self {
        fn read<T>(
            what: &str,
            key: &str,
            bytes: Option<Vec<u8>>,
            decode: fn(&[u8]) -> Result<T, RecordError>,
        ) -> Option<T> {
            match decode(&bytes?) {
                Ok(v) => Some(v),
                Err(e) => {
                    warn!(%key, "follower view: skipping an unreadable {what} record: {e}");
                    None
                }
            }
        }
        let Change { table, key, value } = c;
        match table {
            Table::Models => {
                let v = read("model", &key, value, ModelRecord::read);
                Self::Model(key, v)
            }
            Table::Manifests => Self::Manifest(key, value.map(Arc::new)),
            Table::Hosts => {
                let v = read("host", &key, value, crate::wire::read_host_record);
                Self::Host(key, v)
            }
            Table::Plans => {
                let v = read("plan", &key, value, crate::wire::read_plan_record);
                Self::Plan(key, v)
            }
            Table::Usage => Self::Usage(key, value),
            Table::PartitionPlans => Self::PartitionPlans(key, value),
        }
    }
}

/// Applies changes seen through the watch to a follower's read-only view, in order, the
/// state's under one lock. A changed host is up and seen now (a follower never marks
/// hosts down; its `last_seen_s` is the time since the host's record last changed). A
/// plan's watchers get each stored update, and are dropped when it ends, as the
/// leader's are.
pub(crate) fn apply(ctl: &Services, changes: Vec<Change>) {
    let records: Vec<Record> = changes.into_iter().map(Record::decode).collect();
    let now = Instant::now();
    let mut st = lock(&ctl.core.state);
    let mut inv = ctl.core.inventory.lock();
    for r in records {
        match r {
            Record::Model(name, m) => ctl.core.registry().apply_model(name, m),
            Record::Manifest(digest, m) => ctl.core.registry().apply_manifest(digest, m),
            Record::Host(id, Some(r)) => {
                inv.hosts.insert(id, HostEntry::restored(r, now));
            }
            Record::Host(id, None) => {
                inv.hosts.remove(&id);
            }
            Record::Plan(id, Some(p)) => {
                let running = p.running();
                match st.watchers.get(&id) {
                    Some(w) => {
                        w.send_replace(p.clone());
                    }
                    None if running => {
                        st.watchers
                            .insert(id.clone(), watch::Sender::new(p.clone()));
                    }
                    None => {}
                }
                if !running {
                    st.watchers.remove(&id);
                }
                st.insert_plan(id, p);
            }
            Record::Plan(id, None) => {
                if let Some(p) = st.plans.remove(&id) {
                    for h in &p.hosts {
                        if let Some(ids) = st.receiver_plans.get_mut(&h.host) {
                            ids.retain(|x| *x != id);
                        }
                    }
                }
                st.watchers.remove(&id);
            }
            Record::Usage(digest, v) => ctl.core.usage().apply_stored(&digest, v.as_deref()),
            Record::PartitionPlans(name, v) => ctl.tables.apply_stored(&name, v.as_deref()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{PlanKind, PlanState, ReceiverProgress, ReceiverState, StoredPlanRef};
    use crate::state::RedbStore;
    use shardcast_placement::Tier;

    fn model(name: &str, digest: &str) -> Vec<u8> {
        serde_json::to_vec(&ModelRecord {
            version: crate::core::MODEL_RECORD_VERSION.into(),
            name: name.into(),
            digest: digest.into(),
            origin: "file:///m/".into(),
            chunk_size: 1 << 20,
            total_bytes: 10,
            shards: vec![("a.safetensors".into(), 10, 1)],
            registered_at: 1.0,
            profile: None,
            read_origin: String::new(),
        })
        .unwrap()
    }

    fn host(id: &str) -> Vec<u8> {
        serde_json::to_vec(&StoredHost {
            version: crate::inventory::HOST_RECORD_VERSION.into(),
            host: crate::inventory::HostView {
                host_id: id.into(),
                rack: "r1".into(),
                data_addr: "127.0.0.1:1".into(),
                agent_addr: "127.0.0.1:2".into(),
                ..Default::default()
            },
            gpu_reserved: Default::default(),
            pending_evictions: Vec::new(),
        })
        .unwrap()
    }

    fn plan(id: &str, state: PlanState) -> (Plan, Vec<u8>) {
        let p = Plan {
            state,
            ..Plan::started(
                id,
                ("org/m", "d1"),
                Tier::Memory,
                PlanKind::Chains,
                vec![ReceiverProgress::new("h1", ReceiverState::Receiving)],
                "file:///m/",
                10.0,
            )
        };
        let bytes = serde_json::to_vec(&StoredPlanRef::V1(&p)).unwrap();
        (p, bytes)
    }

    fn put(table: Table, key: &str, value: Vec<u8>) -> Change {
        Change {
            table,
            key: key.into(),
            value: Some(value),
        }
    }

    fn del(table: Table, key: &str) -> Change {
        Change {
            table,
            key: key.into(),
            value: None,
        }
    }

    /// Changes applied one by one leave a view equal to a whole load of the same state.
    #[tokio::test]
    async fn applied_changes_match_a_whole_load() {
        let dir = tempfile::tempdir().unwrap();
        let cancel = CancellationToken::new();
        let empty: Arc<dyn StateStore> =
            Arc::new(RedbStore::open(&dir.path().join("empty.redb")).unwrap());
        let view = Services::open_read_only(&Config::default(), empty, cancel.clone()).unwrap();
        let (running, running_bytes) = plan("p1", PlanState::Running);
        let (_, p2_running) = plan("p2", PlanState::Running);
        let (p2_done, p2_done_bytes) = plan("p2", PlanState::Done);
        let steps = vec![
            vec![put(Table::Models, "org/a", model("org/a", "d0"))],
            vec![
                put(Table::Models, "org/m", model("org/m", "d1")),
                put(Table::Manifests, "d1", b"manifest".to_vec()),
            ],
            vec![
                put(Table::Hosts, "h1", host("h1")),
                put(Table::Hosts, "h2", host("h2")),
            ],
            vec![put(Table::Plans, "p1", running_bytes)],
            vec![put(Table::Plans, "p2", p2_running)],
            vec![del(Table::Models, "org/a"), del(Table::Hosts, "h2")],
            vec![put(Table::Usage, "d1", b"1234.5".to_vec())],
            vec![put(Table::Plans, "p9", b"not json".to_vec())],
        ];
        for step in steps {
            apply(&view, step);
        }
        // A watcher of a running plan follows its stored updates to the end.
        let (_, rx) = view.core.watch_plan("p2").unwrap();
        let mut rx = rx.expect("a running plan has watchers");
        apply(&view, vec![put(Table::Plans, "p2", p2_done_bytes)]);
        rx.changed().await.unwrap();
        assert_eq!(*rx.borrow_and_update(), p2_done);
        assert!(
            view.core.watch_plan("p2").unwrap().1.is_none(),
            "ended: no watchers"
        );
        assert!(view.core.watch_plan("p1").unwrap().1.is_some());

        // The same state written to a store and loaded whole.
        let full = RedbStore::open(&dir.path().join("full.redb")).unwrap();
        full.put(Table::Models, "org/m", &model("org/m", "d1"))
            .unwrap();
        full.put(Table::Manifests, "d1", b"manifest").unwrap();
        full.put(Table::Hosts, "h1", &host("h1")).unwrap();
        full.put(
            Table::Plans,
            "p1",
            &serde_json::to_vec(&StoredPlanRef::V1(&running)).unwrap(),
        )
        .unwrap();
        full.put(
            Table::Plans,
            "p2",
            &serde_json::to_vec(&StoredPlanRef::V1(&p2_done)).unwrap(),
        )
        .unwrap();
        full.put(Table::Usage, "d1", b"1234.5").unwrap();
        let loaded =
            Services::open_read_only(&Config::default(), Arc::new(full), cancel.clone()).unwrap();

        assert_eq!(view.core.list_models(), loaded.core.list_models());
        let hosts = |c: &Services| {
            c.core
                .list_hosts()
                .into_iter()
                .map(|h| (h.report, h.up, h.gpus_reserved))
                .collect::<Vec<_>>()
        };
        assert_eq!(hosts(&view), hosts(&loaded));
        let plans = |c: &Services| {
            let mut v = c.core.list_plans(Plan::clone);
            v.sort_by(|a, b| a.id.cmp(&b.id));
            v
        };
        assert_eq!(plans(&view), plans(&loaded));
        assert_eq!(
            view.core.get_status("org/m").unwrap(),
            loaded.core.get_status("org/m").unwrap()
        );
        assert_eq!(view.core.usage().last("d1"), 1234.5);
        assert_eq!(
            lock(&view.core.state).receiver_plans.get("h1"),
            lock(&loaded.core.state).receiver_plans.get("h1")
        );

        // A deleted plan leaves the receiver index too.
        apply(&view, vec![del(Table::Plans, "p1")]);
        assert!(view.core.get_plan("p1").is_err());
        assert_eq!(
            lock(&view.core.state).receiver_plans.get("h1"),
            Some(&vec!["p2".to_string()])
        );
        cancel.cancel();
    }
}
