//! SVG plots of the simulator's and `cold-start --emulate`'s reports (`--plots DIR`).
//!
//! The data of each plot is computed here, from the report types, as plain [`Figure`]s
//! (series of points); [`render`] draws a figure with `plotters`' SVG backend and
//! [`write`] puts the files in a directory. Tests check the data and that the SVG is
//! well-formed with one line per series, not pixels.
//!
//! | file | from | what |
//! |---|---|---|
//! | `ready-cdf.svg` | `simulate` | per-host cold start (prewarm → GPU replica resident), CDF, one line per method |
//! | `copy-cdf.svg` | `simulate`, `cold-start --emulate` | per-host copy complete in host memory, CDF, one line per method |
//! | `bytes-by-tier-<method>.svg` | `simulate` | bytes that reached hosts by source tier (origin, peer, local) over the burst |
//! | `<model>-<trace>-<scaler>-ready-cdf.svg` | `simulate --trace` | cold starts (scaler's decision → serving), CDF, one line per technique |
//! | `<model>-<trace>-<scaler>-<technique>-bytes-by-tier.svg` | `simulate --trace` | bytes by source tier over the trace |
//! | `<model>-<trace>-<scaler>-<technique>-replicas-queue.svg` | `simulate --trace` | replicas held and serving, and the request queue, over the trace |
//! | `<method>-fault-timeline.svg` | `simulate --faults` | per affected host, its phases (receiving, down, stalled, recovering, done) over time, with fault markers ([`super::fault_plot`]) |
//!
//! `cold-start --emulate` prewarms tier memory: its hosts are ready when their copy is
//! complete in host memory, which is what the simulator's `copy-cdf.svg` shows (its
//! `ready-cdf.svg` adds the load and the copy to the GPU). Both are drawn by
//! [`ready_cdf`] from [`ReadyTimes`], so an emulated and a simulated burst of the same
//! shape compare picture to picture. Their legends name the simulator's methods (the
//! emulated `origin-pull` is the simulator's `baseline`, `shardcast` its `chain`).

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::coldstart::{self, ColdStartRow, Method};
use super::compare::TraceReport;
use super::dc::TierBytes;
use super::workload::TraceRow;
use crate::managed::{ColdStartReport, ColdStartResult};

/// One line: a label and its points, drawn joined in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The legend's text.
    pub label: String,
    /// (x, y), in drawing order.
    pub points: Vec<(f64, f64)>,
}

/// Where a panel's legend goes: out of the way of its lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegendAt {
    /// Upper left (lines that rise from low on the left).
    UpperLeft,
    /// Lower right (CDFs, which reach the top early on the left).
    LowerRight,
}

/// One chart of a figure; a figure's panels share its x axis and are stacked.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    /// The y axis.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
    /// The legend's place.
    pub legend: LegendAt,
}

/// One SVG file.
#[derive(Debug, Clone, PartialEq)]
pub struct Figure {
    /// File name (in the plots directory).
    pub file: String,
    /// Title.
    pub title: String,
    /// The x axis.
    pub x_label: String,
    /// Stacked panels, top first.
    pub panels: Vec<Panel>,
}

/// Why plots could not be drawn or written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// `plotters` refused to draw a figure.
    #[error("drawing {file}: {message}")]
    Draw {
        /// The figure's file name.
        file: String,
        /// What plotters said.
        message: String,
    },
    /// The directory or a file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Per-host ready times of one method or technique: the input of [`ready_cdf`].
#[derive(Debug, Clone, PartialEq)]
pub struct ReadyTimes {
    /// The legend's text.
    pub label: String,
    /// Seconds to ready of the hosts that became ready, any order.
    pub ready_s: Vec<f64>,
    /// Hosts asked for (the CDF's 100%; hosts never ready keep it below).
    pub receivers: usize,
}

