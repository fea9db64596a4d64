//! The emulated-cluster path (network namespaces, a bridge, tc caps) at a small size, so it
//! cannot silently rot. Needs root and iproute2; skipped with the reason otherwise.

use std::time::Duration;

use shardcast_bench::netns;
use shardcast_bench::scenario::{ChainBenchOpts, Method, NetMode, run_chain_bench};

/// The emulated chain benchmark at a test's size: 2 shards over 200 Mbit/s links, TLS,
/// transferd's defaults otherwise; `loss_per_10000` of each host's frames dropped.
fn emulated(
    receivers: usize,
    size: u64,
    methods: Vec<Method>,
    loss_per_10000: u32,
) -> ChainBenchOpts {
    ChainBenchOpts {
        loss_per_10000,
        shards: 2,
        rate: Some(200_000_000 / 8),
        timeout: Duration::from_secs(120),
        ..ChainBenchOpts::new(NetMode::Emulate, receivers, size, methods)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_chain_beats_star_and_verifies_over_tcp_and_quic() {
    if let Err(why) = netns::available() {
        eprintln!("SKIPPED: emulated cluster needs root and iproute2: {why}");
        return;
    }
    let opts = emulated(
        4,
        24 << 20,
        vec![Method::ChainTcp, Method::Star, Method::ChainQuic],
        0,
    );
    let report = run_chain_bench(&opts).await.unwrap();
    assert_eq!(report.results.len(), 3);
    for r in &report.results {
        assert!(r.verified, "{} copies must be byte-exact", r.method);
        assert_eq!(r.per_receiver_s.len(), 4);
    }
    let (chain, star, quic) = (&report.results[0], &report.results[1], &report.results[2]);
    // Over QUIC through the same veths (1500-byte MTU) and caps: a chain, not a star.
    assert!(
        quic.completion_s < star.completion_s,
        "chain-quic {:.2}s vs star {:.2}s",
        quic.completion_s,
        star.completion_s
    );
    // The chain needs about one link-time; the star shares the source's uplink four ways.
    assert!(
        chain.completion_s < report.ideal_s * 1.6,
        "chain {:.2}s vs ideal {:.2}s",
        chain.completion_s,
        report.ideal_s
    );
    assert!(
        star.completion_s > chain.completion_s * 2.0,
        "star {:.2}s vs chain {:.2}s",
        star.completion_s,
        chain.completion_s
    );
    let left = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    let left = String::from_utf8_lossy(&left.stdout);
    assert!(
        !left.contains(&format!("shcbench-{}-", std::process::id())),
        "namespaces left behind: {left}"
    );
}

/// Chains over TCP and over QUIC through links that drop 2% of every host's packets: the
/// transports' loss recovery, not shardcast's, makes up for it, and every copy still ends
/// byte-exact. The drops are counted, so the test knows the loss happened. No hop is given
/// up: with quinn's Internet default initial RTT (333 ms) two lost handshake packets cost
/// 3 s, the forwarder skipped a live host after 2 s and it never got its copy (CI row 83);
/// `transport::quic::INITIAL_RTT` keeps a lossy handshake within tens of milliseconds, and
/// over TCP a lost SYN costs a 250 ms second attempt (`grpc::CONNECT_ATTEMPT_DELAY`), not
/// the kernel's 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_chains_over_tcp_and_quic_stay_exact_through_packet_loss() {
    if let Err(why) = netns::available().and_then(|()| netns::loss_available()) {
        eprintln!("SKIPPED: emulated loss needs root, iproute2 and nftables: {why}");
        return;
    }
    let opts = emulated(3, 16 << 20, vec![Method::ChainTcp, Method::ChainQuic], 200);
    let report = run_chain_bench(&opts).await.unwrap();
    assert_eq!(report.loss_percent, 2.0);
    for r in &report.results {
        assert!(r.verified, "{} copies must be byte-exact", r.method);
        assert_eq!(r.per_receiver_s.len(), 3);
        // ~16 MiB × 3 hops in 1448-byte segments is ~35k packets: 2% is hundreds dropped.
        assert!(
            r.packets_dropped > 100,
            "{}: only {} packets dropped",
            r.method,
            r.packets_dropped
        );
        assert_eq!(r.hop_failovers, 0, "{}: a hop was given up", r.method);
    }
}

/// A QUIC chain over jumbo-frame links with the path MTU declared (`--quic-path-mtu`): every
/// copy byte-exact, the packets as large as the links carry from the start, and almost none
/// lost (a GSO batch of ten 8972-byte packets is over the kernel's 64 KiB limit and would
/// vanish whole without transferd's cap: a third of all packets did).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_quic_chain_over_jumbo_frames_uses_them_and_loses_almost_nothing() {
    if let Err(why) = netns::available() {
        eprintln!("SKIPPED: emulated cluster needs root and iproute2: {why}");
        return;
    }
    let mut opts = emulated(3, 16 << 20, vec![Method::ChainQuic], 0);
    opts.mtu = Some(9000);
    let report = run_chain_bench(&opts).await.unwrap();
    assert_eq!(report.mtu, 9000);
    let r = &report.results[0];
    assert!(r.verified, "chain-quic copies must be byte-exact");
    let quic = r.quic.as_ref().expect("QUIC figures of a chain-quic run");
    assert_eq!(quic.max_path_mtu, 8972);
    assert!(
        quic.tx_bytes_per_datagram > 4000.0,
        "{:.0} bytes per datagram: the declared MTU was not used",
        quic.tx_bytes_per_datagram
    );
    assert!(
        quic.lost_packets * 20 < quic.tx_datagrams,
        "{} of {} datagrams lost",
        quic.lost_packets,
        quic.tx_datagrams
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_cold_start_reads_the_origin_once() {
    use shardcast_bench::managed::{ColdStartOpts, run_cold_start};
    if let Err(why) = netns::available() {
        eprintln!("SKIPPED: emulated cluster needs root and iproute2: {why}");
        return;
    }
    let opts = ColdStartOpts {
        hosts: 4,
        size: 16 << 20,
        shards: 2,
        rate: 200_000_000 / 8,
        origin_rate: 50_000_000 / 8,
        methods: vec!["origin-pull".into(), "shardcast".into()],
        timeout: Duration::from_secs(120),
        progress: false,
    };
    let report = run_cold_start(&opts).await.unwrap();
    let (pull, sc) = (&report.results[0], &report.results[1]);
    for r in &report.results {
        assert!(r.verified, "{} copies must be byte-exact", r.method);
        assert_eq!(r.per_host_s.len(), 4);
    }
    // The baseline reads the model once per host; shardcast once in all.
    assert_eq!(pull.origin_bytes, 4 * report.bytes);
    assert_eq!(sc.origin_bytes, report.bytes);
    assert_eq!(sc.chains, 1);
    assert!(
        sc.ready_s < report.origin_read_s * 1.5,
        "shardcast {:.2}s vs one origin read {:.2}s",
        sc.ready_s,
        report.origin_read_s
    );
    assert!(
        pull.ready_s > sc.ready_s * 2.5,
        "origin-pull {:.2}s vs shardcast {:.2}s",
        pull.ready_s,
        sc.ready_s
    );
}

/// The simulator against the emulated cluster (issue #32): one burst — 8 hosts, one
/// 64 MiB model in one shard, 200 Mbit/s links, an origin serving 400 Mbit/s behind its own
/// 200 Mbit/s link — run by real transferds and a real controller in network namespaces,
/// then replayed in the simulator from the report's own parameters (`sim::params`). For
/// both methods (every host from the origin, and shardcast's chain) the slowest host agrees
/// within 10 %; for the chain also the mean and every host against the simulated host of
/// the same rank. The baseline's 8 downloads share the origin's link by TCP, which is not
/// max-min fair host by host: all of them end together in the simulator, while in one CI
/// run two hosts finished at 12.9 and 14.3 s and six at 22.4–22.6 s (simulated 22.46 s
/// each), a mean 10.8 % below the simulator's with the same last host (−0.5 %). The link
/// carries the same bytes in the same time either way, so the baseline's slowest host is
/// held and its mean and ranks are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_cold_start_agrees_with_the_simulator_within_10_percent() {
    use shardcast_bench::managed::{ColdStartOpts, run_cold_start};
    use shardcast_bench::sim::params;
    if let Err(why) = netns::available() {
        eprintln!("SKIPPED: emulated cluster needs root and iproute2: {why}");
        return;
    }
    let opts = ColdStartOpts {
        hosts: 8,
        size: 64 << 20,
        shards: 1,
        rate: 200_000_000 / 8,
        origin_rate: 400_000_000 / 8,
        methods: vec!["origin-pull".into(), "shardcast".into()],
        timeout: Duration::from_secs(180),
        progress: false,
    };
    let report = run_cold_start(&opts).await.unwrap();
    for r in &report.results {
        assert!(r.verified, "{} copies must be byte-exact", r.method);
    }
    assert_eq!(
        report.sim_params.shard_bytes.iter().sum::<u64>(),
        report.bytes
    );
    // The simulator runs on a paused runtime of its own, off this one.
    let replays = std::thread::spawn(move || params::replay(&report))
        .join()
        .unwrap()
        .unwrap();
    eprintln!("{}", params::table(&replays));
    assert_eq!(replays.len(), 2);
    for r in &replays {
        let a = &r.agreement;
        eprintln!(
            "{}: measured {:?}\n  simulated {:?}",
            r.method, a.measured_s, a.simulated_s
        );
    }
    for r in &replays {
        let a = &r.agreement;
        let mean_held = r.method == "shardcast";
        assert!(
            (!mean_held || a.mean_error.abs() <= 0.10) && a.max_error.abs() <= 0.10,
            "{}: mean {:+.1}%, slowest {:+.1}%",
            r.method,
            a.mean_error * 100.0,
            a.max_error * 100.0
        );
        if r.method == "shardcast" {
            assert!(
                a.worst_rank_error <= 0.10,
                "{}: a host {:.1}% off",
                r.method,
                a.worst_rank_error * 100.0
            );
        }
    }
}

/// Faults on the emulated cluster, through the controller: two victims in one chain (one
/// killed and restarted 3 s later, its neighbour stopped for 8 s) and a link cut for 8 s, at
/// the head and in the middle of the chain. Every healthy host must end byte-exact, the
/// victims too (they come back within the controller's lost grace and are re-planned), the
/// plan's report must match what every host really holds, and evicting the model afterwards
/// must leave no byte in any host's memory tier. What the faults cost is `shardcast-bench
/// faults`' figure, not this test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_stalls_and_cut_links_end_exact_and_reported_truly() {
    use shardcast_bench::faults::{Fault, FaultsOpts, Position, run_faults};
    if let Err(why) = netns::available() {
        eprintln!("SKIPPED: emulated cluster needs root and iproute2: {why}");
        return;
    }
    let opts = FaultsOpts {
        hosts: 4,
        size: 64 << 20,
        shards: 1,
        rate: 200_000_000 / 8,
        origin_rate: 200_000_000 / 8,
        faults: vec![Fault::Two, Fault::LinkDown],
        positions: vec![Position::Head, Position::Middle],
        trials: 1,
        at: Duration::from_secs(1),
        timeout: Duration::from_secs(120),
        daemon_args: Vec::new(),
    };
    let report = run_faults(&opts).await.unwrap();
    assert_eq!(report.results.len(), 4);
    for t in &report.results {
        assert!(
            t.exact,
            "{:?} at {:?}: a healthy copy is not exact",
            t.fault, t.position
        );
        assert!(
            t.status_true,
            "{:?} at {:?}: the plan's report is not what the hosts hold: {}",
            t.fault, t.position, t.plan
        );
        // A host cut off or stopped for 8 s heartbeats again within the controller's lost
        // grace: it is re-planned and ends with its copy too.
        assert!(
            t.victims_complete,
            "{:?} at {:?}: the victim did not complete: {}",
            t.fault, t.position, t.plan
        );
        // A host whose link was down reads from a peer once it is back, not the origin a
        // second time: an origin read of its own stops when a holder feeds the shard, and
        // one that stalled with the link resumes only after its peers had the first word
        // (the holders above for a hop, the hop below for a head, which read on from the
        // origin meanwhile). It read 1.7 × the model before, and still up to 1.73 × under
        // CI's load while the stalled read resumed the moment the link came back; a cut-off
        // head 1.75 × once in CI until it pulled from the hop below first (2026-11-28: 1.14–
        // 1.18 × after, the overlap being what the head held and had not forwarded yet, and
        // its reads in flight when the link went).
        if t.fault == Fault::LinkDown {
            assert!(
                t.origin_bytes * 100 <= report.bytes * 125,
                "link-down at {:?}: the origin was read {:.2} × ({} of {} bytes)",
                t.position,
                t.origin_bytes as f64 / report.bytes as f64,
                t.origin_bytes,
                report.bytes
            );
        }
        // Evicting the model afterwards frees every byte of every host's memory tier.
        assert_eq!(
            t.bytes_left_after_evict,
            Some(0),
            "{:?} at {:?}: evict left bytes behind ({:?})",
            t.fault,
            t.position,
            t.evict_error
        );
    }
}

