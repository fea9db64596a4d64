//! A small cluster CA for quick starts, tests and the demo (`shardcast certs`): create the
//! CA, issue a certificate naming one [`Identity`], and rotate one (new key, new validity,
//! same names). Production clusters may use any CA instead: transferd and the controller
//! only load PEM files.
//!
//! Layout of a PKI directory: `ca.pem` + `ca.key` (the CA), and `<role>-<name>.pem` +
//! `<role>-<name>.key` per identity. Keys are written 0600, atomically (a temporary file
//! renamed into place), so a daemon that reloads its certificate never reads half a file.

use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use time::OffsetDateTime;

use crate::role::{Identity, IdentityError};

/// Default validity of a leaf certificate. Rationale: long enough that a quick-start
/// cluster does not expire under its users, short enough that `rotate` gets exercised;
/// production deployments usually issue far shorter ones from their own CA.
pub const DEFAULT_LEAF_VALIDITY: Duration = Duration::from_secs(90 * 24 * 3600);
/// Default validity of the CA certificate (ten years).
pub const DEFAULT_CA_VALIDITY: Duration = Duration::from_secs(3650 * 24 * 3600);

/// File names of a PKI directory.
#[derive(Debug, Clone)]
pub struct PkiDir {
    dir: PathBuf,
}

/// A certificate and its key on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    /// The PEM certificate.
    pub cert: PathBuf,
    /// The PEM private key (0600).
    pub key: PathBuf,
}

/// What to put in a leaf certificate besides its identity.
#[derive(Debug, Clone)]
pub struct IssueRequest {
    /// Role and name (the `shardcast://role/name` SAN).
    pub identity: Identity,
    /// DNS names the holder serves under (for clients that check names, e.g. curl).
    pub dns: Vec<String>,
    /// IP addresses the holder serves under.
    pub ips: Vec<IpAddr>,
    /// How long from now the certificate is valid.
    pub validity: Duration,
    /// Start of validity relative to now (negative: in the past). Tests use it to make
    /// expired certificates; `shardcast certs` leaves it at a minute ago (clock skew).
    pub not_before_offset: time::Duration,
}

impl IssueRequest {
    /// A request for `identity` valid for [`DEFAULT_LEAF_VALIDITY`], with `localhost` and
    /// the loopback addresses as names (every listener defaults to loopback).
    pub fn new(identity: Identity) -> Self {
        Self {
            identity,
            dns: vec!["localhost".into()],
            ips: vec![
                IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
                IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
            ],
            validity: DEFAULT_LEAF_VALIDITY,
            not_before_offset: time::Duration::minutes(-1),
        }
    }
}

impl PkiDir {
    /// A PKI rooted at `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA's files.
    pub fn ca(&self) -> CertFiles {
        CertFiles {
            cert: self.dir.join("ca.pem"),
            key: self.dir.join("ca.key"),
        }
    }

    /// The files of one identity.
    pub fn leaf(&self, id: &Identity) -> CertFiles {
        let stem = format!("{}-{}", id.role, id.name);
        CertFiles {
            cert: self.dir.join(format!("{stem}.pem")),
            key: self.dir.join(format!("{stem}.key")),
        }
    }

