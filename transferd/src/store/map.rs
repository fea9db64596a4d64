//! Read-only memory maps of shard data files, and zero-copy [`Bytes`] views into them.

#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use memmap2::{Mmap, MmapOptions, MmapRaw};

/// A shared read-only map of a whole shard data file.
#[derive(Clone)]
pub(super) struct ShardMap(Arc<Mmap>);

impl ShardMap {
    /// Maps the first `len` bytes of `file` (which must already be at least that long).
    pub(super) fn new(file: &File, len: u64) -> io::Result<Self> {
        let len = usize::try_from(len).map_err(|_| io::Error::other("shard too large to map"))?;
        // SAFETY: memmap2 requires that the mapped file is not truncated or modified in
        // ways that break Rust's aliasing rules while the map is alive. The store owns its
        // data files: it sizes them with `set_len` before mapping and never shrinks them, and
        // `Shard::read` only hands out ranges of chunks already verified, which the store
        // does not write again while they stay verified (writes of a verified chunk are
        // refused, and a concurrent duplicate write is serialised by the shard's in-flight
        // set). The one rewrite is a repair: a chunk that failed re-verification is dropped
        // first, so its bytes had already changed behind the store's back, and a view of
        // it handed out earlier may see the repaired bytes; the map is only ever read as
        // plain bytes (no value with validity invariants lives in it), and every peer
        // re-verifies what it receives. Other processes are expected only to read these
        // files (inference mmaps them read-only; modes 0600/0640 keep other users out); a
        // process that truncates them behind our back is outside the store's contract.
        let map = unsafe { MmapOptions::new().len(len).map(file)? };
        Ok(Self(Arc::new(map)))
    }

    /// The map itself, shared (for a GPU to register and copy verified chunks from).
    pub(super) fn shared(&self) -> Arc<Mmap> {
        self.0.clone()
    }

    /// The bytes in `range`, or `None` if it lies outside the map.
    pub(super) fn slice(&self, range: Range<usize>) -> Option<&[u8]> {
        self.0.get(range)
    }

    /// A zero-copy [`Bytes`] of `range` that keeps the map alive; `None` if out of bounds.
    pub(super) fn bytes(&self, range: Range<usize>) -> Option<Bytes> {
        self.0.get(range.clone())?;
        Some(Bytes::from_owner(MappedRange {
            map: self.0.clone(),
            range,
        }))
    }
}

/// Owner of a [`Bytes`] view: a bounds-checked range of a shared map.
struct MappedRange {
    map: Arc<Mmap>,
    range: Range<usize>,
}

impl AsRef<[u8]> for MappedRange {
    fn as_ref(&self) -> &[u8] {
        // The range was checked against the map's length on construction.
        self.map.get(self.range.clone()).unwrap_or_default()
    }
}

/// A shared writable map of a whole shard data file, for the `mapped` writer: verified
/// chunks are copied into it from several blocking-pool threads at once, where `pwrite`s to
/// one tmpfs file queue on its inode lock (one core's copy rate per shard).
///
/// A map made of a spare of the memory reserve ([`WritableMap::premapped`]) comes with its
/// pages allocated and its page tables filled while the host was idle, so a copy into it is
/// a `memcpy` and nothing else: cheaper than the `pwrite` of a chunk into pages the file
/// already holds (0.21 against 0.27–0.31 CPU-s/GB with the receive on the 2-core VM,
/// `recv_into_map`'s `buffer+premapped` and `buffer+pwrite`; docs/BENCHMARKS.md).
pub(super) struct WritableMap {
    map: MmapRaw,
    /// Bytes of the file this map writes (a spare's map may be longer than its shard).
    len: usize,
    /// Bytes from the start whose pages are allocated and mapped writable already.
    populated: usize,
}

impl WritableMap {
    /// Maps the first `len` bytes of `file` (opened read-write, at least that long).
    pub(super) fn new(file: &File, len: u64) -> io::Result<Self> {
        let map = map_whole(file, len)?;
        Ok(Self {
            len: map.len(),
            map,
            populated: 0,
        })
    }

    /// The map of a spare that became a shard's file of `len` bytes: `map` was populated
    /// whole when the spare was filled. `None` if it covers less than `len` bytes.
    pub(super) fn premapped(map: PopulatedMap, len: u64) -> Option<Self> {
        let len = usize::try_from(len).ok()?;
        (map.0.len() >= len).then_some(Self {
            map: map.0,
            len,
            populated: len,
        })
    }

    /// Whether `len` bytes at `offset` lie where the pages were populated before: a copy
    /// there costs no page-table work.
    pub(super) fn populated(&self, offset: u64, len: usize) -> bool {
        usize::try_from(offset)
            .ok()
            .and_then(|start| start.checked_add(len))
            .is_some_and(|end| end <= self.populated)
    }

