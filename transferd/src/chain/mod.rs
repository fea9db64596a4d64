//! Chain sessions: receive → verify → store → forward, with failover.
//!
//! ```text
//!            upstream conn(s)                     this host                      downstream
//!  head/hop ──Chunk──▶ [handle_upstream] ─verify─▶ ShardStore ─watch─▶ [forwarder] ──Chunk──▶ hop
//!          ◀──Ack/Nack─┘        ▲                    ▲                     │ ◀──Ack/Nack/Progress/Done
//!          ◀──Progress (relayed)┴──── broadcast ─────┼─────────────────────┘
//!                                 [recovery] ─fetch─▶┘ (origin or another holder, when no
//!                                                       upstream is feeding the session)
//! ```
//!
//! One [`ShardSession`] exists per (session id, shard) on each host. It owns the shard's
//! range, the list of hosts below, and three kinds of tasks:
//!
//! * `Receiver::handle_upstream` (`upstream.rs`; one per upstream connection, more than one
//!   when an upstream's upstream fails over to us): reads `Chunk` frames (or a chunk's `ChunkHead` and `Piece`s), verifies each
//!   against the manifest, writes it positionally into the store, answers `Ack` (or `Nack`
//!   on a hash mismatch, so the sender sends it again) and relays `Progress` from below.
//! * the forwarder (`forward.rs`; one per session): waits on the store's "newly verified"
//!   signal and sends each chunk on as soon as it is here (cut-through), keeping at most
//!   `window` chunks unacknowledged. Where it knows a chunk's pieces' CVs it sends the chunk
//!   as a `ChunkHead` and `Piece`s, and the verified pieces of a chunk still arriving here
//!   in pieces go ahead of the chunk (`pieces.rs`), so a chunk crosses a hop a piece
//!   (256 KiB) behind rather than a chunk behind. If the next hop dies or refuses, it connects to the one
//!   after it and resumes from what that hop's `Accept` says it lacks.
//! * the recovery monitor (`recovery.rs`): when no upstream is feeding an incomplete session
//!   for `upstream_grace`, it fetches the missing chunks from the session's fallback source
//!   (an origin URI, or `shardcast://host:port` for another holder).
//!
//! What these tasks decide (which chunk next, when to answer, when a peer is silent, when to
//! stop waiting for an upstream) is decided by the state machines of `proto`, which take
//! events and the time and return actions; the tasks only move frames and bytes.
//!
//! A host that heads a chain (started through the agent API) runs the same forwarder; its
//! chunks come from its store, or from an origin fill task as they arrive.
//!
//! Completion: a sender sends `Done` once its downstream has acknowledged the whole range;
//! a hop answers `Done` upstream only when its whole range is verified *and* its own
//! forwarder has finished, so the head's `Done` means the whole chain is done. `Progress`
//! from every hop is relayed up to the head (`GetSession`).
//!
//! Corruption at rest: the forwarder and the `Fetch` server read chunks through
//! [`Shard::read_checked`](crate::store::Shard::read_checked), which re-hashes a chunk not
//! verified within the store's trust window. A chunk that fails is dropped by the store, never
//! sent, and repaired (`crate::repair`: the other tier, the session's source, known
//! sources); the forwarder sends it once it is verified again. A `Nack` from downstream makes
//! the forwarder re-hash its copy before resending: a bad copy is dropped and repaired rather
//! than resent, and counts nothing against the downstream. A forwarder whose own copy cannot
//! be completed (the session failed) stops without failing over: the downstream hop is not
//! at fault, and its recovery monitor fetches from its fallback source.
//!
//! The store's refusals of a model's data are recorded per (model, tier) with the session
//! (`table::StoreFailures`: a shard that did not fit, a write the file system failed — the
//! session ends instead of fetching the same chunks again), reported by `GetModelStatus`
//! until a new session of the model in that tier starts.
//!
//! ## Roles and their handles
//!
//! Each role is a struct given only the handles it needs; what a role may touch is what it
//! was given. [`Node`] builds the handles once, hands each role its part, and keeps its own
//! fields private. It forwards to no role: the daemon takes from it the handles each module
//! outside the chain is given (`crate::daemon` has that table) — the read-only
//! [`NodeView`] for those that only look, and `Sessions`, `StoreFailures`, `Heads`, the
//! `Fetcher`, the `Server` and the repair queue for those that act.
//!
//! | handle | what it is |
//! | --- | --- |
//! | `Links` (`handshake`) | this host's id and data address, the transports, the rate limits, the wire's byte counters, the frame budget: dialling, framing, `Hello` |
//! | [`ShardStore`] | the store |
//! | `Sessions` (`table`) | the hop and head session tables, and whether the host drains |
//! | `StoreFailures` (`table`) | the store's refusals per (model, tier) |
//! | `Intake` (`session`) | the counters and `StoreFailures`: makes sessions, stores and counts chunks |
//! | [`Repairs`] / [`RepairHandle`](crate::repair::RepairHandle) | the repair sources and queue / the queue alone |
//! | [`NodeStats`], `DataMetrics` | counters, histograms |
//! | [`NodeView`] | read only: the host id, transports, counters and histograms, frame memory and connection caps in use, the origin allow-list, draining |
//! | `CancellationToken` | shutdown |
//!
//! | role | is given |
//! | --- | --- |
//! | `Server` (`serve`; the daemon runs its accept loops) | `Links`, the `Receiver`, the store, a `RepairHandle`, counters, cancel, the connection caps, handshake/idle timeouts, `sendfile` |
//! | `Receiver` (`upstream`) | `Links`, `Sessions`, the store, `Intake`, `Repairs` (sources), counters and histograms, cancel, the `Forwarder` and `Recovery` it starts, the origin allow-list, `max_sessions`, the receiving end's tuning |
//! | `Forwarder` (`forward`) | `Links`, counters, a `RepairHandle`, fault injection, cancel, the send window's tuning, `sendfile` |
//! | `Recovery` (`recovery`) | the `Fetcher`, counters, cancel, `upstream_grace` |
//! | `Fetcher` (`fetch`) | `Links`, `Intake`, the store, `Repairs` (sources), the origin allow-list, parallelism, timeouts |
//! | `Heads` (`head`) | the store, `Sessions`, `Intake`, `Repairs` (sources), the `Forwarder`, the `Fetcher`, cancel, `stripes`, counters, `upstream_grace` |
//! | `Repairer` (`crate::repair`) | the store, `Repairs`, the `Fetcher`, `Sessions`, the wire's byte counters (the scrub waits while chunks move) |
//!
//! No role but `Receiver`, `Heads` and `Repairer` reaches the session table (outside the
//! chain, the agent API and the drain see its outward part: draining, head sessions by id,
//! ending a model's sessions); only `Intake` writes the store-failure records; no role and
//! no module outside the chain holds the `Node` but the daemon that assembles them.
//!
//! ## Copies and passes over each byte (issue #16)
//!
//! A *copy* reads and writes every byte; a *pass* reads it (hash) or rewrites it in place
//! (AES-GCM). The steps on a receiving hop (`upstream` → `session::store_chunk` → `store`):
//!
//! | step | what | TLS | plaintext |
//! | --- | --- | --- | --- |
//! | R1 | socket → the frame's body buffer, up to 256 KiB a read (the kernel's copy) | copy | copy |
//! | R2 | AES-GCM decryption where the records landed, each record's plaintext moved down behind the previous one's in the same pass (`shardcast_identity::records`; a record split between two reads is copied out and back, ≤ 16 KiB per read) | pass | — |
//! | R3 | the body's buffer: reused from the frame budget and kept initialized, never freshly faulted in and zeroed (`crate::wire`) | — | — |
//! | R4 | frame → `Frame::Chunk` (`Bytes::split_to`) | — | — |
//! | R5 | BLAKE3 of the chunk (blocking pool) | pass | pass |
//! | R6 | into the shard file (`Shard::verify_and_write`): `pwrite`, or a copy into its populated map while another stripe holds the file (the adaptive writer, `crate::store`) | copy | copy |
//!
//! A chunk in verified pieces (`pieces`) takes the same steps piece by piece: R5 is each
//! piece's CV, worked out as it arrives, and R6 writes the pieces once the last one verified
//! (one blocking-pool task); a forwarder sends each piece on from the frame's buffer.
//!
//! Receiver totals: TLS 2 copies + 2 passes, plaintext 2 copies + 1 pass, QUIC 3 copies +
//! 2 passes per packet (`crate::transport::quic`); iperf3's receiver makes 1 copy. A peer
//! of an earlier version (ALPN `shardcast/1`) is read through rustls's stream instead,
//! which adds three copies (R1's read buffer into rustls 4 KiB at a time, each record into
//! a `Vec`, that into the body). R6, the page-cache write, is the largest cost (why it
//! stays a `pwrite` on one stream: `crate::store`'s `shard` module). Sending (`forward` /
//! `serve` → `Shard::read_checked` → `FrameWriter::send_chunk`): S1 the chunk from the
//! shard's map as `Bytes` (zero-copy), S2 a BLAKE3 pass only for an untrusted chunk, S3 the
//! 17-byte frame prefix (the payload bypasses the buffer), S4 over TLS a copy into a record
//! and AES-GCM, S5 the kernel's copy into the socket (none with `sendfile`, `crate::wire`):
//! TLS 2 copies + 1 pass, plaintext 1 copy. docs/BENCHMARKS.md has the profiles.
//!
//! ## Files
//!
//! | file | role |
//! | --- | --- |
//! | `mod.rs` | [`Node`] (the assembly of the handles and roles), [`NodeView`], its tuning ([`ChainConfig`]), counters ([`NodeStats`]) and errors |
//! | `proto` | the protocol's decisions as pure state machines (no I/O, no clock): the send window, the receiving end, the recovery monitor; tested in virtual time |
//! | `session` | [`ShardSession`] (one shard of a session on this host), its RAII gauges, and `Intake`: the one path that verifies, writes and counts a chunk |
//! | `table` | `Sessions` (the session tables, draining) and `StoreFailures` |
//! | `handshake` | `Links`: connecting to a hop, the `Hello` exchange bound to the peer's certificate |
//! | `serve` | the data port's accept loops and connections: an upstream's `Open`, or `Fetch` (the pull server) |
//! | `upstream` | joining a session (plan token, fallback origin, caps) and receiving from an upstream |
//! | `forward` | the forwarder: sending to the downstream with failover |
//! | `recovery` | the recovery monitor: a hop without upstream fetches from its fallback |
//! | `fetch` | fetching chunks from an origin or a holder into a session (recovery, head fill, imports) |
//! | `pieces` | chunks in verified pieces (protocol 7): `Assemblies`, the receiving end of one connection's chunks in pieces; `PieceRelay`, a session's verified pieces of chunks not yet whole, which its forwarder sends ahead |
//! | `head` | head sessions started through the agent API; a head's origin read, stopped when the forwarder loses the hop below and resumed after a pull from that hop |

