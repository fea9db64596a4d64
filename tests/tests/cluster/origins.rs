//! `s3://` and `hf://` origins on real daemons, against real servers the tests start:
//!
//! * S3: moto (an S3-compatible server from PyPI), installed into a virtual environment
//!   under `target/` and started by `tests/support/s3-server.sh`, with IAM authentication
//!   enforced so that wrong credentials are refused as by AWS; a small fault-injecting TCP
//!   proxy in front of it answers `503 SlowDown` with `Retry-After` once. The tests skip,
//!   saying why, only when python3 or pip are unavailable.
//! * Hugging Face: a local HTTP server laid out like the Hub (`/api/models/…/revision/…`
//!   and `/…/resolve/…/file` with ranges), requiring a bearer token.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use shardcast_bench::cluster::{Daemon, DaemonOpts};
use shardcast_bench::synth::{self, SynthSpec};
use shardcast_protocol::Manifest;
use shardcast_protocol::agent::{ImportModelRequest, ImportModelResponse, Tier};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::Code;

/// A synthetic model (2 safetensors shards + index) plus the non-weight files a Hub
/// repository carries.
fn model_dir(seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synth::generate(
        dir.path(),
        &SynthSpec {
            total_bytes: 6 << 20,
            shards: 2,
            seed,
        },
    )
    .unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        br#"{"model_type": "llama"}"#,
    )
    .unwrap();
    std::fs::create_dir_all(dir.path().join("tokenizer")).unwrap();
    std::fs::write(
        dir.path().join("tokenizer/tokenizer.json"),
        b"{\"vocab\": {}}",
    )
    .unwrap();
    dir
}

/// A daemon allowed to read `allow`, with `env` added to its environment.
async fn daemon(scratch: &tempfile::TempDir, allow: &[&str], env: &[(&str, &str)]) -> Daemon {
    let mut o = DaemonOpts::local("origins");
    o.extra_args.extend(shardcast_tests::allow_args(allow));
    o.env = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Daemon::start(scratch.path(), o).await.unwrap()
}

async fn import(
    d: &Daemon,
    origin: &str,
    fetch: bool,
) -> Result<ImportModelResponse, tonic::Status> {
    let req = ImportModelRequest {
        name: "test/model".into(),
        origin: origin.into(),
        tier: Tier::Memory as i32,
        fetch,
        ..Default::default()
    };
    tokio::time::timeout(
        Duration::from_secs(120),
        d.agent().await.unwrap().import_model(req),
    )
    .await
    .expect("import must not hang")
    .map(|r| r.into_inner())
}

fn manifest(resp: &ImportModelResponse) -> Manifest {
    shardcast_protocol::codec::decode_exact(resp.manifest.clone().into()).unwrap()
}

fn file_uri(dir: &Path) -> String {
    format!("file://{}/", dir.display())
}

// ---------------------------------------------------------------- S3 (moto)

/// A moto server, killed by PID when dropped.
struct Moto {
    child: Child,
    endpoint: String,
    key: String,
    secret: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts moto (installing it on first use), creates an IAM user, bucket `bucket` and
/// uploads `dir` under `prefix`. `None`, after printing why, when python3/pip are missing.
async fn moto(bucket: &str, prefix: &str, dir: &Path) -> Option<Moto> {
    let support = Path::new(env!("CARGO_MANIFEST_DIR")).join("support");
    let port = free_port();
    let log = tempfile::NamedTempFile::new().unwrap();
    let child = Command::new("bash")
        .arg(support.join("s3-server.sh"))
        .arg(port.to_string())
        // The IAM calls of s3-setup.py go unauthenticated; every later request is checked.
        .env("INITIAL_NO_AUTH_ACTION_COUNT", "3")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .expect("starting tests/support/s3-server.sh");
    let mut server = Moto {
        child,
        endpoint: format!("http://127.0.0.1:{port}"),
        key: String::new(),
        secret: String::new(),
    };
    // The first run installs moto into a venv: allow minutes.
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            let text = std::fs::read_to_string(log.path()).unwrap_or_default();
            if status.code() == Some(3) {
                eprintln!("SKIPPING s3:// origin test: no S3 test server can be set up: {text}");
                return None;
            }
            panic!("moto exited with {status}: {text}");
        }
        if TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "moto did not start in time");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let out = Command::new(target_dir().join("s3-test-venv/bin/python"))
        .arg(support.join("s3-setup.py"))
        .args([&server.endpoint, bucket, prefix])
        .arg(dir)
        .output()
        .expect("running tests/support/s3-setup.py");
    assert!(
        out.status.success(),
        "s3-setup.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let keys: BTreeMap<String, String> = serde_json::from_slice(&out.stdout).unwrap();
    server.key = keys["key"].clone();
    server.secret = keys["secret"].clone();
    Some(server)
}

