//! Synthetic models in the safetensors format, generated fast enough for benchmarks.
//!
//! [`generate`] lays out a Llama-shaped decoder (embedding, `n` layers of attention and MLP
//! projections plus norms, final norm, LM head) whose tensor bytes add up to just under the
//! requested size, splits the tensors over shard files the way Hugging Face checkpoints are
//! split, and fills every tensor with pseudo-random BF16 values.
//!
//! * **Sizing.** The hidden size is the largest candidate that still leaves room for
//!   `max(8, shards)` layers; the layer count then fills the budget and the vocabulary size
//!   absorbs the remainder, so the tensor bytes fall short of the request by less than one
//!   vocabulary row pair (`4 × hidden` bytes).
//! * **Sharding.** Tensors are kept in checkpoint order and tensor `t` goes to the shard whose
//!   equal-byte slice holds `t`'s midpoint. Every tensor is smaller than one slice, so no shard is
//!   left empty.
//! * **Data.** Bytes come from a SplitMix64 stream keyed by `(seed, file, block)`, so the
//!   content is deterministic from the seed and blocks can be filled on several threads. Bit 14
//!   of every 16-bit value is cleared, which keeps every BF16 (and F16) value finite with
//!   magnitude below 2: no NaN or infinity for a consumer that does arithmetic on the weights.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};
use serde_json::{Map, Value, json};

/// Bytes of tensor data filled and written per `write` call. Large enough that the system call
/// and thread hand-off costs vanish next to the fill, small enough to stay in the CPU caches of
/// two fill threads sharing it.
const BLOCK_BYTES: usize = 8 << 20;

/// Threads that fill one block: the benchmark hosts have few cores and the writer is usually
/// disk or page-cache bound past two.
const FILL_THREADS: usize = 2;

/// Hidden sizes tried, largest first; each is a multiple of 16 so every shape stays aligned.
const HIDDEN_SIZES: [u64; 12] = [
    8192, 5120, 4096, 3072, 2048, 1024, 512, 256, 128, 64, 32, 16,
];

/// Fewest decoder layers a generated model has (unless the request is too small for even one
/// layer at the smallest hidden size): few-layer models would make the embedding dominate.
const MIN_LAYERS: u64 = 8;

/// Most shards accepted: file names carry five digits, as Hugging Face's do.
const MAX_SHARDS: usize = 99_999;

/// Largest model accepted (16 TiB): far beyond any benchmark, and it keeps the layer count
/// (and so the tensor list) bounded.
const MAX_TOTAL_BYTES: u64 = 16 << 40;

/// Bytes per element: every tensor is BF16.
const ELEM_BYTES: u64 = 2;

/// What to generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthSpec {
    /// Requested total size of the tensor data in bytes; the generated model's tensor bytes are
    /// at most this and short of it by less than `4 × hidden size` bytes.
    pub total_bytes: u64,
    /// Number of safetensors files to split the tensors over (at least 1).
    pub shards: usize,
    /// Seed of the pseudo-random tensor contents: equal specs give byte-identical files.
    pub seed: u64,
}

/// A generated model on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthModel {
    /// Directory holding the files.
    pub dir: PathBuf,
    /// Every file written, as (file name relative to `dir`, size in bytes), shards in order and
    /// `model.safetensors.index.json` last when there is one.
    pub files: Vec<(String, u64)>,
    /// Sum of the sizes in `files`: the bytes a transfer of the whole model moves.
    pub total_bytes: u64,
}

/// One tensor of the layout, before it is assigned to a shard.
#[derive(Debug, Clone)]
struct TensorSpec {
    name: String,
    shape: Vec<u64>,
}

impl TensorSpec {
    fn new(name: String, shape: Vec<u64>) -> Self {
        Self { name, shape }
    }

    fn bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * ELEM_BYTES
    }
}

/// Dimensions of the generated decoder.
#[derive(Debug, Clone, Copy)]
struct Dims {
    hidden: u64,
    intermediate: u64,
    layers: u64,
    vocab: u64,
}

