//! Shared helpers for the integration tests: start a cluster of real `transferd`
//! processes on loopback with a synthetic model in a `file://` origin.

use std::time::{Duration, Instant};

use anyhow::Context;
use shardcast_bench::cluster::{Daemon, DaemonOpts, wait_complete};
use shardcast_bench::synth::{self, SynthSpec};
use shardcast_protocol::agent::{Chain, ImportModelRequest, StartChainRequest, Tier};
use shardcast_protocol::{HopTransport, Manifest};

use shardcast_protocol::codec::decode_exact;

/// A test cluster: daemon 0 is the source, the rest are receivers.
pub struct TestCluster {
    /// The daemons.
    pub daemons: Vec<Daemon>,
    /// The origin directory.
    pub origin: tempfile::TempDir,
    /// `file://` URI of the origin.
    pub origin_uri: String,
    /// Scratch space of the daemons.
    pub scratch: tempfile::TempDir,
    /// How the hops of the chains [`Self::start_chain`] starts dial each other (TCP unless
    /// a test sets it).
    pub transport: HopTransport,
    /// The chunk size [`Self::import_on_source`] imports with: 256 KiB unless a test sets
    /// it (`SHARDCAST_TEST_CHUNK_SIZE` overrides the default, to run the suite with chunks
    /// that go in pieces); chunks over 256 KiB cross hops in verified pieces.
    pub chunk_size: u32,
}

