//! Faults in the simulated datacenter, and the chain's recovery from them, decided by
//! transferd's own rules.
//!
//! A fault ([`super::faults::FaultSpec`]) happens at a virtual time to one host:
//!
//! * **link down** for a while (a hop stalls): every flow through the host stops; it sends
//!   no heartbeat and answers no agent call until its link is back;
//! * **lost** (killed, never back): the same, for good; its GPU loads never finish.
//!
//! A chain is one pipelined flow ([`super::dc`]); a fault splits it where the victim sits.
//! What follows is what a transferd hop does (docs/PROTOCOL.md §9), with its timings:
//!
//! * **The hops above the victim** go on receiving at once: a new flow from the same
//!   source, each receiver keeping the bytes it had ([`super::dc::Copy::partial`]).
//! * **The hops below** hear nothing: after `stall_timeout` (transferd's
//!   [`ChainConfig`] default) the first of them drops its upstream as stalled, and the hop
//!   above the victim, whose downstream answered nothing for as long, fails over to it.
//!   What the first hop below then does is [`RecoveryMonitor::poll`]'s decision on what
//!   it sees — fed again (a failover), or not fed with every holder above it stalled
//!   (fetch at once), or not fed with live holders above (wait `upstream_grace`, then
//!   fetch) — and a fetch reads the first of [`recovery_sources`] (the live holders above,
//!   nearest first, then the origin). The hops below it stay its downstream.
//! * **The victim**, when its link comes back: the hosts above have failed over past it
//!   and it completes its own copy by recovery, from the first of [`recovery_sources`]
//!   over the holders above it that are up — a holder before the origin, as transferd's
//!   `holders_first` makes a cut-off host do once it can reach anyone again; a head that
//!   read the origin (no holder above) pulls from the hop below first, as transferd's
//!   head does once its stalled origin read finds the origin answering again (that hop
//!   read on from the origin meanwhile), and the origin only for the rest. A link that comes back
//!   within the stall timeout was never noticed: the chain below the victim resumes
//!   through it.
//! * **The controller** sees only what it would see: no heartbeats from a host that is
//!   down (its inventory's expiry, then the plan runner's lost grace), agent calls that
//!   fail, receivers whose bytes stop growing (its stall re-plan).
//!
//! A flow that feeds hosts from a hop still being filled (a failover, a pull from a holder
//! above) moves at its own max-min rate, but its receivers complete no earlier than that
//! hop ([`super::dc::Delivery::gate`]): a catch-up at the link rate, then the pace of the
//! hop above. Not modelled: the probe of unreachable holders during the grace (it only
//! shortens a grace when the holder right above is the one that failed, which the
//! failover covers), the handshake of a failover or pull (milliseconds), several chains
//! per shard set (a partial copy is counted for the whole model), a victim that comes
//! back after a kill with an empty store.
//!
//! One feed per host: a host whose copy is already being filled (a recovery under way)
//! is left out of a chain or download the controller starts for it meanwhile (its re-plan
//! of a receiver that was lost or made no progress), and a download joins the fill in
//! progress. transferd claims each chunk once per store, so a chunk is not stored twice;
//! whether two upstreams of one shard ever both send it is not modelled (the simulated
//! bytes are the lower bound).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use shardcast_controller::error::AgentError;
use shardcast_protocol::{Hop, HostId};
use transferd::chain::{
    ChainConfig, RECOVERY_ATTEMPTS, RecoveryAction, RecoveryMonitor, RecoverySource, Watched,
    all_stalled, recovery_sources,
};

use super::coldstart::ORIGIN_PREFIX;
use super::dc::{Dc, host_id};
use super::faults::{EventKind, FaultEvent, FaultKind, FaultSpec, Role, Target};
use super::net::{Endpoint, FlowId};

/// A host that is down.
#[derive(Debug, Clone, Copy)]
struct Down {
    /// When it went down (datacenter clock).
    since: f64,
}

/// A victim's copy left incomplete by its fault, and the chain around it.
#[derive(Debug, Clone)]
struct Stranded {
    fault: usize,
    host: usize,
    digest: String,
    shards: Vec<u32>,
    /// The hosts above it in its chain, nearest first (the source holder last).
    above: Vec<usize>,
    /// The chain's source (the origin, or a holder).
    source: Endpoint,
    /// The hosts below it.
    below: Vec<usize>,
    /// When its fault happened.
    at: f64,
}

