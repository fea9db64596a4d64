//! Scale-up / scale-down decisions for one model from its reported load.
//!
//! One call to [`decide`] per model per autoscaler tick (INFaaS polls every second). The
//! function is pure: the caller passes the previous [`ModelScaleState`] and the clock
//! (`now_s`), applies the returned [`Action`] and keeps the returned state for the next tick.
//!
//! ## The rule
//!
//! With `n = replicas + partitioned` replicas (replicas still loading included, so a
//! scale-up is not repeated while its replicas load), each serving `μ` req/s,
//! capacity is `μ_total = n·μ`.
//!
//! * **Scale up** when `λ·headroom + ρ_H > μ_total` — Flashpoint eq. (4.12) case 1, with the
//!   INFaaS slack-threshold (§4.2.2, §5: 1.05) on the arrival rate. The target is the
//!   smallest `n*` with `n*·μ ≥ λ·headroom + ρ_H`, clamped to `[min, max]`.
//! * **Scale down** when `μ_total > λ + ρ_L` *and* the scale-down target is below `n` — the
//!   corrected Flashpoint eq. (4.12) case 3 (the thesis prints `λ − ρ_L > μ`, which is the
//!   overload side; the intended rule is surplus capacity). The condition must hold
//!   continuously for at least the model's load time (INFaaS §4.2.2: "`T_v` is set equal to
//!   the loading latency of variant `v`"), tracked in [`ModelScaleState::below_since_s`],
//!   and at least the load time must have passed since the last scale-up. The target is
//!   the `n*` of the *highest* λ seen during that window
//!   ([`ModelScaleState::window_peak_rate`]), so the count after a scale-down never
//!   triggers a scale-up at any load the window saw: no up/down alternation. Partitioned
//!   replicas are removed first (Flashpoint §4.2.6: they serve less because of the
//!   transfers between parts), and never below `min_replicas`.
//! * **Full replicas or a partitioned burst**: when a [`BurstOption`] is offered, both plans
//!   are priced with the INFaaS objective `Cost(δ) = C·(δ + w·T_load·max(δ, 0))` (INFaaS
//!   §4.2.1), instantiated here as `GPUs used + w·λ·T_cold`: the hardware (a partitioned
//!   replica occupies `partitions` GPUs) plus `w` times the requests that arrive while the
//!   new replicas cold-start. The cheaper plan wins; ties go to full replicas (no
//!   partitioning overhead, no model completion needed).
//!
//! Every [`Decision`] carries a reason with the numbers it was made from.

use serde::{Deserialize, Serialize};

/// Load reported for one model over the last reporting interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// Model the report is about.
    pub model: String,
    /// Arrival rate λ, requests per second.
    pub arrival_rate: f64,
    /// Requests waiting in the model's queue when the report was taken.
    pub queue_len: u32,
    /// Service rate μ of one (full) replica, requests per second (from the profile).
    pub service_rate_per_replica: f64,
    /// When the report was taken, seconds on the controller's clock.
    pub at_s: f64,
}

/// Tuning of the autoscaler. Every field says its default and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalerConfig {
    /// Multiplier on λ that capacity must cover (INFaaS slack-threshold). Default `1.05`:
    /// INFaaS §5 swept 1.01–1.1 and chose 1.05 — lower did not scale fast enough for load
    /// changes, higher scaled too eagerly.
    pub headroom: f64,
    /// ρ_H, req/s of extra capacity demanded before scaling up (Flashpoint eq. 4.12).
    /// Default `0.0`: the headroom factor already provides the margin, and a positive value
    /// would scale a model with no traffic up from zero.
    pub rho_high: f64,
    /// ρ_L, req/s of surplus capacity needed before a scale-down is considered
    /// (Flashpoint eq. 4.12). Default `0.0`: the scale-down target already keeps the
    /// headroom, so any surplus that frees a whole replica counts; raise it to keep spare
    /// capacity for spiky models.
    pub rho_low: f64,
    /// Fewest replicas (full + partitioned) to keep. Default `0`: serverless scale-to-zero.
    pub min_replicas: u32,
    /// Most replicas (full + partitioned). Default `64`: a guard against runaway scaling
    /// from a bogus report; set it per model from the cluster's GPU count.
    pub max_replicas: u32,
    /// `w`, GPUs that one request delayed by a cold start is worth (INFaaS λ, "query-load
    /// unpredictability", 1/s in the paper). Default `0.1`: ten requests caught behind a
    /// cold start cost as much as one extra GPU. Larger values favour the faster
    /// (partitioned) plan, smaller ones the cheaper (full) plan.
    pub load_penalty_weight: f64,
}

