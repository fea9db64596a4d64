//! Model manifests: what a model is made of, and how each piece is verified.
//!
//! A [`Manifest`] lists a model's shards (relative path and size), the chunk size, a BLAKE3
//! hash for every chunk and for every whole shard. Its canonical binary encoding (see
//! `docs/PROTOCOL.md`) is hashed with BLAKE3 to give the [`ModelDigest`], which names this
//! exact version of the model everywhere: on the wire, in the store, in the API.
//!
//! [`ShardHasher`] hashes a shard as it streams past (an origin read once builds the
//! manifest). [`VerifiedChunk`] can only be made by [`Manifest::verified`], which checks the
//! chunk's BLAKE3 hash: code that takes one cannot be handed unverified bytes.

use std::fmt;
use std::str::FromStr;

use bytes::{Buf, BufMut};
use serde::{Deserialize, Serialize};

use crate::codec::{self, Codec, DecodeError, get_array, get_str, get_u16, get_u32, get_u64};
use crate::name::{MAX_MODEL_NAME_LEN, MAX_SHARD_PATH_LEN, ModelName, ShardPath};
use crate::pieces::{Hashed, PieceCv};

/// Magic at the start of an encoded manifest.
pub const MANIFEST_MAGIC: &[u8; 4] = b"SCMF";
/// Version of the manifest encoding.
pub const MANIFEST_VERSION: u16 = 1;
/// Largest chunk size a manifest may declare (16 MiB): bounds every chunk frame.
pub const MAX_CHUNK_SIZE: u32 = 16 << 20;
/// Smallest chunk size (4 KiB): keeps hash lists and per-chunk overheads bounded.
pub const MIN_CHUNK_SIZE: u32 = 4 << 10;
/// Default chunk size, 1 MiB. Rationale: a chain of h hops finishes in about
/// S/B + (h-1)·chunk/B, so small chunks keep the pipeline fill short (8 hops at 1 Gbit/s
/// cost 59 ms with 1 MiB chunks, 0.24 s with 4 MiB); below ~256 KiB per-chunk costs
/// (a hash, a frame, an ack, a positional write) start to show in throughput.
pub const DEFAULT_CHUNK_SIZE: u32 = 1 << 20;
/// Most chunks a single shard may have (2^24): with 16 MiB chunks, shards up to 256 TiB.
pub const MAX_CHUNKS_PER_SHARD: u32 = 1 << 24;
/// Most shards a model may have.
pub const MAX_SHARDS: u32 = 1 << 16;
/// Largest encoded manifest accepted (64 MiB).
pub const MAX_MANIFEST_LEN: usize = 64 << 20;

/// A BLAKE3 hash of one chunk or of one whole shard.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkHash(pub [u8; 32]);

/// The BLAKE3 digest of a manifest's canonical encoding: the identity of one model version.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelDigest(pub [u8; 32]);

macro_rules! hex_hash {
    ($t:ident) => {
        impl $t {
            /// Lower-case hex, 64 characters.
            pub fn to_hex(&self) -> String {
                hex::encode(self.0)
            }
            /// The hash of `data`.
            pub fn of(data: &[u8]) -> Self {
                Self(*blake3::hash(data).as_bytes())
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.to_hex())
            }
        }
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($t), &self.to_hex()[..16])
            }
        }
        impl FromStr for $t {
            type Err = DecodeError;
            fn from_str(s: &str) -> Result<Self, DecodeError> {
                let mut out = [0u8; 32];
                hex::decode_to_slice(s, &mut out).map_err(|e| DecodeError::Invalid {
                    field: stringify!($t),
                    reason: format!("expected 64 hex characters: {e}"),
                })?;
                Ok(Self(out))
            }
        }
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.to_hex())
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
hex_hash!(ChunkHash);
hex_hash!(ModelDigest);

/// One shard of a model: a file, its size and hashes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// File name relative to the model root.
    pub path: ShardPath,
    /// Size in bytes.
    pub size: u64,
    /// BLAKE3 of the whole file.
    pub hash: ChunkHash,
    /// BLAKE3 of each chunk, in order; the last chunk may be short.
    pub chunks: Vec<ChunkHash>,
}

