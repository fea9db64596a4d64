//! The simulated datacenter behind the controller's agent port: every host's copies and GPU
//! loads, and the flow-level network ([`super::net`]) that moves the bytes.
//! [`super::agents::SimAgents`], the controller's agent port, acts on it.
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
//!   grow linearly meanwhile, so the plan runner's stall clock sees progress. Each call is
//!   one more load of `count` GPUs (a later scale-out adds GPUs on a host that already
//!   serves the model); each load is one replica group with its own times.
//! * A GPU replica leaves when the trace-driven run ([`super::serve`]) unloads it, after
//!   the controller released its slots (the controller's GPU evict only books; the host's
//!   serving runtime stops the replica).
//! * `model_status` / `watch_model_status`: the host's copy in its memory tier and its GPU
//!   loads; the watch pushes on every change and, while bytes move, every
//!   `progress_period`.

use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use shardcast_controller::agents::AgentAt;
use shardcast_controller::error::{AgentError, AgentFailure};
use shardcast_controller::inventory::HostView;
use shardcast_protocol::codec::encode_to_vec;
use tokio::sync::{Notify, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::models::{ManifestError, Phases, SimModel};
use super::net::{Endpoint, FlowId, FlowSpec, NetError, Network, Reached, Topology};

/// Why [`Datacenter::seed`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SeedError {
    /// No model of that name in the datacenter's catalogue.
    #[error("{0} is not catalogued")]
    NotCatalogued(String),
    /// No host with that index.
    #[error("no host {0}")]
    NoSuchHost(usize),
}

/// Why a delivery (a chain or a download: one flow) could not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FlowError {
    /// No model with that digest in the catalogue.
    #[error("model {0} is not catalogued")]
    NotCatalogued(String),
    /// No receivers, or shards that hold no bytes.
    #[error("nothing to send")]
    NothingToSend,
    /// The network refused the flow (no path, a bad segment).
    #[error(transparent)]
    Net(#[from] NetError),
}

/// How far receiver `j` of a delivery (0: the first, fed by the source) lags the source's
/// progress, in bytes of the flow's progress: receiver `j` holds the whole model once the
/// source has pushed `bytes + pipeline_lag(…, j)`.
///
/// * **One chunk a hop.** A hop forwards a chunk only once it has received and verified
///   all of it, so hop `j` is `j` chunks behind the first receiver.
/// * **The head's origin reads.** A head that fills from the origin reads
///   `origin_parallel` chunks at once (transferd's `origin_parallel`, 8 by default), each
///   at a share of the rate, and forwards a chunk once it is complete: the last
///   `origin_parallel` chunks complete together at the end, so the first hop below the
///   head is `origin_parallel` chunks behind it, not one. Measured on the emulated 8-host
///   chain (docs/BENCHMARKS.md): hop 1 ends 6.5–7 chunk-times after the head, each later
///   hop ≈ 1.2 after the one above.
///
/// Not modelled: the shards of a model travel as parallel sessions (one per shard, each its
/// own connection), which share the links unevenly — the emulated 4-shard burst's head
/// finished forwarding its shards up to a second apart — so a many-shard chain is treated
/// as one session.
pub fn pipeline_lag(chunk: f64, j: usize, from_origin: bool, origin_parallel: u32) -> f64 {
    let fill = if from_origin && j > 0 {
        f64::from(origin_parallel.max(1)) - 1.0
    } else {
        0.0
    };
    (j as f64 + fill) * chunk
}

/// Bytes that reached the hosts, by where they came from; cumulative.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct TierBytes {
    /// Received into host memory straight from the origin (a chain's head or a direct
    /// download).
    pub origin: f64,
    /// Received into host memory from another host (a chain's later hops, or a chain
    /// headed by a holder).
    pub peer: f64,
    /// Loaded onto GPUs from a copy that was already complete in the host's memory when
    /// the load was asked (no network bytes): the model's bytes times the GPU replicas,
    /// counted when they became resident.
    pub local: f64,
}

impl TierBytes {
    /// `self - before`, tier by tier.
    pub fn since(self, before: Self) -> Self {
        Self {
            origin: self.origin - before.origin,
            peer: self.peer - before.peer,
            local: self.local - before.local,
        }
    }
}

