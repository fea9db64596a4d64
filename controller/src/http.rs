//! The HTTP/JSON front end: the same operations as gRPC, for platforms that prefer plain
//! HTTP. Bodies and answers are the `.proto` messages in JSON (field names as in
//! `protocol/proto/controller.proto`). Errors are `{"error": {"code", "message"}}` with the
//! gRPC code name and a matching HTTP status (docs/OPERATIONS.md lists them).
//!
//! | method | path | body → answer |
//! | --- | --- | --- |
//! | POST | /v1/models | RegisterModelRequest → ModelInfo |
//! | GET | /v1/models | → ListModelsResponse |
//! | GET | /v1/models/{name} | → ModelInfo (name may contain `/`) |
//! | GET | /v1/status/{name} | → ModelStatus |
//! | POST | /v1/prewarm | PrewarmRequest → PlanAccepted |
//! | POST | /v1/scale-out | ScaleOutRequest → PlanAccepted |
//! | POST | /v1/evict | EvictRequest → EvictResponse |
//! | GET | /v1/plans | → ListPlansResponse |
//! | GET | /v1/plans/{id} | → PlanStatus |
//! | GET | /v1/plans/{id}/watch | → newline-delimited PlanStatus until the plan ends |
//! | GET | /v1/hosts | → ListHostsResponse |
//! | POST | /v1/heartbeat | HostReport → HeartbeatResponse |
//! | POST | /v1/load | ReportLoadRequest → ReportLoadResponse (the autoscaler's decision) |
//! | GET | /v1/events | → ListEventsResponse (`?model=` filters) |
//! | POST | /v1/partition-plan | GetPartitionPlanRequest → the plan table as JSON |
//! | GET | /metrics | → the controller's metrics (Prometheus text 0.0.4, `crate::metrics`) |
//! | GET | /healthz | → `ok` |

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use shardcast_protocol::controller::{
    EvictRequest, EvictResponse, GetPartitionPlanRequest, HeartbeatResponse, HostReport,
    ListModelsResponse, ModelInfo, ModelStatus, PlanAccepted, PrewarmRequest, RegisterModelRequest,
    ReportLoadRequest, ReportLoadResponse, ScaleOutRequest,
};

use crate::core::now_unix;
use crate::error::ApiError;
use crate::services::Services;
use crate::wire::plan_status;

type Ctl = State<Arc<Services>>;

fn body<T: DeserializeOwned>(bytes: &Bytes) -> Result<T, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::invalid("the request needs a JSON body"));
    }
    serde_json::from_slice(bytes).map_err(|e| ApiError::invalid(format!("request body: {e}")))
}

/// An operation's answer: its value as JSON, or its error (typed per operation, mapped to
/// a status through [`ApiError`]).
fn json<T: Serialize, E: Into<ApiError>>(r: Result<T, E>) -> Response {
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into().into_response(),
    }
}

fn ok<T: Serialize>(v: T) -> Response {
    axum::Json(v).into_response()
}

