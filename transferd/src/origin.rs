//! Origins: where the first copy of a model comes from.
//!
//! An [`Origin`] is parsed from a URI and reads a model's files from one of:
//!
//! * `file:///abs/dir`: every regular file under the directory, recursively. Names starting
//!   with `.` are skipped (`.git`, `.cache`, editor droppings); a symbolic link is followed
//!   only if its target stays inside the directory; each relative path must be a valid
//!   [`ShardPath`].
//! * `file:///abs/file`: that one file, named by its file name.
//! * `http(s)://host/dir/` (ending in `/`): a Hugging Face style model directory. The shard
//!   list comes from `model.safetensors.index.json` (its `weight_map` values); without an
//!   index, `model.safetensors` alone. Sizes come from `HEAD` `Content-Length`.
//! * `http(s)://host/path/file` (not ending in `/`): that one file.
//! * `s3://bucket/prefix/`: every object under the prefix (through `object_store`; see
//!   the `s3` module for credentials, endpoints and retries); `s3://bucket/key` without the
//!   trailing `/`: that one object if it exists, else the prefix `key/`.
//! * `hf://org/name@revision`: every file of one revision of a Hugging Face Hub repository
//!   (see the `hf` module).
//!
//! Every origin is opened through [`Origin::parse`] with the host's [`OriginAccess`]: the
//! URI must pass the allow-list ([`shardcast_protocol::origin_policy`]); a `file://` path
//! must resolve (symbolic links included) beneath the allowed root, and the file actually
//! opened is checked again through `/proc/self/fd`; shard paths with a hidden (`.`)
//! component are refused; HTTP redirects are followed only while they stay inside an
//! allowed prefix, and a host name is connected to only at resolved addresses the policy
//! permits (no loopback, link-local or metadata address unless listed literally), checked
//! in the client's DNS resolver so that rebinding between check and connect cannot bypass
//! it. No proxy from the environment is used. Refusals are counted
//! ([`OriginAccess::refused`], `shardcast_origin_refused_total`) and logged with the URI.
//!
//! Who talks to whom: the publisher calls [`Origin::build_manifest`] once, streaming every
//! byte through [`ShardHasher`]; a chain head then calls [`fetch_chunks`], which issues
//! parallel range reads ([`Origin::read_range`]), verifies each chunk against the manifest,
//! retries bad ones, and hands [`VerifiedChunk`]s to the session that stores and forwards
//! them. Local reads are positional reads on the blocking pool; HTTP reads are `Range` GETs
//! through one shared `reqwest` client (connection pooling, HTTP/2 where offered).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::{StreamExt, TryStreamExt};
use reqwest::{StatusCode, Url, header};
use shardcast_protocol::manifest::{MAX_CHUNK_SIZE, MIN_CHUNK_SIZE};
use shardcast_protocol::origin_policy::{
    self, Enforcer, OriginLocation, OriginPolicy, OriginScheme, PolicyError,
};
use shardcast_protocol::{
    DecodeError, Manifest, ModelName, ShardEntry, ShardHasher, ShardPath, VerifiedChunk,
    VerifyError,
};
use tokio::sync::mpsc;

mod hf;
mod s3;

/// Attempts per chunk in [`fetch_chunks`]: the first try and 3 retries. Rationale: a flaky
/// object store or a torn read rarely fails twice in a row; a chunk that fails four times
/// points at a real mismatch between origin and manifest, which retrying will not fix.
const FETCH_ATTEMPTS: u32 = 4;

/// Base pause before the first retry of a chunk, doubled for each further one (50, 100,
/// 200 ms), each pause then drawn at random from `[base, 2 × base)` (jitter, so that hosts
/// throttled together do not retry together). Every pause thus lies within the 100, 200,
/// 400 ms of the schedule without jitter that this replaced, and a chunk's retries wait less
/// than 700 ms in all: enough for a throttling object store to recover, short next to a
/// model download.
const RETRY_BACKOFF: Duration = Duration::from_millis(50);

/// The pauses between the attempts at one chunk ([`RETRY_BACKOFF`]): exponential with
/// jitter, from `backon`, one fewer than [`FETCH_ATTEMPTS`].
fn retry_pauses() -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder as _;
    backon::ExponentialBuilder::default()
        .with_min_delay(RETRY_BACKOFF)
        .with_factor(2.0)
        .with_max_delay(RETRY_BACKOFF * 4)
        .with_max_times(FETCH_ATTEMPTS as usize - 1)
        .with_jitter()
        .build()
}

/// Limit on establishing a connection to an HTTP origin.
const HTTP_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest an HTTP response may stall between two reads before the request fails (and, in
/// [`fetch_chunks`], is retried). Generous, since a rate-capped origin shared by many hosts
/// can be slow, but finite so a dead connection cannot hang a download.
const HTTP_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Shards hashed at once by [`Origin::build_manifest`]. Rationale: enough to overlap I/O
/// latency (HTTP round trips, disk seeks) with hashing on a few cores; more only contends.
const HASH_PARALLEL: usize = 4;

/// Read size when hashing a local shard: large sequential reads, few syscalls.
const HASH_READ_SIZE: usize = 1 << 20;

/// `HEAD` requests in flight while sizing the shards of an HTTP model directory.
const HEAD_PARALLEL: usize = 8;

/// Largest `model.safetensors.index.json` accepted (32 MiB; real ones are well under 1 MiB).
const MAX_INDEX_LEN: usize = 32 << 20;

/// Name of the Hugging Face sharded-checkpoint index in an HTTP model directory.
const HF_INDEX: &str = "model.safetensors.index.json";

/// Name of the single weight file of an unsharded Hugging Face model.
const HF_SINGLE: &str = "model.safetensors";

/// Redirects followed per request (each must stay inside the allow-list). Rationale:
/// object stores redirect once or twice (region, pre-signed URL); more is a loop.
const MAX_REDIRECTS: usize = 5;

/// The host's origin policy and its refusal counter. Cheap to clone; clones share the
/// counter. The default allows nothing.
#[derive(Clone, Debug, Default)]
pub struct OriginAccess {
    policy: OriginPolicy,
    refused: Arc<AtomicU64>,
}

impl OriginAccess {
    /// Access under `policy`.
    pub fn new(policy: OriginPolicy) -> Self {
        Self {
            policy,
            refused: Arc::default(),
        }
    }

    /// The allow-list.
    pub fn policy(&self) -> &OriginPolicy {
        &self.policy
    }

    /// Origins (and redirects, resolved addresses, shard paths) refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Counts and logs a refusal.
    fn refuse(&self, e: PolicyError) -> OriginError {
        self.refused.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %e, "origin refused by policy");
        OriginError::Policy(e)
    }

    /// Checks `uri` against the allow-list, counting a refusal.
    pub fn check(&self, uri: &str) -> Result<(), OriginError> {
        self.policy.check(uri).map(drop).map_err(|e| self.refuse(e))
    }

    /// Counts a symbolic link that led outside its root as a refusal (passes others on).
    fn note(&self, e: OriginError) -> OriginError {
        if let OriginError::SymlinkEscape { .. } = &e {
            self.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "origin refused by policy");
        }
        e
    }

    /// Checks a shard path (relative to origin `uri`) for hidden components.
    fn check_relative(&self, uri: &str, path: &str) -> Result<(), OriginError> {
        origin_policy::check_relative(uri, path).map_err(|e| self.refuse(e))
    }
}

