//! How fast one fresh shard file on a tmpfs is written in 1 MiB chunks by several threads
//! at once, by each way the store can write it: `pwrite` queued on a lock (the `pwrite`
//! writer), `pwrite` from every thread (the kernel's inode lock serialises them), copies
//! into a shared writable map (a page fault per page), and copies after
//! `MADV_POPULATE_WRITE` (the `mapped` writer). Issue #28: a striped shard is written by
//! several threads at once.
//!
//! ```sh
//! cargo run --release -p transferd --example file_write_rate -- /dev/shm 2 1,2,4,8,16
//! #                                                              dir  GiB threads
//! ```
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

const CHUNK: usize = 1 << 20;
const METHODS: [&str; 4] = ["pwrite-queued", "pwrite", "map", "populate+map"];

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).map_or("/dev/shm", String::as_str).to_owned();
    let gib: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let threads: Vec<usize> = args
        .get(3)
        .map_or("1,2", String::as_str)
        .split(',')
        .filter_map(|x| x.parse().ok())
        .collect();
    let len = gib << 30;
    let src: Arc<Vec<u8>> = Arc::new((0..CHUNK).map(|i| (i * 31 + 7) as u8).collect());
    for &n in &threads {
        for method in METHODS {
            let path = format!("{dir}/file-write-rate-{}-{method}-{n}", std::process::id());
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)?;
            f.set_len(len as u64)?;
            let f = Arc::new(f);
            // SAFETY: a fresh shared map of the whole file, which this program alone uses and
            // unmaps below after every thread has joined.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    f.as_raw_fd(),
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error());
            }
            let base = base as usize;
            let next = Arc::new(AtomicUsize::new(0));
            let queue = Arc::new(Mutex::new(()));
            let t0 = Instant::now();
            let workers: Vec<_> = (0..n)
                .map(|_| {
                    let (f, next, queue, src) =
                        (f.clone(), next.clone(), queue.clone(), src.clone());
                    std::thread::spawn(move || -> std::io::Result<()> {
                        loop {
                            let off = next.fetch_add(1, Ordering::Relaxed) * CHUNK;
                            if off >= len {
                                return Ok(());
                            }
                            let at = (base + off) as *mut u8;
                            match method {
                                "pwrite-queued" => {
                                    let _q = queue
                                        .lock()
                                        .map_err(|_| std::io::Error::other("poisoned"))?;
                                    f.write_all_at(&src, off as u64)?;
                                }
                                "pwrite" => f.write_all_at(&src, off as u64)?,
                                _ => {
                                    if method == "populate+map" {
                                        // SAFETY: a range inside the map.
                                        let r = unsafe {
                                            libc::madvise(
                                                at.cast(),
                                                CHUNK,
                                                libc::MADV_POPULATE_WRITE,
                                            )
                                        };
                                        if r != 0 {
                                            return Err(std::io::Error::last_os_error());
                                        }
                                    }
                                    // SAFETY: each chunk's range is inside the map and given
                                    // to one thread only (the counter); `src` is not in it.
                                    unsafe {
                                        std::ptr::copy_nonoverlapping(src.as_ptr(), at, CHUNK)
                                    };
                                }
                            }
                        }
                    })
                })
                .collect();
            for w in workers {
                w.join()
                    .map_err(|_| std::io::Error::other("a writer panicked"))??;
            }
            let s = t0.elapsed().as_secs_f64();
            println!("{method:>14} threads {n:>2}: {:6.2} GiB/s", gib as f64 / s);
            // SAFETY: the map made above; no thread uses it any more.
            unsafe { libc::munmap(base as *mut libc::c_void, len) };
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}
