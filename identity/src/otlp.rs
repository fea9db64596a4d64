//! OTLP trace export for the daemons (the `otlp` cargo feature, off by default): the
//! `tracing` spans a daemon already opens (transferd's `upstream`/`forward` hops, the
//! controller's `prewarm` and `plan`) go, through `tracing-opentelemetry`, to an
//! OpenTelemetry SDK tracer provider whose batch processor sends them as OTLP over
//! HTTP/protobuf (`POST {endpoint}/v1/traces`) from a thread of its own.
//!
//! * [`OtlpEndpoint`]: the `otlp_endpoint` setting, checked at load in every build (with or
//!   without the feature): `http://` to a loopback address only. The exporter speaks no TLS
//!   and sends no credentials, so spans (model names, host ids, plan ids) leave the process
//!   only to a collector on the same machine (an OpenTelemetry Collector or agent), which
//!   forwards them with its own TLS and authentication.
//! * [`TraceExport`]: where and as whom ([`Resource`](opentelemetry_sdk::Resource):
//!   `service.name`, `service.version`, `service.instance.id`).
//! * [`Traces`]: what [`crate::process::init_logging`] returns; [`Traces::shutdown`] flushes
//!   the spans still queued (bounded by the exporter's timeout) before the process exits.
//!
//! Trace context is not propagated between processes: the controller's `plan` and a
//! transferd's hops are separate traces, joined by their `plan`/`session` and `model`
//! attributes.

use std::net::IpAddr;
use std::time::Duration;

/// How long one export (a POST of a batch) may take before it is abandoned; also bounds the
/// flush at shutdown. Rationale: a collector on loopback answers in milliseconds; a stuck
/// one must not hold a stopping daemon past its drain grace.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// The `otlp_endpoint` setting: an OTLP/HTTP collector on this machine
/// (`http://127.0.0.1:4318`), to which `/v1/traces` is appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpEndpoint {
    /// `http://host:port` as given, without a trailing slash.
    base: String,
}

/// Why an `otlp_endpoint` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "otlp_endpoint must be http://<loopback address>:<port> (e.g. http://127.0.0.1:4318, \
     an OpenTelemetry Collector on this machine, which forwards with TLS): {why}, got {given:?}"
)]
pub struct OtlpEndpointError {
    given: String,
    why: &'static str,
}

impl OtlpEndpoint {
    /// Checks `s`: scheme `http`, a loopback IP literal or `localhost`, an explicit port,
    /// no path (or `/`), no query, no user info.
    pub fn parse(s: &str) -> Result<Self, OtlpEndpointError> {
        let refuse = |why| OtlpEndpointError {
            given: s.to_string(),
            why,
        };
        let uri: http::Uri = s.parse().map_err(|_| refuse("not a URL"))?;
        if uri.scheme_str() != Some("http") {
            return Err(refuse("the scheme must be http"));
        }
        let authority = uri.authority().ok_or_else(|| refuse("no host"))?;
        if authority.as_str().contains('@') {
            return Err(refuse("user info is not allowed"));
        }
        if authority.port_u16().is_none() {
            return Err(refuse("the port must be given"));
        }
        let host = authority.host();
        let ip = host.trim_start_matches('[').trim_end_matches(']');
        let loopback = host.eq_ignore_ascii_case("localhost")
            || ip.parse::<IpAddr>().is_ok_and(|a| a.is_loopback());
        if !loopback {
            return Err(refuse("the host must be a loopback address"));
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(refuse(
                "give the collector's base address only (/v1/traces is appended)",
            ));
        }
        Ok(Self {
            base: format!("http://{authority}"),
        })
    }

    /// The URL spans are posted to: `http://host:port/v1/traces`.
    pub fn traces_url(&self) -> String {
        format!("{}/v1/traces", self.base)
    }
}

impl std::fmt::Display for OtlpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.base)
    }
}

/// Where a daemon's spans go, and the resource they are attributed to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceExport {
    /// The collector.
    pub endpoint: OtlpEndpoint,
    /// `service.name`: `transferd` or `shardcast-controller`.
    pub service_name: &'static str,
    /// `service.version`: the daemon's version.
    pub service_version: &'static str,
    /// `service.instance.id`: transferd's host id, the controller's replica id.
    pub instance_id: String,
}

/// Why trace export could not start.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// An endpoint was given to a binary built without the `otlp` feature.
    #[error(
        "otlp_endpoint is set, but this binary was built without the `otlp` feature \
         (build it with `--features otlp`, or unset otlp_endpoint)"
    )]
    NotBuilt,
    /// The OTLP exporter could not be built.
    #[error("cannot start the OTLP exporter: {0}")]
    Exporter(String),
    /// Spans still queued could not be flushed at shutdown.
    #[error("flushing spans to the OTLP collector: {0}")]
    Flush(String),
}

