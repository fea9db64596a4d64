//! Fetching chunks into a session from an origin (range reads) or from another holder
//! (`Fetch`): used by recovery, by a head that does not hold its shard, by imports and by
//! repairs.
//!
//! `Node::fetch_model` fetches a whole model (an import with `fetch`), `Node::adopt_staged`
//! moves a kept import into the store shard by shard, and `Node::fetch_spans` fetches chunk
//! ranges in a given order (whole-model imports, partition-first loads, repairs).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use shardcast_protocol::{
    DataTier, Frame, HopTransport, HostId, Manifest, SessionId, VerifiedChunk,
};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::outcome::FetchError;
use super::session::{ChunkFrom, Incoming};
use super::{ChainError, Node, ShardSession, read_timeout};
use crate::origin::{self, Origin};
use crate::wire::Conn;

impl Node {
    /// Fetches `missing` chunks of the session's shard from `source` into the store:
    /// `shardcast://host:port` pulls from another holder, anything else is an origin URI.
    pub(super) async fn fill(
        &self,
        sess: &ShardSession,
        source: &str,
        missing: Vec<u32>,
    ) -> Result<(), FetchError> {
        if missing.is_empty() {
            return Ok(());
        }
        if let Some(addr) = source.strip_prefix("shardcast://") {
            // Ask only for the span that holds the missing chunks (`missing` is ascending),
            // not the whole range again.
            let span = match (missing.first(), missing.last()) {
                (Some(&first), Some(&last)) => first..last.saturating_add(1),
                _ => return Ok(()),
            };
            return self
                .pull_from_holder(sess, addr, None, span, self.cfg.idle_timeout)
                .await
                .map_err(|error| FetchError::Holder {
                    holder: addr.to_string(),
                    error,
                });
        }
        let origin = Origin::parse(source, &self.cfg.origins)?;
        self.fill_from(sess, &origin, missing, ChunkFrom::Origin)
            .await
    }

    /// Fills `missing` chunks of the session from `origin`, each verified and stored as
    /// coming `from` there.
    async fn fill_from(
        &self,
        sess: &ShardSession,
        origin: &Origin,
        missing: Vec<u32>,
        from: ChunkFrom,
    ) -> Result<(), FetchError> {
        let (tx, mut rx) = mpsc::channel::<VerifiedChunk>(self.cfg.origin_parallel.max(1) * 2);
        let fetch = {
            let origin = origin.clone();
            let manifest = sess.manifest.clone();
            let shard = sess.shard_index();
            let parallel = self.cfg.origin_parallel;
            tokio::spawn(async move {
                origin::fetch_chunks(&origin, manifest, shard, missing, parallel, tx).await
            })
        };
        while let Some(chunk) = rx.recv().await {
            let index = chunk.index();
            self.store_chunk(sess, index, Incoming::Verified(chunk), from)
                .await?;
        }
        Ok(fetch.await??)
    }

    /// Pulls every chunk of `span` (within the session's range) that `addr` holds; the
    /// holder must be host `expect` when given, be connected within twice `patience`, and
    /// send each frame within `patience`.
    pub(super) async fn pull_from_holder(
        &self,
        sess: &ShardSession,
        addr: &str,
        expect: Option<&HostId>,
        span: std::ops::Range<u32>,
        patience: std::time::Duration,
    ) -> Result<(), ChainError> {
        // A stopped holder's kernel still completes the TCP handshake: bound the set-up too.
        let setup = patience * 2;
        let result = async {
            let connect = self.connect(sess.transport, addr, expect);
            let (mut conn, _) = tokio::time::timeout(setup, connect)
                .await
                .map_err(|_| ChainError::Timeout(setup))??;
            self.fetch_over(sess, &mut conn, span, patience).await
        }
        .await;
        if let Err(e) = &result {
            self.forget_path(sess.transport, addr, e);
        }
        result
    }

    /// Sends `Fetch` for `span` on `conn` and stores every chunk the holder answers with.
    async fn fetch_over(
        &self,
        sess: &ShardSession,
        conn: &mut Conn,
        span: std::ops::Range<u32>,
        patience: std::time::Duration,
    ) -> Result<(), ChainError> {
        let shard = sess.shard_index();
        let fetch = Frame::Fetch {
            model: sess.model,
            shard,
            start: span.start,
            end: span.end,
        };
        conn.writer.send_now(&fetch).await?;
        loop {
            match read_timeout(conn, patience).await? {
                Frame::Chunk {
                    shard: s,
                    index,
                    data,
                } if s == shard && (sess.start..sess.end).contains(&index) => {
                    // A corrupt one is counted and dropped; what is missing is fetched by
                    // the next recovery attempt.
                    self.store_chunk(sess, index, Incoming::Unverified(data), ChunkFrom::Holder)
                        .await?;
                }
                Frame::Done => return Ok(()),
                Frame::Error { code, message } => return Err(ChainError::Remote { code, message }),
                other => {
                    return Err(ChainError::protocol(format!(
                        "unexpected {:?} answering Fetch",
                        other.ty()
                    )));
                }
            }
        }
    }

