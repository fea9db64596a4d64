//! [`Inbound`]: the receiving end of one upstream connection.
//!
//! It admits chunks of the session's shard and range for verification (at most
//! `pipeline_depth` at once, so a hop verifies and stores while it reads the next ones),
//! answers each verdict with `Ack` or `Nack`, and says when this hop's own `Progress` is
//! due (at most every `progress_interval`, and always once the range is complete). The
//! upstream stops feeding the session once it has sent `Done` and every chunk it sent has
//! been answered.
//!
//! It also watches the upstream's liveness: while it waits for a frame (the pipeline has
//! room and `Done` has not come), an upstream that sends nothing — no chunk and no
//! `Keepalive` — for `stall_timeout` is stalled (dead, stopped or cut off), and the driver
//! drops it so the session can be fed from elsewhere. Time spent with the pipeline full is
//! this hop's own slowness and does not count against the upstream.

use std::ops::Range;
use std::time::{Duration, Instant};

/// The receiving end's tuning (from `ChainConfig`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct InboundConfig {
    /// Chunks verified and stored concurrently while the next ones are read.
    pub(crate) pipeline_depth: usize,
    /// Minimum interval between this hop's own `Progress` frames.
    pub(crate) progress_interval: Duration,
    /// Silence of the upstream, while a frame is awaited, after which it is stalled.
    pub(crate) stall_timeout: Duration,
}

/// A frame from the upstream that the session acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InboundFrame {
    /// A chunk arrived (its bytes stay with the driver).
    Chunk {
        /// Its shard.
        shard: u32,
        /// Its index.
        index: u32,
    },
    /// A chunk's `ChunkHead` or one of its pieces arrived: alive, and the chunk must be
    /// within the session (it is admitted with its last piece, as a `Chunk`).
    Piece {
        /// Its shard.
        shard: u32,
        /// Its index.
        index: u32,
    },
    /// The upstream has sent everything it will.
    Done,
    /// The upstream is alive with nothing to send.
    Keepalive,
}

/// A chunk outside the session's shard or range: the upstream broke the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutOfRange {
    /// The chunk's shard.
    pub(crate) shard: u32,
    /// Its index.
    pub(crate) index: u32,
}

/// The outcome of verifying and storing one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Verified and stored (or already held).
    Stored,
    /// It failed verification and was dropped.
    Corrupt,
}

/// What to answer the upstream after a verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reply {
    /// `Ack` (stored) or `Nack` (the sender sends it again) of this chunk.
    pub(crate) verdict: Verdict,
    /// The chunk.
    pub(crate) index: u32,
    /// Whether this hop's own `Progress` follows.
    pub(crate) progress: bool,
}

/// The receiving end of one upstream connection. See the module docs.
#[derive(Debug)]
pub(crate) struct Inbound {
    cfg: InboundConfig,
    shard: u32,
    range: Range<u32>,
    /// Chunks admitted and not yet answered.
    verifying: usize,
    upstream_done: bool,
    last_progress: Option<Instant>,
    /// Since when a frame has been awaited without one arriving (`None`: not waiting).
    waiting_since: Option<Instant>,
}

/// The upstream sent nothing for this long while a frame was awaited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stalled(pub(crate) Duration);

impl Inbound {
    /// The receiving end of a session over `range` of `shard`.
    pub(crate) fn new(shard: u32, range: Range<u32>, cfg: InboundConfig, now: Instant) -> Self {
        Self {
            cfg,
            shard,
            range,
            verifying: 0,
            upstream_done: false,
            last_progress: None,
            waiting_since: Some(now),
        }
    }

    /// Starts or stops the liveness clock as the pipeline fills and drains.
    fn rearm(&mut self, now: Instant) {
        if !self.wants_frame() {
            self.waiting_since = None;
        } else if self.waiting_since.is_none() {
            self.waiting_since = Some(now);
        }
    }

    /// When the upstream counts as stalled if nothing arrives, while a frame is awaited.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.waiting_since.map(|t| t + self.cfg.stall_timeout)
    }

    /// The time passed: the upstream is stalled if it stayed silent past the deadline. A
    /// deadline passed by far more than the timeout means this process did not run (it was
    /// stopped, or starved of CPU): the clock restarts instead.
    pub(crate) fn handle_timeout(&mut self, now: Instant) -> Option<Stalled> {
        let due = self.poll_timeout().filter(|&t| now >= t)?;
        if super::send::late(now, due, self.cfg.stall_timeout) {
            self.waiting_since = Some(now);
            return None;
        }
        Some(Stalled(self.cfg.stall_timeout))
    }

    /// Whether the driver should read the next frame now: the upstream has not finished
    /// and the verification pipeline has room.
    pub(crate) fn wants_frame(&self) -> bool {
        !self.upstream_done && self.verifying < self.cfg.pipeline_depth.max(1)
    }

    /// A frame from the upstream. A chunk within the session is admitted: verify and store
    /// it, then report [`Inbound::handle_verdict`].
    pub(crate) fn handle_frame(
        &mut self,
        now: Instant,
        frame: InboundFrame,
    ) -> Result<(), OutOfRange> {
        self.waiting_since = None;
        let r = self.admit(frame);
        self.rearm(now);
        r
    }

    fn admit(&mut self, frame: InboundFrame) -> Result<(), OutOfRange> {
        match frame {
            InboundFrame::Chunk { shard, index } => {
                if shard != self.shard || !self.range.contains(&index) {
                    return Err(OutOfRange { shard, index });
                }
                self.verifying += 1;
            }
            InboundFrame::Piece { shard, index } => {
                if shard != self.shard || !self.range.contains(&index) {
                    return Err(OutOfRange { shard, index });
                }
            }
            InboundFrame::Done => self.upstream_done = true,
            InboundFrame::Keepalive => {}
        }
        Ok(())
    }

    /// An admitted chunk was verified and stored, or dropped. `complete`: the session's
    /// whole range is now verified here.
    pub(crate) fn handle_verdict(
        &mut self,
        now: Instant,
        index: u32,
        verdict: Verdict,
        complete: bool,
    ) -> Reply {
        self.verifying = self.verifying.saturating_sub(1);
        self.rearm(now);
        let due = self
            .last_progress
            .is_none_or(|t| now.saturating_duration_since(t) >= self.cfg.progress_interval);
        let progress = due || complete;
        if progress {
            self.last_progress = Some(now);
        }
        Reply {
            verdict,
            index,
            progress,
        }
    }

    /// Whether the upstream still feeds the session: it has not sent `Done`, or chunks it
    /// sent are still being verified.
    pub(crate) fn feeding(&self) -> bool {
        !self.upstream_done || self.verifying > 0
    }
}
