//! The plan runner: starts a plan's chains (signing their plan tokens), follows every
//! receiver (pushed `WatchModelStatus` streams, polls otherwise), asks GPU hosts to load,
//! re-plans stalled, returned and restarted receivers, and ends the plan.
//!
//! Following: each active receiver's `WatchModelStatus` stream (completion within tens of
//! milliseconds); receivers without a stream polled every `--poll-ms` (250 ms). Receivers of
//! down hosts are marked `lost` (with `lost_at`) and the plan keeps running for
//! `--lost-grace-s` (20 s): a lost receiver whose host heartbeats again within it is
//! re-planned and resumes from its verified chunks (`receiver-returned`); after it the plan
//! ends `partial` without it. A heartbeat naming a new transferd process marks the receiver
//! lost at once, re-planned on the next round (`receiver-restarted`, in `hosts`). A receiver
//! without progress for `stall_timeout` is re-planned with new chains from the sources alive
//! now, each with its own budget of `max_replans` re-plans in a row without progress
//! (`ReceiverProgress::replanned`). A receiver whose store refused the data (the agent's
//! `store_failures` for the plan's own sessions) is `lost` at once, awaiting room
//! (`ReceiverProgress::observe`; `failed` with lost grace 0), and re-planned once its host reports room
//! for the rest (`room_for_rest`). A returning receiver is held back (`defer_return`) while
//! no host holds a complete copy and other receivers still move the model, so that it does
//! not read the origin beside them. A receiver marked `lost`/`failed` whose heartbeat later
//! reports a complete copy is made `done` again (`receiver-recovered`, in `hosts`), and an
//! ended plan's outcome is recomputed. A finished receiver is recorded as a holder at once.

use futures::StreamExt;

use super::*;
use crate::agents::ModelReport;
use crate::error::{AgentFailure, PollError, StartError};

impl Controller {
    /// Starts a plan's chains that are not started yet, then polls its receivers until
    /// every one is done, failed or lost; re-plans receivers that stop making progress.
    /// Sends a plan's status to its watchers and persists it (at most once a second while
    /// it runs, and when it ends); an ended plan's watchers are dropped.
    pub(crate) fn publish_plan(
        &self,
        st: &mut State,
        id: &str,
        ended: bool,
        last_persist: &mut Instant,
    ) {
        let Some(plan) = st.plans.get(id) else { return };
        if ended {
            self.cfg.metrics.plan_ended(plan);
        }
        if let Some(w) = st.watchers.get(id) {
            w.send_replace(plan.clone());
        }
        if ended || last_persist.elapsed() >= Duration::from_secs(1) {
            // The end is committed at once (a controller killed right after must not come
            // back with the plan running); progress is queued.
            let r = if ended {
                self.persist_plan_now(plan)
            } else {
                self.persist_plan(plan)
            };
            if let Err(e) = r {
                warn!(plan = %id, "persisting plan: {e}");
            }
            *last_persist = Instant::now();
        }
        if ended {
            info!(plan = %id, kind = %plan.kind, state = %plan.state, elapsed_s = plan.elapsed_s(now_unix()), "plan ended");
            // The `plan` span of the run, when this is it (exported with the outcome).
            tracing::Span::current().record("state", tracing::field::display(&plan.state));
            st.watchers.remove(id);
        }
    }

