//! The controller's configuration: [`Cli`] declares the flags and their environment
//! variables; [`Args`] holds the settings, loaded by [`Args::from_matches`] through
//! `shardcast_protocol::layered` (built-in defaults < the TOML file of
//! `--config`/`SHARDCAST_CONTROLLER_CONFIG` < environment < flags), an unknown or
//! ill-typed key refused naming it and its origin; [`Loaded::validate`] makes every check
//! before a port is bound and [`Loaded::render`] is `--print-config` (the flag is
//! `layered::PrintConfig`, shared with transferd). The TLS identity or the insecure mode is
//! chosen by `shardcast_identity::process::Security`, shared with transferd too; the flags
//! stay here, as their help and some environment variables are the controller's own.
//! `controller/controller.example.toml` documents every key.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{CommandFactory, Parser};
use serde::{Deserialize, Serialize};
use shardcast_identity::http::HttpLimits;
use shardcast_identity::otlp::{OtlpEndpoint, TraceExport};
use shardcast_identity::process::{Security, SecurityError};
use shardcast_identity::{Role, TlsContext};
use shardcast_placement::PlanParams;
use shardcast_policies::profile::MIN_RATE_BPS;
use shardcast_protocol::layered::{Layers, PrintConfig};
use shardcast_protocol::origin_policy::{Enforcer, OriginPolicy};
use shardcast_protocol::units::{self, parse_rate};
use tracing::warn;

use crate::core::ControllerConfig;
use crate::ptables::PartitionConfig;
use crate::services::Config;