use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shardcast_protocol::{ErrorCode, Frame, HostId, SessionId};
use tokio_util::sync::CancellationToken;

mod fetch;
mod forward;
mod handshake;
mod head;
mod outcome;
mod pieces;
mod proto;
mod recovery;
mod serve;
mod session;
mod table;
mod upstream;

pub(crate) use fetch::Fetcher;
pub(crate) use head::Heads;
pub use head::{ChainSpec, HeadSession};
pub use outcome::{FetchError, ForwardError, HopFailure, RecoveryError, SessionError};
/// The recovery decisions of a hop, as a pure state machine (`proto`): when a hop that lost
/// its upstream stops waiting for a failover and fetches ([`RecoveryMonitor`]), and from
/// which sources, in which order ([`recovery_sources`]). Public so that the datacenter
/// simulator (`shardcast-bench simulate --faults`) decides its faults' recoveries with the
/// daemon's own rules instead of a copy of them.
pub use proto::{
    AfterFill, RecoveryAction, RecoveryMonitor, Source as RecoverySource, Watched, all_stalled,
    recovery_sources,
};
pub use recovery::RECOVERY_ATTEMPTS;
pub(crate) use serve::Server;
pub use session::ShardSession;
pub(crate) use table::{Sessions, StoreFailures};

use forward::Forwarder;
use handshake::Links;
use proto::{InboundConfig, SendFailure, SendWindowConfig};
use recovery::Recovery;
use session::Intake;
use upstream::Receiver;

