//! Tests of the state machines against a virtual clock with scripted peers: a sender's
//! [`SendWindow`] and a receiver's [`Inbound`] joined by an in-order link (TCP) each way,
//! with verifications completing in any order, chunks corrupted in flight, copies rotting
//! at rest on the sender, silent peers, and duplicate, stray and late answers. Scripted
//! scenarios first, then property tests over random event sequences.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use shardcast_protocol::ChunkSet;

use super::receive::OutOfRange;
use super::*;

const IDLE: Duration = Duration::from_secs(2);
const KEEPALIVE: Duration = Duration::from_millis(500);
const DONE_TIMEOUT: Duration = Duration::from_secs(30);
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

fn cfg(window: usize, max_resends: u32) -> SendWindowConfig {
    SendWindowConfig {
        window,
        stall_timeout: IDLE,
        keepalive: KEEPALIVE,
        done_timeout: DONE_TIMEOUT,
        max_resends,
    }
}

/// A window over `range` whose downstream holds `have`, and a sender holding all of it.
fn start(
    range: Range<u32>,
    have: impl IntoIterator<Item = u32>,
    window: usize,
    max_resends: u32,
) -> (Instant, OwnCopy, SendWindow) {
    let t0 = Instant::now();
    let w = SendWindow::new(set(range.clone(), have), cfg(window, max_resends), t0);
    (t0, OwnCopy::full(range), w)
}

fn set(range: Range<u32>, held: impl IntoIterator<Item = u32>) -> ChunkSet {
    let mut s = ChunkSet::new(range.start, range.end);
    for i in held {
        s.insert(i);
    }
    s
}

/// The sender's copy of the shard: what it holds verified, what the store dropped as
/// corrupt, and what has rotted without being noticed yet (it fails the next read).
#[derive(Debug, Default)]
struct OwnCopy {
    verified: BTreeSet<u32>,
    dropped: BTreeSet<u32>,
    rotten: BTreeSet<u32>,
}

impl OwnCopy {
    fn full(range: Range<u32>) -> Self {
        Self {
            verified: range.collect(),
            ..Self::default()
        }
    }

    /// A read of a chunk: a rotten one is caught by the re-hash and dropped.
    fn read(&mut self, index: u32) -> bool {
        if self.rotten.remove(&index) {
            self.verified.remove(&index);
            self.dropped.insert(index);
        }
        self.verified.contains(&index)
    }

    fn repaired(&mut self, index: u32) {
        self.dropped.remove(&index);
        self.verified.insert(index);
    }
}

impl LocalCopy for OwnCopy {
    fn is_verified(&self, index: u32) -> bool {
        self.verified.contains(&index)
    }
    fn is_dropped(&self, index: u32) -> bool {
        self.dropped.contains(&index)
    }
    fn dropped(&self, range: Range<u32>) -> Vec<u32> {
        self.dropped.range(range).copied().collect()
    }
}

/// Drives a window the way the forwarder does: repairs asked for, then chunks read and
/// sent until the window is full. Returns what went on the wire.
fn pump(w: &mut SendWindow, local: &mut OwnCopy, repairs: &mut Vec<Repair>) -> Vec<Transmit> {
    repairs.extend(w.scan_dropped(local));
    let mut out = Vec::new();
    while let Some(t) = w.poll_transmit(local) {
        if let Transmit::Chunk { index, recheck } = t {
            if !local.read(index) {
                repairs.extend(w.chunk_unreadable(index));
                continue;
            }
            if w.chunk_read(index, recheck).is_err() {
                break;
            }
        }
        out.push(t);
    }
    out
}

fn chunks(sent: &[Transmit]) -> Vec<u32> {
    sent.iter()
        .filter_map(|t| match t {
            Transmit::Chunk { index, .. } => Some(*index),
            Transmit::Done => None,
        })
        .collect()
}

// ---- SendWindow, scripted ----

#[test]
fn sends_only_what_the_accept_lacks_then_done() {
    let (t0, mut local, mut w) = start(0..5, [0, 2], 16, 5);
    let sent = pump(&mut w, &mut local, &mut Vec::new());
    assert_eq!(chunks(&sent), [1, 3, 4]);
    assert!(!sent.contains(&Transmit::Done));
    for i in [4, 1, 3] {
        // Answers in another order than the chunks went out.
        assert_eq!(w.handle_answer(t0, Answer::Ack(i)), None);
    }
    assert_eq!(pump(&mut w, &mut local, &mut Vec::new()), [Transmit::Done]);
    assert_eq!(
        w.handle_answer(t0, Answer::Done),
        Some(SendOutcome::Complete)
    );
    assert_eq!(w.poll_transmit(&local), None);
}

#[test]
fn a_receiver_holding_everything_gets_done_at_once() {
    let t0 = Instant::now();
    let mut w = SendWindow::new(set(3..6, 3..6), cfg(4, 5), t0);
    assert_eq!(
        pump(&mut w, &mut OwnCopy::default(), &mut Vec::new()),
        [Transmit::Done]
    );
    // Only Done awaits an answer: the downstream holds the range, so only the long bound.
    assert_eq!(w.poll_timeout(), Some(t0 + DONE_TIMEOUT));
}

#[test]
fn a_quiet_spell_with_nothing_in_flight_does_not_count_as_silence() {
    // The sender's own upstream was slow: nothing in flight for a while.
    let t0 = Instant::now();
    let mut w = SendWindow::new(set(0..4, []), cfg(4, 1), t0);
    let mut own = OwnCopy::default();
    assert_eq!(w.poll_transmit(&own), None);
    assert_eq!(w.poll_timeout(), None);
    // A chunk arrives 1.5 s later and is sent: the downstream gets a full stall timeout
    // from then, not from the last answer long ago.
    let t1 = t0 + Duration::from_millis(1500);
    own.verified.insert(0);
    assert!(w.poll_transmit(&own).is_some());
    w.note_sent(t1);
    assert_eq!(w.poll_timeout(), Some(t1 + IDLE));
    assert_eq!(w.handle_timeout(t0 + IDLE), None);
    assert_eq!(
        w.handle_timeout(t1 + IDLE),
        Some(SendOutcome::Failed(SendFailure::Silent(IDLE)))
    );
}

