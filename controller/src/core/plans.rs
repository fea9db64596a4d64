//! Plan creation: `Prewarm` and `ScaleOut` validated, placed (`placement::plan`),
//! recorded with their GPU slots and persisted holding the plans' and hosts' locks, then handed to the runner;
//! plan lookups and watches.

use super::*;

impl Controller {
    /// `Prewarm`: make `replicas` replicas (or the named hosts) hold the model. Under a
    /// `prewarm` span (model, tier, the plan it made), the parent of the plan's run.
    #[tracing::instrument(name = "prewarm", skip_all, fields(model = %req.model, tier = ?req.tier, plan = tracing::field::Empty))]
    pub fn prewarm(self: &Arc<Self>, req: Prewarm) -> Result<Accepted, PlanRequestError> {
        let tier = req.tier;
        let target = req.target;
        if target == Target::Replicas(0) {
            return Err(PlanRequestError::Invalid(
                "replicas must be at least 1 (or name the hosts)".into(),
            ));
        }
        let transport = req.transport.unwrap_or(self.cfg.transport);
        let each_from_origin = req.sources == Sources::Origin;
        let accepted = self.make_plan(
            &req.model,
            tier,
            (each_from_origin, transport),
            |_, inv, m| {
                // GPU slots are counted by reservation: a gpu prewarm of k makes sure k slots are
                // reserved for the model, reserving only the missing ones.
                if tier == Tier::Gpu
                    && let Target::Replicas(k) = target
                {
                    let have = inv.gpu_reserved(&m.digest);
                    return Ok((have < k).then(|| Target::Replicas(k - have)));
                }
                Ok(Some(target.clone()))
            },
        )?;
        tracing::Span::current().record("plan", accepted.plan_id.as_str());
        Ok(accepted)
    }

    /// What a partitioned burst needs from the controller's state: the model, its
    /// manifest, the data addresses of the live hosts holding it in memory (the
    /// partitions' sources, used in turn) and the hosts with a free GPU slot and no GPU
    /// replica of the model: those already holding the data first (nothing to fetch), then
    /// by free slots.
    #[allow(clippy::type_complexity)]
    pub(crate) fn burst_inputs(
        &self,
        key: &str,
    ) -> Result<(ModelRecord, Arc<Vec<u8>>, Vec<String>, Vec<String>), PlanRequestError> {
        let m = self.registry.model(key)?;
        let manifest = self
            .registry
            .manifest(&m.digest)
            .ok_or_else(|| PlanRequestError::NoManifest(m.name.clone()))?;
        let inv = self.inventory.lock();
        let holds = |h: &HostEntry| {
            h.holding(&m.digest, DataTier::Memory)
                .is_some_and(|x| x.complete)
        };
        let holders: Vec<String> = inv
            .hosts
            .values()
            .filter(|h| h.up && holds(h))
            .map(|h| h.report.data_addr.clone())
            .collect();
        let mut free: Vec<(bool, u32, String)> = inv
            .hosts
            .values()
            .filter(|h| h.up && !h.gpu_reserved.contains_key(&m.digest))
            .filter_map(|h| {
                let slots = (h.report.gpus.len() as u32)
                    .saturating_sub(h.report.gpus_busy)
                    .saturating_sub(h.reserved_gpus());
                (slots > 0).then(|| (holds(h), slots, h.report.host_id.clone()))
            })
            .collect();
        free.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        Ok((
            m,
            manifest,
            holders,
            free.into_iter().map(|(_, _, h)| h).collect(),
        ))
    }

    /// Books one GPU slot of `digest` on `host` (a burst partition), persisted like a
    /// plan's reservation.
    pub(crate) fn reserve_gpu_slot(
        &self,
        host: &str,
        digest: &str,
    ) -> Result<(), PlanRequestError> {
        let st = lock(&self.state);
        let mut inv = self.inventory.lock();
        let Some(h) = inv.hosts.get_mut(host) else {
            return Err(HostUnavailable::Unknown(host.to_string()).into());
        };
        *h.gpu_reserved.entry(digest.to_string()).or_default() += 1;
        h.booked_at.insert(digest.to_string(), Instant::now());
        let rec = StoredHost::of(h);
        drop(st);
        self.put_json(Table::Hosts, host, &rec)
            .map_err(|e| PlanRequestError::Store(e.message))
    }

