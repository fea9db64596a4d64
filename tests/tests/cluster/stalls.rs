//! Stalled hops on real processes (loopback): a hop that is alive but silent (`SIGSTOP`)
//! at the head, in the middle and at the tail, two faults in one chain (a stopped hop and a
//! killed one; a killed head and a stopped hop below it), and a stalled hop that comes back.
//! The neighbours must notice at the hop (`stall_timeout`), not after the 30 s write timeout
//! or the 60 s peer idle timeout: the healthy hosts complete while the stalled one is still
//! stopped, and the counters say which detection fired. The time it costs is measured by
//! `shardcast-bench faults`, not here. Each test runs over TCP (`tcp::`) and over QUIC
//! (`quic::`).

use std::time::Duration;

use shardcast_bench::cluster::DaemonOpts;
use shardcast_protocol::HopTransport;
use shardcast_tests::{TestCluster, metric};

const MIB: u64 = 1 << 20;

/// Receivers capped at 100 Mbit/s (a 48 MiB model takes about 4 s), with the hop-level
/// timeouts at their defaults and everything else left to take far longer: the peer idle
/// timeout (60 s) and the write timeout (30 s) must not be what detects the stall.
fn opts() -> impl FnMut(usize, &mut DaemonOpts) {
    move |i, o| {
        if i > 0 {
            o.ingress_rate = "100Mbit".into();
        }
        o.extra_args
            .extend(["--stall-timeout-ms".into(), "2000".into()]);
    }
}

/// What no test here may wait for: well under the write timeout plus the upstream grace,
/// so a chain that only notices a stall through those fails.
const HEALTHY_WITHIN: Duration = Duration::from_secs(25);

async fn chain_of(
    receivers: usize,
    transport: HopTransport,
) -> (
    TestCluster,
    String,
    shardcast_protocol::Manifest,
    Vec<usize>,
) {
    let mut c = TestCluster::start(receivers, 48 * MIB, 2, opts())
        .await
        .unwrap();
    c.transport = transport;
    let (digest, manifest) = c.import_on_source().await.unwrap();
    let hops: Vec<usize> = (1..=receivers).collect();
    c.start_chain(0, &digest, &hops, &c.origin_uri)
        .await
        .unwrap();
    (c, digest, manifest, hops)
}

