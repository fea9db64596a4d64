//! [`SendWindow`]: what a sender sends on one downstream connection, and when it gives up.
//!
//! One window exists per downstream connection (a failover starts a new one from the next
//! hop's `Accept`). It decides which chunk goes next (re-sends after a `Nack` first, then
//! chunks repaired after failing re-verification here, then the lowest chunk not sent yet
//! that this host holds verified), keeps at most `window` chunks unanswered, sends `Done`
//! once every chunk of the range is acknowledged, and fails the connection on silence
//! (`stall_timeout` while it waits for an answer) or on a chunk refused more than
//! `max_resends` times although it verifies here. When it has sent nothing for `keepalive`
//! (it waits for its own upstream), it asks for a `Keepalive`, so that the downstream can
//! tell a starved sender from a stalled one.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use shardcast_protocol::ChunkSet;

/// The sender's own copy of the shard, as the window sees it: read at each call (the
/// store's bitmap in the daemon, a script in tests). Cut-through means chunks become
/// verified here while the window runs.
pub(crate) trait LocalCopy {
    /// Whether chunk `index` is held verified here.
    fn is_verified(&self, index: u32) -> bool;
    /// Whether chunk `index` was dropped after failing re-verification (awaiting repair).
    fn is_dropped(&self, index: u32) -> bool;
    /// The dropped chunks within `range`, ascending.
    fn dropped(&self, range: Range<u32>) -> Vec<u32>;
    /// The lowest chunk in `range` held verified here and not in `skip`. By default one
    /// [`LocalCopy::is_verified`] a chunk; the store's copy answers from its bitmap under
    /// one lock, since the window asks on every wake-up of a forwarder that has caught up
    /// with its upstream, over the whole rest of the range.
    fn first_verified(&self, mut range: Range<u32>, skip: &ChunkSet) -> Option<u32> {
        range.find(|&i| !skip.contains(i) && self.is_verified(i))
    }
}

/// The window's tuning (from `ChainConfig`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendWindowConfig {
    /// Chunks sent but not yet answered by `Ack` or `Nack`, at most.
    pub(crate) window: usize,
    /// Silence from the downstream, while chunks or `Done` await its answer, after which
    /// the connection fails (the downstream is stalled: dead, stopped or cut off).
    pub(crate) stall_timeout: Duration,
    /// Time without sending anything after which a `Keepalive` is due.
    pub(crate) keepalive: Duration,
    /// Silence after `Done` while every chunk is acknowledged: the downstream holds the
    /// range and answers `Done` once the chain below it finished, so this is only the outer
    /// bound (failing over would not help).
    pub(crate) done_timeout: Duration,
    /// How often one chunk may be re-sent after `Nack`s (our copy verifying each time).
    pub(crate) max_resends: u32,
}

/// What to send next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transmit {
    /// Read chunk `index` (re-hashing it first when `recheck`: the downstream refused it)
    /// and send it; then report [`SendWindow::chunk_read`] or
    /// [`SendWindow::chunk_unreadable`].
    Chunk {
        /// The chunk.
        index: u32,
        /// Whether it is a re-send after a `Nack`.
        recheck: bool,
    },
    /// Send `Done`: the downstream acknowledged the whole range.
    Done,
}

/// A chunk of our copy to repair (it failed re-verification here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Repair {
    /// The chunk.
    pub(crate) index: u32,
    /// Whether the downstream still needs it (the window sends it once repaired, and the
    /// session fails if the repair does).
    pub(crate) for_peer: bool,
}

/// A frame from the downstream that the window acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The downstream verified and stored the chunk.
    Ack(u32),
    /// The downstream dropped the chunk (it failed verification there).
    Nack(u32),
    /// Any other sign of life (`Progress`).
    Progress,
    /// The downstream holds the whole range.
    Done,
}

/// How a window ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SendOutcome {
    /// Every chunk acknowledged, `Done` both ways.
    Complete,
    /// The downstream is given up.
    Failed(SendFailure),
}

/// Why a downstream is given up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SendFailure {
    /// No frame for this long while chunks or `Done` awaited an answer.
    Silent(Duration),
    /// The downstream refused a chunk more than `max_resends` times although our copy
    /// verifies.
    Rejected {
        /// The chunk.
        index: u32,
        /// Times it was sent again.
        times: u32,
    },
    /// `Done` before we sent ours.
    EarlyDone,
}

/// Whether a timer due at `due` that fired at `now` fired so late (by more than half of
/// `timeout`) that this process cannot have been running: stopped, or starved of CPU.
pub(crate) fn late(now: Instant, due: Instant, timeout: Duration) -> bool {
    now.saturating_duration_since(due) > timeout / 2
}

