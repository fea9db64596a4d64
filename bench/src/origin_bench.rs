//! The `origin` benchmark: one model read by a real `transferd` from each kind of origin
//! server, on loopback (each server's own ceiling) or across one emulated link
//! (`--emulate`), next to that link's raw TCP rate measured by iperf3 in the same run.
//!
//! ```text
//!  loopback:   transferd ──────────────────────────▶ server on 127.0.0.1
//!  emulated:   ns h1: transferd ─▶ relay 127.0.0.1 ══ tc-capped link ══▶ ns h0: server
//! ```
//!
//! Servers: `http` is this crate's origin server (`shardcast-bench origin-server`, no rate
//! cap of its own), `moto` and `s3rver` are S3-compatible servers from PyPI and npm
//! (`tests/support/s3-server.sh`, `tests/support/s3rver.sh`, which install them under the
//! target directory on first use; the model is uploaded with `tests/support/s3-setup.py`,
//! signed, and every read is signed and checked by the server).
//!
//! For each server a fresh `transferd` (its memory tier on tmpfs) reads the model twice
//! through the code every origin read takes ([`transferd::origin::Origin`]):
//!
//! 1. **manifest**: `ImportModel` without a manifest: one streaming GET per file, four files
//!    at a time, every byte hashed (what registration reads); the digest must equal the one
//!    built from the local files.
//! 2. **fetch**: `ImportModel` with that manifest and `fetch`: chunk-sized ranged GETs,
//!    `origin_parallel` in flight, each chunk verified and written to the memory tier (what
//!    a chain head without the model reads). The copy is then checked byte for byte.
//!
//! CPU seconds of the server, the reader and (emulated) the relay come from
//! `/proc/<pid>/stat` around the fetch.
//!
//! Why a relay: transferd accepts a plain-`http://` S3 endpoint only at a loopback address
//! (anything else must be HTTPS, `transferd::origin`'s S3 module). In the emulated mode the
//! reader's namespace runs a small TCP relay (`shardcast-bench relay`) on its loopback that
//! forwards to the server across the capped link; every origin, HTTP included, goes
//! through one, so they are compared on the same path. Its CPU is reported.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;
use shardcast_protocol::agent::{ImportModelRequest, ImportModelResponse, Tier as PbTier};
use shardcast_protocol::codec::encode_to_vec;
use shardcast_protocol::manifest::DEFAULT_CHUNK_SIZE;
use shardcast_protocol::origin_policy::{Enforcer, OriginPolicy};
use shardcast_protocol::{Manifest, ModelName};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::cluster::{Daemon, DaemonOpts, workspace_bin};
use crate::netns::EmulatedNet;
use crate::scenario::{MODEL_NAME, process_cpu_s, scratch_dir};
use crate::synth::{self, SynthSpec};

/// The server's host in the emulated net; the reader is host [`READER`].
const SERVER: usize = 0;
/// The reader's host in the emulated net.
const READER: usize = 1;
/// Bucket and key prefix the S3 servers hold the model under.
const BUCKET: &str = "bench";
const PREFIX: &str = "model";
/// The fixed credentials s3rver checks signatures against.
const S3RVER_KEY: &str = "S3RVER:S3RVER";
/// Longest wait for a server or relay to come up (an S3 server's first start installs it).
const START_TIMEOUT: Duration = Duration::from_secs(600);
/// Bytes a relay moves per read and write, each way. Rationale: at 8 KiB (tokio's default)
/// the relay cost about 1.8 CPU s/GB on the development host, a fifth of a core at 1 Gbit/s;
/// larger buffers cut its system calls.
const RELAY_BUFFER: usize = 256 << 10;
/// Longest a relay process lives: it exits by itself even if the benchmark is SIGKILLed.
const RELAY_LIFETIME: Duration = Duration::from_secs(4 * 3600);

