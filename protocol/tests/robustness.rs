//! Decoder robustness: truncated, hostile and random input is rejected with the right
//! [`DecodeError`], never a panic, and never an allocation sized by an unchecked length.
//!
//! The last tests run the fuzz targets' bodies (`support/fuzz_checks.rs`, shared with
//! `protocol/fuzz/`) over a deterministic corpus of mutated valid frames, so the fuzz
//! invariants are exercised on stable Rust in every `cargo test`.

#[path = "support/fuzz_checks.rs"]
mod fuzz_checks;
#[path = "support/strategies.rs"]
mod strategies;

use bytes::{BufMut, Bytes};
use fuzz_checks::{FrameOutcome, check_frame_bytes, check_manifest_bytes};
use proptest::prelude::*;
use shardcast_protocol::codec::{decode_exact, encode_to_vec};
use shardcast_protocol::frame::{
    FrameHeader, HEADER_LEN, HELLO_MAGIC, MAX_HOPS, MAX_MESSAGE_LEN, MAX_UPSTREAM_HOPS,
};
use shardcast_protocol::manifest::{
    MAX_CHUNK_SIZE, MAX_CHUNKS_PER_SHARD, MAX_MANIFEST_LEN, MAX_SHARDS, MIN_CHUNK_SIZE,
};
use shardcast_protocol::{
    ChunkHash, ChunkSet, Codec, DataTier, DecodeError, ErrorCode, Frame, FrameType, Hop, Manifest,
    ModelDigest, ModelName, SessionHeader, SessionId, ShardEntry, ShardPath,
};

const ALL_TYPES: [FrameType; 14] = [
    FrameType::Hello,
    FrameType::Manifest,
    FrameType::Open,
    FrameType::Accept,
    FrameType::Chunk,
    FrameType::Ack,
    FrameType::Nack,
    FrameType::Progress,
    FrameType::Fetch,
    FrameType::Done,
    FrameType::Keepalive,
    FrameType::ChunkHead,
    FrameType::Piece,
    FrameType::Error,
];

fn small_manifest() -> Manifest {
    let shard = |path: &str, size: u64, n: usize| ShardEntry {
        path: ShardPath::new(path).unwrap(),
        size,
        hash: ChunkHash([7; 32]),
        chunks: (0..n).map(|i| ChunkHash([i as u8; 32])).collect(),
    };
    Manifest::new(
        ModelName::new("org/model").unwrap(),
        MIN_CHUNK_SIZE,
        vec![
            shard("a.safetensors", 5000, 2),
            shard("empty", 0, 0),
            shard("b/c", 4096, 1),
        ],
    )
    .unwrap()
}

fn small_chunk_set() -> ChunkSet {
    let mut s = ChunkSet::new(3, 14);
    for i in [3, 4, 9, 13] {
        s.insert(i);
    }
    s
}

/// One valid frame of every type, with non-trivial contents.
fn sample_frames() -> Vec<Frame> {
    let open = SessionHeader {
        session: SessionId([1; 16]),
        model: ModelDigest([2; 32]),
        shard: 1,
        start: 4,
        end: 90,
        tier: DataTier::Memory,
        origin: "https://origin.example/models/org/model".into(),
        downstream: vec![
            Hop {
                host: "h2".parse().unwrap(),
                addr: "10.0.0.2:7400".into(),
            },
            Hop {
                host: "h3".parse().unwrap(),
                addr: "[::1]:7400".into(),
            },
        ],
        token: bytes::Bytes::from_static(b"signed plan token"),
        upstream: Vec::new(),
        transport: Default::default(),
    };
    vec![
        Frame::Hello {
            version: 1,
            host: "host-a".parse().unwrap(),
        },
        Frame::Manifest(small_manifest()),
        Frame::Open(open),
        Frame::Accept {
            have: small_chunk_set(),
        },
        Frame::Chunk {
            shard: 2,
            index: 5,
            data: Bytes::from(vec![0x5a; 300]),
        },
        Frame::ChunkHead {
            shard: 2,
            index: 5,
            cvs: vec![[0x11; 32], [0x22; 32], [0x33; 32]],
        },
        Frame::Piece {
            shard: 2,
            index: 5,
            piece: 1,
            data: Bytes::from(vec![0x5b; 200]),
        },
        Frame::Ack { shard: 2, index: 5 },
        Frame::Nack { shard: 2, index: 6 },
        Frame::Progress {
            host: "h3".parse().unwrap(),
            shard: 2,
            verified: 10,
            total: 86,
        },
        Frame::Fetch {
            model: ModelDigest([3; 32]),
            shard: 0,
            start: 0,
            end: 2,
        },
        Frame::Done,
        Frame::Error {
            code: ErrorCode::Refused,
            message: "shutting down: späť".into(),
        },
    ]
}

