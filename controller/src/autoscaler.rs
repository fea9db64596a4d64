//! Load-driven autoscaling: `ReportLoad` (from the FaaS, or the scraper) runs
//! `shardcast_policies::autoscale::decide` and carries its decision out through the same
//! paths as the API (`ScaleOut` for scale-up, a partitioned burst when the partition table
//! offers a faster one, `Evict` for scale-down); every decision is recorded with its reason
//! in the [`EventLog`] (`ListEvents`, `shardcast events`, a counter per kind on `/metrics`).
//!
//! A scale-down evicts whole hosts (an `Evict` of the GPU tier releases every replica a host
//! holds): [`scale_down_victims`] takes the newest hosts whose replicas all serve and fit
//! in the count the policy removes. The policy's load time (its scale-down delay) is the
//! mean cold start of the model's latest replicas ([`measured_load_time`]). Before both
//! (issue #32), the `n` newest *hosts* went for `n` replicas, loading ones included, and
//! the load time was the last plan's slowest receiver: in the simulator the service then
//! served bursty traces 11–71 × slower than the same policy (docs/BENCHMARKS.md).
//!
//! A service holding narrow handles: the [`Fleet`] it scales (the core, wired in
//! `crate::services`), the partition tables, the event log and the last-use record.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use shardcast_placement::Tier;
use shardcast_policies::autoscale::{self, Action, LoadReport, ModelScaleState, ScalerConfig};

use crate::events::Event;

use crate::burst::BurstPart;
use crate::core::{EvictModel, Evicted, ScaleOut, now_unix};
use crate::error::{EvictError, LoadError, LookupError, PlanRequestError, ScaleOutError};
use crate::events::EventLog;
use crate::lock;
use crate::ops::ReportLoad;
use crate::plan::{Accepted, Plan, ReceiverState};
use crate::ptables::{ModelSource, PartitionTables};
use crate::usage::Usage;

/// A model's replicas as the autoscaler sees them.
#[derive(Debug, Clone)]
pub struct ScalingView {
    /// Model name.
    pub name: String,
    /// Manifest digest.
    pub digest: String,
    /// Replicas now (held, in flight, or GPU slots reserved).
    pub replicas: u32,
    /// Load time: the mean cold start of its latest receivers ([`measured_load_time`]),
    /// else an estimate.
    pub load_time_s: f64,
    /// Live hosts holding it in the tier, oldest replica first (by the latest plan that
    /// made the host a receiver; hosts no stored plan names first), then by id.
    pub holders: Vec<Holder>,
}

/// One live host holding a model in a tier, as the autoscaler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Host id.
    pub host: String,
    /// Replicas of the model on it: GPU slots reserved (`Evict` of the GPU tier releases
    /// them all at once), 1 in the other tiers.
    pub replicas: u32,
    /// A running plan still moves the model to it, loads it, or waits for it to return:
    /// its replicas do not serve yet, and `Evict` refuses the host until the plan ends.
    pub loading: bool,
}

/// What the autoscaler acts on: the cluster's replicas, and the operations that add or
/// remove them (the same ones the API serves).
pub trait Fleet: Send + Sync + 'static {
    /// The model's replicas in `tier`.
    fn scaling_view(&self, key: &str, tier: Tier) -> Result<ScalingView, LookupError>;
    /// `ScaleOut` by whole replicas.
    fn scale_out(&self, req: ScaleOut) -> Result<Accepted, PlanRequestError>;
    /// A partitioned burst of `replicas` × `partitions`.
    fn burst(
        &self,
        model: &str,
        replicas: u32,
        partitions: u32,
    ) -> impl Future<Output = Result<(Accepted, Vec<BurstPart>), ScaleOutError>> + Send;
    /// `Evict`.
    fn evict(&self, req: EvictModel) -> impl Future<Output = Result<Evicted, EvictError>> + Send;
}

/// The autoscaler: per-model scaling state, acting on a [`Fleet`].
pub struct Autoscaler<F, M> {
    cfg: ScalerConfig,
    states: Mutex<HashMap<String, ModelScaleState>>,
    fleet: Arc<F>,
    tables: Arc<PartitionTables<M>>,
    events: Arc<EventLog>,
    usage: Arc<Usage>,
}

impl<F: Fleet, M: ModelSource> Autoscaler<F, M> {
    /// An autoscaler with the default policy settings.
    pub fn new(
        fleet: Arc<F>,
        tables: Arc<PartitionTables<M>>,
        events: Arc<EventLog>,
        usage: Arc<Usage>,
    ) -> Self {
        Self {
            cfg: ScalerConfig::default(),
            states: Mutex::default(),
            fleet,
            tables,
            events,
            usage,
        }
    }

