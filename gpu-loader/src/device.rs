//! The device abstraction: what the loader needs from a GPU, implemented by the CUDA backend
//! ([`crate::cuda`]) and by the simulated backend ([`crate::sim`]).
//!
//! The model is CUDA's: device memory is taken one *region* at a time, each its own device
//! allocation (`cuMemAlloc`), made when a model is loaded and freed when it is evicted —
//! nothing is reserved ahead, so an inference engine on the same GPU keeps the rest
//! ([`crate::pool`] keeps the regions within the host's budget). Copies are issued on an
//! in-order *stream* and return a [`Completion`] (an event) that the caller waits on before
//! reusing the staging buffer. Calls are blocking-safe: the loader drives each device from
//! its own threads, never from an async executor.

use std::fmt;
use std::sync::Arc;

/// Which backend a device belongs to. Logs, metrics and the API always print it, so a
/// simulated device can never be mistaken for a real GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// A real GPU through the CUDA driver.
    Cuda,
    /// Host memory pretending to be a GPU, with paced copies. Never a real GPU.
    Simulated,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Cuda => "cuda",
            Self::Simulated => "simulated",
        })
    }
}

/// What a device is.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct DeviceInfo {
    /// Index on this host (CUDA ordinal).
    pub index: u32,
    /// Marketing name (`"NVIDIA H100 80GB HBM3"`, or `"simulated GPU 0"`).
    pub name: String,
    /// Backend.
    pub kind: DeviceKind,
    /// Total device memory in bytes.
    pub memory_bytes: u64,
    /// GPUs behind the same PCIe switch report the same id ("" when unknown).
    pub pcie_switch: String,
    /// Peers reachable over NVLink (or another peer path), with the copy rate in bytes/s
    /// (0 when unknown). Only peers with peer access enabled are listed.
    pub peers: Vec<(u32, u64)>,
    /// The host NUMA node the GPU's PCIe link hangs off (`None` when unknown): loads run
    /// their fillers and allocate their staging buffers there ([`crate::numa`]).
    pub numa_node: Option<u32>,
}

/// Errors of device operations.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The CUDA driver library is not installed: a normal condition on hosts without GPUs.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// The device refused an allocation: its memory is taken (by this host's regions or by
    /// other processes on the GPU, such as an inference engine).
    #[error(
        "out of GPU memory on device {device}: asked for {requested} bytes, the device has {available} free (memory held by other processes on the GPU counts)"
    )]
    OutOfMemory {
        /// Device index.
        device: u32,
        /// Bytes asked for.
        requested: u64,
        /// Bytes free on the device when it refused (0 when unknown).
        available: u64,
    },
    /// A bad argument (offset past the end, wrong device).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The driver (or the simulation) failed.
    #[error("device {device}: {message}")]
    Device {
        /// Device index.
        device: u32,
        /// What failed.
        message: String,
    },
    /// The operation is not possible on this device (e.g. no peer access).
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// One device allocation (a region, from [`Device::alloc_region`]), or a sub-range of one.
/// Devices check a span against the live allocation it names before every use: a span of a
/// freed region, or past its end, is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevSpan {
    /// Device index.
    pub device: u32,
    /// Which allocation: its device address (CUDA `CUdeviceptr`), or the region's number on
    /// the simulated device (never reused).
    pub base: u64,
    /// Offset of this span within the allocation.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl DevSpan {
    /// A sub-span `[off, off+len)` of this span, checked.
    pub fn sub(&self, off: u64, len: u64) -> Result<Self, GpuError> {
        let end = off
            .checked_add(len)
            .ok_or_else(|| GpuError::Invalid("span overflow".into()))?;
        if end > self.len {
            return Err(GpuError::Invalid(format!(
                "span [{off}, {end}) is outside a span of {} bytes",
                self.len
            )));
        }
        Ok(Self {
            device: self.device,
            base: self.base,
            offset: self.offset + off,
            len,
        })
    }
}

