//! Who may call what on the controller: the one table of method → [`Permission`] for the
//! gRPC services, the same for HTTP routes, bearer tokens for HTTP clients, and the axum
//! listener that carries each connection's authenticated peer.
//!
//! | permission | gRPC methods | HTTP routes |
//! | --- | --- | --- |
//! | admin | RegisterModel, Evict | POST /v1/models, POST /v1/evict |
//! | platform | Prewarm, ScaleOut, ReportLoad | POST /v1/prewarm, /v1/scale-out, /v1/load |
//! | read | ListModels, GetModel, WatchPlan, GetPlan, ListPlans, GetStatus, ListHosts, ListEvents, GetPartitionPlan | every GET but /healthz, POST /v1/partition-plan |
//! | heartbeat | Inventory.Heartbeat | POST /v1/heartbeat |
//! | none | — | GET /healthz |
//!
//! Roles hold permissions as `shardcast_identity::Role::grants` says: `admin` ⊃ `platform`
//! ⊃ `read`; `host` holds only `heartbeat` (and the host id it reports must be its
//! certificate's); `controller` holds `read`. Peers on the Unix socket (0600) are local
//! operators and hold everything.

use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use shardcast_identity::grpc::{AuthzStats, Incoming, PeerInfo};
use shardcast_identity::token::Tokens;
use shardcast_identity::{Peer, Permission};
use tokio_stream::StreamExt;
use tracing::warn;

use crate::error::ApiError;

/// What each gRPC method needs.
pub fn permission(path: &str) -> Option<Permission> {
    if path == "/shardcast.controller.v1.Inventory/Heartbeat" {
        return Some(Permission::Heartbeat);
    }
    let method = path.strip_prefix("/shardcast.controller.v1.Controller/")?;
    Some(match method {
        "RegisterModel" | "Evict" => Permission::Admin,
        "Prewarm" | "ScaleOut" | "ReportLoad" => Permission::Platform,
        "ListModels" | "GetModel" | "WatchPlan" | "GetPlan" | "ListPlans" | "GetStatus"
        | "ListHosts" | "ListEvents" | "GetPartitionPlan" => Permission::Read,
        _ => return None,
    })
}

/// What each HTTP route needs (`None`: public).
fn http_permission(method: &Method, path: &str) -> Option<Permission> {
    if path == "/healthz" {
        return None;
    }
    Some(match (method, path) {
        (&Method::POST, "/v1/models" | "/v1/evict") => Permission::Admin,
        (&Method::POST, "/v1/prewarm" | "/v1/scale-out" | "/v1/load") => Permission::Platform,
        (&Method::POST, "/v1/heartbeat") => Permission::Heartbeat,
        (&Method::POST, "/v1/partition-plan") => Permission::Read,
        (&Method::GET | &Method::HEAD, _) => Permission::Read,
        // Unknown method/route pairs: only local operators reach the 404/405.
        _ => Permission::Admin,
    })
}

/// Authentication state shared by the HTTP middleware.
#[derive(Clone)]
pub struct HttpAuth {
    /// Bearer tokens (empty: none accepted).
    pub tokens: Arc<Tokens>,
    /// Refusal counters (shared with the gRPC layer).
    pub stats: Arc<AuthzStats>,
}

/// The peer of one HTTP connection (axum `ConnectInfo`).
#[derive(Debug, Clone)]
pub struct HttpPeer(pub PeerInfo);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, HttpListener>>
    for HttpPeer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, HttpListener>) -> Self {
        Self(stream.remote_addr().clone())
    }
}

/// An axum listener over authenticated connections (handshakes run in their own tasks).
pub struct HttpListener {
    incoming: Incoming,
    local: std::net::SocketAddr,
}

impl HttpListener {
    /// Wraps `incoming`, bound at `local`.
    pub fn new(incoming: Incoming, local: std::net::SocketAddr) -> Self {
        Self { incoming, local }
    }
}

