//! Torpor Algorithm 1 on a 4-GPU node shaped like Torpor's Fig. 5.

use shardcast_policies::evict::Heaviness;
use shardcast_policies::gpu_choice::{
    ChoiceSource, GpuChoice, GpuLoadState, GpuNode, Topology, choose_gpu,
};

const GB: u64 = 1 << 30;

/// Torpor Fig. 5: 4 V100s, GPUs {0, 1} on PCIe switch 0 and {2, 3} on switch 1, every pair
/// linked by NVLink at different speeds. The paper's text gives no figures, so the speeds are
/// those of NVLink 2.0 on V100: 25 GB/s per link, one or two links per pair.
fn fig5() -> Topology {
    let links = [
        (0, 1, 25.0),
        (0, 2, 25.0),
        (0, 3, 50.0),
        (1, 2, 50.0),
        (1, 3, 25.0),
        (2, 3, 50.0),
    ];
    let gpus = (0..4u32)
        .map(|i| GpuNode {
            index: i,
            pcie_switch: i / 2,
            nvlink: links
                .iter()
                .filter(|(a, _, _)| *a == i)
                .map(|(_, b, g)| (*b, *g))
                .collect(),
        })
        .collect();
    Topology { gpus }
}

fn gpu(i: u32, idle: bool, free_gb: u64, holds: &[&str]) -> GpuLoadState {
    GpuLoadState {
        gpu: i,
        idle,
        free_bytes: free_gb * GB,
        holds: holds.iter().map(|s| (*s).to_owned()).collect(),
        loading: None,
    }
}

fn loading(mut s: GpuLoadState, model: &str, h: Heaviness) -> GpuLoadState {
    s.loading = Some((model.to_owned(), h));
    s
}

fn choose(states: &[GpuLoadState]) -> Option<GpuChoice> {
    choose_gpu(&fig5(), states, "bert-qa", 2 * GB, Heaviness::Heavy)
}

#[test]
fn links_are_symmetric_and_switches_pair_up() {
    let t = fig5();
    assert_eq!(t.nvlink_gbps(3, 0), Some(50.0));
    assert_eq!(t.nvlink_gbps(0, 3), Some(50.0));
    assert_eq!(t.nvlink_gbps(1, 0), Some(25.0));
    assert_eq!(t.nvlink_gbps(1, 1), None);
    assert_eq!(t.pcie_neighbours(2), Some(vec![3]));
    assert_eq!(t.pcie_neighbours(9), None);
}

#[test]
fn rule1_idle_gpu_holding_the_model() {
    let states = [
        gpu(0, false, 8, &["bert-qa"]),
        gpu(1, true, 8, &[]),
        gpu(2, true, 0, &["bert-qa"]),
        gpu(3, true, 8, &["bert-qa"]),
    ];
    let c = choose(&states).unwrap();
    // Idle holders 2 and 3: lowest index; room is irrelevant, nothing is loaded.
    assert_eq!((c.gpu, c.source), (2, ChoiceSource::AlreadyHolds));
    assert!(c.reason.contains("rule 1"), "{}", c.reason);
}

#[test]
fn rule2_fastest_nvlink_from_a_busy_holder() {
    // GPU 0 holds it but is busy: 0→3 is the 50 GB/s link.
    let states = [
        gpu(0, false, 8, &["bert-qa"]),
        gpu(1, true, 8, &[]),
        gpu(2, true, 8, &[]),
        gpu(3, true, 8, &[]),
    ];
    let c = choose(&states).unwrap();
    assert_eq!(c.gpu, 3);
    assert_eq!(c.source, ChoiceSource::NvlinkFrom { gpu: 0, gbps: 50.0 });
    assert!(c.reason.contains("50 GB/s"), "{}", c.reason);

    // GPU 3 has no room: 0→1 and 0→2 are both 25 GB/s; the lowest target wins.
    let states = [
        gpu(0, false, 8, &["bert-qa"]),
        gpu(1, true, 8, &[]),
        gpu(2, true, 8, &[]),
        gpu(3, true, 1, &[]),
    ];
    let c = choose(&states).unwrap();
    assert_eq!(
        (c.gpu, c.source),
        (1, ChoiceSource::NvlinkFrom { gpu: 0, gbps: 25.0 })
    );
}

#[test]
fn rule2_ties_break_on_target_then_source() {
    // Holders 0 and 1 busy; targets 2 and 3. 50 GB/s pairs: 0→3 and 1→2 → target 2 wins.
    let states = [
        gpu(0, false, 8, &["bert-qa"]),
        gpu(1, false, 8, &["bert-qa"]),
        gpu(2, true, 8, &[]),
        gpu(3, true, 8, &[]),
    ];
    let c = choose(&states).unwrap();
    assert_eq!(
        (c.gpu, c.source),
        (2, ChoiceSource::NvlinkFrom { gpu: 1, gbps: 50.0 })
    );
    // Uniform links: same target from the lowest source.
    let mut flat = fig5();
    for n in &mut flat.gpus {
        for l in &mut n.nvlink {
            l.1 = 25.0;
        }
    }
    let c = choose_gpu(&flat, &states, "bert-qa", 2 * GB, Heaviness::Heavy).unwrap();
    assert_eq!(
        (c.gpu, c.source),
        (2, ChoiceSource::NvlinkFrom { gpu: 0, gbps: 25.0 })
    );
}

