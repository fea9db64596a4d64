//! The memory reserve: spares filled, taken by new memory-tier shards, kept or cleared at
//! start-up, and dropped when the tier's bounds need their room.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::Ordering;

use shardcast_protocol::DataTier;

use super::reserve::RESERVE_DIR;
use super::tests::{chunk, model};
use super::*;

const MIB: u64 = 1 << 20;

fn config(root: &Path, bytes: u64, spare: u64) -> StoreConfig {
    StoreConfig {
        memory_reserve: ReserveConfig {
            bytes,
            spare: SpareSize::Fixed(spare),
        },
        ..StoreConfig::new(root.join("mem"), root.join("disk"))
    }
}

/// Fills the reserve until it says it is full (bounded).
fn fill(store: &ShardStore) -> u64 {
    let mut total = 0;
    for _ in 0..10_000 {
        match store.fill_reserve().unwrap() {
            0 => return total,
            n => total += n,
        }
    }
    panic!("the reserve never said it was full");
}

/// The names in the reserve's directory, sorted.
fn spares(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root.join("mem").join(RESERVE_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Bytes a file's blocks hold.
fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[tokio::test]
async fn a_new_memory_shard_is_written_into_a_filled_spare() {
    let dir = tempfile::tempdir().unwrap();
    let (m, data) = model("org/model", &[("a.safetensors", 3 * MIB + 4096)]);
    let size = m.shards[0].size;
    let store = ShardStore::open(config(dir.path(), 2 * size, size)).unwrap();
    assert_eq!(store.reserve_status().held, 0);
    assert_eq!(fill(&store), 2 * size);
    let st = store.reserve_status();
    assert_eq!(
        (st.held, st.config.bytes, st.refused),
        (2 * size, 2 * size, None)
    );
    assert_eq!(spares(dir.path()), ["spare-0", "spare-1"]);
    for name in spares(dir.path()) {
        let p = dir.path().join("mem").join(RESERVE_DIR).join(name);
        assert!(allocated(&p) >= size, "a spare's pages are allocated");
        assert!(std::fs::read(&p).unwrap().iter().all(|&b| b == 0));
    }

    store.put_manifest(&m).unwrap();
    let d = m.digest();
    let shard = store.shard(&d, 0, DataTier::Memory).unwrap();
    assert_eq!(shard.resident_bytes(), size);
    assert_eq!(shard.unallocated_bytes(), 0);
    assert_eq!(shard.unwritten_bytes(), size);
    // The shard's file is the spare: allocated before any chunk was written.
    assert_eq!(std::fs::metadata(shard.path()).unwrap().len(), size);
    assert!(allocated(shard.path()) >= size);
    assert_eq!(store.reserve_status().held, size);
    assert_eq!(spares(dir.path()).len(), 1);
    let stats = store.stats();
    assert_eq!(stats.reserve_spares_taken.load(Ordering::Relaxed), 1);
    assert_eq!(stats.reserve_bytes_taken.load(Ordering::Relaxed), size);
    assert_eq!(stats.reserve_bytes_filled.load(Ordering::Relaxed), 2 * size);

    // Nothing is readable before it is verified, spare or not.
    assert!(matches!(
        shard.read(0),
        Err(StoreError::NotVerified { index: 0, .. })
    ));
    for i in 0..shard.total_chunks() {
        assert!(shard.write(chunk(&m, &data, 0, i)).await.unwrap());
    }
    assert_eq!(std::fs::read(shard.path()).unwrap(), data[0]);
    assert_eq!(
        stats.chunks_written.load(Ordering::Relaxed),
        u64::from(shard.total_chunks())
    );

    // The disk tier never takes a spare.
    let on_disk = store.shard(&d, 0, DataTier::Disk).unwrap();
    assert_eq!(on_disk.resident_bytes(), 0);
    assert_eq!(store.reserve_status().held, size);

    // The filler tops the reserve up again.
    assert_eq!(fill(&store), size);
    assert_eq!(store.reserve_status().held, 2 * size);
}

#[test]
fn a_shard_takes_the_best_fitting_spare_or_none() {
    let dir = tempfile::tempdir().unwrap();
    // Spares of 4, 4 and 2 MiB (the last one smaller: what was left of the target).
    let store = ShardStore::open(config(dir.path(), 10 * MIB, 4 * MIB)).unwrap();
    assert_eq!(fill(&store), 10 * MIB);
    let (m, _) = model(
        "org/sizes",
        &[
            ("small.json", 4096),
            ("b.safetensors", 3 * MIB),
            ("c.safetensors", 6 * MIB),
            ("d.safetensors", MIB + 4096),
        ],
    );
    store.put_manifest(&m).unwrap();
    let d = m.digest();
    let resident = |i| {
        store
            .shard(&d, i, DataTier::Memory)
            .unwrap()
            .resident_bytes()
    };
    // Under half of every spare: fresh pages, no spare spent.
    assert_eq!(resident(0), 0);
    assert_eq!(store.reserve_status().held, 10 * MIB);
    // 3 MiB: the 4 MiB spare covers it (the 2 MiB one does not), cut to 3 MiB.
    assert_eq!(resident(1), 3 * MIB);
    assert_eq!(store.reserve_status().held, 6 * MIB);
    // 6 MiB: no spare covers it; the largest smaller one covers its start.
    assert_eq!(resident(2), 4 * MIB);
    let c = store.shard(&d, 2, DataTier::Memory).unwrap();
    assert_eq!(std::fs::metadata(c.path()).unwrap().len(), 6 * MIB);
    assert_eq!(c.unallocated_bytes(), 2 * MIB);
    // 1 MiB + 4 KiB: the 2 MiB spare, at most twice its size.
    assert_eq!(resident(3), MIB + 4096);
    assert_eq!(store.reserve_status().held, 0);
    assert!(spares(dir.path()).is_empty());
}

#[test]
fn start_up_keeps_complete_spares_and_removes_everything_else() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = ShardStore::open(config(dir.path(), 3 * MIB, MIB)).unwrap();
        assert_eq!(fill(&store), 3 * MIB);
    }
    let reserve = dir.path().join("mem").join(RESERVE_DIR);
    let outside = dir.path().join("outside");
    std::fs::write(&outside, b"not the store's").unwrap();
    std::os::unix::fs::symlink(&outside, reserve.join("spare-7")).unwrap();
    std::fs::write(reserve.join("spare-8.filling"), vec![0u8; 4096]).unwrap();
    std::fs::write(reserve.join("notes.txt"), b"x").unwrap();
    // A sparse file under a spare's name: not allocated, so not a spare.
    std::fs::File::create(reserve.join("spare-9"))
        .unwrap()
        .set_len(MIB)
        .unwrap();

    // A smaller target keeps two of the three spares.
    let store = ShardStore::open(config(dir.path(), 2 * MIB, MIB)).unwrap();
    assert_eq!(store.reserve_status().held, 2 * MIB);
    assert_eq!(spares(dir.path()), ["spare-0", "spare-1"]);
    assert_eq!(std::fs::read(&outside).unwrap(), b"not the store's");
    assert!(store.stats().symlinks_refused.load(Ordering::Relaxed) >= 1);
    // New spares do not reuse a kept spare's number.
    drop(store);
    let store = ShardStore::open(config(dir.path(), 3 * MIB, MIB)).unwrap();
    assert_eq!(fill(&store), MIB);
    assert_eq!(spares(dir.path()), ["spare-0", "spare-1", "spare-2"]);
    drop(store);

    // With the reserve off, every spare goes.
    let store = ShardStore::open(config(dir.path(), 0, MIB)).unwrap();
    assert_eq!(store.reserve_status().held, 0);
    assert!(spares(dir.path()).is_empty());
    assert_eq!(fill(&store), 0);
}

