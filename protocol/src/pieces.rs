//! Verified pieces of a chunk: forwarding a chunk before all of it has arrived.
//!
//! A hop that stores a chunk whole before forwarding it adds one chunk's link time per hop
//! (1 MiB at 250 Mbit/s is 34 ms; sixteen hops add half a second). A chunk's BLAKE3 hash is
//! the root of a binary tree over its bytes, so a chunk of more than [`PIECE_SIZE`] bytes
//! splits into pieces of [`PIECE_SIZE`] (the last one shorter) whose *chaining values*
//! ("CVs", the non-root hashes of those subtrees: [`blake3::hazmat`]) merge into that root.
//! A sender ships the CVs first (`ChunkHead`); the receiver checks that they merge into the
//! manifest's hash of the chunk ([`Manifest::piece_check`]) and then checks each piece
//! (`Piece`) against its CV as it arrives ([`PieceCheck::verify`]), so it can forward a
//! verified piece while the rest of the chunk is still on the wire. No byte is stored or
//! forwarded before it is verified against the manifest: a piece that matches its CV, with
//! CVs that merge into the manifest's hash, is the chunk's true content by BLAKE3's
//! collision resistance (the construction Bao's verified streaming uses).
//!
//! [`PIECE_SIZE`] is a power of two of at least BLAKE3's 1 KiB chunk, so every piece
//! boundary is a subtree boundary: in BLAKE3's tree the left subtree of any span longer
//! than a piece is the largest power of two of 1 KiB chunks shorter than the span, which
//! is a whole number of pieces. [`ChunkHasher`] hashes a whole chunk piece by piece as its
//! bytes stream past and gives the root and the CVs with the same work as one hash.

use blake3::hazmat::{HasherExt, Mode, merge_subtrees_non_root, merge_subtrees_root};
use bytes::Bytes;

use crate::manifest::{ChunkHash, Manifest, VerifyError};

/// Bytes in a piece (the last piece of a chunk may be shorter). Rationale: a quarter of the
/// default 1 MiB chunk cuts a hop's store-and-forward delay by four while keeping each
/// piece large enough that BLAKE3 runs its widest SIMD paths over it and the per-piece
/// frame costs nothing measurable (20 bytes in 256 KiB).
pub const PIECE_SIZE: usize = 256 << 10;

/// The chaining value of one piece (the non-root BLAKE3 hash of its subtree).
pub type PieceCv = [u8; 32];

/// Most pieces in one chunk (`MAX_CHUNK_SIZE / PIECE_SIZE`).
pub const MAX_PIECES: usize = crate::manifest::MAX_CHUNK_SIZE as usize / PIECE_SIZE;

/// Pieces in a chunk of `len` bytes: 0 when it is one piece or less (such a chunk is sent
/// whole), else `len / PIECE_SIZE` rounded up.
pub fn piece_count(len: usize) -> usize {
    if len <= PIECE_SIZE {
        0
    } else {
        len.div_ceil(PIECE_SIZE)
    }
}

/// The byte range of piece `piece` within a chunk of `len` bytes (`None` past its end, or
/// for a chunk not sent in pieces).
pub fn piece_span(len: usize, piece: u32) -> Option<std::ops::Range<usize>> {
    let piece = piece as usize;
    if piece >= piece_count(len) {
        return None;
    }
    let start = piece * PIECE_SIZE;
    Some(start..(start + PIECE_SIZE).min(len))
}

/// The CV of piece number `piece` of a chunk, over `data` (its bytes, non-empty).
pub fn piece_cv(piece: u32, data: &[u8]) -> PieceCv {
    let mut h = PieceHasher::new(piece);
    h.update(data);
    h.finish()
}

/// Hashes one piece as its bytes stream past (at most [`PIECE_SIZE`] of them): its CV.
#[derive(Debug, Clone)]
pub struct PieceHasher {
    hasher: blake3::Hasher,
    len: usize,
}

impl PieceHasher {
    /// A hasher for piece number `piece` of a chunk (its place in the chunk's tree).
    pub fn new(piece: u32) -> Self {
        let mut hasher = blake3::Hasher::new();
        hasher.set_input_offset(u64::from(piece) * PIECE_SIZE as u64);
        Self { hasher, len: 0 }
    }

    /// Feeds the next bytes of the piece; bytes past [`PIECE_SIZE`] are ignored (a piece
    /// that long fails its length check anyway).
    pub fn update(&mut self, data: &[u8]) {
        let take = data.len().min(PIECE_SIZE - self.len);
        self.hasher.update(&data[..take]);
        self.len += take;
    }