/// What happens at an instant.
#[derive(Debug, Clone)]
enum Due {
    /// Fault `i` of the schedule happens.
    Inject(usize),
    /// The hops below a victim notice their upstream is silent.
    Detect(Stranded),
    /// A victim's link comes back.
    Heal { host: usize },
    /// A recovery flow starts (after a grace).
    Start(Start),
}

/// A recovery flow to start.
#[derive(Debug, Clone)]
struct Start {
    fault: usize,
    digest: String,
    shards: Vec<u32>,
    source: Endpoint,
    receivers: Vec<usize>,
}

/// The faults of a run: the schedule, the hosts that are down, and the log.
#[derive(Debug)]
pub(super) struct Faults {
    specs: Vec<FaultSpec>,
    /// The prewarm's instant on the datacenter clock: fault times count from it.
    t0: f64,
    seed: u64,
    dues: Vec<(f64, Due)>,
    down: BTreeMap<usize, Down>,
    lost: HashSet<usize>,
    stranded: Vec<Stranded>,
    /// Hosts a fault touched: (fault, role), the first fault that did.
    pub(super) affected: BTreeMap<usize, (usize, Role)>,
    pub(super) events: Vec<FaultEvent>,
    /// Downloads (`import_model` with fetch) of a victim whose link is down: they resume
    /// with its recovery and answer when that ends (a lost host's are dropped: the call
    /// fails).
    waiting: Vec<(usize, String, Vec<tokio::sync::oneshot::Sender<()>>)>,
    stall: Duration,
    grace: Duration,
    /// The `Instant` the recovery monitor's clock maps the datacenter's 0 to.
    base: Instant,
}

impl Default for Faults {
    fn default() -> Self {
        let chain = ChainConfig::default();
        Self {
            specs: Vec::new(),
            t0: 0.0,
            seed: 0,
            dues: Vec::new(),
            down: BTreeMap::new(),
            lost: HashSet::new(),
            stranded: Vec::new(),
            affected: BTreeMap::new(),
            events: Vec::new(),
            waiting: Vec::new(),
            stall: chain.stall_timeout,
            grace: chain.upstream_grace,
            base: Instant::now(),
        }
    }
}

impl Faults {
    /// The earliest scheduled instant.
    pub(super) fn next_due(&self) -> Option<f64> {
        self.dues.iter().map(|(t, _)| *t).reduce(f64::min)
    }

    /// Host `h` is down now (lost, or its link is).
    pub(super) fn is_down(&self, h: usize) -> bool {
        self.down.contains_key(&h)
    }

    /// Host `h` was lost for good.
    pub(super) fn is_lost(&self, h: usize) -> bool {
        self.lost.contains(&h)
    }

    /// The agent call's error for a host that is down.
    pub(super) fn unreachable(&self, h: usize) -> Option<AgentError> {
        self.is_down(h)
            .then(|| AgentError::unreachable(&host_id(h), "the simulated host is down"))
    }

    fn at(&self, t: f64) -> Instant {
        self.base + Duration::from_secs_f64(t.max(0.0))
    }

    fn take_due(&mut self, t: f64) -> Option<Due> {
        let i = self
            .dues
            .iter()
            .enumerate()
            .filter(|(_, (at, _))| *at <= t)
            .min_by(|a, b| a.1.0.total_cmp(&b.1.0))
            .map(|(i, _)| i)?;
        Some(self.dues.remove(i).1)
    }

    fn log(&mut self, t: f64, fault: usize, host: usize, kind: EventKind, detail: String) {
        self.events.push(FaultEvent {
            t: t - self.t0,
            fault,
            host: host_id(host),
            kind,
            detail,
        });
    }

    fn touch(&mut self, h: usize, fault: usize, role: Role) {
        self.affected.entry(h).or_insert((fault, role));
    }
}

/// A host as a chain hop, for transferd's rules (only the id matters to them).
fn hop(h: usize) -> Option<Hop> {
    Some(Hop {
        host: HostId::new(host_id(h)).ok()?,
        addr: String::new(),
    })
}

impl Dc {
    /// Schedules `specs` to happen at their times after `t0` (the prewarm); `seed` picks
    /// the hosts of `random` targets.
    pub(super) fn schedule_faults(&mut self, t0: f64, specs: &[FaultSpec], seed: u64) {
        self.faults.t0 = t0;
        self.faults.seed = seed;
        for (i, s) in specs.iter().enumerate() {
            self.faults.dues.push((t0 + s.at_s, Due::Inject(i)));
        }
        self.faults.specs = specs.to_vec();
    }

