//! The simulated device: a "GPU" whose memory is files in a tmpfs directory, one file per
//! region (made by [`Device::alloc_region`], removed by [`Device::free_region`], so the
//! host's memory is taken only while a model is loaded), with copies that really move the
//! bytes and are paced to a configured PCIe rate (host → device) and NVLink rate (device →
//! device). Every path of the loader runs on it on machines without GPUs.
//!
//! It cannot be mistaken for a GPU: its kind is [`DeviceKind::Simulated`], its name is
//! `simulated GPU <n>`, and its hand-off is a file path, not a CUDA IPC handle.
//!
//! Each device has one copy worker thread (its "stream"): copies run in the order they were
//! issued, each paced so the stream never goes faster than the configured rate. Memory held
//! by other processes (an inference engine on the same GPU) can be simulated with
//! [`SimDevice::set_external_use`]: allocations then fail as `cudaMalloc` would.
//!
//! Host memory registration ([`Device::register_host`]) is simulated too: a registration
//! keeps the mapping alive and copies from it read the mapping directly, paced like the
//! staged copies (all copy streams share the one paced worker: one PCIe link). A device can
//! be told to refuse registrations ([`SimOptions::refuse_registration`],
//! [`SimDevice::set_refuse_registration`]) so the loader's fallback to staging can be tested.
//! As CUDA does for portable registrations, memory overlapping a live registration of any
//! simulated device in the process is refused ("already registered"), and pinning can be
//! given a rate ([`SimOptions::pin_bps`]) so that registering takes time as it does on a host.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::device::{
    Completion, DevSpan, Device, DeviceInfo, DeviceKind, GpuError, HostMemory, HostRegistration,
    IpcHandle, Staging,
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
    /// Directory for the regions' backing files (tmpfs, e.g. `/dev/shm/...`). It belongs to
    /// these devices: region files left in it (by a crash) are removed when they start.
    pub dir: PathBuf,
    /// Refuse to register host memory, as a driver might (so the loader falls back to its
    /// staging ring). Default `false`.
    pub refuse_registration: bool,
    /// Pinning rate of host memory registrations, bytes/s (a registration of `n` bytes
    /// takes `n / pin_bps`); 0 = instant. The H100 host measured 15–30 GB/s.
    pub pin_bps: u64,
    /// The host NUMA node the devices report ([`DeviceInfo::numa_node`]), so loads place
    /// their fillers and staging buffers on it; `None` by default.
    pub numa_node: Option<u32>,
    /// The first `busy` devices start with [`SIM_BUSY_SHARE`] of their memory held by
    /// "another process" ([`SimDevice::set_external_use`]), as an inference engine the
    /// platform started itself would hold it. Default 0.
    pub busy: u32,
}

/// The share of a busy simulated device's memory another process holds: what vLLM claims
/// by default (`gpu_memory_utilization` 0.9).
pub const SIM_BUSY_SHARE: f64 = 0.9;

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
            refuse_registration: false,
            pin_bps: 0,
            numa_node: None,
            busy: 0,
        }
    }
}

/// Host memory registered with any simulated device of this process, as (address, bytes):
/// CUDA refuses to register memory that overlaps a live portable registration.
static REGISTERED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

fn registered() -> std::sync::MutexGuard<'static, Vec<(usize, usize)>> {
    REGISTERED.lock().unwrap_or_else(PoisonError::into_inner)
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

/// A copy for the stream worker. Each names its files by handle: a region freed while a
/// copy is queued keeps its (unlinked) file until the copy is done, so the copy can never
/// land in another region.
enum Op {
    Htod {
        dst: Arc<File>,
        offset: u64,
        /// The staging buffer itself, shared (no copy): the loader does not touch it
        /// until the completion says the copy is done.
        data: Arc<Vec<u8>>,
        len: usize,
        done: mpsc::SyncSender<Result<(), GpuError>>,
    },
    /// From registered host memory, read in place.
    Registered {
        dst: Arc<File>,
        offset: u64,
        /// Keeps the memory registered (and mapped) until the copy is done.
        src: Arc<dyn HostRegistration>,
        src_offset: usize,
        len: usize,
        done: mpsc::SyncSender<Result<(), GpuError>>,
    },
    Peer {
        dst: Arc<File>,
        offset: u64,
        src: Arc<File>,
        src_offset: u64,
        len: u64,
        done: mpsc::SyncSender<Result<(), GpuError>>,
    },
}

