//! The controller's state in etcd (`--state etcd://host:port[,host:port]`), for several
//! controller replicas with one leader (see [`crate::ha`]).
//!
//! Keys are `<prefix>/<table>/<key>` (prefix `/shardcast` by default); the leader's key
//! is `<prefix>/leader`. Every write is **fenced**: one etcd transaction that succeeds only
//! while the leader key still has the create revision this replica's term started with, so
//! a deposed leader's late write (after its lease expired and another replica took over)
//! is refused instead of overwriting the new leader's state.
//!
//! Large values: etcd refuses requests above `--max-request-bytes` (1.5 MiB by default).
//! A manifest is the largest record (a BLAKE3 hash per chunk: about 90 bytes per chunk in
//! its canonical encoding, so 1.5 MiB holds ~17 000 chunks, a 70 GB model at 4 MiB
//! chunks). We do not split values over several keys: a split value could not be written
//! in one fenced transaction (the transaction itself is bounded by the same limit), and a
//! reader could see half of a replaced one. Instead the limit is configurable on both
//! sides: run etcd with a larger `--max-request-bytes` and pass the same figure to the
//! controller's `--etcd-max-request-bytes`; a value above it is refused with an error that
//! names both flags (docs/OPERATIONS.md).
//!
//! Batches: [`StateStore::put_many`] (the write-behind's batches of host reports and plan
//! progress) commits fenced transactions of at most `--etcd-max-txn-ops` puts (etcd's
//! `--max-txn-ops`, 128 by default) and at most the request limit in bytes; each batch
//! is atomic, and the first batch refused by the fence ends the call with the same
//! "no longer the leader" error as a single put (earlier batches stay committed).
//!
//! Followers read the state at one revision ([`EtcdSnapshot`]) and then follow it with a
//! watch from the next revision ([`EtcdStore::watch`]), applying each change to their view
//! instead of reloading everything ([`crate::ha`]).
//!
//! The [`StateStore`] trait is synchronous and is called from the controller's async
//! code (often under its state lock, as redb's commits are). The etcd client is async, so
//! the store owns a small runtime of its own; a call runs there and the caller waits on a
//! channel, bounded by `--etcd-timeout-ms`. The caller never blocks a thread the etcd call
//! itself needs.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchClient, WatchOptions,
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::core::lock;
use crate::state::{StateError, StateStore, Table};

/// etcd's own default `--max-request-bytes`.
pub const ETCD_DEFAULT_MAX_REQUEST_BYTES: usize = 1536 * 1024;
/// Room kept under the request limit for the key, the comparison and framing.
const REQUEST_OVERHEAD: usize = 4096;
/// etcd's own default `--max-txn-ops`: the most operations one transaction may hold.
pub const ETCD_DEFAULT_MAX_TXN_OPS: usize = 128;
/// Bytes a put adds to a transaction besides its key and value (protobuf tags and lengths
/// are a few bytes; generous so that a batch never meets the request limit).
const OP_OVERHEAD: usize = 32;
/// Watch responses queued for the follower before the watch waits for it: a burst of
/// transactions (a plan's hosts completing) queues here instead of in etcd.
const WATCH_BUFFER: usize = 256;

/// Where the state lives in etcd.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// `host:port` (or `http://host:port`) of each etcd member.
    pub endpoints: Vec<String>,
    /// Key prefix, without a trailing slash (`/shardcast`).
    pub prefix: String,
    /// etcd's `--max-request-bytes`: larger values are refused here with a clear error.
    pub max_request_bytes: usize,
    /// etcd's `--max-txn-ops`: the most puts one `put_many` transaction holds.
    pub max_txn_ops: usize,
    /// The longest one etcd call may take.
    pub timeout: Duration,
    /// etcd user and password (etcd's own authentication), if enabled on the cluster.
    pub user: Option<(String, String)>,
}

impl EtcdConfig {
    /// Parses `etcd://host:port[,host:port...]`.
    pub fn parse_url(url: &str) -> Result<Vec<String>, String> {
        let rest = url
            .strip_prefix("etcd://")
            .ok_or_else(|| format!("state URL {url:?} must start with etcd://"))?;
        let mut out = Vec::new();
        for ep in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let hostport = ep.trim_end_matches('/');
            let Some((host, port)) = hostport.rsplit_once(':') else {
                return Err(format!("etcd endpoint {ep:?} must be host:port"));
            };
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(format!("etcd endpoint {ep:?} must be host:port"));
            }
            out.push(format!("http://{hostport}"));
        }
        if out.is_empty() {
            return Err(format!("state URL {url:?} names no etcd endpoint"));
        }
        Ok(out)
    }
}