    /// Releases what [`reserve_gpu_slot`](Self::reserve_gpu_slot) booked.
    pub(crate) fn release_gpu_slot(&self, host: &str, digest: &str) {
        let st = lock(&self.state);
        let mut inv = self.inventory.lock();
        if let Some(h) = inv.hosts.get_mut(host)
            && h.gpu_reserved.remove(digest).is_some()
        {
            let rec = StoredHost::of(h);
            drop(st);
            let _ = self.put_json(Table::Hosts, host, &rec);
        }
    }

    /// The heaviness of a model for `LoadModel` (Torpor §5.3) from its registered profile:
    /// PCIe load time of its weights over its execution time. Empty (the host's default)
    /// without a profile.
    pub(crate) fn heaviness_of(&self, digest: &str) -> String {
        let profile = self.registry.by_digest(digest).and_then(|m| m.profile);
        let Some(p) = profile.and_then(|j| parse_profile(&j).ok()) else {
            return String::new();
        };
        let h = shardcast_policies::evict::heaviness(
            p.total_bytes(),
            self.cfg.pcie_bps,
            p.total_exec_s(),
            &shardcast_policies::evict::HeavinessThresholds::default(),
        );
        format!("{h:?}").to_lowercase()
    }

    /// `ScaleOut`: `replicas` more replicas than exist now.
    pub fn scale_out(self: &Arc<Self>, req: ScaleOut) -> Result<Accepted, PlanRequestError> {
        let tier = req.tier;
        if req.replicas == 0 {
            return Err(PlanRequestError::Invalid(
                "replicas must be at least 1".into(),
            ));
        }
        let transport = req.transport.unwrap_or(self.cfg.transport);
        self.make_plan(&req.model, tier, (false, transport), |st, inv, m| {
            let current: u32 = match tier {
                // Placement sees only free GPU slots: ask for the additional ones.
                Tier::Gpu => return Ok(Some(Target::Replicas(req.replicas))),
                _ => {
                    let held = inv
                        .hosts
                        .values()
                        .filter(|h| {
                            h.up && h
                                .holding(&m.digest, DataTier::serving(tier))
                                .is_some_and(|x| x.complete)
                        })
                        .count();
                    (held + st.in_flight(&m.digest, tier).len()) as u32
                }
            };
            Ok(Some(Target::Replicas(current.saturating_add(req.replicas))))
        })
    }

