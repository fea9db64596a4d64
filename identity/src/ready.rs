//! Readiness of a daemon, in one place: the conditions it waits for, the shutdown that
//! withdraws it, and the three ways it is read.
//!
//! ```text
//!  start-up ──require("store", why) … met("store")──▶ Readiness ──▶ GET /readyz  (200 | 503 + unmet lines)
//!  heartbeat / election ──met / unmet────────────────▶     │     ──▶ grpc.health.v1 (SERVING | NOT_SERVING)
//!  SIGTERM ──drain()─────────────────────────────────▶     │     ──▶ shardcast_ready gauge (1 | 0)
//! ```
//!
//! A daemon names each condition at start-up with [`Readiness::require`] (unmet, with the
//! reason a probe shows) and marks it [`Readiness::met`] when it holds; a condition that can
//! be lost again (the controller's leader) goes back with [`Readiness::unmet`]. It is ready
//! when every condition is met and it is not draining. [`Readiness::drain`] is one-way: from
//! the moment shutdown starts, the daemon is not ready, whatever else holds.
//!
//! `/readyz` and the gRPC health service reveal readiness only: the condition names and
//! reasons say what the daemon waits for (a listener, the store, a controller), never what
//! it holds. Who may ask: `/readyz` anyone (the HTTP listeners take anonymous requests for
//! it, for kubelet's probes); gRPC health any authenticated identity
//! ([`crate::Permission::Health`]), since the gRPC listeners require a client certificate
//! in the TLS handshake itself.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The gRPC path prefix of `grpc.health.v1.Health` (`Check` and `Watch`).
pub const HEALTH_SERVICE: &str = "/grpc.health.v1.Health/";

/// What a health call needs: [`crate::Permission::Health`] for `grpc.health.v1.Health`'s
/// methods, `None` for any other path (for the daemons' method tables).
pub fn health_permission(path: &str) -> Option<crate::Permission> {
    match path.strip_prefix(HEALTH_SERVICE) {
        Some("Check" | "Watch") => Some(crate::Permission::Health),
        _ => None,
    }
}