#[test]
fn spares_give_way_to_shards_within_the_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        memory_capacity: Some(5 * MIB),
        ..config(dir.path(), 4 * MIB, MIB)
    };
    let store = ShardStore::open(cfg).unwrap();
    assert_eq!(fill(&store), 4 * MIB);
    let (m, _) = model(
        "org/big",
        &[("a.safetensors", 3 * MIB), ("b.safetensors", 2 * MIB)],
    );
    store.put_manifest(&m).unwrap();
    let d = m.digest();
    // A 3 MiB shard takes one 1 MiB spare; 3 MiB of shards and 3 of spares no longer fit
    // the 5 MiB capacity, so one spare is dropped.
    let a = store.shard(&d, 0, DataTier::Memory).unwrap();
    assert_eq!(a.resident_bytes(), MIB);
    assert_eq!(store.reserve_status().held, 2 * MIB);
    assert_eq!(
        store.stats().reserve_bytes_dropped.load(Ordering::Relaxed),
        MIB
    );
    // The spares' room is the shards': a second shard that fills the capacity is admitted,
    // and the reserve gives up the rest.
    let b = store.shard(&d, 1, DataTier::Memory).unwrap();
    assert_eq!(b.resident_bytes(), MIB);
    assert_eq!(store.reserve_status().held, 0);
    assert_eq!(
        store.stats().reserve_bytes_dropped.load(Ordering::Relaxed),
        2 * MIB
    );
    // With the capacity full, the filler adds nothing.
    assert_eq!(fill(&store), 0);
    assert!(spares(dir.path()).is_empty());
}

