//! Configuration in layers: built-in defaults < TOML file (`--config`, `SHARDCAST_CONFIG`)
//! < environment (`SHARDCAST_*`) < command-line flags, merged by the loader shared with the
//! controller ([`shardcast_protocol::layered`]). Every setting is one field of `Settings`:
//! a file key, a flag (`--file-key`) and an environment variable (declared on [`Args`]).
//! An unknown key or an ill-typed value is refused naming the key and where it came from,
//! and [`Config::from_matches`] then validates everything into [`Config`], so a bad setting
//! stops the daemon with a clear message (exit 2) before any port is bound. Keys ending in
//! `_ms`/`_s` also take a duration with its unit (`"10s"`), sizes a unit (`"4GiB"`).
//! `--print-config` (`layered::PrintConfig`, shared with the controller) prints the effective
//! settings with each value's origin and exits. The TLS identity or the insecure mode is
//! chosen by `shardcast_identity::process::Security`, shared with the controller too; the
//! flags themselves stay here, as their help and some environment variables are transferd's
//! own. The example `transferd/transferd.example.toml` documents every field (a test keeps
//! it so).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{CommandFactory, Parser};
use serde::{Deserialize, Serialize};
use shardcast_identity::otlp::{OtlpEndpoint, TraceExport};
use shardcast_protocol::HostId;
use shardcast_protocol::layered::{Layers, Origin, PrintConfig};
use shardcast_protocol::units::{self, parse_rate, parse_size};

use gpu_loader::loader::FreshMappings;
use gpu_loader::manager::{BackendChoice, GpuBudget, ManagerConfig};
use gpu_loader::sim::SimOptions;

use shardcast_protocol::origin_policy::{Enforcer, OriginPolicy};

use crate::chain::{ChainConfig, parse_fault_list};
use crate::limits::Limits;
use crate::origin::OriginAccess;
use crate::store::{StoreConfig, WriterKind};
use crate::transport::DataMode;
use crate::transport::quic::{MAX_PATH_MTU, MIN_PATH_MTU};