/// A host staging buffer, page-locked on CUDA so copies are true DMA.
pub trait Staging: Send {
    /// Capacity in bytes.
    fn capacity(&self) -> usize;
    /// The bytes, to fill before a copy.
    fn as_mut_slice(&mut self) -> &mut [u8];
    /// The bytes.
    fn as_slice(&self) -> &[u8];
    /// For a backend to recognise its own buffers.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Host memory that a device can register (page-lock for DMA) and copy from directly, with
/// no staging copy: a read-only map of a memory-tier shard file (see [`crate::mapped`]).
///
/// The contract: [`HostMemory::as_bytes`] returns the same bytes (same address, same length)
/// every time, and they stay mapped for as long as the value lives. A device keeps an `Arc`
/// of the memory in its registration, and every copy from it keeps the registration, so the
/// memory outlives both; devices also check the address again before each copy.
pub trait HostMemory: Send + Sync {
    /// The bytes.
    fn as_bytes(&self) -> &[u8];
    /// Whether the memory is mapped read-only (CUDA then registers it `READ_ONLY`).
    fn read_only(&self) -> bool;
}

impl HostMemory for memmap2::Mmap {
    fn as_bytes(&self) -> &[u8] {
        self
    }

    fn read_only(&self) -> bool {
        true
    }
}

/// A part of a [`HostMemory`] (`start .. start + len`), itself a [`HostMemory`]: the unit
/// the loader registers, so that pinning the next part overlaps the copies from this one.
pub struct HostSlice {
    memory: Arc<dyn HostMemory>,
    start: usize,
    len: usize,
}

impl HostSlice {
    /// Bytes `start .. start + len` of `memory`; `None` when they are not all inside it.
    pub fn new(memory: Arc<dyn HostMemory>, start: usize, len: usize) -> Option<Self> {
        let end = start.checked_add(len)?;
        (end <= memory.as_bytes().len()).then_some(Self { memory, start, len })
    }

    /// Offset of the slice in the whole memory.
    pub fn start(&self) -> usize {
        self.start
    }
}

impl HostMemory for HostSlice {
    fn as_bytes(&self) -> &[u8] {
        // Checked in `new`, and the memory's bytes never change length (its contract).
        self.memory
            .as_bytes()
            .get(self.start..self.start + self.len)
            .unwrap_or_default()
    }

    fn read_only(&self) -> bool {
        self.memory.read_only()
    }
}

/// [`HostMemory`] registered with a device ([`Device::register_host`]): copies from it
/// ([`Device::copy_htod_registered`]) are DMA straight from its pages. Unregistered when the
/// last `Arc` goes, which is after every copy from it finished (each copy's completion
/// holds the registration until the copy is done).
pub trait HostRegistration: Send + Sync {
    /// Bytes registered.
    fn len(&self) -> u64;
    /// Whether nothing is registered (never: registrations are of at least one byte).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device index it was registered with.
    fn device(&self) -> u32;
    /// For a backend to recognise its own registrations.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A copy in flight: wait before reusing its source buffer.
pub trait Completion: Send {
    /// Blocks until the copy has finished (CUDA: event synchronize).
    fn wait(self: Box<Self>) -> Result<(), GpuError>;
}

/// How a consumer process maps a region (the hand-off). Each model has its own allocation,
/// so a handle opens that model's region alone; `offset` is 0 for a span that starts the
/// allocation (the whole region).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum IpcHandle {
    /// A CUDA IPC memory handle of the model's allocation (64 bytes, hex); the span starts
    /// `offset` bytes into it (`cuIpcOpenMemHandle`, then add the offset).
    CudaIpc {
        /// `CUipcMemHandle` bytes, hex.
        handle: String,
        /// Byte offset of the span within the opened allocation.
        offset: u64,
    },
    /// The simulated region's backing file; the span starts `offset` bytes into it.
    SimulatedFile {
        /// Path of the region's backing file.
        path: String,
        /// Byte offset of the span within the file.
        offset: u64,
    },
}

/// A GPU as the loader uses it.
pub trait Device: Send + Sync {
    /// What it is.
    fn info(&self) -> &DeviceInfo;

    /// For backends to recognise their own devices (peer copies).
    fn as_any(&self) -> &dyn std::any::Any;

    /// Allocates a region: a device allocation of its own, `bytes` long (> 0), returned as
    /// the span covering all of it. [`GpuError::OutOfMemory`] when the device refuses (its
    /// memory is taken, by this process or by others). Prefer [`DeviceRegion::alloc`], which
    /// frees it when dropped.
    fn alloc_region(&self, bytes: u64) -> Result<DevSpan, GpuError>;

