//! One shard file in one tier, with its persisted verified-chunk bitmap.
//!
//! ## Bitmap file (`<tier_root>/state/<digest-hex>/<shard-index>.bits`)
//!
//! ```text
//!  "SCVB"  u16 version (1, big-endian)  u32 chunk count (big-endian)  ceil(count/8) bytes
//! ```
//!
//! Bit `i` (chunk `i`) is `byte[i / 8] & (1 << (i % 8))`, the layout of
//! [`ChunkSet`](shardcast_protocol::ChunkSet). Bits past the chunk count are zero. Marking
//! a chunk verified rewrites the one byte holding its bit, in place; so does dropping a chunk
//! that failed re-verification at rest ([`Shard::check`]).
//!
//! ## Writing and reading
//!
//! [`Shard::verify_and_write`] hashes a received chunk (BLAKE3 against the manifest) and
//! writes it in the same blocking-pool task, so the write copies bytes the hash just pulled
//! into that core's cache; only verified bytes reach the file. The file is created sparse
//! (`set_len`), so nothing is zeroed first, but on tmpfs every first write of a 4 KiB page
//! allocates it: this write is the largest cost of a receiving hop (docs/BENCHMARKS.md).
//!
//! How the bytes get into the file is the writer's choice ([`WriterKind`]). `pwrite`s to one
//! tmpfs file serialise on its inode lock, so with `pwrite` alone a shard is written at one
//! core's rate (≈ 2.5 GB/s on 4 KiB pages), however many stripes carry it; they queue on a
//! per-shard lock here rather than spin in the kernel. The mapped writer copies into a
//! writable shared map of the file instead, its pages allocated first with
//! `MADV_POPULATE_WRITE` (which fails cleanly where a plain store into an unbacked page
//! would raise `SIGBUS`: a full tmpfs), so writes to one file run in parallel. One copy
//! into a map is slower than a `pwrite` (1.3–1.9 against 2.5 GiB/s on one core), so the
//! default, adaptive, `pwrite`s while the shard's lock is free and copies into the map when
//! another write holds it. On a 16-core host a TLS hop of one shard over 8 stripes went
//! from 2.1 to 3.7 GB/s on 4 KiB pages, and from 4.0 to 5.3 GB/s on a huge-page tmpfs.
//!
//! Reads are zero-copy `Bytes` over the shard's shared map. Before bytes leave the store,
//! [`Shard::read_checked`] re-hashes a chunk that is not trusted: verified more than
//! `reverify_after` ago, after a `Nack`, or an adopted kept copy's first send. A chunk the
//! forwarder sends down a chain ([`Check::Send`]) is not re-hashed unless the store is told
//! to (`reverify_sends`): every receiver verifies it against the manifest and `Nack`s a bad
//! one, which makes the sender re-hash, drop and repair it (one BLAKE3 pass per byte
//! fewer at a chain's head: a TLS hop on a 16-core host carried 2.16 GB/s without it,
//! 1.68 with it); `Fetch` answers, GPU loads and hand-offs, which have no `Nack`, still
//! re-hash;
//! [`Shard::check_ahead`] does that a few chunks ahead of the socket on the blocking pool.
//! [`Shard::chunk_in_file`] gives a chunk's file and offset for `sendfile`, and
//! [`Shard::mapping`] the read-only map the GPU loader registers.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use shardcast_protocol::{
    ChunkSet, DataTier, Hashed, Manifest, ModelDigest, PieceCv, VerifiedChunk, VerifiedPieces,
    VerifyError,
};
use tokio::sync::{Notify, watch};

use super::beneath::{Access, TierDir};
use super::map::{ShardMap, WritableMap};
use super::reserve::Taken;
use super::writer::{ChunkWriter, WriterKind};
use super::{Integrity, StoreError, io_err, lock};

/// Magic at the start of a bitmap file.
const BITS_MAGIC: &[u8; 4] = b"SCVB";
/// Version of the bitmap file format.
const BITS_VERSION: u16 = 1;
/// Bytes before the bitmap: magic, version, chunk count.
const BITS_HEADER: u64 = 4 + 2 + 4;

/// How [`Shard::open`] treats what is already on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OpenMode {
    /// A new shard: any old bitmap is replaced by an empty one.
    Create,
    /// Recovery at start-up: keep the persisted bitmap if it and the data file are sound;
    /// with `verify`, re-hash every chunk marked verified and clear those that do not match.
    Recover {
        /// Re-hash chunks marked verified.
        verify: bool,
    },
    /// A file this daemon wrote while hashing it, moved into place
    /// ([`ShardStore::adopt_kept`](super::ShardStore::adopt_kept)): it must already have the
    /// manifest's size; every chunk is marked verified without a trust stamp, as after a
    /// recovery without re-hashing, so each is re-hashed before its bytes first leave the
    /// store.
    Adopt,
}

/// Where a shard's files are (relative to its tier root) and what it belongs to.
pub(super) struct ShardSpec {
    pub(super) manifest: Arc<Manifest>,
    pub(super) digest: ModelDigest,
    pub(super) index: u32,
    pub(super) tier: DataTier,
    pub(super) dir: Arc<TierDir>,
    pub(super) data_rel: PathBuf,
    pub(super) bits_rel: PathBuf,
    pub(super) writer: Arc<ChunkWriter>,
    pub(super) integrity: Arc<Integrity>,
    /// A spare of the memory reserve to become the data file (a new shard only): its
    /// pages are allocated already.
    pub(super) spare: Option<Taken>,
}