/// The send window of one downstream connection. See the module docs.
#[derive(Debug)]
pub(crate) struct SendWindow {
    cfg: SendWindowConfig,
    range: Range<u32>,
    /// Held by the downstream: its `Accept` plus every `Ack`.
    acked: ChunkSet,
    /// Sent at least once on this connection (or given up for repair).
    sent: ChunkSet,
    /// Sent and not answered yet; never more than `cfg.window`.
    in_flight: BTreeSet<u32>,
    /// `Nack`ed: re-hashed here, then sent again.
    resend: VecDeque<u32>,
    /// Pulled back because our copy failed re-verification: sent once verified again.
    repairing: BTreeSet<u32>,
    /// Repairs asked for (a chunk stays dropped until it is written again). A chunk
    /// repaired and dropped again between two scans is not asked for anew: the store
    /// reports no drop generation. The forwarder wakes on every write to its copy, so in
    /// practice it sees the repair first; the recovery work may add the generation.
    requested: HashSet<u32>,
    /// Re-sends per chunk after `Nack`s.
    resends: HashMap<u32, u32>,
    /// Every chunk below it has been sent.
    cursor: u32,
    done_sent: bool,
    last_heard: Instant,
    /// Since when chunks await an answer (set when one is sent into an empty window).
    waiting_since: Option<Instant>,
    last_sent: Instant,
    outcome: Option<SendOutcome>,
}

impl SendWindow {
    /// A window over `have`'s range, starting from what the downstream's `Accept` says it
    /// holds.
    pub(crate) fn new(have: ChunkSet, cfg: SendWindowConfig, now: Instant) -> Self {
        let range = have.range();
        Self {
            cfg,
            sent: have.clone(),
            acked: have,
            in_flight: BTreeSet::new(),
            resend: VecDeque::new(),
            repairing: BTreeSet::new(),
            requested: HashSet::new(),
            resends: HashMap::new(),
            cursor: range.start,
            range,
            done_sent: false,
            last_heard: now,
            waiting_since: None,
            last_sent: now,
            outcome: None,
        }
    }

    /// Chunks of our copy dropped as corrupt (by another reader, a check ahead or the
    /// scrub) that need a repair not asked for yet. A chunk written again (repaired) may be
    /// dropped and asked for anew later.
    pub(crate) fn scan_dropped(&mut self, local: &impl LocalCopy) -> Vec<Repair> {
        self.requested.retain(|&i| local.is_dropped(i));
        let mut out = Vec::new();
        for index in local.dropped(self.range.clone()) {
            if !self.requested.insert(index) {
                continue;
            }
            let for_peer = !self.acked.contains(index);
            // One in flight is answered first: a Nack brings it back through
            // `chunk_unreadable` while it is still dropped.
            if for_peer && !self.in_flight.contains(&index) {
                self.repairing.insert(index);
            }
            out.push(Repair { index, for_peer });
        }
        out
    }

    /// The next thing to send, if the window has room and something is ready. A chunk it
    /// returns counts against the window at once.
    pub(crate) fn poll_transmit(&mut self, local: &impl LocalCopy) -> Option<Transmit> {
        if self.outcome.is_some() {
            return None;
        }
        if self.has_room() {
            if let Some((index, recheck)) = self.next_chunk(local) {
                self.repairing.remove(&index);
                self.sent.insert(index);
                self.in_flight.insert(index);
                return Some(Transmit::Chunk { index, recheck });
            }
        }
        if !self.done_sent && self.acked.is_full() {
            self.done_sent = true;
            return Some(Transmit::Done);
        }
        None
    }

    fn next_chunk(&mut self, local: &impl LocalCopy) -> Option<(u32, bool)> {
        // A re-send once our copy holds the chunk: one that went down in pieces ahead of
        // our copy ([`SendWindow::sent_ahead`]) may still be arriving here; a dropped one
        // is repaired first (`scan_dropped`).
        if let Some(at) = self.resend.iter().position(|&i| local.is_verified(i)) {
            let i = self.resend.remove(at)?;
            return Some((i, true));
        }
        if let Some(&i) = self.repairing.iter().find(|&&i| local.is_verified(i)) {
            return Some((i, false));
        }
        while self.cursor < self.range.end && self.sent.contains(self.cursor) {
            self.cursor += 1;
        }
        local
            .first_verified(self.cursor..self.range.end, &self.sent)
            .map(|i| (i, false))
    }

    /// The chunk [`Transmit::Chunk`] named was read (and, with `recheck`, verifies here):
    /// send it. Fails the window when the downstream has refused it too often.
    pub(crate) fn chunk_read(&mut self, index: u32, recheck: bool) -> Result<(), SendFailure> {
        if !recheck {
            return Ok(());
        }
        // Our copy is sound: the downstream rejected good bytes.
        let times = self.resends.entry(index).or_default();
        *times += 1;
        if *times > self.cfg.max_resends {
            let failure = SendFailure::Rejected {
                index,
                times: *times,
            };
            self.outcome = Some(SendOutcome::Failed(failure.clone()));
            return Err(failure);
        }
        Ok(())
    }