#[test]
fn at_most_window_chunks_are_unanswered() {
    let (t0, mut local, mut w) = start(0..10, [], 3, 5);
    assert_eq!(
        chunks(&pump(&mut w, &mut local, &mut Vec::new())),
        [0, 1, 2]
    );
    assert!(!w.has_room());
    w.handle_answer(t0, Answer::Ack(1));
    assert_eq!(chunks(&pump(&mut w, &mut local, &mut Vec::new())), [3]);
    w.handle_answer(t0, Answer::Nack(0));
    // A Nacked chunk goes first, re-hashed here.
    assert_eq!(
        pump(&mut w, &mut local, &mut Vec::new()),
        [Transmit::Chunk {
            index: 0,
            recheck: true
        }]
    );
    assert_eq!(w.in_flight(), 3);
}

#[test]
fn duplicate_stray_and_late_answers_neither_widen_the_window_nor_resend() {
    let (t0, mut local, mut w) = start(0..6, [], 2, 5);
    assert_eq!(chunks(&pump(&mut w, &mut local, &mut Vec::new())), [0, 1]);
    w.handle_answer(t0, Answer::Ack(0));
    w.handle_answer(t0, Answer::Ack(0));
    w.handle_answer(t0, Answer::Ack(5)); // never sent
    w.handle_answer(t0, Answer::Nack(4)); // never sent
    w.handle_answer(t0, Answer::Ack(99)); // outside the range
    assert_eq!(w.in_flight(), 1);
    // One slot came free (chunk 0's); chunk 5 counts as held, chunk 4 is not re-sent early.
    assert_eq!(chunks(&pump(&mut w, &mut local, &mut Vec::new())), [2]);
    assert!(w.acked().contains(5));
}

#[test]
fn a_refused_chunk_is_resent_until_max_resends_then_the_hop_is_given_up() {
    let (t0, mut local, mut w) = start(0..1, [], 4, 2);
    assert_eq!(chunks(&pump(&mut w, &mut local, &mut Vec::new())), [0]);
    for _ in 0..2 {
        w.handle_answer(t0, Answer::Nack(0));
        assert_eq!(
            w.poll_transmit(&local),
            Some(Transmit::Chunk {
                index: 0,
                recheck: true
            })
        );
        assert_eq!(w.chunk_read(0, true), Ok(()));
    }
    w.handle_answer(t0, Answer::Nack(0));
    assert!(w.poll_transmit(&local).is_some());
    let failure = SendFailure::Rejected { index: 0, times: 3 };
    assert_eq!(w.chunk_read(0, true), Err(failure.clone()));
    assert_eq!(
        w.handle_answer(t0, Answer::Progress),
        Some(SendOutcome::Failed(failure))
    );
    assert_eq!(w.poll_transmit(&local), None);
}

#[test]
fn a_silent_downstream_fails_exactly_at_the_idle_deadline() {
    let (t0, mut local, mut w) = start(0..4, [], 2, 5);
    pump(&mut w, &mut local, &mut Vec::new());
    assert_eq!(w.poll_timeout(), Some(t0 + IDLE));
    // A sign of life moves the deadline.
    let t1 = t0 + Duration::from_secs(10);
    w.handle_answer(t1, Answer::Progress);
    assert_eq!(w.poll_timeout(), Some(t1 + IDLE));
    assert_eq!(w.handle_timeout(t1 + IDLE - Duration::from_millis(1)), None);
    assert_eq!(
        w.handle_timeout(t1 + IDLE),
        Some(SendOutcome::Failed(SendFailure::Silent(IDLE)))
    );
}

#[test]
fn no_deadline_while_the_sender_waits_for_its_own_chunks() {
    // Cut-through: a hop whose upstream is slow has nothing in flight; its downstream is
    // not at fault for being quiet.
    let t0 = Instant::now();
    let mut local = OwnCopy::default();
    let mut w = SendWindow::new(set(0..3, []), cfg(4, 5), t0);
    assert!(pump(&mut w, &mut local, &mut Vec::new()).is_empty());
    assert_eq!(w.poll_timeout(), None);
    assert_eq!(w.handle_timeout(t0 + IDLE * 10), None);
    // Chunks arrive out of order; each goes on as soon as it is here.
    local.verified.insert(2);
    assert_eq!(chunks(&pump(&mut w, &mut local, &mut Vec::new())), [2]);
    local.verified.insert(0);
    assert_eq!(chunks(&pump(&mut w, &mut local, &mut Vec::new())), [0]);
}

#[test]
fn early_done_from_the_downstream_is_a_failure() {
    let t0 = Instant::now();
    let mut w = SendWindow::new(set(0..2, []), cfg(2, 5), t0);
    assert_eq!(
        w.handle_answer(t0, Answer::Done),
        Some(SendOutcome::Failed(SendFailure::EarlyDone))
    );
}

#[test]
fn a_copy_rotten_here_is_repaired_and_never_sent() {
    let t0 = Instant::now();
    let mut local = OwnCopy::full(0..4);
    local.rotten.insert(1);
    let mut w = SendWindow::new(set(0..4, []), cfg(8, 5), t0);
    let mut repairs = Vec::new();
    assert_eq!(chunks(&pump(&mut w, &mut local, &mut repairs)), [0, 2, 3]);
    assert_eq!(
        repairs,
        [Repair {
            index: 1,
            for_peer: true
        }]
    );
    // The next round does not ask again while the repair runs.
    repairs.clear();
    assert!(pump(&mut w, &mut local, &mut repairs).is_empty());
    assert!(repairs.is_empty());
    local.repaired(1);
    assert_eq!(
        pump(&mut w, &mut local, &mut repairs),
        [Transmit::Chunk {
            index: 1,
            recheck: false
        }]
    );
}

