//! transferd's side of GPU loading: the store as a [`ChunkSource`] (chunks are loaded as
//! they are verified, while the chain transfer is still running), the GPU manager, and the
//! hand-off for inference processes.
//!
//! Corruption at rest: every chunk is checked ([`Shard::check`]: re-hashed unless verified
//! within the store's trust window) before its bytes are copied towards a GPU, and every
//! chunk of a memory-tier hand-off before the files are offered. A chunk that fails is
//! dropped and repaired; a load waits for the repair (up to [`REPAIR_WAIT`]) and fails
//! rather than copy bad bytes; a hand-off is refused until the repair is done.
//!
//! The source reads with `pread` through the store's own file handle, and offers each
//! shard's read-only map (`Shard::mapping`) as `host_memory` for the loader's registered path,
//! running the same checks in `check_direct` before a GPU copies straight from it. [`load`]
//! serves `LoadModel`; `load_partition` serves it with a `PartitionSpec`: fetch the
//! safetensors headers from the given peer or origin, pick the tensors of the layer groups
//! (`shardcast_policies::profile::group_of`), start the partition-first load, then fetch the
//! partition's chunks and then the rest. [`handoff()`] serves from the GPUs, else the
//! memory-tier files; a [`Selection`] (`?tensors=` / `?prefix=`) keeps the tensors a rank uses
//! and the shards holding them, and on the memory tier re-checks only the headers and those
//! tensors' chunks.

use std::sync::Arc;
use std::time::Duration;

use gpu_loader::device::HostMemory;
use gpu_loader::handoff::{self, Handoff};
use gpu_loader::index::{self, Layout, ShardRange, TensorEntry};
use gpu_loader::loader::{ChunkSource, SourceError, SourceShard};
use gpu_loader::manager::{GpuManager, LoadRequest, ManagerError, PartitionLoad};
use shardcast_policies::evict::Heaviness;
use shardcast_policies::profile::group_of;
use shardcast_protocol::agent::PartitionSpec;
use shardcast_protocol::{DataTier, ModelDigest};
use tracing::warn;

use crate::chain::Fetcher;
use crate::repair::{RepairHandle, RepairRequest};
use crate::store::{Check, Shard, ShardStore, StoreError};

/// How long a GPU load waits for a chunk found corrupt at rest to be repaired.
pub const REPAIR_WAIT: Duration = Duration::from_secs(60);

/// What GPU loads and hand-offs touch: the GPU manager, the store (manifests, the memory
/// tier's shards) and the repair queue (a chunk that fails its check before its bytes go
/// to a GPU or to an inference process is queued). Cheap to clone. A partitioned load
/// with a source also fetches: [`load`] is given the fetcher for that.
#[derive(Clone)]
pub struct GpuLoads {
    store: ShardStore,
    repairs: RepairHandle,
    manager: Arc<GpuManager>,
}

impl GpuLoads {
    /// Loads and hand-offs of `store`'s models onto `manager`'s GPUs.
    pub fn new(store: ShardStore, repairs: RepairHandle, manager: Arc<GpuManager>) -> Self {
        Self {
            store,
            repairs,
            manager,
        }
    }

    /// The GPU manager.
    pub fn manager(&self) -> &Arc<GpuManager> {
        &self.manager
    }

    /// The store the loads read.
    pub fn store(&self) -> &ShardStore {
        &self.store
    }
}

