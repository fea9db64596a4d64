//! `shardcast-controller`: see `shardcast_controller::server`.

use clap::CommandFactory;
use shardcast_controller::server::{Args, Cli, run};
use shardcast_protocol::layered::PrintConfig;

#[tokio::main]
async fn main() {
    // clap answers --help and --version, and refuses an unknown flag, itself (exit 2).
    let matches = Cli::command().get_matches();
    // `shardcast-controller openapi`: the document, generated from the code; no settings.
    if matches.subcommand_name() == Some("openapi") {
        print!("{}", shardcast_controller::openapi::json());
        return;
    }
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
    if PrintConfig::requested(&matches) {
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
    // RUST_LOG, tracing's own variable (transferd reads SHARDCAST_LOG); log_format is text
    // or json (validated above).
    let traces = match args.trace_export().and_then(|export| {
        Ok(shardcast_identity::process::init_logging(
            "RUST_LOG",
            args.log_format == "json",
            export.as_ref(),
        )?)
    }) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("shardcast-controller: {e:#}");
            std::process::exit(1);
        }
    };
    let outcome = run(args).await;
    // The spans of the last moments go out before exit (process::exit skips destructors).
    if let Err(e) = traces.shutdown() {
        eprintln!("shardcast-controller: {e}");
    }
    if let Err(e) = outcome {
        eprintln!("shardcast-controller: {e:#}");
        std::process::exit(1);
    }
}