#[test]
fn a_nacked_chunk_that_fails_its_recheck_counts_nothing_against_the_downstream() {
    let (t0, mut local, mut w) = start(0..1, [], 4, 1);
    pump(&mut w, &mut local, &mut Vec::new());
    w.handle_answer(t0, Answer::Nack(0));
    local.rotten.insert(0);
    let mut repairs = Vec::new();
    assert!(pump(&mut w, &mut local, &mut repairs).is_empty());
    assert_eq!(repairs.len(), 1);
    local.repaired(0);
    assert_eq!(chunks(&pump(&mut w, &mut local, &mut repairs)), [0]);
    // One more refusal is still within max_resends (1): the rotten copy was our fault.
    w.handle_answer(t0, Answer::Nack(0));
    assert_eq!(chunks(&pump(&mut w, &mut local, &mut repairs)), [0]);
}

#[test]
fn chunks_dropped_by_the_scrub_are_repaired_and_only_needed_ones_resent() {
    let (_, mut local, mut w) = start(0..4, [0], 8, 5);
    local.verified.remove(&0);
    local.dropped.insert(0);
    local.verified.remove(&3);
    local.dropped.insert(3);
    let mut repairs = Vec::new();
    assert_eq!(chunks(&pump(&mut w, &mut local, &mut repairs)), [1, 2]);
    assert_eq!(
        repairs,
        [
            Repair {
                index: 0,
                for_peer: false
            },
            Repair {
                index: 3,
                for_peer: true
            }
        ]
    );
    local.repaired(0);
    local.repaired(3);
    repairs.clear();
    assert_eq!(chunks(&pump(&mut w, &mut local, &mut repairs)), [3]);
    // Dropped again after its repair: asked for anew.
    local.verified.remove(&0);
    local.dropped.insert(0);
    pump(&mut w, &mut local, &mut repairs);
    assert_eq!(
        repairs,
        [Repair {
            index: 0,
            for_peer: false
        }]
    );
}

#[test]
fn a_sender_with_nothing_to_send_asks_for_keepalives() {
    // The downstream holds nothing, we hold nothing yet (our upstream is slow).
    let t0 = Instant::now();
    let mut w = SendWindow::new(set(0..4, []), cfg(4, 1), t0);
    let empty = OwnCopy::default();
    assert_eq!(w.poll_transmit(&empty), None);
    // Nothing in flight: no silence deadline, only the keepalive.
    assert_eq!(w.poll_timeout(), None);
    assert_eq!(w.poll_keepalive(), Some(t0 + KEEPALIVE));
    assert!(!w.keepalive_due(t0 + KEEPALIVE / 2));
    assert!(w.keepalive_due(t0 + KEEPALIVE));
    w.note_sent(t0 + KEEPALIVE);
    assert_eq!(w.poll_keepalive(), Some(t0 + KEEPALIVE * 2));
    // A chunk sent counts as a sign of life too.
    let t1 = t0 + KEEPALIVE + Duration::from_millis(100);
    w.note_sent(t1);
    assert_eq!(w.poll_keepalive(), Some(t1 + KEEPALIVE));
}

#[test]
fn a_late_timer_means_we_did_not_run_not_that_the_peer_was_silent() {
    let (t0, own, mut w) = start(0..4, [], 4, 1);
    assert!(w.poll_transmit(&own).is_some());
    // Fired on time: the downstream is stalled.
    let mut on_time = SendWindow::new(set(0..4, []), cfg(4, 1), t0);
    on_time.poll_transmit(&own);
    assert_eq!(
        on_time.handle_timeout(t0 + IDLE + IDLE / 4),
        Some(SendOutcome::Failed(SendFailure::Silent(IDLE)))
    );
    // Fired far past its deadline (this process was stopped for a minute): the clock
    // restarts and the downstream gets a full period.
    let resumed = t0 + Duration::from_secs(60);
    assert_eq!(w.handle_timeout(resumed), None);
    assert_eq!(w.poll_timeout(), Some(resumed + IDLE));
    assert_eq!(
        w.handle_timeout(resumed + IDLE),
        Some(SendOutcome::Failed(SendFailure::Silent(IDLE)))
    );
}

// ---- Inbound, scripted ----

fn inbound(depth: usize) -> Inbound {
    inbound_at(depth, Instant::now())
}

fn inbound_at(depth: usize, t0: Instant) -> Inbound {
    Inbound::new(
        7,
        10..20,
        InboundConfig {
            pipeline_depth: depth,
            progress_interval: PROGRESS_EVERY,
            stall_timeout: IDLE,
        },
        t0,
    )
}

#[test]
fn inbound_admits_up_to_the_pipeline_depth_and_refuses_foreign_chunks() {
    let mut rx = inbound(2);
    let chunk = |shard, index| InboundFrame::Chunk { shard, index };
    assert_eq!(
        rx.handle_frame(Instant::now(), chunk(7, 20)),
        Err(OutOfRange {
            shard: 7,
            index: 20
        })
    );
    assert!(rx.handle_frame(Instant::now(), chunk(6, 10)).is_err());
    assert!(rx.handle_frame(Instant::now(), chunk(7, 10)).is_ok());
    assert!(rx.wants_frame());
    assert!(rx.handle_frame(Instant::now(), chunk(7, 11)).is_ok());
    assert!(!rx.wants_frame());
    rx.handle_verdict(Instant::now(), 11, Verdict::Stored, false);
    assert!(rx.wants_frame());
}

#[test]
fn inbound_progress_is_throttled_in_virtual_time_and_sent_on_completion() {
    let t0 = Instant::now();
    let mut rx = inbound(4);
    let progress_at = |rx: &mut Inbound, t, complete| {
        rx.handle_frame(
            Instant::now(),
            InboundFrame::Chunk {
                shard: 7,
                index: 10,
            },
        )
        .unwrap();
        rx.handle_verdict(t, 10, Verdict::Stored, complete).progress
    };
    assert!(progress_at(&mut rx, t0, false));
    assert!(!progress_at(&mut rx, t0 + PROGRESS_EVERY / 2, false));
    assert!(progress_at(&mut rx, t0 + PROGRESS_EVERY, false));
    assert!(progress_at(&mut rx, t0 + PROGRESS_EVERY, true));
}