/// Why a chunk is re-verified: selects the counter and names the reader in the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Before its bytes answer a peer's `Fetch` (the puller has no `Nack`).
    Serve,
    /// Before the forwarder sends it down a chain. Only with
    /// [`StoreConfig::reverify_sends`](super::StoreConfig::reverify_sends): otherwise the
    /// receiver's verification is the check, and its `Nack` makes this host re-hash the
    /// chunk ([`Check::Nack`]).
    Send,
    /// After a downstream `Nack`: always re-hashed.
    Nack,
    /// Before it is copied towards a GPU.
    Load,
    /// Before the model is handed off to an inference process.
    Handoff,
    /// By the background scrub.
    Scrub,
    /// Before it is copied into the other tier to repair a copy there.
    Repair,
}

/// One shard of one model in one tier: a preallocated data file written chunk by chunk at
/// chunk offsets, and the set of chunks verified so far. Get one from
/// [`ShardStore::shard`](super::ShardStore::shard); share it as `Arc<Shard>`.
pub struct Shard {
    manifest: Arc<Manifest>,
    digest: ModelDigest,
    index: u32,
    tier: DataTier,
    size: u64,
    total: u32,
    data_path: PathBuf,
    bits_path: PathBuf,
    file: Arc<File>,
    bits_file: File,
    /// `None` only for an empty (zero-byte) shard, which has no chunks to read.
    map: Option<ShardMap>,
    writer: Arc<ChunkWriter>,
    /// The writable map chunks are copied into with the `mapped` writer (`None` with the
    /// others, and for an empty shard).
    writable: Option<Arc<WritableMap>>,
    /// Taken around each data write with the `pwrite` writer: writes to the file queue here.
    serial: Arc<Mutex<()>>,
    integrity: Arc<Integrity>,
    /// Bytes at the start of the data file that were allocated when it was created (a
    /// spare of the memory reserve), so writing them takes no new memory.
    resident: u64,
    state: Mutex<BitState>,
    /// Woken whenever a chunk leaves the in-flight set (written or failed).
    settled: Notify,
    verified: watch::Sender<u32>,
    /// Recently written chunks' piece CVs, for a sender that forwards them in pieces.
    cvs: Mutex<CvCache>,
}

/// Chunks written last, at most this many, keep their pieces' CVs
/// ([`Shard::piece_cvs`]). Rationale: a forwarder sends a chunk within its send window
/// (16) of its arrival; one that lags further sends whole chunks, which is still correct.
/// 256 chunks of 1 MiB keep 32 KiB of CVs per shard.
const CV_CACHE: usize = 256;

/// The CVs of the chunks written last ([`CV_CACHE`]), the oldest dropped first.
#[derive(Debug, Default)]
struct CvCache {
    map: std::collections::HashMap<u32, Arc<[PieceCv]>>,
    order: std::collections::VecDeque<u32>,
}

