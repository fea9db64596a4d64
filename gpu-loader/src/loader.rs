//! The streaming loader: verified chunks → pinned staging ring → host-to-device copies on the
//! first GPU → peer copies (NVLink) to sibling GPUs, all three overlapped with the network
//! transfer that is still delivering chunks.
//!
//! Threads per load ([`load`] / [`load_map`]; a [`crate::index::LoadMap`] says what is
//! copied and in which order: the whole model, or a partition's ranges first):
//!
//! 1. [`LoadOptions::fill_threads`] **fillers** (up to 4 by default, since one core's
//!    memcpy is slower than PCIe) each take a free staging buffer (blocking when all are in
//!    flight: back-pressure, never unbounded memory), then the next piece in load order (a
//!    piece is one staging buffer), wait until the chunks under it are verified, fill the
//!    buffer from the source and issue the copy to the first GPU — and to siblings that
//!    have no peer path, from the same buffer;
//! 2. the **completer** puts the fillers' pieces back in load order, waits each copy's
//!    event, returns the buffer to the ring, and issues the peer copies of that piece to
//!    the siblings with a peer path;
//! 3. the **peer waiter** waits the peer copies and counts bytes per sibling.
//!
//! Every byte crosses PCIe once when peers exist. Bytes per GPU are published in
//! [`LoadProgress`] as they land, with the partition milestone (every GPU holds the
//! priority part). The fillers run, and the staging ring is allocated, on the GPU's NUMA
//! node ([`crate::numa`]).
//!
//! # Host paths: registered or staging
//!
//! When the source's shards are mapped files ([`ChunkSource::host_memory`]: transferd's
//! memory tier is files in tmpfs, mapped), the loader registers the mappings with the first
//! GPU ([`Device::register_host`], CUDA `cuMemHostRegister`) in
//! [`LoadOptions::register_segment`] segments: the first before any copy (it decides the
//! path), the others on two pinner threads a few segments ahead of the copies. The fillers
//! issue copies of at least [`LoadOptions::copy_size`] straight from the mapping
//! ([`Device::copy_htod_registered`]) on [`LoadOptions::copy_streams`] streams in turn: no
//! CPU copy into staging, which caps the staging path at what the fillers' memcpy sustains.
//! A piece is still copied only once the source says its chunks are verified (and after
//! [`ChunkSource::check_direct`]), exactly as on the staging path; the ring's slots then only
//! bound the copies in flight. With a [`RegistrationCache`] the registrations outlive the
//! load, so only the first load of a mapping pays for pinning it (pinning is slower than the
//! copies and, on CUDA, does not overlap them).
//!
//! When registration is off, impossible (a shard that is not a mapped file, a backend that
//! cannot) or refused (a driver error) for the first segment, the load uses the staging
//! ring; a later segment that fails goes through a filler's own staging buffer.
//! [`LoadReport::host_path`] with [`LoadReport::fallback_reason`] says which path ran and
//! why; the report also gives `register_s`, `waited_for_register_s`, `registrations` /
//! `registrations_reused`, `staged_bytes`, `copy_streams` and `numa_node` / `numa_reason`.
//!
//! [`RegistrationCache`]: registrations kept across loads while the mapping's owner holds
//! it (`sweep` at each load's start releases the others). A segment being registered is
//! marked pending, so a second caller (a load and the registrar ahead of it, or two loads)
//! waits for it instead of registering the same pages twice, which the driver refuses;
//! `register_ahead` registers a whole mapping in the segments loads use (`segment_span`),
//! pausing when told to.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::device::{
    Completion, DevSpan, Device, GpuError, HostMemory, HostRegistration, HostSlice, Staging,
};
use crate::index::{Layout, LoadMap};

/// One shard as the source describes it.
#[derive(Debug, Clone)]
pub struct SourceShard {
    /// Path in the model.
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// Chunk size of the manifest.
    pub chunk_size: u32,
}

/// Why a [`ChunkSource`] cannot deliver chunks a load waits for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// The source has no such shard.
    #[error("no shard {0}")]
    NoShard(usize),
    /// The shard's copy was removed from the store while the load waited.
    #[error("the shard was removed from the store")]
    Removed,
    /// The chunks were not verified within the load's `chunk_timeout`.
    #[error("not verified within {0:?}")]
    Timeout(Duration),
    /// The transfer feeding the source failed, as the source words it.
    #[error("{0}")]
    Failed(String),
}

/// Where verified chunks come from: the store of transferd, or a test double.
pub trait ChunkSource: Send + Sync {
    /// The shards, in manifest order.
    fn shards(&self) -> &[SourceShard];
    /// Blocks until chunks `first..=last` of `shard` are verified (`Ok(true)`), `timeout`
    /// passes (`Ok(false)`), or the transfer failed (`Err`).
    fn wait_verified(
        &self,
        shard: usize,
        first: u32,
        last: u32,
        timeout: Duration,
    ) -> Result<bool, SourceError>;
    /// Reads verified bytes of `shard` at `offset` into `buf`.
    fn read(&self, shard: usize, offset: u64, buf: &mut [u8]) -> std::io::Result<()>;
    /// The whole of `shard` as host memory a device can register (a read-only map of the
    /// shard's file), for copies with no staging copy; `None` (the default) when the shard
    /// is not a mapped file. Its bytes at an offset must be what [`ChunkSource::read`]
    /// returns there.
    fn host_memory(&self, shard: usize) -> Option<Arc<dyn HostMemory>> {
        let _ = shard;
        None
    }
    /// Called before bytes `offset .. offset + len` of `shard`, whose chunks are verified,
    /// are copied to a GPU straight from [`ChunkSource::host_memory`] (so [`ChunkSource::read`]
    /// is not called for them): whatever `read` checks besides verification (transferd
    /// re-hashes chunks that may have rotted at rest, and repairs a bad one). The default
    /// checks nothing.
    fn check_direct(&self, shard: usize, offset: u64, len: u64) -> std::io::Result<()> {
        let _ = (shard, offset, len);
        Ok(())
    }
}

/// Loader settings.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Staging buffers in the ring.
    pub staging_buffers: usize,
    /// Bytes per staging buffer (one copy each).
    pub staging_size: usize,
    /// A piece whose chunks are not verified within this fails the load.
    pub chunk_timeout: Duration,
    /// Threads copying verified chunks into staging buffers at once (at most one per
    /// buffer). One core's memcpy is slower than a PCIe Gen5 link, so a single filler
    /// would cap the host → GPU rate. On the registered path they only wait for chunks and
    /// issue copies.
    pub fill_threads: usize,
    /// Copy from the source's mapped files directly (register them with the GPU) when it
    /// has them; `false` always uses the staging ring.
    pub register_host: bool,
    /// Copy streams per GPU on the registered path (copies go to them in turn, so one
    /// copy's start does not wait for the previous one's end); 1 to 8.
    pub copy_streams: usize,
    /// Bytes registered (pinned) at a time on the registered path, a multiple of the page
    /// size: the first copy waits for one segment, the rest are pinned ahead of the copies.
    pub register_segment: u64,
    /// Bytes per copy on the registered path, at least: verified chunks are coalesced into
    /// copies of `max(copy_size, staging_size)` (larger copies cost less per byte:
    /// measured on the H100, 4 MiB copies reached 0.82 of the pinned peak, 16 MiB 0.88).
    pub copy_size: usize,
    /// Registrations kept across loads: a mapping registered by one load is reused by the
    /// next ones while its owner (the memory tier) still holds it. `None`: each load
    /// registers what it copies and unregisters it when it ends.
    pub registrations: Option<Arc<RegistrationCache>>,
    /// What a load does with mapped shards not registered yet (a *fresh* mapping: the
    /// shards arrived since the last register-ahead pass, or there is no
    /// [`registrations`](Self::registrations) cache): pin them as it copies, or stage them.
    pub fresh: FreshMappings,
}

