//! The CUDA backend of [`Device`]: real GPUs through the CUDA driver API, called through
//! cudarc's raw bindings (`cudarc::driver::sys`), which load `libcuda` at run time.
//!
//! What it does: [`devices`] opens every GPU of the host (its primary context, one
//! non-blocking copy stream at the highest priority), enables peer access between GPUs that
//! support it, and returns [`CudaDevice`]s. A device allocates one region per model on demand
//! (`cuMemAlloc`, freed with `cuMemFree` when the model is evicted; nothing at start),
//! pinned staging buffers (`cuMemHostAlloc`), issues host → device and peer copies on its
//! stream with an event per copy as the [`Completion`], reads memory back for verification,
//! and hands regions to consumer processes as CUDA IPC handles. It also registers host
//! memory (`cuMemHostRegister`, portable, read-only for read-only maps: the memory tier's
//! shard mappings) so copies DMA straight from it, on a few extra copy streams made on first
//! use (see "Registered host memory" below). [`calibrate`] and
//! [`peak_htod`] measure the host → device path (the copy-size "elbow" of Torpor §4.3 and the
//! plain pinned reference rate).
//!
//! # Hosts without a driver
//!
//! cudarc's dynamic loading *panics* on the first driver call when `libcuda` cannot be
//! loaded. So [`devices`] first probes the library with `libloading` ([`driver_available`])
//! and returns [`GpuError::NoDriver`] when it is missing — a normal condition on hosts
//! without GPUs, where the loader falls back to the simulated device. As a second line of
//! defence every driver call goes through [`std::panic::catch_unwind`]: a cudarc panic (a
//! library that vanished, a symbol an old driver lacks) becomes [`GpuError::NoDriver`] (at
//! `cuInit`) or [`GpuError::Device`] (later), never a crash. This needs `panic = "unwind"`
//! (the workspace default).
//!
//! # Contexts and threads
//!
//! Each device uses its *primary* context (the one the CUDA runtime and PyTorch use too, so
//! IPC handles and peer mappings are shared with them). A CUDA context is current per
//! thread, and the loader drives each device from its own threads: every method therefore
//! makes the device's context current on the calling thread (`cuCtxSetCurrent`, cheap) before
//! any other call. Handles (contexts, streams, events, pinned pointers) are plain driver
//! handles usable from any thread once the context is current, which is why the wrappers
//! here are `Send`/`Sync`.
//!
//! # Peer access
//!
//! cudarc does not enable peer access; [`devices`] does it explicitly: for every ordered
//! pair (i, j) with `cuDeviceCanAccessPeer(i, j)`, it calls `cuCtxEnablePeerAccess` from i's
//! context to j's (already enabled counts as success) and lists j in i's
//! [`DeviceInfo::peers`] with rate 0 (unknown: NVML is not used, so NVLink and PCIe peer
//! paths are not told apart). A pair whose enabling fails is logged and left out.
//!
//! # PCIe switch id (an approximation)
//!
//! [`DeviceInfo::pcie_switch`] groups GPUs that share a PCIe switch (and so its upstream
//! link). Without NVML it is derived from the PCI bus id (`cuDeviceGetPCIBusId`):
//! - when sysfs is readable, the device's canonical path under `/sys/devices` is walked up:
//!   behind a switch, the GPU's parent is a downstream port and its grandparent the switch's
//!   upstream port, whose address is the id (shared by all GPUs under that switch); a GPU
//!   attached straight to a root port gets that root port's address (its own link);
//! - otherwise it is the `domain:bus` part of the bus id (`"0000:3b"`). GPUs under one
//!   switch usually sit on neighbouring buses, each behind its own downstream port, so this
//!   fallback tends to give every GPU its own id: it under-reports sharing (conservative for
//!   interference-aware placement), and never groups GPUs that do not share a bus.
//!
//! # Registered host memory
//!
//! [`Device::register_host`] page-locks a [`HostMemory`] (a read-only file map) with
//! `cuMemHostRegister` and `CU_MEMHOSTREGISTER_PORTABLE` (usable from every context, so
//! sibling GPUs fed from the host copy from the same registration) plus
//! `CU_MEMHOSTREGISTER_READ_ONLY` when the memory is read-only (required to pin a
//! `PROT_READ` map on most platforms; when the driver refuses the flag, registration is
//! tried once without it). `CU_MEMHOSTREGISTER_DEVICEMAP` is not asked for: the loader only
//! issues DMA copies, never kernels reading host memory. The [`CudaRegistration`] holds an
//! `Arc` of the memory, and every copy's completion holds the registration until the copy
//! has finished (a completion dropped without waiting synchronises its event first), so
//! `cuMemHostUnregister` (on the registration's drop) runs after every copy from it, and the
//! mapping is released after that. Registration pins every page: its time grows with the
//! mapping's size and the loader reports it.
//!
//! # Unsafe code
//!
//! The loader's `unsafe` is confined to this module and to [`crate::mapped`]'s one `mmap`
//! (the workspace denies it elsewhere): the driver calls, `Send`/`Sync` for the handle
//! wrappers, pinned-buffer slices and the copies; every block carries a `// SAFETY:`
//! comment. Memory safety of the safe API
//! rests on: spans checked against the live region they point into before any copy, with
//! the device's region list read-locked from the check until the copy is enqueued (peer
//! copies lock both devices' lists, lower index first); pinned buffers zeroed at allocation
//! (never exposed uninitialised) and freed only after their context is synchronised (so a
//! dropped, never-waited copy cannot read freed memory); a region freed only after it left
//! the list (so no new copy can resolve it) and after the contexts of this device and of
//! every GPU that can peer-copy from it were synchronised (so no enqueued copy still
//! touches it). A span kept after its region was freed is refused, unless a later region
//! got the same device address; the pool never frees a locked region, and the loader holds
//! spans only while their region is locked.

// `unsafe_code` is denied workspace-wide. This module calls the CUDA driver's C API, which
// cannot be done without `unsafe`; it is the one place of the loader allowed to, and every
// block says why it is sound.
#![allow(unsafe_code)]

use std::any::Any;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard};
use std::time::Instant;

use cudarc::driver::sys::{self, CUresult};

use crate::device::{
    Completion, DevSpan, Device, DeviceInfo, DeviceKind, GpuError, HostMemory, HostRegistration,
    IpcHandle, Staging,
};
use crate::loader::MAX_COPY_STREAMS;

/// The smallest page size: registered memory must start on a page (a file map always does).
const MIN_PAGE: usize = 4096;

/// Whether the CUDA driver library can be loaded, checked without calling into cudarc
/// (whose first call panics when the library is missing). [`GpuError::NoDriver`] when not.
pub fn driver_available() -> Result<(), GpuError> {
    // cudarc searches these names too (among others), so when one loads here, cudarc's own
    // loading succeeds.
    for name in ["libcuda.so.1", "libcuda.so"] {
        // SAFETY: loading libcuda runs only the library's own initialisers, which have no
        // preconditions; the handle is dropped (dlclose) at once.
        let lib = unsafe { libloading::Library::new(name) };
        if lib.is_ok() {
            return Ok(());
        }
    }
    Err(GpuError::NoDriver(
        "libcuda.so.1 not found (no NVIDIA driver on this host)".into(),
    ))
}

/// Settings of the CUDA devices of one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Allocate staging buffers write-combined (`CU_MEMHOSTALLOC_WRITECOMBINED`). WC memory
    /// is not cached by the CPU: writing it sequentially and DMA-reading it can be faster on
    /// some platforms, but CPU reads of it are very slow. Default `false` (plain portable
    /// pinned memory); [`calibrate`] measures both so a host can pick.
    pub write_combined: bool,
    /// Create each device's copy stream at the greatest priority the context allows, so
    /// model loads are not queued behind inference work of the same process. Default `true`.
    pub stream_priority_high: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            write_combined: false,
            stream_priority_high: true,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Driver calls: panics caught, results mapped.

/// How a driver call failed.
#[derive(Debug)]
enum CallError {
    /// The driver returned an error code.
    Code(CUresult),
    /// cudarc panicked before reaching the driver (library or symbol missing).
    Panicked(String),
}

/// Runs one driver call with cudarc's panics caught.
fn call(f: impl FnOnce() -> CUresult) -> Result<(), CallError> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(CUresult::CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(CallError::Code(code)),
        Err(payload) => Err(CallError::Panicked(panic_message(payload.as_ref()))),
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic without a message".to_owned()
    }
}

/// Turns a failed driver call into [`GpuError::Device`]:
/// `"cuXxx failed: CUDA_ERROR_..."`.
fn cu_error(device: u32, function: &str, err: CallError) -> GpuError {
    let message = match err {
        CallError::Code(code) => format!("{function} failed: {code:?}"),
        CallError::Panicked(msg) => {
            format!("{function} could not be called (cudarc panicked: {msg})")
        }
    };
    GpuError::Device { device, message }
}

/// Runs one driver call for `device`, mapping any failure with [`cu_error`].
fn check(device: u32, function: &str, f: impl FnOnce() -> CUresult) -> Result<(), GpuError> {
    call(f).map_err(|e| cu_error(device, function, e))
}

/// A `usize` length from a `u64` one.
fn to_usize(n: u64) -> Result<usize, GpuError> {
    usize::try_from(n).map_err(|_| GpuError::Invalid(format!("{n} bytes do not fit in usize")))
}

/// The string a driver call wrote into a `c_char` buffer.
fn c_string(buf: &[c_char]) -> String {
    // SAFETY: `c_char` and `u8` have the same size and alignment; the slice is initialised.
    let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), buf.len()) };
    match CStr::from_bytes_until_nul(bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    }
}

// ---------------------------------------------------------------------------------------
// RAII wrappers of driver handles.

/// A retained primary context of one device; released on drop.
#[derive(Debug)]
struct Context {
    /// Device index (CUDA ordinal), for errors.
    index: u32,
    /// The driver's device handle.
    cu_device: sys::CUdevice,
    /// The primary context.
    raw: sys::CUcontext,
}

