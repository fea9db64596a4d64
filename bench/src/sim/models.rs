//! The models the simulator places: the six of Flashpoint's Table 3.1, their cold-start
//! phases, their layer profiles, and the manifests the simulated hosts "build" for them.
//!
//! ## Sizes (Table 3.1, MB = 10^6 bytes)
//!
//! CodeBERT-base 499 MB, ALBERT-xxlarge-v2 890 MB, BART-large 1,626 MB, DialoGPT-large
//! 3,135 MB, GPT-2-XL 6,282 MB, T5-3B 11,408 MB. Decimal megabytes: the thesis' T5-3B
//! download of ≈41 s at its measured 2,203 Mbit/s is 11,408 × 10^6 bytes.
//!
//! ## Phases (§3.4.1, Fig. 3.5)
//!
//! A cold start is download → load into host memory (deserialisation into tensors) → copy
//! to the GPU. The thesis gives absolute figures for T5-3B only: 14,138 ms to load and
//! 1,206 ms to send 11,408 MB to an A10, i.e. ≈ 807 MB/s and ≈ 9.46 GB/s; for the other
//! models only means across models relative to a warm start (Fig. 3.6). **Assumption**: the
//! other models load and copy at T5-3B's rates, so both phases scale with size. Both rates
//! are parameters ([`Phases`]), to be replaced by measured ones (the H100's 53.6 GB/s host →
//! GPU, shardcast's load path that needs no deserialisation).
//!
//! ## Layer profiles
//!
//! The thesis partitions T5-3B into 55 layers (§4.1.3) and gives no per-layer figures for
//! any model. **Assumption**: each model is split evenly into `layers` groups, T5-3B into
//! 55, the others into their transformer blocks plus an embedding and a head group (from
//! the architectures: 12, 12, 12 + 12, 36 and 48 blocks); each group's load time is its
//! share of the model's load + copy phases, its execution time its share of a batch-1
//! request at T5-3B's assumed 0.5 s per 11,408 MB (`shardcast_policies::profile`), and its
//! output the T5-3B-implied activation size. Every profile is marked `estimated`.

use shardcast_policies::profile::{LayerGroup, ModelProfile, T5_3B_EXEC_S, T5_3B_TOTAL_BYTES};
use shardcast_protocol::codec::DecodeError;
use shardcast_protocol::manifest::{ChunkHash, Manifest, ShardEntry};
use shardcast_protocol::name::NameError;
use shardcast_protocol::{ModelName, ShardPath};

/// Why a simulated model's manifest could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// The model's name is not a valid registry name.
    #[error("model name {model:?}: {source}")]
    Name {
        /// The model.
        model: &'static str,
        /// What is wrong with it.
        source: NameError,
    },
    /// A shard's file name is not a valid shard path.
    #[error("a shard path of {model}: {source}")]
    ShardPath {
        /// The model.
        model: &'static str,
        /// What is wrong with it.
        source: NameError,
    },
    /// The manifest itself is refused (too many shards or chunks, bad chunk size).
    #[error("the manifest of {model}: {source}")]
    Invalid {
        /// The model.
        model: &'static str,
        /// Why.
        source: DecodeError,
    },
}

/// One model of the catalogue.
#[derive(Debug, Clone, PartialEq)]
pub struct SimModel {
    /// The registry name (`t5-3b`).
    pub name: &'static str,
    /// As the thesis names it.
    pub label: &'static str,
    /// Parameters, as Table 3.1 gives them.
    pub params: &'static str,
    /// Weight bytes (Table 3.1).
    pub bytes: u64,
    /// Layer groups for the profile.
    pub layers: usize,
    /// The shards' sizes in manifest order (they add up to `bytes`); `None`: [`SHARD_BYTES`]
    /// each, the rest in the last. A model measured on a real or emulated cluster
    /// ([`super::params`]) has its manifest's.
    pub shards: Option<Vec<u64>>,
}

