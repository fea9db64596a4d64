//! Load-driven autoscaling and partition plans, wired to the controller: `ReportLoad` runs
//! `shardcast_policies::autoscale::decide` and carries its decision out through the same
//! paths as the API (`ScaleOut` for scale-up, `Evict` for scale-down); every decision is
//! recorded with its reason (`ListEvents`, `shardcast events`, and a counter per kind on the
//! HTTP `/metrics`). `GetPartitionPlan` precomputes a model's partition plans from its
//! registered profile, or from the tensor index of a host that holds it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use shardcast_policies::autoscale::{self, Action, LoadReport, ModelScaleState, ScalerConfig};
use shardcast_policies::partition;
use shardcast_policies::profile::{self, Bandwidths, ModelProfile};
use shardcast_protocol::agent::GetHandoffRequest;
use shardcast_protocol::controller::{
    Event, EvictRequest, GetPartitionPlanRequest, ListEventsResponse, PartitionPlanResponse,
    ReportLoadRequest, ScaleOutRequest,
};
use tracing::{info, warn};

use crate::core::Controller;
use crate::error::ApiError;

/// Decisions kept in memory for `ListEvents`.
pub const EVENTS_KEPT: usize = 1000;

/// The autoscaler's memory: per-model state, recent events, counters.
#[derive(Default)]
pub struct Autoscaler {
    cfg: ScalerConfig,
    states: Mutex<HashMap<String, ModelScaleState>>,
    events: Mutex<VecDeque<Event>>,
    counters: Mutex<BTreeMap<String, u64>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Autoscaler {
    fn record(&self, e: Event) -> Event {
        info!(model = %e.model, kind = %e.kind, delta = e.delta, "autoscaler: {}", e.reason);
        *lock(&self.counters).entry(e.kind.clone()).or_default() += 1;
        let mut ev = lock(&self.events);
        if ev.len() >= EVENTS_KEPT {
            ev.pop_back();
        }
        ev.push_front(e.clone());
        e
    }

    /// Decision counts per kind, for `/metrics`.
    pub fn counters(&self) -> BTreeMap<String, u64> {
        lock(&self.counters).clone()
    }

    /// Recent events, newest first.
    pub fn events(&self, model: &str, limit: usize) -> ListEventsResponse {
        let ev = lock(&self.events);
        ListEventsResponse {
            events: ev
                .iter()
                .filter(|e| model.is_empty() || e.model == model)
                .take(if limit == 0 { 100 } else { limit })
                .cloned()
                .collect(),
        }
    }
}

fn now_unix() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Controller {
    /// `ReportLoad`: decide and act.
    pub async fn report_load(self: &Arc<Self>, req: ReportLoadRequest) -> Result<Event, ApiError> {
        for (name, v) in [
            ("arrival_rate", req.arrival_rate),
            ("service_rate", req.service_rate),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(ApiError::invalid(format!(
                    "{name} must be a finite number ≥ 0, got {v}"
                )));
            }
        }
        if req.service_rate <= 0.0 {
            return Err(ApiError::invalid(
                "service_rate (requests per second one replica serves) must be above 0",
            ));
        }
        let tier = if req.tier.is_empty() {
            "memory".to_string()
        } else {
            req.tier.clone()
        };
        let (name, replicas, load_time_s, holders) = self.scaling_view(&req.model, &tier)?;
        let scaler = self.autoscaler();
        let now = now_unix();
        let mut state = lock(&scaler.states).get(&name).cloned().unwrap_or_default();
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
        // Partitioned burst replicas need partial loads, which the data plane does not do
        // yet: only full replicas are offered to the policy.
        let (decision, next) = autoscale::decide(&scaler.cfg, &state, &report, now, None);
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
            Action::ScaleUp { full, partitioned } => {
                let add = full.saturating_add(partitioned);
                match self.scale_out(ScaleOutRequest {
                    model: name.clone(),
                    replicas: add,
                    tier: tier.clone(),
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
                            format!("{} — scale-up of {add} failed: {}", event.reason, e.message);
                    }
                }
            }
            Action::ScaleDown {
                remove_partitioned,
                remove_full,
            } => {
                let remove = remove_full.saturating_add(remove_partitioned) as usize;
                // The most recently added hosts go first (highest id as a stand-in), never
                // below one copy in the cluster.
                let mut victims: Vec<String> = holders.into_iter().rev().take(remove).collect();
                if victims.len() >= replicas as usize && replicas > 0 {
                    victims.pop();
                }
                if victims.is_empty() {
                    event.reason = format!("{} — nothing evictable", event.reason);
                } else {
                    match self
                        .evict(EvictRequest {
                            model: name.clone(),
                            hosts: victims.clone(),
                            tier: tier.clone(),
                        })
                        .await
                    {
                        Ok(r) => {
                            event.kind = "scale-down".into();
                            event.delta = -(r.evicted.len() as i32);
                            event.hosts = r.evicted;
                        }
                        Err(e) => {
                            event.kind = "error".into();
                            event.reason =
                                format!("{} — scale-down failed: {}", event.reason, e.message);
                        }
                    }
                }
            }
        }
        lock(&scaler.states).insert(name, next);
        Ok(scaler.record(event))
    }

    /// `GetPartitionPlan`.
    pub async fn partition_plan(
        &self,
        req: GetPartitionPlanRequest,
    ) -> Result<PartitionPlanResponse, ApiError> {
        let (name, digest, registered_profile, holder, smallest_gpu) =
            self.partition_inputs(&req.model)?;
        let profile: ModelProfile = match registered_profile {
            Some(p) => p,
            None => {
                let host = holder.ok_or_else(|| {
                    ApiError::precondition(format!(
                        "model {name} has no registered profile and no live host holds it to read its tensor index; prewarm it or register it with a profile"
                    ))
                })?;
                let mut agent = self.agent_client(&host)?;
                let h = agent
                    .get_handoff(GetHandoffRequest {
                        model: digest.clone(),
                    })
                    .await
                    .map_err(|s| ApiError::unavailable(format!("host {host}: {}", s.message())))?
                    .into_inner();
                let v: serde_json::Value = serde_json::from_str(&h.json)
                    .map_err(|e| ApiError::internal(format!("hand-off of {host}: {e}")))?;
                let tensors: Vec<(String, u64)> = v["tensors"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|t| {
                                Some((t["name"].as_str()?.to_string(), t["nbytes"].as_u64()?))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                if tensors.is_empty() {
                    return Err(ApiError::precondition(format!(
                        "model {name} has no safetensors tensors to derive a profile from; register it with a profile"
                    )));
                }
                profile::profile_from_tensors(&name, &tensors, &Bandwidths::default())
            }
        };
        let max_p = if req.max_partitions == 0 {
            8
        } else {
            req.max_partitions as usize
        };
        let gpu_memory = if req.gpu_memory > 0 {
            req.gpu_memory
        } else {
            smallest_gpu.unwrap_or(16 << 30)
        };
        let queue = req.queue.max(1);
        let table = partition::precompute(
            &profile,
            max_p,
            gpu_memory,
            Bandwidths::default().link_bps,
            queue.max(64),
        )
        .map_err(|e| ApiError::precondition(format!("no partition plan: {e}")))?;
        let chosen = table.best_for(queue).cloned();
        let json = serde_json::json!({
            "model": name,
            "gpu_memory": gpu_memory,
            "queue": queue,
            "chosen": chosen,
            "table": table,
            "profile": profile,
        });
        Ok(PartitionPlanResponse {
            json: json.to_string(),
            estimated: profile.estimated,
        })
    }
}

/// Parses a registered profile (`RegisterModel.profile_json`).
pub fn parse_profile(json: &str) -> Result<ModelProfile, ApiError> {
    let p: ModelProfile =
        serde_json::from_str(json).map_err(|e| ApiError::invalid(format!("profile_json: {e}")))?;
    p.validate()
        .map_err(|e| ApiError::invalid(format!("profile_json: {e}")))?;
    if p.groups.len() > 100_000 {
        warn!("a profile with {} groups", p.groups.len());
    }
    Ok(p)
}