/// Why an origin operation failed.
#[derive(Debug, thiserror::Error)]
pub enum OriginError {
    /// The URI's scheme is not one shardcast reads from.
    #[error(
        "unsupported origin {uri:?}: use file:///absolute/path, http://host/path, https://host/path, s3://bucket/prefix or hf://org/name@revision"
    )]
    UnsupportedScheme {
        /// The URI as given.
        uri: String,
    },
    /// The URI has a supported scheme but cannot be used as given.
    #[error("invalid origin {uri:?}: {reason}")]
    InvalidUri {
        /// The URI as given.
        uri: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Nothing exists at the origin under that name.
    #[error("{location} not found at the origin")]
    NotFound {
        /// The path or URL looked up.
        location: String,
    },
    /// The origin holds no files that could make a model.
    #[error("origin {uri} holds no model files (names starting with '.' are skipped)")]
    Empty {
        /// The origin's URI.
        uri: String,
    },
    /// An HTTP request got a status other than the one expected.
    #[error("{url} answered HTTP {status}{}", status_hint(*status))]
    HttpStatus {
        /// The URL requested.
        url: String,
        /// The status code received.
        status: u16,
    },
    /// An HTTP request failed before a complete response arrived (connect, TLS, timeout,
    /// connection reset).
    #[error("HTTP request to {url} failed: {}", error_chain(source))]
    Http {
        /// The URL requested.
        url: String,
        /// The client's error.
        #[source]
        source: reqwest::Error,
    },
    /// An HTTP response to `HEAD` carried no usable `Content-Length`.
    #[error("{url} gives no Content-Length, so its size is unknown; serve it with one")]
    NoContentLength {
        /// The URL requested.
        url: String,
    },
    /// The origin policy refuses the URI, a redirect, a resolved address or a shard path.
    #[error("{0}")]
    Policy(#[source] PolicyError),
    /// The HTTP client could not be set up (for instance, no usable TLS roots).
    #[error("cannot set up the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// A range read returned a different number of bytes than asked for.
    #[error(
        "short read from {location}: asked for {expected} bytes at offset {offset}, got {got}; \
         the file is shorter than the manifest says or the server ignored the range"
    )]
    ShortRead {
        /// The path or URL read.
        location: String,
        /// Offset of the read.
        offset: u64,
        /// Bytes asked for.
        expected: u64,
        /// Bytes received (more than `expected` if the server sent too much).
        got: u64,
    },
    /// A file's size differs from the size it was listed with: the origin changed while it
    /// was being read.
    #[error(
        "{location} was listed as {expected} bytes but {actual} bytes were read; the origin \
         changed while it was read, retry once it is stable"
    )]
    SizeMismatch {
        /// The path or URL read.
        location: String,
        /// Size when listed.
        expected: u64,
        /// Bytes actually read.
        actual: u64,
    },
    /// A local file-system operation failed.
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        /// What was being done ("open", "read", "list").
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// A file at the origin has a name that cannot be a shard path.
    #[error("origin file {path:?} cannot be a shard: {reason}; rename it or move it out")]
    BadName {
        /// The file's path relative to the origin (lossily decoded if not UTF-8).
        path: String,
        /// Why it is refused.
        reason: String,
    },
    /// A symbolic link under an origin directory points outside it.
    #[error(
        "{} is a symbolic link to {}, outside the origin directory {}; copy the file in or \
         point the origin at a directory that holds it",
        path.display(), target.display(), root.display()
    )]
    SymlinkEscape {
        /// The link.
        path: PathBuf,
        /// Where it resolves to.
        target: PathBuf,
        /// The origin directory.
        root: PathBuf,
    },
    /// The Hugging Face index of an HTTP model directory is not usable.
    #[error(
        "{url} is not a usable safetensors index (expected {{\"weight_map\": {{\"tensor\": \"file\"}}}}): {reason}"
    )]
    BadIndex {
        /// The index URL.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The origin's files do not make a valid manifest (bad chunk size, too many shards or
    /// chunks).
    #[error("cannot build a manifest: {0}")]
    Manifest(#[source] DecodeError),
    /// A shard or chunk asked for is not in the manifest.
    #[error("not in the manifest: {0}")]
    NotInManifest(#[source] VerifyError),
    /// A chunk read from the origin kept failing verification against the manifest.
    #[error(
        "chunk {shard}/{index} of {location} failed verification {attempts} times ({source}); \
         the origin's copy differs from the manifest, so republish the model"
    )]
    Corrupt {
        /// The path or URL read.
        location: String,
        /// Shard index.
        shard: u32,
        /// Chunk index.
        index: u32,
        /// Attempts made.
        attempts: u32,
        /// The last verification failure.
        #[source]
        source: VerifyError,
    },
    /// An `hf://` branch or tag now names a commit that does not hold a shard as the
    /// manifest has it: the revision moved since the model was imported.
    #[error(
        "hf://{repo} now names commit {commit}, where {detail}: the revision moved since the \
         model's manifest was built; import the model again to take the new commit, or read \
         the commit it was built from by naming it (hf://org/name@<commit>, logged by the \
         host that imported it)"
    )]
    RevisionMoved {
        /// `org/name@revision`.
        repo: String,
        /// The commit the revision names now.
        commit: String,
        /// What differs from the manifest.
        detail: String,
    },
    /// An object store (S3) has no object under that key, or the bucket does not exist.
    #[error("no such object {uri}")]
    NoSuchObject {
        /// `s3://bucket/key`, with what was missing.
        uri: String,
    },
    /// The origin refused the credentials (or their absence).
    #[error("access denied to {uri} (check credentials: {hint}): {detail}")]
    AccessDenied {
        /// The object or repository.
        uri: String,
        /// Which credentials are used and where they come from.
        hint: &'static str,
        /// The origin's answer.
        detail: String,
    },
    /// An object store request failed after `object_store`'s own retries.
    #[error("object store request for {uri} failed: {}", error_chain(source))]
    ObjectStore {
        /// The object.
        uri: String,
        /// The client's error.
        #[source]
        source: object_store::Error,
    },
    /// A background read task panicked or was cancelled.
    #[error("a background read task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
}

/// A hint after an unexpected HTTP status, saying what to check.
fn status_hint(status: u16) -> &'static str {
    match status {
        401 | 403 => " (access denied: check that the URL is public or pre-signed and not expired)",
        404 | 410 => " (not found: check the URL)",
        416 => " (range not satisfiable: the file is shorter than the manifest says)",
        408 | 429 => " (the origin is throttling; retry later or lower the fetch parallelism)",
        500..=599 => " (the origin failed; retry later)",
        _ => "",
    }
}

impl OriginError {
    /// `uri` cannot be used as an origin, for `reason`.
    pub(crate) fn invalid_uri(uri: &str, reason: impl Into<String>) -> Self {
        Self::InvalidUri {
            uri: uri.to_string(),
            reason: reason.into(),
        }
    }

    /// Whether trying the same read again might succeed.
    fn is_transient(&self) -> bool {
        match self {
            Self::Http { .. }
            | Self::ShortRead { .. }
            | Self::Corrupt { .. }
            | Self::Io { .. }
            | Self::ObjectStore { .. }
            | Self::Task(_) => true,
            Self::HttpStatus { status, .. } => matches!(status, 408 | 429 | 500..=599),
            _ => false,
        }
    }
}

/// Where the first copy of a model comes from. Cheap to clone; clones share the HTTP
/// connection pool and the [`Origin::bytes_read`] counter.
#[derive(Clone, Debug)]
pub struct Origin {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    uri: String,
    source: Source,
    bytes_read: AtomicU64,
    access: OriginAccess,
}

#[derive(Debug)]
enum Source {
    /// A local file or directory; which one is decided when it is read, so an origin can be
    /// configured before its mount is up. `root` is the allowed prefix it lies under:
    /// everything read must resolve beneath it.
    Local { path: PathBuf, root: PathBuf },
    /// An HTTP directory; `base` ends in `/`.
    HttpDir { client: reqwest::Client, base: Url },
    /// One file over HTTP.
    HttpFile {
        client: reqwest::Client,
        url: Url,
        name: ShardPath,
    },
    /// An S3 bucket and prefix.
    S3(s3::S3Source),
    /// A Hugging Face Hub repository revision.
    Hf(hf::HfSource),
}

