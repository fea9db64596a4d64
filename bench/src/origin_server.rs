//! A plain HTTP/1.1 file server that stands in for cloud object storage in benchmarks.
//!
//! It serves the files of one directory with `GET` and `HEAD`, honours a single
//! `Range: bytes=a-b`, `bytes=a-` or `bytes=-n` (206 with `Content-Range`; 416 when
//! unsatisfiable; anything else is ignored and the whole file sent, as RFC 9110 allows), and
//! refuses any request path that is not a valid [`ShardPath`] (400) or names no file (404).
//! All responses share one [`RateLimiter`], so N clients split the configured egress the way
//! they would split a bucket endpoint's bandwidth. Bodies are streamed in
//! [`PIECE`]-byte pieces, never loaded whole.
//!
//! `GET /_stats` returns `{"bytes_sent":N,"requests":N}`: payload bytes sent and requests
//! served, the `/_stats` requests themselves not counted.
//!
//! Tasks: [`serve`] runs the accept loop; each connection runs in its own task under a
//! `hyper` HTTP/1.1 connection, and a cancelled token stops accepting, lets in-flight
//! responses finish for up to [`SHUTDOWN_GRACE`], then drops the rest.

use std::convert::Infallible;
use std::io::{self, SeekFrom};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::Frame;
use hyper::header::{self, HeaderValue};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use shardcast_protocol::ShardPath;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use transferd::throttle::RateLimiter;

/// Bytes read from disk and sent per step of a response body (256 KiB). Rationale: each
/// piece takes one trip through the rate limiter and one blocking read; 256 KiB keeps both
/// overheads small while bounding memory per response and keeping rate shaping smooth
/// (2 ms of a 1 Gbit/s link).
pub const PIECE: usize = 256 << 10;

/// How long in-flight responses may run on after the cancel token fires.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Pause after a failed `accept` (e.g. out of file descriptors) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Counters of what the server has served.
#[derive(Debug, Default)]
pub struct OriginStats {
    /// Payload (file body) bytes sent.
    pub bytes_sent: AtomicU64,
    /// Requests served, excluding `GET /_stats`.
    pub requests: AtomicU64,
}

type Body = UnsyncBoxBody<Bytes, io::Error>;

struct Server {
    root: PathBuf,
    limiter: RateLimiter,
    stats: Arc<OriginStats>,
}

/// The counters as JSON (`{"bytes_sent":N,"requests":N}`), as `/_stats` serves them.
pub fn stats_json(stats: &OriginStats) -> serde_json::Value {
    serde_json::json!({
        "bytes_sent": stats.bytes_sent.load(Ordering::Relaxed),
        "requests": stats.requests.load(Ordering::Relaxed),
    })
}

/// Writes [`stats_json`] to `path` every 100 ms (write to a temporary name, then rename, so
/// readers never see half a file), and once more when `cancel` fires.
pub async fn write_stats_loop(stats: Arc<OriginStats>, path: PathBuf, cancel: CancellationToken) {
    let tmp = path.with_extension("tmp");
    loop {
        let done = tokio::select! {
            _ = cancel.cancelled() => true,
            _ = tokio::time::sleep(Duration::from_millis(100)) => false,
        };
        let body = stats_json(&stats).to_string();
        if tokio::fs::write(&tmp, body).await.is_ok() {
            let _ = tokio::fs::rename(&tmp, &path).await;
        }
        if done {
            return;
        }
    }
}

/// Reads a stats file written by [`write_stats_loop`]: payload bytes sent (0 if absent).
pub fn read_stats_file(path: &Path) -> u64 {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["bytes_sent"].as_u64())
        .unwrap_or(0)
}