/// The leader's advertised addresses, stored as the value of the leader key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderInfo {
    /// Replica id (`--replica-id`).
    pub id: String,
    /// gRPC address clients should use.
    pub grpc: String,
    /// HTTP address clients should use.
    pub http: String,
}

/// The outcome of one campaign round.
#[derive(Debug, Clone)]
pub enum Campaign {
    /// This replica holds the leader key now; writes are fenced on this create revision.
    Won {
        /// The leader key's create revision.
        revision: i64,
    },
    /// Another replica leads (`None`: its record is unreadable).
    Lost(Option<LeaderInfo>),
}

/// [`StateStore`] on etcd; also the election primitives [`crate::ha`] uses.
pub struct EtcdStore {
    rt: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
    client: Client,
    prefix: String,
    max_value: usize,
    max_txn_ops: usize,
    timeout: Duration,
    /// The leader key's create revision while this replica leads; `None`: writes refused.
    fence: Mutex<Option<i64>>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which is not allowed inside another runtime.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

fn etcd_err(what: &str, e: etcd_client::Error) -> StateError {
    StateError::from_display(format!("etcd {what}: {e}"))
}

impl EtcdStore {
    /// Connects (lazily: an etcd that is down now is retried on each call).
    pub fn connect(cfg: &EtcdConfig) -> Result<Arc<Self>, StateError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("etcd-client")
            .enable_all()
            .build()
            .map_err(|e| StateError::from_display(format!("etcd client runtime: {e}")))?;
        let handle = rt.handle().clone();
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(cfg.timeout)
            .with_timeout(cfg.timeout)
            .with_keep_alive(Duration::from_secs(2), cfg.timeout)
            .with_keep_alive_while_idle(true);
        if let Some((u, p)) = &cfg.user {
            opts = opts.with_user(u.clone(), p.clone());
        }
        let endpoints = cfg.endpoints.clone();
        let client = wait(&handle, cfg.timeout, "connect", async move {
            Client::connect(endpoints, Some(opts)).await
        })?;
        Ok(Arc::new(Self {
            rt: Some(rt),
            handle,
            client,
            prefix: cfg.prefix.trim_end_matches('/').to_string(),
            max_value: cfg.max_request_bytes.saturating_sub(REQUEST_OVERHEAD),
            max_txn_ops: cfg.max_txn_ops.max(1),
            timeout: cfg.timeout,
            fence: Mutex::new(None),
        }))
    }

    fn key(&self, table: Table, key: &str) -> String {
        format!("{}/{}/{key}", self.prefix, table.name())
    }

    fn table_prefix(&self, table: Table) -> String {
        format!("{}/{}/", self.prefix, table.name())
    }

    /// The leader key.
    pub fn leader_key(&self) -> String {
        format!("{}/leader", self.prefix)
    }

    /// Runs `f` on the store's runtime and blocks this thread until it ends (bounded).
    fn block<T, F>(&self, what: &str, f: F) -> Result<T, StateError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    {
        wait(&self.handle, self.timeout, what, f)
    }

    /// Runs `f` on the store's runtime and awaits it from any runtime (bounded).
    async fn run<T, F>(&self, what: &str, f: F) -> Result<T, StateError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    {
        let timeout = self.timeout;
        let what = what.to_string();
        let task = self.handle.spawn(async move {
            match tokio::time::timeout(timeout, f).await {
                Ok(r) => r.map_err(|e| etcd_err(&what, e)),
                Err(_) => Err(StateError::from_display(format!(
                    "etcd {what}: no answer within {timeout:?} (is etcd reachable?)"
                ))),
            }
        });
        task.await
            .map_err(|e| StateError::from_display(format!("etcd task: {e}")))?
    }

    /// Fences this replica's writes on `revision` (the leader key's create revision), or
    /// refuses every write (`None`).
    pub fn set_fence(&self, revision: Option<i64>) {
        *lock(&self.fence) = revision;
    }

