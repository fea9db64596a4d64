//! `s3://bucket/prefix` origins through the `object_store` crate (AWS S3 and S3-compatible
//! servers: MinIO, Ceph RGW, moto, …).
//!
//! Configuration comes from the environment, read by [`AmazonS3Builder::from_env`] when
//! the origin is opened: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
//! `AWS_REGION` / `AWS_DEFAULT_REGION` (default `us-east-1`), `AWS_ENDPOINT_URL` (or
//! `AWS_ENDPOINT`, `AWS_ENDPOINT_URL_S3`) for S3-compatible servers (path-style requests),
//! web identity (`AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN`), ECS container
//! credentials, and finally the EC2 instance metadata service. `object_store` does **not**
//! read the shared `~/.aws/credentials` / `~/.aws/config` profile files, so `AWS_PROFILE`
//! has no effect: export the keys, or use an instance or web-identity role.
//!
//! Security: a plain-`http://` endpoint is accepted only at a loopback IP literal (a local
//! test server); anything else must be `https://`. The requests go through the same
//! `reqwest` client set-up as HTTP origins ([`super::http_client`]): no proxy from the
//! environment, redirects only inside the allow-list, and host names connected to only at
//! addresses the origin policy permits. The allow-list itself (`s3://bucket/prefix/`
//! entries) is checked in [`super::Origin::parse`] before any request.
//!
//! Retries: `object_store` retries a request that fails with a 5xx (including S3's
//! `503 SlowDown`), 429 or 408, or a connection error, with exponential backoff and full
//! jitter ([`RetryConfig`]: here at most [`S3_MAX_RETRIES`] retries within
//! [`S3_RETRY_TIMEOUT`]). It does not look at `Retry-After`, so the HTTP service below
//! ([`RetryAfterService`]) waits for a 429/503's `Retry-After` (in seconds, at most
//! [`MAX_RETRY_AFTER`]) before handing the response back to `object_store`, which then
//! adds its own jittered pause. On top of that, [`super::fetch_chunks`] retries a chunk
//! whose bytes fail verification, like for every origin.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::client::{
    ClientOptions, HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService,
};
use object_store::path::Path as StorePath;
use object_store::{BackoffConfig, ObjectStore, ObjectStoreExt, RetryConfig};
use reqwest::{StatusCode, Url, header};
use shardcast_protocol::ShardPath;
use shardcast_protocol::origin_policy::{Authority, OriginLocation};
use tokio::sync::OnceCell;

use super::{OriginAccess, OriginError, error_chain};

/// Retries `object_store` makes per request. Rationale: enough to ride out a few seconds of
/// `SlowDown`; [`super::fetch_chunks`] retries a failed chunk again on top.
pub(super) const S3_MAX_RETRIES: usize = 5;