/// An origin server kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OriginKind {
    /// This crate's HTTP origin server.
    Http,
    /// moto's S3 server (PyPI).
    Moto,
    /// s3rver (npm).
    S3rver,
}

impl OriginKind {
    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Http => "http",
            Self::Moto => "moto",
            Self::S3rver => "s3rver",
        }
    }

    /// Port it listens on in the emulated net (the namespace is the benchmark's own).
    fn emulated_port(self) -> u16 {
        match self {
            Self::Http => 8080,
            Self::Moto => 9000,
            Self::S3rver => 9001,
        }
    }
}

impl FromStr for OriginKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "http" => Ok(Self::Http),
            "moto" => Ok(Self::Moto),
            "s3rver" => Ok(Self::S3rver),
            other => Err(format!("unknown origin {other:?} (http, moto, s3rver)")),
        }
    }
}

/// Options of `origin`.
#[derive(Debug, Clone)]
pub struct OriginBenchOpts {
    /// Servers and reader in two network namespaces joined by a capped link (needs root);
    /// else loopback, uncapped.
    pub emulate: bool,
    /// Model size.
    pub size: u64,
    /// Safetensors shards (the S3 servers hold one object per file).
    pub shards: usize,
    /// The link's cap in bytes/s (emulated mode).
    pub rate: Option<u64>,
    /// Servers, in the order run.
    pub origins: Vec<OriginKind>,
    /// The reader's `--origin-parallel` (concurrent ranged GETs); `None`: transferd's
    /// default.
    pub origin_parallel: Option<usize>,
    /// The manifest's chunk size (one ranged GET per chunk); 0: transferd's default.
    pub chunk_size: u32,
    /// Limit on each read.
    pub timeout: Duration,
    /// Seconds iperf3 measures the link (0: skip).
    pub iperf_seconds: u32,
}

/// One server's result.
#[derive(Debug, Clone, Serialize)]
pub struct OriginRun {
    /// The server.
    pub origin: OriginKind,
    /// The URI the reader was given.
    pub uri: String,
    /// Starting the server, the relay (emulated mode) and the reading transferd, seconds.
    pub setup_s: f64,
    /// Streaming read to build the manifest (one GET per file, 4 at a time), seconds.
    pub manifest_s: f64,
    /// Its rate, MB/s (10^6 bytes).
    pub manifest_mb_per_s: f64,
    /// Parallel ranged reads into the memory tier, every chunk verified, seconds.
    pub fetch_s: f64,
    /// Its rate, MB/s.
    pub fetch_mb_per_s: f64,
    /// Fetch rate / the link's TCP rate measured by iperf3 (emulated mode).
    pub fetch_of_link: Option<f64>,
    /// Fetch rate / the link's tc cap (emulated mode).
    pub fetch_of_cap: Option<f64>,
    /// Server CPU seconds during the fetch.
    pub server_cpu_s: f64,
    /// Server CPU seconds per GB fetched.
    pub server_cpu_s_per_gb: f64,
    /// Reader (transferd) CPU seconds per GB fetched.
    pub reader_cpu_s_per_gb: f64,
    /// Relay CPU seconds per GB fetched (emulated mode).
    pub relay_cpu_s_per_gb: Option<f64>,
    /// The manifest built through this origin has the local files' digest.
    pub digest_matches: bool,
    /// The fetched copy matched the manifest byte for byte.
    pub verified: bool,
}

/// What `origin` measured.
#[derive(Debug, Clone, Serialize)]
pub struct OriginReport {
    /// `loopback` or `emulated`.
    pub mode: String,
    /// Model bytes.
    pub bytes: u64,
    /// Files of the model.
    pub files: usize,
    /// Chunk size, bytes: one ranged GET per chunk.
    pub chunk_size: u32,
    /// Ranged GETs in flight.
    pub origin_parallel: usize,
    /// The link's cap, bits/s (emulated mode).
    pub rate_bits_per_s: Option<u64>,
    /// Raw TCP across the same link (or loopback) from iperf3, MB/s; `None` if iperf3 is
    /// missing or skipped.
    pub link_tcp_mb_per_s: Option<f64>,
    /// Per server.
    pub runs: Vec<OriginRun>,
}

