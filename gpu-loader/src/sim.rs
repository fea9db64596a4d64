//! The simulated device: a "GPU" whose memory is a file in a tmpfs directory, with copies that
//! really move the bytes and are paced to a configured PCIe rate (host → device) and NVLink
//! rate (device → device). Every path of the loader runs on it on machines without GPUs.
//!
//! It cannot be mistaken for a GPU: its kind is [`DeviceKind::Simulated`], its name is
//! `simulated GPU <n>`, and its hand-off is a file path, not a CUDA IPC handle.
//!
//! Each device has one copy worker thread (its "stream"): copies run in the order they were
//! issued, each paced so the stream never goes faster than the configured rate.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::device::{
    Completion, DevSpan, Device, DeviceInfo, DeviceKind, GpuError, IpcHandle, Staging,
};

/// Settings of the simulated devices of one host.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// How many devices.
    pub gpus: u32,
    /// Memory of each, bytes.
    pub memory_bytes: u64,
    /// Host → device rate per device, bytes/s (PCIe).
    pub pcie_bps: u64,
    /// Device → device rate, bytes/s (NVLink); 0 = no peer path.
    pub nvlink_bps: u64,
    /// Devices per PCIe switch (pairs by default, like Torpor's testbed).
    pub per_switch: u32,
    /// Directory for the backing files (tmpfs, e.g. `/dev/shm/...`).
    pub dir: PathBuf,
}

impl SimOptions {
    /// `gpus` devices of `memory_bytes` each in `dir`, PCIe 4.0-like and NVLink-like rates
    /// scaled down by 100 (250 MB/s and 2.5 GB/s) so tests finish in seconds.
    pub fn new(dir: &Path, gpus: u32, memory_bytes: u64) -> Self {
        Self {
            gpus,
            memory_bytes,
            pcie_bps: 250_000_000,
            nvlink_bps: 2_500_000_000,
            per_switch: 2,
            dir: dir.to_path_buf(),
        }
    }
}

/// Paces a stream: each transfer of `n` bytes takes `n / rate`, back to back.
#[derive(Debug)]
struct Pacer {
    rate: u64,
    next_free: Option<Instant>,
}

impl Pacer {
    fn new(rate: u64) -> Self {
        Self {
            rate,
            next_free: None,
        }
    }

    /// Blocks until a transfer of `n` bytes, started now or when the previous one ended,
    /// would have finished at `rate`.
    fn pace(&mut self, n: u64) {
        if self.rate == 0 {
            return;
        }
        let now = Instant::now();
        let start = self.next_free.filter(|t| *t > now).unwrap_or(now);
        let end = start + Duration::from_secs_f64(n as f64 / self.rate as f64);
        self.next_free = Some(end);
        if let Some(wait) = end.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
}

enum Op {
    Htod {
        offset: u64,
        /// The staging buffer itself, shared (no copy): the loader does not touch it
        /// until the completion says the copy is done.
        data: Arc<Vec<u8>>,
        len: usize,
        done: mpsc::SyncSender<Result<(), GpuError>>,
    },
    Peer {
        offset: u64,
        src: Arc<File>,
        src_offset: u64,
        len: u64,
        done: mpsc::SyncSender<Result<(), GpuError>>,
    },
}

/// One simulated device.
pub struct SimDevice {
    info: DeviceInfo,
    path: PathBuf,
    file: Arc<File>,
    arena: Mutex<Option<DevSpan>>,
    stream: Mutex<mpsc::Sender<Op>>,
}

impl std::fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDevice")
            .field("info", &self.info)
            .finish()
    }
}

