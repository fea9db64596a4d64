//! The agent gRPC service (`proto/agent.proto`): the controller, `shardcast-bench` or an
//! operator drives chain sessions and reads holdings through it. All error mapping to
//! `tonic::Status` happens here.
//!
//! The RPCs (`proto/agent.proto`): `ImportModel` (build a manifest from an origin; with
//! `keep` the bytes read are kept in the store, with `fetch` the chunks are fetched),
//! `StartChain` (head sessions of a plan's chain), `GetSession`, `GetModelStatus` (with the
//! store's refusals of the model's data, by tier and session), `WatchModelStatus` (a stream:
//! the status at once, milestones — a tier appearing or completing, a GPU state — within
//! 20 ms, byte progress at most every 250 ms), `ListHoldings`, `GetStats`, `EvictModel`
//! (refused while a session of the model runs here, unless `end_sessions`: the controller's
//! evicts end sessions that outlived their plans, `Sessions::end_of`), `LoadModel`,
//! `GpuStatus` and `GetHandoff`. [`permission`] is the method → permission table, applied by
//! `shardcast_identity::grpc::AuthzLayer` in `daemon`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use shardcast_identity::Permission;
use shardcast_protocol::agent::agent_server::Agent;
use shardcast_protocol::agent::{
    self as pb, EvictModelRequest, EvictModelResponse, GetModelStatusRequest,
    GetModelStatusResponse, GetSessionRequest, GetStatsRequest, ImportModelRequest,
    ImportModelResponse, ListHoldingsRequest, ListHoldingsResponse, SessionStatus,
    StartChainRequest, StartChainResponse, Stats,
};
use shardcast_protocol::codec::{decode_exact, encode_to_vec};
use shardcast_protocol::frame::{MAX_ADDR_LEN, MAX_HOPS, MAX_URI_LEN};
use shardcast_protocol::manifest::DEFAULT_CHUNK_SIZE;
use shardcast_protocol::{
    DataTier, ErrorCode, Hop, HopTransport, HostId, Manifest, ModelDigest, ModelName, SessionId,
    Tier,
};
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use gpu_loader::manager::{GpuManager, LoadState, ManagerError, ModelGpuStatus};

use crate::chain::{
    ChainError, ChainSpec, Fetcher, Heads, NodeView, Sessions, StoreFailures, new_session_id,
};
use crate::gpu::GpuLoads;
use crate::origin::Origin;
use crate::store::{BindingSource, Holding, ShardStore};
use tokio_util::sync::CancellationToken;

/// What each agent method needs (the one authorisation table of this API, applied by
/// `shardcast_identity::grpc::AuthzLayer` before the call reaches the service). Calls that
/// read from the store or fetch from origins on the host's behalf, start chains or change
/// GPU memory need [`Permission::DriveAgent`] (the controller or an admin); status and the
/// hand-off need [`Permission::Read`]. Unknown methods need admin (they are then
/// `UNIMPLEMENTED`).
pub fn permission(path: &str) -> Option<Permission> {
    // grpc.health.v1 beside the agent: any authenticated caller.
    if let Some(p) = shardcast_identity::ready::health_permission(path) {
        return Some(p);
    }
    let method = path.strip_prefix("/shardcast.agent.v1.Agent/")?;
    Some(match method {
        "ImportModel" | "StartChain" | "EvictModel" | "LoadModel" => Permission::DriveAgent,
        "GetSession" | "GetModelStatus" | "WatchModelStatus" | "ListHoldings" | "GetStats"
        | "GpuStatus" | "GetHandoff" => Permission::Read,
        _ => return None,
    })
}

