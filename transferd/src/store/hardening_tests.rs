//! The hardened store: tier root checks, modes, symlinks planted in every store directory,
//! stale temporary files, space checks, and chunks rotting at rest.

use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use shardcast_protocol::manifest::{ChunkHash, MIN_CHUNK_SIZE, ShardEntry};
use shardcast_protocol::{DataTier, Manifest, ModelName, ShardHasher, ShardPath, VerifiedChunk};

use super::*;

const CHUNK: u32 = MIN_CHUNK_SIZE;

fn bytes_of(i: usize, size: u64) -> Vec<u8> {
    (0..size)
        .map(|b| (b as u8).wrapping_mul(13) ^ (i as u8) ^ ((b >> 12) as u8))
        .collect()
}

fn model(shards: &[(&str, u64)]) -> (Manifest, Vec<Vec<u8>>) {
    let mut entries = Vec::new();
    let mut datas = Vec::new();
    for (i, (path, size)) in shards.iter().enumerate() {
        let data = bytes_of(i, *size);
        let mut h = ShardHasher::new(CHUNK);
        h.update(&data);
        entries.push(h.finish(ShardPath::new(*path).unwrap()));
        datas.push(data);
    }
    (
        Manifest::new(ModelName::new("hard/model").unwrap(), CHUNK, entries).unwrap(),
        datas,
    )
}

fn chunk(m: &Manifest, data: &[Vec<u8>], shard: u32, index: u32) -> VerifiedChunk {
    let (off, len) = m.chunk_span(shard, index).unwrap();
    let bytes = Bytes::copy_from_slice(&data[shard as usize][off as usize..off as usize + len]);
    m.verified(shard, index, bytes).unwrap()
}

fn cfg(root: &Path) -> StoreConfig {
    StoreConfig {
        writer: WriterKind::Pwrite,
        ..StoreConfig::new(root.join("mem"), root.join("disk"))
    }
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
}

