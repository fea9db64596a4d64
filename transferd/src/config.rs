//! Configuration in layers: built-in defaults < TOML file (`--config`) < environment
//! (`SHARDCAST_*`) < command-line flags. Everything is parsed into valid types here, so a
//! bad setting stops the daemon with a clear message before any port is bound. The example
//! `transferd/transferd.example.toml` documents every field.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use serde::Deserialize;
use shardcast_protocol::HostId;
use shardcast_protocol::units::{parse_rate, parse_size};

use gpu_loader::manager::{BackendChoice, GpuBudget, ManagerConfig};
use gpu_loader::sim::SimOptions;

use shardcast_protocol::origin_policy::{Enforcer, OriginPolicy};

use crate::chain::{ChainConfig, parse_fault_list};
use crate::limits::Limits;
use crate::origin::OriginAccess;
use crate::store::{StoreConfig, WriterKind};
use crate::transport::DataMode;
use crate::transport::quic::{MAX_PATH_MTU, MIN_PATH_MTU};

/// Command-line flags; each has an environment fallback and a TOML field of the same name.
#[derive(Debug, Default, Parser)]
#[command(
    name = "transferd",
    version,
    about = "shardcast per-host data-plane daemon"
)]
pub struct Args {
    /// TOML config file (fields as in transferd.example.toml).
    #[arg(long, env = "SHARDCAST_CONFIG")]
    pub config: Option<PathBuf>,
    /// This host's id in the cluster [default: the hostname].
    #[arg(long, env = "SHARDCAST_HOST_ID")]
    pub host_id: Option<String>,
    /// Data-plane listener (hop-to-hop chains) [default: 0.0.0.0:7400].
    #[arg(long, env = "SHARDCAST_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// QUIC listener (UDP) on the data listener's address and port, so sessions whose plan
    /// asks for QUIC reach this host; it uses the TLS identity, so `insecure_plaintext`
    /// turns it off [default: true].
    #[arg(long, env = "SHARDCAST_QUIC")]
    pub quic: Option<bool>,
    /// UDP payload size every path between hosts is known to carry (8972 on an IPv4 network
    /// with 9000-byte jumbo frames, 8952 over IPv6): QUIC sends packets this large from the first one, without
    /// discovery and without falling back below it. Only where the network guarantees it:
    /// a larger packet than a path carries is lost, and the connection with it
    /// [default: none: discovery from 1200 up to 1472 bytes].
    #[arg(long, env = "SHARDCAST_QUIC_PATH_MTU")]
    pub quic_path_mtu: Option<u16>,
    /// Agent gRPC listener: `host:port`, or `unix:/path/to.sock` for a local socket
    /// [default: 0.0.0.0:7401].
    #[arg(long, env = "SHARDCAST_AGENT_LISTEN")]
    pub agent_listen: Option<String>,
    /// Admin HTTP listener (/metrics, /healthz, /readyz, /v1/handoff): `host:port` (HTTPS
    /// with the cluster TLS identity), or `unix:/path/to.sock` (0600, or 0660 with
    /// `store_group`) [default: 127.0.0.1:7402].
    #[arg(long, env = "SHARDCAST_ADMIN_LISTEN")]
    pub admin_listen: Option<String>,
    /// Bearer tokens the admin listener accepts instead of a client certificate: lines of
    /// `<role> <name> <blake3-hex of the token>` (`shardcast certs token`) [default: none].
    #[arg(long, env = "SHARDCAST_TOKENS_FILE")]
    pub tokens_file: Option<PathBuf>,
    /// Milliseconds an admin client has to send a request head (from the connection's
    /// start or the first byte after a keep-alive pause); also the longest pause inside
    /// a request body [default: 10000].
    #[arg(long, env = "SHARDCAST_ADMIN_HEADER_TIMEOUT_MS")]
    pub admin_header_timeout_ms: Option<u64>,
    /// Milliseconds a keep-alive admin connection may wait for its next request
    /// [default: 60000].
    #[arg(long, env = "SHARDCAST_ADMIN_IDLE_TIMEOUT_MS")]
    pub admin_idle_timeout_ms: Option<u64>,
    /// Memory tier directory, on tmpfs [default: /dev/shm/shardcast].
    #[arg(long, env = "SHARDCAST_MEMORY_DIR")]
    pub memory_dir: Option<PathBuf>,
    /// Disk tier directory [default: /var/lib/shardcast].
    #[arg(long, env = "SHARDCAST_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Egress cap for all sessions together, e.g. 1Gbit, 100MB/s, unlimited [default: unlimited].
    #[arg(long, env = "SHARDCAST_EGRESS_RATE")]
    pub egress_rate: Option<String>,
    /// Ingress cap for all sessions together [default: unlimited].
    #[arg(long, env = "SHARDCAST_INGRESS_RATE")]
    pub ingress_rate: Option<String>,
    /// Unacknowledged chunks per downstream connection [default: 16].
    #[arg(long, env = "SHARDCAST_WINDOW")]
    pub window: Option<usize>,
    /// Milliseconds a hop waits for a replacement upstream before fetching from the
    /// fallback source [default: 2000].
    #[arg(long, env = "SHARDCAST_UPSTREAM_GRACE_MS")]
    pub upstream_grace_ms: Option<u64>,
    /// Seconds a hop waits for a peer's answer while setting up a connection (`Hello`,
    /// `Accept`) or for a holder answering `Fetch` [default: 30].
    #[arg(long, env = "SHARDCAST_IDLE_TIMEOUT_S")]
    pub idle_timeout_s: Option<u64>,
    /// Milliseconds without progress after which a neighbour hop (upstream or downstream)
    /// is stalled — dead, stopped or cut off — and bypassed [default: 2000; at least 200].
    #[arg(long, env = "SHARDCAST_STALL_TIMEOUT_MS")]
    pub stall_timeout_ms: Option<u64>,
    /// Concurrent range reads from an origin [default: 8].
    #[arg(long, env = "SHARDCAST_ORIGIN_PARALLEL")]
    pub origin_parallel: Option<usize>,
    /// Chunks verified and stored concurrently per upstream connection [default: 4].
    #[arg(long, env = "SHARDCAST_PIPELINE_DEPTH")]
    pub pipeline_depth: Option<usize>,
    /// Re-hash chunks marked verified when recovering the store at startup [default: true].
    #[arg(long, env = "SHARDCAST_VERIFY_ON_RECOVER")]
    pub verify_on_recover: Option<bool>,
    /// Positional writer: auto, pwrite or io-uring [default: auto].
    #[arg(long, env = "SHARDCAST_WRITER")]
    pub writer: Option<String>,
    /// Group (name or gid) given to the store's files, with modes 0750/0640, so inference
    /// processes in it can map the memory tier [default: none; modes 0700/0600].
    #[arg(long, env = "SHARDCAST_STORE_GROUP")]
    pub store_group: Option<String>,
    /// Milliseconds a verified chunk stays trusted; older ones are re-hashed before they
    /// are served, loaded onto GPUs or handed off (0: always) [default: 1000].
    #[arg(long, env = "SHARDCAST_REVERIFY_AFTER_MS")]
    pub reverify_after_ms: Option<u64>,
    /// Rate at which the background scrub re-hashes idle chunks, e.g. 64MB/s; 0 or off
    /// turns it off [default: 64MB/s].
    #[arg(long, env = "SHARDCAST_SCRUB_RATE")]
    pub scrub_rate: Option<String>,
    /// Log format: text or json [default: text].
    #[arg(long, env = "SHARDCAST_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// Controller inventory address to heartbeat to (`host:port`, `http://host:port` or
    /// `unix:/path`), or every replica's, comma-separated: heartbeats follow the elected
    /// leader [default: none, the daemon runs unmanaged].
    #[arg(long, env = "SHARDCAST_CONTROLLER")]
    pub controller: Option<String>,
    /// Data-plane address peers use to reach this host [default: the listen address; required
    /// when that is unspecified (0.0.0.0) and a controller is set].
    #[arg(long, env = "SHARDCAST_ADVERTISE")]
    pub advertise: Option<String>,
    /// Agent API address the controller uses [default: the agent listen address].
    #[arg(long, env = "SHARDCAST_AGENT_ADVERTISE")]
    pub agent_advertise: Option<String>,
    /// Zone label reported to the controller.
    #[arg(long, env = "SHARDCAST_ZONE")]
    pub zone: Option<String>,
    /// Rack label reported to the controller (placement keeps chains in-rack).
    #[arg(long, env = "SHARDCAST_RACK")]
    pub rack: Option<String>,
    /// NIC rate reported to the controller, e.g. 10Gbit [default: the egress cap, else unknown].
    #[arg(long, env = "SHARDCAST_NIC_RATE")]
    pub nic_rate: Option<String>,
    /// Cap on the memory tier, e.g. 64GiB [default: the file system's size].
    #[arg(long, env = "SHARDCAST_MEMORY_CAPACITY")]
    pub memory_capacity: Option<String>,
    /// Cap on the disk tier [default: the file system's size].
    #[arg(long, env = "SHARDCAST_DISK_CAPACITY")]
    pub disk_capacity: Option<String>,
    /// Host memory a memory tier on tmpfs leaves free: a new shard must fit the host's
    /// available memory less this, e.g. 2GiB; 0 turns the check off [default: 5% of the
    /// host's memory, between 256MiB and 4GiB].
    #[arg(long, env = "SHARDCAST_MEMORY_HEADROOM")]
    pub memory_headroom: Option<String>,
    /// GPUs reported to the controller until the GPU loader detects them [default: 0].
    #[arg(long, env = "SHARDCAST_GPUS")]
    pub gpus: Option<u32>,
    /// Memory of each reported GPU, e.g. 80GiB [default: 0].
    #[arg(long, env = "SHARDCAST_GPU_MEMORY")]
    pub gpu_memory: Option<String>,
    /// Milliseconds between heartbeats to the controller [default: 1000].
    #[arg(long, env = "SHARDCAST_HEARTBEAT_MS")]
    pub heartbeat_ms: Option<u64>,
    /// GPU backend: auto (CUDA if a driver is present), cuda, simulated or none [default: auto].
    #[arg(long, env = "SHARDCAST_GPU_BACKEND")]
    pub gpu_backend: Option<String>,
    /// Simulated GPUs (gpu_backend = simulated) [default: 2].
    #[arg(long, env = "SHARDCAST_SIM_GPUS")]
    pub sim_gpus: Option<u32>,
    /// Memory of each simulated GPU [default: 1GiB].
    #[arg(long, env = "SHARDCAST_SIM_GPU_MEMORY")]
    pub sim_gpu_memory: Option<String>,
    /// Host-to-device rate of each simulated GPU [default: 2GB/s].
    #[arg(long, env = "SHARDCAST_SIM_PCIE_RATE")]
    pub sim_pcie_rate: Option<String>,
    /// Peer rate between simulated GPUs, 0 for none [default: 8GB/s].
    #[arg(long, env = "SHARDCAST_SIM_NVLINK_RATE")]
    pub sim_nvlink_rate: Option<String>,
    /// The first N simulated GPUs start with 90% of their memory held by another process,
    /// as an inference engine started outside shardcast would hold it; they are reported
    /// busy [default: 0].
    #[arg(long, env = "SHARDCAST_SIM_GPUS_BUSY")]
    pub sim_gpus_busy: Option<u32>,
    /// The most memory this host takes on each GPU for models: a share (0.8, 80%) or a size
    /// per GPU (60GiB). A cap, not a reservation: nothing is allocated at start, a model's
    /// region is allocated when it loads and freed when it is evicted [default: 0.8].
    #[arg(long, env = "SHARDCAST_GPU_BUDGET")]
    pub gpu_budget: Option<String>,
    /// Old name of gpu_budget given as a share (0.01–1); like gpu_budget, now a cap.
    #[arg(long, env = "SHARDCAST_GPU_BUDGET_FRACTION", hide = true)]
    pub gpu_budget_fraction: Option<f64>,
    /// Evict resident models (light ones and extra replicas first, LRU) when a new load
    /// does not fit a GPU, instead of refusing it [default: true].
    #[arg(long, env = "SHARDCAST_GPU_AUTO_EVICT")]
    pub gpu_auto_evict: Option<bool>,
    /// Pinned staging buffers per load [default: 8].
    #[arg(long, env = "SHARDCAST_STAGING_BUFFERS")]
    pub staging_buffers: Option<usize>,
    /// Bytes per staging buffer (one host-to-device copy each), or auto: calibrated at the
    /// elbow of throughput vs. transfer size on CUDA, 4MiB otherwise [default: auto].
    #[arg(long, env = "SHARDCAST_STAGING_SIZE")]
    pub staging_size: Option<String>,
    /// Threads copying verified chunks into the staging buffers of one load (one core's
    /// memcpy is slower than PCIe Gen5) [default: the CPU count, at most 4].
    #[arg(long, env = "SHARDCAST_STAGING_FILL_THREADS")]
    pub staging_fill_threads: Option<usize>,
    /// Register the memory tier's shard mappings with the GPU (pinned host memory) and copy
    /// from them directly, with no CPU copy into staging; the staging ring is the fallback
    /// when registration fails [default: true].
    #[arg(long, env = "SHARDCAST_REGISTER_HOST")]
    pub register_host: Option<bool>,
    /// With register_host: register the memory tier's complete shards with the GPU while no
    /// load runs, so that even the first GPU load of a model already in memory copies
    /// without pinning first [default: true].
    #[arg(long, env = "SHARDCAST_REGISTER_AHEAD")]
    pub register_ahead: Option<bool>,
    /// Copy streams per GPU for copies from registered shard mappings, 1 to 8 [default: 4].
    #[arg(long, env = "SHARDCAST_COPY_STREAMS")]
    pub copy_streams: Option<usize>,
    /// Cluster CA bundle (PEM) that peers' and the controller's certificates must chain to.
    #[arg(long, env = "SHARDCAST_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This host's certificate (PEM), naming `shardcast://host/<host_id>`
    /// (`shardcast certs issue --role host --name <host_id>`).
    #[arg(long, env = "SHARDCAST_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "SHARDCAST_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// INSECURE: no TLS and no authentication on any listener. Refused unless every
    /// TCP listener is on loopback. For benchmarks and experiments only [default: false].
    #[arg(long, env = "SHARDCAST_INSECURE_PLAINTEXT")]
    pub insecure_plaintext: Option<bool>,
    /// With data_mode = authenticate-only or insecure_plaintext: send chunk payloads from
    /// the store's files with sendfile (no copy through user space; copied instead where
    /// the kernel refuses). Measured slower on loopback, so off [default: false].
    #[arg(long, env = "SHARDCAST_SENDFILE")]
    pub sendfile: Option<bool>,
    /// How the data port (TCP) protects what crosses it: `tls` encrypts every byte with
    /// mutual TLS; `authenticate-only` (for a trusted fabric) authenticates both ends with
    /// the same mutual-TLS handshake and each session with its plan token, then sends
    /// frames unencrypted: every chunk is still verified against the manifest's BLAKE3
    /// hashes, confidentiality is given up (docs/SECURITY.md). Both ends of every hop must
    /// use the same mode; QUIC always encrypts [default: tls].
    #[arg(long, env = "SHARDCAST_DATA_MODE", value_enum)]
    pub data_mode: Option<DataMode>,
    /// Connections (sessions) each shard of a chain this host heads is striped over, so
    /// each hop handles one shard on several cores; hops below follow [default: 1, at most
    /// 16; fewer for shards under 4 chunks a stripe].
    #[arg(long, env = "SHARDCAST_STRIPES")]
    pub stripes: Option<usize>,
    /// Allowed origin prefixes (repeatable or comma-separated): `file:///data/models/`,
    /// `https://models.example.com/org/`. Every origin this host opens must lie under
    /// one [default: none, so every origin is refused].
    #[arg(long, env = "SHARDCAST_ORIGIN_ALLOW", value_delimiter = ',')]
    pub origin_allow: Vec<String>,
    /// Milliseconds an accepted data-plane connection has to complete the `Hello`
    /// exchange [default: 10000].
    #[arg(long, env = "SHARDCAST_HANDSHAKE_TIMEOUT_MS")]
    pub handshake_timeout_ms: Option<u64>,
    /// Seconds a connected peer may stay silent while this host waits for its next frame
    /// or the rest of a frame [default: 60].
    #[arg(long, env = "SHARDCAST_PEER_IDLE_TIMEOUT_S")]
    pub peer_idle_timeout_s: Option<u64>,
    /// Seconds a write to a peer may take to drain before the connection is dropped
    /// [default: 30].
    #[arg(long, env = "SHARDCAST_WRITE_TIMEOUT_S")]
    pub write_timeout_s: Option<u64>,
    /// Data-plane connections accepted at once, from all peers [default: 8192].
    #[arg(long, env = "SHARDCAST_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Data-plane connections accepted at once from one IP address [default: 1024].
    #[arg(long, env = "SHARDCAST_MAX_CONNECTIONS_PER_IP")]
    pub max_connections_per_ip: Option<usize>,
    /// Hop sessions (session × shard) held at once; more `Open`s are refused
    /// [default: 4096].
    #[arg(long, env = "SHARDCAST_MAX_SESSIONS")]
    pub max_sessions: Option<usize>,
    /// Memory for frame bodies in flight on the data port, across all connections
    /// (e.g. 512MiB); a frame that does not fit waits [default: 512MiB].
    #[arg(long, env = "SHARDCAST_FRAME_MEMORY")]
    pub frame_memory: Option<String>,
}

