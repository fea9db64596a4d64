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
//!
//! and, in front of the current controller (`crate::ha::http_router`): `GET /v1/replica`,
//! `GET /readyz` and `GET /openapi.json`.
//!
//! Every route is a handler with a `#[utoipa::path]` attribute, registered with
//! `utoipa_axum::routes!`: the router takes each route's method and path from the same
//! attribute the OpenAPI document ([`crate::openapi`]) is generated from, so a route
//! cannot be served undocumented or documented unserved (a test checks the sources add no
//! route any other way, and the cluster tests call every documented route).

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use shardcast_protocol::controller::{
    EvictRequest, EvictResponse, GetPartitionPlanRequest, HeartbeatResponse, HostReport,
    ListEventsResponse, ListHostsResponse, ListModelsResponse, ListPlansResponse, ModelInfo,
    ModelStatus, PlanAccepted, PlanStatus, PrewarmRequest, RegisterModelRequest, ReportLoadRequest,
    ReportLoadResponse, ScaleOutRequest,
};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::core::now_unix;
use crate::error::{ApiError, ErrorBody};
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

/// The HTTP router over `c`: [`routes()`] with the request timing and the fallback.
pub fn router(c: Arc<Services>) -> Router {
    let metrics = c.core.config().metrics.clone();
    let (router, _) = routes().split_for_parts();
    router
        .route_layer(axum::middleware::from_fn_with_state(
            metrics,
            crate::metrics::time_http,
        ))
        .fallback(|| async {
            ApiError::not_found("no such endpoint; see docs/OPERATIONS.md for the HTTP API")
        })
        .with_state(c)
}

/// Every route of the current controller, each with its part of the OpenAPI document.
pub fn routes() -> OpenApiRouter<Arc<Services>> {
    OpenApiRouter::default()
        .routes(routes!(healthz))
        .routes(routes!(list_models, register_model))
        .routes(routes!(get_model))
        .routes(routes!(get_status))
        .routes(routes!(prewarm))
        .routes(routes!(scale_out))
        .routes(routes!(evict))
        .routes(routes!(list_plans))
        .routes(routes!(get_plan))
        .routes(routes!(watch))
        .routes(routes!(list_hosts))
        .routes(routes!(heartbeat))
        .routes(routes!(report_load))
        .routes(routes!(list_events))
        .routes(routes!(partition_plan))
        .routes(routes!(metrics))
}

/// The process is up (liveness; anonymous).
#[utoipa::path(get, path = "/healthz", tag = "probes",
    responses((status = 200, description = "The process is up.", body = String, content_type = "text/plain")))]
async fn healthz() -> &'static str {
    "ok\n"
}

/// Lists the registered models.
#[utoipa::path(get, path = "/v1/models", tag = "models",
    responses(
        (status = 200, description = "Every registered model.", body = ListModelsResponse),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn list_models(State(c): Ctl) -> Response {
    ok(ListModelsResponse::from(c.core.list_models()))
}

/// Registers a model by origin URI: builds its manifest; the same name with different
/// bytes records a new version.
#[utoipa::path(post, path = "/v1/models", tag = "models",
    request_body = RegisterModelRequest,
    responses(
        (status = 200, description = "The registered model.", body = ModelInfo),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn register_model(State(c): Ctl, b: Bytes) -> Response {
    match body::<RegisterModelRequest>(&b) {
        Ok(req) => json(
            c.core
                .register_model(crate::wire::register(req))
                .await
                .map(ModelInfo::from),
        ),
        Err(e) => e.into_response(),
    }
}

/// One model by name (which may contain `/`) or digest.
#[utoipa::path(get, path = "/v1/models/{*model}", tag = "models",
    params(("model" = String, Path, description = "A model name (it may contain `/`) or digest.")),
    responses(
        (status = 200, description = "The model.", body = ModelInfo),
        (status = "default", description = "An error (404: not registered).", body = ErrorBody)))]
async fn get_model(State(c): Ctl, Path(m): Path<String>) -> Response {
    json(c.core.get_model(&m).map(ModelInfo::from))
}

/// Where a model's copies are, per host and tier.
#[utoipa::path(get, path = "/v1/status/{*model}", tag = "models",
    params(("model" = String, Path, description = "A model name (it may contain `/`) or digest.")),
    responses(
        (status = 200, description = "The model's copies.", body = ModelStatus),
        (status = "default", description = "An error (404: not registered).", body = ErrorBody)))]
async fn get_status(State(c): Ctl, Path(m): Path<String>) -> Response {
    json(c.core.get_status(&m).map(ModelStatus::from))
}

