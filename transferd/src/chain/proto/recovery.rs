//! [`RecoveryMonitor`]: when a hop stops waiting for its upstream and fetches what it lacks.
//!
//! A session is fed while some upstream connection or fill task is writing into it. When
//! nothing has fed an incomplete session for `upstream_grace` (time for the upstream's
//! upstream to fail over to this hop), the monitor asks for a fetch of the missing chunks
//! from the session's fallback source; a session without one fails. A fetch that leaves the
//! session incomplete is retried after another grace period, up to `max_attempts` in all.

use std::time::{Duration, Instant};

/// What the monitor observes of its session at each poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Watched {
    /// Upstream connections and fill tasks writing into the session now.
    pub(crate) feeders: usize,
    /// Every chunk of the range is verified here.
    pub(crate) complete: bool,
    /// The session failed (it cannot complete here).
    pub(crate) failed: bool,
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RecoveryAction {
    /// Wait for a change of the feeders, or until the instant given.
    Wait(Option<Instant>),
    /// Fetch the missing chunks from the fallback source (attempt `attempt`), then report
    /// [`RecoveryMonitor::fill_finished`].
    Fetch {
        /// 1 for the first attempt.
        attempt: u32,
    },
    /// Fail the session with this reason and stop.
    Fail(String),
    /// Nothing more to do: the session completed or failed.
    Stop,
}

/// What follows a fetch from the fallback source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AfterFill {
    /// The session is complete.
    Stop,
    /// Poll again (after another grace period); the fetch's error, if it had one.
    Retry(Option<String>),
    /// Fail the session with this reason.
    Fail(String),
}

/// The recovery decisions of one hop session. See the module docs.
#[derive(Debug)]
pub(crate) struct RecoveryMonitor {
    grace: Duration,
    max_attempts: u32,
    has_fallback: bool,
    attempts: u32,
    /// Since when nothing feeds the session.
    unfed_since: Option<Instant>,
}

impl RecoveryMonitor {
    /// A monitor for a session with (or without) a fallback source.
    pub(crate) fn new(grace: Duration, max_attempts: u32, has_fallback: bool) -> Self {
        Self {
            grace,
            max_attempts,
            has_fallback,
            attempts: 0,
            unfed_since: None,
        }
    }

    /// The next action, given what the session looks like at `now`.
    pub(crate) fn poll(&mut self, now: Instant, seen: Watched) -> RecoveryAction {
        if seen.complete || seen.failed {
            return RecoveryAction::Stop;
        }
        if seen.feeders > 0 {
            self.unfed_since = None;
            return RecoveryAction::Wait(None);
        }
        let since = *self.unfed_since.get_or_insert(now);
        let deadline = since + self.grace;
        if now < deadline {
            return RecoveryAction::Wait(Some(deadline));
        }
        self.unfed_since = None;
        self.attempts += 1;
        if !self.has_fallback {
            return RecoveryAction::Fail(
                "upstream vanished and the session has no fallback source".into(),
            );
        }
        RecoveryAction::Fetch {
            attempt: self.attempts,
        }
    }

    /// A fetch from the fallback source ended with `result`; `complete`: the range is now
    /// verified here.
    pub(crate) fn fill_finished(
        &mut self,
        result: Result<(), String>,
        complete: bool,
    ) -> AfterFill {
        match result {
            Ok(()) if complete => AfterFill::Stop,
            r if self.attempts >= self.max_attempts => {
                let why = r
                    .err()
                    .unwrap_or_else(|| "fallback source lacks chunks".into());
                AfterFill::Fail(format!(
                    "recovery failed after {} attempts: {why}",
                    self.attempts
                ))
            }
            r => AfterFill::Retry(r.err()),
        }
    }
}
