//! Model profiles: the per-layer-group figures that partition planning needs.
//!
//! A [`ModelProfile`] is a chain of [`LayerGroup`]s in execution order. For each group it
//! records the weight bytes (what must fit in one GPU), the time to load those weights into a
//! GPU (`load_s`: download or host-memory read, deserialisation and the host → GPU copy,
//! whatever the load path is), the execution time of one request through the group
//! (`exec_s`) and the size of the activations the group hands to the next one
//! (`output_bytes`, what crosses the link when a partition ends after this group).
//!
//! These are exactly the three per-layer properties Flashpoint's partition solver needs
//! (thesis §4.2.3 and §9: "file size, intermediate data size, and execution time"), and the
//! per-layer performance model of Gillis §IV-A (layer runtime + communication delay).
//!
//! Profiles come from measurement when available. When they do not,
//! [`profile_from_tensors`] derives an estimate from a safetensors tensor index
//! (names and byte sizes only) and marks it `estimated`; [`synthetic_t5_3b_like`] builds a
//! profile calibrated on the thesis' T5-3B numbers for tests, benches and the simulator.

use serde::{Deserialize, Serialize};

/// One group of consecutive layers: the unit a partition plan cuts between.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerGroup {
    /// Name of the group, e.g. `model.layers.7`, `pre` or `post`.
    pub name: String,
    /// Bytes of weights in the group (what a GPU holding it must store).
    pub weight_bytes: u64,
    /// Seconds to load the group's weights into a GPU along the load path.
    pub load_s: f64,
    /// Seconds to execute one request through the group.
    pub exec_s: f64,
    /// Bytes of activations the group outputs (sent over the link when a cut follows it).
    pub output_bytes: u64,
}

/// The profile of one model: its layer groups in execution order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    /// Model name or version.
    pub model: String,
    /// Layer groups in execution order.
    pub groups: Vec<LayerGroup>,
    /// True when the figures were derived (estimated), not measured.
    pub estimated: bool,
    /// Free-form notes: which figures are estimates and from what.
    pub notes: Vec<String>,
}

/// Why a profile is unusable.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProfileError {
    /// The profile has no layer groups.
    #[error("profile of {model:?} has no layer groups")]
    Empty {
        /// The model's name.
        model: String,
    },
    /// A group's load or execution time is negative, NaN or infinite.
    #[error("group {index} ({name:?}): {field} is {value}, expected a finite number >= 0")]
    InvalidTime {
        /// Index of the group in the chain.
        index: usize,
        /// Name of the group.
        name: String,
        /// `load_s` or `exec_s`.
        field: &'static str,
        /// The offending value.
        value: f64,
    },
    /// The sum of all load or execution times is not finite.
    #[error("the total {field} of the profile overflows")]
    TotalOverflow {
        /// `load_s` or `exec_s`.
        field: &'static str,
    },
}

impl ModelProfile {
    /// Total weight bytes over all groups (saturating at `u64::MAX`).
    pub fn total_bytes(&self) -> u64 {
        self.groups
            .iter()
            .fold(0u64, |acc, g| acc.saturating_add(g.weight_bytes))
    }

    /// Total load time over all groups: the cold start of the unpartitioned model, C(1).
    pub fn total_load_s(&self) -> f64 {
        self.groups.iter().map(|g| g.load_s).sum()
    }

    /// Total execution time over all groups: the unpartitioned inference time, I(1).
    pub fn total_exec_s(&self) -> f64 {
        self.groups.iter().map(|g| g.exec_s).sum()
    }

    /// Sets every group's load time to `weight_bytes / load_bps` (a load path at that rate)
    /// and marks the profile estimated, replacing any earlier load-rate note with one naming
    /// this rate.
    pub fn estimate_load(&mut self, load_bps: f64) {
        for g in &mut self.groups {
            g.load_s = g.weight_bytes as f64 / load_bps;
        }
        let note = format!("{LOAD_NOTE}{load_bps} B/s (load path)");
        match self.notes.iter().position(|n| n.starts_with(LOAD_NOTE)) {
            Some(i) => self.notes[i] = note,
            None => self.notes.insert(0, note),
        }
        self.estimated = true;
    }

