//! Wiring of one transferd process: store, listeners, agent API, admin endpoint, shutdown.
//!
//! Readiness (`shardcast_identity::ready`): the store recovered, each listener accepting
//! (data TCP, QUIC when on, the agent API, the admin endpoint) and, with a controller, its
//! first answered heartbeat; lost at the first moment of shutdown. `/readyz`, the agent
//! listener's `grpc.health.v1` and the `shardcast_ready` gauge all read it. With
//! `shutdown_delay_ms`, SIGTERM first withdraws readiness and keeps serving for that long.
//!
//! Start-up order: recover the store, bind every listener, then print one line
//! `READY data=<addr> agent=<addr> admin=<addr>` on stdout (scripts and `shardcast-bench`
//! wait for it; with port 0 it carries the ports the OS chose). Shutdown (SIGINT/SIGTERM):
//! first drain (`drain_grace_ms`: finish the sessions in flight, start no new one, tell the
//! controller), then stop accepting, cancel what is left, and give tasks a grace period to
//! finish.
//!
//! In order: raise `RLIMIT_NOFILE`, load the TLS identity (which must name this host) and
//! start its reloader, recover the store, bind the data port on TCP and, with `quic` (the
//! default) and TLS, on UDP for QUIC (its accept loop admits each connection and stream
//! against the same caps), the agent's Unix socket (0600) and the admin listener (0600, or
//! 0660 with `store_group`). The TCP accept loop (`chain::Server::accept_tcp`) admits
//! against the connection caps, spawns, and runs the TLS handshake and the `Hello` exchange
//! in the task (under `handshake_timeout_ms`). The agent API sits behind `AuthzLayer`. A task
//! (`keep_registrations`) every 5 s unregisters shard mappings kept registered for GPU loads
//! once the store has dropped them, then registers the memory tier's shards (those still
//! being received included) ahead of any load (`GpuManager::register_ahead`; it pauses
//! while a load runs).
//!
//! Who is given what: the daemon holds the chain's `Node` and hands each task the handles
//! it needs, nothing more:
//!
//! | task | is given |
//! | --- | --- |
//! | the data port's accept loops | the chain's `Server` |
//! | the agent API (`crate::agent`) | a `NodeView`, the store, `Sessions`, `StoreFailures`, `Heads`, the `Fetcher`, `GpuLoads`, cancel |
//! | the admin endpoint (`crate::admin`) | `GpuLoads` (hand-offs), the metrics registry, its counters |
//! | the metrics registry (`crate::metrics`) | a `NodeView`, the store, the GPU manager |
//! | heartbeats (`crate::report`) | a `NodeView`, the store, the GPU manager |
//! | the drain | `Sessions` |
//! | `keep_registrations` | the store, the GPU manager |
//! | `fill_reserve` (with `memory_reserve`) | the store |

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use shardcast_identity::grpc::{self, AuthzLayer, SocketAccess, TcpSecurity};
use shardcast_identity::ready::Readiness;
use shardcast_identity::tls::RELOAD_PERIOD;
use shardcast_identity::token::Tokens;
use shardcast_identity::{Alpn, Role, TlsContext};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use gpu_loader::device::HostMemory;
use gpu_loader::manager::{AheadState, GpuManager};

use crate::agent::AgentService;
use crate::chain::{Faults, Node, Sessions};
use crate::config::{Config, ListenAddr, Security};
use crate::gpu::GpuLoads;
use crate::store::ShardStore;
use crate::throttle::RateLimiter;
use crate::transport::{Quic, Transport, Transports};
use shardcast_protocol::DataTier;

/// The agent's gRPC service name, as `grpc.health.v1` reports it.
const AGENT_SERVICE: &str = shardcast_protocol::agent::agent_server::SERVICE_NAME;

