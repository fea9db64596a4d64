//! Bandwidth caps shared by every session of a daemon.
//!
//! A [`RateLimiter`] is a token bucket implemented by virtual-time scheduling (the "generic
//! cell rate algorithm"): the bucket keeps one timestamp, the *theoretical finish time* of all
//! bytes granted so far. Each [`RateLimiter::acquire`] takes the mutex for a few nanoseconds,
//! pushes that timestamp forward by `n / rate` seconds and then sleeps, outside the lock,
//! until its slot has come (less a small burst allowance). So:
//!
//! * the long-run rate is exact, however many sessions share the limiter;
//! * grants are FIFO: a session that asks again after being served queues behind every
//!   session already waiting, so sessions moving equal pieces get equal shares;
//! * nothing polls or spins; an unlimited limiter costs one branch.
//!
//! Clones share one bucket: hand a clone to every session that must respect the same cap
//! (the daemon's egress limiter to all outgoing sessions, its ingress limiter to all
//! incoming ones). Time comes from `tokio::time`, so tests can run it on a paused clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// Longest burst a limiter lets through after being idle, as time at the full rate (20 ms).
/// Rationale: long enough that timer granularity (~1 ms) and scheduling jitter do not eat
/// into the rate, short enough that a burst does not overflow switch buffers or starve a
/// competing flow.
const MAX_BURST_TIME: Duration = Duration::from_millis(20);

/// Longest burst as bytes (4 MiB), which bounds [`MAX_BURST_TIME`] at high rates so a
/// 100 Gbit/s cap still smooths at the granularity of a few chunks.
const MAX_BURST_BYTES: u64 = 4 << 20;

/// A token-bucket limiter on bytes per second, shared by clones.
#[derive(Clone, Debug)]
pub struct RateLimiter {
    bucket: Option<Arc<Bucket>>,
}

#[derive(Debug)]
struct Bucket {
    /// Bytes per second, at least 1.
    rate: u64,
    /// How far ahead of the clock a grant may be and still pass at once.
    burst: Duration,
    /// The time by which every byte granted so far will have passed at `rate`.
    finish: Mutex<Instant>,
}

impl RateLimiter {
    /// A limiter of `bytes_per_sec` bytes per second; `None` (or `Some(0)`) is unlimited.
    pub fn new(bytes_per_sec: Option<u64>) -> Self {
        let Some(rate) = bytes_per_sec.filter(|&r| r > 0) else {
            return Self::unlimited();
        };
        let burst = MAX_BURST_TIME.min(transfer_time(MAX_BURST_BYTES, rate));
        Self {
            bucket: Some(Arc::new(Bucket {
                rate,
                burst,
                finish: Mutex::new(Instant::now()),
            })),
        }
    }

    /// A limiter that never waits.
    pub fn unlimited() -> Self {
        Self { bucket: None }
    }

    /// The cap in bytes per second, or `None` when unlimited.
    pub fn rate(&self) -> Option<u64> {
        self.bucket.as_ref().map(|b| b.rate)
    }

    /// Reserves `n` bytes now and returns the instant at which they may pass (now, when
    /// unlimited). Callers that may be cancelled keep the instant and sleep until it, so a
    /// cancelled wait is resumed rather than charged twice.
    pub fn reserve(&self, n: u64) -> Instant {
        match &self.bucket {
            Some(bucket) if n > 0 => bucket.reserve(n),
            _ => Instant::now(),
        }
    }

    /// Waits until `n` more bytes may pass.
    ///
    /// The bytes are reserved when this is first polled: dropping the future while it waits
    /// does not give them back, so a cancelled transfer costs its share of the rate once.
    pub async fn acquire(&self, n: u64) {
        let Some(bucket) = &self.bucket else { return };
        if n == 0 {
            return;
        }
        let deadline = bucket.reserve(n);
        if deadline > Instant::now() {
            tokio::time::sleep_until(deadline).await;
        }
    }
}

impl Bucket {
    /// Reserves `n` bytes and returns when they may pass.
    fn reserve(&self, n: u64) -> Instant {
        let now = Instant::now();
        // A poisoned lock only means another acquirer panicked between two plain stores;
        // the timestamp is still a valid timestamp.
        let mut finish = self.finish.lock().unwrap_or_else(|e| e.into_inner());
        // An idle bucket does not bank more than `burst` of credit.
        let start = (*finish).max(now.checked_sub(self.burst).unwrap_or(now));
        *finish = start + transfer_time(n, self.rate);
        finish.checked_sub(self.burst).unwrap_or(now)
    }
}

