//! Eviction: heaviness, Torpor's GPU evictor, the one-replica rule, host memory and disk
//! tiers, last-copy protection.

use proptest::prelude::*;
use shardcast_policies::evict::{
    ClusterCopies, DiskItem, EvictError, GpuModel, GpuState, Heaviness, HeavinessThresholds,
    TierItem, TierKind, choose_gpu_evictions, choose_memory_evictions, disk_watermark_evictions,
    disk_watermark_plan, heaviness, load_slowdown, one_replica_rule,
};

const GB: u64 = 1 << 30;

/// Plenty of copies: never protected.
const SAFE: ClusterCopies = ClusterCopies {
    copies_in_cluster: 3,
    registered: true,
    origin_available: true,
};
/// The last copy of a registered model whose origin is gone.
const LAST: ClusterCopies = ClusterCopies {
    copies_in_cluster: 1,
    registered: true,
    origin_available: false,
};

fn gm(model: &str, gb: u64, h: Heaviness, last_used_s: f64) -> GpuModel {
    GpuModel {
        model: model.to_owned(),
        bytes: gb * GB,
        heaviness: h,
        last_used_s,
        locked: false,
        replicas_on_host: 1,
        only_gpu_copy_in_cluster: false,
        copies: SAFE,
    }
}

fn gpu(index: u32, capacity_gb: u64, models: Vec<GpuModel>) -> GpuState {
    GpuState {
        gpu: index,
        capacity: capacity_gb * GB,
        models,
    }
}

#[test]
fn heaviness_from_pcie_slowdown() {
    let t = HeavinessThresholds::default();
    let pcie = 12e9; // ~PCIe 3.0 x16 effective
    // Bert-large ~1.34 GB, 43 ms (Torpor Table 4): 0.112 s / 0.043 s ≈ 2.6 → heavy.
    assert_eq!(heaviness(1_340_000_000, pcie, 0.043, &t), Heaviness::Heavy);
    // DenseNet-201 ~80 MB, 28 ms: ≈ 0.24 → light.
    assert_eq!(heaviness(80_000_000, pcie, 0.028, &t), Heaviness::Light);
    // ResNet-50 ~98 MB, 9 ms: ≈ 0.91 → medium.
    assert_eq!(heaviness(98_000_000, pcie, 0.009, &t), Heaviness::Medium);
    // Boundaries: exactly 0.5 is medium, exactly 1.0 is heavy.
    assert_eq!(heaviness(500, 1000.0, 1.0, &t), Heaviness::Medium);
    assert_eq!(heaviness(1000, 1000.0, 1.0, &t), Heaviness::Heavy);
    // Degenerate inputs: cautious answers, no panic.
    assert_eq!(heaviness(0, 0.0, 0.0, &t), Heaviness::Light);
    assert_eq!(heaviness(10, pcie, 0.0, &t), Heaviness::Heavy);
    assert_eq!(heaviness(10, 0.0, 1.0, &t), Heaviness::Heavy);
    assert_eq!(heaviness(10, f64::NAN, 1.0, &t), Heaviness::Heavy);
    assert!((load_slowdown(2000, 1000.0, 4.0) - 0.5).abs() < 1e-12);
    // Thresholds are configurable.
    let strict = HeavinessThresholds {
        light_below: 0.1,
        heavy_at_or_above: 0.2,
    };
    assert_eq!(
        heaviness(80_000_000, pcie, 0.028, &strict),
        Heaviness::Heavy
    );
}

/// A full 32 GB V100 (Torpor's testbed) holding a heavy/light mix.
fn torpor_mix() -> GpuState {
    let mut resnet_extra = gm("resnet152", 4, Heaviness::Heavy, 50.0);
    resnet_extra.replicas_on_host = 2;
    let mut bert_only = gm("bert-qa", 8, Heaviness::Heavy, 10.0);
    bert_only.only_gpu_copy_in_cluster = true;
    let bert_elsewhere = gm("bert-large", 8, Heaviness::Heavy, 20.0);
    gpu(
        0,
        32,
        vec![
            bert_only,
            gm("densenet201", 2, Heaviness::Light, 90.0),
            resnet_extra,
            gm("efficientnet", 1, Heaviness::Light, 70.0),
            gm("resnet50", 2, Heaviness::Medium, 5.0),
            bert_elsewhere,
            gm("inception", 3, Heaviness::Light, 95.0),
        ],
    )
}

