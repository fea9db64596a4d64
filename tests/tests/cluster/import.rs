//! Importing models from origins through the agent API.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use shardcast_bench::cluster::{Daemon, DaemonOpts};
use shardcast_bench::origin_server::{OriginStats, serve};
use shardcast_bench::synth::{self, SynthSpec};
use shardcast_protocol::Manifest;
use shardcast_protocol::agent::{ImportModelRequest, ImportModelResponse, Tier};
use tokio_util::sync::CancellationToken;

fn model_dir(total_bytes: u64, shards: usize, seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synth::generate(
        dir.path(),
        &SynthSpec {
            total_bytes,
            shards,
            seed,
        },
    )
    .unwrap();
    dir
}

/// Serves `dir` over HTTP (capped at `rate` bytes/s) until the token is cancelled.
async fn http_origin(dir: &Path, rate: Option<u64>) -> (String, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let cancel = CancellationToken::new();
    let stats = Arc::new(OriginStats::default());
    tokio::spawn(serve(
        dir.to_path_buf(),
        listener,
        rate,
        stats,
        cancel.clone(),
    ));
    (url, cancel)
}

async fn import(d: &Daemon, origin: String, tier: Tier, fetch: bool) -> ImportModelResponse {
    let req = ImportModelRequest {
        name: "synthetic/llm".into(),
        origin,
        tier: tier as i32,
        fetch,
        ..Default::default()
    };
    tokio::time::timeout(
        Duration::from_secs(60),
        d.agent().await.unwrap().import_model(req),
    )
    .await
    .expect("import must not hang")
    .unwrap()
    .into_inner()
}

/// A daemon allowed to read exactly the origins `allow`.
async fn daemon(scratch: &tempfile::TempDir, allow: &[&str]) -> Daemon {
    let mut o = DaemonOpts::local("importer");
    o.extra_args.extend(shardcast_tests::allow_args(allow));
    Daemon::start(scratch.path(), o).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_with_default_chunk_size_from_a_file_origin() {
    let origin = model_dir(64 << 20, 4, 1);
    let scratch = tempfile::tempdir().unwrap();
    let uri = format!("file://{}", origin.path().display());
    let d = daemon(&scratch, &[&uri]).await;
    let resp = import(&d, uri, Tier::Memory, true).await;
    assert_eq!(resp.shards, 5, "4 safetensors shards + the index");
    let manifest: Manifest = shardcast_protocol::codec::decode_exact(resp.manifest.into()).unwrap();
    d.verify_copy(&manifest).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_from_a_rate_capped_http_origin() {
    let origin = model_dir(16 << 20, 2, 2);
    let (url, cancel) = http_origin(origin.path(), Some(100 << 20)).await;
    let scratch = tempfile::tempdir().unwrap();
    let d = daemon(&scratch, &[&url]).await;
    let resp = import(&d, url, Tier::Disk, true).await;
    let manifest: Manifest = shardcast_protocol::codec::decode_exact(resp.manifest.into()).unwrap();
    d.verify_copy(&manifest).unwrap();
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_and_http_origins_of_one_directory_give_the_same_digest() {
    let origin = model_dir(8 << 20, 3, 3);
    let (url, cancel) = http_origin(origin.path(), None).await;
    let scratch = tempfile::tempdir().unwrap();
    let uri = format!("file://{}", origin.path().display());
    let d = daemon(&scratch, &[&uri, &url]).await;
    let from_file = import(&d, uri, Tier::Memory, false).await;
    let from_http = import(&d, url, Tier::Memory, false).await;
    assert_eq!(from_file.digest, from_http.digest);
    cancel.cancel();
}
