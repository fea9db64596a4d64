//! The controller's services, wired together: the core (`crate::core`: registry,
//! inventory, plans, bursts, eviction) and the services around it, each holding only the
//! handles it needs:
//!
//! * the partition-plan tables ([`PartitionTables`]) read models through [`ModelSource`];
//! * the autoscaler ([`Autoscaler`]) scales a [`Fleet`] and asks the tables for bursts;
//! * the tier sweeper ([`TierSweeper`]) sees hosts' tiers and evicts through [`TierTarget`];
//! * the scraper (`crate::scrape::run`) feeds the autoscaler through [`LoadSink`];
//! * the [`EventLog`] and the last-use record ([`Usage`](crate::usage::Usage)) are shared values.
//!
//! The core knows none of them: the traits are implemented here, over the core's state.
//! Both front ends (`crate::grpc`, `crate::http`) serve a [`Services`].

use std::collections::HashMap;
use std::sync::Arc;

use shardcast_placement::Tier;

use crate::events::Event;
use tokio_util::sync::CancellationToken;

use crate::autoscaler::{Autoscaler, Fleet, Holder, ScalingView};
use crate::burst::{BurstPart, MAX_PARTITIONS};
use crate::core::{
    Controller, ControllerConfig, EvictModel, Evicted, ScaleOut, lock, now_unix, parse_profile,
};
use crate::error::{
    ApiError, EvictError, LoadError, LookupError, PartitionError, PlanRequestError, ScaleOutError,
};
use crate::events::EventLog;
use crate::inventory::DataTier;
use crate::plan::{Accepted, ReceiverState};
use crate::ptables::{
    HostLink, ModelSource, PartitionConfig, PartitionInputs, PartitionTables, slowest_nic,
};
use crate::scrape::{LoadSink, ScrapeConfig};
use crate::state::StateStore;
use crate::tiers::{
    HostTiers, StaleBooking, TierConfig, TierCopy, TierSweeper, TierTarget, stale_booking,
};

/// The whole controller's settings: the core's and the services'.
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// The core: heartbeats, placement, plans, identity, origins.
    pub core: ControllerConfig,
    /// Host memory and disk tiers kept under their watermarks.
    pub tiers: TierConfig,
    /// Scrape load from a Prometheus endpoint.
    pub scrape: Option<ScrapeConfig>,
    /// Partition planning's rates.
    pub partitions: PartitionConfig,
}

/// The partition tables over the core.
pub type Tables = PartitionTables<Controller>;

/// The autoscaler over the core.
pub type Scaler = Autoscaler<ClusterFleet, Controller>;

/// The controller: the core and its services.
pub struct Services {
    /// Registry, inventory, plans, bursts, eviction.
    pub core: Arc<Controller>,
    /// Partition-plan tables.
    pub tables: Arc<Tables>,
    /// The autoscaler.
    pub autoscaler: Arc<Scaler>,
    /// The tier sweeper.
    pub sweeper: Arc<TierSweeper<Controller>>,
}

impl Services {
    /// The leader's controller: loads the state, resumes plans in flight, and starts the
    /// tier sweeper and the scraper (when configured) until `cancel`.
    pub fn open(
        cfg: &Config,
        store: Arc<dyn StateStore>,
        cancel: CancellationToken,
    ) -> Result<Arc<Self>, ApiError> {
        let core = Controller::open(cfg.core.clone(), store, cancel.clone())?;
        let me = Self::wire(cfg, core)?;
        if cfg.tiers.enabled {
            tokio::spawn(me.sweeper.clone().run(cancel.clone()));
        }
        if let Some(s) = cfg.scrape.clone() {
            tokio::spawn(crate::scrape::run(
                s,
                cfg.core.tls.clone(),
                me.autoscaler.clone(),
                cancel,
            ));
        }
        Ok(me)
    }

    /// A follower's read-only view (`crate::ha`): nothing runs, writes are refused.
    pub fn open_read_only(
        cfg: &Config,
        store: Arc<dyn StateStore>,
        cancel: CancellationToken,
    ) -> Result<Arc<Self>, ApiError> {
        Self::wire(
            cfg,
            Controller::open_read_only(cfg.core.clone(), store, cancel)?,
        )
    }

