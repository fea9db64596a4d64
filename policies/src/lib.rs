//! # shardcast-policies
//!
//! The controller's judgement, as pure functions over plain data (no I/O, no clock: time is
//! an argument), so the controller, the tests and the simulator run the same code.
//!
//! * [`profile`]: model profiles (per layer group: weights, load time, execution time,
//!   output activations), derived from safetensors tensor names when none is given.
//! * [`partition`]: latency-optimal partition plans under a per-GPU memory budget (a DP over
//!   cut points), precomputed per partition count and queue length; cost-optimal plans under
//!   a latency SLO (exact search).
//! * [`autoscale`]: scale up/down decisions from reported load, with headroom, scale-down
//!   delay and a load-latency penalty.
//! * [`evict`]: heavy/light eviction per GPU, host memory and disk tiers, last-copy protection.
//! * [`gpu_choice`]: interference-aware GPU choice (Torpor Algorithm 1).
//!
//! This crate is the one source of judgement. The controller calls it for autoscaling
//! (`autoscaler`), partition plans (`ptables`, `burst`), heaviness (`core::plans`) and the
//! host tiers' evictions (`tiers`); `gpu-loader`'s `GpuManager` for GPU choice and per-GPU
//! eviction; `transferd` to map tensors to partition groups (`profile::group_of`) when it
//! loads a partition. Tests: property tests against brute force, the Flashpoint Figs 4.2–4.4
//! example, autoscaler timelines, Torpor eviction mixes, a Fig. 5-like topology
//! (`tests/`); `benches/policies.rs`.

pub mod autoscale;
pub mod evict;
pub mod gpu_choice;
pub mod partition;
pub mod profile;