impl ReadyTimes {
    /// A simulated burst's hosts: GPU replica resident.
    pub fn gpu(row: &ColdStartRow) -> Self {
        Self {
            label: row.label.to_string(),
            ready_s: row.hosts.iter().filter_map(|h| h.ready_s).collect(),
            receivers: row.hosts.len(),
        }
    }

    /// A simulated burst's hosts: copy complete in host memory.
    pub fn copy(row: &ColdStartRow) -> Self {
        Self {
            label: row.label.to_string(),
            ready_s: row.hosts.iter().filter_map(|h| h.copy_s).collect(),
            receivers: row.hosts.len(),
        }
    }

    /// An emulated burst's hosts (`cold-start --emulate`, tier memory: a verified copy in
    /// host memory), labelled as the simulator's method it corresponds to.
    pub fn emulated(result: &ColdStartResult, hosts: usize) -> Self {
        let label = match result.method.as_str() {
            "origin-pull" => format!("{} (origin-pull)", Method::Baseline.label()),
            "shardcast" => format!("{} (shardcast)", Method::Chain.label()),
            other => other.to_string(),
        };
        Self {
            label,
            ready_s: result.per_host_s.clone(),
            receivers: hosts.max(result.per_host_s.len()),
        }
    }

    /// A trace run's cold starts (one per replica group: the scaler's decision → serving)
    /// that finished.
    pub fn trace(row: &TraceRow) -> Self {
        Self {
            label: row.label.to_string(),
            ready_s: row.cold_start_list.iter().map(|c| c.cold_start_s).collect(),
            receivers: row.cold_start_list.len(),
        }
    }
}

