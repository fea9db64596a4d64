//! Trace-driven runs: one model's requests from a rate trace, a request queue served by the
//! model's GPU replicas ([`super::serve`]), an autoscaler ([`super::scalers`]) that asks the
//! real controller for more replicas (`ScaleOut`, or a `Prewarm` with `sources: origin`
//! for the baseline) and gives them back (GPU `Evict`), on the simulated datacenter, for the
//! trace's duration of virtual time.
//!
//! ```text
//!  trace ─► arrivals ─► Serving (global FIFO queue, replicas pull) ─► latencies
//!                          ▲ replicas resident (exact times)   │ queue, rates, busy time
//!                          │                                    ▼
//!  Datacenter ◄── agents ◄── Controller ◄── ScaleOut / Evict ◄── Scaler (every tick)
//! ```
//!
//! Each tick (1 s of virtual time) the run reads the replica groups the datacenter holds
//! (a group becomes serving at the exact instant its GPU load ended), adds the arrivals up
//! to now, starts what can start, asks the scaler for a count against the controller's
//! own reservation count (`scaling_view`), and carries the difference out:
//!
//! * **up**: the controller places and plans it (placement, sourcing, chains); the run stamps
//!   the planned hosts with the request time, so each replica's cold start runs from the
//!   scaler's decision to its GPU load's end;
//! * **down**: the newest hosts whose replicas are all serving, as many as fit in the
//!   count without removing more (the controller's GPU evict takes a host's every replica
//!   of the model); their serving runtime stops the replicas, and without lazy eviction
//!   the copy in host memory goes too (a memory `Evict`).
//!
//! Before the trace starts, the replicas its first minute needs are made warm (their hosts
//! seeded with a copy, a `Prewarm` from them) and are not counted as cold starts — unless
//! the run starts cold (`warm_start: false`): no replica and no copy anywhere, so the first
//! scale-up reads the origin in every row (where chains and locality part ways). After
//! the trace ends the run keeps going, without arrivals, until the queue is empty or
//! `drain_s` has passed; requests still waiting then count with their age at the end (a
//! lower bound of their latency).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use anyhow::Context;
use shardcast_controller::core::{EvictModel, Prewarm, ScaleOut};
use shardcast_controller::ops::Sources;
use shardcast_placement::{Target, Tier};

use super::autoscaler::ControllerScaler;
use super::coldstart::{Cluster, controller_config_for, percentile};
use super::dc::{DcConfig, ReplicaGroup, TierBytes};
use super::models::SimModel;
use super::pipelines::{PipelineEvent, Pipelines};
use super::scalers::{Observation, Scaler, ScalerKind};
use super::serve::Serving;
use super::trace::RateTrace;

/// Which of the thesis' techniques the cluster uses (§8.4: BL, LC, MC, MP, LC+MC,
/// LC+MC+MP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Technique {
    /// Every new host downloads from the origin (`Prewarm` with `sources: origin`); an
    /// evicted replica's host drops its copy.
    Baseline,
    /// Plus locality: evicted replicas' hosts keep their copy in memory (lazy eviction)
    /// and placement sources from peers holding one (hierarchical sourcing), one stream
    /// per receiver (`max_chain_len` 1: no multicast).
    Locality,
    /// Plus chain multicast: the controller's chains (16 hops at most), no lazy eviction.
    Multicast,
    /// Plus model partitioning: a scale-up the partition table splits is a partitioned
    /// burst through the controller ([`super::pipelines`]; its parts fetch from a peer
    /// holding the model, else the origin, as the controller's burst sources them), served
    /// as a pipeline until its parts hold the whole model; other replicas as the baseline's
    /// (`sources: origin`); no lazy eviction.
    Partitioning,
    /// Locality and chain multicast together, without partitioning.
    LocalityMulticast,
    /// Locality, chain multicast and partitioning: the controller as it ships.
    Combined,
}