/// Longest `object_store` keeps retrying one request.
pub(super) const S3_RETRY_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest `Retry-After` honoured; a server asking for more gets this much (and
/// `object_store`'s own backoff on top), so one throttled request cannot stall a chunk for
/// minutes.
pub(super) const MAX_RETRY_AFTER: Duration = Duration::from_secs(20);

/// What to check when S3 refuses a request.
const S3_CREDENTIALS_HINT: &str = "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and \
    AWS_SESSION_TOKEN in transferd's environment, or its instance / web-identity role, and \
    the bucket policy";

/// An S3 bucket and key prefix.
#[derive(Debug)]
pub(super) struct S3Source {
    store: Arc<AmazonS3>,
    bucket: String,
    /// The key prefix as written, without leading or trailing `/` (empty: the whole bucket).
    key: String,
    /// The URI ended in `/` (or named the bucket alone): a prefix, never one object.
    dir: bool,
    /// Whether a URI without a trailing `/` names one object (decided on first use).
    single: OnceCell<bool>,
}

impl S3Source {
    /// Sets up the client for an allowed `s3://` location. Does no network I/O.
    pub(super) fn open(
        uri: &str,
        location: &OriginLocation,
        access: &OriginAccess,
    ) -> Result<Self, OriginError> {
        let invalid = |reason: String| OriginError::invalid_uri(uri, reason);
        let Authority::Bucket(bucket) = location.authority() else {
            return Err(invalid("no bucket".into()));
        };
        let key = location.segments().join("/");
        let dir = key.is_empty() || uri.ends_with('/');
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_retry(RetryConfig {
                backoff: BackoffConfig::default(),
                max_retries: S3_MAX_RETRIES,
                retry_timeout: S3_RETRY_TIMEOUT,
            })
            .with_http_connector(S3Connector {
                access: access.clone(),
            });
        let endpoint = builder
            .get_config_value(&AmazonS3ConfigKey::S3Endpoint)
            .or_else(|| builder.get_config_value(&AmazonS3ConfigKey::Endpoint));
        let plain_http = match &endpoint {
            None => false,
            Some(e) => {
                let url = Url::parse(e).map_err(|err| {
                    invalid(format!(
                        "the S3 endpoint {e:?} (AWS_ENDPOINT_URL) is not a URL: {err}"
                    ))
                })?;
                match url.scheme() {
                    "https" => false,
                    "http" if loopback_literal(&url) => true,
                    _ => {
                        return Err(invalid(format!(
                            "the S3 endpoint {e} (AWS_ENDPOINT_URL) must be https:// (plain http \
                             only at a loopback address such as http://127.0.0.1:9000)"
                        )));
                    }
                }
            }
        };
        // Overrides AWS_ALLOW_HTTP from the environment: plain HTTP only to loopback.
        builder = builder.with_allow_http(plain_http);
        let store = builder.build().map_err(|e| invalid(error_chain(&e)))?;
        Ok(Self {
            store: Arc::new(store),
            bucket: bucket.clone(),
            key,
            dir,
            single: OnceCell::new(),
        })
    }

    /// `s3://bucket/key`, for messages.
    pub(super) fn object_uri(&self, key: &str) -> String {
        format!("s3://{}/{key}", self.bucket)
    }

    /// Whether the origin is one object (the URI's key) rather than a prefix.
    async fn single(&self) -> Result<bool, OriginError> {
        if self.dir {
            return Ok(false);
        }
        self.single
            .get_or_try_init(|| async {
                match self.store.head(&StorePath::from(self.key.as_str())).await {
                    Ok(_) => Ok(true),
                    Err(object_store::Error::NotFound { .. }) => Ok(false),
                    Err(e) => Err(self.error(&self.key, e)),
                }
            })
            .await
            .copied()
    }

    /// The object key holding `shard`.
    async fn key_of(&self, shard: &ShardPath) -> Result<String, OriginError> {
        if self.single().await? {
            let name = self.key.rsplit('/').next().unwrap_or_default();
            return if name == shard.as_str() {
                Ok(self.key.clone())
            } else {
                Err(OriginError::NoSuchObject {
                    uri: format!(
                        "{} (the origin is the single object {})",
                        shard,
                        self.object_uri(&self.key)
                    ),
                })
            };
        }
        Ok(if self.key.is_empty() {
            shard.as_str().to_string()
        } else {
            format!("{}/{}", self.key, shard.as_str())
        })
    }

    /// Every object under the prefix (or the one object), as shard paths relative to it.
    /// Keys with a component starting with `.` are skipped, like hidden local files.
    pub(super) async fn list(&self) -> Result<Vec<(ShardPath, u64)>, OriginError> {
        if self.single().await? {
            let meta = self
                .store
                .head(&StorePath::from(self.key.as_str()))
                .await
                .map_err(|e| self.error(&self.key, e))?;
            let name = self.key.rsplit('/').next().unwrap_or_default();
            let shard = ShardPath::new(name).map_err(|e| OriginError::BadName {
                path: name.to_string(),
                reason: e.to_string(),
            })?;
            return Ok(vec![(shard, meta.size)]);
        }
        let prefix = (!self.key.is_empty()).then(|| StorePath::from(self.key.as_str()));
        let mut listing = self.store.list(prefix.as_ref());
        let mut files = Vec::new();
        while let Some(meta) = listing.next().await {
            let meta = meta.map_err(|e| self.error(&self.key, e))?;
            let key = meta.location.as_ref();
            let rel = if self.key.is_empty() {
                key
            } else {
                match key
                    .strip_prefix(self.key.as_str())
                    .and_then(|r| r.strip_prefix('/'))
                {
                    Some(r) => r,
                    None => continue,
                }
            };
            if rel.split('/').any(|s| s.starts_with('.') || s.is_empty()) {
                continue;
            }
            let shard = ShardPath::new(rel).map_err(|e| OriginError::BadName {
                path: rel.to_string(),
                reason: e.to_string(),
            })?;
            files.push((shard, meta.size));
        }
        if files.is_empty() {
            let what = if self.dir {
                "no objects under that prefix"
            } else {
                "neither an object nor a prefix holding objects"
            };
            return Err(OriginError::NoSuchObject {
                uri: format!("{} ({what})", self.object_uri(&self.key)),
            });
        }
        Ok(files)
    }

    /// Streams `shard` whole, handing each piece to `each`; returns the byte count.
    pub(super) async fn stream(
        &self,
        shard: &ShardPath,
        mut each: impl FnMut(&[u8]),
    ) -> Result<(String, u64), OriginError> {
        let key = self.key_of(shard).await?;
        let got = self
            .store
            .get(&StorePath::from(key.as_str()))
            .await
            .map_err(|e| self.error(&key, e))?;
        let mut body = got.into_stream();
        let mut read = 0u64;
        while let Some(piece) = body.next().await {
            let piece = piece.map_err(|e| self.error(&key, e))?;
            each(&piece);
            read += piece.len() as u64;
        }
        Ok((self.object_uri(&key), read))
    }

    /// Reads `len` bytes at `offset` of `shard` (one ranged GET).
    pub(super) async fn read_range(
        &self,
        shard: &ShardPath,
        offset: u64,
        len: usize,
    ) -> Result<Bytes, OriginError> {
        let key = self.key_of(shard).await?;
        let short = |got: u64| OriginError::ShortRead {
            location: self.object_uri(&key),
            offset,
            expected: len as u64,
            got,
        };
        let end = offset.checked_add(len as u64).ok_or_else(|| short(0))?;
        let data = self
            .store
            .get_range(&StorePath::from(key.as_str()), offset..end)
            .await
            .map_err(|e| self.error(&key, e))?;
        if data.len() != len {
            return Err(short(data.len() as u64));
        }
        Ok(data)
    }

    /// `s3://bucket/key` for messages about `shard`.
    pub(super) fn location(&self, shard: &ShardPath) -> String {
        if self.key.is_empty() {
            self.object_uri(shard.as_str())
        } else if self.dir {
            self.object_uri(&format!("{}/{}", self.key, shard))
        } else {
            format!("{} ({shard})", self.object_uri(&self.key))
        }
    }

    /// Maps an `object_store` error about `key` to an [`OriginError`] that says what to do.
    fn error(&self, key: &str, e: object_store::Error) -> OriginError {
        let uri = self.object_uri(key);
        match e {
            object_store::Error::NotFound { .. } => OriginError::NoSuchObject { uri },
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => OriginError::AccessDenied {
                uri,
                hint: S3_CREDENTIALS_HINT,
                detail: error_chain(&e),
            },
            e => {
                // List requests and some servers report refusals as generic errors; the
                // S3 error codes in the body tell them apart.
                let text = error_chain(&e);
                if [
                    "InvalidAccessKeyId",
                    "SignatureDoesNotMatch",
                    "AccessDenied",
                    "403 Forbidden",
                ]
                .iter()
                .any(|code| text.contains(code))
                {
                    OriginError::AccessDenied {
                        uri,
                        hint: S3_CREDENTIALS_HINT,
                        detail: text,
                    }
                } else if text.contains("NoSuchBucket") {
                    OriginError::NoSuchObject {
                        uri: format!("{uri} (no such bucket {})", self.bucket),
                    }
                } else {
                    OriginError::ObjectStore { uri, source: e }
                }
            }
        }
    }
}

/// Whether `url`'s host is a loopback IP literal.
pub(super) fn loopback_literal(url: &Url) -> bool {
    url.host_str()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
        .and_then(|h| h.parse::<IpAddr>().ok())
        .is_some_and(|a| a.is_loopback())
}

/// Hands `object_store` the origin's policy-checked HTTP client, wrapped to honour
/// `Retry-After`.
#[derive(Debug)]
struct S3Connector {
    access: OriginAccess,
}

impl HttpConnector for S3Connector {
    fn connect(&self, _options: &ClientOptions) -> object_store::Result<HttpClient> {
        let client =
            super::http_client(&self.access).map_err(|e| object_store::Error::Generic {
                store: "S3",
                source: Box::new(e),
            })?;
        Ok(HttpClient::new(RetryAfterService { client }))
    }
}

/// A `reqwest` client that, on a 429 or 503 answer carrying `Retry-After: <seconds>`,
/// waits that long (at most [`MAX_RETRY_AFTER`]) before returning the answer, so that
/// `object_store`'s retry (which ignores the header) comes no earlier than the server
/// asked.
#[derive(Debug)]
pub(super) struct RetryAfterService {
    client: reqwest::Client,
}

impl HttpService for RetryAfterService {
    // `HttpService` is declared with `#[async_trait]`; this is its expansion.
    fn call<'a, 'b>(
        &'a self,
        req: HttpRequest,
    ) -> Pin<Box<dyn Future<Output = Result<HttpResponse, HttpError>> + Send + 'b>>
    where
        'a: 'b,
        Self: 'b,
    {
        Box::pin(async move {
            let resp = HttpService::call(&self.client, req).await?;
            if matches!(
                resp.status(),
                StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
            ) && let Some(wait) = retry_after(resp.headers())
            {
                let wait = wait.min(MAX_RETRY_AFTER);
                tracing::info!(
                    status = resp.status().as_u16(),
                    wait_ms = wait.as_millis() as u64,
                    "object store asked to retry later; waiting for Retry-After"
                );
                tokio::time::sleep(wait).await;
            }
            Ok(resp)
        })
    }
}

/// A `Retry-After` header in seconds (the HTTP-date form is not used by S3 and is ignored).
pub(super) fn retry_after(headers: &header::HeaderMap) -> Option<Duration> {
    headers
        .get(header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_seconds() {
        let mut h = header::HeaderMap::new();
        assert_eq!(retry_after(&h), None);
        h.insert(header::RETRY_AFTER, "2".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert(
            header::RETRY_AFTER,
            "Wed, 21 Oct 2015 07:28:00 GMT".parse().unwrap(),
        );
        assert_eq!(retry_after(&h), None);
    }
}
