//! The switch in front of the services: each call goes to the controller the slot holds
//! now (the leader's full one, or a follower's read-only view), and writes are refused on
//! a follower with the leader's address.

use super::*;

/// A gRPC service that serves each call with the service `make` builds over the current
/// controller in the slot.
#[derive(Clone)]
pub struct Switch<S> {
    slot: Slot,
    make: fn(Arc<Services>) -> S,
}

impl<S> Switch<S> {
    /// Serves with `make(current controller)`.
    pub fn new(slot: Slot, make: fn(Arc<Services>) -> S) -> Self {
        Self { slot, make }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Switch<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tower::Service<http::Request<B>> for Switch<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tower::util::Oneshot<S, http::Request<B>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        (self.make)(self.slot.load().ctl.clone()).oneshot(req)
    }
}

/// The HTTP routes of the current controller.
#[derive(Clone)]
struct HttpSwitch(Slot);

impl tower::Service<http::Request<Body>> for HttpSwitch {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = tower::util::Oneshot<Router, http::Request<Body>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        self.0.load().http.clone().oneshot(req)
    }
}

/// What the routes in front of the current controller read: this replica, its readiness
/// and the API's OpenAPI document (`crate::openapi::json`, given by the process: the
/// document is made from these routes, so this module does not call it).
#[derive(Clone)]
pub struct Front {
    replica: Replica,
    readiness: shardcast_identity::ready::Readiness,
    openapi: fn() -> String,
}

/// The routes in front of the current controller (`/v1/replica`, `/readyz`,
/// `/openapi.json`), each with its part of the OpenAPI document.
pub fn front_routes() -> utoipa_axum::router::OpenApiRouter<Front> {
    use utoipa_axum::routes;
    utoipa_axum::router::OpenApiRouter::default()
        .routes(routes!(replica_status))
        .routes(routes!(readyz))
        .routes(routes!(openapi_json))
}

/// This replica's id and role, the leader, and how its follower view kept up.
#[utoipa::path(get, path = "/v1/replica", tag = "replicas",
    responses(
        (status = 200, description = "`{id, role: leader|follower, leader: {id, grpc, http} | null, view: {full_loads, applied, resumed, revision}}`.", body = Object),
        (status = "default", description = "An error.", body = crate::error::ErrorBody)))]
async fn replica_status(
    axum::extract::State(f): axum::extract::State<Front>,
) -> axum::Json<serde_json::Value> {
    axum::Json(f.replica.status_json())
}

/// Readiness (anonymous, for probes): the listeners are up, the state is loaded and, on
/// etcd, the leader is known (this replica or another); lost once shutdown begins.
#[utoipa::path(get, path = "/readyz", tag = "probes",
    responses(
        (status = 200, description = "`ready`.", body = String, content_type = "text/plain"),
        (status = 503, description = "`not ready`, then one line per unmet condition (`name: reason`), or `draining: shutting down`.", body = String, content_type = "text/plain")))]
async fn readyz(
    axum::extract::State(f): axum::extract::State<Front>,
) -> (http::StatusCode, String) {
    f.readiness.http_answer()
}

/// This API's OpenAPI 3.1 document (the same as `shardcast-controller openapi` prints).
#[utoipa::path(get, path = "/openapi.json", tag = "meta",
    responses(
        (status = 200, description = "The OpenAPI document.", body = Object),
        (status = "default", description = "An error.", body = crate::error::ErrorBody)))]
async fn openapi_json(
    axum::extract::State(f): axum::extract::State<Front>,
) -> axum::response::Response {
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        (f.openapi)(),
    )
        .into_response()
}

/// The HTTP front end over the slot: [`front_routes`], then the current controller's
/// routes, behind the leader gate. `openapi` answers `/openapi.json`.
pub fn http_router(
    slot: Slot,
    replica: Replica,
    readiness: shardcast_identity::ready::Readiness,
    openapi: fn() -> String,
) -> Router {
    let (front, _) = front_routes().split_for_parts();
    front
        .with_state(Front {
            replica: replica.clone(),
            readiness,
            openapi,
        })
        .fallback_service(HttpSwitch(slot))
        .layer(shardcast_identity::grpc::GateLayer::gate(LeaderGate(
            replica,
        )))
}

/// Refuses writes on a replica that does not lead, naming the leader.
#[derive(Clone)]
pub struct LeaderGate(pub Replica);

impl<B> Gate<B, tonic::body::Body> for LeaderGate {
    fn admit(&self, req: &mut http::Request<B>) -> Result<(), http::Response<tonic::body::Body>> {
        // Reads and health checks are a follower's to answer.
        if matches!(
            crate::auth::permission(req.uri().path()),
            Some(Permission::Read | Permission::Health)
        ) || self.0.is_leader()
        {
            return Ok(());
        }
        let (msg, leader) = self.0.refusal();
        let mut status = tonic::Status::unavailable(msg);
        // Always present on a refusal (empty: no leader known), so clients can tell it
        // from an UNAVAILABLE of the call itself.
        let hint = leader.map(|l| l.grpc).unwrap_or_default();
        if let Ok(v) = hint.parse() {
            status.metadata_mut().insert(LEADER_HEADER, v);
        }
        Err(status.into_http())
    }
}

impl<B> Gate<B, Body> for LeaderGate {
    fn admit(&self, req: &mut http::Request<B>) -> Result<(), http::Response<Body>> {
        let read = matches!(
            crate::auth::http_permission(req.method(), req.uri().path()),
            None | Some(Permission::Read)
        );
        if read || self.0.is_leader() {
            return Ok(());
        }
        let (msg, leader) = self.0.refusal();
        let body = serde_json::json!({
            "error": {"code": "unavailable", "message": msg},
            "leader": leader,
        });
        let mut resp = (http::StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
        if let Some(l) = leader
            && let Ok(v) = http::HeaderValue::from_str(&l.http)
        {
            resp.headers_mut().insert(LEADER_HEADER, v);
        }
        Err(resp)
    }
}
