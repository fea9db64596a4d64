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

#[test]
fn simulate_writes_the_comparison_rows_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("sim.json");
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-bench"))
        .args([
            "simulate",
            "--hosts",
            "8",
            "--hosts-per-leaf",
            "4",
            "--model",
            "bart-large",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["method"], "baseline");
    assert_eq!(rows[1]["method"], "chain");
    for r in rows {
        assert_eq!(r["ready"], 8);
        assert_eq!(r["hosts"].as_array().unwrap().len(), 8);
    }
    // One chain reads the origin once; the baseline reads it once per host.
    let origin = |r: &serde_json::Value| r["bytes_from_origin"].as_f64().unwrap();
    assert!(origin(&rows[0]) > 7.9 * origin(&rows[1]));
    assert_eq!(report["params"]["hosts"], 8);
    // The table on stdout names both rows.
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("+ chain multicast"), "{table}");
}

#[test]
fn simulate_names_the_models_it_knows() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-bench"))
        .args(["simulate", "--model", "llama-70b", "--hosts", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("t5-3b") && err.contains("llama-70b"), "{err}");
}
