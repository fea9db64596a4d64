//! Controller replicas on a real etcd: the cluster behind the high-availability tests
//! (`tests/tests/cluster/ha.rs`) and the `failover` benchmark.
//!
//! * [`EtcdProc`]: an `etcd` process on loopback (free ports, a data directory of its
//!   own), killed by PID when dropped; restartable on the same ports and data.
//! * [`TcpProxy`]: a TCP relay the test owns, to cut one controller off from etcd (a
//!   network partition) and heal it again.
//! * [`HaCluster`]: etcd, three `shardcast-controller` replicas with `--state etcd://`
//!   (mutual TLS as in [`crate::control`]), and `transferd` daemons that heartbeat to
//!   every replica's socket and follow the leader.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use shardcast_identity::failover::FailoverChannel;
use shardcast_identity::grpc::ClientSecurity;
use shardcast_identity::{Expect, Role};
use shardcast_protocol::controller::ListHostsRequest;
use shardcast_protocol::controller::controller_client::ControllerClient;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use crate::cluster::{Daemon, DaemonOpts};
use crate::control::{ControllerProc, HEARTBEAT_MS, HttpAs, wait_plan};

/// How to get etcd when it is missing.
const INSTALL_HINT: &str = "etcd is needed for the controller's high-availability tests: run .ci/setup as root, \
     or `apt-get install etcd-server` (Debian/Ubuntu), or put an etcd 3.4+ binary on PATH \
     or in $SHARDCAST_ETCD_BIN";

/// The `etcd` binary: `$SHARDCAST_ETCD_BIN`, else `etcd` on PATH; when missing and
/// running as root, installs Debian's `etcd-server` once (bounded); else an error that
/// says how to install it.
pub fn etcd_bin() -> anyhow::Result<PathBuf> {
    static INSTALL: std::sync::Mutex<Option<bool>> = std::sync::Mutex::new(None);
    if let Some(p) = std::env::var_os("SHARDCAST_ETCD_BIN") {
        return Ok(PathBuf::from(p));
    }
    let find = || {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("etcd"))
                .find(|p| p.is_file())
        })
    };
    if let Some(p) = find() {
        return Ok(p);
    }
    let mut tried = INSTALL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if tried.is_none() {
        // SAFETY-free check of root: the effective uid from /proc.
        let root = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Uid:"))
                    .map(|l| l.split_whitespace().nth(2) == Some("0"))
            })
            .unwrap_or(false);
        let ok = root
            && std::process::Command::new("timeout")
                .args(["300", "apt-get", "install", "-y", "-qq", "etcd-server"])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
        *tried = Some(ok);
    }
    find().with_context(|| INSTALL_HINT.to_string())
}

/// A free loopback port (bound, then released; etcd binds it right after).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A single-member etcd on loopback. Killed (by PID) when dropped.
pub struct EtcdProc {
    /// Client address (`127.0.0.1:port`).
    pub client: SocketAddr,
    peer: SocketAddr,
    /// Data directory (kept across restarts).
    pub data: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl EtcdProc {
    /// Starts etcd with its data and log under `root`.
    pub async fn start(root: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(root)?;
        let mut last = None;
        // Another process may take a port between our probe and etcd's bind: retry.
        for _ in 0..5 {
            let mut e = Self {
                client: SocketAddr::from(([127, 0, 0, 1], free_port()?)),
                peer: SocketAddr::from(([127, 0, 0, 1], free_port()?)),
                data: root.join("data"),
                log: root.join("etcd.log"),
                child: None,
            };
            match e.spawn().await {
                Ok(()) => return Ok(e),
                Err(err) => last = Some(err),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("etcd did not start")))
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let bin = etcd_bin()?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let client = format!("http://{}", self.client);
        let peer = format!("http://{}", self.peer);
        let mut cmd = Command::new(&bin);
        cmd.arg("--name")
            .arg("shardcast-test")
            .arg("--data-dir")
            .arg(&self.data)
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("shardcast-test={peer}"))
            // Room for large manifests (docs/OPERATIONS.md): the controllers here are
            // started with the same --etcd-max-request-bytes.
            .arg("--max-request-bytes")
            .arg(ETCD_MAX_REQUEST_BYTES.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        // Ready when a client request is answered.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "etcd exited ({status}) at start; see {}",
                    self.log.display()
                );
            }
            if etcd_healthy(self.client).await {
                break;
            }
            if Instant::now() >= deadline {
                let _ = child.start_kill();
                bail!("etcd not healthy within 20 s; see {}", self.log.display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.child = Some(child);
        Ok(())
    }

    /// `etcd://host:port` for `--state`.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.client)
    }

    /// SIGKILL (by PID) and wait.
    pub async fn kill(&mut self) {
        crate::cluster::kill_child(&mut self.child).await;
    }