impl Origin {
    /// Parses an origin URI (`file:///abs/dir`, `file:///abs/file`, `http(s)://…/dir/`,
    /// `http(s)://…/file`, `s3://bucket/prefix` or `hf://org/name@revision`) and checks it
    /// against `access`'s allow-list before anything else. Does no network I/O (an `hf://`
    /// origin reads its token file); every later read is checked again (symbolic links,
    /// redirects, resolved addresses).
    pub fn parse(uri: &str, access: &OriginAccess) -> Result<Self, OriginError> {
        let invalid = |reason: String| OriginError::invalid_uri(uri, reason);
        let location = OriginLocation::parse(uri).map_err(|e| match e {
            PolicyError::Invalid { reason, .. } => invalid(reason),
            _ => OriginError::UnsupportedScheme {
                uri: uri.to_string(),
            },
        })?;
        let allowed = access
            .policy
            .check_location(uri, location)
            .map_err(|e| access.refuse(e))?;
        let source = match allowed.location.scheme() {
            OriginScheme::File => {
                let (Some(path), Some(root)) =
                    (allowed.location.local_path(), allowed.prefix.local_root())
                else {
                    return Err(invalid("not a local path".into()));
                };
                Source::Local {
                    path: PathBuf::from(path),
                    root: PathBuf::from(root),
                }
            }
            OriginScheme::Http | OriginScheme::Https => {
                let url = Url::parse(uri).map_err(|e| invalid(e.to_string()))?;
                let client = http_client(access)?;
                if url.path().ends_with('/') {
                    Source::HttpDir { client, base: url }
                } else {
                    let name = allowed
                        .location
                        .segments()
                        .last()
                        .cloned()
                        .ok_or_else(|| invalid("the URL names no file".into()))?;
                    let name = ShardPath::new(name).map_err(|e| {
                        invalid(format!("the file name cannot be a shard path: {e}"))
                    })?;
                    Source::HttpFile { client, url, name }
                }
            }
            OriginScheme::S3 => Source::S3(s3::S3Source::open(uri, &allowed.location, access)?),
            OriginScheme::Hf => Source::Hf(hf::HfSource::open(uri, &allowed.location, access)?),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                uri: uri.to_string(),
                source,
                bytes_read: AtomicU64::new(0),
                access: access.clone(),
            }),
        })
    }

    /// The URI this origin was parsed from.
    pub fn uri(&self) -> &str {
        &self.inner.uri
    }

    /// The URI that names exactly what this origin has read, where the origin can name an
    /// immutable version and it differs from the URI given: `hf://org/name@<commit>` for a
    /// Hub revision (a branch or tag) once listed. `None` for every other origin.
    pub fn resolved_uri(&self) -> Option<String> {
        match &self.inner.source {
            Source::Hf(hf) => hf
                .resolved_uri()
                .filter(|resolved| *resolved != self.inner.uri),
            _ => None,
        }
    }

    /// Payload bytes read from the origin so far (manifest hashing and range reads).
    pub fn bytes_read(&self) -> u64 {
        self.inner.bytes_read.load(Ordering::Relaxed)
    }

    /// A local directory this host wrote itself (bytes kept while building a manifest),
    /// read back as an origin. Not subject to the allow-list: the path is the store's, not
    /// a caller's; reads still resolve beneath it with no symlinks.
    pub fn staged(dir: PathBuf) -> Self {
        Self {
            inner: Arc::new(Inner {
                uri: format!("file://{}", dir.display()),
                source: Source::Local {
                    path: dir.clone(),
                    root: dir,
                },
                bytes_read: AtomicU64::new(0),
                access: OriginAccess::new(OriginPolicy::new(Vec::new(), Enforcer::Host)),
            }),
        }
    }

    fn count(&self, n: usize) {
        self.inner.bytes_read.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The model's files and their sizes, sorted by path.
    pub async fn list(&self) -> Result<Vec<(ShardPath, u64)>, OriginError> {
        let mut files = match &self.inner.source {
            Source::Local { path, root } => {
                let (path, root) = (path.clone(), root.clone());
                blocking(move || list_local(&path, &root))
                    .await
                    .map_err(|e| self.inner.access.note(e))?
            }
            Source::HttpDir { client, base } => list_http_dir(client, base).await?,
            Source::HttpFile { client, url, name } => {
                vec![(name.clone(), head_size(client, url).await?)]
            }
            Source::S3(s3) => s3.list().await?,
            Source::Hf(hf) => hf.list().await?,
        };
        if files.is_empty() {
            return Err(OriginError::Empty {
                uri: self.inner.uri.clone(),
            });
        }
        files.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(files)
    }

    /// Builds the model's manifest, reading every byte once through [`ShardHasher`] (a few
    /// shards at a time). `progress` is called with the bytes hashed so far.
    pub async fn build_manifest(
        &self,
        name: ModelName,
        chunk_size: u32,
        progress: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<Manifest, OriginError> {
        self.build_manifest_keeping(name, chunk_size, progress, None)
            .await
            .map(|(m, _)| m)
    }

    /// [`build_manifest`](Self::build_manifest), writing every byte read into the file
    /// `keep` opens for its shard as well, so the model need not be read from the origin a
    /// second time. Keeping is best effort: a shard whose file cannot be opened or written
    /// is only hashed (logged). Returns the manifest and whether every shard was kept whole.
    pub async fn build_manifest_keeping(
        &self,
        name: ModelName,
        chunk_size: u32,
        progress: &(dyn Fn(u64) + Send + Sync),
        keep: Option<&dyn KeepSink>,
    ) -> Result<(Manifest, bool), OriginError> {
        // Refuse a bad chunk size before reading possibly hundreds of GiB.
        if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&chunk_size) {
            return Err(OriginError::Manifest(DecodeError::Invalid {
                field: "chunk_size",
                reason: format!("{chunk_size} is outside {MIN_CHUNK_SIZE}..={MAX_CHUNK_SIZE}"),
            }));
        }
        let files = self.list().await?;
        let (progress_tx, mut progress_rx) = mpsc::unbounded_channel::<u64>();
        let hashing = futures::stream::iter(files)
            .map(|(path, size)| {
                let tee = Tee::open(keep, &path);
                self.hash_shard(path, size, chunk_size, progress_tx.clone(), tee)
            })
            .buffered(HASH_PARALLEL)
            .try_collect::<Vec<(ShardEntry, bool)>>();
        let mut hashing = pin!(hashing);
        let mut done = 0u64;
        let shards = loop {
            tokio::select! {
                biased;
                Some(n) = progress_rx.recv() => {
                    done += n;
                    progress(done);
                }
                shards = &mut hashing => break shards?,
            }
        };
        while let Ok(n) = progress_rx.try_recv() {
            done += n;
            progress(done);
        }
        let kept = keep.is_some() && shards.iter().all(|(_, kept)| *kept);
        let shards = shards.into_iter().map(|(e, _)| e).collect();
        let manifest = Manifest::new(name, chunk_size, shards).map_err(OriginError::Manifest)?;
        if let Source::Hf(hf) = &self.inner.source {
            // Later reads of this model on this host use the commit it was built from.
            hf.remember(manifest.digest());
        }
        Ok((manifest, kept))
    }

    /// Hashes one shard, sending the byte count of each piece read on `progress` and
    /// writing each piece to `tee`. Returns its entry and whether `tee` kept it whole.
    async fn hash_shard(
        &self,
        path: ShardPath,
        size: u64,
        chunk_size: u32,
        progress: mpsc::UnboundedSender<u64>,
        mut tee: Tee,
    ) -> Result<(ShardEntry, bool), OriginError> {
        let mut hasher = ShardHasher::new(chunk_size);
        self.check_shard(&path)?;
        let (location, read) = match &self.inner.source {
            Source::Local { path: origin, root } => {
                // The blocking task stops at its next read if this future is dropped.
                let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
                let (dir, root, shard, origin) =
                    (origin.clone(), root.clone(), path.clone(), self.clone());
                let stop_flag = stop.0.clone();
                let (file, hasher, read, tee) = blocking(move || {
                    let (file, root) = resolve_local(&dir, &root, &shard)?;
                    let mut f = open_beneath(&file, &root)?;
                    let mut buf = vec![0u8; HASH_READ_SIZE];
                    let mut read = 0u64;
                    while !stop_flag.load(Ordering::Relaxed) {
                        let n = match f.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => n,
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                            Err(e) => return Err(io_err("read", &file, e)),
                        };
                        hasher.update(&buf[..n]);
                        tee.write(&buf[..n]);
                        read += n as u64;
                        origin.count(n);
                        let _ = progress.send(n as u64);
                    }
                    Ok((file, hasher, read, tee))
                })
                .await
                .map_err(|e| self.inner.access.note(e))?;
                drop(stop);
                let kept = tee.finish(&path, read);
                return finish_shard(file.display().to_string(), hasher, read, size, path)
                    .map(|e| (e, kept));
            }
            Source::HttpDir { client, base } => {
                let url = shard_url(base, path.as_str())?;
                let read = self.stream_http(client, &url, |piece| {
                    hasher.update(piece);
                    tee.write(piece);
                    let _ = progress.send(piece.len() as u64);
                });
                (url.to_string(), read.await?)
            }
            Source::HttpFile { client, url, name } => {
                if *name != path {
                    return Err(self.not_found(&path));
                }
                let read = self.stream_http(client, url, |piece| {
                    hasher.update(piece);
                    tee.write(piece);
                    let _ = progress.send(piece.len() as u64);
                });
                (url.to_string(), read.await?)
            }
            Source::S3(s3) => {
                s3.stream(&path, |piece| {
                    hasher.update(piece);
                    tee.write(piece);
                    self.count(piece.len());
                    let _ = progress.send(piece.len() as u64);
                })
                .await?
            }
            Source::Hf(hf) => {
                let url = hf.url(&path)?;
                let read = self.stream_http(&hf.client, &url, |piece| {
                    hasher.update(piece);
                    tee.write(piece);
                    let _ = progress.send(piece.len() as u64);
                });
                (url.to_string(), read.await.map_err(|e| hf.error(e))?)
            }
        };
        let kept = tee.finish(&path, read);
        finish_shard(location, hasher, read, size, path).map(|e| (e, kept))
    }

    /// GETs `url` whole, handing each piece of the body to `each`; returns the byte count.
    async fn stream_http(
        &self,
        client: &reqwest::Client,
        url: &Url,
        mut each: impl FnMut(&[u8]),
    ) -> Result<u64, OriginError> {
        let mut resp = client
            .get(url.clone())
            .send()
            .await
            .map_err(|e| http_err(url, e))?;
        check_status(&resp, url, StatusCode::OK)?;
        let mut read = 0u64;
        while let Some(piece) = resp.chunk().await.map_err(|e| http_err(url, e))? {
            each(&piece);
            read += piece.len() as u64;
            self.count(piece.len());
        }
        Ok(read)
    }

    /// Reads `len` bytes at `offset` of `path`. Fails with [`OriginError::ShortRead`] unless
    /// exactly `len` bytes come back. `len` is allocated up front: callers pass chunk sizes.
    pub async fn read_range(
        &self,
        path: &ShardPath,
        offset: u64,
        len: usize,
    ) -> Result<Bytes, OriginError> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        self.check_shard(path)?;
        match &self.inner.source {
            Source::Local { path: dir, root } => {
                let (dir, root, shard, origin) =
                    (dir.clone(), root.clone(), path.clone(), self.clone());
                blocking(move || {
                    let (file, root) = resolve_local(&dir, &root, &shard)?;
                    let data = read_local_range(&file, &root, offset, len)?;
                    origin.count(data.len());
                    Ok(data)
                })
                .await
                .map_err(|e| self.inner.access.note(e))
            }
            Source::HttpDir { client, base } => {
                let url = shard_url(base, path.as_str())?;
                self.read_http_range(client, &url, offset, len).await
            }
            Source::HttpFile { client, url, name } => {
                if name != path {
                    return Err(self.not_found(path));
                }
                self.read_http_range(client, url, offset, len).await
            }
            Source::S3(s3) => {
                let data = s3.read_range(path, offset, len).await?;
                self.count(data.len());
                Ok(data)
            }
            Source::Hf(hf) => {
                let url = hf.url(path)?;
                self.read_http_range(&hf.client, &url, offset, len)
                    .await
                    .map_err(|e| hf.error(e))
            }
        }
    }

    async fn read_http_range(
        &self,
        client: &reqwest::Client,
        url: &Url,
        offset: u64,
        len: usize,
    ) -> Result<Bytes, OriginError> {
        let short = |got: u64| OriginError::ShortRead {
            location: url.to_string(),
            offset,
            expected: len as u64,
            got,
        };
        let last = offset.checked_add(len as u64 - 1).ok_or_else(|| short(0))?;
        let mut resp = client
            .get(url.clone())
            .header(header::RANGE, format!("bytes={offset}-{last}"))
            .send()
            .await
            .map_err(|e| http_err(url, e))?;
        match resp.status() {
            StatusCode::PARTIAL_CONTENT => {
                // A server answering another range than asked would hand us the wrong bytes.
                let start = resp
                    .headers()
                    .get(header::CONTENT_RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("bytes "))
                    .and_then(|v| v.split_once('-'))
                    .and_then(|(a, _)| a.trim().parse::<u64>().ok());
                if start != Some(offset) {
                    return Err(short(0));
                }
            }
            // A server without range support may send the whole file: fine if that is the
            // range asked for, which the length check below decides.
            StatusCode::OK if offset == 0 => {}
            _ => check_status(&resp, url, StatusCode::PARTIAL_CONTENT)?,
        }
        let mut buf = BytesMut::with_capacity(len);
        while let Some(piece) = resp.chunk().await.map_err(|e| http_err(url, e))? {
            if buf.len() + piece.len() > len {
                return Err(short((buf.len() + piece.len()) as u64));
            }
            buf.extend_from_slice(&piece);
            self.count(piece.len());
        }
        if buf.len() != len {
            return Err(short(buf.len() as u64));
        }
        Ok(buf.freeze())
    }

    /// Refuses a shard path with a hidden (`.`) component: a manifest from a peer or an
    /// index from an HTTP origin must not reach `.git/` or `.env` beside the weights.
    fn check_shard(&self, path: &ShardPath) -> Result<(), OriginError> {
        self.inner
            .access
            .check_relative(&self.inner.uri, path.as_str())
    }

    /// Where `path` lives at this origin, for messages.
    fn location(&self, path: &ShardPath) -> String {
        match &self.inner.source {
            Source::Local { path: root, .. } => root.join(path.as_str()).display().to_string(),
            Source::HttpDir { base, .. } => shard_url(base, path.as_str())
                .map_or_else(|_| format!("{base}{path}"), |u| u.to_string()),
            Source::HttpFile { url, .. } => url.to_string(),
            Source::S3(s3) => s3.location(path),
            Source::Hf(hf) => hf.location(path),
        }
    }

    fn not_found(&self, path: &ShardPath) -> OriginError {
        OriginError::NotFound {
            location: format!("{path} (origin {})", self.inner.uri),
        }
    }
}

