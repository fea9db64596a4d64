//! The controller at 1000 hosts: a real `shardcast-controller` process under a swarm of
//! 1000 simulated hosts (`shardcast_bench::swarm`), each heartbeating over gRPC with its
//! own host certificate and serving the agent API on its own loopback port. The simulated
//! hosts move no bytes (transfers are timed at a simulated link rate); what is under test
//! is the control plane: every host registered and up, a prewarm of 64 replicas planned,
//! run and completed with every receiver reporting the model, and the status APIs
//! answering throughout. Then the same swarm against three controller replicas on a real
//! etcd: hosts follow the leader from a follower's refusal, the prewarm completes, no host
//! is lost or marked down, and a follower's view (kept by its etcd watch) shows the same
//! holders.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use shardcast_bench::control::wait_plan;
use shardcast_bench::scale::{
    SIM_ORIGIN_PREFIX, ScaleControllers, StoreKind, hosts_up, start_controller,
};
use shardcast_bench::swarm::{SimModel, Swarm, SwarmOpts};
use shardcast_protocol::controller::{
    GetStatusRequest, ListHostsRequest, ListPlansRequest, PrewarmRequest, RegisterModelRequest,
};

const HOSTS: usize = 1000;
const REPLICAS: u32 = 64;
const HEARTBEAT_MS: u64 = 1000;

