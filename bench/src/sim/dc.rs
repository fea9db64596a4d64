//! The simulated datacenter behind the controller's agent port: every host's copies and GPU
//! loads, the flow-level network ([`super::net`]) that moves the bytes, and
//! [`SimAgents`], the [`Agents`] implementation the real controller calls.
//!
//! Who talks to whom:
//!
//! ```text
//!  controller (real: plan runner, placement, registry, inventory)
//!     │  start_chain / import_model / load_model / model_status / watch / evict
//!     ▼
//!  SimAgents ──► Datacenter (one lock) ──► Network (flows, max-min rates, milestones)
//!     ▲                    │  host changes (tokio watch per host)
//!     │                    ▼
//!  fleet heartbeats   driver task: sleeps until the next milestone or GPU event on the
//!  (HostView per host)  paused tokio clock, then syncs
//! ```
//!
//! Time is the tokio clock, paused: [`Datacenter::now`] is seconds since the datacenter was
//! made. Every call first *syncs* the datacenter to now: the network is advanced event by
//! event, each milestone reached updates the receiving host's copy at the exact time it
//! was reached, a copy that becomes complete starts its GPU load if one was asked for, and
//! GPU loads whose time has come become resident. The driver task only makes sure the
//! clock stops at those instants (tokio wakes it at the next millisecond at the latest;
//! the recorded times are the exact ones).
//!
//! What a host does, in the terms of the agent port:
//!
//! * `start_chain` at a head: the head sends from its complete copy, or (without one) reads
//!   the origin and forwards; the chain is one pipelined flow through every hop (hop `j`
//!   complete when the head has pushed `bytes + j * chunk`). Every receiver knows the model
//!   from then on (`load_model` is accepted).
//! * `import_model`: without `fetch` (registration) the host "builds" the manifest of a
//!   catalogued model at once (no bytes exist, [`super::models`]); with `fetch` it downloads
//!   from the origin and answers when the download ends.
//! * `load_model`: the GPU load starts when the copy is complete (or now, if later) and
//!   takes the model's load + host-to-GPU time ([`super::models::Phases`]); its GPU bytes
//!   grow linearly meanwhile, so the plan runner's stall clock sees progress.
//! * `model_status` / `watch_model_status`: the host's copy in its memory tier and its GPU
//!   loads; the watch pushes on every change and, while bytes move, every
//!   `progress_period`.

use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::stream::BoxStream;
use shardcast_controller::agents::{
    AgentAt, Agents, Evict, Import, Imported, Load, ModelReport, StartChain, TierReport,
};
use shardcast_controller::error::{AgentError, AgentFailure};
use shardcast_controller::inventory::{GpuInfo, GpuLoad, Holding, HostView};
use shardcast_controller::plan::GpuState;
use shardcast_protocol::DataTier;
use shardcast_protocol::codec::encode_to_vec;
use tokio::sync::{Notify, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::models::{Phases, SimModel};
use super::net::{Endpoint, FlowId, FlowSpec, Network, Reached, Topology};

/// How often a watch pushes progress while bytes move: well inside the controller's
/// default 10 s stall timeout (a receiver whose pushed bytes do not grow for that long is
/// re-planned), and seldom enough that the pushes of 200 receivers cost the plan runner
/// one round every 2 s on top of its own 250 ms tick.
pub const PROGRESS_PERIOD: Duration = Duration::from_secs(2);

/// What the simulated hosts are like.
#[derive(Debug, Clone)]
pub struct DcConfig {
    /// The network.
    pub topology: Topology,
    /// GPUs per host.
    pub gpus_per_host: u32,
    /// Each GPU's memory, bytes.
    pub gpu_memory: u64,
    /// Each host's memory tier, bytes.
    pub host_memory: u64,
    /// Load and host-to-GPU rates.
    pub phases: Phases,
    /// Manifest chunk size, bytes.
    pub chunk_size: u32,
    /// The most one host-to-host hop moves, bytes/s (a chain hop's CPU limit; `None`: the
    /// links only).
    pub hop_cap_bps: Option<f64>,
    /// How often a watch pushes progress while bytes move.
    pub progress_period: Duration,
}

/// When a host's copy and GPU replica of a model were ready, seconds on the datacenter's
/// clock.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HostReady {
    /// Host id.
    pub host: String,
    /// The copy was complete in host memory.
    pub copy_s: Option<f64>,
    /// The GPU load was asked for.
    pub load_asked_s: Option<f64>,
    /// The GPU replica was resident.
    pub gpu_s: Option<f64>,
    /// Where its bytes came from: `origin` or the sending host.
    pub source: String,
}

