//! The host inventory: the last report of every transferd, whether it is up, and the GPU
//! slots the controller reserved on it. Converts to the placement crate's plain view.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use shardcast_placement::{Held, HostInfo};
use shardcast_protocol::controller::{HeldModel, HostReport};

/// What the controller knows about one host.
#[derive(Debug, Clone)]
pub struct HostEntry {
    /// The last heartbeat's content.
    pub report: HostReport,
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
}

/// The persisted part of a host entry.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostRecord {
    /// Last report.
    pub report: HostReport,
    /// GPU reservations.
    #[serde(default)]
    pub gpu_reserved: BTreeMap<String, u32>,
}

impl HostEntry {
    /// An entry read from the state, up and seen at `now`: hosts get one heartbeat window
    /// after a controller (re)loads the state before they are marked down.
    pub fn restored(record: HostRecord, now: Instant) -> Self {
        Self {
            report: record.report,
            last_seen: now,
            up: true,
            gpu_reserved: record.gpu_reserved,
            booked_at: HashMap::new(),
        }
    }

    /// GPU slots reserved for all models.
    pub fn reserved_gpus(&self) -> u32 {
        self.gpu_reserved.values().sum()
    }

    /// The holding of `digest` in `tier` ("memory" or "disk").
    pub fn holding(&self, digest: &str, tier: &str) -> Option<&HeldModel> {
        self.report
            .holdings
            .iter()
            .find(|h| h.digest == digest && h.tier == tier)
    }

    /// Records that the host now holds a complete copy (before its next heartbeat says so),
    /// so a plan made right after this one sees it.
    pub fn mark_complete(&mut self, digest: &str, name: &str, tier: &str, bytes: u64) {
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
            None => self.report.holdings.push(HeldModel {
                digest: digest.into(),
                name: name.into(),
                tier: tier.into(),
                complete: true,
                bytes_verified: bytes,
                total_bytes: bytes,
            }),
        }
    }

    /// Forgets a copy (after an eviction).
    pub fn forget(&mut self, digest: &str, tier: &str) {
        self.report
            .holdings
            .retain(|h| !(h.digest == digest && h.tier == tier));
    }

    /// What changes slowly: a heartbeat that changes this is persisted; one that only moves
    /// free space is not.
    pub fn signature(r: &HostReport) -> String {
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

/// Bytes still to arrive per host and data tier, from plans in flight: capacity they will
/// use that heartbeats do not show yet.
pub type Pending = HashMap<(String, &'static str), u64>;

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
            let memory = e.holding(digest, "memory").is_some_and(|h| h.complete);
            let disk = e.holding(digest, "disk").is_some_and(|h| h.complete);
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
            let pend = |tier: &'static str| {
                pending
                    .get(&(r.host_id.clone(), tier))
                    .copied()
                    .unwrap_or(0)
            };
            HostInfo {
                id: r.host_id.clone(),
                rack: r.rack.clone(),
                zone: r.zone.clone(),
                up: e.up,
                nic_bps: r.nic_bps,
                mem_capacity: r.mem_capacity,
                mem_free: r.mem_free.saturating_sub(pend("memory")),
                disk_capacity: r.disk_capacity,
                disk_free: r.disk_free.saturating_sub(pend("disk")),
                gpus,
                gpus_free: gpus
                    .saturating_sub(r.gpus_busy)
                    .saturating_sub(e.reserved_gpus()),
                holdings,
            }
        })
        .collect()
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
    use shardcast_protocol::controller::Gpu;

    fn entry(id: &str, up: bool, held: &[(&str, &str, bool)]) -> HostEntry {
        HostEntry {
            report: HostReport {
                host_id: id.into(),
                data_addr: "127.0.0.1:1".into(),
                agent_addr: "127.0.0.1:2".into(),
                rack: "r1".into(),
                mem_capacity: 100,
                mem_free: 80,
                disk_capacity: 1000,
                disk_free: 900,
                gpus: vec![Gpu::default(), Gpu::default()],
                gpus_busy: 0,
                holdings: held
                    .iter()
                    .map(|(d, t, c)| HeldModel {
                        digest: (*d).into(),
                        tier: (*t).into(),
                        complete: *c,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            },
            last_seen: Instant::now(),
            up,
            gpu_reserved: BTreeMap::new(),
            booked_at: HashMap::new(),
        }
    }

    #[test]
    fn view_has_only_the_model_asked_for_and_subtracts_pending_and_reserved() {
        let mut hosts = BTreeMap::new();
        let mut a = entry("a", true, &[("m1", "memory", true), ("m2", "disk", true)]);
        a.gpu_reserved.insert("m9".into(), 1);
        hosts.insert("a".to_string(), a);
        hosts.insert(
            "b".to_string(),
            entry("b", false, &[("m1", "memory", false)]),
        );
        let mut pending = Pending::new();
        pending.insert(("a".into(), "memory"), 30);
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
        let a = entry("a", true, &[("m1", "memory", false)]).report;
        let mut b = a.clone();
        b.mem_free = 1;
        assert_eq!(HostEntry::signature(&a), HostEntry::signature(&b));
        b.holdings[0].complete = true;
        assert_ne!(HostEntry::signature(&a), HostEntry::signature(&b));
    }

    #[test]
    fn mark_complete_and_forget() {
        let mut e = entry("a", true, &[]);
        e.mark_complete("m1", "x/y", "memory", 42);
        assert!(
            e.holding("m1", "memory")
                .is_some_and(|h| h.complete && h.total_bytes == 42)
        );
        e.mark_complete("m1", "x/y", "memory", 42);
        assert_eq!(e.report.holdings.len(), 1);
        e.forget("m1", "memory");
        assert!(e.holding("m1", "memory").is_none());
    }
}