impl CvCache {
    fn keep(&mut self, index: u32, cvs: Arc<[PieceCv]>) {
        if self.map.insert(index, cvs).is_none() {
            self.order.push_back(index);
        }
        while self.order.len() > CV_CACHE {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("model", &self.digest)
            .field("index", &self.index)
            .field("tier", &self.tier)
            .field("path", &self.data_path)
            .field("verified", &self.verified_count())
            .field("total", &self.total)
            .finish()
    }
}

/// The mutable part of a shard, behind one short-held lock.
#[derive(Debug)]
struct BitState {
    bits: Vec<u8>,
    count: u32,
    /// Per chunk, when it was last verified ([`Integrity::now_ms`]); 0: not in this process
    /// (recovered without re-hashing), so not trusted.
    verified_at: Vec<u64>,
    /// Chunks dropped after failing re-verification and not written since: writing one
    /// again counts as a repair.
    dropped: HashSet<u32>,
    /// Chunks being written right now: a second writer of the same chunk waits for the first.
    in_flight: HashSet<u32>,
    /// Chunks being re-verified ahead of a reader ([`Shard::check_ahead`]).
    checking: HashSet<u32>,
    /// The tier copy was removed from the store: refuse further reads and writes.
    removed: bool,
}

impl BitState {
    fn empty(total: u32) -> Self {
        Self {
            bits: vec![0; total.div_ceil(8) as usize],
            count: 0,
            verified_at: vec![0; total as usize],
            dropped: HashSet::new(),
            in_flight: HashSet::new(),
            checking: HashSet::new(),
            removed: false,
        }
    }
    /// Every chunk verified, none trusted (stamps 0: re-hashed before first use).
    fn full(total: u32) -> Self {
        let mut st = Self::empty(total);
        for i in 0..total {
            st.insert(i);
        }
        st
    }
    fn stamp(&self, i: u32) -> u64 {
        self.verified_at.get(i as usize).copied().unwrap_or(0)
    }
    fn set_stamp(&mut self, i: u32, at: u64) {
        if let Some(s) = self.verified_at.get_mut(i as usize) {
            *s = at;
        }
    }
    fn contains(&self, i: u32) -> bool {
        self.bits
            .get(i as usize / 8)
            .is_some_and(|b| b & (1 << (i % 8)) != 0)
    }
    /// Sets bit `i`; returns the byte offset in `bits` and its new value if it was new.
    fn insert(&mut self, i: u32) -> Option<(usize, u8)> {
        let at = i as usize / 8;
        let byte = self.bits.get_mut(at)?;
        let mask = 1 << (i % 8);
        if *byte & mask != 0 {
            return None;
        }
        *byte |= mask;
        self.count += 1;
        Some((at, *byte))
    }
    /// Clears bit `i`; returns the byte offset in `bits` and its new value if it was set.
    fn remove(&mut self, i: u32) -> Option<(usize, u8)> {
        let at = i as usize / 8;
        let byte = self.bits.get_mut(at)?;
        let mask = 1 << (i % 8);
        if *byte & mask == 0 {
            return None;
        }
        *byte &= !mask;
        let value = *byte;
        self.count -= 1;
        self.set_stamp(i, 0);
        Some((at, value))
    }
}

impl Shard {
    /// Opens or creates the shard's data file (sized to the manifest's size with `set_len`)
    /// and bitmap file.
    pub(super) fn open(spec: ShardSpec, mode: OpenMode) -> Result<Self, StoreError> {
        let ShardSpec {
            manifest,
            digest,
            index,
            tier,
            dir,
            data_rel,
            bits_rel,
            writer,
            integrity,
            spare,
        } = spec;
        let data_path = dir.root().join(&data_rel);
        let bits_path = dir.root().join(&bits_rel);
        let entry = manifest.shard(index).map_err(|_| StoreError::NoSuchShard {
            digest,
            shard: index,
        })?;
        let size = entry.size;
        // Bounded by MAX_CHUNKS_PER_SHARD (2^24) when the manifest was validated.
        let total = u32::try_from(entry.chunks.len()).map_err(|_| StoreError::Corrupt {
            path: data_path.clone(),
            reason: "too many chunks".into(),
        })?;

        if let Some(parent) = data_rel.parent().filter(|p| !p.as_os_str().is_empty()) {
            dir.create_dir_all(parent)?;
        }
        let mut resident = 0;
        let mut premapped = None;
        if let Some(spare) = spare.filter(|_| mode == OpenMode::Create) {
            match dir.rename_file(&spare.rel, &data_rel) {
                Ok(()) => {
                    resident = spare.size.min(size);
                    premapped = spare.map;
                }
                Err(e) => {
                    tracing::warn!(path = %data_path.display(), "a spare of the memory reserve could not become a shard's file: {e}");
                    if let Err(e) = dir.remove_tree(&spare.rel) {
                        tracing::warn!("removing the spare: {e}");
                    }
                }
            }
        }
        let file = dir.open_file(&data_rel, Access::ReadWriteCreate)?;
        let len = file.metadata().map_err(io_err(&data_path))?.len();
        if len != size {
            if mode == OpenMode::Adopt {
                return Err(StoreError::Corrupt {
                    path: data_path,
                    reason: format!("kept file has {len} bytes; the manifest says {size}"),
                });
            }
            file.set_len(size).map_err(io_err(&data_path))?;
        }
        let map = if size > 0 {
            Some(ShardMap::new(&file, size).map_err(io_err(&data_path))?)
        } else {
            None
        };
        let writable = if size > 0 && writer.copies_into_maps() {
            // A spare's map (its pages populated while the host was idle) where it
            // covers the shard; it was made before the file was cut to the shard's
            // size, which unmapped whatever lay beyond.
            let map = match premapped.and_then(|m| WritableMap::premapped(m, size)) {
                Some(map) => map,
                None => WritableMap::new(&file, size).map_err(io_err(&data_path))?,
            };
            Some(Arc::new(map))
        } else {
            None
        };

        let mut state = if mode == OpenMode::Adopt {
            BitState::full(total)
        } else {
            BitState::empty(total)
        };
        let mut rewrite = true;
        if let OpenMode::Recover { verify } = mode {
            match read_bits(&dir, &bits_rel, total) {
                // A data file of the wrong size was not the one these bits describe.
                Ok(bits) if len == size => {
                    rewrite = false;
                    for (at, b) in bits.iter().enumerate() {
                        state.bits[at] = *b;
                    }
                    state.count = bits.iter().map(|b| b.count_ones()).sum();
                }
                Ok(_) => tracing::warn!(
                    path = %data_path.display(), expected = size, found = len,
                    "shard data file has the wrong size; forgetting its verified chunks"
                ),
                Err(e) => tracing::warn!(error = %e, "forgetting the verified chunks of a shard"),
            }
            if verify && state.count > 0 {
                let now = integrity.now_ms();
                let bad = reverify(&manifest, index, map.as_ref(), &mut state, now);
                if bad > 0 {
                    tracing::warn!(
                        model = %digest, shard = index, ?tier, bad,
                        "verified chunks did not match their hashes on recovery; cleared"
                    );
                    rewrite = true;
                }
            }
        }
        if rewrite {
            write_bits(&dir, &bits_rel, total, &state.bits)?;
        }
        let bits_file = dir.open_file(&bits_rel, Access::ReadWriteCreate)?;
        let (verified, _) = watch::channel(state.count);
        Ok(Self {
            manifest,
            digest,
            index,
            tier,
            size,
            total,
            data_path,
            bits_path,
            file: Arc::new(file),
            bits_file,
            map,
            writer,
            writable,
            serial: Arc::default(),
            integrity,
            resident,
            state: Mutex::new(state),
            settled: Notify::new(),
            verified,
            cvs: Mutex::default(),
        })
    }

    /// The tier this copy lives in.
    pub fn tier(&self) -> DataTier {
        self.tier
    }

    /// The shard's index in its manifest.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The digest of the model this shard belongs to.
    pub fn digest(&self) -> ModelDigest {
        self.digest
    }

    /// Size of the shard in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Number of chunks in the shard.
    pub fn total_chunks(&self) -> u32 {
        self.total
    }

    /// The data file (its name is the shard's path in the model).
    pub fn path(&self) -> &Path {
        &self.data_path
    }

    /// The manifest of the model this shard belongs to.
    pub fn manifest(&self) -> &Arc<Manifest> {
        &self.manifest
    }

