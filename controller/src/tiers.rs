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

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::core::{EvictModel, Evicted};
use crate::events::Event;
use shardcast_policies::evict::{
    self, ClusterCopies, DiskItem, TierItem, TierKind, choose_memory_evictions,
};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::core::now_unix;
use crate::error::EvictError;
use crate::events::EventLog;
use crate::inventory::{DataTier, GpuLoad};
use crate::lock;
use crate::plan::GpuState;
use crate::state::StateStore;
use crate::usage::Usage;

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

/// Why a GPU reservation of `digest` on a host no longer stands, from the host's report of
/// its GPUs: the load failed there, or its GPU manager evicted the model to make room and
/// has not loaded it again. `None`: the reservation stands (loading, live, resident, or not
/// started yet).
pub fn stale_booking(digest: &str, loads: &[GpuLoad], evicted: &[String]) -> Option<String> {
    match loads.iter().find(|l| l.digest == digest) {
        Some(l) if l.state == GpuState::Failed => Some(if l.error.is_empty() {
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
    /// Which tier.
    pub tier: DataTier,
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
) -> (Vec<(DataTier, String, String)>, Vec<String>) {
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
            .filter(|c| c.tier == DataTier::Memory)
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
            out.push((DataTier::Memory, d, why.clone()));
        }
    }
    if h.disk_capacity > 0 {
        let items: Vec<DiskItem> = h
            .items
            .iter()
            .filter(|c| c.tier == DataTier::Disk)
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
            out.push((DataTier::Disk, d, why.clone()));
        }
    }
    (out, notes)
}

/// A GPU reservation the host's own report contradicts.
#[derive(Debug, Clone)]
pub struct StaleBooking {
    /// Host id.
    pub host: String,
    /// Model digest.
    pub digest: String,
    /// Model name (the digest when not registered).
    pub name: String,
    /// Why it no longer stands ([`stale_booking`]).
    pub why: String,
}

/// What the sweeper needs from the rest of the controller: the hosts' tiers as the last
/// heartbeats describe them, the GPU reservations to release, and eviction.
pub trait TierTarget: Send + Sync + 'static {
    /// Each up host's memory and disk use and the model copies in them.
    fn tier_view(&self, origins_durable: bool) -> Vec<HostTiers>;
    /// GPU reservations the hosts' reports contradict.
    fn stale_gpu_bookings(&self) -> Vec<StaleBooking>;
    /// Releases one GPU reservation.
    fn release_gpu_slot(&self, host: &str, digest: &str);
    /// (host, digest, tier) of the evictions asked for while an up host was down and still
    /// due: its last report holds the copy.
    fn pending_evictions(&self) -> Vec<(String, String, DataTier)>;
    /// `Evict`, as the API does it.
    fn evict(&self, req: EvictModel) -> impl Future<Output = Result<Evicted, EvictError>> + Send;
}

/// The tier sweeper: keeps every host's memory and disk tiers under their high watermarks
/// and releases GPU reservations the hosts contradict. Holds only the handles it needs.
pub struct TierSweeper<T> {
    cfg: TierConfig,
    target: Arc<T>,
    usage: Arc<Usage>,
    events: Arc<EventLog>,
    store: Arc<dyn StateStore>,
    /// Hosts whose "tier full" note was recorded.
    full: Mutex<HashSet<String>>,
}

impl<T: TierTarget> TierSweeper<T> {
    /// A sweeper over `target`.
    pub fn new(
        cfg: TierConfig,
        target: Arc<T>,
        usage: Arc<Usage>,
        events: Arc<EventLog>,
        store: Arc<dyn StateStore>,
    ) -> Self {
        Self {
            cfg,
            target,
            usage,
            events,
            store,
            full: Mutex::default(),
        }
    }

