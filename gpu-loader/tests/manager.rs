//! The GPU manager on simulated devices: memory taken per model on demand within the budget
//! (nothing at start, freed on eviction, refusals leave nothing behind), eviction to make
//! room (light models before heavy ones, loading models never) and interference-aware GPU
//! choice over a topology of PCIe-switch pairs.

use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_loader::device::{GpuError, IpcHandle};
use gpu_loader::loader::LoadOptions;
use gpu_loader::manager::{
    BackendChoice, GpuBudget, GpuManager, LoadRequest, LoadState, ManagerConfig, ManagerError,
};
use gpu_loader::pool::{GpuPool, PoolError};
use gpu_loader::sim::{SimDevice, SimOptions};
use gpu_loader::source::PacedSource;
use shardcast_policies::evict::Heaviness;

const MIB: usize = 1 << 20;

fn manager(dir: &std::path::Path, gpus: u32, memory: u64) -> Arc<GpuManager> {
    manager_with(dir, gpus, memory, GpuBudget::Fraction(1.0), true)
}

fn manager_with(
    dir: &std::path::Path,
    gpus: u32,
    memory: u64,
    budget: GpuBudget,
    auto_evict: bool,
) -> Arc<GpuManager> {
    let mut sim = SimOptions::new(dir, gpus, memory);
    sim.pcie_bps = 0; // unpaced: these tests are about decisions, not rates
    sim.nvlink_bps = 0;
    Arc::new(GpuManager::open(&ManagerConfig {
        backend: BackendChoice::Simulated(sim),
        budget,
        auto_evict,
        load: LoadOptions {
            staging_buffers: 2,
            staging_size: MIB,
            chunk_timeout: Duration::from_secs(5),
            ..Default::default()
        },
        ..Default::default()
    }))
}

/// Bytes of device memory the manager's GPU `gpu` has allocated.
fn allocated(m: &GpuManager, gpu: u32) -> u64 {
    m.device(gpu).unwrap().allocated_bytes()
}

/// Bytes of host memory the simulated GPUs' files in `dir` really hold.
fn held(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().blocks() * 512)
        .sum()
}

/// The simulated device behind GPU `gpu`.
fn sim(m: &GpuManager, gpu: u32) -> Arc<dyn gpu_loader::device::Device> {
    let d = m.device(gpu).unwrap();
    assert!(d.as_any().downcast_ref::<SimDevice>().is_some());
    d
}

fn set_external_use(m: &GpuManager, gpu: u32, bytes: u64) {
    sim(m, gpu)
        .as_any()
        .downcast_ref::<SimDevice>()
        .unwrap()
        .set_external_use(bytes);
}

fn charge(bytes: usize) -> u64 {
    GpuPool::charge(bytes as u64).unwrap()
}

