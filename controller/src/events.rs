//! The controller's decision log: every autoscaler decision, tier eviction, GPU-slot
//! release and plan event, newest first (`ListEvents`, `shardcast events`), with a counter
//! per kind (`/metrics`). Shared by the core and the services; it depends on neither.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

use tracing::info;

use crate::lock;

/// A decision or plan event.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Event {
    /// Seconds since the Unix epoch.
    pub at: f64,
    /// The model (name, or digest where it has none).
    pub model: String,
    /// "scale-up", "burst", "scale-down", "hold", "error", the tier sweeper's kinds,
    /// "receiver-lost", "receiver-recovered", ….
    pub kind: String,
    /// Why, in words.
    pub reason: String,
    /// The plan a scale-up or burst started, or the plan a receiver event is about.
    pub plan_id: String,
    /// Replicas added (positive) or removed (negative).
    pub delta: i32,
    /// The hosts it concerns.
    pub hosts: Vec<String>,
}

/// Events kept in memory for `ListEvents`.
pub const EVENTS_KEPT: usize = 1000;

/// Recent events and counts per kind.
#[derive(Default)]
pub struct EventLog {
    events: Mutex<VecDeque<Event>>,
    counters: Mutex<BTreeMap<String, u64>>,
}

impl EventLog {
    /// Records `e` (logged, counted, kept) and returns it.
    pub fn record(&self, e: Event) -> Event {
        info!(model = %e.model, kind = %e.kind, delta = e.delta, "event: {}", e.reason);
        *lock(&self.counters).entry(e.kind.clone()).or_default() += 1;
        let mut ev = lock(&self.events);
        if ev.len() >= EVENTS_KEPT {
            ev.pop_back();
        }
        ev.push_front(e.clone());
        e
    }

    /// Counts per kind, for `/metrics`.
    pub fn counters(&self) -> BTreeMap<String, u64> {
        lock(&self.counters).clone()
    }

    /// Recent events of `model` (all when empty), newest first, at most `limit` (100 when
    /// 0).
    pub fn list(&self, model: &str, limit: usize) -> Vec<Event> {
        let ev = lock(&self.events);
        ev.iter()
            .filter(|e| model.is_empty() || e.model == model)
            .take(if limit == 0 { 100 } else { limit })
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(model: &str, kind: &str) -> Event {
        Event {
            model: model.into(),
            kind: kind.into(),
            ..Default::default()
        }
    }

    #[test]
    fn newest_first_bounded_and_counted() {
        let log = EventLog::default();
        for i in 0..EVENTS_KEPT + 5 {
            log.record(event(if i % 2 == 0 { "a" } else { "b" }, "hold"));
        }
        log.record(event("a", "scale-up"));
        let all = log.list("", EVENTS_KEPT * 2);
        assert_eq!(all.len(), EVENTS_KEPT);
        assert_eq!(all[0].kind, "scale-up");
        assert!(log.list("b", 0).iter().all(|e| e.model == "b"));
        assert_eq!(log.list("", 0).len(), 100);
        let c = log.counters();
        assert_eq!(c["hold"], (EVENTS_KEPT + 5) as u64);
        assert_eq!(c["scale-up"], 1);
    }
}
