//! `transferd`: the shardcast per-host daemon. See `transferd --help` and
//! `transferd.example.toml`.

use clap::CommandFactory;
use shardcast_protocol::layered::PrintConfig;
use transferd::config::{Args, Config};

fn main() -> std::process::ExitCode {
    // clap answers --help and --version, and refuses an unknown flag, itself (exit 2).
    let matches = Args::command().get_matches();
    let loaded = match Config::from_matches(&matches) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("transferd: configuration error: {e:#}");
            return std::process::ExitCode::from(2);
        }
    };
    if PrintConfig::requested(&matches) {
        return match loaded.render() {
            Ok(text) => {
                print!("{text}");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("transferd: configuration error: {e:#}");
                std::process::ExitCode::from(2)
            }
        };
    }
    let config = loaded.config;
    let traces = match shardcast_identity::process::init_logging(
        "SHARDCAST_LOG",
        config.json_logs,
        config.traces.as_ref(),
    ) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("transferd: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = config.worker_threads {
        runtime.worker_threads(n);
    }
    let runtime = match runtime.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("transferd: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(transferd::daemon::run(config));
    // The spans of the last moments (a drain, the hops it waited for) go out before exit.
    if let Err(e) = traces.shutdown() {
        eprintln!("transferd: {e}");
    }
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("transferd: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