/// Why a chunk failed verification.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// The shard index is not in the manifest.
    #[error("shard {shard} is not in the manifest ({shards} shards)")]
    NoSuchShard {
        /// The shard index asked for.
        shard: u32,
        /// How many shards the manifest has.
        shards: usize,
    },
    /// The chunk index is past the end of the shard.
    #[error("chunk {index} is past the end of shard {shard} ({chunks} chunks)")]
    NoSuchChunk {
        /// Shard index.
        shard: u32,
        /// Chunk index asked for.
        index: u32,
        /// Chunks in the shard.
        chunks: usize,
    },
    /// The chunk has the wrong length.
    #[error("chunk {shard}/{index} is {got} bytes; expected {expected}")]
    Length {
        /// Shard index.
        shard: u32,
        /// Chunk index.
        index: u32,
        /// Bytes received.
        got: usize,
        /// Bytes expected.
        expected: usize,
    },
    /// The chunk's BLAKE3 hash does not match the manifest.
    #[error("chunk {shard}/{index} hash mismatch")]
    Hash {
        /// Shard index.
        shard: u32,
        /// Chunk index.
        index: u32,
    },
    /// A piece of a chunk sent in pieces (`crate::pieces`) is not what its CV says, or the
    /// CVs do not fit the chunk.
    #[error("chunk {shard}/{index} piece {piece}: {reason}")]
    Piece {
        /// Shard index.
        shard: u32,
        /// Chunk index.
        index: u32,
        /// The piece.
        piece: u32,
        /// What is wrong.
        reason: String,
    },
}

/// A model's manifest. Construct with [`Manifest::new`] (which validates) or decode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The model's name.
    pub name: ModelName,
    /// Bytes per chunk (the last chunk of each shard may be shorter).
    pub chunk_size: u32,
    /// The shards in order.
    pub shards: Vec<ShardEntry>,
}

/// Number of chunks a shard of `size` bytes has with `chunk_size`-byte chunks.
pub fn chunk_count(size: u64, chunk_size: u32) -> u64 {
    size.div_ceil(u64::from(chunk_size.max(1)))
}

impl Manifest {
    /// Builds a manifest, checking that sizes, chunk counts and limits are consistent.
    pub fn new(
        name: ModelName,
        chunk_size: u32,
        shards: Vec<ShardEntry>,
    ) -> Result<Self, DecodeError> {
        let m = Self {
            name,
            chunk_size,
            shards,
        };
        m.validate()?;
        Ok(m)
    }

