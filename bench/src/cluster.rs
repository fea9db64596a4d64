//! Real multi-process clusters of `transferd` daemons, on loopback or inside the
//! namespaces of an [`crate::netns::EmulatedNet`]. Used by `shardcast-bench` and by the
//! integration tests.
//!
//! Each daemon is a separate process with its own memory-tier and disk-tier directories.
//! The data plane uses TCP (127.0.0.x on loopback, the namespace address when emulated);
//! the agent API listens on a Unix socket in the daemon's directory, so the bench reaches
//! every daemon the same way whichever network namespace it runs in.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hyper_util::rt::TokioIo;
use std::sync::Arc;

use shardcast_identity::Role;

use crate::pki::ClusterPki;
use shardcast_protocol::agent::agent_client::AgentClient;
use shardcast_protocol::agent::{GetModelStatusRequest, GetStatsRequest, Stats};
use shardcast_protocol::{HostId, Manifest};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tonic::transport::{Channel, Endpoint, Uri};

/// How long a daemon may take to print its `READY` line.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the `transferd` binary is: `$SHARDCAST_TRANSFERD`, else found or built by
/// [`workspace_bin`].
pub fn transferd_bin() -> anyhow::Result<PathBuf> {
    workspace_bin("transferd", "transferd", "SHARDCAST_TRANSFERD")
}

/// Where binary `bin` of workspace package `package` is: `$env` if set. Otherwise, when this
/// program runs from the workspace's cargo build directory, the binary is (re)built once per
/// process with the same profile (a no-op when it is up to date), so tests and benches never
/// run a stale daemon left from an earlier build; if cargo cannot run, an existing binary
/// next to the running executable is used. Outside a build tree, the binary is looked up
/// next to the running executable.
pub fn workspace_bin(bin: &str, package: &str, env: &str) -> anyhow::Result<PathBuf> {
    static BUILT: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    if let Some(p) = std::env::var_os(env) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("locating the running executable")?;
    // target/<profile>/x or target/<profile>/deps/x
    let mut profile_dir = None;
    let mut existing = None;
    let mut dir = exe.parent().map(Path::to_path_buf);
    for _ in 0..2 {
        let Some(d) = dir else { break };
        if existing.is_none() && d.join(bin).is_file() {
            existing = Some(d.join(bin));
        }
        if profile_dir.is_none() && (d.ends_with("debug") || d.ends_with("release")) {
            profile_dir = Some(d.clone());
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .filter(|w| w.join("Cargo.toml").is_file());
    let (Some(profile_dir), Some(workspace)) = (profile_dir, workspace) else {
        return existing.with_context(|| {
            format!(
                "cannot find the {bin} binary next to {}; build it (cargo build --bins) or set {env}",
                exe.display()
            )
        });
    };
    let mut built = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, p)) = built.iter().find(|(b, _)| b == bin) {
        return Ok(p.clone());
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let release = profile_dir.ends_with("release");
    let mut cmd = std::process::Command::new(cargo);
    cmd.arg("build")
        .arg("--quiet")
        .arg("--manifest-path")
        .arg(workspace.join("Cargo.toml"))
        .stdin(std::process::Stdio::null());
    // `cargo test` / nextest give the test process the package's build-time environment
    // (CARGO_PKG_NAME, CARGO_MANIFEST_DIR, …). Build scripts (ring's, cc's) rerun when those
    // change, so passing them on would rebuild half the dependency tree per test package.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("CARGO_PKG_")
            || k.starts_with("CARGO_MANIFEST_")
            || k.starts_with("CARGO_CRATE_")
            || k.starts_with("CARGO_BIN_")
            || k.starts_with("CARGO_PRIMARY_")
            || k.starts_with("CARGO_TARGET_TMPDIR")
            || k.starts_with("NEXTEST")
            || k.starts_with("__NEXTEST")
            || k == "OUT_DIR"
        {
            cmd.env_remove(&*k);
        }
    }
    if exe.parent().is_some_and(|p| p.ends_with("deps")) {
        // A test binary: resolve features as the test build did (whole workspace,
        // dev-dependencies included), so this is a no-op after `cargo test` / `cargo
        // nextest run` instead of rebuilding the daemon with a different feature set (and
        // flipping it back on the next test build).
        cmd.args(["--workspace", "--tests", "--bin", bin]);
    } else {
        cmd.args(["-p", package, "--bin", bin]);
    }
    if release {
        cmd.arg("--release");
    }
    // A build with the `otlp` feature (the OTLP trace test) starts daemons that export.
    if cfg!(feature = "otlp") {
        cmd.args(["--features", "shardcast-bench/otlp"]);
    }
    let candidate = profile_dir.join(bin);
    match cmd.status() {
        Ok(status) if status.success() && candidate.is_file() => {}
        Ok(status) => bail!("building {bin} failed ({status}); build it with cargo build --bins"),
        Err(e) => {
            return existing.with_context(|| {
                format!("{bin} is not built and cargo cannot run ({e}); build it with cargo build --bins")
            });
        }
    }
    built.push((bin.to_string(), candidate.clone()));
    Ok(candidate)
}

