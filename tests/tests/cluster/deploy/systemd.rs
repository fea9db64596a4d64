//! deploy/systemd: each unit verified by `systemd-analyze verify` (with `ExecStart` pointed
//! at the freshly built binary, in a copy), any warning about the unit a failure; and the
//! example env file each unit loads given to the daemon's own loader, its paths checked
//! against the unit's sandbox (the tiers writable, nothing in a hidden directory).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use super::daemons::{self, Daemon, Listener};
use super::{deploy, env_file, read};

/// A unit file's `[Service]` settings: every value of every key, in order.
fn service_section(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut in_service = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_service = line == "[Service]";
        } else if in_service
            && !line.starts_with('#')
            && let Some((k, v)) = line.split_once('=')
        {
            out.entry(k.trim().into())
                .or_default()
                .push(v.trim().into());
        }
    }
    out
}

fn units() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(deploy("systemd"))
        .expect("deploy/systemd")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "service"))
        .collect();
    v.sort();
    v
}

/// The built binary of `daemon` (built now if needed, like the cluster tests' daemons).
fn built(daemon: Daemon) -> PathBuf {
    match daemon {
        Daemon::Transferd => shardcast_bench::cluster::transferd_bin(),
        Daemon::Controller => shardcast_bench::control::controller_bin(),
    }
    .expect("the daemon's binary")
}

#[test]
fn systemd_units_verify_and_give_the_daemons_only_what_they_accept() {
    let units = units();
    let daemons: Vec<Daemon> = units
        .iter()
        .map(|u| {
            let section = service_section(&read(u));
            let exec = section.get("ExecStart").and_then(|v| v.first()).cloned();
            exec.as_deref()
                .and_then(|e| e.split_whitespace().next())
                .and_then(Daemon::from_program)
                .unwrap_or_else(|| panic!("{}: ExecStart {exec:?} runs no daemon", u.display()))
        })
        .collect();
    assert_eq!(
        daemons,
        [Daemon::Controller, Daemon::Transferd],
        "one unit per daemon"
    );
    let analyze = Command::new("systemd-analyze").arg("--version").output();
    let tmp = tempfile::tempdir().unwrap();
    for (unit, daemon) in units.iter().zip(daemons) {
        let name = unit.file_name().and_then(|n| n.to_str()).unwrap_or("?");
        let text = read(unit);
        let section = service_section(&text);
        let one = |k: &str| {
            section
                .get(k)
                .and_then(|v| v.last())
                .map(String::as_str)
                .unwrap_or_else(|| panic!("{name}: no {k}="))
        };
        // The sandbox the issue asks for, and the limits the daemons need.
        assert_eq!(one("ProtectSystem"), "strict", "{name}");
        for k in ["NoNewPrivileges", "ProtectHome", "PrivateTmp"] {
            assert_eq!(one(k), "yes", "{name}: {k}");
        }
        assert!(
            one("LimitNOFILE").parse::<u64>().unwrap() >= 65536,
            "{name}"
        );
        assert_eq!(one("Restart"), "on-failure", "{name}");
        assert!(one("TimeoutStopSec").ends_with('s'), "{name}");
        if daemon == Daemon::Transferd {
            assert_eq!(one("LimitMEMLOCK"), "infinity", "{name}: pinned buffers");
        }

        // The example env file the unit loads: every variable one the daemon reads, the
        // whole configuration accepted by its loader.
        let env_path = one("EnvironmentFile").trim_start_matches('-');
        let example = deploy("systemd").join(
            std::path::Path::new(env_path)
                .file_name()
                .expect("an env file name"),
        );
        let vars: BTreeMap<String, String> = env_file(&read(&example))
            .unwrap_or_else(|e| panic!("{}: {e}", example.display()))
            .into_iter()
            .collect();
        let argv = daemons::argv(daemon, &[], &vars, |var| {
            daemon
                .reads_env_directly(var)
                .then_some("read by the daemon")
        })
        .unwrap_or_else(|e| panic!("{}: {e:?}", example.display()));
        let settings = daemon.load(&argv).unwrap_or_else(|e| {
            panic!("{}: {} refuses it: {e}", example.display(), daemon.binary())
        });

        // Paths against the sandbox: the tiers and the state writable; nothing in a
        // directory ProtectHome= or PrivateTmp= hides; sockets in the runtime directory.
        let mut writable: Vec<String> = section
            .get("ReadWritePaths")
            .into_iter()
            .flatten()
            .flat_map(|v| v.split_whitespace())
            .map(|p| p.trim_start_matches('-').to_string())
            .collect();
        writable.extend(
            section
                .get("StateDirectory")
                .into_iter()
                .flatten()
                .map(|d| format!("/var/lib/{d}")),
        );
        for pk in daemon.path_keys() {
            let Some(p) = daemons::text(&settings, pk.key) else {
                continue;
            };
            let path = std::path::Path::new(p);
            if pk.writable {
                assert!(
                    writable.iter().any(|w| path.starts_with(w)),
                    "{name}: {} = {p} is not writable under ProtectSystem=strict (ReadWritePaths: {writable:?})",
                    pk.key
                );
            }
            for hidden in ["/home", "/root", "/run/user", "/tmp", "/var/tmp"] {
                assert!(
                    !path.starts_with(hidden),
                    "{name}: {} = {p} is hidden by ProtectHome=/PrivateTmp=",
                    pk.key
                );
            }
        }
        let runtime: Vec<String> = section
            .get("RuntimeDirectory")
            .into_iter()
            .flatten()
            .map(|d| format!("/run/{d}"))
            .collect();
        for &(key, _) in daemon.listener_keys() {
            if let Some(Ok(Listener::Unix(p))) = daemons::text(&settings, key).map(Listener::parse)
            {
                assert!(
                    runtime.iter().any(|r| p.starts_with(r)),
                    "{name}: {key} socket {} outside RuntimeDirectory {runtime:?}",
                    p.display()
                );
            }
        }

        // systemd's own verdict, on a copy that runs the built binary.
        if analyze.is_err() {
            // The marker scripts/skip-report lists.
            eprintln!("SKIPPED: systemd-analyze is not on PATH: `systemd-analyze verify {name}`");
            continue;
        }
        let bin = built(daemon);
        let exec = one("ExecStart");
        let program = exec.split_whitespace().next().unwrap_or_default();
        let copy = tmp.path().join(name);
        std::fs::write(
            &copy,
            text.replace(
                &format!("ExecStart={exec}"),
                &format!(
                    "ExecStart={}",
                    exec.replacen(program, &bin.display().to_string(), 1)
                ),
            ),
        )
        .unwrap();
        let out = Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(&copy)
            .output()
            .expect("running systemd-analyze");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let about_unit: Vec<&str> = said.lines().filter(|l| l.contains(name)).collect();
        assert!(
            out.status.success() && about_unit.is_empty(),
            "systemd-analyze verify {name} (exit {:?}):\n{said}",
            out.status.code()
        );
        if !said.trim().is_empty() {
            println!("systemd-analyze verify {name}, about other units:\n{said}");
        }
        println!("systemd-analyze verify {name}: clean");
    }
}