/// A rolling restart on the emulated cluster, through the controller: during a prewarm every
/// transferd in turn, in chain order from the head, gets SIGTERM and is started again as
/// soon as it exits. With a 1 s drain each host leaves while its sessions still run (the
/// default drain would let the head finish its whole chain first), so every hop below
/// loses its upstream at least once. The prewarm must complete with every host's copy
/// byte-exact, the plan's report true, and nothing left in any memory tier after evict.
/// What the restarts cost is `shardcast-bench faults --faults rolling`' figure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_rolling_restart_during_a_prewarm_ends_exact() {
    use shardcast_bench::faults::{Fault, FaultsOpts, Position, run_faults};
    if let Err(why) = netns::available() {
        eprintln!("SKIPPED: emulated cluster needs root and iproute2: {why}");
        return;
    }
    let opts = FaultsOpts {
        hosts: 4,
        size: 64 << 20,
        shards: 1,
        rate: 200_000_000 / 8,
        origin_rate: 200_000_000 / 8,
        faults: vec![Fault::Rolling],
        positions: vec![Position::Head],
        trials: 1,
        at: Duration::from_secs(1),
        timeout: Duration::from_secs(120),
        daemon_args: vec!["--drain-grace-ms".into(), "1000".into()],
    };
    let report = run_faults(&opts).await.unwrap();
    assert_eq!(report.results.len(), 1);
    let t = &report.results[0];
    assert!(t.exact, "a copy is not exact after the rolling restart");
    assert!(
        t.status_true,
        "the plan's report is not what the hosts hold: {}",
        t.plan
    );
    assert!(
        t.victims_complete,
        "a restarted host did not complete: {}",
        t.plan
    );
    assert_eq!(
        t.bytes_left_after_evict,
        Some(0),
        "evict left bytes behind ({:?})",
        t.evict_error
    );
}

