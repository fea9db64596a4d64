//! The `shardcast` operator CLI: talks to the controller's gRPC API. Tables and progress
//! bars on a terminal; `--json` prints the API's messages as JSON for scripts.
//!
//! Exit status: 0 success, 2 invalid argument, 3 not found, 4 not enough capacity,
//! 5 unavailable (no live host, controller unreachable), 6 a plan ended failed, 7 a plan
//! ended partial (some requested hosts without a verified copy, named on stderr), 1 other.
//!
//! Subcommands: `certs init|issue|rotate|token` (a PKI directory, offline), `register`,
//! `models`, `model`, `hosts`, `prewarm`, `scale-out` (`--partitions` for a burst), `evict`,
//! `status`, `watch`, `plans`, `report-load`, `events`, and `plan` (a partition plan, online
//! or offline from a profile at `--link-rate` / `--load-rate`). The controller is reached
//! over mutual TLS (`--tls-ca`, `--tls-cert`, `--tls-key`, several replicas through
//! `shardcast_identity::failover`) or its Unix socket. `tests/cli.rs` runs the binary as a
//! user meets it.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::Duration;

use clap::{Parser, Subcommand};
use futures::StreamExt;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde::Serialize;
use shardcast_identity::failover::FailoverChannel;
use shardcast_protocol::controller::controller_client::ControllerClient;
use shardcast_protocol::controller::{
    EvictRequest, GetModelRequest, GetStatusRequest, GpuState, HostProgress, ListHostsRequest,
    ListModelsRequest, ListPlansRequest, PlanAccepted, PlanKind, PlanState, PlanStatus,
    PrewarmRequest, ReceiverState, RegisterModelRequest, ScaleOutRequest, Tier, Transport,
    WatchPlanRequest,
};
use shardcast_protocol::units::{format_bytes, parse_size};

/// How long a call keeps trying while no controller replica takes it (an election after
/// the leader died takes a few seconds).
const FAILOVER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(15);

