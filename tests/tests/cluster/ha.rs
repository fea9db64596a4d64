//! High availability on a real etcd: three `shardcast-controller` replicas and real
//! `transferd` daemons on loopback. The leader is killed during a prewarm and during a
//! partitioned burst, etcd is killed and restarted under the replicas, and one replica is
//! cut off from etcd. A follower's view follows etcd through a watch (a reload only after
//! a compaction overtook it). The etcd state store on its own: `put_many` in fenced
//! batches, the watch's puts, deletes and compaction. Every wait is bounded; every process
//! is killed by PID when its handle drops. etcd comes from PATH (`.ci/setup` installs
//! Debian's `etcd-server`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shardcast_bench::cluster::DaemonOpts;
use shardcast_bench::control::{HttpAs, cli_bin, wait_fraction, wait_plan};
use shardcast_bench::ha::{ETCD_MAX_REQUEST_BYTES, EtcdProc, HaCluster, role, wait_role};
use shardcast_bench::synth::{self, SynthSpec};
use shardcast_controller::etcd::{
    Campaign, Change, EtcdConfig, EtcdStore, LeaderInfo, WatchEvent, WatchLoss,
};
use shardcast_controller::state::{StateStore, Table};
use shardcast_identity::Role;
use shardcast_identity::failover::FailoverChannel;
use shardcast_protocol::Manifest;
use shardcast_protocol::codec::decode_exact;
use shardcast_protocol::controller::controller_client::ControllerClient;
use shardcast_protocol::controller::{
    GetStatusRequest, ListHostsRequest, ListModelsRequest, ListPlansRequest, PrewarmRequest,
    RegisterModelRequest, ScaleOutRequest,
};
use tokio_util::sync::CancellationToken;

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
            ..Default::default()
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

/// `GET /v1/replica`'s `view` counters of replica `i`: (whole loads, changes applied,
/// watches resumed).
async fn view_counts(c: &HaCluster, i: usize) -> (u64, u64, u64) {
    let (status, body) = c.controllers[i]
        .http(HttpAs::Cert(Role::Read), "GET", "/v1/replica", "")
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let n = |k: &str| {
        v["view"][k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} in {body}"))
    };
    (n("full_loads"), n("applied"), n("resumed"))
}

/// What a replica's read API says: models, plans (id, state, receivers' states) and the
/// model's holders (or GetStatus's error code).
async fn reads(
    c: &HaCluster,
    i: usize,
) -> (Vec<String>, Vec<(String, String, Vec<String>)>, Vec<String>) {
    let mut api = c.controllers[i].client().await.unwrap();
    let mut models: Vec<String> = api
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner()
        .models
        .into_iter()
        .map(|m| format!("{} {}", m.name, m.digest))
        .collect();
    models.sort();
    let mut plans: Vec<(String, String, Vec<String>)> = api
        .list_plans(ListPlansRequest {})
        .await
        .unwrap()
        .into_inner()
        .plans
        .into_iter()
        .map(|p| {
            let hosts = p
                .hosts
                .iter()
                .map(|h| format!("{} {}", h.host, h.state().label()))
                .collect();
            (p.plan_id.clone(), p.state().label().to_string(), hosts)
        })
        .collect();
    plans.sort();
    let mut holders: Vec<String> = match api
        .get_status(GetStatusRequest {
            model: MODEL.into(),
        })
        .await
    {
        Ok(st) => st
            .into_inner()
            .hosts
            .into_iter()
            .map(|h| format!("{} memory={} disk={}", h.host, h.memory, h.disk))
            .collect(),
        Err(e) => vec![format!("GetStatus: {:?}", e.code())],
    };
    holders.sort();
    (models, plans, holders)
}

