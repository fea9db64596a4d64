//! TLS 1.3 application-data records on a data connection after its handshake, protected
//! with the traffic keys rustls negotiated ([`rustls::ExtractedSecrets`]), read and written
//! here instead of through rustls's buffers.
//!
//! Why: on a TLS hop's receiving side rustls 0.23 makes two copies of every byte of its
//! own (its record buffer is filled from the socket 4 KiB at a time, so a read buffer sits
//! in front of it; it then copies each decrypted record into a plaintext buffer, which the
//! reader copies out again). Here, when the caller reads into a large initialized buffer
//! (a chunk's body), the socket is read straight into it and each record is decrypted
//! where it landed, its plaintext moved down behind the previous record's in the same
//! AEAD pass: no copy of the plaintext at all, only of a record split between two reads.
//! Smaller reads go through one buffer of this reader's, where records are decrypted in
//! place and the plaintext is copied once, into the caller's buffer. Writing, each record
//! is sealed from the caller's bytes straight into the send buffer with aws-lc-rs's
//! out-of-place AEAD (ring, which rustls uses, seals only in place, after a copy: 0.162
//! against 0.115 CPU-s per GB; docs/BENCHMARKS.md, issue #28). The two directions
//! keep separate keys and sequence numbers, so the halves are independent ([`RecordReader`], [`RecordWriter`]): no lock between reading a
//! hop's chunks and writing its acknowledgements.
//!
//! What is implemented is RFC 8446 section 5 for application data, nothing more:
//! - a record is `0x17 0x03 0x03`, a 16-bit length, and the AEAD ciphertext of the payload
//!   followed by its real content type (no padding is sent; any received is removed);
//! - the nonce is the traffic IV XOR the record's 64-bit sequence number (section 5.3),
//!   the additional data the record's header (section 5.2);
//! - a key protects at most [`RECORD_LIMIT`] records (section 5.5's limit for AES-GCM is
//!   2^24.5 full-size records): a writer past it fails, and the connection is dialled anew;
//! - `close_notify` ends the stream; any other alert, a handshake message (a key update or
//!   a session ticket: neither end sends one) or a malformed record is an error, and the
//!   stream is unusable after it.
//!
//! Only the handshake decides what is protected and by whom: it is rustls's, with both
//! certificates checked as on every connection ([`crate::TlsContext::accept_data`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use aws_lc_rs::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use rustls::ConnectionTrafficSecrets;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes of a record's header.
const HEADER: usize = 5;
/// Largest plaintext of one record (2^14).
pub const MAX_PLAINTEXT: usize = 1 << 14;
/// Largest ciphertext a record may carry (2^14 + 256, RFC 8446 section 5.2).
const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;
/// Bytes of the AEAD tag (all three TLS 1.3 AEADs rustls offers).
const TAG: usize = 16;
/// Records one key protects before the writer refuses to go on (below AES-GCM's 2^24.5).
pub const RECORD_LIMIT: u64 = 1 << 24;
/// Content types.
const APPLICATION_DATA: u8 = 0x17;
const ALERT: u8 = 0x15;
const HANDSHAKE: u8 = 0x16;
/// Bytes read from the socket at a time, beyond one whole record (the read buffer holds
/// both: about 144 KiB a connection; rustls's stream held a 64 KiB read buffer and its own
/// record and plaintext buffers).
const READ_BUFFER: usize = 128 << 10;
/// Least initialized room in the caller's buffer for a direct read
/// ([`RecordReader::poll_read_direct`]): four whole records, so the copies of a partial
/// record in and out stay small beside the plaintext it saves copying.
const DIRECT_READ: usize = 4 * (HEADER + MAX_CIPHERTEXT);
/// Encrypted bytes the writer gathers before it writes them out (its buffer is this and one
/// more record, allocated with the writer and grown, once, if a burst needs more).
const WRITE_BUFFER: usize = 128 << 10;