    fn fence(&self) -> Result<i64, StateError> {
        lock(&self.fence).ok_or_else(|| {
            StateError::from_display(
                "this controller replica is not the leader: state writes are refused",
            )
        })
    }

    /// One fenced transaction: `ops` apply (all of them) only while the leader key is still
    /// this term's.
    fn fenced(&self, what: &str, ops: Vec<TxnOp>) -> Result<(), StateError> {
        let revision = self.fence()?;
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.leader_key(),
                CompareOp::Equal,
                revision,
            )])
            .and_then(ops);
        let mut kv = self.client.kv_client();
        let resp = self.block(what, async move { kv.txn(txn).await })?;
        if resp.succeeded() {
            Ok(())
        } else {
            // Someone else leads now: stop writing at once.
            self.set_fence(None);
            Err(StateError::from_display(
                "write refused: this controller replica is no longer the leader (fenced by the leader key's revision)",
            ))
        }
    }

    /// Refuses a value etcd would refuse, with the flags to change.
    fn check_size(&self, table: Table, key: &str, value: &[u8]) -> Result<(), StateError> {
        if value.len() <= self.max_value {
            return Ok(());
        }
        Err(StateError::from_display(format!(
            "{} record {key:?} is {} bytes, over the etcd request limit ({} bytes with room for the key): \
             start etcd with a larger --max-request-bytes and pass the same value to the controller's \
             --etcd-max-request-bytes (docs/OPERATIONS.md)",
            table.name(),
            value.len(),
            self.max_value + REQUEST_OVERHEAD,
        )))
    }

    /// The store's current revision (changes on every write anywhere in etcd).
    pub async fn revision(&self) -> Result<i64, StateError> {
        let mut kv = self.client.kv_client();
        let key = self.leader_key();
        let resp = self
            .run("revision", async move {
                kv.get(key, Some(GetOptions::new().with_count_only())).await
            })
            .await?;
        Ok(resp.header().map(|h| h.revision()).unwrap_or_default())
    }

    /// Grants a lease of `ttl`.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, StateError> {
        let mut lease = self.client.lease_client();
        let secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let resp = self
            .run("lease grant", async move { lease.grant(secs, None).await })
            .await?;
        Ok(resp.id())
    }

    /// Renews `lease` once; an error when it is gone or etcd did not answer.
    pub async fn keep_alive(&self, lease: i64) -> Result<(), StateError> {
        let mut client = self.client.lease_client();
        self.run("lease keep-alive", async move {
            client.keep_alive(lease).await.map(|_| ())
        })
        .await
    }

    /// Revokes `lease` (best effort; deletes the leader key if it is attached to it).
    pub async fn revoke(&self, lease: i64) -> Result<(), StateError> {
        let mut client = self.client.lease_client();
        self.run("lease revoke", async move {
            client.revoke(lease).await.map(|_| ())
        })
        .await
    }

    /// One campaign round: takes the leader key with `lease` if nobody holds it.
    pub async fn campaign(&self, lease: i64, me: &LeaderInfo) -> Result<Campaign, StateError> {
        let key = self.leader_key();
        let value = serde_json::to_vec(me).map_err(StateError::from_display)?;
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key, None)]);
        let mut kv = self.client.kv_client();
        let resp = self
            .run("campaign", async move { kv.txn(txn).await })
            .await?;
        if resp.succeeded() {
            let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
            return Ok(Campaign::Won { revision });
        }
        let leader = resp.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => g
                .kvs()
                .first()
                .and_then(|kv| serde_json::from_slice::<LeaderInfo>(kv.value()).ok()),
            _ => None,
        });
        Ok(Campaign::Lost(leader))
    }
}

/// Runs `f` on `handle` and waits for it on this thread, at most `timeout` (plus slack).
fn wait<T, F>(
    handle: &tokio::runtime::Handle,
    timeout: Duration,
    what: &str,
    f: F,
) -> Result<T, StateError>
where
    T: Send + 'static,
    F: Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    handle.spawn(async move {
        let _ = tx.send(tokio::time::timeout(timeout, f).await);
    });
    match rx.recv_timeout(timeout + Duration::from_secs(1)) {
        Ok(Ok(Ok(v))) => Ok(v),
        Ok(Ok(Err(e))) => Err(etcd_err(what, e)),
        Ok(Err(_)) | Err(_) => Err(StateError::from_display(format!(
            "etcd {what}: no answer within {timeout:?} (is etcd reachable?)"
        ))),
    }
}

