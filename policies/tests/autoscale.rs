//! Autoscaler: step, spike, slow decay without flapping, load-time-proportional delay,
//! burst choice, bounds.

use proptest::prelude::*;
use shardcast_policies::autoscale::{
    Action, BurstOption, Decision, LoadReport, ModelScaleState, ScalerConfig, decide,
};

const MU: f64 = 10.0;

fn report(lambda: f64, t: f64) -> LoadReport {
    LoadReport {
        model: "resnet".to_owned(),
        arrival_rate: lambda,
        queue_len: 0,
        service_rate_per_replica: MU,
        at_s: t,
    }
}

fn state(replicas: u32, load_time_s: f64) -> ModelScaleState {
    ModelScaleState {
        replicas,
        load_time_s,
        ..ModelScaleState::default()
    }
}

/// Runs one report per second over `[0, secs)`; returns the non-`None` decisions with their
/// times and the final state.
fn simulate(
    cfg: &ScalerConfig,
    mut st: ModelScaleState,
    secs: u32,
    lambda: impl Fn(f64) -> f64,
) -> (Vec<(f64, Decision)>, ModelScaleState) {
    let mut actions = Vec::new();
    for i in 0..secs {
        let t = f64::from(i);
        let (d, next) = decide(cfg, &st, &report(lambda(t), t), t, None);
        if d.action != Action::None {
            actions.push((t, d));
        }
        st = next;
    }
    (actions, st)
}

fn total(st: &ModelScaleState) -> u32 {
    st.replicas + st.partitioned
}

#[test]
fn step_load_scales_up_once_to_the_right_count() {
    let cfg = ScalerConfig::default();
    // 10 req/s → 2 replicas (10·1.05 = 10.5 > 10); step to 50 req/s → ⌈52.5 / 10⌉ = 6.
    let (actions, st) = simulate(&cfg, state(2, 20.0), 200, |t| {
        if t < 10.0 { 10.0 } else { 50.0 }
    });
    assert_eq!(actions.len(), 1, "{actions:#?}");
    let (t, d) = &actions[0];
    assert_eq!(*t, 10.0);
    assert_eq!(
        d.action,
        Action::ScaleUp {
            full: 4,
            partitioned: 0
        }
    );
    assert!(d.reason.contains("scale up 2 → 6"), "{}", d.reason);
    assert!(d.reason.contains("52.500"), "{}", d.reason);
    assert_eq!(total(&st), 6);
    assert_eq!(st.last_scale_up_s, Some(10.0));
}

#[test]
fn spike_scales_up_then_down_after_the_load_time() {
    let cfg = ScalerConfig::default();
    let (actions, st) = simulate(&cfg, state(2, 20.0), 120, |t| {
        if (10.0..30.0).contains(&t) {
            100.0
        } else {
            10.0
        }
    });
    assert_eq!(actions.len(), 2, "{actions:#?}");
    assert_eq!(actions[0].0, 10.0);
    assert_eq!(
        actions[0].1.action,
        Action::ScaleUp {
            full: 9,
            partitioned: 0
        }
    );
    // Surplus from t = 30; delay = load time = 20 s.
    assert_eq!(actions[1].0, 50.0);
    assert_eq!(
        actions[1].1.action,
        Action::ScaleDown {
            remove_partitioned: 0,
            remove_full: 9
        }
    );
    assert!(
        actions[1].1.reason.contains("delay 20.0 s"),
        "{}",
        actions[1].1.reason
    );
    assert_eq!(total(&st), 2);
}

#[test]
fn pending_scale_down_is_cancelled_when_load_returns() {
    let cfg = ScalerConfig::default();
    // Dips to 10 req/s for 10 s (shorter than the 20 s delay), then back to 100.
    let (actions, _) = simulate(&cfg, state(11, 20.0), 100, |t| {
        if (20.0..30.0).contains(&t) {
            10.0
        } else {
            100.0
        }
    });
    assert!(actions.is_empty(), "{actions:#?}");
}