/// How often a watch pushes progress while bytes move: well inside the controller's
/// default 10 s stall timeout (a receiver whose pushed bytes do not grow for that long is
/// re-planned), and seldom enough that the pushes of 200 receivers cost the plan runner
/// one round every 2 s on top of its own 250 ms tick.
pub const PROGRESS_PERIOD: Duration = Duration::from_secs(2);

/// transferd's default `origin_parallel`: concurrent chunk reads from an origin.
pub const ORIGIN_PARALLEL: u32 = 8;

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
    /// Chunks a head reads from the origin at once (transferd's `origin_parallel`): the
    /// first hop below a head that fills from the origin lags it by this many
    /// ([`pipeline_lag`]).
    pub origin_parallel: u32,
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
pub(super) struct Catalogued {
    pub(super) model: SimModel,
    pub(super) manifest: Vec<u8>,
    pub(super) shard_sizes: Vec<u64>,
}

/// A chain (or direct download) in flight: one flow.
#[derive(Debug)]
pub(super) struct Delivery {
    pub(super) digest: String,
    /// Where the bytes come from: the origin (read by the first receiver, the head) or a
    /// holder.
    pub(super) source: Endpoint,
    /// Receivers in order: receiver `j` completes at milestone `j`.
    pub(super) receivers: Vec<usize>,
    pub(super) shards: Vec<u32>,
    /// Told when the flow ends (an `import_model` with `fetch` waits on it).
    pub(super) waiters: Vec<oneshot::Sender<()>>,
    /// Bytes receiver `j` gets from this flow: the shards' bytes less what it already held (a
    /// partial copy left by a fault, [`Copy::partial`]).
    pub(super) need: Vec<f64>,
    /// A host whose copy must be complete before this flow's receivers are (a hop that
    /// feeds them while it still receives itself: a failover or a pull from a holder
    /// above that is still being filled, [`super::recovery`]); `None`: the source holds
    /// everything.
    pub(super) gate: Option<usize>,
    /// Receiver `j` lags the head by `lags[j]` bytes of progress ([`pipeline_lag`]).
    pub(super) lags: Vec<f64>,
    /// The head reads the origin (receiver 0's bytes are origin bytes).
    pub(super) from_origin: bool,
    /// Receivers whose copy is complete (milestones applied; they are reached in order).
    pub(super) reached: usize,
    /// The partitioned GPU load (its id) this fetch feeds ([`super::parts`]): its one
    /// receiver holds some bytes of the model, not whole shards.
    pub(super) part: Option<u64>,
}

/// Bytes on their way to a host's copy.
#[derive(Debug, Clone)]
pub(super) struct Incoming {
    pub(super) flow: FlowId,
    /// How far this host lags the head, bytes of the flow's progress ([`pipeline_lag`]).
    pub(super) lag: f64,
    /// Bytes the flow carries to it.
    pub(super) bytes: f64,
}

/// A host's copy of a model in its memory tier.
#[derive(Debug, Clone, Default)]
pub(super) struct Copy {
    pub(super) shards_done: Vec<bool>,
    pub(super) incoming: Vec<Incoming>,
    pub(super) complete_at: Option<f64>,
    pub(super) source: String,
    /// Bytes held outside whole shards: a partitioned load's part ([`super::parts`]).
    pub(super) partial_bytes: u64,
    /// Bytes of the copy held from flows that a fault stopped ([`super::recovery`]): a
    /// later flow brings only the rest.
    pub(super) partial: f64,
}

/// A host's GPU load of a model: `count` GPU replicas loaded together.
#[derive(Debug, Clone)]
pub(super) struct GpuLoadSim {
    /// Unique in the datacenter.
    pub(super) id: u64,
    pub(super) count: u32,
    pub(super) asked_at: f64,
    /// When the scale-out that made it was asked for (the cold start's start), else
    /// `asked_at`.
    pub(super) requested_at: f64,
    /// (start, end) once the copy is complete.
    pub(super) window: Option<(f64, f64)>,
    pub(super) resident: bool,
    /// Where its bytes came from: `local` when the host's copy was complete when the load
    /// was asked (a cold start from host memory), else where the copy came from.
    pub(super) source: String,
    /// A partitioned load ([`super::parts`]): its partition first, then (with completion)
    /// the rest; `window` is then the rest's load.
    pub(super) part: Option<super::parts::PartLoad>,
}

