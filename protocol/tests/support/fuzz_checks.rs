//! The bodies of the fuzz targets in `protocol/fuzz/`, shared with the stable-Rust smoke test
//! in `tests/robustness.rs` so that both exercise exactly the same checks.
//!
//! Each function takes arbitrary bytes, runs every decoder that applies to them and, whenever
//! a decoder accepts the input, checks the canonical-encoding invariants:
//! `encoded_len` equals the length of the encoding, re-encoding and decoding again gives the
//! same value, and the encoding is byte-for-byte the bytes that were decoded (there is exactly
//! one encoding of every value). A violated invariant panics, which is what a fuzzer reports.
//!
//! Depends only on `shardcast_protocol` and `bytes`, so the fuzz crate can include it with
//! `#[path]`.

use bytes::{Buf, Bytes};
use shardcast_protocol::codec::{decode_exact, encode_to_vec};
use shardcast_protocol::frame::{FrameHeader, HEADER_LEN};
use shardcast_protocol::{ChunkSet, Codec, DecodeError, Frame, Manifest};

/// What [`check_frame_bytes`] found at the front of the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FrameOutcome {
    /// A frame decoded and passed every invariant.
    Decoded(Frame),
    /// The decoder rejected the input.
    Rejected(DecodeError),
}

/// Feeds `data` to [`Frame::decode`] and to `FrameHeader::parse` + [`Frame::decode_body`],
/// checks that both paths agree, and that an accepted frame re-encodes canonically.
pub(crate) fn check_frame_bytes(data: &[u8]) -> FrameOutcome {
    let mut buf = Bytes::copy_from_slice(data);
    let whole = Frame::decode(&mut buf);
    let consumed = data.len() - buf.remaining();

    // The two-step path a stream reader takes: 5 header bytes, then exactly body_len bytes.
    let split = split_decode(data);
    assert_eq!(
        whole, split,
        "Frame::decode and FrameHeader::parse + decode_body disagree"
    );

    match whole {
        Ok(frame) => {
            let enc = encode_to_vec(&frame);
            assert_eq!(
                enc.len(),
                frame.encoded_len(),
                "encoded_len is wrong for {frame:?}"
            );
            assert_eq!(
                enc,
                data[..consumed],
                "decoded frame does not re-encode to its input"
            );
            let again: Frame = decode_exact(Bytes::from(enc)).expect("re-encoded frame decodes");
            assert_eq!(again, frame, "decode(encode(frame)) != frame");
            if let Frame::Manifest(m) = &frame {
                check_manifest_invariants(m);
            }
            if let Frame::Accept { have } = &frame {
                check_chunkset_invariants(have);
            }
            FrameOutcome::Decoded(frame)
        }
        Err(e) => FrameOutcome::Rejected(e),
    }
}

fn split_decode(data: &[u8]) -> Result<Frame, DecodeError> {
    let Some(header) = data.get(..HEADER_LEN) else {
        return Err(DecodeError::Truncated {
            needed: HEADER_LEN - data.len(),
        });
    };
    let header: [u8; HEADER_LEN] = header.try_into().expect("slice of HEADER_LEN bytes");
    let header = FrameHeader::parse(header)?;
    let rest = &data[HEADER_LEN..];
    if rest.len() < header.body_len {
        return Err(DecodeError::Truncated {
            needed: header.body_len - rest.len(),
        });
    }
    let body = Bytes::copy_from_slice(&rest[..header.body_len]);
    Frame::decode_body(header.ty, body)
}

/// Feeds `data` to the manifest decoder (and, for coverage of the same bytes, the chunk-set
/// decoder), checking the canonical-encoding invariants of whatever decodes.
pub(crate) fn check_manifest_bytes(data: &[u8]) -> Option<Manifest> {
    if let Ok(set) = ChunkSet::decode(&mut Bytes::copy_from_slice(data)) {
        check_chunkset_invariants(&set);
    }
    let mut buf = Bytes::copy_from_slice(data);
    let manifest = Manifest::decode(&mut buf).ok()?;
    let consumed = data.len() - buf.remaining();
    let enc = encode_to_vec(&manifest);
    assert_eq!(
        enc,
        data[..consumed],
        "decoded manifest does not re-encode to its input"
    );
    check_manifest_invariants(&manifest);
    Some(manifest)
}

fn check_manifest_invariants(m: &Manifest) {
    let enc = encode_to_vec(m);
    assert_eq!(enc.len(), m.encoded_len(), "manifest encoded_len is wrong");
    let again: Manifest = decode_exact(Bytes::from(enc.clone())).expect("re-encoded manifest");
    assert_eq!(&again, m, "decode(encode(manifest)) != manifest");
    assert_eq!(
        m.digest().0,
        *blake3::hash(&enc).as_bytes(),
        "digest is not BLAKE3(encoding)"
    );
    for s in &m.shards {
        let expected = s.size.div_ceil(u64::from(m.chunk_size));
        assert_eq!(
            s.chunks.len() as u64,
            expected,
            "chunk count disagrees with size"
        );
    }
}

fn check_chunkset_invariants(set: &ChunkSet) {
    let enc = encode_to_vec(set);
    assert_eq!(
        enc.len(),
        set.encoded_len(),
        "chunk set encoded_len is wrong"
    );
    let again: ChunkSet = decode_exact(Bytes::from(enc)).expect("re-encoded chunk set");
    assert_eq!(&again, set, "decode(encode(set)) != set");
    let range = set.range();
    assert_eq!(
        set.iter().count() as u32,
        set.len(),
        "iter and len disagree"
    );
    assert_eq!(
        u64::from(set.len()) + set.missing().count() as u64,
        u64::from(range.end - range.start),
        "held + missing != range length"
    );
}