    fn wire(cfg: &Config, core: Arc<Controller>) -> Result<Arc<Self>, ApiError> {
        let store = core.store_handle();
        let tables = Arc::new(PartitionTables::restore(
            core.clone(),
            store.clone(),
            cfg.partitions,
        )?);
        // Weak: the core holds the hook, the tables hold the core.
        let weak = Arc::downgrade(&tables);
        core.after_register(Arc::new(move |name| {
            let tables = weak.clone();
            Box::pin(async move {
                if let Some(t) = tables.upgrade() {
                    t.precompute(&name).await;
                }
            })
        }));
        let fleet = Arc::new(ClusterFleet {
            core: core.clone(),
            tables: tables.clone(),
        });
        let autoscaler = Arc::new(Autoscaler::new(
            fleet,
            tables.clone(),
            core.events().clone(),
            core.usage().clone(),
        ));
        let sweeper = Arc::new(TierSweeper::new(
            cfg.tiers.clone(),
            core.clone(),
            core.usage().clone(),
            core.events().clone(),
            store,
        ));
        Ok(Arc::new(Self {
            core,
            tables,
            autoscaler,
            sweeper,
        }))
    }

    /// Decisions and plan events.
    pub fn events(&self) -> &EventLog {
        self.core.events()
    }

    /// `ScaleOut` as the API serves it: a partitioned burst when `partitions > 1`, else
    /// whole replicas by chain plans.
    pub async fn scale_out(&self, req: ScaleOut) -> Result<Accepted, ScaleOutError> {
        if req.partitions > 1 {
            let tier = req.tier;
            if tier != Tier::Gpu {
                return Err(PlanRequestError::Invalid(format!(
                    "partitions need tier gpu (a partition is a GPU load), got {tier}"
                ))
                .into());
            }
            return Ok(burst(
                &self.core,
                &self.tables,
                &req.model,
                req.replicas,
                req.partitions,
            )
            .await?
            .0);
        }
        Ok(self.core.scale_out(req)?)
    }
}

/// A partitioned burst: the plan from the tables, then the core starts it.
async fn burst(
    core: &Arc<Controller>,
    tables: &Tables,
    model: &str,
    replicas: u32,
    partitions: u32,
) -> Result<(Accepted, Vec<BurstPart>), ScaleOutError> {
    if replicas == 0 {
        return Err(PlanRequestError::Invalid("replicas must be at least 1".into()).into());
    }
    if !(2..=MAX_PARTITIONS).contains(&partitions) {
        return Err(PlanRequestError::Invalid(format!(
            "partitions must be between 2 and {MAX_PARTITIONS} (1 is a whole replica: leave it 0)"
        ))
        .into());
    }
    let plan = tables.burst_plan(model, partitions, 1).await?;
    Ok(core.burst(model, replicas, plan).await?)
}

/// The cluster as the autoscaler scales it: the core, plus the tables for bursts.
pub struct ClusterFleet {
    core: Arc<Controller>,
    tables: Arc<Tables>,
}

impl Fleet for ClusterFleet {
    fn scaling_view(&self, key: &str, tier: Tier) -> Result<ScalingView, LookupError> {
        self.core.scaling_view(key, tier)
    }

    fn scale_out(&self, req: ScaleOut) -> Result<Accepted, PlanRequestError> {
        self.core.scale_out(req)
    }

    async fn burst(
        &self,
        model: &str,
        replicas: u32,
        partitions: u32,
    ) -> Result<(Accepted, Vec<BurstPart>), ScaleOutError> {
        burst(&self.core, &self.tables, model, replicas, partitions).await
    }

    async fn evict(&self, req: EvictModel) -> Result<Evicted, EvictError> {
        self.core.evict(req).await
    }
}

impl LoadSink for Scaler {
    async fn report_load(&self, req: crate::ops::ReportLoad) -> Result<Event, LoadError> {
        Self::report_load(self, req).await
    }
}

impl ModelSource for Controller {
    fn partition_inputs(&self, key: &str) -> Result<PartitionInputs, PartitionError> {
        let m = self.registry().model(key)?;
        let inv = self.inventory.lock();
        let profile = m
            .profile
            .as_deref()
            .map(parse_profile)
            .transpose()
            .map_err(|why| PartitionError::BadStoredProfile {
                name: m.name.clone(),
                why,
            })?;
        let holder = inv
            .hosts
            .values()
            .find(|h| {
                h.up && h
                    .holding(&m.digest, DataTier::Memory)
                    .is_some_and(|x| x.complete)
            })
            .map(|h| h.report.host_id.clone());
        let smallest_gpu = inv
            .hosts
            .values()
            .flat_map(|h| h.report.gpus.iter().map(|g| g.memory_bytes))
            .filter(|&b| b > 0)
            .min();
        let slowest_nic = slowest_nic(inv.hosts.values().map(|h| HostLink {
            up: h.up,
            nic_bps: h.report.nic_bps,
            gpus: h.report.gpus.len(),
        }));
        Ok(PartitionInputs {
            name: m.name,
            digest: m.digest,
            profile,
            holder,
            smallest_gpu,
            slowest_nic,
            default_nic_bps: self.config().plan.default_nic_bps,
        })
    }

