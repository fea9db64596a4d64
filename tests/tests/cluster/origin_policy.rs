//! The origin allow-list from the attacker's side, against real daemons and a real
//! controller on loopback: file reads outside the allowed roots, dot-files, `..`, symbolic
//! links leaving a root, HTTP redirects out of the prefix or to a metadata address, a name
//! resolving to loopback, and a session's fallback origin (`Open.origin`) outside policy.

use std::sync::Arc;
use std::time::Duration;

use shardcast_bench::cluster::{Daemon, DaemonOpts};
use shardcast_bench::control::{HttpAs, ManagedCluster};
use shardcast_bench::origin_server::{OriginStats, serve};
use shardcast_bench::synth::{self, SynthSpec};
use shardcast_identity::Role;
use shardcast_protocol::agent::{ImportModelRequest, StartChainRequest, Tier};
use shardcast_protocol::codec::Codec;
use shardcast_protocol::controller::RegisterModelRequest;
use shardcast_protocol::{
    ErrorCode, Frame, Manifest, ModelName, SessionHeader, SessionId, ShardHasher, ShardPath,
};
use shardcast_tests::metric;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::Code;

fn model_in(dir: &std::path::Path, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    synth::generate(
        dir,
        &SynthSpec {
            total_bytes: 2 << 20,
            shards: 1,
            seed,
        },
    )
    .unwrap();
}

async fn daemon(scratch: &tempfile::TempDir, allow: &[&str]) -> Daemon {
    let mut o = DaemonOpts::local("guarded");
    o.extra_args.extend(shardcast_tests::allow_args(allow));
    Daemon::start(scratch.path(), o).await.unwrap()
}

async fn import(d: &Daemon, origin: &str) -> Result<(), tonic::Status> {
    let req = ImportModelRequest {
        name: "test/m".into(),
        origin: origin.into(),
        tier: Tier::Memory as i32,
        fetch: true,
        ..Default::default()
    };
    tokio::time::timeout(
        Duration::from_secs(60),
        d.agent().await.unwrap().import_model(req),
    )
    .await
    .expect("import must not hang")
    .map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_refuses_files_outside_the_allowed_root() {
    let root = shardcast_tests::origin_dir();
    let allowed = root.path().join("models");
    model_in(&allowed.join("good"), 1);
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), b"secret").unwrap();
    let uri = format!("file://{}/", allowed.display());
    let scratch = tempfile::tempdir().unwrap();
    let d = daemon(&scratch, &[&uri]).await;

    // Inside the root: fine.
    import(&d, &format!("{uri}good")).await.unwrap();

    let denied = |e: &tonic::Status, what: &str| {
        assert_eq!(e.code(), Code::PermissionDenied, "{what}: {e:?}");
    };
    // /etc/passwd and a neighbouring directory whose name extends the root's.
    let e = import(&d, "file:///etc/passwd").await.unwrap_err();
    denied(&e, "/etc/passwd");
    assert!(e.message().contains("origin_allow"), "{e:?}");
    let evil = format!("file://{}-evil/x", allowed.display());
    denied(&import(&d, &evil).await.unwrap_err(), "prefix confusion");
    // A dot-file and a dot-directory below the root.
    std::fs::write(allowed.join(".env"), b"KEY=1").unwrap();
    denied(
        &import(&d, &format!("{uri}.env")).await.unwrap_err(),
        "dot-file",
    );
    std::fs::create_dir_all(allowed.join(".git")).unwrap();
    std::fs::write(allowed.join(".git/config"), b"[core]").unwrap();
    denied(
        &import(&d, &format!("{uri}.git/config")).await.unwrap_err(),
        "dot-dir",
    );
    // `..`, plain and percent-encoded: malformed, refused before any policy lookup.
    for up in ["good/../../../etc/passwd", "%2e%2e/%2e%2e/etc/passwd"] {
        let e = import(&d, &format!("{uri}{up}")).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{up}: {e:?}");
    }
    // A symbolic link inside the root that leads out: a file, and a whole directory.
    let linked = allowed.join("linked");
    std::fs::create_dir_all(&linked).unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret"), linked.join("w.bin")).unwrap();
    denied(
        &import(&d, &format!("{uri}linked")).await.unwrap_err(),
        "symlinked file",
    );
    std::os::unix::fs::symlink(outside.path(), allowed.join("escape")).unwrap();
    denied(
        &import(&d, &format!("{uri}escape")).await.unwrap_err(),
        "symlinked dir",
    );
    // A manifest handed in that names a dot-file shard: refused when the host reads it.
    std::fs::write(allowed.join("good/.env"), b"KEY=1").unwrap();
    let mut h = ShardHasher::new(64 << 10);
    h.update(b"KEY=1");
    let m = Manifest::new(
        ModelName::new("test/dot").unwrap(),
        64 << 10,
        vec![h.finish(ShardPath::new(".env").unwrap())],
    )
    .unwrap();
    let mut bytes = Vec::new();
    m.encode(&mut bytes);
    let e = d
        .agent()
        .await
        .unwrap()
        .import_model(ImportModelRequest {
            name: "test/dot".into(),
            origin: format!("{uri}good"),
            tier: Tier::Memory as i32,
            fetch: true,
            manifest: bytes,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("hidden"), "{e:?}");
    assert!(
        metric(&d, "origin_refused_total").await >= 6,
        "refusals are counted"
    );
}

