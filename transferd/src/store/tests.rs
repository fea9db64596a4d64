use std::path::Path;

use bytes::Bytes;
use shardcast_protocol::manifest::MIN_CHUNK_SIZE;
use shardcast_protocol::{DataTier, Hashed, Manifest, ModelName, ShardHasher, ShardPath};

use super::*;
use shardcast_protocol::VerifiedChunk;

const CHUNK: u32 = MIN_CHUNK_SIZE;

fn shard_bytes(i: usize, size: u64) -> Vec<u8> {
    (0..size)
        .map(|b| (b as u8).wrapping_mul(31) ^ (i as u8) ^ ((b >> 12) as u8))
        .collect()
}

/// A manifest of shards with the given paths and sizes, and the shards' bytes.
pub(super) fn model(name: &str, shards: &[(&str, u64)]) -> (Manifest, Vec<Vec<u8>>) {
    let mut entries = Vec::new();
    let mut datas = Vec::new();
    for (i, (path, size)) in shards.iter().enumerate() {
        let data = shard_bytes(i, *size);
        let mut h = ShardHasher::new(CHUNK);
        h.update(&data);
        entries.push(h.finish(ShardPath::new(*path).unwrap()));
        datas.push(data);
    }
    (
        Manifest::new(ModelName::new(name).unwrap(), CHUNK, entries).unwrap(),
        datas,
    )
}

pub(super) fn chunk(m: &Manifest, data: &[Vec<u8>], shard: u32, index: u32) -> VerifiedChunk {
    let (off, len) = m.chunk_span(shard, index).unwrap();
    let bytes = Bytes::copy_from_slice(&data[shard as usize][off as usize..off as usize + len]);
    m.verified(shard, index, bytes).unwrap()
}

fn config(root: &Path, writer: WriterKind, verify: bool) -> StoreConfig {
    StoreConfig {
        verify_on_recover: verify,
        writer,
        ..StoreConfig::new(root.join("mem"), root.join("disk"))
    }
}

fn writers() -> Vec<WriterKind> {
    let mut w = vec![WriterKind::Pwrite, WriterKind::Auto];
    match ChunkWriter::new(WriterKind::IoUring) {
        Ok(_) => w.push(WriterKind::IoUring),
        Err(e) => eprintln!("io_uring unavailable here, not tested: {e}"),
    }
    match ChunkWriter::new(WriterKind::Mapped) {
        Ok(_) => w.extend([WriterKind::Mapped, WriterKind::Adaptive]),
        Err(e) => eprintln!("the mapped writer is unavailable here, not tested: {e}"),
    }
    w
}

#[tokio::test]
async fn write_read_round_trip_with_every_writer() {
    for writer in writers() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(config(dir.path(), writer, false)).unwrap();
        let (m, data) = model(
            "org/model",
            &[("a.safetensors", 3 * 4096 + 100), ("b.bin", 4096)],
        );
        let d = m.digest();
        store.put_manifest(&m).unwrap();
        for tier in [DataTier::Memory, DataTier::Disk] {
            for s in 0..2u32 {
                let shard = store.shard(&d, s, tier).unwrap();
                let mut rx = shard.subscribe();
                for i in 0..shard.total_chunks() {
                    assert!(
                        shard.write(chunk(&m, &data, s, i)).await.unwrap(),
                        "{writer:?}"
                    );
                    assert!(rx.has_changed().unwrap());
                    assert_eq!(*rx.borrow_and_update(), i + 1);
                }
                assert!(shard.is_complete());
                let mut back = Vec::new();
                for i in 0..shard.total_chunks() {
                    back.extend_from_slice(&shard.read(i).unwrap());
                }
                assert_eq!(back, data[s as usize], "{writer:?} {tier:?}");
                assert_eq!(std::fs::read(shard.path()).unwrap(), data[s as usize]);
                // A second write of a verified chunk is a no-op.
                assert!(!shard.write(chunk(&m, &data, s, 0)).await.unwrap());
            }
        }
    }
}