/// Spawns `cmd` (stdout piped, stderr to `log`) and waits up to [`START_TIMEOUT`] for the
/// `READY …` line it prints once its listeners are up; returns the child and the rest of
/// that line. Stdout keeps being drained so the process never blocks on a full pipe. A
/// process that exits or stays silent is an error with the tail of its log.
pub(crate) async fn spawn_ready(
    mut cmd: Command,
    bin: &Path,
    what: &str,
    log: &Path,
) -> anyhow::Result<(tokio::process::Child, String)> {
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stdout = child.stdout.take().context("no stdout pipe")?;
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(START_TIMEOUT, async {
        while let Some(line) = lines.next_line().await? {
            if let Some(rest) = line.strip_prefix("READY ") {
                return Ok::<_, std::io::Error>(Some(rest.to_string()));
            }
        }
        Ok(None)
    })
    .await;
    let line = match ready {
        Ok(Ok(Some(line))) => line,
        Ok(Ok(None)) | Ok(Err(_)) => {
            let status = child.wait().await.ok();
            bail!(
                "{what} exited before it was ready ({status:?}); log: {}\n{}",
                log.display(),
                tail(log)
            );
        }
        Err(_) => bail!(
            "{what} not ready after {START_TIMEOUT:?}; log: {}",
            log.display()
        ),
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, line))
}

/// How to start one daemon.
#[derive(Debug, Clone)]
pub struct DaemonOpts {
    /// Host id.
    pub host_id: String,
    /// Address the data listener binds (port 0 picks one).
    pub data_ip: IpAddr,
    /// Egress cap, as transferd parses it (e.g. `1Gbit`), or `unlimited`.
    pub egress_rate: String,
    /// Ingress cap.
    pub ingress_rate: String,
    /// Extra `--flag value` arguments.
    pub extra_args: Vec<String>,
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// Run inside this network namespace (`ip netns exec`).
    pub netns: Option<String>,
    /// The cluster CA the daemon's certificate comes from (mutual TLS); `None` runs it with
    /// `insecure_plaintext` (loopback only).
    pub pki: Option<Arc<ClusterPki>>,
    /// Serve the agent API on this TCP address (e.g. `127.0.0.1:0`) instead of the Unix
    /// socket.
    pub agent_tcp: Option<String>,
    /// Serve the admin endpoint on this Unix socket instead of TCP on `data_ip`.
    pub admin_socket: Option<PathBuf>,
    /// Put the memory tier on a tmpfs of its own of this many bytes (mounted before the
    /// daemon starts, lazily unmounted when it is dropped; needs root), so that a test can
    /// fill its file system.
    pub memory_tmpfs: Option<u64>,
}

impl DaemonOpts {
    /// Gives the daemon `n` simulated GPUs of `memory` each (`--gpu-backend simulated`).
    pub fn sim_gpus(&mut self, n: u32, memory: &str) {
        self.extra_args.extend([
            "--gpu-backend".into(),
            "simulated".into(),
            "--sim-gpus".into(),
            n.to_string(),
            "--sim-gpu-memory".into(),
            memory.into(),
        ]);
    }

    /// A daemon on loopback with no caps.
    pub fn local(host_id: impl Into<String>) -> Self {
        Self {
            host_id: host_id.into(),
            data_ip: IpAddr::from([127, 0, 0, 1]),
            egress_rate: "unlimited".into(),
            ingress_rate: "unlimited".into(),
            extra_args: Vec::new(),
            env: Vec::new(),
            netns: None,
            pki: ClusterPki::shared().ok(),
            agent_tcp: None,
            admin_socket: None,
            memory_tmpfs: None,
        }
    }
}

