//! The daemon's metrics registry, served as `/metrics` by [`crate::admin`].
//!
//! [`registry`] builds one `prometheus_client` [`Registry`] at start-up (in
//! [`crate::daemon::run`]) and it is handed to the admin endpoint; nothing is global. Every
//! series carries the label `host` (this host's id), first, and the prefix `shardcast_`.
//! The text is the Prometheus text format 0.0.4 ([`CONTENT_TYPE`]): counters keep their
//! `_total` in the `# HELP`/`# TYPE` lines as they always had.
//!
//! Two kinds of series:
//!
//! * The counters and gauges of the data path stay plain atomics where they are counted
//!   (`NodeStats`, `ByteCounters`, `StoreStats`, the connection limits, the TLS and QUIC
//!   statistics): a chunk costs a relaxed `fetch_add`, no lock. [`NodeCollector`] reads
//!   them at scrape time and writes each under the name, type and labels it has always had
//!   (docs/OPERATIONS.md lists them).
//! * Histograms ([`Histogram`], lock-free: one atomic add per bucket hit and a
//!   compare-and-swap on the sum): the time to verify a chunk (BLAKE3 against the
//!   manifest, per chunk from a peer), and per receiver hop session its time to ready and
//!   its throughput (both once its range is verified here), and the time of each GPU load.
//!   Their handles live in [`DataMetrics`] (on the `Node`) and in `StoreStats`; the
//!   registry holds clones of the same handles.
//!
//! What it reads is what [`registry`] is given: the data plane's figures (a [`NodeView`]),
//! the store (for its statistics) and the GPU manager; it changes none of them.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use gpu_loader::manager::GpuManager;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::chain::NodeView;
use crate::store::ShardStore;

/// The `Content-Type` of `/metrics`: the Prometheus text format 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Bucket bounds of the histograms in seconds: 100 µs (one small chunk's hash) to 1000 s
/// (a large model's copy to a slow host).
pub const SECONDS_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0,
];

/// Bucket bounds of the throughput histogram in bytes per second: 1 MB/s to 100 GB/s.
pub const THROUGHPUT_BUCKETS: &[f64] = &[
    1e6, 1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11,
];

/// A histogram with fixed buckets, observed without a lock: [`Histogram::observe`] is an
/// atomic add on one bucket and a compare-and-swap on the sum. Clones share the counts
/// (the data path observes, the registry reads).
#[derive(Debug, Clone)]
pub struct Histogram(Arc<HistogramInner>);

#[derive(Debug)]
struct HistogramInner {
    /// Upper bounds, ascending; the last bucket (`+Inf`) is implied.
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative), `bounds.len() + 1` of them.
    counts: Box<[AtomicU64]>,
    /// The sum of the observations, as `f64` bits.
    sum: AtomicU64,
}

impl Default for Histogram {
    /// A histogram of seconds ([`SECONDS_BUCKETS`]).
    fn default() -> Self {
        Self::new(SECONDS_BUCKETS)
    }
}

impl Histogram {
    /// An empty histogram with buckets up to each of `bounds` (ascending) and `+Inf`.
    pub fn new(bounds: &'static [f64]) -> Self {
        Self(Arc::new(HistogramInner {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
        }))
    }