#[tokio::test]
async fn verify_and_write_stores_sound_chunks_and_drops_bad_ones_with_every_writer() {
    for writer in writers() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(config(dir.path(), writer, false)).unwrap();
        let (m, data) = model("org/model", &[("a.safetensors", 3 * 4096 + 100)]);
        let d = m.digest();
        store.put_manifest(&m).unwrap();
        let shard = store.shard(&d, 0, DataTier::Memory).unwrap();
        let bytes = |i: u32| chunk(&m, &data, 0, i).data().clone();

        // A flipped byte: refused, nothing written, the bit stays clear.
        let mut bad = bytes(1).to_vec();
        bad[7] ^= 0x40;
        let got = shard.verify_and_write(1, Bytes::from(bad)).await.unwrap();
        assert!(matches!(got, Written::Corrupt(_)), "{writer:?}: {got:?}");
        assert!(!shard.is_verified(1));
        let (off, len) = m.chunk_span(0, 1).unwrap();
        let on_disk = std::fs::read(shard.path()).unwrap();
        assert!(
            on_disk[off as usize..off as usize + len]
                .iter()
                .all(|&b| b == 0),
            "{writer:?}: a bad chunk reached the file"
        );
        // The wrong chunk's bytes at this index: refused too.
        let got = shard.verify_and_write(2, bytes(0)).await.unwrap();
        assert!(matches!(got, Written::Corrupt(_)), "{writer:?}: {got:?}");
        // Hashed as they arrived: the hash worked out over these bytes decides, so the
        // wrong chunk's bytes with their own (true) hash are refused as well.
        let wrong = bytes(0);
        let got = shard
            .verify_and_write_hashed(2, wrong.clone(), Some(Hashed::of(&wrong)))
            .await
            .unwrap();
        assert!(matches!(got, Written::Corrupt(_)), "{writer:?}: {got:?}");
        assert!(!shard.is_verified(2));

        let mut rx = shard.subscribe();
        for i in 0..shard.total_chunks() {
            // Every other chunk with the hash worked out as it arrived.
            let data = bytes(i);
            let hashed = (i % 2 == 1).then(|| Hashed::of(&data));
            let got = shard
                .verify_and_write_hashed(i, data, hashed)
                .await
                .unwrap();
            assert!(
                matches!(got, Written::Stored),
                "{writer:?} chunk {i}: {got:?}"
            );
            assert_eq!(*rx.borrow_and_update(), i + 1);
        }
        assert!(shard.is_complete());
        assert_eq!(std::fs::read(shard.path()).unwrap(), data[0], "{writer:?}");
        // Again: already had it. A bad copy of a chunk it has is still reported.
        let got = shard.verify_and_write(0, bytes(0)).await.unwrap();
        assert!(matches!(got, Written::AlreadyHad), "{writer:?}: {got:?}");
        let got = shard.verify_and_write(0, bytes(1)).await.unwrap();
        assert!(matches!(got, Written::Corrupt(_)), "{writer:?}: {got:?}");
        assert_eq!(std::fs::read(shard.path()).unwrap(), data[0], "{writer:?}");
        // Every chunk that came in was hashed once, sound or not, and timed.
        let times = &store.stats().chunk_verify;
        assert_eq!(
            times.count(),
            u64::from(shard.total_chunks()) + 5,
            "{writer:?}"
        );
        assert!(times.sum() > 0.0, "{writer:?}");
    }
}