    /// Sets every group's execution time to `weight_bytes × exec_s_per_byte` (batch-1
    /// inference is memory-bound) and marks the profile estimated, replacing any earlier
    /// execution-rate note.
    pub fn estimate_exec(&mut self, exec_s_per_byte: f64) {
        for g in &mut self.groups {
            g.exec_s = g.weight_bytes as f64 * exec_s_per_byte;
        }
        let note = format!("{EXEC_NOTE}{exec_s_per_byte} s/B (memory-bound batch-1 inference)");
        match self.notes.iter().position(|n| n.starts_with(EXEC_NOTE)) {
            Some(i) => self.notes[i] = note,
            None => {
                let after_load = self
                    .notes
                    .iter()
                    .position(|n| n.starts_with(LOAD_NOTE))
                    .map_or(0, |i| i + 1);
                self.notes.insert(after_load, note);
            }
        }
        self.estimated = true;
    }

    /// [`estimate_load`](Self::estimate_load) and [`estimate_exec`](Self::estimate_exec)
    /// at `bw`'s rates: what [`profile_from_tensors`] does to the groups it builds, so a
    /// derived profile can be re-estimated at other rates without its tensor index.
    pub fn estimate_times(&mut self, bw: &Bandwidths) {
        self.estimate_load(bw.load_bps);
        self.estimate_exec(bw.exec_s_per_byte);
    }

    /// Checks that the profile can be planned: at least one group, and every time finite
    /// and non-negative (with finite totals).
    pub fn validate(&self) -> Result<(), ProfileError> {
        if self.groups.is_empty() {
            return Err(ProfileError::Empty {
                model: self.model.clone(),
            });
        }
        for (index, g) in self.groups.iter().enumerate() {
            for (field, value) in [("load_s", g.load_s), ("exec_s", g.exec_s)] {
                if !(value.is_finite() && value >= 0.0) {
                    return Err(ProfileError::InvalidTime {
                        index,
                        name: g.name.clone(),
                        field,
                        value,
                    });
                }
            }
        }
        if !self.total_load_s().is_finite() {
            return Err(ProfileError::TotalOverflow { field: "load_s" });
        }
        if !self.total_exec_s().is_finite() {
            return Err(ProfileError::TotalOverflow { field: "exec_s" });
        }
        Ok(())
    }
}

/// The rates used to turn byte counts into times when a profile is estimated.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Bandwidths {
    /// Bytes per second along the load path (network, host memory tier, deserialisation
    /// and host → GPU copy together, whichever is the bottleneck).
    pub load_bps: f64,
    /// Execution seconds per weight byte for one request (a crude roofline: inference of
    /// a batch-1 request is memory-bound, so time grows with the weights read).
    pub exec_s_per_byte: f64,
    /// Bytes per second on the link carrying activations between partitions.
    pub link_bps: f64,
}

/// The slowest load, execution or link rate a setting may give, in bytes/s (1 MB/s).
/// Anything slower is almost certainly a unit left off: a bare number is bytes/s, so `100`
/// is 100 B/s, not 100 Gbit/s.
pub const MIN_RATE_BPS: u64 = 1_000_000;

impl Bandwidths {
    /// The execution rate: weight bytes one request runs through per second (the inverse
    /// of [`exec_s_per_byte`](Self::exec_s_per_byte)).
    pub fn exec_bps(&self) -> f64 {
        1.0 / self.exec_s_per_byte
    }
}

/// How the note recording an estimated load time starts.
const LOAD_NOTE: &str = "load_s estimated as weight_bytes / ";
/// How the note recording an estimated execution time starts.
const EXEC_NOTE: &str = "exec_s estimated as weight_bytes x ";

/// T5-3B's weights in bytes: 11,408 MB (Flashpoint thesis, Table 3.1).
pub const T5_3B_TOTAL_BYTES: u64 = 11_408_000_000;
/// T5-3B's full cold start (process initialisation) in seconds after Flashpoint's locality
/// and network optimisations (thesis §4.1.3, Fig. 4.5: 25.974 s).
pub const T5_3B_COLD_START_S: f64 = 25.974;
/// Execution time of one T5-3B request, in seconds. **Assumption**: the thesis' Fig. 4.5
/// plots it but the text gives no number; 0.5 s is a plausible batch-1 figure on an A10
/// and is consistent with the thesis' end-to-end averages (0.93–0.95 s including waits).
pub const T5_3B_EXEC_S: f64 = 0.5;
/// Extra inference time when T5-3B is cut into 55 partitions (54 cuts): +43.94%
/// (thesis §4.1.3).
pub const T5_3B_55_PARTITION_OVERHEAD: f64 = 0.4394;
/// Link between partitions: 10 Gbit/s, the thesis' testbed NICs (§6.1), in bytes/s.
pub const T5_3B_LINK_BPS: f64 = 1.25e9;
/// T5-3B's shared embedding: 32,128 tokens × 1,024 dims × 4 bytes (fp32).
pub const T5_3B_EMBEDDING_BYTES: u64 = 32_128 * 1_024 * 4;
/// T5-3B's final layer norms (encoder and decoder): 2 × 1,024 × 4 bytes.
pub const T5_3B_FINAL_NORM_BYTES: u64 = 2 * 1_024 * 4;