    /// Runs what is due at `t` (the network is synced to `t`).
    pub(super) fn run_fault_due(&mut self, t: f64) {
        while let Some(due) = self.faults.take_due(t) {
            match due {
                Due::Inject(i) => self.inject(t, i),
                Due::Detect(s) => self.detect(t, s),
                Due::Heal { host } => self.heal(t, host),
                Due::Start(s) => self.start_recovery(t, s),
            }
        }
    }

    /// The host fault `i` names, now.
    fn victim(&self, i: usize) -> Option<usize> {
        let spec = self.faults.specs.get(i)?;
        // The chains in flight, oldest first: (source, receivers).
        let mut flows: Vec<(&FlowId, &super::dc::Delivery)> = self.deliveries.iter().collect();
        flows.sort_by_key(|(id, _)| **id);
        let chain_of = |d: &super::dc::Delivery| -> Vec<usize> {
            match d.source {
                Endpoint::Host(s) => std::iter::once(s)
                    .chain(d.receivers.iter().copied())
                    .collect(),
                Endpoint::Origin => d.receivers.clone(),
            }
        };
        match &spec.target {
            Target::Host(id) => self.index.get(id).copied(),
            Target::Random => {
                let mut hosts: Vec<usize> = flows.iter().flat_map(|(_, d)| chain_of(d)).collect();
                hosts.sort_unstable();
                hosts.dedup();
                hosts.retain(|h| !self.faults.is_down(*h));
                if hosts.is_empty() {
                    return None;
                }
                let pick = splitmix(self.faults.seed ^ (i as u64).wrapping_mul(0x9e37)) as usize;
                Some(hosts[pick % hosts.len()])
            }
            pos => {
                // The first chain (two hosts or more), else the first flow.
                let d = flows
                    .iter()
                    .find(|(_, d)| chain_of(d).len() >= 2)
                    .or(flows.first())?
                    .1;
                let chain = chain_of(d);
                let k = match pos {
                    Target::Head => 0,
                    Target::Middle => chain.len() / 2,
                    _ => chain.len().saturating_sub(1),
                };
                chain.get(k).copied()
            }
        }
    }

    fn inject(&mut self, t: f64, i: usize) {
        let Some(spec) = self.faults.specs.get(i).cloned() else {
            return;
        };
        let Some(v) = self.victim(i).filter(|v| !self.faults.is_down(*v)) else {
            self.faults.log(
                t,
                i,
                0,
                EventKind::Skipped,
                format!("no host to fail at {}", spec.target),
            );
            return;
        };
        let until = match spec.kind {
            FaultKind::LinkDown => Some(t + spec.for_s.unwrap_or(0.0)),
            FaultKind::Lost => None,
        };
        self.faults.down.insert(v, Down { since: t });
        if spec.kind == FaultKind::Lost {
            self.faults.lost.insert(v);
        }
        self.faults.touch(v, i, Role::Victim);
        self.faults.log(t, i, v, EventKind::Fault, spec.to_string());
        if let Some(u) = until {
            self.faults.dues.push((u, Due::Heal { host: v }));
        }
        let mut through: Vec<FlowId> = self
            .deliveries
            .iter()
            .filter(|(_, d)| d.receivers.contains(&v) || d.source == Endpoint::Host(v))
            .map(|(id, _)| *id)
            .collect();
        through.sort();
        for flow in through {
            self.split(t, i, flow, v);
        }
        self.hosts[v].changed.send_modify(|x| *x += 1);
    }

    /// Ends `flow` at `t`: each receiver keeps what it got (as a partial copy), and the
    /// bytes count in their tiers. Returns the delivery.
    fn stop_flow(&mut self, t: f64, flow: FlowId) -> Option<super::dc::Delivery> {
        let (p, reached) = self.net.remove_flow(t, flow);
        self.apply(reached);
        let d = self.deliveries.remove(&flow)?;
        let p = p.unwrap_or(0.0);
        for j in d.reached..d.receivers.len() {
            let got = (p - d.lags[j]).clamp(0.0, d.need[j]);
            if j == 0 && d.from_origin {
                self.settled.origin += got;
            } else {
                self.settled.peer += got;
            }
            let r = d.receivers[j];
            if let Some(c) = self.hosts[r].copies.get_mut(&d.digest) {
                c.incoming.retain(|i| i.flow != flow);
                if c.complete_at.is_none() {
                    c.partial += got;
                }
            }
            self.hosts[r].changed.send_modify(|x| *x += 1);
        }
        Some(d)
    }