#[test]
fn inbound_feeds_until_done_and_every_chunk_answered() {
    let mut rx = inbound(4);
    rx.handle_frame(
        Instant::now(),
        InboundFrame::Chunk {
            shard: 7,
            index: 12,
        },
    )
    .unwrap();
    rx.handle_frame(Instant::now(), InboundFrame::Done).unwrap();
    assert!(!rx.wants_frame());
    assert!(rx.feeding());
    let r = rx.handle_verdict(Instant::now(), 12, Verdict::Corrupt, false);
    assert_eq!(r.verdict, Verdict::Corrupt);
    assert!(!rx.feeding());
}

#[test]
fn an_upstream_silent_while_a_frame_is_awaited_is_stalled() {
    let t0 = Instant::now();
    let mut rx = inbound_at(4, t0);
    assert_eq!(rx.poll_timeout(), Some(t0 + IDLE));
    assert_eq!(rx.handle_timeout(t0 + IDLE / 2), None);
    // A keepalive is a sign of life: the clock restarts.
    let t1 = t0 + IDLE / 2;
    rx.handle_frame(t1, InboundFrame::Keepalive).unwrap();
    assert_eq!(rx.poll_timeout(), Some(t1 + IDLE));
    assert_eq!(rx.handle_timeout(t1 + IDLE), Some(Stalled(IDLE)));
}

#[test]
fn time_with_the_pipeline_full_does_not_count_against_the_upstream() {
    let t0 = Instant::now();
    let mut rx = inbound_at(2, t0);
    for index in [10, 11] {
        rx.handle_frame(t0, InboundFrame::Chunk { shard: 7, index })
            .unwrap();
    }
    // Full: this hop is the slow one; no deadline runs.
    assert!(!rx.wants_frame());
    assert_eq!(rx.poll_timeout(), None);
    assert_eq!(rx.handle_timeout(t0 + IDLE * 10), None);
    // Room again: the upstream gets a full period from then.
    let t1 = t0 + IDLE * 10;
    rx.handle_verdict(t1, 10, Verdict::Stored, false);
    assert_eq!(rx.poll_timeout(), Some(t1 + IDLE));
    // After Done nothing more is awaited.
    rx.handle_frame(t1, InboundFrame::Done).unwrap();
    assert_eq!(rx.poll_timeout(), None);
}

#[test]
fn an_inbound_timer_that_fires_late_restarts_the_clock() {
    let t0 = Instant::now();
    let mut rx = inbound_at(4, t0);
    let resumed = t0 + Duration::from_secs(60);
    assert_eq!(rx.handle_timeout(resumed), None);
    assert_eq!(rx.poll_timeout(), Some(resumed + IDLE));
}

// ---- RecoveryMonitor, scripted ----

const GRACE: Duration = Duration::from_secs(2);

fn watched(feeders: usize) -> Watched {
    Watched {
        feeders,
        complete: false,
        failed: false,
        no_failover: false,
        has_source: true,
    }
}

#[test]
fn recovery_waits_the_grace_then_fetches() {
    let t0 = Instant::now();
    let mut m = RecoveryMonitor::new(GRACE, 3);
    assert_eq!(m.poll(t0, watched(1)), RecoveryAction::Wait(None));
    assert_eq!(
        m.poll(t0, watched(0)),
        RecoveryAction::Wait(Some(t0 + GRACE))
    );
    // A wake-up without a feeder keeps the same deadline.
    let t1 = t0 + GRACE / 2;
    assert_eq!(
        m.poll(t1, watched(0)),
        RecoveryAction::Wait(Some(t0 + GRACE))
    );
    assert_eq!(
        m.poll(t0 + GRACE, watched(0)),
        RecoveryAction::Fetch { attempt: 1 }
    );
}

#[test]
fn recovery_skips_the_fetch_when_an_upstream_rejoins_in_the_grace() {
    let t0 = Instant::now();
    let mut m = RecoveryMonitor::new(GRACE, 3);
    m.poll(t0, watched(0));
    assert_eq!(
        m.poll(t0 + GRACE / 2, watched(1)),
        RecoveryAction::Wait(None)
    );
    // It leaves again: a fresh grace period.
    let t2 = t0 + GRACE;
    assert_eq!(
        m.poll(t2, watched(0)),
        RecoveryAction::Wait(Some(t2 + GRACE))
    );
}

#[test]
fn recovery_without_a_fallback_fails_after_the_grace() {
    let t0 = Instant::now();
    let mut m = RecoveryMonitor::new(GRACE, 3);
    let none = Watched {
        has_source: false,
        ..watched(0)
    };
    m.poll(t0, none);
    assert_eq!(m.poll(t0 + GRACE, none), RecoveryAction::NoSource);
}

#[test]
fn recovery_gives_up_after_its_attempts() {
    let mut t = Instant::now();
    let mut m = RecoveryMonitor::new(GRACE, 3);
    for attempt in 1..=3 {
        m.poll(t, watched(0));
        t += GRACE;
        assert_eq!(m.poll(t, watched(0)), RecoveryAction::Fetch { attempt });
        let after = m.fill_finished(Err("origin down"), false);
        if attempt < 3 {
            assert_eq!(after, AfterFill::Retry(Some("origin down")));
        } else {
            assert_eq!(
                after,
                AfterFill::Fail {
                    attempts: 3,
                    cause: Some("origin down")
                }
            );
        }
    }
    // A last fetch that ended without an error but left chunks missing: no cause.
    let mut m = RecoveryMonitor::new(GRACE, 1);
    m.poll(t, watched(0));
    assert_eq!(
        m.poll(t + GRACE, watched(0)),
        RecoveryAction::Fetch { attempt: 1 }
    );
    assert_eq!(
        m.fill_finished(Ok::<(), &str>(()), false),
        AfterFill::Fail {
            attempts: 1,
            cause: None
        }
    );
}