/// A catalogued model, by digest.
#[derive(Debug, Clone)]
struct Catalogued {
    model: SimModel,
    manifest: Vec<u8>,
    shard_sizes: Vec<u64>,
}

/// A chain (or direct download) in flight: one flow.
#[derive(Debug)]
struct Delivery {
    digest: String,
    /// Receivers in order: receiver `j` completes at milestone `j`.
    receivers: Vec<usize>,
    shards: Vec<u32>,
    /// Told when the flow ends (an `import_model` with `fetch` waits on it).
    waiters: Vec<oneshot::Sender<()>>,
}

/// Bytes on their way to a host's copy.
#[derive(Debug, Clone)]
struct Incoming {
    flow: FlowId,
    /// The head's progress at which this host's first byte lands (`j * chunk`).
    lag: f64,
    /// Bytes the flow carries to it.
    bytes: f64,
}

/// A host's copy of a model in its memory tier.
#[derive(Debug, Clone, Default)]
struct Copy {
    shards_done: Vec<bool>,
    incoming: Vec<Incoming>,
    complete_at: Option<f64>,
    source: String,
}

/// A host's GPU load of a model.
#[derive(Debug, Clone)]
struct GpuLoadSim {
    count: u32,
    asked_at: f64,
    /// (start, end) once the copy is complete.
    window: Option<(f64, f64)>,
    resident: bool,
}

#[derive(Debug)]
struct SimHost {
    id: String,
    copies: BTreeMap<String, Copy>,
    gpus: BTreeMap<String, GpuLoadSim>,
    changed: watch::Sender<u64>,
}

/// A GPU load that ends at a time (a min-heap by time, then host, then digest).
#[derive(Debug, Clone, PartialEq)]
struct GpuDue {
    at: f64,
    host: usize,
    digest: String,
}

impl Eq for GpuDue {}

impl Ord for GpuDue {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .at
            .total_cmp(&self.at)
            .then_with(|| other.host.cmp(&self.host))
            .then_with(|| other.digest.cmp(&self.digest))
    }
}

impl PartialOrd for GpuDue {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

struct Dc {
    cfg: DcConfig,
    net: Network,
    hosts: Vec<SimHost>,
    index: HashMap<String, usize>,
    catalogue: HashMap<String, Catalogued>,
    by_name: HashMap<String, String>,
    deliveries: HashMap<FlowId, Delivery>,
    sessions: HashSet<String>,
    gpu_due: BinaryHeap<GpuDue>,
    ready: BTreeMap<(String, usize), HostReady>,
}

/// The simulated datacenter. Cheap to share (`Arc`); every method locks it briefly and
/// never across an await.
pub struct Datacenter {
    inner: Mutex<Dc>,
    wake: Notify,
    epoch: tokio::time::Instant,
}

/// Host `i`'s id.
pub fn host_id(i: usize) -> String {
    format!("h{i:04}")
}

impl Datacenter {
    /// A datacenter of `cfg.topology.hosts` idle hosts knowing `models`, its clock at 0 now.
    pub fn new(cfg: DcConfig, models: &[SimModel]) -> Result<Arc<Self>, String> {
        let mut catalogue = HashMap::new();
        let mut by_name = HashMap::new();
        for m in models {
            let manifest = m.manifest(cfg.chunk_size)?;
            let digest = manifest.digest().to_hex();
            by_name.insert(m.name.to_string(), digest.clone());
            catalogue.insert(
                digest,
                Catalogued {
                    model: m.clone(),
                    manifest: encode_to_vec(&manifest),
                    shard_sizes: m.shard_sizes(),
                },
            );
        }
        let hosts: Vec<SimHost> = (0..cfg.topology.hosts)
            .map(|i| SimHost {
                id: host_id(i),
                copies: BTreeMap::new(),
                gpus: BTreeMap::new(),
                changed: watch::Sender::new(0),
            })
            .collect();
        let index = hosts
            .iter()
            .enumerate()
            .map(|(i, h)| (h.id.clone(), i))
            .collect();
        Ok(Arc::new(Self {
            inner: Mutex::new(Dc {
                net: Network::new(cfg.topology.clone()),
                cfg,
                hosts,
                index,
                catalogue,
                by_name,
                deliveries: HashMap::new(),
                sessions: HashSet::new(),
                gpu_due: BinaryHeap::new(),
                ready: BTreeMap::new(),
            }),
            wake: Notify::new(),
            epoch: tokio::time::Instant::now(),
        }))
    }