impl axum::serve::Listener for HttpListener {
    type Io = shardcast_identity::grpc::AuthedIo;
    type Addr = PeerInfo;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.incoming.next().await {
                Some(Ok(io)) => {
                    let info = io.info().clone();
                    return (io, info);
                }
                Some(Err(e)) => warn!("HTTP accept failed: {e}"),
                // The accept task ended (shutdown): never yield again.
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(PeerInfo {
            peer: Peer::Anonymous,
            addr: self.local.to_string(),
        })
    }
}

/// Authenticates (certificate, else bearer token) and authorises every HTTP request, and
/// leaves the resolved [`Peer`] in the request's extensions for handlers that check names
/// (heartbeats).
pub async fn middleware(
    State(auth): State<HttpAuth>,
    ConnectInfo(HttpPeer(info)): ConnectInfo<HttpPeer>,
    mut req: Request,
    next: Next,
) -> Response {
    let mut peer = info.peer;
    if let Some(value) = req.headers().get(axum::http::header::AUTHORIZATION) {
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        match token.and_then(|t| auth.tokens.lookup(t)) {
            Some(id) if matches!(peer, Peer::Anonymous | Peer::Insecure) => {
                peer = Peer::Token(id.clone())
            }
            Some(_) => {}
            None => {
                auth.stats
                    .unauthenticated
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                warn!(peer = %info.addr, path = req.uri().path(), "refused an unknown bearer token");
                return ApiError::unauthenticated("the bearer token is not valid").into_response();
            }
        }
    }
    if let Some(needed) = http_permission(req.method(), req.uri().path())
        && let Err(denied) = peer.authorize(needed)
    {
        let anonymous = matches!(peer, Peer::Anonymous);
        let counter = if anonymous {
            &auth.stats.unauthenticated
        } else {
            &auth.stats.denied
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        warn!(%peer, addr = %info.addr, path = req.uri().path(), needs = %needed, "refused HTTP request");
        let e = if anonymous {
            ApiError::unauthenticated(format!(
                "{denied}; present a client certificate of the cluster CA or a bearer token"
            ))
        } else {
            ApiError::permission_denied(denied.to_string())
        };
        return e.into_response();
    }
    req.extensions_mut().insert(peer);
    next.run(req).await
}

/// Checks that a heartbeat for `host_id` comes from that host: a `host` certificate must
/// name it (a local or insecure-mode peer is trusted with any).
pub fn check_heartbeat(peer: &Peer, host_id: &str) -> Result<(), ApiError> {
    match peer {
        Peer::Cert(id) | Peer::Token(id) if id.name == host_id => Ok(()),
        Peer::Cert(id) | Peer::Token(id) => Err(ApiError::permission_denied(format!(
            "{peer} may not report as host {host_id:?} (its certificate names {})",
            id.name
        ))),
        Peer::Local { .. } | Peer::Insecure => Ok(()),
        Peer::Anonymous => Err(ApiError::unauthenticated(
            "heartbeats need a host certificate",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rpc_has_a_permission() {
        let proto = include_str!("../../protocol/proto/controller.proto");
        let mut service = "";
        for line in proto.lines().map(str::trim) {
            if let Some(s) = line.strip_prefix("service ") {
                service = s.trim_end_matches(" {").trim();
            }
            if let Some(rest) = line.strip_prefix("rpc ") {
                let method = rest.split('(').next().unwrap_or_default().trim();
                let path = format!("/shardcast.controller.v1.{service}/{method}");
                assert!(permission(&path).is_some(), "{path} has no permission");
            }
        }
        assert_eq!(permission("/shardcast.controller.v1.Controller/Nope"), None);
    }

    #[test]
    fn http_routes() {
        assert_eq!(http_permission(&Method::GET, "/healthz"), None);
        assert_eq!(
            http_permission(&Method::POST, "/v1/models"),
            Some(Permission::Admin)
        );
        assert_eq!(
            http_permission(&Method::GET, "/v1/models"),
            Some(Permission::Read)
        );
        assert_eq!(
            http_permission(&Method::POST, "/v1/prewarm"),
            Some(Permission::Platform)
        );
        assert_eq!(
            http_permission(&Method::DELETE, "/v1/models"),
            Some(Permission::Admin)
        );
    }
}
