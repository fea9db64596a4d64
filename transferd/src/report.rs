//! Heartbeats to the controller's inventory service: who this host is, where to reach it,
//! its labels, capacities and free space per tier, its GPUs, and what it holds. The first
//! heartbeat registers the host; the controller marks it down after missed heartbeats.
//!
//! A controller that is down or unreachable is logged once per outage, never fatal: the data
//! plane keeps serving chains that are already planned. A host that starts draining sends a
//! heartbeat at once (`draining`), so the controller stops placing there.
//!
//! The controller's answer carries its registry's current version of each reported model
//! name; the host's name table follows it (see `crate::store::names`). It also says which
//! of the host's GPU models another host holds resident on its GPUs, for the GPU manager's
//! eviction order.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use shardcast_protocol::controller::inventory_client::InventoryClient;
use shardcast_protocol::controller::{Gpu, GpuLoad, HeldModel, HostReport, NameBinding};
use shardcast_protocol::{DataTier, ModelDigest, ModelName};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use gpu_loader::manager::GpuManager;

use crate::agent::{model_status, state_name};
use crate::chain::NodeView;
use crate::config::Inventory;
use crate::store::ShardStore;

/// Heartbeats the controller's answer about GPU copies on other hosts holds for: after that
/// many go unanswered, every GPU model counts as the only GPU copy again (the cautious
/// default without a controller).
const GPU_COPIES_HEARTBEATS: u32 = 3;

/// The readiness condition heartbeats meet: the controller has answered one since start.
/// Later misses do not withdraw it (the data plane keeps serving planned chains while the
/// controller is away, and a controller outage must not take every host out of rotation);
/// they are logged and counted by the controller's inventory instead.
pub const CONTROLLER: &str = "controller";

/// Addresses this host advertises.
#[derive(Debug, Clone)]
pub struct Advertised {
    /// Data-plane `host:port` as peers reach it.
    pub data: String,
    /// Agent API address as the controller reaches it.
    pub agent: String,
}

/// What a host reports and to whom: the handles and settings [`run`] works with.
pub struct Reporting {
    /// The data plane's figures it reads: the host id, TLS, draining.
    pub view: NodeView,
    /// Holdings and free space per tier; its name table follows the controller's answers.
    pub store: ShardStore,
    /// The host's GPUs; told which GPU copies exist on other hosts.
    pub gpus: Arc<GpuManager>,
    /// The heartbeat interval, labels and capacities (`[inventory]`).
    pub inventory: Inventory,
    /// Where peers and the controller reach this host.
    pub advertised: Advertised,
    /// The controller's address, or its replicas' (comma-separated).
    pub controller: String,
}