/// Activation bytes per cut implied by the thesis' T5-3B numbers: 54 cuts add 43.94% of a
/// 0.5 s inference, i.e. ≈ 4.07 ms per cut, ≈ 5.09 MB at 10 Gbit/s.
pub fn t5_3b_activation_bytes() -> u64 {
    let per_cut_s = T5_3B_55_PARTITION_OVERHEAD * T5_3B_EXEC_S / 54.0;
    (per_cut_s * T5_3B_LINK_BPS).round() as u64
}

impl Default for Bandwidths {
    /// Estimates calibrated on the thesis' T5-3B measurements: the load path moves
    /// 11,408 MB in 25.974 s (≈ 439 MB/s), execution is 0.5 s per 11,408 MB of weights
    /// (≈ 22.8 GB/s; an assumption, see [`T5_3B_EXEC_S`]) and the link is 10 Gbit/s.
    ///
    /// These are fallbacks, not a description of a GPU host (100–400 Gbit/s NICs, a memory
    /// tier loading at 25–55 GB/s over PCIe Gen4/5). The controller takes its figures from
    /// `--partition-link-rate` (else the slowest NIC rate its up GPU hosts report, else
    /// `--default-nic-rate`), `--partition-load-rate` and `--partition-exec-rate`;
    /// `shardcast plan` offline from `--link-rate` and `--load-rate`. The load and
    /// execution rates stay calibrated unless set: no host reports them (unlike its NIC
    /// rate), these are the only measured figures at hand, and they only shape profiles
    /// *estimated* from a tensor index (measured profiles carry their own times). On a fast
    /// memory tier they overstate load times, which favours more partitions than needed.
    fn default() -> Self {
        Self {
            load_bps: T5_3B_TOTAL_BYTES as f64 / T5_3B_COLD_START_S,
            exec_s_per_byte: T5_3B_EXEC_S / T5_3B_TOTAL_BYTES as f64,
            link_bps: T5_3B_LINK_BPS,
        }
    }
}

/// Tokens per request assumed when estimating activation sizes.
const ESTIMATE_SEQ_TOKENS: f64 = 512.0;
/// Bytes per activation element assumed when estimating (fp16 / bf16).
const ESTIMATE_ACTIVATION_DTYPE_BYTES: f64 = 2.0;
/// Bytes per weight assumed when guessing the hidden size (fp16 / bf16 checkpoints).
const ESTIMATE_WEIGHT_DTYPE_BYTES: f64 = 2.0;
/// Parameters per transformer layer in units of hidden²: 4h² attention + 8h² MLP.
const ESTIMATE_PARAMS_PER_HIDDEN_SQ: f64 = 12.0;

/// Where a tensor belongs: the stack and index of its layer, if its name has one.
///
/// The layer is named by the components up to the first all-digit component that is not
/// the first one: `model.layers.7.mlp.up_proj.weight` → (`model.layers`, 7),
/// `encoder.block.3.layer.0.…` → (`encoder.block`, 3), `transformer.h.11.…` →
/// (`transformer.h`, 11).
fn layer_of(name: &str) -> Option<(String, u64)> {
    let parts: Vec<&str> = name.split('.').collect();
    for (i, part) in parts.iter().enumerate().skip(1) {
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            let index = part.parse::<u64>().ok()?;
            return Some((parts[..i].join("."), index));
        }
    }
    None
}

/// Whether a non-layer tensor runs before the layers (embeddings) rather than after them
/// (final norm, LM head, pooler, anything else).
fn is_pre_layer(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    ["embed", "wte", "wpe", "shared", "word_embeddings", "tok_"]
        .iter()
        .any(|k| lower.contains(k))
}

