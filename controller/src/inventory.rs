//! The host inventory: the last report of every transferd, whether it is up, and the GPU
//! slots the controller reserved on it. Converts to the placement crate's plain view.
//!
//! A host's report is held as a typed [`HostView`] (tiers and GPU states are enums, not
//! the wire's strings), converted from the `HostReport` message at the edge
//! (`crate::wire::host_view`, which refuses unknown names), and persisted as a versioned
//! [`StoredHost`] record; records written before it (the wire message itself) still load.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

// The tokio clock (the monotonic clock outside a paused runtime): a controller driven on a
// paused runtime (the simulator, `shardcast-bench simulate`) sees its hosts age in virtual
// time.
use tokio::time::Instant;

use serde::{Deserialize, Serialize};
use shardcast_placement::{Held, HostInfo};

use crate::plan::GpuState;

/// A host's data tiers (the GPU tier is GPU slots, not a store): the protocol's, which
/// `shardcast_protocol::Tier` converts to and from.
pub use shardcast_protocol::DataTier;

/// One GPU of a host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// Index on the host.
    pub index: u32,
    /// Memory, bytes.
    pub memory_bytes: u64,
    /// GPUs sharing a PCIe switch report the same id.
    pub pcie_switch: String,
    /// GPUs this one reaches over NVLink.
    pub nvlink_peers: Vec<u32>,
}

/// A model copy in one of the host's data tiers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    /// Manifest digest (hex).
    pub digest: String,
    /// The name the host knows it by.
    pub name: String,
    /// Which tier.
    pub tier: DataTier,
    /// Every chunk verified.
    pub complete: bool,
    /// Bytes verified.
    pub bytes_verified: u64,
    /// The model's size.
    pub total_bytes: u64,
}

/// A model on the host's GPUs, as its GPU manager reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLoad {
    /// Manifest digest (hex).
    pub digest: String,
    /// Where the load is.
    pub state: GpuState,
    /// GPUs it is on (or being loaded onto).
    pub gpus: Vec<u32>,
    /// A partitioned load's label (`1.2/4`); empty for a whole replica.
    pub partition: String,
    /// Why it failed.
    pub error: String,
}

/// A host's last report, typed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostView {
    /// Host id.
    pub host_id: String,
    /// Data-plane listener, as peers reach it.
    pub data_addr: String,
    /// Agent API, as the controller reaches it.
    pub agent_addr: String,
    /// Zone.
    pub zone: String,
    /// Rack.
    pub rack: String,
    /// NIC rate, bytes/s (0: unknown).
    pub nic_bps: u64,
    /// Memory tier capacity, bytes.
    pub mem_capacity: u64,
    /// Memory tier free, bytes.
    pub mem_free: u64,
    /// Disk tier capacity, bytes.
    pub disk_capacity: u64,
    /// Disk tier free, bytes.
    pub disk_free: u64,
    /// GPUs.
    pub gpus: Vec<GpuInfo>,
    /// Model copies in its tiers.
    pub holdings: Vec<Holding>,
    /// transferd's version.
    pub version: String,
    /// GPUs running replicas (set by the inference platform).
    pub gpus_busy: u32,
    /// Models on its GPUs.
    pub gpu_loads: Vec<GpuLoad>,
    /// Digests its GPU manager evicted to make room (recent ones).
    pub gpu_evicted: Vec<String>,
    /// Model names bound on the host.
    pub bound_names: Vec<String>,
    /// When its transferd process started (Unix ms; 0: not reported).
    #[serde(default)]
    pub started_at_ms: u64,
    /// Its transferd is draining (stopping): nothing new is placed or sourced there.
    #[serde(default)]
    pub draining: bool,
}

/// The version of [`StoredHost`] records written now.
pub const HOST_RECORD_VERSION: &str = "2";

/// A host as persisted: its last report and the GPU slots reserved on it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredHost {
    /// [`HOST_RECORD_VERSION`].
    pub version: String,
    /// Last report.
    pub host: HostView,
    /// GPU reservations per model digest.
    #[serde(default)]
    pub gpu_reserved: BTreeMap<String, u32>,
    /// Evictions asked for while the host was down ([`HostEntry::pending_evictions`]).
    #[serde(default)]
    pub pending_evictions: Vec<(String, DataTier)>,
}

impl StoredHost {
    /// The record of `e`.
    pub fn of(e: &HostEntry) -> Self {
        Self {
            version: HOST_RECORD_VERSION.into(),
            host: e.report.clone(),
            gpu_reserved: e.gpu_reserved.clone(),
            pending_evictions: e.pending_evictions.clone(),
        }
    }