    /// Records one observation. A NaN is ignored (it has no bucket).
    pub fn observe(&self, v: f64) {
        if v.is_nan() {
            return;
        }
        let h = &self.0;
        let i = h.bounds.partition_point(|b| *b < v);
        h.counts[i].fetch_add(1, Ordering::Relaxed);
        let _ = h
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + v).to_bits())
            });
    }

    /// Records a duration in seconds.
    pub fn observe_duration(&self, d: Duration) {
        self.observe(d.as_secs_f64());
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.0
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// The sum of the observations so far.
    pub fn sum(&self) -> f64 {
        f64::from_bits(self.0.sum.load(Ordering::Relaxed))
    }

    /// `(upper bound, observations in that bucket)`, not cumulative, `+Inf` last.
    pub fn buckets(&self) -> Vec<(f64, u64)> {
        let h = &self.0;
        h.bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(h.counts.iter().map(|c| c.load(Ordering::Relaxed)))
            .collect()
    }
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), fmt::Error> {
        let buckets = self.buckets();
        // The count from the same reads as the buckets, so `+Inf` equals `_count`.
        let count = buckets.iter().map(|(_, n)| n).sum();
        encoder.encode_histogram::<NoLabelSet>(self.sum(), count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The histograms the data path feeds, created with the `Node` and registered by
/// [`registry`].
#[derive(Debug, Clone)]
pub struct DataMetrics {
    /// Per receiver hop session, bytes of its range over the seconds from joining the
    /// session to holding the range verified.
    pub hop_throughput: Histogram,
    /// Per receiver hop session, seconds from joining the session to holding its range
    /// verified.
    pub session_ready: Histogram,
    /// Seconds of each GPU load that made a model resident (`gpu-loader`'s own figure).
    pub gpu_load: Histogram,
    /// GPU loads that ended, by outcome: `[resident, failed]`.
    pub gpu_loads: Arc<[AtomicU64; 2]>,
}

impl Default for DataMetrics {
    fn default() -> Self {
        Self {
            hop_throughput: Histogram::new(THROUGHPUT_BUCKETS),
            session_ready: Histogram::default(),
            gpu_load: Histogram::default(),
            gpu_loads: Arc::default(),
        }
    }
}

impl DataMetrics {
    /// Records a receiver session whose `bytes` are verified here `elapsed` after it joined.
    pub fn session_ready(&self, bytes: u64, elapsed: Duration) {
        self.session_ready.observe_duration(elapsed);
        let secs = elapsed.as_secs_f64();
        if secs > 0.0 {
            self.hop_throughput.observe(bytes as f64 / secs);
        }
    }

    /// Records the end of a GPU load: `Some(seconds)` when the model became resident,
    /// `None` when it failed.
    pub fn gpu_load_done(&self, resident_after: Option<f64>) {
        match resident_after {
            Some(s) => {
                self.gpu_load.observe(s);
                self.gpu_loads[0].fetch_add(1, Ordering::Relaxed);
            }
            None => {
                self.gpu_loads[1].fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The daemon's registry: the data path's counters through [`NodeCollector`], and the
/// histograms of `view.metrics()` and of the store. Built once at start-up.
pub fn registry(view: &NodeView, store: &ShardStore, gpus: &Arc<GpuManager>) -> Registry {
    let mut r = Registry::with_prefix_and_labels(
        "shardcast",
        [("host".into(), view.host().to_string().into())].into_iter(),
    );
    let m = view.metrics();
    r.register(
        "chunk_verify_seconds",
        "Seconds to verify one chunk from a peer against the manifest (BLAKE3), per chunk",
        store.stats().chunk_verify.clone(),
    );
    r.register(
        "session_ready_seconds",
        "Per receiver hop session, seconds from joining the session to holding its range verified",
        m.session_ready.clone(),
    );
    r.register(
        "hop_throughput_bytes_per_second",
        "Per receiver hop session, the bytes of its range over the seconds it took to hold them verified",
        m.hop_throughput.clone(),
    );
    r.register(
        "gpu_load_seconds",
        "Seconds of each GPU load that made a model resident",
        m.gpu_load.clone(),
    );
    r.register_collector(Box::new(NodeCollector {
        view: view.clone(),
        store: store.clone(),
        gpus: gpus.clone(),
    }));
    r
}

/// Adds `shardcast_ready` to `registry`: 1 while `readiness` holds (what `/readyz` and
/// gRPC health answer), 0 otherwise, read at each scrape.
pub fn register_readiness(
    registry: &mut Registry,
    readiness: shardcast_identity::ready::Readiness,
) {
    registry.register_collector(Box::new(ReadyCollector(readiness)));
}

#[derive(Debug)]
struct ReadyCollector(shardcast_identity::ready::Readiness);

impl Collector for ReadyCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        series(
            &mut enc,
            "ready",
            Kind::Gauge,
            "1 when every readiness condition holds (listeners up, store recovered, the controller answered a heartbeat when one is configured) and shutdown has not begun, else 0: what /readyz and gRPC health answer.",
            u64::from(self.0.is_ready()),
        )
    }
}

/// `registry` as Prometheus text (0.0.4).
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String fails only if a metric's encoder does, and none of ours do.
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, registry) {
        tracing::warn!("encoding /metrics: {e}");
    }
    out
}

/// Reads the data path's atomics at scrape time (see the module docs).
pub struct NodeCollector {
    view: NodeView,
    store: ShardStore,
    gpus: Arc<GpuManager>,
}

impl fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeCollector")
            .field("host", self.view.host())
            .finish()
    }
}

/// A series' type as the collector writes it.
#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
}

/// Writes one unlabelled series (besides `host`) named `shardcast_<name>`: a counter's name
/// ends in `_total`, which the encoder adds back.
fn series(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    kind: Kind,
    help: &str,
    v: u64,
) -> fmt::Result {
    match kind {
        Kind::Counter => {
            let c = ConstCounter::new(v);
            let name = name.strip_suffix("_total").unwrap_or(name);
            c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)
        }
        Kind::Gauge => {
            let g = ConstGauge::new(v);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)
        }
    }
}