/// The command line. Every flag has an environment variable (`SHARDCAST_*`) and a key of the
/// same name in the TOML file; values are read as text here and typed by the layered
/// loader ([`Config::from_matches`]), so a bad value names where it came from.
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
    /// `--print-config`.
    #[command(flatten)]
    pub print_config: PrintConfig,
    /// This host's id in the cluster [default: the hostname].
    #[arg(long, env = "SHARDCAST_HOST_ID")]
    pub host_id: Option<String>,
    /// Data-plane listener (hop-to-hop chains) [default: 0.0.0.0:7400].
    #[arg(long, env = "SHARDCAST_LISTEN")]
    pub listen: Option<String>,
    /// QUIC listener (UDP) on the data listener's address and port, so sessions whose plan
    /// asks for QUIC reach this host; it uses the TLS identity, so `insecure_plaintext`
    /// turns it off [default: true].
    #[arg(long, env = "SHARDCAST_QUIC")]
    pub quic: Option<String>,
    /// UDP payload size every path between hosts is known to carry (8972 on an IPv4 network
    /// with 9000-byte jumbo frames, 8952 over IPv6): QUIC sends packets this large from the first one, without
    /// discovery and without falling back below it. Only where the network guarantees it:
    /// a larger packet than a path carries is lost, and the connection with it
    /// [default: none: discovery from 1200 up to 1472 bytes].
    #[arg(long, env = "SHARDCAST_QUIC_PATH_MTU")]
    pub quic_path_mtu: Option<String>,
    /// QUIC connections kept to each peer host, 1 to 16: a hop's streams (sessions, shards,
    /// stripes) are spread over them in turn. Each connection is driven by its own task, so
    /// its encryption and packet work can run on its own core; but each also has its own
    /// congestion controller, and on a rate-capped link several lose more packets than one
    /// [default: 1].
    #[arg(long, env = "SHARDCAST_QUIC_CONNECTIONS")]
    pub quic_connections: Option<String>,
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
    pub tokens_file: Option<String>,
    /// Milliseconds an admin client has to send a request head (from the connection's
    /// start or the first byte after a keep-alive pause); also the longest pause inside
    /// a request body [default: 10000].
    #[arg(long, env = "SHARDCAST_ADMIN_HEADER_TIMEOUT_MS")]
    pub admin_header_timeout_ms: Option<String>,
    /// Milliseconds a keep-alive admin connection may wait for its next request
    /// [default: 60000].
    #[arg(long, env = "SHARDCAST_ADMIN_IDLE_TIMEOUT_MS")]
    pub admin_idle_timeout_ms: Option<String>,
    /// Milliseconds between SIGTERM and the start of shutdown, while `/readyz` answers 503
    /// and gRPC health NOT_SERVING and everything else serves as before, so probes and load
    /// balancers stop sending work first [default: 0].
    #[arg(long, env = "SHARDCAST_SHUTDOWN_DELAY_MS")]
    pub shutdown_delay_ms: Option<String>,
    /// Memory tier directory, on tmpfs [default: /dev/shm/shardcast].
    #[arg(long, env = "SHARDCAST_MEMORY_DIR")]
    pub memory_dir: Option<String>,
    /// Disk tier directory [default: /var/lib/shardcast].
    #[arg(long, env = "SHARDCAST_DATA_DIR")]
    pub data_dir: Option<String>,
    /// Egress cap for all sessions together, e.g. 1Gbit, 100MB/s, unlimited [default: unlimited].
    #[arg(long, env = "SHARDCAST_EGRESS_RATE")]
    pub egress_rate: Option<String>,
    /// Ingress cap for all sessions together [default: unlimited].
    #[arg(long, env = "SHARDCAST_INGRESS_RATE")]
    pub ingress_rate: Option<String>,
    /// Unacknowledged chunks per downstream connection [default: 16].
    #[arg(long, env = "SHARDCAST_WINDOW")]
    pub window: Option<String>,
    /// Milliseconds a hop waits for a replacement upstream before fetching from the
    /// fallback source [default: 2000].
    #[arg(long, env = "SHARDCAST_UPSTREAM_GRACE_MS")]
    pub upstream_grace_ms: Option<String>,
    /// Seconds a hop waits for a peer's answer while setting up a connection (`Hello`,
    /// `Accept`) or for a holder answering `Fetch` [default: 30].
    #[arg(long, env = "SHARDCAST_IDLE_TIMEOUT_S")]
    pub idle_timeout_s: Option<String>,
    /// Milliseconds without progress after which a neighbour hop (upstream or downstream)
    /// is stalled — dead, stopped or cut off — and bypassed [default: 2000; at least 200].
    #[arg(long, env = "SHARDCAST_STALL_TIMEOUT_MS")]
    pub stall_timeout_ms: Option<String>,
    /// Concurrent range reads from an origin [default: 8].
    #[arg(long, env = "SHARDCAST_ORIGIN_PARALLEL")]
    pub origin_parallel: Option<String>,
    /// Chunks verified and stored concurrently per upstream connection [default: 4].
    #[arg(long, env = "SHARDCAST_PIPELINE_DEPTH")]
    pub pipeline_depth: Option<String>,
    /// Re-hash chunks marked verified when recovering the store at startup [default: true].
    #[arg(long, env = "SHARDCAST_VERIFY_ON_RECOVER")]
    pub verify_on_recover: Option<String>,
    /// Positional writer: auto, pwrite, io-uring, mapped or adaptive [default: auto].
    #[arg(long, env = "SHARDCAST_WRITER")]
    pub writer: Option<String>,
    /// Group (name or gid) given to the store's files, with modes 0750/0640, so inference
    /// processes in it can map the memory tier [default: none; modes 0700/0600].
    #[arg(long, env = "SHARDCAST_STORE_GROUP")]
    pub store_group: Option<String>,
    /// Milliseconds a verified chunk stays trusted; older ones are re-hashed before they
    /// are served, loaded onto GPUs or handed off (0: always) [default: 1000].
    #[arg(long, env = "SHARDCAST_REVERIFY_AFTER_MS")]
    pub reverify_after_ms: Option<String>,
    /// Re-hash untrusted chunks before the forwarder sends them down a chain too; without
    /// it the receiver's verification and `Nack` are the check [default: false].
    #[arg(long, env = "SHARDCAST_REVERIFY_SENDS")]
    pub reverify_sends: Option<String>,
    /// Rate at which the background scrub re-hashes idle chunks, e.g. 64MB/s; 0 or off
    /// turns it off [default: 64MB/s].
    #[arg(long, env = "SHARDCAST_SCRUB_RATE")]
    pub scrub_rate: Option<String>,
    /// Log format: text or json [default: text].
    #[arg(long, env = "SHARDCAST_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// Export spans as OTLP traces to this collector on loopback, e.g.
    /// http://127.0.0.1:4318 (needs a build with the `otlp` feature) [default: none, off].
    #[arg(long, env = "SHARDCAST_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
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
    /// Memory-tier bytes kept as spare files of allocated pages, filled while the host is
    /// idle, for new shards to be written into without allocating pages (a cold start's
    /// largest receiving cost on tmpfs); they give way to shards, the capacity and the
    /// headroom. e.g. 16GiB; 0 turns it off [default: 0].
    #[arg(long, env = "SHARDCAST_MEMORY_RESERVE")]
    pub memory_reserve: Option<String>,
    /// Size of each spare of the memory reserve: best the size of the shards this host
    /// receives, e.g. 5GB; auto sizes new spares like the largest shard of the last model
    /// received into the memory tier (1GiB until one is) [default: auto].
    #[arg(long, env = "SHARDCAST_MEMORY_RESERVE_SPARE")]
    pub memory_reserve_spare: Option<String>,
    /// GPUs reported to the controller until the GPU loader detects them [default: 0].
    #[arg(long, env = "SHARDCAST_GPUS")]
    pub gpus: Option<String>,
    /// Memory of each reported GPU, e.g. 80GiB [default: 0].
    #[arg(long, env = "SHARDCAST_GPU_MEMORY")]
    pub gpu_memory: Option<String>,
    /// Milliseconds between heartbeats to the controller [default: 1000].
    #[arg(long, env = "SHARDCAST_HEARTBEAT_MS")]
    pub heartbeat_ms: Option<String>,
    /// GPU backend: auto (CUDA if a driver is present), cuda, simulated or none [default: auto].
    #[arg(long, env = "SHARDCAST_GPU_BACKEND")]
    pub gpu_backend: Option<String>,
    /// Simulated GPUs (gpu_backend = simulated) [default: 2].
    #[arg(long, env = "SHARDCAST_SIM_GPUS")]
    pub sim_gpus: Option<String>,
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
    pub sim_gpus_busy: Option<String>,
    /// The most memory this host takes on each GPU for models: a share (0.8, 80%) or a size
    /// per GPU (60GiB). A cap, not a reservation: nothing is allocated at start, a model's
    /// region is allocated when it loads and freed when it is evicted [default: 0.8].
    #[arg(long, env = "SHARDCAST_GPU_BUDGET")]
    pub gpu_budget: Option<String>,
    /// Old name of gpu_budget given as a share (0.01–1); like gpu_budget, now a cap.
    #[arg(long, env = "SHARDCAST_GPU_BUDGET_FRACTION", hide = true)]
    pub gpu_budget_fraction: Option<String>,
    /// Evict resident models (light ones and extra replicas first, LRU) when a new load
    /// does not fit a GPU, instead of refusing it [default: true].
    #[arg(long, env = "SHARDCAST_GPU_AUTO_EVICT")]
    pub gpu_auto_evict: Option<String>,
    /// Pinned staging buffers per load [default: 8].
    #[arg(long, env = "SHARDCAST_STAGING_BUFFERS")]
    pub staging_buffers: Option<String>,
    /// Bytes per staging buffer (one host-to-device copy each), or auto: calibrated at the
    /// elbow of throughput vs. transfer size on CUDA, 4MiB otherwise [default: auto].
    #[arg(long, env = "SHARDCAST_STAGING_SIZE")]
    pub staging_size: Option<String>,
    /// Threads copying verified chunks into the staging buffers of one load (one core's
    /// memcpy is slower than PCIe Gen5) [default: the CPU count, at most 4].
    #[arg(long, env = "SHARDCAST_STAGING_FILL_THREADS")]
    pub staging_fill_threads: Option<String>,
    /// Register the memory tier's shard mappings with the GPU (pinned host memory) and copy
    /// from them directly, with no CPU copy into staging; the staging ring is the fallback
    /// when registration fails [default: true].
    #[arg(long, env = "SHARDCAST_REGISTER_HOST")]
    pub register_host: Option<String>,
    /// With register_host: register the memory tier's complete shards with the GPU while no
    /// load runs, so that even the first GPU load of a model already in memory copies
    /// without pinning first [default: true].
    #[arg(long, env = "SHARDCAST_REGISTER_AHEAD")]
    pub register_ahead: Option<String>,
    /// With register_host: what a GPU load does with shards not registered yet (they
    /// arrived since register-ahead last ran, as in a cold start that streams a model into
    /// a GPU while it lands): stage, copy them through the staging ring and leave them to
    /// register-ahead; register, pin them as it copies (the driver serialises pinning with
    /// the copies, and a fresh mapping pins at 16 GB/s on an H200); auto, stage when
    /// register_ahead is on, else register [default: auto].
    #[arg(long, env = "SHARDCAST_FRESH_MAPPINGS")]
    pub fresh_mappings: Option<String>,
    /// Copy streams per GPU for copies from registered shard mappings, 1 to 8 [default: 4].
    #[arg(long, env = "SHARDCAST_COPY_STREAMS")]
    pub copy_streams: Option<String>,
    /// Cluster CA bundle (PEM) that peers' and the controller's certificates must chain to.
    #[arg(long, env = "SHARDCAST_TLS_CA")]
    pub tls_ca: Option<String>,
    /// This host's certificate (PEM), naming `shardcast://host/<host_id>`
    /// (`shardcast certs issue --role host --name <host_id>`).
    #[arg(long, env = "SHARDCAST_TLS_CERT")]
    pub tls_cert: Option<String>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "SHARDCAST_TLS_KEY")]
    pub tls_key: Option<String>,
    /// Seconds before tls_cert's (or a CA of tls_ca's) notAfter from which the daemon logs
    /// a WARN, at start, on each reload and when it gets there while running (ERROR once
    /// expired); e.g. 14d, 0 for expired only. The seconds left are the gauge
    /// shardcast_certificate_expiry_seconds [default: 14d].
    #[arg(long, env = "SHARDCAST_CERT_EXPIRY_WARNING_S")]
    pub cert_expiry_warning_s: Option<String>,
    /// INSECURE: no TLS and no authentication on any listener. Refused unless every
    /// TCP listener is on loopback. For benchmarks and experiments only [default: false].
    #[arg(long, env = "SHARDCAST_INSECURE_PLAINTEXT")]
    pub insecure_plaintext: Option<String>,
    /// With data_mode = authenticate-only or insecure_plaintext: send chunk payloads from
    /// the store's files with sendfile (no copy through user space; copied instead where
    /// the kernel refuses). Measured slower on loopback, so off [default: false].
    #[arg(long, env = "SHARDCAST_SENDFILE")]
    pub sendfile: Option<String>,
    /// Forward chunks in verified 256 KiB pieces (protocol version 7): each piece is
    /// checked against the manifest's hash (through the BLAKE3 tree) as it lands and sent
    /// on at once, so a chunk crosses each hop a piece behind instead of a chunk behind.
    /// Off sends chunks whole; receivers take both [default: true].
    #[arg(long, env = "SHARDCAST_PIECES")]
    pub pieces: Option<String>,
    /// How the data port (TCP) protects what crosses it: `tls` encrypts every byte with
    /// mutual TLS; `authenticate-only` (for a trusted fabric) authenticates both ends with
    /// the same mutual-TLS handshake and each session with its plan token, then sends
    /// frames unencrypted: every chunk is still verified against the manifest's BLAKE3
    /// hashes, confidentiality is given up (docs/SECURITY.md). Both ends of every hop must
    /// use the same mode; QUIC always encrypts [default: tls].
    #[arg(long, env = "SHARDCAST_DATA_MODE")]
    pub data_mode: Option<String>,
    /// Connections (sessions) each shard of a chain this host heads is striped over, so
    /// each hop handles one shard on several cores; hops below follow. `auto`: one per
    /// shard below 8 cores, else half the cores (at most 8) per chain, shared among its
    /// shards [default: auto; a number is 1 to 16; fewer for shards under 4 chunks a stripe].
    #[arg(long, env = "SHARDCAST_STRIPES")]
    pub stripes: Option<String>,
    /// Hash each received chunk's payload while it arrives (one pass over memory fewer),
    /// rather than in one pass on the blocking pool before storing it (the hash then runs
    /// beside the connection's next read on another core): true, false or `auto`, which is
    /// true below 8 cores [default: auto].
    #[arg(long, env = "SHARDCAST_HASH_ON_READ")]
    pub hash_on_read: Option<String>,
    /// Threads that run the daemon's async tasks (sockets, decryption, hashing as bytes
    /// arrive, sending); file writes and hashing run on a separate blocking pool. `auto`:
    /// one per core this process may use (its CPU affinity and cgroup quota). Set fewer on
    /// a host shared with inference servers, or where many daemons share few cores
    /// [default: auto; a number is 1 to 1024].
    #[arg(long, env = "SHARDCAST_WORKER_THREADS")]
    pub worker_threads: Option<String>,
    /// Allowed origin prefixes (repeatable or comma-separated): `file:///data/models/`,
    /// `https://models.example.com/org/`. Every origin this host opens must lie under
    /// one [default: none, so every origin is refused].
    #[arg(long, env = "SHARDCAST_ORIGIN_ALLOW", value_delimiter = ',')]
    pub origin_allow: Vec<String>,
    /// Milliseconds an accepted data-plane connection has to complete the `Hello`
    /// exchange [default: 10000].
    #[arg(long, env = "SHARDCAST_HANDSHAKE_TIMEOUT_MS")]
    pub handshake_timeout_ms: Option<String>,
    /// Seconds a connected peer may stay silent while this host waits for its next frame
    /// or the rest of a frame [default: 60].
    #[arg(long, env = "SHARDCAST_PEER_IDLE_TIMEOUT_S")]
    pub peer_idle_timeout_s: Option<String>,
    /// Seconds a write to a peer may take to drain before the connection is dropped
    /// [default: 30].
    #[arg(long, env = "SHARDCAST_WRITE_TIMEOUT_S")]
    pub write_timeout_s: Option<String>,
    /// Data-plane connections accepted at once, from all peers [default: 8192].
    #[arg(long, env = "SHARDCAST_MAX_CONNECTIONS")]
    pub max_connections: Option<String>,
    /// Data-plane connections accepted at once from one IP address [default: 1024].
    #[arg(long, env = "SHARDCAST_MAX_CONNECTIONS_PER_IP")]
    pub max_connections_per_ip: Option<String>,
    /// Hop sessions (session × shard) held at once; more `Open`s are refused
    /// [default: 4096].
    #[arg(long, env = "SHARDCAST_MAX_SESSIONS")]
    pub max_sessions: Option<String>,
    /// Memory for frame bodies in flight on the data port, across all connections
    /// (e.g. 512MiB); a frame that does not fit waits [default: 512MiB].
    #[arg(long, env = "SHARDCAST_FRAME_MEMORY")]
    pub frame_memory: Option<String>,
    /// Milliseconds a stopping transferd (SIGTERM, Ctrl-C) drains before it ends what is
    /// left: it finishes the sessions it runs and starts no new one; a second signal ends
    /// the drain at once; 0 stops at once [default: 20000]. Keep the service manager's stop
    /// timeout above this plus 5 s.
    #[arg(long, env = "SHARDCAST_DRAIN_GRACE_MS")]
    pub drain_grace_ms: Option<String>,
}