/// Why a model's memory-tier shards cannot be read as a [`StoreSource`].
#[derive(Debug, thiserror::Error)]
pub enum StoreSourceError {
    /// The model's manifest is not on this host.
    #[error("model {0} is unknown on this host")]
    UnknownModel(ModelDigest),
    /// A shard could not be opened in the memory tier.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The memory tier's shards of one model, read as their chunks are verified.
pub struct StoreSource {
    shards: Vec<Arc<Shard>>,
    info: Vec<SourceShard>,
    repairs: RepairHandle,
    rt: tokio::runtime::Handle,
}

impl StoreSource {
    /// The memory-tier shards of `digest` (created empty if the model is still to arrive).
    pub fn new(
        store: &ShardStore,
        repairs: RepairHandle,
        digest: &ModelDigest,
        rt: tokio::runtime::Handle,
    ) -> Result<Self, StoreSourceError> {
        let manifest = store
            .manifest(digest)
            .ok_or(StoreSourceError::UnknownModel(*digest))?;
        let mut shards = Vec::new();
        let mut info = Vec::new();
        for (i, s) in manifest.shards.iter().enumerate() {
            // Read through the store's own file handle: no path is opened again.
            let shard = store.shard(digest, i as u32, DataTier::Memory)?;
            info.push(SourceShard {
                path: s.path.to_string(),
                size: s.size,
                chunk_size: manifest.chunk_size,
            });
            shards.push(shard);
        }
        Ok(Self {
            shards,
            info,
            repairs,
            rt,
        })
    }

    /// Checks chunk `c` of `s` before its bytes go to a GPU; a chunk that fails is repaired
    /// (waiting up to [`REPAIR_WAIT`]) or the read fails.
    fn ensure_sound(&self, s: &Arc<Shard>, c: u32) -> std::io::Result<()> {
        let failed = |e: &dyn std::fmt::Display| {
            std::io::Error::other(format!(
                "chunk {c} of {} cannot be loaded: {e}",
                s.path().display()
            ))
        };
        match s.check(c, false, Check::Load) {
            Ok(_) => return Ok(()),
            Err(StoreError::CorruptChunk { .. } | StoreError::NotVerified { .. }) => {}
            Err(e) => return Err(failed(&e)),
        }
        let wait = async {
            tokio::time::timeout(REPAIR_WAIT, self.repairs.repair(s.clone(), vec![c])).await
        };
        // Usually the loader's own thread; the partition path also reads headers from the
        // runtime, where blocking needs `block_in_place` (multi-threaded runtimes only).
        let repaired = match tokio::runtime::Handle::try_current() {
            Err(_) => self.rt.block_on(wait),
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| self.rt.block_on(wait))
            }
            Ok(_) => {
                self.repairs.request(RepairRequest::new(s.clone(), vec![c]));
                return Err(failed(&"it is corrupt at rest and being repaired; retry"));
            }
        };
        match repaired {
            Ok(Ok(())) => s
                .check(c, false, Check::Load)
                .map(|_| ())
                .map_err(|e| failed(&e)),
            Ok(Err(e)) => Err(failed(&e)),
            Err(_) => Err(failed(&format!("not repaired within {REPAIR_WAIT:?}"))),
        }
    }

    /// Shard files, for the hand-off.
    pub fn file_paths(&self) -> Vec<String> {
        self.shards
            .iter()
            .map(|s| s.path().display().to_string())
            .collect()
    }
}

impl ChunkSource for StoreSource {
    fn shards(&self) -> &[SourceShard] {
        &self.info
    }

    fn wait_verified(
        &self,
        shard: usize,
        first: u32,
        last: u32,
        timeout: Duration,
    ) -> Result<bool, SourceError> {
        let s = self.shards.get(shard).ok_or(SourceError::NoShard(shard))?;
        let done = |s: &Shard| (first..=last).all(|c| s.is_verified(c));
        if done(s) {
            return Ok(true);
        }
        let mut rx = s.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        // Called from the loader's own thread, never from the runtime.
        self.rt.block_on(async {
            loop {
                if done(s) {
                    return Ok(true);
                }
                match tokio::time::timeout_at(deadline, rx.changed()).await {
                    Err(_) => return Ok(done(s)),
                    Ok(Err(_)) => return Err(SourceError::Removed),
                    Ok(Ok(())) => {}
                }
            }
        })
    }