    fn incomplete(&self, h: usize, digest: &str) -> bool {
        self.hosts[h]
            .copies
            .get(digest)
            .is_none_or(|c| c.complete_at.is_none())
    }

    /// Splits the chain of `flow` at victim `v` (module docs).
    fn split(&mut self, t: f64, fault: usize, flow: FlowId, v: usize) {
        let Some(mut d) = self.stop_flow(t, flow) else {
            return;
        };
        if !d.waiters.is_empty() && d.receivers == [v] && !self.faults.is_lost(v) {
            let waiters = std::mem::take(&mut d.waiters);
            self.faults.waiting.push((v, d.digest.clone(), waiters));
        }
        let chain: Vec<usize> = match d.source {
            Endpoint::Host(s) => std::iter::once(s)
                .chain(d.receivers.iter().copied())
                .collect(),
            Endpoint::Origin => d.receivers.clone(),
        };
        let Some(k) = chain.iter().position(|&h| h == v) else {
            return;
        };
        let upper: Vec<usize> = d
            .receivers
            .iter()
            .copied()
            .filter(|&r| chain[..k].contains(&r) && self.incomplete(r, &d.digest))
            .collect();
        if !upper.is_empty() {
            self.start_flow(t, &d.digest, d.source, upper, d.shards.clone(), d.gate);
        }
        let below: Vec<usize> = chain[k + 1..]
            .iter()
            .copied()
            .filter(|&r| self.incomplete(r, &d.digest))
            .collect();
        for &b in &below {
            self.faults.touch(b, fault, Role::Below);
        }
        let stranded = Stranded {
            fault,
            host: v,
            digest: d.digest.clone(),
            shards: d.shards.clone(),
            above: chain[..k].iter().rev().copied().collect(),
            source: d.source,
            below: below.clone(),
            at: t,
        };
        if !below.is_empty() {
            let when = t + self.faults.stall.as_secs_f64();
            self.faults.dues.push((when, Due::Detect(stranded.clone())));
        }
        if k > 0 || d.source == Endpoint::Origin {
            // The victim was receiving (not the source holder).
            if self.incomplete(v, &d.digest) {
                self.faults.stranded.push(stranded);
            }
        }
    }

    /// Starts a flow (a recovery's or a chain's continuation) whose receivers complete no
    /// earlier than `gate`'s copy, if that is incomplete.
    fn start_flow(
        &mut self,
        t: f64,
        digest: &str,
        source: Endpoint,
        receivers: Vec<usize>,
        shards: Vec<u32>,
        gate: Option<usize>,
    ) -> Option<FlowId> {
        let gate = gate
            .or(match source {
                Endpoint::Host(s) => Some(s),
                Endpoint::Origin => None,
            })
            .filter(|&g| self.incomplete(g, digest));
        let flow = self
            .start_delivery(t, digest, source, receivers, shards)
            .inspect_err(|e| tracing::warn!("a simulated recovery flow did not start: {e}"))
            .ok()?;
        if let Some(d) = self.deliveries.get_mut(&flow) {
            d.gate = gate;
        }
        Some(flow)
    }

    fn origin_uri(&self, digest: &str) -> String {
        self.catalogue
            .get(digest)
            .map(|c| format!("{ORIGIN_PREFIX}{}", c.model.name))
            .unwrap_or_default()
    }