/// Every file and directory beneath `dir` (not following symlinks).
fn tree(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if std::fs::symlink_metadata(&p).unwrap().is_dir() {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    out.sort();
    out
}

#[test]
fn created_directories_and_files_get_private_modes() {
    let dir = tempfile::tempdir().unwrap();
    // Roots an installer created with default modes (0755): tightened to 0700.
    for t in ["mem", "disk"] {
        std::fs::create_dir(dir.path().join(t)).unwrap();
        std::fs::set_permissions(dir.path().join(t), PermissionsExt::from_mode(0o755)).unwrap();
    }
    let store = ShardStore::open(cfg(dir.path())).unwrap();
    let (m, _) = model(&[("sub/dir/a.bin", 2 * 4096)]);
    let d = m.digest();
    store.put_manifest(&m).unwrap();
    store.shard(&d, 0, DataTier::Memory).unwrap();
    for t in ["mem", "disk"] {
        assert_eq!(mode(&dir.path().join(t)), 0o700, "{t}");
    }
    let mem = dir.path().join("mem");
    let paths = tree(&mem);
    assert!(paths.len() > 6, "{paths:?}");
    for p in paths.into_iter().chain(tree(&dir.path().join("disk"))) {
        let want = if p.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(mode(&p), want, "{}", p.display());
    }
}

/// Whether the tests run as root (needed to chown to arbitrary users and groups).
fn root() -> bool {
    let root = rustix::process::geteuid().is_root();
    if !root {
        eprintln!("SKIPPED: needs root to chown");
    }
    root
}

#[test]
fn a_store_group_gets_group_readable_modes() {
    if !root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let gid = 4242;
    let store = ShardStore::open(StoreConfig {
        group: Some(gid),
        ..cfg(dir.path())
    })
    .unwrap();
    let (m, _) = model(&[("sub/a.bin", 4096)]);
    let d = m.digest();
    store.put_manifest(&m).unwrap();
    store.shard(&d, 0, DataTier::Memory).unwrap();
    let mem = dir.path().join("mem");
    for p in std::iter::once(mem.clone()).chain(tree(&mem)) {
        let md = std::fs::symlink_metadata(&p).unwrap();
        let want = if md.is_dir() { 0o750 } else { 0o640 };
        assert_eq!(md.permissions().mode() & 0o777, want, "{}", p.display());
        assert_eq!(md.gid(), gid, "{}", p.display());
    }
}

#[test]
fn unsafe_tier_roots_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("mem");

    // Owned by another user.
    std::fs::create_dir(&mem).unwrap();
    std::fs::set_permissions(&mem, PermissionsExt::from_mode(0o700)).unwrap();
    if root() {
        std::os::unix::fs::chown(&mem, Some(54321), None).unwrap();
        let err = ShardStore::open(cfg(dir.path())).unwrap_err();
        assert!(
            matches!(err, StoreError::RootOwner { owner: 54321, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("owned by uid 54321"), "{err}");
        assert!(tree(&mem).is_empty());
        assert!(
            !dir.path().join("disk").exists(),
            "nothing created for the other tier"
        );
        let me = rustix::process::geteuid().as_raw();
        std::os::unix::fs::chown(&mem, Some(me), None).unwrap();
    }

    // Ours, but group-writable.
    std::fs::set_permissions(&mem, PermissionsExt::from_mode(0o770)).unwrap();
    let err = ShardStore::open(cfg(dir.path())).unwrap_err();
    assert!(
        matches!(err, StoreError::RootWritable { mode: 0o770, .. }),
        "{err}"
    );
    assert!(tree(&mem).is_empty());

    // World-writable (a sticky /dev/shm-like directory).
    std::fs::set_permissions(&mem, PermissionsExt::from_mode(0o1777)).unwrap();
    assert!(matches!(
        ShardStore::open(cfg(dir.path())),
        Err(StoreError::RootWritable { .. })
    ));

    // A bad disk root leaves a missing memory root uncreated.
    std::fs::remove_dir(&mem).unwrap();
    let disk = dir.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    std::fs::set_permissions(&disk, PermissionsExt::from_mode(0o757)).unwrap();
    assert!(matches!(
        ShardStore::open(cfg(dir.path())),
        Err(StoreError::RootWritable { mode: 0o757, .. })
    ));
    assert!(!mem.exists(), "nothing created before both roots passed");
    std::fs::remove_dir(&disk).unwrap();
    std::fs::create_dir(&mem).unwrap();

    // A symlink as the root, pointing at a directory we own.
    std::fs::remove_dir(&mem).unwrap();
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    symlink(&elsewhere, &mem).unwrap();
    let err = ShardStore::open(cfg(dir.path())).unwrap_err();
    assert!(matches!(err, StoreError::Symlink { .. }), "{err}");
    assert!(tree(&elsewhere).is_empty());
}

/// Plants `link` → an outside directory (or file) and expects `act` to fail with a
/// symlink refusal, counted, with nothing written outside.
fn expect_refused(
    store: &ShardStore,
    outside: &Path,
    what: &str,
    act: impl FnOnce() -> Result<(), StoreError>,
) {
    let before = store.stats().symlinks_refused.load(Ordering::Relaxed);
    let outside_before = tree(outside);
    let err = act().expect_err(what);
    assert!(
        matches!(err, StoreError::Symlink { .. }),
        "{what}: expected a symlink refusal, got {err}"
    );
    assert!(err.to_string().contains("symlink"), "{what}: {err}");
    assert!(
        store.stats().symlinks_refused.load(Ordering::Relaxed) > before,
        "{what}: counted"
    );
    assert_eq!(
        tree(outside),
        outside_before,
        "{what}: nothing written outside"
    );
    for p in tree(outside) {
        if p.is_file() {
            assert_eq!(
                std::fs::read(&p).unwrap(),
                b"precious",
                "{what}: {}",
                p.display()
            );
        }
    }
}

fn planted_symlinks(walk: bool) {
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("victim"), b"precious").unwrap();
    let (m, data) = model(&[("sub/a.bin", 2 * 4096), ("b.bin", 4096)]);
    let d = m.digest();
    let hex = d.to_hex();
    let open = || {
        let store = ShardStore::open(cfg(dir.path())).unwrap();
        if walk {
            store.inner.memory.force_walk();
            store.inner.disk.force_walk();
        }
        store.put_manifest(&m).unwrap();
        store
    };
    let mem = dir.path().join("mem");

    // models/<digest>
    let store = open();
    symlink(&outside, mem.join("models").join(&hex)).unwrap();
    expect_refused(&store, &outside, "models/<digest>", || {
        store.shard(&d, 0, DataTier::Memory).map(|_| ())
    });
    // Eviction removes the link, never what it points to.
    store.remove(&d, DataTier::Memory).unwrap();
    assert!(!mem.join("models").join(&hex).exists());
    assert_eq!(std::fs::read(outside.join("victim")).unwrap(), b"precious");
    drop(store);

    // A shard's subdirectory.
    let store = open();
    std::fs::create_dir_all(mem.join("models").join(&hex)).unwrap();
    symlink(&outside, mem.join("models").join(&hex).join("sub")).unwrap();
    expect_refused(&store, &outside, "shard subdirectory", || {
        store.shard(&d, 0, DataTier::Memory).map(|_| ())
    });
    store.remove(&d, DataTier::Memory).unwrap();
    drop(store);

    // The shard file itself.
    let store = open();
    std::fs::create_dir_all(mem.join("models").join(&hex)).unwrap();
    symlink(
        outside.join("victim"),
        mem.join("models").join(&hex).join("b.bin"),
    )
    .unwrap();
    expect_refused(&store, &outside, "shard file", || {
        store.shard(&d, 1, DataTier::Memory).map(|_| ())
    });
    store.remove(&d, DataTier::Memory).unwrap();
    drop(store);

    // state/<digest>
    let store = open();
    symlink(&outside, mem.join("state").join(&hex)).unwrap();
    expect_refused(&store, &outside, "state/<digest>", || {
        store.shard(&d, 1, DataTier::Memory).map(|_| ())
    });
    store.remove(&d, DataTier::Memory).unwrap();
    drop(store);

    // A bitmap file.
    let store = open();
    std::fs::create_dir_all(mem.join("state").join(&hex)).unwrap();
    symlink(
        outside.join("victim"),
        mem.join("state").join(&hex).join("1.bits"),
    )
    .unwrap();
    expect_refused(&store, &outside, "bitmap file", || {
        store.shard(&d, 1, DataTier::Memory).map(|_| ())
    });
    store.remove(&d, DataTier::Memory).unwrap();
    drop(store);

    // The tier copy's manifest file.
    let store = open();
    std::fs::create_dir_all(mem.join("state").join(&hex)).unwrap();
    symlink(
        outside.join("victim"),
        mem.join("state").join(&hex).join(MANIFEST_FILE),
    )
    .unwrap();
    expect_refused(&store, &outside, "state manifest", || {
        store.shard(&d, 1, DataTier::Memory).map(|_| ())
    });
    store.remove(&d, DataTier::Memory).unwrap();
    drop(store);

    // A known manifest in the disk tier, replaced by a symlink behind the store's back.
    let store = open();
    let known = dir.path().join("disk").join(known_manifest_rel(&d));
    std::fs::remove_file(&known).unwrap();
    symlink(outside.join("victim"), &known).unwrap();
    let (other, _) = model(&[("x", 10)]);
    expect_refused(&store, &outside, "known manifest", || {
        // The next store of this manifest refreshes the file.
        store.put_manifest(&m).map(|_| ())
    });
    assert!(
        store.put_manifest(&other).is_ok(),
        "other models are unaffected"
    );
    drop(store);

    // Recovery skips planted entries and still opens.
    std::fs::remove_file(&known).unwrap();
    symlink(&outside, mem.join("state").join("ab".repeat(32))).unwrap();
    let store = ShardStore::open(cfg(dir.path())).unwrap();
    assert!(store.stats().symlinks_refused.load(Ordering::Relaxed) >= 1);
    store.put_manifest(&m).unwrap();

    // And a healthy copy still works after all that.
    let s = store.shard(&d, 0, DataTier::Memory).unwrap();
    assert_eq!(s.path(), mem.join("models").join(&hex).join("sub/a.bin"));
    let _ = data;
    assert_eq!(std::fs::read(outside.join("victim")).unwrap(), b"precious");
    assert_eq!(tree(&outside), vec![outside.join("victim")]);
}

#[test]
fn planted_symlinks_are_refused_with_openat2() {
    planted_symlinks(false);
}

#[test]
fn planted_symlinks_are_refused_by_the_component_walk() {
    planted_symlinks(true);
}

#[tokio::test]
async fn stale_temporary_files_are_removed_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (m, data) = model(&[("a.bin", 4096)]);
    let d = m.digest();
    {
        let store = ShardStore::open(cfg(dir.path())).unwrap();
        store.put_manifest(&m).unwrap();
        let s = store.shard(&d, 0, DataTier::Memory).unwrap();
        s.write(chunk(&m, &data, 0, 0)).await.unwrap();
    }
    let state = dir.path().join("mem").join(state_rel(&d));
    let manifests = dir.path().join("disk/manifests");
    // What a crash during an atomic replacement leaves, and a planted symlink by the name.
    std::fs::write(state.join("0.bits.tmp"), b"half").unwrap();
    std::fs::write(state.join("manifest.scmf.tmp"), b"half").unwrap();
    std::fs::write(manifests.join(format!("{}.scmf.tmp", d.to_hex())), b"half").unwrap();
    let outside = dir.path().join("victim");
    std::fs::write(&outside, b"precious").unwrap();
    symlink(&outside, manifests.join("x.tmp")).unwrap();
    // Shard data is never touched, whatever its name.
    let data_file = dir.path().join("mem").join(model_rel(&d)).join("keep.tmp");
    std::fs::write(&data_file, b"data").unwrap();

    let store = ShardStore::open(cfg(dir.path())).unwrap();
    assert_eq!(store.stats().temp_files_removed.load(Ordering::Relaxed), 4);
    assert!(!state.join("0.bits.tmp").exists());
    assert!(!state.join("manifest.scmf.tmp").exists());
    assert_eq!(std::fs::read_dir(&manifests).unwrap().count(), 1);
    assert_eq!(std::fs::read(&outside).unwrap(), b"precious");
    assert!(data_file.exists());
    assert!(store.existing_shard(&d, 0).unwrap().is_complete());
}