/// A counter family `shardcast_<name>` with one label besides `host`.
fn labelled(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    label: &str,
    values: impl IntoIterator<Item = (&'static str, u64)>,
) -> fmt::Result {
    let base = name.strip_suffix("_total").unwrap_or(name);
    let mut m = enc.encode_descriptor(base, help, None, MetricType::Counter)?;
    for (v, n) in values {
        ConstCounter::new(n).encode(m.encode_family(&[(label, v)])?)?;
    }
    Ok(())
}

impl Collector for NodeCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        use Kind::{Counter, Gauge};
        let view = &self.view;
        let (s, c) = (view.stats(), view.counters());
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let budget = view.frame_budget();
        let limits = view.conn_limits();
        let reserve = self.store.reserve_status();
        let rows: &[(&str, Kind, &str, u64)] = &[
            (
                "memory_reserve_bytes",
                Gauge,
                "Bytes of spare files of allocated pages the memory reserve holds for new shards.",
                reserve.held,
            ),
            (
                "memory_reserve_mapped_bytes",
                Gauge,
                "Bytes of the memory reserve's complete spares whose pages are mapped for the shard that takes them (its chunks are copied in, not pwritten).",
                reserve.mapped,
            ),
            (
                "memory_reserve_target_bytes",
                Gauge,
                "The memory_reserve setting (0: off).",
                reserve.config.bytes,
            ),
            (
                "memory_reserve_stopped",
                Gauge,
                "1 when the memory reserve stopped filling for good: the file system refused a spare's write (the log says why).",
                u64::from(reserve.refused.is_some()),
            ),
            (
                "scrub_yielding",
                Gauge,
                "1 while the background scrub waits for chunks to stop moving through this host.",
                load(&self.store.stats().scrub_yielding),
            ),
            (
                "memory_reserve_spare_bytes",
                Gauge,
                "The size the memory reserve's next spare gets (memory_reserve_spare, or what auto learned).",
                reserve.spare,
            ),
            (
                "bytes_received_total",
                Counter,
                "Bytes read from data-plane connections.",
                load(&c.received),
            ),
            (
                "bytes_sent_total",
                Counter,
                "Bytes written to data-plane connections.",
                load(&c.sent),
            ),
            (
                "sendfile_bytes_total",
                Counter,
                "Chunk payload bytes sent from the store's files by the kernel (sendfile, plaintext TCP): no copy through user space.",
                load(&c.sendfile_bytes),
            ),
            (
                "sendfile_refused_total",
                Counter,
                "Chunk payloads copied through user space because the kernel refused sendfile from their file (the first refusal is logged).",
                load(&c.sendfile_refused),
            ),
            (
                "chunks_verified_total",
                Counter,
                "Chunks verified and stored.",
                load(&s.chunks_verified),
            ),
            (
                "chunks_corrupt_total",
                Counter,
                "Chunks dropped after a hash mismatch.",
                load(&s.chunks_corrupt),
            ),
            (
                "chunks_sent_in_pieces_total",
                Counter,
                "Chunks sent downstream in verified pieces (ChunkHead and 256 KiB Pieces).",
                load(&s.chunks_sent_in_pieces),
            ),
            (
                "chunks_received_in_pieces_total",
                Counter,
                "Chunks received in verified pieces and stored.",
                load(&s.chunks_received_in_pieces),
            ),
            (
                "chunks_resent_total",
                Counter,
                "Chunks sent again after a Nack.",
                load(&s.chunks_resent),
            ),
            (
                "sessions_active",
                Gauge,
                "Chain sessions in progress.",
                load(&s.sessions_active),
            ),
            (
                "sessions_total",
                Counter,
                "Chain sessions started.",
                load(&s.sessions_total),
            ),
            (
                "origin_bytes_total",
                Counter,
                "Payload bytes fetched from origins.",
                load(&s.origin_bytes),
            ),
            (
                "manifest_bytes_total",
                Counter,
                "Bytes read from origins to build manifests (registration, imports).",
                load(&s.manifest_bytes),
            ),
            (
                "kept_bytes_total",
                Counter,
                "Bytes stored from the copy kept while building a manifest (the origin not read again).",
                load(&s.kept_bytes),
            ),
            (
                "downstream_failovers_total",
                Counter,
                "Dead or refusing downstream hops skipped.",
                load(&s.downstream_failovers),
            ),
            (
                "upstream_stalls_total",
                Counter,
                "Upstream connections dropped after stall_timeout without a chunk or a keepalive.",
                load(&s.upstream_stalls),
            ),
            (
                "downstream_stalls_total",
                Counter,
                "Downstream connections given up after stall_timeout without an answer or a drained write.",
                load(&s.downstream_stalls),
            ),
            (
                "second_upstreams_refused_total",
                Counter,
                "Opens of a running session refused because its upstream is alive (a bypassed host that came back).",
                load(&s.second_upstreams_refused),
            ),
            (
                "fetches_not_receiving_total",
                Counter,
                "Fetches answered in part with NotReceiving: this copy lacks some of the span and no session here receives it.",
                load(&s.fetches_not_receiving),
            ),
            (
                "origin_reads_yielded_total",
                Counter,
                "Origin reads paused because a peer started feeding the same shard here (the origin is read again only if it stalls).",
                load(&s.origin_reads_yielded),
            ),
            (
                "holders_back_during_origin_read_total",
                Counter,
                "Holders above a recovering hop, out of reach when it began reading the origin, that answered again: the rest came from them.",
                load(&s.holders_back_during_origin_read),
            ),
            (
                "origin_reads_stalled_total",
                Counter,
                "A recovery's origin reads that stopped progressing for an upstream grace (link or origin gone): paused until the origin answers, then the holders above get a grace first.",
                load(&s.origin_reads_stalled),
            ),
            (
                "head_origin_reads_stopped_total",
                Counter,
                "A head's origin reads stopped because its forwarder lost the hop below (link or that hop gone): resumed once the origin answers, after a pull from that hop.",
                load(&s.head_origin_reads_stopped),
            ),
            (
                "upstream_holders_unreachable_total",
                Counter,
                "Holders above a hop without upstream, dialled while it waited for a failover, that could not be reached (so no failover was awaited from them).",
                load(&s.upstream_holders_unreachable),
            ),
            (
                "chunks_from_holders_total",
                Counter,
                "Chunks pulled from another holder (Fetch: recovery from a hop above, imports from a peer) rather than the origin.",
                load(&s.chunks_from_holders),
            ),
            (
                "origin_refused_total",
                Counter,
                "Origins, redirects, resolved addresses or shard paths refused by the origin allow-list.",
                view.origins().refused(),
            ),
            (
                "conn_open",
                Gauge,
                "Data-plane connections open.",
                limits.open() as u64,
            ),
            (
                "conn_refused_total_cap_total",
                Counter,
                "Data-plane connections refused at max_connections.",
                load(&limits.stats.refused_total_cap),
            ),
            (
                "conn_refused_per_ip_cap_total",
                Counter,
                "Data-plane connections refused at max_connections_per_ip.",
                load(&limits.stats.refused_per_ip_cap),
            ),
            (
                "conn_handshake_timeouts_total",
                Counter,
                "Accepted connections closed because Hello did not complete within handshake_timeout_ms.",
                load(&c.handshake_timeouts),
            ),
            (
                "conn_idle_timeouts_total",
                Counter,
                "Connections closed because the peer was silent past peer_idle_timeout_s.",
                load(&c.idle_timeouts),
            ),
            (
                "conn_frames_not_admitted_total",
                Counter,
                "Large frames refused from their header: a type the connection does not take at that point (a Chunk or Manifest before an authorised Open).",
                load(&c.frames_not_admitted),
            ),
            (
                "conn_frame_timeouts_total",
                Counter,
                "Connections closed because a large frame did not arrive within 10 s plus its size at 1 MiB/s.",
                load(&c.frame_timeouts),
            ),
            (
                "conn_write_timeouts_total",
                Counter,
                "Connections closed because a write did not drain within write_timeout_s.",
                load(&c.write_timeouts),
            ),
            (
                "sessions_refused_total",
                Counter,
                "Open frames refused because the host held max_sessions hop sessions.",
                load(&s.sessions_refused),
            ),
            (
                "sessions_refused_draining_total",
                Counter,
                "Open frames of a session new to this host refused because it was draining.",
                load(&s.sessions_refused_draining),
            ),
            (
                "draining",
                Gauge,
                "1 while the host drains (asked to stop: it finishes its sessions and starts no new one), else 0.",
                u64::from(view.draining()),
            ),
            (
                "frame_memory_bytes",
                Gauge,
                "Bytes of frame bodies in flight (received, not yet verified and stored), across all connections.",
                budget.in_use() as u64,
            ),
            (
                "frame_memory_limit_bytes",
                Gauge,
                "The frame_memory budget.",
                budget.total() as u64,
            ),
            (
                "frame_memory_waits_total",
                Counter,
                "Frames that waited for room in the frame_memory budget before being read.",
                load(&budget.waits),
            ),
            (
                "frame_memory_peer_limit_bytes",
                Gauge,
                "The most of frame_memory one peer's frames may hold (a quarter, at least the largest frame).",
                budget.per_peer() as u64,
            ),
            (
                "frame_memory_peer_waits_total",
                Counter,
                "Frames that waited because their peer already held its share of frame_memory.",
                load(&budget.peer_waits),
            ),
            (
                "progress_dropped_total",
                Counter,
                "Relayed Progress frames not recorded because a session tracks the maximum of hosts.",
                load(&s.progress_dropped),
            ),
            (
                "upstream_recoveries_total",
                Counter,
                "Fetches from a fallback source after an upstream vanished.",
                load(&s.upstream_recoveries),
            ),
            (
                "data_tls_refused_total",
                Counter,
                "Data-port connections refused in the TLS handshake (no certificate, another CA, expired, timeout).",
                load(&s.tls_refused),
            ),
            (
                "hello_identity_mismatch_total",
                Counter,
                "Peers whose Hello host id differed from their certificate, or that were not hosts.",
                load(&s.identity_mismatch),
            ),
            (
                "sessions_unauthorised_total",
                Counter,
                "Opens refused for want of a valid plan token (none, forged, expired, other model, unnamed host).",
                load(&s.sessions_unauthorised),
            ),
            (
                "agent_unauthenticated_total",
                Counter,
                "Agent API calls refused for want of an identity.",
                load(&s.authz.unauthenticated),
            ),
            (
                "agent_denied_total",
                Counter,
                "Agent API calls refused because the caller's role lacks the permission.",
                load(&s.authz.denied),
            ),
            (
                "admin_refused_total",
                Counter,
                "Admin HTTP requests refused for want of an identity (no certificate, no or an unknown token).",
                load(&s.admin_authz.unauthenticated),
            ),
            (
                "gpu_loads_resident_total",
                Counter,
                "GPU loads that made a model resident.",
                load(&view.metrics().gpu_loads[0]),
            ),
            (
                "gpu_loads_failed_total",
                Counter,
                "GPU loads that failed or were cancelled.",
                load(&view.metrics().gpu_loads[1]),
            ),
        ];
        for &(name, kind, help, v) in rows {
            series(&mut enc, name, kind, help, v)?;
        }
        if let Some(tls) = view.transports().tls() {
            let t = &tls.stats;
            for (name, help, v) in [
                (
                    "tls_handshakes_accepted_total",
                    "TLS handshakes completed as a server (data port, agent API and admin listener).",
                    load(&t.accepted),
                ),
                (
                    "tls_handshakes_refused_total",
                    "TLS handshakes refused as a server (data port, agent API and admin listener).",
                    load(&t.refused) + load(&t.timed_out),
                ),
                (
                    "tls_connect_refused_total",
                    "Outgoing TLS connections whose server was refused (bad chain or wrong identity).",
                    load(&t.connect_refused),
                ),
                (
                    "tls_alpn_mismatches_total",
                    "TLS handshakes, either side, that failed because the peer speaks another protocol on the port (on the data port: the other end of the hop uses another data_mode).",
                    load(&t.alpn_mismatches),
                ),
                (
                    "tls_record_layer_connections_total",
                    "Data connections in the tls data mode, either side, whose TLS records transferd reads and writes itself after the handshake (ALPN shardcast-rec/1).",
                    load(&t.record_layer),
                ),
                (
                    "tls_rustls_stream_connections_total",
                    "Data connections in the tls data mode, either side, left on rustls's own stream because the peer speaks shardcast/1 only (a host of an earlier version).",
                    load(&t.rustls_stream),
                ),
                (
                    "connections_over_peer_limit_total",
                    "Agent API and admin connections closed after their handshake because their peer (a certificate's identity, or an address without one) already held the per-peer limit on the listener.",
                    load(&t.over_peer_limit),
                ),
                (
                    "handshakes_over_addr_limit_total",
                    "Agent API and admin connections closed before their handshake because their address already had the per-address limit of handshakes in progress.",
                    load(&t.handshakes_over_addr_limit),
                ),
                (
                    "tls_reloads_total",
                    "Certificate reloads without a restart.",
                    load(&t.reloads),
                ),
                (
                    "tls_reload_failures_total",
                    "Certificate reloads that failed (the running certificate stays).",
                    load(&t.reload_failures),
                ),
            ] {
                series(&mut enc, name, Counter, help, v)?;
            }
            // Seconds left, as of this scrape (negative once passed).
            let (own, ca) = tls.expiry().remaining(std::time::SystemTime::now());
            let mut m = enc.encode_descriptor(
                "certificate_expiry_seconds",
                "Seconds until the notAfter of this host's TLS certificate (certificate=\"own\") and of the CA bundle's first to expire (certificate=\"ca\"), as of the scrape; negative once passed. The log warns within cert_expiry_warning_s (default 14 days).",
                None,
                MetricType::Gauge,
            )?;
            for (which, left) in [("own", own), ("ca", ca)] {
                ConstGauge::new(left).encode(m.encode_family(&[("certificate", which)])?)?;
            }
        }
        if let Some(q) = view.transports().quic() {
            let (qs, o) = (&q.stats, q.offload());
            let t = qs.conns.totals();
            for (name, kind, help, v) in [
                (
                    "quic_connections_dialled_total",
                    Counter,
                    "QUIC connections this host opened to peers.",
                    load(&qs.dialled),
                ),
                (
                    "quic_connections_accepted_total",
                    Counter,
                    "QUIC connections accepted (handshake completed, a host's certificate).",
                    load(&qs.accepted),
                ),
                (
                    "quic_connections_refused_total",
                    Counter,
                    "Incoming QUIC connections refused in the handshake or timed out.",
                    load(&qs.refused),
                ),
                (
                    "quic_path_mtu_refused_total",
                    Counter,
                    "QUIC dials and incoming connections refused because this host's route to the peer carries less than quic_path_mtu.",
                    load(&qs.path_mtu_refused),
                ),
                (
                    "quic_connections_reused_total",
                    Counter,
                    "Sessions that opened their stream on a connection already held.",
                    load(&qs.reused),
                ),
                (
                    "quic_streams_opened_total",
                    Counter,
                    "QUIC streams opened (one per session and shard sent).",
                    load(&qs.streams_opened),
                ),
                (
                    "quic_streams_accepted_total",
                    Counter,
                    "QUIC streams accepted from peers.",
                    load(&qs.streams_accepted),
                ),
                (
                    "quic_rx_datagrams_total",
                    Counter,
                    "UDP datagrams received on QUIC connections (live and closed).",
                    t.rx_datagrams,
                ),
                (
                    "quic_tx_datagrams_total",
                    Counter,
                    "UDP datagrams sent on QUIC connections.",
                    t.tx_datagrams,
                ),
                (
                    "quic_tx_bytes_total",
                    Counter,
                    "UDP payload bytes sent on QUIC connections.",
                    t.tx_bytes,
                ),
                (
                    "quic_tx_ios_total",
                    Counter,
                    "Send calls that carried them (datagrams per call above 1: GSO worked).",
                    t.tx_ios,
                ),
                (
                    "quic_lost_packets_total",
                    Counter,
                    "Packets QUIC declared lost.",
                    t.lost_packets,
                ),
                (
                    "quic_congestion_events_total",
                    Counter,
                    "QUIC congestion events (window cuts).",
                    t.congestion_events,
                ),
                (
                    "quic_max_path_mtu_bytes",
                    Gauge,
                    "The largest UDP payload a QUIC connection's MTU discovery reached.",
                    t.max_mtu,
                ),
                (
                    "quic_gso_segments",
                    Gauge,
                    "Datagrams per send with UDP GSO (1: none).",
                    o.gso_segments as u64,
                ),
                (
                    "quic_gro_segments",
                    Gauge,
                    "Datagrams per receive with UDP GRO (1: none).",
                    o.gro_segments as u64,
                ),
                (
                    "quic_udp_recv_buffer_bytes",
                    Gauge,
                    "Receive buffer the kernel granted the QUIC socket.",
                    o.recv_buffer as u64,
                ),
                (
                    "quic_udp_send_buffer_bytes",
                    Gauge,
                    "Send buffer the kernel granted the QUIC socket.",
                    o.send_buffer as u64,
                ),
            ] {
                series(&mut enc, name, kind, help, v)?;
            }
        }
        let st = self.store.stats();
        for (name, help, v) in [
            (
                "store_symlinks_refused_total",
                "Symlinks met inside a store tier (refused, or unlinked by a removal).",
                &st.symlinks_refused,
            ),
            (
                "name_bindings_refused_total",
                "Plan tokens whose model-name binding was refused as older than the binding held (a replayed token cannot roll a name back).",
                &st.name_bindings_refused,
            ),
            (
                "store_temp_files_removed_total",
                "Stale temporary files removed from the store at start-up.",
                &st.temp_files_removed,
            ),
            (
                "store_orphans_removed_total",
                "Orphaned model or state directories (no model accounts for them) removed from the store at start-up.",
                &st.orphans_removed,
            ),
            (
                "store_orphan_bytes_removed_total",
                "Bytes the orphaned directories removed at start-up held.",
                &st.orphan_bytes_removed,
            ),
            (
                "store_space_refusals_total",
                "Shard files refused because their tier lacked space.",
                &st.space_refusals,
            ),
            (
                "chunks_reverified_total",
                "Chunks re-hashed before being served, loaded onto a GPU or handed off.",
                &st.chunks_reverified,
            ),
            (
                "bytes_reverified_total",
                "Bytes re-hashed before being served, loaded onto a GPU or handed off.",
                &st.bytes_reverified,
            ),
            (
                "store_bytes_written_mapped_total",
                "Chunk bytes written by copying into a shard's writable map (the adaptive writer while another write held the shard's lock); the rest went by pwrite.",
                &st.bytes_written_mapped,
            ),
            (
                "chunks_scrubbed_total",
                "Chunks re-hashed by the background scrub.",
                &st.chunks_scrubbed,
            ),
            (
                "bytes_scrubbed_total",
                "Bytes re-hashed by the background scrub.",
                &st.bytes_scrubbed,
            ),
            (
                "scrub_yields_total",
                "Times the background scrub stopped because chunks were moving through this host (it resumes once the data path has been quiet for a second).",
                &st.scrub_yields,
            ),
            (
                "chunks_corrupt_at_rest_total",
                "Verified chunks that failed re-verification at rest and were dropped.",
                &st.chunks_rotted,
            ),
            (
                "chunks_repaired_total",
                "Dropped chunks written again from a good source.",
                &st.chunks_repaired,
            ),
            (
                "chunks_unrepairable_total",
                "Dropped chunks a repair attempt could not restore.",
                &st.chunks_unrepairable,
            ),
            (
                "store_chunks_written_total",
                "Chunks written and marked verified in a shard file.",
                &st.chunks_written,
            ),
            (
                "store_shards_created_total",
                "Shard files created (a session or an import starting to write one).",
                &st.shards_created,
            ),
            (
                "memory_reserve_spares_taken_total",
                "New memory-tier shards created from a spare of the memory reserve.",
                &st.reserve_spares_taken,
            ),
            (
                "memory_reserve_taken_bytes_total",
                "Bytes of new shards the memory reserve's spares covered (written without allocating pages).",
                &st.reserve_bytes_taken,
            ),
            (
                "memory_reserve_filled_bytes_total",
                "Bytes the memory reserve's filler allocated while the host was idle.",
                &st.reserve_bytes_filled,
            ),
            (
                "memory_reserve_dropped_bytes_total",
                "Bytes of spares dropped to give their memory back to a shard, the capacity or the host's headroom.",
                &st.reserve_bytes_dropped,
            ),
        ] {
            series(&mut enc, name, Counter, help, load(v))?;
        }
        series(
            &mut enc,
            "memory_tier_huge_pages",
            Gauge,
            "1 when the memory tier is a tmpfs whose new pages can be huge (huge=within_size, always, advise or a kernel-wide force): chunk writes there cost several times less CPU than with 4 KiB pages.",
            u64::from(self.store.memory_fs().is_some_and(|f| f.huge_pages())),
        )?;
        series(
            &mut enc,
            "gpu_registered_host_bytes",
            Gauge,
            "Host memory kept registered (pinned) with the GPUs for loads: memory-tier shard mappings, registered by a load or ahead of loads, released once the shard leaves the tier.",
            self.gpus.registered_host_bytes(),
        )?;
        series(
            &mut enc,
            "repairs_refused_total",
            Counter,
            "Repair requests refused because the repair queue was full.",
            view.repairs_refused(),
        )?;
        {
            let mut m = enc.encode_descriptor(
                "data_mode",
                "How the TCP data port protects payloads (1 for this host's mode): tls (encrypted), authenticate-only (mutual-TLS handshake, then unencrypted; every chunk still verified) or insecure-plaintext. QUIC always encrypts.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(1u64)
                .encode(m.encode_family(&[("mode", view.transports().data_mode_name())])?)?;
        }
        labelled(
            &mut enc,
            "admin_denied_total",
            "Admin HTTP requests refused because the caller may not read, by its role (local: a socket-group user).",
            "role",
            s.admin_authz.denied_by(),
        )?;
        labelled(
            &mut enc,
            "admin_timeouts_total",
            "Admin HTTP connections closed because the client stalled: a request head not sent in time (header), a request body paused too long (body), no request on a keep-alive connection (idle).",
            "kind",
            s.admin_http
                .timeouts()
                .into_iter()
                .map(|(stall, n)| (stall.as_str(), n)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_sum_and_count_follow_the_observations() {
        let h = Histogram::new(&[1.0, 2.0, 5.0]);
        for v in [0.5, 1.0, 1.5, 4.0, 7.0, f64::NAN, f64::INFINITY] {
            h.observe(v);
        }
        // `le` is inclusive: 1.0 falls in the first bucket; NaN is dropped, +Inf counted.
        assert_eq!(
            h.buckets(),
            vec![(1.0, 2), (2.0, 1), (5.0, 1), (f64::INFINITY, 2)]
        );
        assert_eq!(h.count(), 6);
        assert_eq!(h.sum(), f64::INFINITY);

        let h = Histogram::default();
        h.observe_duration(Duration::from_millis(3));
        h.observe_duration(Duration::from_millis(3));
        assert_eq!(h.count(), 2);
        assert!((h.sum() - 0.006).abs() < 1e-12, "{}", h.sum());
    }

    #[test]
    fn histogram_encodes_cumulative_buckets_after_the_host_label() {
        let mut r = Registry::with_prefix_and_labels(
            "shardcast",
            [("host".into(), "h1".into())].into_iter(),
        );
        let h = Histogram::new(&[0.5, 1.0]);
        r.register("x_seconds", "Some seconds", h.clone());
        h.observe(0.25);
        h.observe(0.75);
        h.observe(3.0);
        assert_eq!(
            encode(&r),
            "# HELP shardcast_x_seconds Some seconds.\n\
             # TYPE shardcast_x_seconds histogram\n\
             shardcast_x_seconds_bucket{host=\"h1\",le=\"0.5\"} 1\n\
             shardcast_x_seconds_bucket{host=\"h1\",le=\"1\"} 2\n\
             shardcast_x_seconds_bucket{host=\"h1\",le=\"+Inf\"} 3\n\
             shardcast_x_seconds_sum{host=\"h1\"} 4.0\n\
             shardcast_x_seconds_count{host=\"h1\"} 3\n"
        );
    }

    #[test]
    fn data_metrics_record_sessions_and_loads() {
        let m = DataMetrics::default();
        m.session_ready(1 << 30, Duration::from_secs(2));
        // A session that was ready at once has no throughput to speak of.
        m.session_ready(1 << 20, Duration::ZERO);
        assert_eq!(m.session_ready.count(), 2);
        assert_eq!(m.hop_throughput.count(), 1);
        assert_eq!(m.hop_throughput.sum(), (1u64 << 29) as f64);
        m.gpu_load_done(Some(1.5));
        m.gpu_load_done(None);
        assert_eq!(m.gpu_load.count(), 1);
        assert_eq!(m.gpu_loads[0].load(Ordering::Relaxed), 1);
        assert_eq!(m.gpu_loads[1].load(Ordering::Relaxed), 1);
    }

    /// A fresh node in insecure mode (no TLS, no QUIC): every series of that mode, once,
    /// with its `# HELP`, `# TYPE` and the host label first, and the chunk verification
    /// histogram counting what the store verified.
    #[tokio::test]
    async fn a_node_exports_each_series_once_with_its_host() {
        use crate::chain::{ChainConfig, Faults, Node};
        use crate::store::{ShardStore, StoreConfig};
        use crate::throttle::RateLimiter;
        use crate::transport::{Transport, Transports};

        let dir = tempfile::tempdir().expect("tempdir");
        let store = ShardStore::open(StoreConfig::new(
            dir.path().join("mem"),
            dir.path().join("disk"),
        ))
        .expect("store");
        let node = Node::new(
            shardcast_protocol::HostId::new("h1").expect("host id"),
            None,
            store,
            Transports {
                tcp: Transport::InsecureTcp,
                quic: None,
            },
            RateLimiter::new(None),
            RateLimiter::new(None),
            ChainConfig::default(),
            Faults::default(),
            tokio_util::sync::CancellationToken::new(),
        );
        let gpus = Arc::new(GpuManager::open(&Default::default()));
        let r = registry(node.view(), node.store(), &gpus);
        node.view()
            .stats()
            .chunks_verified
            .fetch_add(7, Ordering::Relaxed);
        node.view()
            .counters()
            .sent
            .fetch_add(1 << 20, Ordering::Relaxed);
        node.view().metrics().gpu_load_done(Some(2.0));
        node.store().stats().chunk_verify.observe(0.003);
        let text = encode(&r);

        let mut families = std::collections::BTreeSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap_or_default();
                assert!(name.starts_with("shardcast_"), "{line}");
                assert!(families.insert(name.to_string()), "{name} twice in\n{text}");
            } else if !line.starts_with("# HELP ") {
                assert!(line.contains("{host=\"h1\""), "{line}");
            }
        }
        for (line, want) in [
            ("shardcast_chunks_verified_total{host=\"h1\"}", "7"),
            ("shardcast_bytes_sent_total{host=\"h1\"}", "1048576"),
            ("shardcast_sessions_active{host=\"h1\"}", "0"),
            (
                "shardcast_data_mode{host=\"h1\",mode=\"insecure-plaintext\"}",
                "1",
            ),
            ("shardcast_gpu_loads_resident_total{host=\"h1\"}", "1"),
            ("shardcast_gpu_load_seconds_count{host=\"h1\"}", "1"),
            ("shardcast_gpu_load_seconds_sum{host=\"h1\"}", "2.0"),
            (
                "shardcast_chunk_verify_seconds_bucket{host=\"h1\",le=\"0.005\"}",
                "1",
            ),
            ("shardcast_session_ready_seconds_count{host=\"h1\"}", "0"),
            (
                "shardcast_hop_throughput_bytes_per_second_count{host=\"h1\"}",
                "0",
            ),
            (
                "shardcast_admin_denied_total{host=\"h1\",role=\"read\"}",
                "0",
            ),
            (
                "shardcast_admin_timeouts_total{host=\"h1\",kind=\"idle\"}",
                "0",
            ),
        ] {
            let got = text
                .lines()
                .find_map(|l| l.strip_prefix(line)?.strip_prefix(' '));
            assert_eq!(got, Some(want), "{line} in\n{text}");
        }
        // Types as they always were: counters end in `_total`, gauges do not.
        assert!(text.contains("# TYPE shardcast_conn_refused_total_cap_total counter\n"));
        assert!(text.contains("# TYPE shardcast_frame_memory_bytes gauge\n"));
        assert!(text.contains("# TYPE shardcast_chunk_verify_seconds histogram\n"));
        // Insecure mode: no TLS or QUIC series.
        assert!(!text.contains("shardcast_tls_"), "{text}");
        assert!(!text.contains("shardcast_quic_"), "{text}");
        node.cancel().cancel();
    }

    #[test]
    fn counters_keep_their_total_names_in_help_type_and_samples() {
        #[derive(Debug)]
        struct Two;
        impl Collector for Two {
            fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
                series(&mut enc, "a_total", Kind::Counter, "A.", 3)?;
                series(
                    &mut enc,
                    "conn_refused_total_cap_total",
                    Kind::Counter,
                    "B.",
                    4,
                )?;
                series(&mut enc, "g_bytes", Kind::Gauge, "G.", 5)?;
                labelled(&mut enc, "l_total", "L.", "role", [("x", 1), ("y", 2)])
            }
        }
        let mut r = Registry::with_prefix_and_labels(
            "shardcast",
            [("host".into(), "h1".into())].into_iter(),
        );
        r.register_collector(Box::new(Two));
        assert_eq!(
            encode(&r),
            "# HELP shardcast_a_total A.\n# TYPE shardcast_a_total counter\nshardcast_a_total{host=\"h1\"} 3\n\
             # HELP shardcast_conn_refused_total_cap_total B.\n# TYPE shardcast_conn_refused_total_cap_total counter\nshardcast_conn_refused_total_cap_total{host=\"h1\"} 4\n\
             # HELP shardcast_g_bytes G.\n# TYPE shardcast_g_bytes gauge\nshardcast_g_bytes{host=\"h1\"} 5\n\
             # HELP shardcast_l_total L.\n# TYPE shardcast_l_total counter\nshardcast_l_total{host=\"h1\",role=\"x\"} 1\nshardcast_l_total{host=\"h1\",role=\"y\"} 2\n"
        );
    }
}