/// The HTTP router.
pub fn router(c: Arc<Services>) -> Router {
    let metrics = c.core.config().metrics.clone();
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/v1/models",
            get(|State(c): Ctl| async move { ok(ListModelsResponse::from(c.core.list_models())) }).post(
                |State(c): Ctl, b: Bytes| async move {
                    match body::<RegisterModelRequest>(&b) {
                        Ok(req) => json(c.core.register_model(crate::wire::register(req)).await.map(ModelInfo::from)),
                        Err(e) => e.into_response(),
                    }
                },
            ),
        )
        .route(
            "/v1/models/{*model}",
            get(|State(c): Ctl, Path(m): Path<String>| async move { json(c.core.get_model(&m).map(ModelInfo::from)) }),
        )
        .route(
            "/v1/status/{*model}",
            get(|State(c): Ctl, Path(m): Path<String>| async move { json(c.core.get_status(&m).map(ModelStatus::from)) }),
        )
        .route(
            "/v1/prewarm",
            post(|State(c): Ctl, b: Bytes| async move {
                json(body::<PrewarmRequest>(&b).and_then(crate::wire::prewarm).and_then(|r| c.core.prewarm(r).map_err(ApiError::from)).map(PlanAccepted::from))
            }),
        )
        .route(
            "/v1/scale-out",
            post(|State(c): Ctl, b: Bytes| async move {
                match body::<ScaleOutRequest>(&b).and_then(crate::wire::scale_out) {
                    Ok(req) => json(c.scale_out(req).await.map(PlanAccepted::from)),
                    Err(e) => json::<PlanAccepted, _>(Err(e)),
                }
            }),
        )
        .route(
            "/v1/evict",
            post(|State(c): Ctl, b: Bytes| async move {
                match body::<EvictRequest>(&b).and_then(crate::wire::evict) {
                    Ok(req) => json(c.core.evict(req).await.map(EvictResponse::from)),
                    Err(e) => e.into_response(),
                }
            }),
        )
        .route(
            "/v1/plans",
            get(|State(c): Ctl| async move { ok(crate::grpc::list_plans(&c.core)) }),
        )
        .route(
            "/v1/plans/{id}",
            get(|State(c): Ctl, Path(id): Path<String>| async move {
                json(c.core.get_plan(&id).map(|p| plan_status(&p, now_unix())))
            }),
        )
        .route("/v1/plans/{id}/watch", get(watch))
        .route(
            "/v1/hosts",
            get(|State(c): Ctl| async move { ok(crate::wire::host_list(c.core.list_hosts())) }),
        )
        .route(
            "/v1/heartbeat",
            post(|State(c): Ctl, peer: Option<axum::Extension<shardcast_identity::Peer>>, b: Bytes| async move {
                let peer = peer.map(|p| p.0).unwrap_or(shardcast_identity::Peer::Anonymous);
                json(
                    body::<HostReport>(&b)
                        .and_then(|r| crate::auth::check_heartbeat(&peer, &r.host_id).map(|_| r))
                        .and_then(crate::wire::host_view)
                        .and_then(|r| c.core.heartbeat(r).map(HeartbeatResponse::from).map_err(ApiError::from)),
                )
            }),
        )
        .route(
            "/v1/load",
            post(|State(c): Ctl, b: Bytes| async move {
                match body::<ReportLoadRequest>(&b).and_then(crate::wire::report_load) {
                    Ok(req) => json(c.autoscaler.report_load(req).await.map(|d| ReportLoadResponse {
                        decision: Some(d.into()),
                    })),
                    Err(e) => e.into_response(),
                }
            }),
        )
        .route(
            "/v1/events",
            get(
                |State(c): Ctl, Query(q): Query<std::collections::HashMap<String, String>>| async move {
                    let model = q.get("model").cloned().unwrap_or_default();
                    ok(crate::wire::event_list(c.events().list(&model, 100)))
                },
            ),
        )
        .route(
            "/v1/partition-plan",
            post(|State(c): Ctl, b: Bytes| async move {
                match body::<GetPartitionPlanRequest>(&b) {
                    Ok(req) => match c.tables.partition_plan(crate::wire::partition_plan_query(req)).await {
                        Ok(r) => (
                            [(header::CONTENT_TYPE, "application/json")],
                            r.json,
                        )
                            .into_response(),
                        Err(e) => e.into_response(),
                    },
                    Err(e) => e.into_response(),
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(c): Ctl| async move {
                let text = c
                    .core
                    .config()
                    .metrics
                    .render(Box::new(crate::exposition::StateCollector(c.clone())));
                ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text)
            }),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            metrics,
            crate::metrics::time_http,
        ))
        .fallback(|| async {
            ApiError::not_found("no such endpoint; see docs/OPERATIONS.md for the HTTP API")
        })
        .with_state(c)
}

async fn watch(State(c): Ctl, Path(id): Path<String>) -> Response {
    let stream = match crate::grpc::plan_updates(&c.core, &id) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let lines = stream.map(|item| {
        let line = match item {
            Ok(s) => serde_json::to_vec(&s),
            Err(status) => serde_json::to_vec(&serde_json::json!({
                "error": { "code": crate::error::code_name(status.code()), "message": status.message() }
            })),
        };
        let mut line = line.unwrap_or_default();
        line.push(b'\n');
        Ok::<_, std::convert::Infallible>(Bytes::from(line))
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response()
}