/// `gpu_budget` in the TOML file: a share as a number (`0.8`) or a string (`"80%"`,
/// `"60GiB"`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum BudgetValue {
    Number(f64),
    Text(String),
}

/// The GPU budget of one layer (flags and environment, or the file), from `gpu_budget` or
/// its old name `gpu_budget_fraction`.
fn gpu_budget(
    layer: &str,
    budget: Option<String>,
    fraction: Option<f64>,
) -> anyhow::Result<Option<GpuBudget>> {
    match (budget, fraction) {
        (Some(_), Some(_)) => {
            bail!("{layer}: set gpu_budget or its old name gpu_budget_fraction, not both")
        }
        (Some(b), None) => b
            .parse()
            .map(Some)
            .map_err(|e| anyhow::anyhow!("gpu_budget: {e}")),
        (None, Some(f)) => GpuBudget::fraction(f)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("gpu_budget_fraction: {e}")),
        (None, None) => Ok(None),
    }
}

/// The TOML file's fields (all optional; unknown fields are an error).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    host_id: Option<String>,
    listen: Option<SocketAddr>,
    quic: Option<bool>,
    quic_path_mtu: Option<u16>,
    agent_listen: Option<String>,
    admin_listen: Option<String>,
    tokens_file: Option<PathBuf>,
    admin_header_timeout_ms: Option<u64>,
    admin_idle_timeout_ms: Option<u64>,
    memory_dir: Option<PathBuf>,
    data_dir: Option<PathBuf>,
    egress_rate: Option<String>,
    ingress_rate: Option<String>,
    window: Option<usize>,
    upstream_grace_ms: Option<u64>,
    idle_timeout_s: Option<u64>,
    stall_timeout_ms: Option<u64>,
    origin_parallel: Option<usize>,
    pipeline_depth: Option<usize>,
    verify_on_recover: Option<bool>,
    writer: Option<String>,
    store_group: Option<String>,
    reverify_after_ms: Option<u64>,
    scrub_rate: Option<String>,
    log_format: Option<String>,
    controller: Option<String>,
    advertise: Option<String>,
    agent_advertise: Option<String>,
    zone: Option<String>,
    rack: Option<String>,
    nic_rate: Option<String>,
    memory_capacity: Option<String>,
    disk_capacity: Option<String>,
    memory_headroom: Option<String>,
    gpus: Option<u32>,
    gpu_memory: Option<String>,
    heartbeat_ms: Option<u64>,
    gpu_backend: Option<String>,
    sim_gpus: Option<u32>,
    sim_gpu_memory: Option<String>,
    sim_pcie_rate: Option<String>,
    sim_nvlink_rate: Option<String>,
    sim_gpus_busy: Option<u32>,
    gpu_budget: Option<BudgetValue>,
    gpu_budget_fraction: Option<f64>,
    gpu_auto_evict: Option<bool>,
    staging_buffers: Option<usize>,
    staging_size: Option<String>,
    staging_fill_threads: Option<usize>,
    register_host: Option<bool>,
    register_ahead: Option<bool>,
    copy_streams: Option<usize>,
    tls_ca: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    insecure_plaintext: Option<bool>,
    sendfile: Option<bool>,
    data_mode: Option<DataMode>,
    stripes: Option<usize>,
    origin_allow: Option<Vec<String>>,
    handshake_timeout_ms: Option<u64>,
    peer_idle_timeout_s: Option<u64>,
    write_timeout_s: Option<u64>,
    max_connections: Option<usize>,
    max_connections_per_ip: Option<usize>,
    max_sessions: Option<usize>,
    frame_memory: Option<String>,
}