impl Technique {
    /// As the comparison rows name it.
    pub fn label(self) -> &'static str {
        match self {
            Self::Baseline => "baseline: every host from the origin",
            Self::Locality => "+ locality (lazy eviction, peers)",
            Self::Multicast => "+ chain multicast",
            Self::Partitioning => "+ partitioning (bursts, pipelines)",
            Self::LocalityMulticast => "locality + chains",
            Self::Combined => "combined (locality + chains + partitions)",
        }
    }

    /// Whether scale-ups may be partitioned bursts.
    pub fn partitions(self) -> bool {
        matches!(self, Self::Partitioning | Self::Combined)
    }

    /// Whether whole replicas come from the origin (`Prewarm` with `sources: origin`).
    fn reads_origin(self) -> bool {
        matches!(self, Self::Baseline | Self::Partitioning)
    }

    /// `max_chain_len` for the controller (`None`: its default).
    fn max_chain_len(self) -> Option<usize> {
        match self {
            Self::Locality => Some(1),
            _ => None,
        }
    }

    /// Whether a replica's host keeps the model in memory after the replica is evicted.
    fn lazy_eviction(self) -> bool {
        matches!(
            self,
            Self::Locality | Self::LocalityMulticast | Self::Combined
        )
    }
}

/// One trace-driven run.
#[derive(Debug, Clone)]
pub struct TraceRun {
    /// The datacenter.
    pub dc: DcConfig,
    /// The model.
    pub model: SimModel,
    /// The request rate (its whole length is run).
    pub trace: RateTrace,
    /// The trace's name in the report.
    pub trace_name: String,
    /// Seed of the Poisson arrivals.
    pub seed: u64,
    /// The autoscaler.
    pub scaler: ScalerKind,
    /// The technique.
    pub technique: Technique,
    /// Heartbeat period of the hosts.
    pub heartbeat: Duration,
    /// The plan runner's poll tick.
    pub poll: Duration,
    /// The autoscaler's tick.
    pub tick: Duration,
    /// Seconds after the trace to let the queue drain.
    pub drain_s: f64,
    /// Seconds between timeline samples.
    pub sample_s: f64,
    /// Make the first minute's replicas warm before the trace (else start from nothing).
    pub warm_start: bool,
    /// Most partitions a burst uses (the partition table's `P`; 0: the controller's
    /// default, 8).
    pub max_partitions: usize,
}

/// Where it stands, for progress lines.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Virtual seconds into the trace.
    pub t: f64,
    /// The trace's length.
    pub duration: f64,
    /// Replicas the controller holds.
    pub replicas: u32,
    /// Replicas serving.
    pub serving: u32,
    /// Requests waiting.
    pub queue: usize,
    /// Wall seconds so far.
    pub wall_s: f64,
}

/// One timeline sample (for plots of replicas and queue over time).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Sample {
    /// Seconds into the trace.
    pub t: f64,
    /// Replicas the controller holds (loading included).
    pub replicas: u32,
    /// Replicas serving.
    pub serving: u32,
    /// Requests waiting.
    pub queue: usize,
    /// Arrivals since the previous sample.
    pub arrived: u64,
    /// Bytes read from the origin so far.
    pub origin_bytes: f64,
    /// Bytes that reached the hosts so far, by source tier (origin, peer, local).
    pub tiers: TierBytes,
}

/// A cold start: one GPU replica group from the scaler's decision to serving.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ColdStartRecord {
    /// Seconds into the trace of the decision.
    pub requested_s: f64,
    /// Seconds from the decision to serving.
    pub cold_start_s: f64,
    /// Replicas in the group.
    pub replicas: u32,
    /// Host id.
    pub host: String,
    /// Where the host's copy came from: `origin`, `local` or a host id.
    pub source: String,
    /// Partitions of a burst replica (its `replicas` GPUs form one pipeline); 0: whole.
    pub partitions: u32,
}

