//! One cold-start burst on the simulated datacenter, through the real controller: `N`
//! GPU replicas of one model on hosts that hold nothing, every host from the origin (the
//! thesis' baseline) or by the controller's own plan (chains from the origin and peers).
//!
//! The controller is opened with [`Controller::open_with`] on the simulated agents and an
//! in-memory store, on a current-thread tokio runtime whose clock starts paused: its plan
//! runner, heartbeat expiry and timeouts, the agents' pushes and the network's events all
//! run on one virtual clock that jumps from event to event. The hosts register through
//! [`Controller::heartbeat`] like transferd does, the model through
//! [`Controller::register_model`] (a host builds the manifest), and the burst is a
//! [`Controller::prewarm`] of tier gpu; the run ends when the plan ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use shardcast_controller::core::{Controller, ControllerConfig, Prewarm, Register, Registered};
use shardcast_controller::ops::Sources;
use shardcast_placement::{PlanParams, Target, Tier};
use shardcast_protocol::origin_policy::{Enforcer, OriginPolicy};
use tokio_util::sync::CancellationToken;

use super::agents::SimAgents;
use super::dc::{Datacenter, DcConfig, HostReady, TierBytes};
use super::faults::{FaultEvent, FaultSpec, Role};
use super::models::SimModel;
use super::store::MemStore;

/// The bucket the simulated models are registered from (`s3://flashpoint-sim/<name>`).
pub const ORIGIN_PREFIX: &str = "s3://flashpoint-sim/";

/// How the replicas get the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// Every host downloads from the origin itself (the thesis' baseline; the controller's
    /// `sources: origin`).
    Baseline,
    /// The controller's plan: hierarchical sources and pipelined chains (the thesis'
    /// "+ chain multicast").
    Chain,
}

impl Method {
    /// As the comparison rows name it.
    pub fn label(self) -> &'static str {
        match self {
            Self::Baseline => "baseline: every host from the origin",
            Self::Chain => "+ chain multicast",
        }
    }
}

/// One cold-start burst.
#[derive(Debug, Clone)]
pub struct ColdStart {
    /// The datacenter.
    pub dc: DcConfig,
    /// The model.
    pub model: SimModel,
    /// GPU replicas asked for (every GPU of the hosts holding the model first, then one GPU
    /// on each new host: placement's Pareto-greedy).
    pub replicas: u32,
    /// Hosts that hold the model in memory before the burst (spread evenly over the host
    /// indices, hence over the leaves).
    pub warm: usize,
    /// The tier the prewarm fills: `Gpu` (a cold start: a GPU replica resident) or
    /// `Memory` (a complete copy in host memory, as `cold-start --emulate` measures).
    pub tier: Tier,
    /// Heartbeat period of the hosts (and the controller's expiry tick).
    pub heartbeat: Duration,
    /// The plan runner's poll tick.
    pub poll: Duration,
    /// Virtual time after which the run gives up.
    pub limit: Duration,
}

/// A host's cold start, seconds after the prewarm.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HostColdStart {
    /// Host id.
    pub host: String,
    /// Where its bytes came from.
    pub source: String,
    /// Its copy was complete in host memory.
    pub copy_s: Option<f64>,
    /// It was ready in the prewarm's tier: its GPU replica was resident (the cold start),
    /// or for a prewarm of tier memory its copy was complete.
    pub ready_s: Option<f64>,
}

/// Bytes by source tier at one instant of a burst (for the bytes-over-time plot).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TierSample {
    /// Seconds after the prewarm.
    pub t: f64,
    /// Bytes by tier since the prewarm.
    pub bytes: TierBytes,
}

/// How often a burst samples its tier bytes at first: fine enough for a chained burst of
/// a minute (240 samples); a long one thins its series ([`MAX_TIER_SAMPLES`]).
pub const TIER_SAMPLE: Duration = Duration::from_millis(250);

/// The most tier samples a burst keeps: at this many it drops every other one and samples
/// half as often from then on, so a 200-host baseline of hours keeps 256–512 evenly
/// spaced samples and wakes about a thousand times for them, not 30,000.
pub const MAX_TIER_SAMPLES: usize = 512;