/// Where a listener binds: TCP, or a Unix socket (reachable from every network namespace
/// on the host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// `host:port`.
    Tcp(SocketAddr),
    /// `unix:/path`.
    Unix(PathBuf),
}

impl std::str::FromStr for ListenAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.strip_prefix("unix:") {
            Some("") => {
                Err("unix: needs a socket path, e.g. unix:/run/shardcast/agent.sock".into())
            }
            Some(path) => Ok(Self::Unix(PathBuf::from(path))),
            None => s
                .parse()
                .map(Self::Tcp)
                .map_err(|e| format!("{s:?}: {e} (expected host:port or unix:/path)")),
        }
    }
}

impl ListenAddr {
    /// The TCP address, if it is one.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            Self::Tcp(a) => Some(*a),
            Self::Unix(_) => None,
        }
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(a) => write!(f, "{a}"),
            Self::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// Validated daemon configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// This host's id.
    pub host_id: HostId,
    /// Data-plane listener.
    pub listen: SocketAddr,
    /// Whether the QUIC listener is bound too (UDP, same address and port as `listen`).
    pub quic: bool,
    /// The UDP payload size every path is declared to carry (`None`: discovered).
    pub quic_path_mtu: Option<u16>,
    /// Agent gRPC listener.
    pub agent_listen: ListenAddr,
    /// Admin HTTP listener.
    pub admin_listen: ListenAddr,
    /// Bearer tokens for the admin listener.
    pub tokens_file: Option<PathBuf>,
    /// Timeouts of the admin listener's clients.
    pub admin_limits: shardcast_identity::http::HttpLimits,
    /// Store settings.
    pub store: StoreConfig,
    /// Egress cap in bytes/s.
    pub egress_rate: Option<u64>,
    /// Ingress cap in bytes/s.
    pub ingress_rate: Option<u64>,
    /// Chain tuning.
    pub chain: ChainConfig,
    /// JSON logs instead of text.
    pub json_logs: bool,
    /// Reporting to a controller, if one is configured.
    pub inventory: Inventory,
    /// GPU backend and loader settings.
    pub gpu: ManagerConfig,
    /// Chunks to corrupt once when sent (`SHARDCAST_FAULT_CORRUPT`, honoured only with
    /// `SHARDCAST_ENABLE_FAULT_INJECTION=1`; for tests).
    pub corrupt_once: Vec<(u32, u32)>,
    /// How peers and API clients are authenticated.
    pub security: Security,
    /// How the data port protects chunk payloads (with TLS; `Tls` otherwise unused).
    pub data_mode: DataMode,
}

