//! One model's request queue and the GPU replicas that serve it (the thesis' "global
//! queue": every replica pulls the oldest waiting request whenever it is free, §8.4).
//!
//! Pure: no clock, no I/O. The caller adds arrivals, adds replica groups as they become
//! resident and removes them as they are evicted, and calls [`Serving::advance`] with the
//! virtual time; everything that can start by then starts, in arrival order, on the replica
//! that is free earliest. A request's service takes `1 / μ` seconds (batch 1, the model's
//! execution time from its profile); its end-to-end latency is its wait plus its service.
//!
//! `advance(t)` is exact, not a tick approximation: a request starts at
//! `max(arrival, replica free)` and only starts if that is at most `t`, and the caller adds
//! every replica that became resident by `t` with its exact resident time before calling
//! it, so calling it every second or every millisecond gives the same latencies.
//!
//! A removed replica finishes the request it is serving (its start and end are already
//! booked) and takes no new one.
//!
//! A partitioned replica (Flashpoint §4.1.2, §4.2: its parts on several GPUs, requests
//! pipelined through them) is one slot with its own [`Timing`]
//! ([`Serving::add_pipeline`]): it takes the next request one slowest stage after the last
//! (`interval_s`: the longest execution or activation transfer of any part) and each
//! request takes the whole inference (`latency_s`: every part's execution plus every
//! transfer between parts). With fixed stage times and requests entering at least one
//! slowest stage apart, no request ever waits inside the pipeline, so this is exact for
//! the pipeline the thesis describes (eq. 4.1–4.4).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};

/// A replica's next free time, ordered for a min-heap (time, then group, then index).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Free {
    at: f64,
    group: u64,
    index: u32,
}

impl Eq for Free {}

impl Ord for Free {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at
            .total_cmp(&other.at)
            .then_with(|| self.group.cmp(&other.group))
            .then_with(|| self.index.cmp(&other.index))
    }
}

impl PartialOrd for Free {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// How one slot of a group serves (module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Seconds from taking one request to taking the next.
    pub interval_s: f64,
    /// Seconds from a request's start to its end.
    pub latency_s: f64,
    /// Replica-seconds of service a request books (the scalers' utilisation): a whole
    /// replica's service time; a pipeline's interval times its GPUs.
    pub busy_s: f64,
}

/// What was served between two calls of [`Serving::take_window`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Window {
    /// Requests that arrived.
    pub arrived: u64,
    /// Requests that started service.
    pub started: u64,
    /// Seconds of service started (the busy time the window booked).
    pub busy_s: f64,
    /// Summed wait of the requests that started, seconds.
    pub wait_s: f64,
}

/// One model's queue and replicas.
#[derive(Debug)]
pub struct Serving {
    service_s: f64,
    queue: VecDeque<f64>,
    free: BinaryHeap<Reverse<Free>>,
    groups: BTreeSet<u64>,
    /// Groups that do not serve at the whole replica's `service_s` (pipelines).
    timings: HashMap<u64, Timing>,
    removed: HashSet<u64>,
    replicas: u32,
    latencies: Vec<f64>,
    window: Window,
}

impl Serving {
    /// A queue whose replicas each serve one request in `service_s` seconds.
    pub fn new(service_s: f64) -> Self {
        Self {
            service_s: service_s.max(1e-9),
            queue: VecDeque::new(),
            free: BinaryHeap::new(),
            groups: BTreeSet::new(),
            timings: HashMap::new(),
            removed: HashSet::new(),
            replicas: 0,
            latencies: Vec::new(),
            window: Window::default(),
        }
    }

    /// Seconds one request takes.
    pub fn service_s(&self) -> f64 {
        self.service_s
    }

    /// A request arrives at `at` (arrivals in time order).
    pub fn arrive(&mut self, at: f64) {
        self.queue.push_back(at);
        self.window.arrived += 1;
    }