/// How long in-flight work may take to wind down after a shutdown signal.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Runs the daemon until SIGINT or SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let cancel = CancellationToken::new();
    // Readiness (`/readyz`, gRPC health, `shardcast_ready`): each condition below is met
    // where it comes true; the admin listener binds after the store is recovered, so a
    // probe sees "store" unmet only if the order changes, and "controller" until the first
    // heartbeat is answered.
    let readiness = Readiness::new();
    readiness.require("store", "recovering the shard store");
    readiness.require("data", "the data listener is not accepting yet");
    if config.quic && matches!(config.security, Security::Tls(_)) {
        readiness.require("quic", "the QUIC listener is not accepting yet");
    }
    readiness.require("agent", "the agent API is not serving yet");
    readiness.require("admin", "the admin endpoint is not serving yet");
    // Reasons name no address: `/readyz` is anonymous (the logs name the controller).
    if config.inventory.controller.is_some() {
        readiness.require(
            crate::report::CONTROLLER,
            "the controller has not answered a heartbeat yet",
        );
    }
    match shardcast_identity::process::raise_nofile_limit() {
        Ok((old, new)) if new > old => info!(old, new, "raised the open-file limit"),
        Ok(_) => {}
        Err(e) => warn!("cannot raise the open-file limit: {e}"),
    }
    if config.chain.origins.policy().is_empty() {
        warn!("origin_allow is empty: every origin is refused (set --origin-allow)");
    } else {
        info!(allowed = %config.chain.origins.policy().describe(), "origin allow-list");
    }
    let store_cfg = config.store.clone();
    let store = tokio::task::spawn_blocking(move || ShardStore::open(store_cfg))
        .await
        .context("store recovery task")?
        .context("opening the shard store")?;
    readiness.met("store");
    let tls = match &config.security {
        Security::Tls(files) => {
            let ctx = TlsContext::load_as(files.clone(), Role::Host, Some(config.host_id.as_str()))
                .context("loading this host's TLS identity")?;
            // Warns (or errs) now if the certificate or the CA ends soon; the reloader
            // below warns again on each reload and when it gets there while running.
            ctx.set_expiry_warning(config.cert_expiry_warning);
            ctx.log_expiry();
            ctx.spawn_reloader(RELOAD_PERIOD, cancel.clone().cancelled_owned());
            // One budget for the whole greeting: the TLS handshake, then (in `chain`) the
            // Hello exchange, each bounded by `handshake_timeout_ms`.
            ctx.set_handshake_timeout(config.chain.limits.handshake_timeout);
            if config.data_mode == crate::transport::DataMode::AuthenticateOnly {
                warn!(
                    "data_mode = authenticate-only: hops over TCP authenticate with mutual TLS, then send chunks UNENCRYPTED (each still verified against the manifest); every peer must set the same mode; QUIC hops still encrypt"
                );
            }
            Some(ctx)
        }
        Security::InsecurePlaintext => {
            warn!(
                "INSECURE: insecure_plaintext is set; no TLS and no authentication on any listener (loopback only)"
            );
            None
        }
    };
    let data = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding data listener {}", config.listen))?;
    let data_addr = data.local_addr()?;
    let transports = Transports {
        tcp: match &tls {
            Some(ctx) => Transport::Tls(ctx.clone(), config.data_mode),
            None => Transport::InsecureTcp,
        },
        // QUIC on the data port's number (UDP), with the same identity.
        quic: match (&tls, config.quic) {
            (Some(ctx), true) => {
                let q = Quic::bind(
                    data_addr,
                    ctx.clone(),
                    config.quic_path_mtu,
                    config.quic_connections,
                )
                .context("binding the QUIC listener (set quic = false to run without)")?;
                q.log_ready();
                q.follow_reloads(cancel.clone());
                Some(Transport::Quic(q))
            }
            (None, true) => {
                info!(
                    "no QUIC listener: QUIC needs the TLS identity, and insecure_plaintext is set"
                );
                None
            }
            (_, false) => None,
        },
    };
    // Hops below name this host to recover from when their upstream stalls: the configured
    // address, else the bound one when it is specific.
    let advertised_data = match &config.inventory.advertise {
        Some(a) => Some(a.clone()),
        None if !data_addr.ip().is_unspecified() => Some(data_addr.to_string()),
        None => None,
    };
    let node = Node::new(
        config.host_id.clone(),
        advertised_data,
        store,
        transports,
        RateLimiter::new(config.ingress_rate),
        RateLimiter::new(config.egress_rate),
        config.chain.clone(),
        Faults::corrupt_once(config.corrupt_once.iter().copied()),
        cancel.child_token(),
    );
    if !config.corrupt_once.is_empty() {
        warn!(chunks = ?config.corrupt_once, "FAULT INJECTION ARMED: these chunks will be corrupted once when sent");
    }

    // GPUs: CUDA when a driver is present (a host without one runs on without GPUs),
    // simulated when configured. Opening CUDA contexts can take seconds: off the runtime.
    let gpu_cfg = config.gpu.clone();
    let gpus = Arc::new(
        tokio::task::spawn_blocking(move || GpuManager::open(&gpu_cfg))
            .await
            .context("GPU start-up task")?,
    );
    {
        let m = node.view().metrics().clone();
        gpus.observe_loads(Box::new(move |resident| m.gpu_load_done(resident)));
    }
    let loads = GpuLoads::new(node.store().clone(), node.repairs().clone(), gpus.clone());
    // The metrics registry, handed to the admin endpoint (`crate::metrics`).
    let mut registry = crate::metrics::registry(node.view(), node.store(), &gpus);
    crate::metrics::register_readiness(&mut registry, readiness.clone());
    let registry = Arc::new(registry);
    let agent = ApiListener::bind(&config.agent_listen, "agent", SocketAccess::Owner).await?;
    // Inference processes in the store's group may read hand-offs from the admin socket.
    let admin_access = match config.store.group {
        Some(gid) => SocketAccess::Group(gid),
        None => SocketAccess::Owner,
    };
    let admin = ApiListener::bind(&config.admin_listen, "admin", admin_access).await?;
    let tokens = match &config.tokens_file {
        Some(p) => Tokens::load(p).context("loading the tokens file")?,
        None => Tokens::default(),
    };
    let (agent_addr, admin_addr) = (agent.describe()?, admin.describe()?);

    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(node.server().clone().accept_tcp(data, cancel.clone()));
    readiness.met("data");
    if let Some(q) = node.view().transports().quic() {
        tasks.spawn(node.server().clone().accept_quic(q.clone(), cancel.clone()));
        readiness.met("quic");
    }
    tasks.spawn(keep_registrations(
        node.store().clone(),
        gpus.clone(),
        cancel.clone(),
    ));
    if config.store.memory_reserve.bytes > 0 {
        tasks.spawn(fill_reserve(node.store().clone(), cancel.clone()));
    }
    {
        let service = shardcast_protocol::agent::agent_server::AgentServer::new(AgentService {
            view: node.view().clone(),
            store: node.store().clone(),
            sessions: node.sessions().clone(),
            failures: node.failures().clone(),
            heads: node.heads().clone(),
            fetcher: node.fetcher().clone(),
            gpus: loads.clone(),
            cancel: node.cancel().clone(),
        })
        .max_decoding_message_size(128 << 20)
        .max_encoding_message_size(128 << 20);
        let cancel = cancel.clone();
        let security = match &tls {
            Some(ctx) => TcpSecurity::Tls(ctx.clone(), Alpn::Grpc),
            None => TcpSecurity::Plaintext,
        };
        let incoming = agent.incoming(security, cancel.clone());
        let authz = AuthzLayer::new(crate::agent::permission, node.view().stats().authz.clone());
        // grpc.health.v1 beside the agent: SERVING while ready (any certificate may ask).
        let health = readiness
            .health_service(&[AGENT_SERVICE], cancel.clone())
            .await;
        tasks.spawn(async move {
            let r = tonic::transport::Server::builder()
                .http2_keepalive_interval(Some(grpc::SERVER_KEEPALIVE.0))
                .http2_keepalive_timeout(Some(grpc::SERVER_KEEPALIVE.1))
                .layer(authz)
                .add_service(service)
                .add_service(health)
                .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
                .await;
            if let Err(e) = r {
                warn!("agent API server ended: {e}");
            }
        });
        readiness.met("agent");
    }
    {
        // HTTPS with the cluster identity (a client certificate or a bearer token); plain
        // HTTP only in insecure mode (loopback, checked) or on the Unix socket.
        let security = match &tls {
            Some(ctx) => TcpSecurity::TlsOptionalClient(ctx.clone()),
            None => {
                if let ApiListener::Tcp(_) = admin {
                    warn!(
                        "INSECURE: the admin listener serves plain HTTP without authentication (insecure_plaintext)"
                    );
                }
                TcpSecurity::Plaintext
            }
        };
        let incoming = admin.incoming(security, cancel.clone());
        let api = crate::admin::AdminApi {
            gpus: loads.clone(),
            stats: crate::admin::AdminStats {
                authz: node.view().stats().admin_authz.clone(),
                http: node.view().stats().admin_http.clone(),
            },
            registry: registry.clone(),
            readiness: readiness.clone(),
            tokens,
            limits: config.admin_limits,
        };
        tasks.spawn(crate::admin::serve(api, incoming, cancel.clone()));
        readiness.met("admin");
    }
    if let Some(controller) = config.inventory.controller.clone() {
        let addrs = advertised(&config, data_addr, &agent_addr)?;
        info!(%controller, data = %addrs.data, agent = %addrs.agent, "reporting to the controller");
        let reporting = crate::report::Reporting {
            view: node.view().clone(),
            store: node.store().clone(),
            gpus: gpus.clone(),
            inventory: config.inventory.clone(),
            advertised: addrs,
            controller,
        };
        tasks.spawn(crate::report::run(
            reporting,
            readiness.clone(),
            cancel.clone(),
        ));
    }
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    info!(host = %config.host_id, %data_addr, %agent_addr, %admin_addr, stripes = %config.chain.stripes, workers, "transferd ready");
    println!("READY data={data_addr} agent={agent_addr} admin={admin_addr}");

    shardcast_identity::process::shutdown_signal().await;
    // Not ready from the first moment of shutdown: /readyz 503, gRPC health NOT_SERVING.
    readiness.drain();
    // Then serve on for `shutdown_delay_ms` (load balancers see the 503) while the drain
    // finishes the sessions in flight; a second signal ends both at once.
    let delay = async {
        if !config.shutdown_delay.is_zero() {
            info!(delay = ?config.shutdown_delay, "shutdown requested: not ready; serving on until the delay ends (a second signal ends it)");
            tokio::time::sleep(config.shutdown_delay).await;
        }
    };
    tokio::select! {
        _ = async { tokio::join!(delay, drain(node.sessions(), config.drain_grace)) } => {}
        _ = shardcast_identity::process::shutdown_signal() => {
            warn!(unfinished = node.sessions().unfinished(), "asked again to stop: ending the delay and the drain now");
        }
    }
    info!("shutting down: no new connections; {SHUTDOWN_GRACE:?} for in-flight work");
    cancel.cancel();
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!("grace period over; exiting with tasks still running");
    }
    Ok(())
}