/// One direction's key, IV and next sequence number.
struct Direction {
    key: LessSafeKey,
    iv: [u8; aead::NONCE_LEN],
    seq: u64,
}

impl Direction {
    fn new((seq, secrets): (u64, ConnectionTrafficSecrets)) -> io::Result<Self> {
        let (alg, key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&aead::AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&aead::AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
                (&aead::CHACHA20_POLY1305, key, iv)
            }
            #[allow(unreachable_patterns)]
            _ => {
                return Err(io::Error::other(
                    "the negotiated cipher is not one this record layer has",
                ));
            }
        };
        let key = UnboundKey::new(alg, key.as_ref())
            .map_err(|_| io::Error::other("the negotiated traffic key has the wrong length"))?;
        let iv: [u8; aead::NONCE_LEN] = iv
            .as_ref()
            .try_into()
            .map_err(|_| io::Error::other("the negotiated traffic IV has the wrong length"))?;
        Ok(Self {
            key: LessSafeKey::new(key),
            iv,
            seq,
        })
    }

    /// The next record's nonce (RFC 8446 section 5.3), consuming its sequence number.
    fn next_nonce(&mut self) -> io::Result<Nonce> {
        if self.seq >= RECORD_LIMIT {
            return Err(io::Error::other(
                "this connection's traffic key has protected as many records as it may; dial again",
            ));
        }
        let mut n = self.iv;
        for (b, s) in n[aead::NONCE_LEN - 8..]
            .iter_mut()
            .zip(self.seq.to_be_bytes())
        {
            *b ^= s;
        }
        self.seq += 1;
        Ok(Nonce::assume_unique_for_key(n))
    }
}

fn bad_record(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS record: {why}"))
}

/// The read half: decrypts records from `inner` in place and hands out their plaintext.
pub struct RecordReader<R> {
    inner: R,
    dir: Direction,
    buf: Vec<u8>,
    /// Unprocessed bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    /// Decrypted plaintext not yet read is `buf[plain.0..plain.1]`.
    plain: (usize, usize),
    /// `close_notify` received: the stream has ended.
    closed: bool,
    /// A fatal error was returned: every later read fails too.
    failed: bool,
    /// Plaintext bytes decrypted where the caller's buffer received them (direct reads).
    direct: u64,
    /// The socket's receive low-water mark, where this reader manages it
    /// ([`RecordReader::wake_in_batches`]).
    low_water: Option<crate::lowat::LowWater>,
}

/// The write half: encrypts what is written into records and sends them to `inner`.
pub struct RecordWriter<W> {
    inner: W,
    dir: Direction,
    /// Records not yet written out: `out[sent..end]`. The buffer keeps its length (it is
    /// never zero-filled again), so records are sealed into it from the caller's bytes.
    out: Vec<u8>,
    sent: usize,
    end: usize,
    /// `close_notify` has been queued.
    closing: bool,
}

/// Both halves of a data connection whose records this module protects.
pub fn split<R, W>(
    read: R,
    write: W,
    secrets: rustls::ExtractedSecrets,
) -> io::Result<(RecordReader<R>, RecordWriter<W>)> {
    Ok((
        RecordReader {
            inner: read,
            dir: Direction::new(secrets.rx)?,
            buf: vec![0; READ_BUFFER + HEADER + MAX_CIPHERTEXT],
            start: 0,
            end: 0,
            plain: (0, 0),
            closed: false,
            failed: false,
            direct: 0,
            low_water: None,
        },
        RecordWriter {
            inner: write,
            dir: Direction::new(secrets.tx)?,
            out: vec![0; WRITE_BUFFER + HEADER + MAX_CIPHERTEXT],
            sent: 0,
            end: 0,
            closing: false,
        },
    ))
}

/// What a record held, once opened.
enum Content {
    /// Application data: this many bytes of plaintext.
    Data(usize),
    /// `close_notify`: the stream has ended.
    Close,
}

