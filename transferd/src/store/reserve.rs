//! The memory tier's reserve: spare files whose pages are already allocated, into which new
//! shards are written.
//!
//! On tmpfs the first write of a page allocates it, and that allocation is the largest cost
//! of a receiving hop on a 2-core VM (a chunk written over pages a file already holds costs
//! about half as much as one written into fresh pages; in the hop, with the adaptive
//! writer's concurrent map writes, the receiver spent 0.7–0.8 CPU-s/GB against 1.6–1.7:
//! docs/BENCHMARKS.md). The reserve moves that cost out of the cold start: while the host
//! is idle the daemon fills up to `bytes` of spare files, and a new memory-tier shard takes
//! one ([`Reserve::take`]): the spare is renamed to the shard's path and cut (or grown) to
//! the shard's size, so its chunks land on pages that exist.
//! * **Filled through a map:** for the writers that copy into maps (adaptive, the default,
//!   and mapped) the filler maps each new spare and allocates its pages with
//!   `MADV_POPULATE_WRITE`, which also fills the map's page tables; the shard that takes
//!   the spare keeps that map ([`Taken::map`]) and its chunks are plain copies into it
//!   where it covers them (no `pwrite`, no page-table work during the transfer: on the
//!   2-core VM an authenticate-only hop's receiver spent 0.48–0.54 CPU-s/GB against
//!   0.61–0.74, a TLS one's 0.70–0.87 against 0.79–0.88, docs/BENCHMARKS.md). The
//!   page tables cost 2 MiB per GiB of spares. Elsewhere (the `pwrite` writer, a kernel
//!   without `MADV_POPULATE_WRITE`) the filler writes zeroes. A spare kept from an earlier
//!   run gets its map once the reserve is full ([`Reserve::map_kept`]: page tables only,
//!   nothing allocated); a shard that takes it before is written as before.
//!
//! * **Where:** `<memory root>/reserve/spare-<n>`, beneath the tier root like every other
//!   store file (no symlink followed; the store's modes). A spare being filled is
//!   `spare-<n>.filling`; anything else found there at start-up (a half-filled spare, a
//!   name the store does not write, a symlink) is removed.
//! * **Sizes:** each spare is `spare` bytes (the last may be smaller); with
//!   [`SpareSize::Auto`] (the default) that is the largest shard of the last model a
//!   memory-tier shard was created for, rounded up to 2 MiB ([`Reserve::learn`]; at
//!   start-up the largest spare kept, else [`DEFAULT_SPARE`]). A shard takes the
//!   smallest spare that covers it and is at most twice its size, else the largest spare
//!   smaller than it (its tail is then allocated as it is written), else none (a shard
//!   under half a spare: an index file). Safetensors shards are mostly one size, so a
//!   `spare` of that size wastes nothing; a spare larger than the shard is cut, which frees
//!   the rest (and costs the cut: about 0.12 CPU-s per GiB freed on the 2-core VM).
//! * **Only fresh spares:** a removed shard's file is never recycled as a spare, since an
//!   inference process that mapped it may still read it: recycling would change the bytes
//!   under it. A spare is written by no one before a shard takes it, so it holds zeroes.
//! * **It gives way.** Spares are memory a shard can have: a new shard's admission counts
//!   them as free room, and after a shard is created the store drops spares (the smallest
//!   that frees enough, so the larger ones stay for the shards they fit) until the file
//!   system, the configured capacity and the host's memory (less the headroom) again cover
//!   every open shard's unwritten bytes ([`super::ShardStore::shard`]). The filler grows the
//!   reserve only within those bounds, and drops spares while the host's available memory
//!   is below the headroom (another process needs it).
//! * **When it fills:** only while no chunk has been written for a while (the daemon's
//!   filler task: `crate::daemon`), in steps of [`FILL_STEP`], so a filling reserve never
//!   competes with a transfer for long.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use std::os::unix::fs::FileExt;

use rustix::fs::FileType;

use super::beneath::{Access, TierDir};
use super::map::{PopulatedMap, Populating};
use super::{StoreError, StoreStats, io_err, lock};