/// The drain after a stop signal: the host stops taking new sessions and new agent work
/// (`Sessions::start_draining`; its heartbeat tells the controller at once, which places
/// nothing new there) and waits for its unfinished sessions, until none is left or `grace`
/// is over (the caller ends it at a second signal too). What is still unfinished then is
/// ended by the shutdown: the hops above fail over past this host and the hops below
/// recover, as after a crash, and a restarted host resumes its copy from its verified
/// chunks.
async fn drain(sessions: &Sessions, grace: Duration) {
    if grace.is_zero() {
        return;
    }
    sessions.start_draining();
    let unfinished = sessions.unfinished();
    if unfinished == 0 {
        info!("draining: no session in flight");
        return;
    }
    info!(
        unfinished,
        ?grace,
        "draining: finishing the sessions in flight, starting no new one"
    );
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        let left = sessions.unfinished();
        if left == 0 {
            info!("drained: every session finished");
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {
                warn!(left, "drain grace over: ending the unfinished sessions (the hops above fail over past this host)");
                return;
            }
            _ = tokio::time::sleep(DRAIN_POLL) => {}
        }
    }
}

/// How often a draining host looks at its unfinished sessions.
const DRAIN_POLL: Duration = Duration::from_millis(100);

/// The addresses to report: configured ones, else the bound ones when they are specific.
fn advertised(
    config: &Config,
    data: std::net::SocketAddr,
    agent: &str,
) -> anyhow::Result<crate::report::Advertised> {
    let data = match &config.inventory.advertise {
        Some(a) => a.clone(),
        None if data.ip().is_unspecified() => anyhow::bail!(
            "the data listener is {data}: set `advertise` to the address peers should use"
        ),
        None => data.to_string(),
    };
    let agent = match &config.inventory.agent_advertise {
        Some(a) => a.clone(),
        None if agent.starts_with("0.0.0.0:") || agent.starts_with("[::]:") => anyhow::bail!(
            "the agent listener is {agent}: set `agent_advertise` to the address the controller should use"
        ),
        None => agent.to_string(),
    };
    Ok(crate::report::Advertised { data, agent })
}

