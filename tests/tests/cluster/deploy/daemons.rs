//! The two daemons as the deploy files see them: their clap command lines (the flags and the
//! environment variables they declare), the variables they read outside clap, and their
//! own loaders, which turn a command line into the validated, effective settings that
//! `--print-config` prints (parsed back here as TOML).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::CommandFactory;

/// A daemon a deploy file runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Daemon {
    Transferd,
    Controller,
}

/// A setting whose value is a path, and whether the daemon writes beneath it.
pub(crate) struct PathKey {
    pub(crate) key: &'static str,
    pub(crate) writable: bool,
}

const fn path(key: &'static str, writable: bool) -> PathKey {
    PathKey { key, writable }
}

impl Daemon {
    /// The daemon a container's `command[0]` or a unit's `ExecStart` runs, by file name.
    pub(crate) fn from_program(program: &str) -> Option<Self> {
        match Path::new(program).file_name()?.to_str()? {
            "transferd" => Some(Self::Transferd),
            "shardcast-controller" => Some(Self::Controller),
            _ => None,
        }
    }

    /// The binary's name.
    pub(crate) fn binary(self) -> &'static str {
        match self {
            Self::Transferd => "transferd",
            Self::Controller => "shardcast-controller",
        }
    }

    /// The daemon's own clap command (what `--help` prints and what parses its argv).
    pub(crate) fn command(self) -> clap::Command {
        match self {
            Self::Transferd => transferd::config::Args::command(),
            Self::Controller => shardcast_controller::server::Cli::command(),
        }
    }

    /// The long flag (without `--`) whose environment variable is `var`, if clap declares one.
    pub(crate) fn flag_of_env(self, var: &str) -> Option<String> {
        self.command().get_arguments().find_map(|a| {
            (a.get_env().and_then(|e| e.to_str()) == Some(var))
                .then(|| a.get_long().map(str::to_string))
                .flatten()
        })
    }

    /// Whether `--flag` (without the dashes) is one of the daemon's flags.
    pub(crate) fn has_flag(self, flag: &str) -> bool {
        flag == "help"
            || flag == "version"
            || self
                .command()
                .get_arguments()
                .any(|a| a.get_long() == Some(flag))
    }

    /// Whether the daemon reads environment variable `var` itself, outside clap (a logging
    /// filter, a password kept out of the flags): its name is a string literal in the
    /// daemon's sources or in the shared process shell (`identity`).
    pub(crate) fn reads_env_directly(self, var: &str) -> bool {
        let crates: &[&str] = match self {
            Self::Transferd => &["transferd/src", "identity/src"],
            Self::Controller => &["controller/src", "identity/src"],
        };
        let literal = format!("\"{var}\"");
        crates
            .iter()
            .any(|dir| source_mentions(&super::repo().join(dir), &literal))
    }

    /// Parses and validates `argv` (`argv[0]` first) with the daemon's own loader, as the
    /// daemon does before binding a port, and returns the effective settings.
    pub(crate) fn load(self, argv: &[String]) -> Result<toml::Table, String> {
        let text = match self {
            Self::Transferd => transferd::config::Config::from_args(argv)
                .and_then(|l| l.render())
                .map_err(|e| format!("{e:#}"))?,
            Self::Controller => {
                let loaded = shardcast_controller::server::Args::from_argv(argv)
                    .map_err(|e| format!("{e:#}"))?;
                loaded.validate().map_err(|e| format!("{e:#}"))?;
                loaded.render().map_err(|e| format!("{e:#}"))?
            }
        };
        toml::from_str(&text).map_err(|e| format!("--print-config output is not TOML: {e}"))
    }

    /// The settings that name listeners: (key, whether it carries HTTP with `/healthz`,
    /// `/readyz` and `/metrics`).
    pub(crate) fn listener_keys(self) -> &'static [(&'static str, bool)] {
        match self {
            Self::Transferd => &[
                ("listen", false),
                ("agent_listen", false),
                ("admin_listen", true),
            ],
            Self::Controller => &[("listen", false), ("http_listen", true)],
        }
    }

    /// The settings that name paths.
    pub(crate) fn path_keys(self) -> &'static [PathKey] {
        const TRANSFERD: &[PathKey] = &[
            path("memory_dir", true),
            path("data_dir", true),
            path("tls_ca", false),
            path("tls_cert", false),
            path("tls_key", false),
            path("tokens_file", false),
        ];
        const CONTROLLER: &[PathKey] = &[
            path("state_dir", true),
            path("tls_ca", false),
            path("tls_cert", false),
            path("tls_key", false),
            path("tokens_file", false),
        ];
        match self {
            Self::Transferd => TRANSFERD,
            Self::Controller => CONTROLLER,
        }
    }

    /// (advertised address key, the listener it must match the port of).
    pub(crate) fn advertise_keys(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Self::Transferd => &[("advertise", "listen"), ("agent_advertise", "agent_listen")],
            Self::Controller => &[("advertise", "listen"), ("advertise_http", "http_listen")],
        }
    }
}

fn source_mentions(dir: &Path, literal: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let p = e.path();
        if p.is_dir() {
            source_mentions(&p, literal)
        } else {
            p.extension().is_some_and(|x| x == "rs")
                && std::fs::read_to_string(&p).is_ok_and(|t| t.contains(literal))
        }
    })
}

/// A listener setting's value: a TCP address, or a Unix socket path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Listener {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl Listener {
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        match s.strip_prefix("unix:") {
            Some(p) => Ok(Self::Unix(PathBuf::from(p))),
            None => s
                .parse()
                .map(Self::Tcp)
                .map_err(|e| format!("listener {s:?}: {e}")),
        }
    }
}

/// A string setting, if set.
pub(crate) fn text<'a>(settings: &'a toml::Table, key: &str) -> Option<&'a str> {
    settings.get(key).and_then(toml::Value::as_str)
}

/// A boolean setting (false when unset).
pub(crate) fn flag(settings: &toml::Table, key: &str) -> bool {
    settings
        .get(key)
        .and_then(toml::Value::as_bool)
        .unwrap_or(false)
}

/// The port of `host:port` (a name or an address).
pub(crate) fn port_of(addr: &str) -> Option<u16> {
    addr.rsplit_once(':')?.1.parse().ok()
}

/// A command line for `daemon` from its arguments and its environment: every variable clap
/// declares becomes its flag (unless the arguments already give that flag, which wins, as
/// a flag wins over a variable in the daemon). Variables clap does not declare are
/// refused unless `other` accepts them (it says why, or `None`).
pub(crate) fn argv(
    daemon: Daemon,
    args: &[String],
    env: &BTreeMap<String, String>,
    mut other: impl FnMut(&str) -> Option<&'static str>,
) -> Result<Vec<String>, Vec<String>> {
    let mut errors = Vec::new();
    let mut out = vec![daemon.binary().to_string()];
    let mut given = Vec::new();
    for a in args {
        if let Some(flag) = a.strip_prefix("--") {
            let name = flag.split_once('=').map_or(flag, |(n, _)| n);
            if !daemon.has_flag(name) {
                errors.push(format!("{} has no flag --{name}", daemon.binary()));
            }
            given.push(name.to_string());
        }
        out.push(a.clone());
    }
    for (var, value) in env {
        match daemon.flag_of_env(var) {
            Some(flag) if given.contains(&flag) => {}
            Some(flag) => out.push(format!("--{flag}={value}")),
            None => {
                if other(var).is_none() {
                    errors.push(format!(
                        "{} reads no environment variable {var} (not in its --help, not read by its code)",
                        daemon.binary()
                    ));
                }
            }
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}
