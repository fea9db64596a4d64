//! The two binaries as a user meets them: help, bad flags, and an unreachable controller.
//! (Having integration tests here also makes `cargo test` build both binaries before the
//! cluster tests in `shardcast-tests` start them.)

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
fn cli_reports_an_unreachable_controller() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast"))
        .args(["--controller", "127.0.0.1:1", "models"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(5), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: UNAVAILABLE"), "{err}");
}

#[test]
fn cli_usage_errors_exit_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast"))
        .args(["prewarm"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn offline_plan_of_a_synthetic_t5_profile() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast"))
        .args([
            "--json",
            "plan",
            "--synthetic-layers",
            "55",
            "--max-partitions",
            "64",
            "--queue",
            "8",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!v["chosen"]["partitions"].as_array().unwrap().is_empty());
    assert_eq!(v["estimated"], true);
}
