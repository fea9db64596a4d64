//! Whether the QUIC receiver should stop copying stream data into one frame buffer
//! (issue #16's "reassembly copy").
//!
//! quinn hands a stream's bytes over either copied into the caller's buffer
//! (`RecvStream::read`, what `FrameReader` uses) or as the received packets' own pieces
//! (`read_chunk`, no copy). Without the copy, a 1 MiB chunk would be hashed piece by piece
//! (`blake3::Hasher::update`). BLAKE3 hashes many 1 KiB chunks in parallel (SIMD) only
//! across a subtree that is contiguous and aligned in the input, so pieces of a packet's
//! payload, at arbitrary offsets, lose most of that parallelism.
//!
//! * `chunk_hash/contiguous`: one 1 MiB chunk in one buffer (the receiver's hash today).
//! * `chunk_hash/copy_then_hash/<piece>`: the pieces copied into one reused buffer, then
//!   hashed: the QUIC receiver today (its reassembly copy plus the hash).
//! * `chunk_hash/pieces/<piece>`: the pieces hashed in place: the receiver with
//!   `read_chunk`.
//!
//! Piece sizes: 1453 bytes (the average stream payload per packet at a 1472-byte UDP
//! payload, measured in issue #16's step 4) and 8596 (at 8972-byte jumbo packets, step 5).
//! Each piece lives in its own allocation, as each received datagram does.
//!
//! Run: `cargo bench -p transferd --bench chunk_hash`

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use shardcast_protocol::manifest::ChunkHash;

/// The protocol's default chunk size.
const CHUNK: usize = 1 << 20;
/// Average stream bytes per QUIC packet, standard and jumbo (BENCHMARKS, issue #16).
const PIECES: [usize; 2] = [1453, 8596];

fn chunk() -> Vec<u8> {
    (0..CHUNK)
        .map(|i| (i.wrapping_mul(31) % 251) as u8)
        .collect()
}

/// The chunk as separately allocated pieces of `piece` bytes (the last one shorter).
fn pieces(data: &[u8], piece: usize) -> Vec<Bytes> {
    data.chunks(piece).map(Bytes::copy_from_slice).collect()
}

fn bench(c: &mut Criterion) {
    let data = chunk();
    let expected = ChunkHash::of(&data);
    let mut g = c.benchmark_group("chunk_hash");
    g.throughput(Throughput::Bytes(CHUNK as u64));
    g.bench_function("contiguous", |b| b.iter(|| ChunkHash::of(&data)));
    for piece in PIECES {
        let parts = pieces(&data, piece);
        let mut frame = Vec::with_capacity(CHUNK);
        g.bench_with_input(
            BenchmarkId::new("copy_then_hash", piece),
            &parts,
            |b, parts| {
                b.iter(|| {
                    frame.clear();
                    for p in parts {
                        frame.extend_from_slice(p);
                    }
                    let h = ChunkHash::of(&frame);
                    assert_eq!(h, expected, "the copied chunk hashes as the original");
                    h
                })
            },
        );
        g.bench_with_input(BenchmarkId::new("pieces", piece), &parts, |b, parts| {
            b.iter(|| {
                let mut hasher = blake3::Hasher::new();
                for p in parts {
                    hasher.update(p);
                }
                let h = ChunkHash(*hasher.finalize().as_bytes());
                assert_eq!(h, expected, "the pieces hash as the original");
                h
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
