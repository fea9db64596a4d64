//! Scenario tests for receiver choice, sourcing, chains, striping and reservation.

mod common;

use std::collections::HashMap;

use common::{GIB, KEY, holder, host, model, rack_of};
use shardcast_placement::{
    ChainPlan, HostInfo, ModelSpec, Plan, PlanError, PlanParams, PlanRequest, Receiver,
    ReceiverKind, Source, Target, Tier, choose_receivers, plan, plan_chains, reserve,
};

fn req<'a>(model: &'a ModelSpec, target: Target, tier: Tier) -> PlanRequest<'a> {
    PlanRequest {
        model,
        target,
        tier,
        in_flight: &[],
    }
}

fn hosts(list: &[&str]) -> Target {
    Target::Hosts(list.iter().map(|s| (*s).to_owned()).collect())
}

fn ids(rs: &[Receiver], kind: ReceiverKind) -> Vec<&str> {
    rs.iter()
        .filter(|r| r.kind == kind)
        .map(|r| r.host.as_str())
        .collect()
}

fn peer(c: &ChainPlan) -> Option<(&str, Tier)> {
    match &c.source {
        Source::Peer { host, tier } => Some((host.as_str(), *tier)),
        Source::Origin => None,
    }
}

/// Every New receiver gets every shard exactly once; Local/Joined hosts are in no chain.
fn assert_complete(p: &Plan, m: &ModelSpec) {
    let mut got: HashMap<(&str, u32), usize> = HashMap::new();
    for c in &p.chains {
        let shards: Vec<u32> = if c.shards.is_empty() {
            (0..m.shard_bytes.len() as u32).collect()
        } else {
            c.shards.clone()
        };
        for h in &c.hops {
            for &s in &shards {
                *got.entry((h.as_str(), s)).or_insert(0) += 1;
            }
        }
    }
    for r in &p.receivers {
        for s in 0..m.shard_bytes.len() as u32 {
            let n = got.get(&(r.host.as_str(), s)).copied().unwrap_or(0);
            let want = usize::from(r.kind == ReceiverKind::New);
            assert_eq!(n, want, "{} shard {s}: {p:#?}", r.host);
        }
    }
}

// ---- racks -----------------------------------------------------------------------------

#[test]
fn chains_are_sourced_in_rack_and_hops_share_a_rack() {
    let mut cluster = vec![
        holder("s1", "r1", true, false),
        holder("s2", "r2", true, false),
    ];
    for i in 0..4 {
        cluster.push(host(&format!("a{i}"), "r1"));
        cluster.push(host(&format!("b{i}"), "r2"));
    }
    let m = model(1);
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(10), Tier::Memory),
        &PlanParams::default(),
    )
    .unwrap();
    assert_eq!(ids(&p.receivers, ReceiverKind::Local), ["s1", "s2"]);
    assert_eq!(ids(&p.receivers, ReceiverKind::New).len(), 8);
    assert_eq!(p.chains.len(), 2);
    for c in &p.chains {
        let (src, tier) = peer(c).unwrap();
        assert_eq!(tier, Tier::Memory);
        assert_eq!(c.hops.len(), 4);
        for h in &c.hops {
            assert_eq!(rack_of(&cluster, h), rack_of(&cluster, src), "{c:?}");
        }
    }
    assert_complete(&p, &m);
}

#[test]
fn origin_chains_keep_racks_contiguous() {
    let mut cluster = Vec::new();
    for i in 0..4 {
        cluster.push(host(&format!("a{i}"), "r1"));
        cluster.push(host(&format!("b{i}"), "r2"));
    }
    let m = model(1);
    let params = PlanParams {
        max_chain_len: 4,
        ..PlanParams::default()
    };
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(8), Tier::Memory),
        &params,
    )
    .unwrap();
    assert_eq!(p.chains.len(), 2);
    for c in &p.chains {
        assert_eq!(c.source, Source::Origin);
        for pair in c.hops.windows(2) {
            assert_eq!(
                rack_of(&cluster, &pair[0]),
                rack_of(&cluster, &pair[1]),
                "{c:?}"
            );
        }
    }
}