/// Waits (30 s at most) until `client`'s controller lists every host of `swarm` up, and
/// checks that it lists exactly the swarm; returns the listing.
async fn all_up(
    client: &mut shardcast_protocol::controller::controller_client::ControllerClient<
        tonic::transport::Channel,
    >,
    swarm: &Swarm,
    at: &str,
) -> anyhow::Result<shardcast_protocol::controller::ListHostsResponse> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while hosts_up(client).await? < HOSTS {
        ensure!(
            Instant::now() < deadline,
            "not every host came up at {at} within 30 s (last heartbeat error: {})",
            swarm.heartbeats.last_error()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let listed = client.list_hosts(ListHostsRequest {}).await?.into_inner();
    let ids: BTreeSet<String> = listed
        .hosts
        .iter()
        .filter_map(|h| h.report.as_ref().map(|r| r.host_id.clone()))
        .collect();
    assert_eq!(ids, swarm.host_ids(), "{at} lists exactly the swarm");
    Ok(listed)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_hosts_heartbeat_prewarm_64_and_status_answers_under_load() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let origin_bps = 2_500_000_000 / 8;
    let controller = start_controller(dir.path(), HEARTBEAT_MS, origin_bps, false, &[]).await?;
    let name = "sim/scale-test";
    let origin = format!("{SIM_ORIGIN_PREFIX}scale-test/");
    let model = SimModel::zeros(name, &origin, 256 << 20, 2, 1 << 20)?;
    let swarm = Swarm::start(SwarmOpts {
        hosts: HOSTS,
        racks: 25,
        heartbeat: Duration::from_millis(HEARTBEAT_MS),
        link_bps: 10_000_000_000 / 8,
        origin_bps,
        mem_capacity: 512 << 30,
        disk_capacity: 4 << 40,
        controllers: vec![controller.grpc.to_string()],
        pki: controller.pki.clone(),
        catalog: vec![model],
    })
    .await?;
    let mut client = controller.client().await?;

    // Every host registers over its own mutually authenticated connection and is up.
    let listed = all_up(&mut client, &swarm, "the controller").await?;
    for h in &listed.hosts {
        let r = h.report.as_ref().context("a host without its report")?;
        let sim = swarm.host(&r.host_id).context("an unknown host")?;
        assert!(h.up, "{} is not up", r.host_id);
        assert_eq!(r.agent_addr, sim.agent_addr.to_string());
        assert_eq!(r.rack, sim.rack);
    }

    // Registration goes through one simulated host's ImportModel.
    let info = client
        .register_model(RegisterModelRequest {
            name: name.into(),
            origin,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(info.total_bytes, 256 << 20);

    // Status queries run the whole time; each must answer.
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let prober = {
        let (mut c, stop, answered) = (client.clone(), stop.clone(), answered.clone());
        let name = name.to_string();
        tokio::spawn(async move {
            let mut slowest = Duration::ZERO;
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                c.get_status(GetStatusRequest {
                    model: name.clone(),
                })
                .await
                .context("GetStatus under load")?;
                let hosts = c.list_hosts(ListHostsRequest {}).await?.into_inner();
                ensure!(hosts.hosts.len() == HOSTS, "ListHosts lost hosts");
                c.list_plans(ListPlansRequest {}).await?;
                slowest = slowest.max(t0.elapsed());
                answered.fetch_add(3, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            anyhow::Ok(slowest)
        })
    };

    let t0 = Instant::now();
    let accepted = client
        .prewarm(PrewarmRequest {
            model: name.into(),
            replicas: REPLICAS,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await?
        .into_inner();
    let plan_time = t0.elapsed();
    let receivers: BTreeSet<String> = accepted.hosts.iter().map(|h| h.host.clone()).collect();
    assert_eq!(receivers.len(), REPLICAS as usize, "64 distinct receivers");
    assert!(receivers.is_subset(&swarm.host_ids()));
    let status = wait_plan(&mut client, &accepted.plan_id, Duration::from_secs(60)).await?;
    assert_eq!(status.state().label(), "done", "{status:?}");
    assert!(
        status
            .hosts
            .iter()
            .all(|h| h.state().label() == "done" && h.bytes == 256 << 20),
        "{:?}",
        status.hosts
    );
    let done = t0.elapsed();

    // Every receiver holds the model (in its simulated store) and reports it: GetStatus
    // shows exactly the 64 receivers with a complete memory copy once they heartbeated.
    assert_eq!(swarm.holders(&status.digest), receivers);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = client
            .get_status(GetStatusRequest { model: name.into() })
            .await?
            .into_inner();
        let holders: BTreeSet<String> = s
            .hosts
            .iter()
            .filter(|h| h.up && h.memory && h.memory_bytes == 256 << 20)
            .map(|h| h.host.clone())
            .collect();
        if holders == receivers {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "GetStatus shows {} holders, not the plan's {} receivers",
            holders.len(),
            receivers.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    stop.store(true, Ordering::Relaxed);
    let slowest = prober.await??;
    assert!(
        answered.load(Ordering::Relaxed) >= 30,
        "status queries answered: {}",
        answered.load(Ordering::Relaxed)
    );
    // Generous bounds (a loaded 2-core CI machine); the benchmark reports the real numbers.
    assert!(
        slowest < Duration::from_secs(2),
        "a round of status queries took {slowest:?}"
    );
    assert!(
        plan_time < Duration::from_secs(2),
        "planning took {plan_time:?}"
    );
    let (ok, failed, _) = swarm.heartbeats.take();
    assert_eq!(
        failed,
        0,
        "heartbeats failed: {}",
        swarm.heartbeats.last_error()
    );
    assert!(ok >= HOSTS as u64, "only {ok} heartbeats answered");
    assert_eq!(hosts_up(&mut client).await?, HOSTS, "a host went down");
    eprintln!(
        "{HOSTS} hosts: plan {plan_time:?}, 64 replicas done after {done:?}, {ok} heartbeats, slowest status round {slowest:?}"
    );
    swarm.stop().await;
    Ok(())
}

/// Hosts `GetStatus` shows holding a complete memory copy of `model`, up.
async fn memory_holders<T: shardcast_bench::control::ApiChannel>(
    client: &mut shardcast_protocol::controller::controller_client::ControllerClient<T>,
    model: &str,
    bytes: u64,
) -> anyhow::Result<BTreeSet<String>> {
    let s = client
        .get_status(GetStatusRequest {
            model: model.into(),
        })
        .await?
        .into_inner();
    Ok(s.hosts
        .iter()
        .filter(|h| h.up && h.memory && h.memory_bytes == bytes)
        .map(|h| h.host.clone())
        .collect())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_hosts_on_three_replicas_on_etcd_prewarm_64_none_lost() -> anyhow::Result<()> {
    let t_start = Instant::now();
    let dir = tempfile::tempdir()?;
    let origin_bps = 2_500_000_000 / 8;
    let ctl = ScaleControllers::start(
        dir.path(),
        StoreKind::Etcd,
        3,
        HEARTBEAT_MS,
        origin_bps,
        false,
        &[],
    )
    .await?;
    let leader = ctl.wait_leader(Duration::from_secs(20)).await?;
    let follower = (leader + 1) % 3;
    let name = "sim/scale-etcd";
    let origin = format!("{SIM_ORIGIN_PREFIX}scale-etcd/");
    let size = 256 << 20;
    let model = SimModel::zeros(name, &origin, size, 2, 1 << 20)?;
    // The leader listed last: every host's first heartbeat is refused by a follower that
    // names the leader, and the host follows.
    let mut addrs = ctl.grpc_addrs();
    addrs.rotate_left(leader + 1);
    let swarm = Swarm::start(SwarmOpts {
        hosts: HOSTS,
        racks: 25,
        heartbeat: Duration::from_millis(HEARTBEAT_MS),
        link_bps: 10_000_000_000 / 8,
        origin_bps,
        mem_capacity: 512 << 30,
        disk_capacity: 4 << 40,
        controllers: addrs,
        pki: ctl.replicas[0].pki.clone(),
        catalog: vec![model],
    })
    .await?;
    let mut client = ctl.client(leader).await?;
    let _ = all_up(&mut client, &swarm, "the leader").await?;
    // Heartbeats that failed while 1000 hosts came up at once (each handshaking with a
    // follower, then with the leader it names, 2000 TLS handshakes on this machine's two
    // cores within the hosts' 2 s of patience): each host beats again on its next tick, and
    // all are up. Counted apart; none may fail from here on.
    let (_, failed_coming_up, _) = swarm.heartbeats.take();

    // Writes through the client that follows the leader.
    let mut api = ctl.failover_client()?;
    api.register_model(RegisterModelRequest {
        name: name.into(),
        origin,
        ..Default::default()
    })
    .await?;
    let t0 = Instant::now();
    let accepted = api
        .prewarm(PrewarmRequest {
            model: name.into(),
            replicas: REPLICAS,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await?
        .into_inner();
    let plan_time = t0.elapsed();
    let receivers: BTreeSet<String> = accepted.hosts.iter().map(|h| h.host.clone()).collect();
    assert_eq!(receivers.len(), REPLICAS as usize, "64 distinct receivers");
    let status = wait_plan(&mut api, &accepted.plan_id, Duration::from_secs(60)).await?;
    assert_eq!(status.state().label(), "done", "{status:?}");
    assert!(
        status
            .hosts
            .iter()
            .all(|h| h.state().label() == "done" && h.bytes == size),
        "{:?}",
        status.hosts
    );
    let done = t0.elapsed();
    assert_eq!(swarm.holders(&status.digest), receivers);

    // The leader, then a follower (its view kept by the watch), show the 64 holders.
    let mut follower_client = ctl.client(follower).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let at_leader = memory_holders(&mut client, name, size).await?;
        let at_follower = memory_holders(&mut follower_client, name, size).await?;
        if at_leader == receivers && at_follower == receivers {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "holders: the leader shows {}, the follower {}, the plan has {}",
            at_leader.len(),
            at_follower.len(),
            receivers.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let follower_plan = follower_client
        .get_plan(shardcast_protocol::controller::WatchPlanRequest {
            plan_id: accepted.plan_id.clone(),
        })
        .await?
        .into_inner();
    assert_eq!(follower_plan.state().label(), "done");
    // Every host's first record is committed before its heartbeat is answered, so the
    // follower's watch brings at least one change per host; it applies them on its own
    // time, which on a loaded machine can trail the leader (a clean-clone CI once read 749
    // of 1000 here right after the plan ended), so it gets a bounded wait to catch up.
    let caught_up_by = Instant::now() + Duration::from_secs(30);
    let view = loop {
        let view = ctl
            .view_counts(follower)
            .await
            .context("the follower's view counters")?;
        if view.1 >= HOSTS as u64 || Instant::now() >= caught_up_by {
            break view;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(
        view.0, 1,
        "the follower loaded the state whole only once: {view:?}"
    );
    assert!(
        view.1 >= HOSTS as u64,
        "changes applied within 30 s of the plan's end: {view:?}"
    );

    // No host lost, none marked down, no heartbeat failed.
    let listed = client.list_hosts(ListHostsRequest {}).await?.into_inner();
    assert_eq!(listed.hosts.len(), HOSTS, "the leader lost hosts");
    let down: Vec<String> = listed
        .hosts
        .iter()
        .filter(|h| !h.up)
        .filter_map(|h| h.report.as_ref().map(|r| r.host_id.clone()))
        .collect();
    assert!(down.is_empty(), "hosts marked down: {down:?}");
    let (ok, failed, _) = swarm.heartbeats.take();
    assert_eq!(
        failed - failed_coming_up,
        0,
        "heartbeats failed once every host was up: {}",
        swarm.heartbeats.last_error()
    );
    assert!(
        plan_time < Duration::from_secs(2),
        "planning took {plan_time:?}"
    );
    eprintln!(
        "{HOSTS} hosts on 3 replicas: plan {plan_time:?}, 64 done after {done:?}, {ok} heartbeats ({failed_coming_up} failed while the hosts came up), follower view {view:?}, test {:?}",
        t_start.elapsed()
    );
    swarm.stop().await;
    Ok(())
}
