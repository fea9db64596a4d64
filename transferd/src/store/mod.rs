//! The shard store: where verified chunks land, in two tiers.
//!
//! A [`ShardStore`] keeps model shards in a **memory tier** (a tmpfs directory, by default
//! under `/dev/shm`, which inference processes on the host map directly) and a **disk
//! tier**. Chunks arrive as [`VerifiedChunk`]s (already checked against the manifest's
//! BLAKE3 hash), are written at their offset into a preallocated shard file, and only then
//! is their bit set in a persisted per-shard bitmap. Readers (chain forwarders, the GPU
//! loader) get verified chunks zero-copy from a memory map and wait for progress on a
//! [`tokio::sync::watch`] channel.
//!
//! ```text
//!  chain session ──VerifiedChunk──▶ Shard::write ──▶ ChunkWriter (pwrite | io_uring) ──▶ data file
//!                                        └──then──▶ verified bit ──▶ bitmap file, watch count
//!  forwarder / GPU loader ◀── Shard::read (mmap, zero-copy Bytes) ◀── Shard::subscribe
//! ```
//!
//! ## On-disk layout
//!
//! Each tier root (`memory_dir`, `disk_dir`) holds:
//!
//! ```text
//!  <tier_root>/models/<digest-hex>/<shard path>        shard data, under its original name
//!                                                      (paths may contain '/': subdirectories)
//!  <tier_root>/state/<digest-hex>/manifest.scmf        the model's manifest (binary encoding)
//!  <tier_root>/state/<digest-hex>/<shard index>.bits   verified-chunk bitmap (format in `shard`)
//! ```
//!
//! and the disk tier also holds every known manifest, with or without data:
//!
//! ```text
//!  <disk_dir>/manifests/<digest-hex>.scmf
//! ```
//!
//! Manifests use `shardcast_protocol::codec` encoding and are checked against the digest in
//! their file name when read. The modification time of a `manifests/` file is when it was
//! last stored; [`ShardStore::resolve`] uses it to find the newest version of a model name.
//!
//! ## Recovery
//!
//! [`ShardStore::open`] loads every known manifest and, in each tier, every
//! `state/<digest-hex>/` directory. A shard is recovered when its bitmap file is sound and
//! its data file has the manifest's size; otherwise its bits are forgotten (the chunks will
//! be fetched again). With [`StoreConfig::verify_on_recover`] every chunk marked verified is
//! re-hashed and cleared if it does not match. Nothing in a file is trusted enough to panic
//! on: bad files are logged and skipped.
//!
//! Non-goals: eviction policy and capacity accounting (callers decide what to
//! [`ShardStore::remove`]), replication between tiers (a copy is just another write).

mod map;
mod shard;
#[cfg(test)]
mod tests;
#[cfg(target_os = "linux")]
mod uring;
mod writer;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use shardcast_protocol::codec::{decode_exact, encode_to_vec};
use shardcast_protocol::{Manifest, ModelDigest, ModelName, ShardPath, Tier};

pub use shard::Shard;
pub use writer::{ChunkWriter, WriterKind};

use shard::{OpenMode, ShardSpec};

/// File name of a model's manifest in a tier's state directory.
const MANIFEST_FILE: &str = "manifest.scmf";
/// Both tiers, memory first (the preferred copy when equally verified).
const TIERS: [Tier; 2] = [Tier::Memory, Tier::Disk];