/// What a load does with host memory not registered yet ([`LoadOptions::fresh`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FreshMappings {
    /// Register it segment by segment ahead of the copies (kept in the cache for the next
    /// loads). The driver serialises pinning with the copies, so the load runs at the
    /// slower of pinning and PCIe: a fresh 4 KiB-page mapping pins at about 16 GB/s on an
    /// H200, a third of its PCIe rate.
    #[default]
    Register,
    /// Copy it through the staging ring (CPU copies into pinned buffers on several
    /// threads), leaving it for register-ahead to pin while no load runs; memory found
    /// registered already still takes the registered path.
    Stage,
}

impl std::str::FromStr for FreshMappings {
    type Err = String;
    fn from_str(v: &str) -> Result<Self, String> {
        match v {
            "register" => Ok(Self::Register),
            "stage" => Ok(Self::Stage),
            other => Err(format!("expected register or stage, got {other:?}")),
        }
    }
}

/// The most copy streams per GPU ([`LoadOptions::copy_streams`]).
pub const MAX_COPY_STREAMS: usize = 8;

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            staging_buffers: 8,
            staging_size: 4 << 20,
            chunk_timeout: Duration::from_secs(120),
            fill_threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(4),
            register_host: true,
            // Four streams keep a few copies queued on the DMA engines; more gain nothing
            // when one link is the limit (`shardcast-bench loader --copy-streams N`).
            copy_streams: 4,
            register_segment: DEFAULT_REGISTER_SEGMENT,
            copy_size: 16 << 20,
            registrations: None,
            fresh: FreshMappings::default(),
        }
    }
}

/// How bytes went from host memory to the first GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostPath {
    /// Straight from the source's registered (page-locked) mapped files.
    Registered,
    /// Through the ring of pinned staging buffers, filled by CPU copies.
    Staging,
}

impl std::fmt::Display for HostPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Registered => "registered",
            Self::Staging => "staging",
        })
    }
}

/// Why a load failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A device operation failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// The data never arrived.
    #[error("shard {shard}: chunks {first}..={last} not verified: {why}")]
    Source {
        /// Shard path.
        shard: String,
        /// First chunk.
        first: u32,
        /// Last chunk.
        last: u32,
        /// Why.
        why: SourceError,
    },
    /// Reading the store failed.
    #[error("reading {shard}: {source}")]
    Io {
        /// Shard path.
        shard: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The layout and the targets do not fit together.
    #[error("invalid load: {0}")]
    Invalid(String),
    /// Cancelled.
    #[error("cancelled")]
    Cancelled,
}

/// Bytes landed per GPU, updated while loading.
#[derive(Debug)]
pub struct LoadProgress {
    /// Bytes the load copies to each GPU.
    pub total: u64,
    /// Bytes of the priority part (a partition; `total` for a whole-model load).
    pub first_total: u64,
    /// (device index, bytes landed).
    pub gpus: Vec<(u32, AtomicU64)>,
    /// Set to stop the load.
    pub cancel: AtomicBool,
    started: Instant,
    /// Nanoseconds from the start until every GPU held the priority part, plus one (0: not
    /// yet).
    first_done_ns: AtomicU64,
}

impl LoadProgress {
    /// Progress for `total` bytes on `gpus`.
    pub fn new(total: u64, gpus: &[u32]) -> Self {
        Self::with_first(total, total, gpus)
    }

    /// Progress for `total` bytes on `gpus`, of which the first `first_total` are the
    /// priority part.
    pub fn with_first(total: u64, first_total: u64, gpus: &[u32]) -> Self {
        Self {
            total,
            first_total: first_total.min(total),
            gpus: gpus.iter().map(|&g| (g, AtomicU64::new(0))).collect(),
            cancel: AtomicBool::new(false),
            started: Instant::now(),
            first_done_ns: AtomicU64::new(0),
        }
    }