use shardcast_protocol::code_name;

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
    Register {
        /// Model name, e.g. org/llama-3-8b.
        name: String,
        /// Origin: file:///abs/dir or http(s)://host/prefix/.
        origin: String,
        /// Chunk size, e.g. 1MiB [default: 1MiB].
        #[arg(long)]
        chunk_size: Option<String>,
        /// Host whose transferd reads the origin [default: any live host].
        #[arg(long)]
        via: Option<String>,
        /// A model profile (JSON: per layer group weight bytes, load and execution time,
        /// output bytes) for partition plans and the autoscaler.
        #[arg(long)]
        profile: Option<std::path::PathBuf>,
        /// Return once the registration has started; it goes on on the controller, and
        /// `shardcast models` lists it until it ends. (Without it, interrupting the command
        /// does not stop the registration either.)
        #[arg(long)]
        no_wait: bool,
    },
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
    Prewarm {
        /// Name or digest.
        model: String,
        /// Replicas wanted.
        #[arg(long, short = 'n', conflicts_with = "hosts")]
        replicas: Option<u32>,
        /// Exactly these hosts (comma-separated).
        #[arg(long, value_delimiter = ',')]
        hosts: Vec<String>,
        /// memory, disk or gpu.
        #[arg(long, default_value = "memory")]
        tier: String,
        /// auto (hierarchical sources and chains) or origin (every host downloads from the
        /// origin itself: the baseline without shardcast).
        #[arg(long, default_value = "auto")]
        sources: String,
        /// tcp or quic: how the chains' hops dial each other [default: the controller's
        /// --transport].
        #[arg(long, default_value = "")]
        transport: String,
        /// Return once the plan is made instead of watching it.
        #[arg(long)]
        no_wait: bool,
    },
    /// Add N replicas beyond those that exist.
    ScaleOut {
        /// Name or digest.
        model: String,
        /// Additional replicas.
        #[arg(long, short = 'n')]
        replicas: u32,
        /// memory, disk or gpu.
        #[arg(long, default_value = "memory")]
        tier: String,
        /// Partitioned burst (tier gpu): split each new replica into this many partitions
        /// on separate hosts, each loading its partition first and then completing to a
        /// full replica.
        #[arg(long, default_value_t = 0)]
        partitions: u32,
        /// tcp or quic: how the chains' hops dial each other [default: the controller's
        /// --transport].
        #[arg(long, default_value = "")]
        transport: String,
        /// Return once the plan is made.
        #[arg(long)]
        no_wait: bool,
    },
    /// Remove a model's copy in a tier from hosts (all holders by default).
    Evict {
        /// Name or digest.
        model: String,
        /// Only these hosts (comma-separated).
        #[arg(long, value_delimiter = ',')]
        hosts: Vec<String>,
        /// memory, disk or gpu.
        #[arg(long, default_value = "memory")]
        tier: String,
    },
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
    ReportLoad {
        /// Name or digest.
        model: String,
        /// Requests per second arriving.
        #[arg(long)]
        arrival_rate: f64,
        /// Requests per second one replica serves.
        #[arg(long)]
        service_rate: f64,
        /// Requests waiting.
        #[arg(long, default_value_t = 0)]
        queue: u32,
        /// memory or gpu.
        #[arg(long, default_value = "memory")]
        tier: String,
    },
    /// The autoscaler's decisions with their reasons, newest first.
    Events {
        /// Only this model.
        #[arg(long)]
        model: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Partition plans: of a registered model (through the controller), or offline from a
    /// profile file or a synthetic T5-3B-like profile (no controller needed).
    Plan {
        /// Registered model (name or digest); omit with --profile or --synthetic-layers.
        model: Option<String>,
        /// Offline: a profile JSON file.
        #[arg(long, conflicts_with = "model")]
        profile: Option<std::path::PathBuf>,
        /// Offline: a generated T5-3B-like profile with this many layers.
        #[arg(long, conflicts_with_all = ["model", "profile"])]
        synthetic_layers: Option<usize>,
        /// Most partitions considered.
        #[arg(long, default_value_t = 8)]
        max_partitions: u32,
        /// Per-GPU memory budget, e.g. 16GiB.
        #[arg(long, default_value = "16GiB")]
        gpu_memory: String,
        /// Queue length (requests of a burst) the plan is for.
        #[arg(long, default_value_t = 1)]
        queue: u32,
        /// Offline: rate of the link carrying activations between partitions, e.g. 100Gbit
        /// [default: 10Gbit, the thesis' testbed]. Through the controller, its
        /// --partition-link-rate or the hosts' NICs decide.
        #[arg(long, conflicts_with = "model")]
        link_rate: Option<String>,
        /// Offline: load rate (storage or host memory → GPU), e.g. 25GB/s: every group's
        /// load time becomes its weight bytes at this rate, and the profile is marked
        /// estimated [default: the profile's own load times; a synthetic profile's are
        /// calibrated at 439MB/s].
        #[arg(long, conflicts_with = "model")]
        load_rate: Option<String>,
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

fn certs(action: CertsCommand) -> Result<(), CliError> {
    use shardcast_identity::Identity;
    use shardcast_identity::pki::{IssueRequest, PkiDir};
    let days = |d: u64| Duration::from_secs(d.saturating_mul(24 * 3600));
    let identity = |role: &str, name: &str| -> Result<Identity, CliError> {
        let role = role.parse().map_err(|e| usage(format!("--role: {e}")))?;
        Identity::new(role, name).map_err(|e| usage(format!("--name: {e}")))
    };
    let fail = |e: shardcast_identity::IdentityError| CliError {
        exit: 1,
        message: e.to_string(),
    };
    match action {
        CertsCommand::Init { dir, name, days: d } => {
            let files = PkiDir::new(&dir).init(&name, days(d)).map_err(fail)?;
            println!(
                "created CA {} (key {})",
                files.cert.display(),
                files.key.display()
            );
        }
        CertsCommand::Issue {
            dir,
            role,
            name,
            dns,
            ip,
            days: d,
        } => {
            let mut req = IssueRequest::new(identity(&role, &name)?);
            req.dns.extend(dns);
            req.ips.extend(ip);
            req.validity = days(d);
            let files = PkiDir::new(&dir).issue(&req).map_err(fail)?;
            println!(
                "issued {} for {} (key {})",
                files.cert.display(),
                req.identity.uri(),
                files.key.display()
            );
        }
        CertsCommand::Rotate { dir, cert, days: d } => {
            let files = shardcast_identity::pki::CertFiles {
                key: cert.with_extension("key"),
                cert,
            };
            PkiDir::new(&dir).rotate(&files, days(d)).map_err(fail)?;
            println!("rotated {}", files.cert.display());
        }
        CertsCommand::Token { role, name } => {
            let id = identity(&role, &name)?;
            if matches!(
                id.role,
                shardcast_identity::Role::Host | shardcast_identity::Role::Controller
            ) {
                return Err(usage(
                    "tokens are for HTTP clients (admin, platform, read); hosts and the controller use certificates",
                ));
            }
            let (token, line) = shardcast_identity::token::generate(&id);
            println!("token: {token}");
            println!("tokens-file line: {line}");
        }
    }
    Ok(())
}

/// How the CLI reaches the controller.
fn client_security(cli: &Cli) -> Result<shardcast_identity::grpc::ClientSecurity, CliError> {
    use shardcast_identity::grpc::ClientSecurity;
    if cli.controller.starts_with("unix:") || cli.insecure_plaintext {
        return Ok(ClientSecurity::Plaintext);
    }
    match (&cli.tls_ca, &cli.tls_cert, &cli.tls_key) {
        (Some(ca), Some(cert), Some(key)) => {
            let ctx = shardcast_identity::TlsContext::load(shardcast_identity::TlsFiles {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            })
            .map_err(|e| usage(format!("TLS identity: {e}")))?;
            Ok(ClientSecurity::Tls(
                ctx,
                shardcast_identity::Expect::Role(shardcast_identity::Role::Controller),
            ))
        }
        _ => Err(usage(
            "the controller requires mutual TLS: pass --tls-ca, --tls-cert and --tls-key (or SHARDCAST_TLS_CA/_CERT/_KEY), \
             or use its Unix socket (--controller unix:/path) as a local operator",
        )),
    }
}

/// A CLI failure with its exit status.
#[derive(Debug)]
pub struct CliError {
    /// Exit status.
    pub exit: i32,
    /// Message for stderr.
    pub message: String,
}

impl From<tonic::Status> for CliError {
    fn from(s: tonic::Status) -> Self {
        let exit = match s.code() {
            tonic::Code::InvalidArgument => 2,
            tonic::Code::NotFound => 3,
            tonic::Code::ResourceExhausted => 4,
            tonic::Code::Unavailable => 5,
            _ => 1,
        };
        Self {
            exit,
            message: format!("{}: {}", code_name(s.code()), s.message()),
        }
    }
}

fn usage(message: impl Into<String>) -> CliError {
    CliError {
        exit: 2,
        message: message.into(),
    }
}

/// A rate given to an offline plan (`--link-rate`, `--load-rate`): finite and at least
/// [`MIN_RATE_BPS`](shardcast_policies::profile::MIN_RATE_BPS).
fn plan_rate(flag: &str, value: Option<&String>) -> Result<Option<f64>, CliError> {
    let Some(s) = value else { return Ok(None) };
    let bps = shardcast_protocol::units::parse_rate(s)
        .map_err(|e| usage(format!("{flag}: {e}")))?
        .ok_or_else(|| {
            usage(format!(
                "{flag} must be a finite rate, e.g. 100Gbit or 25GB/s"
            ))
        })?;
    if bps < shardcast_policies::profile::MIN_RATE_BPS {
        return Err(usage(format!(
            "{flag} must be at least 1MB/s, got {s:?} ({bps} bytes/s; a number without a unit \
             is bytes/s: write e.g. 100Gbit or 25GB/s)"
        )));
    }
    Ok(Some(bps as f64))
}

/// Plans offline from a profile: no controller involved. `link_bps`: the link between
/// partitions (default: [`Bandwidths::default`](shardcast_policies::profile::Bandwidths)'s);
/// `load_bps`: re-estimate every group's load time at this rate.
fn offline_plan(
    mut profile: shardcast_policies::profile::ModelProfile,
    max_partitions: u32,
    gpu_memory: u64,
    queue: u32,
    link_bps: Option<f64>,
    load_bps: Option<f64>,
    json: bool,
) -> Result<(), CliError> {
    use shardcast_policies::partition;
    if let Some(bps) = load_bps {
        profile.estimate_load(bps);
    }
    profile
        .validate()
        .map_err(|e| usage(format!("profile: {e}")))?;
    let link =
        link_bps.unwrap_or_else(|| shardcast_policies::profile::Bandwidths::default().link_bps);
    let table = partition::precompute(
        &profile,
        max_partitions.max(1) as usize,
        gpu_memory,
        link,
        queue.max(64),
    )
    .map_err(|e| CliError {
        exit: 4,
        message: format!("no partition plan: {e}"),
    })?;
    let chosen = table.best_for(queue.max(1)).cloned();
    if json {
        print_json(
            &serde_json::json!({"chosen": chosen, "table": table, "estimated": profile.estimated}),
        );
        return Ok(());
    }
    print_plan(&profile.model, profile.estimated, chosen.as_ref(), queue);
    Ok(())
}

fn print_plan(
    model: &str,
    estimated: bool,
    plan: Option<&shardcast_policies::partition::PartitionPlan>,
    queue: u32,
) {
    let Some(p) = plan else {
        println!("{model}: no plan");
        return;
    };
    println!(
        "{model}: {} partition(s) for a queue of {} — cold start {:.2} s, mean latency {:.2} s{}",
        p.partitions.len(),
        queue.max(1),
        p.cold_start_s,
        p.latency_s,
        if estimated {
            " (figures are estimates: no measured profile)"
        } else {
            ""
        }
    );
    let rows = p
        .partitions
        .iter()
        .enumerate()
        .map(|(i, part)| {
            vec![
                i.to_string(),
                format!("{:?}", part.groups),
                format_bytes(part.weight_bytes),
                format!("{:.3}s", part.load_s),
                format!("{:.3}s", part.exec_s),
            ]
        })
        .collect();
    print!(
        "{}",
        table(&["PART", "GROUPS", "WEIGHTS", "LOAD", "EXEC"], rows)
    );
}

/// Runs one command.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    if let Command::Certs { action } = cli.command {
        return certs(action);
    }
    if let Command::Plan {
        model: None,
        profile,
        synthetic_layers,
        max_partitions,
        gpu_memory,
        queue,
        link_rate,
        load_rate,
    } = &cli.command
    {
        let gpu_memory = parse_size(gpu_memory).map_err(|e| usage(format!("--gpu-memory: {e}")))?;
        let link_bps = plan_rate("--link-rate", link_rate.as_ref())?;
        let load_bps = plan_rate("--load-rate", load_rate.as_ref())?;
        let profile = match (profile, synthetic_layers) {
            (Some(path), _) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| usage(format!("--profile {}: {e}", path.display())))?;
                serde_json::from_str(&text)
                    .map_err(|e| usage(format!("--profile {}: {e}", path.display())))?
            }
            (None, Some(n)) => shardcast_policies::profile::synthetic_t5_3b_like(*n),
            (None, None) => {
                return Err(usage(
                    "give a registered model, --profile FILE or --synthetic-layers N",
                ));
            }
        };
        return offline_plan(
            profile,
            *max_partitions,
            gpu_memory,
            *queue,
            link_bps,
            load_bps,
            cli.json,
        );
    }
    // Several replicas (comma-separated): calls follow the leader and fail over.
    let channel = FailoverChannel::new(
        &shardcast_identity::failover::split_addrs(&cli.controller),
        client_security(&cli)?,
        FAILOVER_PATIENCE,
    )
    .map_err(|e| usage(e.to_string()))?;
    let mut c = ControllerClient::new(channel)
        .max_decoding_message_size(128 << 20)
        .max_encoding_message_size(128 << 20);
    let json = cli.json;
    match cli.command {
        Command::Register {
            name,
            origin,
            chunk_size,
            via,
            profile,
            no_wait,
        } => {
            let profile_json = match profile {
                None => String::new(),
                Some(p) => std::fs::read_to_string(&p)
                    .map_err(|e| usage(format!("--profile {}: {e}", p.display())))?,
            };
            let chunk_size = match chunk_size {
                None => 0,
                Some(s) => {
                    let v = parse_size(&s).map_err(|e| usage(format!("--chunk-size: {e}")))?;
                    u32::try_from(v).map_err(|_| usage("--chunk-size must be below 4 GiB"))?
                }
            };
            if !json && !no_wait {
                eprintln!(
                    "reading {origin} to build the manifest (large models take a while; the registration goes on if this command is interrupted)…"
                );
            }
            let m = c
                .register_model(RegisterModelRequest {
                    name,
                    origin,
                    chunk_size,
                    via_host: via.unwrap_or_default(),
                    profile_json,
                    no_wait,
                })
                .await?
                .into_inner();
            if json {
                print_json(&m);
            } else if no_wait {
                println!(
                    "registering {} from {} (`shardcast models` lists it until it ends)",
                    m.name, m.origin
                );
            } else {
                println!(
                    "registered {} {} ({}, {} shards)",
                    m.name,
                    m.digest,
                    format_bytes(m.total_bytes),
                    m.shards.len()
                );
            }
        }
        Command::Models => {
            let r = c.list_models(ListModelsRequest {}).await?.into_inner();
            if json {
                print_json(&r);
            } else {
                let rows = r
                    .models
                    .iter()
                    .map(|m| {
                        vec![
                            m.name.clone(),
                            short(&m.digest),
                            format_bytes(m.total_bytes),
                            m.shards.len().to_string(),
                            m.origin.clone(),
                        ]
                    })
                    .collect();
                print!(
                    "{}",
                    table(&["MODEL", "DIGEST", "SIZE", "SHARDS", "ORIGIN"], rows)
                );
                if !r.registering.is_empty() {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_secs_f64())
                        .unwrap_or(0.0);
                    let rows = r
                        .registering
                        .iter()
                        .map(|g| {
                            vec![
                                g.name.clone(),
                                g.via_host.clone(),
                                format!("{:.0}s", (now - g.started_at).max(0.0)),
                                g.origin.clone(),
                            ]
                        })
                        .collect();
                    print!(
                        "\nregistering:\n{}",
                        table(&["MODEL", "READ BY", "FOR", "ORIGIN"], rows)
                    );
                }
            }
        }
        Command::Model { model } => {
            let m = c.get_model(GetModelRequest { model }).await?.into_inner();
            if json {
                print_json(&m);
            } else {
                println!(
                    "{} {}\norigin {}\nsize {} in {} shards, chunk {}",
                    m.name,
                    m.digest,
                    m.origin,
                    format_bytes(m.total_bytes),
                    m.shards.len(),
                    format_bytes(u64::from(m.chunk_size))
                );
                let rows = m
                    .shards
                    .iter()
                    .map(|s| vec![s.path.clone(), format_bytes(s.size), s.chunks.to_string()])
                    .collect();
                print!("{}", table(&["SHARD", "SIZE", "CHUNKS"], rows));
            }
        }
        Command::Hosts => {
            let r = c.list_hosts(ListHostsRequest {}).await?.into_inner();
            if json {
                print_json(&r);
            } else {
                let rows = r
                    .hosts
                    .iter()
                    .map(|h| {
                        let rep = h.report.clone().unwrap_or_default();
                        let complete = rep.holdings.iter().filter(|m| m.complete).count();
                        vec![
                            rep.host_id,
                            if h.up { "up".into() } else { "DOWN".into() },
                            format!("{:.1}s", h.last_seen_s),
                            rep.rack,
                            rep.data_addr,
                            format!(
                                "{}/{}",
                                format_bytes(rep.mem_free),
                                format_bytes(rep.mem_capacity)
                            ),
                            format!(
                                "{}/{}",
                                format_bytes(rep.disk_free),
                                format_bytes(rep.disk_capacity)
                            ),
                            format!("{}/{}", h.gpus_reserved, rep.gpus.len()),
                            complete.to_string(),
                            gpu_loads_summary(&rep.gpu_loads),
                        ]
                    })
                    .collect();
                print!(
                    "{}",
                    table(
                        &[
                            "HOST",
                            "STATE",
                            "SEEN",
                            "RACK",
                            "DATA",
                            "MEM FREE",
                            "DISK FREE",
                            "GPUS RSV",
                            "COPIES",
                            "GPU LOADS"
                        ],
                        rows
                    )
                );
            }
        }
        Command::Prewarm {
            model,
            replicas,
            hosts,
            tier,
            sources,
            transport,
            no_wait,
        } => {
            if replicas.is_none() && hosts.is_empty() {
                return Err(usage("give --replicas N or --hosts a,b"));
            }
            let a = c
                .prewarm(PrewarmRequest {
                    model,
                    replicas: replicas.unwrap_or(0),
                    hosts,
                    tier: tier_arg(&tier)?,
                    sources,
                    transport: transport_arg(&transport)?,
                })
                .await?
                .into_inner();
            return accepted(&mut c, a, json, no_wait, None).await;
        }
        Command::ScaleOut {
            model,
            replicas,
            tier,
            partitions,
            transport,
            no_wait,
        } => {
            let a = c
                .scale_out(ScaleOutRequest {
                    model,
                    replicas,
                    tier: tier_arg(&tier)?,
                    partitions,
                    transport: transport_arg(&transport)?,
                })
                .await?
                .into_inner();
            // A burst has no chains: the header says what it is, the host lines what
            // each host loads.
            let what = (partitions > 1).then(|| {
                format!("burst of {replicas} replica(s) × {partitions} partitions, estimated cold start {:.2} s", a.estimate_s)
            });
            return accepted(&mut c, a, json, no_wait, what).await;
        }
        Command::Evict { model, hosts, tier } => {
            let r = c
                .evict(EvictRequest {
                    model,
                    hosts,
                    tier: tier_arg(&tier)?,
                })
                .await?
                .into_inner();
            if json {
                print_json(&r);
            } else {
                if r.evicted.is_empty() && r.pending.is_empty() {
                    println!("nothing to evict");
                }
                if !r.evicted.is_empty() {
                    println!(
                        "evicted from {}: {} freed",
                        r.evicted.join(", "),
                        format_bytes(r.bytes_freed)
                    );
                }
                if !r.pending.is_empty() {
                    println!(
                        "pending on {} (down): evicted when they heartbeat again",
                        r.pending.join(", ")
                    );
                }
            }
        }
        Command::Status { model } => {
            let s = c.get_status(GetStatusRequest { model }).await?.into_inner();
            if json {
                print_json(&s);
            } else {
                let m = s.model.clone().unwrap_or_default();
                println!("{} {} ({})", m.name, m.digest, format_bytes(m.total_bytes));
                let rows = s
                    .hosts
                    .iter()
                    .map(|h| {
                        vec![
                            h.host.clone(),
                            if h.up { "up".into() } else { "DOWN".into() },
                            tier_cell(h.memory, h.memory_bytes, m.total_bytes),
                            tier_cell(h.disk, h.disk_bytes, m.total_bytes),
                            h.gpus.to_string(),
                        ]
                    })
                    .collect();
                print!(
                    "{}",
                    table(&["HOST", "STATE", "MEMORY", "DISK", "GPUS"], rows)
                );
                if !s.plans.is_empty() {
                    println!("plans in flight: {}", s.plans.join(", "));
                }
            }
        }
        Command::Watch { plan } => {
            let last = watch(&mut c, &plan, json).await?;
            return plan_result(&last);
        }
        Command::ReportLoad {
            model,
            arrival_rate,
            service_rate,
            queue,
            tier,
        } => {
            let r = c
                .report_load(shardcast_protocol::controller::ReportLoadRequest {
                    model,
                    arrival_rate,
                    queue_len: queue,
                    service_rate,
                    tier: tier_arg(&tier)?,
                })
                .await?
                .into_inner();
            let d = r.decision.unwrap_or_default();
            if json {
                print_json(&d);
            } else {
                println!("{}: {} ({:+}) — {}", d.model, d.kind, d.delta, d.reason);
            }
        }
        Command::Events { model, limit } => {
            let r = c
                .list_events(shardcast_protocol::controller::ListEventsRequest {
                    model: model.unwrap_or_default(),
                    limit,
                })
                .await?
                .into_inner();
            if json {
                print_json(&r);
            } else {
                let rows = r
                    .events
                    .iter()
                    .map(|e| {
                        vec![
                            format!("{:.1}", e.at),
                            e.model.clone(),
                            e.kind.clone(),
                            format!("{:+}", e.delta),
                            e.reason.clone(),
                        ]
                    })
                    .collect();
                print!(
                    "{}",
                    table(&["AT", "MODEL", "KIND", "DELTA", "REASON"], rows)
                );
            }
        }
        Command::Certs { action } => certs(action)?,
        Command::Plan {
            model,
            max_partitions,
            gpu_memory,
            queue,
            ..
        } => {
            let gpu_memory =
                parse_size(&gpu_memory).map_err(|e| usage(format!("--gpu-memory: {e}")))?;
            let r = c
                .get_partition_plan(shardcast_protocol::controller::GetPartitionPlanRequest {
                    model: model.unwrap_or_default(),
                    max_partitions,
                    gpu_memory,
                    queue,
                })
                .await?
                .into_inner();
            if json {
                println!("{}", r.json);
            } else {
                let v: serde_json::Value = serde_json::from_str(&r.json).unwrap_or_default();
                let plan: Option<shardcast_policies::partition::PartitionPlan> =
                    serde_json::from_value(v["chosen"].clone()).ok();
                print_plan(
                    v["model"].as_str().unwrap_or_default(),
                    r.estimated,
                    plan.as_ref(),
                    queue,
                );
            }
        }
        Command::Plans => {
            let r = c.list_plans(ListPlansRequest {}).await?.into_inner();
            if json {
                print_json(&r);
            } else {
                let rows = r
                    .plans
                    .iter()
                    .map(|p| {
                        let done = p
                            .hosts
                            .iter()
                            .filter(|h| {
                                matches!(h.state(), ReceiverState::Done | ReceiverState::Local)
                            })
                            .count();
                        vec![
                            p.plan_id.clone(),
                            p.model.clone(),
                            if p.kind() == PlanKind::Burst {
                                format!("{} (burst)", p.tier().label())
                            } else {
                                p.tier().label().to_string()
                            },
                            p.state().label().to_string(),
                            format!("{done}/{}", p.hosts.len()),
                            format!("{:.1}s", p.elapsed_s),
                            format!("{:.1}s", p.estimate_s),
                        ]
                    })
                    .collect();
                print!(
                    "{}",
                    table(
                        &[
                            "PLAN", "MODEL", "TIER", "STATE", "HOSTS", "ELAPSED", "ESTIMATE"
                        ],
                        rows
                    )
                );
            }
        }
    }
    Ok(())
}

