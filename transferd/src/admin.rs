//! Admin HTTP endpoint, off the data path: `/healthz` (the process is up), `/readyz`
//! (every listener is bound), `/metrics` (Prometheus text format), and
//! `/v1/handoff/{model}` (the hand-off of a model to an inference process on this host).
//!
//! Who may call what ([`permission`], applied by `shardcast_identity::http::HttpAuthLayer`
//! before a handler runs):
//!
//! | permission | routes |
//! | --- | --- |
//! | none | `GET /healthz`, `GET /readyz` (liveness probes; they say nothing else) |
//! | read (read, platform, admin, controller; a socket-group user) | `GET /metrics`, `GET /v1/handoff/{model}` |
//! | admin | anything else (only local operators reach the 404/405) |
//!
//! On TCP the listener speaks HTTPS with the host's cluster certificate; a client presents
//! its own certificate or a bearer token from `tokens_file`. On a Unix socket the peer's
//! uid decides (`shardcast_identity::grpc::SocketAccess`). Refusals are `401`/`403` with a
//! JSON message, logged with the identity and counted (`shardcast_admin_refused_total`,
//! `shardcast_admin_denied_total{role}`); clients that stall are closed and counted
//! (`shardcast_admin_timeouts_total{kind}`).

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{Method, StatusCode};
use axum::routing::get;
use gpu_loader::manager::GpuManager;
use shardcast_identity::Permission;
use shardcast_identity::grpc::Incoming;
use shardcast_identity::http::{HttpAuthLayer, HttpLimits};
use shardcast_identity::token::Tokens;
use tokio_util::sync::CancellationToken;

use crate::chain::Node;

/// What each admin route needs (`None`: anonymous).
pub fn permission(method: &Method, path: &str) -> Option<Permission> {
    match (method, path) {
        (&Method::GET | &Method::HEAD, "/healthz" | "/readyz") => None,
        (&Method::GET | &Method::HEAD, "/metrics") => Some(Permission::Read),
        (&Method::GET | &Method::HEAD, p) if p.starts_with("/v1/handoff/") => {
            Some(Permission::Read)
        }
        _ => Some(Permission::Admin),
    }
}

/// Serves the admin endpoints on `incoming` until `cancel`.
pub async fn serve(
    node: Arc<Node>,
    gpus: Arc<GpuManager>,
    incoming: Incoming,
    tokens: Tokens,
    limits: HttpLimits,
    cancel: CancellationToken,
) {
    let with_gpus = Router::new()
        .route("/v1/handoff/{model}", get(handoff))
        .route("/metrics", get(metrics))
        .with_state((node.clone(), gpus));
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { (StatusCode::OK, "ready\n") }))
        .merge(with_gpus)
        .layer(HttpAuthLayer::new(
            permission,
            Arc::new(tokens),
            node.stats.admin_authz.clone(),
        ));
    shardcast_identity::http::serve(incoming, app, limits, node.stats.admin_http.clone(), cancel)
        .await;
}

