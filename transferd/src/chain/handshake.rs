//! Connections between hops: connecting to a hop's data port and the `Hello` exchange,
//! bound to the host id of the peer's certificate.

use std::sync::atomic::Ordering;

use shardcast_identity::{Peer, Role};
use shardcast_protocol::{ErrorCode, Frame, HostId, PROTOCOL_VERSION};

use super::{ChainError, Node, read_timeout};
use crate::wire::BoxStream;
use crate::wire::{Conn, WireError};

impl Node {
    /// Connects to a hop's data port; with TLS the peer must be a `host` (exactly
    /// `expect` when given).
    pub(super) async fn connect(
        &self,
        addr: &str,
        expect: Option<&HostId>,
    ) -> Result<(Conn, Peer), ChainError> {
        let (stream, peer) = self
            .transport
            .connect(addr, expect)
            .await
            .map_err(WireError::Io)?;
        Ok((self.conn(stream), peer))
    }

    pub(super) fn conn(&self, stream: BoxStream) -> Conn {
        let mut conn = Conn::new(
            stream,
            self.ingress.clone(),
            self.egress.clone(),
            self.counters.clone(),
            self.frame_budget.clone(),
        );
        conn.writer
            .set_write_timeout(Some(self.cfg.limits.write_timeout));
        conn
    }

    /// Sends our `Hello` and reads the peer's; refuses other protocol versions, and a
    /// `Hello` whose host id is not the one the peer's certificate names.
    pub(super) async fn handshake(
        &self,
        conn: &mut Conn,
        peer: &Peer,
    ) -> Result<HostId, ChainError> {
        let host = self.hello(conn).await?;
        match peer {
            Peer::Cert(id) if id.role == Role::Host && id.name == host.as_str() => Ok(host),
            Peer::Insecure => Ok(host),
            other => {
                self.stats.identity_mismatch.fetch_add(1, Ordering::Relaxed);
                Err(ChainError::refused(
                    ErrorCode::Refused,
                    format!("Hello names host {host}, but the peer is {other}"),
                ))
            }
        }
    }

    async fn hello(&self, conn: &mut Conn) -> Result<HostId, ChainError> {
        let hello = Frame::Hello {
            version: PROTOCOL_VERSION,
            host: self.host.clone(),
        };
        conn.writer.send_now(&hello).await?;
        let timeout = self.cfg.idle_timeout;
        match read_timeout(conn, timeout).await? {
            Frame::Hello { version, host } if version == PROTOCOL_VERSION => Ok(host),
            Frame::Hello { version, .. } => Err(ChainError::refused(
                ErrorCode::UnsupportedVersion,
                format!(
                    "peer speaks protocol version {version}; this host speaks {PROTOCOL_VERSION}"
                ),
            )),
            Frame::Error { code, message } => Err(ChainError::Remote { code, message }),
            other => Err(ChainError::protocol(format!(
                "expected Hello, got {:?}",
                other.ty()
            ))),
        }
    }
}