// SAFETY: a CUcontext is an opaque driver handle, not thread-affine memory. The driver API is
// thread-safe, and any thread may make a context current and use it; every use here makes it
// current first (`make_current`).
unsafe impl Send for Context {}
// SAFETY: as for `Send`; `&Context` only reads the handle values.
unsafe impl Sync for Context {}

impl Context {
    /// Retains the primary context of `ordinal`.
    fn retain(ordinal: u32) -> Result<Self, GpuError> {
        let ord = c_int::try_from(ordinal)
            .map_err(|_| GpuError::Invalid(format!("device ordinal {ordinal} too large")))?;
        let mut cu_device: sys::CUdevice = 0;
        // SAFETY: `cu_device` is a valid out-pointer for the duration of the call.
        check(ordinal, "cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut cu_device, ord)
        })?;
        let mut raw: sys::CUcontext = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; `cu_device` came from cuDeviceGet.
        check(ordinal, "cuDevicePrimaryCtxRetain", || unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut raw, cu_device)
        })?;
        Ok(Self {
            index: ordinal,
            cu_device,
            raw,
        })
    }

    /// Makes this context current on the calling thread.
    fn make_current(&self) -> Result<(), GpuError> {
        let raw = self.raw;
        // SAFETY: `raw` is a primary context retained by `self` and not yet released.
        check(self.index, "cuCtxSetCurrent", || unsafe {
            sys::cuCtxSetCurrent(raw)
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let cu_device = self.cu_device;
        // SAFETY: `self` holds exactly one retain of the primary context, released once here.
        if let Err(e) = check(self.index, "cuDevicePrimaryCtxRelease_v2", || unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(cu_device)
        }) {
            tracing::warn!(device = self.index, error = %e, "releasing the primary context");
        }
    }
}

/// A stream of one context; destroyed on drop (after its work has finished).
#[derive(Debug)]
struct Stream {
    raw: sys::CUstream,
    ctx: Arc<Context>,
}

// SAFETY: a CUstream is an opaque driver handle usable from any thread with its context
// current (made current before every use); the driver serialises concurrent enqueues.
unsafe impl Send for Stream {}
// SAFETY: as for `Send`; `&Stream` only reads the handle values.
unsafe impl Sync for Stream {}

impl Stream {
    /// A non-blocking stream (no implicit sync with the legacy default stream) at the
    /// greatest priority (`high`) or the least (the default).
    fn create(ctx: &Arc<Context>, high: bool) -> Result<Self, GpuError> {
        ctx.make_current()?;
        let (mut least, mut greatest): (c_int, c_int) = (0, 0);
        // SAFETY: both are valid out-pointers; the context is current.
        check(ctx.index, "cuCtxGetStreamPriorityRange", || unsafe {
            sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
        })?;
        let priority = if high { greatest } else { least };
        let mut raw: sys::CUstream = ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        check(ctx.index, "cuStreamCreateWithPriority", || unsafe {
            sys::cuStreamCreateWithPriority(&mut raw, flags, priority)
        })?;
        Ok(Self {
            raw,
            ctx: Arc::clone(ctx),
        })
    }

    /// Blocks until all work issued on the stream has finished.
    fn synchronize(&self) -> Result<(), GpuError> {
        self.ctx.make_current()?;
        let raw = self.raw;
        // SAFETY: `raw` is a live stream of the current context.
        check(self.ctx.index, "cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let raw = self.raw;
        let result = self.synchronize().and_then(|()| {
            // SAFETY: `raw` is a live stream created by `Stream::create`, destroyed once here;
            // its work has finished (synchronised above) and its context is current.
            check(self.ctx.index, "cuStreamDestroy_v2", || unsafe {
                sys::cuStreamDestroy_v2(raw)
            })
        });
        if let Err(e) = result {
            tracing::warn!(device = self.ctx.index, error = %e, "destroying the copy stream");
        }
    }
}

/// One device allocation (a model's region, or calibration scratch); freed on drop.
#[derive(Debug)]
struct DeviceBuffer {
    /// Device address.
    ptr: sys::CUdeviceptr,
    /// Length in bytes.
    len: u64,
    ctx: Arc<Context>,
}

impl DeviceBuffer {
    /// `cuMemAlloc` of `bytes` (> 0); out of memory is [`GpuError::OutOfMemory`].
    fn alloc(ctx: &Arc<Context>, bytes: u64) -> Result<Self, GpuError> {
        if bytes == 0 {
            return Err(GpuError::Invalid("a device allocation of 0 bytes".into()));
        }
        let len = to_usize(bytes)?;
        ctx.make_current()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is current.
        match call(|| unsafe { sys::cuMemAlloc_v2(&mut ptr, len) }) {
            Ok(()) => Ok(Self {
                ptr,
                len: bytes,
                ctx: Arc::clone(ctx),
            }),
            Err(CallError::Code(CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
                let (mut free, mut total): (usize, usize) = (0, 0);
                // SAFETY: both are valid out-pointers; the context is current.
                let available =
                    match call(|| unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }) {
                        Ok(()) => free as u64,
                        Err(_) => 0,
                    };
                Err(GpuError::OutOfMemory {
                    device: ctx.index,
                    requested: bytes,
                    available,
                })
            }
            Err(e) => Err(cu_error(ctx.index, "cuMemAlloc_v2", e)),
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let ptr = self.ptr;
        let result = self.ctx.make_current().and_then(|()| {
            // SAFETY: `ptr` came from cuMemAlloc_v2 in this context and is freed once here.
            // Its owner waited for the copies that use it before dropping it: a region
            // (`CudaDevice::free_region` and `CudaDevice`'s drop synchronise this device and
            // its peer readers first), or calibration scratch (whose copies are synchronous
            // or synchronised before the measuring function returns).
            check(self.ctx.index, "cuMemFree_v2", || unsafe {
                sys::cuMemFree_v2(ptr)
            })
        });
        if let Err(e) = result {
            tracing::warn!(device = self.ctx.index, error = %e, "freeing device memory");
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`); freed on drop.
#[derive(Debug)]
struct PinnedBuffer {
    /// Start; dangling (and not allocated) when `len` is 0.
    ptr: NonNull<u8>,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: the buffer exclusively owns its host memory (like a `Box<[u8]>`); the context handle
// is `Send`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: `&PinnedBuffer` only gives shared reads of the bytes; mutation needs `&mut`.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// `bytes` of pinned memory with `cuMemHostAlloc` `flags`, zeroed.
    fn alloc(ctx: &Arc<Context>, bytes: usize, flags: c_uint) -> Result<Self, GpuError> {
        if bytes == 0 {
            return Ok(Self {
                ptr: NonNull::dangling(),
                len: 0,
                ctx: Arc::clone(ctx),
            });
        }
        ctx.make_current()?;
        let mut raw: *mut c_void = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        check(ctx.index, "cuMemHostAlloc", || unsafe {
            sys::cuMemHostAlloc(&mut raw, bytes, flags)
        })?;
        let Some(ptr) = NonNull::new(raw.cast::<u8>()) else {
            return Err(GpuError::Device {
                device: ctx.index,
                message: "cuMemHostAlloc returned a null pointer".into(),
            });
        };
        // SAFETY: the driver returned `bytes` writable bytes at `ptr`; zeroing them means the
        // slices handed out later never expose uninitialised memory.
        unsafe { ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        Ok(Self {
            ptr,
            len: bytes,
            ctx: Arc::clone(ctx),
        })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self` (or is dangling with
        // `len == 0`, which is valid for an empty slice); the borrow ties the slice to `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        let raw = self.ptr.as_ptr().cast::<c_void>();
        let index = self.ctx.index;
        let result = self.ctx.make_current().and_then(|()| {
            // A copy from this buffer may still be in flight if its completion was dropped
            // without waiting: wait for all work of the context before freeing. Staging
            // buffers are long-lived (a ring), so this is rare.
            // SAFETY: the context is current; no arguments.
            check(index, "cuCtxSynchronize", || unsafe {
                sys::cuCtxSynchronize()
            })
        });
        if let Err(e) = &result {
            tracing::warn!(device = index, error = %e, "synchronising before freeing pinned memory");
        }
        // SAFETY: `raw` came from cuMemHostAlloc and is freed once here; no copy reads it any
        // more (synchronised above; if that failed, the context is unusable and so are its
        // copies).
        if let Err(e) = check(index, "cuMemFreeHost", || unsafe {
            sys::cuMemFreeHost(raw)
        }) {
            tracing::warn!(device = index, error = %e, "freeing pinned memory");
        }
    }
}

/// The `cuMemHostAlloc` flags: always portable (pinned for every context, so a buffer can
/// feed any GPU of the host), write-combined on request.
fn host_alloc_flags(write_combined: bool) -> c_uint {
    if write_combined {
        sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_WRITECOMBINED
    } else {
        sys::CU_MEMHOSTALLOC_PORTABLE
    }
}

/// Fills a buffer with a non-constant pattern (so nothing can be compressed or skipped).
fn fill_pattern(buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i.wrapping_mul(31) >> 3) as u8;
    }
}

// ---------------------------------------------------------------------------------------
// The public types.

/// A pinned (page-locked) host staging buffer of a CUDA device.
#[derive(Debug)]
pub struct CudaStaging {
    buf: PinnedBuffer,
}

impl Staging for CudaStaging {
    fn capacity(&self) -> usize {
        self.buf.len
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buf.as_mut_slice()
    }