/// The Cargo target directory (where the S3 servers are installed).
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

/// The S3 servers' scripts, shared with `tests/tests/cluster/origins.rs`.
fn support_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/support")
}

/// A child process killed (by PID) when dropped.
struct Proc {
    child: Child,
}

impl Proc {
    fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    fn cpu_s(&self) -> f64 {
        self.pid().and_then(process_cpu_s).unwrap_or(0.0)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// `program` on this host, or inside host `i`'s namespace of `net`; killed (by PID) if
/// dropped before it ends, so a timed-out wait leaves nothing behind.
fn command(net: Option<&EmulatedNet>, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd: Command = match net {
        Some(net) => net.command(i, program).into(),
        None => Command::new(program),
    };
    cmd.kill_on_drop(true);
    cmd
}

/// Spawns `cmd` and waits for a stdout line starting with `READY `; returns the process
/// and the rest of that line. Stdout keeps being drained afterwards.
async fn spawn_ready(mut cmd: Command, what: &str) -> anyhow::Result<(Proc, String)> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let stdout = child.stdout.take().context("stdout")?;
    let proc = Proc { child };
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(l) = lines.next_line().await? {
            if let Some(rest) = l.strip_prefix("READY ") {
                return Ok::<_, std::io::Error>(Some(rest.to_string()));
            }
        }
        Ok(None)
    })
    .await;
    let line = match line {
        Ok(Ok(Some(l))) => l,
        _ => bail!("{what} did not start"),
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((proc, line))
}