    fn validate(&self) -> Result<(), DecodeError> {
        if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&self.chunk_size) {
            return Err(DecodeError::Invalid {
                field: "chunk_size",
                reason: format!(
                    "{} is outside {MIN_CHUNK_SIZE}..={MAX_CHUNK_SIZE}",
                    self.chunk_size
                ),
            });
        }
        if self.shards.len() > MAX_SHARDS as usize {
            return Err(DecodeError::TooLong {
                field: "shards",
                len: self.shards.len() as u64,
                max: MAX_SHARDS.into(),
            });
        }
        let mut seen = std::collections::HashSet::new();
        for s in &self.shards {
            let n = chunk_count(s.size, self.chunk_size);
            if n > u64::from(MAX_CHUNKS_PER_SHARD) {
                return Err(DecodeError::TooLong {
                    field: "shard chunks",
                    len: n,
                    max: MAX_CHUNKS_PER_SHARD.into(),
                });
            }
            if n != s.chunks.len() as u64 {
                return Err(DecodeError::Invalid {
                    field: "shard chunks",
                    reason: format!(
                        "shard {} of {} bytes needs {n} chunk hashes, has {}",
                        s.path,
                        s.size,
                        s.chunks.len()
                    ),
                });
            }
            if !seen.insert(s.path.as_str()) {
                return Err(DecodeError::Invalid {
                    field: "shard path",
                    reason: format!("shard {} is listed twice", s.path),
                });
            }
        }
        Ok(())
    }

    /// The digest naming this manifest: BLAKE3 of its canonical encoding.
    pub fn digest(&self) -> ModelDigest {
        ModelDigest::of(&codec::encode_to_vec(self))
    }

    /// Total bytes over all shards.
    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.size).sum()
    }

    /// Total chunks over all shards.
    pub fn total_chunks(&self) -> u64 {
        self.shards.iter().map(|s| s.chunks.len() as u64).sum()
    }

    /// The shard at `shard`, if any.
    pub fn shard(&self, shard: u32) -> Result<&ShardEntry, VerifyError> {
        self.shards
            .get(shard as usize)
            .ok_or(VerifyError::NoSuchShard {
                shard,
                shards: self.shards.len(),
            })
    }

    /// Byte offset and length of chunk `index` of `shard`.
    pub fn chunk_span(&self, shard: u32, index: u32) -> Result<(u64, usize), VerifyError> {
        let s = self.shard(shard)?;
        if index as usize >= s.chunks.len() {
            return Err(VerifyError::NoSuchChunk {
                shard,
                index,
                chunks: s.chunks.len(),
            });
        }
        let offset = u64::from(index) * u64::from(self.chunk_size);
        let len = (s.size - offset).min(u64::from(self.chunk_size)) as usize;
        Ok((offset, len))
    }

    /// Checks `data` against the manifest's hash for chunk `index` of `shard`.
    pub fn verify_chunk(&self, shard: u32, index: u32, data: &[u8]) -> Result<(), VerifyError> {
        self.check_chunk(shard, index, data.len(), || ChunkHash::of(data))
    }

    /// As [`Manifest::verify_chunk`], hashing piece by piece ([`Hashed::of`], the same work):
    /// the chunk's hash and its pieces' CVs when it verifies.
    pub fn verify_chunk_hashed(
        &self,
        shard: u32,
        index: u32,
        data: &[u8],
    ) -> Result<Hashed, VerifyError> {
        let mut hashed = None;
        self.check_chunk(shard, index, data.len(), || {
            let h = Hashed::of(data);
            let root = h.root;
            hashed = Some(h);
            root
        })?;
        // Verified means hashed: the check calls the hash once the length matched.
        hashed.ok_or(VerifyError::Hash { shard, index })
    }

    /// The length check, then `hash()` against the manifest's hash of the chunk.
    fn check_chunk(
        &self,
        shard: u32,
        index: u32,
        len: usize,
        hash: impl FnOnce() -> ChunkHash,
    ) -> Result<(), VerifyError> {
        let (_, expected) = self.chunk_span(shard, index)?;
        if len != expected {
            return Err(VerifyError::Length {
                shard,
                index,
                got: len,
                expected,
            });
        }
        if hash() != self.shard(shard)?.chunks[index as usize] {
            return Err(VerifyError::Hash { shard, index });
        }
        Ok(())
    }

    /// As [`Manifest::verified`], with the BLAKE3 hash of `data` already computed by the
    /// caller: `hashed` must be `ChunkHash::of(&data)`, worked out by this process over
    /// exactly these bytes as they arrived (transferd's frame reader hashes a chunk's body
    /// piece by piece while the bytes are in cache) — never a hash a peer sent.
    pub fn verified_hashed(
        &self,
        shard: u32,
        index: u32,
        data: bytes::Bytes,
        hashed: Hashed,
    ) -> Result<VerifiedChunk, VerifyError> {
        self.wrap_verified(shard, index, data, |_| hashed)
    }

    /// Verifies a chunk and wraps it as a [`VerifiedChunk`], the only form the store accepts.
    /// The hash is worked out piece by piece ([`Hashed::of`]), so the chunk carries its
    /// pieces' CVs for a sender that forwards it in pieces.
    pub fn verified(
        &self,
        shard: u32,
        index: u32,
        data: bytes::Bytes,
    ) -> Result<VerifiedChunk, VerifyError> {
        self.wrap_verified(shard, index, data, Hashed::of)
    }

    /// Checks `data` with `hash(&data)` and wraps it as a [`VerifiedChunk`].
    fn wrap_verified(
        &self,
        shard: u32,
        index: u32,
        data: bytes::Bytes,
        hash: impl FnOnce(&[u8]) -> Hashed,
    ) -> Result<VerifiedChunk, VerifyError> {
        let mut cvs = Vec::new();
        self.check_chunk(shard, index, data.len(), || {
            let h = hash(&data);
            cvs = h.cvs;
            h.root
        })?;
        let (offset, _) = self.chunk_span(shard, index)?;
        // CVs that did not come with a chunk of that many pieces are not kept.
        if cvs.len() != crate::pieces::piece_count(data.len()) {
            cvs.clear();
        }
        Ok(VerifiedChunk {
            shard,
            index,
            offset,
            data,
            cvs,
        })
    }

    /// Index of the shard with path `path`.
    pub fn shard_index(&self, path: &str) -> Option<u32> {
        self.shards
            .iter()
            .position(|s| s.path.as_str() == path)
            .map(|i| i as u32)
    }
}