use crate::limits::{ConnLimits, Limits};
use crate::origin::OriginAccess;
use crate::repair::{RepairHandle, Repairer, Repairs};
use crate::store::ShardStore;
use crate::throttle::RateLimiter;
use crate::transport::Transports;
use crate::wire::{ByteCounters, Conn, FrameBudget, WireError};

/// Chunks a sender re-verifies ahead of the one it is sending (when they are not trusted):
/// the hashing of the next chunks overlaps the socket write of this one. Rationale: BLAKE3
/// of a 1 MiB chunk (0.25–0.5 ms on the 2-vCPU host) is about the time to write it at
/// 10 Gbit/s, so a few in parallel keep an idle holder's re-hash off the critical path
/// without taking more than the blocking pool's share of the cores.
const CHECK_AHEAD: u32 = 4;

/// Tuning of chain sessions.
#[derive(Debug, Clone)]
pub struct ChainConfig {
    /// Chunks a sender keeps unacknowledged per downstream connection. Rationale: the
    /// window must cover the bandwidth-delay product plus one chunk of verify+write time at
    /// the receiver; 16 × 1 MiB covers 1 Gbit/s at up to ~100 ms RTT and 10 Gbit/s on a
    /// LAN, while bounding what a dead hop leaves in flight.
    pub window: usize,
    /// How long a hop whose upstream vanished waits for a replacement upstream (the
    /// upstream's upstream failing over to it) before fetching from the fallback source.
    pub upstream_grace: Duration,
    /// Longest wait for a peer's answer in the connection set-up (`Hello`, `Accept`) and
    /// for a holder answering `Fetch`.
    pub idle_timeout: Duration,
    /// A neighbour that makes no progress for this long is stalled — dead, stopped or cut
    /// off — and is bypassed: a downstream that answers nothing while chunks await its
    /// answer, or that drains no chunk write; an upstream that sends nothing (no chunk, no
    /// `Keepalive`) while this hop waits for one. Senders with nothing to send say they are
    /// alive every quarter of it. Rationale: 2 s is about 1 s of scheduling noise on a
    /// loaded host plus a few chunk times at the slowest links we plan for (1 MiB at
    /// 10 Mbit/s is 0.8 s); heartbeats (10 s) stay the controller's slower signal.
    pub stall_timeout: Duration,
    /// Concurrent range reads when filling from an origin.
    pub origin_parallel: usize,
    /// The origin allow-list, checked for every origin this host opens (fills, a
    /// session's fallback origin, imports). The default allows none.
    pub origins: OriginAccess,
    /// Connection caps and per-phase timeouts of the data port.
    pub limits: Limits,
    /// How often one chunk may be re-sent after `Nack`s before the hop is given up.
    pub max_resends: u32,
    /// Minimum interval between a hop's own `Progress` frames.
    pub progress_interval: Duration,
    /// Chunks a hop verifies and stores concurrently per upstream connection, while it
    /// reads the next ones off the wire. Rationale: measured on loopback (docs/BENCHMARKS.md),
    /// 4 beat 1 and 2: it keeps hashing, the store write and the socket busy at once while
    /// holding only 4 chunks of memory per connection.
    pub pipeline_depth: usize,
    /// Send chunk payloads from the store's files with `sendfile` on plaintext TCP
    /// connections. Off by default: measured on loopback (docs/BENCHMARKS.md, issue #16
    /// step 4), `sendfile` from tmpfs cost the sender 0.36–0.39 CPU-s/GB against `write`'s
    /// 0.23 and moved 2.6 GB/s against 4.2; a NIC that takes the pages without a copy was
    /// not measured.
    pub sendfile: bool,
    /// Connections each shard of a chain this host heads is striped over: the shard's
    /// chunks split into this many contiguous ranges, each its own session (the same
    /// session id, the range in its `Open`) on its own connection down the whole chain, so
    /// every hop receives, decrypts, verifies and forwards one shard on as many cores.
    /// Hops below follow the head's ranges. The daemon's default is [`Stripes::Auto`]; this
    /// struct's `Default` is one stripe (tests and embedders get the same behaviour on any
    /// machine).
    pub stripes: Stripes,
    /// Hash each chunk's payload while it arrives, in 64 KiB steps still in cache from
    /// the read (and decryption) that wrote them, instead of in one pass over the whole
    /// chunk on the blocking pool before it is stored: one pass over memory fewer, but the
    /// hash then runs on the connection's reading task rather than beside its next read on
    /// another core. The daemon's default (`hash_on_read = "auto"`) is on below
    /// [`AUTO_STRIPES_MIN_CORES`] cores: on the quiet 2-core VM the emulated 8-receiver
    /// chain's receivers spent 6–9% less user CPU with it in 3 of 3 alternating rounds
    /// (docs/BENCHMARKS.md, issue #28); from there off, since one connection's reading task
    /// would carry the hash too (not measured on many cores). This struct's `Default` is
    /// off.
    pub hash_on_read: bool,
    /// Forward chunks in verified pieces (protocol version 7, `shardcast_protocol::pieces`):
    /// a chunk whose pieces' CVs this host knows (it verified the chunk itself, or is
    /// receiving it in pieces) goes down as a `ChunkHead` and 256 KiB `Piece`s, each checked
    /// against the manifest's hash on arrival and forwarded at once, so a chunk crosses a
    /// hop a piece behind instead of a chunk behind. On by default; off sends every chunk
    /// whole (receivers take both).
    pub pieces: bool,
}

