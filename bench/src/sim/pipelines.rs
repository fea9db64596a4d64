//! Partitioned replicas in a trace-driven run (the rows with partitioning, Flashpoint §4.2
//! and §8.4's MP): how a scale-up becomes a partitioned burst through the controller, and
//! how a burst's replica serves — a pipeline of its parts until every part holds the whole
//! model, then one whole replica per part.
//!
//! ```text
//!  scale-up of `add` ── PartitionTables::plan_table → best_for(queue) → p ≤ add
//!        │ (p ≥ 2)            PartitionTables::burst_plan(p) ─► Controller::burst (real)
//!        ▼                                                         │ LoadModel + partition
//!  Pipelines ◄── parts live / resident (ReplicaGroup) ── Datacenter ◄┘ (sim::parts)
//!        │ live: one pipeline slot (Timing)   all resident: whole replicas
//!        ▼
//!     Serving
//! ```
//!
//! * **How many partitions.** The controller's own rule, as its `Autoscaler` offers a
//!   burst (`burst_option`): the best plan of the model's partition table for the queue
//!   at the time of the scale-up (P = [`DEFAULT_MAX_PARTITIONS`] unless the run says
//!   otherwise), capped at the GPUs being added (§4.2.3: "used when the autoscaling policy
//!   decides to scale up by fewer … than the optimal number of partitions"). A scale-up of
//!   `add` GPUs with `p` partitions is `add / p` burst replicas (each over `p` hosts, one
//!   GPU each) and `add % p` whole replicas. Then, as `services::burst` does for a
//!   `ScaleOut` with `partitions`: the table's plan with `p` partitions
//!   ([`PartitionTables::burst_plan`]) and [`Controller::burst`].
//! * **Serving.** A burst replica serves once every part is live, as one pipeline slot
//!   ([`pipeline_timing`]): stage `k` executes its groups (the profile's `exec_s`) and hands
//!   its last group's output (`output_bytes`, the T5-3B-implied 5.09 MB,
//!   `shardcast_policies::profile::t5_3b_activation_bytes`) to stage `k + 1` over the
//!   partitions' link (the tables' rate: the hosts' NICs, 50 Gbit/s by default: 0.81 ms a
//!   hop). Transfers are not flows in the network model (5 MB a request).
//! * **Switching.** Each part keeps loading the rest of the model (completion); when every
//!   part holds the whole model, the pipeline stops taking requests and each part serves
//!   as a whole replica from that instant. A part that fails or never starts leaves its
//!   pipeline incomplete: it never serves as a pipeline, and its other parts serve as
//!   whole replicas once they hold the model.
//! * **Cold starts.** A burst replica over `p` GPUs counts `p` cold starts (one per GPU,
//!   like `p` whole replicas), each from the scale-up decision to the pipeline serving.

use std::sync::Arc;

use shardcast_controller::burst::BurstPart;
use shardcast_controller::core::Controller;
use shardcast_controller::plan::Accepted;
use shardcast_controller::ptables::{
    DEFAULT_MAX_PARTITIONS, PartitionConfig, PartitionTables, table_queue,
};
use shardcast_policies::profile::ModelProfile;

use super::dc::ReplicaGroup;
use super::serve::Timing;
use super::store::MemStore;

/// The partition tables over the simulated cluster's controller.
pub type Tables = PartitionTables<Controller>;

/// The partition-plan service over `ctl` (its registry and inventory: the registered
/// profile, the hosts' GPUs and NICs), with its own in-memory store, at the default rates.
pub fn open_tables(ctl: &Arc<Controller>) -> anyhow::Result<Tables> {
    PartitionTables::restore(
        ctl.clone(),
        Arc::new(MemStore::default()),
        PartitionConfig::default(),
    )
    .map_err(|e| anyhow::anyhow!("partition tables: {e}"))
}

/// Partitions for a scale-up of `add` replicas with `queue` requests waiting (module docs):
/// below 2, whole replicas. `max_partitions` 0: [`DEFAULT_MAX_PARTITIONS`].
pub async fn choose_partitions(
    tables: &Tables,
    model: &str,
    queue: usize,
    add: u32,
    max_partitions: usize,
) -> Result<u32, String> {
    let queue = u32::try_from(queue).unwrap_or(u32::MAX).max(1);
    let max_p = if max_partitions == 0 {
        DEFAULT_MAX_PARTITIONS
    } else {
        max_partitions
    };
    let (_, _, table, _) = tables
        .plan_table(model, max_p, None, table_queue(queue))
        .await
        .map_err(|e| e.to_string())?;
    let best = table.best_for(queue).map_or(1, |p| p.partition_count());
    Ok(u32::try_from(best).unwrap_or(u32::MAX).min(add))
}

