//! Property tests over small random clusters: plan invariants, reservation, no panics.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use shardcast_placement::{
    Held, HostInfo, ModelSpec, Plan, PlanError, PlanParams, PlanRequest, ReceiverKind, Source,
    Target, Tier, plan, plan_chains, reserve,
};

const KEY: &str = "m0";

fn arb_host() -> impl Strategy<Value = HostInfo> {
    (
        (
            0usize..4,
            prop::bool::weighted(0.9),
            prop::sample::select(vec![0u64, 1, 100, 10_000]),
        ),
        (0u64..4000, 0u64..4000, 0u32..4, 0u32..5),
        (
            prop::bool::weighted(0.25),
            prop::bool::weighted(0.25),
            prop::bool::weighted(0.1),
        ),
        prop::bool::weighted(0.3),
    )
        .prop_map(
            |((rack, up, nic), (mem, disk, gpus, free), (hm, hd, recv), other)| {
                let mut holdings = HashMap::new();
                if hm || hd || recv {
                    holdings.insert(
                        KEY.to_owned(),
                        Held {
                            memory: hm,
                            disk: hd,
                            receiving: recv,
                        },
                    );
                }
                if other {
                    holdings.insert("other".to_owned(), Held::default());
                }
                HostInfo {
                    id: String::new(),
                    rack: ["", "r1", "r2", "r3"][rack].to_owned(),
                    zone: String::new(),
                    up,
                    nic_bps: nic,
                    mem_capacity: 6000,
                    mem_free: mem,
                    disk_capacity: 6000,
                    disk_free: disk,
                    gpus,
                    gpus_free: free.min(gpus),
                    holdings,
                }
            },
        )
}

fn arb_cluster() -> impl Strategy<Value = Vec<HostInfo>> {
    prop::collection::vec(arb_host(), 0..14).prop_map(|mut hs| {
        for (i, h) in hs.iter_mut().enumerate() {
            h.id = format!("h{i:02}");
        }
        hs
    })
}

fn arb_model() -> impl Strategy<Value = ModelSpec> {
    (prop::collection::vec(0u64..400, 1..6), 0u64..300).prop_map(|(shard_bytes, chunk_size)| {
        ModelSpec {
            key: KEY.to_owned(),
            shard_bytes,
            chunk_size,
        }
    })
}

fn arb_tier() -> impl Strategy<Value = Tier> {
    prop::sample::select(vec![Tier::Memory, Tier::Disk, Tier::Gpu])
}

fn arb_params() -> impl Strategy<Value = PlanParams> {
    (1usize..6, any::<bool>(), 1u64..200, 1u64..200, 1u64..200).prop_map(
        |(max_chain_len, stripe, origin_bps, default_nic_bps, disk_read_bps)| PlanParams {
            max_chain_len,
            origin_bps,
            default_nic_bps,
            disk_read_bps,
            stripe,
        },
    )
}

/// Host names drawn from the cluster's id space plus one unknown name.
fn arb_names() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(0usize..13, 0..6).prop_map(|v| {
        v.into_iter()
            .map(|i| {
                if i == 12 {
                    "ghost".to_owned()
                } else {
                    format!("h{i:02}")
                }
            })
            .collect()
    })
}

fn arb_target() -> impl Strategy<Value = Target> {
    prop_oneof![
        3 => (0u32..10).prop_map(Target::Replicas),
        1 => arb_names().prop_map(|mut v| {
            // Mostly distinct names; duplicates are tested elsewhere but allowed here too.
            if v.len() % 3 != 0 {
                let mut seen = HashSet::new();
                v.retain(|h| seen.insert(h.clone()));
            }
            Target::Hosts(v)
        }),
    ]
}

fn holds(h: &HostInfo, tier: Tier) -> bool {
    h.holdings.get(KEY).is_some_and(|x| match tier {
        Tier::Memory | Tier::Gpu => x.memory,
        Tier::Disk => x.disk,
    })
}

