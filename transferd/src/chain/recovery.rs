//! The recovery monitor of a hop session: the [`RecoveryMonitor`] decides; this task
//! watches the session's feeders and runs the fetches it asks for, from the sources
//! [`recovery_sources`] orders (live holders above, nearest first, then the origin).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use shardcast_protocol::Hop;
use tracing::{info, warn};

use super::outcome::{FetchError, RecoveryError, SessionError};
use super::proto::{
    AfterFill, RecoveryAction, RecoveryMonitor, Source, Watched, all_stalled, recovery_sources,
};
use super::session::FeederGuard;
use super::{Node, ShardSession, now, sleep_until};

/// Fetches from the fallback source a hop session tries before it fails. Rationale: one
/// retry covers a transient origin error, a third a holder that is still being filled; more
/// only delays the controller's re-plan of a receiver that cannot finish.
const RECOVERY_ATTEMPTS: u32 = 3;

/// Pulls in a row that bring nothing new before a holder is left for the next source.
/// Rationale: a live holder above that is itself still receiving has new chunks at every
/// pull; four empty pulls a quarter stall timeout apart (about a stall timeout in all) mean
/// it is starved too.
const EMPTY_PULLS: u32 = 4;

impl Node {
    /// Watches a hop session: when no upstream is feeding it and it is incomplete, waits
    /// `upstream_grace` for a replacement, then fetches what is missing from the fallback.
    pub(super) fn spawn_recovery(self: &Arc<Self>, sess: &Arc<ShardSession>) {
        let node = self.clone();
        let sess = sess.clone();
        tokio::spawn(async move {
            let mut feeders = sess.feeders.subscribe();
            let mut monitor = RecoveryMonitor::new(node.cfg.upstream_grace, RECOVERY_ATTEMPTS);
            while !node.cancel.is_cancelled() {
                let (up, stalled) = sess.upstream_view();
                let below = sess.bypassed.borrow().clone();
                let sources = recovery_sources(&up, &stalled, below.as_ref(), &sess.origin);
                let seen = Watched {
                    feeders: *feeders.borrow_and_update(),
                    complete: sess.complete(),
                    failed: sess.failed.borrow().is_some(),
                    no_failover: all_stalled(&up, &stalled),
                    has_source: !sources.is_empty(),
                };
                match monitor.poll(now(), seen) {
                    RecoveryAction::Stop => return,
                    RecoveryAction::NoSource => return sess.fail(SessionError::NoFallback),
                    RecoveryAction::Wait(until) => tokio::select! {
                        r = feeders.changed() => if r.is_err() { return },
                        () = sleep_until(until) => {}
                        _ = node.cancel.cancelled() => return,
                    },
                    RecoveryAction::Fetch { attempt } => {
                        node.stats
                            .upstream_recoveries
                            .fetch_add(1, Ordering::Relaxed);
                        info!(session = %sess.id, shard = sess.shard_index(), attempt, missing = sess.total() - sess.verified(), sources = sources.len(), "no upstream; fetching missing chunks");
                        let guard = FeederGuard::new(&sess.feeders);
                        let _ = feeders.borrow_and_update();
                        let result = node.recover_from(&sess, &sources).await;
                        drop(guard);
                        match monitor.fill_finished(result, sess.complete()) {
                            AfterFill::Stop => return,
                            AfterFill::Fail { attempts, cause } => {
                                return sess.fail(SessionError::RecoveryFailed {
                                    attempts,
                                    cause: cause.map(Arc::new),
                                });
                            }
                            AfterFill::Retry(Some(e)) => {
                                warn!(session = %sess.id, "recovery attempt failed: {e}");
                            }
                            AfterFill::Retry(None) => {}
                        }
                    }
                }
            }
        });
    }

    /// Fetches what the session lacks from `sources` in order, until it is complete.
    async fn recover_from(
        &self,
        sess: &ShardSession,
        sources: &[Source],
    ) -> Result<(), RecoveryError> {
        let mut errors = Vec::new();
        for source in sources {
            if sess.complete() {
                break;
            }
            let result = match source {
                Source::Holder(hop) => {
                    info!(session = %sess.id, holder = %hop.host, "pulling from a holder");
                    self.pull_while_progressing(sess, hop).await
                }
                Source::Origin(uri) => {
                    let missing: Vec<u32> = sess
                        .shard
                        .verified_set(sess.start, sess.end)
                        .missing()
                        .collect();
                    info!(session = %sess.id, source = %uri, missing = missing.len(), "fetching from the fallback source");
                    self.fill(sess, uri, missing).await
                }
            };
            if let Err(e) = result {
                warn!(session = %sess.id, "recovery source failed: {e}");
                errors.push(e);
            }
        }
        if sess.complete() || errors.is_empty() {
            Ok(())
        } else {
            Err(RecoveryError { failures: errors })
        }
    }

    /// Pulls from a holder above for as long as it has something new: a hop above that is
    /// still receiving has more at each pull.
    pub(super) async fn pull_while_progressing(
        &self,
        sess: &ShardSession,
        hop: &Hop,
    ) -> Result<(), FetchError> {
        let mut empty = 0;
        loop {
            let held = sess.shard.verified_set(sess.start, sess.end);
            let mut missing = held.missing();
            let span = match (missing.next(), missing.last()) {
                (Some(first), last) => first..last.unwrap_or(first).saturating_add(1),
                (None, _) => return Ok(()),
            };
            let before = sess.verified();
            // A holder that stops answering for a stall timeout is left for the next source;
            // a long pull that keeps delivering is not cut short.
            self.pull_from_holder(
                sess,
                &hop.addr,
                Some(&hop.host),
                span,
                self.cfg.stall_timeout,
            )
            .await
            .map_err(|error| FetchError::Holder {
                holder: hop.host.to_string(),
                error,
            })?;
            if sess.verified() > before {
                empty = 0;
                continue;
            }
            empty += 1;
            if empty >= EMPTY_PULLS {
                return Ok(());
            }
            tokio::time::sleep(self.cfg.stall_timeout / 4).await;
        }
    }
}
