//! The io_uring chunk writer (Linux only).
//!
//! ```text
//!  async callers ──(std mpsc: WriteRequest)──▶ ring thread ──SQE──▶ kernel
//!        ▲                                          │
//!        └──────────(oneshot: io::Result<()>)───────┘◀──CQE──
//! ```
//!
//! One dedicated OS thread owns the ring. It blocks on the request channel while nothing is
//! in flight; otherwise it drains whatever requests are queued, submits them and waits for
//! at least one completion. Every in-flight request keeps its file (`Arc<File>`) and its
//! buffer (`Bytes`) in the thread's table until the kernel has reported the completion, so
//! the kernel never sees a closed descriptor or freed memory. Short writes are resubmitted
//! for the remainder. When every sender is gone and nothing is in flight, the thread exits.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::mpsc;

use bytes::Bytes;
use io_uring::{IoUring, opcode, types};
use tokio::sync::oneshot;

/// Submission queue entries. Rationale: the store writes chunks of about 1 MiB with a
/// handful in flight per shard and a few shards at once; 256 entries is far above that, and
/// the ring's memory (a few tens of KiB) is negligible.
const RING_ENTRIES: u32 = 256;

/// Largest length passed in one SQE; longer buffers are written in pieces (the SQE length
/// field is a `u32`). 1 GiB keeps every piece well inside it.
const MAX_SQE_LEN: usize = 1 << 30;

/// One positional write handed to the ring thread.
struct WriteRequest {
    file: Arc<File>,
    offset: u64,
    data: Bytes,
    done: oneshot::Sender<io::Result<()>>,
}

/// A request the kernel currently owns: its file and buffer stay alive here until the CQE.
struct InFlight {
    req: WriteRequest,
    /// Bytes of `req.data` already written by earlier completions.
    written: usize,
}

/// Handle to the ring thread. Dropping it lets the thread finish in-flight writes and exit.
pub(super) struct UringWriter {
    tx: mpsc::Sender<WriteRequest>,
}

impl UringWriter {
    /// Sets up a ring and starts its thread. Fails where io_uring is unavailable (old kernel,
    /// seccomp filter, `io_uring_disabled` sysctl).
    pub(super) fn new() -> io::Result<Self> {
        let ring = IoUring::new(RING_ENTRIES)?;
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("store-uring".into())
            .spawn(move || run(ring, rx))?;
        Ok(Self { tx })
    }

    /// Writes all of `data` at `offset` of `file`.
    pub(super) async fn write_at(
        &self,
        file: Arc<File>,
        offset: u64,
        data: Bytes,
    ) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let (done, rx) = oneshot::channel();
        self.tx
            .send(WriteRequest {
                file,
                offset,
                data,
                done,
            })
            .map_err(|_| io::Error::other("io_uring writer thread has stopped"))?;
        rx.await
            .map_err(|_| io::Error::other("io_uring writer thread dropped a request"))?
    }
}

/// The ring thread's loop.
fn run(mut ring: IoUring, rx: mpsc::Receiver<WriteRequest>) {
    let mut in_flight: HashMap<u64, InFlight> = HashMap::new();
    let mut next_id: u64 = 0;
    // Never let more requests be in flight than the completion queue holds.
    let sq_cap = ring.submission().capacity();
    let cap = ring.completion().capacity().min(sq_cap * 2);
    let mut senders_gone = false;
    loop {
        if in_flight.is_empty() {
            if senders_gone {
                return;
            }
            match rx.recv() {
                Ok(req) => submit(&mut ring, &mut in_flight, &mut next_id, req, 0),
                Err(mpsc::RecvError) => return,
            }
        }
        while in_flight.len() < cap && !senders_gone {
            match rx.try_recv() {
                Ok(req) => submit(&mut ring, &mut in_flight, &mut next_id, req, 0),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => senders_gone = true,
            }
        }
        if in_flight.is_empty() {
            continue;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            // EBUSY: the completion queue is full; reap below, then submit again.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
            Err(e) => {
                tracing::error!(error = %e, "io_uring submit failed; stopping the ring thread");
                abandon(in_flight, &e);
                return;
            }
        }
        reap(&mut ring, &mut in_flight, &mut next_id);
    }
}

/// Queues the unwritten part (from `written`) of `req` as one SQE.
fn submit(
    ring: &mut IoUring,
    in_flight: &mut HashMap<u64, InFlight>,
    next_id: &mut u64,
    req: WriteRequest,
    written: usize,
) {
    let id = *next_id;
    *next_id = next_id.wrapping_add(1);
    let rest = &req.data[written..];
    let len = rest.len().min(MAX_SQE_LEN) as u32;
    let sqe = opcode::Write::new(types::Fd(req.file.as_raw_fd()), rest.as_ptr(), len)
        .offset(req.offset + written as u64)
        .build()
        .user_data(id);
    // Make room: a full submission queue is flushed to the kernel first.
    while ring.submission().is_full() {
        if let Err(e) = ring.submit() {
            if e.raw_os_error() != Some(libc::EINTR) && e.raw_os_error() != Some(libc::EBUSY) {
                let _ = req.done.send(Err(e));
                return;
            }
            reap(ring, in_flight, next_id);
        }
    }
    // SAFETY: the SQE points at `rest` (inside `req.data`) and at `req.file`'s descriptor.
    // Both are owned by `req`, which is moved into `in_flight` under `id` right below and
    // stays there until the CQE with `id` has been reaped (or is leaked by `abandon`), so the
    // buffer and the descriptor outlive the kernel's use of them. `Bytes` never moves its
    // heap data when the handle moves.
    let pushed = unsafe { ring.submission().push(&sqe) };
    match pushed {
        Ok(()) => {
            in_flight.insert(id, InFlight { req, written });
        }
        Err(_) => {
            // Unreachable in practice: we made room above.
            let _ = req
                .done
                .send(Err(io::Error::other("io_uring submission queue full")));
        }
    }
}

/// Handles every available completion.
fn reap(ring: &mut IoUring, in_flight: &mut HashMap<u64, InFlight>, next_id: &mut u64) {
    let cqes: Vec<(u64, i32)> = ring
        .completion()
        .map(|c| (c.user_data(), c.result()))
        .collect();
    for (id, res) in cqes {
        let Some(mut f) = in_flight.remove(&id) else {
            tracing::warn!(id, "io_uring completion for an unknown request");
            continue;
        };
        if res < 0 {
            let _ = f.req.done.send(Err(io::Error::from_raw_os_error(-res)));
            continue;
        }
        if res == 0 {
            let _ = f
                .req
                .done
                .send(Err(io::Error::from(io::ErrorKind::WriteZero)));
            continue;
        }
        f.written += res as usize;
        if f.written >= f.req.data.len() {
            let _ = f.req.done.send(Ok(()));
        } else {
            submit(ring, in_flight, next_id, f.req, f.written);
        }
    }
}

/// The ring is unusable and the kernel may still own the in-flight buffers: fail every
/// request but leak its buffer and file so that no memory the kernel might touch is freed.
fn abandon(in_flight: HashMap<u64, InFlight>, e: &io::Error) {
    for (_, f) in in_flight {
        let InFlight { req, .. } = f;
        let WriteRequest {
            file, data, done, ..
        } = req;
        let _ = done.send(Err(io::Error::new(e.kind(), e.to_string())));
        std::mem::forget(file);
        std::mem::forget(data);
    }
}