fn check_no_flapping(actions: &[(f64, Decision)], delay: f64) {
    let mut last_down: Option<f64> = None;
    let mut seen_down = false;
    for (t, d) in actions {
        match d.action {
            Action::ScaleDown { .. } => {
                if let Some(prev) = last_down {
                    assert!(
                        t - prev >= delay,
                        "two scale-downs within one delay window: {prev} and {t}"
                    );
                }
                last_down = Some(*t);
                seen_down = true;
            }
            Action::ScaleUp { .. } => {
                assert!(
                    !seen_down,
                    "scale-up at {t} after a scale-down: {actions:#?}"
                )
            }
            Action::None => {}
        }
    }
}

#[test]
fn slow_decay_steps_down_without_flapping() {
    let cfg = ScalerConfig::default();
    let delay = 15.0;
    // 100 → 0 req/s over 600 s.
    let (actions, st) = simulate(&cfg, state(11, delay), 700, |t| (100.0 - t / 6.0).max(0.0));
    assert!(actions.len() >= 5, "{actions:#?}");
    check_no_flapping(&actions, delay);
    assert_eq!(total(&st), 0, "scale-to-zero once idle (min_replicas = 0)");
}

#[test]
fn noisy_slow_decay_does_not_flap() {
    let cfg = ScalerConfig::default();
    let delay = 15.0;
    // Decaying trend with ±8 req/s of noise (period ≈ 5 s, shorter than the delay).
    let (actions, _) = simulate(&cfg, state(12, delay), 700, |t| {
        (100.0 - t / 6.0 + 8.0 * (1.3 * t).sin()).max(0.0)
    });
    assert!(actions.len() >= 5, "{actions:#?}");
    check_no_flapping(&actions, delay);
}

/// Time of the first scale-down after a 100 → 10 req/s drop at t = 30.
fn scale_down_time(load_time_s: f64) -> f64 {
    let cfg = ScalerConfig::default();
    let (actions, _) = simulate(&cfg, state(11, load_time_s), 300, |t| {
        if t < 30.0 { 100.0 } else { 10.0 }
    });
    actions
        .iter()
        .find(|(_, d)| matches!(d.action, Action::ScaleDown { .. }))
        .map(|(t, _)| *t)
        .expect("scales down eventually")
}

#[test]
fn slow_loading_model_is_kept_longer() {
    let fast = scale_down_time(5.0);
    let slow = scale_down_time(60.0);
    assert_eq!(fast, 35.0);
    assert_eq!(slow, 90.0);
    assert!(slow - 30.0 == 12.0 * (fast - 30.0));
}

#[test]
fn scale_down_waits_for_the_load_time_after_a_scale_up() {
    let cfg = ScalerConfig::default();
    let mut st = state(11, 30.0);
    st.last_scale_up_s = Some(100.0);
    st.below_since_s = Some(90.0);
    st.window_peak_rate = Some(10.0);
    // Surplus has held 40 s, but the last scale-up was only 20 s ago.
    let (d, st2) = decide(&cfg, &st, &report(10.0, 120.0), 120.0, None);
    assert_eq!(d.action, Action::None, "{}", d.reason);
    let (d, _) = decide(&cfg, &st2, &report(10.0, 130.0), 130.0, None);
    assert_eq!(
        d.action,
        Action::ScaleDown {
            remove_partitioned: 0,
            remove_full: 9
        },
        "{}",
        d.reason
    );
}

#[test]
fn scale_down_removes_partitioned_replicas_first() {
    let cfg = ScalerConfig::default();
    let mut st = state(3, 10.0);
    st.partitioned = 4;
    // 20 req/s → ⌈21 / 10⌉ = 3 replicas; 4 to remove, all partitioned.
    let (actions, end) = simulate(&cfg, st, 30, |_| 20.0);
    assert_eq!(actions.len(), 1, "{actions:#?}");
    assert_eq!(actions[0].0, 10.0);
    assert_eq!(
        actions[0].1.action,
        Action::ScaleDown {
            remove_partitioned: 4,
            remove_full: 0
        }
    );
    assert_eq!((end.replicas, end.partitioned), (3, 0));

    let mut st = state(3, 0.0);
    st.partitioned = 2;
    // Zero load: remove both partitioned, then all 3 full.
    let (d, _) = decide(&cfg, &st, &report(0.0, 0.0), 0.0, None);
    assert_eq!(
        d.action,
        Action::ScaleDown {
            remove_partitioned: 2,
            remove_full: 3
        },
        "{}",
        d.reason
    );
}