/// Every strict prefix of a frame's encoding is `Truncated`, and `needed` says exactly how
/// many more bytes a stream reader must wait for before it can make progress: up to the end
/// of the header, then up to the end of the frame.
fn assert_prefixes_truncated(frame: &Frame) -> Result<(), TestCaseError> {
    // Cheap slices of one buffer, not a copy per prefix: the copies made this test
    // quadratic in the frame's length (33 s of CI's CPU on the 2-vCPU VM).
    let enc = Bytes::from(encode_to_vec(frame));
    for cut in 0..enc.len() {
        let mut buf = enc.slice(..cut);
        let expected = if cut < HEADER_LEN {
            HEADER_LEN - cut
        } else {
            enc.len() - cut
        };
        prop_assert_eq!(
            Frame::decode(&mut buf),
            Err(DecodeError::Truncated { needed: expected }),
            "prefix of {} bytes of {:?}",
            cut,
            frame.ty()
        );
        // A body cut short (the header having claimed the full length) is Truncated too.
        if cut > HEADER_LEN {
            let body = enc.slice(HEADER_LEN..cut);
            let err = Frame::decode_body(frame.ty(), body).unwrap_err();
            prop_assert!(
                matches!(err, DecodeError::Truncated { .. }),
                "{:?}: {}",
                frame.ty(),
                err
            );
        }
    }
    Ok(())
}

#[test]
fn every_strict_prefix_is_truncated() {
    for f in sample_frames() {
        assert_prefixes_truncated(&f).unwrap();
    }
    let m = encode_to_vec(&small_manifest());
    for cut in 0..m.len() {
        let err = Manifest::decode(&mut Bytes::copy_from_slice(&m[..cut])).unwrap_err();
        assert!(
            matches!(err, DecodeError::Truncated { .. }),
            "manifest cut at {cut}: {err}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn strict_prefixes_of_random_frames_are_truncated(f in strategies::frame()) {
        assert_prefixes_truncated(&f)?;
    }

    /// Arbitrary bytes never panic any decoder.
    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..4096)) {
        check_frame_bytes(&data);
        check_manifest_bytes(&data);
        let _ = decode_exact::<Frame>(Bytes::from(data));
    }

    /// Arbitrary bodies behind a well-formed header of every type: reaches each body decoder
    /// far more often than fully random bytes do.
    #[test]
    fn arbitrary_bodies_never_panic(
        ty in proptest::sample::select(ALL_TYPES.to_vec()),
        body in proptest::collection::vec(any::<u8>(), 0..4096),
    ) {
        let mut framed = Vec::with_capacity(HEADER_LEN + body.len());
        framed.put_u32(1 + body.len() as u32);
        framed.put_u8(ty as u8);
        framed.extend_from_slice(&body);
        if let FrameOutcome::Decoded(f) = check_frame_bytes(&framed) {
            prop_assert_eq!(f.ty(), ty);
        }
        check_manifest_bytes(&body);
    }
}

