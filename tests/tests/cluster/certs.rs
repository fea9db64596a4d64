//! Certificates near their end and refused handshakes, against real processes: each
//! daemon runs under a CA of its own whose certificate for it expires in a few days.
//!
//! * a transferd whose certificate expires in 10 days exports
//!   `shardcast_certificate_expiry_seconds{certificate="own"}` at about that, the CA's
//!   (ten years) beside it, and logs a WARN at start (default threshold, 14 days); after the
//!   certificate is rotated (SIGHUP) the gauge follows the new one;
//! * a controller whose certificate expires in 20 days, with `--cert-expiry-warning-s 30d`,
//!   exports the gauge and logs the WARN; clients with a certificate of a foreign CA,
//!   on its gRPC and HTTP listeners, are counted in its
//!   `shardcast_tls_handshakes_refused_total`;
//! * a transferd started with a certificate already past its `notAfter` logs an ERROR
//!   naming the file and the date, exports the gauge negative, and is refused: its
//!   controller refuses its heartbeats in the handshake (it never registers, and stays not
//!   ready), and a peer refuses its data port; once the certificate is renewed and
//!   reloaded (SIGHUP) it registers and turns ready.

use std::sync::Arc;
use std::time::{Duration, Instant};

use shardcast_bench::cluster::{Daemon, DaemonOpts};
use shardcast_bench::control::{ControllerProc, HttpAs, wait_hosts_up};
use shardcast_bench::pki::ClusterPki;
use shardcast_identity::expiry::not_after;
use shardcast_identity::pki::DEFAULT_CA_VALIDITY;
use shardcast_identity::tls::first_cert;
use shardcast_identity::{Alpn, Expect, Role, TlsContext};
use shardcast_tests::{closed_within, metric};
use tokio::net::TcpStream;

const DAY: u64 = 86_400;
/// How far a gauge may be from the seconds left by the test's clock (`notAfter` is in
/// whole seconds; the certificate is issued, and the gauge read, a little after the test's
/// clock starts and stops).
const TOLERANCE: u64 = 5;

/// Whether `got` seconds left is `validity` less the time since `issued`.
fn near(got: u64, validity: u64, issued: Instant) -> bool {
    got.abs_diff(validity - issued.elapsed().as_secs()) <= TOLERANCE
}

/// Whether a log line says `days` are left: `"{days}d 0h"`, or `"{days-1}d 23h"` once the
/// certificate's first second has passed.
fn says_days(line: &str, days: u64) -> bool {
    line.contains(&format!(" {days}d 0h")) || line.contains(&format!(" {}d 23h", days - 1))
}

