//! The GPU memory pool of one device (Torpor §4.4): one region per model, each its own device
//! allocation, made when the model is loaded and freed — for real — when it is evicted. The
//! pool keeps the regions within a *budget*: the most this host may take on the GPU, an upper
//! limit and not a reservation. Nothing is allocated ahead, so an inference engine on the
//! same GPU gets whatever the host's models do not use; when the engine holds the memory a
//! load needs, the device refuses it ([`GpuError::OutOfMemory`]) and the pool records
//! nothing. A region being copied to a sibling GPU is locked against eviction.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::device::{DevSpan, Device, DeviceRegion, GpuError};

/// Regions are allocated, and charged to the budget, in multiples of 2 MiB: the granularity
/// at which CUDA maps large allocations, so the budget counts what the driver really takes
/// (and regions start on large-page boundaries).
pub const REGION_ALIGN: u64 = 2 << 20;

/// One model's region, as [`GpuPool::regions`] reports it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Region {
    /// Model key (hex digest).
    pub model: String,
    /// Bytes allocated (the model's bytes rounded up to [`REGION_ALIGN`]).
    pub len: u64,
    /// Locks held (copies to siblings in flight, hand-offs being read).
    pub locks: u32,
}

/// Why a pool operation failed.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The device refused the region: [`GpuError::OutOfMemory`] when its memory is held by
    /// other processes (an inference engine) or by this host's other regions.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// The region would take this host past its budget on the GPU.
    #[error(
        "GPU {device}: a region of {requested} bytes does not fit this host's budget ({used} of {budget} bytes in use); evict a model or raise gpu_budget"
    )]
    OverBudget {
        /// Device.
        device: u32,
        /// Bytes asked for.
        requested: u64,
        /// Bytes of the live regions.
        used: u64,
        /// The budget.
        budget: u64,
    },
    /// The model already has a region here.
    #[error("model {0} already has a region on this GPU")]
    Exists(String),
    /// No region for the model.
    #[error("model {0} has no region on this GPU")]
    Missing(String),
    /// The region is locked.
    #[error(
        "model {model} is locked on GPU {device} ({locks} copies or hand-offs in flight); evict it later"
    )]
    Locked {
        /// Model.
        model: String,
        /// Device.
        device: u32,
        /// Locks held.
        locks: u32,
    },
}

/// A live region and its locks.
#[derive(Debug)]
struct Held {
    /// The allocation; dropping it frees the device memory.
    memory: DeviceRegion,
    locks: u32,
}

/// The pool of one device.
pub struct GpuPool {
    device: Arc<dyn Device>,
    budget: u64,
    /// By model.
    regions: BTreeMap<String, Held>,
}

impl std::fmt::Debug for GpuPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuPool")
            .field("device", &self.device.info().index)
            .field("budget", &self.budget)
            .field("regions", &self.regions)
            .finish()
    }
}

impl GpuPool {
    /// A pool that may take up to `budget` bytes of `device` (at most the device's memory,
    /// rounded down to [`REGION_ALIGN`]). Allocates nothing.
    pub fn new(device: Arc<dyn Device>, budget: u64) -> Self {
        let budget = budget.min(device.info().memory_bytes) / REGION_ALIGN * REGION_ALIGN;
        Self {
            device,
            budget,
            regions: BTreeMap::new(),
        }
    }

