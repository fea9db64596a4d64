//! Mutual TLS over real loopback sockets: who gets in, who is refused, and reloads.

use std::time::Duration;

use shardcast_identity::pki::{CertFiles, IssueRequest, PkiDir};
use shardcast_identity::{Alpn, Expect, Identity, Role, TlsContext, TlsError, TlsFiles};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

struct Pki {
    _dir: tempfile::TempDir,
    pki: PkiDir,
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let pki = PkiDir::new(dir.path().join("pki"));
    pki.init("test CA", Duration::from_secs(3600)).unwrap();
    Pki { _dir: dir, pki }
}

fn files(p: &Pki, leaf: CertFiles) -> TlsFiles {
    TlsFiles {
        ca: p.pki.ca().cert,
        cert: leaf.cert,
        key: leaf.key,
    }
}

fn issue(p: &Pki, role: Role, name: &str) -> TlsFiles {
    let leaf = p
        .pki
        .issue(&IssueRequest::new(Identity::new(role, name).unwrap()))
        .unwrap();
    files(p, leaf)
}

/// Runs one accept on a loopback listener; returns what the server saw.
async fn serve_once(
    server: std::sync::Arc<TlsContext>,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<Result<Identity, TlsError>>,
) {
    serve_alpn(server, Alpn::Data).await
}

async fn serve_alpn(
    server: std::sync::Arc<TlsContext>,
    alpn: Alpn,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<Result<Identity, TlsError>>,
) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        let (mut s, id) = server.accept(tcp, alpn).await?;
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await.map_err(TlsError::Handshake)?;
        s.write_all(&buf).await.map_err(TlsError::Handshake)?;
        s.flush().await.map_err(TlsError::Handshake)?;
        Ok(id)
    });
    (addr, task)
}

#[tokio::test]
async fn members_connect_and_see_each_other() {
    let p = pki();
    let server = TlsContext::load_as(issue(&p, Role::Host, "h1"), Role::Host, Some("h1")).unwrap();
    let client = TlsContext::load(issue(&p, Role::Host, "h2")).unwrap();
    let (addr, task) = serve_once(server).await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let expect = Expect::Exactly(Identity::new(Role::Host, "h1").unwrap());
    let (mut s, id) = client.connect(tcp, Alpn::Data, &expect).await.unwrap();
    assert_eq!(id, Identity::new(Role::Host, "h1").unwrap());
    s.write_all(b"hello").await.unwrap();
    let mut buf = [0u8; 5];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"hello");
    let seen = task.await.unwrap().unwrap();
    assert_eq!(seen, Identity::new(Role::Host, "h2").unwrap());
}

#[tokio::test]
async fn a_certificate_for_another_role_is_refused_at_load() {
    let p = pki();
    let err = TlsContext::load_as(issue(&p, Role::Admin, "a"), Role::Host, None).unwrap_err();
    assert!(err.to_string().contains("names admin:a"), "{err}");
    let err = TlsContext::load_as(issue(&p, Role::Host, "h9"), Role::Host, Some("h1")).unwrap_err();
    assert!(err.to_string().contains("host:h9"), "{err}");
}

#[tokio::test]
async fn plaintext_and_certless_clients_are_refused_before_any_frame() {
    let p = pki();
    let server = TlsContext::load(issue(&p, Role::Host, "h1")).unwrap();
    // Plaintext bytes where a ClientHello should be.
    let (addr, task) = serve_once(server.clone()).await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"\0\0\0\x10\x01SHCS hello").await.unwrap();
    let err = task.await.unwrap().unwrap_err();
    assert!(matches!(err, TlsError::Handshake(_)), "{err}");
    // TLS but no client certificate.
    let (addr, task) = serve_alpn(server.clone(), Alpn::Http).await;
    let client = TlsContext::load(issue(&p, Role::Read, "r")).unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let r = client
        .connect_http_without_cert(tcp, &Expect::Role(Role::Host))
        .await;
    // TLS 1.3: the client may finish before the server's alert arrives; the server
    // always refuses.
    drop(r);
    let err = task.await.unwrap().unwrap_err();
    assert!(err.to_string().contains("certificate"), "{err}");
    assert!(
        server
            .stats
            .refused
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2
    );
}

