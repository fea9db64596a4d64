//! Benchmark scenarios: `demo` (the README's main command) and `chain` (emulated or
//! loopback chain vs star). Each method runs on a fresh set of daemons so no method
//! benefits from another's copies.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use shardcast_protocol::agent::{Chain, ImportModelRequest, StartChainRequest, Tier as PbTier};
use shardcast_protocol::codec::decode_exact;
use shardcast_protocol::units::format_bytes;
use shardcast_protocol::{HopTransport, Manifest};
use tokio_util::sync::CancellationToken;

use crate::cluster::{Daemon, DaemonOpts, wait_complete, wait_complete_timed};
use crate::netns::EmulatedNet;
use crate::origin_server::{self, OriginStats};
use crate::synth::{self, SynthSpec};

/// Name the synthetic model is registered under.
pub const MODEL_NAME: &str = "synthetic/llm";

/// How daemons are connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetMode {
    /// Processes on 127.0.0.1, caps (if any) by transferd's own token buckets.
    Local,
    /// One network namespace per host, `tc` caps on every host's egress and ingress.
    Emulate,
}

/// A distribution method to compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// One chain through every receiver, headed by the source.
    ChainTcp,
    /// The same chain with its hops dialling each other over QUIC.
    ChainQuic,
    /// Every receiver pulls from the single source at once (one 1-hop chain each).
    Star,
}

impl Method {
    /// The name used in flags and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::ChainTcp => "chain-tcp",
            Self::ChainQuic => "chain-quic",
            Self::Star => "star",
        }
    }

    /// How the method's hops dial each other.
    pub fn transport(self) -> HopTransport {
        match self {
            Self::ChainQuic => HopTransport::Quic,
            Self::ChainTcp | Self::Star => HopTransport::Tcp,
        }
    }
}

impl std::str::FromStr for Method {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "chain-tcp" | "chain" => Ok(Self::ChainTcp),
            "chain-quic" => Ok(Self::ChainQuic),
            "star" => Ok(Self::Star),
            other => Err(format!(
                "unknown method {other:?}; expected chain-tcp, chain-quic or star"
            )),
        }
    }
}

/// Options of the `chain` benchmark.
#[derive(Debug, Clone)]
pub struct ChainBenchOpts {
    /// Loopback or emulated.
    pub mode: NetMode,
    /// Receivers (the source is one more host).
    pub receivers: usize,
    /// Model size in bytes.
    pub size: u64,
    /// Shards the model is split into.
    pub shards: usize,
    /// Link rate in bytes/s (emulated mode; ignored on loopback).
    pub rate: Option<u64>,
    /// Methods to run, in order.
    pub methods: Vec<Method>,
    /// Per-method time limit.
    pub timeout: Duration,
    /// Chunk size of the manifest (0 = transferd's default).
    pub chunk_size: u32,
    /// In-flight chunks per hop (0 = transferd's default).
    pub window: usize,
    /// Run the daemons without TLS (`insecure_plaintext`; loopback only), as the baseline
    /// the TLS hop is compared with.
    pub plaintext: bool,
    /// Extra transferd arguments for the source only (e.g. `--reverify-after-ms 0`).
    pub source_args: Vec<String>,
    /// Extra transferd arguments for every daemon (e.g. `--data-mode authenticate-only`).
    pub daemon_args: Vec<String>,
    /// Record one transferd (the source's, or the first receiver's) with `perf record -g`
    /// for the whole transfer into this file (loopback only; `perf` must be installed and
    /// allowed to attach).
    pub perf: Option<(Side, PathBuf)>,
    /// Random loss on every host's egress, in packets per 10 000 (emulated mode; 0: none).
    pub loss_per_10000: u32,
    /// MTU of every emulated link (emulated mode; `None`: 1500). QUIC daemons are told the
    /// matching UDP payload size (`--quic-path-mtu`, the MTU less 28 bytes of IPv4 and UDP
    /// headers); TCP finds its segment size from the link itself. On loopback, whose MTU is
    /// 65536 already, only the QUIC daemons' packet size changes.
    pub mtu: Option<u32>,
    /// TCP congestion control of every emulated host (`None`: the machine's).
    pub tcp_congestion: Option<String>,
    /// Run the first method once before the measured runs and report only its time
    /// (`warm_up_s`): the first transfer after daemons of an earlier run left pays for
    /// memory the VM's guest has not touched lately, which would count against the first
    /// method only (on the 2-vCPU VM measured: TCP 11–12 s instead of 6.3–8.8 s).
    pub warm_up: bool,
    /// Show progress bars.
    pub progress: bool,
    /// The memory reserve each daemon keeps (`--memory-reserve`), filled before the
    /// transfer starts.
    pub memory_reserve: BenchReserve,
}

/// The memory reserve the bench's daemons keep (transferd's `memory_reserve`: spare files
/// of allocated pages that new shards are written into), filled before each measured
/// transfer: the hosts of a cold start that were idle before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub enum BenchReserve {
    /// No reserve: every received page is allocated as it is written.
    #[default]
    Off,
    /// One spare per shard of the model, each the size of its largest shard.
    Auto,
    /// This many bytes, in spares the size of the model's largest shard.
    Bytes(u64),
}

impl std::str::FromStr for BenchReserve {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "off" | "0" => Ok(Self::Off),
            other => shardcast_protocol::units::parse_size(other)
                .map(|b| if b == 0 { Self::Off } else { Self::Bytes(b) })
                .map_err(|e| format!("--memory-reserve: auto, off or a size such as 4GiB ({e})")),
        }
    }
}

impl BenchReserve {
    /// transferd's flags for a model whose files have `sizes` bytes: spares the size of the
    /// largest, as many as the files that would take one (at least half a spare), or the
    /// bytes given.
    pub fn daemon_args(self, sizes: &[u64]) -> Vec<String> {
        let spare = sizes.iter().copied().max().unwrap_or(0).max(1 << 20);
        let bytes = match self {
            Self::Off => return Vec::new(),
            Self::Auto => spare * sizes.iter().filter(|&&s| s * 2 >= spare).count() as u64,
            Self::Bytes(b) => b,
        };
        vec![
            "--memory-reserve".into(),
            bytes.to_string(),
            "--memory-reserve-spare".into(),
            spare.to_string(),
        ]
    }
}

/// How long the bench waits for its daemons' memory reserves to fill.
const RESERVE_FILL_TIMEOUT: Duration = Duration::from_secs(120);