/// How many connections each shard of a chain this host heads is striped over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stripes {
    /// This many per shard (1 to [`MAX_STRIPES`]).
    Fixed(usize),
    /// About `connections` per chain, shared among its shards: a model of one shard gets
    /// them all, one of as many shards as connections (or more) one each.
    /// [`Stripes::for_cores`] picks `connections` from the host's cores.
    Auto {
        /// Connections per chain this host aims for.
        connections: usize,
    },
}

/// Fewest cores for which [`Stripes::for_cores`] stripes at all. Rationale: one connection
/// per shard already fills a 2-core host (striping only added work there), while on a
/// 16-core host one TLS hop of one shard carried 1.76 GB/s with 1 stripe and 4.46 GB/s
/// with 8 (docs/BENCHMARKS.md, issue #28); a hop's two ends each spend about a core per
/// connection, so half the cores is what one chain can use without starving the rest.
pub const AUTO_STRIPES_MIN_CORES: usize = 8;

/// The cores this process may use ([`std::thread::available_parallelism`], which honours
/// CPU affinity and cgroup quotas; 1 when unknown): what the `auto` settings go by.
pub fn host_cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Whether this host has fewer than [`AUTO_STRIPES_MIN_CORES`] cores: one connection per
/// shard (`stripes = "auto"`) and chunks hashed as they arrive (`hash_on_read = "auto"`).
pub fn few_cores() -> bool {
    host_cores() < AUTO_STRIPES_MIN_CORES
}

/// Most connections per chain [`Stripes::for_cores`] aims for: 8 is the most measured.
pub const AUTO_STRIPES_MAX: usize = 8;

impl Stripes {
    /// `auto` on a host of `cores` cores: one connection per shard below
    /// [`AUTO_STRIPES_MIN_CORES`], else half the cores, at most [`AUTO_STRIPES_MAX`].
    pub fn for_cores(cores: usize) -> Self {
        let connections = if cores < AUTO_STRIPES_MIN_CORES {
            1
        } else {
            (cores / 2).min(AUTO_STRIPES_MAX)
        };
        Self::Auto { connections }
    }

    /// `auto` on this host ([`host_cores`]).
    pub fn auto() -> Self {
        Self::for_cores(host_cores())
    }

    /// Stripes for each shard of a chain that sends `shards` shards.
    pub fn per_shard(self, shards: usize) -> usize {
        match self {
            Self::Fixed(n) => n.clamp(1, MAX_STRIPES),
            Self::Auto { connections } => (connections / shards.max(1)).clamp(1, MAX_STRIPES),
        }
    }
}

impl std::fmt::Display for Stripes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fixed(n) => write!(f, "{n}"),
            Self::Auto { connections } => write!(f, "auto ({connections} per chain)"),
        }
    }
}

/// Fewest chunks in one stripe: a shard is striped into fewer ranges than `stripes` rather
/// than into ranges shorter than this (each stripe costs a connection, a session and a
/// recovery monitor on every hop).
pub const MIN_STRIPE_CHUNKS: u32 = 4;

/// Most stripes per shard (`stripes` above this is refused at start).
pub const MAX_STRIPES: usize = 16;

/// The ranges a shard of `chunks` chunks is striped into with `stripes` wanted: contiguous,
/// in order, covering `0..chunks`, none shorter than [`MIN_STRIPE_CHUNKS`] unless the
/// shard itself is (one range then).
pub fn stripe_ranges(chunks: u32, stripes: usize) -> Vec<std::ops::Range<u32>> {
    let k = u32::try_from(stripes.clamp(1, MAX_STRIPES))
        .unwrap_or(1)
        .min((chunks / MIN_STRIPE_CHUNKS).max(1));
    (0..k)
        .map(|i| {
            let at = |j: u32| (u64::from(chunks) * u64::from(j) / u64::from(k)) as u32;
            at(i)..at(i + 1)
        })
        .collect()
}

