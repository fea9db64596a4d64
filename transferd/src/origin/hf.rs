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
//! * `GET {endpoint}/api/models/{org}/{name}/revision/{revision}?blobs=true`: the
//!   revision's `siblings` (`rfilename`, and `size` with `blobs=true`);
//! * `GET {endpoint}/{org}/{name}/resolve/{revision}/{path}` with `Range`, which the Hub
//!   answers directly or by redirecting to its CDN.
//!
//! Configuration, read from transferd's environment when the origin is opened:
//! `HF_ENDPOINT` (default `https://huggingface.co`; plain `http://` only at a loopback IP
//! literal), and the token from `HF_TOKEN`, else the file `HF_TOKEN_PATH`, else
//! `$HF_HOME/token`, else `~/.cache/huggingface/token` (as `huggingface_hub` does). The
//! token is sent as `Authorization: Bearer` to the endpoint only: `reqwest` drops it when a
//! redirect leaves the endpoint's host. Redirects are followed to the endpoint itself, to
//! any `https://` host (the Hub's CDN hosts vary), or inside the allow-list; host names are
//! connected to only at addresses the origin policy permits, like every HTTP origin.

use std::path::PathBuf;

use reqwest::{StatusCode, Url, header};
use shardcast_protocol::ShardPath;
use shardcast_protocol::origin_policy::{Authority, OriginLocation};

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

/// One revision of a Hub repository.
#[derive(Debug)]
pub(super) struct HfSource {
    /// Sends the token (if any) as a default header.
    pub(super) client: reqwest::Client,
    /// `{endpoint}/{org}/{name}/resolve/{revision}/` (ends in `/`).
    pub(super) files: Url,
    /// `{endpoint}/api/models/{org}/{name}/revision/{revision}`.
    api: Url,
    /// `org/name@revision`, for messages.
    repo: String,
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
        let join = |parts: &[&str]| -> Result<Url, OriginError> {
            let mut url = endpoint.clone();
            url.path_segments_mut()
                .map_err(|()| invalid(format!("HF_ENDPOINT {endpoint_text} cannot have a path")))?
                .pop_if_empty()
                .extend(parts);
            Ok(url)
        };
        let mut api = join(&["api", "models", org, name, "revision", revision])?;
        api.query_pairs_mut().append_pair("blobs", "true");
        let files = join(&[org, name, "resolve", revision, ""])?;
        let token = token().map_err(|(path, e)| OriginError::Io {
            op: "read the Hugging Face token file",
            path,
            source: e,
        })?;
        let client = hub_client(access, &endpoint, token.as_deref())?;
        Ok(Self {
            client,
            files,
            api,
            repo: format!("{org}/{name}@{revision}"),
        })
    }

    /// The revision's files and sizes (from `siblings`; a `HEAD` for any without a size).
    pub(super) async fn list(&self) -> Result<Vec<(ShardPath, u64)>, OriginError> {
        let mut resp = self
            .client
            .get(self.api.clone())
            .send()
            .await
            .map_err(|e| http_err(&self.api, e))?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Err(OriginError::NotFound {
                location: format!(
                    "repository revision {} ({}: check the organisation, name and revision)",
                    self.repo, self.api
                ),
            });
        }
        check_status(&resp, &self.api, StatusCode::OK).map_err(|e| self.error(e))?;
        let mut body = Vec::new();
        while let Some(piece) = resp.chunk().await.map_err(|e| http_err(&self.api, e))? {
            if body.len() + piece.len() > MAX_INDEX_LEN {
                return Err(self.bad_listing(format!("larger than {MAX_INDEX_LEN} bytes")));
            }
            body.extend_from_slice(&piece);
        }
        #[derive(serde::Deserialize)]
        struct Revision {
            siblings: Vec<Sibling>,
        }
        #[derive(serde::Deserialize)]
        struct Sibling {
            rfilename: String,
            size: Option<u64>,
        }
        let revision: Revision =
            serde_json::from_slice(&body).map_err(|e| self.bad_listing(e.to_string()))?;
        let mut files = Vec::new();
        for s in revision.siblings {
            if s.rfilename
                .split('/')
                .any(|c| c.starts_with('.') || c.is_empty())
            {
                continue;
            }
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

    /// The `resolve` URL of `shard`.
    pub(super) fn url(&self, shard: &ShardPath) -> Result<Url, OriginError> {
        super::shard_url(&self.files, shard.as_str())
    }

    fn bad_listing(&self, reason: String) -> OriginError {
        OriginError::BadIndex {
            url: self.api.to_string(),
            reason: format!(
                "not a Hub revision listing ({{\"siblings\": [{{\"rfilename\": …}}]}}): {reason}"
            ),
        }
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