/// Runs `script install` (bounded): installs an S3 server before it is started where no
/// registry can be reached.
async fn install(script: &str) -> anyhow::Result<()> {
    let out = tokio::time::timeout(
        START_TIMEOUT,
        command(None, 0, "bash")
            .arg(support_dir().join(script))
            .arg("install")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .with_context(|| format!("{script} install did not finish in {START_TIMEOUT:?}"))?
    .with_context(|| format!("running {script}"))?;
    if !out.status.success() {
        bail!(
            "{script} install failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Installs what serving from `kind` needs, if missing (under the target directory):
/// moto and the upload client (boto3) into a venv for both S3 servers, s3rver with npm.
/// Fails saying why (for instance no python3, pip, node or npm here), which the tests print
/// as they skip that server.
pub async fn prepare(kind: OriginKind) -> anyhow::Result<()> {
    match kind {
        OriginKind::Http => Ok(()),
        OriginKind::Moto => install("s3-server.sh").await,
        OriginKind::S3rver => {
            install("s3-server.sh").await?;
            install("s3rver.sh").await
        }
    }
}

/// A port free on loopback now.
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A server holding the model, as the reader reaches it.
struct Server {
    proc: Proc,
    /// The URI the reader imports.
    uri: String,
    /// The address the server listens on.
    addr: SocketAddr,
    /// Environment the reader needs (S3 credentials; the endpoint is set by the caller).
    credentials: Option<(String, String)>,
}

/// Starts `kind` serving `model_dir` (in the server's namespace when emulated).
async fn start_server(
    kind: OriginKind,
    net: Option<&EmulatedNet>,
    model_dir: &Path,
    scratch: &Path,
) -> anyhow::Result<Server> {
    let ip: IpAddr = net.map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |n| {
        IpAddr::V4(n.host_ip(SERVER))
    });
    let port = match net {
        Some(_) => kind.emulated_port(),
        None => free_port()?,
    };
    let addr = SocketAddr::new(ip, port);
    let support = support_dir();
    let proc = match kind {
        OriginKind::Http => {
            let exe = workspace_bin("shardcast-bench", "shardcast-bench", "SHARDCAST_BENCH_BIN")?;
            let mut cmd = command(net, SERVER, exe);
            cmd.arg("origin-server")
                .arg("--dir")
                .arg(model_dir)
                .arg("--listen")
                .arg(addr.to_string())
                .args(["--rate", "unlimited"]);
            let (proc, _) = spawn_ready(cmd, "the HTTP origin server").await?;
            return Ok(Server {
                proc,
                uri: format!("http://{addr}/"),
                addr,
                credentials: None,
            });
        }
        OriginKind::Moto => {
            prepare(kind).await?;
            let mut cmd = command(net, SERVER, "bash");
            cmd.arg(support.join("s3-server.sh"))
                .arg(port.to_string())
                .arg(ip.to_string())
                // s3-setup.py's IAM calls go unauthenticated; every later request is checked.
                .env("INITIAL_NO_AUTH_ACTION_COUNT", "3");
            spawn_logged(cmd, "moto", &scratch.join("moto.log"))?
        }
        OriginKind::S3rver => {
            prepare(kind).await?;
            let mut cmd = command(net, SERVER, "bash");
            cmd.arg(support.join("s3rver.sh"))
                .arg(port.to_string())
                .arg(scratch.join("s3rver-data"))
                .arg(ip.to_string());
            spawn_logged(cmd, "s3rver", &scratch.join("s3rver.log"))?
        }
    };
    // Upload from the server's own namespace (not across the measured link), signed.
    let python = target_dir().join("s3-test-venv/bin/python");
    let mut setup = command(net, SERVER, &python);
    setup
        .arg(support.join("s3-setup.py"))
        .arg(format!("http://{addr}"))
        .args([BUCKET, PREFIX])
        .arg(model_dir);
    if kind == OriginKind::S3rver {
        setup.arg(S3RVER_KEY);
    }
    let out = tokio::time::timeout(START_TIMEOUT, setup.stdin(Stdio::null()).output())
        .await
        .context("uploading the model to the S3 server timed out")?
        .context("running tests/support/s3-setup.py")?;
    if !out.status.success() {
        bail!(
            "uploading the model to {} failed: {}\n{} log: {}",
            kind.name(),
            String::from_utf8_lossy(&out.stderr).trim(),
            kind.name(),
            crate::cluster::tail(&scratch.join(format!("{}.log", kind.name())))
        );
    }
    let keys: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("s3-setup.py's answer")?;
    let field = |k: &str| {
        keys[k]
            .as_str()
            .map(str::to_string)
            .with_context(|| format!("s3-setup.py gave no {k}"))
    };
    Ok(Server {
        proc,
        uri: format!("s3://{BUCKET}/{PREFIX}/"),
        addr,
        credentials: Some((field("key")?, field("secret")?)),
    })
}

/// Spawns a server that prints no `READY` line (readiness is the upload's connect), its
/// output appended to `log`.
fn spawn_logged(mut cmd: Command, what: &str, log: &Path) -> anyhow::Result<Proc> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::from(file.try_clone()?))
        .stderr(Stdio::from(file))
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    Ok(Proc { child })
}

/// Spawns a process whose output is not wanted.
fn spawn_quiet(mut cmd: Command, what: &str) -> anyhow::Result<Proc> {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    Ok(Proc { child })
}

/// Starts a relay in the reader's namespace from `127.0.0.1:<port>` to `to`; returns it
/// and the port.
async fn start_relay(net: &EmulatedNet, to: SocketAddr) -> anyhow::Result<(Proc, u16)> {
    let exe = workspace_bin("shardcast-bench", "shardcast-bench", "SHARDCAST_BENCH_BIN")?;
    let mut cmd = command(Some(net), READER, exe);
    cmd.arg("relay")
        .args(["--listen", "127.0.0.1:0", "--to"])
        .arg(to.to_string())
        .arg("--lifetime-s")
        .arg(RELAY_LIFETIME.as_secs().to_string());
    let (proc, line) = spawn_ready(cmd, "the relay").await?;
    let port = line
        .strip_prefix("relay=")
        .and_then(|a| a.parse::<SocketAddr>().ok())
        .map(|a| a.port())
        .with_context(|| format!("bad READY line from the relay: {line:?}"))?;
    Ok((proc, port))
}

/// Relays every connection to `listen` to `to` until `lifetime` has passed: the
/// `shardcast-bench relay` subcommand (see the module docs). Prints `READY relay=<addr>`
/// once listening.
pub async fn relay(listen: &str, to: SocketAddr, lifetime: Duration) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    println!("READY relay={}", listener.local_addr()?);
    let accept = async {
        loop {
            let (mut inbound, _) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "relay: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            tokio::spawn(async move {
                let Ok(Ok(mut outbound)) = tokio::time::timeout(
                    Duration::from_secs(10),
                    tokio::net::TcpStream::connect(to),
                )
                .await
                else {
                    return;
                };
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                // 256 KiB buffers: a tenth of the system calls of the default 8 KiB.
                let _ = tokio::io::copy_bidirectional_with_sizes(
                    &mut inbound,
                    &mut outbound,
                    RELAY_BUFFER,
                    RELAY_BUFFER,
                )
                .await;
            });
        }
    };
    tokio::select! {
        () = accept => Ok(()),
        () = tokio::time::sleep(lifetime) => Ok(()),
    }
}

