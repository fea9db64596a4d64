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
    // Said before the model is written: 8 GiB would take seconds and the memory.
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-bench"))
        .args([
            "loader",
            "--backend",
            "cuda",
            "--size",
            "8GiB",
            "--model-dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no CUDA driver"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
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
        .arg("--plots")
        .arg(dir.path().join("plots"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // The plots, each path said on stderr.
    for f in [
        "ready-cdf.svg",
        "copy-cdf.svg",
        "bytes-by-tier-baseline.svg",
        "bytes-by-tier-chain.svg",
    ] {
        let path = dir.path().join("plots").join(f);
        assert!(err.contains(&path.display().to_string()), "{f}: {err}");
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
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

#[test]
fn simulate_runs_a_trace_and_writes_the_rows_next_to_the_thesis() {
    // 16 hosts × 2 GPUs, 10 minutes of the Twitter-shaped trace, GPT-2 XL: the baseline's
    // new hosts share the origin; the combined row sources from peers and host memory.
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("trace.json");
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-bench"))
        .args([
            "simulate",
            "--hosts",
            "16",
            "--hosts-per-leaf",
            "4",
            "--gpus-per-host",
            "2",
            "--trace",
            "twitter",
            "--duration",
            "10m",
            "--models",
            "gpt2-xl",
            "--techniques",
            "baseline,combined",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // Progress on stderr while it runs, and the peak memory at the end.
    assert!(err.contains("gpt2-xl twitter atl baseline:") && err.contains("peak RSS"));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["params"]["duration_s"], 600.0);
    let cmp = report["comparisons"].as_array().unwrap();
    assert_eq!(cmp.len(), 1);
    assert_eq!(
        (cmp[0]["model"].as_str(), cmp[0]["scaler"].as_str()),
        (Some("gpt2-xl"), Some("atl"))
    );
    let rows = cmp[0]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    let (base, all) = (&rows[0]["row"], &rows[1]["row"]);
    assert_eq!(
        (base["technique"].as_str(), all["technique"].as_str()),
        (Some("baseline"), Some("combined"))
    );
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    assert!(base["cold_starts"].as_u64().unwrap() > 0 && all["cold_starts"].as_u64().unwrap() > 0);
    assert!(f(all, "avg_cold_start_s") < f(base, "avg_cold_start_s"));
    assert!(f(all, "bytes_from_origin") < f(base, "bytes_from_origin"));
    assert!(f(all, "avg_e2e_s") <= f(base, "avg_e2e_s"));
    // Our change and the thesis' side by side.
    assert!(rows[1]["change"]["avg_cold_start"].as_f64().unwrap() < 0.0);
    assert_eq!(rows[1]["thesis"]["avg_cold_start"], -0.9351);
    assert!(!all["timeline"].as_array().unwrap().is_empty());
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("combined (locality + chains + partitions)"),
        "{table}"
    );
    // The combined row may split scale-ups into partitioned bursts; it reports them.
    assert!(all["burst_replicas"].as_u64().is_some(), "{all}");
    // Without --plots, no plot.
    assert!(!err.contains("plot written"));
}

#[test]
fn cold_start_takes_a_plots_directory() {
    // The emulated run itself needs root and minutes; its option is checked here, its
    // conversion to the plot in `sim::plots`' tests.
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-bench"))
        .args(["cold-start", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--plots <DIR>"), "{help}");
}

#[test]
fn simulate_reads_an_azure_functions_trace() {
    let csv = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/azure_functions_2019_sample.csv"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast-bench"))
        .args([
            "simulate",
            "--hosts",
            "4",
            "--hosts-per-leaf",
            "2",
            "--duration",
            "5m",
        ])
        .args([
            "--models",
            "codebert-base",
            "--techniques",
            "combined",
            "--trace",
        ])
        .arg(format!("azure:{csv}"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("codebert-base on azure:"));
    let bad = Command::new(env!("CARGO_BIN_EXE_shardcast-bench"))
        .args(["simulate", "--trace", "poisson"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown trace"));
}