/// `gpu_budget`: a share as a number (`0.8`) or text (`"80%"`, `"60GiB"`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
enum BudgetValue {
    Number(f64),
    Text(String),
}

/// Every setting, as the layered loader reads it: a key of the TOML file, a flag and an
/// environment variable each. `Default` is the built-in layer; `None` is no value (the
/// field's fallback in [`Config::from_matches`] applies, e.g. the hostname for `host_id`).
/// Keys ending in `_ms` or `_s` take a number in that unit or a duration with its own
/// (`"2s"`); sizes take bytes or a size with its unit (`"512MiB"`); rates are text
/// (`"1Gbit"`, `"100MB/s"`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
struct Settings {
    host_id: Option<String>,
    listen: SocketAddr,
    quic: bool,
    quic_path_mtu: Option<u16>,
    quic_connections: u16,
    agent_listen: String,
    admin_listen: String,
    tokens_file: Option<PathBuf>,
    #[serde(with = "units::millis")]
    admin_header_timeout_ms: u64,
    #[serde(with = "units::millis")]
    admin_idle_timeout_ms: u64,
    #[serde(with = "units::millis")]
    shutdown_delay_ms: u64,
    memory_dir: PathBuf,
    data_dir: PathBuf,
    egress_rate: String,
    ingress_rate: String,
    window: usize,
    #[serde(with = "units::millis")]
    upstream_grace_ms: u64,
    #[serde(with = "units::seconds")]
    idle_timeout_s: u64,
    #[serde(with = "units::millis")]
    stall_timeout_ms: u64,
    origin_parallel: usize,
    pipeline_depth: usize,
    verify_on_recover: bool,
    writer: String,
    store_group: Option<String>,
    #[serde(with = "units::millis")]
    reverify_after_ms: u64,
    reverify_sends: bool,
    scrub_rate: String,
    log_format: String,
    otlp_endpoint: Option<String>,
    controller: Option<String>,
    advertise: Option<String>,
    agent_advertise: Option<String>,
    zone: String,
    rack: String,
    nic_rate: Option<String>,
    #[serde(with = "units::opt_size")]
    memory_capacity: Option<u64>,
    #[serde(with = "units::opt_size")]
    disk_capacity: Option<u64>,
    #[serde(with = "units::opt_size")]
    memory_headroom: Option<u64>,
    #[serde(with = "units::size")]
    memory_reserve: u64,
    memory_reserve_spare: Auto<ByteSize>,
    gpus: u32,
    #[serde(with = "units::size")]
    gpu_memory: u64,
    #[serde(with = "units::millis")]
    heartbeat_ms: u64,
    gpu_backend: String,
    sim_gpus: u32,
    #[serde(with = "units::size")]
    sim_gpu_memory: u64,
    sim_pcie_rate: String,
    sim_nvlink_rate: String,
    sim_gpus_busy: u32,
    gpu_budget: Option<BudgetValue>,
    gpu_budget_fraction: Option<f64>,
    gpu_auto_evict: bool,
    staging_buffers: usize,
    staging_size: String,
    staging_fill_threads: usize,
    register_host: bool,
    register_ahead: bool,
    fresh_mappings: String,
    copy_streams: usize,
    tls_ca: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    #[serde(with = "units::seconds")]
    cert_expiry_warning_s: u64,
    insecure_plaintext: bool,
    sendfile: bool,
    pieces: bool,
    data_mode: DataMode,
    stripes: Auto<usize>,
    hash_on_read: Auto<bool>,
    worker_threads: Auto<usize>,
    origin_allow: Vec<String>,
    #[serde(with = "units::millis")]
    handshake_timeout_ms: u64,
    #[serde(with = "units::seconds")]
    peer_idle_timeout_s: u64,
    #[serde(with = "units::seconds")]
    write_timeout_s: u64,
    max_connections: usize,
    max_connections_per_ip: usize,
    max_sessions: usize,
    #[serde(with = "units::size")]
    frame_memory: u64,
    #[serde(with = "units::millis")]
    drain_grace_ms: u64,
}

impl Default for Settings {
    fn default() -> Self {
        let chain = ChainConfig::default();
        let limits = Limits::default();
        let http = shardcast_identity::http::HttpLimits::default();
        let gpu = ManagerConfig::default();
        let ms = |d: Duration| d.as_millis() as u64;
        Self {
            host_id: None,
            listen: ([0, 0, 0, 0], 7400).into(),
            quic: true,
            quic_path_mtu: None,
            quic_connections: 1,
            // The agent API drives imports, chains, loads and evictions: loopback unless the
            // operator opens it (the controller then reaches it over mutual TLS).
            agent_listen: "127.0.0.1:7401".into(),
            admin_listen: "127.0.0.1:7402".into(),
            tokens_file: None,
            admin_header_timeout_ms: ms(http.header_timeout),
            admin_idle_timeout_ms: ms(http.idle_timeout),
            shutdown_delay_ms: 0,
            memory_dir: "/dev/shm/shardcast".into(),
            data_dir: "/var/lib/shardcast".into(),
            egress_rate: "unlimited".into(),
            ingress_rate: "unlimited".into(),
            window: chain.window,
            upstream_grace_ms: ms(chain.upstream_grace),
            idle_timeout_s: chain.idle_timeout.as_secs(),
            stall_timeout_ms: ms(chain.stall_timeout),
            origin_parallel: chain.origin_parallel,
            pipeline_depth: chain.pipeline_depth,
            verify_on_recover: true,
            writer: "auto".into(),
            store_group: None,
            reverify_after_ms: ms(crate::store::DEFAULT_REVERIFY_AFTER),
            reverify_sends: false,
            scrub_rate: format!("{}MB/s", crate::store::DEFAULT_SCRUB_RATE / 1_000_000),
            log_format: "text".into(),
            otlp_endpoint: None,
            controller: None,
            advertise: None,
            agent_advertise: None,
            zone: String::new(),
            rack: String::new(),
            nic_rate: None,
            memory_capacity: None,
            disk_capacity: None,
            memory_headroom: None,
            memory_reserve: 0,
            memory_reserve_spare: Auto::Auto,
            gpus: 0,
            gpu_memory: 0,
            heartbeat_ms: 1000,
            gpu_backend: "auto".into(),
            sim_gpus: 2,
            sim_gpu_memory: 1 << 30,
            sim_pcie_rate: "2GB/s".into(),
            sim_nvlink_rate: "8GB/s".into(),
            sim_gpus_busy: 0,
            gpu_budget: None,
            gpu_budget_fraction: None,
            gpu_auto_evict: true,
            staging_buffers: 8,
            staging_size: "auto".into(),
            staging_fill_threads: gpu.load.fill_threads,
            register_host: gpu.load.register_host,
            register_ahead: gpu.register_ahead,
            fresh_mappings: "auto".into(),
            copy_streams: gpu.load.copy_streams,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            cert_expiry_warning_s: shardcast_identity::expiry::EXPIRY_WARNING.as_secs(),
            insecure_plaintext: false,
            sendfile: chain.sendfile,
            pieces: chain.pieces,
            data_mode: DataMode::default(),
            stripes: Auto::Auto,
            hash_on_read: Auto::Auto,
            worker_threads: Auto::Auto,
            origin_allow: Vec::new(),
            drain_grace_ms: ms(DEFAULT_DRAIN_GRACE),
            handshake_timeout_ms: ms(limits.handshake_timeout),
            peer_idle_timeout_s: limits.peer_idle_timeout.as_secs(),
            write_timeout_s: limits.write_timeout.as_secs(),
            max_connections: limits.max_connections,
            max_connections_per_ip: limits.max_connections_per_ip,
            max_sessions: limits.max_sessions,
            frame_memory: limits.frame_memory as u64,
        }
    }
}