#[test]
fn shards_larger_than_the_tier_are_refused_before_a_file_exists() {
    let dir = tempfile::tempdir().unwrap();
    // A configured capacity.
    let store = ShardStore::open(StoreConfig {
        memory_capacity: Some(3 * 4096),
        ..cfg(dir.path())
    })
    .unwrap();
    let (m, _) = model(&[("a.bin", 2 * 4096), ("b.bin", 2 * 4096)]);
    let d = m.digest();
    store.put_manifest(&m).unwrap();
    store.shard(&d, 0, DataTier::Memory).unwrap();
    let err = store.shard(&d, 1, DataTier::Memory).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::NoSpace {
                shard: 1,
                need: 8192,
                available: 4096,
                limit: SpaceLimit::Capacity,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        !dir.path()
            .join("mem")
            .join(model_rel(&d))
            .join("b.bin")
            .exists()
    );
    assert_eq!(store.stats().space_refusals.load(Ordering::Relaxed), 1);
    // The disk tier has no cap.
    store.shard(&d, 1, DataTier::Disk).unwrap();

    // The file system's free space: a shard well beyond what is available (four times: other
    // processes on the machine — builds, other tests — free and fill space meanwhile).
    let free = store.inner.memory.available().unwrap();
    let max = u64::from(shardcast_protocol::manifest::MAX_CHUNK_SIZE);
    let size = free.saturating_mul(4).saturating_add(max);
    let chunks = size.div_ceil(max) as usize;
    let entry = ShardEntry {
        path: ShardPath::new("huge.bin").unwrap(),
        size,
        hash: ChunkHash([0; 32]),
        chunks: vec![ChunkHash([0; 32]); chunks],
    };
    let huge = Manifest::new(ModelName::new("huge").unwrap(), max as u32, vec![entry]).unwrap();
    let hd = huge.digest();
    store.put_manifest(&huge).unwrap();
    let err = store.shard(&hd, 0, DataTier::Disk).unwrap_err();
    assert!(matches!(err, StoreError::NoSpace { .. }), "{err}");
    assert!(err.to_string().contains("available"), "{err}");
    assert!(!dir.path().join("disk").join(model_rel(&hd)).exists());
    assert!(!dir.path().join("disk").join(state_rel(&hd)).exists());
}

