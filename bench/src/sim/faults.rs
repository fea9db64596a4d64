//! `simulate --faults`: faults injected into a simulated cold-start burst, what they cost
//! against the same burst without them, and a timeline of each affected host.
//!
//! The faults happen in [`super::recovery`], which decides the recoveries with
//! transferd's own state machine; this module parses the specs, runs the burst twice (with
//! and without the faults, [`run`]) and builds the report ([`FaultReport`]): per affected
//! host its ready time against the no-fault run, the bytes read from the origin (× the
//! model), the events with their virtual times, and each affected host's phases
//! (receiving, down, stalled, recovering, done) that [`super::fault_plot`] draws.
//!
//! Spec syntax (comma-separated, times in seconds after the prewarm, humantime accepted):
//!
//! ```text
//!  KIND@WHERE:AT[+FOR]
//!  KIND  = link-down   the host's link is down for FOR, then back (a hop stalls)
//!        | lost        the host is killed and never comes back (alias: kill)
//!  WHERE = head | middle | tail   that position of the burst's first chain
//!        | random                 a host of a flow in progress (seeded by --fault-seed)
//!        | h0042                  a host by id
//!  e.g.  link-down@middle:3s+8s   lost@head:5s   link-down@random:10s+8s,lost@tail:12s
//! ```

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::coldstart::{self, ColdStart, ColdStartRow, Method};

/// What happens to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// Its link is down for a while, then back (a hop stalls).
    LinkDown,
    /// Killed; it never comes back.
    Lost,
}

/// Which host.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    /// The first chain's head (the host that reads the origin, or the holder that sends).
    Head,
    /// The first chain's host in the middle (index `len / 2`, as `faults --emulate`).
    Middle,
    /// The first chain's last hop.
    Tail,
    /// A host of a flow in progress, picked with the seed.
    Random,
    /// A host by id.
    Host(String),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Head => f.write_str("head"),
            Self::Middle => f.write_str("middle"),
            Self::Tail => f.write_str("tail"),
            Self::Random => f.write_str("random"),
            Self::Host(h) => f.write_str(h),
        }
    }
}

/// One fault to inject.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FaultSpec {
    /// What happens.
    pub kind: FaultKind,
    /// To which host.
    pub target: Target,
    /// When, seconds after the prewarm.
    pub at_s: f64,
    /// For how long (a link down), seconds.
    pub for_s: Option<f64>,
}

impl fmt::Display for FaultSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            FaultKind::LinkDown => "link-down",
            FaultKind::Lost => "lost",
        };
        write!(f, "{kind}@{}:{}s", self.target, self.at_s)?;
        if let Some(d) = self.for_s {
            write!(f, "+{d}s")?;
        }
        Ok(())
    }
}

/// Why a fault spec was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fault {spec:?}: {why} (expected KIND@WHERE:AT[+FOR], e.g. link-down@middle:3s+8s)")]
pub struct FaultSpecError {
    /// The spec as given.
    pub spec: String,
    /// What is wrong with it.
    pub why: String,
}

fn seconds(s: &str) -> Option<f64> {
    let s = s.trim();
    if let Ok(x) = s.parse::<f64>() {
        return (x.is_finite() && x >= 0.0).then_some(x);
    }
    humantime::parse_duration(s)
        .ok()
        .map(|d: Duration| d.as_secs_f64())
}

