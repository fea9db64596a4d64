//! A flow-level model of a datacenter network: hosts under leaf switches under one spine,
//! and an origin ("cloud storage") behind the spine; flows share the links they cross
//! max-min fairly (progressive filling), recomputed whenever a flow starts or ends.
//!
//! Pure: no I/O, no clock. The caller passes virtual time (seconds since the simulation
//! began) into every call that moves time forward; [`Network::advance`] moves every flow
//! at its rate up to that time, event by event, so a flow that ends half-way gives its
//! bandwidth to the others from that instant on, and returns each milestone crossed with
//! its exact time.
//!
//! ## Topology (default: Flashpoint's, thesis §8.2.2 and §8.4)
//!
//! ```text
//!                 origin ──origin link── spine
//!                                      ╱   │   ╲        leaf uplinks (100 Gbit/s each way)
//!                                 leaf 0  leaf 1 … leaf 9
//!                                 ╱ │ ╲                 host links (50 Gbit/s each way)
//!                            h0 … h19  (20 hosts per leaf, 200 hosts)
//! ```
//!
//! Links are full duplex: each host link and leaf uplink is two directed links, one per
//! direction, each with the full capacity. A path between two hosts under one leaf crosses
//! the sender's host link up and the receiver's down; under different leaves also the
//! sender's leaf uplink up and the receiver's down. The spine itself is non-blocking. The
//! origin reaches the spine through one directed link of the cluster's effective bandwidth
//! to cloud storage (the thesis' simulator varies exactly this, Fig. 8.3; 2,203 Mbit/s
//! measured), and each stream it serves is capped at the per-stream rate of one S3 client
//! (2.2–2.9 Gbit/s measured, §3.4.1). Either can be unlimited.
//!
//! ## Flows
//!
//! A flow is a pipelined transfer along one or more segments — a direct download is one
//! segment (origin → host), a chain of `k` hops is `k` segments (source → h1 → … → hk) that
//! all move at one rate, the chain's bottleneck (cut-through forwarding: no hop can run ahead
//! of the one feeding it, and none falls behind for long). Its links are the union of its
//! segments' paths; a link crossed by two segments of the same flow (a chain that leaves a
//! leaf twice) carries the flow's rate twice. A flow may carry its own rate cap (e.g. the
//! measured per-hop CPU limit of a verified TLS hop).
//!
//! Progress is one number per flow, the bytes that have passed its first segment. Its
//! milestones are the progress values someone waits for: hop `j` of a chain holds all `S`
//! bytes once the head has pushed `S + j * chunk` (each hop forwards a chunk only once it
//! has received and verified it, so hop `j` lags the head by `j` chunks). The flow ends at
//! its last milestone.
//!
//! ## Max-min fairness
//!
//! [`Network::rates`] are the max-min fair allocation: every unfrozen flow's rate rises at
//! the same pace; a link that fills freezes the flows crossing it, a flow that reaches its
//! cap freezes. The result has no link over capacity, and every flow is either at its cap
//! or crosses a saturated link on which no flow has a higher rate (its bottleneck) — the
//! two properties the tests check on random inputs.

use std::collections::BTreeMap;

/// Bytes a milestone may be short of and still count as reached (float rounding).
const BYTES_EPS: f64 = 1e-3;

/// Relative slack under which a link counts as full.
const FULL_EPS: f64 = 1e-9;

/// One end of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Endpoint {
    /// The origin (cloud storage), behind the spine.
    Origin,
    /// A host, by index (`0..hosts`).
    Host(usize),
}

/// The shape and link rates of the datacenter. Rates are bytes per second.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    /// Hosts.
    pub hosts: usize,
    /// Hosts under each leaf switch (the last leaf may have fewer).
    pub hosts_per_leaf: usize,
    /// Each host's link to its leaf, each way.
    pub host_link_bps: f64,
    /// Each leaf's uplink to the spine, each way.
    pub leaf_uplink_bps: f64,
    /// The cluster's link to the origin, origin → spine (`None`: unlimited).
    pub origin_link_bps: Option<f64>,
    /// The most one stream from the origin moves (`None`: unlimited).
    pub origin_stream_bps: Option<f64>,
}

/// Bits per second to bytes per second.
pub fn gbit(gbps: f64) -> f64 {
    gbps * 1e9 / 8.0
}

impl Topology {
    /// Flashpoint's simulated datacenter (§8.2.2, §8.4): 200 hosts, 20 per leaf, 50 Gbit/s
    /// host links, 100 Gbit/s leaf-to-spine links, and cloud storage at the 2,203 Mbit/s
    /// the thesis measured from its testbed, both per stream and for the cluster as a whole.
    pub fn flashpoint() -> Self {
        Self {
            hosts: 200,
            hosts_per_leaf: 20,
            host_link_bps: gbit(50.0),
            leaf_uplink_bps: gbit(100.0),
            origin_link_bps: Some(gbit(2.203)),
            origin_stream_bps: Some(gbit(2.203)),
        }
    }