fn tier_cell(complete: bool, bytes: u64, total: u64) -> String {
    if complete {
        "complete".into()
    } else if bytes > 0 {
        format!("{} / {}", format_bytes(bytes), format_bytes(total))
    } else {
        "-".into()
    }
}

async fn accepted(
    c: &mut ControllerClient<FailoverChannel>,
    a: PlanAccepted,
    json: bool,
    no_wait: bool,
    what: Option<String>,
) -> Result<(), CliError> {
    if json && no_wait {
        print_json(&a);
        return Ok(());
    }
    if !json {
        match what {
            Some(what) => println!("plan {} — {what}", a.plan_id),
            None => println!("plan {} — estimated {:.1} s", a.plan_id, a.estimate_s),
        }
        let rows = a
            .chains
            .iter()
            .map(|ch| {
                vec![
                    format!("{} ({})", ch.source, ch.source_tier),
                    ch.hops.join(" → "),
                    if ch.shards.is_empty() {
                        "all".into()
                    } else {
                        format!("{:?}", ch.shards)
                    },
                    format_bytes(ch.bytes),
                    format!("{:.1}s", ch.estimate_s),
                ]
            })
            .collect::<Vec<_>>();
        if !rows.is_empty() {
            print!(
                "{}",
                table(&["SOURCE", "CHAIN", "SHARDS", "BYTES", "ESTIMATE"], rows)
            );
        }
        for h in a
            .hosts
            .iter()
            .filter(|h| h.state() != ReceiverState::Pending)
        {
            let note = if h.error.is_empty() {
                &h.source
            } else {
                &h.error
            };
            println!("{}: {} ({note})", h.host, host_state(h));
        }
        if no_wait {
            println!("follow it with: shardcast watch {}", a.plan_id);
            return Ok(());
        }
    }
    let last = watch(c, &a.plan_id, json).await?;
    plan_result(&last)
}