/// A partitioned burst of `replicas` × `partitions`, as the controller's `ScaleOut` with
/// `partitions` starts one (`services::burst`): the tables' plan, then the core.
pub async fn burst(
    ctl: &Arc<Controller>,
    tables: &Tables,
    model: &str,
    replicas: u32,
    partitions: u32,
) -> Result<(Accepted, Vec<BurstPart>), String> {
    let plan = tables
        .burst_plan(model, partitions, 1)
        .await
        .map_err(|e| e.to_string())?;
    ctl.burst(model, replicas, plan)
        .await
        .map_err(|e| e.to_string())
}

/// How a pipeline over `parts` (each part's layer groups, in order) of `profile` serves,
/// with activations crossing `link_bps` between parts (module docs). Groups the profile
/// does not name count nothing.
pub fn pipeline_timing(profile: &ModelProfile, parts: &[Vec<String>], link_bps: f64) -> Timing {
    let group = |name: &String| profile.groups.iter().find(|g| &g.name == name);
    let mut execs = Vec::with_capacity(parts.len());
    let mut transfers = Vec::with_capacity(parts.len());
    for (k, part) in parts.iter().enumerate() {
        execs.push(part.iter().filter_map(group).map(|g| g.exec_s).sum::<f64>());
        if k + 1 < parts.len() {
            let out = part.last().and_then(group).map_or(0, |g| g.output_bytes);
            transfers.push(if link_bps > 0.0 {
                out as f64 / link_bps
            } else {
                0.0
            });
        }
    }
    let slowest = execs
        .iter()
        .chain(&transfers)
        .fold(0.0_f64, |a, &b| a.max(b));
    Timing {
        interval_s: slowest,
        latency_s: execs.iter().sum::<f64>() + transfers.iter().sum::<f64>(),
        busy_s: slowest * parts.len() as f64,
    }
}

/// One burst replica.
#[derive(Debug, Clone)]
struct Pipeline {
    /// Its serving group id (counting down from `u64::MAX`: the datacenter's load ids
    /// count up from 0).
    id: u64,
    /// Its parts' (host, label), in stage order.
    parts: Vec<(usize, String)>,
    /// Partitions of the plan (parts that started may be fewer).
    partitions: usize,
    requested_at: f64,
    timing: Timing,
    live_at: Option<f64>,
    whole: bool,
}

/// What became of a burst replica since the last [`Pipelines::update`].
#[derive(Debug, Clone, PartialEq)]
pub enum PipelineEvent {
    /// Every part is live: the pipeline serves.
    Live {
        /// Serving group id.
        id: u64,
        /// GPUs (parts).
        gpus: u32,
        /// When the last part went live.
        at: f64,
        /// How it serves.
        timing: Timing,
        /// The scale-up's time.
        requested_at: f64,
        /// Its first part's host.
        host: usize,
        /// Where its first part's bytes came from.
        source: String,
    },
    /// Every part holds the whole model: the pipeline (if it served) stops, the parts serve
    /// as whole replicas.
    Whole {
        /// Serving group id of the pipeline.
        id: u64,
        /// GPUs of the pipeline (0 if it never served).
        pipeline_gpus: u32,
        /// When the last part became resident.
        at: f64,
        /// The parts' replica groups: (load id, GPUs, host).
        groups: Vec<(u64, u32, usize)>,
        /// The scale-up's time.
        requested_at: f64,
        /// Where the first part's bytes came from.
        source: String,
    },
}

/// The burst replicas of a run.
#[derive(Debug, Default)]
pub struct Pipelines {
    list: Vec<Pipeline>,
    started: u32,
}

