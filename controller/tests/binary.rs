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
