//! Step 1: which hosts (and, for `Gpu`, how many GPU slots on each) receive the model.
//!
//! * `Memory` / `Disk`: a replica is a host holding a complete copy in that tier. Hosts that
//!   already hold it come first ([`ReceiverKind::Local`], by id), then hosts already
//!   receiving it in a plan in flight ([`ReceiverKind::Joined`], by id), then new hosts with
//!   enough free bytes in the tier ([`ReceiverKind::New`]).
//! * `Gpu`: a replica is one GPU slot; the model must be in the host's memory tier. This is
//!   the thesis' Pareto-optimal greedy placement (§5.2.3), implementing the prose rather than
//!   Listing 5.1 (see the crate docs for the listing's bugs):
//!   1. every free GPU on hosts that hold the model in memory (`Local`) or are receiving it
//!      (`Joined`): the fastest cold starts, and no bytes move;
//!   2. ONE GPU on each new host, so the next burst finds the model on more hosts;
//!   3. only if still short, more GPUs on the new hosts already chosen, round robin.
//!
//! New hosts are ranked: hosts that are not themselves sources first (see below), then racks
//! that contain a memory holder, then racks with a disk holder (in-rack sourcing is cheaper),
//! then the rest; within a rank, most free bytes in the receiving tier (memory for `Gpu`),
//! then id. A new host needs free bytes >= the model's
//! total in the receiving tier and, for `Gpu`, a free GPU; hosts failing that are *full*.
//! If the request cannot be met in full, nothing is chosen and the error says how many hosts
//! were down or full.
//!
//! A host that holds only a disk copy is `New` for a `Memory`/`Gpu` request (and a memory-only
//! holder for a `Disk` request): it is sent the model like any other new host and is not a
//! source while it receives. Choosing it would take a source away (with a single disk holder,
//! a peer transfer would become an origin read), so such hosts are ranked after every host
//! that holds nothing — a refinement of the brief's order (racks, free memory, id). Loading
//! a host's own disk copy into its memory tier is not modelled as a chain.

use std::cmp::Reverse;
use std::collections::{HashMap, HashSet};

use crate::view::{ClusterView, HostView};
use crate::{HostInfo, PlanError, PlanRequest, Receiver, ReceiverKind, Target, Tier};

/// Only the receiver choice (step 1), exposed for tests and the simulator.
///
/// Errors: [`PlanError::InvalidRequest`] for zero replicas, an empty or duplicate host list
/// or a model without shards; [`PlanError::NoLiveHost`] when no host is up (or the cluster is
/// empty); [`PlanError::UnknownHost`] / [`PlanError::HostDown`] for a named host;
/// [`PlanError::NotEnoughCapacity`] when the replicas cannot all be placed.
pub fn choose_receivers(
    cluster: &[HostInfo],
    req: &PlanRequest<'_>,
) -> Result<Vec<Receiver>, PlanError> {
    crate::validate_model(req.model)?;
    let view = ClusterView::new(cluster, &req.model.key, req.in_flight);
    choose(&view, req)
}

pub(crate) fn choose(
    view: &ClusterView<'_>,
    req: &PlanRequest<'_>,
) -> Result<Vec<Receiver>, PlanError> {
    match &req.target {
        Target::Replicas(0) => Err(PlanError::InvalidRequest(
            "replicas must be at least 1".to_owned(),
        )),
        Target::Replicas(k) => {
            if view.live() == 0 {
                return Err(PlanError::NoLiveHost);
            }
            let ctx = Ctx::new(view, req);
            match req.tier {
                Tier::Memory | Tier::Disk => ctx.host_replicas(*k),
                Tier::Gpu => ctx.gpu_replicas(*k),
            }
        }
        Target::Hosts(list) => {
            if list.is_empty() {
                return Err(PlanError::InvalidRequest(
                    "the host list is empty".to_owned(),
                ));
            }
            let mut seen = HashSet::with_capacity(list.len());
            if let Some(dup) = list.iter().find(|h| !seen.insert(h.as_str())) {
                return Err(PlanError::InvalidRequest(format!(
                    "host `{dup}` is listed more than once"
                )));
            }
            if view.hosts.is_empty() {
                return Err(PlanError::NoLiveHost);
            }
            Ctx::new(view, req).named(list)
        }
    }
}

