//! Mutual TLS with the cluster CA: [`TlsContext`] loads a CA bundle, a certificate and its
//! key (PEM), builds rustls configurations for each kind of listener ([`Alpn`]), hands
//! them to accept/connect calls, and reloads them when the files change (no restart).
//!
//! Verification:
//! - A server requires a client certificate signed by the CA (the controller's HTTP
//!   listener may instead accept a bearer token: [`TlsContext::accept_optional`]); a peer
//!   without one is refused in the TLS handshake, before any frame is parsed.
//! - A client checks the server's chain against the CA, validity dates included, but not
//!   its DNS name: cluster members are named by their identity URI
//!   (`shardcast://role/name`), which the caller compares with whom it meant to reach
//!   ([`Expect`]). Several daemons behind one address (loopback tests, NAT) stay
//!   distinguishable that way.
//! - TLS 1.3 only, ring's cipher suites (AES-GCM with AES-NI, or ChaCha20 without).
//! - No session resumption: every connection authenticates in full. Each handshake runs
//!   under a timeout (`accept`/`connect` return the peer's [`Identity`]).
//!
//! ALPNs ([`Alpn`]): data `shardcast/1`, data in the authenticate-only mode
//! `shardcast-clear/1`, gRPC `h2`, HTTP `http/1.1`; a peer of another ALPN is
//! [`TlsError::AlpnMismatch`], counted. `accept_clear` / `connect_clear` run the same mutual
//! handshake under `shardcast-clear/1`, then switch in lock-step to the bare `TcpStream`
//! (nothing left inside rustls; the server's marker carries a TLS exporter value the client
//! checks), so payloads may then go by `sendfile`. Reload: the files are re-read on change
//! or SIGHUP (`spawn_reloader`, an `ArcSwap`); a broken file keeps the old certificate;
//! [`TlsContext::watch_reloads`] tells what follows the certificate (the plan signer, the
//! scraper's HTTPS client from `http_client_config`). Counters in [`TlsStats`]; the
//! certificate's and the CA bundle's ends in [`crate::expiry`], logged at start
//! ([`TlsContext::log_expiry`]), on reload and when one comes within the warning or passes.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::{info, warn};

use crate::expiry::{EXPIRY_WARNING, Expiry, ExpiryState, Which};
use crate::role::{Identity, IdentityError, Role};

/// Default time allowed for a TLS handshake. Rationale: a handshake is two round trips
/// and a few signatures (well under 10 ms in a datacenter); a peer that connects and
/// says nothing must not hold a socket and a task for long.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the certificate files are checked for changes.
pub const RELOAD_PERIOD: Duration = Duration::from_secs(10);
/// SNI sent by clients. Servers are identified by their identity URI, not a DNS name.
const CLUSTER_SERVER_NAME: &str = "shardcast.cluster";

/// The PEM files of one member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA bundle: every certificate in it is trusted (two during a CA rotation).
    pub ca: PathBuf,
    /// This member's certificate (chain).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

/// Which protocol a TLS connection carries (its ALPN id), so a data-port client can never
/// talk to a gRPC listener by mistake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    /// The hop-to-hop data protocol, `shardcast/1`.
    Data,
    /// The hop-to-hop data protocol in the authenticate-only data mode,
    /// `shardcast-clear/1`: the mutual-TLS handshake authenticates both ends, then the
    /// connection continues as plain TCP ([`TlsContext::accept_clear`]).
    DataClear,
    /// gRPC over HTTP/2, `h2`.
    Grpc,
    /// HTTP/1.1 (the controller's JSON API, transferd's hand-off and admin endpoints).
    Http,
    /// The hop-to-hop data protocol with TLS records read and written by
    /// [`crate::records`] after the handshake, `shardcast-rec/1`. Its configurations offer
    /// `shardcast/1` too, second, so a peer that lacks it gets rustls's stream
    /// ([`TlsContext::accept_data`]).
    DataRecords,
}

impl Alpn {
    /// The ALPN protocol id.
    pub fn id(self) -> &'static [u8] {
        match self {
            Self::Data => b"shardcast/1",
            Self::DataClear => b"shardcast-clear/1",
            Self::Grpc => b"h2",
            Self::Http => b"http/1.1",
            Self::DataRecords => b"shardcast-rec/1",
        }
    }
}

/// Whom a client means to reach; checked against the server's certificate after the
/// handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// Any member with this role.
    Role(Role),
    /// Exactly this identity.
    Exactly(Identity),
}

impl Expect {
    /// Checks `got`.
    pub fn check(&self, got: &Identity) -> Result<(), TlsError> {
        let ok = match self {
            Self::Role(r) => got.role == *r,
            Self::Exactly(id) => got == id,
        };
        if ok {
            Ok(())
        } else {
            Err(TlsError::WrongPeer {
                expected: match self {
                    Self::Role(r) => format!("any {r}"),
                    Self::Exactly(id) => id.to_string(),
                },
                got: got.clone(),
            })
        }
    }
}

