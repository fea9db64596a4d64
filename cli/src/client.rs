//! The controller's gRPC client: TLS or the Unix socket, following the leader over replicas.

use std::path::PathBuf;
use std::time::Duration;

use shardcast_identity::failover::FailoverChannel;
use shardcast_identity::grpc::ClientSecurity;
use shardcast_protocol::controller::controller_client::ControllerClient;

use crate::error::{CliError, usage};

/// The client every controller command takes.
pub(crate) type Client = ControllerClient<FailoverChannel>;

/// How long a call keeps trying while no controller replica takes it (an election after
/// the leader died takes a few seconds).
const FAILOVER_PATIENCE: Duration = Duration::from_secs(15);

/// What the global flags say about reaching the controller.
#[derive(Debug)]
pub(crate) struct Connection {
    /// `--controller`: one address or every replica's, comma-separated.
    pub(crate) controller: String,
    /// `--tls-ca`.
    pub(crate) tls_ca: Option<PathBuf>,
    /// `--tls-cert`.
    pub(crate) tls_cert: Option<PathBuf>,
    /// `--tls-key`.
    pub(crate) tls_key: Option<PathBuf>,
    /// `--insecure-plaintext`.
    pub(crate) insecure_plaintext: bool,
}

impl Connection {
    /// A client of the controller. Several replicas (comma-separated): calls follow the
    /// leader and fail over.
    pub(crate) fn client(&self) -> Result<Client, CliError> {
        let channel = FailoverChannel::new(
            &shardcast_identity::failover::split_addrs(&self.controller),
            self.security()?,
            FAILOVER_PATIENCE,
        )
        .map_err(|e| usage(e.to_string()))?;
        Ok(ControllerClient::new(channel)
            .max_decoding_message_size(128 << 20)
            .max_encoding_message_size(128 << 20))
    }

    /// How the CLI reaches the controller.
    fn security(&self) -> Result<ClientSecurity, CliError> {
        if self.controller.starts_with("unix:") || self.insecure_plaintext {
            return Ok(ClientSecurity::Plaintext);
        }
        match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (Some(ca), Some(cert), Some(key)) => {
                let ctx = shardcast_identity::TlsContext::load(shardcast_identity::TlsFiles {
                    ca: ca.clone(),
                    cert: cert.clone(),
                    key: key.clone(),
                })
                .map_err(|e| usage(format!("TLS identity: {e}")))?;
                Ok(ClientSecurity::Tls(
                    ctx,
                    shardcast_identity::Expect::Role(shardcast_identity::Role::Controller),
                ))
            }
            _ => Err(usage(
                "the controller requires mutual TLS: pass --tls-ca, --tls-cert and --tls-key (or SHARDCAST_TLS_CA/_CERT/_KEY), \
                 or use its Unix socket (--controller unix:/path) as a local operator",
            )),
        }
    }
}