/// A memory tier on tmpfs admits a shard only within the host's available memory less the
/// headroom: with a headroom larger than the host's memory nothing fits, with none the
/// same shard does, and the disk tier is not bound by it.
#[test]
fn a_memory_tier_on_tmpfs_keeps_the_hosts_headroom() {
    let Ok(shm) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("SKIPPED: no /dev/shm here");
        return;
    };
    let fs = TierFs::of(shm.path());
    if !fs
        .as_ref()
        .is_some_and(|f| hostmem::memory_backed(&f.fs_type))
    {
        eprintln!("SKIPPED: /dev/shm is not tmpfs here: {fs:?}");
        return;
    }
    let disk = tempfile::tempdir().unwrap();
    let open = |headroom| {
        ShardStore::open(StoreConfig {
            memory_headroom: Some(headroom),
            ..StoreConfig::new(shm.path().join("mem"), disk.path().join("disk"))
        })
        .unwrap()
    };
    let (m, _) = model(&[("a.bin", 2 * 4096)]);
    let d = m.digest();
    let store = open(u64::MAX / 2);
    store.put_manifest(&m).unwrap();
    assert_eq!(store.host_room(DataTier::Memory), Some(0));
    assert_eq!(store.host_room(DataTier::Disk), None);
    let err = store.shard(&d, 0, DataTier::Memory).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::NoSpace {
                limit: SpaceLimit::HostMemory,
                available: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("memory_headroom"), "{err}");
    assert_eq!(store.stats().space_refusals.load(Ordering::Relaxed), 1);
    store.shard(&d, 0, DataTier::Disk).unwrap();
    drop(store);
    let store = open(0);
    assert!(store.host_room(DataTier::Memory).unwrap() > 0);
    store.shard(&d, 0, DataTier::Memory).unwrap();
}

