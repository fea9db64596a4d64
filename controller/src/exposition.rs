//! The state half of the controller's `/metrics`: a collector that reads the answering
//! controller's plans, hosts, models, registrations and API refusals at scrape time, under
//! the names they have always had. The observed half (histograms, event counters) is
//! `crate::metrics`'s registry; `crate::http` serves both.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::plan::{PlanState, ReceiverState};
use crate::services::Services;

/// Reads the answering controller's state at scrape time (see the module docs).
pub struct StateCollector(pub Arc<Services>);

impl fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StateCollector")
    }
}

/// A family `shardcast_<name>` with one label, of the metric `make` builds from a value
/// (`ConstCounter::new`: `…_total`; `ConstGauge::new`).
fn family<'a, M: EncodeMetric>(
    enc: &mut DescriptorEncoder<'_>,
    (name, help, label): (&str, &str, &str),
    values: impl IntoIterator<Item = (&'a str, u64)>,
    make: fn(u64) -> M,
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, make(0).metric_type())?;
    for (v, n) in values {
        make(n).encode(m.encode_family(&[(label, v)])?)?;
    }
    Ok(())
}

/// An unlabelled counter `shardcast_<name>_total`.
fn counter(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)
}

/// An unlabelled gauge `shardcast_<name>`.
fn gauge(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for StateCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let c = &self.0;
        let core = &c.core;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        // The series from before the registry, as they were.
        let decisions = c.events().counters();
        family(
            &mut enc,
            (
                "autoscaler_decisions",
                "Autoscaler decisions by kind.",
                "kind",
            ),
            decisions.iter().map(|(k, n)| (k.as_str(), *n)),
            ConstCounter::new,
        )?;
        let authz = core.authz_stats();
        family(
            &mut enc,
            ("api_refused", "API calls refused, by reason.", "reason"),
            [
                ("unauthenticated", load(&authz.unauthenticated)),
                ("denied", load(&authz.denied)),
            ],
            ConstCounter::new,
        )?;
        family(
            &mut enc,
            (
                "api_denied",
                "API calls refused because the caller's role lacks the permission, by role.",
                "role",
            ),
            authz.denied_by(),
            ConstCounter::new,
        )?;
        family(
            &mut enc,
            (
                "http_timeouts",
                "HTTP connections closed because the client stalled: a request head not sent in time (header), a request body paused too long (body), no request on a keep-alive connection (idle).",
                "kind",
            ),
            core.http_stats()
                .timeouts()
                .into_iter()
                .map(|(stall, n)| (stall.as_str(), n)),
            ConstCounter::new,
        )?;
        counter(
            &mut enc,
            "origin_refused",
            "Registrations refused by the origin allow-list.",
            core.origin_refusals(),
        )?;
        if let Some(tls) = &core.config().tls {
            let t = &tls.stats;
            for (name, help, v) in [
                (
                    "tls_handshakes_accepted",
                    "TLS handshakes completed as a server (the gRPC and HTTP listeners).",
                    load(&t.accepted),
                ),
                (
                    "tls_handshakes_refused",
                    "TLS handshakes refused as a server (the gRPC and HTTP listeners): no client certificate on gRPC, one of another CA, expired, one without a shardcast identity, another ALPN protocol, or a handshake not finished in time.",
                    load(&t.refused) + load(&t.timed_out),
                ),
                (
                    "tls_connect_refused",
                    "Outgoing TLS connections (to transferds' agent APIs, the scrape endpoint) whose server was refused: a bad chain or the wrong identity.",
                    load(&t.connect_refused),
                ),
                (
                    "tls_reloads",
                    "Certificate reloads without a restart.",
                    load(&t.reloads),
                ),
                (
                    "tls_reload_failures",
                    "Certificate reloads that failed (the running certificate stays).",
                    load(&t.reload_failures),
                ),
            ] {
                counter(&mut enc, name, help, v)?;
            }
            // Seconds left, as of this scrape (negative once passed).
            let (own, ca) = tls.expiry().remaining(std::time::SystemTime::now());
            let mut m = enc.encode_descriptor(
                "certificate_expiry_seconds",
                "Seconds until the notAfter of the controller's TLS certificate (certificate=\"own\") and of the CA bundle's first to expire (certificate=\"ca\"), as of the scrape; negative once passed. The log warns within --cert-expiry-warning-s (default 14 days).",
                None,
                ConstGauge::new(0i64).metric_type(),
            )?;
            for (which, left) in [("own", own), ("ca", ca)] {
                ConstGauge::new(left).encode(m.encode_family(&[("certificate", which)])?)?;
            }
            counter(
                &mut enc,
                "connections_over_peer_limit",
                "API connections closed after their handshake because their peer (a certificate's identity, or an address without one) already held the per-peer limit on the listener.",
                load(&tls.stats.over_peer_limit),
            )?;
            counter(
                &mut enc,
                "handshakes_over_addr_limit",
                "API connections closed before their handshake because their address already had the per-address limit of handshakes in progress.",
                load(&tls.stats.handshakes_over_addr_limit),
            )?;
        }

        // The state, read under its lock once.
        let (plans, receivers, hosts, up, models, pending_evictions) = {
            let st = crate::lock(&core.state);
            let inv = core.inventory.lock();
            let mut plans = vec![0u64; PlanState::ALL.len()];
            let mut receivers = vec![0u64; ReceiverState::ALL.len()];
            for p in st.plans.values() {
                if let Some(i) = PlanState::ALL.iter().position(|s| *s == p.state) {
                    plans[i] += 1;
                }
                if p.running() {
                    for h in &p.hosts {
                        if let Some(i) = ReceiverState::ALL.iter().position(|s| *s == h.state) {
                            receivers[i] += 1;
                        }
                    }
                }
            }
            let up = inv.hosts.values().filter(|h| h.up).count() as u64;
            let pending: u64 = inv
                .hosts
                .values()
                .map(|h| h.pending_evictions.len() as u64)
                .sum();
            (
                plans,
                receivers,
                inv.hosts.len() as u64,
                up,
                core.registry().count() as u64,
                pending,
            )
        };
        family(
            &mut enc,
            (
                "plans",
                "Plans the controller holds, by state (running, done, partial, failed).",
                "state",
            ),
            PlanState::ALL.iter().map(|s| s.as_str()).zip(plans),
            ConstGauge::new,
        )?;
        family(
            &mut enc,
            (
                "plan_receivers",
                "Receivers of running plans, by state.",
                "state",
            ),
            ReceiverState::ALL.iter().map(|s| s.as_str()).zip(receivers),
            ConstGauge::new,
        )?;
        gauge(
            &mut enc,
            "hosts_registered",
            "Hosts known to the inventory (heartbeated at least once).",
            hosts,
        )?;
        gauge(
            &mut enc,
            "hosts_up",
            "Hosts whose heartbeats are current.",
            up,
        )?;
        gauge(
            &mut enc,
            "models_registered",
            "Models registered (latest version per name).",
            models,
        )?;
        let metrics = &core.config().metrics;
        gauge(
            &mut enc,
            "registrations_in_progress",
            "Model registrations started and not ended.",
            metrics.registrations_in_progress(),
        )?;
        gauge(
            &mut enc,
            "pending_evictions",
            "Evictions waiting for a down host to heartbeat again.",
            pending_evictions,
        )?;
        gauge(
            &mut enc,
            "leader",
            "1 while this replica leads (always, without leader election).",
            u64::from(metrics.leads()),
        )
    }
}