/// The reserve's directory, relative to the memory tier root.
pub(super) const RESERVE_DIR: &str = "reserve";
/// Prefix of a spare's name; the rest is its number.
const SPARE_PREFIX: &str = "spare-";
/// Suffix of the spare being filled.
const FILLING_SUFFIX: &str = ".filling";
/// The most one [`Reserve::fill`] call allocates: at about 0.4 CPU-s per GiB, a step takes a
/// core some 25 ms, the longest a transfer that starts meanwhile competes with the filler.
pub const FILL_STEP: u64 = 64 << 20;

/// How much of the memory tier to keep as spare files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveConfig {
    /// Bytes of spare files to keep (0: no reserve; spares left by an earlier run are removed).
    pub bytes: u64,
    /// The size of each spare file: best the size of the shards the host receives.
    pub spare: SpareSize,
}

impl ReserveConfig {
    /// No reserve.
    pub const OFF: Self = Self {
        bytes: 0,
        spare: SpareSize::Auto,
    };
}

/// The size of each spare (`memory_reserve_spare`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpareSize {
    /// The largest shard of the last model received into the memory tier, rounded up to
    /// [`LEARNED_ROUNDING`]; [`DEFAULT_SPARE`] until one is.
    Auto,
    /// This many bytes.
    Fixed(u64),
}

/// A learned spare size is rounded up to this (a huge page's size).
pub const LEARNED_ROUNDING: u64 = 2 << 20;

impl Default for ReserveConfig {
    fn default() -> Self {
        Self::OFF
    }
}

/// The size of a spare while [`SpareSize::Auto`] has learned none.
pub const DEFAULT_SPARE: u64 = 1 << 30;

/// A spare a new shard takes: where it is (relative to the tier root), its size, and its
/// map with every page populated, where the filler made one (not yet for a spare kept from
/// an earlier run, nor where the kernel lacks `MADV_POPULATE_WRITE`).
#[derive(Debug)]
pub(super) struct Taken {
    pub(super) rel: PathBuf,
    pub(super) size: u64,
    pub(super) map: Option<PopulatedMap>,
}

/// The spares of the memory tier. See the module docs.
#[derive(Debug)]
pub(super) struct Reserve {
    dir: Arc<TierDir>,
    cfg: ReserveConfig,
    /// Whether the filler makes each spare's map (for the mapped and adaptive writers).
    premap: bool,
    stats: Arc<StoreStats>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Complete spares.
    spares: Vec<Spare>,
    /// A complete spare without a map (kept from an earlier run) whose map the filler is
    /// populating, while it is not working on it.
    mapping: Option<(u64, Populating)>,
    /// The spare being filled, while the filler is not working on it.
    filling: Option<Filling>,
    /// Bytes of the spare being filled while the filler works on it (out of `filling`).
    filling_out: u64,
    /// The next spare's number.
    next: u64,
    /// Why filling stopped for good (the file system refused a write).
    refused: Option<String>,
    /// The spare size [`SpareSize::Auto`] learned ([`Reserve::learn`]).
    learned: Option<u64>,
}

/// A complete spare.
#[derive(Debug)]
struct Spare {
    /// Its number (its name).
    n: u64,
    /// Its bytes.
    len: u64,
    map: SpareMap,
}

/// A complete spare's map.
#[derive(Debug)]
enum SpareMap {
    /// None yet (a spare kept from an earlier run, or one the filler could not map).
    Unmapped,
    /// Every page populated: handed to the shard that takes the spare.
    Populated(PopulatedMap),
    /// Making it failed: the spare is written with `pwrite`.
    Unmappable,
}

impl State {
    /// The complete spare numbered `n`, if it still is one.
    fn spare(&mut self, n: u64) -> Option<&mut Spare> {
        self.spares.iter_mut().find(|s| s.n == n)
    }

    /// Drops the half-made map of spare `n`, if the filler was making it (the spare is
    /// being taken or dropped).
    fn forget_mapping(&mut self, n: u64) {
        if self.mapping.as_ref().is_some_and(|(m, _)| *m == n) {
            self.mapping = None;
        }
    }
}