/// `shardcast-bench origin --emulate` at a small size: the servers in one namespace, a
/// transferd behind a relay in another, the link capped at 200 Mbit/s. Every copy exact,
/// and no read faster than the cap (so the bytes crossed the shaped link).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_origin_benchmark_reads_across_the_capped_link() {
    use shardcast_bench::origin_bench::{OriginBenchOpts, OriginKind, prepare, run_origin_bench};
    if let Err(why) = netns::available() {
        eprintln!("SKIPPED: emulated cluster needs root and iproute2: {why}");
        return;
    }
    let mut origins = vec![OriginKind::Http];
    match prepare(OriginKind::S3rver).await {
        Ok(()) => origins.push(OriginKind::S3rver),
        Err(e) => eprintln!("SKIPPED: s3rver in the emulated origin benchmark: {e:#}"),
    }
    let cap = 200_000_000 / 8;
    let opts = OriginBenchOpts {
        emulate: true,
        size: 16 << 20,
        shards: 2,
        rate: Some(cap),
        origins: origins.clone(),
        origin_parallel: None,
        chunk_size: 0,
        timeout: Duration::from_secs(120),
        iperf_seconds: 1,
    };
    let report = run_origin_bench(&opts).await.unwrap();
    assert_eq!(report.mode, "emulated");
    assert_eq!(report.rate_bits_per_s, Some(200_000_000));
    assert_eq!(report.runs.len(), origins.len());
    for run in &report.runs {
        let name = run.origin.name();
        assert!(run.digest_matches && run.verified, "{name}: not exact");
        assert!(run.relay_cpu_s_per_gb.is_some(), "{name}: no relay");
        let of_cap = run.fetch_of_cap.unwrap();
        assert!(
            of_cap < 1.1,
            "{name}: {of_cap:.2} of the cap: not through the link"
        );
    }
    let left = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    let left = String::from_utf8_lossy(&left.stdout);
    assert!(
        !left.contains(&format!("shcbench-{}-", std::process::id())),
        "namespaces left behind: {left}"
    );
}