/// Whether this build can export traces (the `otlp` feature of this crate).
pub const BUILT: bool = cfg!(feature = "otlp");

/// The running exporter, if any: call [`Traces::shutdown`] before the process exits.
#[derive(Debug, Default)]
#[must_use = "call Traces::shutdown before exit, or the last spans are lost"]
pub struct Traces {
    #[cfg(feature = "otlp")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Traces {
    #[cfg(feature = "otlp")]
    pub(crate) fn new(provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>) -> Self {
        Self { provider }
    }

    /// Whether spans are being exported.
    pub fn exporting(&self) -> bool {
        #[cfg(feature = "otlp")]
        {
            self.provider.is_some()
        }
        #[cfg(not(feature = "otlp"))]
        {
            false
        }
    }

    /// Ends every span still queued with an export, waiting at most about
    /// [`EXPORT_TIMEOUT`], and stops the exporter's thread. A no-op without an exporter.
    pub fn shutdown(self) -> Result<(), TraceError> {
        #[cfg(feature = "otlp")]
        if let Some(p) = self.provider {
            return p
                .shutdown_with_timeout(EXPORT_TIMEOUT)
                .map_err(|e| TraceError::Flush(e.to_string()));
        }
        Ok(())
    }
}

/// The `tracing` layer that hands spans to OpenTelemetry, and the provider behind it, for
/// [`crate::process::init_logging`].
#[cfg(feature = "otlp")]
pub(crate) fn layer<S>(
    export: &TraceExport,
) -> Result<
    (
        impl tracing_subscriber::Layer<S>,
        opentelemetry_sdk::trace::SdkTracerProvider,
    ),
    TraceError,
>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use opentelemetry::KeyValue;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::filter::{LevelFilter, Targets};

    // reqwest (built with `rustls-no-provider`, like the rest of the tree) needs a process
    // crypto provider before a client is built, even for the plain http:// used here: ring,
    // the tree's provider. Already installed (transferd's origins) is fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(export.endpoint.traces_url())
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| TraceError::Exporter(e.to_string()))?;
    // An empty builder: the resource is what the settings say, not what OTEL_* variables
    // of the environment would add.
    let resource = opentelemetry_sdk::Resource::builder_empty()
        .with_service_name(export.service_name)
        .with_attributes([
            KeyValue::new("service.version", export.service_version),
            KeyValue::new("service.instance.id", export.instance_id.clone()),
        ])
        .build();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("shardcast");
    // The exporter's own HTTP client must not feed spans back into the exporter.
    let not_the_exporter = Targets::new()
        .with_default(LevelFilter::TRACE)
        .with_target("hyper", LevelFilter::OFF)
        .with_target("hyper_util", LevelFilter::OFF)
        .with_target("h2", LevelFilter::OFF)
        .with_target("reqwest", LevelFilter::OFF)
        .with_target("opentelemetry", LevelFilter::OFF)
        .with_target("opentelemetry_sdk", LevelFilter::OFF)
        .with_target("opentelemetry_otlp", LevelFilter::OFF)
        .with_target("opentelemetry_http", LevelFilter::OFF);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(not_the_exporter);
    Ok((layer, provider))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_http_endpoints_are_accepted() {
        for (given, url) in [
            ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
            ("http://127.0.0.1:4318/", "http://127.0.0.1:4318/v1/traces"),
            ("http://127.1.2.3:9", "http://127.1.2.3:9/v1/traces"),
            ("http://[::1]:4318", "http://[::1]:4318/v1/traces"),
            ("http://localhost:4318", "http://localhost:4318/v1/traces"),
        ] {
            let e = OtlpEndpoint::parse(given).unwrap_or_else(|e| panic!("{given}: {e}"));
            assert_eq!(e.traces_url(), url);
        }
    }

    #[test]
    fn other_endpoints_are_refused_saying_why() {
        for (given, why) in [
            ("http://10.0.0.1:4318", "loopback"),
            ("http://0.0.0.0:4318", "loopback"),
            ("http://collector.example.com:4318", "loopback"),
            ("https://127.0.0.1:4318", "scheme"),
            ("127.0.0.1:4318", "scheme"),
            ("http://127.0.0.1", "port"),
            ("http://127.0.0.1:4318/v1/traces", "base address"),
            ("http://127.0.0.1:4318/?a=b", "base address"),
            ("http://u:p@127.0.0.1:4318", "user info"),
            ("", "not a URL"),
        ] {
            let err = OtlpEndpoint::parse(given).expect_err(given).to_string();
            assert!(err.contains(why), "{given}: {err}");
            assert!(err.contains("otlp_endpoint"), "{err}");
        }
    }

    #[test]
    fn shutdown_without_an_exporter_is_a_no_op() {
        let t = Traces::default();
        assert!(!t.exporting());
        assert!(t.shutdown().is_ok());
    }
}