/// The outcome of one run: one comparison row.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TraceRow {
    /// The technique.
    pub technique: Technique,
    /// What the row is in the thesis' terms.
    pub label: &'static str,
    /// The model.
    pub model: String,
    /// The trace.
    pub trace: String,
    /// The autoscaler.
    pub scaler: ScalerKind,
    /// Requests in the trace.
    pub requests: usize,
    /// Requests served by the end.
    pub served: usize,
    /// Requests still waiting at the end (counted with their age then).
    pub unserved: usize,
    /// GPU replicas that cold-started (warm-up replicas not counted).
    pub cold_starts: usize,
    /// Replicas asked for that were not serving by the end (not in the averages).
    pub cold_starts_unfinished: u32,
    /// Mean cold start per replica, seconds.
    pub avg_cold_start_s: f64,
    /// 99th percentile (nearest rank).
    pub p99_cold_start_s: f64,
    /// Mean end-to-end latency (wait + service), seconds.
    pub avg_e2e_s: f64,
    /// 99th percentile.
    pub p99_e2e_s: f64,
    /// Replica-seconds held (the controller's reservations, loading included): the cost.
    pub replica_seconds: f64,
    /// Mean replicas held over the run.
    pub avg_replicas: f64,
    /// Most replicas held at once.
    pub peak_replicas: u32,
    /// Bytes read from the origin during the trace.
    pub bytes_from_origin: f64,
    /// Cold-started replicas by where their host's copy came from (`origin`, `local`,
    /// `peer`).
    pub sources: BTreeMap<String, u32>,
    /// Scale-ups asked of the controller.
    pub scale_ups: u32,
    /// Scale-downs carried out.
    pub scale_downs: u32,
    /// Scale requests the controller refused (e.g. no free GPU).
    pub scale_errors: u32,
    /// Partitioned burst replicas started (each over `partitions` GPUs).
    pub burst_replicas: u32,
    /// Burst replicas by partitions (`"4"` → replicas split in 4).
    pub partitions_used: BTreeMap<String, u32>,
    /// Bursts the controller refused (the scale-up then asked for whole replicas).
    pub burst_errors: u32,
    /// The last refusal.
    pub last_error: String,
    /// Replicas made warm before the trace.
    pub warm_replicas: u32,
    /// Virtual seconds simulated (trace + drain).
    pub virtual_s: f64,
    /// Wall seconds the run took.
    pub wall_s: f64,
    /// Replicas and queue over time.
    pub timeline: Vec<Sample>,
    /// Every cold start.
    pub cold_start_list: Vec<ColdStartRecord>,
}

/// Runs `spec` on a fresh datacenter and controller on its own paused runtime (call it from
/// a thread that is not running a runtime); `progress` is called about every 5% of the
/// trace.
pub fn run(spec: &TraceRun, progress: &mut dyn FnMut(&Progress)) -> anyhow::Result<TraceRow> {
    let rt = super::paused_runtime().context("building the simulator's runtime")?;
    let wall = Instant::now();
    let mut row = rt.block_on(drive(spec, progress, wall))?;
    row.wall_s = wall.elapsed().as_secs_f64();
    Ok(row)
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Where a host's copy came from, as a kind.
fn source_kind(source: &str) -> &'static str {
    match source {
        "origin" => "origin",
        "local" | "" => "local",
        _ => "peer",
    }
}