#[test]
fn burst_chosen_when_its_penalised_cost_is_lower() {
    let cfg = ScalerConfig::default();
    let burst = BurstOption {
        partitions: 2,
        cold_start_s: 5.0,
    };
    // λ = 100, 2 replicas → need 11, add 9.
    // full: 9 + 0.1·100·30 = 309; burst: 18 + 0.1·100·5 = 68.
    let (d, st) = decide(
        &cfg,
        &state(2, 30.0),
        &report(100.0, 0.0),
        0.0,
        Some(&burst),
    );
    assert_eq!(
        d.action,
        Action::ScaleUp {
            full: 0,
            partitioned: 9
        },
        "{}",
        d.reason
    );
    assert!(d.reason.contains("chose partitioned burst"), "{}", d.reason);
    assert!(d.reason.contains("68.000"), "{}", d.reason);
    assert!(d.reason.contains("309.000"), "{}", d.reason);
    assert_eq!((st.replicas, st.partitioned), (2, 9));
}

#[test]
fn full_replicas_chosen_when_cheaper() {
    let cfg = ScalerConfig {
        load_penalty_weight: 0.01,
        ..ScalerConfig::default()
    };
    let burst = BurstOption {
        partitions: 4,
        cold_start_s: 20.0,
    };
    // λ = 20 → need 3. full: 3 + 0.01·20·30 = 9; burst: 12 + 0.01·20·20 = 16.
    let (d, _) = decide(&cfg, &state(0, 30.0), &report(20.0, 0.0), 0.0, Some(&burst));
    assert_eq!(
        d.action,
        Action::ScaleUp {
            full: 3,
            partitioned: 0
        },
        "{}",
        d.reason
    );
    assert!(d.reason.contains("chose full replicas"), "{}", d.reason);

    // A degenerate burst plan is ignored with a reason.
    let bad = BurstOption {
        partitions: 0,
        cold_start_s: 1.0,
    };
    let (d, _) = decide(&cfg, &state(0, 30.0), &report(20.0, 0.0), 0.0, Some(&bad));
    assert_eq!(
        d.action,
        Action::ScaleUp {
            full: 3,
            partitioned: 0
        }
    );
    assert!(d.reason.contains("ignored"), "{}", d.reason);
}

#[test]
fn max_bound_caps_scale_up() {
    let cfg = ScalerConfig {
        max_replicas: 5,
        ..ScalerConfig::default()
    };
    let (d, st) = decide(&cfg, &state(2, 10.0), &report(100.0, 0.0), 0.0, None);
    assert_eq!(
        d.action,
        Action::ScaleUp {
            full: 3,
            partitioned: 0
        }
    );
    assert!(
        d.reason.contains("capped at max_replicas = 5"),
        "{}",
        d.reason
    );
    let (d, _) = decide(&cfg, &st, &report(100.0, 1.0), 1.0, None);
    assert_eq!(d.action, Action::None);
    assert!(d.reason.contains("at max_replicas = 5"), "{}", d.reason);

    // Above max (config lowered): back down to max at once, partitioned first.
    let mut over = state(5, 10.0);
    over.partitioned = 2;
    let (d, _) = decide(&cfg, &over, &report(100.0, 0.0), 0.0, None);
    assert_eq!(
        d.action,
        Action::ScaleDown {
            remove_partitioned: 2,
            remove_full: 0
        }
    );
}