    /// Starts it again on the same ports and data directory.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill().await;
        let mut last = None;
        for _ in 0..20 {
            match self.spawn().await {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("etcd restart failed")))
    }
}

impl Drop for EtcdProc {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
    }
}

/// etcd's request limit in these clusters (and the controllers' flag to match).
pub const ETCD_MAX_REQUEST_BYTES: usize = 16 << 20;

/// Whether etcd at `addr` answers `/health` with `"health":"true"`.
async fn etcd_healthy(addr: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(b"GET /health HTTP/1.1\r\nHost: etcd\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        Some(String::from_utf8_lossy(&out).contains("\"health\":\"true\""))
    };
    tokio::time::timeout(Duration::from_secs(2), attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// A TCP relay from a loopback port to `target` that can be cut (every connection closed,
/// new ones refused) and healed. Stops when dropped.
pub struct TcpProxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    cut: Arc<AtomicBool>,
    generation: Arc<tokio::sync::watch::Sender<u64>>,
    stop: CancellationToken,
}

impl TcpProxy {
    /// Relays `127.0.0.1:<free port>` to `target`.
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let cut = Arc::new(AtomicBool::new(false));
        let generation = Arc::new(tokio::sync::watch::Sender::new(0u64));
        let stop = CancellationToken::new();
        {
            let (cut, generation, stop) = (cut.clone(), generation.clone(), stop.clone());
            tokio::spawn(async move {
                loop {
                    let conn = tokio::select! {
                        _ = stop.cancelled() => return,
                        c = listener.accept() => c,
                    };
                    let Ok((mut inbound, _)) = conn else { continue };
                    if cut.load(Ordering::SeqCst) {
                        drop(inbound);
                        continue;
                    }
                    let mut cutoff = generation.subscribe();
                    let stop = stop.clone();
                    tokio::spawn(async move {
                        let Ok(Ok(mut outbound)) = tokio::time::timeout(
                            Duration::from_secs(2),
                            tokio::net::TcpStream::connect(target),
                        )
                        .await
                        else {
                            return;
                        };
                        tokio::select! {
                            _ = stop.cancelled() => {}
                            _ = cutoff.changed() => {}
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        }
                    });
                }
            });
        }
        Ok(Self {
            addr,
            cut,
            generation,
            stop,
        })
    }

    /// Closes every relayed connection and refuses new ones (a partition).
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Relays again.
    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Flags that put a controller on etcd (`state` is an `etcd://` URL).
pub fn replica_args(state: &str, id: &str) -> Vec<String> {
    vec![
        "--state".into(),
        state.into(),
        "--replica-id".into(),
        id.into(),
        "--etcd-max-request-bytes".into(),
        ETCD_MAX_REQUEST_BYTES.to_string(),
    ]
}

/// etcd, three controller replicas on it and daemons that follow the leader.
pub struct HaCluster {
    /// The etcd member.
    pub etcd: EtcdProc,
    /// The replicas, `ctl-1` … `ctl-3`.
    pub controllers: Vec<ControllerProc>,
    /// Relays between a replica and etcd, when started with one (index of the replica).
    pub proxies: Vec<(usize, TcpProxy)>,
    /// The daemons, `host-1` … `host-N`.
    pub daemons: Vec<Daemon>,
    /// Scratch directory holding everything.
    pub scratch: tempfile::TempDir,
}

impl HaCluster {
    /// Starts etcd, `replicas` controllers (with `ctl_args`) and `n` daemons; replica
    /// indexes in `proxied` reach etcd through a [`TcpProxy`]. The first replica is
    /// started alone and leads before the others start. Waits until every daemon is up
    /// in the leader's inventory.
    pub async fn start(
        replicas: usize,
        n: usize,
        ctl_args: Vec<String>,
        proxied: &[usize],
        mut opts: impl FnMut(usize, &mut DaemonOpts),
    ) -> anyhow::Result<Self> {
        let scratch = tempfile::Builder::new()
            .prefix("shardcast-ha-")
            .tempdir()
            .context("scratch dir")?;
        let etcd = EtcdProc::start(&scratch.path().join("etcd")).await?;
        let mut controllers = Vec::new();
        let mut proxies = Vec::new();
        for i in 0..replicas {
            let url = if proxied.contains(&i) {
                let p = TcpProxy::start(etcd.client).await?;
                let url = format!("etcd://{}", p.addr);
                proxies.push((i, p));
                url
            } else {
                etcd.url()
            };
            let id = format!("ctl-{}", i + 1);
            let mut args = replica_args(&url, &id);
            args.extend(ctl_args.iter().cloned());
            let c = ControllerProc::start(&scratch.path().join(&id), args).await?;
            if i == 0 {
                wait_role(&c, "leader", Duration::from_secs(20)).await?;
            }
            controllers.push(c);
        }
        let inventory = controllers
            .iter()
            .map(ControllerProc::inventory_addr)
            .collect::<Vec<_>>()
            .join(",");
        let mut daemons = Vec::new();
        for i in 0..n {
            let name = format!("host-{}", i + 1);
            let mut o = DaemonOpts::local(name.clone());
            o.extra_args.extend([
                "--controller".into(),
                inventory.clone(),
                "--heartbeat-ms".into(),
                HEARTBEAT_MS.to_string(),
                "--upstream-grace-ms".into(),
                "500".into(),
                "--idle-timeout-s".into(),
                "5".into(),
            ]);
            opts(i, &mut o);
            daemons.push(Daemon::start(&scratch.path().join(&name), o).await?);
        }
        let c = Self {
            etcd,
            controllers,
            proxies,
            daemons,
            scratch,
        };
        c.wait_hosts_up(n, Duration::from_secs(30)).await?;
        Ok(c)
    }