/// Reads the given chunks of one shard with `parallel` concurrent range reads, verifies
/// each against the manifest ([`Manifest::verified`]), retries a chunk that fails
/// verification or errors transiently up to 3 times, and sends each [`VerifiedChunk`] on
/// `tx` as it completes (completion order, so a chain head can forward while the rest still
/// downloads). Returns the first unrecoverable error. Stops early, without error, if `tx`
/// is closed.
#[tracing::instrument(skip_all, fields(origin = origin.uri(), shard, chunks = chunks.len()))]
pub async fn fetch_chunks(
    origin: &Origin,
    manifest: Arc<Manifest>,
    shard: u32,
    chunks: Vec<u32>,
    parallel: usize,
    tx: mpsc::Sender<VerifiedChunk>,
) -> Result<(), OriginError> {
    let path = manifest
        .shard(shard)
        .map_err(OriginError::NotInManifest)?
        .path
        .clone();
    // Check every index before downloading anything.
    for &index in &chunks {
        manifest
            .chunk_span(shard, index)
            .map_err(OriginError::NotInManifest)?;
    }
    if let Source::Hf(hf) = &origin.inner.source {
        // Every chunk from one commit: the one the manifest was built from where known.
        hf.pin_for(&manifest, shard).await?;
    }
    let mut done = futures::stream::iter(chunks)
        .map(|index| fetch_verified(origin, &manifest, shard, &path, index))
        .buffer_unordered(parallel.max(1));
    loop {
        let chunk = tokio::select! {
            biased;
            () = tx.closed() => return Ok(()),
            next = done.next() => match next {
                Some(chunk) => chunk?,
                None => return Ok(()),
            },
        };
        if tx.send(chunk).await.is_err() {
            return Ok(());
        }
    }
}

/// Reads and verifies one chunk, retrying as [`fetch_chunks`] describes.
async fn fetch_verified(
    origin: &Origin,
    manifest: &Manifest,
    shard: u32,
    path: &ShardPath,
    index: u32,
) -> Result<VerifiedChunk, OriginError> {
    let (offset, len) = manifest
        .chunk_span(shard, index)
        .map_err(OriginError::NotInManifest)?;
    let mut attempts = 0;
    let mut pauses = retry_pauses();
    loop {
        attempts += 1;
        let err = match origin.read_range(path, offset, len).await {
            Ok(data) => match manifest.verified(shard, index, data) {
                Ok(chunk) => return Ok(chunk),
                Err(source) => OriginError::Corrupt {
                    location: origin.location(path),
                    shard,
                    index,
                    attempts,
                    source,
                },
            },
            Err(e) if !e.is_transient() => return Err(e),
            Err(e) => e,
        };
        let Some(pause) = pauses.next().filter(|_| attempts < FETCH_ATTEMPTS) else {
            return Err(err);
        };
        tracing::warn!(shard, index, attempts, error = %err, "origin read failed; retrying");
        tokio::time::sleep(pause).await;
    }
}

/// Sets its flag when dropped, telling a blocking task to stop.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Runs `f` on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, OriginError> + Send + 'static,
) -> Result<T, OriginError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(OriginError::Task)?
}

/// Where [`Origin::build_manifest_keeping`] keeps what it reads: one file per shard.
pub trait KeepSink: Send + Sync {
    /// A new, empty file for `shard`'s bytes.
    fn open(&self, shard: &ShardPath) -> io::Result<std::fs::File>;
}

/// One shard's copy while it is hashed: best effort, so the first failed write drops the
/// file and the shard is only hashed.
struct Tee {
    file: Option<std::fs::File>,
    failed: Option<io::Error>,
}

impl Tee {
    fn open(keep: Option<&dyn KeepSink>, shard: &ShardPath) -> Self {
        let Some(keep) = keep else {
            return Self {
                file: None,
                failed: None,
            };
        };
        match keep.open(shard) {
            Ok(f) => Self {
                file: Some(f),
                failed: None,
            },
            Err(e) => Self {
                file: None,
                failed: Some(e),
            },
        }
    }

