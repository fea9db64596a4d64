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

/// The readiness condition of a replica on etcd: a leader is known.
pub const LEADER: &str = "leader";

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

    /// Keeps the readiness condition [`LEADER`] until `cancel`: met while this replica
    /// leads or knows who does, unmet while no leader is known (etcd unreachable, an
    /// election in progress).
    pub async fn follow_leader(
        mut self,
        readiness: shardcast_identity::ready::Readiness,
        cancel: CancellationToken,
    ) {
        loop {
            match &*self.role.borrow_and_update() {
                Role::Leader | Role::Follower { leader: Some(_) } => readiness.met(LEADER),
                Role::Follower { leader: None } => readiness.unmet(
                    LEADER,
                    "no leader known (etcd unreachable or an election in progress)",
                ),
            }
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                r = self.role.changed() => if r.is_err() { return },
            }
        }
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

mod switch;
#[cfg(test)]
mod tests;
mod view;

pub use switch::{Front, LeaderGate, Switch, front_routes, http_router};
pub use view::{FirstView, first_view};
use view::{FollowerView, Quiet};

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