/// The six models of Flashpoint's Table 3.1, smallest first.
pub static TABLE_3_1: [SimModel; 6] = [
    SimModel {
        name: "codebert-base",
        label: "CodeBERT",
        params: "125M",
        bytes: 499_000_000,
        layers: 14,
        shards: None,
    },
    SimModel {
        name: "albert-xxlarge-v2",
        label: "ALBERT",
        params: "223M",
        bytes: 890_000_000,
        layers: 14,
        shards: None,
    },
    SimModel {
        name: "bart-large",
        label: "BART",
        params: "406M",
        bytes: 1_626_000_000,
        layers: 26,
        shards: None,
    },
    SimModel {
        name: "dialogpt-large",
        label: "DialoGPT",
        params: "774M",
        bytes: 3_135_000_000,
        layers: 38,
        shards: None,
    },
    SimModel {
        name: "gpt2-xl",
        label: "GPT-2",
        params: "1,558M",
        bytes: 6_282_000_000,
        layers: 50,
        shards: None,
    },
    SimModel {
        name: "t5-3b",
        label: "T5",
        params: "~2.8B",
        bytes: T5_3B_TOTAL_BYTES,
        layers: 55,
        shards: None,
    },
];

/// A model of the catalogue by registry name or thesis label (case-insensitive).
pub fn find(name: &str) -> Option<&'static SimModel> {
    TABLE_3_1
        .iter()
        .find(|m| m.name.eq_ignore_ascii_case(name) || m.label.eq_ignore_ascii_case(name))
}

/// The host-side phases of a cold start after the download, as rates.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Phases {
    /// Host memory → usable tensors (deserialisation), bytes/s.
    pub load_bps: f64,
    /// Host → GPU copy, bytes/s.
    pub gpu_bps: f64,
}

impl Phases {
    /// The thesis' T5-3B figures (§3.4.1): 11,408 MB loaded in 14.138 s and sent to an A10
    /// in 1.206 s.
    pub fn flashpoint() -> Self {
        Self {
            load_bps: T5_3B_TOTAL_BYTES as f64 / 14.138,
            gpu_bps: T5_3B_TOTAL_BYTES as f64 / 1.206,
        }
    }

    /// Seconds from a complete copy in host memory to a serving GPU replica.
    pub fn startup_s(&self, bytes: u64) -> f64 {
        bytes as f64 / self.load_bps + bytes as f64 / self.gpu_bps
    }
}

/// Largest shard: 5 GB, the Hugging Face default `max_shard_size` (the thesis' models are
/// one file each; shards only matter to striping, which needs several sources).
pub const SHARD_BYTES: u64 = 5_000_000_000;

/// The file name of shard `i` (0-based) of `count`, as the Hugging Face hub names them.
pub fn shard_path(i: usize, count: usize) -> String {
    format!("model-{:05}-of-{count:05}.safetensors", i + 1)
}

impl SimModel {
    /// Shard sizes: [`Self::shards`], or `SHARD_BYTES` each and the rest in the last.
    pub fn shard_sizes(&self) -> Vec<u64> {
        if let Some(sizes) = &self.shards {
            return sizes.clone();
        }
        let mut left = self.bytes;
        let mut out = Vec::new();
        while left > 0 {
            let s = left.min(SHARD_BYTES);
            out.push(s);
            left -= s;
        }
        out
    }

    /// The manifest a host builds for the model with `chunk_size`-byte chunks. No bytes
    /// exist, so the chunk hashes are BLAKE3 of (name, shard, chunk): distinct per chunk and
    /// per model, and the same on every run, so the digest is reproducible.
    pub fn manifest(&self, chunk_size: u32) -> Result<Manifest, ManifestError> {
        let model = self.name;
        let name = ModelName::new(model).map_err(|source| ManifestError::Name { model, source })?;
        let sizes = self.shard_sizes();
        let count = sizes.len();
        let mut shards = Vec::new();
        for (i, size) in sizes.into_iter().enumerate() {
            let chunks = shardcast_protocol::manifest::chunk_count(size, chunk_size);
            let hash = |c: u64| {
                ChunkHash(*blake3::hash(format!("{}/{i}/{c}", self.name).as_bytes()).as_bytes())
            };
            shards.push(ShardEntry {
                path: ShardPath::new(shard_path(i, count))
                    .map_err(|source| ManifestError::ShardPath { model, source })?,
                size,
                hash: hash(u64::MAX),
                chunks: (0..chunks).map(hash).collect(),
            });
        }
        Manifest::new(name, chunk_size, shards)
            .map_err(|source| ManifestError::Invalid { model, source })
    }

