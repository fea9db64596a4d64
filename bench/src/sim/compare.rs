//! The comparison rows of trace-driven runs next to the thesis' reported improvements, as
//! one report type (JSON for a plot step, a text table for the terminal).
//!
//! ## The thesis' numbers (Flashpoint ch. 8, Twitter and Azure traces, 1 h)
//!
//! * Individual techniques against the baseline, mean over the six models and four
//!   autoscalers (§8.4.1 for Twitter, §8.4.2's Azure paragraph): average cold start
//!   reduced 15.41× by locality (LC), 3.09× by multicast (MC), 2.12× by model partitioning
//!   (MP) on Twitter; 7.93×, 1.73× and 1.95× on Azure. Average end-to-end latency 4.07×
//!   (LC), 2.17× (MC), 1.23× (MP) on Twitter; 2.28×, 1.30× and 1.22× on Azure. As
//!   changes: `1 / x − 1`. (For T5-3B under ATL on Twitter, §8.4.1 also gives MP alone:
//!   3.10 s → 1.41 s average cold start, 1.28 s → 1.12 s e2e.)
//! * Everything combined (LC + MC + model partitioning) against the baseline (§8.4.2):
//!   −93.51% average cold start, −75.42% average and −66.90% p99 end-to-end latency on
//!   Twitter; −87.39%, −56.23% and −56.67% on Azure. Per model, Table 8.1 gives the
//!   average end-to-end change: T5 −92.79% (Twitter), −78.64% (Azure); GPT-2 −74.12%,
//!   −66.57%. The per-model figure is shown where the model has one.
//! * The thesis gives no LC + MC figure against the baseline (only against LC alone), and
//!   no change of p99 for single techniques; those cells are empty. Our combined row is
//!   LC + MC + MP like the thesis'.

use super::scalers::ScalerKind;
use super::workload::{Technique, TraceRow};

/// What the thesis reports for a row, as changes against its baseline (−0.935 = −93.5%).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ThesisChange {
    /// Average cold start.
    pub avg_cold_start: Option<f64>,
    /// Average end-to-end latency.
    pub avg_e2e: Option<f64>,
    /// p99 end-to-end latency.
    pub p99_e2e: Option<f64>,
    /// Where the numbers are from.
    pub source: &'static str,
}

/// The thesis' reported change for `technique` on `trace` (`twitter` or `azure`) and
/// `model` (registry name).
pub fn thesis(technique: Technique, trace: &str, model: &str) -> ThesisChange {
    let twitter = !trace.starts_with("azure");
    let times = |x: f64| Some(1.0 / x - 1.0);
    match technique {
        Technique::Baseline => ThesisChange {
            avg_cold_start: Some(0.0),
            avg_e2e: Some(0.0),
            p99_e2e: Some(0.0),
            source: "baseline",
        },
        Technique::Locality => ThesisChange {
            avg_cold_start: times(if twitter { 15.41 } else { 7.93 }),
            avg_e2e: times(if twitter { 4.07 } else { 2.28 }),
            p99_e2e: None,
            source: "§8.4.1/§8.4.2: LC alone, mean of 6 models × 4 autoscalers",
        },
        Technique::Multicast => ThesisChange {
            avg_cold_start: times(if twitter { 3.09 } else { 1.73 }),
            avg_e2e: times(if twitter { 2.17 } else { 1.30 }),
            p99_e2e: None,
            source: "§8.4.1/§8.4.2: MC alone, mean of 6 models × 4 autoscalers",
        },
        Technique::Partitioning => ThesisChange {
            avg_cold_start: times(if twitter { 2.12 } else { 1.95 }),
            avg_e2e: times(if twitter { 1.23 } else { 1.22 }),
            p99_e2e: None,
            source: "§8.4.1/§8.4.2: MP alone, mean of 6 models × 4 autoscalers",
        },
        Technique::LocalityMulticast => ThesisChange {
            avg_cold_start: None,
            avg_e2e: None,
            p99_e2e: None,
            source: "§8.4.2 gives LC+MC only against LC alone",
        },
        Technique::Combined => {
            let per_model = match (model, twitter) {
                ("t5-3b", true) => Some(-0.9279),
                ("t5-3b", false) => Some(-0.7864),
                ("gpt2-xl", true) => Some(-0.7412),
                ("gpt2-xl", false) => Some(-0.6657),
                _ => None,
            };
            ThesisChange {
                avg_cold_start: Some(if twitter { -0.9351 } else { -0.8739 }),
                avg_e2e: per_model.or(Some(if twitter { -0.7542 } else { -0.5623 })),
                p99_e2e: Some(if twitter { -0.6690 } else { -0.5667 }),
                source: if per_model.is_some() {
                    "§8.4.2 LC+MC+MP (cold start, p99: mean of models × autoscalers); \
                     Table 8.1 (average e2e, this model)"
                } else {
                    "§8.4.2 LC+MC+MP, mean of 6 models × 4 autoscalers"
                },
            }
        }
    }
}