    /// The verified chunks within `start..end` (clamped to the shard's chunk count).
    pub fn verified_set(&self, start: u32, end: u32) -> ChunkSet {
        let end = end.min(self.total);
        let mut set = ChunkSet::new(start, end);
        let st = lock(&self.state);
        for i in start..end {
            if st.contains(i) {
                set.insert(i);
            }
        }
        set
    }

    /// The lowest chunk in `range` that is verified and not `skip`ped, under one lock and
    /// eight chunks a byte where none is verified (a forwarder that has caught up with its
    /// upstream asks this over the rest of its range on every wake-up: one lock a chunk
    /// made that quadratic in the shard's chunks).
    pub fn first_verified(
        &self,
        range: std::ops::Range<u32>,
        skip: impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let st = lock(&self.state);
        let end = range.end.min(self.total);
        let mut i = range.start;
        while i < end {
            match st.bits.get(i as usize / 8) {
                // No verified chunk in this byte: on to the next one.
                Some(0) => i = (i / 8).saturating_add(1).saturating_mul(8),
                Some(_) if st.contains(i) && !skip(i) => return Some(i),
                Some(_) => i += 1,
                None => return None,
            }
        }
        None
    }

    /// Whether chunk `index` is written and verified.
    pub fn is_verified(&self, index: u32) -> bool {
        lock(&self.state).contains(index)
    }

    /// How many chunks are verified.
    pub fn verified_count(&self) -> u32 {
        lock(&self.state).count
    }

    /// Whether every chunk is verified.
    pub fn is_complete(&self) -> bool {
        self.verified_count() == self.total
    }

    /// A receiver of the verified-chunk count, bumped on every newly verified chunk.
    pub fn subscribe(&self) -> watch::Receiver<u32> {
        self.verified.subscribe()
    }

    /// Writes a verified chunk at its offset, then marks and persists its verified bit.
    /// Returns `Ok(false)` without writing if the chunk was already verified. Writes of
    /// different chunks run in parallel; a second write of a chunk already being written
    /// waits for the first and then returns `Ok(false)` (or retries if the first failed).
    ///
    /// The chunk must have been verified against this shard's manifest: its shard index,
    /// offset and length are checked against it.
    pub async fn write(&self, chunk: VerifiedChunk) -> Result<bool, StoreError> {
        let index = chunk.index();
        let mismatch = || StoreError::ChunkMismatch {
            shard: self.index,
            got_shard: chunk.shard(),
            index,
        };
        if chunk.shard() != self.index {
            return Err(mismatch());
        }
        let (offset, len) = self.span(index)?;
        if chunk.offset() != offset || chunk.data().len() != len {
            return Err(mismatch());
        }

        let Some(_claim) = self.claim(index).await? else {
            return Ok(false);
        };
        self.write_at(offset, chunk.data().clone()).await?;
        self.keep_cvs(index, chunk.cvs());
        self.mark_written(index)
    }

    /// Writes a chunk that arrived in pieces, each verified against CVs that merged into the
    /// manifest's hash ([`shardcast_protocol::pieces`]), and marks it verified, as
    /// [`Shard::write`] does a whole chunk: `Ok(false)` without writing if it was verified
    /// already. The pieces go to the file one after another, in one blocking-pool task
    /// with the `pwrite` writer.
    pub async fn write_pieces(&self, chunk: VerifiedPieces) -> Result<bool, StoreError> {
        let index = chunk.index();
        let (offset, len) = self.span(index)?;
        if chunk.shard() != self.index || chunk.offset() != offset || chunk.len() != len {
            return Err(StoreError::ChunkMismatch {
                shard: self.index,
                got_shard: chunk.shard(),
                index,
            });
        }
        let Some(_claim) = self.claim(index).await? else {
            return Ok(false);
        };
        if let Some(place) = self.placer() {
            let pieces = chunk.clone();
            self.blocking(move || {
                pieces
                    .pieces()
                    .try_for_each(|(offset, data)| place(data, offset))
            })
            .await?
            .map_err(io_err(&self.data_path))?;
        } else {
            for (offset, data) in chunk.pieces() {
                self.write_at(offset, data.clone()).await?;
            }
        }
        self.keep_cvs(index, chunk.cvs());
        self.mark_written(index)
    }

    /// Keeps chunk `index`'s pieces' CVs for [`Shard::piece_cvs`] (none for a chunk of one
    /// piece).
    fn keep_cvs(&self, index: u32, cvs: &[PieceCv]) {
        if !cvs.is_empty() {
            lock(&self.cvs).keep(index, cvs.into());
        }
    }

    /// The CVs of chunk `index`'s pieces, when it was written recently with them (worked
    /// out by this process as it verified the chunk, or checked against the manifest's
    /// hash): what a sender ships in a `ChunkHead` to forward the chunk in pieces.
    pub fn piece_cvs(&self, index: u32) -> Option<Arc<[PieceCv]>> {
        lock(&self.cvs).map.get(&index).cloned()
    }

    /// Writes `data` at `offset` in the data file with this shard's writer. With `pwrite`
    /// the write runs on the blocking pool and writes to the file queue on the shard's
    /// `serial` lock (sleeping there rather than spinning on the inode lock in the kernel),
    /// as the write half of [`Shard::verify_and_write`] does.
    async fn write_at(&self, offset: u64, data: Bytes) -> Result<(), StoreError> {
        if let Some(place) = self.placer() {
            self.blocking(move || place(&data, offset)).await?
        } else {
            self.writer.write_at(self.file.clone(), offset, data).await
        }
        .map_err(io_err(&self.data_path))
    }