async fn drive(
    spec: &TraceRun,
    progress: &mut dyn FnMut(&Progress),
    wall: Instant,
) -> anyhow::Result<TraceRow> {
    let t = spec.technique;
    let cfg = controller_config_for(&spec.dc, spec.heartbeat, spec.poll, t.max_chain_len())?;
    anyhow::ensure!(
        !(t.partitions() && spec.scaler == ScalerKind::Controller),
        "{t:?} needs partitioned bursts, and the controller's Autoscaler is wired without them here (sim::autoscaler)"
    );
    let cluster = Cluster::open(&spec.dc, std::slice::from_ref(&spec.model), cfg)?;
    let (ctl, dc) = (&cluster.ctl, &cluster.dc);
    let name = spec.model.name;
    let digest = cluster.register(&spec.model, &spec.dc).await?;
    let partitioning = if t.partitions() {
        Some(Partitioning {
            tables: super::pipelines::open_tables(ctl)?,
            profile: spec.model.profile(&spec.dc.phases),
            link_bps: spec.dc.topology.host_link_bps,
            max_partitions: spec.max_partitions,
        })
    } else {
        None
    };
    let mut pipelines = Pipelines::default();
    let exec_s = spec.model.profile(&spec.dc.phases).total_exec_s();
    anyhow::ensure!(exec_s > 0.0, "{name} has no execution time");
    let mu = 1.0 / exec_s;
    let hosts = spec.dc.topology.hosts;
    let gpus = spec.dc.gpus_per_host.max(1);
    let max_replicas = u32::try_from(hosts)
        .unwrap_or(u32::MAX)
        .saturating_mul(gpus);

    // Warm start: the first minute's mean rate, served at 80%.
    let first: Vec<f64> = spec
        .trace
        .rps
        .iter()
        .take((60.0 / spec.trace.step_s).ceil().max(1.0) as usize)
        .copied()
        .collect();
    let warm = if spec.warm_start {
        ((mean(&first) / mu / 0.8).ceil() as u32).clamp(1, max_replicas)
    } else {
        0
    };
    if warm > 0 {
        let warm_hosts = warm.div_ceil(gpus) as usize;
        for k in 0..warm_hosts.min(hosts) {
            dc.seed(k * hosts / warm_hosts, name)?;
        }
        cluster.heartbeat_all()?;
        let accepted = ctl
            .prewarm(Prewarm {
                model: name.to_string(),
                target: Target::Replicas(warm),
                tier: Tier::Gpu,
                sources: Sources::Auto,
                transport: None,
            })
            .map_err(|e| anyhow::anyhow!("warm-up prewarm of {name}: {e}"))?;
        let (_, rx) = ctl.watch_plan(&accepted.plan_id)?;
        if let Some(mut rx) = rx {
            tokio::time::timeout(Duration::from_secs(3600), rx.wait_for(|p| !p.running()))
                .await
                .context("the warm-up plan did not end within an hour of virtual time")?
                .ok();
        }
    }

    let t0 = dc.now();
    let origin_before = dc.origin_bytes();
    let tiers_before = dc.tier_bytes();
    let arrivals = spec.trace.arrivals(spec.seed);
    let duration = spec.trace.duration_s();
    let tick = spec.tick.as_secs_f64();
    let mut serving = Serving::new(exec_s);
    let mut scaler = Scaler::new(spec.scaler);
    let mut service = if spec.scaler == ScalerKind::Controller {
        Some(ControllerScaler::new(
            &cluster,
            &digest,
            t.reads_origin(),
            t.lazy_eviction(),
            max_replicas,
        )?)
    } else {
        None
    };
    // Groups serving (id → (count, host)).
    let mut known: HashMap<u64, (u32, usize)> = HashMap::new();
    let mut cold: Vec<f64> = Vec::new();
    let mut row = TraceRow {
        technique: t,
        label: t.label(),
        model: name.to_string(),
        trace: spec.trace_name.clone(),
        scaler: spec.scaler,
        requests: arrivals.len(),
        served: 0,
        unserved: 0,
        cold_starts: 0,
        cold_starts_unfinished: 0,
        avg_cold_start_s: 0.0,
        p99_cold_start_s: 0.0,
        avg_e2e_s: 0.0,
        p99_e2e_s: 0.0,
        replica_seconds: 0.0,
        avg_replicas: 0.0,
        peak_replicas: 0,
        bytes_from_origin: 0.0,
        sources: BTreeMap::new(),
        scale_ups: 0,
        scale_downs: 0,
        scale_errors: 0,
        burst_replicas: 0,
        partitions_used: BTreeMap::new(),
        burst_errors: 0,
        last_error: String::new(),
        warm_replicas: warm,
        virtual_s: 0.0,
        wall_s: 0.0,
        timeline: Vec::new(),
        cold_start_list: Vec::new(),
    };
    let mut next = 0;
    let mut next_sample = 0.0;
    let mut sample_arrived = 0u64;
    let mut next_progress = 0.0;
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + spec.tick, spec.tick);
    let mut groups: Vec<ReplicaGroup>;
    loop {
        ticker.tick().await;
        let now = dc.now();
        let rel = now - t0;
        groups = dc.replicas(&digest);
        for g in &groups {
            // Parts of burst replicas: `pipelines` follows them.
            if !g.partition.is_empty() {
                continue;
            }
            let Some(at) = g.resident_at else { continue };
            if known.contains_key(&g.id) {
                continue;
            }
            known.insert(g.id, (g.count, g.host));
            serving.add_group(g.id, g.count, at);
            if g.requested_at >= t0 {
                let c = at - g.requested_at;
                cold.extend(std::iter::repeat_n(c, g.count as usize));
                *row.sources
                    .entry(source_kind(&g.source).into())
                    .or_default() += g.count;
                row.cold_start_list.push(ColdStartRecord {
                    requested_s: g.requested_at - t0,
                    cold_start_s: c,
                    replicas: g.count,
                    host: super::dc::host_id(g.host),
                    source: g.source.clone(),
                    partitions: 0,
                });
            }
        }
        for event in pipelines.update(&groups) {
            let cold_start = |at: f64, requested_at: f64, gpus: u32, host: usize, source: &str| {
                (requested_at >= t0).then(|| ColdStartRecord {
                    requested_s: requested_at - t0,
                    cold_start_s: at - requested_at,
                    replicas: gpus,
                    host: super::dc::host_id(host),
                    source: source.to_string(),
                    partitions: gpus,
                })
            };
            let record = match event {
                PipelineEvent::Live {
                    id,
                    gpus,
                    at,
                    timing,
                    requested_at,
                    host,
                    source,
                } => {
                    serving.add_pipeline(id, gpus, at, timing);
                    cold_start(at, requested_at, gpus, host, &source)
                }
                PipelineEvent::Whole {
                    id,
                    pipeline_gpus,
                    at,
                    groups: parts,
                    requested_at,
                    source,
                } => {
                    serving.remove_group(id, pipeline_gpus);
                    for &(gid, count, host) in &parts {
                        known.insert(gid, (count, host));
                        serving.add_group(gid, count, at);
                    }
                    // Parts of a pipeline that never served cold-started as whole replicas.
                    let gpus: u32 = parts.iter().map(|p| p.1).sum();
                    let host = parts.first().map_or(0, |p| p.2);
                    if pipeline_gpus == 0 {
                        cold_start(at, requested_at, gpus, host, &source).map(|mut c| {
                            c.partitions = 0;
                            c
                        })
                    } else {
                        None
                    }
                }
            };
            if let Some(c) = record {
                cold.extend(std::iter::repeat_n(c.cold_start_s, c.replicas as usize));
                *row.sources
                    .entry(source_kind(&c.source).into())
                    .or_default() += c.replicas;
                row.cold_start_list.push(c);
            }
        }
        while next < arrivals.len() && t0 + arrivals[next] <= now {
            serving.arrive(t0 + arrivals[next]);
            next += 1;
        }
        serving.advance(now);
        let window = serving.take_window();
        sample_arrived += window.arrived;
        let reserved = ctl
            .scaling_view(name, Tier::Gpu)
            .map_err(|e| anyhow::anyhow!("scaling view of {name}: {e}"))?
            .replicas;
        row.replica_seconds += f64::from(reserved) * tick;
        row.peak_replicas = row.peak_replicas.max(reserved);
        if rel + 1e-9 >= next_sample {
            row.timeline.push(Sample {
                t: rel,
                replicas: reserved,
                serving: serving.replicas(),
                queue: serving.queue_len(),
                arrived: std::mem::take(&mut sample_arrived),
                origin_bytes: dc.origin_bytes() - origin_before,
                tiers: dc.tier_bytes().since(tiers_before),
            });
            next_sample += spec.sample_s;
        }
        if rel + 1e-9 >= next_progress {
            progress(&Progress {
                t: rel,
                duration,
                replicas: reserved,
                serving: serving.replicas(),
                queue: serving.queue_len(),
                wall_s: wall.elapsed().as_secs_f64(),
            });
            next_progress += (duration / 20.0).max(tick);
        }
        let done = rel >= duration && (serving.queue_len() == 0 || rel >= duration + spec.drain_s);
        if done {
            break;
        }
        let measured = mean(&cold);
        let obs = Observation {
            now_s: rel,
            replicas: reserved,
            serving: serving.replicas(),
            queue_len: serving.queue_len(),
            oldest_wait_s: serving.oldest_waiting().map_or(0.0, |a| now - a),
            window,
            tick_s: tick,
            service_rate: mu,
            load_time_s: if cold.is_empty() {
                spec.dc.phases.startup_s(spec.model.bytes)
            } else {
                measured
            },
            max_replicas,
        };
        if let Some(service) = service.as_mut() {
            let log = service
                .tick(name, window.arrived, serving.queue_len(), mu)
                .await;
            row.scale_ups += log.scale_ups;
            row.scale_downs += log.scale_downs;
            row.scale_errors += log.errors;
            if !log.last_error.is_empty() {
                row.last_error = log.last_error;
            }
            for id in log.stopped {
                if let Some((count, _)) = known.get(&id) {
                    serving.remove_group(id, *count);
                }
            }
            continue;
        }
        let want = scaler.target(&obs);
        if want > reserved {
            let mut add = want - reserved;
            if let Some(mp) = &partitioning {
                add -= burst_up(
                    spec,
                    &cluster,
                    mp,
                    &mut pipelines,
                    add,
                    serving.queue_len(),
                    now,
                    &mut row,
                )
                .await;
            }
            let reserved = ctl
                .scaling_view(name, Tier::Gpu)
                .map_err(|e| anyhow::anyhow!("scaling view of {name}: {e}"))?
                .replicas;
            if add > 0 {
                scale_up(spec, &cluster, &digest, reserved, add, now, &mut row);
            }
        } else if want < reserved {
            let removed = scale_down(
                spec,
                &cluster,
                &digest,
                &groups,
                &known,
                reserved - want,
                &mut row,
            )
            .await;
            for id in removed {
                if let Some((count, _)) = known.get(&id) {
                    serving.remove_group(id, *count);
                }
            }
        }
    }
    let end = dc.now();
    // Replicas asked for during the trace and not serving at the end.
    row.cold_starts_unfinished = groups
        .iter()
        .filter(|g| g.partition.is_empty() && g.resident_at.is_none() && g.requested_at >= t0)
        .map(|g| g.count)
        .sum::<u32>()
        + pipelines.unfinished();
    let mut latencies = serving.latencies().to_vec();
    row.served = latencies.len();
    latencies.extend(serving.waiting().map(|a| end - a));
    row.unserved = latencies.len() - row.served;
    latencies.sort_by(f64::total_cmp);
    cold.sort_by(f64::total_cmp);
    row.cold_starts = cold.len();
    row.avg_cold_start_s = mean(&cold);
    row.p99_cold_start_s = percentile(&cold, 0.99);
    row.avg_e2e_s = mean(&latencies);
    row.p99_e2e_s = percentile(&latencies, 0.99);
    row.virtual_s = end - t0;
    row.avg_replicas = row.replica_seconds / row.virtual_s.max(tick);
    row.bytes_from_origin = dc.origin_bytes() - origin_before;
    Ok(row)
}

