//! A burst measured on a real or emulated cluster, replayed in the simulator: the
//! parameters `cold-start --emulate` writes into its report ([`BurstParams`]), the
//! simulated burst they make ([`BurstParams::cold_start`]), and the comparison of the two
//! runs' per-host ready times ([`Agreement`]), which `simulate --emulated REPORT` prints and
//! the validation test holds within 10 %.
//!
//! What the emulated cluster is, in the simulator's terms (`crate::netns`,
//! `crate::managed::EmulatedCluster`):
//!
//! * **One switch.** Every host's veth hangs off one bridge: one leaf holding every host,
//!   whose uplink nothing crosses but the origin's traffic. The origin server runs in a
//!   namespace of its own behind a link capped like the hosts', and its rate limiter caps
//!   the payload of all its responses together: the cluster's origin link is the smaller of
//!   the two, and no per-stream cap.
//! * **Goodput, not the cap.** `tc`'s `tbf` counts link-layer bytes: a full TCP segment
//!   carries 1,448 payload bytes (1,500 MTU less 20 IP, 20 TCP and 12 of timestamps) in a
//!   1,514-byte frame ([`TCP_PAYLOAD_PER_FRAME`]). A chain hop also pays TLS 1.3's 22 bytes
//!   per 16 KiB record (header, tag, content type: [`TLS_PAYLOAD_PER_RECORD`]) and the
//!   frame's 17-byte prefix per chunk. The simulated links carry what a chain hop moves.
//! * **The model's shards.** transferd runs one session per shard, so a chain's hop lag is
//!   counted per shard ([`super::dc::pipeline_lag`]): the simulated model has the measured
//!   manifest's shard sizes and chunk size.
//! * **Tier memory.** `cold-start` prewarms the memory tier: a host is ready when its copy
//!   is complete, so no load or GPU phase is simulated.
//!
//! What is not modelled: the controller's and the daemons' own latencies (planning, the
//! agent calls, TLS handshakes down the chain, status pushes to the controller, the
//! caller's 50 ms poll), TCP's slow start and the hosts' CPU. The validation test says how
//! much they weigh.

use std::time::Duration;

use shardcast_placement::Tier;

use super::coldstart::{ColdStart, ColdStartRow, Method};
use super::dc::{DcConfig, PROGRESS_PERIOD};
use super::models::{Phases, SimModel};
use super::net::Topology;

/// TCP payload bytes in a full 1,514-byte Ethernet frame at a 1,500-byte MTU with
/// timestamps: 1,448 / 1,514.
pub const TCP_PAYLOAD_PER_FRAME: f64 = 1448.0 / 1514.0;

/// Plaintext per TLS 1.3 record on the wire: 16,384 / (16,384 + 5 header + 16 tag + 1
/// content type).
pub const TLS_PAYLOAD_PER_RECORD: f64 = 16384.0 / 16406.0;

/// The wire frame's prefix before a chunk's payload (`shardcast_protocol::frame`), bytes.
pub const CHUNK_FRAME_PREFIX: f64 = 17.0;

/// What a burst on a real or emulated cluster was, as the simulator needs it: written by
/// `cold-start --emulate` into its report (`sim_params`), read by `simulate --emulated`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BurstParams {
    /// Hosts, all under one switch; every one receives the model.
    pub hosts: usize,
    /// The model's registry name.
    pub model: String,
    /// Its shards' sizes in manifest order, bytes.
    pub shard_bytes: Vec<u64>,
    /// Manifest chunk size, bytes.
    pub chunk_size: u32,
    /// Each host link's cap, bytes/s each way (link-layer bytes, as `tc` counts them).
    pub host_link_cap_bps: f64,
    /// The origin's cap on all its responses together, payload bytes/s.
    pub origin_bps: f64,
    /// The origin's own link is capped like a host's (the emulated cluster's origin runs in a
    /// namespace of its own).
    pub origin_behind_host_link: bool,
    /// Chunks travel over TLS (transferd's default data mode).
    pub tls: bool,
    /// Chunks a head reads from the origin at once (the daemons' `origin_parallel`).
    pub origin_parallel: u32,
}

/// The name the replayed model is registered under in the simulator (the measured one's
/// may be any valid name; only its bytes and shards matter here).
pub const REPLAYED_MODEL: &str = "measured-burst";

impl BurstParams {
    /// Payload bytes/s a chain hop moves over one host link: the cap less Ethernet, IP and
    /// TCP headers, TLS records and the chunk frame's prefix (module docs).
    pub fn hop_goodput_bps(&self) -> f64 {
        let chunk = f64::from(self.chunk_size);
        let tls = if self.tls {
            TLS_PAYLOAD_PER_RECORD
        } else {
            1.0
        };
        self.host_link_cap_bps * TCP_PAYLOAD_PER_FRAME * tls * chunk / (chunk + CHUNK_FRAME_PREFIX)
    }

