//! `shardcast status MODEL`: where a model is, per host and tier, and its plans in flight.

use shardcast_protocol::controller::{GetStatusRequest, ModelStatus};
use shardcast_protocol::units::format_bytes;

use crate::client::Client;
use crate::error::CliError;
use crate::output::{Output, up_down};
use crate::table::table_or;

/// A model's whereabouts.
pub(crate) async fn run(
    model: String,
    c: &mut Client,
    out: Output,
) -> Result<ModelStatus, CliError> {
    let s = c.get_status(GetStatusRequest { model }).await?.into_inner();
    out.show(&s, render);
    Ok(s)
}

/// What `status` prints: the model, a row per host holding some of it (or `no copies`),
/// the plans in flight.
pub(crate) fn render(s: &ModelStatus) -> String {
    let m = s.model.clone().unwrap_or_default();
    let mut out = format!(
        "{} {} ({})\n",
        m.name,
        m.digest,
        format_bytes(m.total_bytes)
    );
    let rows = s.hosts.iter().map(|h| {
        vec![
            h.host.clone(),
            up_down(h.up),
            tier_cell(h.memory, h.memory_bytes, m.total_bytes),
            tier_cell(h.disk, h.disk_bytes, m.total_bytes),
            h.gpus.to_string(),
        ]
    });
    out.push_str(&table_or(
        &["HOST", "STATE", "MEMORY", "DISK", "GPUS"],
        rows,
        "no copies",
    ));
    if !s.plans.is_empty() {
        out.push_str(&format!("plans in flight: {}\n", s.plans.join(", ")));
    }
    out
}

/// A tier's cell: `complete`, the verified bytes of a partial copy, or `-`.
fn tier_cell(complete: bool, bytes: u64, total: u64) -> String {
    if complete {
        "complete".into()
    } else if bytes > 0 {
        format!("{} / {}", format_bytes(bytes), format_bytes(total))
    } else {
        "-".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardcast_protocol::controller::{HostHolding, ModelInfo};

    #[test]
    fn holders_complete_partial_and_absent() {
        let s = ModelStatus {
            model: Some(ModelInfo {
                name: "org/m".into(),
                digest: "abc".into(),
                total_bytes: 4 << 20,
                ..Default::default()
            }),
            hosts: vec![
                HostHolding {
                    host: "h1".into(),
                    up: true,
                    memory: true,
                    memory_bytes: 4 << 20,
                    gpus: 2,
                    ..Default::default()
                },
                HostHolding {
                    host: "host-2".into(),
                    disk_bytes: 1 << 20,
                    ..Default::default()
                },
            ],
            plans: vec!["p-1".into()],
        };
        let total = format_bytes(4 << 20);
        let partial = format!("{} / {total}", format_bytes(1 << 20));
        let expected = format!(
            "org/m abc ({total})\n\
             HOST    STATE  {:<w$}  {:<w2$}  GPUS\n\
             h1      up     {:<w$}  {:<w2$}  2\n\
             host-2  DOWN   {:<w$}  {:<w2$}  0\n\
             plans in flight: p-1\n",
            "MEMORY",
            "DISK",
            "complete",
            "-",
            "-",
            partial,
            w = "complete".len().max("MEMORY".len()),
            w2 = partial.len(),
        );
        assert_eq!(render(&s), expected);
    }

    #[test]
    fn a_model_nobody_holds() {
        let s = ModelStatus {
            model: Some(ModelInfo {
                name: "org/m".into(),
                digest: "abc".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            render(&s),
            format!("org/m abc ({})\nno copies\n", format_bytes(0))
        );
    }

    /// The sample in docs/OPERATIONS.md ("The `shardcast` CLI").
    #[test]
    fn the_documented_sample() {
        let gib = 1u64 << 30;
        let total = 15 * gib;
        let holding =
            |host: &str, up: bool, memory_bytes: u64, disk: bool, gpus: u32| HostHolding {
                host: host.into(),
                up,
                memory: memory_bytes == total,
                disk,
                memory_bytes,
                disk_bytes: if disk { total } else { 0 },
                gpus,
            };
        let s = ModelStatus {
            model: Some(ModelInfo {
                name: "org/llama-3-8b".into(),
                digest: "DIGEST".into(),
                total_bytes: total,
                ..Default::default()
            }),
            hosts: vec![
                holding("gpu-1", true, total, true, 1),
                holding("gpu-2", true, 6 * gib + (205 << 20), false, 0),
                holding("gpu-3", false, 0, true, 0),
            ],
            plans: vec!["p-000017".into()],
        };
        let doc = include_str!("../../../docs/OPERATIONS.md");
        let sample = doc
            .split("For example, `shardcast status org/llama-3-8b`:\n\n```text\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("the sample in docs/OPERATIONS.md");
        let digest = sample
            .split_whitespace()
            .nth(1)
            .expect("a digest in the sample");
        let rendered = render(&s).replace("DIGEST", digest);
        assert_eq!(rendered, sample);
    }
}