/// Waits until every daemon's memory reserve holds its target (or
/// [`RESERVE_FILL_TIMEOUT`] passed: then says so and goes on); returns what each held.
async fn wait_reserves(daemons: &[Daemon]) -> anyhow::Result<Vec<u64>> {
    let deadline = Instant::now() + RESERVE_FILL_TIMEOUT;
    loop {
        let mut held = Vec::new();
        let mut short = None;
        for d in daemons {
            let st = d.stats().await?;
            if st.memory_reserve_bytes < st.memory_reserve_target {
                short = Some((
                    d.host_id.clone(),
                    st.memory_reserve_bytes,
                    st.memory_reserve_target,
                ));
            }
            held.push(st.memory_reserve_bytes);
        }
        match short {
            None => return Ok(held),
            Some((host, h, t)) if Instant::now() >= deadline => {
                eprintln!(
                    "warning: {host}'s memory reserve holds {h} of {t} bytes after {RESERVE_FILL_TIMEOUT:?}; measuring anyway"
                );
                return Ok(held);
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

impl ChainBenchOpts {
    /// `methods` moving `size` bytes in one shard to `receivers` hosts over `mode`, with
    /// transferd's defaults for everything else: TLS, the default chunk size and window, no
    /// loss, standard frames, no warm-up, no profile, no progress bars, 600 s per method.
    /// Callers change what they measure with struct update syntax.
    pub fn new(mode: NetMode, receivers: usize, size: u64, methods: Vec<Method>) -> Self {
        Self {
            mode,
            receivers,
            size,
            shards: 1,
            rate: None,
            methods,
            timeout: Duration::from_secs(600),
            chunk_size: 0,
            window: 0,
            plaintext: false,
            source_args: Vec::new(),
            daemon_args: Vec::new(),
            perf: None,
            loss_per_10000: 0,
            mtu: None,
            tcp_congestion: None,
            warm_up: false,
            progress: false,
            memory_reserve: BenchReserve::Off,
        }
    }
}

/// One method's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct MethodResult {
    /// Method name.
    pub method: String,
    /// Seconds from the start of the transfer until the last receiver held a verified copy.
    pub completion_s: f64,
    /// Each receiver's completion time in seconds, in chain order.
    pub per_receiver_s: Vec<f64>,
    /// When each receiver first held verified bytes, in seconds, in chain order: a chain's
    /// per-hop lag is the step from one to the next (to within one polling round).
    #[serde(default)]
    pub per_receiver_first_s: Vec<f64>,
    /// When each receiver held half the model verified, in seconds, in chain order: half the
    /// model over (completion − this) is that receiver's steady rate.
    #[serde(default)]
    pub per_receiver_half_s: Vec<f64>,
    /// Every receiver's copy matched the origin byte for byte.
    pub verified: bool,
    /// Average CPU utilisation of the whole machine during the transfer (0..1).
    pub cpu_util: f64,
    /// CPU seconds (user + system) the source's transferd spent during the transfer.
    pub source_cpu_s: f64,
    /// CPU seconds each receiver's transferd spent during the transfer, in chain order.
    pub receiver_cpu_s: Vec<f64>,
    /// The source's CPU seconds per GB of the model (one copy sent: the first hop's).
    pub source_cpu_s_per_gb: f64,
    /// Each receiver's CPU seconds per GB of the model it received, in chain order.
    pub receiver_cpu_s_per_gb: Vec<f64>,
    /// The source's CPU time during the transfer, user and system apart.
    pub source_cpu: ProcCpu,
    /// Each receiver's CPU time during the transfer, user and system apart.
    pub receiver_cpu: Vec<ProcCpu>,
    /// Bytes the source re-hashed on the serve path during the transfer.
    pub source_bytes_reverified: u64,
    /// Bytes each receiver re-hashed before forwarding them (chunks that sat longer than
    /// `reverify_after` between arriving and leaving), in chain order.
    #[serde(default)]
    pub receiver_bytes_reverified: Vec<u64>,
    /// Bytes each receiver wrote into its store by copying into the shard's writable map
    /// rather than `pwrite` (the adaptive writer, while another write held the shard's
    /// lock), in chain order.
    #[serde(default)]
    pub receiver_bytes_written_mapped: Vec<u64>,
    /// Bytes each daemon's memory reserve held when the transfer started, source first.
    #[serde(default)]
    pub memory_reserve_bytes: Vec<u64>,
    /// Bytes of the model each receiver wrote into spares of its memory reserve (pages
    /// allocated before the transfer), in chain order.
    #[serde(default)]
    pub receiver_reserve_taken_bytes: Vec<u64>,
    /// Packets the emulated loss dropped, all hosts together (0 without a loss).
    pub packets_dropped: u64,
    /// Times a forwarder gave up on the hop below it (dead, refusing, or silent for the
    /// stall timeout, setting up or sending), all hosts together: 0 in a healthy run.
    #[serde(default)]
    pub hop_failovers: u64,
    /// What quinn counted on every daemon's QUIC connections (chain-quic only).
    pub quic: Option<QuicFigures>,
}

/// quinn's connection statistics summed over every daemon of a run (their `/metrics`).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct QuicFigures {
    /// UDP datagrams received.
    pub rx_datagrams: u64,
    /// UDP datagrams sent.
    pub tx_datagrams: u64,
    /// Average UDP payload per datagram sent, bytes.
    pub tx_bytes_per_datagram: f64,
    /// Datagrams per send call (above 1: GSO worked).
    pub tx_datagrams_per_call: f64,
    /// Packets declared lost.
    pub lost_packets: u64,
    /// Congestion events (window cuts).
    pub congestion_events: u64,
    /// The largest UDP payload MTU discovery reached on any connection, bytes.
    pub max_path_mtu: u64,
}

/// [`QuicFigures`] summed over `daemons`' metrics.
async fn quic_figures(daemons: &[Daemon]) -> anyhow::Result<QuicFigures> {
    let (mut rx, mut tx, mut tx_ios, mut tx_bytes) = (0, 0, 0, 0);
    let mut f = QuicFigures::default();
    for d in daemons {
        let text = d.metrics().await?;
        let v = |name| crate::cluster::metric_value(&text, &d.host_id, name).unwrap_or(0);
        rx += v("quic_rx_datagrams_total");
        tx += v("quic_tx_datagrams_total");
        tx_ios += v("quic_tx_ios_total");
        tx_bytes += v("quic_tx_bytes_total");
        f.lost_packets += v("quic_lost_packets_total");
        f.congestion_events += v("quic_congestion_events_total");
        f.max_path_mtu = f.max_path_mtu.max(v("quic_max_path_mtu_bytes"));
    }
    f.rx_datagrams = rx;
    f.tx_datagrams = tx;
    f.tx_bytes_per_datagram = tx_bytes as f64 / tx.max(1) as f64;
    f.tx_datagrams_per_call = tx as f64 / tx_ios.max(1) as f64;
    Ok(f)
}

/// The `chain` benchmark's JSON report.
#[derive(Debug, Clone, Serialize)]
pub struct ChainReport {
    /// Receivers.
    pub receivers: usize,
    /// Model bytes.
    pub bytes: u64,
    /// Link rate in bits/s (0 = uncapped).
    pub rate_bits_per_s: u64,
    /// bytes·8 / rate: the time one link needs for the model (0 when uncapped).
    pub ideal_s: f64,
    /// "emulate" or "local".
    pub mode: String,
    /// Random loss on every host's egress, in percent (0: none).
    pub loss_percent: f64,
    /// MTU of the links (emulated mode; loopback's own otherwise, reported as 1500).
    pub mtu: u32,
    /// TCP congestion control the emulated hosts used (the machine's when not set).
    #[serde(default)]
    pub tcp_congestion: String,
    /// Time of the warm-up run of the first method, not counted (`None`: none ran).
    pub warm_up_s: Option<f64>,
    /// Extra transferd arguments every daemon ran with (`--data-mode …`; empty: defaults).
    pub daemon_args: Vec<String>,
    /// The memory reserve the daemons kept (filled before each run).
    pub memory_reserve: BenchReserve,
    /// The machine's page cache when the bench started.
    pub page_cache: PageCache,
    /// The machine it ran on.
    pub machine: Machine,
    /// Per-method results.
    pub results: Vec<MethodResult>,
}

/// The machine's page cache when a benchmark started: on the 2-vCPU VM a cache of 15–16 GB
/// (after builds and a CI run) made the emulated cluster's daemons spend up to twice the
/// CPU per GB, mostly in the kernel, while the tmpfs pages of their stores were found
/// (docs/BENCHMARKS.md, issue #28). `--drop-caches` drops it first.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PageCache {
    /// Whether the bench dropped it before starting (`--drop-caches`).
    pub dropped: bool,
    /// `Cached` of `/proc/meminfo` at the start (after the drop), bytes; 0 where unknown.
    pub cached_bytes: u64,
}

impl PageCache {
    /// Reads `/proc/meminfo`, after dropping the page cache first with `drop` (`sync`,
    /// then `3` into `/proc/sys/vm/drop_caches`: needs root).
    pub fn at_start(drop: bool) -> anyhow::Result<Self> {
        if drop {
            rustix::fs::sync();
            std::fs::write("/proc/sys/vm/drop_caches", "3\n")
                .context("--drop-caches: writing /proc/sys/vm/drop_caches (needs root)")?;
        }
        use procfs_core::FromRead;
        let cached_bytes = procfs_core::Meminfo::from_file("/proc/meminfo").map_or(0, |m| m.cached);
        Ok(Self {
            dropped: drop,
            cached_bytes,
        })
    }
}

/// What the machine a benchmark ran on is, as far as it changes the figures: reports of
/// different sessions ran on different VMs of the same name. One of them lacked AVX-512
/// (BLAKE3 runs its AVX2 path, half as wide) and gave freed memory back to its host (a
/// virtio balloon with free page reporting), so every page a process touched for the
/// first time cost a fault on the host too: the same build's hop took twice the CPU per GB
/// there (docs/BENCHMARKS.md, issue #28, thirteenth session).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Machine {
    /// `model name` of `/proc/cpuinfo`.
    pub cpu_model: String,
    /// Cores the bench may use.
    pub cores: usize,
    /// The widest x86 vector extension BLAKE3 can use here: `avx512`, `avx2`, `sse4.1`,
    /// or `none` (not x86).
    pub simd: String,
    /// Whether a virtio balloon reports freed pages to the host (`None`: no balloon).
    pub free_page_reporting: Option<bool>,
    /// Fresh anonymous memory touched once per 4 KiB page (256 MiB), GB/s: the price of a
    /// first touch, which free page reporting makes high.
    pub first_touch_gb_s: f64,
    /// The file system the daemons' memory tiers are on (the scratch directory's: `/dev/shm`
    /// or `SHARDCAST_BENCH_SCRATCH`), as transferd sees it at start-up; `None` where
    /// `/proc` cannot tell. A tmpfs with huge pages took a quarter to a third less CPU per
    /// GB through a TLS hop on the 2-vCPU VM.
    pub memory_tier: Option<transferd::store::TierFs>,
}

impl Machine {
    /// Looks at this machine (about a quarter of a second, for the first-touch rate).
    pub fn describe() -> Self {
        use procfs_core::FromRead;
        let cpu_model = procfs_core::CpuInfo::from_file("/proc/cpuinfo")
            .ok()
            .and_then(|c| c.model_name(0).map(str::to_owned))
            .unwrap_or_default();
        Self {
            cpu_model,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            simd: simd().into(),
            free_page_reporting: free_page_reporting(),
            first_touch_gb_s: first_touch_rate(256 << 20),
            memory_tier: transferd::store::TierFs::of(&scratch_base()),
        }
    }
}

fn simd() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512vl") {
            return "avx512";
        }
        if std::is_x86_feature_detected!("avx2") {
            return "avx2";
        }
        if std::is_x86_feature_detected!("sse4.1") {
            return "sse4.1";
        }
    }
    "none"
}

/// Bit 5 of a virtio balloon's features (`VIRTIO_BALLOON_F_REPORTING`, the virtio spec
/// 5.5.3): freed guest pages are reported to the host, which may take them back.
fn free_page_reporting() -> Option<bool> {
    let dir = std::fs::read_dir("/sys/bus/virtio/drivers/virtio_balloon").ok()?;
    dir.flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("virtio"))
        .find_map(|e| std::fs::read_to_string(e.path().join("features")).ok())
        .map(|bits| reports_free_pages(&bits))
}

/// Whether a virtio device's `features` (one `0`/`1` a bit, bit 0 first) has bit 5 set.
fn reports_free_pages(features: &str) -> bool {
    features.trim().as_bytes().get(5) == Some(&b'1')
}