/// Exit status of a plan that ended `partial`: some requested hosts hold no verified copy.
pub const EXIT_PARTIAL: i32 = 7;

/// How a followed plan ended, as the exit status: `failed` 6, `partial`
/// ([`EXIT_PARTIAL`]) naming each host short of a verified copy with its state and error.
fn plan_result(p: &PlanStatus) -> Result<(), CliError> {
    match p.state().label() {
        "failed" => Err(CliError {
            exit: 6,
            message: format!("plan {} failed: {}", p.plan_id, p.message),
        }),
        "partial" => {
            let short: Vec<String> = p
                .hosts
                .iter()
                .filter(|h| !matches!(h.state().label(), "done" | "local"))
                .map(|h| {
                    if h.error.is_empty() {
                        format!("{} ({})", h.host, h.state().label())
                    } else {
                        format!("{} ({}: {})", h.host, h.state().label(), h.error)
                    }
                })
                .collect();
            Err(CliError {
                exit: EXIT_PARTIAL,
                message: format!(
                    "plan {} ended partial: {} of {} hosts without a verified copy: {}",
                    p.plan_id,
                    short.len(),
                    p.hosts.len(),
                    short.join("; ")
                ),
            })
        }
        _ => Ok(()),
    }
}

/// Follows a plan: progress bars on a terminal, one line per change otherwise, or the final
/// status as JSON.
async fn watch(
    c: &mut ControllerClient<FailoverChannel>,
    plan: &str,
    json: bool,
) -> Result<PlanStatus, CliError> {
    let mut stream = c
        .watch_plan(WatchPlanRequest {
            plan_id: plan.to_string(),
        })
        .await?
        .into_inner();
    let tty = std::io::stderr().is_terminal() && !json;
    let multi = MultiProgress::new();
    let style =
        ProgressStyle::with_template("{prefix:>12} [{bar:30}] {bytes:>10}/{total_bytes:<10} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
    let mut bars: BTreeMap<String, ProgressBar> = BTreeMap::new();
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut last: Option<PlanStatus> = None;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(3600), stream.next()).await;
        let item = match next {
            Err(_) => break,
            Ok(None) => break,
            Ok(Some(item)) => item?,
        };
        for h in &item.hosts {
            if tty {
                let bar = bars.entry(h.host.clone()).or_insert_with(|| {
                    let b = multi.add(ProgressBar::new(h.total));
                    b.set_style(style.clone());
                    b.set_prefix(h.host.clone());
                    b
                });
                bar.set_length(h.total);
                bar.set_position(h.bytes);
                let msg = if h.error.is_empty() {
                    format!("{} from {}", host_state(h), h.source)
                } else {
                    format!("{} ({})", host_state(h), h.error)
                };
                bar.set_message(msg);
                if !is_running_state(h.state()) && !bar.is_finished() {
                    bar.finish();
                }
            } else if !json {
                let key = format!("{}:{}", host_state(h), h.error);
                if seen.get(&h.host) != Some(&key) {
                    println!(
                        "{:>8.1}s {} {} {}/{} from {}{}",
                        item.elapsed_s,
                        h.host,
                        host_state(h),
                        format_bytes(h.bytes),
                        format_bytes(h.total),
                        h.source,
                        if h.error.is_empty() {
                            String::new()
                        } else {
                            format!(" ({})", h.error)
                        }
                    );
                    seen.insert(h.host.clone(), key);
                }
            }
        }
        last = Some(item);
    }
    // The stream ends with the final state; ask once more in case it was cut short.
    let last = match last {
        Some(l) if l.state() != PlanState::Running => l,
        _ => c
            .get_plan(WatchPlanRequest {
                plan_id: plan.to_string(),
            })
            .await?
            .into_inner(),
    };
    if json {
        print_json(&last);
    } else {
        for b in bars.values() {
            if !b.is_finished() {
                b.finish();
            }
        }
        let rows = last
            .hosts
            .iter()
            .map(|h| {
                let gpu = if h.gpus == 0 {
                    "-".to_string()
                } else if h.gpu_state() == GpuState::Unspecified {
                    format!("{} slots", h.gpus)
                } else {
                    format!(
                        "{} × {} ({})",
                        h.gpus,
                        h.gpu_state,
                        format_bytes(h.gpu_bytes)
                    )
                };
                vec![
                    h.host.clone(),
                    host_state(h),
                    h.source.clone(),
                    format_bytes(h.bytes),
                    gpu,
                    h.error.clone(),
                ]
            })
            .collect();
        print!(
            "{}",
            table(&["HOST", "STATE", "SOURCE", "BYTES", "GPUS", "NOTE"], rows)
        );
        let live = if last.kind() == PlanKind::Burst && last.live_s > 0.0 {
            format!("; every partition live at {:.2} s", last.live_s)
        } else {
            String::new()
        };
        println!(
            "plan {} {} in {:.2} s (estimate {:.2} s{live}){}",
            last.plan_id,
            last.state,
            last.elapsed_s,
            last.estimate_s,
            if last.message.is_empty() {
                String::new()
            } else {
                format!(": {}", last.message)
            }
        );
    }
    Ok(last)
}