/// The model's manifest built from its local files (the reference digest).
async fn local_manifest(dir: &Path, chunk_size: u32) -> anyhow::Result<Manifest> {
    let uri = format!("file://{}", dir.display());
    let access = transferd::origin::OriginAccess::new(
        OriginPolicy::parse([uri.as_str()], Enforcer::Host).map_err(anyhow::Error::msg)?,
    );
    let origin = transferd::origin::Origin::parse(&uri, &access)?;
    Ok(origin
        .build_manifest(ModelName::new(MODEL_NAME)?, chunk_size, &|_| {})
        .await?)
}

/// One `ImportModel` on `d`, bounded by `timeout`.
async fn import(
    d: &Daemon,
    uri: &str,
    chunk_size: u32,
    manifest: Option<&Manifest>,
    timeout: Duration,
) -> anyhow::Result<ImportModelResponse> {
    let req = ImportModelRequest {
        name: MODEL_NAME.into(),
        origin: uri.into(),
        chunk_size,
        tier: PbTier::Memory as i32,
        fetch: manifest.is_some(),
        keep: false,
        manifest: manifest.map(encode_to_vec).unwrap_or_default(),
        bind_name: None,
    };
    let mut agent = d.agent().await?;
    Ok(tokio::time::timeout(timeout, agent.import_model(req))
        .await
        .with_context(|| format!("reading {uri} took more than {timeout:?}"))?
        .with_context(|| format!("ImportModel from {uri}"))?
        .into_inner())
}