#[tokio::test]
async fn another_ca_and_expired_certificates_are_refused() {
    let p = pki();
    let other = pki();
    let server = TlsContext::load(issue(&p, Role::Host, "h1")).unwrap();

    let (addr, task) = serve_once(server.clone()).await;
    let stranger = TlsContext::load(issue(&other, Role::Host, "h2")).unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let r = stranger
        .connect(tcp, Alpn::Data, &Expect::Role(Role::Host))
        .await;
    // The stranger also refuses our server: it does not chain to its CA.
    assert!(r.is_err());
    assert!(task.await.unwrap().is_err());

    let mut req = IssueRequest::new(Identity::new(Role::Host, "old").unwrap());
    req.not_before_offset = time::Duration::hours(-3);
    req.validity = Duration::ZERO; // not_after = now: expired by the time it is used
    let expired = p.pki.issue(&req).unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let expired = TlsContext::load(files(&p, expired)).unwrap();
    let (addr, task) = serve_once(server.clone()).await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let _ = expired
        .connect(tcp, Alpn::Data, &Expect::Role(Role::Host))
        .await;
    let err = task.await.unwrap().unwrap_err();
    assert!(err.to_string().to_lowercase().contains("expired"), "{err}");
}

#[tokio::test]
async fn the_wrong_server_identity_and_protocol_are_refused() {
    let p = pki();
    let server = TlsContext::load(issue(&p, Role::Host, "h1")).unwrap();
    let client = TlsContext::load(issue(&p, Role::Host, "h2")).unwrap();
    let (addr, _task) = serve_once(server.clone()).await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let expect = Expect::Exactly(Identity::new(Role::Host, "h3").unwrap());
    let err = client.connect(tcp, Alpn::Data, &expect).await.unwrap_err();
    assert!(
        matches!(&err, TlsError::WrongPeer { got, .. } if got.name == "h1"),
        "{err}"
    );
    // A gRPC client at the data port: ALPN mismatch.
    let (addr, task) = serve_once(server).await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    assert!(
        client
            .connect(tcp, Alpn::Grpc, &Expect::Role(Role::Host))
            .await
            .is_err()
    );
    assert!(task.await.unwrap().is_err());
}

#[tokio::test]
async fn an_authenticate_only_connection_carries_both_directions_in_the_clear_after_the_handshake()
{
    let p = pki();
    let server = TlsContext::load(issue(&p, Role::Host, "h1")).unwrap();
    let client = TlsContext::load(issue(&p, Role::Host, "h2")).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    // What each end sends right after the switch, large enough to span many TCP segments,
    // so any byte a TLS layer kept would show as a difference.
    let from_client: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 + 3) as u8).collect();
    let from_server: Vec<u8> = (0..300_000u32).map(|i| (i * 13 + 1) as u8).collect();
    let (fc, fs) = (from_client.clone(), from_server.clone());
    let task = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        let (mut raw, id) = server.accept_clear(tcp).await?;
        // The server writes at once, while the client writes too: neither waits.
        let (mut r, mut w) = raw.split();
        let write = async {
            w.write_all(&fs).await?;
            w.flush().await
        };
        let mut got = vec![0u8; fc.len()];
        let (wrote, read) = tokio::join!(write, r.read_exact(&mut got));
        wrote.map_err(TlsError::Handshake)?;
        read.map_err(TlsError::Handshake)?;
        Ok::<_, TlsError>((id, got))
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    let expect = Expect::Exactly(Identity::new(Role::Host, "h1").unwrap());
    let (mut raw, id) = client.connect_clear(tcp, &expect).await.unwrap();
    assert_eq!(id, Identity::new(Role::Host, "h1").unwrap());
    let (mut r, mut w) = raw.split();
    let mut got = vec![0u8; from_server.len()];
    let (wrote, read) = tokio::join!(w.write_all(&from_client), r.read_exact(&mut got));
    wrote.unwrap();
    read.unwrap();
    assert!(got == from_server, "the server's clear bytes differ");
    let (seen, got) = task.await.unwrap().unwrap();
    assert_eq!(seen, Identity::new(Role::Host, "h2").unwrap());
    assert!(got == from_client, "the client's clear bytes differ");
}