/// Why a TLS connection was not established.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The handshake failed (no certificate, another CA, expired, wrong protocol…).
    #[error("TLS handshake failed: {0}")]
    Handshake(std::io::Error),
    /// The handshake did not finish in time.
    #[error("TLS handshake timed out after {0:?}")]
    Timeout(Duration),
    /// The peer's certificate holds no usable identity.
    #[error("peer certificate: {0}")]
    Identity(#[from] IdentityError),
    /// The peer does not speak this ALPN protocol (the handshake ended with
    /// `no_application_protocol`): on the data port, the two ends use different data modes.
    #[error("the peer does not speak {ours} on this port (it offers or accepts another protocol)")]
    AlpnMismatch {
        /// The protocol this end offered or accepts.
        ours: &'static str,
    },
    /// The switch to plain TCP after an authenticate-only handshake went wrong (bytes left
    /// in the TLS layer, or the peer's switch marker missing or different).
    #[error("switching to the clear after the handshake: {0}")]
    ClearSwitch(String),
    /// The peer is a valid member, but not the one we meant to reach.
    #[error("peer is {got}, expected {expected}")]
    WrongPeer {
        /// Whom we expected.
        expected: String,
        /// Whom we got.
        got: Identity,
    },
}

/// The names in a certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertNames {
    /// The one `shardcast://` identity.
    pub identity: Identity,
    /// DNS SANs.
    pub dns: Vec<String>,
    /// IP SANs.
    pub ips: Vec<IpAddr>,
}

/// Reads the first certificate of a PEM file's contents.
pub fn first_cert(pem: &[u8], path: &Path) -> Result<CertificateDer<'static>, IdentityError> {
    CertificateDer::pem_slice_iter(pem)
        .next()
        .ok_or_else(|| IdentityError::Pem {
            path: path.display().to_string(),
            reason: "no CERTIFICATE block".into(),
        })?
        .map_err(|e| IdentityError::Pem {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
}

/// The identity and other names of a DER certificate.
pub fn cert_names(der: &CertificateDer<'_>) -> Result<CertNames, IdentityError> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der.as_ref())
        .map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
    let mut ids = Vec::new();
    let (mut dns, mut ips) = (Vec::new(), Vec::new());
    if let Some(san) = san {
        for name in &san.value.general_names {
            match name {
                GeneralName::URI(u) if u.starts_with(crate::role::IDENTITY_SCHEME) => {
                    ids.push(Identity::from_uri(u)?)
                }
                GeneralName::DNSName(d) => dns.push(d.to_string()),
                GeneralName::IPAddress(b) => match b.len() {
                    4 => ips.push(IpAddr::from(<[u8; 4]>::try_from(*b).unwrap_or_default())),
                    16 => ips.push(IpAddr::from(<[u8; 16]>::try_from(*b).unwrap_or_default())),
                    _ => {}
                },
                _ => {}
            }
        }
    }
    if ids.len() != 1 {
        return Err(IdentityError::IdentityCount(ids.len()));
    }
    Ok(CertNames {
        identity: ids.remove(0),
        dns,
        ips,
    })
}

/// The identity of a DER certificate.
pub fn identity_of(der: &CertificateDer<'_>) -> Result<Identity, IdentityError> {
    Ok(cert_names(der)?.identity)
}

/// ring's provider, built once (it is consulted on every reload and plan-token check).
pub(crate) fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: std::sync::LazyLock<Arc<CryptoProvider>> =
        std::sync::LazyLock::new(|| Arc::new(rustls::crypto::ring::default_provider()));
    PROVIDER.clone()
}

/// Size and modification time of each file: a change of either triggers a reload.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp(Vec<Option<(u64, SystemTime)>>);

impl Stamp {
    fn of(files: &TlsFiles) -> Self {
        Self(
            [&files.ca, &files.cert, &files.key]
                .into_iter()
                .map(|p| {
                    std::fs::metadata(p)
                        .ok()
                        .and_then(|m| Some((m.len(), m.modified().ok()?)))
                })
                .collect(),
        )
    }
}

/// Configurations built from one reading of the files.
struct Loaded {
    identity: Identity,
    /// Where the certificate's and the CA bundle's validity end.
    expiry: Expiry,
    roots: Arc<RootCertStore>,
    stamp: Stamp,
    servers: [Arc<ServerConfig>; 5],
    http_optional: Arc<ServerConfig>,
    clients: [Arc<ClientConfig>; 5],
    /// HTTP client without a certificate (bearer-token clients, refusal tests).
    http_anonymous: Arc<ClientConfig>,
}

/// The ALPN protocols a configuration for `alpn` offers, preferred first: the record
/// layer's data protocol falls back to rustls's.
fn alpn_offer(alpn: Alpn) -> Vec<Vec<u8>> {
    match alpn {
        Alpn::DataRecords => vec![alpn.id().to_vec(), Alpn::Data.id().to_vec()],
        other => vec![other.id().to_vec()],
    }
}

fn index(alpn: Alpn) -> usize {
    match alpn {
        Alpn::Data => 0,
        Alpn::Grpc => 1,
        Alpn::Http => 2,
        Alpn::DataClear => 3,
        Alpn::DataRecords => 4,
    }
}

