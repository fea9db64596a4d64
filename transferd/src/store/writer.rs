//! Positional chunk writers: portable `pwrite` on the blocking pool, io_uring, or copies
//! into a writable shared map of the shard file (`mapped`), which several threads do at once.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use bytes::Bytes;

use super::StoreError;

/// Which positional writer the store uses for chunk data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WriterKind {
    /// [`WriterKind::Adaptive`] where the kernel has `MADV_POPULATE_WRITE`, else
    /// [`WriterKind::Pwrite`] (the measurements behind it are in `docs/BENCHMARKS.md`).
    #[default]
    Auto,
    /// `pwrite(2)` on tokio's blocking thread pool. Works everywhere.
    Pwrite,
    /// io_uring on a dedicated thread (Linux 5.6+). Fails to open where unavailable.
    IoUring,
    /// Copies into a writable shared map of the shard file on the blocking pool, its pages
    /// allocated first with `MADV_POPULATE_WRITE` (Linux 5.14+; fails to open elsewhere).
    /// Writes to one file run in parallel: `pwrite`s to one tmpfs file queue on its inode
    /// lock, so one shard is written at one core's copy rate (≈ 2.5 GB/s measured) however
    /// many stripes carry it.
    Mapped,
    /// `pwrite` while no other write to the same file is in progress, else the mapped
    /// copy: one stream per shard keeps `pwrite`'s cheaper single-thread rate (one core:
    /// 2.5 GB/s against 1.9 on a tmpfs of 4 KiB pages), a shard striped over several
    /// connections is written by several threads at once instead of queueing on the inode
    /// lock. Needs what [`WriterKind::Mapped`] needs.
    Adaptive,
}

/// Whether [`WriterKind::Auto`] picks io_uring over the others. Rationale: on the 2-core development host
/// (`cargo bench -p transferd --bench store_write`, 1 MiB chunks, numbers in
/// `docs/BENCHMARKS.md`) pwrite on the blocking pool beat io_uring in every case measured:
/// tmpfs 6.2 vs 5.4 GiB/s at one write in flight and 8.5 vs 6.8 GiB/s at four; disk (page
/// cache) 9.9 vs 7.8 and 14.2 vs 11.5 GiB/s. Re-measure before flipping this on other
/// hardware.
const AUTO_PREFERS_URING: bool = false;

/// Writes whole buffers at file offsets. Shared by every shard of a store; cheap to share
/// behind an `Arc`.
pub struct ChunkWriter {
    imp: Imp,
}

enum Imp {
    Pwrite,
    Mapped,
    Adaptive,
    #[cfg(target_os = "linux")]
    IoUring(super::uring::UringWriter),
}

impl std::fmt::Debug for ChunkWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkWriter")
            .field("kind", &self.kind())
            .finish()
    }
}

impl ChunkWriter {
    /// Sets up the writer `kind` asks for. [`WriterKind::IoUring`] fails with
    /// [`StoreError::WriterSetup`] where io_uring is unavailable; [`WriterKind::Auto`] never
    /// fails.
    pub fn new(kind: WriterKind) -> Result<Self, StoreError> {
        let imp = match kind {
            WriterKind::Pwrite => Imp::Pwrite,
            WriterKind::IoUring => uring().map_err(|source| StoreError::WriterSetup { source })?,
            WriterKind::Mapped | WriterKind::Adaptive => {
                super::map::populate_supported()
                    .map_err(|source| StoreError::WriterSetup { source })?;
                if kind == WriterKind::Mapped {
                    Imp::Mapped
                } else {
                    Imp::Adaptive
                }
            }
            WriterKind::Auto if AUTO_PREFERS_URING => uring().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "io_uring unavailable; writing chunks with pwrite");
                Imp::Pwrite
            }),
            WriterKind::Auto => match super::map::populate_supported() {
                Ok(()) => Imp::Adaptive,
                Err(e) => {
                    tracing::info!(
                        error = %e,
                        "no MADV_POPULATE_WRITE: writing chunks with pwrite alone (a striped shard is written at one core's rate)"
                    );
                    Imp::Pwrite
                }
            },
        };
        Ok(Self { imp })
    }

    /// The writer actually in use: never [`WriterKind::Auto`].
    pub fn kind(&self) -> WriterKind {
        match self.imp {
            Imp::Pwrite => WriterKind::Pwrite,
            Imp::Mapped => WriterKind::Mapped,
            Imp::Adaptive => WriterKind::Adaptive,
            #[cfg(target_os = "linux")]
            Imp::IoUring(_) => WriterKind::IoUring,
        }
    }

    /// Whether this writer copies chunks into the shard's writable map (mapped, adaptive):
    /// such a shard gets a map, and the memory reserve's spares get populated maps for it.
    pub fn copies_into_maps(&self) -> bool {
        matches!(self.imp, Imp::Mapped | Imp::Adaptive)
    }

    /// Writes all of `data` at byte `offset` of `file`, without moving any file position.
    /// The mapped writer's copies need the shard's map, which the shard holds
    /// (`Shard::write`); a bare file is written with `pwrite` there.
    pub async fn write_at(&self, file: Arc<File>, offset: u64, data: Bytes) -> io::Result<()> {
        match &self.imp {
            Imp::Pwrite | Imp::Mapped | Imp::Adaptive => pwrite(file, offset, data).await,
            #[cfg(target_os = "linux")]
            Imp::IoUring(u) => u.write_at(file, offset, data).await,
        }
    }
}

async fn pwrite(file: Arc<File>, offset: u64, data: Bytes) -> io::Result<()> {
    tokio::task::spawn_blocking(move || file.write_all_at(&data, offset))
        .await
        .map_err(|e| io::Error::other(format!("pwrite task failed: {e}")))?
}

#[cfg(target_os = "linux")]
fn uring() -> io::Result<Imp> {
    super::uring::UringWriter::new().map(Imp::IoUring)
}

#[cfg(not(target_os = "linux"))]
fn uring() -> io::Result<Imp> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "io_uring needs Linux",
    ))
}
