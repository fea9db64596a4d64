//! Tests of [`super`] and [`super::super::recovery`]: spec parsing, a small fault scenario
//! against hand-computed times and origin bytes, and the timeline's SVG.

use std::time::Duration;

use shardcast_placement::Tier;

use super::*;
use crate::sim::coldstart::ColdStart;
use crate::sim::dc::DcConfig;
use crate::sim::fault_plot;
use crate::sim::models::{Phases, SimModel};
use crate::sim::net::Topology;
use crate::sim::plots::well_formed;

/// Link rate, bytes/s.
const B: f64 = 1e8;
/// Model bytes.
const S: f64 = 1e9;
/// Chunk bytes.
const C: f64 = 1_048_576.0;

/// 4 hosts under one switch, 100 MB/s links, an origin no slower than a link, one shard
/// of 1 GB, 1 MiB chunks, one origin read at a time (hop `j` lags `j` chunks), tier
/// memory; heartbeats every 5 s (the inventory expires a host after 15 s, longer than the
/// 8 s link-down: the controller does not step in).
fn small() -> ColdStart {
    ColdStart {
        dc: DcConfig {
            topology: Topology {
                hosts: 4,
                hosts_per_leaf: 4,
                host_link_bps: B,
                leaf_uplink_bps: 1e12,
                origin_link_bps: None,
                origin_stream_bps: None,
            },
            gpus_per_host: 1,
            gpu_memory: 24 << 30,
            host_memory: 200 << 30,
            phases: Phases::flashpoint(),
            chunk_size: C as u32,
            hop_cap_bps: None,
            progress_period: Duration::from_secs(1),
            origin_parallel: 1,
        },
        model: SimModel {
            name: "fault-test",
            label: "fault test",
            params: "-",
            bytes: S as u64,
            layers: 1,
            shards: Some(vec![S as u64]),
        },
        replicas: 4,
        warm: 0,
        tier: Tier::Memory,
        heartbeat: Duration::from_secs(5),
        poll: Duration::from_millis(250),
        limit: Duration::from_secs(3600),
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6
}

#[test]
fn specs_parse_and_bad_ones_are_refused() {
    let f: Vec<FaultSpec> = parse_faults("link-down@middle:3s+8s, lost@h0042:500ms").unwrap();
    assert_eq!(
        f,
        [
            FaultSpec {
                kind: FaultKind::LinkDown,
                target: Target::Middle,
                at_s: 3.0,
                for_s: Some(8.0)
            },
            FaultSpec {
                kind: FaultKind::Lost,
                target: Target::Host("h0042".into()),
                at_s: 0.5,
                for_s: None
            }
        ]
    );
    assert_eq!(f[0].to_string(), "link-down@middle:3s+8s");
    assert_eq!(
        "kill@random:2".parse::<FaultSpec>().unwrap().kind,
        FaultKind::Lost
    );
    for bad in [
        "link-down@middle:3s",
        "lost@head:3s+1s",
        "melt@head:3s",
        "link-down@side:3s+1s",
        "link-down@head",
        "link-down@head:-1+2",
        "link-down@head:3+0",
        "link-down@hx:3+1",
        "",
    ] {
        assert!(bad.parse::<FaultSpec>().is_err(), "{bad:?} was accepted");
    }
}

#[test]
fn a_middle_hop_whose_link_goes_down_costs_its_downstream_the_stall_and_a_shared_link() {
    // Chain origin → a → b → v → d at B. At 3 s v's link goes down for 8 s (progress 3e8).
    // * a and b go on from the origin: done as without the fault, at S/B and S/B + C/B.
    // * 2 s later (transferd's stall timeout) d drops v, and b, whose downstream was silent
    //   as long, fails over to it: b → d carries the 7e8 + 3C that d lacks, at B.
    // * At 11 s v is back, and pulls its 7e8 + 2C from b, its nearest holder above
    //   (transferd's recovery sources), which shares b's uplink with d's feed: each at B/2.
    //   d has 1e8 + 3C left → done at 13 + 6C/B; then v alone at B: done at 19 + 5C/B.
    // * The origin read the head's 3e8 and then the upper flow's 7e8 + C (the flow's
    //   progress runs to the lower hop's lag): S + C, against S + 3C without the fault.
    let spec = small();
    let f = parse_faults("link-down@middle:3s+8s").unwrap();
    let r = run(&spec, Method::Chain, &f, 0).unwrap();
    let c = C / B;
    assert_eq!(r.affected.len(), 2, "{:#?}", r.affected);
    let victim = r.affected.iter().find(|a| a.role == Role::Victim).unwrap();
    let below = r.affected.iter().find(|a| a.role == Role::Below).unwrap();
    // Without the fault: hop j at (S + jC)/B; v is hop 2, d hop 3.
    assert!(
        close(victim.no_fault_ready_s.unwrap(), S / B + 2.0 * c),
        "{victim:?}"
    );
    assert!(
        close(below.no_fault_ready_s.unwrap(), S / B + 3.0 * c),
        "{below:?}"
    );
    assert!(close(below.ready_s.unwrap(), 13.0 + 6.0 * c), "{below:?}");
    assert!(close(victim.ready_s.unwrap(), 19.0 + 5.0 * c), "{victim:?}");
    assert!(close(r.no_fault.healthy_ready_s.unwrap(), S / B + 3.0 * c));
    assert!(close(
        r.with_faults.healthy_ready_s.unwrap(),
        13.0 + 6.0 * c
    ));
    assert!(close(
        r.healthy_ratio.unwrap(),
        (13.0 + 6.0 * c) / (10.0 + 3.0 * c)
    ));
    assert!(
        close(r.with_faults.origin_bytes, S + C),
        "{:?}",
        r.with_faults
    );
    assert!(
        close(r.no_fault.origin_bytes, S + 3.0 * C),
        "{:?}",
        r.no_fault
    );
    assert_eq!((r.with_faults.ready, r.no_fault.ready), (4, 4));
    // The events, in order, at their times.
    let seen: Vec<(EventKind, &str, f64)> = r
        .events
        .iter()
        .map(|e| (e.kind, e.host.as_str(), e.t))
        .collect();
    let (v, d) = (victim.host.as_str(), below.host.as_str());
    let want = [
        (EventKind::Fault, v, 3.0),
        (EventKind::Detected, d, 5.0),
        (EventKind::Failover, d, 5.0),
        (EventKind::RecoveryStart, d, 5.0),
        (EventKind::Heal, v, 11.0),
        (EventKind::RecoveryStart, v, 11.0),
        (EventKind::Complete, d, 13.0 + 6.0 * c),
        (EventKind::Complete, v, 19.0 + 5.0 * c),
    ];
    assert_eq!(seen.len(), want.len(), "{:#?}", r.events);
    for (s, w) in seen.iter().zip(&want) {
        assert!(
            s.0 == w.0 && s.1 == w.1 && close(s.2, w.2),
            "{s:?} vs {w:?}"
        );
    }
    // The victim pulled from the holder right above it.
    let pulled = r
        .events
        .iter()
        .find(|e| e.kind == EventKind::RecoveryStart && e.host == v)
        .unwrap();
    assert!(pulled.detail.contains("h0"), "{pulled:?}");
    assert!(!pulled.detail.contains("origin"), "{pulled:?}");
    // Phases: d receiving, stalled for the stall timeout, recovering, done.
    let phases: Vec<(Phase, f64, f64)> = below
        .phases
        .iter()
        .map(|s| (s.phase, s.from, s.to))
        .collect();
    assert_eq!(phases.len(), 4, "{phases:?}");
    assert_eq!(
        phases.iter().map(|p| p.0).collect::<Vec<_>>(),
        [
            Phase::Receiving,
            Phase::Stalled,
            Phase::Recovering,
            Phase::Done
        ]
    );
    assert!(
        close(phases[1].1, 3.0) && close(phases[1].2, 5.0),
        "{phases:?}"
    );
    let vp: Vec<Phase> = victim.phases.iter().map(|s| s.phase).collect();
    assert_eq!(
        vp,
        [
            Phase::Receiving,
            Phase::Down,
            Phase::Recovering,
            Phase::Done
        ]
    );
}

#[test]
fn a_head_that_reads_the_origin_is_replaced_by_the_hop_below_and_pulls_from_it_when_back() {
    // The head h of origin → h → x → y → z goes down at 3 s (progress 3e8) for 8 s. Its
    // only holder above is none: x finds every holder above it (h) stalled after the stall
    // timeout, so transferd's monitor fetches at once (no grace), from the origin, and x
    // heads the rest of the chain: x lacks 7e8 + C at 5 s, so by 11 s it lacks 1e8 + C.
    // At 11 s h is back and, as transferd's head does, pulls from the hop below (x) before
    // the origin: that pull and x's chain share x's uplink, B/2 each, so the chain ends
    // x at 13 + 2c, y and z two c apart after it (a chunk's lag at B/2). h got B/2 until
    // z was done (13 + 6c): 1e8 + 3C; the rest, 6e8 − 3C, at B: done at 19 + 3c.
    // Origin: 3e8 (the old flow) + the new chain's progress to z's lag (7e8 + 3C) = S + 3C;
    // h reads none of it again (it read 7e8 more, 1.7 S + 3C, when it resumed its own
    // origin read).
    let spec = small();
    let f = parse_faults("link-down@head:3+8").unwrap();
    let r = run(&spec, Method::Chain, &f, 0).unwrap();
    let c = C / B;
    let victim = r.affected.iter().find(|a| a.role == Role::Victim).unwrap();
    assert!(close(victim.no_fault_ready_s.unwrap(), S / B));
    assert!(close(victim.ready_s.unwrap(), 19.0 + 3.0 * c), "{victim:?}");
    let mut below: Vec<f64> = r
        .affected
        .iter()
        .filter(|a| a.role == Role::Below)
        .map(|a| a.ready_s.unwrap())
        .collect();
    below.sort_by(f64::total_cmp);
    assert_eq!(below.len(), 3);
    for (j, t) in below.iter().enumerate() {
        assert!(close(*t, 13.0 + 2.0 * (j + 1) as f64 * c), "hop {j}: {t}");
    }
    assert!(
        close(r.with_faults.origin_bytes, S + 3.0 * C),
        "{:?}",
        r.with_faults
    );
    assert!(
        r.events
            .iter()
            .any(|e| e.kind == EventKind::RecoveryStart && e.detail.contains("origin")),
        "{:#?}",
        r.events
    );
    assert!(!r.events.iter().any(|e| e.kind == EventKind::Failover));
    // The victim's recovery named the hop below, not the origin.
    let back = r
        .events
        .iter()
        .find(|e| e.kind == EventKind::RecoveryStart && e.host == victim.host)
        .unwrap();
    assert!(back.detail.contains("h0001"), "{back:?}");
    assert!(!back.detail.contains("origin"), "{back:?}");
}

#[test]
fn the_fault_timeline_draws_a_bar_per_phase_and_a_marker_per_fault() {
    let spec = small();
    let f = parse_faults("link-down@middle:3s+8s").unwrap();
    let r = run(&spec, Method::Chain, &f, 0).unwrap();
    let t = fault_plot::timeline("chain", &r);
    assert_eq!(t.file, "chain-fault-timeline.svg");
    assert_eq!(t.rows.len(), 2);
    let spans: usize = t.rows.iter().map(|r| r.spans.len()).sum();
    assert_eq!(spans, 8);
    assert_eq!(t.markers.len(), 2, "{:?}", t.markers);
    let svg = fault_plot::render(&t).unwrap();
    let sum = well_formed(&svg);
    // A bar per span, a box per phase in the legend, the backgrounds.
    assert!(sum.rects >= spans + Phase::ALL.len(), "{} rects", sum.rects);
    for p in Phase::ALL {
        assert!(
            sum.texts.iter().any(|x| x == p.name()),
            "no legend for {p:?}"
        );
    }
    for a in &r.affected {
        assert!(
            sum.texts.iter().any(|x| x.starts_with(&a.host)),
            "no row label for {}: {:?}",
            a.host,
            sum.texts
        );
    }
    assert!(sum.texts.iter().any(|x| x.ends_with(" hit")));
    assert!(sum.texts.iter().any(|x| x.ends_with(" back")));
}

#[test]
fn a_lost_middle_hop_never_finishes_and_the_hop_below_is_failed_over_to() {
    // As the link-down above, but v never comes back: d is failed over to at 5 s and gets
    // its 7e8 + 3C from b alone at B, ready at 12 + 3C/B; v is never ready, and the plan
    // ends partial once the controller's lost grace is over.
    let spec = small();
    let f = parse_faults("lost@middle:3s").unwrap();
    let r = run(&spec, Method::Chain, &f, 0).unwrap();
    let c = C / B;
    let victim = r.affected.iter().find(|a| a.role == Role::Victim).unwrap();
    let below = r.affected.iter().find(|a| a.role == Role::Below).unwrap();
    assert_eq!(victim.ready_s, None);
    assert!(close(below.ready_s.unwrap(), 12.0 + 3.0 * c), "{below:?}");
    assert_eq!(r.with_faults.ready, 3);
    assert_eq!(r.with_faults.plan_state, "partial");
    assert!(!r.events.iter().any(|e| e.kind == EventKind::Heal));
    assert_eq!(
        victim.phases.iter().map(|s| s.phase).collect::<Vec<_>>(),
        [Phase::Receiving, Phase::Down]
    );
}

#[test]
fn a_random_target_is_the_same_host_for_the_same_seed() {
    let spec = small();
    let f = parse_faults("link-down@random:2s+1s").unwrap();
    let pick = |seed| {
        let r = run(&spec, Method::Chain, &f, seed).unwrap();
        let v = r
            .events
            .iter()
            .find(|e| e.kind == EventKind::Fault)
            .unwrap();
        (v.host.clone(), r.with_faults.ready)
    };
    let (a, ready) = pick(7);
    assert_eq!(pick(7).0, a);
    // A link down for less than the stall timeout is never noticed: every host finishes.
    assert_eq!(ready, 4);
}
