//! The autoscaler's scale-down victims and load time (issue #32): before these, a
//! scale-down of `n` replicas evicted the `n` newest *hosts* — every replica each held, and
//! hosts still loading — and the load time was the last plan's slowest receiver.

use std::sync::{Arc, Mutex};

use shardcast_placement::Tier;

use super::*;
use crate::error::PartitionError;
use crate::plan::{PlanKind, PlanState, ReceiverProgress};
use crate::ptables::PartitionInputs;
use crate::state::{RedbStore, StateStore};

/// A fleet with a fixed view; records what the autoscaler asks of it.
struct FakeFleet {
    view: ScalingView,
    evicts: Mutex<Vec<Vec<String>>>,
    scale_outs: Mutex<Vec<u32>>,
}

impl Fleet for FakeFleet {
    fn scaling_view(&self, _key: &str, _tier: Tier) -> Result<ScalingView, LookupError> {
        Ok(self.view.clone())
    }

    fn scale_out(&self, req: ScaleOut) -> Result<Accepted, PlanRequestError> {
        self.scale_outs.lock().unwrap().push(req.replicas);
        Ok(Accepted {
            plan_id: "up".into(),
            estimate_s: 1.0,
            chains: Vec::new(),
            hosts: Vec::new(),
        })
    }

    async fn burst(
        &self,
        model: &str,
        _replicas: u32,
        _partitions: u32,
    ) -> Result<(Accepted, Vec<BurstPart>), ScaleOutError> {
        Err(PartitionError::NoProfileSource(model.to_string()).into())
    }

    async fn evict(&self, req: EvictModel) -> Result<Evicted, EvictError> {
        self.evicts.lock().unwrap().push(req.hosts.clone());
        Ok(Evicted {
            evicted: req.hosts,
            bytes_freed: 0,
            pending: Vec::new(),
        })
    }
}

/// No profile: the autoscaler is offered no partitioned burst.
struct NoProfile;