impl EtcdStore {
    /// One value, at `revision` (`None`: the latest).
    fn get_at(
        &self,
        table: Table,
        key: &str,
        revision: Option<i64>,
    ) -> Result<Option<Vec<u8>>, StateError> {
        let mut kv = self
            .client
            .kv_client()
            .max_decoding_message_size(usize::MAX);
        let k = self.key(table, key);
        let opts = revision.map(|r| GetOptions::new().with_revision(r));
        let resp = self.block("get", async move { kv.get(k, opts).await })?;
        Ok(resp.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Every entry of `table`, at `revision` (`None`: the latest; each page then reads the
    /// latest, so pages may come from different revisions).
    fn list_at(
        &self,
        table: Table,
        revision: Option<i64>,
    ) -> Result<Vec<(String, Vec<u8>)>, StateError> {
        // Many manifests can exceed any single response limit: one page of keys at a time.
        const PAGE: i64 = 256;
        let prefix = self.table_prefix(table);
        let end = prefix_end(&prefix);
        let mut out = Vec::new();
        let mut from = prefix.clone().into_bytes();
        loop {
            let mut kv = self
                .client
                .kv_client()
                .max_decoding_message_size(usize::MAX);
            let (start, end2) = (from.clone(), end.clone());
            let mut opts = GetOptions::new().with_range(end2).with_limit(PAGE);
            if let Some(r) = revision {
                opts = opts.with_revision(r);
            }
            let resp = self.block("list", async move { kv.get(start, Some(opts)).await })?;
            let kvs = resp.kvs();
            for kv in kvs {
                match std::str::from_utf8(kv.key()) {
                    Ok(k) => {
                        if let Some(name) = k.strip_prefix(&prefix) {
                            out.push((name.to_string(), kv.value().to_vec()));
                        }
                    }
                    Err(_) => warn!("skipping a non-UTF-8 key under {prefix}"),
                }
            }
            match (resp.more(), kvs.last()) {
                (true, Some(last)) => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        Ok(out)
    }
}

impl StateStore for EtcdStore {
    fn put(&self, table: Table, key: &str, value: &[u8]) -> Result<(), StateError> {
        self.check_size(table, key, value)?;
        self.fenced("put", vec![TxnOp::put(self.key(table, key), value, None)])
    }

    /// Fenced transactions of at most `max_txn_ops` puts and the request limit in bytes,
    /// in order; each is atomic. etcd refuses a transaction naming a key twice, so a key
    /// given twice is written once, with its last value.
    fn put_many(&self, writes: &[(Table, String, Vec<u8>)]) -> Result<(), StateError> {
        for (table, key, value) in writes {
            self.check_size(*table, key, value)?;
        }
        let mut last: HashMap<(Table, &str), usize> = HashMap::with_capacity(writes.len());
        for (i, (table, key, _)) in writes.iter().enumerate() {
            last.insert((*table, key.as_str()), i);
        }
        let mut batch = Vec::new();
        let mut bytes = 0usize;
        for (i, (table, key, value)) in writes.iter().enumerate() {
            if last.get(&(*table, key.as_str())) != Some(&i) {
                continue;
            }
            let key = self.key(*table, key);
            let size = key.len() + value.len() + OP_OVERHEAD;
            if !batch.is_empty()
                && (batch.len() >= self.max_txn_ops || bytes + size > self.max_value)
            {
                self.fenced("put_many", std::mem::take(&mut batch))?;
                bytes = 0;
            }
            batch.push(TxnOp::put(key, value.as_slice(), None));
            bytes += size;
        }
        if batch.is_empty() {
            return Ok(());
        }
        self.fenced("put_many", batch)
    }

    fn delete(&self, table: Table, key: &str) -> Result<(), StateError> {
        self.fenced("delete", vec![TxnOp::delete(self.key(table, key), None)])
    }

    fn get(&self, table: Table, key: &str) -> Result<Option<Vec<u8>>, StateError> {
        self.get_at(table, key, None)
    }

    fn list(&self, table: Table) -> Result<Vec<(String, Vec<u8>)>, StateError> {
        self.list_at(table, None)
    }
}

/// The state as etcd held it at one revision, read-only: what a follower loads its view
/// from, so that the view is one consistent snapshot and the watch that follows it starts
/// at the next revision. Reading it fails once etcd has compacted that revision away
/// (the view is loaded right after the revision is taken). Its writes are refused as a
/// follower's are.
#[derive(Debug)]
pub struct EtcdSnapshot {
    store: Arc<EtcdStore>,
    revision: i64,
}

impl EtcdSnapshot {
    /// The state at `revision`.
    pub fn new(store: Arc<EtcdStore>, revision: i64) -> Self {
        Self { store, revision }
    }

    /// The revision it reads at.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    fn refused() -> StateError {
        StateError::from_display(
            "this controller replica is not the leader: state writes are refused",
        )
    }
}

impl StateStore for EtcdSnapshot {
    fn put(&self, _: Table, _: &str, _: &[u8]) -> Result<(), StateError> {
        Err(Self::refused())
    }

    fn put_many(&self, _: &[(Table, String, Vec<u8>)]) -> Result<(), StateError> {
        Err(Self::refused())
    }

    fn delete(&self, _: Table, _: &str) -> Result<(), StateError> {
        Err(Self::refused())
    }

    fn get(&self, table: Table, key: &str) -> Result<Option<Vec<u8>>, StateError> {
        self.store.get_at(table, key, Some(self.revision))
    }

    fn list(&self, table: Table) -> Result<Vec<(String, Vec<u8>)>, StateError> {
        self.store.list_at(table, Some(self.revision))
    }
}

/// One stored record that changed, as a watch saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Its table.
    pub table: Table,
    /// Its key in the table.
    pub key: String,
    /// The new value; `None`: deleted.
    pub value: Option<Vec<u8>>,
}

/// Why a watch ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchLoss {
    /// etcd compacted its history past the revision the watch needed: the changes in
    /// between are gone, only a whole reload can catch up.
    Compacted {
        /// The first revision the watcher had not seen.
        needed: i64,
        /// etcd's compaction revision.
        compacted: i64,
    },
    /// The stream failed or ended (etcd unreachable or restarted, or it cancelled the
    /// watch); a new watch from the next revision may resume it.
    Broken(String),
}

impl std::fmt::Display for WatchLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Compacted { needed, compacted } => write!(
                f,
                "etcd compacted its history up to revision {compacted}, past revision {needed} the watch needed"
            ),
            Self::Broken(why) => write!(f, "the watch broke: {why}"),
        }
    }
}