#[test]
fn holder_without_nvlink_falls_back_to_pcie() {
    let no_links = Topology {
        gpus: fig5()
            .gpus
            .into_iter()
            .map(|mut n| {
                n.nvlink.clear();
                n
            })
            .collect(),
    };
    let states = [
        gpu(0, false, 8, &["bert-qa"]),
        gpu(1, true, 8, &[]),
        gpu(2, true, 8, &[]),
        gpu(3, true, 8, &[]),
    ];
    let c = choose_gpu(&no_links, &states, "bert-qa", 2 * GB, Heaviness::Heavy).unwrap();
    assert_eq!((c.gpu, c.source), (1, ChoiceSource::Pcie));
    assert!(c.reason.contains("no NVLink"), "{}", c.reason);
}

#[test]
fn rule3_prefers_a_switch_with_no_load() {
    // GPU 0 is loading a heavy model: GPU 1 shares its switch; 2 and 3 do not → 2.
    let states = [
        loading(gpu(0, false, 8, &[]), "llama", Heaviness::Heavy),
        gpu(1, true, 8, &[]),
        gpu(2, true, 8, &[]),
        gpu(3, true, 8, &[]),
    ];
    let c = choose(&states).unwrap();
    assert_eq!((c.gpu, c.source), (2, ChoiceSource::Pcie));
    assert!(c.reason.contains("line 13"), "{}", c.reason);
    // Even a light load on the neighbour ranks below a quiet switch.
    let states = [
        loading(gpu(0, false, 8, &[]), "densenet", Heaviness::Light),
        gpu(1, true, 8, &[]),
        gpu(2, true, 8, &[]),
        gpu(3, true, 8, &[]),
    ];
    assert_eq!(choose(&states).unwrap().gpu, 2);
}

#[test]
fn rule3_then_a_neighbour_loading_only_light() {
    // Both switches busy: 0 loads heavy, 2 loads light → GPU 3 (neighbour 2 is light).
    let states = [
        loading(gpu(0, false, 8, &[]), "llama", Heaviness::Heavy),
        gpu(1, true, 8, &[]),
        loading(gpu(2, false, 8, &[]), "densenet", Heaviness::Light),
        gpu(3, true, 8, &[]),
    ];
    let c = choose(&states).unwrap();
    assert_eq!((c.gpu, c.source), (3, ChoiceSource::Pcie));
    assert!(c.reason.contains("line 15"), "{}", c.reason);
    // A medium load is not light.
    let states = [
        loading(gpu(0, false, 8, &[]), "resnet50", Heaviness::Medium),
        gpu(1, true, 8, &[]),
        loading(gpu(2, false, 8, &[]), "densenet", Heaviness::Light),
        gpu(3, true, 8, &[]),
    ];
    assert_eq!(choose(&states).unwrap().gpu, 3);
}

#[test]
fn rule4_any_idle_gpu_with_room() {
    let states = [
        loading(gpu(0, false, 8, &[]), "llama", Heaviness::Heavy),
        gpu(1, true, 8, &[]),
        gpu(2, true, 8, &[]),
        loading(gpu(3, false, 8, &[]), "resnet152", Heaviness::Medium),
    ];
    let c = choose(&states).unwrap();
    assert_eq!((c.gpu, c.source), (1, ChoiceSource::Pcie));
    assert!(c.reason.contains("line 17"), "{}", c.reason);
    // A GPU missing from the topology is usable, but only at this last rule.
    let states = [gpu(7, true, 8, &[]), gpu(3, true, 8, &[])];
    assert_eq!(choose(&states).unwrap().gpu, 3);
    let states = [gpu(7, true, 8, &[])];
    assert_eq!(choose(&states).unwrap().gpu, 7);
}

#[test]
fn nothing_fits_is_none() {
    // Every GPU busy.
    let busy = [
        gpu(0, false, 8, &["bert-qa"]),
        gpu(1, false, 8, &[]),
        gpu(2, false, 8, &[]),
        gpu(3, false, 8, &[]),
    ];
    assert_eq!(choose(&busy), None);
    // Idle GPUs, none with room.
    let full = [
        gpu(0, false, 8, &["bert-qa"]),
        gpu(1, true, 1, &[]),
        gpu(2, true, 0, &[]),
        gpu(3, true, 1, &[]),
    ];
    assert_eq!(choose(&full), None);
    assert_eq!(choose(&[]), None);
}
