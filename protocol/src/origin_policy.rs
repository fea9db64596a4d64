//! Origin policy: which origin URIs a controller may register and a host may open.
//!
//! An operator lists allowed origin *prefixes* (`origin_allow`): `file://` roots, HTTP(S) URL
//! prefixes such as `https://models.example.com/org/`, and (once the reader exists)
//! `s3://bucket/prefix/`, and Hugging Face repositories (`hf://org/` for every repository of
//! an organisation, `hf://org/name` for one repository at any revision, `hf://org/name@rev`
//! for one revision). Both the controller (at register time) and every transferd (for
//! every origin it opens: imports, chain heads, a session's fallback origin, partition
//! loads) check a URI against the same [`OriginPolicy`]. This module is pure: no I/O, no
//! DNS, no clock. The daemon adds what needs I/O on top (symlink resolution beneath a
//! `file://` root, redirect and resolved-address checks for HTTP).
//!
//! Rules, in order:
//!
//! 1. The URI must parse as an origin ([`OriginLocation::parse`]): a supported scheme, no
//!    user info, no `.`/`..` path segment (also not percent-encoded), no empty segment, and
//!    no segment that decodes to `/`, `\`, NUL or a control character. Hosts are
//!    normalised (lower case, IP literals in canonical form, default ports made explicit),
//!    so `HTTP://Example.COM:80/a` and `http://example.com/a` are the same location.
//! 2. It must lie under an allowed prefix, compared segment by segment on decoded
//!    segments: `file:///data/models` allows `file:///data/models/llama` but not
//!    `file:///data/models-evil`. Scheme, host and port must be equal.
//! 3. No segment *below* the matched prefix may start with `.` (`.git`, `.env`, `.ssh`):
//!    a prefix the operator wrote may itself contain such a directory (a scratch directory
//!    from `mktemp`, say), but nothing under it is reached through a dot name.
//! 4. An empty allow-list refuses everything ([`PolicyError::NothingAllowed`] says how to
//!    allow an origin): secure by default.
//!
//! Addresses: an HTTP origin's host may resolve to anything, so the daemon filters resolved
//! addresses with [`OriginPolicy::permits_address`]: loopback, link-local, unspecified,
//! multicast and cloud metadata addresses ([`restricted_address`]) are refused unless an
//! allowed prefix names that very address as its host. Private (RFC 1918, unique-local)
//! ranges are not restricted: in-house object stores live there, and the prefix already
//! pins the host name.
//!
//! Hugging Face commits: [`is_commit_id`] and [`OriginLocation::pins`] (a Hub location at a
//! full commit of another's repository) are how the `hf://` origin pins a revision's commit
//! and how the controller decides whether a host's resolved origin may become a model's
//! `read_origin`. The module is property-tested (`tests/` and its unit tests).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use url::{Host, Url};

/// Longest origin URI or prefix accepted, in bytes (matches the frame limit for URIs).
pub const MAX_ORIGIN_LEN: usize = 4096;

/// The setting an operator changes to allow an origin, named in refusals.
pub const SETTING_HINT: &str = "origin_allow (flag --origin-allow, env SHARDCAST_ORIGIN_ALLOW, comma-separated prefixes such as file:///data/models/ or https://models.example.com/org/)";

/// Why an origin URI or an allow-list entry is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The text is not a usable origin URI.
    #[error("invalid origin {uri:?}: {reason}")]
    Invalid {
        /// The URI as given.
        uri: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The scheme is not one shardcast reads from.
    #[error(
        "unsupported origin {uri:?}: use file:///absolute/path, http://host/path, https://host/path, s3://bucket/prefix or hf://org/name@revision"
    )]
    UnsupportedScheme {
        /// The URI as given.
        uri: String,
    },
    /// The allow-list is empty, so no origin may be used.
    #[error("origin {uri} refused: no origins are allowed on this {role}; set {SETTING_HINT}")]
    NothingAllowed {
        /// The URI refused.
        uri: String,
        /// `controller` or `host`.
        role: &'static str,
    },
    /// The URI lies under no allowed prefix.
    #[error(
        "origin {uri} refused: it is outside the origin allow-list of this {role} ({allowed}); add a prefix to {SETTING_HINT}"
    )]
    NotAllowed {
        /// The URI refused.
        uri: String,
        /// `controller` or `host`.
        role: &'static str,
        /// The allowed prefixes, comma-separated.
        allowed: String,
    },
    /// A path segment below the allowed prefix names a hidden file or directory.
    #[error("origin {uri} refused: {segment:?} is a hidden (dot) file or directory")]
    DotSegment {
        /// The URI refused.
        uri: String,
        /// The offending segment.
        segment: String,
    },
    /// A host name resolved only to restricted addresses (loopback, link-local, metadata).
    #[error(
        "origin host {host} refused: it resolves to {addr}, a loopback, link-local or metadata address; list that address literally in {SETTING_HINT} to allow it"
    )]
    RestrictedAddress {
        /// The host name.
        host: String,
        /// The first restricted address it resolved to.
        addr: IpAddr,
    },
}