/// What a state watch reports, in revision order.
#[derive(Debug)]
pub enum WatchEvent {
    /// The changes of one or more revisions, up to and including `revision`, in commit
    /// order; one transaction's changes always arrive together.
    Changes {
        /// The last revision these changes complete.
        revision: i64,
        /// The records changed (keys outside the tables are left out).
        changes: Vec<Change>,
        /// The leader key was deleted (its lease expired or was revoked): an election is
        /// open.
        leader_gone: bool,
    },
    /// The watch ended; nothing follows.
    Lost(WatchLoss),
}

impl EtcdStore {
    /// Watches every table from `from` (inclusive) until `cancel`, the receiver is
    /// dropped, or the watch is lost (the last event then says why). Runs on the store's
    /// runtime.
    pub fn watch(&self, from: i64, cancel: CancellationToken) -> mpsc::Receiver<WatchEvent> {
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        let client = self
            .client
            .watch_client()
            .max_decoding_message_size(usize::MAX);
        let prefix = format!("{}/", self.prefix);
        let leader = self.leader_key();
        let timeout = self.timeout;
        self.handle.spawn(async move {
            let pump = Pump {
                prefix,
                leader,
                timeout,
                tx: tx.clone(),
                cancel: cancel.clone(),
            };
            if let Some(loss) = pump.run(client, from).await {
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = tx.send(WatchEvent::Lost(loss)) => {}
                }
            }
        });
        rx
    }
}

/// Forwards one etcd watch's responses as [`WatchEvent`]s.
struct Pump {
    prefix: String,
    leader: String,
    timeout: Duration,
    tx: mpsc::Sender<WatchEvent>,
    cancel: CancellationToken,
}