/// A tmpfs mounted for a test, lazily unmounted (`umount -l`) when dropped: the mount
/// point is detached at once even while a killed daemon has not closed its files yet.
#[derive(Debug)]
pub struct TmpfsMount {
    path: PathBuf,
}

impl TmpfsMount {
    /// Mounts a tmpfs of `bytes` at `path` (an existing, empty directory), mode 0700.
    pub fn mount(path: &Path, bytes: u64) -> anyhow::Result<Self> {
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={bytes},mode=0700"))
            .arg("tmpfs")
            .arg(path)
            .output()
            .context("running mount")?;
        if !out.status.success() {
            bail!(
                "mounting a tmpfs at {}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
        })
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this process can mount a tmpfs (root, a `mount` binary): `Ok`, or the reason
    /// for a test to print as it skips. Tried once per process.
    pub fn available() -> Result<(), crate::netns::Unavailable> {
        use crate::netns::Unavailable;
        static RESULT: std::sync::OnceLock<Result<(), Unavailable>> = std::sync::OnceLock::new();
        RESULT
            .get_or_init(|| {
                let dir = tempfile::tempdir()
                    .map_err(|e| Unavailable::Tmpfs(format!("a probe directory: {e}")))?;
                Self::mount(dir.path(), 1 << 20).map(drop).map_err(|e| {
                    Unavailable::Tmpfs(format!("cannot mount a tmpfs here (needs root): {e:#}"))
                })
            })
            .clone()
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.path)
            .status();
    }
}

/// A running `transferd` process. Killed (by PID) when dropped.
pub struct Daemon {
    /// Its host id.
    pub host_id: HostId,
    /// Its data-plane address.
    pub data_addr: SocketAddr,
    /// Its admin HTTP address (`/metrics`, `/v1/handoff/…`; HTTPS with a CA), unless it
    /// serves the admin endpoint on [`DaemonOpts::admin_socket`].
    pub admin_addr: SocketAddr,
    /// Its agent API Unix socket.
    pub agent_socket: PathBuf,
    /// Its agent API address as the READY line gave it (`unix:…` or `host:port`).
    pub agent_addr: String,
    /// Its memory-tier directory.
    pub memory_dir: PathBuf,
    /// Its disk-tier directory.
    pub disk_dir: PathBuf,
    /// Its log file (stderr).
    pub log: PathBuf,
    /// The tmpfs under its memory tier, when [`DaemonOpts::memory_tmpfs`] asked for one
    /// (unmounted after `Drop` has killed the process).
    tmpfs: Option<TmpfsMount>,
    opts: DaemonOpts,
    root: PathBuf,
    child: Option<Child>,
}

impl Daemon {
    /// Starts a daemon whose state lives under `root` (memory tier in `root/mem`, disk tier
    /// in `root/disk`), and waits until it is ready.
    pub async fn start(root: &Path, opts: DaemonOpts) -> anyhow::Result<Self> {
        let memory_dir = root.join("mem");
        let disk_dir = root.join("disk");
        std::fs::create_dir_all(&memory_dir)
            .with_context(|| format!("creating {}", memory_dir.display()))?;
        std::fs::create_dir_all(&disk_dir)
            .with_context(|| format!("creating {}", disk_dir.display()))?;
        let tmpfs = match opts.memory_tmpfs {
            Some(bytes) => Some(TmpfsMount::mount(&memory_dir, bytes)?),
            None => None,
        };
        let host_id = HostId::new(&opts.host_id)?;
        let mut d = Self {
            host_id,
            data_addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            admin_addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            agent_socket: root.join("agent.sock"),
            agent_addr: String::new(),
            memory_dir,
            disk_dir,
            log: root.join("transferd.log"),
            tmpfs,
            opts,
            root: root.to_path_buf(),
            child: None,
        };
        d.spawn(0).await?;
        Ok(d)
    }