/// The header and ciphertext length of the record at the front of `avail`, once it is
/// whole there; `None` while it is not.
fn whole_record(avail: &[u8]) -> io::Result<Option<([u8; HEADER], usize)>> {
    let Some(header) = avail.first_chunk::<HEADER>() else {
        return Ok(None);
    };
    if header[0] != APPLICATION_DATA || header[1] != 0x03 || header[2] != 0x03 {
        return Err(bad_record("not an application-data record of TLS 1.3"));
    }
    let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
    if !(TAG + 1..=MAX_CIPHERTEXT).contains(&len) {
        return Err(bad_record("length out of bounds"));
    }
    Ok((avail.len() >= HEADER + len).then_some((*header, len)))
}

/// What a decrypted record's TLSInnerPlaintext holds: its content, then its type, then
/// zero padding.
fn content(plain: &[u8]) -> io::Result<Content> {
    let Some(at) = plain.iter().rposition(|&b| b != 0) else {
        return Err(bad_record("no content type"));
    };
    let (ty, content_len) = (plain[at], at);
    if content_len > MAX_PLAINTEXT {
        return Err(bad_record("plaintext too long"));
    }
    match ty {
        APPLICATION_DATA => Ok(Content::Data(content_len)),
        ALERT if content_len == 2 && plain[1] == 0 => Ok(Content::Close),
        ALERT => Err(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            format!(
                "the peer sent TLS alert {}",
                plain.get(1).copied().unwrap_or(0)
            ),
        )),
        HANDSHAKE => Err(bad_record(
            "a handshake message after the handshake (key updates are not supported on data connections)",
        )),
        _ => Err(bad_record("unknown content type")),
    }
}

impl<R> RecordReader<R> {
    /// Decrypts the record at the front of the unprocessed bytes, if it is whole: `Ok(true)`
    /// when one was consumed.
    fn open_one(&mut self) -> io::Result<bool> {
        let Some((header, len)) = whole_record(&self.buf[self.start..self.end])? else {
            return Ok(false);
        };
        let body = self.start + HEADER..self.start + HEADER + len;
        self.start += HEADER + len;
        let nonce = self.dir.next_nonce()?;
        let plain = self
            .dir
            .key
            .open_in_place(nonce, Aad::from(header), &mut self.buf[body.clone()])
            .map_err(|_| bad_record("decryption failed (bad record MAC)"))?;
        match content(plain)? {
            Content::Data(n) => self.plain = (body.start, body.start + n),
            Content::Close => self.closed = true,
        }
        Ok(true)
    }

    /// Decrypts every whole record in `region` (ciphertext as read from the socket) where
    /// it lies, moving each record's plaintext down behind the previous one's in the same
    /// pass (the AEAD writes below what it reads). Returns the plaintext's length, now at
    /// the front of `region`, and how many bytes of records were consumed; a partial record
    /// after them is left where it is. Stops after `close_notify`.
    fn open_within(&mut self, region: &mut [u8]) -> io::Result<(usize, usize)> {
        let (mut plain, mut read) = (0, 0);
        while !self.closed {
            let Some((header, len)) = whole_record(&region[read..])? else {
                break;
            };
            let end = read + HEADER + len;
            let nonce = self.dir.next_nonce()?;
            let opened = self
                .dir
                .key
                .open_within(
                    nonce,
                    Aad::from(header),
                    &mut region[plain..end],
                    read + HEADER - plain..,
                )
                .map_err(|_| bad_record("decryption failed (bad record MAC)"))?;
            match content(opened)? {
                Content::Data(n) => plain += n,
                Content::Close => self.closed = true,
            }
            read = end;
        }
        Ok((plain, read))
    }
}