fn io_err(path: &Path, e: std::io::Error) -> IdentityError {
    IdentityError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

fn pem_err(path: &Path, e: impl std::fmt::Display) -> IdentityError {
    IdentityError::Pem {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

impl Loaded {
    fn read(files: &TlsFiles) -> Result<Self, IdentityError> {
        let stamp = Stamp::of(files);
        let ca_pem = std::fs::read(&files.ca).map_err(|e| io_err(&files.ca, e))?;
        let mut roots = RootCertStore::empty();
        let cas = CertificateDer::pem_slice_iter(&ca_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| pem_err(&files.ca, e))?;
        for c in &cas {
            roots.add(c.clone()).map_err(|e| pem_err(&files.ca, e))?;
        }
        if roots.is_empty() {
            return Err(pem_err(&files.ca, "no CA certificate in the bundle"));
        }
        let cert_pem = std::fs::read(&files.cert).map_err(|e| io_err(&files.cert, e))?;
        let chain = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| pem_err(&files.cert, e))?;
        let Some(leaf) = chain.first() else {
            return Err(pem_err(&files.cert, "no CERTIFICATE block"));
        };
        let identity = identity_of(leaf)?;
        let expiry = Expiry::read(leaf, &cas)?;
        let key_pem = std::fs::read(&files.key).map_err(|e| io_err(&files.key, e))?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| pem_err(&files.key, e))?;
        let roots = Arc::new(roots);
        let provider = provider();

        let client_verifier = |optional: bool| {
            let b = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone());
            if optional {
                b.allow_unauthenticated().build()
            } else {
                b.build()
            }
        };
        let server = |alpn: Alpn, optional: bool| -> Result<Arc<ServerConfig>, IdentityError> {
            let mut cfg = ServerConfig::builder_with_provider(provider.clone())
                .with_protocol_versions(&[&rustls::version::TLS13])?
                .with_client_cert_verifier(client_verifier(optional)?)
                .with_single_cert(chain.clone(), key.clone_key())?;
            cfg.alpn_protocols = alpn_offer(alpn);
            // The record layer takes the traffic keys over after the handshake.
            cfg.enable_secret_extraction = alpn == Alpn::DataRecords;
            // Session tickets would let a client skip certificate verification on
            // resumption; every connection authenticates in full instead.
            cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
            cfg.send_tls13_tickets = 0;
            Ok(Arc::new(cfg))
        };
        let verifier = Arc::new(ClusterServerVerifier {
            roots: roots.clone(),
            algs: provider.signature_verification_algorithms,
        });
        let client = |alpn: Alpn| -> Result<Arc<ClientConfig>, IdentityError> {
            let mut cfg = ClientConfig::builder_with_provider(provider.clone())
                .with_protocol_versions(&[&rustls::version::TLS13])?
                .dangerous()
                .with_custom_certificate_verifier(verifier.clone())
                .with_client_auth_cert(chain.clone(), key.clone_key())?;
            cfg.alpn_protocols = alpn_offer(alpn);
            cfg.enable_secret_extraction = alpn == Alpn::DataRecords;
            cfg.resumption = rustls::client::Resumption::disabled();
            Ok(Arc::new(cfg))
        };
        Ok(Self {
            identity,
            expiry,
            roots: roots.clone(),
            stamp,
            servers: [
                server(Alpn::Data, false)?,
                server(Alpn::Grpc, false)?,
                server(Alpn::Http, false)?,
                server(Alpn::DataClear, false)?,
                server(Alpn::DataRecords, false)?,
            ],
            http_optional: server(Alpn::Http, true)?,
            clients: [
                client(Alpn::Data)?,
                client(Alpn::Grpc)?,
                client(Alpn::Http)?,
                client(Alpn::DataClear)?,
                client(Alpn::DataRecords)?,
            ],
            http_anonymous: {
                let mut cfg = ClientConfig::builder_with_provider(provider.clone())
                    .with_protocol_versions(&[&rustls::version::TLS13])?
                    .dangerous()
                    .with_custom_certificate_verifier(verifier.clone())
                    .with_no_client_auth();
                cfg.alpn_protocols = vec![Alpn::Http.id().to_vec()];
                Arc::new(cfg)
            },
        })
    }
}

/// Checks a server's chain against the cluster CA (dates, key usage, signatures) and
/// leaves the name to the caller's [`Expect`].
#[derive(Debug)]
struct ClusterServerVerifier {
    roots: Arc<RootCertStore>,
    algs: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for ClusterServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algs.all,
        )?;
        // The identity must parse; whom it names is checked by the caller.
        identity_of(end_entity).map_err(|e| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
                Arc::new(e),
            )))
        })?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

/// Counters of one process's TLS activity (exported by the daemons' `/metrics`).
#[derive(Debug, Default)]
pub struct TlsStats {
    /// Handshakes completed as a server.
    pub accepted: AtomicU64,
    /// Handshakes refused or failed as a server (no certificate, other CA, expired…).
    pub refused: AtomicU64,
    /// Handshakes that did not finish within the timeout.
    pub timed_out: AtomicU64,
    /// Outgoing connections whose server was refused (bad chain or the wrong identity).
    pub connect_refused: AtomicU64,
    /// Handshakes, either side, that failed because the peer speaks another ALPN protocol
    /// (on the data port: the other end uses another data mode).
    pub alpn_mismatches: AtomicU64,
    /// Connections closed right after their handshake because their peer already held
    /// `grpc::MAX_CONNECTIONS_PER_PEER` on the listener.
    pub over_peer_limit: AtomicU64,
    /// Connections closed before their handshake because their address already had
    /// `grpc::MAX_PENDING_HANDSHAKES_PER_ADDR` handshaking on the listener.
    pub handshakes_over_addr_limit: AtomicU64,
    /// Successful reloads of the certificate files.
    pub reloads: AtomicU64,
    /// Reloads that failed (the previous certificate stays in use).
    pub reload_failures: AtomicU64,
    /// `tls`-mode data connections, either side, switched to the record layer
    /// ([`crate::records`]).
    pub record_layer: AtomicU64,
    /// `tls`-mode data connections, either side, left on rustls's stream because the peer
    /// offered or chose `shardcast/1` only (a host of an earlier version).
    pub rustls_stream: AtomicU64,
}

