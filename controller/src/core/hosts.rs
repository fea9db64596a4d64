//! The controller's view of its hosts: heartbeats (a host registers with its first), the
//! host list, and what a heartbeat changes in the plans receiving on that host (a
//! restarted transferd, a receiver that completed after it was given up).

use super::*;

impl Controller {
    /// A heartbeat (the first one registers the host). The answer carries the registry's
    /// current version of every model name the report mentions: hosts resolve names only
    /// through it.
    pub fn heartbeat(&self, report: HostView) -> Result<HeartbeatAnswer, HeartbeatError> {
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
        let mut inv = self.inventory.lock();
        let entry = inv.hosts.entry(id.clone()).or_insert_with(|| {
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
        if report.draining && !entry.report.draining {
            info!(host = %id, "host is draining: nothing new is placed there");
        }
        entry.report = report;
        entry.last_seen = Instant::now();
        entry.up = true;
        let record = StoredHost::of(entry);
        if inv.persisted.get(&id) != Some(&sig) {
            let bytes =
                serde_json::to_vec(&record).map_err(|e| HeartbeatError::Store(e.to_string()))?;
            if inv.persisted.contains_key(&id) {
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
            inv.persisted.insert(id.clone(), sig);
        }
        let gpu_copies_elsewhere = inventory::gpu_copies_elsewhere(&inv.hosts, &id);
        drop(inv);
        // What the report changes in the plans receiving on the host (the plans' lock, then
        // the hosts' again, in the lock order; most hosts receive in no plan).
        let mut st = lock(&self.state);
        let mut events = Vec::new();
        if st.receiver_plans.contains_key(&id)
            && let Some(entry) = self.inventory.lock().hosts.get(&id)
        {
            events = reconcile_receivers(&mut st, entry);
        }
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
        drop(st);
        let names = self.registry.bindings(asked.iter().map(String::as_str));
        Ok(HeartbeatAnswer {
            interval: self.cfg.heartbeat,
            names,
            gpu_copies_elsewhere,
            issued_at_ms: unix_now_ms(),
        })
    }

    /// Every known host.
    pub fn list_hosts(&self) -> Vec<HostListing> {
        let inv = self.inventory.lock();
        let now = Instant::now();
        inv.hosts
            .values()
            .map(|h| HostListing {
                report: h.report.clone(),
                up: h.up,
                last_seen_s: now.saturating_duration_since(h.last_seen).as_secs_f64(),
                gpus_reserved: h.reserved_gpus(),
            })
            .collect()
    }
}

/// The running plans receiving on `host`, whose transferd just restarted: its receivers
/// there are marked `lost` as of now (their sessions died with the process), so the plan
/// runner re-plans them on its next round as returned hosts (`receiver-returned`) instead
/// of waiting out its stall clock. With no lost grace a restart is not waited for: the
/// stall clock decides as before.
pub(super) fn restarted_receivers(st: &mut State, host: &str, grace: Duration) -> Vec<Event> {
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

/// A receiver's state is what it holds: a receiver of any plan (running or ended) marked
/// `lost` or `failed` whose latest heartbeat reports the plan's model complete in the
/// plan's tier (and resident on its GPUs, for tier gpu) is `done` again, with the time it
/// was seen; an ended plan's outcome is recomputed. Returns one event per such receiver.
pub(super) fn reconcile_receivers(st: &mut State, entry: &HostEntry) -> Vec<Event> {
    let host = entry.report.host_id.as_str();
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
        if !complete.contains(&(digest, DataTier::serving(tier))) {
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