impl RecordReader<tokio::net::tcp::OwnedReadHalf> {
    /// From now on, this reader manages its socket's receive low-water mark
    /// ([`crate::lowat`]): before it waits, the mark is set to the bytes it still needs (for
    /// a direct read, the plaintext asked for less the ciphertext kept here, since the
    /// records carrying it are longer; else the rest of the partial record here), and after
    /// a read that returned bytes, to [`crate::lowat::BUSY`]. So a large read is woken once
    /// instead of every few segments.
    ///
    /// Only for a caller whose reads never ask for more plaintext than the peer is bound to
    /// send (a framed protocol reading the rest of a header or of a body whose length it
    /// knows, as transferd's frame reader does): a read asking for more than ever comes
    /// could otherwise wait until the connection ends.
    pub fn wake_in_batches(&mut self) {
        self.low_water = Some(crate::lowat::LowWater::of(&self.inner));
    }
}

impl<R: AsyncRead + Unpin> RecordReader<R> {
    /// Bytes still to come before the partial record at the front of the unprocessed bytes
    /// is whole: from its header's length once the header is here, else those of the
    /// shortest record (a header, one byte of content, its type and the tag).
    fn record_rest(&self) -> usize {
        let kept = &self.buf[self.start..self.end];
        let whole = match kept.first_chunk::<HEADER>() {
            Some(h) => HEADER + usize::from(u16::from_be_bytes([h[3], h[4]])),
            None => HEADER + 1 + 1 + TAG,
        };
        whole.saturating_sub(kept.len())
    }

    /// Sets the socket's receive low-water mark to `want` bytes where this reader manages
    /// it ([`RecordReader::wake_in_batches`]).
    fn low_water(&mut self, want: usize) {
        crate::lowat::set(&mut self.low_water, want);
    }

    /// The direct read: when the caller's buffer has room for many records (and nothing
    /// but a partial record is buffered here), the socket is read straight into it and the
    /// records are decrypted there, so the plaintext is never copied. The partial record
    /// is copied in front of the new bytes first, and whatever partial record ends them is
    /// copied back here (at most one record each way per read). `Ok(true)` when plaintext
    /// was produced or the stream was closed; `Ok(false)` when only part of a record came.
    fn poll_read_direct(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<bool>> {
        let room = out.initialized().len() - out.filled().len();
        let kept = self.end - self.start;
        let dst = out.initialize_unfilled_to(room);
        dst[..kept].copy_from_slice(&self.buf[self.start..self.end]);
        let mut rb = ReadBuf::new(&mut dst[kept..]);
        if Pin::new(&mut self.inner)
            .poll_read(cx, &mut rb)?
            .is_pending()
        {
            // Nothing to read: wait for the records of `room` bytes of plaintext, which
            // are longer than `room` and of which `kept` bytes are here.
            self.low_water(room.saturating_sub(kept));
            return Poll::Pending;
        }
        let n = rb.filled().len();
        // Busy with what came: no wake-ups for less than a large read until it waits.
        self.low_water(crate::lowat::BUSY);
        if n == 0 {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed connection without sending TLS close_notify",
            )));
        }
        let region = &mut dst[..kept + n];
        let (plain, read) = self.open_within(region)?;
        // What follows `close_notify` is ignored, as in `open_one`'s path.
        let rest = if self.closed {
            &[][..]
        } else {
            &region[read..]
        };
        self.buf[..rest.len()].copy_from_slice(rest);
        (self.start, self.end) = (0, rest.len());
        out.advance(plain);
        self.direct += plain as u64;
        Poll::Ready(Ok(plain > 0 || self.closed))
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for RecordReader<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.failed {
            return Poll::Ready(Err(bad_record("the stream failed earlier")));
        }
        loop {
            if me.plain.0 < me.plain.1 {
                let n = (me.plain.1 - me.plain.0).min(out.remaining());
                out.put_slice(&me.buf[me.plain.0..me.plain.0 + n]);
                me.plain.0 += n;
                return Poll::Ready(Ok(()));
            }
            if me.closed {
                return Poll::Ready(Ok(()));
            }
            match me.open_one() {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    me.failed = true;
                    return Poll::Ready(Err(e));
                }
            }
            // Nothing but a partial record is buffered here now.
            if out.initialized().len() - out.filled().len() >= DIRECT_READ {
                match ready!(me.poll_read_direct(cx, out)) {
                    Ok(true) => return Poll::Ready(Ok(())),
                    Ok(false) => continue,
                    Err(e) => {
                        me.failed = true;
                        return Poll::Ready(Err(e));
                    }
                }
            }
            // A partial record at most: move it to the front when the room behind it is
            // less than a whole record, then read more.
            if me.buf.len() - me.end < HEADER + MAX_CIPHERTEXT {
                me.buf.copy_within(me.start..me.end, 0);
                me.end -= me.start;
                me.start = 0;
            }
            // A small read (a frame's header) takes at most one more record from the
            // socket, so that what follows it (a chunk's body) stays there for a direct
            // read into the body's buffer instead of being decrypted here and copied.
            let limit = if out.remaining() < DIRECT_READ {
                (me.end + HEADER + MAX_CIPHERTEXT).min(me.buf.len())
            } else {
                me.buf.len()
            };
            let mut rb = ReadBuf::new(&mut me.buf[me.end..limit]);
            if Pin::new(&mut me.inner).poll_read(cx, &mut rb)?.is_pending() {
                // Nothing to read: wait for the rest of the partial record here (or for a
                // whole record of the shortest kind), nothing comes out before it.
                let want = me.record_rest();
                me.low_water(want);
                return Poll::Pending;
            }
            let n = rb.filled().len();
            me.low_water(crate::lowat::BUSY);
            if n == 0 {
                me.failed = true;
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed connection without sending TLS close_notify",
                )));
            }
            me.end += n;
        }
    }
}

