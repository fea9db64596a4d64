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

pub mod autoscale;
pub mod evict;
pub mod gpu_choice;
pub mod partition;
pub mod profile;
