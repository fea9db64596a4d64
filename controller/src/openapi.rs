//! The HTTP API's OpenAPI 3.1 document, generated from the code: the routes and their
//! operations from the handlers' `#[utoipa::path]` attributes ([`crate::http::routes`] and
//! [`crate::ha::front_routes`], which are also what the router serves), the request and
//! answer schemas from the `.proto` messages (`ToSchema`, the protocol crate's `openapi`
//! feature) and [`crate::error::ErrorBody`], and each operation's permission from
//! [`crate::auth::http_permission`] (the table the HTTP listener enforces).
//!
//! Served at `GET /openapi.json` (read permission), printed by `shardcast-controller
//! openapi`, and committed as `docs/openapi.json` (a test regenerates it and compares).
//!
//! Two touches after generation: axum's catch-all parameters (`{*model}`: a model name may
//! contain `/`) are written `{model}` as OpenAPI has no catch-all, and every operation gets
//! its `security` (none for the anonymous probes, a client certificate or a bearer token
//! otherwise) and an `x-shardcast-permission` naming what the caller's role must hold.

use std::sync::OnceLock;

use axum::http::Method;
use serde_json::{Value, json};
use utoipa::openapi::OpenApi;

/// The methods an OpenAPI path item may hold, as its keys and as HTTP methods.
pub const METHODS: [(&str, Method); 8] = [
    ("get", Method::GET),
    ("put", Method::PUT),
    ("post", Method::POST),
    ("delete", Method::DELETE),
    ("options", Method::OPTIONS),
    ("head", Method::HEAD),
    ("patch", Method::PATCH),
    ("trace", Method::TRACE),
];

/// The document's frame: title, version, description, security schemes.
fn frame() -> OpenApi {
    let mut doc = OpenApi::default();
    doc.info = utoipa::openapi::InfoBuilder::new()
        .title("shardcast controller HTTP API")
        .version(env!("CARGO_PKG_VERSION"))
        .description(Some(
            "The controller's HTTP/JSON API: the same operations as its gRPC API \
             (protocol/proto/controller.proto), with the messages in JSON (field names as in \
             the .proto; enum fields by name). Every call but the probes needs a client \
             certificate of the cluster CA or a bearer token, of a role that holds the \
             operation's x-shardcast-permission (admin ⊃ platform ⊃ read; host: heartbeat). \
             On a follower replica writes answer 503 naming the leader \
             (x-shardcast-leader). Errors are {\"error\": {\"code\", \"message\"}}.",
        ))
        .license(Some(utoipa::openapi::License::new("Apache-2.0")))
        .build();
    doc
}

/// The document as JSON.
pub fn document() -> Value {
    let (_, inner) = crate::http::routes().split_for_parts();
    let (_, front) = crate::ha::front_routes().split_for_parts();
    let mut doc = frame();
    doc.merge(front);
    doc.merge(inner);
    let mut v = serde_json::to_value(&doc).unwrap_or_else(|_| json!({}));
    finish(&mut v);
    v
}

/// [`document`] as indented JSON with a final newline, computed once.
pub fn json() -> String {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| {
        let mut s = serde_json::to_string_pretty(&document()).unwrap_or_else(|_| "{}".into());
        s.push('\n');
        s
    })
    .clone()
}

/// `{*name}` (axum's catch-all) as `{name}`.
pub fn openapi_path(route: &str) -> String {
    route.replace("{*", "{")
}

/// Paths in OpenAPI form; security and permission on every operation; the schemes.
fn finish(v: &mut Value) {
    if let Some(paths) = v.get_mut("paths").and_then(Value::as_object_mut) {
        let old = std::mem::take(paths);
        for (route, mut item) in old {
            let path = openapi_path(&route);
            for (key, method) in &METHODS {
                let Some(op) = item.get_mut(*key).and_then(Value::as_object_mut) else {
                    continue;
                };
                match crate::auth::http_permission(method, &path) {
                    None => {
                        op.insert("security".into(), json!([{}]));
                        op.insert("x-shardcast-permission".into(), json!("none"));
                    }
                    Some(p) => {
                        op.insert(
                            "security".into(),
                            json!([{ "mutualTLS": [] }, { "bearer": [] }]),
                        );
                        op.insert("x-shardcast-permission".into(), json!(p.as_str()));
                    }
                }
            }
            paths.insert(path, item);
        }
    }
    let components = v
        .as_object_mut()
        .map(|o| o.entry("components").or_insert_with(|| json!({})));
    if let Some(c) = components.and_then(Value::as_object_mut) {
        c.insert(
            "securitySchemes".into(),
            json!({
                "mutualTLS": {
                    "type": "mutualTLS",
                    "description": "A client certificate of the cluster CA naming shardcast://<role>/<name>."
                },
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A token from the controller's tokens file (`shardcast certs token`), carrying a role."
                }
            }),
        );
    }
}

