//! The command line: global flags, subcommands and their arguments (clap).

use clap::{Args, Parser, Subcommand};

/// `shardcast`: operate a shardcast cluster through its controller.
#[derive(Debug, Parser)]
#[command(
    name = "shardcast",
    version,
    about = "Operate a shardcast cluster through its controller"
)]
pub struct Cli {
    /// Controller gRPC address: host:port, http://host:port or unix:/path; or every
    /// replica's, comma-separated (calls follow the elected leader).
    #[arg(
        long,
        global = true,
        env = "SHARDCAST_CONTROLLER",
        default_value = "127.0.0.1:7500"
    )]
    pub controller: String,
    /// Print JSON (the API's messages) instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// Cluster CA bundle (PEM) the controller's certificate must chain to.
    #[arg(long, global = true, env = "SHARDCAST_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// Client certificate (PEM) naming an admin, platform or read identity.
    #[arg(long, global = true, env = "SHARDCAST_TLS_CERT")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, global = true, env = "SHARDCAST_TLS_KEY")]
    pub tls_key: Option<std::path::PathBuf>,
    /// INSECURE: talk plaintext to a controller started with --insecure-plaintext.
    #[arg(long, global = true)]
    pub insecure_plaintext: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Cluster certificates and tokens (no controller needed).
    Certs {
        /// What to do.
        #[command(subcommand)]
        action: CertsCommand,
    },
    /// Register a model: build its manifest from the origin.
    Register(RegisterArgs),
    /// List registered models (and registrations in progress).
    Models,
    /// Show one model's manifest summary.
    Model {
        /// Name or digest.
        model: String,
    },
    /// List hosts and what they report.
    Hosts,
    /// Make N replicas (or the named hosts) hold a model.
    Prewarm(PrewarmArgs),
    /// Add N replicas beyond those that exist.
    ScaleOut(ScaleOutArgs),
    /// Remove a model's copy in a tier from hosts (all holders by default).
    Evict(EvictArgs),
    /// Where a model is, and its plans in flight.
    Status {
        /// Name or digest.
        model: String,
    },
    /// Follow a plan until it ends.
    Watch {
        /// Plan id.
        plan: String,
    },
    /// List plans, newest first.
    Plans,
    /// Report a model's load to the autoscaler (what a FaaS does continuously).
    ReportLoad(ReportLoadArgs),
    /// The autoscaler's decisions with their reasons, newest first.
    Events(EventsArgs),
    /// Partition plans: of a registered model (through the controller), or offline from a
    /// profile file or a synthetic T5-3B-like profile (no controller needed).
    Plan(PlanArgs),
    /// Print shell completions for `shardcast` (no controller needed), e.g.
    /// `shardcast completions bash > /etc/bash_completion.d/shardcast`.
    Completions {
        /// bash, zsh, fish, powershell or elvish.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Man pages (no controller needed): `shardcast.1` on stdout, or with --out one page
    /// per command and subcommand (`shardcast-prewarm.1`, …) written into a directory.
    Man {
        /// Directory to write every page into (created if missing).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
}

/// `shardcast certs …`: a small CA for quick starts. Production clusters may bring their
/// own CA; transferd and the controller only read PEM files.
#[derive(Debug, Subcommand)]
pub enum CertsCommand {
    /// Create the cluster CA (`<dir>/ca.pem`, `<dir>/ca.key` 0600).
    Init {
        /// PKI directory.
        #[arg(long, default_value = "/etc/shardcast/pki")]
        dir: std::path::PathBuf,
        /// The CA's common name.
        #[arg(long, default_value = "shardcast cluster CA")]
        name: String,
        /// Validity in days.
        #[arg(long, default_value_t = 3650)]
        days: u64,
    },
    /// Issue a certificate naming `shardcast://<role>/<name>` (`<dir>/<role>-<name>.pem/.key`).
    Issue {
        /// PKI directory (holding the CA).
        #[arg(long, default_value = "/etc/shardcast/pki")]
        dir: std::path::PathBuf,
        /// host, controller, admin, platform or read.
        #[arg(long)]
        role: String,
        /// The host id (role host) or a principal name.
        #[arg(long)]
        name: String,
        /// Extra DNS names the holder serves under (comma-separated).
        #[arg(long, value_delimiter = ',')]
        dns: Vec<String>,
        /// Extra IP addresses the holder serves under (comma-separated).
        #[arg(long, value_delimiter = ',')]
        ip: Vec<std::net::IpAddr>,
        /// Validity in days.
        #[arg(long, default_value_t = 90)]
        days: u64,
    },
    /// Re-issue a certificate with a new key and validity, same identity and names; running
    /// daemons pick it up without a restart.
    Rotate {
        /// PKI directory (holding the CA).
        #[arg(long, default_value = "/etc/shardcast/pki")]
        dir: std::path::PathBuf,
        /// The certificate to rotate; its key is the same path with `.key`.
        #[arg(long)]
        cert: std::path::PathBuf,
        /// Validity in days.
        #[arg(long, default_value_t = 90)]
        days: u64,
    },
    /// Create a bearer token for HTTP clients; prints the token, and the line to add to the
    /// controller's --tokens-file (which stores only its hash).
    Token {
        /// admin, platform or read.
        #[arg(long)]
        role: String,
        /// A principal name.
        #[arg(long)]
        name: String,
    },
}

/// `shardcast register`'s arguments.
#[derive(Debug, Args)]
pub struct RegisterArgs {
    /// Model name, e.g. org/llama-3-8b.
    pub name: String,
    /// Origin: file:///abs/dir or http(s)://host/prefix/.
    pub origin: String,
    /// Chunk size, e.g. 1MiB [default: 1MiB].
    #[arg(long)]
    pub chunk_size: Option<String>,
    /// Host whose transferd reads the origin [default: any live host].
    #[arg(long)]
    pub via: Option<String>,
    /// A model profile (JSON: per layer group weight bytes, load and execution time,
    /// output bytes) for partition plans and the autoscaler.
    #[arg(long)]
    pub profile: Option<std::path::PathBuf>,
    /// Return once the registration has started; it goes on on the controller, and
    /// `shardcast models` lists it until it ends. (Without it, interrupting the command
    /// does not stop the registration either.)
    #[arg(long)]
    pub no_wait: bool,
}

/// `shardcast prewarm`'s arguments.
#[derive(Debug, Args)]
pub struct PrewarmArgs {
    /// Name or digest.
    pub model: String,
    /// Replicas wanted.
    #[arg(long, short = 'n', conflicts_with = "hosts")]
    pub replicas: Option<u32>,
    /// Exactly these hosts (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub hosts: Vec<String>,
    /// memory, disk or gpu.
    #[arg(long, default_value = "memory")]
    pub tier: String,
    /// auto (hierarchical sources and chains) or origin (every host downloads from the
    /// origin itself: the baseline without shardcast).
    #[arg(long, default_value = "auto")]
    pub sources: String,
    /// tcp or quic: how the chains' hops dial each other [default: the controller's
    /// --transport].
    #[arg(long, default_value = "")]
    pub transport: String,
    /// Return once the plan is made instead of watching it.
    #[arg(long)]
    pub no_wait: bool,
}

/// `shardcast scale-out`'s arguments.
#[derive(Debug, Args)]
pub struct ScaleOutArgs {
    /// Name or digest.
    pub model: String,
    /// Additional replicas.
    #[arg(long, short = 'n')]
    pub replicas: u32,
    /// memory, disk or gpu.
    #[arg(long, default_value = "memory")]
    pub tier: String,
    /// Partitioned burst (tier gpu): split each new replica into this many partitions
    /// on separate hosts, each loading its partition first and then completing to a
    /// full replica.
    #[arg(long, default_value_t = 0)]
    pub partitions: u32,
    /// tcp or quic: how the chains' hops dial each other [default: the controller's
    /// --transport].
    #[arg(long, default_value = "")]
    pub transport: String,
    /// Return once the plan is made.
    #[arg(long)]
    pub no_wait: bool,
}

/// `shardcast evict`'s arguments.
#[derive(Debug, Args)]
pub struct EvictArgs {
    /// Name or digest.
    pub model: String,
    /// Only these hosts (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub hosts: Vec<String>,
    /// memory, disk or gpu.
    #[arg(long, default_value = "memory")]
    pub tier: String,
}

/// `shardcast report-load`'s arguments.
#[derive(Debug, Args)]
pub struct ReportLoadArgs {
    /// Name or digest.
    pub model: String,
    /// Requests per second arriving.
    #[arg(long)]
    pub arrival_rate: f64,
    /// Requests per second one replica serves.
    #[arg(long)]
    pub service_rate: f64,
    /// Requests waiting.
    #[arg(long, default_value_t = 0)]
    pub queue: u32,
    /// memory or gpu.
    #[arg(long, default_value = "memory")]
    pub tier: String,
}

/// `shardcast events`'s arguments.
#[derive(Debug, Args)]
pub struct EventsArgs {
    /// Only this model.
    #[arg(long)]
    pub model: Option<String>,
    /// At most this many.
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
}

/// `shardcast plan`'s arguments.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Registered model (name or digest); omit with --profile or --synthetic-layers.
    pub model: Option<String>,
    /// Offline: a profile JSON file.
    #[arg(long, conflicts_with = "model")]
    pub profile: Option<std::path::PathBuf>,
    /// Offline: a generated T5-3B-like profile with this many layers.
    #[arg(long, conflicts_with_all = ["model", "profile"])]
    pub synthetic_layers: Option<usize>,
    /// Most partitions considered.
    #[arg(long, default_value_t = 8)]
    pub max_partitions: u32,
    /// Per-GPU memory budget, e.g. 16GiB.
    #[arg(long, default_value = "16GiB")]
    pub gpu_memory: String,
    /// Queue length (requests of a burst) the plan is for.
    #[arg(long, default_value_t = 1)]
    pub queue: u32,
    /// Offline: rate of the link carrying activations between partitions, e.g. 100Gbit
    /// [default: 10Gbit, the thesis' testbed]. Through the controller, its
    /// --partition-link-rate or the hosts' NICs decide.
    #[arg(long, conflicts_with = "model")]
    pub link_rate: Option<String>,
    /// Offline: load rate (storage or host memory → GPU), e.g. 25GB/s: every group's
    /// load time becomes its weight bytes at this rate, and the profile is marked
    /// estimated [default: the profile's own load times; a synthetic profile's are
    /// calibrated at 439MB/s].
    #[arg(long, conflicts_with = "model")]
    pub load_rate: Option<String>,
}