/// The log lines at `level` (`WARN`, `ERROR`, `INFO`) that contain `text`.
fn log_lines(log: &std::path::Path, level: &str, text: &str) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(level) && l.contains(text))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transferd_gauges_its_certificates_end_and_warns_within_two_weeks() {
    let scratch = tempfile::tempdir().unwrap();
    let ca_issued = Instant::now();
    let pki = Arc::new(ClusterPki::new().unwrap());
    let host = "expiring-host";
    let issued = Instant::now();
    pki.issue_valid_for(Role::Host, host, Duration::from_secs(10 * DAY))
        .unwrap();
    let mut opts = DaemonOpts::local(host);
    opts.pki = Some(pki.clone());
    let d = Daemon::start(&scratch.path().join(host), opts)
        .await
        .unwrap();

    let own = metric(&d, "certificate_expiry_seconds{certificate=\"own\"}").await;
    assert!(near(own, 10 * DAY, issued), "own certificate: {own} s left");
    let ca = metric(&d, "certificate_expiry_seconds{certificate=\"ca\"}").await;
    assert!(
        near(ca, DEFAULT_CA_VALIDITY.as_secs(), ca_issued),
        "CA: {ca} s left"
    );

    // Within the default threshold (14 days): a WARN at start, and no ERROR.
    let warned = log_lines(&d.log, "WARN", "TLS certificate expires in");
    assert_eq!(
        warned.len(),
        1,
        "{}",
        std::fs::read_to_string(&d.log).unwrap()
    );
    assert!(warned[0].contains(host), "{}", warned[0]);
    assert!(says_days(&warned[0], 10), "{}", warned[0]);
    assert!(log_lines(&d.log, "ERROR", "certificate").is_empty());
    // The CA has years left: not warned about.
    assert!(log_lines(&d.log, "WARN", "CA bundle").is_empty());

    // Renewed for 90 days and reloaded on SIGHUP: the gauge follows the new certificate.
    let renewed_at = Instant::now();
    d.rotate_certificate().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let renewed = loop {
        let v = metric(&d, "certificate_expiry_seconds{certificate=\"own\"}").await;
        if v > 80 * DAY || Instant::now() > deadline {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        near(renewed, 90 * DAY, renewed_at),
        "renewed certificate: {renewed} s left"
    );
    assert_eq!(metric(&d, "tls_reloads_total").await, 1);
    let valid = log_lines(&d.log, "INFO", "TLS certificate valid for");
    assert_eq!(
        valid.len(),
        1,
        "{}",
        std::fs::read_to_string(&d.log).unwrap()
    );
    assert!(says_days(&valid[0], 90), "{}", valid[0]);
    assert_eq!(
        log_lines(&d.log, "WARN", "TLS certificate expires in").len(),
        1
    );
}

/// The controller's `/metrics` as an admin.
async fn controller_metrics(ctl: &ControllerProc) -> String {
    let (status, body) = ctl
        .http(HttpAs::Cert(Role::Admin), "GET", "/metrics", "")
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    body
}

/// The value of the sample `series` (`shardcast_…` with its labels) in the controller's
/// `/metrics`.
async fn controller_value(ctl: &ControllerProc, series: &str) -> i64 {
    let body = controller_metrics(ctl).await;
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{series} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in {body}"))
}

/// Handshakes with `client` at `addr` (ALPN `alpn`); where the client's side finished (TLS
/// 1.3 clients finish before the server's verdict), reads until the server closes.
async fn try_handshake(client: &TlsContext, addr: std::net::SocketAddr, alpn: Alpn) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    if let Ok((mut s, _)) = client
        .connect(tcp, alpn, &Expect::Role(Role::Controller))
        .await
    {
        let closed = closed_within(&mut s, Duration::from_secs(5)).await;
        assert!(closed, "the controller kept a foreign client's connection");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_gauges_its_certificate_and_counts_refused_handshakes() {
    let scratch = tempfile::tempdir().unwrap();
    let ca_issued = Instant::now();
    let pki = Arc::new(ClusterPki::new().unwrap());
    let issued = Instant::now();
    pki.issue_valid_for(
        Role::Controller,
        "controller",
        Duration::from_secs(20 * DAY),
    )
    .unwrap();
    // 20 days left is outside the default 14, inside the 30 configured here.
    let ctl = ControllerProc::start_with_pki(
        &scratch.path().join("ctl"),
        vec!["--cert-expiry-warning-s".into(), "30d".into()],
        pki.clone(),
    )
    .await
    .unwrap();

    let own = controller_value(
        &ctl,
        "shardcast_certificate_expiry_seconds{certificate=\"own\"}",
    )
    .await;
    assert!(
        near(own as u64, 20 * DAY, issued),
        "own certificate: {own} s left"
    );
    let ca = controller_value(
        &ctl,
        "shardcast_certificate_expiry_seconds{certificate=\"ca\"}",
    )
    .await;
    assert!(
        near(ca as u64, DEFAULT_CA_VALIDITY.as_secs(), ca_issued),
        "CA: {ca} s left"
    );
    let warned = log_lines(&ctl.log, "WARN", "TLS certificate expires in");
    assert_eq!(
        warned.len(),
        1,
        "{}",
        std::fs::read_to_string(&ctl.log).unwrap()
    );
    assert!(warned[0].contains("warning at 30d"), "{}", warned[0]);
    assert!(says_days(&warned[0], 20), "{}", warned[0]);

    // Certificates of a foreign CA, on the gRPC and the HTTP listener: refused in the
    // handshake, and counted.
    let refused = "shardcast_tls_handshakes_refused_total";
    let before = controller_value(&ctl, refused).await;
    let accepted_before = controller_value(&ctl, "shardcast_tls_handshakes_accepted_total").await;
    let foreign_pki = ClusterPki::new().unwrap();
    let foreign = TlsContext::load(foreign_pki.files(Role::Admin, "mallory").unwrap()).unwrap();
    try_handshake(&foreign, ctl.grpc, Alpn::Grpc).await;
    try_handshake(&foreign, ctl.http, Alpn::Http).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while controller_value(&ctl, refused).await < before + 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(controller_value(&ctl, refused).await, before + 2);
    // The scrapes themselves (an admin certificate of the cluster CA) are accepted.
    assert!(
        controller_value(&ctl, "shardcast_tls_handshakes_accepted_total").await > accepted_before
    );
    let body = controller_metrics(&ctl).await;
    for family in [
        "shardcast_tls_reloads_total",
        "shardcast_tls_reload_failures_total",
    ] {
        assert!(body.contains(&format!("\n{family} 0")), "{family}: {body}");
    }
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

/// The value of `shardcast_certificate_expiry_seconds{certificate="own"}` (signed) in a
/// daemon's `/metrics`.
async fn own_expiry(d: &Daemon) -> i64 {
    let body = d.metrics().await.unwrap();
    let series = format!(
        "shardcast_certificate_expiry_seconds{{host=\"{}\",certificate=\"own\"}} ",
        d.host_id
    );
    body.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series}in {body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transferd_with_an_expired_certificate_says_so_and_is_refused_until_renewed() {
    let scratch = tempfile::tempdir().unwrap();
    let pki = Arc::new(ClusterPki::new().unwrap());
    let ctl = ControllerProc::start_with_pki(&scratch.path().join("ctl"), vec![], pki.clone())
        .await
        .unwrap();
    let refused = "shardcast_tls_handshakes_refused_total";
    let refused_before = controller_value(&ctl, refused).await;

    // `notAfter` is now (a minute after `notBefore`): expired once its second has passed.
    let host = "expired-host";
    let files = pki
        .issue_valid_for(Role::Host, host, Duration::ZERO)
        .unwrap();
    let issued = Instant::now();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut opts = DaemonOpts::local(host);
    opts.pki = Some(pki.clone());
    // The admin endpoint on a Unix socket: over TCP it would serve the expired certificate,
    // and the test's scrapes would refuse it like any client.
    opts.admin_socket = Some(scratch.path().join("admin.sock"));
    // Heartbeats over TCP (mutual TLS), not the controller's Unix socket.
    opts.extra_args.extend([
        "--controller".into(),
        ctl.grpc.to_string(),
        "--heartbeat-ms".into(),
        "100".into(),
    ]);
    // It starts: the data plane keeps what it holds servable once the certificate is
    // renewed, which needs no restart.
    let d = Daemon::start(&scratch.path().join(host), opts)
        .await
        .unwrap();

    // An ERROR naming the certificate's file and its end, and no WARN about it.
    let log = || std::fs::read_to_string(&d.log).unwrap();
    let expired = log_lines(&d.log, "ERROR", "TLS certificate EXPIRED");
    assert_eq!(expired.len(), 1, "{}", log());
    assert!(
        expired[0].contains(&files.cert.display().to_string()),
        "{}",
        expired[0]
    );
    // `not_after` as x509-parser prints it (`Jun  1 12:00:00 2026 +00:00`); the field's
    // name and value may be apart (the log's colours).
    let der = first_cert(&std::fs::read(&files.cert).unwrap(), &files.cert).unwrap();
    let end = time::OffsetDateTime::from_unix_timestamp(not_after(&der).unwrap()).unwrap();
    let month = end.month().to_string();
    let date = format!(
        "{} {:>2} {:02}:{:02}:{:02} {} +00:00",
        &month[..3],
        end.day(),
        end.hour(),
        end.minute(),
        end.second(),
        end.year()
    );
    assert!(
        expired[0].contains("not_after") && expired[0].contains(&date),
        "{date}: {}",
        expired[0]
    );
    assert!(log_lines(&d.log, "WARN", "TLS certificate expires in").is_empty());
    // The gauge is negative: the seconds since `notAfter`.
    let own = own_expiry(&d).await;
    assert!(
        own < 0 && own.unsigned_abs() <= issued.elapsed().as_secs() + TOLERANCE,
        "own certificate: {own} s left"
    );

    // The controller refuses its heartbeats in the handshake: counted there, the host never
    // registers, and it stays not ready.
    until(
        "the controller refuses heartbeats",
        Duration::from_secs(10),
        || async { controller_value(&ctl, refused).await >= refused_before + 3 },
    )
    .await;
    let mut api = ctl.client().await.unwrap();
    let hosts = api
        .list_hosts(shardcast_protocol::controller::ListHostsRequest {})
        .await
        .unwrap()
        .into_inner()
        .hosts;
    assert!(
        hosts
            .iter()
            .all(|h| h.report.as_ref().is_none_or(|r| r.host_id != host)),
        "{hosts:?}"
    );
    let (status, body) = d.admin(HttpAs::Anonymous, "GET", "/readyz").await.unwrap();
    assert_eq!(status, 503, "{body}");
    // `refused the heartbeat (Cancelled)` or `(Unknown)`: how the refused handshake
    // reaches the gRPC client depends on when the alert arrives.
    assert!(body.contains("\ncontroller: the controller "), "{body}");
    // Logged once for the outage, not once per heartbeat.
    assert_eq!(
        log_lines(&d.log, "WARN", "controller rejected the heartbeat").len(),
        1,
        "{}",
        log()
    );

    // A peer with a valid certificate of the same CA refuses its data port.
    let peer = TlsContext::load(pki.files(Role::Host, "valid-peer").unwrap()).unwrap();
    let tcp = TcpStream::connect(d.data_addr).await.unwrap();
    let Err(err) = peer
        .connect(tcp, Alpn::Data, &Expect::Role(Role::Host))
        .await
    else {
        panic!("a peer completed a handshake with an expired certificate");
    };
    assert!(err.to_string().to_lowercase().contains("expired"), "{err}");
    // The host sees the peer's alert, and counts the refused connection.
    until(
        "the refusal is counted",
        Duration::from_secs(10),
        || async { metric(&d, "data_tls_refused_total").await == 1 },
    )
    .await;
    assert_eq!(
        log_lines(&d.log, "WARN", "refusing connection: TLS handshake failed").len(),
        1,
        "{}",
        log()
    );

    // Renewed and reloaded (SIGHUP), without a restart: the gauge turns positive, the next
    // heartbeat registers the host, and it turns ready.
    d.rotate_certificate().unwrap();
    until(
        "the renewed certificate is loaded",
        Duration::from_secs(15),
        || async { own_expiry(&d).await > 80 * DAY as i64 },
    )
    .await;
    wait_hosts_up(&ctl, 1, Duration::from_secs(15))
        .await
        .unwrap();
    until("the host turns ready", Duration::from_secs(15), || async {
        d.admin(HttpAs::Anonymous, "GET", "/readyz").await.unwrap() == (200, "ready\n".into())
    })
    .await;
    assert_eq!(
        log_lines(&d.log, "INFO", "TLS certificate valid for").len(),
        1,
        "{}",
        log()
    );
}
