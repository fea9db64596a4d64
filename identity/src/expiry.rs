//! Certificate expiry ahead of time: the `notAfter` of a member's own certificate and of
//! its CA bundle, read once per load of the TLS files (x509-parser, as for the identity),
//! and how close each is to its end against a warning threshold.
//!
//! [`crate::TlsContext`] keeps an [`Expiry`] beside each reading of the files, logs it at
//! start ([`crate::TlsContext::log_expiry`]), after every reload, and when a state changes
//! while the daemon runs (the reloader's periodic check): `WARN` within the threshold
//! (default [`EXPIRY_WARNING`], set by each daemon's `cert_expiry_warning_s`), `ERROR` once
//! passed. The daemons export the seconds left at each scrape
//! (`shardcast_certificate_expiry_seconds{certificate="own"|"ca"}`).

use std::path::Path;
use std::time::{Duration, SystemTime};

use rustls::pki_types::CertificateDer;
use tracing::{error, info, warn};
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::role::IdentityError;

/// Default of how long before a certificate's `notAfter` the daemons warn. Rationale: two
/// weeks leaves a renewal that failed (cert-manager, a cron job) time to be noticed and
/// done by hand, and is shorter than a third of `shardcast certs issue`'s 90 days, so a
/// certificate renewed at two thirds of its life never warns.
pub const EXPIRY_WARNING: Duration = Duration::from_secs(14 * 86_400);

/// A DER certificate's `notAfter`, in seconds since the Unix epoch.
pub fn not_after(der: &CertificateDer<'_>) -> Result<i64, IdentityError> {
    let (_, cert) = X509Certificate::from_der(der.as_ref())
        .map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
    Ok(cert.validity().not_after.timestamp())
}

/// Where validity ends for one reading of a member's TLS files, in seconds since the Unix
/// epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expiry {
    /// The member's own certificate (the first of its chain).
    pub cert: i64,
    /// The certificate of the CA bundle that expires first (during a CA rotation the
    /// bundle holds two; the older one's end is the one that matters).
    pub ca: i64,
}

impl Expiry {
    /// Reads the ends of `leaf` and of every certificate in `ca_bundle`.
    pub fn read(
        leaf: &CertificateDer<'_>,
        ca_bundle: &[CertificateDer<'_>],
    ) -> Result<Self, IdentityError> {
        let mut ca = None::<i64>;
        for c in ca_bundle {
            let end = not_after(c)?;
            ca = Some(ca.map_or(end, |e| e.min(end)));
        }
        Ok(Self {
            cert: not_after(leaf)?,
            ca: ca.ok_or_else(|| {
                IdentityError::BadCertificate("no CA certificate in the bundle".into())
            })?,
        })
    }

    /// Seconds from `now` to the own certificate's end and to the CA bundle's; negative
    /// once passed.
    pub fn remaining(&self, now: SystemTime) -> (i64, i64) {
        let now = unix_seconds(now);
        (self.cert.saturating_sub(now), self.ca.saturating_sub(now))
    }
}

/// Seconds since the Unix epoch (negative before it).
fn unix_seconds(t: SystemTime) -> i64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    }
}

/// How close a certificate is to its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ExpiryState {
    /// More than the warning threshold left.
    Valid,
    /// Within the threshold: renew it.
    Soon,
    /// Past its `notAfter`: peers refuse it.
    Expired,
}

impl ExpiryState {
    /// The state of a certificate with `remaining` seconds left, warned about `within`
    /// its end. `notAfter` is the last second of validity, so 0 left is still valid.
    pub fn of(remaining: i64, within: Duration) -> Self {
        if remaining < 0 {
            Self::Expired
        } else if remaining.unsigned_abs() <= within.as_secs() {
            Self::Soon
        } else {
            Self::Valid
        }
    }
}

/// `secs` as a short text: `"13d 4h"`, `"3h 12m"`, `"42s"`.
pub fn describe_seconds(secs: u64) -> String {
    let (d, h, m) = (secs / 86_400, secs % 86_400 / 3600, secs % 3600 / 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{secs}s"),
        (0, 0, m) => format!("{m}m"),
        (0, h, m) => format!("{h}h {m}m"),
        (d, h, _) => format!("{d}d {h}h"),
    }
}

/// A Unix time as x509-parser prints certificate dates (`Jun  1 12:00:00 2026 +00:00`).
fn date(unix: i64) -> String {
    x509_parser::time::ASN1Time::from_timestamp(unix)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| format!("{unix} (Unix time)"))
}

/// Which certificate a log line is about.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Which {
    /// The member's own certificate.
    Own,
    /// The CA bundle's first to expire.
    Ca,
}

