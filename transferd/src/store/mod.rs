//! The shard store: where verified chunks land, in two tiers.
//!
//! A [`ShardStore`] keeps model shards in a **memory tier** (a tmpfs directory, by default
//! under `/dev/shm`, which inference processes on the host map directly) and a **disk
//! tier**. Chunks arrive as [`VerifiedChunk`](shardcast_protocol::VerifiedChunk)s (already checked against the manifest's
//! BLAKE3 hash), are written at their offset into a preallocated shard file, and only then
//! is their bit set in a persisted per-shard bitmap. The one other way in is a file this
//! daemon kept while it hashed a model's origin to build the manifest: moved into place
//! whole, its chunks verified but not yet trusted ([`ShardStore::adopt_kept`]). Readers
//! (chain forwarders, the GPU loader) get verified chunks zero-copy from a memory map and
//! wait for progress on a [`tokio::sync::watch`] channel.
//!
//! ```text
//!  chain session ──VerifiedChunk──▶ Shard::write ──▶ ChunkWriter (pwrite | io_uring) ──▶ data file
//!                                        └──then──▶ verified bit ──▶ bitmap file, watch count
//!  forwarder / GPU loader ◀── Shard::read (mmap, zero-copy Bytes) ◀── Shard::subscribe
//! ```
//!
//! ## On-disk layout
//!
//! Each tier root (`memory_dir`, `disk_dir`) holds:
//!
//! ```text
//!  <tier_root>/models/<digest-hex>/<shard path>        shard data, under its original name
//!                                                      (paths may contain '/': subdirectories)
//!  <tier_root>/state/<digest-hex>/manifest.scmf        the model's manifest (binary encoding)
//!  <tier_root>/state/<digest-hex>/<shard index>.bits   verified-chunk bitmap (format in `shard`)
//! ```
//!
//! and the disk tier also holds every known manifest, with or without data:
//!
//! ```text
//!  <disk_dir>/manifests/<digest-hex>.scmf
//! ```
//!
//! Manifests use `shardcast_protocol::codec` encoding and are checked against the digest in
//! their file name when read. A manifest names its model but binds no name: which version a
//! name means is the name table's (`<disk_dir>/names.json`, see [`names`]).
//!
//! ## Recovery
//!
//! [`ShardStore::open`] loads every known manifest and, in each tier, every
//! `state/<digest-hex>/` directory. A shard is recovered when its bitmap file is sound and
//! its data file has the manifest's size; otherwise its bits are forgotten (the chunks will
//! be fetched again). With [`StoreConfig::verify_on_recover`] every chunk marked verified is
//! re-hashed and cleared if it does not match. Nothing in a file is trusted enough to panic
//! on: bad files are logged and skipped.
//!
//! ## Hardening (see `beneath`)
//!
//! Each tier root must be a directory owned by the daemon's effective uid and not writable
//! by group or others; [`ShardStore::open`] refuses anything else before writing a byte, and
//! tightens a root that others can read. Directories are created `0700` and files `0600`
//! (`0750`/`0640` with [`StoreConfig::group`], for inference processes that map the memory
//! tier). Every path is resolved beneath its tier root without following symlinks; a
//! planted symlink is refused with [`StoreError::Symlink`] and counted in
//! [`StoreStats::symlinks_refused`]. Stale temporary files (`*.tmp`, left by a crash during
//! an atomic manifest or bitmap replacement) are removed at start-up, and so are orphans no
//! model accounts for (`models/<digest>` without state, `state/<digest>` without a
//! manifest). A new shard file is created only when its size fits the tier's free space,
//! its configured capacity and, for a memory tier on tmpfs, the host's available memory
//! less `memory_headroom` ([`hostmem`]); else [`StoreError::NoSpace`] names the
//! [`SpaceLimit`]. [`ShardStore::remove`] returns the bytes the model's files occupied (an
//! eviction's `bytes_freed`).
//!
//! ## Kept copies
//!
//! [`Staging`] holds the bytes an import reads while it builds the manifest
//! (`<tier>/staging/<random>/`, created beneath the root like shard files, removed when done
//! and at start-up). [`ShardStore::adopt_kept`] renames a staged file the tier does not hold
//! yet into place and marks its chunks verified without hashing them again, but with no
//! trust stamp, so each is re-hashed before its bytes first leave the store; a shard held in
//! part, or a failed rename, goes through the verified path every chunk takes.
//!
//! ## Corruption at rest
//!
//! A chunk verified once can rot afterwards (a flipped DRAM bit, a write behind the store's
//! back). Before a chunk's bytes leave the store for a peer, a GPU or a hand-off, the
//! reader calls [`Shard::check`] (or a reading method that does): the chunk is re-hashed
//! against the manifest unless it was verified within [`StoreConfig::reverify_after`] (on
//! arrival, by an earlier check or by the scrub). A chunk that fails is dropped from the
//! verified set (the bitmap on disk too), counted in [`StoreStats::chunks_rotted`], logged
//! as a repair event, and reported as [`StoreError::CorruptChunk`]; the caller arranges its
//! repair (`crate::repair`). Writing it again counts it in [`StoreStats::chunks_repaired`].
//!
//! ## Submodules
//!
//! `beneath` (the tier root's descriptor; every path opened beneath it), `shard` (one
//! shard file and its bitmap: writes, zero-copy reads, checks, the verified watch),
//! [`hostmem`] (the host's available memory and the default headroom), `pages` (the memory
//! tier's mount: file system and tmpfs huge-page policy, logged and exported as
//! `shardcast_memory_tier_huge_pages`), `writer` (`pwrite` on the blocking pool) and
//! `uring` (an io_uring writer thread), `map` (shared maps as `Bytes`), [`names`] (which
//! version a model name means here). `unsafe` is confined to `map` and `uring`.
//!
//! Non-goals: eviction policy and capacity accounting (callers decide what to
//! [`ShardStore::remove`]), replication between tiers (a copy is just another write).

mod beneath;
#[cfg(test)]
mod hardening_tests;
pub mod hostmem;
mod map;
pub mod names;
mod pages;
mod reserve;
#[cfg(test)]
mod reserve_tests;
mod shard;
#[cfg(test)]
mod tests;
#[cfg(target_os = "linux")]
mod uring;
mod writer;

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use shardcast_protocol::codec::{decode_exact, encode_to_vec};
use shardcast_protocol::{DataTier, Manifest, ModelDigest, ModelName, ShardPath};

pub use names::{Binding, BindingSource};
pub use pages::TierFs;
pub use reserve::{DEFAULT_SPARE, FILL_STEP, LEARNED_ROUNDING, ReserveConfig, SpareSize};
pub use shard::{Check, Shard, Written};
pub use writer::{ChunkWriter, WriterKind};

use beneath::{Access, Perms, TierDir};
use shard::{OpenMode, ShardSpec};

/// File name of a model's manifest in a tier's state directory.
const MANIFEST_FILE: &str = "manifest.scmf";
/// Both tiers, memory first (the preferred copy when equally verified).
const TIERS: [DataTier; 2] = [DataTier::Memory, DataTier::Disk];

