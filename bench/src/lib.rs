//! # shardcast-bench
//!
//! Benchmarks and local clusters for shardcast (see `docs/BENCHMARKS.md`).

pub mod netns;
pub mod origin_server;
pub mod synth;