/// Our change against our baseline row.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Change {
    /// Average cold start.
    pub avg_cold_start: Option<f64>,
    /// p99 cold start.
    pub p99_cold_start: Option<f64>,
    /// Average end-to-end latency.
    pub avg_e2e: Option<f64>,
    /// p99 end-to-end latency.
    pub p99_e2e: Option<f64>,
    /// Replica-seconds.
    pub replica_seconds: Option<f64>,
    /// Bytes from the origin.
    pub bytes_from_origin: Option<f64>,
}

fn change(ours: f64, base: f64) -> Option<f64> {
    (base > 0.0 && ours.is_finite()).then(|| ours / base - 1.0)
}

/// One row with its changes.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ComparedRow {
    /// The run.
    pub row: TraceRow,
    /// Against the baseline row of the same model, trace and scaler.
    pub change: Change,
    /// What the thesis reports for this row.
    pub thesis: ThesisChange,
}

/// The rows of one model, trace and autoscaler.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Comparison {
    /// Model.
    pub model: String,
    /// Trace.
    pub trace: String,
    /// Autoscaler.
    pub scaler: ScalerKind,
    /// The rows, baseline first when it ran.
    pub rows: Vec<ComparedRow>,
}

impl Comparison {
    /// Rows of one model, trace and scaler, compared with the baseline among them.
    pub fn new(rows: Vec<TraceRow>) -> Option<Self> {
        let first = rows.first()?;
        let (model, trace, scaler) = (first.model.clone(), first.trace.clone(), first.scaler);
        let base = rows
            .iter()
            .find(|r| r.technique == Technique::Baseline)
            .cloned();
        let rows = rows
            .into_iter()
            .map(|row| {
                let change = base.as_ref().map_or_else(Change::default, |b| Change {
                    avg_cold_start: change(row.avg_cold_start_s, b.avg_cold_start_s),
                    p99_cold_start: change(row.p99_cold_start_s, b.p99_cold_start_s),
                    avg_e2e: change(row.avg_e2e_s, b.avg_e2e_s),
                    p99_e2e: change(row.p99_e2e_s, b.p99_e2e_s),
                    replica_seconds: change(row.replica_seconds, b.replica_seconds),
                    bytes_from_origin: change(row.bytes_from_origin, b.bytes_from_origin),
                });
                let thesis = thesis(row.technique, &trace, &model);
                ComparedRow {
                    row,
                    change,
                    thesis,
                }
            })
            .collect();
        Some(Self {
            model,
            trace,
            scaler,
            rows,
        })
    }
}

/// The parameters of a trace-driven report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TraceParams {
    /// Hosts.
    pub hosts: usize,
    /// GPUs per host.
    pub gpus_per_host: u32,
    /// Hosts per leaf.
    pub hosts_per_leaf: usize,
    /// Host links, Gbit/s.
    pub host_gbps: f64,
    /// Leaf uplinks, Gbit/s.
    pub leaf_gbps: f64,
    /// The cluster's link to the origin, Gbit/s.
    pub origin_link_gbps: Option<f64>,
    /// One origin stream, Gbit/s.
    pub origin_stream_gbps: Option<f64>,
    /// Trace length, seconds.
    pub duration_s: f64,
    /// Arrival seed.
    pub seed: u64,
    /// Heartbeat period, seconds.
    pub heartbeat_s: f64,
    /// Plan runner poll tick, seconds.
    pub poll_s: f64,
    /// Autoscaler tick, seconds.
    pub tick_s: f64,
    /// Whether the first minute's replicas were made warm before the trace.
    pub warm_start: bool,
}

