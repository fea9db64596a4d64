//! The layout of a model in its GPU region and the tensor index (direct tensor addressing).
//!
//! A model occupies one contiguous region per GPU. Its shard files are laid out back to back
//! in manifest order, each starting on a 4 KiB boundary, byte for byte as they are in the
//! store: a chunk of a shard lands at `shard offset + chunk offset`, so loading is a
//! sequence of plain copies and needs no parsing on the data path. The tensor index (name →
//! offset in the region, dtype, shape) is read from the safetensors headers only, with the
//! `safetensors` crate; tensors are then addressed directly in the region.

use serde::Serialize;

/// Shards start on this boundary within a region.
pub const SHARD_ALIGN: u64 = 4096;

/// Where one shard sits in the region.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ShardSlot {
    /// Path in the model (`model-00001-of-00002.safetensors`).
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// Offset in the region.
    pub offset: u64,
}

/// A model's layout in a region.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Layout {
    /// Shards in manifest order.
    pub shards: Vec<ShardSlot>,
    /// Bytes the region needs.
    pub total: u64,
}

impl Layout {
    /// Lays out shards `(path, size)` back to back.
    pub fn new(shards: &[(String, u64)]) -> Self {
        let mut at = 0u64;
        let mut out = Vec::with_capacity(shards.len());
        for (path, size) in shards {
            out.push(ShardSlot {
                path: path.clone(),
                size: *size,
                offset: at,
            });
            at = (at + size).div_ceil(SHARD_ALIGN) * SHARD_ALIGN;
        }
        Self {
            shards: out,
            total: at.max(SHARD_ALIGN),
        }
    }
}

/// One tensor in the region.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct TensorEntry {
    /// Tensor name.
    pub name: String,
    /// safetensors dtype (`F16`, `BF16`, `F32`, …).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte offset in the model's region.
    pub offset: u64,
    /// Bytes.
    pub nbytes: u64,
    /// Shard it came from.
    pub shard: String,
}

/// Why a header could not be indexed.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// Reading the header failed.
    #[error("reading the header of {shard}: {source}")]
    Io {
        /// Shard.
        shard: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Not a valid safetensors header.
    #[error("{shard} is not a valid safetensors file: {message}")]
    Invalid {
        /// Shard.
        shard: String,
        /// Why.
        message: String,
    },
}

/// Largest header accepted (safetensors' own limit is 100 MB).
pub const MAX_HEADER: u64 = 100_000_000;

/// Builds the tensor index of `layout`. `read(shard index, offset, len)` returns bytes of a
/// shard file (only headers are read). Shards whose names do not end in `.safetensors`
/// (e.g. the HF `model.safetensors.index.json`) are loaded but hold no tensors. Entries are
/// sorted by offset.
pub fn tensor_index(
    layout: &Layout,
    mut read: impl FnMut(usize, u64, usize) -> std::io::Result<Vec<u8>>,
) -> Result<Vec<TensorEntry>, IndexError> {
    let mut out = Vec::new();
    for (i, slot) in layout.shards.iter().enumerate() {
        if !slot.path.ends_with(".safetensors") {
            continue;
        }
        let invalid = |message: String| IndexError::Invalid {
            shard: slot.path.clone(),
            message,
        };
        let io = |source| IndexError::Io {
            shard: slot.path.clone(),
            source,
        };
        if slot.size < 8 {
            return Err(invalid("shorter than the 8-byte header length".into()));
        }
        let len_bytes = read(i, 0, 8).map_err(io)?;
        let n = u64::from_le_bytes(
            len_bytes
                .get(..8)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| invalid("short read of the header length".into()))?,
        );
        if n > MAX_HEADER || n + 8 > slot.size {
            return Err(invalid(format!(
                "header length {n} does not fit a {}-byte file",
                slot.size
            )));
        }
        let header = read(i, 8, n as usize).map_err(io)?;
        let meta: safetensors::tensor::Metadata =
            serde_json::from_slice(&header).map_err(|e| invalid(e.to_string()))?;
        let data_start = 8 + n;
        if data_start + meta.data_len() as u64 > slot.size {
            return Err(invalid(format!(
                "tensors need {} bytes after the header, the file has {}",
                meta.data_len(),
                slot.size - data_start
            )));
        }
        for (name, info) in meta.tensors() {
            let (begin, end) = info.data_offsets;
            out.push(TensorEntry {
                name,
                dtype: format!("{:?}", info.dtype),
                shape: info.shape.clone(),
                offset: slot.offset + data_start + begin as u64,
                nbytes: (end - begin) as u64,
                shard: slot.path.clone(),
            });
        }
    }
    out.sort_by_key(|t| t.offset);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(tensors: &[(&str, Vec<usize>, u8)]) -> Vec<u8> {
        let views: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
            .iter()
            .map(|(n, shape, fill)| {
                let count: usize = shape.iter().product();
                ((*n).to_string(), vec![*fill; count * 4], shape.clone())
            })
            .collect();
        let data: Vec<(String, safetensors::tensor::TensorView<'_>)> = views
            .iter()
            .map(|(n, b, s)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                        .unwrap(),
                )
            })
            .collect();
        safetensors::serialize(data, None).unwrap()
    }

    #[test]
    fn offsets_point_at_each_tensor_in_the_region() {
        let a = file(&[("a.w", vec![2, 3], 1), ("a.b", vec![3], 2)]);
        let b = file(&[("b.w", vec![5], 3)]);
        let files = [a, b, b"{}".to_vec()];
        let layout = Layout::new(&[
            ("a.safetensors".into(), files[0].len() as u64),
            ("b.safetensors".into(), files[1].len() as u64),
            ("model.safetensors.index.json".into(), 2),
        ]);
        assert_eq!(layout.shards[1].offset % SHARD_ALIGN, 0);
        let idx = tensor_index(&layout, |i, off, len| {
            Ok(files[i][off as usize..off as usize + len].to_vec())
        })
        .unwrap();
        assert_eq!(idx.len(), 3);
        // Build the region as the loader would, and read each tensor at its offset.
        let mut region = vec![0u8; layout.total as usize];
        for (slot, f) in layout.shards.iter().zip(&files) {
            region[slot.offset as usize..slot.offset as usize + f.len()].copy_from_slice(f);
        }
        for t in &idx {
            let bytes = &region[t.offset as usize..(t.offset + t.nbytes) as usize];
            let want = match t.name.as_str() {
                "a.w" => 1,
                "a.b" => 2,
                _ => 3,
            };
            assert!(bytes.iter().all(|&b| b == want), "{}", t.name);
            assert_eq!(t.dtype, "F32");
        }
    }

    #[test]
    fn bad_headers_are_errors() {
        let layout = Layout::new(&[("x.safetensors".into(), 16)]);
        let bad_len = tensor_index(&layout, |_, off, len| {
            Ok(if off == 0 {
                1_000u64.to_le_bytes().to_vec()
            } else {
                vec![b' '; len]
            })
        });
        assert!(matches!(bad_len, Err(IndexError::Invalid { .. })));
        let bad_json = tensor_index(&layout, |_, off, len| {
            Ok(if off == 0 {
                8u64.to_le_bytes().to_vec()
            } else {
                vec![b'{'; len]
            })
        });
        assert!(matches!(bad_json, Err(IndexError::Invalid { .. })));
        let io = tensor_index(&layout, |_, _, _| Err(std::io::Error::other("gone")));
        assert!(matches!(io, Err(IndexError::Io { .. })));
    }
}
