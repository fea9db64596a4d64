//! Host memory and disk tiers kept under their high watermarks (Flashpoint's multi-tier
//! store, Torpor §5.4's host side). Every `interval` the controller looks at each live
//! host's last heartbeat. A tier's use is the bytes the store holds in it, and its capacity
//! that plus the free space (at most the configured capacity): other programs' files on a
//! shared filesystem never make the cache evict models, which would not free them. When a
//! tier is above `high` of its capacity, model copies are evicted until it is at `low`:
//!
//! * memory: `shardcast_policies::evict::choose_memory_evictions` (model data before
//!   process memory, least recently used first);
//! * disk: `shardcast_policies::evict::disk_watermark_plan` (LRU).
//!
//! Copies a plan is still moving (to or from the host) and memory copies feeding a GPU
//! replica are pinned. The last copy in the cluster of a registered model is never evicted
//! unless its origin can serve it again (`origins_durable`). Every eviction, and every
//! sweep that cannot get down to the low watermark, is an event (`ListEvents`, kind
//! `tier-evict` / `tier-full`) with its reason.
//!
//! The same pass reconciles GPU reservations with what the hosts report of their GPUs: a
//! reservation whose load failed on the host, or whose model the host's GPU manager evicted
//! to make room, is released (event `gpu-release`), so a failed burst partition or plan does
//! not hold a GPU slot, nor count as a replica, until an operator evicts it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use shardcast_policies::evict::{
    self, ClusterCopies, DiskItem, TierItem, TierKind, choose_memory_evictions,
};
use shardcast_protocol::controller::{Event, EvictRequest, GpuLoad};
use tracing::warn;

use crate::core::Controller;
use crate::state::{StateError, StateStore, Table};

/// Watermark settings.
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// Run the sweeper.
    pub enabled: bool,
    /// Fractions of the memory tier's capacity: evict above `memory_high` down to
    /// `memory_low`.
    pub memory_high: f64,
    /// See `memory_high`.
    pub memory_low: f64,
    /// Fractions of the disk tier's capacity.
    pub disk_high: f64,
    /// See `disk_high`.
    pub disk_low: f64,
    /// How often to look.
    pub interval: Duration,
    /// Origins can always serve a model again (object stores, registries). When false, the
    /// last copy in the cluster of a registered model is never evicted.
    pub origins_durable: bool,
}

impl Default for TierConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            memory_high: 0.90,
            memory_low: 0.75,
            disk_high: 0.90,
            disk_low: 0.80,
            interval: Duration::from_secs(5),
            origins_durable: true,
        }
    }
}

/// When each model was last used (prewarmed, scaled, or reported with load), seconds since
/// the epoch. Kept in the state store (table `usage`, flushed by each sweep), so a restarted
/// controller still evicts the least recently used copies first.
#[derive(Default)]
pub struct Usage {
    last: Mutex<HashMap<String, f64>>,
    /// Digests touched since the last flush.
    dirty: Mutex<HashSet<String>>,
    /// Hosts whose "tier full" note was recorded.
    full: Mutex<HashSet<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Usage {
    /// The last uses kept in `store`; an unreadable entry is skipped with a warning (it
    /// counts as never used, the oldest).
    pub fn restore(store: &dyn StateStore) -> Result<Self, StateError> {
        let mut last = HashMap::new();
        for (digest, bytes) in store.list(Table::Usage)? {
            match Self::decode(&bytes) {
                Some(t) => {
                    last.insert(digest, t);
                }
                None => warn!(model = %digest, "skipping an unreadable last-use record"),
            }
        }
        Ok(Self {
            last: Mutex::new(last),
            ..Self::default()
        })
    }

    /// A stored last-use record: seconds since the epoch, decimal text.
    fn decode(bytes: &[u8]) -> Option<f64> {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|t| t.is_finite())
    }

    /// One stored record changed (a follower's view, `crate::ha`): `None` deleted it.
    pub fn apply_stored(&self, digest: &str, bytes: Option<&[u8]>) {
        let mut last = lock(&self.last);
        match bytes.map(Self::decode) {
            Some(Some(t)) => {
                last.insert(digest.to_string(), t);
            }
            Some(None) => {
                warn!(model = %digest, "skipping an unreadable last-use record");
                last.remove(digest);
            }
            None => {
                last.remove(digest);
            }
        }
    }

    /// Writes the uses recorded since the last flush.
    pub fn flush(&self, store: &dyn StateStore) -> Result<(), StateError> {
        let dirty: Vec<String> = lock(&self.dirty).drain().collect();
        for (n, digest) in dirty.iter().enumerate() {
            let t = self.last(digest);
            if let Err(e) = store.put(Table::Usage, digest, t.to_string().as_bytes()) {
                // Try again next time.
                lock(&self.dirty).extend(dirty[n..].iter().cloned());
                return Err(e);
            }
        }
        Ok(())
    }

