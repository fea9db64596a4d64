//! gRPC channels to shardcast services by the address forms the daemons print and accept:
//! `host:port`, `http://host:port`, or `unix:/path/to.sock` (a Unix socket reaches across
//! network namespaces on one machine). Behind the `channel` feature, so the protocol core
//! stays free of sockets.

use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// Time allowed to establish a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// An error in an address string.
#[derive(Debug, thiserror::Error)]
#[error(
    "invalid service address {addr:?}: {reason} (expected host:port, http://host:port or unix:/path)"
)]
pub struct AddrError {
    addr: String,
    reason: String,
}

fn endpoint(addr: &str) -> Result<(Endpoint, Option<String>), AddrError> {
    let bad = |reason: String| AddrError {
        addr: addr.to_string(),
        reason,
    };
    if let Some(path) = addr.strip_prefix("unix:") {
        if path.is_empty() {
            return Err(bad("empty socket path".into()));
        }
        let ep = Endpoint::from_static("http://unix.socket");
        return Ok((ep, Some(path.to_string())));
    }
    let uri = if addr.starts_with("http://") || addr.starts_with("https://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let ep = Endpoint::from_shared(uri).map_err(|e| bad(e.to_string()))?;
    Ok((ep, None))
}

/// A channel that connects on first use and reconnects after failures, so a client can be
/// built once per peer and kept.
pub fn lazy(addr: &str) -> Result<Channel, AddrError> {
    let (ep, unix) = endpoint(addr)?;
    let ep = ep
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5));
    Ok(match unix {
        Some(path) => ep.connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        })),
        None => ep.connect_lazy(),
    })
}

/// Connects now, so that an unreachable address is reported at once.
pub async fn connect(addr: &str) -> Result<Channel, ConnectError> {
    let (ep, unix) = endpoint(addr)?;
    let ep = ep.connect_timeout(CONNECT_TIMEOUT).tcp_nodelay(true);
    let r = match unix {
        Some(path) => {
            ep.connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(
                        tokio::net::UnixStream::connect(path).await?,
                    ))
                }
            }))
            .await
        }
        None => ep.connect().await,
    };
    r.map_err(|e| ConnectError::Connect {
        addr: addr.to_string(),
        source: e,
    })
}

/// Why [`connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The address is malformed.
    #[error(transparent)]
    Addr(#[from] AddrError),
    /// Nothing answered.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
}
