//! A per-plan view of the cluster for one model: built in one pass over the hosts, it looks
//! the model up once in each host's holdings (never the other models), so every later step
//! works on plain flags and indices.
//!
//! Host ids are expected to be unique (the controller's inventory is keyed by id). If an id
//! repeats, the first entry wins and later ones are ignored, so no host is ever picked twice.

use std::collections::HashMap;

use crate::{HostInfo, PlanParams, Tier};

/// One host as seen by one plan.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostView<'a> {
    pub(crate) info: &'a HostInfo,
    /// The host's rack, `None` when unknown (an unknown rack never matches another).
    pub(crate) rack: Option<&'a str>,
    /// Complete verified copy in the memory tier.
    pub(crate) mem: bool,
    /// Complete verified copy in the disk tier.
    pub(crate) disk: bool,
    /// Already receiving the model in a plan in flight (listed in `in_flight`, or marked by
    /// [`crate::reserve`]).
    pub(crate) joined: bool,
}

impl HostView<'_> {
    /// Whether the host holds the model in the tier a request for `tier` needs
    /// (`Gpu` needs the memory tier).
    pub(crate) fn holds(&self, tier: Tier) -> bool {
        match tier {
            Tier::Memory | Tier::Gpu => self.mem,
            Tier::Disk => self.disk,
        }
    }

    /// The tier this host would serve the model from as a source, if any: memory before disk.
    /// Hosts that are down or still receiving the model are never sources.
    pub(crate) fn source_tier(&self) -> Option<Tier> {
        if !self.info.up || self.joined {
            None
        } else if self.mem {
            Some(Tier::Memory)
        } else if self.disk {
            Some(Tier::Disk)
        } else {
            None
        }
    }
}

/// The cluster for one model.
#[derive(Debug)]
pub(crate) struct ClusterView<'a> {
    /// First entry of each host id, in cluster order.
    pub(crate) hosts: Vec<HostView<'a>>,
    /// Host id to index into `hosts`.
    pub(crate) by_id: HashMap<&'a str, usize>,
}

impl<'a> ClusterView<'a> {
    pub(crate) fn new(cluster: &'a [HostInfo], model_key: &str, in_flight: &[String]) -> Self {
        let mut hosts = Vec::with_capacity(cluster.len());
        let mut by_id = HashMap::with_capacity(cluster.len());
        for info in cluster {
            if by_id.contains_key(info.id.as_str()) {
                continue;
            }
            by_id.insert(info.id.as_str(), hosts.len());
            let held = info.holdings.get(model_key);
            hosts.push(HostView {
                info,
                rack: (!info.rack.is_empty()).then_some(info.rack.as_str()),
                mem: held.is_some_and(|h| h.memory),
                disk: held.is_some_and(|h| h.disk),
                joined: held.is_some_and(|h| h.receiving),
            });
        }
        for id in in_flight {
            if let Some(&i) = by_id.get(id.as_str()) {
                if let Some(h) = hosts.get_mut(i) {
                    h.joined = true;
                }
            }
        }
        Self { hosts, by_id }
    }

    pub(crate) fn get(&self, id: &str) -> Option<&HostView<'a>> {
        self.by_id.get(id).and_then(|&i| self.hosts.get(i))
    }

    /// Number of hosts that are up.
    pub(crate) fn live(&self) -> usize {
        self.hosts.iter().filter(|h| h.info.up).count()
    }
}

/// A host's NIC rate for estimates: the reported rate, or the configured default when the
/// host reports 0 (unknown), never below 1 byte/s.
pub(crate) fn nic_bps(info: Option<&HostInfo>, params: &PlanParams) -> u64 {
    match info {
        Some(h) if h.nic_bps > 0 => h.nic_bps,
        _ => params.default_nic_bps.max(1),
    }
}
