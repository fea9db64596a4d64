//! The controller's `/metrics` (HTTP front end, [`crate::http`]), through
//! `prometheus_client`: nothing is written by hand.
//!
//! [`ControllerMetrics`] is made once per process with the configuration
//! ([`ControllerConfig::metrics`](crate::core::ControllerConfig::metrics)) and shared by
//! every controller opened with it: a replica's successive terms and follower views
//! (`crate::ha`) add to the same series. It holds a registry of what is observed as it
//! happens:
//!
//! * `shardcast_api_request_seconds{transport,method}`: API latency per method, gRPC
//!   (timed in each handler, `crate::grpc`) and HTTP (a route layer, by route);
//! * `shardcast_plan_ready_seconds{state}`: per plan that ended, seconds from its creation
//!   to its end, by how it ended (`done`, `partial`, `failed`);
//!   `shardcast_receiver_ready_seconds`: per receiver that came to hold a copy, seconds
//!   from its plan's start; `shardcast_plans_ended_total{state}`;
//! * `shardcast_evictions_total{tier}`, `shardcast_evicted_hosts_total{tier}`,
//!   `shardcast_evicted_bytes_total`: `Evict` calls that removed copies (the API, the
//!   autoscaler's scale-downs and the tier sweeper all go through it);
//! * `shardcast_registrations_started_total`, `shardcast_registrations_ended_total{outcome}`;
//! * `shardcast_leader_terms_total`, `shardcast_leader_step_downs_total`: fail-overs seen
//!   by this replica (elected, stepped down).
//!
//! At each scrape, `StateCollector` reads the controller answering it: the series that
//! existed before the registry (same names, types and labels: autoscaler decisions by
//! kind, API refusals, HTTP timeouts, origin refusals, connection limits) and gauges of
//! its state: plans by state, receivers of running plans by state, hosts registered and
//! up, models, registrations in progress, pending evictions and whether it leads.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::plan::{Plan, ReceiverState};

/// The `Content-Type` of `/metrics`: the Prometheus text format 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Bucket bounds of the latency histograms, seconds: 1 ms to 30 s.
const API_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Bucket bounds of the time-to-ready histograms, seconds: 100 ms to 1 h.
const READY_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 1800.0, 3600.0,
];

fn api_histogram() -> Histogram {
    Histogram::new(API_BUCKETS.iter().copied())
}

fn ready_histogram() -> Histogram {
    Histogram::new(READY_BUCKETS.iter().copied())
}