    /// Records a use of `digest` now.
    pub fn touch(&self, digest: &str) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        lock(&self.last).insert(digest.to_string(), now);
        lock(&self.dirty).insert(digest.to_string());
    }

    /// Whether a "tier full" note for `host` is news: recorded when the host becomes full,
    /// not again on every sweep while it stays full (`full = false` clears it).
    fn new_note(&self, host: &str, full: bool) -> bool {
        let mut m = lock(&self.full);
        if !full {
            m.remove(host);
            return false;
        }
        m.insert(host.to_string())
    }

    /// Last use of `digest` (0: never recorded).
    pub fn last(&self, digest: &str) -> f64 {
        lock(&self.last).get(digest).copied().unwrap_or(0.0)
    }
}

/// Why a GPU reservation of `digest` on a host no longer stands, from the host's report of
/// its GPUs: the load failed there, or its GPU manager evicted the model to make room and
/// has not loaded it again. `None`: the reservation stands (loading, live, resident, or not
/// started yet).
pub fn stale_booking(digest: &str, loads: &[GpuLoad], evicted: &[String]) -> Option<String> {
    match loads.iter().find(|l| l.digest == digest) {
        Some(l) if l.state == "failed" => Some(if l.error.is_empty() {
            "the GPU load failed on the host".to_string()
        } else {
            format!("the GPU load failed on the host: {}", l.error)
        }),
        Some(_) => None,
        None if evicted.iter().any(|d| d == digest) => {
            Some("the host's GPU manager evicted it to make room for another model".into())
        }
        None => None,
    }
}

/// One copy on a host, as the sweeper sees it.
#[derive(Debug, Clone)]
pub struct TierCopy {
    /// `memory` or `disk`.
    pub tier: String,
    /// Model digest.
    pub digest: String,
    /// Model name.
    pub name: String,
    /// Bytes verified.
    pub bytes: u64,
    /// A plan moves it, or a GPU replica reads it.
    pub pinned: bool,
    /// Complete copies in the cluster over both tiers.
    pub copies: u32,
    /// The model is registered.
    pub registered: bool,
    /// Its origin can serve it again.
    pub origin_available: bool,
}

/// One host's tiers.
#[derive(Debug, Clone)]
pub struct HostTiers {
    /// Host id.
    pub host: String,
    /// Memory tier capacity, bytes.
    pub mem_capacity: u64,
    /// Memory tier use, bytes.
    pub mem_used: u64,
    /// Disk tier capacity, bytes.
    pub disk_capacity: u64,
    /// Disk tier use, bytes.
    pub disk_used: u64,
    /// Copies in either tier.
    pub items: Vec<TierCopy>,
}

/// What to evict from one host: (tier, digest, reason), plus a note when the tier cannot
/// get down to its low watermark.
pub fn sweep_host(
    h: &HostTiers,
    cfg: &TierConfig,
    usage: &Usage,
) -> (Vec<(String, String, String)>, Vec<String>) {
    let mut out = Vec::new();
    let mut notes = Vec::new();
    let copies = |c: &TierCopy| ClusterCopies {
        copies_in_cluster: c.copies,
        registered: c.registered,
        origin_available: c.origin_available,
    };
    let pct = |used: u64, cap: u64| 100.0 * used as f64 / cap.max(1) as f64;
    if h.mem_capacity > 0 && h.mem_used as f64 > cfg.memory_high * h.mem_capacity as f64 {
        let need = h
            .mem_used
            .saturating_sub((cfg.memory_low.min(cfg.memory_high) * h.mem_capacity as f64) as u64);
        let items: Vec<TierItem> = h
            .items
            .iter()
            .filter(|c| c.tier == "memory")
            .map(|c| TierItem {
                model: c.digest.clone(),
                bytes: c.bytes,
                last_used_s: usage.last(&c.digest),
                pinned: c.pinned,
                kind: TierKind::ModelData,
                copies: copies(c),
            })
            .collect();
        let why = format!(
            "memory tier at {:.0}% > high watermark {:.0}%: least recently used model data, down to {:.0}%",
            pct(h.mem_used, h.mem_capacity),
            cfg.memory_high * 100.0,
            cfg.memory_low * 100.0
        );
        // Free what can be freed when the whole need cannot: the smallest need first.
        let mut chosen = choose_memory_evictions(&items, need);
        if let Err(e) = &chosen {
            notes.push(format!("memory: {e}"));
            let evictable: u64 = items
                .iter()
                .filter(|i| !i.pinned && !i.copies.protects())
                .map(|i| i.bytes)
                .sum();
            chosen = choose_memory_evictions(&items, evictable.min(need));
        }
        for d in chosen.unwrap_or_default() {
            out.push(("memory".into(), d, why.clone()));
        }
    }
    if h.disk_capacity > 0 {
        let items: Vec<DiskItem> = h
            .items
            .iter()
            .filter(|c| c.tier == "disk")
            .map(|c| DiskItem {
                model: c.digest.clone(),
                bytes: c.bytes,
                last_used_s: usage.last(&c.digest),
                pinned: c.pinned,
                copies: copies(c),
            })
            .collect();
        let plan = evict::disk_watermark_plan(
            &items,
            h.disk_used,
            h.disk_capacity,
            cfg.disk_high,
            cfg.disk_low,
        );
        let why = format!(
            "disk tier at {:.0}% > high watermark {:.0}%: least recently used, down to {:.0}%",
            pct(h.disk_used, h.disk_capacity),
            cfg.disk_high * 100.0,
            cfg.disk_low * 100.0
        );
        if !plan.evict.is_empty() && !plan.reaches_low {
            notes.push(format!(
                "disk: cannot reach the low watermark; kept {:?}",
                plan.skipped
            ));
        }
        for d in plan.evict {
            out.push(("disk".into(), d, why.clone()));
        }
    }
    (out, notes)
}