#[test]
fn new_hosts_prefer_racks_holding_the_model() {
    // r2 has the only holder; r1 hosts have more free memory but r2 hosts win.
    let mut cluster = vec![holder("s", "r2", true, false)];
    for i in 0..3 {
        let mut h = host(&format!("a{i}"), "r1");
        h.mem_free = 1000 * GIB;
        cluster.push(h);
        cluster.push(host(&format!("b{i}"), "r2"));
    }
    let m = model(1);
    let rs = choose_receivers(&cluster, &req(&m, Target::Replicas(3), Tier::Memory)).unwrap();
    assert_eq!(ids(&rs, ReceiverKind::Local), ["s"]);
    assert_eq!(ids(&rs, ReceiverKind::New), ["b0", "b1"]);
}

#[test]
fn sources_are_not_taken_as_receivers_while_others_fit() {
    // The only copy is on d's disk; d has the most free memory and sits in the holder rack,
    // but choosing it would leave no source (origin at 250 Mbit/s instead of d's disk).
    let mut d = holder("d", "r1", false, true);
    d.mem_free = 1000 * GIB;
    let cluster = vec![d, host("x", "r2"), host("y", "r2")];
    let m = model(1);
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(2), Tier::Memory),
        &PlanParams::default(),
    )
    .unwrap();
    assert_eq!(ids(&p.receivers, ReceiverKind::New), ["x", "y"]);
    assert_eq!(peer(&p.chains[0]), Some(("d", Tier::Disk)));
    // When it is needed, it is still chosen (and the origin serves everyone).
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(3), Tier::Memory),
        &PlanParams::default(),
    )
    .unwrap();
    assert_eq!(ids(&p.receivers, ReceiverKind::New), ["x", "y", "d"]);
    assert!(p.chains.iter().all(|c| c.source == Source::Origin));
    assert_complete(&p, &m);
}

// ---- capacity, down hosts ----------------------------------------------------------------

#[test]
fn full_hosts_are_skipped() {
    let mut cluster = vec![host("a", "r"), host("b", "r"), host("c", "r")];
    cluster[1].mem_free = GIB; // model is 2 GiB
    let m = model(2);
    let rs = choose_receivers(&cluster, &req(&m, Target::Replicas(2), Tier::Memory)).unwrap();
    assert_eq!(ids(&rs, ReceiverKind::New), ["a", "c"]);
}

#[test]
fn not_enough_capacity_names_down_and_full() {
    let mut cluster = vec![host("a", "r"), host("b", "r"), host("c", "r")];
    cluster[1].mem_free = GIB;
    cluster[2].up = false;
    let m = model(2);
    let err = choose_receivers(&cluster, &req(&m, Target::Replicas(2), Tier::Memory)).unwrap_err();
    match &err {
        PlanError::NotEnoughCapacity {
            requested,
            available,
            detail,
        } => {
            assert_eq!((*requested, *available), (2, 1));
            assert!(
                detail.contains("1 down") && detail.contains("1 full"),
                "{detail}"
            );
        }
        e => panic!("unexpected {e:?}"),
    }
    assert!(err.to_string().contains("fewer replicas"));
}

#[test]
fn disk_tier_counts_disk_space() {
    let mut cluster = vec![host("a", "r"), host("b", "r")];
    cluster[0].disk_free = 0;
    cluster[1].mem_free = 0;
    let m = model(1);
    let rs = choose_receivers(&cluster, &req(&m, Target::Replicas(1), Tier::Disk)).unwrap();
    assert_eq!(ids(&rs, ReceiverKind::New), ["b"]);
}

#[test]
fn down_hosts_are_skipped() {
    let mut cluster = vec![
        holder("s", "r", true, false),
        host("a", "r"),
        host("b", "r"),
    ];
    cluster[1].up = false;
    cluster[0].up = false;
    let m = model(1);
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(1), Tier::Memory),
        &PlanParams::default(),
    )
    .unwrap();
    assert_eq!(ids(&p.receivers, ReceiverKind::New), ["b"]);
    // The down holder is not a source either.
    assert_eq!(p.chains.len(), 1);
    assert_eq!(p.chains[0].source, Source::Origin);
}