/// Where the store keeps its files and how it writes them.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Root of the memory tier; should be on tmpfs (e.g. `/dev/shm/shardcast`).
    pub memory_dir: PathBuf,
    /// Root of the disk tier; also holds the known manifests.
    pub disk_dir: PathBuf,
    /// Re-hash every chunk marked verified when opening, clearing those that do not match.
    /// Costs a read of all stored data at start-up; catches data changed behind the store's
    /// back and data lost by a host crash.
    pub verify_on_recover: bool,
    /// Which positional writer writes chunk data.
    pub writer: WriterKind,
    /// Group (gid) given to every directory and file the store creates, with modes
    /// `0750`/`0640`, so that inference processes in it can map the memory tier. `None`:
    /// modes `0700`/`0600`, the daemon's user only.
    pub group: Option<u32>,
    /// Cap on the bytes of shard files in the memory tier (`None`: the file system's size).
    pub memory_capacity: Option<u64>,
    /// Cap on the bytes of shard files in the disk tier (`None`: the file system's size).
    pub disk_capacity: Option<u64>,
    /// Host memory kept free of a memory tier on tmpfs or ramfs: a new shard must fit the
    /// host's available memory less this (see [`hostmem`]). `None`: 5% of the host's
    /// memory, between 256 MiB and 4 GiB ([`hostmem::default_headroom`]).
    pub memory_headroom: Option<u64>,
    /// How long a chunk stays trusted after it was last verified (on arrival, by a check or
    /// by the scrub); older chunks are re-hashed before their bytes are served, loaded or
    /// handed off. `Duration::ZERO` re-hashes on every read.
    pub reverify_after: Duration,
    /// Whether the forwarder's sends down a chain re-hash untrusted chunks too
    /// ([`Check::Send`]). Off by default: each receiver verifies every chunk against the
    /// manifest and `Nack`s a bad one, upon which the sender re-hashes, drops and repairs
    /// it, and the scrub finds rot in idle copies.
    pub reverify_sends: bool,
    /// Bytes per second the background scrub re-hashes idle chunks at; 0 turns it off.
    /// The store only records it; the daemon runs the scrub (`crate::repair`).
    pub scrub_rate: u64,
    /// Spare files of allocated pages kept in the memory tier for new shards to be written
    /// into (see `reserve`). The store keeps and hands them out; the daemon fills them
    /// ([`ShardStore::fill_reserve`]) while idle.
    pub memory_reserve: ReserveConfig,
}

impl StoreConfig {
    /// Settings for the two tier roots with every other field at its default: the auto
    /// writer, no verification on recovery, no group, no caps, chunks trusted for
    /// [`DEFAULT_REVERIFY_AFTER`], scrub at [`DEFAULT_SCRUB_RATE`].
    pub fn new(memory_dir: PathBuf, disk_dir: PathBuf) -> Self {
        Self {
            memory_dir,
            disk_dir,
            verify_on_recover: false,
            writer: WriterKind::Auto,
            group: None,
            memory_capacity: None,
            disk_capacity: None,
            memory_headroom: None,
            reverify_after: DEFAULT_REVERIFY_AFTER,
            reverify_sends: false,
            scrub_rate: DEFAULT_SCRUB_RATE,
            memory_reserve: ReserveConfig::OFF,
        }
    }
}

/// Default of [`StoreConfig::reverify_after`]. Rationale: the cut-through forwarder and a
/// GPU load that runs alongside a chain read a chunk within milliseconds of verifying it,
/// so one second keeps them at one hash per byte per hop; anything that sat idle longer (a
/// holder answering `Fetch`, a head sending from its store, a later GPU load or hand-off)
/// is re-hashed. BLAKE3 runs at 2.2–4.5 GB/s per core on the 2-vCPU development host
/// (AVX-512; median under a parallel build, best when quiet; docs/OPERATIONS.md), so a
/// re-hash costs 3–6% of a core per Gbit/s served from an idle copy.
pub const DEFAULT_REVERIFY_AFTER: Duration = Duration::from_secs(1);
/// Default of [`StoreConfig::scrub_rate`]: 64 MB/s, 1.5–3% of a core at the BLAKE3 rates
/// above; a 64 GiB memory tier is scrubbed every ~18 minutes of quiet (the scrub waits
/// while chunks move through the host: `crate::repair`).
pub const DEFAULT_SCRUB_RATE: u64 = 64_000_000;

/// Tells when counts of activity have stopped moving for a while: background work (the
/// memory reserve's filler, the scrub) runs only then, so it yields to transfers. Two counts
/// are watched: any change of the exact one is movement (chunks written, shards created);
/// the loose one moves only by `slack` or more at once (bytes on the data connections,
/// where keepalives and acknowledgements trickle).
#[derive(Debug)]
pub struct Quiet {
    after: Duration,
    slack: u64,
    /// The counts when they last counted as moving.
    seen: (u64, u64),
    moved_at: tokio::time::Instant,
}

impl Quiet {
    /// Starts from the counts `now` (exact, loose); quiet at once if `quiet_now`, else only
    /// once they have not moved for `after`.
    pub fn new(after: Duration, slack: u64, now: (u64, u64), quiet_now: bool) -> Self {
        let t = tokio::time::Instant::now();
        Self {
            after,
            slack,
            seen: now,
            // Just after boot the clock itself may be younger than `after`.
            moved_at: if quiet_now {
                t.checked_sub(after).unwrap_or(t)
            } else {
                t
            },
        }
    }

    /// Takes the counts now; true once neither has moved for `after`.
    pub fn observe(&mut self, exact: u64, loose: u64) -> bool {
        let grew = loose.wrapping_sub(self.seen.1);
        if exact != self.seen.0 || (grew != 0 && grew >= self.slack) {
            self.seen = (exact, loose);
            self.moved_at = tokio::time::Instant::now();
        }
        self.moved_at.elapsed() >= self.after
    }
}

/// What bounded the space a shard was refused: see [`StoreError::NoSpace`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpaceLimit {
    /// The file system's free space, less what open shards have still to write.
    FileSystem,
    /// The tier's configured capacity (`memory_capacity`, `disk_capacity`).
    Capacity,
    /// The host's available memory less `memory_headroom` (a memory tier on tmpfs).
    HostMemory,
}

impl std::fmt::Display for SpaceLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::FileSystem => "free space on its file system",
            Self::Capacity => "left under its configured capacity",
            Self::HostMemory => "the host's available memory less memory_headroom",
        })
    }
}

/// Counters of the store, for `/metrics`.
#[derive(Debug, Default)]
pub struct StoreStats {
    /// Symlinks met inside a tier (refused, or unlinked by a removal).
    pub symlinks_refused: AtomicU64,
    /// Stale temporary files removed at start-up.
    pub temp_files_removed: AtomicU64,
    /// Orphaned model or state directories removed at start-up.
    pub orphans_removed: AtomicU64,
    /// Bytes those held.
    pub orphan_bytes_removed: AtomicU64,
    /// Shard files refused because the tier lacked space.
    pub space_refusals: AtomicU64,
    /// Chunks re-hashed before being served, loaded or handed off (not counting the scrub).
    pub chunks_reverified: AtomicU64,
    /// Bytes re-hashed that way.
    pub bytes_reverified: AtomicU64,
    /// Chunk bytes written by copying into a shard's writable map (the adaptive writer
    /// while another write held the shard's lock, or the mapped writer); the rest went by
    /// `pwrite` or io_uring. A mapped write of a fresh tmpfs page pays a page clear that a
    /// whole-page `pwrite` does not.
    pub bytes_written_mapped: AtomicU64,
    /// Chunks re-hashed by the background scrub.
    pub chunks_scrubbed: AtomicU64,
    /// Bytes re-hashed by the background scrub.
    pub bytes_scrubbed: AtomicU64,
    /// 1 while the background scrub waits for the data path to go quiet (a transfer is
    /// moving chunks through this host), else 0.
    pub scrub_yielding: AtomicU64,
    /// Times the scrub stopped to let a transfer through.
    pub scrub_yields: AtomicU64,
    /// Chunks that failed re-verification at rest and were dropped.
    pub chunks_rotted: AtomicU64,
    /// Dropped chunks written again (repaired).
    pub chunks_repaired: AtomicU64,
    /// Dropped chunks a repair attempt could not restore (counted per attempt).
    pub chunks_unrepairable: AtomicU64,
    /// Plan tokens whose name binding was refused as older than the binding held (a
    /// replayed token: see [`names`]).
    pub name_bindings_refused: AtomicU64,
    /// Seconds to verify a chunk from a peer against the manifest, per chunk
    /// ([`Shard::verify_and_write`]; `shardcast_chunk_verify_seconds`).
    pub chunk_verify: crate::metrics::Histogram,
    /// Chunks written and marked verified in a shard file (either tier).
    pub chunks_written: AtomicU64,
    /// Shard files created (either tier): a session or an import starting to write.
    pub shards_created: AtomicU64,
    /// New memory-tier shards created from a spare of the memory reserve.
    pub reserve_spares_taken: AtomicU64,
    /// Bytes of those shards the spares covered (written without allocating a page).
    pub reserve_bytes_taken: AtomicU64,
    /// Bytes the reserve's filler allocated.
    pub reserve_bytes_filled: AtomicU64,
    /// Bytes of spares dropped to give their memory back (to a new shard, the configured
    /// capacity, or the host's headroom).
    pub reserve_bytes_dropped: AtomicU64,
}