/// How the daemon authenticates everything that connects to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Security {
    /// Mutual TLS under the cluster CA on the data port and the agent API (the default,
    /// and required unless [`Security::InsecurePlaintext`] is set).
    Tls(shardcast_identity::TlsFiles),
    /// No TLS, no authentication; every TCP listener is on loopback.
    InsecurePlaintext,
}

impl Security {
    fn load(
        ca: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        insecure: bool,
        listeners: &[(&str, Option<SocketAddr>)],
    ) -> anyhow::Result<Self> {
        if insecure {
            for (name, addr) in listeners {
                if let Some(a) = addr
                    && !shardcast_identity::plaintext_allowed(a)
                {
                    bail!(
                        "insecure_plaintext is only allowed when every listener is on loopback, but {name} is {a}"
                    );
                }
            }
            return Ok(Self::InsecurePlaintext);
        }
        match (ca, cert, key) {
            (Some(ca), Some(cert), Some(key)) => {
                Ok(Self::Tls(shardcast_identity::TlsFiles { ca, cert, key }))
            }
            (ca, cert, key) => {
                let missing: Vec<&str> = [
                    ("tls_ca", ca.is_none()),
                    ("tls_cert", cert.is_none()),
                    ("tls_key", key.is_none()),
                ]
                .into_iter()
                .filter(|(_, m)| *m)
                .map(|(n, _)| n)
                .collect();
                bail!(
                    "mutual TLS is required: set {} (create a CA and this host's certificate with \
                     `shardcast certs init` and `shardcast certs issue --role host --name <host_id>`), \
                     or set insecure_plaintext = true with loopback listeners only",
                    missing.join(", ")
                )
            }
        }
    }
}

/// What the daemon reports to the controller, and where.
#[derive(Debug, Clone, Default)]
pub struct Inventory {
    /// Controller inventory address; `None` runs unmanaged.
    pub controller: Option<String>,
    /// Data-plane address peers use (`None`: the listen address).
    pub advertise: Option<String>,
    /// Agent address the controller uses (`None`: the agent listen address).
    pub agent_advertise: Option<String>,
    /// Zone label.
    pub zone: String,
    /// Rack label.
    pub rack: String,
    /// NIC rate in bytes/s (0: unknown).
    pub nic_bps: u64,
    /// Memory-tier cap in bytes (`None`: file system size).
    pub memory_capacity: Option<u64>,
    /// Disk-tier cap in bytes (`None`: file system size).
    pub disk_capacity: Option<u64>,
    /// GPUs to report.
    pub gpus: u32,
    /// Memory per GPU in bytes.
    pub gpu_memory: u64,
    /// Heartbeat period.
    pub heartbeat: Duration,
}

fn default_host_id() -> String {
    let raw = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into());
    raw.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-._:".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect()
}