/// Creates the simulated devices (backing files `sim-gpu-<n>.mem` in `opts.dir`).
pub fn devices(opts: &SimOptions) -> Result<Vec<Arc<SimDevice>>, GpuError> {
    std::fs::create_dir_all(&opts.dir).map_err(|e| GpuError::Device {
        device: 0,
        message: format!("creating {}: {e}", opts.dir.display()),
    })?;
    let per_switch = opts.per_switch.max(1);
    let mut out = Vec::new();
    for i in 0..opts.gpus {
        let peers = if opts.nvlink_bps > 0 {
            (0..opts.gpus)
                .filter(|&j| j != i)
                .map(|j| (j, opts.nvlink_bps))
                .collect()
        } else {
            Vec::new()
        };
        let info = DeviceInfo {
            index: i,
            name: format!("simulated GPU {i}"),
            kind: DeviceKind::Simulated,
            memory_bytes: opts.memory_bytes,
            pcie_switch: format!("sim-switch-{}", i / per_switch),
            peers,
        };
        let path = opts.dir.join(format!("sim-gpu-{i}.mem"));
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| GpuError::Device {
                device: i,
                message: format!("creating {}: {e}", path.display()),
            })?;
        let file = Arc::new(file);
        let (tx, rx) = mpsc::channel::<Op>();
        let worker_file = file.clone();
        let (pcie, nvlink) = (opts.pcie_bps, opts.nvlink_bps);
        std::thread::Builder::new()
            .name(format!("sim-gpu-{i}-stream"))
            .spawn(move || stream_worker(i, worker_file, rx, pcie, nvlink))
            .map_err(|e| GpuError::Device {
                device: i,
                message: format!("starting the copy stream: {e}"),
            })?;
        out.push(Arc::new(SimDevice {
            info,
            path,
            file,
            arena: Mutex::new(None),
            stream: Mutex::new(tx),
        }));
    }
    Ok(out)
}

fn stream_worker(device: u32, file: Arc<File>, rx: mpsc::Receiver<Op>, pcie: u64, nvlink: u64) {
    let mut pcie = Pacer::new(pcie);
    let mut nvlink = Pacer::new(nvlink);
    let io = |what: &str, e: std::io::Error| GpuError::Device {
        device,
        message: format!("{what}: {e}"),
    };
    while let Ok(op) = rx.recv() {
        match op {
            Op::Htod {
                offset,
                data,
                len,
                done,
            } => {
                pcie.pace(len as u64);
                let r = match data.get(..len) {
                    Some(bytes) => file.write_all_at(bytes, offset).map_err(|e| io("write", e)),
                    None => Err(GpuError::Invalid("copy longer than its buffer".into())),
                };
                // Release the buffer before signalling, so the loader can refill it in
                // place.
                drop(data);
                let _ = done.send(r);
            }
            Op::Peer {
                offset,
                src,
                src_offset,
                len,
                done,
            } => {
                nvlink.pace(len);
                let r = (|| {
                    let n = usize::try_from(len).map_err(|_| GpuError::Invalid("len".into()))?;
                    let mut buf = vec![0u8; n];
                    src.read_exact_at(&mut buf, src_offset)
                        .map_err(|e| io("peer read", e))?;
                    file.write_all_at(&buf, offset)
                        .map_err(|e| io("peer write", e))
                })();
                let _ = done.send(r);
            }
        }
    }
}

/// A staging buffer shared with the copy thread while a copy is in flight (like pinned
/// memory the DMA engine reads).
struct SimStaging(Arc<Vec<u8>>);

