//! The recovery monitor of a hop session: the [`RecoveryMonitor`] decides; this task
//! watches the session's feeders and runs the fetches it asks for.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tracing::{info, warn};

use super::proto::{AfterFill, RecoveryAction, RecoveryMonitor, Watched};
use super::session::FeederGuard;
use super::{Node, ShardSession, now, sleep_until};

/// Fetches from the fallback source a hop session tries before it fails. Rationale: one
/// retry covers a transient origin error, a third a holder that is still being filled; more
/// only delays the controller's re-plan of a receiver that cannot finish.
const RECOVERY_ATTEMPTS: u32 = 3;

impl Node {
    /// Watches a hop session: when no upstream is feeding it and it is incomplete, waits
    /// `upstream_grace` for a replacement, then fetches what is missing from the fallback.
    pub(super) fn spawn_recovery(self: &Arc<Self>, sess: &Arc<ShardSession>) {
        let node = self.clone();
        let sess = sess.clone();
        tokio::spawn(async move {
            let mut feeders = sess.feeders.subscribe();
            let mut monitor = RecoveryMonitor::new(
                node.cfg.upstream_grace,
                RECOVERY_ATTEMPTS,
                !sess.origin.is_empty(),
            );
            while !node.cancel.is_cancelled() {
                let seen = Watched {
                    feeders: *feeders.borrow_and_update(),
                    complete: sess.complete(),
                    failed: sess.failed.borrow().is_some(),
                };
                match monitor.poll(now(), seen) {
                    RecoveryAction::Stop => return,
                    RecoveryAction::Fail(why) => return sess.fail(why),
                    RecoveryAction::Wait(until) => tokio::select! {
                        r = feeders.changed() => if r.is_err() { return },
                        () = sleep_until(until) => {}
                        _ = node.cancel.cancelled() => return,
                    },
                    RecoveryAction::Fetch { attempt } => {
                        node.stats
                            .upstream_recoveries
                            .fetch_add(1, Ordering::Relaxed);
                        let missing: Vec<u32> = sess
                            .shard
                            .verified_set(sess.start, sess.end)
                            .missing()
                            .collect();
                        info!(session = %sess.id, shard = sess.shard_index(), attempt, missing = missing.len(), source = %sess.origin, "no upstream; fetching missing chunks from fallback");
                        let guard = FeederGuard::new(&sess.feeders);
                        let _ = feeders.borrow_and_update();
                        let result = node.fill(&sess, &sess.origin, missing).await;
                        drop(guard);
                        match monitor.fill_finished(result, sess.complete()) {
                            AfterFill::Stop => return,
                            AfterFill::Fail(why) => return sess.fail(why),
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
}