#[test]
fn huge_lengths_are_rejected_by_the_header() {
    for ty in ALL_TYPES {
        let max = ty.max_body_len();
        let header = |len: u32| {
            let mut h = [0u8; HEADER_LEN];
            h[..4].copy_from_slice(&len.to_be_bytes());
            h[4] = ty as u8;
            h
        };
        assert_eq!(
            FrameHeader::parse(header(u32::MAX)),
            Err(DecodeError::TooLong {
                field: "frame",
                len: u64::from(u32::MAX) - 1,
                max: max as u64
            }),
            "{ty:?}"
        );
        // The bound is inclusive: exactly the maximum passes, one more byte does not.
        let at_max = u32::try_from(max + 1).unwrap();
        assert_eq!(
            FrameHeader::parse(header(at_max)),
            Ok(FrameHeader { ty, body_len: max })
        );
        assert!(matches!(
            FrameHeader::parse(header(at_max + 1)),
            Err(DecodeError::TooLong { field: "frame", .. })
        ));
        // A zero length cannot even hold the type byte.
        assert!(matches!(
            FrameHeader::parse(header(0)),
            Err(DecodeError::Invalid { .. })
        ));
        // Whole-frame decoding rejects the header before waiting for (or allocating) a body.
        let err = Frame::decode(&mut Bytes::copy_from_slice(&header(u32::MAX))).unwrap_err();
        assert!(matches!(err, DecodeError::TooLong { .. }), "{ty:?}: {err}");
    }
}

#[test]
fn per_type_maximum_body_lengths() {
    // The values documented in docs/PROTOCOL.md.
    let control = 64 << 10;
    assert_eq!(FrameType::Hello.max_body_len(), control);
    assert_eq!(FrameType::Ack.max_body_len(), control);
    assert_eq!(FrameType::Nack.max_body_len(), control);
    assert_eq!(FrameType::Progress.max_body_len(), control);
    assert_eq!(FrameType::Fetch.max_body_len(), control);
    assert_eq!(FrameType::Done.max_body_len(), control);
    assert_eq!(FrameType::Keepalive.max_body_len(), control);
    assert_eq!(FrameType::Error.max_body_len(), control);
    assert_eq!(FrameType::Manifest.max_body_len(), MAX_MANIFEST_LEN);
    assert_eq!(
        FrameType::Chunk.max_body_len(),
        MAX_CHUNK_SIZE as usize + 12
    );
    assert_eq!(
        FrameType::Accept.max_body_len(),
        (MAX_CHUNKS_PER_SHARD / 8) as usize + 8
    );
    assert_eq!(
        FrameType::Open.max_body_len(),
        16 + 32
            + 13
            + 2
            + 4096
            + 2
            + MAX_HOPS * 514
            + 4
            + shardcast_protocol::plan::MAX_TOKEN_LEN
            + 2
            + MAX_UPSTREAM_HOPS * 514
            + 1
    );
    // The largest valid bodies fit their bound.
    let full_chunk = Frame::Chunk {
        shard: 0,
        index: 0,
        data: vec![0; MAX_CHUNK_SIZE as usize].into(),
    };
    assert_eq!(
        full_chunk.encoded_len() - HEADER_LEN,
        FrameType::Chunk.max_body_len()
    );
    let full_piece = Frame::Piece {
        shard: 0,
        index: 0,
        piece: 0,
        data: vec![0; shardcast_protocol::pieces::PIECE_SIZE].into(),
    };
    assert_eq!(
        full_piece.encoded_len() - HEADER_LEN,
        FrameType::Piece.max_body_len()
    );
    let full_head = Frame::ChunkHead {
        shard: 0,
        index: 0,
        cvs: vec![[0; 32]; shardcast_protocol::pieces::MAX_PIECES],
    };
    assert_eq!(
        full_head.encoded_len() - HEADER_LEN,
        FrameType::ChunkHead.max_body_len()
    );
    let full_set = Frame::Accept {
        have: ChunkSet::new(0, MAX_CHUNKS_PER_SHARD),
    };
    assert_eq!(
        full_set.encoded_len() - HEADER_LEN,
        FrameType::Accept.max_body_len()
    );
    let longest = "x".repeat(255);
    let full_open = Frame::Open(SessionHeader {
        session: SessionId([0; 16]),
        model: ModelDigest([0; 32]),
        shard: 0,
        start: 0,
        end: 0,
        tier: DataTier::Disk,
        origin: "o".repeat(4096),
        downstream: vec![
            Hop {
                host: longest.parse().unwrap(),
                addr: longest.clone()
            };
            MAX_HOPS
        ],
        token: bytes::Bytes::from(vec![0u8; shardcast_protocol::plan::MAX_TOKEN_LEN]),
        upstream: vec![
            Hop {
                host: longest.parse().unwrap(),
                addr: longest.clone()
            };
            MAX_UPSTREAM_HOPS
        ],
        transport: Default::default(),
    });
    assert_eq!(
        full_open.encoded_len() - HEADER_LEN,
        FrameType::Open.max_body_len()
    );
    assert_eq!(
        decode_exact::<Frame>(encode_to_vec(&full_open).into()).unwrap(),
        full_open
    );
}

