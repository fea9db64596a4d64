//! Compiles `proto/agent.proto` and `proto/controller.proto` with protox (a protobuf
//! compiler in pure Rust), so building shardcast never needs a system `protoc`. The
//! controller's messages also derive serde, so the HTTP/JSON API uses the same types.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["proto/agent.proto", "proto/controller.proto"], ["proto"])?;
    // With the `openapi` feature the same messages derive their OpenAPI schemas (their
    // proto comments become the descriptions); `#[serde(default)]` makes every field
    // optional in a request, as the schemas say.
    let mut config = tonic_prost_build::configure().message_attribute(
        ".shardcast.controller.v1",
        "#[derive(serde::Serialize, serde::Deserialize)] #[serde(default)] \
         #[cfg_attr(feature = \"openapi\", derive(utoipa::ToSchema))]",
    );
    // Enum fields are numbers on the gRPC wire and their lowercase names in JSON.
    for (field, module) in [
        ("PrewarmRequest.tier", "tier"),
        ("ScaleOutRequest.tier", "tier"),
        ("EvictRequest.tier", "tier"),
        ("ReportLoadRequest.tier", "tier"),
        ("PlanStatus.tier", "tier"),
        ("PrewarmRequest.transport", "transport"),
        ("ScaleOutRequest.transport", "transport"),
        ("PlanStatus.transport", "transport"),
        ("PlanStatus.state", "plan_state"),
        ("PlanStatus.kind", "plan_kind"),
        ("HostProgress.state", "receiver_state"),
        ("HostProgress.gpu_state", "gpu_state"),
    ] {
        config = config.field_attribute(
            format!(".shardcast.controller.v1.{field}"),
            format!(
                "#[serde(with = \"crate::api::json::{module}\")] \
                 #[cfg_attr(feature = \"openapi\", schema(value_type = crate::api::json::{module}::Name, default = \"\"))]"
            ),
        );
    }
    config
        // No `connect` constructors: they need tonic's transport, which the callers bring.
        .build_transport(false)
        .field_attribute(
            ".shardcast.controller.v1.ModelInfo.manifest",
            "#[serde(skip)]",
        )
        .compile_fds(fds)?;
    Ok(())
}