impl Pipelines {
    /// Records a started burst (`parts` as the controller answered, labels `r.k/p`) asked
    /// at `requested_at`; `host_of` maps a host id to its index. Returns the burst's
    /// replicas.
    pub fn add_burst(
        &mut self,
        parts: &[BurstPart],
        profile: &ModelProfile,
        link_bps: f64,
        requested_at: f64,
        host_of: impl Fn(&str) -> Option<usize>,
    ) -> u32 {
        // label "r.k/p" → (r, k, p)
        let parse = |label: &str| -> Option<(u32, u32, u32)> {
            let (rk, p) = label.split_once('/')?;
            let (r, k) = rk.split_once('.')?;
            Some((r.parse().ok()?, k.parse().ok()?, p.parse().ok()?))
        };
        let mut replicas: std::collections::BTreeMap<u32, Vec<(u32, &BurstPart, u32)>> =
            Default::default();
        for part in parts {
            if let Some((r, k, p)) = parse(&part.label) {
                replicas.entry(r).or_default().push((k, part, p));
            }
        }
        let mut added = 0;
        for (_, mut list) in replicas {
            list.sort_by_key(|(k, _, _)| *k);
            let partitions = list.first().map_or(0, |(_, _, p)| *p as usize);
            let groups: Vec<Vec<String>> = list.iter().map(|(_, b, _)| b.groups.clone()).collect();
            let parts: Vec<(usize, String)> = list
                .iter()
                .filter_map(|(_, b, _)| Some((host_of(&b.host)?, b.label.clone())))
                .collect();
            self.started += 1;
            self.list.push(Pipeline {
                id: u64::MAX - u64::from(self.started),
                parts,
                partitions,
                requested_at,
                timing: pipeline_timing(profile, &groups, link_bps),
                live_at: None,
                whole: false,
            });
            added += 1;
        }
        added
    }

    /// Burst replicas started so far.
    pub fn started(&self) -> u32 {
        self.started
    }

    /// GPUs of burst replicas asked for that neither serve as a pipeline nor as whole
    /// replicas yet.
    pub fn unfinished(&self) -> u32 {
        self.list
            .iter()
            .filter(|p| p.live_at.is_none() && !p.whole)
            .map(|p| p.parts.len() as u32)
            .sum()
    }