/// The command line. Every setting is a flag, most also an environment variable, and all a
/// key of the TOML file (`--config`); values are read as text here and typed by the layered
/// loader ([`Args::from_matches`]), so a bad value names where it came from.
#[derive(Debug, Parser)]
#[command(
    name = "shardcast-controller",
    version,
    about = "shardcast control plane"
)]
pub struct Cli {
    /// TOML config file (keys as in controller.example.toml). Its variable is not
    /// SHARDCAST_CONFIG, which names transferd's file on the same host.
    #[arg(long, env = "SHARDCAST_CONTROLLER_CONFIG")]
    pub config: Option<PathBuf>,
    /// `--print-config`.
    #[command(flatten)]
    pub print_config: PrintConfig,
    /// Instead of running: `openapi` prints the HTTP API's OpenAPI document.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// gRPC listener (Controller and Inventory services). [default: 127.0.0.1:7500]
    #[arg(long, env = "SHARDCAST_CONTROLLER_LISTEN")]
    pub listen: Option<String>,
    /// HTTP/JSON listener. [default: 127.0.0.1:7501]
    #[arg(long, env = "SHARDCAST_CONTROLLER_HTTP")]
    pub http_listen: Option<String>,
    /// Also serve gRPC on this Unix socket (reachable from every network namespace).
    #[arg(long, env = "SHARDCAST_CONTROLLER_UNIX")]
    pub unix: Option<String>,
    /// Directory of the state database. [default: /var/lib/shardcast-controller]
    #[arg(long, env = "SHARDCAST_CONTROLLER_STATE")]
    pub state_dir: Option<String>,
    /// Heartbeat period expected from hosts, in milliseconds. [default: 1000]
    #[arg(long, env = "SHARDCAST_HEARTBEAT_MS")]
    pub heartbeat_ms: Option<String>,
    /// Heartbeats a host may miss before it is marked down. [default: 3]
    #[arg(long, env = "SHARDCAST_MISSED_HEARTBEATS")]
    pub missed_heartbeats: Option<String>,
    /// Most receivers in one chain. [default: 16]
    #[arg(long, env = "SHARDCAST_MAX_CHAIN_LEN")]
    pub max_chain_len: Option<String>,
    /// Expected origin read rate, for estimates (e.g. 250Mbit, 1GB/s). [default: 250Mbit]
    #[arg(long, env = "SHARDCAST_ORIGIN_RATE")]
    pub origin_rate: Option<String>,
    /// NIC rate assumed for hosts that report none. [default: 10Gbit]
    #[arg(long, env = "SHARDCAST_DEFAULT_NIC_RATE")]
    pub default_nic_rate: Option<String>,
    /// Partition plans: rate of the link carrying activations between partitions (e.g.
    /// 100Gbit) [default: the slowest NIC rate the up GPU hosts report, else
    /// --default-nic-rate].
    #[arg(long, env = "SHARDCAST_PARTITION_LINK_RATE")]
    pub partition_link_rate: Option<String>,
    /// Partition plans: load rate (storage or host memory → GPU) at which the load times of
    /// a profile derived from a tensor index are estimated (e.g. 25GB/s) [default: 439MB/s,
    /// the thesis' T5-3B calibration]. Registered profiles keep their own times.
    #[arg(long, env = "SHARDCAST_PARTITION_LOAD_RATE")]
    pub partition_load_rate: Option<String>,
    /// Partition plans: weight bytes one request executes through per second, at which the
    /// execution times of a derived profile are estimated (batch-1 inference is
    /// memory-bound) [default: 22.8GB/s, the thesis' T5-3B calibration].
    #[arg(long, env = "SHARDCAST_PARTITION_EXEC_RATE")]
    pub partition_exec_rate: Option<String>,
    /// How often a plan's loop runs without news, in milliseconds: it polls receivers
    /// whose agent stream is not up, and checks stalls and hosts that went down.
    /// Completion itself is pushed by each receiver's agent, not polled. [default: 250]
    #[arg(long, env = "SHARDCAST_POLL_MS")]
    pub poll_ms: Option<String>,
    /// Seconds without progress after which a receiver is re-planned. [default: 10]
    #[arg(long, env = "SHARDCAST_STALL_TIMEOUT_S")]
    pub stall_timeout_s: Option<String>,
    /// Seconds a running plan waits for a receiver whose host stopped heartbeating to come
    /// back (re-planned then, resuming from its verified chunks) before it ends without it
    /// (`partial`). 0: end at once. [default: 20]
    #[arg(long, env = "SHARDCAST_LOST_GRACE_S")]
    pub lost_grace_s: Option<String>,
    /// Log format: text or json. [default: text]
    #[arg(long, env = "SHARDCAST_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// Export spans as OTLP traces to this collector on loopback, e.g.
    /// http://127.0.0.1:4318 (needs a build with the `otlp` feature). [default: none, off]
    #[arg(long, env = "SHARDCAST_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Host memory tier: above this fraction of its capacity, evict model copies (least
    /// recently used first) down to --memory-low. [default: 0.90]
    #[arg(long, env = "SHARDCAST_MEMORY_HIGH")]
    pub memory_high: Option<String>,
    /// See --memory-high. [default: 0.75]
    #[arg(long, env = "SHARDCAST_MEMORY_LOW")]
    pub memory_low: Option<String>,
    /// Disk tier: above this fraction, evict down to --disk-low. [default: 0.90]
    #[arg(long, env = "SHARDCAST_DISK_HIGH")]
    pub disk_high: Option<String>,
    /// See --disk-high. [default: 0.80]
    #[arg(long, env = "SHARDCAST_DISK_LOW")]
    pub disk_low: Option<String>,
    /// How often the tiers are checked, milliseconds (0: never; tiers are then only
    /// emptied by Evict). [default: 5000]
    #[arg(long, env = "SHARDCAST_TIER_SWEEP_MS")]
    pub tier_sweep_ms: Option<String>,
    /// Origins may not serve a model again (scratch buckets): never evict the last copy
    /// in the cluster of a registered model.
    #[arg(long, env = "SHARDCAST_ORIGINS_NOT_DURABLE")]
    pub origins_not_durable: bool,
    /// Scrape per-model load from this Prometheus endpoint (http(s)://host:port/metrics)
    /// and feed it to the autoscaler as ReportLoad would (see docs/OPERATIONS.md).
    #[arg(long, env = "SHARDCAST_SCRAPE_URL")]
    pub scrape_url: Option<String>,
    /// How often to scrape, milliseconds. [default: 5000]
    #[arg(long, env = "SHARDCAST_SCRAPE_INTERVAL_MS")]
    pub scrape_interval_ms: Option<String>,
    /// Tier for series without a `tier` label. [default: memory]
    #[arg(long, env = "SHARDCAST_SCRAPE_TIER")]
    pub scrape_tier: Option<String>,
    /// Gauge of arrivals per second, labelled `model`. [default: shardcast_model_arrival_rate]
    #[arg(long)]
    pub scrape_arrival_metric: Option<String>,
    /// Gauge of queued requests, labelled `model`. [default: shardcast_model_queue_length]
    #[arg(long)]
    pub scrape_queue_metric: Option<String>,
    /// Gauge of requests per second one replica serves, labelled `model`. [default: shardcast_model_service_rate]
    #[arg(long)]
    pub scrape_service_metric: Option<String>,
    /// Cluster CA bundle (PEM): clients, hosts and agents must chain to it.
    #[arg(long, env = "SHARDCAST_TLS_CA")]
    pub tls_ca: Option<String>,
    /// The controller's certificate (PEM), naming `shardcast://controller/<name>`.
    #[arg(long, env = "SHARDCAST_TLS_CERT")]
    pub tls_cert: Option<String>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "SHARDCAST_TLS_KEY")]
    pub tls_key: Option<String>,
    /// Seconds before the certificate's (or a CA's) notAfter from which the controller logs
    /// a WARN, at start, on each reload and when it gets there while running (ERROR once
    /// expired); e.g. 14d, 0 for expired only. The seconds left are the gauge
    /// shardcast_certificate_expiry_seconds. [default: 14d]
    #[arg(long, env = "SHARDCAST_CERT_EXPIRY_WARNING_S")]
    pub cert_expiry_warning_s: Option<String>,
    /// Bearer tokens for HTTP clients without a certificate: lines of
    /// `<role> <name> <blake3-hex of the token>` (`shardcast certs token`).
    #[arg(long, env = "SHARDCAST_TOKENS_FILE")]
    pub tokens_file: Option<String>,
    /// HTTP listener: milliseconds a client has to send a request head (from the
    /// connection's start or the first byte after a keep-alive pause), and the longest a
    /// handler waits for the next bytes of a request body. [default: 10000]
    #[arg(long, env = "SHARDCAST_HTTP_HEADER_TIMEOUT_MS")]
    pub http_header_timeout_ms: Option<String>,
    /// HTTP listener: milliseconds a keep-alive connection may wait for its next request. [default: 60000]
    #[arg(long, env = "SHARDCAST_HTTP_IDLE_TIMEOUT_MS")]
    pub http_idle_timeout_ms: Option<String>,
    /// Milliseconds between SIGTERM and the start of shutdown, while `/readyz` answers 503
    /// and gRPC health NOT_SERVING and everything else serves as before, so probes and load
    /// balancers stop sending requests first (at most 300000). [default: 0]
    #[arg(long, env = "SHARDCAST_SHUTDOWN_DELAY_MS")]
    pub shutdown_delay_ms: Option<String>,
    /// INSECURE: no TLS and no authentication on the TCP listeners; refused unless both
    /// are on loopback. For benchmarks and experiments only.
    #[arg(long, env = "SHARDCAST_INSECURE_PLAINTEXT")]
    pub insecure_plaintext: bool,
    /// Origin prefixes models may be registered from (repeatable or comma-separated):
    /// `file:///data/models/`, `https://models.example.com/org/`. Empty (the default)
    /// refuses every registration. Each transferd enforces its own `origin_allow` too.
    #[arg(long, env = "SHARDCAST_ORIGIN_ALLOW", value_delimiter = ',')]
    pub origin_allow: Vec<String>,
    /// Where the state lives: unset for the embedded store in --state-dir (one replica),
    /// or `etcd://host:port[,host:port...]` for several replicas with one elected leader
    /// (docs/OPERATIONS.md, "High availability").
    #[arg(long, env = "SHARDCAST_STATE")]
    pub state: Option<String>,
    /// Key prefix of this cluster's state in etcd. [default: /shardcast]
    #[arg(long, env = "SHARDCAST_ETCD_PREFIX")]
    pub etcd_prefix: Option<String>,
    /// etcd's --max-request-bytes: records above it (large manifests) are refused with a
    /// clear error; raise both together. [default: 1.5 MiB, etcd's]
    #[arg(long, env = "SHARDCAST_ETCD_MAX_REQUEST_BYTES")]
    pub etcd_max_request_bytes: Option<String>,
    /// etcd's --max-txn-ops: batched writes (host reports, plan progress) are committed in
    /// fenced transactions of at most this many puts. [default: 128, etcd's]
    #[arg(long, env = "SHARDCAST_ETCD_MAX_TXN_OPS")]
    pub etcd_max_txn_ops: Option<String>,
    /// The longest one etcd call may take, milliseconds. [default: 2000]
    #[arg(long, env = "SHARDCAST_ETCD_TIMEOUT_MS")]
    pub etcd_timeout_ms: Option<String>,
    /// etcd user, when etcd's authentication is enabled (the password is read from
    /// SHARDCAST_ETCD_PASSWORD).
    #[arg(long, env = "SHARDCAST_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// This replica's name in the election [default: the advertised gRPC address].
    #[arg(long, env = "SHARDCAST_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// gRPC address clients and hosts should use for this replica when it leads
    /// [default: the gRPC listener's address].
    #[arg(long, env = "SHARDCAST_ADVERTISE")]
    pub advertise: Option<String>,
    /// HTTP address clients should use for this replica when it leads [default: the HTTP
    /// listener's address].
    #[arg(long, env = "SHARDCAST_ADVERTISE_HTTP")]
    pub advertise_http: Option<String>,
    /// Leader lease TTL, milliseconds (whole seconds in etcd; at least 2000). A leader
    /// that cannot renew it for 2/3 of this steps down; a killed leader is replaced
    /// after about this long. [default: 3000]
    #[arg(long, env = "SHARDCAST_LEASE_TTL_MS")]
    pub lease_ttl_ms: Option<String>,
    /// How often a follower campaigns for leadership, milliseconds (its view follows
    /// etcd through a watch, not on this period). [default: 250]
    #[arg(long, env = "SHARDCAST_CAMPAIGN_MS")]
    pub campaign_ms: Option<String>,
    /// Whether the host that reads a model's origin to build its manifest at registration
    /// keeps the bytes in its memory tier (best effort), so a prewarm that follows is served
    /// from it and the origin is read once, not twice. `false` leaves registration a read
    /// that keeps nothing (cold-start benchmarks that measure the origin path use it). [default: true]
    #[arg(long, env = "SHARDCAST_REGISTER_KEEP_COPY")]
    pub register_keep_copy: Option<String>,
    /// How the hops of a plan's chains dial each other, unless the request says otherwise:
    /// `tcp`, or `quic` (every transferd listens on both unless started with quic = false). [default: tcp]
    #[arg(long, env = "SHARDCAST_TRANSPORT")]
    pub transport: Option<String>,
}

