//! Scenarios that go through the controller's API, as a FaaS platform would: the `demo`
//! (loopback, no root) and the `cold-start` benchmark (emulated cluster).
//!
//! Timing is taken on the caller's side: from just before the `Prewarm` call to the first
//! poll of `GetPlan` that shows each host done (polled every 50 ms), and every copy is then
//! checked byte for byte against the manifest.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use shardcast_protocol::Manifest;
use shardcast_protocol::codec::decode_exact;
use shardcast_protocol::controller::controller_client::ControllerClient;
use shardcast_protocol::controller::{
    PlanStatus, PrewarmRequest, RegisterModelRequest, ScaleOutRequest, WatchPlanRequest,
};
use shardcast_protocol::units::format_bytes;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::cluster::{Daemon, DaemonOpts};
use crate::control::{ControllerProc, ManagedCluster, managed_args, wait_hosts_up};
use crate::netns::EmulatedNet;
use crate::origin_server::{self, OriginStats};
use crate::scenario::{MODEL_NAME, scratch_dir};
use crate::synth::{self, SynthSpec};

/// Polls a plan until it ends; returns its final status and when each host became ready
/// (seconds since `t0`; hosts that already held the model count as ready at once).
pub async fn ready_times(
    api: &mut ControllerClient<Channel>,
    plan: &str,
    t0: Instant,
    timeout: Duration,
    pb: &ProgressBar,
) -> anyhow::Result<(PlanStatus, Vec<(String, f64)>)> {
    let mut ready: Vec<(String, f64)> = Vec::new();
    loop {
        let s = api
            .get_plan(WatchPlanRequest {
                plan_id: plan.to_string(),
            })
            .await
            .context("GetPlan")?
            .into_inner();
        let now = t0.elapsed().as_secs_f64();
        pb.set_length(s.hosts.iter().map(|h| h.total).sum::<u64>().max(1));
        pb.set_position(s.hosts.iter().map(|h| h.bytes).sum());
        for h in &s.hosts {
            let is_ready = h.state().label() == "done" || h.state().label() == "local";
            if is_ready && !ready.iter().any(|(x, _)| *x == h.host) {
                ready.push((
                    h.host.clone(),
                    if h.state().label() == "local" {
                        0.0
                    } else {
                        now
                    },
                ));
            }
        }
        if s.state().label() != "running" {
            ready.sort_by(|a, b| a.0.cmp(&b.0));
            return Ok((s, ready));
        }
        if t0.elapsed() > timeout {
            bail!("plan {plan} still running after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn bar(enabled: bool, label: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(1);
    pb.set_style(
        ProgressStyle::with_template(
            "{prefix:>22} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} {elapsed}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_prefix(label.to_string());
    pb
}

async fn register(
    api: &mut ControllerClient<Channel>,
    origin: &str,
) -> anyhow::Result<(Manifest, String)> {
    let m = api
        .register_model(RegisterModelRequest {
            name: MODEL_NAME.into(),
            origin: origin.into(),
            chunk_size: 0,
            via_host: String::new(),
            profile_json: String::new(),
            no_wait: false,
        })
        .await
        .context("RegisterModel")?
        .into_inner();
    Ok((decode_exact(m.manifest.into())?, m.digest))
}

/// A scratch directory holding a synthetic safetensors model (removed on drop).
fn synthetic_origin(size: u64, shards: usize) -> anyhow::Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new()
        .prefix("shardcast-origin-")
        .tempdir()
        .context("origin dir")?;
    eprintln!(
        "generating a {} synthetic model ({shards} safetensors shards)",
        format_bytes(size)
    );
    synth::generate(
        dir.path(),
        &SynthSpec {
            total_bytes: size,
            shards,
            seed: 42,
        },
    )?;
    Ok(dir)
}

fn verify_all<'a>(
    daemons: impl IntoIterator<Item = &'a Daemon>,
    manifest: &Manifest,
) -> anyhow::Result<()> {
    for d in daemons {
        d.verify_copy(manifest)?;
    }
    Ok(())
}

// ---------------------------------------------------------------- demo

/// Options of `demo`.
#[derive(Debug, Clone)]
pub struct DemoOpts {
    /// Model size.
    pub size: u64,
    /// Safetensors shards.
    pub shards: usize,
    /// Hosts (transferd processes); the first half is prewarmed cold, the rest warm.
    pub hosts: usize,
    /// Per-host egress and ingress cap (bytes/s).
    pub rate: Option<u64>,
    /// The origin's total cap (bytes/s).
    pub origin_rate: Option<u64>,
    /// Progress bars.
    pub progress: bool,
}

/// One step of the demo.
#[derive(Debug, Clone, Serialize)]
pub struct DemoStep {
    /// What was asked.
    pub step: String,
    /// Plan id.
    pub plan: String,
    /// Where the data came from (chain sources).
    pub sources: Vec<String>,
    /// Hosts that received the model in this step.
    pub received: usize,
    /// Hosts that already held it.
    pub already: usize,
    /// The controller's estimate.
    pub estimate_s: f64,
    /// Until every host held a verified copy.
    pub ready_s: f64,
    /// Bytes the origin served during the step.
    pub origin_bytes: u64,
}

/// Runs the demo: a controller and `hosts` transferd processes on loopback, a synthetic
/// model behind a rate-capped HTTP origin; register (one origin read, kept by the host that
/// hashes it), prewarm half the hosts (a chain from that copy: no origin traffic), scale
/// out to the rest (served by the holders), then prewarm all (everything already held).
pub async fn run_demo(opts: &DemoOpts) -> anyhow::Result<Vec<DemoStep>> {
    if opts.hosts < 2 {
        bail!("--hosts must be at least 2");
    }
    let origin_dir = synthetic_origin(opts.size, opts.shards)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let origin_url = format!("http://{}/", listener.local_addr()?);
    let stats = Arc::new(OriginStats::default());
    let cancel = CancellationToken::new();
    let _guard = cancel.clone().drop_guard();
    tokio::spawn(origin_server::serve(
        origin_dir.path().to_path_buf(),
        listener,
        opts.origin_rate,
        stats.clone(),
        cancel.clone(),
    ));
    let rate_flag = opts
        .rate
        .map(|r| format!("{r}B/s"))
        .unwrap_or_else(|| "unlimited".into());
    // The controller and every host may read exactly this origin.
    let allow = vec!["--origin-allow".to_string(), origin_url.clone()];
    let mut ctl_args = allow.clone();
    if let Some(r) = opts.origin_rate {
        ctl_args.extend(["--origin-rate".into(), format!("{r}B/s")]);
    }
    eprintln!(
        "starting a controller and {} transferd processes on loopback",
        opts.hosts
    );
    let cluster = ManagedCluster::start(opts.hosts, ctl_args, |i, o| {
        o.egress_rate = rate_flag.clone();
        o.ingress_rate = rate_flag.clone();
        o.extra_args.extend(allow.clone());
        // Two racks, so the plans show rack-aware ordering.
        o.extra_args.extend([
            "--rack".into(),
            format!("rack-{}", i % 2 + 1),
            "--nic-rate".into(),
            rate_flag.clone(),
        ]);
    })
    .await?;
    let mut api = cluster.controller.client().await?;
    eprintln!(
        "registering {MODEL_NAME} from {origin_url} (the controller has a transferd hash it)"
    );
    let t0 = Instant::now();
    let (manifest, _) = register(&mut api, &origin_url).await?;
    // The host that read the origin to hash the model kept what it read.
    let keepers = crate::control::memory_holders(&mut api, MODEL_NAME).await?;
    for h in &keepers {
        cluster.daemon(h)?.verify_copy(&manifest)?;
    }
    let mut steps = vec![DemoStep {
        step: "register".into(),
        plan: "-".into(),
        sources: vec!["origin".into()],
        received: keepers.len(),
        already: 0,
        estimate_s: 0.0,
        ready_s: t0.elapsed().as_secs_f64(),
        origin_bytes: stats.bytes_sent.load(Ordering::Relaxed),
    }];
    eprintln!(
        "{:>22}: done in {:.2} s, origin served {}, kept on {}",
        "register",
        steps[0].ready_s,
        format_bytes(steps[0].origin_bytes),
        if keepers.is_empty() {
            "no host".to_string()
        } else {
            keepers.join(", ")
        }
    );
    let half = opts.hosts / 2;
    for (label, call) in [
        (format!("prewarm {half}"), 0),
        (format!("scale-out +{} (warm)", opts.hosts - half), 1),
        (format!("prewarm all {}", opts.hosts), 2),
    ] {
        let before = stats.bytes_sent.load(Ordering::Relaxed);
        let t0 = Instant::now();
        let accepted = match call {
            0 => {
                api.prewarm(PrewarmRequest {
                    model: MODEL_NAME.into(),
                    replicas: half as u32,
                    ..Default::default()
                })
                .await
            }
            1 => {
                api.scale_out(ScaleOutRequest {
                    partitions: 0,
                    model: MODEL_NAME.into(),
                    replicas: (opts.hosts - half) as u32,
                    tier: shardcast_protocol::controller::Tier::Memory as i32,
                    ..Default::default()
                })
                .await
            }
            _ => {
                api.prewarm(PrewarmRequest {
                    model: MODEL_NAME.into(),
                    replicas: opts.hosts as u32,
                    ..Default::default()
                })
                .await
            }
        }
        .with_context(|| format!("step {label:?}"))?
        .into_inner();
        let pb = bar(opts.progress, &label);
        let (status, _) = ready_times(
            &mut api,
            &accepted.plan_id,
            t0,
            Duration::from_secs(900),
            &pb,
        )
        .await?;
        pb.finish_and_clear();
        let ready_s = t0.elapsed().as_secs_f64();
        if status.state().label() != "done" {
            bail!(
                "plan {} ended {}: {}",
                status.plan_id,
                status.state,
                status.message
            );
        }
        let received: Vec<&str> = status
            .hosts
            .iter()
            .filter(|h| h.state().label() == "done")
            .map(|h| h.host.as_str())
            .collect();
        for h in &received {
            cluster.daemon(h)?.verify_copy(&manifest)?;
        }
        let mut sources: Vec<String> = accepted.chains.iter().map(|c| c.source.clone()).collect();
        sources.sort();
        sources.dedup();
        let step = DemoStep {
            step: label,
            plan: accepted.plan_id,
            sources,
            received: received.len(),
            already: status
                .hosts
                .iter()
                .filter(|h| h.state().label() == "local")
                .count(),
            estimate_s: accepted.estimate_s,
            ready_s,
            origin_bytes: stats.bytes_sent.load(Ordering::Relaxed) - before,
        };
        eprintln!(
            "{:>22}: ready in {:.2} s, origin served {}",
            step.step,
            step.ready_s,
            format_bytes(step.origin_bytes)
        );
        steps.push(step);
    }
    verify_all(&cluster.daemons, &manifest)?;
    Ok(steps)
}

/// Renders the demo's steps as a table.
pub fn demo_table(steps: &[DemoStep], bytes: u64) -> String {
    let mut out = format!(
        "model {} through the controller\n{:<22}  {:<24}  {:>8}  {:>7}  {:>9}  {:>8}  {:>12}\n",
        format_bytes(bytes),
        "STEP",
        "SOURCES",
        "RECEIVED",
        "ALREADY",
        "ESTIMATE",
        "READY",
        "ORIGIN READ"
    );
    for s in steps {
        let sources = if s.sources.is_empty() {
            "-".to_string()
        } else {
            s.sources.join(",")
        };
        out.push_str(&format!(
            "{:<22}  {:<24}  {:>8}  {:>7}  {:>8.1}s  {:>7.2}s  {:>12}\n",
            s.step,
            sources,
            s.received,
            s.already,
            s.estimate_s,
            s.ready_s,
            format_bytes(s.origin_bytes)
        ));
    }
    out
}

// ---------------------------------------------------------------- cold start

/// Options of `cold-start`.
#[derive(Debug, Clone)]
pub struct ColdStartOpts {
    /// Hosts.
    pub hosts: usize,
    /// Model size.
    pub size: u64,
    /// Safetensors shards.
    pub shards: usize,
    /// Host link rate (bytes/s), enforced by tc.
    pub rate: u64,
    /// Origin server rate (bytes/s), enforced by the server.
    pub origin_rate: u64,
    /// Methods: `origin-pull` (baseline), `shardcast`.
    pub methods: Vec<String>,
    /// Per-method limit.
    pub timeout: Duration,
    /// Progress bars.
    pub progress: bool,
}

/// One method's result.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ColdStartResult {
    /// `origin-pull` or `shardcast`.
    pub method: String,
    /// Prewarm call → every host holds a verified copy.
    pub ready_s: f64,
    /// Per host, in host order.
    pub per_host_s: Vec<f64>,
    /// The hosts of `per_host_s`, in its order.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Each planned chain's receivers in order (the first is fed by the chain's source).
    #[serde(default)]
    pub chain_hops: Vec<Vec<String>>,
    /// The controller's estimate.
    pub estimate_s: f64,
    /// Bytes the origin served for the prewarm.
    pub origin_bytes: u64,
    /// Chains in the plan.
    pub chains: usize,
    /// Every copy matched the manifest byte for byte.
    pub verified: bool,
}

/// The `cold-start` report.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ColdStartReport {
    /// Hosts.
    pub hosts: usize,
    /// Model bytes.
    pub bytes: u64,
    /// Host link rate, bits/s.
    pub rate_bits_per_s: u64,
    /// Origin rate, bits/s.
    pub origin_rate_bits_per_s: u64,
    /// One origin read: bytes / origin rate.
    pub origin_read_s: f64,
    /// Per method.
    pub results: Vec<ColdStartResult>,
    /// The burst in the simulator's terms (`simulate --emulated` replays it).
    pub sim_params: crate::sim::params::BurstParams,
}

/// An origin server process inside a namespace; killed (by PID) on drop.
pub(crate) struct OriginProc {
    child: tokio::process::Child,
    stats: PathBuf,
    url: String,
}

impl OriginProc {
    async fn start(
        net: &EmulatedNet,
        i: usize,
        dir: &Path,
        rate: u64,
        scratch: &Path,
    ) -> anyhow::Result<Self> {
        let exe = crate::cluster::workspace_bin(
            "shardcast-bench",
            "shardcast-bench",
            "SHARDCAST_BENCH_BIN",
        )?;
        let stats = scratch.join("origin-stats.json");
        let listen = format!("{}:8080", net.host_ip(i));
        let mut cmd: tokio::process::Command = net.command(i, exe).into();
        let mut child = cmd
            .arg("origin-server")
            .arg("--dir")
            .arg(dir)
            .arg("--listen")
            .arg(&listen)
            .arg("--rate")
            .arg(format!("{rate}B/s"))
            .arg("--stats-file")
            .arg(&stats)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting the origin server")?;
        let stdout = child.stdout.take().context("origin stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(20), async {
            while let Some(l) = lines.next_line().await? {
                if l.starts_with("READY ") {
                    return Ok::<_, std::io::Error>(true);
                }
            }
            Ok(false)
        })
        .await;
        if !matches!(ready, Ok(Ok(true))) {
            bail!("the origin server did not start in its namespace");
        }
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self {
            child,
            stats,
            url: format!("http://{listen}/"),
        })
    }

    pub(crate) fn bytes_sent(&self) -> u64 {
        origin_server::read_stats_file(&self.stats)
    }
}

