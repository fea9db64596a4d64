//! Steps 2 and 3: sources and chains for the receivers that need the model.
//!
//! **Sources** are hierarchical (thesis §5.2.2, Fig. 5.2): a receiver's own memory tier makes
//! it `Local` (it never gets here); otherwise a peer's memory tier, then a peer's disk tier,
//! then the origin. A source is an up host holding a complete copy that is neither a receiver
//! of this plan nor still receiving the model (a `Joined` host has no complete copy yet).
//! Sources are ranked memory before disk; within a tier, racks with the most receivers first,
//! and spread over racks: each rack first gets at most as many sources as it has receivers,
//! then the remaining slots go round robin over racks.
//!
//! **Split plan.** `n` receivers, `m` sources, `L` = max hops per chain:
//! * `m == 0`: `ceil(n / L)` chains from the origin (one chain when `n <= L`, so the origin
//!   is read once);
//! * otherwise `c = max(min(m, n), ceil(n / L))` chains headed by the `c` best sources (round
//!   robin when `c > m`, each such source's uplink then shared by the chains it heads).
//!
//! Chain sizes differ by at most one. Receivers are sorted by (rack, id); each chain first
//! takes receivers from its source's rack, the rest fill the chains in (rack, id) order, so
//! consecutive hops share a rack wherever the numbers allow.
//!
//! **Striped plan.** When striping is allowed, the model has at least two shards, there are
//! at least two sources and `n <= L`: `s` chains (2 <= s <= min(m, shards, 16)), one per
//! source, each carrying a byte-balanced subset of the shards (greedy, largest shard first)
//! through ALL receivers, the hop order rotated per chain so no receiver is last in every
//! chain. Every receiver then takes part in `s` chains, so each chain gets `1/s` of its NIC;
//! striping wins when sources are slower than the receivers (disk sources, slower NICs), as no
//! single uplink carries the whole model. Of the split plan and the striped plans (one per
//! `s`), the one with the lowest estimate is used; ties go to the split plan.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

use crate::estimate::estimate_chain_s;
use crate::view::{ClusterView, nic_bps};
use crate::{ChainPlan, HostInfo, ModelSpec, PlanParams, Source, Tier};

/// Most stripes in a striped plan. Each receiver holds one inbound and one outbound
/// connection per stripe and gets `1/s` of its NIC per stripe; past the point where
/// `s * source rate` exceeds the receivers' NICs more stripes only add chain fill and
/// connections, and 16 is well past it for any source slower than 1/16 of a receiver.
const MAX_STRIPES: usize = 16;

/// Only chain building for given receivers needing data (steps 2 and 3).
///
/// `new_receivers` are the hosts to send the model to (duplicates are ignored; an id not in
/// `cluster` is still served, with an unknown rack and the default NIC rate). `tier` is the
/// tier they store into; sourcing does not depend on it today. Hosts whose
/// [`Held::receiving`](crate::Held::receiving) is set are not sources. A `max_chain_len` of 0
/// is treated as 1 and zero rates as 1 byte/s ([`crate::plan`] rejects both).
pub fn plan_chains(
    cluster: &[HostInfo],
    model: &ModelSpec,
    tier: Tier,
    new_receivers: &[String],
    params: &PlanParams,
) -> Vec<ChainPlan> {
    // The receiving tier does not change sourcing or rates today (there is no disk write
    // rate in the model); the parameter keeps the signature stable for when it does.
    let _ = tier;
    let view = ClusterView::new(cluster, &model.key, &[]);
    let ids: Vec<&str> = new_receivers.iter().map(String::as_str).collect();
    build(&view, model, &ids, params)
}

/// A receiver that needs data.
#[derive(Debug, Clone, Copy)]
struct Rx<'a> {
    id: &'a str,
    rack: Option<&'a str>,
    nic: u64,
}

/// A candidate source.
#[derive(Debug, Clone, Copy)]
struct Src<'a> {
    id: &'a str,
    rack: Option<&'a str>,
    tier: Tier,
    /// Read-and-send rate: NIC, or min(NIC, disk read) for a disk copy.
    bps: u64,
}

impl Src<'_> {
    fn source(&self) -> Source {
        Source::Peer {
            host: self.id.to_owned(),
            tier: self.tier,
        }
    }
}

/// A candidate plan: its chains and its estimate.
struct Candidate {
    chains: Vec<ChainPlan>,
    estimate_s: f64,
}

impl Candidate {
    fn new(chains: Vec<ChainPlan>) -> Self {
        let estimate_s = chains.iter().map(|c| c.estimate_s).fold(0.0, f64::max);
        Self { chains, estimate_s }
    }
}