/// The scheme of an origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OriginScheme {
    /// A local path.
    File,
    /// Plain HTTP.
    Http,
    /// HTTP over TLS.
    Https,
    /// An S3 (or S3-compatible) bucket.
    S3,
    /// A Hugging Face Hub repository (`hf://org/name@revision`).
    Hf,
}

impl OriginScheme {
    fn as_str(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::Http => "http",
            Self::Https => "https",
            Self::S3 => "s3",
            Self::Hf => "hf",
        }
    }
}

/// Who holds the data: nobody for `file://`, a host and port for HTTP(S), a bucket for S3.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Authority {
    /// `file://`: the local file system.
    Local,
    /// HTTP(S): a normalised host and the effective port.
    Net {
        /// Lower-case domain or IP literal.
        host: NetHost,
        /// Port, the scheme's default when none is written.
        port: u16,
    },
    /// S3: the bucket name.
    Bucket(String),
    /// Hugging Face: the organisation (or user) owning the repository, case kept.
    HubOrg(String),
}

/// A network host as written in a URI, normalised.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum NetHost {
    /// A DNS name, lower case.
    Domain(String),
    /// An IP literal.
    Ip(IpAddr),
}

impl fmt::Display for NetHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Domain(d) => f.write_str(d),
            Self::Ip(IpAddr::V4(a)) => write!(f, "{a}"),
            Self::Ip(IpAddr::V6(a)) => write!(f, "[{a}]"),
        }
    }
}

/// Whether `s` is a full git commit id: 40 (SHA-1) or 64 (SHA-256) hex digits.
pub fn is_commit_id(s: &str) -> bool {
    matches!(s.len(), 40 | 64) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A parsed, normalised origin location: scheme, authority and decoded path segments.
/// Constructed only by [`OriginLocation::parse`], so every value obeys rule 1 above.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OriginLocation {
    scheme: OriginScheme,
    authority: Authority,
    /// Decoded path segments, none empty, none `.` or `..`.
    segments: Vec<String>,
    /// The written URI ended in `/`.
    dir: bool,
    /// `hf://` only: the revision written after `@` in the repository name.
    revision: Option<String>,
}