impl Drop for OriginProc {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// An emulated cluster under a controller, as `cold-start` and `faults` run it: `hosts`
/// transferds in network namespaces with links capped at `rate`, an origin server (at
/// `origin_rate`, serving `origin_dir`) in one more namespace, and a controller every
/// daemon heartbeats to, with the model registered through the origin. Dropped in field
/// order: the daemons, the controller, the origin, the namespaces, the scratch directory.
pub(crate) struct EmulatedCluster {
    pub(crate) daemons: Vec<Daemon>,
    pub(crate) controller: ControllerProc,
    pub(crate) origin: OriginProc,
    pub(crate) net: EmulatedNet,
    /// The registered model's manifest.
    pub(crate) manifest: Manifest,
    _scratch: tempfile::TempDir,
}

impl EmulatedCluster {
    /// Starts it; `label` names the scratch directory and the progress line; every
    /// transferd also gets `daemon_args`, and with `memory_tmpfs` a memory tier on a tmpfs
    /// of its own of that many bytes.
    pub(crate) async fn start(
        hosts: usize,
        rate: u64,
        origin_rate: u64,
        origin_dir: &Path,
        label: &str,
        daemon_args: &[String],
        memory_tmpfs: Option<u64>,
    ) -> anyhow::Result<Self> {
        let net = EmulatedNet::create(hosts + 1, Some(rate), None)?;
        let scratch = scratch_dir(label)?;
        let origin =
            OriginProc::start(&net, hosts, origin_dir, origin_rate, scratch.path()).await?;
        let rate_flag = format!("{rate}B/s");
        let controller = ControllerProc::start(
            &scratch.path().join("controller"),
            vec![
                "--origin-rate".into(),
                format!("{origin_rate}B/s"),
                "--default-nic-rate".into(),
                rate_flag.clone(),
                "--origin-allow".into(),
                origin.url.clone(),
                // Cold starts from the origin are what these benchmarks measure: the
                // registering host keeps no copy to serve them from.
                "--register-keep-copy".into(),
                "false".into(),
            ],
        )
        .await?;
        let mut daemons = Vec::new();
        for i in 0..hosts {
            let name = format!("host-{}", i + 1);
            let mut o = DaemonOpts::local(name.clone());
            o.data_ip = IpAddr::V4(net.host_ip(i));
            o.netns = Some(net.ns_name(i).to_string());
            o.extra_args.extend(managed_args(&controller, ""));
            o.extra_args.extend([
                "--nic-rate".into(),
                rate_flag.clone(),
                "--origin-allow".into(),
                origin.url.clone(),
            ]);
            o.extra_args.extend(daemon_args.iter().cloned());
            o.memory_tmpfs = memory_tmpfs;
            daemons.push(Daemon::start(&scratch.path().join(&name), o).await?);
        }
        wait_hosts_up(&controller, hosts, Duration::from_secs(30)).await?;
        let mut api = controller.client().await?;
        eprintln!("{label}: registering (a transferd hashes the model through the origin)");
        let (manifest, _) = register(&mut api, &origin.url).await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(Self {
            daemons,
            controller,
            origin,
            net,
            manifest,
            _scratch: scratch,
        })
    }
}

/// A synthetic model of `size` bytes in `shards` shards, in a temporary directory that
/// the emulated clusters' origin server serves.
pub(crate) fn origin_model(
    size: u64,
    shards: usize,
) -> anyhow::Result<(tempfile::TempDir, synth::SynthModel)> {
    let dir = tempfile::Builder::new()
        .prefix("shardcast-origin-")
        .tempdir()
        .context("origin dir")?;
    let model = synth::generate(
        dir.path(),
        &SynthSpec {
            total_bytes: size,
            shards,
            seed: 42,
        },
    )?;
    Ok((dir, model))
}

/// Runs `cold-start`: for each method a fresh emulated cluster (hosts + one origin
/// namespace), a controller, and a prewarm of every host through the API.
pub async fn run_cold_start(opts: &ColdStartOpts) -> anyhow::Result<ColdStartReport> {
    if opts.hosts == 0 {
        bail!("--hosts must be at least 1");
    }
    let (origin_dir, model) = origin_model(opts.size, opts.shards)?;
    let mut results = Vec::new();
    let mut layout = None;
    for method in &opts.methods {
        let sources = match method.as_str() {
            "origin-pull" => "origin",
            "shardcast" => "auto",
            other => bail!("unknown method {other:?} (origin-pull, shardcast)"),
        };
        let (r, manifest) = cold_start_method(opts, method, sources, origin_dir.path())
            .await
            .with_context(|| format!("method {method}"))?;
        layout = Some(manifest);
        eprintln!(
            "{:>12}: ready in {:.2} s (estimate {:.2} s), origin served {}",
            r.method,
            r.ready_s,
            r.estimate_s,
            format_bytes(r.origin_bytes)
        );
        results.push(r);
    }
    let manifest = layout.context("no method was run")?;
    let sim_params = crate::sim::params::BurstParams {
        hosts: opts.hosts,
        model: manifest.name.to_string(),
        shard_bytes: manifest.shards.iter().map(|s| s.size).collect(),
        chunk_size: manifest.chunk_size,
        host_link_cap_bps: opts.rate as f64,
        origin_bps: opts.origin_rate as f64,
        origin_behind_host_link: true,
        tls: true,
        origin_parallel: crate::sim::dc::ORIGIN_PARALLEL,
    };
    Ok(ColdStartReport {
        hosts: opts.hosts,
        bytes: model.total_bytes,
        rate_bits_per_s: opts.rate * 8,
        origin_rate_bits_per_s: opts.origin_rate * 8,
        origin_read_s: model.total_bytes as f64 / opts.origin_rate as f64,
        results,
        sim_params,
    })
}

async fn cold_start_method(
    opts: &ColdStartOpts,
    method: &str,
    sources: &str,
    origin_dir: &Path,
) -> anyhow::Result<(ColdStartResult, Manifest)> {
    let c = EmulatedCluster::start(
        opts.hosts,
        opts.rate,
        opts.origin_rate,
        origin_dir,
        method,
        &[],
        None,
    )
    .await?;
    let (origin, manifest) = (&c.origin, &c.manifest);
    let mut api = c.controller.client().await?;
    let before = origin.bytes_sent();
    let pb = bar(opts.progress, method);
    let t0 = Instant::now();
    let accepted = api
        .prewarm(PrewarmRequest {
            model: MODEL_NAME.into(),
            replicas: opts.hosts as u32,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            sources: sources.into(),
            ..Default::default()
        })
        .await
        .context("Prewarm")?
        .into_inner();
    let (status, ready) = ready_times(&mut api, &accepted.plan_id, t0, opts.timeout, &pb).await?;
    pb.finish_and_clear();
    if status.state().label() != "done" || ready.len() != opts.hosts {
        bail!(
            "plan {} ended {} with {} of {} hosts ready: {}",
            status.plan_id,
            status.state,
            ready.len(),
            opts.hosts,
            status.message
        );
    }
    // Let the origin's stats file catch up (it is rewritten every 100 ms).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let origin_bytes = origin.bytes_sent() - before;
    let verified = match verify_all(&c.daemons, manifest) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("verification failed: {e:#}");
            false
        }
    };
    let per_host_s: Vec<f64> = ready.iter().map(|r| r.1).collect();
    let manifest = manifest.clone();
    drop(c);
    let result = ColdStartResult {
        method: method.into(),
        ready_s: per_host_s.iter().copied().fold(0.0, f64::max),
        per_host_s,
        hosts: ready.iter().map(|r| r.0.clone()).collect(),
        chain_hops: accepted.chains.iter().map(|c| c.hops.clone()).collect(),
        estimate_s: accepted.estimate_s,
        origin_bytes,
        chains: accepted.chains.len(),
        verified,
    };
    Ok((result, manifest))
}

