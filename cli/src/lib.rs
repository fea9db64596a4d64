//! The `shardcast` operator CLI: talks to the controller's gRPC API. Tables and progress
//! bars on a terminal; `--json` prints the API's messages as JSON for scripts.
//!
//! Exit status: 0 success, 2 invalid argument, 3 not found, 4 not enough capacity,
//! 5 unavailable (no live host, controller unreachable), 6 a plan ended failed, 7 a plan
//! ended partial (some requested hosts without a verified copy, named on stderr), 1 other.
//!
//! Subcommands: `certs init|issue|rotate|token` (a PKI directory, offline), `register`,
//! `models`, `model`, `hosts`, `prewarm`, `scale-out` (`--partitions` for a burst), `evict`,
//! `status`, `watch`, `plans`, `report-load`, `events`, `plan` (a partition plan, online
//! or offline from a profile at `--link-rate` / `--load-rate`), and `completions` / `man`
//! (generated from this command line, offline). The controller is reached
//! over mutual TLS (`--tls-ca`, `--tls-cert`, `--tls-key`, several replicas through
//! `shardcast_identity::failover`) or its Unix socket. `tests/cli.rs` runs the binary as a
//! user meets it.
//!
//! Layout: [`args`](Cli) holds the command line (clap), `commands/` one module per command
//! (a function per command returning the API's typed answer, and a pure `render` for its
//! text), `table` the one table style (comfy-table), `client` the controller connection.

mod args;
mod client;
mod commands;
mod error;
mod output;
mod table;

pub use args::{
    CertsCommand, Cli, Command, EventsArgs, EvictArgs, PlanArgs, PrewarmArgs, RegisterArgs,
    ReportLoadArgs, ScaleOutArgs,
};
pub use error::{CliError, EXIT_PARTIAL};

use client::Connection;
use output::Output;

/// Runs one command.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    let Cli {
        controller,
        json,
        tls_ca,
        tls_cert,
        tls_key,
        insecure_plaintext,
        command,
    } = cli;
    let out = Output { json };
    match command {
        // No controller needed.
        Command::Certs { action } => commands::certs::run(action),
        Command::Completions { shell } => {
            commands::manual::completions(shell, &mut std::io::stdout().lock())
        }
        Command::Man { out: None } => commands::manual::page(&mut std::io::stdout().lock()),
        Command::Man { out: Some(dir) } => commands::manual::pages(&dir).map(|written| {
            for p in written {
                println!("{}", p.display());
            }
        }),
        Command::Plan(args) if args.model.is_none() => {
            commands::plan::offline(&args, out).map(drop)
        }
        command => {
            let mut c = Connection {
                controller,
                tls_ca,
                tls_cert,
                tls_key,
                insecure_plaintext,
            }
            .client()?;
            commands::dispatch(command, &mut c, out).await
        }
    }
}
