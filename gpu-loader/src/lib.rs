//! # gpu-loader
//!
//! Turns "the last chunk arrived" into "the weights are on every GPU that needs them": chunks
//! are copied into GPU memory as the store verifies them, through a ring of pinned staging
//! buffers, overlapped with the network transfer; sibling GPUs get peer copies over NVLink.
//!
//! * [`device`]: the device trait (one allocation per region, staging buffers, in-order copy
//!   stream, events, peer copies, IPC handles, registered host memory copied from on a few
//!   streams) and its errors.
//! * [`cuda`]: the CUDA backend (cudarc with dynamic loading; "no CUDA driver" is a normal
//!   condition, detected before the first driver call).
//! * [`sim`]: the simulated backend: a tmpfs file per region, copies paced to PCIe and NVLink
//!   rates, labelled `simulated` everywhere.
//! * [`pool`]: the per-GPU memory pool: one device allocation per model, made when it loads
//!   and freed when it is evicted, within the host's budget (a cap: nothing is reserved
//!   ahead); locks against eviction during sibling copies.
//! * [`index`]: the model's layout in its region and the tensor index from the safetensors
//!   headers (direct tensor addressing).
//! * [`loader`]: the streaming pipeline (fillers, completer, peer waiter; host memory
//!   registered segment by segment, or the staging ring as the reported fallback).
//! * [`source`]: a chunk source (heap memory or mapped files) verified at a paced rate
//!   (benchmarks, tests).
//! * [`mapped`]: read-only file maps as host memory a device can register (DMA straight
//!   from the page cache).
//! * [`handoff`]: what an inference process needs to map the weights without copying.
//! * [`manager`]: a host's GPUs: backend selection, pools, loads and their status.
//! * [`numa`]: the GPU's NUMA node and CPUs, to run a load's fillers and allocate its
//!   staging buffers near the GPU.
//!
//! Device I/O only; `unsafe` only in [`cuda`] and [`mapped`]. Tests: `tests/loader.rs`
//! (the pipeline on the simulated backend: bytes and offsets on every GPU, overlap,
//! back-pressure, both host paths and their fallbacks, partitions, NUMA placement,
//! registration ahead) and `tests/manager.rs` (regions, budgets, eviction, GPU choice);
//! the CUDA hardware tests are `#[ignore]`d.

pub mod cuda;
pub mod device;
pub mod handoff;
pub mod index;
pub mod loader;
pub mod manager;
pub mod mapped;
pub mod numa;
pub mod pool;
pub mod sim;
pub mod source;

/// Locks `m`, taking the data of a poisoned lock as it is (no critical section here leaves
/// a half-done update behind).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