/// Asks the controller for `add` more replicas (the baseline: a `Prewarm` of the new total
/// with `sources: origin`) and stamps the planned hosts with the request time.
fn scale_up(
    spec: &TraceRun,
    cluster: &Cluster,
    digest: &str,
    reserved: u32,
    add: u32,
    now: f64,
    row: &mut TraceRow,
) {
    let name = spec.model.name.to_string();
    let accepted = if spec.technique.reads_origin() {
        cluster
            .ctl
            .prewarm(Prewarm {
                model: name,
                target: Target::Replicas(reserved + add),
                tier: Tier::Gpu,
                sources: Sources::Origin,
                transport: None,
            })
            .map_err(|e| e.to_string())
    } else {
        cluster
            .ctl
            .scale_out(ScaleOut {
                model: name,
                replicas: add,
                tier: Tier::Gpu,
                partitions: 0,
                transport: None,
            })
            .map_err(|e| e.to_string())
    };
    match accepted {
        Ok(a) => {
            row.scale_ups += 1;
            for r in a.hosts.iter().filter(|r| r.gpus > 0) {
                if let Some(h) = cluster.dc.host_index(&r.host) {
                    cluster.dc.expect_load(h, digest, now);
                }
            }
        }
        Err(e) => {
            row.scale_errors += 1;
            row.last_error = e;
        }
    }
}

