//! `s3://` and `hf://` origins on real daemons, against real servers the tests start:
//!
//! * S3: moto (an S3-compatible server from PyPI), installed into a virtual environment
//!   under `target/` and started by `tests/support/s3-server.sh`, with IAM authentication
//!   enforced so that wrong credentials are refused as by AWS; a small fault-injecting TCP
//!   proxy in front of it answers `503 SlowDown` with `Retry-After` once. The tests skip,
//!   saying why, only when python3 or pip are unavailable.
//! * Hugging Face: a local HTTP server following the Hub's API (`/api/models/…/revision/…`
//!   naming the commit, `/…/resolve/{branch or commit}/file` with ranges, a bearer token
//!   required), which redirects LFS files with `302` to a second local server standing in
//!   for the Hub's CDN (another port, so another origin, recording what it is sent). The
//!   real Hub is not reachable from the test machines.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
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
    import_with(d, req).await
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
                eprintln!("SKIPPED: s3:// origin test: no S3 test server can be set up: {text}");
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

/// The commit `main` names at first, and the one a push moves it to.
const COMMIT_A: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678";
const COMMIT_B: &str = "b2c3d4e5f60718293a4b5c6d7e8f90123456789a";

/// Every file of a Hub repository holding `dir` (plus a `.gitattributes`, which must be
/// skipped), by repository path.
fn repo_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
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
        b"*.safetensors filter=lfs diff=lfs merge=lfs -text".to_vec(),
    );
    files
}

/// Whether the Hub stores `path` in LFS (and so redirects its downloads to the CDN), as the
/// repository's `.gitattributes` says.
fn is_lfs(path: &str) -> bool {
    path.ends_with(".safetensors")
}

/// The next commit of a repository: every weight (LFS) byte changed, at the same sizes.
fn weights_changed(files: &BTreeMap<String, Vec<u8>>) -> BTreeMap<String, Vec<u8>> {
    let mut next = files.clone();
    for (path, data) in next.iter_mut() {
        if is_lfs(path) {
            data.iter_mut().for_each(|b| *b ^= 0x5a);
        }
    }
    next
}

/// The CDN's name for a file's content (the real one uses the LFS SHA-256; BLAKE3 stands in).
fn oid(data: &[u8]) -> String {
    shardcast_protocol::ModelDigest::of(data).to_hex()
}

/// `data` answered as a static file server does: `HEAD` with its length, a single `Range`
/// with `206` (or `416`), else the whole file.
fn file_response(req: &Request<hyper::body::Incoming>, data: &[u8]) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: Vec<u8>| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut()
            .insert(hyper::header::ACCEPT_RANGES, "bytes".parse().unwrap());
        r
    };
    if req.method() == hyper::Method::HEAD {
        let mut r = reply(StatusCode::OK, vec![]);
        r.headers_mut()
            .insert(hyper::header::CONTENT_LENGTH, data.len().into());
        return r;
    }
    let Some(range) = req.headers().get(hyper::header::RANGE) else {
        return reply(StatusCode::OK, data.to_vec());
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

fn plain(status: StatusCode, body: &[u8]) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::copy_from_slice(body)));
    *r.status_mut() = status;
    r
}

/// Serves HTTP/1.1 on `listener` with `answer`.
fn serve<T, F>(listener: TcpListener, server: Arc<T>, answer: F)
where
    T: Send + Sync + 'static,
    F: Fn(&T, &Request<hyper::body::Incoming>) -> Response<Full<Bytes>>
        + Copy
        + Send
        + Sync
        + 'static,
{
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let server = server.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let resp = answer(&server, &req);
                    async move { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
}

/// One request the CDN received.
#[derive(Debug)]
struct CdnRequest {
    method: String,
    path: String,
    authorization: Option<String>,
    range: Option<String>,
}

/// A CDN-like server (on its own port, so another origin than the Hub) holding LFS objects
/// by content, read through the pre-signed URLs the Hub redirects to (no token needed:
/// the signature is the credential). Records every request with its `Authorization`.
struct Cdn {
    base: String,
    objects: Mutex<BTreeMap<String, Vec<u8>>>,
    requests: Mutex<Vec<CdnRequest>>,
}

impl Cdn {
    async fn start() -> Arc<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let cdn = Arc::new(Self {
            base: format!("http://{}", listener.local_addr().unwrap()),
            objects: Mutex::default(),
            requests: Mutex::default(),
        });
        serve(listener, cdn.clone(), Self::answer);
        cdn
    }

    fn answer(&self, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        let header = |name| {
            req.headers()
                .get(name)
                .map(|v| v.to_str().unwrap_or("<not text>").to_string())
        };
        self.requests.lock().unwrap().push(CdnRequest {
            method: req.method().to_string(),
            path: req.uri().path().to_string(),
            authorization: header(hyper::header::AUTHORIZATION),
            range: header(hyper::header::RANGE),
        });
        if !req.uri().query().unwrap_or("").contains("X-Amz-Signature=") {
            return plain(
                StatusCode::FORBIDDEN,
                b"<Error><Code>AccessDenied</Code></Error>",
            );
        }
        let Some(oid) = req.uri().path().strip_prefix("/repos/acme/tiny/") else {
            return plain(
                StatusCode::NOT_FOUND,
                b"<Error><Code>NoSuchKey</Code></Error>",
            );
        };
        match self.objects.lock().unwrap().get(oid) {
            Some(data) => file_response(req, data),
            None => plain(
                StatusCode::NOT_FOUND,
                b"<Error><Code>NoSuchKey</Code></Error>",
            ),
        }
    }
}

