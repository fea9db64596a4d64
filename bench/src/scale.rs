//! `shardcast-bench scale`: a real `shardcast-controller` process under a [`Swarm`] of
//! simulated hosts (1000 by default). Measures what the controller does at that size:
//! heartbeat round trips and throughput, the status APIs' latency (`GetStatus`,
//! `ListHosts`, `ListPlans`) with every host heartbeating, then a prewarm of 64 replicas
//! (request → `PlanAccepted`, and until every receiver is done) with the status APIs
//! still being queried, and the controller's CPU and memory.
//!
//! The swarm moves no bytes (see [`crate::swarm`]): these are control-plane numbers only.

use std::path::Path;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;
use shardcast_protocol::controller::controller_client::ControllerClient;
use shardcast_protocol::controller::{
    GetStatusRequest, ListHostsRequest, ListPlansRequest, PrewarmRequest, RegisterModelRequest,
    WatchPlanRequest,
};
use tonic::transport::Channel;

use crate::control::ControllerProc;
use crate::swarm::{SimModel, Swarm, SwarmOpts, quantile};

/// The origin prefix of the swarm's models (nothing listens there; the simulated hosts
/// answer `ImportModel` from their catalog).
pub const SIM_ORIGIN_PREFIX: &str = "http://127.0.0.1:9/swarm/";

/// What to run.
#[derive(Debug, Clone)]
pub struct ScaleOpts {
    /// Simulated hosts.
    pub hosts: usize,
    /// Racks.
    pub racks: usize,
    /// Replicas of the prewarm.
    pub replicas: u32,
    /// Heartbeat period (the controller's `--heartbeat-ms`, which the hosts follow).
    pub heartbeat_ms: u64,
    /// Model size and shards.
    pub size: u64,
    /// Shards of the model.
    pub shards: usize,
    /// Simulated link and origin rates, bytes per second.
    pub link_bps: u64,
    /// Simulated origin rate per connection, bytes per second.
    pub origin_bps: u64,
    /// Steady-state window (heartbeats and status queries, no plan).
    pub window: Duration,
    /// Longest wait for the hosts to come up, and for the prewarm.
    pub timeout: Duration,
    /// Plaintext instead of mutual TLS (the controller's `--insecure-plaintext`).
    pub insecure: bool,
    /// Extra controller flags (e.g. another state backend), passed through unchanged.
    pub controller_args: Vec<String>,
}

impl Default for ScaleOpts {
    fn default() -> Self {
        Self {
            hosts: 1000,
            racks: 25,
            replicas: 64,
            heartbeat_ms: 1000,
            size: 4 << 30,
            shards: 4,
            link_bps: 10_000_000_000 / 8,
            origin_bps: 2_500_000_000 / 8,
            window: Duration::from_secs(20),
            timeout: Duration::from_secs(120),
            insecure: false,
            controller_args: Vec::new(),
        }
    }
}

/// Latency percentiles of one API call, milliseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Latency {
    /// Calls answered.
    pub calls: usize,
    /// Calls that failed.
    pub errors: usize,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Slowest.
    pub max_ms: f64,
}

impl Latency {
    fn of(mut us: Vec<u32>, errors: usize) -> Self {
        Self {
            calls: us.len(),
            errors,
            p50_ms: quantile(&mut us, 0.5) / 1000.0,
            p99_ms: quantile(&mut us, 0.99) / 1000.0,
            max_ms: quantile(&mut us, 1.0) / 1000.0,
        }
    }
}

/// One phase's numbers.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Phase {
    /// Wall seconds.
    pub seconds: f64,
    /// Heartbeat round trips (as the hosts saw them).
    pub heartbeat: Latency,
    /// Heartbeats answered per second.
    pub heartbeats_per_s: f64,
    /// `GetStatus` of the model.
    pub get_status: Latency,
    /// `ListHosts` (every host's last report).
    pub list_hosts: Latency,
    /// `ListPlans`.
    pub list_plans: Latency,
    /// The controller's CPU use over the phase, in cores (1.0 = one core busy).
    pub controller_cpu_cores: f64,
}

