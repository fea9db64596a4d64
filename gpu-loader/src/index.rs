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
    /// The layout of a chunk source's shards.
    pub fn of_source(shards: &[crate::loader::SourceShard]) -> Self {
        Self::new(
            &shards
                .iter()
                .map(|s| (s.path.clone(), s.size))
                .collect::<Vec<_>>(),
        )
    }

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

/// A byte range of one shard file.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct ShardRange {
    /// Shard index in the layout.
    pub shard: usize,
    /// Offset in the shard file.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// One extent the loader copies: a byte range of a shard and where it lands in the region.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Extent {
    /// Shard index.
    pub shard: usize,
    /// Offset in the shard file.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Offset in the region.
    pub dest: u64,
}

/// Alignment of extents packed into a partition-only region (CUDA's allocation alignment
/// for tensors).
pub const EXTENT_ALIGN: u64 = 256;

/// What a load copies, in which order, and how big the region is.
///
/// A whole-model load copies every shard to its [`Layout`] slot. A partitioned load
/// (Flashpoint §4.2.5) copies the partition's ranges first; with *completion* it then copies
/// the rest of the model into the same full-size region, so the host ends with a full
/// replica and tensor offsets never change; without completion the partition's ranges are
/// packed into a region of their own size (a model larger than one GPU).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct LoadMap {
    /// Extents in copy order.
    pub extents: Vec<Extent>,
    /// The first `first` extents are the priority part (the partition).
    pub first: usize,
    /// Bytes of the priority part.
    pub first_bytes: u64,
    /// Bytes copied in all.
    pub bytes: u64,
    /// Region size.
    pub region: u64,
}

/// Sorts and merges ranges, dropping empty ones and clipping to the shard sizes.
fn normalise(layout: &Layout, ranges: &[ShardRange]) -> Vec<ShardRange> {
    let mut v: Vec<ShardRange> = ranges
        .iter()
        .filter_map(|r| {
            let size = layout.shards.get(r.shard)?.size;
            let end = r.offset.saturating_add(r.len).min(size);
            (end > r.offset).then_some(ShardRange {
                shard: r.shard,
                offset: r.offset,
                len: end - r.offset,
            })
        })
        .collect();
    v.sort_by_key(|r| (r.shard, r.offset));
    let mut out: Vec<ShardRange> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(l) if l.shard == r.shard && r.offset <= l.offset + l.len => {
                l.len = l.len.max(r.offset + r.len - l.offset);
            }
            _ => out.push(r),
        }
    }
    out
}

impl LoadMap {
    /// The whole model, shard by shard.
    pub fn full(layout: &Layout) -> Self {
        let extents: Vec<Extent> = layout
            .shards
            .iter()
            .enumerate()
            .filter(|(_, s)| s.size > 0)
            .map(|(i, s)| Extent {
                shard: i,
                offset: 0,
                len: s.size,
                dest: s.offset,
            })
            .collect();
        let bytes = extents.iter().map(|e| e.len).sum();
        Self {
            first: extents.len(),
            extents,
            first_bytes: bytes,
            bytes,
            region: layout.total,
        }
    }

    /// A partition: `ranges` first; then, with `complete`, everything else at its full-layout
    /// offset, else nothing more and the ranges packed into a smaller region.
    pub fn partition(layout: &Layout, ranges: &[ShardRange], complete: bool) -> Self {
        let part = normalise(layout, ranges);
        let first_bytes: u64 = part.iter().map(|r| r.len).sum();
        let mut extents = Vec::new();
        if complete {
            for r in &part {
                extents.push(Extent {
                    shard: r.shard,
                    offset: r.offset,
                    len: r.len,
                    dest: layout.shards[r.shard].offset + r.offset,
                });
            }
            // The complement, shard by shard.
            for (i, slot) in layout.shards.iter().enumerate() {
                let mut at = 0u64;
                let mut push = |from: u64, to: u64| {
                    if to > from {
                        extents.push(Extent {
                            shard: i,
                            offset: from,
                            len: to - from,
                            dest: slot.offset + from,
                        });
                    }
                };
                for r in part.iter().filter(|r| r.shard == i) {
                    push(at, r.offset);
                    at = r.offset + r.len;
                }
                push(at, slot.size);
            }
            let bytes = extents.iter().map(|e| e.len).sum();
            return Self {
                first: part.len(),
                extents,
                first_bytes,
                bytes,
                region: layout.total,
            };
        }
        let mut at = 0u64;
        for r in &part {
            extents.push(Extent {
                shard: r.shard,
                offset: r.offset,
                len: r.len,
                dest: at,
            });
            at = (at + r.len).div_ceil(EXTENT_ALIGN) * EXTENT_ALIGN;
        }
        Self {
            first: extents.len(),
            extents,
            first_bytes,
            bytes: first_bytes,
            region: at.div_ceil(SHARD_ALIGN).max(1) * SHARD_ALIGN,
        }
    }

