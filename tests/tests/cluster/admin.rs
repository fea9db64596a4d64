//! transferd's admin listener and the controller's HTTP API against real processes on
//! loopback: who may read metrics and hand-offs (certificates by role, bearer tokens, the
//! Unix socket and its modes), and clients that stall (slowloris, idle keep-alive) are
//! closed within the configured timeouts and counted.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::{Duration, Instant};

use shardcast_bench::cluster::{Daemon, DaemonOpts};
use shardcast_bench::control::{ControllerProc, HttpAs, HttpTarget, http_call, http_connect};
use shardcast_bench::pki::ClusterPki;
use shardcast_identity::grpc::Io;
use shardcast_identity::{Expect, Identity, Role, TlsContext, TlsFiles};
use shardcast_tests::{TestCluster, metric};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The hand-off path of the model `TestCluster::import_on_source` imports.
const HANDOFF: &str = "/v1/handoff/test%2Fmodel";

/// A tokens file admitting a new `read` token; the token.
fn read_token(dir: &std::path::Path) -> (std::path::PathBuf, String) {
    let id = Identity::new(Role::Read, "dashboard").unwrap();
    let (token, line) = shardcast_identity::token::generate(&id);
    let path = dir.join("tokens");
    std::fs::write(&path, format!("{line}\n")).unwrap();
    (path, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_endpoint_serves_readers_and_refuses_everyone_else() {
    let tokens = tempfile::tempdir().unwrap();
    let (tokens_file, token) = read_token(tokens.path());
    let c = TestCluster::start(0, 1 << 20, 1, |_, o| {
        o.extra_args
            .extend(["--tokens-file".into(), tokens_file.display().to_string()])
    })
    .await
    .unwrap();
    c.import_on_source().await.unwrap();
    let d = &c.daemons[0];
    let get =
        |who: HttpAs, path: &'static str| async move { d.admin(who, "GET", path).await.unwrap() };

    // Liveness probes stay anonymous and say nothing else.
    assert_eq!(
        get(HttpAs::Anonymous, "/healthz").await,
        (200, "ok\n".into())
    );
    assert_eq!(
        get(HttpAs::Anonymous, "/readyz").await,
        (200, "ready\n".into())
    );

    // Readers: a `read` certificate, the controller's, a bearer token.
    let (s, b) = get(HttpAs::Cert(Role::Read), HANDOFF).await;
    assert_eq!(s, 200, "{b}");
    let h: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(h["kind"], "memory-file", "{b}");
    let (s, b) = get(HttpAs::Cert(Role::Controller), "/metrics").await;
    assert_eq!(s, 200, "{b}");
    assert!(b.contains("shardcast_admin_refused_total"), "{b}");
    // The memory tier's page policy, as the daemon read it from its mount.
    let huge = transferd::store::TierFs::of(&d.memory_dir).is_some_and(|f| f.huge_pages());
    let gauge = format!(
        "shardcast_memory_tier_huge_pages{{host=\"{}\"}} {}",
        d.host_id,
        u8::from(huge)
    );
    assert!(b.contains(&gauge), "{gauge} not in {b}");
    assert_eq!(get(HttpAs::Token(token.clone()), HANDOFF).await.0, 200);
    assert_eq!(get(HttpAs::Token(token), "/metrics").await.0, 200);

    // No identity: 401 with a message saying how to get one.
    for path in ["/metrics", HANDOFF] {
        let (s, b) = get(HttpAs::Anonymous, path).await;
        assert_eq!(s, 401, "{path}: {b}");
        assert!(
            b.contains("UNAUTHENTICATED") && b.contains("bearer token"),
            "{b}"
        );
    }
    let (s, b) = get(HttpAs::Token("shc_forged".into()), HANDOFF).await;
    assert_eq!(s, 401, "{b}");
    assert!(b.contains("not valid"), "{b}");
    // A host certificate may not read: 403 naming the identity and the permission.
    let (s, b) = get(HttpAs::Cert(Role::Host), HANDOFF).await;
    assert_eq!(s, 403, "{b}");
    assert!(
        b.contains("PERMISSION_DENIED") && b.contains("host:test-host") && b.contains("read"),
        "{b}"
    );
    // Other methods and routes need admin.
    let (s, b) = d
        .admin(HttpAs::Cert(Role::Read), "POST", "/metrics")
        .await
        .unwrap();
    assert_eq!(s, 403, "{b}");
    // Plain HTTP gets no answer at all.
    assert_eq!(get(HttpAs::Plaintext, "/metrics").await.0, 0);
    // A certificate of another CA is refused in the TLS handshake.
    let stranger = ClusterPki::new().unwrap();
    let ours = ClusterPki::shared().unwrap();
    let f = stranger.files(Role::Read, "stranger").unwrap();
    let ctx = TlsContext::load(TlsFiles {
        ca: ours.pki().ca().cert,
        cert: f.cert,
        key: f.key,
    })
    .unwrap();
    let tcp = tokio::net::TcpStream::connect(d.admin_addr).await.unwrap();
    let expect = Expect::Role(Role::Host);
    if let Ok((mut s, _)) = ctx
        .connect(tcp, shardcast_identity::Alpn::Http, &expect)
        .await
    {
        // TLS 1.3 clients finish before the server's verdict: nothing may follow.
        let _ = s
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await;
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
        assert!(!String::from_utf8_lossy(&out).contains("200 OK"));
    }

    // Every refusal is counted, with the role where there is one.
    assert_eq!(metric(d, "admin_refused_total").await, 3);
    assert_eq!(metric(d, "admin_denied_total{role=\"host\"}").await, 1);
    assert_eq!(metric(d, "admin_denied_total{role=\"read\"}").await, 1);
    assert!(metric(d, "tls_handshakes_refused_total").await >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_socket_is_private_or_shared_with_the_store_group() {
    let scratch = tempfile::tempdir().unwrap();
    // A group this process may give files to: its own.
    let gid = std::fs::metadata(scratch.path()).unwrap().gid();
    let mut daemons = Vec::new();
    for (name, group) in [("private", None), ("shared", Some(gid))] {
        let mut o = DaemonOpts::local(name);
        o.admin_socket = Some(scratch.path().join(format!("{name}-admin.sock")));
        if let Some(g) = group {
            o.extra_args.extend(["--store-group".into(), g.to_string()]);
        }
        daemons.push(Daemon::start(&scratch.path().join(name), o).await.unwrap());
    }
    for (d, mode) in daemons.iter().zip([0o600, 0o660]) {
        let sock = scratch.path().join(format!("{}-admin.sock", d.host_id));
        let meta = std::fs::symlink_metadata(&sock).unwrap();
        assert_eq!(
            meta.permissions().mode() & 0o777,
            mode,
            "{}",
            sock.display()
        );
        assert_eq!(meta.gid(), gid);
        // This process is the daemon's user: a local operator, no certificate needed.
        let (s, b) = d.admin(HttpAs::Anonymous, "GET", "/metrics").await.unwrap();
        assert_eq!(s, 200, "{b}");
        let (s, b) = d
            .admin(HttpAs::Anonymous, "GET", "/v1/handoff/no%2Fsuch")
            .await
            .unwrap();
        assert_eq!(s, 404, "authorised, then not found: {b}");
        assert_eq!(metric(d, "admin_refused_total").await, 0);
    }
}

/// Reads until the peer closes (or `limit`); how long that took.
async fn time_to_close(s: &mut Box<dyn Io>, limit: Duration) -> Duration {
    let t0 = Instant::now();
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the server kept a stalled connection for {limit:?}"
    );
    t0.elapsed()
}

/// Reads one response to a request for `/healthz` (`ok\n`), leaving the connection open.
async fn read_healthz(s: &mut Box<dyn Io>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(Duration::from_secs(10), async {
        while !got.ends_with(b"\r\n\r\nok\n") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the response: {got:?}");
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .unwrap();
}

/// With a 500 ms header timeout and a 1 s idle timeout on the listener at `addr` (whose
/// certificate names `server`): half a request line is cut off after about half a second,
/// an idle keep-alive connection after about a second.
async fn stalled_clients_are_closed(addr: std::net::SocketAddr, server: Expect) {
    let pki = ClusterPki::shared().unwrap();
    let connect = || async {
        http_connect(
            HttpTarget::Tcp(addr),
            (Some(&pki), server.clone()),
            &HttpAs::Cert(Role::Read),
        )
        .await
        .unwrap()
    };
    // Slowloris: half a request line, then nothing.
    let mut s = connect().await;
    s.write_all(b"GET /heal").await.unwrap();
    let t = time_to_close(&mut s, Duration::from_secs(5)).await;
    assert!(t >= Duration::from_millis(300), "closed after {t:?}");
    // A client that connects and sends nothing is timed the same way.
    let mut s = connect().await;
    let t = time_to_close(&mut s, Duration::from_secs(5)).await;
    assert!(t >= Duration::from_millis(300), "closed after {t:?}");
    // Keep-alive: one request, then silence.
    let mut s = connect().await;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    read_healthz(&mut s).await;
    let t = time_to_close(&mut s, Duration::from_secs(5)).await;
    assert!(t >= Duration::from_millis(800), "closed after {t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_admin_clients_are_closed_and_counted() {
    let c = TestCluster::start(0, 1 << 20, 1, |_, o| {
        o.extra_args.extend(
            [
                "--admin-header-timeout-ms",
                "500",
                "--admin-idle-timeout-ms",
                "1000",
            ]
            .map(String::from),
        )
    })
    .await
    .unwrap();
    let d = &c.daemons[0];
    stalled_clients_are_closed(d.admin_addr, Expect::Role(Role::Host)).await;
    assert_eq!(metric(d, "admin_timeouts_total{kind=\"header\"}").await, 2);
    assert_eq!(metric(d, "admin_timeouts_total{kind=\"idle\"}").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_controller_http_clients_are_closed_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = ControllerProc::start(
        dir.path(),
        [
            "--http-header-timeout-ms",
            "500",
            "--http-idle-timeout-ms",
            "1000",
        ]
        .map(String::from)
        .to_vec(),
    )
    .await
    .unwrap();
    stalled_clients_are_closed(ctl.http, Expect::Role(Role::Controller)).await;
    let (s, body) = ctl
        .http(HttpAs::Cert(Role::Read), "GET", "/metrics", "")
        .await
        .unwrap();
    assert_eq!(s, 200);
    for (kind, n) in [("header", 2), ("idle", 1)] {
        let line = format!("shardcast_http_timeouts_total{{kind=\"{kind}\"}} {n}");
        assert!(body.lines().any(|l| l == line), "{line} in {body}");
    }
}

/// The controller scrapes a transferd's admin `/metrics` over HTTPS with its own
/// certificate (the `controller` role may read); nothing is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_scraper_reads_transferd_metrics_with_its_certificate() {
    let scratch = tempfile::tempdir().unwrap();
    let d = Daemon::start(&scratch.path().join("h"), DaemonOpts::local("scraped"))
        .await
        .unwrap();
    let url = format!("https://{}/metrics", d.admin_addr);
    let ctl = ControllerProc::start(
        &scratch.path().join("ctl"),
        ["--scrape-url", &url, "--scrape-interval-ms", "200"]
            .map(String::from)
            .to_vec(),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let log = std::fs::read_to_string(&ctl.log).unwrap();
    assert!(log.contains("scraping load"), "{log}");
    assert!(!log.contains("scraping load failed"), "{log}");
    assert_eq!(metric(&d, "admin_refused_total").await, 0);
    assert_eq!(
        metric(&d, "admin_denied_total{role=\"controller\"}").await,
        0
    );
    // What the scraper read is what a reader reads (a plain request as the controller).
    let (s, _) = http_call(
        HttpTarget::Tcp(d.admin_addr),
        (ctl.pki.as_deref(), Expect::Role(Role::Host)),
        &HttpAs::Cert(Role::Controller),
        "GET",
        "/metrics",
        "",
    )
    .await
    .unwrap();
    assert_eq!(s, 200);
}
