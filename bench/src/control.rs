//! A real `shardcast-controller` process with `transferd` daemons that heartbeat to it: the
//! managed cluster behind `demo`, `cold-start` and the controller integration tests.
//!
//! The controller serves gRPC on loopback TCP and on a Unix socket in its directory; the
//! daemons report to the Unix socket, so the same cluster works whether the daemons run on
//! loopback or inside emulated network namespaces.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use shardcast_protocol::controller::controller_client::ControllerClient;
use shardcast_protocol::controller::{ListHostsRequest, PlanState, PlanStatus, WatchPlanRequest};

use tokio::process::{Child, Command};
use tonic::transport::Channel;

use std::sync::Arc;

use shardcast_identity::grpc::ClientSecurity;
use shardcast_identity::{Alpn, Expect, Role};

use crate::cluster::{Daemon, DaemonOpts, workspace_bin};
use crate::pki::ClusterPki;

/// Heartbeat period used in managed clusters (fast, so a dead host is noticed in under a
/// second).
pub const HEARTBEAT_MS: u64 = 200;

/// Where the `shardcast-controller` binary is (`$SHARDCAST_CONTROLLER_BIN` overrides).
pub fn controller_bin() -> anyhow::Result<PathBuf> {
    workspace_bin(
        "shardcast-controller",
        "shardcast-controller",
        "SHARDCAST_CONTROLLER_BIN",
    )
}

/// Where the `shardcast` CLI binary is (`$SHARDCAST_CLI_BIN` overrides).
pub fn cli_bin() -> anyhow::Result<PathBuf> {
    workspace_bin("shardcast", "shardcast-cli", "SHARDCAST_CLI_BIN")
}

/// A running controller process. Killed (by PID) when dropped.
pub struct ControllerProc {
    /// gRPC address on loopback.
    pub grpc: SocketAddr,
    /// HTTP/JSON address on loopback.
    pub http: SocketAddr,
    /// gRPC Unix socket.
    pub unix: PathBuf,
    /// State directory (survives restarts).
    pub state_dir: PathBuf,
    /// Log file.
    pub log: PathBuf,
    extra: Vec<String>,
    heartbeat_ms: u64,
    child: Option<Child>,
    /// The cluster CA (mutual TLS on the TCP listeners); `None`: insecure plaintext.
    pub pki: Option<Arc<ClusterPki>>,
}

/// How a test or benchmark presents itself to the controller's HTTP API.
#[derive(Debug, Clone)]
pub enum HttpAs {
    /// A client certificate with this role.
    Cert(Role),
    /// No certificate, this bearer token.
    Token(String),
    /// TLS without a certificate or token.
    Anonymous,
    /// No TLS at all (a plaintext client against a TLS listener).
    Plaintext,
}

impl ControllerProc {
    /// Starts a controller whose state and socket live under `root`, with extra flags.
    pub async fn start(root: &Path, extra: Vec<String>) -> anyhow::Result<Self> {
        Self::start_with_heartbeat(root, extra, HEARTBEAT_MS).await
    }

    /// [`Self::start`] with another `--heartbeat-ms` (the scale benchmark runs the
    /// production default, 1000, with a thousand simulated hosts).
    pub async fn start_with_heartbeat(
        root: &Path,
        extra: Vec<String>,
        heartbeat_ms: u64,
    ) -> anyhow::Result<Self> {
        Self::start_on(root, extra, heartbeat_ms, ClusterPki::shared()?).await
    }

    /// [`Self::start`] under another cluster CA than the process's shared one (its
    /// controller certificate issued as the test wants, e.g. near its end).
    pub async fn start_with_pki(
        root: &Path,
        extra: Vec<String>,
        pki: Arc<ClusterPki>,
    ) -> anyhow::Result<Self> {
        Self::start_on(root, extra, HEARTBEAT_MS, pki).await
    }

