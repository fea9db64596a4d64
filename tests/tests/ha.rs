//! High availability on a real etcd: three `shardcast-controller` replicas and real
//! `transferd` daemons on loopback. The leader is killed during a prewarm and during a
//! partitioned burst, etcd is killed and restarted under the replicas, and one replica is
//! cut off from etcd. Every wait is bounded; every process is killed by PID when its
//! handle drops. etcd comes from PATH (`.ci/setup` installs Debian's `etcd-server`).

use std::time::{Duration, Instant};

use shardcast_bench::cluster::DaemonOpts;
use shardcast_bench::control::{HttpAs, cli_bin, wait_fraction, wait_plan};
use shardcast_bench::ha::{HaCluster, role, wait_role};
use shardcast_bench::synth::{self, SynthSpec};
use shardcast_identity::Role;
use shardcast_identity::failover::FailoverChannel;
use shardcast_protocol::Manifest;
use shardcast_protocol::codec::decode_exact;
use shardcast_protocol::controller::controller_client::ControllerClient;
use shardcast_protocol::controller::{
    GetStatusRequest, ListModelsRequest, ListPlansRequest, PrewarmRequest, RegisterModelRequest,
    ScaleOutRequest,
};

const MODEL: &str = "test/ha";

type Api = ControllerClient<FailoverChannel>;

/// A synthetic model under the origins root the clusters allow.
fn origin(size: u64, seed: u64) -> (tempfile::TempDir, String) {
    let dir = shardcast_tests::origin_dir();
    synth::generate(
        dir.path(),
        &SynthSpec {
            total_bytes: size,
            shards: 2,
            seed,
        },
    )
    .unwrap();
    let uri = format!("file://{}", dir.path().display());
    (dir, uri)
}

async fn start(n: usize, proxied: &[usize], opts: impl FnMut(usize, &mut DaemonOpts)) -> HaCluster {
    let root = format!("file://{}/", shardcast_tests::origins_root().display());
    let allow = shardcast_tests::allow_args(&[root.as_str()]);
    let mut opts = opts;
    let daemon_allow = allow.clone();
    HaCluster::start(3, n, allow, proxied, move |i, o| {
        o.extra_args.extend(daemon_allow.clone());
        opts(i, o);
    })
    .await
    .unwrap()
}

async fn register(api: &mut Api, name: &str, uri: &str) -> Manifest {
    let m = api
        .register_model(RegisterModelRequest {
            name: name.into(),
            origin: uri.into(),
            chunk_size: 256 << 10,
            via_host: String::new(),
            profile_json: String::new(),
            no_wait: false,
        })
        .await
        .unwrap()
        .into_inner();
    decode_exact(m.manifest.into()).unwrap()
}