/// `GET /v1/handoff/{model}`: the hand-off JSON for inference processes on this host
/// (`examples/python/handoff.py`, the `shardcast` Python package). `?tensors=a,b` and
/// `?prefix=p` (both repeatable) list only the tensors a tensor-parallel rank uses
/// ([`crate::gpu::Selection`]); `404` for a model the host does not know, `400` for a
/// selection naming tensors the model lacks, `409` while it cannot be handed off.
async fn handoff(
    State((node, gpus)): State<(Arc<Node>, Arc<GpuManager>)>,
    Path(model): Path<String>,
    Query(query): Query<Vec<(String, String)>>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let select = match crate::gpu::Selection::from_query(&query) {
        Ok(s) => s,
        Err(e) => return (StatusCode::BAD_REQUEST, e + "\n").into_response(),
    };
    let Some(digest) = node.store.resolve(&model) else {
        return (
            StatusCode::NOT_FOUND,
            format!("model {model:?} is not known on this host\n"),
        )
            .into_response();
    };
    match crate::gpu::handoff(&node, &gpus, &digest, &select) {
        Ok(h) => axum::Json(h).into_response(),
        Err(e @ crate::gpu::HandoffError::Invalid(_)) => {
            (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response()
        }
        Err(e) => (StatusCode::CONFLICT, format!("{e}\n")).into_response(),
    }
}

async fn metrics(State((node, gpus)): State<(Arc<Node>, Arc<GpuManager>)>) -> String {
    render(&node, &gpus)
}

/// A counter family with one label besides `host`.
fn labelled(
    out: &mut String,
    host: &impl std::fmt::Display,
    name: &str,
    help: &str,
    label: &str,
    values: Vec<(&str, u64)>,
) {
    let _ = writeln!(
        out,
        "# HELP shardcast_{name} {help}\n# TYPE shardcast_{name} counter"
    );
    for (v, n) in values {
        let _ = writeln!(
            out,
            "shardcast_{name}{{host=\"{host}\",{label}=\"{v}\"}} {n}"
        );
    }
}

/// Renders every data-plane counter in Prometheus text format.
pub fn render(node: &Node, gpus: &GpuManager) -> String {
    let s = &node.stats;
    let c = &node.counters;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, v: u64| {
        let _ = writeln!(
            out,
            "# HELP shardcast_{name} {help}\n# TYPE shardcast_{name} {kind}\nshardcast_{name}{{host=\"{}\"}} {v}",
            node.host
        );
    };
    metric(
        "bytes_received_total",
        "counter",
        "Bytes read from data-plane connections.",
        c.received.load(Ordering::Relaxed),
    );
    metric(
        "bytes_sent_total",
        "counter",
        "Bytes written to data-plane connections.",
        c.sent.load(Ordering::Relaxed),
    );
    metric(
        "sendfile_bytes_total",
        "counter",
        "Chunk payload bytes sent from the store's files by the kernel (sendfile, plaintext TCP): no copy through user space.",
        c.sendfile_bytes.load(Ordering::Relaxed),
    );
    metric(
        "sendfile_refused_total",
        "counter",
        "Chunk payloads copied through user space because the kernel refused sendfile from their file (the first refusal is logged).",
        c.sendfile_refused.load(Ordering::Relaxed),
    );
    metric(
        "chunks_verified_total",
        "counter",
        "Chunks verified and stored.",
        s.chunks_verified.load(Ordering::Relaxed),
    );
    metric(
        "chunks_corrupt_total",
        "counter",
        "Chunks dropped after a hash mismatch.",
        s.chunks_corrupt.load(Ordering::Relaxed),
    );
    metric(
        "chunks_resent_total",
        "counter",
        "Chunks sent again after a Nack.",
        s.chunks_resent.load(Ordering::Relaxed),
    );
    metric(
        "sessions_active",
        "gauge",
        "Chain sessions in progress.",
        s.sessions_active.load(Ordering::Relaxed),
    );
    metric(
        "sessions_total",
        "counter",
        "Chain sessions started.",
        s.sessions_total.load(Ordering::Relaxed),
    );
    metric(
        "origin_bytes_total",
        "counter",
        "Payload bytes fetched from origins.",
        s.origin_bytes.load(Ordering::Relaxed),
    );
    metric(
        "manifest_bytes_total",
        "counter",
        "Bytes read from origins to build manifests (registration, imports).",
        s.manifest_bytes.load(Ordering::Relaxed),
    );
    metric(
        "kept_bytes_total",
        "counter",
        "Bytes stored from the copy kept while building a manifest (the origin not read again).",
        s.kept_bytes.load(Ordering::Relaxed),
    );
    metric(
        "downstream_failovers_total",
        "counter",
        "Dead or refusing downstream hops skipped.",
        s.downstream_failovers.load(Ordering::Relaxed),
    );
    metric(
        "upstream_stalls_total",
        "counter",
        "Upstream connections dropped after stall_timeout without a chunk or a keepalive.",
        s.upstream_stalls.load(Ordering::Relaxed),
    );
    metric(
        "downstream_stalls_total",
        "counter",
        "Downstream connections given up after stall_timeout without an answer or a drained write.",
        s.downstream_stalls.load(Ordering::Relaxed),
    );
    metric(
        "second_upstreams_refused_total",
        "counter",
        "Opens of a running session refused because its upstream is alive (a bypassed host that came back).",
        s.second_upstreams_refused.load(Ordering::Relaxed),
    );
    metric(
        "chunks_from_holders_total",
        "counter",
        "Chunks pulled from another holder (Fetch: recovery from a hop above, imports from a peer) rather than the origin.",
        s.chunks_from_holders.load(Ordering::Relaxed),
    );
    metric(
        "origin_refused_total",
        "counter",
        "Origins, redirects, resolved addresses or shard paths refused by the origin allow-list.",
        node.cfg.origins.refused(),
    );
    metric(
        "conn_open",
        "gauge",
        "Data-plane connections open.",
        node.conn_limits.open() as u64,
    );
    metric(
        "conn_refused_total_cap_total",
        "counter",
        "Data-plane connections refused at max_connections.",
        node.conn_limits
            .stats
            .refused_total_cap
            .load(Ordering::Relaxed),
    );
    metric(
        "conn_refused_per_ip_cap_total",
        "counter",
        "Data-plane connections refused at max_connections_per_ip.",
        node.conn_limits
            .stats
            .refused_per_ip_cap
            .load(Ordering::Relaxed),
    );
    metric(
        "conn_handshake_timeouts_total",
        "counter",
        "Accepted connections closed because Hello did not complete within handshake_timeout_ms.",
        c.handshake_timeouts.load(Ordering::Relaxed),
    );
    metric(
        "conn_idle_timeouts_total",
        "counter",
        "Connections closed because the peer was silent past peer_idle_timeout_s.",
        c.idle_timeouts.load(Ordering::Relaxed),
    );
    metric(
        "conn_frames_not_admitted_total",
        "counter",
        "Large frames refused from their header: a type the connection does not take at that point (a Chunk or Manifest before an authorised Open).",
        c.frames_not_admitted.load(Ordering::Relaxed),
    );
    metric(
        "conn_frame_timeouts_total",
        "counter",
        "Connections closed because a large frame did not arrive within 10 s plus its size at 1 MiB/s.",
        c.frame_timeouts.load(Ordering::Relaxed),
    );
    metric(
        "conn_write_timeouts_total",
        "counter",
        "Connections closed because a write did not drain within write_timeout_s.",
        c.write_timeouts.load(Ordering::Relaxed),
    );
    metric(
        "sessions_refused_total",
        "counter",
        "Open frames refused because the host held max_sessions hop sessions.",
        s.sessions_refused.load(Ordering::Relaxed),
    );
    let budget = &node.frame_budget;
    metric(
        "frame_memory_bytes",
        "gauge",
        "Bytes of frame bodies in flight (received, not yet verified and stored), across all connections.",
        budget.in_use() as u64,
    );
    metric(
        "frame_memory_limit_bytes",
        "gauge",
        "The frame_memory budget.",
        budget.total() as u64,
    );
    metric(
        "frame_memory_waits_total",
        "counter",
        "Frames that waited for room in the frame_memory budget before being read.",
        budget.waits.load(Ordering::Relaxed),
    );
    metric(
        "frame_memory_peer_limit_bytes",
        "gauge",
        "The most of frame_memory one peer's frames may hold (a quarter, at least the largest frame).",
        budget.per_peer() as u64,
    );
    metric(
        "frame_memory_peer_waits_total",
        "counter",
        "Frames that waited because their peer already held its share of frame_memory.",
        budget.peer_waits.load(Ordering::Relaxed),
    );
    metric(
        "progress_dropped_total",
        "counter",
        "Relayed Progress frames not recorded because a session tracks the maximum of hosts.",
        s.progress_dropped.load(Ordering::Relaxed),
    );
    metric(
        "upstream_recoveries_total",
        "counter",
        "Fetches from a fallback source after an upstream vanished.",
        s.upstream_recoveries.load(Ordering::Relaxed),
    );
    metric(
        "data_tls_refused_total",
        "counter",
        "Data-port connections refused in the TLS handshake (no certificate, another CA, expired, timeout).",
        s.tls_refused.load(Ordering::Relaxed),
    );
    metric(
        "hello_identity_mismatch_total",
        "counter",
        "Peers whose Hello host id differed from their certificate, or that were not hosts.",
        s.identity_mismatch.load(Ordering::Relaxed),
    );
    metric(
        "sessions_unauthorised_total",
        "counter",
        "Opens refused for want of a valid plan token (none, forged, expired, other model, unnamed host).",
        s.sessions_unauthorised.load(Ordering::Relaxed),
    );
    metric(
        "agent_unauthenticated_total",
        "counter",
        "Agent API calls refused for want of an identity.",
        s.authz.unauthenticated.load(Ordering::Relaxed),
    );
    metric(
        "agent_denied_total",
        "counter",
        "Agent API calls refused because the caller's role lacks the permission.",
        s.authz.denied.load(Ordering::Relaxed),
    );
    metric(
        "admin_refused_total",
        "counter",
        "Admin HTTP requests refused for want of an identity (no certificate, no or an unknown token).",
        s.admin_authz.unauthenticated.load(Ordering::Relaxed),
    );
    if let Some(tls) = node.transports.tls() {
        let t = &tls.stats;
        metric(
            "tls_handshakes_accepted_total",
            "counter",
            "TLS handshakes completed as a server (data port, agent API and admin listener).",
            t.accepted.load(Ordering::Relaxed),
        );
        metric(
            "tls_handshakes_refused_total",
            "counter",
            "TLS handshakes refused as a server (data port, agent API and admin listener).",
            t.refused.load(Ordering::Relaxed) + t.timed_out.load(Ordering::Relaxed),
        );
        metric(
            "tls_connect_refused_total",
            "counter",
            "Outgoing TLS connections whose server was refused (bad chain or wrong identity).",
            t.connect_refused.load(Ordering::Relaxed),
        );
        metric(
            "tls_alpn_mismatches_total",
            "counter",
            "TLS handshakes, either side, that failed because the peer speaks another protocol on the port (on the data port: the other end of the hop uses another data_mode).",
            t.alpn_mismatches.load(Ordering::Relaxed),
        );
        metric(
            "connections_over_peer_limit_total",
            "counter",
            "Agent API and admin connections closed after their handshake because their peer (a certificate's identity, or an address without one) already held the per-peer limit on the listener.",
            t.over_peer_limit.load(Ordering::Relaxed),
        );
        metric(
            "handshakes_over_addr_limit_total",
            "counter",
            "Agent API and admin connections closed before their handshake because their address already had the per-address limit of handshakes in progress.",
            t.handshakes_over_addr_limit.load(Ordering::Relaxed),
        );
        metric(
            "tls_reloads_total",
            "counter",
            "Certificate reloads without a restart.",
            t.reloads.load(Ordering::Relaxed),
        );
        metric(
            "tls_reload_failures_total",
            "counter",
            "Certificate reloads that failed (the running certificate stays).",
            t.reload_failures.load(Ordering::Relaxed),
        );
    }
    if let Some(q) = node.transports.quic() {
        let (qs, o) = (&q.stats, q.offload());
        let t = qs.conns.totals();
        let count = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        for (name, kind, help, v) in [
            (
                "quic_connections_dialled_total",
                "counter",
                "QUIC connections this host opened to peers.",
                count(&qs.dialled),
            ),
            (
                "quic_connections_accepted_total",
                "counter",
                "QUIC connections accepted (handshake completed, a host's certificate).",
                count(&qs.accepted),
            ),
            (
                "quic_connections_refused_total",
                "counter",
                "Incoming QUIC connections refused in the handshake or timed out.",
                count(&qs.refused),
            ),
            (
                "quic_path_mtu_refused_total",
                "counter",
                "QUIC dials and incoming connections refused because this host's route to the peer carries less than quic_path_mtu.",
                count(&qs.path_mtu_refused),
            ),
            (
                "quic_connections_reused_total",
                "counter",
                "Sessions that opened their stream on a connection already held.",
                count(&qs.reused),
            ),
            (
                "quic_streams_opened_total",
                "counter",
                "QUIC streams opened (one per session and shard sent).",
                count(&qs.streams_opened),
            ),
            (
                "quic_streams_accepted_total",
                "counter",
                "QUIC streams accepted from peers.",
                count(&qs.streams_accepted),
            ),
            (
                "quic_rx_datagrams_total",
                "counter",
                "UDP datagrams received on QUIC connections (live and closed).",
                t.rx_datagrams,
            ),
            (
                "quic_tx_datagrams_total",
                "counter",
                "UDP datagrams sent on QUIC connections.",
                t.tx_datagrams,
            ),
            (
                "quic_tx_bytes_total",
                "counter",
                "UDP payload bytes sent on QUIC connections.",
                t.tx_bytes,
            ),
            (
                "quic_tx_ios_total",
                "counter",
                "Send calls that carried them (datagrams per call above 1: GSO worked).",
                t.tx_ios,
            ),
            (
                "quic_lost_packets_total",
                "counter",
                "Packets QUIC declared lost.",
                t.lost_packets,
            ),
            (
                "quic_congestion_events_total",
                "counter",
                "QUIC congestion events (window cuts).",
                t.congestion_events,
            ),
            (
                "quic_max_path_mtu_bytes",
                "gauge",
                "The largest UDP payload a QUIC connection's MTU discovery reached.",
                t.max_mtu,
            ),
            (
                "quic_gso_segments",
                "gauge",
                "Datagrams per send with UDP GSO (1: none).",
                o.gso_segments as u64,
            ),
            (
                "quic_gro_segments",
                "gauge",
                "Datagrams per receive with UDP GRO (1: none).",
                o.gro_segments as u64,
            ),
            (
                "quic_udp_recv_buffer_bytes",
                "gauge",
                "Receive buffer the kernel granted the QUIC socket.",
                o.recv_buffer as u64,
            ),
            (
                "quic_udp_send_buffer_bytes",
                "gauge",
                "Send buffer the kernel granted the QUIC socket.",
                o.send_buffer as u64,
            ),
        ] {
            metric(name, kind, help, v);
        }
    }
    let st = node.store.stats();
    for (name, kind, help, v) in [
        (
            "store_symlinks_refused_total",
            "counter",
            "Symlinks met inside a store tier (refused, or unlinked by a removal).",
            &st.symlinks_refused,
        ),
        (
            "name_bindings_refused_total",
            "counter",
            "Plan tokens whose model-name binding was refused as older than the binding held (a replayed token cannot roll a name back).",
            &st.name_bindings_refused,
        ),
        (
            "store_temp_files_removed_total",
            "counter",
            "Stale temporary files removed from the store at start-up.",
            &st.temp_files_removed,
        ),
        (
            "store_orphans_removed_total",
            "counter",
            "Orphaned model or state directories (no model accounts for them) removed from the store at start-up.",
            &st.orphans_removed,
        ),
        (
            "store_orphan_bytes_removed_total",
            "counter",
            "Bytes the orphaned directories removed at start-up held.",
            &st.orphan_bytes_removed,
        ),
        (
            "store_space_refusals_total",
            "counter",
            "Shard files refused because their tier lacked space.",
            &st.space_refusals,
        ),
        (
            "chunks_reverified_total",
            "counter",
            "Chunks re-hashed before being served, loaded onto a GPU or handed off.",
            &st.chunks_reverified,
        ),
        (
            "bytes_reverified_total",
            "counter",
            "Bytes re-hashed before being served, loaded onto a GPU or handed off.",
            &st.bytes_reverified,
        ),
        (
            "chunks_scrubbed_total",
            "counter",
            "Chunks re-hashed by the background scrub.",
            &st.chunks_scrubbed,
        ),
        (
            "bytes_scrubbed_total",
            "counter",
            "Bytes re-hashed by the background scrub.",
            &st.bytes_scrubbed,
        ),
        (
            "chunks_corrupt_at_rest_total",
            "counter",
            "Verified chunks that failed re-verification at rest and were dropped.",
            &st.chunks_rotted,
        ),
        (
            "chunks_repaired_total",
            "counter",
            "Dropped chunks written again from a good source.",
            &st.chunks_repaired,
        ),
        (
            "chunks_unrepairable_total",
            "counter",
            "Dropped chunks a repair attempt could not restore.",
            &st.chunks_unrepairable,
        ),
    ] {
        metric(name, kind, help, v.load(Ordering::Relaxed));
    }
    metric(
        "memory_tier_huge_pages",
        "gauge",
        "1 when the memory tier is a tmpfs whose new pages can be huge (huge=within_size, always, advise or a kernel-wide force): chunk writes there cost several times less CPU than with 4 KiB pages.",
        u64::from(node.store.memory_fs().is_some_and(|f| f.huge_pages())),
    );
    metric(
        "gpu_registered_host_bytes",
        "gauge",
        "Host memory kept registered (pinned) with the GPUs for loads: memory-tier shard mappings, registered by a load or ahead of loads, released once the shard leaves the tier.",
        gpus.registered_host_bytes(),
    );
    metric(
        "repairs_refused_total",
        "counter",
        "Repair requests refused because the repair queue was full.",
        node.repairs.refused(),
    );
    let _ = writeln!(
        out,
        "# HELP shardcast_data_mode How the TCP data port protects payloads (1 for this host's mode): tls (encrypted), authenticate-only (mutual-TLS handshake, then unencrypted; every chunk still verified) or insecure-plaintext. QUIC always encrypts.\n# TYPE shardcast_data_mode gauge\nshardcast_data_mode{{host=\"{}\",mode=\"{}\"}} 1",
        node.host,
        node.transports.data_mode_name()
    );
    labelled(
        &mut out,
        &node.host,
        "admin_denied_total",
        "Admin HTTP requests refused because the caller may not read, by its role (local: a socket-group user).",
        "role",
        s.admin_authz.denied_by(),
    );
    labelled(
        &mut out,
        &node.host,
        "admin_timeouts_total",
        "Admin HTTP connections closed because the client stalled: a request head not sent in time (header), a request body paused too long (body), no request on a keep-alive connection (idle).",
        "kind",
        s.admin_http
            .timeouts()
            .into_iter()
            .map(|(stall, n)| (stall.as_str(), n))
            .collect(),
    );
    out
}
