//! The process shell the daemons share (transferd and the controller): what each does
//! around its own work, written once.
//!
//! * [`init_logging`]: `tracing` to stderr, as text (coloured only on a terminal) or JSON,
//!   filtered by an environment variable each daemon names (transferd `SHARDCAST_LOG`, the
//!   controller `RUST_LOG`), and, with the `otlp` feature and an `otlp_endpoint`, the same
//!   spans exported as OTLP traces ([`crate::otlp`]).
//! * [`Security::choose`]: the TLS identity from the `tls_ca`/`tls_cert`/`tls_key`
//!   settings, or the insecure plaintext mode (refused unless every TCP listener is on
//!   loopback); each daemon words the refusal for its own settings and loads the identity
//!   with its own role.
//! * [`raise_nofile_limit`]: the soft `RLIMIT_NOFILE` raised to the hard limit at start.
//! * [`shutdown_signal`]: the wait for SIGTERM or Ctrl-C (SIGINT) that starts a shutdown.
//!
//! The command line itself stays with each daemon: the flags' environment variables and
//! help differ (`--config` reads `SHARDCAST_CONFIG` for transferd and
//! `SHARDCAST_CONTROLLER_CONFIG` for the controller, `--insecure-plaintext` takes a value
//! in one and is a switch in the other); `--print-config` and the layered loader are
//! `shardcast_protocol::layered`'s.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::TlsFiles;
use crate::otlp::{TraceError, TraceExport, Traces};

/// Sends `tracing` events to stderr, as text or (`json`) one JSON object a line, at the
/// levels the environment variable `filter_var` sets (an `EnvFilter` directive such as
/// `info,transferd::chain=debug`; `info` when unset or unreadable). With `traces` (the
/// `otlp_endpoint` setting), the spans that pass the same filter are also exported to that
/// OTLP collector: [`Traces::shutdown`] flushes them before exit. Once per process, before
/// the first event; an exporter that cannot start is refused before anything is installed.
pub fn init_logging(
    filter_var: &str,
    json: bool,
    traces: Option<&TraceExport>,
) -> Result<Traces, TraceError> {
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = EnvFilter::try_from_env(filter_var).unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only for a person at a terminal: a log file, journald or a log shipper gets
    // plain `key=value` text, not escape sequences around every field.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let stderr = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let stderr = if json {
        stderr.json().boxed()
    } else {
        stderr.boxed()
    };
    let registry = tracing_subscriber::registry().with(filter).with(stderr);
    #[cfg(feature = "otlp")]
    {
        let (otel, provider) = match traces {
            Some(export) => {
                let (layer, provider) = crate::otlp::layer(export)?;
                (Some(layer), Some(provider))
            }
            None => (None, None),
        };
        registry.with(otel).init();
        Ok(Traces::new(provider))
    }
    #[cfg(not(feature = "otlp"))]
    {
        if traces.is_some() {
            return Err(TraceError::NotBuilt);
        }
        registry.init();
        Ok(Traces::default())
    }
}

/// How a daemon authenticates everything that connects to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Security {
    /// Mutual TLS under the cluster CA with these files (the default, and required unless
    /// [`Security::InsecurePlaintext`] is set).
    Tls(TlsFiles),
    /// No TLS, no authentication; every TCP listener is on loopback.
    InsecurePlaintext,
}

/// Why the TLS settings do not give a [`Security`]; each daemon words it for its settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecurityError {
    /// The insecure mode was asked for, but this TCP listener is not on loopback.
    NotLoopback {
        /// The listener's setting (`listen`).
        listener: String,
        /// Its address.
        addr: SocketAddr,
    },
    /// Mutual TLS (the default) without all three files: the settings not given, of
    /// `tls_ca`, `tls_cert` and `tls_key`, in that order.
    Missing(Vec<&'static str>),
}

