//! transferd's side of GPU loading: the store as a [`ChunkSource`] (chunks are loaded as
//! they are verified, while the chain transfer is still running), the GPU manager, and the
//! hand-off for inference processes.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use gpu_loader::handoff::{self, Handoff};
use gpu_loader::loader::{ChunkSource, SourceShard};
use gpu_loader::manager::{GpuManager, ManagerError};
use shardcast_protocol::{ModelDigest, Tier};

use crate::chain::Node;
use crate::store::Shard;

/// The memory tier's shards of one model, read as their chunks are verified.
pub struct StoreSource {
    shards: Vec<Arc<Shard>>,
    files: Vec<File>,
    info: Vec<SourceShard>,
    rt: tokio::runtime::Handle,
}

impl StoreSource {
    /// The memory-tier shards of `digest` (created empty if the model is still to arrive).
    pub fn new(
        node: &Node,
        digest: &ModelDigest,
        rt: tokio::runtime::Handle,
    ) -> Result<Self, String> {
        let manifest = node
            .store
            .manifest(digest)
            .ok_or_else(|| format!("model {digest} is unknown on this host"))?;
        let mut shards = Vec::new();
        let mut files = Vec::new();
        let mut info = Vec::new();
        for (i, s) in manifest.shards.iter().enumerate() {
            let shard = node
                .store
                .shard(digest, i as u32, Tier::Memory)
                .map_err(|e| e.to_string())?;
            files.push(
                File::open(shard.path())
                    .map_err(|e| format!("opening {}: {e}", shard.path().display()))?,
            );
            info.push(SourceShard {
                path: s.path.to_string(),
                size: s.size,
                chunk_size: manifest.chunk_size,
            });
            shards.push(shard);
        }
        Ok(Self {
            shards,
            files,
            info,
            rt,
        })
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
    ) -> Result<bool, String> {
        let s = self
            .shards
            .get(shard)
            .ok_or_else(|| format!("no shard {shard}"))?;
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
                    Ok(Err(_)) => return Err("the shard was removed from the store".into()),
                    Ok(Ok(())) => {}
                }
            }
        })
    }

    fn read(&self, shard: usize, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let f = self
            .files
            .get(shard)
            .ok_or_else(|| std::io::Error::other(format!("no shard {shard}")))?;
        f.read_exact_at(buf, offset)
    }
}

/// Starts loading `digest` onto GPUs of this host.
pub fn load(
    node: &Arc<Node>,
    gpus: &Arc<GpuManager>,
    digest: &ModelDigest,
    count: usize,
    explicit: &[u32],
) -> Result<Vec<u32>, LoadFailure> {
    let name = node
        .store
        .manifest(digest)
        .map(|m| m.name.to_string())
        .unwrap_or_default();
    let source = StoreSource::new(node, digest, tokio::runtime::Handle::current())
        .map_err(LoadFailure::Source)?;
    let files = source.file_paths();
    gpus.start_load(
        &digest.to_hex(),
        &name,
        Arc::new(source),
        count,
        explicit,
        files,
    )
    .map_err(LoadFailure::Manager)
}

/// Why a load could not start.
#[derive(Debug, thiserror::Error)]
pub enum LoadFailure {
    /// The model or its shards.
    #[error("{0}")]
    Source(String),
    /// The GPUs.
    #[error(transparent)]
    Manager(ManagerError),
}

/// The hand-off of `digest`: from the GPUs when it is resident there, else the memory-tier
/// files (when the model is complete in memory).
pub fn handoff(node: &Node, gpus: &GpuManager, digest: &ModelDigest) -> Result<Handoff, String> {
    match gpus.handoff(&digest.to_hex()) {
        Ok(h) => return Ok(h),
        Err(ManagerError::Busy(m)) => return Err(format!("model {m} is still loading onto GPUs")),
        Err(_) => {}
    }
    let manifest = node
        .store
        .manifest(digest)
        .ok_or_else(|| format!("model {digest} is unknown on this host"))?;
    let mut shards = Vec::new();
    for (i, s) in manifest.shards.iter().enumerate() {
        let shard = node
            .store
            .existing_shard(digest, i as u32)
            .filter(|sh| sh.tier() == Tier::Memory && sh.is_complete())
            .ok_or_else(|| format!("model {digest} is not complete in this host's memory tier"))?;
        shards.push((s.path.to_string(), shard.path().to_path_buf(), s.size));
    }
    handoff::memory_file(&digest.to_hex(), manifest.name.as_str(), &shards)
        .map_err(|e| e.to_string())
}
