//! Partitioned bursts (Flashpoint §4.2): a scale-up where each new replica is split into
//! `p` partitions by the model's partition plan, one per host. Every host fetches its
//! partition's chunks first — from a peer holding the model, else the origin — and loads
//! them onto its GPU, so the replica serves after roughly `1/p` of a full load (pipelined
//! over the hosts); then each host keeps fetching and loading the rest ("model completion",
//! §4.2.5) until it holds a full replica of its own.
//!
//! The controller only decides and asks: transferd's `LoadModel` with a `PartitionSpec`
//! does the fetching and loading (see `transferd::gpu::load_partition`).

use std::sync::Arc;
use tokio::time::Instant;

use shardcast_placement::Tier;
use shardcast_policies::partition::PartitionPlan;
use shardcast_policies::profile::ModelProfile;
use tracing::{info, warn};

use crate::core::{Controller, StallClock, lock, now_unix};
use crate::error::{AgentError, PlanRequestError};
use crate::plan::{Accepted, GpuState, Plan, PlanKind, ReceiverProgress, ReceiverState};

/// Most partitions a burst may use.
pub const MAX_PARTITIONS: u32 = 64;

/// One host's part of a burst.
#[derive(Debug, Clone)]
pub struct BurstPart {
    /// Host id.
    pub host: String,
    /// `k/p` of replica `r` (`r.k/p`).
    pub label: String,
    /// Layer groups it loads first.
    pub groups: Vec<String>,
}

/// The layer groups of each partition of `plan`.
pub fn partition_groups(profile: &ModelProfile, plan: &PartitionPlan) -> Vec<Vec<String>> {
    plan.partitions
        .iter()
        .map(|p| {
            profile
                .groups
                .get(p.groups.clone())
                .unwrap_or_default()
                .iter()
                .map(|g| g.name.clone())
                .collect()
        })
        .collect()
}

