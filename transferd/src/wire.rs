//! Frames over a byte stream: [`FrameReader`] and [`FrameWriter`].
//!
//! The hop logic in [`crate::chain`] talks frames, never sockets: it gets a [`BoxStream`]
//! from a [`crate::transport::Transport`] (TLS over TCP, plaintext TCP, or a QUIC stream) as
//! [`Halves`] ([`BoxRead`], [`BoxSink`]: TCP and TLS through tokio's split, QUIC's own send
//! and receive streams), framed by a [`Conn`]. Both sides charge the daemon-wide [`RateLimiter`]s, so the
//! egress/ingress caps hold across every concurrent session. Ingress is charged for the
//! bytes that actually arrived, as they arrive (never for a length a peer merely
//! announced). Optional limits: a reader's idle timeout (silence while a frame, or the
//! rest of one, is awaited) and a writer's timeout on writes that do not drain; both are
//! counted in [`ByteCounters`].
//!
//! Every reader also draws on one daemon-wide [`FrameBudget`]: a frame body larger than
//! [`UNCHARGED_BODY`] is allocated only once its length is granted, and the grant is given
//! back when the last reference to the body's bytes is dropped (the chunk was verified and
//! stored, or the frame was refused), so the memory held by frames in flight across all
//! connections stays under `frame_memory` however many peers announce large frames.
//!
//! Which large frames a reader takes at each point ([`FrameReader::admit_large`]): the data
//! port takes only the `Open` before its token is checked, then its `Manifest`, then
//! `Chunk`s and `Piece`s; another is refused from its header (`WireError::NotAdmitted`). Every large
//! frame has a time ([`frame_time`]: [`FRAME_GRACE`] plus 1 s per MiB from its grant, the
//! reader's own ingress waits added; `WireError::FrameStalled`). The budget gives each peer a
//! share (a quarter, at least the largest frame) taken first ([`FrameReader::set_peer`],
//! from the certificate's identity). The grant rides with the body's `Bytes`
//! (`Bytes::from_owner`) until its last slice is dropped; then the buffer goes back to the
//! budget for the next body (at most [`IDLE_BODY_BYTES`] of idle buffers), so chunk bodies
//! are not read into freshly mapped memory the kernel must fault in and zero first (that
//! hidden zeroing pass was 8.6–13.4% of a receiver's samples before, 0.1–0.3% after;
//! issue #16). Plaintext reads go straight into the body, up to `READ_PIECE` (256 KiB) per
//! call. [`FrameReader::read`] is cancel-safe (a partly read frame stays in the reader), so
//! it sits in `select!` loops. With [`FrameReader::hash_chunks`] a `Chunk` payload is
//! BLAKE3-hashed in 64 KiB steps as it arrives, while still in cache, and the hash is taken
//! with [`FrameReader::take_chunk_hash`] for the store's verification.
//!
//! Writing: a chunk payload of at least the writer's 256 KiB buffer bypasses it and goes to
//! [`FrameSink::write_bytes`] as the `Bytes` it is (TLS copies it into records like any
//! bytes; QUIC's send stream keeps the `Bytes` in quinn's send buffer: `write_chunk`).
//! With the payload's file region (the store's data file and offset) it goes to
//! [`FrameSink::send_file`]: plaintext TCP's [`TcpSink`] sends it with `sendfile(2)`
//! (rustix), and writes it from memory where the kernel refuses (`EINVAL`/`ENOSYS`/
//! `EOPNOTSUPP`; `SentFrom::Refused`, `ByteCounters::sendfile_bytes` / `sendfile_refused`,
//! the first refusal logged). `sendfile` is off by default: on loopback from tmpfs it cost
//! the sender more CPU (0.36–0.39 against 0.23 CPU-s/GB) and moved less (2.6 against
//! 4.2 GB/s; docs/BENCHMARKS.md).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use shardcast_protocol::codec::{Codec, DecodeError};
use shardcast_protocol::frame::{FrameHeader, HEADER_LEN};
use shardcast_protocol::pieces::{ChunkHasher, PieceHasher};
use shardcast_protocol::{ErrorCode, Frame, FrameType, Hashed, PieceCv};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::throttle::RateLimiter;

/// A bidirectional byte stream a session runs over.
pub trait AsyncStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> AsyncStream for T {}

/// A boxed stream from any transport.
pub type BoxStream = Box<dyn AsyncStream>;

/// The read half of a stream, as [`Conn`] reads frames from it.
pub type BoxRead = Box<dyn AsyncRead + Unpin + Send>;

/// The write half of a stream, as [`Conn`] writes frames to it.
pub type BoxSink = Box<dyn FrameSink>;

/// A write half that can be handed a chunk's bytes as they are.
pub trait FrameSink: AsyncWrite + Unpin + Send {
    /// Writes all of `data`. By default it is written like any other bytes (copied into
    /// the socket, or into TLS records); a transport that can keep the `Bytes` themselves
    /// until they are sent — QUIC's send buffer — takes them without a copy.
    fn write_bytes(&mut self, data: Bytes) -> BoxFuture<'_, std::io::Result<()>> {
        Box::pin(async move { self.write_all(&data).await })
    }

    /// Writes all of `data`, which are the bytes at `region` in a file, from the file where
    /// the sink can (plaintext TCP: `sendfile`, no copy through user space); by default, and
    /// wherever the kernel refuses the file, as [`FrameSink::write_bytes`].
    fn send_file<'a>(
        &'a mut self,
        _region: &'a FileRegion,
        data: Bytes,
    ) -> BoxFuture<'a, std::io::Result<SentFrom>> {
        Box::pin(async move {
            self.write_bytes(data).await?;
            Ok(SentFrom::Memory)
        })
    }
}

/// Where a chunk's payload lies in a file (the store's data file): what
/// [`FrameSink::send_file`] sends from.
#[derive(Debug, Clone)]
pub struct FileRegion {
    /// The file.
    pub file: Arc<std::fs::File>,
    /// The payload's first byte in it.
    pub offset: u64,
}

/// How [`FrameSink::send_file`] sent a payload.
#[derive(Debug)]
pub enum SentFrom {
    /// From the file, by the kernel (`sendfile`).
    File,
    /// From memory: the sink does not send from files.
    Memory,
    /// From memory because the kernel refused to send from the file (the error).
    Refused(std::io::Error),
}

impl<T: AsyncWrite + Send> FrameSink for tokio::io::WriteHalf<T> {}

/// The write half of a `tls`-mode data connection on the record layer
/// ([`shardcast_identity::records`]): payloads are copied into records (no `sendfile`).
impl FrameSink for Box<shardcast_identity::records::RecordWriter<tokio::net::tcp::OwnedWriteHalf>> {}
#[cfg(test)]
impl FrameSink for tokio::io::DuplexStream {}
impl FrameSink for BoxSink {
    fn write_bytes(&mut self, data: Bytes) -> BoxFuture<'_, std::io::Result<()>> {
        (**self).write_bytes(data)
    }
    fn send_file<'a>(
        &'a mut self,
        region: &'a FileRegion,
        data: Bytes,
    ) -> BoxFuture<'a, std::io::Result<SentFrom>> {
        (**self).send_file(region, data)
    }
}

/// The write half of a plaintext TCP connection: chunk payloads go from the store's file to
/// the socket with `sendfile(2)` (the kernel passes the page-cache pages to the socket, no
/// copy through user space). Where the kernel refuses (a file system without the
/// operation), the payload is written from memory instead and the refusal reported.
pub struct TcpSink(tokio::net::tcp::OwnedWriteHalf);