/// GB/s at which `len` bytes of fresh anonymous memory are touched, one write a page.
fn first_touch_rate(len: usize) -> f64 {
    let mut v = vec![0u8; len];
    let t = std::time::Instant::now();
    for i in (0..len).step_by(4096) {
        v[i] = 1;
    }
    std::hint::black_box(&mut v);
    len as f64 / 1e9 / t.elapsed().as_secs_f64().max(1e-9)
}

/// The page cache (dropped first with `drop_caches`) and the machine, read before a
/// benchmark starts, for its report.
pub fn at_start(drop_caches: bool) -> anyhow::Result<(PageCache, Machine)> {
    let page_cache = PageCache::at_start(drop_caches)?;
    Ok((page_cache, Machine::describe()))
}

/// Where [`scratch_dir`] makes its directories: `SHARDCAST_BENCH_SCRATCH`, else `/dev/shm`
/// where there is one, else `/tmp`.
pub fn scratch_base() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("SHARDCAST_BENCH_SCRATCH") {
        return dir.into();
    }
    let shm = Path::new("/dev/shm");
    if shm.is_dir() { shm } else { Path::new("/tmp") }.to_path_buf()
}

/// A scratch directory, on tmpfs when there is one (the memory tier is meant to be tmpfs).
///
/// `SHARDCAST_BENCH_SCRATCH` puts it on another tmpfs (one mounted with huge pages, say);
/// `SHARDCAST_BENCH_KEEP=1` keeps it after the run (the daemons' logs and stores, to read a
/// run's timeline), and its path is printed on stderr.
pub fn scratch_dir(label: &str) -> anyhow::Result<tempfile::TempDir> {
    let keep = std::env::var_os("SHARDCAST_BENCH_KEEP").is_some_and(|v| v == "1");
    let dir = tempfile::Builder::new()
        .prefix(&format!("shardcast-{label}-"))
        .disable_cleanup(keep)
        .tempdir_in(scratch_base())
        .context("creating a scratch directory")?;
    if keep {
        eprintln!("keeping {} (SHARDCAST_BENCH_KEEP=1)", dir.path().display());
    }
    Ok(dir)
}

/// Machine-wide CPU time counters from /proc/stat: (busy, total) jiffies.
fn cpu_sample() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().next()?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let idle = v.get(3)? + v.get(4).unwrap_or(&0);
    let total: u64 = v.iter().sum();
    Some((total - idle, total))
}

/// CPU seconds a process has used, user and system apart.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ProcCpu {
    /// Seconds in user mode (utime).
    pub user_s: f64,
    /// Seconds in the kernel on the process's behalf (stime): syscalls, the TCP stack,
    /// page-cache copies, page faults.
    pub system_s: f64,
}

impl ProcCpu {
    /// User + system.
    pub fn total_s(&self) -> f64 {
        self.user_s + self.system_s
    }

    /// These seconds per GB (10^9 bytes) of `bytes`.
    fn per_gb(&self, bytes: u64) -> Self {
        let gb = bytes as f64 / 1e9;
        Self {
            user_s: self.user_s / gb,
            system_s: self.system_s / gb,
        }
    }
}

/// CPU time process `pid` has used, from `/proc/<pid>/stat` (fields 14 and 15, utime and
/// stime, in USER_HZ ticks, which Linux fixes at 100 for every /proc interface). `None`
/// when the process is gone or the file does not parse.
pub fn process_cpu(pid: u32) -> Option<ProcCpu> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_proc_stat_cpu(&text)
}

/// Parses utime and stime out of the text of a /proc/<pid>/stat file.
fn parse_proc_stat_cpu(text: &str) -> Option<ProcCpu> {
    // The command name (field 2) may contain spaces and ')': count fields after its last ')'.
    let rest = text.get(text.rfind(')')? + 1..)?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime = f.get(11)?.parse::<u64>().ok()?;
    let stime = f.get(12)?.parse::<u64>().ok()?;
    Some(ProcCpu {
        user_s: utime as f64 / 100.0,
        system_s: stime as f64 / 100.0,
    })
}

/// CPU seconds (user + system) process `pid` has used, from `/proc/<pid>/stat`.
pub fn process_cpu_s(pid: u32) -> Option<f64> {
    process_cpu(pid).map(|c| c.total_s())
}

/// CPU time of each daemon so far (zero for one without a process).
fn daemons_cpu(daemons: &[Daemon]) -> Vec<ProcCpu> {
    daemons
        .iter()
        .map(|d| d.pid().and_then(process_cpu).unwrap_or_default())
        .collect()
}

fn cpu_util(a: Option<(u64, u64)>, b: Option<(u64, u64)>) -> f64 {
    match (a, b) {
        (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => (b1 - b0) as f64 / (t1 - t0) as f64,
        _ => 0.0,
    }
}

fn bar(enabled: bool, total: u64, label: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template(
            "{prefix:>24} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} {elapsed}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_prefix(label.to_string());
    pb
}

/// Imports the model from a `file://` origin into `source`'s memory tier (the source
/// already holds the model) and returns (digest, manifest).
async fn import_on(
    source: &Daemon,
    origin: &str,
    fetch: bool,
    chunk_size: u32,
) -> anyhow::Result<(String, Manifest)> {
    let resp = source
        .agent()
        .await?
        .import_model(ImportModelRequest {
            name: MODEL_NAME.into(),
            origin: origin.into(),
            chunk_size,
            tier: PbTier::Memory as i32,
            fetch,
            keep: false,
            manifest: vec![],
            bind_name: None,
        })
        .await
        .context("ImportModel")?
        .into_inner();
    let manifest: Manifest = decode_exact(resp.manifest.into()).context("decoding the manifest")?;
    Ok((resp.digest, manifest))
}

/// Starts one chain session on `head`.
async fn start_chain(
    head: &Daemon,
    digest: &str,
    manifest: Option<&Manifest>,
    origin: &str,
    chains: Vec<Vec<&Daemon>>,
    transport: HopTransport,
) -> anyhow::Result<String> {
    let mut req = StartChainRequest {
        session_id: String::new(),
        model: digest.into(),
        manifest: manifest
            .map(shardcast_protocol::codec::encode_to_vec)
            .unwrap_or_default(),
        origin: origin.into(),
        tier: PbTier::Memory as i32,
        chains: chains
            .into_iter()
            .map(|c| Chain {
                shards: vec![],
                hops: c.iter().map(|d| d.hop()).collect(),
            })
            .collect(),
        plan_token: Vec::new(),
        transport: shardcast_protocol::agent::Transport::from(transport) as i32,
    };
    head.sign_chain(&mut req, &[])?;
    Ok(head
        .agent()
        .await?
        .start_chain(req)
        .await
        .context("StartChain")?
        .into_inner()
        .session_id)
}

/// Generates the synthetic model under `dir`.
fn make_model(dir: &Path, size: u64, shards: usize) -> anyhow::Result<synth::SynthModel> {
    synth::generate(
        dir,
        &SynthSpec {
            total_bytes: size,
            shards,
            seed: 42,
        },
    )
}

/// Runs the `chain` benchmark.
pub async fn run_chain_bench(opts: &ChainBenchOpts) -> anyhow::Result<ChainReport> {
    if opts.receivers == 0 {
        bail!("--receivers must be at least 1");
    }
    let origin_dir = tempfile::Builder::new()
        .prefix("shardcast-origin-")
        .tempdir()
        .context("origin dir")?;
    let model = make_model(origin_dir.path(), opts.size, opts.shards)?;
    let origin_uri = format!("file://{}", origin_dir.path().display());
    let sizes: Vec<u64> = model.files.iter().map(|f| f.1).collect();
    let reserve_args = opts.memory_reserve.daemon_args(&sizes);
    let opts = &ChainBenchOpts {
        daemon_args: opts
            .daemon_args
            .iter()
            .cloned()
            .chain(reserve_args)
            .collect(),
        ..opts.clone()
    };
    let warm_up_s = match opts.methods.first() {
        Some(&first) if opts.warm_up => {
            let r = run_method(opts, first, &origin_uri, model.total_bytes)
                .await
                .with_context(|| format!("warm-up run of {}", first.name()))?;
            if opts.progress {
                eprintln!("   warm-up: {:.2} s (not counted)", r.completion_s);
            }
            Some(r.completion_s)
        }
        _ => None,
    };
    let mut results = Vec::new();
    for &method in &opts.methods {
        let r = run_method(opts, method, &origin_uri, model.total_bytes)
            .await
            .with_context(|| format!("method {}", method.name()))?;
        if opts.progress {
            eprintln!(
                "{:>10}: {:.2} s (cpu {:.0}%)",
                r.method,
                r.completion_s,
                r.cpu_util * 100.0
            );
        }
        results.push(r);
    }
    let rate = if opts.mode == NetMode::Emulate {
        opts.rate.unwrap_or(0)
    } else {
        0
    };
    Ok(ChainReport {
        page_cache: PageCache::default(),
        machine: Machine::default(),
        receivers: opts.receivers,
        bytes: model.total_bytes,
        rate_bits_per_s: rate * 8,
        ideal_s: if rate > 0 {
            model.total_bytes as f64 / rate as f64
        } else {
            0.0
        },
        mode: if opts.mode == NetMode::Emulate {
            "emulate"
        } else {
            "local"
        }
        .into(),
        loss_percent: f64::from(opts.loss_per_10000) / 100.0,
        mtu: opts.mtu.unwrap_or(1500),
        tcp_congestion: opts.tcp_congestion.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        }),
        warm_up_s,
        daemon_args: opts.daemon_args.clone(),
        memory_reserve: opts.memory_reserve,
        results,
    })
}