/// Why a daemon is not ready (the lines of a `503` from `/readyz`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotReady {
    /// Shutdown has begun (SIGTERM or Ctrl-C).
    Draining,
    /// These conditions do not hold: (name, reason), in the order they were required.
    Unmet(Vec<(&'static str, String)>),
}

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Draining => writeln!(f, "draining: shutting down"),
            Self::Unmet(unmet) => {
                for (name, why) in unmet {
                    writeln!(f, "{name}: {why}")?;
                }
                Ok(())
            }
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Every required condition, in order, with the reason while it is unmet.
    conditions: Vec<(&'static str, Option<String>)>,
    draining: bool,
}

impl State {
    fn check(&self) -> Result<(), NotReady> {
        if self.draining {
            return Err(NotReady::Draining);
        }
        let unmet: Vec<_> = self
            .conditions
            .iter()
            .filter_map(|(n, why)| why.clone().map(|w| (*n, w)))
            .collect();
        if unmet.is_empty() {
            Ok(())
        } else {
            Err(NotReady::Unmet(unmet))
        }
    }
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    ready: watch::Sender<bool>,
}

/// A daemon's readiness: named conditions and the drain flag; cheap to clone (one shared
/// state).
#[derive(Debug, Clone)]
pub struct Readiness(Arc<Inner>);

impl Default for Readiness {
    fn default() -> Self {
        Self::new()
    }
}

impl Readiness {
    /// No condition yet: ready until one is required.
    pub fn new() -> Self {
        let (ready, _) = watch::channel(true);
        Self(Arc::new(Inner {
            state: Mutex::new(State::default()),
            ready,
        }))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the state half-written (every
        // update is one assignment): keep serving with it.
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies `f` to the state and publishes the readiness it leaves.
    fn update(&self, f: impl FnOnce(&mut State)) {
        let mut s = self.state();
        f(&mut s);
        let ready = s.check().is_ok();
        self.0.ready.send_if_modified(|r| {
            let changed = *r != ready;
            *r = ready;
            changed
        });
    }

    /// Adds condition `name`, unmet because `why` (or sets it unmet again).
    pub fn require(&self, name: &'static str, why: impl Into<String>) {
        self.unmet(name, why);
    }

    /// Condition `name` holds now.
    pub fn met(&self, name: &'static str) {
        self.update(
            |s| match s.conditions.iter_mut().find(|(n, _)| *n == name) {
                Some(c) => c.1 = None,
                None => s.conditions.push((name, None)),
            },
        );
    }

    /// Condition `name` does not hold (any more), because `why`.
    pub fn unmet(&self, name: &'static str, why: impl Into<String>) {
        let why = why.into();
        self.update(
            |s| match s.conditions.iter_mut().find(|(n, _)| *n == name) {
                Some(c) => c.1 = Some(why),
                None => s.conditions.push((name, Some(why))),
            },
        );
    }

    /// Shutdown has begun: not ready from now on.
    pub fn drain(&self) {
        self.update(|s| s.draining = true);
    }

    /// Whether shutdown has begun.
    pub fn draining(&self) -> bool {
        self.state().draining
    }

    /// Ready, or why not.
    pub fn check(&self) -> Result<(), NotReady> {
        self.state().check()
    }

    /// Whether every condition holds and shutdown has not begun.
    pub fn is_ready(&self) -> bool {
        self.check().is_ok()
    }

    /// Readiness now, and each change after it.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.0.ready.subscribe()
    }

    /// The answer of `GET /readyz`: `200 ready`, or `503` with `not ready` and one line per
    /// unmet condition (`draining: shutting down` once shutdown began).
    pub fn http_answer(&self) -> (http::StatusCode, String) {
        match self.check() {
            Ok(()) => (http::StatusCode::OK, "ready\n".into()),
            Err(why) => (
                http::StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready\n{why}"),
            ),
        }
    }

    /// A `grpc.health.v1.Health` service that reports `services` (fully qualified names,
    /// e.g. `shardcast.agent.v1.Agent`) and the whole server (`""`) as `SERVING` while this
    /// is ready and `NOT_SERVING` otherwise, until `cancel`. Then every status is removed,
    /// so that open `Watch` streams end (after their last `NOT_SERVING`) and the server's
    /// graceful shutdown does not wait on them.
    pub async fn health_service(
        &self,
        services: &[&'static str],
        cancel: CancellationToken,
    ) -> tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>
    {
        let (reporter, server) = tonic_health::server::health_reporter();
        let mut names: Vec<&'static str> = vec![""];
        names.extend_from_slice(services);
        let mut ready = self.subscribe();
        // The first statuses are set before the server exists: no call sees a default.
        let status = |ready: bool| {
            if ready {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            }
        };
        let first = status(*ready.borrow_and_update());
        for n in &names {
            reporter.set_service_status(n, first).await;
        }
        tokio::spawn(async move {
            let mut reporter = reporter;
            loop {
                tokio::select! {
                    biased;
                    _ = cancel.cancelled() => break,
                    r = ready.changed() => if r.is_err() { break },
                }
                let now = status(*ready.borrow_and_update());
                for n in &names {
                    reporter.set_service_status(n, now).await;
                }
            }
            // A watcher's last message is the status set last (NOT_SERVING once draining).
            for n in &names {
                reporter.clear_service_status(n).await;
            }
        });
        server
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_when_every_condition_is_met_until_draining() {
        let r = Readiness::new();
        assert!(r.is_ready(), "nothing required");
        r.require("store", "recovering");
        r.require("controller", "no heartbeat answered yet");
        let (code, body) = r.http_answer();
        assert_eq!(code, http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body,
            "not ready\nstore: recovering\ncontroller: no heartbeat answered yet\n"
        );
        r.met("store");
        assert_eq!(
            r.check(),
            Err(NotReady::Unmet(vec![(
                "controller",
                "no heartbeat answered yet".into()
            )]))
        );
        r.met("controller");
        assert_eq!(r.http_answer(), (http::StatusCode::OK, "ready\n".into()));
        // A condition can be lost again, and found again.
        r.unmet("controller", "no leader known");
        assert!(!r.is_ready());
        r.met("controller");
        assert!(r.is_ready());
        // Draining wins over everything and is one-way.
        r.drain();
        assert_eq!(
            r.http_answer(),
            (
                http::StatusCode::SERVICE_UNAVAILABLE,
                "not ready\ndraining: shutting down\n".into()
            )
        );
        r.met("store");
        assert!(!r.is_ready() && r.draining());
    }

    #[test]
    fn subscribers_see_each_change_of_readiness() {
        let r = Readiness::new();
        let mut rx = r.subscribe();
        assert!(*rx.borrow_and_update());
        r.require("admin", "not bound");
        assert!(rx.has_changed().unwrap());
        assert!(!*rx.borrow_and_update());
        // A change of reason alone is no change of readiness.
        r.unmet("admin", "still not bound");
        assert!(!rx.has_changed().unwrap());
        r.met("admin");
        assert!(*rx.borrow_and_update());
    }

    #[test]
    fn only_the_health_methods_need_the_health_permission() {
        assert_eq!(
            health_permission("/grpc.health.v1.Health/Check"),
            Some(crate::Permission::Health)
        );
        assert_eq!(
            health_permission("/grpc.health.v1.Health/Watch"),
            Some(crate::Permission::Health)
        );
        assert_eq!(health_permission("/grpc.health.v1.Health/List"), None);
        assert_eq!(health_permission("/shardcast.agent.v1.Agent/Stats"), None);
    }
}