#[test]
fn unknown_frame_types_are_rejected() {
    let known: Vec<u8> = ALL_TYPES.iter().map(|t| *t as u8).collect();
    assert_eq!(
        known,
        [
            0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x0a, 0x07, 0x08, 0x09, 0x0b, 0x0c, 0x0d, 0x0f
        ]
    );
    for b in 0..=u8::MAX {
        if known.contains(&b) {
            assert_eq!(FrameType::from_u8(b).unwrap() as u8, b);
            continue;
        }
        assert_eq!(FrameType::from_u8(b), Err(DecodeError::UnknownFrameType(b)));
        let header = [0, 0, 0, 1, b];
        assert_eq!(
            FrameHeader::parse(header),
            Err(DecodeError::UnknownFrameType(b))
        );
        // The type is checked before the length, so even a huge length reports the type.
        assert_eq!(
            Frame::decode(&mut Bytes::copy_from_slice(&[0xff, 0xff, 0xff, 0xff, b])),
            Err(DecodeError::UnknownFrameType(b))
        );
    }
}

/// Builds a frame of type `ty` around `body`.
fn framed(ty: FrameType, body: &[u8]) -> Bytes {
    let mut out = Vec::new();
    out.put_u32(1 + body.len() as u32);
    out.put_u8(ty as u8);
    out.extend_from_slice(body);
    out.into()
}

fn body_of(f: &Frame) -> Vec<u8> {
    encode_to_vec(f)[HEADER_LEN..].to_vec()
}

#[test]
fn hello_with_bad_magic() {
    let mut body = body_of(&Frame::Hello {
        version: 1,
        host: "a".parse().unwrap(),
    });
    assert_eq!(&body[..4], HELLO_MAGIC);
    body[0] = b'X';
    assert_eq!(
        Frame::decode(&mut framed(FrameType::Hello, &body)),
        Err(DecodeError::BadMagic {
            expected: HELLO_MAGIC
        })
    );
}

#[test]
fn hello_with_invalid_host_id() {
    for bad in ["", "host a", "h/1", "ü"] {
        let mut body = HELLO_MAGIC.to_vec();
        body.put_u16(1);
        body.put_u16(bad.len() as u16);
        body.extend_from_slice(bad.as_bytes());
        let err = Frame::decode(&mut framed(FrameType::Hello, &body)).unwrap_err();
        assert!(
            matches!(
                err,
                DecodeError::Invalid {
                    field: "host id",
                    ..
                }
            ),
            "{bad:?}: {err}"
        );
    }
    // A host id longer than 255 bytes is rejected by its length prefix.
    let mut body = HELLO_MAGIC.to_vec();
    body.put_u16(1);
    body.put_u16(256);
    body.extend_from_slice(&[b'a'; 256]);
    assert_eq!(
        Frame::decode(&mut framed(FrameType::Hello, &body)),
        Err(DecodeError::TooLong {
            field: "host id",
            len: 256,
            max: 255
        })
    );
}

/// The fixed part of an `Open` body up to (not including) the hop count.
fn open_prefix(start: u32, end: u32, tier: u8) -> Vec<u8> {
    let mut body = vec![0u8; 16 + 32];
    body.put_u32(0);
    body.put_u32(start);
    body.put_u32(end);
    body.put_u8(tier);
    body.put_u16(0); // empty origin
    body
}