async fn run_method(
    opts: &ChainBenchOpts,
    method: Method,
    origin_uri: &str,
    bytes: u64,
) -> anyhow::Result<MethodResult> {
    let hosts = opts.receivers + 1;
    let net = match opts.mode {
        NetMode::Emulate => Some(EmulatedNet::create(hosts, opts.rate, None)?),
        NetMode::Local => None,
    };
    if opts.loss_per_10000 > 0 {
        let net = net
            .as_ref()
            .context("packet loss is emulated in the hosts' namespaces: it needs --emulate")?;
        crate::netns::loss_available().map_err(anyhow::Error::msg)?;
        for i in 0..hosts {
            net.set_loss(i, opts.loss_per_10000)?;
        }
    }
    // On loopback (MTU 65536) only QUIC's declared packet size changes.
    if let (Some(mtu), Some(net)) = (opts.mtu, &net) {
        net.set_mtu(mtu)?;
    }
    if let (Some(cc), Some(net)) = (&opts.tcp_congestion, &net) {
        net.set_congestion(cc)?;
    }
    let scratch = scratch_dir(method.name())?;
    let mut daemons = Vec::new();
    for i in 0..hosts {
        let name = if i == 0 {
            "source".to_string()
        } else {
            format!("recv-{i}")
        };
        let mut o = DaemonOpts::local(name.clone());
        if opts.plaintext {
            anyhow::ensure!(
                net.is_none(),
                "plaintext daemons are allowed on loopback only"
            );
            anyhow::ensure!(
                method.transport() == HopTransport::Tcp,
                "QUIC needs the daemons' TLS identity: {} cannot run in plaintext",
                method.name()
            );
            o.pki = None;
        }
        o.extra_args
            .extend(["--origin-allow".into(), origin_uri.to_string()]);
        if opts.window > 0 {
            o.extra_args
                .extend(["--window".into(), opts.window.to_string()]);
        }
        o.extra_args.extend(opts.daemon_args.iter().cloned());
        if i == 0 {
            o.extra_args.extend(opts.source_args.iter().cloned());
        }
        if let Some(mtu) = opts.mtu {
            // The UDP payload of a full frame (transferd refuses one below QUIC's minimum).
            let payload =
                mtu.saturating_sub(u32::from(transferd::transport::quic::IPV4_UDP_HEADERS));
            o.extra_args
                .extend(["--quic-path-mtu".into(), payload.to_string()]);
        }
        if let Some(net) = &net {
            o.data_ip = IpAddr::V4(net.host_ip(i));
            o.netns = Some(net.ns_name(i).to_string());
            // Its TCP listeners are inside the namespace: the admin endpoint (`/metrics`)
            // on a Unix socket instead, reachable from here.
            o.admin_socket = Some(scratch.path().join(&name).join("admin.sock"));
        }
        daemons.push(Daemon::start(&scratch.path().join(&name), o).await?);
    }
    let (digest, manifest) = import_on(&daemons[0], origin_uri, true, opts.chunk_size).await?;
    let receivers: Vec<&Daemon> = daemons[1..].iter().collect();
    let chains = match method {
        Method::ChainTcp | Method::ChainQuic => vec![receivers.clone()],
        Method::Star => receivers.iter().map(|d| vec![*d]).collect(),
    };
    let pb = bar(opts.progress, bytes * opts.receivers as u64, method.name());
    let reserve_held = if opts.memory_reserve == BenchReserve::Off {
        vec![0; daemons.len()]
    } else {
        wait_reserves(&daemons).await?
    };
    // Each daemon's counters before the transfer; the report gives what the run added.
    let mut before = Vec::with_capacity(daemons.len());
    for d in &daemons {
        before.push(d.stats().await?);
    }
    let perf = match &opts.perf {
        Some((side, out)) => {
            let daemon = match side {
                Side::Source => daemons.first(),
                Side::Receiver => receivers.first().copied(),
            };
            match daemon.and_then(|d| d.pid()) {
                Some(pid) => Some(PerfRecord::start(pid, out)?),
                None => None,
            }
        }
        None => None,
    };
    let cpu0 = cpu_sample();
    let proc0 = daemons_cpu(&daemons);
    let t0 = Instant::now();
    start_chain(
        &daemons[0],
        &digest,
        None,
        origin_uri,
        chains,
        method.transport(),
    )
    .await?;
    let done = wait_complete_timed(&receivers, &digest, t0, opts.timeout, |b| {
        pb.set_position(b)
    })
    .await;
    let cpu = cpu_util(cpu0, cpu_sample());
    let proc1 = daemons_cpu(&daemons);
    if let Some(perf) = perf {
        perf.stop().await?;
    }
    let done = done?;
    let split: Vec<ProcCpu> = proc1
        .iter()
        .zip(&proc0)
        .map(|(b, a)| ProcCpu {
            user_s: b.user_s - a.user_s,
            system_s: b.system_s - a.system_s,
        })
        .collect();
    let procs: Vec<f64> = split.iter().map(ProcCpu::total_s).collect();
    let gb = bytes as f64 / 1e9;
    let (mut reverified, mut mapped, mut taken) = (Vec::new(), Vec::new(), Vec::new());
    let mut hop_failovers = 0;
    for (d, b) in daemons.iter().zip(&before) {
        let st = d.stats().await?;
        reverified.push(st.bytes_reverified.saturating_sub(b.bytes_reverified));
        mapped.push(
            st.bytes_written_mapped
                .saturating_sub(b.bytes_written_mapped),
        );
        taken.push(
            st.memory_reserve_taken_bytes
                .saturating_sub(b.memory_reserve_taken_bytes),
        );
        hop_failovers += st
            .downstream_failovers
            .saturating_sub(b.downstream_failovers);
    }
    let quic = match method {
        Method::ChainQuic => Some(quic_figures(&daemons).await?),
        _ => None,
    };
    pb.finish_and_clear();
    let mut per = Vec::new();
    let mut late = Vec::new();
    for (d, t) in receivers.iter().zip(&done) {
        match t.done_s {
            Some(t) => per.push(t),
            // The run's directory goes with the daemons: what each late host logged last
            // goes into the error, so a run that failed in CI says what it waited for.
            None => late.push(format!(
                "{} did not complete within {:?}; the end of its log ({}):\n{}",
                d.host_id,
                opts.timeout,
                d.log.display(),
                crate::cluster::tail(&d.log)
            )),
        }
    }
    if !late.is_empty() {
        let source = &daemons[0];
        late.push(format!(
            "the end of the source's log ({}):\n{}",
            source.log.display(),
            crate::cluster::tail(&source.log)
        ));
        bail!("{}", late.join("\n"));
    }
    let mut packets_dropped = 0;
    if let Some(net) = &net {
        for i in 0..hosts {
            packets_dropped += net.dropped(i)?;
        }
    }
    let mut verified = true;
    for d in &receivers {
        if let Err(e) = d.verify_copy(&manifest) {
            eprintln!("verification failed: {e:#}");
            verified = false;
        }
    }
    drop(daemons);
    Ok(MethodResult {
        method: method.name().into(),
        completion_s: per.iter().copied().fold(0.0, f64::max),
        per_receiver_s: per,
        per_receiver_first_s: done.iter().map(|m| m.first_s.unwrap_or(0.0)).collect(),
        per_receiver_half_s: done.iter().map(|m| m.half_s.unwrap_or(0.0)).collect(),
        verified,
        cpu_util: cpu,
        source_cpu_s: procs[0],
        receiver_cpu_s: procs[1..].to_vec(),
        source_cpu_s_per_gb: procs[0] / gb,
        receiver_cpu_s_per_gb: procs[1..].iter().map(|s| s / gb).collect(),
        source_cpu: split[0],
        receiver_cpu: split[1..].to_vec(),
        source_bytes_reverified: reverified[0],
        receiver_bytes_reverified: reverified[1..].to_vec(),
        receiver_bytes_written_mapped: mapped[1..].to_vec(),
        memory_reserve_bytes: reserve_held,
        receiver_reserve_taken_bytes: taken[1..].to_vec(),
        packets_dropped,
        hop_failovers,
        quic,
    })
}

/// `perf record -g` attached to one process, stopped (SIGINT, by PID) when asked.
struct PerfRecord {
    child: tokio::process::Child,
}

impl PerfRecord {
    fn start(pid: u32, out: &Path) -> anyhow::Result<Self> {
        let child = tokio::process::Command::new("perf")
            .args(["record", "-g", "-F", "999", "-q", "-o"])
            .arg(out)
            .args(["-p", &pid.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting perf record (is perf installed?)")?;
        Ok(Self { child })
    }

    /// Stops recording and waits (at most 30 s) for perf to write its file.
    async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            // Our own child, by its PID (perf writes its file on SIGINT, not on SIGKILL).
            tokio::process::Command::new("kill")
                .args(["-INT", &pid.to_string()])
                .status()
                .await
                .context("sending SIGINT to perf record")?;
        }
        match tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await {
            Ok(status) => {
                status.context("waiting for perf record")?;
                Ok(())
            }
            Err(_) => bail!("perf record did not stop within 30 s of SIGINT"),
        }
    }
}

/// Options of `demo`.
#[derive(Debug, Clone)]
pub struct DemoOpts {
    /// Model size.
    pub size: u64,
    /// Shards.
    pub shards: usize,
    /// Receivers.
    pub receivers: usize,
    /// Per-daemon (and origin) rate cap in bytes/s.
    pub rate: Option<u64>,
    /// Show progress bars.
    pub progress: bool,
}