/// Serves the files under `dir` on `listener` until `cancel` fires, capping total egress at
/// `rate` bytes per second (`None`: unlimited) and counting into `stats`.
pub async fn serve(
    dir: PathBuf,
    listener: TcpListener,
    rate: Option<u64>,
    stats: Arc<OriginStats>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let root = tokio::fs::canonicalize(&dir)
        .await
        .with_context(|| format!("origin directory {}", dir.display()))?;
    anyhow::ensure!(
        root.is_dir(),
        "origin directory {} is not a directory",
        root.display()
    );
    let server = Arc::new(Server {
        root,
        limiter: RateLimiter::new(rate),
        stats,
    });
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(serve_connection(server.clone(), stream, peer, cancel.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "origin server: accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
        }
    }
    let drain = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, drain).await.is_err() {
        tracing::debug!(
            left = connections.len(),
            "origin server: dropping connections"
        );
    }
    Ok(())
}

#[tracing::instrument(skip_all, fields(peer = %peer))]
async fn serve_connection(
    server: Arc<Server>,
    stream: TcpStream,
    peer: SocketAddr,
    cancel: CancellationToken,
) {
    let _ = stream.set_nodelay(true);
    let service = service_fn(move |req| {
        let server = server.clone();
        async move { Ok::<_, Infallible>(server.respond(req).await) }
    });
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    let mut conn = pin!(conn);
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = cancel.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "origin server: connection ended with an error");
    }
}

/// Which bytes of a file a request asked for.
#[derive(Debug, PartialEq, Eq)]
enum Span {
    /// The whole file (no range, or one this server ignores).
    Whole,
    /// Bytes `start..=end`.
    Part { start: u64, end: u64 },
    /// A range that selects no byte of the file.
    Unsatisfiable,
}

/// Interprets a `Range` header value for a file of `size` bytes.
fn parse_range(value: &str, size: u64) -> Span {
    let Some(spec) = value.trim().strip_prefix("bytes=") else {
        return Span::Whole;
    };
    // Multiple ranges would need multipart/byteranges; ignoring the header is allowed.
    let Some((first, last)) = spec.split_once('-').filter(|_| !spec.contains(',')) else {
        return Span::Whole;
    };
    let (first, last) = (first.trim(), last.trim());
    if first.is_empty() {
        // Suffix: the last `n` bytes.
        let Ok(n) = last.parse::<u64>() else {
            return Span::Whole;
        };
        if n == 0 || size == 0 {
            return Span::Unsatisfiable;
        }
        return Span::Part {
            start: size - n.min(size),
            end: size - 1,
        };
    }
    let Ok(start) = first.parse::<u64>() else {
        return Span::Whole;
    };
    let end = if last.is_empty() {
        u64::MAX
    } else {
        match last.parse::<u64>() {
            Ok(end) if end >= start => end,
            _ => return Span::Whole,
        }
    };
    if start >= size {
        return Span::Unsatisfiable;
    }
    Span::Part {
        start,
        end: end.min(size - 1),
    }
}

/// Decodes `%XX` escapes; `None` if malformed or not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut rest = s.as_bytes();
    while let Some((&b, tail)) = rest.split_first() {
        if b == b'%' {
            let hex = std::str::from_utf8(tail.get(..2)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            rest = &tail[2..];
        } else {
            out.push(b);
            rest = tail;
        }
    }
    String::from_utf8(out).ok()
}

fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A plain-text response with `status`.
fn text(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    let message = message.into() + "\n";
    let mut resp = Response::new(full(message));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    resp
}

