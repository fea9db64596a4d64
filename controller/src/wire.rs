//! The edge between the controller's typed core ([`crate::plan`]) and the API's wire
//! messages: the gRPC front end ([`crate::grpc`]) and the HTTP/JSON one ([`crate::http`])
//! convert here, and nowhere else, so the core never compares or builds state strings.

use shardcast_placement::{Target, Tier};
use shardcast_protocol::HopTransport;
use shardcast_protocol::controller::{
    self as pb, HostProgress, PlanAccepted, PlanStatus, PlannedChain,
};

use crate::error::{ApiError, RecordError};
use crate::events::Event;
use crate::inventory::{GpuInfo, GpuLoad, HOST_RECORD_VERSION, Holding, HostView, StoredHost};
use crate::model::ModelRecord;
use crate::ops::{
    EvictModel, Evicted, HeartbeatAnswer, HostListing, ModelEntry, Models, PartitionPlanAnswer,
    PartitionPlanQuery, Prewarm, Register, Registered, ReportLoad, ScaleOut, Sources, Whereabouts,
};
use crate::plan::{
    Accepted, ChainSummary, GpuState, Plan, PlanKind, PlanState, ReceiverProgress, ReceiverState,
    StoredPlan,
};

/// A request's tier: unspecified is memory; a number this build does not know is refused.
pub fn tier_of(v: i32) -> Result<Tier, ApiError> {
    match pb::Tier::try_from(v) {
        Ok(t) => Ok(t.domain().unwrap_or(Tier::Memory)),
        Err(_) => Err(ApiError::invalid(format!(
            "tier must be memory, disk or gpu, got {v}"
        ))),
    }
}

/// A request's transport: unspecified is `default` (the controller's `--transport`); a
/// number this build does not know is refused.
pub fn transport_of(v: i32, default: HopTransport) -> Result<HopTransport, ApiError> {
    pb::Transport::try_from(v)
        .map(|t| t.domain().unwrap_or(default))
        .map_err(|_| ApiError::invalid(format!("transport must be tcp or quic, got {v}")))
}

/// A `Prewarm` request in the controller's terms.
pub fn prewarm(req: pb::PrewarmRequest) -> Result<Prewarm, ApiError> {
    let tier = tier_of(req.tier)?;
    let sources = match req.sources.as_str() {
        "" | "auto" => Sources::Auto,
        "origin" => Sources::Origin,
        other => {
            return Err(ApiError::invalid(format!(
                "sources must be auto or origin, got {other:?}"
            )));
        }
    };
    Ok(Prewarm {
        model: req.model,
        target: if req.hosts.is_empty() {
            Target::Replicas(req.replicas)
        } else {
            Target::Hosts(req.hosts)
        },
        tier,
        sources,
        transport: hop_of(req.transport)?,
    })
}

/// A `ScaleOut` request in the controller's terms.
pub fn scale_out(req: pb::ScaleOutRequest) -> Result<ScaleOut, ApiError> {
    Ok(ScaleOut {
        tier: tier_of(req.tier)?,
        transport: hop_of(req.transport)?,
        model: req.model,
        replicas: req.replicas,
        partitions: req.partitions,
    })
}

/// An `Evict` request in the controller's terms.
pub fn evict(req: pb::EvictRequest) -> Result<EvictModel, ApiError> {
    Ok(EvictModel {
        tier: tier_of(req.tier)?,
        model: req.model,
        hosts: req.hosts,
    })
}

impl From<Evicted> for pb::EvictResponse {
    fn from(e: Evicted) -> Self {
        Self {
            evicted: e.evicted,
            bytes_freed: e.bytes_freed,
            pending: e.pending,
        }
    }
}

/// A request's transport: unspecified is `None` (the controller's `--transport`); a number
/// this build does not know is refused.
fn hop_of(v: i32) -> Result<Option<HopTransport>, ApiError> {
    pb::Transport::try_from(v)
        .map(|t| t.domain())
        .map_err(|_| ApiError::invalid(format!("transport must be tcp or quic, got {v}")))
}