    /// Seconds since the datacenter was made, on the tokio clock.
    pub fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Dc> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The datacenter synced to now.
    fn synced(&self) -> std::sync::MutexGuard<'_, Dc> {
        let now = self.now();
        let mut dc = self.lock();
        dc.sync(now);
        dc
    }

    /// The digest of a catalogued model.
    pub fn digest_of(&self, name: &str) -> Option<String> {
        self.lock().by_name.get(name).cloned()
    }

    /// Bytes that have left the origin.
    pub fn origin_bytes(&self) -> f64 {
        self.synced().net.origin_bytes()
    }

    /// When each host's copy and GPU replica of `digest` were ready.
    pub fn ready(&self, digest: &str) -> Vec<HostReady> {
        self.synced()
            .ready
            .iter()
            .filter(|((d, _), _)| d == digest)
            .map(|(_, r)| r.clone())
            .collect()
    }

    /// Puts a complete copy of a catalogued model in host `h`'s memory tier now, as if an
    /// earlier plan had left it there (a warm holder: the thesis' locality).
    pub fn seed(&self, h: usize, name: &str) -> Result<(), String> {
        let now = self.now();
        let mut dc = self.synced();
        let digest = dc
            .by_name
            .get(name)
            .cloned()
            .ok_or_else(|| format!("{name} is not catalogued"))?;
        let shards = dc.catalogue[&digest].shard_sizes.len();
        let host = dc.hosts.get_mut(h).ok_or_else(|| format!("no host {h}"))?;
        host.copies.insert(
            digest,
            Copy {
                shards_done: vec![true; shards],
                incoming: Vec::new(),
                complete_at: Some(now),
                source: "local".into(),
            },
        );
        host.changed.send_modify(|v| *v += 1);
        Ok(())
    }

    /// Every host's report, as its transferd would heartbeat it.
    pub fn host_views(&self) -> Vec<HostView> {
        let dc = self.synced();
        (0..dc.hosts.len()).map(|i| dc.host_view(i)).collect()
    }

    /// Keeps the paused clock stopping at every milestone and GPU event until `cancel`.
    pub async fn drive(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            let next = self.synced().next_event();
            let sleep = async {
                match next {
                    Some(t) => {
                        // Strictly after now: an event a fraction of a nanosecond ahead
                        // (float rounding) must still move the clock, not wake at once
                        // and find nothing to do, forever.
                        let at = (self.epoch + Duration::from_secs_f64(t.max(0.0)))
                            .max(tokio::time::Instant::now() + Duration::from_nanos(1));
                        tokio::time::sleep_until(at).await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = sleep => {}
            }
        }
    }

    /// Sleeps until the next multiple of `period` on the datacenter's clock: every watch
    /// pushes its progress at the same instants, so the plan runner wakes once per period
    /// for all of them instead of once per receiver.
    async fn sleep_to_grid(&self, period: Duration) {
        let p = period.as_secs_f64().max(1e-3);
        let next = ((self.now() / p).floor() + 1.0) * p;
        tokio::time::sleep_until(self.epoch + Duration::from_secs_f64(next)).await;
    }

    fn host(&self, at: &AgentAt) -> Result<usize, AgentError> {
        self.lock()
            .index
            .get(&at.host)
            .copied()
            .ok_or_else(|| AgentError::unreachable(&at.host, "no such simulated host"))
    }
}

fn agent_error(host: &str, failure: AgentFailure, message: impl Into<String>) -> AgentError {
    AgentError {
        host: host.to_string(),
        failure,
        message: message.into(),
    }
}

impl Dc {
    /// Advances the network and the GPU loads to `now`, applying every event in order.
    fn sync(&mut self, now: f64) {
        let reached = self.net.advance(now);
        self.apply(reached);
        self.finish_gpu_loads(now);
    }