impl Dims {
    fn layer_bytes(hidden: u64, intermediate: u64) -> u64 {
        // q, k, v, o: hidden²; gate, up, down: hidden × intermediate; two norms: hidden.
        ELEM_BYTES * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden)
    }

    /// Llama's MLP width: 8/3 of the hidden size, rounded up to a multiple of 64.
    fn intermediate_for(hidden: u64) -> u64 {
        (hidden * 8 / 3).div_ceil(64) * 64
    }

    /// Chooses dimensions whose tensor bytes are at most `total` and close to it.
    fn for_budget(total: u64, shards: usize) -> anyhow::Result<Self> {
        let min_layers = MIN_LAYERS.max(shards as u64);
        for (idx, &hidden) in HIDDEN_SIZES.iter().enumerate() {
            let smallest = idx + 1 == HIDDEN_SIZES.len();
            let intermediate = Self::intermediate_for(hidden);
            let layer = Self::layer_bytes(hidden, intermediate);
            // A nominal vocabulary of 4 × hidden keeps the embedding well under one layer.
            let base_vocab = 4 * hidden;
            let row_pair = 2 * hidden * ELEM_BYTES; // one vocabulary row of embed + lm_head
            let fixed = base_vocab * row_pair + hidden * ELEM_BYTES; // + final norm
            let wanted_layers = if smallest { shards as u64 } else { min_layers };
            if total < fixed + wanted_layers * layer {
                if smallest {
                    break;
                }
                continue;
            }
            let layers = (total - fixed) / layer;
            let spare = total - fixed - layers * layer;
            let vocab = base_vocab + spare / row_pair;
            return Ok(Self {
                hidden,
                intermediate,
                layers,
                vocab,
            });
        }
        let hidden = HIDDEN_SIZES[HIDDEN_SIZES.len() - 1];
        let need = 4 * hidden * 2 * hidden * ELEM_BYTES
            + hidden * ELEM_BYTES
            + shards as u64 * Self::layer_bytes(hidden, Self::intermediate_for(hidden));
        bail!(
            "total_bytes {total} is too small for a model of {shards} shard(s); need at least {need}"
        )
    }

    /// The tensors in checkpoint order.
    fn tensors(&self) -> Vec<TensorSpec> {
        let (h, i) = (self.hidden, self.intermediate);
        let mut out = Vec::with_capacity(self.layers as usize * 9 + 3);
        out.push(TensorSpec::new(
            "model.embed_tokens.weight".into(),
            vec![self.vocab, h],
        ));
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                out.push(TensorSpec::new(
                    format!("{p}.self_attn.{proj}.weight"),
                    vec![h, h],
                ));
            }
            out.push(TensorSpec::new(
                format!("{p}.mlp.gate_proj.weight"),
                vec![i, h],
            ));
            out.push(TensorSpec::new(
                format!("{p}.mlp.up_proj.weight"),
                vec![i, h],
            ));
            out.push(TensorSpec::new(
                format!("{p}.mlp.down_proj.weight"),
                vec![h, i],
            ));
            out.push(TensorSpec::new(
                format!("{p}.input_layernorm.weight"),
                vec![h],
            ));
            out.push(TensorSpec::new(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
            ));
        }
        out.push(TensorSpec::new("model.norm.weight".into(), vec![h]));
        out.push(TensorSpec::new(
            "lm_head.weight".into(),
            vec![self.vocab, h],
        ));
        out
    }
}

/// Splits `tensors` (in order) into `shards` contiguous groups of roughly equal bytes.
fn split_shards(tensors: Vec<TensorSpec>, shards: usize) -> anyhow::Result<Vec<Vec<TensorSpec>>> {
    let total: u64 = tensors.iter().map(TensorSpec::bytes).sum();
    let mut out: Vec<Vec<TensorSpec>> = vec![Vec::new(); shards];
    let mut offset = 0u64;
    for t in tensors {
        let size = t.bytes();
        let mid = u128::from(offset) * 2 + u128::from(size);
        // Shard whose slice [k·total/shards, (k+1)·total/shards) holds the midpoint.
        let k = (mid * shards as u128 / (u128::from(total.max(1)) * 2)) as usize;
        out[k.min(shards - 1)].push(t);
        offset += size;
    }
    if let Some(empty) = out.iter().position(Vec::is_empty) {
        bail!("shard {} of {shards} would hold no tensor", empty + 1);
    }
    Ok(out)
}