impl ModelSource for NoProfile {
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

fn holder(host: &str, replicas: u32, loading: bool) -> Holder {
    Holder {
        host: host.into(),
        replicas,
        loading,
    }
}

/// The autoscaler over a fleet of `holders` (oldest first), with no scale-down delay
/// (load time 0), and the tempdir its partition tables' store lives in.
fn scaler(holders: Vec<Holder>) -> (Autoscaler<FakeFleet, NoProfile>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn StateStore> = Arc::new(RedbStore::open(&dir.path().join("s.redb")).unwrap());
    let tables = PartitionTables::restore(Arc::new(NoProfile), store, Default::default()).unwrap();
    let fleet = FakeFleet {
        view: ScalingView {
            name: "m".into(),
            digest: "d".into(),
            replicas: holders.iter().map(|h| h.replicas).sum(),
            load_time_s: 0.0,
            holders,
        },
        evicts: Mutex::default(),
        scale_outs: Mutex::default(),
    };
    let a = Autoscaler::new(
        Arc::new(fleet),
        Arc::new(tables),
        Arc::default(),
        Arc::default(),
    );
    (a, dir)
}

fn load(arrival_rate: f64) -> ReportLoad {
    ReportLoad {
        model: "m".into(),
        arrival_rate,
        queue_len: 0,
        service_rate: 1.0,
        tier: Tier::Gpu,
    }
}

#[tokio::test]
async fn a_scale_down_evicts_only_the_replicas_it_decided_on_and_none_still_loading() {
    // 8 replicas: 4 + 2 + 1 serving, the newest host's 1 still loading. λ = 4.5 at μ = 1
    // needs 5 (headroom 1.05): 3 go. The newest host loads; the next two hold 1 + 2.
    let (a, _dir) = scaler(vec![
        holder("h0", 4, false),
        holder("h1", 2, false),
        holder("h2", 1, false),
        holder("h3", 1, true),
    ]);
    let e = a.report_load(load(4.5)).await.unwrap();
    assert_eq!(e.kind, "scale-down", "{}", e.reason);
    assert_eq!(e.delta, -3, "{}", e.reason);
    assert_eq!(e.hosts, ["h2", "h1"]);
    assert_eq!(*a.fleet.evicts.lock().unwrap(), [vec!["h2", "h1"]]);
}

#[tokio::test]
async fn a_host_holding_more_replicas_than_the_removal_is_passed_over() {
    // 1 to go (λ = 6.5 needs 7 of 8); the newest host holds 2, the one before it 1.
    let (a, _dir) = scaler(vec![
        holder("h0", 5, false),
        holder("h1", 1, false),
        holder("h2", 2, false),
    ]);
    let e = a.report_load(load(6.5)).await.unwrap();
    assert_eq!(
        (e.kind.as_str(), e.delta),
        ("scale-down", -1),
        "{}",
        e.reason
    );
    assert_eq!(*a.fleet.evicts.lock().unwrap(), [vec!["h1"]]);
    // Every host holds more than the one to remove: nothing is evicted.
    let (a, _dir) = scaler(vec![holder("h0", 4, false), holder("h1", 4, false)]);
    let e = a.report_load(load(6.5)).await.unwrap();
    assert_eq!(e.kind, "hold");
    assert!(e.reason.ends_with("nothing evictable"), "{}", e.reason);
    assert!(a.fleet.evicts.lock().unwrap().is_empty());
    assert!(a.fleet.scale_outs.lock().unwrap().is_empty());
}

#[tokio::test]
async fn the_last_serving_replica_stays_while_the_others_load() {
    // No load: the policy would remove all 3, but two of them are still loading and the
    // one serving is the last.
    let (a, _dir) = scaler(vec![holder("h0", 1, false), holder("h1", 2, true)]);
    let e = a.report_load(load(0.0)).await.unwrap();
    assert_eq!(e.kind, "hold", "{}", e.reason);
    assert!(a.fleet.evicts.lock().unwrap().is_empty());
}

#[test]
fn victims_are_the_newest_serving_hosts_that_fit() {
    let hs = [
        holder("a", 1, false),
        holder("b", 3, false),
        holder("c", 2, true),
        holder("d", 1, false),
    ];
    assert_eq!(scale_down_victims(&hs, 1), ["d"]);
    assert_eq!(scale_down_victims(&hs, 2), ["d", "a"]);
    assert_eq!(scale_down_victims(&hs, 4), ["d", "b"]);
    // Never the last of the 5 serving.
    assert_eq!(scale_down_victims(&hs, 5), ["d", "b"]);
    assert_eq!(scale_down_victims(&hs, 8), ["d", "b"]);
    assert!(scale_down_victims(&hs, 0).is_empty());
    assert!(scale_down_victims(&[holder("a", 1, false)], 1).is_empty());
    assert!(scale_down_victims(&[], 3).is_empty());
}

/// A plan of `digest` in `tier` made at `created_at`, its receivers in `states` with
/// `done_s` each, ended (or running).
fn plan(
    digest: &str,
    tier: Tier,
    created_at: f64,
    receivers: &[(ReceiverState, f64)],
    state: PlanState,
) -> Plan {
    let hosts = receivers
        .iter()
        .enumerate()
        .map(|(i, (s, done))| ReceiverProgress {
            done_s: *done,
            ..ReceiverProgress::new(format!("h{i}"), *s)
        })
        .collect();
    let mut p = Plan::started(
        "p",
        ("m", digest),
        tier,
        PlanKind::Chains,
        hosts,
        "file:///m",
        created_at,
    );
    p.state = state;
    if state != PlanState::Running {
        // The slowest receiver ended the plan.
        let slowest = receivers.iter().map(|r| r.1).fold(0.0, f64::max);
        p.ended_at = Some(created_at + slowest);
    }
    p
}

#[test]
fn the_load_time_is_the_mean_cold_start_of_the_latest_receivers_not_the_slowest() {
    use ReceiverState::*;
    let plans = [
        // Older: only counted when the newer ones have fewer than LOAD_TIME_SAMPLES.
        plan("d", Tier::Gpu, 10.0, &[(Done, 100.0)], PlanState::Done),
        // The latest ended plan: 10 and 20 s, the plan itself 40 s (its slowest), a local
        // receiver (no cold start) and a failed one.
        plan(
            "d",
            Tier::Gpu,
            50.0,
            &[(Done, 10.0), (Done, 20.0), (Local, 0.0), (Failed, 0.0)],
            PlanState::Partial,
        ),
        // Running, another model, another tier: not counted.
        plan(
            "d",
            Tier::Gpu,
            60.0,
            &[(Done, 1.0), (Receiving, 0.0)],
            PlanState::Running,
        ),
        plan("e", Tier::Gpu, 70.0, &[(Done, 1.0)], PlanState::Done),
        plan("d", Tier::Memory, 70.0, &[(Done, 1.0)], PlanState::Done),
    ];
    // 10, 20 and the older 100.
    assert_eq!(
        measured_load_time(&plans, "d", Tier::Gpu),
        Some(130.0 / 3.0)
    );
    assert_eq!(measured_load_time(&plans, "x", Tier::Gpu), None);
    assert_eq!(measured_load_time(&plans[2..3], "d", Tier::Gpu), None);
    // Enough recent receivers: the older plan drops out.
    let many = vec![(Done, 8.0); LOAD_TIME_SAMPLES - 1];
    let mut latest = plans.to_vec();
    latest.push(plan("d", Tier::Gpu, 80.0, &many, PlanState::Done));
    // 15 × 8 s and the 10 s of the plan before, the 20 s and 100 s beyond the samples.
    let want = (8.0 * (LOAD_TIME_SAMPLES - 1) as f64 + 10.0) / LOAD_TIME_SAMPLES as f64;
    assert_eq!(measured_load_time(&latest, "d", Tier::Gpu), Some(want));
}