/// Everything one choice needs.
struct Ctx<'v, 'a> {
    view: &'v ClusterView<'a>,
    tier: Tier,
    total: u64,
}

impl<'v, 'a> Ctx<'v, 'a> {
    fn new(view: &'v ClusterView<'a>, req: &PlanRequest<'_>) -> Self {
        Self {
            view,
            tier: req.tier,
            total: req.model.total_bytes(),
        }
    }

    /// Free bytes in the tier the model is received into.
    fn free_bytes(&self, h: &HostView<'_>) -> u64 {
        match self.tier {
            Tier::Memory | Tier::Gpu => h.info.mem_free,
            Tier::Disk => h.info.disk_free,
        }
    }

    /// Whether a host that does not hold the model can take a new replica.
    fn fits(&self, h: &HostView<'_>) -> bool {
        self.free_bytes(h) >= self.total && (self.tier != Tier::Gpu || h.info.gpus_free >= 1)
    }

    /// Holds the model in the needed tier, or is receiving it: no bytes to send.
    fn has_or_gets(&self, h: &HostView<'_>) -> bool {
        h.holds(self.tier) || h.joined
    }

    fn kind(&self, h: &HostView<'_>) -> ReceiverKind {
        if h.holds(self.tier) {
            ReceiverKind::Local
        } else if h.joined {
            ReceiverKind::Joined
        } else {
            ReceiverKind::New
        }
    }

    fn need(&self) -> String {
        match self.tier {
            Tier::Memory => format!("need {} bytes of free memory", self.total),
            Tier::Disk => format!("need {} bytes of free disk", self.total),
            Tier::Gpu => format!("need {} bytes of free memory and a free GPU", self.total),
        }
    }

    /// Up hosts that would be new receivers and can take the model.
    fn new_candidates(&self) -> Vec<&'v HostView<'a>> {
        self.view
            .hosts
            .iter()
            .filter(|h| h.info.up && !self.has_or_gets(h) && self.fits(h))
            .collect()
    }

    /// The best `n` new hosts, best first: hosts that are not sources, then racks with a
    /// memory holder, racks with a disk holder, the rest; most free bytes; id.
    fn pick_new(&self, cands: Vec<&'v HostView<'a>>, n: usize) -> Vec<&'v HostView<'a>> {
        if n == 0 {
            return Vec::new();
        }
        // Racks holding the model: 0 = a memory copy, 1 = only disk copies.
        let mut rack_rank: HashMap<&str, u8> = HashMap::new();
        for h in &self.view.hosts {
            if let (Some(rack), Some(t)) = (h.rack, h.source_tier()) {
                let rank = if t == Tier::Memory { 0 } else { 1 };
                let e = rack_rank.entry(rack).or_insert(rank);
                *e = (*e).min(rank);
            }
        }
        // Keys computed once per candidate, not once per comparison.
        let mut keyed: Vec<_> = cands
            .into_iter()
            .map(|h| {
                let rank = h.rack.and_then(|r| rack_rank.get(r).copied()).unwrap_or(2);
                let key = (
                    h.source_tier().is_some(),
                    rank,
                    Reverse(self.free_bytes(h)),
                    h.info.id.as_str(),
                );
                (key, h)
            })
            .collect();
        if n < keyed.len() {
            keyed.select_nth_unstable_by(n - 1, |a, b| a.0.cmp(&b.0));
            keyed.truncate(n);
        }
        keyed.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        keyed.into_iter().map(|(_, h)| h).collect()
    }

