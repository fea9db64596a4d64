//! Data at rest on real daemons: chunks that rot in a verified memory-tier copy while the
//! daemon runs (found by the next hop's verification and `Nack`, before serving with
//! `reverify_sends`, or by the scrub; repaired; never resent), and symlinks planted in a
//! running daemon's memory tier.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use shardcast_bench::cluster::Daemon;
use shardcast_protocol::Manifest;
use shardcast_tests::{TestCluster, metric};

const MIB: u64 = 1 << 20;
/// Chunk size `TestCluster::import_on_source` uses.
const CHUNK: u64 = 256 << 10;

/// Polls `metric` until it reaches `at_least`, for up to `timeout`.
async fn wait_metric(d: &Daemon, name: &str, at_least: u64, timeout: Duration) -> u64 {
    let deadline = Instant::now() + timeout;
    loop {
        let v = metric(d, name).await;
        if v >= at_least || Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The memory-tier file of shard `shard` of `manifest` on `d`.
fn shard_file(d: &Daemon, digest: &str, manifest: &Manifest, shard: usize) -> PathBuf {
    assert_eq!(digest, manifest.digest().to_hex());
    d.memory_shard_path(manifest, shard)
}

/// Flips one byte of a file in place.
fn flip(path: &Path, at: u64) {
    shardcast_bench::cluster::flip_byte(path, at).unwrap();
}

fn source_flags(
    args: &'static [&'static str],
) -> impl FnMut(usize, &mut shardcast_bench::cluster::DaemonOpts) {
    move |i, o| {
        if i == 0 {
            o.extra_args.extend(args.iter().map(|s| s.to_string()));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn byte_flipped_at_rest_is_caught_before_serving_and_repaired() {
    // With `reverify_sends` the source re-hashes any chunk older than 100 ms before sending
    // it; no scrub, so the send path is what finds it.
    let c = TestCluster::start(
        2,
        8 * MIB,
        2,
        source_flags(&[
            "--reverify-after-ms",
            "100",
            "--reverify-sends",
            "true",
            "--scrub-rate",
            "off",
        ]),
    )
    .await
    .unwrap();
    let (digest, manifest) = c.import_on_source().await.unwrap();
    let file = shard_file(&c.daemons[0], &digest, &manifest, 1);
    flip(&file, 3 * CHUNK + 1234);
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.start_chain(0, &digest, &[1, 2], &c.origin_uri)
        .await
        .unwrap();
    c.wait(&[1, 2], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    for d in &c.daemons[1..] {
        d.verify_copy(&manifest).unwrap();
        assert_eq!(
            d.stats().await.unwrap().chunks_corrupt,
            0,
            "{}: the rotten chunk was never sent",
            d.host_id
        );
    }
    let src = &c.daemons[0];
    assert_eq!(metric(src, "chunks_corrupt_at_rest_total").await, 1);
    assert_eq!(
        wait_metric(src, "chunks_repaired_total", 1, Duration::from_secs(10)).await,
        1
    );
    assert_eq!(metric(src, "chunks_unrepairable_total").await, 0);
    assert!(metric(src, "chunks_reverified_total").await >= manifest.total_chunks());
    assert_eq!(src.stats().await.unwrap().downstream_failovers, 0);
    // The source's own copy is byte-exact again.
    src.verify_copy(&manifest).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_makes_the_sender_rehash_drop_and_repair_not_resend_bad_bytes() {
    nack_case(false).await;
}

/// The same with the receivers hashing each payload as it arrives (`--hash-on-read`): the
/// hash their frame reader works out catches the rotten chunk just the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_catches_a_rotten_chunk_hashed_as_it_arrives() {
    nack_case(true).await;
}

async fn nack_case(hash_on_read: bool) {
    // The defaults (no scrub): the source does not re-hash before sending down a chain, not
    // even the chunks of the copy kept at import, which it does not trust; so the rotten
    // chunk goes out once, and the receiver's Nack makes the source re-hash, drop and
    // repair it, then send good bytes.
    let c = TestCluster::start(2, 8 * MIB, 1, |i, o| {
        if i == 0 {
            o.extra_args.extend(["--scrub-rate".into(), "off".into()]);
        } else {
            o.extra_args
                .extend(["--hash-on-read".into(), hash_on_read.to_string()]);
        }
    })
    .await
    .unwrap();
    let (digest, manifest) = c.import_on_source().await.unwrap();
    flip(
        &shard_file(&c.daemons[0], &digest, &manifest, 0),
        5 * CHUNK + 7,
    );
    c.start_chain(0, &digest, &[1, 2], &c.origin_uri)
        .await
        .unwrap();
    c.wait(&[1, 2], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    for d in &c.daemons[1..] {
        d.verify_copy(&manifest).unwrap();
    }
    let first = c.daemons[1].stats().await.unwrap();
    assert_eq!(first.chunks_corrupt, 1, "recv-1 caught the bad chunk once");
    assert_eq!(
        c.daemons[2].stats().await.unwrap().chunks_corrupt,
        0,
        "corruption must not propagate"
    );
    let src = &c.daemons[0];
    let stats = src.stats().await.unwrap();
    assert_eq!(
        stats.downstream_failovers, 0,
        "the healthy downstream was not skipped"
    );
    assert_eq!(metric(src, "chunks_corrupt_at_rest_total").await, 1);
    assert_eq!(
        metric(src, "chunks_resent_total").await,
        0,
        "bad bytes never resent"
    );
    assert_eq!(
        wait_metric(src, "chunks_repaired_total", 1, Duration::from_secs(10)).await,
        1
    );
    // Only the Nacked chunk (and what its repair checks) was re-hashed, not the model.
    let rehashed = metric(src, "chunks_reverified_total").await;
    assert!(
        rehashed <= 2,
        "{rehashed} chunks re-hashed of {}",
        manifest.total_chunks()
    );
    src.verify_copy(&manifest).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_copy_is_rehashed_before_its_first_send() {
    // The copy kept while the manifest was built is moved into the store without a second
    // hash and is not trusted (even with a ten-minute window): with `reverify_sends` the
    // source re-hashes each chunk before sending it, so a byte that rotted after the import
    // never leaves it.
    let c = TestCluster::start(
        2,
        8 * MIB,
        1,
        source_flags(&[
            "--reverify-after-ms",
            "600000",
            "--reverify-sends",
            "true",
            "--scrub-rate",
            "off",
        ]),
    )
    .await
    .unwrap();
    let (digest, manifest) = c.import_on_source().await.unwrap();
    let src = &c.daemons[0];
    assert_eq!(
        src.stats().await.unwrap().kept_bytes,
        manifest.total_bytes(),
        "the import kept what it read"
    );
    flip(&shard_file(src, &digest, &manifest, 0), 5 * CHUNK + 7);
    c.start_chain(0, &digest, &[1, 2], &c.origin_uri)
        .await
        .unwrap();
    c.wait(&[1, 2], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    for d in &c.daemons[1..] {
        d.verify_copy(&manifest).unwrap();
        assert_eq!(d.stats().await.unwrap().chunks_corrupt, 0, "bad bytes sent");
    }
    assert_eq!(metric(src, "chunks_corrupt_at_rest_total").await, 1);
    assert!(metric(src, "chunks_reverified_total").await >= manifest.total_chunks());
    assert_eq!(
        wait_metric(src, "chunks_repaired_total", 1, Duration::from_secs(10)).await,
        1
    );
    src.verify_copy(&manifest).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrub_finds_and_repairs_a_flipped_byte_in_an_idle_copy() {
    let c = TestCluster::start(
        0,
        4 * MIB,
        1,
        source_flags(&["--reverify-after-ms", "50", "--scrub-rate", "256MB/s"]),
    )
    .await
    .unwrap();
    let (digest, manifest) = c.import_on_source().await.unwrap();
    let src = &c.daemons[0];
    // A pass over 4 MiB at 256 MB/s takes ~16 ms; let a few go by.
    let before = wait_metric(
        src,
        "chunks_scrubbed_total",
        2 * manifest.total_chunks(),
        Duration::from_secs(10),
    )
    .await;
    assert!(before >= 2 * manifest.total_chunks(), "scrubbed {before}");
    assert_eq!(metric(src, "chunks_corrupt_at_rest_total").await, 0);
    flip(&shard_file(src, &digest, &manifest, 0), 9 * CHUNK + 99);
    assert_eq!(
        wait_metric(
            src,
            "chunks_corrupt_at_rest_total",
            1,
            Duration::from_secs(10)
        )
        .await,
        1
    );
    assert_eq!(
        wait_metric(src, "chunks_repaired_total", 1, Duration::from_secs(10)).await,
        1
    );
    assert!(metric(src, "bytes_scrubbed_total").await >= before * CHUNK);
    src.verify_copy(&manifest).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrepairable_rot_fails_the_session_without_sending_or_skipping() {
    // Every send re-hashed (`reverify_sends`, a zero trust window), so the rotten chunk is
    // found before it leaves.
    let c = TestCluster::start(
        2,
        4 * MIB,
        1,
        source_flags(&[
            "--reverify-after-ms",
            "0",
            "--reverify-sends",
            "true",
            "--scrub-rate",
            "off",
        ]),
    )
    .await
    .unwrap();
    let (digest, manifest) = c.import_on_source().await.unwrap();
    // No repair source left anywhere: the origin is gone and the chain has no fallback.
    for e in std::fs::read_dir(c.origin.path()).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::remove_file(p).unwrap();
        }
    }
    flip(&shard_file(&c.daemons[0], &digest, &manifest, 0), 2 * CHUNK);
    c.start_chain(0, &digest, &[1, 2], "").await.unwrap();
    let src = &c.daemons[0];
    assert!(wait_metric(src, "chunks_unrepairable_total", 1, Duration::from_secs(20)).await >= 1);
    // Give the chain time to move everything else.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for d in &c.daemons[1..] {
        assert_eq!(
            d.stats().await.unwrap().chunks_corrupt,
            0,
            "nothing corrupt was sent"
        );
        let (bytes, complete) = {
            let mut a = d.agent().await.unwrap();
            d.model_progress(&mut a, &digest).await.unwrap()
        };
        assert!(!complete, "{} cannot be complete", d.host_id);
        assert!(bytes < manifest.total_bytes());
    }
    assert_eq!(src.stats().await.unwrap().downstream_failovers, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlink_planted_in_a_running_receivers_memory_tier_is_refused() {
    let c = TestCluster::start(1, 2 * MIB, 1, |_, _| {}).await.unwrap();
    let (digest, _) = c.import_on_source().await.unwrap();
    let recv = &c.daemons[1];
    let outside = c.scratch.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, recv.memory_dir.join("models").join(&digest)).unwrap();
    c.start_chain(0, &digest, &[1], "").await.unwrap();
    assert!(
        wait_metric(
            recv,
            "store_symlinks_refused_total",
            1,
            Duration::from_secs(10)
        )
        .await
            >= 1
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        std::fs::read_dir(&outside).unwrap().next().is_none(),
        "nothing written through the symlink"
    );
    let mut a = recv.agent().await.unwrap();
    assert_eq!(recv.model_progress(&mut a, &digest).await.unwrap().0, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rot_is_repaired_before_a_hand_off_or_a_gpu_load() {
    use shardcast_protocol::agent::{GetHandoffRequest, LoadModelRequest};
    let c = TestCluster::start(
        0,
        4 * MIB,
        1,
        source_flags(&[
            "--reverify-after-ms",
            "0",
            "--scrub-rate",
            "off",
            "--gpu-backend",
            "simulated",
            "--sim-gpus",
            "1",
            "--sim-gpu-memory",
            "64MiB",
        ]),
    )
    .await
    .unwrap();
    let (digest, manifest) = c.import_on_source().await.unwrap();
    let d = &c.daemons[0];
    let file = shard_file(d, &digest, &manifest, 0);
    let mut agent = d.agent().await.unwrap();

    // Hand-off of the memory-tier files: refused while the chunk is being repaired.
    flip(&file, 4 * CHUNK + 3);
    let e = agent
        .get_handoff(GetHandoffRequest {
            model: digest.clone(),
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("corrupt at rest"), "{e:?}");
    assert_eq!(
        wait_metric(d, "chunks_repaired_total", 1, Duration::from_secs(10)).await,
        1
    );
    let h = agent
        .get_handoff(GetHandoffRequest {
            model: digest.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(h.json.contains("memory-file"), "{}", h.json);
    d.verify_copy(&manifest).unwrap();

    // A GPU load: the rotten chunk is repaired before it is copied.
    flip(&file, 7 * CHUNK + 11);
    agent
        .load_model(LoadModelRequest {
            heaviness: String::new(),
            model: digest.clone(),
            count: 1,
            gpus: vec![],
            partition: None,
        })
        .await
        .unwrap();
    shardcast_tests::wait_gpu_status(d, Duration::from_secs(30), |st| {
        let m = st.models.iter().find(|m| m.model == digest).unwrap();
        assert_ne!(m.state, "failed", "{m:?}");
        (m.state == "resident").then_some(())
    })
    .await;
    assert_eq!(metric(d, "chunks_corrupt_at_rest_total").await, 2);
    assert_eq!(metric(d, "chunks_repaired_total").await, 2);
    // The GPU region holds the origin's bytes.
    let h = agent
        .get_handoff(GetHandoffRequest {
            model: digest.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let h: serde_json::Value = serde_json::from_str(&h.json).unwrap();
    for dev in h["devices"].as_array().unwrap() {
        let path = dev["handle"]["path"].as_str().unwrap();
        let base = dev["handle"]["offset"].as_u64().unwrap();
        let gpu_mem = std::fs::read(path).unwrap();
        for s in h["shards"].as_array().unwrap() {
            let want = std::fs::read(c.origin.path().join(s["path"].as_str().unwrap())).unwrap();
            let at = (base + s["offset"].as_u64().unwrap()) as usize;
            assert!(gpu_mem[at..at + want.len()] == want[..], "{}", s["path"]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_answering_fetch_never_serves_its_rotten_chunk() {
    use shardcast_protocol::agent::{ImportModelRequest, Tier};
    // recv-1 is slow, so the head dies mid-way and recv-1 pulls the rest from the holder
    // (daemon 2), whose copy has one rotten chunk near the end.
    let mut c = TestCluster::start(2, 16 * MIB, 1, |i, o| match i {
        1 => o.ingress_rate = "100Mbit".into(),
        2 => o
            .extra_args
            .extend(["--reverify-after-ms", "0", "--scrub-rate", "off"].map(String::from)),
        _ => {}
    })
    .await
    .unwrap();
    let (digest, manifest) = c.import_on_source().await.unwrap();
    c.daemons[2]
        .agent()
        .await
        .unwrap()
        .import_model(ImportModelRequest {
            name: "test/model".into(),
            origin: c.origin_uri.clone(),
            chunk_size: CHUNK as u32,
            tier: Tier::Memory as i32,
            fetch: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let last = manifest.shards[0].chunks.len() as u64 - 1;
    flip(
        &shard_file(&c.daemons[2], &digest, &manifest, 0),
        (last - 2) * CHUNK + 5,
    );
    let fallback = format!("shardcast://{}", c.daemons[2].data_addr);
    c.start_chain(0, &digest, &[1], &fallback).await.unwrap();
    c.wait_bytes(1, &digest, 4 * MIB, Duration::from_secs(60))
        .await
        .unwrap();
    c.daemons[0].kill().await;
    c.wait(&[1], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    let recv = &c.daemons[1];
    recv.verify_copy(&manifest).unwrap();
    let st = recv.stats().await.unwrap();
    assert_eq!(
        st.chunks_corrupt, 0,
        "the holder never sent the rotten chunk"
    );
    assert_eq!(st.origin_bytes, 0, "recv-1 pulled from the holder only");
    let holder = &c.daemons[2];
    assert_eq!(metric(holder, "chunks_corrupt_at_rest_total").await, 1);
    assert_eq!(
        wait_metric(holder, "chunks_repaired_total", 1, Duration::from_secs(10)).await,
        1
    );
    holder.verify_copy(&manifest).unwrap();
}
