//! The fault timeline (`<name>-fault-timeline.svg`, `simulate --faults --plots DIR`): one
//! row per host a fault touched, a bar per phase over time (receiving, down, stalled,
//! recovering, done: [`super::faults::Phase`]), and a marker at every fault and every link
//! that comes back. Drawn from a [`FaultReport`] with `plotters`, next to the line plots of
//! [`super::plots`] (whose error type and file handling it shares).

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::faults::{EventKind, FaultReport, Phase, Role};
use super::plots::PlotError;

/// One row of the timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineRow {
    /// The row's label (host and role).
    pub label: String,
    /// Its bars: (from, to, phase), seconds.
    pub spans: Vec<(f64, f64, Phase)>,
}

/// A fault timeline figure: its rows, top first, and its markers.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// File name.
    pub file: String,
    /// Title.
    pub title: String,
    /// Rows, top first.
    pub rows: Vec<TimelineRow>,
    /// Vertical markers: (time, label).
    pub markers: Vec<(f64, String)>,
}

/// The timeline of `report`, in `<name>-fault-timeline.svg`.
pub fn timeline(name: &str, report: &FaultReport) -> Timeline {
    let rows = report
        .affected
        .iter()
        .map(|a| TimelineRow {
            label: format!(
                "{} ({})",
                a.host,
                match a.role {
                    Role::Victim => "victim",
                    Role::Below => "below",
                }
            ),
            spans: a.phases.iter().map(|s| (s.from, s.to, s.phase)).collect(),
        })
        .collect();
    let markers = report
        .events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::Fault => Some((e.t, format!("{} {}", e.host, "hit"))),
            EventKind::Heal => Some((e.t, format!("{} back", e.host))),
            _ => None,
        })
        .collect();
    Timeline {
        file: format!("{name}-fault-timeline.svg"),
        title: format!(
            "Fault timeline: {} — {} ({} hosts, simulated)",
            report.faults.join(", "),
            report.model,
            report.hosts
        ),
        rows,
        markers,
    }
}

fn color(p: Phase) -> RGBColor {
    match p {
        Phase::Receiving => RGBColor(66, 133, 244),
        Phase::Down => RGBColor(219, 68, 55),
        Phase::Stalled => RGBColor(244, 180, 0),
        Phase::Recovering => RGBColor(171, 71, 188),
        Phase::Done => RGBColor(15, 157, 88),
    }
}

/// `t` as an SVG document: a bar per span, a dashed marker per fault.
pub fn render(t: &Timeline) -> Result<String, PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError::Draw {
        file: t.file.clone(),
        message: e.to_string(),
    };
    let n = t.rows.len().max(1);
    let x_max = t
        .rows
        .iter()
        .flat_map(|r| r.spans.iter().map(|s| s.1))
        .chain(t.markers.iter().map(|m| m.0))
        .fold(1.0f64, f64::max)
        * 1.02;
    let mut svg = String::new();
    {
        let height = 160 + 36 * n as u32;
        let root = SVGBackend::with_string(&mut svg, (900, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let labels: Vec<String> = t.rows.iter().map(|r| r.label.clone()).collect();
        let mut chart = ChartBuilder::on(&root)
            .caption(&t.title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(150)
            .build_cartesian_2d(0.0..x_max, 0.0..n as f64)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("seconds after the prewarm")
            .y_labels(n * 2 + 1)
            .y_label_formatter(&|y| {
                // Row i is drawn between n-1-i and n-i: its label at the middle.
                let k = (*y - 0.5).round();
                if (*y - 0.5 - k).abs() > 1e-6 || k < 0.0 {
                    return String::new();
                }
                let i = n as i64 - 1 - k as i64;
                usize::try_from(i)
                    .ok()
                    .and_then(|i| labels.get(i).cloned())
                    .unwrap_or_default()
            })
            .light_line_style(WHITE)
            .draw()
            .map_err(|e| err(&e))?;
        for (i, row) in t.rows.iter().enumerate() {
            let y = (n - 1 - i) as f64;
            chart
                .draw_series(row.spans.iter().map(|&(from, to, p)| {
                    Rectangle::new([(from, y + 0.2), (to, y + 0.8)], color(p).filled())
                }))
                .map_err(|e| err(&e))?;
        }
        for p in Phase::ALL {
            let c = color(p);
            chart
                .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
                .map_err(|e| err(&e))?
                .label(p.name())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], c.filled()));
        }
        for (at, label) in &t.markers {
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(*at, 0.0), (*at, n as f64)],
                    BLACK.stroke_width(1),
                )))
                .map_err(|e| err(&e))?;
            chart
                .draw_series(std::iter::once(Text::new(
                    label.clone(),
                    (*at, n as f64 - 0.05),
                    ("sans-serif", 12),
                )))
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

/// Draws `t` into `dir` (created if missing); returns the path written.
pub fn write(dir: &Path, t: &Timeline) -> Result<PathBuf, PlotError> {
    std::fs::create_dir_all(dir).map_err(|source| PlotError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let svg = render(t)?;
    let path = dir.join(&t.file);
    std::fs::write(&path, svg).map_err(|source| PlotError::Write {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}