/// One row of the demo's table.
#[derive(Debug, Clone, Serialize)]
pub struct DemoRow {
    /// Method.
    pub method: String,
    /// Per-host completion times in seconds.
    pub per_host_s: Vec<(String, f64)>,
    /// Bytes the origin served during this method.
    pub origin_bytes: u64,
}

/// Runs the demo: a local cluster on loopback, a synthetic model, and three ways to get it
/// onto every receiver. Returns the table rows.
pub async fn run_demo(opts: &DemoOpts) -> anyhow::Result<Vec<DemoRow>> {
    let origin_dir = tempfile::Builder::new()
        .prefix("shardcast-origin-")
        .tempdir()
        .context("origin dir")?;
    eprintln!(
        "generating a {} synthetic model ({} safetensors shards) in {}",
        format_bytes(opts.size),
        opts.shards,
        origin_dir.path().display()
    );
    let model = make_model(origin_dir.path(), opts.size, opts.shards)?;
    // The origin stands in for cloud storage: one HTTP endpoint whose total egress is capped.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let origin_url = format!("http://{}/", listener.local_addr()?);
    let stats = Arc::new(OriginStats::default());
    let cancel = CancellationToken::new();
    let server = tokio::spawn(origin_server::serve(
        origin_dir.path().to_path_buf(),
        listener,
        opts.rate,
        stats.clone(),
        cancel.clone(),
    ));
    let file_uri = format!("file://{}", origin_dir.path().display());
    let rate_flag = opts
        .rate
        .map(|r| format!("{}B/s", r))
        .unwrap_or_else(|| "unlimited".into());
    let mut rows = Vec::new();
    for method in ["origin-pull", "chain-from-peer", "chain-from-origin"] {
        let scratch = scratch_dir(method)?;
        let mut daemons = Vec::new();
        for i in 0..=opts.receivers {
            let name = if i == 0 {
                "source".to_string()
            } else {
                format!("recv-{i}")
            };
            let mut o = DaemonOpts::local(name.clone());
            o.egress_rate = rate_flag.clone();
            o.ingress_rate = rate_flag.clone();
            o.extra_args
                .extend(["--origin-allow".into(), format!("{file_uri},{origin_url}")]);
            daemons.push(Daemon::start(&scratch.path().join(&name), o).await?);
        }
        // The source already holds the model (imported from local files, not timed).
        let (digest, manifest) = import_on(&daemons[0], &file_uri, true, 0).await?;
        let receivers: Vec<&Daemon> = daemons[1..].iter().collect();
        let before = stats.bytes_sent.load(Ordering::Relaxed);
        let pb = bar(
            opts.progress,
            model.total_bytes * opts.receivers as u64,
            method,
        );
        let t0 = Instant::now();
        match method {
            "origin-pull" => {
                // Every receiver downloads the registered model from the origin itself.
                let encoded = shardcast_protocol::codec::encode_to_vec(&manifest);
                for d in &receivers {
                    let mut client = d.agent().await?;
                    let url = origin_url.clone();
                    let encoded = encoded.clone();
                    tokio::spawn(async move {
                        let req = ImportModelRequest {
                            name: MODEL_NAME.into(),
                            origin: url,
                            chunk_size: 0,
                            tier: PbTier::Memory as i32,
                            fetch: true,
                            keep: false,
                            manifest: encoded,
                            bind_name: None,
                        };
                        if let Err(e) = client.import_model(req).await {
                            eprintln!("origin pull failed: {e}");
                        }
                    });
                }
            }
            "chain-from-peer" => {
                start_chain(
                    &daemons[0],
                    &digest,
                    None,
                    &origin_url,
                    vec![receivers.clone()],
                    HopTransport::Tcp,
                )
                .await?;
            }
            _ => {
                // The first receiver heads the chain, fetching from the origin and
                // forwarding each chunk as it arrives.
                start_chain(
                    receivers[0],
                    &digest,
                    Some(&manifest),
                    &origin_url,
                    vec![receivers[1..].to_vec()],
                    HopTransport::Tcp,
                )
                .await?;
            }
        }
        let done = wait_complete(&receivers, &digest, t0, Duration::from_secs(600), |b| {
            pb.set_position(b)
        })
        .await?;
        pb.finish_and_clear();
        let mut per = Vec::new();
        for (d, t) in receivers.iter().zip(done) {
            let t = t.with_context(|| {
                format!("{} did not finish; log: {}", d.host_id, d.log.display())
            })?;
            d.verify_copy(&manifest)?;
            per.push((d.host_id.to_string(), t));
        }
        let origin_bytes = stats.bytes_sent.load(Ordering::Relaxed) - before;
        eprintln!(
            "{method:>18}: every receiver verified, last at {:.1} s",
            per.iter().map(|p| p.1).fold(0.0, f64::max)
        );
        rows.push(DemoRow {
            method: method.into(),
            per_host_s: per,
            origin_bytes,
        });
    }
    cancel.cancel();
    let _ = server.await;
    Ok(rows)
}

/// Renders the demo table.
pub fn demo_table(rows: &[DemoRow], bytes: u64) -> String {
    let mut out = String::new();
    let hosts: Vec<String> = rows
        .first()
        .map(|r| r.per_host_s.iter().map(|p| p.0.clone()).collect())
        .unwrap_or_default();
    out.push_str(&format!("{:<20}", "method"));
    for h in &hosts {
        out.push_str(&format!("{h:>10}"));
    }
    out.push_str(&format!("{:>12}{:>14}\n", "all done", "origin read"));
    for r in rows {
        out.push_str(&format!("{:<20}", r.method));
        for (_, t) in &r.per_host_s {
            out.push_str(&format!("{:>9.1}s", t));
        }
        let last = r.per_host_s.iter().map(|p| p.1).fold(0.0, f64::max);
        out.push_str(&format!(
            "{:>11.1}s{:>14}\n",
            last,
            format_bytes(r.origin_bytes)
        ));
    }
    out.push_str(&format!(
        "(model: {}; every copy verified byte-exact against the origin)\n",
        format_bytes(bytes)
    ));
    out
}

/// Where a JSON report goes.
pub fn write_json<T: Serialize>(path: &PathBuf, value: &T) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

/// One configuration of the hop in the `hop` benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct HopRun {
    /// What ran: `tls` (the production configuration), `tls-reverify-sends` (the source
    /// also re-hashes chunks older than `reverify_after_ms` before sending them, the
    /// default until 2026-11-27),
    /// `plaintext` (`insecure_plaintext`), `quic` (the hop over QUIC) or `quic-jumbo` (QUIC in
    /// 8972-byte packets, `--quic-path-mtu`, as on a jumbo-frame network).
    pub config: String,
    /// Bytes/s through the hop.
    pub bytes_per_s: f64,
    /// Machine CPU utilisation during the transfer (0..1).
    pub cpu_util: f64,
    /// CPU seconds the source's transferd spent per GB (10^9 bytes) moved.
    pub source_cpu_s_per_gb: f64,
    /// CPU seconds the receiver's transferd spent per GB moved.
    pub receiver_cpu_s_per_gb: f64,
    /// The source's CPU seconds per GB, user and system apart.
    pub source_cpu_per_gb: ProcCpu,
    /// The receiver's CPU seconds per GB, user and system apart.
    pub receiver_cpu_per_gb: ProcCpu,
    /// Bytes the source re-hashed before serving them.
    pub source_bytes_reverified: u64,
}

/// Which daemon of a hop a profile is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The source: reads its store and sends.
    Source,
    /// The receiver: receives, verifies and stores.
    Receiver,
}

/// Where one daemon's cycles went in one hop run, from `perf record -g` attached to its
/// transferd for the whole transfer (`hop --profile`).
#[derive(Debug, Clone, Serialize)]
pub struct HopProfile {
    /// The daemon profiled.
    pub side: Side,
    /// The configuration profiled (a run of its own after the measured ones, since perf
    /// itself costs cycles).
    pub config: String,
    /// Bytes/s of the profiled run (lower than unprofiled: perf shares the cores).
    pub bytes_per_s: f64,
    /// Percent of the receiver's samples by category (self time of each symbol, folded
    /// by [`profile_category`]), largest first.
    pub categories: Vec<ProfileShare>,
    /// The symbols with the most self time.
    pub top_symbols: Vec<ProfileShare>,
    /// Percent of the receiver's samples by the work they belong to, read from each
    /// sample's call chain (a `memcpy` under rustls is a TLS copy, `copy_to_iter` under
    /// `tcp_recvmsg` the socket's): [`fold_by_path`].
    pub by_path: Vec<ProfileShare>,
}

/// One line of a [`HopProfile`].
#[derive(Debug, Clone, Serialize)]
pub struct ProfileShare {
    /// Category or symbol (`[k]` kernel, `[.]` user space).
    pub name: String,
    /// Percent of samples.
    pub percent: f64,
}

/// The background scrub measured alone: one daemon holding the model, every chunk idle
/// (`reverify_after_ms` 0) and the scrub's rate far above what a core hashes (100 GB/s).
#[derive(Debug, Clone, Serialize)]
pub struct ScrubReport {
    /// Seconds sampled.
    pub seconds: f64,
    /// Bytes/s the scrub re-hashed.
    pub bytes_per_s: f64,
    /// CPU seconds the daemon spent per GB scrubbed.
    pub cpu_s_per_gb: f64,
}