    async fn start_on(
        root: &Path,
        extra: Vec<String>,
        heartbeat_ms: u64,
        pki: Arc<ClusterPki>,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
        let mut c = Self {
            grpc: SocketAddr::from(([127, 0, 0, 1], 0)),
            http: SocketAddr::from(([127, 0, 0, 1], 0)),
            unix: root.join("controller.sock"),
            state_dir: root.join("state"),
            log: root.join("controller.log"),
            extra,
            heartbeat_ms,
            child: None,
            pki: Some(pki),
        };
        c.spawn().await?;
        Ok(c)
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let bin = controller_bin()?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let mut cmd = Command::new(&bin);
        cmd.arg("--listen")
            .arg(self.grpc.to_string())
            .arg("--http-listen")
            .arg(self.http.to_string())
            .arg("--unix")
            .arg(&self.unix)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--heartbeat-ms")
            .arg(self.heartbeat_ms.to_string())
            .args(match &self.pki {
                Some(pki) => pki.args(Role::Controller, "controller")?,
                None => vec!["--insecure-plaintext".into()],
            })
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        let (child, line) =
            crate::cluster::spawn_ready(cmd, &bin, "shardcast-controller", &self.log).await?;
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(k))
                .with_context(|| format!("READY line {line:?} lacks {k}"))
        };
        self.grpc = field("grpc=")?.parse()?;
        self.http = field("http=")?.parse()?;
        self.child = Some(child);
        Ok(())
    }

    /// The process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// SIGKILL (by PID) and wait: a controller crash.
    pub async fn kill(&mut self) {
        crate::cluster::kill_child(&mut self.child).await;
    }

    /// Starts it again on the same ports and state.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill().await;
        let mut last = None;
        for _ in 0..50 {
            match self.spawn().await {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("restart failed")))
    }

    /// The address daemons heartbeat to.
    pub fn inventory_addr(&self) -> String {
        format!("unix:{}", self.unix.display())
    }

    /// A gRPC client (over loopback TCP) with an admin certificate.
    pub async fn client(&self) -> anyhow::Result<ControllerClient<Channel>> {
        self.client_as(Some(Role::Admin)).await
    }

    /// A gRPC client with a certificate of `role` (`None`: no TLS at all).
    pub async fn client_as(&self, role: Option<Role>) -> anyhow::Result<ControllerClient<Channel>> {
        let security = match (&self.pki, role) {
            (Some(pki), Some(role)) => {
                ClientSecurity::Tls(pki.client(role)?, Expect::Role(Role::Controller))
            }
            _ => ClientSecurity::Plaintext,
        };
        let ch = shardcast_identity::grpc::connect(&self.grpc.to_string(), security).await?;
        Ok(ControllerClient::new(ch)
            .max_decoding_message_size(128 << 20)
            .max_encoding_message_size(128 << 20))
    }

    /// Flags for the `shardcast` CLI: this controller's address and an admin certificate.
    pub fn cli_args(&self) -> anyhow::Result<Vec<String>> {
        let mut args = vec!["--controller".to_string(), self.grpc.to_string()];
        match &self.pki {
            Some(pki) => {
                let f = pki.files(Role::Admin, "test-admin")?;
                for (flag, path) in [
                    ("--tls-ca", f.ca),
                    ("--tls-cert", f.cert),
                    ("--tls-key", f.key),
                ] {
                    args.push(flag.into());
                    args.push(path.display().to_string());
                }
            }
            None => args.push("--insecure-plaintext".into()),
        }
        Ok(args)
    }

    /// One HTTP/1.1 request to the JSON API as `who`; the status and the body.
    pub async fn http(
        &self,
        who: HttpAs,
        method: &str,
        path: &str,
        body: &str,
    ) -> anyhow::Result<(u16, String)> {
        let server = (self.pki.as_deref(), Expect::Role(Role::Controller));
        http_call(HttpTarget::Tcp(self.http), server, &who, method, path, body).await
    }

    /// Base URL of the HTTP API.
    pub fn http_url(&self) -> String {
        format!("http://{}", self.http)
    }
}

/// Where an HTTP API listens.
#[derive(Debug, Clone, Copy)]
pub enum HttpTarget<'a> {
    /// A TCP address: HTTPS when the server has a CA, unless the caller is
    /// [`HttpAs::Plaintext`].
    Tcp(SocketAddr),
    /// A Unix socket: plain HTTP, the peer known by its uid.
    Unix(&'a Path),
}

