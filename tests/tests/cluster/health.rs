//! Readiness and health against real processes: `/readyz` (anonymous) and the
//! `shardcast_ready` gauge, `grpc.health.v1` on transferd's agent listener and the
//! controller's gRPC listener (any certificate may ask), readiness withdrawn at SIGTERM
//! while `shutdown_delay_ms` keeps the daemon serving, and the controller's OpenAPI
//! document called route by route against the router that serves it.
//!
//! * a transferd whose controller is not there yet is not ready (503 naming the
//!   controller, NOT_SERVING, gauge 0), and becomes ready once the controller starts;
//! * a draining transferd and a draining controller answer 503 `draining` and a health
//!   `Watch` sees NOT_SERVING, then they exit on their own;
//! * every (method, path) of `/openapi.json` is routed, every other method on a documented
//!   path answers 405, and the document is `read`, not anonymous.

use std::time::{Duration, Instant};

use shardcast_bench::cluster::{Daemon, DaemonOpts, metric_value};
use shardcast_bench::control::{ControllerProc, HttpAs};
use shardcast_bench::pki::ClusterPki;
use shardcast_identity::grpc::ClientSecurity;
use shardcast_identity::{Expect, Identity, Role};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// A health client over mutual TLS with a certificate of `role`, to a server that must be
/// `server`.
async fn health(addr: &str, role: Role, server: Expect) -> HealthClient<tonic::transport::Channel> {
    let pki = ClusterPki::shared().unwrap();
    let security = ClientSecurity::Tls(pki.client(role).unwrap(), server);
    let ch = shardcast_identity::grpc::connect(addr, security)
        .await
        .unwrap();
    HealthClient::new(ch)
}

async fn check(c: &mut HealthClient<tonic::transport::Channel>, service: &str) -> ServingStatus {
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        c.check(HealthCheckRequest {
            service: service.into(),
        }),
    )
    .await
    .expect("health check timed out")
    .unwrap_or_else(|s| panic!("health check of {service:?}: {s:?}"));
    r.into_inner().status()
}

/// The next message of a health `Watch`, within 10 s.
async fn next_status(
    w: &mut tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
) -> Option<tonic_health::pb::HealthCheckResponse> {
    tokio::time::timeout(Duration::from_secs(10), w.message())
        .await
        .expect("no health update")
        .unwrap()
}

/// Polls `f` every 50 ms until it holds, for at most `limit`.
async fn until<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn host(d: &Daemon) -> Expect {
    Expect::Exactly(Identity::new(Role::Host, d.host_id.as_str()).unwrap())
}

