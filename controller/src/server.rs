//! Wiring of the `shardcast-controller` process: configuration, state, listeners.
//!
//! Start-up: open the state store (resuming plans in flight), bind every listener, then
//! print one line `READY grpc=<addr> http=<addr> [unix=<path>]` on stdout.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use shardcast_identity::grpc::{self, AuthzLayer, SocketAccess, TcpSecurity};
use shardcast_identity::http::{HttpAuthLayer, HttpLimits};
use shardcast_identity::tls::RELOAD_PERIOD;
use shardcast_identity::token::Tokens;
use shardcast_identity::{Alpn, Role, TlsContext};
use shardcast_placement::PlanParams;
use shardcast_policies::profile::MIN_RATE_BPS;
use shardcast_protocol::controller::controller_server::ControllerServer;
use shardcast_protocol::controller::inventory_server::InventoryServer;
use shardcast_protocol::origin_policy::{Enforcer, OriginPolicy};
use shardcast_protocol::units::parse_rate;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::core::ControllerConfig;
use crate::grpc::GrpcApi;
use crate::ha::{Active, LeaderGate, Replica, Slot, Switch};
use crate::ptables::PartitionConfig;
use crate::services::{Config, Services};
use crate::state::RedbStore;
use shardcast_identity::grpc::GateLayer;