impl Config {
    /// Merges flags/env over the optional TOML file over defaults, and validates.
    pub fn load(args: Args) -> anyhow::Result<Self> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let host_id = args
            .host_id
            .or(file.host_id)
            .unwrap_or_else(default_host_id);
        let host_id =
            HostId::new(&host_id).with_context(|| format!("invalid host_id {host_id:?}"))?;
        let rate = |name: &str, v: Option<String>| -> anyhow::Result<Option<u64>> {
            match v {
                None => Ok(None),
                Some(s) => parse_rate(&s).map_err(|e| anyhow::anyhow!("{name}: {e}")),
            }
        };
        let defaults = ChainConfig::default();
        let window = bounded("window", args.window.or(file.window), defaults.window, 4096)?;
        let quic_path_mtu = match args.quic_path_mtu.or(file.quic_path_mtu) {
            Some(m) if !(MIN_PATH_MTU..=MAX_PATH_MTU).contains(&m) => bail!(
                "quic_path_mtu must be between {MIN_PATH_MTU} and {MAX_PATH_MTU} bytes (a UDP \
                 payload), got {m}"
            ),
            m => m,
        };
        let origin_parallel = bounded(
            "origin_parallel",
            args.origin_parallel.or(file.origin_parallel),
            defaults.origin_parallel,
            256,
        )?;
        let pipeline_depth = bounded(
            "pipeline_depth",
            args.pipeline_depth.or(file.pipeline_depth),
            defaults.pipeline_depth,
            64,
        )?;
        let idle_timeout_s = args
            .idle_timeout_s
            .or(file.idle_timeout_s)
            .unwrap_or(defaults.idle_timeout.as_secs());
        if idle_timeout_s == 0 {
            bail!("idle_timeout_s must be at least 1");
        }
        let stall_timeout_ms = args
            .stall_timeout_ms
            .or(file.stall_timeout_ms)
            .unwrap_or(defaults.stall_timeout.as_millis() as u64);
        if stall_timeout_ms < 200 {
            bail!("stall_timeout_ms must be at least 200 (it is {stall_timeout_ms})");
        }
        let origin_allow = if args.origin_allow.is_empty() {
            file.origin_allow.unwrap_or_default()
        } else {
            args.origin_allow
        };
        let origins = OriginPolicy::parse(&origin_allow, Enforcer::Host)
            .map_err(|e| anyhow::anyhow!("origin_allow: {e}"))?;
        let limits = {
            let d = Limits::default();
            let secs =
                |name: &str, v: Option<u64>, default: Duration| -> anyhow::Result<Duration> {
                    match v {
                        None => Ok(default),
                        Some(0) => bail!("{name} must be at least 1"),
                        Some(n) => Ok(Duration::from_secs(n)),
                    }
                };
            let handshake_ms = args
                .handshake_timeout_ms
                .or(file.handshake_timeout_ms)
                .unwrap_or(d.handshake_timeout.as_millis() as u64);
            if !(100..=600_000).contains(&handshake_ms) {
                bail!("handshake_timeout_ms must be between 100 and 600000, got {handshake_ms}");
            }
            Limits {
                handshake_timeout: Duration::from_millis(handshake_ms),
                peer_idle_timeout: secs(
                    "peer_idle_timeout_s",
                    args.peer_idle_timeout_s.or(file.peer_idle_timeout_s),
                    d.peer_idle_timeout,
                )?,
                write_timeout: secs(
                    "write_timeout_s",
                    args.write_timeout_s.or(file.write_timeout_s),
                    d.write_timeout,
                )?,
                max_connections: bounded(
                    "max_connections",
                    args.max_connections.or(file.max_connections),
                    d.max_connections,
                    1 << 20,
                )?,
                max_connections_per_ip: bounded(
                    "max_connections_per_ip",
                    args.max_connections_per_ip.or(file.max_connections_per_ip),
                    d.max_connections_per_ip,
                    1 << 20,
                )?,
                max_sessions: bounded(
                    "max_sessions",
                    args.max_sessions.or(file.max_sessions),
                    d.max_sessions,
                    1 << 20,
                )?,
                frame_memory: match args.frame_memory.or(file.frame_memory) {
                    None => d.frame_memory,
                    Some(s) => {
                        let v = parse_size(&s).map_err(|e| anyhow::anyhow!("frame_memory: {e}"))?;
                        let min = shardcast_protocol::manifest::MAX_CHUNK_SIZE as u64 + 12;
                        if v < min {
                            bail!(
                                "frame_memory must hold at least one chunk frame of the largest chunk size ({min} bytes), got {v}"
                            );
                        }
                        usize::try_from(v).unwrap_or(usize::MAX)
                    }
                },
            }
        };
        let writer = match args.writer.or(file.writer).as_deref().unwrap_or("auto") {
            "auto" => WriterKind::Auto,
            "pwrite" => WriterKind::Pwrite,
            "io-uring" | "io_uring" => WriterKind::IoUring,
            other => bail!("writer must be auto, pwrite or io-uring, got {other:?}"),
        };
        let json_logs = match args
            .log_format
            .or(file.log_format)
            .as_deref()
            .unwrap_or("text")
        {
            "text" => false,
            "json" => true,
            other => bail!("log_format must be text or json, got {other:?}"),
        };
        let memory_dir = args
            .memory_dir
            .or(file.memory_dir)
            .unwrap_or_else(|| "/dev/shm/shardcast".into());
        let data_dir = args
            .data_dir
            .or(file.data_dir)
            .unwrap_or_else(|| "/var/lib/shardcast".into());
        if memory_dir == data_dir {
            bail!(
                "memory_dir and data_dir must differ (both are {})",
                memory_dir.display()
            );
        }
        let corrupt_once =
            if std::env::var("SHARDCAST_ENABLE_FAULT_INJECTION").as_deref() == Ok("1") {
                parse_fault_list(&std::env::var("SHARDCAST_FAULT_CORRUPT").unwrap_or_default())
                    .map_err(|e| anyhow::anyhow!("SHARDCAST_FAULT_CORRUPT: {e}"))?
            } else {
                Vec::new()
            };
        let size = |name: &str, v: Option<String>| -> anyhow::Result<Option<u64>> {
            v.map(|s| parse_size(&s).map_err(|e| anyhow::anyhow!("{name}: {e}")))
                .transpose()
        };
        let egress_rate = rate("egress_rate", args.egress_rate.or(file.egress_rate))?;
        let store_group = match args.store_group.or(file.store_group) {
            Some(g) => Some(resolve_group(&g).with_context(|| format!("store_group {g:?}"))?),
            None => None,
        };
        let reverify_after = match args.reverify_after_ms.or(file.reverify_after_ms) {
            Some(ms) if ms > 86_400_000 => {
                bail!("reverify_after_ms must be at most 86400000 (a day), got {ms}")
            }
            Some(ms) => Duration::from_millis(ms),
            None => crate::store::DEFAULT_REVERIFY_AFTER,
        };
        let scrub_rate = match args.scrub_rate.or(file.scrub_rate) {
            None => crate::store::DEFAULT_SCRUB_RATE,
            Some(s) if matches!(s.trim().to_ascii_lowercase().as_str(), "0" | "off") => 0,
            Some(s) => parse_rate(&s)
                .map_err(|e| anyhow::anyhow!("scrub_rate: {e}"))?
                .ok_or_else(|| {
                    anyhow::anyhow!("scrub_rate must be a rate such as 64MB/s, or off")
                })?,
        };
        let heartbeat_ms = args.heartbeat_ms.or(file.heartbeat_ms).unwrap_or(1000);
        if !(50..=60_000).contains(&heartbeat_ms) {
            bail!("heartbeat_ms must be between 50 and 60000, got {heartbeat_ms}");
        }
        let inventory = Inventory {
            controller: args.controller.or(file.controller),
            advertise: args.advertise.or(file.advertise),
            agent_advertise: args.agent_advertise.or(file.agent_advertise),
            zone: args.zone.or(file.zone).unwrap_or_default(),
            rack: args.rack.or(file.rack).unwrap_or_default(),
            nic_bps: rate("nic_rate", args.nic_rate.or(file.nic_rate))?
                .or(egress_rate)
                .unwrap_or(0),
            memory_capacity: size(
                "memory_capacity",
                args.memory_capacity.or(file.memory_capacity),
            )?,
            disk_capacity: size("disk_capacity", args.disk_capacity.or(file.disk_capacity))?,
            gpus: args.gpus.or(file.gpus).unwrap_or(0),
            gpu_memory: size("gpu_memory", args.gpu_memory.or(file.gpu_memory))?.unwrap_or(0),
            heartbeat: Duration::from_millis(heartbeat_ms),
        };
        let gpu = {
            let mut m = ManagerConfig::default();
            let backend = args.gpu_backend.or(file.gpu_backend);
            m.backend = match backend.as_deref().unwrap_or("auto") {
                "auto" => BackendChoice::Auto,
                "cuda" => BackendChoice::Cuda,
                "none" => BackendChoice::None,
                "simulated" => {
                    let mut o = SimOptions::new(
                        &memory_dir.join("sim-gpus"),
                        args.sim_gpus.or(file.sim_gpus).unwrap_or(2),
                        size(
                            "sim_gpu_memory",
                            args.sim_gpu_memory.or(file.sim_gpu_memory),
                        )?
                        .unwrap_or(1 << 30),
                    );
                    o.pcie_bps = rate("sim_pcie_rate", args.sim_pcie_rate.or(file.sim_pcie_rate))?
                        .unwrap_or(2_000_000_000);
                    o.nvlink_bps = rate(
                        "sim_nvlink_rate",
                        args.sim_nvlink_rate.or(file.sim_nvlink_rate),
                    )?
                    .unwrap_or(8_000_000_000);
                    o.busy = args.sim_gpus_busy.or(file.sim_gpus_busy).unwrap_or(0);
                    if o.busy > o.gpus {
                        bail!(
                            "sim_gpus_busy ({}) cannot exceed sim_gpus ({})",
                            o.busy,
                            o.gpus
                        );
                    }
                    BackendChoice::Simulated(o)
                }
                other => bail!("gpu_backend must be auto, cuda, simulated or none, got {other:?}"),
            };
            // A cap on each GPU, not a reservation (see `GpuBudget`).
            let file_budget = file.gpu_budget.map(|v| match v {
                BudgetValue::Number(f) => f.to_string(),
                BudgetValue::Text(s) => s,
            });
            m.budget = gpu_budget(
                "flags and environment",
                args.gpu_budget,
                args.gpu_budget_fraction,
            )?
            .or(gpu_budget(
                "the config file",
                file_budget,
                file.gpu_budget_fraction,
            )?)
            .unwrap_or_default();
            m.auto_evict = args.gpu_auto_evict.or(file.gpu_auto_evict).unwrap_or(true);
            m.load.staging_buffers = bounded(
                "staging_buffers",
                args.staging_buffers.or(file.staging_buffers),
                8,
                1024,
            )?;
            m.load.fill_threads = bounded(
                "staging_fill_threads",
                args.staging_fill_threads.or(file.staging_fill_threads),
                m.load.fill_threads,
                64,
            )?;
            m.load.register_host = args
                .register_host
                .or(file.register_host)
                .unwrap_or(m.load.register_host);
            m.register_ahead = args
                .register_ahead
                .or(file.register_ahead)
                .unwrap_or(m.register_ahead);
            m.load.copy_streams = bounded(
                "copy_streams",
                args.copy_streams.or(file.copy_streams),
                m.load.copy_streams,
                gpu_loader::loader::MAX_COPY_STREAMS,
            )?;
            // "auto" (the default): calibrated at start-up on CUDA (Torpor's elbow), 4 MiB on
            // simulated devices.
            let staging = args.staging_size.or(file.staging_size);
            m.load.staging_size = match staging.as_deref() {
                None | Some("auto") => 0,
                Some(v) => {
                    let n = parse_size(v).map_err(|e| anyhow::anyhow!("staging_size: {e}"))?;
                    if !(4096..=(1 << 30)).contains(&n) {
                        bail!("staging_size must be auto or between 4KiB and 1GiB, got {n}");
                    }
                    n as usize
                }
            };
            m
        };
        let listen = args
            .listen
            .or(file.listen)
            .unwrap_or_else(|| ([0, 0, 0, 0], 7400).into());
        // The agent API drives imports, chains, loads and evictions: loopback unless the
        // operator opens it (the controller then reaches it over mutual TLS).
        let agent_listen = match args.agent_listen.or(file.agent_listen) {
            Some(s) => s
                .parse()
                .map_err(|e| anyhow::anyhow!("agent_listen: {e}"))?,
            None => ListenAddr::Tcp(([127, 0, 0, 1], 7401).into()),
        };
        let admin_listen = match args.admin_listen.or(file.admin_listen) {
            Some(s) => s
                .parse()
                .map_err(|e| anyhow::anyhow!("admin_listen: {e}"))?,
            None => ListenAddr::Tcp(([127, 0, 0, 1], 7402).into()),
        };
        let admin_limits = shardcast_identity::http::HttpLimits::from_millis(
            args.admin_header_timeout_ms
                .or(file.admin_header_timeout_ms),
            args.admin_idle_timeout_ms.or(file.admin_idle_timeout_ms),
            ["admin_header_timeout_ms", "admin_idle_timeout_ms"],
        )
        .map_err(anyhow::Error::msg)?;
        let security = Security::load(
            args.tls_ca.or(file.tls_ca),
            args.tls_cert.or(file.tls_cert),
            args.tls_key.or(file.tls_key),
            args.insecure_plaintext
                .or(file.insecure_plaintext)
                .unwrap_or(false),
            &[
                ("listen", Some(listen)),
                ("agent_listen", agent_listen.tcp()),
                ("admin_listen", admin_listen.tcp()),
            ],
        )?;
        let data_mode = args.data_mode.or(file.data_mode).unwrap_or_default();
        let stripes = args.stripes.or(file.stripes).unwrap_or(1);
        if !(1..=crate::chain::MAX_STRIPES).contains(&stripes) {
            bail!(
                "stripes must be between 1 and {} (got {stripes})",
                crate::chain::MAX_STRIPES
            );
        }
        if data_mode == DataMode::AuthenticateOnly
            && matches!(security, Security::InsecurePlaintext)
        {
            bail!(
                "data_mode = authenticate-only authenticates hops with the mutual-TLS handshake, \
                 but insecure_plaintext turns TLS off: set tls_ca/tls_cert/tls_key, or drop data_mode"
            );
        }
        Ok(Self {
            host_id,
            listen,
            quic: args.quic.or(file.quic).unwrap_or(true),
            quic_path_mtu,
            agent_listen,
            admin_listen,
            tokens_file: args.tokens_file.or(file.tokens_file),
            admin_limits,
            security,
            data_mode,
            store: StoreConfig {
                memory_dir,
                disk_dir: data_dir,
                verify_on_recover: args
                    .verify_on_recover
                    .or(file.verify_on_recover)
                    .unwrap_or(true),
                writer,
                group: store_group,
                memory_capacity: inventory.memory_capacity,
                disk_capacity: inventory.disk_capacity,
                memory_headroom: size(
                    "memory_headroom",
                    args.memory_headroom.or(file.memory_headroom),
                )?,
                reverify_after,
                scrub_rate,
            },
            egress_rate,
            ingress_rate: rate("ingress_rate", args.ingress_rate.or(file.ingress_rate))?,
            chain: ChainConfig {
                window,
                upstream_grace: Duration::from_millis(
                    args.upstream_grace_ms
                        .or(file.upstream_grace_ms)
                        .unwrap_or(defaults.upstream_grace.as_millis() as u64),
                ),
                idle_timeout: Duration::from_secs(idle_timeout_s),
                stall_timeout: Duration::from_millis(stall_timeout_ms),
                origin_parallel,
                pipeline_depth,
                sendfile: args.sendfile.or(file.sendfile).unwrap_or(defaults.sendfile),
                stripes,
                origins: OriginAccess::new(origins),
                limits,
                ..defaults
            },
            json_logs,
            inventory,
            gpu,
            corrupt_once,
        })
    }
}