/// Flips one byte of a shard file behind the store's back.
fn flip(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x5a], at).unwrap();
}

#[tokio::test]
async fn a_chunk_rotting_at_rest_is_dropped_persisted_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (m, data) = model(&[("a.bin", 3 * 4096)]);
    let d = m.digest();
    let store = ShardStore::open(StoreConfig {
        reverify_after: Duration::ZERO,
        ..cfg(dir.path())
    })
    .unwrap();
    store.put_manifest(&m).unwrap();
    let s = store.shard(&d, 0, DataTier::Memory).unwrap();
    for i in 0..3 {
        s.write(chunk(&m, &data, 0, i)).await.unwrap();
    }
    flip(s.path(), 4096 + 100);
    // Every read re-hashes: the bad chunk is never returned.
    assert_eq!(s.read(0).unwrap(), &data[0][..4096]);
    let err = s.read(1).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::CorruptChunk {
                shard: 0,
                index: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(!s.is_verified(1));
    assert_eq!(s.verified_count(), 2);
    assert!(matches!(s.read(1), Err(StoreError::NotVerified { .. })));
    let st = store.stats();
    assert_eq!(st.chunks_rotted.load(Ordering::Relaxed), 1);
    assert!(st.chunks_reverified.load(Ordering::Relaxed) >= 2);
    // Repaired by writing a good copy again.
    assert!(s.write(chunk(&m, &data, 0, 1)).await.unwrap());
    assert_eq!(st.chunks_repaired.load(Ordering::Relaxed), 1);
    assert_eq!(
        s.read_checked(1, false, Check::Serve).await.unwrap(),
        &data[0][4096..8192]
    );

    // The drop is persisted.
    flip(s.path(), 2 * 4096);
    assert!(matches!(
        s.check(2, false, Check::Scrub),
        Err(StoreError::CorruptChunk { .. })
    ));
    assert_eq!(st.chunks_scrubbed.load(Ordering::Relaxed), 1);
    drop((s, store));
    let store = ShardStore::open(cfg(dir.path())).unwrap();
    let s = store.existing_shard(&d, 0).unwrap();
    assert_eq!(s.verified_set(0, 3).iter().collect::<Vec<_>>(), vec![0, 1]);
}