    /// Frees the allocation `span` points into, for real (CUDA: `cuMemFree`). Copies
    /// already issued into or out of it are waited for first; later uses of its spans are
    /// refused. [`GpuError::Invalid`] when it is not a live allocation of this device.
    fn free_region(&self, span: DevSpan) -> Result<(), GpuError>;

    /// Bytes of device memory this process holds on the device through
    /// [`Device::alloc_region`] (0 before the first load).
    fn allocated_bytes(&self) -> u64;

    /// Device memory free now for any process (CUDA: `cuMemGetInfo`), which other
    /// processes on the GPU lower as they allocate.
    fn free_memory(&self) -> Result<u64, GpuError>;

    /// A staging buffer of `bytes` for host-to-device copies to this device.
    fn alloc_staging(&self, bytes: usize) -> Result<Box<dyn Staging>, GpuError>;

    /// Starts copying `src[..dst.len]` into `dst` on this device's copy stream (in order
    /// with earlier copies). The caller keeps `src` unchanged until the completion is waited.
    fn copy_htod(&self, dst: DevSpan, src: &dyn Staging) -> Result<Box<dyn Completion>, GpuError>;

    /// Registers `memory` for direct host → device copies (CUDA: `cuMemHostRegister`,
    /// portable, so every GPU of the backend can copy from it). Registering pins every page
    /// of it and can take a while for large mappings. Devices that cannot register return
    /// an error; the loader then uses the staging ring.
    fn register_host(
        &self,
        memory: Arc<dyn HostMemory>,
    ) -> Result<Arc<dyn HostRegistration>, GpuError> {
        let _ = memory;
        Err(GpuError::Unsupported(format!(
            "{} device {} cannot register host memory",
            self.info().kind,
            self.info().index
        )))
    }

    /// Starts copying `src[offset .. offset + dst.len]` into `dst` on copy stream `stream`
    /// of this device (0 is the stream [`Device::copy_htod`] uses; a device has a few, a
    /// larger number wraps around). Copies on one stream run in order; copies on different
    /// streams may overlap. `src` may be a registration of another device of the same
    /// backend. The completion keeps `src` registered until the copy is done.
    fn copy_htod_registered(
        &self,
        dst: DevSpan,
        src: &Arc<dyn HostRegistration>,
        offset: u64,
        stream: usize,
    ) -> Result<Box<dyn Completion>, GpuError> {
        let _ = (dst, src, offset, stream);
        Err(GpuError::Unsupported(format!(
            "{} device {} cannot copy from registered host memory",
            self.info().kind,
            self.info().index
        )))
    }

    /// Starts a device-to-device copy from `src` (on another device) into `dst` (on this one)
    /// over the peer path (NVLink). `Unsupported` when peer access is not enabled.
    fn copy_peer(
        &self,
        dst: DevSpan,
        src_device: &dyn Device,
        src: DevSpan,
    ) -> Result<Box<dyn Completion>, GpuError>;

    /// Reads device memory back to the host (for verification; slow path).
    fn read(&self, src: DevSpan) -> Result<Vec<u8>, GpuError>;

    /// The hand-off handle of the allocation `span` points into, with `span`'s offset in it.
    fn ipc_handle(&self, span: DevSpan) -> Result<IpcHandle, GpuError>;
}

/// A region that frees its device memory when dropped: the safe way to hold one.
pub struct DeviceRegion {
    device: Arc<dyn Device>,
    span: DevSpan,
}

impl fmt::Debug for DeviceRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceRegion")
            .field("span", &self.span)
            .finish()
    }
}

impl DeviceRegion {
    /// Allocates `bytes` on `device` (see [`Device::alloc_region`]).
    pub fn alloc(device: &Arc<dyn Device>, bytes: u64) -> Result<Self, GpuError> {
        let span = device.alloc_region(bytes)?;
        Ok(Self {
            device: Arc::clone(device),
            span,
        })
    }

    /// The span covering the whole region.
    pub fn span(&self) -> DevSpan {
        self.span
    }

    /// The device it is on.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }
}

impl Drop for DeviceRegion {
    fn drop(&mut self) {
        if let Err(e) = self.device.free_region(self.span) {
            tracing::warn!(device = self.span.device, error = %e, "freeing a GPU region");
        }
    }
}