/// The GPU budget from `gpu_budget` or its old name `gpu_budget_fraction`: the one from the
/// higher layer (flags and environment over the file over the default); both from one
/// layer is refused.
fn gpu_budget(s: &Settings, layers: &Layers) -> anyhow::Result<GpuBudget> {
    let rank = |key: &str| layers.origin(key).map_or(0, Origin::rank);
    let from_budget = |v: &BudgetValue| {
        let text = match v {
            BudgetValue::Number(f) => f.to_string(),
            BudgetValue::Text(t) => t.clone(),
        };
        text.parse::<GpuBudget>()
            .map_err(|e| anyhow::anyhow!("gpu_budget: {e}"))
    };
    let from_fraction =
        |f: f64| GpuBudget::fraction(f).map_err(|e| anyhow::anyhow!("gpu_budget_fraction: {e}"));
    match (&s.gpu_budget, s.gpu_budget_fraction) {
        (Some(_), Some(_)) if rank("gpu_budget") == rank("gpu_budget_fraction") => {
            let layer = match layers.origin("gpu_budget") {
                Some(Origin::File(p)) => format!("config file {}", p.display()),
                _ => "flags and environment".into(),
            };
            bail!("{layer}: set gpu_budget or its old name gpu_budget_fraction, not both")
        }
        (Some(b), Some(f)) => {
            if rank("gpu_budget") > rank("gpu_budget_fraction") {
                from_budget(b)
            } else {
                from_fraction(f)
            }
        }
        (Some(b), None) => from_budget(b),
        (None, Some(f)) => from_fraction(f),
        (None, None) => Ok(GpuBudget::default()),
    }
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
    /// Threads of the async runtime (`None`: `auto`, one per core this process may use).
    pub worker_threads: Option<usize>,
    /// This host's id.
    pub host_id: HostId,
    /// Data-plane listener.
    pub listen: SocketAddr,
    /// Whether the QUIC listener is bound too (UDP, same address and port as `listen`).
    pub quic: bool,
    /// The UDP payload size every path is declared to carry (`None`: discovered).
    pub quic_path_mtu: Option<u16>,
    /// QUIC connections kept to each peer host (1 to 16).
    pub quic_connections: usize,
    /// Agent gRPC listener.
    pub agent_listen: ListenAddr,
    /// Admin HTTP listener.
    pub admin_listen: ListenAddr,
    /// Bearer tokens for the admin listener.
    pub tokens_file: Option<PathBuf>,
    /// Timeouts of the admin listener's clients.
    pub admin_limits: shardcast_identity::http::HttpLimits,
    /// Time between SIGTERM and the start of shutdown, not ready all along.
    pub shutdown_delay: Duration,
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
    /// Where spans are exported as OTLP traces (`None`: nowhere).
    pub traces: Option<TraceExport>,
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
    /// How long before the certificate's (or the CA's) end the daemon warns.
    pub cert_expiry_warning: Duration,
    /// How long a stopping daemon drains ([`crate::daemon`]); zero: it stops at once.
    pub drain_grace: Duration,
}

/// Default of [`Config::drain_grace`]. Rationale: long enough for a hop to finish a
/// multi-GiB range at a few Gbit/s, and with transferd's 5 s to wind down after it, inside
/// Kubernetes' default 30 s termination grace.
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(20);

/// How the daemon authenticates everything that connects to it: mutual TLS under the
/// cluster CA on the data port and the agent API, or (`insecure_plaintext`, loopback only)
/// nothing. Chosen by the process shell both daemons share.
pub use shardcast_identity::process::Security;