/// `memory_reserve_spare = auto`: spares start at the default size (cut to what the target
/// leaves), are sized after the largest shard of the last model received into the memory
/// tier (rounded up to 2 MiB), and a restart remembers it from the spares it keeps.
#[test]
fn auto_spares_are_sized_like_the_last_models_largest_shard() {
    let dir = tempfile::tempdir().unwrap();
    let auto = |bytes| StoreConfig {
        memory_reserve: ReserveConfig {
            bytes,
            spare: SpareSize::Auto,
        },
        ..StoreConfig::new(dir.path().join("mem"), dir.path().join("disk"))
    };
    let store = ShardStore::open(auto(14 * MIB)).unwrap();
    assert_eq!(store.reserve_status().spare, DEFAULT_SPARE);
    // Nothing learned yet: one spare of what the target leaves (under DEFAULT_SPARE).
    assert_eq!(fill(&store), 14 * MIB);
    assert_eq!(spares(dir.path()), ["spare-0"]);

    let (m, _) = model(
        "org/auto",
        &[
            ("config.json", 4096),
            ("a.safetensors", 3 * MIB + 4096),
            ("b.safetensors", 2 * MIB),
        ],
    );
    store.put_manifest(&m).unwrap();
    let d = m.digest();
    // The index file learns from its model's largest shard too, and takes no spare.
    let small = store.shard(&d, 0, DataTier::Memory).unwrap();
    assert_eq!(small.resident_bytes(), 0);
    assert_eq!(store.reserve_status().spare, 4 * MIB);
    // a.safetensors is under half the 14 MiB spare, and larger than none: it takes none.
    assert_eq!(
        store
            .shard(&d, 1, DataTier::Memory)
            .unwrap()
            .resident_bytes(),
        0
    );
    // Disk copies teach nothing, and a model of small files only neither.
    let (tiny, _) = model("org/tiny", &[("only.json", 8192)]);
    store.put_manifest(&tiny).unwrap();
    store.shard(&tiny.digest(), 0, DataTier::Memory).unwrap();
    assert_eq!(store.reserve_status().spare, 4 * MIB);

    // Start again with a larger target: the 14 MiB spare is kept, and new spares are 4 MiB
    // (learned again from the model; before it, the largest spare kept).
    drop((small, store));
    let store = ShardStore::open(auto(26 * MIB)).unwrap();
    assert_eq!(store.reserve_status().spare, 14 * MIB);
    store.put_manifest(&m).unwrap();
    store.shard(&d, 2, DataTier::Memory).unwrap();
    assert_eq!(store.reserve_status().spare, 4 * MIB);
    assert_eq!(fill(&store), 12 * MIB);
    let sizes: Vec<u64> = spares(dir.path())
        .iter()
        .map(|n| {
            std::fs::metadata(dir.path().join("mem").join(RESERVE_DIR).join(n))
                .unwrap()
                .len()
        })
        .collect();
    assert_eq!(
        sizes,
        [14 * MIB, 4 * MIB, 4 * MIB, 4 * MIB],
        "{:?}",
        spares(dir.path())
    );
}

/// A spare is started no larger than the room the tier's bounds leave, so every spare can
/// be completed and taken (one sized past the room would stay half-filled for good).
#[test]
fn a_spare_is_no_larger_than_the_room_left() {
    let dir = tempfile::tempdir().unwrap();
    let store = ShardStore::open(StoreConfig {
        memory_capacity: Some(10 * MIB),
        ..config(dir.path(), 16 * MIB, 8 * MIB)
    })
    .unwrap();
    assert_eq!(fill(&store), 10 * MIB);
    assert_eq!(spares(dir.path()), ["spare-0", "spare-1"]);
    let len = |n: &str| {
        std::fs::metadata(dir.path().join("mem").join(RESERVE_DIR).join(n))
            .unwrap()
            .len()
    };
    assert_eq!((len("spare-0"), len("spare-1")), (8 * MIB, 2 * MIB));
    assert_eq!(store.reserve_status().held, 10 * MIB);
}