impl OriginLocation {
    /// Parses and normalises `uri`. Does no I/O.
    pub fn parse(uri: &str) -> Result<Self, PolicyError> {
        let invalid = |reason: &str| PolicyError::Invalid {
            uri: uri.to_string(),
            reason: reason.to_string(),
        };
        if uri.len() > MAX_ORIGIN_LEN {
            return Err(invalid("longer than 4096 bytes"));
        }
        let Some((scheme, rest)) = uri.split_once("://") else {
            return Err(PolicyError::UnsupportedScheme {
                uri: uri.to_string(),
            });
        };
        let scheme = match scheme.to_ascii_lowercase().as_str() {
            "file" => OriginScheme::File,
            "http" => OriginScheme::Http,
            "https" => OriginScheme::Https,
            "s3" => OriginScheme::S3,
            "hf" => OriginScheme::Hf,
            _ => {
                return Err(PolicyError::UnsupportedScheme {
                    uri: uri.to_string(),
                });
            }
        };
        // Look at the path as written, before the URL parser folds `..` away: a `..` is
        // refused, never resolved. Backslashes count as separators (WHATWG parsers treat
        // them so for http).
        let raw_path = {
            let no_tail = rest.split(['?', '#']).next().unwrap_or_default();
            match scheme {
                OriginScheme::File => no_tail,
                _ => no_tail.find(['/', '\\']).map_or("", |i| &no_tail[i..]),
            }
        };
        for piece in raw_path.split(['/', '\\']) {
            let decoded = percent_decode(piece).ok_or_else(|| {
                invalid("a path segment has a malformed %-escape or is not UTF-8")
            })?;
            if decoded == "." || decoded == ".." {
                return Err(invalid(
                    "'.' and '..' path segments are not allowed; write the path out",
                ));
            }
        }
        if rest.contains(char::is_whitespace) {
            return Err(invalid("contains white space"));
        }
        let url = Url::parse(uri).map_err(|e| invalid(&e.to_string()))?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(invalid(
                "user info (user:password@) is not allowed in an origin",
            ));
        }
        let authority = match scheme {
            OriginScheme::File => {
                match url.host() {
                    None => {}
                    Some(Host::Domain(d)) if d.is_empty() || d == "localhost" => {}
                    Some(_) => {
                        return Err(invalid(
                            "expected an absolute local path such as file:///data/model",
                        ));
                    }
                }
                Authority::Local
            }
            OriginScheme::Http | OriginScheme::Https => {
                let host = match url.host() {
                    None => return Err(invalid("the URL has no host")),
                    Some(Host::Domain("")) => return Err(invalid("the URL has no host")),
                    Some(Host::Domain(d)) => NetHost::Domain(d.to_ascii_lowercase()),
                    Some(Host::Ipv4(a)) => NetHost::Ip(IpAddr::V4(a)),
                    Some(Host::Ipv6(a)) => NetHost::Ip(IpAddr::V6(a)),
                };
                let port = url
                    .port_or_known_default()
                    .ok_or_else(|| invalid("the URL has no port"))?;
                Authority::Net { host, port }
            }
            OriginScheme::S3 => match url.host_str() {
                Some(b) if valid_bucket(b) => Authority::Bucket(b.to_string()),
                _ => {
                    return Err(invalid(
                        "expected s3://bucket/prefix with a bucket name of 3-63 lower-case letters, digits, '-' or '.'",
                    ));
                }
            },
            OriginScheme::Hf => match url.host_str() {
                Some(org) if valid_hub_name(org) => Authority::HubOrg(org.to_string()),
                _ => {
                    return Err(invalid(
                        "expected hf://org/name@revision with an organisation of letters, digits, '-', '_' or '.'",
                    ));
                }
            },
        };
        let path = url.path();
        let dir = path.ends_with('/');
        let mut segments = Vec::new();
        let pieces: Vec<&str> = path.split('/').skip(1).collect();
        let last = pieces.len().saturating_sub(1);
        for (i, piece) in pieces.iter().enumerate() {
            if piece.is_empty() {
                if i == last {
                    continue; // the trailing slash of a directory
                }
                return Err(invalid("empty path segment ('//')"));
            }
            let decoded = percent_decode(piece).ok_or_else(|| {
                invalid("a path segment has a malformed %-escape or is not UTF-8")
            })?;
            if decoded == "." || decoded == ".." {
                return Err(invalid("'.' and '..' path segments are not allowed"));
            }
            if decoded
                .chars()
                .any(|c| c == '/' || c == '\\' || c.is_control())
            {
                return Err(invalid(
                    "a path segment encodes '/', '\\' or a control character",
                ));
            }
            segments.push(decoded);
        }
        let mut revision = None;
        if scheme == OriginScheme::Hf {
            if segments.len() > 1 {
                return Err(invalid(
                    "a Hugging Face origin is hf://org/name@revision: no path below the repository",
                ));
            }
            if let Some(repo) = segments.first_mut()
                && let Some((name, rev)) = repo.split_once('@')
            {
                if !valid_hub_revision(rev) {
                    return Err(invalid(
                        "the revision after '@' must be a branch, tag or commit of letters, digits, '-', '_' or '.'",
                    ));
                }
                revision = Some(rev.to_string());
                *repo = name.to_string();
            }
            if segments.first().is_some_and(|name| !valid_hub_name(name)) {
                return Err(invalid(
                    "the repository name must be letters, digits, '-', '_' or '.'",
                ));
            }
        }
        if scheme == OriginScheme::File && segments.is_empty() {
            return Err(invalid(
                "file:/// (the whole file system) cannot be an origin",
            ));
        }
        Ok(Self {
            scheme,
            authority,
            segments,
            dir,
            revision,
        })
    }

    /// The revision of an `hf://org/name@revision` location (`None` when none is written,
    /// and for other schemes).
    pub fn revision(&self) -> Option<&str> {
        self.revision.as_deref()
    }

    /// Whether this is `other`'s Hub repository pinned to a commit: both `hf://`, the same
    /// organisation and name, and this revision a full commit id ([`is_commit_id`]) —
    /// whatever revision `other` names.
    pub fn pins(&self, other: &Self) -> bool {
        self.scheme == OriginScheme::Hf
            && other.scheme == OriginScheme::Hf
            && self.authority == other.authority
            && self.segments == other.segments
            && self.revision().is_some_and(is_commit_id)
    }

    /// The scheme.
    pub fn scheme(&self) -> OriginScheme {
        self.scheme
    }

    /// Who holds the data.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// Decoded path segments (none empty, `.` or `..`).
    pub fn segments(&self) -> &[String] {
        &self.segments
    }

    /// The local path of a `file://` location (`None` for other schemes): `/` followed by
    /// the segments.
    pub fn local_path(&self) -> Option<String> {
        (self.scheme == OriginScheme::File).then(|| format!("/{}", self.segments.join("/")))
    }

    /// Whether `self` lies under `prefix` (segment by segment; equal counts).
    fn under(&self, prefix: &Self) -> bool {
        self.scheme == prefix.scheme
            && self.authority == prefix.authority
            && self.segments.len() >= prefix.segments.len()
            && self.segments[..prefix.segments.len()] == prefix.segments[..]
            && (prefix.revision.is_none() || prefix.revision == self.revision)
    }
}