    fn write(&mut self, piece: &[u8]) {
        use std::io::Write;
        if let Some(f) = &mut self.file
            && let Err(e) = f.write_all(piece)
        {
            self.file = None;
            self.failed = Some(e);
        }
    }

    /// True when all `read` bytes were kept; a failure is logged once here.
    fn finish(self, shard: &ShardPath, read: u64) -> bool {
        if let Some(e) = self.failed {
            tracing::warn!(shard = %shard, bytes = read, "not keeping the shard read to build the manifest (it will be read again when fetched): {e}");
            return false;
        }
        self.file.is_some()
    }
}

fn finish_shard(
    location: String,
    hasher: ShardHasher,
    read: u64,
    size: u64,
    path: ShardPath,
) -> Result<ShardEntry, OriginError> {
    if read != size {
        return Err(OriginError::SizeMismatch {
            location,
            expected: size,
            actual: read,
        });
    }
    Ok(hasher.finish(path))
}

fn io_err(op: &'static str, path: &Path, source: io::Error) -> OriginError {
    if source.kind() == io::ErrorKind::NotFound {
        OriginError::NotFound {
            location: path.display().to_string(),
        }
    } else {
        OriginError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// `path` resolved (links followed), refused unless it lies beneath the allowed `root`
/// (resolved the same way: an operator may allow a root that is itself a link). Returns
/// the resolved path and the resolved root.
fn beneath_root(path: &Path, root: &Path) -> Result<(PathBuf, PathBuf), OriginError> {
    let root = std::fs::canonicalize(root).map_err(|e| io_err("resolve", root, e))?;
    let target = std::fs::canonicalize(path).map_err(|e| io_err("resolve", path, e))?;
    if !target.starts_with(&root) {
        return Err(OriginError::SymlinkEscape {
            path: path.to_path_buf(),
            target,
            root,
        });
    }
    Ok((target, root))
}

/// Opens `file` (already resolved beneath `root`) without following a final symbolic link,
/// then checks the path the kernel actually opened, so a link swapped in after resolution
/// cannot lead outside `root`.
fn open_beneath(file: &Path, root: &Path) -> Result<std::fs::File, OriginError> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(file)
        .map_err(|e| io_err("open", file, e))?;
    use std::os::fd::AsRawFd;
    let proc_path = PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
    // Without /proc (unusual on Linux) the resolution above stands on its own.
    if let Ok(actual) = std::fs::read_link(&proc_path)
        && !actual.starts_with(root)
    {
        return Err(OriginError::SymlinkEscape {
            path: file.to_path_buf(),
            target: actual,
            root: root.to_path_buf(),
        });
    }
    Ok(f)
}

/// Lists a local origin: the file itself, or every regular file under the directory.
/// Everything must resolve beneath the allowed `allowed_root`.
fn list_local(path: &Path, allowed_root: &Path) -> Result<Vec<(ShardPath, u64)>, OriginError> {
    let md = std::fs::metadata(path).map_err(|e| io_err("inspect", path, e))?;
    beneath_root(path, allowed_root)?;
    if md.is_file() {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let shard = ShardPath::new(name.as_ref()).map_err(|e| OriginError::BadName {
            path: name.to_string(),
            reason: e.to_string(),
        })?;
        return Ok(vec![(shard, md.len())]);
    }
    if !md.is_dir() {
        return Err(OriginError::InvalidUri {
            uri: path.display().to_string(),
            reason: "neither a regular file nor a directory".into(),
        });
    }
    let root = std::fs::canonicalize(path).map_err(|e| io_err("resolve", path, e))?;
    let mut files = Vec::new();
    let mut dirs = vec![(root.clone(), String::new())];
    while let Some((dir, prefix)) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| io_err("list", &dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| io_err("list", &dir, e))?;
            let name = entry.file_name();
            let rel = format!("{prefix}{}", name.to_string_lossy());
            let Some(name) = name.to_str() else {
                return Err(OriginError::BadName {
                    path: rel,
                    reason: "not valid UTF-8".into(),
                });
            };
            if name.starts_with('.') {
                continue;
            }
            let full = entry.path();
            let kind = entry.file_type().map_err(|e| io_err("inspect", &full, e))?;
            let md = if kind.is_symlink() {
                let target =
                    std::fs::canonicalize(&full).map_err(|e| io_err("resolve", &full, e))?;
                if !target.starts_with(&root) {
                    return Err(OriginError::SymlinkEscape {
                        path: full,
                        target,
                        root,
                    });
                }
                let md = std::fs::metadata(&target).map_err(|e| io_err("inspect", &target, e))?;
                if md.is_dir() {
                    // Following links to directories inside the root would list files twice
                    // under two names, or loop.
                    tracing::warn!(path = %full.display(), "skipping a symbolic link to a directory");
                    continue;
                }
                md
            } else {
                entry.metadata().map_err(|e| io_err("inspect", &full, e))?
            };
            if md.is_dir() {
                dirs.push((full, format!("{rel}/")));
            } else if md.is_file() {
                let shard = ShardPath::new(rel.as_str()).map_err(|e| OriginError::BadName {
                    path: rel,
                    reason: e.to_string(),
                })?;
                files.push((shard, md.len()));
            }
        }
    }
    Ok(files)
}

/// The file holding `shard` at a local origin, refusing links that leave the origin
/// directory or the allowed root. Returns the resolved file and the resolved allowed root.
fn resolve_local(
    path: &Path,
    allowed_root: &Path,
    shard: &ShardPath,
) -> Result<(PathBuf, PathBuf), OriginError> {
    let md = std::fs::metadata(path).map_err(|e| io_err("inspect", path, e))?;
    let (origin, root) = beneath_root(path, allowed_root)?;
    if !md.is_dir() {
        if path.file_name().and_then(|n| n.to_str()) == Some(shard.as_str()) {
            return Ok((origin, root));
        }
        return Err(OriginError::NotFound {
            location: format!("{shard} (the origin is the single file {})", path.display()),
        });
    }
    // `ShardPath` has no `..`, absolute or empty components, so only links can escape.
    let file = origin.join(shard.as_str());
    let target = std::fs::canonicalize(&file).map_err(|e| io_err("resolve", &file, e))?;
    if !target.starts_with(&origin) {
        return Err(OriginError::SymlinkEscape {
            path: file,
            target,
            root: origin,
        });
    }
    Ok((target, root))
}

/// Reads exactly `len` bytes at `offset` of `file`.
fn read_local_range(
    file: &Path,
    root: &Path,
    offset: u64,
    len: usize,
) -> Result<Bytes, OriginError> {
    let f = open_beneath(file, root)?;
    let mut buf = BytesMut::zeroed(len);
    let mut got = 0;
    while got < len {
        match f.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("read", file, e)),
        }
    }
    if got < len {
        return Err(OriginError::ShortRead {
            location: file.display().to_string(),
            offset,
            expected: len as u64,
            got: got as u64,
        });
    }
    Ok(buf.freeze())
}

/// An HTTP client for one origin; installs the ring TLS provider on first use. Redirects
/// are followed only inside the allow-list, host names connect only to permitted
/// addresses ([`PolicyResolver`]), and proxies from the environment are ignored (a proxy
/// would resolve names where the policy cannot see them).
fn http_client(access: &OriginAccess) -> Result<reqwest::Client, OriginError> {
    install_tls_provider();
    let redirects = access.clone();
    let redirect = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= MAX_REDIRECTS {
            return attempt.error(format!("more than {MAX_REDIRECTS} redirects"));
        }
        match redirects.policy.check(attempt.url().as_str()) {
            Ok(_) => attempt.follow(),
            Err(e) => {
                let e = redirects.refuse(e);
                attempt.error(format!("redirect refused: {e}"))
            }
        }
    });
    policy_client(access, redirect, reqwest::header::HeaderMap::new())
}

/// A `reqwest` client under the origin policy: the given redirect policy and default
/// headers, host names resolved only to permitted addresses ([`PolicyResolver`]), no proxy
/// from the environment, and the origin timeouts.
fn policy_client(
    access: &OriginAccess,
    redirect: reqwest::redirect::Policy,
    headers: reqwest::header::HeaderMap,
) -> Result<reqwest::Client, OriginError> {
    reqwest::Client::builder()
        .connect_timeout(HTTP_CONNECT_TIMEOUT)
        .read_timeout(HTTP_READ_TIMEOUT)
        .tcp_nodelay(true)
        .default_headers(headers)
        .redirect(redirect)
        .no_proxy()
        .dns_resolver(PolicyResolver {
            access: access.clone(),
        })
        .build()
        .map_err(OriginError::Client)
}

