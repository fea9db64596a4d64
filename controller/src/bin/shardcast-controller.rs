//! `shardcast-controller`: see `shardcast_controller::server`.

use clap::CommandFactory;
use shardcast_controller::server::{Args, Cli, run};

#[tokio::main]
async fn main() {
    // clap answers --help and --version, and refuses an unknown flag, itself (exit 2).
    let matches = Cli::command().get_matches();
    // Settings that cannot be read (an unknown key, a value of the wrong type: exit 2, as
    // clap's refusals) or that do not pass the checks (exit 1) stop the controller before
    // any port is bound.
    let loaded = match Args::from_matches(&matches) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("shardcast-controller: configuration error: {e:#}");
            std::process::exit(2);
        }
    };
    if let Err(e) = loaded.validate() {
        eprintln!("shardcast-controller: {e:#}");
        std::process::exit(1);
    }
    if matches.get_flag("print_config") {
        match loaded.render() {
            Ok(text) => {
                print!("{text}");
                return;
            }
            Err(e) => {
                eprintln!("shardcast-controller: configuration error: {e:#}");
                std::process::exit(2);
            }
        }
    }
    let args = loaded.args;
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