/// A group name (looked up in `/etc/group`) or a numeric gid.
fn resolve_group(g: &str) -> anyhow::Result<u32> {
    if let Ok(gid) = g.parse::<u32>() {
        return Ok(gid);
    }
    let groups = std::fs::read_to_string("/etc/group").context("reading /etc/group")?;
    groups
        .lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            let gid = f.nth(1)?.parse::<u32>().ok()?;
            (name == g).then_some(gid)
        })
        .next()
        .with_context(|| format!("no group {g:?} in /etc/group; give its numeric gid instead"))
}

/// `value` (or `default`), checked to lie in `1..=max`.
fn bounded(name: &str, value: Option<usize>, default: usize, max: usize) -> anyhow::Result<usize> {
    let v = value.unwrap_or(default);
    if !(1..=max).contains(&v) {
        bail!("{name} must be between 1 and {max}, got {v}");
    }
    Ok(v)
}

fn read_file(path: &Path) -> anyhow::Result<FileConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parsing config file {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_file_and_bad_values_fail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        std::fs::write(
            &path,
            "host_id = \"from-file\"\nwindow = 8\negress_rate = \"1Gbit\"\n",
        )
        .unwrap();
        let args = Args {
            config: Some(path.clone()),
            window: Some(4),
            ..tls_args()
        };
        let c = Config::load(args).unwrap();
        assert_eq!(c.host_id.as_str(), "from-file");
        assert_eq!(c.chain.window, 4);
        assert_eq!(c.egress_rate, Some(125_000_000));

        std::fs::write(&path, "windw = 8\n").unwrap();
        let err = Config::load(Args {
            config: Some(path.clone()),
            ..Args::default()
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("unknown field"), "{err:#}");

        let err = Config::load(Args {
            egress_rate: Some("fast".into()),
            ..tls_args()
        })
        .unwrap_err();
        assert!(err.to_string().contains("egress_rate"), "{err}");
        let err = Config::load(Args {
            host_id: Some("a b".into()),
            ..tls_args()
        })
        .unwrap_err();
        assert!(err.to_string().contains("host_id"), "{err}");
        for bad in [1000, 65528] {
            let err = Config::load(Args {
                quic_path_mtu: Some(bad),
                ..tls_args()
            })
            .unwrap_err();
            assert!(err.to_string().contains("quic_path_mtu"), "{err}");
        }
        std::fs::write(&path, "quic_path_mtu = 8952\n").unwrap();
        let c = Config::load(Args {
            config: Some(path.clone()),
            ..tls_args()
        })
        .unwrap();
        assert_eq!(c.quic_path_mtu, Some(8952));
    }

    fn tls_args() -> Args {
        Args {
            tls_ca: Some("/etc/shardcast/ca.pem".into()),
            tls_cert: Some("/etc/shardcast/host.pem".into()),
            tls_key: Some("/etc/shardcast/host.key".into()),
            ..Args::default()
        }
    }

    #[test]
    fn tls_is_required_and_plaintext_only_on_loopback() {
        let err = Config::load(Args::default()).unwrap_err();
        assert!(
            err.to_string()
                .contains("mutual TLS is required: set tls_ca, tls_cert, tls_key"),
            "{err}"
        );
        let err = Config::load(Args {
            insecure_plaintext: Some(true),
            ..Args::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("listen is 0.0.0.0:7400"), "{err}");
        let c = Config::load(Args {
            insecure_plaintext: Some(true),
            listen: Some("127.0.0.1:0".parse().unwrap()),
            ..Args::default()
        })
        .unwrap();
        assert_eq!(c.security, Security::InsecurePlaintext);
        let c = Config::load(tls_args()).unwrap();
        assert!(matches!(c.security, Security::Tls(_)));
        assert_eq!(
            c.agent_listen,
            ListenAddr::Tcp("127.0.0.1:7401".parse().unwrap())
        );
        assert_eq!(
            c.admin_listen,
            ListenAddr::Tcp("127.0.0.1:7402".parse().unwrap())
        );
        assert_eq!(
            c.admin_limits,
            shardcast_identity::http::HttpLimits::default()
        );
        let c = Config::load(Args {
            admin_listen: Some("unix:/run/shardcast/admin.sock".into()),
            admin_header_timeout_ms: Some(500),
            ..tls_args()
        })
        .unwrap();
        assert_eq!(
            c.admin_listen,
            ListenAddr::Unix("/run/shardcast/admin.sock".into())
        );
        assert_eq!(c.admin_limits.header_timeout, Duration::from_millis(500));
        let err = Config::load(Args {
            admin_idle_timeout_ms: Some(0),
            ..tls_args()
        })
        .unwrap_err();
        assert!(err.to_string().contains("admin_idle_timeout_ms"), "{err}");
    }

    #[test]
    fn data_mode_is_tls_by_default_and_authenticate_only_needs_tls() {
        assert_eq!(Config::load(tls_args()).unwrap().data_mode, DataMode::Tls);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        std::fs::write(&path, "data_mode = \"authenticate-only\"\n").unwrap();
        let c = Config::load(Args {
            config: Some(path.clone()),
            ..tls_args()
        })
        .unwrap();
        assert_eq!(c.data_mode, DataMode::AuthenticateOnly);
        // The flag wins over the file.
        let c = Config::load(Args {
            config: Some(path.clone()),
            data_mode: Some(DataMode::Tls),
            ..tls_args()
        })
        .unwrap();
        assert_eq!(c.data_mode, DataMode::Tls);
        std::fs::write(&path, "data_mode = \"clear\"\n").unwrap();
        let err = Config::load(Args {
            config: Some(path),
            ..tls_args()
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("authenticate-only"), "{err:#}");
        let err = Config::load(Args {
            insecure_plaintext: Some(true),
            listen: Some("127.0.0.1:0".parse().unwrap()),
            data_mode: Some(DataMode::AuthenticateOnly),
            ..Args::default()
        })
        .unwrap_err();
        assert!(
            err.to_string().contains(
                "data_mode = authenticate-only authenticates hops with the mutual-TLS handshake"
            ),
            "{err}"
        );
    }

    #[test]
    fn store_hardening_and_scrub_settings() {
        let c = Config::load(tls_args()).unwrap();
        assert_eq!(c.store.group, None);
        assert_eq!(c.store.reverify_after, crate::store::DEFAULT_REVERIFY_AFTER);
        assert_eq!(c.store.scrub_rate, crate::store::DEFAULT_SCRUB_RATE);
        let c = Config::load(Args {
            store_group: Some("4242".into()),
            reverify_after_ms: Some(0),
            scrub_rate: Some("off".into()),
            memory_capacity: Some("1GiB".into()),
            ..tls_args()
        })
        .unwrap();
        assert_eq!(c.store.group, Some(4242));
        assert_eq!(c.store.reverify_after, Duration::ZERO);
        assert_eq!(c.store.scrub_rate, 0);
        assert_eq!(c.store.memory_capacity, Some(1 << 30));
        assert_eq!(
            Config::load(Args {
                scrub_rate: Some("100MB/s".into()),
                store_group: Some("root".into()),
                ..tls_args()
            })
            .unwrap()
            .store
            .scrub_rate,
            100_000_000
        );
        for bad in [
            Args {
                scrub_rate: Some("unlimited".into()),
                ..tls_args()
            },
            Args {
                store_group: Some("no-such-group-here".into()),
                ..tls_args()
            },
            Args {
                reverify_after_ms: Some(u64::MAX),
                ..tls_args()
            },
        ] {
            assert!(Config::load(bad).is_err());
        }
    }

    #[test]
    fn origin_allow_from_flags_env_style_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        std::fs::write(
            &path,
            "origin_allow = [\"file:///data/models/\", \"https://m.example.com/org/\"]\n",
        )
        .unwrap();
        let c = Config::load(Args {
            config: Some(path.clone()),
            ..tls_args()
        })
        .unwrap();
        assert_eq!(c.chain.origins.policy().prefixes().len(), 2);
        // Flags replace the file's list.
        let c = Config::load(Args {
            config: Some(path),
            origin_allow: vec!["file:///srv/a".into()],
            ..tls_args()
        })
        .unwrap();
        assert_eq!(c.chain.origins.policy().describe(), "file:///srv/a/");
        // Nothing configured: nothing allowed.
        let c = Config::load(tls_args()).unwrap();
        assert!(c.chain.origins.policy().is_empty());
        let err = Config::load(Args {
            origin_allow: vec!["ftp://x/".into()],
            ..tls_args()
        })
        .unwrap_err();
        assert!(err.to_string().contains("origin_allow"), "{err}");
        let err = Config::load(Args {
            peer_idle_timeout_s: Some(0),
            ..tls_args()
        })
        .unwrap_err();
        assert!(err.to_string().contains("peer_idle_timeout_s"), "{err}");
    }

    #[test]
    fn gpu_budget_is_a_share_or_a_size_and_a_cap() {
        let budget = |args: Args| Config::load(args).map(|c| c.gpu.budget);
        assert_eq!(budget(tls_args()).unwrap(), GpuBudget::Fraction(0.8));
        for (v, want) in [
            ("0.5", GpuBudget::Fraction(0.5)),
            ("75%", GpuBudget::Fraction(0.75)),
            ("60GiB", GpuBudget::Bytes(60 << 30)),
        ] {
            let got = budget(Args {
                gpu_budget: Some(v.into()),
                ..tls_args()
            })
            .unwrap();
            assert_eq!(got, want, "{v}");
        }
        for bad in ["2", "0", "150%", "1MiB", "lots"] {
            let err = budget(Args {
                gpu_budget: Some(bad.into()),
                ..tls_args()
            })
            .unwrap_err();
            assert!(err.to_string().contains("gpu_budget"), "{bad}: {err}");
        }
        // The old name still works, as a share, and is a cap like the new one.
        assert_eq!(
            budget(Args {
                gpu_budget_fraction: Some(0.6),
                ..tls_args()
            })
            .unwrap(),
            GpuBudget::Fraction(0.6)
        );
        let err = budget(Args {
            gpu_budget: Some("0.5".into()),
            gpu_budget_fraction: Some(0.6),
            ..tls_args()
        })
        .unwrap_err();
        assert!(err.to_string().contains("not both"), "{err}");

        // In the file: a number or a string; flags override it.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        for (text, want) in [
            ("gpu_budget = 0.7\n", GpuBudget::Fraction(0.7)),
            ("gpu_budget = 1\n", GpuBudget::Fraction(1.0)),
            ("gpu_budget = \"40GiB\"\n", GpuBudget::Bytes(40 << 30)),
            ("gpu_budget_fraction = 0.9\n", GpuBudget::Fraction(0.9)),
        ] {
            std::fs::write(&path, text).unwrap();
            let got = budget(Args {
                config: Some(path.clone()),
                ..tls_args()
            })
            .unwrap();
            assert_eq!(got, want, "{text}");
        }
        let got = budget(Args {
            config: Some(path.clone()),
            gpu_budget: Some("10GiB".into()),
            ..tls_args()
        })
        .unwrap();
        assert_eq!(got, GpuBudget::Bytes(10 << 30));
        std::fs::write(&path, "gpu_budget = 80\n").unwrap();
        let err = budget(Args {
            config: Some(path),
            ..tls_args()
        })
        .unwrap_err();
        assert!(
            err.to_string().contains("give a size with its unit"),
            "{err}"
        );
    }

    #[test]
    fn example_config_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("transferd.example.toml");
        Config::load(Args {
            config: Some(path),
            ..Args::default()
        })
        .unwrap();
    }
}
