//! Tests of [`super`]: paths, max-min fairness, chains, caps, milestones.

use super::*;
use proptest::prelude::*;

const G: f64 = 1e9 / 8.0; // 1 Gbit/s in bytes/s

/// 4 hosts, 2 per leaf; host links 10 Gbit/s, leaf uplinks 15 Gbit/s; the origin's
/// link 6 Gbit/s, 4 Gbit/s per stream.
fn small() -> Topology {
    Topology {
        hosts: 4,
        hosts_per_leaf: 2,
        host_link_bps: 10.0 * G,
        leaf_uplink_bps: 15.0 * G,
        origin_link_bps: Some(6.0 * G),
        origin_stream_bps: Some(4.0 * G),
    }
}

fn one(from: Endpoint, to: Endpoint, size: f64) -> FlowSpec {
    FlowSpec {
        segments: vec![(from, to)],
        cap_bps: None,
        milestones: vec![size],
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

use Endpoint::{Host, Origin};

#[test]
fn a_milestone_lost_in_the_clocks_resolution_counts_as_crossed() {
    // At t = 5000 s one ulp of time is 9.1e-13 s; at 50 Gbit/s (6.25 GB/s) a flow 2 mB
    // short of its milestone needs 3.2e-13 s, so `next_at` rounds to now. The old check
    // (within 1 mB) never crossed it, and `advance` looped at that instant.
    let m = 11_408e6;
    let f = Flow {
        links: vec![(0, 1)],
        cap: f64::INFINITY,
        milestones: vec![m, m + 1048576.0],
        next: 0,
        progress: m - 0.002,
        since: 5000.0,
        rate: gbit(50.0),
        from_origin: false,
    };
    assert_eq!(f.next_at(), 5000.0);
    assert!(f.crossed(m, 5000.0));
    // Far enough away to need time that the clock can tell: not crossed yet.
    let far = Flow {
        progress: m - 1e6,
        ..f.clone()
    };
    assert!(!far.crossed(m, 5000.0));
    assert!(far.next_at() > 5000.0);
}

#[test]
fn paths_follow_the_leaves() {
    let t = small();
    assert_eq!(t.path(Host(0), Host(1)).unwrap(), vec![0, 3]);
    // host 0 up, leaf 0 up, leaf 1 down, host 3 down
    assert_eq!(t.path(Host(0), Host(3)).unwrap(), vec![0, 8, 11, 7]);
    assert_eq!(t.path(Origin, Host(2)).unwrap(), vec![12, 11, 5]);
    assert_eq!(t.path(Host(1), Host(1)), Err(NetError::Loop(Host(1))));
    assert_eq!(t.path(Host(1), Origin), Err(NetError::ToOrigin));
    assert_eq!(t.path(Host(9), Host(1)), Err(NetError::NoSuchHost(9)));
    assert_eq!(Topology::flashpoint().leaves(), 10);
}

#[test]
fn two_flows_share_a_host_link_equally() {
    // 0 -> 1 and 0 -> 1 again: both cross host 0's uplink (10 G): 5 G each.
    let mut n = Network::new(small());
    let size = 10.0 * G; // 10 Gbit: 2 s at 5 G
    let (a, _) = n.add_flow(0.0, one(Host(0), Host(1), size)).unwrap();
    let (b, _) = n.add_flow(0.0, one(Host(0), Host(1), size / 2.0)).unwrap();
    assert!(close(n.rate(a).unwrap(), 5.0 * G));
    assert!(close(n.rate(b).unwrap(), 5.0 * G));
    // b ends at 1 s (5 Gbit at 5 G); a then has 5 Gbit left at 10 G: ends at 1.5 s.
    assert!(close(n.next_event().unwrap(), 1.0));
    let r = n.advance(10.0);
    assert_eq!(r.len(), 2);
    assert_eq!((r[0].flow, r[0].ended), (b, true));
    assert!(close(r[0].at, 1.0));
    assert_eq!((r[1].flow, r[1].ended), (a, true));
    assert!(close(r[1].at, 1.5));
    assert_eq!(n.flow_count(), 0);
}

#[test]
fn the_spine_uplink_is_the_bottleneck_for_cross_leaf_flows() {
    // Hosts 0 and 1 (leaf 0) each send to 2 and 3 (leaf 1): four flows, each host
    // uplink carries two (10 G -> 5 G each would fit), but leaf 0's uplink (15 G) carries
    // all four: 3.75 G each.
    let mut n = Network::new(small());
    let mut ids = Vec::new();
    for (a, b) in [(0, 2), (0, 3), (1, 2), (1, 3)] {
        ids.push(n.add_flow(0.0, one(Host(a), Host(b), G)).unwrap().0);
    }
    for id in &ids {
        assert!(close(n.rate(*id).unwrap(), 3.75 * G), "{:?}", n.rates());
    }
    // Add an in-leaf flow 2 -> 3: host 3's downlink (10 G) now carries three flows
    // (0->3, 1->3, 2->3) and fills first, at 10/3 G each; 0->2 and 1->2 then share
    // what is left of leaf 0's uplink: (15 - 2 x 10/3) / 2 = 25/6 G each.
    let (c, _) = n.add_flow(0.0, one(Host(2), Host(3), G)).unwrap();
    assert!(close(n.rate(c).unwrap(), 10.0 / 3.0 * G), "{:?}", n.rates());
    for (i, want) in [25.0 / 6.0, 10.0 / 3.0, 25.0 / 6.0, 10.0 / 3.0]
        .iter()
        .enumerate()
    {
        assert!(close(n.rate(ids[i]).unwrap(), want * G), "{:?}", n.rates());
    }
}

#[test]
fn origin_streams_are_capped_and_share_the_origin_link() {
    let mut n = Network::new(small());
    // One stream: its own cap (4 G), not the link's 6 G.
    let (a, _) = n.add_flow(0.0, one(Origin, Host(0), 4.0 * G)).unwrap();
    assert!(close(n.rate(a).unwrap(), 4.0 * G));
    // Three streams share the 6 G link: 2 G each.
    let (b, _) = n.add_flow(0.0, one(Origin, Host(1), 4.0 * G)).unwrap();
    let (c, _) = n.add_flow(0.0, one(Origin, Host(2), 4.0 * G)).unwrap();
    for id in [a, b, c] {
        assert!(close(n.rate(id).unwrap(), 2.0 * G));
    }
    // All three end at 2 s; the origin sent 12 Gbit.
    let r = n.advance(5.0);
    assert_eq!(r.len(), 3);
    assert!(r.iter().all(|x| close(x.at, 2.0)));
    assert!(close(n.origin_bytes(), 12.0 * G));
    // Unlimited origin link: each stream at its 4 G cap.
    let mut t = small();
    t.origin_link_bps = None;
    let mut n = Network::new(t);
    let ids: Vec<_> = (0..3)
        .map(|h| n.add_flow(0.0, one(Origin, Host(h), G)).unwrap().0)
        .collect();
    for id in ids {
        assert!(close(n.rate(id).unwrap(), 4.0 * G));
    }
}

#[test]
fn a_chain_moves_at_its_bottleneck_and_its_hops_finish_a_chunk_apart() {
    // origin -> 0 -> 1 -> 3: the origin stream (4 G) is the bottleneck. S = 8 Gbit,
    // chunk = 0.4 Gbit: hop j ends when the head has pushed S + j * chunk, at
    // (S + j * chunk) / 4 G = 2 s, 2.1 s, 2.2 s.
    let mut n = Network::new(small());
    let (s, c) = (8.0 * G, 0.4 * G);
    let spec = FlowSpec {
        segments: vec![(Origin, Host(0)), (Host(0), Host(1)), (Host(1), Host(3))],
        cap_bps: None,
        milestones: (0..3).map(|j| s + j as f64 * c).collect(),
    };
    let (id, _) = n.add_flow(0.0, spec).unwrap();
    assert!(close(n.rate(id).unwrap(), 4.0 * G));
    let r = n.advance(100.0);
    let at: Vec<f64> = r.iter().map(|x| x.at).collect();
    assert_eq!(r.len(), 3);
    for (got, want) in at.iter().zip([2.0, 2.1, 2.2]) {
        assert!(close(*got, want), "{at:?}");
    }
    assert!(r[2].ended && !r[1].ended);
    // The origin sent the chain's bytes once (the milestones' tail included).
    assert!(close(n.origin_bytes(), s + 2.0 * c));
}

#[test]
fn a_chain_that_leaves_a_leaf_twice_pays_twice_on_its_uplink() {
    // 0 -> 2 -> 1 -> 3 with the flow capped at 10 G: leaf 0's uplink (15 G) carries
    // segments 0->2 and 1->3: 2r <= 15 G, so r = 7.5 G.
    let mut n = Network::new(small());
    let spec = FlowSpec {
        segments: vec![(Host(0), Host(2)), (Host(2), Host(1)), (Host(1), Host(3))],
        cap_bps: Some(10.0 * G),
        milestones: vec![G],
    };
    let (id, _) = n.add_flow(0.0, spec).unwrap();
    assert!(close(n.rate(id).unwrap(), 7.5 * G));
}

#[test]
fn a_flow_cap_binds_and_frees_the_rest_for_others() {
    // Two flows over host 0's uplink (10 G); one capped at 2 G: the other gets 8 G.
    let mut n = Network::new(small());
    let mut capped = one(Host(0), Host(1), G);
    capped.cap_bps = Some(2.0 * G);
    let (a, _) = n.add_flow(0.0, capped).unwrap();
    let (b, _) = n.add_flow(0.0, one(Host(0), Host(1), G)).unwrap();
    assert!(close(n.rate(a).unwrap(), 2.0 * G));
    assert!(close(n.rate(b).unwrap(), 8.0 * G));
}

#[test]
fn removing_a_flow_gives_its_share_back_from_then_on() {
    let mut n = Network::new(small());
    let (a, _) = n.add_flow(0.0, one(Host(0), Host(1), 10.0 * G)).unwrap();
    let (b, _) = n.add_flow(0.0, one(Host(0), Host(1), 10.0 * G)).unwrap();
    // 1 s at 5 G, then a alone at 10 G for the remaining 5 Gbit: ends at 1.5 s.
    let (left, _) = n.remove_flow(1.0, b);
    assert!(close(left.unwrap(), 5.0 * G));
    assert!(close(n.progress(a).unwrap(), 5.0 * G));
    assert!(close(n.next_event().unwrap(), 1.5));
    assert_eq!(n.remove_flow(1.0, b).0, None);
}

#[test]
fn bad_flows_are_refused() {
    let mut n = Network::new(small());
    let mut f = one(Host(0), Host(1), G);
    f.milestones = vec![2.0, 1.0];
    assert!(matches!(n.add_flow(0.0, f), Err(NetError::Invalid(_))));
    let f = FlowSpec {
        segments: vec![],
        cap_bps: None,
        milestones: vec![1.0],
    };
    assert!(matches!(n.add_flow(0.0, f), Err(NetError::Invalid(_))));
    assert!(n.add_flow(0.0, one(Host(0), Host(7), G)).is_err());
}

fn endpoint(hosts: usize) -> impl Strategy<Value = Endpoint> {
    prop_oneof![
        1 => Just(Endpoint::Origin),
        6 => (0..hosts).prop_map(Endpoint::Host),
    ]
}

proptest! {
    /// Max-min fairness on random topologies and flows: no link over capacity, no flow
    /// over its cap, and every flow is at its cap or crosses a full link on which no
    /// flow is faster (its bottleneck).
    #[test]
    fn rates_are_max_min_fair(
        hosts in 2usize..12,
        per_leaf in 1usize..5,
        host_g in 1.0f64..50.0,
        leaf_g in 1.0f64..100.0,
        origin_g in prop::option::of(0.5f64..20.0),
        stream_g in prop::option::of(0.5f64..5.0),
        raw in prop::collection::vec(
            (prop::collection::vec((endpoint(12), 0usize..12), 1..4),
             prop::option::of(0.5f64..30.0)),
            1..25),
    ) {
        let topo = Topology {
            hosts,
            hosts_per_leaf: per_leaf,
            host_link_bps: host_g * G,
            leaf_uplink_bps: leaf_g * G,
            origin_link_bps: origin_g.map(|g| g * G),
            origin_stream_bps: stream_g.map(|g| g * G),
        };
        let mut n = Network::new(topo.clone());
        for (segs, cap) in raw {
            // A chain: each segment starts where the last one ended.
            let mut at = match segs[0].0 { Endpoint::Host(h) => Endpoint::Host(h % hosts), o => o };
            let mut segments = Vec::new();
            for (_, to) in segs {
                let to = Endpoint::Host(to % hosts);
                if to != at {
                    segments.push((at, to));
                    at = to;
                }
            }
            if segments.is_empty() { continue; }
            let spec = FlowSpec { segments, cap_bps: cap.map(|g| g * G), milestones: vec![G] };
            n.add_flow(0.0, spec).unwrap();
        }
        let caps = topo.capacities();
        let mut load = vec![0.0; caps.len()];
        for f in n.flows.values() {
            for &(l, m) in &f.links {
                load[l] += f.rate * f64::from(m);
            }
        }
        for (l, (&x, &c)) in load.iter().zip(&caps).enumerate() {
            prop_assert!(x <= c * (1.0 + 1e-6), "link {l}: {x} > {c}");
        }
        for (id, f) in &n.flows {
            prop_assert!(f.rate <= f.cap * (1.0 + 1e-6));
            prop_assert!(f.rate > 0.0);
            let at_cap = f.rate >= f.cap * (1.0 - 1e-6);
            let bottleneck = f.links.iter().any(|&(l, _)| {
                load[l] >= caps[l] * (1.0 - 1e-6)
                    && n.flows.values().filter(|g| g.links.iter().any(|&(k, _)| k == l))
                        .all(|g| g.rate <= f.rate * (1.0 + 1e-6))
            });
            prop_assert!(at_cap || bottleneck, "flow {id:?} at {} has no bottleneck", f.rate);
        }
    }
}