/// A series sampled at multiples of a base period, thinned to every other sample (and
/// sampled half as often) whenever [`MAX_TIER_SAMPLES`] are kept: the kept ones stay
/// evenly spaced.
#[derive(Debug)]
struct Thinned {
    base: f64,
    /// Base periods between samples.
    every: u64,
    /// The next sample's time, in base periods.
    next: u64,
    samples: Vec<TierSample>,
}

impl Thinned {
    fn new(base: Duration) -> Self {
        Self {
            base: base.as_secs_f64(),
            every: 1,
            next: 0,
            samples: Vec::new(),
        }
    }

    /// When the next sample is due, seconds from the start.
    fn due(&self) -> f64 {
        self.next as f64 * self.base
    }

    /// Keeps `sample` (taken at [`Self::due`]). The next one is due a period later: a
    /// multiple of the doubled period when this one fills the series, since it was
    /// kept at a multiple of the old one and the thinning keeps every other.
    fn push(&mut self, sample: TierSample) {
        self.samples.push(sample);
        self.next += self.every;
        if self.samples.len() >= MAX_TIER_SAMPLES {
            let mut k = 0;
            self.samples.retain(|_| {
                k += 1;
                k % 2 == 1
            });
            self.every *= 2;
        }
    }
}

/// The outcome of a burst: one comparison row.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ColdStartRow {
    /// The method.
    pub method: Method,
    /// What the row is in the thesis' terms.
    pub label: &'static str,
    /// The model's registry name.
    pub model: String,
    /// Replicas asked for.
    pub replicas: u32,
    /// Hosts whose replica became resident.
    pub ready: usize,
    /// The plan's end state.
    pub plan_state: String,
    /// Chains the plan started (re-plans included).
    pub chains: usize,
    /// Mean cold start (prewarm → resident), seconds.
    pub avg_cold_start_s: f64,
    /// Median.
    pub p50_cold_start_s: f64,
    /// 99th percentile (nearest rank).
    pub p99_cold_start_s: f64,
    /// Slowest.
    pub max_cold_start_s: f64,
    /// Mean time to a complete copy in host memory, seconds.
    pub avg_copy_s: f64,
    /// Bytes read from the origin.
    pub bytes_from_origin: f64,
    /// Virtual seconds simulated (prewarm → plan end).
    pub virtual_s: f64,
    /// Wall-clock seconds the run took.
    pub wall_s: f64,
    /// Every receiver, by host id.
    pub hosts: Vec<HostColdStart>,
    /// Bytes by source tier over the burst: evenly spaced samples from the prewarm (every
    /// [`TIER_SAMPLE`], or a multiple of it for a long burst) and one at its end.
    pub tiers: Vec<TierSample>,
}

/// Nearest-rank percentile of sorted `xs` (`q` in 0..=1); 0 when empty.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Runs one burst on a fresh datacenter and controller, on its own paused runtime (call it
/// from a thread that is not running a runtime).
pub fn run(spec: &ColdStart, method: Method) -> anyhow::Result<ColdStartRow> {
    let rt = super::paused_runtime().context("building the simulator's runtime")?;
    let wall = Instant::now();
    let mut row = rt.block_on(burst(spec, method, &[], 0))?.0;
    row.wall_s = wall.elapsed().as_secs_f64();
    Ok(row)
}

/// What a run with faults logged: the events, and each host a fault touched as (host id,
/// fault index, role).
pub type FaultLog = (Vec<FaultEvent>, Vec<(String, usize, Role)>);

/// [`run`] with `faults` injected at their times after the prewarm ([`super::faults`];
/// `seed` picks random targets): the row, the events and the hosts the faults touched.
pub fn run_with_faults(
    spec: &ColdStart,
    method: Method,
    faults: &[FaultSpec],
    seed: u64,
) -> anyhow::Result<(ColdStartRow, FaultLog)> {
    let rt = super::paused_runtime().context("building the simulator's runtime")?;
    let wall = Instant::now();
    let (mut row, log) = rt.block_on(burst(spec, method, faults, seed))?;
    row.wall_s = wall.elapsed().as_secs_f64();
    Ok((row, log))
}

/// The controller configuration the simulator runs: the production defaults, with the
/// origin allow-list naming the simulated bucket, no copy kept by the registering host (the
/// burst starts from a cluster that holds nothing), and rates from the topology for the
/// placement estimates.
pub fn controller_config(spec: &ColdStart) -> anyhow::Result<ControllerConfig> {
    controller_config_for(&spec.dc, spec.heartbeat, spec.poll, None)
}