/// The TLS identity from the settings, or the insecure mode, refused in the words of
/// transferd's settings.
fn security(
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    insecure: bool,
    listeners: &[(&str, Option<SocketAddr>)],
) -> anyhow::Result<Security> {
    use shardcast_identity::process::SecurityError;
    Security::choose(ca, cert, key, insecure, listeners).map_err(|e| match e {
        SecurityError::NotLoopback { listener, addr } => anyhow::anyhow!(
            "insecure_plaintext is only allowed when every listener is on loopback, but {listener} is {addr}"
        ),
        SecurityError::Missing(missing) => anyhow::anyhow!(
            "mutual TLS is required: set {} (create a CA and this host's certificate with \
             `shardcast certs init` and `shardcast certs issue --role host --name <host_id>`), \
             or set insecure_plaintext = true with loopback listeners only",
            missing.join(", ")
        ),
    })
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

/// A loaded configuration with its settings and where each came from.
#[derive(Debug)]
pub struct Loaded {
    /// The validated configuration.
    pub config: Config,
    settings: Settings,
    layers: Layers,
}

impl Loaded {
    /// The effective settings as TOML, each value followed by its origin (`--print-config`).
    pub fn render(&self) -> anyhow::Result<String> {
        Ok(format!(
            "# transferd: the effective configuration; after each value, where it came from\n{}",
            self.layers.render(&self.settings)?
        ))
    }
}

impl Config {
    /// Loads the configuration from a command line (`argv[0]` first) and the process
    /// environment: see [`Config::from_matches`].
    pub fn from_args<I, T>(argv: I) -> anyhow::Result<Loaded>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = Args::command().try_get_matches_from(argv)?;
        Self::from_matches(&matches)
    }

    /// Layers built-in defaults < the TOML file (`--config`, `SHARDCAST_CONFIG`) <
    /// environment variables < flags (what clap read into `matches`), refuses an unknown or
    /// ill-typed key naming it and its origin, and validates. Nothing is bound here.
    pub fn from_matches(matches: &clap::ArgMatches) -> anyhow::Result<Loaded> {
        let layers =
            Layers::from_command_line(&Settings::default(), &Args::command(), matches, |p| {
                std::fs::read_to_string(p)
            })?;
        let settings: Settings = layers.extract()?;
        let config = Self::validate(&settings, &layers).map_err(|e| {
            let message = format!("{e:#}");
            anyhow::anyhow!("{message}{}", layers.explain(&message))
        })?;
        Ok(Loaded {
            config,
            settings,
            layers,
        })
    }

    /// The checks and conversions the types of [`Settings`] do not already make.
    fn validate(s: &Settings, layers: &Layers) -> anyhow::Result<Self> {
        let host_id = s.host_id.clone().unwrap_or_else(default_host_id);
        let host_id =
            HostId::new(&host_id).with_context(|| format!("invalid host_id {host_id:?}"))?;
        let rate = |name: &str, v: &str| -> anyhow::Result<Option<u64>> {
            parse_rate(v).map_err(|e| anyhow::anyhow!("{name}: {e}"))
        };
        let window = bounded("window", s.window, 4096)?;
        if let Some(m) = s.quic_path_mtu
            && !(MIN_PATH_MTU..=MAX_PATH_MTU).contains(&m)
        {
            bail!(
                "quic_path_mtu must be between {MIN_PATH_MTU} and {MAX_PATH_MTU} bytes (a UDP \
                 payload), got {m}"
            );
        }
        let quic_connections = bounded("quic_connections", usize::from(s.quic_connections), 16)?;
        let origin_parallel = bounded("origin_parallel", s.origin_parallel, 256)?;
        let pipeline_depth = bounded("pipeline_depth", s.pipeline_depth, 64)?;
        if s.idle_timeout_s == 0 {
            bail!("idle_timeout_s must be at least 1");
        }
        if s.stall_timeout_ms < 200 {
            bail!(
                "stall_timeout_ms must be at least 200 (it is {})",
                s.stall_timeout_ms
            );
        }
        let origins = OriginPolicy::parse(&s.origin_allow, Enforcer::Host)
            .map_err(|e| anyhow::anyhow!("origin_allow: {e}"))?;
        let limits = {
            let secs = |name: &str, v: u64| -> anyhow::Result<Duration> {
                match v {
                    0 => bail!("{name} must be at least 1"),
                    n => Ok(Duration::from_secs(n)),
                }
            };
            if !(100..=600_000).contains(&s.handshake_timeout_ms) {
                bail!(
                    "handshake_timeout_ms must be between 100 and 600000, got {}",
                    s.handshake_timeout_ms
                );
            }
            let min_frame = shardcast_protocol::manifest::MAX_CHUNK_SIZE as u64 + 12;
            if s.frame_memory < min_frame {
                bail!(
                    "frame_memory must hold at least one chunk frame of the largest chunk size ({min_frame} bytes), got {}",
                    s.frame_memory
                );
            }
            Limits {
                handshake_timeout: Duration::from_millis(s.handshake_timeout_ms),
                peer_idle_timeout: secs("peer_idle_timeout_s", s.peer_idle_timeout_s)?,
                write_timeout: secs("write_timeout_s", s.write_timeout_s)?,
                max_connections: bounded("max_connections", s.max_connections, 1 << 20)?,
                max_connections_per_ip: bounded(
                    "max_connections_per_ip",
                    s.max_connections_per_ip,
                    1 << 20,
                )?,
                max_sessions: bounded("max_sessions", s.max_sessions, 1 << 20)?,
                frame_memory: usize::try_from(s.frame_memory).unwrap_or(usize::MAX),
            }
        };
        let writer = match s.writer.as_str() {
            "auto" => WriterKind::Auto,
            "pwrite" => WriterKind::Pwrite,
            "io-uring" | "io_uring" => WriterKind::IoUring,
            "mapped" => WriterKind::Mapped,
            "adaptive" => WriterKind::Adaptive,
            other => {
                bail!("writer must be auto, pwrite, io-uring, mapped or adaptive, got {other:?}")
            }
        };
        let json_logs = match s.log_format.as_str() {
            "text" => false,
            "json" => true,
            other => bail!("log_format must be text or json, got {other:?}"),
        };
        let traces = match &s.otlp_endpoint {
            None => None,
            Some(e) => {
                let endpoint = OtlpEndpoint::parse(e)?;
                if !cfg!(feature = "otlp") {
                    bail!(
                        "otlp_endpoint is set, but this transferd was built without the `otlp` \
                         feature (cargo build --release -p transferd --features otlp), or unset \
                         otlp_endpoint"
                    );
                }
                Some(TraceExport {
                    endpoint,
                    service_name: "transferd",
                    service_version: env!("CARGO_PKG_VERSION"),
                    instance_id: host_id.as_str().to_string(),
                })
            }
        };
        if s.memory_dir == s.data_dir {
            bail!(
                "memory_dir and data_dir must differ (both are {})",
                s.memory_dir.display()
            );
        }
        let corrupt_once =
            if std::env::var("SHARDCAST_ENABLE_FAULT_INJECTION").as_deref() == Ok("1") {
                parse_fault_list(&std::env::var("SHARDCAST_FAULT_CORRUPT").unwrap_or_default())
                    .map_err(|e| anyhow::anyhow!("SHARDCAST_FAULT_CORRUPT: {e}"))?
            } else {
                Vec::new()
            };
        let egress_rate = rate("egress_rate", &s.egress_rate)?;
        let store_group = match &s.store_group {
            Some(g) => Some(resolve_group(g).with_context(|| format!("store_group {g:?}"))?),
            None => None,
        };
        if s.reverify_after_ms > 86_400_000 {
            bail!(
                "reverify_after_ms must be at most 86400000 (a day), got {}",
                s.reverify_after_ms
            );
        }
        let scrub_rate = match s.scrub_rate.trim().to_ascii_lowercase().as_str() {
            "0" | "off" => 0,
            _ => rate("scrub_rate", &s.scrub_rate)?.ok_or_else(|| {
                anyhow::anyhow!("scrub_rate must be a rate such as 64MB/s, or off")
            })?,
        };
        if !(50..=60_000).contains(&s.heartbeat_ms) {
            bail!(
                "heartbeat_ms must be between 50 and 60000, got {}",
                s.heartbeat_ms
            );
        }
        let inventory = Inventory {
            controller: s.controller.clone(),
            advertise: s.advertise.clone(),
            agent_advertise: s.agent_advertise.clone(),
            zone: s.zone.clone(),
            rack: s.rack.clone(),
            nic_bps: match &s.nic_rate {
                Some(r) => rate("nic_rate", r)?,
                None => None,
            }
            .or(egress_rate)
            .unwrap_or(0),
            memory_capacity: s.memory_capacity,
            disk_capacity: s.disk_capacity,
            gpus: s.gpus,
            gpu_memory: s.gpu_memory,
            heartbeat: Duration::from_millis(s.heartbeat_ms),
        };
        let gpu = {
            let backend = match s.gpu_backend.as_str() {
                "auto" => BackendChoice::Auto,
                "cuda" => BackendChoice::Cuda,
                "none" => BackendChoice::None,
                "simulated" => {
                    let mut o = SimOptions::new(
                        &s.memory_dir.join("sim-gpus"),
                        s.sim_gpus,
                        s.sim_gpu_memory,
                    );
                    o.pcie_bps = rate("sim_pcie_rate", &s.sim_pcie_rate)?.unwrap_or(2_000_000_000);
                    o.nvlink_bps =
                        rate("sim_nvlink_rate", &s.sim_nvlink_rate)?.unwrap_or(8_000_000_000);
                    o.busy = s.sim_gpus_busy;
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
            let mut m = ManagerConfig {
                backend,
                // A cap on each GPU, not a reservation (see `GpuBudget`).
                budget: gpu_budget(s, layers)?,
                auto_evict: s.gpu_auto_evict,
                ..ManagerConfig::default()
            };
            m.load.staging_buffers = bounded("staging_buffers", s.staging_buffers, 1024)?;
            m.load.fill_threads = bounded("staging_fill_threads", s.staging_fill_threads, 64)?;
            m.load.register_host = s.register_host;
            m.register_ahead = s.register_ahead;
            // Without register-ahead nothing else would ever pin a shard, so staging every
            // fresh load would stage every load.
            m.load.fresh = match s.fresh_mappings.as_str() {
                "auto" if s.register_ahead => FreshMappings::Stage,
                "auto" => FreshMappings::Register,
                v => v
                    .parse()
                    .map_err(|e| anyhow::anyhow!("fresh_mappings must be auto or {e}"))?,
            };
            m.load.copy_streams = bounded(
                "copy_streams",
                s.copy_streams,
                gpu_loader::loader::MAX_COPY_STREAMS,
            )?;
            // "auto" (the default): calibrated at start-up on CUDA (Torpor's elbow), 4 MiB on
            // simulated devices.
            m.load.staging_size = match s.staging_size.as_str() {
                "auto" => 0,
                v => {
                    let n = parse_size(v).map_err(|e| anyhow::anyhow!("staging_size: {e}"))?;
                    if !(4096..=(1 << 30)).contains(&n) {
                        bail!("staging_size must be auto or between 4KiB and 1GiB, got {n}");
                    }
                    n as usize
                }
            };
            m
        };
        let listen = s.listen;
        let agent_listen: ListenAddr = s
            .agent_listen
            .parse()
            .map_err(|e| anyhow::anyhow!("agent_listen: {e}"))?;
        let admin_listen: ListenAddr = s
            .admin_listen
            .parse()
            .map_err(|e| anyhow::anyhow!("admin_listen: {e}"))?;
        let admin_limits = shardcast_identity::http::HttpLimits::from_millis(
            Some(s.admin_header_timeout_ms),
            Some(s.admin_idle_timeout_ms),
            ["admin_header_timeout_ms", "admin_idle_timeout_ms"],
        )
        .map_err(anyhow::Error::msg)?;
        if s.shutdown_delay_ms > 300_000 {
            bail!(
                "shutdown_delay_ms must be at most 300000 (5 minutes), got {}",
                s.shutdown_delay_ms
            );
        }
        let security = security(
            s.tls_ca.clone(),
            s.tls_cert.clone(),
            s.tls_key.clone(),
            s.insecure_plaintext,
            &[
                ("listen", Some(listen)),
                ("agent_listen", agent_listen.tcp()),
                ("admin_listen", admin_listen.tcp()),
            ],
        )?;
        let data_mode = s.data_mode;
        let worker_threads = match s.worker_threads {
            Auto::Auto => None,
            Auto::Set(n) => Some(bounded("worker_threads", n, MAX_WORKER_THREADS)?),
        };
        let stripes = match s.stripes {
            Auto::Auto => crate::chain::Stripes::auto(),
            Auto::Set(n) if (1..=crate::chain::MAX_STRIPES).contains(&n) => {
                crate::chain::Stripes::Fixed(n)
            }
            Auto::Set(n) => bail!(
                "stripes must be auto or between 1 and {} (got {n})",
                crate::chain::MAX_STRIPES
            ),
        };
        if data_mode == DataMode::AuthenticateOnly
            && matches!(security, Security::InsecurePlaintext)
        {
            bail!(
                "data_mode = authenticate-only authenticates hops with the mutual-TLS handshake, \
                 but insecure_plaintext turns TLS off: set tls_ca/tls_cert/tls_key, or drop data_mode"
            );
        }
        let spare = match s.memory_reserve_spare {
            Auto::Auto => crate::store::SpareSize::Auto,
            Auto::Set(ByteSize(n)) if n >= (1 << 20) || s.memory_reserve == 0 => {
                crate::store::SpareSize::Fixed(n)
            }
            Auto::Set(ByteSize(n)) => bail!(
                "memory_reserve_spare must be auto or at least 1MiB (the size of each spare file of the memory reserve), got {n} bytes"
            ),
        };
        let memory_reserve = crate::store::ReserveConfig {
            bytes: s.memory_reserve,
            spare,
        };
        let defaults = ChainConfig::default();
        Ok(Self {
            host_id,
            listen,
            quic: s.quic,
            quic_path_mtu: s.quic_path_mtu,
            quic_connections,
            agent_listen,
            admin_listen,
            tokens_file: s.tokens_file.clone(),
            admin_limits,
            shutdown_delay: Duration::from_millis(s.shutdown_delay_ms),
            security,
            data_mode,
            cert_expiry_warning: Duration::from_secs(s.cert_expiry_warning_s),
            store: StoreConfig {
                memory_dir: s.memory_dir.clone(),
                disk_dir: s.data_dir.clone(),
                verify_on_recover: s.verify_on_recover,
                writer,
                group: store_group,
                memory_capacity: inventory.memory_capacity,
                disk_capacity: inventory.disk_capacity,
                memory_headroom: s.memory_headroom,
                reverify_after: Duration::from_millis(s.reverify_after_ms),
                reverify_sends: s.reverify_sends,
                scrub_rate,
                memory_reserve,
            },
            egress_rate,
            ingress_rate: rate("ingress_rate", &s.ingress_rate)?,
            chain: ChainConfig {
                window,
                upstream_grace: Duration::from_millis(s.upstream_grace_ms),
                idle_timeout: Duration::from_secs(s.idle_timeout_s),
                stall_timeout: Duration::from_millis(s.stall_timeout_ms),
                origin_parallel,
                pipeline_depth,
                sendfile: s.sendfile,
                pieces: s.pieces,
                stripes,
                hash_on_read: match s.hash_on_read {
                    Auto::Auto => crate::chain::few_cores(),
                    Auto::Set(on) => on,
                },
                origins: OriginAccess::new(origins),
                limits,
                ..defaults
            },
            json_logs,
            traces,
            inventory,
            gpu,
            corrupt_once,
            drain_grace: Duration::from_millis(s.drain_grace_ms),
            worker_threads,
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

/// `v`, checked to lie in `1..=max`.
/// Most async worker threads `worker_threads` accepts.
const MAX_WORKER_THREADS: usize = 1024;

fn bounded(name: &str, v: usize, max: usize) -> anyhow::Result<usize> {
    if !(1..=max).contains(&v) {
        bail!("{name} must be between 1 and {max}, got {v}");
    }
    Ok(v)
}

/// A size in bytes, read as [`units::size`] reads one (`4096`, `"5GB"`), for [`Auto`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ByteSize(u64);

impl std::str::FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        units::parse_size(s).map(Self)
    }
}

impl serde::Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        units::size::serialize(&self.0, s)
    }
}

impl<'de> serde::Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        units::size::deserialize(d).map(Self)
    }
}

