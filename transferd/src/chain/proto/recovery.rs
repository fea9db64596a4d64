//! [`RecoveryMonitor`]: when a hop stops waiting for its upstream and fetches what it lacks.
//!
//! A session is fed while some upstream connection or fill task is writing into it. When
//! nothing has fed an incomplete session for `upstream_grace` (time for the upstream's
//! upstream to fail over to this hop), the monitor asks for a fetch of the missing chunks
//! from its sources; a session without any fails. When every holder above this hop was
//! found stalled, nobody can fail over to it, and the fetch starts at once. A fetch that
//! leaves the session incomplete is retried after another grace period, up to
//! `max_attempts` in all.
//!
//! The sources, in order ([`recovery_sources`]): the holders above this hop, nearest
//! first, except those found stalled, then the hop below if it bypassed this one, then the
//! origin. So a hop that comes back after a
//! stall (or restarts) pulls from the hop above it, and the origin is read only for what no
//! live holder above has.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use shardcast_protocol::{Hop, HostId};

/// What the monitor observes of its session at each poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Watched {
    /// Upstream connections and fill tasks writing into the session now.
    pub feeders: usize,
    /// Every chunk of the range is verified here.
    pub complete: bool,
    /// The session failed (it cannot complete here).
    pub failed: bool,
    /// Every holder above this hop was found stalled: no failover will come.
    pub no_failover: bool,
    /// There is a source to fetch from (a live holder above, or an origin).
    pub has_source: bool,
}

/// Where a recovering hop fetches from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A holder above this hop (`Fetch`), named by its certificate's host id.
    Holder(Hop),
    /// An origin URI, or `shardcast://host:port` for a holder the plan named.
    Origin(String),
}

/// The sources of a recovery, in the order to try them: the holders above (nearest first)
/// not found stalled, then the hop below that bypassed this one (`below`: it answered
/// `AlreadyFed` — it is fed by someone else and holds at least what this hop has sent it),
/// then the origin (if any). Reading the origin last keeps a hop that was stopped or cut
/// off from taking the origin's bandwidth from the hosts it was bypassed for.
pub fn recovery_sources(
    upstream: &[Hop],
    stalled: &HashSet<HostId>,
    below: Option<&Hop>,
    origin: &str,
) -> Vec<Source> {
    upstream
        .iter()
        .chain(below)
        .filter(|h| !stalled.contains(&h.host))
        .cloned()
        .map(Source::Holder)
        .chain((!origin.is_empty()).then(|| Source::Origin(origin.to_string())))
        .collect()
}

/// Whether every holder above was found stalled (and there was at least one).
pub fn all_stalled(upstream: &[Hop], stalled: &HashSet<HostId>) -> bool {
    !upstream.is_empty() && upstream.iter().all(|h| stalled.contains(&h.host))
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoveryAction {
    /// Wait for a change of the feeders, or until the instant given.
    Wait(Option<Instant>),
    /// Fetch the missing chunks from the fallback source (attempt `attempt`), then report
    /// [`RecoveryMonitor::fill_finished`].
    Fetch {
        /// 1 for the first attempt.
        attempt: u32,
    },
    /// Nothing fed the session for the grace period and it has no source to fetch from:
    /// fail it and stop.
    NoSource,
    /// Nothing more to do: the session completed or failed.
    Stop,
}

/// What follows a fetch from the fallback source that ended with an error of type `E`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterFill<E> {
    /// The session is complete.
    Stop,
    /// Poll again (after another grace period); the fetch's error, if it had one.
    Retry(Option<E>),
    /// Every attempt was made: fail the session. `cause`: the last fetch's error (`None`:
    /// it ended without one, but the source lacked chunks).
    Fail {
        /// Fetches made.
        attempts: u32,
        /// The last fetch's error.
        cause: Option<E>,
    },
}

/// The recovery decisions of one hop session. See the module docs.
#[derive(Debug)]
pub struct RecoveryMonitor {
    grace: Duration,
    max_attempts: u32,
    attempts: u32,
    /// Since when nothing feeds the session.
    unfed_since: Option<Instant>,
}

impl RecoveryMonitor {
    /// A monitor that waits `grace` for a failover and fetches at most `max_attempts` times.
    pub fn new(grace: Duration, max_attempts: u32) -> Self {
        Self {
            grace,
            max_attempts,
            attempts: 0,
            unfed_since: None,
        }
    }

    /// The next action, given what the session looks like at `now`.
    pub fn poll(&mut self, now: Instant, seen: Watched) -> RecoveryAction {
        if seen.complete || seen.failed {
            return RecoveryAction::Stop;
        }
        if seen.feeders > 0 {
            self.unfed_since = None;
            return RecoveryAction::Wait(None);
        }
        let since = *self.unfed_since.get_or_insert(now);
        let grace = if seen.no_failover {
            Duration::ZERO
        } else {
            self.grace
        };
        let deadline = since + grace;
        if now < deadline {
            return RecoveryAction::Wait(Some(deadline));
        }
        self.unfed_since = None;
        self.attempts += 1;
        if !seen.has_source {
            return RecoveryAction::NoSource;
        }
        RecoveryAction::Fetch {
            attempt: self.attempts,
        }
    }

    /// A fetch from the fallback source ended with `result`; `complete`: the range is now
    /// verified here.
    pub fn fill_finished<E>(&mut self, result: Result<(), E>, complete: bool) -> AfterFill<E> {
        match result {
            Ok(()) if complete => AfterFill::Stop,
            r if self.attempts >= self.max_attempts => AfterFill::Fail {
                attempts: self.attempts,
                cause: r.err(),
            },
            r => AfterFill::Retry(r.err()),
        }
    }
}