impl FromStr for FaultSpec {
    type Err = FaultSpecError;
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let err = |why: &str| FaultSpecError {
            spec: spec.to_string(),
            why: why.to_string(),
        };
        let (kind, rest) = spec.trim().split_once('@').ok_or_else(|| err("no `@`"))?;
        let kind = match kind {
            "link-down" => FaultKind::LinkDown,
            "lost" | "kill" => FaultKind::Lost,
            _ => return Err(err("the kind is link-down or lost")),
        };
        let (target, when) = rest.split_once(':').ok_or_else(|| err("no `:AT`"))?;
        let target = match target {
            "head" => Target::Head,
            "middle" => Target::Middle,
            "tail" => Target::Tail,
            "random" => Target::Random,
            h if h.len() > 1
                && h.starts_with('h')
                && h[1..].bytes().all(|b| b.is_ascii_digit()) =>
            {
                Target::Host(h.to_string())
            }
            _ => {
                return Err(err(
                    "WHERE is head, middle, tail, random or a host id (h0042)",
                ));
            }
        };
        let (at, dur) = match when.split_once('+') {
            Some((a, d)) => (a, Some(d)),
            None => (when, None),
        };
        let at_s = seconds(at).ok_or_else(|| err("AT is not a time"))?;
        let for_s = match dur {
            Some(d) => Some(
                seconds(d)
                    .filter(|x| *x > 0.0)
                    .ok_or_else(|| err("FOR is not a positive time"))?,
            ),
            None => None,
        };
        match (kind, for_s) {
            (FaultKind::LinkDown, None) => Err(err("a link-down needs +FOR")),
            (FaultKind::Lost, Some(_)) => Err(err("a lost host does not come back: no +FOR")),
            _ => Ok(Self {
                kind,
                target,
                at_s,
                for_s,
            }),
        }
    }
}

/// Parses a comma-separated list of specs.
pub fn parse_faults(list: &str) -> Result<Vec<FaultSpec>, FaultSpecError> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(str::parse)
        .collect()
}

/// What a host is to a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// The host the fault hit.
    Victim,
    /// A hop below the victim in its chain (cut off from its upstream).
    Below,
}

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EventKind {
    /// The fault hit the host.
    Fault,
    /// No host to hit (the position named no chain in flight).
    Skipped,
    /// The victim's link is back.
    Heal,
    /// The hop below the victim dropped its silent upstream (the stall timeout).
    Detected,
    /// The hop above the victim failed over to this one.
    Failover,
    /// The upstream grace ended without a failover.
    GraceOver,
    /// Bytes flow to the host again: a recovery's source was chosen (or the controller
    /// re-planned it).
    RecoveryStart,
    /// No source to recover from.
    NoSource,
    /// The host's copy is complete.
    Complete,
}

/// One event of a fault, seconds after the prewarm.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FaultEvent {
    /// Seconds after the prewarm.
    pub t: f64,
    /// Index of the fault in the schedule.
    pub fault: usize,
    /// The host it happened to.
    pub host: String,
    /// What happened.
    pub kind: EventKind,
    /// In words (the source chosen, the timeouts).
    pub detail: String,
}

/// A phase of a host in a fault's timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Bytes arrive.
    Receiving,
    /// The host itself is down (its link, or lost).
    Down,
    /// Up, but nothing feeds it (it waits for the stall timeout, the grace, or a re-plan).
    Stalled,
    /// Fed again, by a failover or a recovery's source.
    Recovering,
    /// Its copy is complete.
    Done,
}

impl Phase {
    /// Every phase, in drawing order.
    pub const ALL: [Self; 5] = [
        Self::Receiving,
        Self::Down,
        Self::Stalled,
        Self::Recovering,
        Self::Done,
    ];

    /// Its name in the plots' legend.
    pub fn name(self) -> &'static str {
        match self {
            Self::Receiving => "receiving",
            Self::Down => "down",
            Self::Stalled => "stalled",
            Self::Recovering => "recovering",
            Self::Done => "done",
        }
    }
}

/// One phase of a host, seconds after the prewarm.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Span {
    /// Start.
    pub from: f64,
    /// End.
    pub to: f64,
    /// What the host was doing.
    pub phase: Phase,
}

/// A host a fault touched, with and without the faults.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AffectedHost {
    /// Host id.
    pub host: String,
    /// The fault (index in the schedule).
    pub fault: usize,
    /// Victim or a hop below it.
    pub role: Role,
    /// Ready (the prewarm's tier) with the faults, seconds after the prewarm.
    pub ready_s: Option<f64>,
    /// Ready in the run without faults.
    pub no_fault_ready_s: Option<f64>,
    /// `ready_s / no_fault_ready_s`.
    pub ratio: Option<f64>,
    /// Its phases over the run.
    pub phases: Vec<Span>,
}

