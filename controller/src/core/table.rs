//! The plans' table ([`State`]): every plan by id (running or ended), the channel each
//! running plan's watchers follow, and the index of the plans each host receives in.
//! Locked first when more than one lock is needed (see the `core` module docs); its
//! methods are pure bookkeeping, with no lock, clock or I/O of their own.

use std::collections::{BTreeMap, HashMap};

use shardcast_placement::Tier;
use tokio::sync::watch;

use crate::inventory::{DataTier, Pending};
use crate::plan::Plan;

/// The plans, their watchers and the receiver index (see the module docs).
#[derive(Default)]
pub(crate) struct State {
    pub(crate) plans: HashMap<String, Plan>,
    pub(crate) watchers: HashMap<String, watch::Sender<Plan>>,
    /// Host → the plans (running or ended) it is a receiver of, so a heartbeat looks only
    /// at its own plans (`hosts::reconcile_receivers`) instead of every plan ever made: with
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

    /// Bytes still to arrive on each host from plans in flight.
    pub(super) fn pending(&self) -> Pending {
        let mut p = Pending::new();
        for plan in self.plans.values().filter(|p| p.running()) {
            let tier = DataTier::serving(plan.tier);
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
            if !plan.running()
                || plan.digest != digest
                || DataTier::serving(plan.tier) != DataTier::serving(tier)
            {
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

    /// Hosts a running plan of `digest` (any tier) still moves it to (receiving, joined or
    /// loading) or waits for (lost less than `grace` before `now`), each with the plan: `Evict` refuses them
    /// (the partial copy is what the plan resumes from), and the autoscaler does not pick
    /// them as scale-down victims (their replicas are not serving yet).
    pub(crate) fn moving_to(&self, digest: &str, now: f64, grace: f64) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for plan in self.plans.values() {
            if !plan.running() || plan.digest != digest {
                continue;
            }
            for h in &plan.hosts {
                if h.state.is_active() || h.awaits_return(now, grace) {
                    out.entry(h.host.clone()).or_insert_with(|| plan.id.clone());
                }
            }
        }
        out
    }
}
