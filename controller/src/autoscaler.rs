//! Load-driven autoscaling and partition plans, wired to the controller: `ReportLoad` runs
//! `shardcast_policies::autoscale::decide` and carries its decision out through the same
//! paths as the API (`ScaleOut` for scale-up, `Evict` for scale-down); every decision is
//! recorded with its reason (`ListEvents`, `shardcast events`, and a counter per kind on the
//! HTTP `/metrics`). `GetPartitionPlan` answers from the model's stored partition-plan table
//! (`ptables`), built from its registered profile or from the tensor index of a host that
//! holds it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use shardcast_policies::autoscale::{self, Action, LoadReport, ModelScaleState, ScalerConfig};
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

    /// Records an event from elsewhere in the controller (tier evictions).
    pub fn record_event(&self, e: Event) -> Event {
        self.record(e)
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
        let tier = crate::wire::tier_of(req.tier)?;
        let (name, replicas, load_time_s, holders) = self.scaling_view(&req.model, tier)?;
        if req.arrival_rate > 0.0
            && let Ok(info) = self.get_model(&name)
        {
            self.usage().touch(&info.digest);
        }
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
        // GPU replicas may instead be partitioned bursts (Flashpoint §4.2): offer the best
        // plan for the current queue when it splits the model.
        let burst = if tier == shardcast_placement::Tier::Gpu {
            self.burst_option(&name, req.queue_len, load_time_s).await
        } else {
            None
        };
        let (decision, next) = autoscale::decide(&scaler.cfg, &state, &report, now, burst.as_ref());
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
                match self.burst(&name, partitioned, p).await {
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
                            event.reason, e.message
                        );
                    }
                }
                if full > 0 {
                    match self.scale_out(ScaleOutRequest {
                        model: name.clone(),
                        replicas: full,
                        tier: crate::wire::pb_tier(tier) as i32,
                        partitions: 0,
                    }) {
                        Ok(a) => event.plan_id = a.plan_id,
                        Err(e) => {
                            event.reason = format!(
                                "{} — scale-up of {full} failed: {}",
                                event.reason, e.message
                            );
                        }
                    }
                }
            }
            Action::ScaleUp { full, partitioned } => {
                let add = full.saturating_add(partitioned);
                match self.scale_out(ScaleOutRequest {
                    model: name.clone(),
                    replicas: add,
                    tier: crate::wire::pb_tier(tier) as i32,
                    partitions: 0,
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
                            tier: crate::wire::pb_tier(tier) as i32,
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

    /// A model's profile: the registered one, else one derived from the tensor index of a
    /// live host holding it (marked estimated). With the model's name and the smallest GPU
    /// memory reported in the cluster.
    pub async fn model_profile(
        &self,
        key: &str,
    ) -> Result<(String, ModelProfile, Option<u64>), ApiError> {
        let (name, digest, registered_profile, holder, smallest_gpu) =
            self.partition_inputs(key)?;
        let stored = || self.plan_store().derived(&name, &digest);
        let profile: ModelProfile = match registered_profile.or_else(stored) {
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
                let p = profile::profile_from_tensors(&name, &tensors, &Bandwidths::default());
                self.plan_store()
                    .set_derived(self.store(), &name, &digest, &p);
                p
            }
        };
        Ok((name, profile, smallest_gpu))
    }

    /// `GetPartitionPlan`.
    pub async fn partition_plan(
        &self,
        req: GetPartitionPlanRequest,
    ) -> Result<PartitionPlanResponse, ApiError> {
        let max_p = if req.max_partitions == 0 {
            crate::ptables::DEFAULT_MAX_PARTITIONS
        } else {
            req.max_partitions as usize
        };
        let queue = req.queue.max(1);
        let (name, profile, table, stored) = self
            .plan_table(
                &req.model,
                max_p,
                (req.gpu_memory > 0).then_some(req.gpu_memory),
                crate::ptables::table_queue(queue),
            )
            .await?;
        let chosen = table.best_for(queue).cloned();
        let json = serde_json::json!({
            "model": name,
            "gpu_memory": table.gpu_memory,
            "queue": queue,
            "stored": stored,
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

impl Controller {
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
