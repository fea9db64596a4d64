//! Positional chunk writers: portable `pwrite` on the blocking pool, or io_uring.

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
    /// The faster writer on the measured hardware (see `docs/BENCHMARKS.md`), falling back
    /// to [`WriterKind::Pwrite`] with a warning where io_uring cannot be set up.
    #[default]
    Auto,
    /// `pwrite(2)` on tokio's blocking thread pool. Works everywhere.
    Pwrite,
    /// io_uring on a dedicated thread (Linux 5.6+). Fails to open where unavailable.
    IoUring,
}

/// The writer [`WriterKind::Auto`] picks. Rationale: on the 2-core development host
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
            WriterKind::Auto if AUTO_PREFERS_URING => uring().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "io_uring unavailable; writing chunks with pwrite");
                Imp::Pwrite
            }),
            WriterKind::Auto => Imp::Pwrite,
        };
        Ok(Self { imp })
    }

    /// The writer actually in use: [`WriterKind::Pwrite`] or [`WriterKind::IoUring`].
    pub fn kind(&self) -> WriterKind {
        match self.imp {
            Imp::Pwrite => WriterKind::Pwrite,
            #[cfg(target_os = "linux")]
            Imp::IoUring(_) => WriterKind::IoUring,
        }
    }

    /// Writes all of `data` at byte `offset` of `file`, without moving any file position.
    pub async fn write_at(&self, file: Arc<File>, offset: u64, data: Bytes) -> io::Result<()> {
        match &self.imp {
            Imp::Pwrite => pwrite(file, offset, data).await,
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
