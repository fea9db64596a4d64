//! Load from a Prometheus endpoint: instead of (or as well as) the FaaS calling
//! `ReportLoad`, the controller scrapes a metrics endpoint every `interval` and feeds each
//! model's figures to the autoscaler exactly as a `ReportLoad` would.
//!
//! The endpoint serves the Prometheus text exposition format. Three gauges per model,
//! labelled `model="<name or digest>"` (and optionally `tier="memory|disk|gpu"`):
//!
//! ```text
//! shardcast_model_arrival_rate{model="org/m"} 30     # requests/s (λ)
//! shardcast_model_queue_length{model="org/m"} 4      # requests waiting
//! shardcast_model_service_rate{model="org/m"} 10     # requests/s one replica serves (μ)
//! ```
//!
//! With TLS configured, an `https://` endpoint is reached with the controller's own
//! certificate and must present one of the cluster CA (transferd's admin listener serves
//! `/metrics` that way to the `controller` role).
//!
//! The metric names are configurable. A model missing its arrival or service rate is
//! skipped; one the controller does not know is logged once. An unreachable endpoint is
//! logged once per outage, never fatal.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::events::Event;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::error::{LoadError, LookupError};
use crate::ops::ReportLoad;

/// Where scraped load goes: the autoscaler, as a `ReportLoad` would.
pub trait LoadSink: Send + Sync + 'static {
    /// One model's load.
    fn report_load(&self, req: ReportLoad)
    -> impl Future<Output = Result<Event, LoadError>> + Send;
}

/// Scrape settings.
#[derive(Debug, Clone)]
pub struct ScrapeConfig {
    /// `http(s)://host:port/metrics`.
    pub url: String,
    /// How often.
    pub interval: Duration,
    /// Gauge of arrivals per second.
    pub arrival_metric: String,
    /// Gauge of queued requests.
    pub queue_metric: String,
    /// Gauge of requests per second one replica serves.
    pub service_metric: String,
    /// Tier when the series has no `tier` label.
    pub tier: String,
}

impl ScrapeConfig {
    /// Defaults for `url`.
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_string(),
            interval: Duration::from_secs(5),
            arrival_metric: "shardcast_model_arrival_rate".into(),
            queue_metric: "shardcast_model_queue_length".into(),
            service_metric: "shardcast_model_service_rate".into(),
            tier: "memory".into(),
        }
    }
}

/// One sample: metric name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name.
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Value.
    pub value: f64,
}

/// Parses the Prometheus text exposition format. Comment and blank lines are skipped;
/// a malformed line is an error naming its number (nothing from a bad page is used).
pub fn parse_text(text: &str) -> Result<Vec<Sample>, String> {
    let mut out = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |why: &str| format!("line {}: {why}: {raw:?}", n + 1);
        let (name, rest) = match line.find(['{', ' ', '\t']) {
            Some(i) => line.split_at(i),
            None => return Err(bad("no value")),
        };
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        {
            return Err(bad("bad metric name"));
        }
        let mut labels = BTreeMap::new();
        let rest = if let Some(body) = rest.strip_prefix('{') {
            let mut chars = body.char_indices().peekable();
            let mut end = None;
            loop {
                // key
                while chars
                    .peek()
                    .is_some_and(|(_, c)| *c == ',' || c.is_whitespace())
                {
                    chars.next();
                }
                match chars.peek() {
                    Some((i, '}')) => {
                        end = Some(*i);
                        break;
                    }
                    None => break,
                    _ => {}
                }
                let mut key = String::new();
                while let Some((_, c)) = chars.peek().copied() {
                    if c == '=' {
                        break;
                    }
                    key.push(c);
                    chars.next();
                }
                if chars.next().map(|(_, c)| c) != Some('=')
                    || chars.next().map(|(_, c)| c) != Some('"')
                {
                    return Err(bad("bad label"));
                }
                let mut value = String::new();
                loop {
                    match chars.next() {
                        Some((_, '\\')) => match chars.next() {
                            Some((_, 'n')) => value.push('\n'),
                            Some((_, c)) => value.push(c),
                            None => return Err(bad("unterminated label value")),
                        },
                        Some((_, '"')) => break,
                        Some((_, c)) => value.push(c),
                        None => return Err(bad("unterminated label value")),
                    }
                }
                labels.insert(key.trim().to_string(), value);
            }
            let Some(end) = end else {
                return Err(bad("unterminated labels"));
            };
            &body[end + 1..]
        } else {
            rest
        };
        let value = rest
            .split_whitespace()
            .next()
            .ok_or_else(|| bad("no value"))?;
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse::<f64>().map_err(|_| bad("bad value"))?,
        };
        out.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    Ok(out)
}