/// Time `n` bytes take at `rate` bytes per second (saturating at ~584 years).
fn transfer_time(n: u64, rate: u64) -> Duration {
    let nanos = u128::from(n) * 1_000_000_000 / u128::from(rate.max(1));
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    const MB: u64 = 1_000_000;

    /// Moves `total` bytes in `piece`-byte acquires on `tasks` concurrent tasks and returns
    /// the elapsed (virtual) time.
    async fn run(limiter: &RateLimiter, tasks: usize, total: u64, piece: u64) -> Duration {
        let start = Instant::now();
        let per_task = total / tasks as u64;
        let handles: Vec<_> = (0..tasks)
            .map(|_| {
                let l = limiter.clone();
                tokio::spawn(async move {
                    let mut done = 0;
                    while done < per_task {
                        l.acquire(piece).await;
                        done += piece;
                    }
                })
            })
            .collect();
        for h in handles {
            h.await.unwrap();
        }
        start.elapsed()
    }

    fn assert_close(got: Duration, want: Duration, tolerance: f64) {
        let ratio = got.as_secs_f64() / want.as_secs_f64();
        assert!(
            (1.0 - tolerance..=1.0 + tolerance).contains(&ratio),
            "took {got:?}, expected {want:?} (ratio {ratio:.4})"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn one_acquirer_holds_the_rate() {
        let l = RateLimiter::new(Some(100 * MB));
        assert_eq!(l.rate(), Some(100 * MB));
        let took = run(&l, 1, 1000 * MB, 256 << 10).await;
        assert_close(took, Duration::from_secs(10), 0.02);
    }

    #[tokio::test(start_paused = true)]
    async fn many_acquirers_hold_the_rate() {
        let l = RateLimiter::new(Some(50 * MB));
        // 32 tasks x 64 KiB pieces, 500 MB in all: 10 s.
        let took = run(&l, 32, 32 * 15625 * 1000, 64_000).await;
        assert_close(took, Duration::from_secs(10), 0.02);
    }

    #[tokio::test(start_paused = true)]
    async fn slow_rates_and_odd_sizes_hold() {
        // 1000 B/s with 333-byte pieces: rounding must not accumulate.
        let l = RateLimiter::new(Some(1000));
        let took = run(&l, 3, 3 * 333 * 100, 333).await;
        assert_close(took, Duration::from_secs_f64(99.9), 0.02);
        // A single acquire larger than the burst waits for its whole length.
        let l = RateLimiter::new(Some(MB));
        let start = Instant::now();
        l.acquire(5 * MB).await;
        assert_close(start.elapsed(), Duration::from_secs(5), 0.01);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_credit_is_bounded() {
        let l = RateLimiter::new(Some(100 * MB));
        tokio::time::sleep(Duration::from_secs(60)).await;
        // After a minute idle only the burst (2 MB at 20 ms) passes at once, not 6 GB.
        let start = Instant::now();
        l.acquire(2 * MB).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        let took = run(&l, 1, 1000 * MB, MB).await;
        assert_close(took, Duration::from_secs(10), 0.01);
    }

    #[tokio::test(start_paused = true)]
    async fn unlimited_never_sleeps() {
        for l in [
            RateLimiter::unlimited(),
            RateLimiter::new(None),
            RateLimiter::new(Some(0)),
        ] {
            assert_eq!(l.rate(), None);
            let start = Instant::now();
            for _ in 0..1000 {
                assert!(l.acquire(u64::MAX / 2).now_or_never().is_some());
            }
            assert_eq!(start.elapsed(), Duration::ZERO);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_acquirers_get_equal_shares() {
        let l = RateLimiter::new(Some(10 * MB));
        let end = Instant::now() + Duration::from_secs(20);
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let l = l.clone();
                tokio::spawn(async move {
                    let mut moved = 0u64;
                    while Instant::now() < end {
                        l.acquire(64 << 10).await;
                        moved += 64 << 10;
                    }
                    moved
                })
            })
            .collect();
        let mut shares = Vec::new();
        for h in handles {
            shares.push(h.await.unwrap());
        }
        let total: u64 = shares.iter().sum();
        let (min, max) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
        // Shares differ by at most the burst (200 KB here, which the first task takes
        // without yielding) plus one piece in flight: under 2% over 20 s.
        assert!(
            max - min <= 200_000 + (64 << 10),
            "unequal shares: {shares:?}"
        );
        assert_close(
            Duration::from_secs_f64(total as f64 / (10 * MB) as f64),
            Duration::from_secs(20),
            0.02,
        );
    }
}