pub(crate) fn build(
    view: &ClusterView<'_>,
    model: &ModelSpec,
    new: &[&str],
    params: &PlanParams,
) -> Vec<ChainPlan> {
    let mut seen = HashSet::with_capacity(new.len());
    let mut rx: Vec<Rx<'_>> = Vec::with_capacity(new.len());
    for &id in new {
        if !seen.insert(id) {
            continue;
        }
        let host = view.get(id);
        rx.push(Rx {
            id,
            rack: host.and_then(|h| h.rack),
            nic: nic_bps(host.map(|h| h.info), params),
        });
    }
    if rx.is_empty() {
        return Vec::new();
    }
    // (rack, id), unknown racks last.
    rx.sort_by(|a, b| (a.rack.is_none(), a.rack, a.id).cmp(&(b.rack.is_none(), b.rack, b.id)));

    let disk_bps = params.disk_read_bps.max(1);
    let srcs: Vec<Src<'_>> = view
        .hosts
        .iter()
        .filter(|h| !seen.contains(h.info.id.as_str()))
        .filter_map(|h| {
            let tier = h.source_tier()?;
            let nic = nic_bps(Some(h.info), params);
            Some(Src {
                id: h.info.id.as_str(),
                rack: h.rack,
                tier,
                bps: if tier == Tier::Disk {
                    nic.min(disk_bps)
                } else {
                    nic
                },
            })
        })
        .collect();

    let mut demand: HashMap<&str, usize> = HashMap::new();
    for r in &rx {
        if let Some(rack) = r.rack {
            *demand.entry(rack).or_insert(0) += 1;
        }
    }

    let max_len = params.max_chain_len.max(1);
    let shard_count = model.shard_bytes.len();
    let mut best = split_plan(&rx, srcs.clone(), &demand, model, params);
    if params.stripe && shard_count >= 2 && srcs.len() >= 2 && rx.len() <= max_len {
        let limit = srcs.len().min(shard_count).min(MAX_STRIPES);
        let ordered = order_sources(srcs, &demand, limit);
        for s in 2..=ordered.len() {
            let striped = stripe_plan(&rx, ordered.get(..s).unwrap_or(&[]), model);
            if striped.estimate_s < best.estimate_s {
                best = striped;
            }
        }
    }
    best.chains
}

fn tier_rank(t: Tier) -> u8 {
    match t {
        Tier::Memory => 0,
        Tier::Disk => 1,
        Tier::Gpu => 2,
    }
}

/// The best `limit` sources, best first: memory before disk; within a tier each rack first
/// gets up to as many sources as it has receivers (racks with most receivers first), then
/// the rest round robin over racks; within a rack the fastest, then by id.
fn order_sources<'a>(
    srcs: Vec<Src<'a>>,
    demand: &HashMap<&str, usize>,
    limit: usize,
) -> Vec<Src<'a>> {
    let d = |s: &Src<'_>| s.rack.and_then(|r| demand.get(r).copied()).unwrap_or(0);
    // Keys computed once per source, not once per comparison.
    let mut keyed: Vec<_> = srcs
        .into_iter()
        .map(|s| {
            (
                (
                    tier_rank(s.tier),
                    Reverse(d(&s)),
                    Reverse(s.bps),
                    s.rack,
                    s.id,
                ),
                s,
            )
        })
        .collect();
    keyed.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let srcs: Vec<Src<'a>> = keyed.into_iter().map(|(_, s)| s).collect();
    let mut out = Vec::with_capacity(limit.min(srcs.len()));
    let mut rest = srcs.as_slice();
    while !rest.is_empty() && out.len() < limit {
        let tier = rest.first().map(|s| s.tier);
        let split = rest
            .iter()
            .position(|s| Some(s.tier) != tier)
            .unwrap_or(rest.len());
        let (group, tail) = rest.split_at(split);
        rest = tail;

        // Buckets by rack in first-appearance order (so most receivers first); a source with
        // an unknown rack is a bucket of its own.
        let mut buckets: Vec<Vec<Src<'a>>> = Vec::new();
        let mut index: HashMap<&str, usize> = HashMap::new();
        for s in group {
            match s.rack.and_then(|r| index.get(r).copied()) {
                Some(b) => {
                    if let Some(bucket) = buckets.get_mut(b) {
                        bucket.push(*s);
                    }
                }
                None => {
                    if let Some(r) = s.rack {
                        index.insert(r, buckets.len());
                    }
                    buckets.push(vec![*s]);
                }
            }
        }
        let bucket_demand: Vec<usize> = buckets.iter().map(|b| b.first().map_or(0, &d)).collect();
        let mut taken = vec![0usize; buckets.len()];
        // Phase 1: in-rack sources for racks with receivers, at most one per receiver.
        // Phase 2: everything else, round robin over racks.
        for phase in 0..2 {
            loop {
                let mut progressed = false;
                for (b, bucket) in buckets.iter().enumerate() {
                    if out.len() >= limit {
                        return out;
                    }
                    let t = taken.get(b).copied().unwrap_or(usize::MAX);
                    let cap = if phase == 0 {
                        bucket_demand.get(b).copied().unwrap_or(0)
                    } else {
                        usize::MAX
                    };
                    if t < cap {
                        if let Some(s) = bucket.get(t) {
                            out.push(*s);
                            if let Some(t) = taken.get_mut(b) {
                                *t += 1;
                            }
                            progressed = true;
                        }
                    }
                }
                if !progressed {
                    break;
                }
            }
        }
    }
    out
}

