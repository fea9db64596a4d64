//! deploy/grafana/shardcast.json: the metric names every PromQL expression (and template
//! query) of the dashboard reads, and the check that each is exported: called by
//! `controller::metrics_after_a_prewarm_match_what_happened` with the `/metrics` of every
//! transferd and of the controller after a prewarm and an eviction.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::{deploy, read};

/// Series the dashboard queries that a prewarm and an eviction leave declared (`# TYPE`)
/// but without a sample, each with what makes it appear.
const ONLY_AFTER: &[(&str, &str)] = &[(
    "shardcast_autoscaler_decisions_total",
    "the first autoscaler decision, tier eviction or receiver loss (one child per event kind that happened, none before)",
)];

/// PromQL words that are not metric names.
const KEYWORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
];

/// The metric names `expr` selects: identifiers outside label matchers, ranges and
/// strings that are neither functions (followed by `(`), operators nor the labels of a
/// `by (…)`-like clause.
pub(crate) fn metric_names(expr: &str) -> Result<BTreeSet<String>, String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    let mut labels_next = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                let end = chars[i + 1..]
                    .iter()
                    .position(|&x| x == c)
                    .ok_or_else(|| format!("unclosed string in {expr:?}"))?;
                i += end + 2;
            }
            '{' | '[' => {
                // Label matchers and ranges, with the strings inside them.
                let close = if c == '{' { '}' } else { ']' };
                let mut quote = None;
                let mut j = i + 1;
                loop {
                    let x = *chars
                        .get(j)
                        .ok_or_else(|| format!("unclosed {c} in {expr:?}"))?;
                    match quote {
                        Some(q) if x == q => quote = None,
                        Some(_) => {}
                        None if x == '"' || x == '\'' => quote = Some(x),
                        None if x == close => break,
                        None => {}
                    }
                    j += 1;
                }
                i = j + 1;
            }
            '(' if labels_next => {
                let end = chars[i..]
                    .iter()
                    .position(|&x| x == ')')
                    .ok_or_else(|| format!("unclosed ( in {expr:?}"))?;
                i += end + 1;
                labels_next = false;
            }
            c if c.is_ascii_digit() || c == '.' => {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let next = chars[i..].iter().find(|c| !c.is_whitespace());
                if matches!(
                    word.as_str(),
                    "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
                ) {
                    labels_next = true;
                } else if next != Some(&'(') && !KEYWORDS.contains(&word.as_str()) {
                    names.insert(word);
                }
            }
            _ => i += 1,
        }
    }
    Ok(names)
}

/// Every expression the dashboard evaluates: panel targets (rows' nested panels too) and
/// template-variable queries (`label_values(metric, label)`).
fn expressions(dashboard: &Value) -> Vec<String> {
    fn panels(v: &Value, out: &mut Vec<String>) {
        for p in v.as_array().into_iter().flatten() {
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(e) = t["expr"].as_str() {
                    out.push(e.to_string());
                }
            }
            panels(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    panels(&dashboard["panels"], &mut out);
    for var in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let q = var["query"]["query"].as_str().or(var["query"].as_str());
        if var["type"] == "query"
            && let Some(q) = q
        {
            // label_values(metric, label): the metric is a selector; the label is not.
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|r| r.strip_suffix(')'))
                .and_then(|r| r.rsplit_once(','))
                .map_or(q, |(m, _)| m);
            out.push(inner.to_string());
        }
    }
    out
}

fn dashboard() -> Value {
    serde_json::from_str(&read(&deploy("grafana/shardcast.json"))).expect("the dashboard's JSON")
}

/// Every metric name the dashboard reads.
pub(crate) fn queried() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for e in expressions(&dashboard()) {
        names.extend(metric_names(&e).unwrap_or_else(|err| panic!("{err}")));
    }
    names
}

/// A `/metrics` text's sample names and declared families (`# TYPE name type`).
#[derive(Default)]
struct Exposition {
    samples: BTreeSet<String>,
    types: BTreeMap<String, String>,
}

impl Exposition {
    fn add(&mut self, text: &str) {
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                if let Some((name, kind)) = rest.split_once(' ') {
                    self.types.insert(name.to_string(), kind.trim().to_string());
                }
            } else if !line.starts_with('#') && !line.trim().is_empty() {
                let end = line.find(['{', ' ']).unwrap_or(line.len());
                self.samples.insert(line[..end].to_string());
            }
        }
    }

    /// The family `name` belongs to, if declared: itself, or a histogram's `_bucket`,
    /// `_sum` or `_count`, or a counter declared without its `_total`.
    fn declared(&self, name: &str) -> bool {
        self.types.contains_key(name)
            || ["_bucket", "_sum", "_count"].iter().any(|s| {
                name.strip_suffix(s)
                    .is_some_and(|b| self.types.get(b).is_some_and(|t| t == "histogram"))
            })
            || name
                .strip_suffix("_total")
                .is_some_and(|b| self.types.get(b).is_some_and(|t| t == "counter"))
    }
}