/// The agent service of one daemon. What the RPCs may touch is what it holds; the daemon
/// fills it with handles from the `Node`.
#[derive(Clone)]
pub struct AgentService {
    /// The counters and transports (`GetStats`, `GetSession`, plan tokens), the origin
    /// allow-list.
    pub(crate) view: NodeView,
    /// Manifests, holdings, names, evictions.
    pub(crate) store: ShardStore,
    /// Draining, head sessions by id (`GetSession`), the sessions of a model
    /// (`EvictModel`).
    pub(crate) sessions: Sessions,
    /// The store's refusals of a model's data (`GetModelStatus`).
    pub(crate) failures: StoreFailures,
    /// Starts the chains this host heads (`StartChain`).
    pub(crate) heads: Arc<Heads>,
    /// Fetches and keeps imported models (`ImportModel`); partitioned loads' fetches.
    pub(crate) fetcher: Arc<Fetcher>,
    /// GPU loads and hand-offs, and the GPU manager.
    pub(crate) gpus: GpuLoads,
    /// Ends `WatchModelStatus` streams at shutdown.
    pub(crate) cancel: CancellationToken,
}

/// The state of one `WatchModelStatus` stream.
struct Watch {
    this: AgentService,
    digest: ModelDigest,
    tick: tokio::time::Interval,
    until: tokio::time::Instant,
    /// What was sent last, and when.
    last: Option<GetModelStatusResponse>,
    sent: tokio::time::Instant,
}

/// What in a status is a milestone: per tier held, whether its first bytes are verified,
/// whether it is complete and its GPUs' states. The first bytes are one so that a watcher
/// sees a transfer start when it starts: a tier's entry can appear before any byte (a
/// session's shard files are allocated first), and its first bytes then went out with the
/// next progress message, up to `WATCH_PROGRESS_EVERY` late (the chain bench read all 16
/// hops' first bytes 0.28–0.33 s after the start; with this milestone, 0.04–0.17 s).
fn milestones(r: &GetModelStatusResponse) -> Vec<(i32, bool, bool, Vec<&str>)> {
    r.tiers
        .iter()
        .map(|t| {
            (
                t.tier,
                t.bytes_verified > 0,
                t.complete,
                t.gpus.iter().map(|g| g.state.as_str()).collect(),
            )
        })
        .collect()
}

/// How often `WatchModelStatus` sends byte progress that reached no milestone.
const WATCH_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// How often `WatchModelStatus` looks for a change.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_millis(20);
/// How long one `WatchModelStatus` stream lasts.
const WATCH_LIMIT: std::time::Duration = std::time::Duration::from_secs(3600);

impl AgentService {
    /// The status of `digest` in each tier that holds any of it (with its GPUs).
    fn model_status_of(&self, digest: &ModelDigest) -> GetModelStatusResponse {
        let tiers = self
            .store
            .holdings_of(digest)
            .iter()
            .map(|h| self.with_gpus(model_status(h)))
            .collect();
        let store_failures = self
            .failures
            .of(digest)
            .into_iter()
            .map(|(tier, session, error)| pb::StoreFailure {
                tier: tier_to_pb(tier),
                session: session.to_hex(),
                error,
            })
            .collect();
        GetModelStatusResponse {
            tiers,
            store_failures,
        }
    }

    fn with_gpus(&self, mut st: pb::ModelStatus) -> pb::ModelStatus {
        if st.tier == pb::Tier::Memory as i32
            && let Some(g) = self.gpus.manager().model_status(&st.digest)
        {
            st.gpus = gpu_residency(self.gpus.manager(), &g);
        }
        st
    }
}

fn gpu_residency(gpus: &GpuManager, g: &ModelGpuStatus) -> Vec<pb::GpuResidency> {
    let kinds: std::collections::HashMap<u32, String> = gpus
        .devices()
        .into_iter()
        .map(|d| (d.index, d.kind.to_string()))
        .collect();
    let (state, error) = state_name(&g.state);
    g.gpus
        .iter()
        .map(|&(gpu, bytes, total)| pb::GpuResidency {
            gpu,
            state: state.into(),
            bytes,
            total,
            device_kind: kinds.get(&gpu).cloned().unwrap_or_default(),
            error: error.clone(),
        })
        .collect()
}

/// A load state's wire name and, for a failure, why.
pub(crate) fn state_name(s: &LoadState) -> (&'static str, String) {
    match s {
        LoadState::Loading => ("loading", String::new()),
        LoadState::PartitionLive => ("partition-live", String::new()),
        LoadState::Resident => ("resident", String::new()),
        LoadState::Failed(e) => ("failed", e.clone()),
    }
}