    fn read(&self, shard: usize, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let s = self
            .shards
            .get(shard)
            .ok_or_else(|| std::io::Error::other(format!("no shard {shard}")))?;
        for c in s.chunks_covering(offset, buf.len()) {
            self.ensure_sound(s, c)?;
        }
        s.read_at(offset, buf)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    fn host_memory(&self, shard: usize) -> Option<Arc<dyn HostMemory>> {
        let map = self.shards.get(shard)?.mapping()?;
        Some(map as Arc<dyn HostMemory>)
    }

    /// What [`ChunkSource::read`] checks before its copy: the chunks are sound at rest (a
    /// chunk past the trust window is re-hashed, a bad one repaired or the load fails), so a
    /// GPU copying straight from the mapping gets the same guarantee.
    fn check_direct(&self, shard: usize, offset: u64, len: u64) -> std::io::Result<()> {
        let s = self
            .shards
            .get(shard)
            .ok_or_else(|| std::io::Error::other(format!("no shard {shard}")))?;
        if s.is_removed() {
            return Err(std::io::Error::other(format!(
                "{} was removed from the store",
                s.path().display()
            )));
        }
        let len = usize::try_from(len).map_err(std::io::Error::other)?;
        for c in s.chunks_covering(offset, len) {
            self.ensure_sound(s, c)?;
        }
        Ok(())
    }
}

/// Parses a `LoadModel` heaviness ("" is medium).
pub fn parse_heaviness(s: &str) -> Result<Heaviness, LoadFailure> {
    match s.to_ascii_lowercase().as_str() {
        "" | "medium" => Ok(Heaviness::Medium),
        "light" => Ok(Heaviness::Light),
        "heavy" => Ok(Heaviness::Heavy),
        other => Err(LoadFailure::Invalid(format!(
            "heaviness {other:?}: expected light, medium or heavy"
        ))),
    }
}

/// Starts loading `digest` onto GPUs of this host (the agent's `LoadModel`): the whole
/// model, or with `partition` a partitioned load (see `load_partition`).
pub(crate) async fn load(
    loads: &GpuLoads,
    fetcher: &Arc<Fetcher>,
    digest: &ModelDigest,
    count: usize,
    explicit: &[u32],
    heaviness: Heaviness,
    partition: Option<PartitionSpec>,
) -> Result<Vec<u32>, LoadFailure> {
    if let Some(spec) = partition {
        return load_partition(loads, fetcher, digest, count, explicit, heaviness, spec).await;
    }
    let source = StoreSource::new(
        &loads.store,
        loads.repairs.clone(),
        digest,
        tokio::runtime::Handle::current(),
    )
    .map_err(|e| LoadFailure::Source(e.to_string()))?;
    start(
        loads,
        digest,
        Arc::new(source),
        (count, explicit, heaviness),
        None,
    )
}

/// Hands a load to the GPU manager.
fn start(
    loads: &GpuLoads,
    digest: &ModelDigest,
    source: Arc<StoreSource>,
    (count, explicit, heaviness): (usize, &[u32], Heaviness),
    partition: Option<PartitionLoad>,
) -> Result<Vec<u32>, LoadFailure> {
    let name = loads
        .store
        .manifest(digest)
        .map(|m| m.name.to_string())
        .unwrap_or_default();
    let files = source.file_paths();
    loads
        .manager
        .start(
            LoadRequest {
                model: digest.to_hex(),
                name,
                count,
                gpus: explicit.to_vec(),
                files,
                partition,
                heaviness,
            },
            source,
        )
        .map_err(LoadFailure::Manager)
}

/// How long a partitioned load waits for the safetensors headers to arrive by a chain when
/// no source to fetch them from is given.
const HEADER_WAIT: Duration = Duration::from_secs(30);

/// Chunk spans (shard, chunks) covering byte `ranges`, merged, in the ranges' order.
fn chunk_spans(ranges: &[ShardRange], chunk_size: u32) -> Vec<(u32, std::ops::Range<u32>)> {
    let cs = u64::from(chunk_size.max(1));
    let mut out: Vec<(u32, std::ops::Range<u32>)> = Vec::new();
    for r in ranges.iter().filter(|r| r.len > 0) {
        let shard = r.shard as u32;
        let first = u32::try_from(r.offset / cs).unwrap_or(u32::MAX);
        let end = u32::try_from((r.offset + r.len - 1) / cs + 1).unwrap_or(u32::MAX);
        match out.last_mut() {
            Some((s, span)) if *s == shard && first <= span.end => span.end = span.end.max(end),
            _ => out.push((shard, first..end)),
        }
    }
    out
}

/// Starts a partitioned load (Flashpoint §4.2.5): reads the safetensors headers (fetching
/// them from `spec.source` when given, else waiting for a chain to deliver them), picks the
/// tensors of `spec.groups`, and loads them first; with `spec.complete` the rest of the
/// model follows into the same region. With a source, the data plane fetches the
/// partition's chunks first, then (with completion) every other chunk, while the loader
/// streams them to the GPUs.
async fn load_partition(
    loads: &GpuLoads,
    fetcher: &Arc<Fetcher>,
    digest: &ModelDigest,
    count: usize,
    explicit: &[u32],
    heaviness: Heaviness,
    spec: PartitionSpec,
) -> Result<Vec<u32>, LoadFailure> {
    if spec.groups.is_empty() {
        return Err(LoadFailure::Invalid(
            "a partition needs at least one layer group".into(),
        ));
    }
    let manifest = loads
        .store
        .manifest(digest)
        .ok_or_else(|| LoadFailure::Source(format!("model {digest} is unknown on this host")))?;
    let chunk_size = manifest.chunk_size;
    let source = Arc::new(
        StoreSource::new(
            &loads.store,
            loads.repairs.clone(),
            digest,
            tokio::runtime::Handle::current(),
        )
        .map_err(|e| LoadFailure::Source(e.to_string()))?,
    );
    let layout = Layout::of_source(source.shards());
    let tensor_shards: Vec<usize> = layout
        .shards
        .iter()
        .enumerate()
        .filter(|(_, s)| s.path.ends_with(".safetensors") && s.size >= 8)
        .map(|(i, _)| i)
        .collect();
    let header_len = |src: &StoreSource, i: usize| -> Result<u64, LoadFailure> {
        let mut b = [0u8; 8];
        src.read(i, 0, &mut b)
            .map_err(|e| LoadFailure::Source(format!("reading a header: {e}")))?;
        Ok(u64::from_le_bytes(b).min(index::MAX_HEADER))
    };
    // 1. The headers.
    if !spec.source.is_empty() {
        let first = tensor_shards.iter().map(|&i| (i as u32, 0..1)).collect();
        fetcher
            .fetch_spans(&manifest, &spec.source, DataTier::Memory, first)
            .await
            .map_err(|e| LoadFailure::Unavailable(format!("fetching headers: {e}")))?;
        let mut rest = Vec::new();
        for &i in &tensor_shards {
            let n = header_len(&source, i)?;
            let size = layout.shards[i].size;
            rest.push(ShardRange {
                shard: i,
                offset: 0,
                len: (8 + n).min(size),
            });
        }
        fetcher
            .fetch_spans(
                &manifest,
                &spec.source,
                DataTier::Memory,
                chunk_spans(&rest, chunk_size),
            )
            .await
            .map_err(|e| LoadFailure::Unavailable(format!("fetching headers: {e}")))?;
    }
    // 2. The tensor index (waits for header chunks a chain is still delivering).
    let index = {
        let (source, layout, shards) = (source.clone(), layout.clone(), tensor_shards.clone());
        tokio::task::spawn_blocking(move || -> Result<Vec<TensorEntry>, LoadFailure> {
            let cs = u64::from(chunk_size.max(1));
            let wait = |i: usize, last: u32| -> Result<(), LoadFailure> {
                match source.wait_verified(i, 0, last, HEADER_WAIT) {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(LoadFailure::Unavailable(format!(
                        "the header of {} did not arrive within {HEADER_WAIT:?}; give the partition a source or start the model's chain first",
                        layout.shards[i].path
                    ))),
                    Err(e) => Err(LoadFailure::Source(e.to_string())),
                }
            };
            for &i in &shards {
                wait(i, (7 / cs) as u32)?;
                let n = header_len(&source, i)?;
                let end = (8 + n).min(layout.shards[i].size).max(1);
                wait(i, ((end - 1) / cs) as u32)?;
            }
            index::tensor_index(&layout, |s, off, len| {
                let mut b = vec![0u8; len];
                source.read(s, off, &mut b)?;
                Ok(b)
            })
            .map_err(|e| LoadFailure::Source(e.to_string()))
        })
        .await
        .map_err(|e| LoadFailure::Source(format!("header task: {e}")))??
    };
    // 3. The partition's tensors.
    let wanted: std::collections::BTreeSet<&str> = spec.groups.iter().map(String::as_str).collect();
    let known: std::collections::BTreeSet<String> =
        index.iter().map(|t| group_of(&t.name)).collect();
    let unknown: Vec<&str> = wanted
        .iter()
        .filter(|g| !known.contains(**g))
        .copied()
        .collect();
    if !unknown.is_empty() {
        let sample: Vec<&String> = known.iter().take(6).collect();
        return Err(LoadFailure::Invalid(format!(
            "unknown layer groups {unknown:?}; this model has {} groups, e.g. {sample:?}",
            known.len()
        )));
    }
    let ranges = index::tensor_ranges(&layout, &index, |n| wanted.contains(group_of(n).as_str()));
    let label = if spec.label.is_empty() {
        format!("{} groups", wanted.len())
    } else {
        spec.label.clone()
    };
    let part_spans = chunk_spans(&ranges, chunk_size);
    let chosen = start(
        loads,
        digest,
        source,
        (count, explicit, heaviness),
        Some(PartitionLoad {
            label,
            ranges,
            complete: spec.complete,
            index,
        }),
    )?;
    // 4. The data plane: the partition's chunks first, then the rest.
    if !spec.source.is_empty() {
        let (fetcher, gpus, digest) = (fetcher.clone(), loads.manager.clone(), *digest);
        tokio::spawn(async move {
            let mut r = fetcher
                .fetch_spans(&manifest, &spec.source, DataTier::Memory, part_spans)
                .await;
            if r.is_ok() && spec.complete {
                let all = (0..manifest.shards.len() as u32)
                    .map(|s| (s, 0..u32::MAX))
                    .collect();
                r = fetcher
                    .fetch_spans(&manifest, &spec.source, DataTier::Memory, all)
                    .await;
            }
            if let Err(e) = r {
                warn!(model = %digest, "partition fetch from {} failed: {e}", spec.source);
                gpus.abort(
                    &digest.to_hex(),
                    &format!("fetching from {}: {e}", spec.source),
                );
            }
        });
    }
    Ok(chosen)
}

/// Why a load could not start.
#[derive(Debug, thiserror::Error)]
pub enum LoadFailure {
    /// The model or its shards.
    #[error("{0}")]
    Source(String),
    /// The request does not fit the model (unknown layer groups).
    #[error("{0}")]
    Invalid(String),
    /// The data could not be fetched or did not arrive.
    #[error("{0}")]
    Unavailable(String),
    /// The GPUs.
    #[error(transparent)]
    Manager(ManagerError),
}

/// Which tensors a hand-off lists: every one (the default), or those named in `names` or
/// starting with one of `prefixes` (`GET /v1/handoff/{model}?tensors=a,b&prefix=model.layers.3.`).
/// A tensor-parallel rank asks for what it uses; on the memory tier only the chunks holding
/// the selected tensors (and the headers) are re-checked before the files are offered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Exact tensor names.
    pub names: std::collections::BTreeSet<String>,
    /// Name prefixes.
    pub prefixes: Vec<String>,
}

