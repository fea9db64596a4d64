//! `shardcast-bench`: the demo and the benchmarks. See `shardcast-bench --help`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use shardcast_bench::scenario::{self, ChainBenchOpts, DemoOpts, Method, NetMode};
use shardcast_protocol::units::{parse_rate, parse_size};

#[derive(Parser)]
#[command(
    name = "shardcast-bench",
    version,
    about = "shardcast demo and benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

/// What `chain` and `hop` do before they start.
#[derive(clap::Args)]
struct StartArgs {
    /// Drop the machine's page cache first (`sync`, then `3` into
    /// `/proc/sys/vm/drop_caches`; needs root): a large cache slowed the emulated
    /// cluster's daemons on the 2-vCPU VM (docs/BENCHMARKS.md). The report's `page_cache`
    /// says whether it was dropped and how large it was.
    #[arg(long)]
    drop_caches: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// Local cluster on loopback (no root), through the controller: register a synthetic
    /// model behind a rate-capped HTTP origin (one origin read, kept by the host that hashes
    /// it), prewarm half the hosts (a chain from that copy), scale out to the rest (served
    /// by peers), prewarm all; no origin traffic after the registration.
    Demo {
        /// Model size.
        #[arg(long, default_value = "512MiB", value_parser = parse_size)]
        size: u64,
        /// Safetensors shards.
        #[arg(long, default_value_t = 4)]
        shards: usize,
        /// transferd processes.
        #[arg(long, default_value_t = 6)]
        hosts: usize,
        /// Per-host egress and ingress cap.
        #[arg(long, default_value = "1Gbit")]
        rate: String,
        /// The origin's total cap (cloud storage is slower than host links).
        #[arg(long, default_value = "250Mbit")]
        origin_rate: String,
        /// Write the steps as JSON too.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Time to a serving GPU replica through the controller, whole vs a partitioned burst
    /// (simulated GPUs on loopback; the model is already in every host's memory tier, so
    /// the host-to-GPU load is what is measured).
    Burst {
        /// Model size.
        #[arg(long, default_value = "512MiB", value_parser = parse_size)]
        size: u64,
        /// Safetensors shards.
        #[arg(long, default_value_t = 4)]
        shards: usize,
        /// Partitions of the burst replica (one host each).
        #[arg(long, default_value_t = 4)]
        partitions: u32,
        /// Simulated host-to-GPU rate.
        #[arg(long, default_value = "400MB/s")]
        pcie_rate: String,
        /// Write the report as JSON too.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Controller fail-over: three `shardcast-controller` replicas on a real etcd (on
    /// loopback) and daemons; each trial SIGKILLs the leader and times the first write
    /// (a prewarm) the fail-over client gets accepted, then restarts the killed replica.
    Failover {
        /// Leader kills.
        #[arg(long, default_value_t = 10)]
        trials: usize,
        /// transferd processes.
        #[arg(long, default_value_t = 2)]
        hosts: usize,
        /// The replicas' leader lease TTL, milliseconds.
        #[arg(long, default_value_t = 3000)]
        lease_ttl_ms: u64,
        /// Write the report as JSON too.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// One fault × chain position on an emulated cluster (needs root): a prewarm of every
    /// host through the controller with a host killed, stopped, cut off, its copy
    /// corrupted, two neighbours killed and stopped, or its memory tier filled `--at-s` in;
    /// the healthy hosts' ready time against the no-fault one, their copies byte-exact, the
    /// plan's report true, the victims' copies complete, and the bytes left after an evict.
    Faults {
        /// One network namespace per host with tc rate caps (required; the only mode).
        #[arg(long, required = true)]
        emulate: bool,
        /// Hosts (all prewarmed).
        #[arg(long, default_value_t = 8)]
        hosts: usize,
        /// Model size.
        #[arg(long, default_value = "512MiB", value_parser = parse_size)]
        size: u64,
        /// Safetensors shards.
        #[arg(long, default_value_t = 1)]
        shards: usize,
        /// Host link rate.
        #[arg(long, default_value = "250Mbit")]
        rate: String,
        /// Origin rate.
        #[arg(long, default_value = "250Mbit")]
        origin_rate: String,
        /// Comma-separated faults: kill (or restart: kill -9, started again 3 s later), stop
        /// (SIGSTOP for 8 s), link-down (8 s), corrupt (a byte at rest), two (a kill and a
        /// stop of neighbours), fill (the memory tier's tmpfs filled for 8 s; needs root),
        /// rotate (the host certificate re-issued, then SIGHUP), term (SIGTERM: transferd
        /// drains, then is started again 3 s after it exits), rolling (every host in turn
        /// as term, from the head; positions do not apply).
        #[arg(
            long,
            default_value = "kill,stop,link-down,corrupt",
            value_delimiter = ','
        )]
        faults: Vec<shardcast_bench::faults::Fault>,
        /// Comma-separated positions: head, middle, tail.
        #[arg(long, default_value = "head,middle,tail", value_delimiter = ',')]
        positions: Vec<shardcast_bench::faults::Position>,
        /// Trials per fault × position, and of the no-fault baseline.
        #[arg(long, default_value_t = 5)]
        trials: usize,
        /// Seconds after the prewarm call the fault strikes.
        #[arg(long, default_value_t = 5.0)]
        at_s: f64,
        /// Per-trial time limit in seconds.
        #[arg(long, default_value_t = 600)]
        timeout_s: u64,
        /// Write the report as JSON (`results`: one record per trial).
        #[arg(long)]
        json: Option<PathBuf>,
        /// An extra transferd argument for every host (repeat it), e.g.
        /// `--daemon-arg=--write-timeout-s --daemon-arg=3`.
        #[arg(long = "daemon-arg", allow_hyphen_values = true)]
        daemon_args: Vec<String>,
    },
    /// Cold start through the controller on an emulated cluster (needs root): every host
    /// pulling from a rate-capped HTTP origin in its own namespace, vs shardcast's plan.
    ColdStart {
        /// One network namespace per host with tc rate caps (required; the only mode).
        #[arg(long, required = true)]
        emulate: bool,
        /// Hosts.
        #[arg(long, default_value_t = 8)]
        hosts: usize,
        /// Model size.
        #[arg(long, default_value = "512MiB", value_parser = parse_size)]
        size: u64,
        /// Safetensors shards.
        #[arg(long, default_value_t = 4)]
        shards: usize,
        /// Host link rate.
        #[arg(long, default_value = "1Gbit")]
        rate: String,
        /// Origin (cloud storage) rate.
        #[arg(long, default_value = "250Mbit")]
        origin_rate: String,
        /// Comma-separated methods: origin-pull, shardcast.
        #[arg(long, default_value = "origin-pull,shardcast", value_delimiter = ',')]
        methods: Vec<String>,
        /// Per-method time limit in seconds.
        #[arg(long, default_value_t = 900)]
        timeout_s: u64,
        /// Write the report as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Draw SVG plots into this directory (created if missing): `copy-cdf.svg`, the
        /// per-host ready-time CDF, drawn as `simulate --plots` draws its own.
        #[arg(long, value_name = "DIR")]
        plots: Option<PathBuf>,
    },
    /// The data plane alone on loopback (no controller): a source and 4 receivers, chain vs
    /// every host pulling from the origin.
    Compare {
        /// Model size.
        #[arg(long, default_value = "1GiB", value_parser = parse_size)]
        size: u64,
        /// Safetensors shards.
        #[arg(long, default_value_t = 4)]
        shards: usize,
        /// Receivers.
        #[arg(long, default_value_t = 4)]
        receivers: usize,
        /// Per-daemon egress and ingress cap, and the origin's total cap.
        #[arg(long, default_value = "1Gbit")]
        rate: String,
        /// Write the table as JSON too.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Chain vs star on an emulated cluster (network namespaces + tc; needs root) or on
    /// loopback.
    Chain {
        /// One network namespace per host with tc rate caps (needs root).
        #[arg(long, conflicts_with = "local")]
        emulate: bool,
        /// Loopback, no caps.
        #[arg(long)]
        local: bool,
        /// Receivers.
        #[arg(long, default_value_t = 8)]
        receivers: usize,
        /// Model size.
        #[arg(long, default_value = "512MiB", value_parser = parse_size)]
        size: u64,
        /// Safetensors shards.
        #[arg(long, default_value_t = 1)]
        shards: usize,
        /// Per-host link rate (emulated mode).
        #[arg(long, default_value = "1Gbit")]
        rate: String,
        /// Comma-separated methods: chain-tcp, chain-quic, star.
        #[arg(long, default_value = "chain-tcp,star", value_delimiter = ',')]
        methods: Vec<Method>,
        /// Write the report as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Per-method time limit in seconds.
        #[arg(long, default_value_t = 600)]
        timeout_s: u64,
        /// Manifest chunk size [default: transferd's, 1 MiB].
        #[arg(long, value_parser = parse_size)]
        chunk_size: Option<u64>,
        /// In-flight chunks per hop [default: transferd's].
        #[arg(long)]
        window: Option<usize>,
        /// Random loss on every host's egress, in percent (e.g. `1` or `0.5%`; emulated
        /// mode, needs `nft`): each packet a host sends is dropped with this probability.
        #[arg(long, value_parser = parse_loss)]
        loss: Option<u32>,
        /// MTU of every emulated link (e.g. 9000 for jumbo frames; emulated mode). QUIC
        /// daemons then send packets of the matching size (`--quic-path-mtu`) [default: 1500].
        #[arg(long)]
        mtu: Option<u32>,
        /// TCP congestion control of every emulated host (e.g. `cubic`, `bbr`; emulated
        /// mode) [default: the machine's, `net.ipv4.tcp_congestion_control`].
        #[arg(long)]
        tcp_congestion: Option<String>,
        /// Run the first method once before the measured runs, not counted: the first
        /// transfer after an earlier run's daemons left is slower on a VM whose guest memory
        /// went cold.
        #[arg(long)]
        warm_up: bool,
        /// The daemons' data mode on TCP hops: tls, or authenticate-only (mutual-TLS
        /// handshake, then unencrypted; `--sendfile` too with `authenticate-only-sendfile`).
        #[arg(long, default_value = "tls")]
        data_mode: BenchDataMode,
        /// Connections each shard is striped over (the head's `--stripes`: a number, or
        /// `auto`, transferd's own default, which depends on the cores).
        #[arg(long, default_value = "1")]
        stripes: String,
        /// The memory reserve every daemon keeps and fills before the transfer (transferd's
        /// `--memory-reserve`: spare files of allocated pages new shards are written into):
        /// auto (one spare per shard, each the largest shard's size), off, or a size.
        #[arg(long, default_value = "auto")]
        memory_reserve: scenario::BenchReserve,
        /// An extra transferd argument for every daemon (repeat it), e.g.
        /// `--daemon-arg=--writer --daemon-arg=mapped`.
        #[arg(long = "daemon-arg", allow_hyphen_values = true)]
        daemon_args: Vec<String>,
        #[command(flatten)]
        start: StartArgs,
    },
    /// One chain hop on loopback (verification on) next to raw TCP measured by iperf3.
    Hop {
        /// Bytes to move.
        #[arg(long, default_value = "2GiB", value_parser = parse_size)]
        size: u64,
        /// Safetensors shards (one session and TCP connection per shard).
        #[arg(long, default_value_t = 1)]
        shards: usize,
        /// Connections each shard is striped over (transferd's `--stripes`).
        #[arg(long, default_value_t = 1)]
        stripes: usize,
        /// After the measured runs, run the TLS hop once more with `perf record -g`
        /// attached to one transferd (--profile-side) and report where its cycles went.
        #[arg(long)]
        profile: bool,
        /// The daemon the profiled run records.
        #[arg(long, value_enum, default_value = "receiver")]
        profile_side: scenario::Side,
        /// Keep perf's data file of the profiled run here (implies --profile).
        #[arg(long)]
        profile_data: Option<PathBuf>,
        /// The transport of the profiled run: tcp (TLS over TCP) or quic.
        #[arg(long, default_value = "tcp")]
        profile_transport: shardcast_protocol::HopTransport,
        /// The memory reserve both daemons keep and fill before each run (transferd's
        /// `--memory-reserve`): auto (one spare per shard, each the largest shard's size),
        /// off, or a size.
        #[arg(long, default_value = "auto")]
        memory_reserve: scenario::BenchReserve,
        /// Write the report as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        #[command(flatten)]
        start: StartArgs,
    },
    /// The GPU loader: network, PCIe and NVLink stages alone, then streamed together
    /// (simulated devices by default; --backend cuda on a GPU host).
    Loader {
        /// simulated or cuda.
        #[arg(long, default_value = "simulated")]
        backend: String,
        /// Model size.
        #[arg(long, default_value = "512MiB", value_parser = parse_size)]
        size: u64,
        /// Safetensors shards.
        #[arg(long, default_value_t = 4)]
        shards: usize,
        /// GPUs (two: PCIe to the first, NVLink to the second).
        #[arg(long, default_value_t = 2)]
        gpus: u32,
        /// Rate at which chunks arrive (the chain transfer).
        #[arg(long, default_value = "600MB/s")]
        net_rate: String,
        /// Simulated host-to-device rate (kept below what 2 host cores can copy, so the
        /// simulation is paced, not CPU-bound).
        #[arg(long, default_value = "400MB/s")]
        pcie_rate: String,
        /// Simulated GPU-to-GPU rate.
        #[arg(long, default_value = "1GB/s")]
        nvlink_rate: String,
        /// Staging buffers.
        #[arg(long, default_value_t = 8)]
        staging_buffers: usize,
        /// Bytes per staging buffer.
        #[arg(long, default_value = "4MiB", value_parser = parse_size)]
        staging_size: u64,
        /// Threads filling staging buffers [default: the CPU count, at most 4].
        #[arg(long)]
        fill_threads: Option<usize>,
        /// Host → GPU path: registered (DMA straight from the mapped model files; falls
        /// back to staging if the device refuses to register them) or staging.
        #[arg(long, default_value = "registered", value_parser = parse_host_path)]
        host_path: gpu_loader::loader::HostPath,
        /// Copy streams per GPU on the registered path (1 to 8).
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u8).range(1..=8))]
        copy_streams: u8,
        /// Bytes registered (pinned) at a time on the registered path, ahead of the copies.
        #[arg(long, default_value = "128MiB", value_parser = parse_size)]
        register_segment: u64,
        /// Least bytes per copy on the registered path (verified chunks are coalesced).
        #[arg(long, default_value = "16MiB", value_parser = parse_size)]
        copy_size: u64,
        /// Keep registrations between loads, as transferd does while a shard stays in the
        /// memory tier (the PCIe pass then reuses those of its first pass).
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        keep_registrations: bool,
        /// Register the model's mappings ahead of the first load, as transferd does for the
        /// memory tier's complete shards while no load runs, and report how long pinning
        /// alone took (`register_ahead_s`); the first load then pins nothing. Needs the
        /// registered path with kept registrations.
        #[arg(long)]
        register_ahead: bool,
        /// What the streamed pipeline does with its fresh mappings (the model's files mapped
        /// anew, as when the shards have just arrived): `stage` copies them through the
        /// staging ring (transferd's default with register_ahead), `register` pins them as it
        /// copies. The PCIe stage alone always takes the registered path, so it stays the
        /// bound.
        #[arg(long, default_value = "stage")]
        fresh: gpu_loader::loader::FreshMappings,
        /// Directory for the model's shard files, which are mapped (memory-backed like the
        /// memory tier) [default: /dev/shm, else the temp dir].
        #[arg(long)]
        model_dir: Option<PathBuf>,
        /// Also measure a partitioned load: the last of this many partitions first, then
        /// completion (0: skip).
        #[arg(long, default_value_t = 4)]
        partitions: u32,
        /// Write the report as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The controller at datacenter scale: a real `shardcast-controller` under a swarm of
    /// simulated hosts in this process (real heartbeats with a certificate each, the real
    /// agent API; NO bytes move: transfers are simulated at `--link-rate`). Heartbeat and
    /// status-API latency, then a prewarm of `--replicas` (plan time, time to done).
    Scale {
        /// Simulated hosts.
        #[arg(long, default_value_t = 1000)]
        hosts: usize,
        /// Racks they are spread over.
        #[arg(long, default_value_t = 25)]
        racks: usize,
        /// Replicas of the prewarm.
        #[arg(long, default_value_t = 64)]
        replicas: u32,
        /// Heartbeat period (the controller's --heartbeat-ms).
        #[arg(long, default_value_t = 1000)]
        heartbeat_ms: u64,
        /// Model size (simulated).
        #[arg(long, default_value = "4GiB", value_parser = parse_size)]
        size: u64,
        /// Shards of the model.
        #[arg(long, default_value_t = 4)]
        shards: usize,
        /// Simulated per-host link rate.
        #[arg(long, default_value = "10Gbit")]
        link_rate: String,
        /// Simulated origin rate per connection.
        #[arg(long, default_value = "2.5Gbit")]
        origin_rate: String,
        /// Seconds of steady state (heartbeats and status queries, no plan) measured.
        #[arg(long, default_value_t = 20)]
        window_s: u64,
        /// Longest wait for the hosts to come up, and for the prewarm.
        #[arg(long, default_value_t = 180)]
        timeout_s: u64,
        /// Run the controller in its documented plaintext mode (no certificates).
        #[arg(long)]
        insecure: bool,
        /// An extra flag for the controller, passed through unchanged (repeatable), e.g.
        /// another state backend: `--controller-arg=--state-dir=/fast/disk`.
        #[arg(long = "controller-arg", allow_hyphen_values = true)]
        controller_args: Vec<String>,
        /// Where the controllers keep their state: `embedded` (one controller, redb) or
        /// `etcd` (an etcd member started on loopback and `--controllers` replicas on it;
        /// hosts heartbeat to every replica and follow the leader).
        #[arg(long, default_value = "embedded")]
        store: shardcast_bench::scale::StoreKind,
        /// Controller replicas (etcd only).
        #[arg(long, default_value_t = 1)]
        controllers: usize,
        /// After the measured prewarm, run a second one and SIGKILL the leader during it:
        /// how long hosts could not heartbeat, and whether the new leader finishes the plan
        /// (etcd, at least 2 replicas).
        #[arg(long)]
        kill_leader: bool,
        /// Write the report as JSON too.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Origin read throughput: one model read by a real transferd (streaming GETs to build
    /// the manifest, then parallel ranged GETs into its memory tier, verified) from this
    /// tool's HTTP origin server and from S3-compatible servers (moto, s3rver; installed
    /// under the target directory on first use), on loopback or with --emulate across one
    /// link capped by tc (needs root), next to iperf3 over the same link.
    Origin {
        /// Servers in one namespace, the reader in another, joined by a capped link.
        #[arg(long)]
        emulate: bool,
        /// Model size.
        #[arg(long, default_value = "512MiB", value_parser = parse_size)]
        size: u64,
        /// Safetensors shards (one S3 object each).
        #[arg(long, default_value_t = 4)]
        shards: usize,
        /// The link's cap (with --emulate).
        #[arg(long, default_value = "1Gbit")]
        rate: String,
        /// Comma-separated servers: http, moto, s3rver.
        #[arg(long, default_value = "http,s3rver,moto", value_delimiter = ',')]
        origins: Vec<shardcast_bench::origin_bench::OriginKind>,
        /// Concurrent ranged GETs of the reader [default: transferd's].
        #[arg(long)]
        origin_parallel: Option<usize>,
        /// Manifest chunk size: the size of each ranged GET [default: transferd's, 1 MiB].
        #[arg(long, value_parser = parse_size)]
        chunk_size: Option<u64>,
        /// Seconds iperf3 measures the link's raw TCP rate (0: skip).
        #[arg(long, default_value_t = 5)]
        iperf_seconds: u32,
        /// Limit on each read, seconds.
        #[arg(long, default_value_t = 600)]
        timeout_s: u64,
        /// Write the report as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// (Internal, for `origin --emulate`) relays TCP connections to LISTEN on to TO.
    #[command(hide = true)]
    Relay {
        /// Listen address.
        #[arg(long)]
        listen: String,
        /// Where each connection is relayed.
        #[arg(long)]
        to: std::net::SocketAddr,
        /// Exit after this many seconds.
        #[arg(long, default_value_t = 3600)]
        lifetime_s: u64,
    },
    /// The datacenter simulator: the real controller (registration, inventory, placement,
    /// chain plans, plan runner) on a paused clock, driving simulated hosts over a
    /// flow-level spine-leaf network (default: Flashpoint's 200 hosts x 8 GPUs). Without
    /// --trace: one cold-start burst of a model per method (per-host ready times, average
    /// and p99 cold start, bytes from the origin). With --trace: trace-driven runs (request
    /// queue, replicas serving, an autoscaler scaling through the controller) for
    /// --duration of virtual time, one row per technique, next to the thesis' numbers.
    /// Progress on stderr.
    Simulate(Box<SimulateArgs>),
    /// A rate-capped HTTP origin server (cloud storage stand-in) for a directory.
    OriginServer {
        /// Directory to serve.
        #[arg(long)]
        dir: PathBuf,
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        /// Total egress cap.
        #[arg(long, default_value = "unlimited")]
        rate: String,
        /// Also write the counters as JSON to this file, every 100 ms and on exit (for
        /// callers that cannot reach `/_stats`, e.g. from outside the server's namespace).
        #[arg(long)]
        stats_file: Option<PathBuf>,
    },
}

/// `simulate`'s options (defaults: Flashpoint's datacenter, thesis §8.2.2 and §8.4).
#[derive(clap::Args)]
struct SimulateArgs {
    /// The model: a name or label of Flashpoint's Table 3.1 (codebert-base,
    /// albert-xxlarge-v2, bart-large, dialogpt-large, gpt2-xl, t5-3b).
    #[arg(long, default_value = "t5-3b")]
    model: String,
    /// Hosts.
    #[arg(long, default_value_t = 200)]
    hosts: usize,
    /// GPUs per host.
    #[arg(long, default_value_t = 8)]
    gpus_per_host: u32,
    /// Hosts under each leaf switch.
    #[arg(long, default_value_t = 20)]
    hosts_per_leaf: usize,
    /// GPU replicas in the burst (default: one per host).
    #[arg(long)]
    replicas: Option<u32>,
    /// Hosts holding the model in host memory before the burst (spread over the leaves):
    /// they fill their own GPUs first and are the chains' sources.
    #[arg(long, default_value_t = 0)]
    warm: usize,
    /// Host link rate, Gbit/s each way.
    #[arg(long, default_value_t = 50.0)]
    host_gbps: f64,
    /// Leaf-to-spine link rate, Gbit/s each way.
    #[arg(long, default_value_t = 100.0)]
    leaf_gbps: f64,
    /// One origin stream's rate, Gbit/s (the thesis measured 2.203 for one S3 client; 0:
    /// unlimited).
    #[arg(long, default_value_t = 2.203)]
    origin_stream_gbps: f64,
    /// The cluster's total rate from the origin, Gbit/s (the thesis' simulator: the
    /// effective bandwidth from the compute cluster to cloud storage, 2.203; 0: unlimited,
    /// streams limited only by --origin-stream-gbps).
    #[arg(long, default_value_t = 2.203)]
    origin_link_gbps: f64,
    /// The most one host-to-host hop moves, Gbit/s (a chain hop's CPU limit; 0: links
    /// only).
    #[arg(long, default_value_t = 0.0)]
    hop_gbps: f64,
    /// Host memory to usable tensors, MB/s (thesis: T5-3B's 11,408 MB in 14.138 s).
    #[arg(long)]
    load_mbps: Option<f64>,
    /// Host to GPU copy, MB/s (thesis: T5-3B's 11,408 MB in 1.206 s on an A10).
    #[arg(long)]
    gpu_mbps: Option<f64>,
    /// Methods to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "baseline,chain")]
    methods: Vec<shardcast_bench::sim::coldstart::Method>,
    /// Heartbeat period of the simulated hosts, seconds (default: 1 for a burst, 5 for
    /// --trace, where placement sees a new copy at most that late and 200 hosts cost
    /// 40 heartbeats a virtual second).
    #[arg(long)]
    heartbeat_s: Option<f64>,
    /// The plan runner's poll tick, seconds. The simulated agents push every change (and
    /// progress every 2 s), so the tick only paces stall detection: the results are the
    /// same at the controller's 0.25 s default, which costs 4 rounds over every receiver
    /// each virtual second.
    #[arg(long, default_value_t = 1.0)]
    poll_s: f64,
    /// Give up on a burst after this much virtual time, seconds.
    #[arg(long, default_value_t = 86_400.0)]
    limit_s: f64,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw SVG plots of the report into this directory (created if missing): ready-time
    /// CDFs, bytes by source tier over time, and with --trace replicas and queue over time.
    #[arg(long, value_name = "DIR")]
    plots: Option<PathBuf>,
    /// Trace-driven mode: `twitter` or `azure` (seeded generators with the thesis'
    /// statistics), or `azure:FILE` / `azure:FILE#FUNCTION` (an Azure Functions 2019
    /// invocation-count CSV, all functions summed or one), comma-separated.
    #[arg(long, value_delimiter = ',')]
    trace: Vec<String>,
    /// --trace: virtual time to run (the trace is cut to it), e.g. 1h, 10m.
    #[arg(long, default_value = "1h")]
    duration: humantime::Duration,
    /// --trace: the models, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "t5-3b,gpt2-xl")]
    models: Vec<String>,
    /// --trace: the autoscalers (tsk, atl, owk, sm, shardcast; controller: the controller's own
    /// Autoscaler service), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "atl")]
    autoscaler: Vec<shardcast_bench::sim::scalers::ScalerKind>,
    /// --trace: the techniques (rows), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "baseline,locality,multicast,partitioning,locality-multicast,combined"
    )]
    techniques: Vec<shardcast_bench::sim::workload::Technique>,
    /// --trace: most partitions a partitioned burst uses (the partition table's P; the
    /// controller's default is 8, its limit 64).
    #[arg(long, default_value_t = 8)]
    max_partitions: usize,
    /// --trace: seed of the generated traces and of the Poisson arrivals.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// --trace: seconds after the trace to let the queue drain.
    #[arg(long, default_value_t = 600.0)]
    drain_s: f64,
    /// Replay a `cold-start --emulate --json` report in the simulator with the report's own
    /// parameters (hosts, shards, chunk size, link and origin rates) and compare each
    /// method's per-host ready times with the measured ones (the other burst options are
    /// ignored).
    #[arg(long, value_name = "REPORT")]
    emulated: Option<PathBuf>,
    /// Faults injected into the burst, comma-separated, each `KIND@WHERE:AT[+FOR]`:
    /// KIND `link-down` (the host's link down for FOR, then back: a hop stalls) or `lost`
    /// (killed, never back; alias `kill`); WHERE `head`, `middle` or `tail` of the burst's
    /// first chain, `random` (a host of a flow in progress, --fault-seed), or a host id
    /// (`h0042`); AT and FOR in seconds after the prewarm (`3`, `3s`, `500ms`). E.g.
    /// `link-down@middle:3s+8s`, `lost@head:5s`. Each method then runs twice, without and
    /// with the faults; the recoveries follow transferd's chain rules and the controller's
    /// own re-plans. The report (--json) holds per affected host its ready time against
    /// the no-fault run, the origin bytes × the model and the events; --plots draws
    /// `<method>-fault-timeline.svg`.
    #[arg(long, value_name = "SPEC")]
    faults: Option<String>,
    /// --faults: seed of the `random` targets.
    #[arg(long, default_value_t = 1)]
    fault_seed: u64,
    /// Replay a `faults --emulate --json` report in the simulator with its parameters
    /// (hosts, model bytes, link rate, fault time; one shard, the origin at the link rate)
    /// and compare the healthy hosts' ready time (× no fault) and the origin bytes (× the
    /// model) per fault and position (`link-down` only; the other options are ignored).
    #[arg(long, value_name = "REPORT")]
    replay_faults: Option<PathBuf>,
    /// --trace: start from nothing (no replica, no copy in the cluster) instead of making
    /// the first minute's replicas warm: the first scale-up then reads the origin in every
    /// row.
    #[arg(long)]
    cold_cluster: bool,
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHARDCAST_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // The simulator runs its own paused runtime: not inside the multi-threaded one.
    if let Cmd::Simulate(args) = cli.command {
        return match simulate(*args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("shardcast-bench simulate: {e:#}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("shardcast-bench: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        tokio::select! {
            r = run(cli) => r,
            sig = interrupted() => {
                eprintln!("{sig}: stopping daemons and removing namespaces");
                Ok(())
            }
        }
    });
    // Dropping the runtime drops every daemon (killed by PID) and namespace (deleted).
    drop(runtime);
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shardcast-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Resolves on SIGINT or SIGTERM; returning from `main` then drops every daemon (killed by
/// PID), scratch directory and emulated network (deleted).
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return "interrupted";
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "interrupted",
        _ = term.recv() => "terminated",
    }
}

/// `simulate`: one cold-start burst per method, a table on stdout, the report as JSON.
fn simulate(a: SimulateArgs) -> anyhow::Result<()> {
    use shardcast_bench::sim::{coldstart, dc, models, net, params, plots};
    if let Some(path) = &a.emulated {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let report: shardcast_bench::managed::ColdStartReport = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a cold-start report", path.display()))?;
        let replays = params::replay(&report)?;
        print!("{}", params::table(&replays));
        if let Some(dir) = &a.plots {
            write_plots("simulate", dir, &plots::replay_figures(&report, &replays))?;
        }
        if let Some(json) = &a.json {
            std::fs::write(json, serde_json::to_vec_pretty(&replays)?)
                .with_context(|| format!("writing {}", json.display()))?;
        }
        return Ok(());
    }
    if let Some(path) = &a.replay_faults {
        use shardcast_bench::sim::fault_replay;
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let report: fault_replay::EmulatedFaults = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a faults report", path.display()))?;
        let replays = fault_replay::replay(&report)?;
        print!("{}", fault_replay::table(&replays));
        if let Some(json) = &a.json {
            std::fs::write(json, serde_json::to_vec_pretty(&replays)?)
                .with_context(|| format!("writing {}", json.display()))?;
        }
        if let Some(dir) = &a.plots {
            for r in &replays {
                if let Some(sim) = &r.simulated {
                    let name = format!("replay-{}-{}", r.fault, r.position);
                    let t = shardcast_bench::sim::fault_plot::timeline(&name, sim);
                    let path = shardcast_bench::sim::fault_plot::write(dir, &t)?;
                    eprintln!("simulate: plot written to {}", path.display());
                }
            }
        }
        return Ok(());
    }
    let model = models::find(&a.model).with_context(|| {
        let names: Vec<&str> = models::TABLE_3_1.iter().map(|m| m.name).collect();
        format!("unknown model {:?}; one of {}", a.model, names.join(", "))
    })?;
    anyhow::ensure!(
        a.hosts > 0 && a.hosts_per_leaf > 0,
        "hosts must be at least 1"
    );
    let positive = |g: f64| (g > 0.0).then(|| net::gbit(g));
    let mut phases = models::Phases::flashpoint();
    if let Some(r) = a.load_mbps {
        phases.load_bps = r * 1e6;
    }
    if let Some(r) = a.gpu_mbps {
        phases.gpu_bps = r * 1e6;
    }
    anyhow::ensure!(
        phases.load_bps > 0.0 && phases.gpu_bps > 0.0,
        "load and GPU rates must be positive"
    );
    let secs = |s: f64, what: &str| {
        Duration::try_from_secs_f64(s)
            .ok()
            .filter(|d| !d.is_zero())
            .with_context(|| format!("{what} must be a positive number of seconds"))
    };
    let dc_cfg = dc::DcConfig {
        topology: net::Topology {
            hosts: a.hosts,
            hosts_per_leaf: a.hosts_per_leaf,
            host_link_bps: net::gbit(a.host_gbps),
            leaf_uplink_bps: net::gbit(a.leaf_gbps),
            origin_link_bps: positive(a.origin_link_gbps),
            origin_stream_bps: positive(a.origin_stream_gbps),
        },
        gpus_per_host: a.gpus_per_host,
        // The thesis' A10s (24 GB) and 200 GiB hosts (§8.1.1).
        gpu_memory: 24 << 30,
        host_memory: 200 << 30,
        phases,
        chunk_size: shardcast_protocol::manifest::DEFAULT_CHUNK_SIZE,
        hop_cap_bps: positive(a.hop_gbps),
        progress_period: dc::PROGRESS_PERIOD,
        origin_parallel: dc::ORIGIN_PARALLEL,
    };
    anyhow::ensure!(
        a.host_gbps > 0.0 && a.leaf_gbps > 0.0,
        "link rates must be positive"
    );
    if !a.trace.is_empty() {
        return simulate_trace(&a, dc_cfg);
    }
    let spec = coldstart::ColdStart {
        dc: dc_cfg,
        model: model.clone(),
        replicas: a.replicas.unwrap_or(a.hosts as u32),
        warm: a.warm,
        tier: shardcast_placement::Tier::Gpu,
        heartbeat: secs(a.heartbeat_s.unwrap_or(1.0), "--heartbeat-s")?,
        poll: secs(a.poll_s, "--poll-s")?,
        limit: secs(a.limit_s, "--limit-s")?,
    };
    if let Some(list) = &a.faults {
        return simulate_faults(&a, &spec, list);
    }
    let wall = std::time::Instant::now();
    let mut rows = Vec::new();
    for method in &a.methods {
        eprintln!(
            "simulate: {} of {} onto {} of {} hosts ({})...",
            spec.replicas,
            model.name,
            spec.replicas.min(a.hosts as u32),
            a.hosts,
            method.label()
        );
        let row = coldstart::run(&spec, *method)?;
        eprintln!(
            "simulate:   {} ready, plan {}, avg {:.2} s, p99 {:.2} s, {:.1} GB from the origin; {:.1} s virtual in {:.2} s",
            row.ready,
            row.plan_state,
            row.avg_cold_start_s,
            row.p99_cold_start_s,
            row.bytes_from_origin / 1e9,
            row.virtual_s,
            row.wall_s
        );
        rows.push(row);
    }
    let report = coldstart::Report::new(&spec, rows, wall.elapsed().as_secs_f64());
    println!("{}", report.table());
    if let Some(path) = a.json {
        std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("simulate: report written to {}", path.display());
    }
    if let Some(dir) = &a.plots {
        write_plots("simulate", dir, &plots::burst_figures(&report))?;
    }
    Ok(())
}

/// `simulate --faults`: each method without and with the faults, the tables on stdout, the
/// reports as JSON, a fault timeline per method.
fn simulate_faults(
    a: &SimulateArgs,
    spec: &shardcast_bench::sim::coldstart::ColdStart,
    list: &str,
) -> anyhow::Result<()> {
    use shardcast_bench::sim::{fault_plot, faults};
    let specs = faults::parse_faults(list)?;
    anyhow::ensure!(!specs.is_empty(), "--faults names no fault");
    let wall = std::time::Instant::now();
    let mut reports = Vec::new();
    for method in &a.methods {
        eprintln!(
            "simulate: {} of {} onto {} hosts ({}), without and with {list}...",
            spec.replicas,
            spec.model.name,
            a.hosts,
            method.label()
        );
        let r = faults::run(spec, *method, &specs, a.fault_seed)?;
        println!("{}", faults::table(&r));
        reports.push(r);
    }
    eprintln!(
        "simulate: {} runs in {:.2} s",
        reports.len() * 2,
        wall.elapsed().as_secs_f64()
    );
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&reports)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("simulate: report written to {}", path.display());
    }
    if let Some(dir) = &a.plots {
        for r in &reports {
            let name = format!("{:?}", r.method).to_lowercase();
            let path = fault_plot::write(dir, &fault_plot::timeline(&name, r))?;
            eprintln!("simulate: plot written to {}", path.display());
        }
    }
    Ok(())
}