#[test]
fn open_with_too_many_hops_and_a_short_body() {
    let mut body = open_prefix(0, 10, 0);
    body.put_u16(u16::MAX);
    assert_eq!(
        Frame::decode(&mut framed(FrameType::Open, &body)),
        Err(DecodeError::TooLong {
            field: "downstream hops",
            len: u64::from(u16::MAX),
            max: MAX_HOPS as u64
        })
    );
    // The maximum hop count is allowed, but hops that are not there are Truncated.
    let mut body = open_prefix(0, 10, 0);
    body.put_u16(MAX_HOPS as u16);
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Open, &body)),
        Err(DecodeError::Truncated { .. })
    ));
}

#[test]
fn open_with_invalid_fields() {
    let mut bad_tier = open_prefix(0, 1, 2);
    bad_tier.put_u16(0);
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Open, &bad_tier)),
        Err(DecodeError::Invalid { field: "tier", .. })
    ));
    // A transport byte this version does not know (nor a missing one).
    let mut bad_transport = open_prefix(0, 1, 0);
    bad_transport.put_u16(0); // no hops
    bad_transport.put_u32(0); // no token
    bad_transport.put_u16(0); // no upstream hops
    let mut missing_transport = bad_transport.clone();
    bad_transport.put_u8(2);
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Open, &bad_transport)),
        Err(DecodeError::Invalid {
            field: "transport",
            ..
        })
    ));
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Open, &missing_transport)),
        Err(DecodeError::Truncated { .. })
    ));
    missing_transport.put_u8(1);
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Open, &missing_transport)),
        Ok(Frame::Open(h)) if h.transport == shardcast_protocol::HopTransport::Quic
    ));
    let mut long_origin = open_prefix(0, 1, 0);
    long_origin.truncate(long_origin.len() - 2);
    long_origin.put_u16(4097);
    long_origin.extend_from_slice(&[b'o'; 4097]);
    long_origin.put_u16(0);
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Open, &long_origin)),
        Err(DecodeError::TooLong {
            field: "origin",
            len: 4097,
            max: 4096
        })
    ));
    let mut long_addr = open_prefix(0, 1, 0);
    long_addr.put_u16(1);
    long_addr.put_u16(1);
    long_addr.put_u8(b'h');
    long_addr.put_u16(256);
    long_addr.extend_from_slice(&[b'a'; 256]);
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Open, &long_addr)),
        Err(DecodeError::TooLong {
            field: "hop address",
            len: 256,
            max: 255
        })
    ));
}

#[test]
fn manifest_claiming_u32_max_shards() {
    let mut body = encode_to_vec(
        &Manifest::new(ModelName::new("m").unwrap(), MIN_CHUNK_SIZE, vec![]).unwrap(),
    );
    let n = body.len();
    body[n - 4..].copy_from_slice(&u32::MAX.to_be_bytes());
    let expected = DecodeError::TooLong {
        field: "shards",
        len: u64::from(u32::MAX),
        max: MAX_SHARDS.into(),
    };
    assert_eq!(
        Manifest::decode(&mut Bytes::from(body.clone())),
        Err(expected.clone())
    );
    assert_eq!(
        Frame::decode(&mut framed(FrameType::Manifest, &body)),
        Err(expected)
    );
    // The maximum shard count with no shards following is merely Truncated.
    body[n - 4..].copy_from_slice(&MAX_SHARDS.to_be_bytes());
    assert!(matches!(
        Manifest::decode(&mut Bytes::from(body)),
        Err(DecodeError::Truncated { .. })
    ));
}