/// What a run needs to start partitioned bursts.
struct Partitioning {
    tables: super::pipelines::Tables,
    profile: shardcast_policies::profile::ModelProfile,
    /// The link between a pipeline's parts, bytes/s.
    link_bps: f64,
    max_partitions: usize,
}

/// Starts as much of a scale-up of `add` replicas as the partition table splits as a
/// partitioned burst ([`super::pipelines`]); returns the replicas (GPUs) it covers, 0 when
/// the table says whole replicas or the controller refused the burst.
#[allow(clippy::too_many_arguments)]
async fn burst_up(
    spec: &TraceRun,
    cluster: &Cluster,
    mp: &Partitioning,
    pipelines: &mut Pipelines,
    add: u32,
    queue: usize,
    now: f64,
    row: &mut TraceRow,
) -> u32 {
    let name = spec.model.name;
    let p =
        match super::pipelines::choose_partitions(&mp.tables, name, queue, add, mp.max_partitions)
            .await
        {
            Ok(p) if p >= 2 => p,
            Ok(_) => return 0,
            Err(e) => {
                row.burst_errors += 1;
                row.last_error = e;
                return 0;
            }
        };
    let replicas = add / p;
    match super::pipelines::burst(&cluster.ctl, &mp.tables, name, replicas, p).await {
        Ok((_, parts)) => {
            row.scale_ups += 1;
            let n = pipelines.add_burst(&parts, &mp.profile, mp.link_bps, now, |h| {
                cluster.dc.host_index(h)
            });
            row.burst_replicas += n;
            *row.partitions_used.entry(p.to_string()).or_default() += n;
            // GPUs reserved: the parts that started.
            parts.len() as u32
        }
        Err(e) => {
            row.burst_errors += 1;
            row.last_error = e;
            0
        }
    }
}

