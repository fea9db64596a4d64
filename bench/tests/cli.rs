//! The bench binary as a user meets it. (Having an integration test here also makes
//! `cargo test` build `shardcast-bench` before the emulated tests run its origin server.)

use std::process::Command;

#[test]
fn origin_server_refuses_a_missing_directory() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-bench"))
        .args([
            "origin-server",
            "--dir",
            "/nonexistent/shardcast-origin",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/shardcast-origin"), "{err}");
}

#[test]
fn loader_without_a_cuda_driver_says_so() {
    // Wherever the system keeps the driver library, the same check the loader makes.
    if gpu_loader::cuda::driver_available().is_ok() {
        eprintln!("SKIPPED: this host has a CUDA driver (the test needs one without)");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-bench"))
        .args(["loader", "--backend", "cuda", "--size", "1MiB"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no CUDA driver"), "{err}");
}
