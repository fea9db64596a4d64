//! The controller with real `transferd` processes on loopback: register, prewarm, peers
//! serving the second prewarm, a host dying mid-plan, a controller restart mid-plan,
//! concurrent prewarms, and bad input through gRPC, HTTP and the CLI.

use std::time::{Duration, Instant};

use shardcast_bench::cluster::{Daemon, DaemonOpts};
use shardcast_bench::control::{
    ControllerProc, HttpAs, ManagedCluster, cli_bin, memory_holders, plan_status, wait_fraction,
    wait_plan,
};
use shardcast_bench::origin_server::{OriginStats, serve};
use shardcast_bench::synth::{self, SynthSpec};
use shardcast_identity::Role;
use shardcast_protocol::Manifest;
use shardcast_protocol::codec::decode_exact;
use shardcast_protocol::controller::controller_client::ControllerClient;
use shardcast_protocol::controller::{
    EvictRequest, GetStatusRequest, ListModelsRequest, ListPlansRequest, PlanStatus,
    PrewarmRequest, RegisterModelRequest, ScaleOutRequest, WatchPlanRequest,
};
use tonic::Code;
use tonic::transport::Channel;

const MODEL: &str = "test/llm";

struct Origin {
    dir: tempfile::TempDir,
}

impl Origin {
    /// A synthetic model under the origins root every cluster here allows.
    fn new(size: u64, shards: usize) -> Self {
        Self::seeded(size, shards, 11)
    }

    /// Another version: other bytes for another `seed`.
    fn seeded(size: u64, shards: usize, seed: u64) -> Self {
        let dir = shardcast_tests::origin_dir();
        synth::generate(
            dir.path(),
            &SynthSpec {
                total_bytes: size,
                shards,
                seed,
            },
        )
        .unwrap();
        Self { dir }
    }

    fn uri(&self) -> String {
        format!("file://{}", self.dir.path().display())
    }
}

/// `ManagedCluster::start` whose controller and daemons allow the origins root (where
/// [`Origin::new`] puts models) and `http` (HTTP origins bound before the cluster starts).
/// Registration keeps no copy unless `ctl_args` say so: these tests follow a model from
/// the origin through chains (the kept copy is tested in `prewarm_then_peers`).
async fn start_cluster_allowing(
    n: usize,
    mut ctl_args: Vec<String>,
    http: &[&str],
    mut opts: impl FnMut(usize, &mut DaemonOpts),
) -> anyhow::Result<ManagedCluster> {
    let root = format!("file://{}/", shardcast_tests::origins_root().display());
    let mut prefixes = vec![root.as_str()];
    prefixes.extend_from_slice(http);
    let allow = shardcast_tests::allow_args(&prefixes);
    ctl_args.extend(allow.clone());
    if !ctl_args.iter().any(|a| a == "--register-keep-copy") {
        ctl_args.extend(["--register-keep-copy".into(), "false".into()]);
    }
    ManagedCluster::start(n, ctl_args, move |i, o| {
        o.extra_args.extend(allow.clone());
        opts(i, o);
    })
    .await
}

/// [`start_cluster_allowing`] with no HTTP origin.
async fn start_cluster(
    n: usize,
    ctl_args: Vec<String>,
    opts: impl FnMut(usize, &mut DaemonOpts),
) -> anyhow::Result<ManagedCluster> {
    start_cluster_allowing(n, ctl_args, &[], opts).await
}