/// One member's TLS material, reloadable.
pub struct TlsContext {
    files: TlsFiles,
    loaded: ArcSwap<Loaded>,
    handshake_timeout_ms: AtomicU64,
    /// How long before a certificate's end it is warned about, in seconds.
    expiry_warning_s: AtomicU64,
    /// The states last logged (own certificate, CA bundle), so the periodic check logs
    /// only what changed.
    expiry_logged: std::sync::Mutex<[ExpiryState; 2]>,
    /// Bumped after each successful reload, for what must follow the certificate (the
    /// controller's plan-token signer, HTTPS clients built from it).
    reloaded: tokio::sync::watch::Sender<u64>,
    /// Counters.
    pub stats: TlsStats,
}

impl std::fmt::Debug for TlsContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsContext")
            .field("files", &self.files)
            .field("identity", &self.identity())
            .finish()
    }
}

impl TlsContext {
    /// Loads the files; errors name the file and the problem.
    pub fn load(files: TlsFiles) -> Result<Arc<Self>, IdentityError> {
        let loaded = Loaded::read(&files)?;
        Ok(Arc::new(Self {
            files,
            loaded: ArcSwap::from_pointee(loaded),
            handshake_timeout_ms: AtomicU64::new(HANDSHAKE_TIMEOUT.as_millis() as u64),
            expiry_warning_s: AtomicU64::new(EXPIRY_WARNING.as_secs()),
            expiry_logged: std::sync::Mutex::new([ExpiryState::Valid; 2]),
            reloaded: tokio::sync::watch::Sender::new(0),
            stats: TlsStats::default(),
        }))
    }

    /// Loads the files and checks that the certificate names `role` (and `name` when
    /// given): a transferd refuses to start with a controller's certificate, and so on.
    pub fn load_as(
        files: TlsFiles,
        role: Role,
        name: Option<&str>,
    ) -> Result<Arc<Self>, IdentityError> {
        let ctx = Self::load(files)?;
        let id = ctx.identity();
        if id.role != role || name.is_some_and(|n| n != id.name) {
            return Err(IdentityError::BadCertificate(format!(
                "{} names {id}, but this process is {role}{}",
                ctx.files.cert.display(),
                name.map(|n| format!(":{n}")).unwrap_or_default()
            )));
        }
        Ok(ctx)
    }

    /// Sets the time allowed for each TLS handshake (default [`HANDSHAKE_TIMEOUT`]).
    pub fn set_handshake_timeout(&self, limit: Duration) {
        self.handshake_timeout_ms
            .store(limit.as_millis().max(1) as u64, Ordering::Relaxed);
    }

    fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.handshake_timeout_ms.load(Ordering::Relaxed))
    }

    /// This member's identity, from its certificate.
    pub fn identity(&self) -> Identity {
        self.loaded.load().identity.clone()
    }

    /// Where the running certificate's and CA bundle's validity end (from the files as
    /// last loaded).
    pub fn expiry(&self) -> Expiry {
        self.loaded.load().expiry
    }

    /// Sets how long before a certificate's end it is warned about (default
    /// [`EXPIRY_WARNING`]; the daemons' `cert_expiry_warning_s`).
    pub fn set_expiry_warning(&self, within: Duration) {
        self.expiry_warning_s
            .store(within.as_secs(), Ordering::Relaxed);
    }

    /// How long before a certificate's end it is warned about.
    pub fn expiry_warning(&self) -> Duration {
        Duration::from_secs(self.expiry_warning_s.load(Ordering::Relaxed))
    }

    /// Logs how long the certificate and the CA bundle have left: `ERROR` once expired,
    /// `WARN` within [`Self::expiry_warning`], `INFO` otherwise. The daemons call it at
    /// start; reloads call it themselves. Returns the states (own certificate, CA bundle).
    pub fn log_expiry(&self) -> [ExpiryState; 2] {
        self.check_expiry(true)
    }

    /// Logs the expiry states: all of them when `always` (start, reload), else only those
    /// that changed since last logged (the reloader's periodic check: a certificate that
    /// comes within the threshold, or expires, while the daemon runs).
    fn check_expiry(&self, always: bool) -> [ExpiryState; 2] {
        let e = self.expiry();
        let (own, ca) = e.remaining(SystemTime::now());
        let within = self.expiry_warning();
        let now = [ExpiryState::of(own, within), ExpiryState::of(ca, within)];
        let mut logged = self
            .expiry_logged
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let rows = [
            (Which::Own, &self.files.cert, e.cert, own),
            (Which::Ca, &self.files.ca, e.ca, ca),
        ];
        for (i, (which, path, end, left)) in rows.into_iter().enumerate() {
            if always || now[i] != logged[i] {
                crate::expiry::log(which, path, end, left, within, !always);
            }
        }
        *logged = now;
        now
    }

    /// Checks that `cert` chains to this member's CA bundle and is valid at `now` (dates,
    /// key usage, signatures), as the TLS handshake would.
    pub fn verify_member(
        &self,
        cert: &CertificateDer<'_>,
        now: UnixTime,
    ) -> Result<(), rustls::Error> {
        let parsed = ParsedCertificate::try_from(cert)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.loaded.load().roots,
            &[],
            now,
            provider().signature_verification_algorithms.all,
        )
    }

    /// Changes after every successful reload (the value counts them): whatever was built
    /// from the certificate is rebuilt when it does.
    pub fn watch_reloads(&self) -> tokio::sync::watch::Receiver<u64> {
        self.reloaded.subscribe()
    }

    /// The current client configuration for HTTPS (ALPN `http/1.1`): presents this member's
    /// certificate and checks the server's chain against the CA bundle, not its name. For
    /// HTTP clients such as reqwest; rebuild them after [`Self::watch_reloads`] changes.
    pub fn http_client_config(&self) -> Arc<ClientConfig> {
        self.loaded.load().clients[index(Alpn::Http)].clone()
    }

    /// The current server configuration for `alpn` (a client certificate of the CA is
    /// required), for transports that drive rustls themselves: quinn wraps it for QUIC.
    /// Take it again after [`Self::watch_reloads`] changes.
    pub fn server_config(&self, alpn: Alpn) -> Arc<ServerConfig> {
        self.loaded.load().servers[index(alpn)].clone()
    }

    /// The current client configuration for `alpn` (presents this member's certificate,
    /// checks the server's chain but not its name: compare the peer's identity with
    /// [`Expect::check`]), for transports that drive rustls themselves.
    pub fn client_config(&self, alpn: Alpn) -> Arc<ClientConfig> {
        self.loaded.load().clients[index(alpn)].clone()
    }

    /// The files.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Re-reads the files when their size or modification time changed. A file that no
    /// longer loads leaves the previous configuration in place (and is counted); a new
    /// certificate must keep the same identity.
    pub fn reload_if_changed(&self) -> Result<bool, IdentityError> {
        let current = self.loaded.load();
        if Stamp::of(&self.files) == current.stamp {
            return Ok(false);
        }
        let fresh = Loaded::read(&self.files).and_then(|l| {
            if l.identity == current.identity {
                Ok(l)
            } else {
                Err(IdentityError::BadCertificate(format!(
                    "the new certificate names {}, the running one {}: identity changes need a restart",
                    l.identity, current.identity
                )))
            }
        });
        match fresh {
            Ok(l) => {
                self.loaded.store(Arc::new(l));
                self.stats.reloads.fetch_add(1, Ordering::Relaxed);
                self.reloaded.send_modify(|n| *n += 1);
                info!(cert = %self.files.cert.display(), "reloaded TLS certificate");
                self.check_expiry(true);
                Ok(true)
            }
            Err(e) => {
                self.stats.reload_failures.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Checks the files every `period` (and on SIGHUP) until `cancel`.
    pub fn spawn_reloader(
        self: &Arc<Self>,
        period: Duration,
        cancel: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut hup =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tokio::pin!(cancel);
            loop {
                tokio::select! {
                    biased;
                    _ = &mut cancel => return,
                    _ = tick.tick() => {}
                    _ = async { match hup.as_mut() { Some(h) => { h.recv().await; } None => std::future::pending().await } } => {}
                }
                match me.reload_if_changed() {
                    Err(e) => {
                        warn!(cert = %me.files.cert.display(), "TLS reload failed, keeping the running certificate: {e}")
                    }
                    // A certificate that comes within the warning, or expires, while it runs.
                    Ok(false) => {
                        me.check_expiry(false);
                    }
                    Ok(true) => {}
                }
            }
        })
    }

    /// Server side of a handshake that requires a client certificate. Returns the
    /// stream and the client's identity.
    pub async fn accept<S>(
        &self,
        stream: S,
        alpn: Alpn,
    ) -> Result<(tokio_rustls::server::TlsStream<S>, Identity), TlsError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let cfg = self.loaded.load().servers[index(alpn)].clone();
        let (s, id) = self.accept_with(cfg, stream).await?;
        let id = id.ok_or_else(|| {
            // Unreachable with a mandatory verifier; refuse rather than assume.
            TlsError::Handshake(std::io::Error::other("no client certificate"))
        })?;
        Ok((s, id))
    }

    /// Server side of an HTTP handshake where the client certificate is optional (a bearer
    /// token may authenticate the request instead).
    pub async fn accept_optional<S>(
        &self,
        stream: S,
    ) -> Result<(tokio_rustls::server::TlsStream<S>, Option<Identity>), TlsError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let cfg = self.loaded.load().http_optional.clone();
        self.accept_with(cfg, stream).await
    }

    async fn accept_with<S>(
        &self,
        cfg: Arc<ServerConfig>,
        stream: S,
    ) -> Result<(tokio_rustls::server::TlsStream<S>, Option<Identity>), TlsError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let acceptor_alpn = cfg.alpn_protocols.first().cloned().unwrap_or_default();
        let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
        let limit = self.handshake_timeout();
        let r = tokio::time::timeout(limit, acceptor.accept(stream)).await;
        let s = match r {
            Err(_) => {
                self.stats.timed_out.fetch_add(1, Ordering::Relaxed);
                return Err(TlsError::Timeout(limit));
            }
            Ok(Err(e)) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                return Err(self.handshake_error(e, &acceptor_alpn));
            }
            Ok(Ok(s)) => s,
        };
        let id = match s.get_ref().1.peer_certificates().and_then(|c| c.first()) {
            None => None,
            Some(c) => match identity_of(c) {
                Ok(id) => Some(id),
                Err(e) => {
                    self.stats.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(e.into());
                }
            },
        };
        self.stats.accepted.fetch_add(1, Ordering::Relaxed);
        Ok((s, id))
    }

    /// Client side: handshakes over `stream` and checks the server is `expect`.
    pub async fn connect<S>(
        &self,
        stream: S,
        alpn: Alpn,
        expect: &Expect,
    ) -> Result<(tokio_rustls::client::TlsStream<S>, Identity), TlsError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let cfg = self.loaded.load().clients[index(alpn)].clone();
        self.connect_with(cfg, stream, expect).await
    }

    /// Client side of an HTTP connection that presents no certificate (a bearer-token
    /// client); the server is still verified.
    pub async fn connect_http_without_cert<S>(
        &self,
        stream: S,
        expect: &Expect,
    ) -> Result<(tokio_rustls::client::TlsStream<S>, Identity), TlsError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let cfg = self.loaded.load().http_anonymous.clone();
        self.connect_with(cfg, stream, expect).await
    }

    async fn connect_with<S>(
        &self,
        cfg: Arc<ClientConfig>,
        stream: S,
        expect: &Expect,
    ) -> Result<(tokio_rustls::client::TlsStream<S>, Identity), TlsError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let connector_alpn = cfg.alpn_protocols.first().cloned().unwrap_or_default();
        let connector = tokio_rustls::TlsConnector::from(cfg);
        let name = ServerName::try_from(CLUSTER_SERVER_NAME)
            .map_err(|e| TlsError::Handshake(std::io::Error::other(e)))?;
        let limit = self.handshake_timeout();
        let r = tokio::time::timeout(limit, connector.connect(name, stream)).await;
        let s = match r {
            Err(_) => {
                self.stats.connect_refused.fetch_add(1, Ordering::Relaxed);
                return Err(TlsError::Timeout(limit));
            }
            Ok(Err(e)) => {
                self.stats.connect_refused.fetch_add(1, Ordering::Relaxed);
                return Err(self.handshake_error(e, &connector_alpn));
            }
            Ok(Ok(s)) => s,
        };
        let id = s
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .ok_or_else(|| TlsError::Handshake(std::io::Error::other("server sent no certificate")))
            .and_then(|c| identity_of(c).map_err(TlsError::from))
            .and_then(|id| expect.check(&id).map(|_| id));
        match id {
            Ok(id) => Ok((s, id)),
            Err(e) => {
                self.stats.connect_refused.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }
    /// Classifies a failed handshake: the peer speaking another ALPN protocol gets its own
    /// error (and counter), anything else stays a handshake failure.
    fn handshake_error(&self, e: std::io::Error, ours: &[u8]) -> TlsError {
        let alpn = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            .is_some_and(|r| {
                matches!(
                    r,
                    rustls::Error::NoApplicationProtocol
                        | rustls::Error::AlertReceived(
                            rustls::AlertDescription::NoApplicationProtocol
                        )
                )
            });
        if !alpn {
            return TlsError::Handshake(e);
        }
        self.stats.alpn_mismatches.fetch_add(1, Ordering::Relaxed);
        // The configured id, as the `'static` text of the `Alpn` it belongs to.
        let ours = [
            Alpn::Data,
            Alpn::DataClear,
            Alpn::Grpc,
            Alpn::Http,
            Alpn::DataRecords,
        ]
        .into_iter()
        .map(Alpn::id)
        .find(|id| *id == ours)
        .and_then(|id| std::str::from_utf8(id).ok())
        .unwrap_or("this protocol");
        TlsError::AlpnMismatch { ours }
    }

    /// Server side of an authenticate-only data connection ([`Alpn::DataClear`]): the full
    /// mutual-TLS handshake (the client's certificate verified as in [`Self::accept`]), then
    /// the connection continues as plain TCP. Returns the TCP stream and the client's
    /// identity.
    ///
    /// The switch is in lock step, so no byte of either direction is left behind in the
    /// TLS layer: the client sends nothing after its `Finished` until it has read this
    /// side's switch marker (sent in the clear once the handshake is done here), and this
    /// side has no session tickets or other records to send after the handshake. The marker
    /// carries a value exported from the TLS session, so the client checks that the clear
    /// stream continues the connection it authenticated.
    pub async fn accept_clear(
        &self,
        stream: tokio::net::TcpStream,
    ) -> Result<(tokio::net::TcpStream, Identity), TlsError> {
        use tokio::io::AsyncWriteExt;
        let (tls, id) = self.accept(stream, Alpn::DataClear).await?;
        let marker = marker(tls.get_ref().1, CLEAR)?;
        let (mut tcp, conn) = tls.into_inner();
        nothing_left(conn)?;
        let limit = self.handshake_timeout();
        tokio::time::timeout(limit, tcp.write_all(&marker))
            .await
            .map_err(|_| TlsError::Timeout(limit))?
            .map_err(TlsError::Handshake)?;
        Ok((tcp, id))
    }

    /// Client side of an authenticate-only data connection ([`Self::accept_clear`]):
    /// handshakes, checks the server is `expect`, waits for the server's switch marker
    /// and returns the plain TCP stream.
    pub async fn connect_clear(
        &self,
        stream: tokio::net::TcpStream,
        expect: &Expect,
    ) -> Result<(tokio::net::TcpStream, Identity), TlsError> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut tls, id) = self.connect(stream, Alpn::DataClear, expect).await?;
        let limit = self.handshake_timeout();
        let switch = async {
            // Our `Finished` is on the wire before anything is read in the clear.
            tls.flush().await.map_err(TlsError::Handshake)?;
            let want = marker(tls.get_ref().1, CLEAR)?;
            let (mut tcp, conn) = tls.into_inner();
            nothing_left(conn)?;
            let mut got = [0u8; MARKER_LEN];
            tcp.read_exact(&mut got).await.map_err(|e| {
                TlsError::ClearSwitch(format!("reading the server's switch marker: {e}"))
            })?;
            if got != want {
                return Err(TlsError::ClearSwitch(
                    "the server's switch marker does not match this TLS session".into(),
                ));
            }
            Ok(tcp)
        };
        let tcp = tokio::time::timeout(limit, switch)
            .await
            .map_err(|_| TlsError::Timeout(limit))??;
        Ok((tcp, id))
    }
}