/// One run's totals.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RunSummary {
    /// Hosts ready.
    pub ready: usize,
    /// The slowest host that no fault hit, seconds after the prewarm (`faults --emulate`'s
    /// ready time: every healthy host holds the model).
    pub healthy_ready_s: Option<f64>,
    /// Mean ready time of every ready host.
    pub avg_ready_s: f64,
    /// Bytes read from the origin.
    pub origin_bytes: f64,
    /// The same, × the model's bytes.
    pub origin_x_model: f64,
    /// The plan's end state.
    pub plan_state: String,
    /// Virtual seconds, prewarm → plan end.
    pub virtual_s: f64,
}

/// `simulate --faults`' report for one method.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FaultReport {
    /// The faults, as specs.
    pub faults: Vec<String>,
    /// The seed of `random` targets.
    pub seed: u64,
    /// The method.
    pub method: Method,
    /// The model.
    pub model: String,
    /// Its bytes.
    pub model_bytes: u64,
    /// Hosts in the burst.
    pub hosts: usize,
    /// The burst without faults.
    pub no_fault: RunSummary,
    /// With them.
    pub with_faults: RunSummary,
    /// `with_faults.healthy_ready_s / no_fault.healthy_ready_s` (the healthy hosts are
    /// those no fault hit: the victims are left out of both).
    pub healthy_ratio: Option<f64>,
    /// Every host a fault touched.
    pub affected: Vec<AffectedHost>,
    /// What happened, in time order.
    pub events: Vec<FaultEvent>,
    /// Wall-clock seconds of both runs.
    pub wall_s: f64,
}

/// Runs `spec` with `method` without faults, then with `faults` (`seed` picks random
/// targets), each on its own paused runtime; call it from a thread that is not running a
/// runtime.
pub fn run(
    spec: &ColdStart,
    method: Method,
    faults: &[FaultSpec],
    seed: u64,
) -> anyhow::Result<FaultReport> {
    let wall = Instant::now();
    let clean = coldstart::run(spec, method).context("the burst without faults")?;
    let (faulty, (events, affected)) =
        coldstart::run_with_faults(spec, method, faults, seed).context("the burst with faults")?;
    let victims: Vec<&str> = affected
        .iter()
        .filter(|a| a.2 == Role::Victim)
        .map(|a| a.0.as_str())
        .collect();
    let model_bytes = spec.model.bytes;
    let summary = |row: &ColdStartRow| {
        let healthy = row
            .hosts
            .iter()
            .filter(|h| !victims.contains(&h.host.as_str()))
            .map(|h| h.ready_s);
        // A healthy host that never became ready leaves no healthy ready time.
        let healthy_ready_s = healthy
            .clone()
            .try_fold(0.0f64, |m, r| r.map(|r| m.max(r)))
            .filter(|_| healthy.count() > 0);
        RunSummary {
            ready: row.ready,
            healthy_ready_s,
            avg_ready_s: row.avg_cold_start_s,
            origin_bytes: row.bytes_from_origin,
            origin_x_model: row.bytes_from_origin / model_bytes.max(1) as f64,
            plan_state: row.plan_state.clone(),
            virtual_s: row.virtual_s,
        }
    };
    let (no_fault, with_faults) = (summary(&clean), summary(&faulty));
    let ready_in = |row: &ColdStartRow, host: &str| {
        row.hosts
            .iter()
            .find(|h| h.host == host)
            .and_then(|h| h.ready_s)
    };
    let end = faulty.virtual_s;
    let affected = affected
        .into_iter()
        .map(|(host, fault, role)| {
            let ready_s = ready_in(&faulty, &host);
            let no_fault_ready_s = ready_in(&clean, &host);
            AffectedHost {
                phases: phases(&events, &host, role, end),
                ratio: ready_s.zip(no_fault_ready_s).map(|(a, b)| a / b),
                host,
                fault,
                role,
                ready_s,
                no_fault_ready_s,
            }
        })
        .collect();
    Ok(FaultReport {
        faults: faults.iter().map(ToString::to_string).collect(),
        seed,
        method,
        model: spec.model.name.to_string(),
        model_bytes,
        hosts: spec.dc.topology.hosts,
        healthy_ratio: with_faults
            .healthy_ready_s
            .zip(no_fault.healthy_ready_s)
            .map(|(a, b)| a / b),
        no_fault,
        with_faults,
        affected,
        events,
        wall_s: wall.elapsed().as_secs_f64(),
    })
}