    /// Replica group `group` of `count` replicas serves from `at` on. A group already known
    /// is ignored.
    pub fn add_group(&mut self, group: u64, count: u32, at: f64) {
        if !self.groups.insert(group) {
            return;
        }
        self.replicas += count;
        for index in 0..count {
            self.free.push(Reverse(Free { at, group, index }));
        }
    }

    /// Pipeline `group` (a partitioned replica over `gpus` GPUs, counted as that many
    /// replicas) serves from `at` on with `timing`. A group already known is ignored.
    pub fn add_pipeline(&mut self, group: u64, gpus: u32, at: f64, timing: Timing) {
        if !self.groups.insert(group) {
            return;
        }
        self.replicas += gpus;
        self.timings.insert(group, timing);
        self.free.push(Reverse(Free {
            at,
            group,
            index: 0,
        }));
    }

    /// Replica group `group` serves no more requests.
    pub fn remove_group(&mut self, group: u64, count: u32) {
        if self.groups.remove(&group) {
            self.removed.insert(group);
            self.replicas = self.replicas.saturating_sub(count);
        }
    }

    /// Whether group `group` serves.
    pub fn has_group(&self, group: u64) -> bool {
        self.groups.contains(&group)
    }

    /// Replicas serving.
    pub fn replicas(&self) -> u32 {
        self.replicas
    }

    /// Requests waiting (arrived, not started) after the last `advance`.
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// The oldest waiting request's arrival.
    pub fn oldest_waiting(&self) -> Option<f64> {
        self.queue.front().copied()
    }

    /// Starts every request that can start by `now` (module docs).
    pub fn advance(&mut self, now: f64) {
        while let Some(&arrival) = self.queue.front() {
            let Some(Reverse(slot)) = self.free.peek().copied() else {
                break;
            };
            if self.removed.contains(&slot.group) {
                self.free.pop();
                continue;
            }
            let start = arrival.max(slot.at);
            if start > now {
                break;
            }
            self.free.pop();
            self.queue.pop_front();
            let t = self.timings.get(&slot.group).copied().unwrap_or(Timing {
                interval_s: self.service_s,
                latency_s: self.service_s,
                busy_s: self.service_s,
            });
            self.latencies.push(start + t.latency_s - arrival);
            self.window.started += 1;
            self.window.busy_s += t.busy_s;
            self.window.wait_s += start - arrival;
            self.free.push(Reverse(Free {
                at: start + t.interval_s,
                ..slot
            }));
        }
    }

    /// What happened since the last call.
    pub fn take_window(&mut self) -> Window {
        std::mem::take(&mut self.window)
    }

    /// End-to-end latencies of every request started so far, in start order.
    pub fn latencies(&self) -> &[f64] {
        &self.latencies
    }

    /// The requests still waiting, by arrival.
    pub fn waiting(&self) -> impl Iterator<Item = f64> + '_ {
        self.queue.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_replica_serves_in_arrival_order_and_requests_wait_for_it() {
        // Service 0.5 s. Requests at 0, 0.1, 0.2 on one replica resident at 1.0: they
        // start at 1.0, 1.5, 2.0 and end 0.5 s later.
        let mut s = Serving::new(0.5);
        for t in [0.0, 0.1, 0.2] {
            s.arrive(t);
        }
        s.advance(0.9);
        assert_eq!(s.queue_len(), 3, "no replica yet");
        s.add_group(7, 1, 1.0);
        s.advance(1.6);
        // 1.0 and 1.5 started by 1.6; the third starts at 2.0.
        assert_eq!(s.queue_len(), 1);
        assert_eq!(s.latencies(), &[1.5, 1.9]);
        s.advance(2.0);
        assert_eq!(s.queue_len(), 0);
        let l = s.latencies();
        assert!((l[2] - 2.3).abs() < 1e-12, "{l:?}");
        let w = s.take_window();
        assert_eq!((w.arrived, w.started), (3, 3));
        assert!((w.busy_s - 1.5).abs() < 1e-12);
        assert!((w.wait_s - (1.0 + 1.4 + 1.8)).abs() < 1e-12);
        assert_eq!(s.take_window(), Window::default());
    }