/// A `RegisterModel` request in the controller's terms.
pub fn register(req: pb::RegisterModelRequest) -> Register {
    Register {
        name: req.name,
        origin: req.origin,
        profile_json: req.profile_json,
        chunk_size: req.chunk_size,
        via_host: req.via_host,
        no_wait: req.no_wait,
    }
}

/// A model as the API shows it, with its manifest where given.
pub fn model_info(m: &ModelRecord, manifest: Option<&[u8]>) -> pb::ModelInfo {
    pb::ModelInfo {
        name: m.name.clone(),
        digest: m.digest.clone(),
        origin: m.origin.clone(),
        total_bytes: m.total_bytes,
        chunk_size: m.chunk_size,
        shards: m
            .shards
            .iter()
            .map(|(path, size, chunks)| pb::ShardInfo {
                path: path.clone(),
                size: *size,
                chunks: *chunks,
            })
            .collect(),
        manifest: manifest.map(<[u8]>::to_vec).unwrap_or_default(),
        registered_at: m.registered_at,
    }
}

impl From<ModelEntry> for pb::ModelInfo {
    fn from(e: ModelEntry) -> Self {
        model_info(&e.record, e.manifest.as_deref().map(Vec::as_slice))
    }
}

impl From<Registered> for pb::ModelInfo {
    fn from(r: Registered) -> Self {
        match r {
            Registered::Done(e) => e.into(),
            Registered::Started { name, origin } => Self {
                name,
                origin,
                ..Default::default()
            },
        }
    }
}

impl From<Models> for pb::ListModelsResponse {
    fn from(m: Models) -> Self {
        Self {
            models: m.models.iter().map(|m| model_info(m, None)).collect(),
            registering: m
                .registering
                .into_iter()
                .map(|r| pb::Registration {
                    name: r.name,
                    origin: r.origin,
                    via_host: r.via_host,
                    started_at: r.started_at,
                })
                .collect(),
        }
    }
}

impl From<Whereabouts> for pb::ModelStatus {
    fn from(w: Whereabouts) -> Self {
        Self {
            model: Some(model_info(&w.model, None)),
            hosts: w
                .hosts
                .into_iter()
                .map(|h| pb::HostHolding {
                    host: h.host,
                    up: h.up,
                    memory: h.memory,
                    disk: h.disk,
                    memory_bytes: h.memory_bytes,
                    disk_bytes: h.disk_bytes,
                    gpus: h.gpus,
                })
                .collect(),
            plans: w.plans,
        }
    }
}

impl From<HeartbeatAnswer> for pb::HeartbeatResponse {
    fn from(a: HeartbeatAnswer) -> Self {
        Self {
            interval_ms: u32::try_from(a.interval.as_millis()).unwrap_or(u32::MAX),
            names: a
                .names
                .into_iter()
                .map(|(name, digest)| pb::NameBinding { name, digest })
                .collect(),
            gpu_copies_elsewhere: a.gpu_copies_elsewhere,
            issued_at_ms: a.issued_at_ms,
        }
    }
}

/// The host list as the API shows it.
pub fn host_list(hosts: Vec<HostListing>) -> pb::ListHostsResponse {
    pb::ListHostsResponse {
        hosts: hosts
            .into_iter()
            .map(|h| pb::HostState {
                report: Some(host_report(&h.report)),
                up: h.up,
                last_seen_s: h.last_seen_s,
                gpus_reserved: h.gpus_reserved,
            })
            .collect(),
    }
}

impl From<Event> for pb::Event {
    fn from(e: Event) -> Self {
        Self {
            at: e.at,
            model: e.model,
            kind: e.kind,
            reason: e.reason,
            plan_id: e.plan_id,
            delta: e.delta,
            hosts: e.hosts,
        }
    }
}

/// Events as `ListEvents` answers them.
pub fn event_list(events: Vec<Event>) -> pb::ListEventsResponse {
    pb::ListEventsResponse {
        events: events.into_iter().map(pb::Event::from).collect(),
    }
}