impl Security {
    /// The insecure mode if `insecure` (every TCP listener, by setting name and address,
    /// checked to be on loopback: a Unix socket's `None` passes), else mutual TLS with the
    /// three files, all required.
    pub fn choose(
        ca: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        insecure: bool,
        listeners: &[(&str, Option<SocketAddr>)],
    ) -> Result<Self, SecurityError> {
        if insecure {
            for (name, addr) in listeners {
                if let Some(a) = addr
                    && !crate::plaintext_allowed(a)
                {
                    return Err(SecurityError::NotLoopback {
                        listener: (*name).to_string(),
                        addr: *a,
                    });
                }
            }
            return Ok(Self::InsecurePlaintext);
        }
        match (ca, cert, key) {
            (Some(ca), Some(cert), Some(key)) => Ok(Self::Tls(TlsFiles { ca, cert, key })),
            (ca, cert, key) => Err(SecurityError::Missing(
                [
                    ("tls_ca", ca.is_none()),
                    ("tls_cert", cert.is_none()),
                    ("tls_key", key.is_none()),
                ]
                .into_iter()
                .filter(|(_, m)| *m)
                .map(|(n, _)| n)
                .collect(),
            )),
        }
    }
}

/// Returns when the process is asked to stop: SIGTERM, or Ctrl-C (SIGINT). Where SIGTERM
/// cannot be watched, Ctrl-C alone.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (every connection, shard file and
/// mapping holds a descriptor; distributions default the soft limit to 1024). Returns the
/// (old, new) soft limits.
pub fn raise_nofile_limit() -> std::io::Result<(u64, u64)> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let cur = getrlimit(Resource::Nofile);
    let old = cur.current.unwrap_or(u64::MAX);
    let Some(hard) = cur.maximum else {
        // Unlimited hard limit: the kernel still caps descriptors at fs.nr_open; ask for
        // a large, always-valid value.
        let new = old.max(1 << 20);
        let r = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(new),
                maximum: None,
            },
        );
        return match r {
            Ok(()) => Ok((old, new)),
            Err(_) => Ok((old, old)),
        };
    };
    if old >= hard {
        return Ok((old, old));
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(hard),
            maximum: Some(hard),
        },
    )?;
    Ok((old, hard))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nofile_limit_is_raised_to_the_hard_limit() {
        let (old, new) = raise_nofile_limit().unwrap();
        assert!(new >= old);
        let cur = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        assert_eq!(cur.current, Some(new));
    }

    #[test]
    fn security_is_tls_with_all_three_files_or_plaintext_on_loopback() {
        let p = |s: &str| Some(PathBuf::from(s));
        let loopback = [("listen", Some(SocketAddr::from(([127, 0, 0, 1], 7400))))];
        assert_eq!(
            Security::choose(p("/ca"), p("/c"), p("/k"), false, &loopback),
            Ok(Security::Tls(TlsFiles {
                ca: "/ca".into(),
                cert: "/c".into(),
                key: "/k".into(),
            }))
        );
        assert_eq!(
            Security::choose(None, p("/c"), None, false, &loopback),
            Err(SecurityError::Missing(vec!["tls_ca", "tls_key"]))
        );
        // The insecure mode wins over the files, on loopback and Unix sockets only.
        let unix_and_loopback = [("agent_listen", None), loopback[0]];
        assert_eq!(
            Security::choose(p("/ca"), None, None, true, &unix_and_loopback),
            Ok(Security::InsecurePlaintext)
        );
        let open = SocketAddr::from(([0, 0, 0, 0], 7401));
        assert_eq!(
            Security::choose(
                None,
                None,
                None,
                true,
                &[loopback[0], ("agent", Some(open))]
            ),
            Err(SecurityError::NotLoopback {
                listener: "agent".into(),
                addr: open,
            })
        );
    }

    #[tokio::test]
    async fn shutdown_signal_waits_for_a_signal() {
        let wait = tokio::time::timeout(std::time::Duration::from_millis(100), shutdown_signal());
        assert!(wait.await.is_err(), "no signal, no shutdown");
    }
}
