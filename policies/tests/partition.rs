//! Partition planning: DP vs brute force, cost-optimal plans under an SLO, precomputed
//! tables, the Flashpoint worked example, profile estimation and degenerate inputs.

use proptest::prelude::*;
use shardcast_policies::partition::{
    CostModel, FLASHPOINT_EXAMPLE_LINK_BPS, NoPlan, PartitionError, PartitionPlan,
    brute_force_plan, brute_force_plan_on_gpus, cost_optimal, cost_optimal_brute_force,
    flashpoint_example, optimal_plan, optimal_plan_on_gpus, precompute, precompute_exhaustive,
};
use shardcast_policies::profile::{
    Bandwidths, LayerGroup, ModelProfile, ProfileError, T5_3B_COLD_START_S, profile_from_tensors,
    synthetic_t5_3b_like,
};

fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// Checks the structural invariants of a plan with `p` partitions over `n` groups.
fn assert_well_formed(plan: &PartitionPlan, n: usize, p: usize, gpu_memory: u64) {
    assert_eq!(plan.cuts.len(), p);
    assert_eq!(plan.partitions.len(), p);
    assert_eq!(plan.cuts[0], 0);
    assert!(plan.cuts.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(plan.partitions.last().map(|q| q.groups.end), Some(n));
    for (k, part) in plan.partitions.iter().enumerate() {
        assert_eq!(part.groups.start, plan.cuts[k]);
        assert!(part.weight_bytes <= gpu_memory);
    }
    assert_eq!(plan.latency_s, plan.mean_latency_s(plan.queue));
}

fn group(i: usize, weight_bytes: u64, load_s: f64, exec_s: f64, output_bytes: u64) -> LayerGroup {
    LayerGroup {
        name: format!("g{i}"),
        weight_bytes,
        load_s,
        exec_s,
        output_bytes,
    }
}

/// Small random profiles; times on a coarse grid half the time to provoke ties.
fn small_profile() -> impl Strategy<Value = ModelProfile> {
    let coarse = (1u64..=100, 0u32..=40, 0u32..=20, 0u64..=2_000)
        .prop_map(|(w, l, e, o)| (w, f64::from(l) * 0.25, f64::from(e) * 0.25, o));
    let fine = (1u64..=100, 0.0f64..10.0, 0.0f64..5.0, 0u64..=2_000);
    prop::collection::vec(prop_oneof![coarse, fine], 1..=8).prop_map(|gs| ModelProfile {
        model: "random".to_owned(),
        groups: gs
            .into_iter()
            .enumerate()
            .map(|(i, (w, l, e, o))| group(i, w, l, e, o))
            .collect(),
        estimated: false,
        notes: Vec::new(),
    })
}

proptest! {
    #[test]
    fn dp_equals_brute_force(
        profile in small_profile(),
        p in 1usize..=4,
        extra_gpus in 0usize..=4,
        gpu_memory in 1u64..=400,
        queue in 0u32..=20,
        link_bps in prop_oneof![Just(100.0), Just(1_000.0), 10.0f64..10_000.0],
    ) {
        let gpus = p + extra_gpus;
        let dp = optimal_plan_on_gpus(&profile, p, gpus, gpu_memory, queue, link_bps);
        let bf = brute_force_plan_on_gpus(&profile, p, gpus, gpu_memory, queue, link_bps);
        match (&dp, &bf) {
            (Ok(a), Ok(b)) => {
                prop_assert!(close(a.latency_s, b.latency_s), "dp {a:?}\nbf {b:?}");
                assert_well_formed(a, profile.groups.len(), p, gpu_memory);
                prop_assert_eq!(a.replicas, gpus / p);
            }
            (Err(a), Err(b)) => prop_assert_eq!(a, b),
            _ => prop_assert!(false, "dp {dp:?}\nbf {bf:?}"),
        }
        // The one-replica entry points agree too.
        let dp1 = optimal_plan(&profile, p, gpu_memory, queue, link_bps);
        let bf1 = brute_force_plan(&profile, p, gpu_memory, queue, link_bps);
        match (&dp1, &bf1) {
            (Ok(a), Ok(b)) => prop_assert!(close(a.latency_s, b.latency_s)),
            (Err(a), Err(b)) => prop_assert_eq!(a, b),
            _ => prop_assert!(false, "dp {dp1:?}\nbf {bf1:?}"),
        }
    }

    #[test]
    fn cost_optimal_equals_brute_force(
        profile in small_profile(),
        max_partitions in 0usize..=5,
        gpu_memory in 1u64..=400,
        slo_s in 0.0f64..60.0,
        link_bps in prop_oneof![Just(100.0), 10.0f64..10_000.0],
        overhead in prop_oneof![Just(0.0), 0.0f64..3.0],
    ) {
        let cost = CostModel { price_per_gpu_s: 0.001, per_gpu_overhead_s: overhead };
        let dp = cost_optimal(&profile, slo_s, gpu_memory, link_bps, max_partitions, &cost);
        let bf = cost_optimal_brute_force(&profile, slo_s, gpu_memory, link_bps, max_partitions, &cost);
        match (&dp, &bf) {
            (Ok(a), Ok(b)) => {
                prop_assert!(a.latency_s <= slo_s);
                prop_assert!(close(a.cost(&cost), b.cost(&cost)), "dp {a:?}\nbf {b:?}");
                prop_assert!(a.partition_count() <= max_partitions);
                assert_well_formed(a, profile.groups.len(), a.partition_count(), gpu_memory);
                prop_assert_eq!(a.latency_s, a.cold_start_s + a.inference_s);
            }
            (
                Err(NoPlan::SloUnreachable { best_latency_s: a, slo_s: sa }),
                Err(NoPlan::SloUnreachable { best_latency_s: b, slo_s: sb }),
            ) => {
                prop_assert!(close(*a, *b));
                prop_assert!(*a > slo_s);
                prop_assert_eq!(sa, sb);
            }
            (Err(NoPlan::Infeasible(a)), Err(NoPlan::Infeasible(b))) => prop_assert_eq!(a, b),
            _ => prop_assert!(false, "dp {dp:?}\nbf {bf:?}"),
        }
    }

    #[test]
    fn precomputed_table_matches_optimal_plans(
        profile in small_profile(),
        max_partitions in 1usize..=5,
        gpu_memory in 1u64..=400,
        max_queue in 1u32..=40,
        link_bps in prop_oneof![Just(100.0), 10.0f64..10_000.0],
    ) {
        let exact = precompute_exhaustive(&profile, max_partitions, gpu_memory, link_bps, max_queue);
        let fast = precompute(&profile, max_partitions, gpu_memory, link_bps, max_queue);
        let (exact, fast) = match (exact, fast) {
            (Ok(e), Ok(f)) => (e, f),
            (Err(a), Err(b)) => {
                prop_assert_eq!(a, b);
                return Ok(());
            }
            (e, f) => {
                prop_assert!(false, "exhaustive {e:?}\nexponential {f:?}");
                unreachable!()
            }
        };
        let n = profile.groups.len();
        for x in 1..=max_queue {
            let best = (1..=max_partitions.min(n))
                .filter_map(|p| {
                    optimal_plan_on_gpus(&profile, p, max_partitions, gpu_memory, x, link_bps).ok()
                })
                .map(|plan| plan.latency_s)
                .fold(f64::INFINITY, f64::min);
            let from_exact = exact.best_for(x).map(|plan| plan.mean_latency_s(x));
            prop_assert!(from_exact.is_some_and(|l| close(l, best)), "x={x} {from_exact:?} vs {best}");
            // The thesis' exponential search is exact at its probes, never better than exact.
            let from_fast = fast.best_for(x).map(|plan| plan.mean_latency_s(x)).unwrap_or(f64::NAN);
            prop_assert!(from_fast >= best - 1e-9 * best.abs().max(1.0));
            if x.is_power_of_two() || x == max_queue {
                prop_assert!(close(from_fast, best), "probe x={x}: {from_fast} vs {best}");
            }
            for p in 1..=max_partitions.min(n) {
                let direct = optimal_plan_on_gpus(&profile, p, max_partitions, gpu_memory, x, link_bps);
                let stored = exact.best_with_partitions(p, x);
                match (direct, stored) {
                    (Ok(d), Some(s)) => prop_assert!(close(d.latency_s, s.latency_s)),
                    (Err(_), None) => {}
                    (d, s) => prop_assert!(false, "p={p} x={x}: {d:?} vs {s:?}"),
                }
            }
        }
        // Ranges tile 1..=max_queue.
        prop_assert_eq!(exact.ranges.first().map(|r| r.first_queue), Some(1));
        prop_assert_eq!(exact.ranges.last().map(|r| r.last_queue), Some(max_queue));
        prop_assert!(exact.ranges.windows(2).all(|w| w[0].last_queue + 1 == w[1].first_queue));
        // The table is a plain value.
        let json = serde_json::to_string(&exact).unwrap();
        let back: shardcast_policies::partition::PlanTable = serde_json::from_str(&json).unwrap();
        // (serde_json's default float parsing may differ in the last bit.)
        prop_assert_eq!(back.ranges.len(), exact.ranges.len());
        for (a, b) in back.ranges.iter().zip(&exact.ranges) {
            prop_assert_eq!(&a.plan.cuts, &b.plan.cuts);
            prop_assert_eq!((a.first_queue, a.last_queue), (b.first_queue, b.last_queue));
            prop_assert!(close(a.plan.latency_s, b.plan.latency_s));
        }
    }

    #[test]
    fn arbitrary_input_never_panics(
        groups in prop::collection::vec(
            (any::<u64>(), any::<f64>(), any::<f64>(), any::<u64>()), 0..=6),
        p in 0usize..=8,
        gpus in 0usize..=8,
        gpu_memory in any::<u64>(),
        queue in any::<u32>(),
        link_bps in any::<f64>(),
        slo_s in any::<f64>(),
    ) {
        let profile = ModelProfile {
            model: String::new(),
            groups: groups
                .into_iter()
                .enumerate()
                .map(|(i, (w, l, e, o))| group(i, w, l, e, o))
                .collect(),
            estimated: true,
            notes: Vec::new(),
        };
        let _ = profile.validate();
        let _ = profile.total_bytes();
        let _ = optimal_plan_on_gpus(&profile, p, gpus, gpu_memory, queue, link_bps);
        let _ = brute_force_plan_on_gpus(&profile, p, gpus, gpu_memory, queue, link_bps);
        if let Ok(t) = precompute(&profile, p, gpu_memory, link_bps, queue % 64) {
            let _ = t.best_for(queue);
            let _ = t.best_with_partitions(p, queue);
        }
        let _ = cost_optimal(&profile, slo_s, gpu_memory, link_bps, p, &CostModel::default());
    }

    #[test]
    fn tensor_names_never_panic(
        tensors in prop::collection::vec(("[a-z0-9._]{0,20}", any::<u64>()), 0..20),
    ) {
        let p = profile_from_tensors("m", &tensors, &Bandwidths::default());
        prop_assert!(p.estimated);
        let total: u128 = tensors.iter().map(|(_, b)| u128::from(*b)).sum();
        if total <= u128::from(u64::MAX) {
            prop_assert_eq!(u128::from(p.total_bytes()), total);
        }
    }
}

#[test]
fn flashpoint_worked_example_reproduces_the_thesis() {
    let profile = flashpoint_example();
    let mem = 1_000_000_000;
    let link = FLASHPOINT_EXAMPLE_LINK_BPS;
    // Fig. 4.2: the full model on each of 2 GPUs, 8 requests: 24 s cold start, mean 34 s.
    let full = optimal_plan_on_gpus(&profile, 1, 2, 2 * mem, 8, link).unwrap();
    assert_eq!((full.cold_start_s, full.latency_s), (24.0, 34.0));
    // Fig. 4.3: two partitions without pipelining: mean 34.5 s, last request at 12 + 40 s.
    let split = optimal_plan_on_gpus(&profile, 2, 2, mem, 8, link).unwrap();
    assert_eq!(split.mean_latency_unpipelined_s(8), 34.5);
    // Fig. 4.4: with pipelining: 12 s cold start, requests done 5, 7, …, 19 s later, mean 24 s.
    assert_eq!((split.cold_start_s, split.latency_s), (12.0, 24.0));
    assert_eq!(split.request_latency_s(8), 12.0 + 19.0);
    // With 1 GB per GPU the full model does not fit.
    assert!(matches!(
        optimal_plan_on_gpus(&profile, 1, 2, mem, 8, link),
        Err(PartitionError::NoFeasiblePlan { partitions: 1, .. })
    ));
    // The precomputed table picks the split for the burst of 8, and for a lone request
    // too (17 s vs 28 s).
    for table in [
        precompute(&profile, 2, 2 * mem, link, 16).unwrap(),
        precompute_exhaustive(&profile, 2, 2 * mem, link, 16).unwrap(),
    ] {
        assert_eq!(table.best_for(8).unwrap().partition_count(), 2);
        assert_eq!(table.best_for(8).unwrap().mean_latency_s(8), 24.0);
        assert_eq!(table.best_for(1).unwrap().mean_latency_s(1), 17.0);
        assert_eq!(table.best_with_partitions(1, 8).unwrap().latency_s, 34.0);
    }
}

#[test]
fn t5_3b_like_partitioning_matches_the_thesis_scale() {
    let profile = synthetic_t5_3b_like(48);
    let n = profile.groups.len();
    let mem = 24 * 1_000_000_000;
    let link = 1.25e9;
    let full = optimal_plan(&profile, 1, mem, 1, link).unwrap();
    assert!((full.cold_start_s - T5_3B_COLD_START_S).abs() < 1e-6);
    // One partition per group: cold start ≈ 0.6 s (thesis: 25.97 s → 0.59 s with 55).
    let finest = optimal_plan(&profile, n, mem, 1, link).unwrap();
    assert!(
        (0.55..0.65).contains(&finest.cold_start_s),
        "{}",
        finest.cold_start_s
    );
    // Inference overhead scales with the cuts: 43.94% for 54 cuts.
    let overhead = finest.inference_s / full.inference_s - 1.0;
    let expect = 0.4394 * (n - 1) as f64 / 54.0;
    assert!((overhead - expect).abs() < 1e-3, "{overhead} vs {expect}");

    // With 64 GPUs, exponential search agrees with the exhaustive table up to 3000 requests.
    let fast = precompute(&profile, 64, mem, link, 3000).unwrap();
    let exact = precompute_exhaustive(&profile, 64, mem, link, 3000).unwrap();
    for x in 1..=3000 {
        let a = fast.best_for(x).unwrap().mean_latency_s(x);
        let b = exact.best_for(x).unwrap().mean_latency_s(x);
        assert!(a >= b - 1e-9);
        assert!(a - b < 0.05 * b, "x={x}: {a} vs {b}");
    }
    // A lone cold-started request is served far faster partitioned.
    let lone = exact.best_for(1).unwrap();
    assert!(lone.partition_count() > 1);
    assert!(lone.latency_s < 2.0, "{}", lone.latency_s);
    // Large bursts favour fewer partitions (more replicas, less transfer time).
    assert!(exact.best_for(3000).unwrap().partition_count() <= lone.partition_count());

    // Cost-optimal under an SLO: a 1.5 s SLO needs partitions; a 60 s SLO does not.
    let cost = CostModel::default();
    let tight = cost_optimal(&profile, 1.5, mem, link, 64, &cost).unwrap();
    assert!(tight.latency_s <= 1.5 && tight.partition_count() > 1);
    let loose = cost_optimal(&profile, 60.0, mem, link, 64, &cost).unwrap();
    assert_eq!(loose.partition_count(), 1);
    assert!(loose.cost(&cost) <= tight.cost(&cost));
    match cost_optimal(&profile, 0.1, mem, link, 64, &cost) {
        Err(NoPlan::SloUnreachable {
            best_latency_s,
            slo_s,
        }) => {
            assert_eq!(slo_s, 0.1);
            assert!((best_latency_s - finest.latency_s).abs() < 0.2);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn profile_from_tensors_groups_layers() {
    // Alphabetical order, as in a safetensors header: lm_head sorts first, layer 10 before 2.
    let mut tensors = vec![
        ("lm_head.weight".to_owned(), 1000),
        ("model.embed_tokens.weight".to_owned(), 1000),
        ("model.norm.weight".to_owned(), 8),
    ];
    for i in 0..12u64 {
        tensors.push((format!("model.layers.{i}.self_attn.q_proj.weight"), 100 + i));
        tensors.push((format!("model.layers.{i}.mlp.up_proj.weight"), 200));
    }
    tensors.sort();
    let bw = Bandwidths {
        load_bps: 100.0,
        exec_s_per_byte: 0.01,
        link_bps: 1.0,
    };
    let profile = profile_from_tensors("llama-ish", &tensors, &bw);
    let names: Vec<&str> = profile.groups.iter().map(|g| g.name.as_str()).collect();
    let mut expect = vec!["pre".to_owned()];
    expect.extend((0..12).map(|i| format!("model.layers.{i}")));
    expect.push("post".to_owned());
    assert_eq!(names, expect);
    assert_eq!(profile.groups[0].weight_bytes, 1000);
    assert_eq!(profile.groups[13].weight_bytes, 1008);
    for (i, g) in profile.groups[1..13].iter().enumerate() {
        assert_eq!(g.weight_bytes, 300 + i as u64);
        assert!((g.load_s - g.weight_bytes as f64 / 100.0).abs() < 1e-12);
        assert!((g.exec_s - g.weight_bytes as f64 * 0.01).abs() < 1e-12);
    }
    assert!(profile.estimated);
    assert!(profile.notes.iter().any(|n| n.contains("load_s")));
    assert!(profile.notes.iter().any(|n| n.contains("output_bytes")));
    assert_eq!(
        profile.total_bytes(),
        tensors.iter().map(|t| t.1).sum::<u64>()
    );
    profile.validate().unwrap();
    assert!(optimal_plan(&profile, 3, 10_000, 4, bw.link_bps).is_ok());

    // T5 names: encoder blocks before decoder blocks, shared embedding first.
    let t5 = [
        "decoder.block.0.layer.0.SelfAttention.q.weight",
        "decoder.block.1.layer.0.SelfAttention.q.weight",
        "decoder.final_layer_norm.weight",
        "encoder.block.0.layer.0.SelfAttention.q.weight",
        "encoder.block.1.layer.0.SelfAttention.q.weight",
        "encoder.final_layer_norm.weight",
        "shared.weight",
    ]
    .map(|n| (n.to_owned(), 10));
    let profile = profile_from_tensors("t5", &t5, &bw);
    let names: Vec<&str> = profile.groups.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "pre",
            "encoder.block.0",
            "encoder.block.1",
            "decoder.block.0",
            "decoder.block.1",
            "post"
        ]
    );

    // GPT-2 names.
    let gpt2 = [
        "transformer.h.0.attn.c_attn.weight",
        "transformer.wte.weight",
        "transformer.ln_f.weight",
    ]
    .map(|n| (n.to_owned(), 10));
    let profile = profile_from_tensors("gpt2", &gpt2, &bw);
    let names: Vec<&str> = profile.groups.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["pre", "transformer.h.0", "post"]);

    // Nothing given: an empty, invalid profile, no panic.
    let empty = profile_from_tensors("none", &[], &bw);
    assert!(empty.groups.is_empty());
    assert!(matches!(empty.validate(), Err(ProfileError::Empty { .. })));
}

#[test]
fn validation_and_input_errors() {
    let good = || ModelProfile {
        model: "m".to_owned(),
        groups: (0..3).map(|i| group(i, 60, 1.0, 1.0, 10)).collect(),
        estimated: false,
        notes: Vec::new(),
    };
    assert_eq!(good().validate(), Ok(()));
    for (load, exec, field) in [
        (f64::NAN, 1.0, "load_s"),
        (-1.0, 1.0, "load_s"),
        (1.0, f64::INFINITY, "exec_s"),
        (1.0, -0.5, "exec_s"),
    ] {
        let mut p = good();
        p.groups[1].load_s = load;
        p.groups[1].exec_s = exec;
        match p.validate() {
            Err(ProfileError::InvalidTime {
                index: 1, field: f, ..
            }) => assert_eq!(f, field),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            optimal_plan(&p, 1, 1000, 1, 1.0),
            Err(PartitionError::InvalidProfile(_))
        ));
    }
    let mut huge = good();
    huge.groups[0].load_s = f64::MAX;
    huge.groups[1].load_s = f64::MAX;
    assert!(matches!(
        huge.validate(),
        Err(ProfileError::TotalOverflow { .. })
    ));

    let p = good();
    for link in [0.0, -1.0, f64::NAN] {
        assert!(matches!(
            optimal_plan(&p, 1, 1000, 1, link),
            Err(PartitionError::InvalidLink(_))
        ));
    }
    assert_eq!(
        optimal_plan(&p, 0, 1000, 1, 1.0),
        Err(PartitionError::ZeroPartitions)
    );
    assert_eq!(
        optimal_plan(&p, 4, 1000, 1, 1.0),
        Err(PartitionError::TooManyPartitions {
            partitions: 4,
            groups: 3
        })
    );
    assert_eq!(
        optimal_plan_on_gpus(&p, 3, 2, 1000, 1, 1.0),
        Err(PartitionError::NotEnoughGpus {
            partitions: 3,
            gpus: 2
        })
    );
    assert!(matches!(
        optimal_plan(&p, 3, 59, 1, 1.0),
        Err(PartitionError::GroupTooLarge {
            index: 0,
            weight_bytes: 60,
            gpu_memory: 59,
            ..
        })
    ));
    assert_eq!(
        optimal_plan(&p, 1, 100, 1, 1.0),
        Err(PartitionError::NoFeasiblePlan {
            partitions: 1,
            gpu_memory: 100
        })
    );
    // Two partitions of at most 100 B: one holds two 60 B groups — infeasible; three fit.
    assert!(optimal_plan(&p, 2, 100, 1, 1.0).is_err());
    assert_eq!(
        optimal_plan(&p, 3, 100, 1, 1.0).unwrap().cuts,
        vec![0, 1, 2]
    );
    // Error messages are readable.
    let msg = optimal_plan(&p, 3, 59, 1, 1.0).unwrap_err().to_string();
    assert!(msg.contains("g0") && msg.contains("59"), "{msg}");
    // Cost-optimal: a plan needs at least one partition; nothing fits → Infeasible.
    assert!(matches!(
        cost_optimal(&p, 100.0, 1000, 1.0, 0, &CostModel::default()),
        Err(NoPlan::Infeasible(PartitionError::ZeroPartitions))
    ));
    assert!(matches!(
        cost_optimal(&p, 100.0, 100, 1.0, 2, &CostModel::default()),
        Err(NoPlan::Infeasible(PartitionError::NoFeasiblePlan { .. }))
    ));
    // precompute with zero partitions.
    assert_eq!(
        precompute(&p, 0, 1000, 1.0, 10),
        Err(PartitionError::ZeroPartitions)
    );
}

/// The thesis' exponential search (§4.2.2) assumes the best plan is constant between
/// probes; with ⌈y/r⌉ and different replica counts per partition count it can alternate
/// with the parity of the queue length. Two halves (1 s load, 2 s exec, 0.1 s transfer)
/// on 2 GPUs: the split wins at x = 1 and 3, the full model at 2 and 4.
#[test]
fn exponential_search_can_miss_parity_flips() {
    let profile = ModelProfile {
        model: "parity".to_owned(),
        groups: (0..2).map(|i| group(i, 1, 1.0, 2.0, 10)).collect(),
        estimated: false,
        notes: Vec::new(),
    };
    let link = 100.0; // 10 B in 0.1 s
    let exact = precompute_exhaustive(&profile, 2, 10, link, 4).unwrap();
    let parts: Vec<usize> = (1..=4)
        .map(|x| exact.best_for(x).unwrap().partition_count())
        .collect();
    assert_eq!(parts, [2, 1, 2, 1]);
    let fast = precompute(&profile, 2, 10, link, 4).unwrap();
    let parts: Vec<usize> = (1..=4)
        .map(|x| fast.best_for(x).unwrap().partition_count())
        .collect();
    assert_eq!(parts, [2, 1, 1, 1]);
}