/// Raw TCP from the server's side to the reader's (`iperf3 -R`, the origin's direction),
/// across the emulated link or on loopback; MB/s, or `None` when iperf3 is missing.
async fn iperf3(net: Option<&EmulatedNet>, seconds: u32) -> anyhow::Result<Option<f64>> {
    if seconds == 0 {
        return Ok(None);
    }
    let found = Command::new("iperf3")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .is_ok();
    if !found {
        eprintln!("iperf3 is not installed: no link ceiling in this report");
        return Ok(None);
    }
    let ip = net.map_or(Ipv4Addr::LOCALHOST, |n| n.host_ip(SERVER));
    let port = match net {
        Some(_) => 5201,
        None => free_port()?,
    };
    let mut server = command(net, SERVER, "iperf3");
    server.args(["-s", "-1", "-B", &ip.to_string(), "-p", &port.to_string()]);
    let _server = spawn_quiet(server, "iperf3 -s")?;
    let mut client = command(net, READER, "timeout");
    client.args([
        &(seconds + 15).to_string(),
        "iperf3",
        "-c",
        &ip.to_string(),
        "-p",
        &port.to_string(),
        "-t",
        &seconds.to_string(),
        "-R",
        "-J",
    ]);
    // The server needs a moment to listen: retry the client briefly.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = client.stdin(Stdio::null()).output().await?;
        let json: Option<serde_json::Value> = serde_json::from_slice(&out.stdout).ok();
        if let Some(bps) = json
            .as_ref()
            .and_then(|j| j["end"]["sum_received"]["bits_per_second"].as_f64())
        {
            return Ok(Some(bps / 8.0 / 1e6));
        }
        if Instant::now() > deadline {
            bail!(
                "iperf3 failed: {}",
                json.map(|j| j["error"].to_string()).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Runs the `origin` benchmark (see the module docs).
pub async fn run_origin_bench(opts: &OriginBenchOpts) -> anyhow::Result<OriginReport> {
    if opts.origins.is_empty() {
        bail!("no origin to measure");
    }
    let net = if opts.emulate {
        let rate = opts.rate.context("--emulate needs a finite --rate")?;
        Some(EmulatedNet::create(2, Some(rate), None)?)
    } else {
        None
    };
    let scratch = scratch_dir("origin")?;
    let model_dir = scratch.path().join("model");
    let model = synth::generate(
        &model_dir,
        &SynthSpec {
            total_bytes: opts.size,
            shards: opts.shards,
            seed: 42,
        },
    )?;
    let chunk_size = match opts.chunk_size {
        0 => DEFAULT_CHUNK_SIZE,
        c => c,
    };
    let manifest = local_manifest(&model_dir, chunk_size).await?;
    let bytes = manifest.total_bytes();
    eprintln!(
        "origin: {} in {} files, {}",
        shardcast_protocol::units::format_bytes(model.total_bytes),
        manifest.shards.len(),
        match (net.as_ref(), opts.rate) {
            (Some(_), Some(r)) => format!("across one link capped at {} Mbit/s", r * 8 / 1_000_000),
            _ => "on loopback".to_string(),
        }
    );
    let link = iperf3(net.as_ref(), opts.iperf_seconds).await?;
    if let Some(l) = link {
        eprintln!("{:>8}: {l:.1} MB/s raw TCP (iperf3)", "link");
    }
    let mut runs = Vec::new();
    for &kind in &opts.origins {
        let run = run_one(
            kind,
            opts,
            net.as_ref(),
            &model_dir,
            scratch.path(),
            &manifest,
            link,
        )
        .await
        .with_context(|| format!("origin {}", kind.name()))?;
        eprintln!(
            "{:>8}: manifest {:.1} MB/s ({:.1} s), fetch {:.1} MB/s ({:.1} s){}, server {:.2} CPU s/GB, set-up {:.1} s{}",
            kind.name(),
            run.manifest_mb_per_s,
            run.manifest_s,
            run.fetch_mb_per_s,
            run.fetch_s,
            run.fetch_of_link
                .map(|f| format!(" ({:.0}% of the link)", f * 100.0))
                .unwrap_or_default(),
            run.server_cpu_s_per_gb,
            run.setup_s,
            if run.verified && run.digest_matches {
                ""
            } else {
                ", NOT VERIFIED"
            }
        );
        runs.push(run);
    }
    Ok(OriginReport {
        mode: if opts.emulate { "emulated" } else { "loopback" }.into(),
        bytes,
        files: manifest.shards.len(),
        chunk_size: manifest.chunk_size,
        origin_parallel: opts
            .origin_parallel
            .unwrap_or_else(|| transferd::chain::ChainConfig::default().origin_parallel),
        rate_bits_per_s: opts.rate.filter(|_| opts.emulate).map(|r| r * 8),
        link_tcp_mb_per_s: link,
        runs,
    })
}

/// One server: start it, read the model twice through a fresh transferd, stop both.
async fn run_one(
    kind: OriginKind,
    opts: &OriginBenchOpts,
    net: Option<&EmulatedNet>,
    model_dir: &Path,
    scratch: &Path,
    manifest: &Manifest,
    link: Option<f64>,
) -> anyhow::Result<OriginRun> {
    let started = Instant::now();
    let server = start_server(kind, net, model_dir, scratch).await?;
    let (relay, endpoint) = match net {
        Some(net) => {
            let (relay, port) = start_relay(net, server.addr).await?;
            (Some(relay), SocketAddr::from(([127, 0, 0, 1], port)))
        }
        None => (None, server.addr),
    };
    let uri = match kind {
        OriginKind::Http => format!("http://{endpoint}/"),
        _ => server.uri.clone(),
    };
    let mut o = DaemonOpts::local(format!("reader-{}", kind.name()));
    if let Some(net) = net {
        o.data_ip = IpAddr::V4(net.host_ip(READER));
        o.netns = Some(net.ns_name(READER).to_string());
    }
    o.extra_args.extend(["--origin-allow".into(), uri.clone()]);
    if let Some(p) = opts.origin_parallel {
        o.extra_args
            .extend(["--origin-parallel".into(), p.to_string()]);
    }
    if let Some((key, secret)) = &server.credentials {
        o.env = vec![
            ("AWS_ACCESS_KEY_ID".into(), key.clone()),
            ("AWS_SECRET_ACCESS_KEY".into(), secret.clone()),
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_ENDPOINT_URL".into(), format!("http://{endpoint}")),
        ];
    }
    let reader = Daemon::start(&scratch.join(format!("reader-{}", kind.name())), o).await?;
    let setup_s = started.elapsed().as_secs_f64();

    let t0 = Instant::now();
    let built = import(&reader, &uri, manifest.chunk_size, None, opts.timeout).await?;
    let manifest_s = t0.elapsed().as_secs_f64();
    let digest_matches = built.digest == manifest.digest().to_hex();

    let cpu = |p: Option<&Proc>| p.map_or(0.0, Proc::cpu_s);
    let reader_cpu = || reader.pid().and_then(process_cpu_s).unwrap_or(0.0);
    let (s0, r0, x0) = (server.proc.cpu_s(), reader_cpu(), cpu(relay.as_ref()));
    let t0 = Instant::now();
    import(
        &reader,
        &uri,
        manifest.chunk_size,
        Some(manifest),
        opts.timeout,
    )
    .await?;
    let fetch_s = t0.elapsed().as_secs_f64();
    let (s1, r1, x1) = (server.proc.cpu_s(), reader_cpu(), cpu(relay.as_ref()));
    let verified = match reader.verify_copy(manifest) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("{}: {e:#}", kind.name());
            false
        }
    };
    let reader_root = reader.root().to_path_buf();
    drop(reader);
    drop(relay);
    drop(server);
    // The next server's reader and data get the tmpfs room back.
    let _ = std::fs::remove_dir_all(reader_root);
    let _ = std::fs::remove_dir_all(scratch.join("s3rver-data"));

    let bytes = manifest.total_bytes() as f64;
    let gb = bytes / 1e9;
    let fetch_mb_per_s = bytes / fetch_s / 1e6;
    Ok(OriginRun {
        origin: kind,
        uri,
        setup_s,
        manifest_s,
        manifest_mb_per_s: bytes / manifest_s / 1e6,
        fetch_s,
        fetch_mb_per_s,
        fetch_of_link: link.map(|l| fetch_mb_per_s / l),
        fetch_of_cap: opts
            .rate
            .filter(|_| net.is_some())
            .map(|r| fetch_mb_per_s * 1e6 / r as f64),
        server_cpu_s: s1 - s0,
        server_cpu_s_per_gb: (s1 - s0) / gb,
        reader_cpu_s_per_gb: (r1 - r0) / gb,
        relay_cpu_s_per_gb: net.map(|_| (x1 - x0) / gb),
        digest_matches,
        verified,
    })
}