    fn add(&self, slot: usize, n: u64) {
        if let Some((_, b)) = self.gpus.get(slot) {
            // Bytes land in copy order on each GPU, so "every GPU has `first_total` bytes"
            // means "every GPU holds the priority part".
            let now = b.fetch_add(n, Ordering::Relaxed) + n;
            if now >= self.first_total
                && self.first_done_ns.load(Ordering::Relaxed) == 0
                && self
                    .gpus
                    .iter()
                    .all(|(_, b)| b.load(Ordering::Relaxed) >= self.first_total)
            {
                let ns = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                let _ = self.first_done_ns.compare_exchange(
                    0,
                    ns.saturating_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
        }
    }

    /// Seconds from the start until every GPU held the priority part (the partition is
    /// live), once it has.
    pub fn first_done_s(&self) -> Option<f64> {
        match self.first_done_ns.load(Ordering::Relaxed) {
            0 => None,
            n => Some((n - 1) as f64 / 1e9),
        }
    }

    /// When every GPU held the priority part, in seconds since `t0` (a load's own start,
    /// taken after this progress was made), so it compares with that load's elapsed time.
    fn first_done_since(&self, t0: Instant) -> Option<f64> {
        let offset = t0.saturating_duration_since(self.started).as_secs_f64();
        self.first_done_s().map(|s| (s - offset).max(0.0))
    }

    /// Bytes landed on each GPU.
    pub fn snapshot(&self) -> Vec<(u32, u64)> {
        self.gpus
            .iter()
            .map(|(g, b)| (*g, b.load(Ordering::Relaxed)))
            .collect()
    }
}

/// What a finished load measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoadReport {
    /// Model bytes per GPU.
    pub bytes: u64,
    /// Start to every GPU holding every byte.
    pub elapsed_s: f64,
    /// When the first GPU held every byte.
    pub primary_s: f64,
    /// Bytes of the priority part (the partition).
    pub first_bytes: u64,
    /// When every GPU held the priority part (the partition went live).
    pub first_s: f64,
    /// Time the issuer spent waiting for chunks to be verified (network-bound share).
    pub waited_for_data_s: f64,
    /// Time the issuer spent waiting for a free staging buffer (device-bound share).
    pub waited_for_staging_s: f64,
    /// Siblings fed over the peer path / over the host path.
    pub peer_siblings: usize,
    /// Siblings fed from the host (no peer path).
    pub host_siblings: usize,
    /// Which host → GPU path ran.
    pub host_path: HostPath,
    /// Why the staging ring ran instead of the registered path; on the registered path, why
    /// some segments went through staging (`staged_bytes`). `None` when every byte was
    /// copied from registered memory.
    pub fallback_reason: Option<String>,
    /// Seconds spent registering (page-locking) the source's mappings, segment by segment,
    /// by all pinner threads together: overlapped with the copies, except the first segment
    /// (0 on the staging path).
    pub register_s: f64,
    /// Time the fillers waited for a segment to be registered (summed over fillers): where
    /// pinning, not the copies, was the limit.
    pub waited_for_register_s: f64,
    /// Registration segments the load copied from.
    pub registrations: usize,
    /// Of those, the ones registered already (kept from an earlier load).
    pub registrations_reused: usize,
    /// Bytes copied through staging buffers (all of them on the staging path; on the
    /// registered path those of segments that failed to register).
    pub staged_bytes: u64,
    /// Copy streams used per GPU (1 on the staging path).
    pub copy_streams: usize,
    /// The NUMA node the fillers ran on and the staging buffers were allocated on (the
    /// first GPU's, [`crate::numa`]); `None` when they were not placed, see `numa_reason`.
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// Why the fillers and staging buffers were not placed on the GPU's NUMA node.
    #[serde(default)]
    pub numa_reason: Option<String>,
}

/// A target GPU and the span of the model's region on it.
#[derive(Clone)]
pub struct Target {
    /// The device.
    pub device: Arc<dyn Device>,
    /// The region.
    pub span: DevSpan,
}

#[derive(Clone, Copy)]
struct Piece {
    shard: usize,
    offset: u64,
    len: u64,
    /// Offset in the region.
    dest: u64,
}

/// The load's pieces: `map`'s extents cut into pieces of at most `size` bytes, and also at
/// every multiple of `cut` in the shard (registration segments) when given.
fn pieces(
    layout: &Layout,
    map: &LoadMap,
    source: &[SourceShard],
    size: u64,
    cut: Option<u64>,
) -> Result<Vec<Piece>, LoadError> {
    if layout.shards.len() != source.len() {
        return Err(LoadError::Invalid(format!(
            "layout has {} shards, the source {}",
            layout.shards.len(),
            source.len()
        )));
    }
    let mut out = Vec::new();
    for e in &map.extents {
        let within = source
            .get(e.shard)
            .is_some_and(|s| e.offset.checked_add(e.len).is_some_and(|end| end <= s.size));
        if !within || e.dest.saturating_add(e.len) > map.region {
            return Err(LoadError::Invalid(format!(
                "extent {}+{} of shard {} does not fit the shard or the region",
                e.offset, e.len, e.shard
            )));
        }
        let mut off = 0;
        while off < e.len {
            let mut len = size.min(e.len - off);
            if let Some(c) = cut.filter(|&c| c > 0) {
                len = len.min(c - (e.offset + off) % c);
            }
            out.push(Piece {
                shard: e.shard,
                offset: e.offset + off,
                len,
                dest: e.dest + off,
            });
            off += len;
        }
    }
    Ok(out)
}

/// An issued piece: its place in the load order, the piece, its staging buffer (none on the
/// registered path: the slot only bounds the copies in flight), and the copies to wait for.
type Staged = (
    usize,
    Piece,
    Option<Box<dyn Staging>>,
    Vec<Box<dyn Completion>>,
);

/// Bytes pinned per registration on the registered path, by default
/// ([`LoadOptions::register_segment`]). Pinning runs at 15–30 GB/s on the
/// H100 host measured (4 KiB pages; `registration_rate_by_segment_and_threads` in `cuda`),
/// below the ≈ 52 GB/s of the copies from pinned memory, so the loader pins segment by
/// segment ahead of the copies instead of every shard before the first one. At 128 MiB the
/// first copy waits for one segment only (a few ms) and the per-call cost is small.
pub const DEFAULT_REGISTER_SEGMENT: u64 = 128 << 20;

/// Threads pinning segments ahead of the copies: two pinned about 1.8× faster than one on
/// the H100 host; more did not help (the driver serialises much of the work).
const PINNERS: usize = 2;

/// Segments the pinners may register past the last one a filler asked for. The driver
/// serialises registering with the copy calls, so pinning far ahead delays the copies that
/// are due now (a partition's, the first bytes of a model); a few segments keep the copies
/// from waiting for their segment.
const PIN_AHEAD: usize = 3;

/// Registrations of host memory kept across loads ([`LoadOptions::registrations`]).
///
/// Pinning runs at 15–30 GB/s and, measured on the H100 host, does not overlap the copies
/// (the driver serialises `cuMemHostRegister` with the copy calls of other threads), so a
/// load that registers its mappings is bound by pinning plus copying. Kept registrations make
/// every later load of the same mapping copy at the link's rate, and
/// [`RegistrationCache::register_ahead`] lets the owner of a mapping pin it before any load
/// asks (transferd does so for the memory tier's complete shards while no load runs), so
/// even the first load finds it registered. A mapping stays registered (pinned, so never
/// swapped or migrated) while anyone but the cache holds it: for transferd, while the shard
/// is in the memory tier and so already in RAM. [`RegistrationCache::sweep`], run at the
/// start of each load, unregisters mappings that only the cache still holds.
///
/// A segment being registered is marked pending, so a second caller for it (a load and the
/// registrar ahead of it, or two loads) waits for the first instead of registering the same
/// pages again, which the driver refuses.
#[derive(Default)]
pub struct RegistrationCache {
    mappings: Mutex<Vec<CachedMapping>>,
    /// Signalled when a pending segment is registered or its registration failed.
    settled: std::sync::Condvar,
}

/// One mapping's kept registrations.
struct CachedMapping {
    memory: Arc<dyn HostMemory>,
    /// By (start, len) in the mapping.
    segments: std::collections::HashMap<(usize, usize), Kept>,
}

/// A segment of a kept mapping.
enum Kept {
    /// Registered.
    Ready(Arc<dyn HostRegistration>),
    /// Being registered by another thread.
    Pending,
}

impl CachedMapping {
    fn ready(&self) -> impl Iterator<Item = &Arc<dyn HostRegistration>> {
        self.segments.values().filter_map(|k| match k {
            Kept::Ready(r) => Some(r),
            Kept::Pending => None,
        })
    }
}

impl std::fmt::Debug for RegistrationCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistrationCache")
            .field("registered_bytes", &self.registered_bytes())
            .finish()
    }
}