impl Selection {
    /// Every tensor.
    pub fn all() -> Self {
        Self::default()
    }

    /// Parses query pairs: `tensors` (comma-separated names; repeatable) and `prefix`
    /// (repeatable); other keys are refused.
    pub fn from_query(pairs: &[(String, String)]) -> Result<Self, String> {
        let mut s = Self::default();
        for (k, v) in pairs {
            match k.as_str() {
                "tensors" | "tensor" => s.names.extend(
                    v.split(',')
                        .map(str::trim)
                        .filter(|n| !n.is_empty())
                        .map(String::from),
                ),
                "prefix" if !v.is_empty() => s.prefixes.push(v.clone()),
                "prefix" => {}
                other => {
                    return Err(format!(
                        "unknown hand-off parameter {other:?}; expected tensors or prefix"
                    ));
                }
            }
        }
        Ok(s)
    }

    /// Whether it selects every tensor.
    pub fn is_all(&self) -> bool {
        self.names.is_empty() && self.prefixes.is_empty()
    }

    /// Whether tensor `name` is selected.
    pub fn wants(&self, name: &str) -> bool {
        self.is_all()
            || self.names.contains(name)
            || self.prefixes.iter().any(|p| name.starts_with(p.as_str()))
    }

    /// Keeps the selected tensors (and the shards holding them). Names that match no
    /// tensor are an error: a rank asking for a tensor the model lacks is misconfigured.
    pub fn apply(&self, mut h: Handoff) -> Result<Handoff, HandoffError> {
        if self.is_all() {
            return Ok(h);
        }
        let missing: Vec<&String> = self
            .names
            .iter()
            .filter(|n| !h.tensors.iter().any(|t| &t.name == *n))
            .collect();
        if !missing.is_empty() {
            let shown: Vec<&&String> = missing.iter().take(8).collect();
            return Err(HandoffError::Invalid(format!(
                "model {} has no tensors named {shown:?}{}",
                h.name,
                if missing.len() > 8 { " …" } else { "" }
            )));
        }
        h.tensors.retain(|t| self.wants(&t.name));
        let used: std::collections::BTreeSet<&str> =
            h.tensors.iter().map(|t| t.shard.as_str()).collect();
        let used: std::collections::BTreeSet<String> = used.into_iter().map(String::from).collect();
        h.shards.retain(|s| used.contains(&s.path));
        Ok(h)
    }
}