    fn as_slice(&self) -> &[u8] {
        self.buf.as_slice()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A copy in flight on a CUDA stream: an event recorded after it.
struct CudaCompletion {
    /// The event; null once destroyed.
    event: sys::CUevent,
    ctx: Arc<Context>,
    /// The registered host memory the copy reads, kept registered (and mapped) until the
    /// copy is done: dropped only after the event was waited.
    keep: Option<Arc<dyn HostRegistration>>,
}

impl std::fmt::Debug for CudaCompletion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCompletion")
            .field("event", &self.event)
            .field("registered_source", &self.keep.is_some())
            .finish()
    }
}

// SAFETY: a CUevent is an opaque driver handle usable from any thread with its context current
// (made current before every use).
unsafe impl Send for CudaCompletion {}

impl CudaCompletion {
    /// Destroys the event (once).
    fn destroy(&mut self) -> Result<(), GpuError> {
        let event = std::mem::replace(&mut self.event, ptr::null_mut());
        if event.is_null() {
            return Ok(());
        }
        self.ctx.make_current()?;
        // SAFETY: `event` was created by cuEventCreate in this context and, having been swapped
        // out for null, is destroyed exactly once.
        check(self.ctx.index, "cuEventDestroy_v2", || unsafe {
            sys::cuEventDestroy_v2(event)
        })
    }
}

impl Completion for CudaCompletion {
    fn wait(mut self: Box<Self>) -> Result<(), GpuError> {
        self.ctx.make_current()?;
        let event = self.event;
        // SAFETY: `event` is a live event of the current context (only `destroy` nulls it).
        let synced = check(self.ctx.index, "cuEventSynchronize", || unsafe {
            sys::cuEventSynchronize(event)
        });
        let destroyed = self.destroy();
        synced.and(destroyed)
    }
}

impl Drop for CudaCompletion {
    fn drop(&mut self) {
        // Dropped without waiting while it keeps registered memory: the copy must finish
        // before the registration can go (it is released right after this).
        if self.keep.is_some() && !self.event.is_null() {
            let event = self.event;
            let synced = self.ctx.make_current().and_then(|()| {
                // SAFETY: `event` is a live event of the current context (only `destroy`
                // nulls it).
                check(self.ctx.index, "cuEventSynchronize", || unsafe {
                    sys::cuEventSynchronize(event)
                })
            });
            if let Err(e) = synced {
                tracing::warn!(device = self.ctx.index, error = %e, "waiting a dropped copy from registered memory");
            }
        }
        if let Err(e) = self.destroy() {
            tracing::warn!(device = self.ctx.index, error = %e, "destroying a copy event");
        }
    }
}

/// Host memory registered with `cuMemHostRegister` (see the module docs); unregistered on
/// drop, which comes after every copy from it finished.
pub struct CudaRegistration {
    /// Address of the first registered byte (the memory's), for checks and the unregister.
    addr: usize,
    /// Bytes registered.
    len: usize,
    /// The `cuMemHostRegister` flags that succeeded.
    flags: c_uint,
    /// Seconds the registration (page pinning) took.
    register_s: f64,
    /// The context it was registered in (current for the unregister).
    ctx: Arc<Context>,
    /// What keeps the bytes mapped; released after the unregister (fields drop after
    /// `Drop::drop`).
    memory: Arc<dyn HostMemory>,
}

impl std::fmt::Debug for CudaRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRegistration")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("flags", &self.flags)
            .field("register_s", &self.register_s)
            .finish()
    }
}

impl CudaRegistration {
    /// Whether it was registered `CU_MEMHOSTREGISTER_READ_ONLY`.
    pub fn read_only(&self) -> bool {
        self.flags & sys::CU_MEMHOSTREGISTER_READ_ONLY != 0
    }

    /// Seconds `cuMemHostRegister` took (pinning every page).
    pub fn register_s(&self) -> f64 {
        self.register_s
    }

    /// The registered bytes `offset .. offset + len`, after checking that the memory is
    /// still where it was registered.
    fn range(&self, offset: usize, len: usize) -> Result<&[u8], GpuError> {
        let bytes = self.memory.as_bytes();
        if bytes.as_ptr() as usize != self.addr || bytes.len() != self.len {
            return Err(GpuError::Invalid(
                "registered host memory moved since it was registered".into(),
            ));
        }
        offset
            .checked_add(len)
            .and_then(|end| bytes.get(offset..end))
            .ok_or_else(|| {
                GpuError::Invalid(format!(
                    "copy of {len} bytes at {offset} from a registration of {} bytes",
                    self.len
                ))
            })
    }
}

impl HostRegistration for CudaRegistration {
    fn len(&self) -> u64 {
        self.len as u64
    }

    fn device(&self) -> u32 {
        self.ctx.index
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaRegistration {
    fn drop(&mut self) {
        let p = self.memory.as_bytes().as_ptr().cast_mut().cast::<c_void>();
        if p as usize != self.addr {
            tracing::warn!(
                device = self.ctx.index,
                "registered host memory moved; not unregistering it"
            );
            return;
        }
        let index = self.ctx.index;
        let result = self.ctx.make_current().and_then(|()| {
            // SAFETY: `p` is the address registered by `cuMemHostRegister_v2` in
            // `register_host` and is unregistered once here. No copy reads it any more: each
            // copy's completion holds this registration until the copy finished (waited, or
            // synchronised when dropped), and this runs when the last holder is gone. The
            // memory itself stays mapped until `self.memory` is released after this.
            check(index, "cuMemHostUnregister", || unsafe {
                sys::cuMemHostUnregister(p)
            })
        });
        match result {
            Ok(()) => tracing::debug!(device = index, bytes = self.len, "host memory unregistered"),
            Err(e) => tracing::warn!(device = index, error = %e, "unregistering host memory"),
        }
    }
}

/// One GPU through the CUDA driver (see the module docs).
///
/// Create with [`devices`]. All methods may be called from any thread. Copies to one device
/// run in issue order on its stream; a peer copy reads its source as it is when the copy
/// runs, so wait for the source's own completion before issuing it.
#[derive(Debug)]
pub struct CudaDevice {
    info: DeviceInfo,
    /// PCI bus id as the driver reports it (`"0000:3b:00.0"`).
    pci_bus_id: String,
    /// Staging buffers write-combined.
    write_combined: bool,
    // Field order is drop order: the stream is synchronised and destroyed before the regions
    // are freed, and the context is released last (every wrapper also holds an `Arc` of it).
    /// The copy stream.
    stream: Stream,
    /// Extra copy streams for copies from registered memory (`stream` is number 0, these
    /// 1, 2, …), made on first use, never removed before the device is dropped.
    lanes: Mutex<Vec<Stream>>,
    /// Create streams at the greatest priority.
    stream_priority_high: bool,
    /// Live regions (one device allocation per model), freed by `free_region` or on drop.
    /// Read-locked from a span's check until its copy is enqueued; write-locked only to add
    /// or remove one.
    regions: RwLock<Vec<DeviceBuffer>>,
    /// Contexts of the GPUs with peer access to this one, whose streams may run peer copies
    /// reading this device's regions: synchronised before a region is freed.
    peer_readers: Vec<Arc<Context>>,
    ctx: Arc<Context>,
}

impl CudaDevice {
    /// The PCI bus id reported by the driver (`"0000:3b:00.0"`).
    pub fn pci_bus_id(&self) -> &str {
        &self.pci_bus_id
    }

    /// The live regions, read-locked: hold the guard until the copies using a span resolved
    /// through it are enqueued, so the region cannot be freed in between.
    fn regions(&self) -> RwLockReadGuard<'_, Vec<DeviceBuffer>> {
        self.regions.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The device address of `span`'s first byte, after checking that the span lies on this
    /// device inside one of the live `regions` (this device's, read-locked by the caller).
    fn resolve(
        &self,
        regions: &[DeviceBuffer],
        span: &DevSpan,
    ) -> Result<sys::CUdeviceptr, GpuError> {
        if span.device != self.info.index {
            return Err(GpuError::Invalid(format!(
                "span of device {} used on device {}",
                span.device, self.info.index
            )));
        }
        let region = regions.iter().find(|a| a.ptr == span.base).ok_or_else(|| {
            GpuError::Invalid(format!(
                "span base {:#x} is not a live region of device {}",
                span.base, self.info.index
            ))
        })?;
        let end = span
            .offset
            .checked_add(span.len)
            .ok_or_else(|| GpuError::Invalid("span overflow".into()))?;
        if end > region.len {
            return Err(GpuError::Invalid(format!(
                "span [{}, {end}) is outside a region of {} bytes",
                span.offset, region.len
            )));
        }
        Ok(region.ptr + span.offset)
    }

    /// Waits until no copy issued so far can touch this device's memory: its own stream,
    /// and every context that may run peer copies reading from it.
    fn quiesce(&self) -> Result<(), GpuError> {
        self.sync_streams()?;
        for ctx in &self.peer_readers {
            ctx.make_current()?;
            // SAFETY: the context is current; no arguments.
            check(ctx.index, "cuCtxSynchronize", || unsafe {
                sys::cuCtxSynchronize()
            })?;
        }
        self.ctx.make_current()
    }

    /// Waits for every copy stream of this device (the first and the extra ones).
    fn sync_streams(&self) -> Result<(), GpuError> {
        self.stream.synchronize()?;
        for lane in self
            .lanes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            lane.synchronize()?;
        }
        self.ctx.make_current()
    }

    /// Copy stream number `n` (modulo [`MAX_COPY_STREAMS`]): 0 is the first stream, the
    /// others are made on first use. The handle stays valid while the device lives.
    fn lane(&self, n: usize) -> Result<sys::CUstream, GpuError> {
        let n = n % MAX_COPY_STREAMS;
        if n == 0 {
            return Ok(self.stream.raw);
        }
        let mut lanes = self.lanes.lock().unwrap_or_else(PoisonError::into_inner);
        while lanes.len() < n {
            lanes.push(Stream::create(&self.ctx, self.stream_priority_high)?);
        }
        Ok(lanes[n - 1].raw)
    }

    /// Records an event on the copy stream, as the completion of the copies issued so far.
    fn record(&self) -> Result<Box<dyn Completion>, GpuError> {
        self.record_on(self.stream.raw, None)
    }

    /// Records an event on `stream` (a live stream of this device, its context current), as
    /// the completion of the copies issued on it so far; the completion keeps `keep`.
    fn record_on(
        &self,
        stream: sys::CUstream,
        keep: Option<Arc<dyn HostRegistration>>,
    ) -> Result<Box<dyn Completion>, GpuError> {
        let index = self.info.index;
        let mut event: sys::CUevent = ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        // SAFETY: `event` is a valid out-pointer; the caller made the context current.
        check(index, "cuEventCreate", || unsafe {
            sys::cuEventCreate(&mut event, flags)
        })?;
        // Owned from here on: destroyed on drop even if recording fails.
        let completion = Box::new(CudaCompletion {
            event,
            ctx: Arc::clone(&self.ctx),
            keep,
        });
        // SAFETY: `event` and `stream` are live handles of the current context.
        check(index, "cuEventRecord", || unsafe {
            sys::cuEventRecord(event, stream)
        })?;
        Ok(completion)
    }

    /// Issues `copies` back-to-back async copies of `size` bytes from `src` to `dst` on the
    /// copy stream and returns the seconds until they all finished.
    fn timed_htod(
        &self,
        dst: &DeviceBuffer,
        src: &PinnedBuffer,
        size: usize,
        copies: usize,
    ) -> Result<f64, GpuError> {
        assert!(
            size <= src.len && size as u64 <= dst.len,
            "timed copy larger than its buffers"
        );
        let index = self.info.index;
        // Earlier work on the stream must not count.
        self.stream.synchronize()?;
        let (dptr, host, stream) = (dst.ptr, src.ptr.as_ptr().cast::<c_void>(), self.stream.raw);
        let start = Instant::now();
        for _ in 0..copies {
            // SAFETY: `host` has at least `size` readable pinned bytes and `dptr` at least
            // `size` device bytes (asserted above); both outlive the copy, which is waited
            // for below before this function returns.
            check(index, "cuMemcpyHtoDAsync_v2", || unsafe {
                sys::cuMemcpyHtoDAsync_v2(dptr, host, size, stream)
            })?;
        }
        self.stream.synchronize()?;
        Ok(start.elapsed().as_secs_f64().max(1e-9))
    }

    /// Throughput of single copies of `bytes` from a fresh pinned buffer with `flags`, best
    /// of three after a warm-up, bytes/s.
    fn flag_run(&self, dst: &DeviceBuffer, bytes: usize, flags: c_uint) -> Result<f64, GpuError> {
        let mut src = PinnedBuffer::alloc(&self.ctx, bytes, flags)?;
        fill_pattern(src.as_mut_slice());
        self.timed_htod(dst, &src, bytes, 1)?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            best = best.min(self.timed_htod(dst, &src, bytes, 1)?);
        }
        Ok(bytes as f64 / best)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Copies into or out of the regions may still be running: wait before anything is
        // freed. (The stream's own drop synchronises too; this covers the regions regardless
        // of order, and the peers' copies reading them.)
        if let Err(e) = self.quiesce() {
            tracing::warn!(device = self.info.index, error = %e, "synchronising before drop");
        }
    }
}

