//! # transferd
//!
//! The per-host daemon of shardcast: a two-tier shard store, origin fetch, chain sessions
//! (receive → verify → store → forward), the agent gRPC API and an admin endpoint.
//! `docs/ARCHITECTURE.md` maps the crates and the data path; the modules' own docs have
//! the detail.
//!
//! * [`store`]: memory tier (tmpfs) + disk tier, positional writes, verified-chunk bitmaps,
//!   recovery on restart.
//! * [`origin`]: `file://`, `http(s)://`, `s3://` and `hf://` origins under the origin
//!   allow-list, manifest building, parallel range reads.
//! * [`chain`]: chain sessions: hop receive path, cut-through forwarder with a bounded
//!   window, failover, recovery from a fallback source, chain heads.
//! * [`wire`] / [`transport`]: frames over any byte stream (zero-copy payloads, `sendfile`
//!   where allowed); mutual TLS over TCP, the authenticate-only mode, and QUIC.
//! * [`throttle`]: daemon-wide egress/ingress token buckets.
//! * [`limits`]: connection caps, per-phase timeouts and frame memory of the data port.
//! * [`agent`]: the gRPC service; [`admin`]: `/metrics`, `/healthz`, `/readyz`;
//!   [`metrics`]: the registry behind `/metrics` (counters read at scrape time, histograms).
//! * [`gpu`]: the store as a chunk source for `gpu-loader`, GPU loads and hand-offs.
//! * [`repair`]: corruption at rest: repairs of chunks that failed re-verification, and
//!   the background scrub.
//! * [`report`]: heartbeats to the controller's inventory (identity, capacity, holdings).
//! * [`config`] and [`daemon`]: layered configuration and process wiring.
//!
//! `unsafe` lives only in `store::map` (the `memmap2` maps) and `store::uring` (io_uring
//! submissions), each block with a `SAFETY` comment (and, outside the library, in the
//! `store_write` bench's writable map of its own scratch file and the `file_write_rate` and
//! `recv_into_map` examples' maps and `getrusage` calls). Tests: unit tests next to each
//! module, `chain/proto/sim.rs` (the state machines in virtual time), `store/hardening_tests.rs`,
//! `tests/cli.rs` (the binary); benches `store_write` and `chunk_hash` (criterion).

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod admin;
pub mod agent;
pub mod chain;
pub mod config;
pub mod daemon;
pub mod gpu;
pub mod limits;
pub mod metrics;
pub mod origin;
pub mod repair;
pub mod report;
pub mod store;
pub mod throttle;
pub mod transport;
pub mod wire;
