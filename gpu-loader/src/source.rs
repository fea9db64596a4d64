//! A [`ChunkSource`] over shards held in memory whose chunks become verified in order at a
//! paced rate, the way a chain transfer delivers them. Used by the loader benchmark
//! (`shardcast-bench loader`) and the tests to drive the pipeline without a network.
//!
//! The shards are either plain heap memory ([`PacedSource::new`]) or files mapped read-only
//! ([`PacedSource::from_files`]), which is what transferd's memory tier is: files in a tmpfs
//! directory, mapped. Only mapped shards offer [`ChunkSource::host_memory`], so only they can
//! take the loader's registered (no staging copy) path.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::device::HostMemory;
use crate::loader::{ChunkSource, SourceError, SourceShard};
use crate::mapped::MappedFile;

/// Where a shard's bytes are.
enum ShardBytes {
    /// On the heap: no registration possible.
    Heap(Vec<u8>),
    /// A read-only map of a file.
    Mapped(Arc<MappedFile>),
}

impl ShardBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Heap(v) => v,
            Self::Mapped(m) => m.as_slice(),
        }
    }
}

/// Shards in memory, "verified" over time.
pub struct PacedSource {
    shards: Vec<SourceShard>,
    data: Vec<ShardBytes>,
    verified: Mutex<Vec<u32>>,
    cv: Condvar,
    fail: Mutex<Option<String>>,
}

impl PacedSource {
    /// `(path, bytes)` shards split into `chunk`-byte chunks, none verified yet.
    pub fn new(data: Vec<(String, Vec<u8>)>, chunk: u32) -> Arc<Self> {
        Arc::new(Self {
            shards: data
                .iter()
                .map(|(p, d)| SourceShard {
                    path: p.clone(),
                    size: d.len() as u64,
                    chunk_size: chunk.max(1),
                })
                .collect(),
            verified: Mutex::new(vec![0; data.len()]),
            data: data.into_iter().map(|(_, d)| ShardBytes::Heap(d)).collect(),
            cv: Condvar::new(),
            fail: Mutex::new(None),
        })
    }

    /// `(path in the model, file)` shards, each file mapped read-only (see
    /// [`MappedFile::open`]: the files must stay as they are while the source lives), split
    /// into `chunk`-byte chunks, none verified yet.
    pub fn from_files(files: Vec<(String, PathBuf)>, chunk: u32) -> std::io::Result<Arc<Self>> {
        let mut shards = Vec::with_capacity(files.len());
        let mut data = Vec::with_capacity(files.len());
        for (path, file) in files {
            let m = MappedFile::open(&file)?;
            shards.push(SourceShard {
                path,
                size: m.as_slice().len() as u64,
                chunk_size: chunk.max(1),
            });
            data.push(ShardBytes::Mapped(m));
        }
        Ok(Arc::new(Self {
            verified: Mutex::new(vec![0; shards.len()]),
            shards,
            data,
            cv: Condvar::new(),
            fail: Mutex::new(None),
        }))
    }

    /// Marks every chunk verified, in order, at `rate` bytes/s (0: all at once), on a
    /// thread of its own. With `fail_after`, the "upstream vanishes" once that many bytes
    /// were delivered. Returns the thread, which ends when everything is delivered.
    pub fn deliver(
        self: &Arc<Self>,
        rate: u64,
        fail_after: Option<u64>,
    ) -> std::thread::JoinHandle<f64> {
        let me = self.clone();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let mut sent = 0u64;
            for (i, s) in me.shards.iter().enumerate() {
                let cs = u64::from(s.chunk_size);
                let chunks = s.size.div_ceil(cs) as u32;
                for c in 0..chunks {
                    sent += cs.min(s.size - u64::from(c) * cs);
                    if fail_after.is_some_and(|n| sent > n) {
                        *me.fail.lock().unwrap_or_else(PoisonError::into_inner) =
                            Some("upstream vanished".into());
                        me.cv.notify_all();
                        return t0.elapsed().as_secs_f64();
                    }
                    if rate > 0 {
                        let due = t0 + Duration::from_secs_f64(sent as f64 / rate as f64);
                        if let Some(w) = due.checked_duration_since(Instant::now()) {
                            std::thread::sleep(w);
                        }
                    }
                    if let Some(v) = me
                        .verified
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .get_mut(i)
                    {
                        *v = c + 1;
                    }
                    me.cv.notify_all();
                }
            }
            t0.elapsed().as_secs_f64()
        })
    }

    fn failure(&self) -> Option<String> {
        self.fail
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl ChunkSource for PacedSource {
    fn shards(&self) -> &[SourceShard] {
        &self.shards
    }

    fn wait_verified(
        &self,
        shard: usize,
        _first: u32,
        last: u32,
        timeout: Duration,
    ) -> Result<bool, SourceError> {
        let g = self.verified.lock().unwrap_or_else(PoisonError::into_inner);
        let done = |v: &Vec<u32>| v.get(shard).is_some_and(|&n| n > last);
        let (g, _) = self
            .cv
            .wait_timeout_while(g, timeout, |v| !done(v) && self.failure().is_none())
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = self.failure() {
            return Err(SourceError::Failed(f));
        }
        Ok(done(&g))
    }

    fn read(&self, shard: usize, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let d = self
            .data
            .get(shard)
            .ok_or_else(|| std::io::Error::other(format!("no shard {shard}")))?;
        let o = usize::try_from(offset).map_err(std::io::Error::other)?;
        let src = d
            .as_slice()
            .get(o..o + buf.len())
            .ok_or_else(|| std::io::Error::other("read past the end of the shard"))?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn host_memory(&self, shard: usize) -> Option<Arc<dyn HostMemory>> {
        match self.data.get(shard)? {
            ShardBytes::Heap(_) => None,
            ShardBytes::Mapped(m) => Some(m.clone() as Arc<dyn HostMemory>),
        }
    }
}