/// Command line (every flag also reads an environment variable).
#[derive(Debug, Parser)]
#[command(
    name = "shardcast-controller",
    version,
    about = "shardcast control plane"
)]
pub struct Args {
    /// gRPC listener (Controller and Inventory services).
    #[arg(
        long,
        env = "SHARDCAST_CONTROLLER_LISTEN",
        default_value = "127.0.0.1:7500"
    )]
    pub listen: SocketAddr,
    /// HTTP/JSON listener.
    #[arg(
        long,
        env = "SHARDCAST_CONTROLLER_HTTP",
        default_value = "127.0.0.1:7501"
    )]
    pub http_listen: SocketAddr,
    /// Also serve gRPC on this Unix socket (reachable from every network namespace).
    #[arg(long, env = "SHARDCAST_CONTROLLER_UNIX")]
    pub unix: Option<PathBuf>,
    /// Directory of the state database.
    #[arg(
        long,
        env = "SHARDCAST_CONTROLLER_STATE",
        default_value = "/var/lib/shardcast-controller"
    )]
    pub state_dir: PathBuf,
    /// Heartbeat period expected from hosts, in milliseconds.
    #[arg(long, env = "SHARDCAST_HEARTBEAT_MS", default_value_t = 1000)]
    pub heartbeat_ms: u64,
    /// Heartbeats a host may miss before it is marked down.
    #[arg(long, env = "SHARDCAST_MISSED_HEARTBEATS", default_value_t = 3)]
    pub missed_heartbeats: u32,
    /// Most receivers in one chain.
    #[arg(long, env = "SHARDCAST_MAX_CHAIN_LEN", default_value_t = 16)]
    pub max_chain_len: usize,
    /// Expected origin read rate, for estimates (e.g. 250Mbit, 1GB/s).
    #[arg(long, env = "SHARDCAST_ORIGIN_RATE", default_value = "250Mbit")]
    pub origin_rate: String,
    /// NIC rate assumed for hosts that report none.
    #[arg(long, env = "SHARDCAST_DEFAULT_NIC_RATE", default_value = "10Gbit")]
    pub default_nic_rate: String,
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
    /// Completion itself is pushed by each receiver's agent, not polled.
    #[arg(long, env = "SHARDCAST_POLL_MS", default_value_t = 250)]
    pub poll_ms: u64,
    /// Seconds without progress after which a receiver is re-planned.
    #[arg(long, env = "SHARDCAST_STALL_TIMEOUT_S", default_value_t = 10)]
    pub stall_timeout_s: u64,
    /// Seconds a running plan waits for a receiver whose host stopped heartbeating to come
    /// back (re-planned then, resuming from its verified chunks) before it ends without it
    /// (`partial`). 0: end at once.
    #[arg(long, env = "SHARDCAST_LOST_GRACE_S", default_value_t = 20)]
    pub lost_grace_s: u64,
    /// Log format: text or json.
    #[arg(long, env = "SHARDCAST_LOG_FORMAT", default_value = "text")]
    pub log_format: String,
    /// Host memory tier: above this fraction of its capacity, evict model copies (least
    /// recently used first) down to --memory-low.
    #[arg(long, env = "SHARDCAST_MEMORY_HIGH", default_value_t = 0.90)]
    pub memory_high: f64,
    /// See --memory-high.
    #[arg(long, env = "SHARDCAST_MEMORY_LOW", default_value_t = 0.75)]
    pub memory_low: f64,
    /// Disk tier: above this fraction, evict down to --disk-low.
    #[arg(long, env = "SHARDCAST_DISK_HIGH", default_value_t = 0.90)]
    pub disk_high: f64,
    /// See --disk-high.
    #[arg(long, env = "SHARDCAST_DISK_LOW", default_value_t = 0.80)]
    pub disk_low: f64,
    /// How often the tiers are checked, milliseconds (0: never; tiers are then only
    /// emptied by Evict).
    #[arg(long, env = "SHARDCAST_TIER_SWEEP_MS", default_value_t = 5000)]
    pub tier_sweep_ms: u64,
    /// Origins may not serve a model again (scratch buckets): never evict the last copy
    /// in the cluster of a registered model.
    #[arg(long, env = "SHARDCAST_ORIGINS_NOT_DURABLE")]
    pub origins_not_durable: bool,
    /// Scrape per-model load from this Prometheus endpoint (http(s)://host:port/metrics)
    /// and feed it to the autoscaler as ReportLoad would (see docs/OPERATIONS.md).
    #[arg(long, env = "SHARDCAST_SCRAPE_URL")]
    pub scrape_url: Option<String>,
    /// How often to scrape, milliseconds.
    #[arg(long, env = "SHARDCAST_SCRAPE_INTERVAL_MS", default_value_t = 5000)]
    pub scrape_interval_ms: u64,
    /// Tier for series without a `tier` label.
    #[arg(long, env = "SHARDCAST_SCRAPE_TIER", default_value = "memory")]
    pub scrape_tier: String,
    /// Gauge of arrivals per second, labelled `model`.
    #[arg(long, default_value = "shardcast_model_arrival_rate")]
    pub scrape_arrival_metric: String,
    /// Gauge of queued requests, labelled `model`.
    #[arg(long, default_value = "shardcast_model_queue_length")]
    pub scrape_queue_metric: String,
    /// Gauge of requests per second one replica serves, labelled `model`.
    #[arg(long, default_value = "shardcast_model_service_rate")]
    pub scrape_service_metric: String,
    /// Cluster CA bundle (PEM): clients, hosts and agents must chain to it.
    #[arg(long, env = "SHARDCAST_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// The controller's certificate (PEM), naming `shardcast://controller/<name>`.
    #[arg(long, env = "SHARDCAST_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "SHARDCAST_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Bearer tokens for HTTP clients without a certificate: lines of
    /// `<role> <name> <blake3-hex of the token>` (`shardcast certs token`).
    #[arg(long, env = "SHARDCAST_TOKENS_FILE")]
    pub tokens_file: Option<PathBuf>,
    /// HTTP listener: milliseconds a client has to send a request head (from the
    /// connection's start or the first byte after a keep-alive pause), and the longest a
    /// handler waits for the next bytes of a request body.
    #[arg(
        long,
        env = "SHARDCAST_HTTP_HEADER_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub http_header_timeout_ms: u64,
    /// HTTP listener: milliseconds a keep-alive connection may wait for its next request.
    #[arg(long, env = "SHARDCAST_HTTP_IDLE_TIMEOUT_MS", default_value_t = 60_000)]
    pub http_idle_timeout_ms: u64,
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
    /// Key prefix of this cluster's state in etcd.
    #[arg(long, env = "SHARDCAST_ETCD_PREFIX", default_value = "/shardcast")]
    pub etcd_prefix: String,
    /// etcd's --max-request-bytes: records above it (large manifests) are refused with a
    /// clear error; raise both together.
    #[arg(
        long,
        env = "SHARDCAST_ETCD_MAX_REQUEST_BYTES",
        default_value_t = crate::etcd::ETCD_DEFAULT_MAX_REQUEST_BYTES
    )]
    pub etcd_max_request_bytes: usize,
    /// etcd's --max-txn-ops: batched writes (host reports, plan progress) are committed in
    /// fenced transactions of at most this many puts.
    #[arg(
        long,
        env = "SHARDCAST_ETCD_MAX_TXN_OPS",
        default_value_t = crate::etcd::ETCD_DEFAULT_MAX_TXN_OPS
    )]
    pub etcd_max_txn_ops: usize,
    /// The longest one etcd call may take, milliseconds.
    #[arg(long, env = "SHARDCAST_ETCD_TIMEOUT_MS", default_value_t = 2000)]
    pub etcd_timeout_ms: u64,
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
    /// after about this long.
    #[arg(long, env = "SHARDCAST_LEASE_TTL_MS", default_value_t = 3000)]
    pub lease_ttl_ms: u64,
    /// How often a follower campaigns for leadership, milliseconds (its view follows
    /// etcd through a watch, not on this period).
    #[arg(long, env = "SHARDCAST_CAMPAIGN_MS", default_value_t = 250)]
    pub campaign_ms: u64,
    /// Whether the host that reads a model's origin to build its manifest at registration
    /// keeps the bytes in its memory tier (best effort), so a prewarm that follows is served
    /// from it and the origin is read once, not twice. `false` leaves registration a read
    /// that keeps nothing (cold-start benchmarks that measure the origin path use it).
    #[arg(long, env = "SHARDCAST_REGISTER_KEEP_COPY", default_value_t = true, action = clap::ArgAction::Set)]
    pub register_keep_copy: bool,
    /// How the hops of a plan's chains dial each other, unless the request says otherwise:
    /// `tcp`, or `quic` (every transferd listens on both unless started with quic = false).
    #[arg(long, env = "SHARDCAST_TRANSPORT", default_value = "tcp")]
    pub transport: shardcast_protocol::HopTransport,
}