    fn shortfall(&self, requested: u32, available: u64) -> PlanError {
        let hosts = &self.view.hosts;
        let down = hosts.iter().filter(|h| !h.info.up).count();
        let full = hosts
            .iter()
            .filter(|h| h.info.up && !self.has_or_gets(h) && !self.fits(h))
            .count();
        let mut detail = format!(
            "{} hosts: {down} down, {full} full ({})",
            hosts.len(),
            self.need()
        );
        if self.tier == Tier::Gpu {
            let busy = hosts
                .iter()
                .filter(|h| h.info.up && self.has_or_gets(h) && h.info.gpus_free == 0)
                .count();
            detail.push_str(&format!(
                ", {busy} holding or receiving the model with no free GPU"
            ));
        }
        PlanError::NotEnoughCapacity {
            requested,
            available: u32::try_from(available).unwrap_or(u32::MAX),
            detail,
        }
    }

    fn receiver(&self, h: &HostView<'_>, gpus: u32) -> Receiver {
        Receiver {
            host: h.info.id.clone(),
            gpus,
            kind: self.kind(h),
        }
    }

    /// `Memory` / `Disk`: `k` hosts.
    fn host_replicas(&self, k: u32) -> Result<Vec<Receiver>, PlanError> {
        let want = usize::try_from(k).unwrap_or(usize::MAX);
        let mut local: Vec<&HostView<'a>> = Vec::new();
        let mut joined: Vec<&HostView<'a>> = Vec::new();
        for h in self.view.hosts.iter().filter(|h| h.info.up) {
            if h.holds(self.tier) {
                local.push(h);
            } else if h.joined {
                joined.push(h);
            }
        }
        let cands = self.new_candidates();
        let available = local.len() + joined.len() + cands.len();
        if available < want {
            return Err(self.shortfall(k, available as u64));
        }
        local.sort_by_key(|h| h.info.id.as_str());
        joined.sort_by_key(|h| h.info.id.as_str());
        let mut out: Vec<Receiver> = local
            .into_iter()
            .chain(joined)
            .take(want)
            .map(|h| self.receiver(h, 0))
            .collect();
        let short = want - out.len();
        out.extend(
            self.pick_new(cands, short)
                .into_iter()
                .map(|h| self.receiver(h, 0)),
        );
        Ok(out)
    }

    /// `Gpu`: `k` GPU slots, Pareto-greedy.
    fn gpu_replicas(&self, k: u32) -> Result<Vec<Receiver>, PlanError> {
        let want = u64::from(k);
        // Stage 1 candidates: holders (memory) and hosts receiving the model, with free GPUs.
        let mut primed: Vec<&HostView<'a>> = self
            .view
            .hosts
            .iter()
            .filter(|h| h.info.up && self.has_or_gets(h) && h.info.gpus_free > 0)
            .collect();
        let cands = self.new_candidates();
        let available: u64 = primed
            .iter()
            .chain(cands.iter())
            .map(|h| u64::from(h.info.gpus_free))
            .sum();
        if available < want {
            return Err(self.shortfall(k, available));
        }

        // Stage 1: every free GPU on primed hosts (Local before Joined, most GPUs, id).
        primed.sort_by_key(|h| (self.kind(h), Reverse(h.info.gpus_free), h.info.id.as_str()));
        let mut out = Vec::new();
        let mut left = want;
        for h in primed {
            if left == 0 {
                break;
            }
            let take = u64::from(h.info.gpus_free).min(left);
            left -= take;
            out.push(self.receiver(h, u32::try_from(take).unwrap_or(u32::MAX)));
        }
        if left == 0 {
            return Ok(out);
        }

        // Stage 2: one GPU on each of the best new hosts.
        let n = usize::try_from(left).unwrap_or(usize::MAX);
        let chosen = self.pick_new(cands, n);
        left -= chosen.len() as u64;
        let first_new = out.len();
        out.extend(chosen.iter().map(|h| self.receiver(h, 1)));

        // Stage 3: the rest round robin over the new hosts' remaining GPUs. `available >= want`
        // guarantees they suffice.
        if left > 0 {
            let spare: Vec<u64> = chosen
                .iter()
                .map(|h| u64::from(h.info.gpus_free.saturating_sub(1)))
                .collect();
            let extra = round_robin(&spare, left);
            for (r, add) in out.iter_mut().skip(first_new).zip(extra) {
                r.gpus = r
                    .gpus
                    .saturating_add(u32::try_from(add).unwrap_or(u32::MAX));
            }
        }
        Ok(out)
    }