/// What the memory reserve holds ([`ShardStore::reserve_status`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveStatus {
    /// Bytes of spares held (complete ones and the one being filled).
    pub held: u64,
    /// The target and spare size.
    pub config: ReserveConfig,
    /// The size the next spare gets (with [`SpareSize::Auto`], what it learned).
    pub spare: u64,
    /// Why filling stopped for good (the file system refused a write).
    pub refused: Option<String>,
    /// Bytes of complete spares that carry a populated map for the shard that takes them
    /// (the rest are written into with `pwrite`: spares kept from an earlier run, the
    /// `pwrite` writer, a kernel without `MADV_POPULATE_WRITE`).
    pub mapped: u64,
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The model's manifest is not in the store.
    #[error("model {digest} is not known to the store")]
    UnknownModel {
        /// The model asked for.
        digest: ModelDigest,
    },
    /// The shard index is not in the model's manifest.
    #[error("model {digest} has no shard {shard}")]
    NoSuchShard {
        /// The model.
        digest: ModelDigest,
        /// The shard index asked for.
        shard: u32,
    },
    /// The chunk index is past the end of the shard.
    #[error("shard {shard} has no chunk {index} ({chunks} chunks)")]
    NoSuchChunk {
        /// The shard index.
        shard: u32,
        /// The chunk index asked for.
        index: u32,
        /// Chunks in the shard.
        chunks: u32,
    },
    /// The chunk has not been written and verified yet.
    #[error("chunk {shard}/{index} is not verified")]
    NotVerified {
        /// The shard index.
        shard: u32,
        /// The chunk index.
        index: u32,
    },
    /// The chunk was verified for another shard or another manifest than this shard's.
    #[error("chunk {got_shard}/{index} does not belong to shard {shard}")]
    ChunkMismatch {
        /// The shard written to.
        shard: u32,
        /// The shard the chunk was verified for.
        got_shard: u32,
        /// The chunk index.
        index: u32,
    },
    /// The shard's tier copy was removed from the store while in use.
    #[error("model {digest} was removed from the {tier:?} tier")]
    Removed {
        /// The model.
        digest: ModelDigest,
        /// The tier it was removed from.
        tier: DataTier,
    },
    /// A shard path would lead outside the model directory.
    #[error("shard path {path:?} leads outside the model directory")]
    InvalidPath {
        /// The offending path.
        path: String,
    },
    /// A file-system operation failed (including ENOSPC while writing a chunk).
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A state file (manifest or bitmap) is malformed.
    #[error("corrupt state file {path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A symlink was met where the store expects its own file or directory (planted by
    /// someone else); nothing was read or written through it.
    #[error("refusing symlink {path} inside the store")]
    Symlink {
        /// The symlink (or the path whose resolution met one).
        path: PathBuf,
    },
    /// A tier root is owned by another user than the daemon's effective uid.
    #[error(
        "tier root {path} is owned by uid {owner}, not by the daemon's uid {euid}; chown it or pick another directory"
    )]
    RootOwner {
        /// The root.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// The daemon's effective uid.
        euid: u32,
    },
    /// A tier root is writable by its group or by others, who could plant files in it.
    #[error("tier root {path} has mode {mode:o}, writable by group or others; chmod go-w it")]
    RootWritable {
        /// The root.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The configured store group could not be given to a directory or file.
    #[error(
        "cannot give {path} the store group {gid} (the daemon must be root or a member): {source}"
    )]
    Group {
        /// The file or directory.
        path: PathBuf,
        /// The group.
        gid: u32,
        /// The error from `fchown`.
        #[source]
        source: io::Error,
    },
    /// A shard does not fit the tier: checked before its file is created.
    #[error(
        "shard {shard} of model {digest} needs {need} bytes in the {tier:?} tier, which has {available} available ({limit})"
    )]
    NoSpace {
        /// The model.
        digest: ModelDigest,
        /// The shard index.
        shard: u32,
        /// The tier.
        tier: DataTier,
        /// The shard's size plus what shards already open there have still to write.
        need: u64,
        /// Free space on the file system, left under the configured capacity, or left of
        /// the host's memory: whichever is least.
        available: u64,
        /// Which of those it was.
        limit: SpaceLimit,
    },
    /// A verified chunk failed re-verification at rest: it was dropped from the verified
    /// set and must be repaired before it can be read again.
    #[error("chunk {shard}/{index} of model {digest} ({tier:?} tier) is corrupt at rest; dropped")]
    CorruptChunk {
        /// The model.
        digest: ModelDigest,
        /// The tier.
        tier: DataTier,
        /// The shard index.
        shard: u32,
        /// The chunk index.
        index: u32,
    },
    /// The io_uring writer could not be set up (old kernel, seccomp, disabled by sysctl).
    #[error("cannot set up the io_uring writer: {source}")]
    WriterSetup {
        /// The error from `io_uring_setup`.
        #[source]
        source: io::Error,
    },
}

/// A model present in one tier (see [`ShardStore::holdings`]).
#[derive(Debug, Clone)]
pub struct Holding {
    /// The model.
    pub digest: ModelDigest,
    /// Its name.
    pub name: ModelName,
    /// The tier.
    pub tier: DataTier,
    /// Directory holding the shard files ([`ShardStore::model_dir`]).
    pub dir: PathBuf,
    /// Every shard of the manifest, in order; shards not started in this tier have
    /// `verified == 0`.
    pub shards: Vec<ShardState>,
}

/// How much of one shard a tier holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardState {
    /// The shard's path within the model.
    pub path: ShardPath,
    /// Its size in bytes.
    pub size: u64,
    /// Chunks verified in this tier.
    pub verified: u32,
    /// Chunks in the shard.
    pub total: u32,
}

/// The shard store. Cheap to clone (an `Arc`); all methods take `&self`.
#[derive(Clone, Debug)]
pub struct ShardStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    memory: Arc<TierDir>,
    disk: Arc<TierDir>,
    writer: Arc<ChunkWriter>,
    /// The memory tier's file system, where `/proc` tells.
    memory_fs: Option<TierFs>,
    integrity: Arc<Integrity>,
    memory_capacity: Option<u64>,
    disk_capacity: Option<u64>,
    /// The headroom in force when the memory tier is memory-backed (`None` where it is not,
    /// or where `/proc/meminfo` cannot be read).
    memory_headroom: Option<u64>,
    scrub_rate: u64,
    /// The memory tier's spares.
    reserve: reserve::Reserve,
    models: Mutex<HashMap<ModelDigest, Model>>,
    names: Mutex<names::Names>,
    /// Woken when a memory-tier shard file is created ([`ShardStore::memory_shard_created`]).
    memory_shard_created: Arc<tokio::sync::Notify>,
}

