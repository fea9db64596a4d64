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

/// The HTTP front end over the slot, with `GET /v1/replica` and the leader gate.
pub fn http_router(slot: Slot, replica: Replica) -> Router {
    let status = replica.clone();
    Router::new()
        .route(
            "/v1/replica",
            axum::routing::get(move || {
                let s = status.status_json();
                async move { axum::Json(s) }
            }),
        )
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
        if crate::auth::permission(req.uri().path()) == Some(Permission::Read) || self.0.is_leader()
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
