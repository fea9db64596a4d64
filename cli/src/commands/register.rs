//! `shardcast register NAME ORIGIN`: build a model's manifest from its origin.

use shardcast_protocol::controller::{ModelInfo, RegisterModelRequest};
use shardcast_protocol::units::{format_bytes, parse_size};

use crate::args::RegisterArgs;
use crate::client::Client;
use crate::error::{CliError, usage};
use crate::output::Output;

/// Registers a model; the registered model (or, with `--no-wait`, the registration started).
pub(crate) async fn run(
    args: RegisterArgs,
    c: &mut Client,
    out: Output,
) -> Result<ModelInfo, CliError> {
    let RegisterArgs {
        name,
        origin,
        chunk_size,
        via,
        profile,
        no_wait,
    } = args;
    let profile_json = match profile {
        None => String::new(),
        Some(p) => std::fs::read_to_string(&p)
            .map_err(|e| usage(format!("--profile {}: {e}", p.display())))?,
    };
    let chunk_size = match chunk_size {
        None => 0,
        Some(s) => {
            let v = parse_size(&s).map_err(|e| usage(format!("--chunk-size: {e}")))?;
            u32::try_from(v).map_err(|_| usage("--chunk-size must be below 4 GiB"))?
        }
    };
    if !out.json && !no_wait {
        eprintln!(
            "reading {origin} to build the manifest (large models take a while; the registration goes on if this command is interrupted)…"
        );
    }
    let m = c
        .register_model(RegisterModelRequest {
            name,
            origin,
            chunk_size,
            via_host: via.unwrap_or_default(),
            profile_json,
            no_wait,
        })
        .await?
        .into_inner();
    out.show(&m, |m| render(m, no_wait));
    Ok(m)
}

/// What `register` prints.
pub(crate) fn render(m: &ModelInfo, no_wait: bool) -> String {
    if no_wait {
        format!(
            "registering {} from {} (`shardcast models` lists it until it ends)\n",
            m.name, m.origin
        )
    } else {
        format!(
            "registered {} {} ({}, {} shards)\n",
            m.name,
            m.digest,
            format_bytes(m.total_bytes),
            m.shards.len()
        )
    }
}