    /// Verifies `data` as chunk `index` against this shard's manifest and, if it is sound
    /// and not verified yet, writes it and marks its bit, as [`Shard::write`] does.
    ///
    /// With the `pwrite` writer the hash and the write run in one task on the blocking
    /// pool: one hand-off per chunk instead of two, and the write copies bytes that the
    /// hash has just pulled into that core's cache. A chunk already verified is still
    /// hashed (a bad copy is reported, so its sender learns of it), not written again.
    pub async fn verify_and_write(&self, index: u32, data: Bytes) -> Result<Written, StoreError> {
        self.verify_and_write_hashed(index, data, None).await
    }

    /// As [`Shard::verify_and_write`], with the chunk's BLAKE3 hash already worked out by
    /// this process as its bytes arrived (`Some`: see
    /// [`crate::wire::FrameReader::hash_chunks`]), which is then compared with the
    /// manifest's instead of hashing `data` again. A hash a peer sent must never be passed.
    pub async fn verify_and_write_hashed(
        &self,
        index: u32,
        data: Bytes,
        hashed: Option<Hashed>,
    ) -> Result<Written, StoreError> {
        let (offset, _) = self.span(index)?;
        let claim = self.claim(index).await?;
        let (manifest, shard) = (self.manifest.clone(), self.index);
        let times = self.integrity.stats.chunk_verify.clone();
        let verify = move |data: Bytes| {
            let t = std::time::Instant::now();
            let r = match hashed {
                Some(h) => manifest.verified_hashed(shard, index, data, h),
                None => manifest.verified(shard, index, data),
            };
            times.observe_duration(t.elapsed());
            r
        };
        if claim.is_none() {
            return Ok(match self.blocking(move || verify(data)).await? {
                Ok(_) => Written::AlreadyHad,
                Err(e) => Written::Corrupt(e),
            });
        }
        if let Some(place) = self.placer() {
            // Hashes run in parallel; with `pwrite` the writes queue on the shard's lock,
            // with the mapped writer they run in parallel too.
            let written = self
                .blocking(move || verify(data).map(|chunk| (place(chunk.data(), offset), chunk)));
            match written.await? {
                Ok((w, chunk)) => {
                    w.map_err(io_err(&self.data_path))?;
                    self.keep_cvs(index, chunk.cvs());
                }
                Err(e) => return Ok(Written::Corrupt(e)),
            }
        } else {
            let chunk = match self.blocking(move || verify(data)).await? {
                Ok(chunk) => chunk,
                Err(e) => return Ok(Written::Corrupt(e)),
            };
            self.write_at(offset, chunk.data().clone()).await?;
            self.keep_cvs(index, chunk.cvs());
        }
        Ok(if self.mark_written(index)? {
            Written::Stored
        } else {
            Written::AlreadyHad
        })
    }

