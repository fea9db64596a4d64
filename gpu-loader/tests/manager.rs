//! The GPU manager's policies on simulated devices: eviction to make room (light models
//! before heavy ones, loading models never) and interference-aware GPU choice over a
//! topology of PCIe-switch pairs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_loader::loader::LoadOptions;
use gpu_loader::manager::{
    BackendChoice, GpuManager, LoadRequest, LoadState, ManagerConfig, ManagerError,
};
use gpu_loader::pool::PoolError;
use gpu_loader::sim::SimOptions;
use gpu_loader::source::PacedSource;
use shardcast_policies::evict::Heaviness;

const MIB: usize = 1 << 20;

fn manager(dir: &std::path::Path, gpus: u32, memory: u64) -> Arc<GpuManager> {
    let mut sim = SimOptions::new(dir, gpus, memory);
    sim.pcie_bps = 0; // unpaced: these tests are about decisions, not rates
    sim.nvlink_bps = 0;
    Arc::new(GpuManager::open(&ManagerConfig {
        backend: BackendChoice::Simulated(sim),
        budget_fraction: 1.0,
        load: LoadOptions {
            staging_buffers: 2,
            staging_size: MIB,
            chunk_timeout: Duration::from_secs(5),
            ..Default::default()
        },
        ..Default::default()
    }))
}

fn source(bytes: usize, seed: u8) -> Arc<PacedSource> {
    PacedSource::new(
        vec![(format!("w{seed}.bin"), vec![seed; bytes])],
        MIB as u32,
    )
}

fn request(model: &str, heaviness: Heaviness, gpus: &[u32]) -> LoadRequest {
    LoadRequest {
        model: model.into(),
        name: model.into(),
        count: 1,
        gpus: gpus.to_vec(),
        files: Vec::new(),
        partition: None,
        heaviness,
    }
}

fn until_resident(m: &GpuManager, model: &str) {
    let t0 = Instant::now();
    loop {
        let st = m.model_status(model).expect("model known");
        match st.state {
            LoadState::Resident => return,
            LoadState::Failed(e) => panic!("{model} failed: {e}"),
            _ => {}
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{st:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn load_now(m: &Arc<GpuManager>, model: &str, h: Heaviness, bytes: usize, seed: u8) -> Vec<u32> {
    let src = source(bytes, seed);
    src.deliver(0, None);
    let gpus = m.start(request(model, h, &[0]), src).unwrap();
    until_resident(m, model);
    gpus
}

#[test]
fn a_full_gpu_evicts_the_light_model_before_an_older_heavy_one() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(dir.path(), 1, 100 * MIB as u64);
    // The heavy model is loaded first and never used again: older in LRU terms.
    load_now(&m, "heavy", Heaviness::Heavy, 40 * MIB, 1);
    load_now(&m, "light", Heaviness::Light, 40 * MIB, 2);
    m.handoff("light").unwrap(); // used recently
    // A third model does not fit: the light one goes, recency notwithstanding.
    load_now(&m, "new", Heaviness::Medium, 40 * MIB, 3);
    let ev = m.evictions();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].model, "light");
    assert!(ev[0].reason.contains("light"), "{}", ev[0].reason);
    assert!(m.model_status("light").is_none());
    assert_eq!(m.model_status("heavy").unwrap().state, LoadState::Resident);
    // The region the new model got holds its bytes.
    let h = m.handoff("new").unwrap();
    assert_eq!(h.devices.len(), 1);
}

#[test]
fn a_loading_model_is_never_evicted_and_the_error_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(dir.path(), 1, 100 * MIB as u64);
    // Never delivered: this load stays in flight.
    let stuck = source(60 * MIB, 1);
    m.start(request("stuck", Heaviness::Light, &[0]), stuck.clone())
        .unwrap();
    let src = source(60 * MIB, 2);
    src.deliver(0, None);
    let e = m
        .start(request("other", Heaviness::Heavy, &[0]), src)
        .unwrap_err();
    assert!(matches!(e, ManagerError::Pool(PoolError::Gpu(_))), "{e:?}");
    assert!(m.evictions().is_empty());
    assert_eq!(m.model_status("stuck").unwrap().state, LoadState::Loading);
    assert!(
        m.model_status("other").is_none(),
        "a refused load reserves nothing"
    );
    m.abort("stuck", "test over");
}

#[test]
fn gpu_choice_avoids_the_pcie_neighbour_of_a_heavy_load() {
    let dir = tempfile::tempdir().unwrap();
    // Four GPUs, PCIe switches (0, 1) and (2, 3), as in Torpor's testbed.
    let m = manager(dir.path(), 4, 100 * MIB as u64);
    let devs = m.devices();
    assert_eq!(devs[0].pcie_switch, devs[1].pcie_switch);
    assert_ne!(devs[1].pcie_switch, devs[2].pcie_switch);
    // A heavy model loading on GPU 0 (kept in flight).
    let stuck = source(8 * MIB, 1);
    m.start(request("heavy", Heaviness::Heavy, &[0]), stuck)
        .unwrap();
    // The next model goes to the other switch: GPU 1 shares GPU 0's PCIe switch.
    let src = source(4 * MIB, 2);
    src.deliver(0, None);
    let chosen = m
        .start(request("next", Heaviness::Medium, &[]), src)
        .unwrap();
    assert_eq!(chosen.len(), 1);
    assert!(
        chosen[0] == 2 || chosen[0] == 3,
        "chose GPU {} next to a heavy load",
        chosen[0]
    );
    m.abort("heavy", "test over");
}