    async fn spawn(&mut self, port: u16) -> anyhow::Result<()> {
        let bin = transferd_bin()?;
        let _ = std::fs::remove_file(&self.agent_socket);
        let mut cmd = match &self.opts.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        cmd.arg("--host-id")
            .arg(self.host_id.as_str())
            .arg("--listen")
            .arg(SocketAddr::new(self.opts.data_ip, port).to_string())
            .arg("--agent-listen")
            .arg(match &self.opts.agent_tcp {
                Some(a) => a.clone(),
                None => format!("unix:{}", self.agent_socket.display()),
            })
            .arg("--admin-listen")
            .arg(match &self.opts.admin_socket {
                Some(p) => format!("unix:{}", p.display()),
                None => SocketAddr::new(self.opts.data_ip, 0).to_string(),
            })
            .arg("--memory-dir")
            .arg(&self.memory_dir)
            .arg("--data-dir")
            .arg(&self.disk_dir)
            .arg("--egress-rate")
            .arg(&self.opts.egress_rate)
            .arg("--ingress-rate")
            .arg(&self.opts.ingress_rate)
            .args(match &self.opts.pki {
                Some(pki) => pki.args(Role::Host, self.host_id.as_str())?,
                None => vec!["--insecure-plaintext".into(), "true".into()],
            })
            .args(&self.opts.extra_args)
            // One stripe unless a flag (`--stripes`) or `env` says otherwise: transferd's
            // default (`auto`) depends on the machine's cores, and a test or bench should
            // behave the same on any machine.
            .env("SHARDCAST_STRIPES", "1")
            .envs(self.opts.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        let what = format!("transferd {}", self.host_id);
        let (child, line) = spawn_ready(cmd, &bin, &what, &self.log).await?;
        let data = line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("data="))
            .context("READY line without data=")?;
        self.data_addr = data
            .parse()
            .with_context(|| format!("bad data address in READY line {line:?}"))?;
        if let Some(agent) = line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("agent="))
        {
            self.agent_addr = agent.to_string();
        }
        if let Some(admin) = line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("admin="))
            .filter(|a| !a.starts_with("unix:"))
        {
            self.admin_addr = admin
                .parse()
                .with_context(|| format!("bad admin address in READY line {line:?}"))?;
        }
        self.child = Some(child);
        Ok(())
    }

    /// The process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// The memory-tier file of shard `shard` of `manifest` on this daemon.
    pub fn memory_shard_path(&self, manifest: &Manifest, shard: usize) -> PathBuf {
        self.memory_dir
            .join("models")
            .join(manifest.digest().to_hex())
            .join(manifest.shards[shard].path.as_str())
    }

    /// The tmpfs mounted for its memory tier ([`DaemonOpts::memory_tmpfs`]).
    pub fn memory_tmpfs(&self) -> Option<&Path> {
        self.tmpfs.as_ref().map(TmpfsMount::path)
    }

    /// Bytes the memory tier really occupies (allocated blocks of every file under it,
    /// models, recovery state and staging alike): what an evict of every model must bring
    /// to 0.
    pub fn memory_tier_bytes(&self) -> anyhow::Result<u64> {
        allocated_bytes(&self.memory_dir)
    }

    /// Sends `signal` (`"STOP"`, `"CONT"`, …) to the process, by PID: a host that is alive
    /// but silent, and back.
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self.pid().context("the daemon is not running")?;
        let ok = std::process::Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .context("running kill")?
            .success();
        anyhow::ensure!(ok, "kill -{signal} {pid} failed");
        Ok(())
    }

    /// Stops the process as an operator would (SIGTERM, by PID) and waits up to `grace`
    /// for it to exit; SIGKILL after that. True when it exited on its own.
    pub async fn terminate(&mut self, grace: Duration) -> anyhow::Result<bool> {
        if self.child.is_none() {
            return Ok(true);
        }
        self.signal("TERM")?;
        let exited = match self.child.as_mut() {
            Some(child) => tokio::time::timeout(grace, child.wait()).await.is_ok(),
            None => true,
        };
        self.kill().await;
        Ok(exited)
    }

    /// Waits up to `grace` for the process to exit on its own (after a signal sent with
    /// [`Self::signal`]): its exit status, or `None` while it still runs.
    pub async fn wait_exit(
        &mut self,
        grace: Duration,
    ) -> anyhow::Result<Option<std::process::ExitStatus>> {
        let Some(child) = self.child.as_mut() else {
            bail!("the daemon is not running");
        };
        match tokio::time::timeout(grace, child.wait()).await {
            Ok(status) => {
                let status = status.context("waiting for the daemon")?;
                self.child = None;
                Ok(Some(status))
            }
            Err(_) => Ok(None),
        }
    }

    /// Kills the process (SIGKILL, by PID) and waits for it: a host dying mid-transfer.
    pub async fn kill(&mut self) {
        kill_child(&mut self.child).await;
    }

    /// Starts the daemon again on the same data port and directories (its store recovers).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill().await;
        let port = self.data_addr.port();
        // The port may sit in TIME_WAIT for a moment; SO_REUSEADDR in tokio lets us rebind.
        let mut last = None;
        for _ in 0..50 {
            match self.spawn(port).await {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("restart failed")))
    }

    /// Signs a `StartChain` this daemon heads with the harness CA's controller key (the
    /// hops accept only sessions the controller signed), naming `holders` too (the daemons
    /// a `shardcast://` fallback may point at); a no-op without a CA.
    pub fn sign_chain(
        &self,
        req: &mut shardcast_protocol::agent::StartChainRequest,
        holders: &[&Self],
    ) -> anyhow::Result<()> {
        match &self.opts.pki {
            Some(pki) => {
                let holders: Vec<_> = holders.iter().map(|d| d.plan_host()).collect();
                pki.sign_chain(req, &self.plan_host(), &holders)
            }
            None => Ok(()),
        }
    }

    /// Re-issues this daemon's host certificate (a new key, the same identity, from the
    /// harness CA) into its TLS files and tells it with `SIGHUP`, as an operator rotating a
    /// certificate would (`shardcast certs rotate`). Established sessions keep their keys;
    /// new connections present the new certificate.
    pub fn rotate_certificate(&self) -> anyhow::Result<()> {
        let pki = self
            .opts
            .pki
            .as_ref()
            .context("the daemon runs without TLS: nothing to rotate")?;
        let files = pki.files(Role::Host, self.host_id.as_str())?;
        pki.pki().rotate(
            &shardcast_identity::pki::CertFiles {
                cert: files.cert,
                key: files.key,
            },
            shardcast_identity::pki::DEFAULT_LEAF_VALIDITY,
        )?;
        self.signal("HUP")
    }

    /// This daemon as a plan token names it: its host id and data address.
    pub fn plan_host(&self) -> shardcast_protocol::Hop {
        shardcast_protocol::Hop {
            host: self.host_id.clone(),
            addr: self.data_addr.to_string(),
        }
    }

    /// One request to the admin endpoint as `who` (over its Unix socket when it has one);
    /// the status and the body.
    pub async fn admin(
        &self,
        who: crate::control::HttpAs,
        method: &str,
        path: &str,
    ) -> anyhow::Result<(u16, String)> {
        use crate::control::{HttpTarget, http_call};
        let target = match &self.opts.admin_socket {
            Some(p) => HttpTarget::Unix(p),
            None => HttpTarget::Tcp(self.admin_addr),
        };
        let server = (
            self.opts.pki.as_deref(),
            shardcast_identity::Expect::Exactly(shardcast_identity::Identity::new(
                Role::Host,
                self.host_id.as_str(),
            )?),
        );
        http_call(target, server, &who, method, path, "").await
    }

    /// The admin endpoint's `/metrics` page, read with a `read` certificate (parse it with
    /// [`metric_value`]).
    pub async fn metrics(&self) -> anyhow::Result<String> {
        let (status, body) = self
            .admin(crate::control::HttpAs::Cert(Role::Read), "GET", "/metrics")
            .await?;
        if status != 200 {
            bail!("{} /metrics answered {status}: {body}", self.host_id);
        }
        Ok(body)
    }

    /// `--admin` and `--tls-ca/--tls-cert/--tls-key` flags for `examples/python/handoff.py`
    /// with a `read` certificate (or `--unix` for a socket).
    pub fn handoff_py_args(&self) -> anyhow::Result<Vec<String>> {
        if let Some(p) = &self.opts.admin_socket {
            return Ok(vec!["--unix".into(), p.display().to_string()]);
        }
        Ok(match &self.opts.pki {
            Some(pki) => [
                vec!["--admin".into(), format!("https://{}", self.admin_addr)],
                pki.args(Role::Read, "test-read")?,
            ]
            .concat(),
            None => vec!["--admin".into(), format!("http://{}", self.admin_addr)],
        })
    }

    /// An agent API client.
    pub async fn agent(&self) -> anyhow::Result<AgentClient<Channel>> {
        let path = self.agent_socket.clone();
        let channel = Endpoint::try_from("http://agent.local")?
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(
                        tokio::net::UnixStream::connect(path).await?,
                    ))
                }
            }))
            .await
            .with_context(|| {
                format!(
                    "connecting to the agent of {} at {}",
                    self.host_id,
                    self.agent_socket.display()
                )
            })?;
        Ok(AgentClient::new(channel)
            .max_decoding_message_size(128 << 20)
            .max_encoding_message_size(128 << 20))
    }

    /// This daemon as a chain hop.
    pub fn hop(&self) -> shardcast_protocol::agent::Hop {
        shardcast_protocol::agent::Hop {
            host_id: self.host_id.to_string(),
            addr: self.data_addr.to_string(),
        }
    }

    /// Data-plane counters.
    pub async fn stats(&self) -> anyhow::Result<Stats> {
        Ok(self
            .agent()
            .await?
            .get_stats(GetStatsRequest {})
            .await?
            .into_inner())
    }

    /// Verified bytes and whether the model is complete here (any tier).
    pub async fn model_progress(
        &self,
        client: &mut AgentClient<Channel>,
        digest: &str,
    ) -> anyhow::Result<(u64, bool)> {
        match client
            .get_model_status(GetModelStatusRequest {
                model: digest.to_string(),
            })
            .await
        {
            Ok(r) => {
                let tiers = r.into_inner().tiers;
                let best = tiers.iter().max_by_key(|t| t.bytes_verified);
                Ok(best
                    .map(|t| (t.bytes_verified, t.complete))
                    .unwrap_or((0, false)))
            }
            Err(s) if s.code() == tonic::Code::NotFound => Ok((0, false)),
            Err(s) => Err(s.into()),
        }
    }

    /// Checks that every shard file this daemon holds for `manifest` hashes to the
    /// manifest's whole-shard BLAKE3 (byte-exact copy). Returns the tier directory checked.
    pub fn verify_copy(&self, manifest: &Manifest) -> anyhow::Result<PathBuf> {
        let digest = manifest.digest().to_hex();
        for tier_root in [&self.memory_dir, &self.disk_dir] {
            let dir = tier_root.join("models").join(&digest);
            if !dir.is_dir() {
                continue;
            }
            for shard in &manifest.shards {
                let path = dir.join(shard.path.as_str());
                let got = hash_file(&path)?;
                if got != shard.hash.0 {
                    bail!(
                        "{}: {} differs from the origin (BLAKE3 mismatch)",
                        self.host_id,
                        path.display()
                    );
                }
            }
            return Ok(dir);
        }
        bail!("{} holds no copy of model {digest}", self.host_id)
    }

    /// Where this daemon keeps its state.
    pub fn root(&self) -> &Path {
        &self.root
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
    }
}