    /// The blocking write of bytes at an offset in the data file, for the blocking pool,
    /// where the writer is one that runs there (`None` for io_uring):
    /// - `pwrite`: a `pwrite` queued on the shard's `serial` lock (writes to one file sleep
    ///   there rather than spin on the inode lock in the kernel);
    /// - mapped: a copy into the shard's writable map (writes to one file run in parallel);
    /// - adaptive: a copy into the map where its pages were populated before (a spare of
    ///   the memory reserve); elsewhere the `pwrite` when the `serial` lock is free, else
    ///   the copy into the map, so a second concurrent write to the file (a striped shard)
    ///   does not wait.
    fn placer(&self) -> Option<impl Fn(&[u8], u64) -> std::io::Result<()> + Send + 'static> {
        let kind = self.writer.kind();
        if !matches!(
            kind,
            WriterKind::Pwrite | WriterKind::Mapped | WriterKind::Adaptive
        ) {
            return None;
        }
        let (file, serial, writable) = (
            self.file.clone(),
            self.serial.clone(),
            self.writable.clone(),
        );
        let stats = self.integrity.stats.clone();
        let mapped = move |map: &WritableMap, data: &[u8], offset| {
            map.write(offset, data)?;
            stats
                .bytes_written_mapped
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            Ok(())
        };
        let adaptive = kind == WriterKind::Adaptive;
        Some(move |data: &[u8], offset| match &writable {
            // A range already populated (a spare's) is a bare copy: cheaper than `pwrite`.
            Some(map) if !adaptive || map.populated(offset, data.len()) => {
                mapped(map, data, offset)
            }
            Some(map) => match serial.try_lock() {
                Ok(_serial) => file.write_all_at(data, offset),
                // Poisoned only by a panic in a write; the file is still sound.
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    let _serial = p.into_inner();
                    file.write_all_at(data, offset)
                }
                Err(std::sync::TryLockError::WouldBlock) => mapped(map, data, offset),
            },
            None => {
                let _serial = lock(&serial);
                file.write_all_at(data, offset)
            }
        })
    }

    /// Runs `f`, work on this shard's file, on tokio's blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, StoreError> {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| StoreError::Io {
                path: self.data_path.clone(),
                source: std::io::Error::other(format!("blocking task failed: {e}")),
            })
    }

    /// Claims chunk `index` for writing, waiting for whoever is writing it now: `None` when
    /// it is verified already (after that writer, if there was one, finished).
    async fn claim(&self, index: u32) -> Result<Option<Claim<'_>>, StoreError> {
        loop {
            let wait = {
                let mut st = lock(&self.state);
                if st.removed {
                    return Err(self.removed());
                }
                if st.contains(index) {
                    return Ok(None);
                }
                if st.in_flight.insert(index) {
                    None
                } else {
                    // Created under the lock, so it cannot miss the claimant's wake-up.
                    Some(self.settled.notified())
                }
            };
            match wait {
                None => return Ok(Some(Claim { shard: self, index })),
                Some(settled) => settled.await,
            }
        }
    }

    /// Marks chunk `index` verified once its bytes are in the file: sets and persists its
    /// bit, stamps it trusted and wakes the subscribers. `Ok(false)` if it was set already.
    fn mark_written(&self, index: u32) -> Result<bool, StoreError> {
        // Crash safety: the bit is persisted only after the data write has completed (the
        // writer returned), so a crash at any point can lose verified bits (the chunk is
        // fetched again) but never leave a bit claiming data that was not written. Both
        // writes go through the page cache without fsync, which makes this hold for a
        // crash of the process; after a crash of the host the disk may have kept the bitmap
        // page and not the data page, which is what `verify_on_recover` is for (the memory
        // tier does not survive a host crash at all). An fsync per chunk would cost more
        // than the chunk's transfer.
        let mut st = lock(&self.state);
        if st.removed {
            return Err(self.removed());
        }
        let Some((at, byte)) = st.insert(index) else {
            return Ok(false);
        };
        if let Err(source) = self
            .bits_file
            .write_all_at(&[byte], BITS_HEADER + at as u64)
        {
            st.remove(index);
            return Err(StoreError::Io {
                path: self.bits_path.clone(),
                source,
            });
        }
        self.integrity
            .stats
            .chunks_written
            .fetch_add(1, Ordering::Relaxed);
        st.set_stamp(index, self.integrity.now_ms());
        if st.dropped.remove(&index) {
            self.integrity
                .stats
                .chunks_repaired
                .fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                model = %self.digest, shard = self.index, chunk = index, tier = ?self.tier,
                event = "repaired", "chunk repaired"
            );
        }
        // Sent under the lock so that receivers see counts in increasing order.
        self.verified.send_replace(st.count);
        Ok(true)
    }

    /// Whether chunk `index` is verified but not trusted any more: its bytes must be
    /// re-hashed ([`Shard::check`]) before they leave the store.
    pub fn needs_check(&self, index: u32) -> bool {
        let st = lock(&self.state);
        st.contains(index) && !self.trusted(&st, index)
    }

    /// Whether a check for `why` hashes at all when not forced: a [`Check::Send`] does not
    /// unless the store re-verifies sends.
    fn checks_for(&self, why: Check) -> bool {
        why != Check::Send || self.integrity.reverify_sends
    }

    fn trusted(&self, st: &BitState, index: u32) -> bool {
        let at = st.stamp(index);
        let window = u64::try_from(self.integrity.reverify_after.as_millis()).unwrap_or(u64::MAX);
        at != 0 && self.integrity.now_ms().saturating_sub(at) < window
    }

    /// Re-verifies verified chunk `index` against the manifest, unless it was verified
    /// within the trust window or `why` is a [`Check::Send`] the store does not re-hash
    /// (`force` re-hashes regardless). `Ok(true)`: re-hashed and
    /// sound (trusted again from now); `Ok(false)`: trusted without hashing. A chunk that
    /// fails is dropped from the verified set (bitmap file included), counted, logged as a
    /// repair event and reported as [`StoreError::CorruptChunk`]. Hashes on the calling
    /// thread: ~0.25 ms per MiB.
    pub fn check(&self, index: u32, force: bool, why: Check) -> Result<bool, StoreError> {
        let (offset, len) = self.span(index)?;
        // One retry when a repair rewrote the chunk while it was being hashed.
        for _ in 0..2 {
            let stamp = {
                let st = lock(&self.state);
                self.held(&st, index)?;
                if !force && (!self.checks_for(why) || self.trusted(&st, index)) {
                    return Ok(false);
                }
                st.stamp(index)
            };
            // Hashed piece by piece: a sound chunk's pieces' CVs are kept for a sender.
            let hashed = self.slice(offset, len, index).ok().and_then(|data| {
                self.manifest
                    .verify_chunk_hashed(self.index, index, data)
                    .ok()
            });
            let stats = &self.integrity.stats;
            let (chunks, bytes) = match why {
                Check::Scrub => (&stats.chunks_scrubbed, &stats.bytes_scrubbed),
                _ => (&stats.chunks_reverified, &stats.bytes_reverified),
            };
            chunks.fetch_add(1, Ordering::Relaxed);
            bytes.fetch_add(len as u64, Ordering::Relaxed);
            let mut st = lock(&self.state);
            self.held(&st, index)?;
            if st.stamp(index) != stamp {
                // Rewritten (repaired) meanwhile: what was hashed may be a mix; again.
                continue;
            }
            if let Some(h) = hashed {
                st.set_stamp(index, self.integrity.now_ms());
                drop(st);
                self.keep_cvs(index, &h.cvs);
                return Ok(true);
            }
            self.drop_locked(&mut st, index, why);
            return Err(self.corrupt(index));
        }
        // Rewritten twice while being hashed: trust the latest writer's verification.
        Ok(false)
    }

    /// Starts re-verifying, on the blocking pool, each chunk of `chunks` that needs it and is
    /// not being checked ahead already, so that a reader reaching it a moment later finds it
    /// trusted: the forwarder hashes the next chunks while it sends this one, instead of
    /// hashing and sending in turn. A chunk that fails is dropped as by [`Shard::check`];
    /// the reader then finds it unverified. Must be called inside a tokio runtime.
    pub fn check_ahead(self: &Arc<Self>, chunks: std::ops::Range<u32>, why: Check) {
        if !self.checks_for(why) {
            return;
        }
        for i in chunks {
            {
                let mut st = lock(&self.state);
                if st.removed || !st.contains(i) || self.trusted(&st, i) || !st.checking.insert(i) {
                    continue;
                }
            }
            let shard = self.clone();
            tokio::task::spawn_blocking(move || {
                let _ = shard.check(i, false, why);
                lock(&shard.state).checking.remove(&i);
            });
        }
    }

    fn corrupt(&self, index: u32) -> StoreError {
        StoreError::CorruptChunk {
            digest: self.digest,
            tier: self.tier,
            shard: self.index,
            index,
        }
    }

    /// Drops a verified chunk that failed re-verification: clears and persists its bit,
    /// remembers it as awaiting repair, counts and logs it.
    fn drop_locked(&self, st: &mut BitState, index: u32, why: Check) {
        let Some((at, byte)) = st.remove(index) else {
            return;
        };
        if let Err(e) = self
            .bits_file
            .write_all_at(&[byte], BITS_HEADER + at as u64)
        {
            // The bit is cleared in memory; a restart re-hashes with verify_on_recover.
            tracing::error!(path = %self.bits_path.display(), error = %e, "cannot persist a dropped chunk");
        }
        st.dropped.insert(index);
        self.integrity
            .stats
            .chunks_rotted
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            model = %self.digest, shard = self.index, chunk = index, tier = ?self.tier,
            found_by = ?why, event = "corrupt-at-rest",
            "chunk failed re-verification at rest; dropped, needs repair"
        );
        self.verified.send_replace(st.count);
    }

    /// Bytes of the shard not yet verified (what is still to be written into its file).
    pub fn unwritten_bytes(&self) -> u64 {
        let verified = u64::from(self.verified_count());
        let chunk = u64::from(self.manifest.chunk_size);
        self.size.saturating_sub(verified.saturating_mul(chunk))
    }

    /// What writing the rest of the shard may still allocate: its unwritten bytes, less
    /// those of a spare it was created from (at most the part of the file the spare did
    /// not cover).
    pub fn unallocated_bytes(&self) -> u64 {
        self.unwritten_bytes()
            .min(self.size.saturating_sub(self.resident))
    }

    /// Bytes of the data file that a spare of the memory reserve had allocated when the
    /// shard was created (0 without one).
    pub fn resident_bytes(&self) -> u64 {
        self.resident
    }

    /// Chunks within `start..end` dropped after failing re-verification and not written
    /// since (awaiting repair), ascending.
    pub fn dropped_chunks(&self, start: u32, end: u32) -> Vec<u32> {
        let st = lock(&self.state);
        if st.dropped.is_empty() {
            return Vec::new();
        }
        let mut out: Vec<u32> = st
            .dropped
            .iter()
            .copied()
            .filter(|i| (start..end).contains(i))
            .collect();
        out.sort_unstable();
        out
    }

    /// Whether chunk `index` was dropped after failing re-verification and not written since.
    pub fn is_dropped(&self, index: u32) -> bool {
        lock(&self.state).dropped.contains(&index)
    }

    /// Whether this copy was removed from the store.
    pub fn is_removed(&self) -> bool {
        lock(&self.state).removed
    }

    /// The chunks holding bytes `offset..offset + len` of the shard (clamped to the shard).
    pub fn chunks_covering(&self, offset: u64, len: usize) -> std::ops::Range<u32> {
        if len == 0 || offset >= self.size {
            return 0..0;
        }
        let cs = u64::from(self.manifest.chunk_size.max(1));
        let last = (offset.saturating_add(len as u64) - 1).min(self.size - 1);
        let first = u32::try_from(offset / cs).unwrap_or(u32::MAX);
        let end = u32::try_from(last / cs + 1).unwrap_or(u32::MAX);
        first.min(self.total)..end.min(self.total)
    }

    /// Byte offset and length of chunk `index` in the data file.
    fn span(&self, index: u32) -> Result<(u64, usize), StoreError> {
        self.manifest
            .chunk_span(self.index, index)
            .map_err(|_| StoreError::NoSuchChunk {
                shard: self.index,
                index,
                chunks: self.total,
            })
    }

    /// A verified chunk's bytes, zero-copy from a memory map of the data file, after
    /// [`Shard::check`] (re-hashing on the calling thread when the chunk is not trusted).
    pub fn read(&self, index: u32) -> Result<Bytes, StoreError> {
        self.check(index, false, Check::Serve)?;
        self.read_raw(index)
    }

    /// [`Shard::read`] for async callers: a re-hash (when needed, or always with `force`)
    /// runs on the blocking pool.
    pub async fn read_checked(
        self: &Arc<Self>,
        index: u32,
        force: bool,
        why: Check,
    ) -> Result<Bytes, StoreError> {
        if force || (self.checks_for(why) && self.needs_check(index)) {
            let shard = self.clone();
            tokio::task::spawn_blocking(move || shard.check(index, force, why))
                .await
                .map_err(|e| StoreError::Io {
                    path: self.data_path.clone(),
                    source: std::io::Error::other(format!("re-verification task: {e}")),
                })??;
        }
        self.read_raw(index)
    }

    /// The data file and where chunk `index` starts in it, for sending the chunk from the
    /// file (`sendfile`). The bytes there are the ones [`Shard::read`] returns, so the same
    /// checks come first: only send a chunk [`Shard::read_checked`] has just returned.
    pub fn chunk_in_file(&self, index: u32) -> Result<(Arc<File>, u64), StoreError> {
        let (offset, _) = self.span(index)?;
        Ok((self.file.clone(), offset))
    }

    /// The read-only shared map of the whole data file (`None` for an empty shard), for a
    /// GPU to register and copy from directly (gpu-loader's registered path: DMA from the
    /// page cache, no staging copy). Like [`Shard::read_at`] it checks nothing: only bytes of
    /// chunks that are verified and passed [`Shard::check`] may be copied from it.
    pub fn mapping(&self) -> Option<Arc<memmap2::Mmap>> {
        self.map.as_ref().map(ShardMap::shared)
    }

    /// Copies bytes `offset..offset + buf.len()` of the data file into `buf`, without any
    /// check: call [`Shard::check`] on [`Shard::chunks_covering`] first.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        if self.is_removed() {
            return Err(self.removed());
        }
        self.file
            .read_exact_at(buf, offset)
            .map_err(io_err(&self.data_path))
    }

    fn slice(&self, offset: u64, len: usize, index: u32) -> Result<&[u8], StoreError> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        self.map
            .as_ref()
            .and_then(|m| m.slice(start..start.saturating_add(len)))
            .ok_or_else(|| StoreError::Corrupt {
                path: self.data_path.clone(),
                reason: format!("chunk {index} lies outside the mapped file"),
            })
    }

    /// A verified chunk's bytes without re-verification. Only for callers that verify the
    /// bytes themselves before they leave the host (a repair into the other tier).
    pub fn read_raw(&self, index: u32) -> Result<Bytes, StoreError> {
        let (offset, len) = self.span(index)?;
        {
            let st = lock(&self.state);
            self.held(&st, index)?;
        }
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        self.map
            .as_ref()
            .and_then(|m| m.bytes(start..start.saturating_add(len)))
            .ok_or_else(|| StoreError::Corrupt {
                path: self.data_path.clone(),
                reason: format!("chunk {index} lies outside the mapped file"),
            })
    }

    /// Marks this copy removed: later reads and writes fail with [`StoreError::Removed`].
    pub(super) fn mark_removed(&self) {
        lock(&self.state).removed = true;
        self.settled.notify_waiters();
    }

    /// Refuses a removed shard, or a chunk this shard does not hold verified.
    fn held(&self, st: &BitState, index: u32) -> Result<(), StoreError> {
        if st.removed {
            return Err(self.removed());
        }
        if !st.contains(index) {
            return Err(StoreError::NotVerified {
                shard: self.index,
                index,
            });
        }
        Ok(())
    }

    fn removed(&self) -> StoreError {
        StoreError::Removed {
            digest: self.digest,
            tier: self.tier,
        }
    }
}