/// The split plan: receivers divided over chains, every chain carrying the whole model.
fn split_plan(
    rx: &[Rx<'_>],
    srcs: Vec<Src<'_>>,
    demand: &HashMap<&str, usize>,
    model: &ModelSpec,
    params: &PlanParams,
) -> Candidate {
    let n = rx.len();
    let max_len = params.max_chain_len.max(1);
    let min_chains = n.div_ceil(max_len);
    let m = srcs.len();
    // Heads: one per chain; None = origin.
    let heads: Vec<Option<Src<'_>>> = if m == 0 {
        vec![None; min_chains]
    } else {
        let c = m.min(n).max(min_chains);
        let chosen = order_sources(srcs, demand, c);
        let k = chosen.len().max(1);
        (0..c).map(|i| chosen.get(i % k).copied()).collect()
    };
    let c = heads.len();
    if c == 0 {
        return Candidate::new(Vec::new());
    }
    // Chains each source heads (its uplink is shared between them).
    let mut heads_per_source: HashMap<&str, u64> = HashMap::new();
    for s in heads.iter().flatten() {
        *heads_per_source.entry(s.id).or_insert(0) += 1;
    }

    // Capacities: n / c each, one more for the n % c chains whose source racks have the most
    // receivers (ties: earlier chain).
    let head_rack = |i: usize| heads.get(i).copied().flatten().and_then(|s| s.rack);
    let head_demand = |i: usize| {
        head_rack(i)
            .and_then(|r| demand.get(r).copied())
            .unwrap_or(0)
    };
    let mut caps = vec![n / c; c];
    let mut by_demand: Vec<usize> = (0..c).collect();
    by_demand.sort_by_key(|&i| (Reverse(head_demand(i)), i));
    for &i in by_demand.iter().take(n % c) {
        if let Some(cap) = caps.get_mut(i) {
            *cap += 1;
        }
    }

    // Contiguous ranges of each known rack in `rx` (sorted by rack).
    let mut ranges: HashMap<&str, (usize, usize)> = HashMap::new();
    for (i, r) in rx.iter().enumerate() {
        if let Some(rack) = r.rack {
            ranges.entry(rack).or_insert((i, i)).1 = i + 1;
        }
    }
    let mut assigned = vec![false; n];
    let mut hops: Vec<Vec<usize>> = caps.iter().map(|&cap| Vec::with_capacity(cap)).collect();
    // Phase A: each chain takes receivers from its source's rack.
    for (i, chain) in hops.iter_mut().enumerate() {
        let cap = caps.get(i).copied().unwrap_or(0);
        let Some(range) = head_rack(i).and_then(|r| ranges.get_mut(r)) else {
            continue;
        };
        while chain.len() < cap && range.0 < range.1 {
            chain.push(range.0);
            if let Some(a) = assigned.get_mut(range.0) {
                *a = true;
            }
            range.0 += 1;
        }
    }
    // Phase B: the rest, in (rack, id) order, fill chains in order.
    let mut j = 0;
    for (idx, done) in assigned.iter().enumerate() {
        if *done {
            continue;
        }
        while j < c && hops.get(j).map_or(0, Vec::len) >= caps.get(j).copied().unwrap_or(0) {
            j += 1;
        }
        if let Some(chain) = hops.get_mut(j) {
            chain.push(idx);
        }
    }

    let total = model.total_bytes();
    let chains = heads
        .iter()
        .zip(hops)
        .filter(|(_, h)| !h.is_empty())
        .map(|(head, h)| {
            let (source, src_bps) = match head {
                None => (Source::Origin, params.origin_bps.max(1)),
                Some(s) => {
                    let share = heads_per_source.get(s.id).copied().unwrap_or(1).max(1);
                    (s.source(), (s.bps / share).max(1))
                }
            };
            make_chain(
                rx,
                source,
                src_bps,
                &h,
                Vec::new(),
                total,
                model.chunk_size,
                1,
            )
        })
        .collect();
    Candidate::new(chains)
}