#[test]
fn no_live_host() {
    let m = model(1);
    let r = req(&m, Target::Replicas(1), Tier::Memory);
    assert_eq!(
        plan(&[], &r, &PlanParams::default()),
        Err(PlanError::NoLiveHost)
    );
    let mut down = host("a", "r");
    down.up = false;
    assert_eq!(
        plan(&[down], &r, &PlanParams::default()),
        Err(PlanError::NoLiveHost)
    );
    assert_eq!(
        plan(
            &[],
            &req(&m, hosts(&["a"]), Tier::Gpu),
            &PlanParams::default()
        ),
        Err(PlanError::NoLiveHost)
    );
}

// ---- sources -----------------------------------------------------------------------------

#[test]
fn own_memory_is_local_and_nothing_moves() {
    let cluster = vec![
        holder("a", "r", true, false),
        holder("b", "r", true, true),
        host("c", "r"),
    ];
    let m = model(1);
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(2), Tier::Memory),
        &PlanParams::default(),
    )
    .unwrap();
    assert_eq!(ids(&p.receivers, ReceiverKind::Local), ["a", "b"]);
    assert!(p.chains.is_empty());
    assert_eq!(p.estimate_s, 0.0);
    // GPU tier: memory copy on the host is enough.
    let p = plan(
        &cluster,
        &req(&m, hosts(&["a"]), Tier::Gpu),
        &PlanParams::default(),
    )
    .unwrap();
    assert_eq!(p.receivers[0].kind, ReceiverKind::Local);
    assert_eq!(p.receivers[0].gpus, 1);
    assert!(p.chains.is_empty());
}

#[test]
fn peer_memory_preferred_over_peer_disk() {
    let cluster = vec![
        holder("d", "r", false, true),
        holder("m", "r2", true, false),
        host("x", "r"),
    ];
    for shards in [1, 4] {
        let m = model(shards);
        let p = plan(
            &cluster,
            &req(&m, hosts(&["x"]), Tier::Memory),
            &PlanParams::default(),
        )
        .unwrap();
        assert_eq!(p.chains.len(), 1, "{p:#?}");
        assert_eq!(peer(&p.chains[0]), Some(("m", Tier::Memory)));
        assert_complete(&p, &m);
    }
}

#[test]
fn same_rack_memory_peer_preferred() {
    let cluster = vec![
        holder("m1", "r1", true, false),
        holder("m2", "r2", true, false),
        host("x", "r2"),
    ];
    let m = model(1);
    let p = plan(
        &cluster,
        &req(&m, hosts(&["x"]), Tier::Memory),
        &PlanParams::default(),
    )
    .unwrap();
    assert_eq!(peer(&p.chains[0]), Some(("m2", Tier::Memory)));
}

#[test]
fn disk_peer_used_when_no_memory_peer() {
    let cluster = vec![
        holder("d", "r", false, true),
        host("x", "r"),
        host("y", "r"),
    ];
    let m = model(1);
    let params = PlanParams::default();
    let p = plan(
        &cluster,
        &req(&m, hosts(&["x", "y"]), Tier::Memory),
        &params,
    )
    .unwrap();
    assert_eq!(p.chains.len(), 1);
    assert_eq!(peer(&p.chains[0]), Some(("d", Tier::Disk)));
    // Disk read rate (1 GB/s) is below the 10 Gbit/s NIC: it is the bottleneck.
    let want = (m.total_bytes() as f64 + m.chunk_size as f64) / params.disk_read_bps as f64;
    assert!(
        (p.estimate_s - want).abs() < 1e-6,
        "{} vs {want}",
        p.estimate_s
    );
}

#[test]
fn disk_request_is_local_on_disk_holders() {
    let cluster = vec![holder("d", "r", false, true), holder("m", "r", true, false)];
    let m = model(1);
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(2), Tier::Disk),
        &PlanParams::default(),
    )
    .unwrap();
    assert_eq!(ids(&p.receivers, ReceiverKind::Local), ["d"]);
    assert_eq!(ids(&p.receivers, ReceiverKind::New), ["m"]);
    // m holds a memory copy but is a receiver: never its own source; d serves from disk.
    assert_eq!(peer(&p.chains[0]), Some(("d", Tier::Disk)));
}