/// What every shard shares for re-verification: the trust window, a clock, the counters.
#[derive(Debug)]
pub(super) struct Integrity {
    /// Zero point of the shards' verification stamps.
    pub(super) epoch: Instant,
    /// [`StoreConfig::reverify_after`].
    pub(super) reverify_after: Duration,
    /// [`StoreConfig::reverify_sends`].
    pub(super) reverify_sends: bool,
    /// The store's counters.
    pub(super) stats: Arc<StoreStats>,
}

impl Integrity {
    /// Milliseconds since the epoch, plus one (0 means "never verified in this process").
    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }
}

#[derive(Debug)]
struct Model {
    manifest: Arc<Manifest>,
    /// Tier copies present; each maps shard index to its open shard.
    tiers: HashMap<DataTier, HashMap<u32, Arc<Shard>>>,
}

/// Locks `m`, taking the data of a poisoned lock as it is (a panicking holder left no
/// half-done update behind: every critical section is a plain assignment or a map edit).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Largest state file read back (a manifest is at most `MAX_MANIFEST_LEN`).
const MAX_STATE_FILE: u64 = shardcast_protocol::manifest::MAX_MANIFEST_LEN as u64;

/// Reads a manifest file beneath `dir` and checks it against `digest`.
fn read_manifest(dir: &TierDir, rel: &Path, digest: &ModelDigest) -> Result<Manifest, StoreError> {
    let raw = dir.read_file(rel, MAX_STATE_FILE)?;
    let corrupt = |reason: String| StoreError::Corrupt {
        path: dir.root().join(rel),
        reason,
    };
    let m: Manifest = decode_exact(Bytes::from(raw)).map_err(|e| corrupt(e.to_string()))?;
    if m.digest() != *digest {
        return Err(corrupt(format!(
            "manifest digest is {}, not {digest}",
            m.digest()
        )));
    }
    Ok(m)
}

/// The data file of `path` relative to the tier root, under the model's directory.
/// [`ShardPath`] already rejects absolute paths and `.`/`..` components; this checks again,
/// component by component, and the tier's `openat2` refuses anything that would leave it.
fn shard_file(model_rel: &Path, path: &ShardPath) -> Result<PathBuf, StoreError> {
    let rel = Path::new(path.as_str());
    if rel.components().all(|c| matches!(c, Component::Normal(_))) {
        Ok(model_rel.join(rel))
    } else {
        Err(StoreError::InvalidPath {
            path: path.as_str().into(),
        })
    }
}

/// Where bytes read before their model's digest is known wait, relative to a tier root.
const STAGING: &str = "staging";

/// A directory in a tier for the bytes read while a manifest is built (the model's digest,
/// and so its place in the store, is known only at the end). Each shard's file is created
/// beneath the tier root with the store's modes, symlinks refused. Removed when dropped;
/// what a crash leaves is removed when the store opens.
#[derive(Debug)]
pub struct Staging {
    dir: Arc<TierDir>,
    rel: PathBuf,
}

impl Staging {
    /// The directory, to read the kept bytes back ([`crate::origin::Origin::staged`]).
    pub fn path(&self) -> PathBuf {
        self.dir.root().join(&self.rel)
    }

    /// Removes one shard's file once its bytes are in the store.
    pub fn remove(&self, shard: &ShardPath) -> Result<(), StoreError> {
        self.dir.remove_tree(&shard_file(&self.rel, shard)?)?;
        Ok(())
    }
}

impl crate::origin::KeepSink for Staging {
    fn open(&self, shard: &ShardPath) -> std::io::Result<std::fs::File> {
        let to_io = |e: StoreError| std::io::Error::other(e.to_string());
        let rel = shard_file(&self.rel, shard).map_err(to_io)?;
        if let Some(parent) = rel.parent() {
            self.dir.create_dir_all(parent).map_err(to_io)?;
        }
        let f = self
            .dir
            .open_file(&rel, beneath::Access::ReadWriteCreate)
            .map_err(to_io)?;
        f.set_len(0)?;
        Ok(f)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Err(e) = self.dir.remove_tree(&self.rel) {
            tracing::warn!(dir = %self.path().display(), "removing a staging directory: {e}");
        }
    }
}

/// `models/<digest-hex>`, relative to a tier root.
fn model_rel(d: &ModelDigest) -> PathBuf {
    Path::new("models").join(d.to_hex())
}

/// `state/<digest-hex>`, relative to a tier root.
fn state_rel(d: &ModelDigest) -> PathBuf {
    Path::new("state").join(d.to_hex())
}

/// `manifests/<digest-hex>.scmf`, relative to the disk tier root.
fn known_manifest_rel(d: &ModelDigest) -> PathBuf {
    Path::new("manifests").join(format!("{}.scmf", d.to_hex()))
}

/// Says at start-up what the memory tier's file system does with pages, with a hint where
/// it could be cheaper (see [`pages`]).
fn report_memory_fs(root: &Path, fs: Option<&TierFs>) {
    let Some(fs) = fs else {
        tracing::info!(root = %root.display(), "memory tier: file system unknown (no /proc/self/mountinfo)");
        return;
    };
    let (mount, fs_type, huge) = (fs.mount_point.display(), &fs.fs_type, fs.huge.as_deref());
    match huge {
        None => tracing::warn!(
            root = %root.display(), %mount, fs_type,
            "memory tier is not on tmpfs: its shards are page cache of a disk file system, \
             written back and evictable; mount a tmpfs there"
        ),
        Some(_) if fs.huge_pages() => tracing::info!(
            root = %root.display(), %mount, fs_type, huge, "memory tier: tmpfs with huge pages"
        ),
        Some(_) => tracing::info!(
            root = %root.display(), %mount, fs_type, huge,
            "memory tier: tmpfs with 4 KiB pages; a tmpfs mounted with huge=within_size \
             makes writing received chunks several times cheaper (docs/OPERATIONS.md)"
        ),
    }
}

impl ShardStore {
    /// Opens the store: checks and opens the tier roots, creates their directories, removes
    /// stale temporary files, sets up the writer and recovers every model found in either
    /// tier (see the module docs), then removes orphans no model accounts for. A tier root that fails its checks is refused before
    /// anything is written.
    pub fn open(cfg: StoreConfig) -> Result<Self, StoreError> {
        let StoreConfig {
            memory_dir,
            disk_dir,
            verify_on_recover,
            writer,
            group,
            memory_capacity,
            disk_capacity,
            memory_headroom,
            reverify_after,
            reverify_sends,
            scrub_rate,
            memory_reserve,
        } = cfg;
        let stats = Arc::new(StoreStats::default());
        let perms = Perms { gid: group };
        // Both roots are checked before either is created or changed.
        for root in [&memory_dir, &disk_dir] {
            TierDir::precheck(root, &stats)?;
        }
        let memory = Arc::new(TierDir::open(&memory_dir, perms, stats.clone())?);
        let disk = Arc::new(TierDir::open(&disk_dir, perms, stats.clone())?);
        for (dir, subdirs) in [
            (&memory, &["models", "state"][..]),
            (&disk, &["models", "state", "manifests"][..]),
        ] {
            for sub in subdirs {
                let rel = Path::new(sub);
                dir.create_dir_all(rel)?;
                dir.tighten_dir(rel)?;
            }
        }
        let writer = Arc::new(ChunkWriter::new(writer)?);
        tracing::info!(writer = ?writer.kind(), "shard store writer");
        // Spares get populated maps only for a writer that copies into maps.
        let reserve = reserve::Reserve::open(
            memory.clone(),
            memory_reserve,
            writer.copies_into_maps(),
            stats.clone(),
        )?;
        let names = Mutex::new(names::Names::load(&disk)?);
        let memory_fs = TierFs::of(&memory_dir);
        report_memory_fs(&memory_dir, memory_fs.as_ref());
        let memory_headroom = match (&memory_fs, hostmem::HostMemory::read()) {
            (Some(fs), Some(mem)) if hostmem::memory_backed(&fs.fs_type) => {
                let h = memory_headroom.unwrap_or_else(|| hostmem::default_headroom(mem.total));
                tracing::info!(
                    headroom = h,
                    available = mem.available,
                    "memory tier is RAM: new shards must fit the host's available memory less the headroom"
                );
                Some(h)
            }
            _ => None,
        };
        let inner = Inner {
            memory,
            disk,
            writer,
            memory_fs,
            integrity: Arc::new(Integrity {
                epoch: Instant::now(),
                reverify_after,
                reverify_sends,
                stats,
            }),
            memory_capacity,
            disk_capacity,
            memory_headroom,
            scrub_rate,
            reserve,
            models: Mutex::new(HashMap::new()),
            names,
            memory_shard_created: Arc::new(tokio::sync::Notify::new()),
        };
        let store = Self {
            inner: Arc::new(inner),
        };
        store.remove_stale_temps()?;
        store.recover(verify_on_recover)?;
        store.collect_orphans()?;
        Ok(store)
    }