#[tokio::test]
async fn incomplete_shard_never_complete_and_unverified_reads_fail() {
    let dir = tempfile::tempdir().unwrap();
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    let (m, data) = model("m", &[("x", 5 * 4096)]);
    let d = m.digest();
    store.put_manifest(&m).unwrap();
    let shard = store.shard(&d, 0, DataTier::Disk).unwrap();
    assert_eq!(
        std::fs::metadata(shard.path()).unwrap().len(),
        5 * 4096,
        "preallocated"
    );
    for i in [0, 1, 3, 4] {
        shard.write(chunk(&m, &data, 0, i)).await.unwrap();
        assert!(!shard.is_complete());
    }
    assert_eq!(shard.verified_count(), 4);
    assert!(matches!(
        shard.read(2),
        Err(StoreError::NotVerified { shard: 0, index: 2 })
    ));
    assert!(matches!(shard.read(5), Err(StoreError::NoSuchChunk { .. })));
    let set = shard.verified_set(0, 100);
    assert_eq!(set.missing().collect::<Vec<_>>(), vec![2]);
    assert_eq!(shard.verified_set(2, 4).iter().collect::<Vec<_>>(), vec![3]);
    shard.write(chunk(&m, &data, 0, 2)).await.unwrap();
    assert!(shard.is_complete());
}

#[tokio::test]
async fn chunk_of_another_shard_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    let (m, data) = model("m", &[("x", 4096), ("y", 4096)]);
    let d = m.digest();
    store.put_manifest(&m).unwrap();
    let shard = store.shard(&d, 0, DataTier::Disk).unwrap();
    let err = shard.write(chunk(&m, &data, 1, 0)).await.unwrap_err();
    assert!(matches!(err, StoreError::ChunkMismatch { .. }), "{err}");
    assert_eq!(shard.verified_count(), 0);
}

#[tokio::test]
async fn restart_recovers_bits_and_manifests() {
    let dir = tempfile::tempdir().unwrap();
    let (m, data) = model(
        "org/model",
        &[("sub/dir/a.safetensors", 4 * 4096), ("b", 4096)],
    );
    let (other, _) = model("org/model", &[("only", 10)]);
    let d = m.digest();
    {
        let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
        store.put_manifest(&other).unwrap();
        // A manifest with no data at all must survive too.
        store.put_manifest(&m).unwrap();
        assert_eq!(store.resolve("org/model"), None, "a manifest binds no name");
        store
            .bind_name(&m.name, d, BindingSource::Plan, 1_000)
            .unwrap();
        let a = store.shard(&d, 0, DataTier::Memory).unwrap();
        a.write(chunk(&m, &data, 0, 0)).await.unwrap();
        a.write(chunk(&m, &data, 0, 2)).await.unwrap();
        let b = store.shard(&d, 1, DataTier::Disk).unwrap();
        b.write(chunk(&m, &data, 1, 0)).await.unwrap();
    }
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    assert_eq!(store.manifest(&d).as_deref(), Some(&m));
    assert!(store.manifest(&other.digest()).is_some());
    assert_eq!(store.resolve("org/model"), Some(d), "the binding survives");
    // With its time: an older plan statement for another version is refused and counted.
    store
        .bind_name(&other.name, other.digest(), BindingSource::Plan, 999)
        .unwrap();
    assert_eq!(store.resolve("org/model"), Some(d));
    assert_eq!(
        store.stats().name_bindings_refused.load(Ordering::Relaxed),
        1
    );
    assert_eq!(store.resolve(&d.to_hex()), Some(d));
    assert_eq!(store.resolve("nope"), None);

    let a = store.existing_shard(&d, 0).unwrap();
    assert_eq!(a.tier(), DataTier::Memory);
    assert_eq!(a.verified_set(0, 4).iter().collect::<Vec<_>>(), vec![0, 2]);
    assert!(matches!(a.read(1), Err(StoreError::NotVerified { .. })));
    assert_eq!(&a.read(2).unwrap()[..], &data[0][2 * 4096..3 * 4096]);
    assert!(
        Arc::ptr_eq(&a, &store.shard(&d, 0, DataTier::Memory).unwrap()),
        "same Arc"
    );
    assert!(store.existing_shard(&d, 1).unwrap().is_complete());

    let mut holdings = store.holdings();
    holdings.sort_by_key(|h| h.tier == DataTier::Disk);
    assert_eq!(holdings.len(), 2);
    assert_eq!(holdings[0].tier, DataTier::Memory);
    assert_eq!(holdings[0].dir, store.model_dir(&d, DataTier::Memory));
    let verified: Vec<u32> = holdings[0].shards.iter().map(|s| s.verified).collect();
    assert_eq!(verified, vec![2, 0]);
    assert_eq!(holdings[1].shards[1].verified, 1);

    // Storing the other version again does not repoint the name; binding it does.
    store.put_manifest(&other).unwrap();
    assert_eq!(store.resolve("org/model"), Some(d));
    store
        .bind_name(&other.name, other.digest(), BindingSource::Import, 0)
        .unwrap();
    assert_eq!(store.resolve("org/model"), Some(other.digest()));
    // The registry does not know the name: a plan's binding goes, an import's stays.
    store
        .sync_names(
            std::slice::from_ref(&other.name),
            &Default::default(),
            2_000,
        )
        .unwrap();
    assert_eq!(store.resolve("org/model"), Some(other.digest()));
    store
        .bind_name(&other.name, d, BindingSource::Plan, 3_000)
        .unwrap();
    store
        .sync_names(
            std::slice::from_ref(&other.name),
            &Default::default(),
            4_000,
        )
        .unwrap();
    assert_eq!(store.resolve("org/model"), None);
}