    fn apply(&mut self, reached: Vec<Reached>) {
        for r in reached {
            let Some(d) = self.deliveries.get(&r.flow) else {
                continue;
            };
            let (digest, shards) = (d.digest.clone(), d.shards.clone());
            if let Some(&h) = d.receivers.get(r.milestone) {
                self.copy_arrived(h, &digest, r.flow, &shards, r.at);
            }
            if r.ended
                && let Some(d) = self.deliveries.remove(&r.flow)
            {
                for w in d.waiters {
                    let _ = w.send(());
                }
            }
        }
    }

    /// The bytes of `flow` are all on host `h` at `at`.
    fn copy_arrived(&mut self, h: usize, digest: &str, flow: FlowId, shards: &[u32], at: f64) {
        let startup = match self.catalogue.get(digest) {
            Some(c) => self.cfg.phases.startup_s(c.model.bytes),
            None => return,
        };
        let host = &mut self.hosts[h];
        let Some(copy) = host.copies.get_mut(digest) else {
            return;
        };
        copy.incoming.retain(|i| i.flow != flow);
        for &s in shards {
            if let Some(done) = copy.shards_done.get_mut(s as usize) {
                *done = true;
            }
        }
        if copy.complete_at.is_none() && copy.shards_done.iter().all(|d| *d) {
            copy.complete_at = Some(at);
            if let Some(r) = self.ready.get_mut(&(digest.to_string(), h)) {
                r.copy_s = Some(at);
            }
            if let Some(g) = host.gpus.get_mut(digest)
                && g.window.is_none()
            {
                let start = at.max(g.asked_at);
                g.window = Some((start, start + startup));
                self.gpu_due.push(GpuDue {
                    at: start + startup,
                    host: h,
                    digest: digest.to_string(),
                });
            }
        }
        host.changed.send_modify(|v| *v += 1);
    }

    fn finish_gpu_loads(&mut self, now: f64) {
        while self.gpu_due.peek().is_some_and(|d| d.at <= now) {
            let Some(due) = self.gpu_due.pop() else {
                break;
            };
            let host = &mut self.hosts[due.host];
            if let Some(g) = host.gpus.get_mut(&due.digest)
                && !g.resident
            {
                g.resident = true;
                if let Some(r) = self.ready.get_mut(&(due.digest.clone(), due.host)) {
                    r.gpu_s = Some(due.at);
                }
                host.changed.send_modify(|v| *v += 1);
            }
        }
    }