/// Order of a layer stack: encoders before anything else, decoders after.
fn stack_rank(stack: &str) -> u8 {
    let lower = stack.to_ascii_lowercase();
    if lower.contains("encoder") {
        0
    } else if lower.contains("decoder") {
        2
    } else {
        1
    }
}

/// The layer group a tensor belongs to, named as [`profile_from_tensors`] names groups:
/// `<stack>.<N>` for layer tensors (`model.layers.7`), `pre` for embeddings, `post` for the
/// rest (final norm, LM head). Partitioned loads select tensors by these names.
pub fn group_of(tensor: &str) -> String {
    match layer_of(tensor) {
        Some((stack, index)) => format!("{stack}.{index}"),
        None if is_pre_layer(tensor) => "pre".to_owned(),
        None => "post".to_owned(),
    }
}

/// Derives an estimated profile from a tensor index (name, bytes), e.g. a safetensors
/// header.
///
/// Grouping: tensors whose name has a numeric component after a prefix
/// (`model.layers.N.…`, `encoder.block.N.…`, `decoder.block.N.…`, `transformer.h.N.…`)
/// form one group per (prefix, N), named `prefix.N`; stacks are ordered encoder first,
/// decoder last, others in between (ties: first appearance), layers by N. Other tensors
/// go to a `pre` group when their name looks like an embedding (`embed`, `wte`, `wpe`,
/// `shared`, …) and to a `post` group otherwise (final norm, LM head, pooler). Name order
/// in the index does not matter (safetensors headers are sorted alphabetically, which
/// would put `lm_head` before `model.layers`).
///
/// Estimates (all recorded in `notes`):
/// * `load_s = weight_bytes / bw.load_bps`;
/// * `exec_s = weight_bytes × bw.exec_s_per_byte` (batch-1 inference is memory-bound);
/// * `output_bytes = h × 512 tokens × 2 bytes`, with the hidden size guessed from the
///   median layer group as `h = sqrt(bytes / (12 × 2))` (a transformer layer has ≈ 12h²
///   parameters, fp16 weights). The same figure is used for every group.
pub fn profile_from_tensors(
    model: &str,
    tensors: &[(String, u64)],
    bw: &Bandwidths,
) -> ModelProfile {
    // (rank, first appearance of the stack, stack, index) → bytes
    let mut stack_first_seen: Vec<String> = Vec::new();
    let mut layers: std::collections::BTreeMap<(u8, usize, u64), (String, u64)> =
        std::collections::BTreeMap::new();
    let mut pre_bytes: Option<u64> = None;
    let mut post_bytes: Option<u64> = None;
    for (name, bytes) in tensors {
        match layer_of(name) {
            Some((stack, index)) => {
                let seen = match stack_first_seen.iter().position(|s| *s == stack) {
                    Some(pos) => pos,
                    None => {
                        stack_first_seen.push(stack.clone());
                        stack_first_seen.len() - 1
                    }
                };
                let entry = layers
                    .entry((stack_rank(&stack), seen, index))
                    .or_insert_with(|| (format!("{stack}.{index}"), 0));
                entry.1 = entry.1.saturating_add(*bytes);
            }
            None if is_pre_layer(name) => {
                pre_bytes = Some(pre_bytes.unwrap_or(0).saturating_add(*bytes));
            }
            None => post_bytes = Some(post_bytes.unwrap_or(0).saturating_add(*bytes)),
        }
    }

    let mut sized: Vec<(String, u64)> = Vec::new();
    if let Some(b) = pre_bytes {
        sized.push(("pre".to_owned(), b));
    }
    sized.extend(layers.into_values());
    if let Some(b) = post_bytes {
        sized.push(("post".to_owned(), b));
    }

    let mut layer_sizes: Vec<u64> = sized
        .iter()
        .filter(|(n, _)| n != "pre" && n != "post")
        .map(|(_, b)| *b)
        .collect();
    if layer_sizes.is_empty() {
        layer_sizes = sized.iter().map(|(_, b)| *b).collect();
    }
    layer_sizes.sort_unstable();
    let median = layer_sizes.get(layer_sizes.len() / 2).copied().unwrap_or(0);
    let hidden = (median as f64 / (ESTIMATE_PARAMS_PER_HIDDEN_SQ * ESTIMATE_WEIGHT_DTYPE_BYTES))
        .sqrt()
        .round();
    let output_bytes = (hidden * ESTIMATE_SEQ_TOKENS * ESTIMATE_ACTIVATION_DTYPE_BYTES) as u64;

    let groups = sized
        .into_iter()
        .map(|(name, weight_bytes)| LayerGroup {
            name,
            weight_bytes,
            load_s: 0.0,
            exec_s: 0.0,
            output_bytes,
        })
        .collect();

    let mut notes = vec![
        format!(
            "output_bytes estimated as hidden {hidden} x {ESTIMATE_SEQ_TOKENS} tokens x \
             {ESTIMATE_ACTIVATION_DTYPE_BYTES} B, hidden guessed from the median layer group \
             ({median} B = 12 h^2 fp16 parameters)"
        ),
        "groups from tensor names: layer stacks by numeric component; embeddings -> pre, \
         other non-layer tensors -> post"
            .to_owned(),
    ];
    if tensors.is_empty() {
        notes.push("no tensors given: the profile is empty".to_owned());
    }
    let mut profile = ModelProfile {
        model: model.to_owned(),
        groups,
        estimated: true,
        notes,
    };
    // Load and execution times (and their notes, first) at `bw`'s rates.
    profile.estimate_times(bw);
    profile
}