/// On a memory tier in RAM (tmpfs), spares are memory the host may need back: while the
/// host's available memory is below the headroom, the filler adds nothing and drops the
/// spares it finds (kept from an earlier run here), and says so in its counters.
#[test]
fn spares_give_way_to_the_hosts_headroom() {
    let Some(mem) = hostmem::HostMemory::read() else {
        eprintln!("skipped: no /proc/meminfo");
        return;
    };
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("skipped: no /dev/shm");
        return;
    };
    let cfg = |headroom| StoreConfig {
        memory_headroom: Some(headroom),
        ..config(dir.path(), 4 * MIB, MIB)
    };
    // With no headroom asked, the spares are filled.
    let store = ShardStore::open(cfg(0)).unwrap();
    assert_eq!(fill(&store), 4 * MIB);
    drop(store);
    // A headroom above all the host's memory: nothing may be held. The spares kept at
    // start-up are dropped by the filler's first call, which allocates nothing.
    let store = ShardStore::open(cfg(2 * mem.total)).unwrap();
    assert_eq!(store.reserve_status().held, 4 * MIB);
    assert_eq!(fill(&store), 0);
    assert_eq!(store.reserve_status().held, 0);
    assert!(spares(dir.path()).is_empty());
    let stats = store.stats();
    assert_eq!(stats.reserve_bytes_dropped.load(Ordering::Relaxed), 4 * MIB);
    assert_eq!(stats.reserve_bytes_filled.load(Ordering::Relaxed), 0);
}