#[test]
fn torpor_mix_evicts_light_and_extra_replicas_first_heavy_only_copy_last() {
    let st = torpor_mix();
    assert_eq!(st.free_bytes(), 4 * GB);
    // Need everything but what is left at the end: order is the whole ranking.
    let order = choose_gpu_evictions(&st, 32 * GB).expect("all evictable");
    assert_eq!(
        order,
        [
            // Class 1 (LRU): light models and the extra replica.
            "resnet152",
            "efficientnet",
            "densenet201",
            "inception",
            // Class 2: medium, heavy with a GPU copy elsewhere, heavy only copy.
            "resnet50",
            "bert-large",
            "bert-qa",
        ]
    );
    // A small request stops early: 4 GB free + 4 GB (resnet152 extra) ≥ 8 GB.
    assert_eq!(choose_gpu_evictions(&st, 8 * GB).unwrap(), ["resnet152"]);
    // 4 free + 4 + 1 + 2 = 11 ≥ 10.
    assert_eq!(
        choose_gpu_evictions(&st, 10 * GB).unwrap(),
        ["resnet152", "efficientnet", "densenet201"]
    );
    // Already fits: nothing to evict.
    assert!(choose_gpu_evictions(&st, 4 * GB).unwrap().is_empty());
}

#[test]
fn pure_light_heavy_mix_is_torpors_two_classes() {
    // Only light and heavy models, no cross-host copies: light LRU, then heavy LRU.
    let st = gpu(
        1,
        10,
        vec![
            gm("h-old", 3, Heaviness::Heavy, 1.0),
            gm("l-new", 2, Heaviness::Light, 9.0),
            gm("h-new", 3, Heaviness::Heavy, 8.0),
            gm("l-old", 2, Heaviness::Light, 2.0),
        ],
    );
    assert_eq!(
        choose_gpu_evictions(&st, 10 * GB).unwrap(),
        ["l-old", "l-new", "h-old", "h-new"]
    );
}

#[test]
fn locked_models_are_never_chosen() {
    let mut light = gm("light", 4, Heaviness::Light, 0.0);
    light.locked = true;
    let st = gpu(2, 10, vec![light, gm("heavy", 4, Heaviness::Heavy, 100.0)]);
    assert_eq!(choose_gpu_evictions(&st, 6 * GB).unwrap(), ["heavy"]);
    let err = choose_gpu_evictions(&st, 10 * GB).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("GPU 2"), "{msg}");
    assert!(msg.contains("light (locked"), "{msg}");
}

#[test]
fn last_copy_protection_on_gpu() {
    let mut last = gm("only", 4, Heaviness::Light, 0.0);
    last.copies = LAST;
    let st = gpu(
        0,
        8,
        vec![last.clone(), gm("other", 4, Heaviness::Heavy, 5.0)],
    );
    // The light model goes first normally, but it is the last copy and the origin is gone.
    assert_eq!(choose_gpu_evictions(&st, 4 * GB).unwrap(), ["other"]);
    let err = choose_gpu_evictions(&st, 8 * GB).unwrap_err();
    assert!(
        matches!(&err, EvictError::Insufficient { evictable_bytes, .. } if *evictable_bytes == 4 * GB)
    );
    assert!(err.to_string().contains("only (last copy"), "{err}");

    // The origin can serve it again: evictable, light first.
    last.copies.origin_available = true;
    let st = gpu(
        0,
        8,
        vec![last.clone(), gm("other", 4, Heaviness::Heavy, 5.0)],
    );
    assert_eq!(choose_gpu_evictions(&st, 4 * GB).unwrap(), ["only"]);
    // Unregistered: nobody will call it; evictable.
    last.copies = ClusterCopies {
        registered: false,
        ..LAST
    };
    let st = gpu(0, 8, vec![last, gm("other", 4, Heaviness::Heavy, 5.0)]);
    assert_eq!(choose_gpu_evictions(&st, 4 * GB).unwrap(), ["only"]);
}