/// An HTTP connection to `target`: TLS as `who` when `server` names a CA (checking that
/// the server is `server.1`), else plain.
pub async fn http_connect(
    target: HttpTarget<'_>,
    server: (Option<&ClusterPki>, Expect),
    who: &HttpAs,
) -> anyhow::Result<Box<dyn shardcast_identity::grpc::Io>> {
    let tcp = match target {
        HttpTarget::Unix(path) => {
            return Ok(Box::new(tokio::net::UnixStream::connect(path).await?));
        }
        HttpTarget::Tcp(addr) => tokio::net::TcpStream::connect(addr).await?,
    };
    let (pki, expect) = server;
    Ok(match (who, pki) {
        (HttpAs::Plaintext, _) | (_, None) => Box::new(tcp),
        (HttpAs::Cert(role), Some(pki)) => Box::new(
            pki.client(*role)?
                .connect(tcp, Alpn::Http, &expect)
                .await?
                .0,
        ),
        (HttpAs::Token(_) | HttpAs::Anonymous, Some(pki)) => Box::new(
            pki.client(Role::Read)?
                .connect_http_without_cert(tcp, &expect)
                .await?
                .0,
        ),
    })
}

/// One HTTP/1.1 request (`Connection: close`) to `target` as `who`; the status and the
/// body. A server that closes without answering (a refused plaintext client) reads as
/// status 0.
pub async fn http_call(
    target: HttpTarget<'_>,
    server: (Option<&ClusterPki>, Expect),
    who: &HttpAs,
    method: &str,
    path: &str,
    body: &str,
) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = http_connect(target, server, who).await?;
    let auth = match who {
        HttpAs::Token(t) => format!("Authorization: Bearer {t}\r\n"),
        _ => String::new(),
    };
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: shardcast\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut raw)).await;
    let out = String::from_utf8_lossy(&raw);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

impl Drop for ControllerProc {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
    }
}

/// Flags that make a daemon report to `controller`.
pub fn managed_args(controller: &ControllerProc, rack: &str) -> Vec<String> {
    let mut v = vec![
        "--controller".into(),
        controller.inventory_addr(),
        "--heartbeat-ms".into(),
        HEARTBEAT_MS.to_string(),
    ];
    if !rack.is_empty() {
        v.extend(["--rack".into(), rack.into()]);
    }
    v
}

/// A controller and daemons reporting to it.
pub struct ManagedCluster {
    /// The controller.
    pub controller: ControllerProc,
    /// The daemons, `host-1` … `host-N`.
    pub daemons: Vec<Daemon>,
    /// Scratch directory holding everything.
    pub scratch: tempfile::TempDir,
}

impl ManagedCluster {
    /// Starts a controller (with `ctl_args`) and `n` daemons on loopback; `opts(i, o)`
    /// adjusts daemon `i` (0-based). Waits until every daemon has registered.
    pub async fn start(
        n: usize,
        ctl_args: Vec<String>,
        mut opts: impl FnMut(usize, &mut DaemonOpts),
    ) -> anyhow::Result<Self> {
        let scratch = tempfile::Builder::new()
            .prefix("shardcast-managed-")
            .tempdir()
            .context("scratch dir")?;
        let controller =
            ControllerProc::start(&scratch.path().join("controller"), ctl_args).await?;
        let mut daemons = Vec::new();
        for i in 0..n {
            let name = format!("host-{}", i + 1);
            let mut o = DaemonOpts::local(name.clone());
            o.extra_args.extend(managed_args(&controller, ""));
            o.extra_args.extend([
                "--upstream-grace-ms".into(),
                "500".into(),
                "--idle-timeout-s".into(),
                "5".into(),
            ]);
            opts(i, &mut o);
            daemons.push(Daemon::start(&scratch.path().join(&name), o).await?);
        }
        let c = Self {
            controller,
            daemons,
            scratch,
        };
        c.wait_hosts_up(n, Duration::from_secs(20)).await?;
        Ok(c)
    }

    /// Waits until at least `n` hosts are up in the controller's inventory.
    pub async fn wait_hosts_up(&self, n: usize, timeout: Duration) -> anyhow::Result<()> {
        wait_hosts_up(&self.controller, n, timeout).await
    }

    /// Daemon by host id.
    pub fn daemon(&self, host: &str) -> anyhow::Result<&Daemon> {
        self.daemons
            .iter()
            .find(|d| d.host_id.as_str() == host)
            .with_context(|| format!("no daemon {host}"))
    }

