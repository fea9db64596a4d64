//! The cross-crate integration and fault tests, as one test binary: every module below
//! starts real daemons (transferd, the controller, etcd, S3 servers) on loopback or in
//! network namespaces. One binary instead of one per file: each test binary links the whole
//! workspace (about 45 MiB in a dev build), and fifteen of them made a clean CI build run
//! out of disk while linking. nextest still runs every test in its own process; select a
//! module with a filter, e.g. `scripts/test -E 'test(/^stalls::/)'`.

mod admin;
mod at_rest;
mod chain;
mod controller;
mod emulated;
mod gpu;
mod ha;
mod import;
mod limits;
mod origin_policy;
mod origins;
mod scale;
mod stalls;
mod trust;
mod wire;