    /// Sweeps every `interval` until `cancel`, then records the last uses once more.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(self.cfg.interval);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => {
                    let _ = self.usage.flush(self.store.as_ref());
                    return;
                }
                _ = tick.tick() => {}
            }
            self.sweep().await;
            if let Err(e) = self.usage.flush(self.store.as_ref()) {
                warn!("recording last uses: {e}");
            }
        }
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

    /// One pass over every live host's tiers; returns the events it recorded.
    pub async fn sweep(&self) -> Vec<Event> {
        let cfg = &self.cfg;
        let mut events = Vec::new();
        // GPU reservations first: a failed or evicted GPU copy frees its slot, so the
        // autoscaler does not count it as a replica and placement can use the GPU again.
        for b in self.target.stale_gpu_bookings() {
            self.target.release_gpu_slot(&b.host, &b.digest);
            warn!(host = %b.host, model = %b.name, "GPU reservation released: {}", b.why);
            events.push(self.events.record(Event {
                at: now_unix(),
                model: b.name,
                kind: "gpu-release".into(),
                reason: format!("host {}: {}", b.host, b.why),
                plan_id: String::new(),
                delta: -1,
                hosts: vec![b.host],
            }));
        }
        // Evictions asked for while their hosts were down, now that they are back.
        for (host, digest, tier) in self.target.pending_evictions() {
            let r = self.target.evict(evict_request(&digest, &host, tier)).await;
            let (kind, reason) = match r {
                Ok(_) => (
                    "evict-on-return",
                    format!(
                        "host {host} is back: its {tier} copy, evicted while it was down, is removed"
                    ),
                ),
                Err(e) => {
                    // A plan moving the model to the host (StillMoving), an agent that
                    // does not answer yet: tried again on the next sweep.
                    warn!(host = %host, model = %digest, "eviction on return failed, will retry: {e}");
                    continue;
                }
            };
            events.push(self.events.record(Event {
                at: now_unix(),
                model: digest,
                kind: kind.into(),
                reason,
                plan_id: String::new(),
                delta: -1,
                hosts: vec![host],
            }));
        }
        for h in self.target.tier_view(cfg.origins_durable) {
            let (evictions, notes) = sweep_host(&h, cfg, &self.usage);
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
                    .target
                    .evict(evict_request(&digest, &h.host, tier))
                    .await;
                let (kind, reason) = match r {
                    Ok(_) => ("tier-evict", why),
                    Err(e) => {
                        warn!(host = %h.host, model = %name, "tier eviction failed: {e}");
                        ("error", format!("{why} — eviction failed: {e}"))
                    }
                };
                events.push(self.events.record(Event {
                    at: now_unix(),
                    model: name,
                    kind: kind.into(),
                    reason,
                    plan_id: String::new(),
                    delta: -1,
                    hosts: vec![h.host.clone()],
                }));
            }
            let news = self.new_note(&h.host, !notes.is_empty());
            for n in notes.into_iter().filter(|_| news) {
                events.push(self.events.record(Event {
                    at: now_unix(),
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

/// `Evict` of `digest`'s copy in `tier` on `host`.
fn evict_request(digest: &str, host: &str, tier: DataTier) -> EvictModel {
    EvictModel {
        model: digest.to_string(),
        hosts: vec![host.to_string()],
        tier: tier.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(tier: &str, digest: &str, mib: u64, copies: u32) -> TierCopy {
        TierCopy {
            tier: tier.parse().unwrap(),
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
            .filter(|c| c.tier == DataTier::Memory)
            .map(|c| c.bytes)
            .sum();
        let disk_used = items
            .iter()
            .filter(|c| c.tier == DataTier::Disk)
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
        assert_eq!((ev[0].0, ev[0].1.as_str()), (DataTier::Disk, "old"));
    }

    #[test]
    fn gpu_bookings_go_when_the_host_reports_a_failure_or_an_eviction() {
        let load = |d: &str, state: &str, error: &str| GpuLoad {
            digest: d.into(),
            state: state.parse().unwrap(),
            error: error.into(),
            gpus: Vec::new(),
            partition: String::new(),
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
}