    pub(super) fn make_plan(
        self: &Arc<Self>,
        key: &str,
        tier: Tier,
        (each_from_origin, transport): (bool, shardcast_protocol::HopTransport),
        target: impl FnOnce(
            &State,
            &HostTable,
            &ModelRecord,
        ) -> Result<Option<Target>, PlanRequestError>,
    ) -> Result<Accepted, PlanRequestError> {
        let model = self.registry.model(key)?;
        let mut st = lock(&self.state);
        let mut inv = self.inventory.lock();
        self.usage.touch(&model.digest);
        let target = target(&st, &inv, &model)?;
        let in_flight = st.in_flight(&model.digest, tier);
        let in_flight_hosts: Vec<String> = in_flight.keys().cloned().collect();
        let cluster = inventory::cluster_view(&inv.hosts, &model.digest, &st.pending());
        let spec = model.spec();
        let mut plan = match target {
            Some(target) => {
                let req = placement::PlanRequest {
                    model: &spec,
                    target,
                    tier,
                    in_flight: &in_flight_hosts,
                };
                placement::plan(&cluster, &req, &self.cfg.plan).map_err(plan_error)?
            }
            // Already satisfied: the hosts with reserved GPU slots, nothing to move.
            None => placement::Plan {
                receivers: inv
                    .hosts
                    .values()
                    .filter(|h| h.gpu_reserved.contains_key(&model.digest))
                    .map(|h| Receiver {
                        host: h.report.host_id.clone(),
                        gpus: 0,
                        kind: ReceiverKind::Local,
                    })
                    .collect(),
                chains: Vec::new(),
                estimate_s: 0.0,
            },
        };
        if each_from_origin {
            plan = origin_each(plan, &spec, &self.cfg.plan);
        }

        let id = hex::encode(rand::random::<[u8; 8]>());
        let mut source_of: HashMap<String, String> = HashMap::new();
        let mut chains = Vec::new();
        let mut runs = Vec::new();
        for c in &plan.chains {
            let (source, source_tier) = match &c.source {
                Source::Origin => ("origin".to_string(), "origin".to_string()),
                Source::Peer { host, tier } => (host.clone(), tier.to_string()),
            };
            for h in &c.hops {
                source_of.entry(h.clone()).or_insert_with(|| source.clone());
            }
            chains.push(ChainSummary {
                source: source.clone(),
                source_tier,
                hops: c.hops.clone(),
                shards: c.shards.clone(),
                bytes: c.bytes,
                estimate_s: c.estimate_s,
            });
            runs.push(chain_run(&c.source, &c.hops, &c.shards));
        }
        let total = model.total_bytes;
        let hosts: Vec<ReceiverProgress> = plan
            .receivers
            .iter()
            .map(|r: &Receiver| {
                let (state, source, bytes) = match r.kind {
                    // Already in memory; with GPU slots to fill it still has to load.
                    ReceiverKind::Local if tier == Tier::Gpu && r.gpus > 0 => {
                        (ReceiverState::Loading, "local".to_string(), total)
                    }
                    ReceiverKind::Local => (ReceiverState::Local, "local".to_string(), total),
                    ReceiverKind::Joined => (
                        ReceiverState::Joined,
                        in_flight.get(&r.host).cloned().unwrap_or_default(),
                        0,
                    ),
                    ReceiverKind::New => (
                        ReceiverState::Pending,
                        source_of.get(&r.host).cloned().unwrap_or_default(),
                        0,
                    ),
                };
                let mut h = ReceiverProgress::new(r.host.clone(), state);
                h.bytes = bytes;
                h.total = total;
                h.source = source;
                h.gpus = r.gpus;
                h
            })
            .collect();
        let record = Plan {
            estimate_s: plan.estimate_s,
            chains: chains.clone(),
            runs,
            transport,
            ..Plan::started(
                id.clone(),
                (model.name.clone(), model.digest.clone()),
                tier,
                PlanKind::Chains,
                hosts.clone(),
                model.reads_from().to_string(),
                now_unix(),
            )
        };
        // GPU slots are reserved when the plan is made.
        let mut touched = Vec::new();
        if tier == Tier::Gpu {
            for r in &plan.receivers {
                if r.gpus > 0
                    && let Some(h) = inv.hosts.get_mut(&r.host)
                {
                    *h.gpu_reserved.entry(model.digest.clone()).or_default() += r.gpus;
                    h.booked_at.insert(model.digest.clone(), Instant::now());
                    touched.push(StoredHost::of(h));
                }
            }
        }
        // Durable before any chain starts.
        let stored = |e: ApiError| PlanRequestError::Store(e.message);
        self.persist_plan_now(&record).map_err(stored)?;
        for t in touched {
            self.put_json(Table::Hosts, &t.host.host_id, &t)
                .map_err(stored)?;
        }
        st.add_plan(record);
        drop(st);
        info!(plan = %id, model = %model.name, ?tier, receivers = plan.receivers.len(), chains = chains.len(), estimate_s = plan.estimate_s, "plan made");
        // One span per plan run, from its first chain to its end (`state` recorded then);
        // a child of the API call's span (`prewarm`) where there is one.
        let span = tracing::info_span!("plan", plan = %id, model = %model.name, tier = ?tier, receivers = plan.receivers.len(), chains = chains.len(), state = tracing::field::Empty);
        tokio::spawn(tracing::Instrument::instrument(
            self.clone().run_plan(id.clone()),
            span,
        ));
        Ok(Accepted {
            plan_id: id,
            estimate_s: plan.estimate_s,
            chains,
            hosts,
        })
    }