/// A host's state in a plan; for a burst with its partition and GPU state, e.g.
/// `loading [1.2/4 partition-live at 1.08 s]`.
fn host_state(h: &HostProgress) -> String {
    if h.partition.is_empty() {
        return h.state().label().to_string();
    }
    let mut s = format!("{} [{}", h.state().label(), h.partition);
    if h.gpu_state() != GpuState::Unspecified {
        s.push(' ');
        s.push_str(h.gpu_state().label());
    }
    if h.live_s > 0.0 {
        s.push_str(&format!(", live at {:.2} s", h.live_s));
    }
    s.push(']');
    s
}

fn is_running_state(s: ReceiverState) -> bool {
    matches!(
        s,
        ReceiverState::Pending
            | ReceiverState::Receiving
            | ReceiverState::Joined
            | ReceiverState::Loading
    )
}

/// A `--tier` argument: memory, disk or gpu.
fn tier_arg(s: &str) -> Result<i32, CliError> {
    match Tier::from_label(s) {
        Some(Tier::Unspecified) | None => Err(usage(format!(
            "--tier must be one of {}, got {s:?}",
            Tier::LABELS.join(", ")
        ))),
        Some(t) => Ok(t as i32),
    }
}

/// `""` leaves the choice to the controller.
fn transport_arg(s: &str) -> Result<i32, CliError> {
    Transport::from_label(s).map(|t| t as i32).ok_or_else(|| {
        usage(format!(
            "--transport must be one of {}, got {s:?}",
            Transport::LABELS.join(", ")
        ))
    })
}