/// Releases a chunk's in-flight claim, also when the writing future is dropped midway.
/// What [`Shard::verify_and_write`] did with a chunk.
#[derive(Debug)]
pub enum Written {
    /// Sound, written and marked verified.
    Stored,
    /// Sound; the shard had it verified already (nothing written).
    AlreadyHad,
    /// Did not match the manifest; nothing written.
    Corrupt(VerifyError),
}

struct Claim<'a> {
    shard: &'a Shard,
    index: u32,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        lock(&self.shard.state).in_flight.remove(&self.index);
        self.shard.settled.notify_waiters();
    }
}

/// Re-hashes every chunk marked verified; clears those that do not match. Returns how many
/// were cleared.
fn reverify(
    manifest: &Manifest,
    shard: u32,
    map: Option<&ShardMap>,
    st: &mut BitState,
    now: u64,
) -> u32 {
    let total = st.bits.len() as u32 * 8;
    let mut bad = 0;
    for i in 0..total {
        if !st.contains(i) {
            continue;
        }
        let data = manifest.chunk_span(shard, i).ok().and_then(|(off, len)| {
            let start = usize::try_from(off).ok()?;
            map?.slice(start..start.checked_add(len)?)
        });
        if data.is_none_or(|data| manifest.verify_chunk(shard, i, data).is_err()) {
            st.remove(i);
            bad += 1;
        } else {
            st.set_stamp(i, now);
        }
    }
    bad
}