impl Default for ChainConfig {
    fn default() -> Self {
        Self {
            window: 16,
            upstream_grace: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(2),
            origin_parallel: 8,
            origins: OriginAccess::default(),
            limits: Limits::default(),
            max_resends: 5,
            progress_interval: Duration::from_millis(100),
            pipeline_depth: 4,
            sendfile: false,
            pieces: true,
            stripes: Stripes::Fixed(1),
            hash_on_read: false,
        }
    }
}

impl ChainConfig {
    /// The send window's part of the tuning.
    fn send_window(&self) -> SendWindowConfig {
        SendWindowConfig {
            window: self.window,
            stall_timeout: self.stall_timeout,
            keepalive: self.stall_timeout / 4,
            done_timeout: self.idle_timeout,
            max_resends: self.max_resends,
        }
    }

    /// The receiving end's part of the tuning.
    fn inbound(&self) -> InboundConfig {
        InboundConfig {
            pipeline_depth: self.pipeline_depth,
            progress_interval: self.progress_interval,
            stall_timeout: self.stall_timeout,
        }
    }
}

/// Counters of the data plane on one host.
#[derive(Debug, Default)]
pub struct NodeStats {
    /// Chunks verified and stored.
    pub chunks_verified: AtomicU64,
    /// Chunks dropped because their hash did not match.
    pub chunks_corrupt: AtomicU64,
    /// Chunks sent downstream in verified pieces (`ChunkHead` and `Piece`s).
    pub chunks_sent_in_pieces: AtomicU64,
    /// Chunks received in verified pieces and stored.
    pub chunks_received_in_pieces: AtomicU64,
    /// Chunks sent again after a `Nack`.
    pub chunks_resent: AtomicU64,
    /// Sessions in progress.
    pub sessions_active: AtomicU64,
    /// Sessions ever started on this host.
    pub sessions_total: AtomicU64,
    /// Payload bytes fetched from origins.
    pub origin_bytes: AtomicU64,
    /// Bytes read from origins to build manifests (registration, imports).
    pub manifest_bytes: AtomicU64,
    /// Bytes stored from the copy kept while a manifest was built (not read twice).
    pub kept_bytes: AtomicU64,
    /// Times a forwarder skipped a dead or refusing downstream hop.
    pub downstream_failovers: AtomicU64,
    /// Times a hop fetched missing chunks from a fallback source.
    pub upstream_recoveries: AtomicU64,
    /// Upstream connections dropped because the upstream sent nothing (no chunk, no
    /// `Keepalive`) for `stall_timeout`.
    pub upstream_stalls: AtomicU64,
    /// Downstream connections given up because the downstream answered nothing or drained
    /// no write for `stall_timeout`.
    pub downstream_stalls: AtomicU64,
    /// `Open`s of a running session refused because its upstream is alive (a host that
    /// was cut off or stopped and came back; it completes as a leaf instead).
    pub second_upstreams_refused: AtomicU64,
    /// `Fetch`es answered with part of the span and `NotReceiving`: this host's copy lacks
    /// some of it and no session here receives the shard, so the puller moved on at once.
    pub fetches_not_receiving: AtomicU64,
    /// Origin reads (a recovery's, a head's) stopped because a peer started feeding the
    /// same shard here: the rest comes from that peer, or the read goes on if it stalls.
    pub origin_reads_yielded: AtomicU64,
    /// Holders above a recovering hop, out of reach when it started reading the origin,
    /// that answered again during that read: the rest came from them, not the origin.
    pub holders_back_during_origin_read: AtomicU64,
    /// A recovery's origin reads that stored nothing for an upstream grace (this host's
    /// link, or the origin, went away): stopped, and resumed only after the holders above
    /// had a grace to answer once the origin answered again.
    pub origin_reads_stalled: AtomicU64,
    /// A head's origin reads stopped because its forwarder lost the hop below (this host's
    /// link, or that hop, went away): resumed once the origin answered again and the hop
    /// below was pulled from.
    pub head_origin_reads_stopped: AtomicU64,
    /// Holders above a hop without upstream that it dialled while waiting for a failover
    /// and could not reach (dead or stopped): it stopped waiting for them.
    pub upstream_holders_unreachable: AtomicU64,
    /// Chunks pulled from another holder with `Fetch` (a recovering hop from a hop above
    /// it, an import or a partition from a peer) rather than from the origin.
    pub chunks_from_holders: AtomicU64,
    /// Data-port connections refused in the TLS handshake (no certificate, another CA,
    /// expired, not a `host`).
    pub tls_refused: AtomicU64,
    /// Peers whose `Hello` host id differed from their certificate's.
    pub identity_mismatch: AtomicU64,
    /// Agent API calls refused by role.
    pub authz: Arc<shardcast_identity::grpc::AuthzStats>,
    /// Admin HTTP requests refused (no identity, or a role that may not read).
    pub admin_authz: Arc<shardcast_identity::grpc::AuthzStats>,
    /// Admin HTTP connections closed because the client stalled.
    pub admin_http: Arc<shardcast_identity::http::HttpStats>,
    /// `Open`s refused for want of a valid plan token (none, forged, expired, another
    /// model, or a host the plan does not name).
    pub sessions_unauthorised: AtomicU64,
    /// `Open`s refused because the host already holds `max_sessions` hop sessions.
    pub sessions_refused: AtomicU64,
    /// `Open`s of a session new to this host refused because it is draining.
    pub sessions_refused_draining: AtomicU64,
    /// `Progress` frames not recorded because a session already tracks
    /// [`MAX_PROGRESS_HOSTS`] hosts below it (a peer inventing host ids).
    pub progress_dropped: AtomicU64,
}