#[tokio::test]
async fn the_two_data_modes_refuse_each_other_by_name_and_count_it() {
    let p = pki();
    let server = TlsContext::load(issue(&p, Role::Host, "h1")).unwrap();
    let client = TlsContext::load(issue(&p, Role::Host, "h2")).unwrap();
    // An authenticate-only client at an encrypting data port.
    let (addr, task) = serve_once(server.clone()).await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let err = client
        .connect_clear(tcp, &Expect::Role(Role::Host))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TlsError::AlpnMismatch {
                ours: "shardcast-clear/1"
            }
        ),
        "{err}"
    );
    let err = task.await.unwrap().unwrap_err();
    assert!(
        matches!(
            err,
            TlsError::AlpnMismatch {
                ours: "shardcast/1"
            }
        ),
        "{err}"
    );
    // An encrypting client at an authenticate-only port.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let srv = server.clone();
    let task = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        srv.accept_clear(tcp).await.map(|(_, id)| id)
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    let err = client
        .connect(tcp, Alpn::Data, &Expect::Role(Role::Host))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TlsError::AlpnMismatch {
                ours: "shardcast/1"
            }
        ),
        "{err}"
    );
    assert!(matches!(
        task.await.unwrap().unwrap_err(),
        TlsError::AlpnMismatch { .. }
    ));
    let count = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(count(&server.stats.alpn_mismatches), 2);
    assert_eq!(count(&client.stats.alpn_mismatches), 2);
}

#[tokio::test]
async fn rotation_is_picked_up_and_a_broken_file_keeps_the_old_certificate() {
    let p = pki();
    let f = issue(&p, Role::Host, "h1");
    let ctx = TlsContext::load(f.clone()).unwrap();
    assert!(!ctx.reload_if_changed().unwrap());
    p.pki
        .rotate(
            &CertFiles {
                cert: f.cert.clone(),
                key: f.key.clone(),
            },
            Duration::from_secs(600),
        )
        .unwrap();
    assert!(ctx.reload_if_changed().unwrap());
    std::fs::write(&f.cert, "not a certificate").unwrap();
    assert!(ctx.reload_if_changed().is_err());
    assert_eq!(ctx.identity(), Identity::new(Role::Host, "h1").unwrap());
    // Still serves with the previous certificate.
    let client = TlsContext::load(issue(&p, Role::Host, "h2")).unwrap();
    let (addr, task) = serve_once(ctx).await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut s, _) = client
        .connect(tcp, Alpn::Data, &Expect::Role(Role::Host))
        .await
        .unwrap();
    s.write_all(b"again").await.unwrap();
    let mut buf = [0u8; 5];
    s.read_exact(&mut buf).await.unwrap();
    assert!(task.await.unwrap().is_ok());
}

/// Both directions of a `tls`-mode data connection whose records the record layer reads
/// and writes (both ends offer `shardcast-rec/1`): 1 MB one way and 300 KB the other at
/// once, byte-exact, then `close_notify` ends the client's reads cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_connection_on_the_record_layer_carries_both_directions_and_closes_cleanly() {
    use shardcast_identity::DataConn;
    let p = pki();
    let server = TlsContext::load(issue(&p, Role::Host, "h1")).unwrap();
    let client = TlsContext::load(issue(&p, Role::Host, "h2")).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let from_client: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 + 3) as u8).collect();
    let from_server: Vec<u8> = (0..300_000u32).map(|i| (i * 13 + 1) as u8).collect();
    let (fc, fs) = (from_client.clone(), from_server.clone());
    let task = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        let (conn, id) = server.accept_data(tcp).await?;
        let DataConn::Records(mut r, mut w) = conn else {
            panic!("two current hosts fell back to rustls's stream");
        };
        let write = async {
            w.write_all(&fs).await?;
            w.shutdown().await
        };
        let mut got = vec![0u8; fc.len()];
        let (wrote, read) = tokio::join!(write, r.read_exact(&mut got));
        wrote.map_err(TlsError::Handshake)?;
        read.map_err(TlsError::Handshake)?;
        Ok::<_, TlsError>((id, got))
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    let expect = Expect::Exactly(Identity::new(Role::Host, "h1").unwrap());
    let (conn, id) = client.connect_data(tcp, &expect).await.unwrap();
    assert_eq!(id, Identity::new(Role::Host, "h1").unwrap());
    let DataConn::Records(mut r, mut w) = conn else {
        panic!("two current hosts fell back to rustls's stream");
    };
    let mut got = vec![0u8; from_server.len()];
    let (wrote, read) = tokio::join!(
        async {
            w.write_all(&from_client).await?;
            w.flush().await
        },
        r.read_exact(&mut got)
    );
    wrote.unwrap();
    read.unwrap();
    assert!(got == from_server, "the server's bytes differ");
    // The server shut its half down with close_notify: a clean end of stream.
    let mut more = [0u8; 1];
    assert_eq!(r.read(&mut more).await.unwrap(), 0);
    let (seen, got) = task.await.unwrap().unwrap();
    assert_eq!(seen, Identity::new(Role::Host, "h2").unwrap());
    assert!(got == from_client, "the client's bytes differ");
}