/// The controller's TLS identity, or `None` in insecure mode (checked: loopback only).
fn load_tls(args: &Args) -> anyhow::Result<Option<Arc<TlsContext>>> {
    if args.insecure_plaintext {
        for (name, addr) in [("listen", args.listen), ("http_listen", args.http_listen)] {
            if !shardcast_identity::plaintext_allowed(&addr) {
                bail!(
                    "--insecure-plaintext is only allowed on loopback listeners, but {name} is {addr}"
                );
            }
        }
        warn!(
            "INSECURE: --insecure-plaintext is set; no TLS and no authentication on the TCP listeners (loopback only)"
        );
        return Ok(None);
    }
    match (&args.tls_ca, &args.tls_cert, &args.tls_key) {
        (Some(ca), Some(cert), Some(key)) => {
            let files = shardcast_identity::TlsFiles {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            };
            Ok(Some(
                TlsContext::load_as(files, Role::Controller, None)
                    .context("loading the controller's TLS identity")?,
            ))
        }
        _ => bail!(
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

    /// The controller configuration these flags describe.
    pub fn config(&self) -> anyhow::Result<Config> {
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

/// Runs the controller until SIGINT/SIGTERM.
pub async fn run(args: Args) -> anyhow::Result<()> {
    // Every host's heartbeat connection, API client and etcd stream holds a descriptor;
    // distributions default the soft limit to 1024.
    match shardcast_identity::process::raise_nofile_limit() {
        Ok((old, new)) if new > old => tracing::info!(old, new, "raised the open-file limit"),
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot raise the open-file limit: {e}"),
    }
    let mut cfg = args.config()?;
    let http_limits = args.http_limits()?;
    let tls = load_tls(&args)?;
    let tokens = match &args.tokens_file {
        Some(p) => Tokens::load(p).context("loading the tokens file")?,
        None => Tokens::default(),
    };
    cfg.core.tls = tls.clone();
    // Chains' plan tokens are signed with the controller's own TLS key and certificate.
    cfg.core.signer = match &tls {
        Some(ctx) => Some(Arc::new(arc_swap::ArcSwap::from_pointee(
            shardcast_identity::plan::PlanSigner::load(ctx.files())
                .context("loading the controller's key for plan tokens")?,
        ))),
        None => None,
    };
    if cfg.core.origins.is_empty() {
        warn!("--origin-allow is empty: every model registration is refused");
    } else {
        info!(allowed = %cfg.core.origins.describe(), "origin allow-list");
    }
    let cancel = CancellationToken::new();
    if let (Some(ctx), Some(signer)) = (&tls, &cfg.core.signer) {
        ctx.spawn_reloader(RELOAD_PERIOD, cancel.clone().cancelled_owned());
        tokio::spawn(follow_rotation(ctx.clone(), signer.clone(), cancel.clone()));
    }
    let grpc = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding gRPC listener {}", args.listen))?;
    let http = TcpListener::bind(args.http_listen)
        .await
        .with_context(|| format!("binding HTTP listener {}", args.http_listen))?;
    // 0600: local operators only (same user or root), who hold every permission.
    let unix = match &args.unix {
        Some(p) => Some(
            grpc::bind_unix(p, SocketAccess::Owner)
                .with_context(|| format!("binding {}", p.display()))?,
        ),
        None => None,
    };
    let (grpc_addr, http_addr) = (grpc.local_addr()?, http.local_addr()?);

    let (slot, replica, state_note) = match &args.state {
        None => {
            let path = args.state_dir.join("state.redb");
            let store = tokio::task::spawn_blocking(move || RedbStore::open(&path))
                .await
                .context("state store task")??;
            let controller = Services::open(&cfg, Arc::new(store), cancel.clone())
                .map_err(|e| anyhow::anyhow!("loading state: {e}"))?;
            let slot: Slot = Arc::new(arc_swap::ArcSwap::new(Active::new(controller)));
            (slot, Replica::solo(), args.state_dir.display().to_string())
        }
        Some(url) => {
            let (slot, replica) =
                start_replica(&args, url, cfg, grpc_addr, http_addr, &cancel).await?;
            (slot, replica, url.clone())
        }
    };

    let authz = slot.load().ctl.core.authz_stats();
    let http_stats = slot.load().ctl.core.http_stats();
    let services = || {
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(grpc::SERVER_KEEPALIVE.0))
            .http2_keepalive_timeout(Some(grpc::SERVER_KEEPALIVE.1))
            .layer(AuthzLayer::new(crate::auth::permission, authz.clone()))
            .layer(GateLayer::gate(LeaderGate(replica.clone())))
            .add_service(Switch::new(slot.clone(), |c| {
                ControllerServer::new(GrpcApi(c))
                    .max_decoding_message_size(128 << 20)
                    .max_encoding_message_size(128 << 20)
            }))
            .add_service(Switch::new(slot.clone(), |c| {
                InventoryServer::new(GrpcApi(c))
            }))
    };
    let mut tasks = tokio::task::JoinSet::new();
    {
        let server = services();
        let cancel = cancel.clone();
        let incoming = grpc::incoming_tcp(
            grpc,
            match &tls {
                Some(ctx) => TcpSecurity::Tls(ctx.clone(), Alpn::Grpc),
                None => TcpSecurity::Plaintext,
            },
            cancel.clone().cancelled_owned(),
        );
        tasks.spawn(async move {
            if let Err(e) = server
                .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
                .await
            {
                warn!("gRPC server ended: {e}");
            }
        });
    }
    if let Some(l) = unix {
        let server = services();
        let cancel = cancel.clone();
        let incoming =
            grpc::incoming_unix(l, SocketAccess::Owner, cancel.clone().cancelled_owned());
        tasks.spawn(async move {
            if let Err(e) = server
                .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
                .await
            {
                warn!("gRPC (unix) server ended: {e}");
            }
        });
    }
    {
        let router =
            crate::ha::http_router(slot.clone(), replica.clone()).layer(HttpAuthLayer::new(
                crate::auth::http_permission,
                Arc::new(tokens),
                authz.clone(),
            ));
        let incoming = grpc::incoming_tcp(
            http,
            match &tls {
                Some(ctx) => TcpSecurity::TlsOptionalClient(ctx.clone()),
                None => TcpSecurity::Plaintext,
            },
            cancel.clone().cancelled_owned(),
        );
        tasks.spawn(shardcast_identity::http::serve(
            incoming,
            router,
            http_limits,
            http_stats,
            cancel.clone(),
        ));
    }
    let unix_note = args
        .unix
        .as_ref()
        .map(|p| format!(" unix={}", p.display()))
        .unwrap_or_default();
    info!(%grpc_addr, %http_addr, state = %state_note, "controller ready");
    println!("READY grpc={grpc_addr} http={http_addr}{unix_note}");

    shutdown_signal().await;
    info!("shutting down");
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    Ok(())
}

/// Connects to etcd, loads the first (read-only) view and starts this replica's election.
async fn start_replica(
    args: &Args,
    url: &str,
    cfg: Config,
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
    cancel: &CancellationToken,
) -> anyhow::Result<(Slot, Replica)> {
    let endpoints = crate::etcd::EtcdConfig::parse_url(url).map_err(anyhow::Error::msg)?;
    if !(2000..=60_000).contains(&args.lease_ttl_ms) {
        bail!(
            "lease_ttl_ms must be between 2000 and 60000, got {}",
            args.lease_ttl_ms
        );
    }
    if !(10..=10_000).contains(&args.campaign_ms) {
        bail!(
            "campaign_ms must be between 10 and 10000, got {}",
            args.campaign_ms
        );
    }
    if !(1..=100_000).contains(&args.etcd_max_txn_ops) {
        bail!(
            "etcd_max_txn_ops must be between 1 and 100000 (etcd's --max-txn-ops), got {}",
            args.etcd_max_txn_ops
        );
    }
    if !(100..=60_000).contains(&args.etcd_timeout_ms) {
        bail!("etcd_timeout_ms must be between 100 and 60000");
    }
    if !args.etcd_prefix.starts_with('/') || args.etcd_prefix.len() < 2 {
        bail!(
            "etcd_prefix must start with / and name something, got {:?}",
            args.etcd_prefix
        );
    }
    let user = match &args.etcd_user {
        Some(u) => Some((
            u.clone(),
            std::env::var("SHARDCAST_ETCD_PASSWORD")
                .context("--etcd-user needs the password in SHARDCAST_ETCD_PASSWORD")?,
        )),
        None => None,
    };
    let etcd_cfg = crate::etcd::EtcdConfig {
        endpoints,
        prefix: args.etcd_prefix.clone(),
        max_request_bytes: args.etcd_max_request_bytes,
        max_txn_ops: args.etcd_max_txn_ops,
        timeout: Duration::from_millis(args.etcd_timeout_ms),
        user,
    };
    let store = tokio::task::spawn_blocking(move || crate::etcd::EtcdStore::connect(&etcd_cfg))
        .await
        .context("etcd connect task")?
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let grpc = args
        .advertise
        .clone()
        .unwrap_or_else(|| grpc_addr.to_string());
    let http = args
        .advertise_http
        .clone()
        .unwrap_or_else(|| http_addr.to_string());
    if grpc_addr.ip().is_unspecified() && args.advertise.is_none() {
        warn!(
            "the gRPC listener is {grpc_addr}: set --advertise to the address clients should be sent to"
        );
    }
    let id = args.replica_id.clone().unwrap_or_else(|| grpc.clone());
    let stats = Arc::new(crate::ha::ViewStats::default());
    let (view, first) =
        crate::ha::first_view(&cfg, store.clone(), cancel, Duration::from_secs(30), &stats).await?;
    let slot: Slot = Arc::new(arc_swap::ArcSwap::new(view));
    let (role_tx, role_rx) =
        tokio::sync::watch::channel(crate::ha::Role::Follower { leader: None });
    let ha = crate::ha::HaConfig {
        me: crate::etcd::LeaderInfo {
            id: id.clone(),
            grpc,
            http,
        },
        ttl: Duration::from_millis(args.lease_ttl_ms),
        campaign: Duration::from_millis(args.campaign_ms),
    };
    info!(%id, prefix = %args.etcd_prefix, "state in etcd: campaigning for leadership");
    tokio::spawn(crate::ha::run(
        cfg,
        ha,
        store,
        slot.clone(),
        role_tx,
        cancel.clone(),
        first,
        stats.clone(),
    ));
    Ok((slot, Replica::new(id, role_rx, stats)))
}

/// Plan tokens are signed with the controller's TLS key: as soon as the TLS context
/// reloads a rotated certificate, load the signer from the same files.
async fn follow_rotation(
    ctx: Arc<TlsContext>,
    signer: Arc<arc_swap::ArcSwap<shardcast_identity::plan::PlanSigner>>,
    cancel: CancellationToken,
) {
    let mut reloads = ctx.watch_reloads();
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            r = reloads.changed() => if r.is_err() { return },
        }
        match shardcast_identity::plan::PlanSigner::load(ctx.files()) {
            Ok(s) => {
                signer.store(Arc::new(s));
                info!("plan tokens are now signed with the reloaded certificate");
            }
            Err(e) => warn!("keeping the previous plan-token key: {e}"),
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &[&str]) -> anyhow::Result<Config> {
        let mut argv = vec!["shardcast-controller"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv)?.config()
    }

    #[test]
    fn partition_rates_default_to_the_hosts_nics_and_the_calibration() {
        let p = config(&[]).unwrap().partitions;
        assert_eq!(p, PartitionConfig::default());
        assert_eq!(p.link_bps, None);
    }

    #[test]
    fn partition_rates_parse_like_the_other_rates() {
        let p = config(&[
            "--partition-link-rate",
            "200Gbit",
            "--partition-load-rate",
            "25GB/s",
            "--partition-exec-rate",
            "2000GB/s",
        ])
        .unwrap()
        .partitions;
        assert_eq!(p.link_bps, Some(25_000_000_000));
        assert_eq!(p.load_bps, 25e9);
        assert_eq!(p.exec_s_per_byte, 1.0 / 2e12);
    }

    #[test]
    fn bad_partition_rates_are_refused_by_name() {
        for (flag, value, says) in [
            ("--partition-link-rate", "fast", "invalid rate"),
            (
                "--partition-link-rate",
                "unlimited",
                "must be a finite rate",
            ),
            ("--partition-link-rate", "0", "must be a finite rate"),
            (
                "--partition-load-rate",
                "100",
                "a number without a unit is bytes/s",
            ),
            ("--partition-load-rate", "25Tbit", "unknown prefix"),
            ("--partition-exec-rate", "999kB/s", "at least 1MB/s"),
        ] {
            let e = config(&[flag, value]).unwrap_err().to_string();
            let name = flag.trim_start_matches("--").replace('-', "_");
            assert!(e.contains(&name), "{flag} {value}: {e}");
            assert!(e.contains(says), "{flag} {value}: {e}");
        }
    }
}
