//! A TCP socket's receive low-water mark (`SO_RCVLOWAT`), managed by a reader that knows
//! how many bytes it waits for, so that the kernel wakes it once for a large read instead
//! of for every few segments.
//!
//! Why (issue #28): a data connection's reader asks for a frame's body, up to 256 KiB a
//! read, and the peer is bound to send all of it. Without a mark the kernel signals the
//! socket readable at every arrival; on a link slower than the reader (a shaped 1 Gbit/s
//! hop) that is a wake-up of the reading thread per few segments, and with tokio's
//! multi-thread runtime every arrival also wakes the worker parked in `epoll_wait` while
//! another worker is busy with what was read before; on loopback the sender pays for each
//! of those wake-ups too. On the 2-core test VM a TLS hop ran 30 % faster at 0.92–0.95
//! CPU-s/GB against 1.21–1.23 with the mark, and the emulated 8-receiver chain's receivers
//! spent about 9 % less CPU per GB (docs/BENCHMARKS.md).
//!
//! How: the mark is set only when a read of the socket found nothing (the reader is about
//! to wait), to the bytes it still needs for the read it was asked for; and after a read
//! that returned bytes it is raised to [`BUSY`], so that bytes arriving while the reader
//! works on what it read wake nobody (the reader reads them before it waits again). Where
//! tokio took a short read for a drained socket, its next read waits for the socket to be
//! signalled even if bytes came meanwhile: lowering the mark then signals it at once when
//! what is there reaches the new mark (Linux checks on every change), so no read waits for
//! bytes it already has. The kernel still signals the socket below the mark when the
//! connection ends, when the receive buffer is nearly full, or when the receive window has
//! closed (Linux's `tcp_epollin_ready`), so no mark can stall a reader that is the
//! bottleneck.
//!
//! Linux also raises the socket's receive buffer to about twice a mark it is given (unless
//! the buffer size was fixed with `SO_RCVBUF`), so a managed connection's receive buffer
//! is the kernel's maximum for a TCP socket (`net.ipv4.tcp_rmem`'s third value) once bytes
//! have flowed: the most its autotuning would give a fast connection anyway (a receiving
//! hop on loopback autotuned to about 10 MB on a VM whose maximum is 32 MiB).
//!
//! The one rule for a caller: never ask for more than the peer is bound to send (a framed
//! protocol reading the rest of a header or of a body whose length it knows), or a read can
//! wait until the connection ends.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::tcp::OwnedReadHalf;

/// The mark while the reader is busy with what it read: as high as the kernel allows (it
/// caps the mark at half of `net.ipv4.tcp_rmem`'s maximum), so that bytes arriving
/// meanwhile wake no thread even when the reader is the slower end and its socket holds
/// megabytes (a receiving hop on loopback held about 10 MB).
pub const BUSY: usize = 1 << 30;

/// One socket's mark, as last set.
pub(crate) struct LowWater {
    /// The socket: the reader that owns this mark owns the socket too, so it stays open as
    /// long as the mark is used.
    fd: RawFd,
    mark: usize,
}

impl LowWater {
    /// The mark of `read`'s socket, taken to be the kernel's default of one byte.
    pub(crate) fn of(read: &OwnedReadHalf) -> Self {
        Self {
            fd: read.as_ref().as_raw_fd(),
            mark: 1,
        }
    }

    /// Sets the mark to `want` bytes (at least 1, at most [`BUSY`]) where it differs.
    #[allow(unsafe_code)]
    fn set(&mut self, want: usize) -> io::Result<()> {
        let want = want.clamp(1, BUSY);
        if want == self.mark {
            return Ok(());
        }
        let value = libc::c_int::try_from(want).unwrap_or(1);
        // SAFETY: `fd` is the open socket of the read half whose owner owns this mark (see
        // the field); the option's value is a `c_int` passed by pointer with its size, as
        // setsockopt(2) takes it, and only read during the call.
        let rc = unsafe {
            libc::setsockopt(
                self.fd,
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        self.mark = want;
        Ok(())
    }
}

/// Sets `low_water`'s mark to `want` bytes; where the kernel refuses, the mark is set back
/// to one byte and no longer managed (`low_water` becomes `None`), with a debug log.
pub(crate) fn set(low_water: &mut Option<LowWater>, want: usize) {
    if let Some(lw) = low_water.as_mut() {
        if let Err(e) = lw.set(want) {
            tracing::debug!(error = %e, "SO_RCVLOWAT refused; reading this connection without it");
            let _ = lw.set(1);
            *low_water = None;
        }
    }
}

/// A plaintext TCP connection's read half whose reader asks only for bytes the peer is
/// bound to send (see the module): it sets the socket's receive low-water mark as above.
pub struct BatchedRead {
    inner: OwnedReadHalf,
    low_water: Option<LowWater>,
}

impl BatchedRead {
    /// Wraps `inner`; the caller must keep the module's rule.
    pub fn new(inner: OwnedReadHalf) -> Self {
        let low_water = Some(LowWater::of(&inner));
        Self { inner, low_water }
    }
}

impl AsyncRead for BatchedRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut me.inner).poll_read(cx, buf) {
            Poll::Pending => {
                // Nothing to read: wait for what was asked for.
                set(&mut me.low_water, buf.remaining());
                Poll::Pending
            }
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                set(&mut me.low_water, BUSY);
                Poll::Ready(Ok(()))
            }
            ready => ready,
        }
    }
}

