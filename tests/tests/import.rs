//! Importing models from origins through the agent API.

use std::time::Duration;

use shardcast_bench::cluster::{Daemon, DaemonOpts};
use shardcast_bench::synth::{self, SynthSpec};
use shardcast_protocol::agent::{ImportModelRequest, Tier};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_with_default_chunk_size_from_a_file_origin() {
    let origin = tempfile::tempdir().unwrap();
    synth::generate(
        origin.path(),
        &SynthSpec {
            total_bytes: 64 << 20,
            shards: 4,
            seed: 1,
        },
    )
    .unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let d = Daemon::start(scratch.path(), DaemonOpts::local("importer"))
        .await
        .unwrap();
    let req = ImportModelRequest {
        name: "synthetic/llm".into(),
        origin: format!("file://{}", origin.path().display()),
        chunk_size: 0,
        tier: Tier::Memory as i32,
        fetch: true,
        manifest: vec![],
    };
    let resp = tokio::time::timeout(
        Duration::from_secs(60),
        d.agent().await.unwrap().import_model(req),
    )
    .await
    .expect("import must not hang")
    .unwrap()
    .into_inner();
    assert_eq!(resp.shards, 5, "4 safetensors shards + the index");
    let manifest = shardcast_protocol::codec::decode_exact(resp.manifest.into()).unwrap();
    d.verify_copy(&manifest).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_from_a_rate_capped_http_origin() {
    use shardcast_bench::origin_server::{OriginStats, serve};
    use std::sync::Arc;
    let origin = tempfile::tempdir().unwrap();
    synth::generate(
        origin.path(),
        &SynthSpec {
            total_bytes: 16 << 20,
            shards: 2,
            seed: 2,
        },
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let stats = Arc::new(OriginStats::default());
    let cancel = tokio_util::sync::CancellationToken::new();
    tokio::spawn(serve(
        origin.path().to_path_buf(),
        listener,
        Some(100 << 20),
        stats.clone(),
        cancel.clone(),
    ));
    let scratch = tempfile::tempdir().unwrap();
    let d = Daemon::start(scratch.path(), DaemonOpts::local("importer"))
        .await
        .unwrap();
    let req = ImportModelRequest {
        name: "synthetic/llm".into(),
        origin: url,
        chunk_size: 0,
        tier: Tier::Disk as i32,
        fetch: true,
        manifest: vec![],
    };
    let resp = tokio::time::timeout(
        Duration::from_secs(60),
        d.agent().await.unwrap().import_model(req),
    )
    .await
    .expect("import must not hang")
    .unwrap()
    .into_inner();
    let manifest = shardcast_protocol::codec::decode_exact(resp.manifest.into()).unwrap();
    d.verify_copy(&manifest).unwrap();
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_and_http_origins_of_one_directory_give_the_same_digest() {
    use shardcast_bench::origin_server::{OriginStats, serve};
    use std::sync::Arc;
    let origin = tempfile::tempdir().unwrap();
    synth::generate(
        origin.path(),
        &SynthSpec {
            total_bytes: 8 << 20,
            shards: 3,
            seed: 3,
        },
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let cancel = tokio_util::sync::CancellationToken::new();
    tokio::spawn(serve(
        origin.path().to_path_buf(),
        listener,
        None,
        Arc::new(OriginStats::default()),
        cancel.clone(),
    ));
    let scratch = tempfile::tempdir().unwrap();
    let d = Daemon::start(scratch.path(), DaemonOpts::local("importer"))
        .await
        .unwrap();
    let mut digests = Vec::new();
    for origin in [format!("file://{}", origin.path().display()), url] {
        let req = ImportModelRequest {
            name: "m".into(),
            origin,
            ..Default::default()
        };
        digests.push(
            d.agent()
                .await
                .unwrap()
                .import_model(req)
                .await
                .unwrap()
                .into_inner()
                .digest,
        );
    }
    assert_eq!(digests[0], digests[1]);
    cancel.cancel();
}