#[test]
fn origin_one_chain_when_it_fits_else_ceil() {
    let cluster: Vec<HostInfo> = (0..10).map(|i| host(&format!("h{i:02}"), "r")).collect();
    let m = model(1);
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(10), Tier::Memory),
        &PlanParams::default(),
    )
    .unwrap();
    assert_eq!(p.chains.len(), 1);
    assert_eq!(p.chains[0].source, Source::Origin);
    assert_eq!(p.chains[0].hops.len(), 10);

    let params = PlanParams {
        max_chain_len: 4,
        ..PlanParams::default()
    };
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(10), Tier::Memory),
        &params,
    )
    .unwrap();
    let mut sizes: Vec<usize> = p.chains.iter().map(|c| c.hops.len()).collect();
    sizes.sort_unstable();
    assert_eq!(sizes, [3, 3, 4]);
    assert!(p.chains.iter().all(|c| c.source == Source::Origin));
    assert_complete(&p, &m);
    // Origin at 250 Mbit/s is the bottleneck.
    let want = (m.total_bytes() as f64 + 3.0 * m.chunk_size as f64) / params.origin_bps as f64;
    assert!((p.estimate_s - want).abs() < 1e-6);
}

#[test]
fn even_split_over_sources_and_max_len() {
    let mut cluster = vec![
        holder("s1", "r", true, false),
        holder("s2", "r", true, false),
        holder("s3", "r", true, false),
    ];
    cluster.extend((0..10).map(|i| host(&format!("h{i:02}"), "r")));
    let m = model(1);
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(13), Tier::Memory),
        &PlanParams::default(),
    )
    .unwrap();
    let mut sizes: Vec<usize> = p.chains.iter().map(|c| c.hops.len()).collect();
    sizes.sort_unstable();
    assert_eq!(sizes, [3, 3, 4]);
    let mut srcs: Vec<&str> = p.chains.iter().map(|c| peer(c).unwrap().0).collect();
    srcs.sort_unstable();
    assert_eq!(srcs, ["s1", "s2", "s3"]);

    // More chains than sources: sources head several chains, none longer than L.
    let params = PlanParams {
        max_chain_len: 2,
        ..PlanParams::default()
    };
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(13), Tier::Memory),
        &params,
    )
    .unwrap();
    assert_eq!(p.chains.len(), 5);
    assert!(p.chains.iter().all(|c| (1..=2).contains(&c.hops.len())));
    assert_complete(&p, &m);
}

// ---- striping ----------------------------------------------------------------------------

#[test]
fn striping_over_slow_sources() {
    let mut cluster = vec![
        holder("d1", "r", false, true),
        holder("d2", "r", false, true),
    ];
    cluster.extend((0..4).map(|i| host(&format!("h{i}"), "r")));
    let m = ModelSpec {
        key: KEY.to_owned(),
        shard_bytes: vec![4 * GIB, GIB, 2 * GIB, 3 * GIB, GIB],
        chunk_size: 4 << 20,
    };
    let params = PlanParams {
        disk_read_bps: 100_000_000,
        ..PlanParams::default()
    };
    let r = req(&m, hosts(&["h0", "h1", "h2", "h3"]), Tier::Memory);
    let p = plan(&cluster, &r, &params).unwrap();
    assert_eq!(p.chains.len(), 2, "{p:#?}");
    let mut carried: Vec<u32> = p.chains.iter().flat_map(|c| c.shards.clone()).collect();
    carried.sort_unstable();
    assert_eq!(carried, [0, 1, 2, 3, 4], "each shard in exactly one stripe");
    for c in &p.chains {
        assert_eq!(c.hops.len(), 4);
        let bytes: u64 = c.shards.iter().map(|&s| m.shard_bytes[s as usize]).sum();
        assert_eq!(c.bytes, bytes);
    }
    // Balanced: 11 GiB over two stripes, largest first: {4,1,1}=6 vs {3,2}=5.
    let mut loads: Vec<u64> = p.chains.iter().map(|c| c.bytes / GIB).collect();
    loads.sort_unstable();
    assert_eq!(loads, [5, 6]);
    // Rotated: not the same last hop in every chain.
    assert_ne!(p.chains[0].hops.last(), p.chains[1].hops.last());
    assert_complete(&p, &m);

    // The split plan would have been slower.
    let split = plan(
        &cluster,
        &r,
        &PlanParams {
            stripe: false,
            ..params.clone()
        },
    )
    .unwrap();
    assert!(split.chains.iter().all(|c| c.shards.is_empty()));
    assert!(p.estimate_s < split.estimate_s);
}