impl TestCluster {
    /// Starts `receivers + 1` daemons (with `opts` applied to each) and writes a synthetic
    /// model of `size` bytes in `shards` shards into the origin.
    pub async fn start(
        receivers: usize,
        size: u64,
        shards: usize,
        mut opts: impl FnMut(usize, &mut DaemonOpts),
    ) -> anyhow::Result<Self> {
        let origin = tempfile::tempdir()?;
        synth::generate(
            origin.path(),
            &SynthSpec {
                total_bytes: size,
                shards,
                seed: 7,
            },
        )?;
        let origin_uri = format!("file://{}", origin.path().display());
        let scratch = tempfile::tempdir()?;
        let mut daemons = Vec::new();
        for i in 0..=receivers {
            let name = if i == 0 {
                "source".to_string()
            } else {
                format!("recv-{i}")
            };
            let mut o = DaemonOpts::local(name.clone());
            o.extra_args.extend(allow_args(&[&origin_uri]));
            o.extra_args.extend([
                "--upstream-grace-ms".into(),
                "500".into(),
                "--idle-timeout-s".into(),
                "5".into(),
            ]);
            opts(i, &mut o);
            daemons.push(Daemon::start(&scratch.path().join(&name), o).await?);
        }
        Ok(Self {
            daemons,
            origin,
            origin_uri,
            chunk_size: std::env::var("SHARDCAST_TEST_CHUNK_SIZE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(256 << 10),
            scratch,
            transport: HopTransport::Tcp,
        })
    }

    /// Imports the model on the source (which then holds it in its memory tier): one read
    /// of the origin, hashed as it is read and kept (the copy's chunks are verified but not
    /// trusted: each is re-hashed before its bytes first leave the store).
    pub async fn import_on_source(&self) -> anyhow::Result<(String, Manifest)> {
        self.import_on_source_with(Vec::new()).await
    }

    /// Imports the model on the source in two steps: the manifest, then every chunk from
    /// the origin through the verified path, so each is trusted for the source's
    /// `reverify_after_ms` from its arrival, like a chunk a chain delivers.
    pub async fn import_on_source_verified(&self) -> anyhow::Result<(String, Manifest)> {
        let resp = self.daemons[0]
            .agent()
            .await?
            .import_model(self.import_request(false, Vec::new()))
            .await?
            .into_inner();
        self.import_on_source_with(resp.manifest).await
    }

    async fn import_on_source_with(&self, manifest: Vec<u8>) -> anyhow::Result<(String, Manifest)> {
        let resp = self.daemons[0]
            .agent()
            .await?
            .import_model(self.import_request(true, manifest))
            .await?
            .into_inner();
        Ok((resp.digest, decode_exact(resp.manifest.into())?))
    }

    fn import_request(&self, fetch: bool, manifest: Vec<u8>) -> ImportModelRequest {
        ImportModelRequest {
            name: "test/model".into(),
            origin: self.origin_uri.clone(),
            chunk_size: self.chunk_size,
            tier: Tier::Memory as i32,
            fetch,
            keep: false,
            manifest,
            bind_name: None,
        }
    }

    /// Starts one chain from daemon `head` through `hops` (daemon indices).
    pub async fn start_chain(
        &self,
        head: usize,
        digest: &str,
        hops: &[usize],
        origin: &str,
    ) -> anyhow::Result<String> {
        let mut req = StartChainRequest {
            session_id: String::new(),
            model: digest.into(),
            manifest: vec![],
            origin: origin.into(),
            tier: Tier::Memory as i32,
            chains: vec![Chain {
                shards: vec![],
                hops: hops.iter().map(|&i| self.daemons[i].hop()).collect(),
            }],
            plan_token: Vec::new(),
            transport: shardcast_protocol::agent::Transport::from(self.transport) as i32,
        };
        // A `shardcast://` fallback is one of the cluster's daemons, named in the plan.
        let holders: Vec<&Daemon> = self
            .daemons
            .iter()
            .filter(|d| origin.strip_prefix("shardcast://") == Some(&d.data_addr.to_string()))
            .collect();
        self.daemons[head].sign_chain(&mut req, &holders)?;
        Ok(self.daemons[head]
            .agent()
            .await?
            .start_chain(req)
            .await?
            .into_inner()
            .session_id)
    }

    /// Checks the cluster still works after whatever a test did to it: imports the model
    /// on the source, chains it to daemon 1 and verifies daemon 1's copy byte for byte.
    pub async fn serves_a_chain(&self) -> anyhow::Result<()> {
        self.chain_to(&[1]).await.map(drop)
    }

    /// Imports the model on the source, runs one chain from it through `hops` (no
    /// fallback origin), waits for every hop (60 s at most) and checks each copy is
    /// byte-exact; returns the model's digest and manifest.
    pub async fn chain_to(&self, hops: &[usize]) -> anyhow::Result<(String, Manifest)> {
        let (digest, manifest) = self.import_on_source().await?;
        self.start_chain(0, &digest, hops, "").await?;
        self.wait(hops, &digest, Duration::from_secs(60)).await?;
        for &i in hops {
            self.daemons[i].verify_copy(&manifest)?;
        }
        Ok((digest, manifest))
    }

    /// Waits until every daemon in `which` holds a complete copy, or fails after `timeout`.
    pub async fn wait(
        &self,
        which: &[usize],
        digest: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let ds: Vec<&Daemon> = which.iter().map(|&i| &self.daemons[i]).collect();
        let done = wait_complete(&ds, digest, Instant::now(), timeout, |_| {}).await?;
        for (d, t) in ds.iter().zip(done) {
            t.with_context(|| {
                format!(
                    "{} incomplete after {timeout:?}; log {} ends:\n{}",
                    d.host_id,
                    d.log.display(),
                    shardcast_bench::cluster::tail(&d.log)
                )
            })?;
        }
        Ok(())
    }

    /// Verified bytes of `digest` on daemon `i`.
    pub async fn verified_bytes(&self, i: usize, digest: &str) -> anyhow::Result<u64> {
        let mut c = self.daemons[i].agent().await?;
        Ok(self.daemons[i].model_progress(&mut c, digest).await?.0)
    }

    /// Waits until daemon `i` has verified at least `bytes` of `digest`.
    pub async fn wait_bytes(
        &self,
        i: usize,
        digest: &str,
        bytes: u64,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.verified_bytes(i, digest).await? >= bytes {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        anyhow::bail!("daemon {i} did not reach {bytes} bytes in {timeout:?}")
    }
}

/// The directory under which tests that start their clusters before creating origins put
/// those origins; such clusters allow exactly this root ([`allow_args`]). One fixed
/// directory (each origin in it is a temporary directory removed when dropped).
pub fn origins_root() -> std::path::PathBuf {
    let root = std::env::temp_dir().join("shardcast-test-origins");
    // Racing test processes may create it at once; `create_dir_all` tolerates that.
    let _ = std::fs::create_dir_all(&root);
    root
}

/// A fresh temporary origin directory under [`origins_root`].
pub fn origin_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("origin-")
        .tempdir_in(origins_root())
        .expect("creating an origin directory under the temp dir")
}

/// `--origin-allow` flags for a transferd or the controller: `prefixes`, or when empty
/// the `file://` root of [`origins_root`].
pub fn allow_args(prefixes: &[&str]) -> Vec<String> {
    let list = if prefixes.is_empty() {
        format!("file://{}/", origins_root().display())
    } else {
        prefixes.join(",")
    };
    vec!["--origin-allow".into(), list]
}

/// A data-port stream of any transport (TLS in every test cluster).
pub type Stream = Box<dyn shardcast_identity::grpc::Io>;

/// A TLS connection to a data port as host `name` of the process's test CA: a peer with a
/// valid certificate, whose `Hello` must then name `name`.
pub async fn tls_connect(addr: std::net::SocketAddr, name: &str) -> std::io::Result<Stream> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tls_over(tcp, name).await
}