#[derive(Debug)]
pub(super) struct SimHost {
    pub(super) id: String,
    pub(super) copies: BTreeMap<String, Copy>,
    pub(super) gpus: BTreeMap<String, Vec<GpuLoadSim>>,
    /// Scale-out request times not yet matched by a GPU load, per model (oldest first).
    pub(super) expected: HashMap<String, VecDeque<f64>>,
    pub(super) changed: watch::Sender<u64>,
}

/// A GPU load that ends at a time (a min-heap by time, then host, then load id).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct GpuDue {
    pub(super) at: f64,
    pub(super) host: usize,
    pub(super) digest: String,
    pub(super) id: u64,
    /// A partitioned load's partition goes live (else: the load becomes resident).
    pub(super) live: bool,
}

/// A GPU replica group as the serving side sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaGroup {
    /// The load's id (unique in the datacenter).
    pub id: u64,
    /// Host index.
    pub host: usize,
    /// GPU replicas in the group.
    pub count: u32,
    /// When the scale-out that made it was asked for.
    pub requested_at: f64,
    /// When it became resident (serving), if it has.
    pub resident_at: Option<f64>,
    /// Where its bytes came from: `local` (host memory), `origin` or the sending host.
    pub source: String,
    /// A partitioned load's label (`r.k/p`, as the controller's burst names it); empty for
    /// a whole replica.
    pub partition: String,
    /// When its partition went live (serving as one stage of a pipeline), if it has.
    pub live_at: Option<f64>,
}

impl Eq for GpuDue {}

impl Ord for GpuDue {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .at
            .total_cmp(&self.at)
            .then_with(|| other.host.cmp(&self.host))
            .then_with(|| other.id.cmp(&self.id))
    }
}

