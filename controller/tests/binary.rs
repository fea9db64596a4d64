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