/// Hosts whose relayed progress one session records: no chain has more hops below a host
/// than an `Open` frame may list.
pub const MAX_PROGRESS_HOSTS: usize = shardcast_protocol::frame::MAX_HOPS;

/// Why a chain operation failed. Sent to peers as an `Error` frame, to API callers as a
/// `tonic::Status` (see `agent.rs`).
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// The peer broke the protocol or the stream failed.
    #[error("{0}")]
    Wire(#[from] WireError),
    /// The peer sent an `Error` frame.
    #[error("peer reported {code:?}: {message}")]
    Remote {
        /// Its code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// A request we refuse, with the code to send back.
    #[error("{message}")]
    Refused {
        /// Code for the peer.
        code: ErrorCode,
        /// What is wrong.
        message: String,
    },
    /// The store failed (shared: a session's outcome names the same error).
    #[error("store: {0}")]
    Store(#[source] Arc<crate::store::StoreError>),
    /// The peer closed the connection before the exchange finished.
    #[error("peer closed the connection")]
    Closed,
    /// The peer went silent.
    #[error("peer silent for {0:?}")]
    Timeout(Duration),
}

impl ChainError {
    fn refused(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::Refused {
            code,
            message: message.into(),
        }
    }

    fn protocol(message: impl Into<String>) -> Self {
        Self::refused(ErrorCode::ProtocolViolation, message)
    }

    /// Whether the peer made no progress within a deadline (silent, or draining no write):
    /// stalled rather than refusing or broken.
    pub fn is_stall(&self) -> bool {
        matches!(
            self,
            Self::Timeout(_) | Self::Wire(WireError::Idle(_) | WireError::WriteStalled(_))
        )
    }

    /// Whether the path to the peer failed (silence, a broken stream, a closed
    /// connection), as opposed to the peer answering with a refusal.
    fn is_path_fault(&self) -> bool {
        self.is_stall()
            || matches!(
                self,
                Self::Closed | Self::Wire(WireError::Io(_) | WireError::Truncated)
            )
    }

    /// Whether the peer refused a second upstream because a live one feeds it.
    fn is_already_fed(&self) -> bool {
        matches!(
            self,
            Self::Remote {
                code: ErrorCode::AlreadyFed,
                ..
            }
        )
    }

    /// The code to send the peer, if the fault is worth telling it about.
    fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Wire(w) => w.code(),
            Self::Refused { code, .. } => Some(*code),
            Self::Store(_) => Some(ErrorCode::Storage),
            Self::Remote { .. } | Self::Closed | Self::Timeout(_) => None,
        }
    }
}

impl From<crate::store::StoreError> for ChainError {
    fn from(e: crate::store::StoreError) -> Self {
        Self::Store(Arc::new(e))
    }
}

impl From<SendFailure> for ChainError {
    fn from(f: SendFailure) -> Self {
        match f {
            SendFailure::Silent(d) => Self::Timeout(d),
            SendFailure::Rejected { index, times } => Self::refused(
                ErrorCode::Refused,
                format!("chunk {index} rejected {times} times although it verifies here"),
            ),
            SendFailure::EarlyDone => Self::protocol("unexpected Done from downstream"),
        }
    }
}

/// Test-only fault injection: chunks to corrupt the first time this host sends them.
/// Armed only when the daemon runs with `SHARDCAST_ENABLE_FAULT_INJECTION=1` (see
/// `config.rs`), so production daemons cannot be made to corrupt data by configuration.
#[derive(Debug, Default)]
pub struct Faults {
    corrupt_once: Mutex<HashSet<(u32, u32)>>,
}

impl Faults {
    /// Arms corruption of each `(shard, chunk)` in `chunks`.
    pub fn corrupt_once(chunks: impl IntoIterator<Item = (u32, u32)>) -> Self {
        Self {
            corrupt_once: Mutex::new(chunks.into_iter().collect()),
        }
    }

    fn take(&self, shard: u32, index: u32) -> bool {
        self.corrupt_once
            .lock()
            .map(|mut s| s.remove(&(shard, index)))
            .unwrap_or(false)
    }
}

/// Everything a host needs to take part in chains; one per daemon. It builds the handles,
/// hands each role its part (see the module docs) and keeps them; it runs no role itself.
/// The daemon takes from it the handles each outer module is given (`crate::daemon`).
pub struct Node {
    view: NodeView,
    store: ShardStore,
    cancel: CancellationToken,
    sessions: Sessions,
    failures: StoreFailures,
    fetcher: Arc<Fetcher>,
    server: Arc<Server>,
    heads: Arc<Heads>,
    repairs: RepairHandle,
    /// The repairer and the scrub run on it (they hold it weakly).
    _repairer: Arc<Repairer>,
}