    /// `--controller a,b,c` and an admin certificate, for the `shardcast` CLI.
    pub fn cli_args(&self) -> anyhow::Result<Vec<String>> {
        let mut args = self.controllers[0].cli_args()?;
        let all = self
            .controllers
            .iter()
            .map(|c| c.grpc.to_string())
            .collect::<Vec<_>>()
            .join(",");
        if let Some(i) = args.iter().position(|a| a == "--controller") {
            args[i + 1] = all;
        }
        Ok(args)
    }

    /// A gRPC client over every replica (admin certificate) that follows the leader.
    pub fn client(&self) -> anyhow::Result<ControllerClient<FailoverChannel>> {
        let pki = self.controllers[0]
            .pki
            .as_ref()
            .context("the replicas run without TLS")?;
        let security =
            ClientSecurity::Tls(pki.client(Role::Admin)?, Expect::Role(Role::Controller));
        let addrs: Vec<String> = self
            .controllers
            .iter()
            .map(|c| c.grpc.to_string())
            .collect();
        let ch = FailoverChannel::new(&addrs, security, Duration::from_secs(20))?;
        Ok(ControllerClient::new(ch)
            .max_decoding_message_size(128 << 20)
            .max_encoding_message_size(128 << 20))
    }

    /// The index of the replica that says it leads now, if one does.
    pub async fn leader(&self) -> Option<usize> {
        leader_of(&self.controllers).await
    }

    /// Waits (bounded) until a replica leads; its index.
    pub async fn wait_leader(&self, timeout: Duration) -> anyhow::Result<usize> {
        wait_leader_of(&self.controllers, timeout).await
    }

