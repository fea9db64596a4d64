//! What writing a chunk into the store costs (step R7 of the copy map in
//! `transferd/src/chain/mod.rs`), and what the alternatives to a `pwrite` would cost.
//!
//! Every case writes a 64 MiB file as 1 MiB chunks (the default chunk size).
//!
//! * `store_write/<target>/<writer>/<pages>/c<n>`: the store's two positional writers with
//!   at most 1 or 4 writes in flight. `fresh` pages: each iteration writes a new sparse
//!   file, as the store does for every shard it receives (the kernel allocates a page per
//!   4 KiB on first write); `overwrite`: the file's pages exist already (what this bench
//!   measured before issue #16, which hid the allocation).
//! * `store_placement/<target>/<how>`: one chunk at a time into a fresh file, four ways:
//!   `pwrite` (what the store does), `fallocate+pwrite` (pages allocated ahead, in the
//!   timed section), `mapped` (a copy into a shared writable mapping of the file: the
//!   memory traffic of receiving a chunk straight into the shard's mapping, where the
//!   socket's copy would land in the page cache and the `pwrite` disappear), and
//!   `pwritev-pages` (two chunks, a whole 2 MiB huge page, per `pwritev`: what the store does
//!   on a huge-page tmpfs, where a 1 MiB write into a new page makes the kernel zero the
//!   other half first).
//!
//! Targets: `tmpfs` (`/dev/shm`, the memory tier), `disk` (a file under `target/`: the
//! page cache, as the store never fsyncs chunks), and `huge` when
//! `SHARDCAST_BENCH_HUGE_TMPFS` names a directory on a tmpfs mounted with `huge=`.
//! Files are created and removed outside the timed sections.
//!
//! Run: `cargo bench -p transferd --bench store_write`

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use futures::stream::{self, StreamExt};
use transferd::store::{ChunkWriter, WriterKind};

/// Chunk size: the protocol's default.
const CHUNK: usize = 1 << 20;
/// Chunks per iteration: 64 MiB, large enough to amortise the per-iteration set-up.
const CHUNKS: u64 = 64;
const FILE_LEN: u64 = CHUNKS * CHUNK as u64;

/// A file of `FILE_LEN` bytes under `dir`, sparse, or with every page written once.
/// Removed (its pages freed) when dropped, outside the timed section.
struct Target {
    file: Arc<File>,
    _dir: tempfile::TempDir,
}

impl Target {
    fn new(root: &Path, written: bool, data: &[u8]) -> Self {
        let dir = tempfile::tempdir_in(root).expect("scratch directory");
        let file = File::create_new(dir.path().join("shard")).expect("create shard file");
        file.set_len(FILE_LEN).expect("size the shard file");
        if written {
            for i in 0..CHUNKS {
                file.write_all_at(data, i * CHUNK as u64)
                    .expect("write once");
            }
        }
        Self {
            file: Arc::new(file),
            _dir: dir,
        }
    }
}

fn write_file(rt: &tokio::runtime::Runtime, w: &ChunkWriter, t: &Target, data: &Bytes, c: usize) {
    rt.block_on(async {
        let writes =
            (0..CHUNKS).map(|i| w.write_at(t.file.clone(), i * CHUNK as u64, data.clone()));
        let mut done = stream::iter(writes).buffer_unordered(c);
        while let Some(r) = done.next().await {
            r.expect("chunk write");
        }
    });
}

/// The ways of getting one chunk's bytes into a fresh file that `store_placement` compares.
#[derive(Clone, Copy)]
enum Placement {
    Pwrite,
    FallocatePwrite,
    Mapped,
    PwritevPages,
}

