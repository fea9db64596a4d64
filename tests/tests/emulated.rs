//! The emulated-cluster path (network namespaces, a bridge, tc caps) at a small size, so it
//! cannot silently rot. Needs root and iproute2; skipped with the reason otherwise.

use std::time::Duration;

use shardcast_bench::netns;
use shardcast_bench::scenario::{ChainBenchOpts, Method, NetMode, run_chain_bench};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulated_chain_beats_star_and_verifies() {
    if let Err(why) = netns::available() {
        eprintln!("SKIPPED: emulated cluster needs root and iproute2: {why}");
        return;
    }
    let opts = ChainBenchOpts {
        mode: NetMode::Emulate,
        receivers: 4,
        size: 24 << 20,
        shards: 2,
        rate: Some(200_000_000 / 8),
        methods: vec![Method::ChainTcp, Method::Star],
        timeout: Duration::from_secs(120),
        progress: false,
        chunk_size: 0,
        window: 0,
    };
    let report = run_chain_bench(&opts).await.unwrap();
    assert_eq!(report.results.len(), 2);
    for r in &report.results {
        assert!(r.verified, "{} copies must be byte-exact", r.method);
        assert_eq!(r.per_receiver_s.len(), 4);
    }
    let (chain, star) = (&report.results[0], &report.results[1]);
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
