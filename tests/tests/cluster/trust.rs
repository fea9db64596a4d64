//! The trust model from the attacker's side, against real daemons and a real controller on
//! loopback: strangers are refused before any frame, identities come from certificates
//! only, and every API method answers each role as the permission table says.

use std::time::Duration;

use http::uri::PathAndQuery;
use shardcast_bench::cluster::{Daemon, DaemonOpts};
use shardcast_bench::control::{ControllerProc, HttpAs};
use shardcast_bench::pki::ClusterPki;
use shardcast_identity::grpc::ClientSecurity;
use shardcast_identity::pki::IssueRequest;
use shardcast_identity::{Alpn, Expect, Identity, Role, TlsContext, TlsFiles};
use shardcast_protocol::codec::Codec;
use shardcast_protocol::{ErrorCode, Frame, HostId};
use shardcast_tests::{TestCluster, closed_within, hello, metric, read_frames};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::Code;

async fn send_hello<S: AsyncWrite + Unpin>(s: &mut S, host: &str) {
    let _ = s.write_all(&hello(host)).await;
    let _ = s.flush().await;
}

fn error_code(frames: &[Frame]) -> Option<ErrorCode> {
    frames.iter().find_map(|f| match f {
        Frame::Error { code, .. } => Some(*code),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_port_refuses_strangers_and_impostors() {
    let c = TestCluster::start(1, 2 * 1024 * 1024, 1, |_, _| {})
        .await
        .unwrap();
    let target = &c.daemons[1];
    let addr = target.data_addr;
    let pki = ClusterPki::shared().unwrap();

    // Plaintext: the daemon never speaks the protocol to it, not even its Hello.
    let mut s = TcpStream::connect(addr).await.unwrap();
    send_hello(&mut s, "attacker").await;
    let frames = read_frames(&mut s).await;
    assert!(frames.is_empty(), "plaintext peer got frames: {frames:?}");

    // A certificate from another CA: refused in the handshake (in both directions).
    let stranger_pki = ClusterPki::new().unwrap();
    let stranger = TlsContext::load(stranger_pki.files(Role::Host, "recv-1").unwrap()).unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    assert!(
        stranger
            .connect(tcp, Alpn::Data, &Expect::Role(Role::Host))
            .await
            .is_err()
    );

    // An expired certificate of the right CA.
    let mut req = IssueRequest::new(Identity::new(Role::Host, "expired").unwrap());
    req.not_before_offset = time::Duration::hours(-2);
    req.validity = Duration::ZERO;
    let f = pki.pki().issue(&req).unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let expired = TlsContext::load(TlsFiles {
        ca: pki.pki().ca().cert,
        cert: f.cert,
        key: f.key,
    })
    .unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    if let Ok((mut s, _)) = expired
        .connect(tcp, Alpn::Data, &Expect::Role(Role::Host))
        .await
    {
        // TLS 1.3 clients finish before the server's verdict: nothing may follow.
        send_hello(&mut s, "expired").await;
        assert!(read_frames(&mut s).await.is_empty());
    }

    // A valid host certificate whose Hello claims another host (the source).
    let mallory = TlsContext::load(pki.files(Role::Host, "mallory").unwrap()).unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut s, _) = mallory
        .connect(tcp, Alpn::Data, &Expect::Role(Role::Host))
        .await
        .unwrap();
    send_hello(&mut s, "source").await;
    let frames = read_frames(&mut s).await;
    assert_eq!(error_code(&frames), Some(ErrorCode::Refused), "{frames:?}");

    // A valid certificate that is not a host's (an inference process's `read` identity).
    let reader = pki.client(Role::Read).unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut s, _) = reader
        .connect(tcp, Alpn::Data, &Expect::Role(Role::Host))
        .await
        .unwrap();
    send_hello(&mut s, "test-read").await;
    assert_eq!(
        error_code(&read_frames(&mut s).await),
        Some(ErrorCode::Refused)
    );

    // Reaching a host under another host's name fails on the client side too: the
    // forwarder expects exactly the plan's host id.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let expect = Expect::Exactly(Identity::new(Role::Host, "source").unwrap());
    let err = mallory.connect(tcp, Alpn::Data, &expect).await.unwrap_err();
    assert!(err.to_string().contains("recv-1"), "{err}");

    // Counted, and the daemon still serves a real chain.
    assert!(metric(target, "data_tls_refused_total").await >= 2);
    assert!(metric(target, "hello_identity_mismatch_total").await >= 2);
    c.serves_a_chain().await.unwrap();
}

/// Every `rpc` of a service in a `.proto` file, as gRPC paths.
/// Dials `addr` over QUIC as `who` (from an endpoint of its own on loopback), sends a
/// `Hello` naming `host` and returns the frames that came back; `Err` when the connection
/// or stream could not be made.
async fn quic_hello(
    who: std::sync::Arc<TlsContext>,
    addr: std::net::SocketAddr,
    host: &str,
) -> anyhow::Result<Vec<Frame>> {
    let quic = transferd::transport::Quic::bind("127.0.0.1:0".parse()?, who, None, 1)?;
    let (mut s, _) = quic.connect(&addr.to_string(), None).await?;
    send_hello(&mut s, host).await;
    Ok(read_frames(&mut s).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quic_port_refuses_strangers_and_impostors() {
    let c = TestCluster::start(1, 2 * 1024 * 1024, 1, |_, _| {})
        .await
        .unwrap();
    let target = &c.daemons[1];
    let addr = target.data_addr;
    let pki = ClusterPki::shared().unwrap();

    // A certificate from another CA: refused in the handshake, before any stream.
    let stranger_pki = ClusterPki::new().unwrap();
    let stranger = TlsContext::load(stranger_pki.files(Role::Host, "recv-1").unwrap()).unwrap();
    let err = quic_hello(stranger, addr, "recv-1").await.unwrap_err();
    assert!(err.to_string().contains("handshake"), "{err:#}");

    // A valid certificate that is not a host's: the connection is closed unanswered.
    let reader = pki.client(Role::Read).unwrap();
    match quic_hello(reader, addr, "test-read").await {
        Ok(frames) => assert!(frames.is_empty(), "a reader got frames: {frames:?}"),
        Err(e) => assert!(e.to_string().contains("not a host"), "{e:#}"),
    }

    // A valid host certificate whose Hello claims another host (the source).
    let mallory = TlsContext::load(pki.files(Role::Host, "mallory").unwrap()).unwrap();
    let frames = quic_hello(mallory, addr, "source").await.unwrap();
    assert_eq!(error_code(&frames), Some(ErrorCode::Refused), "{frames:?}");

    // Counted; the listener still carries a real chain over QUIC.
    assert!(metric(target, "quic_connections_refused_total").await >= 2);
    assert!(metric(target, "hello_identity_mismatch_total").await >= 1);
    let mut c = c;
    c.transport = shardcast_protocol::HopTransport::Quic;
    c.serves_a_chain().await.unwrap();
    assert_eq!(metric(&c.daemons[0], "quic_streams_opened_total").await, 1);
    // quinn's own figures for that chain, on the source: the 2 MiB went out in datagrams
    // of at most the MTU ceiling, several per transmit where GSO works, and the receiver
    // acknowledged them.
    let src = &c.daemons[0];
    let (sent, bytes, transmits) = (
        metric(src, "quic_tx_datagrams_total").await,
        metric(src, "quic_tx_bytes_total").await,
        metric(src, "quic_tx_ios_total").await,
    );
    assert!(bytes >= 2 << 20, "{bytes} bytes sent");
    assert!(
        sent >= bytes / 1472 && transmits >= 1 && transmits <= sent,
        "{sent} {transmits}"
    );
    assert!(metric(src, "quic_rx_datagrams_total").await > 0);
    let mtu = metric(src, "quic_max_path_mtu_bytes").await;
    assert!((1200..=1472).contains(&mtu), "{mtu}");
}

fn rpc_paths(proto: &str, package: &str) -> Vec<String> {
    let mut service = "";
    let mut out = Vec::new();
    for line in proto.lines().map(str::trim) {
        if let Some(s) = line.strip_prefix("service ") {
            service = s.trim_end_matches('{').trim();
        }
        if let Some(rest) = line.strip_prefix("rpc ") {
            let method = rest.split('(').next().unwrap_or_default().trim();
            out.push(format!("/{package}.{service}/{method}"));
        }
    }
    out
}

/// Calls `path` with an empty message (every proto3 request's default) and returns the
/// status code.
async fn call(channel: tonic::transport::Channel, path: &str) -> Code {
    let mut grpc = tonic::client::Grpc::new(channel);
    if let Err(e) = grpc.ready().await {
        panic!("{path}: channel not ready: {e}");
    }
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    let path = PathAndQuery::try_from(path.to_string()).unwrap();
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        grpc.unary(tonic::Request::new(()), path, codec),
    )
    .await
    .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("test timeout")));
    match r {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

fn agent_permission(method: &str) -> shardcast_identity::Permission {
    use shardcast_identity::Permission as P;
    match method {
        "ImportModel" | "StartChain" | "EvictModel" | "LoadModel" => P::DriveAgent,
        _ => P::Read,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_api_answers_each_role_by_the_table() {
    let scratch = tempfile::tempdir().unwrap();
    let mut o = DaemonOpts::local("agent-host");
    o.agent_tcp = Some("127.0.0.1:0".into());
    let d = Daemon::start(&scratch.path().join("d"), o).await.unwrap();
    let pki = ClusterPki::shared().unwrap();
    let me = Identity::new(Role::Host, "agent-host").unwrap();
    let paths = rpc_paths(
        include_str!("../../../protocol/proto/agent.proto"),
        "shardcast.agent.v1",
    );
    assert!(paths.len() >= 10, "{paths:?}");
    for role in Role::ALL {
        let security = ClientSecurity::Tls(pki.client(role).unwrap(), Expect::Exactly(me.clone()));
        let ch = shardcast_identity::grpc::connect(&d.agent_addr, security)
            .await
            .unwrap();
        for path in &paths {
            let method = path.rsplit('/').next().unwrap();
            let code = call(ch.clone(), path).await;
            let allowed = role.grants(agent_permission(method));
            if allowed {
                assert!(
                    !matches!(code, Code::PermissionDenied | Code::Unauthenticated),
                    "{role} calling {path}: {code:?}"
                );
            } else {
                assert_eq!(code, Code::PermissionDenied, "{role} calling {path}");
            }
        }
    }
    // No certificate at all (plaintext): no answer.
    let plain = shardcast_identity::grpc::lazy(&d.agent_addr, ClientSecurity::Plaintext).unwrap();
    let code = call(plain, "/shardcast.agent.v1.Agent/ListHoldings").await;
    assert!(
        matches!(code, Code::Unavailable | Code::Unknown | Code::Cancelled),
        "a plaintext client must not get an answer: {code:?}"
    );
    // A client that expects another host refuses this agent (a heartbeat cannot point the
    // controller at the wrong host).
    let wrong = ClientSecurity::Tls(
        pki.client(Role::Controller).unwrap(),
        Expect::Exactly(Identity::new(Role::Host, "someone-else").unwrap()),
    );
    let ch = shardcast_identity::grpc::lazy(&d.agent_addr, wrong).unwrap();
    assert_eq!(
        call(ch, "/shardcast.agent.v1.Agent/ListHoldings").await,
        Code::Unavailable
    );
    assert!(metric(&d, "agent_denied_total").await >= 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_api_answers_each_role_by_the_table() {
    let scratch = tempfile::tempdir().unwrap();
    let platform = Identity::new(Role::Platform, "faas").unwrap();
    let (platform_token, line) = shardcast_identity::token::generate(&platform);
    let tokens = scratch.path().join("tokens");
    std::fs::write(&tokens, format!("{line}\n")).unwrap();
    let ctl = ControllerProc::start(
        &scratch.path().join("ctl"),
        vec!["--tokens-file".into(), tokens.display().to_string()],
    )
    .await
    .unwrap();
    let pki = ClusterPki::shared().unwrap();
    let paths = rpc_paths(
        include_str!("../../../protocol/proto/controller.proto"),
        "shardcast.controller.v1",
    );
    for role in Role::ALL {
        let security =
            ClientSecurity::Tls(pki.client(role).unwrap(), Expect::Role(Role::Controller));
        let ch = shardcast_identity::grpc::connect(&ctl.grpc.to_string(), security)
            .await
            .unwrap();
        for path in &paths {
            if role == Role::Host && path.ends_with("/Heartbeat") {
                // Allowed, but an empty report names no host: checked on its own below.
                continue;
            }
            let needed = shardcast_controller::auth::permission(path).unwrap();
            let code = call(ch.clone(), path).await;
            if role.grants(needed) {
                assert!(
                    !matches!(code, Code::PermissionDenied | Code::Unauthenticated),
                    "{role} calling {path}: {code:?}"
                );
            } else {
                assert_eq!(code, Code::PermissionDenied, "{role} calling {path}");
            }
        }
    }
    // Plaintext gRPC gets nothing.
    let plain =
        shardcast_identity::grpc::lazy(&ctl.grpc.to_string(), ClientSecurity::Plaintext).unwrap();
    let code = call(plain, "/shardcast.controller.v1.Controller/ListModels").await;
    assert!(
        matches!(code, Code::Unavailable | Code::Unknown | Code::Cancelled),
        "{code:?}"
    );

    // A host may only report as itself.
    let mut inv = shardcast_protocol::controller::inventory_client::InventoryClient::new(
        shardcast_identity::grpc::connect(
            &ctl.grpc.to_string(),
            ClientSecurity::Tls(
                pki.client(Role::Host).unwrap(),
                Expect::Role(Role::Controller),
            ),
        )
        .await
        .unwrap(),
    );
    let report = |host: &str| shardcast_protocol::controller::HostReport {
        host_id: host.into(),
        data_addr: "127.0.0.1:1".into(),
        agent_addr: "127.0.0.1:2".into(),
        ..Default::default()
    };
    let e = inv.heartbeat(report("victim")).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    assert!(e.message().contains("victim"), "{e}");
    inv.heartbeat(report("test-host")).await.unwrap();

    // HTTP: certificates, tokens, anonymous, plaintext.
    let h = |who: HttpAs, method: &'static str, path: &'static str, body: &'static str| {
        let ctl = &ctl;
        async move { ctl.http(who, method, path, body).await.unwrap() }
    };
    assert_eq!(h(HttpAs::Anonymous, "GET", "/healthz", "").await.0, 200);
    let (s, b) = h(HttpAs::Anonymous, "GET", "/v1/models", "").await;
    assert_eq!(s, 401, "{b}");
    assert!(b.contains("UNAUTHENTICATED"), "{b}");
    assert_eq!(
        h(HttpAs::Cert(Role::Read), "GET", "/v1/models", "").await.0,
        200
    );
    let (s, b) = h(
        HttpAs::Cert(Role::Read),
        "POST",
        "/v1/models",
        r#"{"name":"x/y","origin":"file:///etc"}"#,
    )
    .await;
    assert_eq!(s, 403, "{b}");
    assert!(
        b.contains("PERMISSION_DENIED") && b.contains("admin"),
        "{b}"
    );
    let (s, b) = h(
        HttpAs::Token(platform_token.clone()),
        "POST",
        "/v1/prewarm",
        r#"{"model":"no/such","replicas":1}"#,
    )
    .await;
    assert_eq!(s, 404, "platform token passes auth: {b}");
    let (s, b) = h(
        HttpAs::Token(platform_token),
        "POST",
        "/v1/evict",
        r#"{"model":"no/such"}"#,
    )
    .await;
    assert_eq!(s, 403, "{b}");
    let (s, _) = h(HttpAs::Token("shc_forged".into()), "GET", "/v1/models", "").await;
    assert_eq!(s, 401);
    let (s, b) = h(
        HttpAs::Cert(Role::Host),
        "POST",
        "/v1/heartbeat",
        r#"{"host_id":"victim","data_addr":"127.0.0.1:1","agent_addr":"127.0.0.1:2"}"#,
    )
    .await;
    assert_eq!(s, 403, "{b}");
    let (s, _) = h(HttpAs::Plaintext, "GET", "/v1/models", "").await;
    assert_eq!(s, 0, "a plaintext HTTP client must get no answer");
    let (s, b) = h(HttpAs::Cert(Role::Read), "GET", "/metrics", "").await;
    assert_eq!(s, 200);
    let denied: u64 = b
        .lines()
        .find(|l| l.starts_with("shardcast_api_refused_total{reason=\"denied\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(denied >= 10, "{b}");
}

/// What an `Open` would have its receiver dial: the hops after it, the holders above it
/// and a fallback origin.
#[derive(Default)]
struct Reach {
    downstream: Vec<shardcast_protocol::Hop>,
    upstream: Vec<shardcast_protocol::Hop>,
    origin: String,
}

impl Reach {
    fn down(downstream: Vec<shardcast_protocol::Hop>) -> Self {
        Self {
            downstream,
            ..Self::default()
        }
    }
}

/// Sends Hello, a manifest and an `Open` for it as `mallory`, and returns the first
/// `Error` frame's code and message (None if the session was accepted).
async fn open_as_mallory(
    addr: std::net::SocketAddr,
    manifest: &shardcast_protocol::Manifest,
    reach: Reach,
    token: bytes::Bytes,
) -> Option<(ErrorCode, String)> {
    let mut s = open_session_as_mallory(addr, manifest, reach, token).await;
    let frames = read_frames(&mut s).await;
    frames.into_iter().find_map(|f| match f {
        Frame::Error { code, message } => Some((code, message)),
        _ => None,
    })
}

fn sign_as(
    files: &TlsFiles,
    model: shardcast_protocol::ModelDigest,
    hosts: &[&str],
    not_after: u64,
) -> bytes::Bytes {
    let signer = shardcast_identity::plan::PlanSigner::load(files).unwrap();
    let claims = shardcast_protocol::plan::PlanClaims {
        plan: "forged".into(),
        model,
        not_after,
        issued_at_ms: not_after.saturating_sub(600) * 1000,
        hosts: hosts
            .iter()
            .map(|h| shardcast_tests::plan_host(h))
            .collect(),
        name: None,
    };
    bytes::Bytes::from(signer.sign(&claims).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_need_the_controllers_signature_and_pushed_manifests_are_not_kept() {
    let c = TestCluster::start(1, 2 * 1024 * 1024, 1, |_, _| {})
        .await
        .unwrap();
    let target = &c.daemons[1];
    let (digest, real) = c.import_on_source().await.unwrap();
    // Other weights under the registered name: what a pushed manifest would repoint it to.
    let mut evil = real.clone();
    evil.shards[0].chunks[0] = shardcast_protocol::ChunkHash([0xee; 32]);
    let model = evil.digest();
    assert_ne!(model.to_string(), digest);
    let pki = ClusterPki::shared().unwrap();
    let controller = pki.files(Role::Controller, "controller").unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let refused = |r: Option<(ErrorCode, String)>, why: &str| {
        let (code, message) = r.unwrap_or_else(|| panic!("accepted ({why})"));
        assert_eq!(code, ErrorCode::Refused, "{why}: {message}");
        assert!(message.contains("not authorised"), "{why}: {message}");
        message
    };
    let addr = target.data_addr;
    // No token.
    refused(
        open_as_mallory(addr, &evil, Reach::default(), bytes::Bytes::new()).await,
        "no token",
    );
    // Expired.
    let t = sign_as(&controller, model, &["mallory", "recv-1"], now - 10);
    let m = refused(
        open_as_mallory(addr, &evil, Reach::default(), t).await,
        "expired",
    );
    assert!(m.contains("expired"), "{m}");
    // Not naming the receiver, or not the sender.
    let t = sign_as(&controller, model, &["mallory", "recv-9"], now + 60);
    refused(
        open_as_mallory(addr, &evil, Reach::default(), t).await,
        "receiver",
    );
    let t = sign_as(&controller, model, &["source", "recv-1"], now + 60);
    refused(
        open_as_mallory(addr, &evil, Reach::default(), t).await,
        "sender",
    );
    // A downstream hop outside the plan: this host would connect where the peer says.
    let t = sign_as(&controller, model, &["mallory", "recv-1"], now + 60);
    let outside = shardcast_protocol::Hop {
        host: HostId::new("elsewhere").unwrap(),
        addr: "127.0.0.1:9".into(),
    };
    let m = refused(
        open_as_mallory(addr, &evil, Reach::down(vec![outside]), t).await,
        "hop",
    );
    assert!(m.contains("downstream"), "{m}");
    // Signed by a host instead of the controller: a non-controller certificate is refused
    // when loading a signer; forge the parts by hand.
    let good = sign_as(&controller, model, &["mallory", "recv-1"], now + 60);
    let mut parts = shardcast_protocol::plan::TokenParts::parse(&good).unwrap();
    let host_cert = std::fs::read(pki.files(Role::Host, "mallory").unwrap().cert).unwrap();
    parts.signer = bytes::Bytes::from(
        shardcast_identity::tls::first_cert(&host_cert, std::path::Path::new("mallory"))
            .unwrap()
            .to_vec(),
    );
    let m = refused(
        open_as_mallory(addr, &evil, Reach::default(), parts.encode().into()).await,
        "host signer",
    );
    assert!(m.contains("not by the controller"), "{m}");
    // Claims changed after signing.
    let mut parts = shardcast_protocol::plan::TokenParts::parse(&good).unwrap();
    let mut claims = parts.claims.to_vec();
    let last = claims.len() - 1;
    claims[last] ^= 1;
    parts.claims = claims.into();
    refused(
        open_as_mallory(addr, &evil, Reach::default(), parts.encode().into()).await,
        "tampered",
    );
    // A controller of another CA.
    let other = ClusterPki::new().unwrap();
    let t = sign_as(
        &other.files(Role::Controller, "controller").unwrap(),
        model,
        &["mallory", "recv-1"],
        now + 60,
    );
    refused(
        open_as_mallory(addr, &evil, Reach::default(), t).await,
        "other CA",
    );

    // None of it left a trace: the name still resolves to nothing on the target, and its
    // store holds no manifest of the pushed model.
    let mut agent = target.agent().await.unwrap();
    let holdings = agent
        .list_holdings(shardcast_protocol::agent::ListHoldingsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(holdings.models.is_empty(), "{holdings:?}");
    let found = walk(&target.memory_dir)
        .into_iter()
        .chain(walk(&target.disk_dir))
        .any(|p| p.to_string_lossy().contains(&model.to_string()));
    assert!(!found, "the refused session's manifest was persisted");
    assert!(metric(target, "sessions_unauthorised_total").await >= 8);

    // The controller-signed path (the harness signs as the controller) still works.
    c.start_chain(0, &digest, &[1], "").await.unwrap();
    c.wait(&[1], &digest, Duration::from_secs(60))
        .await
        .unwrap();
    target.verify_copy(&real).unwrap();
}

/// A host with a valid certificate and a valid plan token (one the controller signed for a
/// plan it is part of) cannot make another host dial an address of its choosing: an
/// `Open` whose next hop, upstream holder or `shardcast://` fallback is not at the address
/// the plan gives it is refused with the reason, and nothing connects to that address; the
/// same token with the plan's addresses is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_can_point_a_host_only_at_addresses_the_plan_signed() {
    let c = TestCluster::start(2, 2 * 1024 * 1024, 1, |_, _| {})
        .await
        .unwrap();
    let (target, next) = (&c.daemons[1], &c.daemons[2]);
    let (_, manifest) = c.import_on_source().await.unwrap();
    // Where mallory wants the target to connect: a listener that counts who does.
    let trap = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let trap_addr = trap.local_addr().unwrap().to_string();
    let dialled = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = dialled.clone();
    let trap_task = tokio::spawn(async move {
        while let Ok((_s, _)) = trap.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    // A genuine plan: mallory (at an address of its own), the target and the next hop.
    let mallory_at = "127.0.0.1:9";
    let token = || {
        shardcast_tests::plan_token(
            manifest.digest(),
            &[
                &format!("mallory@{mallory_at}"),
                &format!("recv-1@{}", target.data_addr),
                &format!("recv-2@{}", next.data_addr),
            ],
        )
    };
    let hop = |host: &str, addr: &str| shardcast_protocol::Hop {
        host: HostId::new(host).unwrap(),
        addr: addr.into(),
    };
    let cases = [
        (
            Reach::down(vec![hop("recv-2", &trap_addr)]),
            format!("does not give downstream hop recv-2 the address {trap_addr}"),
        ),
        (
            Reach {
                upstream: vec![hop("mallory", &trap_addr)],
                ..Reach::default()
            },
            format!("does not give upstream hop mallory the address {trap_addr}"),
        ),
        (
            Reach {
                origin: format!("shardcast://{trap_addr}"),
                ..Reach::default()
            },
            format!("fallback holder {trap_addr} is not the address of a host of plan"),
        ),
    ];
    let addr = target.data_addr;
    for (reach, why) in cases {
        let (code, message) = open_as_mallory(addr, &manifest, reach, token())
            .await
            .unwrap_or_else(|| panic!("accepted ({why})"));
        assert_eq!(code, ErrorCode::Refused, "{message}");
        assert!(message.contains(&why), "{message} (wanted {why})");
    }
    assert!(metric(target, "sessions_unauthorised_total").await >= 3);
    // The same token with the plan's own addresses is accepted (the refusals were about
    // the addresses, nothing else): the target answers `Accept`.
    let mut s = open_session_as_mallory(
        addr,
        &manifest,
        Reach {
            downstream: vec![hop("recv-2", &next.data_addr.to_string())],
            upstream: vec![hop("mallory", mallory_at)],
            origin: format!("shardcast://{}", next.data_addr),
        },
        token(),
    )
    .await;
    // (read_frames reads for up to 5 s: the accepted session's connection stays open.)
    let frames = read_frames(&mut s).await;
    assert!(
        frames.iter().any(|f| matches!(f, Frame::Accept { .. }))
            && !frames.iter().any(|f| matches!(f, Frame::Error { .. })),
        "the signed addresses were refused: {frames:?}"
    );
    drop(s);
    // Nothing ever connected to the trap.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(dialled.load(std::sync::atomic::Ordering::SeqCst), 0);
    trap_task.abort();
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}

/// Sends `Hello`, the manifest and an `Open` of `manifest`'s model (forwarding, pulling and
/// falling back as `reach` says) carrying `token` as `mallory` (a host with a valid
/// certificate) and returns the connection, left open.
async fn open_session_as_mallory(
    addr: std::net::SocketAddr,
    manifest: &shardcast_protocol::Manifest,
    reach: Reach,
    token: bytes::Bytes,
) -> shardcast_tests::Stream {
    let mut s = shardcast_tests::tls_connect(addr, "mallory").await.unwrap();
    let mut out = hello("mallory");
    Frame::Open(shardcast_protocol::SessionHeader {
        origin: reach.origin,
        downstream: reach.downstream,
        token,
        upstream: reach.upstream,
        ..shardcast_tests::open_header(shardcast_tests::session_id(), manifest.digest(), &[])
    })
    .encode(&mut out);
    // The session's manifest follows its Open (protocol v6).
    Frame::Manifest(manifest.clone()).encode(&mut out);
    s.write_all(&out).await.unwrap();
    s
}

/// The version `name` resolves to on `d` (through its name table), once it is `want`,
/// within 10 s; panics otherwise.
async fn wait_resolves(d: &Daemon, name: &str, want: shardcast_protocol::ModelDigest) {
    let mut agent = d.agent().await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = agent
            .get_model_status(shardcast_protocol::agent::GetModelStatusRequest {
                model: name.into(),
            })
            .await
            .map(|r| r.into_inner());
        let got: Vec<String> = st
            .as_ref()
            .map(|s| s.tiers.iter().map(|t| t.digest.clone()).collect())
            .unwrap_or_default();
        if got.contains(&want.to_string()) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{name} resolves to {got:?}, not {want}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A host with a valid certificate that kept an old plan token (one the controller signed
/// when the name meant the previous version) replays it: the receiver keeps the name on
/// the newer version, counts the refusal, and a genuinely newer statement (a rollback the
/// registry made later) still moves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_old_plan_token_cannot_roll_a_name_back() {
    let c = TestCluster::start(1, 2 * 1024 * 1024, 1, |_, _| {})
        .await
        .unwrap();
    let target = &c.daemons[1];
    let (_, v2) = c.import_on_source().await.unwrap();
    // The previous version under the same name.
    let mut v1 = v2.clone();
    v1.shards[0].chunks[0] = shardcast_protocol::ChunkHash([0xee; 32]);
    let name = v2.name.clone();
    let hosts = ["mallory", "recv-1"];
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let token = |m: &shardcast_protocol::Manifest, at: u64| {
        shardcast_tests::plan_token_with(m.digest(), &hosts, Some(name.clone()), at)
    };
    let addr = target.data_addr;
    // The name's history on the target: v1 a minute ago, then v2 (the current version).
    let old = token(&v1, now_ms - 60_000);
    let _s1 = open_session_as_mallory(addr, &v1, Reach::default(), old.clone()).await;
    wait_resolves(target, name.as_str(), v1.digest()).await;
    let _s2 =
        open_session_as_mallory(addr, &v2, Reach::default(), token(&v2, now_ms - 30_000)).await;
    wait_resolves(target, name.as_str(), v2.digest()).await;
    assert_eq!(metric(target, "name_bindings_refused_total").await, 0);

    // The replay: the session may go on (its chunks are verified), the name does not move.
    let _s3 = open_session_as_mallory(addr, &v1, Reach::default(), old).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while metric(target, "name_bindings_refused_total").await < 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the replayed token's binding was not refused"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_resolves(target, name.as_str(), v2.digest()).await;

    // A rollback the registry made now is a newer statement: it applies.
    let _s4 = open_session_as_mallory(addr, &v1, Reach::default(), token(&v1, now_ms)).await;
    wait_resolves(target, name.as_str(), v1.digest()).await;
    assert_eq!(metric(target, "name_bindings_refused_total").await, 1);
}

/// The controller's unlabelled counter `shardcast_<name>`, read from `/metrics` as an admin.
async fn controller_counter(ctl: &ControllerProc, name: &str) -> u64 {
    let (status, body) = ctl
        .http(HttpAs::Cert(Role::Admin), "GET", "/metrics", "")
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("shardcast_{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no shardcast_{name} in {body}"))
}

/// A host with a valid certificate holds idle TLS connections to the controller's gRPC port
/// (connections that never make a call): the first `MAX_CONNECTIONS_PER_PEER` are kept, the
/// rest are closed right after their handshake and counted, and the cluster's own calls
/// still get in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hosts_idle_connections_are_capped_and_others_still_get_in() {
    use shardcast_identity::grpc::MAX_CONNECTIONS_PER_PEER;
    use tokio::io::AsyncReadExt;
    let scratch = tempfile::tempdir().unwrap();
    let ctl = ControllerProc::start(&scratch.path().join("ctl"), Vec::new())
        .await
        .unwrap();
    let evil = shardcast_tests::host_tls("mallory").unwrap();
    let extra = 40;
    let mut held = Vec::new();
    for _ in 0..MAX_CONNECTIONS_PER_PEER + extra {
        let tcp = TcpStream::connect(ctl.grpc).await.unwrap();
        let (s, _) = evil
            .connect(tcp, Alpn::Grpc, &Expect::Role(Role::Controller))
            .await
            .unwrap();
        held.push(s);
    }
    // The server closes those over the limit (EOF); the others stay open and silent.
    let closed = futures::future::join_all(held.iter_mut().map(|s| async move {
        let mut b = [0u8; 256];
        loop {
            match tokio::time::timeout(Duration::from_millis(500), s.read(&mut b)).await {
                // The server's HTTP/2 preface (SETTINGS): read past it.
                Ok(Ok(n)) if n > 0 => continue,
                Ok(_) => return true,
                Err(_) => return false,
            }
        }
    }))
    .await
    .into_iter()
    .filter(|c| *c)
    .count();
    assert_eq!(closed, extra, "connections over the per-peer limit");
    // Other peers still get in and are answered.
    let mut api = ctl.client().await.unwrap();
    api.list_hosts(shardcast_protocol::controller::ListHostsRequest {})
        .await
        .unwrap();
    let refused = controller_counter(&ctl, "connections_over_peer_limit_total").await;
    assert_eq!(refused, extra as u64);
    // Closing them gives the places back.
    drop(held);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let tcp = TcpStream::connect(ctl.grpc).await.unwrap();
    let (mut s, _) = evil
        .connect(tcp, Alpn::Grpc, &Expect::Role(Role::Controller))
        .await
        .unwrap();
    let closed = closed_within(&mut s, Duration::from_millis(500)).await;
    assert!(!closed, "a connection after the others closed was refused");
}

/// Hundreds of connections from one address that never finish their TLS handshake (more
/// than the listener's handshake slots): that address gets a bounded share, the rest are
/// closed at once, and a call from another address is answered at once rather than queued
/// behind them until their handshakes time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_handshakes_from_one_address_do_not_queue_the_others() {
    use shardcast_identity::grpc::{MAX_PENDING_HANDSHAKES, MAX_PENDING_HANDSHAKES_PER_ADDR};
    let scratch = tempfile::tempdir().unwrap();
    let ctl = ControllerProc::start(&scratch.path().join("ctl"), Vec::new())
        .await
        .unwrap();
    let mut silent = Vec::new();
    for _ in 0..MAX_PENDING_HANDSHAKES + 44 {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(std::net::SocketAddr::from(([127, 0, 0, 9], 0)))
            .unwrap();
        silent.push(sock.connect(ctl.grpc).await.unwrap());
    }
    // The calls of another address get in while those still hold their connections.
    let started = std::time::Instant::now();
    let mut api = ctl.client().await.unwrap();
    api.list_hosts(shardcast_protocol::controller::ListHostsRequest {})
        .await
        .unwrap();
    let waited = started.elapsed();
    // Queued behind them it would wait for their handshake timeout (10 s).
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    let refused = controller_counter(&ctl, "handshakes_over_addr_limit_total").await as usize;
    assert!(
        refused >= MAX_PENDING_HANDSHAKES + 44 - MAX_PENDING_HANDSHAKES_PER_ADDR,
        "{refused} refused"
    );
    drop(silent);
}