    /// The hops below victim `s.host` noticed it is silent: the first of them decides as
    /// transferd's recovery monitor does.
    fn detect(&mut self, t: f64, s: Stranded) {
        let v = s.host;
        if !self.faults.is_down(v) {
            // Back within the stall timeout: `heal` resumed the chain through it.
            return;
        }
        let below: Vec<usize> = s
            .below
            .iter()
            .copied()
            .filter(|&b| self.incomplete(b, &s.digest) && !self.faults.is_down(b))
            .collect();
        let Some(&first) = below.first() else {
            return;
        };
        // Its holders above, nearest first: the victim, then the victim's holders above.
        let above_first: Vec<usize> = std::iter::once(v).chain(s.above.iter().copied()).collect();
        let up: Vec<Hop> = above_first.iter().filter_map(|&h| hop(h)).collect();
        // Found stalled: the victim (silent for the stall timeout); a holder above that is
        // down too would be found so by the hop below it.
        let stalled: HashSet<HostId> = above_first
            .iter()
            .filter(|&&h| self.faults.is_down(h))
            .filter_map(|&h| hop(h).map(|x| x.host))
            .collect();
        let uri = self.origin_uri(&s.digest);
        let sources = recovery_sources(&up, &stalled, None, &uri);
        // The hop above the victim saw its downstream silent for as long, and fails over
        // to the next host of its list: this one.
        let failover = s
            .above
            .first()
            .copied()
            .filter(|&a| !self.faults.is_down(a));
        let seen = Watched {
            feeders: usize::from(failover.is_some()),
            complete: false,
            failed: false,
            no_failover: all_stalled(&up, &stalled),
            has_source: !sources.is_empty(),
        };
        self.faults.log(
            t,
            s.fault,
            first,
            EventKind::Detected,
            format!(
                "upstream {} silent for the stall timeout ({:?})",
                host_id(v),
                self.faults.stall
            ),
        );
        let mut monitor = RecoveryMonitor::new(self.faults.grace, RECOVERY_ATTEMPTS);
        let mut action = monitor.poll(self.faults.at(t), seen);
        let mut when = t;
        if let RecoveryAction::Wait(Some(deadline)) = action {
            // Nobody fails over within the grace: the monitor fetches when it ends.
            when = t + deadline
                .saturating_duration_since(self.faults.at(t))
                .as_secs_f64();
            action = monitor.poll(deadline, seen);
            self.faults.log(
                when,
                s.fault,
                first,
                EventKind::GraceOver,
                format!(
                    "no failover within the upstream grace ({:?})",
                    self.faults.grace
                ),
            );
        }
        let source = match action {
            RecoveryAction::Wait(_) => match failover {
                Some(a) => {
                    self.faults.log(
                        t,
                        s.fault,
                        first,
                        EventKind::Failover,
                        format!("{} fails over past {} to it", host_id(a), host_id(v)),
                    );
                    Endpoint::Host(a)
                }
                None => return,
            },
            RecoveryAction::Fetch { .. } => match sources.first() {
                Some(src) => self.source_endpoint(src),
                None => return,
            },
            RecoveryAction::NoSource => {
                self.faults.log(
                    when,
                    s.fault,
                    first,
                    EventKind::NoSource,
                    "no holder above and no origin: the session fails".into(),
                );
                return;
            }
            RecoveryAction::Stop => return,
        };
        let start = Start {
            fault: s.fault,
            digest: s.digest,
            shards: s.shards,
            source,
            receivers: below,
        };
        if when > t {
            self.faults.dues.push((when, Due::Start(start)));
        } else {
            self.start_recovery(t, start);
        }
    }

    fn source_endpoint(&self, src: &RecoverySource) -> Endpoint {
        match src {
            RecoverySource::Holder(h) => self
                .index
                .get(h.host.as_str())
                .map_or(Endpoint::Origin, |&i| Endpoint::Host(i)),
            RecoverySource::Origin(_) => Endpoint::Origin,
        }
    }

