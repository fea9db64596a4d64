//! Limits on the data port against a real daemon on loopback: peers silent after connect,
//! after `Hello`, mid-frame and mid-session are closed within their timeouts and counted; a connection
//! flood beyond the caps is refused while a peer from another address still gets in; a
//! peer inventing host ids in `Progress` frames does not grow a session's table.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use shardcast_protocol::agent::{Chain, Hop, StartChainRequest, Tier};
use shardcast_protocol::codec::Codec;
use shardcast_protocol::{ChunkSet, ErrorCode, Frame, HostId, SessionId};
use shardcast_tests::{Stream, TestCluster, hello, metric, tls_accept, tls_connect, tls_over};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// Reads until the daemon closes the connection; returns how long that took.
async fn time_to_close<S: AsyncRead + Unpin>(s: &mut S, limit: Duration) -> Duration {
    let start = Instant::now();
    let mut tmp = [0u8; 4096];
    loop {
        match tokio::time::timeout_at((start + limit).into(), s.read(&mut tmp)).await {
            Err(_) => panic!("connection still open after {limit:?}"),
            Ok(Ok(0) | Err(_)) => return start.elapsed(),
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_peers_are_closed_in_every_phase() {
    let c = TestCluster::start(1, 1 << 20, 1, |_, o| {
        o.extra_args.extend([
            "--handshake-timeout-ms".into(),
            "500".into(),
            "--peer-idle-timeout-s".into(),
            "1".into(),
        ]);
    })
    .await
    .unwrap();
    let d = &c.daemons[0];
    let limit = Duration::from_secs(5);

    // Silent after connect: the handshake timeout.
    let mut s = TcpStream::connect(d.data_addr).await.unwrap();
    let t = time_to_close(&mut s, limit).await;
    assert!(t >= Duration::from_millis(400), "closed after {t:?}");

    // Silent after the TLS handshake: the Hello timeout.
    let mut s = tls_connect(d.data_addr, "quiet").await.unwrap();
    let t = time_to_close(&mut s, limit).await;
    assert!(t >= Duration::from_millis(400), "closed after {t:?}");

    // Silent after Hello.
    let mut s = tls_connect(d.data_addr, "quiet").await.unwrap();
    s.write_all(&hello("quiet")).await.unwrap();
    let t = time_to_close(&mut s, limit).await;
    assert!(t >= Duration::from_millis(900), "closed after {t:?}");

    // Silent in the middle of a frame: a header announcing 1000 bytes, then 10 of them.
    let mut s = tls_connect(d.data_addr, "dribbler").await.unwrap();
    s.write_all(&hello("dribbler")).await.unwrap();
    s.write_all(&[0, 0, 3, 0xe8, 0x02]).await.unwrap();
    s.write_all(&[0u8; 10]).await.unwrap();
    time_to_close(&mut s, limit).await;

    // Silent in the middle of a session: Hello, Manifest, Open, Accept back, then nothing.
    let (_, manifest) = c.import_on_source().await.unwrap();
    let r = &c.daemons[1];
    let mut s = tls_connect(r.data_addr, "stalled-upstream").await.unwrap();
    let mut out = hello("stalled-upstream");
    Frame::Open(shardcast_tests::open_header(
        SessionId([9; 16]),
        manifest.digest(),
        &["stalled-upstream", "recv-1"],
    ))
    .encode(&mut out);
    // The session's manifest follows its Open (protocol v6).
    Frame::Manifest(manifest.clone()).encode(&mut out);
    s.write_all(&out).await.unwrap();
    let t = time_to_close(&mut s, limit).await;
    assert!(t >= Duration::from_millis(900), "closed after {t:?}");

    assert!(metric(d, "conn_handshake_timeouts_total").await >= 1);
    assert!(metric(d, "conn_idle_timeouts_total").await >= 2);
    assert!(metric(r, "conn_idle_timeouts_total").await >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_reading_is_dropped_when_writes_do_not_drain() {
    let c = TestCluster::start(0, 48 << 20, 1, |_, o| {
        o.extra_args
            .extend(["--write-timeout-s".into(), "1".into()]);
    })
    .await
    .unwrap();
    let (_, manifest) = c.import_on_source().await.unwrap();
    let d = &c.daemons[0];
    // Ask for every chunk of the largest shard, then never read.
    let (shard, entry) = manifest
        .shards
        .iter()
        .enumerate()
        .max_by_key(|(_, e)| e.size)
        .unwrap();
    let mut s = tls_connect(d.data_addr, "sink").await.unwrap();
    let mut out = hello("sink");
    Frame::Fetch {
        model: manifest.digest(),
        shard: shard as u32,
        start: 0,
        end: entry.chunks.len() as u32,
    }
    .encode(&mut out);
    s.write_all(&out).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while metric(d, "conn_write_timeouts_total").await == 0 {
        assert!(
            Instant::now() < deadline,
            "the stalled write was never dropped"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_beyond_the_cap_are_refused() {
    let c = TestCluster::start(1, 1 << 20, 1, |_, o| {
        o.extra_args.extend(["--max-sessions".into(), "2".into()]);
    })
    .await
    .unwrap();
    let (_, manifest) = c.import_on_source().await.unwrap();
    let r = &c.daemons[1];
    let mut conns = Vec::new();
    let mut refused = 0;
    for id in 1..=4u8 {
        let mut s = tls_connect(r.data_addr, "opener").await.unwrap();
        let mut out = hello("opener");
        Frame::Open(shardcast_tests::open_header(
            SessionId([id; 16]),
            manifest.digest(),
            &["opener", "recv-1"],
        ))
        .encode(&mut out);
        // The session's manifest follows its Open (protocol v6).
        Frame::Manifest(manifest.clone()).encode(&mut out);
        s.write_all(&out).await.unwrap();
        let mut buf = BytesMut::new();
        loop {
            match shardcast_tests::read_frame(&mut s, &mut buf)
                .await
                .expect("an answer to Open")
            {
                Frame::Accept { .. } => break,
                Frame::Error { message, .. } => {
                    assert!(message.contains("max_sessions"), "{message}");
                    refused += 1;
                    break;
                }
                _ => continue,
            }
        }
        conns.push(s);
    }
    assert_eq!(refused, 2);
    assert_eq!(metric(r, "sessions_refused_total").await, 2);
}

async fn connect_from(ip: [u8; 4], to: SocketAddr) -> std::io::Result<TcpStream> {
    let sock = TcpSocket::new_v4()?;
    sock.bind(SocketAddr::from((ip, 0)))?;
    sock.connect(to).await
}

/// The connection as an admitted peer: the TLS handshake completes and the daemon answers
/// `Hello`, rather than closing it at accept.
async fn admitted(tcp: TcpStream) -> Option<Stream> {
    let mut s = tokio::time::timeout(Duration::from_secs(5), tls_over(tcp, "peer"))
        .await
        .ok()?
        .ok()?;
    s.write_all(&hello("peer")).await.ok()?;
    let mut b = [0u8; 64];
    match tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await {
        Ok(Ok(n)) if n > 0 => Some(s),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_is_refused_while_another_peer_gets_in() {
    let c = TestCluster::start(0, 1 << 20, 1, |_, o| {
        o.extra_args.extend([
            "--max-connections-per-ip".into(),
            "4".into(),
            "--max-connections".into(),
            "6".into(),
        ]);
    })
    .await
    .unwrap();
    let d = &c.daemons[0];
    // 127.0.0.9 floods: four are admitted, the rest closed at once.
    let mut held = Vec::new();
    for _ in 0..4 {
        let s = connect_from([127, 0, 0, 9], d.data_addr).await.unwrap();
        held.push(admitted(s).await.expect("admitted"));
    }
    for _ in 0..10 {
        let s = connect_from([127, 0, 0, 9], d.data_addr).await.unwrap();
        assert!(
            admitted(s).await.is_none(),
            "a connection over the per-IP cap"
        );
    }
    // Another address still gets in, up to the total cap.
    let other = connect_from([127, 0, 0, 10], d.data_addr).await.unwrap();
    assert!(
        admitted(other).await.is_some(),
        "a legitimate peer is still served"
    );
    assert!(metric(d, "conn_refused_per_ip_cap_total").await >= 10);
    // Closing the flood gives the slots back.
    drop(held);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = connect_from([127, 0, 0, 9], d.data_addr).await.unwrap();
    assert!(admitted(again).await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invented_host_ids_do_not_grow_a_session() {
    let c = TestCluster::start(0, 1 << 20, 1, |_, _| {}).await.unwrap();
    let (digest, _) = c.import_on_source().await.unwrap();
    // A rogue downstream hop: accepts the session, then floods Progress from 5000 hosts.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let rogue = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut s = tls_accept(tcp, "rogue-hop").await.unwrap();
        let mut buf = BytesMut::new();
        s.write_all(&hello("rogue-hop")).await.unwrap();
        let (start, end) = loop {
            match shardcast_tests::read_frame(&mut s, &mut buf)
                .await
                .expect("Open")
            {
                Frame::Open(h) => break (h.start, h.end),
                _ => continue,
            }
        };
        let mut out = Vec::new();
        Frame::Accept {
            have: ChunkSet::new(start, end),
        }
        .encode(&mut out);
        for i in 0..5000 {
            Frame::Progress {
                host: HostId::new(format!("invented-{i}")).unwrap(),
                shard: 0,
                verified: 0,
                total: 1,
            }
            .encode(&mut out);
        }
        s.write_all(&out).await.unwrap();
        // Keep the connection open while the test looks at the daemon.
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    let mut req = StartChainRequest {
        model: digest,
        tier: Tier::Memory as i32,
        chains: vec![Chain {
            shards: vec![],
            hops: vec![Hop {
                host_id: "rogue-hop".into(),
                addr: addr.to_string(),
            }],
        }],
        ..Default::default()
    };
    c.daemons[0].sign_chain(&mut req, &[]).unwrap();
    c.daemons[0]
        .agent()
        .await
        .unwrap()
        .start_chain(req)
        .await
        .unwrap();
    let d = &c.daemons[0];
    let deadline = Instant::now() + Duration::from_secs(10);
    let dropped = loop {
        let n = metric(d, "progress_dropped_total").await;
        if n >= 5000 - 1024 || Instant::now() > deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(dropped >= 5000 - 1024, "dropped {dropped}");
    rogue.abort();
}

/// Polls the daemon's metric `name` until `ok` holds (or panics after 10 s).
async fn wait_metric(d: &shardcast_bench::cluster::Daemon, name: &str, ok: impl Fn(u64) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = metric(d, name).await;
        if ok(v) {
            return;
        }
        assert!(Instant::now() < deadline, "{name} = {v} after 10 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The body length of the largest chunk frame.
const LARGEST_CHUNK_BODY: usize = shardcast_protocol::manifest::MAX_CHUNK_SIZE as usize + 12;

/// Connects to `d`'s data port as host `name` and opens a session of `manifest` there with
/// a plan token naming both (`Open`, then the manifest), as a host of a genuine plan
/// would; returns the connection once `d` has accepted.
async fn open_session(
    d: &shardcast_bench::cluster::Daemon,
    name: &str,
    manifest: &shardcast_protocol::Manifest,
) -> shardcast_tests::Stream {
    let mut s = tls_connect(d.data_addr, name).await.unwrap();
    let mut out = hello(name);
    Frame::Open(shardcast_tests::open_header(
        shardcast_tests::session_id(),
        manifest.digest(),
        &[name, d.host_id.as_str()],
    ))
    .encode(&mut out);
    Frame::Manifest(manifest.clone()).encode(&mut out);
    s.write_all(&out).await.unwrap();
    let mut buf = BytesMut::new();
    loop {
        match shardcast_tests::read_frame(&mut s, &mut buf).await {
            Some(Frame::Accept { .. }) => return s,
            Some(Frame::Error { code, message }) => panic!("Open refused: {code:?} {message}"),
            Some(_) => {}
            None => panic!("no answer to the Open"),
        }
    }
}

/// The header of a chunk frame with a body of `body` bytes.
fn chunk_header(body: usize) -> Vec<u8> {
    let mut header = ((body + 1) as u32).to_be_bytes().to_vec();
    header.push(0x05); // Chunk
    header
}

/// Opens a session of `manifest` on `d` as host `name` ([`open_session`]) and announces a
/// chunk frame of [`LARGEST_CHUNK_BODY`] bytes of which it sends 10: the daemon grants
/// the body its room in the frame budget and waits for the rest. The connection is
/// returned, left open.
async fn announce_largest_chunk(
    d: &shardcast_bench::cluster::Daemon,
    name: &str,
    manifest: &shardcast_protocol::Manifest,
) -> shardcast_tests::Stream {
    let mut s = open_session(d, name, manifest).await;
    s.write_all(&chunk_header(LARGEST_CHUNK_BODY))
        .await
        .unwrap();
    s.write_all(&[0u8; 10]).await.unwrap();
    s
}

/// Before its `Open` is authorised a peer may send no large frame but the `Open`: a
/// chunk frame or a manifest announced right after `Hello` is refused from its header
/// (`ProtocolViolation`, counted), and nothing of the budget is granted to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_frames_before_an_authorised_open_are_refused_unread() {
    let c = TestCluster::start(1, 1 << 20, 1, |_, _| {}).await.unwrap();
    let d = &c.daemons[1];
    // A chunk of the largest size, and a 1 MiB manifest: each announced, 10 bytes sent.
    for (ty, body, name) in [
        (0x05u8, LARGEST_CHUNK_BODY, "Chunk"),
        (0x02, 1 << 20, "Manifest"),
    ] {
        let mut s = tls_connect(d.data_addr, "mallory").await.unwrap();
        s.write_all(&hello("mallory")).await.unwrap();
        let mut header = ((body + 1) as u32).to_be_bytes().to_vec();
        header.push(ty);
        s.write_all(&header).await.unwrap();
        s.write_all(&[0u8; 10]).await.unwrap();
        let refused = shardcast_tests::first_error(&mut s).await;
        let (code, message) = refused.unwrap_or_else(|| panic!("a {name} frame was taken"));
        assert_eq!(code, ErrorCode::ProtocolViolation, "{message}");
        assert!(
            message.contains(&format!(
                "a {name} frame of {body} bytes is not accepted here"
            )),
            "{message}"
        );
    }
    assert_eq!(metric(d, "conn_frames_not_admitted_total").await, 2);
    assert_eq!(metric(d, "frame_memory_bytes").await, 0);
    assert_eq!(metric(d, "frame_memory_waits_total").await, 0);
}

/// A peer whose `Open` was authorised announces the manifest that must follow and then
/// sends a byte a second (never silent long enough for the idle timeout, and no session
/// yet whose stall detection would drop it): it loses the connection once the frame's
/// time is up (10 s plus 1 s per MiB), and its room in the budget comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_frame_that_stops_progressing_is_dropped() {
    let c = TestCluster::start(1, 1 << 20, 1, |_, _| {}).await.unwrap();
    let (_, manifest) = c.import_on_source().await.unwrap();
    let d = &c.daemons[1];
    let mut s = tls_connect(d.data_addr, "dribbler").await.unwrap();
    let mut out = hello("dribbler");
    Frame::Open(shardcast_tests::open_header(
        SessionId([3; 16]),
        manifest.digest(),
        &["dribbler", "recv-1"],
    ))
    .encode(&mut out);
    let body = 1 << 20;
    out.extend_from_slice(&((body + 1) as u32).to_be_bytes());
    out.push(0x02); // Manifest
    s.write_all(&out).await.unwrap();
    let started = Instant::now();
    let mut sent = 0;
    let mut answer = None;
    let mut buf = BytesMut::new();
    while started.elapsed() < Duration::from_secs(30) {
        if s.write_all(&[0u8]).await.is_err() {
            break;
        }
        sent += 1;
        if sent == 1 {
            wait_metric(d, "frame_memory_bytes", |v| v >= body as u64).await;
        }
        // Frames the daemon sends meanwhile (none is expected) are skipped; an `Error` or
        // the end of the connection is the answer.
        let next = tokio::time::timeout(
            Duration::from_secs(1),
            shardcast_tests::read_frame(&mut s, &mut buf),
        );
        if let Ok(f @ (Some(Frame::Error { .. }) | None)) = next.await {
            answer = f;
            break;
        }
    }
    let waited = started.elapsed();
    let Some(Frame::Error { code, message }) = answer else {
        panic!("no refusal after {waited:?}: {answer:?}");
    };
    assert_eq!(code, ErrorCode::Refused, "{message}");
    assert!(
        message.contains(&format!(
            "a Manifest frame of {body} bytes did not arrive within 11"
        )),
        "{message}"
    );
    assert!(
        waited >= Duration::from_secs(10),
        "dropped after {waited:?}"
    );
    assert_eq!(metric(d, "conn_frame_timeouts_total").await, 1);
    assert_eq!(metric(d, "conn_idle_timeouts_total").await, 0);
    wait_metric(d, "frame_memory_bytes", |v| v == 0).await;
}

/// Frame bodies draw on one daemon-wide budget: two peers announcing the largest chunk
/// frame cannot make the daemon hold both; the second waits (counted) until the first
/// goes, and nothing stays charged when both are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_frames_share_one_memory_budget() {
    let c = TestCluster::start(1, 1 << 20, 1, |_, o| {
        o.extra_args
            .extend(["--frame-memory".into(), "17MiB".into()]);
    })
    .await
    .unwrap();
    let (_, manifest) = c.import_on_source().await.unwrap();
    let d = &c.daemons[1];
    assert_eq!(metric(d, "frame_memory_limit_bytes").await, 17 << 20);
    let body = LARGEST_CHUNK_BODY;
    let a = announce_largest_chunk(d, "big-a", &manifest).await;
    wait_metric(d, "frame_memory_bytes", |v| v >= body as u64).await;
    let b = announce_largest_chunk(d, "big-b", &manifest).await;
    wait_metric(d, "frame_memory_waits_total", |v| v == 1).await;
    assert!(metric(d, "frame_memory_bytes").await <= 17 << 20);
    drop(a);
    drop(b);
    wait_metric(d, "frame_memory_bytes", |v| v == 0).await;
    assert_eq!(metric(d, "frame_memory_waits_total").await, 1);
}

/// One peer — a host with a valid certificate, on many connections — cannot take the whole
/// frame budget: it may hold a quarter (at least the largest frame), its further frames
/// wait (counted), and another peer's frame still gets room at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_take_the_whole_frame_budget() {
    let c = TestCluster::start(1, 1 << 20, 1, |_, o| {
        o.extra_args
            .extend(["--frame-memory".into(), "256MiB".into()]);
    })
    .await
    .unwrap();
    let (_, manifest) = c.import_on_source().await.unwrap();
    let d = &c.daemons[1];
    let share = metric(d, "frame_memory_peer_limit_bytes").await;
    assert_eq!(share, 64 << 20, "a quarter of 256 MiB");
    let body = LARGEST_CHUNK_BODY;
    // Three frames of just over 16 MiB fit in mallory's 64 MiB share; the fourth waits on
    // the share, not on the budget.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(announce_largest_chunk(d, "mallory", &manifest).await);
    }
    wait_metric(d, "frame_memory_bytes", |v| v >= 3 * body as u64).await;
    held.push(announce_largest_chunk(d, "mallory", &manifest).await);
    wait_metric(d, "frame_memory_peer_waits_total", |v| v == 1).await;
    assert!(metric(d, "frame_memory_bytes").await <= share);
    // Another host is not held up by it.
    let other = announce_largest_chunk(d, "honest", &manifest).await;
    wait_metric(d, "frame_memory_bytes", |v| v >= 4 * body as u64).await;
    assert_eq!(metric(d, "frame_memory_waits_total").await, 0);
    assert_eq!(metric(d, "frame_memory_peer_waits_total").await, 1);
    drop(other);
    drop(held);
    wait_metric(d, "frame_memory_bytes", |v| v == 0).await;
}
