//! A swarm of simulated hosts: a **load generator for the controller**, not a data plane.
//!
//! Each simulated host is a real participant of the control plane over the real APIs:
//!
//! - it heartbeats to the controller's `Inventory.Heartbeat` over gRPC on its own
//!   connection, with its own `host` certificate from the cluster CA (mutual TLS, exactly
//!   like a transferd; `--insecure` runs the controller in its documented plaintext mode);
//!   given several controller replicas it follows the leader as transferd does (one
//!   `FailoverChannel` per host: a follower's refusal names the leader in
//!   `x-shardcast-leader`, a dead replica is skipped);
//! - it serves the `Agent` gRPC API on its own loopback port behind the same mutual TLS and
//!   the same per-method authorisation table as transferd (`transferd::agent::permission`),
//!   so the controller dials it, checks its identity and calls `ImportModel`, `StartChain`,
//!   `GetModelStatus`, `WatchModelStatus`, `EvictModel`, … as it does a daemon.
//!
//! What it does **not** do: move, store or verify a single byte. A chain the controller
//! starts is *simulated*: every receiver's shards "arrive" at the configured link rate
//! (the chain's head delays each hop by one chunk, as the pipelined chain does; a head that
//! does not hold the model reads from the origin at `origin_bps`), and the host reports the
//! verified bytes and completion that time implies, through the same session states a
//! transferd reports (unknown → partial → complete). The plan token is verified (signed by
//! the controller, naming this host). Its manifest is that of a model made of zero bytes
//! (real BLAKE3 hashes of zeros), so registration works through the real path too.
//!
//! Use it to measure the controller (heartbeat handling, inventory, placement, plan
//! runner, status APIs) at hundreds or thousands of hosts on one machine; never to claim
//! data-plane numbers. The data addresses it advertises point at its agent listener; no
//! peer ever connects to them.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use shardcast_identity::failover::FailoverChannel;
use shardcast_identity::grpc::{AuthzLayer, AuthzStats, ClientSecurity, TcpSecurity};
use shardcast_identity::{Alpn, Expect, Role, TlsContext};
use shardcast_protocol::agent::agent_server::{Agent, AgentServer};
use shardcast_protocol::agent::{self as pb};
use shardcast_protocol::codec::{decode_exact, encode_to_vec};
use shardcast_protocol::controller::inventory_client::InventoryClient;
use shardcast_protocol::controller::{HeldModel, HostReport};
use shardcast_protocol::manifest::ShardHasher;
use shardcast_protocol::{HostId, Manifest, ModelDigest, ModelName, ShardPath};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::pki::ClusterPki;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A model the swarm can "import": its origin URI and the manifest of `size` zero bytes.
#[derive(Debug, Clone)]
pub struct SimModel {
    /// The origin URI the controller registers it from (never read).
    pub origin: String,
    /// Its manifest (real hashes of zero bytes).
    pub manifest: Arc<Manifest>,
}

impl SimModel {
    /// A model of `size` zero bytes in `shards` shards of `chunk_size`-byte chunks.
    pub fn zeros(
        name: &str,
        origin: &str,
        size: u64,
        shards: usize,
        chunk_size: u32,
    ) -> anyhow::Result<Self> {
        let shards = shards.max(1);
        let zeros = vec![0u8; 1 << 20];
        let mut entries = Vec::with_capacity(shards);
        for i in 0..shards {
            let per = size / shards as u64;
            let len = if i + 1 == shards {
                size - per * (shards as u64 - 1)
            } else {
                per
            };
            let mut h = ShardHasher::new(chunk_size);
            let mut left = len;
            while left > 0 {
                let n = left.min(zeros.len() as u64) as usize;
                h.update(&zeros[..n]);
                left -= n as u64;
            }
            let path = ShardPath::new(format!("model-{:05}-of-{shards:05}.safetensors", i + 1))?;
            entries.push(h.finish(path));
        }
        let manifest = Manifest::new(ModelName::new(name)?, chunk_size, entries)?;
        Ok(Self {
            origin: origin.to_string(),
            manifest: Arc::new(manifest),
        })
    }
}

/// How the swarm is made.
#[derive(Debug, Clone)]
pub struct SwarmOpts {
    /// Simulated hosts.
    pub hosts: usize,
    /// Racks they are spread over (round robin by index blocks).
    pub racks: usize,
    /// Heartbeat period of every host.
    pub heartbeat: Duration,
    /// Simulated per-host link rate, bytes per second.
    pub link_bps: u64,
    /// Simulated origin rate per connection, bytes per second.
    pub origin_bps: u64,
    /// Memory-tier capacity each host reports.
    pub mem_capacity: u64,
    /// Disk-tier capacity each host reports.
    pub disk_capacity: u64,
    /// The controller's gRPC address (`host:port`), or every replica's (on etcd): each
    /// host's heartbeats follow the leader among them.
    pub controllers: Vec<String>,
    /// The cluster CA: each host gets its own certificate. `None`: plaintext (the
    /// controller must run with `--insecure-plaintext`).
    pub pki: Option<Arc<ClusterPki>>,
    /// Models the hosts can import, by origin.
    pub catalog: Vec<SimModel>,
}