impl Staging for SimStaging {
    fn capacity(&self) -> usize {
        self.0.len()
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // Unique once the copy completed (the loader waits for it first); if not, this
        // copies rather than racing the copy thread.
        Arc::make_mut(&mut self.0).as_mut_slice()
    }
    fn as_slice(&self) -> &[u8] {
        &self.0
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

struct SimCompletion(mpsc::Receiver<Result<(), GpuError>>, u32);

impl Completion for SimCompletion {
    fn wait(self: Box<Self>) -> Result<(), GpuError> {
        self.0.recv().unwrap_or_else(|_| {
            Err(GpuError::Device {
                device: self.1,
                message: "copy stream stopped".into(),
            })
        })
    }
}

impl SimDevice {
    /// The backing file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check(&self, span: DevSpan) -> Result<u64, GpuError> {
        if span.device != self.info.index {
            return Err(GpuError::Invalid(format!(
                "span of device {} used on device {}",
                span.device, self.info.index
            )));
        }
        let arena = self
            .arena
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ok_or_else(|| GpuError::Invalid("no arena allocated".into()))?;
        let end = span
            .offset
            .checked_add(span.len)
            .ok_or_else(|| GpuError::Invalid("span overflow".into()))?;
        if end > arena.len {
            return Err(GpuError::Invalid(format!(
                "span end {end} is past the arena ({} bytes)",
                arena.len
            )));
        }
        Ok(span.base + span.offset)
    }

    fn submit(&self, op: Op) -> Result<(), GpuError> {
        self.stream
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(op)
            .map_err(|_| GpuError::Device {
                device: self.info.index,
                message: "copy stream stopped".into(),
            })
    }
}

impl Device for SimDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn alloc_arena(&self, bytes: u64) -> Result<DevSpan, GpuError> {
        let mut arena = self.arena.lock().unwrap_or_else(PoisonError::into_inner);
        if arena.is_some() {
            return Err(GpuError::Invalid("the arena is already allocated".into()));
        }
        if bytes > self.info.memory_bytes {
            return Err(GpuError::OutOfMemory {
                device: self.info.index,
                requested: bytes,
                available: self.info.memory_bytes,
            });
        }
        // Allocate every page now, as cudaMalloc does: first-touch page faults on the copy
        // path would make the simulated PCIe rate depend on the host's page allocator.
        self.file.set_len(bytes).map_err(|e| GpuError::Device {
            device: self.info.index,
            message: format!("sizing {}: {e}", self.path.display()),
        })?;
        if let Err(e) =
            rustix::fs::fallocate(&*self.file, rustix::fs::FallocateFlags::empty(), 0, bytes)
        {
            tracing::warn!(
                device = self.info.index,
                "allocating simulated GPU memory: {e}"
            );
            return Err(GpuError::OutOfMemory {
                device: self.info.index,
                requested: bytes,
                available: 0,
            });
        }
        let span = DevSpan {
            device: self.info.index,
            base: 0,
            offset: 0,
            len: bytes,
        };
        *arena = Some(span);
        Ok(span)
    }

    fn alloc_staging(&self, bytes: usize) -> Result<Box<dyn Staging>, GpuError> {
        Ok(Box::new(SimStaging(Arc::new(vec![0u8; bytes]))))
    }

    fn copy_htod(&self, dst: DevSpan, src: &dyn Staging) -> Result<Box<dyn Completion>, GpuError> {
        let at = self.check(dst)?;
        let n = usize::try_from(dst.len).map_err(|_| GpuError::Invalid("len".into()))?;
        if n > src.capacity() {
            return Err(GpuError::Invalid(format!(
                "copy of {n} bytes from a staging buffer of {}",
                src.capacity()
            )));
        }
        // Our own staging buffers are shared with the copy thread; others are copied.
        let data = match src.as_any().downcast_ref::<SimStaging>() {
            Some(s) => s.0.clone(),
            None => Arc::new(src.as_slice()[..n].to_vec()),
        };
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(Op::Htod {
            offset: at,
            data,
            len: n,
            done: tx,
        })?;
        Ok(Box::new(SimCompletion(rx, self.info.index)))
    }