impl fmt::Display for OriginLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://", self.scheme.as_str())?;
        match &self.authority {
            Authority::Local => {}
            Authority::Net { host, port } => write!(f, "{host}:{port}")?,
            Authority::Bucket(b) | Authority::HubOrg(b) => f.write_str(b)?,
        }
        for s in &self.segments {
            write!(f, "/{}", encode_segment(s))?;
        }
        if let Some(rev) = &self.revision {
            write!(f, "@{rev}")?;
        }
        if self.dir || self.segments.is_empty() {
            f.write_str("/")?;
        }
        Ok(())
    }
}

/// An allowed prefix: a location under which every origin is allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OriginPrefix {
    location: OriginLocation,
}

impl OriginPrefix {
    /// Parses an allow-list entry. A `file://` entry must name an absolute directory; an
    /// HTTP(S) entry a host (and optionally a path).
    pub fn parse(entry: &str) -> Result<Self, PolicyError> {
        let location = OriginLocation::parse(entry.trim())?;
        Ok(Self { location })
    }

    /// The prefix as a location.
    pub fn location(&self) -> &OriginLocation {
        &self.location
    }

    /// The root directory of a `file://` prefix.
    pub fn local_root(&self) -> Option<String> {
        self.location.local_path()
    }
}

impl fmt::Display for OriginPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut l = self.location.clone();
        // A repository name is not a directory: `hf://org/name@main`, not `…@main/`.
        l.dir = l.scheme != OriginScheme::Hf || l.segments.is_empty();
        l.fmt(f)
    }
}

/// The allow-list of origin prefixes. Cheap to clone. The default is empty, which refuses
/// every origin.
#[derive(Debug, Clone, Default)]
pub struct OriginPolicy {
    prefixes: Arc<[OriginPrefix]>,
    role: Enforcer,
}

/// Which process enforces a policy, named in refusals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Enforcer {
    /// A transferd host.
    #[default]
    Host,
    /// The controller.
    Controller,
}

impl Enforcer {
    fn as_str(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Controller => "controller",
        }
    }
}

/// An origin that passed the policy: its location and the prefix that allowed it.
#[derive(Debug, Clone)]
pub struct Allowed {
    /// The origin's location.
    pub location: OriginLocation,
    /// The allowed prefix it lies under.
    pub prefix: OriginPrefix,
}

impl OriginPolicy {
    /// A policy of `prefixes` enforced by `role`.
    pub fn new(prefixes: Vec<OriginPrefix>, role: Enforcer) -> Self {
        Self {
            prefixes: prefixes.into(),
            role,
        }
    }

    /// Parses allow-list entries; each entry may itself hold several comma-separated
    /// prefixes (as an environment variable does). Blank entries are ignored.
    pub fn parse<S: AsRef<str>>(
        entries: impl IntoIterator<Item = S>,
        role: Enforcer,
    ) -> Result<Self, PolicyError> {
        let mut prefixes = Vec::new();
        for entry in entries {
            for p in entry.as_ref().split(',') {
                let p = p.trim();
                if !p.is_empty() {
                    prefixes.push(OriginPrefix::parse(p)?);
                }
            }
        }
        Ok(Self::new(prefixes, role))
    }

