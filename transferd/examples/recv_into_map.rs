//! What a receiving hop would save by reading chunk payloads from the socket straight into
//! the shard file's map instead of into a reused buffer that is then `pwrite`n (issue #28:
//! the `pwrite` copy, R6 in `transferd::chain`'s table, is a receiver's one copy beyond
//! the kernel's). A sender thread streams `GiB` over loopback TCP in 1 MiB chunks; the
//! receiver stores them in a tmpfs file whose pages already exist (as the memory reserve
//! leaves them), each way in turn, and the receiving thread's CPU time is reported:
//!
//! * `buffer+pwrite`: reads into one reused 1 MiB buffer, then `pwrite`s the chunk (today's
//!   path without TLS: the frame body, then the store's write);
//! * `map`: `MADV_POPULATE_WRITE` over the chunk's range of a shared writable map, then
//!   reads straight into it;
//! * `premapped`: reads straight into a map whose page tables were filled before the clock
//!   started (as the memory reserve's filler fills a spare's while the host is idle);
//! * `buffer+premapped`: reads into the reused buffer, then copies the chunk into such a map
//!   (today's path into a spare: `store::map::WritableMap::premapped`).
//!
//! ```sh
//! cargo run --release -p transferd --example recv_into_map -- /dev/shm 2 3
//! #                                                           dir  GiB rounds
//! ```
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::time::Instant;

const CHUNK: usize = 1 << 20;
/// The frame reader's largest read (`transferd::wire`).
const READ_PIECE: usize = 256 << 10;

/// CPU seconds (user, system) of the calling thread.
fn thread_cpu() -> (f64, f64) {
    // SAFETY: getrusage writes the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (s(ru.ru_utime), s(ru.ru_stime))
}

fn send(addr: std::net::SocketAddr, len: usize) -> std::io::Result<()> {
    let mut s = TcpStream::connect(addr)?;
    let src: Vec<u8> = (0..CHUNK).map(|i| (i * 31 + 7) as u8).collect();
    for _ in 0..len / CHUNK {
        s.write_all(&src)?;
    }
    Ok(())
}

/// Reads exactly `dst.len()` bytes in pieces of at most [`READ_PIECE`].
fn read_chunk(s: &mut TcpStream, dst: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < dst.len() {
        let end = (filled + READ_PIECE).min(dst.len());
        let n = s.read(&mut dst[filled..end])?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        filled += n;
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).map_or("/dev/shm", String::as_str).to_owned();
    let gib: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let rounds: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1);
    let len = gib << 30;
    let path = format!("{dir}/recv-into-map-{}", std::process::id());
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)?;
    // Every page allocated and touched first, as a spare of the memory reserve.
    let zeroes = vec![0u8; CHUNK];
    for i in 0..len / CHUNK {
        f.write_all_at(&zeroes, (i * CHUNK) as u64)?;
    }
    println!(
        "method,round,seconds,gb_per_s,recv_user_s_per_gb,recv_sys_s_per_gb,recv_cpu_s_per_gb"
    );
    for round in 1..=rounds {
        for method in ["buffer+pwrite", "map", "premapped", "buffer+premapped"] {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            let addr = listener.local_addr()?;
            let sender = std::thread::spawn(move || send(addr, len));
            let (mut s, _) = listener.accept()?;
            // `premapped`: the map and its page tables made before the clock starts, as
            // a spare's could be while the host is idle.
            let premapped = if method.ends_with("premapped") {
                let map = memmap2::MmapOptions::new().len(len).map_raw(&f)?;
                map.advise(memmap2::Advice::PopulateWrite)?;
                Some(map)
            } else {
                None
            };
            let t0 = Instant::now();
            let (u0, s0) = thread_cpu();
            // A new map each run, as each new shard gets one (its page tables filled anew).
            let map = match premapped {
                Some(map) => map,
                None => memmap2::MmapOptions::new().len(len).map_raw(&f)?,
            };
            let base = map.as_mut_ptr();
            let mut buf = vec![0u8; CHUNK];
            for i in 0..len / CHUNK {
                let off = i * CHUNK;
                match method {
                    "map" | "premapped" => {
                        // SAFETY: `off..off + CHUNK` lies inside the map; only this thread
                        // touches it.
                        let dst = unsafe { std::slice::from_raw_parts_mut(base.add(off), CHUNK) };
                        if method == "map" {
                            map.advise_range(memmap2::Advice::PopulateWrite, off, CHUNK)?;
                        }
                        read_chunk(&mut s, dst)?;
                    }
                    "buffer+premapped" => {
                        read_chunk(&mut s, &mut buf)?;
                        // SAFETY: as above; `buf` is a separate allocation.
                        unsafe {
                            std::ptr::copy_nonoverlapping(buf.as_ptr(), base.add(off), CHUNK)
                        };
                    }
                    _ => {
                        read_chunk(&mut s, &mut buf)?;
                        f.write_all_at(&buf, off as u64)?;
                    }
                }
            }
            drop(map);
            let secs = t0.elapsed().as_secs_f64();
            let (u1, s1) = thread_cpu();
            sender
                .join()
                .map_err(|_| std::io::Error::other("sender panicked"))??;
            let gb = len as f64 / 1e9;
            println!(
                "{method},{round},{secs:.3},{:.2},{:.3},{:.3},{:.3}",
                gb / secs,
                (u1 - u0) / gb,
                (s1 - s0) / gb,
                (u1 - u0 + s1 - s0) / gb
            );
        }
    }
    drop(f);
    std::fs::remove_file(&path)
}
