//! Request-rate traces: a reader for the Azure Functions 2019 invocation counts, seeded
//! generators shaped like the thesis' two workloads, and Poisson arrivals from a rate.
//!
//! A [`RateTrace`] is a request rate (requests per second) held constant over steps of
//! `step_s` seconds: 60 s for the Azure per-minute counts, 1 s for the generators.
//!
//! ## The Azure Functions 2019 format
//!
//! `invocations_per_function_md.anon.dNN.csv` of the Azure Functions public dataset: a
//! header `HashOwner,HashApp,HashFunction,Trigger,1,2,…,1440`, then one row per function
//! with its invocation count in each minute of the day. [`read_azure`] accepts exactly that
//! shape: the four named columns first (names compared case-insensitively), then minute
//! columns named `1`, `2`, … consecutively (any number of them, at least one); each row must
//! have every column, counts are non-negative integers. A malformed file is an error naming
//! the line, never a panic. [`AzurePick`] says which rows make the trace: their sum (the
//! whole platform's load) or one function by its hash.
//!
//! ## The generators (thesis §3.1, §8.4)
//!
//! The thesis' traces are not public in the shape it used; it gives two statistics of each
//! one-hour trace: the Twitter trace has a median of 57 requests/s and a peak-to-median
//! ratio of 4.68, the Azure trace 18 requests/s and 2.54. [`generate`] builds a rate with
//! exactly those statistics and a plausible shape: a log-normal AR(1) wander (minutes-long
//! drifts) plus a few bursts that rise in seconds and decay over a minute or two (the
//! Twitter shape has sharper, more frequent bursts). The shape is then fixed by two monotone
//! steps that keep the order of the samples: divide by the median (median 1) and raise the
//! values above the median to the power that maps the highest one to the peak-to-median
//! ratio; then multiply by the median rate. Same seed, same trace, on every platform
//! (ChaCha8). These match the published statistics, not the traces' exact timelines.

use std::io::Read;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A request rate over time.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RateTrace {
    /// Seconds each value holds for.
    pub step_s: f64,
    /// Requests per second in each step.
    pub rps: Vec<f64>,
}

impl RateTrace {
    /// Its length, seconds.
    pub fn duration_s(&self) -> f64 {
        self.step_s * self.rps.len() as f64
    }

    /// The median rate.
    pub fn median(&self) -> f64 {
        median(&self.rps)
    }

    /// The highest rate over the median.
    pub fn peak_to_median(&self) -> f64 {
        let m = self.median();
        let peak = self.rps.iter().copied().fold(0.0, f64::max);
        if m > 0.0 { peak / m } else { f64::INFINITY }
    }

    /// The first `seconds` of the trace (whole steps).
    pub fn truncate(&mut self, seconds: f64) {
        let steps = (seconds / self.step_s).ceil().max(0.0) as usize;
        self.rps.truncate(steps);
    }

    /// Request arrival times (seconds from the start) of a Poisson process with this
    /// rate, seeded.
    pub fn arrivals(&self, seed: u64) -> Vec<f64> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut out = Vec::new();
        for (i, &rate) in self.rps.iter().enumerate() {
            if rate.is_nan() || rate <= 0.0 {
                continue;
            }
            let (start, end) = (i as f64 * self.step_s, (i + 1) as f64 * self.step_s);
            let mut t = start;
            loop {
                // Exponential gap by inversion; 1 - u is in (0, 1].
                let u: f64 = rng.random();
                t += -(1.0f64 - u).ln() / rate;
                if t >= end {
                    break;
                }
                out.push(t);
            }
        }
        out
    }
}

