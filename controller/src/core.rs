//! The controller's operations, shared by the gRPC and HTTP front ends: the registry, the
//! inventory, plan creation (placement + chain plans from `shardcast-placement`), and the
//! plan runner that starts chains on transferd agents and watches them to the end.
//!
//! Locking: one mutex guards the in-memory state. Plan creation validates, places and
//! records the plan under that lock, so two concurrent prewarms of one model see each
//! other (the second joins the first's transfers instead of starting new ones). Calls to
//! agents never happen under the lock.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use shardcast_placement::{
    self as placement, PlanError, PlanParams, Receiver, ReceiverKind, Source, Target, Tier,
};
use shardcast_protocol::agent::agent_client::AgentClient;
use shardcast_protocol::agent::{self as apb, GetModelStatusRequest, ImportModelRequest};
use shardcast_protocol::codec::decode_exact;
use shardcast_protocol::controller::{
    Event, EvictRequest, EvictResponse, HeartbeatResponse, HostHolding, HostState,
    ListHostsResponse, ListModelsResponse, ModelInfo, ModelStatus, NameBinding, PrewarmRequest,
    RegisterModelRequest, ScaleOutRequest, ShardInfo,
};
use shardcast_protocol::origin_policy::{Enforcer, OriginLocation, OriginPolicy};
use shardcast_protocol::{HostId, Manifest, ModelName};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tracing::{info, warn};

use crate::error::{
    AgentError, AgentFailure, ApiError, EvictError, HeartbeatError, HostUnavailable, LookupError,
    PlanRequestError, RegisterError,
};
use crate::events::EventLog;
use crate::inventory::{self, DataTier, HostEntry, HostView, Pending, StoredHost};
pub use crate::plan::ChainRun;
use crate::plan::{
    Accepted, ChainSummary, GpuState, Plan, PlanKind, ReceiverProgress, ReceiverState, Seen,
    StoredPlan,
};
use crate::state::{StateStore, Table};
use crate::usage::Usage;

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

/// The version of [`ModelRecord`]s written now.
pub const MODEL_RECORD_VERSION: &str = "1";

fn model_record_version() -> String {
    MODEL_RECORD_VERSION.to_string()
}

/// A registered model, as persisted (table `models`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelRecord {
    /// [`MODEL_RECORD_VERSION`]; records written before versions have none and read as
    /// version 1 (the same shape).
    #[serde(default = "model_record_version")]
    pub version: String,
    /// Name.
    pub name: String,
    /// Hex manifest digest.
    pub digest: String,
    /// Origin URI.
    pub origin: String,
    /// Chunk size.
    pub chunk_size: u32,
    /// Total bytes.
    pub total_bytes: u64,
    /// Shards: (path, size, chunks).
    pub shards: Vec<(String, u64, u32)>,
    /// Seconds since the epoch.
    pub registered_at: f64,
    /// Registered profile (JSON of `shardcast_policies::profile::ModelProfile`).
    #[serde(default)]
    pub profile: Option<String>,
    /// The origin pinned to the version that was registered, where `origin` names a
    /// movable one (`hf://org/name@<commit>` for a Hub branch): what plans, bursts and
    /// recovery read from. Empty: `origin` itself.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub read_origin: String,
}

impl ModelRecord {
    /// The origin hosts read this version from: [`Self::read_origin`], else `origin`.
    pub fn reads_from(&self) -> &str {
        if self.read_origin.is_empty() {
            &self.origin
        } else {
            &self.read_origin
        }
    }

    /// Reads a stored record; a version this controller does not know is an error naming
    /// it, not a guess.
    pub fn read(bytes: &[u8]) -> Result<Self, String> {
        let m: Self = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if m.version != MODEL_RECORD_VERSION {
            return Err(format!(
                "model record version {:?} is not known to this controller (it reads {MODEL_RECORD_VERSION:?})",
                m.version
            ));
        }
        Ok(m)
    }

    fn info(&self, manifest: Option<&[u8]>) -> ModelInfo {
        ModelInfo {
            name: self.name.clone(),
            digest: self.digest.clone(),
            origin: self.origin.clone(),
            total_bytes: self.total_bytes,
            chunk_size: self.chunk_size,
            shards: self
                .shards
                .iter()
                .map(|(path, size, chunks)| ShardInfo {
                    path: path.clone(),
                    size: *size,
                    chunks: *chunks,
                })
                .collect(),
            manifest: manifest.map(<[u8]>::to_vec).unwrap_or_default(),
            registered_at: self.registered_at,
        }
    }

