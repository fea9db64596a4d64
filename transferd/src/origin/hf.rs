//! `hf://org/name@revision` origins: every file of one revision of a Hugging Face Hub model
//! repository (weights, `config.json`, tokenizer files, …; names with a component starting
//! with `.`, such as `.gitattributes`, are skipped like hidden local files). No revision
//! means `main`.
//!
//! Implemented against the documented Hub HTTP API rather than the `hf-hub` crate:
//! `hf-hub` (0.4, and as far as checked the 1.0 rewrite) downloads whole files into its
//! cache or a local directory through its own HTTP client, while a chain head needs
//! parallel `Range` reads straight into the chain, and every request must go through the
//! origin policy's HTTP client (address filtering, redirect rules, no proxy). The API
//! used:
//!
//! * `GET {endpoint}/api/models/{org}/{name}/revision/{revision}?blobs=true`: the commit
//!   the revision names now (`sha`) and its `siblings` (`rfilename`, and `size` with
//!   `blobs=true`);
//! * `GET {endpoint}/{org}/{name}/resolve/{commit}/{path}` with `Range`, which the Hub
//!   answers directly or, for large (LFS) files, by a `302` to its CDN.
//!
//! **One commit per model.** A branch (`main`) moves when someone pushes, so every file is
//! read from the commit the listing named, never from the branch: a push during an import
//! cannot mix two commits' files into one manifest. Later reads of the same model
//! ([`super::fetch_chunks`]: a fetch after the import, a chain head, recovery, repairs) are
//! given only the URI (`hf://org/name@main`) and the manifest, so each origin resolves its
//! commit once, before its first read: the commit this process built that manifest from
//! (remembered by manifest digest in [`PINNED`], kept in memory only), else the commit the
//! revision names now, whose listing must still hold the shard at the manifest's size (else
//! [`OriginError::RevisionMoved`] says the branch moved and how to read the old commit). A
//! listing without `sha` (an old Hub or a mirror) is read by revision, with a warning. A
//! revision that is already a commit id is read as it is.
//!
//! Configuration, read from transferd's environment when the origin is opened:
//! `HF_ENDPOINT` (default `https://huggingface.co`; plain `http://` only at a loopback IP
//! literal), and the token from `HF_TOKEN`, else the file `HF_TOKEN_PATH`, else
//! `$HF_HOME/token`, else `~/.cache/huggingface/token` (as `huggingface_hub` does). The
//! token is sent as `Authorization: Bearer` to the endpoint only: `reqwest` drops it when a
//! redirect leaves the endpoint's host, port or scheme. Redirects are followed to the
//! endpoint itself, to any `https://` host (the Hub's CDN hosts vary), or inside the
//! allow-list; host names are connected to only at addresses the origin policy permits,
//! like every HTTP origin.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{LazyLock, Mutex, OnceLock};

use reqwest::{StatusCode, Url, header};
use shardcast_protocol::origin_policy::{Authority, OriginLocation, is_commit_id};
use shardcast_protocol::{Manifest, ModelDigest, ShardPath};

use super::{
    MAX_INDEX_LEN, MAX_REDIRECTS, OriginAccess, OriginError, check_status, head_size, http_err,
};

/// The public Hub.
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Revision used when the URI names none.
const DEFAULT_REVISION: &str = "main";

/// What to check when the Hub refuses a request.
const HF_CREDENTIALS_HINT: &str = "HF_TOKEN or the token file (HF_TOKEN_PATH, default \
    ~/.cache/huggingface/token) in transferd's environment; a gated or private repository \
    also needs access granted to that token's user";

/// Models whose commit [`PINNED`] remembers. Rationale: an entry is a few hundred bytes and
/// a host imports far fewer models than this while it runs; past it an arbitrary entry is
/// forgotten, and its model's later reads resolve the revision again.
const MAX_PINNED: usize = 4096;

/// The commit each model was built from in this process, by repository (`{endpoint}/{org}/
/// {name}`) and manifest digest: a model's later reads use it even after its branch moved.
/// Any commit whose files produced a manifest holds exactly that manifest's bytes, so the
/// revision the URI names does not matter. In memory only: after a restart, or on another
/// host, the revision is resolved again (see the module documentation).
static PINNED: LazyLock<Mutex<HashMap<(String, ModelDigest), String>>> =
    LazyLock::new(Mutex::default);