    /// Reads a record of this version; `Ok(None)` for a record written before versions
    /// (the `HostReport` wire message and the reservations, read by
    /// `crate::wire::read_host_record`). A record of an unknown version is an error naming
    /// it, not a guess.
    pub fn read_versioned(bytes: &[u8]) -> Result<Option<Self>, crate::error::RecordError> {
        #[derive(Deserialize)]
        struct Version {
            version: Option<String>,
        }
        let v: Version = serde_json::from_slice(bytes)?;
        match v.version {
            Some(v) if v == HOST_RECORD_VERSION => Ok(Some(serde_json::from_slice(bytes)?)),
            Some(found) => Err(crate::error::RecordError::UnknownVersion {
                what: "host",
                found,
                reads: format!("{HOST_RECORD_VERSION:?} and unversioned ones"),
            }),
            None => Ok(None),
        }
    }
}

/// What the controller knows about one host.
#[derive(Debug, Clone)]
pub struct HostEntry {
    /// The last heartbeat's content.
    pub report: HostView,
    /// When it arrived (or when the controller started, for hosts loaded from state).
    pub last_seen: Instant,
    /// Heartbeating within the allowed window.
    pub up: bool,
    /// GPU slots reserved per model digest (tier "gpu" replicas).
    pub gpu_reserved: BTreeMap<String, u32>,
    /// When each reservation was last made (not persisted: a reservation loaded from state
    /// counts as old). A report is only taken as news about a reservation once it arrived
    /// well after it.
    pub booked_at: HashMap<String, Instant>,
    /// (digest, tier) copies an `Evict` of every holder found here while the host was down:
    /// the tier sweeper evicts them once it heartbeats again (persisted).
    pub pending_evictions: Vec<(String, DataTier)>,
}

impl HostEntry {
    /// An entry read from the state, up and seen at `now`: hosts get one heartbeat window
    /// after a controller (re)loads the state before they are marked down.
    pub fn restored(record: StoredHost, now: Instant) -> Self {
        Self {
            report: record.host,
            last_seen: now,
            up: true,
            gpu_reserved: record.gpu_reserved,
            booked_at: HashMap::new(),
            pending_evictions: record.pending_evictions,
        }
    }

    /// GPU slots reserved for all models.
    pub fn reserved_gpus(&self) -> u32 {
        self.gpu_reserved.values().sum()
    }

    /// The holding of `digest` in `tier`.
    pub fn holding(&self, digest: &str, tier: DataTier) -> Option<&Holding> {
        self.report
            .holdings
            .iter()
            .find(|h| h.digest == digest && h.tier == tier)
    }

    /// Records that the host now holds a complete copy (before its next heartbeat says so),
    /// so a plan made right after this one sees it.
    pub fn mark_complete(&mut self, digest: &str, name: &str, tier: DataTier, bytes: u64) {
        match self
            .report
            .holdings
            .iter_mut()
            .find(|h| h.digest == digest && h.tier == tier)
        {
            Some(h) => {
                h.complete = true;
                h.bytes_verified = bytes;
                h.total_bytes = bytes;
            }
            None => self.report.holdings.push(Holding {
                digest: digest.into(),
                name: name.into(),
                tier,
                complete: true,
                bytes_verified: bytes,
                total_bytes: bytes,
            }),
        }
    }

    /// Forgets a copy (after an eviction).
    pub fn forget(&mut self, digest: &str, tier: DataTier) {
        self.report
            .holdings
            .retain(|h| !(h.digest == digest && h.tier == tier));
    }

    /// What changes slowly: a heartbeat that changes this is persisted; one that only moves
    /// free space is not.
    pub fn signature(r: &HostView) -> String {
        let mut held: Vec<String> = r
            .holdings
            .iter()
            .map(|h| format!("{}:{}:{}", h.digest, h.tier, h.complete))
            .collect();
        held.sort();
        format!(
            "{}|{}|{}|{}|{}|{}|{}",
            r.data_addr,
            r.agent_addr,
            r.zone,
            r.rack,
            r.nic_bps,
            r.gpus.len(),
            held.join(",")
        )
    }
}

/// The hosts the controller knows: each one's last report, liveness, GPU reservations
/// and pending evictions, and the signature of what was last persisted for it. An owner
/// with its own lock. Lock order: the controller's plan state (`crate::core`) may be held
/// while this is locked, never the other way round; the registry (a leaf) may be locked
/// while this is held.
#[derive(Default)]
pub struct Inventory {
    table: std::sync::Mutex<HostTable>,
}