/// Whether two handles name the same memory (the same allocation).
fn same_memory(a: &Arc<dyn HostMemory>, b: &Arc<dyn HostMemory>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// Bytes `(start, len)` of registration segment `seg` of `size` bytes in a memory of
/// `mapped` bytes (the last segment is shorter). Loads and [`RegistrationCache::register_ahead`]
/// cut mappings the same way, so a segment pinned ahead is the one a load looks up.
fn segment_span(mapped: u64, seg: u64, size: u64) -> Option<(usize, usize)> {
    let start = seg.checked_mul(size)?;
    let len = mapped.saturating_sub(start).min(size);
    usize::try_from(start).ok().zip(usize::try_from(len).ok())
}

/// What one [`RegistrationCache::register_ahead`] call did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ahead {
    /// Segments registered by this call.
    pub segments: usize,
    /// Bytes registered by this call.
    pub bytes: u64,
    /// Whether every segment of the memory is now registered (`false`: paused before the end).
    pub complete: bool,
}

impl RegistrationCache {
    /// An empty cache.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Bytes registered and kept.
    pub fn registered_bytes(&self) -> u64 {
        crate::lock(&self.mappings)
            .iter()
            .flat_map(CachedMapping::ready)
            .map(|r| r.len())
            .sum()
    }

    /// Unregisters the mappings nobody but the cache holds any more (their owner dropped
    /// them: the shard left the memory tier); returns the bytes released.
    pub fn sweep(&self) -> u64 {
        let mut gone = Vec::new();
        crate::lock(&self.mappings).retain_mut(|m| {
            // Held by: the cache, each kept segment's slice, and others (a registration in
            // progress holds its slice too, so its mapping is kept).
            let others = Arc::strong_count(&m.memory) > 1 + m.ready().count();
            if !others {
                gone.extend(m.segments.drain().filter_map(|(_, k)| match k {
                    Kept::Ready(r) => Some(r),
                    Kept::Pending => None,
                }));
            }
            others
        });
        // Unregistered here, outside the lock (each drop calls the driver).
        let bytes = gone.iter().map(|r| r.len()).sum();
        drop(gone);
        bytes
    }

    /// Whether `memory[start .. start + len]` is registered and kept.
    fn holds(&self, memory: &Arc<dyn HostMemory>, start: usize, len: usize) -> bool {
        crate::lock(&self.mappings)
            .iter()
            .find(|m| same_memory(&m.memory, memory))
            .and_then(|m| m.segments.get(&(start, len)))
            .is_some_and(|k| matches!(k, Kept::Ready(_)))
    }

    /// The kept registration of `memory[start .. start + len]`, or a new one made with
    /// `device` and kept; whether it was kept already. Waits while another thread is
    /// registering the same segment.
    fn get_or_register(
        &self,
        memory: &Arc<dyn HostMemory>,
        start: usize,
        len: usize,
        device: &dyn Device,
    ) -> Result<(Arc<dyn HostRegistration>, bool), GpuError> {
        let slice = HostSlice::new(memory.clone(), start, len)
            .ok_or_else(|| GpuError::Invalid(format!("bytes {start}+{len} outside the memory")))?;
        let key = (start, len);
        let mut mappings = crate::lock(&self.mappings);
        loop {
            let at = match mappings.iter().position(|m| same_memory(&m.memory, memory)) {
                Some(at) => at,
                None => {
                    mappings.push(CachedMapping {
                        memory: memory.clone(),
                        segments: Default::default(),
                    });
                    mappings.len() - 1
                }
            };
            match mappings[at].segments.get(&key) {
                // Registrations are portable: any GPU of the backend copies from them.
                Some(Kept::Ready(r)) => return Ok((r.clone(), true)),
                Some(Kept::Pending) => {
                    // The other registration ends (registered or failed) within one
                    // driver call; the timeout only re-checks.
                    mappings = self
                        .settled
                        .wait_timeout(mappings, Duration::from_millis(200))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                None => {
                    mappings[at].segments.insert(key, Kept::Pending);
                    break;
                }
            }
        }
        drop(mappings);
        // Registered outside the lock: pinning takes a while.
        let registered = device.register_host(Arc::new(slice));
        let mut mappings = crate::lock(&self.mappings);
        // A sweep keeps a mapping with a registration in progress, so it is still there.
        if let Some(m) = mappings.iter_mut().find(|m| same_memory(&m.memory, memory)) {
            match &registered {
                Ok(r) => {
                    m.segments.insert(key, Kept::Ready(r.clone()));
                }
                Err(_) => {
                    m.segments.remove(&key);
                }
            }
        }
        mappings.retain(|m| !m.segments.is_empty());
        drop(mappings);
        self.settled.notify_all();
        registered.map(|r| (r, false))
    }

    /// Registers (with `device`) and keeps every `segment`-byte segment of `memory` not
    /// kept yet, in order, cut as a load cuts it ([`LoadOptions::register_segment`]), so
    /// loads of it find it registered. Checks `pause` before each segment and returns early
    /// when it says so (a load started: the driver serialises pinning with its copies).
    /// Stops at the first segment the device refuses and returns that error.
    pub fn register_ahead(
        &self,
        memory: &Arc<dyn HostMemory>,
        segment: u64,
        device: &dyn Device,
        pause: &dyn Fn() -> bool,
    ) -> Result<Ahead, GpuError> {
        if segment == 0 || segment % PAGE != 0 {
            return Err(GpuError::Invalid(format!(
                "register_segment must be a positive multiple of {PAGE}, got {segment}"
            )));
        }
        let mapped = memory.as_bytes().len() as u64;
        let mut done = Ahead::default();
        for seg in 0..mapped.div_ceil(segment) {
            if pause() {
                return Ok(done);
            }
            let (start, len) = segment_span(mapped, seg, segment).ok_or_else(|| {
                GpuError::Invalid(format!("segment {seg} lies outside the address space"))
            })?;
            let (r, kept) = self.get_or_register(memory, start, len, device)?;
            if !kept {
                done.segments += 1;
                done.bytes += r.len();
            }
        }
        done.complete = true;
        Ok(done)
    }
}

/// Why the registered host path (copies straight from the mapped shards) is not taken, or
/// not for a segment; the load then stages those bytes ([`LoadReport::fallback_reason`]).
#[derive(Debug, Clone, thiserror::Error)]
pub enum RegisteredPathError {
    /// [`LoadOptions::register_host`] is off.
    #[error("register_host is off")]
    Off,
    /// A host-fed GPU is of another kind than the first GPU.
    #[error("GPU {gpu} is fed from the host but is a {kind} device, the first GPU a {first} one")]
    MixedKinds {
        /// The host-fed GPU.
        gpu: u32,
        /// Its kind.
        kind: crate::device::DeviceKind,
        /// The first GPU's kind.
        first: crate::device::DeviceKind,
    },
    /// The load map names a shard the source lacks.
    #[error("no shard {0}")]
    NoShard(usize),
    /// The shard is not a mapped file.
    #[error("shard {0} is not a mapped file")]
    NotMapped(String),
    /// The shard's mapping is shorter than the shard.
    #[error("shard {path}: its mapping has {mapped} bytes, the shard {size}")]
    ShortMapping {
        /// The shard.
        path: String,
        /// Bytes mapped.
        mapped: u64,
        /// The shard's size.
        size: u64,
    },
    /// The shard's memory is not registered yet and the load stages fresh memory
    /// ([`FreshMappings::Stage`]).
    #[error("shard {0} is not registered yet (fresh = stage)")]
    Fresh(String),
    /// A piece lies in no registration segment.
    #[error("no registration segment for shard {0}")]
    NoSegment(usize),
    /// The shard has no host memory to register.
    #[error("shard {0} has no host memory")]
    NoHostMemory(usize),
    /// A segment lies outside the shard's mapping.
    #[error("segment {seg} of shard {shard} is outside its mapping")]
    Outside {
        /// The segment.
        seg: u64,
        /// The shard.
        shard: usize,
    },
    /// The device refused to register the segment.
    #[error("registering shard {path} (bytes {start}..{end}): {error}")]
    Register {
        /// The shard.
        path: String,
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
        /// What the device said.
        error: Arc<GpuError>,
    },
}

/// Registration segments start on pages ([`LoadOptions::register_segment`]).
const PAGE: u64 = 4096;

/// The shards' host memory, when the registered path is possible, or why not.
fn host_memories(
    source: &dyn ChunkSource,
    map: &LoadMap,
    primary: &Arc<dyn Device>,
    host_fed: &[&Arc<dyn Device>],
    opts: &LoadOptions,
) -> Result<Vec<Option<Arc<dyn HostMemory>>>, RegisteredPathError> {
    if !opts.register_host {
        return Err(RegisteredPathError::Off);
    }
    let kind = primary.info().kind;
    if let Some(d) = host_fed.iter().find(|d| d.info().kind != kind) {
        return Err(RegisteredPathError::MixedKinds {
            gpu: d.info().index,
            kind: d.info().kind,
            first: kind,
        });
    }
    let shards = source.shards();
    let mut mems: Vec<Option<Arc<dyn HostMemory>>> = vec![None; shards.len()];
    for e in map.extents.iter().filter(|e| e.len > 0) {
        let Some(slot) = mems.get_mut(e.shard) else {
            return Err(RegisteredPathError::NoShard(e.shard));
        };
        if slot.is_some() {
            continue;
        }
        let shard = &shards[e.shard];
        let Some(mem) = source.host_memory(e.shard) else {
            return Err(RegisteredPathError::NotMapped(shard.path.clone()));
        };
        let mapped = mem.as_bytes().len() as u64;
        if mapped < shard.size {
            return Err(RegisteredPathError::ShortMapping {
                path: shard.path.clone(),
                mapped,
                size: shard.size,
            });
        }
        *slot = Some(mem);
    }
    Ok(mems)
}

/// A registration segment's state.
enum SegState {
    /// Not registered yet.
    Pending,
    /// Registered.
    Ready(Arc<dyn HostRegistration>),
    /// Registering it failed: its pieces go through staging.
    Failed(RegisteredPathError),
}

/// The registration segments of one load (shard, index of the segment in it),
/// in the order the pieces first use them, registered ahead of the copies by the pinner
/// threads. The registrations live until the table is dropped at the end of the load (every
/// copy's completion also holds its registration until the copy is done).
struct Segments {
    /// Segment size, bytes.
    size: u64,
    /// The shards' paths, for messages.
    paths: Vec<String>,
    order: Vec<(usize, u64)>,
    position: std::collections::HashMap<(usize, u64), usize>,
    states: Mutex<Vec<SegState>>,
    registered: std::sync::Condvar,
    /// The next position in `order` for a pinner to take.
    next: AtomicUsize,
    /// Nanoseconds spent registering (all pinners).
    register_ns: AtomicU64,
    /// Segments found registered already (kept by the cache).
    reused: AtomicUsize,
    /// The furthest position a filler asked for.
    frontier: AtomicUsize,
}

impl Segments {
    fn new(work: &[Piece], size: u64, shards: &[SourceShard]) -> Self {
        let mut order = Vec::new();
        let mut position = std::collections::HashMap::new();
        for p in work {
            let key = (p.shard, p.offset / size);
            position.entry(key).or_insert_with(|| {
                order.push(key);
                order.len() - 1
            });
        }
        let states = order.iter().map(|_| SegState::Pending).collect();
        Self {
            size,
            paths: shards.iter().map(|s| s.path.clone()).collect(),
            order,
            position,
            states: Mutex::new(states),
            registered: std::sync::Condvar::new(),
            next: AtomicUsize::new(0),
            register_ns: AtomicU64::new(0),
            reused: AtomicUsize::new(0),
            frontier: AtomicUsize::new(0),
        }
    }

