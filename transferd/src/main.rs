//! `transferd`: the shardcast per-host daemon. See `transferd --help` and
//! `transferd.example.toml`.

use clap::Parser;
use tracing_subscriber::EnvFilter;
use transferd::config::{Args, Config};

fn main() -> std::process::ExitCode {
    let config = match Config::load(Args::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("transferd: configuration error: {e:#}");
            return std::process::ExitCode::from(2);
        }
    };
    let filter =
        EnvFilter::try_from_env("SHARDCAST_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if config.json_logs {
        builder.json().init();
    } else {
        builder.init();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("transferd: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(transferd::daemon::run(config)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("transferd: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