impl TcpSink {
    /// `sendfile` of `len` bytes from `region`; the bytes sent so far when it fails.
    async fn sendfile(
        &self,
        region: &FileRegion,
        len: usize,
    ) -> Result<(), (usize, std::io::Error)> {
        let stream: &tokio::net::TcpStream = self.0.as_ref();
        let mut offset = region.offset;
        let mut sent = 0;
        while sent < len {
            if let Err(e) = stream.writable().await {
                return Err((sent, e));
            }
            let r = stream.try_io(tokio::io::Interest::WRITABLE, || {
                rustix::fs::sendfile(stream, &*region.file, Some(&mut offset), len - sent)
                    .map_err(std::io::Error::from)
            });
            match r {
                Ok(0) => {
                    return Err((
                        sent,
                        std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "sendfile: the file ended before the chunk did",
                        ),
                    ));
                }
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err((sent, e)),
            }
        }
        Ok(())
    }
}

impl AsyncWrite for TcpSink {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl FrameSink for TcpSink {
    fn send_file<'a>(
        &'a mut self,
        region: &'a FileRegion,
        data: Bytes,
    ) -> BoxFuture<'a, std::io::Result<SentFrom>> {
        Box::pin(async move {
            match self.sendfile(region, data.len()).await {
                Ok(()) => Ok(SentFrom::File),
                // Refused by the kernel for this file (nothing of it went out, or part of
                // it did): the rest from memory, the same bytes.
                Err((sent, e)) if refused_sendfile(&e) => {
                    self.write_all(&data[sent..]).await?;
                    Ok(SentFrom::Refused(e))
                }
                Err((_, e)) => Err(e),
            }
        })
    }
}

/// Whether a `sendfile` error means "not from this file" (send from memory instead) rather
/// than a broken connection.
fn refused_sendfile(e: &std::io::Error) -> bool {
    matches!(
        rustix::io::Errno::from_io_error(e),
        Some(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS | rustix::io::Errno::OPNOTSUPP)
    ) || e.kind() == std::io::ErrorKind::UnexpectedEof
}

impl Halves {
    /// A plaintext TCP connection's halves: owned halves (no split lock), the read half
    /// managing the socket's receive low-water mark (the [`FrameReader`] never asks for
    /// more than the rest of the frame it is in), and a [`TcpSink`] that sends chunk
    /// payloads from the store's files.
    pub fn tcp(stream: tokio::net::TcpStream) -> Self {
        let (read, write) = stream.into_split();
        Self {
            read: Box::new(shardcast_identity::lowat::BatchedRead::new(read)),
            write: Box::new(TcpSink(write)),
        }
    }
}

/// A stream taken apart for [`Conn`]: its read half and its write half.
pub struct Halves {
    /// Where frames are read from.
    pub read: BoxRead,
    /// Where frames are written to.
    pub write: BoxSink,
}

impl From<BoxStream> for Halves {
    /// Splits a stream whose two directions share one object (TCP, TLS) behind tokio's
    /// split lock.
    fn from(stream: BoxStream) -> Self {
        let (read, write) = tokio::io::split(stream);
        Self {
            read: Box::new(read),
            write: Box::new(write),
        }
    }
}

/// Why reading or writing frames failed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The underlying stream failed.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent bytes that are not a valid frame.
    #[error("malformed frame: {0}")]
    Decode(#[from] DecodeError),
    /// The peer closed the stream in the middle of a frame.
    #[error("peer closed the connection mid-frame")]
    Truncated,
    /// The peer sent nothing for this long while a frame (or the rest of one) was awaited.
    #[error("peer silent for {0:?} while a frame was awaited")]
    Idle(Duration),
    /// A write did not drain within this long (the peer stopped reading).
    #[error("write did not drain within {0:?}; the peer stopped reading")]
    WriteStalled(Duration),
    /// A frame larger than [`UNCHARGED_BODY`] of a type this connection does not take at
    /// this point (a `Chunk` before an authorised `Open`, say): refused from its header,
    /// before any memory is granted.
    #[error(
        "a {ty:?} frame of {len} bytes is not accepted here (this point of the connection takes large frames of {allowed:?} only)"
    )]
    NotAdmitted {
        /// The frame's type.
        ty: FrameType,
        /// Its announced body length.
        len: usize,
        /// What the connection admits now.
        allowed: &'static [FrameType],
    },
    /// A large frame that did not arrive within its time ([`frame_time`]): the peer
    /// announced it and then sent too little of it.
    #[error("a {ty:?} frame of {len} bytes did not arrive within {limit:?} ({got} bytes came)")]
    FrameStalled {
        /// The frame's type.
        ty: FrameType,
        /// Its announced body length.
        len: usize,
        /// Bytes of its body that arrived.
        got: usize,
        /// The time it had (waits on this host's own ingress cap not counted).
        limit: Duration,
    },
}

impl WireError {
    /// The error code to send the peer before closing, if the fault is theirs.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Decode(DecodeError::UnknownFrameType(_)) => Some(ErrorCode::UnknownFrameType),
            Self::Decode(_) => Some(ErrorCode::Malformed),
            Self::NotAdmitted { .. } => Some(ErrorCode::ProtocolViolation),
            Self::FrameStalled { .. } => Some(ErrorCode::Refused),
            Self::Io(_) | Self::Truncated | Self::Idle(_) | Self::WriteStalled(_) => None,
        }
    }
}

/// Byte counters shared by every connection of a daemon.
#[derive(Debug, Default)]
pub struct ByteCounters {
    /// Bytes read off the wire (frame headers included).
    pub received: AtomicU64,
    /// Bytes written to the wire (frame headers included).
    pub sent: AtomicU64,
    /// Connections dropped because the peer stayed silent past the idle timeout.
    pub idle_timeouts: AtomicU64,
    /// Connections dropped because a write did not drain in time.
    pub write_timeouts: AtomicU64,
    /// Accepted connections dropped because `Hello` did not complete in time.
    pub handshake_timeouts: AtomicU64,
    /// Chunk payload bytes sent from the store's files by the kernel (`sendfile`).
    pub sendfile_bytes: AtomicU64,
    /// Chunk payloads sent from memory because the kernel refused `sendfile` for their file.
    pub sendfile_refused: AtomicU64,
    /// Large frames refused from their header: a type the connection did not take at that
    /// point ([`WireError::NotAdmitted`]).
    pub frames_not_admitted: AtomicU64,
    /// Connections dropped because a large frame did not arrive in time
    /// ([`WireError::FrameStalled`]).
    pub frame_timeouts: AtomicU64,
}

/// Frame bodies up to this length are not charged to the [`FrameBudget`]: control frames
/// (acks, progress, `Hello`) must always get through, or a budget full of chunks waiting
/// for their acks could stall the connections that carry those acks. Their memory is
/// bounded by the connection cap instead (64 KiB each).
pub const UNCHARGED_BODY: usize = 64 << 10;

/// The least rate at which a large frame's body must arrive, with [`FRAME_GRACE`]: see
/// [`frame_time`]. Rationale: a frame holds its bytes of the peer's share of the
/// [`FrameBudget`] until it is complete, so one that stops progressing must end; a hop
/// whose upstream delivers less than 1 MiB/s is stalled for any practical purpose (chains
/// run at hundreds of MB/s, and `stall_timeout` drops an upstream silent for 2 s).
pub const FRAME_MIN_RATE: u64 = 1 << 20;

/// The time every large frame has on top of its size at [`FRAME_MIN_RATE`]. Rationale:
/// covers scheduling hiccups and TCP recovering from loss on a slow link; 10 s is five
/// stall timeouts.
pub const FRAME_GRACE: Duration = Duration::from_secs(10);

/// How long the body of a large frame of `len` bytes may take to arrive, counted from when
/// its room in the budget was granted; time this host holds the reader back for its own
/// ingress cap is added. A 1 MiB chunk has 11 s, a 16 MiB one 26 s.
pub fn frame_time(len: usize) -> Duration {
    FRAME_GRACE + Duration::from_secs_f64(len as f64 / FRAME_MIN_RATE as f64)
}

