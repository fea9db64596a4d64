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

use shardcast_policies::partition::PartitionPlan;
use shardcast_policies::profile::ModelProfile;
use shardcast_protocol::agent as apb;
use shardcast_protocol::controller::{HostProgress, PlanAccepted};
use tracing::{info, warn};

use crate::core::Controller;
use crate::error::ApiError;

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
    /// `ScaleOut` as the API serves it: a partitioned burst when `partitions > 1`, else
    /// whole replicas by chain plans.
    pub async fn scale_out_any(
        self: &Arc<Self>,
        req: shardcast_protocol::controller::ScaleOutRequest,
    ) -> Result<PlanAccepted, ApiError> {
        if req.partitions > 1 {
            if !matches!(req.tier.as_str(), "gpu") {
                return Err(ApiError::invalid(format!(
                    "partitions need tier gpu (a partition is a GPU load), got {:?}",
                    req.tier
                )));
            }
            return Ok(self
                .burst(&req.model, req.replicas, req.partitions)
                .await?
                .0);
        }
        self.scale_out(req)
    }

    /// The partition plan a burst of `partitions` uses for `model` at `queue` requests,
    /// with the profile it came from.
    pub async fn burst_plan(
        &self,
        model: &str,
        partitions: u32,
        queue: u32,
    ) -> Result<(ModelProfile, PartitionPlan), ApiError> {
        let (_, profile, table, _) = self
            .plan_table(
                model,
                partitions as usize,
                None,
                crate::ptables::table_queue(queue),
            )
            .await?;
        let plan = table
            .best_with_partitions(partitions as usize, queue.max(1))
            .ok_or_else(|| {
                ApiError::precondition(format!(
                    "model {model} cannot be split into {partitions} partitions (it has {} layer groups)",
                    profile.groups.len()
                ))
            })?;
        Ok((profile, plan))
    }

    /// `ScaleOut` with `partitions > 1`: `replicas` partitioned replicas on new hosts.
    pub async fn burst(
        self: &Arc<Self>,
        model: &str,
        replicas: u32,
        partitions: u32,
    ) -> Result<(PlanAccepted, Vec<BurstPart>), ApiError> {
        if replicas == 0 {
            return Err(ApiError::invalid("replicas must be at least 1"));
        }
        if !(2..=MAX_PARTITIONS).contains(&partitions) {
            return Err(ApiError::invalid(format!(
                "partitions must be between 2 and {MAX_PARTITIONS} (1 is a whole replica: leave it 0)"
            )));
        }
        let (profile, plan) = self.burst_plan(model, partitions, 1).await?;
        let groups = partition_groups(&profile, &plan);
        let (m, manifest, holders, free) = self.burst_inputs(model)?;
        let need = (replicas * partitions) as usize;
        if free.len() < need {
            return Err(ApiError::exhausted(format!(
                "a burst of {replicas} × {partitions} partitions needs {need} hosts with a free GPU and no GPU replica of {}; {} have one",
                m.name,
                free.len()
            )));
        }
        // Partitions are fetched from the holders in turn (their NICs add up), else from
        // the origin. A host that holds the data already fetches nothing.
        let source_of = |n: usize| match holders.get(n % holders.len().max(1)) {
            Some(addr) => format!("shardcast://{addr}"),
            None => m.origin.clone(),
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
                    &host, &m.name, &m.digest, &m.origin, &manifest, &part, &source, &heaviness,
                )
                .await
            {
                Ok(()) => {
                    hosts.push(HostProgress {
                        host: host.clone(),
                        state: "loading".into(),
                        total: m.total_bytes,
                        source: if holders.is_empty() {
                            "origin".into()
                        } else {
                            "peer".into()
                        },
                        gpus: 1,
                        gpu_state: "loading".into(),
                        ..Default::default()
                    });
                    parts.push(part);
                }
                Err(e) => {
                    self.release_gpu_slot(&host, &m.digest);
                    warn!(host, model = %m.name, "burst partition not started: {}", e.message);
                    hosts.push(HostProgress {
                        host,
                        state: "failed".into(),
                        error: e.message,
                        ..Default::default()
                    });
                }
            }
        }
        if parts.is_empty() {
            return Err(ApiError::unavailable(format!(
                "no burst partition of {} could start: {}",
                m.name,
                hosts
                    .iter()
                    .map(|h| format!("{}: {}", h.host, h.error))
                    .collect::<Vec<_>>()
                    .join("; ")
            )));
        }
        info!(model = %m.name, replicas, partitions, sources = holders.len(), cold_start_s = plan.cold_start_s, "burst started");
        Ok((
            PlanAccepted {
                plan_id: String::new(),
                estimate_s: plan.cold_start_s,
                chains: Vec::new(),
                hosts,
            },
            parts,
        ))
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
    ) -> Result<(), ApiError> {
        let mut agent = self.agent_client(host)?;
        let remote =
            |s: tonic::Status| ApiError::unavailable(format!("host {host}: {}", s.message()));
        agent
            .import_model(apb::ImportModelRequest {
                name: name.to_string(),
                origin: origin.to_string(),
                chunk_size: 0,
                tier: apb::Tier::Memory as i32,
                fetch: false,
                manifest: manifest.to_vec(),
            })
            .await
            .map_err(remote)?;
        agent
            .load_model(apb::LoadModelRequest {
                model: digest.to_string(),
                count: 1,
                gpus: Vec::new(),
                partition: Some(apb::PartitionSpec {
                    groups: part.groups.clone(),
                    complete: true,
                    source: source.to_string(),
                    label: part.label.clone(),
                }),
                heaviness: heaviness.to_string(),
            })
            .await
            .map_err(remote)?;
        info!(host, model = name, partition = %part.label, groups = part.groups.len(), "burst partition started");
        Ok(())
    }
}
