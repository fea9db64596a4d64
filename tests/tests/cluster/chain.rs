//! Multi-process chain tests on loopback: real transferd processes, real sockets. The
//! chain and failure tests run twice, with the hops dialling each other over TCP (`tcp::`)
//! and over QUIC (`quic::`).

use std::time::Duration;

use shardcast_bench::cluster::DaemonOpts;
use shardcast_protocol::HopTransport;
use shardcast_protocol::agent::{ImportModelRequest, StartChainRequest, Tier};
use shardcast_tests::{TestCluster, metric};

const MIB: u64 = 1 << 20;

/// Daemon options that cap every receiver's ingress at `rate`, so transfers take long
/// enough to interrupt mid-way.
fn cap_receivers(rate: &'static str) -> impl FnMut(usize, &mut DaemonOpts) {
    move |i, o| {
        if i > 0 {
            o.ingress_rate = rate.into();
        }
    }
}

async fn chain_of_eight_receivers_is_byte_exact(transport: HopTransport) {
    let mut c = TestCluster::start(8, 48 * MIB, 3, |_, _| {}).await.unwrap();
    c.transport = transport;
    let (digest, manifest) = c.import_on_source().await.unwrap();
    c.start_chain(0, &digest, &[1, 2, 3, 4, 5, 6, 7, 8], &c.origin_uri)
        .await
        .unwrap();
    c.wait(&[1, 2, 3, 4, 5, 6, 7, 8], &digest, Duration::from_secs(120))
        .await
        .unwrap();
    for d in &c.daemons[1..] {
        d.verify_copy(&manifest).unwrap();
        let stats = d.stats().await.unwrap();
        assert_eq!(stats.chunks_corrupt, 0);
        // Each receiver got the model once: no duplicate traffic in a healthy chain.
        assert!(
            stats.bytes_received < manifest.total_bytes() + manifest.total_bytes() / 20,
            "{stats:?}"
        );
    }
    // Over TCP every hop's TLS records were read and written by transferd's record layer
    // (identity::records), none by rustls's stream: all hosts run this version.
    if transport == HopTransport::Tcp {
        for d in &c.daemons[1..] {
            assert!(metric(d, "tls_record_layer_connections_total").await >= 1);
            assert_eq!(metric(d, "tls_rustls_stream_connections_total").await, 0);
        }
    }
}