#[test]
fn recovery_stops_once_complete_or_failed() {
    let t0 = Instant::now();
    let mut m = RecoveryMonitor::new(GRACE, 3);
    m.poll(t0, watched(0));
    assert_eq!(
        m.poll(t0 + GRACE, watched(0)),
        RecoveryAction::Fetch { attempt: 1 }
    );
    assert_eq!(m.fill_finished(Ok::<(), ()>(()), true), AfterFill::Stop);
    let done = Watched {
        complete: true,
        ..watched(0)
    };
    assert_eq!(m.poll(t0, done), RecoveryAction::Stop);
    let failed = Watched {
        failed: true,
        ..watched(0)
    };
    assert_eq!(m.poll(t0, failed), RecoveryAction::Stop);
}

fn hop(name: &str) -> shardcast_protocol::Hop {
    shardcast_protocol::Hop {
        host: name.parse().unwrap(),
        addr: format!("{name}:7000"),
    }
}

#[test]
fn recovery_sources_are_live_holders_above_nearest_first_then_the_origin() {
    let up = [hop("b"), hop("a"), hop("head")];
    let none = std::collections::HashSet::new();
    assert_eq!(
        recovery_sources(&up, &none, None, "https://origin/m"),
        vec![
            Source::Holder(hop("b")),
            Source::Holder(hop("a")),
            Source::Holder(hop("head")),
            Source::Origin("https://origin/m".into()),
        ]
    );
    let stalled: std::collections::HashSet<_> = ["b".parse().unwrap()].into();
    assert_eq!(
        recovery_sources(&up, &stalled, None, ""),
        vec![Source::Holder(hop("a")), Source::Holder(hop("head"))]
    );
    // The hop below that bypassed this one comes after the holders above, before the
    // origin; not when it was found stalled.
    let below = hop("c");
    assert_eq!(
        recovery_sources(&up, &stalled, Some(&below), "https://origin/m"),
        vec![
            Source::Holder(hop("a")),
            Source::Holder(hop("head")),
            Source::Holder(hop("c")),
            Source::Origin("https://origin/m".into()),
        ]
    );
    let c_stalled: std::collections::HashSet<_> = ["c".parse().unwrap()].into();
    assert_eq!(
        recovery_sources(&[], &c_stalled, Some(&below), "o"),
        vec![Source::Origin("o".into())]
    );
    assert!(!all_stalled(&up, &stalled));
    let everyone: std::collections::HashSet<_> = up.iter().map(|h| h.host.clone()).collect();
    assert!(all_stalled(&up, &everyone));
    assert!(
        !all_stalled(&[], &everyone),
        "no list: a failover may still come"
    );
    assert!(recovery_sources(&up, &everyone, None, "").is_empty());
}

#[test]
fn recovery_fetches_at_once_when_every_holder_above_is_stalled() {
    let t0 = Instant::now();
    let mut m = RecoveryMonitor::new(GRACE, 3);
    let head_stalled = Watched {
        no_failover: true,
        ..watched(0)
    };
    assert_eq!(
        m.poll(t0, head_stalled),
        RecoveryAction::Fetch { attempt: 1 }
    );
}

// ---- a sender and a receiver in virtual time ----

/// Frames towards the receiver.
#[derive(Debug, Clone, Copy)]
enum Down {
    Chunk { index: u32, corrupt: bool },
    Done,
}

/// One event of a run. Indices are taken modulo what they pick from.
#[derive(Debug, Clone)]
enum Step {
    /// The sender sends what its window allows.
    Pump,
    /// The receiver reads the next frame (if its pipeline has room).
    Deliver,
    /// One admitted chunk (the k-th, so in any order) finishes verification.
    Verify(usize),
    /// The sender reads the next answer.
    Answer,
    /// Virtual time passes (milliseconds).
    Wait(u64),
    /// A chunk reaches the sender's own copy (cut-through from its upstream).
    Arrive(u32),
    /// A chunk of the sender's copy rots at rest (caught when next read).
    Rot(u32),
    /// The scrub drops a chunk of the sender's copy.
    Scrub(u32),
    /// One requested repair finishes.
    Repaired,
    /// A misbehaving receiver answers a chunk again (or one never sent).
    DupAck(u32),
    /// A misbehaving receiver refuses a chunk never sent.
    StrayNack(u32),
}

struct Pair {
    now: Instant,
    range: Range<u32>,
    window: usize,
    tx: SendWindow,
    local: OwnCopy,
    repairs: VecDeque<u32>,
    rx: Inbound,
    /// The receiver's store: writes per chunk (its `Accept` counts as held, not written).
    held: BTreeSet<u32>,
    writes: BTreeMap<u32, u32>,
    /// Chunks the sender has sent on the wire, and chunks the receiver acknowledged.
    sent_acked: BTreeSet<u32>,
    /// Times each chunk is still to be corrupted in flight, and as planned.
    corrupt: HashMap<u32, u32>,
    planned: HashMap<u32, u32>,
    /// Chunks repaired since the sender last looked at its copy.
    repaired_unseen: BTreeSet<u32>,
    to_rx: VecDeque<Down>,
    verifying: Vec<(u32, bool)>,
    to_tx: VecDeque<Answer>,
    rx_done: bool,
    /// Frames that crossed the link so far, either way.
    frames: usize,
    outcome: Option<SendOutcome>,
    honest: bool,
}