/// `simulate --trace`'s report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TraceReport {
    /// What made the rows.
    pub params: TraceParams,
    /// One per model × trace × autoscaler.
    pub comparisons: Vec<Comparison>,
    /// Wall seconds for all of them.
    pub wall_s: f64,
    /// Peak resident memory of the process, bytes (`VmHWM`), where the OS says.
    pub peak_rss_bytes: Option<u64>,
}

fn pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{:+.1}%", v * 100.0))
}

impl TraceReport {
    /// The rows as text tables, one per comparison.
    pub fn table(&self) -> String {
        let mut out = String::new();
        for c in &self.comparisons {
            out.push_str(&format!(
                "\n{} on {} with {}\n{:<42} {:>9} {:>9} {:>8} {:>8} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
                c.model,
                c.trace,
                c.scaler.label(),
                "technique",
                "cold avg",
                "cold p99",
                "e2e avg",
                "e2e p99",
                "replica-h",
                "origin GB",
                "Δcold",
                "thesis",
                "Δe2e",
                "thesis",
                "Δe2e p99",
                "thesis",
            ));
            for r in &c.rows {
                let x = &r.row;
                out.push_str(&format!(
                    "{:<42} {:>9.2} {:>9.2} {:>8.2} {:>8.2} {:>9.1} {:>8.1} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
                    x.label,
                    x.avg_cold_start_s,
                    x.p99_cold_start_s,
                    x.avg_e2e_s,
                    x.p99_e2e_s,
                    x.replica_seconds / 3600.0,
                    x.bytes_from_origin / 1e9,
                    pct(r.change.avg_cold_start),
                    pct(r.thesis.avg_cold_start),
                    pct(r.change.avg_e2e),
                    pct(r.thesis.avg_e2e),
                    pct(r.change.p99_e2e),
                    pct(r.thesis.p99_e2e),
                ));
            }
        }
        out
    }
}

/// The process's peak resident memory (`VmHWM` in `/proc/self/status`), bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thesis_changes_are_the_reported_ones() {
        let lc = thesis(Technique::Locality, "twitter", "t5-3b");
        assert!((lc.avg_cold_start.unwrap() - (1.0 / 15.41 - 1.0)).abs() < 1e-12);
        let all = thesis(Technique::Combined, "twitter", "t5-3b");
        assert_eq!(all.avg_cold_start, Some(-0.9351));
        assert_eq!(all.avg_e2e, Some(-0.9279));
        let az = thesis(Technique::Combined, "azure", "codebert-base");
        assert_eq!(
            (az.avg_cold_start, az.avg_e2e),
            (Some(-0.8739), Some(-0.5623))
        );
        assert_eq!(
            thesis(Technique::Multicast, "azure", "gpt2-xl").p99_e2e,
            None
        );
        let mp = thesis(Technique::Partitioning, "twitter", "gpt2-xl");
        assert!((mp.avg_cold_start.unwrap() - (1.0 / 2.12 - 1.0)).abs() < 1e-12);
        assert!((mp.avg_e2e.unwrap() - (1.0 / 1.23 - 1.0)).abs() < 1e-12);
        let mp = thesis(Technique::Partitioning, "azure", "t5-3b");
        assert!((mp.avg_cold_start.unwrap() - (1.0 / 1.95 - 1.0)).abs() < 1e-12);
        assert_eq!(
            thesis(Technique::LocalityMulticast, "twitter", "t5-3b").avg_cold_start,
            None
        );
        assert_eq!(change(5.0, 10.0), Some(-0.5));
        assert_eq!(change(5.0, 0.0), None);
    }
}