    fn start_recovery(&mut self, t: f64, s: Start) {
        let receivers: Vec<usize> = s
            .receivers
            .into_iter()
            .filter(|&r| self.incomplete(r, &s.digest) && !self.faults.is_down(r))
            .collect();
        if receivers.is_empty() {
            return;
        }
        if let Endpoint::Host(h) = s.source
            && self.faults.is_down(h)
        {
            return;
        }
        let from = match s.source {
            Endpoint::Origin => "origin".to_string(),
            Endpoint::Host(h) => host_id(h),
        };
        for &r in &receivers {
            self.faults.log(
                t,
                s.fault,
                r,
                EventKind::RecoveryStart,
                format!("fed again from {from}"),
            );
        }
        let digest = s.digest.clone();
        let flow = self.start_flow(t, &s.digest, s.source, receivers.clone(), s.shards, None);
        // A download of a receiver that went down answers when its recovery ends.
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.faults.waiting)
            .into_iter()
            .partition(|(h, d, _)| receivers.contains(h) && *d == digest);
        self.faults.waiting = rest;
        let waiters = mine.into_iter().flat_map(|(_, _, w)| w);
        match flow.and_then(|f| self.deliveries.get_mut(&f)) {
            Some(d) => d.waiters.extend(waiters),
            None => drop(waiters.collect::<Vec<_>>()),
        }
    }

    /// Victim `v`'s link is back.
    fn heal(&mut self, t: f64, v: usize) {
        let Some(down) = self.faults.down.remove(&v) else {
            return;
        };
        let stranded: Vec<Stranded> = {
            let (mine, rest) = std::mem::take(&mut self.faults.stranded)
                .into_iter()
                .partition(|s| s.host == v);
            self.faults.stranded = rest;
            mine
        };
        let fault = stranded.first().map_or_else(
            || self.faults.affected.get(&v).map_or(0, |a| a.0),
            |s| s.fault,
        );
        self.faults.log(
            t,
            fault,
            v,
            EventKind::Heal,
            format!("link back after {:.1} s", t - down.since),
        );
        self.hosts[v].changed.send_modify(|x| *x += 1);
        for s in stranded {
            if !self.incomplete(v, &s.digest) {
                continue;
            }
            let undetected = t < s.at + self.faults.stall.as_secs_f64();
            let (source, receivers) = if undetected {
                // Nobody noticed: the chain resumes through the victim, from the nearest
                // holder above that is up.
                let source = s
                    .above
                    .iter()
                    .copied()
                    .find(|&h| !self.faults.is_down(h))
                    .map_or(s.source, Endpoint::Host);
                (
                    source,
                    std::iter::once(v).chain(s.below.iter().copied()).collect(),
                )
            } else {
                let Some(source) = self.recovery_source(&s) else {
                    continue;
                };
                (source, vec![v])
            };
            self.start_recovery(
                t,
                Start {
                    fault: s.fault,
                    digest: s.digest,
                    shards: s.shards,
                    source,
                    receivers,
                },
            );
        }
    }

    /// Where victim `s.host`, back and noticed as gone, recovers from: the first of
    /// transferd's [`recovery_sources`] over the holders above it that are up.
    fn recovery_source(&self, s: &Stranded) -> Option<Endpoint> {
        let up: Vec<Hop> = s.above.iter().filter_map(|&h| hop(h)).collect();
        let stalled: HashSet<HostId> = s
            .above
            .iter()
            .filter(|&&h| self.faults.is_down(h))
            .filter_map(|&h| hop(h).map(|x| x.host))
            .collect();
        // A head (it read the origin: no holder above) pulls from the hop below first
        // once the origin answers again (transferd's `fill_watching`): that hop read on
        // from the origin meanwhile.
        let below = if s.above.is_empty() {
            s.below
                .first()
                .copied()
                .filter(|&b| !self.faults.is_down(b))
                .and_then(hop)
        } else {
            None
        };
        let uri = self.origin_uri(&s.digest);
        recovery_sources(&up, &stalled, below.as_ref(), &uri)
            .first()
            .map(|src| self.source_endpoint(src))
    }

    /// Host `h`'s copy of `digest` is incomplete and bytes are on their way to it (a flow,
    /// or the hop it is held for).
    pub(super) fn being_filled(&self, h: usize, digest: &str) -> bool {
        self.hosts[h]
            .copies
            .get(digest)
            .is_some_and(|c| c.complete_at.is_none() && !c.incoming.is_empty())
            || self.gate_of(h, digest).is_some()
    }

    /// The controller started a chain from `source` to `receivers` at `t`: a host a fault
    /// touched is fed again from then on (a re-plan).
    pub(super) fn note_chain(
        &mut self,
        t: f64,
        digest: &str,
        receivers: &[usize],
        source: Endpoint,
    ) {
        let from = match source {
            Endpoint::Origin => "the origin".to_string(),
            Endpoint::Host(h) => host_id(h),
        };
        for &r in receivers {
            if let Some(&(fault, _)) = self.faults.affected.get(&r)
                && self.incomplete(r, digest)
            {
                self.faults.log(
                    t,
                    fault,
                    r,
                    EventKind::RecoveryStart,
                    format!("the controller re-planned it: a chain from {from}"),
                );
            }
        }
    }

    /// Host `h`'s copy of `digest` became complete at `at`: a host a fault touched logs
    /// it, and the other flows that fed only it (a recovery beside a controller's re-plan)
    /// stop.
    pub(super) fn copy_completed(&mut self, h: usize, digest: &str, at: f64) {
        if let Some(&(fault, _)) = self.faults.affected.get(&h) {
            self.faults
                .log(at, fault, h, EventKind::Complete, "copy complete".into());
        }
        let extra: Vec<FlowId> = self.hosts[h]
            .copies
            .get(digest)
            .map(|c| c.incoming.iter().map(|i| i.flow).collect())
            .unwrap_or_default();
        for flow in extra {
            if self
                .deliveries
                .get(&flow)
                .is_some_and(|d| d.receivers == [h] && d.waiters.is_empty())
            {
                self.stop_flow(at, flow);
            }
        }
    }
}

/// SplitMix64: a seeded pick without a generator's state.
fn splitmix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