impl Pair {
    fn new(
        range: Range<u32>,
        have: &BTreeSet<u32>,
        local: BTreeSet<u32>,
        window: usize,
        corrupt: HashMap<u32, u32>,
    ) -> Self {
        let now = Instant::now();
        let have: BTreeSet<u32> = have.iter().copied().filter(|i| range.contains(i)).collect();
        Self {
            now,
            tx: SendWindow::new(
                set(range.clone(), have.iter().copied()),
                cfg(window, MAX_RESENDS),
                now,
            ),
            local: OwnCopy {
                verified: local,
                ..OwnCopy::default()
            },
            repairs: VecDeque::new(),
            rx: Inbound::new(
                0,
                range.clone(),
                InboundConfig {
                    pipeline_depth: 3,
                    progress_interval: PROGRESS_EVERY,
                    stall_timeout: IDLE,
                },
                now,
            ),
            held: have,
            writes: BTreeMap::new(),
            sent_acked: BTreeSet::new(),
            planned: corrupt.clone(),
            corrupt,
            repaired_unseen: BTreeSet::new(),
            to_rx: VecDeque::new(),
            verifying: Vec::new(),
            to_tx: VecDeque::new(),
            rx_done: false,
            frames: 0,
            outcome: None,
            range,
            window,
            honest: true,
        }
    }

    fn pick(&self, i: u32) -> u32 {
        let n = self.range.len() as u32;
        self.range.start + if n == 0 { 0 } else { i % n }
    }

    fn finish(&mut self, o: Option<SendOutcome>) {
        if self.outcome.is_none() {
            self.outcome = o;
        }
    }

    /// Runs one step and checks the invariants after it.
    fn step(&mut self, step: &Step) {
        if self.outcome.is_some() {
            return;
        }
        match *step {
            Step::Pump => {
                self.repaired_unseen.clear();
                let mut asked = Vec::new();
                let sent = pump(&mut self.tx, &mut self.local, &mut asked);
                self.repairs.extend(asked.iter().map(|r| r.index));
                self.frames += sent.len();
                if !sent.is_empty() {
                    self.tx.note_sent(self.now);
                }
                for t in sent {
                    match t {
                        Transmit::Chunk { index, .. } => {
                            if self.honest {
                                assert!(
                                    !self.sent_acked.contains(&index),
                                    "chunk {index} sent again after its Ack"
                                );
                            }
                            let corrupt = match self.corrupt.get_mut(&index) {
                                Some(left) if *left > 0 => {
                                    *left -= 1;
                                    true
                                }
                                _ => false,
                            };
                            self.to_rx.push_back(Down::Chunk { index, corrupt });
                        }
                        Transmit::Done => self.to_rx.push_back(Down::Done),
                    }
                }
                // A Rejected failure surfaces on the next call.
                let o = self.tx.handle_timeout(self.now);
                self.finish(o);
            }
            Step::Deliver => {
                if !self.rx.wants_frame() {
                    return;
                }
                match self.to_rx.pop_front() {
                    Some(Down::Chunk { index, corrupt }) => {
                        let frame = InboundFrame::Chunk { shard: 0, index };
                        assert_eq!(self.rx.handle_frame(self.now, frame), Ok(()));
                        self.verifying.push((index, corrupt));
                    }
                    Some(Down::Done) => {
                        assert_eq!(self.rx.handle_frame(self.now, InboundFrame::Done), Ok(()));
                    }
                    None => {}
                }
            }
            Step::Verify(k) => {
                if self.verifying.is_empty() {
                    return;
                }
                let (index, corrupt) = self.verifying.remove(k % self.verifying.len());
                let verdict = if corrupt {
                    Verdict::Corrupt
                } else {
                    self.held.insert(index);
                    *self.writes.entry(index).or_default() += 1;
                    Verdict::Stored
                };
                let complete = self.held.len() == self.range.len();
                let reply = self.rx.handle_verdict(self.now, index, verdict, complete);
                self.to_tx.push_back(match reply.verdict {
                    Verdict::Stored => Answer::Ack(index),
                    Verdict::Corrupt => Answer::Nack(index),
                });
                if reply.progress {
                    self.to_tx.push_back(Answer::Progress);
                }
            }
            Step::Answer => {
                if let Some(a) = self.to_tx.pop_front() {
                    self.frames += 1;
                    if let Answer::Ack(i) = a {
                        self.sent_acked.insert(i);
                    }
                    let o = self.tx.handle_answer(self.now, a);
                    self.finish(o);
                }
            }
            Step::Wait(ms) => {
                self.now += Duration::from_millis(ms);
                let o = self.tx.handle_timeout(self.now);
                self.finish(o);
            }
            Step::Arrive(i) => {
                let i = self.pick(i);
                if !self.local.dropped.contains(&i) {
                    self.local.verified.insert(i);
                }
            }
            Step::Rot(i) => {
                let i = self.pick(i);
                if self.local.verified.contains(&i) {
                    self.local.rotten.insert(i);
                }
            }
            Step::Scrub(i) => {
                let i = self.pick(i);
                // Not a copy repaired since the sender last looked: the forwarder wakes on
                // every write to its copy, and the window does not tell a repaired and
                // dropped-again chunk from one still awaiting its first repair.
                if self.repaired_unseen.contains(&i) {
                    return;
                }
                if self.local.verified.remove(&i) {
                    self.local.rotten.remove(&i);
                    self.local.dropped.insert(i);
                }
            }
            Step::Repaired => {
                if let Some(i) = self.repairs.pop_front() {
                    self.local.repaired(i);
                    self.repaired_unseen.insert(i);
                }
            }
            Step::DupAck(i) => {
                self.honest = false;
                let i = self.pick(i);
                self.to_tx.push_front(Answer::Ack(i));
            }
            Step::StrayNack(i) => {
                self.honest = false;
                let i = self.pick(i);
                self.to_tx.push_front(Answer::Nack(i));
            }
        }
        // The receiver answers Done once its upstream finished and it holds the range.
        if !self.rx_done && !self.rx.feeding() && self.held.len() == self.range.len() {
            self.rx_done = true;
            self.to_tx.push_back(Answer::Done);
        }
        assert!(self.tx.in_flight() <= self.window, "window exceeded");
        if self.honest {
            assert!(
                self.writes.values().all(|&n| n == 1),
                "a chunk reached the receiver's store twice"
            );
        }
    }