#[test]
fn impossible_gpu_request_is_a_clear_error() {
    let st = torpor_mix();
    let err = choose_gpu_evictions(&st, 40 * GB).unwrap_err();
    assert_eq!(
        err,
        EvictError::LargerThanTier {
            tier: "GPU 0".to_owned(),
            need_bytes: 40 * GB,
            capacity: 32 * GB
        }
    );
    assert!(
        err.to_string().contains("only 34359738368 bytes in all"),
        "{err}"
    );
}

#[test]
fn one_replica_rule_applies_once_memory_is_full() {
    let mut a0 = gm("a", 4, Heaviness::Heavy, 10.0);
    a0.replicas_on_host = 3;
    let mut a1 = a0.clone();
    a1.last_used_s = 30.0;
    let mut a2 = a0.clone();
    a2.last_used_s = 20.0;
    let mut b1 = gm("b", 4, Heaviness::Light, 5.0);
    b1.replicas_on_host = 2;
    let mut b2 = b1.clone();
    b2.locked = true;
    let full = vec![
        gpu(0, 8, vec![a0.clone(), gm("c", 4, Heaviness::Light, 1.0)]),
        gpu(1, 8, vec![a1.clone(), b1.clone()]),
        gpu(2, 8, vec![a2.clone(), b2.clone()]),
    ];
    // Keep the most recent "a" (GPU 1) and the locked "b" (GPU 2).
    assert_eq!(
        one_replica_rule(&full),
        [
            (0, "a".to_owned()),
            (1, "b".to_owned()),
            (2, "a".to_owned())
        ]
    );

    // GPU 2 has room for the smallest resident model: not full, nothing to do.
    let roomy = vec![
        gpu(0, 8, vec![a0, gm("c", 4, Heaviness::Light, 1.0)]),
        gpu(1, 8, vec![a1, b1]),
        gpu(2, 12, vec![a2, b2]),
    ];
    assert!(one_replica_rule(&roomy).is_empty());
    assert!(one_replica_rule(&[]).is_empty());
}

#[test]
fn one_replica_rule_tie_keeps_lowest_gpu() {
    let a = gm("a", 8, Heaviness::Heavy, 7.0);
    let host = vec![
        gpu(3, 8, vec![a.clone()]),
        gpu(1, 8, vec![a.clone()]),
        gpu(2, 8, vec![a]),
    ];
    assert_eq!(
        one_replica_rule(&host),
        [(2, "a".to_owned()), (3, "a".to_owned())]
    );
}

fn item(model: &str, gb: u64, last: f64, kind: TierKind) -> TierItem {
    TierItem {
        model: model.to_owned(),
        bytes: gb * GB,
        last_used_s: last,
        pinned: false,
        kind,
        copies: SAFE,
    }
}

#[test]
fn memory_tier_evicts_model_data_before_process_memory_lru() {
    let mut pinned = item("pinned-old", 4, 0.0, TierKind::ModelData);
    pinned.pinned = true;
    let mut last = item("last-copy", 4, 1.0, TierKind::ModelData);
    last.copies = LAST;
    let mut proc_last = item("proc-last", 2, 0.5, TierKind::ProcessMemory);
    // Process memory is not a copy of the weights: protection does not apply.
    proc_last.copies = LAST;
    let items = vec![
        item("proc-old", 2, 3.0, TierKind::ProcessMemory),
        item("data-new", 4, 50.0, TierKind::ModelData),
        pinned,
        item("data-old", 4, 10.0, TierKind::ModelData),
        last,
        proc_last,
    ];
    assert_eq!(
        choose_memory_evictions(&items, 8 * GB).unwrap(),
        ["data-old", "data-new"]
    );
    assert_eq!(
        choose_memory_evictions(&items, 11 * GB).unwrap(),
        ["data-old", "data-new", "proc-last", "proc-old"]
    );
    assert!(choose_memory_evictions(&items, 0).unwrap().is_empty());
    let err = choose_memory_evictions(&items, 13 * GB).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("host memory"), "{msg}");
    assert!(msg.contains("pinned-old (pinned"), "{msg}");
    assert!(msg.contains("last-copy (last copy"), "{msg}");
    assert!(matches!(
        err,
        EvictError::Insufficient { evictable_bytes, .. } if evictable_bytes == 12 * GB
    ));
    // More than the whole tier holds.
    assert!(choose_memory_evictions(&items, 100 * GB).is_err());
}