/// Sends a heartbeat every `inventory.heartbeat` until `cancel`. It reads the data plane's
/// figures (`view`: the host id, TLS, draining), the store's holdings and free space and
/// the GPUs; from the controller's answer it writes the store's name table and tells the
/// GPU manager which GPU copies exist elsewhere, and nothing else. The first answer meets
/// the readiness condition [`CONTROLLER`].
pub async fn run(
    reporting: Reporting,
    readiness: shardcast_identity::ready::Readiness,
    cancel: CancellationToken,
) {
    let Reporting {
        view,
        store,
        gpus,
        inventory: inv,
        advertised: addrs,
        controller,
    } = reporting;
    // Over TCP: mutual TLS, and the server must be the controller. A Unix socket is local
    // (its 0600 mode is the authentication); plaintext TCP only in insecure mode.
    let security = match view.transports().tls() {
        Some(ctx) if !controller.starts_with("unix:") => {
            shardcast_identity::grpc::ClientSecurity::Tls(
                ctx.clone(),
                shardcast_identity::Expect::Role(shardcast_identity::Role::Controller),
            )
        }
        _ => shardcast_identity::grpc::ClientSecurity::Plaintext,
    };
    // Several controller replicas (comma-separated): heartbeats follow the leader, whose
    // inventory is the one placement uses.
    let channel = match shardcast_identity::failover::FailoverChannel::new(
        &shardcast_identity::failover::split_addrs(&controller),
        security,
        inv.heartbeat.max(Duration::from_secs(2)),
    ) {
        Ok(c) => c,
        Err(e) => {
            warn!("not reporting to the controller: {e}");
            return;
        }
    };
    let mut client = InventoryClient::new(channel);
    let mut tick = tokio::time::interval(inv.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut connected: Option<bool> = None;
    let mut draining = view.watch_draining();
    // Whether the controller has answered once (the readiness condition, see CONTROLLER).
    let mut answered = false;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
            // A host that starts draining says so at once: the controller stops placing
            // there before the next tick.
            Ok(()) = draining.changed() => {}
        }
        let report = build_report(&view, &store, &gpus, &inv, &addrs);
        let reported = reported_names(&report);
        let sent = tokio::time::timeout(
            inv.heartbeat.max(Duration::from_secs(2)),
            client.heartbeat(report),
        )
        .await;
        match sent {
            Ok(Ok(answer)) => {
                if connected != Some(true) {
                    info!(%controller, "registered with the controller");
                }
                readiness.met(CONTROLLER);
                answered = true;
                connected = Some(true);
                let answer = answer.into_inner();
                apply_registry(&store, &reported, &answer.names, answer.issued_at_ms);
                gpus.set_gpu_copies_elsewhere(
                    answer.gpu_copies_elsewhere,
                    inv.heartbeat * GPU_COPIES_HEARTBEATS,
                );
            }
            Ok(Err(status)) => {
                if connected != Some(false) {
                    warn!(%controller, code = ?status.code(), "controller rejected the heartbeat: {}", with_causes(&status));
                }
                if !answered {
                    // An unreachable controller is an `UNAVAILABLE` of the channel.
                    let why = if status.code() == tonic::Code::Unavailable {
                        "the controller has not answered a heartbeat yet (unreachable)".to_string()
                    } else {
                        format!("the controller refused the heartbeat ({:?})", status.code())
                    };
                    readiness.unmet(CONTROLLER, why);
                }
                connected = Some(false);
            }
            Err(_) => {
                if connected != Some(false) {
                    warn!(%controller, "controller did not answer the heartbeat; retrying every {:?}", inv.heartbeat);
                }
                if !answered {
                    readiness.unmet(
                        CONTROLLER,
                        "the controller has not answered a heartbeat yet (no answer in time)",
                    );
                }
                connected = Some(false);
            }
        }
    }
}

/// A refused call's message and the errors beneath it: a handshake the controller refused
/// (this host's certificate expired, another CA) reads `operation was canceled` alone, the
/// alert that says why is in its sources.
fn with_causes(status: &tonic::Status) -> String {
    let mut text = status.message().to_string();
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        let e_text = e.to_string();
        if !text.contains(&e_text) {
            text.push_str(": ");
            text.push_str(&e_text);
        }
        source = e.source();
    }
    text
}

/// The model names a report asks the controller about: its holdings' and its bound names.
fn reported_names(report: &HostReport) -> Vec<ModelName> {
    let mut names: Vec<ModelName> = report
        .holdings
        .iter()
        .map(|h| h.name.as_str())
        .chain(report.bound_names.iter().map(String::as_str))
        .filter_map(|n| ModelName::new(n).ok())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Applies the controller's registry (its answer to a heartbeat, made at `stated_ms` by its
/// clock) to the name table. An entry that does not parse is skipped and logged: it binds
/// nothing.
fn apply_registry(
    store: &ShardStore,
    reported: &[ModelName],
    answer: &[NameBinding],
    stated_ms: u64,
) {
    let mut registry = BTreeMap::new();
    for b in answer {
        match (
            ModelName::new(b.name.as_str()),
            b.digest.parse::<ModelDigest>(),
        ) {
            (Ok(name), Ok(digest)) => {
                registry.insert(name, digest);
            }
            _ => {
                warn!(name = %b.name, digest = %b.digest, "ignoring a malformed name binding from the controller")
            }
        }
    }
    if let Err(e) = store.sync_names(reported, &registry, stated_ms) {
        warn!("could not save the name table: {e}");
    }
}

/// Capacity and free bytes of a tier: the file system's (with `spares`, the memory
/// reserve's bytes, counted free), lowered by a configured cap (less what the store already
/// holds there).
fn space(dir: &Path, cap: Option<u64>, used: u64, spares: u64) -> (u64, u64) {
    let (fs_total, fs_free) = match rustix::fs::statvfs(dir) {
        Ok(s) => (
            s.f_blocks.saturating_mul(s.f_frsize),
            s.f_bavail.saturating_mul(s.f_frsize).saturating_add(spares),
        ),
        Err(_) => (0, 0),
    };
    match cap {
        Some(c) => (c.min(fs_total.max(c)), fs_free.min(c.saturating_sub(used))),
        None => (fs_total, fs_free),
    }
}

/// When this process started reporting (Unix ms; read once): a restarted transferd
/// reports a new value, and the controller re-plans what it was receiving at once.
fn process_started_ms() -> u64 {
    static STARTED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *STARTED.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    })
}