/// Heartbeat round trips as the hosts saw them.
#[derive(Debug, Default)]
pub struct HeartbeatStats {
    samples_us: Mutex<Vec<u32>>,
    ok: AtomicU64,
    failed: AtomicU64,
    last_error: Mutex<String>,
    /// Gaps between a host's consecutive answered heartbeats longer than two periods
    /// (its heartbeats failed or waited meanwhile), with when the gap ended.
    gaps: Mutex<Vec<(Instant, Duration)>>,
}

impl HeartbeatStats {
    /// Clears the samples and counters (start of a measurement window).
    pub fn reset(&self) {
        lock(&self.samples_us).clear();
        lock(&self.gaps).clear();
        self.ok.store(0, Ordering::Relaxed);
        self.failed.store(0, Ordering::Relaxed);
    }

    /// Hosts' gaps between answered heartbeats longer than two periods since the last
    /// reset: (when the gap ended, its length).
    pub fn gaps(&self) -> Vec<(Instant, Duration)> {
        lock(&self.gaps).clone()
    }

    /// (answered, failed, round trips in µs) since the last reset.
    pub fn take(&self) -> (u64, u64, Vec<u32>) {
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            lock(&self.samples_us).clone(),
        )
    }

    /// The last heartbeat error, if any.
    pub fn last_error(&self) -> String {
        lock(&self.last_error).clone()
    }
}

/// The simulated arrival of one shard on one host.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    size: u64,
    /// When the first byte lands; `None`: not scheduled.
    start: Option<Instant>,
    bps: f64,
}

impl Arrival {
    fn verified(&self, now: Instant, chunk: u64) -> u64 {
        let Some(start) = self.start else { return 0 };
        let secs = now.saturating_duration_since(start).as_secs_f64();
        let bytes = (secs * self.bps) as u64;
        if bytes >= self.size {
            self.size
        } else {
            // Whole verified chunks only, as a daemon reports them.
            bytes / chunk.max(1) * chunk.max(1)
        }
    }
}

/// One model's copy in one tier of one simulated host.
#[derive(Debug, Clone)]
struct SimCopy {
    manifest: Arc<Manifest>,
    shards: Vec<Arrival>,
}

impl SimCopy {
    fn new(manifest: Arc<Manifest>) -> Self {
        let shards = manifest
            .shards
            .iter()
            .map(|s| Arrival {
                size: s.size,
                start: None,
                bps: 1.0,
            })
            .collect();
        Self { manifest, shards }
    }

    fn verified(&self, now: Instant) -> u64 {
        let chunk = u64::from(self.manifest.chunk_size);
        self.shards.iter().map(|a| a.verified(now, chunk)).sum()
    }

    fn complete(&self, now: Instant) -> bool {
        self.verified(now) >= self.manifest.total_bytes()
    }

    /// When the last shard lands (`None` while some shard is not scheduled).
    fn done_at(&self) -> Option<Instant> {
        self.shards.iter().try_fold(Instant::now(), |acc, a| {
            let start = a.start?;
            let end = start + Duration::from_secs_f64(a.size as f64 / a.bps.max(1.0));
            Some(acc.max(end))
        })
    }

    fn status(&self, digest: &str, tier: i32, now: Instant) -> pb::ModelStatus {
        let chunk = u64::from(self.manifest.chunk_size);
        let shards: Vec<pb::ShardStatus> = self
            .manifest
            .shards
            .iter()
            .zip(&self.shards)
            .map(|(s, a)| {
                let v = a.verified(now, chunk);
                pb::ShardStatus {
                    path: s.path.to_string(),
                    verified: v.div_ceil(chunk.max(1)) as u32,
                    total: s.chunks.len() as u32,
                    complete: v >= s.size,
                    size: s.size,
                }
            })
            .collect();
        let bytes = self.verified(now);
        let total = self.manifest.total_bytes();
        pb::ModelStatus {
            digest: digest.to_string(),
            name: self.manifest.name.to_string(),
            tier,
            complete: bytes >= total,
            bytes_verified: bytes,
            total_bytes: total,
            shards,
            path: String::new(),
            gpus: Vec::new(),
        }
    }
}

#[derive(Debug, Default)]
struct HostState {
    manifests: HashMap<String, Arc<Manifest>>,
    names: HashMap<String, String>,
    /// (hex digest, agent tier) → copy.
    copies: HashMap<(String, i32), SimCopy>,
}

/// One simulated host.
#[derive(Debug)]
pub struct SimHost {
    /// Host id (`sim-00001`, …).
    pub id: String,
    /// Rack.
    pub rack: String,
    /// Its agent listener, `127.0.0.1:port`.
    pub agent_addr: SocketAddr,
    tls: Option<Arc<TlsContext>>,
    state: Mutex<HostState>,
    /// Woken when a copy is scheduled or removed (watch streams sleep until then, or until
    /// the next progress report or completion is due, instead of ticking every 20 ms:
    /// a thousand hosts ticking cost more CPU than the controller under test).
    changed: tokio::sync::Notify,
}