/// The agent's or the admin's listener: TCP or a Unix socket.
enum ApiListener {
    Tcp(TcpListener),
    Unix(tokio::net::UnixListener, std::path::PathBuf, SocketAccess),
}

impl ApiListener {
    async fn bind(addr: &ListenAddr, what: &str, access: SocketAccess) -> anyhow::Result<Self> {
        match addr {
            ListenAddr::Tcp(a) => Ok(Self::Tcp(
                TcpListener::bind(a)
                    .await
                    .with_context(|| format!("binding {what} listener {a}"))?,
            )),
            ListenAddr::Unix(path) => {
                // A stale socket from a previous run is replaced (never another kind of
                // file); the new one is 0600 (0660 for a group): only this user, root
                // (and the group's members) may connect.
                let l = grpc::bind_unix(path, access)
                    .with_context(|| format!("binding {what} socket {}", path.display()))?;
                Ok(Self::Unix(l, path.clone(), access))
            }
        }
    }

    fn describe(&self) -> std::io::Result<String> {
        Ok(match self {
            Self::Tcp(l) => l.local_addr()?.to_string(),
            Self::Unix(_, p, _) => format!("unix:{}", p.display()),
        })
    }

    /// Authenticated connections: TCP ones as `security` says, Unix ones by their uid.
    fn incoming(self, security: TcpSecurity, cancel: CancellationToken) -> grpc::Incoming {
        match self {
            Self::Tcp(l) => grpc::incoming_tcp(l, security, cancel.cancelled_owned()),
            Self::Unix(l, _, access) => grpc::incoming_unix(l, access, cancel.cancelled_owned()),
        }
    }
}