/// The report of one run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScaleReport {
    /// Hosts in the swarm.
    pub hosts: usize,
    /// Whether the hosts used mutual TLS with a certificate each.
    pub mutual_tls: bool,
    /// Heartbeat period, ms.
    pub heartbeat_ms: u64,
    /// Seconds spent issuing the hosts' certificates.
    pub cert_issue_s: f64,
    /// Seconds from the swarm's start until `ListHosts` showed every host up.
    pub all_up_s: f64,
    /// Hosts `ListHosts` showed up.
    pub hosts_up: usize,
    /// Heartbeats, status queries and CPU without a plan.
    pub steady: Phase,
    /// The same while the prewarm ran.
    pub during_prewarm: Phase,
    /// `RegisterModel` (through one simulated host's `ImportModel`), ms.
    pub register_ms: f64,
    /// Model bytes.
    pub model_bytes: u64,
    /// Replicas asked for.
    pub replicas: u32,
    /// `Prewarm` request → `PlanAccepted`, ms (placement, chain plan, persisting it).
    pub plan_ms: f64,
    /// Chains in the plan.
    pub chains: usize,
    /// The controller's estimate, seconds.
    pub estimate_s: f64,
    /// `Prewarm` request → the plan reported done, seconds.
    pub prewarm_s: f64,
    /// The plan's final state and its receivers that ended `done`.
    pub plan_state: String,
    /// Receivers `done` in the plan.
    pub plan_done: usize,
    /// Hosts `GetStatus` reports holding a complete memory copy, up.
    pub status_holders: usize,
    /// Hosts whose simulated store holds the model complete.
    pub swarm_holders: usize,
    /// Heartbeats that failed over the whole run.
    pub heartbeat_failures: u64,
    /// Controller CPU seconds over the whole run.
    pub controller_cpu_s: f64,
    /// Controller resident memory at the end and its peak, MiB.
    pub controller_rss_mib: f64,
    /// Peak resident memory, MiB.
    pub controller_peak_rss_mib: f64,
}

/// Which API the prober calls, in turn.
const CALLS: [&str; 3] = ["get_status", "list_hosts", "list_plans"];

/// Samples recorded by the prober: per phase (0 steady, 1 prewarm, other: not recorded),
/// per call kind, microseconds and errors.
#[derive(Default)]
struct ProbeLog {
    us: Mutex<[[Vec<u32>; 3]; 2]>,
    errors: Mutex<[[usize; 3]; 2]>,
}

