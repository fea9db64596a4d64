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
pub(super) struct WritableMap(MmapRaw);

impl WritableMap {
    /// Maps the first `len` bytes of `file` (opened read-write, at least that long).
    pub(super) fn new(file: &File, len: u64) -> io::Result<Self> {
        let len = usize::try_from(len).map_err(|_| io::Error::other("shard too large to map"))?;
        MmapOptions::new().len(len).map_raw(file).map(Self)
    }

    /// Copies `data` to byte `offset` of the file. The pages are allocated first with
    /// `MADV_POPULATE_WRITE`, which fails with an error where a plain store would raise
    /// `SIGBUS` (a full tmpfs); that error is returned as "no space", so a full memory tier
    /// refuses the chunk as `pwrite` would, and the process lives.
    ///
    /// The caller must own the byte range: one chunk being written by one writer, which no
    /// reader is handed while it is unverified (the store's claim).
    pub(super) fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let end = start.checked_add(data.len()).filter(|&e| e <= self.0.len());
        let Some(_) = end else {
            return Err(io::Error::other(format!(
                "write of {} bytes at {offset} lies outside the {}-byte file",
                data.len(),
                self.0.len()
            )));
        };
        if data.is_empty() {
            return Ok(());
        }
        populate(&self.0, start, data.len())?;
        // SAFETY: `start..start + data.len()` lies inside the map (checked above), whose
        // pages were just allocated (populated), so the stores cannot fault. The store gives
        // each chunk's range to one writer at a time (its claim), and no `Bytes` view or GPU
        // registration reads a chunk's range before the chunk is marked verified, which
        // happens after this copy returns; `data` is a separate allocation (a received
        // buffer), so the two ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.0.as_mut_ptr().add(start),
                data.len(),
            );
        }
        Ok(())
    }
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
