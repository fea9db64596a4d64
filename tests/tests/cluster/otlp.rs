//! OTLP trace export (`--features otlp`) against a real trace backend: Arize Phoenix
//! (`scripts/phoenix install`; Jaeger, a Go program, cannot be built on this project's
//! machines). A controller and two transferds export to it; a prewarm runs a chain from the
//! origin through both hosts; the daemons are stopped with SIGTERM (the last spans are
//! flushed on shutdown); then Phoenix's REST API must return the controller's `prewarm`
//! and `plan` spans and the hosts' `fetch_chunks`, `forward` and `upstream` spans with
//! their attributes. Skipped (`SKIPPED:`) when Phoenix is not installed.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use shardcast_bench::control::{HttpAs, HttpTarget, ManagedCluster, http_call, wait_plan};
use shardcast_bench::synth::{self, SynthSpec};
use shardcast_identity::{Expect, Role};
use shardcast_protocol::controller::{PrewarmRequest, RegisterModelRequest, Tier};

const MODEL: &str = "test/otlp";
/// Phoenix's first start creates its database: tens of seconds on a busy 2-core machine.
const PHOENIX_START: Duration = Duration::from_secs(120);
/// From the daemons' exit (their flush) to the spans being queryable.
const SPANS_ARRIVE: Duration = Duration::from_secs(30);

fn phoenix_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/phoenix")
}

/// A free TCP port on 127.0.0.1 (bound and released: Phoenix binds it next).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a loopback port");
    l.local_addr().expect("local address").port()
}

/// GET `path` from Phoenix over plain HTTP on loopback: the status and the body.
async fn phoenix_get(addr: SocketAddr, path: &str) -> (u16, String) {
    http_call(
        HttpTarget::Tcp(addr),
        (None, Expect::Role(Role::Read)),
        &HttpAs::Plaintext,
        "GET",
        path,
        "",
    )
    .await
    .unwrap_or((0, String::new()))
}

/// The spans named `name` in Phoenix's default project (OTLP JSON), newest first.
async fn spans(addr: SocketAddr, name: &str) -> Vec<serde_json::Value> {
    let (status, body) = phoenix_get(
        addr,
        &format!("/v1/projects/default/spans/otlpv1?limit=100&name={name}"),
    )
    .await;
    if status != 200 {
        return Vec::new();
    }
    serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["data"].as_array().cloned())
        .unwrap_or_default()
}