    /// The model's layer profile (module docs: an even split, estimated).
    pub fn profile(&self, phases: &Phases) -> ModelProfile {
        let layers = self.layers.max(1) as u64;
        let each = self.bytes / layers;
        let exec_per_byte = T5_3B_EXEC_S / T5_3B_TOTAL_BYTES as f64;
        let output_bytes = shardcast_policies::profile::t5_3b_activation_bytes();
        let groups = (0..layers)
            .map(|i| {
                let bytes = if i + 1 == layers {
                    self.bytes - each * (layers - 1)
                } else {
                    each
                };
                LayerGroup {
                    name: format!("layer.{i}"),
                    weight_bytes: bytes,
                    load_s: phases.startup_s(bytes),
                    exec_s: bytes as f64 * exec_per_byte,
                    output_bytes,
                }
            })
            .collect();
        ModelProfile {
            model: self.name.to_string(),
            groups,
            estimated: true,
            notes: vec![
                format!(
                    "{} ({} parameters, {} MB, Flashpoint Table 3.1) split evenly into {} \
                     layer groups: the thesis gives no per-layer figures",
                    self.label,
                    self.params,
                    self.bytes / 1_000_000,
                    self.layers
                ),
                "load_s: the thesis' T5-3B load and host-to-GPU rates (14.138 s and 1.206 s \
                 for 11,408 MB) applied to each group"
                    .to_string(),
                "exec_s: 0.5 s per 11,408 MB (an assumption, see shardcast_policies::profile)"
                    .to_string(),
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_3_1_sizes_and_lookup() {
        let mb: Vec<u64> = TABLE_3_1.iter().map(|m| m.bytes / 1_000_000).collect();
        assert_eq!(mb, [499, 890, 1626, 3135, 6282, 11408]);
        assert_eq!(find("T5").map(|m| m.name), Some("t5-3b"));
        assert_eq!(find("gpt2-xl").map(|m| m.label), Some("GPT-2"));
        assert!(find("llama").is_none());
    }

    #[test]
    fn phases_reproduce_the_thesis_t5_figures() {
        let p = Phases::flashpoint();
        let t5 = find("t5-3b").unwrap();
        assert!((p.startup_s(t5.bytes) - (14.138 + 1.206)).abs() < 1e-9);
        // Half the bytes, half the time.
        assert!((p.startup_s(t5.bytes / 2) - (14.138 + 1.206) / 2.0).abs() < 1e-9);
    }

    #[test]
    fn manifests_and_profiles_add_up() {
        let p = Phases::flashpoint();
        for m in &TABLE_3_1 {
            let man = m.manifest(1 << 20).unwrap();
            assert_eq!(man.total_bytes(), m.bytes);
            assert!(man.shards.iter().all(|s| s.size <= SHARD_BYTES));
            // Reproducible.
            assert_eq!(man.digest(), m.manifest(1 << 20).unwrap().digest());
            let prof = m.profile(&p);
            prof.validate().unwrap();
            assert_eq!(prof.groups.len(), m.layers);
            assert_eq!(prof.total_bytes(), m.bytes);
            assert!((prof.total_load_s() - p.startup_s(m.bytes)).abs() < 1e-6);
        }
        // Distinct models, distinct digests.
        let a = TABLE_3_1[0].manifest(1 << 20).unwrap().digest();
        let b = TABLE_3_1[1].manifest(1 << 20).unwrap().digest();
        assert_ne!(a, b);
        assert_eq!(find("t5-3b").unwrap().shard_sizes().len(), 3);
    }
}