/// The value of `host`'s metric `shardcast_<name>` in a `/metrics` text. `name` may carry
/// labels after the host's: `admin_denied_total{role="host"}`.
pub fn metric_value(text: &str, host: &HostId, name: &str) -> Option<u64> {
    let (family, labels) = match name.split_once('{') {
        Some((f, l)) => (f, format!(",{}", l.trim_end_matches('}'))),
        None => (name, String::new()),
    };
    let prefix = format!("shardcast_{family}{{host=\"{host}\"{labels}}}");
    text.lines()
        .find(|l| l.starts_with(&prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.trim().parse().ok())
}

/// SIGKILLs the process in `child` (by its PID) and reaps it; nothing when it is not
/// running.
pub async fn kill_child(child: &mut Option<tokio::process::Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.start_kill();
        let _ = c.wait().await;
    }
}

/// Bytes allocated to the regular files under `dir` (their blocks, not their lengths: a
/// sparse partial copy counts what it holds), symlinks not followed.
pub fn allocated_bytes(dir: &Path) -> anyhow::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("listing {}", d.display())),
        };
        for e in entries {
            let e = e.with_context(|| format!("listing {}", d.display()))?;
            let md = e.metadata()?;
            if md.is_dir() {
                todo.push(e.path());
            } else if md.is_file() {
                total += md.blocks() * 512;
            }
        }
    }
    Ok(total)
}

