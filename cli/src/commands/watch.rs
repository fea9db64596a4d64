//! `shardcast watch PLAN`, and the following of a plan that `prewarm` and `scale-out` do:
//! progress bars on a terminal, one line per change otherwise, then a table of the hosts
//! (or with `--json`, the final status); the exit status says how the plan ended.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::Duration;

use futures::StreamExt;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use shardcast_protocol::controller::{
    GpuState, HostProgress, PlanKind, PlanState, PlanStatus, ReceiverState, WatchPlanRequest,
};
use shardcast_protocol::units::format_bytes;

use crate::client::Client;
use crate::error::{CliError, EXIT_PARTIAL};
use crate::output::Output;
use crate::table::table_or;

/// Follows a plan until it ends: progress bars on a terminal, one line per change
/// otherwise, then the final status (a table, or JSON).
pub(crate) async fn run(c: &mut Client, plan: &str, out: Output) -> Result<PlanStatus, CliError> {
    let json = out.json;
    let mut stream = c
        .watch_plan(WatchPlanRequest {
            plan_id: plan.to_string(),
        })
        .await?
        .into_inner();
    let tty = std::io::stderr().is_terminal() && !json;
    let multi = MultiProgress::new();
    let style =
        ProgressStyle::with_template("{prefix:>12} [{bar:30}] {bytes:>10}/{total_bytes:<10} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
    let mut bars: BTreeMap<String, ProgressBar> = BTreeMap::new();
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut last: Option<PlanStatus> = None;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(3600), stream.next()).await;
        let item = match next {
            Err(_) => break,
            Ok(None) => break,
            Ok(Some(item)) => item?,
        };
        for h in &item.hosts {
            if tty {
                let bar = bars.entry(h.host.clone()).or_insert_with(|| {
                    let b = multi.add(ProgressBar::new(h.total));
                    b.set_style(style.clone());
                    b.set_prefix(h.host.clone());
                    b
                });
                bar.set_length(h.total);
                bar.set_position(h.bytes);
                let msg = if h.error.is_empty() {
                    format!("{} from {}", host_state(h), h.source)
                } else {
                    format!("{} ({})", host_state(h), h.error)
                };
                bar.set_message(msg);
                if !is_running_state(h.state()) && !bar.is_finished() {
                    bar.finish();
                }
            } else if !json {
                let key = format!("{}:{}", host_state(h), h.error);
                if seen.get(&h.host) != Some(&key) {
                    println!("{}", change_line(item.elapsed_s, h));
                    seen.insert(h.host.clone(), key);
                }
            }
        }
        last = Some(item);
    }
    // The stream ends with the final state; ask once more in case it was cut short.
    let last = match last {
        Some(l) if l.state() != PlanState::Running => l,
        _ => c
            .get_plan(WatchPlanRequest {
                plan_id: plan.to_string(),
            })
            .await?
            .into_inner(),
    };
    for b in bars.values() {
        if !b.is_finished() {
            b.finish();
        }
    }
    out.show(&last, render_final);
    Ok(last)
}

/// One host's change of state, when not on a terminal:
/// `     1.2s host-1 receiving 4 MiB/16 MiB from origin`.
fn change_line(elapsed_s: f64, h: &HostProgress) -> String {
    format!(
        "{:>8.1}s {} {} {}/{} from {}{}",
        elapsed_s,
        h.host,
        host_state(h),
        format_bytes(h.bytes),
        format_bytes(h.total),
        h.source,
        if h.error.is_empty() {
            String::new()
        } else {
            format!(" ({})", h.error)
        }
    )
}

/// How a plan ended: a row per host, then a line with its state and times.
pub(crate) fn render_final(last: &PlanStatus) -> String {
    let rows = last.hosts.iter().map(|h| {
        let gpu = if h.gpus == 0 {
            "-".to_string()
        } else if h.gpu_state() == GpuState::Unspecified {
            format!("{} slots", h.gpus)
        } else {
            format!(
                "{} × {} ({})",
                h.gpus,
                h.gpu_state,
                format_bytes(h.gpu_bytes)
            )
        };
        vec![
            h.host.clone(),
            host_state(h),
            h.source.clone(),
            format_bytes(h.bytes),
            gpu,
            h.error.clone(),
        ]
    });
    let mut s = table_or(
        &["HOST", "STATE", "SOURCE", "BYTES", "GPUS", "NOTE"],
        rows,
        "no hosts",
    );
    let live = if last.kind() == PlanKind::Burst && last.live_s > 0.0 {
        format!("; every partition live at {:.2} s", last.live_s)
    } else {
        String::new()
    };
    s.push_str(&format!(
        "plan {} {} in {:.2} s (estimate {:.2} s{live}){}\n",
        last.plan_id,
        last.state,
        last.elapsed_s,
        last.estimate_s,
        if last.message.is_empty() {
            String::new()
        } else {
            format!(": {}", last.message)
        }
    ));
    s
}

/// How a followed plan ended, as the exit status: `failed` 6, `partial`
/// ([`EXIT_PARTIAL`]) naming each host short of a verified copy with its state and error.
pub(crate) fn plan_result(p: &PlanStatus) -> Result<(), CliError> {
    match p.state().label() {
        "failed" => Err(CliError {
            exit: 6,
            message: format!("plan {} failed: {}", p.plan_id, p.message),
        }),
        "partial" => {
            let short: Vec<String> = p
                .hosts
                .iter()
                .filter(|h| !matches!(h.state().label(), "done" | "local"))
                .map(|h| {
                    if h.error.is_empty() {
                        format!("{} ({})", h.host, h.state().label())
                    } else {
                        format!("{} ({}: {})", h.host, h.state().label(), h.error)
                    }
                })
                .collect();
            Err(CliError {
                exit: EXIT_PARTIAL,
                message: format!(
                    "plan {} ended partial: {} of {} hosts without a verified copy: {}",
                    p.plan_id,
                    short.len(),
                    p.hosts.len(),
                    short.join("; ")
                ),
            })
        }
        _ => Ok(()),
    }
}

/// A host's state in a plan; for a burst with its partition and GPU state, e.g.
/// `loading [1.2/4 partition-live at 1.08 s]`.
pub(crate) fn host_state(h: &HostProgress) -> String {
    if h.partition.is_empty() {
        return h.state().label().to_string();
    }
    let mut s = format!("{} [{}", h.state().label(), h.partition);
    if h.gpu_state() != GpuState::Unspecified {
        s.push(' ');
        s.push_str(h.gpu_state().label());
    }
    if h.live_s > 0.0 {
        s.push_str(&format!(", live at {:.2} s", h.live_s));
    }
    s.push(']');
    s
}

fn is_running_state(s: ReceiverState) -> bool {
    matches!(
        s,
        ReceiverState::Pending
            | ReceiverState::Receiving
            | ReceiverState::Joined
            | ReceiverState::Loading
    )
}