    /// `Target::Hosts`: exactly these hosts, one GPU each for `Gpu`.
    fn named(&self, list: &[String]) -> Result<Vec<Receiver>, PlanError> {
        let mut chosen = Vec::with_capacity(list.len());
        for name in list {
            let h = self
                .view
                .get(name)
                .ok_or_else(|| PlanError::UnknownHost(name.clone()))?;
            if !h.info.up {
                return Err(PlanError::HostDown(name.clone()));
            }
            chosen.push(h);
        }
        let mut problems = Vec::new();
        for h in &chosen {
            if self.tier == Tier::Gpu && h.info.gpus_free == 0 {
                problems.push(format!("`{}` has no free GPU", h.info.id));
            } else if !self.has_or_gets(h) && self.free_bytes(h) < self.total {
                problems.push(format!(
                    "`{}` has {} bytes free in the {} tier, needs {}",
                    h.info.id,
                    self.free_bytes(h),
                    if self.tier == Tier::Disk {
                        "disk"
                    } else {
                        "memory"
                    },
                    self.total
                ));
            }
        }
        if !problems.is_empty() {
            return Err(PlanError::NotEnoughCapacity {
                requested: u32::try_from(list.len()).unwrap_or(u32::MAX),
                available: u32::try_from(list.len() - problems.len()).unwrap_or(u32::MAX),
                detail: format!("full: {}", problems.join("; ")),
            });
        }
        let gpus = u32::from(self.tier == Tier::Gpu);
        let mut out: Vec<Receiver> = chosen.iter().map(|h| self.receiver(h, gpus)).collect();
        out.sort_by_key(|r| r.kind); // stable: Local, Joined, New, each in the order named
        Ok(out)
    }
}

/// Hands out `n` units over hosts with `spare[i]` free units each, one per host per round in
/// order (round robin), skipping hosts that have run out. Computed in O(hosts · log) rather
/// than unit by unit. Requires `n <= sum(spare)`; hands out what there is otherwise.
fn round_robin(spare: &[u64], n: u64) -> Vec<u64> {
    let given = |rounds: u64| -> u64 { spare.iter().map(|&s| s.min(rounds)).sum() };
    // The largest number of full rounds that does not exceed n.
    let (mut lo, mut hi) = (0u64, spare.iter().copied().max().unwrap_or(0));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if given(mid) <= n {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let mut rest = n.saturating_sub(given(lo));
    spare
        .iter()
        .map(|&s| {
            let mut g = s.min(lo);
            if rest > 0 && s > lo {
                g += 1;
                rest -= 1;
            }
            g
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::round_robin;

    #[test]
    fn round_robin_matches_unit_by_unit() {
        let cases: &[(&[u64], u64)] = &[
            (&[3, 1, 2], 5),
            (&[7, 7, 7], 4),
            (&[0, 5, 1], 6),
            (&[2, 2], 4),
            (&[], 0),
            (&[4], 3),
        ];
        for &(spare, n) in cases {
            let mut want = vec![0u64; spare.len()];
            let mut left = n;
            while left > 0 {
                for (w, &s) in want.iter_mut().zip(spare) {
                    if left > 0 && *w < s {
                        *w += 1;
                        left -= 1;
                    }
                }
            }
            assert_eq!(round_robin(spare, n), want, "spare {spare:?} n {n}");
        }
    }

    #[test]
    fn round_robin_huge_is_fast() {
        let spare = [u64::from(u32::MAX); 3];
        let got = round_robin(&spare, 3 * u64::from(u32::MAX) - 1);
        assert_eq!(got.iter().sum::<u64>(), 3 * u64::from(u32::MAX) - 1);
    }
}