/// Logs the state of one certificate: `ERROR` when expired, `WARN` within the threshold,
/// `INFO` otherwise (only at start and reload: `quiet_when_valid` leaves it out of the
/// periodic check's transitions back to valid, which a reload already logged).
pub(crate) fn log(
    which: Which,
    path: &Path,
    end: i64,
    remaining: i64,
    within: Duration,
    quiet_when_valid: bool,
) -> ExpiryState {
    let state = ExpiryState::of(remaining, within);
    let (path, until) = (path.display(), date(end));
    let left = describe_seconds(remaining.unsigned_abs());
    let threshold = describe_seconds(within.as_secs());
    match (which, state) {
        (Which::Own, ExpiryState::Expired) => error!(
            cert = %path, not_after = %until,
            "this daemon's TLS certificate EXPIRED {left} ago: peers refuse it in the TLS handshake; \
             renew it (`shardcast certs rotate`, or your CA) and the daemon loads it without a restart"
        ),
        (Which::Own, ExpiryState::Soon) => warn!(
            cert = %path, not_after = %until,
            "this daemon's TLS certificate expires in {left} (warning at {threshold}): renew it \
             (`shardcast certs rotate`, or your CA); the daemon loads it without a restart"
        ),
        (Which::Ca, ExpiryState::Expired) => error!(
            ca = %path, not_after = %until,
            "a certificate of the CA bundle EXPIRED {left} ago: certificates it issued no longer \
             verify; rotate the CA (docs/SECURITY.md, Rotation and reload)"
        ),
        (Which::Ca, ExpiryState::Soon) => warn!(
            ca = %path, not_after = %until,
            "a certificate of the CA bundle expires in {left} (warning at {threshold}): rotate \
             the CA (docs/SECURITY.md, Rotation and reload)"
        ),
        (_, ExpiryState::Valid) if quiet_when_valid => {}
        (Which::Own, ExpiryState::Valid) => {
            info!(cert = %path, not_after = %until, "TLS certificate valid for {left}")
        }
        (Which::Ca, ExpiryState::Valid) => {
            info!(ca = %path, not_after = %until, "CA bundle valid for {left}")
        }
    }
    state
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{IssueRequest, PkiDir};
    use crate::{Identity, Role};
    use rustls::pki_types::pem::PemObject;

    fn der(path: &Path) -> CertificateDer<'static> {
        CertificateDer::from_pem_file(path).unwrap()
    }

    #[test]
    fn not_after_is_read_from_the_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let pki = PkiDir::new(dir.path().join("pki"));
        let ca = pki
            .init("test CA", Duration::from_secs(400 * 86_400))
            .unwrap();
        let mut req = IssueRequest::new(Identity::new(Role::Host, "h1").unwrap());
        req.validity = Duration::from_secs(10 * 86_400);
        let issued_at = unix_seconds(SystemTime::now());
        let leaf = pki.issue(&req).unwrap();

        let end = not_after(&der(&leaf.cert)).unwrap();
        let want = issued_at + 10 * 86_400;
        assert!((end - want).abs() <= 2, "notAfter {end}, issued for {want}");

        let e = Expiry::read(&der(&leaf.cert), &[der(&ca.cert)]).unwrap();
        assert_eq!(e.cert, end);
        assert!((e.ca - (issued_at + 400 * 86_400)).abs() <= 2, "{e:?}");
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(issued_at as u64);
        let (own, ca_left) = e.remaining(now);
        assert!((own - 10 * 86_400).abs() <= 2, "{own}");
        assert!((ca_left - 400 * 86_400).abs() <= 2, "{ca_left}");
        // Past the end the seconds left are negative.
        let later = now + Duration::from_secs(11 * 86_400);
        assert!(e.remaining(later).0 < -86_000);
    }

    #[test]
    fn the_ca_bundles_first_end_counts_and_garbage_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let old = PkiDir::new(dir.path().join("old"));
        let new = PkiDir::new(dir.path().join("new"));
        let old_ca = old.init("old", Duration::from_secs(30 * 86_400)).unwrap();
        let new_ca = new.init("new", Duration::from_secs(900 * 86_400)).unwrap();
        let leaf = new
            .issue(&IssueRequest::new(Identity::new(Role::Host, "h").unwrap()))
            .unwrap();
        let e = Expiry::read(&der(&leaf.cert), &[der(&new_ca.cert), der(&old_ca.cert)]).unwrap();
        assert_eq!(e.ca, not_after(&der(&old_ca.cert)).unwrap());
        assert!(Expiry::read(&der(&leaf.cert), &[]).is_err());
        assert!(not_after(&CertificateDer::from(vec![0x30, 0x03, 1, 2, 3])).is_err());
    }

    #[test]
    fn states_against_the_threshold() {
        let two_weeks = EXPIRY_WARNING;
        assert_eq!(ExpiryState::of(30 * 86_400, two_weeks), ExpiryState::Valid);
        assert_eq!(
            ExpiryState::of(14 * 86_400 + 1, two_weeks),
            ExpiryState::Valid
        );
        assert_eq!(ExpiryState::of(14 * 86_400, two_weeks), ExpiryState::Soon);
        assert_eq!(ExpiryState::of(1, two_weeks), ExpiryState::Soon);
        assert_eq!(ExpiryState::of(0, two_weeks), ExpiryState::Soon);
        assert_eq!(ExpiryState::of(-1, two_weeks), ExpiryState::Expired);
        // A zero threshold warns only once expired.
        assert_eq!(ExpiryState::of(5, Duration::ZERO), ExpiryState::Valid);
        assert_eq!(ExpiryState::of(-5, Duration::ZERO), ExpiryState::Expired);
        assert!(ExpiryState::Expired > ExpiryState::Soon && ExpiryState::Soon > ExpiryState::Valid);
    }

    #[test]
    fn durations_read_as_days_hours_minutes() {
        assert_eq!(describe_seconds(42), "42s");
        assert_eq!(describe_seconds(125), "2m");
        assert_eq!(describe_seconds(3 * 3600 + 12 * 60), "3h 12m");
        assert_eq!(describe_seconds(13 * 86_400 + 4 * 3600 + 59), "13d 4h");
        assert_eq!(date(0), "Jan  1 00:00:00 1970 +00:00");
    }
}