/// The daemon-wide budget of bytes for frame bodies being read or still held (a chunk not
/// yet verified and stored). Fair: readers waiting for room are served in order.
///
/// Each peer (a certificate's identity; the remote address without TLS) may hold at most
/// [`Self::per_peer`] of it, so one host — a compromised one with a valid certificate,
/// announcing large frames on many connections and sending nothing more — cannot take the
/// whole budget and stall everyone else's chains: its own frames wait instead (counted).
#[derive(Debug)]
pub struct FrameBudget {
    sem: Arc<Semaphore>,
    total: usize,
    per_peer: usize,
    /// Each peer's share, while a connection of it is open.
    peers: std::sync::Mutex<HashMap<String, std::sync::Weak<Semaphore>>>,
    /// Frames that had to wait for room.
    pub waits: AtomicU64,
    /// Frames that had to wait because their peer held its whole share.
    pub peer_waits: AtomicU64,
    /// Buffers of charged frame bodies whose bytes were all dropped, kept for the next
    /// bodies (at most [`IDLE_BODY_BYTES`] in all).
    idle: std::sync::Mutex<Vec<Vec<u8>>>,
}

/// Most bytes of idle body buffers the [`FrameBudget`] keeps for reuse. Reusing them
/// spares each chunk a fresh allocation: glibc serves a 1 MiB body from a fresh `mmap` (or
/// a heap it trimmed), so every page was faulted in and zeroed by the kernel
/// (`clear_page_erms` in the receiver's profile, docs/BENCHMARKS.md "Where the receiver's
/// cycles go") — a pass over every byte before the socket's bytes are even copied in.
/// 32 MiB: a few connections' pipelines of 1 MiB chunks.
pub const IDLE_BODY_BYTES: usize = 32 << 20;

impl FrameBudget {
    /// A budget of `bytes` (at least one frame of [`UNCHARGED_BODY`]); each peer's share is
    /// a quarter of it, but never less than the largest frame body (or the whole budget,
    /// when that is smaller), so any valid frame can pass.
    pub fn new(bytes: usize) -> Arc<Self> {
        let total = bytes.clamp(UNCHARGED_BODY, Semaphore::MAX_PERMITS);
        // The longest bodies the protocol allows (a manifest's, then a chunk's; the other
        // frame types are far shorter).
        let largest = shardcast_protocol::FrameType::Manifest
            .max_body_len()
            .max(shardcast_protocol::FrameType::Chunk.max_body_len());
        let per_peer = (total / 4).max(largest.min(total));
        Arc::new(Self {
            sem: Arc::new(Semaphore::new(total)),
            total,
            per_peer,
            peers: std::sync::Mutex::new(HashMap::new()),
            waits: AtomicU64::new(0),
            peer_waits: AtomicU64::new(0),
            idle: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// A budget no frame ever waits for (tests, tools).
    pub fn unlimited() -> Arc<Self> {
        Self::new(Semaphore::MAX_PERMITS)
    }

    /// The budget in bytes.
    pub fn total(&self) -> usize {
        self.total
    }

    /// The most one peer may hold, in bytes.
    pub fn per_peer(&self) -> usize {
        self.per_peer
    }

    /// `peer`'s share (shared by all its connections; forgotten once none is open).
    pub fn share(&self, peer: &str) -> Arc<Semaphore> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = peers.get(peer).and_then(std::sync::Weak::upgrade) {
            return s;
        }
        peers.retain(|_, w| w.strong_count() > 0);
        let s = Arc::new(Semaphore::new(self.per_peer));
        peers.insert(peer.to_string(), Arc::downgrade(&s));
        s
    }

    /// Bytes granted to frames now.
    pub fn in_use(&self) -> usize {
        self.total - self.sem.available_permits().min(self.total)
    }

    /// A buffer of `len` initialized bytes for a body: an idle one when one fits (at most
    /// twice the size needed, so small bodies do not pin big buffers), else a new one.
    /// Initialized, so a reader may be handed all of it at once (the TLS record layer
    /// decrypts straight into it, `shardcast_identity::records`): an idle buffer keeps
    /// the length of the body it held, so only what a longer body needs beyond that is
    /// zeroed; a new one comes zeroed from the allocator's fresh pages.
    fn body_buffer(&self, len: usize) -> Vec<u8> {
        if len > UNCHARGED_BODY {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let fit = idle
                .iter()
                .position(|b| b.capacity() >= len && b.capacity() / 2 <= len);
            if let Some(i) = fit {
                let mut buf = idle.swap_remove(i);
                drop(idle);
                buf.resize(len, 0);
                return buf;
            }
        }
        vec![0; len]
    }

    /// Takes back a body's buffer once nothing refers to its bytes (dropped when the idle
    /// buffers already hold [`IDLE_BODY_BYTES`]). It keeps its length, so its bytes stay
    /// initialized for the next body.
    fn recycle(&self, buf: Vec<u8>) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let held: usize = idle.iter().map(Vec::capacity).sum();
        if held + buf.capacity() <= IDLE_BODY_BYTES {
            idle.push(buf);
        }
    }

    /// Idle body buffers kept for reuse, in bytes.
    pub fn idle_bytes(&self) -> usize {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.iter().map(Vec::capacity).sum()
    }

    /// Grants room for a body of `len` bytes (nothing for a small one): first in the
    /// peer's share (when the reader knows its peer), then in the whole budget, waiting
    /// for each when it is spent. A body longer than the whole budget is granted the whole
    /// budget, so it can still pass, alone. Cancel-safe: nothing is held until it returns.
    async fn grant(&self, len: usize, share: Option<&Arc<Semaphore>>) -> Option<Grant> {
        if len <= UNCHARGED_BODY {
            return None;
        }
        // At most `total`, which never exceeds `Semaphore::MAX_PERMITS`; the cast holds
        // because frame bodies are bounded well below 4 GiB.
        let n = len.min(self.total).min(u32::MAX as usize) as u32;
        let peer = match share {
            None => None,
            Some(s) => {
                // `per_peer` is at least the largest body, or the whole budget.
                let m = n.min(self.per_peer as u32);
                Some(match s.clone().try_acquire_many_owned(m) {
                    Ok(p) => p,
                    Err(_) => {
                        self.peer_waits.fetch_add(1, Ordering::Relaxed);
                        // Shares are never closed.
                        s.clone().acquire_many_owned(m).await.ok()?
                    }
                })
            }
        };
        let all = match self.sem.clone().try_acquire_many_owned(n) {
            Ok(p) => p,
            Err(_) => {
                self.waits.fetch_add(1, Ordering::Relaxed);
                // The semaphore is never closed.
                self.sem.clone().acquire_many_owned(n).await.ok()?
            }
        };
        Some(Grant {
            _peer: peer,
            _all: all,
        })
    }
}

/// Room granted to one frame body: in its peer's share and in the whole budget, both
/// given back when the body's last byte is dropped.
#[derive(Debug)]
struct Grant {
    _peer: Option<OwnedSemaphorePermit>,
    _all: OwnedSemaphorePermit,
}

/// A frame body that holds its grant of the [`FrameBudget`] until its last byte is
/// dropped, and then gives its buffer back to the budget for the next body.
struct Charged {
    buf: Vec<u8>,
    budget: Arc<FrameBudget>,
    _grant: Grant,
}

impl AsRef<[u8]> for Charged {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Charged {
    fn drop(&mut self) {
        self.budget.recycle(std::mem::take(&mut self.buf));
    }
}

/// Bytes read per `read` call inside a frame body. Ingress is charged per piece, so this
/// is also the granularity of the ingress limiter (256 KiB: a few syscalls per 1 MiB
/// chunk, and a burst well inside the limiter's allowance).
const READ_PIECE: usize = 256 << 10;

/// Reads frames, charging the ingress limiter for the bytes received, as they arrive.
///
/// [`FrameReader::read`] is cancel-safe: a partly read frame is kept in the reader, so it
/// can sit in a `tokio::select!` beside other branches without ever losing bytes of the
/// stream (a shaped link delivers frames in pieces).
///
/// It never asks its inner reader for more than the rest of the frame it is in (of its
/// header, or of its body, at most [`READ_PIECE`] at a time), bytes the peer is bound to
/// send: that is what lets a data connection's read half manage its socket's receive
/// low-water mark ([`shardcast_identity::lowat`]) and be woken once per large read.
pub struct FrameReader<R> {
    inner: R,
    ingress: RateLimiter,
    counters: Arc<ByteCounters>,
    budget: Arc<FrameBudget>,
    header: [u8; HEADER_LEN],
    header_filled: usize,
    /// The body being read, once the header is parsed and its room granted: its buffer
    /// (the body's length, initialized) and how much of it has arrived.
    body: Option<(FrameHeader, Vec<u8>, usize, Option<Grant>)>,
    /// This connection's peer's share of the budget, once the peer is known.
    share: Option<Arc<Semaphore>>,
    /// When the bytes received last may pass the ingress limiter; no more is read before.
    ready_at: Option<tokio::time::Instant>,
    /// Longest silence while a frame is awaited; `None`: wait forever.
    idle: Option<Duration>,
    /// When bytes last arrived (or the idle timeout was armed).
    last_rx: tokio::time::Instant,
    /// When the caller started waiting for the frame now being read (kept across
    /// cancelled reads, cleared when a frame is returned).
    waiting_since: Option<tokio::time::Instant>,
    /// The types of large frames (bodies over [`UNCHARGED_BODY`]) this connection takes
    /// now; `None`: any.
    large: Option<&'static [FrameType]>,
    /// When the large frame being read must be complete ([`frame_time`]).
    frame_deadline: Option<tokio::time::Instant>,
    /// Hash a `Chunk` or `Piece` body's payload as it arrives ([`FrameReader::hash_chunks`]).
    hash_chunks: bool,
    /// The payload hash of the `Chunk` or `Piece` body being read: the hasher (none yet
    /// while a `Piece`'s number has not arrived) and the body offset it has hashed up to.
    hashing: Option<(Hashing, usize)>,
    /// The payload hash of the last `Chunk` frame returned, until taken.
    chunk_hash: Option<Hashed>,
    /// The payload CV of the last `Piece` frame returned, until taken.
    piece_cv: Option<PieceCv>,
}

/// What hashes the payload of the frame being read.
enum Hashing {
    /// A whole chunk, piece by piece (its hash and its pieces' CVs).
    Chunk(ChunkHasher),
    /// A piece whose number (and so its place in the chunk's tree) has not arrived yet.
    PieceAwaited,
    /// A piece: its CV.
    Piece(PieceHasher),
}

/// Bytes of a `Chunk` body before its payload: shard, index and length, a `u32` each.
const CHUNK_FIXED: usize = 12;
/// Bytes of a `Piece` body before its payload: shard, index, piece and length.
const PIECE_FIXED: usize = 16;

/// A `Chunk` payload is hashed in steps of this many bytes as they arrive (and the rest at
/// its end): whole powers of two from the payload's start keep BLAKE3's SIMD paths on
/// whole subtrees, and 64 KiB is still in the core's cache from the read (and decryption)
/// that just wrote it.
const HASH_STEP: usize = 64 << 10;

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Charges this connection's large frames to `peer`'s share of the budget as well
    /// (its certificate's identity, or its address without TLS): set once the peer is
    /// known, before its first large frame.
    pub fn set_peer(&mut self, peer: &str) {
        self.share = Some(self.budget.share(peer));
    }