impl<W> RecordWriter<W> {
    /// Appends one record of `content` (at most [`MAX_PLAINTEXT`] bytes) of type `ty`,
    /// sealed from `content` into the buffer (no copy of the plaintext first).
    fn seal(&mut self, ty: u8, content: &[u8]) -> io::Result<()> {
        let nonce = self.dir.next_nonce()?;
        let len = content.len() + 1 + TAG;
        let len16 = u16::try_from(len).map_err(|_| bad_record("record too long"))?;
        let [hi, lo] = len16.to_be_bytes();
        let header = [APPLICATION_DATA, 0x03, 0x03, hi, lo];
        // Records already written out are dropped from the front (all at once when none
        // is left, else once they are half the buffer), so it stays bounded.
        if self.sent == self.end {
            (self.sent, self.end) = (0, 0);
        } else if self.sent >= WRITE_BUFFER / 2 {
            self.out.copy_within(self.sent..self.end, 0);
            (self.sent, self.end) = (0, self.end - self.sent);
        }
        let record = HEADER + len;
        if self.out.len() < self.end + record {
            self.out.resize(self.end + record, 0);
        }
        let (head, body) = self.out[self.end..self.end + record].split_at_mut(HEADER);
        head.copy_from_slice(&header);
        let (ciphertext, type_and_tag) = body.split_at_mut(content.len());
        self.dir
            .key
            .seal_out_of_place_scatter(
                nonce,
                Aad::from(header),
                content,
                ciphertext,
                &[ty],
                type_and_tag,
            )
            .map_err(|_| io::Error::other("TLS record encryption failed"))?;
        self.end += record;
        Ok(())
    }
}