#[tokio::test]
async fn verify_on_recover_catches_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let (m, data) = model("m", &[("x", 3 * 4096)]);
    let d = m.digest();
    let path = {
        let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
        store.put_manifest(&m).unwrap();
        let s = store.shard(&d, 0, DataTier::Disk).unwrap();
        for i in 0..3 {
            s.write(chunk(&m, &data, 0, i)).await.unwrap();
        }
        s.path().to_path_buf()
    };
    // Flip a byte of chunk 1 behind the store's back.
    let mut raw = std::fs::read(&path).unwrap();
    raw[4096 + 17] ^= 0xff;
    std::fs::write(&path, &raw).unwrap();

    // Without verification the bit is trusted.
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    assert!(store.existing_shard(&d, 0).unwrap().is_complete());
    drop(store);

    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, true)).unwrap();
    let s = store.existing_shard(&d, 0).unwrap();
    assert_eq!(s.verified_set(0, 3).iter().collect::<Vec<_>>(), vec![0, 2]);
    // The cleared bit is persisted.
    drop((s, store));
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    let s = store.existing_shard(&d, 0).unwrap();
    assert_eq!(s.verified_count(), 2);
    s.write(chunk(&m, &data, 0, 1)).await.unwrap();
    assert_eq!(s.read(1).unwrap(), &data[0][4096..2 * 4096]);
}

#[tokio::test]
async fn damaged_state_files_lose_bits_not_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let (m, data) = model("m", &[("x", 2 * 4096), ("y", 4096)]);
    let d = m.digest();
    let (bits, datafile) = {
        let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
        store.put_manifest(&m).unwrap();
        let x = store.shard(&d, 0, DataTier::Disk).unwrap();
        x.write(chunk(&m, &data, 0, 0)).await.unwrap();
        let y = store.shard(&d, 1, DataTier::Disk).unwrap();
        y.write(chunk(&m, &data, 1, 0)).await.unwrap();
        (
            store
                .tier_root(DataTier::Disk)
                .join(state_rel(&d))
                .join("0.bits"),
            y.path().to_path_buf(),
        )
    };
    std::fs::write(&bits, b"garbage").unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&datafile)
        .unwrap()
        .set_len(1)
        .unwrap();
    // A stray entry and a bogus manifest are skipped.
    std::fs::write(dir.path().join("disk/manifests/junk"), b"x").unwrap();
    std::fs::write(
        dir.path()
            .join(format!("disk/manifests/{}.scmf", "ab".repeat(32))),
        b"x",
    )
    .unwrap();
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    assert_eq!(
        store.shard(&d, 0, DataTier::Disk).unwrap().verified_count(),
        0
    );
    let y = store.shard(&d, 1, DataTier::Disk).unwrap();
    assert_eq!(y.verified_count(), 0, "data file of the wrong size");
    assert_eq!(std::fs::metadata(y.path()).unwrap().len(), 4096);
}