/// Reads and checks a bitmap file for a shard of `total` chunks.
fn read_bits(dir: &TierDir, rel: &Path, total: u32) -> Result<Vec<u8>, StoreError> {
    let nbytes = total.div_ceil(8) as usize;
    let raw = dir.read_file(rel, BITS_HEADER + nbytes as u64)?;
    let corrupt = |reason: String| StoreError::Corrupt {
        path: dir.root().join(rel),
        reason,
    };
    if raw.len() != BITS_HEADER as usize + nbytes {
        return Err(corrupt(format!(
            "{} bytes; expected {}",
            raw.len(),
            BITS_HEADER as usize + nbytes
        )));
    }
    if &raw[..4] != BITS_MAGIC {
        return Err(corrupt("bad magic".into()));
    }
    let version = u16::from_be_bytes([raw[4], raw[5]]);
    if version != BITS_VERSION {
        return Err(corrupt(format!("unsupported version {version}")));
    }
    let count = u32::from_be_bytes([raw[6], raw[7], raw[8], raw[9]]);
    if count != total {
        return Err(corrupt(format!(
            "covers {count} chunks; the shard has {total}"
        )));
    }
    let bits = raw[BITS_HEADER as usize..].to_vec();
    if total % 8 != 0 && bits.last().is_some_and(|b| b >> (total % 8) != 0) {
        return Err(corrupt("bits set past the last chunk".into()));
    }
    Ok(bits)
}

/// Replaces a bitmap file atomically (temporary file, then rename), so that a crash leaves
/// either the old bitmap or the new one.
fn write_bits(dir: &TierDir, rel: &Path, total: u32, bits: &[u8]) -> Result<(), StoreError> {
    let mut buf = Vec::with_capacity(BITS_HEADER as usize + bits.len());
    buf.extend_from_slice(BITS_MAGIC);
    buf.extend_from_slice(&BITS_VERSION.to_be_bytes());
    buf.extend_from_slice(&total.to_be_bytes());
    buf.extend_from_slice(bits);
    dir.write_atomic(rel, &buf)
}