/// The median of `xs` (mean of the middle two for an even count; 0 when empty).
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Which rows of an Azure file make the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AzurePick {
    /// Every function's counts summed.
    Sum,
    /// The function with this `HashFunction`.
    Function(String),
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The CSV layer failed (I/O, a row of the wrong length).
    #[error("reading the trace: {0}")]
    Csv(#[from] csv::Error),
    /// The header is not the Azure Functions 2019 one.
    #[error("not an Azure Functions invocation-count header: {0}")]
    Header(String),
    /// A count is not a non-negative integer.
    #[error("line {line}, minute {minute}: {value:?} is not a non-negative integer count")]
    Count {
        /// 1-based line.
        line: u64,
        /// Minute column.
        minute: usize,
        /// What was there.
        value: String,
    },
    /// No row matched the pick.
    #[error("no function {0:?} in the trace")]
    NoSuchFunction(String),
}

const AZURE_KEYS: [&str; 4] = ["HashOwner", "HashApp", "HashFunction", "Trigger"];

/// Reads an Azure Functions 2019 invocation-count CSV (module docs) into a per-minute rate.
pub fn read_azure(input: impl Read, pick: &AzurePick) -> Result<RateTrace, TraceError> {
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(false)
        .from_reader(input);
    let header = rdr.headers()?.clone();
    for (i, key) in AZURE_KEYS.iter().enumerate() {
        match header.get(i) {
            Some(h) if h.trim().eq_ignore_ascii_case(key) => {}
            other => {
                return Err(TraceError::Header(format!(
                    "column {} is {other:?}, expected {key:?}",
                    i + 1
                )));
            }
        }
    }
    let minutes = header.len() - AZURE_KEYS.len();
    if minutes == 0 {
        return Err(TraceError::Header("no minute columns".into()));
    }
    for (i, h) in header.iter().skip(AZURE_KEYS.len()).enumerate() {
        if h.trim() != (i + 1).to_string() {
            return Err(TraceError::Header(format!(
                "minute column {} is named {h:?}, expected \"{}\"",
                i + 1,
                i + 1
            )));
        }
    }
    let mut counts = vec![0u64; minutes];
    let mut matched = false;
    for row in rdr.records() {
        let row = row?;
        let line = row.position().map(|p| p.line()).unwrap_or(0);
        if let AzurePick::Function(f) = pick
            && row.get(2).map(str::trim) != Some(f.as_str())
        {
            continue;
        }
        matched = true;
        for (m, v) in row.iter().skip(AZURE_KEYS.len()).enumerate() {
            let n: u64 = v.trim().parse().map_err(|_| TraceError::Count {
                line,
                minute: m + 1,
                value: v.to_string(),
            })?;
            counts[m] = counts[m].saturating_add(n);
        }
    }
    if let AzurePick::Function(f) = pick
        && !matched
    {
        return Err(TraceError::NoSuchFunction(f.clone()));
    }
    Ok(RateTrace {
        step_s: 60.0,
        rps: counts.into_iter().map(|c| c as f64 / 60.0).collect(),
    })
}

/// The shape of a generated trace.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TraceShape {
    /// Median requests/s.
    pub median_rps: f64,
    /// Highest rate over the median.
    pub peak_to_median: f64,
    /// Bursts per hour.
    pub bursts_per_hour: f64,
    /// Seconds a burst takes to decay to 1/e.
    pub burst_decay_s: f64,
    /// Standard deviation of the log-rate wander.
    pub wander_sigma: f64,
}

impl TraceShape {
    /// The thesis' Twitter trace: median 57 requests/s, peak-to-median 4.68 (§3.1).
    pub fn twitter() -> Self {
        Self {
            median_rps: 57.0,
            peak_to_median: 4.68,
            bursts_per_hour: 6.0,
            burst_decay_s: 60.0,
            wander_sigma: 0.25,
        }
    }

    /// The thesis' Azure trace: median 18 requests/s, peak-to-median 2.54 (§3.1).
    pub fn azure() -> Self {
        Self {
            median_rps: 18.0,
            peak_to_median: 2.54,
            bursts_per_hour: 3.0,
            burst_decay_s: 150.0,
            wander_sigma: 0.2,
        }
    }
}