// ---------------------------------------------------------------- burst

/// Options of `burst`.
#[derive(Debug, Clone)]
pub struct BurstOpts {
    /// Model size.
    pub size: u64,
    /// Safetensors shards.
    pub shards: usize,
    /// Partitions of the burst replica.
    pub partitions: u32,
    /// Simulated host → GPU rate, bytes/s.
    pub pcie_rate: u64,
}

/// One burst host.
#[derive(Debug, Clone, Serialize)]
pub struct BurstHost {
    /// Host id.
    pub host: String,
    /// Its partition label.
    pub partition: String,
    /// Bytes of its partition.
    pub partition_bytes: u64,
    /// Seconds from the `ScaleOut` call until this host's partition was live (polled).
    pub live_s: f64,
    /// Seconds until this host held a full replica on its GPU (polled).
    pub complete_s: f64,
    /// The host's own figure: load start → partition live.
    pub host_live_s: f64,
}

/// What `burst` measured.
#[derive(Debug, Clone, Serialize)]
pub struct BurstReport {
    /// Model bytes.
    pub bytes: u64,
    /// Partitions.
    pub partitions: u32,
    /// Simulated PCIe rate, bytes/s.
    pub pcie_rate: u64,
    /// A whole GPU replica (model already in the host's memory tier): `Prewarm` tier gpu
    /// until the host's GPU status says resident.
    pub full_ready_s: f64,
    /// The partitioned replica: `ScaleOut(partitions)` until every partition is live.
    pub burst_live_s: f64,
    /// Until every burst host held a full replica (model completion).
    pub burst_complete_s: f64,
    /// Per host.
    pub hosts: Vec<BurstHost>,
    /// The controller's estimate of the burst's cold start (from the partition plan).
    pub estimate_s: f64,
}