#[test]
fn no_striping_when_sources_are_as_fast_as_receivers() {
    let mut cluster = vec![
        holder("m1", "r", true, false),
        holder("m2", "r", true, false),
    ];
    cluster.extend((0..4).map(|i| host(&format!("h{i}"), "r")));
    let m = model(4);
    let p = plan(
        &cluster,
        &req(&m, Target::Replicas(6), Tier::Memory),
        &PlanParams::default(),
    )
    .unwrap();
    assert_eq!(p.chains.len(), 2);
    assert!(
        p.chains
            .iter()
            .all(|c| c.shards.is_empty() && c.hops.len() == 2)
    );
}

// ---- GPU: Pareto-greedy ------------------------------------------------------------------

#[test]
fn pareto_stage1_uses_holder_gpus_first() {
    let mut a = holder("a", "r1", true, false);
    a.gpus_free = 3;
    let mut cluster = vec![a];
    cluster.extend((0..5).map(|i| host(&format!("n{i}"), "r2")));
    let m = model(1);

    let rs = choose_receivers(&cluster, &req(&m, Target::Replicas(3), Tier::Gpu)).unwrap();
    assert_eq!(
        rs,
        [Receiver {
            host: "a".into(),
            gpus: 3,
            kind: ReceiverKind::Local
        }]
    );

    let rs = choose_receivers(&cluster, &req(&m, Target::Replicas(6), Tier::Gpu)).unwrap();
    assert_eq!(rs[0].gpus, 3);
    assert_eq!(ids(&rs, ReceiverKind::New), ["n0", "n1", "n2"]);
    assert!(rs[1..].iter().all(|r| r.gpus == 1));
}

#[test]
fn pareto_stage3_round_robin_when_short_of_hosts() {
    let mut a = holder("a", "r", true, false);
    a.gpus_free = 2;
    let mut b = host("b", "r");
    b.gpus_free = 4;
    let mut c = host("c", "r");
    c.gpus_free = 2;
    let mut full = host("f", "r");
    full.gpus_free = 0;
    let cluster = vec![a, b, c, full];
    let m = model(1);
    let rs = choose_receivers(&cluster, &req(&m, Target::Replicas(7), Tier::Gpu)).unwrap();
    let got: Vec<(&str, u32)> = rs.iter().map(|r| (r.host.as_str(), r.gpus)).collect();
    assert_eq!(got, [("a", 2), ("b", 3), ("c", 2)]);
    let err = choose_receivers(&cluster, &req(&m, Target::Replicas(9), Tier::Gpu)).unwrap_err();
    assert!(matches!(
        err,
        PlanError::NotEnoughCapacity {
            requested: 9,
            available: 8,
            ..
        }
    ));
}

#[test]
fn gpu_new_hosts_need_memory() {
    let mut a = host("a", "r");
    a.mem_free = 0;
    let cluster = vec![a, host("b", "r")];
    let m = model(1);
    let rs = choose_receivers(&cluster, &req(&m, Target::Replicas(2), Tier::Gpu)).unwrap();
    assert_eq!(rs.len(), 1);
    assert_eq!((rs[0].host.as_str(), rs[0].gpus), ("b", 2));
}

// ---- download sharing --------------------------------------------------------------------

#[test]
fn in_flight_hosts_join_and_are_never_in_chains() {
    // j holds a disk copy but is receiving into memory: neither sent again nor a source.
    let cluster = vec![
        holder("j", "r", false, true),
        host("a", "r"),
        host("b", "r"),
        holder("s", "r", true, false),
    ];
    let m = model(2);
    let in_flight = vec!["j".to_owned()];
    for tier in [Tier::Memory, Tier::Gpu] {
        let r = PlanRequest {
            model: &m,
            target: Target::Replicas(if tier == Tier::Gpu { 24 } else { 4 }),
            tier,
            in_flight: &in_flight,
        };
        let p = plan(&cluster, &r, &PlanParams::default()).unwrap();
        assert_eq!(ids(&p.receivers, ReceiverKind::Joined), ["j"], "{tier}");
        for c in &p.chains {
            assert!(!c.hops.iter().any(|h| h == "j"));
            assert_ne!(peer(c).map(|p| p.0), Some("j"));
        }
        assert_complete(&p, &m);
    }
}