/// A host's phases from its events: receiving from the prewarm until its fault (its own,
/// or its upstream's), then down (a victim, until its link is back) or stalled, recovering
/// from the first time bytes flow to it again, done once its copy is complete; the last
/// phase lasts until `end`.
pub fn phases(events: &[FaultEvent], host: &str, role: Role, end: f64) -> Vec<Span> {
    let mine: Vec<&FaultEvent> = events.iter().filter(|e| e.host == host).collect();
    let first = |k: EventKind| mine.iter().find(|e| e.kind == k).map(|e| e.t);
    // A hop below is cut off when its upstream is hit: the first victim's fault of its
    // fault index.
    let fault_idx = mine.first().map(|e| e.fault);
    let hit = match role {
        Role::Victim => first(EventKind::Fault),
        Role::Below => events
            .iter()
            .find(|e| Some(e.fault) == fault_idx && e.kind == EventKind::Fault)
            .map(|e| e.t),
    };
    let complete = first(EventKind::Complete);
    let mut marks: Vec<(f64, Phase)> = vec![(0.0, Phase::Receiving)];
    if let Some(t) = hit.filter(|t| complete.is_none_or(|c| *t < c)) {
        match role {
            Role::Victim => {
                marks.push((t, Phase::Down));
                if let Some(h) = first(EventKind::Heal) {
                    marks.push((h, Phase::Stalled));
                }
            }
            Role::Below => marks.push((t, Phase::Stalled)),
        }
        let fed = mine
            .iter()
            .filter(|e| e.kind == EventKind::RecoveryStart && e.t >= t)
            .map(|e| e.t)
            .next();
        if let Some(f) = fed {
            marks.push((f, Phase::Recovering));
        }
    }
    if let Some(c) = complete {
        marks.push((c, Phase::Done));
    }
    // In time order (a recovery may start while the victim is still counted down, if the
    // controller re-planned it: the later mark wins from its time).
    marks.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<Span> = Vec::new();
    for (i, &(from, phase)) in marks.iter().enumerate() {
        let to = marks.get(i + 1).map_or(end.max(from), |m| m.0);
        if to > from || (i + 1 == marks.len()) {
            out.push(Span { from, to, phase });
        }
    }
    out
}

/// The report's rows as a text table.
pub fn table(r: &FaultReport) -> String {
    let mut out = format!(
        "faults {} ({}, {} hosts, {})\n",
        r.faults.join(","),
        r.model,
        r.hosts,
        r.method.label()
    );
    let opt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    out.push_str(&format!(
        "healthy hosts ready: {} s with, {} s without ({} x); origin {:.3} x the model ({:.3} x without)\n",
        opt(r.with_faults.healthy_ready_s),
        opt(r.no_fault.healthy_ready_s),
        opt(r.healthy_ratio),
        r.with_faults.origin_x_model,
        r.no_fault.origin_x_model
    ));
    out.push_str(&format!(
        "{:<8} {:<7} {:>10} {:>12} {:>8}\n",
        "host", "role", "ready s", "no fault s", "x"
    ));
    for a in &r.affected {
        out.push_str(&format!(
            "{:<8} {:<7} {:>10} {:>12} {:>8}\n",
            a.host,
            match a.role {
                Role::Victim => "victim",
                Role::Below => "below",
            },
            opt(a.ready_s),
            opt(a.no_fault_ready_s),
            opt(a.ratio)
        ));
    }
    for e in &r.events {
        out.push_str(&format!(
            "  {:>8.3} s  {:<6} {:?}: {}\n",
            e.t, e.host, e.kind, e.detail
        ));
    }
    out
}

#[cfg(test)]
#[path = "faults_tests.rs"]
mod tests;
