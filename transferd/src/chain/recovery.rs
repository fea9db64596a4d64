//! The recovery monitor of a hop session: the [`RecoveryMonitor`] decides; this task
//! watches the session's feeders and runs the fetches it asks for, from the sources
//! [`recovery_sources`] orders (live holders above, nearest first, then the origin).
//!
//! [`Recovery`] is given a [`Fetcher`] (to pull from holders and origins), the counters
//! (`upstream_recoveries`), the shutdown token and `upstream_grace`: it sees the one session
//! it watches, and nothing of the others.
//!
//! While the monitor's grace waits for a holder above to fail over to this hop, the task
//! dials those holders once (within half the grace): one that refuses or does not finish
//! the handshake (dead, or stopped) will fail over to no one: no failover to wait for if
//! every holder above is stalled or unreachable, and such a holder is tried last, after the
//! origin (one that comes back is a source still where there is no origin). When there are
//! several and none answers, this host is more likely cut off itself, and the probe's
//! verdict is dropped (the grace runs as before; a cut-off host that read the origin first
//! went on reading it after its link came back, next to the upstream that rejoined it). A
//! killed head with a stopped hop below it (two faults in one chain) then costs
//! the hop below those two a stall timeout, not a stall timeout and a grace.
//!
//! While it reads the origin, the holders above that it could not reach are dialled again
//! every quarter grace, and the first that answers again feeds the rest (a host that was cut off
//! gets its link back and would otherwise read the rest from the origin); and the origin
//! read gives way to a hop above that rejoins the session (`Fetcher::fill_yielding`). An
//! origin read that brings nothing for a grace (the link is down: a host cut off in the
//! middle of a chain starts it during the outage) stops; once the origin answers a one-byte
//! read again, those holders are dialled at once and given a grace before the origin is
//! read (`holders_first`): the origin read otherwise resumed the moment the link came back
//! and, on a loaded host, outran the holders' handshakes (1.37 × the model from the origin
//! with two CPU hogs on 2 cores; 1.00 × with this).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardcast_protocol::{Hop, HostId};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::fetch::Fetcher;
use super::outcome::{FetchError, RecoveryError, SessionError};
use super::proto::{
    AfterFill, RecoveryAction, RecoveryMonitor, Source, Watched, all_stalled, recovery_sources,
};
use super::session::FeederGuard;
use super::{NodeStats, ShardSession, now, sleep_until};

/// Fetches from the fallback source a hop session tries before it fails. Rationale: one
/// retry covers a transient origin error, a third a holder that is still being filled; more
/// only delays the controller's re-plan of a receiver that cannot finish.
pub const RECOVERY_ATTEMPTS: u32 = 3;

/// Runs the recovery monitor of each hop session. See the module docs.
pub(super) struct Recovery {
    fetcher: Arc<Fetcher>,
    stats: Arc<NodeStats>,
    cancel: CancellationToken,
    /// How long a session without upstream waits for a replacement before it fetches.
    upstream_grace: Duration,
}

impl Recovery {
    pub(super) fn new(
        fetcher: Arc<Fetcher>,
        stats: Arc<NodeStats>,
        cancel: CancellationToken,
        upstream_grace: Duration,
    ) -> Self {
        Self {
            fetcher,
            stats,
            cancel,
            upstream_grace,
        }
    }