/// What the binary does instead of running the controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Subcommand)]
pub enum Command {
    /// Print the HTTP API's OpenAPI 3.1 document (JSON, as `GET /openapi.json` serves it;
    /// committed as `docs/openapi.json`) and exit.
    Openapi,
}

/// The controller's settings, as the layered loader reads them (built-in defaults < the TOML
/// file < environment variables < flags, see [`Cli`]): one key of the file, one flag each.
/// Keys ending in `_ms` or `_s` take a number in that unit or a duration with its own
/// (`"2s"`); rates are text (`"250Mbit"`, `"1GB/s"`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Args {
    /// gRPC listener (Controller and Inventory services).
    pub listen: SocketAddr,
    /// HTTP/JSON listener.
    pub http_listen: SocketAddr,
    /// Also serve gRPC on this Unix socket.
    pub unix: Option<PathBuf>,
    /// Directory of the state database.
    pub state_dir: PathBuf,
    /// Heartbeat period expected from hosts, in milliseconds.
    #[serde(with = "units::millis")]
    pub heartbeat_ms: u64,
    /// Heartbeats a host may miss before it is marked down.
    pub missed_heartbeats: u32,
    /// Most receivers in one chain.
    pub max_chain_len: usize,
    /// Expected origin read rate, for estimates.
    pub origin_rate: String,
    /// NIC rate assumed for hosts that report none.
    pub default_nic_rate: String,
    /// Partition plans: rate of the link between partitions.
    pub partition_link_rate: Option<String>,
    /// Partition plans: load rate of a derived profile.
    pub partition_load_rate: Option<String>,
    /// Partition plans: execution rate of a derived profile.
    pub partition_exec_rate: Option<String>,
    /// A plan loop's period without news, milliseconds.
    #[serde(with = "units::millis")]
    pub poll_ms: u64,
    /// Seconds without progress after which a receiver is re-planned.
    #[serde(with = "units::seconds")]
    pub stall_timeout_s: u64,
    /// Seconds a plan waits for a lost receiver's host to come back.
    #[serde(with = "units::seconds")]
    pub lost_grace_s: u64,
    /// Log format: text or json.
    pub log_format: String,
    /// OTLP/HTTP collector the spans are exported to (loopback only; `None`: off).
    pub otlp_endpoint: Option<String>,
    /// Memory tier high watermark (fraction of capacity).
    pub memory_high: f64,
    /// Memory tier low watermark.
    pub memory_low: f64,
    /// Disk tier high watermark.
    pub disk_high: f64,
    /// Disk tier low watermark.
    pub disk_low: f64,
    /// Tier check period, milliseconds (0: never).
    #[serde(with = "units::millis")]
    pub tier_sweep_ms: u64,
    /// Never evict the last copy in the cluster of a registered model.
    pub origins_not_durable: bool,
    /// Prometheus endpoint to scrape per-model load from.
    pub scrape_url: Option<String>,
    /// Scrape period, milliseconds.
    #[serde(with = "units::millis")]
    pub scrape_interval_ms: u64,
    /// Tier for series without a `tier` label.
    pub scrape_tier: String,
    /// Gauge of arrivals per second.
    pub scrape_arrival_metric: String,
    /// Gauge of queued requests.
    pub scrape_queue_metric: String,
    /// Gauge of requests per second one replica serves.
    pub scrape_service_metric: String,
    /// Cluster CA bundle (PEM).
    pub tls_ca: Option<PathBuf>,
    /// The controller's certificate (PEM).
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    pub tls_key: Option<PathBuf>,
    /// Seconds before a certificate's end from which it is warned about.
    #[serde(with = "units::seconds")]
    pub cert_expiry_warning_s: u64,
    /// Bearer tokens for HTTP clients without a certificate.
    pub tokens_file: Option<PathBuf>,
    /// HTTP: milliseconds a client has to send a request head.
    #[serde(with = "units::millis")]
    pub http_header_timeout_ms: u64,
    /// HTTP: milliseconds a keep-alive connection may wait for its next request.
    #[serde(with = "units::millis")]
    pub http_idle_timeout_ms: u64,
    /// Milliseconds between SIGTERM and the start of shutdown, not ready all along.
    #[serde(with = "units::millis")]
    pub shutdown_delay_ms: u64,
    /// INSECURE: no TLS and no authentication (loopback listeners only).
    pub insecure_plaintext: bool,
    /// Origin prefixes models may be registered from.
    pub origin_allow: Vec<String>,
    /// Where the state lives: unset for the embedded store, or `etcd://...`.
    pub state: Option<String>,
    /// Key prefix of this cluster's state in etcd.
    pub etcd_prefix: String,
    /// etcd's --max-request-bytes.
    pub etcd_max_request_bytes: usize,
    /// etcd's --max-txn-ops.
    pub etcd_max_txn_ops: usize,
    /// The longest one etcd call may take, milliseconds.
    #[serde(with = "units::millis")]
    pub etcd_timeout_ms: u64,
    /// etcd user (the password is read from SHARDCAST_ETCD_PASSWORD).
    pub etcd_user: Option<String>,
    /// This replica's name in the election.
    pub replica_id: Option<String>,
    /// gRPC address clients and hosts should use for this replica.
    pub advertise: Option<String>,
    /// HTTP address clients should use for this replica.
    pub advertise_http: Option<String>,
    /// Leader lease TTL, milliseconds.
    #[serde(with = "units::millis")]
    pub lease_ttl_ms: u64,
    /// How often a follower campaigns for leadership, milliseconds.
    #[serde(with = "units::millis")]
    pub campaign_ms: u64,
    /// Whether the host that builds a model's manifest at registration keeps the bytes.
    pub register_keep_copy: bool,
    /// How the hops of a plan's chains dial each other, unless the request says otherwise.
    pub transport: shardcast_protocol::HopTransport,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            listen: ([127, 0, 0, 1], 7500).into(),
            http_listen: ([127, 0, 0, 1], 7501).into(),
            unix: None,
            state_dir: "/var/lib/shardcast-controller".into(),
            heartbeat_ms: 1000,
            missed_heartbeats: 3,
            max_chain_len: 16,
            origin_rate: "250Mbit".into(),
            default_nic_rate: "10Gbit".into(),
            partition_link_rate: None,
            partition_load_rate: None,
            partition_exec_rate: None,
            poll_ms: 250,
            stall_timeout_s: 10,
            lost_grace_s: 20,
            log_format: "text".into(),
            otlp_endpoint: None,
            memory_high: 0.90,
            memory_low: 0.75,
            disk_high: 0.90,
            disk_low: 0.80,
            tier_sweep_ms: 5000,
            origins_not_durable: false,
            scrape_url: None,
            scrape_interval_ms: 5000,
            scrape_tier: "memory".into(),
            scrape_arrival_metric: "shardcast_model_arrival_rate".into(),
            scrape_queue_metric: "shardcast_model_queue_length".into(),
            scrape_service_metric: "shardcast_model_service_rate".into(),
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            cert_expiry_warning_s: shardcast_identity::expiry::EXPIRY_WARNING.as_secs(),
            tokens_file: None,
            http_header_timeout_ms: 10_000,
            http_idle_timeout_ms: 60_000,
            shutdown_delay_ms: 0,
            insecure_plaintext: false,
            origin_allow: Vec::new(),
            state: None,
            etcd_prefix: "/shardcast".into(),
            etcd_max_request_bytes: crate::etcd::ETCD_DEFAULT_MAX_REQUEST_BYTES,
            etcd_max_txn_ops: crate::etcd::ETCD_DEFAULT_MAX_TXN_OPS,
            etcd_timeout_ms: 2000,
            etcd_user: None,
            replica_id: None,
            advertise: None,
            advertise_http: None,
            lease_ttl_ms: 3000,
            campaign_ms: 250,
            register_keep_copy: true,
            transport: shardcast_protocol::HopTransport::Tcp,
        }
    }
}

