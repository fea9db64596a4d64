//! Who a peer is ([`Identity`]: a [`Role`] and a name) and what each role may do
//! ([`Permission`]).
//!
//! An identity travels in the certificate as one subject-alternative-name URI,
//! `shardcast://<role>/<name>` (for example `shardcast://host/gpu-node-17` or
//! `shardcast://platform/knative`). It is never taken from a frame or a request body: the
//! `Hello` host id and a heartbeat's host id must equal the certificate's name.

use std::fmt;
use std::str::FromStr;

/// URI scheme of the identity SAN.
pub const IDENTITY_SCHEME: &str = "shardcast://";
/// Longest identity name in bytes (a host id is at most 255 bytes too).
pub const MAX_NAME_LEN: usize = 255;

/// The roles of the security model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// A transferd: data port to data port, heartbeats to the controller.
    Host,
    /// The controller: drives agents (import, chains, loads, evictions).
    Controller,
    /// An operator: register, evict, configure, and everything `platform` and `read` may do.
    Admin,
    /// The FaaS platform: prewarm, scale out, report load, and everything `read` may do.
    Platform,
    /// Status, watch and hand-off (an inference process mapping its weights).
    Read,
}

impl Role {
    /// Every role, in the order above.
    pub const ALL: [Self; 5] = [
        Self::Host,
        Self::Controller,
        Self::Admin,
        Self::Platform,
        Self::Read,
    ];

    /// The role's name in certificates, tokens and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Controller => "controller",
            Self::Admin => "admin",
            Self::Platform => "platform",
            Self::Read => "read",
        }
    }

    /// Whether this role holds `p`.
    pub fn grants(self, p: Permission) -> bool {
        use Permission as P;
        if p == P::Health {
            return true;
        }
        match self {
            Self::Host => matches!(p, P::DataPlane | P::Heartbeat),
            // The controller drives agents and reads everything; it never registers
            // models on its own behalf through its own API.
            Self::Controller => matches!(p, P::DriveAgent | P::Read),
            Self::Admin => matches!(p, P::Admin | P::Platform | P::Read | P::DriveAgent),
            Self::Platform => matches!(p, P::Platform | P::Read),
            Self::Read => matches!(p, P::Read),
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = IdentityError;
    fn from_str(s: &str) -> Result<Self, IdentityError> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| IdentityError::UnknownRole(s.to_string()))
    }
}

/// What an operation needs. Each API method maps to exactly one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Permission {
    /// Send or receive chunks on the data port.
    DataPlane,
    /// Report as a host to the controller's inventory.
    Heartbeat,
    /// Mutating agent calls: import, start chains, load onto GPUs, evict.
    DriveAgent,
    /// Register models, evict, change configuration.
    Admin,
    /// Prewarm, scale out, report load.
    Platform,
    /// Status, watch, list, hand-off.
    Read,
    /// Ask whether a service is serving (`grpc.health.v1.Health`): every authenticated
    /// identity holds it, whatever its role; an anonymous caller does not. It reveals
    /// readiness only.
    Health,
}

impl Permission {
    /// Lower-case name for logs, metrics and errors.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DataPlane => "data-plane",
            Self::Heartbeat => "heartbeat",
            Self::DriveAgent => "drive-agent",
            Self::Admin => "admin",
            Self::Platform => "platform",
            Self::Read => "read",
            Self::Health => "health",
        }
    }
}

impl fmt::Display for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role and a name, as a certificate (or a bearer token) states them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    /// The role.
    pub role: Role,
    /// The host id for `host`, else a free-form principal name.
    pub name: String,
}

impl Identity {
    /// Builds an identity, checking the name.
    pub fn new(role: Role, name: &str) -> Result<Self, IdentityError> {
        check_name(name)?;
        Ok(Self {
            role,
            name: name.to_string(),
        })
    }

    /// The SAN URI form, `shardcast://<role>/<name>`.
    pub fn uri(&self) -> String {
        format!("{IDENTITY_SCHEME}{}/{}", self.role, self.name)
    }

    /// Parses the SAN URI form.
    pub fn from_uri(uri: &str) -> Result<Self, IdentityError> {
        let rest = uri
            .strip_prefix(IDENTITY_SCHEME)
            .ok_or_else(|| IdentityError::BadUri(uri.to_string()))?;
        let (role, name) = rest
            .split_once('/')
            .ok_or_else(|| IdentityError::BadUri(uri.to_string()))?;
        Self::new(role.parse()?, name)
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.role, self.name)
    }
}

/// Names are what host ids allow: ASCII letters, digits, `-`, `_`, `.`, `:`, at most
/// [`MAX_NAME_LEN`] bytes, and not `.` or `..`.
fn check_name(name: &str) -> Result<(), IdentityError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    if ok {
        Ok(())
    } else {
        Err(IdentityError::BadName(name.to_string()))
    }
}

/// Who is on the other end of a connection, as far as authorisation is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// A peer that presented a certificate signed by the cluster CA.
    Cert(Identity),
    /// An HTTP client that presented a bearer token from the tokens file.
    Token(Identity),
    /// A process of the same user (or root) on a Unix socket whose mode is 0600: local
    /// operator trust, every permission.
    Local {
        /// The peer's uid from `SO_PEERCRED`.
        uid: u32,
    },
    /// Another user on a Unix socket that is shared with a group (mode 0660, e.g.
    /// transferd's admin socket with `store_group`): the file mode let it connect, so it
    /// is a member of that group. It may read (hand-offs, metrics), nothing more.
    LocalGroup {
        /// The peer's uid from `SO_PEERCRED`.
        uid: u32,
    },
    /// No identity: only where the loudly named plaintext setting allowed it (loopback).
    Insecure,
    /// Nothing presented.
    Anonymous,
}

