//! Who may call what on the controller: the one table of method → [`Permission`] for the
//! gRPC services and the same for HTTP routes (applied by `shardcast_identity`'s
//! `grpc::AuthzLayer` and `http::HttpAuthLayer`, which also take bearer tokens).
//!
//! | permission | gRPC methods | HTTP routes |
//! | --- | --- | --- |
//! | admin | RegisterModel, Evict | POST /v1/models, POST /v1/evict |
//! | platform | Prewarm, ScaleOut, ReportLoad | POST /v1/prewarm, /v1/scale-out, /v1/load |
//! | read | ListModels, GetModel, WatchPlan, GetPlan, ListPlans, GetStatus, ListHosts, ListEvents, GetPartitionPlan | every GET but /healthz, POST /v1/partition-plan |
//! | heartbeat | Inventory.Heartbeat | POST /v1/heartbeat |
//! | health (every role) | grpc.health.v1.Health Check, Watch | — |
//! | none | — | GET /healthz, GET /readyz |
//!
//! `GET /openapi.json` is a GET like the others: read. The document describes nothing a
//! caller could not learn from the repository (it is committed as `docs/openapi.json`),
//! but the anonymous surface stays the two probes, which reveal only liveness and
//! readiness. gRPC health needs a certificate of any role: the gRPC listener requires one
//! in the TLS handshake, so an anonymous caller (kubelet's gRPC probe, which speaks no
//! TLS) never reaches it; probes use the HTTP `/readyz`.
//!
//! Roles hold permissions as `shardcast_identity::Role::grants` says: `admin` ⊃ `platform`
//! ⊃ `read`; `host` holds only `heartbeat` (and the host id it reports must be its
//! certificate's); `controller` holds `read`. Peers on the Unix socket (0600) are local
//! operators and hold everything.

use axum::http::Method;
use shardcast_identity::{Peer, Permission};

use crate::error::ApiError;

/// What each gRPC method needs.
pub fn permission(path: &str) -> Option<Permission> {
    if let Some(p) = shardcast_identity::ready::health_permission(path) {
        return Some(p);
    }
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

/// What each HTTP route needs (`None`: public); the table of
/// `shardcast_identity::http::HttpAuthLayer` on the HTTP listener.
pub fn http_permission(method: &Method, path: &str) -> Option<Permission> {
    if matches!(path, "/healthz" | "/readyz") {
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
        Peer::LocalGroup { .. } | Peer::Anonymous => Err(ApiError::unauthenticated(
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
        assert_eq!(http_permission(&Method::GET, "/readyz"), None);
        assert_eq!(
            http_permission(&Method::GET, "/openapi.json"),
            Some(Permission::Read)
        );
        assert_eq!(
            permission("/grpc.health.v1.Health/Check"),
            Some(Permission::Health)
        );
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
