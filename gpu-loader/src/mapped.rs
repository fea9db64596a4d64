//! Read-only maps of files as [`HostMemory`]: a file in the memory tier's tmpfs directory,
//! mapped so a device can register it and DMA straight from the page cache (no staging
//! copy). transferd maps its shard files itself (a `memmap2::Mmap`, which is
//! [`HostMemory`] too); [`MappedFile`] is for sources outside the store (the loader
//! benchmark's file-backed source, tests).
//!
//! Its one `unsafe` block is the `mmap`, under the same contract as transferd's
//! `store::map`: the file is not truncated while it is mapped.

// `unsafe_code` is denied workspace-wide. Mapping a file is `unsafe` in memmap2 (the file
// could change under the map); this module is the loader's one place outside `cuda` that
// needs it, with the same contract as transferd's `store::map`.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::{Mmap, MmapOptions};

use crate::device::HostMemory;

/// A whole file mapped read-only (`PROT_READ`, `MAP_SHARED`): its pages are the page
/// cache's, so on tmpfs the bytes are not copied at all.
pub struct MappedFile {
    map: Mmap,
    path: PathBuf,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedFile")
            .field("path", &self.path)
            .field("len", &self.map.len())
            .finish()
    }
}

impl MappedFile {
    /// Maps all of `path` (which must not be empty).
    ///
    /// The file must not be truncated while the map lives (reading a page past the new end
    /// raises `SIGBUS`); bytes rewritten in place are seen by later reads and copies, as
    /// plain bytes.
    pub fn open(path: &Path) -> io::Result<Arc<Self>> {
        let file = File::open(path)?;
        let len = file.metadata()?.len();
        if len == 0 {
            return Err(io::Error::other(format!(
                "{}: an empty file cannot be mapped",
                path.display()
            )));
        }
        let len = usize::try_from(len).map_err(|_| io::Error::other("file too large to map"))?;
        // SAFETY: memmap2 requires that the mapped file is not truncated or changed in ways
        // that break Rust's aliasing rules while the map lives. The map is only ever read as
        // plain bytes (no value with validity invariants lives in it, and nothing here
        // writes it); the callers (the loader benchmark and tests) write their files before
        // mapping them and keep them until the map is dropped, and `open` documents that the
        // file must not be truncated meanwhile.
        let map = unsafe { MmapOptions::new().len(len).map(&file)? };
        Ok(Arc::new(Self {
            map,
            path: path.to_path_buf(),
        }))
    }

    /// The mapped file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }
}

impl HostMemory for MappedFile {
    fn as_bytes(&self) -> &[u8] {
        &self.map
    }

    fn read_only(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_a_file_read_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("shard");
        std::fs::write(&p, b"weights").unwrap();
        let m = MappedFile::open(&p).unwrap();
        assert_eq!(m.as_bytes(), b"weights");
        assert!(m.read_only());
        assert_eq!(
            m.as_bytes().as_ptr() as usize % 4096,
            0,
            "maps are page-aligned"
        );
        std::fs::write(dir.path().join("empty"), b"").unwrap();
        assert!(MappedFile::open(&dir.path().join("empty")).is_err());
        assert!(MappedFile::open(&dir.path().join("missing")).is_err());
    }
}