    /// From now on, takes frames larger than [`UNCHARGED_BODY`] only of `types` (`None`:
    /// any); another type that large fails the read with [`WireError::NotAdmitted`] as
    /// soon as its header arrives, before any memory is granted to it. Where a connection
    /// is with a peer that chose to connect (the data port), the large frames it may send
    /// depend on what it is authorised for: nothing but its `Open` before its plan token
    /// is checked.
    pub fn admit_large(&mut self, types: Option<&'static [FrameType]>) {
        self.large = types;
    }

    /// Whether to hash each `Chunk` frame's payload while it arrives, in [`HASH_STEP`]s
    /// that are still in cache from the read that wrote them, rather than in one pass over
    /// the whole chunk later: the hash is then taken with [`FrameReader::take_chunk_hash`].
    /// Saves a pass over memory; costs the reading task the hash's CPU time (the hash no
    /// longer runs beside the next chunk's read on another core).
    pub fn hash_chunks(&mut self, on: bool) {
        self.hash_chunks = on;
    }

    /// The BLAKE3 hash of the payload of the `Chunk` frame the last [`FrameReader::read`]
    /// returned, worked out here over exactly those bytes as they arrived; `None` when
    /// [`FrameReader::hash_chunks`] is off or the last frame was another type.
    pub fn take_chunk_hash(&mut self) -> Option<Hashed> {
        self.chunk_hash.take()
    }

    /// The CV of the payload of the `Piece` frame the last [`FrameReader::read`] returned,
    /// worked out here over exactly those bytes as they arrived (at the piece's place in its
    /// chunk's tree); `None` when [`FrameReader::hash_chunks`] is off or the last frame was
    /// another type.
    pub fn take_piece_cv(&mut self) -> Option<PieceCv> {
        self.piece_cv.take()
    }

    /// Wraps a read half.
    pub fn new(
        inner: R,
        ingress: RateLimiter,
        counters: Arc<ByteCounters>,
        budget: Arc<FrameBudget>,
    ) -> Self {
        Self {
            inner,
            ingress,
            counters,
            budget,
            header: [0; HEADER_LEN],
            header_filled: 0,
            body: None,
            share: None,
            ready_at: None,
            idle: None,
            last_rx: tokio::time::Instant::now(),
            waiting_since: None,
            large: None,
            frame_deadline: None,
            hash_chunks: false,
            hashing: None,
            chunk_hash: None,
            piece_cv: None,
        }
    }

    /// Arms (or with `None` disarms) the idle timeout: from now on a `read` fails with
    /// [`WireError::Idle`] once the peer has sent nothing for `idle` while a frame is
    /// awaited, whether it is silent between frames or in the middle of one. The clock
    /// counts from the later of the last byte received and the first `read` since the
    /// previous frame, so it holds however often `read` is cancelled and called again, and
    /// time spent not reading (serving a `Fetch`) does not count against the peer.
    pub fn set_idle_timeout(&mut self, idle: Option<Duration>) {
        self.idle = idle;
        self.last_rx = tokio::time::Instant::now();
    }

    /// Charges `n` received bytes to the ingress limiter and the counters.
    fn received(&mut self, n: usize) {
        self.last_rx = tokio::time::Instant::now();
        self.counters
            .received
            .fetch_add(n as u64, Ordering::Relaxed);
        self.ready_at = Some(self.ingress.reserve(n as u64));
    }

    /// Reads the next frame; `Ok(None)` on a clean end of stream between frames.
    pub async fn read(&mut self) -> Result<Option<Frame>, WireError> {
        // The reads below are raced against the idle deadline; on a timeout nothing of
        // the stream is lost (a partly read frame stays here), but the caller drops the
        // connection anyway.
        let since = *self
            .waiting_since
            .get_or_insert_with(tokio::time::Instant::now);
        let deadline = self.idle.map(|d| (since.max(self.last_rx) + d, d));
        let r = match deadline {
            None => self.read_inner().await,
            Some((at, d)) => match tokio::time::timeout_at(at, self.read_inner()).await {
                Ok(r) => r,
                Err(_) => {
                    self.counters.idle_timeouts.fetch_add(1, Ordering::Relaxed);
                    return Err(WireError::Idle(d));
                }
            },
        };
        if r.is_ok() {
            self.waiting_since = None;
        }
        r
    }