/// A data connection in the `tls` data mode after its handshake.
pub enum DataConn {
    /// Both ends negotiated `shardcast-rec/1`: the records are read and written by
    /// [`crate::records`], each direction on its own half of the socket.
    Records(
        Box<crate::records::RecordReader<tokio::net::tcp::OwnedReadHalf>>,
        Box<crate::records::RecordWriter<tokio::net::tcp::OwnedWriteHalf>>,
    ),
    /// The peer speaks `shardcast/1` only (an older host): rustls's stream, over a read
    /// buffer of [`DATA_READ_BUFFER`] bytes.
    Rustls(Box<dyn DataStream>),
}

/// A stream rustls protects (either end's type), for [`DataConn::Rustls`].
pub trait DataStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> DataStream for T {}

/// The read buffer in front of rustls on a [`DataConn::Rustls`] connection: rustls reads
/// at most 4 KiB per call, so without it a 1 MiB chunk would take 256 `recvfrom` calls.
pub const DATA_READ_BUFFER: usize = 64 << 10;

impl TlsContext {
    /// Server side of a data connection in the `tls` data mode: the mutual-TLS handshake
    /// ([`Self::accept`]), then, where the client offered `shardcast-rec/1`, the switch to
    /// [`crate::records`]: this side takes the traffic keys from rustls and sends its first
    /// record, a marker carrying a value exported from the session, which the client
    /// awaits before it sends anything (so no byte is left behind in rustls on either
    /// side).
    pub async fn accept_data(
        &self,
        stream: tokio::net::TcpStream,
    ) -> Result<(DataConn, Identity), TlsError> {
        use tokio::io::AsyncWriteExt;
        let stream = tokio::io::BufReader::with_capacity(DATA_READ_BUFFER, stream);
        let (tls, id) = self.accept(stream, Alpn::DataRecords).await?;
        if tls.get_ref().1.alpn_protocol() != Some(Alpn::DataRecords.id()) {
            self.stats.rustls_stream.fetch_add(1, Ordering::Relaxed);
            return Ok((DataConn::Rustls(Box::new(tls)), id));
        }
        let marker = marker(tls.get_ref().1, RECORDS)?;
        let (buffered, conn) = tls.into_inner();
        let (reader, mut writer) = take_over(buffered, conn)?;
        let limit = self.handshake_timeout();
        tokio::time::timeout(limit, async {
            writer.write_all(&marker).await?;
            writer.flush().await
        })
        .await
        .map_err(|_| TlsError::Timeout(limit))?
        .map_err(TlsError::Handshake)?;
        self.stats.record_layer.fetch_add(1, Ordering::Relaxed);
        Ok((DataConn::Records(Box::new(reader), Box::new(writer)), id))
    }