fn disk(model: &str, gb: u64, last: f64) -> DiskItem {
    DiskItem {
        model: model.to_owned(),
        bytes: gb * GB,
        last_used_s: last,
        pinned: false,
        copies: SAFE,
    }
}

#[test]
fn disk_watermarks() {
    let items = vec![
        disk("d", 10, 40.0),
        disk("a", 10, 10.0),
        disk("c", 10, 30.0),
        disk("b", 10, 20.0),
    ];
    // 40 of 100 GB used, high 0.9: nothing.
    assert!(disk_watermark_evictions(&items, 40 * GB, 100 * GB, 0.9, 0.7).is_empty());
    // 40 of 42 GB (> 0.9·42 = 37.8): evict LRU until ≤ 0.5·42 = 21 → a, b.
    assert_eq!(
        disk_watermark_evictions(&items, 40 * GB, 42 * GB, 0.9, 0.5),
        ["a", "b"]
    );
    // Exactly at the high watermark is not above it.
    assert!(disk_watermark_evictions(&items, 40 * GB, 50 * GB, 0.8, 0.5).is_empty());

    // Pinned and protected items are skipped with a reason.
    let mut a = disk("a", 10, 10.0);
    a.pinned = true;
    let mut b = disk("b", 10, 20.0);
    b.copies = LAST;
    let items = vec![a, b, disk("c", 10, 30.0), disk("d", 10, 40.0)];
    let plan = disk_watermark_plan(&items, 40 * GB, 42 * GB, 0.9, 0.5);
    assert_eq!(plan.evict, ["c", "d"]);
    assert_eq!(plan.freed_bytes, 20 * GB);
    assert_eq!(plan.skipped.len(), 2);
    assert!(plan.skipped[0].1.contains("pinned"));
    assert!(plan.skipped[1].1.contains("last copy"));
    assert!(plan.reaches_low);
    // Low watermark out of reach: best effort, flagged.
    let plan = disk_watermark_plan(&items, 40 * GB, 42 * GB, 0.9, 0.1);
    assert_eq!(plan.evict, ["c", "d"]);
    assert!(!plan.reaches_low);
}

proptest! {
    /// The GPU evictor frees enough when it succeeds, never picks locked or protected
    /// models, and fails only when even evicting every allowed model is not enough.
    #[test]
    fn gpu_evictions_are_sufficient_and_allowed(
        models in proptest::collection::vec(
            (1u64..8, 0u8..3, 0.0f64..100.0, any::<bool>(), 1u32..3, any::<bool>(), any::<bool>()),
            0..8,
        ),
        need in 0u64..40,
    ) {
        let models: Vec<GpuModel> = models
            .into_iter()
            .enumerate()
            .map(|(i, (gb, h, last, locked, reps, only, protected))| GpuModel {
                model: format!("m{i}"),
                bytes: gb * GB,
                heaviness: [Heaviness::Light, Heaviness::Medium, Heaviness::Heavy][usize::from(h)],
                last_used_s: last,
                locked,
                replicas_on_host: reps,
                only_gpu_copy_in_cluster: only,
                copies: if protected { LAST } else { SAFE },
            })
            .collect();
        let used: u64 = models.iter().map(|m| m.bytes).sum();
        let st = GpuState { gpu: 0, capacity: used.max(32 * GB), models };
        let need = need * GB;
        let allowed: u64 = st.models.iter()
            .filter(|m| !m.locked && !m.copies.protects())
            .map(|m| m.bytes)
            .sum();
        match choose_gpu_evictions(&st, need) {
            Ok(names) => {
                let freed: u64 = st.models.iter().filter(|m| names.contains(&m.model)).map(|m| m.bytes).sum();
                prop_assert!(st.free_bytes() + freed >= need);
                for n in &names {
                    let m = st.models.iter().find(|m| &m.model == n).unwrap();
                    prop_assert!(!m.locked && !m.copies.protects());
                }
            }
            Err(_) => prop_assert!(need > st.capacity || st.free_bytes() + allowed < need),
        }
    }
}
