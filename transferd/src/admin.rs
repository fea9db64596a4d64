//! Admin HTTP endpoint, off the data path: `/healthz` (the process is up), `/readyz`
//! (`200 ready` when the daemon's readiness holds — listeners up, store recovered, the
//! controller answered a heartbeat when one is configured — else `503` with one line per
//! unmet condition, `draining` once shutdown began; see `crate::daemon`), `/metrics` (Prometheus text format 0.0.4, from the registry
//! of [`crate::metrics`]), and
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

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{Method, StatusCode};
use axum::routing::get;
use prometheus_client::registry::Registry;
use shardcast_identity::Permission;
use shardcast_identity::grpc::Incoming;
use shardcast_identity::http::{HttpAuthLayer, HttpLimits};
use shardcast_identity::ready::Readiness;
use shardcast_identity::token::Tokens;
use tokio_util::sync::CancellationToken;

use crate::gpu::GpuLoads;

/// The admin endpoint's counters (`NodeStats::admin_authz`, `admin_http`).
#[derive(Debug, Clone)]
pub struct AdminStats {
    /// Requests refused (no identity, or a role that may not read).
    pub authz: Arc<shardcast_identity::grpc::AuthzStats>,
    /// Connections closed because the client stalled.
    pub http: Arc<shardcast_identity::http::HttpStats>,
}

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

/// What the admin endpoint serves and how it guards it: the inputs of [`serve`].
pub struct AdminApi {
    /// The hand-offs `/v1/handoff/{model}` reads.
    pub gpus: GpuLoads,
    /// Where refusals and stalled clients are counted.
    pub stats: AdminStats,
    /// What `/metrics` encodes (built at start-up by [`crate::metrics::registry`]).
    pub registry: Arc<Registry>,
    /// What `/readyz` answers.
    pub readiness: Readiness,
    /// The bearer tokens a client may present instead of a certificate.
    pub tokens: Tokens,
    /// Bounds on each HTTP connection (stalled clients are closed).
    pub limits: HttpLimits,
}

/// Serves the admin endpoints of `api` on `incoming` until `cancel`.
pub async fn serve(api: AdminApi, incoming: Incoming, cancel: CancellationToken) {
    let AdminApi {
        gpus,
        stats,
        registry,
        readiness,
        tokens,
        limits,
    } = api;
    let with_gpus = Router::new()
        .route("/v1/handoff/{model}", get(handoff))
        .with_state(gpus);
    let with_registry = Router::new()
        .route("/metrics", get(metrics))
        .with_state(registry);
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let answer = readiness.http_answer();
                async move { answer }
            }),
        )
        .merge(with_gpus)
        .merge(with_registry)
        .layer(HttpAuthLayer::new(
            permission,
            Arc::new(tokens),
            stats.authz,
        ));
    shardcast_identity::http::serve(incoming, app, limits, stats.http, cancel).await;
}

/// `GET /v1/handoff/{model}`: the hand-off JSON for inference processes on this host
/// (`examples/python/handoff.py`, the `shardcast` Python package). `?tensors=a,b` and
/// `?prefix=p` (both repeatable) list only the tensors a tensor-parallel rank uses
/// ([`crate::gpu::Selection`]); `404` for a model the host does not know, `400` for a
/// selection naming tensors the model lacks, `409` while it cannot be handed off.
async fn handoff(
    State(gpus): State<GpuLoads>,
    Path(model): Path<String>,
    Query(query): Query<Vec<(String, String)>>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let select = match crate::gpu::Selection::from_query(&query) {
        Ok(s) => s,
        Err(e) => return (StatusCode::BAD_REQUEST, e + "\n").into_response(),
    };
    let Some(digest) = gpus.store().resolve(&model) else {
        return (
            StatusCode::NOT_FOUND,
            format!("model {model:?} is not known on this host\n"),
        )
            .into_response();
    };
    match crate::gpu::handoff(&gpus, &digest, &select) {
        Ok(h) => axum::Json(h).into_response(),
        Err(e @ crate::gpu::HandoffError::Invalid(_)) => {
            (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response()
        }
        Err(e) => (StatusCode::CONFLICT, format!("{e}\n")).into_response(),
    }
}

async fn metrics(State(registry): State<Arc<Registry>>) -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::metrics::CONTENT_TYPE,
        )],
        crate::metrics::encode(&registry),
    )
}