/// Settings loaded with where each value came from, for `--print-config` and for naming
/// the origin of a key a validation error mentions.
#[derive(Debug)]
pub struct Loaded {
    /// The settings.
    pub args: Args,
    layers: Layers,
}

impl Loaded {
    /// The effective settings as TOML, each value followed by its origin (`--print-config`).
    pub fn render(&self) -> anyhow::Result<String> {
        Ok(format!(
            "# shardcast-controller: the effective configuration; after each value, where it \
             came from\n{}",
            self.layers.render(&self.args)?
        ))
    }

    /// Every check [`run`](super::run) makes on the settings before it binds a port, with
    /// the origins of the keys a refusal names.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.args
            .config()
            .and_then(|_| self.args.http_limits())
            .map(|_| ())
            .map_err(|e| {
                let message = format!("{e:#}");
                anyhow::anyhow!("{message}{}", self.layers.explain(&message))
            })
    }
}

impl Args {
    /// Loads the settings from a command line (`argv[0]` first) and the process environment:
    /// see [`Args::from_matches`].
    pub fn from_argv<I, T>(argv: I) -> anyhow::Result<Loaded>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = Cli::command().try_get_matches_from(argv)?;
        Self::from_matches(&matches)
    }

    /// Layers built-in defaults < the TOML file (`--config`, `SHARDCAST_CONTROLLER_CONFIG`)
    /// < environment variables < flags (what clap read into `matches`), refusing an unknown
    /// or ill-typed key with its name and origin. Nothing is bound here.
    pub fn from_matches(matches: &clap::ArgMatches) -> anyhow::Result<Loaded> {
        let layers = Layers::from_command_line(&Self::default(), &Cli::command(), matches, |p| {
            std::fs::read_to_string(p)
        })?;
        let args = layers.extract()?;
        Ok(Loaded { args, layers })
    }
}