impl Node {
    /// A node with no sessions yet, for host `host` whose data port peers reach at
    /// `advertised` (`None`: not known, so hops below are never told to recover from this
    /// one). Inside a tokio runtime this also starts the repairer and the scrub
    /// (`crate::repair`), which stop on `cancel`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        host: HostId,
        advertised: Option<String>,
        store: ShardStore,
        transports: Transports,
        ingress: RateLimiter,
        egress: RateLimiter,
        cfg: ChainConfig,
        faults: Faults,
        cancel: CancellationToken,
    ) -> Arc<Self> {
        let counters: Arc<ByteCounters> = Arc::default();
        let frame_budget = FrameBudget::new(cfg.limits.frame_memory);
        let stats: Arc<NodeStats> = Arc::default();
        let metrics = crate::metrics::DataMetrics::default();
        let conn_limits = ConnLimits::new(&cfg.limits);
        let repairs = Arc::new(Repairs::new());
        let sessions = Sessions::default();
        let failures = StoreFailures::default();
        let links = Links::new(
            (host, advertised),
            transports,
            (ingress, egress),
            counters.clone(),
            frame_budget.clone(),
            stats.clone(),
            cfg.limits.write_timeout,
            cfg.idle_timeout,
        )
        .with_hash_on_read(cfg.hash_on_read);
        let intake = Intake::new(stats.clone(), failures.clone());
        let fetcher = Arc::new(Fetcher::new(
            links.clone(),
            intake.clone(),
            store.clone(),
            repairs.clone(),
            &cfg,
        ));
        let forwarder = Arc::new(Forwarder::new(
            links.clone(),
            stats.clone(),
            repairs.handle(),
            Arc::new(faults),
            cancel.clone(),
            &cfg,
        ));
        let recovery = Arc::new(Recovery::new(
            fetcher.clone(),
            stats.clone(),
            cancel.clone(),
            cfg.upstream_grace,
        ));
        let receiver = Arc::new(Receiver::new(
            links.clone(),
            sessions.clone(),
            store.clone(),
            intake.clone(),
            repairs.clone(),
            (stats.clone(), metrics.clone()),
            cancel.clone(),
            (forwarder.clone(), recovery),
            &cfg,
        ));
        let server = Arc::new(Server::new(
            links.clone(),
            receiver,
            store.clone(),
            repairs.handle(),
            stats.clone(),
            cancel.clone(),
            conn_limits.clone(),
            &cfg,
        ));
        let heads = Arc::new(Heads::new(
            store.clone(),
            sessions.clone(),
            intake,
            repairs.clone(),
            forwarder,
            fetcher.clone(),
            cancel.clone(),
            cfg.stripes,
            (stats.clone(), cfg.upstream_grace),
        ));
        let repairer = Arc::new(Repairer::new(
            store.clone(),
            repairs.clone(),
            fetcher.clone(),
            sessions.clone(),
            counters.clone(),
        ));
        if tokio::runtime::Handle::try_current().is_ok() {
            crate::repair::spawn(&repairer, &cancel);
        }
        Arc::new(Self {
            view: NodeView {
                links,
                stats,
                metrics,
                frame_budget,
                conn_limits,
                origins: cfg.origins.clone(),
                repairs: repairs.clone(),
                sessions: sessions.clone(),
            },
            store,
            cancel,
            sessions,
            failures,
            fetcher,
            server,
            heads,
            repairs: repairs.handle(),
            _repairer: repairer,
        })
    }

    /// The data plane's figures, for those who only read them.
    pub fn view(&self) -> &NodeView {
        &self.view
    }

    /// The local store.
    pub fn store(&self) -> &ShardStore {
        &self.store
    }

    /// Cancelled on shutdown.
    pub fn cancel(&self) -> &CancellationToken {
        &self.cancel
    }

    /// The session table: draining, head sessions by id, the sessions of a model.
    pub(crate) fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// The store's refusals of a model's data, per tier.
    pub(crate) fn failures(&self) -> &StoreFailures {
        &self.failures
    }

    /// Fetches into the store from an origin or a holder (imports, partition loads).
    pub(crate) fn fetcher(&self) -> &Arc<Fetcher> {
        &self.fetcher
    }

    /// Starts the chains this host heads.
    pub(crate) fn heads(&self) -> &Arc<Heads> {
        &self.heads
    }

    /// The data port's accepted connections.
    pub(crate) fn server(&self) -> &Arc<Server> {
        &self.server
    }

    /// The repair queue (for chunks found corrupt at rest outside the chain: GPU loads,
    /// hand-offs).
    pub fn repairs(&self) -> &RepairHandle {
        &self.repairs
    }
}

/// What the daemon's observers read of the data plane: the counters and histograms, the
/// wire's and the transports' statistics, the connection caps and frame memory in use,
/// the origin allow-list, and whether the host drains. Nothing in it starts, ends or
/// changes a session or queues a repair (the metrics collector, the heartbeat and the
/// agent API are given it). Cheap to clone.
#[derive(Clone)]
pub struct NodeView {
    links: Links,
    stats: Arc<NodeStats>,
    metrics: crate::metrics::DataMetrics,
    frame_budget: Arc<FrameBudget>,
    conn_limits: Arc<ConnLimits>,
    origins: OriginAccess,
    repairs: Arc<Repairs>,
    sessions: Sessions,
}

impl NodeView {
    /// This host's id.
    pub fn host(&self) -> &HostId {
        self.links.host()
    }

    /// Transports to other hops (TCP, and QUIC when bound), with their statistics.
    pub fn transports(&self) -> &Transports {
        self.links.transports()
    }