/// A Hub-like server for repository `acme/tiny`, following the documented Hub API as far as
/// transferd uses it:
///
/// * `GET /api/models/acme/tiny/revision/{rev}?blobs=true`: the commit `rev` names (`sha`)
///   and its `siblings` (`rfilename`, `size`, and `blobId` and `lfs` for LFS files);
/// * `GET`/`HEAD /acme/tiny/resolve/{rev}/{path}`, `rev` a branch (`main`) or a commit:
///   a non-LFS file served directly (with `Range`, `ETag`, `X-Repo-Commit`); an LFS file,
///   when a CDN is attached, answered `302 Found` with `Location` a pre-signed CDN URL,
///   `X-Linked-Size`, `X-Linked-Etag` and `X-Repo-Commit`, as the Hub does.
///
/// Every request needs the bearer token. Each commit has its own files, so a file read from
/// the wrong commit has the wrong bytes; `push` moves `main` right after a listing of it.
struct Hub {
    commits: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
    /// The commit `main` names now.
    main: Mutex<String>,
    /// Where `main` moves right after the next listing of it is answered.
    push: Mutex<Option<String>>,
    /// Whether listings carry `sha` (older servers and some mirrors send none).
    with_sha: bool,
    cdn: Option<Arc<Cdn>>,
    /// Every request: method, path and whether it carried the token.
    requests: Mutex<Vec<(String, String, bool)>>,
}