/// One revision of a Hub repository.
#[derive(Debug)]
pub(super) struct HfSource {
    /// Sends the token (if any) as a default header.
    pub(super) client: reqwest::Client,
    /// `{endpoint}/{org}/{name}/resolve` (the revision or commit follows).
    resolve: Url,
    /// `{endpoint}/api/models/{org}/{name}/revision` (the revision or commit follows).
    api: Url,
    /// The revision the URI names (`main` when none).
    revision: String,
    /// The commit the revision resolved to, once known: every file is then read from it.
    commit: OnceLock<String>,
    /// `{endpoint}/{org}/{name}`, the key of [`PINNED`].
    key: String,
    /// `org/name@revision`, for messages.
    repo: String,
    /// `org/name`.
    id: String,
}

/// A revision listing, as far as it is used.
#[derive(serde::Deserialize)]
struct Listing {
    /// The commit the revision names; older servers and some mirrors send none.
    #[serde(default)]
    sha: Option<String>,
    siblings: Vec<Sibling>,
}

#[derive(serde::Deserialize)]
struct Sibling {
    rfilename: String,
    size: Option<u64>,
}

impl Listing {
    /// The siblings that are model files: no component starting with `.` (nor empty).
    fn files(&self) -> impl Iterator<Item = &Sibling> {
        self.siblings.iter().filter(|s| {
            !s.rfilename
                .split('/')
                .any(|c| c.starts_with('.') || c.is_empty())
        })
    }
}

/// `base` with `parts` appended as path segments (each percent-encoded).
fn join(base: &Url, parts: &[&str]) -> Result<Url, OriginError> {
    let mut url = base.clone();
    url.path_segments_mut()
        .map_err(|()| OriginError::invalid_uri(base.as_str(), "the URL cannot have a path"))?
        .pop_if_empty()
        .extend(parts);
    Ok(url)
}

impl HfSource {
    /// Reads the endpoint and token from the environment and sets up the client. Reads the
    /// token file, if any; no network I/O.
    pub(super) fn open(
        uri: &str,
        location: &OriginLocation,
        access: &OriginAccess,
    ) -> Result<Self, OriginError> {
        let invalid = |reason: String| OriginError::invalid_uri(uri, reason);
        let Authority::HubOrg(org) = location.authority() else {
            return Err(invalid("no organisation".into()));
        };
        let [name] = location.segments() else {
            return Err(invalid(
                "name one repository: hf://org/name or hf://org/name@revision".into(),
            ));
        };
        let revision = location.revision().unwrap_or(DEFAULT_REVISION);
        let endpoint_text =
            std::env::var("HF_ENDPOINT").unwrap_or_else(|_| DEFAULT_ENDPOINT.to_string());
        let endpoint = Url::parse(endpoint_text.trim_end_matches('/'))
            .map_err(|e| invalid(format!("HF_ENDPOINT {endpoint_text:?} is not a URL: {e}")))?;
        match endpoint.scheme() {
            "https" => {}
            "http" if super::s3::loopback_literal(&endpoint) => {}
            _ => {
                return Err(invalid(format!(
                    "HF_ENDPOINT {endpoint_text} must be https:// (plain http only at a \
                     loopback address such as http://127.0.0.1:8080)"
                )));
            }
        }
        let no_path = |_| invalid(format!("HF_ENDPOINT {endpoint_text} cannot have a path"));
        let api = join(&endpoint, &["api", "models", org, name, "revision"]).map_err(no_path)?;
        let resolve = join(&endpoint, &[org, name, "resolve"]).map_err(no_path)?;
        let key = join(&endpoint, &[org, name]).map_err(no_path)?.to_string();
        let token = token().map_err(|(path, e)| OriginError::Io {
            op: "read the Hugging Face token file",
            path,
            source: e,
        })?;
        let client = hub_client(access, &endpoint, token.as_deref())?;
        Ok(Self {
            client,
            resolve,
            api,
            revision: revision.to_string(),
            commit: OnceLock::new(),
            key,
            repo: format!("{org}/{name}@{revision}"),
            id: format!("{org}/{name}"),
        })
    }

    /// `hf://org/name@<commit>` once the revision resolved to a commit: the URI that reads
    /// exactly what this origin read, whatever the branch does later.
    pub(super) fn resolved_uri(&self) -> Option<String> {
        self.commit
            .get()
            .map(|commit| format!("hf://{}@{commit}", self.id))
    }

    /// What files are read from: the commit once resolved, else the revision.
    fn read_rev(&self) -> &str {
        self.commit
            .get()
            .map_or(self.revision.as_str(), String::as_str)
    }

    /// The listing URL of `rev`.
    fn api_url(&self, rev: &str) -> Result<Url, OriginError> {
        let mut url = join(&self.api, &[rev])?;
        url.query_pairs_mut().append_pair("blobs", "true");
        Ok(url)
    }

