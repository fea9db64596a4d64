//! The controller's operations, shared by the gRPC and HTTP front ends, the autoscaler
//! and the tier sweeper: registration, heartbeats, plan creation (placement + chain plans
//! from `shardcast-placement`), the plan runner that starts chains through the agents
//! port and watches them to the end, and eviction. They take and return the typed values
//! of `crate::ops`; `crate::wire` converts them to and from the API's protobuf.
//!
//! Owners and locks: the models and manifests are the registry's
//! (`crate::registry::Registry`, leaf locks); the hosts are the inventory's
//! (`crate::inventory::Inventory`); the plans, their watchers and the receiver index are
//! the plans' table (`table::State`). When more than one is needed they are locked in that order:
//! plans, then hosts, then the registry. Plan creation validates, places and records the
//! plan holding the plans' and the hosts' locks, so two concurrent prewarms of one model
//! see each other (the second joins the first's transfers) and GPU slots are booked once.
//! Calls to agents (`crate::agents::Agents`) never happen under a lock.
//!
//! The operations are split by concern, each an `impl Controller` of its own file:
//! `hosts` (heartbeats, the host list), `register` (origins, registrations, models),
//! `plans` (prewarm, scale-out, plan lookups), `evict`, and `runner` (the plan runner);
//! `table` holds the plans' table they share.
//! Host reports and plan progress are persisted through [`crate::write_behind`], off the
//! locks. Each operation fails with its own error type ([`crate::error`]).

pub(crate) use crate::clock::now_unix;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

// The tokio clock, not `std::time::Instant`: outside a paused runtime they are the same
// monotonic clock; on a paused one (the datacenter simulator drives the controller on
// virtual time) heartbeats age, stalls are timed and rounds are paced in virtual time.
use tokio::time::Instant;

use crate::events::Event;
use serde::Serialize;
use shardcast_placement::{
    self as placement, PlanError, PlanParams, Receiver, ReceiverKind, Source, Target, Tier,
};
use shardcast_protocol::codec::decode_exact;
use shardcast_protocol::origin_policy::{Enforcer, OriginLocation, OriginPolicy};
use shardcast_protocol::{HostId, Manifest, ModelName};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::agents::{AgentAt, Agents};
use crate::error::{
    AgentError, AgentFailure, ApiError, EvictError, HeartbeatError, HostUnavailable, LookupError,
    PlanRequestError, RegisterError,
};
use crate::events::EventLog;
use crate::inventory::{self, DataTier, HostEntry, HostTable, HostView, Inventory, StoredHost};
pub use crate::plan::ChainRun;
use crate::plan::{
    Accepted, ChainSummary, GpuState, Plan, PlanKind, ReceiverProgress, ReceiverState, Seen,
};
use crate::state::{StateStore, Table};
use crate::usage::Usage;

mod evict;
mod hosts;
mod plans;
mod register;
mod runner;
mod table;

pub use crate::model::{MODEL_RECORD_VERSION, ModelRecord};
pub use crate::ops::{
    EvictModel, Evicted, HeartbeatAnswer, Holder, HostListing, ModelEntry, Models, Prewarm,
    Register, Registered, RegistrationJob, ScaleOut, Sources, Whereabouts,
};
pub use register::parse_profile;
pub(crate) use table::State;
// The parts' free functions, for each other and for the tests below.
#[cfg(test)]
use hosts::*;
use plans::*;
#[cfg(test)]
use register::*;