/// The `hop` benchmark's report: one hop on loopback next to raw TCP.
#[derive(Debug, Clone, Serialize)]
pub struct HopReport {
    /// Bytes moved through the hop.
    pub bytes: u64,
    /// The machine's page cache when the bench started.
    pub page_cache: PageCache,
    /// The machine it ran on.
    pub machine: Machine,
    /// The memory reserve the daemons kept (filled before each run).
    pub memory_reserve: BenchReserve,
    /// Shards of the model (one session, so one TCP connection, per shard and stripe).
    pub shards: usize,
    /// Connections each shard was striped over (the source's `--stripes`).
    pub stripes: usize,
    /// The warm-up run's rate (the TLS hop once before the measured runs), bytes/s.
    pub warm_up_bytes_per_s: Option<f64>,
    /// Raw TCP over loopback measured by iperf3 in the same run, bytes/s (None if iperf3
    /// is not installed).
    pub raw_tcp_bytes_per_s: Option<f64>,
    /// iperf3's sender CPU seconds per GB (its own `cpu_utilization_percent`).
    pub raw_tcp_sender_cpu_s_per_gb: Option<f64>,
    /// iperf3's receiver CPU seconds per GB.
    pub raw_tcp_receiver_cpu_s_per_gb: Option<f64>,
    /// iperf3's sender CPU seconds per GB, user and system apart.
    pub raw_tcp_sender_cpu_per_gb: Option<ProcCpu>,
    /// iperf3's receiver CPU seconds per GB, user and system apart.
    pub raw_tcp_receiver_cpu_per_gb: Option<ProcCpu>,
    /// One chain hop with mutual TLS, BLAKE3 verification and store writes, bytes/s.
    pub hop_bytes_per_s: f64,
    /// hop / raw TCP.
    pub ratio: Option<f64>,
    /// Machine CPU utilisation during the hop transfer (0..1).
    pub cpu_util: f64,
    /// The same hop without TLS (`insecure_plaintext`), bytes/s, in the same run.
    pub plaintext_hop_bytes_per_s: f64,
    /// Machine CPU utilisation during the plaintext hop (0..1).
    pub plaintext_cpu_util: f64,
    /// TLS hop / plaintext hop.
    pub tls_vs_plaintext: f64,
    /// The same hop in the authenticate-only data mode (mutual-TLS handshake, then the
    /// clear), bytes/s, in the same run.
    pub auth_only_hop_bytes_per_s: f64,
    /// Authenticate-only hop / TLS hop.
    pub auth_only_vs_tls: f64,
    /// The TLS hop re-hashing before sends (`--reverify-sends true`) / the default TLS hop:
    /// what re-hashing chunks older than `reverify_after_ms` on the way out costs.
    pub reverify_throughput_ratio: f64,
    /// The same hop over QUIC (mutual TLS 1.3 under the same CA), bytes/s, in the same run.
    pub quic_hop_bytes_per_s: f64,
    /// QUIC hop / raw TCP.
    pub quic_ratio: Option<f64>,
    /// QUIC hop / TLS-over-TCP hop.
    pub quic_vs_tls: f64,
    /// Every configuration, in the order run.
    pub runs: Vec<HopRun>,
    /// The scrub alone.
    pub scrub: ScrubReport,
    /// Where the profiled daemon's cycles went (`--profile`; `None` without it).
    pub profile: Option<HopProfile>,
}

/// Raw loopback TCP from iperf3: bytes/s, and the sender's and receiver's CPU seconds per
/// GB.
struct Iperf {
    bytes_per_s: f64,
    sender_cpu_s_per_gb: f64,
    receiver_cpu_s_per_gb: f64,
    sender_cpu_per_gb: ProcCpu,
    receiver_cpu_per_gb: ProcCpu,
}

/// Measures raw loopback TCP with iperf3 (server and client are separate processes, killed
/// by PID when done).
fn iperf3_loopback(seconds: u32) -> anyhow::Result<Option<Iperf>> {
    use std::process::{Command, Stdio};
    if Command::new("iperf3")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        eprintln!(
            "iperf3 is not installed: this report has no raw-TCP baseline (install Debian's iperf3)"
        );
        return Ok(None);
    }
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 -s")?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("timeout")
        .args([
            &(seconds + 10).to_string(),
            "iperf3",
            "-c",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-t",
            &seconds.to_string(),
            "-J",
        ])
        .output()
        .context("running iperf3 -c")?;
    let _ = server.kill();
    let _ = server.wait();
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("parsing iperf3 -J output")?;
    let bps = json["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 output lacks end.sum_received.bits_per_second")?;
    // iperf3's CPU figures are percent of one core over the test (user + system).
    let cpu = &json["end"]["cpu_utilization_percent"];
    let gb = bps / 8.0 * f64::from(seconds) / 1e9;
    let per_gb = |pct: Option<f64>| pct.map_or(0.0, |p| p / 100.0 * f64::from(seconds) / gb);
    let split = |side: &str| ProcCpu {
        user_s: per_gb(cpu[format!("{side}_user")].as_f64()),
        system_s: per_gb(cpu[format!("{side}_system")].as_f64()),
    };
    Ok(Some(Iperf {
        bytes_per_s: bps / 8.0,
        sender_cpu_s_per_gb: per_gb(cpu["host_total"].as_f64()),
        receiver_cpu_s_per_gb: per_gb(cpu["remote_total"].as_f64()),
        sender_cpu_per_gb: split("host"),
        receiver_cpu_per_gb: split("remote"),
    }))
}

/// Runs the scrub alone on one daemon holding a model of `size` bytes for `seconds`.
async fn measure_scrub(size: u64, shards: usize, seconds: u64) -> anyhow::Result<ScrubReport> {
    let scratch = scratch_dir("scrub")?;
    let origin = scratch.path().join("origin");
    synth::generate(
        &origin,
        &SynthSpec {
            total_bytes: size,
            shards,
            seed: 7,
        },
    )?;
    let origin_uri = format!("file://{}", origin.display());
    let mut o = DaemonOpts::local("scrubber");
    o.extra_args.extend([
        "--origin-allow".into(),
        origin_uri.clone(),
        "--scrub-rate".into(),
        "100GB/s".into(),
        "--reverify-after-ms".into(),
        "0".into(),
    ]);
    let d = Daemon::start(&scratch.path().join("scrubber"), o).await?;
    import_on(&d, &origin_uri, true, 0).await?;
    let before = d.stats().await?.bytes_scrubbed;
    let cpu0 = d.pid().and_then(process_cpu_s).unwrap_or(0.0);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let scrubbed = d.stats().await?.bytes_scrubbed - before;
    let cpu = d.pid().and_then(process_cpu_s).unwrap_or(0.0) - cpu0;
    let elapsed = t0.elapsed().as_secs_f64();
    anyhow::ensure!(
        scrubbed > 0,
        "the scrub re-hashed nothing in {elapsed:.1} s"
    );
    Ok(ScrubReport {
        seconds: elapsed,
        bytes_per_s: scrubbed as f64 / elapsed,
        cpu_s_per_gb: cpu / (scrubbed as f64 / 1e9),
    })
}

/// transferd's arguments for striping each shard over `stripes` connections (a number, or
/// `auto`).
pub fn stripe_args(stripes: impl std::fmt::Display) -> Vec<String> {
    // Always given: the daemons' default (`auto`) depends on the machine's cores.
    vec!["--stripes".into(), stripes.to_string()]
}