async fn a_stopped_middle_hop_is_bypassed_and_rejoins_as_a_leaf(transport: HopTransport) {
    let (c, digest, manifest, _) = chain_of(5, transport).await;
    c.wait_bytes(3, &digest, 8 * MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[2].signal("STOP").unwrap();
    c.wait(&[1, 3, 4, 5], &digest, HEALTHY_WITHIN)
        .await
        .unwrap();
    for i in [1, 3, 4, 5] {
        c.daemons[i].verify_copy(&manifest).unwrap();
    }
    // recv-1 gave recv-2 up for not draining its writes or not answering, and failed over.
    assert!(metric(&c.daemons[1], "downstream_stalls_total").await >= 1);
    assert!(c.daemons[1].stats().await.unwrap().downstream_failovers >= 1);

    // It comes back: it completes from the holder above it, never from the origin.
    c.daemons[2].signal("CONT").unwrap();
    c.wait(&[2], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[2].verify_copy(&manifest).unwrap();
    for i in 1..=5 {
        assert_eq!(
            c.daemons[i].stats().await.unwrap().origin_bytes,
            0,
            "recv-{i} read the origin although the source and the hops above held the model"
        );
    }
}

async fn a_stopped_head_is_noticed_by_the_first_hop_which_alone_reads_the_origin(
    transport: HopTransport,
) {
    let (c, digest, manifest, _) = chain_of(3, transport).await;
    c.wait_bytes(1, &digest, 4 * MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[0].signal("STOP").unwrap();
    c.wait(&[1, 2, 3], &digest, HEALTHY_WITHIN).await.unwrap();
    for i in 1..=3 {
        c.daemons[i].verify_copy(&manifest).unwrap();
    }
    // recv-1 found its upstream silent; the others heard recv-1's keepalives while it was
    // starved, so they did not give it up and did not read the origin themselves.
    assert!(metric(&c.daemons[1], "upstream_stalls_total").await >= 1);
    assert!(c.daemons[1].stats().await.unwrap().origin_bytes > 0);
    for i in [2, 3] {
        assert_eq!(metric(&c.daemons[i], "upstream_stalls_total").await, 0);
        assert_eq!(
            c.daemons[i].stats().await.unwrap().origin_bytes,
            0,
            "recv-{i}"
        );
    }
    c.daemons[0].signal("CONT").unwrap();
}

/// The head killed and the hop below it stopped at once: the hop below those two finds its
/// upstream silent, dials the holders above it while it waits for one to fail over, finds
/// them dead or stopped, and reads the origin at once (it does not wait out the grace for a
/// failover that cannot come); the rest of the chain goes on from it.
async fn a_killed_head_and_a_stopped_hop_below_it_leave_the_next_hop_to_read_the_origin_at_once(
    transport: HopTransport,
) {
    let (mut c, digest, manifest, _) = chain_of(3, transport).await;
    c.wait_bytes(3, &digest, 4 * MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[1].signal("STOP").unwrap();
    c.daemons[0].kill().await;
    c.wait(&[2, 3], &digest, HEALTHY_WITHIN).await.unwrap();
    for i in [2, 3] {
        c.daemons[i].verify_copy(&manifest).unwrap();
    }
    assert!(metric(&c.daemons[2], "upstream_stalls_total").await >= 1);
    assert!(metric(&c.daemons[2], "upstream_holders_unreachable_total").await >= 1);
    assert!(c.daemons[2].stats().await.unwrap().origin_bytes > 0);
    assert_eq!(c.daemons[3].stats().await.unwrap().origin_bytes, 0);
    c.daemons[1].signal("CONT").unwrap();
    c.wait(&[1], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[1].verify_copy(&manifest).unwrap();
}

async fn a_stopped_tail_costs_the_others_nothing_and_completes_when_it_comes_back(
    transport: HopTransport,
) {
    let (c, digest, manifest, _) = chain_of(3, transport).await;
    c.wait_bytes(3, &digest, 4 * MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[3].signal("STOP").unwrap();
    c.wait(&[1, 2], &digest, HEALTHY_WITHIN).await.unwrap();
    for i in [1, 2] {
        c.daemons[i].verify_copy(&manifest).unwrap();
    }
    c.daemons[3].signal("CONT").unwrap();
    c.wait(&[3], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[3].verify_copy(&manifest).unwrap();
    assert_eq!(c.daemons[3].stats().await.unwrap().origin_bytes, 0);
}

async fn two_faults_in_one_chain_a_stopped_hop_and_a_killed_one(transport: HopTransport) {
    let (mut c, digest, manifest, _) = chain_of(6, transport).await;
    c.wait_bytes(5, &digest, 4 * MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[2].signal("STOP").unwrap();
    c.daemons[4].kill().await;
    c.wait(&[1, 3, 5, 6], &digest, HEALTHY_WITHIN)
        .await
        .unwrap();
    for i in [1, 3, 5, 6] {
        c.daemons[i].verify_copy(&manifest).unwrap();
        assert_eq!(
            c.daemons[i].stats().await.unwrap().origin_bytes,
            0,
            "recv-{i}"
        );
    }
    c.daemons[2].signal("CONT").unwrap();
    c.wait(&[2], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[2].verify_copy(&manifest).unwrap();
}

shardcast_tests::over_each_transport!(
    a_stopped_middle_hop_is_bypassed_and_rejoins_as_a_leaf,
    a_stopped_head_is_noticed_by_the_first_hop_which_alone_reads_the_origin,
    a_stopped_tail_costs_the_others_nothing_and_completes_when_it_comes_back,
    two_faults_in_one_chain_a_stopped_hop_and_a_killed_one,
    a_killed_head_and_a_stopped_hop_below_it_leave_the_next_hop_to_read_the_origin_at_once,
);