/// Plans `replicas` copies (or the named hosts) of a model and starts the chains.
#[utoipa::path(post, path = "/v1/prewarm", tag = "plans",
    request_body = PrewarmRequest,
    responses(
        (status = 200, description = "The accepted plan.", body = PlanAccepted),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn prewarm(State(c): Ctl, b: Bytes) -> Response {
    json(
        body::<PrewarmRequest>(&b)
            .and_then(crate::wire::prewarm)
            .and_then(|r| c.core.prewarm(r).map_err(ApiError::from))
            .map(PlanAccepted::from),
    )
}

/// Scales a model out by `add` replicas (chains, or a partitioned burst).
#[utoipa::path(post, path = "/v1/scale-out", tag = "plans",
    request_body = ScaleOutRequest,
    responses(
        (status = 200, description = "The accepted plan.", body = PlanAccepted),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn scale_out(State(c): Ctl, b: Bytes) -> Response {
    match body::<ScaleOutRequest>(&b).and_then(crate::wire::scale_out) {
        Ok(req) => json(c.scale_out(req).await.map(PlanAccepted::from)),
        Err(e) => json::<PlanAccepted, _>(Err(e)),
    }
}

/// Evicts a model's copies from hosts and tiers.
#[utoipa::path(post, path = "/v1/evict", tag = "models",
    request_body = EvictRequest,
    responses(
        (status = 200, description = "What was evicted.", body = EvictResponse),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn evict(State(c): Ctl, b: Bytes) -> Response {
    match body::<EvictRequest>(&b).and_then(crate::wire::evict) {
        Ok(req) => json(c.core.evict(req).await.map(EvictResponse::from)),
        Err(e) => e.into_response(),
    }
}

/// Lists the plans, running and finished.
#[utoipa::path(get, path = "/v1/plans", tag = "plans",
    responses(
        (status = 200, description = "Every plan.", body = ListPlansResponse),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn list_plans(State(c): Ctl) -> Response {
    ok(crate::grpc::list_plans(&c.core))
}

/// One plan's progress.
#[utoipa::path(get, path = "/v1/plans/{id}", tag = "plans",
    params(("id" = String, Path, description = "The plan's id.")),
    responses(
        (status = 200, description = "The plan's progress.", body = PlanStatus),
        (status = "default", description = "An error (404: no such plan).", body = ErrorBody)))]
async fn get_plan(State(c): Ctl, Path(id): Path<String>) -> Response {
    json(c.core.get_plan(&id).map(|p| plan_status(&p, now_unix())))
}

/// Lists the hosts in the inventory.
#[utoipa::path(get, path = "/v1/hosts", tag = "hosts",
    responses(
        (status = 200, description = "Every known host.", body = ListHostsResponse),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn list_hosts(State(c): Ctl) -> Response {
    ok(crate::wire::host_list(c.core.list_hosts()))
}

/// A host's heartbeat (what transferd sends over gRPC): the host id must be the
/// certificate's.
#[utoipa::path(post, path = "/v1/heartbeat", tag = "hosts",
    request_body = HostReport,
    responses(
        (status = 200, description = "The registry's current bindings for the host's names.", body = HeartbeatResponse),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn heartbeat(
    State(c): Ctl,
    peer: Option<axum::Extension<shardcast_identity::Peer>>,
    b: Bytes,
) -> Response {
    let peer = peer
        .map(|p| p.0)
        .unwrap_or(shardcast_identity::Peer::Anonymous);
    json(
        body::<HostReport>(&b)
            .and_then(|r| crate::auth::check_heartbeat(&peer, &r.host_id).map(|_| r))
            .and_then(crate::wire::host_view)
            .and_then(|r| {
                c.core
                    .heartbeat(r)
                    .map(HeartbeatResponse::from)
                    .map_err(ApiError::from)
            }),
    )
}

/// Reports a model's load; answers the autoscaler's decision.
#[utoipa::path(post, path = "/v1/load", tag = "autoscaler",
    request_body = ReportLoadRequest,
    responses(
        (status = 200, description = "The autoscaler's decision.", body = ReportLoadResponse),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn report_load(State(c): Ctl, b: Bytes) -> Response {
    match body::<ReportLoadRequest>(&b).and_then(crate::wire::report_load) {
        Ok(req) => json(
            c.autoscaler
                .report_load(req)
                .await
                .map(|d| ReportLoadResponse {
                    decision: Some(d.into()),
                }),
        ),
        Err(e) => e.into_response(),
    }
}

/// The latest events (plans, evictions, autoscaler decisions), newest last.
#[utoipa::path(get, path = "/v1/events", tag = "autoscaler",
    params(("model" = Option<String>, Query, description = "Only this model's events.")),
    responses(
        (status = 200, description = "Up to 100 events.", body = ListEventsResponse),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn list_events(
    State(c): Ctl,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> Response {
    let model = q.get("model").cloned().unwrap_or_default();
    ok(crate::wire::event_list(c.events().list(&model, 100)))
}

/// A model's partition plan table and the plan chosen for a queue length.
#[utoipa::path(post, path = "/v1/partition-plan", tag = "models",
    request_body = GetPartitionPlanRequest,
    responses(
        (status = 200, description = "The plan table (`shardcast_policies::partition::PlanTable`) with the chosen plan, as JSON.", body = Object),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn partition_plan(State(c): Ctl, b: Bytes) -> Response {
    match body::<GetPartitionPlanRequest>(&b) {
        Ok(req) => match c
            .tables
            .partition_plan(crate::wire::partition_plan_query(req))
            .await
        {
            Ok(r) => ([(header::CONTENT_TYPE, "application/json")], r.json).into_response(),
            Err(e) => e.into_response(),
        },
        Err(e) => e.into_response(),
    }
}

/// The controller's metrics.
#[utoipa::path(get, path = "/metrics", tag = "metrics",
    responses(
        (status = 200, description = "Prometheus text format 0.0.4.", body = String, content_type = "text/plain; version=0.0.4"),
        (status = "default", description = "An error.", body = ErrorBody)))]
async fn metrics(State(c): Ctl) -> Response {
    let text = c
        .core
        .config()
        .metrics
        .render(Box::new(crate::exposition::StateCollector(c.clone())));
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response()
}

/// A plan's progress as it changes, one JSON object a line, until the plan ends.
#[utoipa::path(get, path = "/v1/plans/{id}/watch", tag = "plans",
    params(("id" = String, Path, description = "The plan's id.")),
    responses(
        (status = 200, description = "Newline-delimited `PlanStatus` objects (an error mid-stream is a line `{\"error\": {code, message}}`).", body = PlanStatus, content_type = "application/x-ndjson"),
        (status = "default", description = "An error (404: no such plan).", body = ErrorBody)))]
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
