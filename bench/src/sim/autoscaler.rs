//! The controller's own autoscaler in a trace-driven run (`--autoscaler controller`): the
//! service `shardcast_controller::autoscaler::Autoscaler` — the one `ReportLoad` and the
//! scraper drive — deciding on the virtual clock, and acting through the simulator's
//! [`Fleet`].
//!
//! ```text
//!  workload tick ── ReportLoad (λ over 5 s, queue, μ) ──► Autoscaler (real)
//!                                                          │ scaling_view / scale_out / evict
//!                                                          ▼
//!                                         SimFleet ──► Controller (real) ──► SimAgents
//!                                           │ the technique's rules: the baseline's
//!                                           │ `sources: origin`, eviction without lazy
//!                                           ▼ eviction drops the copy; replicas stopped
//!                                         Datacenter (serving runtimes)
//! ```
//!
//! What differs from the `shardcast` scaler of [`super::scalers`], which calls the same
//! policy (`shardcast_policies::autoscale::decide`) directly: the service keeps its own
//! per-model state stamped on the controller's clock (`now_unix`, the tokio clock: virtual
//! here), counts replicas and takes the load time from the cluster (the controller's
//! [`ScalingView`]: the mean cold start of the latest receivers its plans finished, not the
//! simulator's mean over the run), and chooses the scale-down victims itself
//! (`shardcast_controller::autoscaler::scale_down_victims`: the newest hosts whose replicas
//! all serve and fit in the removal, never the last serving one). The victims' serving
//! runtimes stop their replicas at once.
//!
//! Partitioned bursts are not offered to the service: the simulated hosts do load
//! partitions (`sim::parts`, driven by the trace runs' direct scalers through
//! `sim::pipelines`), but the service's own burst path is not wired to the simulated fleet,
//! so the partition tables it asks are over a model source that has no profile
//! ([`NoPartitions`]) — the service then decides between whole replicas only, as the
//! controller does for a model registered without a profile before any host holds it.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use shardcast_controller::autoscaler::{Autoscaler, Fleet, ScalingView};
use shardcast_controller::burst::BurstPart;
use shardcast_controller::core::{Controller, EvictModel, Evicted, Prewarm, ScaleOut};
use shardcast_controller::error::{
    EvictError, LookupError, PartitionError, PlanRequestError, ScaleOutError,
};
use shardcast_controller::ops::{ReportLoad, Sources};
use shardcast_controller::plan::Accepted;
use shardcast_controller::ptables::{
    ModelSource, PartitionConfig, PartitionInputs, PartitionTables,
};
use shardcast_controller::state::StateStore;
use shardcast_placement::{Target, Tier};
use shardcast_policies::autoscale::ScalerConfig;

use super::coldstart::Cluster;
use super::scalers::RATE_WINDOW_S;
use super::store::MemStore;

/// What the fleet did since it was last asked ([`SimFleet::take_log`]).
#[derive(Debug, Default)]
pub struct FleetLog {
    /// Scale-outs the controller accepted.
    pub scale_ups: u32,
    /// Evictions the controller performed.
    pub scale_downs: u32,
    /// Actions the controller refused.
    pub errors: u32,
    /// The last refusal.
    pub last_error: String,
    /// Replica groups whose serving runtimes stopped (evicted).
    pub stopped: Vec<u64>,
}

/// The fleet the controller's autoscaler scales in a simulated run: the real controller's
/// operations, with the technique's rules and the simulated hosts' serving runtimes.
pub struct SimFleet {
    ctl: Arc<Controller>,
    dc: Arc<super::dc::Datacenter>,
    digest: String,
    /// The baseline: every new replica's host reads the origin (`Prewarm` of the new total
    /// with `sources: origin`) rather than the controller's `ScaleOut`.
    from_origin: bool,
    /// Evicted replicas' hosts keep their copy in memory.
    lazy_eviction: bool,
    log: Mutex<FleetLog>,
}