#[tokio::test]
async fn files_stay_inside_model_dir() {
    let dir = tempfile::tempdir().unwrap();
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    let (m, data) = model("evil/name", &[("deep/er/x.bin", 4096), ("y", 4096)]);
    let d = m.digest();
    store.put_manifest(&m).unwrap();
    for tier in [DataTier::Memory, DataTier::Disk] {
        let root = store.model_dir(&d, tier);
        for s in 0..2 {
            let shard = store.shard(&d, s, tier).unwrap();
            shard.write(chunk(&m, &data, s, 0)).await.unwrap();
            let canon = shard.path().canonicalize().unwrap();
            assert!(canon.starts_with(root.canonicalize().unwrap()), "{canon:?}");
        }
    }
    assert!(ShardPath::new("../x").is_err());
    assert!(ShardPath::new("/etc/passwd").is_err());
    let nested = shard_file(Path::new("/r"), &ShardPath::new("a/b").unwrap()).unwrap();
    assert_eq!(nested, Path::new("/r/a/b"));
    // Nothing was created outside the two tier roots.
    let mut top: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    top.sort();
    assert_eq!(top, vec!["disk", "mem"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writes_with_every_writer() {
    for writer in writers() {
        let dir = tempfile::tempdir().unwrap();
        let store = ShardStore::open(config(dir.path(), writer, false)).unwrap();
        let (m, data) = model("m", &[("x", 64 * 4096 + 7)]);
        let (m, data) = (Arc::new(m), Arc::new(data));
        let d = m.digest();
        store.put_manifest(&m).unwrap();
        let shard = store.shard(&d, 0, DataTier::Memory).unwrap();
        let mut tasks = Vec::new();
        // Four writers over interleaved chunks, each also rewriting every chunk once, so
        // duplicate writes race with first writes.
        for t in 0..4u32 {
            let (shard, m, data) = (shard.clone(), m.clone(), data.clone());
            tasks.push(tokio::spawn(async move {
                let mut fresh = 0;
                for round in 0..2 {
                    for i in (0..shard.total_chunks()).filter(|i| (i + round) % 4 == t) {
                        if shard.write(chunk(&m, &data, 0, i)).await.unwrap() {
                            fresh += 1;
                        }
                    }
                }
                fresh
            }));
        }
        let mut fresh = 0;
        for t in tasks {
            fresh += t.await.unwrap();
        }
        assert_eq!(
            fresh,
            shard.total_chunks(),
            "each chunk newly verified exactly once"
        );
        assert!(shard.is_complete());
        assert_eq!(*shard.subscribe().borrow(), shard.total_chunks());
        assert_eq!(std::fs::read(shard.path()).unwrap(), data[0]);
    }
}

#[tokio::test]
async fn remove_deletes_one_tier() {
    let dir = tempfile::tempdir().unwrap();
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    let (m, data) = model("m", &[("x", 4096)]);
    let d = m.digest();
    store.put_manifest(&m).unwrap();
    let mem = store.shard(&d, 0, DataTier::Memory).unwrap();
    mem.write(chunk(&m, &data, 0, 0)).await.unwrap();
    let disk = store.shard(&d, 0, DataTier::Disk).unwrap();
    store.remove(&d, DataTier::Memory).unwrap();
    assert!(!store.model_dir(&d, DataTier::Memory).exists());
    assert!(matches!(mem.read(0), Err(StoreError::Removed { .. })));
    assert!(Arc::ptr_eq(&store.existing_shard(&d, 0).unwrap(), &disk));
    assert_eq!(store.holdings().len(), 1);
    store.remove(&d, DataTier::Memory).unwrap();
    drop(store);
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    assert_eq!(store.holdings().len(), 1);
    assert!(store.manifest(&d).is_some());
    let err = store
        .shard(&ModelDigest([7; 32]), 0, DataTier::Disk)
        .unwrap_err();
    assert!(matches!(err, StoreError::UnknownModel { .. }));
    assert!(matches!(
        store.shard(&d, 9, DataTier::Disk),
        Err(StoreError::NoSuchShard { .. })
    ));
}

/// Evicting a partial copy frees what it held and says how much; a restart collects what a
/// crash between removing a copy's state and its data left, and state no manifest explains.
#[tokio::test]
async fn remove_counts_the_bytes_and_a_restart_collects_orphans() {
    let dir = tempfile::tempdir().unwrap();
    let (m, data) = model("m", &[("x", 4 * CHUNK as u64), ("sub/y", 2 * CHUNK as u64)]);
    let d = m.digest();
    let mem_root = dir.path().join("mem");
    {
        let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
        store.put_manifest(&m).unwrap();
        // A partial copy: one chunk of four.
        let s = store.shard(&d, 0, DataTier::Memory).unwrap();
        s.write(chunk(&m, &data, 0, 1)).await.unwrap();
        drop(s);
        let freed = store.remove(&d, DataTier::Memory).unwrap();
        assert!(freed >= CHUNK as u64, "freed {freed}");
        assert_eq!(store.remove(&d, DataTier::Memory).unwrap(), 0);
        // Again, then a crash after the state went but before the data did.
        let s = store.shard(&d, 1, DataTier::Memory).unwrap();
        s.write(chunk(&m, &data, 1, 0)).await.unwrap();
        drop(s);
    }
    std::fs::remove_dir_all(mem_root.join(state_rel(&d))).unwrap();
    // State of a model whose manifest is nowhere, and a name that is not a digest (left).
    let stray = ModelDigest([9; 32]);
    std::fs::create_dir_all(mem_root.join(state_rel(&stray))).unwrap();
    std::fs::write(mem_root.join(state_rel(&stray)).join("0.bits"), [0u8; 4096]).unwrap();
    std::fs::create_dir_all(mem_root.join("models/not-a-digest")).unwrap();

    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    assert_eq!(store.stats().orphans_removed.load(Ordering::Relaxed), 2);
    assert!(store.stats().orphan_bytes_removed.load(Ordering::Relaxed) >= CHUNK as u64);
    assert!(!store.model_dir(&d, DataTier::Memory).exists());
    assert!(!mem_root.join(state_rel(&stray)).exists());
    assert!(mem_root.join("models/not-a-digest").exists());
    // The model is still known (its manifest is on disk) and nothing of it is held.
    assert!(store.manifest(&d).is_some());
    assert!(store.holdings().is_empty());
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn write_errors_are_returned() {
    // /dev/full fails every write with ENOSPC.
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        return;
    };
    let full = Arc::new(full);
    for writer in writers() {
        let w = ChunkWriter::new(writer).unwrap();
        let err = w
            .write_at(full.clone(), 0, Bytes::from_static(b"abc"))
            .await
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{writer:?}");
    }
}

/// Writes `data` as a kept file for `path` through `staging`, as the manifest build does.
fn keep(staging: &Staging, path: &str, data: &[u8]) {
    use std::io::Write;
    let mut f = crate::origin::KeepSink::open(staging, &ShardPath::new(path).unwrap()).unwrap();
    f.write_all(data).unwrap();
}

#[tokio::test]
async fn kept_files_are_adopted_without_rehashing_and_checked_before_use() {
    let dir = tempfile::tempdir().unwrap();
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    let (m, data) = model(
        "org/kept",
        &[
            ("sub/a.safetensors", 3 * 4096 + 100),
            ("b.bin", 4096),
            ("c.bin", 2 * 4096),
        ],
    );
    let d = m.digest();
    store.put_manifest(&m).unwrap();
    let staging = store.staging(DataTier::Memory).unwrap();
    keep(&staging, "sub/a.safetensors", &data[0]);
    // A kept file that is not the shard's size (a truncated copy) is refused and left.
    keep(&staging, "b.bin", &data[1][..100]);
    // c.bin is corrupted after it was hashed: a bit flipped at rest.
    let mut rotten = data[2].clone();
    rotten[4096 + 7] ^= 1;
    keep(&staging, "c.bin", &rotten);

    let a = store
        .adopt_kept(&d, 0, DataTier::Memory, &staging)
        .unwrap()
        .unwrap();
    assert!(a.is_complete());
    assert!(
        !staging.path().join("sub/a.safetensors").exists(),
        "moved, not copied"
    );
    assert_eq!(
        std::fs::read(
            store
                .model_dir(&d, DataTier::Memory)
                .join("sub/a.safetensors")
        )
        .unwrap(),
        data[0]
    );
    // Marked verified without hashing, but not trusted: the first read re-hashes.
    let before = store.stats().chunks_reverified.load(Ordering::Relaxed);
    assert!((0..a.total_chunks()).all(|i| a.needs_check(i)));
    assert_eq!(&a.read(1).unwrap()[..], &data[0][4096..2 * 4096]);
    assert_eq!(
        store.stats().chunks_reverified.load(Ordering::Relaxed),
        before + 1
    );
    assert!(!a.needs_check(1));
    // Open already: the caller tops it up instead.
    assert!(
        store
            .adopt_kept(&d, 0, DataTier::Memory, &staging)
            .unwrap()
            .is_none()
    );
    // Another tier than the staging's: not renamed across.
    assert!(
        store
            .adopt_kept(&d, 0, DataTier::Disk, &staging)
            .unwrap()
            .is_none()
    );

    let err = store
        .adopt_kept(&d, 1, DataTier::Memory, &staging)
        .unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    assert!(
        staging.path().join("b.bin").exists(),
        "moved back for the fallback"
    );
    assert!(store.tier_shard(&d, 1, DataTier::Memory).is_none());

    let c = store
        .adopt_kept(&d, 2, DataTier::Memory, &staging)
        .unwrap()
        .unwrap();
    assert!(c.read(0).is_ok());
    let err = c.read(1).unwrap_err();
    assert!(
        matches!(err, StoreError::CorruptChunk { index: 1, .. }),
        "{err}"
    );
    assert!(!c.is_complete());

    // The bits are persisted: a restart recovers the adopted shard as held.
    drop((a, c, staging));
    drop(store);
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, true)).unwrap();
    let holding = &store.holdings_of(&d)[0];
    assert_eq!(holding.shards[0].verified, holding.shards[0].total);
    assert_eq!(holding.shards[2].verified, holding.shards[2].total - 1);
}

#[test]
fn adopting_refuses_a_symlink_planted_as_the_kept_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    let (m, data) = model("org/kept", &[("a.bin", 4096)]);
    let d = m.digest();
    store.put_manifest(&m).unwrap();
    let staging = store.staging(DataTier::Memory).unwrap();
    let outside = dir.path().join("outside");
    std::fs::write(&outside, &data[0]).unwrap();
    std::os::unix::fs::symlink(&outside, staging.path().join("a.bin")).unwrap();
    let err = store
        .adopt_kept(&d, 0, DataTier::Memory, &staging)
        .unwrap_err();
    assert!(matches!(err, StoreError::Symlink { .. }), "{err}");
    assert!(store.tier_shard(&d, 0, DataTier::Memory).is_none());
    assert!(!store.model_dir(&d, DataTier::Memory).join("a.bin").exists());
}