    /// The piece's CV (of no bytes: all zero, which no piece's CV is but by chance).
    pub fn finish(&self) -> PieceCv {
        if self.len == 0 {
            return [0; 32];
        }
        self.hasher.finalize_non_root()
    }
}

/// The chunk hash that `cvs` (one per piece, in order) merge into for a chunk of `len`
/// bytes; `None` when `cvs` is not exactly [`piece_count`]`(len)` long (or that is 0).
pub fn root_of(cvs: &[PieceCv], len: usize) -> Option<ChunkHash> {
    let n = piece_count(len);
    if n == 0 || cvs.len() != n {
        return None;
    }
    let split = blake3::hazmat::left_subtree_len(len as u64) as usize;
    let left = subtree(&cvs[..split / PIECE_SIZE], split);
    let right = subtree(&cvs[split / PIECE_SIZE..], len - split);
    Some(ChunkHash(
        *merge_subtrees_root(&left, &right, Mode::Hash).as_bytes(),
    ))
}

/// The CV of the subtree over `len` bytes whose pieces' CVs are `cvs` (a non-root node).
fn subtree(cvs: &[PieceCv], len: usize) -> PieceCv {
    if len <= PIECE_SIZE {
        return cvs[0];
    }
    let split = blake3::hazmat::left_subtree_len(len as u64) as usize;
    let left = subtree(&cvs[..split / PIECE_SIZE], split);
    let right = subtree(&cvs[split / PIECE_SIZE..], len - split);
    merge_subtrees_non_root(&left, &right, Mode::Hash)
}

/// A chunk's hash worked out by this process over its bytes, with its pieces' CVs (empty
/// for a chunk of one piece or less).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hashed {
    /// The chunk's BLAKE3 hash.
    pub root: ChunkHash,
    /// Its pieces' CVs, in order.
    pub cvs: Vec<PieceCv>,
}

impl Hashed {
    /// Hashes `data` (a whole chunk) piece by piece.
    pub fn of(data: &[u8]) -> Self {
        let mut h = ChunkHasher::new();
        h.update(data);
        h.finish()
    }
}

/// Hashes a whole chunk as its bytes stream past (any slicing), piece by piece: the chunk's
/// hash and its pieces' CVs for the work of one hash.
#[derive(Debug, Clone)]
pub struct ChunkHasher {
    hasher: blake3::Hasher,
    /// Bytes fed into the current piece.
    in_piece: usize,
    cvs: Vec<PieceCv>,
    len: usize,
}

impl Default for ChunkHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkHasher {
    /// A hasher at the start of a chunk.
    pub fn new() -> Self {
        Self {
            hasher: blake3::Hasher::new(),
            in_piece: 0,
            cvs: Vec::new(),
            len: 0,
        }
    }

    /// Feeds the next bytes of the chunk.
    pub fn update(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            // A full piece is closed only once more bytes follow: a chunk of exactly one
            // piece has no CVs, its hash is the root of that piece.
            if self.in_piece == PIECE_SIZE {
                self.cvs.push(self.hasher.finalize_non_root());
                self.hasher = blake3::Hasher::new();
                self.hasher.set_input_offset(self.len as u64);
                self.in_piece = 0;
            }
            let take = (PIECE_SIZE - self.in_piece).min(data.len());
            self.hasher.update(&data[..take]);
            self.in_piece += take;
            self.len += take;
            data = &data[take..];
        }
    }

    /// The chunk's hash and its pieces' CVs.
    pub fn finish(mut self) -> Hashed {
        if self.cvs.is_empty() {
            return Hashed {
                root: ChunkHash(*self.hasher.finalize().as_bytes()),
                cvs: Vec::new(),
            };
        }
        self.cvs.push(self.hasher.finalize_non_root());
        let root = root_of(&self.cvs, self.len).unwrap_or(ChunkHash([0; 32]));
        Hashed {
            root,
            cvs: self.cvs,
        }
    }
}

/// What a chunk's pieces are checked against: CVs that merge into the manifest's hash of the
/// chunk. Made only by [`Manifest::piece_check`].
#[derive(Debug, Clone)]
pub struct PieceCheck {
    shard: u32,
    index: u32,
    offset: u64,
    len: usize,
    cvs: std::sync::Arc<[PieceCv]>,
}