/// The striped plan over `srcs` (one chain per source): byte-balanced shard subsets, each
/// through all receivers.
fn stripe_plan(rx: &[Rx<'_>], srcs: &[Src<'_>], model: &ModelSpec) -> Candidate {
    let s = srcs.len();
    let n = rx.len();
    let bins = balance_shards(&model.shard_bytes, s);
    let order: Vec<usize> = (0..n).collect();
    let chains = srcs
        .iter()
        .zip(bins)
        .enumerate()
        .filter(|(_, (_, (shards, _)))| !shards.is_empty())
        .map(|(j, (src, (shards, bytes)))| {
            let mut hops = order.clone();
            if n > 0 {
                hops.rotate_left(j * n / s % n);
            }
            let share = s as u64;
            make_chain(
                rx,
                src.source(),
                src.bps,
                &hops,
                shards,
                bytes,
                model.chunk_size,
                share,
            )
        })
        .collect();
    Candidate::new(chains)
}

/// Greedy largest-first partition of shards into `bins` subsets of about equal bytes.
/// Returns each subset (ascending indices) with its bytes. Ties go to the bin with fewer
/// shards, then the lower index, so no bin is empty while there are at least as many shards.
fn balance_shards(shard_bytes: &[u64], bins: usize) -> Vec<(Vec<u32>, u64)> {
    let mut out: Vec<(Vec<u32>, u64)> = vec![(Vec::new(), 0); bins];
    if bins == 0 {
        return out;
    }
    let mut order: Vec<(u64, u32)> = shard_bytes
        .iter()
        .enumerate()
        .filter_map(|(i, &b)| u32::try_from(i).ok().map(|i| (b, i)))
        .collect();
    order.sort_by_key(|&(b, i)| (Reverse(b), i));
    let mut heap: BinaryHeap<Reverse<(u64, usize, usize)>> =
        (0..bins).map(|b| Reverse((0, 0, b))).collect();
    for (bytes, shard) in order {
        let Some(Reverse((load, count, b))) = heap.pop() else {
            break;
        };
        if let Some(bin) = out.get_mut(b) {
            bin.0.push(shard);
            bin.1 = bin.1.saturating_add(bytes);
        }
        heap.push(Reverse((load.saturating_add(bytes), count + 1, b)));
    }
    for bin in &mut out {
        bin.0.sort_unstable();
    }
    out
}

/// One chain over receivers `hops` (indices into `rx`), each hop's NIC divided by
/// `nic_share` (the number of chains it takes part in).
#[allow(clippy::too_many_arguments)]
fn make_chain(
    rx: &[Rx<'_>],
    source: Source,
    src_bps: u64,
    hops: &[usize],
    shards: Vec<u32>,
    bytes: u64,
    chunk_size: u64,
    nic_share: u64,
) -> ChainPlan {
    let share = nic_share.max(1);
    let members: Vec<&Rx<'_>> = hops.iter().filter_map(|&i| rx.get(i)).collect();
    let nics: Vec<u64> = members.iter().map(|r| (r.nic / share).max(1)).collect();
    ChainPlan {
        source,
        hops: members.iter().map(|r| r.id.to_owned()).collect(),
        shards,
        bytes,
        estimate_s: estimate_chain_s(bytes, src_bps, &nics, chunk_size),
    }
}

#[cfg(test)]
mod tests {
    use super::balance_shards;

    #[test]
    fn balance_is_largest_first_and_complete() {
        let bins = balance_shards(&[5, 9, 2, 7, 3], 2);
        // 9 -> b0, 7 -> b1, 5 -> b1 (7 < 9), 3 -> b0 (9 < 12), 2 -> b0 (12 = 12 and two shards
        // each: the lower index).
        assert_eq!(bins, vec![(vec![1, 2, 4], 14), (vec![0, 3], 12)]);
    }

    #[test]
    fn balance_never_leaves_a_bin_empty() {
        let bins = balance_shards(&[0, 0, 0, 0], 3);
        assert!(bins.iter().all(|(s, _)| !s.is_empty()));
        let mut all: Vec<u32> = bins.into_iter().flat_map(|(s, _)| s).collect();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3]);
    }
}