    /// Payload bytes/s the origin serves to the whole cluster.
    pub fn origin_goodput_bps(&self) -> f64 {
        if self.origin_behind_host_link {
            self.origin_bps
                .min(self.host_link_cap_bps * TCP_PAYLOAD_PER_FRAME)
        } else {
            self.origin_bps
        }
    }

    /// The model, with the measured shards.
    pub fn model(&self) -> SimModel {
        SimModel {
            name: REPLAYED_MODEL,
            label: "measured",
            params: "-",
            bytes: self.shard_bytes.iter().sum(),
            layers: 1,
            shards: Some(self.shard_bytes.clone()),
        }
    }

    /// The simulated burst: one leaf of `hosts`, links at the hop goodput, the origin's
    /// goodput as the cluster's origin link, a prewarm of tier memory on every host.
    pub fn cold_start(&self) -> ColdStart {
        let link = self.hop_goodput_bps();
        ColdStart {
            dc: DcConfig {
                topology: Topology {
                    hosts: self.hosts,
                    hosts_per_leaf: self.hosts.max(1),
                    host_link_bps: link,
                    // One bridge: the "uplink" carries only the origin's traffic, which
                    // its own link caps already.
                    leaf_uplink_bps: link * self.hosts.max(1) as f64,
                    origin_link_bps: Some(self.origin_goodput_bps()),
                    origin_stream_bps: None,
                },
                // Tier memory: no GPU is asked for; these only size the hosts.
                gpus_per_host: 1,
                gpu_memory: 24 << 30,
                host_memory: 200 << 30,
                phases: Phases::flashpoint(),
                chunk_size: self.chunk_size,
                hop_cap_bps: None,
                progress_period: PROGRESS_PERIOD,
                origin_parallel: self.origin_parallel,
            },
            model: self.model(),
            replicas: self.hosts as u32,
            warm: 0,
            tier: Tier::Memory,
            heartbeat: Duration::from_secs(1),
            // The controller's default tick, as the emulated controller runs it.
            poll: Duration::from_millis(250),
            limit: Duration::from_secs(86_400),
        }
    }
}

/// The method a `cold-start` method name is in the simulator: `origin-pull` the baseline,
/// `shardcast` the controller's plan.
pub fn method_of(emulated: &str) -> Option<Method> {
    match emulated {
        "origin-pull" => Some(Method::Baseline),
        "shardcast" => Some(Method::Chain),
        _ => None,
    }
}

/// How a measured burst's per-host ready times and a simulated one's agree: the hosts
/// compared rank by rank (fastest with fastest), since which host is which hop is the
/// controller's choice on each side.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Agreement {
    /// The measured ready times, sorted, seconds after the prewarm.
    pub measured_s: Vec<f64>,
    /// The simulated ones, sorted.
    pub simulated_s: Vec<f64>,
    /// Mean of each.
    pub measured_mean_s: f64,
    /// Mean of the simulated.
    pub simulated_mean_s: f64,
    /// `simulated / measured - 1` of the means.
    pub mean_error: f64,
    /// `simulated / measured - 1` of the slowest host.
    pub max_error: f64,
    /// The largest `|simulated / measured - 1|` of any rank.
    pub worst_rank_error: f64,
}

impl Agreement {
    /// Compares `measured` with the simulated `row`'s per-host ready times. `None` when the
    /// two do not have the same number of ready hosts (or none).
    pub fn of(measured: &[f64], row: &ColdStartRow) -> Option<Self> {
        let mut m = measured.to_vec();
        let mut s: Vec<f64> = row.hosts.iter().filter_map(|h| h.ready_s).collect();
        if m.is_empty() || m.len() != s.len() {
            return None;
        }
        m.sort_by(f64::total_cmp);
        s.sort_by(f64::total_cmp);
        let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
        let err = |sim: f64, real: f64| sim / real - 1.0;
        let (mm, sm) = (mean(&m), mean(&s));
        let worst = m
            .iter()
            .zip(&s)
            .map(|(a, b)| err(*b, *a).abs())
            .fold(0.0, f64::max);
        let max_error = err(s[s.len() - 1], m[m.len() - 1]);
        Some(Self {
            measured_mean_s: mm,
            simulated_mean_s: sm,
            mean_error: err(sm, mm),
            max_error,
            worst_rank_error: worst,
            measured_s: m,
            simulated_s: s,
        })
    }
}

/// One method of a measured burst next to its replay in the simulator.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Replayed {
    /// The measured method (`origin-pull`, `shardcast`).
    pub method: String,
    /// The simulated burst.
    pub simulated: ColdStartRow,
    /// How the two agree.
    pub agreement: Agreement,
}