/// Labels of an API call: `transport` (`grpc`, `http`) and `method` (the gRPC method, or
/// the HTTP method and route).
type ApiLabels = [(&'static str, String); 2];
/// One label.
type OneLabel = [(&'static str, &'static str); 1];

/// What the controller observes as it happens (see the module docs).
#[derive(Debug)]
pub struct ControllerMetrics {
    registry: Registry,
    api: Family<ApiLabels, Histogram, fn() -> Histogram>,
    plan_ready: Family<OneLabel, Histogram, fn() -> Histogram>,
    receiver_ready: Histogram,
    plans_ended: Family<OneLabel, Counter>,
    evictions: Family<OneLabel, Counter>,
    evicted_hosts: Family<OneLabel, Counter>,
    evicted_bytes: Counter,
    registrations_started: Counter,
    registrations_ended: Family<OneLabel, Counter>,
    leader_terms: Counter,
    step_downs: Counter,
    /// This replica runs under leader election (`crate::ha`); otherwise it always leads.
    elected: AtomicBool,
    /// The process's readiness, for `shardcast_ready` (set once at start-up).
    readiness: std::sync::OnceLock<shardcast_identity::ready::Readiness>,
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        let m = Self {
            registry: Registry::with_prefix("shardcast"),
            api: Family::new_with_constructor(api_histogram),
            plan_ready: Family::new_with_constructor(ready_histogram),
            receiver_ready: ready_histogram(),
            plans_ended: Family::default(),
            evictions: Family::default(),
            evicted_hosts: Family::default(),
            evicted_bytes: Counter::default(),
            registrations_started: Counter::default(),
            registrations_ended: Family::default(),
            leader_terms: Counter::default(),
            step_downs: Counter::default(),
            elected: AtomicBool::new(false),
            readiness: std::sync::OnceLock::new(),
        };
        m.with_registry()
    }
}

impl ControllerMetrics {
    /// The readiness `shardcast_ready` reports (the first one set counts).
    pub fn set_readiness(&self, readiness: shardcast_identity::ready::Readiness) {
        let _ = self.readiness.set(readiness);
    }

    /// Registers every metric (clones share their values).
    fn with_registry(mut self) -> Self {
        let r = &mut self.registry;
        r.register(
            "api_request_seconds",
            "API calls by transport (grpc, http) and method: seconds to the answer (a stream's first message)",
            self.api.clone(),
        );
        r.register(
            "plan_ready_seconds",
            "Plans that ended, by state (done, partial, failed): seconds from the plan's creation to its end",
            self.plan_ready.clone(),
        );
        r.register(
            "receiver_ready_seconds",
            "Receivers that came to hold a verified copy (resident, for tier gpu): seconds from their plan's start",
            self.receiver_ready.clone(),
        );
        r.register(
            "plans_ended",
            "Plans that ended, by state (done, partial, failed)",
            self.plans_ended.clone(),
        );
        r.register(
            "evictions",
            "Evict calls that removed copies, by tier (the API, autoscaler scale-downs and the tier sweeper)",
            self.evictions.clone(),
        );
        r.register(
            "evicted_hosts",
            "Hosts whose copy (or GPU slots) an eviction removed, by tier",
            self.evicted_hosts.clone(),
        );
        r.register(
            "evicted_bytes",
            "Bytes the hosts freed by evictions",
            self.evicted_bytes.clone(),
        );
        r.register(
            "registrations_started",
            "Model registrations started (a job per name and origin)",
            self.registrations_started.clone(),
        );
        r.register(
            "registrations_ended",
            "Model registrations that ended, by outcome (ok, failed)",
            self.registrations_ended.clone(),
        );
        r.register(
            "leader_terms",
            "Times this replica was elected leader",
            self.leader_terms.clone(),
        );
        r.register(
            "leader_step_downs",
            "Times this replica stopped leading (lease lost, etcd unreachable, shutdown)",
            self.step_downs.clone(),
        );
        self
    }

    /// Starts timing an API call; observed when the guard drops.
    pub fn time(&self, transport: &'static str, method: String) -> ApiTimer {
        ApiTimer {
            histogram: self
                .api
                .get_or_create(&[("transport", transport.to_string()), ("method", method)])
                .clone(),
            start: Instant::now(),
        }
    }

    /// Records `plan`, which has just ended.
    pub fn plan_ended(&self, plan: &Plan) {
        let state: OneLabel = [("state", plan.state.as_str())];
        self.plans_ended.get_or_create(&state).inc();
        if let Some(end) = plan.ended_at {
            self.plan_ready
                .get_or_create(&state)
                .observe((end - plan.created_at).max(0.0));
        }
        for h in &plan.hosts {
            if h.state == ReceiverState::Done && h.done_s > 0.0 {
                self.receiver_ready.observe(h.done_s);
            }
        }
    }

    /// Records an eviction in `tier` that removed the copies of `hosts` hosts.
    pub fn evicted(&self, tier: &'static str, hosts: usize, bytes: u64) {
        if hosts == 0 {
            return;
        }
        let tier: OneLabel = [("tier", tier)];
        self.evictions.get_or_create(&tier).inc();
        self.evicted_hosts.get_or_create(&tier).inc_by(hosts as u64);
        self.evicted_bytes.inc_by(bytes);
    }

    /// Records a registration job that started.
    pub fn registration_started(&self) {
        self.registrations_started.inc();
    }

    /// Records a registration job that ended.
    pub fn registration_ended(&self, ok: bool) {
        let outcome = if ok { "ok" } else { "failed" };
        self.registrations_ended
            .get_or_create(&[("outcome", outcome)])
            .inc();
    }

    /// This replica runs under leader election: it leads only between
    /// [`Self::became_leader`] and [`Self::stepped_down`].
    pub fn elected(&self) {
        self.elected.store(true, Ordering::Relaxed);
    }

    /// This replica was elected leader.
    pub fn became_leader(&self) {
        self.leader_terms.inc();
    }

    /// This replica stopped leading.
    pub fn stepped_down(&self) {
        self.step_downs.inc();
    }

    /// Whether this replica leads now (always, without leader election).
    pub fn leads(&self) -> bool {
        !self.elected.load(Ordering::Relaxed) || self.leader_terms.get() > self.step_downs.get()
    }

    /// Registrations started and not ended.
    pub(crate) fn registrations_in_progress(&self) -> u64 {
        let ended: u64 = ["ok", "failed"]
            .iter()
            .map(|o| {
                self.registrations_ended
                    .get_or_create(&[("outcome", *o)])
                    .get()
            })
            .sum();
        self.registrations_started.get().saturating_sub(ended)
    }

    /// `/metrics`: what `state` reads at scrape time (the answering controller's plans,
    /// hosts and models, `crate::exposition`), `shardcast_ready`, then the registry.
    pub fn render(&self, state: Box<dyn Collector>) -> String {
        let mut scrape = Registry::with_prefix("shardcast");
        scrape.register_collector(state);
        if let Some(r) = self.readiness.get() {
            scrape.register_collector(Box::new(ReadyGauge(r.clone())));
        }
        let mut out = String::new();
        for r in [&scrape, &self.registry] {
            // Writing to a String fails only if an encoder does; ours do not.
            if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, r) {
                tracing::warn!("encoding /metrics: {e}");
            }
        }
        out
    }
}

/// `shardcast_ready`: 1 while the process is ready (what `/readyz` and gRPC health
/// answer), read at each scrape.
#[derive(Debug)]
struct ReadyGauge(shardcast_identity::ready::Readiness);