/// Runs the `hop` benchmark: iperf3 on loopback, then a model of `size` bytes through one
/// chain hop (source → receiver, both real daemons, no caps, each shard striped over
/// `stripes` connections) with mutual TLS over TCP, with TLS but no serve-path
/// re-verification, in plaintext, in the authenticate-only data mode (with and without
/// `sendfile`), and over QUIC; then the scrub alone. With `profile` (`Some`), the hop runs
/// once more over `profile_method`'s transport under `perf record -g` on `profile_side`'s
/// daemon, whose data file is kept at the given path (else removed).
pub async fn run_hop_bench(
    size: u64,
    shards: usize,
    stripes: usize,
    profile: Option<HopProfileOpts>,
    memory_reserve: BenchReserve,
    progress: bool,
) -> anyhow::Result<HopReport> {
    let raw = tokio::task::spawn_blocking(|| iperf3_loopback(5)).await??;
    let mut opts = ChainBenchOpts {
        shards,
        progress,
        memory_reserve,
        ..ChainBenchOpts::new(NetMode::Local, 1, size, vec![Method::ChainTcp])
    };
    // (name, plaintext, source-only arguments, both daemons' arguments, transport, frame
    // MTU the QUIC daemons are told: `quic-jumbo` sends 8972-byte packets, as on a
    // 9000-byte jumbo-frame network; loopback carries them.)
    type HopConfig<'a> = (
        &'a str,
        bool,
        &'a [&'a str],
        &'a [&'a str],
        Method,
        Option<u32>,
    );
    const AUTH_ONLY: &[&str] = &["--data-mode", "authenticate-only"];
    let configs: [HopConfig<'_>; 7] = [
        ("tls", false, &[], &[], Method::ChainTcp, None),
        (
            "tls-reverify-sends",
            false,
            &["--reverify-sends", "true"],
            &[],
            Method::ChainTcp,
            None,
        ),
        ("plaintext", true, &[], &[], Method::ChainTcp, None),
        ("auth-only", false, &[], AUTH_ONLY, Method::ChainTcp, None),
        (
            "auth-only-sendfile",
            false,
            &[],
            &["--data-mode", "authenticate-only", "--sendfile", "true"],
            Method::ChainTcp,
            None,
        ),
        ("quic", false, &[], &[], Method::ChainQuic, None),
        ("quic-jumbo", false, &[], &[], Method::ChainQuic, Some(9000)),
    ];
    // The first configuration runs once more before it is measured (`warm_up`), not
    // reported but its rate: the first transfer after start-up pays for memory the guest
    // has not touched lately (on the VM measured, 2× slower than the same build's next
    // run), which would count against the first configuration only.
    let mut warm_up_bytes_per_s = None;
    let mut runs = Vec::new();
    for (i, (config, plaintext, args, all_args, method, mtu)) in configs.into_iter().enumerate() {
        opts.plaintext = plaintext;
        opts.daemon_args = stripe_args(stripes)
            .into_iter()
            .chain(all_args.iter().map(|a| a.to_string()))
            .collect();
        opts.methods = vec![method];
        opts.mtu = mtu;
        opts.warm_up = i == 0;
        opts.source_args = args.iter().map(|a| a.to_string()).collect();
        let report = run_chain_bench(&opts).await?;
        if let Some(s) = report.warm_up_s {
            warm_up_bytes_per_s = Some(report.bytes as f64 / s);
        }
        let r = report.results.first().context("no result")?;
        if !r.verified {
            bail!("the receiver's copy did not verify ({config})");
        }
        let gb = report.bytes as f64 / 1e9;
        let receiver = r.receiver_cpu.first().copied().unwrap_or_default();
        runs.push(HopRun {
            config: config.into(),
            bytes_per_s: report.bytes as f64 / r.completion_s,
            cpu_util: r.cpu_util,
            source_cpu_s_per_gb: r.source_cpu_s / gb,
            receiver_cpu_s_per_gb: r.receiver_cpu_s.first().copied().unwrap_or(0.0) / gb,
            source_cpu_per_gb: r.source_cpu.per_gb(report.bytes),
            receiver_cpu_per_gb: receiver.per_gb(report.bytes),
            source_bytes_reverified: r.source_bytes_reverified,
        });
    }
    let profile = if let Some(HopProfileOpts {
        keep,
        method: profile_method,
        side: profile_side,
    }) = profile
    {
        // The production configuration once more, with perf attached to one side.
        let dir = scratch_dir("perf")?;
        let data = keep.unwrap_or_else(|| dir.path().join("hop.perf.data"));
        opts.plaintext = false;
        opts.methods = vec![profile_method];
        opts.source_args = Vec::new();
        opts.daemon_args = stripe_args(stripes);
        opts.mtu = None;
        opts.warm_up = false;
        opts.perf = Some((profile_side, data.clone()));
        let report = run_chain_bench(&opts).await?;
        let r = report.results.first().context("no result")?;
        let bytes_per_s = report.bytes as f64 / r.completion_s;
        let (text, script) = tokio::task::spawn_blocking(move || {
            anyhow::Ok((perf_report_text(&data)?, perf_script_text(&data)?))
        })
        .await??;
        let (categories, top_symbols) = fold_profile(&text, 15);
        let by_path = fold_by_path(&script);
        Some(HopProfile {
            side: profile_side,
            config: match profile_method {
                Method::ChainQuic => "quic",
                _ => "tls",
            }
            .into(),
            bytes_per_s,
            categories,
            top_symbols,
            by_path,
        })
    } else {
        None
    };
    let scrub = measure_scrub(size.min(1 << 30), shards, 5).await?;
    let (tls, reverify_sends, plain, auth_only, quic) =
        (&runs[0], &runs[1], &runs[2], &runs[3], &runs[5]);
    Ok(HopReport {
        page_cache: PageCache::default(),
        machine: Machine::default(),
        bytes: size,
        memory_reserve,
        shards,
        stripes,
        warm_up_bytes_per_s,
        raw_tcp_bytes_per_s: raw.as_ref().map(|r| r.bytes_per_s),
        raw_tcp_sender_cpu_s_per_gb: raw.as_ref().map(|r| r.sender_cpu_s_per_gb),
        raw_tcp_receiver_cpu_s_per_gb: raw.as_ref().map(|r| r.receiver_cpu_s_per_gb),
        raw_tcp_sender_cpu_per_gb: raw.as_ref().map(|r| r.sender_cpu_per_gb),
        raw_tcp_receiver_cpu_per_gb: raw.as_ref().map(|r| r.receiver_cpu_per_gb),
        hop_bytes_per_s: tls.bytes_per_s,
        ratio: raw.as_ref().map(|r| tls.bytes_per_s / r.bytes_per_s),
        cpu_util: tls.cpu_util,
        plaintext_hop_bytes_per_s: plain.bytes_per_s,
        plaintext_cpu_util: plain.cpu_util,
        tls_vs_plaintext: tls.bytes_per_s / plain.bytes_per_s,
        auth_only_hop_bytes_per_s: auth_only.bytes_per_s,
        auth_only_vs_tls: auth_only.bytes_per_s / tls.bytes_per_s,
        reverify_throughput_ratio: reverify_sends.bytes_per_s / tls.bytes_per_s,
        quic_hop_bytes_per_s: quic.bytes_per_s,
        quic_ratio: raw.as_ref().map(|r| quic.bytes_per_s / r.bytes_per_s),
        quic_vs_tls: quic.bytes_per_s / tls.bytes_per_s,
        runs,
        scrub,
        profile,
    })
}

/// The hop bench's profiled run ([`run_hop_bench`]).
#[derive(Debug, Clone)]
pub struct HopProfileOpts {
    /// Keep perf's data file here (`None`: a scratch file).
    pub keep: Option<PathBuf>,
    /// The transport of the profiled run.
    pub method: Method,
    /// The daemon recorded.
    pub side: Side,
}

/// `perf report`'s flat self-time listing of `data`, one symbol a line.
fn perf_report_text(data: &Path) -> anyhow::Result<String> {
    perf_text(
        &[
            "report",
            "--no-children",
            "--sort",
            "sym",
            "--stdio",
            "-g",
            "none",
            "--percent-limit",
            "0.01",
        ],
        data,
    )
}

/// `perf script`'s samples of `data`, each a header line and its call chain (leaf first),
/// symbols only, samples separated by blank lines.
fn perf_script_text(data: &Path) -> anyhow::Result<String> {
    perf_text(&["script", "-F", "comm,ip,sym"], data)
}

/// The output of `perf <args> -i data`.
fn perf_text(args: &[&str], data: &Path) -> anyhow::Result<String> {
    let what = args.first().copied().unwrap_or("");
    let out = std::process::Command::new("perf")
        .args(args)
        .arg("-i")
        .arg(data)
        .stderr(std::process::Stdio::null())
        .output()
        .with_context(|| format!("running perf {what}"))?;
    anyhow::ensure!(out.status.success(), "perf {what} failed: {}", out.status);
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What a sample's call chain (`frames`, leaf first) was doing, by the first rule that
/// matches: the owner of a copy or of crypto is found among the callers, so the flat
/// profile's "memcpy" splits into TLS's, QUIC's, the socket's and the store's. Kernel
/// chains are complete; user-space ones stop where a function keeps no frame pointer
/// (release builds), and such samples are named by their leaf ("caller not seen").
pub fn path_category(frames: &[&str]) -> &'static str {
    let has = |keys: &[&str]| frames.iter().any(|f| keys.iter().any(|k| f.contains(k)));
    let leaf = frames.first().copied().unwrap_or("");
    let leaf_is = |keys: &[&str]| keys.iter().any(|k| leaf.contains(k));
    let copy = leaf_is(&[
        "memcpy",
        "memmove",
        "memset",
        "copy_",
        "_copy",
        "clear_page",
    ]);
    // Kernel UDP entry points: under quinn they are QUIC's socket work, alone a socket's.
    const UDP_RECV: &[&str] = &["udp_recvmsg", "__sys_recvmmsg", "udp_gro_receive"];
    const UDP_SEND: &[&str] = &["udp_sendmsg", "udp_send_skb", "__sys_sendmsg"];
    if has(&["blake3"]) {
        "hashing (BLAKE3)"
    } else if has(&["quinn"]) {
        // Before rustls: quinn encrypts and decrypts its packets through rustls.
        if copy {
            "QUIC: copies"
        } else if leaf_is(&["aes", "gcm", "ghash", "ring"]) {
            "QUIC: AES-GCM"
        } else if has(UDP_RECV) || has(UDP_SEND) {
            "QUIC: socket (kernel UDP)"
        } else {
            "QUIC: protocol"
        }
    } else if has(&["rustls"]) {
        if copy {
            "TLS: copies"
        } else if leaf_is(&["aes", "gcm", "ghash"]) {
            "TLS: AES-GCM"
        } else {
            "TLS: other"
        }
    } else if has(UDP_RECV) {
        "socket receive (kernel UDP)"
    } else if has(UDP_SEND) {
        "socket send (kernel UDP)"
    } else if has(&["tcp_recvmsg", "sock_recvmsg", "sys_recvfrom"]) {
        "socket receive (kernel TCP)"
    } else if has(&["tcp_sendmsg", "sock_sendmsg", "sys_sendto", "sys_writev"]) {
        "socket send (kernel TCP)"
    } else if has(&[
        "shmem_file_write_iter",
        "generic_perform_write",
        "ksys_pwrite64",
        "write_all_at",
    ]) {
        "store write (page cache)"
    } else if has(&["exc_page_fault", "handle_mm_fault"]) {
        "page faults"
    } else if has(&[
        "malloc",
        "free",
        "realloc",
        "alloc::",
        "__rust_alloc",
        "__rust_dealloc",
    ]) {
        "allocation"
    } else if has(&[
        "schedule",
        "finish_task_switch",
        "futex",
        "try_to_wake_up",
        "epoll",
    ]) {
        "scheduling and wake-ups"
    } else if leaf_is(&["aes", "gcm", "ghash"]) {
        // Release builds keep no frame pointers, so a user-space chain often ends at the
        // leaf: crypto whose caller perf could not see.
        "AES-GCM (caller not seen)"
    } else if copy {
        "copies (caller not seen)"
    } else {
        "other"
    }
}