    fn next_event(&self) -> Option<f64> {
        let gpu = self.gpu_due.peek().map(|d| d.at);
        match (self.net.next_event(), gpu) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Verified bytes of host `h`'s copy of `digest` now.
    fn verified(&self, h: usize, digest: &str) -> u64 {
        let (Some(c), Some(cat)) = (self.hosts[h].copies.get(digest), self.catalogue.get(digest))
        else {
            return 0;
        };
        let done: u64 = c
            .shards_done
            .iter()
            .zip(&cat.shard_sizes)
            .filter(|(d, _)| **d)
            .map(|(_, s)| *s)
            .sum();
        let moving: f64 = c
            .incoming
            .iter()
            .map(|i| {
                let p = self.net.progress(i.flow).unwrap_or(0.0);
                (p - i.lag).clamp(0.0, i.bytes)
            })
            .sum();
        (done + moving as u64).min(cat.model.bytes)
    }

    /// The GPU state names and bytes of host `h`'s load of `digest` now.
    fn gpu_report(&self, h: usize, digest: &str, now: f64) -> Vec<(String, u64)> {
        let (Some(g), Some(cat)) = (self.hosts[h].gpus.get(digest), self.catalogue.get(digest))
        else {
            return Vec::new();
        };
        let bytes = cat.model.bytes;
        let (state, loaded) = match (g.resident, g.window) {
            (true, _) => (GpuState::Resident, bytes),
            (false, Some((start, end))) if end > start => {
                let f = ((now - start) / (end - start)).clamp(0.0, 1.0);
                (GpuState::Loading, (bytes as f64 * f) as u64)
            }
            _ => (GpuState::Loading, 0),
        };
        vec![(state.to_string(), loaded); g.count.max(1) as usize]
    }

    fn report(&self, h: usize, digest: &str, now: f64) -> Option<ModelReport> {
        let c = self.hosts[h].copies.get(digest)?;
        Some(ModelReport {
            tiers: vec![TierReport {
                tier: DataTier::Memory,
                bytes_verified: self.verified(h, digest),
                complete: c.complete_at.is_some(),
                gpus: self.gpu_report(h, digest, now),
            }],
            store_failures: Vec::new(),
        })
    }

    /// Bytes still move into host `h`'s copy of `digest`, or onto its GPUs.
    fn moving(&self, h: usize, digest: &str) -> bool {
        let host = &self.hosts[h];
        host.copies
            .get(digest)
            .is_some_and(|c| !c.incoming.is_empty())
            || host
                .gpus
                .get(digest)
                .is_some_and(|g| g.window.is_some() && !g.resident)
    }

    fn host_view(&self, h: usize) -> HostView {
        let host = &self.hosts[h];
        let topo = self.net.topology();
        let mut used = 0u64;
        let holdings = host
            .copies
            .iter()
            .filter_map(|(digest, c)| {
                let cat = self.catalogue.get(digest)?;
                used += cat.model.bytes;
                Some(Holding {
                    digest: digest.clone(),
                    name: cat.model.name.to_string(),
                    tier: DataTier::Memory,
                    complete: c.complete_at.is_some(),
                    bytes_verified: self.verified(h, digest),
                    total_bytes: cat.model.bytes,
                })
            })
            .collect();
        let gpu_loads = host
            .gpus
            .iter()
            .map(|(digest, g)| GpuLoad {
                digest: digest.clone(),
                state: if g.resident {
                    GpuState::Resident
                } else {
                    GpuState::Loading
                },
                gpus: (0..g.count).collect(),
                partition: String::new(),
                error: String::new(),
            })
            .collect();
        let n = self.cfg.gpus_per_host;
        HostView {
            host_id: host.id.clone(),
            data_addr: format!("sim:{}:data", host.id),
            agent_addr: format!("sim:{}:agent", host.id),
            zone: "dc-0".into(),
            rack: format!("leaf-{:02}", topo.leaf_of(h)),
            nic_bps: topo.host_link_bps as u64,
            mem_capacity: self.cfg.host_memory,
            mem_free: self.cfg.host_memory.saturating_sub(used),
            disk_capacity: 0,
            disk_free: 0,
            // No NVLink in the thesis' hosts (and placement does not look at it).
            gpus: (0..n)
                .map(|i| GpuInfo {
                    index: i,
                    memory_bytes: self.cfg.gpu_memory,
                    pcie_switch: String::new(),
                    nvlink_peers: Vec::new(),
                })
                .collect(),
            holdings,
            version: "simulated".into(),
            gpus_busy: 0,
            gpu_loads,
            gpu_evicted: Vec::new(),
            bound_names: Vec::new(),
            started_at_ms: 0,
            // A simulated host does not drain (yet: rolling upgrades are not simulated).
            draining: false,
        }
    }

    /// Starts a flow from `source` through `receivers` carrying `shards` of `digest`.
    fn start_delivery(
        &mut self,
        now: f64,
        digest: &str,
        source: Endpoint,
        receivers: Vec<usize>,
        shards: Vec<u32>,
    ) -> Result<FlowId, String> {
        let cat = self
            .catalogue
            .get(digest)
            .ok_or_else(|| format!("model {digest} is not catalogued"))?;
        let shard_sizes = cat.shard_sizes.clone();
        let shards: Vec<u32> = if shards.is_empty() {
            (0..shard_sizes.len() as u32).collect()
        } else {
            shards
        };
        let bytes: f64 = shards
            .iter()
            .filter_map(|&s| shard_sizes.get(s as usize))
            .map(|&b| b as f64)
            .sum();
        if bytes <= 0.0 || receivers.is_empty() {
            return Err("nothing to send".into());
        }
        let chunk = f64::from(self.cfg.chunk_size);
        let mut segments = Vec::with_capacity(receivers.len());
        let mut from = source;
        for &r in &receivers {
            segments.push((from, Endpoint::Host(r)));
            from = Endpoint::Host(r);
        }
        let milestones: Vec<f64> = (0..receivers.len())
            .map(|j| bytes + j as f64 * chunk)
            .collect();
        let cap = match source {
            Endpoint::Origin if receivers.len() == 1 => None,
            _ => self.cfg.hop_cap_bps,
        };
        let (flow, reached) = self
            .net
            .add_flow(
                now,
                FlowSpec {
                    segments,
                    cap_bps: cap,
                    milestones,
                },
            )
            .map_err(|e| e.to_string())?;
        self.apply(reached);
        let source_name = match source {
            Endpoint::Origin => "origin".to_string(),
            Endpoint::Host(h) => self.hosts[h].id.clone(),
        };
        for (j, &r) in receivers.iter().enumerate() {
            let id = self.hosts[r].id.clone();
            let copy = self.hosts[r]
                .copies
                .entry(digest.to_string())
                .or_insert_with(|| Copy {
                    shards_done: vec![false; shard_sizes.len()],
                    ..Copy::default()
                });
            copy.incoming.push(Incoming {
                flow,
                lag: j as f64 * chunk,
                bytes,
            });
            if copy.source.is_empty() {
                copy.source = source_name.clone();
            }
            self.ready
                .entry((digest.to_string(), r))
                .or_insert_with(|| HostReady {
                    host: id,
                    copy_s: None,
                    load_asked_s: None,
                    gpu_s: None,
                    source: source_name.clone(),
                });
            self.hosts[r].changed.send_modify(|v| *v += 1);
        }
        self.deliveries.insert(
            flow,
            Delivery {
                digest: digest.to_string(),
                receivers,
                shards,
                waiters: Vec::new(),
            },
        );
        Ok(flow)
    }
}

/// The agent port of the simulated hosts.
pub struct SimAgents {
    dc: Arc<Datacenter>,
}

impl SimAgents {
    /// The agents of `dc`'s hosts.
    pub fn new(dc: Arc<Datacenter>) -> Self {
        Self { dc }
    }
}

#[async_trait::async_trait]
impl Agents for SimAgents {
    async fn start_chain(&self, at: &AgentAt, chain: StartChain) -> Result<(), AgentError> {
        let head = self.dc.host(at)?;
        let now = self.dc.now();
        let mut dc = self.dc.synced();
        if !dc.sessions.insert(chain.session.clone()) {
            return Ok(());
        }
        let mut hops = Vec::with_capacity(chain.hops.len());
        for hop in &chain.hops {
            let i = dc.index.get(&hop.host).copied().ok_or_else(|| {
                agent_error(
                    &at.host,
                    AgentFailure::Invalid,
                    format!("unknown hop {}", hop.host),
                )
            })?;
            hops.push(i);
        }
        let holds = dc.hosts[head]
            .copies
            .get(&chain.model)
            .is_some_and(|c| c.complete_at.is_some());
        let (source, receivers) = if holds {
            (Endpoint::Host(head), hops)
        } else {
            (
                Endpoint::Origin,
                std::iter::once(head).chain(hops).collect(),
            )
        };
        dc.start_delivery(now, &chain.model, source, receivers, chain.shards)
            .map_err(|e| agent_error(&at.host, AgentFailure::Invalid, e))?;
        drop(dc);
        self.dc.wake.notify_one();
        Ok(())
    }

