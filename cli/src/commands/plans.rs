//! `shardcast plans`: every plan, newest first.

use shardcast_protocol::controller::{
    ListPlansRequest, ListPlansResponse, PlanKind, ReceiverState,
};

use crate::client::Client;
use crate::error::CliError;
use crate::output::Output;
use crate::table::table_or;

/// Lists the plans.
pub(crate) async fn run(c: &mut Client, out: Output) -> Result<ListPlansResponse, CliError> {
    let r = c.list_plans(ListPlansRequest {}).await?.into_inner();
    out.show(&r, render);
    Ok(r)
}

/// What `plans` prints: a row per plan (hosts done or local of those asked), or `no plans`.
pub(crate) fn render(r: &ListPlansResponse) -> String {
    let rows = r.plans.iter().map(|p| {
        let done = p
            .hosts
            .iter()
            .filter(|h| matches!(h.state(), ReceiverState::Done | ReceiverState::Local))
            .count();
        vec![
            p.plan_id.clone(),
            p.model.clone(),
            if p.kind() == PlanKind::Burst {
                format!("{} (burst)", p.tier().label())
            } else {
                p.tier().label().to_string()
            },
            p.state().label().to_string(),
            format!("{done}/{}", p.hosts.len()),
            format!("{:.1}s", p.elapsed_s),
            format!("{:.1}s", p.estimate_s),
        ]
    });
    table_or(
        &[
            "PLAN", "MODEL", "TIER", "STATE", "HOSTS", "ELAPSED", "ESTIMATE",
        ],
        rows,
        "no plans",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardcast_protocol::controller::{HostProgress, PlanState, PlanStatus, Tier};

    #[test]
    fn a_burst_and_a_prewarm() {
        let host = |state: ReceiverState| HostProgress {
            state: state as i32,
            ..Default::default()
        };
        let r = ListPlansResponse {
            plans: vec![
                PlanStatus {
                    plan_id: "p-2".into(),
                    model: "org/big-model".into(),
                    kind: PlanKind::Burst as i32,
                    tier: Tier::Gpu as i32,
                    state: PlanState::Running as i32,
                    hosts: vec![host(ReceiverState::Loading), host(ReceiverState::Done)],
                    elapsed_s: 1.5,
                    estimate_s: 2.5,
                    ..Default::default()
                },
                PlanStatus {
                    plan_id: "p-10".into(),
                    model: "org/m".into(),
                    tier: Tier::Memory as i32,
                    state: PlanState::Done as i32,
                    hosts: vec![host(ReceiverState::Local), host(ReceiverState::Done)],
                    elapsed_s: 12.0,
                    estimate_s: 10.0,
                    ..Default::default()
                },
            ],
        };
        assert_eq!(
            render(&r),
            "PLAN  MODEL          TIER         STATE    HOSTS  ELAPSED  ESTIMATE\n\
             p-2   org/big-model  gpu (burst)  running  1/2    1.5s     2.5s\n\
             p-10  org/m          memory       done     2/2    12.0s    10.0s\n"
        );
    }

    #[test]
    fn no_plans_says_so() {
        assert_eq!(render(&ListPlansResponse::default()), "no plans\n");
    }
}