#[test]
fn manifest_with_invalid_fields() {
    let good = encode_to_vec(&small_manifest());
    let name_len = "org/model".len();
    let chunk_size_at = 4 + 2 + 2 + name_len;

    let mut bad = good.clone();
    bad[..4].copy_from_slice(b"SCMX");
    assert!(matches!(
        decode_exact::<Manifest>(bad.into()),
        Err(DecodeError::BadMagic { .. })
    ));

    let mut bad = good.clone();
    bad[4..6].copy_from_slice(&2u16.to_be_bytes());
    assert_eq!(
        decode_exact::<Manifest>(bad.into()),
        Err(DecodeError::UnsupportedVersion {
            what: "manifest",
            version: 2
        })
    );

    for cs in [0, MIN_CHUNK_SIZE - 1, MAX_CHUNK_SIZE + 1, u32::MAX] {
        let mut bad = good.clone();
        bad[chunk_size_at..chunk_size_at + 4].copy_from_slice(&cs.to_be_bytes());
        assert!(
            matches!(
                decode_exact::<Manifest>(bad.into()),
                Err(DecodeError::Invalid {
                    field: "chunk_size",
                    ..
                })
            ),
            "chunk size {cs}"
        );
    }

    // "org/model" -> "../model": path traversal in the model name.
    let mut bad = good.clone();
    bad[8..11].copy_from_slice(b"../");
    assert!(matches!(
        decode_exact::<Manifest>(bad.into()),
        Err(DecodeError::Invalid {
            field: "model name",
            ..
        })
    ));

    // Shard "b/c" -> "/bc" (absolute), and "a.safetensors" -> duplicate of a later shard.
    let first_path_at = chunk_size_at + 8 + 2;
    let mut bad = good.clone();
    bad[first_path_at..first_path_at + 2].copy_from_slice(b"/x");
    assert!(matches!(
        decode_exact::<Manifest>(bad.into()),
        Err(DecodeError::Invalid {
            field: "shard path",
            ..
        })
    ));
    let dup = Manifest {
        shards: vec![
            small_manifest().shards[0].clone(),
            small_manifest().shards[0].clone(),
        ],
        ..small_manifest()
    };
    assert!(matches!(
        decode_exact::<Manifest>(encode_to_vec(&dup).into()),
        Err(DecodeError::Invalid {
            field: "shard path",
            ..
        })
    ));

    // A shard size that implies more than MAX_CHUNKS_PER_SHARD chunks.
    let size_at = first_path_at + "a.safetensors".len();
    let mut bad = good.clone();
    let too_big = u64::from(MAX_CHUNKS_PER_SHARD) * u64::from(MIN_CHUNK_SIZE) + 1;
    bad[size_at..size_at + 8].copy_from_slice(&too_big.to_be_bytes());
    assert!(matches!(
        decode_exact::<Manifest>(bad.into()),
        Err(DecodeError::TooLong {
            field: "shard chunks",
            ..
        })
    ));
    // A size one chunk larger: the hashes it needs are not there.
    let mut bad = good;
    bad[size_at..size_at + 8].copy_from_slice(&(5000u64 + 4096).to_be_bytes());
    assert!(decode_exact::<Manifest>(bad.into()).is_err());
}

#[test]
fn inverted_chunk_ranges_are_rejected() {
    let mut open = open_prefix(10, 9, 0);
    open.put_u16(0);
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Open, &open)),
        Err(DecodeError::Invalid {
            field: "chunk range",
            ..
        })
    ));
    let mut fetch = vec![0u8; 32];
    fetch.put_u32(0);
    fetch.put_u32(u32::MAX);
    fetch.put_u32(0);
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Fetch, &fetch)),
        Err(DecodeError::Invalid {
            field: "chunk range",
            ..
        })
    ));
    let mut set = Vec::new();
    set.put_u32(8);
    set.put_u32(0);
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Accept, &set)),
        Err(DecodeError::Invalid {
            field: "chunk set",
            ..
        })
    ));
    // Empty ranges are fine.
    let mut empty = Vec::new();
    empty.put_u32(8);
    empty.put_u32(8);
    assert_eq!(
        Frame::decode(&mut framed(FrameType::Accept, &empty)),
        Ok(Frame::Accept {
            have: ChunkSet::new(8, 8)
        })
    );
}

#[test]
fn chunk_sets_larger_than_a_shard_are_rejected() {
    let mut set = Vec::new();
    set.put_u32(0);
    set.put_u32(MAX_CHUNKS_PER_SHARD + 1);
    assert!(matches!(
        ChunkSet::decode(&mut Bytes::from(set)),
        Err(DecodeError::TooLong {
            field: "chunk set",
            ..
        })
    ));
}