/// A span attribute's value as text (strings as they are, integers printed).
fn attr(span: &serde_json::Value, key: &str) -> Option<String> {
    let a = span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)?;
    let v = &a["value"];
    v["string_value"]
        .as_str()
        .map(str::to_string)
        .or_else(|| v["int_value"].as_i64().map(|i| i.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_of_a_prewarm_reach_a_real_otlp_backend() {
    let installed = std::process::Command::new("bash")
        .arg(phoenix_script())
        .arg("installed")
        .status()
        .is_ok_and(|s| s.success());
    if !installed {
        println!("SKIPPED: Phoenix (the OTLP receiver) is not installed: scripts/phoenix install");
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let (http_port, grpc_port) = (free_port(), free_port());
    let phoenix_log = std::fs::File::create(scratch.path().join("phoenix.log")).unwrap();
    let _phoenix = tokio::process::Command::new("bash")
        .arg(phoenix_script())
        .args(["serve", &http_port.to_string(), &grpc_port.to_string()])
        .arg(scratch.path().join("phoenix"))
        .stdin(std::process::Stdio::null())
        .stdout(phoenix_log.try_clone().unwrap())
        .stderr(phoenix_log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let phoenix: SocketAddr = ([127, 0, 0, 1], http_port).into();
    let started = Instant::now();
    while phoenix_get(phoenix, "/v1/projects/default/spans/otlpv1?limit=1")
        .await
        .0
        != 200
    {
        assert!(
            started.elapsed() < PHOENIX_START,
            "Phoenix did not answer within {PHOENIX_START:?}: {}",
            shardcast_bench::cluster::tail(&scratch.path().join("phoenix.log"))
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // A controller and two hosts, all exporting to Phoenix.
    let endpoint = format!("http://127.0.0.1:{http_port}");
    let origin = tempfile::Builder::new()
        .prefix("origin-")
        .tempdir_in(shardcast_tests::origins_root())
        .unwrap();
    synth::generate(
        origin.path(),
        &SynthSpec {
            total_bytes: 4 << 20,
            shards: 2,
            seed: 5,
        },
    )
    .unwrap();
    let origin_uri = format!("file://{}", origin.path().display());
    let allow = shardcast_tests::allow_args(&[&format!("{origin_uri}/")]);
    let otlp = ["--otlp-endpoint".to_string(), endpoint.clone()];
    let mut ctl_args = allow.clone();
    ctl_args.extend(otlp.clone());
    ctl_args.extend(["--register-keep-copy".into(), "false".into()]);
    let mut c = ManagedCluster::start(2, ctl_args, |_, o| {
        o.extra_args.extend(allow.clone());
        o.extra_args.extend(otlp.clone());
    })
    .await
    .unwrap();
    let mut api = c.controller.client().await.unwrap();
    api.register_model(RegisterModelRequest {
        name: MODEL.into(),
        origin: origin_uri,
        chunk_size: 256 << 10,
        ..Default::default()
    })
    .await
    .unwrap();
    let plan = api
        .prewarm(PrewarmRequest {
            model: MODEL.into(),
            replicas: 2,
            tier: Tier::Memory as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .plan_id;
    let status = wait_plan(&mut api, &plan, Duration::from_secs(60))
        .await
        .unwrap();
    let plan_state = status.state().label().to_string();
    assert_eq!(plan_state, "done", "{status:?}");

    // SIGTERM everything: each daemon flushes its queued spans before it exits (well
    // within the batch processor's 5 s schedule, so what arrives is the flush).
    for d in &mut c.daemons {
        assert!(d.terminate(Duration::from_secs(15)).await.unwrap());
    }
    let pid = c.controller.pid().expect("the controller runs");
    let stopped = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());

    // The controller's spans: the API call and the plan run it started.
    let deadline = Instant::now() + SPANS_ARRIVE;
    let wanted = ["prewarm", "plan", "fetch_chunks", "forward", "upstream"];
    let mut found: Vec<Vec<serde_json::Value>> = Vec::new();
    loop {
        found.clear();
        for name in wanted {
            found.push(spans(phoenix, name).await);
        }
        if found.iter().all(|s| !s.is_empty()) {
            break;
        }
        let missing: Vec<&str> = wanted
            .iter()
            .zip(&found)
            .filter(|(_, s)| s.is_empty())
            .map(|(n, _)| *n)
            .collect();
        assert!(
            Instant::now() < deadline,
            "spans {missing:?} did not reach Phoenix within {SPANS_ARRIVE:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let [prewarm, plan_spans, fetches, forwards, upstreams] = &found[..] else {
        unreachable!("five names asked for");
    };
    assert!(
        prewarm
            .iter()
            .any(|s| attr(s, "model").as_deref() == Some(MODEL)
                && attr(s, "plan").as_deref() == Some(plan.as_str())),
        "no prewarm span of {MODEL} naming plan {plan}: {prewarm:?}"
    );
    let run = plan_spans
        .iter()
        .find(|s| attr(s, "plan").as_deref() == Some(plan.as_str()))
        .unwrap_or_else(|| panic!("no plan span for {plan}: {plan_spans:?}"));
    assert_eq!(attr(run, "model").as_deref(), Some(MODEL), "{run:?}");
    assert_eq!(attr(run, "state").as_deref(), Some("done"), "{run:?}");
    assert_eq!(attr(run, "receivers").as_deref(), Some("2"), "{run:?}");
    // The run is a child of the API call that started it: one trace.
    let parent = prewarm
        .iter()
        .find(|s| attr(s, "plan").as_deref() == Some(plan.as_str()))
        .expect("the prewarm span");
    assert_eq!(run["trace_id"], parent["trace_id"]);
    assert_eq!(run["parent_span_id"], parent["span_id"]);

    // The hosts' spans: the head read the model from the origin (a span per batch of
    // chunks) and forwarded it; the second host received it from the first.
    let read: u64 = fetches
        .iter()
        .filter_map(|s| attr(s, "chunks")?.parse::<u64>().ok())
        .sum();
    assert!(read >= 1, "{fetches:?}");
    assert!(
        fetches
            .iter()
            .all(|s| attr(s, "origin").is_some_and(|o| o.starts_with("file://"))),
        "{fetches:?}"
    );
    for (name, list) in [("forward", forwards), ("upstream", upstreams)] {
        for s in list.iter() {
            for key in ["session", "model", "shard"] {
                assert!(attr(s, key).is_some(), "{name} span without {key}: {s:?}");
            }
        }
    }
    assert!(
        upstreams.iter().all(|s| attr(s, "peer").is_some()),
        "{upstreams:?}"
    );
}