/// One live region: its backing file, removed when the region is freed.
#[derive(Debug)]
struct SimRegion {
    file: Arc<File>,
    path: PathBuf,
    len: u64,
}

impl Drop for SimRegion {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), "removing a simulated GPU region: {e}");
        }
    }
}

/// The regions of one device.
#[derive(Debug, Default)]
struct Regions {
    /// By region number (a span's `base`).
    live: HashMap<u64, SimRegion>,
    /// Bytes of the live regions plus those being created.
    allocated: u64,
    /// The next region number; numbers are never reused.
    next: u64,
}

/// One simulated device.
pub struct SimDevice {
    info: DeviceInfo,
    dir: PathBuf,
    regions: Mutex<Regions>,
    /// Bytes "held by other processes" (see [`SimDevice::set_external_use`]).
    external: AtomicU64,
    /// Refuse host memory registrations.
    refuse_registration: AtomicBool,
    /// Registrations still accepted before refusing (`u64::MAX`: no limit).
    registrations_left: AtomicU64,
    /// See [`SimOptions::pin_bps`].
    pin_bps: u64,
    stream: Mutex<mpsc::Sender<Op>>,
}

impl std::fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDevice")
            .field("info", &self.info)
            .finish()
    }
}

/// Creates the simulated devices. Nothing is allocated: a region's backing file
/// (`sim-gpu-<n>-region-<k>.mem` in `opts.dir`) exists only while the region does.
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
            numa_node: opts.numa_node,
        };
        // Region files a previous run left behind (a crash) hold memory nobody uses.
        remove_stale_regions(&opts.dir, i);
        let (tx, rx) = mpsc::channel::<Op>();
        let (pcie, nvlink) = (opts.pcie_bps, opts.nvlink_bps);
        std::thread::Builder::new()
            .name(format!("sim-gpu-{i}-stream"))
            .spawn(move || stream_worker(i, rx, pcie, nvlink))
            .map_err(|e| GpuError::Device {
                device: i,
                message: format!("starting the copy stream: {e}"),
            })?;
        out.push(Arc::new(SimDevice {
            info,
            dir: opts.dir.clone(),
            regions: Mutex::default(),
            external: AtomicU64::new(if i < opts.busy {
                (opts.memory_bytes as f64 * SIM_BUSY_SHARE) as u64
            } else {
                0
            }),
            refuse_registration: AtomicBool::new(opts.refuse_registration),
            registrations_left: AtomicU64::new(u64::MAX),
            pin_bps: opts.pin_bps,
            stream: Mutex::new(tx),
        }));
    }
    Ok(out)
}