    /// The allowed prefixes.
    pub fn prefixes(&self) -> &[OriginPrefix] {
        &self.prefixes
    }

    /// Whether nothing is allowed.
    pub fn is_empty(&self) -> bool {
        self.prefixes.is_empty()
    }

    /// The prefixes, comma-separated, for messages.
    pub fn describe(&self) -> String {
        let v: Vec<String> = self.prefixes.iter().map(ToString::to_string).collect();
        if v.is_empty() {
            "none".into()
        } else {
            v.join(", ")
        }
    }

    /// Parses `uri` and checks it against the allow-list (rules 1–4 of the module docs).
    pub fn check(&self, uri: &str) -> Result<Allowed, PolicyError> {
        let location = OriginLocation::parse(uri)?;
        self.check_location(uri, location)
    }

    /// Checks an already parsed location; `uri` is named in errors.
    pub fn check_location(
        &self,
        uri: &str,
        location: OriginLocation,
    ) -> Result<Allowed, PolicyError> {
        if self.prefixes.is_empty() {
            return Err(PolicyError::NothingAllowed {
                uri: uri.to_string(),
                role: self.role.as_str(),
            });
        }
        // The longest matching prefix decides which part of the path is "below" it.
        let prefix = self
            .prefixes
            .iter()
            .filter(|p| location.under(&p.location))
            .max_by_key(|p| p.location.segments.len())
            .ok_or_else(|| PolicyError::NotAllowed {
                uri: uri.to_string(),
                role: self.role.as_str(),
                allowed: self.describe(),
            })?;
        let below = &location.segments[prefix.location.segments.len()..];
        if let Some(dot) = below.iter().find(|s| s.starts_with('.')) {
            return Err(PolicyError::DotSegment {
                uri: uri.to_string(),
                segment: dot.clone(),
            });
        }
        Ok(Allowed {
            location,
            prefix: prefix.clone(),
        })
    }

    /// Whether a network connection to `addr` is allowed: any address that is not
    /// [`restricted_address`], or one that an allowed prefix names literally as its host.
    pub fn permits_address(&self, addr: IpAddr) -> bool {
        !restricted_address(addr) || self.names_address(addr)
    }

    fn names_address(&self, addr: IpAddr) -> bool {
        let canon = canonical_ip(addr);
        self.prefixes.iter().any(|p| {
            matches!(&p.location.authority, Authority::Net { host: NetHost::Ip(ip), .. } if canonical_ip(*ip) == canon)
        })
    }
}

/// Checks a path relative to an origin (a shard path, or a name from an index) for hidden
/// components: no segment may start with `.`.
pub fn check_relative(uri: &str, relative: &str) -> Result<(), PolicyError> {
    match relative
        .split(['/', '\\'])
        .find(|s| s.starts_with('.') || s.is_empty())
    {
        Some(seg) => Err(PolicyError::DotSegment {
            uri: uri.to_string(),
            segment: seg.to_string(),
        }),
        None => Ok(()),
    }
}

/// Whether `addr` is an address an origin must not reach unless listed literally:
/// unspecified (`0.0.0.0/8`, `::`), loopback (`127.0.0.0/8`, `::1`), link-local
/// (`169.254.0.0/16`, which holds the AWS/GCP/Azure metadata service, and `fe80::/10`),
/// multicast and broadcast, deprecated site-local `fec0::/10`, and the metadata services
/// at `100.100.100.200` (Alibaba) and `fd00:ec2::254` (AWS over IPv6). IPv4 addresses
/// embedded in IPv6 (mapped, compatible, NAT64 `64:ff9b::/96`, 6to4 `2002::/16`) are
/// judged as the IPv4 address they carry.
pub fn restricted_address(addr: IpAddr) -> bool {
    match canonical_ip(addr) {
        IpAddr::V4(a) => restricted_v4(a),
        IpAddr::V6(a) => restricted_v6(a),
    }
}

fn restricted_v4(a: Ipv4Addr) -> bool {
    let o = a.octets();
    o[0] == 0
        || a.is_loopback()
        || a.is_link_local()
        || a.is_multicast()
        || a.is_broadcast()
        || a == Ipv4Addr::new(100, 100, 100, 200)
}