/// Waits (bounded) until replica `i` reads what the leader reads.
async fn wait_same_reads(c: &HaCluster, leader: usize, i: usize) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (want, got) = (reads(c, leader).await, reads(c, i).await);
        if want == got {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "replica {i} reads {got:?}, the leader {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_follow_a_watch_and_reload_only_after_a_compaction() {
    // Replica 1 reaches etcd through a relay the test cuts; replica 0 leads.
    let c = start(2, &[1], |_, _| {}).await;
    assert_eq!(c.leader().await, Some(0));
    let (_dir, uri) = origin(2 << 20, 26);
    let mut api = c.client().unwrap();
    register(&mut api, MODEL, &uri).await;
    prewarm_both_hosts(&mut api).await;
    // Both followers read what the leader reads (the registry, the plan to its end, the
    // holders), from changes applied through their watches: each loaded the state whole
    // once, at start.
    for i in [1, 2] {
        wait_same_reads(&c, 0, i).await;
        let (loads, applied, _) = view_counts(&c, i).await;
        assert_eq!(loads, 1, "replica {i} reloaded the whole state");
        assert!(applied >= 4, "replica {i} applied {applied} changes");
    }
    let hosts = c.controllers[2]
        .client()
        .await
        .unwrap()
        .list_hosts(ListHostsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(hosts.hosts.len(), 2, "{hosts:?}");

    // Cut replica 1 off, write, and compact etcd's history past what it has seen: when it
    // is back its watch cannot resume, and it loads the state whole once more.
    let (_, proxy) = &c.proxies[0];
    proxy.cut();
    let (_dir2, uri2) = origin(2 << 20, 27);
    register(&mut api, "test/ha-compacted", &uri2).await;
    let mut raw = etcd_client::Client::connect([format!("http://{}", c.etcd.client)], None)
        .await
        .unwrap();
    let now = raw
        .get("/", Some(etcd_client::GetOptions::new().with_count_only()))
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    raw.compact(now, None).await.unwrap();
    // The uncut follower is unaffected (a watch in sync is not compacted).
    wait_same_reads(&c, 0, 2).await;
    assert_eq!(view_counts(&c, 2).await.0, 1);
    proxy.heal();
    wait_same_reads(&c, 0, 1).await;
    let (loads, _, resumed) = view_counts(&c, 1).await;
    assert_eq!(loads, 2, "one reload after the compaction");
    assert!(resumed >= 1, "the broken watch was counted");
    let log = std::fs::read_to_string(&c.controllers[1].log).unwrap();
    assert!(
        log.contains("reloading the whole state"),
        "the reload is logged: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_replaced_by_an_empty_one_followers_load_the_new_state() {
    // A follower's watch resumes from the revision it needs; an etcd that lost its data (or
    // was restored from an older backup) is behind that revision, and a watch from there
    // would wait silently: the follower must notice and load the state whole.
    let mut c = start(1, &[], |_, _| {}).await;
    let (_dir, uri) = origin(2 << 20, 28);
    let mut api = c.client().unwrap();
    register(&mut api, MODEL, &uri).await;
    for i in [1, 2] {
        wait_same_reads(&c, 0, i).await;
    }
    c.etcd.kill().await;
    std::fs::remove_dir_all(&c.etcd.data).unwrap();
    c.etcd.restart().await.unwrap();
    // A new election on the empty etcd; the hosts register again with whoever leads.
    c.wait_hosts_up(1, Duration::from_secs(30)).await.unwrap();
    // The leader of the old etcd may still answer for up to 2/3 of its lease's TTL (its
    // renewal on the new etcd fails: "lease not found", then it steps down); the leader to
    // check is the one elected on the new, empty etcd.
    let deadline = Instant::now() + Duration::from_secs(15);
    let leader = loop {
        let leader = c.wait_leader(Duration::from_secs(10)).await.unwrap();
        let (models, _, _) = reads(&c, leader).await;
        if models.is_empty() {
            break leader;
        }
        assert!(
            Instant::now() < deadline,
            "no leader serves the new etcd's empty state: {models:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for i in (0..3).filter(|&i| i != leader) {
        wait_same_reads(&c, leader, i).await;
        let (loads, _, _) = view_counts(&c, i).await;
        assert!(
            loads >= 2,
            "replica {i} loaded the new state whole: {loads}"
        );
    }
}

fn etcd_config(etcd: &EtcdProc, prefix: &str, max_request_bytes: usize) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![format!("http://{}", etcd.client)],
        prefix: prefix.into(),
        max_request_bytes,
        max_txn_ops: 128,
        timeout: Duration::from_secs(5),
        user: None,
    }
}

async fn connect(cfg: EtcdConfig) -> Arc<EtcdStore> {
    tokio::task::spawn_blocking(move || EtcdStore::connect(&cfg))
        .await
        .unwrap()
        .unwrap()
}

/// Makes `store` the leader (a lease of its own) with its writes fenced; the lease.
async fn lead(store: &EtcdStore, id: &str) -> i64 {
    let lease = store.grant(Duration::from_secs(30)).await.unwrap();
    let me = LeaderInfo {
        id: id.into(),
        grpc: "127.0.0.1:1".into(),
        http: "127.0.0.1:2".into(),
    };
    match store.campaign(lease, &me).await.unwrap() {
        Campaign::Won { revision } => store.set_fence(Some(revision)),
        Campaign::Lost(l) => panic!("{id} lost the campaign to {l:?}"),
    }
    lease
}

/// Runs a blocking state-store call off the async workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// How many keys under `prefix` (the leader key aside) were last written at each
/// revision, in revision order.
async fn keys_per_revision(etcd: &EtcdProc, prefix: &str) -> Vec<usize> {
    let mut raw = etcd_client::Client::connect([format!("http://{}", etcd.client)], None)
        .await
        .unwrap();
    let resp = raw
        .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let mut per: BTreeMap<i64, usize> = BTreeMap::new();
    for kv in resp
        .kvs()
        .iter()
        .filter(|kv| !kv.key().ends_with(b"/leader"))
    {
        *per.entry(kv.mod_revision()).or_default() += 1;
    }
    per.into_values().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_put_many_commits_fenced_batches_and_is_refused_once_deposed() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdProc::start(&dir.path().join("etcd")).await.unwrap();
    let a = connect(etcd_config(&etcd, "/pm", ETCD_MAX_REQUEST_BYTES)).await;
    let lease = lead(&a, "a").await;
    // 300 host records (one given twice: its last value wins) and a plan: 301 keys.
    let mut writes: Vec<(Table, String, Vec<u8>)> = (0..300)
        .map(|i| {
            (
                Table::Hosts,
                format!("h{i:03}"),
                format!("v{i}").into_bytes(),
            )
        })
        .collect();
    writes.push((Table::Hosts, "h000".into(), b"last".to_vec()));
    writes.push((Table::Plans, "p".into(), b"plan".to_vec()));
    let store = a.clone();
    blocking(move || store.put_many(&writes)).await.unwrap();
    let store = a.clone();
    let hosts = blocking(move || store.list(Table::Hosts)).await.unwrap();
    assert_eq!(hosts.len(), 300);
    assert_eq!(hosts[0], ("h000".to_string(), b"last".to_vec()));
    // Three transactions of at most etcd's 128 operations, each atomic (one revision).
    assert_eq!(keys_per_revision(&etcd, "/pm/").await, vec![128, 128, 45]);

    // Batches also stay under the request limit: 100 KiB values against 256 KiB.
    let b = connect(etcd_config(&etcd, "/pm", 256 << 10)).await;
    // Fenced on the same leader key as `a` (the fence is the key's create revision).
    let revision = {
        let mut raw = etcd_client::Client::connect([format!("http://{}", etcd.client)], None)
            .await
            .unwrap();
        raw.get("/pm/leader", None).await.unwrap().kvs()[0].create_revision()
    };
    b.set_fence(Some(revision));
    let big: Vec<(Table, String, Vec<u8>)> = (0..10)
        .map(|i| (Table::Manifests, format!("d{i}"), vec![7u8; 100 << 10]))
        .collect();
    let store = b.clone();
    blocking(move || store.put_many(&big)).await.unwrap();
    let per = keys_per_revision(&etcd, "/pm/manifests/").await;
    assert_eq!(per, vec![2; 5], "two 100 KiB puts per 256 KiB transaction");

    // Deposed: the lease ends, another replica leads. The old leader's batch is refused
    // whole with the "not leader" error, and it writes nothing after.
    a.revoke(lease).await.unwrap();
    let c = connect(etcd_config(&etcd, "/pm", ETCD_MAX_REQUEST_BYTES)).await;
    lead(&c, "c").await;
    let late: Vec<(Table, String, Vec<u8>)> = (0..200)
        .map(|i| (Table::Usage, format!("late{i}"), b"1".to_vec()))
        .collect();
    let (store, w) = (a.clone(), late.clone());
    let e = blocking(move || store.put_many(&w)).await.unwrap_err();
    assert!(e.to_string().contains("no longer the leader"), "{e}");
    let store = a.clone();
    let e = blocking(move || store.put(Table::Usage, "x", b"1"))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not the leader"), "{e}");
    let store = c.clone();
    assert!(
        blocking(move || store.list(Table::Usage))
            .await
            .unwrap()
            .is_empty()
    );
    // The new leader's batch goes through.
    let store = c.clone();
    blocking(move || store.put_many(&late)).await.unwrap();
    let store = c.clone();
    assert_eq!(
        blocking(move || store.list(Table::Usage))
            .await
            .unwrap()
            .len(),
        200
    );
}

/// The next watch event, bounded.
async fn next_event(rx: &mut tokio::sync::mpsc::Receiver<WatchEvent>) -> WatchEvent {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a watch event within 10 s")
        .expect("the watch is open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_watch_reports_puts_deletes_and_transactions_and_a_compaction_ends_it() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdProc::start(&dir.path().join("etcd")).await.unwrap();
    let s = connect(etcd_config(&etcd, "/w", ETCD_MAX_REQUEST_BYTES)).await;
    let lease = lead(&s, "w").await;
    let store = s.clone();
    blocking(move || store.put(Table::Models, "org/a", b"1"))
        .await
        .unwrap();
    let loaded = s.revision().await.unwrap();
    let cancel = CancellationToken::new();
    let mut rx = s.watch(loaded + 1, cancel.clone());
    let store = s.clone();
    blocking(move || {
        store.put(Table::Models, "org/b", b"2")?;
        store.delete(Table::Models, "org/a")?;
        store.put_many(&[
            (Table::Hosts, "h1".into(), b"h".to_vec()),
            (Table::Plans, "p1".into(), b"p".to_vec()),
        ])
    })
    .await
    .unwrap();
    let change = |table, key: &str, value: Option<&[u8]>| Change {
        table,
        key: key.into(),
        value: value.map(<[u8]>::to_vec),
    };
    let want = [
        change(Table::Models, "org/b", Some(b"2")),
        change(Table::Models, "org/a", None),
        change(Table::Hosts, "h1", Some(b"h")),
        change(Table::Plans, "p1", Some(b"p")),
    ];
    // etcd may deliver several revisions in one watch response (a watcher that starts
    // behind gets them together), so events are read until every change is in, in order.
    let mut got = Vec::new();
    let mut last = loaded;
    while got.len() < want.len() {
        match next_event(&mut rx).await {
            WatchEvent::Changes {
                revision,
                changes,
                leader_gone,
            } => {
                assert!(!leader_gone);
                assert!(revision > last, "revision {revision} after {last}");
                // One transaction's changes arrive together.
                let has = |k: &str| changes.iter().any(|c| c.key == k);
                assert_eq!(has("h1"), has("p1"), "{changes:?}");
                last = revision;
                got.extend(changes);
            }
            WatchEvent::Lost(l) => panic!("lost: {l}"),
        }
    }
    assert_eq!(got, want);
    assert_eq!(last, loaded + 3, "two writes and one transaction");
    // The leader key going away is reported (an election is open), with no change.
    s.revoke(lease).await.unwrap();
    match next_event(&mut rx).await {
        WatchEvent::Changes {
            changes,
            leader_gone,
            ..
        } => assert!(changes.is_empty() && leader_gone),
        WatchEvent::Lost(l) => panic!("lost: {l}"),
    }
    cancel.cancel();

    // A watch from a revision etcd has compacted away reports that, and ends.
    lead(&s, "w").await;
    let seen = s.revision().await.unwrap();
    let store = s.clone();
    blocking(move || {
        for i in 0..3 {
            store.put(Table::Usage, &format!("u{i}"), b"1")?;
        }
        Ok::<_, shardcast_controller::state::StateError>(())
    })
    .await
    .unwrap();
    let now = s.revision().await.unwrap();
    let mut raw = etcd_client::Client::connect([format!("http://{}", etcd.client)], None)
        .await
        .unwrap();
    raw.compact(now, None).await.unwrap();
    let cancel = CancellationToken::new();
    let mut rx = s.watch(seen + 1, cancel.clone());
    match next_event(&mut rx).await {
        WatchEvent::Lost(WatchLoss::Compacted { needed, compacted }) => {
            assert_eq!(needed, seen + 1);
            assert_eq!(compacted, now);
        }
        other => panic!("expected a compaction, got {other:?}"),
    }
    assert!(
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .is_none(),
        "nothing follows a lost watch"
    );
}
