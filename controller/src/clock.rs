//! The controller's clock: [`now_unix`]. A module of its own, below every other, so that
//! the owners (`core`), the usage tracker and the autoscaler read one clock without
//! importing each other.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch on the tokio clock: the system clock is read once (the
/// first call in the process), and from then on advanced by `tokio::time::Instant` — the
/// monotonic clock in a daemon, the virtual one on a paused runtime (the simulator,
/// `start_paused` tests). Plans, events, last uses, the autoscaler's state and the lost
/// grace of hosts that stopped heartbeating are stamped with it, so every decision of the
/// controller that waits on time runs on one clock, and a paused runtime moves them all.
/// What other processes read — plan tokens, heartbeat answers (`unix_now_ms`) — keeps the
/// system clock.
///
/// Across runtimes (the simulator runs one paused runtime per run, each starting at the
/// real instant it was built) the anchor is one instant: a runtime built after another ran
/// hours of virtual time may read times before the other's last ones, never a clock that
/// stands still.
pub(crate) fn now_unix() -> f64 {
    static ANCHOR: std::sync::OnceLock<(f64, tokio::time::Instant)> = std::sync::OnceLock::new();
    let (wall, at) = *ANCHOR.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        (wall, tokio::time::Instant::now())
    });
    let now = tokio::time::Instant::now();
    if now >= at {
        wall + (now - at).as_secs_f64()
    } else {
        wall - (at - now).as_secs_f64()
    }
}