    /// Queues the plan (as its versioned record; progress: the newest record wins,
    /// committed within `write_behind::BATCH_WINDOW`, off the state lock).
    pub(crate) fn persist_plan(&self, p: &Plan) -> Result<(), ApiError> {
        let bytes = serde_json::to_vec(&crate::plan::StoredPlanRef::V1(p))
            .map_err(|e| ApiError::internal(e.to_string()))?;
        self.writes.put(Table::Plans, &p.id, bytes);
        Ok(())
    }

    /// Commits the plan now (a new plan, before its chains start; an ended one).
    pub(crate) fn persist_plan_now(&self, p: &Plan) -> Result<(), ApiError> {
        self.put_json(Table::Plans, &p.id, &crate::plan::StoredPlanRef::V1(p))
    }

    /// Stores `value` as JSON under `key` now. Through the write-behind, so an older value
    /// of the key still queued there (a host record from a heartbeat) is dropped instead of
    /// overwriting this one when its batch commits.
    pub(super) fn put_json<T: Serialize>(
        &self,
        table: Table,
        key: &str,
        value: &T,
    ) -> Result<(), ApiError> {
        let bytes = serde_json::to_vec(value).map_err(|e| ApiError::internal(e.to_string()))?;
        self.writes.put_now(table, key, &bytes)?;
        Ok(())
    }

    /// A plan now.
    pub fn get_plan(&self, id: &str) -> Result<Plan, LookupError> {
        let st = lock(&self.state);
        st.plans
            .get(id)
            .cloned()
            .ok_or_else(|| LookupError::UnknownPlan(id.to_string()))
    }

    /// Every plan as `view` renders it, newest first (rendered under the lock, so the
    /// plans' chain runs are not copied for a listing).
    pub fn list_plans<R>(&self, view: impl Fn(&Plan) -> R) -> Vec<R> {
        let st = lock(&self.state);
        let mut plans: Vec<&Plan> = st.plans.values().collect();
        plans.sort_by(|a, b| b.created_at.total_cmp(&a.created_at));
        plans.into_iter().map(view).collect()
    }

    /// A receiver of a plan's changes; `None` when the plan has ended (its final state
    /// comes from [`Self::get_plan`]).
    pub fn watch_plan(
        &self,
        id: &str,
    ) -> Result<(Plan, Option<watch::Receiver<Plan>>), LookupError> {
        let st = lock(&self.state);
        let p = st
            .plans
            .get(id)
            .ok_or_else(|| LookupError::UnknownPlan(id.to_string()))?;
        Ok((p.clone(), st.watchers.get(id).map(watch::Sender::subscribe)))
    }
}

/// The baseline: every new receiver downloads from the origin itself, all sharing the
/// origin's bandwidth.
pub(super) fn origin_each(
    mut plan: placement::Plan,
    spec: &placement::ModelSpec,
    params: &PlanParams,
) -> placement::Plan {
    let new: Vec<String> = plan.new_receivers().map(str::to_string).collect();
    let bytes = spec.total_bytes();
    let share = (params.origin_bps / new.len().max(1) as u64).max(1);
    plan.chains = new
        .into_iter()
        .map(|h| placement::ChainPlan {
            source: Source::Origin,
            hops: vec![h],
            shards: Vec::new(),
            bytes,
            estimate_s: placement::estimate_chain_s(bytes, share, &[share], spec.chunk_size),
        })
        .collect();
    plan.estimate_s = plan.chains.iter().map(|c| c.estimate_s).fold(0.0, f64::max);
    plan
}

pub(super) fn chain_run(source: &Source, hops: &[String], shards: &[u32]) -> ChainRun {
    let session = hex::encode(rand::random::<[u8; 16]>());
    match source {
        Source::Origin => ChainRun {
            head: hops.first().cloned().unwrap_or_default(),
            session,
            hops: hops.iter().skip(1).cloned().collect(),
            shards: shards.to_vec(),
            from_origin: true,
            started: false,
            error: String::new(),
        },
        Source::Peer { host, .. } => ChainRun {
            head: host.clone(),
            session,
            hops: hops.to_vec(),
            shards: shards.to_vec(),
            from_origin: false,
            started: false,
            error: String::new(),
        },
    }
}