async fn register(api: &mut ControllerClient<Channel>, origin: &Origin) -> Manifest {
    let m = api
        .register_model(RegisterModelRequest {
            name: MODEL.into(),
            origin: origin.uri(),
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

/// Every event the controller keeps, of every model.
async fn all_events(
    api: &mut ControllerClient<Channel>,
) -> Vec<shardcast_protocol::controller::Event> {
    api.list_events(shardcast_protocol::controller::ListEventsRequest {
        model: String::new(),
        limit: 0,
    })
    .await
    .unwrap()
    .into_inner()
    .events
}

fn hosts(range: std::ops::RangeInclusive<usize>) -> Vec<String> {
    range.map(|i| format!("host-{i}")).collect()
}

async fn prewarm_hosts(api: &mut ControllerClient<Channel>, h: Vec<String>) -> String {
    api.prewarm(PrewarmRequest {
        model: MODEL.into(),
        replicas: 0,
        hosts: h,
        tier: shardcast_protocol::controller::Tier::Memory as i32,
        sources: String::new(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .plan_id
}

/// Bytes the daemons read from origins: chunks fetched plus reads to build manifests.
async fn origin_bytes(daemons: &[Daemon]) -> u64 {
    let mut total = 0;
    for d in daemons {
        let s = d.stats().await.unwrap();
        total += s.origin_bytes + s.manifest_bytes;
    }
    total
}

fn host_state<'a>(p: &'a PlanStatus, host: &str) -> &'a str {
    p.hosts
        .iter()
        .find(|h| h.host == host)
        .map(|h| h.state().label())
        .unwrap_or("absent")
}

/// Bytes an origin served: counted by the HTTP origin server itself, or for a `file://`
/// origin by the transferds that read it.
async fn served(c: &ManagedCluster, http: Option<&OriginStats>) -> u64 {
    match http {
        Some(s) => s.bytes_sent.load(std::sync::atomic::Ordering::Relaxed),
        None => origin_bytes(&c.daemons).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prewarm_all_then_second_prewarm_is_served_by_peers() {
    prewarm_then_peers(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_origin_counts_one_read_then_none() {
    prewarm_then_peers(true).await;
}

async fn prewarm_then_peers(http: bool) {
    // The HTTP origin's port is bound first so the cluster can allow exactly it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let keep = ["--register-keep-copy", "true"].map(String::from).to_vec();
    let c = start_cluster_allowing(8, keep, &[&url], |_, _| {})
        .await
        .unwrap();
    let origin = Origin::new(24 << 20, 3);
    let stats = std::sync::Arc::new(OriginStats::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let uri = if http {
        tokio::spawn(serve(
            origin.dir.path().to_path_buf(),
            listener,
            None,
            stats.clone(),
            stop.clone(),
        ));
        url
    } else {
        origin.uri()
    };
    let counter = http.then_some(&*stats);
    let mut api = c.controller.client().await.unwrap();
    let m = api
        .register_model(RegisterModelRequest {
            name: MODEL.into(),
            origin: uri,
            chunk_size: 256 << 10,
            via_host: String::new(),
            profile_json: String::new(),
            no_wait: false,
        })
        .await
        .unwrap()
        .into_inner();
    let manifest: Manifest = decode_exact(m.manifest.into()).unwrap();
    let total = manifest.total_bytes();
    // Registration read the origin once to hash it (the HTTP server counts that read, and
    // the few KiB of safetensors headers its file discovery reads), and the host that read
    // it kept what it read: it holds the model now.
    let registered = served(&c, counter).await;
    assert!(
        (total..total + (64 << 10)).contains(&registered),
        "{registered} bytes served for a {total}-byte model"
    );
    let keepers = memory_holders(&mut api, MODEL).await.unwrap();
    assert_eq!(keepers.len(), 1, "{keepers:?}");
    let keeper = keepers[0].clone();
    c.daemon(&keeper).unwrap().verify_copy(&manifest).unwrap();
    let kept = c.daemon(&keeper).unwrap().stats().await.unwrap().kept_bytes;
    assert_eq!(kept, total);

    // First prewarm of four hosts: the keeper is a source (it holds the model already), so
    // the chain starts there and the origin serves nothing more: register + prewarm read
    // it once.
    let a = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            hosts: hosts(1..=4),
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!a.chains.is_empty(), "{a:?}");
    for ch in &a.chains {
        assert_eq!(ch.source, keeper, "{a:?}");
    }
    assert!(a.estimate_s > 0.0);
    let done = wait_plan(&mut api, &a.plan_id, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    for h in hosts(1..=4) {
        assert!(
            matches!(host_state(&done, &h), "done" | "local"),
            "{done:?}"
        );
        c.daemon(&h).unwrap().verify_copy(&manifest).unwrap();
    }
    assert_eq!(served(&c, counter).await - registered, 0);

    // Second prewarm on the other four: served by the holders, the origin serves nothing.
    let before = served(&c, counter).await;
    let b = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            hosts: hosts(5..=8),
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!b.chains.is_empty());
    for ch in &b.chains {
        assert!(
            hosts(1..=4).contains(&ch.source),
            "chain sourced from {} instead of a holder",
            ch.source
        );
        assert_eq!(ch.source_tier, "memory");
    }
    let done = wait_plan(&mut api, &b.plan_id, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    for h in hosts(5..=8) {
        c.daemon(&h).unwrap().verify_copy(&manifest).unwrap();
    }
    assert_eq!(served(&c, counter).await - before, 0);

    // Everyone holds it now: a prewarm of all eight moves nothing.
    let all = prewarm_hosts(&mut api, hosts(1..=8)).await;
    let done = wait_plan(&mut api, &all, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(done.chains.is_empty(), "{done:?}");
    assert!(
        done.hosts.iter().all(|h| h.state().label() == "local"),
        "{done:?}"
    );

    // Status lists all eight as complete in memory.
    let st = api
        .get_status(GetStatusRequest {
            model: MODEL.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.hosts.iter().filter(|h| h.memory).count(), 8, "{st:?}");

    // Scale-out beyond the cluster is refused and changes nothing.
    let plans_before = api
        .list_plans(ListPlansRequest {})
        .await
        .unwrap()
        .into_inner()
        .plans
        .len();
    let err = api
        .scale_out(ScaleOutRequest {
            partitions: 0,
            model: MODEL.into(),
            replicas: 1,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let plans_after = api
        .list_plans(ListPlansRequest {})
        .await
        .unwrap()
        .into_inner()
        .plans
        .len();
    assert_eq!(plans_before, plans_after);

    // Evict from two hosts: their copies are gone, the others stay.
    let ev = api
        .evict(EvictRequest {
            model: MODEL.into(),
            hosts: hosts(7..=8),
            tier: shardcast_protocol::controller::Tier::Memory as i32,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ev.evicted, hosts(7..=8));
    // What the hosts freed is what their copies occupied, and nothing of them is left.
    assert!(
        ev.bytes_freed >= 2 * manifest.total_bytes(),
        "{} freed for two copies of {}",
        ev.bytes_freed,
        manifest.total_bytes()
    );
    for h in ["host-7", "host-8"] {
        let d = c.daemon(h).unwrap();
        assert!(d.verify_copy(&manifest).is_err());
        assert_eq!(d.memory_tier_bytes().unwrap(), 0, "{h}");
    }
    c.daemon("host-6").unwrap().verify_copy(&manifest).unwrap();
}

/// A cluster of `n` hosts with 24 MB/s egress caps (so a fault lands mid-transfer), a
/// model of `size` bytes in 2 shards registered, and a prewarm of every host started (one
/// chain from the origin). The controller waits `lost_grace_s` for a lost host to return.
async fn prewarm_every_host(
    n: usize,
    size: u64,
    lost_grace_s: u64,
) -> (
    ManagedCluster,
    Origin,
    ControllerClient<Channel>,
    Manifest,
    shardcast_protocol::controller::PlanAccepted,
) {
    prewarm_every_host_with(n, size, lost_grace_s, &[]).await
}

/// [`prewarm_every_host`], with `daemon_args` given to every transferd.
async fn prewarm_every_host_with(
    n: usize,
    size: u64,
    lost_grace_s: u64,
    daemon_args: &[&str],
) -> (
    ManagedCluster,
    Origin,
    ControllerClient<Channel>,
    Manifest,
    shardcast_protocol::controller::PlanAccepted,
) {
    let c = start_cluster(
        n,
        vec!["--lost-grace-s".into(), lost_grace_s.to_string()],
        |_, o| {
            o.egress_rate = "24MB/s".into();
            o.extra_args
                .extend(daemon_args.iter().map(|a| a.to_string()));
        },
    )
    .await
    .unwrap();
    let origin = Origin::new(size, 2);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;
    let a = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            replicas: n as u32,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a.chains.len(), 1);
    (c, origin, api, manifest, a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_killed_during_prewarm_plan_completes_on_the_rest() {
    // No grace: the victim stays dead, and the plan ends without it at once.
    let (mut c, _origin, mut api, manifest, a) = prewarm_every_host(6, 32 << 20, 0).await;
    // Kill a middle hop of the chain once data is flowing.
    let victim = a.chains[0].hops[2].clone();
    wait_fraction(&mut api, &a.plan_id, 0.15).await;
    c.daemon_mut(&victim).unwrap().kill().await;

    let done = wait_plan(&mut api, &a.plan_id, Duration::from_secs(120))
        .await
        .unwrap();
    // Five of six replicas is not what was asked for: `partial`, naming the victim.
    assert_eq!(done.state().label(), "partial", "{done:?}");
    let dead = done.hosts.iter().find(|h| h.host == victim).unwrap();
    assert_eq!(dead.state().label(), "lost", "{dead:?}");
    assert!(dead.error.contains("heartbeat"), "{dead:?}");
    assert!(done.message.contains(&victim), "{done:?}");
    for d in c.daemons.iter().filter(|d| d.host_id.as_str() != victim) {
        d.verify_copy(&manifest).unwrap();
        assert_eq!(host_state(&done, d.host_id.as_str()), "done");
    }
    // The CLI says so in its exit status and names the host; its JSON says `partial`.
    let (code, out, err) = cli(&c.controller, &["watch", &a.plan_id]).await;
    assert_eq!(code, 7, "{out}\n{err}");
    assert!(
        err.contains("ended partial") && err.contains(&victim),
        "{err}"
    );
    assert!(err.contains("1 of 6 hosts"), "{err}");
    let (code, out, err) = cli(&c.controller, &["--json", "watch", &a.plan_id]).await;
    assert_eq!(code, 7, "{out}\n{err}");
    let last: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(last["state"], "partial", "{out}");
}

/// A receiver killed mid-prewarm (`kill -9`) and started again a few seconds later, within
/// the controller's lost grace: the plan marks it `lost`, waits, re-plans it once it
/// heartbeats again, and it resumes from the chunks it had verified; the prewarm ends
/// `done` with every copy exact, without anyone asking again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_restarted_mid_prewarm_resumes_and_the_plan_completes() {
    let (mut c, _origin, mut api, manifest, a) = prewarm_every_host(4, 32 << 20, 30).await;
    let victim = a.chains[0].hops[1].clone();
    wait_fraction(&mut api, &a.plan_id, 0.2).await;
    c.daemon_mut(&victim).unwrap().kill().await;
    // Lost once its heartbeats stop (3 missed at 1 s), with the wait said.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = plan_status(&mut api, &a.plan_id).await;
        let h = s.hosts.iter().find(|h| h.host == victim).unwrap();
        if h.state().label() == "lost" {
            assert!(h.lost_at > 0.0, "{h:?}");
            assert!(h.error.contains("waits 30s for it to return"), "{h:?}");
            assert_eq!(s.state().label(), "running", "{s:?}");
            break;
        }
        assert!(Instant::now() < deadline, "{s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.daemon_mut(&victim).unwrap().restart().await.unwrap();
    let done = wait_plan(&mut api, &a.plan_id, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    let back = done.hosts.iter().find(|h| h.host == victim).unwrap();
    assert_eq!(back.state().label(), "done", "{back:?}");
    assert_eq!(back.lost_at, 0.0, "{back:?}");
    assert!(done.replans >= 1, "{done:?}");
    for d in &c.daemons {
        d.verify_copy(&manifest).unwrap();
    }
    // It resumed: what it received after the restart is less than the whole model.
    let received = c
        .daemon(&victim)
        .unwrap()
        .stats()
        .await
        .unwrap()
        .bytes_received;
    assert!(received < manifest.total_bytes(), "{received}");
    let (code, out, err) = cli(&c.controller, &["watch", &a.plan_id]).await;
    assert_eq!(code, 0, "{out}\n{err}");
}

/// The host whose memory tier [`prewarm_then_fill_a_tier`] fills.
const FILLED_VICTIM: &str = "host-2";

/// What [`prewarm_then_fill_a_tier`] leaves running.
struct FilledTier {
    c: ManagedCluster,
    api: ControllerClient<Channel>,
    manifest: Manifest,
    plan: String,
    /// The other process's file on the victim's memory tier.
    filler: std::path::PathBuf,
    _origin: Origin,
}

/// Three hosts under a controller started with `ctl_args`, [`FILLED_VICTIM`]'s memory tier
/// on a tmpfs of its own with room for the model (32 MiB) and 16 MiB more; a prewarm of all
/// three a fifth done, then another process's file taking every byte left on that tmpfs.
/// `None` (the test is skipped, saying why) where no tmpfs can be mounted.
async fn prewarm_then_fill_a_tier(ctl_args: Vec<String>) -> Option<FilledTier> {
    use shardcast_bench::cluster::TmpfsMount;
    if let Err(why) = TmpfsMount::available() {
        eprintln!("SKIPPED: a memory tier on a tmpfs of its own: {why}");
        return None;
    }
    let size = 32u64 << 20;
    let c = start_cluster(3, ctl_args, |i, o| {
        o.egress_rate = "24MB/s".into();
        if i == 1 {
            o.memory_tmpfs = Some(size + (16 << 20));
        }
    })
    .await
    .unwrap();
    let tier = c.daemon(FILLED_VICTIM).unwrap().memory_dir.clone();
    let origin = Origin::new(size, 2);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;
    let plan = prewarm_hosts(&mut api, hosts(1..=3)).await;
    wait_fraction(&mut api, &plan, 0.2).await;
    let filler = tier.join("someone-else");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = vec![1u8; 1 << 20];
        while f.write_all(&block).is_ok() {}
    }
    Some(FilledTier {
        c,
        api,
        manifest,
        plan,
        filler,
        _origin: origin,
    })
}

/// A memory tier whose tmpfs another process fills during a prewarm: the daemon does not
/// die, its receive fails with the file system's own error and the plan ends `partial`
/// naming it, the other hosts complete, and nothing it verified is lost: once room is made,
/// a second prewarm completes its copy from the chunks it kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_tier_filled_by_another_process_mid_prewarm_fails_clearly_and_loses_nothing() {
    let Some(FilledTier {
        c,
        mut api,
        manifest,
        plan,
        filler,
        _origin,
    }) = prewarm_then_fill_a_tier(vec!["--lost-grace-s".into(), "0".into()]).await
    else {
        return;
    };
    let victim = FILLED_VICTIM;
    let done = wait_plan(&mut api, &plan, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "partial", "{done:?}");
    let h = done.hosts.iter().find(|h| h.host == victim).unwrap();
    assert_eq!(h.state().label(), "failed", "{h:?}");
    assert!(h.error.contains("No space left on device"), "{h:?}");
    for d in c.daemons.iter().filter(|d| d.host_id.as_str() != victim) {
        d.verify_copy(&manifest).unwrap();
    }
    // Alive and answering, with what it verified kept.
    let d = c.daemon(victim).unwrap();
    let kept = d.stats().await.unwrap().bytes_received;
    assert!(kept > 0, "nothing received before the tier filled");
    // Room again: a second prewarm completes it, sending less than the whole model. The
    // controller refuses it until the host's heartbeat reports the room.
    std::fs::remove_file(&filler).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let again = loop {
        let r = api
            .prewarm(PrewarmRequest {
                model: MODEL.into(),
                hosts: vec![victim.to_string()],
                tier: shardcast_protocol::controller::Tier::Memory as i32,
                ..Default::default()
            })
            .await;
        match r {
            Ok(a) => break a.into_inner().plan_id,
            Err(e) if e.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    let done = wait_plan(&mut api, &again, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    d.verify_copy(&manifest).unwrap();
    let total = d.stats().await.unwrap().bytes_received;
    assert!(
        total - kept < manifest.total_bytes(),
        "the second prewarm sent {} of {}: the kept chunks were lost",
        total - kept,
        manifest.total_bytes()
    );
}

/// The same filled memory tier with the lost grace on (30 s): the victim's receiver is
/// `lost`, awaiting room, saying why, and its partial copy is not shed by the tier sweeper
/// meanwhile; once the other process's file goes and the host's
/// heartbeat reports room for the rest, the plan re-plans it, it resumes from the chunks it
/// kept, and the plan ends `done` with every copy exact — without a second prewarm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_whose_store_filled_completes_within_its_plan_once_room_returns() {
    // The tier sweeper runs often: it must not shed the victim's partial copy to make
    // room while the plan waits for it (the copy is what it resumes from).
    let Some(FilledTier {
        c,
        mut api,
        manifest,
        plan,
        filler,
        _origin,
    }) = prewarm_then_fill_a_tier(
        ["--lost-grace-s", "30", "--tier-sweep-ms", "300"]
            .map(String::from)
            .to_vec(),
    )
    .await
    else {
        return;
    };
    let victim = FILLED_VICTIM;
    // Lost, awaiting room, saying why.
    let deadline = Instant::now() + Duration::from_secs(60);
    let waiting = loop {
        let st = plan_status(&mut api, &plan).await;
        let h = st.hosts.iter().find(|h| h.host == victim).cloned().unwrap();
        if h.state().label() == "lost" {
            break h;
        }
        assert!(
            Instant::now() < deadline,
            "the victim never waited for room: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        waiting.error.contains("No space left on device"),
        "{waiting:?}"
    );
    assert!(
        waiting.error.contains("for room on the host"),
        "{waiting:?}"
    );
    let kept = c
        .daemon(victim)
        .unwrap()
        .stats()
        .await
        .unwrap()
        .bytes_received;
    // The tier stays full for a few heartbeats and sweeps before the room returns.
    tokio::time::sleep(Duration::from_secs(3)).await;
    std::fs::remove_file(&filler).unwrap();
    let done = wait_plan(&mut api, &plan, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    let h = done.hosts.iter().find(|h| h.host == victim).unwrap();
    assert_eq!(h.state().label(), "done", "{h:?}");
    for d in &c.daemons {
        d.verify_copy(&manifest).unwrap();
    }
    let sent = c
        .daemon(victim)
        .unwrap()
        .stats()
        .await
        .unwrap()
        .bytes_received
        - kept;
    assert!(
        sent < manifest.total_bytes(),
        "the victim received {sent} of {} again: its kept chunks were lost",
        manifest.total_bytes()
    );
}

/// `Evict` of every holder while one of them is down (stopped): the others' copies go at
/// once and the down host is named as pending; once it heartbeats again the tier sweeper
/// evicts its copy too (event `evict-on-return`), and every memory tier ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evict_while_a_holder_is_down_reaches_it_when_it_returns() {
    use shardcast_protocol::controller::ListHostsRequest;
    let c = start_cluster(3, vec!["--tier-sweep-ms".into(), "300".into()], |_, _| {})
        .await
        .unwrap();
    let origin = Origin::new(8 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    register(&mut api, &origin).await;
    let plan = prewarm_hosts(&mut api, hosts(1..=3)).await;
    let done = wait_plan(&mut api, &plan, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    let victim = "host-3";
    c.daemon(victim).unwrap().signal("STOP").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let hs = api
            .list_hosts(ListHostsRequest {})
            .await
            .unwrap()
            .into_inner();
        let h = hs
            .hosts
            .iter()
            .find(|h| h.report.as_ref().is_some_and(|r| r.host_id == victim))
            .unwrap();
        if !h.up {
            break;
        }
        assert!(Instant::now() < deadline, "{victim} never marked down");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ev = api
        .evict(EvictRequest {
            model: MODEL.into(),
            hosts: Vec::new(),
            tier: shardcast_protocol::controller::Tier::Memory as i32,
        })
        .await
        .unwrap()
        .into_inner();
    let mut evicted = ev.evicted.clone();
    evicted.sort();
    assert_eq!(evicted, hosts(1..=2), "{ev:?}");
    assert_eq!(ev.pending, vec![victim.to_string()], "{ev:?}");
    for h in ["host-1", "host-2"] {
        assert_eq!(c.daemon(h).unwrap().memory_tier_bytes().unwrap(), 0, "{h}");
    }
    let d = c.daemon(victim).unwrap();
    assert!(d.memory_tier_bytes().unwrap() > 0);
    d.signal("CONT").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while d.memory_tier_bytes().unwrap() > 0 {
        assert!(
            Instant::now() < deadline,
            "{victim}'s copy was not evicted after it returned"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let events = all_events(&mut api).await;
    assert!(
        events
            .iter()
            .any(|e| e.kind == "evict-on-return" && e.hosts == vec![victim.to_string()]),
        "{events:?}"
    );
}

/// A rolling restart during a prewarm: every transferd in turn stopped as an operator
/// would (SIGTERM, waiting for it to exit) and started again a second later. Each drains
/// for only 300 ms, so it leaves in the middle of its sessions (the hops around it fail
/// over and recover, as after a crash); it comes back within the lost grace and resumes;
/// the prewarm ends `done` and every copy is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_during_a_prewarm_loses_nothing() {
    let (mut c, _origin, mut api, manifest, a) =
        prewarm_every_host_with(4, 128 << 20, 30, &["--drain-grace-ms", "300"]).await;
    wait_fraction(&mut api, &a.plan_id, 0.05).await;
    for i in 0..c.daemons.len() {
        // Every restart lands in the transfer, not after it.
        let s = plan_status(&mut api, &a.plan_id).await;
        assert_eq!(s.state().label(), "running", "restart {i}: {s:?}");
        let d = &mut c.daemons[i];
        let clean = d.terminate(Duration::from_secs(10)).await.unwrap();
        assert!(clean, "{} did not exit on SIGTERM within 10 s", d.host_id);
        tokio::time::sleep(Duration::from_millis(500)).await;
        d.restart().await.unwrap();
    }
    let done = wait_plan(&mut api, &a.plan_id, Duration::from_secs(180))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    for d in &c.daemons {
        d.verify_copy(&manifest)
            .unwrap_or_else(|e| panic!("{}: {e:#}", d.host_id));
        assert_eq!(host_state(&done, d.host_id.as_str()), "done");
    }
    // The controller saw the restarts and re-planned those receivers: from the heartbeat
    // that names the new process's start (`receiver-restarted`) or, when a host was away
    // long enough to miss heartbeats (its drain, a slow start under load), as a lost host
    // back within the grace (`receiver-returned`). Either way not after a stall clock.
    let events = all_events(&mut api).await;
    assert!(
        events
            .iter()
            .any(|e| e.kind == "receiver-restarted" || e.kind == "receiver-returned"),
        "{events:?}"
    );
}

/// SIGTERM in the middle of a transfer with the default drain: the host says at once that
/// it drains (its heartbeat, its metric), finishes the sessions it has — its own copy and
/// its forwarding to the hop below — and only then exits, cleanly. The prewarm ends `done`
/// with every copy exact, the stopped host's included, and nothing had to fail over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_host_drains_its_sessions_before_it_exits() {
    let (mut c, _origin, mut api, manifest, a) = prewarm_every_host(4, 48 << 20, 30).await;
    let victim = a.chains[0].hops[1].clone();
    wait_fraction(&mut api, &a.plan_id, 0.1).await;
    let d = c.daemon(&victim).unwrap();
    d.signal("TERM").unwrap();
    // The controller hears of it from the next heartbeat, sent at once.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let hs = api
            .list_hosts(shardcast_protocol::controller::ListHostsRequest {})
            .await
            .unwrap()
            .into_inner();
        let draining = hs
            .hosts
            .iter()
            .filter_map(|h| h.report.as_ref())
            .any(|r| r.host_id == victim && r.draining);
        if draining {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{victim} never reported draining: {hs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = d.metrics().await.unwrap();
    assert!(m.contains("shardcast_draining{host=\""), "{m}");
    assert!(
        m.contains(&format!("shardcast_draining{{host=\"{victim}\"}} 1")),
        "{m}"
    );
    let plan = plan_status(&mut api, &a.plan_id).await;
    assert_eq!(plan.state().label(), "running", "{plan:?}");
    // It exits on its own once its sessions are done, within the default drain grace.
    let i = c
        .daemons
        .iter()
        .position(|d| d.host_id.as_str() == victim)
        .unwrap();
    let status = c.daemons[i]
        .wait_exit(Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{victim} did not exit within its drain grace"));
    assert!(status.success(), "{victim} exited with {status}");
    c.daemons[i].verify_copy(&manifest).unwrap();
    let done = wait_plan(&mut api, &a.plan_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    for d in &c.daemons {
        d.verify_copy(&manifest)
            .unwrap_or_else(|e| panic!("{}: {e:#}", d.host_id));
        assert_eq!(host_state(&done, d.host_id.as_str()), "done");
    }
    // The hop above the drained host never had to skip it.
    for d in c.daemons.iter().filter(|d| d.host_id.as_str() != victim) {
        let m = d.metrics().await.unwrap();
        assert!(
            m.contains(&format!(
                "shardcast_downstream_failovers_total{{host=\"{}\"}} 0",
                d.host_id
            )),
            "{m}"
        );
    }
}

/// Status says what really happened: a middle hop stopped (alive but silent) is marked
/// `lost` and the plan finishes without it; once it runs again and completes its copy, its
/// heartbeat makes it `done` (with the time), the ended plan's outcome is recomputed, and
/// both transitions are events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_receiver_that_completes_later_is_reported_done() {
    let (c, _origin, mut api, manifest, a) = prewarm_every_host(4, 24 << 20, 0).await;
    let victim = a.chains[0].hops[1].clone();
    let d = c.daemon(&victim).unwrap();
    wait_fraction(&mut api, &a.plan_id, 0.15).await;
    d.signal("STOP").unwrap();
    let ended = wait_plan(&mut api, &a.plan_id, Duration::from_secs(120)).await;
    // Run it again whatever happened, so the process can be cleaned up.
    d.signal("CONT").unwrap();
    let ended = ended.unwrap();
    assert_eq!(host_state(&ended, &victim), "lost", "{ended:?}");
    assert_eq!(ended.state().label(), "partial", "{ended:?}");
    assert!(ended.message.contains(&victim), "{ended:?}");

    // Running again, it completes from its fallback source and says so in a heartbeat.
    let deadline = Instant::now() + Duration::from_secs(60);
    let now = loop {
        let s = plan_status(&mut api, &a.plan_id).await;
        if host_state(&s, &victim) == "done" {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "{victim} never reported done: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    d.verify_copy(&manifest).unwrap();
    assert_eq!(now.state().label(), "done");
    assert!(!now.message.contains(&victim), "{now:?}");
    // Every replica arrived in the end: the CLI now exits 0 for the same plan.
    let (code, out, err) = cli(&c.controller, &["watch", &a.plan_id]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let h = now.hosts.iter().find(|h| h.host == victim).unwrap();
    assert!(h.error.contains("after it was marked lost"), "{h:?}");
    assert!(h.done_s > 0.0, "{h:?}");
    for d in &c.daemons {
        d.verify_copy(&manifest).unwrap();
        assert_eq!(host_state(&now, d.host_id.as_str()), "done");
    }
    let events = api
        .list_events(shardcast_protocol::controller::ListEventsRequest {
            model: MODEL.into(),
            limit: 100,
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    for kind in ["receiver-lost", "receiver-recovered"] {
        assert!(
            events
                .iter()
                .any(|e| e.kind == kind && e.plan_id == a.plan_id && e.hosts == [victim.clone()]),
            "no {kind} event: {events:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_restarted_mid_plan_finishes_it() {
    let mut c = start_cluster(4, vec![], |_, o| {
        o.egress_rate = "16MB/s".into();
    })
    .await
    .unwrap();
    let origin = Origin::new(32 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;
    let plan = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            replicas: 4,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .plan_id;
    wait_fraction(&mut api, &plan, 0.1).await;
    c.controller.kill().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.controller.restart().await.unwrap();
    let mut api = c.controller.client().await.unwrap();
    // Readable at once after the restart, from the state store.
    let p = api
        .get_plan(WatchPlanRequest {
            plan_id: plan.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.plan_id, plan);
    let done = wait_plan(&mut api, &plan, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    assert!(
        done.hosts.iter().all(|h| h.state().label() == "done"),
        "{done:?}"
    );
    for d in &c.daemons {
        d.verify_copy(&manifest).unwrap();
    }
    // The registry survived too.
    let models = api
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(models.models.len(), 1);
    // And the finished plan stays readable after another restart.
    c.controller.restart().await.unwrap();
    let mut api = c.controller.client().await.unwrap();
    let p = api
        .get_plan(WatchPlanRequest { plan_id: plan })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.state().label(), "done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_prewarms_of_one_model_send_it_to_each_host_once() {
    let c = start_cluster(6, vec![], |_, o| {
        o.egress_rate = "32MB/s".into();
    })
    .await
    .unwrap();
    let origin = Origin::new(16 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;
    let mut api2 = api.clone();
    let (a, b) = tokio::join!(
        prewarm_hosts(&mut api, hosts(1..=4)),
        prewarm_hosts(&mut api2, hosts(3..=6)),
    );
    let pa = wait_plan(&mut api, &a, Duration::from_secs(120))
        .await
        .unwrap();
    let pb = wait_plan(&mut api, &b, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(pa.state().label(), "done", "{pa:?}");
    assert_eq!(pb.state().label(), "done", "{pb:?}");
    // Whichever plan came second joined the first's transfers for hosts 3 and 4.
    let joined: usize = [&pa, &pb]
        .iter()
        .map(|p| {
            p.hosts
                .iter()
                .filter(|h| h.source.len() == 16 || h.state().label() == "joined")
                .count()
        })
        .sum();
    assert!(joined >= 2, "no joined transfers: {pa:?} {pb:?}");
    for d in &c.daemons {
        d.verify_copy(&manifest).unwrap();
    }
    // Each host verified each chunk exactly once: nobody received the model twice.
    let chunks: u64 = manifest.shards.iter().map(|s| s.chunks.len() as u64).sum();
    for d in &c.daemons {
        let s = d.stats().await.unwrap();
        assert_eq!(
            s.chunks_verified, chunks,
            "{} verified {} chunks",
            d.host_id, s.chunks_verified
        );
    }
}

/// The value of the series `series` (name and labels exactly as written) in a `/metrics`
/// text.
fn series_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// `/metrics` of both daemons after a prewarm of three hosts, read against what happened:
/// the chunks each verified and how many came from peers, the origin read once, every
/// receiver session timed; the controller's plan, receivers, hosts, registration, API
/// calls and an eviction. Then every series the Grafana dashboard queries is found there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_a_prewarm_match_what_happened() {
    const N: usize = 3;
    let (c, _origin, mut api, manifest, a) = prewarm_every_host(N, 8 << 20, 20).await;
    let done = wait_plan(&mut api, &a.plan_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    let (size, chunks) = (manifest.total_bytes(), manifest.total_chunks());

    // The daemons: sums over the hosts, polled while the receivers' last sessions are
    // recorded (each once its range is verified, as the controller sees it done).
    let deadline = Instant::now() + Duration::from_secs(20);
    let sums = loop {
        let mut sums = std::collections::BTreeMap::<&str, u64>::new();
        for d in &c.daemons {
            let body = d.metrics().await.unwrap();
            assert!(
                body.contains(
                    "# TYPE shardcast_chunk_verify_seconds histogram
"
                ),
                "{body}"
            );
            for name in [
                "chunks_verified_total",
                "chunks_corrupt_total",
                "origin_bytes_total",
                "chunk_verify_seconds_count",
                "session_ready_seconds_count",
                "hop_throughput_bytes_per_second_count",
                "bytes_received_total",
            ] {
                let v = shardcast_bench::cluster::metric_value(&body, &d.host_id, name)
                    .unwrap_or_else(|| panic!("{}: no {name} in {body}", d.host_id));
                *sums.entry(name).or_default() += v;
            }
        }
        if sums["session_ready_seconds_count"] >= 2
            && sums["chunk_verify_seconds_count"] == 2 * chunks
            || Instant::now() > deadline
        {
            break sums;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // One chain: its head read the origin once; every chunk was verified on every host,
    // and the two hosts below the head each hashed every chunk they received.
    assert_eq!(sums["origin_bytes_total"], size, "{sums:?}");
    assert_eq!(sums["chunks_verified_total"], N as u64 * chunks, "{sums:?}");
    assert_eq!(sums["chunks_corrupt_total"], 0, "{sums:?}");
    assert_eq!(
        sums["chunk_verify_seconds_count"],
        (N as u64 - 1) * chunks,
        "{sums:?}"
    );
    // The model crossed two hops: at least its bytes twice came in on data connections.
    assert!(
        sums["bytes_received_total"] >= (N as u64 - 1) * size,
        "{sums:?}"
    );
    // Every receiver session is timed, and has a throughput.
    assert!(
        sums["session_ready_seconds_count"] >= (N as u64 - 1),
        "{sums:?}"
    );
    assert_eq!(
        sums["session_ready_seconds_count"], sums["hop_throughput_bytes_per_second_count"],
        "{sums:?}"
    );

    // The controller.
    let (s, _) = http(&c.controller, "GET", "/v1/plans", "").await;
    assert_eq!(s, 200);
    let (s, body) = http(&c.controller, "GET", "/metrics", "").await;
    assert_eq!(s, 200);
    let v = |series: &str| {
        series_value(&body, series).unwrap_or_else(|| panic!("no {series} in {body}"))
    };
    assert_eq!(v("shardcast_plans{state=\"done\"}"), 1.0);
    assert_eq!(v("shardcast_plans{state=\"running\"}"), 0.0);
    assert_eq!(v("shardcast_plans_ended_total{state=\"done\"}"), 1.0);
    assert_eq!(v("shardcast_plan_ready_seconds_count{state=\"done\"}"), 1.0);
    assert!(v("shardcast_plan_ready_seconds_sum{state=\"done\"}") > 0.0);
    assert_eq!(v("shardcast_receiver_ready_seconds_count"), N as f64);
    assert_eq!(v("shardcast_hosts_registered"), N as f64);
    assert_eq!(v("shardcast_hosts_up"), N as f64);
    assert_eq!(v("shardcast_models_registered"), 1.0);
    assert_eq!(v("shardcast_registrations_started_total"), 1.0);
    assert_eq!(
        v("shardcast_registrations_ended_total{outcome=\"ok\"}"),
        1.0
    );
    assert_eq!(v("shardcast_registrations_in_progress"), 0.0);
    assert_eq!(v("shardcast_leader"), 1.0);
    assert_eq!(
        v("shardcast_api_request_seconds_count{transport=\"grpc\",method=\"Prewarm\"}"),
        1.0
    );
    assert_eq!(
        v("shardcast_api_request_seconds_count{transport=\"grpc\",method=\"RegisterModel\"}"),
        1.0
    );
    assert!(
        v("shardcast_api_request_seconds_count{transport=\"grpc\",method=\"Heartbeat\"}")
            >= N as f64
    );
    assert_eq!(
        v("shardcast_api_request_seconds_count{transport=\"http\",method=\"GET /v1/plans\"}"),
        1.0
    );
    // The series from before the registry are still there, as they were.
    for family in [
        "# TYPE shardcast_autoscaler_decisions_total counter\n",
        "# TYPE shardcast_api_refused_total counter\n",
        "# TYPE shardcast_api_denied_total counter\n",
        "# TYPE shardcast_http_timeouts_total counter\n",
        "# TYPE shardcast_origin_refused_total counter\n",
    ] {
        assert!(body.contains(family), "{family} in {body}");
    }
    assert_eq!(v("shardcast_api_refused_total{reason=\"denied\"}"), 0.0);

    // An eviction from one host: counted, with the bytes it freed.
    let host = done.hosts[0].host.clone();
    let ev = api
        .evict(EvictRequest {
            model: MODEL.into(),
            hosts: vec![host.clone()],
            tier: shardcast_protocol::controller::Tier::Memory as i32,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ev.evicted, vec![host]);
    let (_, body) = http(&c.controller, "GET", "/metrics", "").await;
    let v = |series: &str| {
        series_value(&body, series).unwrap_or_else(|| panic!("no {series} in {body}"))
    };
    assert_eq!(v("shardcast_evictions_total{tier=\"memory\"}"), 1.0);
    assert_eq!(v("shardcast_evicted_hosts_total{tier=\"memory\"}"), 1.0);
    assert_eq!(v("shardcast_evicted_bytes_total"), ev.bytes_freed as f64);
    assert!(ev.bytes_freed > 0, "{ev:?}");

    // The Grafana dashboard (deploy/grafana) queries only series these daemons export.
    let mut scrapes = vec![body];
    for d in &c.daemons {
        scrapes.push(d.metrics().await.unwrap());
    }
    crate::deploy::dashboard::assert_exported(&scrapes);
}

/// A plain HTTP/1.1 request; returns (status, body).
async fn http(ctl: &ControllerProc, method: &str, path: &str, body: &str) -> (u16, String) {
    ctl.http(HttpAs::Cert(Role::Admin), method, path, body)
        .await
        .unwrap()
}

async fn cli(ctl: &ControllerProc, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(cli_bin().unwrap())
        .args(ctl.cli_args().unwrap())
        .args(args)
        .output()
        .await
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_precise_errors_and_changes_nothing() {
    // No host at all: nothing can be registered.
    let empty_root = tempfile::tempdir().unwrap();
    let empty = ControllerProc::start(empty_root.path(), shardcast_tests::allow_args(&[]))
        .await
        .unwrap();
    let err = empty
        .client()
        .await
        .unwrap()
        .register_model(RegisterModelRequest {
            name: MODEL.into(),
            origin: format!("file://{}/m", shardcast_tests::origins_root().display()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("no live host"), "{err:?}");
    drop(empty);

    let c = start_cluster(2, vec![], |_, _| {}).await.unwrap();
    let origin = Origin::new(2 << 20, 1);
    let mut api = c.controller.client().await.unwrap();
    register(&mut api, &origin).await;

    // gRPC.
    let reg = |name: &str, origin: &str| RegisterModelRequest {
        name: name.into(),
        origin: origin.into(),
        ..Default::default()
    };
    let e = api
        .register_model(reg("../x", &origin.uri()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = api
        .register_model(reg("ok/name", "ftp://x/y"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = api
        .register_model(reg("ok/name", "file:///nonexistent/shardcast/model"))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e.code(),
            Code::InvalidArgument | Code::Unavailable | Code::NotFound | Code::PermissionDenied
        ),
        "{e:?}"
    );
    // A tier this build does not know is a number outside the enum on the gRPC wire.
    let pw = |model: &str, replicas: u32, tier: &str, hosts: Vec<String>| PrewarmRequest {
        model: model.into(),
        replicas,
        hosts,
        tier: shardcast_protocol::controller::Tier::from_label(tier).map_or(99, |t| t as i32),
        sources: String::new(),
        ..Default::default()
    };
    let cases = [
        (pw("no/such-model", 1, "memory", vec![]), Code::NotFound),
        (pw(MODEL, 0, "memory", vec![]), Code::InvalidArgument),
        (pw(MODEL, 1, "tape", vec![]), Code::InvalidArgument),
        (pw(MODEL, 50, "memory", vec![]), Code::ResourceExhausted),
        (pw(MODEL, 0, "memory", vec!["nope".into()]), Code::NotFound),
        (
            pw(MODEL, 0, "memory", vec!["host-1".into(), "host-1".into()]),
            Code::InvalidArgument,
        ),
        (pw(MODEL, 1, "gpu", vec![]), Code::ResourceExhausted),
    ];
    for (req, code) in cases {
        let e = api.prewarm(req.clone()).await.unwrap_err();
        assert_eq!(e.code(), code, "{req:?}: {e:?}");
        assert!(!e.message().is_empty());
    }
    let e = api
        .evict(EvictRequest {
            model: MODEL.into(),
            hosts: vec!["nope".into()],
            tier: shardcast_protocol::controller::Tier::Memory as i32,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = api
        .get_plan(WatchPlanRequest {
            plan_id: "zzz".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    // HTTP/JSON.
    let addr = &c.controller;
    let (s, b) = http(addr, "POST", "/v1/prewarm", "{not json").await;
    assert_eq!(s, 400, "{b}");
    assert!(b.contains("INVALID_ARGUMENT"), "{b}");
    let (s, b) = http(
        addr,
        "POST",
        "/v1/prewarm",
        r#"{"model":"no/such","replicas":1}"#,
    )
    .await;
    assert_eq!(s, 404, "{b}");
    assert!(
        b.contains("NOT_FOUND") && b.contains("shardcast register"),
        "{b}"
    );
    let (s, b) = http(
        addr,
        "POST",
        "/v1/prewarm",
        r#"{"model":"test/llm","replicas":99}"#,
    )
    .await;
    assert_eq!(s, 507, "{b}");
    assert!(b.contains("RESOURCE_EXHAUSTED"), "{b}");
    let (s, b) = http(
        addr,
        "POST",
        "/v1/models",
        r#"{"name":"a/../b","origin":"file:///tmp"}"#,
    )
    .await;
    assert_eq!(s, 400, "{b}");
    let (s, b) = http(addr, "GET", "/v1/models/test/llm", "").await;
    assert_eq!(s, 200, "{b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["name"], MODEL);
    let (s, _) = http(addr, "GET", "/v1/nothing-here", "").await;
    assert_eq!(s, 404);

    // CLI.
    let (code, _, err) = cli(&c.controller, &["prewarm", "no/such", "-n", "1"]).await;
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("NOT_FOUND"), "{err}");
    let (code, _, err) = cli(&c.controller, &["register", "../x", "file:///tmp"]).await;
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = cli(&c.controller, &["prewarm", MODEL, "-n", "40"]).await;
    assert_eq!(code, 4, "{err}");
    let (code, out, err) = cli(&c.controller, &["--json", "models"]).await;
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["models"].as_array().unwrap().len(), 1);

    // Nothing above changed anything.
    assert!(
        api.list_plans(ListPlansRequest {})
            .await
            .unwrap()
            .into_inner()
            .plans
            .is_empty()
    );
    assert_eq!(
        api.list_models(ListModelsRequest {})
            .await
            .unwrap()
            .into_inner()
            .models
            .len(),
        1
    );
    for d in &c.daemons {
        assert_eq!(d.stats().await.unwrap().bytes_received, 0);
    }

    // And the CLI does the real thing end to end.
    let (code, out, err) = cli(&c.controller, &["prewarm", MODEL, "-n", "2"]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("done"), "{out}");
    let (code, out, _) = cli(&c.controller, &["status", MODEL]).await;
    assert_eq!(code, 0);
    assert_eq!(out.matches("complete").count(), 2, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_receivers_are_replanned_from_another_holder() {
    use std::sync::Arc;
    // A short stall timeout so the test does not wait long for the re-plan.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let mut c = start_cluster_allowing(
        4,
        vec!["--stall-timeout-s".into(), "2".into()],
        &[&url],
        |_, o| {
            o.egress_rate = "12MB/s".into();
        },
    )
    .await
    .unwrap();
    let origin = Origin::new(24 << 20, 1);
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(serve(
        origin.dir.path().to_path_buf(),
        listener,
        None,
        Arc::new(OriginStats::default()),
        stop.clone(),
    ));
    let mut api = c.controller.client().await.unwrap();
    let m = api
        .register_model(RegisterModelRequest {
            name: MODEL.into(),
            origin: url,
            chunk_size: 256 << 10,
            via_host: String::new(),
            profile_json: String::new(),
            no_wait: false,
        })
        .await
        .unwrap()
        .into_inner();
    let manifest: Manifest = decode_exact(m.manifest.into()).unwrap();
    let first = prewarm_hosts(&mut api, hosts(1..=2)).await;
    assert_eq!(
        wait_plan(&mut api, &first, Duration::from_secs(60))
            .await
            .unwrap()
            .state()
            .label(),
        "done"
    );
    // The origin goes away: from now on only the holders can serve the model.
    stop.cancel();
    server.await.unwrap().unwrap();

    let plan = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            hosts: hosts(3..=4),
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // Kill the source of the first chain mid-transfer. Its hops cannot recover from the
    // origin (gone), so they stall until the controller re-plans them from the other holder.
    let source = plan.chains[0].source.clone();
    assert!(source == "host-1" || source == "host-2", "{plan:?}");
    wait_fraction(&mut api, &plan.plan_id, 0.2).await;
    c.daemon_mut(&source).unwrap().kill().await;

    let done = wait_plan(&mut api, &plan.plan_id, Duration::from_secs(90))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    assert!(done.replans >= 1, "{done:?}");
    assert!(done.message.contains("re-planned"), "{done:?}");
    for h in hosts(3..=4) {
        assert_eq!(host_state(&done, &h), "done", "{done:?}");
        c.daemon(&h).unwrap().verify_copy(&manifest).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_replicas_share_one_copy_per_host() {
    let c = start_cluster(3, vec![], |_, o| {
        o.extra_args.extend(["--gpus".into(), "4".into()]);
    })
    .await
    .unwrap();
    let origin = Origin::new(8 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;
    // 5 GPU replicas over 3 hosts: one GPU per new host first, then more GPUs on them; each
    // host receives the model once whatever number of its GPUs use it.
    let a = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            replicas: 5,
            tier: shardcast_protocol::controller::Tier::Gpu as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a.hosts.len(), 3, "{a:?}");
    assert_eq!(a.hosts.iter().map(|h| h.gpus).sum::<u32>(), 5);
    let done = wait_plan(&mut api, &a.plan_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    let chunks: u64 = manifest.shards.iter().map(|s| s.chunks.len() as u64).sum();
    for d in &c.daemons {
        d.verify_copy(&manifest).unwrap();
        assert_eq!(d.stats().await.unwrap().chunks_verified, chunks);
    }
    // Scale out by 4 more GPUs: the holders' free GPUs take them; nothing moves.
    let b = api
        .scale_out(ScaleOutRequest {
            partitions: 0,
            model: MODEL.into(),
            replicas: 4,
            tier: shardcast_protocol::controller::Tier::Gpu as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(b.chains.is_empty(), "{b:?}");
    assert_eq!(b.hosts.iter().map(|h| h.gpus).sum::<u32>(), 4);
    // Its GPU loads run as a plan; the eviction below would rightly refuse to race it.
    let done = wait_plan(&mut api, &b.plan_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    // A prewarm of 9 GPU replicas is already satisfied: it reserves nothing more.
    let again = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            replicas: 9,
            tier: shardcast_protocol::controller::Tier::Gpu as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(again.chains.is_empty(), "{again:?}");
    assert_eq!(again.hosts.iter().map(|h| h.gpus).sum::<u32>(), 0);
    // 12 GPUs, 9 reserved: 4 more do not fit, and the refusal reserves nothing.
    let e = api
        .scale_out(ScaleOutRequest {
            partitions: 0,
            model: MODEL.into(),
            replicas: 4,
            tier: shardcast_protocol::controller::Tier::Gpu as i32,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    let st = api
        .get_status(GetStatusRequest {
            model: MODEL.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.hosts.iter().map(|h| h.gpus).sum::<u32>(), 9, "{st:?}");
    // Evicting the GPU tier releases the slots.
    api.evict(EvictRequest {
        model: MODEL.into(),
        hosts: vec![],
        tier: shardcast_protocol::controller::Tier::Gpu as i32,
    })
    .await
    .unwrap();
    let st = api
        .get_status(GetStatusRequest {
            model: MODEL.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.hosts.iter().map(|h| h.gpus).sum::<u32>(), 0, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_prewarm_ends_with_the_model_resident_on_simulated_gpus() {
    let mut c = start_cluster(2, vec![], |_, o| o.sim_gpus(2, "128MiB"))
        .await
        .unwrap();
    let origin = Origin::new(12 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;
    let hosts = api
        .list_hosts(shardcast_protocol::controller::ListHostsRequest {})
        .await
        .unwrap()
        .into_inner();
    // The simulated GPUs are what the hosts report (with their peer links).
    for h in &hosts.hosts {
        let r = h.report.as_ref().unwrap();
        assert_eq!(r.gpus.len(), 2, "{r:?}");
        assert_eq!(r.gpus[0].nvlink_peers, vec![1]);
    }
    let a = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            replicas: 4,
            tier: shardcast_protocol::controller::Tier::Gpu as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let done = wait_plan(&mut api, &a.plan_id, Duration::from_secs(90))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    for h in &done.hosts {
        assert_eq!(h.gpus, 2, "{h:?}");
        assert_eq!(h.gpu_state().label(), "resident", "{h:?}");
        assert_eq!(h.gpu_bytes, 2 * manifest.total_bytes(), "{h:?}");
    }
    for d in &c.daemons {
        d.verify_copy(&manifest).unwrap();
        // One load per host (onto both its GPUs), timed and counted on /metrics.
        assert_eq!(
            shardcast_tests::metric(d, "gpu_loads_resident_total").await,
            1
        );
        assert_eq!(
            shardcast_tests::metric(d, "gpu_loads_failed_total").await,
            0
        );
        assert_eq!(
            shardcast_tests::metric(d, "gpu_load_seconds_count").await,
            1
        );
    }
    // Each host learns from the controller's heartbeat answers that the other holds the
    // model resident on its GPUs (an input of its GPU eviction order)...
    let digest = manifest.digest().to_hex();
    for d in &c.daemons {
        gpu_copy_elsewhere_becomes(d, &digest, true).await;
    }
    // ...and once the other host is gone (killed, then marked down), that its copy is the
    // only one.
    c.daemons[1].kill().await;
    gpu_copy_elsewhere_becomes(&c.daemons[0], &digest, false).await;
}

/// A GPU that another process mostly holds (an engine the platform started: here a
/// simulated GPU with 90% of its memory taken, `--sim-gpus-busy 1`) is reported busy in the
/// host's heartbeat, and a GPU prewarm lands on the other GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_held_by_another_process_is_reported_busy_and_left_alone() {
    let c = start_cluster(1, vec![], |_, o| {
        o.sim_gpus(2, "128MiB");
        o.extra_args.extend(["--sim-gpus-busy".into(), "1".into()]);
    })
    .await
    .unwrap();
    let origin = Origin::new(8 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;
    let hosts = api
        .list_hosts(shardcast_protocol::controller::ListHostsRequest {})
        .await
        .unwrap()
        .into_inner();
    let report = hosts.hosts[0].report.as_ref().unwrap();
    assert_eq!((report.gpus.len(), report.gpus_busy), (2, 1), "{report:?}");
    let a = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            replicas: 1,
            tier: shardcast_protocol::controller::Tier::Gpu as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let done = wait_plan(&mut api, &a.plan_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    let digest = manifest.digest().to_hex();
    let gpus = shardcast_tests::wait_gpu_status(&c.daemons[0], Duration::from_secs(15), |st| {
        st.models
            .iter()
            .find(|m| m.model == digest && m.state == "resident")
            .map(|m| m.gpus.iter().map(|g| g.gpu).collect::<Vec<_>>())
    })
    .await;
    assert_eq!(gpus, [1], "the model avoids the busy GPU 0");
}

/// Waits (at most 15 s) until `d`'s `GpuStatus` says `want` of whether another host holds
/// `digest` resident on its GPUs.
async fn gpu_copy_elsewhere_becomes(
    d: &shardcast_bench::cluster::Daemon,
    digest: &str,
    want: bool,
) {
    shardcast_tests::wait_gpu_status(d, Duration::from_secs(15), |st| {
        st.models
            .iter()
            .any(|m| m.model == digest && m.gpu_copy_elsewhere == want)
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reported_load_scales_out_then_in_and_evicts() {
    use shardcast_protocol::controller::{ListEventsRequest, ReportLoadRequest};
    let c = start_cluster(4, vec![], |_, _| {}).await.unwrap();
    let origin = Origin::new(8 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;
    // The first replica on the host with the highest id: a scale-down must keep the oldest
    // replica, not the lowest id.
    let first = prewarm_hosts(&mut api, hosts(4..=4)).await;
    wait_plan(&mut api, &first, Duration::from_secs(60))
        .await
        .unwrap();
    let load = |rate: f64| ReportLoadRequest {
        model: MODEL.into(),
        arrival_rate: rate,
        queue_len: 0,
        service_rate: 10.0,
        tier: shardcast_protocol::controller::Tier::Memory as i32,
    };
    // 30 req/s at 10 per replica, 1.05 headroom: 4 replicas, so 3 more.
    let up = api
        .report_load(load(30.0))
        .await
        .unwrap()
        .into_inner()
        .decision
        .unwrap();
    assert_eq!(up.kind, "scale-up", "{up:?}");
    assert_eq!(up.delta, 3, "{up:?}");
    let done = wait_plan(&mut api, &up.plan_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    for d in &c.daemons {
        d.verify_copy(&manifest).unwrap();
    }
    // Load falls: the first low report only starts the scale-down delay (the model's load
    // time); after it, replicas are evicted down to what the load needs.
    let hold = api
        .report_load(load(5.0))
        .await
        .unwrap()
        .into_inner()
        .decision
        .unwrap();
    assert_ne!(hold.kind, "scale-down", "{hold:?}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let down = loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let d = api
            .report_load(load(5.0))
            .await
            .unwrap()
            .into_inner()
            .decision
            .unwrap();
        if d.kind == "scale-down" {
            break d;
        }
        assert!(Instant::now() < deadline, "no scale-down: {d:?}");
    };
    assert_eq!(down.delta, -3, "{down:?}");
    let st = api
        .get_status(GetStatusRequest {
            model: MODEL.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let kept: Vec<&str> = st
        .hosts
        .iter()
        .filter(|h| h.memory)
        .map(|h| h.host.as_str())
        .collect();
    assert_eq!(
        kept,
        ["host-4"],
        "the oldest replica stays: {st:?} {down:?} {up:?}"
    );
    let gone = c
        .daemons
        .iter()
        .filter(|d| d.verify_copy(&manifest).is_err())
        .count();
    assert_eq!(gone, 3);
    // Every decision is recorded with its reason, and counted on /metrics.
    let ev = api
        .list_events(ListEventsRequest {
            model: MODEL.into(),
            limit: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let kinds: Vec<&str> = ev.events.iter().map(|e| e.kind.as_str()).collect();
    assert!(
        kinds.contains(&"scale-up") && kinds.contains(&"scale-down"),
        "{kinds:?}"
    );
    assert!(ev.events.iter().all(|e| !e.reason.is_empty()));
    let (s, body) = http(&c.controller, "GET", "/metrics", "").await;
    assert_eq!(s, 200);
    assert!(
        body.contains("shardcast_autoscaler_decisions_total{kind=\"scale-down\"} 1"),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_burst_loads_partitions_from_a_peer_then_completes() {
    let c = start_cluster(3, vec![], |_, o| o.sim_gpus(1, "128MiB"))
        .await
        .unwrap();
    let origin = Origin::new(16 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;
    // host-1 holds the model in memory: the peer the partitions are fetched from.
    let first = prewarm_hosts(&mut api, hosts(1..=1)).await;
    wait_plan(&mut api, &first, Duration::from_secs(60))
        .await
        .unwrap();
    let origin_before = origin_bytes(&c.daemons).await;
    // Partitions are GPU loads: another tier is refused, and nothing is reserved.
    let e = api
        .scale_out(ScaleOutRequest {
            model: MODEL.into(),
            replicas: 1,
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            partitions: 2,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let a = api
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
    let mut burst_hosts: Vec<&str> = a.hosts.iter().map(|h| h.host.as_str()).collect();
    burst_hosts.sort_unstable();
    // host-1 holds the data (it loads its partition locally), host-2 fetches from it.
    assert_eq!(burst_hosts, ["host-1", "host-2"], "{a:?}");
    assert!(
        a.hosts
            .iter()
            .all(|h| h.state().label() == "loading" && h.source == "peer"),
        "{a:?}"
    );
    assert!(a.estimate_s > 0.0);
    // Each host: its partition live first, then the full model (completion).
    let mut labels = Vec::new();
    for d in &c.daemons[..2] {
        let m = shardcast_tests::wait_gpu_status(d, Duration::from_secs(60), |st| {
            assert!(
                st.models.iter().all(|m| m.state != "failed"),
                "{:?}",
                st.models
            );
            st.models.iter().find(|m| m.state == "resident").cloned()
        })
        .await;
        assert!(m.partition_complete, "{m:?}");
        assert!(m.partition_live_s.is_some_and(|s| s < m.elapsed_s), "{m:?}");
        assert!(m.partition_bytes < manifest.total_bytes(), "{m:?}");
        labels.push(m.partition.clone());
        d.verify_copy(&manifest).unwrap();
    }
    labels.sort();
    assert_eq!(labels, ["1.1/2", "1.2/2"]);
    // Everything came from the peer: the origin was not read again.
    assert_eq!(origin_bytes(&c.daemons).await, origin_before);
    // The slots are booked: the GPU replicas count them.
    let st = api
        .get_status(GetStatusRequest {
            model: MODEL.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let gpu_hosts: Vec<_> = st
        .hosts
        .iter()
        .filter(|h| h.gpus > 0)
        .map(|h| h.host.as_str())
        .collect();
    assert_eq!(gpu_hosts.len(), 2, "{st:?}");
    // The burst is a plan like any other: it ends when both hosts hold full replicas, and
    // says when each partition went live.
    assert!(!a.plan_id.is_empty(), "{a:?}");
    let done = wait_plan(&mut api, &a.plan_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        (done.state().label(), done.kind().label()),
        ("done", "burst"),
        "{done:?}"
    );
    assert!(
        done.live_s > 0.0 && done.live_s <= done.elapsed_s,
        "{done:?}"
    );
    let mut parts: Vec<&str> = done.hosts.iter().map(|h| h.partition.as_str()).collect();
    parts.sort_unstable();
    assert_eq!(parts, ["1.1/2", "1.2/2"], "{done:?}");
    for h in &done.hosts {
        assert_eq!(
            (h.state().label(), h.gpu_state().label()),
            ("done", "resident"),
            "{h:?}"
        );
        assert!(h.live_s > 0.0 && h.live_s <= done.live_s, "{h:?}");
        assert_eq!(h.bytes, manifest.total_bytes(), "{h:?}");
    }
    let listed = api
        .list_plans(shardcast_protocol::controller::ListPlansRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        listed
            .plans
            .iter()
            .any(|p| p.plan_id == a.plan_id && p.kind().label() == "burst")
    );
    // The CLI follows it like any plan and says when the partitions went live.
    let (code, out, err) = cli(&c.controller, &["watch", &a.plan_id]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("[1.1/2 resident, live at"), "{out}");
    assert!(out.contains("every partition live at"), "{out}");
    let (code, out, err) = cli(&c.controller, &["plans"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("gpu (burst)"), "{out}");
}

/// A profile derived from the origin's own tensor index, so the controller needs no host
/// holding the model to plan partitions.
fn origin_profile(origin: &Origin) -> String {
    let mut files: Vec<_> = std::fs::read_dir(origin.dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    let mut tensors = Vec::new();
    for f in files {
        let bytes = std::fs::read(&f).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            tensors.push((name, view.data().len() as u64));
        }
    }
    let p = shardcast_policies::profile::profile_from_tensors(MODEL, &tensors, &Default::default());
    serde_json::to_string(&p).unwrap()
}

async fn partition_plan(
    api: &mut ControllerClient<Channel>,
    max_partitions: u32,
) -> serde_json::Value {
    let r = api
        .get_partition_plan(shardcast_protocol::controller::GetPartitionPlanRequest {
            model: MODEL.into(),
            max_partitions,
            gpu_memory: 0,
            queue: 4,
        })
        .await
        .unwrap()
        .into_inner();
    serde_json::from_str(&r.json).unwrap()
}

async fn register_profile(api: &mut ControllerClient<Channel>, origin: &Origin, profile: &str) {
    api.register_model(RegisterModelRequest {
        name: MODEL.into(),
        origin: origin.uri(),
        chunk_size: 256 << 10,
        via_host: String::new(),
        profile_json: profile.into(),
        no_wait: false,
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_plans_are_stored_with_the_model_and_survive_a_restart() {
    let mut c = start_cluster(1, vec![], |_, o| {
        o.sim_gpus(1, "128MiB");
        o.extra_args.extend(["--nic-rate".into(), "200Gbit".into()]);
    })
    .await
    .unwrap();
    let origin = Origin::new(16 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    let profile = origin_profile(&origin);
    register_profile(&mut api, &origin, &profile).await;
    // The default table (P = 8, the smallest GPU) was computed at registration.
    let v = partition_plan(&mut api, 0).await;
    assert_eq!(v["stored"], true, "{v}");
    assert_eq!(v["gpu_memory"], 128u64 << 20);
    assert_eq!(v["table"]["max_partitions"], 8);
    // The link between partitions is the GPU host's reported NIC, not the thesis' 10 Gbit/s.
    assert_eq!(
        v["link"],
        serde_json::json!({"bps": 25e9, "from": "host_nics"}),
        "{v}"
    );
    assert_eq!(v["table"]["link_bps"], 25e9);
    assert!(
        v["chosen"]["partitions"]
            .as_array()
            .is_some_and(|p| !p.is_empty()),
        "{v}"
    );
    // Other parameters: computed once, then stored.
    let four = partition_plan(&mut api, 4).await;
    assert_eq!(four["stored"], false);
    assert_eq!(four["table"]["max_partitions"], 4);
    let again = partition_plan(&mut api, 4).await;
    assert_eq!(again["stored"], true);
    assert_eq!(again["table"], four["table"]);
    // A restarted controller answers from its state store. (Host reports are committed
    // in batches: one that changed in the last moments before the kill is learnt again
    // from the host's next heartbeat, so wait for that before asking.)
    c.controller.kill().await;
    let killed = Instant::now();
    c.controller.restart().await.unwrap();
    let mut api = c.controller.client().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let h = api
            .list_hosts(shardcast_protocol::controller::ListHostsRequest {})
            .await
            .unwrap()
            .into_inner();
        let seen = h.hosts.iter().any(|h| {
            h.report.as_ref().is_some_and(|r| !r.gpus.is_empty())
                && Duration::from_secs_f64(h.last_seen_s) < killed.elapsed()
        });
        if seen {
            break;
        }
        assert!(Instant::now() < deadline, "{h:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = partition_plan(&mut api, 4).await;
    assert_eq!(after["stored"], true, "{after}\nbefore the restart: {four}");
    assert_eq!(after["table"], four["table"]);
    // A new profile (slower layers) replaces the tables: the default one is computed again
    // at registration, the others on their next request.
    let mut slower: serde_json::Value = serde_json::from_str(&profile).unwrap();
    for g in slower["groups"].as_array_mut().unwrap() {
        let exec = g["exec_s"].as_f64().unwrap();
        g["exec_s"] = (exec * 10.0 + 0.01).into();
    }
    register_profile(&mut api, &origin, &slower.to_string()).await;
    let v2 = partition_plan(&mut api, 0).await;
    assert_eq!(v2["stored"], true);
    assert_ne!(v2["table"], v["table"]);
    // (Compared with a tolerance: JSON floats need not round-trip to the last bit.)
    let exec = |p: &serde_json::Value| p["groups"][1]["exec_s"].as_f64().unwrap();
    assert!((exec(&v2["profile"]) - exec(&slower)).abs() < 1e-12, "{v2}");
    let four2 = partition_plan(&mut api, 4).await;
    assert_eq!(four2["stored"], false);
    assert_ne!(four2["table"], four["table"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_partition_that_fails_on_its_host_frees_its_gpu_slot() {
    use shardcast_protocol::controller::{ListEventsRequest, ListHostsRequest};
    let c = start_cluster(
        2,
        ["--tier-sweep-ms", "200"].map(String::from).to_vec(),
        |_, o| o.sim_gpus(1, "128MiB"),
    )
    .await
    .unwrap();
    let origin = Origin::new(16 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    api.register_model(RegisterModelRequest {
        name: MODEL.into(),
        origin: origin.uri(),
        chunk_size: 256 << 10,
        via_host: String::new(),
        profile_json: origin_profile(&origin),
        no_wait: false,
    })
    .await
    .unwrap();
    // The origin goes bad after registration: past the headers, every byte changes, so the
    // hosts read the tensor index and start, then a chunk fails verification.
    for e in std::fs::read_dir(origin.dir.path()).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let mut bytes = std::fs::read(&path).unwrap();
            for b in &mut bytes[1 << 20..] {
                *b = !*b;
            }
            std::fs::write(&path, bytes).unwrap();
        }
    }
    let a = api
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
    assert!(
        a.hosts
            .iter()
            .all(|h| h.state().label() == "loading" && h.source == "origin"),
        "{a:?}"
    );
    let reserved = |r: &shardcast_protocol::controller::ListHostsResponse| -> u32 {
        r.hosts.iter().map(|h| h.gpus_reserved).sum()
    };
    // Both hosts report the failed load with their heartbeats; the controller releases
    // the slots and says why.
    let deadline = Instant::now() + Duration::from_secs(60);
    let released = loop {
        let ev = api
            .list_events(ListEventsRequest {
                model: MODEL.into(),
                limit: 0,
            })
            .await
            .unwrap()
            .into_inner();
        let released: Vec<_> = ev
            .events
            .into_iter()
            .filter(|e| e.kind == "gpu-release")
            .collect();
        if released.len() == 2 {
            break released;
        }
        assert!(Instant::now() < deadline, "{released:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for e in &released {
        assert!(e.reason.contains("GPU load failed"), "{e:?}");
        assert_eq!(e.delta, -1);
    }
    let mut on: Vec<_> = released.iter().flat_map(|e| e.hosts.clone()).collect();
    on.sort();
    assert_eq!(on, hosts(1..=2));
    let h = api
        .list_hosts(ListHostsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reserved(&h), 0, "{h:?}");
    // The failure is in the hosts' reports too.
    for host in &h.hosts {
        let r = host.report.as_ref().unwrap();
        assert!(
            r.gpu_loads
                .iter()
                .any(|l| l.state == "failed" && !l.error.is_empty() && !l.partition.is_empty()),
            "{r:?}"
        );
    }
    // No GPU replica is counted, and the GPUs are free for a new burst.
    let st = api
        .get_status(GetStatusRequest {
            model: MODEL.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(st.hosts.iter().all(|h| h.gpus == 0), "{st:?}");
    // The burst's plan failed, with each host's reason.
    let failed = wait_plan(&mut api, &a.plan_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        (failed.state().label(), failed.kind().label()),
        ("failed", "burst"),
        "{failed:?}"
    );
    assert!(
        failed
            .hosts
            .iter()
            .all(|h| h.state().label() == "failed" && !h.error.is_empty()),
        "{failed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_memory_tier_sheds_its_least_recently_used_model() {
    use shardcast_protocol::controller::ListEventsRequest;
    let c = start_cluster(
        2,
        [
            "--memory-high",
            "0.45",
            "--memory-low",
            "0.4",
            "--tier-sweep-ms",
            "200",
        ]
        .map(String::from)
        .to_vec(),
        |i, o| {
            if i == 0 {
                o.extra_args
                    .extend(["--memory-capacity", "24MiB"].map(String::from));
            }
        },
    )
    .await
    .unwrap();
    let mut api = c.controller.client().await.unwrap();
    let origins = [Origin::new(6 << 20, 1), Origin::new(6 << 20, 1)];
    let mut digests = Vec::new();
    for (name, o) in ["test/old", "test/new"].iter().zip(&origins) {
        let m = api
            .register_model(RegisterModelRequest {
                name: (*name).into(),
                origin: o.uri(),
                chunk_size: 256 << 10,
                via_host: String::new(),
                profile_json: String::new(),
                no_wait: false,
            })
            .await
            .unwrap()
            .into_inner();
        digests.push(m.digest);
        // Each on host-1; the second prewarm makes `test/old` the least recently used.
        let id = api
            .prewarm(PrewarmRequest {
                model: (*name).into(),
                replicas: 0,
                hosts: vec!["host-1".into()],
                tier: shardcast_protocol::controller::Tier::Memory as i32,
                sources: String::new(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .plan_id;
        let done = wait_plan(&mut api, &id, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(done.state().label(), "done", "{done:?}");
    }
    // 12 MiB of 24: 50% > 45%. Once a heartbeat reports it, the sweeper evicts the old
    // model (down to 40% = 9.6 MiB) and keeps the new one.
    let t0 = Instant::now();
    let event = loop {
        let ev = api
            .list_events(ListEventsRequest {
                model: String::new(),
                limit: 50,
            })
            .await
            .unwrap()
            .into_inner();
        if let Some(e) = ev.events.iter().find(|e| e.kind == "tier-evict") {
            break e.clone();
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let hosts = api
                .list_hosts(shardcast_protocol::controller::ListHostsRequest {})
                .await
                .unwrap()
                .into_inner();
            let log = std::fs::read_to_string(&c.controller.log).unwrap_or_default();
            panic!("no eviction: {ev:?}\n{hosts:?}\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(event.model, "test/old", "{event:?}");
    assert_eq!(event.hosts, ["host-1"]);
    assert!(event.reason.contains("memory tier at"), "{event:?}");
    let st = c.daemons[0]
        .agent()
        .await
        .unwrap()
        .list_holdings(shardcast_protocol::agent::ListHoldingsRequest {})
        .await
        .unwrap()
        .into_inner();
    let held: Vec<&str> = st.models.iter().map(|m| m.digest.as_str()).collect();
    assert!(!held.contains(&digests[0].as_str()), "{held:?}");
    assert!(held.contains(&digests[1].as_str()), "{held:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_scraped_from_a_prometheus_endpoint_scales_out() {
    use shardcast_protocol::controller::ListEventsRequest;
    // The FaaS's metrics endpoint: a real HTTP server serving the exposition text.
    let metrics = tempfile::tempdir().unwrap();
    let page = metrics.path().join("metrics");
    std::fs::write(&page, "# nothing yet\n").unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    tokio::spawn(serve(
        metrics.path().to_path_buf(),
        listener,
        None,
        std::sync::Arc::new(OriginStats::default()),
        stop.clone(),
    ));
    let c = start_cluster(
        4,
        ["--scrape-url", &url, "--scrape-interval-ms", "200"]
            .map(String::from)
            .to_vec(),
        |_, _| {},
    )
    .await
    .unwrap();
    let origin = Origin::new(4 << 20, 1);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;
    let first = prewarm_hosts(&mut api, hosts(1..=1)).await;
    wait_plan(&mut api, &first, Duration::from_secs(60))
        .await
        .unwrap();
    // 30 req/s at 10 per replica: 4 replicas, so 3 more. A series for an unknown model is
    // skipped without stopping the others.
    std::fs::write(
        &page,
        format!(
            "# TYPE shardcast_model_arrival_rate gauge\n\
             shardcast_model_arrival_rate{{model=\"{MODEL}\"}} 30\n\
             shardcast_model_queue_length{{model=\"{MODEL}\"}} 2\n\
             shardcast_model_service_rate{{model=\"{MODEL}\"}} 10\n\
             shardcast_model_arrival_rate{{model=\"nobody/knows\"}} 5\n\
             shardcast_model_service_rate{{model=\"nobody/knows\"}} 1\n"
        ),
    )
    .unwrap();
    let t0 = Instant::now();
    let up = loop {
        let ev = api
            .list_events(ListEventsRequest {
                model: MODEL.into(),
                limit: 20,
            })
            .await
            .unwrap()
            .into_inner();
        if let Some(e) = ev.events.iter().find(|e| e.kind == "scale-up") {
            break e.clone();
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{ev:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(up.delta, 3, "{up:?}");
    let done = wait_plan(&mut api, &up.plan_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    for d in &c.daemons {
        d.verify_copy(&manifest).unwrap();
    }
}

/// The version a host resolves `name` to (its agent's model status by name), if any.
async fn resolved(d: &Daemon, name: &str) -> Option<String> {
    let mut agent = d.agent().await.unwrap();
    agent
        .get_model_status(shardcast_protocol::agent::GetModelStatusRequest { model: name.into() })
        .await
        .ok()
        .and_then(|r| r.into_inner().tiers.into_iter().next())
        .map(|t| t.digest)
}

/// A host resolves a model name only through the controller: the version a signed plan
/// binds, then whatever the registry says (a rollback repoints the name without moving a
/// byte), and the binding survives a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_follow_the_controllers_registry() {
    let mut c = start_cluster(3, vec![], |_, _| {}).await.unwrap();
    let mut api = c.controller.client().await.unwrap();
    let (v1, v2) = (
        Origin::seeded(2 << 20, 1, 11),
        Origin::seeded(2 << 20, 1, 12),
    );
    let register_as = |origin: &Origin| RegisterModelRequest {
        name: MODEL.into(),
        origin: origin.uri(),
        chunk_size: 256 << 10,
        ..Default::default()
    };
    let d1 = api
        .register_model(register_as(&v1))
        .await
        .unwrap()
        .into_inner()
        .digest;
    let plan = prewarm_hosts(&mut api, hosts(2..=3)).await;
    let done = wait_plan(&mut api, &plan, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    let h3 = c.daemon("host-3").unwrap();
    assert_eq!(resolved(h3, MODEL).await.as_deref(), Some(d1.as_str()));

    // A new version: the plan that brings it binds the name.
    let d2 = api
        .register_model(register_as(&v2))
        .await
        .unwrap()
        .into_inner()
        .digest;
    assert_ne!(d1, d2);
    let plan = prewarm_hosts(&mut api, hosts(2..=3)).await;
    let done = wait_plan(&mut api, &plan, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    assert_eq!(resolved(h3, MODEL).await.as_deref(), Some(d2.as_str()));
    let received = h3.stats().await.unwrap().bytes_received;

    // Rolled back in the registry: the hosts follow at their next heartbeat, with no
    // transfer (both versions are held).
    let again = api
        .register_model(register_as(&v1))
        .await
        .unwrap()
        .into_inner()
        .digest;
    assert_eq!(again, d1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while resolved(h3, MODEL).await.as_deref() != Some(d1.as_str()) {
        assert!(
            Instant::now() < deadline,
            "host-3 did not follow the rollback"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(h3.stats().await.unwrap().bytes_received, received);

    // The table is on disk: a restarted daemon resolves the name before any heartbeat
    // could have told it (its controller is stopped first).
    c.controller.kill().await;
    let h3 = c
        .daemons
        .iter_mut()
        .find(|d| d.host_id.as_str() == "host-3")
        .unwrap();
    h3.restart().await.unwrap();
    assert_eq!(resolved(h3, MODEL).await.as_deref(), Some(d1.as_str()));
}

/// The certificate the controller's HTTP listener presents now (DER).
async fn served_certificate(ctl: &ControllerProc) -> Vec<u8> {
    let pki = ctl.pki.clone().expect("a TLS controller");
    let tcp = tokio::net::TcpStream::connect(ctl.http).await.unwrap();
    let (s, _) = pki
        .client(Role::Read)
        .unwrap()
        .connect(
            tcp,
            shardcast_identity::Alpn::Http,
            &shardcast_identity::Expect::Role(Role::Controller),
        )
        .await
        .unwrap();
    s.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

/// How long the controller's first certificate is valid: long enough to start the cluster
/// and finish one prewarm on a slow machine, short enough to wait out in a test.
const FIRST_CERT_LIFE: Duration = Duration::from_secs(25);

/// The controller's certificate is rotated under a running cluster (`shardcast certs
/// rotate`, then SIGHUP): clients are served the new certificate, and the next prewarm's
/// plan tokens are signed with the new key and accepted by the hosts, with no process
/// restarted. The first certificate is short-lived and has expired before the second
/// prewarm, so a controller still signing with the old key would be refused by every hop
/// (`sessions_unauthorised_total`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_controller_certificate_signs_the_next_plans_without_a_restart() {
    use shardcast_identity::pki::IssueRequest;
    use shardcast_identity::{Identity, tls::first_cert};
    let pki = shardcast_bench::pki::ClusterPki::shared().unwrap();
    let files = pki.files(Role::Controller, "controller").unwrap();
    let mut req = IssueRequest::new(Identity::new(Role::Controller, "controller").unwrap());
    req.validity = FIRST_CERT_LIFE;
    let issued = Instant::now();
    let short = pki.pki().issue(&req).unwrap();
    assert_eq!(
        short.cert, files.cert,
        "the controller's files are replaced"
    );

    let c = start_cluster(2, vec![], |_, _| {}).await.unwrap();
    let pids: Vec<Option<u32>> = std::iter::once(c.controller.pid())
        .chain(c.daemons.iter().map(Daemon::pid))
        .collect();
    let first = served_certificate(&c.controller).await;
    let origin = Origin::new(4 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    register(&mut api, &origin).await;
    let plan = prewarm_hosts(&mut api, hosts(1..=1)).await;
    let done = wait_plan(&mut api, &plan, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    assert!(
        issued.elapsed() < FIRST_CERT_LIFE,
        "the first prewarm took longer than the first certificate lives; nothing left to test"
    );

    // Rotate as an operator would, and tell the controller at once.
    let out = tokio::process::Command::new(cli_bin().unwrap())
        .args(["certs", "rotate", "--dir"])
        .arg(pki.pki().dir())
        .arg("--cert")
        .arg(&files.cert)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let status = std::process::Command::new("kill")
        .args(["-HUP", &c.controller.pid().unwrap().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let rotated = first_cert(&std::fs::read(&files.cert).unwrap(), &files.cert)
        .unwrap()
        .to_vec();
    assert_ne!(rotated, first, "rotate wrote a new certificate");
    let t0 = Instant::now();
    loop {
        let now = served_certificate(&c.controller).await;
        if now == rotated {
            break;
        }
        assert_eq!(now, first, "served neither the old nor the new certificate");
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the controller still serves the old certificate; log {}",
            c.controller.log.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Only the new certificate is valid from here on.
    let expiry = issued + FIRST_CERT_LIFE + Duration::from_secs(1);
    tokio::time::sleep_until(expiry.into()).await;
    // host-1 heads the chain to host-2, whose data port checks the plan token.
    let from_origin = origin_bytes(&c.daemons).await;
    let plan = prewarm_hosts(&mut api, hosts(2..=2)).await;
    let done = wait_plan(&mut api, &plan, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        done.state().label(),
        "done",
        "{done:?}; logs {}",
        c.controller.log.display()
    );
    assert_eq!(
        origin_bytes(&c.daemons).await,
        from_origin,
        "host-2 was served by host-1"
    );
    for d in &c.daemons {
        assert_eq!(
            shardcast_tests::metric(d, "sessions_unauthorised_total").await,
            0,
            "{} refused a plan token",
            d.host_id
        );
    }
    let after: Vec<Option<u32>> = std::iter::once(c.controller.pid())
        .chain(c.daemons.iter().map(Daemon::pid))
        .collect();
    assert_eq!(pids, after, "no process was restarted");
    let log = std::fs::read_to_string(&c.controller.log).unwrap();
    assert!(
        log.contains("plan tokens are now signed with the reloaded certificate"),
        "{log}"
    );
}

/// Completion is pushed by the receivers' agents (`WatchModelStatus`), not polled: with
/// the plan loop's poll at 5 s, a prewarm whose data moves in a fraction of a second ends
/// within about a second, and each receiver's `done_s` is within the plan's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_is_pushed_by_the_agents_not_polled() {
    let c = start_cluster(3, vec!["--poll-ms".into(), "5000".into()], |_, _| {})
        .await
        .unwrap();
    let origin = Origin::new(8 << 20, 1);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;
    let plan = prewarm_hosts(&mut api, hosts(1..=3)).await;
    let done = wait_plan(&mut api, &plan, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    assert!(done.elapsed_s < 2.5, "the plan waited for a poll: {done:?}");
    for h in &done.hosts {
        assert_eq!(h.state().label(), "done", "{h:?}");
        assert!(h.done_s > 0.0 && h.done_s <= done.elapsed_s + 0.05, "{h:?}");
        c.daemon(&h.host).unwrap().verify_copy(&manifest).unwrap();
    }
}

/// Registration runs as a job of its own: `no_wait` answers at once and `ListModels`
/// shows it in progress; the same name and origin again joins it (the origin is read
/// once); another origin for that name is refused while it runs; a caller that gives up
/// does not stop it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_is_a_job_that_callers_join_and_can_leave() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let c = start_cluster_allowing(2, vec![], &[&url], |_, _| {})
        .await
        .unwrap();
    // 4 MiB at 4 MiB/s: each registration takes about a second.
    let origin = Origin::new(4 << 20, 2);
    let stats = std::sync::Arc::new(OriginStats::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    tokio::spawn(serve(
        origin.dir.path().to_path_buf(),
        listener,
        Some(4 << 20),
        stats.clone(),
        stop.clone(),
    ));
    let req = |name: &str, origin: &str, no_wait: bool| RegisterModelRequest {
        name: name.into(),
        origin: origin.into(),
        chunk_size: 256 << 10,
        via_host: String::new(),
        profile_json: String::new(),
        no_wait,
    };
    let mut api = c.controller.client().await.unwrap();
    let t0 = Instant::now();
    let started = api
        .register_model(req(MODEL, &url, true))
        .await
        .unwrap()
        .into_inner();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert_eq!(
        (started.name.as_str(), started.digest.as_str()),
        (MODEL, "")
    );
    let listed = api
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(listed.models.is_empty(), "{listed:?}");
    assert_eq!(listed.registering.len(), 1, "{listed:?}");
    assert_eq!(listed.registering[0].origin, url);
    assert!(!listed.registering[0].via_host.is_empty());

    // Another origin for the same name is refused while it runs.
    let err = api
        .register_model(req(MODEL, &origin.uri(), false))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    assert!(err.message().contains("being registered"), "{err:?}");

    // The same registration again joins the one in progress and gets its outcome.
    let m = api
        .register_model(req(MODEL, &url, false))
        .await
        .unwrap()
        .into_inner();
    let manifest: Manifest = decode_exact(m.manifest.into()).unwrap();
    let served = stats.bytes_sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        (manifest.total_bytes()..manifest.total_bytes() + (64 << 10)).contains(&served),
        "the origin served {served} bytes for one {}-byte model",
        manifest.total_bytes()
    );
    let listed = api
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(listed.registering.is_empty(), "{listed:?}");
    assert_eq!(listed.models.len(), 1);

    // A caller that gives up: the registration still ends with the model registered.
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        api.register_model(req("test/other", &url, false)),
    )
    .await;
    assert!(gave_up.is_err(), "it should take longer than 300 ms");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = api
            .list_models(ListModelsRequest {})
            .await
            .unwrap()
            .into_inner();
        if listed.models.iter().any(|m| m.name == "test/other") {
            assert!(listed.registering.is_empty(), "{listed:?}");
            break;
        }
        assert!(Instant::now() < deadline, "{listed:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_as_the_clusters_transport_with_a_tcp_override_per_plan() {
    use shardcast_protocol::controller::Transport;
    let quic = ["--transport", "quic"].map(String::from).to_vec();
    let c = start_cluster(3, quic, |_, _| {}).await.unwrap();
    let origin = Origin::new(8 << 20, 2);
    let mut api = c.controller.client().await.unwrap();
    let manifest = register(&mut api, &origin).await;

    // The cluster's default: the chain's hops dial each other over QUIC.
    let id = prewarm_hosts(&mut api, hosts(1..=2)).await;
    let done = wait_plan(&mut api, &id, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    assert_eq!(done.transport(), Transport::Quic, "{done:?}");
    let mut streams = 0;
    for h in hosts(1..=2) {
        let d = c.daemon(&h).unwrap();
        d.verify_copy(&manifest).unwrap();
        streams += shardcast_tests::metric(d, "quic_streams_accepted_total").await;
    }
    assert!(
        streams >= 2,
        "the receivers accepted {streams} QUIC streams"
    );

    // A plan that asks for TCP gets TCP: no QUIC stream reaches host-3.
    let id = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            hosts: hosts(3..=3),
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            transport: Transport::Tcp as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .plan_id;
    let done = wait_plan(&mut api, &id, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    assert_eq!(done.transport(), Transport::Tcp, "{done:?}");
    let d3 = c.daemon("host-3").unwrap();
    d3.verify_copy(&manifest).unwrap();
    assert_eq!(
        shardcast_tests::metric(d3, "quic_streams_accepted_total").await,
        0
    );

    // A transport this build does not know is refused by name.
    let err = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            replicas: 1,
            transport: 9,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("tcp or quic"), "{}", err.message());
}

/// Both daemons raise their soft open-file limit to the hard one at start (every host's
/// connections, shard files and mappings hold descriptors; distributions default the soft
/// limit to 1024): started from a process whose soft limit is 512, each runs with its soft
/// limit at the hard one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_daemons_raise_their_open_file_limit() {
    // nextest runs each test in its own process: lowering this one's limit touches no other.
    let me = std::process::id().to_string();
    let lowered = std::process::Command::new("prlimit")
        .args(["--pid", &me, "--nofile=512:"])
        .status()
        .expect("prlimit (util-linux)");
    assert!(lowered.success());
    let c = start_cluster(1, vec![], |_, _| {}).await.unwrap();
    for (what, pid) in [
        ("shardcast-controller", c.controller.pid()),
        ("transferd", c.daemons[0].pid()),
    ] {
        let limits = std::fs::read_to_string(format!("/proc/{}/limits", pid.unwrap())).unwrap();
        let line = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap();
        // "Max open files  <soft>  <hard>  files"
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f[3], f[4], "{what}: {line}");
        assert_ne!(f[3], "512", "{what}: {line}");
    }
}