    /// The memory tier's file system (type, mount, huge-page policy), where `/proc/self/mountinfo`
    /// could tell.
    pub fn memory_fs(&self) -> Option<&TierFs> {
        self.inner.memory_fs.as_ref()
    }

    fn dir(&self, tier: DataTier) -> &Arc<TierDir> {
        match tier {
            DataTier::Memory => &self.inner.memory,
            DataTier::Disk => &self.inner.disk,
        }
    }

    /// The store's counters.
    pub fn stats(&self) -> &StoreStats {
        &self.inner.integrity.stats
    }

    /// [`StoreConfig::scrub_rate`].
    pub fn scrub_rate(&self) -> u64 {
        self.inner.scrub_rate
    }

    /// [`StoreConfig::reverify_after`].
    pub fn reverify_after(&self) -> Duration {
        self.inner.integrity.reverify_after
    }

    /// Removes the `*.tmp` files a crash left in `manifests/` and `state/<digest>/`.
    fn remove_stale_temps(&self) -> Result<(), StoreError> {
        let mut n = self.inner.disk.remove_temps(Path::new("manifests"))?;
        for tier in TIERS {
            let dir = self.dir(tier);
            // Copies kept while building a manifest, left by a crash: never adopted.
            dir.remove_tree(Path::new(STAGING))?;
            for (name, ty) in dir.list(Path::new("state"))? {
                if ty == rustix::fs::FileType::Directory {
                    n += dir.remove_temps(&Path::new("state").join(name))?;
                }
            }
        }
        if n > 0 {
            self.stats()
                .temp_files_removed
                .fetch_add(n, Ordering::Relaxed);
            tracing::info!(removed = n, "removed stale temporary files from the store");
        }
        Ok(())
    }

