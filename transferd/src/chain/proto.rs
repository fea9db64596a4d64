//! The chain protocol as pure state machines: no sockets, no tasks, no clock of their own.
//!
//! Following quinn-proto's split, each machine is driven by events and the time (`now` is an
//! argument of every call that depends on it) and answers with what to do; the socket loops
//! in the sibling modules only translate frames into events and carry out the answers.
//!
//! ```text
//!  forwarder loop (forward.rs)            SendWindow                  downstream hop
//!    Accept{have} ─────────────▶ new(have, now)
//!    store: dropped chunks ────▶ scan_dropped ──▶ Repair{index, for_peer}
//!    window has room ──────────▶ poll_transmit ─▶ Chunk{index, recheck} | Done ──▶ frames
//!    read ok / read failed ────▶ chunk_read / chunk_unreadable
//!    Ack / Nack / Progress / Done ─▶ handle_answer ─▶ Complete | Failed(reason)
//!    poll_timeout ─▶ sleep ────▶ handle_timeout ─▶ Failed(Silent)
//!
//!  upstream loop (upstream.rs)            Inbound
//!    Chunk / Done ─────────────▶ handle_frame ──▶ admitted (verify it) | OutOfRange
//!    verified / corrupt ───────▶ handle_verdict ─▶ Ack|Nack (+ own Progress when due)
//!
//!  recovery monitor (recovery.rs)         RecoveryMonitor
//!    feeders, complete, failed ▶ poll ─────────▶ Wait(until) | Fetch | Fail(why) | Stop
//!    fill result ──────────────▶ fill_finished ▶ Retry | Fail(why) | Stop
//! ```
//!
//! Stalls are decided here too: a downstream silent for `stall_timeout` while chunks await
//! an answer fails its window (`Failed(Silent)`, and the forwarder moves down the list); an
//! upstream silent while a frame is awaited is `Stalled` (dropped; the recovery monitor
//! then fetches from the holders above). A timer that fires far past its deadline restarts
//! the clock instead of blaming the peer (`late`: this host itself was stopped). New
//! recovery behaviour extends these machines with events and outputs rather than adding
//! decisions to the socket loops.
//!
//! `proto/sim.rs` tests them in virtual time with scripted peers (corruption in flight,
//! rot at rest, scrub drops and repairs, stalls, reordered verifications, duplicate and
//! stray answers) and with proptest over random event sequences: the window bound holds,
//! each chunk reaches the receiver's store exactly once, every run ends (complete or failed
//! for a reason the run explains), recovery fetches at most its attempts and ends.

mod receive;
mod recovery;
mod send;
#[cfg(test)]
mod sim;

pub(crate) use receive::{Inbound, InboundConfig, InboundFrame, Stalled, Verdict};
pub use recovery::{
    AfterFill, RecoveryAction, RecoveryMonitor, Source, Watched, all_stalled, recovery_sources,
};
pub(crate) use send::{
    Answer, LocalCopy, Repair, SendFailure, SendOutcome, SendWindow, SendWindowConfig, Transmit,
};