    /// The same autoscaler deciding with `policy` instead of the defaults (e.g.
    /// `max_replicas` from the cluster's GPU count, as [`ScalerConfig::max_replicas`] asks).
    pub fn with_policy(mut self, policy: ScalerConfig) -> Self {
        self.cfg = policy;
        self
    }

    /// `ReportLoad`: decide and act.
    pub async fn report_load(&self, req: ReportLoad) -> Result<Event, LoadError> {
        for (name, v) in [
            ("arrival_rate", req.arrival_rate),
            ("service_rate", req.service_rate),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(LoadError::Invalid(format!(
                    "{name} must be a finite number ≥ 0, got {v}"
                )));
            }
        }
        if req.service_rate <= 0.0 {
            return Err(LoadError::Invalid(
                "service_rate (requests per second one replica serves) must be above 0".into(),
            ));
        }
        let tier = req.tier;
        let ScalingView {
            name,
            digest,
            replicas,
            load_time_s,
            holders,
        } = self.fleet.scaling_view(&req.model, tier)?;
        if req.arrival_rate > 0.0 {
            self.usage.touch(&digest);
        }
        let now = now_unix();
        let mut state = lock(&self.states).get(&name).cloned().unwrap_or_default();
        // Reality wins over memory: replicas are what the cluster holds now.
        state.replicas = replicas;
        state.partitioned = 0;
        state.load_time_s = load_time_s;
        let report = LoadReport {
            model: name.clone(),
            arrival_rate: req.arrival_rate,
            queue_len: req.queue_len,
            service_rate_per_replica: req.service_rate,
            at_s: now,
        };
        // GPU replicas may instead be partitioned bursts (Flashpoint §4.2): offer the best
        // plan for the current queue when it splits the model.
        let burst = if tier == Tier::Gpu {
            self.burst_option(&name, req.queue_len, load_time_s).await
        } else {
            None
        };
        let (decision, next) = autoscale::decide(&self.cfg, &state, &report, now, burst.as_ref());
        let mut event = Event {
            at: now,
            model: name.clone(),
            kind: "hold".into(),
            reason: decision.reason.clone(),
            plan_id: String::new(),
            delta: 0,
            hosts: Vec::new(),
        };
        match decision.action {
            Action::None => {}
            Action::ScaleUp { full, partitioned } if partitioned > 0 => {
                let p = burst.map_or(2, |b| b.partitions);
                match self.fleet.burst(&name, partitioned, p).await {
                    Ok((a, parts)) => {
                        event.kind = "burst".into();
                        event.delta = partitioned as i32;
                        event.hosts = parts.iter().map(|x| x.host.clone()).collect();
                        event.reason = format!(
                            "{} — {partitioned} replica(s) in {p} partitions (plan {}), ready in ≈{:.2} s",
                            event.reason, a.plan_id, a.estimate_s
                        );
                        event.plan_id = a.plan_id;
                    }
                    Err(e) => {
                        event.kind = "error".into();
                        event.reason = format!(
                            "{} — burst of {partitioned} × {p} failed: {}",
                            event.reason, e
                        );
                    }
                }
                if full > 0 {
                    match self.fleet.scale_out(ScaleOut {
                        model: name.clone(),
                        replicas: full,
                        tier,
                        partitions: 0,
                        transport: None,
                    }) {
                        Ok(a) => event.plan_id = a.plan_id,
                        Err(e) => {
                            event.reason =
                                format!("{} — scale-up of {full} failed: {}", event.reason, e);
                        }
                    }
                }
            }
            Action::ScaleUp { full, partitioned } => {
                let add = full.saturating_add(partitioned);
                match self.fleet.scale_out(ScaleOut {
                    model: name.clone(),
                    replicas: add,
                    tier,
                    partitions: 0,
                    transport: None,
                }) {
                    Ok(a) => {
                        event.kind = "scale-up".into();
                        event.plan_id = a.plan_id;
                        event.delta = add as i32;
                        event.hosts = a.hosts.iter().map(|h| h.host.clone()).collect();
                    }
                    Err(e) => {
                        event.kind = "error".into();
                        event.reason =
                            format!("{} — scale-up of {add} failed: {}", event.reason, e);
                    }
                }
            }
            Action::ScaleDown {
                remove_partitioned,
                remove_full,
            } => {
                let remove = remove_full.saturating_add(remove_partitioned);
                let victims = scale_down_victims(&holders, remove);
                if victims.is_empty() {
                    event.reason = format!("{} — nothing evictable", event.reason);
                } else {
                    match self
                        .fleet
                        .evict(EvictModel {
                            model: name.clone(),
                            hosts: victims.clone(),
                            tier,
                        })
                        .await
                    {
                        Ok(r) => {
                            let removed: u32 = holders
                                .iter()
                                .filter(|h| r.evicted.contains(&h.host))
                                .map(|h| h.replicas)
                                .sum();
                            event.kind = "scale-down".into();
                            event.delta = -i32::try_from(removed).unwrap_or(i32::MAX);
                            event.hosts = r.evicted;
                        }
                        Err(e) => {
                            event.kind = "error".into();
                            event.reason = format!("{} — scale-down failed: {}", event.reason, e);
                        }
                    }
                }
            }
        }
        lock(&self.states).insert(name, next);
        Ok(self.events.record(event))
    }

    /// The partitioned alternative offered to the autoscaler for a GPU scale-up: the best
    /// plan for `queue` from the model's partition table when it uses more than one
    /// partition. Its cold start is the plan's, scaled by how the measured load time of a
    /// full replica compares with the profile's (so both options are on the same footing).
    async fn burst_option(
        &self,
        model: &str,
        queue: u32,
        measured_load_s: f64,
    ) -> Option<autoscale::BurstOption> {
        let (_, profile, table, _) = self
            .tables
            .plan_table(
                model,
                crate::ptables::DEFAULT_MAX_PARTITIONS,
                None,
                crate::ptables::table_queue(queue),
            )
            .await
            .ok()?;
        let best = table.best_for(queue.max(1))?;
        let p = best.partition_count();
        if p < 2 {
            return None;
        }
        let profile_load = profile.total_load_s();
        let scale = if profile_load > 0.0 && measured_load_s > 0.0 {
            measured_load_s / profile_load
        } else {
            1.0
        };
        Some(autoscale::BurstOption {
            partitions: p as u32,
            cold_start_s: best.cold_start_s * scale,
        })
    }
}