fn tier_from_pb(t: i32) -> Result<DataTier, Status> {
    let t =
        pb::Tier::try_from(t).map_err(|_| Status::invalid_argument(format!("unknown tier {t}")))?;
    DataTier::try_from(Tier::from(t))
        .map_err(|_| Status::invalid_argument("the gpu tier is not a store tier; use LoadModel"))
}

fn tier_to_pb(t: DataTier) -> i32 {
    pb::Tier::from(t) as i32
}

fn chain_status(e: ChainError) -> Status {
    match e {
        ChainError::Refused {
            code: ErrorCode::NoSuchChunk | ErrorCode::UnknownModel,
            message,
        } => Status::failed_precondition(message),
        ChainError::Refused {
            code: ErrorCode::Refused,
            message,
        } => Status::already_exists(message),
        ChainError::Store(e) => Status::internal(format!("store: {e}")),
        other => Status::internal(other.to_string()),
    }
}

/// A holding as the agent API reports it.
pub(crate) fn model_status(h: &Holding) -> pb::ModelStatus {
    let shards: Vec<pb::ShardStatus> = h
        .shards
        .iter()
        .map(|s| pb::ShardStatus {
            path: s.path.to_string(),
            verified: s.verified,
            total: s.total,
            complete: s.verified == s.total,
            size: s.size,
        })
        .collect();
    let bytes_verified = h
        .shards
        .iter()
        .map(|s| {
            if s.verified == s.total {
                s.size
            } else {
                // Estimate for partial shards: whole chunks, the short last one counted full.
                (s.size / u64::from(s.total.max(1))) * u64::from(s.verified)
            }
        })
        .sum();
    pb::ModelStatus {
        digest: h.digest.to_hex(),
        name: h.name.to_string(),
        tier: tier_to_pb(h.tier),
        complete: shards.iter().all(|s| s.complete),
        bytes_verified,
        total_bytes: h.shards.iter().map(|s| s.size).sum(),
        shards,
        path: h.dir.display().to_string(),
        gpus: Vec::new(),
    }
}

/// `UNAVAILABLE` while the host drains: it is going away, so new work (a chain it would
/// head, an import, a GPU load) belongs on another host; what runs goes on.
fn not_draining(sessions: &Sessions, what: &str) -> Result<(), Status> {
    if sessions.draining() {
        return Err(Status::unavailable(format!(
            "this host is draining (shutting down): not starting {what}"
        )));
    }
    Ok(())
}

/// An origin refused by policy is `PERMISSION_DENIED`; any other parse failure is the
/// caller's malformed input.
fn origin_status(e: crate::origin::OriginError) -> Status {
    match e {
        crate::origin::OriginError::Policy(_) => Status::permission_denied(e.to_string()),
        e => Status::invalid_argument(e.to_string()),
    }
}

