//! Placement + chain planning latency on a datacenter-sized cluster view.
//!
//! 1000 hosts in 40 racks, 8 GPUs each, 100 models; each model is held by a seeded
//! pseudo-random subset of 3..10 hosts in memory, on disk or both (a small LCG, no `rand`).
//! Times [`plan`] for 32 GPU replicas, 64 memory replicas and 16 named hosts. The design
//! target is a median well under 1 ms (docs: "placement + chain plan for 1000 hosts").
//!
//! Run: `cargo bench -p shardcast-placement --bench placement`

use std::collections::HashMap;
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use shardcast_placement::{Held, HostInfo, ModelSpec, PlanParams, PlanRequest, Target, Tier, plan};

const HOSTS: usize = 1000;
const RACKS: usize = 40;
const MODELS: usize = 100;
const GIB: u64 = 1 << 30;

/// Knuth's MMIX LCG; the high bits are the usable ones.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn model_key(rng: &mut Lcg) -> String {
    (0..4)
        .map(|_| format!("{:016x}", rng.next() << 31 ^ rng.next()))
        .collect()
}

fn build() -> (Vec<HostInfo>, Vec<ModelSpec>) {
    let mut rng = Lcg(0x5eed);
    let mut hosts: Vec<HostInfo> = (0..HOSTS)
        .map(|i| HostInfo {
            id: format!("host-{i:04}"),
            rack: format!("rack-{:02}", i % RACKS),
            zone: format!("zone-{}", i % 4),
            up: rng.below(100) != 0,
            nic_bps: if i % 10 == 0 { 0 } else { 25_000_000_000 / 8 },
            mem_capacity: 1024 * GIB,
            mem_free: (200 + rng.below(800)) * GIB,
            disk_capacity: 8192 * GIB,
            disk_free: (1000 + rng.below(7000)) * GIB,
            gpus: 8,
            gpus_free: rng.below(9) as u32,
            holdings: HashMap::new(),
        })
        .collect();
    let models: Vec<ModelSpec> = (0..MODELS)
        .map(|_| {
            let shards = 2 + rng.below(7) as usize;
            ModelSpec {
                key: model_key(&mut rng),
                shard_bytes: (0..shards).map(|_| GIB + rng.below(GIB)).collect(),
                chunk_size: 4 << 20,
            }
        })
        .collect();
    for m in &models {
        let holders = 3 + rng.below(8);
        for _ in 0..holders {
            let h = rng.below(HOSTS as u64) as usize;
            let (memory, disk) = match rng.below(3) {
                0 => (true, false),
                1 => (false, true),
                _ => (true, true),
            };
            hosts[h].holdings.insert(
                m.key.clone(),
                Held {
                    memory,
                    disk,
                    receiving: false,
                },
            );
        }
    }
    (hosts, models)
}

fn bench_plan(c: &mut Criterion) {
    let (cluster, models) = build();
    let params = PlanParams::default();
    let named: Vec<String> = (0..16).map(|i| format!("host-{:04}", 7 + i * 61)).collect();

    // The GPU case uses the model with the fewest memory holders, so that stage 2 (one GPU
    // on each new host) and chain planning do real work rather than stage 1 alone.
    let memory_holders = |m: &ModelSpec| {
        cluster
            .iter()
            .filter(|h| h.holdings.get(&m.key).is_some_and(|x| x.memory))
            .count()
    };
    let sparse = models
        .iter()
        .min_by_key(|m| memory_holders(m))
        .expect("MODELS > 0");

    let cases = [
        (
            "plan/gpu_32_replicas",
            sparse,
            Target::Replicas(32),
            Tier::Gpu,
        ),
        (
            "plan/memory_64_replicas",
            &models[1],
            Target::Replicas(64),
            Tier::Memory,
        ),
        (
            "plan/named_16_hosts",
            &models[2],
            Target::Hosts(named),
            Tier::Memory,
        ),
    ];
    // Worst case for source ranking: a model on every host's disk, wanted in memory, so
    // every host not chosen is a candidate source.
    let mut wide_cluster = cluster.clone();
    let wide = ModelSpec {
        key: "wide".to_owned(),
        ..models[3].clone()
    };
    for h in &mut wide_cluster {
        h.holdings.insert(
            wide.key.clone(),
            Held {
                memory: false,
                disk: true,
                receiving: false,
            },
        );
    }

    let cases = cases
        .into_iter()
        .map(|(n, m, t, tier)| (n, m, t, tier, &cluster))
        .chain([(
            "plan/memory_64_replicas_on_every_disk",
            &wide,
            Target::Replicas(64),
            Tier::Memory,
            &wide_cluster,
        )]);
    for (name, model, target, tier, cluster) in cases {
        let req = PlanRequest {
            model,
            target,
            tier,
            in_flight: &[],
        };
        // Fail loudly (and show the plan's shape) rather than time an error path.
        let p = plan(cluster, &req, &params).expect("bench request is satisfiable");
        eprintln!(
            "{name}: {} receivers ({} new), {} chains, estimate {:.2} s",
            p.receivers.len(),
            p.new_receivers().count(),
            p.chains.len(),
            p.estimate_s
        );
        c.bench_function(name, |b| {
            b.iter(|| {
                plan(
                    black_box(cluster.as_slice()),
                    black_box(&req),
                    black_box(&params),
                )
            })
        });
    }
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
