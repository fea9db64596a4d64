//! The controller's settings as the flags, the environment and the TOML file give them.

use super::*;

fn config(extra: &[&str]) -> anyhow::Result<Config> {
    let mut argv = vec!["shardcast-controller"];
    argv.extend_from_slice(extra);
    Args::from_argv(argv)?.args.config()
}

#[test]
fn partition_rates_default_to_the_hosts_nics_and_the_calibration() {
    let p = config(&[]).unwrap().partitions;
    assert_eq!(p, PartitionConfig::default());
    assert_eq!(p.link_bps, None);
}

#[test]
fn partition_rates_parse_like_the_other_rates() {
    let p = config(&[
        "--partition-link-rate",
        "200Gbit",
        "--partition-load-rate",
        "25GB/s",
        "--partition-exec-rate",
        "2000GB/s",
    ])
    .unwrap()
    .partitions;
    assert_eq!(p.link_bps, Some(25_000_000_000));
    assert_eq!(p.load_bps, 25e9);
    assert_eq!(p.exec_s_per_byte, 1.0 / 2e12);
}

#[test]
fn bad_partition_rates_are_refused_by_name() {
    for (flag, value, says) in [
        ("--partition-link-rate", "fast", "invalid rate"),
        (
            "--partition-link-rate",
            "unlimited",
            "must be a finite rate",
        ),
        ("--partition-link-rate", "0", "must be a finite rate"),
        (
            "--partition-load-rate",
            "100",
            "a number without a unit is bytes/s",
        ),
        ("--partition-load-rate", "25Tbit", "unknown prefix"),
        ("--partition-exec-rate", "999kB/s", "at least 1MB/s"),
    ] {
        let e = config(&[flag, value]).unwrap_err().to_string();
        let name = flag.trim_start_matches("--").replace('-', "_");
        assert!(e.contains(&name), "{flag} {value}: {e}");
        assert!(e.contains(says), "{flag} {value}: {e}");
    }
}

#[test]
fn example_config_loads_and_documents_every_key() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("controller.example.toml");
    let loaded =
        Args::from_argv(["shardcast-controller", "--config", path.to_str().unwrap()]).unwrap();
    loaded.validate().unwrap();
    assert_eq!(loaded.args.origin_allow.len(), 2);
    let text = loaded.render().unwrap();
    let example = std::fs::read_to_string(&path).unwrap();
    for line in text
        .lines()
        .filter(|l| !l.starts_with("# shardcast-controller"))
    {
        let key = line
            .trim_start_matches("# ")
            .split([' ', ':'])
            .next()
            .unwrap();
        assert!(
            example
                .lines()
                .any(|l| l.trim_start_matches("# ").starts_with(&format!("{key} = "))),
            "controller.example.toml does not document {key}"
        );
    }
    // Where the example shows a default, it is the built-in one.
    let defaults = toml::Table::try_from(Args::default()).unwrap();
    let file: toml::Table = toml::from_str(&example).unwrap();
    for (k, v) in &file {
        if ["tls_ca", "tls_cert", "tls_key", "origin_allow"].contains(&k.as_str()) {
            continue;
        }
        assert_eq!(Some(v), defaults.get(k), "{k}");
    }
}