    /// `Ok` when `cache` holds every segment registered already, else the first shard
    /// with one it lacks.
    fn all_kept(
        &self,
        mems: &[Option<Arc<dyn HostMemory>>],
        cache: Option<&RegistrationCache>,
    ) -> Result<(), RegisteredPathError> {
        for &(shard, seg) in &self.order {
            let kept = (|| {
                let mem = mems.get(shard)?.as_ref()?;
                let (s, n) = segment_span(mem.as_bytes().len() as u64, seg, self.size)?;
                Some(cache?.holds(mem, s, n))
            })();
            if kept != Some(true) {
                let path = self.paths.get(shard).map_or("?", String::as_str);
                return Err(RegisteredPathError::Fresh(path.to_string()));
            }
        }
        Ok(())
    }

    /// Registers segment `pos` with `device` (or takes it from `cache`) and records the
    /// outcome.
    fn register(
        &self,
        pos: usize,
        mems: &[Option<Arc<dyn HostMemory>>],
        device: &dyn Device,
        cache: Option<&RegistrationCache>,
    ) {
        let Some(&(shard, seg)) = self.order.get(pos) else {
            return;
        };
        let t = Instant::now();
        let state = (|| {
            let mem = mems
                .get(shard)
                .and_then(Option::clone)
                .ok_or(RegisteredPathError::NoHostMemory(shard))?;
            let outside = || format!("segment {seg} of shard {shard} is outside its mapping");
            let (s, n) = segment_span(mem.as_bytes().len() as u64, seg, self.size)
                .ok_or(RegisteredPathError::Outside { seg, shard })?;
            let (start, len) = (s as u64, n as u64);
            let registered = match cache {
                Some(c) => c.get_or_register(&mem, s, n, device).map(|(r, kept)| {
                    if kept {
                        self.reused.fetch_add(1, Ordering::Relaxed);
                    }
                    r
                }),
                None => HostSlice::new(mem, s, n)
                    .ok_or_else(|| GpuError::Invalid(outside()))
                    .and_then(|slice| device.register_host(Arc::new(slice))),
            };
            registered.map_err(|e| RegisteredPathError::Register {
                path: self
                    .paths
                    .get(shard)
                    .map_or("?", String::as_str)
                    .to_string(),
                start,
                end: start + len,
                error: Arc::new(e),
            })
        })();
        add_ns(&self.register_ns, t.elapsed());
        let state = match state {
            Ok(r) => SegState::Ready(r),
            Err(why) => SegState::Failed(why),
        };
        if let Some(s) = self
            .states
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(pos)
        {
            *s = state;
        }
        self.registered.notify_all();
    }