/// Folds `perf script` output (see `perf_script_text`) into the percent of samples per
/// [`path_category`], largest first.
pub fn fold_by_path(script: &str) -> Vec<ProfileShare> {
    let mut by: std::collections::BTreeMap<&'static str, u64> = Default::default();
    let mut total = 0u64;
    for sample in script.split("\n\n") {
        // Frame lines are indented: `<address> <symbol>`; the header is not.
        let frames: Vec<&str> = sample
            .lines()
            .filter(|l| l.starts_with(char::is_whitespace))
            .filter_map(|l| l.trim().split_once(' ').map(|(_, sym)| sym.trim()))
            .collect();
        if frames.is_empty() {
            continue;
        }
        total += 1;
        *by.entry(path_category(&frames)).or_default() += 1;
    }
    let mut out: Vec<ProfileShare> = by
        .into_iter()
        .map(|(name, n)| ProfileShare {
            name: name.into(),
            percent: 100.0 * n as f64 / total.max(1) as f64,
        })
        .collect();
    out.sort_by(|a, b| b.percent.total_cmp(&a.percent));
    out
}

/// The category a symbol's self time is folded into. `kernel` says whether perf marked it
/// `[k]`. Copies are matched before the kernel's TCP stack, so the kernel's copies to and
/// from user space count as copies.
pub fn profile_category(symbol: &str, kernel: bool) -> &'static str {
    let s = symbol.to_ascii_lowercase();
    let any = |keys: &[&str]| keys.iter().any(|k| s.contains(k));
    if any(&["blake3"]) {
        "hashing (BLAKE3)"
    } else if any(&[
        "aes",
        "gcm",
        "ghash",
        "gfp_",
        "chacha",
        "poly1305",
        "rustls",
        "ring_core",
        "_ring",
    ]) {
        "TLS/crypto"
    } else if any(&[
        "memcpy",
        "memmove",
        "copy_user",
        "copy_to_user",
        "copy_from_user",
        "copy_page",
        "copy_folio",
        "_copy_to_iter",
        "_copy_from_iter",
        "copyin",
        "copyout",
        "rep_movs",
        "memset",
        "clear_page",
    ]) {
        "memcpy/memset"
    } else if any(&[
        "malloc",
        "free",
        "realloc",
        "calloc",
        "alloc",
        "kmem_cache",
        "rmqueue",
        "mi_",
        "je_",
        "folio_add",
        "lru",
    ]) {
        "allocation (heap, pages)"
    } else if kernel
        && any(&[
            "tcp", "skb", "sock", "ip_", "ip6", "net_", "netif", "napi", "loopback", "dev_", "nf_",
            "__inet", "inet_",
        ])
    {
        "kernel TCP"
    } else if kernel {
        "kernel other (syscalls, scheduler, page cache, faults)"
    } else {
        "other user space (tokio, framing, protocol)"
    }
}

/// Folds `perf report --stdio --sort sym -g none` output into categories (largest first)
/// and the `top` symbols. Lines that do not parse are skipped.
pub fn fold_profile(report: &str, top: usize) -> (Vec<ProfileShare>, Vec<ProfileShare>) {
    let mut by_cat: std::collections::BTreeMap<&'static str, f64> = Default::default();
    let mut symbols = Vec::new();
    for line in report.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let Some((pct, rest)) = line.split_once('%') else {
            continue;
        };
        let Ok(pct) = pct.trim().parse::<f64>() else {
            continue;
        };
        let rest = rest.trim();
        let (kernel, symbol) = if let Some(sym) = rest.strip_prefix("[k]") {
            (true, sym.trim())
        } else if let Some(sym) = rest.strip_prefix("[.]") {
            (false, sym.trim())
        } else {
            (false, rest)
        };
        *by_cat.entry(profile_category(symbol, kernel)).or_default() += pct;
        symbols.push(ProfileShare {
            name: format!("{} {symbol}", if kernel { "[k]" } else { "[.]" }),
            percent: pct,
        });
    }
    let mut categories: Vec<ProfileShare> = by_cat
        .into_iter()
        .map(|(name, percent)| ProfileShare {
            name: name.into(),
            percent,
        })
        .collect();
    categories.sort_by(|a, b| b.percent.total_cmp(&a.percent));
    symbols.sort_by(|a, b| b.percent.total_cmp(&a.percent));
    symbols.truncate(top);
    (categories, symbols)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The features string of the balloon on the VM that reports freed pages, and one
    /// without bit 5.
    #[test]
    fn free_page_reporting_is_bit_five_of_the_balloons_features() {
        let with = "0110010100000000000000000000000010000000\n";
        assert!(reports_free_pages(with));
        assert!(!reports_free_pages(
            "0110000100000000000000000000000010000000\n"
        ));
        assert!(!reports_free_pages("0110"), "too short: no bit 5");
        let m = Machine::describe();
        assert!(m.cores >= 1);
        assert!(["avx512", "avx2", "sse4.1", "none"].contains(&m.simd.as_str()));
        assert!(m.first_touch_gb_s > 0.0 && m.first_touch_gb_s.is_finite());
        // The scratch directory's file system, as the daemons' stores see theirs.
        let tier = m.memory_tier.expect("the scratch directory's file system");
        assert!(scratch_base().starts_with(&tier.mount_point), "{tier:?}");
        assert_eq!(tier.huge.is_some(), tier.fs_type == "tmpfs", "{tier:?}");
    }

    #[test]
    fn proc_stat_cpu_splits_user_and_system_and_survives_odd_names() {
        let line = "4242 (transferd) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 9";
        let cpu = parse_proc_stat_cpu(line).unwrap();
        assert_eq!(cpu.user_s, 2.5);
        assert_eq!(cpu.system_s, 0.75);
        assert!(parse_proc_stat_cpu("no parenthesis").is_none());
        assert!(parse_proc_stat_cpu("1 (short) S 1 2").is_none());
        assert!(parse_proc_stat_cpu("1 (bad) S 1 2 3 4 5 6 7 8 9 10 x y").is_none());
    }

    #[test]
    fn perf_report_lines_fold_into_categories() {
        let report = "\
# Samples: 1K of event 'cpu-clock'
#
    30.00%  [.] _blake3_hash_many_avx512
    20.00%  [k] copy_user_enhanced_fast_string
    15.00%  [.] aes_gcm_dec_update_vaes_avx2
    10.00%  [k] tcp_recvmsg_locked
     5.00%  [.] __memmove_avx_unaligned_erms
     5.00%  [k] clear_page_erms
     5.00%  [.] malloc
     4.00%  [k] entry_SYSCALL_64
     3.00%  [.] tokio::runtime::task::raw::poll
     3.00%  garbage without a percent
";
        let (cats, top) = fold_profile(report, 2);
        let get = |n: &str| cats.iter().find(|c| c.name == n).map(|c| c.percent);
        assert_eq!(get("hashing (BLAKE3)"), Some(30.0));
        assert_eq!(get("memcpy/memset"), Some(30.0));
        assert_eq!(get("TLS/crypto"), Some(15.0));
        assert_eq!(get("kernel TCP"), Some(10.0));
        assert_eq!(get("allocation (heap, pages)"), Some(5.0));
        assert!(get("kernel other (syscalls, scheduler, page cache, faults)").is_some());
        assert!(get("other user space (tokio, framing, protocol)").is_some());
        assert_eq!(top.len(), 2);
        assert_eq!(top[0].name, "[.] _blake3_hash_many_avx512");
    }

    #[test]
    fn samples_fold_by_what_their_callers_were_doing() {
        // `perf script -F comm,ip,sym` as perf 6.1 prints it: a header, then the chain.
        let script = "\
transferd
\tffffffff81a0 __memmove_avx512_unaligned_erms
\t55d0 rustls::conn::ConnectionCommon::read_tls
\t55d1 tokio_rustls::common::Stream::read_io

transferd
\tffffffff81a1 _copy_to_iter
\tffffffff81a2 tcp_recvmsg_locked
\tffffffff81a3 tcp_recvmsg

transferd
\tffffffff81a4 copy_folio_from_iter_atomic
\tffffffff81a5 generic_perform_write
\tffffffff81a6 shmem_file_write_iter

transferd
\t55d2 __memmove_avx512_unaligned_erms
\t55d3 quinn_proto::connection::assembler::Assembler::read

transferd
\t55d4 _blake3_hash_many_avx512
\t55d5 blake3::Hasher::update

transferd
\t55d6 ring_core_0_17_14__aes_gcm_dec_update_vaes_avx2
\t55d7 rustls::record_layer::RecordLayer::decrypt_incoming

transferd
\t55d9 ring_core_0_17_14__aes_gcm_dec_update_vaes_avx2
\t55da rustls::crypto::ring::quic::PacketKey::decrypt_in_place
\t55db quinn_proto::connection::Connection::decrypt_packet

transferd
\t55d8 tokio::runtime::task::raw::poll

header only, no frames
";
        let folded = fold_by_path(script);
        let get = |n: &str| folded.iter().find(|c| c.name == n).map(|c| c.percent);
        let one = 100.0 / 8.0;
        for name in [
            "QUIC: AES-GCM",
            "TLS: copies",
            "socket receive (kernel TCP)",
            "store write (page cache)",
            "QUIC: copies",
            "hashing (BLAKE3)",
            "TLS: AES-GCM",
            "other",
        ] {
            let got = get(name).unwrap_or_else(|| panic!("{name} missing from {folded:?}"));
            assert!((got - one).abs() < 1e-9, "{name}: {got}");
        }
    }
}