/// Where the store keeps its files and how it writes them.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Root of the memory tier; should be on tmpfs (e.g. `/dev/shm/shardcast`).
    pub memory_dir: PathBuf,
    /// Root of the disk tier; also holds the known manifests.
    pub disk_dir: PathBuf,
    /// Re-hash every chunk marked verified when opening, clearing those that do not match.
    /// Costs a read of all stored data at start-up; catches data changed behind the store's
    /// back and data lost by a host crash.
    pub verify_on_recover: bool,
    /// Which positional writer writes chunk data.
    pub writer: WriterKind,
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The model's manifest is not in the store.
    #[error("model {digest} is not known to the store")]
    UnknownModel {
        /// The model asked for.
        digest: ModelDigest,
    },
    /// The shard index is not in the model's manifest.
    #[error("model {digest} has no shard {shard}")]
    NoSuchShard {
        /// The model.
        digest: ModelDigest,
        /// The shard index asked for.
        shard: u32,
    },
    /// The chunk index is past the end of the shard.
    #[error("shard {shard} has no chunk {index} ({chunks} chunks)")]
    NoSuchChunk {
        /// The shard index.
        shard: u32,
        /// The chunk index asked for.
        index: u32,
        /// Chunks in the shard.
        chunks: u32,
    },
    /// The chunk has not been written and verified yet.
    #[error("chunk {shard}/{index} is not verified")]
    NotVerified {
        /// The shard index.
        shard: u32,
        /// The chunk index.
        index: u32,
    },
    /// The chunk was verified for another shard or another manifest than this shard's.
    #[error("chunk {got_shard}/{index} does not belong to shard {shard}")]
    ChunkMismatch {
        /// The shard written to.
        shard: u32,
        /// The shard the chunk was verified for.
        got_shard: u32,
        /// The chunk index.
        index: u32,
    },
    /// The shard's tier copy was removed from the store while in use.
    #[error("model {digest} was removed from the {tier:?} tier")]
    Removed {
        /// The model.
        digest: ModelDigest,
        /// The tier it was removed from.
        tier: Tier,
    },
    /// A shard path would lead outside the model directory.
    #[error("shard path {path:?} leads outside the model directory")]
    InvalidPath {
        /// The offending path.
        path: String,
    },
    /// A file-system operation failed (including ENOSPC while writing a chunk).
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A state file (manifest or bitmap) is malformed.
    #[error("corrupt state file {path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The io_uring writer could not be set up (old kernel, seccomp, disabled by sysctl).
    #[error("cannot set up the io_uring writer: {source}")]
    WriterSetup {
        /// The error from `io_uring_setup`.
        #[source]
        source: io::Error,
    },
}

/// A model present in one tier (see [`ShardStore::holdings`]).
#[derive(Debug, Clone)]
pub struct Holding {
    /// The model.
    pub digest: ModelDigest,
    /// Its name.
    pub name: ModelName,
    /// The tier.
    pub tier: Tier,
    /// Directory holding the shard files ([`ShardStore::model_dir`]).
    pub dir: PathBuf,
    /// Every shard of the manifest, in order; shards not started in this tier have
    /// `verified == 0`.
    pub shards: Vec<ShardState>,
}

/// How much of one shard a tier holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardState {
    /// The shard's path within the model.
    pub path: ShardPath,
    /// Its size in bytes.
    pub size: u64,
    /// Chunks verified in this tier.
    pub verified: u32,
    /// Chunks in the shard.
    pub total: u32,
}

/// The shard store. Cheap to clone (an `Arc`); all methods take `&self`.
#[derive(Clone, Debug)]
pub struct ShardStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    memory_dir: PathBuf,
    disk_dir: PathBuf,
    writer: Arc<ChunkWriter>,
    models: Mutex<HashMap<ModelDigest, Model>>,
}