    /// Fixes the commit every file is read from (the first one set stays); logs it.
    fn pin(&self, sha: &str, why: &str) -> &str {
        let pinned = self.commit.get_or_init(|| {
            if sha != self.revision {
                tracing::info!(repo = %self.repo, commit = sha, "Hugging Face revision {} is commit {sha} ({why}); reading its files from resolve/{sha}/", self.revision);
            }
            sha.to_string()
        });
        pinned.as_str()
    }

    /// Fetches and parses the listing of `rev`.
    async fn listing(&self, rev: &str) -> Result<Listing, OriginError> {
        let api = self.api_url(rev)?;
        let mut resp = self
            .client
            .get(api.clone())
            .send()
            .await
            .map_err(|e| http_err(&api, e))?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Err(OriginError::NotFound {
                location: format!(
                    "repository revision {} ({api}: check the organisation, name and revision)",
                    self.repo
                ),
            });
        }
        check_status(&resp, &api, StatusCode::OK).map_err(|e| self.error(e))?;
        let mut body = Vec::new();
        while let Some(piece) = resp.chunk().await.map_err(|e| http_err(&api, e))? {
            if body.len() + piece.len() > MAX_INDEX_LEN {
                return Err(bad_listing(
                    &api,
                    format!("larger than {MAX_INDEX_LEN} bytes"),
                ));
            }
            body.extend_from_slice(&piece);
        }
        let listing = parse_listing(&api, &body)?;
        if listing.sha.is_none() {
            tracing::warn!(repo = %self.repo, url = %api, "the Hub's revision listing names no commit (no \"sha\": an old server or a mirror); reading files by revision {rev}, so a push to it while the model is read fails chunk verification");
        }
        Ok(listing)
    }

    /// The revision's files and sizes (from `siblings`; a `HEAD` for any without a size),
    /// pinning the origin to the commit the listing names.
    pub(super) async fn list(&self) -> Result<Vec<(ShardPath, u64)>, OriginError> {
        let mut listing = self.listing(self.read_rev()).await?;
        if let Some(sha) = listing.sha.take() {
            let pinned = self.pin(&sha, "listed");
            if pinned != sha {
                // Another listing of this origin pinned another commit first: list that one.
                listing = self.listing(pinned).await?;
            }
        }
        let mut files = Vec::new();
        for s in listing.files() {
            let shard = ShardPath::new(s.rfilename.as_str()).map_err(|e| OriginError::BadName {
                path: s.rfilename.clone(),
                reason: e.to_string(),
            })?;
            let size = match s.size {
                Some(size) => size,
                None => {
                    let url = self.url(&shard)?;
                    head_size(&self.client, &url)
                        .await
                        .map_err(|e| self.error(e))?
                }
            };
            files.push((shard, size));
        }
        Ok(files)
    }

    /// Remembers the commit this origin was read from as the one `digest` was built from.
    pub(super) fn remember(&self, digest: ModelDigest) {
        let Some(commit) = self.commit.get() else {
            return;
        };
        let mut pinned = PINNED.lock().unwrap_or_else(|e| e.into_inner());
        if pinned.len() >= MAX_PINNED
            && let Some(old) = pinned.keys().next().cloned()
        {
            pinned.remove(&old);
        }
        pinned.insert((self.key.clone(), digest), commit.clone());
    }

    /// Before reading chunks of `manifest`'s shard `shard`: fixes the commit they are read
    /// from, as the module documentation describes. Fails with
    /// [`OriginError::RevisionMoved`] when the revision now names a commit that does not hold
    /// that shard at the manifest's size.
    pub(super) async fn pin_for(&self, manifest: &Manifest, shard: u32) -> Result<(), OriginError> {
        if self.commit.get().is_some() || is_commit_id(&self.revision) {
            return Ok(());
        }
        let digest = manifest.digest();
        let known = PINNED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(self.key.clone(), digest))
            .cloned();
        if let Some(commit) = known {
            self.pin(&commit, "the commit this model was imported from");
            return Ok(());
        }
        let listing = self.listing(&self.revision).await?;
        let Some(sha) = listing.sha.as_deref() else {
            return Ok(());
        };
        let commit = self.pin(sha, "resolved for a model imported elsewhere or earlier");
        if commit != sha {
            return Ok(());
        }
        let entry = manifest.shard(shard).map_err(OriginError::NotInManifest)?;
        let listed: HashMap<&str, Option<u64>> = listing
            .files()
            .map(|s| (s.rfilename.as_str(), s.size))
            .collect();
        let moved = |detail: String| OriginError::RevisionMoved {
            repo: self.repo.clone(),
            commit: sha.to_string(),
            detail,
        };
        let size = match listed.get(entry.path.as_str()) {
            None => return Err(moved(format!("there is no file {}", entry.path))),
            Some(Some(size)) => *size,
            Some(None) => {
                let url = self.url(&entry.path)?;
                head_size(&self.client, &url)
                    .await
                    .map_err(|e| self.error(e))?
            }
        };
        if size != entry.size {
            return Err(moved(format!(
                "{} is {size} bytes, not {} as in the manifest",
                entry.path, entry.size
            )));
        }
        // The same files at the same sizes: most likely the commit the model was built
        // from; remembered so that the model's other shards need no listing. (Content that
        // differs at the same size still fails chunk verification.)
        let same = listed.len() == manifest.shards.len()
            && manifest.shards.iter().all(|e| {
                listed
                    .get(e.path.as_str())
                    .is_some_and(|s| s.is_none_or(|s| s == e.size))
            });
        if same {
            self.remember(digest);
        }
        Ok(())
    }

    /// The `resolve` URL of `shard`, at the commit once resolved.
    pub(super) fn url(&self, shard: &ShardPath) -> Result<Url, OriginError> {
        let base = join(&self.resolve, &[self.read_rev(), ""])?;
        super::shard_url(&base, shard.as_str())
    }

    /// Where `shard` is read from, for messages.
    pub(super) fn location(&self, shard: &ShardPath) -> String {
        self.url(shard).map_or_else(
            |_| format!("{}/{}/{shard}", self.resolve, self.read_rev()),
            |u| u.to_string(),
        )
    }

    /// Turns 401/403 answers into [`OriginError::AccessDenied`] with the token hint.
    pub(super) fn error(&self, e: OriginError) -> OriginError {
        match e {
            OriginError::HttpStatus {
                url,
                status: status @ (401 | 403),
            } => OriginError::AccessDenied {
                uri: format!("hf://{} ({url})", self.repo),
                hint: HF_CREDENTIALS_HINT,
                detail: format!("HTTP {status}"),
            },
            e => e,
        }
    }
}