/// What runs after a model is registered (with a profile), given its name.
pub type AfterRegister =
    Arc<dyn Fn(String) -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// Controller tuning.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Heartbeat period the hosts are told to keep.
    pub heartbeat: Duration,
    /// Heartbeats a host may miss before it is marked down.
    pub missed_heartbeats: u32,
    /// Placement and estimate parameters.
    pub plan: PlanParams,
    /// How often a running plan polls its receivers.
    pub poll: Duration,
    /// A receiver without progress this long is re-planned.
    pub stall_timeout: Duration,
    /// Re-plans of one receiver in a row without progress in between before it is marked
    /// failed (a receiver that moves bytes between re-plans starts a new count).
    pub max_replans: u32,
    /// How long a running plan waits for a receiver whose host stopped heartbeating (marked
    /// `lost`) to come back: a host that heartbeats again within it (a restarted transferd,
    /// a host cut off or stopped for a moment) is re-planned and resumes from its verified
    /// chunks; after it the plan ends without the host (`partial`).
    pub lost_grace: Duration,
    /// Host → GPU rate (bytes/s) used to class models light/medium/heavy from their
    /// profiles (Torpor §5.3). Default 25 GB/s (PCIe 4.0 x16 in practice).
    pub pcie_bps: f64,
    /// The controller's TLS identity for reaching agents over TCP (`None`: plaintext,
    /// insecure mode or agents on Unix sockets only).
    pub tls: Option<Arc<shardcast_identity::TlsContext>>,
    /// Signs each chain's plan token (model, hosts, expiry) with the controller's key
    /// (`None`: insecure mode, sessions carry no token).
    pub signer: Option<Arc<arc_swap::ArcSwap<shardcast_identity::plan::PlanSigner>>>,
    /// The host that reads the origin to build a registered model's manifest keeps the
    /// bytes (best effort, in its memory tier), so registering and prewarming read the
    /// origin once. Default true.
    pub register_keeps_copy: bool,
    /// How the hops of a plan's chains dial each other when the request does not say
    /// (`--transport`; TCP by default).
    pub transport: shardcast_protocol::HopTransport,
    /// Origin prefixes a model may be registered from (`--origin-allow`). The default is
    /// empty, which refuses every registration with a message saying how to allow one.
    pub origins: OriginPolicy,
    /// Refusal and HTTP-timeout counters (`/metrics`), shared by every `Controller` opened
    /// with this configuration (a replica's successive views and terms, `crate::ha`).
    pub api_stats: (
        Arc<shardcast_identity::grpc::AuthzStats>,
        Arc<shardcast_identity::http::HttpStats>,
    ),
    /// `/metrics`' registry and what it observes, shared the same way.
    pub metrics: Arc<crate::metrics::ControllerMetrics>,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        Self {
            heartbeat: Duration::from_secs(1),
            missed_heartbeats: 3,
            plan: PlanParams::default(),
            poll: Duration::from_millis(250),
            stall_timeout: Duration::from_secs(10),
            max_replans: 3,
            lost_grace: Duration::from_secs(20),
            pcie_bps: 25e9,
            tls: None,
            signer: None,
            origins: OriginPolicy::new(Vec::new(), Enforcer::Controller),
            api_stats: Default::default(),
            metrics: Default::default(),
            register_keeps_copy: true,
            transport: shardcast_protocol::HopTransport::Tcp,
        }
    }
}

impl ControllerConfig {
    /// Silence after which a host is down.
    pub fn host_timeout(&self) -> Duration {
        self.heartbeat * self.missed_heartbeats.max(1)
    }
}

/// When each host of a plan last made progress (data-plane plus GPU bytes), to find the
/// ones stalled for longer than `stall_timeout`.
#[derive(Default)]
pub(crate) struct StallClock(HashMap<String, (u64, Instant)>);

impl StallClock {
    /// Notes that `host` has moved `moved` bytes by `now`; true when it has not moved more
    /// for `timeout`.
    pub(crate) fn stalled(
        &mut self,
        host: &str,
        moved: u64,
        now: Instant,
        timeout: Duration,
    ) -> bool {
        let seen = self.0.entry(host.to_string()).or_insert((moved, now));
        if moved > seen.0 {
            *seen = (moved, now);
        }
        now.saturating_duration_since(seen.1) >= timeout
    }

    /// Starts `host`'s clock again (it was given new work).
    pub(crate) fn restart(&mut self, host: &str) {
        self.0.insert(host.to_string(), (0, Instant::now()));
    }
}