impl PieceCheck {
    /// The chunk's shard.
    pub fn shard(&self) -> u32 {
        self.shard
    }
    /// The chunk's index in its shard.
    pub fn index(&self) -> u32 {
        self.index
    }
    /// The chunk's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Always false: a chunk in pieces is longer than one piece.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Pieces in the chunk.
    pub fn pieces(&self) -> u32 {
        self.cvs.len() as u32
    }
    /// The CVs (as sent on in a `ChunkHead`).
    pub fn cvs(&self) -> &std::sync::Arc<[PieceCv]> {
        &self.cvs
    }

    /// Checks `data` as piece `piece` of the chunk: its length, then its CV.
    pub fn verify(&self, piece: u32, data: &[u8]) -> Result<(), VerifyError> {
        self.verify_hashed(piece, data.len(), || piece_cv(piece, data))
    }

    /// As [`PieceCheck::verify`], with the piece's CV worked out by this process over the
    /// piece's `len` bytes as they arrived (never a CV a peer sent).
    pub fn verify_hashed(
        &self,
        piece: u32,
        len: usize,
        cv: impl FnOnce() -> PieceCv,
    ) -> Result<(), VerifyError> {
        let (shard, index) = (self.shard, self.index);
        let Some(span) = piece_span(self.len, piece) else {
            return Err(VerifyError::Piece {
                shard,
                index,
                piece,
                reason: format!("the chunk has {} pieces", self.cvs.len()),
            });
        };
        if len != span.len() {
            return Err(VerifyError::Piece {
                shard,
                index,
                piece,
                reason: format!("{len} bytes, expected {}", span.len()),
            });
        }
        if cv() != self.cvs[piece as usize] {
            return Err(VerifyError::Piece {
                shard,
                index,
                piece,
                reason: "hash mismatch".into(),
            });
        }
        Ok(())
    }

    /// The chunk, once every piece passed [`PieceCheck::verify`]: `pieces` are those pieces'
    /// bytes in order. Checks that they are all there and of the right lengths (their
    /// contents were checked piece by piece).
    pub fn assemble(&self, pieces: Vec<Bytes>) -> Result<VerifiedPieces, VerifyError> {
        let bad = |reason: String| VerifyError::Piece {
            shard: self.shard,
            index: self.index,
            piece: pieces.len() as u32,
            reason,
        };
        if pieces.len() != self.cvs.len() {
            return Err(bad(format!(
                "{} of {} pieces",
                pieces.len(),
                self.cvs.len()
            )));
        }
        for (i, p) in pieces.iter().enumerate() {
            let span = piece_span(self.len, i as u32).map_or(0, |s| s.len());
            if p.len() != span {
                return Err(bad(format!(
                    "piece {i} has {} bytes, expected {span}",
                    p.len()
                )));
            }
        }
        Ok(VerifiedPieces {
            shard: self.shard,
            index: self.index,
            offset: self.offset,
            pieces,
            cvs: self.cvs.clone(),
        })
    }
}

/// A chunk whose pieces each matched their CV, with CVs that merged into the manifest's
/// hash. It can only be made by [`PieceCheck::assemble`] (as a [`VerifiedChunk`] only by
/// [`Manifest::verified`]), so a store that takes one cannot be handed unverified data.
#[derive(Debug, Clone)]
pub struct VerifiedPieces {
    shard: u32,
    index: u32,
    offset: u64,
    pieces: Vec<Bytes>,
    cvs: std::sync::Arc<[PieceCv]>,
}

impl VerifiedPieces {
    /// The pieces' CVs.
    pub fn cvs(&self) -> &std::sync::Arc<[PieceCv]> {
        &self.cvs
    }
    /// Shard index.
    pub fn shard(&self) -> u32 {
        self.shard
    }
    /// Chunk index within the shard.
    pub fn index(&self) -> u32 {
        self.index
    }
    /// Byte offset of the chunk within its shard file.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// The chunk's length.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(Bytes::len).sum()
    }
    /// Whether it has no bytes (never, for a chunk sent in pieces).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The pieces' bytes, each with its offset within the shard file.
    pub fn pieces(&self) -> impl Iterator<Item = (u64, &Bytes)> {
        self.pieces
            .iter()
            .enumerate()
            .map(|(i, p)| (self.offset + (i * PIECE_SIZE) as u64, p))
    }
}