/// Parses a revision listing; a `sha` must be a commit id (it becomes part of every URL).
fn parse_listing(api: &Url, body: &[u8]) -> Result<Listing, OriginError> {
    let listing: Listing =
        serde_json::from_slice(body).map_err(|e| bad_listing(api, e.to_string()))?;
    match &listing.sha {
        Some(sha) if !is_commit_id(sha) => Err(bad_listing(
            api,
            format!(
                "its sha {:?} is not a commit id (40 or 64 hex digits)",
                sha.chars().take(80).collect::<String>()
            ),
        )),
        _ => Ok(listing),
    }
}

fn bad_listing(api: &Url, reason: String) -> OriginError {
    OriginError::BadIndex {
        url: api.to_string(),
        reason: format!(
            "not a Hub revision listing ({{\"sha\": …, \"siblings\": [{{\"rfilename\": …}}]}}): {reason}"
        ),
    }
}

/// The token: `HF_TOKEN`, else the token file. `Ok(None)` when there is none (public
/// repositories need none); an error only when a named token file cannot be read.
fn token() -> Result<Option<String>, (PathBuf, std::io::Error)> {
    if let Ok(t) = std::env::var("HF_TOKEN")
        && !t.trim().is_empty()
    {
        return Ok(Some(t.trim().to_string()));
    }
    let (path, named) = match std::env::var_os("HF_TOKEN_PATH") {
        Some(p) => (PathBuf::from(p), true),
        None => match std::env::var_os("HF_HOME") {
            Some(home) => (PathBuf::from(home).join("token"), false),
            None => match std::env::var_os("HOME") {
                Some(home) => (PathBuf::from(home).join(".cache/huggingface/token"), false),
                None => return Ok(None),
            },
        },
    };
    match std::fs::read_to_string(&path) {
        Ok(t) if !t.trim().is_empty() => Ok(Some(t.trim().to_string())),
        Ok(_) => Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !named => Ok(None),
        Err(e) => Err((path, e)),
    }
}