    pub(super) async fn run_plan(self: Arc<Self>, id: String) {
        let mut progress = StallClock::default();
        // Tier gpu: hosts asked to load (None) or that cannot (Some(why)).
        let mut gpu_asked: HashMap<String, Option<String>> = HashMap::new();
        let mut last_persist = Instant::now();
        self.start_runs(&id).await;
        // Each active receiver's agent pushes its progress (completion within tens of
        // milliseconds); the tick still runs the loop for hosts without a stream, for
        // stall detection and for hosts that go down. The streams end with the plan.
        let pushed = Arc::new(Pushed::default());
        let mut streams: tokio::task::JoinSet<String> = tokio::task::JoinSet::new();
        let mut watching: HashSet<String> = HashSet::new();
        let mut tick = tokio::time::interval(self.cfg.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_round = Instant::now() - MIN_ROUND;
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = tick.tick() => {}
                _ = pushed.wake.notified() => {}
            }
            // At most one round per MIN_ROUND: with 1000 receivers pushing progress, a
            // round per push kept a core busy and the state lock contended.
            if let Some(wait) = MIN_ROUND.checked_sub(last_round.elapsed()) {
                tokio::time::sleep(wait).await;
            }
            last_round = Instant::now();
            while let Some(ended) = streams.try_join_next() {
                if let Ok(host) = ended {
                    watching.remove(&host);
                    lock(&pushed.latest).remove(&host);
                }
            }
            let Some((digest, name, tier, active, returned)) = self.active_receivers(&id) else {
                return;
            };
            // Lost receivers whose hosts heartbeat again within the grace: new chains from
            // the holders there are now; they resume from their verified chunks.
            if !returned.is_empty() {
                info!(plan = %id, hosts = ?returned, "lost receivers are back: re-planning them");
                for (host, room) in &returned {
                    self.events.record(Event {
                        at: now_unix(),
                        model: name.clone(),
                        kind: "receiver-returned".into(),
                        reason: match room {
                            true => format!(
                                "host {host} reports room for the rest of the copy its store refused: re-planned, resuming from its verified chunks"
                            ),
                            false => format!(
                                "host {host} heartbeats again within the lost grace: re-planned, resuming from its verified chunks"
                            ),
                        },
                        plan_id: id.clone(),
                        delta: 0,
                        hosts: vec![host.clone()],
                    });
                }
                let hosts: Vec<String> = returned.into_iter().map(|(h, _)| h).collect();
                self.replan(&id, &hosts).await;
                for h in &hosts {
                    progress.restart(h);
                }
                let mut st = lock(&self.state);
                self.publish_plan(&mut st, &id, false, &mut last_persist);
                continue;
            }
            for (host, up, _) in &active {
                if *up && watching.insert(host.clone()) {
                    streams.spawn(self.clone().watch_receiver(
                        host.clone(),
                        digest.clone(),
                        tier,
                        pushed.clone(),
                    ));
                }
            }
            // Poll outside the lock.
            let mut updates = Vec::new();
            let mut to_poll = Vec::new();
            for (host, up, gpus) in active {
                if !up {
                    updates.push((host, None));
                    continue;
                }
                // Tier gpu: ask the host to load as soon as it knows the model; its loader
                // streams chunks as they are verified, overlapping the chain transfer.
                if tier == Tier::Gpu && gpus > 0 && !gpu_asked.contains_key(&host) {
                    match self.request_gpu_load(&host, &digest, gpus).await {
                        Ok(()) => {
                            gpu_asked.insert(host.clone(), None);
                        }
                        Err(GpuAsk::Later) => {}
                        Err(GpuAsk::Unavailable(why)) => {
                            gpu_asked.insert(host.clone(), Some(why));
                        }
                    }
                }
                let latest = lock(&pushed.latest).get(&host).cloned();
                match latest {
                    Some(p) => updates.push((host, Some(Ok(p)))),
                    None => to_poll.push(host),
                }
            }
            // Receivers without a pushed status (a plan's first round: every receiver) are
            // polled concurrently: one after the other, 1000 receivers took seconds per round.
            {
                let (digest, me) = (&digest, &*self);
                let mut polls = futures::stream::iter(to_poll)
                    .map(|host| async move {
                        let polled = me.poll_host(&host, digest, tier).await;
                        (host, Some(polled))
                    })
                    .buffer_unordered(POLL_CONCURRENCY);
                while let Some(u) = polls.next().await {
                    updates.push(u);
                }
            }
            let now = Instant::now();
            let mut stalled = Vec::new();
            let mut changed = false;
            let mut ended = false;
            let mut newly_done: HashSet<String> = HashSet::new();
            {
                let total = self.registry.by_digest(&digest).map(|m| m.total_bytes);
                let mut st = lock(&self.state);
                let mut inv = self.inventory.lock();
                let Some(plan) = st.plans.get_mut(&id) else {
                    return;
                };
                let elapsed = plan.elapsed_s(now_unix());
                let round = crate::plan::Round {
                    tier,
                    total,
                    elapsed,
                    now: now_unix(),
                    lost_grace: self.cfg.lost_grace.as_secs_f64(),
                };
                let plan_sessions: Vec<String> =
                    plan.runs.iter().map(|r| r.session.clone()).collect();
                // By host: `receiver_mut`'s linear search per update made a round
                // O(receivers²).
                let at: HashMap<String, usize> = plan
                    .hosts
                    .iter()
                    .enumerate()
                    .map(|(i, h)| (h.host.clone(), i))
                    .collect();
                for (host, polled) in updates {
                    let Some(h) = at.get(&host).and_then(|&i| plan.hosts.get_mut(i)) else {
                        continue;
                    };
                    match polled {
                        None => {
                            changed |= h.lose(
                                &format!(
                                    "the host stopped heartbeating during the transfer; the plan waits {}s for it to return",
                                    self.cfg.lost_grace.as_secs()
                                ),
                                now_unix(),
                            );
                            warn!(plan = %id, host = %host, "receiver lost");
                            self.events.record(Event {
                                at: now_unix(),
                                model: name.clone(),
                                kind: "receiver-lost".into(),
                                reason: format!(
                                    "host {host} stopped heartbeating with {} of {} bytes",
                                    h.bytes, h.total
                                ),
                                plan_id: id.clone(),
                                delta: 0,
                                hosts: vec![host.clone()],
                            });
                        }
                        // An agent that does not answer while heartbeating: keep waiting;
                        // the stall timer decides.
                        Some(Err(e)) => changed |= h.unanswered(e.to_string()),
                        Some(Ok(seen)) => {
                            let seen = seen.for_sessions(plan_sessions.iter().map(String::as_str));
                            let refused = gpu_asked.get(&host).cloned().flatten();
                            let was_done = h.state == ReceiverState::Done;
                            changed |= h.observe(&seen, refused.as_deref(), &round);
                            if !was_done && h.state == ReceiverState::Done {
                                newly_done.insert(host.clone());
                            }
                        }
                    }
                    if progress.stalled(&host, h.moved(), now, self.cfg.stall_timeout)
                        && h.state.is_active()
                    {
                        stalled.push(host.clone());
                    }
                }
                if plan.settle_after(now_unix(), self.cfg.lost_grace.as_secs_f64()) {
                    changed = true;
                    ended = true;
                }
                // Hosts done in this round (every done host once the plan ends): marking
                // every done receiver on every round cost O(receivers) lookups per round.
                let done_hosts: Vec<(String, u64)> = plan
                    .hosts
                    .iter()
                    .filter(|h| {
                        h.state == ReceiverState::Done && (ended || newly_done.contains(&h.host))
                    })
                    .map(|h| (h.host.clone(), h.total))
                    .collect();
                for (host, bytes) in done_hosts {
                    if let Some(e) = inv.hosts.get_mut(&host) {
                        e.mark_complete(&digest, &name, DataTier::serving(tier), bytes);
                    }
                }
            }
            if !stalled.is_empty() && !ended {
                self.replan(&id, &stalled).await;
                for h in &stalled {
                    progress.restart(h);
                }
                changed = true;
            }
            if changed {
                let mut st = lock(&self.state);
                self.publish_plan(&mut st, &id, ended, &mut last_persist);
            }
            if ended {
                return;
            }
        }
    }

    /// (digest, name, tier, [(receiver, up, gpus)], [(returned, for room)]) of a running
    /// plan: its receivers still in progress, and its lost receivers whose hosts heartbeat
    /// again within the lost grace (those whose store refused the data: once their hosts
    /// report room for the rest).
    #[allow(clippy::type_complexity)]
    pub(super) fn active_receivers(
        &self,
        id: &str,
    ) -> Option<(
        String,
        String,
        Tier,
        Vec<(String, bool, u32)>,
        Vec<(String, bool)>,
    )> {
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        let inv = self.inventory.lock();
        let plan = st.plans.get_mut(id).filter(|p| p.running())?;
        let up = |host: &str| inv.hosts.get(host).is_some_and(|e| e.up);
        let active = plan
            .hosts
            .iter()
            .filter(|h| h.state.is_active())
            .map(|h| (h.host.clone(), up(&h.host), h.gpus))
            .collect();
        let (now, grace) = (now_unix(), self.cfg.lost_grace.as_secs_f64());
        // A receiver whose store refused the data returns once its host reports room for
        // the rest in the plan's tier.
        let free = |host: &str| {
            inv.hosts
                .get(host)
                .map_or(0, |e| match DataTier::serving(plan.tier) {
                    DataTier::Memory => e.report.mem_free,
                    DataTier::Disk => e.report.disk_free,
                })
        };
        // With no complete copy on any host yet, a returning receiver would read the
        // origin beside the plan's own receivers, which are still moving the model from it
        // (or from the hosts it feeds), and take their bandwidth: it waits, its grace
        // renewed, until a peer holds a copy or nothing else moves.
        // Scanned only when some receiver is back: this runs on every round of the plan.
        let digest = plan.digest.clone();
        let peer_copy = || {
            inv.hosts.values().any(|e| {
                e.up && [DataTier::Memory, DataTier::Disk]
                    .iter()
                    .any(|t| e.holding(&digest, *t).is_some_and(|h| h.complete))
            })
        };
        let others_moving = plan.hosts.iter().any(|h| h.state.is_active());
        let mut wait_for_peer: Option<bool> = None;
        let mut returned = Vec::new();
        for h in plan.hosts.iter_mut() {
            if !(h.awaits_return(now, grace) && up(&h.host) && h.room_for_rest(free(&h.host))) {
                continue;
            }
            if *wait_for_peer.get_or_insert_with(|| others_moving && !peer_copy()) {
                h.defer_return(now);
                continue;
            }
            returned.push((h.host.clone(), h.awaits_room));
        }
        let plan = &*plan;
        Some((
            plan.digest.clone(),
            plan.model.clone(),
            plan.tier,
            active,
            returned,
        ))
    }

    /// Asks `host` to load the model onto `gpus` GPUs.
    pub(super) async fn request_gpu_load(
        &self,
        host: &str,
        digest: &str,
        gpus: u32,
    ) -> Result<(), GpuAsk> {
        let at = self.agent_at(host).map_err(|_| GpuAsk::Later)?;
        let load = crate::agents::Load {
            heaviness: self.heaviness_of(digest),
            model: digest.to_string(),
            count: gpus,
            partition: None,
        };
        let r =
            tokio::time::timeout(Duration::from_secs(5), self.agents.load_model(&at, load)).await;
        match r {
            Ok(Ok(())) => {
                info!(host, model = %digest, gpus, "GPU load requested");
                Ok(())
            }
            // The manifest has not reached the host yet: ask again on the next poll.
            Ok(Err(e)) if e.failure == AgentFailure::NotFound => Err(GpuAsk::Later),
            Ok(Err(e))
                if matches!(
                    e.failure,
                    AgentFailure::Precondition | AgentFailure::Exhausted
                ) =>
            {
                warn!(host, model = %digest, "GPU load refused: {}", e.message);
                Err(GpuAsk::Unavailable(format!(
                    "GPU load refused ({}); the model is in the host's memory tier",
                    e.message
                )))
            }
            _ => Err(GpuAsk::Later),
        }
    }

    /// Progress of `digest` in the tier on `host` (and on its GPUs).
    pub(crate) async fn poll_host(
        &self,
        host: &str,
        digest: &str,
        tier: Tier,
    ) -> Result<Seen, PollError> {
        let at = self.agent_at(host).map_err(PollError::Agent)?;
        let r = tokio::time::timeout(
            Duration::from_secs(2),
            self.agents.model_status(&at, digest),
        )
        .await;
        match r {
            Err(_) => Err(PollError::Silent {
                host: host.to_string(),
                within: Duration::from_secs(2),
            }),
            Ok(Err(e)) => Err(PollError::Agent(e)),
            Ok(Ok(None)) => Ok(Seen::default()),
            Ok(Ok(Some(report))) => Ok(polled_from(&report, tier)),
        }
    }

    /// Follows `host`'s status of `digest` through its agent's `WatchModelStatus` stream,
    /// storing each update in `pushed` and waking the plan loop, until the stream ends (the
    /// task is aborted with the plan). Returns `host`.
    pub(super) async fn watch_receiver(
        self: Arc<Self>,
        host: String,
        digest: String,
        tier: Tier,
        pushed: Arc<Pushed>,
    ) -> String {
        let Ok(at) = self.agent_at(&host) else {
            return host;
        };
        let Ok(Ok(mut stream)) = tokio::time::timeout(
            Duration::from_secs(2),
            self.agents.watch_model_status(&at, &digest),
        )
        .await
        else {
            return host;
        };
        while let Some(status) = stream.next().await {
            lock(&pushed.latest).insert(host.clone(), polled_from(&status, tier));
            pushed.wake.notify_one();
        }
        host
    }

    /// Starts the chains of a plan that have not been started.
    pub(super) async fn start_runs(&self, id: &str) {
        let (runs, origin, digest, tier, transport) = {
            let st = lock(&self.state);
            let Some(p) = st.plans.get(id) else { return };
            (
                p.runs.clone(),
                p.origin.clone(),
                p.digest.clone(),
                p.tier,
                p.transport,
            )
        };
        let manifest = self.registry.manifest(&digest);
        let Some(manifest) = manifest else {
            warn!(plan = %id, "the model's manifest is missing from the controller state");
            return;
        };
        let mut results = Vec::new();
        for (i, run) in runs.iter().enumerate() {
            if run.started {
                continue;
            }
            let r = self
                .start_run(run, &manifest, (&origin, &digest), tier, transport)
                .await;
            if let Err(e) = &r {
                warn!(plan = %id, head = %run.head, "starting a chain failed: {e}");
            }
            results.push((i, r));
        }
        let mut st = lock(&self.state);
        if let Some(p) = st.plans.get_mut(id) {
            for (i, r) in results {
                if let Some(run) = p.runs.get_mut(i) {
                    match r {
                        Ok(()) => run.started = true,
                        Err(e) => run.error = e.to_string(),
                    }
                }
            }
            if let Err(e) = self.persist_plan(p) {
                warn!(plan = %id, "persisting plan: {e}");
            }
        }
    }

    /// The registry name whose current version is `digest`, if any.
    pub(crate) fn current_name(&self, digest: &str) -> Option<String> {
        self.registry.name_of(digest)
    }

    pub(super) async fn start_run(
        &self,
        run: &ChainRun,
        manifest: &Arc<Vec<u8>>,
        (origin, digest): (&str, &str),
        tier: Tier,
        transport: shardcast_protocol::HopTransport,
    ) -> Result<(), StartError> {
        let at = self.agent_at(&run.head).map_err(StartError::Unreachable)?;
        if run.hops.is_empty() {
            // A single receiver fed by the origin: it downloads on its own. ImportModel
            // returns when the download ends; progress is polled meanwhile.
            let name = decode_exact::<Manifest>(manifest.to_vec().into())
                .map_err(|e| StartError::BadManifest {
                    digest: digest.to_string(),
                    why: e.to_string(),
                })?
                .name
                .to_string();
            let import = crate::agents::Import {
                name,
                origin: origin.to_string(),
                chunk_size: 0,
                tier,
                fetch: true,
                keep: false,
                manifest: manifest.to_vec(),
                // The host's name follows only the registry's current version.
                bind_name: Some(self.current_name(digest).is_some()),
            };
            let agents = self.agents.clone();
            tokio::spawn(async move {
                if let Err(e) = agents.import_model(&at, import).await {
                    warn!(host = %at.host, "download from the origin failed: {}", e.message);
                }
            });
            return Ok(());
        }
        // The head first: the hops' upstream lists name it, and a recovering hop dials it.
        let (head_addr, hosts): (String, Vec<(String, String)>) = {
            let inv = self.inventory.lock();
            let addr_of = |h: &String| {
                inv.hosts
                    .get(h)
                    .map(|e| e.report.data_addr.clone())
                    .unwrap_or_default()
            };
            let hops = run.hops.iter().map(|h| (h.clone(), addr_of(h))).collect();
            (addr_of(&run.head), hops)
        };
        let plan_token = match &self.cfg.signer {
            None => Vec::new(),
            Some(signer) => {
                let claims = shardcast_protocol::plan::PlanClaims {
                    plan: run.session.clone(),
                    model: digest
                        .parse::<shardcast_protocol::ModelDigest>()
                        .map_err(|e| StartError::BadDigest {
                            digest: digest.to_string(),
                            why: e.to_string(),
                        })?,
                    not_after: unix_now() + shardcast_identity::plan::PLAN_TOKEN_TTL.as_secs(),
                    // Orders this statement about the name against the others a host hears.
                    issued_at_ms: unix_now_ms(),
                    // Each with the address the hops may dial it at.
                    hosts: std::iter::once((&run.head, &head_addr))
                        .chain(hosts.iter().map(|(h, a)| (h, a)))
                        .filter_map(|(h, addr)| {
                            Some(shardcast_protocol::Hop {
                                host: shardcast_protocol::HostId::new(h).ok()?,
                                addr: addr.clone(),
                            })
                        })
                        .collect(),
                    // The hosts bind the name only to the registry's current version.
                    name: self
                        .current_name(digest)
                        .and_then(|n| shardcast_protocol::ModelName::new(n).ok()),
                };
                signer
                    .load()
                    .sign(&claims)
                    .map_err(|e| StartError::Sign(e.to_string()))?
            }
        };
        let chain = crate::agents::StartChain {
            session: run.session.clone(),
            model: digest.to_string(),
            manifest: manifest.clone(),
            origin: origin.to_string(),
            tier,
            shards: run.shards.clone(),
            hops: hosts
                .into_iter()
                .map(|(host, addr)| crate::agents::ChainHop { host, addr })
                .collect(),
            plan_token,
            transport,
        };
        match tokio::time::timeout(Duration::from_secs(10), self.agents.start_chain(&at, chain))
            .await
        {
            Err(_) => Err(StartError::Silent {
                head: run.head.clone(),
            }),
            Ok(Err(e)) => Err(StartError::Refused(e)),
            Ok(Ok(())) => Ok(()),
        }
    }

    /// Re-plans receivers that made no progress: new chains from the sources available now.
    pub(super) async fn replan(&self, id: &str, stalled: &[String]) {
        let started = {
            let mut st = lock(&self.state);
            let inv = self.inventory.lock();
            let pending = st.pending();
            let Some(plan) = st.plans.get(id) else { return };
            let digest = plan.digest.clone();
            let Some(model) = self.registry.by_digest(&digest) else {
                return;
            };
            let tier = plan.tier;
            let mut cluster = inventory::cluster_view(&inv.hosts, &digest, &pending);
            // Stalled receivers are not sources.
            for h in &mut cluster {
                if stalled.contains(&h.id) {
                    h.holdings.clear();
                }
            }
            let Some(plan) = st.plans.get_mut(id) else {
                return;
            };
            // Each receiver has its own budget of re-plans without progress in between.
            let max = self.cfg.max_replans;
            let mut given_up = Vec::new();
            for h in plan.hosts.iter_mut().filter(|h| stalled.contains(&h.host)) {
                if !h.replanned(max) {
                    h.state = ReceiverState::Failed;
                    h.error = format!(
                        "no progress for {:?} after {max} re-plans in a row",
                        self.cfg.stall_timeout
                    );
                    given_up.push(h.host.clone());
                }
            }
            if !given_up.is_empty() {
                warn!(plan = %id, hosts = ?given_up, "receivers failed: no progress after re-planning");
            }
            let live: Vec<String> = stalled
                .iter()
                .filter(|h| !given_up.contains(h))
                .filter(|h| cluster.iter().any(|c| c.id == **h && c.up))
                .cloned()
                .collect();
            if live.is_empty() {
                return;
            }
            let chains =
                placement::plan_chains(&cluster, &model.spec(), tier, &live, &self.cfg.plan);
            plan.replans += 1;
            plan.message = format!(
                "re-planned {} receiver(s) that made no progress for {:?}",
                live.len(),
                self.cfg.stall_timeout
            );
            let first = plan.runs.len();
            for c in &chains {
                let source = match &c.source {
                    Source::Origin => "origin".to_string(),
                    Source::Peer { host, .. } => host.clone(),
                };
                for h in plan.hosts.iter_mut().filter(|h| c.hops.contains(&h.host)) {
                    h.source = source.clone();
                    if h.state == ReceiverState::Joined {
                        h.state = ReceiverState::Receiving;
                    }
                    if h.state == ReceiverState::Lost {
                        h.come_back();
                    }
                }
                plan.runs.push(chain_run(&c.source, &c.hops, &c.shards));
            }
            warn!(plan = %id, hosts = ?live, chains = chains.len(), "re-planning stalled receivers");
            first
        };
        let _ = started;
        self.start_runs(id).await;
    }
}