    /// Honest, fair scheduling until the run ends: the sender's upstream delivers every
    /// chunk, repairs finish, every frame is delivered and every chunk verified in turn.
    /// When nothing can move, time passes to the sender's deadline. Returns the steps taken.
    fn drain(&mut self, limit: usize) -> usize {
        let mut steps = 0;
        while self.outcome.is_none() && steps < limit {
            steps += 1;
            let before = self.frames;
            for i in self.range.clone() {
                self.step(&Step::Arrive(i - self.range.start));
            }
            while !self.repairs.is_empty() {
                self.step(&Step::Repaired);
            }
            self.step(&Step::Pump);
            if self.outcome.is_some() {
                break;
            }
            while (self.rx.wants_frame() && !self.to_rx.is_empty()) || !self.verifying.is_empty() {
                self.step(&Step::Deliver);
                self.step(&Step::Verify(0));
            }
            while !self.to_tx.is_empty() && self.outcome.is_none() {
                self.step(&Step::Answer);
            }
            let repairing = !self.repairs.is_empty();
            if self.outcome.is_none() && !repairing && self.frames == before {
                match self.tx.poll_timeout() {
                    Some(t) => {
                        let ms = t.saturating_duration_since(self.now).as_millis() as u64;
                        self.step(&Step::Wait(ms));
                    }
                    None => panic!("stuck without a deadline: {:?}", self.tx),
                }
            }
        }
        steps
    }
}

const MAX_RESENDS: u32 = 3;

#[test]
fn a_pair_completes_with_corruption_in_flight_and_rot_at_rest() {
    let range = 0..12;
    let have: BTreeSet<u32> = [0, 5].into();
    let corrupt = HashMap::from([(3, 2), (7, 1)]);
    let mut p = Pair::new(range.clone(), &have, BTreeSet::new(), 4, corrupt);
    for step in [
        Step::Arrive(1),
        Step::Arrive(3),
        Step::Pump,
        Step::Rot(1),
        Step::Deliver,
        Step::Verify(0),
        Step::Answer,
        Step::Answer,
    ] {
        p.step(&step);
    }
    p.drain(100);
    assert_eq!(p.outcome, Some(SendOutcome::Complete));
    let written: BTreeSet<u32> = p.writes.keys().copied().collect();
    assert_eq!(written, range.filter(|i| !have.contains(i)).collect());
}

#[test]
fn a_pair_gives_up_a_receiver_that_refuses_good_bytes() {
    let corrupt = HashMap::from([(2, MAX_RESENDS + 1)]);
    let mut p = Pair::new(0..4, &BTreeSet::new(), (0..4).collect(), 2, corrupt);
    p.drain(100);
    assert_eq!(
        p.outcome,
        Some(SendOutcome::Failed(SendFailure::Rejected {
            index: 2,
            times: MAX_RESENDS + 1
        }))
    );
}

#[test]
fn a_pair_whose_receiver_stalls_fails_at_the_idle_deadline() {
    let mut p = Pair::new(0..4, &BTreeSet::new(), (0..4).collect(), 2, HashMap::new());
    let t0 = p.now;
    p.step(&Step::Pump);
    p.step(&Step::Deliver);
    // The receiver never answers: only time passes.
    p.step(&Step::Wait(IDLE.as_millis() as u64 - 1));
    assert_eq!(p.outcome, None);
    p.step(&Step::Wait(1));
    assert_eq!(
        p.outcome,
        Some(SendOutcome::Failed(SendFailure::Silent(IDLE)))
    );
    assert_eq!(p.now - t0, IDLE);
}

fn steps() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => Just(Step::Pump),
        4 => Just(Step::Deliver),
        4 => any::<usize>().prop_map(Step::Verify),
        4 => Just(Step::Answer),
        1 => (0u64..20_000).prop_map(Step::Wait),
        3 => any::<u32>().prop_map(Step::Arrive),
        1 => any::<u32>().prop_map(Step::Rot),
        1 => any::<u32>().prop_map(Step::Scrub),
        2 => Just(Step::Repaired),
    ]
}

fn hostile_steps() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => steps(),
        1 => any::<u32>().prop_map(Step::DupAck),
        1 => any::<u32>().prop_map(Step::StrayNack),
    ]
}

/// A run's setup: range, what the receiver holds, what the sender holds, window,
/// corruptions in flight per chunk.
type Setup = (
    Range<u32>,
    BTreeSet<u32>,
    BTreeSet<u32>,
    usize,
    HashMap<u32, u32>,
);

fn setup() -> impl Strategy<Value = Setup> {
    (0u32..4, 0u32..24).prop_flat_map(|(start, len)| {
        let range = start..start + len;
        let idx = proptest::collection::btree_set(start..start + len.max(1), 0..len as usize + 1);
        (
            Just(range),
            idx.clone(),
            idx,
            1usize..6,
            proptest::collection::hash_map(start..start + len.max(1), 0..=MAX_RESENDS + 1, 0..4),
        )
    })
}