/// [`controller_config`] for a datacenter, heartbeat and poll tick; `max_chain_len` caps
/// the hops of a chain (1: no multicast, each receiver its own stream from its source).
pub fn controller_config_for(
    dc: &DcConfig,
    heartbeat: Duration,
    poll: Duration,
    max_chain_len: Option<usize>,
) -> anyhow::Result<ControllerConfig> {
    let topo = &dc.topology;
    let origin_bps = topo
        .origin_stream_bps
        .or(topo.origin_link_bps)
        .unwrap_or(topo.host_link_bps);
    let defaults = PlanParams::default();
    Ok(ControllerConfig {
        heartbeat,
        poll,
        plan: PlanParams {
            origin_bps: origin_bps as u64,
            default_nic_bps: topo.host_link_bps as u64,
            max_chain_len: max_chain_len.unwrap_or(defaults.max_chain_len),
            ..defaults
        },
        register_keeps_copy: false,
        origins: OriginPolicy::parse([ORIGIN_PREFIX], Enforcer::Controller)
            .context("the simulator's origin prefix")?,
        ..ControllerConfig::default()
    })
}

/// A simulated cluster running on the current (paused) runtime: the datacenter, the real
/// controller on its agent port, and the hosts' heartbeats. Dropping it stops them.
pub struct Cluster {
    /// The controller.
    pub ctl: Arc<Controller>,
    /// The datacenter.
    pub dc: Arc<Datacenter>,
    cancel: CancellationToken,
}

impl Cluster {
    /// Opens the controller with `cfg` on a fresh datacenter of `dc` knowing `models`;
    /// every host registers by heartbeat and keeps heartbeating every `cfg.heartbeat`.
    pub fn open(dc: &DcConfig, models: &[SimModel], cfg: ControllerConfig) -> anyhow::Result<Self> {
        let heartbeat = cfg.heartbeat;
        let dc = Datacenter::new(dc.clone(), models)?;
        let cancel = CancellationToken::new();
        let ctl = Controller::open_with(
            cfg,
            Arc::new(MemStore::default()),
            cancel.clone(),
            Arc::new(SimAgents::new(dc.clone())),
        )
        .map_err(|e| anyhow::anyhow!("opening the controller: {}", e.message))?;
        tokio::spawn(dc.clone().drive(cancel.clone()));
        let cluster = Self { ctl, dc, cancel };
        cluster.heartbeat_all()?;
        tokio::spawn(heartbeats(
            cluster.ctl.clone(),
            cluster.dc.clone(),
            heartbeat,
            cluster.cancel.clone(),
        ));
        Ok(cluster)
    }

    /// Every host heartbeats now.
    pub fn heartbeat_all(&self) -> anyhow::Result<()> {
        for view in self.dc.host_views() {
            self.ctl
                .heartbeat(view)
                .map_err(|e| anyhow::anyhow!("heartbeat: {e}"))?;
        }
        Ok(())
    }