impl SimHost {
    fn report(&self, opts: &SwarmOpts) -> HostReport {
        let st = lock(&self.state);
        let now = Instant::now();
        let (mut mem_used, mut disk_used) = (0u64, 0u64);
        let mut holdings = Vec::with_capacity(st.copies.len());
        for ((digest, tier), c) in &st.copies {
            let v = c.verified(now);
            let total = c.manifest.total_bytes();
            // Space is taken when the session opens (files are preallocated).
            if *tier == pb::Tier::Disk as i32 {
                disk_used += total;
            } else {
                mem_used += total;
            }
            holdings.push(HeldModel {
                digest: digest.clone(),
                name: c.manifest.name.to_string(),
                tier: if *tier == pb::Tier::Disk as i32 {
                    "disk"
                } else {
                    "memory"
                }
                .into(),
                complete: v >= total,
                bytes_verified: v,
                total_bytes: total,
            });
        }
        HostReport {
            host_id: self.id.clone(),
            // No data listener: the address is the agent's and no peer connects to it.
            data_addr: self.agent_addr.to_string(),
            agent_addr: self.agent_addr.to_string(),
            zone: "sim".into(),
            rack: self.rack.clone(),
            nic_bps: opts.link_bps,
            mem_capacity: opts.mem_capacity,
            mem_free: opts.mem_capacity.saturating_sub(mem_used),
            disk_capacity: opts.disk_capacity,
            disk_free: opts.disk_capacity.saturating_sub(disk_used),
            gpus: Vec::new(),
            holdings,
            version: "shardcast-bench swarm (simulated host)".into(),
            gpus_busy: 0,
            gpu_loads: Vec::new(),
            gpu_evicted: Vec::new(),
            bound_names: st.names.keys().cloned().collect(),
            // A simulated host never restarts or drains.
            started_at_ms: 0,
            draining: false,
        }
    }

    fn resolve(&self, key: &str) -> Option<String> {
        if let Ok(d) = key.parse::<ModelDigest>() {
            return Some(d.to_hex());
        }
        lock(&self.state).names.get(key).cloned()
    }

    fn status_of(&self, digest: &str) -> pb::GetModelStatusResponse {
        let st = lock(&self.state);
        let now = Instant::now();
        let mut tiers: Vec<pb::ModelStatus> = st
            .copies
            .iter()
            .filter(|((d, _), _)| d == digest)
            .map(|((d, t), c)| c.status(d, *t, now))
            .collect();
        tiers.sort_by_key(|t| t.tier);
        pb::GetModelStatusResponse {
            tiers,
            store_failures: Vec::new(),
        }
    }

    /// Schedules `shards` (all when empty) of `manifest` into `tier`, the first landing at
    /// `start`, one after the other at `bps`. Shards already complete are left alone.
    fn schedule(
        &self,
        manifest: &Arc<Manifest>,
        tier: i32,
        shards: &[u32],
        start: Instant,
        bps: f64,
    ) {
        let digest = manifest.digest().to_hex();
        let mut st = lock(&self.state);
        st.manifests
            .entry(digest.clone())
            .or_insert_with(|| manifest.clone());
        st.names.insert(manifest.name.to_string(), digest.clone());
        let copy = st
            .copies
            .entry((digest, tier))
            .or_insert_with(|| SimCopy::new(manifest.clone()));
        let now = Instant::now();
        let chunk = u64::from(manifest.chunk_size);
        let all: Vec<u32> = (0..copy.shards.len() as u32).collect();
        let order = if shards.is_empty() { &all[..] } else { shards };
        let mut at = start;
        for &i in order {
            let Some(a) = copy.shards.get_mut(i as usize) else {
                continue;
            };
            if a.start.is_some() && a.verified(now, chunk) >= a.size {
                continue;
            }
            *a = Arrival {
                size: a.size,
                start: Some(at),
                bps,
            };
            at += Duration::from_secs_f64(a.size as f64 / bps.max(1.0));
        }
        drop(st);
        self.changed.notify_waiters();
    }

    /// For `digest`'s incomplete copies: whether bytes are arriving, and the earliest
    /// instant one completes.
    fn arriving(&self, digest: &str) -> (bool, Option<Instant>) {
        let st = lock(&self.state);
        let now = Instant::now();
        let mut arriving = false;
        let mut first_done: Option<Instant> = None;
        for ((d, _), c) in &st.copies {
            if d != digest || c.complete(now) {
                continue;
            }
            arriving |= c.shards.iter().any(|a| a.start.is_some());
            if let Some(t) = c.done_at() {
                first_done = Some(first_done.map_or(t, |f| f.min(t)));
            }
        }
        (arriving, first_done)
    }