impl Hub {
    /// Starts a Hub whose `main` names the first of `commits`, redirecting LFS downloads to
    /// `cdn` when given. Returns it and its endpoint.
    async fn start(
        commits: Vec<(&str, BTreeMap<String, Vec<u8>>)>,
        cdn: Option<Arc<Cdn>>,
        with_sha: bool,
    ) -> (Arc<Self>, String) {
        if let Some(cdn) = &cdn {
            let mut objects = cdn.objects.lock().unwrap();
            for (_, files) in &commits {
                for data in files.iter().filter(|(p, _)| is_lfs(p)).map(|(_, d)| d) {
                    objects.insert(oid(data), data.clone());
                }
            }
        }
        let hub = Arc::new(Self {
            main: Mutex::new(commits[0].0.to_string()),
            commits: commits
                .into_iter()
                .map(|(c, files)| (c.to_string(), files))
                .collect(),
            push: Mutex::default(),
            with_sha,
            cdn,
            requests: Mutex::default(),
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        serve(listener, hub.clone(), Self::answer);
        (hub, endpoint)
    }

    /// The commit `rev` names: `main`'s, or a commit given by its id.
    fn commit(&self, rev: &str) -> Option<String> {
        if rev == "main" {
            return Some(self.main.lock().unwrap().clone());
        }
        self.commits.contains_key(rev).then(|| rev.to_string())
    }

    /// Paths of the `resolve` requests received, only `GET`s unless `heads`.
    fn resolved(&self, heads: bool) -> Vec<String> {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|(method, path, _)| path.contains("/resolve/") && (heads || method == "GET"))
            .map(|(_, path, _)| path.clone())
            .collect()
    }

    fn answer(&self, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        let auth = req
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        let authorized = auth == Some(&format!("Bearer {TOKEN}"));
        let path = req.uri().path().to_string();
        self.requests
            .lock()
            .unwrap()
            .push((req.method().to_string(), path.clone(), authorized));
        if !authorized {
            return plain(
                StatusCode::UNAUTHORIZED,
                br#"{"error":"Invalid credentials in Authorization header"}"#,
            );
        }
        let rev_not_found = || {
            let mut r = plain(StatusCode::NOT_FOUND, br#"{"error":"Invalid rev id"}"#);
            r.headers_mut()
                .insert("x-error-code", "RevisionNotFound".parse().unwrap());
            r
        };
        if let Some(rev) = path.strip_prefix("/api/models/acme/tiny/revision/") {
            let Some(commit) = self.commit(rev) else {
                return rev_not_found();
            };
            let siblings: Vec<serde_json::Value> = self.commits[&commit]
                .iter()
                .map(|(name, data)| {
                    if name == "config.json" {
                        // No size: the daemon asks with HEAD.
                        serde_json::json!({ "rfilename": name })
                    } else if is_lfs(name) {
                        serde_json::json!({
                            "rfilename": name,
                            "blobId": &oid(name.as_bytes())[..40],
                            "size": data.len(),
                            "lfs": { "sha256": oid(data), "size": data.len(), "pointerSize": 134 },
                        })
                    } else {
                        serde_json::json!({
                            "rfilename": name,
                            "blobId": &oid(data)[..40],
                            "size": data.len(),
                        })
                    }
                })
                .collect();
            let mut body = serde_json::json!({
                "_id": "0123456789abcdef01234567",
                "id": "acme/tiny",
                "modelId": "acme/tiny",
                "private": true,
                "sha": commit,
                "siblings": siblings,
            });
            if !self.with_sha {
                body.as_object_mut().unwrap().remove("sha");
            }
            if rev == "main"
                && let Some(next) = self.push.lock().unwrap().take()
            {
                *self.main.lock().unwrap() = next;
            }
            let mut r = plain(StatusCode::OK, &serde_json::to_vec(&body).unwrap());
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                "application/json".parse().unwrap(),
            );
            return r;
        }
        let Some((rev, file)) = path
            .strip_prefix("/acme/tiny/resolve/")
            .and_then(|rest| rest.split_once('/'))
        else {
            return plain(StatusCode::NOT_FOUND, b"{}");
        };
        let Some(commit) = self.commit(rev) else {
            return rev_not_found();
        };
        let Some(data) = self.commits[&commit].get(file) else {
            let mut r = plain(StatusCode::NOT_FOUND, br#"{"error":"Entry not found"}"#);
            r.headers_mut()
                .insert("x-error-code", "EntryNotFound".parse().unwrap());
            return r;
        };
        let etag = format!("\"{}\"", oid(data));
        let mut r = match &self.cdn {
            Some(cdn) if is_lfs(file) => {
                let location = format!(
                    "{}/repos/acme/tiny/{}?X-Amz-Expires=3600&X-Amz-Signature=f00d",
                    cdn.base,
                    oid(data)
                );
                let mut r = plain(StatusCode::FOUND, b"");
                let h = r.headers_mut();
                h.insert(hyper::header::LOCATION, location.parse().unwrap());
                h.insert("x-linked-size", data.len().into());
                h.insert("x-linked-etag", etag.parse().unwrap());
                r
            }
            _ => {
                let mut r = file_response(req, data);
                r.headers_mut()
                    .insert(hyper::header::ETAG, etag.parse().unwrap());
                r
            }
        };
        r.headers_mut()
            .insert("x-repo-commit", commit.parse().unwrap());
        r
    }
}

/// Starts a Hub serving `dir` at commit [`COMMIT_A`] as `acme/tiny@main`, files served
/// directly. Returns it and its endpoint.
async fn hub(dir: &Path) -> (Arc<Hub>, String) {
    Hub::start(vec![(COMMIT_A, repo_files(dir))], None, true).await
}

async fn import_with(
    d: &Daemon,
    req: ImportModelRequest,
) -> Result<ImportModelResponse, tonic::Status> {
    tokio::time::timeout(
        Duration::from_secs(120),
        d.agent().await.unwrap().import_model(req),
    )
    .await
    .expect("import must not hang")
    .map(|r| r.into_inner())
}

/// Fetches the model `manifest` describes from `origin` without building a manifest (as a
/// host does after the import: every read a ranged chunk read, verified).
async fn fetch_known(
    d: &Daemon,
    origin: &str,
    manifest: &ImportModelResponse,
) -> Result<ImportModelResponse, tonic::Status> {
    let req = ImportModelRequest {
        name: "test/model".into(),
        origin: origin.into(),
        tier: Tier::Memory as i32,
        fetch: true,
        manifest: manifest.manifest.clone(),
        ..Default::default()
    };
    import_with(d, req).await
}

/// Asserts every file was read (and sized, unless `heads` is false) from
/// `resolve/{commit}/`, never by branch.
fn assert_read_at(hub: &Hub, commit: &str) {
    assert_read_at_with(hub, commit, true);
}

fn assert_read_at_with(hub: &Hub, commit: &str, heads: bool) {
    let resolved = hub.resolved(heads);
    assert!(!resolved.is_empty(), "no file was read");
    let want = format!("/acme/tiny/resolve/{commit}/");
    for path in &resolved {
        assert!(path.starts_with(&want), "{path} is not read at {commit}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_origin_all_files_of_a_revision_with_a_token() {
    let dir = model_dir(12);
    let (hub, endpoint) = hub(dir.path()).await;
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
    // Every file (and the HEAD for config.json) read at the commit `main` named.
    assert_read_at(&hub, COMMIT_A);
    let from_file = import(&d, &file, false).await.unwrap();
    assert_eq!(from_hf.digest, from_file.digest);
    let default_rev = import(&d, "hf://acme/tiny", false).await.unwrap();
    assert_eq!(
        default_rev.digest, from_file.digest,
        "no revision means main"
    );
    assert_read_at(&hub, COMMIT_A);

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

/// A Hub serving `commits` (listings with `sha`) whose weight files redirect to a new CDN;
/// also the Hub's endpoint, and the allow-list entries a daemon needs to import through
/// both: the repository and the CDN's prefix (plain HTTP on loopback: a redirect target only
/// when listed), then `extra`.
async fn hub_with_cdn(
    commits: Vec<(&str, BTreeMap<String, Vec<u8>>)>,
    extra: &[&str],
) -> (Arc<Hub>, String, Arc<Cdn>, Vec<String>) {
    let cdn = Cdn::start().await;
    let (hub, endpoint) = Hub::start(commits, Some(cdn.clone()), true).await;
    let mut allow = vec!["hf://acme/tiny".to_string(), format!("{}/", cdn.base)];
    allow.extend(extra.iter().map(|s| s.to_string()));
    (hub, endpoint, cdn, allow)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_origin_weights_come_from_the_cdn_without_the_token() {
    let dir = model_dir(13);
    let file = file_uri(dir.path());
    let (hub, endpoint, cdn, allow) =
        hub_with_cdn(vec![(COMMIT_A, repo_files(dir.path()))], &[&file]).await;
    let allow: Vec<&str> = allow.iter().map(String::as_str).collect();
    let env = [("HF_ENDPOINT", endpoint.as_str()), ("HF_TOKEN", TOKEN)];

    // The import: each weight file streamed whole from the CDN after the Hub's 302.
    let scratch = tempfile::tempdir().unwrap();
    let d = daemon(&scratch, &allow, &env).await;
    let from_hf = import(&d, "hf://acme/tiny@main", true).await.unwrap();
    d.verify_copy(&manifest(&from_hf)).unwrap();
    let from_file = import(&d, &file, false).await.unwrap();
    assert_eq!(from_hf.digest, from_file.digest);
    drop(d);

    // Another host fetching the model by its manifest: ranged chunk reads, redirected too.
    let scratch = tempfile::tempdir().unwrap();
    let d = daemon(&scratch, &allow, &env).await;
    let fetched = fetch_known(&d, "hf://acme/tiny@main", &from_hf)
        .await
        .unwrap();
    assert_eq!(fetched.digest, from_hf.digest);
    d.verify_copy(&manifest(&from_hf)).unwrap();

    assert_read_at(&hub, COMMIT_A);
    let hub_requests = hub.requests.lock().unwrap();
    assert!(
        hub_requests.iter().all(|(_, _, token)| *token),
        "every Hub request carried the token: {hub_requests:?}"
    );
    let weights = hub_requests
        .iter()
        .filter(|(_, path, _)| path.contains("/resolve/") && is_lfs(path))
        .count();
    assert!(weights >= 2, "the weights were asked of the Hub first");
    let cdn_requests = cdn.requests.lock().unwrap();
    assert!(
        cdn_requests
            .iter()
            .filter(|r| r.method == "GET" && r.range.is_none())
            .count()
            >= 2,
        "the import streamed both weight files from the CDN: {cdn_requests:?}"
    );
    assert!(
        cdn_requests
            .iter()
            .any(|r| r.method == "GET" && r.range.is_some()),
        "chunk reads went to the CDN with their ranges: {cdn_requests:?}"
    );
    for r in cdn_requests.iter() {
        assert!(
            r.path.starts_with("/repos/acme/tiny/"),
            "unexpected CDN request {r:?}"
        );
        assert_eq!(r.authorization, None, "the token reached the CDN: {r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_origin_redirect_outside_the_allow_list_is_refused() {
    let dir = model_dir(14);
    let cdn = Cdn::start().await;
    let (_hub, endpoint) = Hub::start(
        vec![(COMMIT_A, repo_files(dir.path()))],
        Some(cdn.clone()),
        true,
    )
    .await;
    // The Hub is allowed; the plain-HTTP loopback CDN it redirects to is not.
    let scratch = tempfile::tempdir().unwrap();
    let env = [("HF_ENDPOINT", endpoint.as_str()), ("HF_TOKEN", TOKEN)];
    let d = daemon(&scratch, &["hf://acme/tiny"], &env).await;
    let e = import(&d, "hf://acme/tiny@main", true).await.unwrap_err();
    eprintln!("redirect refused: {}", e.message());
    assert!(
        e.message().contains("redirect refused")
            && e.message().contains(&cdn.base)
            && e.message().contains("outside the origin allow-list"),
        "{e:?}"
    );
    assert!(shardcast_tests::metric(&d, "origin_refused_total").await >= 1);
    assert!(
        cdn.requests.lock().unwrap().is_empty(),
        "nothing was asked of the CDN"
    );
    let held = d
        .agent()
        .await
        .unwrap()
        .list_holdings(shardcast_protocol::agent::ListHoldingsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(held.models.is_empty(), "nothing was imported: {held:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_origin_reads_one_commit_while_the_branch_moves() {
    let dir = model_dir(15);
    let first = repo_files(dir.path());
    // The next commit: every weight byte changed, config.json longer.
    let mut next = weights_changed(&first);
    next.insert(
        "config.json".into(),
        br#"{"model_type": "llama", "revision": 2}"#.to_vec(),
    );
    let file = file_uri(dir.path());
    let (hub, endpoint, _cdn, allow) =
        hub_with_cdn(vec![(COMMIT_A, first), (COMMIT_B, next)], &[&file]).await;
    let allow: Vec<&str> = allow.iter().map(String::as_str).collect();
    let env = [("HF_ENDPOINT", endpoint.as_str()), ("HF_TOKEN", TOKEN)];

    // `main` moves to the next commit right after the import listed it: the manifest is
    // still the first commit's, every file read from it.
    *hub.push.lock().unwrap() = Some(COMMIT_B.into());
    let scratch = tempfile::tempdir().unwrap();
    let d = daemon(&scratch, &allow, &env).await;
    let built = import(&d, "hf://acme/tiny@main", false).await.unwrap();
    assert_eq!(*hub.main.lock().unwrap(), COMMIT_B, "main moved");
    // The answer names the commit it read, for the controller to record.
    assert_eq!(built.resolved_origin, format!("hf://acme/tiny@{COMMIT_A}"));
    let from_file = import(&d, &file, false).await.unwrap();
    assert_eq!(built.digest, from_file.digest, "the first commit's model");
    assert_eq!(
        from_file.resolved_origin, "",
        "a directory names no version"
    );
    assert_read_at(&hub, COMMIT_A);

    // Fetching it later on the same host: from the commit it was built from, although
    // `main` names another now.
    let fetched = fetch_known(&d, "hf://acme/tiny@main", &built)
        .await
        .unwrap();
    assert_eq!(fetched.digest, built.digest);
    d.verify_copy(&manifest(&built)).unwrap();
    assert_read_at(&hub, COMMIT_A);
    drop(d);

    // A host that did not build it finds `main` moved: a clear error, nothing mixed in.
    let scratch = tempfile::tempdir().unwrap();
    let d = daemon(&scratch, &allow, &env).await;
    let e = fetch_known(&d, "hf://acme/tiny@main", &built)
        .await
        .unwrap_err();
    eprintln!("moved branch: {}", e.message());
    assert!(
        e.message()
            .contains(&format!("hf://acme/tiny@main now names commit {COMMIT_B}"))
            && e.message().contains("config.json is")
            && e.message().contains("the revision moved"),
        "{e:?}"
    );
    // It sized config.json at the new commit (HEAD) but read nothing from it.
    assert_read_at_with(&hub, COMMIT_A, false);
    // Naming the commit reads it.
    let pinned = format!("hf://acme/tiny@{COMMIT_A}");
    let fetched = fetch_known(&d, &pinned, &built).await.unwrap();
    assert_eq!(fetched.digest, built.digest);
    d.verify_copy(&manifest(&built)).unwrap();
    assert_read_at_with(&hub, COMMIT_A, false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_origin_listing_without_a_commit_reads_by_revision() {
    let dir = model_dir(16);
    let (hub, endpoint) = Hub::start(vec![(COMMIT_A, repo_files(dir.path()))], None, false).await;
    let file = file_uri(dir.path());
    let allow = ["hf://acme/tiny", file.as_str()];
    let scratch = tempfile::tempdir().unwrap();
    let env = [("HF_ENDPOINT", endpoint.as_str()), ("HF_TOKEN", TOKEN)];
    let d = daemon(&scratch, &allow, &env).await;
    let from_hf = import(&d, "hf://acme/tiny@main", true).await.unwrap();
    d.verify_copy(&manifest(&from_hf)).unwrap();
    let from_file = import(&d, &file, false).await.unwrap();
    assert_eq!(from_hf.digest, from_file.digest);
    assert_read_at(&hub, "main");
    let log = std::fs::read_to_string(&d.log).unwrap();
    assert!(
        log.contains("names no commit") && log.contains("reading files by revision main"),
        "the daemon says it reads by revision: {log}"
    );
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
            Err(e) => eprintln!("SKIPPED: {} in the origin benchmark: {e:#}", kind.name()),
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

/// Through the controller: registering `hf://org/name@main` records the commit the
/// registering host read (`read_origin`), and every later read goes there. `main` moves
/// right after the registration's listing; a prewarm whose receivers each download from
/// the origin still gets the registered version, byte-exact, read at the first commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_registration_pins_the_commit_for_every_later_read() {
    use shardcast_bench::control::{ManagedCluster, wait_plan};
    use shardcast_protocol::controller::{PrewarmRequest, RegisterModelRequest};
    let dir = model_dir(17);
    let first = repo_files(dir.path());
    let next = weights_changed(&first);
    let (hub, endpoint) = Hub::start(vec![(COMMIT_A, first), (COMMIT_B, next)], None, true).await;
    let allow = shardcast_tests::allow_args(&["hf://acme/tiny"]);
    let mut ctl_args = allow.clone();
    ctl_args.extend(["--register-keep-copy".into(), "false".into()]);
    let c = ManagedCluster::start(2, ctl_args, |_, o| {
        o.extra_args.extend(allow.clone());
        o.env = vec![
            ("HF_ENDPOINT".into(), endpoint.clone()),
            ("HF_TOKEN".into(), TOKEN.into()),
        ];
    })
    .await
    .unwrap();
    let mut api = c.controller.client().await.unwrap();
    *hub.push.lock().unwrap() = Some(COMMIT_B.into());
    let info = api
        .register_model(RegisterModelRequest {
            name: "acme/tiny".into(),
            origin: "hf://acme/tiny@main".into(),
            chunk_size: 256 << 10,
            via_host: c.daemons[0].host_id.to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(*hub.main.lock().unwrap(), COMMIT_B, "main moved");
    // The registry keeps the origin as given; hosts read the commit.
    assert_eq!(info.origin, "hf://acme/tiny@main");
    let manifest: Manifest = shardcast_protocol::codec::decode_exact(info.manifest.into()).unwrap();
    let a = api
        .prewarm(PrewarmRequest {
            model: "acme/tiny".into(),
            hosts: c.daemons.iter().map(|d| d.host_id.to_string()).collect(),
            tier: shardcast_protocol::controller::Tier::Memory as i32,
            sources: "origin".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let done = wait_plan(&mut api, &a.plan_id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done.state().label(), "done", "{done:?}");
    for d in &c.daemons {
        d.verify_copy(&manifest).unwrap();
    }
    // Every file request, the registration's and each receiver's, at the first commit
    // (without the pin a receiver lists `main`, now the second commit, and fails).
    assert_read_at_with(&hub, COMMIT_A, false);
}