/// A TCP proxy to `upstream` that answers the first request of the first connection with
/// `503 SlowDown` and `Retry-After: <retry_after>`, and pipes everything else through.
/// Returns its address and the number of requests it refused.
async fn slowdown_proxy(upstream: String, retry_after: u64) -> (String, Arc<AtomicU32>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let injected = Arc::new(AtomicU32::new(0));
    let count = injected.clone();
    tokio::spawn(async move {
        loop {
            let (mut client, _) = listener.accept().await.unwrap();
            let count = count.clone();
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if count
                    .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    // Read the request head (a GET/HEAD/LIST has no body), refuse it.
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match client.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
                    let resp = format!(
                        "HTTP/1.1 503 Service Unavailable\r\nRetry-After: {retry_after}\r\n\
                         Content-Type: application/xml\r\nContent-Length: {}\r\n\
                         Connection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = client.write_all(resp.as_bytes()).await;
                    let _ = client.shutdown().await;
                    return;
                }
                let addr = upstream.trim_start_matches("http://").to_string();
                let Ok(mut server) = TcpStream::connect(addr).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            });
        }
    });
    (addr, injected)
}

fn s3_env<'a>(m: &'a Moto, endpoint: &'a str, secret: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("AWS_ACCESS_KEY_ID", m.key.as_str()),
        ("AWS_SECRET_ACCESS_KEY", secret),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT_URL", endpoint),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_origin_byte_exact_and_clear_errors() {
    let dir = model_dir(11);
    let Some(m) = moto("models", "acme/llama", dir.path()).await else {
        return;
    };
    let file = file_uri(dir.path());
    let allow = ["s3://models/acme/", file.as_str()];

    // Right credentials: a fetched copy, byte-exact, with the same digest as file://.
    let scratch = tempfile::tempdir().unwrap();
    let d = daemon(&scratch, &allow, &s3_env(&m, &m.endpoint, &m.secret)).await;
    let from_s3 = import(&d, "s3://models/acme/llama/", true).await.unwrap();
    assert_eq!(from_s3.shards, 5, "2 shards + index + config + tokenizer");
    d.verify_copy(&manifest(&from_s3)).unwrap();
    let from_file = import(&d, &file, false).await.unwrap();
    assert_eq!(from_s3.digest, from_file.digest);
    // Without the trailing slash the key is tried as an object, then as a prefix.
    let no_slash = import(&d, "s3://models/acme/llama", false).await.unwrap();
    assert_eq!(no_slash.digest, from_file.digest);

    // A missing key or prefix.
    let e = import(&d, "s3://models/acme/missing/", false)
        .await
        .unwrap_err();
    eprintln!("missing prefix: {}", e.message());
    assert!(
        e.message()
            .contains("no such object s3://models/acme/missing"),
        "{e:?}"
    );
    let e = import(&d, "s3://models/acme/llama/config.json.gone", false)
        .await
        .unwrap_err();
    assert!(
        e.message()
            .contains("no such object s3://models/acme/llama/config.json.gone"),
        "{e:?}"
    );
    drop(d);

    // Wrong credentials.
    let scratch = tempfile::tempdir().unwrap();
    let d = daemon(&scratch, &allow, &s3_env(&m, &m.endpoint, "not-the-secret")).await;
    let e = import(&d, "s3://models/acme/llama/", false)
        .await
        .unwrap_err();
    eprintln!("wrong credentials: {}", e.message());
    assert!(
        e.message().contains("access denied") && e.message().contains("check credentials"),
        "{e:?}"
    );
    drop(d);

    // 503 SlowDown with Retry-After: waited for, then the import succeeds.
    let (proxy, injected) = slowdown_proxy(m.endpoint.clone(), 2).await;
    let scratch = tempfile::tempdir().unwrap();
    let d = daemon(&scratch, &allow, &s3_env(&m, &proxy, &m.secret)).await;
    let started = Instant::now();
    let resp = import(&d, "s3://models/acme/llama/", true).await.unwrap();
    assert_eq!(
        injected.load(Ordering::SeqCst),
        1,
        "the proxy refused one request"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "Retry-After: 2 was honoured ({:?})",
        started.elapsed()
    );
    assert_eq!(resp.digest, from_file.digest);
    d.verify_copy(&manifest(&resp)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_origin_outside_the_allow_list_is_refused_before_any_request() {
    // The "endpoint" only counts connections: none may arrive.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicU32::new(0));
    let seen = connections.clone();
    tokio::spawn(async move {
        while listener.accept().await.is_ok() {
            seen.fetch_add(1, Ordering::SeqCst);
        }
    });
    let scratch = tempfile::tempdir().unwrap();
    let env = [
        ("AWS_ACCESS_KEY_ID", "k"),
        ("AWS_SECRET_ACCESS_KEY", "s"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT_URL", endpoint.as_str()),
    ];
    let d = daemon(&scratch, &["s3://models/acme/"], &env).await;
    for uri in [
        "s3://models/other/llama/",
        "s3://models/acme-evil/llama/",
        "s3://models-evil/acme/llama/",
        "s3://models/",
        "s3://models/acme/.secret/",
    ] {
        let e = import(&d, uri, true).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{uri}: {e:?}");
    }
    assert_eq!(shardcast_tests::metric(&d, "origin_refused_total").await, 5);
    let e = import(&d, "s3://Bad_Bucket/x/", true).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(connections.load(Ordering::SeqCst), 0, "no request was made");
}

// ---------------------------------------------------------------- Hugging Face

const TOKEN: &str = "hf_right_token";

/// A Hub-like server for repository `acme/tiny` at revision `main`, serving `dir`.
struct Hub {
    files: BTreeMap<String, Vec<u8>>,
}

impl Hub {
    fn answer(&self, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        let reply = |status: StatusCode, body: Vec<u8>| {
            let mut r = Response::new(Full::new(Bytes::from(body)));
            *r.status_mut() = status;
            r
        };
        let auth = req
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if auth != Some(&format!("Bearer {TOKEN}")) {
            return reply(
                StatusCode::UNAUTHORIZED,
                br#"{"error":"Invalid credentials in Authorization header"}"#.to_vec(),
            );
        }
        let path = req.uri().path();
        if let Some(rev) = path.strip_prefix("/api/models/acme/tiny/revision/") {
            if rev != "main" {
                return reply(
                    StatusCode::NOT_FOUND,
                    br#"{"error":"Invalid rev id"}"#.to_vec(),
                );
            }
            let siblings: Vec<serde_json::Value> = self
                .files
                .iter()
                .map(|(name, data)| {
                    if name == "config.json" {
                        // No size: the daemon asks with HEAD.
                        serde_json::json!({ "rfilename": name })
                    } else {
                        serde_json::json!({ "rfilename": name, "size": data.len() })
                    }
                })
                .collect();
            let body =
                serde_json::json!({ "id": "acme/tiny", "sha": "0123abcd", "siblings": siblings });
            return reply(StatusCode::OK, serde_json::to_vec(&body).unwrap());
        }
        let Some(file) = path.strip_prefix("/acme/tiny/resolve/main/") else {
            return reply(StatusCode::NOT_FOUND, b"{}".to_vec());
        };
        let Some(data) = self.files.get(file) else {
            return reply(StatusCode::NOT_FOUND, b"{}".to_vec());
        };
        if req.method() == hyper::Method::HEAD {
            let mut r = reply(StatusCode::OK, vec![]);
            r.headers_mut()
                .insert(hyper::header::CONTENT_LENGTH, data.len().into());
            return r;
        }
        let Some(range) = req.headers().get(hyper::header::RANGE) else {
            return reply(StatusCode::OK, data.clone());
        };
        let (a, b) = range
            .to_str()
            .unwrap()
            .strip_prefix("bytes=")
            .unwrap()
            .split_once('-')
            .unwrap();
        let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
        if a >= data.len() {
            return reply(StatusCode::RANGE_NOT_SATISFIABLE, vec![]);
        }
        let b = b.min(data.len() - 1);
        let mut r = reply(StatusCode::PARTIAL_CONTENT, data[a..=b].to_vec());
        r.headers_mut().insert(
            hyper::header::CONTENT_RANGE,
            format!("bytes {a}-{b}/{}", data.len()).parse().unwrap(),
        );
        r
    }
}

/// Serves `dir` (plus a `.gitattributes`, which must be skipped) as `acme/tiny@main`.
async fn hub(dir: &Path) -> String {
    let mut files = BTreeMap::new();
    for entry in [
        "config.json",
        "tokenizer/tokenizer.json",
        "model.safetensors.index.json",
    ] {
        files.insert(entry.to_string(), std::fs::read(dir.join(entry)).unwrap());
    }
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".safetensors") {
            files.insert(name.clone(), std::fs::read(dir.join(&name)).unwrap());
        }
    }
    files.insert(
        ".gitattributes".into(),
        b"*.safetensors filter=lfs".to_vec(),
    );
    let hub = Arc::new(Hub { files });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let hub = hub.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let resp = hub.answer(&req);
                    async move { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    endpoint
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_origin_all_files_of_a_revision_with_a_token() {
    let dir = model_dir(12);
    let endpoint = hub(dir.path()).await;
    let file = file_uri(dir.path());
    let allow = ["hf://acme/tiny", file.as_str()];
    let no_token_file = tempfile::NamedTempFile::new().unwrap();
    let no_token_path = no_token_file.path().display().to_string();

    // The right token: every file of the revision, byte-exact, same digest as file://.
    let scratch = tempfile::tempdir().unwrap();
    let env = [("HF_ENDPOINT", endpoint.as_str()), ("HF_TOKEN", TOKEN)];
    let d = daemon(&scratch, &allow, &env).await;
    let from_hf = import(&d, "hf://acme/tiny@main", true).await.unwrap();
    assert_eq!(
        from_hf.shards, 5,
        "2 shards + index + config + tokenizer, no .gitattributes"
    );
    d.verify_copy(&manifest(&from_hf)).unwrap();
    let from_file = import(&d, &file, false).await.unwrap();
    assert_eq!(from_hf.digest, from_file.digest);
    let default_rev = import(&d, "hf://acme/tiny", false).await.unwrap();
    assert_eq!(
        default_rev.digest, from_file.digest,
        "no revision means main"
    );

    // An unknown revision.
    let e = import(&d, "hf://acme/tiny@nope", false).await.unwrap_err();
    eprintln!("unknown revision: {}", e.message());
    assert!(
        e.message().contains("acme/tiny@nope") && e.message().contains("not found"),
        "{e:?}"
    );
    // Outside the allow-list: refused before any request.
    let e = import(&d, "hf://acme/other", false).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    drop(d);

    // The token from a token file.
    let token_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(token_file.path(), format!("{TOKEN}\n")).unwrap();
    let token_path = token_file.path().display().to_string();
    let scratch = tempfile::tempdir().unwrap();
    let env = [
        ("HF_ENDPOINT", endpoint.as_str()),
        ("HF_TOKEN_PATH", token_path.as_str()),
    ];
    let d = daemon(&scratch, &allow, &env).await;
    let resp = import(&d, "hf://acme/tiny@main", false).await.unwrap();
    assert_eq!(resp.digest, from_file.digest);
    drop(d);

    // A wrong token, and none at all: a clear 401.
    for env in [
        vec![("HF_ENDPOINT", endpoint.as_str()), ("HF_TOKEN", "hf_wrong")],
        vec![
            ("HF_ENDPOINT", endpoint.as_str()),
            ("HF_TOKEN_PATH", no_token_path.as_str()),
        ],
    ] {
        let scratch = tempfile::tempdir().unwrap();
        let d = daemon(&scratch, &allow, &env).await;
        let e = import(&d, "hf://acme/tiny@main", true).await.unwrap_err();
        eprintln!("bad token: {}", e.message());
        assert!(
            e.message().contains("access denied")
                && e.message().contains("HF_TOKEN")
                && e.message().contains("401"),
            "{e:?}"
        );
    }
}

// ---------------------------------------------------------------- the `origin` benchmark

/// The servers `shardcast-bench origin` can run here: HTTP always, each S3 server once its
/// install succeeds (skipped, saying why, where python3/pip or node/npm are missing).
async fn bench_origins() -> Vec<shardcast_bench::origin_bench::OriginKind> {
    use shardcast_bench::origin_bench::{OriginKind, prepare};
    let mut kinds = vec![OriginKind::Http];
    for kind in [OriginKind::S3rver, OriginKind::Moto] {
        match prepare(kind).await {
            Ok(()) => kinds.push(kind),
            Err(e) => eprintln!("SKIPPING {} in the origin benchmark: {e:#}", kind.name()),
        }
    }
    kinds
}

/// `shardcast-bench origin` at a small size on loopback: each server's model read through a
/// real transferd (manifest, then ranged fetch), digest and copy exact, and the report
/// complete. Its namespace variant is in `tests/emulated.rs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_benchmark_reads_every_server_byte_exact() {
    use shardcast_bench::origin_bench::{OriginBenchOpts, run_origin_bench};
    let origins = bench_origins().await;
    let opts = OriginBenchOpts {
        emulate: false,
        size: 8 << 20,
        shards: 2,
        rate: None,
        origins: origins.clone(),
        origin_parallel: Some(4),
        chunk_size: 256 << 10,
        timeout: Duration::from_secs(120),
        iperf_seconds: 1,
    };
    let report = run_origin_bench(&opts).await.unwrap();
    assert_eq!(report.mode, "loopback");
    assert_eq!(report.chunk_size, 256 << 10);
    assert_eq!(report.origin_parallel, 4);
    assert_eq!(report.runs.len(), origins.len());
    for (run, kind) in report.runs.iter().zip(&origins) {
        assert_eq!(run.origin, *kind);
        assert!(run.digest_matches, "{}: the manifest differs", kind.name());
        assert!(run.verified, "{}: the copy is not exact", kind.name());
        assert!(run.fetch_mb_per_s > 0.0 && run.manifest_mb_per_s > 0.0);
        assert!(run.fetch_of_cap.is_none() && run.relay_cpu_s_per_gb.is_none());
    }
    let json = serde_json::to_value(&report).unwrap();
    assert!(json["runs"][0]["fetch_mb_per_s"].is_number(), "{json}");
}