fn check_plan(
    cluster: &[HostInfo],
    model: &ModelSpec,
    target: &Target,
    tier: Tier,
    in_flight: &[String],
    params: &PlanParams,
    p: &Plan,
) -> Result<(), TestCaseError> {
    let by_id: HashMap<&str, &HostInfo> = cluster.iter().map(|h| (h.id.as_str(), h)).collect();
    let total = model.total_bytes();
    let shards = model.shard_bytes.len() as u32;

    // Receivers: distinct, known, up, kinds consistent.
    let mut kinds: HashMap<&str, ReceiverKind> = HashMap::new();
    for r in &p.receivers {
        prop_assert!(
            kinds.insert(r.host.as_str(), r.kind).is_none(),
            "dup receiver"
        );
        let h = by_id.get(r.host.as_str()).copied();
        prop_assert!(h.is_some_and(|h| h.up), "receiver unknown or down");
        let h = h.unwrap();
        let joined = in_flight.contains(&h.id) || h.holdings.get(KEY).is_some_and(|x| x.receiving);
        match r.kind {
            ReceiverKind::Local => prop_assert!(holds(h, tier)),
            ReceiverKind::Joined => prop_assert!(!holds(h, tier) && joined),
            ReceiverKind::New => {
                prop_assert!(!holds(h, tier) && !joined);
                let free = if tier == Tier::Disk {
                    h.disk_free
                } else {
                    h.mem_free
                };
                prop_assert!(free >= total);
            }
        }
        if tier == Tier::Gpu {
            prop_assert!(r.gpus >= 1 && r.gpus <= h.gpus_free);
        } else {
            prop_assert_eq!(r.gpus, 0);
        }
    }
    match target {
        Target::Replicas(k) if tier == Tier::Gpu => {
            let sum: u64 = p.receivers.iter().map(|r| u64::from(r.gpus)).sum();
            prop_assert_eq!(sum, u64::from(*k));
        }
        Target::Replicas(k) => prop_assert_eq!(p.receivers.len(), *k as usize),
        Target::Hosts(list) => {
            let mut a: Vec<&str> = list.iter().map(String::as_str).collect();
            let mut b: Vec<&str> = kinds.keys().copied().collect();
            a.sort_unstable();
            b.sort_unstable();
            prop_assert_eq!(a, b);
        }
    }

    // Chains: length bounds, sources, coverage.
    let mut got: HashMap<(&str, u32), u32> = HashMap::new();
    let mut max_est = 0.0f64;
    for c in &p.chains {
        prop_assert!(!c.hops.is_empty() && c.hops.len() <= params.max_chain_len);
        let distinct: HashSet<&String> = c.hops.iter().collect();
        prop_assert_eq!(distinct.len(), c.hops.len());
        if let Source::Peer { host, tier: st } = &c.source {
            // A source may be a Local receiver (it holds the model), never one that still
            // needs data.
            prop_assert!(
                matches!(kinds.get(host.as_str()), None | Some(ReceiverKind::Local)),
                "source {} receives data",
                host
            );
            prop_assert!(!in_flight.contains(host));
            let h = by_id.get(host.as_str()).copied();
            prop_assert!(h.is_some_and(|h| h.up && holds(h, *st)));
            prop_assert!(h.is_some_and(|h| !h.holdings.get(KEY).is_some_and(|x| x.receiving)));
            prop_assert!(matches!(st, Tier::Memory | Tier::Disk));
        }
        let carried: Vec<u32> = if c.shards.is_empty() {
            prop_assert_eq!(c.bytes, total);
            (0..shards).collect()
        } else {
            let b: u64 = c
                .shards
                .iter()
                .map(|&s| model.shard_bytes[s as usize])
                .sum();
            prop_assert_eq!(c.bytes, b);
            c.shards.clone()
        };
        for h in &c.hops {
            for &s in &carried {
                *got.entry((h.as_str(), s)).or_insert(0) += 1;
            }
        }
        prop_assert!(c.estimate_s.is_finite() && c.estimate_s >= 0.0);
        max_est = max_est.max(c.estimate_s);
    }
    prop_assert_eq!(p.estimate_s, max_est);
    for (&(h, _), _) in got.iter() {
        prop_assert_eq!(
            kinds.get(h).copied(),
            Some(ReceiverKind::New),
            "{} in a chain",
            h
        );
    }
    for (h, k) in &kinds {
        for s in 0..shards {
            let n = got.get(&(*h, s)).copied().unwrap_or(0);
            prop_assert_eq!(n, u32::from(*k == ReceiverKind::New), "{} shard {}", h, s);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn plan_invariants(
        cluster in arb_cluster(),
        model in arb_model(),
        target in arb_target(),
        tier in arb_tier(),
        in_flight in arb_names(),
        params in arb_params(),
    ) {
        let req = PlanRequest { model: &model, target: target.clone(), tier, in_flight: &in_flight };
        match plan(&cluster, &req, &params) {
            Ok(p) => {
                check_plan(&cluster, &model, &target, tier, &in_flight, &params, &p)?;

                // Same plan whatever the inventory order.
                let mut rev = cluster.clone();
                rev.reverse();
                prop_assert_eq!(&plan(&rev, &req, &params).unwrap(), &p);

                // reserve(): saturating decrements of exactly the reserved amounts.
                let mut after = cluster.clone();
                reserve(&mut after, &model, tier, &p);
                let total = model.total_bytes();
                for (b, a) in cluster.iter().zip(&after) {
                    let r = p.receivers.iter().find(|r| r.host == b.id);
                    let gpus = r.map_or(0, |r| r.gpus);
                    prop_assert_eq!(a.gpus_free, b.gpus_free.saturating_sub(gpus));
                    let new = r.is_some_and(|r| r.kind == ReceiverKind::New);
                    let (dm, dd) = match (new, tier) {
                        (false, _) => (0, 0),
                        (true, Tier::Disk) => (0, total),
                        (true, _) => (total, 0),
                    };
                    prop_assert_eq!(a.mem_free, b.mem_free.saturating_sub(dm));
                    prop_assert_eq!(a.disk_free, b.disk_free.saturating_sub(dd));
                    if r.is_some_and(|r| r.kind != ReceiverKind::Local) {
                        prop_assert!(a.holdings[KEY].receiving);
                    }
                }
                // Planning again right away never sends to the same hosts twice.
                let again = PlanRequest { model: &model, target: Target::Replicas(1), tier, in_flight: &[] };
                if let Ok(q) = plan(&after, &again, &params) {
                    for h in q.new_receivers() {
                        prop_assert!(!p.new_receivers().any(|x| x == h));
                    }
                }
            }
            Err(PlanError::NotEnoughCapacity { requested, available, .. }) => {
                prop_assert!(available < requested);
            }
            Err(PlanError::NoLiveHost) => {
                let named = matches!(&target, Target::Hosts(_));
                prop_assert!(cluster.is_empty() || (!named && cluster.iter().all(|h| !h.up)));
            }
            Err(PlanError::UnknownHost(h)) => prop_assert!(!cluster.iter().any(|c| c.id == h)),
            Err(PlanError::HostDown(h)) => {
                prop_assert!(cluster.iter().any(|c| c.id == h && !c.up));
            }
            Err(PlanError::InvalidRequest(_)) => {
                let dup = match &target {
                    Target::Hosts(l) => l.is_empty() || l.iter().collect::<HashSet<_>>().len() < l.len(),
                    Target::Replicas(k) => *k == 0,
                };
                prop_assert!(dup);
            }
        }
    }

    /// Slow disk sources and fast receivers: the striped path, under the same invariants.
    #[test]
    fn striped_plan_invariants(
        mut cluster in arb_cluster(),
        mut model in arb_model(),
        k in 1u32..8,
        max_chain_len in 1usize..8,
    ) {
        for (i, h) in cluster.iter_mut().enumerate() {
            h.up = true;
            h.mem_free = 4000;
            h.nic_bps = 1000;
            h.holdings.clear();
            if i < 3 {
                h.holdings.insert(KEY.to_owned(), Held { memory: false, disk: true, receiving: false });
            }
        }
        // No chain fill: with two non-empty shards on two slow sources striping is then
        // strictly faster than any split plan.
        model.chunk_size = 0;
        let params = PlanParams { max_chain_len, disk_read_bps: 10, ..PlanParams::default() };
        let target = Target::Replicas(k);
        let req = PlanRequest { model: &model, target: target.clone(), tier: Tier::Memory, in_flight: &[] };
        if let Ok(p) = plan(&cluster, &req, &params) {
            check_plan(&cluster, &model, &target, Tier::Memory, &[], &params, &p)?;
            let striped = p.chains.iter().any(|c| !c.shards.is_empty());
            let n = p.new_receivers().count();
            let nonzero = model.shard_bytes.iter().filter(|&&b| b > 0).count();
            if cluster.len() >= 3 + k as usize && n <= max_chain_len && nonzero >= 2 {
                prop_assert!(striped, "{:#?}", p);
            }
            if striped {
                // Every stripe goes through all receivers, and not all end at the same hop.
                prop_assert!(p.chains.iter().all(|c| c.hops.len() == n));
                let lasts: HashSet<&String> = p.chains.iter().filter_map(|c| c.hops.last()).collect();
                prop_assert!(n == 1 || lasts.len() > 1);
            }
        }
    }

    #[test]
    fn plan_chains_never_panics_and_covers(
        cluster in arb_cluster(),
        model in arb_model(),
        tier in arb_tier(),
        names in arb_names(),
        params in arb_params(),
        zero_len in any::<bool>(),
    ) {
        let params = PlanParams { max_chain_len: if zero_len { 0 } else { params.max_chain_len }, ..params };
        let chains = plan_chains(&cluster, &model, tier, &names, &params);
        let want: HashSet<&str> = names.iter().map(String::as_str).collect();
        let mut got: HashMap<(&str, u32), u32> = HashMap::new();
        for c in &chains {
            prop_assert!(c.hops.len() <= params.max_chain_len.max(1));
            if let Source::Peer { host, .. } = &c.source {
                prop_assert!(!want.contains(host.as_str()));
            }
            let carried: Vec<u32> = if c.shards.is_empty() {
                (0..model.shard_bytes.len() as u32).collect()
            } else {
                c.shards.clone()
            };
            for h in &c.hops {
                for &s in &carried {
                    *got.entry((h.as_str(), s)).or_insert(0) += 1;
                }
            }
        }
        for h in &want {
            for s in 0..model.shard_bytes.len() as u32 {
                prop_assert_eq!(got.get(&(*h, s)).copied().unwrap_or(0), 1);
            }
        }
    }

    #[test]
    fn reserve_never_panics(
        cluster in arb_cluster(),
        model in arb_model(),
        tier in arb_tier(),
        names in arb_names(),
        gpus in prop::collection::vec(any::<u32>(), 0..6),
    ) {
        let p = Plan {
            receivers: names.iter().zip(gpus.iter().chain(std::iter::repeat(&u32::MAX)))
                .enumerate()
                .map(|(i, (h, &g))| shardcast_placement::Receiver {
                    host: h.clone(),
                    gpus: g,
                    kind: [ReceiverKind::Local, ReceiverKind::Joined, ReceiverKind::New][i % 3],
                })
                .collect(),
            chains: vec![],
            estimate_s: 0.0,
        };
        let mut after = cluster.clone();
        reserve(&mut after, &model, tier, &p);
        for (b, a) in cluster.iter().zip(&after) {
            prop_assert!(a.gpus_free <= b.gpus_free);
            prop_assert!(a.mem_free <= b.mem_free && a.disk_free <= b.disk_free);
        }
    }
}