impl<W: AsyncWrite + Unpin> RecordWriter<W> {
    /// Writes out the queued records; `Ready(Ok)` once none is left.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.end {
            let n =
                ready!(Pin::new(&mut self.inner).poll_write(cx, &self.out[self.sent..self.end]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        (self.sent, self.end) = (0, 0);
        Poll::Ready(Ok(()))
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for RecordWriter<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        if me.closing {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        // Room for at least one more record, else write out what is queued first.
        if me.end - me.sent >= WRITE_BUFFER {
            ready!(me.poll_drain(cx))?;
        }
        let mut taken = 0;
        while taken < buf.len() && me.end - me.sent < WRITE_BUFFER {
            let n = (buf.len() - taken).min(MAX_PLAINTEXT);
            me.seal(APPLICATION_DATA, &buf[taken..taken + n])?;
            taken += n;
        }
        // Start sending; what the socket does not take now goes with the next write or
        // the flush.
        if let Poll::Ready(Err(e)) = me.poll_drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(taken))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        ready!(me.poll_drain(cx))?;
        Pin::new(&mut me.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if !me.closing {
            ready!(me.poll_drain(cx))?;
            // close_notify: a warning-level alert, description 0.
            me.seal(ALERT, &[1, 0])?;
            me.closing = true;
        }
        ready!(me.poll_drain(cx))?;
        Pin::new(&mut me.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::crypto::cipher::{AeadKey, Iv};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn secrets(seed: u8) -> rustls::ExtractedSecrets {
        let keys = |s: u8| ConnectionTrafficSecrets::Aes256Gcm {
            key: AeadKey::from([s; 32]),
            iv: Iv::new([s.wrapping_add(1); 12]),
        };
        rustls::ExtractedSecrets {
            tx: (0, keys(seed)),
            rx: (0, keys(seed)),
        }
    }

    /// Records written to a buffer, the buffer handed to a reader with the same keys.
    async fn sealed(data: &[u8], close: bool) -> Vec<u8> {
        let (_, mut w) = split(tokio::io::empty(), Vec::new(), secrets(7)).unwrap();
        w.write_all(data).await.unwrap();
        if close {
            w.shutdown().await.unwrap();
        } else {
            w.flush().await.unwrap();
        }
        std::mem::take(&mut w.inner)
    }

    fn reader(wire: Vec<u8>) -> RecordReader<std::io::Cursor<Vec<u8>>> {
        split(std::io::Cursor::new(wire), tokio::io::sink(), secrets(7))
            .unwrap()
            .0
    }

    /// The writer's records are byte for byte what sealing in place (RFC 8446 section 5.2:
    /// the content, its type byte, then the tag) gives with ring, the library rustls uses,
    /// for the same key, IV and sequence numbers: a peer's TLS stack reads them.
    #[tokio::test]
    async fn records_sealed_out_of_place_equal_records_sealed_in_place_by_ring() {
        let data: Vec<u8> = (0..MAX_PLAINTEXT * 2 + 1000)
            .map(|i| (i * 7 % 253) as u8)
            .collect();
        let wire = sealed(&data, true).await;
        let key = ring::aead::LessSafeKey::new(
            ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &[7; 32]).unwrap(),
        );
        let mut expect = Vec::new();
        let pieces = data.chunks(MAX_PLAINTEXT).map(|c| (APPLICATION_DATA, c));
        for (seq, (ty, content)) in pieces.chain([(ALERT, &[1u8, 0][..])]).enumerate() {
            let mut nonce = [8u8; 12];
            for (b, s) in nonce[4..].iter_mut().zip((seq as u64).to_be_bytes()) {
                *b ^= s;
            }
            let [hi, lo] = u16::try_from(content.len() + 1 + TAG)
                .unwrap()
                .to_be_bytes();
            let header = [APPLICATION_DATA, 3, 3, hi, lo];
            let mut body = [content, &[ty]].concat();
            let nonce = ring::aead::Nonce::assume_unique_for_key(nonce);
            let aad = ring::aead::Aad::from(header);
            key.seal_in_place_append_tag(nonce, aad, &mut body).unwrap();
            expect.extend_from_slice(&header);
            expect.extend_from_slice(&body);
        }
        assert_eq!(wire.len(), expect.len());
        assert!(wire == expect, "the sealed records differ from ring's");
    }

    #[tokio::test]
    async fn records_round_trip_and_close_notify_ends_the_stream() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let wire = sealed(&data, true).await;
        // 7 records of at most 16 KiB, each 5 + 1 + 16 bytes longer; the alert's record.
        assert_eq!(wire.len(), data.len() + 7 * 22 + (5 + 2 + 1 + 16));
        let mut r = reader(wire);
        let mut back = Vec::new();
        r.read_to_end(&mut back).await.unwrap();
        assert!(back == data);
    }

    #[tokio::test]
    async fn a_flipped_byte_fails_the_record_and_the_stream_stays_failed() {
        let mut wire = sealed(&[42u8; 40_000], true).await;
        wire[20_000] ^= 1;
        let mut r = reader(wire);
        let mut back = Vec::new();
        let e = r.read_to_end(&mut back).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("bad record MAC"), "{e}");
        // The first record (before the flip) was delivered; nothing after it.
        assert_eq!(back.len(), MAX_PLAINTEXT);
        let mut more = [0u8; 1];
        assert!(r.read(&mut more).await.is_err());
    }

    #[tokio::test]
    async fn an_end_without_close_notify_is_an_error_not_a_clean_end() {
        let wire = sealed(&[1u8; 1000], false).await;
        let mut r = reader(wire);
        let mut back = Vec::new();
        let e = r.read_to_end(&mut back).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(back.len(), 1000);
    }

    #[tokio::test]
    async fn malformed_headers_and_other_keys_are_refused() {
        // Not application data.
        let mut wire = sealed(b"abc", true).await;
        wire[0] = 0x16;
        let e = reader(wire).read(&mut [0u8; 8]).await.unwrap_err();
        assert!(
            e.to_string().contains("not an application-data record"),
            "{e}"
        );
        // A length beyond 2^14 + 256.
        let mut wire = sealed(b"abc", true).await;
        wire[3] = 0x50;
        let e = reader(wire).read(&mut [0u8; 8]).await.unwrap_err();
        assert!(e.to_string().contains("length out of bounds"), "{e}");
        // Records of another key.
        let (_, mut w) = split(tokio::io::empty(), Vec::new(), secrets(9)).unwrap();
        w.write_all(b"abc").await.unwrap();
        w.flush().await.unwrap();
        let e = reader(std::mem::take(&mut w.inner))
            .read(&mut [0u8; 8])
            .await
            .unwrap_err();
        assert!(e.to_string().contains("bad record MAC"), "{e}");
    }

    /// A stream that hands out its bytes in pieces of the given sizes, in turn.
    struct Pieces {
        data: Vec<u8>,
        at: usize,
        sizes: Vec<usize>,
        turn: usize,
    }

    impl AsyncRead for Pieces {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            out: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let me = self.get_mut();
            let size = me.sizes[me.turn % me.sizes.len()];
            me.turn += 1;
            let n = size.min(me.data.len() - me.at).min(out.remaining());
            out.put_slice(&me.data[me.at..me.at + n]);
            me.at += n;
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn direct_reads_into_large_buffers_give_the_same_bytes_however_the_socket_splits_them() {
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 253) as u8).collect();
        let wire = sealed(&data, true).await;
        // Pieces smaller than a record, a record and a bit, many records; reads into
        // large buffers (the direct path) and small ones (the buffered path) in turn.
        for (sizes, direct_share) in [
            (vec![1000, 70_000, 5, 300_000, 16_406, 16_405], 0.3),
            (vec![1 << 20], 0.6),
            (vec![3, 7, 16_000], 0.3),
        ] {
            let (mut r, _) = split(
                Pieces {
                    data: wire.clone(),
                    at: 0,
                    sizes,
                    turn: 0,
                },
                tokio::io::sink(),
                secrets(7),
            )
            .unwrap();
            let mut back = Vec::new();
            let mut big = vec![0u8; 256 << 10];
            let mut small = [0u8; 100];
            for turn in 0.. {
                let buf: &mut [u8] = if turn % 3 == 2 { &mut small } else { &mut big };
                let n = r.read(buf).await.unwrap();
                if n == 0 {
                    break;
                }
                back.extend_from_slice(&buf[..n]);
            }
            assert!(back == data, "{} of {} bytes back", back.len(), data.len());
            // Two reads in three had room for the direct path.
            assert!(
                r.direct as f64 >= direct_share * data.len() as f64,
                "{} bytes read directly",
                r.direct
            );
        }
    }