async fn ready_gauge(d: &Daemon) -> Option<u64> {
    metric_value(&d.metrics().await.unwrap(), &d.host_id, "ready")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transferd_is_ready_once_its_controller_answers() {
    let scratch = tempfile::tempdir().unwrap();
    let ctl_root = scratch.path().join("controller");
    // The controller's Unix socket, before there is a controller.
    let socket = ctl_root.join("controller.sock");
    let mut o = DaemonOpts::local("ready-host");
    o.agent_tcp = Some("127.0.0.1:0".into());
    o.extra_args.extend([
        "--controller".into(),
        format!("unix:{}", socket.display()),
        "--heartbeat-ms".into(),
        "100".into(),
    ]);
    let d = Daemon::start(&scratch.path().join("d"), o).await.unwrap();

    // Not ready: every listener is up, the store recovered, but no heartbeat answered.
    let (s, body) = d.admin(HttpAs::Anonymous, "GET", "/readyz").await.unwrap();
    assert_eq!(s, 503, "{body}");
    assert!(
        body.starts_with("not ready\ncontroller: the controller has not answered a heartbeat yet")
            && body.lines().count() == 2,
        "{body}"
    );
    // Liveness is another question: the process is up.
    assert_eq!(
        d.admin(HttpAs::Anonymous, "GET", "/healthz")
            .await
            .unwrap()
            .0,
        200
    );
    assert_eq!(ready_gauge(&d).await, Some(0));
    let mut h = health(&d.agent_addr, Role::Read, host(&d)).await;
    for service in ["", "shardcast.agent.v1.Agent"] {
        assert_eq!(check(&mut h, service).await, ServingStatus::NotServing);
    }
    // A service the daemon does not serve is not found, not "serving".
    let unknown = h
        .check(HealthCheckRequest {
            service: "shardcast.controller.v1.Controller".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);

    // The controller comes up; the next heartbeat makes the host ready.
    let _ctl = ControllerProc::start(&ctl_root, vec![]).await.unwrap();
    until("the host turns ready", Duration::from_secs(15), || async {
        d.admin(HttpAs::Anonymous, "GET", "/readyz").await.unwrap() == (200, "ready\n".into())
    })
    .await;
    assert_eq!(ready_gauge(&d).await, Some(1));
    // Every role's certificate may ask (health reveals readiness only).
    for role in Role::ALL {
        let mut h = health(&d.agent_addr, role, host(&d)).await;
        assert_eq!(
            check(&mut h, "shardcast.agent.v1.Agent").await,
            ServingStatus::Serving,
            "{role}"
        );
        assert_eq!(check(&mut h, "").await, ServingStatus::Serving, "{role}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_transferd_answers_503_and_not_serving() {
    let scratch = tempfile::tempdir().unwrap();
    let mut o = DaemonOpts::local("draining-host");
    o.agent_tcp = Some("127.0.0.1:0".into());
    o.extra_args
        .extend(["--shutdown-delay-ms".into(), "6000".into()]);
    let mut d = Daemon::start(&scratch.path().join("d"), o).await.unwrap();
    // Standalone (no controller): ready as soon as it serves.
    assert_eq!(
        d.admin(HttpAs::Anonymous, "GET", "/readyz").await.unwrap(),
        (200, "ready\n".into())
    );
    let mut h = health(&d.agent_addr, Role::Controller, host(&d)).await;
    let mut watch = h
        .watch(HealthCheckRequest {
            service: "shardcast.agent.v1.Agent".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        next_status(&mut watch).await.map(|r| r.status()),
        Some(ServingStatus::Serving)
    );

    d.signal("TERM").unwrap();
    // At once: NOT_SERVING to the watcher, 503 to probes, the gauge at 0 ...
    assert_eq!(
        next_status(&mut watch).await.map(|r| r.status()),
        Some(ServingStatus::NotServing)
    );
    assert_eq!(
        d.admin(HttpAs::Anonymous, "GET", "/readyz").await.unwrap(),
        (503, "not ready\ndraining: shutting down\n".into())
    );
    assert_eq!(ready_gauge(&d).await, Some(0));
    // ... while everything else still serves until the delay ends: the admin endpoint
    // (the gauge above) and the agent listener, to new connections too.
    let mut again = health(&d.agent_addr, Role::Read, host(&d)).await;
    assert_eq!(check(&mut again, "").await, ServingStatus::NotServing);
    // Then it exits on its own once the delay is over (`terminate` signals again, which
    // ends the delay early, as a second Ctrl-C would); the watch ends with it.
    assert!(d.terminate(Duration::from_secs(15)).await.unwrap());
    assert!(
        tokio::time::timeout(Duration::from_secs(5), watch.message())
            .await
            .map(|m| !matches!(m, Ok(Some(_))))
            .unwrap_or(false),
        "the watch outlived the daemon"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_reports_health_and_drains() {
    let scratch = tempfile::tempdir().unwrap();
    let mut c = ControllerProc::start(
        &scratch.path().join("c"),
        vec!["--shutdown-delay-ms".into(), "6000".into()],
    )
    .await
    .unwrap();
    assert_eq!(
        c.http(HttpAs::Anonymous, "GET", "/readyz", "")
            .await
            .unwrap(),
        (200, "ready\n".into())
    );
    let grpc = c.grpc.to_string();
    let ctl = Expect::Role(Role::Controller);
    for role in Role::ALL {
        let mut h = health(&grpc, role, ctl.clone()).await;
        for service in [
            "",
            "shardcast.controller.v1.Controller",
            "shardcast.controller.v1.Inventory",
        ] {
            assert_eq!(
                check(&mut h, service).await,
                ServingStatus::Serving,
                "{role} {service:?}"
            );
        }
    }
    let metrics = c
        .http(HttpAs::Cert(Role::Read), "GET", "/metrics", "")
        .await
        .unwrap();
    assert!(metrics.1.contains("\nshardcast_ready 1\n"), "{}", metrics.1);

    let mut h = health(&grpc, Role::Platform, ctl.clone()).await;
    let mut watch = h
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(10), watch.message()).await;
    assert_eq!(
        first.unwrap().unwrap().map(|r| r.status()),
        Some(ServingStatus::Serving)
    );
    let pid = c.pid().unwrap();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let update = tokio::time::timeout(Duration::from_secs(10), watch.message()).await;
    assert_eq!(
        update.unwrap().unwrap().map(|r| r.status()),
        Some(ServingStatus::NotServing)
    );
    assert_eq!(
        c.http(HttpAs::Anonymous, "GET", "/readyz", "")
            .await
            .unwrap(),
        (503, "not ready\ndraining: shutting down\n".into())
    );
    // The API serves on during the delay.
    assert_eq!(
        c.http(HttpAs::Cert(Role::Read), "GET", "/v1/models", "")
            .await
            .unwrap()
            .0,
        200
    );
    let metrics = c
        .http(HttpAs::Cert(Role::Read), "GET", "/metrics", "")
        .await
        .unwrap();
    assert!(metrics.1.contains("\nshardcast_ready 0\n"), "{}", metrics.1);
    // Then it exits.
    until("the controller exits", Duration::from_secs(15), || async {
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| s.contains(") Z "))
                .unwrap_or(true)
    })
    .await;
    c.kill().await;
}

/// The role whose certificate holds `permission` (as the document names it).
fn role_for(permission: &str) -> Option<Role> {
    match permission {
        "none" => None,
        "read" => Some(Role::Read),
        "platform" => Some(Role::Platform),
        "admin" => Some(Role::Admin),
        "heartbeat" => Some(Role::Host),
        other => panic!("unknown permission {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_route_is_served_and_nothing_else_on_its_paths() {
    let scratch = tempfile::tempdir().unwrap();
    let c = ControllerProc::start(&scratch.path().join("c"), vec![])
        .await
        .unwrap();
    // The document is for readers, not for anyone.
    let (s, _) = c
        .http(HttpAs::Anonymous, "GET", "/openapi.json", "")
        .await
        .unwrap();
    assert_eq!(s, 401);
    let (s, text) = c
        .http(HttpAs::Cert(Role::Read), "GET", "/openapi.json", "")
        .await
        .unwrap();
    assert_eq!(s, 200, "{text}");
    assert_eq!(text, shardcast_controller::openapi::json());
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ops = shardcast_controller::openapi::operations(&doc);
    assert!(ops.len() >= 20, "{ops:?}");
    for (method, path) in &ops {
        let op = &doc["paths"][path][method.to_ascii_lowercase()];
        let who = match role_for(op["x-shardcast-permission"].as_str().unwrap()) {
            Some(role) => HttpAs::Cert(role),
            None => HttpAs::Anonymous,
        };
        // Unknown names and ids: a handler's own 404, never the router's.
        let concrete = path
            .replace("{model}", "no/such-model")
            .replace("{id}", "no-such-plan");
        let (s, body) = c.http(who, method, &concrete, "").await.unwrap();
        assert!(
            s != 405 && !body.contains("no such endpoint") && s != 401 && s != 403,
            "{method} {path} is documented but not served as documented: {s} {body}"
        );
        // Methods the document does not list on this path are not served.
        for other in ["GET", "POST", "PUT", "DELETE", "PATCH"] {
            if ops.contains(&(other.to_string(), path.clone())) {
                continue;
            }
            let (s, body) = c
                .http(HttpAs::Cert(Role::Admin), other, &concrete, "")
                .await
                .unwrap();
            assert_eq!(
                s, 405,
                "{other} {path} is served but not documented: {body}"
            );
        }
    }
    // A path the document does not list is the router's 404.
    let (s, body) = c
        .http(HttpAs::Cert(Role::Admin), "GET", "/v1/nothing-here", "")
        .await
        .unwrap();
    assert_eq!(s, 404);
    assert!(body.contains("no such endpoint"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_is_ready_while_it_knows_the_leader() {
    use shardcast_bench::ha::HaCluster;
    // Replica 1 reaches etcd through a relay the test cuts; replica 0 leads.
    let c = HaCluster::start(2, 0, vec![], &[1], |_, _| {})
        .await
        .unwrap();
    let follower = &c.controllers[1];
    let readyz = |i: usize| {
        let ctl = &c.controllers[i];
        async move {
            ctl.http(HttpAs::Anonymous, "GET", "/readyz", "")
                .await
                .unwrap()
        }
    };
    for i in 0..2 {
        until(
            "every replica turns ready",
            Duration::from_secs(20),
            || async { readyz(i).await == (200, "ready\n".into()) },
        )
        .await;
    }
    // Health is a follower's to answer (the leader gate lets it through, like reads).
    let mut h = health(
        &follower.grpc.to_string(),
        Role::Read,
        Expect::Role(Role::Controller),
    )
    .await;
    assert_eq!(
        check(&mut h, "shardcast.controller.v1.Controller").await,
        ServingStatus::Serving
    );
    // Cut off from etcd it cannot name a leader: not ready, and it says why.
    let (_, proxy) = &c.proxies[0];
    proxy.cut();
    until(
        "the cut-off follower turns unready",
        Duration::from_secs(20),
        || async {
            let (s, body) = readyz(1).await;
            s == 503 && body.contains("leader: no leader known")
        },
    )
    .await;
    assert_eq!(check(&mut h, "").await, ServingStatus::NotServing);
    assert_eq!(readyz(0).await.0, 200, "the leader stays ready");
    proxy.heal();
    until(
        "the healed follower turns ready",
        Duration::from_secs(20),
        || async { readyz(1).await.0 == 200 },
    )
    .await;
}