/// A host that offers only `shardcast/1` (rustls's stream, as hosts before the record
/// layer) still reaches a current host, and a current host still reaches it: the data
/// connection falls back to rustls on both sides, and carries bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_without_the_record_layer_still_connects_both_ways() {
    use shardcast_identity::DataConn;
    let p = pki();
    let new = TlsContext::load(issue(&p, Role::Host, "h1")).unwrap();
    let old = TlsContext::load(issue(&p, Role::Host, "h2")).unwrap();
    // An old client at a current server.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let srv = new.clone();
    let task = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        let (conn, _) = srv.accept_data(tcp).await.unwrap();
        let DataConn::Rustls(mut s) = conn else {
            panic!("an old client got the record layer");
        };
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await.unwrap();
        s.write_all(&buf).await.unwrap();
        s.flush().await.unwrap();
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut s, _) = old
        .connect(tcp, Alpn::Data, &Expect::Role(Role::Host))
        .await
        .unwrap();
    s.write_all(b"ping").await.unwrap();
    s.flush().await.unwrap();
    let mut back = [0u8; 4];
    s.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"ping");
    task.await.unwrap();
    // A current client at an old server.
    let (addr, task) = serve_once(old.clone()).await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (conn, _) = new
        .connect_data(tcp, &Expect::Role(Role::Host))
        .await
        .unwrap();
    let DataConn::Rustls(mut s) = conn else {
        panic!("an old server got the record layer");
    };
    s.write_all(b"hello").await.unwrap();
    s.flush().await.unwrap();
    task.await.unwrap().unwrap();
}

/// The record layer speaks standard TLS 1.3 records: a client that keeps rustls's own
/// stream after negotiating `shardcast-rec/1` reads the server's records (its marker, then
/// data) and the server's record layer reads what rustls sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_layer_and_rustls_read_each_others_records() {
    use shardcast_identity::DataConn;
    let p = pki();
    let server = TlsContext::load(issue(&p, Role::Host, "h1")).unwrap();
    let client = TlsContext::load(issue(&p, Role::Host, "h2")).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let from_client: Vec<u8> = (0..100_000u32).map(|i| (i * 5 + 1) as u8).collect();
    let from_server: Vec<u8> = (0..50_000u32).map(|i| (i * 3 + 2) as u8).collect();
    let (fc, fs) = (from_client.clone(), from_server.clone());
    let task = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        let (conn, _) = server.accept_data(tcp).await.unwrap();
        let DataConn::Records(mut r, mut w) = conn else {
            panic!("the client offered shardcast-rec/1 first");
        };
        let mut got = vec![0u8; fc.len()];
        r.read_exact(&mut got).await.unwrap();
        assert!(got == fc, "rustls's records read back differently");
        w.write_all(&fs).await.unwrap();
        w.flush().await.unwrap();
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut s, _) = client
        .connect(tcp, Alpn::DataRecords, &Expect::Role(Role::Host))
        .await
        .unwrap();
    s.flush().await.unwrap();
    let mut marker = [0u8; 40];
    s.read_exact(&mut marker).await.unwrap();
    assert_eq!(&marker[..8], b"SCREC001");
    s.write_all(&from_client).await.unwrap();
    s.flush().await.unwrap();
    let mut got = vec![0u8; from_server.len()];
    s.read_exact(&mut got).await.unwrap();
    assert!(
        got == from_server,
        "the record layer's records read back differently"
    );
    task.await.unwrap();
}