/// Draws `figures` into `dir` and says which files it wrote.
fn write_plots(
    what: &str,
    dir: &std::path::Path,
    figures: &[shardcast_bench::sim::plots::Figure],
) -> anyhow::Result<()> {
    for path in shardcast_bench::sim::plots::write(dir, figures)? {
        eprintln!("{what}: plot written to {}", path.display());
    }
    Ok(())
}

/// `simulate --trace`: every model × trace × autoscaler × technique, progress on stderr,
/// the tables on stdout, the report as JSON.
fn simulate_trace(
    a: &SimulateArgs,
    dc_cfg: shardcast_bench::sim::dc::DcConfig,
) -> anyhow::Result<()> {
    use shardcast_bench::sim::compare::{self, Comparison, TraceParams, TraceReport};
    use shardcast_bench::sim::{models, trace, workload};
    let duration = a.duration.as_secs_f64();
    anyhow::ensure!(duration >= 1.0, "--duration must be at least 1 s");
    let heartbeat = a.heartbeat_s.unwrap_or(5.0);
    let secs = |s: f64, what: &str| {
        Duration::try_from_secs_f64(s)
            .ok()
            .filter(|d| !d.is_zero())
            .with_context(|| format!("{what} must be a positive number of seconds"))
    };
    let mut traces = Vec::new();
    for t in &a.trace {
        let rate = match t.as_str() {
            "twitter" => trace::generate(
                &trace::TraceShape::twitter(),
                duration.ceil() as usize,
                a.seed,
            ),
            "azure" => trace::generate(
                &trace::TraceShape::azure(),
                duration.ceil() as usize,
                a.seed,
            ),
            other => {
                let spec = other.strip_prefix("azure:").with_context(|| {
                    format!("unknown trace {other:?}: twitter, azure, or azure:FILE[#FUNCTION]")
                })?;
                let (file, pick) = match spec.split_once('#') {
                    Some((f, func)) => (f, trace::AzurePick::Function(func.to_string())),
                    None => (spec, trace::AzurePick::Sum),
                };
                let f = std::fs::File::open(file).with_context(|| format!("opening {file}"))?;
                trace::read_azure(std::io::BufReader::new(f), &pick)
                    .with_context(|| format!("reading {file}"))?
            }
        };
        let mut rate = rate;
        rate.truncate(duration);
        traces.push((t.clone(), rate));
    }
    let mut models_run = Vec::new();
    for m in &a.models {
        models_run.push(
            models::find(m)
                .with_context(|| format!("unknown model {m:?}"))?
                .clone(),
        );
    }
    let wall = std::time::Instant::now();
    let mut comparisons = Vec::new();
    for model in &models_run {
        for (trace_name, rate) in &traces {
            for scaler in &a.autoscaler {
                let mut rows = Vec::new();
                for technique in &a.techniques {
                    if technique.partitions()
                        && *scaler == shardcast_bench::sim::scalers::ScalerKind::Controller
                    {
                        eprintln!(
                            "simulate: {} {trace_name} controller {technique:?}: skipped — the controller's Autoscaler is wired without partitioned bursts here (sim::autoscaler)",
                            model.name
                        );
                        continue;
                    }
                    let spec = workload::TraceRun {
                        dc: dc_cfg.clone(),
                        model: model.clone(),
                        trace: rate.clone(),
                        trace_name: trace_name.clone(),
                        seed: a.seed,
                        scaler: *scaler,
                        technique: *technique,
                        heartbeat: secs(heartbeat, "--heartbeat-s")?,
                        poll: secs(a.poll_s, "--poll-s")?,
                        tick: Duration::from_secs(1),
                        drain_s: a.drain_s.max(0.0),
                        sample_s: 10.0,
                        warm_start: !a.cold_cluster,
                        max_partitions: a.max_partitions,
                    };
                    let what =
                        format!("{} {} {:?} {:?}", model.name, trace_name, scaler, technique)
                            .to_lowercase();
                    let row = workload::run(&spec, &mut |p| {
                        eprintln!(
                            "simulate: {what}: {:>5.0}/{:.0} s, {} replicas ({} serving), queue {}, {:.1} s wall",
                            p.t, p.duration, p.replicas, p.serving, p.queue, p.wall_s
                        );
                    })?;
                    eprintln!(
                        "simulate: {what}: {} cold starts avg {:.2} s p99 {:.2} s, e2e avg {:.2} s p99 {:.2} s, {:.1} replica-h, {:.1} GB from the origin; {:.0} s virtual in {:.2} s",
                        row.cold_starts,
                        row.avg_cold_start_s,
                        row.p99_cold_start_s,
                        row.avg_e2e_s,
                        row.p99_e2e_s,
                        row.replica_seconds / 3600.0,
                        row.bytes_from_origin / 1e9,
                        row.virtual_s,
                        row.wall_s
                    );
                    rows.push(row);
                }
                comparisons.extend(Comparison::new(rows));
            }
        }
    }
    let t = &dc_cfg.topology;
    let g = |bps: f64| bps * 8.0 / 1e9;
    let report = TraceReport {
        params: TraceParams {
            hosts: t.hosts,
            gpus_per_host: dc_cfg.gpus_per_host,
            hosts_per_leaf: t.hosts_per_leaf,
            host_gbps: g(t.host_link_bps),
            leaf_gbps: g(t.leaf_uplink_bps),
            origin_link_gbps: t.origin_link_bps.map(g),
            origin_stream_gbps: t.origin_stream_bps.map(g),
            duration_s: duration,
            seed: a.seed,
            heartbeat_s: heartbeat,
            poll_s: a.poll_s,
            tick_s: 1.0,
            warm_start: !a.cold_cluster,
        },
        comparisons,
        wall_s: wall.elapsed().as_secs_f64(),
        peak_rss_bytes: compare::peak_rss_bytes(),
    };
    println!("{}", report.table());
    eprintln!(
        "simulate: {:.1} s wall, peak RSS {}",
        report.wall_s,
        report
            .peak_rss_bytes
            .map_or_else(|| "unknown".into(), |b| format!("{:.1} MB", b as f64 / 1e6))
    );
    if let Some(path) = &a.json {
        // Compact: the timelines and cold-start lists of 8 runs are ≈ 0.5 MB this way,
        // more than twice that pretty-printed.
        std::fs::write(path, serde_json::to_vec(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("simulate: report written to {}", path.display());
    }
    if let Some(dir) = &a.plots {
        write_plots(
            "simulate",
            dir,
            &shardcast_bench::sim::plots::trace_figures(&report),
        )?;
    }
    Ok(())
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Cmd::Simulate(_) => anyhow::bail!("simulate runs on its own runtime, before this one"),
        Cmd::Scale {
            hosts,
            racks,
            replicas,
            heartbeat_ms,
            size,
            shards,
            link_rate,
            origin_rate,
            window_s,
            timeout_s,
            insecure,
            controller_args,
            store,
            controllers,
            kill_leader,
            json,
        } => {
            let opts = shardcast_bench::scale::ScaleOpts {
                hosts,
                racks,
                replicas,
                heartbeat_ms,
                size,
                shards,
                link_bps: finite_rate("link-rate", &link_rate)?,
                origin_bps: finite_rate("origin-rate", &origin_rate)?,
                window: Duration::from_secs(window_s),
                timeout: Duration::from_secs(timeout_s),
                insecure,
                controller_args,
                store,
                controllers,
                kill_leader,
            };
            let report = shardcast_bench::scale::run_scale(&opts).await?;
            eprint!("{}", shardcast_bench::scale::summary(&report));
            emit(&report, json)
        }
        Cmd::Burst {
            size,
            shards,
            partitions,
            pcie_rate,
            json,
        } => {
            let opts = shardcast_bench::managed::BurstOpts {
                size,
                shards,
                partitions,
                pcie_rate: parse_rate(&pcie_rate)
                    .map_err(anyhow::Error::msg)?
                    .context("--pcie-rate must be a finite rate")?,
            };
            let report = shardcast_bench::managed::run_burst(&opts).await?;
            emit(&report, json)
        }
        Cmd::Failover {
            trials,
            hosts,
            lease_ttl_ms,
            json,
        } => {
            let opts = shardcast_bench::ha::FailoverOpts {
                trials,
                hosts,
                lease_ttl_ms,
            };
            let report = shardcast_bench::ha::run_failover(&opts).await?;
            eprintln!(
                "fail-over (SIGKILL of the leader → first accepted write) over {} trials: median {:.2} s, max {:.2} s",
                report.trials.len(),
                report.median_s,
                report.max_s
            );
            emit(&report, json)
        }
        Cmd::Demo {
            size,
            shards,
            hosts,
            rate,
            origin_rate,
            json,
        } => {
            let opts = shardcast_bench::managed::DemoOpts {
                size,
                shards,
                hosts,
                rate: parse_rate(&rate).map_err(anyhow::Error::msg)?,
                origin_rate: parse_rate(&origin_rate).map_err(anyhow::Error::msg)?,
                progress: true,
            };
            let steps = shardcast_bench::managed::run_demo(&opts).await?;
            println!("{}", shardcast_bench::managed::demo_table(&steps, size));
            if let Some(path) = json {
                scenario::write_json(&path, &steps)?;
            }
            Ok(())
        }
        Cmd::Faults {
            emulate: _,
            hosts,
            size,
            shards,
            rate,
            origin_rate,
            faults,
            positions,
            trials,
            at_s,
            timeout_s,
            json,
            daemon_args,
        } => {
            prepare_emulation()?;
            if !(0.0..=3600.0).contains(&at_s) {
                anyhow::bail!("--at-s must be between 0 and 3600, got {at_s}");
            }
            let opts = shardcast_bench::faults::FaultsOpts {
                hosts,
                size,
                shards,
                rate: finite_rate("rate", &rate)?,
                origin_rate: finite_rate("origin-rate", &origin_rate)?,
                faults,
                positions,
                trials,
                at: Duration::from_secs_f64(at_s),
                timeout: Duration::from_secs(timeout_s),
                daemon_args,
            };
            let report = shardcast_bench::faults::run_faults(&opts).await?;
            emit(&report, json)
        }
        Cmd::ColdStart {
            emulate: _,
            hosts,
            size,
            shards,
            rate,
            origin_rate,
            methods,
            timeout_s,
            json,
            plots,
        } => {
            prepare_emulation()?;
            let opts = shardcast_bench::managed::ColdStartOpts {
                hosts,
                size,
                shards,
                rate: finite_rate("rate", &rate)?,
                origin_rate: finite_rate("origin-rate", &origin_rate)?,
                methods,
                timeout: Duration::from_secs(timeout_s),
                progress: true,
            };
            let report = shardcast_bench::managed::run_cold_start(&opts).await?;
            emit(&report, json)?;
            if let Some(dir) = &plots {
                write_plots(
                    "cold-start",
                    dir,
                    &shardcast_bench::sim::plots::emulated_figures(&report),
                )?;
            }
            Ok(())
        }
        Cmd::Compare {
            size,
            shards,
            receivers,
            rate,
            json,
        } => {
            let rate = parse_rate(&rate).map_err(anyhow::Error::msg)?;
            let opts = DemoOpts {
                size,
                shards,
                receivers,
                rate,
                progress: true,
            };
            let rows = scenario::run_demo(&opts).await?;
            println!("{}", scenario::demo_table(&rows, size));
            if let Some(path) = json {
                scenario::write_json(&path, &rows)?;
            }
            Ok(())
        }
        Cmd::Chain {
            emulate,
            local: _,
            receivers,
            size,
            shards,
            rate,
            methods,
            json,
            timeout_s,
            chunk_size,
            window,
            loss,
            mtu,
            tcp_congestion,
            warm_up,
            data_mode,
            stripes,
            memory_reserve,
            daemon_args,
            start,
        } => {
            if loss.is_some() && !emulate {
                anyhow::bail!("--loss needs --emulate (it drops packets in the hosts' namespaces)");
            }
            if mtu.is_some() && !emulate {
                anyhow::bail!("--mtu needs --emulate (it sets the MTU of the hosts' links)");
            }
            if tcp_congestion.is_some() && !emulate {
                anyhow::bail!(
                    "--tcp-congestion needs --emulate (it is set in the hosts' namespaces)"
                );
            }
            let chunk_size = u32::try_from(chunk_size.unwrap_or(0))
                .map_err(|_| anyhow::anyhow!("--chunk-size is too large"))?;
            let mode = if emulate {
                NetMode::Emulate
            } else {
                NetMode::Local
            };
            if emulate {
                prepare_emulation()?;
            }
            let opts = ChainBenchOpts {
                shards,
                rate: parse_rate(&rate).map_err(anyhow::Error::msg)?,
                timeout: Duration::from_secs(timeout_s),
                progress: true,
                chunk_size,
                window: window.unwrap_or(0),
                loss_per_10000: loss.unwrap_or(0),
                mtu,
                tcp_congestion,
                warm_up,
                memory_reserve,
                daemon_args: data_mode
                    .daemon_args()
                    .into_iter()
                    .chain(scenario::stripe_args(stripes))
                    .chain(daemon_args)
                    .collect(),
                ..ChainBenchOpts::new(mode, receivers, size, methods)
            };
            let (page_cache, machine) = scenario::at_start(start.drop_caches)?;
            let mut report = scenario::run_chain_bench(&opts).await?;
            report.page_cache = page_cache;
            report.machine = machine;
            let text = serde_json::to_string_pretty(&report)?;
            println!("{text}");
            if let Some(path) = json {
                scenario::write_json(&path, &report)?;
            }
            Ok(())
        }
        Cmd::Hop {
            size,
            shards,
            stripes,
            profile,
            profile_data,
            profile_transport,
            profile_side,
            memory_reserve,
            json,
            start,
        } => {
            let method = match profile_transport {
                shardcast_protocol::HopTransport::Tcp => scenario::Method::ChainTcp,
                shardcast_protocol::HopTransport::Quic => scenario::Method::ChainQuic,
            };
            let profile = (profile || profile_data.is_some()).then_some(scenario::HopProfileOpts {
                keep: profile_data,
                method,
                side: profile_side,
            });
            let (page_cache, machine) = scenario::at_start(start.drop_caches)?;
            let mut report =
                scenario::run_hop_bench(size, shards, stripes, profile, memory_reserve, true)
                    .await?;
            report.page_cache = page_cache;
            report.machine = machine;
            emit(&report, json)
        }
        Cmd::Loader {
            backend,
            size,
            shards,
            gpus,
            net_rate,
            pcie_rate,
            nvlink_rate,
            staging_buffers,
            staging_size,
            fill_threads,
            host_path,
            copy_streams,
            register_segment,
            copy_size,
            keep_registrations,
            register_ahead,
            fresh,
            model_dir,
            partitions,
            json,
        } => {
            let opts = shardcast_bench::loader_bench::LoaderOpts {
                backend,
                size,
                shards,
                gpus,
                net_rate: finite_rate("net-rate", &net_rate)?,
                pcie_rate: finite_rate("pcie-rate", &pcie_rate)?,
                nvlink_rate: finite_rate("nvlink-rate", &nvlink_rate)?,
                staging_buffers,
                staging_size: usize::try_from(staging_size)?,
                fill_threads: fill_threads
                    .unwrap_or_else(|| gpu_loader::loader::LoadOptions::default().fill_threads),
                partitions,
                host_path,
                copy_streams: usize::from(copy_streams),
                register_segment,
                copy_size: usize::try_from(copy_size)?,
                keep_registrations,
                register_ahead,
                fresh,
                model_dir,
            };
            let report =
                tokio::task::spawn_blocking(move || shardcast_bench::loader_bench::run(&opts))
                    .await??;
            emit(&report, json)
        }
        Cmd::Origin {
            emulate,
            size,
            shards,
            rate,
            origins,
            origin_parallel,
            chunk_size,
            iperf_seconds,
            timeout_s,
            json,
        } => {
            let chunk_size = u32::try_from(chunk_size.unwrap_or(0))
                .map_err(|_| anyhow::anyhow!("--chunk-size is too large"))?;
            if emulate {
                prepare_emulation()?;
            }
            let opts = shardcast_bench::origin_bench::OriginBenchOpts {
                emulate,
                size,
                shards,
                rate: emulate.then(|| finite_rate("rate", &rate)).transpose()?,
                origins,
                origin_parallel,
                chunk_size,
                timeout: Duration::from_secs(timeout_s),
                iperf_seconds,
            };
            let report = shardcast_bench::origin_bench::run_origin_bench(&opts).await?;
            emit(&report, json)
        }
        Cmd::Relay {
            listen,
            to,
            lifetime_s,
        } => {
            shardcast_bench::origin_bench::relay(&listen, to, Duration::from_secs(lifetime_s)).await
        }
        Cmd::OriginServer {
            dir,
            listen,
            rate,
            stats_file,
        } => {
            let rate = parse_rate(&rate).map_err(anyhow::Error::msg)?;
            let listener = tokio::net::TcpListener::bind(&listen)
                .await
                .with_context(|| format!("binding {listen}"))?;
            let addr = listener.local_addr()?;
            eprintln!(
                "serving {} on http://{addr} (rate cap: {:?} B/s); stats at /_stats",
                dir.display(),
                rate
            );
            println!("READY http={addr}");
            let cancel = tokio_util::sync::CancellationToken::new();
            let stats: std::sync::Arc<shardcast_bench::origin_server::OriginStats> =
                std::sync::Arc::default();
            if let Some(path) = stats_file {
                tokio::spawn(shardcast_bench::origin_server::write_stats_loop(
                    stats.clone(),
                    path,
                    cancel.clone(),
                ));
            }
            let server = tokio::spawn(shardcast_bench::origin_server::serve(
                dir,
                listener,
                rate,
                stats,
                cancel.clone(),
            ));
            // Runs until SIGINT/SIGTERM ends `run` (see `main`).
            server.await.context("origin server task")?
        }
    }
}

/// Checks that emulated clusters can be built here (root, iproute2) and removes the
/// namespaces an interrupted earlier run left behind.
fn prepare_emulation() -> anyhow::Result<()> {
    shardcast_bench::netns::available()
        .map_err(|e| anyhow::anyhow!("--emulate needs root and iproute2: {e}"))?;
    let stale = shardcast_bench::netns::EmulatedNet::cleanup_stale()?;
    if stale > 0 {
        eprintln!("removed {stale} namespaces left by an earlier interrupted run");
    }
    Ok(())
}

/// The rate in flag `--name`, which must be finite.
/// A loss in percent (`1`, `0.5%`) as packets per 10 000.
fn parse_loss(s: &str) -> Result<u32, String> {
    let pct: f64 = s
        .trim()
        .trim_end_matches('%')
        .parse()
        .map_err(|_| format!("not a percentage: {s:?}"))?;
    if !(0.0..=100.0).contains(&pct) {
        return Err(format!("a loss is 0 to 100%, got {s}"));
    }
    Ok((pct * 100.0).round() as u32)
}

/// The daemons' data mode in `chain` (transferd's `--data-mode`, and `--sendfile`).
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum BenchDataMode {
    /// Mutual TLS, encrypted (transferd's default).
    Tls,
    /// The mutual-TLS handshake, then unencrypted.
    AuthenticateOnly,
    /// As `authenticate-only`, payloads sent by `sendfile` from the store's files.
    AuthenticateOnlySendfile,
}

impl BenchDataMode {
    fn daemon_args(self) -> Vec<String> {
        let args: &[&str] = match self {
            Self::Tls => &[],
            Self::AuthenticateOnly => &["--data-mode", "authenticate-only"],
            Self::AuthenticateOnlySendfile => {
                &["--data-mode", "authenticate-only", "--sendfile", "true"]
            }
        };
        args.iter().map(|a| a.to_string()).collect()
    }
}

fn finite_rate(name: &str, v: &str) -> anyhow::Result<u64> {
    parse_rate(v)
        .map_err(anyhow::Error::msg)?
        .ok_or_else(|| anyhow::anyhow!("--{name} must be a finite rate"))
}

/// Prints `report` as JSON, and writes it to `json` when given.
fn emit<T: serde::Serialize>(report: &T, json: Option<PathBuf>) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(report)?);
    if let Some(path) = json {
        scenario::write_json(&path, report)?;
    }
    Ok(())
}

/// `--host-path`: `registered` or `staging`.
fn parse_host_path(v: &str) -> Result<gpu_loader::loader::HostPath, String> {
    match v {
        "registered" => Ok(gpu_loader::loader::HostPath::Registered),
        "staging" => Ok(gpu_loader::loader::HostPath::Staging),
        other => Err(format!("expected registered or staging, got {other:?}")),
    }
}