    async fn tensor_index(
        &self,
        host: &str,
        digest: &str,
    ) -> Result<Vec<(String, u64)>, PartitionError> {
        let at = self.agent_at(host)?;
        let json = self.agents().handoff(&at, digest).await?;
        let v: serde_json::Value =
            serde_json::from_str(&json).map_err(|e| PartitionError::BadHandoff {
                host: host.to_string(),
                why: e.to_string(),
            })?;
        Ok(v["tensors"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|t| Some((t["name"].as_str()?.to_string(), t["nbytes"].as_u64()?)))
                    .collect()
            })
            .unwrap_or_default())
    }
}

impl TierTarget for Controller {
    fn tier_view(&self, origins_durable: bool) -> Vec<HostTiers> {
        let models: HashMap<String, crate::model::ModelRecord> = self
            .registry()
            .all()
            .into_iter()
            .map(|m| (m.digest.clone(), m))
            .collect();
        let st = lock(&self.state);
        let inv = self.inventory.lock();
        let copies = |digest: &str| -> u32 {
            inv.hosts
                .values()
                .filter(|h| h.up)
                .map(|h| {
                    DataTier::ALL
                        .iter()
                        .filter(|t| h.holding(digest, **t).is_some_and(|x| x.complete))
                        .count() as u32
                })
                .sum()
        };
        let busy = |host: &str, digest: &str| -> bool {
            st.plans.values().any(|p| {
                p.running()
                    && p.digest == digest
                    && (p
                        .hosts
                        .iter()
                        .any(|h| h.host == host && h.state.is_active())
                        || p.chains.iter().any(|c| c.source == host))
            })
        };
        inv.hosts
            .values()
            .filter(|h| h.up)
            .map(|h| {
                let r = &h.report;
                let items = r
                    .holdings
                    .iter()
                    .map(|x| {
                        let m = models.get(&x.digest);
                        TierCopy {
                            tier: x.tier,
                            digest: x.digest.clone(),
                            name: m.map_or_else(|| x.name.clone(), |m| m.name.clone()),
                            bytes: x.bytes_verified,
                            pinned: busy(&r.host_id, &x.digest)
                                || (x.tier == DataTier::Memory
                                    && h.gpu_reserved.contains_key(&x.digest)),
                            copies: copies(&x.digest),
                            registered: m.is_some(),
                            origin_available: origins_durable
                                && m.is_some_and(|m| !m.origin.is_empty()),
                        }
                    })
                    .collect();
                // The tiers' own share: what the store holds plus the free space. Files of
                // other programs on the same filesystem are not the cache's to make room
                // for (evicting models would not free them).
                let held = |tier: DataTier| -> u64 {
                    r.holdings
                        .iter()
                        .filter(|x| x.tier == tier)
                        .map(|x| x.bytes_verified)
                        .sum()
                };
                let (mem_used, disk_used) = (held(DataTier::Memory), held(DataTier::Disk));
                HostTiers {
                    host: r.host_id.clone(),
                    mem_capacity: mem_used
                        .saturating_add(r.mem_free)
                        .min(r.mem_capacity.max(mem_used)),
                    mem_used,
                    disk_capacity: disk_used
                        .saturating_add(r.disk_free)
                        .min(r.disk_capacity.max(disk_used)),
                    disk_used,
                    items,
                }
            })
            .collect()
    }

