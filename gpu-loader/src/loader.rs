//! The streaming loader: verified chunks → pinned staging ring → host-to-device copies on the
//! first GPU → peer copies (NVLink) to sibling GPUs, all three overlapped with the network
//! transfer that is still delivering chunks.
//!
//! Three threads per load:
//!
//! 1. the **issuer** walks the model piece by piece (a piece is one staging buffer, the
//!    calibrated transfer size), waits until the chunks under the piece are verified, takes a
//!    free staging buffer (blocking when all are in flight: back-pressure, never unbounded
//!    memory), fills it from the store and issues the copy to the first GPU — and to
//!    siblings that have no peer path, from the same buffer;
//! 2. the **completer** waits each copy's event in issue order, returns the buffer to the
//!    ring, and issues the peer copies of that piece to the siblings with a peer path;
//! 3. the **peer waiter** waits the peer copies and counts bytes per sibling.
//!
//! Every byte crosses PCIe once when peers exist. Bytes per GPU are published in
//! [`LoadProgress`] as they land.
//!
//! # Host paths: registered or staging
//!
//! When the source's shards are mapped files ([`ChunkSource::host_memory`]: transferd's
//! memory tier is files in tmpfs, mapped), the loader first registers each mapping with the
//! first GPU ([`Device::register_host`], CUDA `cuMemHostRegister`), and the fillers issue
//! copies straight from the mapping ([`Device::copy_htod_registered`]) on
//! [`LoadOptions::copy_streams`] streams in turn: no CPU copy into staging, which caps the
//! staging path at what the fillers' memcpy sustains. A piece is still copied only once the
//! source says its chunks are verified (and after [`ChunkSource::check_direct`]), exactly as
//! on the staging path; the ring's slots then only bound the copies in flight. When
//! registration is off, impossible (a shard that is not a mapped file, a backend that cannot)
//! or refused (a driver error), the load uses the staging ring, and [`LoadReport::host_path`]
//! with [`LoadReport::fallback_reason`] says which path ran and why.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::device::{Completion, DevSpan, Device, GpuError, HostMemory, HostRegistration, Staging};
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
    ) -> Result<bool, String>;
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
        why: String,
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
    /// Why the staging ring ran instead of the registered path (`None` when registered).
    pub fallback_reason: Option<String>,
    /// Seconds spent registering (page-locking) the source's mappings before the first
    /// copy, included in `elapsed_s` (0 on the staging path, or when registration failed
    /// at once).
    pub register_s: f64,
    /// Copy streams used per GPU (1 on the staging path).
    pub copy_streams: usize,
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