/// The controller's TLS identity, or `None` in insecure mode (checked: loopback only), chosen
/// by the process shell both daemons share and refused in the words of the controller's
/// flags.
pub(super) fn load_tls(args: &Args) -> anyhow::Result<Option<Arc<TlsContext>>> {
    let security = Security::choose(
        args.tls_ca.clone(),
        args.tls_cert.clone(),
        args.tls_key.clone(),
        args.insecure_plaintext,
        &[
            ("listen", Some(args.listen)),
            ("http_listen", Some(args.http_listen)),
        ],
    );
    match security {
        Ok(Security::InsecurePlaintext) => {
            warn!(
                "INSECURE: --insecure-plaintext is set; no TLS and no authentication on the TCP listeners (loopback only)"
            );
            Ok(None)
        }
        Ok(Security::Tls(files)) => {
            let ctx = TlsContext::load_as(files, Role::Controller, None)
                .context("loading the controller's TLS identity")?;
            // Warns (or errs) now if the certificate or the CA ends soon; the reloader
            // warns again on each reload and when it gets there while running.
            ctx.set_expiry_warning(Duration::from_secs(args.cert_expiry_warning_s));
            ctx.log_expiry();
            Ok(Some(ctx))
        }
        Err(SecurityError::NotLoopback { listener, addr }) => bail!(
            "--insecure-plaintext is only allowed on loopback listeners, but {listener} is {addr}"
        ),
        Err(SecurityError::Missing(_)) => bail!(
            "mutual TLS is required: set --tls-ca, --tls-cert and --tls-key (create them with \
             `shardcast certs init` and `shardcast certs issue --role controller --name <name>`), \
             or --insecure-plaintext with loopback listeners only"
        ),
    }
}