#[test]
fn reserve_then_replan_does_not_double_book() {
    let mut cluster: Vec<HostInfo> = (0..4).map(|i| host(&format!("h{i}"), "r")).collect();
    for h in &mut cluster {
        h.gpus_free = 1;
    }
    let m = model(2);
    let params = PlanParams::default();
    let r = req(&m, Target::Replicas(2), Tier::Gpu);
    let first = plan(&cluster, &r, &params).unwrap();
    reserve(&mut cluster, &m, Tier::Gpu, &first);
    for h in first.new_receivers() {
        let h = cluster.iter().find(|c| c.id == h).unwrap();
        assert_eq!(h.gpus_free, 0);
        assert_eq!(h.mem_free, 512 * GIB - 2 * GIB);
        assert!(h.holdings[KEY].receiving);
    }
    // The next plan does not resend to the receiving hosts and uses the other two GPUs.
    let second = plan(&cluster, &r, &params).unwrap();
    let a: Vec<&str> = first.new_receivers().collect();
    let b: Vec<&str> = second.new_receivers().collect();
    assert!(a.iter().all(|h| !b.contains(h)), "{a:?} {b:?}");
    assert_eq!(b.len(), 2);
    // No GPUs left.
    reserve(&mut cluster, &m, Tier::Gpu, &second);
    assert!(matches!(
        plan(&cluster, &req(&m, Target::Replicas(1), Tier::Gpu), &params),
        Err(PlanError::NotEnoughCapacity { .. })
    ));
}

#[test]
fn reserve_saturates() {
    let mut cluster = vec![host("a", "r")];
    cluster[0].mem_free = 1;
    cluster[0].gpus_free = 1;
    let m = model(1);
    let p = Plan {
        receivers: vec![
            Receiver {
                host: "a".into(),
                gpus: 5,
                kind: ReceiverKind::New,
            },
            Receiver {
                host: "ghost".into(),
                gpus: 5,
                kind: ReceiverKind::New,
            },
        ],
        chains: vec![],
        estimate_s: 0.0,
    };
    reserve(&mut cluster, &m, Tier::Gpu, &p);
    assert_eq!((cluster[0].mem_free, cluster[0].gpus_free), (0, 0));
    reserve(&mut cluster, &m, Tier::Disk, &p);
    assert_eq!(cluster[0].disk_free, 4096 * GIB - GIB);
}

// ---- named hosts and invalid requests ----------------------------------------------------