impl Server {
    async fn respond(&self, req: Request<hyper::body::Incoming>) -> Response<Body> {
        let path = req.uri().path();
        if path == "/_stats" && req.method() == Method::GET {
            let body = stats_json(&self.stats);
            let mut resp = Response::new(full(body.to_string()));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            return resp;
        }
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let head = match *req.method() {
            Method::GET => false,
            Method::HEAD => true,
            _ => {
                let mut resp = text(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD");
                resp.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
                return resp;
            }
        };
        let shard = match path
            .strip_prefix('/')
            .and_then(percent_decode)
            .map(ShardPath::new)
        {
            Some(Ok(shard)) => shard,
            Some(Err(e)) => return text(StatusCode::BAD_REQUEST, e.to_string()),
            None => return text(StatusCode::BAD_REQUEST, "malformed percent-encoding"),
        };
        let range = req
            .headers()
            .get(header::RANGE)
            .and_then(|v| v.to_str().ok());
        match self.file_response(&shard, range, head).await {
            Ok(resp) => resp,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                text(StatusCode::NOT_FOUND, format!("{shard} not found"))
            }
            Err(e) => {
                tracing::warn!(%shard, error = %e, "origin server: cannot serve");
                text(StatusCode::INTERNAL_SERVER_ERROR, "read error")
            }
        }
    }

    async fn file_response(
        &self,
        shard: &ShardPath,
        range: Option<&str>,
        head: bool,
    ) -> io::Result<Response<Body>> {
        // A `ShardPath` cannot climb out with `..`; a symbolic link still could.
        let path = tokio::fs::canonicalize(self.root.join(shard.as_str())).await?;
        if !path.starts_with(&self.root) {
            return Ok(text(
                StatusCode::FORBIDDEN,
                format!("{shard} leaves the served directory"),
            ));
        }
        let mut file = tokio::fs::File::open(&path).await?;
        let meta = file.metadata().await?;
        if !meta.is_file() {
            return Err(io::ErrorKind::NotFound.into());
        }
        let size = meta.len();
        let (status, start, len) = match range.map_or(Span::Whole, |r| parse_range(r, size)) {
            Span::Whole => (StatusCode::OK, 0, size),
            Span::Part { start, end } => (StatusCode::PARTIAL_CONTENT, start, end - start + 1),
            Span::Unsatisfiable => {
                let mut resp = text(StatusCode::RANGE_NOT_SATISFIABLE, "range not satisfiable");
                insert(&mut resp, header::CONTENT_RANGE, format!("bytes */{size}"));
                return Ok(resp);
            }
        };
        let body = if head || len == 0 {
            empty()
        } else {
            file.seek(SeekFrom::Start(start)).await?;
            self.file_body(file, len, &path)
        };
        let mut resp = Response::new(body);
        *resp.status_mut() = status;
        insert(&mut resp, header::CONTENT_LENGTH, len.to_string());
        insert(&mut resp, header::ACCEPT_RANGES, "bytes".to_string());
        insert(
            &mut resp,
            header::CONTENT_TYPE,
            "application/octet-stream".to_string(),
        );
        if status == StatusCode::PARTIAL_CONTENT {
            let end = start + len - 1;
            insert(
                &mut resp,
                header::CONTENT_RANGE,
                format!("bytes {start}-{end}/{size}"),
            );
        }
        Ok(resp)
    }

    /// Streams `len` bytes from `file`'s current position, a [`PIECE`] at a time, each
    /// piece first cleared by the rate limiter.
    fn file_body(&self, file: tokio::fs::File, len: u64, path: &Path) -> Body {
        struct Reader {
            file: tokio::fs::File,
            left: u64,
            limiter: RateLimiter,
            stats: Arc<OriginStats>,
            path: PathBuf,
        }
        let reader = Reader {
            file,
            left: len,
            limiter: self.limiter.clone(),
            stats: self.stats.clone(),
            path: path.to_path_buf(),
        };
        let pieces = futures::stream::try_unfold(reader, |mut r| async move {
            if r.left == 0 {
                return Ok(None);
            }
            let n = r.left.min(PIECE as u64) as usize;
            r.limiter.acquire(n as u64).await;
            let mut buf = vec![0u8; n];
            r.file.read_exact(&mut buf).await.map_err(|e| {
                // The file shrank after its length was sent: abort the response.
                tracing::warn!(path = %r.path.display(), error = %e, "origin server: short file");
                e
            })?;
            r.left -= n as u64;
            r.stats.bytes_sent.fetch_add(n as u64, Ordering::Relaxed);
            Ok(Some((Frame::data(Bytes::from(buf)), r)))
        });
        StreamBody::new(pieces).boxed_unsync()
    }
}