    /// Downloads a whole model from an origin into `tier` (the agent's `ImportModel` with
    /// `fetch`).
    pub async fn fetch_model(
        &self,
        manifest: &Arc<Manifest>,
        origin: &str,
        tier: DataTier,
    ) -> Result<(), FetchError> {
        let spans = (0..manifest.shards.len() as u32)
            .map(|s| (s, 0..u32::MAX))
            .collect();
        self.fetch_spans(manifest, origin, tier, spans).await?;
        let model = manifest.digest();
        for s in 0..manifest.shards.len() as u32 {
            let complete = self
                .store
                .existing_shard(&model, s)
                .is_some_and(|sh| sh.is_complete());
            if !complete {
                return Err(FetchError::Incomplete { shard: s });
            }
        }
        Ok(())
    }

    /// Moves a model whose bytes were kept while its manifest was built (`staging`) into
    /// `tier`, one shard at a time. A shard the tier does not hold yet is renamed into place
    /// and its chunks marked verified without hashing them a second time (see
    /// [`crate::store::ShardStore::adopt_kept`] for why that is safe: the file is ours and
    /// holds exactly the bytes that were hashed; each chunk is still re-hashed before its
    /// bytes first leave the store). A shard the tier already holds in part, or one whose
    /// rename fails, is topped up from the staged file on the verified path every chunk
    /// takes, and that staged file removed once it is in. `origin` (the real one) is noted
    /// for repairs.
    pub async fn adopt_staged(
        &self,
        manifest: &Arc<Manifest>,
        staging: &crate::store::Staging,
        origin: &str,
        tier: DataTier,
    ) -> Result<(), FetchError> {
        let model = manifest.digest();
        self.repairs.note_source(model, origin);
        let staged = Origin::staged(staging.path());
        for (s, entry) in manifest.shards.iter().enumerate() {
            let s = s as u32;
            match self.store.adopt_kept(&model, s, tier, staging) {
                Ok(Some(shard)) if shard.is_complete() => {
                    self.stats
                        .kept_bytes
                        .fetch_add(entry.size, Ordering::Relaxed);
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(model = %model, shard = s, "cannot move the kept file into place; copying it through verification: {e}");
                }
            }
            let shard = self.store.shard(&model, s, tier)?;
            let total = shard.total_chunks();
            let missing: Vec<u32> = shard.verified_set(0, total).missing().collect();
            if !missing.is_empty() {
                let (sess, _active) = self.new_session(
                    SessionId([0; 16]),
                    model,
                    manifest.clone(),
                    shard.clone(),
                    0,
                    total,
                    String::new(),
                    (Bytes::new(), HopTransport::Tcp),
                );
                self.fill_from(&sess, &staged, missing, ChunkFrom::Kept)
                    .await?;
            }
            if !shard.is_complete() {
                return Err(FetchError::KeptIncomplete { shard: s });
            }
            if let Err(e) = staging.remove(&entry.path) {
                warn!(model = %model, shard = s, "removing a staged shard: {e}");
            }
        }
        Ok(())
    }

    /// Downloads the chunks of `spans` (shard, chunk range; clipped to the shard) that this
    /// host does not hold yet, in the order given, into `tier`. `source` is an origin URL or
    /// `shardcast://host:port`, a peer's data listener. Used for whole-model imports and for
    /// partitioned loads (the partition's chunks first, then the rest).
    pub async fn fetch_spans(
        &self,
        manifest: &Arc<Manifest>,
        source: &str,
        tier: DataTier,
        spans: Vec<(u32, std::ops::Range<u32>)>,
    ) -> Result<(), FetchError> {
        let model = manifest.digest();
        self.repairs.note_source(model, source);
        for (s, range) in spans {
            if s as usize >= manifest.shards.len() {
                return Err(FetchError::NoSuchShard {
                    shard: s,
                    shards: manifest.shards.len(),
                });
            }
            let shard = self.store.shard(&model, s, tier)?;
            let total = shard.total_chunks();
            let (start, end) = (range.start.min(total), range.end.min(total));
            if start >= end {
                continue;
            }
            let missing: Vec<u32> = shard.verified_set(start, end).missing().collect();
            if missing.is_empty() {
                continue;
            }
            let (sess, _active) = self.new_session(
                SessionId([0; 16]),
                model,
                manifest.clone(),
                shard,
                start,
                end,
                source.to_string(),
                (Bytes::new(), HopTransport::Tcp),
            );
            self.fill(&sess, source, missing).await?;
            debug!(model = %model, shard = s, start, end, "chunks fetched");
        }
        Ok(())
    }
}
