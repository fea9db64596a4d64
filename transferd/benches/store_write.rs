//! Chunk write throughput of the store's two positional writers.
//!
//! Writes a 64 MiB preallocated file as 1 MiB chunks (the default chunk size) with at most
//! 1 or 4 writes in flight, to a tmpfs file under `/dev/shm` (the memory tier) and to a
//! file on the disk under `target/` (the disk tier). Writes land in the page cache, as the
//! store's do (it does not fsync chunks), so this measures the write path, not the device.
//!
//! Run: `cargo bench -p transferd --bench store_write`

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use futures::stream::{self, StreamExt};
use transferd::store::{ChunkWriter, WriterKind};

/// Chunk size: the protocol's default.
const CHUNK: usize = 1 << 20;
/// Chunks per iteration: 64 MiB, large enough to amortise the per-iteration set-up.
const CHUNKS: u64 = 64;

fn write_file(
    rt: &tokio::runtime::Runtime,
    w: &ChunkWriter,
    file: &Arc<File>,
    data: &Bytes,
    c: usize,
) {
    rt.block_on(async {
        let writes = (0..CHUNKS).map(|i| w.write_at(file.clone(), i * CHUNK as u64, data.clone()));
        let mut done = stream::iter(writes).buffer_unordered(c);
        while let Some(r) = done.next().await {
            r.expect("chunk write");
        }
    });
}

fn bench(c: &mut Criterion) {
    // Two workers: the benchmark host has two cores.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let data = Bytes::from((0..CHUNK).map(|i| (i * 7) as u8).collect::<Vec<u8>>());
    let disk_root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    let targets = [
        ("tmpfs", Path::new("/dev/shm").to_path_buf()),
        ("disk", disk_root),
    ];
    let mut writers = vec![(
        "pwrite",
        ChunkWriter::new(WriterKind::Pwrite).expect("pwrite"),
    )];
    match ChunkWriter::new(WriterKind::IoUring) {
        Ok(w) => writers.push(("io_uring", w)),
        Err(e) => eprintln!("io_uring unavailable, benchmarking pwrite only: {e}"),
    }

    let mut group = c.benchmark_group("store_write");
    group.throughput(Throughput::Bytes(CHUNKS * CHUNK as u64));
    group.sample_size(20);
    for (target, root) in &targets {
        let Ok(dir) = tempfile::tempdir_in(root) else {
            eprintln!(
                "cannot create a file under {}; skipping {target}",
                root.display()
            );
            continue;
        };
        let file = File::create(dir.path().join("shard")).expect("create shard file");
        file.set_len(CHUNKS * CHUNK as u64).expect("preallocate");
        let file = Arc::new(file);
        for (name, w) in &writers {
            for conc in [1usize, 4] {
                let id = BenchmarkId::new(format!("{target}/{name}"), format!("c{conc}"));
                group.bench_with_input(id, &conc, |b, &conc| {
                    b.iter(|| write_file(&rt, w, &file, &data, conc));
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