    /// Client side of a data connection in the `tls` data mode ([`Self::accept_data`]):
    /// handshakes offering `shardcast-rec/1` then `shardcast/1`, checks the server is
    /// `expect`, and where the server chose the first, takes the traffic keys from rustls
    /// and waits for the server's marker record.
    pub async fn connect_data(
        &self,
        stream: tokio::net::TcpStream,
        expect: &Expect,
    ) -> Result<(DataConn, Identity), TlsError> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let stream = tokio::io::BufReader::with_capacity(DATA_READ_BUFFER, stream);
        let (mut tls, id) = self.connect(stream, Alpn::DataRecords, expect).await?;
        if tls.get_ref().1.alpn_protocol() != Some(Alpn::DataRecords.id()) {
            self.stats.rustls_stream.fetch_add(1, Ordering::Relaxed);
            return Ok((DataConn::Rustls(Box::new(tls)), id));
        }
        let limit = self.handshake_timeout();
        let switch = async {
            // Our `Finished` is on the wire before the keys leave rustls.
            tls.flush().await.map_err(TlsError::Handshake)?;
            let want = marker(tls.get_ref().1, RECORDS)?;
            let (buffered, conn) = tls.into_inner();
            let (mut reader, writer) = take_over(buffered, conn)?;
            let mut got = [0u8; MARKER_LEN];
            reader.read_exact(&mut got).await.map_err(|e| {
                TlsError::ClearSwitch(format!("reading the server's first record: {e}"))
            })?;
            if got != want {
                return Err(TlsError::ClearSwitch(
                    "the server's first record does not carry this session's marker".into(),
                ));
            }
            Ok(DataConn::Records(Box::new(reader), Box::new(writer)))
        };
        let conn = tokio::time::timeout(limit, switch)
            .await
            .map_err(|_| TlsError::Timeout(limit))??;
        self.stats.record_layer.fetch_add(1, Ordering::Relaxed);
        Ok((conn, id))
    }
}

