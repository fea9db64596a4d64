//! `Evict`: a model's copies removed from hosts (or GPU slots released), refused while a
//! plan still moves the model there or waits for a host to return; down holders kept as
//! pending evictions, carried out when they heartbeat again.

use super::*;

impl Controller {
    /// `Evict`: remove the model's copy in `tier` from hosts.
    pub async fn evict(&self, req: EvictModel) -> Result<Evicted, EvictError> {
        let tier = req.tier;
        let (digest, targets, pending) = {
            let digest = self.registry.model(&req.model)?.digest;
            let st = lock(&self.state);
            let inv = self.inventory.lock();
            for h in &req.hosts {
                let e = inv
                    .hosts
                    .get(h)
                    .ok_or_else(|| HostUnavailable::Unknown(h.clone()))?;
                if tier != Tier::Gpu && !e.up {
                    return Err(HostUnavailable::Down(h.clone()).into());
                }
            }
            let targets: Vec<String> = if req.hosts.is_empty() {
                inv.hosts
                    .values()
                    .filter(|h| match tier {
                        Tier::Gpu => h.gpu_reserved.contains_key(&digest),
                        t => h.up && h.holding(&digest, DataTier::serving(t)).is_some(),
                    })
                    .map(|h| h.report.host_id.clone())
                    .collect()
            } else {
                req.hosts.clone()
            };
            // Every holder, and some are down: their copies go when they heartbeat again.
            let pending: Vec<String> = if req.hosts.is_empty() && tier != Tier::Gpu {
                inv.hosts
                    .values()
                    .filter(|h| !h.up && h.holding(&digest, DataTier::serving(tier)).is_some())
                    .map(|h| h.report.host_id.clone())
                    .collect()
            } else {
                Vec::new()
            };
            // Refuse while a plan still moves the model to one of them, or waits for one
            // to return (lost, or awaiting room): its partial copy is what it resumes from.
            let moving = st.moving_to(&digest, now_unix(), self.cfg.lost_grace.as_secs_f64());
            if let Some((host, plan)) = targets
                .iter()
                .find_map(|h| moving.get(h).map(|p| (h.clone(), p.clone())))
            {
                return Err(EvictError::StillMoving { plan, host });
            }
            (digest, targets, pending)
        };
        if !pending.is_empty() {
            let mut inv = self.inventory.lock();
            for h in &pending {
                if let Some(e) = inv.hosts.get_mut(h) {
                    let item = (digest.clone(), DataTier::serving(tier));
                    if !e.pending_evictions.contains(&item) {
                        e.pending_evictions.push(item);
                    }
                    let rec = StoredHost::of(e);
                    self.put_json(Table::Hosts, h, &rec)
                        .map_err(|e| EvictError::Store(e.to_string()))?;
                }
            }
            info!(model = %digest, ?tier, hosts = ?pending, "eviction pending: the hosts are down; their copies go when they heartbeat again");
        }
        let mut evicted = Vec::new();
        if tier == Tier::Gpu {
            let mut inv = self.inventory.lock();
            for h in &targets {
                if let Some(e) = inv.hosts.get_mut(h)
                    && e.gpu_reserved.remove(&digest).is_some()
                {
                    let rec = StoredHost::of(e);
                    self.put_json(Table::Hosts, h, &rec)
                        .map_err(|e| EvictError::Store(e.to_string()))?;
                    evicted.push(h.clone());
                }
            }
            self.cfg.metrics.evicted(tier.as_str(), evicted.len(), 0);
            return Ok(Evicted {
                evicted,
                bytes_freed: 0,
                pending,
            });
        }
        let mut failures = Vec::new();
        let mut bytes_freed = 0;
        for h in &targets {
            let r = async {
                let at = self.agent_at(h)?;
                self.agents
                    .evict_model(
                        &at,
                        crate::agents::Evict {
                            model: digest.clone(),
                            tier,
                            // No plan moves it to these hosts any more (checked above): a
                            // session left on one (a forwarder still waiting on a stopped hop)
                            // outlived its plan.
                            end_sessions: true,
                        },
                    )
                    .await
            }
            .await;
            match r {
                Ok(r) => {
                    bytes_freed += r;
                    let mut inv = self.inventory.lock();
                    if let Some(e) = inv.hosts.get_mut(h) {
                        e.forget(&digest, DataTier::serving(tier));
                        let before = e.pending_evictions.len();
                        e.pending_evictions
                            .retain(|(d, t)| !(*d == digest && *t == DataTier::serving(tier)));
                        if e.pending_evictions.len() != before {
                            let rec = StoredHost::of(e);
                            if let Err(err) = self.put_json(Table::Hosts, h, &rec) {
                                warn!(host = %h, "persisting a done pending eviction: {err}");
                            }
                        }
                    }
                    evicted.push(h.clone());
                }
                // The host never heard of the model: nothing to remove.
                Err(e) if e.failure == AgentFailure::NotFound => evicted.push(h.clone()),
                Err(e) => failures.push(e),
            }
        }
        info!(model = %digest, ?tier, hosts = ?evicted, bytes_freed, "evicted");
        self.cfg
            .metrics
            .evicted(tier.as_str(), evicted.len(), bytes_freed);
        match failures.into_iter().next() {
            None => Ok(Evicted {
                evicted,
                bytes_freed,
                pending,
            }),
            Some(first) => Err(EvictError::Partial { evicted, first }),
        }
    }
}