/// The HTTP client for one Hub endpoint: the token as a sensitive default header, redirects
/// to the endpoint, to `https://` hosts or inside the allow-list, and the origin policy's
/// address checks.
fn hub_client(
    access: &OriginAccess,
    endpoint: &Url,
    token: Option<&str>,
) -> Result<reqwest::Client, OriginError> {
    super::install_tls_provider();
    let mut headers = header::HeaderMap::new();
    if let Some(token) = token {
        let mut value =
            header::HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
                OriginError::InvalidUri {
                    uri: "HF_TOKEN".into(),
                    reason: "the token holds characters that cannot be sent in a header".into(),
                }
            })?;
        value.set_sensitive(true);
        headers.insert(header::AUTHORIZATION, value);
    }
    let redirects = access.clone();
    let home = endpoint.origin();
    let redirect = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= MAX_REDIRECTS {
            return attempt.error(format!("more than {MAX_REDIRECTS} redirects"));
        }
        let url = attempt.url();
        if url.origin() == home || url.scheme() == "https" {
            return attempt.follow();
        }
        match redirects.policy().check(url.as_str()) {
            Ok(_) => attempt.follow(),
            Err(e) => {
                let e = redirects.refuse(e);
                attempt.error(format!("redirect refused: {e}"))
            }
        }
    });
    super::policy_client(access, redirect, headers)
}

#[cfg(test)]
mod tests {
    use shardcast_protocol::manifest::MIN_CHUNK_SIZE;
    use shardcast_protocol::{ModelName, ShardHasher};

    use super::*;

    const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

    fn open(uri: &str) -> HfSource {
        let location = OriginLocation::parse(uri).unwrap();
        HfSource::open(uri, &location, &OriginAccess::default()).unwrap()
    }

    fn shard(s: &str) -> ShardPath {
        ShardPath::new(s).unwrap()
    }

    #[test]
    fn listings_name_their_commit_or_none() {
        let api = Url::parse("https://hub.example/api/models/acme/tiny/revision/main").unwrap();
        let body = format!(
            r#"{{"id": "acme/tiny", "sha": "{SHA}", "siblings": [
                {{"rfilename": ".gitattributes", "size": 1}},
                {{"rfilename": "a/.hidden", "size": 1}},
                {{"rfilename": "config.json"}},
                {{"rfilename": "model.safetensors", "size": 9,
                  "lfs": {{"sha256": "ff", "size": 9, "pointerSize": 134}}}}]}}"#
        );
        let listing = parse_listing(&api, body.as_bytes()).unwrap();
        assert_eq!(listing.sha.as_deref(), Some(SHA));
        let files: Vec<_> = listing
            .files()
            .map(|s| (s.rfilename.as_str(), s.size))
            .collect();
        assert_eq!(
            files,
            vec![("config.json", None), ("model.safetensors", Some(9))]
        );
        // An older server: no sha, still a listing.
        let old = parse_listing(&api, br#"{"siblings": []}"#).unwrap();
        assert!(old.sha.is_none());
        // A sha that is no commit id never reaches a URL.
        let err = parse_listing(&api, br#"{"sha": "../../evil", "siblings": []}"#)
            .err()
            .unwrap();
        assert!(
            matches!(err, OriginError::BadIndex { .. })
                && err.to_string().contains("is not a commit id"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn files_are_read_at_the_commit_once_known() {
        let a = open("hf://acme/tiny@main");
        // `https://huggingface.co/acme/tiny/resolve` unless HF_ENDPOINT says otherwise.
        let base = a.resolve.to_string();
        assert!(base.ends_with("/acme/tiny/resolve"), "{base}");
        assert_eq!(
            a.url(&shard("dir/x y.bin")).unwrap().as_str(),
            format!("{base}/main/dir/x%20y.bin")
        );
        assert_eq!(
            a.api_url("main").unwrap().as_str(),
            format!("{}/main?blobs=true", a.api)
        );
        assert!(a.api.as_str().ends_with("/api/models/acme/tiny/revision"));
        a.pin(SHA, "test");
        // The first commit stays.
        a.pin(&"f".repeat(40), "test");
        assert_eq!(
            a.url(&shard("w.safetensors")).unwrap().as_str(),
            format!("{base}/{SHA}/w.safetensors")
        );

        // Another origin of the same repository, reading a model `a` built: the same
        // commit, with no request (there is no server to answer one).
        let mut h = ShardHasher::new(MIN_CHUNK_SIZE);
        h.update(b"weights");
        let manifest = Manifest::new(
            ModelName::new("acme/tiny").unwrap(),
            MIN_CHUNK_SIZE,
            vec![h.finish(shard("w.safetensors"))],
        )
        .unwrap();
        a.remember(manifest.digest());
        let b = open("hf://acme/tiny");
        b.pin_for(&manifest, 0).await.unwrap();
        assert_eq!(
            b.location(&shard("w.safetensors")),
            format!("{base}/{SHA}/w.safetensors")
        );
        // A revision that is a commit is read as it is, again with no request.
        let c = open(&format!("hf://acme/tiny@{}", "e".repeat(40)));
        c.pin_for(&manifest, 0).await.unwrap();
        assert!(
            c.location(&shard("w.safetensors"))
                .contains(&"e".repeat(40))
        );
    }
}