    /// Where byte `offset` of `shard` lands in the region, if this map copies it.
    pub fn dest_of(&self, shard: usize, offset: u64) -> Option<u64> {
        self.extents
            .iter()
            .find(|e| e.shard == shard && (e.offset..e.offset + e.len).contains(&offset))
            .map(|e| e.dest + (offset - e.offset))
    }

    /// Whether the map copies every byte of `[offset, offset + len)` of `shard` within the
    /// priority part (`first_only`) or anywhere.
    pub fn covers(&self, shard: usize, offset: u64, len: u64, first_only: bool) -> bool {
        let n = if first_only {
            self.first
        } else {
            self.extents.len()
        };
        let mut need = offset;
        let end = offset + len;
        let mut parts: Vec<&Extent> = self.extents[..n]
            .iter()
            .filter(|e| e.shard == shard)
            .collect();
        parts.sort_by_key(|e| e.offset);
        for e in parts {
            if e.offset <= need && need < e.offset + e.len {
                need = e.offset + e.len;
            }
            if need >= end {
                return true;
            }
        }
        need >= end || len == 0
    }

    /// The tensor index of this map's region: `index` (built over the full [`Layout`]) with
    /// offsets moved to where each tensor lands, keeping only tensors copied entirely (in the
    /// priority part when `first_only`).
    pub fn remap_index(
        &self,
        layout: &Layout,
        index: &[TensorEntry],
        first_only: bool,
    ) -> Vec<TensorEntry> {
        index
            .iter()
            .filter_map(|t| {
                let shard = layout.shards.iter().position(|s| s.path == t.shard)?;
                let local = t.offset.checked_sub(layout.shards[shard].offset)?;
                if !self.covers(shard, local, t.nbytes, first_only) {
                    return None;
                }
                let dest = self.dest_of(shard, local)?;
                Some(TensorEntry {
                    offset: dest,
                    ..t.clone()
                })
            })
            .collect()
    }
}