impl Default for ScalerConfig {
    fn default() -> Self {
        Self {
            headroom: 1.05,
            rho_high: 0.0,
            rho_low: 0.0,
            min_replicas: 0,
            max_replicas: 64,
            load_penalty_weight: 0.1,
        }
    }
}

/// What the autoscaler knows about one model between ticks.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ModelScaleState {
    /// Full replicas, including those still loading.
    pub replicas: u32,
    /// Partitioned burst replicas (Flashpoint §4.2), including those still loading. Model
    /// completion turns them into full replicas; the caller moves them across then.
    pub partitioned: u32,
    /// Measured cold-start time of a full replica, seconds. Also the scale-down delay.
    pub load_time_s: f64,
    /// When the last scale-up was decided.
    pub last_scale_up_s: Option<f64>,
    /// Since when the scale-down condition has held without interruption.
    pub below_since_s: Option<f64>,
    /// Highest λ seen since `below_since_s` (req/s): the scale-down target covers it, so a
    /// noisy load that dipped once is not scaled below what it needed a moment ago.
    pub window_peak_rate: Option<f64>,
}

impl ModelScaleState {
    fn clear_window(&mut self) {
        self.below_since_s = None;
        self.window_peak_rate = None;
    }
}

/// A partitioned burst plan the caller can offer as an alternative to full replicas.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BurstOption {
    /// GPUs (parts) per partitioned replica.
    pub partitions: u32,
    /// Cold-start time of one partitioned replica, seconds (parts load in parallel).
    pub cold_start_s: f64,
}

/// What to do with a model's replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// Keep the replica count.
    None,
    /// Start replicas.
    ScaleUp {
        /// Full replicas to start.
        full: u32,
        /// Partitioned replicas to start (each over [`BurstOption::partitions`] GPUs).
        partitioned: u32,
    },
    /// Stop replicas.
    ScaleDown {
        /// Partitioned replicas to stop (removed first).
        remove_partitioned: u32,
        /// Full replicas to stop.
        remove_full: u32,
    },
}

/// An [`Action`] with the reason it was taken.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// What to do.
    pub action: Action,
    /// Why, with the numbers (for logs and the operator).
    pub reason: String,
}

impl Decision {
    fn none(reason: String) -> Self {
        Self {
            action: Action::None,
            reason,
        }
    }
}