/// Builds the safetensors header for `tensors` laid out back to back, padded with spaces so the
/// data starts on an 8-byte boundary.
fn header_bytes(tensors: &[TensorSpec]) -> anyhow::Result<(Vec<u8>, u64)> {
    let mut map = Map::new();
    map.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0u64;
    for t in tensors {
        let end = offset + t.bytes();
        map.insert(
            t.name.clone(),
            json!({ "dtype": "BF16", "shape": t.shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut header = serde_json::to_vec(&Value::Object(map)).context("encoding header")?;
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    Ok((header, offset))
}

/// SplitMix64 step: a full-period 64-bit generator with good output mixing, fast enough to
/// fill memory at several GB/s per core.
#[inline]
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Clears bit 14 of every 16-bit lane: the top exponent bit of BF16 and F16, so no lane is NaN
/// or infinite.
const FINITE_MASK: u64 = 0xBFFF_BFFF_BFFF_BFFF;

/// Fills `buf` with the stream for (`seed`, `stream`): deterministic in its arguments.
///
/// Four independent SplitMix64 lanes fill each 32-byte group, which lets the CPU overlap their
/// multiplies (about twice the speed of one lane).
fn fill_stream(buf: &mut [u8], seed: u64, stream: u64) {
    let mut key = seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
    // Mix the key so adjacent streams do not start from adjacent states.
    let mut lanes = [0u64; 4];
    for lane in &mut lanes {
        *lane = splitmix64(&mut key);
    }
    let mut groups = buf.chunks_exact_mut(32);
    for g in &mut groups {
        let [a, b, c, d] = &mut lanes;
        let words = [
            splitmix64(a) & FINITE_MASK,
            splitmix64(b) & FINITE_MASK,
            splitmix64(c) & FINITE_MASK,
            splitmix64(d) & FINITE_MASK,
        ];
        for (dst, w) in g.chunks_exact_mut(8).zip(words) {
            dst.copy_from_slice(&w.to_le_bytes());
        }
    }
    for tail in groups.into_remainder().chunks_mut(8) {
        let w = (splitmix64(&mut lanes[0]) & FINITE_MASK).to_le_bytes();
        tail.copy_from_slice(&w[..tail.len()]);
    }
}

/// Fills one block of file `file` starting `block` blocks into its data, on up to
/// [`FILL_THREADS`] threads. Each thread's part has its own stream key, so the result does not
/// depend on scheduling.
fn fill_block(buf: &mut [u8], seed: u64, file: u64, block: u64) {
    let part = buf.len().div_ceil(FILL_THREADS).next_multiple_of(8).max(8);
    let key = |j: usize| (file << 40) ^ (block << 8) ^ j as u64;
    if buf.len() <= part {
        fill_stream(buf, seed, key(0));
        return;
    }
    std::thread::scope(|s| {
        for (j, piece) in buf.chunks_mut(part).enumerate() {
            s.spawn(move || fill_stream(piece, seed, key(j)));
        }
    });
}

/// Writes one safetensors file and returns its size.
fn write_shard(path: &Path, tensors: &[TensorSpec], seed: u64, file: u64) -> anyhow::Result<u64> {
    let (header, data_len) = header_bytes(tensors)?;
    let f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = BufWriter::with_capacity(64 << 10, f);
    w.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|()| w.write_all(&header))
        .with_context(|| format!("writing header of {}", path.display()))?;
    let mut w = w
        .into_inner()
        .map_err(|e| e.into_error())
        .with_context(|| format!("writing header of {}", path.display()))?;
    let mut buf = vec![0u8; BLOCK_BYTES.min(usize::try_from(data_len).unwrap_or(BLOCK_BYTES))];
    let mut written = 0u64;
    let mut block = 0u64;
    while written < data_len {
        let n = buf
            .len()
            .min(usize::try_from(data_len - written).unwrap_or(buf.len()));
        fill_block(&mut buf[..n], seed, file, block);
        w.write_all(&buf[..n])
            .with_context(|| format!("writing {}", path.display()))?;
        written += n as u64;
        block += 1;
    }
    w.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(8 + header.len() as u64 + data_len)
}

/// File name of shard `i` (0-based) of `n`, in the Hugging Face convention.
fn shard_file_name(i: usize, n: usize) -> String {
    if n == 1 {
        "model.safetensors".to_owned()
    } else {
        format!("model-{:05}-of-{n:05}.safetensors", i + 1)
    }
}

/// Generates a synthetic model as described by `spec` into `dir` (created if missing; existing
/// files of the same names are overwritten).
///
/// Writes `model.safetensors` for one shard, or `model-0000i-of-0000n.safetensors` files plus a
/// Hugging Face `model.safetensors.index.json` for several.
///
/// # Errors
///
/// `spec.shards` is 0 or above 99 999, `spec.total_bytes` is above 16 TiB or too small to hold
/// a model with that many shards, or a file cannot be written.
pub fn generate(dir: &Path, spec: &SynthSpec) -> anyhow::Result<SynthModel> {
    ensure!(
        (1..=MAX_SHARDS).contains(&spec.shards),
        "shards must be between 1 and {MAX_SHARDS}, got {}",
        spec.shards
    );
    ensure!(
        spec.total_bytes <= MAX_TOTAL_BYTES,
        "total_bytes must be at most {MAX_TOTAL_BYTES}, got {}",
        spec.total_bytes
    );
    let dims = Dims::for_budget(spec.total_bytes, spec.shards)?;
    let tensors = dims.tensors();
    let tensor_bytes: u64 = tensors.iter().map(TensorSpec::bytes).sum();
    let shards = split_shards(tensors, spec.shards)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;

    let mut files = Vec::with_capacity(spec.shards + 1);
    let mut weight_map = Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let name = shard_file_name(i, spec.shards);
        let size = write_shard(&dir.join(&name), shard, spec.seed, i as u64)?;
        for t in shard {
            weight_map.insert(t.name.clone(), Value::String(name.clone()));
        }
        files.push((name, size));
    }
    if spec.shards > 1 {
        let index = json!({
            "metadata": { "total_size": tensor_bytes },
            "weight_map": weight_map,
        });
        let name = "model.safetensors.index.json".to_owned();
        let path = dir.join(&name);
        let body = serde_json::to_vec_pretty(&index).context("encoding index")?;
        std::fs::write(&path, &body).with_context(|| format!("writing {}", path.display()))?;
        files.push((name, body.len() as u64));
    }
    let total_bytes = files.iter().map(|(_, s)| s).sum();
    Ok(SynthModel {
        dir: dir.to_path_buf(),
        files,
        total_bytes,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use safetensors::{Dtype, SafeTensors};

    use super::*;

    fn tensor_names(model: &SynthModel) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        for (name, size) in &model.files {
            if !name.ends_with(".safetensors") {
                continue;
            }
            let bytes = std::fs::read(model.dir.join(name)).expect("read shard");
            assert_eq!(bytes.len() as u64, *size, "{name}: reported size");
            let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
            assert_eq!((8 + header_len) % 8, 0, "{name}: data is 8-byte aligned");
            let (_, meta) = SafeTensors::read_metadata(&bytes).expect("metadata parses");
            assert_eq!(
                meta.metadata().as_ref().and_then(|m| m.get("format")),
                Some(&"pt".to_owned())
            );
            let st = SafeTensors::deserialize(&bytes).expect("file parses");
            for (tname, view) in st.tensors() {
                assert_eq!(view.dtype(), Dtype::BF16);
                let elems: usize = view.shape().iter().product();
                assert_eq!(view.data().len(), elems * 2, "{tname}: data length");
                assert!(
                    view.data().iter().any(|&b| b != 0),
                    "{tname}: not all zeros"
                );
                assert!(names.insert(tname), "tensor appears twice");
            }
        }
        names
    }

    #[test]
    fn single_shard_parses_and_fills_budget() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = SynthSpec {
            total_bytes: 24 << 20,
            shards: 1,
            seed: 7,
        };
        let model = generate(dir.path(), &spec).expect("generate");
        assert_eq!(model.files.len(), 1);
        assert_eq!(model.files[0].0, "model.safetensors");
        let names = tensor_names(&model);
        for n in [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.norm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
        ] {
            assert!(names.contains(n), "{n} present");
        }
        let on_disk = std::fs::metadata(dir.path().join("model.safetensors"))
            .expect("stat")
            .len();
        assert_eq!(on_disk, model.total_bytes);
        let requested = spec.total_bytes as f64;
        assert!(
            (model.total_bytes as f64 - requested).abs() / requested < 0.02,
            "{} vs {requested}",
            model.total_bytes
        );
    }

    #[test]
    fn sharded_model_has_complete_index() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = SynthSpec {
            total_bytes: 40 << 20,
            shards: 4,
            seed: 1,
        };
        let model = generate(dir.path(), &spec).expect("generate");
        let shard_names: Vec<_> = model.files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            shard_names,
            [
                "model-00001-of-00004.safetensors",
                "model-00002-of-00004.safetensors",
                "model-00003-of-00004.safetensors",
                "model-00004-of-00004.safetensors",
                "model.safetensors.index.json",
            ]
        );
        let names = tensor_names(&model);
        let index: Value = serde_json::from_slice(
            &std::fs::read(dir.path().join("model.safetensors.index.json")).expect("index"),
        )
        .expect("index parses");
        let map = index["weight_map"].as_object().expect("weight_map");
        assert_eq!(
            map.keys().cloned().collect::<BTreeSet<_>>(),
            names,
            "index lists every tensor"
        );
        // Every tensor is in the file the index names.
        for (name, _) in model
            .files
            .iter()
            .filter(|(n, _)| n.ends_with(".safetensors"))
        {
            let bytes = std::fs::read(dir.path().join(name)).expect("read");
            let st = SafeTensors::deserialize(&bytes).expect("parse");
            for t in st.names() {
                assert_eq!(map[t], Value::String(name.clone()));
            }
        }
        let total_size = index["metadata"]["total_size"]
            .as_u64()
            .expect("total_size");
        let header_bytes: u64 = model
            .files
            .iter()
            .filter(|(n, _)| n.ends_with(".safetensors"))
            .map(|(n, s)| {
                let bytes = std::fs::read(dir.path().join(n)).expect("read");
                let (hlen, _) = SafeTensors::read_metadata(&bytes).expect("meta");
                s - 8 - hlen as u64
            })
            .sum();
        assert_eq!(total_size, header_bytes, "total_size is the tensor bytes");
        assert!(total_size <= spec.total_bytes);
        assert!(spec.total_bytes - total_size < 4 * 8192);
        // Shards are balanced within a factor of two of the mean.
        let mean = total_size / 4;
        for (n, s) in model.files.iter().take(4) {
            assert!(*s > mean / 2 && *s < mean * 2, "{n}: {s} vs mean {mean}");
        }
    }

    #[test]
    fn deterministic_by_seed() {
        let spec = |seed| SynthSpec {
            total_bytes: 20 << 20,
            shards: 2,
            seed,
        };
        let a = tempfile::tempdir().expect("tempdir");
        let b = tempfile::tempdir().expect("tempdir");
        let c = tempfile::tempdir().expect("tempdir");
        let ma = generate(a.path(), &spec(42)).expect("a");
        let mb = generate(b.path(), &spec(42)).expect("b");
        let mc = generate(c.path(), &spec(43)).expect("c");
        assert_eq!(ma.files, mb.files);
        assert_eq!(ma.files, mc.files, "layout does not depend on the seed");
        for (name, _) in &ma.files {
            let fa = std::fs::read(a.path().join(name)).expect("read");
            let fb = std::fs::read(b.path().join(name)).expect("read");
            let fc = std::fs::read(c.path().join(name)).expect("read");
            assert!(fa == fb, "{name}: same seed, same bytes");
            if name.ends_with(".safetensors") {
                assert!(fa != fc, "{name}: other seed, other bytes");
            }
        }
    }

    #[test]
    fn sizes_across_scales_stay_close() {
        for total in [200 << 10, 3 << 20, 100 << 20, 1 << 30, 16 << 30, 140 << 30] {
            for shards in [1, 3, 8] {
                let Ok(dims) = Dims::for_budget(total, shards) else {
                    assert!(total < 1 << 20, "{total} bytes, {shards} shards");
                    continue;
                };
                let tensors = dims.tensors();
                let bytes: u64 = tensors.iter().map(TensorSpec::bytes).sum();
                assert!(bytes <= total);
                assert!(
                    total - bytes < 4 * dims.hidden,
                    "{total}: {bytes} ({dims:?})"
                );
                let split = split_shards(tensors, shards).expect("no empty shard");
                assert_eq!(split.len(), shards);
            }
        }
    }

    #[test]
    fn bad_specs_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bad = [
            SynthSpec {
                total_bytes: 1 << 20,
                shards: 0,
                seed: 0,
            },
            SynthSpec {
                total_bytes: 0,
                shards: 1,
                seed: 0,
            },
            SynthSpec {
                total_bytes: 100,
                shards: 1,
                seed: 0,
            },
            SynthSpec {
                total_bytes: 1 << 20,
                shards: 10_000,
                seed: 0,
            },
            SynthSpec {
                total_bytes: u64::MAX,
                shards: 1,
                seed: 0,
            },
        ];
        for spec in bad {
            assert!(generate(dir.path(), &spec).is_err(), "{spec:?}");
        }
    }

    #[test]
    fn a_one_gib_model_is_written_whole_in_its_shards() {
        // How long generating takes is `cold-start`'s and `chain`'s concern (their reports
        // time it); a timed assertion here failed on a loaded machine (21 s against 20 s).
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = SynthSpec {
            total_bytes: 1 << 30,
            shards: 4,
            seed: 3,
        };
        let model = generate(dir.path(), &spec).expect("generate");
        assert!(model.total_bytes > (1 << 30) * 98 / 100);
        let shards: Vec<_> = model
            .files
            .iter()
            .filter(|(name, _)| name.ends_with(".safetensors"))
            .collect();
        assert_eq!(shards.len(), 4, "{:?}", model.files);
        let mut sum = 0;
        for (name, size) in &model.files {
            let on_disk = std::fs::metadata(dir.path().join(name)).expect(name).len();
            assert_eq!(on_disk, *size, "{name}");
            sum += size;
        }
        assert_eq!(sum, model.total_bytes);
    }
}