/// Answers every request with `302` to `target(path)`; counts requests.
async fn redirector(
    target: impl Fn(&str) -> String + Send + Sync + 'static,
) -> (String, Arc<std::sync::atomic::AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let hits = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (target, counter) = (Arc::new(target), hits.clone());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (target, counter) = (target.clone(), counter.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 2048];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut tmp).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&tmp[..n]),
                    }
                }
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let head = String::from_utf8_lossy(&buf);
                let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
                let reply = format!(
                    "HTTP/1.1 302 Found\r\nLocation: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    target(&path)
                );
                let _ = s.write_all(reply.as_bytes()).await;
            });
        }
    });
    (base, hits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_redirects_and_names_are_held_to_the_policy() {
    // A real origin, allowed by address.
    let dir = shardcast_tests::origin_dir();
    model_in(dir.path(), 2);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let real = format!("http://127.0.0.1:{port}/");
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    tokio::spawn(serve(
        dir.path().to_path_buf(),
        listener,
        None,
        Arc::new(OriginStats::default()),
        stop.clone(),
    ));
    // Redirects: /in/… to the real origin (allowed), /out/… elsewhere on the same server
    // (outside the prefix), /meta/… to the cloud metadata address.
    let real_for = real.clone();
    let (r, _hits) = redirector(move |path| {
        let file = path.rsplit('/').next().unwrap_or_default();
        if path.starts_with("/in/") {
            format!("{real_for}{file}")
        } else if path.starts_with("/out/") {
            format!("/elsewhere/{file}")
        } else {
            "http://169.254.169.254/latest/meta-data/iam/".to_string()
        }
    })
    .await;
    let scratch = tempfile::tempdir().unwrap();
    let allow = [
        format!("{r}/in/"),
        format!("{r}/out/"),
        format!("{r}/meta/"),
        real.clone(),
    ];
    let allow: Vec<&str> = allow.iter().map(String::as_str).collect();
    let d = daemon(&scratch, &allow).await;

    // A redirect that stays inside the allow-list is followed.
    import(&d, &format!("{r}/in/")).await.unwrap();
    // Out of the prefix, and to the metadata service: refused.
    let e = import(&d, &format!("{r}/out/")).await.unwrap_err();
    assert!(
        e.message().contains("outside the origin allow-list"),
        "{e:?}"
    );
    let e = import(&d, &format!("{r}/meta/")).await.unwrap_err();
    assert!(e.message().contains("169.254.169.254"), "{e:?}");
    // The same server by its literal address works.
    import(&d, &real).await.unwrap();
    assert!(metric(&d, "origin_refused_total").await >= 2);

    // A host that allows the server only by a name resolving to loopback (and lists no
    // loopback address): refused at connect time by the resolver.
    let scratch2 = tempfile::tempdir().unwrap();
    let by_name = format!("http://localhost:{port}/");
    let d2 = daemon(&scratch2, &[&by_name]).await;
    let e = import(&d2, &by_name).await.unwrap_err();
    assert!(
        e.message().contains("loopback, link-local or metadata"),
        "{e:?}"
    );
    assert!(metric(&d2, "origin_refused_total").await >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_is_refused_by_the_controller_and_again_by_the_host() {
    // The controller allows /etc/ (misconfigured); the hosts allow only the origins root.
    let root = format!("file://{}/", shardcast_tests::origins_root().display());
    let mut ctl = shardcast_tests::allow_args(&[&root, "file:///etc/"]);
    ctl.extend(["--stall-timeout-s".into(), "5".into()]);
    let host_allow = shardcast_tests::allow_args(&[&root]);
    let c = ManagedCluster::start(1, ctl, |_, o| o.extra_args.extend(host_allow.clone()))
        .await
        .unwrap();
    let mut api = c.controller.client().await.unwrap();
    let reg = |origin: &str| RegisterModelRequest {
        name: "test/m".into(),
        origin: origin.into(),
        ..Default::default()
    };
    // Outside the controller's list.
    let e = api
        .register_model(reg("file:///var/lib/secret"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("--origin-allow"), "{e:?}");
    // Inside the controller's list but not the host's: the host refuses.
    let e = api
        .register_model(reg("file:///etc/passwd"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("host"), "{e:?}");
    // A dot-file and `..`.
    let e = api
        .register_model(reg(&format!("{root}.ssh/id_rsa")))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = api
        .register_model(reg(&format!("{root}../../etc/passwd")))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // Over HTTP: 403.
    let body = r#"{"name":"test/m","origin":"file:///root/.ssh/id_rsa"}"#;
    let (status, resp) = c
        .controller
        .http(HttpAs::Cert(Role::Admin), "POST", "/v1/models", body)
        .await
        .unwrap();
    assert_eq!(status, 403, "{resp}");
    assert!(resp.contains("PERMISSION_DENIED"), "{resp}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_origin_outside_policy_refuses_the_session() {
    let c = shardcast_tests::TestCluster::start(1, 2 << 20, 1, |_, _| {})
        .await
        .unwrap();
    let (digest, manifest) = c.import_on_source().await.unwrap();

    // StartChain with an origin outside the head's policy.
    let e = c.daemons[0]
        .agent()
        .await
        .unwrap()
        .start_chain(StartChainRequest {
            model: digest.clone(),
            origin: "file:///etc/".into(),
            tier: Tier::Memory as i32,
            chains: vec![shardcast_protocol::agent::Chain {
                shards: vec![],
                hops: vec![c.daemons[1].hop()],
            }],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");

    // A peer opening a session whose fallback origin is outside the hop's policy.
    let mut s = shardcast_tests::tls_connect(c.daemons[1].data_addr, "attacker")
        .await
        .unwrap();
    let mut out = shardcast_tests::hello("attacker");
    Frame::Open(SessionHeader {
        origin: "http://169.254.169.254/latest/".into(),
        ..shardcast_tests::open_header(
            SessionId([7; 16]),
            manifest.digest(),
            &["attacker", "recv-1"],
        )
    })
    .encode(&mut out);
    // The session's manifest follows its Open (protocol v6).
    Frame::Manifest(manifest.clone()).encode(&mut out);
    s.write_all(&out).await.unwrap();
    let refused = shardcast_tests::first_error(&mut s).await;
    let (code, message) = refused.expect("an Error frame");
    assert_eq!(code, ErrorCode::Refused);
    assert!(message.contains("fallback origin"), "{message}");
    // Nothing was stored for the refused session.
    assert_eq!(c.verified_bytes(1, &digest).await.unwrap_or(0), 0);
}
