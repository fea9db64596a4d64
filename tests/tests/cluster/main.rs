//! The cross-crate integration and fault tests, as one test binary: every module below
//! starts real daemons (transferd, the controller, etcd, S3 servers) on loopback or in
//! network namespaces. One binary instead of one per file: each test binary links the whole
//! workspace (about 45 MiB in a dev build), and fifteen of them made a clean CI build run
//! out of disk while linking. nextest still runs every test in its own process; select a
//! module with a filter, e.g. `scripts/test -E 'test(/^stalls::/)'`.
//!
//! The modules: `gpu` (simulated GPUs loading while a chain delivers, partitions, the Python
//! hand-off; a CUDA test `#[ignore]`d), `controller` (plans through a controller: kills,
//! restarts, re-plans, bursts, scaling, tiers, evictions, metrics), `chain` (chains over TCP
//! and QUIC: kills, corruption, resume, striping, data modes, caps), `stalls` (stopped hops
//! noticed within `stall_timeout`), `wire` (hostile frames), `trust` (every refusal of the
//! data port, both APIs and plan tokens), `certs` (certificates near their end: the
//! expiry gauge and warnings of both daemons; the controller's refused handshakes), `at_rest` (rot caught and repaired), `import`
//! (file and HTTP origins, nginx), `origins` (`s3://` against moto, `hf://` against a local
//! Hub), `admin` (the admin listener), `health` (readiness, gRPC health, drain, the OpenAPI
//! document against the routes), `origin_policy`, `limits` (slow and flooding peers),
//! `emulated` (network namespaces: loss, jumbo frames, cut links; skipped without root),
//! `scale` (1000 simulated hosts, also on three replicas on etcd), `ha` (replicas on a
//! real etcd), `otlp` (spans exported to a real OTLP backend, Phoenix; built only with
//! `--features otlp`) and `deploy` (deploy/'s manifests, units, container build file and dashboard
//! against the daemons' flags, settings and metrics; no daemon started but the dashboard's
//! scrape, which rides on a `controller` test). Each module's own docs list its cases.

mod admin;
mod at_rest;
mod certs;
mod chain;
mod controller;
mod deploy;
mod emulated;
mod gpu;
mod ha;
mod health;
mod import;
mod limits;
mod origin_policy;
mod origins;
#[cfg(feature = "otlp")]
mod otlp;
mod scale;
mod stalls;
mod trust;
mod wire;
