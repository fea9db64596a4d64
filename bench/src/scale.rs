//! `shardcast-bench scale`: a real `shardcast-controller` process under a [`Swarm`] of
//! simulated hosts (1000 by default). Measures what the controller does at that size:
//! heartbeat round trips and throughput, the status APIs' latency (`GetStatus`,
//! `ListHosts`, `ListPlans`) with every host heartbeating, then a prewarm of 64 replicas
//! (request → `PlanAccepted`, and until every receiver is done) with the status APIs
//! still being queried, and the controller's CPU and memory.
//!
//! With `--store etcd` it starts an etcd member on loopback ([`crate::ha::EtcdProc`]) and
//! `--controllers` replicas on it (the first leads); the hosts heartbeat to every replica
//! and follow the leader, the status APIs are queried on the leader and on a follower,
//! and the followers' CPU and view counters are reported. `--kill-leader` then runs a
//! second prewarm, SIGKILLs the leader during it, and reports how long hosts could not
//! heartbeat and whether the new leader finished the plan.
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
    GetModelRequest, GetStatusRequest, ListHostsRequest, ListPlansRequest, PrewarmRequest,
    RegisterModelRequest, WatchPlanRequest,
};
use tonic::transport::Channel;

use shardcast_identity::failover::FailoverChannel;
use shardcast_identity::grpc::ClientSecurity;
use shardcast_identity::{Expect, Role};

use crate::control::{ApiChannel, ControllerProc};
use crate::ha::EtcdProc;
use crate::swarm::{SimModel, Swarm, SwarmOpts, quantile};

/// The origin prefix of the swarm's models (nothing listens there; the simulated hosts
/// answer `ImportModel` from their catalog).
pub const SIM_ORIGIN_PREFIX: &str = "http://127.0.0.1:9/swarm/";

/// Where the controllers keep their state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// One controller on its embedded redb file.
    Embedded,
    /// Replicas on an etcd member this benchmark starts on loopback.
    Etcd,
}

impl std::str::FromStr for StoreKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "embedded" | "redb" => Ok(Self::Embedded),
            "etcd" => Ok(Self::Etcd),
            _ => Err(format!("store {s:?}: embedded or etcd")),
        }
    }
}

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
    /// The embedded store (one controller) or etcd.
    pub store: StoreKind,
    /// Controller replicas on etcd (1 with the embedded store).
    pub controllers: usize,
    /// Kill the leader during a second prewarm (etcd, at least 2 replicas).
    pub kill_leader: bool,
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
            store: StoreKind::Embedded,
            controllers: 1,
            kill_leader: false,
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
    /// The controller's (the leader's) CPU use over the phase, in cores (1.0 = one core
    /// busy).
    pub controller_cpu_cores: f64,
    /// The same calls on a follower replica (etcd with several replicas).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub follower: Option<FollowerReads>,
    /// The followers' CPU use over the phase, in cores, each.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub follower_cpu_cores: Vec<f64>,
}

/// Status calls answered by a follower replica.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FollowerReads {
    /// `GetStatus` of the model.
    pub get_status: Latency,
    /// `ListHosts`.
    pub list_hosts: Latency,
    /// `ListPlans`.
    pub list_plans: Latency,
}

/// One follower replica over the whole run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FollowerReport {
    /// Replica id.
    pub id: String,
    /// CPU seconds over the whole run.
    pub cpu_s: f64,
    /// Whole-state loads of its view (`GET /v1/replica`; absent from controllers that do
    /// not report it).
    pub full_loads: Option<u64>,
    /// Changes applied to its view from the watch.
    pub applied: Option<u64>,
    /// Watches resumed after a break.
    pub resumed: Option<u64>,
    /// Resident memory at the end, MiB.
    pub rss_mib: f64,
}

/// The leader killed during a second prewarm.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KillReport {
    /// The replica killed.
    pub killed: String,
    /// The replica that took over.
    pub new_leader: String,
    /// Seconds from the plan's acceptance to the kill.
    pub killed_after_s: f64,
    /// SIGKILL → a replica says it leads, seconds.
    pub elected_s: f64,
    /// Heartbeats that failed (after the fail-over channel's patience) from the kill on.
    pub heartbeat_failures: u64,
    /// Hosts whose answered heartbeats were more than two periods apart around the kill.
    pub hosts_with_gap: usize,
    /// The median and longest such gap, seconds.
    pub gap_p50_s: f64,
    /// Longest gap, seconds.
    pub gap_max_s: f64,
    /// SIGKILL → the end of the last gap (the last host's first heartbeat answered after
    /// the kill), seconds.
    pub last_gap_end_s: f64,
    /// Hosts the new leader lists after the plan.
    pub hosts_listed: usize,
    /// Hosts up at the new leader.
    pub hosts_up: usize,
    /// The plan's final state and its receivers done.
    pub plan_state: String,
    /// Receivers done.
    pub plan_done: usize,
    /// Prewarm request → the plan reported done (across the kill), seconds.
    pub prewarm_s: f64,
}