    fn spec(&self) -> placement::ModelSpec {
        placement::ModelSpec {
            key: self.digest.clone(),
            shard_bytes: self.shards.iter().map(|s| s.1).collect(),
            chunk_size: u64::from(self.chunk_size),
        }
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

pub(crate) fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

pub(crate) fn data_tier(tier: Tier) -> DataTier {
    match tier {
        Tier::Disk => DataTier::Disk,
        Tier::Memory | Tier::Gpu => DataTier::Memory,
    }
}

fn agent_tier(tier: Tier) -> i32 {
    match tier {
        Tier::Disk => apb::Tier::Disk as i32,
        Tier::Memory | Tier::Gpu => apb::Tier::Memory as i32,
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

#[derive(Default)]
pub(crate) struct State {
    /// By name (latest version).
    pub(crate) models: BTreeMap<String, ModelRecord>,
    pub(crate) manifests: HashMap<String, Arc<Vec<u8>>>,
    pub(crate) hosts: BTreeMap<String, HostEntry>,
    /// Signature of each host's last persisted report.
    persisted: HashMap<String, String>,
    pub(crate) plans: HashMap<String, Plan>,
    pub(crate) watchers: HashMap<String, watch::Sender<Plan>>,
    /// Host → the plans (running or ended) it is a receiver of, so a heartbeat looks only
    /// at its own plans ([`reconcile_receivers`]) instead of every plan ever made: with
    /// 1000 hosts heartbeating each second and plans kept after they end, the scan was
    /// O(plans × receivers) per heartbeat. A plan's receivers are fixed when it is made
    /// (re-plans change sources, not receivers).
    pub(crate) receiver_plans: HashMap<String, Vec<String>>,
}

impl State {
    /// Adds a plan and the channel its watchers subscribe to.
    pub(crate) fn add_plan(&mut self, plan: Plan) {
        let id = plan.id.clone();
        self.watchers
            .insert(id.clone(), watch::Sender::new(plan.clone()));
        self.insert_plan(id, plan);
    }

    /// Adds a plan (without a watch channel) and indexes its receivers.
    pub(crate) fn insert_plan(&mut self, id: String, plan: Plan) {
        for h in &plan.hosts {
            let plans = self.receiver_plans.entry(h.host.clone()).or_default();
            if !plans.contains(&id) {
                plans.push(id.clone());
            }
        }
        self.plans.insert(id, plan);
    }

    pub(crate) fn model(&self, key: &str) -> Result<&ModelRecord, LookupError> {
        if key.is_empty() {
            return Err(LookupError::NoKey);
        }
        self.models
            .get(key)
            .or_else(|| self.models.values().find(|m| m.digest == key))
            .ok_or_else(|| LookupError::UnknownModel(key.to_string()))
    }

    /// Bytes still to arrive on each host from plans in flight.
    fn pending(&self) -> Pending {
        let mut p = Pending::new();
        for plan in self.plans.values().filter(|p| p.running()) {
            let tier = data_tier(plan.tier);
            for h in &plan.hosts {
                if h.state.awaits_data() {
                    *p.entry((h.host.clone(), tier)).or_default() +=
                        h.total.saturating_sub(h.bytes);
                }
            }
        }
        p
    }

    /// Hosts receiving `digest` into `tier`'s data tier in plans in flight, with the plan.
    pub(crate) fn in_flight(&self, digest: &str, tier: Tier) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for plan in self.plans.values() {
            if !plan.running() || plan.digest != digest || data_tier(plan.tier) != data_tier(tier) {
                continue;
            }
            for h in &plan.hosts {
                if h.state.awaits_data() {
                    out.insert(h.host.clone(), plan.id.clone());
                }
            }
        }
        out
    }
}

/// The controller.
pub struct Controller {
    cfg: ControllerConfig,
    store: Arc<dyn StateStore>,
    pub(crate) state: Mutex<State>,
    agents: Mutex<HashMap<String, (String, AgentClient<Channel>)>>,
    /// Host reports and plan progress, committed in batches off the state lock.
    writes: Arc<crate::write_behind::WriteBehind>,
    /// Agents that answered at least once, and the gate for first contacts: a plan's
    /// first round opens a mutually authenticated connection to every receiver, and 1000
    /// handshakes at once starved heartbeats and API calls of CPU for over a second.
    reached: Mutex<HashSet<String>>,
    first_contact: tokio::sync::Semaphore,
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
    /// Registrations in progress, by model name.
    registrations: Mutex<HashMap<String, Registration>>,
}

/// A registration in progress: who reads the origin, and its outcome once it ends.
struct Registration {
    info: shardcast_protocol::controller::Registration,
    outcome: watch::Receiver<Option<Result<ModelInfo, RegisterError>>>,
}

impl Controller {
    /// Loads the state and resumes watching plans in flight.
    pub fn open(
        cfg: ControllerConfig,
        store: Arc<dyn StateStore>,
        cancel: CancellationToken,
    ) -> Result<Arc<Self>, ApiError> {
        let (me, resume) = Self::load(cfg, store, cancel)?;
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
        Ok(Self::load(cfg, store, cancel)?.0)
    }

    /// The stored state, and the plans in flight (id, is a burst).
    #[allow(clippy::type_complexity)]
    fn load(
        cfg: ControllerConfig,
        store: Arc<dyn StateStore>,
        cancel: CancellationToken,
    ) -> Result<(Arc<Self>, Vec<(String, bool)>), ApiError> {
        let mut st = State::default();
        let started = Instant::now();
        for (name, bytes) in store.list(Table::Models)? {
            match ModelRecord::read(&bytes) {
                Ok(m) => {
                    st.models.insert(name, m);
                }
                Err(e) => warn!(model = %name, "skipping unreadable model record: {e}"),
            }
        }
        for (digest, bytes) in store.list(Table::Manifests)? {
            st.manifests.insert(digest, Arc::new(bytes));
        }
        for (id, bytes) in store.list(Table::Hosts)? {
            match StoredHost::read(&bytes) {
                Ok(r) => {
                    st.persisted
                        .insert(id.clone(), HostEntry::signature(&r.host));
                    st.hosts.insert(id, HostEntry::restored(r, started));
                }
                Err(e) => warn!(host = %id, "skipping unreadable host record: {e}"),
            }
        }
        let mut resume = Vec::new();
        for (id, bytes) in store.list(Table::Plans)? {
            match StoredPlan::decode(&bytes) {
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
            agents: Mutex::default(),
            writes,
            reached: Mutex::default(),
            first_contact: tokio::sync::Semaphore::new(FIRST_CONTACTS),
            cancel,
            events: Arc::default(),
            usage,
            after_register: std::sync::OnceLock::new(),
            authz,
            http,
            origin_refused: std::sync::atomic::AtomicU64::new(0),
            registrations: Mutex::default(),
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
            let mut st = lock(&self.state);
            for id in inventory::expire(&mut st.hosts, Instant::now(), self.cfg.host_timeout()) {
                if st.hosts.get(&id).is_some_and(|h| h.up) {
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

    fn agent(&self, host: &str) -> Result<AgentClient<Channel>, AgentError> {
        let addr = {
            let st = lock(&self.state);
            let h = st.hosts.get(host).ok_or_else(|| {
                AgentError::unreachable(host, "the host is not known to the controller")
            })?;
            h.report.agent_addr.clone()
        };
        let mut agents = lock(&self.agents);
        if let Some((a, c)) = agents.get(host)
            && *a == addr
        {
            return Ok(c.clone());
        }
        // Over TCP the agent must prove it is exactly this host (a heartbeat cannot point
        // the controller at another host's agent); Unix sockets are local.
        let security = match &self.cfg.tls {
            Some(ctx) if !addr.starts_with("unix:") => {
                let id = shardcast_identity::Identity::new(shardcast_identity::Role::Host, host)
                    .map_err(|e| AgentError::unreachable(host, e))?;
                shardcast_identity::grpc::ClientSecurity::Tls(
                    ctx.clone(),
                    shardcast_identity::Expect::Exactly(id),
                )
            }
            _ => shardcast_identity::grpc::ClientSecurity::Plaintext,
        };
        let channel = shardcast_identity::grpc::lazy(&addr, security)
            .map_err(|e| AgentError::unreachable(host, e))?;
        let client = AgentClient::new(channel)
            .max_decoding_message_size(128 << 20)
            .max_encoding_message_size(128 << 20);
        agents.insert(host.to_string(), (addr, client.clone()));
        Ok(client)
    }

    /// The state store, shared.
    pub(crate) fn store_handle(&self) -> Arc<dyn StateStore> {
        self.store.clone()
    }

    /// When each model was last used (for the tier sweeper's LRU).
    pub fn usage(&self) -> &Arc<Usage> {
        &self.usage
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

    /// An agent client for `host`.
    pub fn agent_client(&self, host: &str) -> Result<AgentClient<Channel>, AgentError> {
        self.agent(host)
    }

    // ---- inventory ----

    /// A heartbeat (the first one registers the host). The answer carries the registry's
    /// current version of every model name the report mentions: hosts resolve names only
    /// through it.
    pub fn heartbeat(&self, report: HostView) -> Result<HeartbeatResponse, HeartbeatError> {
        HostId::new(&report.host_id).map_err(|e| HeartbeatError::BadHostId(e.to_string()))?;
        if report.data_addr.is_empty() || report.agent_addr.is_empty() {
            return Err(HeartbeatError::NoAddress);
        }
        let sig = HostEntry::signature(&report);
        let asked: BTreeSet<String> = report
            .holdings
            .iter()
            .map(|h| h.name.clone())
            .chain(report.bound_names.iter().cloned())
            .collect();
        let id = report.host_id.clone();
        let mut st = lock(&self.state);
        let entry = st.hosts.entry(id.clone()).or_insert_with(|| {
            info!(host = %id, data = %report.data_addr, rack = %report.rack, "host registered");
            HostEntry {
                report: report.clone(),
                last_seen: Instant::now(),
                up: true,
                gpu_reserved: BTreeMap::new(),
                booked_at: HashMap::new(),
                pending_evictions: Vec::new(),
            }
        });
        if !entry.up {
            info!(host = %id, "host is back");
        }
        // A new transferd process: what it was receiving has no session there any more.
        let (was, now_started) = (entry.report.started_at_ms, report.started_at_ms);
        let restarted = was != 0 && now_started != 0 && was != now_started;
        if restarted {
            info!(host = %id, "host's transferd restarted");
        }
        entry.report = report;
        entry.last_seen = Instant::now();
        entry.up = true;
        let record = StoredHost::of(entry);
        if st.persisted.get(&id) != Some(&sig) {
            let bytes =
                serde_json::to_vec(&record).map_err(|e| HeartbeatError::Store(e.to_string()))?;
            if st.persisted.contains_key(&id) {
                // A change of a known host: queued, not committed under the lock (see
                // `write_behind`).
                self.writes.put(Table::Hosts, &id, bytes);
            } else {
                // A host the state has never held: committed before it is answered, so a
                // controller that takes over (or restarts) right after still knows it.
                self.writes
                    .put_now(Table::Hosts, &id, &bytes)
                    .map_err(|e| HeartbeatError::Store(e.to_string()))?;
            }
            st.persisted.insert(id.clone(), sig);
        }
        let mut events = reconcile_receivers(&mut st, &id);
        if restarted {
            events.extend(restarted_receivers(&mut st, &id, self.cfg.lost_grace));
        }
        for e in events {
            if let Some(plan) = st.plans.get(&e.plan_id) {
                info!(plan = %e.plan_id, host = %id, state = %plan.state, "{}", e.reason);
                if let Some(w) = st.watchers.get(&e.plan_id) {
                    w.send_replace(plan.clone());
                }
                if let Err(err) = self.persist_plan(plan) {
                    warn!(plan = %e.plan_id, "persisting plan: {err}");
                }
            }
            self.events.record(e);
        }
        let names = asked
            .into_iter()
            .filter_map(|n| st.models.get(&n))
            .map(|m| NameBinding {
                name: m.name.clone(),
                digest: m.digest.clone(),
            })
            .collect();
        let gpu_copies_elsewhere = inventory::gpu_copies_elsewhere(&st.hosts, &id);
        Ok(HeartbeatResponse {
            interval_ms: self.cfg.heartbeat.as_millis() as u32,
            names,
            gpu_copies_elsewhere,
            issued_at_ms: unix_now_ms(),
        })
    }

    /// Every known host.
    pub fn list_hosts(&self) -> ListHostsResponse {
        let st = lock(&self.state);
        let now = Instant::now();
        ListHostsResponse {
            hosts: st
                .hosts
                .values()
                .map(|h| HostState {
                    report: Some(crate::wire::host_report(&h.report)),
                    up: h.up,
                    last_seen_s: now.saturating_duration_since(h.last_seen).as_secs_f64(),
                    gpus_reserved: h.reserved_gpus(),
                })
                .collect(),
        }
    }

    // ---- registry ----

    /// Checks an origin against the allow-list: a malformed URI is `INVALID_ARGUMENT`, one
    /// outside the list `PERMISSION_DENIED` (counted and logged with the origin).
    pub fn check_origin(&self, origin: &str) -> Result<(), RegisterError> {
        use shardcast_protocol::origin_policy::PolicyError;
        match self.cfg.origins.check(origin) {
            Ok(_) => Ok(()),
            Err(e @ (PolicyError::Invalid { .. } | PolicyError::UnsupportedScheme { .. })) => {
                Err(RegisterError::OriginInvalid(e.to_string()))
            }
            Err(e) => {
                self.origin_refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                warn!(%origin, "origin refused by policy: {e}");
                Err(RegisterError::OriginRefused(e.to_string()))
            }
        }
    }

    /// Registrations refused by the origin allow-list so far.
    pub fn origin_refusals(&self) -> u64 {
        self.origin_refused
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Registers a model by reading its origin through a live transferd.
    /// `RegisterModel`: checks the request, then registers as a job of its own (a caller
    /// that goes away does not stop it; the same name and origin again joins it) and waits
    /// for it unless `no_wait`.
    pub async fn register_model(
        self: &Arc<Self>,
        req: RegisterModelRequest,
    ) -> Result<ModelInfo, RegisterError> {
        let name = ModelName::new(&req.name).map_err(|e| RegisterError::BadName {
            name: req.name.clone(),
            why: e.to_string(),
        })?;
        let origin = req.origin.trim().to_string();
        let no_wait = req.no_wait;
        let mut outcome = {
            let mut regs = lock(&self.registrations);
            match regs.get(name.as_str()) {
                Some(r) if r.info.origin == origin => r.outcome.clone(),
                Some(r) => {
                    return Err(RegisterError::InProgress {
                        name: name.to_string(),
                        origin: r.info.origin.clone(),
                        via: r.info.via_host.clone(),
                    });
                }
                None => {
                    // Checked here so a bad request is answered at once, not by the job.
                    let profile = if req.profile_json.trim().is_empty() {
                        None
                    } else {
                        parse_profile(&req.profile_json).map_err(RegisterError::BadProfile)?;
                        Some(req.profile_json.clone())
                    };
                    self.check_origin(&origin)?;
                    let via = self.registration_host(&req.via_host)?;
                    let (tx, rx) = watch::channel(None);
                    regs.insert(
                        name.to_string(),
                        Registration {
                            info: shardcast_protocol::controller::Registration {
                                name: name.to_string(),
                                origin: origin.clone(),
                                via_host: via.clone(),
                                started_at: now_unix(),
                            },
                            outcome: rx.clone(),
                        },
                    );
                    let me = self.clone();
                    let (job_name, job_model) = (name.to_string(), name.clone());
                    let (job_origin, chunk_size) = (origin.clone(), req.chunk_size);
                    tokio::spawn(async move {
                        let r = me
                            .register_now(job_model, job_origin, profile, chunk_size, via)
                            .await;
                        if let Err(e) = &r {
                            warn!(model = %job_name, "registration failed: {e}");
                        }
                        lock(&me.registrations).remove(&job_name);
                        tx.send_replace(Some(r));
                    });
                    rx
                }
            }
        };
        if no_wait {
            return Ok(ModelInfo {
                name: name.to_string(),
                origin,
                ..Default::default()
            });
        }
        let r = outcome
            .wait_for(Option::is_some)
            .await
            .map_err(|_| RegisterError::Lost)?
            .clone();
        r.unwrap_or(Err(RegisterError::Lost))
    }

    /// The host that reads the origin: `wanted` if given (it must be up), else any live
    /// host.
    fn registration_host(&self, wanted: &str) -> Result<String, HostUnavailable> {
        let st = lock(&self.state);
        if wanted.is_empty() {
            return st
                .hosts
                .values()
                .find(|h| h.up)
                .map(|h| h.report.host_id.clone())
                .ok_or(HostUnavailable::NoLiveHost);
        }
        match st.hosts.get(wanted) {
            None => Err(HostUnavailable::Unknown(wanted.to_string())),
            Some(h) if !h.up => Err(HostUnavailable::Down(wanted.to_string())),
            Some(h) => Ok(h.report.host_id.clone()),
        }
    }

    /// The registration itself: `via` builds the manifest (and keeps the copy), then the
    /// model is recorded.
    async fn register_now(
        &self,
        name: ModelName,
        origin: String,
        profile_json: Option<String>,
        chunk_size: u32,
        via: String,
    ) -> Result<ModelInfo, RegisterError> {
        info!(model = %name, %origin, via = %via, "registering: building the manifest");
        let read_error = |agent| RegisterError::OriginRead {
            origin: origin.clone(),
            agent,
        };
        let mut agent = self.agent(&via).map_err(read_error)?;
        let resp = agent
            .import_model(ImportModelRequest {
                name: name.to_string(),
                origin: origin.clone(),
                chunk_size,
                tier: apb::Tier::Memory as i32,
                fetch: false,
                manifest: Vec::new(),
                bind_name: None,
                // The host keeps what it reads to build the manifest, so a prewarm that
                // follows is served from it: the origin is read once, not twice.
                keep: self.cfg.register_keeps_copy,
            })
            .await
            .map_err(|s| read_error(AgentError::from_status(&via, &s)))?
            .into_inner();
        let bad = |why: String| RegisterError::BadManifest {
            via: via.clone(),
            why,
        };
        let manifest: Manifest =
            decode_exact(resp.manifest.clone().into()).map_err(|e| bad(e.to_string()))?;
        let digest = manifest.digest().to_hex();
        if digest != resp.digest {
            return Err(bad(format!(
                "its digest is {digest} but it said {}",
                resp.digest
            )));
        }
        let mut record = ModelRecord {
            version: model_record_version(),
            name: name.to_string(),
            digest: digest.clone(),
            origin,
            chunk_size: manifest.chunk_size,
            total_bytes: manifest.total_bytes(),
            shards: manifest
                .shards
                .iter()
                .map(|s| (s.path.to_string(), s.size, s.chunks.len() as u32))
                .collect(),
            registered_at: now_unix(),
            profile: profile_json,
            read_origin: String::new(),
        };
        if !resp.resolved_origin.is_empty() {
            match pinned_origin(&record.origin, &resp.resolved_origin) {
                Some(pinned) if self.cfg.origins.check(&pinned).is_ok() => {
                    info!(model = %name, origin = %record.origin, reads_from = %pinned, "origin pinned to the version registered");
                    record.read_origin = pinned;
                }
                _ => {
                    warn!(model = %name, origin = %record.origin, resolved = %resp.resolved_origin, via = %via, "ignoring a resolved origin that is not the same repository at a commit, or is outside the allow-list");
                }
            }
        }
        let with_profile = record.profile.is_some();
        let info = {
            let mut st = lock(&self.state);
            if let Some(old) = st.models.get(name.as_str())
                && old.digest == digest
                && old.origin == record.origin
                && old.read_origin == record.read_origin
                && old.profile == record.profile
            {
                return Ok(old.info(Some(&resp.manifest)));
            }
            let stored = |e: &dyn std::fmt::Display| RegisterError::Store(e.to_string());
            self.store
                .put(Table::Manifests, &digest, &resp.manifest)
                .map_err(|e| stored(&e))?;
            self.put_json(Table::Models, name.as_str(), &record)
                .map_err(|e| stored(&e))?;
            info!(model = %name, %digest, bytes = record.total_bytes, shards = record.shards.len(), kept_on = %if resp.kept { via.as_str() } else { "-" }, "model registered");
            // Its next heartbeat says so too; a prewarm made before then must already
            // see the copy, not plan a second read of the origin.
            if resp.kept
                && let Some(h) = st.hosts.get_mut(&via)
            {
                h.mark_complete(&digest, name.as_str(), DataTier::Memory, record.total_bytes);
            }
            st.manifests.insert(digest, Arc::new(resp.manifest.clone()));
            let info = record.info(Some(&resp.manifest));
            st.models.insert(name.to_string(), record);
            info
        };
        // Plans are precomputed and stored with the model (Flashpoint §4.2.2).
        if with_profile && let Some(hook) = self.after_register.get() {
            hook(name.to_string()).await;
        }
        Ok(info)
    }

    /// Every registered model (manifests left out).
    pub fn list_models(&self) -> ListModelsResponse {
        let models = lock(&self.state)
            .models
            .values()
            .map(|m| m.info(None))
            .collect();
        let mut registering: Vec<_> = lock(&self.registrations)
            .values()
            .map(|r| r.info.clone())
            .collect();
        registering.sort_by(|a, b| a.name.cmp(&b.name));
        ListModelsResponse {
            models,
            registering,
        }
    }

    /// One model, with its manifest.
    pub fn get_model(&self, key: &str) -> Result<ModelInfo, LookupError> {
        let st = lock(&self.state);
        let m = st.model(key)?;
        Ok(m.info(st.manifests.get(&m.digest).map(|b| b.as_slice())))
    }

    /// Where a model is.
    pub fn get_status(&self, key: &str) -> Result<ModelStatus, LookupError> {
        let st = lock(&self.state);
        let m = st.model(key)?;
        let mut hosts = Vec::new();
        for h in st.hosts.values() {
            let mem = h.holding(&m.digest, DataTier::Memory);
            let disk = h.holding(&m.digest, DataTier::Disk);
            let gpus = h.gpu_reserved.get(&m.digest).copied().unwrap_or(0);
            if mem.is_none() && disk.is_none() && gpus == 0 {
                continue;
            }
            hosts.push(HostHolding {
                host: h.report.host_id.clone(),
                up: h.up,
                memory: mem.is_some_and(|x| x.complete),
                disk: disk.is_some_and(|x| x.complete),
                memory_bytes: mem.map(|x| x.bytes_verified).unwrap_or(0),
                disk_bytes: disk.map(|x| x.bytes_verified).unwrap_or(0),
                gpus,
            });
        }
        let mut plans: Vec<String> = st
            .plans
            .values()
            .filter(|p| p.digest == m.digest && p.running())
            .map(|p| p.id.clone())
            .collect();
        plans.sort();
        Ok(ModelStatus {
            model: Some(m.info(None)),
            hosts,
            plans,
        })
    }

    // ---- plans ----

    /// `Prewarm`: make `replicas` replicas (or the named hosts) hold the model.
    pub fn prewarm(self: &Arc<Self>, req: PrewarmRequest) -> Result<Accepted, PlanRequestError> {
        let tier =
            crate::wire::tier_of(req.tier).map_err(|e| PlanRequestError::Invalid(e.message))?;
        let target = if req.hosts.is_empty() {
            if req.replicas == 0 {
                return Err(PlanRequestError::Invalid(
                    "replicas must be at least 1 (or name the hosts)".into(),
                ));
            }
            Target::Replicas(req.replicas)
        } else {
            Target::Hosts(req.hosts.clone())
        };
        let transport = crate::wire::transport_of(req.transport, self.cfg.transport)
            .map_err(|e| PlanRequestError::Invalid(e.message))?;
        let each_from_origin = match req.sources.as_str() {
            "" | "auto" => false,
            "origin" => true,
            other => {
                return Err(PlanRequestError::Invalid(format!(
                    "sources must be auto or origin, got {other:?}"
                )));
            }
        };
        self.make_plan(&req.model, tier, (each_from_origin, transport), |st, m| {
            // GPU slots are counted by reservation: a gpu prewarm of k makes sure k slots are
            // reserved for the model, reserving only the missing ones.
            if tier == Tier::Gpu
                && let Target::Replicas(k) = target
            {
                let have = gpu_reserved(st, &m.digest);
                return Ok((have < k).then(|| Target::Replicas(k - have)));
            }
            Ok(Some(target))
        })
    }

    /// What a partitioned burst needs from the controller's state: the model, its
    /// manifest, the data addresses of the live hosts holding it in memory (the
    /// partitions' sources, used in turn) and the hosts with a free GPU slot and no GPU
    /// replica of the model: those already holding the data first (nothing to fetch), then
    /// by free slots.
    #[allow(clippy::type_complexity)]
    pub(crate) fn burst_inputs(
        &self,
        key: &str,
    ) -> Result<(ModelRecord, Arc<Vec<u8>>, Vec<String>, Vec<String>), PlanRequestError> {
        let st = lock(&self.state);
        let m = st.model(key)?.clone();
        let manifest = st
            .manifests
            .get(&m.digest)
            .cloned()
            .ok_or_else(|| PlanRequestError::NoManifest(m.name.clone()))?;
        let holds = |h: &HostEntry| {
            h.holding(&m.digest, DataTier::Memory)
                .is_some_and(|x| x.complete)
        };
        let holders: Vec<String> = st
            .hosts
            .values()
            .filter(|h| h.up && holds(h))
            .map(|h| h.report.data_addr.clone())
            .collect();
        let mut free: Vec<(bool, u32, String)> = st
            .hosts
            .values()
            .filter(|h| h.up && !h.gpu_reserved.contains_key(&m.digest))
            .filter_map(|h| {
                let slots = (h.report.gpus.len() as u32)
                    .saturating_sub(h.report.gpus_busy)
                    .saturating_sub(h.reserved_gpus());
                (slots > 0).then(|| (holds(h), slots, h.report.host_id.clone()))
            })
            .collect();
        free.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        Ok((
            m,
            manifest,
            holders,
            free.into_iter().map(|(_, _, h)| h).collect(),
        ))
    }

    /// Books one GPU slot of `digest` on `host` (a burst partition), persisted like a
    /// plan's reservation.
    pub(crate) fn reserve_gpu_slot(
        &self,
        host: &str,
        digest: &str,
    ) -> Result<(), PlanRequestError> {
        let mut st = lock(&self.state);
        let Some(h) = st.hosts.get_mut(host) else {
            return Err(HostUnavailable::Unknown(host.to_string()).into());
        };
        *h.gpu_reserved.entry(digest.to_string()).or_default() += 1;
        h.booked_at.insert(digest.to_string(), Instant::now());
        let rec = StoredHost::of(h);
        drop(st);
        self.put_json(Table::Hosts, host, &rec)
            .map_err(|e| PlanRequestError::Store(e.message))
    }

    /// Releases what [`reserve_gpu_slot`](Self::reserve_gpu_slot) booked.
    pub(crate) fn release_gpu_slot(&self, host: &str, digest: &str) {
        let mut st = lock(&self.state);
        if let Some(h) = st.hosts.get_mut(host)
            && h.gpu_reserved.remove(digest).is_some()
        {
            let rec = StoredHost::of(h);
            drop(st);
            let _ = self.put_json(Table::Hosts, host, &rec);
        }
    }

    /// The heaviness of a model for `LoadModel` (Torpor §5.3) from its registered profile:
    /// PCIe load time of its weights over its execution time. Empty (the host's default)
    /// without a profile.
    pub(crate) fn heaviness_of(&self, digest: &str) -> String {
        let profile = {
            let st = lock(&self.state);
            st.models
                .values()
                .find(|m| m.digest == digest)
                .and_then(|m| m.profile.clone())
        };
        let Some(p) = profile.and_then(|j| parse_profile(&j).ok()) else {
            return String::new();
        };
        let h = shardcast_policies::evict::heaviness(
            p.total_bytes(),
            self.cfg.pcie_bps,
            p.total_exec_s(),
            &shardcast_policies::evict::HeavinessThresholds::default(),
        );
        format!("{h:?}").to_lowercase()
    }

    /// `ScaleOut`: `replicas` more replicas than exist now.
    pub fn scale_out(self: &Arc<Self>, req: ScaleOutRequest) -> Result<Accepted, PlanRequestError> {
        let tier =
            crate::wire::tier_of(req.tier).map_err(|e| PlanRequestError::Invalid(e.message))?;
        if req.replicas == 0 {
            return Err(PlanRequestError::Invalid(
                "replicas must be at least 1".into(),
            ));
        }
        let transport = crate::wire::transport_of(req.transport, self.cfg.transport)
            .map_err(|e| PlanRequestError::Invalid(e.message))?;
        self.make_plan(&req.model, tier, (false, transport), |st, m| {
            let current: u32 = match tier {
                // Placement sees only free GPU slots: ask for the additional ones.
                Tier::Gpu => return Ok(Some(Target::Replicas(req.replicas))),
                _ => {
                    let held = st
                        .hosts
                        .values()
                        .filter(|h| {
                            h.up && h
                                .holding(&m.digest, data_tier(tier))
                                .is_some_and(|x| x.complete)
                        })
                        .count();
                    (held + st.in_flight(&m.digest, tier).len()) as u32
                }
            };
            Ok(Some(Target::Replicas(current.saturating_add(req.replicas))))
        })
    }

    fn make_plan(
        self: &Arc<Self>,
        key: &str,
        tier: Tier,
        (each_from_origin, transport): (bool, shardcast_protocol::HopTransport),
        target: impl FnOnce(&State, &ModelRecord) -> Result<Option<Target>, PlanRequestError>,
    ) -> Result<Accepted, PlanRequestError> {
        let mut st = lock(&self.state);
        let model = st.model(key)?.clone();
        self.usage.touch(&model.digest);
        let target = target(&st, &model)?;
        let in_flight = st.in_flight(&model.digest, tier);
        let in_flight_hosts: Vec<String> = in_flight.keys().cloned().collect();
        let cluster = inventory::cluster_view(&st.hosts, &model.digest, &st.pending());
        let spec = model.spec();
        let mut plan = match target {
            Some(target) => {
                let req = placement::PlanRequest {
                    model: &spec,
                    target,
                    tier,
                    in_flight: &in_flight_hosts,
                };
                placement::plan(&cluster, &req, &self.cfg.plan).map_err(plan_error)?
            }
            // Already satisfied: the hosts with reserved GPU slots, nothing to move.
            None => placement::Plan {
                receivers: st
                    .hosts
                    .values()
                    .filter(|h| h.gpu_reserved.contains_key(&model.digest))
                    .map(|h| Receiver {
                        host: h.report.host_id.clone(),
                        gpus: 0,
                        kind: ReceiverKind::Local,
                    })
                    .collect(),
                chains: Vec::new(),
                estimate_s: 0.0,
            },
        };
        if each_from_origin {
            plan = origin_each(plan, &spec, &self.cfg.plan);
        }

        let id = hex::encode(rand::random::<[u8; 8]>());
        let mut source_of: HashMap<String, String> = HashMap::new();
        let mut chains = Vec::new();
        let mut runs = Vec::new();
        for c in &plan.chains {
            let (source, source_tier) = match &c.source {
                Source::Origin => ("origin".to_string(), "origin".to_string()),
                Source::Peer { host, tier } => (host.clone(), tier.to_string()),
            };
            for h in &c.hops {
                source_of.entry(h.clone()).or_insert_with(|| source.clone());
            }
            chains.push(ChainSummary {
                source: source.clone(),
                source_tier,
                hops: c.hops.clone(),
                shards: c.shards.clone(),
                bytes: c.bytes,
                estimate_s: c.estimate_s,
            });
            runs.push(chain_run(&c.source, &c.hops, &c.shards));
        }
        let total = model.total_bytes;
        let hosts: Vec<ReceiverProgress> = plan
            .receivers
            .iter()
            .map(|r: &Receiver| {
                let (state, source, bytes) = match r.kind {
                    // Already in memory; with GPU slots to fill it still has to load.
                    ReceiverKind::Local if tier == Tier::Gpu && r.gpus > 0 => {
                        (ReceiverState::Loading, "local".to_string(), total)
                    }
                    ReceiverKind::Local => (ReceiverState::Local, "local".to_string(), total),
                    ReceiverKind::Joined => (
                        ReceiverState::Joined,
                        in_flight.get(&r.host).cloned().unwrap_or_default(),
                        0,
                    ),
                    ReceiverKind::New => (
                        ReceiverState::Pending,
                        source_of.get(&r.host).cloned().unwrap_or_default(),
                        0,
                    ),
                };
                let mut h = ReceiverProgress::new(r.host.clone(), state);
                h.bytes = bytes;
                h.total = total;
                h.source = source;
                h.gpus = r.gpus;
                h
            })
            .collect();
        let record = Plan {
            estimate_s: plan.estimate_s,
            chains: chains.clone(),
            runs,
            transport,
            ..Plan::started(
                id.clone(),
                (model.name.clone(), model.digest.clone()),
                tier,
                PlanKind::Chains,
                hosts.clone(),
                model.reads_from().to_string(),
                now_unix(),
            )
        };
        // GPU slots are reserved when the plan is made.
        let mut touched = Vec::new();
        if tier == Tier::Gpu {
            for r in &plan.receivers {
                if r.gpus > 0
                    && let Some(h) = st.hosts.get_mut(&r.host)
                {
                    *h.gpu_reserved.entry(model.digest.clone()).or_default() += r.gpus;
                    h.booked_at.insert(model.digest.clone(), Instant::now());
                    touched.push(StoredHost::of(h));
                }
            }
        }
        // Durable before any chain starts.
        let stored = |e: ApiError| PlanRequestError::Store(e.message);
        self.persist_plan_now(&record).map_err(stored)?;
        for t in touched {
            self.put_json(Table::Hosts, &t.host.host_id, &t)
                .map_err(stored)?;
        }
        st.add_plan(record);
        drop(st);
        info!(plan = %id, model = %model.name, ?tier, receivers = plan.receivers.len(), chains = chains.len(), estimate_s = plan.estimate_s, "plan made");
        tokio::spawn(self.clone().run_plan(id.clone()));
        Ok(Accepted {
            plan_id: id,
            estimate_s: plan.estimate_s,
            chains,
            hosts,
        })
    }

    /// Queues the plan (as its versioned record; progress: the newest record wins,
    /// committed within `write_behind::BATCH_WINDOW`, off the state lock).
    pub(crate) fn persist_plan(&self, p: &Plan) -> Result<(), ApiError> {
        let bytes = serde_json::to_vec(&crate::plan::StoredPlanRef::V1(p))
            .map_err(|e| ApiError::internal(e.to_string()))?;
        self.writes.put(Table::Plans, &p.id, bytes);
        Ok(())
    }

    /// Commits the plan now (a new plan, before its chains start; an ended one).
    pub(crate) fn persist_plan_now(&self, p: &Plan) -> Result<(), ApiError> {
        self.put_json(Table::Plans, &p.id, &crate::plan::StoredPlanRef::V1(p))
    }

    /// Stores `value` as JSON under `key` now. Through the write-behind, so an older value
    /// of the key still queued there (a host record from a heartbeat) is dropped instead of
    /// overwriting this one when its batch commits.
    fn put_json<T: Serialize>(&self, table: Table, key: &str, value: &T) -> Result<(), ApiError> {
        let bytes = serde_json::to_vec(value).map_err(|e| ApiError::internal(e.to_string()))?;
        self.writes.put_now(table, key, &bytes)?;
        Ok(())
    }

    /// A plan now.
    pub fn get_plan(&self, id: &str) -> Result<Plan, LookupError> {
        let st = lock(&self.state);
        st.plans
            .get(id)
            .cloned()
            .ok_or_else(|| LookupError::UnknownPlan(id.to_string()))
    }

    /// Every plan as `view` renders it, newest first (rendered under the lock, so the
    /// plans' chain runs are not copied for a listing).
    pub fn list_plans<R>(&self, view: impl Fn(&Plan) -> R) -> Vec<R> {
        let st = lock(&self.state);
        let mut plans: Vec<&Plan> = st.plans.values().collect();
        plans.sort_by(|a, b| b.created_at.total_cmp(&a.created_at));
        plans.into_iter().map(view).collect()
    }

    /// A receiver of a plan's changes; `None` when the plan has ended (its final state
    /// comes from [`Self::get_plan`]).
    pub fn watch_plan(
        &self,
        id: &str,
    ) -> Result<(Plan, Option<watch::Receiver<Plan>>), LookupError> {
        let st = lock(&self.state);
        let p = st
            .plans
            .get(id)
            .ok_or_else(|| LookupError::UnknownPlan(id.to_string()))?;
        Ok((p.clone(), st.watchers.get(id).map(watch::Sender::subscribe)))
    }

    /// `Evict`: remove the model's copy in `tier` from hosts.
    pub async fn evict(&self, req: EvictRequest) -> Result<EvictResponse, EvictError> {
        let tier = crate::wire::tier_of(req.tier).map_err(|e| EvictError::Invalid(e.message))?;
        let (digest, targets, pending) = {
            let st = lock(&self.state);
            let m = st.model(&req.model)?;
            let digest = m.digest.clone();
            for h in &req.hosts {
                let e = st
                    .hosts
                    .get(h)
                    .ok_or_else(|| HostUnavailable::Unknown(h.clone()))?;
                if tier != Tier::Gpu && !e.up {
                    return Err(HostUnavailable::Down(h.clone()).into());
                }
            }
            let targets: Vec<String> = if req.hosts.is_empty() {
                st.hosts
                    .values()
                    .filter(|h| match tier {
                        Tier::Gpu => h.gpu_reserved.contains_key(&digest),
                        t => h.up && h.holding(&digest, data_tier(t)).is_some(),
                    })
                    .map(|h| h.report.host_id.clone())
                    .collect()
            } else {
                req.hosts.clone()
            };
            // Every holder, and some are down: their copies go when they heartbeat again.
            let pending: Vec<String> = if req.hosts.is_empty() && tier != Tier::Gpu {
                st.hosts
                    .values()
                    .filter(|h| !h.up && h.holding(&digest, data_tier(tier)).is_some())
                    .map(|h| h.report.host_id.clone())
                    .collect()
            } else {
                Vec::new()
            };
            // Refuse while a plan still moves the model to one of them, or waits for one
            // to return (lost, or awaiting room): its partial copy is what it resumes from.
            let (now, grace) = (now_unix(), self.cfg.lost_grace.as_secs_f64());
            for p in st.plans.values() {
                if p.running() && p.digest == digest {
                    if let Some(h) = p.hosts.iter().find(|h| {
                        (h.state.is_active() || h.awaits_return(now, grace))
                            && targets.contains(&h.host)
                    }) {
                        return Err(EvictError::StillMoving {
                            plan: p.id.clone(),
                            host: h.host.clone(),
                        });
                    }
                }
            }
            (digest, targets, pending)
        };
        if !pending.is_empty() {
            let mut st = lock(&self.state);
            for h in &pending {
                if let Some(e) = st.hosts.get_mut(h) {
                    let item = (digest.clone(), data_tier(tier));
                    if !e.pending_evictions.contains(&item) {
                        e.pending_evictions.push(item);
                    }
                    let rec = StoredHost::of(e);
                    self.put_json(Table::Hosts, h, &rec)
                        .map_err(|e| EvictError::Store(e.to_string()))?;
                }
            }
            info!(model = %digest, ?tier, hosts = ?pending, "eviction pending: the hosts are down; their copies go when they heartbeat again");
        }
        let mut evicted = Vec::new();
        if tier == Tier::Gpu {
            let mut st = lock(&self.state);
            for h in &targets {
                if let Some(e) = st.hosts.get_mut(h)
                    && e.gpu_reserved.remove(&digest).is_some()
                {
                    let rec = StoredHost::of(e);
                    self.put_json(Table::Hosts, h, &rec)
                        .map_err(|e| EvictError::Store(e.to_string()))?;
                    evicted.push(h.clone());
                }
            }
            return Ok(EvictResponse {
                evicted,
                bytes_freed: 0,
                pending,
            });
        }
        let mut failures = Vec::new();
        let mut bytes_freed = 0;
        for h in &targets {
            let r = async {
                let mut agent = self.agent(h)?;
                agent
                    .evict_model(apb::EvictModelRequest {
                        model: digest.clone(),
                        tier: agent_tier(tier),
                        // No plan moves it to these hosts any more (checked above): a
                        // session left on one (a forwarder still waiting on a stopped hop)
                        // outlived its plan.
                        end_sessions: true,
                    })
                    .await
                    .map_err(|s| AgentError::from_status(h, &s))
            }
            .await;
            match r {
                Ok(r) => {
                    bytes_freed += r.into_inner().bytes_freed;
                    let mut st = lock(&self.state);
                    if let Some(e) = st.hosts.get_mut(h) {
                        e.forget(&digest, data_tier(tier));
                        let before = e.pending_evictions.len();
                        e.pending_evictions
                            .retain(|(d, t)| !(*d == digest && *t == data_tier(tier)));
                        if e.pending_evictions.len() != before {
                            let rec = StoredHost::of(e);
                            if let Err(err) = self.put_json(Table::Hosts, h, &rec) {
                                warn!(host = %h, "persisting a done pending eviction: {err}");
                            }
                        }
                    }
                    evicted.push(h.clone());
                }
                // The host never heard of the model: nothing to remove.
                Err(e) if e.failure == AgentFailure::NotFound => evicted.push(h.clone()),
                Err(e) => failures.push(e),
            }
        }
        info!(model = %digest, ?tier, hosts = ?evicted, bytes_freed, "evicted");
        match failures.into_iter().next() {
            None => Ok(EvictResponse {
                evicted,
                bytes_freed,
                pending,
            }),
            Some(first) => Err(EvictError::Partial { evicted, first }),
        }
    }

    // ---- plan runner ----

    /// Starts a plan's chains that are not started yet, then polls its receivers until
    /// every one is done, failed or lost; re-plans receivers that stop making progress.
    /// Sends a plan's status to its watchers and persists it (at most once a second while
    /// it runs, and when it ends); an ended plan's watchers are dropped.
    pub(crate) fn publish_plan(
        &self,
        st: &mut State,
        id: &str,
        ended: bool,
        last_persist: &mut Instant,
    ) {
        let Some(plan) = st.plans.get(id) else { return };
        if let Some(w) = st.watchers.get(id) {
            w.send_replace(plan.clone());
        }
        if ended || last_persist.elapsed() >= Duration::from_secs(1) {
            // The end is committed at once (a controller killed right after must not come
            // back with the plan running); progress is queued.
            let r = if ended {
                self.persist_plan_now(plan)
            } else {
                self.persist_plan(plan)
            };
            if let Err(e) = r {
                warn!(plan = %id, "persisting plan: {e}");
            }
            *last_persist = Instant::now();
        }
        if ended {
            info!(plan = %id, kind = %plan.kind, state = %plan.state, elapsed_s = plan.elapsed_s(now_unix()), "plan ended");
            st.watchers.remove(id);
        }
    }

    async fn run_plan(self: Arc<Self>, id: String) {
        let mut progress = StallClock::default();
        // Tier gpu: hosts asked to load (None) or that cannot (Some(why)).
        let mut gpu_asked: HashMap<String, Option<String>> = HashMap::new();
        let mut last_persist = Instant::now();
        self.start_runs(&id).await;
        // Each active receiver's agent pushes its progress (completion within tens of
        // milliseconds); the tick still runs the loop for hosts without a stream, for
        // stall detection and for hosts that go down. The streams end with the plan.
        let pushed = Arc::new(Pushed::default());
        let mut streams: tokio::task::JoinSet<String> = tokio::task::JoinSet::new();
        let mut watching: HashSet<String> = HashSet::new();
        let mut tick = tokio::time::interval(self.cfg.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_round = Instant::now() - MIN_ROUND;
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = tick.tick() => {}
                _ = pushed.wake.notified() => {}
            }
            // At most one round per MIN_ROUND: with 1000 receivers pushing progress, a
            // round per push kept a core busy and the state lock contended.
            if let Some(wait) = MIN_ROUND.checked_sub(last_round.elapsed()) {
                tokio::time::sleep(wait).await;
            }
            last_round = Instant::now();
            while let Some(ended) = streams.try_join_next() {
                if let Ok(host) = ended {
                    watching.remove(&host);
                    lock(&pushed.latest).remove(&host);
                }
            }
            let Some((digest, name, tier, active, returned)) = self.active_receivers(&id) else {
                return;
            };
            // Lost receivers whose hosts heartbeat again within the grace: new chains from
            // the holders there are now; they resume from their verified chunks.
            if !returned.is_empty() {
                info!(plan = %id, hosts = ?returned, "lost receivers are back: re-planning them");
                for (host, room) in &returned {
                    self.events.record(Event {
                        at: now_unix(),
                        model: name.clone(),
                        kind: "receiver-returned".into(),
                        reason: match room {
                            true => format!(
                                "host {host} reports room for the rest of the copy its store refused: re-planned, resuming from its verified chunks"
                            ),
                            false => format!(
                                "host {host} heartbeats again within the lost grace: re-planned, resuming from its verified chunks"
                            ),
                        },
                        plan_id: id.clone(),
                        delta: 0,
                        hosts: vec![host.clone()],
                    });
                }
                let hosts: Vec<String> = returned.into_iter().map(|(h, _)| h).collect();
                self.replan(&id, &hosts).await;
                for h in &hosts {
                    progress.restart(h);
                }
                let mut st = lock(&self.state);
                self.publish_plan(&mut st, &id, false, &mut last_persist);
                continue;
            }
            for (host, up, _) in &active {
                if *up && watching.insert(host.clone()) {
                    streams.spawn(self.clone().watch_receiver(
                        host.clone(),
                        digest.clone(),
                        tier,
                        pushed.clone(),
                    ));
                }
            }
            // Poll outside the lock.
            let mut updates = Vec::new();
            let mut to_poll = Vec::new();
            for (host, up, gpus) in active {
                if !up {
                    updates.push((host, None));
                    continue;
                }
                // Tier gpu: ask the host to load as soon as it knows the model; its loader
                // streams chunks as they are verified, overlapping the chain transfer.
                if tier == Tier::Gpu && gpus > 0 && !gpu_asked.contains_key(&host) {
                    match self.request_gpu_load(&host, &digest, gpus).await {
                        Ok(()) => {
                            gpu_asked.insert(host.clone(), None);
                        }
                        Err(GpuAsk::Later) => {}
                        Err(GpuAsk::Unavailable(why)) => {
                            gpu_asked.insert(host.clone(), Some(why));
                        }
                    }
                }
                let latest = lock(&pushed.latest).get(&host).cloned();
                match latest {
                    Some(p) => updates.push((host, Some(Ok(p)))),
                    None => to_poll.push(host),
                }
            }
            // Receivers without a pushed status (a plan's first round: every receiver) are
            // polled concurrently: one after the other, 1000 receivers took seconds per round.
            {
                use futures::StreamExt;
                let (digest, me) = (&digest, &*self);
                let mut polls = futures::stream::iter(to_poll)
                    .map(|host| async move {
                        let polled = me.poll_host(&host, digest, tier).await;
                        (host, Some(polled))
                    })
                    .buffer_unordered(POLL_CONCURRENCY);
                while let Some(u) = polls.next().await {
                    updates.push(u);
                }
            }
            let now = Instant::now();
            let mut stalled = Vec::new();
            let mut changed = false;
            let mut ended = false;
            let mut newly_done: HashSet<String> = HashSet::new();
            {
                let mut st = lock(&self.state);
                let total = st
                    .models
                    .values()
                    .find(|m| m.digest == digest)
                    .map(|m| m.total_bytes);
                let Some(plan) = st.plans.get_mut(&id) else {
                    return;
                };
                let elapsed = plan.elapsed_s(now_unix());
                let plan_sessions: Vec<String> =
                    plan.runs.iter().map(|r| r.session.clone()).collect();
                // By host: `receiver_mut`'s linear search per update made a round
                // O(receivers²).
                let at: HashMap<String, usize> = plan
                    .hosts
                    .iter()
                    .enumerate()
                    .map(|(i, h)| (h.host.clone(), i))
                    .collect();
                for (host, polled) in updates {
                    let Some(h) = at.get(&host).and_then(|&i| plan.hosts.get_mut(i)) else {
                        continue;
                    };
                    match polled {
                        None => {
                            changed |= h.lose(
                                &format!(
                                    "the host stopped heartbeating during the transfer; the plan waits {}s for it to return",
                                    self.cfg.lost_grace.as_secs()
                                ),
                                now_unix(),
                            );
                            warn!(plan = %id, host = %host, "receiver lost");
                            self.events.record(Event {
                                at: now_unix(),
                                model: name.clone(),
                                kind: "receiver-lost".into(),
                                reason: format!(
                                    "host {host} stopped heartbeating with {} of {} bytes",
                                    h.bytes, h.total
                                ),
                                plan_id: id.clone(),
                                delta: 0,
                                hosts: vec![host.clone()],
                            });
                        }
                        // An agent that does not answer while heartbeating: keep waiting;
                        // the stall timer decides.
                        Some(Err(e)) => changed |= h.unanswered(e),
                        Some(Ok(seen)) => {
                            let seen = seen.for_sessions(plan_sessions.iter().map(String::as_str));
                            let refused = gpu_asked.get(&host).cloned().flatten();
                            let was_done = h.state == ReceiverState::Done;
                            changed |= h.observe(&seen, tier, refused.as_deref(), total, elapsed);
                            if h.state == ReceiverState::Failed && seen.store_failure().is_some() {
                                // Its store refused the data: lost, and re-planned once
                                // its host reports room (within the lost grace).
                                h.wait_for_room(now_unix(), self.cfg.lost_grace.as_secs_f64());
                            }
                            if !was_done && h.state == ReceiverState::Done {
                                newly_done.insert(host.clone());
                            }
                        }
                    }
                    if progress.stalled(&host, h.moved(), now, self.cfg.stall_timeout)
                        && h.state.is_active()
                    {
                        stalled.push(host.clone());
                    }
                }
                if plan.settle_after(now_unix(), self.cfg.lost_grace.as_secs_f64()) {
                    changed = true;
                    ended = true;
                }
                // Hosts done in this round (every done host once the plan ends): marking
                // every done receiver on every round cost O(receivers) lookups per round.
                let done_hosts: Vec<(String, u64)> = plan
                    .hosts
                    .iter()
                    .filter(|h| {
                        h.state == ReceiverState::Done && (ended || newly_done.contains(&h.host))
                    })
                    .map(|h| (h.host.clone(), h.total))
                    .collect();
                for (host, bytes) in done_hosts {
                    if let Some(e) = st.hosts.get_mut(&host) {
                        e.mark_complete(&digest, &name, data_tier(tier), bytes);
                    }
                }
            }
            if !stalled.is_empty() && !ended {
                self.replan(&id, &stalled).await;
                for h in &stalled {
                    progress.restart(h);
                }
                changed = true;
            }
            if changed {
                let mut st = lock(&self.state);
                self.publish_plan(&mut st, &id, ended, &mut last_persist);
            }
            if ended {
                return;
            }
        }
    }

    /// (digest, name, tier, [(receiver, up, gpus)], [(returned, for room)]) of a running
    /// plan: its receivers still in progress, and its lost receivers whose hosts heartbeat
    /// again within the lost grace (those whose store refused the data: once their hosts
    /// report room for the rest).
    #[allow(clippy::type_complexity)]
    fn active_receivers(
        &self,
        id: &str,
    ) -> Option<(
        String,
        String,
        Tier,
        Vec<(String, bool, u32)>,
        Vec<(String, bool)>,
    )> {
        let st = lock(&self.state);
        let plan = st.plans.get(id).filter(|p| p.running())?;
        let up = |host: &str| st.hosts.get(host).is_some_and(|e| e.up);
        let active = plan
            .hosts
            .iter()
            .filter(|h| h.state.is_active())
            .map(|h| (h.host.clone(), up(&h.host), h.gpus))
            .collect();
        let (now, grace) = (now_unix(), self.cfg.lost_grace.as_secs_f64());
        // A receiver whose store refused the data returns once its host reports room for
        // the rest in the plan's tier.
        let free = |host: &str| {
            st.hosts
                .get(host)
                .map_or(0, |e| match data_tier(plan.tier) {
                    DataTier::Memory => e.report.mem_free,
                    DataTier::Disk => e.report.disk_free,
                })
        };
        let returned = plan
            .hosts
            .iter()
            .filter(|h| {
                h.awaits_return(now, grace) && up(&h.host) && h.room_for_rest(free(&h.host))
            })
            .map(|h| (h.host.clone(), h.awaits_room))
            .collect();
        Some((
            plan.digest.clone(),
            plan.model.clone(),
            plan.tier,
            active,
            returned,
        ))
    }

    /// Asks `host` to load the model onto `gpus` GPUs.
    async fn request_gpu_load(&self, host: &str, digest: &str, gpus: u32) -> Result<(), GpuAsk> {
        let mut agent = self.agent(host).map_err(|_| GpuAsk::Later)?;
        let r = tokio::time::timeout(
            Duration::from_secs(5),
            agent.load_model(apb::LoadModelRequest {
                heaviness: self.heaviness_of(digest),
                model: digest.to_string(),
                count: gpus,
                gpus: Vec::new(),
                partition: None,
            }),
        )
        .await;
        match r {
            Ok(Ok(_)) => {
                info!(host, model = %digest, gpus, "GPU load requested");
                Ok(())
            }
            // The manifest has not reached the host yet: ask again on the next poll.
            Ok(Err(s)) if s.code() == tonic::Code::NotFound => Err(GpuAsk::Later),
            Ok(Err(s))
                if matches!(
                    s.code(),
                    tonic::Code::FailedPrecondition | tonic::Code::ResourceExhausted
                ) =>
            {
                warn!(host, model = %digest, "GPU load refused: {}", s.message());
                Err(GpuAsk::Unavailable(format!(
                    "GPU load refused ({}); the model is in the host's memory tier",
                    s.message()
                )))
            }
            _ => Err(GpuAsk::Later),
        }
    }

    /// A permit for calling `host`'s agent while it never answered (its first call opens
    /// the connection); `None` once it has.
    async fn first_contact_gate(&self, host: &str) -> Option<tokio::sync::SemaphorePermit<'_>> {
        if lock(&self.reached).contains(host) {
            return None;
        }
        self.first_contact.acquire().await.ok()
    }

    /// Progress of `digest` in the tier on `host` (and on its GPUs).
    pub(crate) async fn poll_host(
        &self,
        host: &str,
        digest: &str,
        tier: Tier,
    ) -> Result<Seen, String> {
        let mut agent = self.agent(host).map_err(|e| e.message)?;
        let gate = self.first_contact_gate(host).await;
        let r = tokio::time::timeout(
            Duration::from_secs(2),
            agent.get_model_status(GetModelStatusRequest {
                model: digest.to_string(),
            }),
        )
        .await;
        drop(gate);
        if matches!(r, Ok(Ok(_))) {
            lock(&self.reached).insert(host.to_string());
        }
        match r {
            Err(_) => Err(format!("agent of {host} did not answer within 2 s")),
            Ok(Err(s)) if s.code() == tonic::Code::NotFound => Ok(Seen::default()),
            Ok(Err(s)) => Err(format!("agent of {host}: {}", s.message())),
            Ok(Ok(resp)) => Ok(polled_from(&resp.into_inner(), tier)),
        }
    }

    /// Follows `host`'s status of `digest` through its agent's `WatchModelStatus` stream,
    /// storing each update in `pushed` and waking the plan loop, until the stream ends (the
    /// task is aborted with the plan). Returns `host`.
    async fn watch_receiver(
        self: Arc<Self>,
        host: String,
        digest: String,
        tier: Tier,
        pushed: Arc<Pushed>,
    ) -> String {
        let Ok(mut agent) = self.agent(&host) else {
            return host;
        };
        let req = GetModelStatusRequest { model: digest };
        let gate = self.first_contact_gate(&host).await;
        let Ok(Ok(resp)) =
            tokio::time::timeout(Duration::from_secs(2), agent.watch_model_status(req)).await
        else {
            return host;
        };
        drop(gate);
        lock(&self.reached).insert(host.clone());
        let mut stream = resp.into_inner();
        while let Ok(Some(status)) = stream.message().await {
            lock(&pushed.latest).insert(host.clone(), polled_from(&status, tier));
            pushed.wake.notify_one();
        }
        host
    }

    /// Starts the chains of a plan that have not been started.
    async fn start_runs(&self, id: &str) {
        let (runs, origin, digest, tier, transport) = {
            let st = lock(&self.state);
            let Some(p) = st.plans.get(id) else { return };
            (
                p.runs.clone(),
                p.origin.clone(),
                p.digest.clone(),
                p.tier,
                p.transport,
            )
        };
        let manifest = lock(&self.state).manifests.get(&digest).cloned();
        let Some(manifest) = manifest else {
            warn!(plan = %id, "the model's manifest is missing from the controller state");
            return;
        };
        let mut results = Vec::new();
        for (i, run) in runs.iter().enumerate() {
            if run.started {
                continue;
            }
            let r = self
                .start_run(run, &manifest, (&origin, &digest), tier, transport)
                .await;
            if let Err(e) = &r {
                warn!(plan = %id, head = %run.head, "starting a chain failed: {e}");
            }
            results.push((i, r));
        }
        let mut st = lock(&self.state);
        if let Some(p) = st.plans.get_mut(id) {
            for (i, r) in results {
                if let Some(run) = p.runs.get_mut(i) {
                    match r {
                        Ok(()) => run.started = true,
                        Err(e) => run.error = e,
                    }
                }
            }
            if let Err(e) = self.persist_plan(p) {
                warn!(plan = %id, "persisting plan: {e}");
            }
        }
    }

    /// The registry name whose current version is `digest`, if any.
    pub(crate) fn current_name(&self, digest: &str) -> Option<String> {
        lock(&self.state)
            .models
            .values()
            .find(|m| m.digest == digest)
            .map(|m| m.name.clone())
    }

    async fn start_run(
        &self,
        run: &ChainRun,
        manifest: &Arc<Vec<u8>>,
        (origin, digest): (&str, &str),
        tier: Tier,
        transport: shardcast_protocol::HopTransport,
    ) -> Result<(), String> {
        let mut agent = self.agent(&run.head).map_err(|e| e.message)?;
        if run.hops.is_empty() {
            // A single receiver fed by the origin: it downloads on its own. ImportModel
            // returns when the download ends; progress is polled meanwhile.
            let name = decode_exact::<Manifest>(manifest.to_vec().into())
                .map_err(|e| format!("the stored manifest of {digest} does not decode: {e}"))?
                .name
                .to_string();
            let req = ImportModelRequest {
                name,
                origin: origin.to_string(),
                chunk_size: 0,
                tier: agent_tier(tier),
                fetch: true,
                keep: false,
                manifest: manifest.to_vec(),
                // The host's name follows only the registry's current version.
                bind_name: Some(self.current_name(digest).is_some()),
            };
            let head = run.head.clone();
            tokio::spawn(async move {
                if let Err(s) = agent.import_model(req).await {
                    warn!(host = %head, "download from the origin failed: {}", s.message());
                }
            });
            return Ok(());
        }
        // The head first: the hops' upstream lists name it, and a recovering hop dials it.
        let (head_addr, hosts): (String, Vec<(String, String)>) = {
            let st = lock(&self.state);
            let addr_of = |h: &String| {
                st.hosts
                    .get(h)
                    .map(|e| e.report.data_addr.clone())
                    .unwrap_or_default()
            };
            let hops = run.hops.iter().map(|h| (h.clone(), addr_of(h))).collect();
            (addr_of(&run.head), hops)
        };
        let plan_token = match &self.cfg.signer {
            None => Vec::new(),
            Some(signer) => {
                let claims = shardcast_protocol::plan::PlanClaims {
                    plan: run.session.clone(),
                    model: digest
                        .parse()
                        .map_err(|e| format!("model digest {digest}: {e}"))?,
                    not_after: unix_now() + shardcast_identity::plan::PLAN_TOKEN_TTL.as_secs(),
                    // Orders this statement about the name against the others a host hears.
                    issued_at_ms: unix_now_ms(),
                    // Each with the address the hops may dial it at.
                    hosts: std::iter::once((&run.head, &head_addr))
                        .chain(hosts.iter().map(|(h, a)| (h, a)))
                        .filter_map(|(h, addr)| {
                            Some(shardcast_protocol::Hop {
                                host: shardcast_protocol::HostId::new(h).ok()?,
                                addr: addr.clone(),
                            })
                        })
                        .collect(),
                    // The hosts bind the name only to the registry's current version.
                    name: self
                        .current_name(digest)
                        .and_then(|n| shardcast_protocol::ModelName::new(n).ok()),
                };
                signer.load().sign(&claims).map_err(|e| e.to_string())?
            }
        };
        let req = apb::StartChainRequest {
            session_id: run.session.clone(),
            model: digest.to_string(),
            manifest: manifest.to_vec(),
            origin: origin.to_string(),
            tier: agent_tier(tier),
            chains: vec![apb::Chain {
                shards: run.shards.clone(),
                hops: hosts
                    .into_iter()
                    .map(|(host_id, addr)| apb::Hop { host_id, addr })
                    .collect(),
            }],
            plan_token,
            transport: apb::Transport::from(transport) as i32,
        };
        match tokio::time::timeout(Duration::from_secs(10), agent.start_chain(req)).await {
            Err(_) => Err(format!("agent of {} did not answer StartChain", run.head)),
            Ok(Err(s)) if s.code() == tonic::Code::AlreadyExists => Ok(()),
            Ok(Err(s)) => Err(format!("{}: {}", run.head, s.message())),
            Ok(Ok(_)) => Ok(()),
        }
    }

    /// Re-plans receivers that made no progress: new chains from the sources available now.
    async fn replan(&self, id: &str, stalled: &[String]) {
        let started = {
            let mut st = lock(&self.state);
            let pending = st.pending();
            let Some(plan) = st.plans.get(id) else { return };
            let digest = plan.digest.clone();
            let Some(model) = st.models.values().find(|m| m.digest == digest).cloned() else {
                return;
            };
            let tier = plan.tier;
            let mut cluster = inventory::cluster_view(&st.hosts, &digest, &pending);
            // Stalled receivers are not sources.
            for h in &mut cluster {
                if stalled.contains(&h.id) {
                    h.holdings.clear();
                }
            }
            let Some(plan) = st.plans.get_mut(id) else {
                return;
            };
            // Each receiver has its own budget of re-plans without progress in between.
            let max = self.cfg.max_replans;
            let mut given_up = Vec::new();
            for h in plan.hosts.iter_mut().filter(|h| stalled.contains(&h.host)) {
                if !h.replanned(max) {
                    h.state = ReceiverState::Failed;
                    h.error = format!(
                        "no progress for {:?} after {max} re-plans in a row",
                        self.cfg.stall_timeout
                    );
                    given_up.push(h.host.clone());
                }
            }
            if !given_up.is_empty() {
                warn!(plan = %id, hosts = ?given_up, "receivers failed: no progress after re-planning");
            }
            let live: Vec<String> = stalled
                .iter()
                .filter(|h| !given_up.contains(h))
                .filter(|h| cluster.iter().any(|c| c.id == **h && c.up))
                .cloned()
                .collect();
            if live.is_empty() {
                return;
            }
            let chains =
                placement::plan_chains(&cluster, &model.spec(), tier, &live, &self.cfg.plan);
            plan.replans += 1;
            plan.message = format!(
                "re-planned {} receiver(s) that made no progress for {:?}",
                live.len(),
                self.cfg.stall_timeout
            );
            let first = plan.runs.len();
            for c in &chains {
                let source = match &c.source {
                    Source::Origin => "origin".to_string(),
                    Source::Peer { host, .. } => host.clone(),
                };
                for h in plan.hosts.iter_mut().filter(|h| c.hops.contains(&h.host)) {
                    h.source = source.clone();
                    if h.state == ReceiverState::Joined {
                        h.state = ReceiverState::Receiving;
                    }
                    if h.state == ReceiverState::Lost {
                        h.come_back();
                    }
                }
                plan.runs.push(chain_run(&c.source, &c.hops, &c.shards));
            }
            warn!(plan = %id, hosts = ?live, chains = chains.len(), "re-planning stalled receivers");
            first
        };
        let _ = started;
        self.start_runs(id).await;
    }
}

/// The pinned form of `origin` a host resolved it to, if it is one: the same Hub
/// repository at a full commit ([`OriginLocation::pins`]). Anything else is not taken from
/// a host.
fn pinned_origin(origin: &str, resolved: &str) -> Option<String> {
    let origin = OriginLocation::parse(origin).ok()?;
    OriginLocation::parse(resolved)
        .ok()
        .filter(|r| r.pins(&origin))
        .map(|_| resolved.to_string())
}

/// GPU slots reserved for `digest` on live hosts.
pub(crate) fn gpu_reserved(st: &State, digest: &str) -> u32 {
    st.hosts
        .values()
        .filter(|h| h.up)
        .map(|h| h.gpu_reserved.get(digest).copied().unwrap_or(0))
        .sum()
}

/// The baseline: every new receiver downloads from the origin itself, all sharing the
/// origin's bandwidth.
fn origin_each(
    mut plan: placement::Plan,
    spec: &placement::ModelSpec,
    params: &PlanParams,
) -> placement::Plan {
    let new: Vec<String> = plan.new_receivers().map(str::to_string).collect();
    let bytes = spec.total_bytes();
    let share = (params.origin_bps / new.len().max(1) as u64).max(1);
    plan.chains = new
        .into_iter()
        .map(|h| placement::ChainPlan {
            source: Source::Origin,
            hops: vec![h],
            shards: Vec::new(),
            bytes,
            estimate_s: placement::estimate_chain_s(bytes, share, &[share], spec.chunk_size),
        })
        .collect();
    plan.estimate_s = plan.chains.iter().map(|c| c.estimate_s).fold(0.0, f64::max);
    plan
}

/// Receivers a plan's loop polls at once (each poll is one `GetModelStatus` with a 2 s
/// timeout; the first reaches a host over a new mutually authenticated connection).
const POLL_CONCURRENCY: usize = 64;

/// Agents contacted for the first time at once (see `Controller::first_contact`).
const FIRST_CONTACTS: usize = 16;

/// The shortest time between two rounds of a plan's loop (the agents check their status
/// every 20 ms too, so completion is still seen within tens of milliseconds).
const MIN_ROUND: Duration = Duration::from_millis(20);

/// Why a GPU load could not be requested.
enum GpuAsk {
    /// Not yet (the host does not know the model yet, or did not answer).
    Later,
    /// The host cannot (no GPUs, out of GPU memory).
    Unavailable(String),
}

fn chain_run(source: &Source, hops: &[String], shards: &[u32]) -> ChainRun {
    let session = hex::encode(rand::random::<[u8; 16]>());
    match source {
        Source::Origin => ChainRun {
            head: hops.first().cloned().unwrap_or_default(),
            session,
            hops: hops.iter().skip(1).cloned().collect(),
            shards: shards.to_vec(),
            from_origin: true,
            started: false,
            error: String::new(),
        },
        Source::Peer { host, .. } => ChainRun {
            head: host.clone(),
            session,
            hops: hops.to_vec(),
            shards: shards.to_vec(),
            from_origin: false,
            started: false,
            error: String::new(),
        },
    }
}

/// A plan's status with `elapsed_s` filled in.
/// A receiver's state is what it holds: a receiver of any plan (running or ended) marked
/// `lost` or `failed` whose latest heartbeat reports the plan's model complete in the
/// plan's tier (and resident on its GPUs, for tier gpu) is `done` again, with the time it
/// was seen; an ended plan's outcome is recomputed. Returns one event per such receiver.
/// The running plans receiving on `host`, whose transferd just restarted: its receivers
/// there are marked `lost` as of now (their sessions died with the process), so the plan
/// runner re-plans them on its next round as returned hosts (`receiver-returned`) instead
/// of waiting out its stall clock. With no lost grace a restart is not waited for: the
/// stall clock decides as before.
fn restarted_receivers(st: &mut State, host: &str, grace: Duration) -> Vec<Event> {
    if grace.is_zero() {
        return Vec::new();
    }
    let Some(ids) = st.receiver_plans.get(host).cloned() else {
        return Vec::new();
    };
    let now = now_unix();
    let mut events = Vec::new();
    for id in ids {
        let Some(plan) = st.plans.get_mut(&id) else {
            continue;
        };
        if !plan.running() {
            continue;
        }
        let mut hit = false;
        for h in plan
            .hosts
            .iter_mut()
            .filter(|h| h.host == host && h.state.is_active())
        {
            hit |= h.lose(
                "the host's transferd restarted; it is re-planned and resumes from its verified chunks",
                now,
            );
        }
        if hit {
            events.push(Event {
                at: now,
                model: plan.model.clone(),
                kind: "receiver-restarted".into(),
                reason: format!("host {host}'s transferd restarted during the plan"),
                plan_id: id.clone(),
                delta: 0,
                hosts: vec![host.to_string()],
            });
        }
    }
    events
}

fn reconcile_receivers(st: &mut State, host: &str) -> Vec<Event> {
    let Some(entry) = st.hosts.get(host) else {
        return Vec::new();
    };
    let complete: HashSet<(&str, DataTier)> = entry
        .report
        .holdings
        .iter()
        .filter(|h| h.complete)
        .map(|h| (h.digest.as_str(), h.tier))
        .collect();
    if complete.is_empty() {
        return Vec::new();
    }
    let resident: HashSet<&str> = entry
        .report
        .gpu_loads
        .iter()
        .filter(|g| g.state == GpuState::Resident)
        .map(|g| g.digest.as_str())
        .collect();
    let now = now_unix();
    let mut events = Vec::new();
    let Some(ids) = st.receiver_plans.get(host) else {
        return Vec::new();
    };
    for id in ids {
        let Some(plan) = st.plans.get_mut(id) else {
            continue;
        };
        // Since the plan began, even when it has ended: when the copy was seen.
        let (tier, elapsed) = (plan.tier, (now - plan.created_at).max(0.0));
        let digest = plan.digest.as_str();
        if !complete.contains(&(digest, data_tier(tier))) {
            continue;
        }
        let is_resident = resident.contains(digest);
        let mut recovered = false;
        for h in plan.hosts.iter_mut().filter(|h| h.host == host) {
            let Some(was) = h.recover(tier, is_resident, elapsed) else {
                continue;
            };
            events.push(Event {
                at: now,
                model: plan.model.clone(),
                kind: "receiver-recovered".into(),
                reason: format!("host {host} holds a complete copy after it was marked {was}"),
                plan_id: plan.id.clone(),
                delta: 0,
                hosts: vec![host.to_string()],
            });
            recovered = true;
        }
        if recovered && !plan.running() {
            plan.settle(now);
        }
    }
    events
}

/// What receivers' agents pushed last (`WatchModelStatus`), and the plan loop's wake-up.
#[derive(Default)]
pub(crate) struct Pushed {
    latest: Mutex<HashMap<String, Seen>>,
    wake: tokio::sync::Notify,
}

/// A receiver's progress in `tier` from its agent's model status.
fn polled_from(resp: &apb::GetModelStatusResponse, tier: Tier) -> Seen {
    let want = agent_tier(tier);
    let mut seen = resp
        .tiers
        .iter()
        .find(|t| t.tier == want)
        .map(|t| Seen {
            bytes: t.bytes_verified,
            complete: t.complete,
            gpu: GpuState::of_gpus(t.gpus.iter().map(|g| g.state.as_str()))
                .map(|s| (t.gpus.iter().map(|g| g.bytes).sum(), s)),
            store_failures: Vec::new(),
        })
        .unwrap_or_default();
    seen.store_failures = resp
        .store_failures
        .iter()
        .filter(|f| f.tier == want)
        .map(|f| (f.session.clone(), f.error.clone()))
        .collect();
    seen
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

/// Parses a registered profile (`RegisterModel.profile_json`).
pub fn parse_profile(json: &str) -> Result<shardcast_policies::profile::ModelProfile, String> {
    let p: shardcast_policies::profile::ModelProfile =
        serde_json::from_str(json).map_err(|e| e.to_string())?;
    p.validate().map_err(|e| e.to_string())?;
    if p.groups.len() > 100_000 {
        warn!("a profile with {} groups", p.groups.len());
    }
    Ok(p)
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

    #[test]
    fn model_records_are_versioned_and_unversioned_ones_still_load() {
        let old = serde_json::json!({
            "name": "org/m", "digest": "ab", "origin": "file:///m", "chunk_size": 4,
            "total_bytes": 8, "shards": [["w.bin", 8, 2]], "registered_at": 1.0
        });
        let m = ModelRecord::read(old.to_string().as_bytes()).unwrap();
        assert_eq!(m.version, MODEL_RECORD_VERSION);
        let v: serde_json::Value = serde_json::to_value(&m).unwrap();
        assert_eq!(v["version"], MODEL_RECORD_VERSION);
        let mut future = old.clone();
        future["version"] = "7".into();
        let e = ModelRecord::read(future.to_string().as_bytes()).unwrap_err();
        assert!(e.contains("\"7\""), "{e}");
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
        st.hosts.insert("h1".into(), holding("h1", "d1"));
        assert_eq!(st.receiver_plans["h1"], vec!["a".to_string()]);
        assert_eq!(st.receiver_plans["h9"].len(), 1000);
        let events = reconcile_receivers(&mut st, "h1");
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
        assert!(reconcile_receivers(&mut st, "h1").is_empty());
        // A host in no plan.
        st.hosts.insert("h3".into(), holding("h3", "d1"));
        assert!(reconcile_receivers(&mut st, "h3").is_empty());
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