/// A `ReportLoad` request in the controller's terms.
pub fn report_load(req: pb::ReportLoadRequest) -> Result<ReportLoad, ApiError> {
    Ok(ReportLoad {
        tier: tier_of(req.tier)?,
        model: req.model,
        arrival_rate: req.arrival_rate,
        queue_len: req.queue_len,
        service_rate: req.service_rate,
    })
}

/// A `GetPartitionPlan` request in the controller's terms.
pub fn partition_plan_query(req: pb::GetPartitionPlanRequest) -> PartitionPlanQuery {
    PartitionPlanQuery {
        model: req.model,
        max_partitions: req.max_partitions,
        gpu_memory: req.gpu_memory,
        queue: req.queue,
    }
}

impl From<PartitionPlanAnswer> for pb::PartitionPlanResponse {
    fn from(a: PartitionPlanAnswer) -> Self {
        Self {
            json: a.json,
            estimated: a.estimated,
        }
    }
}

/// The typed core and the wire name their states alike: each maps by name, both ways.
macro_rules! by_name {
    ($core:ident <-> $wire:ident) => {
        impl From<$core> for pb::$wire {
            fn from(v: $core) -> Self {
                // Every core name is a wire name (tested below).
                pb::$wire::from_label(v.as_str()).unwrap_or(pb::$wire::Unspecified)
            }
        }

        impl TryFrom<pb::$wire> for $core {
            type Error = String;

            fn try_from(v: pb::$wire) -> Result<Self, String> {
                v.label()
                    .parse()
                    .map_err(|e: crate::plan::UnknownName| e.to_string())
            }
        }
    };
}

by_name!(PlanState <-> PlanState);
by_name!(PlanKind <-> PlanKind);
by_name!(ReceiverState <-> ReceiverState);
by_name!(GpuState <-> GpuState);

impl From<&ReceiverProgress> for HostProgress {
    fn from(r: &ReceiverProgress) -> Self {
        Self {
            host: r.host.clone(),
            state: pb::ReceiverState::from(r.state) as i32,
            bytes: r.bytes,
            total: r.total,
            source: r.source.clone(),
            error: r.error.clone(),
            gpus: r.gpus,
            gpu_bytes: r.gpu_bytes,
            gpu_state: r
                .gpu_state
                .map_or(pb::GpuState::Unspecified, pb::GpuState::from)
                as i32,
            partition: r.partition.clone(),
            live_s: r.live_s,
            done_s: r.done_s,
            lost_at: r.lost_at,
        }
    }
}

impl From<&ChainSummary> for PlannedChain {
    fn from(c: &ChainSummary) -> Self {
        Self {
            source: c.source.clone(),
            source_tier: c.source_tier.clone(),
            hops: c.hops.clone(),
            shards: c.shards.clone(),
            bytes: c.bytes,
            estimate_s: c.estimate_s,
        }
    }
}

/// What callers see of a plan `now` (seconds since the epoch: the elapsed time of a plan
/// still running).
pub fn plan_status(p: &Plan, now: f64) -> PlanStatus {
    PlanStatus {
        plan_id: p.id.clone(),
        model: p.model.clone(),
        digest: p.digest.clone(),
        tier: pb::Tier::from(p.tier) as i32,
        state: pb::PlanState::from(p.state) as i32,
        hosts: p.hosts.iter().map(HostProgress::from).collect(),
        estimate_s: p.estimate_s,
        elapsed_s: p.elapsed_s(now),
        message: p.message.clone(),
        chains: p.chains.iter().map(PlannedChain::from).collect(),
        replans: p.replans,
        created_at: p.created_at,
        kind: pb::PlanKind::from(p.kind) as i32,
        live_s: p.live_s,
        transport: pb::Transport::from(p.transport) as i32,
    }
}

impl From<Accepted> for PlanAccepted {
    fn from(a: Accepted) -> Self {
        Self {
            plan_id: a.plan_id,
            estimate_s: a.estimate_s,
            chains: a.chains.iter().map(PlannedChain::from).collect(),
            hosts: a.hosts.iter().map(HostProgress::from).collect(),
        }
    }
}

