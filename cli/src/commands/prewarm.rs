//! `shardcast prewarm` (N replicas or the named hosts) and `shardcast scale-out` (N more,
//! or a partitioned burst): make the plan, print it, and follow it unless `--no-wait`.

use shardcast_protocol::controller::{
    PlanAccepted, PlanStatus, PrewarmRequest, ReceiverState, ScaleOutRequest,
};
use shardcast_protocol::units::format_bytes;

use super::watch::{self, host_state};
use super::{tier_arg, transport_arg};
use crate::args::{PrewarmArgs, ScaleOutArgs};
use crate::client::Client;
use crate::error::{CliError, usage};
use crate::output::{Output, print_json};
use crate::table::table;

/// Prewarms a model; the plan's final status once it ends (`None` with `--no-wait`).
pub(crate) async fn prewarm(
    args: PrewarmArgs,
    c: &mut Client,
    out: Output,
) -> Result<Option<PlanStatus>, CliError> {
    let PrewarmArgs {
        model,
        replicas,
        hosts,
        tier,
        sources,
        transport,
        no_wait,
    } = args;
    if replicas.is_none() && hosts.is_empty() {
        return Err(usage("give --replicas N or --hosts a,b"));
    }
    let a = c
        .prewarm(PrewarmRequest {
            model,
            replicas: replicas.unwrap_or(0),
            hosts,
            tier: tier_arg(&tier)?,
            sources,
            transport: transport_arg(&transport)?,
        })
        .await?
        .into_inner();
    follow(c, a, out, no_wait, None).await
}

/// Scales a model out; the plan's final status once it ends (`None` with `--no-wait`).
pub(crate) async fn scale_out(
    args: ScaleOutArgs,
    c: &mut Client,
    out: Output,
) -> Result<Option<PlanStatus>, CliError> {
    let ScaleOutArgs {
        model,
        replicas,
        tier,
        partitions,
        transport,
        no_wait,
    } = args;
    let a = c
        .scale_out(ScaleOutRequest {
            model,
            replicas,
            tier: tier_arg(&tier)?,
            partitions,
            transport: transport_arg(&transport)?,
        })
        .await?
        .into_inner();
    // A burst has no chains: the header says what it is, the host lines what each host
    // loads.
    let what = (partitions > 1).then(|| {
        format!(
            "burst of {replicas} replica(s) × {partitions} partitions, estimated cold start {:.2} s",
            a.estimate_s
        )
    });
    follow(c, a, out, no_wait, what).await
}

/// Prints an accepted plan (`what` replaces the estimate in its header line) and follows
/// it unless `no_wait`.
async fn follow(
    c: &mut Client,
    a: PlanAccepted,
    out: Output,
    no_wait: bool,
    what: Option<String>,
) -> Result<Option<PlanStatus>, CliError> {
    if out.json && no_wait {
        print_json(&a);
        return Ok(None);
    }
    if !out.json {
        print!("{}", render_accepted(&a, what.as_deref()));
        if no_wait {
            println!("follow it with: shardcast watch {}", a.plan_id);
            return Ok(None);
        }
    }
    watch::run(c, &a.plan_id, out).await.map(Some)
}

/// An accepted plan: its header line, its chains (if any), and a line per host that is
/// not merely pending.
pub(crate) fn render_accepted(a: &PlanAccepted, what: Option<&str>) -> String {
    let mut s = match what {
        Some(what) => format!("plan {} — {what}\n", a.plan_id),
        None => format!("plan {} — estimated {:.1} s\n", a.plan_id, a.estimate_s),
    };
    if !a.chains.is_empty() {
        let rows = a.chains.iter().map(|ch| {
            vec![
                format!("{} ({})", ch.source, ch.source_tier),
                ch.hops.join(" → "),
                if ch.shards.is_empty() {
                    "all".into()
                } else {
                    format!("{:?}", ch.shards)
                },
                format_bytes(ch.bytes),
                format!("{:.1}s", ch.estimate_s),
            ]
        });
        s.push_str(&table(
            &["SOURCE", "CHAIN", "SHARDS", "BYTES", "ESTIMATE"],
            rows,
        ));
    }
    for h in a
        .hosts
        .iter()
        .filter(|h| h.state() != ReceiverState::Pending)
    {
        let note = if h.error.is_empty() {
            &h.source
        } else {
            &h.error
        };
        s.push_str(&format!("{}: {} ({note})\n", h.host, host_state(h)));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardcast_protocol::controller::{HostProgress, PlannedChain};

    #[test]
    fn a_plan_with_two_chains_and_a_local_host() {
        let a = PlanAccepted {
            plan_id: "p-7".into(),
            estimate_s: 3.5,
            chains: vec![
                PlannedChain {
                    source: "origin".into(),
                    source_tier: "origin".into(),
                    hops: vec!["h1".into(), "h2".into(), "h3".into()],
                    bytes: 1 << 20,
                    estimate_s: 1.5,
                    ..Default::default()
                },
                PlannedChain {
                    source: "host-10".into(),
                    source_tier: "memory".into(),
                    hops: vec!["h4".into()],
                    shards: vec![0, 2],
                    bytes: 2 << 20,
                    estimate_s: 0.3,
                },
            ],
            hosts: vec![
                HostProgress {
                    host: "h1".into(),
                    state: ReceiverState::Pending as i32,
                    ..Default::default()
                },
                HostProgress {
                    host: "h5".into(),
                    state: ReceiverState::Local as i32,
                    source: "memory".into(),
                    ..Default::default()
                },
            ],
        };
        let text = render_accepted(&a, None);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "plan p-7 — estimated 3.5 s", "{text}");
        let col = |h: &str| lines[1].find(h).unwrap();
        // The cell starting at character column `at` of a line (cells hold "→").
        let cell = |line: &str, at: usize| -> String {
            let rest: String = line.chars().skip(at).collect();
            rest.split("  ").next().unwrap_or("").to_string()
        };
        let (chain, shards, bytes) = (col("CHAIN"), col("SHARDS"), col("BYTES"));
        assert_eq!(lines[1].find("SOURCE"), Some(0), "{text}");
        // "host-10 (memory)" is the widest SOURCE cell: CHAIN starts two spaces after it.
        assert_eq!(chain, "host-10 (memory)".len() + 2, "{text}");
        assert_eq!(cell(lines[2], 0), "origin (origin)", "{text}");
        assert_eq!(cell(lines[2], chain), "h1 → h2 → h3", "{text}");
        assert_eq!(cell(lines[2], shards), "all", "{text}");
        assert_eq!(cell(lines[2], bytes), format_bytes(1 << 20), "{text}");
        assert_eq!(cell(lines[3], 0), "host-10 (memory)", "{text}");
        assert_eq!(cell(lines[3], chain), "h4", "{text}");
        assert_eq!(cell(lines[3], shards), "[0, 2]", "{text}");
        assert_eq!(cell(lines[3], bytes), format_bytes(2 << 20), "{text}");
        assert!(lines[3].ends_with("0.3s"), "{text}");
        // The pending host is left out; the local one is named with its source.
        assert_eq!(lines[4], "h5: local (memory)", "{text}");
        assert_eq!(lines.len(), 5, "{text}");
    }

    #[test]
    fn a_burst_has_no_chain_table() {
        let a = PlanAccepted {
            plan_id: "p-8".into(),
            ..Default::default()
        };
        assert_eq!(
            render_accepted(&a, Some("burst of 1 replica(s) × 4 partitions")),
            "plan p-8 — burst of 1 replica(s) × 4 partitions\n"
        );
    }
}