/// The client side of the data-port TLS handshake over an established TCP stream.
pub async fn tls_over(tcp: tokio::net::TcpStream, name: &str) -> std::io::Result<Stream> {
    let ctx = host_tls(name)?;
    let (s, _) = ctx
        .connect(
            tcp,
            shardcast_identity::Alpn::Data,
            &shardcast_identity::Expect::Role(shardcast_identity::Role::Host),
        )
        .await?;
    Ok(Box::new(s))
}

/// The server side of the data-port TLS handshake as host `name` (a hand-driven hop in a
/// test, e.g. a hostile one).
pub async fn tls_accept(tcp: tokio::net::TcpStream, name: &str) -> std::io::Result<Stream> {
    let ctx = host_tls(name)?;
    let (s, _) = ctx
        .accept(tcp, shardcast_identity::Alpn::Data)
        .await
        .map_err(std::io::Error::from)?;
    Ok(Box::new(s))
}

/// The TLS context of host `name` of the process's test CA.
pub fn host_tls(name: &str) -> std::io::Result<std::sync::Arc<shardcast_identity::TlsContext>> {
    let pki = shardcast_bench::pki::ClusterPki::shared().map_err(std::io::Error::other)?;
    let files = pki
        .files(shardcast_identity::Role::Host, name)
        .map_err(std::io::Error::other)?;
    shardcast_identity::TlsContext::load(files).map_err(std::io::Error::other)
}

/// A plan token for `model` naming `hosts`, signed with the test CA's controller key, as
/// a hand-made `Open` must carry to be accepted.
pub fn plan_token(model: shardcast_protocol::ModelDigest, hosts: &[&str]) -> bytes::Bytes {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64;
    plan_token_with(model, hosts, None, now_ms)
}

/// [`plan_token`] binding `name` to `model`, as signed at `issued_at_ms` (the controller's
/// clock): what a plan for the name's current version carries, or — with an old time — a
/// token a host kept and replays. A host is `id` (no address: no one may dial it for the
/// plan) or `id@host:port`.
pub fn plan_token_with(
    model: shardcast_protocol::ModelDigest,
    hosts: &[&str],
    name: Option<shardcast_protocol::ModelName>,
    issued_at_ms: u64,
) -> bytes::Bytes {
    let pki = shardcast_bench::pki::ClusterPki::shared().expect("test PKI");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs();
    let claims = shardcast_protocol::plan::PlanClaims {
        plan: "test".into(),
        model,
        not_after: now + 600,
        issued_at_ms,
        hosts: hosts.iter().map(|h| plan_host(h)).collect(),
        name,
    };
    bytes::Bytes::from(pki.sign(&claims).expect("signing"))
}

/// The `Open` a hand-made session from a peer sends: chunk 0 of shard 0 of `model` into the
/// memory tier, no fallback origin, no hops, with a plan token naming `hosts` (see
/// [`plan_token`]); adjust it with struct update syntax.
pub fn open_header(
    session: shardcast_protocol::SessionId,
    model: shardcast_protocol::ModelDigest,
    hosts: &[&str],
) -> shardcast_protocol::SessionHeader {
    shardcast_protocol::SessionHeader {
        session,
        model,
        shard: 0,
        start: 0,
        end: 1,
        tier: shardcast_protocol::DataTier::Memory,
        origin: String::new(),
        downstream: vec![],
        token: plan_token(model, hosts),
        upstream: Vec::new(),
        transport: Default::default(),
    }
}

/// A fresh session id (random, so sessions of one test and of concurrent tests never
/// collide).
pub fn session_id() -> shardcast_protocol::SessionId {
    shardcast_protocol::SessionId(rand::random())
}

/// `id` or `id@host:port` as a plan token names a host.
pub fn plan_host(h: &str) -> shardcast_protocol::Hop {
    let (id, addr) = h.split_once('@').unwrap_or((h, ""));
    shardcast_protocol::Hop {
        host: shardcast_protocol::HostId::new(id).expect("host id"),
        addr: addr.into(),
    }
}