/// A stored host record: this version, or one written before versions (the
/// `HostReport` wire message and the reservations).
pub fn read_host_record(bytes: &[u8]) -> Result<StoredHost, RecordError> {
    /// A host record as written before records were versioned: the wire message.
    #[derive(serde::Deserialize)]
    struct LegacyHostRecord {
        report: pb::HostReport,
        #[serde(default)]
        gpu_reserved: std::collections::BTreeMap<String, u32>,
    }
    if let Some(r) = StoredHost::read_versioned(bytes)? {
        return Ok(r);
    }
    let legacy: LegacyHostRecord = serde_json::from_slice(bytes)?;
    Ok(StoredHost {
        version: HOST_RECORD_VERSION.into(),
        host: host_view(legacy.report).map_err(|e| RecordError::Invalid(e.message))?,
        gpu_reserved: legacy.gpu_reserved,
        pending_evictions: Vec::new(),
    })
}

/// A stored plan record: the typed layout, else the legacy one.
pub fn read_plan_record(bytes: &[u8]) -> Result<Plan, RecordError> {
    StoredPlan::decode(bytes).or_else(|typed| {
        legacy_plan(bytes).map_err(|legacy| RecordError::Neither {
            typed: Box::new(typed),
            legacy: Box::new(legacy),
        })
    })
}

/// A plan persisted before records were versioned: the `PlanStatus` wire message with
/// the runs beside it. Read once at start-up and rewritten as a
/// [`StoredPlan`](crate::plan::StoredPlan) on its next save.
#[derive(serde::Deserialize)]
struct LegacyPlanRecord {
    status: PlanStatus,
    runs: Vec<crate::plan::ChainRun>,
    origin: String,
    ended_at: Option<f64>,
}

/// Reads a legacy (unversioned) plan record; an error names what does not parse.
pub fn legacy_plan(bytes: &[u8]) -> Result<Plan, RecordError> {
    let r: LegacyPlanRecord = serde_json::from_slice(bytes)?;
    let s = r.status;
    let tier = tier_of(s.tier).map_err(|e| RecordError::Invalid(e.message))?;
    let state = PlanState::try_from(s.state()).map_err(RecordError::Invalid)?;
    let kind = match s.kind() {
        pb::PlanKind::Unspecified => PlanKind::Chains,
        k => PlanKind::try_from(k).map_err(RecordError::Invalid)?,
    };
    let hosts = s
        .hosts
        .into_iter()
        .map(|h| {
            Ok(ReceiverProgress {
                state: ReceiverState::try_from(h.state())?,
                gpu_state: match h.gpu_state() {
                    pb::GpuState::Unspecified => None,
                    g => Some(GpuState::try_from(g)?),
                },
                host: h.host,
                bytes: h.bytes,
                total: h.total,
                source: h.source,
                error: h.error,
                gpus: h.gpus,
                gpu_bytes: h.gpu_bytes,
                partition: h.partition,
                live_s: h.live_s,
                done_s: h.done_s,
                lost_at: h.lost_at,
                // Legacy records carry no re-plan counts: every receiver starts afresh.
                fruitless_replans: 0,
                bytes_at_replan: 0,
                awaits_room: false,
            })
        })
        .collect::<Result<Vec<_>, String>>()
        .map_err(RecordError::Invalid)?;
    Ok(Plan {
        tier,
        state,
        kind,
        id: s.plan_id,
        model: s.model,
        digest: s.digest,
        hosts,
        estimate_s: s.estimate_s,
        message: s.message,
        chains: s
            .chains
            .into_iter()
            .map(|c| ChainSummary {
                source: c.source,
                source_tier: c.source_tier,
                hops: c.hops,
                shards: c.shards,
                bytes: c.bytes,
                estimate_s: c.estimate_s,
            })
            .collect(),
        runs: r.runs,
        replans: s.replans,
        created_at: s.created_at,
        ended_at: r.ended_at,
        live_s: s.live_s,
        origin: r.origin,
        // Legacy records predate transports: every chain ran over TCP.
        transport: HopTransport::Tcp,
    })
}