    /// The chunk [`Transmit::Chunk`] named failed re-verification here (or was dropped
    /// meanwhile): it is never sent; it is sent once repaired. A `Nack` for it was our
    /// fault, not the downstream's. Returns the repair to ask for, unless already asked.
    pub(crate) fn chunk_unreadable(&mut self, index: u32) -> Option<Repair> {
        self.in_flight.remove(&index);
        self.repairing.insert(index);
        self.requested.insert(index).then_some(Repair {
            index,
            for_peer: true,
        })
    }

    /// A frame from the downstream.
    pub(crate) fn handle_answer(&mut self, now: Instant, answer: Answer) -> Option<SendOutcome> {
        if self.outcome.is_some() {
            return self.outcome.clone();
        }
        self.last_heard = now;
        match answer {
            Answer::Ack(index) => {
                self.in_flight.remove(&index);
                self.repairing.remove(&index);
                self.acked.insert(index);
            }
            // An answer frees a slot only for a chunk in flight: a stray one (a peer
            // answering twice) neither widens the window nor triggers a re-send.
            Answer::Nack(index) => {
                if self.in_flight.remove(&index) {
                    self.resend.push_back(index);
                }
            }
            Answer::Progress => {}
            Answer::Done if self.done_sent => self.outcome = Some(SendOutcome::Complete),
            Answer::Done => self.outcome = Some(SendOutcome::Failed(SendFailure::EarlyDone)),
        }
        if self.in_flight.is_empty() {
            self.waiting_since = None;
        }
        self.outcome.clone()
    }

    /// When the window gives up on a silent downstream, if it is waiting for one, and the
    /// silence that takes: the stall timeout while chunks await an answer (counted from the
    /// later of the last answer and the moment they started waiting, so a quiet spell with
    /// nothing in flight does not count), the `Done` timeout while only `Done` does.
    fn deadline(&self) -> Option<(Instant, Duration)> {
        if self.outcome.is_some() {
            return None;
        }
        if !self.in_flight.is_empty() {
            let since = self
                .waiting_since
                .map_or(self.last_heard, |w| w.max(self.last_heard));
            return Some((since + self.cfg.stall_timeout, self.cfg.stall_timeout));
        }
        self.done_sent.then(|| {
            (
                self.last_heard + self.cfg.done_timeout,
                self.cfg.done_timeout,
            )
        })
    }

    /// When the window gives up on a silent downstream, if it is waiting for one.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.deadline().map(|(t, _)| t)
    }

    /// The time passed: fails the window if the downstream stayed silent past its deadline.
    /// A deadline passed by far more than the timeout itself means this process did not
    /// run (it was stopped, or starved of CPU), not that the downstream was silent: the
    /// clock restarts instead, and the downstream gets a full period to answer.
    pub(crate) fn handle_timeout(&mut self, now: Instant) -> Option<SendOutcome> {
        if let Some((t, silence)) = self.deadline().filter(|&(t, _)| now >= t) {
            if late(now, t, silence) {
                self.last_heard = now;
                return None;
            }
            self.outcome = Some(SendOutcome::Failed(SendFailure::Silent(silence)));
        }
        self.outcome.clone()
    }

    /// Something (a chunk, `Done`, a `Keepalive`) was written to the downstream at `now`.
    pub(crate) fn note_sent(&mut self, now: Instant) {
        self.last_sent = now;
        if !self.in_flight.is_empty() && self.waiting_since.is_none() {
            self.waiting_since = Some(now);
        }
    }

    /// When a `Keepalive` is due, if the window is still running.
    pub(crate) fn poll_keepalive(&self) -> Option<Instant> {
        self.outcome
            .is_none()
            .then(|| self.last_sent + self.cfg.keepalive)
    }

    /// Whether to send a `Keepalive` now (then report [`SendWindow::note_sent`]).
    pub(crate) fn keepalive_due(&self, now: Instant) -> bool {
        self.poll_keepalive().is_some_and(|t| now >= t)
    }

    /// Chunk `index` went down whole, as verified pieces sent ahead of our own copy while
    /// it still arrived here (`crate::chain::pieces`): it is sent, in flight and awaits its
    /// answer like any chunk (the forwarder sends pieces ahead only while the window has
    /// room; a chunk completed so may pass the window by the few chunks in pieces at once).
    pub(crate) fn sent_ahead(&mut self, index: u32, now: Instant) {
        if self.unsent(index) {
            self.sent.insert(index);
            self.in_flight.insert(index);
            self.note_sent(now);
        }
    }

    /// Whether chunk `index` is in the window's range and not sent on this connection yet
    /// (nor held by the downstream): the forwarder may send its pieces ahead of it while it
    /// still arrives here (`crate::chain::pieces`).
    pub(crate) fn unsent(&self, index: u32) -> bool {
        self.range.contains(&index) && !self.sent.contains(index)
    }

    /// Whether another chunk may be sent now (the driver waits for local chunks only then).
    pub(crate) fn has_room(&self) -> bool {
        self.in_flight.len() < self.cfg.window
    }

    /// Chunks sent and not answered yet.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Chunks the downstream holds.
    #[cfg(test)]
    pub(crate) fn acked(&self) -> &ChunkSet {
        &self.acked
    }
}