/// The `ReportLoad`s a page of samples describes, one per (model, tier) with both rates.
pub fn reports(samples: &[Sample], cfg: &ScrapeConfig) -> Vec<ReportLoad> {
    /// λ, queue, μ as far as seen.
    type Figures = (Option<f64>, Option<f64>, Option<f64>);
    let mut by: BTreeMap<(String, String), Figures> = BTreeMap::new();
    for s in samples {
        let Some(model) = s.labels.get("model") else {
            continue;
        };
        let tier = s
            .labels
            .get("tier")
            .cloned()
            .unwrap_or_else(|| cfg.tier.clone());
        let e = by.entry((model.clone(), tier)).or_default();
        if s.name == cfg.arrival_metric {
            e.0 = Some(s.value);
        } else if s.name == cfg.queue_metric {
            e.1 = Some(s.value);
        } else if s.name == cfg.service_metric {
            e.2 = Some(s.value);
        }
    }
    by.into_iter()
        .filter_map(|((model, tier), (lambda, queue, mu))| {
            Some(ReportLoad {
                model,
                arrival_rate: lambda?,
                queue_len: queue.filter(|q| q.is_finite() && *q >= 0.0).unwrap_or(0.0) as u32,
                service_rate: mu?,
                // A `tier` label that names no tier: the series is not a load report.
                tier: tier.parse().ok()?,
            })
        })
        .collect()
}

/// The scraper's HTTP client. With TLS, `https://` endpoints are reached with the
/// controller's certificate (the `controller` role may read metrics, e.g. a transferd's
/// admin listener) and must present a certificate of the cluster CA.
fn scrape_client(
    cfg: &ScrapeConfig,
    tls: Option<&shardcast_identity::TlsContext>,
) -> reqwest::Result<reqwest::Client> {
    let mut b = reqwest::Client::builder().timeout(cfg.interval.max(Duration::from_secs(1)));
    if let Some(ctx) = tls {
        b = b.tls_backend_preconfigured((*ctx.http_client_config()).clone());
    }
    b.build()
}

/// Scrapes `cfg.url` every `cfg.interval` until `cancel`, feeding `sink`. With `tls`,
/// `https://` endpoints are reached with the controller's certificate.
pub async fn run<S: LoadSink>(
    cfg: ScrapeConfig,
    tls: Option<Arc<shardcast_identity::TlsContext>>,
    sink: Arc<S>,
    cancel: CancellationToken,
) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut reloads = tls.as_ref().map(|t| t.watch_reloads());
    let mut client = match scrape_client(&cfg, tls.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            warn!("load scraping disabled: cannot build an HTTP client: {e}");
            return;
        }
    };
    info!(url = %cfg.url, interval = ?cfg.interval, "scraping load");
    let mut tick = tokio::time::interval(cfg.interval);
    let mut failing = false;
    let mut unknown: HashSet<String> = HashSet::new();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        // A rotated certificate: present the new one from now on.
        if let Some(r) = reloads.as_mut()
            && r.has_changed().unwrap_or(false)
        {
            r.mark_unchanged();
            match scrape_client(&cfg, tls.as_deref()) {
                Ok(c) => client = c,
                Err(e) => warn!("keeping the previous scrape client: {e}"),
            }
        }
        let page = async {
            let r = client
                .get(&cfg.url)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if !r.status().is_success() {
                return Err(format!("HTTP {}", r.status()));
            }
            let text = r.text().await.map_err(|e| e.to_string())?;
            parse_text(&text)
        }
        .await;
        let samples = match page {
            Ok(s) => {
                if failing {
                    info!(url = %cfg.url, "load endpoint is back");
                    failing = false;
                }
                s
            }
            Err(e) => {
                if !failing {
                    warn!(url = %cfg.url, "scraping load failed (logged once until it works again): {e}");
                    failing = true;
                }
                continue;
            }
        };
        for req in reports(&samples, &cfg) {
            let model = req.model.clone();
            match sink.report_load(req).await {
                Ok(_) => {}
                Err(e @ LoadError::Lookup(LookupError::UnknownModel(_))) => {
                    if unknown.insert(model.clone()) {
                        warn!(
                            model,
                            "scraped load for a model the controller does not know: {e}"
                        );
                    }
                }
                Err(e) => warn!(model, "scraped load refused: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_text_parses_with_labels_escapes_and_comments() {
        let text = "# HELP x y\n# TYPE shardcast_model_arrival_rate gauge\n\
            shardcast_model_arrival_rate{model=\"org/m\",tier=\"gpu\"} 30\n\
            shardcast_model_queue_length{model=\"org/m\", tier=\"gpu\"} 4 1700000000000\n\
            shardcast_model_service_rate{model=\"org/m\",tier=\"gpu\"} 1e1\n\
            other_metric 5\n\
            shardcast_model_arrival_rate{model=\"a\\\"b\"} +Inf\n";
        let s = parse_text(text).unwrap();
        assert_eq!(s.len(), 5);
        assert_eq!(s[1].labels["tier"], "gpu");
        assert_eq!(s[4].labels["model"], "a\"b");
        let cfg = ScrapeConfig::new("http://x/metrics");
        let r = reports(&s, &cfg);
        // `a"b` has no service rate: skipped.
        assert_eq!(r.len(), 1);
        assert_eq!(
            (
                r[0].model.as_str(),
                r[0].arrival_rate,
                r[0].queue_len,
                r[0].service_rate,
                r[0].tier.as_str()
            ),
            ("org/m", 30.0, 4, 10.0, "gpu")
        );
    }

    #[test]
    fn malformed_pages_are_errors_with_the_line() {
        for bad in [
            "x{model=\"a\" 1\n",
            "x{model=a} 1\n",
            "x 1 2\nbad-name 1\n",
            "x\n",
            "x abc\n",
        ] {
            let e = parse_text(bad).unwrap_err();
            assert!(e.contains("line"), "{bad:?}: {e}");
        }
    }
}