/// The byte ranges of the tensors `select` picks, per shard (shard-relative), merged.
pub fn tensor_ranges(
    layout: &Layout,
    index: &[TensorEntry],
    mut select: impl FnMut(&str) -> bool,
) -> Vec<ShardRange> {
    let ranges: Vec<ShardRange> = index
        .iter()
        .filter(|t| select(&t.name))
        .filter_map(|t| {
            let shard = layout.shards.iter().position(|s| s.path == t.shard)?;
            Some(ShardRange {
                shard,
                offset: t.offset.checked_sub(layout.shards[shard].offset)?,
                len: t.nbytes,
            })
        })
        .collect();
    normalise(layout, &ranges)
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

    fn two_shards() -> (Layout, [Vec<u8>; 2], Vec<TensorEntry>) {
        let a = file(&[
            ("l.0.w", vec![64], 1),
            ("l.1.w", vec![64], 2),
            ("l.2.w", vec![64], 3),
        ]);
        let b = file(&[("l.3.w", vec![64], 4), ("z.w", vec![8], 5)]);
        let layout = Layout::new(&[
            ("a.safetensors".into(), a.len() as u64),
            ("b.safetensors".into(), b.len() as u64),
        ]);
        let files = [a, b];
        let idx = tensor_index(&layout, |i, off, len| {
            Ok(files[i][off as usize..off as usize + len].to_vec())
        })
        .unwrap();
        (layout, files, idx)
    }

    /// Copies `map`'s extents into a region as the loader would.
    fn apply(map: &LoadMap, files: &[Vec<u8>], upto: usize) -> Vec<u8> {
        let mut region = vec![0u8; map.region as usize];
        for e in &map.extents[..upto] {
            region[e.dest as usize..(e.dest + e.len) as usize]
                .copy_from_slice(&files[e.shard][e.offset as usize..(e.offset + e.len) as usize]);
        }
        region
    }

    #[test]
    fn partition_with_completion_loads_the_partition_first_then_everything_in_place() {
        let (layout, files, idx) = two_shards();
        let want = |n: &str| n == "l.1.w" || n == "l.3.w";
        let ranges = tensor_ranges(&layout, &idx, want);
        assert_eq!(ranges.len(), 2);
        let map = LoadMap::partition(&layout, &ranges, true);
        assert_eq!(map.region, layout.total);
        assert_eq!(map.first_bytes, 2 * 64 * 4);
        assert_eq!(map.bytes, files.iter().map(|f| f.len() as u64).sum::<u64>());
        // After the priority part, the partition's tensors are in place, others are not.
        let early = apply(&map, &files, map.first);
        let live = map.remap_index(&layout, &idx, true);
        assert_eq!(
            live.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            ["l.1.w", "l.3.w"]
        );
        for t in &live {
            let full = idx.iter().find(|f| f.name == t.name).unwrap();
            assert_eq!(
                t.offset, full.offset,
                "completion keeps full-layout offsets"
            );
            let fill = if t.name == "l.1.w" { 2 } else { 4 };
            let bytes = &early[t.offset as usize..(t.offset + t.nbytes) as usize];
            assert!(bytes.iter().all(|&b| b == fill));
        }
        let other = idx.iter().find(|t| t.name == "l.0.w").unwrap();
        assert!(
            early[other.offset as usize..(other.offset + other.nbytes) as usize]
                .iter()
                .all(|&b| b == 0)
        );
        // After everything: the full layout, byte for byte.
        let done = apply(&map, &files, map.extents.len());
        for (slot, f) in layout.shards.iter().zip(&files) {
            assert_eq!(
                &done[slot.offset as usize..slot.offset as usize + f.len()],
                &f[..]
            );
        }
        assert_eq!(map.remap_index(&layout, &idx, false), idx);
    }

    #[test]
    fn partition_without_completion_packs_a_smaller_region() {
        let (layout, files, idx) = two_shards();
        let ranges = tensor_ranges(&layout, &idx, |n| n == "l.0.w" || n == "z.w");
        let map = LoadMap::partition(&layout, &ranges, false);
        assert_eq!(map.first, map.extents.len());
        assert!(map.region < layout.total);
        let region = apply(&map, &files, map.extents.len());
        let packed = map.remap_index(&layout, &idx, false);
        assert_eq!(packed.len(), 2);
        for t in &packed {
            assert_eq!(t.offset % EXTENT_ALIGN, 0);
            let fill = if t.name == "l.0.w" { 1 } else { 5 };
            let bytes = &region[t.offset as usize..(t.offset + t.nbytes) as usize];
            assert!(bytes.iter().all(|&b| b == fill), "{}", t.name);
        }
    }

    #[test]
    fn ranges_are_merged_clipped_and_empty_ones_dropped() {
        let layout = Layout::new(&[("a".into(), 100), ("b".into(), 50)]);
        let r = |shard, offset, len| ShardRange { shard, offset, len };
        let map = LoadMap::partition(
            &layout,
            &[
                r(0, 10, 10),
                r(0, 15, 10),
                r(1, 40, 100),
                r(0, 90, 0),
                r(7, 0, 1),
            ],
            true,
        );
        assert_eq!(map.first, 2);
        assert_eq!(map.first_bytes, 15 + 10);
        assert_eq!(map.bytes, 150);
        assert!(map.covers(0, 12, 10, true));
        assert!(!map.covers(0, 5, 10, true));
        assert!(map.covers(0, 0, 100, false));
        assert_eq!(LoadMap::full(&layout).bytes, 150);
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
