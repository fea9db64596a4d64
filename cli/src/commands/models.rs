//! `shardcast models` (every registered model, and registrations in progress) and
//! `shardcast model NAME` (one model's manifest summary).

use shardcast_protocol::controller::{
    GetModelRequest, ListModelsRequest, ListModelsResponse, ModelInfo,
};
use shardcast_protocol::units::format_bytes;

use crate::client::Client;
use crate::error::CliError;
use crate::output::{Output, short};
use crate::table::{table, table_or};

/// Lists the registered models.
pub(crate) async fn list(c: &mut Client, out: Output) -> Result<ListModelsResponse, CliError> {
    let r = c.list_models(ListModelsRequest {}).await?.into_inner();
    out.show(&r, |r| render_list(r, unix_now()));
    Ok(r)
}

/// Shows one model.
pub(crate) async fn show(
    model: String,
    c: &mut Client,
    out: Output,
) -> Result<ModelInfo, CliError> {
    let m = c.get_model(GetModelRequest { model }).await?.into_inner();
    out.show(&m, render_model);
    Ok(m)
}

/// Seconds since the Unix epoch (0 if the clock is before it).
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// What `models` prints; `now` (Unix seconds) dates the registrations in progress.
pub(crate) fn render_list(r: &ListModelsResponse, now: f64) -> String {
    let rows = r.models.iter().map(|m| {
        vec![
            m.name.clone(),
            short(&m.digest),
            format_bytes(m.total_bytes),
            m.shards.len().to_string(),
            m.origin.clone(),
        ]
    });
    let mut s = table_or(
        &["MODEL", "DIGEST", "SIZE", "SHARDS", "ORIGIN"],
        rows,
        "no models registered",
    );
    if !r.registering.is_empty() {
        let rows = r.registering.iter().map(|g| {
            vec![
                g.name.clone(),
                g.via_host.clone(),
                format!("{:.0}s", (now - g.started_at).max(0.0)),
                g.origin.clone(),
            ]
        });
        s.push_str("\nregistering:\n");
        s.push_str(&table(&["MODEL", "READ BY", "FOR", "ORIGIN"], rows));
    }
    s
}

/// What `model NAME` prints.
pub(crate) fn render_model(m: &ModelInfo) -> String {
    let mut s = format!(
        "{} {}\norigin {}\nsize {} in {} shards, chunk {}\n",
        m.name,
        m.digest,
        m.origin,
        format_bytes(m.total_bytes),
        m.shards.len(),
        format_bytes(u64::from(m.chunk_size))
    );
    let rows = m
        .shards
        .iter()
        .map(|s| vec![s.path.clone(), format_bytes(s.size), s.chunks.to_string()]);
    s.push_str(&table(&["SHARD", "SIZE", "CHUNKS"], rows));
    s
}
