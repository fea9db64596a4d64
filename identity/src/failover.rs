//! A gRPC client channel over several controller replicas that follows the leader.
//!
//! Controller replicas on etcd elect one leader; the others refuse writes (and heartbeats)
//! with `UNAVAILABLE` and the leader's address in the `x-shardcast-leader` metadata key.
//! [`FailoverChannel`] sends each call to the replica that answered last; on a refusal
//! that names the leader it resends to the leader at once, and on a connection failure or
//! a refusal without a leader (an election in progress) it tries the next replica, round
//! after round, until `patience` runs out. Then the caller gets the last answer. With one
//! address it is a plain channel.
//!
//! Each request's body is buffered so it can be sent again: fine for the controller's
//! unary and server-streaming calls (its API has no client-streaming call).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tonic::transport::Channel;
use tower::ServiceExt;

use crate::grpc::{AddrError, ClientSecurity};

/// Metadata key naming the leader on a follower's refusal (empty when none is known).
pub const LEADER_HEADER: &str = "x-shardcast-leader";

/// The largest request body buffered for a resend.
const MAX_BUFFERED: usize = 128 << 20;

/// See the module documentation.
#[derive(Clone)]
pub struct FailoverChannel {
    inner: Arc<Inner>,
}

struct Inner {
    addrs: Vec<String>,
    channels: Vec<Channel>,
    current: AtomicUsize,
    patience: Duration,
}

/// Splits a comma-separated list of addresses.
pub fn split_addrs(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn bare(addr: &str) -> &str {
    addr.trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
}

impl FailoverChannel {
    /// Lazy channels to each of `addrs` (`host:port`, `http://host:port` or
    /// `unix:/path`); a call keeps trying for at most `patience` while no replica takes it.
    pub fn new(
        addrs: &[String],
        security: ClientSecurity,
        patience: Duration,
    ) -> Result<Self, AddrError> {
        let mut channels = Vec::with_capacity(addrs.len());
        for a in addrs {
            channels.push(crate::grpc::lazy(a, security.clone())?);
        }
        if channels.is_empty() {
            return Err(AddrError {
                addr: String::new(),
                reason: "no controller address given".into(),
            });
        }
        Ok(Self {
            inner: Arc::new(Inner {
                addrs: addrs.to_vec(),
                channels,
                current: AtomicUsize::new(0),
                patience,
            }),
        })
    }

    /// The address calls go to first now (the replica that answered last).
    pub fn current(&self) -> &str {
        let i = self.inner.current.load(Ordering::Relaxed) % self.inner.addrs.len();
        &self.inner.addrs[i]
    }
}

/// What a response says about the replica that sent it.
enum Verdict {
    /// An answer for the caller (success or an error of the call itself).
    Done,
    /// A follower's refusal, naming the leader (or not).
    NotLeader(Option<String>),
}

fn verdict(resp: &http::Response<tonic::body::Body>) -> Verdict {
    let h = resp.headers();
    if h.get("grpc-status").and_then(|v| v.to_str().ok()) != Some("14") {
        return Verdict::Done;
    }
    match h.get(LEADER_HEADER).map(|v| v.to_str().unwrap_or_default()) {
        None => Verdict::Done,
        Some("") => Verdict::NotLeader(None),
        Some(l) => Verdict::NotLeader(Some(l.to_string())),
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for FailoverChannel {
    type Response = http::Response<tonic::body::Body>;
    type Error = tonic::transport::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move {
            let n = inner.channels.len();
            if n == 1 {
                // One controller: nothing to fail over to; errors reach the caller at once.
                return inner.channels[0].clone().oneshot(req).await;
            }
            let (parts, body) = req.into_parts();
            // A body that cannot be buffered (too large, or failing) goes once, as is.
            let bytes: Option<Bytes> = match http_body_util::Limited::new(body, MAX_BUFFERED)
                .collect()
                .await
            {
                Ok(c) => Some(c.to_bytes()),
                Err(_) => None,
            };
            let rebuild = |bytes: &Bytes| {
                let mut b = http::Request::builder()
                    .method(parts.method.clone())
                    .uri(parts.uri.clone())
                    .version(parts.version);
                if let Some(h) = b.headers_mut() {
                    *h = parts.headers.clone();
                }
                b.body(tonic::body::Body::new(Full::new(bytes.clone())))
            };
            let deadline = Instant::now() + inner.patience;
            let mut i = inner.current.load(Ordering::Relaxed) % n;
            let mut misses = 0usize;
            loop {
                let Some(bytes) = &bytes else {
                    let req = http::Request::from_parts(parts, tonic::body::Body::empty());
                    return inner.channels[i].clone().oneshot(req).await;
                };
                let Ok(req) = rebuild(bytes) else {
                    // Parts of a request that was valid: cannot fail; answer as the
                    // channel would have for a request it could not send.
                    let req = http::Request::from_parts(parts, tonic::body::Body::empty());
                    return inner.channels[i].clone().oneshot(req).await;
                };
                let r = inner.channels[i].clone().oneshot(req).await;
                let next = match &r {
                    Ok(resp) => match verdict(resp) {
                        Verdict::Done => {
                            inner.current.store(i, Ordering::Relaxed);
                            return r;
                        }
                        Verdict::NotLeader(Some(l)) => inner
                            .addrs
                            .iter()
                            .position(|a| bare(a) == bare(&l))
                            .filter(|&j| j != i),
                        Verdict::NotLeader(None) => None,
                    },
                    Err(_) => None,
                };
                misses += 1;
                if Instant::now() >= deadline {
                    return r;
                }
                match next {
                    Some(j) => i = j,
                    None => {
                        i = (i + 1) % n;
                        // A whole round without a leader: an election is in progress.
                        if misses % n == 0 {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(
            split_addrs(" a:1, b:2,,c:3 "),
            vec!["a:1".to_string(), "b:2".into(), "c:3".into()]
        );
        assert_eq!(bare("http://127.0.0.1:5/"), "127.0.0.1:5");
    }
}