/// Why a hand-off is not offered.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    /// Not now: loading, incomplete, being repaired (HTTP 409).
    #[error("{0}")]
    Unavailable(String),
    /// The request does not fit the model (HTTP 400).
    #[error("{0}")]
    Invalid(String),
}

/// The hand-off of `digest`: from the GPUs when it is resident there, else the memory-tier
/// files (when the model is complete in memory), listing the tensors `select` chooses.
pub fn handoff(
    loads: &GpuLoads,
    digest: &ModelDigest,
    select: &Selection,
) -> Result<Handoff, HandoffError> {
    let unavailable = HandoffError::Unavailable;
    match loads.manager.handoff(&digest.to_hex()) {
        Ok(h) => return select.apply(h),
        Err(ManagerError::Busy(m)) => {
            return Err(unavailable(format!("model {m} is still loading onto GPUs")));
        }
        Err(_) => {}
    }
    let manifest = loads
        .store
        .manifest(digest)
        .ok_or_else(|| unavailable(format!("model {digest} is unknown on this host")))?;
    let mut shards = Vec::new();
    let mut copies = Vec::new();
    for (i, s) in manifest.shards.iter().enumerate() {
        let shard = loads
            .store
            .existing_shard(digest, i as u32)
            .filter(|sh| sh.tier() == DataTier::Memory && sh.is_complete())
            .ok_or_else(|| {
                unavailable(format!(
                    "model {digest} is not complete in this host's memory tier"
                ))
            })?;
        shards.push((s.path.to_string(), shard.path().to_path_buf(), s.size));
        copies.push(shard);
    }
    // The inference process maps these files: every chunk it may read that was not
    // verified within the trust window is re-hashed first. A whole hand-off checks every
    // chunk before the index is read; with a selection, first each shard's header (the
    // index comes from it), then only the selected tensors' chunks.
    let check = |i: usize, chunks: std::ops::Range<u32>| -> Result<(), HandoffError> {
        let shard = &copies[i];
        for c in chunks {
            match shard.check(c, false, Check::Handoff) {
                Ok(_) => {}
                Err(e @ StoreError::CorruptChunk { .. }) => {
                    loads
                        .repairs
                        .request(RepairRequest::new(shard.clone(), vec![c]));
                    return Err(unavailable(format!(
                        "{e}; it is being repaired, retry the hand-off"
                    )));
                }
                Err(e) => return Err(unavailable(e.to_string())),
            }
        }
        Ok(())
    };
    let before_index = || -> Result<(), HandoffError> {
        for (i, shard) in copies.iter().enumerate() {
            if select.is_all() {
                check(i, 0..shard.total_chunks())?;
                continue;
            }
            check(i, shard.chunks_covering(0, 8))?;
            let mut len = [0u8; 8];
            let end = match shard.read_at(0, &mut len) {
                Ok(()) => 8u64.saturating_add(u64::from_le_bytes(len)),
                Err(_) => shard.size(),
            };
            let end = usize::try_from(end.min(shard.size())).unwrap_or(usize::MAX);
            check(i, shard.chunks_covering(0, end))?;
        }
        Ok(())
    };
    blocking(before_index)?;
    let h = handoff::memory_file(&digest.to_hex(), manifest.name.as_str(), &shards)
        .map_err(|e| unavailable(e.to_string()))?;
    let h = select.apply(h)?;
    if !select.is_all() {
        let tensors = || -> Result<(), HandoffError> {
            for (i, shard) in copies.iter().enumerate() {
                let Some(slot) = h.shards.iter().find(|s| s.path == shards[i].0) else {
                    continue;
                };
                for t in h.tensors.iter().filter(|t| t.shard == slot.path) {
                    let at = t.offset.saturating_sub(slot.offset);
                    let len = usize::try_from(t.nbytes).unwrap_or(usize::MAX);
                    check(i, shard.chunks_covering(at, len))?;
                }
            }
            Ok(())
        };
        blocking(tensors)?;
    }
    Ok(h)
}