#[tonic::async_trait]
impl Agent for AgentService {
    async fn import_model(
        &self,
        request: Request<ImportModelRequest>,
    ) -> Result<Response<ImportModelResponse>, Status> {
        not_draining(&self.sessions, "an import")?;
        let req = request.into_inner();
        let name =
            ModelName::new(&req.name).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let origin = Origin::parse(&req.origin, self.view.origins()).map_err(origin_status)?;
        let tier = tier_from_pb(req.tier)?;
        let chunk_size = if req.chunk_size == 0 {
            DEFAULT_CHUNK_SIZE
        } else {
            req.chunk_size
        };
        // Bytes read to build the manifest are kept (one read of the origin, not two) when
        // asked to, or when the data is wanted anyway.
        let staging = if req.manifest.is_empty() && (req.keep || req.fetch) {
            match self.store.staging(tier) {
                Ok(s) => Some(s),
                Err(e) => {
                    warn!(model = %name, "not keeping the bytes read to build the manifest: {e}");
                    None
                }
            }
        } else {
            None
        };
        let mut kept = false;
        let manifest = if req.manifest.is_empty() {
            info!(model = %name, origin = %req.origin, keep = staging.is_some(), "building manifest from origin");
            // Hashing a large model takes minutes: log progress every GiB.
            let logged = std::sync::atomic::AtomicU64::new(0);
            let progress = |done: u64| {
                let gib = done >> 30;
                if gib > logged.fetch_max(gib, Ordering::Relaxed) {
                    info!(hashed_gib = gib, "building manifest");
                }
            };
            let keep = staging.as_ref().map(|s| s as &dyn crate::origin::KeepSink);
            let built = origin
                .build_manifest_keeping(name, chunk_size, &progress, keep)
                .await;
            self.view
                .stats()
                .manifest_bytes
                .fetch_add(origin.bytes_read(), Ordering::Relaxed);
            let (m, all_kept) = built.map_err(|e| match e {
                crate::origin::OriginError::Policy(_)
                | crate::origin::OriginError::SymlinkEscape { .. } => {
                    Status::permission_denied(format!("reading origin {}: {e}", req.origin))
                }
                e => Status::unavailable(format!("reading origin {}: {e}", req.origin)),
            })?;
            kept = all_kept;
            m
        } else {
            let m: Manifest = decode_exact(req.manifest.into())
                .map_err(|e| Status::invalid_argument(format!("manifest: {e}")))?;
            if m.name != name {
                return Err(Status::invalid_argument(format!(
                    "the manifest is for model {:?}, not {name:?}",
                    m.name.as_str()
                )));
            }
            m
        };
        let manifest = self
            .store
            .put_manifest(&manifest)
            .map_err(|e| Status::internal(format!("storing manifest: {e}")))?;
        if let Some(staging) = staging.as_ref().filter(|_| kept) {
            if let Err(e) = self
                .fetcher
                .adopt_staged(&manifest, staging, &req.origin, tier)
                .await
            {
                warn!(model = %manifest.name, "keeping the copy read to build the manifest failed: {e}");
                kept = false;
            }
        }
        drop(staging);
        if req.fetch && !kept {
            self.fetcher
                .fetch_model(&manifest, &req.origin, tier)
                .await
                .map_err(|e| Status::unavailable(format!("fetching from {}: {e}", req.origin)))?;
            kept = true;
        }
        // Bound once the import succeeded: a failed fetch leaves the name as it was.
        if req.bind_name.unwrap_or(true) {
            self.store
                // An import always applies (an admin's word on this host): never stale.
                .bind_name(&manifest.name, manifest.digest(), BindingSource::Import, 0)
                .map_err(|e| Status::internal(format!("binding the model name: {e}")))?;
        }
        Ok(Response::new(ImportModelResponse {
            digest: manifest.digest().to_hex(),
            manifest: encode_to_vec(&*manifest),
            total_bytes: manifest.total_bytes(),
            shards: manifest.shards.len() as u32,
            kept,
            resolved_origin: origin.resolved_uri().unwrap_or_default(),
        }))
    }