/// Every (method, path) the document describes, sorted, paths in OpenAPI form.
pub fn operations(doc: &Value) -> Vec<(String, String)> {
    let mut ops = Vec::new();
    if let Some(paths) = doc.get("paths").and_then(Value::as_object) {
        for (path, item) in paths {
            for (key, method) in &METHODS {
                if item.get(*key).is_some() {
                    ops.push((method.to_string(), path.clone()));
                }
            }
        }
    }
    ops.sort();
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `routes!(…)` handler's `#[utoipa::path(method, path = "…")]` in a source file.
    fn annotated(src: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for chunk in src.split("#[utoipa::path(").skip(1) {
            let method = chunk.split(',').next().unwrap_or_default().trim();
            let path = chunk
                .split("path = \"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap_or_default();
            out.push((method.to_ascii_uppercase(), openapi_path(path)));
        }
        out
    }

    const SOURCES: [(&str, &str); 2] = [
        ("http.rs", include_str!("http.rs")),
        ("ha/switch.rs", include_str!("ha/switch.rs")),
    ];

    #[test]
    fn routes_are_added_only_with_their_documentation() {
        // A route added with axum's own `.route(…)`, `.nest(…)` or `.route_service(…)`
        // would be served undocumented: the router files add routes through
        // `utoipa_axum::routes!` only.
        for (file, src) in SOURCES {
            for call in [".route(", ".nest(", ".route_service(", ".nest_service("] {
                assert!(
                    !src.contains(call),
                    "{file} adds a route with {call}…): register a handler with #[utoipa::path] and routes!(…) instead"
                );
            }
        }
        // Every annotated handler is in the document, and nothing else is.
        let mut annotated: Vec<_> = SOURCES.iter().flat_map(|(_, s)| annotated(s)).collect();
        annotated.sort();
        assert_eq!(operations(&document()), annotated);
        assert!(annotated.len() >= 20, "{annotated:?}");
    }

    #[test]
    fn every_operation_says_who_may_call_it() {
        let doc = document();
        for (method, path) in operations(&doc) {
            let op = &doc["paths"][&path][method.to_ascii_lowercase()];
            let perm = op["x-shardcast-permission"].as_str().unwrap();
            let public = matches!(path.as_str(), "/healthz" | "/readyz");
            assert_eq!(perm == "none", public, "{method} {path}: {perm}");
            assert!(op["security"].is_array(), "{method} {path}");
        }
        assert_eq!(
            doc["paths"]["/openapi.json"]["get"]["x-shardcast-permission"],
            "read"
        );
        assert_eq!(
            doc["paths"]["/v1/models"]["post"]["x-shardcast-permission"],
            "admin"
        );
        // Catch-all parameters are plain OpenAPI parameters.
        assert!(doc["paths"]["/v1/models/{model}"]["get"].is_object());
        assert!(!json().contains("{*"));
    }

    #[test]
    fn schemas_are_the_json_the_api_speaks() {
        let doc = document();
        let schemas = &doc["components"]["schemas"];
        // Enum fields are names, as `shardcast_protocol::api::json` writes them.
        let tier = &schemas["PrewarmRequest"]["properties"]["tier"];
        assert_eq!(
            tier["oneOf"][0]["$ref"], "#/components/schemas/Tier",
            "{tier}"
        );
        assert_eq!(tier["default"], "", "{tier}");
        let tiers = schemas["Tier"]["enum"].as_array().unwrap();
        assert!(tiers.contains(&json!("gpu")) && tiers.contains(&json!("")));
        // The manifest bytes are not in the JSON (serde(skip)), so not in the schema.
        assert!(schemas["ModelInfo"]["properties"]["manifest"].is_null());
        assert!(schemas["ModelInfo"]["properties"]["digest"].is_object());
        // Nested messages are referenced and defined.
        for name in [
            "PlanStatus",
            "HostProgress",
            "HostReport",
            "Gpu",
            "ErrorBody",
        ] {
            assert!(schemas[name].is_object(), "{name} missing");
        }
        // Every $ref points at a defined schema.
        let text = json();
        for r in text.split("\"#/components/schemas/").skip(1) {
            let name = r.split('"').next().unwrap();
            assert!(schemas[name].is_object(), "dangling $ref {name}");
        }
    }

    #[test]
    fn the_committed_document_is_the_generated_one() {
        let committed = include_str!("../../docs/openapi.json");
        if committed != json() {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.json");
            if std::env::var_os("SHARDCAST_BLESS").is_some() {
                std::fs::write(path, json()).unwrap();
            }
            panic!(
                "docs/openapi.json is not the document the code generates: regenerate it with \
                 `cargo run -p shardcast-controller -- openapi > docs/openapi.json` (or run this \
                 test with SHARDCAST_BLESS=1)"
            );
        }
    }
}