#[tokio::test]
async fn trusted_chunks_are_not_rehashed_until_the_window_passes() {
    let dir = tempfile::tempdir().unwrap();
    let (m, data) = model(&[("a.bin", 2 * 4096)]);
    let d = m.digest();
    let store = ShardStore::open(StoreConfig {
        reverify_after: Duration::from_millis(200),
        ..cfg(dir.path())
    })
    .unwrap();
    store.put_manifest(&m).unwrap();
    let s = store.shard(&d, 0, DataTier::Memory).unwrap();
    for i in 0..2 {
        s.write(chunk(&m, &data, 0, i)).await.unwrap();
    }
    assert!(!s.needs_check(0), "just verified");
    assert!(!s.check(0, false, Check::Serve).unwrap(), "trusted");
    flip(s.path(), 10);
    // Forced (after a Nack) it is re-hashed at once.
    assert!(matches!(
        s.check(0, true, Check::Nack),
        Err(StoreError::CorruptChunk { .. })
    ));
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(s.needs_check(1));
    assert!(s.check(1, false, Check::Serve).unwrap(), "re-hashed");
    assert!(!s.needs_check(1), "trusted again");
    // Recovered chunks are not trusted until re-hashed.
    drop((s, store));
    let store = ShardStore::open(cfg(dir.path())).unwrap();
    let s = store.existing_shard(&d, 0).unwrap();
    assert!(s.needs_check(1));
    assert!(!s.needs_check(0), "not verified at all");
}

#[test]
fn chunks_covering_byte_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let store = ShardStore::open(cfg(dir.path())).unwrap();
    let (m, _) = model(&[("a.bin", 3 * 4096 + 5)]);
    store.put_manifest(&m).unwrap();
    let s = store.shard(&m.digest(), 0, DataTier::Disk).unwrap();
    assert_eq!(s.chunks_covering(0, 1), 0..1);
    assert_eq!(s.chunks_covering(4095, 2), 0..2);
    assert_eq!(s.chunks_covering(4096, 4096), 1..2);
    assert_eq!(s.chunks_covering(3 * 4096, 100), 3..4);
    assert_eq!(s.chunks_covering(0, 0), 0..0);
    assert_eq!(s.chunks_covering(1 << 40, 1), 0..0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_ahead_refresh_trust_and_drop_rotten_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let (m, data) = model(&[("a.bin", 6 * 4096)]);
    let d = m.digest();
    let store = ShardStore::open(StoreConfig {
        reverify_after: Duration::from_millis(100),
        ..cfg(dir.path())
    })
    .unwrap();
    store.put_manifest(&m).unwrap();
    let s = store.shard(&d, 0, DataTier::Memory).unwrap();
    for i in 0..6 {
        s.write(chunk(&m, &data, 0, i)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    flip(s.path(), 4 * 4096 + 1);
    assert!((0..6).all(|i| s.needs_check(i)));
    s.check_ahead(1..6, Check::Serve);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while s.dropped_chunks(0, 6).is_empty() || (1..6).any(|i| s.needs_check(i)) {
        assert!(
            std::time::Instant::now() < deadline,
            "checks ahead did not finish"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(s.dropped_chunks(0, 6), vec![4]);
    assert!(s.is_dropped(4) && !s.is_verified(4));
    assert!(s.needs_check(0), "outside the range: still untrusted");
    assert_eq!(store.stats().chunks_reverified.load(Ordering::Relaxed), 5);
    s.write(chunk(&m, &data, 0, 4)).await.unwrap();
    assert!(s.dropped_chunks(0, 6).is_empty());
}