/// The device bytes a model of these shards takes: its layout's size, charged.
fn region_of(shards: &[Vec<u8>]) -> u64 {
    let layout = gpu_loader::index::Layout::new(
        &shards
            .iter()
            .enumerate()
            .map(|(i, d)| (i.to_string(), d.len() as u64))
            .collect::<Vec<_>>(),
    );
    GpuPool::charge(layout.total).unwrap()
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
fn a_heavy_model_with_a_gpu_copy_elsewhere_goes_before_the_only_one_while_that_holds() {
    for (valid_for, victim) in [
        // The controller said `copied` is resident on another host's GPUs: it goes first,
        // though `only` is older.
        (Duration::from_secs(60), "copied"),
        // Stale (the controller went silent): both count as the only copy, LRU decides.
        (Duration::ZERO, "only"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let m = manager(dir.path(), 1, 100 * MIB as u64);
        load_now(&m, "only", Heaviness::Heavy, 40 * MIB, 1);
        load_now(&m, "copied", Heaviness::Heavy, 40 * MIB, 2);
        m.handoff("copied").unwrap(); // used recently
        m.set_gpu_copies_elsewhere(["copied".to_string(), "absent".to_string()], valid_for);
        assert_eq!(m.gpu_copy_elsewhere("copied"), !valid_for.is_zero());
        assert!(!m.gpu_copy_elsewhere("only"));
        load_now(&m, "new", Heaviness::Medium, 40 * MIB, 3);
        let ev = m.evictions();
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert_eq!(ev[0].model, victim, "{ev:?}");
        assert!(m.model_status(victim).is_none());
    }
}

#[test]
fn a_gpu_that_other_processes_mostly_hold_is_busy_unless_it_holds_a_model_of_ours() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(dir.path(), 2, 100 * MIB as u64);
    assert!(m.busy_gpus().is_empty());
    // The manager's own region, however large, is not another process's; and an engine on
    // a GPU that holds a model of ours serves that replica (its reservation counts it).
    load_now(&m, "mine", Heaviness::Medium, 40 * MIB, 1);
    assert!(m.busy_gpus().is_empty(), "{:?}", m.pools());
    set_external_use(&m, 0, 55 * MIB as u64);
    assert!(m.busy_gpus().is_empty(), "{:?}", m.pools());
    // An engine holding 40% of the empty GPU 1: not yet busy; 60%: busy.
    set_external_use(&m, 1, 40 * MIB as u64);
    assert!(m.busy_gpus().is_empty());
    set_external_use(&m, 1, 60 * MIB as u64);
    assert_eq!(m.busy_gpus(), [1]);
    set_external_use(&m, 1, 0);
    assert!(m.busy_gpus().is_empty());
}

#[test]
fn a_new_model_goes_to_a_gpu_that_is_not_busy_and_to_a_busy_one_only_when_nothing_else_fits() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(dir.path(), 2, 100 * MIB as u64);
    // An engine holds 55% of GPU 0 (busy, 45 MiB free); GPU 1 is empty. Without the
    // preference, Algorithm 1 would take the lower index.
    set_external_use(&m, 0, 55 * MIB as u64);
    assert_eq!(m.busy_gpus(), [0]);
    let load = |name: &str, bytes: usize, seed: u8| {
        let src = source(bytes, seed);
        src.deliver(0, None);
        let gpus = m.start(request(name, Heaviness::Medium, &[]), src).unwrap();
        until_resident(&m, name);
        gpus
    };
    assert_eq!(load("second", 20 * MIB, 2), [1]);
    // Another engine takes 45% of GPU 1 (not busy: under half). A 40 MiB model fits only
    // the busy GPU 0 (45 MiB free; GPU 1 has 35): it goes there rather than being refused.
    set_external_use(&m, 1, 45 * MIB as u64);
    assert_eq!(m.busy_gpus(), [0]);
    assert_eq!(load("third", 40 * MIB, 3), [0]);
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
    assert!(
        matches!(e, ManagerError::Pool(PoolError::OverBudget { .. })),
        "{e:?}"
    );
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

/// Two shards of distinct bytes (so offsets in the region matter).
fn two_shard_source(a: usize, b: usize, seed: u8) -> (Arc<PacedSource>, Vec<Vec<u8>>) {
    let shards: Vec<Vec<u8>> = [(a, 0u8), (b, 1u8)]
        .iter()
        .map(|&(n, k)| {
            (0..n)
                .map(|i| ((i * 7 + usize::from(seed) * 31 + usize::from(k) * 13) % 251) as u8)
                .collect()
        })
        .collect();
    let src = PacedSource::new(
        shards
            .iter()
            .enumerate()
            .map(|(i, d)| (format!("s{seed}-{i}.bin"), d.clone()))
            .collect(),
        MIB as u32,
    );
    src.deliver(0, None);
    (src, shards)
}

/// Every GPU of `model`'s hand-off holds the shards byte for byte where the hand-off says:
/// in the region's own file, at the handle's offset plus the shard's offset, within `size`.
fn assert_handoff_holds(m: &GpuManager, model: &str, shards: &[Vec<u8>], gpus: &[u32]) {
    let h = m.handoff(model).unwrap();
    assert_eq!(h.kind, "simulated");
    let on: Vec<u32> = h.devices.iter().map(|d| d.gpu).collect();
    assert_eq!(on, gpus);
    assert_eq!(h.shards.len(), shards.len());
    for d in &h.devices {
        let IpcHandle::SimulatedFile { path, offset } = &d.handle else {
            panic!("{:?}", d.handle);
        };
        let mem = std::fs::read(path).unwrap();
        assert_eq!(*offset, 0, "the handle opens the model's own region");
        assert!(d.size <= mem.len() as u64 - offset);
        for (s, want) in h.shards.iter().zip(shards) {
            let at = (offset + s.offset) as usize;
            assert!(s.offset + s.size <= d.size);
            assert!(
                mem[at..at + want.len()] == want[..],
                "{model}: {} on GPU {}",
                s.path,
                d.gpu
            );
        }
    }
}

#[test]
fn no_memory_is_taken_at_start_and_each_model_gets_its_own_region() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager_with(dir.path(), 2, 256 * MIB as u64, GpuBudget::default(), true);
    // Started: the budget is a cap, nothing is allocated.
    assert_eq!((allocated(&m, 0), allocated(&m, 1)), (0, 0));
    assert_eq!(held(dir.path()), 0, "no simulated GPU memory at start");
    for p in m.pools() {
        // 80% of 256 MiB, rounded down to whole 2 MiB regions.
        assert_eq!(p.budget, 204 * MIB as u64);
        assert_eq!((p.used, p.free), (0, p.budget));
        assert!(p.regions.is_empty());
    }

    // Loading a model allocates its region, on its GPUs only.
    let (a, a_shards) = two_shard_source(5 * MIB + 123, 3 * MIB, 1);
    m.start(request("a", Heaviness::Medium, &[0]), a).unwrap();
    until_resident(&m, "a");
    let ca = region_of(&a_shards);
    assert_eq!((allocated(&m, 0), allocated(&m, 1)), (ca, 0));
    assert!(held(dir.path()) >= ca);
    assert_handoff_holds(&m, "a", &a_shards, &[0]);

    // A second model on both GPUs: a region of its own on each.
    let (b, b_shards) = two_shard_source(7 * MIB, 2 * MIB + 1, 2);
    m.start(request("b", Heaviness::Medium, &[0, 1]), b)
        .unwrap();
    until_resident(&m, "b");
    let cb = region_of(&b_shards);
    assert_eq!((allocated(&m, 0), allocated(&m, 1)), (ca + cb, cb));
    assert_handoff_holds(&m, "b", &b_shards, &[0, 1]);
    let (ha, hb) = (m.handoff("a").unwrap(), m.handoff("b").unwrap());
    assert_ne!(ha.devices[0].handle, hb.devices[0].handle);
    let p0 = &m.pools()[0];
    assert_eq!(p0.used, ca + cb);
    assert_eq!(p0.regions.len(), 2);

    // Evicting frees the device memory for real; the other model is untouched.
    m.evict("a").unwrap();
    assert_eq!((allocated(&m, 0), allocated(&m, 1)), (cb, cb));
    assert_handoff_holds(&m, "b", &b_shards, &[0, 1]);
    m.evict("b").unwrap();
    assert_eq!((allocated(&m, 0), allocated(&m, 1)), (0, 0));
    assert_eq!(
        held(dir.path()),
        0,
        "evicted regions give their memory back"
    );
}

