//! `simulate --replay-faults REPORT`: an emulated fault run (`faults --emulate --json`)
//! replayed in the simulator with the same parameters, and the two compared: the healthy
//! hosts' ready time against the no-fault run, and the bytes read from the origin (× the
//! model), per fault and chain position.
//!
//! The emulated report records the hosts, the model's bytes, the link rate and when the
//! fault came; the simulated burst is [`BurstParams::cold_start`] of those (one switch,
//! TLS goodput, one shard — `faults --emulate`'s default —, the origin at the link rate —
//! its default `--origin-rate` equals `--rate`, and the report does not record it —, tier
//! memory), and the fault is the same one at the same position: `link-down` is the
//! simulator's `link-down@POS:AT+8s` (`faults --emulate` keeps the port down 8 s). The
//! other emulated faults (a kill restarted 3 s later, a stop, corruption) have no
//! simulated counterpart and are listed as skipped.

use serde::Deserialize;

use super::coldstart::Method;
use super::faults::{self, FaultKind, FaultReport, FaultSpec, Target};
use super::params::{BurstParams, REPLAYED_MODEL};

/// How long `faults --emulate` keeps a `link-down` victim's port down, seconds.
pub const EMULATED_LINK_DOWN_S: f64 = 8.0;

/// The fields of a `faults --emulate` report this replay reads.
#[derive(Debug, Clone, Deserialize)]
pub struct EmulatedFaults {
    /// Hosts in the chain.
    pub hosts: usize,
    /// The model's bytes.
    pub bytes: u64,
    /// Each host link's rate, bits/s.
    pub rate_bits_per_s: u64,
    /// When the fault came, seconds after the prewarm.
    pub at_s: f64,
    /// The trials.
    pub results: Vec<EmulatedTrial>,
}

/// One emulated trial.
#[derive(Debug, Clone, Deserialize)]
pub struct EmulatedTrial {
    /// The fault's name (`link-down`, `kill`, ...).
    pub fault: String,
    /// head, middle or tail.
    #[serde(default)]
    pub position: Option<String>,
    /// Healthy hosts' ready time ÷ the no-fault one.
    #[serde(default)]
    pub ratio: Option<f64>,
    /// Bytes the origin served.
    #[serde(default)]
    pub origin_bytes: Option<u64>,
}

/// One fault × position, measured and simulated.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FaultReplay {
    /// The emulated fault.
    pub fault: String,
    /// The position.
    pub position: String,
    /// Healthy hosts ready, × no fault, per emulated trial.
    pub measured_ratio: Vec<f64>,
    /// Origin bytes × the model, per emulated trial.
    pub measured_origin_x_model: Vec<f64>,
    /// The simulator's run (`None`: no simulated counterpart).
    pub simulated: Option<FaultReport>,
}

/// The simulated burst of an emulated fault report.
pub fn burst_params(e: &EmulatedFaults) -> BurstParams {
    let link = e.rate_bits_per_s as f64 / 8.0;
    BurstParams {
        hosts: e.hosts,
        model: REPLAYED_MODEL.to_string(),
        shard_bytes: vec![e.bytes],
        chunk_size: shardcast_protocol::manifest::DEFAULT_CHUNK_SIZE,
        host_link_cap_bps: link,
        origin_bps: link,
        origin_behind_host_link: true,
        tls: true,
        origin_parallel: super::dc::ORIGIN_PARALLEL,
    }
}

/// Replays every fault × position of `e` (module docs).
pub fn replay(e: &EmulatedFaults) -> anyhow::Result<Vec<FaultReplay>> {
    anyhow::ensure!(
        e.hosts >= 2 && e.bytes > 0 && e.rate_bits_per_s > 0,
        "the report's hosts, bytes and rate must be positive (and at least 2 hosts)"
    );
    anyhow::ensure!(
        e.at_s.is_finite() && e.at_s >= 0.0,
        "the report's at_s is not a time"
    );
    let spec = burst_params(e).cold_start();
    let mut keys: Vec<(String, String)> = Vec::new();
    for t in &e.results {
        let key = (t.fault.clone(), t.position.clone().unwrap_or_default());
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    let mut out = Vec::new();
    for (fault, position) in keys {
        let trials: Vec<&EmulatedTrial> = e
            .results
            .iter()
            .filter(|t| t.fault == fault && t.position.as_deref().unwrap_or("") == position)
            .collect();
        let target = match position.as_str() {
            "head" => Some(Target::Head),
            "middle" => Some(Target::Middle),
            "tail" => Some(Target::Tail),
            _ => None,
        };
        let simulated = match (fault.as_str(), target) {
            ("link-down", Some(target)) => {
                let f = FaultSpec {
                    kind: FaultKind::LinkDown,
                    target,
                    at_s: e.at_s,
                    for_s: Some(EMULATED_LINK_DOWN_S),
                };
                Some(faults::run(&spec, Method::Chain, &[f], 0)?)
            }
            _ => None,
        };
        out.push(FaultReplay {
            measured_ratio: trials.iter().filter_map(|t| t.ratio).collect(),
            measured_origin_x_model: trials
                .iter()
                .filter_map(|t| t.origin_bytes)
                .map(|b| b as f64 / e.bytes as f64)
                .collect(),
            fault,
            position,
            simulated,
        });
    }
    Ok(out)
}

/// The replays side by side.
pub fn table(replays: &[FaultReplay]) -> String {
    let list = |xs: &[f64]| {
        xs.iter()
            .map(|x| format!("{x:.3}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut out = format!(
        "{:<10} {:<7} {:>22} {:>10} {:>22} {:>10}\n",
        "fault", "where", "emulated ready x", "sim x", "emulated origin x", "sim x"
    );
    for r in replays {
        let (ratio, origin) = match &r.simulated {
            Some(s) => (
                s.healthy_ratio
                    .map_or("-".to_string(), |x| format!("{x:.3}")),
                format!("{:.3}", s.with_faults.origin_x_model),
            ),
            None => ("skipped".to_string(), "skipped".to_string()),
        };
        out.push_str(&format!(
            "{:<10} {:<7} {:>22} {:>10} {:>22} {:>10}\n",
            r.fault,
            r.position,
            list(&r.measured_ratio),
            ratio,
            list(&r.measured_origin_x_model),
            origin
        ));
    }
    out
}