fn pieces(
    layout: &Layout,
    map: &LoadMap,
    source: &[SourceShard],
    size: u64,
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
            let len = size.min(e.len - off);
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

/// Registers the mapped files of every shard `map` reads with `primary` (see the module
/// docs), or says why not: the registrations by shard (`None` for shards the load does not
/// read), or the reason to use the staging ring.
fn register(
    source: &dyn ChunkSource,
    map: &LoadMap,
    primary: &Arc<dyn Device>,
    host_fed: &[&Arc<dyn Device>],
    opts: &LoadOptions,
) -> Result<Vec<Option<Arc<dyn HostRegistration>>>, String> {
    if !opts.register_host {
        return Err("register_host is off".into());
    }
    let kind = primary.info().kind;
    if let Some(d) = host_fed.iter().find(|d| d.info().kind != kind) {
        return Err(format!(
            "GPU {} is fed from the host but is a {} device, the first GPU a {kind} one",
            d.info().index,
            d.info().kind
        ));
    }
    let shards = source.shards();
    let mut regs: Vec<Option<Arc<dyn HostRegistration>>> = vec![None; shards.len()];
    for e in &map.extents {
        let Some(slot) = regs.get_mut(e.shard) else {
            return Err(format!("no shard {}", e.shard));
        };
        if slot.is_some() {
            continue;
        }
        let shard = &shards[e.shard];
        let Some(mem) = source.host_memory(e.shard) else {
            return Err(format!("shard {} is not a mapped file", shard.path));
        };
        let mapped = mem.as_bytes().len() as u64;
        if mapped < shard.size {
            return Err(format!(
                "shard {}: its mapping has {mapped} bytes, the shard {}",
                shard.path, shard.size
            ));
        }
        *slot = Some(
            primary
                .register_host(mem)
                .map_err(|e| format!("registering shard {}: {e}", shard.path))?,
        );
    }
    Ok(regs)
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
    // Pieces are the calibrated transfer size (the elbow) on both paths: on the registered
    // path a piece coalesces the verified chunks under it into one copy.
    let work = pieces(layout, map, source.shards(), opts.staging_size as u64)?;
    let total: u64 = map.bytes;
    let t0 = Instant::now();

    let host_fed: Vec<&Arc<dyn Device>> = host_sibs.iter().map(|&i| &targets[i].device).collect();
    let registered = register(source, map, &primary.device, &host_fed, opts);
    let register_s = t0.elapsed().as_secs_f64();
    let (regs, fallback_reason) = match registered {
        Ok(r) => (Some(r), None),
        Err(why) => (None, Some(why)),
    };
    let copy_streams = if regs.is_some() {
        opts.copy_streams.clamp(1, MAX_COPY_STREAMS)
    } else {
        1
    };
    match &fallback_reason {
        None => tracing::info!(
            device = primary.device.info().index,
            register_s,
            copy_streams,
            "host → GPU path: registered (copies straight from the mapped shards)"
        ),
        Some(why) if !opts.register_host => {
            tracing::info!(reason = %why, "host → GPU path: staging")
        }
        Some(why) => tracing::warn!(
            reason = %why,
            "host → GPU path: staging (registering the shards' memory failed or is impossible)"
        ),
    }
    // The ring: staging buffers, or on the registered path empty slots bounding the copies
    // in flight (enough to keep every stream busy).
    let slots = match regs {
        Some(_) => opts.staging_buffers.max(4 * copy_streams),
        None => opts.staging_buffers,
    };
    let (free_tx, free_rx) = mpsc::sync_channel::<Option<Box<dyn Staging>>>(slots);
    for _ in 0..slots {
        let b = match regs {
            Some(_) => None,
            None => Some(primary.device.alloc_staging(opts.staging_size)?),
        };
        let _ = free_tx.send(b);
    }
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
    let regs = regs.as_deref();

    std::thread::scope(|scope| {
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
            move || {
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
                                why: format!("not verified within {:?}", opts.chunk_timeout),
                            });
                        }
                        break;
                    }
                    let n = piece.len as usize;
                    let filled = match (&mut b, regs) {
                        (Some(b), _) => {
                            source.read(piece.shard, piece.offset, &mut b.as_mut_slice()[..n])
                        }
                        (None, _) => source.check_direct(piece.shard, piece.offset, piece.len),
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
                            let c = match (&b, regs) {
                                (Some(b), _) => dev.copy_htod(dst, &**b)?,
                                (None, Some(regs)) => {
                                    let reg = regs
                                        .get(piece.shard)
                                        .and_then(Option::as_ref)
                                        .ok_or_else(|| {
                                            GpuError::Invalid(format!(
                                                "shard {} was not registered",
                                                piece.shard
                                            ))
                                        })?;
                                    dev.copy_htod_registered(
                                        dst,
                                        reg,
                                        piece.offset,
                                        seq % copy_streams,
                                    )?
                                }
                                (None, None) => {
                                    return Err(GpuError::Invalid(
                                        "a slot without a staging buffer on the staging path"
                                            .into(),
                                    ));
                                }
                            };
                            completions.push(c);
                        }
                        Ok::<_, GpuError>(())
                    })();
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
    Ok(LoadReport {
        bytes: total,
        elapsed_s,
        primary_s: primary_done
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .unwrap_or(elapsed_s),
        first_bytes: map.first_bytes,
        first_s: progress.first_done_s().unwrap_or(elapsed_s),
        waited_for_data_s: waited_data_ns.load(Ordering::Relaxed) as f64 / 1e9,
        waited_for_staging_s: waited_staging_ns.load(Ordering::Relaxed) as f64 / 1e9,
        peer_siblings: peer_sibs.len(),
        host_siblings: host_sibs.len(),
        host_path: if regs.is_some() {
            HostPath::Registered
        } else {
            HostPath::Staging
        },
        fallback_reason,
        register_s: if regs.is_some() { register_s } else { 0.0 },
        copy_streams,
    })
}