/// BLAKE3 of a whole file, read in 4 MiB pieces.
pub fn hash_file(path: &Path) -> anyhow::Result<[u8; 32]> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 4 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(*h.finalize().as_bytes())
}

/// The last 20 lines of a log file.
pub fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Polls `daemons` until each holds a complete copy of `digest`, returning each one's
/// completion time measured from `since` (None for those not done by `timeout`).
/// `on_progress(total verified bytes)` is called on every poll.
pub async fn wait_complete(
    daemons: &[&Daemon],
    digest: &str,
    since: Instant,
    timeout: Duration,
    on_progress: impl FnMut(u64),
) -> anyhow::Result<Vec<Option<f64>>> {
    let t = wait_complete_timed(daemons, digest, since, timeout, on_progress).await?;
    Ok(t.into_iter().map(|r| r.done_s).collect())
}

/// When one daemon's verified bytes of a model passed each mark, in seconds from the start
/// (to the status message that first showed it: see [`wait_complete_timed`]).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ProgressMarks {
    /// First verified bytes seen.
    pub first_s: Option<f64>,
    /// Half the model verified.
    pub half_s: Option<f64>,
    /// A complete copy.
    pub done_s: Option<f64>,
}

/// [`wait_complete`] with each daemon's [`ProgressMarks`]: from them a chain's per-hop lag
/// (first bytes) and each hop's steady rate (half to done) can be told apart.
///
/// Each daemon is watched through one `WatchModelStatus` stream rather than polled: the
/// daemon looks every 20 ms and sends completion at once and byte progress at most every
/// 250 ms, so the first and half marks are within about 250 ms and completion within about
/// 20 ms. (Polling all of them every 20 ms had every daemon answering 50 calls a second on
/// the cores the transfer runs on.)
pub async fn wait_complete_timed(
    daemons: &[&Daemon],
    digest: &str,
    since: Instant,
    timeout: Duration,
    mut on_progress: impl FnMut(u64),
) -> anyhow::Result<Vec<ProgressMarks>> {
    use futures::StreamExt as _;
    let deadline = since + timeout;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, u64, bool, u64, f64)>();
    let mut watchers = tokio::task::JoinSet::new();
    for (i, d) in daemons.iter().enumerate() {
        let mut client = d.agent().await?;
        let (tx, digest) = (tx.clone(), digest.to_string());
        watchers.spawn(async move {
            let mut stream = client
                .watch_model_status(GetModelStatusRequest { model: digest })
                .await?
                .into_inner();
            while let Some(status) = stream.next().await {
                let at = since.elapsed().as_secs_f64();
                let tiers = status?.tiers;
                let (bytes, complete, of) = tiers
                    .iter()
                    .max_by_key(|t| t.bytes_verified)
                    .map_or((0, false, 0), |t| {
                        (t.bytes_verified, t.complete, t.total_bytes)
                    });
                if tx.send((i, bytes, complete, of, at)).is_err() || complete {
                    break;
                }
            }
            anyhow::Ok(())
        });
    }
    drop(tx);
    let mut marks = vec![ProgressMarks::default(); daemons.len()];
    let mut bytes = vec![0u64; daemons.len()];
    while marks.iter().any(|m| m.done_s.is_none()) {
        let Ok(got) = tokio::time::timeout_at(deadline.into(), rx.recv()).await else {
            break;
        };
        let Some((i, b, complete, of, at)) = got else {
            // Every stream ended: a watcher failed (its error is below) or the daemon went.
            break;
        };
        bytes[i] = b;
        let m = &mut marks[i];
        if b > 0 && m.first_s.is_none() {
            m.first_s = Some(at);
        }
        if of > 0 && b >= of / 2 && m.half_s.is_none() {
            m.half_s = Some(at);
        }
        if complete && m.done_s.is_none() {
            m.done_s = Some(at);
        }
        on_progress(bytes.iter().sum());
    }
    watchers.abort_all();
    while let Some(r) = watchers.join_next().await {
        if let Ok(Err(e)) = r {
            if marks.iter().any(|m| m.done_s.is_none()) {
                return Err(e.context("watching a daemon's model status"));
            }
        }
    }
    Ok(marks)
}

/// Flips one byte of a file in place, at `at` (a rotten DRAM bit, or a write behind the
/// daemon's back; a daemon maps the same page).
pub fn flip_byte(path: &Path, at: u64) -> anyhow::Result<()> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let mut b = [0u8];
    f.read_exact_at(&mut b, at)?;
    f.write_all_at(&[b[0] ^ 0x01], at)?;
    Ok(())
}
