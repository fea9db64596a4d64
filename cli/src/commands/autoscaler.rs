//! The autoscaler: `shardcast report-load` (a model's load, as a FaaS reports it) and
//! `shardcast events` (its decisions with their reasons, newest first).

use shardcast_protocol::controller::{
    Event, ListEventsRequest, ListEventsResponse, ReportLoadRequest,
};

use super::tier_arg;
use crate::args::{EventsArgs, ReportLoadArgs};
use crate::client::Client;
use crate::error::CliError;
use crate::output::Output;
use crate::table::table_or;

/// Reports a model's load; the autoscaler's decision on it.
pub(crate) async fn report_load(
    args: ReportLoadArgs,
    c: &mut Client,
    out: Output,
) -> Result<Event, CliError> {
    let ReportLoadArgs {
        model,
        arrival_rate,
        service_rate,
        queue,
        tier,
    } = args;
    let r = c
        .report_load(ReportLoadRequest {
            model,
            arrival_rate,
            queue_len: queue,
            service_rate,
            tier: tier_arg(&tier)?,
        })
        .await?
        .into_inner();
    let d = r.decision.unwrap_or_default();
    out.show(&d, render_decision);
    Ok(d)
}

/// Lists the autoscaler's decisions.
pub(crate) async fn events(
    args: EventsArgs,
    c: &mut Client,
    out: Output,
) -> Result<ListEventsResponse, CliError> {
    let r = c
        .list_events(ListEventsRequest {
            model: args.model.unwrap_or_default(),
            limit: args.limit,
        })
        .await?
        .into_inner();
    out.show(&r, render_events);
    Ok(r)
}

/// One decision: `org/m: scale-out (+2) — arrival 30/s over …`.
pub(crate) fn render_decision(d: &Event) -> String {
    format!("{}: {} ({:+}) — {}\n", d.model, d.kind, d.delta, d.reason)
}

/// What `events` prints: a row per decision, or `no events`.
pub(crate) fn render_events(r: &ListEventsResponse) -> String {
    let rows = r.events.iter().map(|e| {
        vec![
            format!("{:.1}", e.at),
            e.model.clone(),
            e.kind.clone(),
            format!("{:+}", e.delta),
            e.reason.clone(),
        ]
    });
    table_or(
        &["AT", "MODEL", "KIND", "DELTA", "REASON"],
        rows,
        "no events",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_with_signed_deltas() {
        let e = |at: f64, kind: &str, delta: i32, reason: &str| Event {
            at,
            model: "org/m".into(),
            kind: kind.into(),
            delta,
            reason: reason.into(),
            ..Default::default()
        };
        let r = ListEventsResponse {
            events: vec![
                e(1700000000.4, "scale-out", 2, "queue 40 over 2 replicas"),
                e(1700000001.0, "scale-in", -1, "idle"),
            ],
        };
        assert_eq!(
            render_events(&r),
            "AT            MODEL  KIND       DELTA  REASON\n\
             1700000000.4  org/m  scale-out  +2     queue 40 over 2 replicas\n\
             1700000001.0  org/m  scale-in   -1     idle\n"
        );
        assert_eq!(render_events(&ListEventsResponse::default()), "no events\n");
        assert_eq!(
            render_decision(&r.events[1]),
            "org/m: scale-in (-1) — idle\n"
        );
    }
}
