//! The `shardcast-controller` binary as an operator meets it: bad settings get a message.
//! (Having an integration test here also makes `cargo test` build the binary before the
//! cluster tests in `shardcast-tests` start it.)

use std::process::Command;

#[test]
fn controller_rejects_bad_settings_with_a_message() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-controller"))
        .args(["--heartbeat-ms", "1", "--state-dir", "/nonexistent/never"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("heartbeat_ms"), "{err}");
}

#[test]
fn controller_refuses_a_partition_rate_without_a_unit_at_start() {
    // From the environment as from the flag: `100` is 100 bytes/s, surely not meant.
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-controller"))
        .args(["--state-dir", "/nonexistent/never"])
        .env("SHARDCAST_PARTITION_LINK_RATE", "100")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("partition_link_rate must be at least 1MB/s"),
        "{err}"
    );
    assert!(err.contains("100Gbit"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-controller"))
        .args([
            "--partition-load-rate",
            "lots",
            "--state-dir",
            "/nonexistent/never",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("partition_load_rate: invalid rate"), "{err}");
}

#[test]
fn controller_refuses_an_unknown_or_ill_typed_key_before_any_port() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("controller.toml");
    std::fs::write(&path, "listen = \"127.0.0.1:0\"\nmax_chain_lenght = 4\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-controller"))
        .env("SHARDCAST_CONTROLLER_CONFIG", &path)
        .args(["--insecure-plaintext", "--state-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "no READY line");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "unknown field `max_chain_lenght` (from file {}); did you mean `max_chain_len`?",
            path.display()
        )),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-controller"))
        .env("SHARDCAST_LOST_GRACE_S", "soon")
        .args(["--insecure-plaintext", "--state-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("lost_grace_s = \"soon\" (from environment variable SHARDCAST_LOST_GRACE_S)"),
        "{err}"
    );
}

#[test]
fn controller_prints_its_effective_config_without_binding() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("controller.toml");
    // The ports are held here: a controller that bound them would fail.
    let grpc = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (grpc, http) = (grpc.local_addr().unwrap(), http.local_addr().unwrap());
    std::fs::write(
        &path,
        format!("listen = \"{grpc}\"\nhttp_listen = \"{http}\"\npoll_ms = \"2s\"\n"),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-controller"))
        .arg("--config")
        .arg(&path)
        .env("SHARDCAST_MAX_CHAIN_LEN", "4")
        .args(["--insecure-plaintext", "--print-config", "--state-dir"])
        .arg(dir.path().join("state"))
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
        format!("listen = \"{grpc}\"  # file {}", path.display()),
        format!("poll_ms = 2000  # file {}", path.display()),
        "max_chain_len = 4  # environment variable SHARDCAST_MAX_CHAIN_LEN".into(),
        "insecure_plaintext = true  # flag --insecure-plaintext".into(),
        "missed_heartbeats = 3  # default".into(),
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} in\n{text}");
    }
    assert!(!dir.path().join("state").exists(), "no state opened");
}

#[test]
fn openapi_prints_the_document_the_code_generates() {
    // No settings are read: the document is the code's, wherever it runs.
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-controller"))
        .arg("openapi")
        .env("SHARDCAST_CONTROLLER_CONFIG", "/nonexistent/never.toml")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text, shardcast_controller::openapi::json());
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    assert!(doc["paths"]["/v1/prewarm"]["post"].is_object());
}