    fn copy_peer(
        &self,
        dst: DevSpan,
        src_device: &dyn Device,
        src: DevSpan,
    ) -> Result<Box<dyn Completion>, GpuError> {
        let other = src_device
            .as_any()
            .downcast_ref::<Self>()
            .ok_or_else(|| GpuError::Unsupported("peer copy across backends".into()))?;
        if !self.info.peers.iter().any(|(p, _)| *p == other.info.index) {
            return Err(GpuError::Unsupported(format!(
                "no peer path from device {} to {}",
                other.info.index, self.info.index
            )));
        }
        if dst.len != src.len {
            return Err(GpuError::Invalid("peer copy spans differ in length".into()));
        }
        let at = self.check(dst)?;
        let from = other.check(src)?;
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(Op::Peer {
            offset: at,
            src: other.file.clone(),
            src_offset: from,
            len: dst.len,
            done: tx,
        })?;
        Ok(Box::new(SimCompletion(rx, self.info.index)))
    }

    fn read(&self, src: DevSpan) -> Result<Vec<u8>, GpuError> {
        let at = self.check(src)?;
        let n = usize::try_from(src.len).map_err(|_| GpuError::Invalid("len".into()))?;
        let mut buf = vec![0u8; n];
        self.file
            .read_exact_at(&mut buf, at)
            .map_err(|e| GpuError::Device {
                device: self.info.index,
                message: format!("read: {e}"),
            })?;
        Ok(buf)
    }

    fn ipc_handle(&self, span: DevSpan) -> Result<IpcHandle, GpuError> {
        self.check(span)?;
        Ok(IpcHandle::SimulatedFile {
            path: self.path.display().to_string(),
            offset: span.base + span.offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_land_and_are_paced() {
        let dir = tempfile::tempdir().unwrap();
        let mut o = SimOptions::new(dir.path(), 2, 64 << 20);
        o.pcie_bps = 100 << 20;
        o.nvlink_bps = 400 << 20;
        let devs = devices(&o).unwrap();
        assert_eq!(devs[0].info().kind, DeviceKind::Simulated);
        assert!(devs[0].info().name.starts_with("simulated"));
        let a0 = devs[0].alloc_arena(32 << 20).unwrap();
        let a1 = devs[1].alloc_arena(32 << 20).unwrap();
        let mut st = devs[0].alloc_staging(4 << 20).unwrap();
        for (i, b) in st.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let t = Instant::now();
        let mut waits = Vec::new();
        for k in 0..5u64 {
            waits.push(
                devs[0]
                    .copy_htod(a0.sub(k << 22, 4 << 20).unwrap(), &*st)
                    .unwrap(),
            );
        }
        for w in waits {
            w.wait().unwrap();
        }
        // 20 MiB at 100 MiB/s: about 0.2 s.
        let took = t.elapsed().as_secs_f64();
        assert!((0.18..0.6).contains(&took), "{took}");
        let back = devs[0].read(a0.sub(3 << 22, 4 << 20).unwrap()).unwrap();
        assert_eq!(back, st.as_slice());
        let p = devs[1]
            .copy_peer(
                a1.sub(0, 4 << 20).unwrap(),
                &*devs[0],
                a0.sub(0, 4 << 20).unwrap(),
            )
            .unwrap();
        p.wait().unwrap();
        assert_eq!(
            devs[1].read(a1.sub(0, 4 << 20).unwrap()).unwrap(),
            st.as_slice()
        );
        // Out of range, wrong device, too much memory: errors, not panics.
        assert!(
            devs[0]
                .read(a0.sub(0, 1).unwrap().sub(0, 2).unwrap_or(a0))
                .is_ok()
        );
        assert!(devs[0].copy_htod(a1.sub(0, 16).unwrap(), &*st).is_err());
        assert!(matches!(devs[1].alloc_arena(1), Err(GpuError::Invalid(_))));
        let other = tempfile::tempdir().unwrap();
        let big = devices(&SimOptions::new(other.path(), 1, 1 << 20)).unwrap();
        assert!(matches!(
            big[0].alloc_arena(2 << 20),
            Err(GpuError::OutOfMemory { .. })
        ));
        assert!(matches!(
            devs[0].ipc_handle(a0.sub(8, 8).unwrap()).unwrap(),
            IpcHandle::SimulatedFile { offset: 8, .. }
        ));
    }
}