impl Controller {
    pub(crate) async fn tier_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.config().tiers.interval);
        loop {
            tokio::select! {
                _ = self.cancelled() => {
                    let _ = self.usage().flush(self.store());
                    return;
                }
                _ = tick.tick() => {}
            }
            self.sweep_tiers().await;
            if let Err(e) = self.usage().flush(self.store()) {
                warn!("recording last uses: {e}");
            }
        }
    }

    /// One pass over every live host's tiers; returns the events it recorded.
    pub async fn sweep_tiers(&self) -> Vec<Event> {
        let cfg = self.config().tiers.clone();
        let mut events = Vec::new();
        // GPU reservations first: a failed or evicted GPU copy frees its slot, so the
        // autoscaler does not count it as a replica and placement can use the GPU again.
        for (host, digest, name, why) in self.stale_gpu_bookings() {
            self.release_gpu_slot(&host, &digest);
            warn!(host = %host, model = %name, "GPU reservation released: {why}");
            events.push(self.autoscaler().record_event(Event {
                at: now(),
                model: name,
                kind: "gpu-release".into(),
                reason: format!("host {host}: {why}"),
                plan_id: String::new(),
                delta: -1,
                hosts: vec![host],
            }));
        }
        for h in self.tier_view(cfg.origins_durable) {
            let (evictions, notes) = sweep_host(&h, &cfg, self.usage());
            tracing::debug!(host = %h.host, mem_used = h.mem_used, disk_used = h.disk_used, ?evictions, ?notes, "tier sweep");
            let name_of = |d: &str| {
                h.items
                    .iter()
                    .find(|c| c.digest == d)
                    .map_or_else(|| d.to_string(), |c| c.name.clone())
            };
            for (tier, digest, why) in evictions {
                let name = name_of(&digest);
                let r = self
                    .evict(EvictRequest {
                        model: digest.clone(),
                        hosts: vec![h.host.clone()],
                        tier: shardcast_protocol::controller::Tier::from_label(&tier)
                            .unwrap_or(shardcast_protocol::controller::Tier::Memory)
                            as i32,
                    })
                    .await;
                let (kind, reason) = match r {
                    Ok(_) => ("tier-evict", why),
                    Err(e) => {
                        warn!(host = %h.host, model = %name, "tier eviction failed: {}", e.message);
                        ("error", format!("{why} — eviction failed: {}", e.message))
                    }
                };
                events.push(self.autoscaler().record_event(Event {
                    at: now(),
                    model: name,
                    kind: kind.into(),
                    reason,
                    plan_id: String::new(),
                    delta: -1,
                    hosts: vec![h.host.clone()],
                }));
            }
            let news = self.usage().new_note(&h.host, !notes.is_empty());
            for n in notes.into_iter().filter(|_| news) {
                events.push(self.autoscaler().record_event(Event {
                    at: now(),
                    model: String::new(),
                    kind: "tier-full".into(),
                    reason: format!("host {}: {n}", h.host),
                    plan_id: String::new(),
                    delta: 0,
                    hosts: vec![h.host.clone()],
                }));
            }
        }
        events
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(tier: &str, digest: &str, mib: u64, copies: u32) -> TierCopy {
        TierCopy {
            tier: tier.into(),
            digest: digest.into(),
            name: digest.into(),
            bytes: mib << 20,
            pinned: false,
            copies,
            registered: true,
            origin_available: true,
        }
    }

    fn host(items: Vec<TierCopy>, mem_cap_mib: u64) -> HostTiers {
        let mem_used = items
            .iter()
            .filter(|c| c.tier == "memory")
            .map(|c| c.bytes)
            .sum();
        let disk_used = items
            .iter()
            .filter(|c| c.tier == "disk")
            .map(|c| c.bytes)
            .sum();
        HostTiers {
            host: "h".into(),
            mem_capacity: mem_cap_mib << 20,
            mem_used,
            disk_capacity: 100 << 20,
            disk_used,
            items,
        }
    }

    #[test]
    fn above_the_high_watermark_lru_copies_go_down_to_the_low_one() {
        let usage = Usage::default();
        usage.touch("b");
        std::thread::sleep(Duration::from_millis(5));
        usage.touch("a");
        // 30 MiB of 32: 94% > 90%; down to 75% = 24 MiB: 6 MiB must go; `c` (never used)
        // goes first and is enough.
        let h = host(
            vec![
                copy("memory", "a", 10, 2),
                copy("memory", "b", 10, 2),
                copy("memory", "c", 10, 2),
            ],
            32,
        );
        let (ev, notes) = sweep_host(&h, &TierConfig::default(), &usage);
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert_eq!(ev[0].1, "c");
        assert!(ev[0].2.contains("memory tier at 94%"), "{}", ev[0].2);
        assert!(notes.is_empty());
        // Below the high watermark nothing happens.
        let h = host(vec![copy("memory", "a", 10, 2)], 32);
        assert!(sweep_host(&h, &TierConfig::default(), &usage).0.is_empty());
    }

    #[test]
    fn pinned_copies_and_unrecoverable_last_copies_stay() {
        let usage = Usage::default();
        let mut busy = copy("memory", "busy", 10, 2);
        busy.pinned = true;
        let mut last = copy("memory", "last", 10, 1);
        last.origin_available = false;
        let h = host(vec![busy, last, copy("memory", "spare", 10, 3)], 32);
        let (ev, _) = sweep_host(&h, &TierConfig::default(), &usage);
        assert_eq!(
            ev.iter().map(|e| e.1.as_str()).collect::<Vec<_>>(),
            ["spare"]
        );
        // With only protected copies there is nothing to do but say so.
        let mut last = copy("memory", "last", 30, 1);
        last.origin_available = false;
        let (ev, notes) = sweep_host(&host(vec![last], 32), &TierConfig::default(), &usage);
        assert!(ev.is_empty());
        assert_eq!(notes.len(), 1);
        assert!(notes[0].contains("last copy"), "{notes:?}");
    }

    #[test]
    fn the_disk_tier_has_its_own_watermarks() {
        let usage = Usage::default();
        let h = host(
            vec![copy("disk", "old", 50, 2), copy("disk", "new", 45, 2)],
            32,
        );
        usage.touch("new");
        let (ev, _) = sweep_host(&h, &TierConfig::default(), &usage);
        assert_eq!(ev.len(), 1);
        assert_eq!((ev[0].0.as_str(), ev[0].1.as_str()), ("disk", "old"));
    }

    #[test]
    fn gpu_bookings_go_when_the_host_reports_a_failure_or_an_eviction() {
        let load = |d: &str, state: &str, error: &str| GpuLoad {
            digest: d.into(),
            state: state.into(),
            error: error.into(),
            ..Default::default()
        };
        let loads = vec![
            load("failed", "failed", "fetching partition: origin gone"),
            load("live", "partition-live", ""),
            load("back", "loading", ""),
        ];
        let evicted = vec!["gone".to_string(), "back".to_string()];
        let why = stale_booking("failed", &loads, &evicted).expect("a failed load is stale");
        assert!(why.contains("origin gone"), "{why}");
        assert_eq!(stale_booking("live", &loads, &evicted), None);
        // Evicted once, loading again: the new load stands.
        assert_eq!(stale_booking("back", &loads, &evicted), None);
        let why = stale_booking("gone", &loads, &evicted).expect("an evicted model is stale");
        assert!(why.contains("evicted"), "{why}");
        // Not started yet (a plan still moving it): stands.
        assert_eq!(stale_booking("pending", &loads, &evicted), None);
    }

    #[test]
    fn last_uses_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let store = crate::state::RedbStore::open(&path).unwrap();
            let usage = Usage::restore(&store).unwrap();
            usage.touch("a");
            usage.flush(&store).unwrap();
            store.put(Table::Usage, "bad", b"not a time").unwrap();
        }
        let store = crate::state::RedbStore::open(&path).unwrap();
        let usage = Usage::restore(&store).unwrap();
        assert!(usage.last("a") > 1.0e9, "{}", usage.last("a"));
        assert_eq!(usage.last("bad"), 0.0);
        assert_eq!(usage.last("never"), 0.0);
    }
}