/// How often shard mappings that left the memory tier are unregistered from the GPUs, and
/// memory-tier shards not registered yet are registered ahead of loads. Until the sweep, a
/// removed shard's pages stay pinned (its memory is not given back), so the period bounds
/// how long evicted shards keep host memory; a sweep is a lock and a count per kept
/// mapping, plus the unregistering (≈ 0.03 s per 4 GiB measured on an H100 host). A new
/// memory-tier shard starts a sweep at once (its session is starting), unless a load runs.
const REGISTRATION_SWEEP: Duration = Duration::from_secs(5);

/// Every [`REGISTRATION_SWEEP`], and whenever a memory-tier shard is created: unregisters
/// the shard mappings kept registered for GPU loads that the store no longer holds, then
/// registers the memory tier's shards ahead of loads, those still being received included
/// (see [`memory_tier_mappings`] and [`GpuManager::register_ahead`]; it pauses while a load
/// runs).
async fn keep_registrations(store: ShardStore, gpus: Arc<GpuManager>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(REGISTRATION_SWEEP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let _stop_on_exit = StopOnDrop(stop.clone());
    let created = store.memory_shard_created();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
            _ = created.notified() => {}
        }
        let (g, store, stop) = (gpus.clone(), store.clone(), stop.clone());
        // Pinning and unregistering call the driver: off the runtime.
        let pass = tokio::task::spawn_blocking(move || {
            let released = g.release_unused_registrations();
            let ahead = (g.ahead_state() == AheadState::On)
                .then(|| g.register_ahead(&memory_tier_mappings(&store), &stop));
            (released, ahead)
        });
        let Ok((released, ahead)) = pass.await else {
            continue;
        };
        if released > 0 {
            tracing::debug!(
                bytes = released,
                "unregistered shard mappings the store dropped"
            );
        }
        if let Some(a) = ahead.filter(|a| a.segments > 0) {
            info!(
                shards = a.complete,
                bytes = a.bytes,
                paused_for_a_load = a.paused,
                "registered memory-tier shards with the GPUs ahead of loads"
            );
        }
    }
}

