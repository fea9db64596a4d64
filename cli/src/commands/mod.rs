//! One module per command. Each command is a function taking its parsed arguments, the
//! controller's client and the [`Output`] handle, and returning what the API answered (a
//! typed message); a pure `render` function beside it turns that into the text printed
//! without `--json`, so each table can be tested without a controller.

pub(crate) mod autoscaler;
pub(crate) mod certs;
pub(crate) mod evict;
pub(crate) mod hosts;
pub(crate) mod manual;
pub(crate) mod models;
pub(crate) mod plan;
pub(crate) mod plans;
pub(crate) mod prewarm;
pub(crate) mod register;
pub(crate) mod status;
pub(crate) mod watch;

use shardcast_protocol::controller::{Tier, Transport};

use crate::args::Command;
use crate::client::Client;
use crate::error::{CliError, usage};
use crate::output::Output;

/// Runs a command that goes through the controller. A plan followed to its end gives the
/// exit status ([`watch::plan_result`]).
pub(crate) async fn dispatch(
    command: Command,
    c: &mut Client,
    out: Output,
) -> Result<(), CliError> {
    match command {
        Command::Register(args) => register::run(args, c, out).await.map(drop),
        Command::Models => models::list(c, out).await.map(drop),
        Command::Model { model } => models::show(model, c, out).await.map(drop),
        Command::Hosts => hosts::run(c, out).await.map(drop),
        Command::Prewarm(args) => prewarm::prewarm(args, c, out).await.and_then(ended),
        Command::ScaleOut(args) => prewarm::scale_out(args, c, out).await.and_then(ended),
        Command::Evict(args) => evict::run(args, c, out).await.map(drop),
        Command::Status { model } => status::run(model, c, out).await.map(drop),
        Command::Watch { plan } => watch::run(c, &plan, out)
            .await
            .and_then(|last| watch::plan_result(&last)),
        Command::Plans => plans::run(c, out).await.map(drop),
        Command::ReportLoad(args) => autoscaler::report_load(args, c, out).await.map(drop),
        Command::Events(args) => autoscaler::events(args, c, out).await.map(drop),
        Command::Plan(args) => plan::online(args, c, out).await.map(drop),
        // Local files only; `run` takes it before connecting.
        Command::Certs { action } => certs::run(action),
        // Offline; `run` takes them before connecting.
        Command::Completions { shell } => manual::completions(shell, &mut std::io::stdout()),
        Command::Man { out: None } => manual::page(&mut std::io::stdout()),
        Command::Man { out: Some(dir) } => manual::pages(&dir).map(drop),
    }
}

/// The exit status of a followed plan; none when not followed (`--no-wait`).
fn ended(last: Option<shardcast_protocol::controller::PlanStatus>) -> Result<(), CliError> {
    last.as_ref().map_or(Ok(()), watch::plan_result)
}

/// A `--tier` argument: memory, disk or gpu.
fn tier_arg(s: &str) -> Result<i32, CliError> {
    match Tier::from_label(s) {
        Some(Tier::Unspecified) | None => Err(usage(format!(
            "--tier must be one of {}, got {s:?}",
            Tier::LABELS.join(", ")
        ))),
        Some(t) => Ok(t as i32),
    }
}

/// A `--transport` argument; `""` leaves the choice to the controller.
fn transport_arg(s: &str) -> Result<i32, CliError> {
    Transport::from_label(s).map(|t| t as i32).ok_or_else(|| {
        usage(format!(
            "--transport must be one of {}, got {s:?}",
            Transport::LABELS.join(", ")
        ))
    })
}