#[derive(Debug)]
struct Filling {
    n: u64,
    file: File,
    /// Bytes allocated so far.
    len: u64,
    /// Bytes it will have.
    size: u64,
    /// Its map, populated a step at a time (`None` where the kernel cannot: then zeroes
    /// are written, and the spare has no map).
    map: Option<Populating>,
}

/// Writes `len` zero bytes at `offset`: every page is allocated and touched now. (Not
/// `fallocate`: on tmpfs it allocates pages without writing them, and in a VM a page's
/// first touch is what costs, which would then fall on the transfer; measured on the 2-core
/// VM, the emulated chain was slower with spares made by `fallocate` than with none.)
fn write_zeroes(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    const BLOCK: usize = 1 << 20;
    let zeroes = vec![0u8; BLOCK];
    let mut done = 0u64;
    while done < len {
        let n = usize::try_from(len - done).map_or(BLOCK, |n| n.min(BLOCK));
        file.write_all_at(&zeroes[..n], offset + done)?;
        done += n as u64;
    }
    Ok(())
}

fn spare_rel(n: u64) -> PathBuf {
    Path::new(RESERVE_DIR).join(format!("{SPARE_PREFIX}{n}"))
}

fn filling_rel(n: u64) -> PathBuf {
    Path::new(RESERVE_DIR).join(format!("{SPARE_PREFIX}{n}{FILLING_SUFFIX}"))
}

impl Reserve {
    /// Opens the reserve of the memory tier `dir`: keeps the complete spares found (up to
    /// `cfg.bytes`, each with every byte allocated) and removes everything else in the
    /// reserve's directory.
    pub(super) fn open(
        dir: Arc<TierDir>,
        cfg: ReserveConfig,
        premap: bool,
        stats: Arc<StoreStats>,
    ) -> Result<Self, StoreError> {
        let rel = Path::new(RESERVE_DIR);
        dir.create_dir_all(rel)?;
        dir.tighten_dir(rel)?;
        let mut found = Vec::new();
        for (name, ty) in dir.list(rel)? {
            let n = name
                .to_str()
                .and_then(|s| s.strip_prefix(SPARE_PREFIX))
                .and_then(|s| s.parse::<u64>().ok())
                .filter(|_| ty == FileType::RegularFile);
            let entry = rel.join(&name);
            // A spare that cannot be opened or measured is not kept either (removed below).
            let kept = n.and_then(|n| {
                let f = dir.open_file(&entry, Access::Read).ok()?;
                let st = rustix::fs::fstat(&f).ok()?;
                let len = u64::try_from(st.st_size).unwrap_or(0);
                let blocks = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
                (len > 0 && blocks >= len).then_some((n, len))
            });
            match kept {
                Some(spare) => found.push(spare),
                None => {
                    tracing::info!(path = %dir.root().join(&entry).display(), "removing what is not a complete spare from the memory reserve");
                    dir.remove_tree(&entry)?;
                }
            }
        }
        found.sort_unstable();
        let next = found.last().map_or(0, |&(n, _)| n + 1);
        let mut held = 0u64;
        let mut spares = Vec::new();
        for (n, len) in found {
            if held.saturating_add(len) <= cfg.bytes {
                held += len;
                spares.push(Spare {
                    n,
                    len,
                    map: SpareMap::Unmapped,
                });
            } else {
                dir.remove_tree(&spare_rel(n))?;
            }
        }
        if held > 0 {
            tracing::info!(
                bytes = held,
                spares = spares.len(),
                "memory reserve: kept the spares of an earlier run"
            );
        }
        // What an earlier run learned lives on in the size of its spares.
        let learned = spares.iter().map(|s| s.len).max();
        Ok(Self {
            dir,
            cfg,
            premap,
            stats,
            state: Mutex::new(State {
                spares,
                next,
                learned,
                ..State::default()
            }),
        })
    }

    /// The configuration.
    pub(super) fn config(&self) -> ReserveConfig {
        self.cfg
    }

    /// The size the next spare gets.
    pub(super) fn spare_size(&self) -> u64 {
        Self::spare_size_in(self.cfg, &lock(&self.state))
    }