/// A tmpfs of its own, mounted with `options` on a temporary directory and unmounted when
/// dropped; `None` (saying why) where the kernel lacks `MADV_POPULATE_WRITE` or the test
/// cannot mount (not root).
#[cfg(target_os = "linux")]
pub(super) struct SmallTmpfs(tempfile::TempDir);

#[cfg(target_os = "linux")]
impl SmallTmpfs {
    pub(super) fn mount(options: &str) -> Option<Self> {
        if ChunkWriter::new(WriterKind::Mapped).is_err() {
            eprintln!("SKIPPED: no MADV_POPULATE_WRITE here");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(dir.path())
            .status();
        if !matches!(mounted, Ok(s) if s.success()) {
            eprintln!("SKIPPED: cannot mount a tmpfs here ({mounted:?})");
            return None;
        }
        Some(Self(dir))
    }

    pub(super) fn path(&self) -> &Path {
        self.0.path()
    }
}

#[cfg(target_os = "linux")]
impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.0.path())
            .status();
    }
}

/// The mapped writer on a tmpfs with no room left: the chunk is refused with an error ("no
/// space"), as `pwrite` refuses it with ENOSPC, instead of a store into an unbacked page
/// raising SIGBUS and killing the daemon. Needs root (to mount a tmpfs of its own); skipped,
/// saying why, elsewhere.
#[cfg(target_os = "linux")]
#[test]
fn mapped_writes_into_a_full_tmpfs_fail_cleanly() {
    let Some(dir) = SmallTmpfs::mount("size=256k") else {
        return;
    };
    let path = dir.path().join("shard");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    // Sparse: the file is 4 MiB long, the tmpfs holds 256 KiB.
    file.set_len(4 << 20).unwrap();
    let map = super::map::WritableMap::new(&file, 4 << 20).unwrap();
    let small = vec![7u8; 64 << 10];
    map.write(0, &small).unwrap();
    let big = vec![9u8; 1 << 20];
    let err = map.write(1 << 20, &big).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::StorageFull, "{err}");
    assert!(err.to_string().contains("no space"), "{err}");
    // Outside the file: refused before any copy.
    let err = map.write(4 << 20, &small).unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    // What was written is there.
    let mut back = vec![0u8; 64 << 10];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut back, 0).unwrap();
    assert_eq!(back, small);
}