impl Pump {
    /// Runs until cancelled or the receiver is gone (`None`) or the watch is lost.
    async fn run(&self, mut client: WatchClient, from: i64) -> Option<WatchLoss> {
        let opts = WatchOptions::new().with_prefix().with_start_revision(from);
        let started = tokio::select! {
            _ = self.cancel.cancelled() => return None,
            r = tokio::time::timeout(self.timeout, client.watch(self.prefix.clone(), Some(opts))) => r,
        };
        let mut stream = match started {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Some(WatchLoss::Broken(format!("starting it: {e}"))),
            Err(_) => {
                return Some(WatchLoss::Broken(format!(
                    "starting it: no answer within {:?}",
                    self.timeout
                )));
            }
        };
        let mut next = from;
        loop {
            let msg = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return None,
                m = stream.message() => m,
            };
            let resp = match msg {
                Ok(Some(r)) => r,
                Ok(None) => return Some(WatchLoss::Broken("etcd ended the stream".into())),
                Err(e) => return Some(WatchLoss::Broken(e.to_string())),
            };
            if resp.compact_revision() > 0 {
                return Some(WatchLoss::Compacted {
                    needed: next,
                    compacted: resp.compact_revision(),
                });
            }
            if resp.canceled() {
                return Some(WatchLoss::Broken(format!(
                    "etcd cancelled it: {}",
                    resp.cancel_reason()
                )));
            }
            if resp.events().is_empty() {
                // The "created" answer, or a progress notification.
                continue;
            }
            let mut revision = next.saturating_sub(1);
            let mut changes = Vec::with_capacity(resp.events().len());
            let mut leader_gone = false;
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                revision = revision.max(kv.mod_revision());
                // A deletion's record is a tombstone without a create revision (how etcd
                // itself tells the two apart; `Event::event_type` would panic on a type
                // number it does not know).
                let deleted = kv.create_revision() == 0;
                if kv.key() == self.leader.as_bytes() {
                    leader_gone |= deleted;
                    continue;
                }
                match split_key(&self.prefix, kv.key()) {
                    Some((table, key)) => changes.push(Change {
                        table,
                        key,
                        value: (!deleted).then(|| kv.value().to_vec()),
                    }),
                    None => tracing::debug!(
                        key = %String::from_utf8_lossy(kv.key()),
                        "watch: a key outside the state's tables"
                    ),
                }
            }
            next = revision + 1;
            let event = WatchEvent::Changes {
                revision,
                changes,
                leader_gone,
            };
            tokio::select! {
                _ = self.cancel.cancelled() => return None,
                r = self.tx.send(event) => if r.is_err() { return None },
            }
        }
    }
}

/// `<prefix><table>/<key>` → (table, key).
fn split_key(prefix: &str, key: &[u8]) -> Option<(Table, String)> {
    let rest = std::str::from_utf8(key).ok()?.strip_prefix(prefix)?;
    let (table, key) = rest.split_once('/')?;
    Some((Table::from_name(table)?, key.to_string()))
}

/// The first key after every key starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_urls() {
        assert_eq!(
            EtcdConfig::parse_url("etcd://127.0.0.1:2379,10.0.0.2:2379").unwrap(),
            vec!["http://127.0.0.1:2379", "http://10.0.0.2:2379"]
        );
        assert!(EtcdConfig::parse_url("redis://x:1").is_err());
        assert!(EtcdConfig::parse_url("etcd://").is_err());
        assert!(EtcdConfig::parse_url("etcd://host").is_err());
        assert!(EtcdConfig::parse_url("etcd://host:notaport").is_err());
    }

    #[test]
    fn watched_keys_split_into_table_and_key() {
        assert_eq!(
            split_key("/sc/", b"/sc/plans/abc"),
            Some((Table::Plans, "abc".into()))
        );
        assert_eq!(
            split_key("/sc/", b"/sc/models/org/name"),
            Some((Table::Models, "org/name".into()))
        );
        assert_eq!(split_key("/sc/", b"/sc/leader"), None);
        assert_eq!(split_key("/sc/", b"/sc/nosuchtable/x"), None);
        assert_eq!(split_key("/sc/", b"/other/plans/x"), None);
        assert_eq!(split_key("/sc/", b"/sc/plans/\xff"), None);
    }

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end("/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
    }
}