    /// Registers `model` (a host builds its manifest) with its layer profile; returns its
    /// digest.
    pub async fn register(&self, model: &SimModel, dc: &DcConfig) -> anyhow::Result<String> {
        let name = model.name;
        let profile = serde_json::to_string(&model.profile(&dc.phases))?;
        let registered = self
            .ctl
            .register_model(Register {
                name: name.to_string(),
                origin: format!("{ORIGIN_PREFIX}{name}"),
                profile_json: profile,
                chunk_size: dc.chunk_size,
                ..Register::default()
            })
            .await
            .map_err(|e| anyhow::anyhow!("registering {name}: {e}"))?;
        let Registered::Done(entry) = registered else {
            anyhow::bail!("the registration of {name} did not finish");
        };
        let digest = entry.record.digest;
        anyhow::ensure!(
            self.dc.digest_of(name).as_deref() == Some(digest.as_str()),
            "the registry's digest of {name} is not the simulated hosts' one"
        );
        Ok(digest)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn burst(
    spec: &ColdStart,
    method: Method,
    faults: &[FaultSpec],
    seed: u64,
) -> anyhow::Result<(ColdStartRow, FaultLog)> {
    let cluster = Cluster::open(
        &spec.dc,
        std::slice::from_ref(&spec.model),
        controller_config(spec)?,
    )?;
    let row = drive_burst(spec, method, &cluster, faults, seed).await?;
    Ok((row, cluster.dc.fault_log()))
}

async fn drive_burst(
    spec: &ColdStart,
    method: Method,
    cluster: &Cluster,
    faults: &[FaultSpec],
    seed: u64,
) -> anyhow::Result<ColdStartRow> {
    let (ctl, dc) = (&cluster.ctl, &cluster.dc);
    let name = spec.model.name;
    let digest = cluster.register(&spec.model, &spec.dc).await?;
    let hosts = spec.dc.topology.hosts;
    for k in 0..spec.warm.min(hosts) {
        dc.seed(k * hosts / spec.warm, name)?;
    }
    if spec.warm > 0 {
        // The holders report their copies before the burst is planned.
        cluster.heartbeat_all()?;
    }
    let t0 = dc.now();
    dc.schedule_faults(t0, faults, seed);
    let origin_before = dc.origin_bytes();
    let tiers_before = dc.tier_bytes();
    let start = tokio::time::Instant::now();
    let mut tiers = Thinned::new(TIER_SAMPLE);
    let sample = || TierSample {
        t: dc.now() - t0,
        bytes: dc.tier_bytes().since(tiers_before),
    };
    let accepted = ctl
        .prewarm(Prewarm {
            model: name.to_string(),
            target: Target::Replicas(spec.replicas),
            tier: spec.tier,
            sources: match method {
                Method::Baseline => Sources::Origin,
                Method::Chain => Sources::Auto,
            },
            transport: None,
        })
        .map_err(|e| anyhow::anyhow!("prewarm of {name}: {e}"))?;
    let id = accepted.plan_id;
    let (plan, rx) = ctl.watch_plan(&id)?;
    let deadline = tokio::time::Instant::now() + spec.limit;
    let plan = match rx {
        None => plan,
        Some(mut rx) => loop {
            tokio::select! {
                biased;
                ended = rx.wait_for(|p| !p.running()) => break match ended {
                    Ok(p) => p.clone(),
                    // The watch is dropped once the plan has ended: its final state is
                    // stored.
                    Err(_) => ctl.get_plan(&id)?,
                },
                () = tokio::time::sleep_until(deadline) => anyhow::bail!(
                    "the plan did not end within {:?} of virtual time",
                    spec.limit
                ),
                () = tokio::time::sleep_until(start + Duration::from_secs_f64(tiers.due())) => {
                    tiers.push(sample());
                }
            }
        },
    };
    let end = dc.now();
    let mut tiers = tiers.samples;
    if tiers.last().is_none_or(|s| s.t < end - t0) {
        tiers.push(sample());
    }
    let hosts: Vec<HostColdStart> = dc
        .ready(&digest)
        .into_iter()
        .map(|r: HostReady| HostColdStart {
            host: r.host,
            source: r.source,
            copy_s: r.copy_s.map(|t| t - t0),
            ready_s: match spec.tier {
                Tier::Memory => r.copy_s,
                _ => r.gpu_s,
            }
            .map(|t| t - t0),
        })
        .collect();
    let mut ready: Vec<f64> = hosts.iter().filter_map(|h| h.ready_s).collect();
    ready.sort_by(f64::total_cmp);
    let copies: Vec<f64> = hosts.iter().filter_map(|h| h.copy_s).collect();
    Ok(ColdStartRow {
        method,
        label: method.label(),
        model: name.to_string(),
        replicas: spec.replicas,
        ready: ready.len(),
        plan_state: plan.state.to_string(),
        chains: plan.runs.len(),
        avg_cold_start_s: mean(&ready),
        p50_cold_start_s: percentile(&ready, 0.5),
        p99_cold_start_s: percentile(&ready, 0.99),
        max_cold_start_s: ready.last().copied().unwrap_or(0.0),
        avg_copy_s: mean(&copies),
        bytes_from_origin: dc.origin_bytes() - origin_before,
        virtual_s: end - t0,
        wall_s: 0.0,
        hosts,
        tiers,
    })
}

/// Every host heartbeats every `period`, as transferd does.
async fn heartbeats(
    ctl: Arc<Controller>,
    dc: Arc<Datacenter>,
    period: Duration,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(period);
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        for view in dc.host_views() {
            if let Err(e) = ctl.heartbeat(view) {
                tracing::warn!("simulated heartbeat refused: {e}");
            }
        }
    }
}

/// The parameters a report was made with.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Params {
    /// Hosts.
    pub hosts: usize,
    /// Hosts per leaf switch.
    pub hosts_per_leaf: usize,
    /// GPUs per host.
    pub gpus_per_host: u32,
    /// Host links, Gbit/s.
    pub host_gbps: f64,
    /// Leaf uplinks, Gbit/s.
    pub leaf_gbps: f64,
    /// The cluster's link to the origin, Gbit/s (`None`: unlimited).
    pub origin_link_gbps: Option<f64>,
    /// One origin stream, Gbit/s (`None`: unlimited).
    pub origin_stream_gbps: Option<f64>,
    /// One host-to-host hop, Gbit/s (`None`: links only).
    pub hop_gbps: Option<f64>,
    /// Manifest chunk size, bytes.
    pub chunk_size: u32,
    /// The model.
    pub model: String,
    /// Its size, bytes.
    pub model_bytes: u64,
    /// Load into host memory, bytes/s.
    pub load_bps: f64,
    /// Host to GPU, bytes/s.
    pub gpu_bps: f64,
    /// Replicas in the burst.
    pub replicas: u32,
    /// Hosts holding the model in memory before the burst.
    pub warm: usize,
    /// Heartbeat period, seconds.
    pub heartbeat_s: f64,
    /// Plan runner poll tick, seconds.
    pub poll_s: f64,
}