/// Replays every method of a `cold-start --emulate` report in the simulator, with the
/// report's own parameters, on a paused runtime per method (call it from a thread that is
/// not running a runtime).
pub fn replay(report: &crate::managed::ColdStartReport) -> anyhow::Result<Vec<Replayed>> {
    let spec = report.sim_params.cold_start();
    let mut out = Vec::new();
    for r in &report.results {
        let method = method_of(&r.method)
            .ok_or_else(|| anyhow::anyhow!("no simulated method for {:?}", r.method))?;
        let simulated = super::coldstart::run(&spec, method)?;
        let agreement = Agreement::of(&r.per_host_s, &simulated).ok_or_else(|| {
            anyhow::anyhow!(
                "{}: {} hosts measured, {} ready in the simulator",
                r.method,
                r.per_host_s.len(),
                simulated.ready
            )
        })?;
        out.push(Replayed {
            method: r.method.clone(),
            simulated,
            agreement,
        });
    }
    Ok(out)
}

/// The replays as a text table: per method the measured and simulated mean and slowest
/// host, and the errors.
pub fn table(replays: &[Replayed]) -> String {
    let mut out = format!(
        "{:<12} {:>10} {:>10} {:>8} {:>10} {:>10} {:>8} {:>11}\n",
        "method", "mean emu", "mean sim", "err", "max emu", "max sim", "err", "worst rank"
    );
    for r in replays {
        let a = &r.agreement;
        let last = |xs: &[f64]| xs.last().copied().unwrap_or(0.0);
        out.push_str(&format!(
            "{:<12} {:>9.2}s {:>9.2}s {:>+7.1}% {:>9.2}s {:>9.2}s {:>+7.1}% {:>10.1}%\n",
            r.method,
            a.measured_mean_s,
            a.simulated_mean_s,
            a.mean_error * 100.0,
            last(&a.measured_s),
            last(&a.simulated_s),
            a.max_error * 100.0,
            a.worst_rank_error * 100.0
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::coldstart;

    fn params() -> BurstParams {
        BurstParams {
            hosts: 8,
            model: "synthetic/llm".into(),
            shard_bytes: vec![16 << 20, 16 << 20, 16 << 20, 16 << 20, 2_000],
            chunk_size: 1 << 20,
            host_link_cap_bps: 200e6 / 8.0,
            origin_bps: 400e6 / 8.0,
            origin_behind_host_link: true,
            tls: true,
            origin_parallel: 8,
        }
    }

    #[test]
    fn goodput_takes_off_headers_records_and_frames() {
        let p = params();
        let want = 25e6 * 1448.0 / 1514.0 * 16384.0 / 16406.0 * 1048576.0 / 1048593.0;
        assert!((p.hop_goodput_bps() - want).abs() < 1e-6);
        // The origin (400 Mbit/s) sits behind a 200 Mbit/s link: TCP's goodput of it.
        assert!((p.origin_goodput_bps() - 25e6 * 1448.0 / 1514.0).abs() < 1e-6);
    }

    #[test]
    fn a_replayed_chain_runs_at_the_hop_goodput_with_the_heads_fill_lag() {
        // One chain (8 <= max_chain_len) at the hop goodput (the origin's link is faster
        // than a hop's): the head holds the model at S / rate, hop j >= 1 at
        // (S + (j + 7) * chunk) / rate (8 parallel origin reads at the head).
        let p = params();
        let row = coldstart::run(&p.cold_start(), Method::Chain).unwrap();
        assert_eq!((row.ready, row.chains), (8, 1));
        let rate = p.hop_goodput_bps();
        let bytes: f64 = p.shard_bytes.iter().map(|&b| b as f64).sum();
        let mut ready: Vec<f64> = row.hosts.iter().map(|h| h.ready_s.unwrap()).collect();
        ready.sort_by(f64::total_cmp);
        for (j, t) in ready.iter().enumerate() {
            let lag = if j == 0 { 0.0 } else { j as f64 + 7.0 };
            let want = (bytes + lag * f64::from(p.chunk_size)) / rate;
            assert!((t - want).abs() < 1e-6, "hop {j}: {t} vs {want}");
        }
        // Against itself, the comparison is exact.
        let a = Agreement::of(&ready, &row).unwrap();
        assert_eq!(
            (a.mean_error, a.max_error, a.worst_rank_error),
            (0.0, 0.0, 0.0)
        );
    }

    #[test]
    fn a_replayed_baseline_shares_the_origin_eight_ways() {
        let p = params();
        let row = coldstart::run(&p.cold_start(), Method::Baseline).unwrap();
        let bytes: f64 = p.shard_bytes.iter().map(|&b| b as f64).sum();
        let want = 8.0 * bytes / p.origin_goodput_bps();
        for h in &row.hosts {
            assert!((h.ready_s.unwrap() - want).abs() < 1e-3, "{h:?} vs {want}");
        }
        // A measured run 5 % slower on every host: the errors say so.
        let measured: Vec<f64> = row
            .hosts
            .iter()
            .map(|h| h.ready_s.unwrap() * 1.05)
            .collect();
        let a = Agreement::of(&measured, &row).unwrap();
        assert!((a.mean_error - (1.0 / 1.05 - 1.0)).abs() < 1e-9);
        assert!((a.worst_rank_error - (1.0 - 1.0 / 1.05)).abs() < 1e-9);
        assert!(Agreement::of(&measured[1..], &row).is_none());
    }
}