    fn spare_size_in(cfg: ReserveConfig, st: &State) -> u64 {
        match cfg.spare {
            SpareSize::Fixed(n) => n,
            SpareSize::Auto => st.learned.unwrap_or(DEFAULT_SPARE),
        }
    }

    /// With [`SpareSize::Auto`], sizes the spares filled from now on after a model whose
    /// largest shard is `largest` bytes (a memory-tier shard of it is being created). A
    /// model of small files only (under 1 MiB) teaches nothing.
    pub(super) fn learn(&self, largest: u64) {
        if self.cfg.spare != SpareSize::Auto || largest < (1 << 20) {
            return;
        }
        let size = largest.div_ceil(LEARNED_ROUNDING) * LEARNED_ROUNDING;
        let mut st = lock(&self.state);
        if st.learned != Some(size) {
            if self.cfg.bytes > 0 {
                tracing::info!(
                    spare = size,
                    "memory reserve: new spares sized like the largest shard received"
                );
            }
            st.learned = Some(size);
        }
    }

    /// Bytes the reserve holds: complete spares and the one being filled.
    pub(super) fn held(&self) -> u64 {
        let st = lock(&self.state);
        Self::held_in(&st)
    }

    fn held_in(st: &State) -> u64 {
        let complete: u64 = st.spares.iter().map(|s| s.len).sum();
        complete + st.filling.as_ref().map_or(st.filling_out, |f| f.len)
    }

    /// Bytes of complete spares with a populated map.
    pub(super) fn mapped(&self) -> u64 {
        let st = lock(&self.state);
        st.spares
            .iter()
            .filter(|s| matches!(s.map, SpareMap::Populated(_)))
            .map(|s| s.len)
            .sum()
    }

    /// Why the reserve stopped filling for good, if it did.
    pub(super) fn refused(&self) -> Option<String> {
        lock(&self.state).refused.clone()
    }

    /// Takes the spare a new shard of `size` bytes is written into: the smallest that covers
    /// it and is at most twice its size, else the largest smaller than it (which covers its
    /// start). `None` when no spare fits so: a shard under half the size of every spare
    /// (an index file, a small model) is written into fresh pages rather than free most of
    /// a spare.
    pub(super) fn take(&self, size: u64) -> Option<Taken> {
        let mut st = lock(&self.state);
        let covering = st
            .spares
            .iter()
            .enumerate()
            .filter(|(_, s)| s.len >= size && size.saturating_mul(2) >= s.len)
            .min_by_key(|(_, s)| s.len)
            .map(|(i, _)| i);
        let at = covering.or_else(|| {
            st.spares
                .iter()
                .enumerate()
                .filter(|(_, s)| s.len < size)
                .max_by_key(|(_, s)| s.len)
                .map(|(i, _)| i)
        })?;
        let spare = st.spares.swap_remove(at);
        st.forget_mapping(spare.n);
        Some(Taken {
            rel: spare_rel(spare.n),
            size: spare.len,
            map: match spare.map {
                SpareMap::Populated(map) => Some(map),
                SpareMap::Unmapped | SpareMap::Unmappable => None,
            },
        })
    }

    /// Counts a spare a shard was written into (`resident`: the bytes of the shard it
    /// covers).
    pub(super) fn note_taken(&self, resident: u64) {
        self.stats
            .reserve_spares_taken
            .fetch_add(1, Ordering::Relaxed);
        self.stats
            .reserve_bytes_taken
            .fetch_add(resident, Ordering::Relaxed);
    }

    /// Removes a spare taken for a shard that could not be created (gone already if the
    /// shard's file was made of it).
    pub(super) fn discard(&self, rel: &Path) {
        if let Err(e) = self.dir.remove_tree(rel) {
            tracing::warn!(path = %self.dir.root().join(rel).display(), "removing a spare: {e}");
        }
    }

    /// Bytes the reserve is short of its target (0 once filling stopped for good).
    pub(super) fn wanted(&self) -> u64 {
        self.wanted_in(&lock(&self.state))
    }

    fn wanted_in(&self, st: &State) -> u64 {
        if st.refused.is_some() {
            return 0;
        }
        self.cfg.bytes.saturating_sub(Self::held_in(st))
    }