    async fn start_chain(
        &self,
        request: Request<StartChainRequest>,
    ) -> Result<Response<StartChainResponse>, Status> {
        not_draining(&self.sessions, "a chain")?;
        let req = request.into_inner();
        let model: ModelDigest = req
            .model
            .parse()
            .map_err(|e| Status::invalid_argument(format!("model: {e}")))?;
        let manifest = match self.store.manifest(&model) {
            Some(m) => m,
            None if !req.manifest.is_empty() => {
                let m: Manifest = decode_exact(req.manifest.into())
                    .map_err(|e| Status::invalid_argument(format!("manifest: {e}")))?;
                if m.digest() != model {
                    return Err(Status::invalid_argument(format!(
                        "manifest digest {} does not match model {model}",
                        m.digest()
                    )));
                }
                self.store
                    .put_manifest(&m)
                    .map_err(|e| Status::internal(e.to_string()))?
            }
            None => {
                return Err(Status::not_found(format!(
                    "model {model} is unknown on this host; import it or pass its manifest"
                )));
            }
        };
        let id = if req.session_id.is_empty() {
            new_session_id()
        } else {
            req.session_id
                .parse::<SessionId>()
                .map_err(|e| Status::invalid_argument(format!("session_id: {e}")))?
        };
        if !req.origin.is_empty() && !req.origin.starts_with("shardcast://") {
            Origin::parse(&req.origin, self.view.origins()).map_err(origin_status)?;
        }
        let tier = tier_from_pb(req.tier)?;
        if req.chains.is_empty() {
            return Err(Status::invalid_argument(
                "a chain session needs at least one chain",
            ));
        }
        if req.origin.len() > MAX_URI_LEN {
            return Err(Status::invalid_argument(format!(
                "origin is longer than {MAX_URI_LEN} bytes"
            )));
        }
        let mut chains = Vec::new();
        for c in req.chains {
            if c.hops.len() > MAX_HOPS {
                return Err(Status::invalid_argument(format!(
                    "a chain may have at most {MAX_HOPS} hops, got {}",
                    c.hops.len()
                )));
            }
            if let Some(h) = c
                .hops
                .iter()
                .find(|h| h.addr.is_empty() || h.addr.len() > MAX_ADDR_LEN)
            {
                return Err(Status::invalid_argument(format!(
                    "hop {:?} has an empty or over-long address",
                    h.host_id
                )));
            }
            if c.hops.is_empty() {
                return Err(Status::invalid_argument(
                    "every chain needs at least one hop",
                ));
            }
            let hops = c
                .hops
                .into_iter()
                .map(|h| {
                    Ok(Hop {
                        host: HostId::new(&h.host_id)
                            .map_err(|e| Status::invalid_argument(e.to_string()))?,
                        addr: h.addr,
                    })
                })
                .collect::<Result<Vec<_>, Status>>()?;
            chains.push(ChainSpec {
                shards: c.shards,
                hops,
            });
        }
        // Unspecified: TCP, as before transports could be chosen.
        let transport = pb::Transport::try_from(req.transport)
            .map(|t| t.domain().unwrap_or(HopTransport::Tcp))
            .map_err(|_| {
                Status::invalid_argument(format!(
                    "transport {} is not one this build knows (tcp or quic)",
                    req.transport
                ))
            })?;
        // Refused before anything starts when this host cannot dial that way.
        self.view
            .transports()
            .get(transport)
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        if self.view.transports().tls().is_some() && req.plan_token.is_empty() {
            return Err(Status::invalid_argument(
                "plan_token is required: hops accept only sessions the controller signed",
            ));
        }
        let head = self
            .heads
            .start_chain(
                id,
                manifest,
                req.origin,
                tier,
                chains,
                req.plan_token.into(),
                transport,
            )
            .map_err(chain_status)?;
        Ok(Response::new(StartChainResponse {
            session_id: head.id.to_hex(),
        }))
    }

    async fn get_session(
        &self,
        request: Request<GetSessionRequest>,
    ) -> Result<Response<SessionStatus>, Status> {
        let id: SessionId = request
            .into_inner()
            .session_id
            .parse()
            .map_err(|e| Status::invalid_argument(format!("session_id: {e}")))?;
        let head = self.sessions.head(&id).ok_or_else(|| {
            Status::not_found(format!("no session {id} was started on this host"))
        })?;
        // Per (host, shard): a striped shard's stripes add up.
        let mut progress: std::collections::BTreeMap<(String, u32), (u32, u32)> =
            std::collections::BTreeMap::new();
        let mut running = false;
        let mut errors = Vec::new();
        for part in &head.parts {
            for (host, (verified, total)) in part.hop_progress() {
                let p = progress.entry((host, part.shard.index())).or_default();
                p.0 += verified;
                p.1 += total;
            }
            match part.outcome() {
                None => running = true,
                Some(Ok(())) => {}
                Some(Err(e)) => {
                    // The stripes of a shard usually fail for one reason: said once.
                    let e = format!("shard {}: {e}", part.shard.index());
                    if !errors.contains(&e) {
                        errors.push(e);
                    }
                }
            }
        }
        // Running while any part is; then failed if any part failed; else done.
        let state = match (running, errors.is_empty()) {
            (true, _) => "running",
            (false, false) => "failed",
            (false, true) => "done",
        };
        Ok(Response::new(SessionStatus {
            session_id: id.to_hex(),
            model: head.model.to_hex(),
            state: state.into(),
            error: errors.join("; "),
            hops: progress
                .into_iter()
                .map(|((host_id, shard), (verified, total))| pb::HopProgress {
                    host_id,
                    shard,
                    verified,
                    total,
                })
                .collect(),
            bytes_sent: self.view.counters().sent.load(Ordering::Relaxed),
            elapsed_s: head.started.elapsed().as_secs_f64(),
        }))
    }

