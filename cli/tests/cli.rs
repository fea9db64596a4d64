//! The `shardcast` CLI as a user meets it: usage errors, an unreachable controller, a
//! missing certificate, identities, offline plans.

use std::process::Command;

#[test]
fn cli_reports_an_unreachable_controller() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast"))
        .args([
            "--controller",
            "127.0.0.1:1",
            "--insecure-plaintext",
            "models",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(5), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: UNAVAILABLE"), "{err}");
}

#[test]
fn cli_without_a_certificate_says_how_to_get_one() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast"))
        .args(["--controller", "127.0.0.1:1", "models"])
        .env_remove("SHARDCAST_TLS_CA")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("requires mutual TLS") && err.contains("--tls-cert"),
        "{err}"
    );
}

#[test]
fn certs_init_issue_rotate_and_token() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_shardcast"))
            .arg("certs")
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let d = pki.to_str().unwrap();
    let (code, out, err) = run(&["init", "--dir", d]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("ca.pem"), "{out}");
    let (code, _, err) = run(&["init", "--dir", d]);
    assert_eq!(
        code,
        Some(1),
        "a second init must not replace the CA: {err}"
    );
    let (code, out, err) = run(&[
        "issue", "--dir", d, "--role", "host", "--name", "gpu-1", "--ip", "10.0.0.7",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("shardcast://host/gpu-1"), "{out}");
    let cert = pki.join("host-gpu-1.pem");
    let before = std::fs::read(&cert).unwrap();
    let (code, _, err) = run(&["rotate", "--dir", d, "--cert", cert.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert_ne!(std::fs::read(&cert).unwrap(), before);
    let (code, _, err) = run(&["issue", "--dir", d, "--role", "root", "--name", "x"]);
    assert_eq!(code, Some(2), "{err}");
    let (code, out, err) = run(&["token", "--role", "platform", "--name", "knative"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("token: shc_") && out.contains("platform knative "),
        "{out}"
    );
    let (code, _, _) = run(&["token", "--role", "host", "--name", "h1"]);
    assert_eq!(code, Some(2));
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

#[test]
fn offline_plan_at_given_link_and_load_rates() {
    let plan = |extra: &[&str]| {
        let mut args = vec!["--json", "plan", "--synthetic-layers", "48", "--queue", "8"];
        args.extend_from_slice(extra);
        let out = Command::new(env!("CARGO_BIN_EXE_shardcast"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    // Today's figures unless told: the thesis' 10 Gbit/s and the calibrated load times.
    let thesis = plan(&[]);
    assert_eq!(thesis["table"]["link_bps"], 1.25e9);
    let fast = plan(&["--link-rate", "400Gbit", "--load-rate", "25GB/s"]);
    assert_eq!(fast["table"]["link_bps"], 50e9);
    let cold = |v: &serde_json::Value| v["chosen"]["cold_start_s"].as_f64().unwrap();
    // 11,408 MB at 25 GB/s: the whole model loads in under half a second.
    assert!(cold(&fast) < 0.46, "{fast}");
    assert!(cold(&fast) < cold(&thesis), "{fast}\n{thesis}");
}

#[test]
fn offline_plan_refuses_a_bad_rate_and_rates_with_a_model() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_shardcast"))
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["plan", "--synthetic-layers", "8", "--link-rate", "100"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--link-rate must be at least 1MB/s"), "{err}");
    let out = run(&["plan", "--synthetic-layers", "8", "--load-rate", "quick"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    // Through the controller the rates are its settings, not the caller's.
    let out = run(&["plan", "org/model", "--link-rate", "100Gbit"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot be used with"), "{err}");
}

#[test]
fn completions_and_man_pages_need_no_controller() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast"))
        .args(["--controller", "127.0.0.1:1", "completions", "bash"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let script = String::from_utf8_lossy(&out.stdout);
    assert!(
        script.contains("_shardcast()") && script.contains("prewarm"),
        "{script}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast"))
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );

    let dir = tempfile::tempdir().unwrap();
    let pages = dir.path().join("man1");
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast"))
        .args(["man", "--out"])
        .arg(&pages)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let listed = String::from_utf8_lossy(&out.stdout);
    for page in [
        "shardcast.1",
        "shardcast-prewarm.1",
        "shardcast-certs-issue.1",
    ] {
        assert!(pages.join(page).is_file(), "{page} not written");
        assert!(listed.contains(page), "{listed}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_shardcast"))
        .arg("man")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains(".SH NAME"));
}
