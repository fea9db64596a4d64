//! Round-trip properties of every wire type: `decode(encode(x)) == x`, `encoded_len()` is the
//! length of the encoding, the header-then-body decoding path agrees with whole-frame
//! decoding, and the zero-copy chunk prefix matches the encoder.

#[path = "support/strategies.rs"]
mod strategies;

use bytes::{Buf, Bytes};
use proptest::prelude::*;
use shardcast_protocol::codec::{decode_exact, encode_to_vec};
use shardcast_protocol::frame::{FrameHeader, HEADER_LEN};
use shardcast_protocol::{ChunkSet, Codec, ErrorCode, Frame, FrameType, Manifest, ModelDigest};
use strategies::{chunk_data, chunk_set, error_code, frame, manifest};

/// The type byte every variant must carry on the wire (the table in `docs/PROTOCOL.md`).
fn wire_type(frame: &Frame) -> u8 {
    match frame {
        Frame::Hello { .. } => 0x01,
        Frame::Manifest(_) => 0x02,
        Frame::Open(_) => 0x03,
        Frame::Accept { .. } => 0x04,
        Frame::Chunk { .. } => 0x05,
        Frame::Ack { .. } => 0x06,
        Frame::Nack { .. } => 0x0a,
        Frame::Progress { .. } => 0x07,
        Frame::Fetch { .. } => 0x08,
        Frame::Done => 0x09,
        Frame::Keepalive => 0x0b,
        Frame::ChunkHead { .. } => 0x0c,
        Frame::Piece { .. } => 0x0d,
        Frame::Error { .. } => 0x0f,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn frame_roundtrips(f in frame()) {
        let enc = encode_to_vec(&f);
        prop_assert_eq!(enc.len(), f.encoded_len());
        // Framing: u32 BE length counting the type byte, then the type byte.
        let len = u32::from_be_bytes(enc[..4].try_into().unwrap()) as usize;
        prop_assert_eq!(len, enc.len() - 4);
        prop_assert_eq!(enc[4], wire_type(&f));
        prop_assert_eq!(enc[4], f.ty() as u8);

        let back: Frame = decode_exact(Bytes::from(enc.clone())).unwrap();
        prop_assert_eq!(&back, &f);

        // Encoding into a `BytesMut` (another `BufMut`) gives the same bytes.
        let mut bm = bytes::BytesMut::new();
        f.encode(&mut bm);
        prop_assert_eq!(&bm[..], &enc[..]);
    }

    #[test]
    fn header_then_body_equals_whole_frame(f in frame()) {
        let enc = encode_to_vec(&f);
        let header = FrameHeader::parse(enc[..HEADER_LEN].try_into().unwrap()).unwrap();
        prop_assert_eq!(header.ty, f.ty());
        prop_assert_eq!(header.body_len, enc.len() - HEADER_LEN);
        prop_assert!(header.body_len <= header.ty.max_body_len());
        let body = Bytes::copy_from_slice(&enc[HEADER_LEN..]);
        let split = Frame::decode_body(header.ty, body).unwrap();
        let whole = Frame::decode(&mut Bytes::from(enc)).unwrap();
        prop_assert_eq!(&split, &whole);
        prop_assert_eq!(&split, &f);
    }

    /// Frames are self-delimiting: a stream of frames decodes one at a time, each decode
    /// consuming exactly its own bytes.
    #[test]
    fn frames_decode_back_to_back(frames in proptest::collection::vec(frame(), 1..6)) {
        let mut stream = Vec::new();
        for f in &frames {
            f.encode(&mut stream);
        }
        let mut buf = Bytes::from(stream);
        for f in &frames {
            let before = buf.remaining();
            let got = Frame::decode(&mut buf).unwrap();
            prop_assert_eq!(before - buf.remaining(), f.encoded_len());
            prop_assert_eq!(&got, f);
        }
        prop_assert_eq!(buf.remaining(), 0);
    }

    #[test]
    fn chunk_prefix_plus_data_is_the_chunk_frame(
        shard in any::<u32>(),
        index in any::<u32>(),
        data in chunk_data(),
    ) {
        let prefix = Frame::chunk_prefix(shard, index, data.len());
        let mut manual = prefix.to_vec();
        manual.extend_from_slice(&data);
        let frame = Frame::Chunk { shard, index, data };
        prop_assert_eq!(&manual, &encode_to_vec(&frame));
        prop_assert_eq!(decode_exact::<Frame>(Bytes::from(manual)).unwrap(), frame);
    }

    #[test]
    fn piece_prefix_plus_data_is_the_piece_frame(
        shard in any::<u32>(),
        index in any::<u32>(),
        piece in any::<u32>(),
        data in chunk_data(),
    ) {
        prop_assume!(data.len() <= shardcast_protocol::pieces::PIECE_SIZE);
        let prefix = Frame::piece_prefix(shard, index, piece, data.len());
        let mut manual = prefix.to_vec();
        manual.extend_from_slice(&data);
        let frame = Frame::Piece { shard, index, piece, data };
        prop_assert_eq!(&manual, &encode_to_vec(&frame));
        prop_assert_eq!(decode_exact::<Frame>(Bytes::from(manual)).unwrap(), frame);
    }

    #[test]
    fn manifest_roundtrips_and_digest_is_blake3_of_encoding(m in manifest()) {
        let enc = encode_to_vec(&m);
        prop_assert_eq!(enc.len(), m.encoded_len());
        let back: Manifest = decode_exact(Bytes::from(enc.clone())).unwrap();
        prop_assert_eq!(&back, &m);
        prop_assert_eq!(m.digest(), ModelDigest(*blake3::hash(&enc).as_bytes()));
        prop_assert_eq!(back.digest(), m.digest());
        // The manifest frame's body is exactly the manifest's canonical encoding.
        let frame = encode_to_vec(&Frame::Manifest(m.clone()));
        prop_assert_eq!(&frame[HEADER_LEN..], &enc[..]);
        prop_assert_eq!(frame[4], FrameType::Manifest as u8);
        // Chunk counts follow from size and chunk size; only the last chunk may be short.
        for s in &m.shards {
            prop_assert_eq!(s.chunks.len() as u64, s.size.div_ceil(u64::from(m.chunk_size)));
        }
    }

    #[test]
    fn manifest_digest_changes_with_any_field(m in manifest(), flip in any::<prop::sample::Index>()) {
        // Flipping any one bit of the encoding either makes it undecodable or yields a
        // manifest with a different digest: the digest pins every byte.
        let enc = encode_to_vec(&m);
        let bit = flip.index(enc.len() * 8);
        let mut bad = enc.clone();
        bad[bit / 8] ^= 1 << (bit % 8);
        if let Ok(other) = decode_exact::<Manifest>(Bytes::from(bad)) {
            prop_assert_ne!(other.digest(), m.digest());
        }
    }

    #[test]
    fn chunk_set_roundtrips(set in chunk_set()) {
        let enc = encode_to_vec(&set);
        prop_assert_eq!(enc.len(), set.encoded_len());
        let range = set.range();
        prop_assert_eq!(enc.len(), 8 + (range.end - range.start).div_ceil(8) as usize);
        let back: ChunkSet = decode_exact(Bytes::from(enc.clone())).unwrap();
        prop_assert_eq!(&back, &set);
        // Bitmap layout: bit i (LSB first within each byte) is chunk start + i.
        for i in range.clone() {
            let k = (i - range.start) as usize;
            let bit = enc[8 + k / 8] >> (k % 8) & 1 == 1;
            prop_assert_eq!(bit, set.contains(i));
        }
        prop_assert_eq!(set.iter().count() as u32, set.len());
        prop_assert_eq!(set.len() + set.missing().count() as u32, range.end - range.start);
        prop_assert_eq!(set.is_full(), set.missing().next().is_none());
    }

    #[test]
    fn error_codes_roundtrip(v in any::<u16>()) {
        let code = ErrorCode::from_u16(v);
        prop_assert_eq!(code.to_u16(), v);
        // Which values are named is `known_error_codes_have_fixed_wire_values`' table
        // (every value 0..=64 checked there): a range here went stale twice, when
        // `AlreadyFed` (11) and `NotReceiving` (12) were added, and failed only when
        // proptest drew the new value.
        if v > 64 {
            prop_assert!(matches!(code, ErrorCode::Other(_)), "{v} is named");
        }
    }

    #[test]
    fn error_frame_with_any_code_roundtrips(code in error_code(), msg in ".{0,200}") {
        let f = Frame::error(code, msg.clone());
        let enc = encode_to_vec(&f);
        prop_assert_eq!(u16::from_be_bytes([enc[5], enc[6]]), code.to_u16());
        prop_assert_eq!(decode_exact::<Frame>(Bytes::from(enc)).unwrap(), Frame::Error {
            code,
            message: msg,
        });
    }
}

#[test]
fn error_constructor_truncates_long_messages_on_a_char_boundary() {
    // 3-byte characters: 4096 is not a multiple of 3, so the cut must move back.
    let long = "模".repeat(2000);
    let f = Frame::error(ErrorCode::Internal, long);
    let Frame::Error { message, .. } = &f else {
        unreachable!()
    };
    assert_eq!(message.len(), 4095);
    assert!(message.chars().all(|c| c == '模'));
    let back: Frame = decode_exact(Bytes::from(encode_to_vec(&f))).unwrap();
    assert_eq!(back, f);
}

#[test]
fn known_error_codes_have_fixed_wire_values() {
    let table = [
        (ErrorCode::UnsupportedVersion, 1),
        (ErrorCode::Malformed, 2),
        (ErrorCode::UnknownFrameType, 3),
        (ErrorCode::UnknownModel, 4),
        (ErrorCode::InvalidName, 5),
        (ErrorCode::NoSuchChunk, 6),
        (ErrorCode::Refused, 7),
        (ErrorCode::Storage, 8),
        (ErrorCode::ProtocolViolation, 9),
        (ErrorCode::Internal, 10),
        (ErrorCode::AlreadyFed, 11),
        (ErrorCode::NotReceiving, 12),
    ];
    // Every value near the named ones: named exactly where the table says.
    for v in 0..=64u16 {
        let named = table.iter().any(|&(_, t)| t == v);
        assert_eq!(
            !matches!(ErrorCode::from_u16(v), ErrorCode::Other(_)),
            named,
            "{v}"
        );
    }
    for (code, v) in table {
        assert_eq!(code.to_u16(), v);
        assert_eq!(ErrorCode::from_u16(v), code);
    }
    assert_eq!(ErrorCode::from_u16(0), ErrorCode::Other(0));
    assert_eq!(ErrorCode::from_u16(13), ErrorCode::Other(13));
}

/// A fixed `Hello`, byte for byte: the example in `docs/PROTOCOL.md` is this encoding.
#[test]
fn hello_golden_bytes() {
    let f = Frame::Hello {
        version: shardcast_protocol::PROTOCOL_VERSION,
        host: "host-a".parse().unwrap(),
    };
    let enc = encode_to_vec(&f);
    // length 15 | type 0x01 | "SHCS" | version 7 | host: length 6, "host-a"
    assert_eq!(hex::encode(&enc), "0000000f015348435300070006686f73742d61");
}

/// Fixed encodings of the other small frames, so that the layouts in `docs/PROTOCOL.md`
/// are pinned by a test.
#[test]
fn golden_bytes_of_small_frames() {
    let fetch_hex = format!("0000002d 08 {} 00000001 00000002 00000003", "11".repeat(32));
    let cases: Vec<(Frame, &str)> = vec![
        (Frame::Done, "0000000109"),
        (Frame::Keepalive, "000000010b"),
        (
            Frame::Ack {
                shard: 1,
                index: 0x0203,
            },
            "00000009 06 00000001 00000203",
        ),
        (
            Frame::Nack {
                shard: 1,
                index: 0x0203,
            },
            "00000009 0a 00000001 00000203",
        ),
        (
            Frame::Progress {
                host: "h1".parse().unwrap(),
                shard: 2,
                verified: 3,
                total: 4,
            },
            "00000011 07 0002 6831 00000002 00000003 00000004",
        ),
        (
            Frame::Error {
                code: ErrorCode::NoSuchChunk,
                message: "gone".into(),
            },
            "00000009 0f 0006 0004 676f6e65",
        ),
        (
            Frame::Chunk {
                shard: 7,
                index: 9,
                data: Bytes::from_static(b"\xaa\xbb"),
            },
            "0000000f 05 00000007 00000009 00000002 aabb",
        ),
        (
            Frame::Accept {
                have: {
                    let mut s = ChunkSet::new(5, 15);
                    for i in [5, 7, 13, 14] {
                        s.insert(i);
                    }
                    s
                },
            },
            // 10 chunks: bits 0, 2 in byte 0 (0x05); bits 8, 9 -> byte 1 bits 0, 1 (0x03).
            "0000000b 04 00000005 0000000f 05 03",
        ),
        (
            Frame::Fetch {
                model: ModelDigest([0x11; 32]),
                shard: 1,
                start: 2,
                end: 3,
            },
            &fetch_hex,
        ),
    ];
    for (f, hex_bytes) in cases {
        let enc = encode_to_vec(&f);
        assert_eq!(hex::encode(&enc), hex_bytes.replace(' ', ""), "{f:?}");
        assert_eq!(decode_exact::<Frame>(Bytes::from(enc)).unwrap(), f);
    }
}

/// The `Open` layout, field by field, as documented.
#[test]
fn open_layout() {
    use shardcast_protocol::{DataTier, Hop, HopTransport, SessionHeader, SessionId};
    let h = SessionHeader {
        session: SessionId([0xab; 16]),
        model: ModelDigest([0xcd; 32]),
        shard: 1,
        start: 2,
        end: 3,
        tier: DataTier::Disk,
        origin: "o".into(),
        downstream: vec![Hop {
            host: "b".parse().unwrap(),
            addr: "b:1".into(),
        }],
        token: Bytes::from_static(b"tok"),
        upstream: vec![Hop {
            host: "a".parse().unwrap(),
            addr: "a:2".into(),
        }],
        transport: HopTransport::Quic,
    };
    let enc = encode_to_vec(&Frame::Open(h.clone()));
    let mut b = Bytes::from(enc.clone());
    assert_eq!(b.get_u32() as usize, enc.len() - 4);
    assert_eq!(b.get_u8(), 0x03);
    assert_eq!(b.copy_to_bytes(16)[..], [0xab; 16]);
    assert_eq!(b.copy_to_bytes(32)[..], [0xcd; 32]);
    assert_eq!((b.get_u32(), b.get_u32(), b.get_u32()), (1, 2, 3));
    assert_eq!(b.get_u8(), 1, "tier: 0 = memory, 1 = disk");
    assert_eq!(b.get_u16(), 1);
    assert_eq!(b.get_u8(), b'o');
    assert_eq!(b.get_u16(), 1, "hop count");
    assert_eq!((b.get_u16(), b.get_u8()), (1, b'b'));
    assert_eq!(b.get_u16(), 3);
    assert_eq!(&b.copy_to_bytes(3)[..], b"b:1");
    assert_eq!(b.get_u32(), 3, "token length");
    assert_eq!(&b.copy_to_bytes(3)[..], b"tok");
    assert_eq!(b.get_u16(), 1, "upstream hop count");
    assert_eq!((b.get_u16(), b.get_u8()), (1, b'a'));
    assert_eq!(b.get_u16(), 3);
    assert_eq!(&b.copy_to_bytes(3)[..], b"a:2");
    assert_eq!(b.get_u8(), 1, "transport: 0 = TCP, 1 = QUIC");
    assert!(!b.has_remaining());

    let mut mem = Vec::new();
    Frame::Open(SessionHeader {
        tier: DataTier::Memory,
        ..h
    })
    .encode(&mut mem);
    assert_eq!(mem[HEADER_LEN + 16 + 32 + 12], 0);
}