    async fn get_model_status(
        &self,
        request: Request<GetModelStatusRequest>,
    ) -> Result<Response<GetModelStatusResponse>, Status> {
        let key = request.into_inner().model;
        let Some(digest) = self.store.resolve(&key) else {
            return Err(Status::not_found(format!(
                "model {key:?} is not known on this host"
            )));
        };
        Ok(Response::new(self.model_status_of(&digest)))
    }

    type WatchModelStatusStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<GetModelStatusResponse, Status>> + Send>,
    >;

    async fn watch_model_status(
        &self,
        request: Request<GetModelStatusRequest>,
    ) -> Result<Response<Self::WatchModelStatusStream>, Status> {
        let key = request.into_inner().model;
        // A name must resolve now; a digest may still be unknown (its session has not
        // opened here yet): the stream then starts with empty tiers.
        let Some(digest) = self.store.resolve(&key) else {
            return Err(Status::not_found(format!(
                "model {key:?} is not known on this host"
            )));
        };
        let this = self.clone();
        let mut tick = tokio::time::interval(WATCH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let state = Watch {
            this,
            digest,
            tick,
            until: tokio::time::Instant::now() + WATCH_LIMIT,
            last: None,
            sent: tokio::time::Instant::now(),
        };
        let stream = futures::stream::unfold(state, |mut w| async move {
            loop {
                tokio::select! {
                    _ = w.this.cancel.cancelled() => return None,
                    _ = tokio::time::sleep_until(w.until) => return None,
                    _ = w.tick.tick() => {}
                }
                let now = w.this.model_status_of(&w.digest);
                let Some(last) = &w.last else {
                    w.last = Some(now.clone());
                    w.sent = tokio::time::Instant::now();
                    return Some((Ok(now), w));
                };
                // A milestone (a tier appears or completes, a GPU state changes) goes out at
                // once; byte progress alone at most every WATCH_PROGRESS_EVERY.
                let send = milestones(&now) != milestones(last)
                    || (now != *last && w.sent.elapsed() >= WATCH_PROGRESS_EVERY);
                if send {
                    w.last = Some(now.clone());
                    w.sent = tokio::time::Instant::now();
                    return Some((Ok(now), w));
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_holdings(
        &self,
        _request: Request<ListHoldingsRequest>,
    ) -> Result<Response<ListHoldingsResponse>, Status> {
        let models = self.store.holdings().iter().map(model_status).collect();
        Ok(Response::new(ListHoldingsResponse { models }))
    }

    async fn get_stats(
        &self,
        _request: Request<GetStatsRequest>,
    ) -> Result<Response<Stats>, Status> {
        let n = &self.view;
        let s = n.stats();
        let st = self.store.stats();
        let reserve = self.store.reserve_status();
        Ok(Response::new(Stats {
            host_id: n.host().to_string(),
            bytes_received: n.counters().received.load(Ordering::Relaxed),
            bytes_sent: n.counters().sent.load(Ordering::Relaxed),
            chunks_verified: s.chunks_verified.load(Ordering::Relaxed),
            chunks_corrupt: s.chunks_corrupt.load(Ordering::Relaxed),
            sessions_active: s.sessions_active.load(Ordering::Relaxed),
            sessions_total: s.sessions_total.load(Ordering::Relaxed),
            origin_bytes: s.origin_bytes.load(Ordering::Relaxed),
            manifest_bytes: s.manifest_bytes.load(Ordering::Relaxed),
            kept_bytes: s.kept_bytes.load(Ordering::Relaxed),
            data_mode: n.transports().data_mode_name().into(),
            downstream_failovers: s.downstream_failovers.load(Ordering::Relaxed),
            bytes_reverified: st.bytes_reverified.load(Ordering::Relaxed),
            bytes_written_mapped: st.bytes_written_mapped.load(Ordering::Relaxed),
            bytes_scrubbed: st.bytes_scrubbed.load(Ordering::Relaxed),
            chunks_rotted: st.chunks_rotted.load(Ordering::Relaxed),
            chunks_repaired: st.chunks_repaired.load(Ordering::Relaxed),
            memory_reserve_bytes: reserve.held,
            memory_reserve_target: reserve.config.bytes,
            memory_reserve_taken_bytes: st.reserve_bytes_taken.load(Ordering::Relaxed),
            chunks_sent_in_pieces: s.chunks_sent_in_pieces.load(Ordering::Relaxed),
            chunks_received_in_pieces: s.chunks_received_in_pieces.load(Ordering::Relaxed),
        }))
    }

    async fn evict_model(
        &self,
        request: Request<EvictModelRequest>,
    ) -> Result<Response<EvictModelResponse>, Status> {
        let req = request.into_inner();
        if req.tier == pb::Tier::Gpu as i32 {
            let digest = self.store.resolve(&req.model).ok_or_else(|| {
                Status::not_found(format!("model {:?} is not known on this host", req.model))
            })?;
            return match self.gpus.manager().evict(&digest.to_hex()) {
                Ok(_) => Ok(Response::new(EvictModelResponse {
                    removed: true,
                    bytes_freed: 0,
                })),
                Err(ManagerError::NotLoaded(_)) => Ok(Response::new(EvictModelResponse {
                    removed: false,
                    bytes_freed: 0,
                })),
                Err(e) => Err(Status::failed_precondition(e.to_string())),
            };
        }
        let tier = tier_from_pb(req.tier)?;
        let Some(digest) = self.store.resolve(&req.model) else {
            return Err(Status::not_found(format!(
                "model {:?} is not known on this host",
                req.model
            )));
        };
        if self.sessions.model_busy(&digest) {
            if !req.end_sessions {
                return Err(Status::failed_precondition(format!(
                    "model {digest} is being transferred through this host; evict it after the transfer ends"
                )));
            }
            let ended = self
                .sessions
                .end_of(&digest, &crate::chain::SessionError::Evicted);
            info!(model = %digest, ended, "ended the model's sessions that outlived their plans before evicting it");
        }
        let held = self
            .store
            .holdings_of(&digest)
            .into_iter()
            .any(|h| h.tier == tier);
        let bytes_freed = self
            .store
            .remove(&digest, tier)
            .map_err(|e| Status::internal(format!("removing {digest}: {e}")))?;
        info!(model = %digest, ?tier, bytes_freed, "evicted");
        Ok(Response::new(EvictModelResponse {
            removed: held,
            bytes_freed,
        }))
    }

    async fn load_model(
        &self,
        request: Request<pb::LoadModelRequest>,
    ) -> Result<Response<pb::LoadModelResponse>, Status> {
        not_draining(&self.sessions, "a GPU load")?;
        let req = request.into_inner();
        let digest = self.store.resolve(&req.model).ok_or_else(|| {
            Status::not_found(format!(
                "model {:?} is not known on this host; start its transfer first",
                req.model
            ))
        })?;
        let heaviness = crate::gpu::parse_heaviness(&req.heaviness)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let gpus = crate::gpu::load(
            &self.gpus,
            &self.fetcher,
            &digest,
            req.count.max(1) as usize,
            &req.gpus,
            heaviness,
            req.partition,
        )
        .await
        .map_err(|e| match e {
            crate::gpu::LoadFailure::Invalid(_) => Status::invalid_argument(e.to_string()),
            crate::gpu::LoadFailure::Unavailable(_) => Status::unavailable(e.to_string()),
            crate::gpu::LoadFailure::Manager(
                ManagerError::NoGpus(_) | ManagerError::TooMany { .. } | ManagerError::NoSuchGpu(_),
            ) => Status::failed_precondition(e.to_string()),
            crate::gpu::LoadFailure::Manager(ManagerError::Pool(_)) => {
                Status::resource_exhausted(e.to_string())
            }
            other => Status::internal(other.to_string()),
        })?;
        Ok(Response::new(pb::LoadModelResponse { gpus }))
    }

    async fn gpu_status(
        &self,
        _request: Request<pb::GpuStatusRequest>,
    ) -> Result<Response<pb::GpuStatusResponse>, Status> {
        let pools = self.gpus.manager().pools();
        let devices = self
            .gpus
            .manager()
            .devices()
            .into_iter()
            .map(|d| {
                // The pool is the host's budget on the GPU (a cap: regions are allocated as
                // models load) and the room a new region could get now.
                let (cap, free) = pools
                    .iter()
                    .find(|p| p.gpu == d.index)
                    .map(|p| (p.budget, p.free))
                    .unwrap_or((0, 0));
                pb::GpuDevice {
                    index: d.index,
                    name: d.name,
                    kind: d.kind.to_string(),
                    memory_bytes: d.memory_bytes,
                    pcie_switch: d.pcie_switch,
                    peers: d.peers.iter().map(|p| p.0).collect(),
                    pool_bytes: cap,
                    pool_free: free,
                    numa_node: d.numa_node,
                }
            })
            .collect();
        let models = self
            .gpus
            .manager()
            .status()
            .iter()
            .map(|m| pb::GpuModel {
                model: m.model.clone(),
                name: m.name.clone(),
                state: state_name(&m.state).0.into(),
                error: state_name(&m.state).1,
                gpus: gpu_residency(self.gpus.manager(), m),
                elapsed_s: m.elapsed_s,
                partition: m
                    .partition
                    .as_ref()
                    .map(|p| p.label.clone())
                    .unwrap_or_default(),
                partition_bytes: m.partition.as_ref().map_or(0, |p| p.bytes),
                partition_live_s: m.partition.as_ref().and_then(|p| p.live_s),
                partition_complete: m.partition.as_ref().is_some_and(|p| p.complete),
                host_path: m.host_path.map(|p| p.to_string()).unwrap_or_default(),
                host_path_reason: m.fallback_reason.clone().unwrap_or_default(),
                register_s: m.register_s,
                segments: u32::try_from(m.segments).unwrap_or(u32::MAX),
                segments_reused: u32::try_from(m.segments_reused).unwrap_or(u32::MAX),
                gpu_copy_elsewhere: self.gpus.manager().gpu_copy_elsewhere(&m.model),
            })
            .collect();
        Ok(Response::new(pb::GpuStatusResponse {
            note: self.gpus.manager().note().to_string(),
            devices,
            models,
            evictions: self
                .gpus
                .manager()
                .evictions()
                .into_iter()
                .map(|e| format!("GPU {}: {} ({})", e.gpu, e.model, e.reason))
                .collect(),
            registered_host_bytes: self.gpus.manager().registered_host_bytes(),
            register_ahead: self.gpus.manager().ahead_state().to_string(),
        }))
    }

    async fn get_handoff(
        &self,
        request: Request<pb::GetHandoffRequest>,
    ) -> Result<Response<pb::GetHandoffResponse>, Status> {
        let key = request.into_inner().model;
        let digest = self
            .store
            .resolve(&key)
            .ok_or_else(|| Status::not_found(format!("model {key:?} is not known on this host")))?;
        let h = crate::gpu::handoff(&self.gpus, &digest, &Default::default())
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        let json = serde_json::to_string(&h).map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(pb::GetHandoffResponse { json }))
    }
}

#[cfg(test)]
mod tests {
    use super::milestones;
    use shardcast_protocol::agent::{GetModelStatusResponse, ModelStatus};

    fn status(bytes_verified: u64, complete: bool) -> GetModelStatusResponse {
        GetModelStatusResponse {
            tiers: vec![ModelStatus {
                tier: 1,
                bytes_verified,
                total_bytes: 100,
                complete,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    /// A watch sends a milestone at once and byte progress at most every 250 ms: the first
    /// verified bytes and completion are milestones, the bytes in between are not.
    #[test]
    fn first_bytes_and_completion_are_milestones_progress_between_is_not() {
        assert_ne!(milestones(&status(0, false)), milestones(&status(1, false)));
        assert_eq!(
            milestones(&status(1, false)),
            milestones(&status(99, false))
        );
        assert_ne!(
            milestones(&status(99, false)),
            milestones(&status(100, true))
        );
        assert_ne!(
            milestones(&GetModelStatusResponse::default()),
            milestones(&status(0, false)),
            "a tier appearing"
        );
    }
}