/// The report of one run.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    /// Where the state lived.
    pub store: StoreKind,
    /// Controller replicas.
    pub controllers: usize,
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
    /// The follower replicas (etcd).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub followers: Vec<FollowerReport>,
    /// The registration answered by the leader → the model read on a follower, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub follower_sees_register_ms: Option<f64>,
    /// The prewarm accepted by the leader → the plan read on a follower, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub follower_sees_plan_ms: Option<f64>,
    /// The leader killed during a second prewarm (`--kill-leader`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kill: Option<KillReport>,
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
async fn probe<T: ApiChannel>(
    mut client: ControllerClient<T>,
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

/// Resident and peak memory of `pid`, MiB, from `/proc/<pid>/status`.
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
pub async fn hosts_up<T: ApiChannel>(client: &mut ControllerClient<T>) -> anyhow::Result<usize> {
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

/// The controllers under test: one on its embedded store, or replicas on an etcd member
/// started here (killed, by PID, when dropped).
pub struct ScaleControllers {
    /// The etcd member (etcd only).
    pub etcd: Option<EtcdProc>,
    /// The replicas (`ctl-1`, …); one with the embedded store.
    pub replicas: Vec<ControllerProc>,
}

impl ScaleControllers {
    /// Starts them under `root`: with etcd, the first replica alone until it leads, then
    /// the others. `extra` goes to every replica.
    pub async fn start(
        root: &Path,
        store: StoreKind,
        controllers: usize,
        heartbeat_ms: u64,
        origin_bps: u64,
        insecure: bool,
        extra: &[String],
    ) -> anyhow::Result<Self> {
        if store == StoreKind::Embedded {
            anyhow::ensure!(
                controllers == 1,
                "the embedded store runs one controller; use --store etcd for replicas"
            );
            let c = start_controller(root, heartbeat_ms, origin_bps, insecure, extra).await?;
            return Ok(Self {
                etcd: None,
                replicas: vec![c],
            });
        }
        anyhow::ensure!((1..=9).contains(&controllers), "1 to 9 controller replicas");
        let etcd = EtcdProc::start(&root.join("etcd")).await?;
        let mut replicas = Vec::with_capacity(controllers);
        for i in 0..controllers {
            let id = format!("ctl-{}", i + 1);
            let mut args = crate::ha::replica_args(&etcd.url(), &id);
            args.extend(extra.iter().cloned());
            let c = start_controller(&root.join(&id), heartbeat_ms, origin_bps, insecure, &args)
                .await?;
            if i == 0 {
                crate::ha::wait_role(&c, "leader", Duration::from_secs(20)).await?;
            }
            replicas.push(c);
        }
        Ok(Self {
            etcd: Some(etcd),
            replicas,
        })
    }

    /// Every replica's gRPC address.
    pub fn grpc_addrs(&self) -> Vec<String> {
        self.replicas.iter().map(|c| c.grpc.to_string()).collect()
    }

    /// The replica that says it leads (the only one with the embedded store).
    pub async fn leader(&self) -> Option<usize> {
        if self.etcd.is_none() {
            return Some(0);
        }
        crate::ha::leader_of(&self.replicas).await
    }

    /// Waits (bounded) until a replica leads.
    pub async fn wait_leader(&self, timeout: Duration) -> anyhow::Result<usize> {
        if self.etcd.is_none() {
            return Ok(0);
        }
        crate::ha::wait_leader_of(&self.replicas, timeout).await
    }

    /// A client of one replica (admin certificate, or plaintext without TLS).
    pub async fn client(&self, i: usize) -> anyhow::Result<ControllerClient<Channel>> {
        let c = &self.replicas[i];
        match &c.pki {
            Some(_) => c.client().await,
            None => c.client_as(None).await,
        }
    }

    /// A client over every replica that follows the leader (admin certificate).
    pub fn failover_client(&self) -> anyhow::Result<ControllerClient<FailoverChannel>> {
        let security = match &self.replicas[0].pki {
            Some(pki) => {
                ClientSecurity::Tls(pki.client(Role::Admin)?, Expect::Role(Role::Controller))
            }
            None => ClientSecurity::Plaintext,
        };
        let ch = FailoverChannel::new(&self.grpc_addrs(), security, Duration::from_secs(20))?;
        Ok(ControllerClient::new(ch)
            .max_decoding_message_size(128 << 20)
            .max_encoding_message_size(128 << 20))
    }

    /// `GET /v1/replica`'s view counters of replica `i` (whole loads, applied, resumed);
    /// `None` from a controller that does not report them.
    pub async fn view_counts(&self, i: usize) -> Option<(u64, u64, u64)> {
        let (status, body) = tokio::time::timeout(
            Duration::from_secs(5),
            self.replicas[i].http(
                crate::control::HttpAs::Cert(Role::Read),
                "GET",
                "/v1/replica",
                "",
            ),
        )
        .await
        .ok()?
        .ok()?;
        if status != 200 {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        let n = |k: &str| v.get("view")?.get(k)?.as_u64();
        Some((n("full_loads")?, n("applied")?, n("resumed")?))
    }
}

/// Runs the benchmark.
pub async fn run_scale(opts: &ScaleOpts) -> anyhow::Result<ScaleReport> {
    anyhow::ensure!(
        !opts.kill_leader || (opts.store == StoreKind::Etcd && opts.controllers >= 2),
        "--kill-leader needs --store etcd and at least 2 --controllers"
    );
    let dir = tempfile::Builder::new()
        .prefix("shardcast-scale-")
        .tempdir()
        .context("creating a scratch directory")?;
    let mut ctl = ScaleControllers::start(
        dir.path(),
        opts.store,
        opts.controllers,
        opts.heartbeat_ms,
        opts.origin_bps,
        opts.insecure,
        &opts.controller_args,
    )
    .await?;
    let leader = ctl.wait_leader(Duration::from_secs(20)).await?;
    let pid = ctl.replicas[leader]
        .pid()
        .context("the controller is not running")?;
    let followers: Vec<usize> = (0..ctl.replicas.len()).filter(|&i| i != leader).collect();
    let follower_pids: Vec<u32> = followers
        .iter()
        .filter_map(|&i| ctl.replicas[i].pid())
        .collect();
    let cpu_of = |pid: u32| crate::scenario::process_cpu_s(pid).unwrap_or(0.0);
    let cpu = || cpu_of(pid);
    let followers_cpu = || follower_pids.iter().map(|&p| cpu_of(p)).collect::<Vec<_>>();
    let cpu_start = cpu();
    let followers_start = followers_cpu();
    let name = "sim/scale-model";
    let origin = format!("{SIM_ORIGIN_PREFIX}scale-model/");
    let kill_name = "sim/scale-model-failover";
    let kill_origin = format!("{SIM_ORIGIN_PREFIX}scale-model-failover/");
    let (model, kill_model) = tokio::task::spawn_blocking({
        let (size, shards, origin, kill_origin) =
            (opts.size, opts.shards, origin.clone(), kill_origin.clone());
        move || -> anyhow::Result<_> {
            Ok((
                SimModel::zeros(name, &origin, size, shards, 1 << 20)?,
                SimModel::zeros(kill_name, &kill_origin, size, shards, 1 << 20)?,
            ))
        }
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
        controllers: ctl.grpc_addrs(),
        pki: ctl.replicas[0].pki.clone(),
        catalog: vec![model.clone(), kill_model],
    })
    .await?;
    let started = Instant::now();
    let mut client = ctl.client(leader).await?;
    let mut report = ScaleReport {
        store: opts.store,
        controllers: ctl.replicas.len(),
        hosts: opts.hosts,
        mutual_tls: ctl.replicas[0].pki.is_some(),
        heartbeat_ms: opts.heartbeat_ms,
        cert_issue_s: swarm.cert_s,
        all_up_s: 0.0,
        hosts_up: 0,
        steady: Phase::default(),
        during_prewarm: Phase::default(),
        register_ms: 0.0,
        model_bytes: opts.size,
        replicas: opts.replicas,
        plan_ms: 0.0,
        chains: 0,
        estimate_s: 0.0,
        prewarm_s: 0.0,
        plan_state: String::new(),
        plan_done: 0,
        status_holders: 0,
        swarm_holders: 0,
        heartbeat_failures: 0,
        controller_cpu_s: 0.0,
        controller_rss_mib: 0.0,
        controller_peak_rss_mib: 0.0,
        followers: Vec::new(),
        follower_sees_register_ms: None,
        follower_sees_plan_ms: None,
        kill: None,
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
    let mut follower_client = match followers.first() {
        Some(&f) => Some(ctl.client(f).await?),
        None => None,
    };
    if let Some(fc) = &mut follower_client {
        let seen = Instant::now();
        let key = name.to_string();
        report.follower_sees_register_ms = until_read(|| {
            let (mut fc, key) = (fc.clone(), key.clone());
            async move { fc.get_model(GetModelRequest { model: key }).await.is_ok() }
        })
        .await
        .then(|| seen.elapsed().as_secs_f64() * 1000.0);
    }

    // Steady state: heartbeats and status queries, no plan; on the leader and on a
    // follower.
    let phase = Arc::new(AtomicU8::new(0));
    let log = Arc::new(ProbeLog::default());
    let follower_log = Arc::new(ProbeLog::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let mut probers = vec![tokio::spawn(probe(
        client.clone(),
        name.to_string(),
        phase.clone(),
        log.clone(),
        Duration::from_millis(20),
        stop.clone(),
    ))];
    if let Some(&f) = followers.first() {
        probers.push(tokio::spawn(probe(
            ctl.client(f).await?,
            name.to_string(),
            phase.clone(),
            follower_log.clone(),
            Duration::from_millis(20),
            stop.clone(),
        )));
    }
    let follower_log = (!followers.is_empty()).then_some(&*follower_log);
    swarm.heartbeats.reset();
    let (w0, c0, f0) = (Instant::now(), cpu(), followers_cpu());
    tokio::time::sleep(opts.window).await;
    phase.store(2, Ordering::Relaxed);
    report.steady = phase_of(&swarm, &log, follower_log, 0, w0.elapsed(), cpu() - c0);
    report.steady.follower_cpu_cores = cores(&f0, &followers_cpu(), w0.elapsed());

    // The prewarm, with the status queries going on.
    swarm.heartbeats.reset();
    phase.store(1, Ordering::Relaxed);
    let (w1, c1, f1) = (Instant::now(), cpu(), followers_cpu());
    let accepted = client
        .prewarm(PrewarmRequest {
            model: name.into(),
            replicas: opts.replicas,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
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
    if let Some(fc) = &mut follower_client {
        let seen = Instant::now();
        let id = accepted.plan_id.clone();
        report.follower_sees_plan_ms = until_read(|| {
            let (mut fc, id) = (fc.clone(), id.clone());
            async move { fc.get_plan(WatchPlanRequest { plan_id: id }).await.is_ok() }
        })
        .await
        .then(|| seen.elapsed().as_secs_f64() * 1000.0);
    }
    let status = loop {
        let s = client
            .get_plan(WatchPlanRequest {
                plan_id: accepted.plan_id.clone(),
            })
            .await?
            .into_inner();
        if s.state().label() != "running" {
            break s;
        }
        if Instant::now() >= w1 + opts.timeout {
            bail!("the prewarm was still running after {:?}", opts.timeout);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    report.prewarm_s = w1.elapsed().as_secs_f64();
    phase.store(2, Ordering::Relaxed);
    report.during_prewarm = phase_of(&swarm, &log, follower_log, 1, w1.elapsed(), cpu() - c1);
    report.during_prewarm.follower_cpu_cores = cores(&f1, &followers_cpu(), w1.elapsed());
    stop.cancel();
    for p in probers {
        let _ = p.await;
    }
    report.plan_state = status.state().label().to_string();
    report.plan_done = status
        .hosts
        .iter()
        .filter(|h| h.state().label() == "done")
        .count();
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
    let followers_end = followers_cpu();
    for (n, &i) in followers.iter().enumerate() {
        let counts = ctl.view_counts(i).await;
        report.followers.push(FollowerReport {
            id: format!("ctl-{}", i + 1),
            cpu_s: followers_end.get(n).copied().unwrap_or(0.0)
                - followers_start.get(n).copied().unwrap_or(0.0),
            full_loads: counts.map(|c| c.0),
            applied: counts.map(|c| c.1),
            resumed: counts.map(|c| c.2),
            rss_mib: follower_pids
                .get(n)
                .and_then(|&p| process_rss_mib(p))
                .map(|r| r.0)
                .unwrap_or(0.0),
        });
    }
    if opts.kill_leader {
        report.kill = Some(
            kill_leader_during_prewarm(&mut ctl, &swarm, leader, kill_name, &kill_origin, opts)
                .await?,
        );
    }
    swarm.stop().await;
    drop(ctl);
    Ok(report)
}

/// Registers a second model, prewarms it through the fail-over client, SIGKILLs the leader
/// a third of the estimate into the plan, and follows the plan to its end on the new
/// leader.
async fn kill_leader_during_prewarm(
    ctl: &mut ScaleControllers,
    swarm: &Swarm,
    leader: usize,
    name: &str,
    origin: &str,
    opts: &ScaleOpts,
) -> anyhow::Result<KillReport> {
    let mut api = ctl.failover_client()?;
    api.register_model(RegisterModelRequest {
        name: name.into(),
        origin: origin.into(),
        ..Default::default()
    })
    .await
    .context("registering the fail-over model")?;
    let t0 = Instant::now();
    let accepted = api
        .prewarm(PrewarmRequest {
            model: name.into(),
            replicas: opts.replicas,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .context("the fail-over prewarm")?
        .into_inner();
    tokio::time::sleep(Duration::from_secs_f64(
        (accepted.estimate_s / 3.0).clamp(0.5, 10.0),
    ))
    .await;
    swarm.heartbeats.reset();
    let killed_after_s = t0.elapsed().as_secs_f64();
    let kill_at = Instant::now();
    ctl.replicas[leader].kill().await;
    eprintln!(
        "scale: killed the leader ctl-{} {killed_after_s:.2} s into the plan",
        leader + 1
    );
    let new = ctl.wait_leader(Duration::from_secs(30)).await?;
    let elected_s = kill_at.elapsed().as_secs_f64();
    eprintln!("scale: ctl-{} leads after {elected_s:.2} s", new + 1);
    let status = crate::control::wait_plan(&mut api, &accepted.plan_id, opts.timeout).await?;
    let prewarm_s = t0.elapsed().as_secs_f64();
    // Every host's heartbeats have had time to reach the new leader.
    tokio::time::sleep(Duration::from_millis(opts.heartbeat_ms * 3)).await;
    let failures = swarm.heartbeats.take().1;
    let mut gaps: Vec<(Instant, Duration)> = swarm
        .heartbeats
        .gaps()
        .into_iter()
        .filter(|(end, _)| *end >= kill_at)
        .collect();
    gaps.sort_by_key(|g| g.1);
    let mut ms: Vec<u32> = gaps
        .iter()
        .map(|g| g.1.as_millis().min(u128::from(u32::MAX)) as u32)
        .collect();
    let last_gap_end_s = gaps
        .iter()
        .map(|g| g.0.saturating_duration_since(kill_at).as_secs_f64())
        .fold(0.0, f64::max);
    let listed = ctl
        .client(new)
        .await?
        .list_hosts(ListHostsRequest {})
        .await?
        .into_inner()
        .hosts;
    Ok(KillReport {
        killed: format!("ctl-{}", leader + 1),
        new_leader: format!("ctl-{}", new + 1),
        killed_after_s,
        elected_s,
        heartbeat_failures: failures,
        hosts_with_gap: gaps.len(),
        gap_p50_s: quantile(&mut ms, 0.5) / 1000.0,
        gap_max_s: quantile(&mut ms, 1.0) / 1000.0,
        last_gap_end_s,
        hosts_listed: listed.len(),
        hosts_up: listed.iter().filter(|h| h.up).count(),
        plan_state: status.state().label().to_string(),
        plan_done: status
            .hosts
            .iter()
            .filter(|h| h.state().label() == "done")
            .count(),
        prewarm_s,
    })
}

/// Calls `read` every millisecond until it says yes (true) or 5 s pass (false).
async fn until_read<F, Fut>(mut read: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if read().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    false
}

/// CPU cores used by each process between two readings `wall` apart.
fn cores(before: &[f64], after: &[f64], wall: Duration) -> Vec<f64> {
    let secs = wall.as_secs_f64().max(1e-9);
    before
        .iter()
        .zip(after)
        .map(|(b, a)| (a - b) / secs)
        .collect()
}

/// The three calls' latencies recorded under phase `p`.
fn reads_of(log: &ProbeLog, p: usize) -> [Latency; 3] {
    let (us, errors) = match (log.us.lock(), log.errors.lock()) {
        (Ok(u), Ok(e)) => (u[p].clone(), e[p]),
        _ => Default::default(),
    };
    let [s, h, l] = us;
    [
        Latency::of(s, errors[0]),
        Latency::of(h, errors[1]),
        Latency::of(l, errors[2]),
    ]
}

fn phase_of(
    swarm: &Swarm,
    log: &ProbeLog,
    follower: Option<&ProbeLog>,
    p: usize,
    wall: Duration,
    cpu_s: f64,
) -> Phase {
    let (ok, failed, hb) = swarm.heartbeats.take();
    let [get_status, list_hosts, list_plans] = reads_of(log, p);
    let secs = wall.as_secs_f64().max(1e-9);
    Phase {
        seconds: secs,
        heartbeat: Latency::of(hb, failed as usize),
        heartbeats_per_s: ok as f64 / secs,
        get_status,
        list_hosts,
        list_plans,
        controller_cpu_cores: cpu_s / secs,
        follower: follower.map(|f| {
            let [get_status, list_hosts, list_plans] = reads_of(f, p);
            FollowerReads {
                get_status,
                list_hosts,
                list_plans,
            }
        }),
        follower_cpu_cores: Vec::new(),
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
        let mut out = format!(
            "{title} ({:.1} s)\n  heartbeat    {}\n  heartbeats/s {:.0}\n  GetStatus    {}\n  ListHosts    {}\n  ListPlans    {}\n  controller CPU {:.2} cores\n",
            p.seconds,
            lat(&p.heartbeat),
            p.heartbeats_per_s,
            lat(&p.get_status),
            lat(&p.list_hosts),
            lat(&p.list_plans),
            p.controller_cpu_cores
        );
        if let Some(f) = &p.follower {
            out.push_str(&format!(
                "  on a follower:\n    GetStatus  {}\n    ListHosts  {}\n    ListPlans  {}\n",
                lat(&f.get_status),
                lat(&f.list_hosts),
                lat(&f.list_plans)
            ));
        }
        if !p.follower_cpu_cores.is_empty() {
            let each: Vec<String> = p
                .follower_cpu_cores
                .iter()
                .map(|c| format!("{c:.3}"))
                .collect();
            out.push_str(&format!("  followers' CPU {} cores\n", each.join(" / ")));
        }
        out
    };
    let mut out = format!(
        "{} simulated hosts ({}), heartbeat every {} ms; {} controller{} on the {} store; certificates issued in {:.2} s; all up after {:.2} s\n{}{}register {:.1} ms\nprewarm {} replicas of {} MiB: plan {:.1} ms ({} chains, estimate {:.2} s), done after {:.2} s: plan {} with {} done; GetStatus shows {} holders, the swarm {}\ncontroller (leader): {:.1} CPU s in all, RSS {:.0} MiB (peak {:.0} MiB); failed heartbeats {}\n",
        r.hosts,
        if r.mutual_tls {
            "mutual TLS, one certificate each"
        } else {
            "INSECURE plaintext"
        },
        r.heartbeat_ms,
        r.controllers,
        if r.controllers == 1 { "" } else { "s" },
        match r.store {
            StoreKind::Embedded => "embedded",
            StoreKind::Etcd => "etcd",
        },
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
    );
    let opt = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |n| n.to_string());
    if let (Some(m), Some(p)) = (r.follower_sees_register_ms, r.follower_sees_plan_ms) {
        out.push_str(&format!(
            "a follower reads the registered model {m:.1} ms after the leader answered, the plan {p:.1} ms after\n"
        ));
    }
    for f in &r.followers {
        out.push_str(&format!(
            "follower {}: {:.2} CPU s, RSS {:.0} MiB; view loaded whole {} time(s), {} changes applied, watch resumed {}\n",
            f.id,
            f.cpu_s,
            f.rss_mib,
            opt(f.full_loads),
            opt(f.applied),
            opt(f.resumed)
        ));
    }
    if let Some(k) = &r.kill {
        out.push_str(&format!(
            "leader {} killed {:.2} s into a second prewarm: {} leads after {:.2} s; {} heartbeats failed; {} hosts had a gap between answered heartbeats (median {:.2} s, longest {:.2} s, the last ended {:.2} s after the kill); the new leader lists {} hosts, {} up; the plan ended {} with {} done, {:.2} s after its request\n",
            k.killed,
            k.killed_after_s,
            k.new_leader,
            k.elected_s,
            k.heartbeat_failures,
            k.hosts_with_gap,
            k.gap_p50_s,
            k.gap_max_s,
            k.last_gap_end_s,
            k.hosts_listed,
            k.hosts_up,
            k.plan_state,
            k.plan_done,
            k.prewarm_s
        ));
    }
    out
}