fn plan_error(e: PlanError) -> PlanRequestError {
    match e {
        PlanError::NoLiveHost => HostUnavailable::NoLiveHost.into(),
        PlanError::UnknownHost(h) => HostUnavailable::Unknown(h).into(),
        PlanError::HostDown(h) => HostUnavailable::Down(h).into(),
        e @ PlanError::NotEnoughCapacity { .. } => PlanRequestError::Capacity(e.to_string()),
        PlanError::InvalidRequest(m) => PlanRequestError::Invalid(m),
    }
}

pub(crate) use crate::lock;

/// The controller.
pub struct Controller {
    cfg: ControllerConfig,
    store: Arc<dyn StateStore>,
    pub(crate) state: Mutex<State>,
    /// The hosts' agents (`crate::agents`).
    agents: Arc<dyn Agents>,
    /// Host reports and plan progress, committed in batches off the state lock.
    writes: Arc<crate::write_behind::WriteBehind>,
    cancel: CancellationToken,
    /// Decisions and plan events (`ListEvents`), shared with the services.
    events: Arc<EventLog>,
    /// Last uses of each model, shared with the tier sweeper.
    usage: Arc<Usage>,
    /// Run after a model is registered, before its registration ends (the partition-plan
    /// service precomputes the model's tables), set once by `crate::services`.
    after_register: std::sync::OnceLock<AfterRegister>,
    authz: Arc<shardcast_identity::grpc::AuthzStats>,
    http: Arc<shardcast_identity::http::HttpStats>,
    origin_refused: std::sync::atomic::AtomicU64,
    /// The models, their manifests and the registrations in progress (`crate::registry`).
    registry: crate::registry::Registry,
    /// The hosts (`crate::inventory::Inventory`); locked after `state` when both are.
    pub(crate) inventory: Inventory,
}

impl Controller {
    /// Loads the state and resumes watching plans in flight.
    pub fn open(
        cfg: ControllerConfig,
        store: Arc<dyn StateStore>,
        cancel: CancellationToken,
    ) -> Result<Arc<Self>, ApiError> {
        let agents = Arc::new(crate::agents::grpc::GrpcAgents::new(cfg.tls.clone()));
        Self::open_with(cfg, store, cancel, agents)
    }

    /// [`Self::open`], reaching the hosts through `agents` (a simulated datacenter's, or
    /// the gRPC agents).
    pub fn open_with(
        cfg: ControllerConfig,
        store: Arc<dyn StateStore>,
        cancel: CancellationToken,
        agents: Arc<dyn Agents>,
    ) -> Result<Arc<Self>, ApiError> {
        let (me, resume) = Self::load(cfg, store, cancel, agents)?;
        for (id, burst) in resume {
            info!(plan = %id, "resuming a plan in flight");
            if burst {
                tokio::spawn(me.clone().run_burst(id));
            } else {
                tokio::spawn(me.clone().run_plan(id));
            }
        }
        tokio::spawn(me.clone().expiry_loop());
        Ok(me)
    }

    /// Loads the state for reads only (a follower replica's view, `crate::ha`): no plan
    /// runner or expiry loop runs; its writes are refused by the store.
    pub fn open_read_only(
        cfg: ControllerConfig,
        store: Arc<dyn StateStore>,
        cancel: CancellationToken,
    ) -> Result<Arc<Self>, ApiError> {
        let agents = Arc::new(crate::agents::grpc::GrpcAgents::new(cfg.tls.clone()));
        Ok(Self::load(cfg, store, cancel, agents)?.0)
    }