    async fn import_model(&self, at: &AgentAt, import: Import) -> Result<Imported, AgentError> {
        // Only the name and whether to fetch matter here; the rest (the manifest the
        // controller sends, 350 kB for T5-3B) is dropped now, not held for the download.
        let Import {
            name,
            fetch,
            manifest,
            ..
        } = import;
        drop(manifest);
        let h = self.dc.host(at)?;
        let digest = self.dc.lock().by_name.get(&name).cloned().ok_or_else(|| {
            agent_error(
                &at.host,
                AgentFailure::NotFound,
                format!("{name} is not in the simulator's catalogue"),
            )
        })?;
        if fetch {
            let (tx, rx) = oneshot::channel();
            {
                let now = self.dc.now();
                let mut dc = self.dc.synced();
                let flow = dc
                    .start_delivery(now, &digest, Endpoint::Origin, vec![h], Vec::new())
                    .map_err(|e| agent_error(&at.host, AgentFailure::Failed, e))?;
                if let Some(d) = dc.deliveries.get_mut(&flow) {
                    d.waiters.push(tx);
                }
            }
            self.dc.wake.notify_one();
            rx.await.map_err(|_| {
                agent_error(&at.host, AgentFailure::Failed, "the download was dropped")
            })?;
        }
        // Copied only now: 200 downloads in flight need not hold 200 manifests.
        let manifest = self.dc.lock().catalogue[&digest].manifest.clone();
        Ok(Imported {
            digest,
            manifest,
            kept: false,
            resolved_origin: String::new(),
        })
    }