/// A heartbeat's report, typed: tiers and GPU states by name. An unknown name is an
/// `INVALID_ARGUMENT` that lists the known ones (a host of a newer version must not be
/// placed on by guesses).
pub fn host_view(r: pb::HostReport) -> Result<HostView, ApiError> {
    let host = r.host_id.clone();
    let bad = |what: &str, e: crate::plan::UnknownName| {
        ApiError::invalid(format!("host {host:?}: {what}: {e}"))
    };
    let holdings = r
        .holdings
        .into_iter()
        .map(|h| {
            Ok(Holding {
                tier: h.tier.parse().map_err(|e| bad("holdings", e))?,
                digest: h.digest,
                name: h.name,
                complete: h.complete,
                bytes_verified: h.bytes_verified,
                total_bytes: h.total_bytes,
            })
        })
        .collect::<Result<_, ApiError>>()?;
    let gpu_loads = r
        .gpu_loads
        .into_iter()
        .map(|l| {
            Ok(GpuLoad {
                state: l.state.parse().map_err(|e| bad("gpu_loads", e))?,
                digest: l.digest,
                gpus: l.gpus,
                partition: l.partition,
                error: l.error,
            })
        })
        .collect::<Result<_, ApiError>>()?;
    Ok(HostView {
        host_id: r.host_id,
        data_addr: r.data_addr,
        agent_addr: r.agent_addr,
        zone: r.zone,
        rack: r.rack,
        nic_bps: r.nic_bps,
        mem_capacity: r.mem_capacity,
        mem_free: r.mem_free,
        disk_capacity: r.disk_capacity,
        disk_free: r.disk_free,
        gpus: r
            .gpus
            .into_iter()
            .map(|g| GpuInfo {
                index: g.index,
                memory_bytes: g.memory_bytes,
                pcie_switch: g.pcie_switch,
                nvlink_peers: g.nvlink_peers,
            })
            .collect(),
        holdings,
        version: r.version,
        gpus_busy: r.gpus_busy,
        gpu_loads,
        gpu_evicted: r.gpu_evicted,
        bound_names: r.bound_names,
        started_at_ms: r.started_at_ms,
        draining: r.draining,
    })
}

