//! The edge between the controller's typed core ([`crate::plan`]) and the API's wire
//! messages: the gRPC front end ([`crate::grpc`]) and the HTTP/JSON one ([`crate::http`])
//! convert here, and nowhere else, so the core never compares or builds state strings.

use shardcast_protocol::controller::{HostProgress, PlanAccepted, PlanStatus, PlannedChain};

use crate::plan::{Accepted, ChainSummary, Plan, ReceiverProgress};

impl From<&ReceiverProgress> for HostProgress {
    fn from(r: &ReceiverProgress) -> Self {
        Self {
            host: r.host.clone(),
            state: r.state.to_string(),
            bytes: r.bytes,
            total: r.total,
            source: r.source.clone(),
            error: r.error.clone(),
            gpus: r.gpus,
            gpu_bytes: r.gpu_bytes,
            gpu_state: r.gpu_state.map(|g| g.to_string()).unwrap_or_default(),
            partition: r.partition.clone(),
            live_s: r.live_s,
            done_s: r.done_s,
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
        tier: p.tier.to_string(),
        state: p.state.to_string(),
        hosts: p.hosts.iter().map(HostProgress::from).collect(),
        estimate_s: p.estimate_s,
        elapsed_s: p.elapsed_s(now),
        message: p.message.clone(),
        chains: p.chains.iter().map(PlannedChain::from).collect(),
        replans: p.replans,
        created_at: p.created_at,
        kind: p.kind.to_string(),
        live_s: p.live_s,
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
pub fn legacy_plan(bytes: &[u8]) -> Result<Plan, String> {
    use crate::plan::{GpuState, PlanKind, PlanState, ReceiverState};
    let r: LegacyPlanRecord = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let s = r.status;
    let hosts = s
        .hosts
        .into_iter()
        .map(|h| {
            Ok(ReceiverProgress {
                state: h
                    .state
                    .parse::<ReceiverState>()
                    .map_err(|e| e.to_string())?,
                gpu_state: match h.gpu_state.as_str() {
                    "" => None,
                    g => Some(g.parse::<GpuState>().map_err(|e| e.to_string())?),
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
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Plan {
        tier: s.tier.parse().map_err(|e| format!("{e}"))?,
        state: s.state.parse::<PlanState>().map_err(|e| e.to_string())?,
        kind: match s.kind.as_str() {
            "" => PlanKind::Chains,
            k => k.parse::<PlanKind>().map_err(|e| e.to_string())?,
        },
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
    })
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
            (s.state.as_str(), s.kind.as_str(), s.elapsed_s),
            ("running", "burst", 2.0)
        );
        assert_eq!(s.hosts[0].gpu_state, "loading");

        let bad = json.to_string().replace("receiving", "dreaming");
        let e = legacy_plan(bad.as_bytes()).unwrap_err();
        assert!(e.contains("dreaming"), "{e}");
    }
}
