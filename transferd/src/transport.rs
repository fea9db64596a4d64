//! Transports: how a hop reaches the next one. The chain logic only sees a
//! [`BoxStream`]; a later transport (TCP+TLS, QUIC) adds a variant here.

use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use crate::wire::BoxStream;

/// How long to wait for a downstream hop to accept a connection before failing over.
/// Rationale: a live transferd on a datacenter network answers a SYN in well under a
/// second; a dead host should not stall the chain for the OS default (minutes).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The byte-stream transport used between hops.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Transport {
    /// Plain TCP with `TCP_NODELAY` (frames are already batched by the writer).
    #[default]
    Tcp,
}

impl Transport {
    /// Connects to `addr` (`host:port`).
    pub async fn connect(self, addr: &str) -> std::io::Result<BoxStream> {
        match self {
            Self::Tcp => {
                let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
                    .await
                    .map_err(|_| {
                        std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("connect to {addr} timed out after {CONNECT_TIMEOUT:?}"),
                        )
                    })??;
                stream.set_nodelay(true)?;
                Ok(Box::new(stream))
            }
        }
    }

    /// Accepts the next connection on a listener.
    pub async fn accept(self, listener: &TcpListener) -> std::io::Result<(BoxStream, String)> {
        let (stream, peer) = listener.accept().await?;
        stream.set_nodelay(true)?;
        Ok((Box::new(stream), peer.to_string()))
    }
}