    async fn read_inner(&mut self) -> Result<Option<Frame>, WireError> {
        loop {
            // Wait until the bytes already received may pass the ingress cap before
            // reading more (the reservation is kept if this future is cancelled).
            if let Some(ready_at) = self.ready_at {
                let now = tokio::time::Instant::now();
                if ready_at > now {
                    // Our own cap holding the reader back does not count against the
                    // frame's time (extended before the wait: if this read is cancelled
                    // mid-wait, the frame only gets a little more).
                    if let Some(d) = self.frame_deadline.as_mut() {
                        *d += ready_at - now;
                    }
                    tokio::time::sleep_until(ready_at).await;
                }
                self.ready_at = None;
            }
            if self.body.is_none() {
                if self.header_filled < HEADER_LEN {
                    let n = self
                        .inner
                        .read(&mut self.header[self.header_filled..])
                        .await?;
                    if n == 0 {
                        return if self.header_filled == 0 {
                            Ok(None)
                        } else {
                            Err(WireError::Truncated)
                        };
                    }
                    self.header_filled += n;
                    self.received(n);
                    continue;
                }
                // Bounds-checked, then granted room in the budget, before anything is
                // allocated for the body.
                let head = FrameHeader::parse(self.header)?;
                if head.body_len > UNCHARGED_BODY {
                    if let Some(allowed) = self.large.filter(|a| !a.contains(&head.ty)) {
                        self.counters
                            .frames_not_admitted
                            .fetch_add(1, Ordering::Relaxed);
                        return Err(WireError::NotAdmitted {
                            ty: head.ty,
                            len: head.body_len,
                            allowed,
                        });
                    }
                }
                let grant = self.budget.grant(head.body_len, self.share.as_ref()).await;
                let buf = self.budget.body_buffer(head.body_len);
                // The frame's clock starts once it has its room (waiting for the budget is
                // not the peer's fault).
                self.frame_deadline = (head.body_len > UNCHARGED_BODY)
                    .then(|| tokio::time::Instant::now() + frame_time(head.body_len));
                self.chunk_hash = None;
                self.piece_cv = None;
                self.hashing = match head.ty {
                    _ if !self.hash_chunks => None,
                    FrameType::Chunk if head.body_len >= CHUNK_FIXED => {
                        Some((Hashing::Chunk(ChunkHasher::new()), CHUNK_FIXED))
                    }
                    FrameType::Piece if head.body_len > PIECE_FIXED => {
                        Some((Hashing::PieceAwaited, PIECE_FIXED))
                    }
                    _ => None,
                };
                self.body = Some((head, buf, 0, grant));
            }
            let Some((head, body, filled, grant)) = self.body.as_mut() else {
                return Err(WireError::Truncated);
            };
            let remaining = head.body_len - *filled;
            if remaining == 0 {
                let ty = head.ty;
                let buf = std::mem::take(body);
                let body = match grant.take() {
                    Some(g) => Bytes::from_owner(Charged {
                        buf,
                        budget: self.budget.clone(),
                        _grant: g,
                    }),
                    None => Bytes::from(buf),
                };
                let body_len = body.len();
                self.body = None;
                self.header_filled = 0;
                self.frame_deadline = None;
                let frame = Frame::decode_body(ty, body)?;
                // The hash covers the body from its payload's first byte to its end: it is
                // the payload's hash exactly when the payload runs to the body's end.
                match (self.hashing.take(), &frame) {
                    (Some((Hashing::Chunk(hasher), upto)), Frame::Chunk { data, .. })
                        if upto == body_len && data.len() == body_len - CHUNK_FIXED =>
                    {
                        self.chunk_hash = Some(hasher.finish());
                    }
                    (Some((Hashing::Piece(hasher), upto)), Frame::Piece { data, .. })
                        if upto == body_len
                            && data.len() == body_len - PIECE_FIXED
                            && !data.is_empty() =>
                    {
                        self.piece_cv = Some(hasher.finish());
                    }
                    _ => {}
                }
                return Ok(Some(frame));
            }
            // Read straight into the body, never past the end of this frame.
            let piece = *filled..*filled + remaining.min(READ_PIECE);
            let read = self.inner.read(&mut body[piece]);
            let n = match self.frame_deadline {
                None => read.await?,
                Some(at) => match tokio::time::timeout_at(at, read).await {
                    Ok(n) => n?,
                    Err(_) => {
                        self.counters.frame_timeouts.fetch_add(1, Ordering::Relaxed);
                        return Err(WireError::FrameStalled {
                            ty: head.ty,
                            len: head.body_len,
                            got: *filled,
                            limit: frame_time(head.body_len),
                        });
                    }
                },
            };
            if n == 0 {
                return Err(WireError::Truncated);
            }
            *filled += n;
            if let Some((hashing, upto)) = self.hashing.as_mut() {
                let fixed = match hashing {
                    Hashing::Chunk(_) => CHUNK_FIXED,
                    Hashing::Piece(_) | Hashing::PieceAwaited => PIECE_FIXED,
                };
                if matches!(hashing, Hashing::PieceAwaited) && *filled >= fixed {
                    // The piece's number is here: its place in the chunk's tree.
                    let piece = u32::from_be_bytes([body[8], body[9], body[10], body[11]]);
                    *hashing = Hashing::Piece(PieceHasher::new(piece));
                }
                if *filled > fixed {
                    // Whole steps from the payload's start, and the rest once it is all here.
                    let end = if *filled == head.body_len {
                        *filled
                    } else {
                        fixed + (*filled - fixed) / HASH_STEP * HASH_STEP
                    };
                    if end > *upto {
                        match hashing {
                            Hashing::Chunk(h) => h.update(&body[*upto..end]),
                            Hashing::Piece(h) => h.update(&body[*upto..end]),
                            Hashing::PieceAwaited => {}
                        }
                        *upto = end;
                    }
                }
            }
            self.received(n);
        }
    }
}

/// A [`FrameWriter`]'s buffer: enough to batch small control frames and chunk headers into
/// few syscalls; chunk payloads this large or larger bypass it.
const WRITE_BUFFER: usize = 256 << 10;

/// Writes frames, charging the egress limiter before each one.
pub struct FrameWriter<W: AsyncWrite> {
    inner: BufWriter<W>,
    egress: RateLimiter,
    counters: Arc<ByteCounters>,
    scratch: Vec<u8>,
    /// Longest one write may wait for the peer to drain it; `None`: forever.
    write_timeout: Option<Duration>,
}

impl<W: FrameSink> FrameWriter<W> {
    /// Wraps a write half.
    pub fn new(inner: W, egress: RateLimiter, counters: Arc<ByteCounters>) -> Self {
        Self {
            inner: BufWriter::with_capacity(WRITE_BUFFER, inner),
            egress,
            counters,
            scratch: Vec::new(),
            write_timeout: None,
        }
    }

    /// Fails writes (and flushes) that do not complete within `timeout` with
    /// [`WireError::WriteStalled`]; `None` waits forever. Waiting for the egress limiter
    /// does not count.
    pub fn set_write_timeout(&mut self, timeout: Option<Duration>) {
        self.write_timeout = timeout;
    }

    /// Runs one write under the write timeout.
    async fn timed<T>(
        &mut self,
        write: impl AsyncFnOnce(&mut BufWriter<W>) -> std::io::Result<T>,
    ) -> Result<T, WireError> {
        match self.write_timeout {
            None => Ok(write(&mut self.inner).await?),
            Some(d) => match tokio::time::timeout(d, write(&mut self.inner)).await {
                Ok(r) => Ok(r?),
                Err(_) => {
                    self.counters.write_timeouts.fetch_add(1, Ordering::Relaxed);
                    Err(WireError::WriteStalled(d))
                }
            },
        }
    }

