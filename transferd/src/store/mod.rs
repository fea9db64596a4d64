//! Shard store (in progress).