/// The hosts a scale-down of `remove` replicas evicts, out of `holders` (oldest first): the
/// newest hosts first, skipping any still loading (its replicas do
/// not serve yet, and `Evict` refuses it while its plan runs), each only when all its
/// replicas fit in what is left to remove — an `Evict` of the GPU tier releases every
/// replica the host holds, so a host of 8 taken for a removal of 1 would cut 7 that are
/// needed — and never the last serving replica of the model.
pub fn scale_down_victims(holders: &[Holder], remove: u32) -> Vec<String> {
    let serving: u32 = holders
        .iter()
        .filter(|h| !h.loading)
        .map(|h| h.replicas)
        .sum();
    let mut left = remove.min(serving.saturating_sub(1));
    let mut victims = Vec::new();
    for h in holders.iter().rev() {
        if left == 0 {
            break;
        }
        if h.loading || h.replicas == 0 || h.replicas > left {
            continue;
        }
        left -= h.replicas;
        victims.push(h.host.clone());
    }
    victims
}

/// Receivers [`measured_load_time`] averages: recent enough to follow a change of where
/// copies come from (the origin at first, peers and local memory later), wide enough that
/// one slow host does not set the scale-down delay on its own.
pub const LOAD_TIME_SAMPLES: usize = 16;

/// A model's measured cold start in `tier`, seconds: the mean time from a plan's start
/// until a receiver was ready (`done_s`: for tier gpu, its replicas resident), over the
/// receivers of the latest ended plans of `digest` in that tier, newest plan first, at most
/// [`LOAD_TIME_SAMPLES`]; `None` before any receiver finished.
///
/// The policy's scale-down delay is "the loading latency" of one replica (INFaaS §4.2.2).
/// A plan's own elapsed time is its slowest receiver's: the last plan's, which the
/// controller took before, was 0.9–2.7 × the mean cold start the simulator measured in the
/// trace runs of docs/BENCHMARKS.md (issue #32).
pub fn measured_load_time<'a>(
    plans: impl IntoIterator<Item = &'a Plan>,
    digest: &str,
    tier: Tier,
) -> Option<f64> {
    let mut ended: Vec<&Plan> = plans
        .into_iter()
        .filter(|p| p.digest == digest && p.tier == tier && !p.running())
        .collect();
    ended.sort_by(|a, b| b.created_at.total_cmp(&a.created_at));
    let times: Vec<f64> = ended
        .iter()
        .flat_map(|p| p.hosts.iter())
        .filter(|r| r.state == ReceiverState::Done && r.done_s > 0.0 && r.done_s.is_finite())
        .map(|r| r.done_s)
        .take(LOAD_TIME_SAMPLES)
        .collect();
    (!times.is_empty()).then(|| times.iter().sum::<f64>() / times.len() as f64)
}

#[cfg(test)]
mod tests;