fn restricted_v6(a: Ipv6Addr) -> bool {
    let s = a.segments();
    a.is_unspecified()
        || a.is_loopback()
        || a.is_multicast()
        || (s[0] & 0xffc0) == 0xfe80
        || (s[0] & 0xffc0) == 0xfec0
        || a == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)
}

/// An IPv6 address that carries an IPv4 address, as that IPv4 address; others unchanged.
fn canonical_ip(addr: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = addr else { return addr };
    let s = v6.segments();
    let o = v6.octets();
    let v4 = |a: u8, b: u8, c: u8, d: u8| IpAddr::V4(Ipv4Addr::new(a, b, c, d));
    if let Some(v4addr) = v6.to_ipv4_mapped() {
        return IpAddr::V4(v4addr);
    }
    // IPv4-compatible (::a.b.c.d, deprecated), except :: and ::1 themselves.
    if s[..6] == [0; 6] && !(v6.is_unspecified() || v6.is_loopback()) {
        return v4(o[12], o[13], o[14], o[15]);
    }
    // NAT64 well-known prefix 64:ff9b::/96.
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return v4(o[12], o[13], o[14], o[15]);
    }
    // 6to4: 2002:AABB:CCDD::/48 carries A.B.C.D.
    if s[0] == 0x2002 {
        return v4(o[2], o[3], o[4], o[5]);
    }
    addr
}

/// S3 bucket naming rules (the part that matters for matching).
fn valid_bucket(b: &str) -> bool {
    (3..=63).contains(&b.len())
        && b.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'.')
        && !b.starts_with(['.', '-'])
        && !b.contains("..")
}

/// Hugging Face organisation and repository names: 1-96 letters, digits, `-`, `_`, `.`, not
/// starting with `.` or `-`.
fn valid_hub_name(n: &str) -> bool {
    (1..=96).contains(&n.len())
        && n.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && !n.starts_with(['.', '-'])
}

/// A Hugging Face revision as accepted here: a branch, tag or commit name of letters,
/// digits, `-`, `_`, `.` (names with `/`, such as `refs/pr/1`, are not supported).
fn valid_hub_revision(r: &str) -> bool {
    (1..=255).contains(&r.len())
        && r.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && !r.starts_with('.')
        && !r.contains("..")
}

