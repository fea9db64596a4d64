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

/// nginx serving `root` on a loopback port until dropped: one process (`master_process
/// off`, `daemon off`), so killing its PID stops it all.
struct Nginx {
    child: std::process::Child,
    url: String,
    access_log: std::path::PathBuf,
    /// Its config, logs and temporary files; removed when dropped.
    dir: tempfile::TempDir,
}

impl Nginx {
    /// The reason, when nginx is not installed or does not start.
    fn start(root: &Path) -> Result<Self, String> {
        let bin = ["/usr/sbin/nginx", "/usr/bin/nginx", "/usr/local/sbin/nginx"]
            .into_iter()
            .map(std::path::PathBuf::from)
            .find(|p| p.is_file())
            .ok_or("nginx not installed (.ci/setup installs nginx-light as root on Debian)")?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let d = dir.path().display();
        let conf = format!(
            "worker_processes 1; master_process off; daemon off;\n\
             error_log {d}/error.log; pid {d}/nginx.pid;\n\
             events {{ worker_connections 64; }}\n\
             http {{\n\
               access_log {d}/access.log;\n\
               client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;\n\
               fastcgi_temp_path {d}/fastcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n\
               types {{ application/json json; }} default_type application/octet-stream;\n\
               server {{ listen 127.0.0.1:{port}; root {root}; }}\n\
             }}\n",
            root = root.display()
        );
        let conf_path = dir.path().join("nginx.conf");
        std::fs::write(&conf_path, conf).map_err(|e| e.to_string())?;
        let child = std::process::Command::new(bin)
            .arg("-p")
            .arg(dir.path())
            .arg("-c")
            .arg(&conf_path)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| format!("starting nginx: {e}"))?;
        let mut n = Self {
            child,
            url: format!("http://127.0.0.1:{port}/"),
            access_log: dir.path().join("access.log"),
            dir,
        };
        // Ready once it accepts connections (bounded: 10 s).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = n.child.try_wait() {
                let log = std::fs::read_to_string(n.dir.path().join("error.log"));
                return Err(format!("nginx exited ({status}): {log:?}"));
            }
            if std::time::Instant::now() > deadline {
                return Err("nginx did not listen within 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(n)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP origin that is a real web server, not ours: nginx's index file, `HEAD` sizes and
/// whole-file `GET`s give the same manifest as the directory itself, and a second host
/// fetching that manifest's chunks reads them through nginx's `206` answers to ranged `GET`s,
/// byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nginx_origin_gives_the_same_model_as_its_directory() {
    let origin = model_dir(24 << 20, 3, 5);
    let nginx = match Nginx::start(origin.path()) {
        Ok(n) => n,
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    let scratch = tempfile::tempdir().unwrap();
    let uri = format!("file://{}", origin.path().display());
    let d = daemon(&scratch, &[&uri, &nginx.url]).await;
    let from_file = import(&d, uri, Tier::Memory, false).await;
    let from_nginx = import(&d, nginx.url.clone(), Tier::Memory, false).await;
    assert_eq!(from_file.digest, from_nginx.digest);

    let scratch2 = tempfile::tempdir().unwrap();
    let d2 = daemon(&scratch2, &[&nginx.url]).await;
    let req = ImportModelRequest {
        name: "synthetic/llm".into(),
        origin: nginx.url.clone(),
        tier: Tier::Memory as i32,
        fetch: true,
        manifest: from_file.manifest.clone(),
        ..Default::default()
    };
    let fetched = tokio::time::timeout(
        Duration::from_secs(60),
        d2.agent().await.unwrap().import_model(req),
    )
    .await
    .expect("fetch must not hang")
    .unwrap()
    .into_inner();
    assert_eq!(fetched.digest, from_file.digest);
    let manifest: Manifest =
        shardcast_protocol::codec::decode_exact(from_file.manifest.into()).unwrap();
    d2.verify_copy(&manifest).unwrap();
    // nginx answered ranged GETs with 206 (its access log: request line, then status), at
    // least one per 1 MiB chunk.
    let log = std::fs::read_to_string(&nginx.access_log).unwrap();
    let partial = log.lines().filter(|l| l.contains("\" 206 ")).count();
    assert!(partial >= 24, "ranged reads of a 24 MiB model:\n{log}");
}