/// A prewarm of the model onto both hosts, through whichever replica leads, that ends done.
async fn prewarm_both_hosts(api: &mut Api) {
    let plan = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            replicas: 2,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .plan_id;
    let done = wait_plan(api, &plan, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
}

async fn cli(c: &HaCluster, args: &[&str]) -> (i32, String, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(cli_bin().unwrap())
            .args(c.cli_args().unwrap())
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the CLI answered within 60 s")
    .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Kills the leader (SIGKILL) and waits for another replica to lead; the new leader's
/// index and how long the hand-over took.
async fn kill_leader(c: &mut HaCluster) -> (usize, usize, Duration) {
    let old = c.wait_leader(Duration::from_secs(20)).await.unwrap();
    let t0 = Instant::now();
    c.controllers[old].kill().await;
    let new = c.wait_leader(Duration::from_secs(20)).await.unwrap();
    assert_ne!(old, new);
    (old, new, t0.elapsed())
}

/// Every host in `hosts` holds the model, per the leader's own status (a follower's view
/// may lag a heartbeat behind); polled for at most 10 s.
async fn assert_held(c: &HaCluster, hosts: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let leader = c.wait_leader(Duration::from_secs(10)).await.unwrap();
        let st = c.controllers[leader]
            .client()
            .await
            .unwrap()
            .get_status(GetStatusRequest {
                model: MODEL.into(),
            })
            .await
            .unwrap()
            .into_inner();
        let missing: Vec<&&str> = hosts
            .iter()
            .filter(|h| !st.hosts.iter().any(|x| x.host == **h))
            .collect();
        if missing.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{missing:?} do not hold {MODEL}: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_during_prewarm_a_new_leader_finishes_it() {
    let mut c = start(3, &[], |_, o| o.egress_rate = "12MB/s".into()).await;
    let (_dir, uri) = origin(24 << 20, 21);
    let mut api = c.client().unwrap();
    let manifest = register(&mut api, MODEL, &uri).await;
    let plan = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            replicas: 3,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .plan_id;
    wait_fraction(&mut api, &plan, 0.1).await;
    let (_, new, took) = kill_leader(&mut c).await;
    assert!(took < Duration::from_secs(10), "fail-over took {took:?}");
    // The new leader resumes the plan from etcd and finishes it.
    let done = wait_plan(&mut api, &plan, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    // The host that built the manifest kept the copy at registration ("local").
    assert!(
        done.hosts
            .iter()
            .all(|h| h.state().label() == "done" || h.state().label() == "local"),
        "{done:?}"
    );
    assert!(
        done.hosts.iter().any(|h| h.state().label() == "done"),
        "{done:?}"
    );
    for d in &c.daemons {
        d.verify_copy(&manifest).unwrap();
    }
    // Nothing lost: the model, the plan and the holdings, read from the new leader.
    let mut leader = c.controllers[new].client().await.unwrap();
    let models = leader
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(models.models.len(), 1, "{models:?}");
    let plans = leader
        .list_plans(ListPlansRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(plans.plans.iter().any(|p| p.plan_id == plan), "{plans:?}");
    c.wait_hosts_up(3, Duration::from_secs(20)).await.unwrap();
    assert_held(&c, &["host-1", "host-2", "host-3"]).await;
    // The CLI, given every replica, reads and writes through the new leader.
    let (code, out, err) = cli(&c, &["models"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(MODEL), "{out}");
    let (code, out, err) = cli(&c, &["prewarm", MODEL, "--replicas", "3"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = cli(&c, &["status", MODEL]).await;
    assert_eq!(code, 0, "{out}{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_during_a_burst_a_new_leader_finishes_it() {
    let mut c = start(3, &[], |_, o| {
        o.egress_rate = "8MB/s".into();
        o.sim_gpus(1, "128MiB");
    })
    .await;
    let (_dir, uri) = origin(16 << 20, 22);
    let mut api = c.client().unwrap();
    let manifest = register(&mut api, MODEL, &uri).await;
    // host-1 holds the model in memory: the peer the partitions come from.
    let first = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            hosts: vec!["host-1".into()],
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .plan_id;
    let p = wait_plan(&mut api, &first, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(p.state().label(), "done", "{p:?}");
    let burst = api
        .scale_out(ScaleOutRequest {
            model: MODEL.into(),
            replicas: 1,
            tier: shardcast_protocol::controller::Tier::Gpu as i32,
            partitions: 2,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!burst.plan_id.is_empty(), "{burst:?}");
    let hosts: Vec<String> = burst.hosts.iter().map(|h| h.host.clone()).collect();
    let (_, new, took) = kill_leader(&mut c).await;
    assert!(took < Duration::from_secs(10), "fail-over took {took:?}");
    let done = wait_plan(&mut api, &burst.plan_id, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(
        (done.state().label(), done.kind().label()),
        ("done", "burst"),
        "{done:?}"
    );
    for h in &hosts {
        c.daemon(h).unwrap().verify_copy(&manifest).unwrap();
    }
    // The registry, both plans and the holdings survived the hand-over.
    let mut leader = c.controllers[new].client().await.unwrap();
    let plans = leader
        .list_plans(ListPlansRequest {})
        .await
        .unwrap()
        .into_inner();
    for id in [&first, &burst.plan_id] {
        assert!(plans.plans.iter().any(|p| &p.plan_id == id), "{plans:?}");
    }
    c.wait_hosts_up(3, Duration::from_secs(20)).await.unwrap();
    let refs: Vec<&str> = hosts.iter().map(String::as_str).collect();
    assert_held(&c, &refs).await;
    let (code, out, err) = cli(&c, &["plans"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&burst.plan_id), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restarted_under_the_replicas_they_reconnect_and_carry_on() {
    let mut c = start(2, &[], |_, _| {}).await;
    let (_dir, uri) = origin(4 << 20, 23);
    let mut api = c.client().unwrap();
    register(&mut api, MODEL, &uri).await;
    c.etcd.kill().await;
    // Without etcd no replica may act as leader (within the step-down bound)...
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.leader().await.is_some() {
        assert!(
            Instant::now() < deadline,
            "a replica still leads without etcd"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // ...but reads still work, from the last view.
    let models = api
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(models.models.len(), 1);
    c.etcd.restart().await.unwrap();
    c.wait_leader(Duration::from_secs(30)).await.unwrap();
    c.wait_hosts_up(2, Duration::from_secs(30)).await.unwrap();
    // Writes work again, and nothing stored before the outage is lost.
    let (_dir2, uri2) = origin(2 << 20, 24);
    register(&mut api, "test/ha-after", &uri2).await;
    prewarm_both_hosts(&mut api).await;
    let models = api
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(models.models.len(), 2, "{models:?}");
    let (code, out, err) = cli(&c, &["models"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("test/ha-after"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_from_etcd_stops_acting_as_leader() {
    // Replica 0 reaches etcd through a relay the test cuts; it is started first and leads.
    let c = start(2, &[0], |_, _| {}).await;
    assert_eq!(c.leader().await, Some(0));
    let (_dir, uri) = origin(2 << 20, 25);
    let mut api = c.client().unwrap();
    register(&mut api, MODEL, &uri).await;
    let (_, proxy) = &c.proxies[0];
    let cut_at = Instant::now();
    proxy.cut();
    // It steps down before its lease (3 s) can have expired in etcd.
    wait_role(&c.controllers[0], "follower", Duration::from_secs(3))
        .await
        .unwrap();
    let stepped = cut_at.elapsed();
    assert!(
        stepped < Duration::from_secs(3),
        "stepped down after {stepped:?}"
    );
    // It refuses writes, over HTTP (503, naming no leader it cannot see) and gRPC.
    let (status, body) = c.controllers[0]
        .http(HttpAs::Cert(Role::Admin), "POST", "/v1/evict", "{}")
        .await
        .unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("not the leader"), "{body}");
    let mut direct = c.controllers[0].client().await.unwrap();
    let e = direct
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            replicas: 1,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains("not the leader"), "{e:?}");
    assert!(e.metadata().get("x-shardcast-leader").is_some(), "{e:?}");
    // The majority side elects another leader, which takes writes and heartbeats.
    let new = c.wait_leader(Duration::from_secs(15)).await.unwrap();
    assert_ne!(new, 0);
    c.wait_hosts_up(2, Duration::from_secs(20)).await.unwrap();
    prewarm_both_hosts(&mut api).await;
    // The cut-off replica stays a follower and names the new leader once healed.
    assert_eq!(role(&c.controllers[0]).await.as_deref(), Some("follower"));
    proxy.heal();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = c.controllers[0]
            .http(HttpAs::Cert(Role::Admin), "POST", "/v1/evict", "{}")
            .await
            .unwrap();
        assert_eq!(status, 503, "{body}");
        if body.contains(&format!("ctl-{}", new + 1)) {
            break;
        }
        assert!(Instant::now() < deadline, "{body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