/// A host's report for the API (`ListHosts`).
pub fn host_report(v: &HostView) -> pb::HostReport {
    pb::HostReport {
        host_id: v.host_id.clone(),
        data_addr: v.data_addr.clone(),
        agent_addr: v.agent_addr.clone(),
        zone: v.zone.clone(),
        rack: v.rack.clone(),
        nic_bps: v.nic_bps,
        mem_capacity: v.mem_capacity,
        mem_free: v.mem_free,
        disk_capacity: v.disk_capacity,
        disk_free: v.disk_free,
        gpus: v
            .gpus
            .iter()
            .map(|g| pb::Gpu {
                index: g.index,
                memory_bytes: g.memory_bytes,
                pcie_switch: g.pcie_switch.clone(),
                nvlink_peers: g.nvlink_peers.clone(),
            })
            .collect(),
        holdings: v
            .holdings
            .iter()
            .map(|h| pb::HeldModel {
                digest: h.digest.clone(),
                name: h.name.clone(),
                tier: h.tier.to_string(),
                complete: h.complete,
                bytes_verified: h.bytes_verified,
                total_bytes: h.total_bytes,
            })
            .collect(),
        version: v.version.clone(),
        gpus_busy: v.gpus_busy,
        gpu_loads: v
            .gpu_loads
            .iter()
            .map(|l| pb::GpuLoad {
                digest: l.digest.clone(),
                state: l.state.to_string(),
                gpus: l.gpus.clone(),
                partition: l.partition.clone(),
                error: l.error.clone(),
            })
            .collect(),
        gpu_evicted: v.gpu_evicted.clone(),
        bound_names: v.bound_names.clone(),
        started_at_ms: v.started_at_ms,
        draining: v.draining,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{PlanKind, PlanState, ReceiverState};

    #[test]
    fn a_legacy_record_reads_as_a_typed_plan() {
        let json = serde_json::json!({
            "status": {
                "plan_id": "ab", "model": "m", "digest": "d", "tier": "gpu", "state": "running",
                "hosts": [
                    {"host": "h1", "state": "receiving", "bytes": 5, "total": 10, "gpus": 1,
                     "gpu_state": "loading"},
                    {"host": "h2", "state": "local", "total": 10}
                ],
                "created_at": 3.0, "kind": "burst"
            },
            "runs": [],
            "origin": "file:///m",
            "name": "m",
            "ended_at": null
        });
        let p = legacy_plan(&serde_json::to_vec(&json).unwrap()).unwrap();
        assert_eq!(
            (p.state, p.kind, p.tier),
            (
                PlanState::Running,
                PlanKind::Burst,
                shardcast_placement::Tier::Gpu
            )
        );
        assert_eq!(p.hosts[0].state, ReceiverState::Receiving);
        assert_eq!(p.hosts[0].gpu_state, Some(crate::plan::GpuState::Loading));
        assert_eq!(p.hosts[1].gpu_state, None);
        // And back to the wire as it was.
        let s = plan_status(&p, 5.0);
        assert_eq!(
            (s.state(), s.kind(), s.elapsed_s),
            (pb::PlanState::Running, pb::PlanKind::Burst, 2.0)
        );
        assert_eq!(s.hosts[0].gpu_state(), pb::GpuState::Loading);

        let bad = json.to_string().replace("receiving", "dreaming");
        let e = legacy_plan(bad.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("dreaming"), "{e}");
    }

    #[test]
    fn every_core_state_has_its_wire_name() {
        for s in PlanState::ALL {
            let w = pb::PlanState::from(*s);
            assert_ne!(w, pb::PlanState::Unspecified);
            assert_eq!(PlanState::try_from(w), Ok(*s));
        }
        for s in PlanKind::ALL {
            assert_eq!(PlanKind::try_from(pb::PlanKind::from(*s)), Ok(*s));
        }
        for s in ReceiverState::ALL {
            let w = pb::ReceiverState::from(*s);
            assert_ne!(w, pb::ReceiverState::Unspecified);
            assert_eq!(ReceiverState::try_from(w), Ok(*s));
        }
        for s in GpuState::ALL {
            let w = pb::GpuState::from(*s);
            assert_ne!(w, pb::GpuState::Unspecified);
            assert_eq!(GpuState::try_from(w), Ok(*s));
        }
        for t in [Tier::Memory, Tier::Disk, Tier::Gpu] {
            assert_eq!(tier_of(pb::Tier::from(t) as i32).unwrap(), t);
        }
        assert_eq!(tier_of(0).unwrap(), Tier::Memory);
        assert!(tier_of(99).is_err());
    }

    #[test]
    fn a_report_with_an_unknown_tier_or_gpu_state_is_refused_by_name() {
        let report = |tier: &str, state: &str| pb::HostReport {
            host_id: "h1".into(),
            holdings: vec![pb::HeldModel {
                digest: "d".into(),
                tier: tier.into(),
                ..Default::default()
            }],
            gpu_loads: vec![pb::GpuLoad {
                digest: "d".into(),
                state: state.into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let v = host_view(report("disk", "partition-live")).unwrap();
        assert_eq!(v.holdings[0].tier, crate::inventory::DataTier::Disk);
        assert_eq!(v.gpu_loads[0].state, GpuState::PartitionLive);
        assert_eq!(host_report(&v), report("disk", "partition-live"));
        let e = host_view(report("tape", "resident")).unwrap_err();
        assert_eq!(e.code, tonic::Code::InvalidArgument);
        assert!(
            e.message.contains("\"tape\"") && e.message.contains("memory, disk"),
            "{}",
            e.message
        );
        let e = host_view(report("memory", "asleep")).unwrap_err();
        assert!(
            e.message.contains("gpu_loads") && e.message.contains("\"asleep\""),
            "{}",
            e.message
        );
    }
}