/// The filler populates each spare's writable map as it allocates the spare, and the shard
/// that takes the spare copies its chunks into that map (no `pwrite`, no page-table work on
/// the transfer's path) where the map covers it: a shard cut from a larger spare. A shard
/// longer than its spare, a spare kept from an earlier run before the filler maps it, and
/// the `pwrite` writer go by `pwrite` as before. Every byte reads back as written in each
/// case.
#[tokio::test]
async fn a_spare_hands_its_populated_map_to_the_shard_written_into_it() {
    if super::map::populate_supported().is_err() {
        eprintln!("skipped: no MADV_POPULATE_WRITE");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (m, data) = model(
        "org/premapped",
        &[
            ("a.safetensors", 3 * MIB + 4096),
            ("b.safetensors", 6 * MIB),
        ],
    );
    let d = m.digest();
    let write_all = |shard: Arc<Shard>, i: u32| {
        let (m, data) = (m.clone(), data.clone());
        async move {
            for c in 0..shard.total_chunks() {
                assert!(shard.write(chunk(&m, &data, i, c)).await.unwrap());
            }
            assert_eq!(std::fs::read(shard.path()).unwrap(), data[i as usize]);
            // Read back through the store (a spare's populated map where it has one).
            for c in 0..shard.total_chunks() {
                assert_eq!(shard.read(c).unwrap(), *chunk(&m, &data, i, c).data());
            }
        }
    };
    let mapped = |store: &ShardStore| store.stats().bytes_written_mapped.load(Ordering::Relaxed);

    // Two 4 MiB spares: a.safetensors is cut from one and written through its map alone.
    let store = ShardStore::open(config(dir.path(), 8 * MIB, 4 * MIB)).unwrap();
    assert_eq!(store.writer_kind(), WriterKind::Adaptive);
    assert_eq!(fill(&store), 8 * MIB);
    assert_eq!(store.reserve_status().mapped, 8 * MIB);
    store.put_manifest(&m).unwrap();
    let a = store.shard(&d, 0, DataTier::Memory).unwrap();
    assert_eq!(a.resident_bytes(), 3 * MIB + 4096);
    assert_eq!(store.reserve_status().mapped, 4 * MIB);
    write_all(a.clone(), 0).await;
    assert_eq!(mapped(&store), 3 * MIB + 4096);
    // b.safetensors is longer than the other spare: the spare's map does not cover it, and
    // its chunks, written one at a time, go by `pwrite`.
    let b = store.shard(&d, 1, DataTier::Memory).unwrap();
    assert_eq!(b.resident_bytes(), 4 * MIB);
    write_all(b, 1).await;
    assert_eq!(mapped(&store), 3 * MIB + 4096);
    drop((a, store));

    // Spares kept from an earlier run have no map: `pwrite`...
    let dir = tempfile::tempdir().unwrap();
    let store = ShardStore::open(config(dir.path(), 8 * MIB, 4 * MIB)).unwrap();
    assert_eq!(fill(&store), 8 * MIB);
    drop(store);
    let store = ShardStore::open(config(dir.path(), 8 * MIB, 4 * MIB)).unwrap();
    assert_eq!(store.reserve_status().held, 8 * MIB);
    assert_eq!(store.reserve_status().mapped, 0);
    store.put_manifest(&m).unwrap();
    let a = store.shard(&d, 0, DataTier::Memory).unwrap();
    assert_eq!(a.resident_bytes(), 3 * MIB + 4096);
    write_all(a.clone(), 0).await;
    assert_eq!(mapped(&store), 0);
    // ...until the filler maps them, once the reserve is full: page tables only, nothing
    // allocated or counted as filled.
    assert_eq!(fill(&store), 4 * MIB);
    let filled = store.stats().reserve_bytes_filled.load(Ordering::Relaxed);
    assert_eq!(store.reserve_status().mapped, 4 * MIB);
    let mut done = 0;
    for _ in 0..100 {
        match store.map_reserve().unwrap() {
            0 => break,
            n => done += n,
        }
    }
    assert_eq!(done, 4 * MIB);
    assert_eq!(store.reserve_status().mapped, 8 * MIB);
    assert_eq!(store.map_reserve().unwrap(), 0);
    assert_eq!(
        store.stats().reserve_bytes_filled.load(Ordering::Relaxed),
        filled
    );
    store.remove(&d, DataTier::Memory).unwrap();
    let a = store.shard(&d, 0, DataTier::Memory).unwrap();
    write_all(a.clone(), 0).await;
    assert_eq!(mapped(&store), 3 * MIB + 4096);
    drop((a, store));

    // The `pwrite` writer: spares are zeroes written, without maps, and shards `pwrite`n.
    let dir = tempfile::tempdir().unwrap();
    let store = ShardStore::open(StoreConfig {
        writer: WriterKind::Pwrite,
        ..config(dir.path(), 8 * MIB, 4 * MIB)
    })
    .unwrap();
    assert_eq!(fill(&store), 8 * MIB);
    assert_eq!(store.reserve_status().mapped, 0);
    for name in spares(dir.path()) {
        let p = dir.path().join("mem").join(RESERVE_DIR).join(name);
        assert!(allocated(&p) >= 4 * MIB, "a spare's pages are allocated");
    }
    store.put_manifest(&m).unwrap();
    let a = store.shard(&d, 0, DataTier::Memory).unwrap();
    write_all(a, 0).await;
    assert_eq!(mapped(&store), 0);
}

/// A spare populated into a tmpfs that runs out of room (another process took it between
/// the filler's look at the room and its step) fails as "no space": the filler removes the
/// half-made spare and tries again later; nothing is stored into an unbacked page, so the
/// daemon lives. The next bounded fill makes a spare that fits, map and all. Needs root (to
/// mount a tmpfs of its own); skipped, saying why, elsewhere.
#[cfg(target_os = "linux")]
#[test]
fn a_spare_populated_into_a_full_tmpfs_is_given_up_not_fatal() {
    let Some(dir) = super::tests::SmallTmpfs::mount("size=3m,mode=0700") else {
        return;
    };
    let store = ShardStore::open(config(dir.path(), 8 * MIB, 4 * MIB)).unwrap();
    // A step sized past the room, as after another process's write: 4 MiB in 3.
    assert_eq!(store.inner.reserve.fill(8 * MIB).unwrap(), 0);
    let st = store.reserve_status();
    assert_eq!((st.held, st.mapped, st.refused), (0, 0, None));
    assert!(spares(dir.path()).is_empty(), "{:?}", spares(dir.path()));
    // Bounded by the room the tmpfs has: a smaller spare, populated and mapped.
    let filled = fill(&store);
    assert!((MIB..=3 * MIB).contains(&filled), "{filled}");
    let st = store.reserve_status();
    assert_eq!((st.held, st.mapped, st.refused), (filled, filled, None));
}