/// `simulate`'s report: the parameters and one row per method.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// What made the rows.
    pub params: Params,
    /// One per method, in the order run.
    pub rows: Vec<ColdStartRow>,
    /// Wall-clock seconds for all of them.
    pub wall_s: f64,
}

impl Report {
    /// The report of `rows` run with `spec`.
    pub fn new(spec: &ColdStart, rows: Vec<ColdStartRow>, wall_s: f64) -> Self {
        let t = &spec.dc.topology;
        let g = |bps: f64| bps * 8.0 / 1e9;
        Self {
            params: Params {
                hosts: t.hosts,
                hosts_per_leaf: t.hosts_per_leaf,
                gpus_per_host: spec.dc.gpus_per_host,
                host_gbps: g(t.host_link_bps),
                leaf_gbps: g(t.leaf_uplink_bps),
                origin_link_gbps: t.origin_link_bps.map(g),
                origin_stream_gbps: t.origin_stream_bps.map(g),
                hop_gbps: spec.dc.hop_cap_bps.map(g),
                chunk_size: spec.dc.chunk_size,
                model: spec.model.name.to_string(),
                model_bytes: spec.model.bytes,
                load_bps: spec.dc.phases.load_bps,
                gpu_bps: spec.dc.phases.gpu_bps,
                replicas: spec.replicas,
                warm: spec.warm,
                heartbeat_s: spec.heartbeat.as_secs_f64(),
                poll_s: spec.poll.as_secs_f64(),
            },
            rows,
            wall_s,
        }
    }