#[test]
fn named_hosts() {
    let mut cluster = vec![
        holder("a", "r", true, false),
        host("b", "r"),
        host("c", "r"),
    ];
    cluster[2].up = false;
    let m = model(1);
    let params = PlanParams::default();
    let p = plan(&cluster, &req(&m, hosts(&["b", "a"]), Tier::Gpu), &params).unwrap();
    let got: Vec<(&str, u32, ReceiverKind)> = p
        .receivers
        .iter()
        .map(|r| (r.host.as_str(), r.gpus, r.kind))
        .collect();
    assert_eq!(
        got,
        [("a", 1, ReceiverKind::Local), ("b", 1, ReceiverKind::New)]
    );
    assert_eq!(p.chains.len(), 1);
    assert_eq!(p.chains[0].hops, ["b"]);

    assert_eq!(
        plan(
            &cluster,
            &req(&m, hosts(&["a", "zz"]), Tier::Memory),
            &params
        ),
        Err(PlanError::UnknownHost("zz".into()))
    );
    assert_eq!(
        plan(&cluster, &req(&m, hosts(&["c"]), Tier::Memory), &params),
        Err(PlanError::HostDown("c".into()))
    );
    assert!(matches!(
        plan(&cluster, &req(&m, hosts(&[]), Tier::Memory), &params),
        Err(PlanError::InvalidRequest(_))
    ));
    assert!(matches!(
        plan(
            &cluster,
            &req(&m, hosts(&["a", "b", "a"]), Tier::Memory),
            &params
        ),
        Err(PlanError::InvalidRequest(_))
    ));
    cluster[1].mem_free = 0;
    cluster[0].gpus_free = 0;
    match plan(&cluster, &req(&m, hosts(&["a", "b"]), Tier::Gpu), &params) {
        Err(PlanError::NotEnoughCapacity {
            requested: 2,
            available: 0,
            detail,
        }) => assert!(detail.contains("`a` has no free GPU") && detail.contains("`b` has 0")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn invalid_requests() {
    let cluster = vec![host("a", "r")];
    let m = model(1);
    let params = PlanParams::default();
    let zero = plan(&cluster, &req(&m, Target::Replicas(0), Tier::Gpu), &params);
    assert!(matches!(zero, Err(PlanError::InvalidRequest(_))));
    let bad = PlanParams {
        max_chain_len: 0,
        ..PlanParams::default()
    };
    let r = req(&m, Target::Replicas(1), Tier::Memory);
    assert!(matches!(
        plan(&cluster, &r, &bad),
        Err(PlanError::InvalidRequest(_))
    ));
    let empty = ModelSpec {
        key: KEY.into(),
        shard_bytes: vec![],
        chunk_size: 1,
    };
    assert!(matches!(
        plan(
            &cluster,
            &req(&empty, Target::Replicas(1), Tier::Memory),
            &params
        ),
        Err(PlanError::InvalidRequest(_))
    ));
    // Every error has an actionable message.
    for e in [
        PlanError::NoLiveHost,
        PlanError::UnknownHost("x".into()),
        PlanError::HostDown("x".into()),
        PlanError::InvalidRequest("why".into()),
    ] {
        assert!(e.to_string().len() > 20);
    }
}

// ---- misc --------------------------------------------------------------------------------

#[test]
fn tier_parse_and_display() {
    for t in [Tier::Memory, Tier::Disk, Tier::Gpu] {
        assert_eq!(t.to_string().parse::<Tier>(), Ok(t));
    }
    assert!(
        "GPU".parse::<Tier>().is_err(),
        "names are exact, like every wire name"
    );
    assert!(
        "ssd"
            .parse::<Tier>()
            .unwrap_err()
            .to_string()
            .contains("memory")
    );
}

#[test]
fn plan_chains_direct() {
    let cluster = vec![
        holder("s", "r", true, false),
        host("a", "r"),
        host("b", "r"),
    ];
    let m = model(1);
    let want = vec![
        "a".to_owned(),
        "b".to_owned(),
        "a".to_owned(),
        "ghost".to_owned(),
    ];
    let chains = plan_chains(&cluster, &m, Tier::Memory, &want, &PlanParams::default());
    assert_eq!(chains.len(), 1);
    assert_eq!(peer(&chains[0]), Some(("s", Tier::Memory)));
    assert_eq!(chains[0].hops, ["a", "b", "ghost"]);
    assert!(plan_chains(&cluster, &m, Tier::Memory, &[], &PlanParams::default()).is_empty());
}

#[test]
fn deterministic_and_order_independent() {
    let mut cluster = Vec::new();
    for i in 0..30 {
        let rack = format!("r{}", i % 4);
        let id = format!("h{i:02}");
        cluster.push(match i % 7 {
            0 => holder(&id, &rack, true, false),
            3 => holder(&id, &rack, false, true),
            _ => host(&id, &rack),
        });
    }
    let m = model(3);
    let params = PlanParams {
        max_chain_len: 4,
        ..PlanParams::default()
    };
    for (target, tier) in [
        (Target::Replicas(20), Tier::Memory),
        (Target::Replicas(40), Tier::Gpu),
        (hosts(&["h01", "h02", "h09"]), Tier::Disk),
    ] {
        let r = req(&m, target, tier);
        let a = plan(&cluster, &r, &params).unwrap();
        let mut rev = cluster.clone();
        rev.reverse();
        assert_eq!(a, plan(&rev, &r, &params).unwrap());
        assert_complete(&a, &m);
    }
}