/// Runs `f` off the async workers where the runtime allows (multi-threaded), else inline.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) if rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_loader::handoff::HandoffShard;

    fn pairs(q: &[(&str, &str)]) -> Vec<(String, String)> {
        q.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn sample() -> Handoff {
        let t = |name: &str, shard: &str, offset| TensorEntry {
            name: name.into(),
            dtype: "F32".into(),
            shape: vec![2],
            offset,
            nbytes: 8,
            shard: shard.into(),
        };
        let s = |path: &str, offset| HandoffShard {
            path: path.into(),
            file: format!("/mem/{path}"),
            offset,
            size: 100,
        };
        Handoff {
            model: "ab".into(),
            name: "org/m".into(),
            kind: "memory-file".into(),
            devices: vec![],
            shards: vec![
                s("a.safetensors", 0),
                s("b.safetensors", 4096),
                s("config.json", 8192),
            ],
            tensors: vec![
                t("layers.0.q", "a.safetensors", 16),
                t("layers.0.o", "a.safetensors", 24),
                t("layers.1.q", "b.safetensors", 4112),
            ],
            partition: None,
        }
    }

    #[test]
    fn a_selection_keeps_named_and_prefixed_tensors_and_their_shards() {
        let all = Selection::from_query(&[]).unwrap();
        assert!(all.is_all());
        assert_eq!(all.apply(sample()).unwrap().tensors.len(), 3);

        let sel = Selection::from_query(&pairs(&[("tensors", "layers.1.q, layers.0.o")])).unwrap();
        let h = sel.apply(sample()).unwrap();
        let names: Vec<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["layers.0.o", "layers.1.q"]);
        let shards: Vec<&str> = h.shards.iter().map(|s| s.path.as_str()).collect();
        assert_eq!(shards, ["a.safetensors", "b.safetensors"]);

        let sel = Selection::from_query(&pairs(&[("prefix", "layers.0.")])).unwrap();
        let h = sel.apply(sample()).unwrap();
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.shards.len(), 1);
        assert_eq!(h.shards[0].path, "a.safetensors");
    }

    #[test]
    fn a_selection_naming_a_missing_tensor_or_an_unknown_key_is_refused() {
        let sel = Selection::from_query(&pairs(&[("tensors", "layers.9.q")])).unwrap();
        let e = sel.apply(sample()).unwrap_err();
        assert!(matches!(e, HandoffError::Invalid(_)), "{e}");
        assert!(e.to_string().contains("layers.9.q"), "{e}");
        let e = Selection::from_query(&pairs(&[("rank", "1")])).unwrap_err();
        assert!(e.contains("rank"), "{e}");
    }
}