/// Time to a serving GPU replica, whole vs partitioned (Flashpoint §4.2), through the
/// controller on loopback with simulated GPUs: `partitions + 1` hosts, each with the model
/// already in its memory tier (so the host → GPU load is what is measured), one GPU each.
/// First a whole replica on host-1, then a burst of one replica in `partitions` parts on
/// the others, each part first, then completion.
pub async fn run_burst(opts: &BurstOpts) -> anyhow::Result<BurstReport> {
    use shardcast_protocol::agent::GpuStatusRequest;
    if !(2..=16).contains(&opts.partitions) {
        bail!("--partitions must be between 2 and 16");
    }
    let origin_dir = synthetic_origin(opts.size, opts.shards)?;
    let hosts = opts.partitions as usize + 1;
    let gpu_mem = format!("{}B", (opts.size * 2).div_ceil(1 << 20) << 20);
    let pcie = format!("{}B/s", opts.pcie_rate);
    eprintln!(
        "starting a controller and {hosts} transferd processes with one simulated GPU each ({} host → GPU)",
        format_bytes(opts.pcie_rate) + "/s"
    );
    let origin = format!("file://{}", origin_dir.path().display());
    let allow = vec!["--origin-allow".to_string(), origin.clone()];
    // A whole replica vs a partitioned burst, each loading from the origin: the
    // registering host keeps no copy.
    let mut ctl_args = allow.clone();
    ctl_args.extend(["--register-keep-copy".into(), "false".into()]);
    let cluster = ManagedCluster::start(hosts, ctl_args, |_, o| {
        o.extra_args.extend(allow.clone());
        o.sim_gpus(1, &gpu_mem);
        o.extra_args
            .extend(["--sim-pcie-rate".into(), pcie.clone()]);
    })
    .await?;
    let mut api = cluster.controller.client().await?;
    let (manifest, digest) = register(&mut api, &origin).await?;
    eprintln!("prewarming every host's memory tier");
    let a = api
        .prewarm(PrewarmRequest {
            model: MODEL_NAME.into(),
            replicas: hosts as u32,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .context("Prewarm memory")?
        .into_inner();
    let pb = bar(false, "memory");
    let (st, _) = ready_times(
        &mut api,
        &a.plan_id,
        Instant::now(),
        Duration::from_secs(600),
        &pb,
    )
    .await?;
    if st.state().label() != "done" {
        bail!("memory prewarm ended {}: {}", st.state, st.message);
    }
    verify_all(&cluster.daemons, &manifest)?;

    eprintln!("whole replica on host-1");
    let t0 = Instant::now();
    let a = api
        .prewarm(PrewarmRequest {
            model: MODEL_NAME.into(),
            hosts: vec!["host-1".into()],
            tier: shardcast_protocol::controller::Tier::Gpu as i32,
            ..Default::default()
        })
        .await
        .context("Prewarm gpu")?
        .into_inner();
    // Timed like the burst below: the host's own GPU status, polled every 10 ms (the
    // plan's status is polled by the controller only every 250 ms).
    let mut agent = cluster.daemon("host-1")?.agent().await?;
    let full_ready_s = loop {
        let st = agent.gpu_status(GpuStatusRequest {}).await?.into_inner();
        if let Some(m) = st.models.iter().find(|m| m.model == digest) {
            match m.state.as_str() {
                "resident" => break t0.elapsed().as_secs_f64(),
                "failed" => bail!("host-1: {}", m.error),
                _ => {}
            }
        }
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("the whole replica did not load within 600 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let (st, _) = ready_times(&mut api, &a.plan_id, t0, Duration::from_secs(600), &pb).await?;
    if st.state().label() != "done" || st.hosts.iter().any(|h| h.gpu_state().label() != "resident")
    {
        bail!("whole GPU replica ended {}: {:?}", st.state, st.hosts);
    }

    eprintln!("burst: one replica in {} partitions", opts.partitions);
    let t0 = Instant::now();
    let a = api
        .scale_out(ScaleOutRequest {
            model: MODEL_NAME.into(),
            replicas: 1,
            tier: shardcast_protocol::controller::Tier::Gpu as i32,
            partitions: opts.partitions,
            ..Default::default()
        })
        .await
        .context("ScaleOut partitions")?
        .into_inner();
    let names: Vec<String> = a
        .hosts
        .iter()
        .filter(|h| h.state().label() == "loading")
        .map(|h| h.host.clone())
        .collect();
    if names.len() != opts.partitions as usize {
        bail!("the burst started on {} hosts: {:?}", names.len(), a.hosts);
    }
    let mut agents = Vec::new();
    for n in &names {
        agents.push(cluster.daemon(n)?.agent().await?);
    }
    let mut out: Vec<Option<BurstHost>> = vec![None; names.len()];
    let mut live: Vec<Option<f64>> = vec![None; names.len()];
    let deadline = Duration::from_secs(600);
    while out.iter().any(Option::is_none) {
        if t0.elapsed() > deadline {
            bail!("the burst did not complete within {deadline:?}");
        }
        for (i, agent) in agents.iter_mut().enumerate() {
            if out[i].is_some() {
                continue;
            }
            let st = agent.gpu_status(GpuStatusRequest {}).await?.into_inner();
            let Some(m) = st.models.iter().find(|m| m.model == digest) else {
                continue;
            };
            if m.state == "failed" {
                bail!("{}: {}", names[i], m.error);
            }
            let now = t0.elapsed().as_secs_f64();
            if live[i].is_none() && matches!(m.state.as_str(), "partition-live" | "resident") {
                live[i] = Some(now);
            }
            if m.state == "resident" {
                out[i] = Some(BurstHost {
                    host: names[i].clone(),
                    partition: m.partition.clone(),
                    partition_bytes: m.partition_bytes,
                    live_s: live[i].unwrap_or(now),
                    complete_s: now,
                    host_live_s: m.partition_live_s.unwrap_or(m.elapsed_s),
                });
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let hosts: Vec<BurstHost> = out.into_iter().flatten().collect();
    verify_all(&cluster.daemons, &manifest)?;
    let max = |f: fn(&BurstHost) -> f64| hosts.iter().map(f).fold(0.0, f64::max);
    Ok(BurstReport {
        bytes: manifest.total_bytes(),
        partitions: opts.partitions,
        pcie_rate: opts.pcie_rate,
        full_ready_s,
        burst_live_s: max(|h| h.live_s),
        burst_complete_s: max(|h| h.complete_s),
        estimate_s: a.estimate_s,
        hosts,
    })
}