impl PartialOrd for GpuDue {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

pub(super) struct Dc {
    pub(super) cfg: DcConfig,
    pub(super) net: Network,
    pub(super) hosts: Vec<SimHost>,
    pub(super) index: HashMap<String, usize>,
    pub(super) catalogue: HashMap<String, Catalogued>,
    pub(super) by_name: HashMap<String, String>,
    pub(super) deliveries: HashMap<FlowId, Delivery>,
    pub(super) sessions: HashSet<String>,
    pub(super) gpu_due: BinaryHeap<GpuDue>,
    pub(super) next_load: u64,
    pub(super) ready: BTreeMap<(String, usize), HostReady>,
    /// Tier bytes of completed copies and resident local loads.
    pub(super) settled: TierBytes,
    /// Receivers whose flow brought all their bytes before their gate's copy was complete
    /// ([`Delivery::gate`]): (host, digest, shards, gate host).
    pub(super) held: Vec<(usize, String, Vec<u32>, usize)>,
    /// Injected faults and what followed them ([`super::recovery`]).
    pub(super) faults: super::recovery::Faults,
}

/// The simulated datacenter. Cheap to share (`Arc`); every method locks it briefly and
/// never across an await.
pub struct Datacenter {
    inner: Mutex<Dc>,
    pub(super) wake: Notify,
    epoch: tokio::time::Instant,
}

/// Host `i`'s id.
pub fn host_id(i: usize) -> String {
    format!("h{i:04}")
}

impl Datacenter {
    /// A datacenter of `cfg.topology.hosts` idle hosts knowing `models`, its clock at 0 now.
    pub fn new(cfg: DcConfig, models: &[SimModel]) -> Result<Arc<Self>, ManifestError> {
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
                expected: HashMap::new(),
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
                next_load: 0,
                ready: BTreeMap::new(),
                settled: TierBytes::default(),
                held: Vec::new(),
                faults: super::recovery::Faults::default(),
            }),
            wake: Notify::new(),
            epoch: tokio::time::Instant::now(),
        }))
    }

    /// Seconds since the datacenter was made, on the tokio clock.
    pub fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Dc> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The datacenter synced to now.
    pub(super) fn synced(&self) -> std::sync::MutexGuard<'_, Dc> {
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

    /// Bytes that have reached the hosts so far, by tier ([`TierBytes`]): copies in
    /// progress count the bytes that have landed, a chain's hop `j` lagging the head by
    /// [`pipeline_lag`].
    pub fn tier_bytes(&self) -> TierBytes {
        let dc = self.synced();
        let mut t = dc.settled;
        for (flow, d) in &dc.deliveries {
            let Some(p) = dc.net.progress(*flow) else {
                continue;
            };
            for j in d.reached..d.receivers.len() {
                let got = (p - d.lags[j]).clamp(0.0, d.need[j]);
                if j == 0 && d.from_origin {
                    t.origin += got;
                } else {
                    t.peer += got;
                }
            }
        }
        t
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
    pub fn seed(&self, h: usize, name: &str) -> Result<(), SeedError> {
        let now = self.now();
        let mut dc = self.synced();
        let digest = dc
            .by_name
            .get(name)
            .cloned()
            .ok_or_else(|| SeedError::NotCatalogued(name.to_string()))?;
        let shards = dc.catalogue[&digest].shard_sizes.len();
        let host = dc.hosts.get_mut(h).ok_or(SeedError::NoSuchHost(h))?;
        host.copies.insert(
            digest,
            Copy {
                shards_done: vec![true; shards],
                incoming: Vec::new(),
                complete_at: Some(now),
                source: "local".into(),
                partial_bytes: 0,
                partial: 0.0,
            },
        );
        host.changed.send_modify(|v| *v += 1);
        Ok(())
    }

    /// Schedules `faults` at their times after `t0` (the prewarm, on this clock);
    /// `seed` picks random targets ([`super::recovery`]).
    pub fn schedule_faults(&self, t0: f64, faults: &[super::faults::FaultSpec], seed: u64) {
        self.synced().schedule_faults(t0, faults, seed);
        self.wake.notify_one();
    }

    /// The faults' events so far, and the hosts they touched (id, fault, role).
    pub fn fault_log(&self) -> super::coldstart::FaultLog {
        let dc = self.synced();
        let affected = dc
            .faults
            .affected
            .iter()
            .map(|(&h, &(fault, role))| (dc.hosts[h].id.clone(), fault, role))
            .collect();
        (dc.faults.events.clone(), affected)
    }

    /// Host `id`'s index.
    pub fn host_index(&self, id: &str) -> Option<usize> {
        self.lock().index.get(id).copied()
    }

    /// Every GPU replica group of `digest` now (resident or loading), by host then load.
    pub fn replicas(&self, digest: &str) -> Vec<ReplicaGroup> {
        let dc = self.synced();
        let mut out = Vec::new();
        for (h, host) in dc.hosts.iter().enumerate() {
            let Some(loads) = host.gpus.get(digest) else {
                continue;
            };
            for g in loads {
                out.push(ReplicaGroup {
                    id: g.id,
                    host: h,
                    count: g.count,
                    requested_at: g.requested_at,
                    resident_at: g.resident.then(|| g.window.map_or(g.asked_at, |w| w.1)),
                    source: g.source.clone(),
                    partition: g.part.as_ref().map(|p| p.label.clone()).unwrap_or_default(),
                    live_at: g.part.as_ref().and_then(|p| p.live_at),
                });
            }
        }
        out
    }

    /// A scale-out asked at `at` will load `digest` on host `h`: the GPU load that comes
    /// next there is stamped with `at` as its cold start's beginning.
    pub fn expect_load(&self, h: usize, digest: &str, at: f64) {
        if let Some(host) = self.lock().hosts.get_mut(h) {
            host.expected
                .entry(digest.to_string())
                .or_default()
                .push_back(at);
        }
    }

    /// Host `h`'s serving runtime stops every GPU replica of `digest` (the controller
    /// released their slots); the copy in host memory stays. Returns the groups stopped.
    pub fn unload_gpus(&self, h: usize, digest: &str) -> Vec<u64> {
        let mut dc = self.synced();
        let Some(host) = dc.hosts.get_mut(h) else {
            return Vec::new();
        };
        host.expected.remove(digest);
        let gone = host.gpus.remove(digest).unwrap_or_default();
        host.changed.send_modify(|v| *v += 1);
        gone.into_iter().map(|g| g.id).collect()
    }

    /// Every host's report, as its transferd would heartbeat it; a host that is down (lost,
    /// or its link is: [`super::recovery`]) sends none, and the controller's inventory
    /// notices.
    pub fn host_views(&self) -> Vec<HostView> {
        let dc = self.synced();
        (0..dc.hosts.len())
            .filter(|&i| !dc.faults.is_down(i))
            .map(|i| dc.host_view(i))
            .collect()
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
    pub(super) async fn sleep_to_grid(&self, period: Duration) {
        let p = period.as_secs_f64().max(1e-3);
        let next = ((self.now() / p).floor() + 1.0) * p;
        tokio::time::sleep_until(self.epoch + Duration::from_secs_f64(next)).await;
    }

    /// `Err(unreachable)` while host `h` is down ([`super::recovery`]).
    pub(super) fn reachable(&self, h: usize) -> Result<(), AgentError> {
        match self.synced().faults.unreachable(h) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(super) fn host(&self, at: &AgentAt) -> Result<usize, AgentError> {
        self.lock()
            .index
            .get(&at.host)
            .copied()
            .ok_or_else(|| AgentError::unreachable(&at.host, "no such simulated host"))
    }
}

impl Dc {
    /// Advances the network and the GPU loads to `now`, applying every event in order.
    pub(super) fn sync(&mut self, now: f64) {
        // Faults and the recoveries they start happen at their instants, between the
        // network's events.
        while let Some(t) = self.faults.next_due().filter(|t| *t <= now) {
            let reached = self.net.advance(t);
            self.apply(reached);
            self.finish_gpu_loads(t);
            self.run_fault_due(t);
        }
        let reached = self.net.advance(now);
        self.apply(reached);
        self.finish_gpu_loads(now);
    }

    pub(super) fn apply(&mut self, reached: Vec<Reached>) {
        for r in reached {
            let Some(d) = self.deliveries.get_mut(&r.flow) else {
                continue;
            };
            // The bytes moved whether or not the receiver still wants the copy.
            if let Some(&need) = d.need.get(r.milestone) {
                if r.milestone == 0 && d.from_origin {
                    self.settled.origin += need;
                } else {
                    self.settled.peer += need;
                }
                d.reached = d.reached.max(r.milestone + 1);
            }
            let (digest, shards, part, gate) = (d.digest.clone(), d.shards.clone(), d.part, d.gate);
            if let Some(&h) = d.receivers.get(r.milestone) {
                let gated = gate.filter(|&g| {
                    self.hosts[g]
                        .copies
                        .get(&digest)
                        .is_none_or(|c| c.complete_at.is_none())
                });
                match (part, gated) {
                    (Some(load), _) => self.part_arrived(h, &digest, r.flow, load, r.at),
                    // Every byte is here that the gate has sent so far; the rest follows
                    // as the gate receives it.
                    (None, Some(g)) => self.hold(h, &digest, r.flow, shards, g),
                    (None, None) => self.copy_arrived(h, &digest, r.flow, &shards, r.at),
                }
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

    /// Host `h` has every byte of `flow` but waits for its gate `g` ([`Delivery::gate`]).
    fn hold(&mut self, h: usize, digest: &str, flow: FlowId, shards: Vec<u32>, g: usize) {
        let Some(copy) = self.hosts[h].copies.get_mut(digest) else {
            return;
        };
        if let Some(i) = copy.incoming.iter().position(|i| i.flow == flow) {
            let inc = copy.incoming.remove(i);
            copy.partial += inc.bytes;
        }
        self.held.push((h, digest.to_string(), shards, g));
    }

    /// The bytes of `flow` are all on host `h` at `at`; the receivers held for `h`'s copy
    /// ([`Self::hold`]) complete with it.
    fn copy_arrived(&mut self, h: usize, digest: &str, flow: FlowId, shards: &[u32], at: f64) {
        let mut work = vec![(h, flow, shards.to_vec())];
        while let Some((h, flow, shards)) = work.pop() {
            if self.copy_arrived_one(h, digest, flow, &shards, at) {
                let (ready, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
                    .into_iter()
                    .partition(|(_, d, _, g)| *g == h && d == digest);
                self.held = rest;
                work.extend(ready.into_iter().map(|(r, _, s, _)| (r, flow, s)));
            }
        }
    }

    /// [`Self::copy_arrived`] for one host; whether its copy became complete.
    fn copy_arrived_one(
        &mut self,
        h: usize,
        digest: &str,
        flow: FlowId,
        shards: &[u32],
        at: f64,
    ) -> bool {
        let startup = match self.catalogue.get(digest) {
            Some(c) => self.cfg.phases.startup_s(c.model.bytes),
            None => return false,
        };
        let lost = self.faults.is_lost(h);
        let host = &mut self.hosts[h];
        let Some(copy) = host.copies.get_mut(digest) else {
            return false;
        };
        copy.incoming.retain(|i| i.flow != flow);
        for &s in shards {
            if let Some(done) = copy.shards_done.get_mut(s as usize) {
                *done = true;
            }
        }
        let mut completed = false;
        if copy.complete_at.is_none() && copy.shards_done.iter().all(|d| *d) {
            completed = true;
            copy.complete_at = Some(at);
            copy.partial = 0.0;
            if let Some(r) = self.ready.get_mut(&(digest.to_string(), h)) {
                r.copy_s = Some(at);
            }
            for g in host
                .gpus
                .get_mut(digest)
                .into_iter()
                .flatten()
                .filter(|g| g.window.is_none() && g.part.is_none() && !lost)
            {
                let start = at.max(g.asked_at);
                g.window = Some((start, start + startup));
                self.gpu_due.push(GpuDue {
                    at: start + startup,
                    host: h,
                    digest: digest.to_string(),
                    id: g.id,
                    live: false,
                });
            }
        }
        host.changed.send_modify(|v| *v += 1);
        if completed {
            self.copy_completed(h, digest, at);
        }
        completed
    }

    fn finish_gpu_loads(&mut self, now: f64) {
        while self.gpu_due.peek().is_some_and(|d| d.at <= now) {
            let Some(due) = self.gpu_due.pop() else {
                break;
            };
            if due.live {
                self.part_live(&due);
                continue;
            }
            let model_bytes = self
                .catalogue
                .get(&due.digest)
                .map_or(0.0, |c| c.model.bytes as f64);
            let host = &mut self.hosts[due.host];
            if let Some(g) = host
                .gpus
                .get_mut(&due.digest)
                .and_then(|loads| loads.iter_mut().find(|g| g.id == due.id))
                && !g.resident
            {
                g.resident = true;
                if g.source == "local" {
                    self.settled.local += model_bytes * f64::from(g.count);
                }
                if let Some(r) = self.ready.get_mut(&(due.digest.clone(), due.host))
                    && r.gpu_s.is_none()
                {
                    r.gpu_s = Some(due.at);
                }
                host.changed.send_modify(|v| *v += 1);
            }
        }
    }

    /// Host `h` loads `digest` onto `count` more GPUs, asked at `now`: the load starts when
    /// the copy is complete. Errors: the model is not catalogued, or the host does not know
    /// it yet (no chain or download has reached it).
    pub(super) fn start_gpu_load(
        &mut self,
        h: usize,
        digest: &str,
        count: u32,
        now: f64,
    ) -> Result<(), (AgentFailure, &'static str)> {
        let startup = match self.catalogue.get(digest) {
            Some(c) => self.cfg.phases.startup_s(c.model.bytes),
            None => return Err((AgentFailure::NotFound, "model not catalogued")),
        };
        let id = self.next_load;
        let host = &mut self.hosts[h];
        let Some(copy) = host.copies.get(digest) else {
            return Err((
                AgentFailure::NotFound,
                "the host does not know the model yet",
            ));
        };
        let (complete_at, source) = (copy.complete_at, copy.source.clone());
        let load_source = if complete_at.is_some() {
            "local".to_string()
        } else {
            source.clone()
        };
        self.next_load += 1;
        let requested_at = host
            .expected
            .get_mut(digest)
            .and_then(VecDeque::pop_front)
            .unwrap_or(now);
        let window = complete_at.map(|c| {
            let start = c.max(now);
            (start, start + startup)
        });
        host.gpus
            .entry(digest.to_string())
            .or_default()
            .push(GpuLoadSim {
                id,
                count,
                asked_at: now,
                requested_at,
                window,
                resident: false,
                source: load_source,
                part: None,
            });
        if let Some((_, end)) = window {
            self.gpu_due.push(GpuDue {
                at: end,
                host: h,
                digest: digest.to_string(),
                id,
                live: false,
            });
        }
        let id = host.id.clone();
        let r = self
            .ready
            .entry((digest.to_string(), h))
            .or_insert_with(|| HostReady {
                host: id,
                copy_s: complete_at,
                load_asked_s: None,
                gpu_s: None,
                source,
            });
        r.load_asked_s.get_or_insert(now);
        self.hosts[h].changed.send_modify(|v| *v += 1);
        Ok(())
    }

    /// Host `h` drops its copy of `digest` and every GPU replica of it; returns the bytes
    /// freed (0 when it held none).
    pub(super) fn evict_copy(&mut self, h: usize, digest: &str) -> u64 {
        let bytes = self
            .catalogue
            .get(digest)
            .map(|c| c.model.bytes)
            .unwrap_or(0);
        let host = &mut self.hosts[h];
        let had = host.copies.remove(digest).is_some();
        host.gpus.remove(digest);
        host.changed.send_modify(|v| *v += 1);
        if had { bytes } else { 0 }
    }

    fn next_event(&self) -> Option<f64> {
        [
            self.net.next_event(),
            self.gpu_due.peek().map(|d| d.at),
            self.faults.next_due(),
        ]
        .into_iter()
        .flatten()
        .reduce(f64::min)
    }

    /// Starts a flow from `source` through `receivers` carrying `shards` of `digest`.
    pub(super) fn start_delivery(
        &mut self,
        now: f64,
        digest: &str,
        source: Endpoint,
        receivers: Vec<usize>,
        shards: Vec<u32>,
    ) -> Result<FlowId, FlowError> {
        let cat = self
            .catalogue
            .get(digest)
            .ok_or_else(|| FlowError::NotCatalogued(digest.to_string()))?;
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
            return Err(FlowError::NothingToSend);
        }
        let chunk = f64::from(self.cfg.chunk_size);
        let from_origin = source == Endpoint::Origin;
        let lags: Vec<f64> = (0..receivers.len())
            .map(|j| pipeline_lag(chunk, j, from_origin, self.cfg.origin_parallel))
            .collect();
        // What each receiver still lacks (a fault left some with part of the model): at
        // least a byte, so that every milestone lies ahead.
        let need: Vec<f64> = receivers
            .iter()
            .map(|&r| {
                let held = self.hosts[r]
                    .copies
                    .get(digest)
                    .filter(|c| c.complete_at.is_none())
                    .map_or(0.0, |c| c.partial);
                (bytes - held).max(1.0)
            })
            .collect();
        let mut segments = Vec::with_capacity(receivers.len());
        let mut from = source;
        for &r in &receivers {
            segments.push((from, Endpoint::Host(r)));
            from = Endpoint::Host(r);
        }
        // Receiver `j` is done once it has its need and trails the one above by the
        // pipeline's lag: without partial copies, `bytes + lag_j`; a hop that already
        // trailed by its lag (its partial copy is that much smaller) is not delayed twice.
        let mut milestones: Vec<f64> = Vec::with_capacity(receivers.len());
        for (j, n) in need.iter().enumerate() {
            let m = match milestones.last() {
                None => lags[0] + n,
                Some(&above) => n.max(above + (lags[j] - lags[j - 1]).max(1.0)),
            };
            milestones.push(m);
        }
        // Each receiver's lag behind the flow's progress, once its need is known.
        let lags: Vec<f64> = milestones.iter().zip(&need).map(|(m, n)| m - n).collect();
        let cap = match source {
            Endpoint::Origin if receivers.len() == 1 => None,
            _ => self.cfg.hop_cap_bps,
        };
        let (flow, reached) = self.net.add_flow(
            now,
            FlowSpec {
                segments,
                cap_bps: cap,
                milestones,
            },
        )?;
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
                lag: lags[j],
                bytes: need[j],
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
                source,
                receivers,
                shards,
                waiters: Vec::new(),
                need,
                gate: None,
                lags,
                from_origin: source == Endpoint::Origin,
                reached: 0,
                part: None,
            },
        );
        Ok(flow)
    }
}