    /// Creates the CA. Refuses to overwrite an existing one (that would orphan every
    /// certificate it issued).
    pub fn init(&self, common_name: &str, validity: Duration) -> Result<CertFiles, IdentityError> {
        let files = self.ca();
        if files.cert.exists() || files.key.exists() {
            return Err(io_err(
                &files.cert,
                std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "a CA already exists here; remove it first or use another directory",
                ),
            ));
        }
        create_private_dir(&self.dir)?;
        let key = KeyPair::generate()?;
        let cert = ca_params(common_name, validity).self_signed(&key)?;
        write_private(&files.key, key.serialize_pem().as_bytes())?;
        write_public(&files.cert, cert.pem().as_bytes())?;
        Ok(files)
    }

    /// Issues a certificate for `req`, signed by this directory's CA, and writes it as
    /// `<role>-<name>.pem/.key` (replacing an older one atomically).
    pub fn issue(&self, req: &IssueRequest) -> Result<CertFiles, IdentityError> {
        let (cert, key) = self.issue_pem(req)?;
        let files = self.leaf(&req.identity);
        write_private(&files.key, key.as_bytes())?;
        write_public(&files.cert, cert.as_bytes())?;
        Ok(files)
    }

    /// Issues a certificate for `req` and returns `(cert PEM, key PEM)` without writing.
    pub fn issue_pem(&self, req: &IssueRequest) -> Result<(String, String), IdentityError> {
        let ca = self.ca();
        let ca_key_pem = read_string(&ca.key)?;
        let ca_cert_pem = read_string(&ca.cert)?;
        let ca_key = KeyPair::from_pem(&ca_key_pem)?;
        let issuer = Issuer::from_ca_cert_pem(&ca_cert_pem, ca_key)?;
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, req.identity.to_string());
        let mut sans = vec![SanType::URI(req.identity.uri().try_into()?)];
        for d in &req.dns {
            sans.push(SanType::DnsName(d.clone().try_into()?));
        }
        sans.extend(req.ips.iter().copied().map(SanType::IpAddress));
        params.subject_alt_names = sans;
        let now = OffsetDateTime::now_utc();
        params.not_before = now + req.not_before_offset;
        params.not_after = now + req.validity;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// Re-issues the certificate in `files` with a new key and a new validity, keeping its
    /// identity and names. A daemon that watches the files picks it up without a restart.
    pub fn rotate(&self, files: &CertFiles, validity: Duration) -> Result<(), IdentityError> {
        let pem = std::fs::read(&files.cert).map_err(|e| io_err(&files.cert, e))?;
        let der = crate::tls::first_cert(&pem, &files.cert)?;
        let names = crate::tls::cert_names(&der)?;
        let mut req = IssueRequest::new(names.identity);
        req.dns = names.dns;
        req.ips = names.ips;
        req.validity = validity;
        let (cert, key) = self.issue_pem(&req)?;
        write_private(&files.key, key.as_bytes())?;
        write_public(&files.cert, cert.as_bytes())?;
        Ok(())
    }
}

fn ca_params(common_name: &str, validity: Duration) -> CertificateParams {
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name.to_string());
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::minutes(1);
    params.not_after = now + validity;
    params
}

fn io_err(path: &Path, source: std::io::Error) -> IdentityError {
    IdentityError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn read_string(path: &Path) -> Result<String, IdentityError> {
    std::fs::read_to_string(path).map_err(|e| io_err(path, e))
}

fn create_private_dir(dir: &Path) -> Result<(), IdentityError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| io_err(dir, e))
}

/// Writes `bytes` to `path` with `mode`, through a temporary file renamed into place
/// (opened with `O_NOFOLLOW`: never write a key through a planted symlink).
fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), IdentityError> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    create_private_dir(dir)?;
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(|e| io_err(&tmp, e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| io_err(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<(), IdentityError> {
    write_atomic(path, bytes, 0o600)
}

fn write_public(path: &Path, bytes: &[u8]) -> Result<(), IdentityError> {
    write_atomic(path, bytes, 0o644)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::role::Role;

    #[test]
    fn init_issue_rotate() {
        let dir = tempfile::tempdir().unwrap();
        let pki = PkiDir::new(dir.path().join("pki"));
        pki.init("test CA", DEFAULT_CA_VALIDITY).unwrap();
        assert!(pki.init("again", DEFAULT_CA_VALIDITY).is_err());
        let id = Identity::new(Role::Host, "h1").unwrap();
        let files = pki.issue(&IssueRequest::new(id.clone())).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&files.key).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let before = std::fs::read(&files.cert).unwrap();
        let der = crate::tls::first_cert(&before, &files.cert).unwrap();
        let names = crate::tls::cert_names(&der).unwrap();
        assert_eq!(names.identity, id);
        assert_eq!(names.dns, vec!["localhost".to_string()]);
        pki.rotate(&files, Duration::from_secs(3600)).unwrap();
        let after = std::fs::read(&files.cert).unwrap();
        assert_ne!(before, after);
        let der = crate::tls::first_cert(&after, &files.cert).unwrap();
        assert_eq!(crate::tls::cert_names(&der).unwrap().identity, id);
    }
}