    /// Daemon by host id, to kill or restart it.
    pub fn daemon_mut(&mut self, host: &str) -> anyhow::Result<&mut Daemon> {
        self.daemons
            .iter_mut()
            .find(|d| d.host_id.as_str() == host)
            .with_context(|| format!("no daemon {host}"))
    }
}

/// Waits until at least `n` hosts are up in `controller`'s inventory.
pub async fn wait_hosts_up(
    controller: &ControllerProc,
    n: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let up = match controller.client().await {
            Ok(mut c) => c
                .list_hosts(ListHostsRequest {})
                .await
                .map(|r| r.into_inner().hosts.iter().filter(|h| h.up).count())
                .unwrap_or(0),
            Err(_) => 0,
        };
        if up >= n {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("only {up} of {n} hosts registered with the controller within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The hosts that hold `model` complete in their memory tier, as the controller sees them.
pub async fn memory_holders(
    api: &mut ControllerClient<Channel>,
    model: &str,
) -> anyhow::Result<Vec<String>> {
    Ok(api
        .get_status(shardcast_protocol::controller::GetStatusRequest {
            model: model.into(),
        })
        .await
        .context("GetStatus")?
        .into_inner()
        .hosts
        .into_iter()
        .filter(|h| h.memory)
        .map(|h| h.host)
        .collect())
}

/// A channel a controller client can run over: a plain [`Channel`] or the fail-over one
/// (`shardcast_identity::failover::FailoverChannel`), so the helpers here serve both.
pub trait ApiChannel:
    tonic::client::GrpcService<
        tonic::body::Body,
        Error: Into<tonic::codegen::StdError>,
        ResponseBody: tonic::codegen::Body<
            Data = bytes::Bytes,
            Error: Into<tonic::codegen::StdError> + Send,
        > + Send
                          + 'static,
    >
{
}

impl<T> ApiChannel for T where
    T: tonic::client::GrpcService<
            tonic::body::Body,
            Error: Into<tonic::codegen::StdError>,
            ResponseBody: tonic::codegen::Body<
                Data = bytes::Bytes,
                Error: Into<tonic::codegen::StdError> + Send,
            > + Send
                              + 'static,
        >
{
}

/// Polls a plan until it has ended (or `timeout`), returning its final status. A failed
/// poll (a controller restarting, a leader changing) is retried until the deadline.
pub async fn wait_plan<T: ApiChannel>(
    client: &mut ControllerClient<T>,
    plan: &str,
    timeout: Duration,
) -> anyhow::Result<PlanStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        let s = client
            .get_plan(WatchPlanRequest {
                plan_id: plan.to_string(),
            })
            .await;
        match s {
            Ok(s) => {
                let s = s.into_inner();
                if s.state() != PlanState::Running {
                    return Ok(s);
                }
                if Instant::now() >= deadline {
                    bail!(
                        "plan {plan} still running after {timeout:?}: {:?}",
                        s.hosts
                            .iter()
                            .map(|h| format!(
                                "{}={}({}/{})",
                                h.host,
                                h.state().label(),
                                h.bytes,
                                h.total
                            ))
                            .collect::<Vec<_>>()
                    );
                }
            }
            Err(e) if Instant::now() >= deadline => bail!("plan {plan}: {e}"),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A plan's status now; panics when the controller does not answer (a test helper).
pub async fn plan_status<T: ApiChannel>(api: &mut ControllerClient<T>, plan: &str) -> PlanStatus {
    api.get_plan(WatchPlanRequest {
        plan_id: plan.into(),
    })
    .await
    .expect("GetPlan")
    .into_inner()
}

/// Waits until `plan`, still running, has moved at least `at_least` of its receivers'
/// bytes (60 s at most); panics otherwise (a test helper: the fault must land mid-plan).
pub async fn wait_fraction<T: ApiChannel>(
    api: &mut ControllerClient<T>,
    plan: &str,
    at_least: f64,
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let p = plan_status(api, plan).await;
        assert_eq!(
            p.state(),
            PlanState::Running,
            "plan ended before the fault: {p:?}"
        );
        let (done, total) = p
            .hosts
            .iter()
            .fold((0u64, 0u64), |(d, t), h| (d + h.bytes, t + h.total));
        if total > 0 && done as f64 / total as f64 >= at_least {
            return;
        }
        assert!(Instant::now() < deadline, "no progress: {p:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