/// Decides what to do with one model's replicas; returns the decision and the state to
/// pass to the next call (the replica counts already updated by the action).
///
/// `burst`, when given, is a partitioned plan to weigh against full replicas on scale-up.
/// Invalid inputs (non-finite or negative rates, `μ ≤ 0`) give [`Action::None`] with a
/// reason; the function never panics.
pub fn decide(
    cfg: &ScalerConfig,
    state: &ModelScaleState,
    report: &LoadReport,
    now_s: f64,
    burst: Option<&BurstOption>,
) -> (Decision, ModelScaleState) {
    let mut next = state.clone();
    let lambda = report.arrival_rate;
    let mu = report.service_rate_per_replica;
    if !lambda.is_finite() || lambda < 0.0 || !mu.is_finite() || mu <= 0.0 {
        next.clear_window();
        let reason = format!(
            "{}: ignoring invalid report (λ = {lambda}, μ = {mu}); keeping {} full + {} partitioned",
            report.model, state.replicas, state.partitioned
        );
        return (Decision::none(reason), next);
    }

    let current = state.replicas.saturating_add(state.partitioned);
    let capacity = f64::from(current) * mu;
    let demand = lambda * cfg.headroom + cfg.rho_high;
    let needed = replicas_for(demand, mu);
    let (lo, hi) = (cfg.min_replicas, cfg.max_replicas.max(cfg.min_replicas));
    let target = needed.clamp(lo, hi);
    let numbers = format!(
        "λ = {lambda:.3} req/s, μ = {mu:.3} req/s per replica, capacity = {current} × μ = {capacity:.3} req/s, \
         λ·headroom + ρ_H = {demand:.3} req/s, queue = {}",
        report.queue_len
    );

    // Bounds first: below min or above max is corrected at once.
    if current < lo || (demand > capacity && current < hi) {
        next.clear_window();
        let add = target.max(lo) - current;
        let why = if current < lo {
            format!("below min_replicas = {lo}")
        } else if needed > hi {
            format!("λ·headroom + ρ_H > capacity; needs {needed}, capped at max_replicas = {hi}")
        } else {
            format!("λ·headroom + ρ_H > capacity; {needed} replicas cover it")
        };
        let (full, partitioned, plan) = choose_plan(cfg, state, lambda, add, burst);
        next.replicas = next.replicas.saturating_add(full);
        next.partitioned = next.partitioned.saturating_add(partitioned);
        next.last_scale_up_s = Some(now_s);
        let backlog =
            f64::from(report.queue_len) + (lambda - capacity).max(0.0) * state.load_time_s;
        let reason = format!(
            "{}: scale up {current} → {} ({why}; {numbers}; expected backlog E(x) = q + (λ − μ_total)·C(1) = {backlog:.1}); {plan}",
            report.model,
            current + add,
        );
        return (
            Decision {
                action: Action::ScaleUp { full, partitioned },
                reason,
            },
            next,
        );
    }
    if current > hi {
        next.clear_window();
        let (remove_partitioned, remove_full) = split_removal(state, current - hi);
        next.partitioned -= remove_partitioned;
        next.replicas -= remove_full;
        let reason = format!(
            "{}: scale down {current} → {hi} (above max_replicas = {hi}; {numbers}); \
             removing {remove_partitioned} partitioned first, then {remove_full} full",
            report.model
        );
        return (
            Decision {
                action: Action::ScaleDown {
                    remove_partitioned,
                    remove_full,
                },
                reason,
            },
            next,
        );
    }

    if demand > capacity {
        next.clear_window();
        let reason = format!(
            "{}: overloaded but at max_replicas = {hi} ({numbers}); needs {needed}",
            report.model
        );
        return (Decision::none(reason), next);
    }

    // Scale-down: the target must cover the highest λ seen while the surplus has held.
    let in_window = state.below_since_s.is_some_and(|t| t <= now_s);
    let peak = match state.window_peak_rate {
        Some(p) if in_window && p.is_finite() => p.max(lambda),
        _ => lambda,
    };
    let down_target = replicas_for(peak * cfg.headroom + cfg.rho_high, mu).clamp(lo, hi);
    let surplus = capacity > lambda + cfg.rho_low;
    if !(surplus && down_target < current) {
        next.clear_window();
        let reason = if surplus {
            format!(
                "{}: keep {current} (capacity covers λ·headroom + ρ_H and no replica can go; {numbers})",
                report.model
            )
        } else {
            format!(
                "{}: keep {current} (capacity {capacity:.3} ≤ λ + ρ_L = {:.3}; {numbers})",
                report.model,
                lambda + cfg.rho_low
            )
        };
        return (Decision::none(reason), next);
    }

    let delay = if state.load_time_s.is_finite() {
        state.load_time_s.max(0.0)
    } else {
        0.0
    };
    let since = if in_window {
        state.below_since_s.unwrap_or(now_s)
    } else {
        now_s
    };
    next.below_since_s = Some(since);
    next.window_peak_rate = Some(peak);
    let held = now_s - since;
    let since_up = state.last_scale_up_s.map(|t| now_s - t);
    let waiting_on_up = since_up.is_some_and(|s| s < delay);
    if held < delay || waiting_on_up {
        let reason = format!(
            "{}: keep {current}, scale-down to {down_target} pending (surplus held {held:.1} s of the \
             {delay:.1} s scale-down delay = load time{}; capacity {capacity:.3} > λ + ρ_L = {:.3}; \
             peak λ in window = {peak:.3}; {numbers})",
            report.model,
            since_up.map_or(String::new(), |s| format!(", last scale-up {s:.1} s ago")),
            lambda + cfg.rho_low
        );
        return (Decision::none(reason), next);
    }

    let (remove_partitioned, remove_full) = split_removal(state, current - down_target);
    next.partitioned -= remove_partitioned;
    next.replicas -= remove_full;
    next.clear_window();
    let reason = format!(
        "{}: scale down {current} → {down_target} (capacity {capacity:.3} > λ + ρ_L = {:.3} for {held:.1} s ≥ \
         delay {delay:.1} s = load time; {down_target} replicas cover the window's peak λ = {peak:.3} \
         with headroom{}; {numbers}); removing {remove_partitioned} partitioned first, then {remove_full} full",
        report.model,
        lambda + cfg.rho_low,
        if down_target == lo && needed < lo {
            format!(", held at min_replicas = {lo}")
        } else {
            String::new()
        },
    );
    (
        Decision {
            action: Action::ScaleDown {
                remove_partitioned,
                remove_full,
            },
            reason,
        },
        next,
    )
}