/// Removes `sim-gpu-<device>-region-*.mem` files in `dir`, and the whole-device backing
/// file `sim-gpu-<device>.mem` of earlier versions.
fn remove_stale_regions(dir: &Path, device: u32) {
    let _ = std::fs::remove_file(dir.join(format!("sim-gpu-{device}.mem")));
    let prefix = format!("sim-gpu-{device}-region-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(&prefix) && name.ends_with(".mem") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn stream_worker(device: u32, rx: mpsc::Receiver<Op>, pcie: u64, nvlink: u64) {
    let mut pcie = Pacer::new(pcie);
    let mut nvlink = Pacer::new(nvlink);
    let io = |what: &str, e: std::io::Error| GpuError::Device {
        device,
        message: format!("{what}: {e}"),
    };
    while let Ok(op) = rx.recv() {
        match op {
            Op::Htod {
                dst,
                offset,
                data,
                len,
                done,
            } => {
                pcie.pace(len as u64);
                let r = match data.get(..len) {
                    Some(bytes) => dst.write_all_at(bytes, offset).map_err(|e| io("write", e)),
                    None => Err(GpuError::Invalid("copy longer than its buffer".into())),
                };
                // Release the buffer before signalling, so the loader can refill it in
                // place.
                drop(data);
                let _ = done.send(r);
            }
            Op::Registered {
                dst,
                offset,
                src,
                src_offset,
                len,
                done,
            } => {
                pcie.pace(len as u64);
                let r = match src.as_any().downcast_ref::<SimRegistration>() {
                    Some(reg) => match src_offset
                        .checked_add(len)
                        .and_then(|end| reg.memory.as_bytes().get(src_offset..end))
                    {
                        Some(bytes) => dst.write_all_at(bytes, offset).map_err(|e| io("write", e)),
                        None => Err(GpuError::Invalid(
                            "copy past the end of the registered memory".into(),
                        )),
                    },
                    None => Err(GpuError::Invalid("not a simulated registration".into())),
                };
                drop(src);
                let _ = done.send(r);
            }
            Op::Peer {
                dst,
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
                    dst.write_all_at(&buf, offset)
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

/// Host memory "registered" with a simulated device: nothing is pinned; the registration
/// keeps the memory alive for the copies that read it, and its range in [`REGISTERED`]
/// until it is dropped.
struct SimRegistration {
    memory: Arc<dyn HostMemory>,
    device: u32,
}

impl Drop for SimRegistration {
    fn drop(&mut self) {
        let range = (
            self.memory.as_bytes().as_ptr() as usize,
            self.memory.as_bytes().len(),
        );
        let mut live = registered();
        if let Some(at) = live.iter().position(|r| *r == range) {
            live.swap_remove(at);
        }
    }
}

impl HostRegistration for SimRegistration {
    fn len(&self) -> u64 {
        self.memory.as_bytes().len() as u64
    }
    fn device(&self) -> u32 {
        self.device
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
    /// The directory holding the regions' backing files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Simulates `bytes` of this GPU's memory held by other processes (an inference engine):
    /// allocations see that much less free memory and fail with
    /// [`GpuError::OutOfMemory`] when it is gone. For tests.
    pub fn set_external_use(&self, bytes: u64) {
        self.external.store(bytes, Ordering::Relaxed);
    }

    /// Makes this device refuse (or accept again) host memory registrations, as a driver
    /// might; the loader then falls back to its staging ring. For tests.
    pub fn set_refuse_registration(&self, refuse: bool) {
        self.refuse_registration.store(refuse, Ordering::Relaxed);
    }

    /// Accepts `n` more host memory registrations, then refuses the others (as a driver out
    /// of pinnable memory might, part-way through a load). For tests.
    pub fn refuse_registration_after(&self, n: u64) {
        self.registrations_left.store(n, Ordering::Relaxed);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Regions> {
        self.regions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The backing file and file offset of `span`, after checking that it lies on this
    /// device inside a live region.
    fn check(&self, span: DevSpan) -> Result<(Arc<File>, u64), GpuError> {
        if span.device != self.info.index {
            return Err(GpuError::Invalid(format!(
                "span of device {} used on device {}",
                span.device, self.info.index
            )));
        }
        let regions = self.lock();
        let region = regions.live.get(&span.base).ok_or_else(|| {
            GpuError::Invalid(format!(
                "span of region {} which is not live on device {}",
                span.base, self.info.index
            ))
        })?;
        let end = span
            .offset
            .checked_add(span.len)
            .ok_or_else(|| GpuError::Invalid("span overflow".into()))?;
        if end > region.len {
            return Err(GpuError::Invalid(format!(
                "span end {end} is past its region ({} bytes)",
                region.len
            )));
        }
        Ok((region.file.clone(), span.offset))
    }

    /// Creates, sizes and allocates a region's backing file.
    fn create_region(&self, path: &Path, bytes: u64) -> Result<File, GpuError> {
        let device = self.info.index;
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| GpuError::Device {
                device,
                message: format!("creating {}: {e}", path.display()),
            })?;
        // Allocate every page now, as cudaMalloc does: first-touch page faults on the copy
        // path would make the simulated PCIe rate depend on the host's page allocator.
        let sized =
            file.set_len(bytes)
                .map_err(|e| GpuError::Device {
                    device,
                    message: format!("sizing {}: {e}", path.display()),
                })
                .and_then(|()| {
                    rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, bytes)
                        .map_err(|e| {
                            tracing::warn!(device, "allocating simulated GPU memory: {e}");
                            GpuError::OutOfMemory {
                                device,
                                requested: bytes,
                                available: 0,
                            }
                        })
                });
        if let Err(e) = sized {
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
        Ok(file)
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

    fn alloc_region(&self, bytes: u64) -> Result<DevSpan, GpuError> {
        let device = self.info.index;
        if bytes == 0 {
            return Err(GpuError::Invalid("a region of 0 bytes".into()));
        }
        // Account first (so concurrent allocations cannot both take the last bytes), create
        // the file outside the lock.
        let id = {
            let mut r = self.lock();
            let taken = r
                .allocated
                .saturating_add(self.external.load(Ordering::Relaxed));
            let available = self.info.memory_bytes.saturating_sub(taken);
            if bytes > available {
                return Err(GpuError::OutOfMemory {
                    device,
                    requested: bytes,
                    available,
                });
            }
            r.allocated += bytes;
            r.next += 1;
            r.next
        };
        let path = self.dir.join(format!("sim-gpu-{device}-region-{id}.mem"));
        let file = match self.create_region(&path, bytes) {
            Ok(f) => f,
            Err(e) => {
                self.lock().allocated -= bytes;
                return Err(e);
            }
        };
        self.lock().live.insert(
            id,
            SimRegion {
                file: Arc::new(file),
                path,
                len: bytes,
            },
        );
        tracing::debug!(device, bytes, region = id, "simulated region allocated");
        Ok(DevSpan {
            device,
            base: id,
            offset: 0,
            len: bytes,
        })
    }

    fn free_region(&self, span: DevSpan) -> Result<(), GpuError> {
        if span.device != self.info.index {
            return Err(GpuError::Invalid(format!(
                "span of device {} freed on device {}",
                span.device, self.info.index
            )));
        }
        let region = {
            let mut r = self.lock();
            let region = r.live.remove(&span.base).ok_or_else(|| {
                GpuError::Invalid(format!(
                    "region {} is not live on device {}",
                    span.base, self.info.index
                ))
            })?;
            r.allocated -= region.len;
            region
        };
        // Dropping it unlinks the file; copies still queued hold the handle, and the pages
        // go back to the host when the last of them is done.
        drop(region);
        Ok(())
    }

    fn allocated_bytes(&self) -> u64 {
        self.lock().allocated
    }

    fn free_memory(&self) -> Result<u64, GpuError> {
        let taken = self
            .lock()
            .allocated
            .saturating_add(self.external.load(Ordering::Relaxed));
        Ok(self.info.memory_bytes.saturating_sub(taken))
    }

    fn alloc_staging(&self, bytes: usize) -> Result<Box<dyn Staging>, GpuError> {
        Ok(Box::new(SimStaging(Arc::new(vec![0u8; bytes]))))
    }

    fn copy_htod(&self, dst: DevSpan, src: &dyn Staging) -> Result<Box<dyn Completion>, GpuError> {
        let (file, at) = self.check(dst)?;
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
            dst: file,
            offset: at,
            data,
            len: n,
            done: tx,
        })?;
        Ok(Box::new(SimCompletion(rx, self.info.index)))
    }

    fn register_host(
        &self,
        memory: Arc<dyn HostMemory>,
    ) -> Result<Arc<dyn HostRegistration>, GpuError> {
        let allowed = self
            .registrations_left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| match n {
                u64::MAX => Some(n),
                0 => None,
                n => Some(n - 1),
            })
            .is_ok();
        if self.refuse_registration.load(Ordering::Relaxed) || !allowed {
            return Err(GpuError::Device {
                device: self.info.index,
                message: "host memory registration refused (simulated driver error)".into(),
            });
        }
        let bytes = memory.as_bytes();
        if bytes.is_empty() {
            return Err(GpuError::Invalid("registering 0 bytes".into()));
        }
        let (addr, len) = (bytes.as_ptr() as usize, bytes.len());
        {
            let mut live = registered();
            if live.iter().any(|&(a, n)| addr < a + n && a < addr + len) {
                return Err(GpuError::Device {
                    device: self.info.index,
                    message: "host memory already registered (simulated \
                              CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)"
                        .into(),
                });
            }
            live.push((addr, len));
        }
        // Pinning takes time on a host (claimed above first, as the driver refuses a second
        // registration of the same pages while the first is still pinning them).
        if self.pin_bps > 0 {
            std::thread::sleep(Duration::from_secs_f64(len as f64 / self.pin_bps as f64));
        }
        Ok(Arc::new(SimRegistration {
            memory,
            device: self.info.index,
        }))
    }

    fn copy_htod_registered(
        &self,
        dst: DevSpan,
        src: &Arc<dyn HostRegistration>,
        offset: u64,
        _stream: usize,
    ) -> Result<Box<dyn Completion>, GpuError> {
        if src.as_any().downcast_ref::<SimRegistration>().is_none() {
            return Err(GpuError::Unsupported(
                "copy to a simulated device from another backend's registration".into(),
            ));
        }
        let (file, at) = self.check(dst)?;
        let len = usize::try_from(dst.len).map_err(|_| GpuError::Invalid("len".into()))?;
        let src_offset = usize::try_from(offset).map_err(|_| GpuError::Invalid("offset".into()))?;
        if offset
            .checked_add(dst.len)
            .is_none_or(|end| end > src.len())
        {
            return Err(GpuError::Invalid(format!(
                "copy of {len} bytes at {offset} from a registration of {} bytes",
                src.len()
            )));
        }
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(Op::Registered {
            dst: file,
            offset: at,
            src: Arc::clone(src),
            src_offset,
            len,
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
        let (dst_file, at) = self.check(dst)?;
        let (src_file, from) = other.check(src)?;
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(Op::Peer {
            dst: dst_file,
            offset: at,
            src: src_file,
            src_offset: from,
            len: dst.len,
            done: tx,
        })?;
        Ok(Box::new(SimCompletion(rx, self.info.index)))
    }

    fn read(&self, src: DevSpan) -> Result<Vec<u8>, GpuError> {
        let (file, at) = self.check(src)?;
        let n = usize::try_from(src.len).map_err(|_| GpuError::Invalid("len".into()))?;
        let mut buf = vec![0u8; n];
        file.read_exact_at(&mut buf, at)
            .map_err(|e| GpuError::Device {
                device: self.info.index,
                message: format!("read: {e}"),
            })?;
        Ok(buf)
    }

    fn ipc_handle(&self, span: DevSpan) -> Result<IpcHandle, GpuError> {
        self.check(span)?;
        let path = self
            .lock()
            .live
            .get(&span.base)
            .map(|r| r.path.display().to_string())
            .ok_or_else(|| GpuError::Invalid("the region was freed".into()))?;
        Ok(IpcHandle::SimulatedFile {
            path,
            offset: span.offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Bytes of host memory the files in `dir` really hold (allocated blocks).
    fn held(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().blocks() * 512)
            .sum()
    }

    #[test]
    fn overlapping_registrations_are_refused_on_every_device_until_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let devs = devices(&SimOptions::new(dir.path(), 2, 64 << 20)).unwrap();
        let path = dir.path().join("shard");
        std::fs::write(&path, vec![7u8; 3 * 4096]).unwrap();
        let map: Arc<dyn HostMemory> = crate::mapped::MappedFile::open(&path).unwrap();
        let part =
            |start, len| Arc::new(crate::device::HostSlice::new(map.clone(), start, len).unwrap());
        let first = devs[0].register_host(part(0, 2 * 4096)).unwrap();
        // The same pages, a page inside them, on this device or another: refused.
        for (dev, start, len) in [(0, 0, 2 * 4096), (1, 4096, 4096), (1, 0, 3 * 4096)] {
            let e = devs[dev]
                .register_host(part(start, len))
                .map(|_| ())
                .unwrap_err();
            assert!(e.to_string().contains("already registered"), "{e}");
        }
        // Pages beside them register; after the drop, the first ones again.
        let beside = devs[1].register_host(part(2 * 4096, 4096)).unwrap();
        drop(first);
        let again = devs[1].register_host(part(0, 2 * 4096)).unwrap();
        drop((beside, again));
    }

    #[test]
    fn copies_land_and_are_paced() {
        let dir = tempfile::tempdir().unwrap();
        let mut o = SimOptions::new(dir.path(), 2, 64 << 20);
        o.pcie_bps = 100 << 20;
        o.nvlink_bps = 400 << 20;
        let devs = devices(&o).unwrap();
        assert_eq!(devs[0].info().kind, DeviceKind::Simulated);
        assert!(devs[0].info().name.starts_with("simulated"));
        let a0 = devs[0].alloc_region(32 << 20).unwrap();
        let a1 = devs[1].alloc_region(32 << 20).unwrap();
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
        let past_end = DevSpan {
            offset: 31 << 20,
            len: 2 << 20,
            ..a0
        };
        assert!(matches!(devs[0].read(past_end), Err(GpuError::Invalid(_))));
        assert!(devs[0].copy_htod(a1.sub(0, 16).unwrap(), &*st).is_err());
        assert!(matches!(devs[1].alloc_region(0), Err(GpuError::Invalid(_))));
        let other = tempfile::tempdir().unwrap();
        let big = devices(&SimOptions::new(other.path(), 1, 1 << 20)).unwrap();
        assert!(matches!(
            big[0].alloc_region(2 << 20),
            Err(GpuError::OutOfMemory { .. })
        ));
        match devs[0].ipc_handle(a0.sub(8, 8).unwrap()).unwrap() {
            IpcHandle::SimulatedFile { path, offset } => {
                assert_eq!(offset, 8);
                assert_eq!(
                    std::fs::metadata(&path).unwrap().len(),
                    32 << 20,
                    "{path} is the region's own file"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn regions_take_memory_only_while_they_live() {
        let dir = tempfile::tempdir().unwrap();
        let mut o = SimOptions::new(dir.path(), 1, 64 << 20);
        o.pcie_bps = 0;
        let dev = devices(&o).unwrap().remove(0);
        // Nothing taken at start.
        assert_eq!(dev.allocated_bytes(), 0);
        assert_eq!(dev.free_memory().unwrap(), 64 << 20);
        assert_eq!(held(dir.path()), 0);

        let a = dev.alloc_region(8 << 20).unwrap();
        let b = dev.alloc_region(16 << 20).unwrap();
        assert_ne!(a.base, b.base);
        assert_eq!(dev.allocated_bytes(), 24 << 20);
        assert_eq!(dev.free_memory().unwrap(), 40 << 20);
        assert!(held(dir.path()) >= 24 << 20, "pages allocated up front");

        // A span of one region is checked against that region, not the other.
        let mut st = dev.alloc_staging(1 << 20).unwrap();
        st.as_mut_slice().fill(7);
        let past_a = DevSpan {
            offset: (8 << 20) - 4,
            len: 8,
            ..a
        };
        assert!(matches!(dev.read(past_a), Err(GpuError::Invalid(_))));
        dev.copy_htod(b.sub(15 << 20, 1 << 20).unwrap(), &*st)
            .unwrap()
            .wait()
            .unwrap();

        // Freeing gives the memory back for real and retires the region's spans.
        dev.free_region(a).unwrap();
        assert_eq!(dev.allocated_bytes(), 16 << 20);
        assert!(held(dir.path()) < 20 << 20);
        assert!(matches!(dev.read(a), Err(GpuError::Invalid(_))));
        assert!(matches!(
            dev.copy_htod(a.sub(0, 16).unwrap(), &*st),
            Err(GpuError::Invalid(_))
        ));
        assert!(matches!(dev.ipc_handle(a), Err(GpuError::Invalid(_))));
        assert!(matches!(dev.free_region(a), Err(GpuError::Invalid(_))));

        // A copy still queued when its region is freed lands in the freed region's file,
        // never in a region allocated after it.
        let slow_dir = tempfile::tempdir().unwrap();
        let mut slow = SimOptions::new(slow_dir.path(), 1, 64 << 20);
        slow.pcie_bps = 20 << 20;
        let sd = devices(&slow).unwrap().remove(0);
        let r = sd.alloc_region(2 << 20).unwrap();
        let queued = sd.copy_htod(r.sub(0, 1 << 20).unwrap(), &*st).unwrap();
        sd.free_region(r).unwrap();
        let fresh = sd.alloc_region(2 << 20).unwrap();
        queued.wait().unwrap();
        assert!(sd.read(fresh).unwrap().iter().all(|&x| x == 0));
        sd.free_region(fresh).unwrap();

        // Memory held by another process (an inference engine) is not ours to take.
        dev.set_external_use(44 << 20);
        assert_eq!(dev.free_memory().unwrap(), 4 << 20);
        match dev.alloc_region(8 << 20) {
            Err(GpuError::OutOfMemory {
                requested,
                available,
                ..
            }) => assert_eq!((requested, available), (8 << 20, 4 << 20)),
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        assert_eq!(dev.allocated_bytes(), 16 << 20, "a refusal takes nothing");
        dev.set_external_use(0);
        let c = dev.alloc_region(8 << 20).unwrap();
        dev.free_region(c).unwrap();
        dev.free_region(b).unwrap();
        assert_eq!(dev.allocated_bytes(), 0);
        assert_eq!(held(dir.path()), 0);
    }

    #[test]
    fn region_files_left_by_a_crash_are_removed_at_start() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("sim-gpu-0-region-7.mem"), [1u8; 4096]).unwrap();
        std::fs::write(dir.path().join("sim-gpu-1.mem"), [1u8; 4096]).unwrap();
        std::fs::write(dir.path().join("unrelated"), [1u8; 10]).unwrap();
        let _devs = devices(&SimOptions::new(dir.path(), 2, 8 << 20)).unwrap();
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["unrelated"]);
    }
}