impl Device for CudaDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn alloc_region(&self, bytes: u64) -> Result<DevSpan, GpuError> {
        self.ctx.make_current()?;
        let buf = DeviceBuffer::alloc(&self.ctx, bytes)?;
        let span = DevSpan {
            device: self.info.index,
            base: buf.ptr,
            offset: 0,
            len: bytes,
        };
        self.regions
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .push(buf);
        tracing::debug!(device = self.info.index, bytes, "region allocated");
        Ok(span)
    }

    fn free_region(&self, span: DevSpan) -> Result<(), GpuError> {
        if span.device != self.info.index {
            return Err(GpuError::Invalid(format!(
                "span of device {} freed on device {}",
                span.device, self.info.index
            )));
        }
        // Out of the list first (waiting for copies being enqueued): no new copy can
        // resolve it from here on.
        let buf = {
            let mut regions = self.regions.write().unwrap_or_else(PoisonError::into_inner);
            let at = regions
                .iter()
                .position(|r| r.ptr == span.base)
                .ok_or_else(|| {
                    GpuError::Invalid(format!(
                        "span base {:#x} is not a live region of device {}",
                        span.base, self.info.index
                    ))
                })?;
            regions.swap_remove(at)
        };
        // Then wait for the copies already enqueued; if that fails the contexts are unusable
        // and so are their copies, and the memory is freed regardless.
        if let Err(e) = self.quiesce() {
            tracing::warn!(device = self.info.index, error = %e, "synchronising before freeing a region");
        }
        let bytes = buf.len;
        drop(buf);
        tracing::debug!(device = self.info.index, bytes, "region freed");
        Ok(())
    }

    fn allocated_bytes(&self) -> u64 {
        self.regions().iter().map(|r| r.len).sum()
    }

    fn free_memory(&self) -> Result<u64, GpuError> {
        self.ctx.make_current()?;
        let (mut free, mut total): (usize, usize) = (0, 0);
        // SAFETY: both are valid out-pointers; the context is current.
        check(self.info.index, "cuMemGetInfo_v2", || unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(free as u64)
    }

    fn alloc_staging(&self, bytes: usize) -> Result<Box<dyn Staging>, GpuError> {
        self.ctx.make_current()?;
        let buf = PinnedBuffer::alloc(&self.ctx, bytes, host_alloc_flags(self.write_combined))?;
        Ok(Box::new(CudaStaging { buf }))
    }

    fn copy_htod(&self, dst: DevSpan, src: &dyn Staging) -> Result<Box<dyn Completion>, GpuError> {
        self.ctx.make_current()?;
        let regions = self.regions();
        let dptr = self.resolve(&regions, &dst)?;
        let bytes = src.as_slice();
        let len = to_usize(dst.len)?;
        if len > bytes.len() || len > src.capacity() {
            return Err(GpuError::Invalid(format!(
                "copy of {len} bytes from a staging buffer of {} bytes",
                src.capacity()
            )));
        }
        if len > 0 {
            let (host, stream) = (bytes.as_ptr().cast::<c_void>(), self.stream.raw);
            // SAFETY: `host` has at least `len` readable bytes (checked above) and `dptr` at
            // least `len` bytes inside a live region of this device (`resolve`; the region
            // list stays read-locked until the copy is enqueued, and a freed region's copies
            // are waited for before `cuMemFree`). The trait's contract keeps `src` unchanged
            // until the completion is waited; should the buffer be freed first,
            // `PinnedBuffer`'s drop synchronises the context before freeing, and pageable
            // sources are staged by the driver before this returns.
            check(self.info.index, "cuMemcpyHtoDAsync_v2", || unsafe {
                sys::cuMemcpyHtoDAsync_v2(dptr, host, len, stream)
            })?;
        }
        drop(regions);
        self.record()
    }

    fn register_host(
        &self,
        memory: Arc<dyn HostMemory>,
    ) -> Result<Arc<dyn HostRegistration>, GpuError> {
        let index = self.info.index;
        let bytes = memory.as_bytes();
        let (addr, len) = (bytes.as_ptr() as usize, bytes.len());
        if len == 0 {
            return Err(GpuError::Invalid(
                "registering 0 bytes of host memory".into(),
            ));
        }
        if addr % MIN_PAGE != 0 {
            return Err(GpuError::Unsupported(format!(
                "host memory at {addr:#x} does not start on a page"
            )));
        }
        let p = bytes.as_ptr().cast_mut().cast::<c_void>();
        let portable = sys::CU_MEMHOSTREGISTER_PORTABLE;
        let attempts: &[c_uint] = if memory.read_only() {
            &[portable | sys::CU_MEMHOSTREGISTER_READ_ONLY, portable]
        } else {
            &[portable]
        };
        self.ctx.make_current()?;
        let mut failures = Vec::new();
        for &flags in attempts {
            let start = Instant::now();
            // SAFETY: `p .. p + len` is host memory mapped for as long as `memory` lives
            // (the `HostMemory` contract), and the registration made from it below holds
            // `memory` until after `cuMemHostUnregister`. The driver only pins the pages and
            // records the range; with READ_ONLY it maps them read-only for the device, and
            // without it nothing writes them either (only host → device copies read them).
            // The context is current.
            match call(|| unsafe { sys::cuMemHostRegister_v2(p, len, flags) }) {
                Ok(()) => {
                    let register_s = start.elapsed().as_secs_f64();
                    tracing::debug!(
                        device = index,
                        bytes = len,
                        flags,
                        register_s,
                        "host memory registered"
                    );
                    return Ok(Arc::new(CudaRegistration {
                        addr,
                        len,
                        flags,
                        register_s,
                        ctx: Arc::clone(&self.ctx),
                        memory,
                    }));
                }
                Err(e) => failures.push(format!(
                    "flags {flags:#x}: {}",
                    cu_error(index, "cuMemHostRegister_v2", e)
                )),
            }
        }
        Err(GpuError::Device {
            device: index,
            message: format!(
                "registering {len} bytes of host memory failed ({})",
                failures.join("; ")
            ),
        })
    }

    fn copy_htod_registered(
        &self,
        dst: DevSpan,
        src: &Arc<dyn HostRegistration>,
        offset: u64,
        stream: usize,
    ) -> Result<Box<dyn Completion>, GpuError> {
        let Some(reg) = src.as_any().downcast_ref::<CudaRegistration>() else {
            return Err(GpuError::Unsupported(format!(
                "copy to CUDA device {} from another backend's registration",
                self.info.index
            )));
        };
        let len = to_usize(dst.len)?;
        let host = reg.range(to_usize(offset)?, len)?;
        self.ctx.make_current()?;
        let lane = self.lane(stream)?;
        let regions = self.regions();
        let dptr = self.resolve(&regions, &dst)?;
        if len > 0 {
            let host = host.as_ptr().cast::<c_void>();
            // SAFETY: `host` has `len` readable bytes of registered (portable, so usable from
            // this context) host memory (`range` checked them against the registration);
            // `dptr` has `len` bytes inside a live region of this device (`resolve`; the
            // region list stays read-locked until the copy is enqueued, and a freed region's
            // copies are waited for before `cuMemFree`); `lane` is a live stream of the
            // current context. The memory stays registered and mapped until the copy is
            // done: the completion returned below holds the registration (if recording it
            // fails, the stream is synchronised before returning).
            check(self.info.index, "cuMemcpyHtoDAsync_v2", || unsafe {
                sys::cuMemcpyHtoDAsync_v2(dptr, host, len, lane)
            })?;
        }
        drop(regions);
        match self.record_on(lane, Some(Arc::clone(src))) {
            Ok(c) => Ok(c),
            Err(e) => {
                // No event to wait on: wait for the copy here, before the caller may drop
                // the registration.
                let raw = lane;
                // SAFETY: `raw` is a live stream of the current context.
                let _ = check(self.info.index, "cuStreamSynchronize", || unsafe {
                    sys::cuStreamSynchronize(raw)
                });
                Err(e)
            }
        }
    }

    fn copy_peer(
        &self,
        dst: DevSpan,
        src_device: &dyn Device,
        src: DevSpan,
    ) -> Result<Box<dyn Completion>, GpuError> {
        self.ctx.make_current()?;
        let Some(peer) = src_device.as_any().downcast_ref::<Self>() else {
            return Err(GpuError::Unsupported(format!(
                "peer copy to CUDA device {} from a {} device",
                self.info.index,
                src_device.info().kind
            )));
        };
        if !self.info.peers.iter().any(|&(i, _)| i == peer.info.index) {
            return Err(GpuError::Unsupported(format!(
                "device {} has no peer access to device {}",
                self.info.index, peer.info.index
            )));
        }
        if dst.len != src.len {
            return Err(GpuError::Invalid(format!(
                "peer copy of {} bytes into a span of {} bytes",
                src.len, dst.len
            )));
        }
        // Both region lists, lower device index first (a free write-locks one list only, so
        // this order cannot deadlock).
        let (dst_regions, src_regions) = if self.info.index < peer.info.index {
            let d = self.regions();
            (d, peer.regions())
        } else {
            let s = peer.regions();
            (self.regions(), s)
        };
        let dptr = self.resolve(&dst_regions, &dst)?;
        let sptr = peer.resolve(&src_regions, &src)?;
        let len = to_usize(dst.len)?;
        if len > 0 {
            let (dctx, sctx, stream) = (self.ctx.raw, peer.ctx.raw, self.stream.raw);
            // SAFETY: both ranges lie inside live regions of their devices (`resolve`, both
            // lists read-locked until the copy is enqueued; freeing a region waits for this
            // stream, a peer reader of the source device), the contexts are the primary
            // contexts owning them, and the stream belongs to the current (destination)
            // context.
            check(self.info.index, "cuMemcpyPeerAsync", || unsafe {
                sys::cuMemcpyPeerAsync(dptr, dctx, sptr, sctx, len, stream)
            })?;
        }
        drop((dst_regions, src_regions));
        self.record()
    }

    fn read(&self, src: DevSpan) -> Result<Vec<u8>, GpuError> {
        self.ctx.make_current()?;
        let regions = self.regions();
        let sptr = self.resolve(&regions, &src)?;
        let len = to_usize(src.len)?;
        // cuMemcpyDtoH runs on the legacy default stream, which does not wait for the
        // non-blocking copy streams: wait for earlier copies explicitly.
        self.sync_streams()?;
        let mut out = vec![0u8; len];
        if len > 0 {
            let host = out.as_mut_ptr().cast::<c_void>();
            // SAFETY: `host` has `len` writable bytes; `sptr` has `len` readable bytes inside
            // a live region of this device (`resolve`, read-locked until the call returns);
            // the call is synchronous.
            check(self.info.index, "cuMemcpyDtoH_v2", || unsafe {
                sys::cuMemcpyDtoH_v2(host, sptr, len)
            })?;
        }
        Ok(out)
    }

    fn ipc_handle(&self, span: DevSpan) -> Result<IpcHandle, GpuError> {
        self.ctx.make_current()?;
        let regions = self.regions();
        self.resolve(&regions, &span)?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        let base = span.base;
        // SAFETY: `handle` is a valid out-pointer; `base` is the start of a live region of
        // this device (checked by `resolve`, read-locked until the call returns), as
        // cuIpcGetMemHandle requires. The handle names that region's allocation alone.
        check(self.info.index, "cuIpcGetMemHandle", || unsafe {
            sys::cuIpcGetMemHandle(&mut handle, base)
        })?;
        drop(regions);
        let bytes = handle.reserved.map(|c| c as u8);
        Ok(IpcHandle::CudaIpc {
            handle: hex::encode(bytes),
            offset: span.offset,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Enumeration.

/// One opened device before peers are known.
struct Opened {
    ctx: Arc<Context>,
    stream: Stream,
    name: String,
    memory_bytes: u64,
    pci_bus_id: String,
}

fn open(ordinal: u32, opts: &CudaOptions) -> Result<Opened, GpuError> {
    let ctx = Arc::new(Context::retain(ordinal)?);
    ctx.make_current()?;
    let dev = ctx.cu_device;

    let mut name: [c_char; 256] = [0; 256];
    // SAFETY: `name` has 256 writable bytes, the length passed.
    check(ordinal, "cuDeviceGetName", || unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev)
    })?;
    let mut total: usize = 0;
    // SAFETY: `total` is a valid out-pointer.
    check(ordinal, "cuDeviceTotalMem_v2", || unsafe {
        sys::cuDeviceTotalMem_v2(&mut total, dev)
    })?;
    let mut bus: [c_char; 64] = [0; 64];
    // SAFETY: `bus` has 64 writable bytes, the length passed (ids need 13 with the nul).
    check(ordinal, "cuDeviceGetPCIBusId", || unsafe {
        sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 64, dev)
    })?;
    let stream = Stream::create(&ctx, opts.stream_priority_high)?;
    Ok(Opened {
        ctx,
        stream,
        name: c_string(&name),
        memory_bytes: total as u64,
        pci_bus_id: c_string(&bus),
    })
}

/// Enables peer access from `from`'s context to `to`'s when the hardware allows; whether it
/// is enabled now.
fn enable_peer(from: &Context, to: &Context) -> Result<bool, GpuError> {
    let mut can: c_int = 0;
    let (a, b) = (from.cu_device, to.cu_device);
    // SAFETY: `can` is a valid out-pointer; both are device handles from cuDeviceGet.
    check(from.index, "cuDeviceCanAccessPeer", || unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, a, b)
    })?;
    if can == 0 {
        return Ok(false);
    }
    from.make_current()?;
    let peer = to.raw;
    // SAFETY: `peer` is a live primary context; the current context is `from`'s.
    match call(|| unsafe { sys::cuCtxEnablePeerAccess(peer, 0) }) {
        Ok(()) | Err(CallError::Code(CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)) => Ok(true),
        Err(e) => {
            let e = cu_error(from.index, "cuCtxEnablePeerAccess", e);
            tracing::warn!(device = from.index, peer = to.index, error = %e, "peer access not enabled");
            Ok(false)
        }
    }
}