/// How long no chunk may have been written before the memory reserve's filler allocates:
/// a transfer in progress writes chunks far more often.
const RESERVE_IDLE: Duration = Duration::from_secs(1);
/// How often the filler looks at the store while it is not filling.
const RESERVE_TICK: Duration = Duration::from_millis(250);

/// Fills the memory reserve (see `store::reserve`) while the host is idle: once no shard has
/// been created and no chunk written for [`RESERVE_IDLE`], one step
/// ([`crate::store::FILL_STEP`]) after the other until it is full, the tier's bounds leave
/// no room, or a shard or chunk is written again. (A shard taking a spare leaves the
/// reserve short just as its transfer starts: counting the creation as activity keeps the
/// filler off the cores until the transfer is over.) Once the reserve is full it maps, step
/// by step too, the spares kept from an earlier run (`ShardStore::map_reserve`). Every tick
/// it also drops spares the bounds no longer leave room for (the host's available memory
/// fell below the headroom).
async fn fill_reserve(store: ShardStore, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(RESERVE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let written = || {
        let st = store.stats();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        load(&st.chunks_written).wrapping_add(load(&st.shards_created))
    };
    let mut quiet = crate::store::Quiet::new(RESERVE_IDLE, 0, (written(), 0), false);
    let mut failed = false;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        loop {
            if !quiet.observe(written(), 0) || cancel.is_cancelled() {
                break;
            }
            let s = store.clone();
            // Allocate first; once the reserve is full, map the spares kept from an
            // earlier run (page tables only).
            let step = move || match s.fill_reserve()? {
                0 => s.map_reserve(),
                n => Ok(n),
            };
            match tokio::task::spawn_blocking(step).await {
                Ok(Ok(n)) if n > 0 => failed = false,
                Ok(Ok(_)) => break,
                Ok(Err(e)) => {
                    if !failed {
                        warn!("filling the memory reserve: {e}");
                    }
                    failed = true;
                    break;
                }
                Err(e) => {
                    warn!("the memory reserve's filler: {e}");
                    break;
                }
            }
        }
    }
}

/// Sets the flag when dropped (the task ends or is aborted): a registration pass still
/// running on the blocking pool then stops at its next segment.
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The mapped memory of every shard in the memory tier, named by its file: complete ones,
/// and those still being received (issue #28: a shard's destination is pinned as its
/// session starts, so a load streamed while its chunks arrive finds it registered instead
/// of pinning as it copies or staging). Pinning reads only the map; which bytes a load
/// may copy is still decided by the shard's verified chunks. A shard written into a spare
/// of the memory reserve has its pages already; pinning another allocates them, which
/// its chunks' writes then find in place.
fn memory_tier_mappings(store: &ShardStore) -> Vec<(String, Arc<dyn HostMemory>)> {
    store
        .shard_keys()
        .into_iter()
        .filter(|(_, tier, _)| *tier == DataTier::Memory)
        .filter_map(|(d, tier, i)| store.tier_shard(&d, i, tier))
        .filter(|s| !s.is_removed())
        .filter_map(|s| {
            let map = s.mapping()?;
            Some((s.path().display().to_string(), map as Arc<dyn HostMemory>))
        })
        .collect()
}