impl Args {
    /// The HTTP listener's timeouts.
    pub fn http_limits(&self) -> anyhow::Result<HttpLimits> {
        HttpLimits::from_millis(
            Some(self.http_header_timeout_ms),
            Some(self.http_idle_timeout_ms),
            ["http_header_timeout_ms", "http_idle_timeout_ms"],
        )
        .map_err(anyhow::Error::msg)
    }

    /// The settings of a replicated controller (`--state etcd://...`), checked before any
    /// port is bound.
    fn check_ha(&self) -> anyhow::Result<()> {
        if let Some(url) = &self.state {
            crate::etcd::EtcdConfig::parse_url(url).map_err(|e| anyhow::anyhow!("state: {e}"))?;
        }
        if self.shutdown_delay_ms > 300_000 {
            bail!(
                "shutdown_delay_ms must be at most 300000 (5 minutes), got {}",
                self.shutdown_delay_ms
            );
        }
        if !(2000..=60_000).contains(&self.lease_ttl_ms) {
            bail!(
                "lease_ttl_ms must be between 2000 and 60000, got {}",
                self.lease_ttl_ms
            );
        }
        if !(10..=10_000).contains(&self.campaign_ms) {
            bail!(
                "campaign_ms must be between 10 and 10000, got {}",
                self.campaign_ms
            );
        }
        if !(1..=100_000).contains(&self.etcd_max_txn_ops) {
            bail!(
                "etcd_max_txn_ops must be between 1 and 100000 (etcd's --max-txn-ops), got {}",
                self.etcd_max_txn_ops
            );
        }
        if !(100..=60_000).contains(&self.etcd_timeout_ms) {
            bail!("etcd_timeout_ms must be between 100 and 60000");
        }
        if !self.etcd_prefix.starts_with('/') || self.etcd_prefix.len() < 2 {
            bail!(
                "etcd_prefix must start with / and name something, got {:?}",
                self.etcd_prefix
            );
        }
        Ok(())
    }