/// Removes at most `remove` replicas: the newest hosts whose replicas all serve, as long as
/// their count fits. Returns the replica groups stopped.
async fn scale_down(
    spec: &TraceRun,
    cluster: &Cluster,
    digest: &str,
    groups: &[ReplicaGroup],
    known: &HashMap<u64, (u32, usize)>,
    remove: u32,
    row: &mut TraceRow,
) -> Vec<u64> {
    // Per host: replicas, newest resident time, all serving.
    let mut per_host: BTreeMap<usize, (u32, f64, bool)> = BTreeMap::new();
    for g in groups {
        let e = per_host
            .entry(g.host)
            .or_insert((0, f64::NEG_INFINITY, true));
        e.0 += g.count;
        e.1 = e.1.max(g.resident_at.unwrap_or(f64::INFINITY));
        e.2 &= g.resident_at.is_some() && known.contains_key(&g.id);
    }
    let mut candidates: Vec<(usize, u32, f64)> = per_host
        .into_iter()
        .filter(|(_, (_, _, all))| *all)
        .map(|(h, (n, newest, _))| (h, n, newest))
        .collect();
    candidates.sort_by(|a, b| b.2.total_cmp(&a.2).then(b.0.cmp(&a.0)));
    let mut left = remove;
    let mut victims = Vec::new();
    for (h, n, _) in candidates {
        if n <= left {
            left -= n;
            victims.push(super::dc::host_id(h));
        }
        if left == 0 {
            break;
        }
    }
    if victims.is_empty() {
        return Vec::new();
    }
    let evicted = match cluster
        .ctl
        .evict(EvictModel {
            model: spec.model.name.to_string(),
            hosts: victims,
            tier: Tier::Gpu,
        })
        .await
    {
        Ok(e) => e.evicted,
        Err(e) => {
            row.scale_errors += 1;
            row.last_error = e.to_string();
            return Vec::new();
        }
    };
    row.scale_downs += 1;
    let mut stopped = Vec::new();
    for host in &evicted {
        if let Some(h) = cluster.dc.host_index(host) {
            stopped.extend(cluster.dc.unload_gpus(h, digest));
        }
    }
    if !spec.technique.lazy_eviction() && !evicted.is_empty() {
        let r = cluster
            .ctl
            .evict(EvictModel {
                model: spec.model.name.to_string(),
                hosts: evicted,
                tier: Tier::Memory,
            })
            .await;
        if let Err(e) = r {
            row.scale_errors += 1;
            row.last_error = e.to_string();
        }
    }
    stopped
}

#[cfg(test)]
#[path = "workload_tests.rs"]
mod tests;