impl Manifest {
    /// Checks that `cvs` merge into this manifest's hash of chunk `index` of `shard` (and
    /// that the chunk is long enough to be sent in pieces): what the chunk's pieces are
    /// then checked against.
    pub fn piece_check(
        &self,
        shard: u32,
        index: u32,
        cvs: &[PieceCv],
    ) -> Result<PieceCheck, VerifyError> {
        let (offset, len) = self.chunk_span(shard, index)?;
        let n = piece_count(len);
        if n == 0 || cvs.len() != n {
            return Err(VerifyError::Piece {
                shard,
                index,
                piece: 0,
                reason: format!(
                    "{} piece hashes for a chunk of {len} bytes ({n} pieces)",
                    cvs.len()
                ),
            });
        }
        if root_of(cvs, len) != Some(self.shard(shard)?.chunks[index as usize]) {
            return Err(VerifyError::Hash { shard, index });
        }
        Ok(PieceCheck {
            shard,
            index,
            offset,
            len,
            cvs: cvs.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
            .collect()
    }

    const LENS: &[usize] = &[
        PIECE_SIZE + 1,
        PIECE_SIZE + 1024,
        2 * PIECE_SIZE,
        2 * PIECE_SIZE + 7,
        3 * PIECE_SIZE,
        3 * PIECE_SIZE + 999,
        4 * PIECE_SIZE,
        5 * PIECE_SIZE + 1,
        7 * PIECE_SIZE - 3,
        16 * PIECE_SIZE,
        (1 << 20) + 12_345,
    ];

    #[test]
    fn cvs_merge_into_the_chunk_hash() {
        for &len in LENS {
            let data = bytes(len, 3);
            let cvs: Vec<PieceCv> = (0..piece_count(len) as u32)
                .map(|p| piece_cv(p, &data[piece_span(len, p).unwrap()]))
                .collect();
            assert_eq!(
                root_of(&cvs, len),
                Some(ChunkHash(*blake3::hash(&data).as_bytes())),
                "len {len}"
            );
        }
    }

    #[test]
    fn the_streaming_hasher_matches_blake3_in_any_slicing() {
        for &len in LENS.iter().chain(&[0, 1, 1024, PIECE_SIZE - 1, PIECE_SIZE]) {
            let data = bytes(len, 9);
            let want = ChunkHash(*blake3::hash(&data).as_bytes());
            for step in [1usize << 16, 4096 + 17, PIECE_SIZE, len.max(1)] {
                let mut h = ChunkHasher::new();
                for part in data.chunks(step) {
                    h.update(part);
                }
                let got = h.finish();
                assert_eq!(got.root, want, "len {len} step {step}");
                assert_eq!(got.cvs.len(), piece_count(len));
                for (p, cv) in got.cvs.iter().enumerate() {
                    let span = piece_span(len, p as u32).unwrap();
                    assert_eq!(*cv, piece_cv(p as u32, &data[span]));
                }
            }
        }
    }

    #[test]
    fn wrong_or_missing_cvs_do_not_merge() {
        let len = 3 * PIECE_SIZE + 5;
        let data = bytes(len, 1);
        let h = Hashed::of(&data);
        assert_eq!(root_of(&h.cvs[..3], len), None);
        assert_eq!(root_of(&h.cvs, PIECE_SIZE), None);
        let mut bad = h.cvs.clone();
        bad[2][0] ^= 1;
        assert_ne!(root_of(&bad, len), Some(h.root));
        let mut swapped = h.cvs.clone();
        swapped.swap(0, 1);
        assert_ne!(root_of(&swapped, len), Some(h.root));
        // The tree's shape depends on the length only through the number of pieces: the
        // last piece's own length is in its CV, and `PieceCheck` checks every piece's
        // length against the manifest's length of the chunk.
    }

    #[test]
    fn small_chunks_have_no_pieces() {
        assert_eq!(piece_count(0), 0);
        assert_eq!(piece_count(PIECE_SIZE), 0);
        assert_eq!(piece_count(PIECE_SIZE + 1), 2);
        assert_eq!(piece_span(PIECE_SIZE, 0), None);
        assert_eq!(
            piece_span(PIECE_SIZE + 1, 1),
            Some(PIECE_SIZE..PIECE_SIZE + 1)
        );
        assert_eq!(piece_span(PIECE_SIZE + 1, 2), None);
        assert!(Hashed::of(&bytes(PIECE_SIZE, 0)).cvs.is_empty());
    }
}