    /// Registers segments in order until none is left or `stop` is set.
    fn pin_ahead(
        &self,
        mems: &[Option<Arc<dyn HostMemory>>],
        device: &dyn Device,
        cache: Option<&RegistrationCache>,
        stop: &AtomicBool,
    ) {
        while !stop.load(Ordering::Relaxed) {
            let pos = self.next.fetch_add(1, Ordering::Relaxed);
            if pos >= self.order.len() {
                break;
            }
            // Not too far ahead of the copies (see `PIN_AHEAD`).
            let mut states = self.states.lock().unwrap_or_else(PoisonError::into_inner);
            while pos > self.frontier.load(Ordering::Relaxed) + PIN_AHEAD
                && !stop.load(Ordering::Relaxed)
            {
                states = self
                    .registered
                    .wait_timeout(states, Duration::from_millis(200))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            drop(states);
            self.register(pos, mems, device, cache);
        }
    }

    /// The registration of `piece`'s segment and the piece's offset in it
    /// ([`From::Registered`]), waiting while it is pending (`Ok(None)` when `stop` was set
    /// meanwhile); `Err` when registering it failed.
    fn of(&self, piece: &Piece, stop: &AtomicBool) -> Result<Option<From>, RegisteredPathError> {
        let seg = piece.offset / self.size;
        let Some(&pos) = self.position.get(&(piece.shard, seg)) else {
            return Err(RegisteredPathError::NoSegment(piece.shard));
        };
        let mut states = self.states.lock().unwrap_or_else(PoisonError::into_inner);
        if self.frontier.fetch_max(pos, Ordering::Relaxed) < pos {
            // The pinners may go further now.
            self.registered.notify_all();
        }
        loop {
            match states.get(pos) {
                Some(SegState::Ready(r)) => {
                    let off = piece.offset - seg * self.size;
                    return Ok(Some(From::Registered(r.clone(), off)));
                }
                Some(SegState::Failed(why)) => return Err(why.clone()),
                Some(SegState::Pending) if !stop.load(Ordering::Relaxed) => {
                    states = self
                        .registered
                        .wait_timeout(states, Duration::from_millis(200))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                _ => return Ok(None),
            }
        }
    }
}

fn add_ns(counter: &AtomicU64, d: Duration) {
    counter.fetch_add(
        u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
        Ordering::Relaxed,
    );
}

/// Loads the model into every target, streaming chunks as `source` verifies them. The first
/// target is fed over PCIe; the others by peer copies from it where a peer path exists,
/// else from the host. Blocks until done; run it on its own thread.
pub fn load(
    source: &dyn ChunkSource,
    layout: &Layout,
    targets: &[Target],
    opts: &LoadOptions,
    progress: &LoadProgress,
) -> Result<LoadReport, LoadError> {
    load_map(
        source,
        layout,
        &LoadMap::full(layout),
        targets,
        opts,
        progress,
    )
}

/// Loads what `map` says (a whole model, or a partition first and, with completion, the
/// rest), in its order, into every target. `progress` should be made with
/// [`LoadProgress::with_first`]`(map.bytes, map.first_bytes, …)` so the partition's
/// milestone is seen.
pub fn load_map(
    source: &dyn ChunkSource,
    layout: &Layout,
    map: &LoadMap,
    targets: &[Target],
    opts: &LoadOptions,
    progress: &LoadProgress,
) -> Result<LoadReport, LoadError> {
    let Some(primary) = targets.first() else {
        return Err(LoadError::Invalid("no target GPU".into()));
    };
    if opts.register_segment == 0 || opts.register_segment % PAGE != 0 {
        return Err(LoadError::Invalid(format!(
            "register_segment must be a positive multiple of {PAGE}, got {}",
            opts.register_segment
        )));
    }
    if opts.staging_buffers == 0 || opts.staging_size == 0 {
        return Err(LoadError::Invalid(
            "the staging ring needs buffers of some size".into(),
        ));
    }
    for t in targets {
        if t.span.len < map.region {
            return Err(LoadError::Invalid(format!(
                "GPU {}: region of {} bytes for a load of {}",
                t.device.info().index,
                t.span.len,
                map.region
            )));
        }
    }
    let pidx = primary.device.info().index;
    let (peer_sibs, host_sibs): (Vec<usize>, Vec<usize>) = (1..targets.len()).partition(|&i| {
        let d = targets[i].device.info();
        d.peers.iter().any(|(p, _)| *p == pidx) && d.kind == primary.device.info().kind
    });
    let cache = opts.registrations.as_deref();
    if let Some(c) = cache {
        let released = c.sweep();
        if released > 0 {
            tracing::debug!(
                bytes = released,
                "unregistered host memory its owner dropped"
            );
        }
    }
    let host_fed: Vec<&Arc<dyn Device>> = host_sibs.iter().map(|&i| &targets[i].device).collect();
    let mems = host_memories(source, map, &primary.device, &host_fed, opts);
    // Pieces: on the staging path a staging buffer each (the calibrated elbow); on the
    // registered path at least that and at least `copy_size` (a piece coalesces the
    // verified chunks under it into one copy), never crossing a registration segment.
    let staging_work = |cut| pieces(layout, map, source.shards(), opts.staging_size as u64, cut);
    let direct_piece = opts.copy_size.max(opts.staging_size);
    let direct_work = match &mems {
        Ok(_) => Some(pieces(
            layout,
            map,
            source.shards(),
            direct_piece as u64,
            Some(opts.register_segment),
        )?),
        Err(_) => None,
    };
    let total: u64 = map.bytes;
    let t0 = Instant::now();

    // The first segment decides the path: registered when it registers (the pinners then
    // register the others ahead of the copies), else the staging ring for the whole load.
    let direct = mems.and_then(|mems| {
        let work = direct_work.as_deref().unwrap_or_default();
        let segs = Segments::new(work, opts.register_segment, source.shards());
        if opts.fresh == FreshMappings::Stage {
            segs.all_kept(&mems, cache)?;
        }
        if !segs.order.is_empty() {
            segs.next.store(1, Ordering::Relaxed);
            segs.register(0, &mems, &*primary.device, cache);
            let states = segs.states.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(SegState::Failed(why)) = states.first() {
                return Err(why.clone());
            }
        }
        Ok((mems, segs))
    });
    let (direct, fallback_reason) = match direct {
        Ok(d) => (Some(d), None),
        Err(why) => (None, Some(why)),
    };
    let (work, piece_size) = match (&direct, direct_work) {
        (Some(_), Some(w)) => (w, direct_piece),
        _ => (staging_work(None)?, opts.staging_size),
    };
    let copy_streams = if direct.is_some() {
        opts.copy_streams.clamp(1, MAX_COPY_STREAMS)
    } else {
        1
    };
    match (&fallback_reason, &direct) {
        (None, Some((_, segs))) => tracing::info!(
            device = primary.device.info().index,
            segments = segs.order.len(),
            first_segment_s = segs.register_ns.load(Ordering::Relaxed) as f64 / 1e9,
            copy_streams,
            "host → GPU path: registered (copies straight from the mapped shards)"
        ),
        (Some(why), _) if !opts.register_host || matches!(why, RegisteredPathError::Fresh(_)) => {
            tracing::info!(reason = %why, "host → GPU path: staging")
        }
        (Some(why), _) => tracing::warn!(
            reason = %why,
            "host → GPU path: staging (registering the shards' memory failed or is impossible)"
        ),
        (None, None) => {}
    }
    // The ring: staging buffers, or on the registered path empty slots bounding the copies
    // in flight (enough to keep every stream busy).
    let slots = match direct {
        Some(_) => opts.staging_buffers.max(4 * copy_streams),
        None => opts.staging_buffers,
    };
    // The fillers run, and the staging buffers are allocated (their pages first touched),
    // on the first GPU's NUMA node's CPUs.
    let (near, ring_pin, numa_reason) = match crate::numa::Near::of(primary.device.info().numa_node)
        .and_then(|n| n.pin().map(|pinned| (n, pinned)))
    {
        Ok((n, pinned)) => (Some(n), Some(pinned), None),
        Err(why) => (None, None, Some(why.to_string())),
    };
    let (free_tx, free_rx) = mpsc::sync_channel::<Option<Box<dyn Staging>>>(slots);
    for _ in 0..slots {
        let b = match direct {
            Some(_) => None,
            None => Some(primary.device.alloc_staging(opts.staging_size)?),
        };
        let _ = free_tx.send(b);
    }
    drop(ring_pin);
    let free_rx = Mutex::new(free_rx);
    let failed: Mutex<Option<LoadError>> = Mutex::new(None);
    let fail = |e: LoadError| {
        let mut f = failed.lock().unwrap_or_else(PoisonError::into_inner);
        if f.is_none() {
            *f = Some(e);
        }
        progress.cancel.store(true, Ordering::Relaxed);
    };
    let primary_done: Mutex<Option<f64>> = Mutex::new(None);
    // Nanoseconds the fillers spent waiting for verified chunks / for a free staging buffer.
    let waited_data_ns = AtomicU64::new(0);
    let waited_staging_ns = AtomicU64::new(0);
    let next_piece = AtomicUsize::new(0);
    let fillers = opts.fill_threads.clamp(1, slots);
    // On the registered path: time the fillers waited for a segment's registration, bytes
    // that went through a filler's own staging buffer because their segment failed to
    // register, and the first such failure.
    let waited_register_ns = AtomicU64::new(0);
    let staged_bytes = AtomicU64::new(0);
    let partial: Mutex<Option<RegisteredPathError>> = Mutex::new(None);
    let segs = direct.as_ref().map(|(_, s)| s);

    std::thread::scope(|scope| {
        // Pinners: register the remaining segments ahead of the copies.
        if let Some((mems, segs)) = &direct {
            for _ in 0..PINNERS {
                scope.spawn(|| segs.pin_ahead(mems, &*primary.device, cache, &progress.cancel));
            }
        }
        let (staged_tx, staged_rx) = mpsc::sync_channel::<Staged>(slots);
        let (peer_tx, peer_rx) = mpsc::sync_channel::<(u64, usize, Box<dyn Completion>)>(slots * 4);

        // Completer: takes the pieces in order (fillers finish them out of order), waits
        // their copies, recycles the buffers, fans out over peers.
        let completer = {
            let (free_tx, peer_sibs, fail, primary_done) =
                (free_tx.clone(), &peer_sibs, &fail, &primary_done);
            let host_sibs = &host_sibs;
            scope.spawn(move || {
                let mut landed = 0u64;
                let mut waiting: std::collections::BTreeMap<usize, Staged> = Default::default();
                let mut next = 0usize;
                while let Ok(staged) = staged_rx.recv() {
                    waiting.insert(staged.0, staged);
                    while let Some((_, piece, buf, completions)) = waiting.remove(&next) {
                        next += 1;
                        for c in completions {
                            if let Err(e) = c.wait() {
                                fail(e.into());
                                return;
                            }
                        }
                        let _ = free_tx.send(buf);
                        progress.add(0, piece.len);
                        for &h in host_sibs {
                            progress.add(h, piece.len);
                        }
                        landed += piece.len;
                        if landed == total {
                            *primary_done.lock().unwrap_or_else(PoisonError::into_inner) =
                                Some(t0.elapsed().as_secs_f64());
                        }
                        let at = piece.dest;
                        for &s in peer_sibs {
                            let r = (|| {
                                let dst = targets[s].span.sub(at, piece.len)?;
                                let src = primary.span.sub(at, piece.len)?;
                                targets[s].device.copy_peer(dst, &*primary.device, src)
                            })();
                            match r {
                                Ok(c) => {
                                    if peer_tx.send((piece.len, s, c)).is_err() {
                                        return;
                                    }
                                }
                                Err(e) => {
                                    fail(e.into());
                                    return;
                                }
                            }
                        }
                    }
                }
            })
        };
        // Peer waiter.
        let waiter = {
            let fail = &fail;
            scope.spawn(move || {
                while let Ok((len, slot, c)) = peer_rx.recv() {
                    if let Err(e) = c.wait() {
                        fail(e.into());
                        return;
                    }
                    progress.add(slot, len);
                }
            })
        };

        // Fillers: each takes a free slot, then the next piece (so the piece the completer
        // waits for always has a slot), waits for its chunks, copies them into the slot's
        // staging buffer and issues the host → GPU copies, or on the registered path issues
        // the copies straight from the mapping, on the streams in turn. Several run at once
        // so the copy into pinned memory (one CPU core's memcpy) does not cap the PCIe rate.
        let filler = || {
            let staged_tx = staged_tx.clone();
            let (free_rx, next_piece, work, fail) = (&free_rx, &next_piece, &work, &fail);
            let (waited_data_ns, waited_staging_ns, host_sibs) =
                (&waited_data_ns, &waited_staging_ns, &host_sibs);
            let (waited_register_ns, staged_bytes, partial) =
                (&waited_register_ns, &staged_bytes, &partial);
            let near = &near;
            move || {
                // On the GPU's node for the whole load (the fill's CPU copies, and the pages
                // of a staging buffer of its own); the thread ends with the load.
                let _pinned = near.as_ref().and_then(|n| n.pin().ok());
                // A staging buffer of this filler's own, made only when a segment failed to
                // register.
                let mut own: Option<Box<dyn Staging>> = None;
                loop {
                    if progress.cancel.load(Ordering::Relaxed) {
                        break;
                    }
                    let w = Instant::now();
                    let buf = loop {
                        let got = free_rx
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .recv_timeout(Duration::from_millis(200));
                        match got {
                            Ok(b) => break Some(b),
                            Err(mpsc::RecvTimeoutError::Timeout) => {
                                if progress.cancel.load(Ordering::Relaxed) {
                                    break None;
                                }
                            }
                            Err(mpsc::RecvTimeoutError::Disconnected) => break None,
                        }
                    };
                    add_ns(waited_staging_ns, w.elapsed());
                    let Some(mut b) = buf else { break };
                    let seq = next_piece.fetch_add(1, Ordering::Relaxed);
                    let Some(piece) = work.get(seq) else { break };
                    let shard = &source.shards()[piece.shard];
                    let cs = u64::from(shard.chunk_size.max(1));
                    let first = (piece.offset / cs) as u32;
                    let last = ((piece.offset + piece.len - 1) / cs) as u32;
                    let w = Instant::now();
                    let deadline = w + opts.chunk_timeout;
                    let mut ok = false;
                    while Instant::now() < deadline && !progress.cancel.load(Ordering::Relaxed) {
                        match source.wait_verified(
                            piece.shard,
                            first,
                            last,
                            Duration::from_millis(200),
                        ) {
                            Ok(true) => {
                                ok = true;
                                break;
                            }
                            Ok(false) => {}
                            Err(why) => {
                                fail(LoadError::Source {
                                    shard: shard.path.clone(),
                                    first,
                                    last,
                                    why,
                                });
                                break;
                            }
                        }
                    }
                    add_ns(waited_data_ns, w.elapsed());
                    if !ok {
                        if !progress.cancel.load(Ordering::Relaxed) {
                            fail(LoadError::Source {
                                shard: shard.path.clone(),
                                first,
                                last,
                                why: SourceError::Timeout(opts.chunk_timeout),
                            });
                        }
                        break;
                    }
                    let n = piece.len as usize;
                    // Where the piece's bytes come from.
                    let from = match (&b, segs) {
                        (Some(_), _) => From::Ring,
                        (None, Some(segs)) => {
                            let w = Instant::now();
                            let r = segs.of(piece, &progress.cancel);
                            add_ns(waited_register_ns, w.elapsed());
                            match r {
                                Ok(Some(from)) => from,
                                Ok(None) => break,
                                Err(why) => {
                                    partial
                                        .lock()
                                        .unwrap_or_else(PoisonError::into_inner)
                                        .get_or_insert(why);
                                    From::Own
                                }
                            }
                        }
                        (None, None) => {
                            fail(LoadError::Invalid(
                                "a slot without a staging buffer on the staging path".into(),
                            ));
                            break;
                        }
                    };
                    if matches!(from, From::Own) && own.is_none() {
                        match primary.device.alloc_staging(piece_size) {
                            Ok(o) => own = Some(o),
                            Err(e) => {
                                fail(e.into());
                                break;
                            }
                        }
                    }
                    let filled = match (&from, &mut b, &mut own) {
                        (From::Registered(..), _, _) => {
                            source.check_direct(piece.shard, piece.offset, piece.len)
                        }
                        (From::Ring, Some(b), _) | (From::Own, _, Some(b)) => {
                            source.read(piece.shard, piece.offset, &mut b.as_mut_slice()[..n])
                        }
                        _ => Err(std::io::Error::other("no buffer for the piece")),
                    };
                    if let Err(e) = filled {
                        fail(LoadError::Io {
                            shard: shard.path.clone(),
                            source: e,
                        });
                        break;
                    }
                    let at = piece.dest;
                    let mut completions = Vec::with_capacity(1 + host_sibs.len());
                    let issued = (|| {
                        for &t in std::iter::once(&0).chain(host_sibs.iter()) {
                            let dst = targets[t].span.sub(at, piece.len)?;
                            let dev = &targets[t].device;
                            let c = match (&from, &b, &own) {
                                (From::Registered(reg, off), _, _) => {
                                    dev.copy_htod_registered(dst, reg, *off, seq % copy_streams)?
                                }
                                (From::Ring, Some(b), _) => dev.copy_htod(dst, &**b)?,
                                (From::Own, _, Some(o)) => {
                                    // The filler's own buffer is refilled for its next piece:
                                    // wait for the copy here.
                                    dev.copy_htod(dst, &**o)?.wait()?;
                                    continue;
                                }
                                _ => {
                                    return Err(GpuError::Invalid(
                                        "no buffer for the piece".into(),
                                    ));
                                }
                            };
                            completions.push(c);
                        }
                        Ok::<_, GpuError>(())
                    })();
                    if matches!(from, From::Own) && issued.is_ok() {
                        staged_bytes.fetch_add(piece.len, Ordering::Relaxed);
                    }
                    if let Err(e) = issued {
                        // Wait what was issued before the buffer goes away.
                        for c in completions {
                            let _ = c.wait();
                        }
                        fail(e.into());
                        break;
                    }
                    let piece = *piece;
                    if staged_tx.send((seq, piece, b, completions)).is_err() {
                        break;
                    }
                }
            }
        };
        let handles: Vec<_> = (0..fillers).map(|_| scope.spawn(filler())).collect();
        drop(staged_tx);
        for h in handles {
            let _ = h.join();
        }
        let _ = completer.join();
        let _ = waiter.join();
    });

    if let Some(e) = failed.into_inner().unwrap_or_else(PoisonError::into_inner) {
        return Err(e);
    }
    if progress.cancel.load(Ordering::Relaxed) {
        return Err(LoadError::Cancelled);
    }
    let elapsed_s = t0.elapsed().as_secs_f64();
    let fallback_reason = match partial.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(why) => {
            let staged = staged_bytes.load(Ordering::Relaxed);
            tracing::warn!(reason = %why, staged, "some segments failed to register: their bytes went through staging");
            Some(format!("{why} ({staged} bytes went through staging)"))
        }
        None => fallback_reason.map(|why| why.to_string()),
    };
    Ok(LoadReport {
        bytes: total,
        elapsed_s,
        primary_s: primary_done
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .unwrap_or(elapsed_s),
        first_bytes: map.first_bytes,
        first_s: progress
            .first_done_since(t0)
            .map_or(elapsed_s, |s| s.min(elapsed_s)),
        waited_for_data_s: waited_data_ns.load(Ordering::Relaxed) as f64 / 1e9,
        waited_for_staging_s: waited_staging_ns.load(Ordering::Relaxed) as f64 / 1e9,
        peer_siblings: peer_sibs.len(),
        host_siblings: host_sibs.len(),
        host_path: if direct.is_some() {
            HostPath::Registered
        } else {
            HostPath::Staging
        },
        fallback_reason,
        register_s: segs.map_or(0.0, |s| s.register_ns.load(Ordering::Relaxed) as f64 / 1e9),
        waited_for_register_s: waited_register_ns.load(Ordering::Relaxed) as f64 / 1e9,
        registrations_reused: segs.map_or(0, |s| s.reused.load(Ordering::Relaxed)),
        registrations: segs.map_or(0, |s| s.order.len()),
        staged_bytes: match direct {
            Some(_) => staged_bytes.load(Ordering::Relaxed),
            None => total,
        },
        copy_streams,
        numa_node: near.map(|n| n.node),
        numa_reason,
    })
}

/// Where a piece's bytes are copied from.
enum From {
    /// A staging buffer of the ring.
    Ring,
    /// A registration, at this offset in it.
    Registered(Arc<dyn HostRegistration>, u64),
    /// The filler's own staging buffer (its segment failed to register).
    Own,
}