/// The report for one heartbeat.
pub fn build_report(
    view: &NodeView,
    store: &ShardStore,
    gpus: &GpuManager,
    inv: &Inventory,
    addrs: &Advertised,
) -> HostReport {
    let holdings = store.holdings();
    let mut used = [0u64; 2];
    let mut held = Vec::with_capacity(holdings.len());
    for h in &holdings {
        let st = model_status(h);
        let slot = match h.tier {
            DataTier::Memory => 0,
            DataTier::Disk => 1,
        };
        let tier = h.tier.as_str();
        used[slot] += st.total_bytes;
        held.push(HeldModel {
            digest: st.digest,
            name: st.name,
            tier: tier.into(),
            complete: st.complete,
            bytes_verified: st.bytes_verified,
            total_bytes: st.total_bytes,
        });
    }
    // The memory reserve's spares give way to shards (store::reserve): they are free room.
    let spares = store.reserve_status().held;
    let (mem_capacity, mem_free) = space(
        store.tier_root(DataTier::Memory),
        inv.memory_capacity,
        used[0],
        spares,
    );
    // A memory tier on tmpfs is RAM: no more is free than the host can still give it.
    let mem_free = store
        .host_room(DataTier::Memory)
        .map_or(mem_free, |room| mem_free.min(room.saturating_add(spares)));
    let (disk_capacity, disk_free) = space(
        store.tier_root(DataTier::Disk),
        inv.disk_capacity,
        used[1],
        0,
    );
    HostReport {
        host_id: view.host().to_string(),
        data_addr: addrs.data.clone(),
        agent_addr: addrs.agent.clone(),
        zone: inv.zone.clone(),
        rack: inv.rack.clone(),
        nic_bps: inv.nic_bps,
        mem_capacity,
        mem_free,
        disk_capacity,
        disk_free,
        // Detected GPUs (CUDA or simulated); the configured count only when none are.
        gpus: {
            let found = gpus.devices();
            if found.is_empty() {
                (0..inv.gpus)
                    .map(|i| Gpu {
                        index: i,
                        memory_bytes: inv.gpu_memory,
                        pcie_switch: String::new(),
                        nvlink_peers: Vec::new(),
                    })
                    .collect()
            } else {
                found
                    .into_iter()
                    .map(|d| Gpu {
                        index: d.index,
                        memory_bytes: d.memory_bytes,
                        pcie_switch: d.pcie_switch,
                        nvlink_peers: d.peers.iter().map(|p| p.0).collect(),
                    })
                    .collect()
            }
        },
        holdings: held,
        bound_names: store.names().into_iter().map(|(n, _)| n).collect(),
        version: env!("CARGO_PKG_VERSION").into(),
        started_at_ms: process_started_ms(),
        draining: view.draining(),
        // GPUs other processes mostly hold (an inference engine): not free for placement.
        gpus_busy: u32::try_from(gpus.busy_gpus().len()).unwrap_or(u32::MAX),
        gpu_loads: gpus
            .status()
            .into_iter()
            .map(|m| {
                let (state, error) = state_name(&m.state);
                GpuLoad {
                    digest: m.model,
                    state: state.into(),
                    gpus: m.gpus.iter().map(|g| g.0).collect(),
                    partition: m.partition.map(|p| p.label).unwrap_or_default(),
                    error,
                }
            })
            .collect(),
        gpu_evicted: {
            let mut evicted: Vec<String> = gpus.evictions().into_iter().map(|e| e.model).collect();
            evicted.sort();
            evicted.dedup();
            evicted
        },
    }
}