/// A per-second rate of `seconds` seconds with `shape`'s median and peak-to-median exactly
/// (module docs), seeded.
pub fn generate(shape: &TraceShape, seconds: usize, seed: u64) -> RateTrace {
    let n = seconds.max(1);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut normal = || {
        // Box–Muller; 1 - u is in (0, 1].
        let (u, v): (f64, f64) = (rng.random(), rng.random());
        (-2.0 * (1.0 - u).ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    };
    // Log-rate wander: AR(1) with a two-minute memory.
    let phi: f64 = (-1.0f64 / 120.0).exp();
    let sd = shape.wander_sigma * (1.0 - phi * phi).sqrt();
    let mut x = 0.0;
    let mut raw: Vec<f64> = (0..n)
        .map(|_| {
            x = phi * x + sd * normal();
            x.exp()
        })
        .collect();
    // Bursts: start uniformly, rise over 10 s, decay exponentially.
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let bursts = ((shape.bursts_per_hour * n as f64 / 3600.0).round() as usize).max(1);
    for _ in 0..bursts {
        let at = rng.random_range(0..n);
        let height: f64 = 1.0 + 3.0 * rng.random::<f64>();
        for (i, r) in raw.iter_mut().enumerate().skip(at) {
            let t = (i - at) as f64;
            let g = if t < 10.0 {
                t / 10.0
            } else {
                (-(t - 10.0) / shape.burst_decay_s.max(1.0)).exp()
            };
            if g < 1e-3 && t > 10.0 {
                break;
            }
            *r += height * g;
        }
    }
    let m = median(&raw);
    for r in &mut raw {
        *r /= m;
    }
    // The values above the upper middle one (the median is the mean of the two middle
    // values for an even count) are stretched so the highest lands on the target; the
    // middle values, hence the median, stay.
    let mut sorted = raw.clone();
    sorted.sort_by(f64::total_cmp);
    let upper_mid = sorted[sorted.len() / 2];
    let peak = sorted.last().copied().unwrap_or(1.0);
    let target = shape.peak_to_median.max(upper_mid);
    if peak > upper_mid && target > upper_mid {
        let gamma = (target / upper_mid).ln() / (peak / upper_mid).ln();
        for r in raw.iter_mut().filter(|r| **r > upper_mid) {
            *r = upper_mid * (*r / upper_mid).powf(gamma);
        }
    }
    RateTrace {
        step_s: 1.0,
        rps: raw.into_iter().map(|r| r * shape.median_rps).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs()
    }

    #[test]
    fn generated_rates_have_the_thesis_statistics() {
        for (shape, seed) in [(TraceShape::twitter(), 1), (TraceShape::azure(), 7)] {
            let t = generate(&shape, 3600, seed);
            assert_eq!(t.rps.len(), 3600);
            assert!(close(t.median(), shape.median_rps, 1e-9), "{}", t.median());
            assert!(
                close(t.peak_to_median(), shape.peak_to_median, 1e-9),
                "{}",
                t.peak_to_median()
            );
            assert!(t.rps.iter().all(|r| *r > 0.0));
        }
    }

    #[test]
    fn arrivals_follow_the_rate_within_tolerance() {
        // Poisson arrivals of the generated rate, counted per minute (per-second counts at
        // 18/s are too noisy to say anything: a Poisson(46) peak second reads 55), against
        // the rate averaged per minute the same way: medians within 5%, peak-to-median
        // ratios within 10%, and the total within 1% of the rate's integral.
        for (shape, seed) in [(TraceShape::twitter(), 3), (TraceShape::azure(), 4)] {
            let t = generate(&shape, 3600, seed);
            let arrivals = t.arrivals(seed + 100);
            let mut counted = vec![0.0; 60];
            for a in &arrivals {
                counted[((*a / 60.0) as usize).min(59)] += 1.0 / 60.0;
            }
            let expected: Vec<f64> = t
                .rps
                .chunks(60)
                .map(|m| m.iter().sum::<f64>() / 60.0)
                .collect();
            let ratio = |xs: &[f64]| xs.iter().copied().fold(0.0, f64::max) / median(xs);
            assert!(close(median(&counted), median(&expected), 0.05));
            assert!(close(ratio(&counted), ratio(&expected), 0.10));
            let total: f64 = t.rps.iter().sum();
            assert!(close(arrivals.len() as f64, total, 0.01));
            assert!(arrivals.windows(2).all(|w| w[0] <= w[1]));
            assert!(arrivals.iter().all(|a| (0.0..3600.0).contains(a)));
        }
    }

    #[test]
    fn generation_is_reproducible_and_seeded() {
        let s = TraceShape::twitter();
        assert_eq!(generate(&s, 600, 42), generate(&s, 600, 42));
        assert_ne!(generate(&s, 600, 42), generate(&s, 600, 43));
        let t = generate(&s, 600, 42);
        assert_eq!(t.arrivals(1), t.arrivals(1));
    }

    const FIXTURE: &str = include_str!("../../tests/data/azure_functions_2019_sample.csv");

    #[test]
    fn the_azure_reader_sums_or_picks_a_function() {
        let all = read_azure(FIXTURE.as_bytes(), &AzurePick::Sum).unwrap();
        assert_eq!(all.step_s, 60.0);
        assert_eq!(all.rps.len(), 10);
        // Minute 1: 120 + 0 + 60 invocations = 180 in 60 s.
        assert!(close(all.rps[0], 3.0, 1e-12));
        let one = read_azure(
            FIXTURE.as_bytes(),
            &AzurePick::Function("f3c1d2".to_string()),
        )
        .unwrap();
        assert!(close(one.rps[0], 2.0, 1e-12));
        assert!(matches!(
            read_azure(FIXTURE.as_bytes(), &AzurePick::Function("nope".into())),
            Err(TraceError::NoSuchFunction(_))
        ));
    }

    #[test]
    fn the_azure_reader_refuses_malformed_files() {
        let bad_header = "Owner,HashApp,HashFunction,Trigger,1\na,b,c,http,1\n";
        assert!(matches!(
            read_azure(bad_header.as_bytes(), &AzurePick::Sum),
            Err(TraceError::Header(_))
        ));
        let gap = "HashOwner,HashApp,HashFunction,Trigger,1,3\na,b,c,http,1,2\n";
        assert!(matches!(
            read_azure(gap.as_bytes(), &AzurePick::Sum),
            Err(TraceError::Header(_))
        ));
        let negative = "HashOwner,HashApp,HashFunction,Trigger,1,2\na,b,c,http,1,-2\n";
        assert!(matches!(
            read_azure(negative.as_bytes(), &AzurePick::Sum),
            Err(TraceError::Count {
                line: 2,
                minute: 2,
                ..
            })
        ));
        let short = "HashOwner,HashApp,HashFunction,Trigger,1,2\na,b,c,http,1\n";
        assert!(matches!(
            read_azure(short.as_bytes(), &AzurePick::Sum),
            Err(TraceError::Csv(_))
        ));
        let none = "HashOwner,HashApp,HashFunction,Trigger\n";
        assert!(read_azure(none.as_bytes(), &AzurePick::Sum).is_err());
    }
}