impl Peer {
    /// The identity, when the peer has one.
    pub fn identity(&self) -> Option<&Identity> {
        match self {
            Self::Cert(id) | Self::Token(id) => Some(id),
            _ => None,
        }
    }

    /// Checks `p`; the error says who was refused what.
    pub fn authorize(&self, p: Permission) -> Result<(), Denied> {
        let ok = match self {
            Self::Cert(id) | Self::Token(id) => id.role.grants(p),
            Self::Local { .. } | Self::Insecure => true,
            Self::LocalGroup { .. } => matches!(p, Permission::Read | Permission::Health),
            Self::Anonymous => false,
        };
        if ok {
            Ok(())
        } else {
            Err(Denied {
                peer: self.to_string(),
                needs: p,
            })
        }
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cert(id) => write!(f, "{id} (certificate)"),
            Self::Token(id) => write!(f, "{id} (token)"),
            Self::Local { uid } => write!(f, "local uid {uid}"),
            Self::LocalGroup { uid } => write!(f, "local uid {uid} (socket group)"),
            Self::Insecure => f.write_str("plaintext peer (insecure mode)"),
            Self::Anonymous => f.write_str("anonymous"),
        }
    }
}

/// A refused operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("permission denied: {peer} lacks the {needs} permission")]
pub struct Denied {
    /// Who asked.
    pub peer: String,
    /// What was needed.
    pub needs: Permission,
}

/// Errors in identities, certificates and TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// A role name outside [`Role::ALL`].
    #[error("unknown role {0:?} (expected host, controller, admin, platform or read)")]
    UnknownRole(String),
    /// A name with characters or a length a host id would not allow.
    #[error("invalid identity name {0:?} (ASCII letters, digits, - _ . : only, at most 255 bytes)")]
    BadName(String),
    /// A SAN URI that is not `shardcast://<role>/<name>`.
    #[error("invalid identity URI {0:?} (expected shardcast://<role>/<name>)")]
    BadUri(String),
    /// A certificate without exactly one identity URI.
    #[error("certificate names {0} shardcast identities; exactly one is required")]
    IdentityCount(usize),
    /// A certificate that does not parse.
    #[error("certificate does not parse: {0}")]
    BadCertificate(String),
    /// A file that could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// PEM that holds no usable certificate or key.
    #[error("{path}: {reason}")]
    Pem {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    /// The client verifier could not be built (e.g. an empty CA file).
    #[error("TLS client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    /// rcgen could not build or sign a certificate.
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_round_trip() {
        for role in Role::ALL {
            let id = Identity::new(role, "node-1.rack:3").unwrap();
            assert_eq!(Identity::from_uri(&id.uri()).unwrap(), id);
        }
    }

    #[test]
    fn bad_uris_and_names() {
        for bad in [
            "https://host/h1",
            "shardcast://host",
            "shardcast://root/h1",
            "shardcast://host/",
            "shardcast://host/a/b",
            "shardcast://host/..",
            "shardcast://host/h 1",
        ] {
            assert!(Identity::from_uri(bad).is_err(), "{bad}");
        }
        assert!(Identity::new(Role::Read, &"x".repeat(256)).is_err());
    }

    #[test]
    fn permissions() {
        use Permission as P;
        let id = |r| Peer::Cert(Identity::new(r, "x").unwrap());
        assert!(id(Role::Host).authorize(P::DataPlane).is_ok());
        assert!(id(Role::Host).authorize(P::DriveAgent).is_err());
        assert!(id(Role::Host).authorize(P::Read).is_err());
        assert!(id(Role::Controller).authorize(P::DriveAgent).is_ok());
        assert!(id(Role::Controller).authorize(P::DataPlane).is_err());
        assert!(id(Role::Admin).authorize(P::Platform).is_ok());
        assert!(id(Role::Admin).authorize(P::Heartbeat).is_err());
        assert!(id(Role::Platform).authorize(P::Admin).is_err());
        assert!(id(Role::Platform).authorize(P::Read).is_ok());
        assert!(id(Role::Read).authorize(P::Platform).is_err());
        assert!(Peer::Anonymous.authorize(P::Read).is_err());
        // Health: any identity, never an anonymous caller.
        for role in Role::ALL {
            assert!(id(role).authorize(P::Health).is_ok(), "{role}");
        }
        assert!(Peer::LocalGroup { uid: 7 }.authorize(P::Health).is_ok());
        assert!(Peer::Anonymous.authorize(P::Health).is_err());
        assert!(Peer::Local { uid: 0 }.authorize(P::Admin).is_ok());
        assert!(Peer::LocalGroup { uid: 7 }.authorize(P::Read).is_ok());
        assert!(
            Peer::LocalGroup { uid: 7 }
                .authorize(P::DriveAgent)
                .is_err()
        );
        let e = id(Role::Read).authorize(P::Admin).unwrap_err();
        assert_eq!(
            e.to_string(),
            "permission denied: read:x (certificate) lacks the admin permission"
        );
    }
}