    /// Where spans are exported (`otlp_endpoint`), attributed to `shardcast-controller` and
    /// this replica (`replica_id`, else the advertised or listening gRPC address); refused
    /// when the endpoint is not loopback `http://`, or this binary lacks the `otlp` feature.
    pub fn trace_export(&self) -> anyhow::Result<Option<TraceExport>> {
        let Some(endpoint) = &self.otlp_endpoint else {
            return Ok(None);
        };
        let endpoint = OtlpEndpoint::parse(endpoint)?;
        if !cfg!(feature = "otlp") {
            bail!(
                "otlp_endpoint is set, but this shardcast-controller was built without the \
                 `otlp` feature (cargo build --release -p shardcast-controller --features otlp), \
                 or unset otlp_endpoint"
            );
        }
        let instance_id = self
            .replica_id
            .clone()
            .or_else(|| self.advertise.clone())
            .unwrap_or_else(|| self.listen.to_string());
        Ok(Some(TraceExport {
            endpoint,
            service_name: "shardcast-controller",
            service_version: env!("CARGO_PKG_VERSION"),
            instance_id,
        }))
    }

    /// The controller configuration these settings describe.
    pub fn config(&self) -> anyhow::Result<Config> {
        if !matches!(self.log_format.as_str(), "text" | "json") {
            bail!("log_format must be text or json, got {:?}", self.log_format);
        }
        self.trace_export()?;
        if !(50..=60_000).contains(&self.heartbeat_ms) {
            bail!(
                "heartbeat_ms must be between 50 and 60000, got {}",
                self.heartbeat_ms
            );
        }
        if !(1..=100).contains(&self.missed_heartbeats) {
            bail!("missed_heartbeats must be between 1 and 100");
        }
        if !(1..=255).contains(&self.max_chain_len) {
            bail!("max_chain_len must be between 1 and 255");
        }
        if !(10..=60_000).contains(&self.poll_ms) {
            bail!("poll_ms must be between 10 and 60000, got {}", self.poll_ms);
        }
        if self.stall_timeout_s == 0 {
            bail!("stall_timeout_s must be at least 1");
        }
        if self.state.is_some() {
            self.check_ha()?;
        }
        let rate = |name: &str, s: &str| -> anyhow::Result<u64> {
            parse_rate(s)
                .map_err(|e| anyhow::anyhow!("{name}: {e}"))?
                .ok_or_else(|| anyhow::anyhow!("{name} must be a finite rate"))
        };
        let partition_rate = |name: &str, v: &Option<String>| -> anyhow::Result<Option<u64>> {
            let Some(s) = v else { return Ok(None) };
            let bps = rate(name, s)?;
            if bps < MIN_RATE_BPS {
                bail!(
                    "{name} must be at least 1MB/s, got {s:?} ({bps} bytes/s; a number without \
                     a unit is bytes/s: write e.g. 100Gbit or 25GB/s)"
                );
            }
            Ok(Some(bps))
        };
        let partitions = {
            let default = PartitionConfig::default();
            PartitionConfig {
                link_bps: partition_rate("partition_link_rate", &self.partition_link_rate)?,
                load_bps: partition_rate("partition_load_rate", &self.partition_load_rate)?
                    .map_or(default.load_bps, |bps| bps as f64),
                exec_s_per_byte: partition_rate("partition_exec_rate", &self.partition_exec_rate)?
                    .map_or(default.exec_s_per_byte, |bps| 1.0 / bps as f64),
            }
        };
        for (name, v) in [
            ("memory_high", self.memory_high),
            ("memory_low", self.memory_low),
            ("disk_high", self.disk_high),
            ("disk_low", self.disk_low),
        ] {
            if !(0.0..=1.0).contains(&v) {
                bail!("{name} must be a fraction between 0 and 1, got {v}");
            }
        }
        if self.memory_low > self.memory_high || self.disk_low > self.disk_high {
            bail!("a low watermark must not be above its high watermark");
        }
        let scrape = match &self.scrape_url {
            None => None,
            Some(url) => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    bail!("scrape_url must be an http:// or https:// URL, got {url:?}");
                }
                if !(100..=3_600_000).contains(&self.scrape_interval_ms) {
                    bail!(
                        "scrape_interval_ms must be between 100 and 3600000, got {}",
                        self.scrape_interval_ms
                    );
                }
                if !matches!(self.scrape_tier.as_str(), "memory" | "disk" | "gpu") {
                    bail!(
                        "scrape_tier must be memory, disk or gpu, got {:?}",
                        self.scrape_tier
                    );
                }
                Some(crate::scrape::ScrapeConfig {
                    url: url.clone(),
                    interval: Duration::from_millis(self.scrape_interval_ms),
                    arrival_metric: self.scrape_arrival_metric.clone(),
                    queue_metric: self.scrape_queue_metric.clone(),
                    service_metric: self.scrape_service_metric.clone(),
                    tier: self.scrape_tier.clone(),
                })
            }
        };
        let core = ControllerConfig {
            heartbeat: Duration::from_millis(self.heartbeat_ms),
            missed_heartbeats: self.missed_heartbeats,
            plan: PlanParams {
                max_chain_len: self.max_chain_len,
                origin_bps: rate("origin_rate", &self.origin_rate)?,
                default_nic_bps: rate("default_nic_rate", &self.default_nic_rate)?,
                ..PlanParams::default()
            },
            stall_timeout: Duration::from_secs(self.stall_timeout_s),
            lost_grace: Duration::from_secs(self.lost_grace_s),
            poll: Duration::from_millis(self.poll_ms),
            origins: OriginPolicy::parse(&self.origin_allow, Enforcer::Controller)
                .map_err(|e| anyhow::anyhow!("origin_allow: {e}"))?,
            register_keeps_copy: self.register_keep_copy,
            transport: self.transport,
            ..ControllerConfig::default()
        };
        Ok(Config {
            core,
            tiers: crate::tiers::TierConfig {
                enabled: self.tier_sweep_ms > 0,
                memory_high: self.memory_high,
                memory_low: self.memory_low,
                disk_high: self.disk_high,
                disk_low: self.disk_low,
                interval: Duration::from_millis(self.tier_sweep_ms.max(1)),
                origins_durable: !self.origins_not_durable,
            },
            scrape,
            partitions,
        })
    }
}

#[cfg(test)]
mod tests;