    /// Allocates up to `max` more bytes of the reserve (at most [`FILL_STEP`]), in the spare
    /// being filled (started if there is none, no larger than `max`: the room the tier's
    /// bounds leave); a spare is complete, and can be taken, once it has its size. Returns
    /// the bytes allocated. Only the daemon's one filler calls it.
    pub(super) fn fill(&self, max: u64) -> Result<u64, StoreError> {
        let (mut filling, grow) = {
            let mut st = lock(&self.state);
            // With the spare being filled (if any) still counted as held.
            let wanted = self.wanted_in(&st);
            if wanted.min(max).min(FILL_STEP) == 0 {
                return Ok(0);
            }
            let filling = match st.filling.take() {
                Some(f) => f,
                None => {
                    let n = st.next;
                    st.next += 1;
                    let rel = filling_rel(n);
                    let file = self.dir.open_file(&rel, Access::ReadWriteCreate)?;
                    // No larger than the room there is now: a spare that could never be
                    // completed could never be taken.
                    let size = Self::spare_size_in(self.cfg, &st)
                        .min(wanted)
                        .min(max)
                        .max(1);
                    file.set_len(0)
                        .map_err(io_err(&self.dir.root().join(&rel)))?;
                    // The whole length at once (no page allocated by it), so the map
                    // covers it; the filler then populates it step by step.
                    file.set_len(size)
                        .map_err(io_err(&self.dir.root().join(&rel)))?;
                    let map = match self.premap.then(|| Populating::new(&file, size)) {
                        Some(Ok(m)) => Some(m),
                        Some(Err(e)) => {
                            tracing::debug!(
                                "memory reserve: a spare without a map ({e}); writing zeroes"
                            );
                            None
                        }
                        None => None,
                    };
                    Filling {
                        n,
                        file,
                        len: 0,
                        size,
                        map,
                    }
                }
            };
            // Out of the state while it is written: its bytes stay counted as held.
            st.filling_out = filling.len;
            let grow = wanted
                .min(max)
                .min(FILL_STEP)
                .min(filling.size - filling.len);
            (filling, grow)
        };
        let rel = filling_rel(filling.n);
        let r = match filling.map.as_mut().map(|m| m.step(grow)) {
            // No room or a signal fall through to a failed write's handling below (the
            // spare is given up for now); any other error means the map cannot be populated.
            Some(Err(e))
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::StorageFull | std::io::ErrorKind::Interrupted
                ) =>
            {
                // No MADV_POPULATE_WRITE, say: zeroes instead, and the spare has no map.
                tracing::debug!(
                    "memory reserve: populating a spare's map failed ({e}); writing zeroes"
                );
                filling.map = None;
                write_zeroes(&filling.file, filling.len, grow)
            }
            Some(r) => r,
            None => write_zeroes(&filling.file, filling.len, grow),
        };
        let mut st = lock(&self.state);
        st.filling_out = 0;
        match r {
            Ok(()) => {
                filling.len += grow;
                self.stats
                    .reserve_bytes_filled
                    .fetch_add(grow, Ordering::Relaxed);
            }
            Err(e) => {
                drop(st);
                let _ = self.dir.remove_tree(&rel);
                let mut st = lock(&self.state);
                let why = format!(
                    "writing a spare in {} failed: {e}",
                    self.dir.root().join(RESERVE_DIR).display()
                );
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::StorageFull | std::io::ErrorKind::Interrupted
                ) {
                    // No room now (the file system is shared): try again later.
                    tracing::info!("memory reserve: {why}; trying again later");
                } else {
                    tracing::warn!("memory reserve: {why}; the reserve stays as it is");
                    st.refused = Some(why);
                }
                return Ok(0);
            }
        }
        if filling.len >= filling.size {
            drop(st);
            self.dir.rename_file(&rel, &spare_rel(filling.n))?;
            let map = filling.map.and_then(Populating::finish);
            let mut st = lock(&self.state);
            st.spares.push(Spare {
                n: filling.n,
                len: filling.len,
                map: map.map_or(SpareMap::Unmapped, SpareMap::Populated),
            });
            if st.spares.len() == 1 || Self::held_in(&st) >= self.cfg.bytes {
                tracing::info!(
                    held = Self::held_in(&st),
                    target = self.cfg.bytes,
                    spares = st.spares.len(),
                    "memory reserve: spare filled"
                );
            }
        } else {
            st.filling = Some(filling);
        }
        Ok(grow)
    }

    /// Populates up to `max` bytes (at most [`FILL_STEP`]) of the map of a complete spare
    /// that has none (one kept from an earlier run: its pages exist, so this fills page
    /// tables only and allocates nothing); the spare has its map once all of it is done.
    /// Returns the bytes done: 0 when every spare has a map (or spares get none). Only the
    /// daemon's one filler calls it, when [`Reserve::fill`] has nothing to do.
    pub(super) fn map_kept(&self, max: u64) -> Result<u64, StoreError> {
        if !self.premap {
            return Ok(0);
        }
        let (n, mut map) = {
            let mut st = lock(&self.state);
            match st.mapping.take() {
                Some(m) => m,
                None => {
                    let unmapped = st
                        .spares
                        .iter()
                        .find(|s| matches!(s.map, SpareMap::Unmapped));
                    let Some((n, len)) = unmapped.map(|s| (s.n, s.len)) else {
                        return Ok(0);
                    };
                    // Opened under the lock: a spare is taken or dropped only under it, so
                    // the file is the spare's.
                    let opened = self.dir.open_file(&spare_rel(n), Access::ReadWriteCreate);
                    match opened
                        .map_err(|e| e.to_string())
                        .and_then(|file| Populating::new(&file, len).map_err(|e| e.to_string()))
                    {
                        Ok(map) => (n, map),
                        Err(e) => {
                            tracing::debug!("memory reserve: a kept spare without a map ({e})");
                            if let Some(s) = st.spare(n) {
                                s.map = SpareMap::Unmappable;
                            }
                            return Ok(0);
                        }
                    }
                }
            }
        };
        let step = map.left().min(max).min(FILL_STEP);
        if let Err(e) = map.step(step) {
            // Taken or dropped meanwhile (its file cut or gone), or no MADV_POPULATE_WRITE:
            // that spare stays without a map (it is written with `pwrite`).
            tracing::debug!(
                spare = n,
                "memory reserve: mapping a kept spare failed ({e})"
            );
            if let Some(s) = lock(&self.state).spare(n) {
                s.map = SpareMap::Unmappable;
            }
            return Ok(0);
        }
        let mut st = lock(&self.state);
        // Still a spare (not taken or dropped meanwhile)?
        if st.spare(n).is_some() {
            if map.left() > 0 {
                st.mapping = Some((n, map));
            } else if let (Some(done), Some(s)) = (map.finish(), st.spare(n)) {
                s.map = SpareMap::Populated(done);
            }
        }
        Ok(step)
    }

    /// Drops one spare to give back at least `need` bytes if one spare can: the one being
    /// filled first, else the smallest spare of at least `need` bytes (the larger ones stay
    /// for the shards they fit), else the largest. Returns the bytes freed, or `None` when
    /// the reserve is empty.
    pub(super) fn drop_one(&self, need: u64) -> Option<u64> {
        let mut st = lock(&self.state);
        let (rel, len) = if let Some(f) = st.filling.take() {
            (filling_rel(f.n), f.len)
        } else {
            let enough = st
                .spares
                .iter()
                .enumerate()
                .filter(|(_, s)| s.len >= need)
                .min_by_key(|(_, s)| s.len);
            let at = enough
                .or_else(|| st.spares.iter().enumerate().max_by_key(|(_, s)| s.len))
                .map(|(i, _)| i)?;
            // Its map (dropped here, with the spare) is gone before the file goes, or its
            // pages would outlive it.
            let spare = st.spares.swap_remove(at);
            st.forget_mapping(spare.n);
            (spare_rel(spare.n), spare.len)
        };
        drop(st);
        if let Err(e) = self.dir.remove_tree(&rel) {
            tracing::warn!(path = %self.dir.root().join(&rel).display(), "dropping a spare: {e}");
        }
        self.stats
            .reserve_bytes_dropped
            .fetch_add(len, Ordering::Relaxed);
        Some(len)
    }
}