impl Codec for Manifest {
    fn decode<B: Buf>(buf: &mut B) -> Result<Self, DecodeError> {
        let magic: [u8; 4] = get_array(buf)?;
        if &magic != MANIFEST_MAGIC {
            return Err(DecodeError::BadMagic {
                expected: MANIFEST_MAGIC,
            });
        }
        let version = get_u16(buf)?;
        if version != MANIFEST_VERSION {
            return Err(DecodeError::UnsupportedVersion {
                what: "manifest",
                version,
            });
        }
        let name = get_str(buf, "model name", MAX_MODEL_NAME_LEN)?;
        let name = ModelName::new(name).map_err(|e| DecodeError::Invalid {
            field: "model name",
            reason: e.to_string(),
        })?;
        let chunk_size = get_u32(buf)?;
        if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&chunk_size) {
            return Err(DecodeError::Invalid {
                field: "chunk_size",
                reason: format!("{chunk_size} is outside {MIN_CHUNK_SIZE}..={MAX_CHUNK_SIZE}"),
            });
        }
        let nshards = get_u32(buf)?;
        if nshards > MAX_SHARDS {
            return Err(DecodeError::TooLong {
                field: "shards",
                len: nshards.into(),
                max: MAX_SHARDS.into(),
            });
        }
        let mut shards = Vec::new();
        for _ in 0..nshards {
            let path = get_str(buf, "shard path", MAX_SHARD_PATH_LEN)?;
            let path = ShardPath::new(path).map_err(|e| DecodeError::Invalid {
                field: "shard path",
                reason: e.to_string(),
            })?;
            let size = get_u64(buf)?;
            let n = chunk_count(size, chunk_size);
            if n > u64::from(MAX_CHUNKS_PER_SHARD) {
                return Err(DecodeError::TooLong {
                    field: "shard chunks",
                    len: n,
                    max: MAX_CHUNKS_PER_SHARD.into(),
                });
            }
            // Check that the hashes are really there before allocating room for them.
            codec::need(buf, 32 + 32 * n as usize)?;
            let hash = ChunkHash(get_array(buf)?);
            let mut chunks = Vec::with_capacity(n as usize);
            for _ in 0..n {
                chunks.push(ChunkHash(get_array(buf)?));
            }
            shards.push(ShardEntry {
                path,
                size,
                hash,
                chunks,
            });
        }
        Self::new(name, chunk_size, shards)
    }

    fn encode<B: BufMut>(&self, buf: &mut B) {
        buf.put_slice(MANIFEST_MAGIC);
        buf.put_u16(MANIFEST_VERSION);
        codec::put_str(buf, self.name.as_str());
        buf.put_u32(self.chunk_size);
        buf.put_u32(self.shards.len() as u32);
        for s in &self.shards {
            codec::put_str(buf, s.path.as_str());
            buf.put_u64(s.size);
            buf.put_slice(&s.hash.0);
            for c in &s.chunks {
                buf.put_slice(&c.0);
            }
        }
    }

    fn encoded_len(&self) -> usize {
        4 + 2
            + codec::str_len(self.name.as_str())
            + 4
            + 4
            + self
                .shards
                .iter()
                .map(|s| codec::str_len(s.path.as_str()) + 8 + 32 + 32 * s.chunks.len())
                .sum::<usize>()
    }
}

/// A chunk whose bytes matched the manifest's hash. It can only be made by
/// [`Manifest::verified`], so code that takes one cannot be handed unverified data.
#[derive(Debug, Clone)]
pub struct VerifiedChunk {
    shard: u32,
    index: u32,
    offset: u64,
    data: bytes::Bytes,
    cvs: Vec<PieceCv>,
}

impl VerifiedChunk {
    /// Its pieces' CVs, worked out with its hash (empty for a chunk of one piece or less,
    /// or where the hash was worked out whole).
    pub fn cvs(&self) -> &[PieceCv] {
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
    /// The verified bytes.
    pub fn data(&self) -> &bytes::Bytes {
        &self.data
    }
}

/// Hashes a shard as its bytes stream past, producing per-chunk hashes and the whole-shard
/// hash. Feed bytes in any slicing with [`ShardHasher::update`].
#[derive(Debug)]
pub struct ShardHasher {
    chunk_size: usize,
    whole: blake3::Hasher,
    chunk: blake3::Hasher,
    in_chunk: usize,
    size: u64,
    chunks: Vec<ChunkHash>,
}

impl ShardHasher {
    /// A hasher for chunks of `chunk_size` bytes.
    pub fn new(chunk_size: u32) -> Self {
        Self {
            chunk_size: chunk_size.max(1) as usize,
            whole: blake3::Hasher::new(),
            chunk: blake3::Hasher::new(),
            in_chunk: 0,
            size: 0,
            chunks: Vec::new(),
        }
    }