#[derive(Debug)]
struct Model {
    manifest: Arc<Manifest>,
    /// When the manifest was last stored: orders versions of one name for `resolve`.
    stored: SystemTime,
    /// Tier copies present; each maps shard index to its open shard.
    tiers: HashMap<Tier, HashMap<u32, Arc<Shard>>>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn create_dir(path: &Path) -> Result<(), StoreError> {
    fs::create_dir_all(path).map_err(io_err(path))
}

/// Removes a directory tree; a missing one is fine.
fn remove_dir(path: &Path) -> Result<(), StoreError> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(StoreError::Io {
            path: path.into(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Writes a file atomically: a temporary file in the same directory, synced, then renamed.
fn write_atomic(path: &Path, data: &[u8]) -> Result<(), StoreError> {
    let tmp = path.with_extension("tmp");
    let f = fs::File::create(&tmp).map_err(io_err(&tmp))?;
    io::Write::write_all(&mut &f, data).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))
}

/// Reads a manifest file and checks it against `digest`.
fn read_manifest(path: &Path, digest: &ModelDigest) -> Result<Manifest, StoreError> {
    let raw = fs::read(path).map_err(io_err(path))?;
    let corrupt = |reason: String| StoreError::Corrupt {
        path: path.into(),
        reason,
    };
    let m: Manifest = decode_exact(Bytes::from(raw)).map_err(|e| corrupt(e.to_string()))?;
    if m.digest() != *digest {
        return Err(corrupt(format!(
            "manifest digest is {}, not {digest}",
            m.digest()
        )));
    }
    Ok(m)
}

/// The data file of `path` under `model_dir`. [`ShardPath`] already rejects absolute paths
/// and `.`/`..` components; this checks again, component by component, so that no path
/// handed to the file system can leave `model_dir`.
fn shard_file(model_dir: &Path, path: &ShardPath) -> Result<PathBuf, StoreError> {
    let rel = Path::new(path.as_str());
    if rel.components().all(|c| matches!(c, Component::Normal(_))) {
        Ok(model_dir.join(rel))
    } else {
        Err(StoreError::InvalidPath {
            path: path.as_str().into(),
        })
    }
}

impl ShardStore {
    /// Opens the store: creates the tier directories, sets up the writer and recovers every
    /// model found in either tier (see the module docs).
    pub fn open(cfg: StoreConfig) -> Result<Self, StoreError> {
        let StoreConfig {
            memory_dir,
            disk_dir,
            verify_on_recover,
            writer,
        } = cfg;
        for root in [&memory_dir, &disk_dir] {
            create_dir(&root.join("models"))?;
            create_dir(&root.join("state"))?;
        }
        create_dir(&disk_dir.join("manifests"))?;
        let writer = Arc::new(ChunkWriter::new(writer)?);
        tracing::debug!(writer = ?writer.kind(), "shard store writer");
        let inner = Inner {
            memory_dir,
            disk_dir,
            writer,
            models: Mutex::new(HashMap::new()),
        };
        let store = Self {
            inner: Arc::new(inner),
        };
        store.recover(verify_on_recover)?;
        Ok(store)
    }

    /// Loads known manifests, then each tier's models and shards.
    fn recover(&self, verify: bool) -> Result<(), StoreError> {
        let mut models = lock(&self.inner.models);
        let dir = self.inner.disk_dir.join("manifests");
        for (digest, path) in digest_entries(&dir, ".scmf")? {
            match read_manifest(&path, &digest) {
                Ok(m) => {
                    let stored = fs::metadata(&path)
                        .and_then(|md| md.modified())
                        .unwrap_or(SystemTime::UNIX_EPOCH);
                    models.insert(
                        digest,
                        Model {
                            manifest: Arc::new(m),
                            stored,
                            tiers: HashMap::new(),
                        },
                    );
                }
                Err(e) => tracing::warn!(error = %e, "skipping a known manifest"),
            }
        }
        for tier in TIERS {
            let state_root = self.tier_root(tier).join("state");
            for (digest, state_dir) in digest_entries(&state_root, "")? {
                let manifest = match models.get(&digest) {
                    Some(m) => m.manifest.clone(),
                    None => match read_manifest(&state_dir.join(MANIFEST_FILE), &digest) {
                        Ok(m) => {
                            // Known again from now on, even if the tier copy goes.
                            let path = self.known_manifest_path(&digest);
                            let stored = next_stamp(&models);
                            write_atomic(&path, &encode_to_vec(&m))?;
                            set_mtime(&path, stored).map_err(io_err(&path))?;
                            let m = Arc::new(m);
                            let model = Model {
                                manifest: m.clone(),
                                stored,
                                tiers: HashMap::new(),
                            };
                            models.insert(digest, model);
                            m
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, ?tier, "skipping a model without a manifest");
                            continue;
                        }
                    },
                };
                let mut shards = HashMap::new();
                for index in 0..manifest.shards.len() as u32 {
                    if !state_dir.join(format!("{index}.bits")).exists() {
                        continue;
                    }
                    let spec = self.spec(&manifest, digest, index, tier)?;
                    let shard = Shard::open(spec, OpenMode::Recover { verify })?;
                    shards.insert(index, Arc::new(shard));
                }
                tracing::info!(model = %digest, ?tier, shards = shards.len(), "recovered model");
                if let Some(model) = models.get_mut(&digest) {
                    model.tiers.insert(tier, shards);
                }
            }
        }
        Ok(())
    }

    /// The directory a tier lives in.
    pub fn tier_root(&self, tier: Tier) -> &Path {
        match tier {
            Tier::Memory => &self.inner.memory_dir,
            Tier::Disk => &self.inner.disk_dir,
        }
    }

    fn state_dir(&self, d: &ModelDigest, tier: Tier) -> PathBuf {
        self.tier_root(tier).join("state").join(d.to_hex())
    }

    fn known_manifest_path(&self, d: &ModelDigest) -> PathBuf {
        self.inner
            .disk_dir
            .join("manifests")
            .join(format!("{}.scmf", d.to_hex()))
    }

    fn spec(
        &self,
        manifest: &Arc<Manifest>,
        digest: ModelDigest,
        index: u32,
        tier: Tier,
    ) -> Result<ShardSpec, StoreError> {
        let entry = manifest.shard(index).map_err(|_| StoreError::NoSuchShard {
            digest,
            shard: index,
        })?;
        Ok(ShardSpec {
            manifest: manifest.clone(),
            digest,
            index,
            tier,
            data_path: shard_file(&self.model_dir(&digest, tier), &entry.path)?,
            bits_path: self.state_dir(&digest, tier).join(format!("{index}.bits")),
            writer: self.inner.writer.clone(),
        })
    }

    /// The writer in use (after [`WriterKind::Auto`] was resolved).
    pub fn writer_kind(&self) -> WriterKind {
        self.inner.writer.kind()
    }

    /// Stores a manifest (persisted at once, so it survives a restart even with no data) and
    /// returns the shared copy. Idempotent; storing a manifest again makes it the newest
    /// version of its name for [`ShardStore::resolve`] (a rollback).
    pub fn put_manifest(&self, m: &Manifest) -> Result<Arc<Manifest>, StoreError> {
        let digest = m.digest();
        let path = self.known_manifest_path(&digest);
        let mut models = lock(&self.inner.models);
        let stored = next_stamp(&models);
        let known = models.get_mut(&digest);
        // A known manifest only needs its time refreshed, unless its file went missing.
        if known.is_none() || set_mtime(&path, stored).is_err() {
            write_atomic(&path, &encode_to_vec(m))?;
            set_mtime(&path, stored).map_err(io_err(&path))?;
        }
        let manifest = match known {
            Some(model) => {
                model.stored = stored;
                model.manifest.clone()
            }
            None => {
                let manifest = Arc::new(m.clone());
                let model = Model {
                    manifest: manifest.clone(),
                    stored,
                    tiers: HashMap::new(),
                };
                models.insert(digest, model);
                manifest
            }
        };
        Ok(manifest)
    }

    /// The manifest of a known model.
    pub fn manifest(&self, d: &ModelDigest) -> Option<Arc<Manifest>> {
        lock(&self.inner.models).get(d).map(|m| m.manifest.clone())
    }

    /// Resolves a 64-character hex digest (returned as is, known or not) or a model name
    /// (the most recently stored manifest of that name; `None` if there is none).
    pub fn resolve(&self, name_or_hex_digest: &str) -> Option<ModelDigest> {
        if let Ok(d) = name_or_hex_digest.parse::<ModelDigest>() {
            return Some(d);
        }
        lock(&self.inner.models)
            .iter()
            .filter(|(_, m)| m.manifest.name.as_str() == name_or_hex_digest)
            .max_by_key(|(d, m)| (m.stored, **d))
            .map(|(d, _)| *d)
    }

    /// The shard `shard` of model `d` in `tier`, created (data file preallocated to its
    /// size, empty bitmap) if the tier does not have it yet. Repeated calls return the same
    /// `Arc`.
    pub fn shard(&self, d: &ModelDigest, shard: u32, tier: Tier) -> Result<Arc<Shard>, StoreError> {
        let mut models = lock(&self.inner.models);
        let model = models
            .get_mut(d)
            .ok_or(StoreError::UnknownModel { digest: *d })?;
        if let Some(s) = model.tiers.get(&tier).and_then(|t| t.get(&shard)) {
            return Ok(s.clone());
        }
        let spec = self.spec(&model.manifest, *d, shard, tier)?;
        if !model.tiers.contains_key(&tier) {
            let state_dir = self.state_dir(d, tier);
            create_dir(&state_dir)?;
            create_dir(&self.model_dir(d, tier))?;
            write_atomic(
                &state_dir.join(MANIFEST_FILE),
                &encode_to_vec(model.manifest.as_ref()),
            )?;
        }
        let s = Arc::new(Shard::open(spec, OpenMode::Create)?);
        model
            .tiers
            .entry(tier)
            .or_default()
            .insert(shard, s.clone());
        Ok(s)
    }

    /// The shard if some tier already has it: the copy with the most verified chunks, the
    /// memory tier's on a tie.
    pub fn existing_shard(&self, d: &ModelDigest, shard: u32) -> Option<Arc<Shard>> {
        let models = lock(&self.inner.models);
        let model = models.get(d)?;
        let mut best: Option<&Arc<Shard>> = None;
        for tier in TIERS {
            if let Some(s) = model.tiers.get(&tier).and_then(|t| t.get(&shard)) {
                if best.is_none_or(|b| s.verified_count() > b.verified_count()) {
                    best = Some(s);
                }
            }
        }
        best.cloned()
    }

    /// Every (model, tier) copy present, with per-shard progress.
    pub fn holdings(&self) -> Vec<Holding> {
        let models = lock(&self.inner.models);
        let mut out = Vec::new();
        for (digest, model) in models.iter() {
            for tier in TIERS {
                let Some(shards) = model.tiers.get(&tier) else {
                    continue;
                };
                let shards = model
                    .manifest
                    .shards
                    .iter()
                    .enumerate()
                    .map(|(i, e)| ShardState {
                        path: e.path.clone(),
                        size: e.size,
                        verified: shards.get(&(i as u32)).map_or(0, |s| s.verified_count()),
                        total: e.chunks.len() as u32,
                    })
                    .collect();
                out.push(Holding {
                    digest: *digest,
                    name: model.manifest.name.clone(),
                    tier,
                    dir: self.model_dir(digest, tier),
                    shards,
                });
            }
        }
        out.sort_by(|a, b| (a.name.as_str(), a.digest).cmp(&(b.name.as_str(), b.digest)));
        out
    }

    /// The directory holding model `d`'s shard files in `tier`, under their original
    /// names; an inference process maps files from here.
    pub fn model_dir(&self, d: &ModelDigest, tier: Tier) -> PathBuf {
        self.tier_root(tier).join("models").join(d.to_hex())
    }

    /// Deletes `tier`'s copy of model `d` (data and state). Shards still held elsewhere fail
    /// later reads and writes with [`StoreError::Removed`]. The manifest stays known.
    /// Removing a copy that is not there is not an error.
    pub fn remove(&self, d: &ModelDigest, tier: Tier) -> Result<(), StoreError> {
        let mut models = lock(&self.inner.models);
        let model = models
            .get_mut(d)
            .ok_or(StoreError::UnknownModel { digest: *d })?;
        if let Some(shards) = model.tiers.remove(&tier) {
            for s in shards.values() {
                s.mark_removed();
            }
        }
        // State first: a crash in between leaves data without bits, which recovery ignores.
        remove_dir(&self.state_dir(d, tier))?;
        remove_dir(&self.model_dir(d, tier))
    }
}

/// A time to record a manifest as stored: now, but strictly after every time recorded so
/// far, so that versions stored within one tick of the file system's clock still order.
fn next_stamp(models: &HashMap<ModelDigest, Model>) -> SystemTime {
    let now = SystemTime::now();
    match models.values().map(|m| m.stored).max() {
        Some(newest) if newest >= now => newest + Duration::from_nanos(1),
        _ => now,
    }
}

/// Sets a file's modification time (the manifest's stored time) to exactly `t`.
fn set_mtime(path: &Path, t: SystemTime) -> io::Result<()> {
    fs::File::options().write(true).open(path)?.set_modified(t)
}

/// Entries of `dir` named `<digest-hex><suffix>`, with their paths. Other names are skipped.
fn digest_entries(dir: &Path, suffix: &str) -> Result<Vec<(ModelDigest, PathBuf)>, StoreError> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        let Some(hex) = name.to_str().and_then(|n| n.strip_suffix(suffix)) else {
            continue;
        };
        match hex.parse::<ModelDigest>() {
            Ok(d) => out.push((d, entry.path())),
            Err(_) => tracing::debug!(name = ?name, "ignoring a stray entry in the store"),
        }
    }
    Ok(out)
}