/// What [`Inventory`] guards.
#[derive(Default)]
pub struct HostTable {
    /// By host id.
    pub hosts: BTreeMap<String, HostEntry>,
    /// Signature of each host's last persisted report.
    pub(crate) persisted: HashMap<String, String>,
}

impl Inventory {
    /// The host table, locked.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, HostTable> {
        crate::lock(&self.table)
    }

    /// A copy of `host`'s entry.
    pub fn get(&self, host: &str) -> Option<HostEntry> {
        self.lock().hosts.get(host).cloned()
    }
}

impl HostTable {
    /// GPU slots reserved for `digest` on live hosts.
    pub fn gpu_reserved(&self, digest: &str) -> u32 {
        self.hosts
            .values()
            .filter(|h| h.up)
            .map(|h| h.gpu_reserved.get(digest).copied().unwrap_or(0))
            .sum()
    }
}

/// Bytes still to arrive per host and data tier, from plans in flight: capacity they will
/// use that heartbeats do not show yet.
pub type Pending = HashMap<(String, DataTier), u64>;

/// The placement view of the inventory for one model: only that model's holdings are
/// included (placement looks at nothing else), so building it is O(hosts).
pub fn cluster_view(
    hosts: &BTreeMap<String, HostEntry>,
    digest: &str,
    pending: &Pending,
) -> Vec<HostInfo> {
    hosts
        .values()
        .map(|e| {
            let r = &e.report;
            let memory = e
                .holding(digest, DataTier::Memory)
                .is_some_and(|h| h.complete);
            let disk = e
                .holding(digest, DataTier::Disk)
                .is_some_and(|h| h.complete);
            let mut holdings = HashMap::new();
            if memory || disk {
                holdings.insert(
                    digest.to_string(),
                    Held {
                        memory,
                        disk,
                        ..Held::default()
                    },
                );
            }
            let gpus = r.gpus.len() as u32;
            let pend = |tier: DataTier| {
                pending
                    .get(&(r.host_id.clone(), tier))
                    .copied()
                    .unwrap_or(0)
            };
            HostInfo {
                id: r.host_id.clone(),
                rack: r.rack.clone(),
                zone: r.zone.clone(),
                // A draining host finishes what it has and goes away: placement neither
                // sends it a copy nor reads one from it.
                up: e.up && !r.draining,
                nic_bps: r.nic_bps,
                mem_capacity: r.mem_capacity,
                mem_free: r.mem_free.saturating_sub(pend(DataTier::Memory)),
                disk_capacity: r.disk_capacity,
                disk_free: r.disk_free.saturating_sub(pend(DataTier::Disk)),
                gpus,
                gpus_free: gpus
                    .saturating_sub(r.gpus_busy)
                    .saturating_sub(e.reserved_gpus()),
                holdings,
            }
        })
        .collect()
}

/// Of the models on `host`'s GPUs, the digests another up host holds resident on its GPUs
/// as a whole replica (not loading, not a partition): the host's GPU eviction takes a heavy
/// model with a GPU copy elsewhere before one that is the only GPU copy (Torpor §5.3).
pub fn gpu_copies_elsewhere(hosts: &BTreeMap<String, HostEntry>, host: &str) -> Vec<String> {
    let Some(me) = hosts.get(host) else {
        return Vec::new();
    };
    let mine: BTreeSet<&str> = me
        .report
        .gpu_loads
        .iter()
        .map(|l| l.digest.as_str())
        .collect();
    // Called on every heartbeat: a scan of every host per heartbeat is O(hosts²) a
    // heartbeat period, so the scan stops as soon as every model of the host is found
    // elsewhere, skips everything for a host with nothing on its GPUs, and compares the
    // cheap fields first (found by the simulator, `shardcast-bench simulate`).
    let mut elsewhere: BTreeSet<&str> = BTreeSet::new();
    if mine.is_empty() {
        return Vec::new();
    }
    for e in hosts.values() {
        if std::ptr::eq(e, me) || !e.up {
            continue;
        }
        for l in &e.report.gpu_loads {
            if l.state == GpuState::Resident
                && l.partition.is_empty()
                && mine.contains(l.digest.as_str())
            {
                elsewhere.insert(l.digest.as_str());
            }
        }
        if elsewhere.len() == mine.len() {
            break;
        }
    }
    elsewhere.into_iter().map(str::to_owned).collect()
}