#[test]
fn chunk_set_with_stray_bits_past_the_end() {
    // 11 chunks: 2 bytes, of which the top 5 bits of the second must be zero.
    for stray in 3..8 {
        let mut set = Vec::new();
        set.put_u32(100);
        set.put_u32(111);
        set.put_u8(0xff);
        set.put_u8(0b111 | 1 << stray);
        assert!(
            matches!(
                ChunkSet::decode(&mut Bytes::from(set)),
                Err(DecodeError::Invalid {
                    field: "chunk set",
                    ..
                })
            ),
            "bit {stray}"
        );
    }
    let mut ok = Vec::new();
    ok.put_u32(100);
    ok.put_u32(111);
    ok.put_u8(0xff);
    ok.put_u8(0b111);
    let set = ChunkSet::decode(&mut Bytes::from(ok)).unwrap();
    assert!(set.is_full());
    assert_eq!(set.len(), 11);
}

#[test]
fn chunk_length_field_must_match_the_body() {
    let body = |claimed: u32, actual: usize| {
        let mut b = Vec::new();
        b.put_u32(0);
        b.put_u32(0);
        b.put_u32(claimed);
        b.extend(std::iter::repeat_n(1u8, actual));
        b
    };
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Chunk, &body(10, 9))),
        Err(DecodeError::Truncated { needed: 1 })
    ));
    assert_eq!(
        Frame::decode(&mut framed(FrameType::Chunk, &body(10, 11))),
        Err(DecodeError::TrailingBytes(1))
    );
    assert_eq!(
        Frame::decode(&mut framed(FrameType::Chunk, &body(MAX_CHUNK_SIZE + 1, 0))),
        Err(DecodeError::TooLong {
            field: "chunk",
            len: u64::from(MAX_CHUNK_SIZE) + 1,
            max: MAX_CHUNK_SIZE.into()
        })
    );
}

#[test]
fn error_frame_invalid_message() {
    let mut body = Vec::new();
    body.put_u16(2);
    body.put_u16(2);
    body.extend_from_slice(&[0xc3, 0x28]); // invalid UTF-8
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Error, &body)),
        Err(DecodeError::Invalid {
            field: "error message",
            ..
        })
    ));
    let mut body = Vec::new();
    body.put_u16(2);
    body.put_u16(MAX_MESSAGE_LEN as u16 + 1);
    body.extend(std::iter::repeat_n(b'x', MAX_MESSAGE_LEN + 1));
    assert!(matches!(
        Frame::decode(&mut framed(FrameType::Error, &body)),
        Err(DecodeError::TooLong {
            field: "error message",
            ..
        })
    ));
}

#[test]
fn trailing_bytes_are_rejected() {
    for f in sample_frames() {
        // Inside the frame: the length claims one byte more than the body decodes.
        let mut body = body_of(&f);
        body.push(0);
        assert_eq!(
            Frame::decode(&mut framed(f.ty(), &body)),
            Err(DecodeError::TrailingBytes(1)),
            "{:?}",
            f.ty()
        );
        // After the frame: fine for a stream, an error for `decode_exact`.
        let mut enc = encode_to_vec(&f);
        enc.extend_from_slice(&[0, 0]);
        assert_eq!(
            decode_exact::<Frame>(enc.into()),
            Err(DecodeError::TrailingBytes(2))
        );
    }
    let mut m = encode_to_vec(&small_manifest());
    m.push(9);
    assert_eq!(
        decode_exact::<Manifest>(m.into()),
        Err(DecodeError::TrailingBytes(1))
    );
}

/// A small deterministic PRNG (xorshift64*), so the smoke corpus is the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const INTERESTING_U32: [u32; 8] = [
    0,
    1,
    0x7f,
    0xff,
    0x1_0000,
    0x7fff_ffff,
    0xffff_fffe,
    u32::MAX,
];

