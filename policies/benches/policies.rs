//! Decision latency of the controller's policies (criterion):
//! * the partition DP for a 55-layer T5-3B-like profile with P = 64 (target < 50 ms), and
//!   the table of plans per queue length;
//! * eviction and GPU-choice decisions at the scale of 1000 hosts: a whole-cluster sweep
//!   (one decision per host) and single decisions (target: median < 1 ms per decision).

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use shardcast_policies::evict::{
    ClusterCopies, GpuModel, GpuState, Heaviness, TierItem, TierKind, choose_gpu_evictions,
    choose_memory_evictions,
};
use shardcast_policies::gpu_choice::{GpuLoadState, GpuNode, Topology, choose_gpu};
use shardcast_policies::partition;
use shardcast_policies::profile::{Bandwidths, synthetic_t5_3b_like};

/// A deterministic LCG.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn copies(n: u32) -> ClusterCopies {
    ClusterCopies {
        copies_in_cluster: n,
        registered: true,
        origin_available: n % 3 != 0,
    }
}

fn gpu_state(rng: &mut Lcg, gpu: u32) -> GpuState {
    let models = (0..24)
        .map(|m| GpuModel {
            model: format!("m{}", rng.next() % 100),
            bytes: (1 + rng.next() % 8) << 30,
            heaviness: match rng.next() % 3 {
                0 => Heaviness::Light,
                1 => Heaviness::Medium,
                _ => Heaviness::Heavy,
            },
            last_used_s: (rng.next() % 10_000) as f64,
            locked: m % 11 == 0,
            replicas_on_host: 1 + (rng.next() % 3) as u32,
            only_gpu_copy_in_cluster: rng.next() % 4 == 0,
            copies: copies(1 + (rng.next() % 4) as u32),
        })
        .collect();
    GpuState {
        gpu,
        capacity: 80 << 30,
        models,
    }
}

fn benches(c: &mut Criterion) {
    let t5 = synthetic_t5_3b_like(55);
    let link = Bandwidths::default().link_bps;
    // p = 32 exactly (the DP for one partition count); the table below covers every p ≤ 64.
    assert!(partition::optimal_plan(&t5, 32, 16 << 30, 8, link).is_ok());
    assert!(partition::precompute(&t5, 64, 16 << 30, link, 64).is_ok());
    c.bench_function("partition/optimal_plan_t5_55_layers_p32", |b| {
        b.iter(|| partition::optimal_plan(black_box(&t5), 32, 16 << 30, 8, link))
    });
    c.bench_function("partition/precompute_t5_55_layers_p64_queue64", |b| {
        b.iter(|| partition::precompute(black_box(&t5), 64, 16 << 30, link, 64))
    });

    let mut rng = Lcg(42);
    // 1000 hosts × 8 GPUs of 24 models each; 1000 hosts' memory tiers of 64 items each.
    let gpus: Vec<GpuState> = (0..8000)
        .map(|i| gpu_state(&mut rng, (i % 8) as u32))
        .collect();
    let tiers: Vec<Vec<TierItem>> = (0..1000)
        .map(|_| {
            (0..64)
                .map(|i| TierItem {
                    model: format!("m{i}"),
                    bytes: (1 + rng.next() % 16) << 30,
                    last_used_s: (rng.next() % 10_000) as f64,
                    pinned: rng.next() % 10 == 0,
                    kind: if i % 8 == 0 {
                        TierKind::ProcessMemory
                    } else {
                        TierKind::ModelData
                    },
                    copies: copies(1 + (rng.next() % 4) as u32),
                })
                .collect()
        })
        .collect();
    c.bench_function("evict/gpu_one_decision", |b| {
        b.iter(|| choose_gpu_evictions(black_box(&gpus[7]), 20 << 30))
    });
    c.bench_function("evict/gpu_sweep_1000_hosts_8_gpus", |b| {
        b.iter(|| {
            gpus.iter()
                .filter(|g| choose_gpu_evictions(g, 20 << 30).is_ok())
                .count()
        })
    });
    c.bench_function("evict/memory_sweep_1000_hosts", |b| {
        b.iter(|| {
            tiers
                .iter()
                .filter(|t| choose_memory_evictions(t, 64 << 30).is_ok())
                .count()
        })
    });
    // Torpor-like 4-GPU hosts: two PCIe switches, NVLink between pairs.
    let topo = Topology {
        gpus: (0..4)
            .map(|i| GpuNode {
                index: i,
                pcie_switch: i / 2,
                nvlink: (0..4)
                    .filter(|&j| j != i)
                    .map(|j| (j, if (i + j) % 3 == 0 { 50.0 } else { 25.0 }))
                    .collect(),
            })
            .collect(),
    };
    let hosts: Vec<Vec<GpuLoadState>> = (0..1000)
        .map(|_| {
            (0..4)
                .map(|g| GpuLoadState {
                    gpu: g,
                    idle: rng.next() % 2 == 0,
                    free_bytes: (rng.next() % 40) << 30,
                    holds: (0..(rng.next() % 4))
                        .map(|k| format!("m{}", (k * 7 + g as u64) % 20))
                        .collect(),
                    loading: (rng.next() % 3 == 0).then(|| ("m1".to_string(), Heaviness::Heavy)),
                })
                .collect()
        })
        .collect();
    c.bench_function("gpu_choice/one_decision", |b| {
        b.iter(|| choose_gpu(black_box(&topo), &hosts[3], "m7", 8 << 30, Heaviness::Heavy))
    });
    c.bench_function("gpu_choice/sweep_1000_hosts", |b| {
        b.iter(|| {
            hosts
                .iter()
                .filter(|h| choose_gpu(&topo, h, "m7", 8 << 30, Heaviness::Heavy).is_some())
                .count()
        })
    });
}

criterion_group!(policies, benches);
criterion_main!(policies);
