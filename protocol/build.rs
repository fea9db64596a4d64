//! Compiles `proto/agent.proto` and `proto/controller.proto` with protox (a protobuf
//! compiler in pure Rust), so building shardcast never needs a system `protoc`. The
//! controller's messages also derive serde, so the HTTP/JSON API uses the same types.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["proto/agent.proto", "proto/controller.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .type_attribute(
            ".shardcast.controller.v1",
            "#[derive(serde::Serialize, serde::Deserialize)] #[serde(default)]",
        )
        .field_attribute(
            ".shardcast.controller.v1.ModelInfo.manifest",
            "#[serde(skip)]",
        )
        .compile_fds(fds)?;
    Ok(())
}
