//! `shardcast plan`: a partition plan, of a registered model through the controller, or
//! offline from a profile file or a synthetic T5-3B-like profile (no controller needed).

use shardcast_policies::partition::{self, PartitionPlan};
use shardcast_policies::profile::{Bandwidths, MIN_RATE_BPS, ModelProfile};
use shardcast_protocol::controller::GetPartitionPlanRequest;
use shardcast_protocol::units::{format_bytes, parse_size};

use crate::args::PlanArgs;
use crate::client::Client;
use crate::error::{CliError, usage};
use crate::output::{Output, print_json};
use crate::table::table;

/// The chosen plan of a registered model, as the controller computed it; `None` when none
/// fits. With `--json`, the controller's answer as it came.
pub(crate) async fn online(
    args: PlanArgs,
    c: &mut Client,
    out: Output,
) -> Result<Option<PartitionPlan>, CliError> {
    let gpu_memory =
        parse_size(&args.gpu_memory).map_err(|e| usage(format!("--gpu-memory: {e}")))?;
    let r = c
        .get_partition_plan(GetPartitionPlanRequest {
            model: args.model.unwrap_or_default(),
            max_partitions: args.max_partitions,
            gpu_memory,
            queue: args.queue,
        })
        .await?
        .into_inner();
    let v: serde_json::Value = serde_json::from_str(&r.json).unwrap_or_default();
    let plan: Option<PartitionPlan> = serde_json::from_value(v["chosen"].clone()).ok();
    if out.json {
        println!("{}", r.json);
    } else {
        print!(
            "{}",
            render(
                v["model"].as_str().unwrap_or_default(),
                r.estimated,
                plan.as_ref(),
                args.queue
            )
        );
    }
    Ok(plan)
}

/// Plans offline from `--profile` or `--synthetic-layers`: no controller involved. The
/// chosen plan; `None` when none fits.
pub(crate) fn offline(args: &PlanArgs, out: Output) -> Result<Option<PartitionPlan>, CliError> {
    let gpu_memory =
        parse_size(&args.gpu_memory).map_err(|e| usage(format!("--gpu-memory: {e}")))?;
    let link_bps = rate("--link-rate", args.link_rate.as_ref())?;
    let load_bps = rate("--load-rate", args.load_rate.as_ref())?;
    let mut profile: ModelProfile = match (&args.profile, args.synthetic_layers) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| usage(format!("--profile {}: {e}", path.display())))?;
            serde_json::from_str(&text)
                .map_err(|e| usage(format!("--profile {}: {e}", path.display())))?
        }
        (None, Some(n)) => shardcast_policies::profile::synthetic_t5_3b_like(n),
        (None, None) => {
            return Err(usage(
                "give a registered model, --profile FILE or --synthetic-layers N",
            ));
        }
    };
    if let Some(bps) = load_bps {
        profile.estimate_load(bps);
    }
    profile
        .validate()
        .map_err(|e| usage(format!("profile: {e}")))?;
    // The link between partitions: the thesis' testbed unless told.
    let link = link_bps.unwrap_or_else(|| Bandwidths::default().link_bps);
    let queue = args.queue;
    let table = partition::precompute(
        &profile,
        args.max_partitions.max(1) as usize,
        gpu_memory,
        link,
        queue.max(64),
    )
    .map_err(|e| CliError {
        exit: 4,
        message: format!("no partition plan: {e}"),
    })?;
    let chosen = table.best_for(queue.max(1)).cloned();
    if out.json {
        print_json(
            &serde_json::json!({"chosen": chosen, "table": table, "estimated": profile.estimated}),
        );
    } else {
        print!(
            "{}",
            render(&profile.model, profile.estimated, chosen.as_ref(), queue)
        );
    }
    Ok(chosen)
}

/// A rate given to an offline plan (`--link-rate`, `--load-rate`): finite and at least
/// [`MIN_RATE_BPS`].
fn rate(flag: &str, value: Option<&String>) -> Result<Option<f64>, CliError> {
    let Some(s) = value else { return Ok(None) };
    let bps = shardcast_protocol::units::parse_rate(s)
        .map_err(|e| usage(format!("{flag}: {e}")))?
        .ok_or_else(|| {
            usage(format!(
                "{flag} must be a finite rate, e.g. 100Gbit or 25GB/s"
            ))
        })?;
    if bps < MIN_RATE_BPS {
        return Err(usage(format!(
            "{flag} must be at least 1MB/s, got {s:?} ({bps} bytes/s; a number without a unit \
             is bytes/s: write e.g. 100Gbit or 25GB/s)"
        )));
    }
    Ok(Some(bps as f64))
}

/// A plan for a queue of `queue`: its figures, then a row per partition.
pub(crate) fn render(
    model: &str,
    estimated: bool,
    plan: Option<&PartitionPlan>,
    queue: u32,
) -> String {
    let Some(p) = plan else {
        return format!("{model}: no plan\n");
    };
    let mut s = format!(
        "{model}: {} partition(s) for a queue of {} — cold start {:.2} s, mean latency {:.2} s{}\n",
        p.partitions.len(),
        queue.max(1),
        p.cold_start_s,
        p.latency_s,
        if estimated {
            " (figures are estimates: no measured profile)"
        } else {
            ""
        }
    );
    let rows = p.partitions.iter().enumerate().map(|(i, part)| {
        vec![
            i.to_string(),
            format!("{:?}", part.groups),
            format_bytes(part.weight_bytes),
            format!("{:.3}s", part.load_s),
            format!("{:.3}s", part.exec_s),
        ]
    });
    s.push_str(&table(&["PART", "GROUPS", "WEIGHTS", "LOAD", "EXEC"], rows));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_rates_parse_and_refuse_with_the_flag_named() {
        let r = |s: &str| rate("--link-rate", Some(&s.to_string()));
        assert_eq!(r("400Gbit").unwrap(), Some(50e9));
        assert_eq!(r("25GB/s").unwrap(), Some(25e9));
        assert_eq!(rate("--link-rate", None).unwrap(), None);
        for (bad, says) in [
            ("fast", "invalid rate"),
            ("unlimited", "must be a finite rate"),
            ("100", "a number without a unit is bytes/s"),
        ] {
            let e = r(bad).unwrap_err();
            assert_eq!(e.exit, 2);
            assert!(e.message.starts_with("--link-rate"), "{}", e.message);
            assert!(e.message.contains(says), "{}", e.message);
        }
    }

    #[test]
    fn a_synthetic_plan_renders_a_row_per_partition() {
        let profile = shardcast_policies::profile::synthetic_t5_3b_like(8);
        let table = partition::precompute(&profile, 4, 16 << 30, 1.25e9, 64).unwrap();
        let plan = table.best_for(8).unwrap();
        let text = render(&profile.model, true, Some(plan), 8);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].contains("for a queue of 8"), "{text}");
        assert!(
            lines[0].ends_with("(figures are estimates: no measured profile)"),
            "{text}"
        );
        assert!(lines[1].starts_with("PART  GROUPS"), "{text}");
        assert_eq!(lines.len(), 2 + plan.partitions.len(), "{text}");
        let weights = lines[1].find("WEIGHTS").unwrap();
        for (i, part) in plan.partitions.iter().enumerate() {
            let row = lines[2 + i];
            assert!(row.starts_with(&i.to_string()), "{text}");
            assert!(
                row[weights..].starts_with(&format_bytes(part.weight_bytes)),
                "{text}"
            );
        }
        assert_eq!(render("m", false, None, 1), "m: no plan\n");
    }
}