/// Asserts that every series the dashboard queries is in `scrapes` (the `/metrics` of the
/// daemons after a prewarm and an eviction): with a sample, or declared and listed in
/// [`ONLY_AFTER`] with what makes it appear.
pub(crate) fn assert_exported(scrapes: &[String]) {
    let mut exp = Exposition::default();
    for s in scrapes {
        exp.add(s);
    }
    let queried = queried();
    let mut problems = Vec::new();
    for name in &queried {
        let listed = ONLY_AFTER.iter().find(|(n, _)| n == name);
        match (exp.samples.contains(name), exp.declared(name), listed) {
            (true, _, None) => {}
            (true, _, Some(_)) => problems.push(format!(
                "{name} has a sample after a prewarm: take it off ONLY_AFTER"
            )),
            (false, true, Some((_, why))) => {
                println!("dashboard: {name} is declared, with a sample only after {why}")
            }
            (false, true, None) => problems.push(format!(
                "{name} is declared but has no sample after a prewarm: list it in ONLY_AFTER with the event that makes it appear"
            )),
            (false, false, _) => problems.push(format!("{name} is not exported by either daemon")),
        }
    }
    for (name, _) in ONLY_AFTER {
        if !queried.contains(*name) {
            problems.push(format!(
                "ONLY_AFTER lists {name}, which the dashboard does not query"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "deploy/grafana/shardcast.json:\n  {}",
        problems.join("\n  ")
    );
    println!(
        "dashboard: all {} series it queries are exported",
        queried.len()
    );
}

#[test]
fn promql_metric_names_are_found_and_nothing_else() {
    let names = |e: &str| metric_names(e).unwrap();
    assert_eq!(
        names(
            r#"histogram_quantile(0.9, sum by (le, method) (rate(a_seconds_bucket{x="rate(b)"}[$__rate_interval])))"#
        ),
        BTreeSet::from(["a_seconds_bucket".to_string()])
    );
    assert_eq!(
        names("sum without (host) (x_total) / on (job) group_left (zone) y offset 5m * 60"),
        BTreeSet::from(["x_total".to_string(), "y".to_string()])
    );
    assert_eq!(
        names("max(up) or vector(0)"),
        BTreeSet::from(["up".to_string()])
    );
    assert!(metric_names(r#"rate(x{a="b}[5m])"#).is_err());

    let mut exp = Exposition::default();
    exp.add("# TYPE a_seconds histogram\na_seconds_bucket{le=\"1\"} 0\n# TYPE b_total counter\n# TYPE c gauge\nc 1\n");
    assert!(exp.samples.contains("a_seconds_bucket") && exp.samples.contains("c"));
    assert!(exp.declared("a_seconds_count") && exp.declared("b_total"));
    assert!(!exp.declared("a_seconds_total") && !exp.declared("d"));
}

#[test]
fn the_dashboard_covers_the_operators_questions_with_shardcast_series() {
    let d = dashboard();
    // A Prometheus datasource variable, used by every panel and target.
    let vars = d["templating"]["list"]
        .as_array()
        .expect("template variables");
    assert!(
        vars.iter().any(|v| v["type"] == "datasource"
            && v["query"] == "prometheus"
            && v["name"] == "datasource"),
        "no Prometheus datasource variable"
    );
    let mut titles = Vec::new();
    let mut stack: Vec<&Value> = d["panels"].as_array().unwrap().iter().collect();
    while let Some(p) = stack.pop() {
        stack.extend(p["panels"].as_array().into_iter().flatten());
        if p["type"] == "row" {
            continue;
        }
        titles.push(p["title"].as_str().unwrap_or_default().to_lowercase());
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{}: no query", p["title"]);
    }
    for topic in [
        "bytes moved",
        "hop throughput",
        "time to ready",
        "stalls",
        "verification",
        "gpu loads",
        "evictions",
        "autoscaler",
        "api latency",
        "fail-overs",
    ] {
        assert!(
            titles.iter().any(|t| t.contains(topic)),
            "no panel on {topic}: {titles:?}"
        );
    }
    let names = queried();
    assert!(names.len() > 20, "{names:?}");
    for n in &names {
        assert!(n.starts_with("shardcast_"), "{n}: not a shardcast series");
    }
}