impl Controller {
    /// `ScaleOut` with `partitions > 1`: `replicas` partitioned replicas on new hosts, by
    /// `plan` (from the partition-plan service, `crate::ptables`) over `profile`.
    pub async fn burst(
        self: &Arc<Self>,
        model: &str,
        replicas: u32,
        (profile, plan): (ModelProfile, PartitionPlan),
    ) -> Result<(Accepted, Vec<BurstPart>), PlanRequestError> {
        let partitions = plan.partition_count() as u32;
        if replicas == 0 {
            return Err(PlanRequestError::Invalid(
                "replicas must be at least 1".into(),
            ));
        }
        if !(2..=MAX_PARTITIONS).contains(&partitions) {
            return Err(PlanRequestError::Invalid(format!(
                "partitions must be between 2 and {MAX_PARTITIONS} (1 is a whole replica: leave it 0)"
            )));
        }
        let groups = partition_groups(&profile, &plan);
        let (m, manifest, holders, free) = self.burst_inputs(model)?;
        let need = (replicas * partitions) as usize;
        if free.len() < need {
            return Err(PlanRequestError::Capacity(format!(
                "a burst of {replicas} × {partitions} partitions needs {need} hosts with a free GPU and no GPU replica of {}; {} have one",
                m.name,
                free.len()
            )));
        }
        // Partitions are fetched from the holders in turn (their NICs add up), else from
        // the origin. A host that holds the data already fetches nothing.
        let source_of = |n: usize| match holders.get(n % holders.len().max(1)) {
            Some(addr) => format!("shardcast://{addr}"),
            None => m.reads_from().to_string(),
        };
        let heaviness = self.heaviness_of(&m.digest);
        let mut parts = Vec::new();
        let mut hosts = Vec::new();
        for (n, host) in free.into_iter().take(need).enumerate() {
            let (r, k) = (n as u32 / partitions, n as u32 % partitions);
            let part = BurstPart {
                host: host.clone(),
                label: format!("{}.{}/{partitions}", r + 1, k + 1),
                groups: groups.get(k as usize).cloned().unwrap_or_default(),
            };
            self.reserve_gpu_slot(&host, &m.digest)?;
            let source = source_of(n);
            match self
                .start_part(
                    &host,
                    &m.name,
                    &m.digest,
                    m.reads_from(),
                    &manifest,
                    &part,
                    &source,
                    &heaviness,
                )
                .await
            {
                Ok(()) => {
                    let mut h = ReceiverProgress::new(host.clone(), ReceiverState::Loading);
                    h.total = m.total_bytes;
                    h.source = if holders.is_empty() { "origin" } else { "peer" }.into();
                    h.gpus = 1;
                    h.gpu_state = Some(GpuState::Loading);
                    h.partition = part.label.clone();
                    hosts.push(h);
                    parts.push(part);
                }
                Err(e) => {
                    self.release_gpu_slot(&host, &m.digest);
                    warn!(host, model = %m.name, "burst partition not started: {e}");
                    let mut h = ReceiverProgress::new(host, ReceiverState::Failed);
                    h.error = e.to_string();
                    hosts.push(h);
                }
            }
        }
        if parts.is_empty() {
            return Err(PlanRequestError::NothingStarted {
                model: m.name.clone(),
                why: hosts
                    .iter()
                    .map(|h| format!("{}: {}", h.host, h.error))
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        let id = self.track_burst(
            &m.name,
            &m.digest,
            m.reads_from(),
            plan.cold_start_s,
            &hosts,
        )?;
        info!(plan = %id, model = %m.name, replicas, partitions, sources = holders.len(), cold_start_s = plan.cold_start_s, "burst started");
        Ok((
            Accepted {
                plan_id: id,
                estimate_s: plan.cold_start_s,
                chains: Vec::new(),
                hosts,
            },
            parts,
        ))
    }

    /// Records a started burst (at least one part started) as a plan of kind "burst"
    /// (listed, watched and persisted like chain plans) and follows it.
    fn track_burst(
        self: &Arc<Self>,
        name: &str,
        digest: &str,
        origin: &str,
        estimate_s: f64,
        hosts: &[ReceiverProgress],
    ) -> Result<String, PlanRequestError> {
        let id = hex::encode(rand::random::<[u8; 8]>());
        let record = Plan {
            estimate_s,
            ..Plan::started(
                id.clone(),
                (name, digest),
                shardcast_placement::Tier::Gpu,
                PlanKind::Burst,
                hosts.to_vec(),
                origin,
                now_unix(),
            )
        };
        self.persist_plan_now(&record)
            .map_err(|e| PlanRequestError::Store(e.message))?;
        lock(&self.state).add_plan(record);
        tokio::spawn(self.clone().run_burst(id.clone()));
        Ok(id)
    }

    /// Follows a burst until every host holds a full replica or failed: polls each loading
    /// host's GPUs, notes when its partition went live (and when all had), and fails a host
    /// that stops heartbeating, whose load fails, or that makes no progress for
    /// `stall_timeout`. A burst is not re-planned: the autoscaler or the caller decides
    /// what to do about a lost partition.
    pub(crate) async fn run_burst(self: Arc<Self>, id: String) {
        let mut progress = StallClock::default();
        let mut last_persist = Instant::now();
        let mut tick = tokio::time::interval(self.config().poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.cancel_token().cancelled() => return,
                _ = tick.tick() => {}
            }
            let (digest, active) = {
                let st = lock(&self.state);
                let inv = self.inventory.lock();
                let Some(p) = st.plans.get(&id).filter(|p| p.running()) else {
                    return;
                };
                let active: Vec<(String, bool)> = p
                    .hosts
                    .iter()
                    .filter(|h| h.state.is_active())
                    .map(|h| {
                        let up = inv.hosts.get(&h.host).is_some_and(|e| e.up);
                        (h.host.clone(), up)
                    })
                    .collect();
                (p.digest.clone(), active)
            };
            let mut polled = Vec::new();
            for (host, up) in active {
                let r = if up {
                    Some(
                        self.poll_host(&host, &digest, shardcast_placement::Tier::Gpu)
                            .await,
                    )
                } else {
                    None
                };
                polled.push((host, r));
            }
            let now = Instant::now();
            let mut st = lock(&self.state);
            let mut inv = self.inventory.lock();
            let st = &mut *st;
            let Some(plan) = st.plans.get_mut(&id) else {
                return;
            };
            let elapsed = plan.elapsed_s(now_unix());
            let mut changed = false;
            let mut done = Vec::new();
            for (host, r) in polled {
                let Some(h) = plan.receiver_mut(&host) else {
                    continue;
                };
                changed |= match r {
                    None => h.lose("the host stopped heartbeating during the burst", now_unix()),
                    // An agent that does not answer while heartbeating: the stall timer
                    // decides.
                    Some(Err(e)) => h.unanswered(e.to_string()),
                    Some(Ok(seen)) => h.observe_burst(&seen, elapsed),
                };
                let timeout = self.config().stall_timeout;
                if progress.stalled(&host, h.moved(), now, timeout) && h.state.is_active() {
                    h.state = ReceiverState::Failed;
                    h.error = format!(
                        "no progress for {timeout:?} (data {} bytes, GPU {} bytes)",
                        h.bytes, h.gpu_bytes
                    );
                    warn!(plan = %id, host = %host, "burst partition stalled");
                    changed = true;
                }
                if h.state == ReceiverState::Done {
                    done.push((host, h.total));
                }
            }
            let started: Vec<&ReceiverProgress> = plan
                .hosts
                .iter()
                .filter(|h| !h.partition.is_empty())
                .collect();
            if plan.live_s == 0.0 && !started.is_empty() && started.iter().all(|h| h.live_s > 0.0) {
                plan.live_s = started.iter().map(|h| h.live_s).fold(0.0, f64::max);
                info!(plan = %id, model = %plan.model, live_s = plan.live_s, "burst live: every partition serves");
                changed = true;
            }
            let ended = plan.settle(now_unix());
            changed |= ended;
            let name = plan.model.clone();
            for (host, bytes) in done {
                if let Some(e) = inv.hosts.get_mut(&host) {
                    e.mark_complete(&digest, &name, crate::inventory::DataTier::Memory, bytes);
                }
            }
            if changed {
                self.publish_plan(st, &id, ended, &mut last_persist);
            }
            if ended {
                return;
            }
        }
    }

    /// Teaches `host` the manifest and asks it to load its partition.
    #[allow(clippy::too_many_arguments)]
    async fn start_part(
        &self,
        host: &str,
        name: &str,
        digest: &str,
        origin: &str,
        manifest: &[u8],
        part: &BurstPart,
        source: &str,
        heaviness: &str,
    ) -> Result<(), AgentError> {
        let at = self.agent_at(host)?;
        let import = crate::agents::Import {
            name: name.to_string(),
            origin: origin.to_string(),
            chunk_size: 0,
            tier: Tier::Memory,
            fetch: false,
            keep: false,
            manifest: manifest.to_vec(),
            bind_name: Some(self.current_name(digest).is_some()),
        };
        self.agents().import_model(&at, import).await?;
        let load = crate::agents::Load {
            model: digest.to_string(),
            count: 1,
            partition: Some(crate::agents::Partition {
                groups: part.groups.clone(),
                complete: true,
                source: source.to_string(),
                label: part.label.clone(),
            }),
            heaviness: heaviness.to_string(),
        };
        self.agents().load_model(&at, load).await?;
        info!(host, model = name, partition = %part.label, groups = part.groups.len(), "burst partition started");
        Ok(())
    }
}
