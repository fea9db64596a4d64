//! Plan tokens: the controller's signature over a chain's [`PlanClaims`] (model, hosts,
//! expiry), checked by every hop before it accepts a session.
//!
//! The controller signs with the private key of its own TLS certificate and puts that
//! certificate in the token, so a host needs nothing beyond the cluster CA it already
//! trusts: it checks that the certificate chains to the CA, is valid now and names the
//! `controller` role, then checks the signature with the certificate's public key. Tokens
//! are per chain and short-lived ([`PLAN_TOKEN_TTL`]); a rotated controller certificate
//! signs new plans at once, and older tokens stay valid until they expire.

use std::time::Duration;

use bytes::Bytes;
use rcgen::{KeyPair, SigningKey};
use rustls::pki_types::{CertificateDer, UnixTime};
use shardcast_protocol::Codec;
use shardcast_protocol::plan::{PlanClaims, TokenParts};

use crate::role::{IdentityError, Role};
use crate::tls::{TlsContext, TlsFiles, identity_of};

/// How long a plan's sessions may start after the plan was made. Rationale: a session is
/// opened when its chain starts, when a hop fails over to the next one and when a hop
/// rejoins after a restart; an hour covers the transfer of a multi-hundred-GB model at
/// 1 Gbit/s with re-plans, while a leaked token is useless soon after.
pub const PLAN_TOKEN_TTL: Duration = Duration::from_secs(3600);

/// Why a plan token was refused.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The token does not parse.
    #[error("malformed plan token: {0}")]
    Malformed(String),
    /// The signer's certificate does not chain to the cluster CA, or is not valid now.
    #[error("plan token signer: {0}")]
    Signer(String),
    /// The signer is a cluster member but not the controller.
    #[error("plan token signed by {0}, not by the controller")]
    NotController(String),
    /// The signature does not match the claims.
    #[error("plan token signature does not verify")]
    BadSignature,
    /// Signing failed (controller side).
    #[error("signing the plan token: {0}")]
    Sign(String),
}

/// The controller's signing key and certificate.
pub struct PlanSigner {
    key: KeyPair,
    cert: Bytes,
}

impl std::fmt::Debug for PlanSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanSigner").finish_non_exhaustive()
    }
}

impl PlanSigner {
    /// Loads the controller's key and certificate (the certificate must name the
    /// `controller` role).
    pub fn load(files: &TlsFiles) -> Result<Self, IdentityError> {
        let cert_pem = std::fs::read(&files.cert).map_err(|e| IdentityError::Io {
            path: files.cert.display().to_string(),
            source: e,
        })?;
        let cert = crate::tls::first_cert(&cert_pem, &files.cert)?;
        let id = identity_of(&cert)?;
        if id.role != Role::Controller {
            return Err(IdentityError::BadCertificate(format!(
                "plan tokens are signed by the controller, but {} names {id}",
                files.cert.display()
            )));
        }
        let key_pem = std::fs::read_to_string(&files.key).map_err(|e| IdentityError::Io {
            path: files.key.display().to_string(),
            source: e,
        })?;
        let key = KeyPair::from_pem(&key_pem)?;
        Ok(Self {
            key,
            cert: Bytes::copy_from_slice(cert.as_ref()),
        })
    }

    /// A token for `claims`.
    pub fn sign(&self, claims: &PlanClaims) -> Result<Vec<u8>, PlanError> {
        let mut body = Vec::with_capacity(claims.encoded_len());
        claims.encode(&mut body);
        let signature = self
            .key
            .sign(&body)
            .map_err(|e| PlanError::Sign(e.to_string()))?;
        Ok(TokenParts {
            claims: Bytes::from(body),
            signature: Bytes::from(signature),
            signer: self.cert.clone(),
        }
        .encode())
    }
}

impl TlsContext {
    /// Verifies a plan token against this member's CA bundle at `now` and returns its
    /// claims (which the caller then checks against the session).
    pub fn verify_plan(&self, token: &[u8], now: UnixTime) -> Result<PlanClaims, PlanError> {
        let parts = TokenParts::parse(token).map_err(|e| PlanError::Malformed(e.to_string()))?;
        let cert = CertificateDer::from(parts.signer.as_ref());
        self.verify_member(&cert, now)
            .map_err(|e| PlanError::Signer(e.to_string()))?;
        let id = identity_of(&cert).map_err(|e| PlanError::Signer(e.to_string()))?;
        if id.role != Role::Controller {
            return Err(PlanError::NotController(id.to_string()));
        }
        let ee =
            webpki::EndEntityCert::try_from(&cert).map_err(|e| PlanError::Signer(e.to_string()))?;
        let algs = crate::tls::provider().signature_verification_algorithms.all;
        let ok = algs.iter().any(|alg| {
            ee.verify_signature(*alg, &parts.claims, &parts.signature)
                .is_ok()
        });
        if !ok {
            return Err(PlanError::BadSignature);
        }
        shardcast_protocol::codec::decode_exact::<PlanClaims>(parts.claims)
            .map_err(|e| PlanError::Malformed(e.to_string()))
    }
}