fn insert(resp: &mut Response<Body>, name: header::HeaderName, value: String) {
    if let Ok(value) = HeaderValue::from_str(&value) {
        resp.headers_mut().insert(name, value);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::time::Instant;

    use shardcast_protocol::manifest::MIN_CHUNK_SIZE;
    use shardcast_protocol::origin_policy::{Enforcer, OriginPolicy};
    use shardcast_protocol::{Manifest, ModelName, ShardHasher};
    use tokio::io::AsyncWriteExt;
    use transferd::origin::{Origin, OriginAccess, OriginError, fetch_chunks};

    /// Origin access allowing everything under `base`.
    fn allow(base: &str) -> OriginAccess {
        OriginAccess::new(OriginPolicy::parse([base], Enforcer::Host).unwrap())
    }

    use super::*;

    struct Running {
        addr: SocketAddr,
        stats: Arc<OriginStats>,
        cancel: CancellationToken,
        task: tokio::task::JoinHandle<anyhow::Result<()>>,
        _dir: tempfile::TempDir,
    }

    fn content(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13) ^ seed ^ (i >> 9) as u8)
            .collect()
    }

    async fn start(files: &[(&str, &[u8])], rate: Option<u64>) -> Running {
        let dir = tempfile::tempdir().unwrap();
        for (name, data) in files {
            let p = dir.path().join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, data).unwrap();
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stats = Arc::new(OriginStats::default());
        let cancel = CancellationToken::new();
        let task = tokio::spawn(serve(
            dir.path().to_path_buf(),
            listener,
            rate,
            stats.clone(),
            cancel.clone(),
        ));
        Running {
            addr,
            stats,
            cancel,
            task,
            _dir: dir,
        }
    }

    struct Reply {
        status: u16,
        headers: HashMap<String, String>,
        body: Vec<u8>,
    }

    /// Sends one raw HTTP/1.1 request (no client-side path normalisation) and reads the
    /// whole reply.
    async fn raw(addr: SocketAddr, method: &str, target: &str, extra: &[(&str, &str)]) -> Reply {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut req = format!("{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
        for (k, v) in extra {
            req += &format!("{k}: {v}\r\n");
        }
        req += "\r\n";
        s.write_all(req.as_bytes()).await.unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).await.unwrap();
        let split = all.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        let head = std::str::from_utf8(&all[..split]).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers = lines
            .map(|l| {
                let (k, v) = l.split_once(':').unwrap();
                (k.trim().to_ascii_lowercase(), v.trim().to_string())
            })
            .collect();
        Reply {
            status,
            headers,
            body: all[split + 4..].to_vec(),
        }
    }

    #[tokio::test]
    async fn ranges() {
        let data = content(1, 1_000_000);
        let srv = start(&[("w.bin", &data), ("empty", b"")], None).await;
        let addr = srv.addr;
        let get = |range: &'static str| async move {
            raw(addr, "GET", "/w.bin", &[("Range", range)]).await
        };

        let r = raw(srv.addr, "GET", "/w.bin", &[]).await;
        assert_eq!((r.status, r.body.len()), (200, data.len()));
        assert_eq!(r.body, data);
        assert_eq!(r.headers["content-length"], "1000000");
        assert_eq!(r.headers["accept-ranges"], "bytes");

        let r = get("bytes=10-19").await;
        assert_eq!((r.status, &r.body[..]), (206, &data[10..20]));
        assert_eq!(r.headers["content-range"], "bytes 10-19/1000000");
        assert_eq!(r.headers["content-length"], "10");

        let r = get("bytes=999990-").await;
        assert_eq!((r.status, &r.body[..]), (206, &data[999_990..]));
        let r = get("bytes=-7").await;
        assert_eq!((r.status, &r.body[..]), (206, &data[999_993..]));
        assert_eq!(r.headers["content-range"], "bytes 999993-999999/1000000");
        let r = get("bytes=-5000000").await;
        assert_eq!((r.status, r.body.len()), (206, data.len()));
        let r = get("bytes=999999-5000000").await;
        assert_eq!((r.status, &r.body[..]), (206, &data[999_999..]));

        for bad in ["bytes=1000000-", "bytes=2000000-2000001", "bytes=-0"] {
            let r = get(bad).await;
            assert_eq!(r.status, 416, "{bad}");
            assert_eq!(r.headers["content-range"], "bytes */1000000");
        }
        let r = raw(srv.addr, "GET", "/empty", &[("Range", "bytes=0-")]).await;
        assert_eq!(r.status, 416);
        // Ranges this server ignores get the whole file.
        for ignored in ["bytes=0-1,5-6", "bytes=9-3", "items=0-1", "bytes=x-"] {
            let r = get(ignored).await;
            assert_eq!((r.status, r.body.len()), (200, data.len()), "{ignored}");
        }

        let r = raw(srv.addr, "HEAD", "/w.bin", &[]).await;
        assert_eq!((r.status, r.body.len()), (200, 0));
        assert_eq!(r.headers["content-length"], "1000000");
        let r = raw(srv.addr, "HEAD", "/w.bin", &[("Range", "bytes=0-99")]).await;
        assert_eq!(
            (r.status, r.headers["content-length"].as_str()),
            (206, "100")
        );
        let r = raw(srv.addr, "GET", "/empty", &[]).await;
        assert_eq!((r.status, r.body.len()), (200, 0));
    }

    #[tokio::test]
    async fn bad_paths_missing_files_and_methods() {
        let srv = start(&[("a/b.bin", b"hello")], None).await;
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"secret").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), srv._dir.path().join("link"))
            .unwrap();

        assert_eq!(raw(srv.addr, "GET", "/a/b.bin", &[]).await.body, b"hello");
        assert_eq!(raw(srv.addr, "GET", "/a%2Fb.bin", &[]).await.body, b"hello");
        for bad in [
            "/../etc/passwd",
            "/a/../../x",
            "/%2e%2e/x",
            "//etc/passwd",
            "/",
            "/a/./b.bin",
            "/%zz",
            "/a%00",
        ] {
            let r = raw(srv.addr, "GET", bad, &[]).await;
            assert_eq!(r.status, 400, "{bad}");
        }
        assert_eq!(raw(srv.addr, "GET", "/missing", &[]).await.status, 404);
        assert_eq!(
            raw(srv.addr, "GET", "/a", &[]).await.status,
            404,
            "a directory"
        );
        assert_eq!(raw(srv.addr, "GET", "/link", &[]).await.status, 403);
        let r = raw(srv.addr, "POST", "/a/b.bin", &[]).await;
        assert_eq!((r.status, r.headers["allow"].as_str()), (405, "GET, HEAD"));
    }

    #[tokio::test]
    async fn stats_count_bytes_and_requests() {
        let data = content(2, 600_000);
        let srv = start(&[("w.bin", &data)], None).await;
        raw(srv.addr, "GET", "/w.bin", &[]).await;
        raw(srv.addr, "GET", "/w.bin", &[("Range", "bytes=0-99")]).await;
        raw(srv.addr, "HEAD", "/w.bin", &[]).await;
        raw(srv.addr, "GET", "/nope", &[]).await;
        let r = raw(srv.addr, "GET", "/_stats", &[]).await;
        assert_eq!(r.status, 200);
        let stats: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(
            stats,
            serde_json::json!({"bytes_sent": 600_100, "requests": 4})
        );
        assert_eq!(srv.stats.bytes_sent.load(Ordering::Relaxed), 600_100);

        srv.cancel.cancel();
        srv.task.await.unwrap().unwrap();
        assert!(
            TcpStream::connect(srv.addr).await.is_err(),
            "stopped listening"
        );
    }

    #[tokio::test]
    async fn egress_is_capped_across_clients() {
        let data = content(3, 400_000);
        // 1 MB/s shared by four clients fetching 1.6 MB in all: about 1.6 s.
        let srv = start(&[("w.bin", &data)], Some(1_000_000)).await;
        let t = Instant::now();
        let fetches: Vec<_> = (0..4)
            .map(|_| raw(srv.addr, "GET", "/w.bin", &[]))
            .collect();
        for r in futures::future::join_all(fetches).await {
            assert_eq!(r.body.len(), data.len());
        }
        let took = t.elapsed().as_secs_f64();
        assert!((1.4..4.0).contains(&took), "took {took:.2}s");
    }

    /// The transferd HTTP origin, end to end against this server.
    #[tokio::test]
    async fn transferd_origin_reads_from_it() {
        let chunk = MIN_CHUNK_SIZE;
        let one = content(4, chunk as usize * 9 + 5);
        let two = content(5, chunk as usize * 2);
        let index = serde_json::json!({"weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }})
        .to_string();
        let srv = start(
            &[
                ("m/model.safetensors.index.json", index.as_bytes()),
                ("m/model-00001-of-00002.safetensors", &one),
                ("m/model-00002-of-00002.safetensors", &two),
                ("single/model.safetensors", &two),
            ],
            None,
        )
        .await;
        let base = format!("http://{}/", srv.addr);

        let origin = Origin::parse(&format!("{base}m/"), &allow(&base)).unwrap();
        let listed = origin.list().await.unwrap();
        // The two shards of the index, and the index itself.
        assert_eq!(listed.len(), 3);
        assert_eq!(listed[0].1, one.len() as u64);
        let name = ModelName::new("t/m").unwrap();
        let manifest = origin
            .build_manifest(name.clone(), chunk, &|_| {})
            .await
            .unwrap();
        let mut h = ShardHasher::new(chunk);
        h.update(&one);
        assert_eq!(manifest.shards[0], h.finish(listed[0].0.clone()));
        assert_eq!(
            &origin.read_range(&listed[1].0, 100, 50).await.unwrap()[..],
            &two[100..150]
        );

        let manifest = Arc::new(manifest);
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let fetch = {
            let (origin, manifest) = (origin.clone(), manifest.clone());
            tokio::spawn(async move {
                fetch_chunks(&origin, manifest, 0, (0..10).collect(), 4, tx).await
            })
        };
        let mut n = 0;
        while let Some(c) = rx.recv().await {
            let off = c.offset() as usize;
            assert_eq!(&c.data()[..], &one[off..off + c.data().len()]);
            n += 1;
        }
        fetch.await.unwrap().unwrap();
        assert_eq!(n, 10);
        let sent = srv.stats.bytes_sent.load(Ordering::Relaxed);
        // The origin counts shard bytes only; the server also sent the index twice (for
        // `list` and for `build_manifest`).
        assert_eq!(sent, origin.bytes_read() + 2 * index.len() as u64);
        assert_eq!(
            origin.bytes_read(),
            manifest.total_bytes() + 50 + one.len() as u64
        );

        let single = Origin::parse(&format!("{base}single/"), &allow(&base)).unwrap();
        let m = single.build_manifest(name, chunk, &|_| {}).await.unwrap();
        assert_eq!(m.shards.len(), 1);
        assert_eq!(m.shards[0].path.as_str(), "model.safetensors");
        let _: &Manifest = &m;

        let err = Origin::parse(&format!("{base}none/"), &allow(&base))
            .unwrap()
            .list()
            .await
            .unwrap_err();
        assert!(matches!(err, OriginError::NotFound { .. }), "{err}");
    }
}