    /// The stored state, and the plans in flight (id, is a burst).
    #[allow(clippy::type_complexity)]
    fn load(
        cfg: ControllerConfig,
        store: Arc<dyn StateStore>,
        cancel: CancellationToken,
        agents: Arc<dyn Agents>,
    ) -> Result<(Arc<Self>, Vec<(String, bool)>), ApiError> {
        let mut st = State::default();
        let started = Instant::now();
        let registry = crate::registry::Registry::restore(store.as_ref())?;
        let inventory = Inventory::default();
        {
            let mut inv = inventory.lock();
            for (id, bytes) in store.list(Table::Hosts)? {
                match crate::wire::read_host_record(&bytes) {
                    Ok(r) => {
                        inv.persisted
                            .insert(id.clone(), HostEntry::signature(&r.host));
                        inv.hosts.insert(id, HostEntry::restored(r, started));
                    }
                    Err(e) => warn!(host = %id, "skipping unreadable host record: {e}"),
                }
            }
        }
        let mut resume = Vec::new();
        for (id, bytes) in store.list(Table::Plans)? {
            match crate::wire::read_plan_record(&bytes) {
                Ok(p) => {
                    if p.running() {
                        resume.push((id.clone(), p.kind == PlanKind::Burst));
                        st.watchers
                            .insert(id.clone(), watch::Sender::new(p.clone()));
                    }
                    st.insert_plan(id, p);
                }
                Err(e) => warn!(plan = %id, "skipping unreadable plan record: {e}"),
            }
        }
        let usage = Arc::new(Usage::restore(store.as_ref())?);
        let (authz, http) = cfg.api_stats.clone();
        let writes = crate::write_behind::WriteBehind::new(store.clone());
        tokio::spawn(writes.clone().run(cancel.clone()));
        let me = Arc::new(Self {
            cfg,
            store,
            state: Mutex::new(st),
            agents,
            writes,
            cancel,
            events: Arc::default(),
            usage,
            after_register: std::sync::OnceLock::new(),
            authz,
            http,
            origin_refused: std::sync::atomic::AtomicU64::new(0),
            registry,
            inventory,
        });
        Ok((me, resume))
    }

    /// The configuration.
    pub fn config(&self) -> &ControllerConfig {
        &self.cfg
    }

    async fn expiry_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.cfg.heartbeat);
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let mut inv = self.inventory.lock();
            for id in inventory::expire(&mut inv.hosts, Instant::now(), self.cfg.host_timeout()) {
                if inv.hosts.get(&id).is_some_and(|h| h.up) {
                    info!(host = %id, "host is back");
                } else {
                    warn!(host = %id, timeout = ?self.cfg.host_timeout(), "host missed its heartbeats: marked down");
                }
            }
        }
    }

    /// Refusals of API calls by role (both front ends), for `/metrics`.
    pub fn authz_stats(&self) -> Arc<shardcast_identity::grpc::AuthzStats> {
        self.authz.clone()
    }

    /// HTTP connections closed for stalling, for `/metrics`.
    pub fn http_stats(&self) -> Arc<shardcast_identity::http::HttpStats> {
        self.http.clone()
    }

    /// Where `host`'s agent is, from its last heartbeat.
    pub fn agent_at(&self, host: &str) -> Result<AgentAt, AgentError> {
        let h = self.inventory.get(host).ok_or_else(|| {
            AgentError::unreachable(host, "the host is not known to the controller")
        })?;
        Ok(AgentAt {
            host: host.to_string(),
            addr: h.report.agent_addr.clone(),
        })
    }

    /// The hosts' agents.
    pub fn agents(&self) -> &Arc<dyn Agents> {
        &self.agents
    }

    /// The state store, shared.
    pub(crate) fn store_handle(&self) -> Arc<dyn StateStore> {
        self.store.clone()
    }

    /// When each model was last used (for the tier sweeper's LRU).
    pub fn usage(&self) -> &Arc<Usage> {
        &self.usage
    }

    /// The model registry.
    pub fn registry(&self) -> &crate::registry::Registry {
        &self.registry
    }

    /// Decisions and plan events.
    pub fn events(&self) -> &Arc<EventLog> {
        &self.events
    }

    /// Sets what runs after each registration (once; later calls are ignored).
    pub fn after_register(&self, hook: AfterRegister) {
        let _ = self.after_register.set(hook);
    }

    /// Cancelled when the controller shuts down.
    pub fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }
}

/// Milliseconds since the Unix epoch (0 if the clock is before it): the stamp of the
/// controller's statements about names (plan tokens, heartbeat answers).
fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Seconds since the Unix epoch (0 if the clock is before it).
fn unix_now() -> u64 {
    unix_now_ms() / 1000
}