    fn stale_gpu_bookings(&self) -> Vec<StaleBooking> {
        let st = lock(&self.state);
        let inv = self.inventory.lock();
        let grace = self.config().heartbeat * 2;
        let mut out = Vec::new();
        for h in inv.hosts.values().filter(|h| h.up) {
            let host = &h.report.host_id;
            for digest in h.gpu_reserved.keys() {
                let fresh = h
                    .booked_at
                    .get(digest)
                    .is_some_and(|at| h.last_seen.saturating_duration_since(*at) < grace);
                let moving = st.plans.values().any(|p| {
                    p.running()
                        && p.digest == *digest
                        && p.hosts
                            .iter()
                            .any(|x| x.host == *host && x.state.is_active())
                });
                if fresh || moving {
                    continue;
                }
                if let Some(why) = stale_booking(digest, &h.report.gpu_loads, &h.report.gpu_evicted)
                {
                    let name = self
                        .registry()
                        .name_of(digest)
                        .unwrap_or_else(|| digest.clone());
                    out.push(StaleBooking {
                        host: host.clone(),
                        digest: digest.clone(),
                        name,
                        why,
                    });
                }
            }
        }
        out
    }

    fn release_gpu_slot(&self, host: &str, digest: &str) {
        Self::release_gpu_slot(self, host, digest)
    }

    fn pending_evictions(&self) -> Vec<(String, String, DataTier)> {
        let mut inv = self.inventory.lock();
        let mut out = Vec::new();
        for h in inv.hosts.values_mut().filter(|h| h.up) {
            // A copy the host no longer reports (it was evicted some other way): done.
            let mut due = std::mem::take(&mut h.pending_evictions);
            due.retain(|(d, t)| h.holding(d, *t).is_some());
            h.pending_evictions = due;
            for (d, t) in &h.pending_evictions {
                out.push((h.report.host_id.clone(), d.clone(), *t));
            }
        }
        out
    }

    async fn evict(&self, req: EvictModel) -> Result<Evicted, EvictError> {
        Self::evict(self, req).await
    }
}

impl Controller {
    /// A model's replicas in `tier`, for the autoscaler: every live holder with its replica
    /// count and whether a plan still moves the model there (what `Evict` refuses), and the
    /// load time ([`crate::autoscaler::measured_load_time`], else an estimate at the
    /// default NIC rate).
    pub fn scaling_view(&self, key: &str, tier: Tier) -> Result<ScalingView, LookupError> {
        let m = self.registry().model(key)?;
        let st = lock(&self.state);
        let inv = self.inventory.lock();
        let moving = st.moving_to(
            &m.digest,
            now_unix(),
            self.config().lost_grace.as_secs_f64(),
        );
        let mut holders: Vec<Holder> = inv
            .hosts
            .values()
            .filter(|h| h.up)
            .filter_map(|h| {
                let replicas = match tier {
                    Tier::Gpu => h.gpu_reserved.get(&m.digest).copied()?,
                    t => {
                        let held = h.holding(&m.digest, DataTier::serving(t))?;
                        if !held.complete {
                            return None;
                        }
                        1
                    }
                };
                let host = h.report.host_id.clone();
                Some(Holder {
                    loading: moving.contains_key(&host),
                    host,
                    replicas,
                })
            })
            .collect();
        // Oldest holder first: by when the latest plan of this model and tier that brought
        // it to the host was made (a receiver that held it before the plan, `local`, does
        // not count; a host no stored plan names — the importing host, or one whose plans
        // aged out — counts as oldest), then by id. A scale-down takes the newest replicas
        // first.
        let mut added_at: HashMap<&str, f64> = HashMap::new();
        for p in st
            .plans
            .values()
            .filter(|p| p.digest == m.digest && p.tier == tier)
        {
            for r in p.hosts.iter().filter(|r| r.state != ReceiverState::Local) {
                let at = added_at.entry(r.host.as_str()).or_insert(p.created_at);
                *at = at.max(p.created_at);
            }
        }
        let when = |h: &Holder| {
            added_at
                .get(h.host.as_str())
                .copied()
                .unwrap_or(f64::NEG_INFINITY)
        };
        holders.sort_by(|a, b| {
            when(a)
                .total_cmp(&when(b))
                .then_with(|| a.host.cmp(&b.host))
        });
        let replicas = match tier {
            Tier::Gpu => inv.gpu_reserved(&m.digest),
            t => (holders.len() + st.in_flight(&m.digest, t).len()) as u32,
        };
        let measured = crate::autoscaler::measured_load_time(st.plans.values(), &m.digest, tier);
        let load_time_s = measured.unwrap_or_else(|| {
            m.total_bytes as f64 / self.config().plan.default_nic_bps.max(1) as f64
        });
        Ok(ScalingView {
            name: m.name.clone(),
            digest: m.digest.clone(),
            replicas,
            load_time_s,
            holders,
        })
    }
}