    /// Leaf switches.
    pub fn leaves(&self) -> usize {
        self.hosts.div_ceil(self.hosts_per_leaf.max(1))
    }

    /// The leaf `host` hangs off.
    pub fn leaf_of(&self, host: usize) -> usize {
        host / self.hosts_per_leaf.max(1)
    }

    fn host_up(&self, h: usize) -> usize {
        2 * h
    }

    fn host_down(&self, h: usize) -> usize {
        2 * h + 1
    }

    fn leaf_up(&self, l: usize) -> usize {
        2 * self.hosts + 2 * l
    }

    fn leaf_down(&self, l: usize) -> usize {
        2 * self.hosts + 2 * l + 1
    }

    fn origin_link(&self) -> usize {
        2 * self.hosts + 2 * self.leaves()
    }

    /// Directed links, indexed as the paths name them.
    fn link_count(&self) -> usize {
        self.origin_link() + 1
    }

    /// Capacity of each directed link (`f64::INFINITY`: unlimited).
    fn capacities(&self) -> Vec<f64> {
        let mut caps = vec![0.0; self.link_count()];
        for h in 0..self.hosts {
            caps[self.host_up(h)] = self.host_link_bps;
            caps[self.host_down(h)] = self.host_link_bps;
        }
        for l in 0..self.leaves() {
            caps[self.leaf_up(l)] = self.leaf_uplink_bps;
            caps[self.leaf_down(l)] = self.leaf_uplink_bps;
        }
        caps[self.origin_link()] = self.origin_link_bps.unwrap_or(f64::INFINITY);
        caps
    }

    /// The directed links from `from` to `to`, in order.
    pub fn path(&self, from: Endpoint, to: Endpoint) -> Result<Vec<usize>, NetError> {
        let check = |e: Endpoint| match e {
            Endpoint::Host(h) if h >= self.hosts => Err(NetError::NoSuchHost(h)),
            _ => Ok(()),
        };
        check(from)?;
        check(to)?;
        Ok(match (from, to) {
            (a, b) if a == b => return Err(NetError::Loop(a)),
            (_, Endpoint::Origin) => return Err(NetError::ToOrigin),
            (Endpoint::Origin, Endpoint::Host(b)) => vec![
                self.origin_link(),
                self.leaf_down(self.leaf_of(b)),
                self.host_down(b),
            ],
            (Endpoint::Host(a), Endpoint::Host(b)) => {
                let (la, lb) = (self.leaf_of(a), self.leaf_of(b));
                if la == lb {
                    vec![self.host_up(a), self.host_down(b)]
                } else {
                    vec![
                        self.host_up(a),
                        self.leaf_up(la),
                        self.leaf_down(lb),
                        self.host_down(b),
                    ]
                }
            }
        })
    }
}

/// Why a flow cannot be added.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NetError {
    /// A host index past the topology's hosts.
    #[error("host {0} is not in the topology")]
    NoSuchHost(usize),
    /// A segment from an endpoint to itself.
    #[error("a segment from {0:?} to itself")]
    Loop(Endpoint),
    /// A segment into the origin (the origin only sends).
    #[error("a segment into the origin")]
    ToOrigin,
    /// No segments, or milestones that are empty, not ascending or not positive.
    #[error("invalid flow: {0}")]
    Invalid(&'static str),
}

/// A flow to add.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowSpec {
    /// The segments, in order (each `(from, to)`).
    pub segments: Vec<(Endpoint, Endpoint)>,
    /// Its own rate cap, bytes/s (`None`: none beyond the links and the origin's stream
    /// cap).
    pub cap_bps: Option<f64>,
    /// Progress values (bytes) to report when crossed, strictly ascending and positive; the
    /// last is the flow's size.
    pub milestones: Vec<f64>,
}

/// A flow's handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowId(pub u64);

/// A milestone crossed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reached {
    /// The flow.
    pub flow: FlowId,
    /// Index into its milestones.
    pub milestone: usize,
    /// When, seconds.
    pub at: f64,
    /// It was the last one: the flow has ended and is gone.
    pub ended: bool,
}

#[derive(Debug, Clone)]
struct Flow {
    /// (link, times the flow crosses it).
    links: Vec<(usize, u32)>,
    cap: f64,
    milestones: Vec<f64>,
    next: usize,
    /// Progress at `since`; it grows at `rate` from then on (settled only when rates
    /// change, so that moving time forward costs nothing between events).
    progress: f64,
    since: f64,
    rate: f64,
    from_origin: bool,
}

impl Flow {
    fn size(&self) -> f64 {
        self.milestones.last().copied().unwrap_or(0.0)
    }