/// Marks hosts whose last heartbeat is older than `timeout` as down; returns the ids that
/// changed state.
pub fn expire(
    hosts: &mut BTreeMap<String, HostEntry>,
    now: Instant,
    timeout: Duration,
) -> Vec<String> {
    let mut changed = Vec::new();
    for (id, e) in hosts.iter_mut() {
        let up = now.saturating_duration_since(e.last_seen) <= timeout;
        if up != e.up {
            e.up = up;
            changed.push(id.clone());
        }
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, up: bool, held: &[(&str, DataTier, bool)]) -> HostEntry {
        HostEntry {
            report: HostView {
                host_id: id.into(),
                data_addr: "127.0.0.1:1".into(),
                agent_addr: "127.0.0.1:2".into(),
                rack: "r1".into(),
                mem_capacity: 100,
                mem_free: 80,
                disk_capacity: 1000,
                disk_free: 900,
                gpus: vec![GpuInfo::default(), GpuInfo::default()],
                gpus_busy: 0,
                holdings: held
                    .iter()
                    .map(|(d, t, c)| Holding {
                        digest: (*d).into(),
                        name: String::new(),
                        tier: *t,
                        complete: *c,
                        bytes_verified: 0,
                        total_bytes: 0,
                    })
                    .collect(),
                ..Default::default()
            },
            last_seen: Instant::now(),
            up,
            gpu_reserved: BTreeMap::new(),
            booked_at: HashMap::new(),
            pending_evictions: Vec::new(),
        }
    }

    #[test]
    fn view_has_only_the_model_asked_for_and_subtracts_pending_and_reserved() {
        let mut hosts = BTreeMap::new();
        let mut a = entry(
            "a",
            true,
            &[("m1", DataTier::Memory, true), ("m2", DataTier::Disk, true)],
        );
        a.gpu_reserved.insert("m9".into(), 1);
        hosts.insert("a".to_string(), a);
        hosts.insert(
            "b".to_string(),
            entry("b", false, &[("m1", DataTier::Memory, false)]),
        );
        let mut pending = Pending::new();
        pending.insert(("a".into(), DataTier::Memory), 30);
        let v = cluster_view(&hosts, "m1", &pending);
        assert_eq!(v.len(), 2);
        let a = &v[0];
        assert_eq!(a.holdings.len(), 1);
        assert!(a.holdings["m1"].memory && !a.holdings["m1"].disk);
        assert_eq!(a.mem_free, 50);
        assert_eq!(a.gpus, 2);
        assert_eq!(a.gpus_free, 1);
        // An incomplete copy is not a holding; a down host stays in the view, marked down.
        assert!(v[1].holdings.is_empty());
        assert!(!v[1].up);
    }

    #[test]
    fn a_draining_host_is_neither_placed_on_nor_read_from() {
        let mut hosts = BTreeMap::new();
        let mut a = entry("a", true, &[("m1", DataTier::Memory, true)]);
        a.report.draining = true;
        hosts.insert("a".to_string(), a);
        hosts.insert("b".to_string(), entry("b", true, &[]));
        let v = cluster_view(&hosts, "m1", &Pending::new());
        // Up as far as heartbeats go, but not a candidate: placement skips hosts that are
        // not up, as receivers and as sources of their complete copies alike.
        assert!(!v[0].up, "{:?}", v[0]);
        assert!(v[1].up);
    }

    #[test]
    fn gpu_copies_elsewhere_counts_whole_resident_replicas_on_other_up_hosts() {
        let load = |d: &str, state: GpuState, partition: &str| GpuLoad {
            digest: d.into(),
            state,
            gpus: vec![0],
            partition: partition.into(),
            error: String::new(),
        };
        let with = |id: &str, up: bool, loads: Vec<GpuLoad>| {
            let mut e = entry(id, up, &[]);
            e.report.gpu_loads = loads;
            (id.to_string(), e)
        };
        let hosts: BTreeMap<String, HostEntry> = [
            with(
                "me",
                true,
                vec![
                    load("resident-elsewhere", GpuState::Resident, ""),
                    load("only-here", GpuState::Resident, ""),
                    load("loading-elsewhere", GpuState::Resident, ""),
                    load("partition-elsewhere", GpuState::Resident, ""),
                    load("on-a-down-host", GpuState::Resident, ""),
                ],
            ),
            with(
                "b",
                true,
                vec![
                    load("resident-elsewhere", GpuState::Resident, ""),
                    load("loading-elsewhere", GpuState::Loading, ""),
                    load("partition-elsewhere", GpuState::PartitionLive, "1.1/2"),
                    load("not-on-me", GpuState::Resident, ""),
                ],
            ),
            with(
                "c",
                false,
                vec![load("on-a-down-host", GpuState::Resident, "")],
            ),
        ]
        .into_iter()
        .collect();
        assert_eq!(gpu_copies_elsewhere(&hosts, "me"), ["resident-elsewhere"]);
        // Seen from `b`: `me` holds whole resident replicas of three of `b`'s models, whatever
        // state `b`'s own copies are in; nobody else holds `not-on-me`.
        assert_eq!(
            gpu_copies_elsewhere(&hosts, "b"),
            [
                "loading-elsewhere",
                "partition-elsewhere",
                "resident-elsewhere"
            ]
        );
        assert!(gpu_copies_elsewhere(&hosts, "unknown").is_empty());
    }

    #[test]
    fn expiry_marks_silent_hosts_down_and_back_up() {
        let mut hosts = BTreeMap::new();
        let mut old = entry("old", true, &[]);
        old.last_seen = Instant::now() - Duration::from_secs(10);
        hosts.insert("old".to_string(), old);
        hosts.insert("new".to_string(), entry("new", true, &[]));
        let changed = expire(&mut hosts, Instant::now(), Duration::from_secs(3));
        assert_eq!(changed, vec!["old".to_string()]);
        assert!(!hosts["old"].up && hosts["new"].up);
        assert!(expire(&mut hosts, Instant::now(), Duration::from_secs(3)).is_empty());
    }

    #[test]
    fn signature_ignores_free_space_but_not_holdings() {
        let a = entry("a", true, &[("m1", DataTier::Memory, false)]).report;
        let mut b = a.clone();
        b.mem_free = 1;
        assert_eq!(HostEntry::signature(&a), HostEntry::signature(&b));
        b.holdings[0].complete = true;
        assert_ne!(HostEntry::signature(&a), HostEntry::signature(&b));
    }

    #[test]
    fn mark_complete_and_forget() {
        let mut e = entry("a", true, &[]);
        e.mark_complete("m1", "x/y", DataTier::Memory, 42);
        assert!(
            e.holding("m1", DataTier::Memory)
                .is_some_and(|h| h.complete && h.total_bytes == 42)
        );
        e.mark_complete("m1", "x/y", DataTier::Memory, 42);
        assert_eq!(e.report.holdings.len(), 1);
        e.forget("m1", DataTier::Memory);
        assert!(e.holding("m1", DataTier::Memory).is_none());
    }

    #[test]
    fn host_records_are_versioned_and_unversioned_ones_still_load() {
        let mut e = entry("a", true, &[("m1", DataTier::Disk, true)]);
        e.gpu_reserved.insert("m1".into(), 2);
        let bytes = serde_json::to_vec(&StoredHost::of(&e)).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["version"], HOST_RECORD_VERSION);
        assert_eq!(v["host"]["holdings"][0]["tier"], "disk");
        let back = crate::wire::read_host_record(&bytes).unwrap();
        assert_eq!(back.host, e.report);
        assert_eq!(back.gpu_reserved, e.gpu_reserved);

        // Written before versions: the wire message (tiers as strings).
        let legacy = serde_json::json!({
            "report": {"host_id": "a", "data_addr": "127.0.0.1:1", "agent_addr": "127.0.0.1:2",
                       "holdings": [{"digest": "m1", "tier": "memory", "complete": true}]},
            "gpu_reserved": {"m1": 1}
        });
        let old = crate::wire::read_host_record(legacy.to_string().as_bytes()).unwrap();
        assert_eq!(old.host.holdings[0].tier, DataTier::Memory);
        assert_eq!(old.gpu_reserved["m1"], 1);

        let future = serde_json::json!({"version": "9", "host": {}});
        let err = crate::wire::read_host_record(future.to_string().as_bytes()).unwrap_err();
        assert!(err.to_string().contains("\"9\""), "{err}");
        let bad_tier = serde_json::json!({
            "report": {"host_id": "a", "holdings": [{"digest": "m1", "tier": "tape"}]}
        });
        let err = crate::wire::read_host_record(bad_tier.to_string().as_bytes()).unwrap_err();
        assert!(err.to_string().contains("tape"), "{err}");
    }
}