/// Receivers a plan's loop polls at once (each poll is one `GetModelStatus` with a 2 s
/// timeout; the first reaches a host over a new mutually authenticated connection).
pub(super) const POLL_CONCURRENCY: usize = 64;

/// The shortest time between two rounds of a plan's loop (the agents check their status
/// every 20 ms too, so completion is still seen within tens of milliseconds).
pub(super) const MIN_ROUND: Duration = Duration::from_millis(20);

/// Why a GPU load could not be requested.
pub(super) enum GpuAsk {
    /// Not yet (the host does not know the model yet, or did not answer).
    Later,
    /// The host cannot (no GPUs, out of GPU memory).
    Unavailable(String),
}

/// What receivers' agents pushed last (`WatchModelStatus`), and the plan loop's wake-up.
#[derive(Default)]
pub(crate) struct Pushed {
    latest: Mutex<HashMap<String, Seen>>,
    wake: tokio::sync::Notify,
}

/// A receiver's progress in `tier` from its agent's model status.
pub(super) fn polled_from(report: &ModelReport, tier: Tier) -> Seen {
    let want = DataTier::serving(tier);
    let mut seen = report
        .tiers
        .iter()
        .find(|t| t.tier == want)
        .map(|t| Seen {
            bytes: t.bytes_verified,
            complete: t.complete,
            gpu: GpuState::of_gpus(t.gpus.iter().map(|(state, _)| state.as_str()))
                .map(|s| (t.gpus.iter().map(|(_, bytes)| bytes).sum(), s)),
            store_failures: Vec::new(),
        })
        .unwrap_or_default();
    seen.store_failures = report
        .store_failures
        .iter()
        .filter(|f| f.tier == want)
        .map(|f| (f.session.clone(), f.error.clone()))
        .collect();
    seen
}