/// Decodes `%XX` escapes; `None` if an escape is malformed or the result is not UTF-8.
pub fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Percent-encodes what cannot appear literally in a path segment.
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn commit_ids_are_full_hex_hashes() {
        assert!(is_commit_id(SHA));
        assert!(is_commit_id(&"ab".repeat(32)));
        for not in [
            "main",
            "v1.0",
            "0123abcd",
            &SHA[1..],
            &format!("{SHA}0"),
            "../../x",
        ] {
            assert!(!is_commit_id(not), "{not}");
        }
    }

    #[test]
    fn only_the_same_hub_repository_at_a_full_commit_pins_an_origin() {
        let loc = |s: &str| OriginLocation::parse(s).unwrap();
        let pinned = loc(&format!("hf://acme/tiny@{SHA}"));
        for origin in [
            "hf://acme/tiny",
            "hf://acme/tiny@main",
            "hf://acme/tiny@v1.0",
        ] {
            assert!(pinned.pins(&loc(origin)), "{origin}");
        }
        let long = loc(&format!("hf://acme/tiny@{}", "ab".repeat(32)));
        assert!(long.pins(&loc("hf://acme/tiny@main")));
        for resolved in [
            format!("hf://acme/other@{SHA}"),
            format!("hf://acme/tiny-2@{SHA}"),
            format!("hf://other/tiny@{SHA}"),
            "hf://acme/tiny@main".to_string(),
            format!("hf://acme/tiny@{}", &SHA[1..]),
            format!("hf://acme/tiny@{}g", &SHA[1..]),
            "hf://acme/tiny".to_string(),
            format!("s3://acme/tiny@{SHA}"),
            format!("file:///acme/tiny@{SHA}"),
        ] {
            assert!(
                !loc(&resolved).pins(&loc("hf://acme/tiny@main")),
                "{resolved}"
            );
        }
        // Only Hub origins are pinned.
        assert!(!pinned.pins(&loc("file:///m/")));
        assert!(!pinned.pins(&loc("https://h/m/")));
    }
    use proptest::prelude::*;

    fn policy(entries: &[&str]) -> OriginPolicy {
        OriginPolicy::parse(entries, Enforcer::Host).unwrap()
    }

    #[test]
    fn prefixes_match_segment_by_segment() {
        let p = policy(&["file:///data/models", "https://Models.Example.com/org/"]);
        for ok in [
            "file:///data/models",
            "file:///data/models/",
            "file:///data/models/llama",
            "file:///data/models/llama/model.safetensors",
            "https://models.example.com/org/llama/",
            "https://models.example.com:443/org/x.bin",
            "HTTPS://MODELS.EXAMPLE.COM/org/a%20b/",
        ] {
            p.check(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "file:///data/models-evil",
            "file:///data/model",
            "file:///data",
            "file:///etc/passwd",
            "https://models.example.com/org-evil/x",
            "https://models.example.com/other/",
            "http://models.example.com/org/x",
            "https://models.example.com:8443/org/x",
            "https://models.example.com.evil.net/org/x",
            "https://evil.net/org/",
        ] {
            let e = p.check(bad).unwrap_err();
            assert!(matches!(e, PolicyError::NotAllowed { .. }), "{bad}: {e}");
            assert!(e.to_string().contains("--origin-allow"), "{e}");
        }
    }

    #[test]
    fn traversal_and_encoding_tricks_are_refused() {
        let p = policy(&["file:///data/models/", "http://127.0.0.1:8080/m/"]);
        for bad in [
            "file:///data/models/../../etc/passwd",
            "file:///data/models/%2e%2e/%2E%2E/etc/passwd",
            "file:///data/models/./x",
            "file:///data/models/x/..",
            "file:///data/models/a%2fb",
            "file:///data/models/a%5c..",
            "file:///data/models//x",
            "http://127.0.0.1:8080/m/..%2f..%2fsecret",
            "http://127.0.0.1:8080/m/%2e%2e/x",
            "http://127.0.0.1:8080/m\\..\\x",
            "http://user:pw@127.0.0.1:8080/m/x",
            "file:///data/models/x%00y",
            "file:///data/models/%ff",
        ] {
            let e = p.check(bad).unwrap_err();
            assert!(matches!(e, PolicyError::Invalid { .. }), "{bad}: {e}");
        }
    }

    #[test]
    fn dot_files_below_the_prefix_are_refused() {
        let p = policy(&["file:///tmp/.tmpAbC/", "https://h.example/"]);
        p.check("file:///tmp/.tmpAbC/model").unwrap();
        for bad in [
            "file:///tmp/.tmpAbC/.git/config",
            "file:///tmp/.tmpAbC/m/.env",
            "https://h.example/.git/",
            "https://h.example/org/%2Essh/id",
        ] {
            let e = p.check(bad).unwrap_err();
            assert!(matches!(e, PolicyError::DotSegment { .. }), "{bad}: {e}");
        }
        assert!(check_relative("u", "a/.env").is_err());
        assert!(check_relative("u", "a/b.safetensors").is_ok());
        assert!(check_relative("u", "a//b").is_err());
    }

    #[test]
    fn empty_policy_refuses_with_a_hint() {
        let e = OriginPolicy::default().check("file:///data/m").unwrap_err();
        assert!(matches!(e, PolicyError::NothingAllowed { .. }), "{e}");
        assert!(e.to_string().contains("SHARDCAST_ORIGIN_ALLOW"), "{e}");
    }

    #[test]
    fn bad_entries_and_schemes() {
        for bad in [
            "ftp://x/y",
            "/abs/path",
            "model",
            "file://relative/path",
            "http://",
        ] {
            assert!(OriginPrefix::parse(bad).is_err(), "{bad}");
        }
        assert!(OriginPrefix::parse("file:///").is_err());
        let p = policy(&["s3://my-bucket/models/", " , "]);
        assert_eq!(p.prefixes().len(), 1);
        p.check("s3://my-bucket/models/llama/").unwrap();
        assert!(p.check("s3://my-bucket-2/models/").is_err());
        assert!(p.check("s3://other/models/").is_err());
        let p = policy(&["file:///a,http://h:81/x/"]);
        assert_eq!(p.describe(), "file:///a/, http://h:81/x/");
    }

    #[test]
    fn restricted_addresses() {
        for a in [
            "127.0.0.1",
            "127.8.9.10",
            "0.0.0.0",
            "169.254.169.254",
            "100.100.100.200",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fe80::1",
            "fd00:ec2::254",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "::127.0.0.1",
        ] {
            assert!(restricted_address(a.parse().unwrap()), "{a}");
        }
        for a in [
            "10.0.0.1",
            "192.168.1.1",
            "8.8.8.8",
            "fd12::1",
            "2001:db8::1",
        ] {
            assert!(!restricted_address(a.parse().unwrap()), "{a}");
        }
        let p = policy(&["http://127.0.0.1:9000/", "http://localhost:9000/"]);
        assert!(p.permits_address("127.0.0.1".parse().unwrap()));
        assert!(p.permits_address("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!p.permits_address("127.0.0.2".parse().unwrap()));
        assert!(!p.permits_address("169.254.169.254".parse().unwrap()));
        let p = policy(&["http://localhost:9000/"]);
        assert!(!p.permits_address("127.0.0.1".parse().unwrap()));
        // Numeric host spellings normalise to the same address.
        let p = policy(&["http://127.0.0.1:9000/"]);
        p.check("http://2130706433:9000/x").unwrap();
    }

    fn segment() -> impl Strategy<Value = String> {
        "[a-z0-9_-]{1,6}(\\.[a-z]{1,3})?"
    }

    proptest! {
        /// A location is under a prefix exactly when the prefix's segments are a leading
        /// run of its segments: no string-prefix confusion (`models` vs `models-evil`).
        #[test]
        fn matching_is_segment_prefix(
            base in prop::collection::vec(segment(), 1..4),
            rest in prop::collection::vec(segment(), 0..4),
            suffix in "[a-z0-9-]{1,4}",
        ) {
            let prefix = format!("file:///{}", base.join("/"));
            let p = policy(&[&prefix]);
            let inside = format!("{prefix}/{}", rest.join("/"));
            let inside = inside.trim_end_matches('/');
            prop_assert!(p.check(inside).is_ok(), "{} under {}", inside, prefix);
            // Extending the last segment of the prefix leaves it.
            let evil = format!("{prefix}{suffix}/{}", rest.join("/"));
            prop_assert!(p.check(evil.trim_end_matches('/')).is_err(), "{}", evil);
            // Parent directories are outside.
            if base.len() > 1 {
                let parent = format!("file:///{}", base[..base.len() - 1].join("/"));
                prop_assert!(p.check(&parent).is_err());
            }
            // Parsing is stable: the displayed form parses to the same location.
            let loc = OriginLocation::parse(inside).unwrap();
            prop_assert_eq!(OriginLocation::parse(&loc.to_string()).unwrap(), loc);
        }

        /// Arbitrary text never panics the parser or the checker.
        #[test]
        fn arbitrary_input_never_panics(s in ".{0,80}", t in "(file|http|https|s3)://[ -~]{0,60}") {
            let p = policy(&["file:///data/", "http://h.example/x/"]);
            let _ = p.check(&s);
            let _ = p.check(&t);
        }
    }

    #[test]
    fn hugging_face_repositories() {
        let p = policy(&["hf://acme/", "hf://Other/model@v1"]);
        let ok = p.check("hf://acme/llama@main").unwrap();
        assert_eq!(ok.location.segments(), ["llama"]);
        assert_eq!(ok.location.revision(), Some("main"));
        assert_eq!(ok.location.to_string(), "hf://acme/llama@main");
        assert!(
            p.check("hf://acme/llama")
                .unwrap()
                .location
                .revision()
                .is_none()
        );
        assert!(p.check("hf://Other/model@v1").is_ok());
        // A prefix with a revision allows only that revision; org names keep their case.
        assert!(matches!(
            p.check("hf://Other/model@main"),
            Err(PolicyError::NotAllowed { .. })
        ));
        assert!(matches!(
            p.check("hf://other/model@v1"),
            Err(PolicyError::NotAllowed { .. })
        ));
        assert!(matches!(
            p.check("hf://acme-evil/llama"),
            Err(PolicyError::NotAllowed { .. })
        ));
        for bad in [
            "hf://acme/llama/extra",
            "hf://acme/llama@",
            "hf://acme/llama@a/b",
            "hf://acme/.hidden",
            "hf://acme/llama@..",
            "hf://-acme/llama",
        ] {
            assert!(
                matches!(p.check(bad), Err(PolicyError::Invalid { .. })),
                "{bad}: {:?}",
                p.check(bad)
            );
        }
        assert_eq!(p.describe(), "hf://acme/, hf://Other/model@v1");
    }
}