#[test]
fn min_bound_holds_under_no_load() {
    let cfg = ScalerConfig {
        min_replicas: 2,
        ..ScalerConfig::default()
    };
    // From zero: straight up to min.
    let (d, _) = decide(&cfg, &state(0, 10.0), &report(0.0, 0.0), 0.0, None);
    assert_eq!(
        d.action,
        Action::ScaleUp {
            full: 2,
            partitioned: 0
        }
    );
    assert!(d.reason.contains("below min_replicas = 2"), "{}", d.reason);
    // From 6 with no load: one scale-down, to 2, never below.
    let (actions, st) = simulate(&cfg, state(6, 10.0), 200, |_| 0.0);
    assert_eq!(actions.len(), 1, "{actions:#?}");
    assert_eq!(total(&st), 2);
    assert!(
        actions[0].1.reason.contains("held at min_replicas = 2"),
        "{}",
        actions[0].1.reason
    );
}

#[test]
fn no_load_and_no_replicas_stays_at_zero() {
    let cfg = ScalerConfig::default();
    let (actions, st) = simulate(&cfg, state(0, 10.0), 50, |_| 0.0);
    assert!(actions.is_empty());
    assert_eq!(total(&st), 0);
}

#[test]
fn invalid_report_is_ignored_with_a_reason() {
    let cfg = ScalerConfig::default();
    let mut r = report(f64::NAN, 0.0);
    let (d, _) = decide(&cfg, &state(3, 10.0), &r, 0.0, None);
    assert_eq!(d.action, Action::None);
    assert!(d.reason.contains("invalid report"), "{}", d.reason);
    r.arrival_rate = 5.0;
    r.service_rate_per_replica = 0.0;
    let (d, _) = decide(&cfg, &state(3, 10.0), &r, 0.0, None);
    assert_eq!(d.action, Action::None);
}

proptest! {
    /// Whatever the load: the count stays in [min, max]; a scale-up covers the demand
    /// unless capped; a scale-down never leaves the current load needing a scale-up.
    #[test]
    fn decisions_respect_bounds_and_cover_demand(
        lambda in 0.0f64..500.0,
        mu in 0.1f64..50.0,
        replicas in 0u32..40,
        partitioned in 0u32..10,
        min in 0u32..5,
        extra in 0u32..60,
        load in 0.0f64..60.0,
        held in 0.0f64..120.0,
    ) {
        let cfg = ScalerConfig { min_replicas: min, max_replicas: min + extra, ..ScalerConfig::default() };
        let st = ModelScaleState {
            replicas,
            partitioned,
            load_time_s: load,
            last_scale_up_s: None,
            below_since_s: Some(0.0),
            window_peak_rate: Some(lambda),
        };
        let r = LoadReport { model: "m".into(), arrival_rate: lambda, queue_len: 0,
                             service_rate_per_replica: mu, at_s: held };
        let (d, next) = decide(&cfg, &st, &r, held, None);
        let n = next.replicas + next.partitioned;
        let before = replicas + partitioned;
        let demand = lambda * cfg.headroom + cfg.rho_high;
        match d.action {
            Action::ScaleUp { full, partitioned: p } => {
                prop_assert_eq!(n, before + full + p);
                prop_assert!(n <= cfg.max_replicas);
                prop_assert!(f64::from(n) * mu >= demand || n == cfg.max_replicas || n == cfg.min_replicas);
            }
            Action::ScaleDown { remove_partitioned, remove_full } => {
                prop_assert!(remove_partitioned <= partitioned);
                prop_assert!(remove_full == 0 || remove_partitioned == partitioned);
                prop_assert_eq!(n, before - remove_partitioned - remove_full);
                prop_assert!(n >= cfg.min_replicas);
                prop_assert!(f64::from(n) * mu >= demand || n == cfg.max_replicas);
                // The next report at the same load does not scale up.
                let (again, _) = decide(&cfg, &next, &r, held + 1.0, None);
                prop_assert!(!matches!(again.action, Action::ScaleUp { .. }), "{}", again.reason);
            }
            Action::None => prop_assert_eq!(n, before),
        }
        prop_assert!(!d.reason.is_empty());
    }
}