/// Polls `d`'s stats every 50 ms until `done` holds, which they are returned for; panics
/// with the last stats after `limit`.
pub async fn wait_stats(
    d: &Daemon,
    limit: Duration,
    done: impl Fn(&shardcast_protocol::agent::Stats) -> bool,
) -> shardcast_protocol::agent::Stats {
    let until = Instant::now() + limit;
    loop {
        let st = d.stats().await.unwrap();
        if done(&st) {
            return st;
        }
        assert!(Instant::now() < until, "{}: {st:?}", d.host_id);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The daemon's Prometheus counter `name` (without the `shardcast_` prefix; with its
/// labels after the host's, e.g. `admin_denied_total{role="host"}` as
/// `admin_denied_total` + `,role="host"`), read from its admin endpoint with a `read`
/// certificate.
pub async fn metric(d: &Daemon, name: &str) -> u64 {
    let body = d.metrics().await.expect("admin /metrics");
    shardcast_bench::cluster::metric_value(&body, &d.host_id, name)
        .unwrap_or_else(|| panic!("no metric {name} in {body}"))
}

/// Polls `d`'s `GpuStatus` every 20 ms until `done` answers `Some`, which it returns;
/// panics with the last status after `limit`.
pub async fn wait_gpu_status<T>(
    d: &Daemon,
    limit: Duration,
    mut done: impl FnMut(&shardcast_protocol::agent::GpuStatusResponse) -> Option<T>,
) -> T {
    let mut agent = d.agent().await.expect("agent client");
    let deadline = Instant::now() + limit;
    loop {
        let st = agent
            .gpu_status(shardcast_protocol::agent::GpuStatusRequest {})
            .await
            .expect("GpuStatus")
            .into_inner();
        if let Some(v) = done(&st) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{}: GpuStatus not as awaited after {limit:?}: {st:?}",
            d.host_id
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every frame the peer sends within five seconds (until it closes), decoded in order.
pub async fn read_frames<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
) -> Vec<shardcast_protocol::Frame> {
    use bytes::Buf;
    use shardcast_protocol::Codec;
    use tokio::io::AsyncReadExt;
    let mut buf = bytes::BytesMut::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let mut tmp = [0u8; 4096];
            match s.read(&mut tmp).await {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        }
    })
    .await;
    let mut frames = Vec::new();
    let mut b = buf.freeze();
    while b.has_remaining() {
        match shardcast_protocol::Frame::decode(&mut b) {
            Ok(f) => frames.push(f),
            Err(_) => break,
        }
    }
    frames
}

/// Reads the next frame from `s`, keeping bytes read beyond it in `buf` for the next call;
/// `None` once the stream ends, nothing arrives for 10 s, or the bytes are no frame.
pub async fn read_frame<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut bytes::BytesMut,
) -> Option<shardcast_protocol::Frame> {
    use bytes::Buf;
    use shardcast_protocol::Codec;
    use tokio::io::AsyncReadExt;
    loop {
        let mut b = buf.clone().freeze();
        if let Ok(f) = shardcast_protocol::Frame::decode(&mut b) {
            let used = buf.len() - b.remaining();
            let _ = buf.split_to(used);
            return Some(f);
        }
        let mut tmp = [0u8; 64 << 10];
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut tmp)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&tmp[..n]),
            _ => return None,
        }
    }
}

/// Reads frames from `s` until an `Error`, whose code and message it returns; `None` if
/// the stream ends (or falls silent for 10 s) first.
pub async fn first_error<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
) -> Option<(shardcast_protocol::ErrorCode, String)> {
    let mut buf = bytes::BytesMut::new();
    while let Some(f) = read_frame(s, &mut buf).await {
        if let shardcast_protocol::Frame::Error { code, message } = f {
            return Some((code, message));
        }
    }
    None
}

/// The encoding of `Hello` from `host` in this build's protocol version.
pub fn hello(host: &str) -> Vec<u8> {
    use shardcast_protocol::Codec;
    let mut out = Vec::new();
    shardcast_protocol::Frame::Hello {
        version: shardcast_protocol::PROTOCOL_VERSION,
        host: shardcast_protocol::HostId::new(host).expect("host id"),
    }
    .encode(&mut out);
    out
}

/// Generates, for each named `async fn name(transport: HopTransport)` of the calling test
/// file, two tests: `tcp::name` and `quic::name`, the same test with the hops dialling each
/// other over TCP and over QUIC.
#[macro_export]
macro_rules! over_each_transport {
    ($($name:ident),+ $(,)?) => {
        mod tcp {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(shardcast_protocol::HopTransport::Tcp).await
                }
            )+
        }
        mod quic {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(shardcast_protocol::HopTransport::Quic).await
                }
            )+
        }
    };
}

/// A head session's status (`GetSession`) through an agent client.
pub async fn session_status(
    agent: &mut shardcast_protocol::agent::agent_client::AgentClient<tonic::transport::Channel>,
    id: &str,
) -> shardcast_protocol::agent::SessionStatus {
    agent
        .get_session(shardcast_protocol::agent::GetSessionRequest {
            session_id: id.to_string(),
        })
        .await
        .expect("GetSession")
        .into_inner()
}

/// Reads from `s`, past whatever the server sends (an HTTP/2 preface), until the peer closes
/// it or the read fails: `true` if that happened within `within`, `false` if it was still
/// open then.
pub async fn closed_within(s: &mut (impl tokio::io::AsyncRead + Unpin), within: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut b = [0u8; 256];
    tokio::time::timeout(within, async {
        loop {
            match s.read(&mut b).await {
                Ok(n) if n > 0 => continue,
                _ => return,
            }
        }
    })
    .await
    .is_ok()
}