    async fn model_status(
        &self,
        at: &AgentAt,
        model: &str,
    ) -> Result<Option<ModelReport>, AgentError> {
        let h = self.dc.host(at)?;
        let now = self.dc.now();
        Ok(self.dc.synced().report(h, model, now))
    }

    async fn watch_model_status(
        &self,
        at: &AgentAt,
        model: &str,
    ) -> Result<BoxStream<'static, ModelReport>, AgentError> {
        let h = self.dc.host(at)?;
        let rx = self.dc.lock().hosts[h].changed.subscribe();
        let period = self.dc.lock().cfg.progress_period;
        let state = (self.dc.clone(), rx, None::<ModelReport>, model.to_string());
        let stream = futures::stream::unfold(state, move |(dc, mut rx, last, model)| async move {
            loop {
                let now = dc.now();
                let (report, moving) = {
                    let d = dc.synced();
                    (d.report(h, &model, now), d.moving(h, &model))
                };
                rx.borrow_and_update();
                if let Some(r) = report
                    && last.as_ref() != Some(&r)
                {
                    return Some((r.clone(), (dc, rx, Some(r), model)));
                }
                if moving {
                    tokio::select! {
                        c = rx.changed() => if c.is_err() { return None },
                        _ = dc.sleep_to_grid(period) => {}
                    }
                } else if rx.changed().await.is_err() {
                    return None;
                }
            }
        });
        Ok(Box::pin(stream))
    }

    async fn load_model(&self, at: &AgentAt, load: Load) -> Result<(), AgentError> {
        let h = self.dc.host(at)?;
        let now = self.dc.now();
        let mut dc = self.dc.synced();
        let startup = match dc.catalogue.get(&load.model) {
            Some(c) => dc.cfg.phases.startup_s(c.model.bytes),
            None => {
                return Err(agent_error(
                    &at.host,
                    AgentFailure::NotFound,
                    "model not catalogued",
                ));
            }
        };
        let Some(complete_at) = dc.hosts[h].copies.get(&load.model).map(|c| c.complete_at) else {
            return Err(agent_error(
                &at.host,
                AgentFailure::NotFound,
                "the host does not know the model yet",
            ));
        };
        if dc.hosts[h].gpus.contains_key(&load.model) {
            return Ok(());
        }
        let window = complete_at.map(|c| {
            let start = c.max(now);
            (start, start + startup)
        });
        dc.hosts[h].gpus.insert(
            load.model.clone(),
            GpuLoadSim {
                count: load.count,
                asked_at: now,
                window,
                resident: false,
            },
        );
        if let Some((_, end)) = window {
            dc.gpu_due.push(GpuDue {
                at: end,
                host: h,
                digest: load.model.clone(),
            });
        }
        let (id, source, copy_s) = {
            let host = &dc.hosts[h];
            let c = host.copies.get(&load.model);
            (
                host.id.clone(),
                c.map(|c| c.source.clone()).unwrap_or_default(),
                c.and_then(|c| c.complete_at),
            )
        };
        let r = dc
            .ready
            .entry((load.model.clone(), h))
            .or_insert_with(|| HostReady {
                host: id,
                copy_s,
                load_asked_s: None,
                gpu_s: None,
                source,
            });
        r.load_asked_s = Some(now);
        dc.hosts[h].changed.send_modify(|v| *v += 1);
        drop(dc);
        self.dc.wake.notify_one();
        Ok(())
    }

    async fn evict_model(&self, at: &AgentAt, evict: Evict) -> Result<u64, AgentError> {
        let h = self.dc.host(at)?;
        let mut dc = self.dc.synced();
        let bytes = dc
            .catalogue
            .get(&evict.model)
            .map(|c| c.model.bytes)
            .unwrap_or(0);
        let host = &mut dc.hosts[h];
        let had = host.copies.remove(&evict.model).is_some();
        host.gpus.remove(&evict.model);
        host.changed.send_modify(|v| *v += 1);
        Ok(if had { bytes } else { 0 })
    }

    async fn handoff(&self, at: &AgentAt, model: &str) -> Result<String, AgentError> {
        let h = self.dc.host(at)?;
        let dc = self.dc.lock();
        match dc.hosts[h].gpus.get(model) {
            Some(g) if g.resident => Ok(format!("{{\"model\":\"{model}\",\"simulated\":true}}")),
            _ => Err(agent_error(
                &at.host,
                AgentFailure::Precondition,
                "no resident GPU replica",
            )),
        }
    }
}