/// A T5-3B-like profile with `layers` transformer blocks (at least 1) plus a `pre` group
/// (the shared embedding) and a `post` group (final norms).
///
/// Calibration (constants above, all from the Flashpoint thesis unless marked):
/// * total weights 11,408 MB ([`T5_3B_TOTAL_BYTES`]); the embedding is 32,128 × 1,024 fp32
///   and the rest is spread over the blocks, the first `layers / 2` being encoder blocks and
///   the others decoder blocks 4/3 as large (a T5 decoder block adds cross-attention:
///   67 M vs 50 M parameters). With 48 blocks this is T5-3B's real shape (24 + 24).
/// * load rate: the full model loads in 25.974 s ([`T5_3B_COLD_START_S`]), so
///   `load_s = bytes × 25.974 / 11.408e9`. With 48 blocks the largest group is a decoder
///   block of ≈ 268 MB, i.e. a partitioned cold start of ≈ 0.61 s, close to the thesis'
///   0.589 s with 55 partitions (its layer split is not given).
/// * execution: 0.5 s per request in total, proportional to bytes (assumption,
///   [`T5_3B_EXEC_S`]).
/// * activations: [`t5_3b_activation_bytes`] (≈ 5.09 MB) per group, so that 54 cuts on a
///   10 Gbit/s link add 43.94% to the inference time, as the thesis reports.
///
/// The profile is marked `estimated`.
pub fn synthetic_t5_3b_like(layers: usize) -> ModelProfile {
    let layers = layers.max(1);
    let encoder = layers / 2;
    let decoder = layers - encoder;
    let block_bytes = T5_3B_TOTAL_BYTES - T5_3B_EMBEDDING_BYTES - T5_3B_FINAL_NORM_BYTES;
    let units = 3 * encoder as u64 + 4 * decoder as u64;
    let unit = block_bytes / units;
    let remainder = block_bytes - unit * units;

    let load_s_per_byte = T5_3B_COLD_START_S / T5_3B_TOTAL_BYTES as f64;
    let exec_s_per_byte = T5_3B_EXEC_S / T5_3B_TOTAL_BYTES as f64;
    let output_bytes = t5_3b_activation_bytes();
    let group = |name: String, weight_bytes: u64| LayerGroup {
        name,
        weight_bytes,
        load_s: weight_bytes as f64 * load_s_per_byte,
        exec_s: weight_bytes as f64 * exec_s_per_byte,
        output_bytes,
    };

    let mut groups = Vec::with_capacity(layers + 2);
    groups.push(group("pre".to_owned(), T5_3B_EMBEDDING_BYTES));
    for i in 0..encoder {
        groups.push(group(format!("encoder.block.{i}"), 3 * unit));
    }
    for i in 0..decoder {
        let extra = if i + 1 == decoder { remainder } else { 0 };
        groups.push(group(format!("decoder.block.{i}"), 4 * unit + extra));
    }
    groups.push(group("post".to_owned(), T5_3B_FINAL_NORM_BYTES));

    ModelProfile {
        model: format!("t5-3b-like-{layers}"),
        groups,
        estimated: true,
        notes: vec![
            "synthetic: calibrated on Flashpoint's T5-3B (11,408 MB, 25.974 s cold start, \
             +43.94% inference with 55 partitions)"
                .to_owned(),
            "exec_s assumes 0.5 s per request in total (not given in the thesis text)".to_owned(),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_names_parse() {
        assert_eq!(
            layer_of("model.layers.7.mlp.up_proj.weight"),
            Some(("model.layers".to_owned(), 7))
        );
        assert_eq!(
            layer_of("encoder.block.3.layer.0.SelfAttention.q.weight"),
            Some(("encoder.block".to_owned(), 3))
        );
        assert_eq!(
            layer_of("transformer.h.11.attn.c_attn.weight"),
            Some(("transformer.h".to_owned(), 11))
        );
        assert_eq!(layer_of("lm_head.weight"), None);
        assert_eq!(layer_of("0.weight"), None);
        assert_eq!(layer_of("a.99999999999999999999999.b"), None);
    }

    #[test]
    fn t5_synthetic_matches_calibration() {
        let p = synthetic_t5_3b_like(48);
        assert_eq!(p.groups.len(), 50);
        assert_eq!(p.total_bytes(), T5_3B_TOTAL_BYTES);
        assert!((p.total_load_s() - T5_3B_COLD_START_S).abs() < 1e-6);
        assert!((p.total_exec_s() - T5_3B_EXEC_S).abs() < 1e-9);
        p.validate().unwrap();
        let largest = p.groups.iter().map(|g| g.load_s).fold(0.0, f64::max);
        assert!((0.55..0.65).contains(&largest), "{largest}");
        // Degenerate layer counts still give a valid profile.
        for layers in [0, 1, 2, 3] {
            let p = synthetic_t5_3b_like(layers);
            p.validate().unwrap();
            assert_eq!(p.total_bytes(), T5_3B_TOTAL_BYTES);
        }
    }

    #[test]
    fn default_bandwidths_are_t5_calibrated() {
        let bw = Bandwidths::default();
        let t = T5_3B_TOTAL_BYTES as f64 / bw.load_bps;
        assert!((t - T5_3B_COLD_START_S).abs() < 1e-9);
        let exec = T5_3B_TOTAL_BYTES as f64 / bw.exec_bps();
        assert!((exec - T5_3B_EXEC_S).abs() < 1e-9);
        assert_eq!(bw.link_bps, T5_3B_LINK_BPS);
    }

    fn tensors() -> Vec<(String, u64)> {
        let mut t = vec![("model.embed_tokens.weight".to_owned(), 4_000)];
        for i in 0..4u64 {
            t.push((
                format!("model.layers.{i}.mlp.up_proj.weight"),
                1_000 * (i + 1),
            ));
        }
        t.push(("lm_head.weight".to_owned(), 4_000));
        t
    }

    #[test]
    fn a_derived_profile_re_estimated_at_other_rates_is_derived_at_them() {
        let fast = Bandwidths {
            load_bps: 40e9,
            exec_s_per_byte: 1.0 / 2e12,
            link_bps: 50e9,
        };
        let mut p = profile_from_tensors("m", &tensors(), &Bandwidths::default());
        p.estimate_times(&fast);
        // Groups, times and notes exactly as if derived at the new rates: a profile stored
        // at the old rates serves the new ones without its tensor index.
        assert_eq!(p, profile_from_tensors("m", &tensors(), &fast));
        assert_eq!(p.groups[1].load_s, 1_000.0 / 40e9);
        assert_eq!(p.groups[4].exec_s, 4_000.0 / 2e12);
        assert_eq!(
            p.notes.iter().filter(|n| n.starts_with(LOAD_NOTE)).count(),
            1
        );
        assert_eq!(
            p.notes.iter().filter(|n| n.starts_with(EXEC_NOTE)).count(),
            1
        );
        assert!(p.notes[0].contains("40000000000 B/s"), "{:?}", p.notes);
    }

    #[test]
    fn estimating_load_marks_a_measured_profile_estimated_and_keeps_exec() {
        let mut p = synthetic_t5_3b_like(4);
        p.estimated = false;
        let exec = p.total_exec_s();
        p.estimate_load(T5_3B_TOTAL_BYTES as f64 / 2.0);
        assert!((p.total_load_s() - 2.0).abs() < 1e-9);
        assert!((p.total_exec_s() - exec).abs() < 1e-12);
        assert!(p.estimated);
        assert!(p.notes[0].starts_with(LOAD_NOTE), "{:?}", p.notes);
        // The synthetic profile's own notes stay.
        assert!(p.notes.iter().any(|n| n.starts_with("synthetic")));
        p.validate().unwrap();
    }
}