    /// The bytes a region for `bytes` of model takes (rounded up to [`REGION_ALIGN`]);
    /// `None` on overflow.
    pub fn charge(bytes: u64) -> Option<u64> {
        bytes
            .max(1)
            .checked_add(REGION_ALIGN - 1)
            .map(|x| x / REGION_ALIGN * REGION_ALIGN)
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The budget: the most this pool may allocate, in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes of the live regions.
    pub fn used(&self) -> u64 {
        self.regions.values().map(|h| h.memory.span().len).sum()
    }

    /// Bytes a new region could get now: the budget's room, lowered to what the device has
    /// free when other processes hold more of it.
    pub fn free(&self) -> u64 {
        let room = self.budget.saturating_sub(self.used());
        match self.device.free_memory() {
            Ok(device_free) => room.min(device_free),
            Err(_) => room,
        }
    }

    /// Allocates a region of `bytes` (rounded up to [`REGION_ALIGN`]) for `model` and
    /// returns its span. Past the budget it is [`PoolError::OverBudget`]; refused by the
    /// device, [`PoolError::Gpu`]. Either way nothing is recorded or allocated.
    pub fn reserve(&mut self, model: &str, bytes: u64) -> Result<DevSpan, PoolError> {
        if self.regions.contains_key(model) {
            return Err(PoolError::Exists(model.to_string()));
        }
        let device = self.device.info().index;
        let len = Self::charge(bytes).ok_or_else(|| GpuError::Invalid("size".into()))?;
        let used = self.used();
        if used.saturating_add(len) > self.budget {
            return Err(PoolError::OverBudget {
                device,
                requested: bytes,
                used,
                budget: self.budget,
            });
        }
        let memory = DeviceRegion::alloc(&self.device, len)?;
        let span = memory.span();
        self.regions
            .insert(model.to_string(), Held { memory, locks: 0 });
        Ok(span)
    }

    /// The span of `model`'s whole region.
    pub fn span(&self, model: &str) -> Option<DevSpan> {
        self.regions.get(model).map(|h| h.memory.span())
    }

    /// Frees `model`'s region (its device memory goes back to the GPU, after the copies
    /// still using it) and returns its size. Refused while it is locked.
    pub fn evict(&mut self, model: &str) -> Result<u64, PoolError> {
        let Some(h) = self.regions.get(model) else {
            return Err(PoolError::Missing(model.to_string()));
        };
        if h.locks > 0 {
            return Err(PoolError::Locked {
                model: model.to_string(),
                device: self.device.info().index,
                locks: h.locks,
            });
        }
        let len = h.memory.span().len;
        self.regions.remove(model);
        Ok(len)
    }

    /// Locks `model`'s region against eviction (a copy to a sibling is in flight).
    pub fn lock(&mut self, model: &str) -> Result<(), PoolError> {
        let h = self
            .regions
            .get_mut(model)
            .ok_or_else(|| PoolError::Missing(model.to_string()))?;
        h.locks += 1;
        Ok(())
    }

    /// Releases one lock.
    pub fn unlock(&mut self, model: &str) {
        if let Some(h) = self.regions.get_mut(model) {
            h.locks = h.locks.saturating_sub(1);
        }
    }

    /// Every region, by model.
    pub fn regions(&self) -> Vec<Region> {
        self.regions
            .iter()
            .map(|(model, h)| Region {
                model: model.clone(),
                len: h.memory.span().len,
                locks: h.locks,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimDevice, SimOptions, devices};

    const MIB: u64 = 1 << 20;

    fn device(dir: &std::path::Path, memory: u64) -> (Arc<SimDevice>, Arc<dyn Device>) {
        let mut o = SimOptions::new(dir, 1, memory);
        o.pcie_bps = 0;
        let d = devices(&o).unwrap().remove(0);
        (d.clone(), d)
    }

    #[test]
    fn regions_are_allocated_on_load_and_freed_on_eviction() {
        let dir = tempfile::tempdir().unwrap();
        let (_, d) = device(dir.path(), 1 << 30);
        let mut p = GpuPool::new(d.clone(), 64 * MIB);
        assert_eq!(d.allocated_bytes(), 0, "a pool takes nothing ahead");
        assert_eq!((p.budget(), p.used(), p.free()), (64 * MIB, 0, 64 * MIB));
        let a = p.reserve("a", 10 * MIB).unwrap();
        let b = p.reserve("b", 3 * MIB).unwrap();
        // Each region is its own allocation, rounded up to the alignment.
        assert_ne!(a.base, b.base);
        assert_eq!(
            (a.offset, a.len, b.offset, b.len),
            (0, 10 * MIB, 0, 4 * MIB)
        );
        assert_eq!(d.allocated_bytes(), 14 * MIB);
        assert_eq!((p.used(), p.free()), (14 * MIB, 50 * MIB));
        assert!(matches!(p.reserve("a", 1), Err(PoolError::Exists(_))));
        assert_eq!(p.span("b"), Some(b));

        assert_eq!(p.evict("a").unwrap(), 10 * MIB);
        assert_eq!(d.allocated_bytes(), 4 * MIB, "eviction frees device memory");
        assert!(d.read(a).is_err(), "the evicted region's spans are refused");
        assert!(p.span("a").is_none());
        p.evict("b").unwrap();
        assert_eq!(d.allocated_bytes(), 0);
    }

    #[test]
    fn the_budget_is_a_cap_and_a_refusal_records_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (sim, d) = device(dir.path(), 100 * MIB);
        let mut p = GpuPool::new(d.clone(), 64 * MIB);
        p.reserve("a", 40 * MIB).unwrap();
        match p.reserve("b", 30 * MIB) {
            Err(PoolError::OverBudget {
                requested,
                used,
                budget,
                ..
            }) => assert_eq!((requested, used, budget), (30 * MIB, 40 * MIB, 64 * MIB)),
            other => panic!("expected OverBudget, got {other:?}"),
        }
        assert_eq!(d.allocated_bytes(), 40 * MIB);
        // Within the budget, but an inference engine holds the device's memory.
        sim.set_external_use(50 * MIB);
        assert_eq!(
            p.free(),
            10 * MIB,
            "the device's free memory lowers the room"
        );
        let e = p.reserve("b", 20 * MIB).unwrap_err();
        assert!(
            matches!(e, PoolError::Gpu(GpuError::OutOfMemory { .. })),
            "{e:?}"
        );
        assert!(e.to_string().contains("out of GPU memory"), "{e}");
        assert!(p.span("b").is_none());
        assert_eq!(d.allocated_bytes(), 40 * MIB);
        assert_eq!(p.regions().len(), 1);
        sim.set_external_use(0);
        p.reserve("b", 20 * MIB).unwrap();
    }

    #[test]
    fn locked_regions_are_not_evicted() {
        let dir = tempfile::tempdir().unwrap();
        let (_, d) = device(dir.path(), 1 << 30);
        let mut p = GpuPool::new(d.clone(), 16 * MIB);
        p.reserve("m", 4 * MIB).unwrap();
        p.lock("m").unwrap();
        assert!(matches!(
            p.evict("m"),
            Err(PoolError::Locked { locks: 1, .. })
        ));
        assert_eq!(d.allocated_bytes(), 4 * MIB);
        p.unlock("m");
        assert_eq!(p.evict("m").unwrap(), 4 * MIB);
        assert!(matches!(p.evict("m"), Err(PoolError::Missing(_))));
        assert!(p.lock("m").is_err());
    }

    #[test]
    fn a_budget_is_at_most_the_device() {
        let dir = tempfile::tempdir().unwrap();
        let (_, d) = device(dir.path(), 8 * MIB);
        assert_eq!(GpuPool::new(d.clone(), 16 * MIB).budget(), 8 * MIB);
        let mut tiny = GpuPool::new(d.clone(), 1);
        assert_eq!(tiny.budget(), 0);
        assert!(matches!(
            tiny.reserve("m", 1),
            Err(PoolError::OverBudget { .. })
        ));
        assert_eq!(GpuPool::charge(0), Some(REGION_ALIGN));
        assert_eq!(GpuPool::charge(u64::MAX), None);
    }
}