    fn progress_at(&self, t: f64) -> f64 {
        (self.progress + self.rate * (t - self.since).max(0.0)).min(self.size())
    }

    /// Whether milestone `m` counts as crossed at `at`: within [`BYTES_EPS`], or so close
    /// that the time to cross it is lost in `at`'s float resolution. Without the second
    /// case a fast flow late in a long run (at t = 5000 s one ulp is 1e-12 s, 6 mB at
    /// 50 Gbit/s) could sit a few millibytes short, its `next_at` rounding to now, and
    /// `advance` would loop at that instant forever (found by the 1-hour trace runs).
    fn crossed(&self, m: f64, at: f64) -> bool {
        let left = m - self.progress;
        left <= BYTES_EPS || (self.rate > 0.0 && self.since + left / self.rate <= at)
    }

    /// When the next milestone is crossed at the current rate (absolute time).
    fn next_at(&self) -> f64 {
        let Some(&m) = self.milestones.get(self.next) else {
            return f64::INFINITY;
        };
        let left = m - self.progress;
        if left <= BYTES_EPS {
            self.since
        } else if self.rate <= 0.0 {
            f64::INFINITY
        } else {
            self.since + left / self.rate
        }
    }
}

/// The network: its topology, the flows in progress and their max-min fair rates.
#[derive(Debug, Clone)]
pub struct Network {
    topo: Topology,
    caps: Vec<f64>,
    /// By id: iteration in id order keeps every result independent of hashing.
    flows: BTreeMap<FlowId, Flow>,
    next_id: u64,
    now: f64,
    /// When the next milestone is crossed at the current rates (cached: every sync asks).
    next_at: Option<f64>,
    /// Bytes that left the origin up to the flows' `since`.
    origin_settled: f64,
}

