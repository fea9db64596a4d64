//! `shardcast-controller`: see `shardcast_controller::server`.

use clap::Parser;
use shardcast_controller::server::{Args, run};

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if args.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
    if let Err(e) = run(args).await {
        eprintln!("shardcast-controller: {e:#}");
        std::process::exit(1);
    }
}