/// Opens every CUDA device of this host, with peer access enabled between those that
/// support it (see the module docs).
///
/// [`GpuError::NoDriver`] when the driver library is missing or cannot initialise; an empty
/// list when the driver sees no device.
pub fn devices(opts: &CudaOptions) -> Result<Vec<Arc<CudaDevice>>, GpuError> {
    driver_available()?;
    // SAFETY: cuInit has no preconditions; it is the first driver call.
    match call(|| unsafe { sys::cuInit(0) }) {
        Ok(()) => {}
        Err(CallError::Code(CUresult::CUDA_ERROR_NO_DEVICE)) => return Ok(Vec::new()),
        Err(CallError::Code(code)) => {
            return Err(GpuError::NoDriver(format!("cuInit failed: {code:?}")));
        }
        Err(CallError::Panicked(msg)) => {
            return Err(GpuError::NoDriver(format!(
                "the CUDA driver could not be loaded: {msg}"
            )));
        }
    }
    let mut count: c_int = 0;
    // SAFETY: `count` is a valid out-pointer; the driver is initialised.
    check(0, "cuDeviceGetCount", || unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    let count = u32::try_from(count).unwrap_or(0);
    let opened = (0..count)
        .map(|ordinal| open(ordinal, opts))
        .collect::<Result<Vec<_>, _>>()?;

    let mut peers: Vec<Vec<(u32, u64)>> = vec![Vec::new(); opened.len()];
    for (i, from) in opened.iter().enumerate() {
        for to in &opened {
            if from.ctx.index != to.ctx.index && enable_peer(&from.ctx, &to.ctx)? {
                peers[i].push((to.ctx.index, 0));
            }
        }
    }

    // The GPUs that may peer-copy out of each device (those with access to it).
    let contexts: Vec<Arc<Context>> = opened.iter().map(|o| Arc::clone(&o.ctx)).collect();
    let readers_of = |index: u32| -> Vec<Arc<Context>> {
        peers
            .iter()
            .zip(&contexts)
            .filter(|(p, _)| p.iter().any(|&(to, _)| to == index))
            .map(|(_, ctx)| Arc::clone(ctx))
            .collect()
    };
    let peer_readers: Vec<Vec<Arc<Context>>> =
        opened.iter().map(|o| readers_of(o.ctx.index)).collect();
    drop(contexts);

    let devices = opened
        .into_iter()
        .zip(peers)
        .zip(peer_readers)
        .map(|((o, peers), peer_readers)| {
            let info = DeviceInfo {
                index: o.ctx.index,
                name: o.name,
                kind: DeviceKind::Cuda,
                memory_bytes: o.memory_bytes,
                pcie_switch: pcie_switch(&o.pci_bus_id),
                peers,
                numa_node: crate::numa::node_of_pci(&o.pci_bus_id),
            };
            tracing::info!(
                device = info.index,
                name = %info.name,
                memory_bytes = info.memory_bytes,
                pci = %o.pci_bus_id,
                pcie_switch = %info.pcie_switch,
                peers = ?info.peers,
                numa_node = ?info.numa_node,
                "CUDA device opened"
            );
            Arc::new(CudaDevice {
                info,
                pci_bus_id: o.pci_bus_id,
                write_combined: opts.write_combined,
                stream: o.stream,
                lanes: Mutex::new(Vec::new()),
                stream_priority_high: opts.stream_priority_high,
                regions: RwLock::new(Vec::new()),
                peer_readers,
                ctx: o.ctx,
            })
        })
        .collect();
    Ok(devices)
}

// ---------------------------------------------------------------------------------------
// PCIe switch id.

/// A PCI address `domain:bus:device.function` in sysfs form (`0000:3b:00.0`, lowercase,
/// 4-digit domain), or `None` when `id` is not one.
fn normalize_bus_id(id: &str) -> Option<String> {
    let mut parts = id.trim().split(':');
    let (domain, bus, devfn) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let (dev, func) = devfn.split_once('.')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// The switch id from a device's canonical sysfs path
/// (`/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:08.0/0000:3d:00.0`): the
/// grandparent when it is a PCI function (a switch's upstream port), else the parent when
/// it is one (a root port the GPU hangs off directly).
fn switch_from_sysfs_path(path: &Path) -> Option<String> {
    let names: Vec<&str> = path
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .collect();
    let is_function = |s: &&str| normalize_bus_id(s).is_some();
    let parent = names.len().checked_sub(2).and_then(|i| names.get(i))?;
    let grandparent = names.len().checked_sub(3).and_then(|i| names.get(i));
    match grandparent {
        Some(g) if is_function(g) => Some((*g).to_owned()),
        _ if is_function(parent) => Some((*parent).to_owned()),
        _ => None,
    }
}

/// The `domain:bus` part of a bus id (`"0000:3b"`).
fn domain_bus(id: &str) -> String {
    match id.rsplit_once(':') {
        Some((domain_bus, _)) => domain_bus.to_owned(),
        None => String::new(),
    }
}

/// The PCIe switch id of a device (see the module docs): sysfs when readable, else the
/// `domain:bus` part of the bus id; "" when the id cannot be parsed.
fn pcie_switch(bus_id: &str) -> String {
    let Some(id) = normalize_bus_id(bus_id) else {
        return String::new();
    };
    std::fs::canonicalize(Path::new("/sys/bus/pci/devices").join(&id))
        .ok()
        .and_then(|p| switch_from_sysfs_path(&p))
        .unwrap_or_else(|| domain_bus(&id))
}

// ---------------------------------------------------------------------------------------
// Calibration.

/// Measured host → device throughput by copy size (see [`calibrate`]).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Calibration {
    /// `(copy size in bytes, throughput in bytes/s)`, in the order of the sizes asked for.
    pub points: Vec<(usize, f64)>,
    /// The smallest size reaching 90% of the best throughput: the staging chunk size to use
    /// (Torpor §4.3's "elbow point", about 2 MB on their testbed).
    pub elbow: usize,
    /// Throughput of one large copy from a write-combined pinned buffer, bytes/s.
    pub write_combined_bps: f64,
    /// Throughput of one large copy from a plain (portable, cached) pinned buffer, bytes/s.
    pub portable_bps: f64,
}

/// Copy sizes to calibrate with: 64 KiB to 64 MiB, powers of two.
pub fn default_sizes() -> Vec<usize> {
    (16..=26).map(|p| 1usize << p).collect()
}

/// The elbow of measured points: the smallest size whose throughput is at least 90% of the
/// best; 0 when there are no points.
fn elbow_of(points: &[(usize, f64)]) -> usize {
    let best = points.iter().map(|&(_, bps)| bps).fold(0.0, f64::max);
    points
        .iter()
        .filter(|&&(_, bps)| bps >= 0.9 * best)
        .map(|&(size, _)| size)
        .min()
        .unwrap_or(0)
}

/// Measures host → device throughput on `dev`'s copy stream for each copy size: for each
/// size, `total_per_size` bytes (at least one copy) as back-to-back async copies of that
/// size from one pinned buffer (flags from the device's options) into a scratch device
/// buffer, timed until the stream is idle. Then one copy of `total_per_size` bytes from a
/// write-combined and from a portable pinned buffer (best of three each), to tell which flag
/// is faster here.
///
/// Allocates `max(max(sizes), total_per_size)` bytes of device memory and at most as much
/// pinned memory at a time; runs for about `(sizes.len() + 8) × total_per_size / rate`.
pub fn calibrate(
    dev: &CudaDevice,
    sizes: &[usize],
    total_per_size: usize,
) -> Result<Calibration, GpuError> {
    let Some(&max_size) = sizes.iter().max() else {
        return Err(GpuError::Invalid("calibration without sizes".into()));
    };
    if sizes.contains(&0) || total_per_size == 0 {
        return Err(GpuError::Invalid(
            "calibration sizes and total must be > 0".into(),
        ));
    }
    dev.ctx.make_current()?;
    let scratch = DeviceBuffer::alloc(&dev.ctx, max_size.max(total_per_size) as u64)?;

    let mut src = PinnedBuffer::alloc(&dev.ctx, max_size, host_alloc_flags(dev.write_combined))?;
    fill_pattern(src.as_mut_slice());
    dev.timed_htod(&scratch, &src, max_size, 1)?; // warm-up
    let mut points = Vec::with_capacity(sizes.len());
    for &size in sizes {
        let copies = (total_per_size / size).max(1);
        let secs = dev.timed_htod(&scratch, &src, size, copies)?;
        let bps = (copies * size) as f64 / secs;
        tracing::debug!(device = dev.info.index, size, bps, "calibration point");
        points.push((size, bps));
    }
    drop(src);

    let elbow = elbow_of(&points);
    let write_combined_bps = dev.flag_run(&scratch, total_per_size, host_alloc_flags(true))?;
    let portable_bps = dev.flag_run(&scratch, total_per_size, host_alloc_flags(false))?;
    Ok(Calibration {
        points,
        elbow,
        write_combined_bps,
        portable_bps,
    })
}

/// The reference host → device rate: synchronous `cuMemcpyHtoD` of `bytes` from one plain
/// pinned buffer into device memory, best of `reps`, bytes/s. The pipelined loader is
/// compared with this.
pub fn peak_htod(dev: &CudaDevice, bytes: usize, reps: usize) -> Result<f64, GpuError> {
    if bytes == 0 || reps == 0 {
        return Err(GpuError::Invalid(
            "peak_htod needs bytes > 0 and reps > 0".into(),
        ));
    }
    dev.ctx.make_current()?;
    let dst = DeviceBuffer::alloc(&dev.ctx, bytes as u64)?;
    let mut src = PinnedBuffer::alloc(&dev.ctx, bytes, host_alloc_flags(false))?;
    fill_pattern(src.as_mut_slice());
    let (dptr, host) = (dst.ptr, src.ptr.as_ptr().cast::<c_void>());
    let index = dev.info.index;
    let mut best = f64::INFINITY;
    // One warm-up copy, then the timed ones.
    for rep in 0..=reps {
        let start = Instant::now();
        // SAFETY: `host` has `bytes` readable pinned bytes and `dptr` `bytes` device bytes,
        // both alive for the call, which is synchronous for pinned sources.
        check(index, "cuMemcpyHtoD_v2", || unsafe {
            sys::cuMemcpyHtoD_v2(dptr, host, bytes)
        })?;
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        if rep > 0 {
            best = best.min(secs);
        }
    }
    Ok(bytes as f64 / best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_a_normal_condition() {
        if driver_available().is_ok() {
            eprintln!("SKIPPED: a CUDA driver is installed on this host");
            return;
        }
        match devices(&CudaOptions::default()) {
            Err(GpuError::NoDriver(msg)) => assert!(msg.contains("libcuda"), "{msg}"),
            Err(e) => panic!("expected NoDriver, got {e}"),
            Ok(d) => panic!("expected NoDriver, got {} devices", d.len()),
        }
    }

    #[test]
    fn a_cudarc_panic_becomes_an_error() {
        if driver_available().is_ok() {
            eprintln!("SKIPPED: a CUDA driver is installed on this host");
            return;
        }
        // Without libcuda, cudarc panics inside its loader; the guard must turn it into an
        // error (the panic message still goes to the captured test output).
        // SAFETY: cuInit has no preconditions.
        let err = call(|| unsafe { sys::cuInit(0) }).expect_err("no driver here");
        assert!(matches!(err, CallError::Panicked(_)), "{err:?}");
        let mapped = cu_error(0, "cuInit", err);
        assert!(mapped.to_string().contains("cuInit"), "{mapped}");
        // And it stays an error on a second call (cudarc's OnceLock is not poisoned).
        // SAFETY: as above.
        assert!(call(|| unsafe { sys::cuInit(0) }).is_err());
    }

    #[test]
    fn driver_codes_are_named() {
        let e = cu_error(
            3,
            "cuMemAlloc_v2",
            CallError::Code(CUresult::CUDA_ERROR_INVALID_VALUE),
        );
        match e {
            GpuError::Device { device, message } => {
                assert_eq!(device, 3);
                assert_eq!(message, "cuMemAlloc_v2 failed: CUDA_ERROR_INVALID_VALUE");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn options_default() {
        let o = CudaOptions::default();
        assert!(!o.write_combined);
        assert!(o.stream_priority_high);
        assert_eq!(host_alloc_flags(false), sys::CU_MEMHOSTALLOC_PORTABLE);
        assert_ne!(
            host_alloc_flags(true) & sys::CU_MEMHOSTALLOC_WRITECOMBINED,
            0
        );
    }

    #[test]
    fn default_sizes_span_64k_to_64m() {
        let s = default_sizes();
        assert_eq!(s.first(), Some(&(64 << 10)));
        assert_eq!(s.last(), Some(&(64 << 20)));
        assert!(s.windows(2).all(|w| w[1] == 2 * w[0]));
    }

    #[test]
    fn elbow_is_the_smallest_size_near_the_best() {
        let pts = [
            (64 << 10, 5e9),
            (1 << 20, 18e9),
            (2 << 20, 23e9),
            (4 << 20, 24.5e9),
            (8 << 20, 25e9),
        ];
        assert_eq!(elbow_of(&pts), 2 << 20);
        // Unordered points, a noisy dip after the elbow.
        let pts = [(8 << 20, 24e9), (1 << 20, 25e9), (512 << 10, 10e9)];
        assert_eq!(elbow_of(&pts), 1 << 20);
        assert_eq!(elbow_of(&[]), 0);
    }

    #[test]
    fn bus_ids_are_normalized() {
        assert_eq!(
            normalize_bus_id("00000000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            normalize_bus_id("0000:3b:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(normalize_bus_id("pci0000:3a"), None);
        assert_eq!(normalize_bus_id("garbage"), None);
        assert_eq!(domain_bus("0000:3b:00.0"), "0000:3b");
        assert_eq!(pcie_switch("not a bus id"), "");
    }

    #[test]
    fn switch_id_from_sysfs_paths() {
        // Two GPUs behind one switch (upstream port 0000:3b:00.0).
        let a = Path::new(
            "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:08.0/0000:3d:00.0",
        );
        let b = Path::new(
            "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:10.0/0000:3e:00.0",
        );
        assert_eq!(switch_from_sysfs_path(a).as_deref(), Some("0000:3b:00.0"));
        assert_eq!(switch_from_sysfs_path(a), switch_from_sysfs_path(b));
        // A GPU on a root port: its own link.
        let c = Path::new("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0");
        assert_eq!(switch_from_sysfs_path(c).as_deref(), Some("0000:00:01.0"));
        // A GPU on the root bus (VMs): unknown here, the caller falls back to domain:bus.
        let d = Path::new("/sys/devices/pci0000:00/0000:00:05.0");
        assert_eq!(switch_from_sysfs_path(d), None);
    }

    // ---- Hardware tests: `cargo test -p gpu-loader cuda -- --ignored` on a GPU host. ----

    fn gpus() -> Vec<Arc<CudaDevice>> {
        let d = devices(&CudaOptions::default()).expect("CUDA devices");
        assert!(!d.is_empty(), "no CUDA device visible");
        d
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn each_gpu_reports_the_numa_node_sysfs_gives_its_pci_address() {
        for dev in gpus() {
            let want = crate::numa::node_of_pci(dev.pci_bus_id());
            eprintln!(
                "GPU {} at {}: NUMA node {:?}",
                dev.info().index,
                dev.pci_bus_id(),
                dev.info().numa_node
            );
            assert_eq!(dev.info().numa_node, want);
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn htod_round_trip() {
        let dev = &gpus()[0];
        assert_eq!(dev.info().kind, DeviceKind::Cuda);
        let region = dev.alloc_region(64 << 20).expect("region");
        assert_eq!((region.offset, region.len), (0, 64 << 20));
        let mut staging = dev.alloc_staging(4 << 20).expect("staging");
        assert_eq!(staging.capacity(), 4 << 20);
        assert!(staging.as_slice().iter().all(|&b| b == 0));
        for (k, b) in staging.as_mut_slice().iter_mut().enumerate() {
            *b = (k % 251) as u8;
        }
        let cases: [(u64, u64); 5] = [
            (0, 4 << 20),
            (1, 1_000_003),
            (4096, 12_345),
            (12_345, 1),
            ((64 << 20) - (4 << 20), 4 << 20),
        ];
        for (off, len) in cases {
            let span = region.sub(off, len).expect("span");
            dev.copy_htod(span, staging.as_ref())
                .expect("copy")
                .wait()
                .expect("wait");
            let back = dev.read(span).expect("read");
            assert_eq!(back, staging.as_slice()[..len as usize], "offset {off}");
        }
        // Several copies in flight, waited in order.
        let spans: Vec<DevSpan> = (0..8)
            .map(|k| region.sub(k * (4 << 20), 4 << 20).expect("span"))
            .collect();
        let pending: Vec<_> = spans
            .iter()
            .map(|&s| dev.copy_htod(s, staging.as_ref()).expect("copy"))
            .collect();
        for c in pending {
            c.wait().expect("wait");
        }
        for s in spans {
            assert_eq!(dev.read(s).expect("read"), staging.as_slice());
        }
        // A completion dropped without waiting is harmless.
        drop(dev.copy_htod(region.sub(0, 1024).expect("span"), staging.as_ref()));
        // Bad spans are refused, not copied.
        let past_end = DevSpan {
            offset: 63 << 20,
            len: 2 << 20,
            ..region
        };
        assert!(matches!(
            dev.copy_htod(past_end, staging.as_ref()),
            Err(GpuError::Invalid(_))
        ));
        let too_long = region.sub(0, 5 << 20).expect("span");
        assert!(matches!(
            dev.copy_htod(too_long, staging.as_ref()),
            Err(GpuError::Invalid(_))
        ));
        let other_device = DevSpan {
            device: dev.info().index + 1,
            ..region
        };
        assert!(matches!(dev.read(other_device), Err(GpuError::Invalid(_))));
    }

    /// A file of `len` patterned bytes in `dir`, mapped read-only.
    fn mapped_pattern(dir: &Path, len: usize) -> Arc<crate::mapped::MappedFile> {
        let path = dir.join("shard.bin");
        let bytes: Vec<u8> = (0..len).map(|k| (k * 13 % 241) as u8).collect();
        std::fs::write(&path, &bytes).expect("write the shard file");
        crate::mapped::MappedFile::open(&path).expect("map the shard file")
    }

    /// Registers `map` on `dev`, copies pieces of it on several streams, reads them back;
    /// then checks that dropping the registration unregistered the memory.
    fn registered_round_trip(dev: &Arc<CudaDevice>, map: &Arc<crate::mapped::MappedFile>) {
        let len = map.as_slice().len() as u64;
        let mem: Arc<dyn HostMemory> = map.clone();
        let reg = dev
            .register_host(mem.clone())
            .expect("register the mapping");
        assert_eq!(reg.len(), len);
        assert_eq!(reg.device(), dev.info().index);
        let cuda_reg = reg
            .as_any()
            .downcast_ref::<CudaRegistration>()
            .expect("a CUDA registration");
        eprintln!(
            "registered {len} bytes in {:.4} s, read-only flag: {}",
            cuda_reg.register_s(),
            cuda_reg.read_only()
        );
        // Registering the same memory again while it is registered is refused.
        assert!(dev.register_host(mem.clone()).is_err());

        let region = dev.alloc_region(len + (1 << 20)).expect("region");
        let cases: [(u64, u64, u64); 6] = [
            (0, 0, 4 << 20),
            (4 << 20, 4 << 20, 4 << 20),
            (123, 77, 1_000_003),
            (len - 5, 1 << 20, 5),
            (8 << 20, 9 << 20, len - (8 << 20)),
            (0, 3, len),
        ];
        let mut pending = Vec::new();
        for (k, &(src_off, dst_off, n)) in cases.iter().enumerate() {
            let span = region.sub(dst_off, n).expect("span");
            let c = dev
                .copy_htod_registered(span, &reg, src_off, k)
                .expect("copy from registered memory");
            pending.push((span, src_off, n, c));
        }
        // Copies on different streams may overlap: check each on its own, after its wait.
        for (span, src_off, n, c) in pending {
            c.wait().expect("wait");
            let want = &map.as_slice()[src_off as usize..(src_off + n) as usize];
            // Later copies may have overwritten overlapping bytes: re-copy alone to check.
            let c = dev
                .copy_htod_registered(span, &reg, src_off, 1)
                .expect("copy");
            c.wait().expect("wait");
            assert!(
                dev.read(span).expect("read") == want,
                "offset {src_off}, {n} bytes"
            );
        }
        // Out of the registration, or past the region: refused, not copied.
        assert!(matches!(
            dev.copy_htod_registered(region.sub(0, 16).expect("span"), &reg, len - 8, 0),
            Err(GpuError::Invalid(_))
        ));
        let past_end = DevSpan {
            offset: len,
            len: 2 << 20,
            ..region
        };
        assert!(matches!(
            dev.copy_htod_registered(past_end, &reg, 0, 0),
            Err(GpuError::Invalid(_))
        ));
        // A completion dropped without waiting keeps the registration until its copy is
        // done; then dropping the registration unregisters the memory, so it can be
        // registered again.
        drop(dev.copy_htod_registered(region.sub(0, len).expect("span"), &reg, 0, 2));
        drop(reg);
        let again = dev
            .register_host(mem)
            .expect("registered again after the unregister");
        drop(again);
        dev.free_region(region).expect("free");
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn registered_file_mapping_round_trip() {
        let dev = &gpus()[0];
        let dir = tempfile::tempdir().expect("temp dir");
        let map = mapped_pattern(dir.path(), (16 << 20) + 123);
        registered_round_trip(dev, &map);
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn registered_tmpfs_mapping_round_trip() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            eprintln!("SKIPPED: no /dev/shm");
            return;
        }
        let dev = &gpus()[0];
        let dir = tempfile::tempdir_in(shm).expect("a directory in /dev/shm");
        let map = mapped_pattern(dir.path(), (16 << 20) + 4096 + 5);
        registered_round_trip(dev, &map);
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn loader_takes_the_registered_path_on_a_gpu() {
        use crate::index::Layout;
        use crate::loader::{HostPath, LoadOptions, LoadProgress, Target, load};
        use crate::source::PacedSource;
        let dev = Arc::clone(&gpus()[0]);
        let base = if Path::new("/dev/shm").is_dir() {
            tempfile::tempdir_in("/dev/shm")
        } else {
            tempfile::tempdir()
        }
        .expect("temp dir");
        let sizes = [(24 << 20) + 17, 8 << 20, 3];
        let mut files = Vec::new();
        let mut data = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let bytes: Vec<u8> = (0..n)
                .map(|k: usize| ((k * 7 + i * 31) % 251) as u8)
                .collect();
            let path = base.path().join(format!("shard-{i}"));
            std::fs::write(&path, &bytes).expect("write");
            files.push((format!("shard-{i}"), path));
            data.push(bytes);
        }
        let layout = Layout::new(
            &files
                .iter()
                .zip(&data)
                .map(|((name, _), d)| (name.clone(), d.len() as u64))
                .collect::<Vec<_>>(),
        );
        let d: Arc<dyn Device> = dev.clone();
        for (register_host, want) in [(true, HostPath::Registered), (false, HostPath::Staging)] {
            let span = d.alloc_region(layout.total).expect("region");
            let targets = [Target {
                device: d.clone(),
                span,
            }];
            let src = PacedSource::from_files(files.clone(), 1 << 20).expect("source");
            src.deliver(0, None);
            let opts = LoadOptions {
                staging_size: 2 << 20,
                register_host,
                ..LoadOptions::default()
            };
            let p = LoadProgress::new(layout.total, &[dev.info().index]);
            let rep = load(&*src, &layout, &targets, &opts, &p).expect("load");
            eprintln!("{}", serde_json::to_string(&rep).expect("json"));
            assert_eq!(rep.host_path, want, "{rep:?}");
            for (slot, bytes) in layout.shards.iter().zip(&data) {
                let got = d
                    .read(span.sub(slot.offset, bytes.len() as u64).expect("span"))
                    .expect("read");
                assert!(got == *bytes, "{} differs ({want})", slot.path);
            }
            d.free_region(span).expect("free");
        }
        // Registrations kept between loads: the second load registers nothing; dropping the
        // source (the mappings' owner) lets the cache unregister them.
        let cache = crate::loader::RegistrationCache::new();
        let opts = LoadOptions {
            staging_size: 2 << 20,
            register_segment: 16 << 20,
            registrations: Some(cache.clone()),
            ..LoadOptions::default()
        };
        let src = PacedSource::from_files(files.clone(), 1 << 20).expect("source");
        src.deliver(0, None);
        for pass in 0..2 {
            let span = d.alloc_region(layout.total).expect("region");
            let targets = [Target {
                device: d.clone(),
                span,
            }];
            let p = LoadProgress::new(layout.total, &[dev.info().index]);
            let rep = load(&*src, &layout, &targets, &opts, &p).expect("load");
            eprintln!(
                "kept registrations, pass {pass}: {}",
                serde_json::to_string(&rep).expect("json")
            );
            assert_eq!(rep.host_path, HostPath::Registered);
            let reused = if pass == 0 { 0 } else { rep.registrations };
            assert_eq!(rep.registrations_reused, reused, "{rep:?}");
            for (slot, bytes) in layout.shards.iter().zip(&data) {
                let got = d
                    .read(span.sub(slot.offset, bytes.len() as u64).expect("span"))
                    .expect("read");
                assert!(got == *bytes, "{} differs (pass {pass})", slot.path);
            }
            d.free_region(span).expect("free");
        }
        drop(src);
        assert_eq!(
            cache.sweep(),
            layout.shards.iter().map(|s| s.size).sum::<u64>()
        );
        assert_eq!(cache.registered_bytes(), 0);
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn registration_rate_by_segment_and_threads() {
        use crate::device::HostSlice;
        let shm = Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::tempdir_in(shm)
        } else {
            tempfile::tempdir()
        }
        .expect("dir");
        let dev = Arc::clone(&gpus()[0]);
        let len: usize = 4 << 30;
        let path = dir.path().join("big.bin");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&path).expect("create");
            let block = vec![7u8; 64 << 20];
            for _ in 0..len / block.len() {
                f.write_all(&block).expect("write");
            }
        }
        let map: Arc<dyn HostMemory> = crate::mapped::MappedFile::open(&path).expect("map");
        for seg in [64usize << 20, 256 << 20, 1 << 30, 4 << 30] {
            for threads in [1usize, 2, 4, 8] {
                let segs: Vec<(usize, usize)> = (0..len / seg).map(|k| (k * seg, seg)).collect();
                let next = std::sync::atomic::AtomicUsize::new(0);
                let regs = std::sync::Mutex::new(Vec::new());
                let t0 = Instant::now();
                std::thread::scope(|s| {
                    for _ in 0..threads.min(segs.len()) {
                        s.spawn(|| {
                            loop {
                                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                let Some(&(start, n)) = segs.get(k) else {
                                    break;
                                };
                                let slice = HostSlice::new(map.clone(), start, n).expect("slice");
                                let r = dev.register_host(Arc::new(slice)).expect("register");
                                regs.lock().expect("lock").push(r);
                            }
                        });
                    }
                });
                let reg_s = t0.elapsed().as_secs_f64();
                let t1 = Instant::now();
                drop(regs);
                let unreg_s = t1.elapsed().as_secs_f64();
                eprintln!(
                    "segment {:>5} MiB, {threads} threads: register {reg_s:.3} s ({:.1} GB/s), unregister {unreg_s:.3} s",
                    seg >> 20,
                    len as f64 / reg_s / 1e9
                );
            }
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn absurd_alloc_is_out_of_memory() {
        let dev = &gpus()[0];
        let requested = dev.info().memory_bytes * 4;
        let before = dev.allocated_bytes();
        match dev.alloc_region(requested) {
            Err(GpuError::OutOfMemory {
                device,
                requested: r,
                available,
            }) => {
                assert_eq!(device, dev.info().index);
                assert_eq!(r, requested);
                assert!(available <= dev.info().memory_bytes);
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        assert_eq!(dev.allocated_bytes(), before, "a refusal takes nothing");
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn regions_are_allocated_and_freed_for_real() {
        let dev = &gpus()[0];
        assert_eq!(dev.allocated_bytes(), 0, "nothing is allocated at open");
        let free0 = dev.free_memory().expect("free memory");
        let a = dev.alloc_region(256 << 20).expect("region a");
        let b = dev.alloc_region(64 << 20).expect("region b");
        assert_eq!(dev.allocated_bytes(), 320 << 20);
        let free1 = dev.free_memory().expect("free memory");
        assert!(
            free0.saturating_sub(free1) >= 320 << 20,
            "{free0} -> {free1}"
        );
        // Each region has its own IPC handle.
        let (ha, hb) = (dev.ipc_handle(a).expect("a"), dev.ipc_handle(b).expect("b"));
        assert_ne!(ha, hb);
        let mut staging = dev.alloc_staging(1 << 20).expect("staging");
        staging.as_mut_slice().fill(9);
        // A copy left in flight when its region is freed is waited for first.
        drop(dev.copy_htod(a.sub(0, 1 << 20).expect("span"), staging.as_ref()));
        dev.free_region(a).expect("free a");
        assert_eq!(dev.allocated_bytes(), 64 << 20);
        let free2 = dev.free_memory().expect("free memory");
        assert!(
            free2 >= free1 + (256 << 20) - (2 << 20),
            "{free1} -> {free2}"
        );
        // Its spans are refused from now on; a second free too.
        assert!(matches!(
            dev.copy_htod(a.sub(0, 16).expect("span"), staging.as_ref()),
            Err(GpuError::Invalid(_))
        ));
        assert!(matches!(dev.read(a), Err(GpuError::Invalid(_))));
        assert!(matches!(dev.free_region(a), Err(GpuError::Invalid(_))));
        dev.free_region(b).expect("free b");
        assert_eq!(dev.allocated_bytes(), 0);
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn ipc_handle_is_128_hex_chars() {
        let dev = &gpus()[0];
        let region = dev.alloc_region(2 << 20).expect("region");
        let span = region.sub(4096, 1024).expect("span");
        match dev.ipc_handle(span).expect("ipc handle") {
            IpcHandle::CudaIpc { handle, offset } => {
                assert_eq!(handle.len(), 128);
                assert!(handle.chars().all(|c| c.is_ascii_hexdigit()));
                assert_eq!(offset, 4096);
            }
            other => panic!("expected a CUDA IPC handle, got {other:?}"),
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn calibration_finds_an_elbow() {
        let dev = &gpus()[0];
        let sizes = default_sizes();
        let cal = calibrate(dev, &sizes, 64 << 20).expect("calibrate");
        eprintln!("{}", serde_json::to_string_pretty(&cal).expect("json"));
        assert_eq!(cal.points.len(), sizes.len());
        assert!(
            cal.points
                .iter()
                .all(|&(_, bps)| bps.is_finite() && bps > 0.0)
        );
        // Throughput grows with the copy size, up to noise.
        for w in cal.points.windows(2) {
            assert!(w[1].1 >= 0.5 * w[0].1, "throughput collapsed: {w:?}");
        }
        let (first, last) = (cal.points[0].1, cal.points[cal.points.len() - 1].1);
        assert!(last >= 0.9 * first, "large copies slower than small ones");
        assert!(sizes.contains(&cal.elbow));
        assert!(cal.write_combined_bps > 0.0 && cal.portable_bps > 0.0);
        let peak = peak_htod(dev, 256 << 20, 3).expect("peak");
        eprintln!("peak pinned HtoD: {:.1} GB/s", peak / 1e9);
        assert!(peak > 1e9, "under 1 GB/s: {peak}");
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn peer_copy_between_two_gpus() {
        let all = gpus();
        let pair = all.iter().find_map(|a| {
            let (b, _) = a.info().peers.first()?;
            Some((Arc::clone(a), Arc::clone(&all[*b as usize])))
        });
        let Some((dst_dev, src_dev)) = pair else {
            eprintln!("SKIPPED: no two GPUs with peer access");
            return;
        };
        let len: u64 = 3 << 20;
        let src_region = src_dev.alloc_region(8 << 20).expect("src region");
        let dst_region = dst_dev.alloc_region(8 << 20).expect("dst region");
        let mut staging = src_dev.alloc_staging(len as usize).expect("staging");
        for (k, b) in staging.as_mut_slice().iter_mut().enumerate() {
            *b = (k * 7 % 253) as u8;
        }
        let src = src_region.sub(4096, len).expect("src span");
        src_dev
            .copy_htod(src, staging.as_ref())
            .expect("htod")
            .wait()
            .expect("wait");
        let dst = dst_region.sub(1 << 20, len).expect("dst span");
        dst_dev
            .copy_peer(dst, src_dev.as_ref(), src)
            .expect("peer copy")
            .wait()
            .expect("wait");
        assert_eq!(dst_dev.read(dst).expect("read"), staging.as_slice());
        // Mismatched lengths are refused.
        let short = dst_region.sub(0, len - 1).expect("span");
        assert!(matches!(
            dst_dev.copy_peer(short, src_dev.as_ref(), src),
            Err(GpuError::Invalid(_))
        ));
    }
}