#[test]
fn a_load_past_the_budget_evicts_or_fails_clearly() {
    let budget = GpuBudget::Bytes(64 * MIB as u64);
    // With eviction: the light model makes room.
    let dir = tempfile::tempdir().unwrap();
    let m = manager_with(dir.path(), 1, 1 << 30, budget, true);
    load_now(&m, "light", Heaviness::Light, 40 * MIB, 1);
    load_now(&m, "new", Heaviness::Medium, 40 * MIB, 2);
    let ev = m.evictions();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].model, "light");
    assert_eq!(allocated(&m, 0), charge(40 * MIB));
    assert!(m.model_status("light").is_none());

    // Without: a clear error, and nothing taken for the refused model.
    let dir = tempfile::tempdir().unwrap();
    let m = manager_with(dir.path(), 1, 1 << 30, budget, false);
    load_now(&m, "first", Heaviness::Light, 40 * MIB, 1);
    let src = source(40 * MIB, 2);
    src.deliver(0, None);
    let e = m
        .start(request("second", Heaviness::Medium, &[0]), src)
        .unwrap_err();
    match &e {
        ManagerError::Pool(PoolError::OverBudget {
            requested,
            used,
            budget,
            ..
        }) => assert_eq!(
            (*requested, *used, *budget),
            (40 * MIB as u64, charge(40 * MIB), 64 * MIB as u64)
        ),
        other => panic!("expected OverBudget, got {other:?}"),
    }
    assert!(e.to_string().contains("budget"), "{e}");
    assert!(m.model_status("second").is_none());
    assert!(m.evictions().is_empty());
    assert_eq!(allocated(&m, 0), charge(40 * MIB));
    assert_eq!(m.model_status("first").unwrap().state, LoadState::Resident);
}