    /// The rows as a text table, with each row's change of the average cold start against
    /// the first row.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<40} {:>6} {:>7} {:>10} {:>10} {:>10} {:>9} {:>8}\n",
            "method", "ready", "chains", "avg s", "p99 s", "origin GB", "vs first", "wall s"
        );
        let first = self.rows.first().map(|r| r.avg_cold_start_s);
        for r in &self.rows {
            let change = match first {
                Some(f) if f > 0.0 => format!("{:+.1}%", (r.avg_cold_start_s / f - 1.0) * 100.0),
                _ => "-".into(),
            };
            out.push_str(&format!(
                "{:<40} {:>6} {:>7} {:>10.2} {:>10.2} {:>10.1} {:>9} {:>8.2}\n",
                r.label,
                r.ready,
                r.chains,
                r.avg_cold_start_s,
                r.p99_cold_start_s,
                r.bytes_from_origin / 1e9,
                change,
                r.wall_s
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::models::{self, Phases};
    use crate::sim::net::{Topology, gbit};

    /// `hosts` hosts, 4 per leaf, Flashpoint's links and origin; one replica per host.
    fn spec(hosts: usize, model: &str) -> ColdStart {
        ColdStart {
            dc: DcConfig {
                topology: Topology {
                    hosts,
                    hosts_per_leaf: 4,
                    ..Topology::flashpoint()
                },
                gpus_per_host: 8,
                gpu_memory: 24 << 30,
                host_memory: 200 << 30,
                phases: Phases::flashpoint(),
                chunk_size: 1 << 20,
                hop_cap_bps: None,
                progress_period: Duration::from_secs(1),
                origin_parallel: crate::sim::dc::ORIGIN_PARALLEL,
            },
            model: models::find(model).unwrap().clone(),
            replicas: hosts as u32,
            warm: 0,
            tier: Tier::Gpu,
            heartbeat: Duration::from_secs(1),
            poll: Duration::from_millis(250),
            limit: Duration::from_secs(86_400),
        }
    }

    fn close(a: f64, b: f64, abs: f64) -> bool {
        (a - b).abs() <= abs
    }

    /// The tier series: starts at the prewarm, ends at the plan's end, time ascending,
    /// every tier non-decreasing; returns the last sample's bytes.
    fn tiers_end(row: &ColdStartRow) -> TierBytes {
        let first = row.tiers.first().unwrap();
        let last = row.tiers.last().unwrap();
        assert!(first.t < 1e-9, "{first:?}");
        assert!(close(last.t, row.virtual_s, 1e-9), "{last:?}");
        for w in row.tiers.windows(2) {
            let (a, b) = (w[0].bytes, w[1].bytes);
            assert!(w[0].t < w[1].t, "{w:?}");
            assert!(
                a.origin <= b.origin && a.peer <= b.peer && a.local <= b.local,
                "{w:?}"
            );
        }
        last.bytes
    }

    #[test]
    fn the_baseline_shares_the_origin_link_among_all_hosts() {
        // 8 hosts each download S from the origin: the 2.203 Gbit/s link is shared 8 ways
        // (below the per-stream cap), all end at 8 S / L, then load + copy to the GPU.
        let s = spec(8, "bart-large");
        let row = run(&s, Method::Baseline).unwrap();
        let bytes = s.model.bytes as f64;
        let want = 8.0 * bytes / gbit(2.203) + s.dc.phases.startup_s(s.model.bytes);
        assert_eq!((row.ready, row.plan_state.as_str()), (8, "done"));
        assert_eq!(row.chains, 8);
        for h in &row.hosts {
            assert_eq!(h.source, "origin");
            assert!(close(h.ready_s.unwrap(), want, 1e-3), "{h:?} vs {want}");
        }
        assert!(close(row.bytes_from_origin, 8.0 * bytes, 1.0));
        // Every host's bytes came from the origin; the link is shared evenly, so half way
        // through the downloads half the bytes have arrived.
        let end = tiers_end(&row);
        assert!(close(end.origin, 8.0 * bytes, 1.0), "{end:?}");
        assert_eq!((end.peer, end.local), (0.0, 0.0));
        let half = 4.0 * bytes / gbit(2.203);
        let mid = row.tiers.iter().find(|s| s.t >= half).unwrap();
        let want = gbit(2.203) * mid.t;
        assert!(close(mid.bytes.origin, want, 1.0), "{mid:?} vs {want}");
    }

    #[test]
    fn one_chain_reads_the_origin_once_and_its_hops_finish_a_chunk_apart() {
        // 8 receivers, no copy anywhere: one chain from the origin (placement: one chain
        // when n <= max_chain_len). It moves at the origin's 2.203 Gbit/s; the head holds
        // the model at S / rate, hop j >= 1 at (S + (j + P - 1) * chunk) / rate (P: the
        // head's parallel origin reads, `dc::pipeline_lag`), then loads.
        let s = spec(8, "bart-large");
        let row = run(&s, Method::Chain).unwrap();
        let (bytes, chunk) = (s.model.bytes as f64, f64::from(s.dc.chunk_size));
        let rate = gbit(2.203);
        assert_eq!((row.ready, row.chains), (8, 1));
        let mut copies: Vec<f64> = row.hosts.iter().map(|h| h.copy_s.unwrap()).collect();
        copies.sort_by(f64::total_cmp);
        let fill = f64::from(s.dc.origin_parallel) - 1.0;
        let lag = |j: usize| if j == 0 { 0.0 } else { j as f64 + fill };
        for (j, c) in copies.iter().enumerate() {
            assert!(
                close(*c, (bytes + lag(j) * chunk) / rate, 1e-6),
                "hop {j}: {c}"
            );
        }
        let startup = s.dc.phases.startup_s(s.model.bytes);
        assert!(close(row.max_cold_start_s, copies[7] + startup, 1e-6));
        // The flow's progress, counted as origin bytes, runs on to the last hop's lag.
        assert!(close(row.bytes_from_origin, bytes + lag(7) * chunk, 1.0));
        // The head received from the origin, the 7 hops after it from their peers.
        let end = tiers_end(&row);
        assert!(close(end.origin, bytes, 1.0), "{end:?}");
        assert!(close(end.peer, 7.0 * bytes, 1.0), "{end:?}");
        assert_eq!(end.local, 0.0);
        // Mid-transfer, hop j lags the head by lag(j) chunks: 8 p - 77 chunks in all.
        let mid = row.tiers.iter().find(|s| s.t >= 3.0).unwrap();
        let p = rate * mid.t;
        let got = mid.bytes.origin + mid.bytes.peer;
        let lags: f64 = (0..8).map(lag).sum();
        assert_eq!(lags, 28.0 + 7.0 * fill);
        assert!(close(got, 8.0 * p - lags * chunk, 1.0), "{mid:?}");
        // Against the baseline of the test above: the origin is read once, not 8 times.
        assert!(row.avg_cold_start_s < (8.0 * bytes / rate + startup) / 4.0);
    }

    #[test]
    fn a_warm_holder_fills_its_own_gpus_and_heads_a_chain_to_the_rest() {
        // Host 0 holds the model in memory. 15 replicas: its 8 GPUs first (they only load:
        // ready at the startup time), then one GPU on each of the 7 other hosts, fed by a
        // chain from host 0's memory at the host link's 50 Gbit/s (hop j at
        // (S + j * chunk) / 50 G). Nothing is read from the origin.
        let mut s = spec(8, "dialogpt-large");
        s.warm = 1;
        s.replicas = 15;
        let row = run(&s, Method::Chain).unwrap();
        let (bytes, chunk) = (s.model.bytes as f64, f64::from(s.dc.chunk_size));
        let startup = s.dc.phases.startup_s(s.model.bytes);
        assert_eq!(
            (row.ready, row.chains, row.plan_state.as_str()),
            (8, 1, "done")
        );
        assert_eq!(row.bytes_from_origin, 0.0);
        // Host 0's 8 GPUs loaded from its own memory; the 7 others received from peers.
        let end = tiers_end(&row);
        assert_eq!(end.origin, 0.0);
        assert!(close(end.local, 8.0 * bytes, 1.0), "{end:?}");
        assert!(close(end.peer, 7.0 * bytes, 1.0), "{end:?}");
        let local = row.hosts.iter().find(|h| h.host == "h0000").unwrap();
        assert_eq!(local.source, "local");
        assert!(close(local.ready_s.unwrap(), startup, 1e-6));
        let mut copies: Vec<f64> = row
            .hosts
            .iter()
            .filter(|h| h.source == "h0000")
            .map(|h| h.copy_s.unwrap())
            .collect();
        copies.sort_by(f64::total_cmp);
        assert_eq!(copies.len(), 7);
        for (j, c) in copies.iter().enumerate() {
            assert!(
                close(*c, (bytes + j as f64 * chunk) / gbit(50.0), 1e-6),
                "hop {j}: {c}"
            );
        }
    }

    #[test]
    fn bursts_are_deterministic() {
        let s = spec(12, "codebert-base");
        let a = run(&s, Method::Chain).unwrap();
        let b = run(&s, Method::Chain).unwrap();
        assert_eq!(a.hosts, b.hosts);
        assert_eq!(a.bytes_from_origin, b.bytes_from_origin);
    }

    #[test]
    fn more_receivers_than_a_chain_holds_make_several_chains() {
        // 40 receivers, at most 16 hops a chain: ceil(40 / 16) = 3 chains, each reading the
        // origin, sharing its link three ways.
        let s = spec(40, "codebert-base");
        let row = run(&s, Method::Chain).unwrap();
        assert_eq!((row.ready, row.chains), (40, 3));
        let bytes = s.model.bytes as f64;
        let first = row
            .hosts
            .iter()
            .filter_map(|h| h.copy_s)
            .fold(f64::INFINITY, f64::min);
        assert!(close(first, 3.0 * bytes / gbit(2.203), 1e-3), "{first}");
        assert!(row.bytes_from_origin > 3.0 * bytes && row.bytes_from_origin < 3.0 * bytes + 1e8);
    }

    #[test]
    fn a_burst_report_draws_its_cdfs_and_tier_plots() {
        use crate::sim::plots;
        let s = spec(8, "codebert-base");
        let rows = vec![
            run(&s, Method::Baseline).unwrap(),
            run(&s, Method::Chain).unwrap(),
        ];
        let report = Report::new(&s, rows, 0.0);
        let figs = plots::burst_figures(&report);
        assert_eq!(
            figs.iter().map(|f| f.file.as_str()).collect::<Vec<_>>(),
            [
                "ready-cdf.svg",
                "copy-cdf.svg",
                "bytes-by-tier-baseline.svg",
                "bytes-by-tier-chain.svg"
            ]
        );
        // The CDFs plot each method's hosts' ready (GPU) and copy times.
        for (row, series) in report.rows.iter().zip(&figs[0].panels[0].series) {
            assert_eq!(series.label, row.label);
            let ready: Vec<f64> = row.hosts.iter().filter_map(|h| h.ready_s).collect();
            assert_eq!(series.points, plots::cdf(&ready, 8));
            assert_eq!(series.points.last().unwrap(), &(row.max_cold_start_s, 1.0));
        }
        let copy = &figs[1].panels[0].series[1];
        let copies: Vec<f64> = report.rows[1]
            .hosts
            .iter()
            .filter_map(|h| h.copy_s)
            .collect();
        assert_eq!(copy.points, plots::cdf(&copies, 8));
        // The chain's tier plot ends at 1 model from the origin and 7 from peers.
        let gb = s.model.bytes as f64 / 1e9;
        let tiers = &figs[3].panels[0].series;
        let last = |i: usize| tiers[i].points.last().unwrap().1;
        assert!(close(last(0), gb, 1e-6) && close(last(1), 7.0 * gb, 1e-6));
        let dir = tempfile::tempdir().unwrap();
        let written = plots::write(&dir.path().join("plots"), &figs).unwrap();
        assert_eq!(written.len(), 4);
        for (path, f) in written.iter().zip(&figs) {
            let svg = std::fs::read_to_string(path).unwrap();
            let lines: usize = f.panels.iter().map(|p| p.series.len()).sum();
            assert!(
                plots::well_formed(&svg).polylines >= 2 * lines,
                "{}",
                path.display()
            );
        }
    }

    #[test]
    fn a_long_burst_keeps_at_most_max_samples_evenly_spaced() {
        // Sampled when due over 10,000 s at a 1 s base: 512 at 1 s, then 256 more at 2 s,
        // 4 s, 8 s and 16 s apart; the series covers the time at 32 s.
        let mut t = Thinned::new(Duration::from_secs(1));
        let mut wakes = 0;
        while t.due() < 10_000.0 {
            let at = t.due();
            t.push(TierSample {
                t: at,
                bytes: TierBytes::default(),
            });
            wakes += 1;
        }
        assert_eq!(wakes, 512 + 4 * 256 + (10_000 - 8_192) / 32 + 1);
        let n = t.samples.len();
        assert!((MAX_TIER_SAMPLES / 2..MAX_TIER_SAMPLES).contains(&n), "{n}");
        let step = t.samples[1].t - t.samples[0].t;
        assert_eq!((t.samples[0].t, step, t.every), (0.0, 32.0, 32));
        assert!(t.samples.windows(2).all(|w| w[1].t - w[0].t == step));
        assert_eq!(t.samples.last().unwrap().t, 9_984.0);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&xs, 0.99), 99.0);
        assert_eq!(percentile(&xs, 0.5), 50.0);
        assert_eq!(percentile(&xs, 1.0), 100.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }
}