impl Network {
    /// An idle network at time 0.
    pub fn new(topo: Topology) -> Self {
        let caps = topo.capacities();
        Self {
            topo,
            caps,
            flows: BTreeMap::new(),
            next_id: 0,
            now: 0.0,
            next_at: None,
            origin_settled: 0.0,
        }
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    /// The time the network has been advanced to.
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Flows in progress.
    pub fn flow_count(&self) -> usize {
        self.flows.len()
    }

    /// Bytes that have left the origin so far.
    pub fn origin_bytes(&self) -> f64 {
        self.origin_settled
            + self
                .flows
                .values()
                .filter(|f| f.from_origin)
                .map(|f| f.progress_at(self.now) - f.progress)
                .sum::<f64>()
    }

    /// Starts a flow at `now` (advancing to it first; milestones crossed on the way are
    /// returned with the id).
    pub fn add_flow(
        &mut self,
        now: f64,
        spec: FlowSpec,
    ) -> Result<(FlowId, Vec<Reached>), NetError> {
        if spec.segments.is_empty() {
            return Err(NetError::Invalid("no segments"));
        }
        let ascending = spec.milestones.windows(2).all(|w| w[0] < w[1]);
        if spec.milestones.is_empty()
            || !ascending
            || !spec.milestones.iter().all(|m| m.is_finite() && *m > 0.0)
        {
            return Err(NetError::Invalid(
                "milestones must be ascending, finite and positive",
            ));
        }
        let mut links: BTreeMap<usize, u32> = BTreeMap::new();
        let mut cap = spec.cap_bps.unwrap_or(f64::INFINITY);
        let from_origin = spec
            .segments
            .iter()
            .any(|(from, _)| *from == Endpoint::Origin);
        for &(from, to) in &spec.segments {
            for l in self.topo.path(from, to)? {
                *links.entry(l).or_default() += 1;
            }
            if from == Endpoint::Origin
                && let Some(s) = self.topo.origin_stream_bps
            {
                cap = cap.min(s);
            }
        }
        // NaN is refused too.
        if cap.is_nan() || cap <= 0.0 {
            return Err(NetError::Invalid("the rate cap must be positive"));
        }
        let reached = self.advance(now);
        let id = FlowId(self.next_id);
        self.next_id += 1;
        self.flows.insert(
            id,
            Flow {
                links: links.into_iter().collect(),
                cap,
                milestones: spec.milestones,
                next: 0,
                progress: 0.0,
                since: self.now,
                rate: 0.0,
                from_origin,
            },
        );
        self.recompute();
        Ok((id, reached))
    }

    /// Ends a flow at `now` (advancing to it first); its progress then, or `None` if it is
    /// not in progress.
    pub fn remove_flow(&mut self, now: f64, id: FlowId) -> (Option<f64>, Vec<Reached>) {
        let reached = self.advance(now);
        let gone = self.flows.remove(&id).map(|f| {
            let p = f.progress_at(self.now);
            if f.from_origin {
                self.origin_settled += p - f.progress;
            }
            p
        });
        if gone.is_some() {
            self.recompute();
        }
        (gone, reached)
    }

    /// A flow's progress (bytes past its first segment), if in progress.
    pub fn progress(&self, id: FlowId) -> Option<f64> {
        self.flows.get(&id).map(|f| f.progress_at(self.now))
    }

    /// A flow's current rate, bytes/s, if in progress.
    pub fn rate(&self, id: FlowId) -> Option<f64> {
        self.flows.get(&id).map(|f| f.rate)
    }

    /// Every flow's current rate, by id.
    pub fn rates(&self) -> Vec<(FlowId, f64)> {
        self.flows.iter().map(|(id, f)| (*id, f.rate)).collect()
    }

    /// When the next milestone will be crossed at the current rates (`None`: no flow is
    /// moving).
    pub fn next_event(&self) -> Option<f64> {
        self.next_at
    }

    /// Moves every flow forward to `now`, event by event (a flow that ends frees its
    /// bandwidth at that instant), and returns the milestones crossed, in time order. A
    /// `now` before the network's time changes nothing. Between events this is O(1).
    pub fn advance(&mut self, now: f64) -> Vec<Reached> {
        let mut out = Vec::new();
        while let Some(at) = self.next_at.filter(|t| *t <= now) {
            self.now = self.now.max(at);
            self.settle();
            // Milestones reached at `at` (several flows may reach one at once).
            let mut ended = Vec::new();
            for (id, f) in &mut self.flows {
                while let Some(&m) = f.milestones.get(f.next) {
                    if !f.crossed(m, at) {
                        break;
                    }
                    let last = f.next + 1 == f.milestones.len();
                    out.push(Reached {
                        flow: *id,
                        milestone: f.next,
                        at,
                        ended: last,
                    });
                    f.next += 1;
                    if last {
                        ended.push(*id);
                    }
                }
            }
            for id in &ended {
                self.flows.remove(id);
            }
            if ended.is_empty() {
                self.refresh_next();
            } else {
                self.recompute();
            }
        }
        self.now = self.now.max(now);
        out
    }

    /// Brings every flow's progress (and the origin's byte count) to `self.now`.
    fn settle(&mut self) {
        let now = self.now;
        for f in self.flows.values_mut() {
            let p = f.progress_at(now);
            if f.from_origin {
                self.origin_settled += p - f.progress;
            }
            f.progress = p;
            f.since = now;
        }
    }

    fn refresh_next(&mut self) {
        let t = self
            .flows
            .values()
            .map(Flow::next_at)
            .fold(f64::INFINITY, f64::min);
        self.next_at = t.is_finite().then_some(t);
    }

    /// Max-min fair rates by progressive filling.
    fn recompute(&mut self) {
        self.settle();
        self.compute_rates();
        self.refresh_next();
    }

    fn compute_rates(&mut self) {
        let mut residual = self.caps.clone();
        let mut weight = vec![0u64; self.caps.len()];
        let mut active: Vec<FlowId> = Vec::with_capacity(self.flows.len());
        for (id, f) in &mut self.flows {
            f.rate = 0.0;
            for &(l, m) in &f.links {
                weight[l] += u64::from(m);
            }
            active.push(*id);
        }
        // Links some active flow crosses (the others cannot bound anything).
        let mut used: Vec<usize> = (0..weight.len()).filter(|&l| weight[l] > 0).collect();
        while !active.is_empty() {
            let mut inc = f64::INFINITY;
            for &l in &used {
                if weight[l] > 0 && residual[l].is_finite() {
                    inc = inc.min(residual[l] / weight[l] as f64);
                }
            }
            for id in &active {
                let f = &self.flows[id];
                inc = inc.min(f.cap - f.rate);
            }
            if !inc.is_finite() {
                // Unbounded (no finite link or cap): cannot happen with finite host links;
                // leave the rest at what they have rather than loop.
                break;
            }
            let inc = inc.max(0.0);
            for id in &active {
                if let Some(f) = self.flows.get_mut(id) {
                    f.rate += inc;
                    for &(l, m) in &f.links {
                        residual[l] -= inc * f64::from(m);
                    }
                }
            }
            let full = |l: usize, residual: &[f64], caps: &[f64]| {
                caps[l].is_finite() && residual[l] <= caps[l] * FULL_EPS
            };
            let mut still = Vec::with_capacity(active.len());
            for id in active {
                let f = &self.flows[&id];
                let capped = f.rate >= f.cap * (1.0 - FULL_EPS);
                let blocked = f.links.iter().any(|&(l, _)| full(l, &residual, &self.caps));
                if capped || blocked {
                    for &(l, m) in &f.links {
                        weight[l] -= u64::from(m);
                    }
                } else {
                    still.push(id);
                }
            }
            active = still;
            used.retain(|&l| weight[l] > 0);
        }
    }
}

#[cfg(test)]
#[path = "net_tests.rs"]
mod tests;