#[test]
fn layers_flags_over_file_with_units_and_origins() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    let config = path.to_str().unwrap();
    std::fs::write(
        &path,
        "lost_grace_s = \"1m\"\npoll_ms = 100\nmax_chain_len = 8\nmemory_high = 1\n",
    )
    .unwrap();
    let loaded = Args::from_argv([
        "shardcast-controller",
        "--config",
        config,
        "--poll-ms",
        "1s",
        "--register-keep-copy",
        "false",
        "--transport",
        "quic",
        "--insecure-plaintext",
    ])
    .unwrap();
    let c = loaded.args.config().unwrap();
    assert_eq!(c.core.lost_grace, Duration::from_secs(60));
    assert_eq!(c.core.poll, Duration::from_secs(1));
    assert_eq!(c.core.plan.max_chain_len, 8);
    assert!(!c.core.register_keeps_copy);
    assert_eq!(c.core.transport, shardcast_protocol::HopTransport::Quic);
    assert_eq!(c.tiers.memory_high, 1.0);
    assert!(loaded.args.insecure_plaintext);
    let text = loaded.render().unwrap();
    for line in [
        format!("lost_grace_s = 60  # file {config}"),
        "poll_ms = 1000  # flag --poll-ms".into(),
        "insecure_plaintext = true  # flag --insecure-plaintext".into(),
        "transport = \"quic\"  # flag --transport".into(),
        "listen = \"127.0.0.1:7500\"  # default".into(),
        "# scrape_url: not set".into(),
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} in\n{text}");
    }

    std::fs::write(&path, "heartbeat = 1000\n").unwrap();
    let err = Args::from_argv(["shardcast-controller", "--config", config]).unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "unknown field `heartbeat` (from file {config}); did you mean `heartbeat_ms`?"
        )),
        "{err}"
    );
    for (flag, value) in [
        ("--listen", "localhost"),
        ("--max-chain-len", "many"),
        ("--memory-high", "high"),
        ("--transport", "pigeon"),
        ("--lost-grace-s", "1500ms"),
    ] {
        let err = Args::from_argv(["shardcast-controller", flag, value]).unwrap_err();
        let key = flag.trim_start_matches("--").replace('-', "_");
        assert!(
            err.to_string()
                .starts_with(&format!("{key} = {value:?} (from flag {flag}): ")),
            "{err}"
        );
    }
    // A check the types do not make names the origin of the key it refuses.
    let loaded = Args::from_argv(["shardcast-controller", "--heartbeat-ms", "1"]).unwrap();
    let err = loaded.validate().unwrap_err().to_string();
    assert!(
        err.contains("heartbeat_ms must be between 50 and 60000")
            && err.contains("[heartbeat_ms from flag --heartbeat-ms]"),
        "{err}"
    );
    // A log format the daemon does not write is refused, as transferd refuses it.
    let loaded = Args::from_argv(["shardcast-controller", "--log-format", "xml"]).unwrap();
    let err = loaded.validate().unwrap_err().to_string();
    assert!(err.contains("log_format must be text or json"), "{err}");
}

#[test]
fn replication_settings_are_checked_before_any_port() {
    for (flags, says) in [
        (
            &["--lease-ttl-ms", "100"][..],
            "lease_ttl_ms must be between",
        ),
        (&["--campaign-ms", "1"][..], "campaign_ms must be between"),
        (&["--etcd-prefix", "x"][..], "etcd_prefix must start with /"),
    ] {
        let mut argv = vec!["shardcast-controller", "--state", "etcd://127.0.0.1:2379"];
        argv.extend_from_slice(flags);
        let err = config(&argv[1..]).unwrap_err().to_string();
        assert!(err.contains(says), "{flags:?}: {err}");
    }
    // Without etcd they do not apply.
    config(&["--lease-ttl-ms", "100"]).unwrap();
}

#[test]
fn otlp_endpoint_is_off_by_default_loopback_only_and_needs_the_feature() {
    let export = |extra: &[&str]| {
        let mut argv = vec!["shardcast-controller", "--insecure-plaintext"];
        argv.extend_from_slice(extra);
        Args::from_argv(argv)?.args.trace_export()
    };
    assert!(export(&[]).unwrap().is_none());
    let err = export(&["--otlp-endpoint", "http://192.0.2.1:4318"]).unwrap_err();
    assert!(format!("{err:#}").contains("loopback"), "{err:#}");
    let got = export(&[
        "--replica-id",
        "ctl-a",
        "--otlp-endpoint",
        "http://[::1]:4318",
    ]);
    if cfg!(feature = "otlp") {
        let t = got.unwrap().expect("exporting");
        assert_eq!(t.endpoint.traces_url(), "http://[::1]:4318/v1/traces");
        assert_eq!(
            (t.service_name, t.instance_id.as_str()),
            ("shardcast-controller", "ctl-a")
        );
    } else {
        let err = format!("{:#}", got.unwrap_err());
        assert!(err.contains("without the `otlp` feature"), "{err}");
    }
    // The check is one of those made before a port is bound.
    assert!(config(&["--otlp-endpoint", "http://192.0.2.1:4318"]).is_err());
}