impl Collector for ReadyGauge {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let g = ConstGauge::new(u64::from(self.0.is_ready()));
        g.encode(enc.encode_descriptor(
            "ready",
            "1 when every readiness condition holds (listeners up, state loaded, on etcd a leader known) and shutdown has not begun, else 0: what /readyz and gRPC health answer.",
            None,
            g.metric_type(),
        )?)
    }
}

/// Observes an API call's duration when dropped ([`ControllerMetrics::time`]).
#[derive(Debug)]
pub struct ApiTimer {
    histogram: Histogram,
    start: Instant,
}

impl ApiTimer {
    /// Time since the call started.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

impl Drop for ApiTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

/// Times each HTTP request by its route (`GET /v1/plans/{id}`): an axum route layer, so
/// only routes that exist get a series.
pub async fn time_http(
    axum::extract::State(metrics): axum::extract::State<Arc<ControllerMetrics>>,
    path: Option<axum::extract::MatchedPath>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let route = path.as_ref().map_or("other", |p| p.as_str());
    let _timer = metrics.time("http", format!("{} {route}", req.method()));
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{PlanKind, ReceiverProgress};
    use shardcast_placement::Tier;

    fn text(m: &ControllerMetrics) -> String {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &m.registry)
            .expect("encode");
        out
    }

    fn value(text: &str, series: &str) -> Option<String> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .map(str::to_string)
    }

    #[test]
    fn plans_receivers_evictions_and_registrations_are_counted() {
        let m = ControllerMetrics::default();
        let host = |name: &str, state, done_s| ReceiverProgress {
            done_s,
            ..ReceiverProgress::new(name, state)
        };
        let mut plan = Plan::started(
            "p1",
            ("org/m", "d"),
            Tier::Memory,
            PlanKind::Chains,
            vec![
                host("a", ReceiverState::Done, 2.0),
                host("b", ReceiverState::Done, 3.0),
                host("c", ReceiverState::Lost, 0.0),
            ],
            "file:///m",
            100.0,
        );
        assert!(plan.settle(104.5));
        m.plan_ended(&plan);
        m.evicted("memory", 2, 300);
        m.evicted("gpu", 0, 0);
        m.registration_started();
        m.registration_started();
        m.registration_ended(false);
        let t = text(&m);
        let v = |s: &str| value(&t, s);
        for (series, want) in [
            ("shardcast_plans_ended_total{state=\"partial\"}", "1"),
            ("shardcast_plan_ready_seconds_count{state=\"partial\"}", "1"),
            ("shardcast_plan_ready_seconds_sum{state=\"partial\"}", "4.5"),
            ("shardcast_receiver_ready_seconds_count", "2"),
            ("shardcast_receiver_ready_seconds_sum", "5.0"),
            ("shardcast_receiver_ready_seconds_bucket{le=\"2.5\"}", "1"),
            ("shardcast_evictions_total{tier=\"memory\"}", "1"),
            ("shardcast_evicted_hosts_total{tier=\"memory\"}", "2"),
        ] {
            assert_eq!(v(series).as_deref(), Some(want), "{series}");
        }
        assert_eq!(v("shardcast_evicted_bytes_total").as_deref(), Some("300"));
        // An eviction that removed nothing is not one.
        assert!(!t.contains("tier=\"gpu\""), "{t}");
        assert_eq!(m.registrations_in_progress(), 1);
        assert_eq!(
            v("shardcast_registrations_ended_total{outcome=\"failed\"}").as_deref(),
            Some("1")
        );
    }

    #[test]
    fn api_timer_observes_on_drop_by_transport_and_method() {
        let m = ControllerMetrics::default();
        for _ in 0..3 {
            let _t = m.time("grpc", "Prewarm".into());
        }
        drop(m.time("http", "GET /v1/plans".into()));
        let t = text(&m);
        assert_eq!(
            value(
                &t,
                "shardcast_api_request_seconds_count{transport=\"grpc\",method=\"Prewarm\"}"
            )
            .as_deref(),
            Some("3"),
            "{t}"
        );
        assert_eq!(
            value(
                &t,
                "shardcast_api_request_seconds_count{transport=\"http\",method=\"GET /v1/plans\"}"
            )
            .as_deref(),
            Some("1"),
            "{t}"
        );
        assert!(
            t.contains("# TYPE shardcast_api_request_seconds histogram\n"),
            "{t}"
        );
    }

    #[test]
    fn leadership_follows_terms_and_step_downs_under_election() {
        let m = ControllerMetrics::default();
        assert!(m.leads(), "without election a controller leads");
        m.elected();
        assert!(!m.leads());
        m.became_leader();
        assert!(m.leads());
        m.stepped_down();
        assert!(!m.leads());
        m.became_leader();
        let t = text(&m);
        assert_eq!(
            value(&t, "shardcast_leader_terms_total").as_deref(),
            Some("2")
        );
        assert_eq!(
            value(&t, "shardcast_leader_step_downs_total").as_deref(),
            Some("1")
        );
    }
}