/// Takes a handshaken connection's traffic keys from rustls and the socket from under it,
/// as the record layer's two halves; refuses when a byte of the stream would be left
/// behind (in the read buffer or inside rustls).
fn take_over<D, C>(
    buffered: tokio::io::BufReader<tokio::net::TcpStream>,
    mut conn: C,
) -> Result<
    (
        crate::records::RecordReader<tokio::net::tcp::OwnedReadHalf>,
        crate::records::RecordWriter<tokio::net::tcp::OwnedWriteHalf>,
    ),
    TlsError,
>
where
    C: std::ops::DerefMut<Target = rustls::ConnectionCommon<D>> + Into<rustls::Connection>,
{
    nothing_buffered(&buffered)?;
    nothing_left(&mut *conn)?;
    let secrets = conn
        .into()
        .dangerous_extract_secrets()
        .map_err(|e| TlsError::ClearSwitch(format!("taking over the traffic keys: {e}")))?;
    let (read, write) = buffered.into_inner().into_split();
    crate::records::split(read, write, secrets).map_err(TlsError::Handshake)
}

/// Refuses the switch to the record layer when the read buffer in front of rustls holds
/// bytes rustls has not taken (the peer sent before the switch).
fn nothing_buffered<S: AsyncRead>(buffered: &tokio::io::BufReader<S>) -> Result<(), TlsError> {
    if buffered.buffer().is_empty() {
        Ok(())
    } else {
        Err(TlsError::ClearSwitch(
            "the peer sent bytes before the switch to the record layer".into(),
        ))
    }
}

/// Length of the marker a server sends when a data connection leaves rustls after the
/// handshake: 8 magic bytes and a 32-byte value exported from the TLS session (RFC 8446
/// section 7.5), which the client compares with its own export.
const MARKER_LEN: usize = 8 + 32;

/// Which switch a marker announces: its magic bytes and its exporter label.
#[derive(Clone, Copy)]
struct Switch {
    magic: &'static [u8; 8],
    label: &'static [u8],
}

/// The authenticate-only switch to the clear ([`TlsContext::accept_clear`]); the marker
/// travels in the clear.
const CLEAR: Switch = Switch {
    magic: b"SCCLEAR1",
    label: b"EXPORTER-shardcast-clear-switch",
};

/// The switch to the record layer ([`TlsContext::accept_data`]); the marker is the
/// server's first record.
const RECORDS: Switch = Switch {
    magic: b"SCREC001",
    label: b"EXPORTER-shardcast-record-switch",
};

/// The marker of `switch` for the session `conn` belongs to (the same on both ends).
fn marker<D>(
    conn: &rustls::ConnectionCommon<D>,
    switch: Switch,
) -> Result<[u8; MARKER_LEN], TlsError> {
    let mut m = [0u8; MARKER_LEN];
    m[..8].copy_from_slice(switch.magic);
    conn.export_keying_material(&mut m[8..], switch.label, None)
        .map_err(|e| TlsError::ClearSwitch(format!("exporting the session value: {e}")))?;
    Ok(m)
}

/// Refuses the switch when the TLS layer still holds bytes of the stream: records to send
/// or plaintext received and not read.
fn nothing_left<D>(
    mut conn: impl std::ops::DerefMut<Target = rustls::ConnectionCommon<D>>,
) -> Result<(), TlsError> {
    use std::io::Read;
    if conn.wants_write() {
        return Err(TlsError::ClearSwitch(
            "TLS records are still queued to send".into(),
        ));
    }
    let mut probe = [0u8; 1];
    match conn.reader().read(&mut probe) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
        Ok(0) => Err(TlsError::ClearSwitch(
            "the peer closed the TLS session".into(),
        )),
        Ok(_) => Err(TlsError::ClearSwitch(
            "the peer sent data inside TLS after the handshake".into(),
        )),
        Err(e) => Err(TlsError::ClearSwitch(e.to_string())),
    }
}