/// Installs the ring TLS provider for `reqwest` once per process.
fn install_tls_provider() {
    static TLS_PROVIDER: Once = Once::new();
    TLS_PROVIDER.call_once(|| {
        // Fails only if the embedding program installed a provider first: then use that.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Resolves host names with the system resolver, then drops every address the policy does
/// not permit; fails when none is left. The client connects only to what this returns,
/// so a name that re-resolves to `169.254.169.254` between two requests is still refused.
struct PolicyResolver {
    access: OriginAccess,
}

impl reqwest::dns::Resolve for PolicyResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let access = self.access.clone();
        let host = name.as_str().to_string();
        Box::pin(async move {
            let resolved: Vec<std::net::SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let (ok, refused): (Vec<_>, Vec<_>) = resolved
                .into_iter()
                .partition(|a| access.policy.permits_address(a.ip()));
            if ok.is_empty() {
                if let Some(addr) = refused.first() {
                    let e = access.refuse(PolicyError::RestrictedAddress {
                        host,
                        addr: addr.ip(),
                    });
                    return Err(Box::new(e) as Box<dyn std::error::Error + Send + Sync>);
                }
                return Err(format!("{host} resolved to no address").into());
            }
            if !refused.is_empty() {
                tracing::debug!(%host, refused = ?refused, "dropped restricted addresses");
            }
            Ok(Box::new(ok.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// An error and its sources, `: `-separated (reqwest hides the cause in `source()`).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = cause.source();
    }
    out
}

fn http_err(url: &Url, source: reqwest::Error) -> OriginError {
    OriginError::Http {
        url: url.to_string(),
        source,
    }
}

/// Fails unless `resp` has status `want`; 404 and 410 become [`OriginError::NotFound`].
fn check_status(resp: &reqwest::Response, url: &Url, want: StatusCode) -> Result<(), OriginError> {
    match resp.status() {
        s if s == want => Ok(()),
        StatusCode::NOT_FOUND | StatusCode::GONE => Err(OriginError::NotFound {
            location: url.to_string(),
        }),
        s => Err(OriginError::HttpStatus {
            url: url.to_string(),
            status: s.as_u16(),
        }),
    }
}

/// `base` (ending in `/`) with the shard's path appended, each component percent-encoded so
/// that names with `:`, `?`, `#` or `%` cannot change the URL's meaning.
fn shard_url(base: &Url, shard: &str) -> Result<Url, OriginError> {
    let mut url = base.clone();
    url.path_segments_mut()
        .map_err(|()| OriginError::InvalidUri {
            uri: base.to_string(),
            reason: "the URL cannot have a path".into(),
        })?
        .pop_if_empty()
        .extend(shard.split('/'));
    Ok(url)
}

/// The size of the file at `url`, from a `HEAD` request's `Content-Length`.
async fn head_size(client: &reqwest::Client, url: &Url) -> Result<u64, OriginError> {
    let resp = client
        .head(url.clone())
        .send()
        .await
        .map_err(|e| http_err(url, e))?;
    check_status(&resp, url, StatusCode::OK)?;
    resp.headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| OriginError::NoContentLength {
            url: url.to_string(),
        })
}

/// Lists an HTTP model directory from its safetensors index, or its single
/// `model.safetensors` when there is no index.
async fn list_http_dir(
    client: &reqwest::Client,
    base: &Url,
) -> Result<Vec<(ShardPath, u64)>, OriginError> {
    let index_url = shard_url(base, HF_INDEX)?;
    let mut resp = client
        .get(index_url.clone())
        .send()
        .await
        .map_err(|e| http_err(&index_url, e))?;
    let names: BTreeSet<String> = match resp.status() {
        StatusCode::NOT_FOUND => {
            let url = shard_url(base, HF_SINGLE)?;
            return match head_size(client, &url).await {
                Ok(size) => Ok(vec![(
                    ShardPath::new(HF_SINGLE).map_err(bad_name(HF_SINGLE))?,
                    size,
                )]),
                Err(OriginError::NotFound { .. }) => Err(OriginError::NotFound {
                    location: format!("{index_url} or {url} (the model directory's weights)"),
                }),
                Err(e) => Err(e),
            };
        }
        _ => {
            check_status(&resp, &index_url, StatusCode::OK)?;
            let bad = |reason: String| OriginError::BadIndex {
                url: index_url.to_string(),
                reason,
            };
            let mut body = Vec::new();
            while let Some(piece) = resp.chunk().await.map_err(|e| http_err(&index_url, e))? {
                if body.len() + piece.len() > MAX_INDEX_LEN {
                    return Err(bad(format!("larger than {MAX_INDEX_LEN} bytes")));
                }
                body.extend_from_slice(&piece);
            }
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: BTreeMap<String, String>,
            }
            let index: Index = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
            if index.weight_map.is_empty() {
                return Err(bad("weight_map is empty".into()));
            }
            // The index is part of the model (loaders need it to find tensors), and a
            // `file://` listing of the same directory includes it: keep both origins'
            // manifests, and so the model's digest, identical.
            let mut names: BTreeSet<String> = index.weight_map.into_values().collect();
            names.insert(HF_INDEX.to_string());
            names
        }
    };
    futures::stream::iter(names)
        .map(|name| async move {
            let shard = ShardPath::new(name.as_str()).map_err(bad_name(&name))?;
            if origin_policy::check_relative(base.as_str(), shard.as_str()).is_err() {
                return Err(OriginError::BadName {
                    path: name.clone(),
                    reason: "hidden (dot) files are not served from origins".into(),
                });
            }
            let url = shard_url(base, shard.as_str())?;
            let size = head_size(client, &url).await?;
            Ok((shard, size))
        })
        .buffer_unordered(HEAD_PARALLEL)
        .try_collect()
        .await
}

fn bad_name(name: &str) -> impl FnOnce(shardcast_protocol::NameError) -> OriginError + '_ {
    move |e| OriginError::BadName {
        path: name.to_string(),
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};
    use std::convert::Infallible;
    use std::sync::Mutex;

    use http_body_util::Full;
    use hyper::service::service_fn;
    use hyper::{Request, Response};
    use hyper_util::rt::TokioIo;
    use shardcast_protocol::manifest::MIN_CHUNK_SIZE;
    use shardcast_protocol::origin_policy::percent_decode;

    use super::*;

    /// The retry pauses keep the old schedule's bounds (each below 100, 200, 400 ms, under
    /// 700 ms in all) and are jittered (each at least half its bound), one per retry.
    #[test]
    fn retry_pauses_are_jittered_within_the_old_bounds() {
        let mut distinct = std::collections::HashSet::new();
        for _ in 0..200 {
            let pauses: Vec<Duration> = retry_pauses().collect();
            assert_eq!(pauses.len(), FETCH_ATTEMPTS as usize - 1);
            let slack = Duration::from_micros(1);
            for (p, bound) in pauses.iter().zip([100u64, 200, 400]) {
                let bound = Duration::from_millis(bound);
                assert!(*p + slack >= bound / 2 && *p <= bound + slack, "{pauses:?}");
            }
            assert!(
                pauses.iter().sum::<Duration>() <= Duration::from_millis(700) + slack * 3,
                "{pauses:?}"
            );
            distinct.insert(pauses[0]);
        }
        assert!(distinct.len() > 1, "no jitter: {distinct:?}");
    }

    /// Access that allows exactly `uri` (and what lies under it).
    fn allowing(uri: &str) -> OriginAccess {
        OriginAccess::new(OriginPolicy::parse([uri], Enforcer::Host).unwrap())
    }

    /// Opens `uri` under a policy that allows exactly it.
    fn open(uri: &str) -> Result<Origin, OriginError> {
        Origin::parse(uri, &allowing(uri))
    }

    const CHUNK: u32 = MIN_CHUNK_SIZE;

    fn content(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 8) as u8)
            .collect()
    }

    fn entry(path: &str, data: &[u8]) -> ShardEntry {
        let mut h = ShardHasher::new(CHUNK);
        h.update(data);
        h.finish(ShardPath::new(path).unwrap())
    }

    fn model() -> ModelName {
        ModelName::new("test/model").unwrap()
    }

    fn shard(s: &str) -> ShardPath {
        ShardPath::new(s).unwrap()
    }

    fn file_uri(p: &Path) -> String {
        format!("file://{}", p.display())
    }

    /// A model directory: `a.safetensors` (3.5 chunks), `sub/b.bin` (1 chunk), an empty
    /// file, and hidden files that must be skipped.
    fn model_dir() -> (tempfile::TempDir, Vec<(&'static str, Vec<u8>)>) {
        let dir = tempfile::tempdir().unwrap();
        let files = vec![
            ("a.safetensors", content(1, CHUNK as usize * 3 + 100)),
            ("empty", Vec::new()),
            ("sub/b.bin", content(2, CHUNK as usize)),
        ];
        for (name, data) in &files {
            let p = dir.path().join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, data).unwrap();
        }
        std::fs::write(dir.path().join(".hidden"), b"x").unwrap();
        std::fs::create_dir_all(dir.path().join(".git")).unwrap();
        std::fs::write(dir.path().join(".git/config"), b"x").unwrap();
        (dir, files)
    }

    /// Keeps each shard in a file under a directory; fails for shards named `refuse`.
    struct DirSink(PathBuf);

    impl KeepSink for DirSink {
        fn open(&self, shard: &ShardPath) -> io::Result<std::fs::File> {
            if shard.as_str().ends_with("b.bin") && self.0.ends_with("refuse") {
                return Err(io::Error::other("no room"));
            }
            let p = self.0.join(shard.as_str());
            std::fs::create_dir_all(p.parent().unwrap())?;
            std::fs::File::create(p)
        }
    }

    #[tokio::test]
    async fn building_a_manifest_can_keep_what_it_reads() {
        let (dir, files) = model_dir();
        let origin = open(&file_uri(dir.path())).unwrap();
        let plain = origin
            .build_manifest(model(), CHUNK, &|_| {})
            .await
            .unwrap();
        let keep = tempfile::tempdir().unwrap();
        let sink = DirSink(keep.path().join("ok"));
        let (m, kept) = origin
            .build_manifest_keeping(model(), CHUNK, &|_| {}, Some(&sink))
            .await
            .unwrap();
        assert_eq!(m, plain);
        assert!(kept);
        for (name, data) in &files {
            assert_eq!(&std::fs::read(sink.0.join(name)).unwrap(), data, "{name}");
        }
        // Read back as a staged origin: the same bytes, and no allow-list involved.
        let staged = Origin::staged(sink.0.clone());
        let back = staged
            .read_range(&shard("a.safetensors"), 7, 100)
            .await
            .unwrap();
        assert_eq!(&back[..], &files[0].1[7..107]);

        // A shard that cannot be kept is still hashed: the same manifest, not kept.
        let sink = DirSink(keep.path().join("refuse"));
        let (m, kept) = origin
            .build_manifest_keeping(model(), CHUNK, &|_| {}, Some(&sink))
            .await
            .unwrap();
        assert_eq!(m, plain);
        assert!(!kept);
    }

    #[tokio::test]
    async fn file_dir_lists_and_builds_the_manifest() {
        let (dir, files) = model_dir();
        let origin = open(&file_uri(dir.path())).unwrap();
        let listed = origin.list().await.unwrap();
        let want: Vec<_> = files
            .iter()
            .map(|(n, d)| (shard(n), d.len() as u64))
            .collect();
        assert_eq!(listed, want);

        let last = AtomicU64::new(0);
        let m = origin
            .build_manifest(model(), CHUNK, &|n| last.store(n, Ordering::Relaxed))
            .await
            .unwrap();
        let expected = Manifest::new(
            model(),
            CHUNK,
            files.iter().map(|(n, d)| entry(n, d)).collect(),
        )
        .unwrap();
        assert_eq!(m, expected);
        assert_eq!(m.digest(), expected.digest());
        assert_eq!(last.load(Ordering::Relaxed), m.total_bytes());
        assert_eq!(origin.bytes_read(), m.total_bytes());

        let data = origin
            .read_range(&shard("a.safetensors"), 5, 1000)
            .await
            .unwrap();
        assert_eq!(&data[..], &files[0].1[5..1005]);
        assert!(
            origin
                .read_range(&shard("a.safetensors"), 0, 0)
                .await
                .unwrap()
                .is_empty()
        );
        let err = origin
            .read_range(&shard("a.safetensors"), 12_000, 1000)
            .await
            .unwrap_err();
        assert!(
            matches!(err, OriginError::ShortRead { got: 388, .. }),
            "{err}"
        );
        let err = origin.read_range(&shard("nope"), 0, 10).await.unwrap_err();
        assert!(matches!(err, OriginError::NotFound { .. }), "{err}");
        let err = origin
            .build_manifest(model(), 100, &|_| {})
            .await
            .unwrap_err();
        assert!(matches!(err, OriginError::Manifest(_)), "{err}");
    }

    #[tokio::test]
    async fn file_origin_of_one_file() {
        let (dir, files) = model_dir();
        let origin = open(&file_uri(&dir.path().join("sub/b.bin"))).unwrap();
        assert_eq!(
            origin.list().await.unwrap(),
            vec![(shard("b.bin"), CHUNK as u64)]
        );
        let m = origin
            .build_manifest(model(), CHUNK, &|_| {})
            .await
            .unwrap();
        assert_eq!(m.shards, vec![entry("b.bin", &files[2].1)]);
        let data = origin.read_range(&shard("b.bin"), 10, 20).await.unwrap();
        assert_eq!(&data[..], &files[2].1[10..30]);
        let err = origin
            .read_range(&shard("a.safetensors"), 0, 1)
            .await
            .unwrap_err();
        assert!(matches!(err, OriginError::NotFound { .. }), "{err}");
    }

    #[tokio::test]
    async fn symlinks_leaving_the_root_are_refused() {
        let (dir, files) = model_dir();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"secret").unwrap();
        // A link inside the root is followed.
        std::os::unix::fs::symlink(dir.path().join("a.safetensors"), dir.path().join("link"))
            .unwrap();
        let origin = open(&file_uri(dir.path())).unwrap();
        let listed = origin.list().await.unwrap();
        assert!(
            listed.contains(&(shard("link"), files[0].1.len() as u64)),
            "{listed:?}"
        );

        std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("escape"))
            .unwrap();
        let err = origin.list().await.unwrap_err();
        assert!(matches!(err, OriginError::SymlinkEscape { .. }), "{err}");
        let err = origin.read_range(&shard("escape"), 0, 6).await.unwrap_err();
        assert!(matches!(err, OriginError::SymlinkEscape { .. }), "{err}");
        // Through a linked directory, too.
        std::fs::remove_file(dir.path().join("escape")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("out")).unwrap();
        let err = origin
            .read_range(&shard("out/secret"), 0, 6)
            .await
            .unwrap_err();
        assert!(matches!(err, OriginError::SymlinkEscape { .. }), "{err}");
    }

    #[test]
    fn bad_uris_are_refused_clearly() {
        for uri in ["ftp://host/x", "/abs/path", "model", "hdfs:///x"] {
            let err = Origin::parse(uri, &OriginAccess::default()).unwrap_err();
            assert!(
                matches!(err, OriginError::UnsupportedScheme { .. }),
                "{uri}: {err}"
            );
            assert!(err.to_string().contains("file:///"), "{err}");
        }
        for uri in ["file://relative/path", "http://", "https://host/%ff"] {
            let err = Origin::parse(uri, &OriginAccess::default()).unwrap_err();
            assert!(
                matches!(err, OriginError::InvalidUri { .. }),
                "{uri}: {err}"
            );
        }
        let o = open("https://example.com/models/llama/").unwrap();
        assert_eq!(o.uri(), "https://example.com/models/llama/");
        assert!(open("HTTP://example.com/a%20b.safetensors").is_ok());
        assert!(open("file:///tmp/a%20b").is_ok());
        // S3 and Hugging Face origins open without any request.
        assert!(open("s3://bucket/models/llama/").is_ok());
        assert!(open("hf://acme/tiny@main").is_ok());
        let err = open("hf://acme/").unwrap_err();
        assert!(err.to_string().contains("name one repository"), "{err}");
        for uri in ["hf://acme/tiny/extra", "s3://Bucket/x"] {
            let err = Origin::parse(uri, &OriginAccess::default()).unwrap_err();
            assert!(
                matches!(err, OriginError::InvalidUri { .. }),
                "{uri}: {err}"
            );
        }
        // Outside the allow-list: refused before the client is even set up.
        let access = allowing("s3://bucket/models/");
        let err = Origin::parse("s3://bucket/other/", &access).unwrap_err();
        assert!(matches!(err, OriginError::Policy(_)), "{err}");
        assert_eq!(access.refused(), 1);
    }

    #[tokio::test]
    async fn missing_local_origin_is_not_found() {
        let err = open("file:///definitely/not/here")
            .unwrap()
            .list()
            .await
            .unwrap_err();
        assert!(matches!(err, OriginError::NotFound { .. }), "{err}");
    }

    /// An in-memory HTTP origin with single-range support, counting requests per range and
    /// corrupting the first answer for the ranges in `corrupt_once` (or every answer for
    /// those in `corrupt_always`).
    #[derive(Default)]
    struct TestServer {
        files: HashMap<String, Vec<u8>>,
        corrupt_once: Mutex<HashSet<(String, u64)>>,
        corrupt_always: HashSet<(String, u64)>,
        hits: Mutex<HashMap<(String, u64), u32>>,
    }

    impl TestServer {
        fn answer(&self, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
            let path = req.uri().path().trim_start_matches('/').to_string();
            let path = percent_decode(&path).unwrap();
            let reply = |status: u16, body: Vec<u8>| {
                let mut r = Response::new(Full::new(Bytes::from(body)));
                *r.status_mut() = StatusCode::from_u16(status).unwrap();
                r
            };
            let Some(data) = self.files.get(&path) else {
                return reply(404, vec![]);
            };
            if req.method() == hyper::Method::HEAD {
                let mut r = reply(200, vec![]);
                r.headers_mut()
                    .insert(header::CONTENT_LENGTH, data.len().into());
                return r;
            }
            let Some(range) = req.headers().get(header::RANGE) else {
                return reply(200, data.clone());
            };
            let (a, b) = range
                .to_str()
                .unwrap()
                .strip_prefix("bytes=")
                .unwrap()
                .split_once('-')
                .unwrap();
            let (a, b): (u64, u64) = (a.parse().unwrap(), b.parse().unwrap());
            if a >= data.len() as u64 {
                return reply(416, vec![]);
            }
            let b = b.min(data.len() as u64 - 1);
            let key = (path.clone(), a);
            *self.hits.lock().unwrap().entry(key.clone()).or_default() += 1;
            let mut body = data[a as usize..=b as usize].to_vec();
            if self.corrupt_always.contains(&key) || self.corrupt_once.lock().unwrap().remove(&key)
            {
                body[0] ^= 0xff;
            }
            let mut r = reply(206, body);
            r.headers_mut().insert(
                header::CONTENT_RANGE,
                format!("bytes {a}-{b}/{}", data.len()).parse().unwrap(),
            );
            r
        }

        fn hits(&self, path: &str, offset: u64) -> u32 {
            self.hits
                .lock()
                .unwrap()
                .get(&(path.to_string(), offset))
                .copied()
                .unwrap_or(0)
        }
    }

    async fn spawn_server(server: TestServer) -> (Arc<TestServer>, String) {
        let server = Arc::new(server);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/", listener.local_addr().unwrap());
        let s = server.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let s = s.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let resp = s.answer(&req);
                        async move { Ok::<_, Infallible>(resp) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        (server, base)
    }

    fn hf_files() -> HashMap<String, Vec<u8>> {
        let index = serde_json::json!({
            "metadata": {"total_size": 1},
            "weight_map": {
                "w1": "model-00001-of-00002.safetensors",
                "w2": "model-00002-of-00002.safetensors",
                "w3": "model-00001-of-00002.safetensors",
            }
        });
        HashMap::from([
            (HF_INDEX.to_string(), serde_json::to_vec(&index).unwrap()),
            (
                "model-00001-of-00002.safetensors".into(),
                content(3, CHUNK as usize * 5 + 17),
            ),
            (
                "model-00002-of-00002.safetensors".into(),
                content(4, CHUNK as usize * 2),
            ),
            ("config.json".into(), b"{}".to_vec()),
        ])
    }

    #[tokio::test]
    async fn http_directory_with_index() {
        let files = hf_files();
        let (_server, base) = spawn_server(TestServer {
            files: files.clone(),
            ..Default::default()
        })
        .await;
        let origin = open(&base).unwrap();
        let one = "model-00001-of-00002.safetensors";
        let two = "model-00002-of-00002.safetensors";
        assert_eq!(
            origin.list().await.unwrap(),
            vec![
                (shard(one), files[one].len() as u64),
                (shard(two), files[two].len() as u64),
                (shard(HF_INDEX), files[HF_INDEX].len() as u64),
            ]
        );
        let m = origin
            .build_manifest(model(), CHUNK, &|_| {})
            .await
            .unwrap();
        assert_eq!(
            m.shards,
            vec![
                entry(one, &files[one]),
                entry(two, &files[two]),
                entry(HF_INDEX, &files[HF_INDEX])
            ]
        );

        let data = origin.read_range(&shard(one), 4000, 300).await.unwrap();
        assert_eq!(&data[..], &files[one][4000..4300]);
        // A range running past the end comes back short.
        let err = origin
            .read_range(&shard(two), 8000, 1000)
            .await
            .unwrap_err();
        assert!(
            matches!(err, OriginError::ShortRead { got: 192, .. }),
            "{err}"
        );
        let err = origin.read_range(&shard(two), 9000, 10).await.unwrap_err();
        assert!(
            matches!(err, OriginError::HttpStatus { status: 416, .. }),
            "{err}"
        );
        let err = origin
            .read_range(&shard("missing.safetensors"), 0, 10)
            .await
            .unwrap_err();
        assert!(matches!(err, OriginError::NotFound { .. }), "{err}");
    }

    #[tokio::test]
    async fn http_directory_without_index_and_single_files() {
        let weights = content(5, 10_000);
        let files = HashMap::from([
            (HF_SINGLE.to_string(), weights.clone()),
            ("dir/odd name.bin".to_string(), weights.clone()),
        ]);
        let (_server, base) = spawn_server(TestServer {
            files,
            ..Default::default()
        })
        .await;
        let origin = open(&base).unwrap();
        assert_eq!(
            origin.list().await.unwrap(),
            vec![(shard(HF_SINGLE), 10_000)]
        );

        let origin = open(&format!("{base}dir/odd%20name.bin")).unwrap();
        assert_eq!(
            origin.list().await.unwrap(),
            vec![(shard("odd name.bin"), 10_000)]
        );
        let data = origin
            .read_range(&shard("odd name.bin"), 0, 10_000)
            .await
            .unwrap();
        assert_eq!(&data[..], &weights[..]);

        let origin = open(&format!("{base}nothing/")).unwrap();
        let err = origin.list().await.unwrap_err();
        assert!(matches!(err, OriginError::NotFound { .. }), "{err}");
        assert!(err.to_string().contains(HF_SINGLE), "{err}");
        let err = open(&format!("{base}gone.bin"))
            .unwrap()
            .list()
            .await
            .unwrap_err();
        assert!(matches!(err, OriginError::NotFound { .. }), "{err}");
    }

    #[tokio::test]
    async fn fetch_chunks_verifies_and_retries() {
        let files = hf_files();
        let one = "model-00001-of-00002.safetensors";
        let bad = (one.to_string(), u64::from(CHUNK) * 2);
        let (server, base) = spawn_server(TestServer {
            files: files.clone(),
            corrupt_once: Mutex::new(HashSet::from([bad.clone()])),
            ..Default::default()
        })
        .await;
        let origin = open(&base).unwrap();
        let manifest =
            Arc::new(Manifest::new(model(), CHUNK, vec![entry(one, &files[one])]).unwrap());
        let (tx, mut rx) = mpsc::channel(2);
        let fetch = tokio::spawn({
            let (origin, manifest) = (origin.clone(), manifest.clone());
            async move { fetch_chunks(&origin, manifest, 0, (0..6).collect(), 3, tx).await }
        });
        let mut got = Vec::new();
        while let Some(c) = rx.recv().await {
            assert_eq!(c.shard(), 0);
            let (offset, len) = manifest.chunk_span(0, c.index()).unwrap();
            assert_eq!(c.offset(), offset);
            assert_eq!(
                &c.data()[..],
                &files[one][offset as usize..offset as usize + len]
            );
            got.push(c.index());
        }
        fetch.await.unwrap().unwrap();
        got.sort();
        assert_eq!(got, (0..6).collect::<Vec<_>>());
        assert_eq!(
            server.hits(one, bad.1),
            2,
            "the corrupted chunk is fetched again"
        );
        assert_eq!(server.hits(one, 0), 1);

        // A chunk that is always corrupt fails after every attempt.
        let (server, base) = spawn_server(TestServer {
            files: files.clone(),
            corrupt_always: HashSet::from([bad.clone()]),
            ..Default::default()
        })
        .await;
        let origin = open(&base).unwrap();
        let (tx, _rx) = mpsc::channel(16);
        let err = fetch_chunks(&origin, manifest.clone(), 0, vec![2], 2, tx)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                OriginError::Corrupt {
                    index: 2,
                    attempts: 4,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(server.hits(one, bad.1), FETCH_ATTEMPTS);

        // Unknown chunks are refused before any download; a closed channel stops quietly.
        let (tx, rx) = mpsc::channel(16);
        let err = fetch_chunks(&origin, manifest.clone(), 0, vec![0, 6], 2, tx.clone()).await;
        assert!(matches!(err, Err(OriginError::NotInManifest(_))), "{err:?}");
        drop(rx);
        fetch_chunks(&origin, manifest, 0, (0..6).collect(), 2, tx)
            .await
            .unwrap();
    }
}