    /// What changed, from the datacenter's replica groups now (module docs).
    pub fn update(&mut self, groups: &[ReplicaGroup]) -> Vec<PipelineEvent> {
        let mut events = Vec::new();
        for p in self.list.iter_mut().filter(|p| !p.whole) {
            let found: Vec<&ReplicaGroup> = p
                .parts
                .iter()
                .filter_map(|(host, label)| {
                    groups
                        .iter()
                        .find(|g| g.host == *host && &g.partition == label)
                })
                .collect();
            if found.len() < p.parts.len() || found.is_empty() {
                continue;
            }
            let source = found[0].source.clone();
            let latest = |f: fn(&ReplicaGroup) -> Option<f64>| -> Option<f64> {
                found
                    .iter()
                    .map(|&g| f(g))
                    .try_fold(f64::NEG_INFINITY, |a, t| Some(a.max(t?)))
            };
            if p.live_at.is_none()
                && p.parts.len() == p.partitions
                && let Some(at) = latest(|g| g.live_at)
            {
                p.live_at = Some(at);
                events.push(PipelineEvent::Live {
                    id: p.id,
                    gpus: p.parts.len() as u32,
                    at,
                    timing: p.timing,
                    requested_at: p.requested_at,
                    host: p.parts[0].0,
                    source: source.clone(),
                });
            }
            if let Some(at) = latest(|g| g.resident_at) {
                p.whole = true;
                events.push(PipelineEvent::Whole {
                    id: p.id,
                    pipeline_gpus: if p.live_at.is_some() {
                        p.parts.len() as u32
                    } else {
                        0
                    },
                    at,
                    groups: found.iter().map(|g| (g.id, g.count, g.host)).collect(),
                    requested_at: p.requested_at,
                    source,
                });
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardcast_policies::profile::LayerGroup;

    fn group(name: &str, exec_s: f64, output_bytes: u64) -> LayerGroup {
        LayerGroup {
            name: name.into(),
            weight_bytes: 1,
            load_s: 1.0,
            exec_s,
            output_bytes,
        }
    }

    use std::time::Duration;

    use shardcast_controller::agents::{AgentAt, Agents};
    use shardcast_controller::core::Prewarm;
    use shardcast_controller::ops::Sources;
    use shardcast_controller::plan::ReceiverState;
    use shardcast_controller::ptables::ModelSource;
    use shardcast_placement::{Target, Tier};

    use crate::sim::coldstart::{Cluster, controller_config_for};
    use crate::sim::dc::{DcConfig, ORIGIN_PARALLEL};
    use crate::sim::models::{Phases, SimModel};
    use crate::sim::net::Topology;
    use crate::sim::serve::Serving;

    /// Waits (virtual time) until plan `id` ends; returns it.
    async fn ended(cluster: &Cluster, id: &str) -> shardcast_controller::plan::Plan {
        let (now, rx) = cluster.ctl.watch_plan(id).unwrap();
        let Some(mut rx) = rx else {
            return now;
        };
        tokio::time::timeout(Duration::from_secs(600), rx.wait_for(|p| !p.running()))
            .await
            .unwrap()
            .unwrap()
            .clone()
    }

    /// A 2 GB model of two 1 GB layer groups on three one-GPU hosts with 2 GB/s links;
    /// loading at 1 GB/s into host memory and 10 GB/s onto the GPU (1.1 s per GB). Host 0
    /// serves a whole replica; then the controller's burst splits one more replica in two,
    /// on hosts 1 and 2, both fetching from host 0.
    ///
    /// By hand, from the burst (t = 0): both parts share host 0's 2 GB/s uplink, 1 GB each
    /// → on their hosts at 1.0 s; each loads in 1.1 s → live at 2.1 s. The rests (1 GB
    /// each) follow on the same uplink → there at 2.0 s, loaded after the parts: 2.1 + 1.1
    /// → resident at 3.2 s. The pipeline: each stage executes 1 GB at T5-3B's 0.5 s per
    /// 11,408 MB (43.83 ms) and stage 1 hands 5.09 MB to stage 2 at 2 GB/s (2.54 ms): it
    /// takes a request every 43.83 ms and each takes 90.20 ms.
    #[tokio::test(start_paused = true)]
    async fn a_partitioned_scale_out_serves_through_its_pipeline_then_as_whole_replicas() {
        let dc_cfg = DcConfig {
            topology: Topology {
                hosts: 3,
                hosts_per_leaf: 3,
                host_link_bps: 2e9,
                leaf_uplink_bps: 1e12,
                origin_link_bps: None,
                origin_stream_bps: None,
            },
            gpus_per_host: 1,
            gpu_memory: 24 << 30,
            host_memory: 200 << 30,
            phases: Phases {
                load_bps: 1e9,
                gpu_bps: 1e10,
            },
            chunk_size: 1 << 20,
            hop_cap_bps: None,
            origin_parallel: ORIGIN_PARALLEL,
            progress_period: Duration::from_secs(2),
        };
        let model = SimModel {
            name: "tiny-2l",
            label: "Tiny",
            params: "-",
            bytes: 2_000_000_000,
            layers: 2,
            shards: None,
        };
        let cfg = controller_config_for(
            &dc_cfg,
            Duration::from_secs(1),
            Duration::from_millis(250),
            None,
        )
        .unwrap();
        let cluster = Cluster::open(&dc_cfg, std::slice::from_ref(&model), cfg).unwrap();
        let digest = cluster.register(&model, &dc_cfg).await.unwrap();
        cluster.dc.seed(0, model.name).unwrap();
        cluster.heartbeat_all().unwrap();
        let warm = cluster
            .ctl
            .prewarm(Prewarm {
                model: model.name.into(),
                target: Target::Replicas(1),
                tier: Tier::Gpu,
                sources: Sources::Auto,
                transport: None,
            })
            .unwrap();
        ended(&cluster, &warm.plan_id).await;
        cluster.heartbeat_all().unwrap();

        // The holder's hand-off is the tensor index the tables would read.
        let index = ModelSource::tensor_index(&*cluster.ctl, "h0000", &digest)
            .await
            .unwrap();
        assert_eq!(
            index,
            [
                ("layer.0.s0.weight".to_string(), 1_000_000_000),
                ("layer.1.s0.weight".to_string(), 1_000_000_000)
            ]
        );

        let tables = open_tables(&cluster.ctl).unwrap();
        assert_eq!(
            choose_partitions(&tables, model.name, 1, 1, 0).await,
            Ok(1),
            "one GPU added: one part"
        );
        let t0 = cluster.dc.now();
        let (accepted, parts) = burst(&cluster.ctl, &tables, model.name, 1, 2)
            .await
            .unwrap();
        let hosts: Vec<(&str, &str, &[String])> = parts
            .iter()
            .map(|p| (p.host.as_str(), p.label.as_str(), p.groups.as_slice()))
            .collect();
        assert_eq!(
            hosts,
            [
                ("h0001", "1.1/2", &["layer.0".to_string()][..]),
                ("h0002", "1.2/2", &["layer.1".to_string()][..])
            ]
        );
        let profile = model.profile(&dc_cfg.phases);
        let mut pipes = Pipelines::default();
        let n = pipes.add_burst(&parts, &profile, 2e9, t0, |h| cluster.dc.host_index(h));
        assert_eq!((n, pipes.unfinished()), (1, 2));

        let stage = 1e9 * 0.5 / 11_408e6;
        let hop = shardcast_policies::profile::t5_3b_activation_bytes() as f64 / 2e9;
        let (interval, latency) = (stage, 2.0 * stage + hop);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6;

        tokio::time::sleep(Duration::from_millis(2500)).await;
        let groups = cluster.dc.replicas(&digest);
        let events = pipes.update(&groups);
        let [
            PipelineEvent::Live {
                id,
                gpus: 2,
                at,
                timing,
                ..
            },
        ] = events.as_slice()
        else {
            panic!("{events:?}");
        };
        assert!(close(*at - t0, 2.1), "live at {}", at - t0);
        assert!(close(timing.interval_s, interval) && close(timing.latency_s, latency));
        // While only its partition is live, a part's hand-off lists its own tensors.
        let at1 = AgentAt {
            host: "h0001".into(),
            addr: "sim:h0001:agent".into(),
        };
        let part_index: serde_json::Value = serde_json::from_str(
            &crate::sim::agents::SimAgents::new(cluster.dc.clone())
                .handoff(&at1, &digest)
                .await
                .unwrap(),
        )
        .unwrap();
        assert_eq!(part_index["partition"], "1.1/2");
        assert_eq!(part_index["tensors"].as_array().unwrap().len(), 1);

        // Three requests waiting since the burst: they enter the pipeline one stage apart.
        let mut serving = Serving::new(2.0 * stage);
        for _ in 0..3 {
            serving.arrive(t0);
        }
        serving.add_pipeline(*id, 2, *at, *timing);
        serving.advance(t0 + 3.0);
        for (k, l) in serving.latencies().iter().enumerate() {
            assert!(close(*l, 2.1 + k as f64 * interval + latency), "{k}: {l}");
        }

        tokio::time::sleep(Duration::from_millis(1000)).await;
        let groups = cluster.dc.replicas(&digest);
        let events = pipes.update(&groups);
        let [
            PipelineEvent::Whole {
                pipeline_gpus: 2,
                at,
                groups: whole,
                ..
            },
        ] = events.as_slice()
        else {
            panic!("{events:?}");
        };
        assert!(close(*at - t0, 3.2), "whole at {}", at - t0);
        assert_eq!(
            whole.iter().map(|g| (g.1, g.2)).collect::<Vec<_>>(),
            [(1, 1), (1, 2)]
        );
        assert_eq!(pipes.unfinished(), 0);
        // Whole replicas from then on: a request at 3.5 s takes the model's 87.66 ms.
        serving.remove_group(*id, 2);
        for g in whole {
            serving.add_group(g.0, g.1, *at);
        }
        serving.arrive(t0 + 3.5);
        serving.advance(t0 + 4.0);
        assert!(close(*serving.latencies().last().unwrap(), 2.0 * stage));

        // The controller's burst ends with both hosts holding the whole model.
        let plan = ended(&cluster, &accepted.plan_id).await;
        assert!(
            plan.hosts.iter().all(|h| h.state == ReceiverState::Done),
            "{:?}",
            plan.hosts
        );
        assert!(plan.live_s >= 2.1 && plan.live_s < 3.2, "{}", plan.live_s);
        let ready = cluster.dc.ready(&digest);
        for r in ready.iter().filter(|r| r.host != "h0000") {
            assert!(close(r.copy_s.unwrap() - t0, 2.0), "{r:?}");
            assert!(close(r.gpu_s.unwrap() - t0, 3.2), "{r:?}");
            assert_eq!(r.source, "h0000");
        }
    }

    #[test]
    fn a_pipelines_interval_is_its_slowest_stage_and_its_latency_the_sum() {
        let profile = ModelProfile {
            model: "m".into(),
            groups: vec![
                group("a", 0.1, 1_000),
                group("b", 0.2, 4_000),
                group("c", 0.3, 9_000),
            ],
            estimated: true,
            notes: Vec::new(),
        };
        // Parts [a, b] and [c] over 1,000 B/s: stage 0 executes 0.3 s, hands b's 4,000
        // bytes in 4 s; stage 1 executes 0.3 s.
        let t = pipeline_timing(
            &profile,
            &[vec!["a".into(), "b".into()], vec!["c".into()]],
            1e3,
        );
        assert!((t.interval_s - 4.0).abs() < 1e-12);
        assert!((t.latency_s - 4.6).abs() < 1e-12);
        assert!((t.busy_s - 8.0).abs() < 1e-12);
        // One part: a whole replica's service.
        let whole = pipeline_timing(&profile, &[vec!["a".into(), "b".into(), "c".into()]], 1e3);
        assert!((whole.latency_s - 0.6).abs() < 1e-12 && (whole.interval_s - 0.6).abs() < 1e-12);
    }
}