    /// Waits until at least `n` hosts are up in the leader's inventory.
    pub async fn wait_hosts_up(&self, n: usize, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            // Reads are served by followers too: count the leader's own view.
            let leader_up = match self.leader().await {
                Some(i) => match self.controllers[i].client().await {
                    Ok(mut c) => c
                        .list_hosts(ListHostsRequest {})
                        .await
                        .map(|r| r.into_inner().hosts.iter().filter(|h| h.up).count())
                        .unwrap_or(0),
                    Err(_) => 0,
                },
                None => 0,
            };
            if leader_up >= n {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("only {leader_up} of {n} hosts are up at the leader after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Daemon by host id.
    pub fn daemon(&self, host: &str) -> anyhow::Result<&Daemon> {
        self.daemons
            .iter()
            .find(|d| d.host_id.as_str() == host)
            .with_context(|| format!("no daemon {host}"))
    }
}

/// What `GET /v1/replica` says this replica is (`leader`, `follower`); `None`: no answer.
pub async fn role(c: &ControllerProc) -> Option<String> {
    let (status, body) = tokio::time::timeout(
        Duration::from_secs(2),
        c.http(HttpAs::Cert(Role::Read), "GET", "/v1/replica", ""),
    )
    .await
    .ok()?
    .ok()?;
    if status != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    v.get("role")?.as_str().map(str::to_string)
}

/// Waits (bounded) until `c` says it is `want`.
pub async fn wait_role(c: &ControllerProc, want: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let now = role(c).await;
        if now.as_deref() == Some(want) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "controller at {} is {now:?}, not {want}, after {timeout:?}",
                c.grpc
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Options of the `failover` benchmark.
#[derive(Debug, Clone)]
pub struct FailoverOpts {
    /// Leader kills.
    pub trials: usize,
    /// transferd processes.
    pub hosts: usize,
    /// Lease TTL given to the replicas, milliseconds.
    pub lease_ttl_ms: u64,
}

/// One trial of the `failover` benchmark.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FailoverTrial {
    /// The replica killed (`ctl-N`).
    pub killed: String,
    /// The replica that took the write.
    pub new_leader: String,
    /// SIGKILL of the leader → the first write (a prewarm) accepted, seconds.
    pub write_s: f64,
}

/// The `failover` benchmark's report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FailoverReport {
    /// Every trial, in order.
    pub trials: Vec<FailoverTrial>,
    /// Median of `write_s`.
    pub median_s: f64,
    /// Largest `write_s`.
    pub max_s: f64,
    /// Lease TTL the replicas ran with, milliseconds.
    pub lease_ttl_ms: u64,
}

/// Three replicas on a real etcd and `hosts` daemons; `trials` times: SIGKILL the leader
/// and time the first write the fail-over client gets accepted (a prewarm onto a host
/// that already holds the model: a plan is created and stored), then restart the killed
/// replica as a follower.
pub async fn run_failover(opts: &FailoverOpts) -> anyhow::Result<FailoverReport> {
    use shardcast_protocol::controller::{PrewarmRequest, RegisterModelRequest};
    let origins = tempfile::Builder::new()
        .prefix("shardcast-failover-origin-")
        .tempdir()?;
    let model_dir = origins.path().join("model");
    std::fs::create_dir_all(&model_dir)?;
    crate::synth::generate(
        &model_dir,
        &crate::synth::SynthSpec {
            total_bytes: 4 << 20,
            shards: 1,
            seed: 7,
        },
    )?;
    let root = format!("file://{}/", origins.path().display());
    let allow = vec!["--origin-allow".to_string(), root.clone()];
    let mut ctl_args = allow.clone();
    ctl_args.extend(["--lease-ttl-ms".into(), opts.lease_ttl_ms.to_string()]);
    let mut c = HaCluster::start(3, opts.hosts, ctl_args, &[], |_, o| {
        o.extra_args.extend(allow.clone());
    })
    .await?;
    let mut api = c.client()?;
    api.register_model(RegisterModelRequest {
        name: "bench/failover".into(),
        origin: format!("file://{}", model_dir.display()),
        chunk_size: 1 << 20,
        via_host: String::new(),
        profile_json: String::new(),
        no_wait: false,
    })
    .await?;
    let write = || PrewarmRequest {
        model: "bench/failover".into(),
        hosts: vec!["host-1".into()],
        tier: shardcast_protocol::controller::Tier::Memory as i32,
        ..Default::default()
    };
    let first = api.prewarm(write()).await?.into_inner().plan_id;
    wait_plan(&mut api, &first, Duration::from_secs(60)).await?;
    let mut trials = Vec::new();
    for t in 0..opts.trials {
        let old = c.wait_leader(Duration::from_secs(30)).await?;
        // Hosts report to the leader before it is killed.
        c.wait_hosts_up(opts.hosts, Duration::from_secs(30)).await?;
        let t0 = Instant::now();
        c.controllers[old].kill().await;
        let deadline = t0 + Duration::from_secs(60);
        loop {
            match api.prewarm(write()).await {
                Ok(_) => break,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("trial {t}: write refused: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => bail!("trial {t}: no write accepted within 60 s: {e}"),
            }
        }
        let write_s = t0.elapsed().as_secs_f64();
        let new = c.leader().await;
        trials.push(FailoverTrial {
            killed: format!("ctl-{}", old + 1),
            new_leader: new.map(|i| format!("ctl-{}", i + 1)).unwrap_or_default(),
            write_s,
        });
        eprintln!(
            "trial {}/{}: killed ctl-{} → write accepted after {write_s:.2} s",
            t + 1,
            opts.trials,
            old + 1
        );
        c.controllers[old].restart().await?;
        wait_role(&c.controllers[old], "follower", Duration::from_secs(20)).await?;
    }
    let mut times: Vec<f64> = trials.iter().map(|t| t.write_s).collect();
    times.sort_by(f64::total_cmp);
    let median_s = match times.len() {
        0 => 0.0,
        n if n % 2 == 1 => times[n / 2],
        n => (times[n / 2 - 1] + times[n / 2]) / 2.0,
    };
    let max_s = times.last().copied().unwrap_or(0.0);
    Ok(FailoverReport {
        trials,
        median_s,
        max_s,
        lease_ttl_ms: opts.lease_ttl_ms,
    })
}

/// The index of the running replica among `controllers` that says it leads now, if one does.
pub async fn leader_of(controllers: &[ControllerProc]) -> Option<usize> {
    for (i, c) in controllers.iter().enumerate() {
        if c.pid().is_some() && role(c).await.as_deref() == Some("leader") {
            return Some(i);
        }
    }
    None
}

/// Waits (bounded by `timeout`) until one of `controllers` leads; its index.
pub async fn wait_leader_of(
    controllers: &[ControllerProc],
    timeout: Duration,
) -> anyhow::Result<usize> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(i) = leader_of(controllers).await {
            return Ok(i);
        }
        if Instant::now() >= deadline {
            bail!("no controller replica leads after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