/// Smallest `n` with `n·μ ≥ demand` (exact against float rounding); `μ > 0`.
fn replicas_for(demand: f64, mu: f64) -> u32 {
    if demand <= 0.0 {
        return 0;
    }
    let guess = (demand / mu).ceil();
    if guess >= f64::from(u32::MAX) {
        return u32::MAX;
    }
    // `guess` is finite, non-negative and below u32::MAX here.
    let mut n = guess as u32;
    while f64::from(n) * mu < demand && n < u32::MAX {
        n += 1;
    }
    while n > 0 && f64::from(n - 1) * mu >= demand {
        n -= 1;
    }
    n
}

/// Splits `count` removals: partitioned replicas first (Flashpoint §4.2.6), then full.
fn split_removal(state: &ModelScaleState, count: u32) -> (u32, u32) {
    let partitioned = count.min(state.partitioned);
    let full = (count - partitioned).min(state.replicas);
    (partitioned, full)
}

/// Chooses full replicas or a partitioned burst for `add` new replicas; returns
/// `(full, partitioned, explanation)`.
fn choose_plan(
    cfg: &ScalerConfig,
    state: &ModelScaleState,
    lambda: f64,
    add: u32,
    burst: Option<&BurstOption>,
) -> (u32, u32, String) {
    let w = cfg.load_penalty_weight;
    let full_cost = f64::from(add) + w * lambda * state.load_time_s;
    let full_text = format!(
        "full replicas cost {add} GPUs + w·λ·T_load = {w} × {lambda:.3} × {:.3} s → {full_cost:.3}",
        state.load_time_s
    );
    let Some(b) = burst else {
        return (add, 0, format!("{full_text}; no burst plan offered"));
    };
    if b.partitions == 0 || !b.cold_start_s.is_finite() || b.cold_start_s < 0.0 {
        return (
            add,
            0,
            format!(
                "{full_text}; burst plan ignored (invalid: {} partitions, cold start {} s)",
                b.partitions, b.cold_start_s
            ),
        );
    }
    let gpus = f64::from(add) * f64::from(b.partitions);
    let burst_cost = gpus + w * lambda * b.cold_start_s;
    let burst_text = format!(
        "partitioned burst costs {add} × {} = {gpus} GPUs + w·λ·T_cold = {w} × {lambda:.3} × {:.3} s → {burst_cost:.3}",
        b.partitions, b.cold_start_s
    );
    if burst_cost < full_cost {
        (
            0,
            add,
            format!("chose partitioned burst: {burst_text} < {full_text}"),
        )
    } else {
        (
            add,
            0,
            format!("chose full replicas: {full_text} ≤ {burst_text}"),
        )
    }
}