/// A connected pair of loopback TCP sockets (client, accepted).
#[cfg(test)]
pub(crate) async fn socket_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (c, s) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
    (c.unwrap(), s.unwrap().0)
}

/// Reads exactly `buf.len()` bytes; how many reads that returned bytes it took.
#[cfg(test)]
pub(crate) async fn read_exact_counted(r: &mut (impl AsyncRead + Unpin), buf: &mut [u8]) -> usize {
    use tokio::io::AsyncReadExt;
    let (mut at, mut reads) = (0, 0);
    while at < buf.len() {
        let n = r.read(&mut buf[at..]).await.unwrap();
        assert!(n > 0, "the stream ended early");
        at += n;
        reads += 1;
    }
    reads
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A [`BatchedRead`] and the write half that feeds it (and the pair's other halves,
    /// to keep while the test runs).
    async fn batched() -> (
        BatchedRead,
        tokio::net::tcp::OwnedWriteHalf,
        (tokio::net::tcp::OwnedWriteHalf, OwnedReadHalf),
    ) {
        let (tx, rx) = socket_pair().await;
        let (read, w) = rx.into_split();
        let (r, writer) = tx.into_split();
        (BatchedRead::new(read), writer, (w, r))
    }

    /// Whether the kernel reports `fd` readable within `ms` milliseconds (`poll`, which
    /// applies the socket's low-water mark as a waiting reader's wake-up does).
    fn readable(fd: &impl std::os::fd::AsFd, ms: i64) -> bool {
        use rustix::event::{PollFd, PollFlags, Timespec};
        let mut fds = [PollFd::new(fd, PollFlags::IN)];
        let t = Timespec {
            tv_sec: ms / 1000,
            tv_nsec: ms % 1000 * 1_000_000,
        };
        rustix::event::poll(&mut fds, Some(&t)).unwrap() > 0
    }

    /// After a read that returned bytes, the mark is raised: bytes that arrive while the
    /// reader works on what it read make the socket readable for nobody, and the next
    /// read still takes them at once. A read that then finds nothing lowers the mark to
    /// what it asked for, and the socket is readable again once that much is there.
    #[tokio::test]
    async fn bytes_arriving_while_the_reader_is_busy_wake_nobody_and_are_read_next() {
        let (mut reader, mut writer, _halves) = batched().await;
        writer.write_all(&[1; 10]).await.unwrap();
        let mut buf = vec![0u8; 10];
        read_exact_counted(&mut reader, &mut buf).await;
        // Busy now: 4000 bytes arrive (well inside the receive window) and nobody is told.
        writer.write_all(&[2; 4000]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !readable(reader.inner.as_ref(), 100),
            "bytes below the busy mark made the socket readable"
        );
        let mut more = vec![0u8; 8000];
        let n = tokio::time::timeout(Duration::from_secs(5), reader.read(&mut more))
            .await
            .expect("a read with bytes waiting waited")
            .unwrap();
        assert_eq!((n, &more[..n]), (4000, &[2u8; 4000][..]));
        // Nothing left: the next read waits with the mark at what it asks for (100), so 50
        // bytes wake nobody and 100 do.
        let mut last = vec![0u8; 100];
        let pending = tokio::time::timeout(Duration::from_millis(50), reader.read(&mut last));
        assert!(
            pending.await.is_err(),
            "a read with nothing to read returned"
        );
        writer.write_all(&[3; 50]).await.unwrap();
        assert!(
            !readable(reader.inner.as_ref(), 100),
            "50 of 100 bytes woke the reader"
        );
        writer.write_all(&[3; 50]).await.unwrap();
        assert!(
            readable(reader.inner.as_ref(), 2000),
            "the 100 bytes asked for did not"
        );
    }

    /// A reader of exact amounts gets everything, small reads after large ones included
    /// (the mark is lowered before each wait: none outlives the read it was set for), and
    /// a large read that arrives in ten paced writes is woken once or twice for it, not
    /// ten times.
    #[tokio::test]
    async fn a_reader_of_exact_amounts_is_woken_for_the_whole_read_and_never_stalls() {
        let (mut reader, mut writer, _halves) = batched().await;
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let send = data.clone();
        let sender = tokio::spawn(async move {
            // A "body" of 100 000 bytes in ten paced pieces, then small "headers" and a
            // one-byte frame, each after a pause, then the rest at once.
            for piece in send[..100_000].chunks(10_000) {
                writer.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            for piece in send[100_000..100_016].chunks(5) {
                writer.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            writer.write_all(&send[100_016..]).await.unwrap();
            writer
        });
        let mut got = vec![0; data.len()];
        let whole = tokio::time::timeout(Duration::from_secs(10), async {
            let reads = read_exact_counted(&mut reader, &mut got[..100_000]).await;
            for at in [100_000, 100_005, 100_010, 100_015] {
                let end = (at + 5).min(100_016);
                read_exact_counted(&mut reader, &mut got[at..end]).await;
            }
            read_exact_counted(&mut reader, &mut got[100_016..]).await;
            reads
        })
        .await
        .expect("a read waited past the bytes it asked for");
        assert_eq!(got, data);
        assert!(
            whole <= 3,
            "100 000 bytes in ten paced writes took {whole} reads: the mark did not hold"
        );
        drop(sender.await.unwrap());
    }
}
