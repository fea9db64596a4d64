//! The hand-off to an inference process: everything it needs to use the weights without
//! copying them. On a GPU host, per GPU holding the model, the region that holds it: the
//! GPU (`gpu`), a CUDA IPC memory handle of the model's own device allocation (open it with
//! `cuIpcOpenMemHandle` / `cudaIpcOpenMemHandle` and add `handle.offset`, 0 today), and the
//! region's length (`size`); plus the tensor index (name → offset in the region, dtype,
//! shape). Each model has its own allocation, so an engine opens (and closes) one model's
//! handle without mapping any other. With simulated GPUs: the region's backing file and
//! offset instead of the handle. On a host without GPUs: the memory-tier files themselves
//! (`kind = "memory-file"`; map each shard file, subtract the shard's region offset).
//!
//! The JSON shape is unchanged from the per-GPU arena of earlier versions, where `offset`
//! was the region's place in the arena: a consumer that adds `offset` works with both.
//!
//! `examples/python/handoff.py` opens a hand-off and builds tensors from it.

use serde::{Deserialize, Serialize};

use crate::device::{DeviceKind, IpcHandle};
use crate::index::TensorEntry;

/// A model's hand-off.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Handoff {
    /// Model key (hex digest).
    pub model: String,
    /// Model name.
    pub name: String,
    /// `cuda-ipc`, `simulated` or `memory-file`.
    pub kind: String,
    /// One entry per GPU holding the model.
    pub devices: Vec<HandoffDevice>,
    /// Shard files and where each sits in the region.
    pub shards: Vec<HandoffShard>,
    /// Tensors, by offset in the region.
    pub tensors: Vec<TensorEntry>,
    /// Set when the region holds a partition only (or a partition is live while the rest is
    /// still loading): the partition's label. `tensors` then lists only the tensors present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
}

/// One GPU's copy: the region holding the model on that GPU.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HandoffDevice {
    /// GPU index.
    pub gpu: u32,
    /// `cuda` or `simulated`.
    pub device_kind: DeviceKind,
    /// Device name.
    pub name: String,
    /// How to map the region: the handle of the model's own allocation and the region's
    /// offset in it.
    pub handle: IpcHandle,
    /// Bytes of the region from that offset (tensor offsets are below this).
    pub size: u64,
}

/// One shard.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HandoffShard {
    /// Path in the model.
    pub path: String,
    /// The memory-tier file holding it ("" when unknown).
    pub file: String,
    /// Offset of the shard in the region.
    pub offset: u64,
    /// Bytes.
    pub size: u64,
}

/// The hand-off on a host without GPUs: the memory-tier shard files and the tensor index,
/// with offsets in the same layout as a GPU region (a tensor of shard `s` is at
/// `tensor.offset - shards[s].offset` in that shard's file).
pub fn memory_file(
    model: &str,
    name: &str,
    shards: &[(String, std::path::PathBuf, u64)],
) -> Result<Handoff, crate::index::IndexError> {
    use std::os::unix::fs::FileExt;
    let layout = crate::index::Layout::new(
        &shards
            .iter()
            .map(|(p, _, s)| (p.clone(), *s))
            .collect::<Vec<_>>(),
    );
    let tensors = crate::index::tensor_index(&layout, |i, off, len| {
        let (_, file, _) = &shards[i];
        let f = std::fs::File::open(file)?;
        let mut b = vec![0u8; len];
        f.read_exact_at(&mut b, off)?;
        Ok(b)
    })?;
    Ok(Handoff {
        model: model.to_string(),
        name: name.to_string(),
        kind: "memory-file".into(),
        devices: Vec::new(),
        shards: layout
            .shards
            .iter()
            .zip(shards)
            .map(|(slot, (_, file, _))| HandoffShard {
                path: slot.path.clone(),
                file: file.display().to_string(),
                offset: slot.offset,
                size: slot.size,
            })
            .collect(),
        tensors,
        partition: None,
    })
}
