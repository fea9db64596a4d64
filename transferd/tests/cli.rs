//! The `transferd` binary itself: bad configuration stops it with a clear message before
//! any port is bound; a good one reaches `READY`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn transferd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_transferd"))
}

#[test]
fn bad_config_exits_with_a_clear_message() {
    let out = transferd()
        .args(["--egress-rate", "warp9"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("egress_rate") && err.contains("warp9"),
        "{err}"
    );

    let out = transferd().args(["--host-id", "../evil"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("host_id"));

    let out = transferd()
        .args(["--config", "/nonexistent/transferd.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/transferd.toml"));
}

#[test]
fn tls_is_required_and_plaintext_is_loopback_only() {
    let out = transferd().args(["--host-id", "h1"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("mutual TLS is required") && err.contains("shardcast certs"),
        "{err}"
    );
    let out = transferd()
        .args([
            "--host-id",
            "h1",
            "--insecure-plaintext",
            "true",
            "--listen",
            "0.0.0.0:0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("only allowed when every listener is on loopback"),
        "{err}"
    );
    // A certificate that names another host.
    let dir = tempfile::tempdir().unwrap();
    let pki = shardcast_identity::pki::PkiDir::new(dir.path().join("pki"));
    pki.init("t", std::time::Duration::from_secs(3600)).unwrap();
    let id = shardcast_identity::Identity::new(shardcast_identity::Role::Host, "other").unwrap();
    let f = pki
        .issue(&shardcast_identity::pki::IssueRequest::new(id))
        .unwrap();
    let out = transferd()
        .args([
            "--host-id",
            "h1",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--agent-listen")
        .arg(format!("unix:{}", dir.path().join("agent.sock").display()))
        .arg("--memory-dir")
        .arg(dir.path().join("mem"))
        .arg("--data-dir")
        .arg(dir.path().join("disk"))
        .arg("--tls-ca")
        .arg(pki.ca().cert)
        .arg("--tls-cert")
        .arg(&f.cert)
        .arg("--tls-key")
        .arg(&f.key)
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("host:other") && err.contains("host:h1"),
        "{err}"
    );
}

#[test]
fn starts_and_reports_ready() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = transferd()
        .args([
            "--host-id",
            "cli-test",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--insecure-plaintext",
            "true",
        ])
        .arg("--agent-listen")
        .arg(format!("unix:{}", dir.path().join("agent.sock").display()))
        .arg("--memory-dir")
        .arg(dir.path().join("mem"))
        .arg("--data-dir")
        .arg(dir.path().join("disk"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = BufReader::new(stdout).lines().next().unwrap().unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.starts_with("READY data=127.0.0.1:"), "{line}");
    assert!(line.contains("agent=unix:"), "{line}");
}

#[test]
fn unsafe_store_roots_stop_the_daemon_before_ready() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("mem");
    std::fs::create_dir(&mem).unwrap();
    let run = || {
        transferd()
            .args(["--host-id", "cli-test", "--listen", "127.0.0.1:0"])
            .args([
                "--admin-listen",
                "127.0.0.1:0",
                "--insecure-plaintext",
                "true",
            ])
            .arg("--agent-listen")
            .arg(format!("unix:{}", dir.path().join("agent.sock").display()))
            .arg("--memory-dir")
            .arg(&mem)
            .arg("--data-dir")
            .arg(dir.path().join("disk"))
            .output()
            .unwrap()
    };
    // Group-writable: anyone in the group could plant files.
    std::fs::set_permissions(&mem, PermissionsExt::from_mode(0o770)).unwrap();
    let out = run();
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stdout).contains("READY"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("writable by group or others"), "{err}");
    assert!(
        std::fs::read_dir(&mem).unwrap().next().is_none(),
        "nothing written"
    );

    // Owned by another user (the tests run as root, which can chown).
    std::fs::set_permissions(&mem, PermissionsExt::from_mode(0o700)).unwrap();
    if std::os::unix::fs::chown(&mem, Some(54321), None).is_ok() {
        let out = run();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("owned by uid 54321"), "{err}");
        assert!(
            std::fs::read_dir(&mem).unwrap().next().is_none(),
            "nothing written"
        );
    }
}

#[test]
fn unknown_or_ill_typed_keys_stop_the_daemon_naming_key_and_origin() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("transferd.toml");
    std::fs::write(&path, "listen = \"127.0.0.1:0\"\nwindw = 8\n").unwrap();
    let out = transferd()
        .arg("--config")
        .arg(&path)
        .args(["--insecure-plaintext", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "nothing started");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "unknown field `windw` (from file {}); did you mean `window`?",
            path.display()
        )),
        "{err}"
    );

    // The same file name in SHARDCAST_CONFIG, and an ill-typed variable.
    std::fs::write(&path, "window = 8\n").unwrap();
    let out = transferd()
        .env("SHARDCAST_CONFIG", &path)
        .env("SHARDCAST_WINDOW", "eight")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("window = \"eight\" (from environment variable SHARDCAST_WINDOW)"),
        "{err}"
    );
    std::fs::write(&path, "window = \"eight\"\n").unwrap();
    let out = transferd().arg("--config").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "window = \"eight\" (from file {})",
            path.display()
        )),
        "{err}"
    );
}

#[test]
fn print_config_shows_each_value_and_its_origin_without_binding() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("transferd.toml");
    std::fs::write(&path, "window = 8\nzone = \"from-file\"\nrack = \"r1\"\n").unwrap();
    // A port held here: a daemon that tried to bind it would fail.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = held.local_addr().unwrap().to_string();
    let out = transferd()
        .arg("--config")
        .arg(&path)
        .env("SHARDCAST_ZONE", "from-env")
        .env("SHARDCAST_STALL_TIMEOUT_MS", "1s")
        .args(["--rack", "from-flag", "--print-config"])
        .args(["--listen", &listen, "--insecure-plaintext", "true"])
        .args([
            "--agent-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        format!("window = 8  # file {}", path.display()),
        "zone = \"from-env\"  # environment variable SHARDCAST_ZONE".to_string(),
        "stall_timeout_ms = 1000  # environment variable SHARDCAST_STALL_TIMEOUT_MS".into(),
        "rack = \"from-flag\"  # flag --rack".into(),
        format!("listen = \"{listen}\"  # flag --listen"),
        "upstream_grace_ms = 2000  # default".into(),
        "# host_id: not set".into(),
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} in\n{text}");
    }
    // A bad value still stops --print-config, with the reason.
    let out = transferd()
        .args(["--print-config", "--stall-timeout-ms", "5"])
        .args(["--insecure-plaintext", "true", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("stall_timeout_ms must be at least 200")
            && err.contains("[stall_timeout_ms from flag --stall-timeout-ms]"),
        "{err}"
    );
}