fn print_json<T: Serialize>(v: &T) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("cannot encode JSON: {e}"),
    }
}

fn short(digest: &str) -> String {
    digest.chars().take(12).collect()
}

/// A plain text table with aligned columns.
pub fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in &rows {
        for (i, cell) in r.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let w = widths.get(i).copied().unwrap_or(0);
            if i + 1 == cells.len() {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$}  "));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(headers.iter().map(|h| (*h).to_string()).collect());
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

/// "2 resident, 1 failed": the models on a host's GPUs by state ("-" when none).
fn gpu_loads_summary(loads: &[shardcast_protocol::controller::GpuLoad]) -> String {
    let parts: Vec<String> = ["loading", "partition-live", "resident", "failed"]
        .iter()
        .filter_map(|state| {
            let n = loads.iter().filter(|l| l.state == *state).count();
            (n > 0).then(|| format!("{n} {state}"))
        })
        .collect();
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns() {
        let t = table(
            &["A", "LONGER"],
            vec![
                vec!["xyz".into(), "1".into()],
                vec!["q".into(), "22".into()],
            ],
        );
        assert_eq!(t, "A    LONGER\nxyz  1\nq    22\n");
    }

    #[test]
    fn plan_rates_parse_and_refuse_with_the_flag_named() {
        let r = |s: &str| plan_rate("--link-rate", Some(&s.to_string()));
        assert_eq!(r("400Gbit").unwrap(), Some(50e9));
        assert_eq!(r("25GB/s").unwrap(), Some(25e9));
        assert_eq!(plan_rate("--link-rate", None).unwrap(), None);
        for (bad, says) in [
            ("fast", "invalid rate"),
            ("unlimited", "must be a finite rate"),
            ("100", "a number without a unit is bytes/s"),
        ] {
            let e = r(bad).unwrap_err();
            assert_eq!(e.exit, 2);
            assert!(e.message.starts_with("--link-rate"), "{}", e.message);
            assert!(e.message.contains(says), "{}", e.message);
        }
    }

    #[test]
    fn exit_codes_follow_grpc_codes() {
        let e: CliError = tonic::Status::not_found("x").into();
        assert_eq!(e.exit, 3);
        assert!(e.message.starts_with("NOT_FOUND: x"));
        let e: CliError = tonic::Status::resource_exhausted("x").into();
        assert_eq!(e.exit, 4);
    }

    #[test]
    fn gpu_loads_are_summarised_by_state() {
        use shardcast_protocol::controller::GpuLoad;
        let l = |state: &str| GpuLoad {
            state: state.into(),
            ..Default::default()
        };
        assert_eq!(gpu_loads_summary(&[]), "-");
        assert_eq!(
            gpu_loads_summary(&[l("failed"), l("resident"), l("resident")]),
            "2 resident, 1 failed"
        );
    }
}