#[test]
fn memory_held_by_another_process_is_out_of_memory_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(dir.path(), 2, 100 * MIB as u64);
    // An inference engine holds most of GPU 1; GPU 0 is free.
    set_external_use(&m, 1, 90 * MIB as u64);
    assert_eq!(m.pools()[1].free, 10 * MIB as u64);
    let (src, _) = two_shard_source(20 * MIB, MIB, 3);
    let e = m
        .start(request("both", Heaviness::Medium, &[0, 1]), src)
        .unwrap_err();
    match &e {
        ManagerError::Pool(PoolError::Gpu(GpuError::OutOfMemory {
            device, available, ..
        })) => assert_eq!((*device, *available), (1, 10 * MIB as u64)),
        other => panic!("expected OutOfMemory on GPU 1, got {other:?}"),
    }
    assert!(
        e.to_string().contains("out of GPU memory on device 1"),
        "{e}"
    );
    // No partial state: GPU 0's region was freed again, nothing is recorded.
    assert!(m.model_status("both").is_none());
    assert_eq!((allocated(&m, 0), allocated(&m, 1)), (0, 0));
    assert!(m.pools().iter().all(|p| p.regions.is_empty()));
    assert_eq!(held(dir.path()), 0);
    assert!(m.handoff("both").is_err());
    // Once the engine lets go, the same load succeeds.
    set_external_use(&m, 1, 0);
    let (src, shards) = two_shard_source(20 * MIB, MIB, 3);
    m.start(request("both", Heaviness::Medium, &[0, 1]), src)
        .unwrap();
    until_resident(&m, "both");
    assert_handoff_holds(&m, "both", &shards, &[0, 1]);
}

#[test]
fn eviction_makes_room_when_an_engine_holds_the_memory() {
    let dir = tempfile::tempdir().unwrap();
    let m = manager(dir.path(), 1, 100 * MIB as u64);
    load_now(&m, "old", Heaviness::Light, 8 * MIB, 1);
    // The engine takes 60 MiB: 32 MiB left on the device although the budget has 92.
    set_external_use(&m, 0, 60 * MIB as u64);
    assert_eq!(m.pools()[0].free, 32 * MIB as u64);
    load_now(&m, "new", Heaviness::Medium, 40 * MIB, 2);
    let ev = m.evictions();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].model, "old");
    assert_eq!(allocated(&m, 0), charge(40 * MIB));
    // When evicting everything could not make room, the device's refusal is the error and
    // nothing is evicted for it.
    let src = source(50 * MIB, 3);
    src.deliver(0, None);
    let e = m
        .start(request("third", Heaviness::Medium, &[0]), src)
        .unwrap_err();
    assert!(
        matches!(
            e,
            ManagerError::Pool(PoolError::Gpu(GpuError::OutOfMemory { .. }))
        ),
        "{e:?}"
    );
    assert_eq!(m.model_status("new").unwrap().state, LoadState::Resident);
    assert_eq!(m.evictions().len(), 1);
    assert!(m.model_status("third").is_none());
}

/// A source of one mapped shard file of `bytes` in `dir`, and its mapping.
fn mapped_source(
    dir: &std::path::Path,
    bytes: usize,
    seed: u8,
) -> (Arc<PacedSource>, Arc<dyn gpu_loader::device::HostMemory>) {
    let path = dir.join(format!("w{seed}.bin"));
    std::fs::write(&path, vec![seed; bytes]).unwrap();
    let src = PacedSource::from_files(vec![(format!("w{seed}.bin"), path)], MIB as u32).unwrap();
    let mem = gpu_loader::loader::ChunkSource::host_memory(&*src, 0).unwrap();
    (src, mem)
}