    /// Over a real socket with the low-water mark managed: a reader of exact amounts (a
    /// frame's header, then its body) gets every byte, a small read after a large one
    /// never waits for more than its record (the mark is lowered before each wait), and
    /// a 240 000-byte body sealed and sent in fifteen paced writes is woken for in at
    /// most three reads.
    #[tokio::test]
    async fn a_reader_of_exact_amounts_over_a_socket_is_woken_per_body_and_never_stalls() {
        let (c, a) = crate::lowat::socket_pair().await;
        let (read, _) = a.into_split();
        let (_, write) = c.into_split();
        let (mut r, _) = split(read, tokio::io::sink(), secrets(7)).unwrap();
        r.wake_in_batches();
        let (_, mut w) = split(tokio::io::empty(), write, secrets(7)).unwrap();
        let data: Vec<u8> = (0..500_000u32).map(|i| (i * 13 % 249) as u8).collect();
        let send = data.clone();
        let sender = tokio::spawn(async move {
            // A 5-byte "header", a 240 000-byte "body" in paced pieces, a header and a
            // one-byte body each after a pause, then the rest at once.
            w.write_all(&send[..5]).await.unwrap();
            w.flush().await.unwrap();
            for piece in send[5..240_005].chunks(16_000) {
                w.write_all(piece).await.unwrap();
                w.flush().await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            for piece in [&send[240_005..240_010], &send[240_010..240_011]] {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                w.write_all(piece).await.unwrap();
                w.flush().await.unwrap();
            }
            w.write_all(&send[240_011..]).await.unwrap();
            w.shutdown().await.unwrap();
        });
        let mut got = vec![0u8; data.len()];
        let body_reads = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            crate::lowat::read_exact_counted(&mut r, &mut got[..5]).await;
            let body = crate::lowat::read_exact_counted(&mut r, &mut got[5..240_005]).await;
            crate::lowat::read_exact_counted(&mut r, &mut got[240_005..240_010]).await;
            crate::lowat::read_exact_counted(&mut r, &mut got[240_010..240_011]).await;
            crate::lowat::read_exact_counted(&mut r, &mut got[240_011..]).await;
            body
        })
        .await
        .expect("a read waited past the bytes it asked for");
        assert!(got == data, "the bytes read differ from those sent");
        assert!(
            body_reads <= 3,
            "a body sent in fifteen paced writes took {body_reads} reads: the mark did not hold"
        );
        let mut rest = [0u8; 10];
        assert_eq!(r.read(&mut rest).await.unwrap(), 0, "close_notify ends it");
        sender.await.unwrap();
    }

    #[tokio::test]
    async fn a_flipped_byte_fails_a_direct_read_and_the_stream_stays_failed() {
        let mut wire = sealed(&[42u8; 200_000], true).await;
        wire[150_000] ^= 1;
        let mut r = reader(wire);
        let mut big = vec![0u8; 1 << 20];
        let mut got = 0;
        let e = loop {
            match r.read(&mut big).await {
                Ok(n) => got += n,
                Err(e) => break e,
            }
        };
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("bad record MAC"), "{e}");
        assert!(got < 150_000, "{got} bytes delivered");
        assert!(r.read(&mut big).await.is_err());
    }

    #[test]
    fn nonces_follow_the_sequence_and_the_key_stops_at_its_limit() {
        let (_, mut w) = split(tokio::io::empty(), Vec::<u8>::new(), secrets(3)).unwrap();
        w.dir.seq = RECORD_LIMIT - 1;
        assert!(w.seal(APPLICATION_DATA, b"x").is_ok());
        let e = w.seal(APPLICATION_DATA, b"y").unwrap_err();
        assert!(e.to_string().contains("dial again"), "{e}");
    }
}