    /// Loads known manifests, then each tier's models and shards.
    fn recover(&self, verify: bool) -> Result<(), StoreError> {
        let mut models = lock(&self.inner.models);
        let disk = &self.inner.disk;
        for (digest, name) in self.digest_entries(DataTier::Disk, "manifests", ".scmf")? {
            let rel = Path::new("manifests").join(name);
            match read_manifest(disk, &rel, &digest) {
                Ok(m) => {
                    models.insert(
                        digest,
                        Model {
                            manifest: Arc::new(m),
                            tiers: HashMap::new(),
                        },
                    );
                }
                Err(e) => tracing::warn!(error = %e, "skipping a known manifest"),
            }
        }
        for tier in TIERS {
            let dir = self.dir(tier);
            for (digest, _) in self.digest_entries(tier, "state", "")? {
                let state = state_rel(&digest);
                let manifest = match models.get(&digest) {
                    Some(m) => m.manifest.clone(),
                    None => match read_manifest(dir, &state.join(MANIFEST_FILE), &digest) {
                        Ok(m) => {
                            // Known again from now on, even if the tier copy goes.
                            let rel = known_manifest_rel(&digest);
                            disk.write_atomic(&rel, &encode_to_vec(&m))?;
                            let m = Arc::new(m);
                            let model = Model {
                                manifest: m.clone(),
                                tiers: HashMap::new(),
                            };
                            models.insert(digest, model);
                            m
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, ?tier, "skipping a model without a manifest");
                            continue;
                        }
                    },
                };
                let mut shards = HashMap::new();
                for index in 0..manifest.shards.len() as u32 {
                    match dir.is_file(&state.join(format!("{index}.bits"))) {
                        Ok(true) => {}
                        Ok(false) => continue,
                        Err(e) => {
                            tracing::warn!(error = %e, ?tier, "skipping a shard");
                            continue;
                        }
                    }
                    let spec = self.spec(&manifest, digest, index, tier)?;
                    match Shard::open(spec, OpenMode::Recover { verify }) {
                        Ok(shard) => {
                            shards.insert(index, Arc::new(shard));
                        }
                        // A planted symlink skips its shard, not the whole store.
                        Err(e @ StoreError::Symlink { .. }) => {
                            tracing::warn!(error = %e, ?tier, "skipping a shard");
                        }
                        Err(e) => return Err(e),
                    }
                }
                tracing::info!(model = %digest, ?tier, shards = shards.len(), "recovered model");
                if let Some(model) = models.get_mut(&digest) {
                    model.tiers.insert(tier, shards);
                }
            }
        }
        Ok(())
    }

    /// A new staging directory in `tier` (see [`Staging`]).
    pub fn staging(&self, tier: DataTier) -> Result<Staging, StoreError> {
        let rel = Path::new(STAGING).join(hex::encode(rand::random::<[u8; 8]>()));
        let dir = self.dir(tier).clone();
        dir.create_dir_all(&rel)?;
        Ok(Staging { dir, rel })
    }

    /// The directory a tier lives in.
    pub fn tier_root(&self, tier: DataTier) -> &Path {
        self.dir(tier).root()
    }

    fn spec(
        &self,
        manifest: &Arc<Manifest>,
        digest: ModelDigest,
        index: u32,
        tier: DataTier,
    ) -> Result<ShardSpec, StoreError> {
        let entry = manifest.shard(index).map_err(|_| StoreError::NoSuchShard {
            digest,
            shard: index,
        })?;
        Ok(ShardSpec {
            manifest: manifest.clone(),
            digest,
            index,
            tier,
            dir: self.dir(tier).clone(),
            data_rel: shard_file(&model_rel(&digest), &entry.path)?,
            bits_rel: state_rel(&digest).join(format!("{index}.bits")),
            writer: self.inner.writer.clone(),
            integrity: self.inner.integrity.clone(),
            spare: None,
        })
    }

    /// The writer in use (after [`WriterKind::Auto`] was resolved).
    pub fn writer_kind(&self) -> WriterKind {
        self.inner.writer.kind()
    }

    /// Stores a manifest (persisted at once, so it survives a restart even with no data) and
    /// returns the shared copy. Idempotent. Storing a manifest binds no name: see
    /// [`ShardStore::bind_name`].
    pub fn put_manifest(&self, m: &Manifest) -> Result<Arc<Manifest>, StoreError> {
        let digest = m.digest();
        let rel = known_manifest_rel(&digest);
        let disk = &self.inner.disk;
        let mut models = lock(&self.inner.models);
        let known = models.get_mut(&digest);
        // A known manifest is written again only if its file went missing.
        if known.is_none() || disk.open_file(&rel, Access::Read).is_err() {
            disk.write_atomic(&rel, &encode_to_vec(m))?;
        }
        let manifest = match known {
            Some(model) => model.manifest.clone(),
            None => {
                let manifest = Arc::new(m.clone());
                let model = Model {
                    manifest: manifest.clone(),
                    tiers: HashMap::new(),
                };
                models.insert(digest, model);
                manifest
            }
        };
        Ok(manifest)
    }

    /// The manifest of a known model.
    pub fn manifest(&self, d: &ModelDigest) -> Option<Arc<Manifest>> {
        lock(&self.inner.models).get(d).map(|m| m.manifest.clone())
    }

    /// Resolves a 64-character hex digest (returned as is, known or not) or a model name
    /// (its binding in the name table: see [`names`]; `None` if it has none). A manifest
    /// never binds its own name.
    pub fn resolve(&self, name_or_hex_digest: &str) -> Option<ModelDigest> {
        if let Ok(d) = name_or_hex_digest.parse::<ModelDigest>() {
            return Some(d);
        }
        lock(&self.inner.names)
            .get(name_or_hex_digest)
            .map(|b| b.digest)
    }

    /// Binds `name` to `digest` on this host, as `source` stated at `stated_ms` (the
    /// controller's clock; see [`names`] for who may, and which statement wins) and
    /// persists the table when it changed. A statement older than the binding held binds
    /// nothing (counted and logged; the caller carries on).
    pub fn bind_name(
        &self,
        name: &ModelName,
        digest: ModelDigest,
        source: BindingSource,
        stated_ms: u64,
    ) -> Result<(), StoreError> {
        let mut names = lock(&self.inner.names);
        match names.bind(name, digest, source, stated_ms) {
            Ok(true) => names.save(&self.inner.disk)?,
            Ok(false) => {}
            Err(stale) => {
                self.stats()
                    .name_bindings_refused
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    model = %name,
                    to = %digest,
                    ?source,
                    "name binding refused: {stale} (a replayed plan token?)"
                );
            }
        }
        Ok(())
    }

    /// Applies the controller's registry, as it answered at `stated_ms` (its clock), to
    /// the names this host holds (`held`): bound to the registry's version, or unbound when
    /// the registry does not know them, unless a plan token stated later. Persists the
    /// table when it changed.
    pub fn sync_names(
        &self,
        held: &[ModelName],
        registry: &BTreeMap<ModelName, ModelDigest>,
        stated_ms: u64,
    ) -> Result<(), StoreError> {
        let mut names = lock(&self.inner.names);
        if names.sync(held, registry, stated_ms) {
            names.save(&self.inner.disk)?;
        }
        Ok(())
    }

    /// Every name binding, by name.
    pub fn names(&self) -> Vec<(String, Binding)> {
        lock(&self.inner.names)
            .iter()
            .map(|(n, b)| (n.clone(), b.clone()))
            .collect()
    }

    /// Checks that a new shard of `size` bytes fits `tier`: the file system's free space
    /// must cover it plus what the tier's open shards have still to write (their files are
    /// sparse until written), the configured capacity must cover every open shard plus
    /// it, and for a memory tier on tmpfs the host's available memory less the headroom
    /// must cover it plus what is still to write (see [`hostmem`]).
    ///
    /// With `on_file_system` (a kept file moved in, whose bytes already take their room)
    /// only the configured capacity is checked.
    fn check_space(
        &self,
        model: &Model,
        models: &HashMap<ModelDigest, Model>,
        digest: ModelDigest,
        shard: u32,
        tier: DataTier,
        on_file_system: bool,
    ) -> Result<(), StoreError> {
        let size = model
            .manifest
            .shard(shard)
            .map_err(|_| StoreError::NoSuchShard { digest, shard })?
            .size;
        let (allocated, pending) = Self::tier_use(models, tier);
        let cap = match tier {
            DataTier::Memory => self.inner.memory_capacity,
            DataTier::Disk => self.inner.disk_capacity,
        };
        let mut bounds = vec![(
            SpaceLimit::Capacity,
            cap.map_or(u64::MAX, |c| c.saturating_sub(allocated)),
        )];
        if !on_file_system {
            // The memory reserve's spares give way to a shard: their bytes are room.
            let spares = match tier {
                DataTier::Memory => self.inner.reserve.held(),
                DataTier::Disk => 0,
            };
            let free = self.dir(tier).available()?.saturating_add(spares);
            bounds.push((SpaceLimit::FileSystem, free.saturating_sub(pending)));
            if let Some(room) = self.host_room(tier) {
                bounds.push((
                    SpaceLimit::HostMemory,
                    room.saturating_add(spares).saturating_sub(pending),
                ));
            }
        }
        let (limit, available) = bounds
            .into_iter()
            .min_by_key(|b| b.1)
            .unwrap_or((SpaceLimit::FileSystem, u64::MAX));
        if size > available {
            self.stats().space_refusals.fetch_add(1, Ordering::Relaxed);
            let e = StoreError::NoSpace {
                digest,
                shard,
                tier,
                need: size,
                available,
                limit,
            };
            tracing::warn!(error = %e, pending, ?cap, "refusing a shard");
            return Err(e);
        }
        Ok(())
    }

    /// What a memory tier on tmpfs or ramfs may still take of the host's memory: its
    /// available memory less the headroom. `None` for the disk tier, a memory tier on
    /// another file system, or where `/proc/meminfo` cannot be read.
    pub fn host_room(&self, tier: DataTier) -> Option<u64> {
        let headroom = match tier {
            DataTier::Memory => self.inner.memory_headroom?,
            DataTier::Disk => return None,
        };
        Some(hostmem::HostMemory::read()?.room(headroom))
    }

    /// The shard `shard` of model `d` in `tier`, created (data file preallocated to its
    /// size, empty bitmap) if the tier does not have it yet; a new one must fit the tier
    /// (see [`StoreError::NoSpace`]), checked before any file is created. Repeated calls
    /// return the same `Arc`.
    pub fn shard(
        &self,
        d: &ModelDigest,
        shard: u32,
        tier: DataTier,
    ) -> Result<Arc<Shard>, StoreError> {
        let mut models = lock(&self.inner.models);
        let model = models
            .get(d)
            .ok_or(StoreError::UnknownModel { digest: *d })?;
        if let Some(s) = model.tiers.get(&tier).and_then(|t| t.get(&shard)) {
            return Ok(s.clone());
        }
        self.check_space(model, &models, *d, shard, tier, false)?;
        let model = models
            .get_mut(d)
            .ok_or(StoreError::UnknownModel { digest: *d })?;
        let mut spec = self.spec(&model.manifest, *d, shard, tier)?;
        self.prepare_tier_copy(d, model, tier)?;
        let size = model.manifest.shard(shard).map_or(0, |e| e.size);
        if tier == DataTier::Memory && size > 0 {
            if let Some(largest) = model.manifest.shards.iter().map(|e| e.size).max() {
                self.inner.reserve.learn(largest);
            }
            spec.spare = self.inner.reserve.take(size);
        }
        let spare = spec.spare.as_ref().map(|t| t.rel.clone());
        let s = match Shard::open(spec, OpenMode::Create) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                // A spare taken but not renamed yet would otherwise stay until a restart.
                if let Some(rel) = spare {
                    self.inner.reserve.discard(&rel);
                }
                return Err(e);
            }
        };
        self.stats()
            .shards_created
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if s.resident_bytes() > 0 {
            self.inner.reserve.note_taken(s.resident_bytes());
        }
        model
            .tiers
            .entry(tier)
            .or_default()
            .insert(shard, s.clone());
        if tier == DataTier::Memory {
            self.give_way(&models);
            self.inner.memory_shard_created.notify_one();
        }
        Ok(s)
    }

    /// A tier's shard bytes and what its open shards may still allocate.
    fn tier_use(models: &HashMap<ModelDigest, Model>, tier: DataTier) -> (u64, u64) {
        let (mut allocated, mut pending) = (0u64, 0u64);
        for s in models
            .values()
            .filter_map(|m| m.tiers.get(&tier))
            .flat_map(|t| t.values())
        {
            allocated = allocated.saturating_add(s.size());
            pending = pending.saturating_add(s.unallocated_bytes());
        }
        (allocated, pending)
    }

    /// How many more bytes the memory tier may allocate beyond `pending`: the least of what
    /// the configured capacity (less shards and spares), the file system and the host's
    /// memory less the headroom leave. `None` when nothing bounds it.
    fn memory_room(&self, allocated: u64, pending: u64) -> Option<i128> {
        let held = i128::from(self.inner.reserve.held());
        let mut room: Option<i128> = None;
        let mut bound = |r: i128| room = Some(room.map_or(r, |x: i128| x.min(r)));
        if let Some(cap) = self.inner.memory_capacity {
            bound(i128::from(cap) - i128::from(allocated) - held);
        }
        if let Ok(free) = self.inner.memory.available() {
            bound(i128::from(free) - i128::from(pending));
        }
        if let (Some(headroom), Some(mem)) =
            (self.inner.memory_headroom, hostmem::HostMemory::read())
        {
            bound(i128::from(mem.available) - i128::from(headroom) - i128::from(pending));
        }
        room
    }

    /// Drops spares of the memory reserve until the memory tier's bounds again cover what
    /// its open shards may still allocate (see `reserve`: spares give way).
    fn give_way(&self, models: &HashMap<ModelDigest, Model>) {
        let (allocated, pending) = Self::tier_use(models, DataTier::Memory);
        while self.inner.reserve.held() > 0 {
            let need = match self.memory_room(allocated, pending) {
                Some(r) if r < 0 => u64::try_from(-r).unwrap_or(u64::MAX),
                _ => break,
            };
            let Some(freed) = self.inner.reserve.drop_one(need) else {
                break;
            };
            tracing::info!(
                freed,
                held = self.inner.reserve.held(),
                "memory reserve: dropped a spare to give its memory back"
            );
        }
    }

    /// Grows the memory reserve by one step (at most [`FILL_STEP`]) where it is short of its
    /// target and the memory tier's bounds leave room, after dropping spares the bounds no
    /// longer leave room for. Returns the bytes allocated (0: full, or no room). Blocking:
    /// the daemon's filler calls it on the blocking pool while no chunk is being written.
    pub fn fill_reserve(&self) -> Result<u64, StoreError> {
        let reserve = &self.inner.reserve;
        if reserve.config().bytes == 0 {
            return Ok(0);
        }
        let room = {
            let models = lock(&self.inner.models);
            self.give_way(&models);
            if reserve.wanted() == 0 {
                return Ok(0);
            }
            let (allocated, pending) = Self::tier_use(&models, DataTier::Memory);
            self.memory_room(allocated, pending)
        };
        let room = room.map_or(FILL_STEP, |r| u64::try_from(r.max(0)).unwrap_or(0));
        // A step too small to be worth a call waits for room.
        if room < (1 << 20) {
            return Ok(0);
        }
        reserve.fill(room)
    }

    /// Populates a step of the map of a spare of the memory reserve that has none (kept
    /// from an earlier run), so the shard that takes it copies its chunks in rather than
    /// `pwrite`s them. Returns the bytes done (0: nothing to do). The daemon's filler calls
    /// it while the host is idle and [`ShardStore::fill_reserve`] has nothing to do.
    pub fn map_reserve(&self) -> Result<u64, StoreError> {
        self.inner.reserve.map_kept(FILL_STEP)
    }

    /// Notified each time a memory-tier shard file is created (a permit is kept while no one
    /// waits): the daemon registers a shard with the GPUs as its session starts.
    pub fn memory_shard_created(&self) -> Arc<tokio::sync::Notify> {
        self.inner.memory_shard_created.clone()
    }

    /// The memory reserve: bytes held, target, spare size and why filling stopped (if it did).
    pub fn reserve_status(&self) -> ReserveStatus {
        let r = &self.inner.reserve;
        ReserveStatus {
            held: r.held(),
            config: r.config(),
            spare: r.spare_size(),
            refused: r.refused(),
            mapped: r.mapped(),
        }
    }

    /// Creates the directories and the state manifest of `model`'s copy in `tier` when the
    /// tier has none of it yet.
    fn prepare_tier_copy(
        &self,
        d: &ModelDigest,
        model: &Model,
        tier: DataTier,
    ) -> Result<(), StoreError> {
        if model.tiers.contains_key(&tier) {
            return Ok(());
        }
        let dir = self.dir(tier);
        let state = state_rel(d);
        dir.create_dir_all(&state)?;
        dir.create_dir_all(&model_rel(d))?;
        dir.write_atomic(
            &state.join(MANIFEST_FILE),
            &encode_to_vec(model.manifest.as_ref()),
        )
    }

    /// Moves the file `staging` kept for shard `shard` of model `d` into `tier` as that
    /// shard, every chunk marked verified **without hashing it again**. `Ok(None)` when the
    /// tier already has the shard open (the caller tops it up through the verified path) or
    /// `staging` is in another tier (a rename cannot cross file systems).
    ///
    /// Why trusting the hashes taken while the file was written is safe:
    ///
    /// * **Who wrote it.** [`Staging`] creates the file beneath the tier root (owned by the
    ///   daemon's euid, not writable by group or others, checked at start-up), in a
    ///   directory named at random, `0600`/`0640`, with no symlink followed on any
    ///   component; the rename below follows none either and refuses a symlink at either
    ///   end. Only this uid or root can change the file: the same principals that could
    ///   change any shard file after its chunks were verified.
    /// * **What it holds.** [`Origin::build_manifest_keeping`](crate::origin::Origin::build_manifest_keeping)
    ///   writes into it, in order and with `write_all`, the very buffers `ShardHasher`
    ///   hashed for the manifest; one failed write drops the copy (`kept` false, no
    ///   adoption at all), and its length is checked against the manifest here. The file
    ///   is closed before this runs and renamed, not copied, so no byte passes through
    ///   another buffer on the way.
    /// * **What is left: corruption at rest** (a bit flipped in memory or on disk between
    ///   the hash and a read, or a write by root). Every stored chunk has that exposure after
    ///   it is verified, and the store answers it the same way here: adopted chunks get no
    ///   trust stamp (like chunks recovered at start-up without re-hashing), so
    ///   [`Shard::check`] re-hashes each one before its bytes first leave the store (to a
    ///   peer, a GPU or a hand-off), and the scrub re-hashes idle ones. The second hash of
    ///   the old copy-through path protected nothing those checks do not.
    ///
    /// Only the configured capacity is checked (the bytes are already on the file system).
    /// If the shard cannot be opened after the rename, the file is moved back.
    pub fn adopt_kept(
        &self,
        d: &ModelDigest,
        shard: u32,
        tier: DataTier,
        staging: &Staging,
    ) -> Result<Option<Arc<Shard>>, StoreError> {
        let mut models = lock(&self.inner.models);
        let model = models
            .get(d)
            .ok_or(StoreError::UnknownModel { digest: *d })?;
        if model
            .tiers
            .get(&tier)
            .is_some_and(|t| t.contains_key(&shard))
            || !Arc::ptr_eq(&staging.dir, self.dir(tier))
        {
            return Ok(None);
        }
        let entry = model
            .manifest
            .shard(shard)
            .map_err(|_| StoreError::NoSuchShard { digest: *d, shard })?;
        let staged = shard_file(&staging.rel, &entry.path)?;
        self.check_space(model, &models, *d, shard, tier, true)?;
        let model = models
            .get_mut(d)
            .ok_or(StoreError::UnknownModel { digest: *d })?;
        let spec = self.spec(&model.manifest, *d, shard, tier)?;
        self.prepare_tier_copy(d, model, tier)?;
        let dir = self.dir(tier);
        let data_rel = spec.data_rel.clone();
        if let Some(parent) = data_rel.parent().filter(|p| !p.as_os_str().is_empty()) {
            dir.create_dir_all(parent)?;
        }
        dir.rename_file(&staged, &data_rel)?;
        let s = match Shard::open(spec, OpenMode::Adopt) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                // Back where the caller's fallback (a verified copy) looks for it.
                if let Err(back) = dir.rename_file(&data_rel, &staged) {
                    tracing::warn!(error = %back, "moving a kept file back to staging");
                }
                return Err(e);
            }
        };
        model
            .tiers
            .entry(tier)
            .or_default()
            .insert(shard, s.clone());
        Ok(Some(s))
    }

    /// The shard if some tier already has it: the copy with the most verified chunks, the
    /// memory tier's on a tie.
    pub fn existing_shard(&self, d: &ModelDigest, shard: u32) -> Option<Arc<Shard>> {
        let models = lock(&self.inner.models);
        let model = models.get(d)?;
        let mut best: Option<&Arc<Shard>> = None;
        for tier in TIERS {
            if let Some(s) = model.tiers.get(&tier).and_then(|t| t.get(&shard)) {
                if best.is_none_or(|b| s.verified_count() > b.verified_count()) {
                    best = Some(s);
                }
            }
        }
        best.cloned()
    }

    /// The shard's copy in `tier`, if that tier has one open (never creates it).
    pub fn tier_shard(&self, d: &ModelDigest, shard: u32, tier: DataTier) -> Option<Arc<Shard>> {
        lock(&self.inner.models)
            .get(d)?
            .tiers
            .get(&tier)?
            .get(&shard)
            .cloned()
    }

    /// Every shard copy open in either tier, as (model, tier, shard index): the scrub looks
    /// each up when it reaches it, so it never keeps a removed copy mapped.
    pub fn shard_keys(&self) -> Vec<(ModelDigest, DataTier, u32)> {
        let models = lock(&self.inner.models);
        let mut out: Vec<_> = models
            .iter()
            .flat_map(|(d, m)| {
                m.tiers
                    .iter()
                    .flat_map(move |(t, shards)| shards.keys().map(move |i| (*d, *t, *i)))
            })
            .collect();
        out.sort_by_key(|(d, t, i)| (*d, matches!(t, DataTier::Disk), *i));
        out
    }

    /// Every (model, tier) copy present, with per-shard progress.
    pub fn holdings(&self) -> Vec<Holding> {
        let models = lock(&self.inner.models);
        let mut out: Vec<Holding> = models
            .iter()
            .flat_map(|(digest, model)| self.model_holdings(digest, model))
            .collect();
        out.sort_by(|a, b| (a.name.as_str(), a.digest).cmp(&(b.name.as_str(), b.digest)));
        out
    }

    /// The holdings of one model (one per tier with any of it), memory first: what
    /// [`ShardStore::holdings`] lists for `digest`, without visiting the other models.
    pub fn holdings_of(&self, digest: &ModelDigest) -> Vec<Holding> {
        let models = lock(&self.inner.models);
        models
            .get(digest)
            .map(|m| self.model_holdings(digest, m).collect())
            .unwrap_or_default()
    }

    fn model_holdings<'a>(
        &'a self,
        digest: &'a ModelDigest,
        model: &'a Model,
    ) -> impl Iterator<Item = Holding> + 'a {
        TIERS.into_iter().filter_map(move |tier| {
            let shards = model.tiers.get(&tier)?;
            let shards = model
                .manifest
                .shards
                .iter()
                .enumerate()
                .map(|(i, e)| ShardState {
                    path: e.path.clone(),
                    size: e.size,
                    verified: shards.get(&(i as u32)).map_or(0, |s| s.verified_count()),
                    total: e.chunks.len() as u32,
                })
                .collect();
            Some(Holding {
                digest: *digest,
                name: model.manifest.name.clone(),
                tier,
                dir: self.model_dir(digest, tier),
                shards,
            })
        })
    }

    /// The directory holding model `d`'s shard files in `tier`, under their original
    /// names; an inference process maps files from here.
    pub fn model_dir(&self, d: &ModelDigest, tier: DataTier) -> PathBuf {
        self.tier_root(tier).join(model_rel(d))
    }

    /// Deletes `tier`'s copy of model `d` (data and state). Shards still held elsewhere fail
    /// later reads and writes with [`StoreError::Removed`]. The manifest stays known.
    /// Removing a copy that is not there is not an error. Never deletes through a symlink
    /// (see `beneath`). Returns the bytes freed: the blocks of every file removed, complete
    /// or partial shards and their state alike.
    pub fn remove(&self, d: &ModelDigest, tier: DataTier) -> Result<u64, StoreError> {
        let mut models = lock(&self.inner.models);
        let model = models
            .get_mut(d)
            .ok_or(StoreError::UnknownModel { digest: *d })?;
        if let Some(shards) = model.tiers.remove(&tier) {
            for s in shards.values() {
                s.mark_removed();
            }
        }
        // State first: a crash in between leaves data without bits, which recovery ignores
        // and the next start collects as an orphan.
        let dir = self.dir(tier);
        let state = dir.remove_tree(&state_rel(d))?;
        Ok(state + dir.remove_tree(&model_rel(d))?)
    }

    /// Removes what no model accounts for after [`Self::recover`]: a tier's
    /// `models/<digest>` without recovered state there (an evict or a crash between removing
    /// the state and the data), and `state/<digest>` whose manifest is unknown. Only
    /// entries named as a digest are touched. Counted in
    /// [`StoreStats::orphans_removed`] and [`StoreStats::orphan_bytes_removed`].
    fn collect_orphans(&self) -> Result<(), StoreError> {
        let models = lock(&self.inner.models);
        let (mut n, mut bytes) = (0u64, 0u64);
        for tier in TIERS {
            let dir = self.dir(tier);
            let held = |d: &ModelDigest| models.get(d).is_some_and(|m| m.tiers.contains_key(&tier));
            for (sub, rel) in [
                ("models", model_rel as fn(&ModelDigest) -> PathBuf),
                ("state", state_rel),
            ] {
                for (digest, _) in self.digest_entries(tier, sub, "")? {
                    if held(&digest) {
                        continue;
                    }
                    let freed = dir.remove_tree(&rel(&digest))?;
                    tracing::info!(model = %digest, ?tier, dir = sub, bytes = freed, "removed an orphaned copy no model accounts for");
                    n += 1;
                    bytes += freed;
                }
            }
        }
        let st = self.stats();
        st.orphans_removed.fetch_add(n, Ordering::Relaxed);
        st.orphan_bytes_removed.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Entries of `sub` in `tier` named `<digest-hex><suffix>`, with their names. Other
    /// names are skipped; symlinks are refused (counted, logged) and skipped.
    fn digest_entries(
        &self,
        tier: DataTier,
        sub: &str,
        suffix: &str,
    ) -> Result<Vec<(ModelDigest, OsString)>, StoreError> {
        let dir = self.dir(tier);
        let mut out = Vec::new();
        for (name, ty) in dir.list(Path::new(sub))? {
            let Some(hex) = name.to_str().and_then(|n| n.strip_suffix(suffix)) else {
                continue;
            };
            let Ok(d) = hex.parse::<ModelDigest>() else {
                tracing::debug!(name = ?name, "ignoring a stray entry in the store");
                continue;
            };
            if ty == rustix::fs::FileType::Symlink {
                // Counted and logged by the refusal; the entry is skipped.
                let _ = dir.is_file(&Path::new(sub).join(&name));
                continue;
            }
            out.push((d, name));
        }
        Ok(out)
    }
}