/// The empirical CDF of `times` over `total` hosts, as the points of its staircase: for
/// the sorted times `t1 ≤ … ≤ tn`, `(t1, 0), (t1, 1/total), (t2, 1/total), (t2, 2/total)
/// … (tn, n/total)`. Empty for no times; non-finite times are left out.
pub fn cdf(times: &[f64], total: usize) -> Vec<(f64, f64)> {
    let mut sorted: Vec<f64> = times.iter().copied().filter(|t| t.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let total = total.max(sorted.len()).max(1) as f64;
    let mut out = Vec::with_capacity(2 * sorted.len());
    for (i, t) in sorted.iter().enumerate() {
        out.push((*t, i as f64 / total));
        out.push((*t, (i + 1) as f64 / total));
    }
    out
}

/// The ready-time CDF of several methods in one figure: every ready-time plot, simulated
/// or emulated, is drawn by this function.
pub fn ready_cdf(file: &str, title: &str, x_label: &str, rows: &[ReadyTimes]) -> Figure {
    Figure {
        file: file.to_string(),
        title: title.to_string(),
        x_label: x_label.to_string(),
        panels: vec![Panel {
            y_label: "fraction of hosts ready".into(),
            series: rows
                .iter()
                .map(|r| Series {
                    label: r.label.clone(),
                    points: cdf(&r.ready_s, r.receivers),
                })
                .collect(),
            legend: LegendAt::LowerRight,
        }],
    }
}

/// Bytes by source tier over time, GB, one line per tier.
pub fn tier_series(samples: impl IntoIterator<Item = (f64, TierBytes)>) -> Vec<Series> {
    let (mut origin, mut peer, mut local) = (Vec::new(), Vec::new(), Vec::new());
    for (t, b) in samples {
        origin.push((t, b.origin / 1e9));
        peer.push((t, b.peer / 1e9));
        local.push((t, b.local / 1e9));
    }
    [("origin", origin), ("peer", peer), ("local", local)]
        .into_iter()
        .map(|(label, points)| Series {
            label: label.into(),
            points,
        })
        .collect()
}

fn tier_figure(file: String, title: String, x_label: &str, series: Vec<Series>) -> Figure {
    Figure {
        file,
        title,
        x_label: x_label.into(),
        panels: vec![Panel {
            y_label: "GB received (cumulative)".into(),
            series,
            legend: LegendAt::UpperLeft,
        }],
    }
}

/// A value's serde name (`baseline`, `chain`, `atl`) for a file name.
fn kebab<T: serde::Serialize>(x: &T) -> String {
    let name = serde_json::to_value(x)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    file_part(&name)
}

/// `s` with everything but ASCII letters, digits, `.` and `-` replaced by `-`.
fn file_part(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

/// A simulated burst's figures: `ready-cdf.svg`, `copy-cdf.svg` and one
/// `bytes-by-tier-<method>.svg` per method.
pub fn burst_figures(report: &coldstart::Report) -> Vec<Figure> {
    let p = &report.params;
    let shape = format!(
        "{} × {} GPU replicas, {} hosts (simulated)",
        p.model, p.replicas, p.hosts
    );
    let mut out = vec![
        ready_cdf(
            "ready-cdf.svg",
            &format!("GPU replica resident: {shape}"),
            "seconds after the prewarm",
            &report.rows.iter().map(ReadyTimes::gpu).collect::<Vec<_>>(),
        ),
        ready_cdf(
            "copy-cdf.svg",
            &format!("Copy complete in host memory: {shape}"),
            "seconds after the prewarm",
            &report.rows.iter().map(ReadyTimes::copy).collect::<Vec<_>>(),
        ),
    ];
    for r in &report.rows {
        out.push(tier_figure(
            format!("bytes-by-tier-{}.svg", kebab(&r.method)),
            format!("Bytes by source: {} — {shape}", r.label),
            "seconds after the prewarm",
            tier_series(r.tiers.iter().map(|s| (s.t, s.bytes))),
        ));
    }
    out
}

/// An emulated burst's figure (`cold-start --emulate`): `copy-cdf.svg`, drawn by the same
/// [`ready_cdf`] as the simulator's.
pub fn emulated_figures(report: &ColdStartReport) -> Vec<Figure> {
    let shape = format!(
        "{:.0} MB onto {} hosts (emulated)",
        report.bytes as f64 / 1e6,
        report.hosts
    );
    vec![ready_cdf(
        "copy-cdf.svg",
        &format!("Copy complete in host memory: {shape}"),
        "seconds after the prewarm",
        &report
            .results
            .iter()
            .map(|r| ReadyTimes::emulated(r, report.hosts))
            .collect::<Vec<_>>(),
    )]
}

/// `simulate --emulated REPORT --plots DIR`: `copy-cdf.svg` with, per method, the emulated
/// hosts' ready times beside the simulator's replay of the same burst, one picture for both.
pub fn replay_figures(
    report: &ColdStartReport,
    replays: &[super::params::Replayed],
) -> Vec<Figure> {
    let shape = format!(
        "{:.0} MB onto {} hosts, emulated and simulated",
        report.bytes as f64 / 1e6,
        report.hosts
    );
    let mut rows: Vec<ReadyTimes> = report
        .results
        .iter()
        .map(|r| {
            let mut t = ReadyTimes::emulated(r, report.hosts);
            t.label = format!("{}: emulated", r.method);
            t
        })
        .collect();
    rows.extend(replays.iter().map(|r| {
        let mut t = ReadyTimes::copy(&r.simulated);
        t.label = format!("{}: simulated", r.method);
        t
    }));
    vec![ready_cdf(
        "copy-cdf.svg",
        &format!("Copy complete in host memory: {shape}"),
        "seconds after the prewarm",
        &rows,
    )]
}

/// A trace report's figures: per model × trace × autoscaler a cold-start CDF of every
/// technique, and per technique its bytes by tier and its replicas and queue.
pub fn trace_figures(report: &TraceReport) -> Vec<Figure> {
    let mut out = Vec::new();
    for c in &report.comparisons {
        let prefix = format!(
            "{}-{}-{}",
            file_part(&c.model),
            file_part(&c.trace),
            kebab(&c.scaler)
        );
        let what = format!("{} on {} with {}", c.model, c.trace, c.scaler.label());
        out.push(ready_cdf(
            &format!("{prefix}-ready-cdf.svg"),
            &format!("Cold starts (decision → serving): {what}"),
            "seconds from the scaler's decision",
            &c.rows
                .iter()
                .map(|r| ReadyTimes::trace(&r.row))
                .collect::<Vec<_>>(),
        ));
        for r in &c.rows {
            let row = &r.row;
            let file = format!("{prefix}-{}", kebab(&row.technique));
            out.push(tier_figure(
                format!("{file}-bytes-by-tier.svg"),
                format!("Bytes by source: {} — {what}", row.label),
                "seconds into the trace",
                tier_series(row.timeline.iter().map(|s| (s.t, s.tiers))),
            ));
            out.push(replicas_queue(
                format!("{file}-replicas-queue.svg"),
                format!("Replicas and queue: {} — {what}", row.label),
                row,
            ));
        }
    }
    out
}

fn replicas_queue(file: String, title: String, row: &TraceRow) -> Figure {
    let line = |label: &str, f: &dyn Fn(&super::workload::Sample) -> f64| Series {
        label: label.into(),
        points: row.timeline.iter().map(|s| (s.t, f(s))).collect(),
    };
    Figure {
        file,
        title,
        x_label: "seconds into the trace".into(),
        panels: vec![
            Panel {
                y_label: "GPU replicas".into(),
                series: vec![
                    line("held (loading included)", &|s| f64::from(s.replicas)),
                    line("serving", &|s| f64::from(s.serving)),
                ],
                legend: LegendAt::UpperLeft,
            },
            Panel {
                y_label: "requests waiting".into(),
                series: vec![line("queue", &|s| s.queue as f64)],
                legend: LegendAt::UpperLeft,
            },
        ],
    }
}

/// The smallest range holding every point's coordinate `pick`, from 0 (or below, for
/// negative values), a little headroom above, never empty.
fn range(panels: &[&Panel], pick: fn(&(f64, f64)) -> f64, headroom: f64) -> (f64, f64) {
    let (mut lo, mut hi) = (0.0f64, f64::NEG_INFINITY);
    for p in panels {
        for s in &p.series {
            for pt in &s.points {
                let v = pick(pt);
                if v.is_finite() {
                    lo = lo.min(v);
                    hi = hi.max(v);
                }
            }
        }
    }
    if !hi.is_finite() || hi <= lo {
        hi = lo + 1.0;
    }
    (lo, hi + (hi - lo) * headroom)
}

/// Draw size of every figure, pixels.
const SIZE: (u32, u32) = (900, 560);

/// `fig` as an SVG document.
pub fn render(fig: &Figure) -> Result<String, PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError::Draw {
        file: fig.file.clone(),
        message: e.to_string(),
    };
    let mut svg = String::new();
    {
        let height = SIZE.1 * (fig.panels.len().max(1) as u32 + 1) / 2;
        let root = SVGBackend::with_string(&mut svg, (SIZE.0, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let body = root
            .titled(&fig.title, ("sans-serif", 18))
            .map_err(|e| err(&e))?;
        let all: Vec<&Panel> = fig.panels.iter().collect();
        let x = range(&all, |p| p.0, 0.02);
        let areas = body.split_evenly((fig.panels.len().max(1), 1));
        for (area, panel) in areas.iter().zip(&fig.panels) {
            let y = range(&[panel], |p| p.1, 0.05);
            let mut chart = ChartBuilder::on(area)
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(70)
                .build_cartesian_2d(x.0..x.1, y.0..y.1)
                .map_err(|e| err(&e))?;
            chart
                .configure_mesh()
                .x_desc(fig.x_label.as_str())
                .y_desc(panel.y_label.as_str())
                .light_line_style(WHITE)
                .draw()
                .map_err(|e| err(&e))?;
            for (i, s) in panel.series.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                chart
                    .draw_series(LineSeries::new(
                        s.points.iter().copied(),
                        color.stroke_width(2),
                    ))
                    .map_err(|e| err(&e))?
                    .label(s.label.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .position(match panel.legend {
                    LegendAt::UpperLeft => SeriesLabelPosition::UpperLeft,
                    LegendAt::LowerRight => SeriesLabelPosition::LowerRight,
                })
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(&e))?;
        }
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

/// Draws `figures` into `dir` (created if missing); returns the paths written, in order.
pub fn write(dir: &Path, figures: &[Figure]) -> Result<Vec<PathBuf>, PlotError> {
    std::fs::create_dir_all(dir).map_err(|source| PlotError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut out = Vec::with_capacity(figures.len());
    for f in figures {
        let svg = render(f)?;
        let path = dir.join(&f.file);
        std::fs::write(&path, svg).map_err(|source| PlotError::Write {
            path: path.clone(),
            source,
        })?;
        out.push(path);
    }
    Ok(out)
}

#[cfg(test)]
/// What a test reads from an SVG document.
pub(crate) struct SvgSummary {
    /// `polyline` elements: every series is one in its chart and one in its legend.
    pub(crate) polylines: usize,
    /// `rect` elements (backgrounds, bars, legend boxes).
    pub(crate) rects: usize,
    /// The text of every `text` element (unescaped, trimmed).
    pub(crate) texts: Vec<String>,
}

#[cfg(test)]
/// Parses `svg` as XML to the end (every tag closed, every attribute quoted, one `svg`
/// root); panics where it is not well-formed.
pub(crate) fn well_formed(svg: &str) -> SvgSummary {
    use quick_xml::events::Event;
    let mut reader = quick_xml::Reader::from_str(svg);
    let mut out = SvgSummary {
        polylines: 0,
        rects: 0,
        texts: Vec::new(),
    };
    let (mut root, mut depth, mut text) = (None, 0usize, String::new());
    let flush = |text: &mut String, texts: &mut Vec<String>| {
        let t = text.trim();
        if !t.is_empty() {
            texts.push(t.to_string());
        }
        text.clear();
    };
    loop {
        let event = reader.read_event();
        if !matches!(event, Ok(Event::Text(_) | Event::GeneralRef(_))) {
            flush(&mut text, &mut out.texts);
        }
        match event {
            Ok(Event::Eof) => break,
            Ok(Event::Start(e)) => {
                let name = String::from_utf8_lossy(e.name().as_ref()).into_owned();
                assert!(depth > 0 || root.is_none(), "a second root element {name}");
                root.get_or_insert(name.clone());
                out.polylines += usize::from(name == "polyline");
                out.rects += usize::from(name == "rect");
                depth += 1;
            }
            Ok(Event::Empty(e)) => {
                let name = String::from_utf8_lossy(e.name().as_ref()).into_owned();
                assert!(depth > 0, "an element {name} outside the root");
                out.polylines += usize::from(name == "polyline");
                out.rects += usize::from(name == "rect");
            }
            Ok(Event::End(_)) => depth -= 1,
            Ok(Event::Text(t)) => text.push_str(&t.decode().expect("UTF-8 text")),
            Ok(Event::GeneralRef(r)) => {
                let name = r.decode().expect("UTF-8 reference");
                let resolved = quick_xml::escape::resolve_predefined_entity(&name);
                text.push_str(resolved.unwrap_or_else(|| panic!("unknown entity &{name};")));
            }
            Ok(_) => {}
            Err(e) => panic!("not well-formed at {}: {e}", reader.buffer_position()),
        }
    }
    assert_eq!((root.as_deref(), depth), (Some("svg"), 0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::coldstart::HostColdStart;

    fn figure(series: usize) -> Figure {
        ready_cdf(
            "ready-cdf.svg",
            "a & b <test>",
            "seconds",
            &(0..series)
                .map(|i| ReadyTimes {
                    label: format!("method {i}"),
                    ready_s: vec![1.0 + i as f64, 2.0, 3.5],
                    receivers: 4,
                })
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn the_cdf_is_the_staircase_of_the_sorted_times_over_all_receivers() {
        // 3 of 4 hosts ready (at 1, 2 and 3 s, given out of order): the CDF tops out at
        // 3/4; a non-finite time is left out; no times, no points.
        let pts = cdf(&[3.0, 1.0, f64::NAN, 2.0], 4);
        assert_eq!(
            pts,
            [
                (1.0, 0.0),
                (1.0, 0.25),
                (2.0, 0.25),
                (2.0, 0.5),
                (3.0, 0.5),
                (3.0, 0.75)
            ]
        );
        assert!(cdf(&[], 8).is_empty());
        // More times than receivers said: the CDF still ends at 1.
        assert_eq!(cdf(&[5.0, 5.0], 1).last(), Some(&(5.0, 1.0)));
    }

    #[test]
    fn the_svg_is_well_formed_with_a_line_per_series() {
        // Each series is a polyline in the chart and one in the legend; the axes are
        // drawn as lines, not polylines, so the difference per series is exactly 2.
        let (one, three) = (render(&figure(1)).unwrap(), render(&figure(3)).unwrap());
        let (s1, s3) = (well_formed(&one), well_formed(&three));
        assert_eq!(
            s3.polylines - s1.polylines,
            4,
            "{} vs {}",
            s1.polylines,
            s3.polylines
        );
        assert!(s1.polylines >= 2);
        for i in 0..3 {
            assert!(s3.texts.contains(&format!("method {i}")), "{:?}", s3.texts);
        }
        // The title and the axes' names are text, the title escaped in the document.
        for t in ["a & b <test>", "seconds", "fraction of hosts ready"] {
            assert!(s3.texts.iter().any(|x| x == t), "{t}: {:?}", s3.texts);
        }
        assert!(three.contains("a &amp; b &lt;test&gt;"));
    }

    /// A 4-host `cold-start --emulate` report: 512 MiB, both methods.
    fn four_host_report() -> ColdStartReport {
        ColdStartReport {
            hosts: 4,
            bytes: 512 << 20,
            rate_bits_per_s: 1_000_000_000,
            origin_rate_bits_per_s: 250_000_000,
            origin_read_s: 17.2,
            results: vec![
                ColdStartResult {
                    method: "origin-pull".into(),
                    ready_s: 8.0,
                    per_host_s: vec![8.0, 4.0, 6.0, 2.0],
                    hosts: Vec::new(),
                    chain_hops: Vec::new(),
                    estimate_s: 8.0,
                    origin_bytes: 4 * (512 << 20),
                    chains: 4,
                    verified: true,
                },
                ColdStartResult {
                    method: "shardcast".into(),
                    ready_s: 2.5,
                    per_host_s: vec![2.0, 2.1, 2.2, 2.5],
                    hosts: Vec::new(),
                    chain_hops: Vec::new(),
                    estimate_s: 2.4,
                    origin_bytes: 512 << 20,
                    chains: 1,
                    verified: true,
                },
            ],
            sim_params: crate::sim::params::BurstParams {
                hosts: 4,
                model: "synthetic/llm".into(),
                shard_bytes: vec![512 << 20],
                chunk_size: 1 << 20,
                host_link_cap_bps: 125e6,
                origin_bps: 31.25e6,
                origin_behind_host_link: true,
                tls: true,
                origin_parallel: 8,
            },
        }
    }

    #[test]
    fn a_replayed_emulated_burst_draws_both_in_one_picture() {
        let report = four_host_report();
        let replays = crate::sim::params::replay(&report).unwrap();
        let figs = replay_figures(&report, &replays);
        assert_eq!(figs.len(), 1);
        assert_eq!(figs[0].file, "copy-cdf.svg");
        let s = &figs[0].panels[0].series;
        assert_eq!(
            s.iter().map(|s| s.label.as_str()).collect::<Vec<_>>(),
            [
                "origin-pull: emulated",
                "shardcast: emulated",
                "origin-pull: simulated",
                "shardcast: simulated"
            ]
        );
        assert_eq!(s[1].points, cdf(&[2.0, 2.1, 2.2, 2.5], 4));
        for (series, replay) in s[2..].iter().zip(&replays) {
            let copies: Vec<f64> = replay
                .simulated
                .hosts
                .iter()
                .filter_map(|h| h.copy_s)
                .collect();
            assert_eq!(copies.len(), 4, "{}", replay.method);
            assert_eq!(series.points, cdf(&copies, 4));
        }
        let svg = render(&figs[0]).unwrap();
        assert!(svg.contains("shardcast: simulated"), "{svg}");
    }

    #[test]
    fn an_emulated_cold_start_gives_the_ready_cdf_a_simulated_one_gives() {
        // `cold-start --emulate` measures per-host ready times (tier memory); the same
        // times from a simulated burst's copies draw the same series.
        let emulated = four_host_report();
        let figs = emulated_figures(&emulated);
        assert_eq!(figs.len(), 1);
        let f = &figs[0];
        assert_eq!(f.file, "copy-cdf.svg");
        let s = &f.panels[0].series;
        assert_eq!(
            s.iter().map(|s| s.label.as_str()).collect::<Vec<_>>(),
            [
                "baseline: every host from the origin (origin-pull)",
                "+ chain multicast (shardcast)"
            ]
        );
        assert_eq!(
            s[0].points,
            [
                (2.0, 0.0),
                (2.0, 0.25),
                (4.0, 0.25),
                (4.0, 0.5),
                (6.0, 0.5),
                (6.0, 0.75),
                (8.0, 0.75),
                (8.0, 1.0)
            ]
        );
        // A simulated chain row with the same copy times: the same points.
        let hosts = [2.0, 2.1, 2.2, 2.5]
            .iter()
            .enumerate()
            .map(|(i, t)| HostColdStart {
                host: crate::sim::dc::host_id(i),
                source: "origin".into(),
                copy_s: Some(*t),
                ready_s: Some(t + 15.0),
            })
            .collect::<Vec<_>>();
        let sim = ReadyTimes::copy(&ColdStartRow {
            method: Method::Chain,
            label: Method::Chain.label(),
            model: "t".into(),
            replicas: 4,
            ready: 4,
            plan_state: "done".into(),
            chains: 1,
            avg_cold_start_s: 0.0,
            p50_cold_start_s: 0.0,
            p99_cold_start_s: 0.0,
            max_cold_start_s: 0.0,
            avg_copy_s: 0.0,
            bytes_from_origin: 0.0,
            virtual_s: 0.0,
            wall_s: 0.0,
            hosts,
            tiers: Vec::new(),
        });
        assert_eq!(cdf(&sim.ready_s, sim.receivers), s[1].points);
        let svg = well_formed(&render(f).unwrap());
        assert!(svg.polylines >= 4);
        assert!(svg.texts.iter().any(|t| t.ends_with("(origin-pull)")));
    }

    #[test]
    fn tier_series_are_gigabytes_per_tier() {
        let b = |o: f64, p: f64, l: f64| TierBytes {
            origin: o,
            peer: p,
            local: l,
        };
        let s = tier_series([(0.0, b(0.0, 0.0, 0.0)), (2.0, b(1e9, 3e9, 8e9))]);
        assert_eq!(
            s.iter().map(|s| s.label.as_str()).collect::<Vec<_>>(),
            ["origin", "peer", "local"]
        );
        assert_eq!(s[0].points, [(0.0, 0.0), (2.0, 1.0)]);
        assert_eq!(s[1].points, [(0.0, 0.0), (2.0, 3.0)]);
        assert_eq!(s[2].points, [(0.0, 0.0), (2.0, 8.0)]);
        assert_eq!(file_part("azure:/x/y.csv#Fn 1"), "azure--x-y.csv-fn-1");
    }
}