/// Queries the status APIs one after the other, with `pause` between calls, until
/// cancelled; records latencies under the current phase.
async fn probe(
    mut client: ControllerClient<Channel>,
    model: String,
    phase: Arc<AtomicU8>,
    log: Arc<ProbeLog>,
    pause: Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut i = 0usize;
    loop {
        let kind = i % CALLS.len();
        i += 1;
        let t0 = Instant::now();
        let ok = match kind {
            0 => client
                .get_status(GetStatusRequest {
                    model: model.clone(),
                })
                .await
                .is_ok(),
            1 => client.list_hosts(ListHostsRequest {}).await.is_ok(),
            _ => client.list_plans(ListPlansRequest {}).await.is_ok(),
        };
        let us = t0.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
        let p = phase.load(Ordering::Relaxed) as usize;
        if p < 2 {
            if ok {
                if let Ok(mut l) = log.us.lock() {
                    l[p][kind].push(us);
                }
            } else if let Ok(mut e) = log.errors.lock() {
                e[p][kind] += 1;
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// Resident and peak memory of `pid`, MiB, from /proc/<pid>/status.
pub fn process_rss_mib(pid: u32) -> Option<(f64, f64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |k: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.starts_with(k))?;
        let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb / 1024.0)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Hosts `ListHosts` shows up.
pub async fn hosts_up(client: &mut ControllerClient<Channel>) -> anyhow::Result<usize> {
    Ok(client
        .list_hosts(ListHostsRequest {})
        .await?
        .into_inner()
        .hosts
        .iter()
        .filter(|h| h.up)
        .count())
}

/// Starts a controller with the flags the swarm needs (its origin prefix allowed, the
/// heartbeat period) plus `extra`.
pub async fn start_controller(
    root: &Path,
    heartbeat_ms: u64,
    origin_bps: u64,
    insecure: bool,
    extra: &[String],
) -> anyhow::Result<ControllerProc> {
    // The controller's estimates use the origin rate the swarm simulates.
    let mut args = vec![
        "--origin-allow".to_string(),
        SIM_ORIGIN_PREFIX.to_string(),
        "--origin-rate".to_string(),
        origin_bps.to_string(),
    ];
    args.extend(extra.iter().cloned());
    let mut c = ControllerProc::start_with_heartbeat(root, args, heartbeat_ms).await?;
    if insecure {
        // Restart without TLS: the controller's documented plaintext mode (loopback only).
        c.kill().await;
        c.pki = None;
        c.restart().await?;
    }
    Ok(c)
}

/// Runs the benchmark.
pub async fn run_scale(opts: &ScaleOpts) -> anyhow::Result<ScaleReport> {
    let dir = tempfile::Builder::new()
        .prefix("shardcast-scale-")
        .tempdir()
        .context("creating a scratch directory")?;
    let controller = start_controller(
        dir.path(),
        opts.heartbeat_ms,
        opts.origin_bps,
        opts.insecure,
        &opts.controller_args,
    )
    .await?;
    let pid = controller.pid().context("the controller is not running")?;
    let cpu = || crate::scenario::process_cpu_s(pid).unwrap_or(0.0);
    let cpu_start = cpu();
    let name = "sim/scale-model";
    let origin = format!("{SIM_ORIGIN_PREFIX}scale-model/");
    let model = tokio::task::spawn_blocking({
        let (size, shards, origin) = (opts.size, opts.shards, origin.clone());
        move || SimModel::zeros(name, &origin, size, shards, 1 << 20)
    })
    .await??;
    let swarm = Swarm::start(SwarmOpts {
        hosts: opts.hosts,
        racks: opts.racks,
        heartbeat: Duration::from_millis(opts.heartbeat_ms),
        link_bps: opts.link_bps,
        origin_bps: opts.origin_bps,
        mem_capacity: 512 << 30,
        disk_capacity: 4 << 40,
        controller: controller.grpc.to_string(),
        pki: controller.pki.clone(),
        catalog: vec![model.clone()],
    })
    .await?;
    let started = Instant::now();
    let mut client = match &controller.pki {
        Some(_) => controller.client().await?,
        None => controller.client_as(None).await?,
    };
    let mut report = ScaleReport {
        hosts: opts.hosts,
        mutual_tls: controller.pki.is_some(),
        heartbeat_ms: opts.heartbeat_ms,
        cert_issue_s: swarm.cert_s,
        model_bytes: opts.size,
        replicas: opts.replicas,
        ..Default::default()
    };
    let deadline = started + opts.timeout;
    loop {
        let up = hosts_up(&mut client).await.unwrap_or(0);
        if up >= opts.hosts {
            report.all_up_s = started.elapsed().as_secs_f64();
            report.hosts_up = up;
            break;
        }
        if Instant::now() >= deadline {
            bail!(
                "only {up} of {} simulated hosts came up within {:?} (last heartbeat error: {})",
                opts.hosts,
                opts.timeout,
                swarm.heartbeats.last_error()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Register first, so GetStatus has a model to report during the steady window.
    eprintln!("scale: all up at {:.3} s", started.elapsed().as_secs_f64());
    let t0 = Instant::now();
    client
        .register_model(RegisterModelRequest {
            name: name.into(),
            origin: origin.clone(),
            ..Default::default()
        })
        .await
        .context("registering the simulated model")?;
    report.register_ms = t0.elapsed().as_secs_f64() * 1000.0;

    // Steady state: heartbeats and status queries, no plan.
    let phase = Arc::new(AtomicU8::new(0));
    let log = Arc::new(ProbeLog::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let prober = tokio::spawn(probe(
        client.clone(),
        name.to_string(),
        phase.clone(),
        log.clone(),
        Duration::from_millis(20),
        stop.clone(),
    ));
    swarm.heartbeats.reset();
    let (w0, c0) = (Instant::now(), cpu());
    tokio::time::sleep(opts.window).await;
    phase.store(2, Ordering::Relaxed);
    report.steady = phase_of(&swarm, &log, 0, w0.elapsed(), cpu() - c0);

    // The prewarm, with the status queries going on.
    swarm.heartbeats.reset();
    phase.store(1, Ordering::Relaxed);
    let (w1, c1) = (Instant::now(), cpu());
    let accepted = client
        .prewarm(PrewarmRequest {
            model: name.into(),
            replicas: opts.replicas,
            tier: "memory".into(),
            ..Default::default()
        })
        .await
        .context("prewarm")?
        .into_inner();
    report.plan_ms = w1.elapsed().as_secs_f64() * 1000.0;
    eprintln!(
        "scale: plan accepted at {:.3} s",
        started.elapsed().as_secs_f64()
    );
    report.chains = accepted.chains.len();
    report.estimate_s = accepted.estimate_s;
    let status = loop {
        let s = client
            .get_plan(WatchPlanRequest {
                plan_id: accepted.plan_id.clone(),
            })
            .await?
            .into_inner();
        if s.state != "running" {
            break s;
        }
        if Instant::now() >= w1 + opts.timeout {
            bail!("the prewarm was still running after {:?}", opts.timeout);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    report.prewarm_s = w1.elapsed().as_secs_f64();
    phase.store(2, Ordering::Relaxed);
    report.during_prewarm = phase_of(&swarm, &log, 1, w1.elapsed(), cpu() - c1);
    stop.cancel();
    let _ = prober.await;
    report.plan_state = status.state.clone();
    report.plan_done = status.hosts.iter().filter(|h| h.state == "done").count();
    let digest = status.digest.clone();
    // Give every receiver one heartbeat to report its copy.
    tokio::time::sleep(Duration::from_millis(opts.heartbeat_ms * 2)).await;
    let holders = client
        .get_status(GetStatusRequest { model: name.into() })
        .await?
        .into_inner();
    report.status_holders = holders.hosts.iter().filter(|h| h.up && h.memory).count();
    report.swarm_holders = swarm.holders(&digest).len();
    report.controller_cpu_s = cpu() - cpu_start;
    if let Some((rss, peak)) = process_rss_mib(pid) {
        report.controller_rss_mib = rss;
        report.controller_peak_rss_mib = peak;
    }
    report.heartbeat_failures = swarm.heartbeats.take().1;
    swarm.stop().await;
    drop(controller);
    Ok(report)
}

fn phase_of(swarm: &Swarm, log: &ProbeLog, p: usize, wall: Duration, cpu_s: f64) -> Phase {
    let (ok, failed, hb) = swarm.heartbeats.take();
    let (us, errors) = match (log.us.lock(), log.errors.lock()) {
        (Ok(u), Ok(e)) => (u[p].clone(), e[p]),
        _ => Default::default(),
    };
    let [s, h, l] = us;
    let secs = wall.as_secs_f64().max(1e-9);
    Phase {
        seconds: secs,
        heartbeat: Latency::of(hb, failed as usize),
        heartbeats_per_s: ok as f64 / secs,
        get_status: Latency::of(s, errors[0]),
        list_hosts: Latency::of(h, errors[1]),
        list_plans: Latency::of(l, errors[2]),
        controller_cpu_cores: cpu_s / secs,
    }
}

/// A human-readable summary of a report.
pub fn summary(r: &ScaleReport) -> String {
    let lat = |l: &Latency| {
        format!(
            "p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms  ({} calls, {} errors)",
            l.p50_ms, l.p99_ms, l.max_ms, l.calls, l.errors
        )
    };
    let phase = |title: &str, p: &Phase| {
        format!(
            "{title} ({:.1} s)\n  heartbeat    {}\n  heartbeats/s {:.0}\n  GetStatus    {}\n  ListHosts    {}\n  ListPlans    {}\n  controller CPU {:.2} cores\n",
            p.seconds,
            lat(&p.heartbeat),
            p.heartbeats_per_s,
            lat(&p.get_status),
            lat(&p.list_hosts),
            lat(&p.list_plans),
            p.controller_cpu_cores
        )
    };
    format!(
        "{} simulated hosts ({}), heartbeat every {} ms; certificates issued in {:.2} s; all up after {:.2} s\n{}{}register {:.1} ms\nprewarm {} replicas of {} MiB: plan {:.1} ms ({} chains, estimate {:.2} s), done after {:.2} s: plan {} with {} done; GetStatus shows {} holders, the swarm {}\ncontroller: {:.1} CPU s in all, RSS {:.0} MiB (peak {:.0} MiB); failed heartbeats {}\n",
        r.hosts,
        if r.mutual_tls {
            "mutual TLS, one certificate each"
        } else {
            "INSECURE plaintext"
        },
        r.heartbeat_ms,
        r.cert_issue_s,
        r.all_up_s,
        phase("steady state", &r.steady),
        phase("during the prewarm", &r.during_prewarm),
        r.register_ms,
        r.replicas,
        r.model_bytes >> 20,
        r.plan_ms,
        r.chains,
        r.estimate_s,
        r.prewarm_s,
        r.plan_state,
        r.plan_done,
        r.status_holders,
        r.swarm_holders,
        r.controller_cpu_s,
        r.controller_rss_mib,
        r.controller_peak_rss_mib,
        r.heartbeat_failures
    )
}