/// Applies 1 to 4 random mutations of the kinds a coverage-guided fuzzer favours.
fn mutate(rng: &mut Rng, input: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        if input.is_empty() {
            input.push(rng.next() as u8);
            continue;
        }
        let at = rng.below(input.len());
        match rng.below(8) {
            0 => input[at] ^= 1 << rng.below(8),
            1 => input[at] = rng.next() as u8,
            2 => input.truncate(at),
            3 => input.insert(at, rng.next() as u8),
            4 => {
                input.remove(at);
            }
            5 => {
                // An interesting big-endian u32 over a length or index field.
                let v = INTERESTING_U32[rng.below(INTERESTING_U32.len())].to_be_bytes();
                for (i, b) in v.iter().enumerate() {
                    if let Some(slot) = input.get_mut(at + i) {
                        *slot = *b;
                    }
                }
            }
            6 => {
                // An interesting big-endian u16 over a string length or count.
                let v = [0u16, 1, 0xff, 0x100, 0x400, 0x401, 0x1000, u16::MAX][rng.below(8)];
                for (i, b) in v.to_be_bytes().iter().enumerate() {
                    if let Some(slot) = input.get_mut(at + i) {
                        *slot = *b;
                    }
                }
            }
            _ => {
                // Duplicate a slice elsewhere.
                let len = 1 + rng.below(16.min(input.len() - at));
                let piece = input[at..at + len].to_vec();
                let to = rng.below(input.len() + 1);
                input.splice(to..to, piece);
            }
        }
    }
}

/// Re-frames a mutated body with a correct length, so mutations of the body reach the body
/// decoders instead of all failing at the header.
fn reframe(input: &[u8]) -> Vec<u8> {
    if input.len() < HEADER_LEN {
        return input.to_vec();
    }
    let mut out = Vec::with_capacity(input.len());
    out.put_u32((input.len() - 4) as u32);
    out.extend_from_slice(&input[4..]);
    out
}

/// The fuzz targets' bodies over 100 000 mutated valid frames (and the manifests among them).
/// Also checks that the corpus is not degenerate: a good share of mutants must still decode,
/// and every frame type must be reached.
#[test]
fn fuzz_bodies_over_a_mutated_corpus() {
    let seeds: Vec<Vec<u8>> = sample_frames().iter().map(encode_to_vec).collect();
    let manifest_seed = encode_to_vec(&small_manifest());
    let mut rng = Rng(0x5eed_cafe_f00d_d00d);
    let (mut decoded, mut rejected) = (0u32, 0u32);
    let mut types_decoded = std::collections::HashSet::new();
    for i in 0..100_000 {
        let mut input = seeds[i % seeds.len()].clone();
        mutate(&mut rng, &mut input);
        if rng.below(2) == 0 {
            input = reframe(&input);
        }
        match check_frame_bytes(&input) {
            FrameOutcome::Decoded(f) => {
                decoded += 1;
                types_decoded.insert(f.ty() as u8);
            }
            FrameOutcome::Rejected(_) => rejected += 1,
        }
        if i % 10 == 0 {
            let mut m = manifest_seed.clone();
            mutate(&mut rng, &mut m);
            check_manifest_bytes(&m);
        }
    }
    assert_eq!(decoded + rejected, 100_000);
    assert!(
        decoded > 5_000,
        "only {decoded} mutants decoded: the corpus is degenerate"
    );
    assert!(rejected > 5_000, "only {rejected} mutants were rejected");
    assert_eq!(
        types_decoded.len(),
        ALL_TYPES.len(),
        "types reached: {types_decoded:?}"
    );
}

/// Writes the seed frames as files into `$SHARDCAST_FUZZ_SEEDS`, to start a cargo-fuzz run
/// from valid inputs: see `protocol/fuzz/README.md`. A tool, not a test: ignored, so that it
/// never counts as a pass.
#[test]
#[ignore = "a tool: writes fuzz seeds into $SHARDCAST_FUZZ_SEEDS (run with --ignored)"]
fn write_fuzz_seeds_if_asked() {
    let dir = std::env::var_os("SHARDCAST_FUZZ_SEEDS")
        .expect("SHARDCAST_FUZZ_SEEDS names the corpus directory to write");
    let dir = std::path::PathBuf::from(dir);
    for sub in ["decode_frame", "decode_manifest"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    for (i, f) in sample_frames().iter().enumerate() {
        std::fs::write(
            dir.join("decode_frame").join(format!("seed-{i:02}")),
            encode_to_vec(f),
        )
        .unwrap();
    }
    std::fs::write(
        dir.join("decode_manifest/seed-00"),
        encode_to_vec(&small_manifest()),
    )
    .unwrap();
}