    fn holds_complete(&self, digest: &str) -> bool {
        let now = Instant::now();
        lock(&self.state)
            .copies
            .iter()
            .any(|((d, _), c)| d == digest && c.complete(now))
    }
}

/// What every simulated host's agent shares.
struct Shared {
    opts: SwarmOpts,
    hosts: HashMap<String, Arc<SimHost>>,
    cancel: CancellationToken,
    started: Instant,
}

/// The agent API of one simulated host.
struct SimAgent {
    shared: Arc<Shared>,
    host: Arc<SimHost>,
}

fn tier_of(t: i32) -> Result<i32, Status> {
    if t == pb::Tier::Memory as i32 || t == pb::Tier::Disk as i32 {
        Ok(t)
    } else {
        Err(Status::invalid_argument(format!(
            "tier {t} is not memory or disk"
        )))
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// How often a watch stream looks for changes, and sends byte progress at most (as
/// transferd's `WatchModelStatus`).
const WATCH_EVERY: Duration = Duration::from_millis(20);
const WATCH_PROGRESS_EVERY: Duration = Duration::from_millis(250);
const WATCH_LIMIT: Duration = Duration::from_secs(3600);

fn milestones(r: &pb::GetModelStatusResponse) -> Vec<(i32, bool)> {
    r.tiers.iter().map(|t| (t.tier, t.complete)).collect()
}

#[tonic::async_trait]
impl Agent for SimAgent {
    async fn import_model(
        &self,
        request: Request<pb::ImportModelRequest>,
    ) -> Result<Response<pb::ImportModelResponse>, Status> {
        let req = request.into_inner();
        let tier = tier_of(req.tier)?;
        let manifest: Arc<Manifest> = if req.manifest.is_empty() {
            let m = self
                .shared
                .opts
                .catalog
                .iter()
                .find(|m| m.origin == req.origin.trim())
                .ok_or_else(|| {
                    Status::unavailable(format!(
                        "reading origin {}: not in the simulated swarm's catalog",
                        req.origin
                    ))
                })?;
            if m.manifest.name.as_str() != req.name {
                return Err(Status::invalid_argument(format!(
                    "the swarm's model at {} is {:?}, not {:?}",
                    req.origin,
                    m.manifest.name.as_str(),
                    req.name
                )));
            }
            m.manifest.clone()
        } else {
            let m: Manifest = decode_exact(req.manifest.into())
                .map_err(|e| Status::invalid_argument(format!("manifest: {e}")))?;
            Arc::new(m)
        };
        let digest = manifest.digest().to_hex();
        lock(&self.host.state)
            .manifests
            .insert(digest.clone(), manifest.clone());
        if req.fetch {
            let opts = &self.shared.opts;
            let bps = opts.origin_bps.min(opts.link_bps).max(1) as f64;
            self.host
                .schedule(&manifest, tier, &[], Instant::now(), bps);
            // ImportModel with `fetch` returns when the download ends.
            let done = lock(&self.host.state)
                .copies
                .get(&(digest.clone(), tier))
                .and_then(SimCopy::done_at);
            if let Some(done) = done {
                tokio::select! {
                    _ = tokio::time::sleep_until(done.into()) => {}
                    _ = self.shared.cancel.cancelled() => return Err(Status::unavailable("shutting down")),
                }
            }
        }
        if req.bind_name.unwrap_or(true) {
            lock(&self.host.state)
                .names
                .insert(manifest.name.to_string(), digest.clone());
        }
        Ok(Response::new(pb::ImportModelResponse {
            digest,
            manifest: encode_to_vec(&*manifest),
            total_bytes: manifest.total_bytes(),
            shards: manifest.shards.len() as u32,
            // A registration's `keep` is not simulated: the copy is only "held" once
            // fetched, so the controller plans the first prewarm from the origin.
            kept: req.fetch,
            resolved_origin: String::new(),
        }))
    }

    async fn start_chain(
        &self,
        request: Request<pb::StartChainRequest>,
    ) -> Result<Response<pb::StartChainResponse>, Status> {
        let req = request.into_inner();
        let model: ModelDigest = req
            .model
            .parse()
            .map_err(|e| Status::invalid_argument(format!("model: {e}")))?;
        let digest = model.to_hex();
        let known = lock(&self.host.state).manifests.get(&digest).cloned();
        let manifest = match known {
            Some(m) => m,
            None if !req.manifest.is_empty() => {
                let m: Manifest = decode_exact(req.manifest.into())
                    .map_err(|e| Status::invalid_argument(format!("manifest: {e}")))?;
                if m.digest() != model {
                    return Err(Status::invalid_argument(
                        "manifest digest does not match the model",
                    ));
                }
                Arc::new(m)
            }
            None => {
                return Err(Status::not_found(format!(
                    "model {digest} is unknown on this host; import it or pass its manifest"
                )));
            }
        };
        let tier = tier_of(req.tier)?;
        if req.chains.is_empty() || req.chains.iter().any(|c| c.hops.is_empty()) {
            return Err(Status::invalid_argument(
                "a chain session needs chains with at least one hop",
            ));
        }
        // The plan token: signed by the controller, naming this host and every hop at its
        // address.
        if let Some(tls) = &self.host.tls {
            if req.plan_token.is_empty() {
                return Err(Status::invalid_argument("plan_token is required"));
            }
            let claims = tls
                .verify_plan(&req.plan_token, rustls_pki_types::UnixTime::now())
                .map_err(|e| Status::permission_denied(format!("plan token: {e}")))?;
            let me = HostId::new(&self.host.id).map_err(|e| Status::internal(e.to_string()))?;
            if claims.model != model || claims.not_after < unix_now() || !claims.names(&me) {
                return Err(Status::permission_denied(
                    "the plan token does not authorise this session on this host",
                ));
            }
            for c in &req.chains {
                for h in &c.hops {
                    let hop = shardcast_protocol::Hop {
                        host: HostId::new(&h.host_id)
                            .map_err(|e| Status::invalid_argument(e.to_string()))?,
                        addr: h.addr.clone(),
                    };
                    if !claims.signs(&hop) {
                        return Err(Status::permission_denied(format!(
                            "hop {} at {} is not in the plan token",
                            h.host_id, h.addr
                        )));
                    }
                }
            }
        }
        let opts = &self.shared.opts;
        let link = opts.link_bps.max(1) as f64;
        let from_store = self.host.holds_complete(&digest);
        // A head without the model reads it from the origin and receives it itself.
        let bps = if from_store {
            link
        } else {
            link.min(opts.origin_bps.max(1) as f64)
        };
        let hop_delay = Duration::from_secs_f64(f64::from(manifest.chunk_size) / bps);
        let now = Instant::now();
        for c in &req.chains {
            let mut receivers: Vec<Arc<SimHost>> = Vec::new();
            if !from_store {
                receivers.push(self.host.clone());
            }
            for h in &c.hops {
                let peer = self.shared.hosts.get(&h.host_id).ok_or_else(|| {
                    Status::unavailable(format!(
                        "hop {} is not a host of this simulated swarm",
                        h.host_id
                    ))
                })?;
                receivers.push(peer.clone());
            }
            for (pos, r) in receivers.iter().enumerate() {
                r.schedule(
                    &manifest,
                    tier,
                    &c.shards,
                    now + hop_delay * pos as u32,
                    bps,
                );
            }
        }
        let session_id = if req.session_id.is_empty() {
            hex::encode(rand::random::<[u8; 16]>())
        } else {
            req.session_id
        };
        Ok(Response::new(pb::StartChainResponse { session_id }))
    }

    async fn get_session(
        &self,
        request: Request<pb::GetSessionRequest>,
    ) -> Result<Response<pb::SessionStatus>, Status> {
        Err(Status::not_found(format!(
            "simulated host: sessions are not tracked ({})",
            request.into_inner().session_id
        )))
    }

    async fn get_model_status(
        &self,
        request: Request<pb::GetModelStatusRequest>,
    ) -> Result<Response<pb::GetModelStatusResponse>, Status> {
        let key = request.into_inner().model;
        let digest = self
            .host
            .resolve(&key)
            .ok_or_else(|| Status::not_found(format!("model {key:?} is not known on this host")))?;
        Ok(Response::new(self.host.status_of(&digest)))
    }

    type WatchModelStatusStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<pb::GetModelStatusResponse, Status>> + Send>,
    >;

    async fn watch_model_status(
        &self,
        request: Request<pb::GetModelStatusRequest>,
    ) -> Result<Response<Self::WatchModelStatusStream>, Status> {
        let key = request.into_inner().model;
        let digest = self
            .host
            .resolve(&key)
            .ok_or_else(|| Status::not_found(format!("model {key:?} is not known on this host")))?;
        struct W {
            host: Arc<SimHost>,
            cancel: CancellationToken,
            digest: String,
            until: tokio::time::Instant,
            last: Option<pb::GetModelStatusResponse>,
            sent: tokio::time::Instant,
        }
        let w = W {
            host: self.host.clone(),
            cancel: self.shared.cancel.clone(),
            digest,
            until: tokio::time::Instant::now() + WATCH_LIMIT,
            last: None,
            sent: tokio::time::Instant::now(),
        };
        let stream = futures::stream::unfold(w, |mut w| async move {
            loop {
                if w.last.is_some() {
                    // Registered before looking, so a change made meanwhile is not missed.
                    let changed = w.host.changed.notified();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    let (arriving, done) = w.host.arriving(&w.digest);
                    // What transferd's 20 ms check would see: completion (a milestone) at
                    // once, byte progress at most every WATCH_PROGRESS_EVERY.
                    let mut next = w.until;
                    if arriving {
                        next = next.min(w.sent + WATCH_PROGRESS_EVERY);
                    }
                    if let Some(d) = done {
                        next = next.min(tokio::time::Instant::from_std(d) + WATCH_EVERY);
                    }
                    // Never sooner than transferd's check (no spinning on a due report
                    // whose bytes did not move).
                    let next = next.max(tokio::time::Instant::now() + WATCH_EVERY);
                    tokio::select! {
                        _ = w.cancel.cancelled() => return None,
                        _ = tokio::time::sleep_until(w.until) => return None,
                        _ = tokio::time::sleep_until(next) => {}
                        _ = changed => {}
                    }
                }
                let now = w.host.status_of(&w.digest);
                let send = match &w.last {
                    None => true,
                    Some(last) => {
                        milestones(&now) != milestones(last)
                            || (now != *last && w.sent.elapsed() >= WATCH_PROGRESS_EVERY)
                    }
                };
                if send {
                    w.last = Some(now.clone());
                    w.sent = tokio::time::Instant::now();
                    return Some((Ok(now), w));
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_holdings(
        &self,
        _request: Request<pb::ListHoldingsRequest>,
    ) -> Result<Response<pb::ListHoldingsResponse>, Status> {
        let st = lock(&self.host.state);
        let now = Instant::now();
        let models = st
            .copies
            .iter()
            .map(|((d, t), c)| c.status(d, *t, now))
            .collect();
        Ok(Response::new(pb::ListHoldingsResponse { models }))
    }

    async fn get_stats(
        &self,
        _request: Request<pb::GetStatsRequest>,
    ) -> Result<Response<pb::Stats>, Status> {
        Ok(Response::new(pb::Stats {
            host_id: self.host.id.clone(),
            ..Default::default()
        }))
    }

    async fn evict_model(
        &self,
        request: Request<pb::EvictModelRequest>,
    ) -> Result<Response<pb::EvictModelResponse>, Status> {
        let req = request.into_inner();
        if req.tier == pb::Tier::Gpu as i32 {
            return Ok(Response::new(pb::EvictModelResponse {
                removed: false,
                bytes_freed: 0,
            }));
        }
        let tier = tier_of(req.tier)?;
        let digest = self.host.resolve(&req.model).ok_or_else(|| {
            Status::not_found(format!("model {:?} is not known on this host", req.model))
        })?;
        let now = Instant::now();
        let removed = lock(&self.host.state).copies.remove(&(digest, tier));
        self.host.changed.notify_waiters();
        Ok(Response::new(pb::EvictModelResponse {
            removed: removed.is_some(),
            bytes_freed: removed.map(|c| c.verified(now)).unwrap_or(0),
        }))
    }

    async fn load_model(
        &self,
        _request: Request<pb::LoadModelRequest>,
    ) -> Result<Response<pb::LoadModelResponse>, Status> {
        Err(Status::failed_precondition(
            "simulated host: no GPUs (the swarm does not simulate GPU loads)",
        ))
    }

    async fn gpu_status(
        &self,
        _request: Request<pb::GpuStatusRequest>,
    ) -> Result<Response<pb::GpuStatusResponse>, Status> {
        Ok(Response::new(pb::GpuStatusResponse {
            note: "simulated host: no GPUs".into(),
            ..Default::default()
        }))
    }

    async fn get_handoff(
        &self,
        _request: Request<pb::GetHandoffRequest>,
    ) -> Result<Response<pb::GetHandoffResponse>, Status> {
        Err(Status::failed_precondition(
            "simulated host: it holds no bytes to hand off",
        ))
    }
}

/// A running swarm. Dropping it (or [`Swarm::stop`]) stops every host.
pub struct Swarm {
    shared: Arc<Shared>,
    /// Heartbeat round trips.
    pub heartbeats: Arc<HeartbeatStats>,
    /// Seconds spent issuing and loading the hosts' certificates.
    pub cert_s: f64,
    tasks: tokio::task::JoinSet<()>,
    heartbeating: Arc<AtomicBool>,
}

impl Drop for Swarm {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
    }
}

impl Swarm {
    /// Issues certificates, binds every host's agent listener and starts heartbeating.
    pub async fn start(opts: SwarmOpts) -> anyhow::Result<Self> {
        anyhow::ensure!(opts.hosts > 0, "a swarm needs at least one host");
        // Each host holds a listener and a connection to the controller, and the controller
        // one to each agent it calls.
        let _ = shardcast_identity::process::raise_nofile_limit();
        let cancel = CancellationToken::new();
        let racks = opts.racks.clamp(1, opts.hosts);
        let per_rack = opts.hosts.div_ceil(racks);
        let ids: Vec<String> = (0..opts.hosts).map(|i| format!("sim-{i:05}")).collect();
        // One certificate per host, issued by the cluster CA (ECDSA P-256; written to the
        // PKI directory and loaded as each host's TLS context).
        let started = Instant::now();
        let tls: Vec<Option<Arc<TlsContext>>> = match &opts.pki {
            None => vec![None; opts.hosts],
            Some(pki) => {
                let (pki, ids) = (pki.clone(), ids.clone());
                tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<_>> {
                    ids.iter()
                        .map(|id| {
                            let files = pki.files(Role::Host, id)?;
                            Ok(Some(TlsContext::load(files)?))
                        })
                        .collect()
                })
                .await??
            }
        };
        let cert_s = started.elapsed().as_secs_f64();
        let mut listeners = Vec::with_capacity(opts.hosts);
        let mut hosts = HashMap::with_capacity(opts.hosts);
        let mut order = Vec::with_capacity(opts.hosts);
        for (i, (id, tls)) in ids.into_iter().zip(tls).enumerate() {
            let l = TcpListener::bind("127.0.0.1:0")
                .await
                .context("binding a simulated agent listener")?;
            let host = Arc::new(SimHost {
                id: id.clone(),
                rack: format!("rack-{:03}", i / per_rack),
                agent_addr: l.local_addr()?,
                tls,
                state: Mutex::default(),
                changed: tokio::sync::Notify::new(),
            });
            listeners.push(l);
            order.push(host.clone());
            hosts.insert(id, host);
        }
        let shared = Arc::new(Shared {
            opts,
            hosts,
            cancel: cancel.clone(),
            started: Instant::now(),
        });
        let heartbeats = Arc::new(HeartbeatStats::default());
        let heartbeating = Arc::new(AtomicBool::new(true));
        let mut tasks = tokio::task::JoinSet::new();
        let authz = Arc::new(AuthzStats::default());
        let n = order.len();
        for (i, (host, l)) in order.into_iter().zip(listeners).enumerate() {
            let security = match &host.tls {
                Some(ctx) => TcpSecurity::Tls(ctx.clone(), Alpn::Grpc),
                None => TcpSecurity::Plaintext,
            };
            let incoming = shardcast_identity::grpc::incoming_tcp(
                l,
                security,
                cancel.clone().cancelled_owned(),
            );
            let service = AgentServer::new(SimAgent {
                shared: shared.clone(),
                host: host.clone(),
            })
            .max_decoding_message_size(128 << 20)
            .max_encoding_message_size(128 << 20);
            let layer = AuthzLayer::new(transferd::agent::permission, authz.clone());
            let stop = cancel.clone();
            tasks.spawn(async move {
                let _ = tonic::transport::Server::builder()
                    .layer(layer)
                    .add_service(service)
                    .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
                    .await;
            });
            // Spread the first heartbeats over one period, as hosts started at random times.
            let offset = shared.opts.heartbeat.mul_f64(i as f64 / n as f64);
            tasks.spawn(heartbeat_loop(
                shared.clone(),
                host,
                offset,
                heartbeats.clone(),
                heartbeating.clone(),
            ));
        }
        Ok(Self {
            shared,
            heartbeats,
            cert_s,
            tasks,
            heartbeating,
        })
    }

    /// The hosts' ids.
    pub fn host_ids(&self) -> BTreeSet<String> {
        self.shared.hosts.keys().cloned().collect()
    }

    /// A host.
    pub fn host(&self, id: &str) -> Option<Arc<SimHost>> {
        self.shared.hosts.get(id).cloned()
    }

    /// Hosts whose simulated store holds `digest` complete (in any tier).
    pub fn holders(&self, digest: &str) -> BTreeSet<String> {
        self.shared
            .hosts
            .values()
            .filter(|h| h.holds_complete(digest))
            .map(|h| h.id.clone())
            .collect()
    }

    /// Stops (or resumes) heartbeats: the hosts stay reachable but go silent.
    pub fn set_heartbeating(&self, on: bool) {
        self.heartbeating.store(on, Ordering::Relaxed);
    }

    /// Stops every host and waits for their tasks.
    pub async fn stop(mut self) {
        self.shared.cancel.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}

async fn heartbeat_loop(
    shared: Arc<Shared>,
    host: Arc<SimHost>,
    offset: Duration,
    stats: Arc<HeartbeatStats>,
    on: Arc<AtomicBool>,
) {
    let security = match &host.tls {
        Some(ctx) => ClientSecurity::Tls(ctx.clone(), Expect::Role(Role::Controller)),
        None => ClientSecurity::Plaintext,
    };
    // As transferd: one channel over every replica that follows the leader, patient for
    // a period (at least 2 s) while no replica takes the heartbeat.
    let channel = match FailoverChannel::new(
        &shared.opts.controllers,
        security,
        shared.opts.heartbeat.max(Duration::from_secs(2)),
    ) {
        Ok(c) => c,
        Err(e) => {
            *lock(&stats.last_error) = e.to_string();
            return;
        }
    };
    let mut client = InventoryClient::new(channel);
    let mut last_ok: Option<Instant> = None;
    // Diagnostics: `SHARDCAST_SWARM_SLOW_MS=n` prints every heartbeat slower than n ms.
    let slow_ms: Option<u64> = std::env::var("SHARDCAST_SWARM_SLOW_MS")
        .ok()
        .and_then(|v| v.parse().ok());
    tokio::select! {
        _ = shared.cancel.cancelled() => return,
        _ = tokio::time::sleep(offset) => {}
    }
    let mut tick = tokio::time::interval(shared.opts.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shared.cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        if !on.load(Ordering::Relaxed) {
            continue;
        }
        let report = host.report(&shared.opts);
        let t0 = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(10), client.heartbeat(report)).await;
        let us = t0.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
        match r {
            Ok(Ok(resp)) => {
                let now = Instant::now();
                if let Some(prev) = last_ok.replace(now)
                    && now - prev > shared.opts.heartbeat * 2
                {
                    lock(&stats.gaps).push((now, now - prev));
                }
                if slow_ms.is_some_and(|ms| u64::from(us) >= ms * 1000) {
                    eprintln!(
                        "swarm: slow heartbeat of {} ({} ms) at {:.3} s",
                        host.id,
                        us / 1000,
                        shared.started.elapsed().as_secs_f64()
                    );
                }
                stats.ok.fetch_add(1, Ordering::Relaxed);
                lock(&stats.samples_us).push(us);
                // The registry's answer: names not registered are unbound (as transferd).
                let names = resp.into_inner().names;
                let mut st = lock(&host.state);
                st.names.retain(|n, _| names.iter().any(|b| b.name == *n));
            }
            Ok(Err(s)) => {
                stats.failed.fetch_add(1, Ordering::Relaxed);
                *lock(&stats.last_error) = format!("{}: {}", host.id, s.message());
            }
            Err(_) => {
                stats.failed.fetch_add(1, Ordering::Relaxed);
                *lock(&stats.last_error) = format!("{}: no answer within 10 s", host.id);
            }
        }
    }
}

/// The `q` quantile (0..=1) of `v` (sorted in place); 0 when empty.
pub fn quantile<T: Copy + Ord + Into<f64>>(v: &mut [T], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * q.clamp(0.0, 1.0)).round() as usize;
    v[i.min(v.len() - 1)].into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(size: u64, shards: usize) -> Arc<Manifest> {
        SimModel::zeros("sim/m", "http://127.0.0.1:9/m/", size, shards, 64 << 10)
            .unwrap()
            .manifest
    }

    fn host() -> SimHost {
        SimHost {
            id: "sim-00000".into(),
            rack: "r".into(),
            agent_addr: "127.0.0.1:1".parse().unwrap(),
            tls: None,
            state: Mutex::default(),
            changed: tokio::sync::Notify::new(),
        }
    }

    #[test]
    fn zero_manifest_hashes_zero_bytes() {
        let m = model(300_000, 3);
        assert_eq!(m.total_bytes(), 300_000);
        assert_eq!(m.shards.len(), 3);
        let zeros = vec![0u8; 64 << 10];
        assert!(m.verify_chunk(0, 0, &zeros).is_ok());
    }

    #[test]
    fn arrivals_follow_the_link_rate_and_chunks() {
        let m = model(1 << 20, 2);
        let h = host();
        let start = Instant::now() - Duration::from_millis(500);
        // 1 MiB/s: after 0.5 s about half has landed, in whole chunks.
        h.schedule(&m, 0, &[], start, (1 << 20) as f64);
        let d = m.digest().to_hex();
        let s = h.status_of(&d);
        let t = &s.tiers[0];
        assert!(!t.complete);
        assert!(t.bytes_verified >= 7 * (64 << 10) && t.bytes_verified <= 9 * (64 << 10));
        assert_eq!(t.bytes_verified % (64 << 10), 0);
        // Done later.
        h.schedule(&m, 0, &[], Instant::now() - Duration::from_secs(5), 1e9);
        assert!(h.holds_complete(&d));
        assert!(h.report(&test_opts()).holdings[0].complete);
    }

    #[test]
    fn a_subset_of_shards_is_not_complete() {
        let m = model(1 << 20, 2);
        let h = host();
        h.schedule(&m, 0, &[1], Instant::now() - Duration::from_secs(5), 1e9);
        let d = m.digest().to_hex();
        let t = &h.status_of(&d).tiers[0];
        assert_eq!(t.bytes_verified, m.shards[1].size);
        assert!(!t.complete);
    }

    fn test_opts() -> SwarmOpts {
        SwarmOpts {
            hosts: 1,
            racks: 1,
            heartbeat: Duration::from_secs(1),
            link_bps: 1,
            origin_bps: 1,
            mem_capacity: 1 << 40,
            disk_capacity: 1 << 40,
            controllers: vec!["127.0.0.1:1".into()],
            pki: None,
            catalog: Vec::new(),
        }
    }

    #[test]
    fn quantiles() {
        let mut v = vec![5u32, 1, 4, 2, 3];
        assert_eq!(quantile(&mut v, 0.5), 3.0);
        assert_eq!(quantile(&mut v, 1.0), 5.0);
        assert_eq!(quantile::<u32>(&mut [], 0.5), 0.0);
    }
}