    /// Buffers one frame (call [`FrameWriter::flush`] to push it out).
    pub async fn send(&mut self, frame: &Frame) -> Result<(), WireError> {
        if let Frame::Chunk { shard, index, data } = frame {
            return self.send_chunk(*shard, *index, data, None).await;
        }
        self.scratch.clear();
        frame.encode(&mut self.scratch);
        self.egress.acquire(self.scratch.len() as u64).await;
        let scratch = std::mem::take(&mut self.scratch);
        let r = self.timed(async |w| w.write_all(&scratch).await).await;
        self.scratch = scratch;
        r?;
        self.counters
            .sent
            .fetch_add(self.scratch.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Writes a `Chunk` frame without copying its payload into the buffer: a payload at
    /// least the buffer's size goes to the stream after the buffered frames and the prefix,
    /// from `file` when given (the payload's place in the store's file:
    /// [`FrameSink::send_file`]), else as `Bytes` ([`FrameSink::write_bytes`]).
    pub async fn send_chunk(
        &mut self,
        shard: u32,
        index: u32,
        data: &Bytes,
        file: Option<&FileRegion>,
    ) -> Result<(), WireError> {
        let prefix = Frame::chunk_prefix(shard, index, data.len());
        self.send_payload(&prefix, data, file).await
    }

    /// Sends piece `piece` of chunk `index` of `shard` (a `Piece` frame; protocol version 7),
    /// its payload as [`FrameWriter::send_chunk`] sends a chunk's.
    pub async fn send_piece(
        &mut self,
        shard: u32,
        index: u32,
        piece: u32,
        data: &Bytes,
        file: Option<&FileRegion>,
    ) -> Result<(), WireError> {
        let prefix = Frame::piece_prefix(shard, index, piece, data.len());
        self.send_payload(&prefix, data, file).await
    }

    /// A frame's `prefix` (header and fixed fields), then its payload `data`: copied into
    /// the buffer when small, else written as it is (or sent from `file`).
    async fn send_payload(
        &mut self,
        prefix: &[u8],
        data: &Bytes,
        file: Option<&FileRegion>,
    ) -> Result<(), WireError> {
        let total = (prefix.len() + data.len()) as u64;
        self.egress.acquire(total).await;
        let from = self
            .timed(async |w| {
                w.write_all(prefix).await?;
                if data.len() < WRITE_BUFFER {
                    w.write_all(data).await?;
                    return Ok(SentFrom::Memory);
                }
                w.flush().await?;
                match file {
                    Some(region) => w.get_mut().send_file(region, data.clone()).await,
                    None => w
                        .get_mut()
                        .write_bytes(data.clone())
                        .await
                        .map(|()| SentFrom::Memory),
                }
            })
            .await?;
        match from {
            SentFrom::File => {
                self.counters
                    .sendfile_bytes
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
            }
            SentFrom::Memory => {}
            SentFrom::Refused(e) => {
                // Said once per daemon; counted every time.
                if self
                    .counters
                    .sendfile_refused
                    .fetch_add(1, Ordering::Relaxed)
                    == 0
                {
                    tracing::warn!(
                        "the kernel refused sendfile from the store ({e}); chunks are copied through user space instead"
                    );
                }
            }
        }
        self.counters.sent.fetch_add(total, Ordering::Relaxed);
        Ok(())
    }

    /// Sends one frame and flushes.
    pub async fn send_now(&mut self, frame: &Frame) -> Result<(), WireError> {
        self.send(frame).await?;
        self.flush().await
    }

    /// Flushes buffered frames to the stream.
    pub async fn flush(&mut self) -> Result<(), WireError> {
        self.timed(async |w| w.flush().await).await
    }

    /// Flushes and shuts down the write side.
    pub async fn shutdown(&mut self) -> Result<(), WireError> {
        self.inner.shutdown().await?;
        Ok(())
    }
}

/// A connected peer: reader and writer halves of one stream.
pub struct Conn {
    /// Incoming frames.
    pub reader: FrameReader<BoxRead>,
    /// Outgoing frames.
    pub writer: FrameWriter<BoxSink>,
    /// The protocol version the peer's `Hello` named (this build's until the handshake).
    pub peer_version: u16,
}

impl Conn {
    /// Frames a stream's halves.
    pub fn new(
        stream: Halves,
        ingress: RateLimiter,
        egress: RateLimiter,
        counters: Arc<ByteCounters>,
        budget: Arc<FrameBudget>,
    ) -> Self {
        Self {
            reader: FrameReader::new(stream.read, ingress, counters.clone(), budget),
            writer: FrameWriter::new(stream.write, egress, counters),
            peer_version: shardcast_protocol::PROTOCOL_VERSION,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardcast_protocol::pieces;
    use shardcast_protocol::{ChunkHash, HostId};

    /// A sink that records, in order, what reached it as plain writes and what as `Bytes`.
    #[derive(Default)]
    struct Recording(Vec<Result<Vec<u8>, Bytes>>);

    impl AsyncWrite for Recording {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            self.0.push(Ok(buf.to_vec()));
            std::task::Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    impl FrameSink for Recording {
        fn write_bytes(&mut self, data: Bytes) -> BoxFuture<'_, std::io::Result<()>> {
            self.0.push(Err(data));
            Box::pin(async { Ok(()) })
        }
    }

    /// Plaintext TCP over loopback: chunk payloads go from a real file by `sendfile`, and
    /// from memory where the file system refuses it (procfs answers `EINVAL`), counted and
    /// byte-exact either way.
    #[tokio::test]
    async fn chunk_payloads_go_by_sendfile_and_from_memory_where_the_kernel_refuses() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let (sender, receiver) = (
            Halves::tcp(client.unwrap()),
            Halves::tcp(accepted.unwrap().0),
        );
        let counters = Arc::new(ByteCounters::default());
        let mut w = FrameWriter::new(sender.write, RateLimiter::unlimited(), counters.clone());
        let mut r = FrameReader::new(
            receiver.read,
            RateLimiter::unlimited(),
            Arc::default(),
            FrameBudget::unlimited(),
        );
        // Three chunks larger than the write buffer, in a real file.
        const N: usize = WRITE_BUFFER + 12_345;
        let content: Vec<u8> = (0..3 * N).map(|i| (i % 251) as u8).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.data");
        std::fs::write(&path, &content).unwrap();
        let file = Arc::new(std::fs::File::open(&path).unwrap());
        let chunk = |i: usize| Bytes::copy_from_slice(&content[i * N..(i + 1) * N]);
        let refusing = Arc::new(std::fs::File::open("/proc/self/status").unwrap());
        let regions = [
            Some(FileRegion {
                file: file.clone(),
                offset: 0,
            }),
            // procfs has no splice: the kernel refuses sendfile from it.
            Some(FileRegion {
                file: refusing,
                offset: 0,
            }),
            Some(FileRegion {
                file,
                offset: 2 * N as u64,
            }),
            // No file (a chunk changed in flight): from memory.
            None,
        ];
        let sending = async {
            for (i, region) in regions.iter().enumerate() {
                w.send_chunk(0, i as u32, &chunk(i.min(2)), region.as_ref())
                    .await
                    .unwrap();
            }
            w.flush().await.unwrap();
        };
        let receiving = async {
            let mut got = Vec::new();
            for _ in 0..regions.len() {
                got.push(r.read().await.unwrap().unwrap());
            }
            got
        };
        let ((), got) = tokio::join!(sending, receiving);
        for (i, frame) in got.into_iter().enumerate() {
            let Frame::Chunk { index, data, .. } = frame else {
                panic!("not a chunk: {frame:?}")
            };
            assert_eq!(index, i as u32);
            assert!(data == chunk(i.min(2)), "chunk {i} differs");
        }
        assert_eq!(
            counters.sendfile_bytes.load(Ordering::Relaxed),
            2 * N as u64
        );
        assert_eq!(counters.sendfile_refused.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn large_chunk_payloads_reach_the_sink_as_the_same_bytes_small_ones_are_buffered() {
        let big = Bytes::from(vec![7u8; WRITE_BUFFER]);
        let small = Bytes::from(vec![9u8; 1000]);
        let mut w = FrameWriter::new(
            Recording::default(),
            RateLimiter::unlimited(),
            Arc::default(),
        );
        w.send(&Frame::Keepalive).await.unwrap();
        w.send_chunk(1, 2, &big, None).await.unwrap();
        w.send_chunk(1, 3, &small, None).await.unwrap();
        w.flush().await.unwrap();
        let pieces = &w.inner.get_ref().0;
        // The big payload was handed over as the very same allocation: no copy.
        let owned: Vec<&Bytes> = pieces.iter().filter_map(|p| p.as_ref().err()).collect();
        assert_eq!(owned.len(), 1, "only the big payload goes as Bytes");
        assert_eq!(owned[0].as_ptr(), big.as_ptr());
        // In order, the pieces are exactly the three frames' encodings.
        let mut wire = Vec::new();
        for p in pieces {
            match p {
                Ok(v) => wire.extend_from_slice(v),
                Err(b) => wire.extend_from_slice(b),
            }
        }
        let mut expected = Vec::new();
        for f in [
            Frame::Keepalive,
            Frame::Chunk {
                shard: 1,
                index: 2,
                data: big.clone(),
            },
            Frame::Chunk {
                shard: 1,
                index: 3,
                data: small.clone(),
            },
        ] {
            f.encode(&mut expected);
        }
        assert_eq!(wire, expected);
    }

    /// Chunk payloads hashed as they arrive, in odd-sized reads across the hash's steps,
    /// give exactly the payload's BLAKE3; another frame type, or hashing off, gives none.
    #[tokio::test]
    async fn chunk_payloads_are_hashed_as_they_arrive() {
        // A pipe of 7,777 bytes: reads end at odd offsets inside and across 64 KiB steps.
        let (a, b) = tokio::io::duplex(7_777);
        let counters = Arc::new(ByteCounters::default());
        let mut w = FrameWriter::new(a, RateLimiter::unlimited(), counters.clone());
        let mut r = FrameReader::new(
            b,
            RateLimiter::unlimited(),
            counters,
            FrameBudget::unlimited(),
        );
        r.hash_chunks(true);
        let sizes = [
            0,
            1,
            HASH_STEP - 1,
            HASH_STEP,
            HASH_STEP + 1,
            3 * HASH_STEP + 17,
            1 << 20,
            (1 << 20) + 5,
        ];
        let payload = |n: usize| -> Bytes { (0..n).map(|i| (i * 7 % 253) as u8).collect() };
        let writer = tokio::spawn(async move {
            for (i, &n) in sizes.iter().enumerate() {
                let chunk = Frame::Chunk {
                    shard: 1,
                    index: i as u32,
                    data: payload(n),
                };
                w.send(&chunk).await.unwrap();
                // Then its pieces, where it has pieces, as `Piece` frames.
                let data = payload(n);
                for p in 0..pieces::piece_count(n) as u32 {
                    let span = pieces::piece_span(n, p).unwrap();
                    w.send_piece(1, i as u32, p, &data.slice(span), None)
                        .await
                        .unwrap();
                }
                w.send(&Frame::Ack {
                    shard: 1,
                    index: i as u32,
                })
                .await
                .unwrap();
            }
            w.shutdown().await.unwrap();
            w
        });
        for (i, &n) in sizes.iter().enumerate() {
            match r.read().await.unwrap() {
                Some(Frame::Chunk { index, data, .. }) => {
                    assert_eq!(index as usize, i);
                    assert_eq!(data, payload(n));
                    assert_eq!(r.take_chunk_hash(), Some(Hashed::of(&data)), "{n} bytes");
                    assert_eq!(
                        Hashed::of(&data).root,
                        ChunkHash(*blake3::hash(&data).as_bytes())
                    );
                    assert_eq!(r.take_chunk_hash(), None, "taken once");
                    assert_eq!(r.take_piece_cv(), None, "a chunk has no piece CV");
                }
                other => panic!("unexpected {other:?}"),
            }
            let data = payload(n);
            let cvs = Hashed::of(&data).cvs;
            for (p, cv) in cvs.iter().enumerate() {
                match r.read().await.unwrap() {
                    Some(Frame::Piece { index, piece, .. }) => {
                        assert_eq!((index as usize, piece as usize), (i, p));
                        assert_eq!(r.take_piece_cv(), Some(*cv), "{n} bytes, piece {p}");
                        assert_eq!(r.take_chunk_hash(), None);
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert!(matches!(r.read().await.unwrap(), Some(Frame::Ack { .. })));
            assert_eq!(r.take_chunk_hash(), None, "an Ack has no payload hash");
        }
        assert!(r.read().await.unwrap().is_none());
        writer.await.unwrap();

        // Off: chunks come through whole, with no hash.
        let (a, b) = tokio::io::duplex(7_777);
        let mut w = FrameWriter::new(a, RateLimiter::unlimited(), Arc::default());
        let mut r = FrameReader::new(
            b,
            RateLimiter::unlimited(),
            Arc::default(),
            FrameBudget::unlimited(),
        );
        let data = payload(HASH_STEP + 3);
        let sent = Frame::Chunk {
            shard: 0,
            index: 0,
            data: data.clone(),
        };
        tokio::spawn(async move {
            w.send(&sent).await.unwrap();
            w.shutdown().await.unwrap();
        });
        assert!(matches!(r.read().await.unwrap(), Some(Frame::Chunk { data: d, .. }) if d == data));
        assert_eq!(r.take_chunk_hash(), None);
    }

    #[tokio::test]
    async fn frames_cross_a_duplex_pipe() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let counters = Arc::new(ByteCounters::default());
        let mut w = FrameWriter::new(a, RateLimiter::unlimited(), counters.clone());
        let mut r = FrameReader::new(
            b,
            RateLimiter::unlimited(),
            counters.clone(),
            FrameBudget::unlimited(),
        );
        let hello = Frame::Hello {
            version: 1,
            host: HostId::new("h1").unwrap(),
        };
        let chunk = Frame::Chunk {
            shard: 2,
            index: 3,
            data: Bytes::from_static(b"abc"),
        };
        let writer = tokio::spawn(async move {
            w.send(&hello).await.unwrap();
            w.send(&chunk).await.unwrap();
            w.shutdown().await.unwrap();
        });
        assert!(matches!(
            r.read().await.unwrap(),
            Some(Frame::Hello { version: 1, .. })
        ));
        match r.read().await.unwrap() {
            Some(Frame::Chunk {
                shard: 2,
                index: 3,
                data,
            }) => assert_eq!(&data[..], b"abc"),
            other => panic!("unexpected {other:?}"),
        }
        assert!(r.read().await.unwrap().is_none());
        writer.await.unwrap();
        assert_eq!(
            counters.sent.load(Ordering::Relaxed),
            counters.received.load(Ordering::Relaxed)
        );
    }

    #[tokio::test]
    async fn huge_length_is_rejected_before_allocation() {
        let (mut a, b) = tokio::io::duplex(64);
        let mut r = FrameReader::new(
            b,
            RateLimiter::unlimited(),
            Arc::default(),
            FrameBudget::unlimited(),
        );
        a.write_all(&[0xff, 0xff, 0xff, 0xff, 0x05]).await.unwrap();
        let err = r.read().await.unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::Malformed), "{err}");
    }

    #[tokio::test]
    async fn reads_survive_cancellation_mid_frame() {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut r = FrameReader::new(
            b,
            RateLimiter::unlimited(),
            Arc::default(),
            FrameBudget::unlimited(),
        );
        let mut bytes = Vec::new();
        for i in 0..20u32 {
            Frame::Chunk {
                shard: 1,
                index: i,
                data: Bytes::from(vec![i as u8; 1000]),
            }
            .encode(&mut bytes);
        }
        let writer = tokio::spawn(async move {
            // Dribble the bytes so reads are often cut off mid-frame.
            for piece in bytes.chunks(7) {
                a.write_all(piece).await.unwrap();
                tokio::task::yield_now().await;
            }
        });
        let mut got = Vec::new();
        while got.len() < 20 {
            tokio::select! {
                f = r.read() => got.push(f.unwrap().unwrap()),
                _ = tokio::task::yield_now() => {}
            }
        }
        writer.await.unwrap();
        for (i, f) in got.iter().enumerate() {
            match f {
                Frame::Chunk { index, data, .. } => {
                    assert_eq!(*index, i as u32);
                    assert!(data.iter().all(|b| *b == i as u8));
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn ingress_is_charged_for_bytes_that_arrived_not_for_announced_ones() {
        // 1 MB/s. A peer announces a 1 MB Manifest body and sends 10 bytes of it.
        let ingress = RateLimiter::new(Some(1_000_000));
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut r = FrameReader::new(b, ingress.clone(), Arc::default(), FrameBudget::unlimited());
        let mut announced = (1_000_000u32).to_be_bytes().to_vec();
        announced.push(0x02);
        a.write_all(&announced).await.unwrap();
        a.write_all(&[0u8; 10]).await.unwrap();
        let pending = tokio::time::timeout(Duration::from_millis(50), r.read()).await;
        assert!(pending.is_err(), "the frame is incomplete");
        // The limiter was charged 15 bytes, not 1 MB: another reader's 1000 bytes may pass
        // within a couple of milliseconds, not after a second.
        let at = ingress.reserve(1000);
        assert!(
            at <= tokio::time::Instant::now() + Duration::from_millis(5),
            "ingress budget held for an announced length"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_times_out_between_and_inside_frames() {
        let counters = Arc::new(ByteCounters::default());
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut r = FrameReader::new(
            b,
            RateLimiter::unlimited(),
            counters.clone(),
            FrameBudget::unlimited(),
        );
        r.set_idle_timeout(Some(Duration::from_secs(2)));
        // Between frames.
        let start = tokio::time::Instant::now();
        assert!(matches!(r.read().await, Err(WireError::Idle(_))));
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        // Inside a frame, with the read cancelled and restarted many times: the clock
        // counts from the last byte, so restarts do not extend it.
        r.set_idle_timeout(Some(Duration::from_secs(2)));
        a.write_all(&[0, 0, 0, 9, 0x06, 1]).await.unwrap();
        let start = tokio::time::Instant::now();
        let err = loop {
            match tokio::time::timeout(Duration::from_millis(300), r.read()).await {
                Ok(r) => break r.unwrap_err(),
                Err(_) => continue,
            }
        };
        assert!(matches!(err, WireError::Idle(_)), "{err}");
        assert!(start.elapsed() <= Duration::from_millis(2100));
        assert_eq!(counters.idle_timeouts.load(Ordering::Relaxed), 2);

        // Time spent not reading (this host busy writing) does not count against the peer:
        // after a whole frame, a pause, then a read, the peer gets the full timeout again.
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut r = FrameReader::new(
            b,
            RateLimiter::unlimited(),
            counters.clone(),
            FrameBudget::unlimited(),
        );
        r.set_idle_timeout(Some(Duration::from_secs(2)));
        let mut done = Vec::new();
        Frame::Done.encode(&mut done);
        a.write_all(&done).await.unwrap();
        assert!(matches!(r.read().await, Ok(Some(Frame::Done))));
        tokio::time::sleep(Duration::from_secs(5)).await;
        let start = tokio::time::Instant::now();
        assert!(matches!(r.read().await, Err(WireError::Idle(_))));
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_does_not_drain_times_out() {
        let counters = Arc::new(ByteCounters::default());
        let (a, _b) = tokio::io::duplex(1024);
        let mut w = FrameWriter::new(a, RateLimiter::unlimited(), counters.clone());
        w.set_write_timeout(Some(Duration::from_secs(1)));
        let data = Bytes::from(vec![0u8; 1 << 20]);
        let err = w.send_chunk(0, 0, &data, None).await.unwrap_err();
        assert!(matches!(err, WireError::WriteStalled(_)), "{err}");
        assert_eq!(counters.write_timeouts.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn truncated_frame_is_an_error() {
        let (mut a, b) = tokio::io::duplex(64);
        let mut r = FrameReader::new(
            b,
            RateLimiter::unlimited(),
            Arc::default(),
            FrameBudget::unlimited(),
        );
        a.write_all(&[0, 0, 0, 9, 0x06, 1, 2]).await.unwrap();
        drop(a);
        assert!(matches!(r.read().await, Err(WireError::Truncated)));
    }

    #[tokio::test]
    async fn frame_bodies_wait_for_room_in_the_budget_and_give_it_back_when_dropped() {
        let budget = FrameBudget::new(256 << 10);
        let (a, b) = tokio::io::duplex(1 << 20);
        let mut w = FrameWriter::new(a, RateLimiter::unlimited(), Arc::default());
        let mut r = FrameReader::new(b, RateLimiter::unlimited(), Arc::default(), budget.clone());
        let chunk = |index| Frame::Chunk {
            shard: 0,
            index,
            data: Bytes::from(vec![index as u8; 100 << 10]),
        };
        let writer = tokio::spawn(async move {
            for i in 0..3 {
                w.send(&chunk(i)).await.unwrap();
            }
            w.send(&Frame::Ack { shard: 0, index: 9 }).await.unwrap();
            w.shutdown().await.unwrap();
        });
        let first = r.read().await.unwrap().unwrap();
        let second = r.read().await.unwrap().unwrap();
        assert!(budget.in_use() >= 200 << 10, "{}", budget.in_use());
        // A third body does not fit until one of the two is dropped.
        assert!(
            tokio::time::timeout(Duration::from_millis(200), r.read())
                .await
                .is_err()
        );
        assert_eq!(budget.waits.load(Ordering::Relaxed), 1);
        // The grant lives as long as any slice of the body.
        let Frame::Chunk { data, .. } = first else {
            panic!("expected a chunk")
        };
        let slice = data.slice(1..2);
        drop(data);
        assert!(
            tokio::time::timeout(Duration::from_millis(200), r.read())
                .await
                .is_err()
        );
        drop(slice);
        let third = r.read().await.unwrap().unwrap();
        assert!(matches!(third, Frame::Chunk { index: 2, .. }));
        drop((second, third));
        assert_eq!(budget.in_use(), 0);
        // Small control frames are never charged.
        assert!(matches!(
            r.read().await.unwrap(),
            Some(Frame::Ack { index: 9, .. })
        ));
        assert_eq!(budget.in_use(), 0);
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn charged_body_buffers_are_reused_once_dropped_and_bounded() {
        let budget = FrameBudget::unlimited();
        let (a, b) = tokio::io::duplex(1 << 20);
        let mut w = FrameWriter::new(a, RateLimiter::unlimited(), Arc::default());
        let mut r = FrameReader::new(b, RateLimiter::unlimited(), Arc::default(), budget.clone());
        let writer = tokio::spawn(async move {
            for i in 0..3u32 {
                let data = Bytes::from(vec![i as u8 + 1; 300 << 10]);
                w.send(&Frame::Chunk {
                    shard: 0,
                    index: i,
                    data,
                })
                .await
                .unwrap();
            }
            w.shutdown().await.unwrap();
        });
        let first = r.read().await.unwrap().unwrap();
        let Frame::Chunk { data, .. } = first else {
            panic!("expected a chunk")
        };
        assert!(data.iter().all(|b| *b == 1));
        let ptr = data.as_ptr();
        assert_eq!(budget.idle_bytes(), 0);
        drop(data);
        assert!(budget.idle_bytes() >= 300 << 10);
        // The next body of the same size is read into the same buffer, with its own bytes.
        let Some(Frame::Chunk { data, index, .. }) = r.read().await.unwrap() else {
            panic!("expected a chunk")
        };
        assert_eq!(index, 1);
        assert_eq!(budget.idle_bytes(), 0);
        assert!(data.iter().all(|b| *b == 2));
        // The body starts after the chunk's 12 bytes of fixed fields.
        assert_eq!(data.as_ptr(), ptr);
        drop(data);
        let _ = r.read().await.unwrap().unwrap();
        writer.await.unwrap();
        // Never more than IDLE_BODY_BYTES kept.
        for _ in 0..(IDLE_BODY_BYTES / (1 << 20)) + 4 {
            budget.recycle(Vec::with_capacity(1 << 20));
        }
        assert!(budget.idle_bytes() <= IDLE_BODY_BYTES);
    }
}
