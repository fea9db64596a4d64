//! Read-only memory maps of shard data files, and zero-copy [`Bytes`] views into them.

#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use memmap2::{Mmap, MmapOptions};

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