#[test]
fn registering_ahead_waits_for_loads_and_stops_for_good_when_refused() {
    use gpu_loader::manager::AheadState;
    use std::sync::atomic::AtomicBool;
    let dir = tempfile::tempdir().unwrap();
    let files = tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap());
    let mut sim = SimOptions::new(dir.path(), 1, 256 * MIB as u64);
    sim.pcie_bps = 0;
    sim.nvlink_bps = 0;
    let cfg = |register_ahead| ManagerConfig {
        backend: BackendChoice::Simulated(sim.clone()),
        register_ahead,
        load: LoadOptions {
            staging_buffers: 2,
            staging_size: MIB,
            register_segment: 4 * MIB as u64,
            chunk_timeout: Duration::from_secs(5),
            ..Default::default()
        },
        ..Default::default()
    };
    let stop = AtomicBool::new(false);
    let (held, mem) = mapped_source(files.path(), 10 * MIB, 1);
    let memories = vec![("w1.bin".to_string(), mem)];

    // Off by configuration: nothing registered.
    let off = GpuManager::open(&cfg(false));
    assert_eq!(off.ahead_state(), AheadState::Off);
    assert_eq!(off.register_ahead(&memories, &stop).bytes, 0);
    assert_eq!(off.registered_host_bytes(), 0);
    drop(off);

    let m = Arc::new(GpuManager::open(&cfg(true)));
    assert_eq!(m.ahead_state(), AheadState::On);
    // A load in flight (its chunks never arrive; heap memory, so it registers nothing):
    // registering waits for it.
    let stuck = source(2 * MIB, 2);
    m.start(request("stuck", Heaviness::Light, &[0]), stuck)
        .unwrap();
    let r = m.register_ahead(&memories, &stop);
    assert!(r.paused && r.segments == 0, "{r:?}");
    m.abort("stuck", "test over");
    let t0 = Instant::now();
    while m.model_status("stuck").unwrap().state == LoadState::Loading {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(5));
    }
    // No load: every 4 MiB segment of the 10 MiB shard is registered, then kept.
    let r = m.register_ahead(&memories, &stop);
    assert_eq!(
        (r.complete, r.segments, r.bytes, r.paused),
        (1, 3, 10 * MIB as u64, false)
    );
    assert_eq!(m.registered_host_bytes(), 10 * MIB as u64);
    assert_eq!(m.register_ahead(&memories, &stop).segments, 0);
    // Its load pins nothing and says so.
    held.deliver(0, None);
    m.start(request("held", Heaviness::Medium, &[0]), held.clone())
        .unwrap();
    until_resident(&m, "held");
    let st = m.model_status("held").unwrap();
    assert_eq!((st.segments, st.segments_reused), (3, 3), "{st:?}");
    assert_eq!(st.host_path, Some(gpu_loader::loader::HostPath::Registered));

    // A shard the driver refuses to register: registering ahead stops, with the reason.
    let (_other, refused) = mapped_source(files.path(), 3 * MIB, 3);
    refuse_registrations(&m, true);
    let r = m.register_ahead(&[("w3.bin".to_string(), refused.clone())], &stop);
    assert_eq!(r.segments, 0, "{r:?}");
    let AheadState::Stopped(why) = m.ahead_state() else {
        panic!("{:?}", m.ahead_state())
    };
    assert!(why.contains("w3.bin") && why.contains("refused"), "{why}");
    // For good: the driver accepting again changes nothing until a restart.
    refuse_registrations(&m, false);
    assert_eq!(
        m.register_ahead(&[("w3.bin".into(), refused)], &stop)
            .segments,
        0
    );
    // When the mapping's owner drops it, the kept registrations go.
    m.evict("held").unwrap();
    drop((held, memories));
    assert_eq!(m.release_unused_registrations(), 10 * MIB as u64);
    assert_eq!(m.registered_host_bytes(), 0);
}

/// Makes GPU 0's simulated driver refuse (or accept again) host memory registrations.
fn refuse_registrations(m: &GpuManager, refuse: bool) {
    let d = m.device(0).unwrap();
    d.as_any()
        .downcast_ref::<SimDevice>()
        .unwrap()
        .set_refuse_registration(refuse);
}
