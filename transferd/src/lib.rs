//! # transferd
//!
//! The per-host daemon of shardcast (module map in `docs/ARCHITECTURE.md`).

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod origin;
pub mod store;
pub mod throttle;