/// A setting that may be left to the daemon: `"auto"`, or a value of its own type (as
/// TOML writes it, or as text from a flag or the environment: `true`, `4`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Auto<T> {
    Auto,
    Set(T),
}

impl<T: serde::Serialize> serde::Serialize for Auto<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::Set(v) => v.serialize(s),
        }
    }
}

impl<'de, T> serde::Deserialize<'de> for Auto<T>
where
    T: serde::Deserialize<'de> + std::str::FromStr,
    T::Err: std::fmt::Display,
{
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::IntoDeserializer;
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T> serde::de::Visitor<'de> for V<T>
        where
            T: serde::Deserialize<'de> + std::str::FromStr,
            T::Err: std::fmt::Display,
        {
            type Value = Auto<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "\"auto\" or a {}", std::any::type_name::<T>())
            }
            fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<Auto<T>, E> {
                T::deserialize(b.into_deserializer()).map(Auto::Set)
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Auto<T>, E> {
                T::deserialize(n.into_deserializer()).map(Auto::Set)
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Auto<T>, E> {
                T::deserialize(n.into_deserializer()).map(Auto::Set)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Auto<T>, E> {
                let v = v.trim();
                if v.eq_ignore_ascii_case("auto") {
                    return Ok(Auto::Auto);
                }
                v.parse()
                    .map(Auto::Set)
                    .map_err(|e| E::custom(format!("expected \"auto\" or a value, got {v:?}: {e}")))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Loads from these flags (and the test process's environment).
    fn load(flags: &[&str]) -> anyhow::Result<Config> {
        let mut argv = vec!["transferd"];
        argv.extend_from_slice(flags);
        Config::from_args(argv).map(|l| l.config)
    }

    /// `flags` with a TLS identity, which is required.
    fn load_tls(flags: &[&str]) -> anyhow::Result<Config> {
        let mut argv = vec![
            "--tls-ca",
            "/etc/shardcast/ca.pem",
            "--tls-cert",
            "/etc/shardcast/host.pem",
            "--tls-key",
            "/etc/shardcast/host.key",
        ];
        argv.extend_from_slice(flags);
        load(&argv)
    }

    #[test]
    fn otlp_endpoint_is_off_by_default_loopback_only_and_needs_the_feature() {
        assert!(load_tls(&[]).unwrap().traces.is_none());
        let err = load_tls(&["--otlp-endpoint", "http://10.0.0.1:4318"]).unwrap_err();
        assert!(format!("{err:#}").contains("loopback"), "{err:#}");
        let loaded = load_tls(&[
            "--host-id",
            "gpu-7",
            "--otlp-endpoint",
            "http://127.0.0.1:4318",
        ]);
        if cfg!(feature = "otlp") {
            let t = loaded.unwrap().traces.expect("exporting");
            assert_eq!(t.endpoint.traces_url(), "http://127.0.0.1:4318/v1/traces");
            assert_eq!(
                (t.service_name, t.instance_id.as_str()),
                ("transferd", "gpu-7")
            );
        } else {
            let err = format!("{:#}", loaded.unwrap_err());
            assert!(err.contains("without the `otlp` feature"), "{err}");
        }
    }

    #[test]
    fn the_expiry_warning_takes_a_duration_and_defaults_to_two_weeks() {
        let c = load_tls(&[]).unwrap();
        assert_eq!(c.cert_expiry_warning, Duration::from_secs(14 * 86_400));
        let c = load_tls(&["--cert-expiry-warning-s", "3d"]).unwrap();
        assert_eq!(c.cert_expiry_warning, Duration::from_secs(3 * 86_400));
        let c = load_tls(&["--cert-expiry-warning-s", "0"]).unwrap();
        assert_eq!(c.cert_expiry_warning, Duration::ZERO);
        let err = load_tls(&["--cert-expiry-warning-s", "soon"]).unwrap_err();
        assert!(err.to_string().contains("cert_expiry_warning_s"), "{err}");
    }

    #[test]
    fn stripes_are_auto_by_default_or_a_count_from_a_flag_or_the_file() {
        let c = load_tls(&[]).unwrap();
        assert_eq!(c.chain.stripes, crate::chain::Stripes::auto());
        let c = load_tls(&["--stripes", "3"]).unwrap();
        assert_eq!(c.chain.stripes, crate::chain::Stripes::Fixed(3));
        let c = load_tls(&["--stripes", "AUTO"]).unwrap();
        assert_eq!(c.chain.stripes, crate::chain::Stripes::auto());
        for bad in ["0", "17", "-1", "many"] {
            let flag = format!("--stripes={bad}");
            let err = load_tls(&[&flag]).unwrap_err();
            assert!(format!("{err:#}").contains("stripes"), "{bad}: {err:#}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let config = path.to_str().unwrap();
        std::fs::write(&path, "stripes = 4\n").unwrap();
        let c = load_tls(&["--config", config]).unwrap();
        assert_eq!(c.chain.stripes, crate::chain::Stripes::Fixed(4));
        std::fs::write(&path, "stripes = \"auto\"\n").unwrap();
        let c = load_tls(&["--config", config]).unwrap();
        assert_eq!(c.chain.stripes, crate::chain::Stripes::auto());
        std::fs::write(&path, "stripes = 2.5\n").unwrap();
        let err = load_tls(&["--config", config]).unwrap_err();
        assert!(format!("{err:#}").contains("stripes"), "{err:#}");
    }

    #[test]
    fn worker_threads_are_auto_by_default_or_a_count_from_a_flag_or_the_file() {
        assert_eq!(load_tls(&[]).unwrap().worker_threads, None);
        assert_eq!(
            load_tls(&["--worker-threads", "1"]).unwrap().worker_threads,
            Some(1)
        );
        assert_eq!(
            load_tls(&["--worker-threads", "auto"])
                .unwrap()
                .worker_threads,
            None
        );
        for bad in ["0", "1025", "two", "-1"] {
            let err = load_tls(&[&format!("--worker-threads={bad}")]).unwrap_err();
            assert!(
                format!("{err:#}").contains("worker_threads"),
                "{bad}: {err:#}"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let config = path.to_str().unwrap();
        std::fs::write(&path, "worker_threads = 3\n").unwrap();
        assert_eq!(
            load_tls(&["--config", config]).unwrap().worker_threads,
            Some(3)
        );
        std::fs::write(&path, "worker_threads = \"auto\"\n").unwrap();
        assert_eq!(
            load_tls(&["--config", config]).unwrap().worker_threads,
            None
        );
    }

    #[test]
    fn hash_on_read_is_auto_by_default_or_set_by_flag_or_file() {
        let few_cores = crate::chain::few_cores();
        assert_eq!(load_tls(&[]).unwrap().chain.hash_on_read, few_cores);
        assert!(
            !load_tls(&["--hash-on-read", "false"])
                .unwrap()
                .chain
                .hash_on_read
        );
        assert!(
            load_tls(&["--hash-on-read", "true"])
                .unwrap()
                .chain
                .hash_on_read
        );
        let err = load_tls(&["--hash-on-read", "sometimes"]).unwrap_err();
        assert!(format!("{err:#}").contains("hash_on_read"), "{err:#}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let config = path.to_str().unwrap();
        std::fs::write(&path, "hash_on_read = false\n").unwrap();
        assert!(!load_tls(&["--config", config]).unwrap().chain.hash_on_read);
        std::fs::write(&path, "hash_on_read = \"auto\"\n").unwrap();
        assert_eq!(
            load_tls(&["--config", config]).unwrap().chain.hash_on_read,
            few_cores
        );
    }

    #[test]
    fn flags_override_file_and_bad_values_fail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let config = path.to_str().unwrap();
        std::fs::write(
            &path,
            "host_id = \"from-file\"\nwindow = 8\negress_rate = \"1Gbit\"\n",
        )
        .unwrap();
        let c = load_tls(&["--config", config, "--window", "4"]).unwrap();
        assert_eq!(c.host_id.as_str(), "from-file");
        assert_eq!(c.chain.window, 4);
        assert_eq!(c.egress_rate, Some(125_000_000));

        std::fs::write(&path, "windw = 8\n").unwrap();
        let err = load(&["--config", config]).unwrap_err();
        assert!(format!("{err:#}").contains("unknown field"), "{err:#}");
        assert!(
            format!("{err:#}").contains(&format!("(from file {config}); did you mean `window`?")),
            "{err:#}"
        );

        let err = load_tls(&["--egress-rate", "fast"]).unwrap_err();
        assert!(err.to_string().contains("egress_rate"), "{err}");
        assert!(
            err.to_string()
                .contains("[egress_rate from flag --egress-rate]"),
            "{err}"
        );
        let err = load_tls(&["--host-id", "a b"]).unwrap_err();
        assert!(err.to_string().contains("host_id"), "{err}");
        for bad in ["1000", "65528"] {
            let err = load_tls(&["--quic-path-mtu", bad]).unwrap_err();
            assert!(err.to_string().contains("quic_path_mtu"), "{err}");
        }
        std::fs::write(&path, "quic_path_mtu = 8952\n").unwrap();
        let c = load_tls(&["--config", config]).unwrap();
        assert_eq!(c.quic_path_mtu, Some(8952));
    }

    #[test]
    fn ill_typed_values_are_refused_naming_key_and_origin() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let config = path.to_str().unwrap();
        for (text, says) in [
            ("window = \"many\"\n", "window = \"many\" (from file "),
            ("quic = \"sometimes\"\n", "quic = \"sometimes\" (from file "),
            ("listen = 7400\n", "listen = 7400 (from file "),
            (
                "stall_timeout_ms = \"soon\"\n",
                "stall_timeout_ms = \"soon\" (from file ",
            ),
            (
                "frame_memory = \"lots\"\n",
                "frame_memory = \"lots\" (from file ",
            ),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = format!("{:#}", load_tls(&["--config", config]).unwrap_err());
            assert!(err.contains(says), "{text}: {err}");
        }
        let err = format!("{:#}", load_tls(&["--window", "x"]).unwrap_err());
        assert!(
            err.contains("window = \"x\" (from flag --window): expected a whole number"),
            "{err}"
        );
        let err = format!("{:#}", load_tls(&["--quic", "perhaps"]).unwrap_err());
        assert!(err.contains("(from flag --quic)"), "{err}");
        let err = format!("{:#}", load_tls(&["--listen", "nowhere"]).unwrap_err());
        assert!(
            err.contains("listen = \"nowhere\" (from flag --listen)"),
            "{err}"
        );
    }

    #[test]
    fn durations_and_sizes_take_units() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let config = path.to_str().unwrap();
        std::fs::write(
            &path,
            "upstream_grace_ms = \"3s\"\nidle_timeout_s = \"1m\"\nstall_timeout_ms = 500\n\
             frame_memory = \"1GiB\"\nmemory_capacity = \"4GiB\"\ngpu_memory = 1024\n",
        )
        .unwrap();
        let c = load_tls(&["--config", config, "--peer-idle-timeout-s", "2m"]).unwrap();
        assert_eq!(c.chain.upstream_grace, Duration::from_secs(3));
        assert_eq!(c.chain.idle_timeout, Duration::from_secs(60));
        assert_eq!(c.chain.stall_timeout, Duration::from_millis(500));
        assert_eq!(c.chain.limits.frame_memory, 1 << 30);
        assert_eq!(c.chain.limits.peer_idle_timeout, Duration::from_secs(120));
        assert_eq!(c.store.memory_capacity, Some(4 << 30));
        assert_eq!(c.inventory.gpu_memory, 1024);
        let err = load_tls(&["--idle-timeout-s", "1500ms"]).unwrap_err();
        assert!(
            err.to_string().contains("not a whole number of seconds"),
            "{err}"
        );
    }

    #[test]
    fn print_config_names_each_origin() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let config = path.to_str().unwrap();
        std::fs::write(&path, "window = 8\nzone = \"a\"\n").unwrap();
        let mut argv = vec!["transferd", "--config", config, "--zone", "b"];
        argv.extend([
            "--tls-ca",
            "/ca.pem",
            "--tls-cert",
            "/h.pem",
            "--tls-key",
            "/h.key",
        ]);
        let text = Config::from_args(argv).unwrap().render().unwrap();
        assert!(
            text.contains(&format!("window = 8  # file {config}\n")),
            "{text}"
        );
        assert!(text.contains("zone = \"b\"  # flag --zone\n"), "{text}");
        assert!(
            text.contains("stall_timeout_ms = 2000  # default\n"),
            "{text}"
        );
        assert!(
            text.contains("frame_memory = \"512MiB\"  # default\n"),
            "{text}"
        );
        assert!(text.contains("# host_id: not set\n"), "{text}");
        // The printed configuration is itself a valid config file, giving the same values.
        std::fs::write(&path, &text).unwrap();
        let again = load(&["--config", config]).unwrap();
        assert_eq!(again.chain.window, 8);
        assert_eq!(again.inventory.zone, "b");
    }

    #[test]
    fn tls_is_required_and_plaintext_only_on_loopback() {
        let err = load(&[]).unwrap_err();
        assert!(
            err.to_string()
                .contains("mutual TLS is required: set tls_ca, tls_cert, tls_key"),
            "{err}"
        );
        let err = load(&["--insecure-plaintext", "true"]).unwrap_err();
        assert!(err.to_string().contains("listen is 0.0.0.0:7400"), "{err}");
        let c = load(&["--insecure-plaintext", "true", "--listen", "127.0.0.1:0"]).unwrap();
        assert_eq!(c.security, Security::InsecurePlaintext);
        let c = load_tls(&[]).unwrap();
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
        let c = load_tls(&[
            "--admin-listen",
            "unix:/run/shardcast/admin.sock",
            "--admin-header-timeout-ms",
            "500",
        ])
        .unwrap();
        assert_eq!(
            c.admin_listen,
            ListenAddr::Unix("/run/shardcast/admin.sock".into())
        );
        assert_eq!(c.admin_limits.header_timeout, Duration::from_millis(500));
        let err = load_tls(&["--admin-idle-timeout-ms", "0"]).unwrap_err();
        assert!(err.to_string().contains("admin_idle_timeout_ms"), "{err}");
    }

    #[test]
    fn data_mode_is_tls_by_default_and_authenticate_only_needs_tls() {
        assert_eq!(load_tls(&[]).unwrap().data_mode, DataMode::Tls);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let config = path.to_str().unwrap();
        std::fs::write(&path, "data_mode = \"authenticate-only\"\n").unwrap();
        let c = load_tls(&["--config", config]).unwrap();
        assert_eq!(c.data_mode, DataMode::AuthenticateOnly);
        // The flag wins over the file.
        let c = load_tls(&["--config", config, "--data-mode", "tls"]).unwrap();
        assert_eq!(c.data_mode, DataMode::Tls);
        std::fs::write(&path, "data_mode = \"clear\"\n").unwrap();
        let err = load_tls(&["--config", config]).unwrap_err();
        assert!(format!("{err:#}").contains("authenticate-only"), "{err:#}");
        let err = load(&[
            "--insecure-plaintext",
            "true",
            "--listen",
            "127.0.0.1:0",
            "--data-mode",
            "authenticate-only",
        ])
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
        let c = load_tls(&[]).unwrap();
        assert_eq!(c.store.group, None);
        assert_eq!(c.store.reverify_after, crate::store::DEFAULT_REVERIFY_AFTER);
        assert_eq!(c.store.scrub_rate, crate::store::DEFAULT_SCRUB_RATE);
        let c = load_tls(&[
            "--store-group",
            "4242",
            "--reverify-after-ms",
            "0",
            "--scrub-rate",
            "off",
            "--memory-capacity",
            "1GiB",
        ])
        .unwrap();
        assert_eq!(c.store.group, Some(4242));
        assert_eq!(c.store.reverify_after, Duration::ZERO);
        assert_eq!(c.store.scrub_rate, 0);
        assert_eq!(c.store.memory_capacity, Some(1 << 30));
        assert_eq!(
            load_tls(&["--scrub-rate", "100MB/s", "--store-group", "root"])
                .unwrap()
                .store
                .scrub_rate,
            100_000_000
        );
        let max = u64::MAX.to_string();
        for bad in [
            ["--scrub-rate", "unlimited"],
            ["--store-group", "no-such-group-here"],
            ["--reverify-after-ms", max.as_str()],
        ] {
            assert!(load_tls(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn origin_allow_from_flags_env_style_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let config = path.to_str().unwrap();
        std::fs::write(
            &path,
            "origin_allow = [\"file:///data/models/\", \"https://m.example.com/org/\"]\n",
        )
        .unwrap();
        let c = load_tls(&["--config", config]).unwrap();
        assert_eq!(c.chain.origins.policy().prefixes().len(), 2);
        // Flags replace the file's list.
        let c = load_tls(&["--config", config, "--origin-allow", "file:///srv/a"]).unwrap();
        assert_eq!(c.chain.origins.policy().describe(), "file:///srv/a/");
        // Comma-separated, as in SHARDCAST_ORIGIN_ALLOW.
        let c = load_tls(&["--origin-allow", "file:///srv/a,file:///srv/b"]).unwrap();
        assert_eq!(c.chain.origins.policy().prefixes().len(), 2);
        // Nothing configured: nothing allowed.
        let c = load_tls(&[]).unwrap();
        assert!(c.chain.origins.policy().is_empty());
        let err = load_tls(&["--origin-allow", "ftp://x/"]).unwrap_err();
        assert!(err.to_string().contains("origin_allow"), "{err}");
        let err = load_tls(&["--peer-idle-timeout-s", "0"]).unwrap_err();
        assert!(err.to_string().contains("peer_idle_timeout_s"), "{err}");
    }

    #[test]
    fn fresh_mappings_stage_with_register_ahead_and_register_without() {
        let fresh = |flags: &[&str]| load_tls(flags).map(|c| c.gpu.load.fresh);
        assert_eq!(fresh(&[]).unwrap(), FreshMappings::Stage);
        assert_eq!(
            fresh(&["--register-ahead", "false"]).unwrap(),
            FreshMappings::Register
        );
        assert_eq!(
            fresh(&["--fresh-mappings", "register"]).unwrap(),
            FreshMappings::Register
        );
        assert_eq!(
            fresh(&["--fresh-mappings", "stage", "--register-ahead", "false"]).unwrap(),
            FreshMappings::Stage
        );
        let err = format!("{:#}", fresh(&["--fresh-mappings", "pin"]).unwrap_err());
        assert!(err.contains("fresh_mappings must be auto or"), "{err}");
    }

    #[test]
    fn memory_reserve_is_off_by_default_and_sized_by_flags() {
        let reserve = |flags: &[&str]| load_tls(flags).map(|c| c.store.memory_reserve);
        assert_eq!(reserve(&[]).unwrap(), crate::store::ReserveConfig::OFF);
        assert_eq!(
            reserve(&["--memory-reserve", "16GiB", "--memory-reserve-spare", "5GB"]).unwrap(),
            crate::store::ReserveConfig {
                bytes: 16 << 30,
                spare: crate::store::SpareSize::Fixed(5_000_000_000),
            }
        );
        assert_eq!(
            reserve(&["--memory-reserve", "2GiB"]).unwrap().spare,
            crate::store::SpareSize::Auto
        );
        assert_eq!(
            reserve(&["--memory-reserve", "2GiB", "--memory-reserve-spare", "AUTO"])
                .unwrap()
                .spare,
            crate::store::SpareSize::Auto
        );
        let err = format!(
            "{:#}",
            reserve(&["--memory-reserve", "1GiB", "--memory-reserve-spare", "4KiB"]).unwrap_err()
        );
        assert!(
            err.contains("memory_reserve_spare must be auto or at least 1MiB"),
            "{err}"
        );
        assert!(reserve(&["--memory-reserve", "lots"]).is_err());
    }

    #[test]
    fn gpu_budget_is_a_share_or_a_size_and_a_cap() {
        let budget = |flags: &[&str]| load_tls(flags).map(|c| c.gpu.budget);
        assert_eq!(budget(&[]).unwrap(), GpuBudget::Fraction(0.8));
        for (v, want) in [
            ("0.5", GpuBudget::Fraction(0.5)),
            ("75%", GpuBudget::Fraction(0.75)),
            ("60GiB", GpuBudget::Bytes(60 << 30)),
        ] {
            let got = budget(&["--gpu-budget", v]).unwrap();
            assert_eq!(got, want, "{v}");
        }
        for bad in ["2", "0", "150%", "1MiB", "lots"] {
            let err = budget(&["--gpu-budget", bad]).unwrap_err();
            assert!(err.to_string().contains("gpu_budget"), "{bad}: {err}");
        }
        // The old name still works, as a share, and is a cap like the new one.
        assert_eq!(
            budget(&["--gpu-budget-fraction", "0.6"]).unwrap(),
            GpuBudget::Fraction(0.6)
        );
        let err = budget(&["--gpu-budget", "0.5", "--gpu-budget-fraction", "0.6"]).unwrap_err();
        assert!(err.to_string().contains("not both"), "{err}");

        // In the file: a number or a string; flags override it.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let config = path.to_str().unwrap();
        for (text, want) in [
            ("gpu_budget = 0.7\n", GpuBudget::Fraction(0.7)),
            ("gpu_budget = 1\n", GpuBudget::Fraction(1.0)),
            ("gpu_budget = \"40GiB\"\n", GpuBudget::Bytes(40 << 30)),
            ("gpu_budget_fraction = 0.9\n", GpuBudget::Fraction(0.9)),
        ] {
            std::fs::write(&path, text).unwrap();
            let got = budget(&["--config", config]).unwrap();
            assert_eq!(got, want, "{text}");
        }
        // A flag of either name wins over the file's other name.
        let got = budget(&["--config", config, "--gpu-budget", "10GiB"]).unwrap();
        assert_eq!(got, GpuBudget::Bytes(10 << 30));
        std::fs::write(&path, "gpu_budget = 0.7\n").unwrap();
        let got = budget(&["--config", config, "--gpu-budget-fraction", "0.5"]).unwrap();
        assert_eq!(got, GpuBudget::Fraction(0.5));
        std::fs::write(&path, "gpu_budget = 0.7\ngpu_budget_fraction = 0.5\n").unwrap();
        let err = budget(&["--config", config]).unwrap_err();
        assert!(err.to_string().contains("not both"), "{err}");
        std::fs::write(&path, "gpu_budget = 80\n").unwrap();
        let err = budget(&["--config", config]).unwrap_err();
        assert!(
            err.to_string().contains("give a size with its unit"),
            "{err}"
        );
    }

    #[test]
    fn example_config_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("transferd.example.toml");
        let loaded = Config::from_args(["transferd", "--config", path.to_str().unwrap()]).unwrap();
        // Every key the example sets came from it (none misspelt into a default).
        let text = loaded.render().unwrap();
        assert!(text.contains("host_id = \"gpu-host-1\"  # file "), "{text}");
        assert_eq!(loaded.config.inventory.rack, "rack-1");
        // And it documents every key (set, or commented out with its default).
        let example = std::fs::read_to_string(&path).unwrap();
        for line in text.lines().filter(|l| !l.starts_with("# transferd")) {
            let key = line
                .trim_start_matches("# ")
                .split([' ', ':'])
                .next()
                .unwrap();
            assert!(
                example
                    .lines()
                    .any(|l| l.trim_start_matches("# ").starts_with(&format!("{key} = "))),
                "transferd.example.toml does not document {key}"
            );
        }
    }
}