    /// Wire byte counters.
    pub fn counters(&self) -> &ByteCounters {
        self.links.counters()
    }

    /// Data-plane counters.
    pub fn stats(&self) -> &NodeStats {
        &self.stats
    }

    /// Histograms of the data path (sessions, GPU loads), registered by
    /// [`crate::metrics::registry`].
    pub fn metrics(&self) -> &crate::metrics::DataMetrics {
        &self.metrics
    }

    /// Memory for frame bodies in flight on every connection (`limits.frame_memory`).
    pub fn frame_budget(&self) -> &FrameBudget {
        &self.frame_budget
    }

    /// Open data-plane connections against their caps.
    pub fn conn_limits(&self) -> &ConnLimits {
        &self.conn_limits
    }

    /// The origin allow-list (and its refusal counter, shared with every role's copy).
    pub fn origins(&self) -> &OriginAccess {
        &self.origins
    }

    /// Repair requests refused because the repair queue was full.
    pub fn repairs_refused(&self) -> u64 {
        self.repairs.refused()
    }

    /// Whether the host is draining.
    pub fn draining(&self) -> bool {
        self.sessions.draining()
    }

    /// Follows [`Self::draining`] (the heartbeat tells the controller at once).
    pub fn watch_draining(&self) -> tokio::sync::watch::Receiver<bool> {
        self.sessions.watch_draining()
    }
}

/// The time the state machines are given: tokio's clock, so paused-time tests drive them.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Sleeps until `deadline`; forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
        None => std::future::pending().await,
    }
}

async fn read_timeout(conn: &mut Conn, timeout: Duration) -> Result<Frame, ChainError> {
    match tokio::time::timeout(timeout, conn.reader.read()).await {
        Err(_) => Err(ChainError::Timeout(timeout)),
        Ok(r) => r?.ok_or(ChainError::Closed),
    }
}

/// Parses the chunk list of `SHARDCAST_FAULT_CORRUPT` (`shard:chunk,shard:chunk`).
pub fn parse_fault_list(s: &str) -> Result<Vec<(u32, u32)>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (a, b) = p
                .trim()
                .split_once(':')
                .ok_or_else(|| format!("{p:?}: expected shard:chunk"))?;
            Ok((
                a.parse().map_err(|_| format!("{p:?}: bad shard"))?,
                b.parse().map_err(|_| format!("{p:?}: bad chunk"))?,
            ))
        })
        .collect()
}

/// A hop session's key: (session, shard, first chunk of its range).
pub(crate) type SessionKey = (SessionId, u32, u32);

/// A fresh random session id.
pub fn new_session_id() -> SessionId {
    SessionId(rand::random())
}

#[cfg(test)]
mod stripe_tests {
    use super::*;

    #[test]
    fn stripes_cover_the_shard_in_order_and_are_never_too_short() {
        for chunks in [0u32, 1, 3, 4, 7, 8, 12, 13, 100, 1000] {
            for stripes in [0usize, 1, 2, 3, 4, 16, 64] {
                let r = stripe_ranges(chunks, stripes);
                assert!(
                    !r.is_empty() && r.len() <= MAX_STRIPES,
                    "{chunks} {stripes}: {r:?}"
                );
                assert_eq!(r[0].start, 0);
                assert_eq!(r[r.len() - 1].end, chunks);
                assert!(r.windows(2).all(|w| w[0].end == w[1].start), "{r:?}");
                assert!(r.len() <= stripes.max(1), "{chunks} {stripes}: {r:?}");
                if r.len() > 1 {
                    assert!(
                        r.iter().all(|x| x.len() >= MIN_STRIPE_CHUNKS as usize),
                        "{r:?}"
                    );
                }
            }
        }
        assert_eq!(stripe_ranges(12, 3), vec![0..4, 4..8, 8..12]);
        assert_eq!(stripe_ranges(10, 3), vec![0..5, 5..10]);
        assert_eq!(stripe_ranges(2, 4), vec![0..2]);
    }

    #[test]
    fn auto_stripes_use_half_the_cores_shared_among_the_shards() {
        // Small hosts: one connection per shard, whatever the shard count.
        for cores in [1, 2, 4, 7] {
            let auto = Stripes::for_cores(cores);
            assert_eq!(auto, Stripes::Auto { connections: 1 });
            for shards in [0, 1, 2, 8] {
                assert_eq!(auto.per_shard(shards), 1, "{cores} cores, {shards} shards");
            }
        }
        // From 8 cores: half of them per chain, at most 8, shared among the shards.
        assert_eq!(Stripes::for_cores(8), Stripes::Auto { connections: 4 });
        assert_eq!(Stripes::for_cores(16), Stripes::Auto { connections: 8 });
        assert_eq!(Stripes::for_cores(192), Stripes::Auto { connections: 8 });
        let sixteen = Stripes::for_cores(16);
        assert_eq!(sixteen.per_shard(1), 8);
        assert_eq!(sixteen.per_shard(2), 4);
        assert_eq!(sixteen.per_shard(3), 2);
        assert_eq!(sixteen.per_shard(8), 1);
        assert_eq!(sixteen.per_shard(100), 1);
        // A fixed count is kept within 1..=MAX_STRIPES.
        assert_eq!(Stripes::Fixed(3).per_shard(8), 3);
        assert_eq!(Stripes::Fixed(0).per_shard(1), 1);
        assert_eq!(Stripes::Fixed(99).per_shard(1), MAX_STRIPES);
    }
}