/// Every run ends within a bounded number of fair rounds: complete with each missing
/// chunk written exactly once, or failed for a reason the run explains.
fn check_ending(p: &mut Pair, have: &BTreeSet<u32>, waited: Duration) {
    let limit = p.range.len() * (MAX_RESENDS as usize + 2) + 8;
    let rounds = p.drain(limit);
    assert!(rounds < limit, "no ending within {limit} rounds");
    match p.outcome.clone() {
        Some(SendOutcome::Complete) => {
            assert_eq!(p.held.len(), p.range.len());
            for i in p.range.clone() {
                let expected = u32::from(!have.contains(&i));
                assert_eq!(
                    p.writes.get(&i).copied().unwrap_or(0),
                    expected,
                    "chunk {i}"
                );
            }
        }
        Some(SendOutcome::Failed(SendFailure::Rejected { index, times })) => {
            assert_eq!(times, MAX_RESENDS + 1);
            assert!(p.planned.get(&index).is_some_and(|&n| n > MAX_RESENDS));
        }
        Some(SendOutcome::Failed(SendFailure::Silent(_))) => {
            assert!(
                waited >= IDLE || !p.honest,
                "silent failure without a stall"
            );
        }
        Some(SendOutcome::Failed(SendFailure::EarlyDone)) => panic!("the receiver is honest"),
        None => unreachable!("drain returns with an outcome"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_runs_hold_the_window_deliver_once_and_end(
        (range, have, local, window, corrupt) in setup(),
        run in proptest::collection::vec(steps(), 0..200),
    ) {
        let mut p = Pair::new(range, &have, local, window, corrupt);
        let start = p.now;
        for s in &run {
            p.step(s);
        }
        let waited = p.now - start;
        check_ending(&mut p, &have, waited);
    }

    #[test]
    fn misbehaving_receivers_never_break_the_window_or_hang_the_sender(
        (range, have, local, window, corrupt) in setup(),
        run in proptest::collection::vec(hostile_steps(), 0..200),
    ) {
        let mut p = Pair::new(range, &have, local, window, corrupt);
        for s in &run {
            p.step(s);
        }
        // A lying receiver may make the sender skip chunks or wait for answers that
        // never come; the window still holds and the run still ends (by the deadline).
        let limit = p.range.len() * (MAX_RESENDS as usize + 2) + 8;
        p.drain(limit);
        prop_assert!(p.outcome.is_some());
    }

    #[test]
    fn recovery_fetches_at_most_its_attempts_and_ends(
        has_fallback in any::<bool>(),
        events in proptest::collection::vec((0usize..3, 0u64..3_000, any::<bool>(), any::<bool>()), 0..60),
    ) {
        let mut now = Instant::now();
        let mut m = RecoveryMonitor::new(GRACE, 3);
        let watched = |feeders| Watched { has_source: has_fallback, ..watched(feeders) };
        let mut fetches = 0;
        let mut ended = false;
        // Random feeders, time and fill results first.
        for (feeders, ms, ok, complete) in events {
            now += Duration::from_millis(ms);
            match m.poll(now, watched(feeders)) {
                RecoveryAction::Wait(Some(t)) => prop_assert!(t > now && t <= now + GRACE),
                RecoveryAction::Wait(None) => prop_assert!(feeders > 0),
                RecoveryAction::Fetch { attempt } => {
                    fetches += 1;
                    prop_assert!(has_fallback);
                    prop_assert_eq!(attempt, fetches);
                    let result = if ok { Ok(()) } else { Err("x".to_string()) };
                    match m.fill_finished(result, ok && complete) {
                        AfterFill::Retry(_) => {}
                        AfterFill::Stop | AfterFill::Fail { .. } => { ended = true; break; }
                    }
                }
                RecoveryAction::NoSource => { prop_assert!(!has_fallback); ended = true; break; }
                RecoveryAction::Stop => unreachable!("never complete nor failed here"),
            }
        }
        prop_assert!(fetches <= 3);
        // Then no feeder ever comes back: the monitor ends within its attempts' grace.
        let mut polls = 0;
        while !ended {
            polls += 1;
            prop_assert!(polls <= 3 * 3, "recovery did not end");
            match m.poll(now, watched(0)) {
                RecoveryAction::Wait(Some(t)) => now = t,
                RecoveryAction::Fetch { .. } => {
                    fetches += 1;
                    if matches!(m.fill_finished(Ok::<(), ()>(()), false), AfterFill::Fail { .. }) {
                        ended = true;
                    }
                }
                RecoveryAction::NoSource => ended = true,
                other => prop_assert!(false, "unexpected {:?}", other),
            }
        }
        prop_assert!(fetches <= 3);
    }
}

/// A chunk still arriving here may have its pieces sent ahead while it is unsent on this
/// connection and not held below; once sent (or held by the downstream) it may not.
#[test]
fn pieces_go_ahead_only_of_chunks_not_sent_on_the_connection() {
    let (_, _, w) = start(0..6, [1], 4, 3);
    assert!(w.unsent(0) && w.unsent(5));
    assert!(!w.unsent(1), "held below");
    assert!(!w.unsent(6), "outside the range");
    let mut local = OwnCopy::default();
    local.verified.insert(0);
    let (_, _, mut w) = start(0..6, [], 4, 3);
    let sent = pump(&mut w, &mut local, &mut Vec::new());
    assert_eq!(chunks(&sent), vec![0]);
    assert!(!w.unsent(0), "sent");
    assert!(w.unsent(2), "not here yet: its pieces may go ahead");
}

/// A chunk sent down whole in pieces ahead of our own copy is in flight and answered like
/// any chunk; a `Nack` for it is re-sent only once our copy holds it.
#[test]
fn a_chunk_sent_ahead_is_in_flight_and_resent_only_once_held_here() {
    let (t0, _, mut w) = start(0..3, [], 4, 3);
    let mut local = OwnCopy::default();
    w.sent_ahead(1, t0);
    assert_eq!(w.in_flight(), 1);
    assert!(!w.unsent(1));
    // Not held here yet: nothing to send (not the chunk it sent ahead either).
    assert!(pump(&mut w, &mut local, &mut Vec::new()).is_empty());
    // Refused below (a piece corrupted on the way): re-sent once held here.
    assert_eq!(w.handle_answer(t0, Answer::Nack(1)), None);
    assert_eq!(w.in_flight(), 0);
    assert!(pump(&mut w, &mut local, &mut Vec::new()).is_empty());
    local.verified.insert(1);
    let sent = pump(&mut w, &mut local, &mut Vec::new());
    assert_eq!(
        sent,
        vec![Transmit::Chunk {
            index: 1,
            recheck: true
        }]
    );
    assert_eq!(w.handle_answer(t0, Answer::Ack(1)), None);
    assert!(w.acked().contains(1));
    // Sent ahead twice, or after it was sent: counted once.
    w.sent_ahead(1, t0);
    assert_eq!(w.in_flight(), 0);
}