#[tokio::test(start_paused = true)]
async fn quiet_waits_its_time_from_the_start_and_after_every_change() {
    // As the memory reserve's filler uses it: not quiet at start, any change is movement.
    let idle = Duration::from_secs(1);
    let mut q = Quiet::new(idle, 0, (5, 0), false);
    assert!(!q.observe(5, 0), "not quiet before a full period");
    tokio::time::advance(idle).await;
    assert!(q.observe(5, 0));
    assert!(!q.observe(6, 0), "one chunk is movement");
    tokio::time::advance(idle).await;
    assert!(q.observe(6, 0));
    assert!(
        !q.observe(6, 1),
        "with no slack any growth of the loose count is movement"
    );
}

#[tokio::test]
async fn first_verified_agrees_with_one_lookup_a_chunk_across_byte_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    let store = ShardStore::open(config(dir.path(), WriterKind::Pwrite, false)).unwrap();
    let (m, data) = model("m", &[("x", 20 * 4096)]);
    store.put_manifest(&m).unwrap();
    let shard = store.shard(&m.digest(), 0, DataTier::Disk).unwrap();
    for i in [3, 7, 8, 9, 17] {
        shard.write(chunk(&m, &data, 0, i)).await.unwrap();
    }
    let skips: [&[u32]; 4] = [&[], &[3], &[3, 7, 8], &[3, 7, 8, 9, 17]];
    let mut found = 0;
    for skip in skips {
        for start in 0..=22 {
            for end in start..=22 {
                let naive = (start..end).find(|&i| !skip.contains(&i) && shard.is_verified(i));
                let got = shard.first_verified(start..end, |i| skip.contains(&i));
                assert_eq!(got, naive, "range {start}..{end}, skipping {skip:?}");
                found += usize::from(got.is_some());
            }
        }
    }
    assert!(
        found > 100,
        "the cases must find chunks, not only miss them"
    );
    assert_eq!(shard.first_verified(0..20, |_| false), Some(3));
    assert_eq!(shard.first_verified(10..20, |_| false), Some(17));
    assert_eq!(shard.first_verified(18..u32::MAX, |_| false), None);
}