    /// Copies `data` to byte `offset` of the file. Pages not populated before are allocated
    /// first with `MADV_POPULATE_WRITE`, which fails with an error where a plain store would
    /// raise `SIGBUS` (a full tmpfs); that error is returned as "no space", so a full memory
    /// tier refuses the chunk as `pwrite` would, and the process lives.
    ///
    /// The caller must own the byte range: one chunk being written by one writer, which no
    /// reader is handed while it is unverified (the store's claim).
    pub(super) fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let end = start.checked_add(data.len()).filter(|&e| e <= self.len);
        let Some(end) = end else {
            return Err(io::Error::other(format!(
                "write of {} bytes at {offset} lies outside the {}-byte file",
                data.len(),
                self.len
            )));
        };
        if data.is_empty() {
            return Ok(());
        }
        if end > self.populated {
            populate(&self.map, start, data.len())?;
        }
        // SAFETY: `start..end` lies inside the map and within the file's length (checked
        // above; the store never shrinks a shard's file), and its pages are allocated and
        // mapped: just now by `populate`, or, below `populated`, by `populate` over the whole
        // spare while it was filled (a tmpfs page stays allocated until the file is cut,
        // which the store does only before the shard's first write), so the stores cannot
        // fault fatally. The store gives each chunk's range to one writer at a time (its
        // claim), and no `Bytes` view or GPU registration reads a chunk's range before the
        // chunk is marked verified, which happens after this copy returns; `data` is a
        // separate allocation (a received buffer), so the two ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.as_mut_ptr().add(start),
                data.len(),
            );
        }
        Ok(())
    }
}

/// A writable shared map of a whole spare file, every page of it allocated and mapped
/// ([`Populating`]): what a spare of the memory reserve hands to the shard that takes it.
#[derive(Debug)]
pub(super) struct PopulatedMap(MmapRaw);

/// A spare's map while the filler populates it, a step at a time.
#[derive(Debug)]
pub(super) struct Populating {
    map: MmapRaw,
    done: usize,
}

impl Populating {
    /// Maps the first `len` bytes of `file` (opened read-write and already `len` bytes long),
    /// nothing populated yet.
    pub(super) fn new(file: &File, len: u64) -> io::Result<Self> {
        Ok(Self {
            map: map_whole(file, len)?,
            done: 0,
        })
    }

    /// Allocates and maps the next `len` bytes' pages (every page touched: the kernel zeroes
    /// each one it allocates). Errors as [`WritableMap::write`]'s: "no space" where the
    /// tier is full.
    pub(super) fn step(&mut self, len: u64) -> io::Result<()> {
        let len = usize::try_from(len).map_err(|_| io::Error::other("step too large"))?;
        let end = self
            .done
            .checked_add(len)
            .filter(|&e| e <= self.map.len())
            .ok_or_else(|| io::Error::other("populating past the end of the spare"))?;
        if len > 0 {
            populate(&self.map, self.done, len)?;
        }
        self.done = end;
        Ok(())
    }

    /// Bytes not populated yet.
    pub(super) fn left(&self) -> u64 {
        (self.map.len() - self.done) as u64
    }

    /// The map, once every page is populated.
    pub(super) fn finish(self) -> Option<PopulatedMap> {
        (self.done == self.map.len()).then_some(PopulatedMap(self.map))
    }
}

/// A writable shared map of the first `len` bytes of `file` (opened read-write, at least
/// that long), nothing populated.
fn map_whole(file: &File, len: u64) -> io::Result<MmapRaw> {
    let len = usize::try_from(len).map_err(|_| io::Error::other("file too large to map"))?;
    MmapOptions::new().len(len).map_raw(file)
}

/// `MADV_POPULATE_WRITE` over `len` bytes at `start` of `map`: allocates (and maps
/// writable) every page of the range, or fails where a store would fault fatally.
fn populate(map: &MmapRaw, start: usize, len: usize) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        map.advise_range(memmap2::Advice::PopulateWrite, start, len)
            .map_err(|e| match e.raw_os_error() {
                // The kernel's answer for "a store here would raise SIGBUS": on a tmpfs,
                // no page could be allocated for the file (it is full).
                Some(libc::EFAULT) | Some(libc::ENOMEM) => io::Error::new(
                    io::ErrorKind::StorageFull,
                    format!(
                        "no space left on device for the chunk's pages ({e}, from MADV_POPULATE_WRITE)"
                    ),
                ),
                _ => e,
            })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (map, start, len);
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the mapped writer needs Linux's MADV_POPULATE_WRITE",
        ))
    }
}

/// Whether this kernel has `MADV_POPULATE_WRITE` (Linux 5.14+), which the mapped writer
/// needs: tried once on a small anonymous shared map.
pub(super) fn populate_supported() -> io::Result<()> {
    let map = MmapOptions::new().len(4096).map_anon()?;
    let raw = MmapRaw::from(map);
    populate(&raw, 0, 4096)
}