    /// Watches a hop session: when no upstream is feeding it and it is incomplete, waits
    /// `upstream_grace` for a replacement, then fetches what is missing from the fallback.
    pub(super) fn spawn(self: &Arc<Self>, sess: &Arc<ShardSession>) {
        let this = self.clone();
        let sess = sess.clone();
        tokio::spawn(async move {
            let mut feeders = sess.feeders.subscribe();
            let mut monitor = RecoveryMonitor::new(this.upstream_grace, RECOVERY_ATTEMPTS);
            // Holders above found unreachable in this unfed period (see `probe`): like the
            // stalled ones, they fail over to no one; they are tried last as sources.
            let mut down: HashSet<HostId> = HashSet::new();
            let mut probed = false;
            while !this.cancel.is_cancelled() {
                let (up, mut stalled) = sess.upstream_view();
                stalled.extend(down.iter().cloned());
                let below = sess.bypassed.borrow().clone();
                let mut sources = recovery_sources(&up, &stalled, below.as_ref(), &sess.origin);
                // Unreachable holders go last, after the origin: one that was only slow, or
                // comes back, is still a source when nothing else is.
                sources.extend(
                    up.iter()
                        .filter(|h| down.contains(&h.host))
                        .cloned()
                        .map(Source::Holder),
                );
                let seen = Watched {
                    feeders: *feeders.borrow_and_update(),
                    complete: sess.complete(),
                    failed: sess.failed.borrow().is_some(),
                    no_failover: all_stalled(&up, &stalled),
                    has_source: !sources.is_empty(),
                };
                if seen.feeders > 0 {
                    (probed, down) = (false, HashSet::new());
                }
                match monitor.poll(now(), seen) {
                    RecoveryAction::Stop => return,
                    RecoveryAction::NoSource => return sess.fail(SessionError::NoFallback),
                    // The grace waits for a holder above to fail over to this hop. One that
                    // cannot be reached will not: once per unfed period, dial them, and fetch
                    // at once if none is left.
                    RecoveryAction::Wait(Some(_)) if !probed => {
                        probed = true;
                        let live: Vec<Hop> = up
                            .iter()
                            .filter(|h| !stalled.contains(&h.host))
                            .cloned()
                            .collect();
                        let gone = this.probe(&sess, &live).await;
                        // Several holders above, every one out of reach at once: more likely
                        // this host is cut off than they all failed. Then their verdict is
                        // not trusted (a failover may still come once the link is back, and
                        // the origin is likely out of reach too): the grace runs as before.
                        if gone.len() >= 2 && gone.len() == live.len() {
                            info!(session = %sess.id, shard = sess.shard_index(), unreachable = ?gone, "no holder above can be reached: this host may be cut off; waiting out the grace");
                        } else if !gone.is_empty() {
                            this.stats
                                .upstream_holders_unreachable
                                .fetch_add(gone.len() as u64, Ordering::Relaxed);
                            info!(session = %sess.id, shard = sess.shard_index(), unreachable = ?gone, "holders above cannot be reached; they will not fail over to this hop");
                            down.extend(gone);
                        }
                    }
                    RecoveryAction::Wait(until) => tokio::select! {
                        r = feeders.changed() => if r.is_err() { return },
                        () = sleep_until(until) => {}
                        _ = this.cancel.cancelled() => return,
                    },
                    RecoveryAction::Fetch { attempt } => {
                        this.stats
                            .upstream_recoveries
                            .fetch_add(1, Ordering::Relaxed);
                        info!(session = %sess.id, shard = sess.shard_index(), attempt, missing = sess.total() - sess.verified(), sources = sources.len(), "no upstream; fetching missing chunks");
                        let guard = FeederGuard::new(&sess.feeders);
                        let _ = feeders.borrow_and_update();
                        let result = this.recover_from(&sess, &sources).await;
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

    /// The holders of `hops` that cannot be reached within half the upstream grace: the
    /// connection or its handshake fails (a process that died: refused at once) or does not
    /// finish (a stopped process, whose kernel still completes the TCP handshake).
    async fn probe(&self, sess: &ShardSession, hops: &[Hop]) -> Vec<HostId> {
        let within = self.upstream_grace / 2;
        let tries = hops.iter().map(|hop| async move {
            let reached = self.fetcher.reach(sess.transport, hop, within).await;
            (!reached).then(|| hop.host.clone())
        });
        futures::future::join_all(tries)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Fetches what the session lacks from `sources` in order, until it is complete. A
    /// holder above that could not be reached (its pull failed, or the probe found it out of
    /// reach) is watched while the origin is read: once it answers again, the origin read
    /// stops and the rest comes from it (see [`Self::read_origin_watching`]).
    async fn recover_from(
        &self,
        sess: &ShardSession,
        sources: &[Source],
    ) -> Result<(), RecoveryError> {
        let mut errors = Vec::new();
        let mut unreached: Vec<Hop> = Vec::new();
        for (at, source) in sources.iter().enumerate() {
            if sess.complete() {
                break;
            }
            let result = match source {
                Source::Holder(hop) => {
                    info!(session = %sess.id, holder = %hop.host, "pulling from a holder");
                    let r = self.fetcher.pull_while_progressing(sess, hop).await;
                    if r.is_err() {
                        unreached.push(hop.clone());
                    }
                    r
                }
                Source::Origin(uri) => {
                    // The holders listed after the origin are the ones found out of reach.
                    unreached.extend(sources[at + 1..].iter().filter_map(|s| match s {
                        Source::Holder(hop) => Some(hop.clone()),
                        Source::Origin(_) => None,
                    }));
                    let missing = sess.total() - sess.verified();
                    info!(session = %sess.id, source = %uri, missing, "fetching from the fallback source");
                    self.read_origin_watching(sess, uri, &mut unreached).await
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

    /// Reads what the session lacks from the origin `uri` while dialling the holders in
    /// `unreached` again and again (`first_back`): the first that answers is pulled from instead (and
    /// leaves the list), then the origin read goes on for whatever is still missing. A host
    /// that was cut off reaches its origin and the holders above at the same moment when
    /// its link comes back; without this it read the rest of the model from the origin
    /// (1.75 × the model's bytes in all, with a 64 MiB model and a 4-host chain).
    async fn read_origin_watching(
        &self,
        sess: &ShardSession,
        uri: &str,
        unreached: &mut Vec<Hop>,
    ) -> Result<(), FetchError> {
        // Whether an origin read that brings nothing for a grace is stopped: not after a
        // round in which the origin answered and no holder did (the origin is then simply
        // this slow: an origin that takes longer than a grace per chunk would otherwise be
        // stopped again and again, its reads in flight dropped each time).
        let mut watch_stall = true;
        loop {
            // `first_back` needs at least one holder to dial.
            if unreached.is_empty() {
                return self.fetcher.fill_yielding(sess, uri).await;
            }
            // Dropping the origin read between or inside a store is safe: a chunk's claim is
            // released, and a chunk written twice is the same verified bytes.
            let back = tokio::select! {
                r = self.fetcher.fill_yielding(sess, uri) => return r,
                hop = self.first_back(sess, unreached, self.upstream_grace / 4) => hop,
                () = stalled(sess, self.upstream_grace), if watch_stall => {
                    self.stats.origin_reads_stalled.fetch_add(1, Ordering::Relaxed);
                    info!(session = %sess.id, have = sess.verified(), total = sess.total(), "the origin read brings nothing (link or origin gone): the holders above get the first word once the origin answers again");
                    match self.holders_first(sess, uri, unreached).await {
                        HoldersFirst::Back(hop) => hop,
                        HoldersFirst::OriginOnly => {
                            watch_stall = false;
                            continue;
                        }
                        HoldersFirst::PeerFed => continue,
                    }
                }
            };
            unreached.retain(|h| h.host != back.host);
            self.stats
                .holders_back_during_origin_read
                .fetch_add(1, Ordering::Relaxed);
            info!(session = %sess.id, holder = %back.host, missing = sess.total() - sess.verified(), "a holder above answers again: pulling from it instead of the origin");
            if let Err(e) = self.fetcher.pull_while_progressing(sess, &back).await {
                warn!(session = %sess.id, "pulling from the holder that came back failed: {e}");
            }
            if sess.complete() {
                return Ok(());
            }
        }
    }

    /// After the origin read stalled ([`stalled`]): waits until a holder of `unreached`
    /// answers, or the origin does; then dials the holders at once and gives them one grace
    /// before the origin is read again. A host whose link was down reaches the origin and
    /// its peers at the same moment when it comes back, and a resumed origin read used to
    /// win that race under load (a cut-off host read the model 1.4–1.7 × from the origin).
    /// If a peer starts feeding the shard meanwhile (a hop above rejoined), returns once it
    /// stops bringing chunks. Bounded: an origin silent for 30 s is read
    /// again (and fails the attempt as it would have): see [`Fetcher::until_origin_answers`].
    async fn holders_first(
        &self,
        sess: &ShardSession,
        uri: &str,
        unreached: &[Hop],
    ) -> HoldersFirst {
        let grace = self.upstream_grace;
        tokio::select! {
            hop = self.first_back(sess, unreached, grace / 4) => return HoldersFirst::Back(hop),
            () = self.fetcher.until_origin_answers(sess, uri, grace) => {}
            () = grows(sess) => {
                self.fetcher.wait_while_growing(sess).await;
                return HoldersFirst::PeerFed;
            }
        }
        info!(session = %sess.id, "the origin answers again: dialling the holders above before reading it");
        tokio::select! {
            hop = self.first_back(sess, unreached, Duration::ZERO) => HoldersFirst::Back(hop),
            () = tokio::time::sleep(grace) => HoldersFirst::OriginOnly,
            () = grows(sess) => {
                self.fetcher.wait_while_growing(sess).await;
                HoldersFirst::PeerFed
            }
        }
    }

    /// The first of `hops` that answers a connection. Each is dialled `first` from now,
    /// then a quarter grace after each try ended, and given a whole grace to finish the
    /// handshake (a loaded host answers slowly, and a returning holder must win the race
    /// against the origin read, which resumes the moment the link is back). Never returns
    /// while none answers; `hops` must not be empty.
    async fn first_back(&self, sess: &ShardSession, hops: &[Hop], first: Duration) -> Hop {
        let (pause, within) = (self.upstream_grace / 4, self.upstream_grace);
        let tries = hops.iter().map(|hop| {
            Box::pin(async move {
                tokio::time::sleep(first).await;
                loop {
                    if self.fetcher.reach(sess.transport, hop, within).await {
                        return hop.clone();
                    }
                    tokio::time::sleep(pause).await;
                }
            })
        });
        futures::future::select_all(tries).await.0
    }
}

/// How [`Recovery::holders_first`] ended.
enum HoldersFirst {
    /// A holder above answers: pull from it.
    Back(Hop),
    /// The origin answers and no holder did within a grace after: read the origin.
    OriginOnly,
    /// A peer fed the shard for a while, then stopped: read the origin for the rest.
    PeerFed,
}

/// Returns once the session's shard has not grown for `quiet`: the origin read brings
/// nothing.
async fn stalled(sess: &ShardSession, quiet: Duration) {
    let mut grown = sess.shard.subscribe();
    grown.borrow_and_update();
    loop {
        match tokio::time::timeout(quiet, grown.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return std::future::pending().await,
            Err(_) => return,
        }
    }
}

/// Returns once the session's shard grows (a peer, or a rejoined hop above, feeds it).
async fn grows(sess: &ShardSession) {
    let mut grown = sess.shard.subscribe();
    grown.borrow_and_update();
    if grown.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}