#[cfg(test)]
mod receiver_index_tests {
    use super::*;

    #[test]
    fn a_pinned_origin_is_taken_only_when_it_pins_the_registered_one() {
        let sha = "0123456789abcdef0123456789abcdef01234567";
        let pinned = format!("hf://acme/tiny@{sha}");
        assert_eq!(
            pinned_origin("hf://acme/tiny@main", &pinned).as_deref(),
            Some(pinned.as_str())
        );
        assert_eq!(pinned_origin("hf://acme/other", &pinned), None);
        assert_eq!(pinned_origin("hf://acme/tiny", "hf://acme/tiny@main"), None);
        assert_eq!(pinned_origin("not a uri", &pinned), None);
        assert_eq!(pinned_origin("hf://acme/tiny", "not a uri"), None);
    }

    use crate::plan::{PlanKind, ReceiverProgress, ReceiverState};

    fn plan(id: &str, digest: &str, hosts: &[(&str, ReceiverState)]) -> Plan {
        let hosts = hosts
            .iter()
            .map(|(h, state)| {
                let mut r = ReceiverProgress::new(*h, *state);
                r.total = 10;
                r
            })
            .collect();
        Plan {
            estimate_s: 1.0,
            ..Plan::started(
                id,
                ("m", digest),
                Tier::Memory,
                PlanKind::Chains,
                hosts,
                "",
                10.0,
            )
        }
    }

    fn holding(host: &str, digest: &str) -> HostEntry {
        HostEntry {
            report: HostView {
                host_id: host.into(),
                holdings: vec![inventory::Holding {
                    digest: digest.into(),
                    name: String::new(),
                    tier: DataTier::Memory,
                    complete: true,
                    bytes_verified: 10,
                    total_bytes: 10,
                }],
                ..Default::default()
            },
            last_seen: Instant::now(),
            up: true,
            gpu_reserved: BTreeMap::new(),
            booked_at: HashMap::new(),
            pending_evictions: Vec::new(),
        }
    }

    #[test]
    fn a_heartbeat_reconciles_only_the_plans_its_host_receives_in() {
        let mut st = State::default();
        st.add_plan(plan(
            "a",
            "d1",
            &[("h1", ReceiverState::Lost), ("h2", ReceiverState::Done)],
        ));
        // Another plan of the same model where h1 is not a receiver: untouched.
        st.add_plan(plan("b", "d1", &[("h2", ReceiverState::Lost)]));
        // Many plans h1 is not part of (restored ones are indexed too).
        for i in 0..1000 {
            st.insert_plan(
                format!("x{i}"),
                plan(&format!("x{i}"), "d1", &[("h9", ReceiverState::Lost)]),
            );
        }
        let h1 = holding("h1", "d1");
        assert_eq!(st.receiver_plans["h1"], vec!["a".to_string()]);
        assert_eq!(st.receiver_plans["h9"].len(), 1000);
        let events = reconcile_receivers(&mut st, &h1);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].plan_id, "a");
        assert_eq!(st.plans["a"].hosts[0].state, ReceiverState::Done);
        assert_eq!(st.plans["b"].hosts[0].state, ReceiverState::Lost);
        assert!(
            st.plans
                .values()
                .filter(|p| p.id.starts_with('x'))
                .all(|p| p.hosts[0].state == ReceiverState::Lost)
        );
        // Nothing left to recover: a second heartbeat changes nothing.
        assert!(reconcile_receivers(&mut st, &h1).is_empty());
        // A host in no plan.
        assert!(reconcile_receivers(&mut st, &holding("h3", "d1")).is_empty());
    }

    #[test]
    fn the_index_does_not_list_a_plan_twice() {
        let mut st = State::default();
        st.add_plan(plan("a", "d1", &[("h1", ReceiverState::Pending)]));
        st.insert_plan(
            "a".into(),
            plan("a", "d1", &[("h1", ReceiverState::Pending)]),
        );
        assert_eq!(st.receiver_plans["h1"], vec!["a".to_string()]);
    }
}
