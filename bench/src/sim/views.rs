//! What a simulated host says about itself: the model reports of the agent port
//! (`model_status`, `watch_model_status`) and the [`HostView`] its heartbeat carries, read
//! from the [`Dc`] state ([`super::dc`]).

use shardcast_controller::agents::{ModelReport, TierReport};
use shardcast_controller::inventory::{GpuInfo, GpuLoad, Holding, HostView};
use shardcast_controller::plan::GpuState;
use shardcast_protocol::DataTier;

use super::dc::Dc;

impl Dc {
    /// Verified bytes of host `h`'s copy of `digest` now.
    pub(super) fn verified(&self, h: usize, digest: &str) -> u64 {
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
        let partial = if c.complete_at.is_none() {
            c.partial
        } else {
            0.0
        };
        let own = (done + c.partial_bytes + (moving + partial) as u64).min(cat.model.bytes);
        // A host held for its gate ([`Dc::gate_of`]) has no more than the gate has.
        match self.gate_of(h, digest) {
            Some(g) if g != h => own.min(self.verified(g, digest)),
            _ => own,
        }
    }

    /// The host whose copy host `h`'s copy of `digest` waits for, if its flow brought every
    /// byte before that host had them (`super::dc::Delivery::gate`).
    pub(super) fn gate_of(&self, h: usize, digest: &str) -> Option<usize> {
        self.held
            .iter()
            .find(|(r, d, _, _)| *r == h && d == digest)
            .map(|x| x.3)
    }

    /// The GPU state names and bytes of host `h`'s loads of `digest` now, one per GPU.
    pub(super) fn gpu_report(&self, h: usize, digest: &str, now: f64) -> Vec<(String, u64)> {
        let (Some(loads), Some(cat)) = (self.hosts[h].gpus.get(digest), self.catalogue.get(digest))
        else {
            return Vec::new();
        };
        let bytes = cat.model.bytes;
        let mut out = Vec::new();
        for g in loads {
            if let Some(p) = &g.part {
                let (state, loaded) = super::parts::part_gpu_state(g, p, bytes, now);
                out.extend(std::iter::repeat_n(
                    (state.to_string(), loaded),
                    g.count.max(1) as usize,
                ));
                continue;
            }
            let (state, loaded) = match (g.resident, g.window) {
                (true, _) => (GpuState::Resident, bytes),
                (false, Some((start, end))) if end > start => {
                    let f = ((now - start) / (end - start)).clamp(0.0, 1.0);
                    (GpuState::Loading, (bytes as f64 * f) as u64)
                }
                _ => (GpuState::Loading, 0),
            };
            out.extend(std::iter::repeat_n(
                (state.to_string(), loaded),
                g.count.max(1) as usize,
            ));
        }
        out
    }

    pub(super) fn report(&self, h: usize, digest: &str, now: f64) -> Option<ModelReport> {
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
    pub(super) fn moving(&self, h: usize, digest: &str) -> bool {
        let host = &self.hosts[h];
        host.copies
            .get(digest)
            .is_some_and(|c| !c.incoming.is_empty())
            || self.gate_of(h, digest).is_some()
            || host.gpus.get(digest).is_some_and(|loads| {
                loads.iter().any(|g| match &g.part {
                    Some(p) => super::parts::part_moving(g, p),
                    None => g.window.is_some() && !g.resident,
                })
            })
    }

    pub(super) fn host_view(&self, h: usize) -> HostView {
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
        let mut first_gpu = 0;
        let gpu_loads = host
            .gpus
            .iter()
            .flat_map(|(digest, loads)| loads.iter().map(move |g| (digest, g)))
            .map(|(digest, g)| {
                let gpus = (first_gpu..first_gpu + g.count).collect();
                first_gpu += g.count;
                let (state, partition, error) = match &g.part {
                    Some(p) => (
                        super::parts::part_gpu_state(g, p, 0, f64::NEG_INFINITY).0,
                        p.label.clone(),
                        p.failed.clone().unwrap_or_default(),
                    ),
                    None if g.resident => (GpuState::Resident, String::new(), String::new()),
                    None => (GpuState::Loading, String::new(), String::new()),
                };
                GpuLoad {
                    digest: digest.clone(),
                    state,
                    gpus,
                    partition,
                    error,
                }
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
}
