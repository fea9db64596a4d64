//! Wiring of the `shardcast-controller` process: configuration, state, listeners.
//!
//! Configuration: [`config`] ([`Cli`], [`Args`], the layered loader, `--print-config`).
//!
//! Start-up: open the state store (resuming plans in flight), bind every listener, then
//! print one line `READY grpc=<addr> http=<addr> [unix=<path>]` on stdout.
//!
//! Readiness (`shardcast_identity::ready`: `GET /readyz`, `grpc.health.v1` on the gRPC
//! listeners, the `shardcast_ready` gauge): the state is loaded, every listener serves and,
//! on etcd, a leader is known (this replica or another: a follower that can name the
//! leader serves reads and points writes at it). Lost at the first moment of shutdown;
//! with `shutdown_delay_ms` the controller then serves on, not ready, for that long.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use shardcast_identity::grpc::{self, AuthzLayer, SocketAccess, TcpSecurity};
use shardcast_identity::http::HttpAuthLayer;
use shardcast_identity::tls::RELOAD_PERIOD;
use shardcast_identity::token::Tokens;
use shardcast_identity::{Alpn, TlsContext};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::grpc::{controller_service, inventory_service};
use crate::ha::{Active, LeaderGate, Replica, Slot, Switch};
use crate::services::{Config, Services};
use crate::state::RedbStore;
use shardcast_identity::grpc::GateLayer;
use shardcast_identity::ready::Readiness;

/// The services `grpc.health.v1` reports besides the whole server (`""`).
const HEALTH_SERVICES: [&str; 2] = [
    shardcast_protocol::controller::controller_server::SERVICE_NAME,
    shardcast_protocol::controller::inventory_server::SERVICE_NAME,
];

pub mod config;

use config::load_tls;
pub use config::{Args, Cli, Loaded};

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
    let readiness = Readiness::new();
    readiness.require("state", "loading the state store");
    readiness.require("grpc", "the gRPC listener is not serving yet");
    readiness.require("http", "the HTTP listener is not serving yet");
    if args.unix.is_some() {
        readiness.require("unix", "the gRPC Unix socket is not serving yet");
    }
    if args.state.is_some() {
        readiness.require(crate::ha::LEADER, "no leader known yet");
    }
    cfg.core.metrics.set_readiness(readiness.clone());
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

    readiness.met("state");
    if args.state.is_some() {
        tokio::spawn(
            replica
                .clone()
                .follow_leader(readiness.clone(), cancel.clone()),
        );
    }

    let authz = slot.load().ctl.core.authz_stats();
    let http_stats = slot.load().ctl.core.http_stats();
    // grpc.health.v1 beside the services: SERVING while ready (any certificate may ask;
    // followers answer it too).
    let health = readiness
        .health_service(&HEALTH_SERVICES, cancel.clone())
        .await;
    let services = || {
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(grpc::SERVER_KEEPALIVE.0))
            .http2_keepalive_timeout(Some(grpc::SERVER_KEEPALIVE.1))
            .layer(AuthzLayer::new(crate::auth::permission, authz.clone()))
            .layer(GateLayer::gate(LeaderGate(replica.clone())))
            .add_service(Switch::new(slot.clone(), controller_service))
            .add_service(Switch::new(slot.clone(), inventory_service))
            .add_service(health.clone())
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
        readiness.met("grpc");
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
        readiness.met("unix");
    }
    {
        let router = crate::ha::http_router(
            slot.clone(),
            replica.clone(),
            readiness.clone(),
            crate::openapi::json,
        )
        .layer(HttpAuthLayer::new(
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
        readiness.met("http");
    }
    let unix_note = args
        .unix
        .as_ref()
        .map(|p| format!(" unix={}", p.display()))
        .unwrap_or_default();
    info!(%grpc_addr, %http_addr, state = %state_note, "controller ready");
    println!("READY grpc={grpc_addr} http={http_addr}{unix_note}");

    shardcast_identity::process::shutdown_signal().await;
    // Not ready from the first moment of shutdown: /readyz 503, gRPC health NOT_SERVING.
    readiness.drain();
    let delay = Duration::from_millis(args.shutdown_delay_ms);
    if !delay.is_zero() {
        info!(
            ?delay,
            "shutdown requested: not ready; serving on until the delay ends (a second signal ends it)"
        );
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shardcast_identity::process::shutdown_signal() => {}
        }
    }
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