/// Chains daemons 1..=3 behind the source with `fallback` as the session's fallback
/// source, kills the source once daemon 1 holds 4 MiB, and checks that every hop still ends
/// with a verified copy.
async fn kill_head_mid_chain(
    c: &mut TestCluster,
    digest: &str,
    manifest: &shardcast_protocol::Manifest,
    fallback: &str,
) {
    c.start_chain(0, digest, &[1, 2, 3], fallback)
        .await
        .unwrap();
    c.wait_bytes(1, digest, 4 * MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[0].kill().await;
    c.wait(&[1, 2, 3], digest, Duration::from_secs(120))
        .await
        .unwrap();
    for i in 1..=3 {
        c.daemons[i].verify_copy(manifest).unwrap();
    }
}

async fn middle_hop_killed_mid_transfer_others_complete(transport: HopTransport) {
    // 200 Mbit/s per daemon: 48 MiB takes ~2 s, leaving time to kill a hop mid-way.
    let mut c = TestCluster::start(5, 48 * MIB, 2, cap_receivers("200Mbit"))
        .await
        .unwrap();
    c.transport = transport;
    let (digest, manifest) = c.import_on_source().await.unwrap();
    c.start_chain(0, &digest, &[1, 2, 3, 4, 5], &c.origin_uri)
        .await
        .unwrap();
    c.wait_bytes(3, &digest, 8 * MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[2].kill().await;
    c.wait(&[1, 3, 4, 5], &digest, Duration::from_secs(120))
        .await
        .unwrap();
    for i in [1, 3, 4, 5] {
        c.daemons[i].verify_copy(&manifest).unwrap();
    }
    assert!(c.daemons[1].stats().await.unwrap().downstream_failovers >= 1);
}

/// A striped chain (`--stripes 3` on the head): each shard crosses every hop as three
/// sessions over three connections, the hops below following the head's ranges; a hop
/// killed mid-way is bypassed stripe by stripe like any other, and every surviving copy is
/// byte-exact. The head's status adds the stripes up per host and shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_striped_chain_survives_a_killed_middle_hop_and_reports_per_shard() {
    let mut caps = cap_receivers("200Mbit");
    let mut c = TestCluster::start(4, 48 * MIB, 2, move |i, o| {
        caps(i, o);
        if i == 0 {
            o.extra_args.extend(["--stripes".into(), "3".into()]);
        }
    })
    .await
    .unwrap();
    let (digest, manifest) = c.import_on_source().await.unwrap();
    let id = c
        .start_chain(0, &digest, &[1, 2, 3, 4], &c.origin_uri)
        .await
        .unwrap();
    c.wait_bytes(3, &digest, 8 * MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[2].kill().await;
    c.wait(&[1, 3, 4], &digest, Duration::from_secs(120))
        .await
        .unwrap();
    for i in [1, 3, 4] {
        c.daemons[i].verify_copy(&manifest).unwrap();
        // Three stripes of each of the two shards reached every hop as sessions of their
        // own (the bypassed hops below the killed one may have taken more).
        let st = c.daemons[i].stats().await.unwrap();
        assert!(st.sessions_total >= 6, "{}: {st:?}", c.daemons[i].host_id);
        assert_eq!(st.chunks_corrupt, 0);
    }
    let mut agent = c.daemons[0].agent().await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let s = shardcast_tests::session_status(&mut agent, &id).await;
        let mut keys: Vec<(String, u32)> = s
            .hops
            .iter()
            .map(|h| (h.host_id.clone(), h.shard))
            .collect();
        let n = keys.len();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), n, "one entry per host and shard: {s:?}");
        let whole = |h: &shardcast_protocol::agent::HopProgress| {
            h.total == manifest.shards[h.shard as usize].chunks.len() as u32
        };
        if s.state != "running" {
            // The hop next to the head reported every stripe to the end: its entry per
            // shard covers the whole shard. (The session itself says it lost recv-2.)
            let next: Vec<_> = s.hops.iter().filter(|h| h.host_id == "recv-1").collect();
            assert_eq!(next.len(), manifest.shards.len(), "{s:?}");
            assert!(
                next.iter().all(|h| whole(h) && h.verified == h.total),
                "{s:?}"
            );
            assert!(s.state == "done" || s.error.contains("recv-2"), "{s:?}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn head_killed_hops_recover_from_origin(transport: HopTransport) {
    let mut c = TestCluster::start(3, 32 * MIB, 1, cap_receivers("100Mbit"))
        .await
        .unwrap();
    c.transport = transport;
    let (digest, manifest) = c.import_on_source().await.unwrap();
    let origin = c.origin_uri.clone();
    kill_head_mid_chain(&mut c, &digest, &manifest, &origin).await;
}

async fn corrupt_chunk_in_flight_is_detected_and_resent(transport: HopTransport) {
    let mut c = TestCluster::start(3, 16 * MIB, 2, |i, o| {
        if i == 0 {
            o.env
                .push(("SHARDCAST_ENABLE_FAULT_INJECTION".into(), "1".into()));
            o.env
                .push(("SHARDCAST_FAULT_CORRUPT".into(), "0:3,1:5".into()));
        }
    })
    .await
    .unwrap();
    c.transport = transport;
    let (digest, manifest) = c.import_on_source().await.unwrap();
    c.start_chain(0, &digest, &[1, 2, 3], &c.origin_uri)
        .await
        .unwrap();
    c.wait(&[1, 2, 3], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    for d in &c.daemons[1..] {
        d.verify_copy(&manifest).unwrap();
    }
    assert_eq!(
        c.daemons[1].stats().await.unwrap().chunks_corrupt,
        2,
        "recv-1 must have caught both corrupted chunks"
    );
    assert_eq!(
        c.daemons[2].stats().await.unwrap().chunks_corrupt,
        0,
        "corruption must not propagate"
    );
}

async fn restarted_receiver_resumes_without_refetching_verified_chunks(transport: HopTransport) {
    let total = 32 * MIB;
    let mut c = TestCluster::start(1, total, 1, cap_receivers("100Mbit"))
        .await
        .unwrap();
    c.transport = transport;
    let (digest, manifest) = c.import_on_source().await.unwrap();
    c.start_chain(0, &digest, &[1], "").await.unwrap();
    c.wait_bytes(1, &digest, 12 * MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[1].restart().await.unwrap();
    let kept = c.verified_bytes(1, &digest).await.unwrap();
    assert!(
        kept >= 10 * MIB,
        "the restarted store must recover its verified chunks, kept {kept}"
    );
    c.start_chain(0, &digest, &[1], "").await.unwrap();
    c.wait(&[1], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[1].verify_copy(&manifest).unwrap();
    let received = c.daemons[1].stats().await.unwrap().bytes_received;
    assert!(
        received <= total - kept + 2 * MIB,
        "resent verified chunks: received {received} after keeping {kept}"
    );
}

/// A copy left by a restart (part of the model, no session feeding it) answers a `Fetch`
/// with every chunk it holds and then `NotReceiving`, so a recovering hop moves on to its
/// next source at once; a complete copy ends the same answer with `Done`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_copy_that_receives_nothing_answers_a_fetch_with_not_receiving() {
    use shardcast_protocol::codec::Codec;
    use shardcast_protocol::{ErrorCode, Frame};
    use tokio::io::AsyncWriteExt;

    let total = 16 * MIB;
    let mut c = TestCluster::start(1, total, 1, cap_receivers("50Mbit"))
        .await
        .unwrap();
    let (digest, manifest) = c.import_on_source().await.unwrap();
    c.start_chain(0, &digest, &[1], "").await.unwrap();
    c.wait_bytes(1, &digest, 3 * MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[1].restart().await.unwrap();
    let kept = c.verified_bytes(1, &digest).await.unwrap();
    assert!(kept > 0 && kept < total, "kept {kept} of {total}");
    let chunks = manifest.shards[0].chunks.len() as u32;
    let model = manifest.digest();
    // Pull the whole shard from each host as a peer with a host certificate would.
    let pull = move |addr| async move {
        let mut s = shardcast_tests::tls_connect(addr, "puller").await.unwrap();
        let mut out = shardcast_tests::hello("puller");
        Frame::Fetch {
            model,
            shard: 0,
            start: 0,
            end: chunks,
        }
        .encode(&mut out);
        s.write_all(&out).await.unwrap();
        let (mut buf, mut got) = (bytes::BytesMut::new(), 0u32);
        loop {
            match shardcast_tests::read_frame(&mut s, &mut buf).await {
                Some(Frame::Hello { .. }) => {}
                Some(Frame::Chunk { .. }) => got += 1,
                other => return (got, other),
            }
        }
    };
    let (got, end) = pull(c.daemons[1].data_addr).await;
    assert!(
        matches!(
            end,
            Some(Frame::Error {
                code: ErrorCode::NotReceiving,
                ..
            })
        ),
        "the partial holder ended its answer with {end:?}"
    );
    let held = u32::try_from(kept.div_ceil(u64::from(manifest.chunk_size))).unwrap();
    assert!(got > 0 && got < chunks, "sent {got} of {chunks} chunks");
    assert!(got.abs_diff(held) <= 1, "sent {got}, holds about {held}");
    assert_eq!(
        metric(&c.daemons[1], "fetches_not_receiving_total").await,
        1
    );
    let (got, end) = pull(c.daemons[0].data_addr).await;
    assert!(
        matches!(end, Some(Frame::Done)),
        "the source ended with {end:?}"
    );
    assert_eq!(got, chunks);
    assert_eq!(
        metric(&c.daemons[0], "fetches_not_receiving_total").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors() {
    let c = TestCluster::start(1, 4 * MIB, 1, |_, _| {}).await.unwrap();
    let mut agent = c.daemons[0].agent().await.unwrap();
    let err = agent
        .import_model(ImportModelRequest {
            name: "../x".into(),
            origin: c.origin_uri.clone(),
            chunk_size: 0,
            tier: Tier::Memory as i32,
            fetch: false,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains(".."), "{}", err.message());

    let err = agent
        .start_chain(StartChainRequest {
            model: "00".repeat(32),
            chains: vec![],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(err.message().contains("unknown"), "{}", err.message());

    let err = agent
        .import_model(ImportModelRequest {
            name: "m".into(),
            origin: "ftp://x/y".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
}

async fn shards_striped_over_two_chains_run_concurrently(transport: HopTransport) {
    use shardcast_protocol::agent::Chain;
    let mut c = TestCluster::start(3, 24 * MIB, 2, |_, _| {}).await.unwrap();
    c.transport = transport;
    let (digest, manifest) = c.import_on_source().await.unwrap();
    let hops = |order: &[usize]| {
        order
            .iter()
            .map(|&i| c.daemons[i].hop())
            .collect::<Vec<_>>()
    };
    let mut req = StartChainRequest {
        model: digest.clone(),
        origin: c.origin_uri.clone(),
        tier: Tier::Memory as i32,
        chains: vec![
            Chain {
                shards: vec![0, 2],
                hops: hops(&[1, 2, 3]),
            },
            Chain {
                shards: vec![1],
                hops: hops(&[3, 2, 1]),
            },
        ],
        transport: shardcast_protocol::agent::Transport::from(transport) as i32,
        ..Default::default()
    };
    c.daemons[0].sign_chain(&mut req, &[]).unwrap();
    let mut agent = c.daemons[0].agent().await.unwrap();
    let id = agent
        .start_chain(req)
        .await
        .unwrap()
        .into_inner()
        .session_id;
    c.wait(&[1, 2, 3], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    for d in &c.daemons[1..] {
        d.verify_copy(&manifest).unwrap();
    }
    // The head reports the session done, with progress relayed from every hop.
    let mut state = String::new();
    for _ in 0..100 {
        let s = shardcast_tests::session_status(&mut agent, &id).await;
        state = s.state.clone();
        if state == "done" {
            let hosts: std::collections::BTreeSet<_> =
                s.hops.iter().map(|h| h.host_id.clone()).collect();
            assert_eq!(hosts.len(), 3, "{s:?}");
            assert!(s.hops.iter().all(|h| h.verified == h.total), "{s:?}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(state, "done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_cap_holds_under_concurrent_sessions() {
    // The source's egress is capped at 200 Mbit/s (25 MB/s) and serves three receivers at
    // once, each over one session per shard: 3 x 16 MiB must take at least 48 MiB / 25 MB/s
    // (less the limiter's 20 ms burst), and the cap must not collapse under many sessions.
    let c = TestCluster::start(3, 16 * MIB, 2, |i, o| {
        if i == 0 {
            o.egress_rate = "200Mbit".into();
        }
    })
    .await
    .unwrap();
    let (digest, manifest) = c.import_on_source().await.unwrap();
    let bytes = 3 * manifest.total_bytes();
    let floor = bytes as f64 / 25e6 - 0.05;
    let mut agent = c.daemons[0].agent().await.unwrap();
    let t0 = std::time::Instant::now();
    let mut req = StartChainRequest {
        model: digest.clone(),
        tier: Tier::Memory as i32,
        chains: (1..=3)
            .map(|i| shardcast_protocol::agent::Chain {
                shards: vec![],
                hops: vec![c.daemons[i].hop()],
            })
            .collect(),
        ..Default::default()
    };
    c.daemons[0].sign_chain(&mut req, &[]).unwrap();
    agent.start_chain(req).await.unwrap();
    c.wait(&[1, 2, 3], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    let took = t0.elapsed().as_secs_f64();
    assert!(
        took >= floor,
        "egress cap exceeded: {bytes} bytes in {took:.2}s (floor {floor:.2}s)"
    );
    assert!(
        took <= floor * 2.5,
        "the cap collapsed under concurrent sessions: {took:.2}s vs {floor:.2}s"
    );
    for d in &c.daemons[1..] {
        d.verify_copy(&manifest).unwrap();
    }
}

async fn head_killed_hops_recover_from_another_holder(transport: HopTransport) {
    // Daemon 4 also holds the model; the session names it as the fallback source
    // (`shardcast://addr`), so when the head dies the hops pull from it, not the origin.
    let mut c = TestCluster::start(4, 32 * MIB, 1, cap_receivers("100Mbit"))
        .await
        .unwrap();
    c.transport = transport;
    let (digest, manifest) = c.import_on_source().await.unwrap();
    let mut holder = c.daemons[4].agent().await.unwrap();
    holder
        .import_model(ImportModelRequest {
            name: "test/model".into(),
            origin: c.origin_uri.clone(),
            chunk_size: c.chunk_size,
            tier: Tier::Disk as i32,
            fetch: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let fallback = format!("shardcast://{}", c.daemons[4].data_addr);
    kill_head_mid_chain(&mut c, &digest, &manifest, &fallback).await;
    for i in 1..=3 {
        assert_eq!(
            c.daemons[i].stats().await.unwrap().origin_bytes,
            0,
            "recv-{i} must not touch the origin"
        );
    }
    assert!(
        c.daemons[4].stats().await.unwrap().bytes_sent > 0,
        "the holder served the missing chunks"
    );
}

/// Chunks cross the hops below the first in verified pieces (protocol 7): each hop checks
/// every piece against the manifest's hash as it lands and forwards it at once. A piece
/// corrupted in flight by a middle hop is caught by the next hop, which refuses the chunk
/// (`Nack` after its last piece) and gets it again whole; nothing corrupt goes further.
/// With `pieces` off, the same chain sends whole chunks only.
async fn chunks_cross_hops_in_verified_pieces(transport: HopTransport) {
    let mut c = TestCluster::start(4, 24 * MIB, 2, |i, o| {
        if i == 2 {
            o.env
                .push(("SHARDCAST_ENABLE_FAULT_INJECTION".into(), "1".into()));
            o.env
                .push(("SHARDCAST_FAULT_CORRUPT".into(), "0:6,1:9".into()));
        }
    })
    .await
    .unwrap();
    c.transport = transport;
    c.chunk_size = 1 << 20;
    let (digest, manifest) = c.import_on_source().await.unwrap();
    c.start_chain(0, &digest, &[1, 2, 3, 4], &c.origin_uri)
        .await
        .unwrap();
    c.wait(&[1, 2, 3, 4], &digest, Duration::from_secs(90))
        .await
        .unwrap();
    let chunks = manifest.total_chunks();
    let mut st = Vec::new();
    for d in &c.daemons {
        st.push(d.stats().await.unwrap());
    }
    for d in &c.daemons[1..] {
        d.verify_copy(&manifest).unwrap();
    }
    // Hop 1 verified what the source sent piece by piece (its CVs were worked out as its
    // hash was), so everything below it can go in pieces.
    for (i, s) in st.iter().enumerate().take(4).skip(1) {
        assert!(
            s.chunks_sent_in_pieces * 2 >= chunks,
            "daemon {i} sent {} of {chunks} chunks in pieces: {s:?}",
            s.chunks_sent_in_pieces
        );
    }
    for (i, s) in st.iter().enumerate().skip(2) {
        assert!(
            s.chunks_received_in_pieces * 2 >= chunks,
            "daemon {i} received {} of {chunks} chunks in pieces: {s:?}",
            s.chunks_received_in_pieces
        );
    }
    assert_eq!(
        st[3].chunks_corrupt, 2,
        "hop 3 caught both bad pieces: {:?}",
        st[3]
    );
    assert_eq!(st[4].chunks_corrupt, 0, "corruption must not propagate");
    assert!(metric(&c.daemons[3], "chunks_received_in_pieces_total").await >= 1);

    // Off: whole chunks only.
    let mut c = TestCluster::start(2, 8 * MIB, 1, |_, o| {
        o.env.push(("SHARDCAST_PIECES".into(), "false".into()));
    })
    .await
    .unwrap();
    c.transport = transport;
    c.chunk_size = 1 << 20;
    let (digest, manifest) = c.import_on_source().await.unwrap();
    c.start_chain(0, &digest, &[1, 2], &c.origin_uri)
        .await
        .unwrap();
    c.wait(&[1, 2], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    for d in &c.daemons[1..] {
        d.verify_copy(&manifest).unwrap();
        let s = d.stats().await.unwrap();
        assert_eq!(s.chunks_received_in_pieces, 0, "{s:?}");
    }
}

shardcast_tests::over_each_transport!(
    chain_of_eight_receivers_is_byte_exact,
    chunks_cross_hops_in_verified_pieces,
    middle_hop_killed_mid_transfer_others_complete,
    head_killed_hops_recover_from_origin,
    corrupt_chunk_in_flight_is_detected_and_resent,
    restarted_receiver_resumes_without_refetching_verified_chunks,
    shards_striped_over_two_chains_run_concurrently,
    head_killed_hops_recover_from_another_holder,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_without_a_tls_identity_is_refused_with_the_reason() {
    // Plaintext daemons (loopback only) have no certificate, so no QUIC endpoint.
    let mut c = TestCluster::start(1, 4 * MIB, 1, |_, o| o.pki = None)
        .await
        .unwrap();
    c.transport = HopTransport::Quic;
    let (digest, _) = c.import_on_source().await.unwrap();
    let err = c.start_chain(0, &digest, &[1], "").await.unwrap_err();
    let status = err.downcast_ref::<tonic::Status>().expect("a gRPC status");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(
        status.message().contains("no QUIC endpoint"),
        "{}",
        status.message()
    );
    // TCP still works on the same daemons.
    c.transport = HopTransport::Tcp;
    c.serves_a_chain().await.unwrap();
}

/// A plaintext chain (`insecure_plaintext`, loopback) with `sendfile` on: the source and
/// the middle hop send chunk payloads from their store files by `sendfile`, and every copy
/// is byte-exact. Off (the default), nothing goes by `sendfile`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_chain_sends_chunks_from_the_store_files_by_sendfile() {
    let sockets = tempfile::tempdir().unwrap();
    let dir = sockets.path().to_path_buf();
    let c = TestCluster::start(2, 8 * MIB, 1, move |i, o| {
        o.pki = None;
        o.extra_args.extend(["--sendfile".into(), "true".into()]);
        // Plaintext HTTP is refused for /metrics: read it over the owner's Unix socket.
        o.admin_socket = Some(dir.join(format!("admin-{i}.sock")));
    })
    .await
    .unwrap();
    let (_, manifest) = c.chain_to(&[1, 2]).await.unwrap();
    // Every payload of at least the write buffer's size (256 KiB) that the source and the
    // middle hop sent went from the file (a shard's short last chunk is buffered with the
    // frames), and the kernel refused none.
    let chunk = u64::from(manifest.chunk_size);
    let large: u64 = manifest
        .shards
        .iter()
        .flat_map(|s| (0..s.size.div_ceil(chunk)).map(move |i| chunk.min(s.size - i * chunk)))
        .filter(|&len| len >= 256 << 10)
        .sum();
    assert!(large >= 7 * MIB, "{large}");
    for d in &c.daemons[..2] {
        let from_file = shardcast_tests::metric(d, "sendfile_bytes_total").await;
        assert_eq!(from_file, large, "{}", d.host_id);
        assert_eq!(
            shardcast_tests::metric(d, "sendfile_refused_total").await,
            0
        );
    }
    assert_eq!(
        shardcast_tests::metric(&c.daemons[2], "sendfile_bytes_total").await,
        0
    );

    // The default: copied through user space, nothing by sendfile.
    let dir = sockets.path().to_path_buf();
    let c = TestCluster::start(1, 2 * MIB, 1, move |i, o| {
        o.pki = None;
        o.admin_socket = Some(dir.join(format!("default-{i}.sock")));
    })
    .await
    .unwrap();
    c.serves_a_chain().await.unwrap();
    assert_eq!(
        shardcast_tests::metric(&c.daemons[0], "sendfile_bytes_total").await,
        0
    );
}

/// The authenticate-only data mode (`--data-mode authenticate-only`): the hops authenticate
/// with the mutual-TLS handshake and then carry the chain in the clear (here chunk payloads
/// go from the store's files by `sendfile`, which no TLS connection can do), every copy
/// byte-exact; status and metrics say which mode. A host of the other mode is refused in
/// the handshake, by both ends, with an error naming the setting, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authenticate_only_chain_sends_in_the_clear_and_refuses_a_host_of_the_other_mode() {
    let c = TestCluster::start(3, 8 * MIB, 1, |i, o| {
        // recv-3 keeps the default (tls).
        if i < 3 {
            o.extra_args.extend([
                "--data-mode".into(),
                "authenticate-only".into(),
                "--sendfile".into(),
                "true".into(),
            ]);
        }
    })
    .await
    .unwrap();
    let (digest, _) = c.chain_to(&[1, 2]).await.unwrap();
    for d in &c.daemons[1..3] {
        assert_eq!(d.stats().await.unwrap().chunks_corrupt, 0);
    }
    // The source and the middle hop sent (nearly) every payload straight from the file.
    for d in &c.daemons[..2] {
        assert!(
            metric(d, "sendfile_bytes_total").await >= 7 * MIB,
            "{}",
            d.host_id
        );
        assert_eq!(d.stats().await.unwrap().data_mode, "authenticate-only");
        let body = d.metrics().await.unwrap();
        assert!(
            body.contains(&format!(
                "shardcast_data_mode{{host=\"{}\",mode=\"authenticate-only\"}} 1",
                d.host_id
            )),
            "{body}"
        );
    }
    assert_eq!(c.daemons[3].stats().await.unwrap().data_mode, "tls");

    // The source (authenticate-only) to recv-3 (tls): refused in the handshake on both
    // ends; the session fails with the reason, and recv-3 holds nothing.
    let id = c.start_chain(0, &digest, &[3], "").await.unwrap();
    let mut agent = c.daemons[0].agent().await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let failed = loop {
        let s = shardcast_tests::session_status(&mut agent, &id).await;
        if s.state == "failed" {
            break s;
        }
        assert!(s.state != "done", "{s:?}");
        assert!(std::time::Instant::now() < deadline, "{s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(failed.error.contains("data_mode"), "{failed:?}");
    for d in [&c.daemons[0], &c.daemons[3]] {
        assert!(
            metric(d, "tls_alpn_mismatches_total").await >= 1,
            "{}",
            d.host_id
        );
    }
    let log = std::fs::read_to_string(&c.daemons[3].log).unwrap();
    assert!(
        log.contains(
            "the two ends of this hop use different data modes (this host: data_mode = tls"
        ),
        "{log}"
    );
    assert_eq!(c.verified_bytes(3, &digest).await.unwrap_or(0), 0);
}

/// The chain benchmark on loopback with a warm-up run (`bench chain --warm-up`): the
/// warm-up's time is reported apart, every measured method still runs and verifies, and the
/// links' MTU (an emulated-network setting) is left alone on loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_bench_reports_its_warm_up_apart_from_the_measured_runs() {
    use shardcast_bench::scenario::{ChainBenchOpts, Method, NetMode, run_chain_bench};
    let opts = ChainBenchOpts {
        timeout: Duration::from_secs(60),
        mtu: Some(9000),
        warm_up: true,
        ..ChainBenchOpts::new(
            NetMode::Local,
            2,
            8 * MIB,
            vec![Method::ChainTcp, Method::ChainQuic],
        )
    };
    let report = run_chain_bench(&opts).await.unwrap();
    assert!(
        report.warm_up_s.is_some_and(|s| s > 0.0),
        "{:?}",
        report.warm_up_s
    );
    assert_eq!(report.results.len(), 2);
    for r in &report.results {
        assert!(r.verified, "{} copies must be byte-exact", r.method);
    }
    // On loopback the QUIC daemons were told the jumbo packet size, and used it.
    let quic = report.results[1].quic.as_ref().expect("QUIC figures");
    assert_eq!(quic.max_path_mtu, 8972);
}

/// A QUIC path MTU declared larger than this host's route to its peer carries (65527 bytes
/// of UDP payload over loopback, whose route MTU the kernel gives as 65535): the source refuses to dial the hop, logs
/// why with both figures and counts it, instead of sending packets the kernel refuses with
/// `EMSGSIZE` and quinn drops without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_path_mtu_above_the_route_is_refused_with_the_reason() {
    let mut c = TestCluster::start(1, 4 * MIB, 1, |i, o| {
        if i == 0 {
            o.extra_args
                .extend(["--quic-path-mtu".into(), "65527".into()]);
        }
    })
    .await
    .unwrap();
    c.transport = HopTransport::Quic;
    let (digest, _) = c.import_on_source().await.unwrap();
    // Refused when StartChain dials, or by the session right after: either way, said.
    let _ = c.start_chain(0, &digest, &[1], "").await;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while metric(&c.daemons[0], "quic_path_mtu_refused_total").await == 0
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(metric(&c.daemons[0], "quic_path_mtu_refused_total").await >= 1);
    let log = std::fs::read_to_string(&c.daemons[0].log).unwrap();
    assert!(
        log.contains("quic_path_mtu 65527 needs an MTU of 65555 bytes")
            && log.contains("has 65535: lower quic_path_mtu to 65507"),
        "{log}"
    );
    assert_eq!(
        metric(&c.daemons[1], "quic_connections_accepted_total").await,
        0
    );
}

/// A session that outlives its plan (here the head's forwarder, waiting on a stopped hop)
/// makes a plain evict refuse; an evict that ends the model's sessions first — what the
/// controller sends once no plan of its moves the model to that host — ends it, says why,
/// and frees every byte of the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evict_ends_the_sessions_that_outlived_their_plan() {
    use shardcast_protocol::agent::EvictModelRequest;
    let c = TestCluster::start(1, 4 * MIB, 1, |_, _| {}).await.unwrap();
    let (digest, _) = c.import_on_source().await.unwrap();
    let (head, stopped) = (&c.daemons[0], &c.daemons[1]);
    stopped.signal("STOP").unwrap();
    let id = c.start_chain(0, &digest, &[1], "").await.unwrap();
    let mut agent = head.agent().await.unwrap();
    let evict = |end_sessions| EvictModelRequest {
        model: digest.clone(),
        tier: Tier::Memory as i32,
        end_sessions,
    };
    let refused = agent.evict_model(evict(false)).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    assert!(
        refused
            .message()
            .contains("being transferred through this host"),
        "{}",
        refused.message()
    );
    let done = agent.evict_model(evict(true)).await.unwrap().into_inner();
    assert!(done.removed, "{done:?}");
    assert!(done.bytes_freed >= 4 * MIB, "{done:?}");
    let st = shardcast_tests::session_status(&mut agent, &id).await;
    assert_eq!(st.state, "failed", "{st:?}");
    assert!(st.error.contains("ended by an evict"), "{st:?}");
    assert_eq!(head.memory_tier_bytes().unwrap(), 0);
    stopped.signal("CONT").unwrap();
}

/// The memory reserve on real processes: idle receivers fill their spares; a chain's
/// shards are written into them (every copy exact, each shard's bytes counted as taken),
/// the reserve fills again once the host is idle, a restart keeps the spares without
/// writing them again, and on a receiver whose memory capacity cannot hold both the model
/// and the reserve, the reserve stays within the capacity before and after the model
/// arrives, status saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receivers_write_shards_into_the_memory_reserve_and_refill_it_when_idle() {
    const SPARE: u64 = 8 * MIB;
    const TARGET: u64 = 4 * SPARE;
    // Receiver 2's: less than the reserve's target, and than the model and the reserve.
    const CAPACITY: u64 = 28 * MIB;
    let mut c = TestCluster::start(2, 24 * MIB, 3, |i, o| {
        if i > 0 {
            o.extra_args.extend([
                "--memory-reserve".into(),
                TARGET.to_string(),
                "--memory-reserve-spare".into(),
                SPARE.to_string(),
            ]);
        }
        if i == 2 {
            o.extra_args
                .extend(["--memory-capacity".into(), CAPACITY.to_string()]);
        }
    })
    .await
    .unwrap();
    let limit = Duration::from_secs(60);
    for (i, want) in [(1, TARGET), (2, CAPACITY)] {
        let st =
            shardcast_tests::wait_stats(&c.daemons[i], limit, |st| st.memory_reserve_bytes == want)
                .await;
        assert_eq!(st.memory_reserve_target, TARGET, "{st:?}");
        assert!(c.daemons[i].memory_tier_bytes().unwrap() >= want);
    }
    let (digest, manifest) = c.chain_to(&[1, 2]).await.unwrap();
    // A shard takes a spare when the spare covers it at no more than twice its size, or when
    // it is larger than the spare (the spare covers its start).
    let taken: Vec<u64> = manifest
        .shards
        .iter()
        .filter(|s| s.size.saturating_mul(2) >= SPARE)
        .map(|s| s.size.min(SPARE))
        .collect();
    assert!(taken.len() >= 3, "{:?}", manifest.shards);
    for i in [1, 2] {
        let d = &c.daemons[i];
        d.verify_copy(&manifest).unwrap();
        let st = d.stats().await.unwrap();
        assert_eq!(st.chunks_corrupt, 0, "{st:?}");
        assert_eq!(
            st.memory_reserve_taken_bytes,
            taken.iter().sum::<u64>(),
            "{st:?}"
        );
        assert_eq!(
            metric(d, "memory_reserve_spares_taken_total").await,
            taken.len() as u64
        );
    }
    // Receiver 1 fills its reserve again once idle: shards and spares both in its tier.
    let r1 = &c.daemons[1];
    shardcast_tests::wait_stats(r1, limit, |st| st.memory_reserve_bytes == TARGET).await;
    assert!(r1.memory_tier_bytes().unwrap() >= TARGET + manifest.total_bytes());
    // Receiver 2's capacity left the reserve what the model does not use, and no more.
    let r2 = &c.daemons[2];
    let room = CAPACITY - manifest.total_bytes();
    shardcast_tests::wait_stats(r2, limit, |st| st.memory_reserve_bytes == room).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let st = r2.stats().await.unwrap();
    assert_eq!(st.memory_reserve_bytes, room, "{st:?}");
    // Its files: the shards, the spares and the small state files of the copy.
    assert!(r2.memory_tier_bytes().unwrap() <= CAPACITY + MIB);
    // A restart keeps the complete spares (none written again) and the copy.
    let r1 = &mut c.daemons[1];
    r1.restart().await.unwrap();
    let st = shardcast_tests::wait_stats(r1, limit, |st| st.memory_reserve_bytes == TARGET).await;
    assert_eq!(st.memory_reserve_target, TARGET);
    assert_eq!(metric(r1, "memory_reserve_filled_bytes_total").await, 0);
    r1.verify_copy(&manifest).unwrap();
    let _ = digest;
}

/// A recovery that reads a slow origin (an HTTP origin capped at 512 KB/s, each 256 KiB
/// chunk taking about 2 s, four times the upstream grace) while the holder above it is dead:
/// its origin read is stopped once as "bringing nothing" and the origin is probed; the
/// origin answers, the dead holder does not within a grace, and the read is then left to
/// the origin's pace for the rest of the attempt (it was stopped again and again, its reads
/// in flight dropped each time, when every stall counted). Both receivers end exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_origin_is_read_to_the_end_when_the_holder_above_is_dead() {
    let (listener, http) = http_origin().await;
    let allowed = http.clone();
    let mut caps = cap_receivers("100Mbit");
    let mut c = TestCluster::start(2, 4 * MIB, 1, move |i, o| {
        caps(i, o);
        allow_origin(o, &allowed);
    })
    .await
    .unwrap();
    let _origin = serve_http_origin(&c, listener, 512_000);
    let (digest, manifest) = c.import_on_source().await.unwrap();
    c.start_chain(0, &digest, &[1, 2], &http).await.unwrap();
    c.wait_bytes(1, &digest, MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[0].kill().await;
    c.wait(&[1, 2], &digest, Duration::from_secs(90))
        .await
        .unwrap();
    for i in [1, 2] {
        c.daemons[i].verify_copy(&manifest).unwrap();
    }
    let r1 = &c.daemons[1];
    assert!(
        r1.stats().await.unwrap().origin_bytes > 0,
        "recv-1 read the origin"
    );
    assert_eq!(
        metric(r1, "origin_reads_stalled_total").await,
        1,
        "the slow origin read was stopped once, then left to its pace"
    );
}

/// A head that reads the origin (it holds only the manifest) and loses the hop below (here
/// killed; a cut link looks the same to it): its forwarder gives the hop up, so the head
/// stops its origin read, waits for the origin to answer, tries to pull from that hop (dead:
/// nothing), and reads the origin on for the rest while the forwarder feeds the next hop.
/// It reads the model about once: one round of reads in flight is dropped, no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_loses_its_hop_below_stops_its_origin_read_and_reads_on_once() {
    let (listener, http) = http_origin().await;
    let allowed = http.clone();
    let size = 8 * MIB;
    let mut c = TestCluster::start(3, size, 1, move |_, o| {
        allow_origin(o, &allowed);
        o.extra_args
            .extend(["--stall-timeout-ms".into(), "2000".into()]);
    })
    .await
    .unwrap();
    // 2 MB/s: the 8 MiB model takes about 4 s, time to kill the hop below mid-read.
    let _origin = serve_http_origin(&c, listener, 2_000_000);
    // The head holds the manifest only: the chain's head fills from the origin.
    let resp = c.daemons[0]
        .agent()
        .await
        .unwrap()
        .import_model(ImportModelRequest {
            name: "test/model".into(),
            origin: c.origin_uri.clone(),
            chunk_size: 256 << 10,
            tier: Tier::Memory as i32,
            fetch: false,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let digest = resp.digest;
    let manifest: shardcast_protocol::Manifest =
        shardcast_protocol::codec::decode_exact(resp.manifest.into()).unwrap();
    c.start_chain(0, &digest, &[1, 2, 3], &http).await.unwrap();
    c.wait_bytes(1, &digest, MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[1].kill().await;
    c.wait(&[0, 2, 3], &digest, Duration::from_secs(90))
        .await
        .unwrap();
    for i in [0, 2, 3] {
        c.daemons[i].verify_copy(&manifest).unwrap();
    }
    let head = &c.daemons[0];
    assert_eq!(
        metric(head, "head_origin_reads_stopped_total").await,
        1,
        "the head stopped its origin read once, when its forwarder gave up recv-1"
    );
    let read = head.stats().await.unwrap().origin_bytes;
    assert!(
        read <= size + size / 4,
        "the head read {read} bytes from the origin for a {size}-byte model"
    );
    for i in [2, 3] {
        assert_eq!(
            c.daemons[i].stats().await.unwrap().origin_bytes,
            0,
            "recv-{i} was fed by the chain"
        );
    }
}

/// A loopback HTTP origin's listener, bound now (served by [`serve_http_origin`] once the
/// cluster's origin directory exists), and its URI.
async fn http_origin() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let uri = format!("http://{}/", listener.local_addr().unwrap());
    (listener, uri)
}

/// Adds `uri` to a daemon's origin allow-list (the cluster allows its file origin).
fn allow_origin(o: &mut DaemonOpts, uri: &str) {
    if let Some(at) = o.extra_args.iter().position(|a| a == "--origin-allow") {
        let list = format!("{},{uri}", o.extra_args[at + 1]);
        o.extra_args[at + 1] = list;
    }
}

/// Serves the cluster's origin directory on `listener` at `rate` bytes/s until the guard
/// is dropped.
fn serve_http_origin(
    c: &TestCluster,
    listener: tokio::net::TcpListener,
    rate: u64,
) -> tokio_util::sync::DropGuard {
    use shardcast_bench::origin_server::{OriginStats, serve};
    let cancel = tokio_util::sync::CancellationToken::new();
    tokio::spawn(serve(
        c.origin.path().to_path_buf(),
        listener,
        Some(rate),
        std::sync::Arc::new(OriginStats::default()),
        cancel.clone(),
    ));
    cancel.drop_guard()
}