impl SimFleet {
    /// What happened since the last call.
    pub fn take_log(&self) -> FleetLog {
        std::mem::take(&mut *self.log.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn note(&self, f: impl FnOnce(&mut FleetLog)) {
        f(&mut self.log.lock().unwrap_or_else(PoisonError::into_inner));
    }
}

impl Fleet for SimFleet {
    fn scaling_view(&self, key: &str, tier: Tier) -> Result<ScalingView, LookupError> {
        self.ctl.scaling_view(key, tier)
    }

    fn scale_out(&self, req: ScaleOut) -> Result<Accepted, PlanRequestError> {
        let accepted = if self.from_origin {
            let now = self.ctl.scaling_view(&req.model, req.tier)?.replicas;
            self.ctl.prewarm(Prewarm {
                model: req.model,
                target: Target::Replicas(now + req.replicas),
                tier: req.tier,
                sources: Sources::Origin,
                transport: req.transport,
            })
        } else {
            self.ctl.scale_out(req)
        };
        match &accepted {
            Ok(a) => {
                let now = self.dc.now();
                for r in a.hosts.iter().filter(|r| r.gpus > 0) {
                    if let Some(h) = self.dc.host_index(&r.host) {
                        self.dc.expect_load(h, &self.digest, now);
                    }
                }
                self.note(|l| l.scale_ups += 1);
            }
            Err(e) => self.note(|l| {
                l.errors += 1;
                l.last_error = e.to_string();
            }),
        }
        accepted
    }

    async fn burst(
        &self,
        model: &str,
        _replicas: u32,
        _partitions: u32,
    ) -> Result<(Accepted, Vec<BurstPart>), ScaleOutError> {
        // Never offered ([`NoPartitions`]); refused if asked all the same.
        Err(PartitionError::NoProfileSource(model.to_string()).into())
    }

    async fn evict(&self, req: EvictModel) -> Result<Evicted, EvictError> {
        let (model, tier) = (req.model.clone(), req.tier);
        let evicted = match self.ctl.evict(req).await {
            Ok(e) => e,
            Err(e) => {
                self.note(|l| {
                    l.errors += 1;
                    l.last_error = e.to_string();
                });
                return Err(e);
            }
        };
        let mut stopped = Vec::new();
        for host in &evicted.evicted {
            if let Some(h) = self.dc.host_index(host) {
                stopped.extend(self.dc.unload_gpus(h, &self.digest));
            }
        }
        if tier == Tier::Gpu && !self.lazy_eviction && !evicted.evicted.is_empty() {
            if let Err(e) = self
                .ctl
                .evict(EvictModel {
                    model,
                    hosts: evicted.evicted.clone(),
                    tier: Tier::Memory,
                })
                .await
            {
                self.note(|l| {
                    l.errors += 1;
                    l.last_error = e.to_string();
                });
            }
        }
        self.note(|l| {
            l.scale_downs += 1;
            l.stopped.extend(stopped);
        });
        Ok(evicted)
    }
}

/// A model source with no profile and no holder to read one from: the partition tables
/// over it offer the autoscaler no partitioned burst (module docs).
pub struct NoPartitions;

impl ModelSource for NoPartitions {
    fn partition_inputs(&self, key: &str) -> Result<PartitionInputs, PartitionError> {
        Err(PartitionError::NoProfileSource(key.to_string()))
    }

    async fn tensor_index(
        &self,
        _host: &str,
        digest: &str,
    ) -> Result<Vec<(String, u64)>, PartitionError> {
        Err(PartitionError::NoProfileSource(digest.to_string()))
    }
}

/// The controller's autoscaler over a [`SimFleet`], and the arrivals it reports as the
/// model's rate.
pub struct ControllerScaler {
    service: Autoscaler<SimFleet, NoPartitions>,
    fleet: Arc<SimFleet>,
    /// Arrivals per tick, the last [`RATE_WINDOW_S`].
    arrivals: VecDeque<u64>,
}

impl ControllerScaler {
    /// The service over `cluster`'s controller for the model `digest`, deciding with the
    /// policy's defaults but `max_replicas` (the cluster's GPUs).
    pub fn new(
        cluster: &Cluster,
        digest: &str,
        from_origin: bool,
        lazy_eviction: bool,
        max_replicas: u32,
    ) -> anyhow::Result<Self> {
        let fleet = Arc::new(SimFleet {
            ctl: cluster.ctl.clone(),
            dc: cluster.dc.clone(),
            digest: digest.to_string(),
            from_origin,
            lazy_eviction,
            log: Mutex::default(),
        });
        let store: Arc<dyn StateStore> = Arc::new(MemStore::default());
        let tables =
            PartitionTables::restore(Arc::new(NoPartitions), store, PartitionConfig::default())
                .map_err(|e| anyhow::anyhow!("partition tables: {e}"))?;
        let service = Autoscaler::new(
            fleet.clone(),
            Arc::new(tables),
            cluster.ctl.events().clone(),
            cluster.ctl.usage().clone(),
        )
        .with_policy(ScalerConfig {
            max_replicas: max_replicas.max(1),
            ..ScalerConfig::default()
        });
        Ok(Self {
            service,
            fleet,
            arrivals: VecDeque::new(),
        })
    }

    /// One tick: `arrived` requests since the last, `queue_len` waiting, `service_rate` per
    /// replica. The service decides and acts; returns what the fleet did.
    pub async fn tick(
        &mut self,
        model: &str,
        arrived: u64,
        queue_len: usize,
        service_rate: f64,
    ) -> FleetLog {
        self.arrivals.push_back(arrived);
        while self.arrivals.len() > RATE_WINDOW_S as usize {
            self.arrivals.pop_front();
        }
        let rate = self.arrivals.iter().sum::<u64>() as f64 / self.arrivals.len() as f64;
        let report = ReportLoad {
            model: model.to_string(),
            arrival_rate: rate,
            queue_len: u32::try_from(queue_len).unwrap_or(u32::MAX),
            service_rate,
            tier: Tier::Gpu,
        };
        let outcome = self.service.report_load(report).await;
        let mut log = self.fleet.take_log();
        if let Err(e) = outcome {
            log.errors += 1;
            log.last_error = e.to_string();
        }
        log
    }
}