    /// Feeds the next bytes of the shard.
    pub fn update(&mut self, mut data: &[u8]) {
        self.whole.update(data);
        self.size += data.len() as u64;
        while !data.is_empty() {
            let take = (self.chunk_size - self.in_chunk).min(data.len());
            self.chunk.update(&data[..take]);
            self.in_chunk += take;
            data = &data[take..];
            if self.in_chunk == self.chunk_size {
                self.chunks
                    .push(ChunkHash(*self.chunk.finalize().as_bytes()));
                self.chunk.reset();
                self.in_chunk = 0;
            }
        }
    }

    /// Finishes the shard and returns its entry.
    pub fn finish(mut self, path: ShardPath) -> ShardEntry {
        if self.in_chunk > 0 {
            self.chunks
                .push(ChunkHash(*self.chunk.finalize().as_bytes()));
        }
        ShardEntry {
            path,
            size: self.size,
            hash: ChunkHash(*self.whole.finalize().as_bytes()),
            chunks: self.chunks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode_exact, encode_to_vec};
    use bytes::Bytes;

    pub(crate) fn sample(chunk_size: u32, sizes: &[u64]) -> Manifest {
        let shards = sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| {
                let data: Vec<u8> = (0..size).map(|b| (b as u8) ^ (i as u8)).collect();
                let mut h = ShardHasher::new(chunk_size);
                h.update(&data);
                h.finish(ShardPath::new(format!("shard-{i}.safetensors")).unwrap())
            })
            .collect();
        Manifest::new(ModelName::new("test/model").unwrap(), chunk_size, shards).unwrap()
    }

    #[test]
    fn roundtrip_and_digest_stable() {
        let m = sample(MIN_CHUNK_SIZE, &[0, 1, 4096, 4097, 20000]);
        let enc = encode_to_vec(&m);
        assert_eq!(enc.len(), m.encoded_len());
        let back: Manifest = decode_exact(Bytes::from(enc)).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.digest(), m.digest());
        assert_eq!(m.shards[3].chunks.len(), 2);
        let json = serde_json::to_string(&m).unwrap();
        let from_json: Manifest = serde_json::from_str(&json).unwrap();
        assert_eq!(from_json.digest(), m.digest());
    }

    #[test]
    fn hasher_is_slicing_independent() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let mut a = ShardHasher::new(MIN_CHUNK_SIZE);
        a.update(&data);
        let mut b = ShardHasher::new(MIN_CHUNK_SIZE);
        for piece in data.chunks(333) {
            b.update(piece);
        }
        let p = ShardPath::new("x").unwrap();
        assert_eq!(a.finish(p.clone()), b.finish(p));
    }

    #[test]
    fn verify_chunk_catches_corruption() {
        let m = sample(MIN_CHUNK_SIZE, &[5000]);
        let data: Vec<u8> = (0..5000u64).map(|b| b as u8).collect();
        m.verify_chunk(0, 0, &data[..4096]).unwrap();
        m.verify_chunk(0, 1, &data[4096..]).unwrap();
        let mut bad = data[..4096].to_vec();
        bad[7] ^= 1;
        assert_eq!(
            m.verify_chunk(0, 0, &bad),
            Err(VerifyError::Hash { shard: 0, index: 0 })
        );
        assert!(matches!(
            m.verify_chunk(0, 1, &data[..10]),
            Err(VerifyError::Length { .. })
        ));
        assert!(matches!(
            m.verify_chunk(0, 2, &data[..10]),
            Err(VerifyError::NoSuchChunk { .. })
        ));
        assert!(matches!(
            m.verify_chunk(3, 0, &data[..10]),
            Err(VerifyError::NoSuchShard { .. })
        ));
    }

    #[test]
    fn decode_rejects_huge_chunk_counts_without_allocating() {
        let mut m = encode_to_vec(&sample(MIN_CHUNK_SIZE, &[1]));
        // Patch the shard size (after the path) to u64::MAX.
        let off = 4 + 2 + 2 + "test/model".len() + 4 + 4 + 2 + "shard-0.safetensors".len();
        m[off..off + 8].copy_from_slice(&u64::MAX.to_be_bytes());
        let err = decode_exact::<Manifest>(Bytes::from(m)).unwrap_err();
        assert!(matches!(err, DecodeError::TooLong { .. }), "{err}");
    }
}