impl Placement {
    const ALL: [Self; 4] = [
        Self::Pwrite,
        Self::FallocatePwrite,
        Self::Mapped,
        Self::PwritevPages,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Pwrite => "pwrite",
            Self::FallocatePwrite => "fallocate+pwrite",
            Self::Mapped => "mapped",
            Self::PwritevPages => "pwritev-pages",
        }
    }

    // The one `unsafe`: mapping the file writable for `Mapped` (memmap2 cannot check that
    // nothing else changes the file's length while it is mapped).
    #[allow(unsafe_code)]
    fn run(self, t: &Target, data: &[u8]) {
        let file = &*t.file;
        match self {
            Self::Pwrite => {
                for i in 0..CHUNKS {
                    file.write_all_at(data, i * CHUNK as u64).expect("pwrite");
                }
            }
            Self::FallocatePwrite => {
                rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, FILE_LEN)
                    .expect("fallocate");
                for i in 0..CHUNKS {
                    file.write_all_at(data, i * CHUNK as u64).expect("pwrite");
                }
            }
            Self::PwritevPages => {
                let page = [std::io::IoSlice::new(data), std::io::IoSlice::new(data)];
                for i in (0..CHUNKS).step_by(2) {
                    let n = rustix::io::pwritev(file, &page, i * CHUNK as u64).expect("pwritev");
                    assert_eq!(n, 2 * CHUNK, "short pwritev");
                }
            }
            Self::Mapped => {
                // SAFETY: the file was created by this process in its own temporary
                // directory and nothing else maps, truncates or writes it while the map
                // lives (the map is dropped before `t`).
                let mut map = unsafe { memmap2::MmapMut::map_mut(file) }.expect("map the file");
                for piece in map.chunks_exact_mut(CHUNK) {
                    piece.copy_from_slice(data);
                }
            }
        }
    }
}

fn bench(c: &mut Criterion) {
    // Two workers: the benchmark host has two cores.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let data = Bytes::from((0..CHUNK).map(|i| (i * 7) as u8).collect::<Vec<u8>>());
    let mut targets: Vec<(&str, PathBuf)> = vec![
        ("tmpfs", PathBuf::from("/dev/shm")),
        (
            "disk",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
        ),
    ];
    if let Some(huge) = std::env::var_os("SHARDCAST_BENCH_HUGE_TMPFS") {
        targets.push(("huge", PathBuf::from(huge)));
    }
    targets.retain(|(name, root)| {
        let ok = tempfile::tempdir_in(root).is_ok();
        if !ok {
            eprintln!(
                "cannot create a file under {}; skipping {name}",
                root.display()
            );
        }
        ok
    });
    let mut writers = vec![(
        "pwrite",
        ChunkWriter::new(WriterKind::Pwrite).expect("pwrite"),
    )];
    match ChunkWriter::new(WriterKind::IoUring) {
        Ok(w) => writers.push(("io_uring", w)),
        Err(e) => eprintln!("io_uring unavailable, benchmarking pwrite only: {e}"),
    }

    let mut group = c.benchmark_group("store_write");
    group.throughput(Throughput::Bytes(FILE_LEN));
    group.sample_size(20);
    for (target, root) in &targets {
        for (name, w) in &writers {
            for (pages, written) in [("fresh", false), ("overwrite", true)] {
                for conc in [1usize, 4] {
                    let id =
                        BenchmarkId::new(format!("{target}/{name}/{pages}"), format!("c{conc}"));
                    group.bench_with_input(id, &conc, |b, &conc| {
                        b.iter_batched_ref(
                            || Target::new(root, written, &data),
                            |t| write_file(&rt, w, t, &data, conc),
                            BatchSize::PerIteration,
                        );
                    });
                }
            }
        }
    }
    group.finish();

    let mut group = c.benchmark_group("store_placement");
    group.throughput(Throughput::Bytes(FILE_LEN));
    group.sample_size(20);
    for (target, root) in &targets {
        for how in Placement::ALL {
            group.bench_function(format!("{target}/{}", how.name()), |b| {
                b.iter_batched_ref(
                    || Target::new(root, false, &data),
                    |t| how.run(t, &data),
                    BatchSize::PerIteration,
                );
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