    #[test]
    fn the_earliest_free_replica_takes_the_next_request() {
        // Two replicas (service 1 s), resident at 0 and 0.5; four requests at 0.
        // Starts: 0 (r0), 0.5 (r1), 1.0 (r0), 1.5 (r1).
        let mut s = Serving::new(1.0);
        for _ in 0..4 {
            s.arrive(0.0);
        }
        s.add_group(1, 1, 0.0);
        s.add_group(2, 1, 0.5);
        assert_eq!(s.replicas(), 2);
        s.advance(10.0);
        assert_eq!(s.latencies(), &[1.0, 1.5, 2.0, 2.5]);
    }

    #[test]
    fn calling_advance_often_or_once_gives_the_same_latencies() {
        let arrivals: Vec<f64> = (0..200).map(|i| f64::from(i) * 0.013).collect();
        let run = |step: f64| {
            let mut s = Serving::new(0.05);
            s.add_group(1, 2, 0.3);
            s.add_group(2, 1, 0.9);
            let mut next = 0;
            let mut t = 0.0;
            while t < 20.0 {
                t += step;
                while next < arrivals.len() && arrivals[next] <= t {
                    s.arrive(arrivals[next]);
                    next += 1;
                }
                s.advance(t);
            }
            s.latencies().to_vec()
        };
        let (a, b) = (run(1.0), run(0.001));
        assert_eq!(a.len(), 200);
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-9, "{x} vs {y}");
        }
    }

    #[test]
    fn a_pipeline_takes_a_request_every_slowest_stage_and_each_takes_the_inference() {
        // Interval 0.2 s, latency 0.7 s, over 4 GPUs; five requests at 0 and a pipeline
        // live at 1.0: starts 1.0, 1.2, 1.4, 1.6, 1.8; each ends 0.7 s later.
        let mut s = Serving::new(0.5);
        for _ in 0..5 {
            s.arrive(0.0);
        }
        let t = Timing {
            interval_s: 0.2,
            latency_s: 0.7,
            busy_s: 0.8,
        };
        s.add_pipeline(9, 4, 1.0, t);
        assert_eq!(s.replicas(), 4);
        s.advance(1.5);
        assert_eq!(s.queue_len(), 2);
        s.advance(10.0);
        let want = [1.7, 1.9, 2.1, 2.3, 2.5];
        for (l, w) in s.latencies().iter().zip(want) {
            assert!((l - w).abs() < 1e-12, "{:?}", s.latencies());
        }
        let w = s.take_window();
        assert!((w.busy_s - 5.0 * 0.8).abs() < 1e-12);
        // Switched to whole replicas: the pipeline goes, the parts serve at the model's
        // own service time.
        s.remove_group(9, 4);
        s.add_group(10, 2, 11.0);
        s.arrive(11.0);
        s.advance(11.0);
        assert_eq!(s.replicas(), 2);
        assert_eq!(s.latencies().last(), Some(&0.5));
    }

    #[test]
    fn a_removed_group_takes_no_new_request() {
        let mut s = Serving::new(1.0);
        s.add_group(1, 2, 0.0);
        s.arrive(0.0);
        s.advance(0.0);
        s.remove_group(1, 2);
        assert_eq!(s.replicas(), 0);
        assert!(!s.has_group(1));
        s.arrive(0.5);
        s.advance(5.0);
        assert_eq!(s.queue_len(), 1);
        assert_eq!(s.oldest_waiting(), Some(0.5));
        // Re-adding a removed id is a new group of the same id: ignored only while known.
        s.add_group(3, 1, 6.0);
        s.advance(6.0);
        assert_eq!(s.latencies(), &[1.0, 6.5]);
    }
}
