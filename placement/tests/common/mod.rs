//! Cluster builders shared by the integration tests.

#![allow(dead_code, unreachable_pub)]

use shardcast_placement::{Held, HostInfo, ModelSpec};

pub const GIB: u64 = 1 << 30;
pub const KEY: &str = "ab12";

/// An up host with plenty of room, 8 free GPUs, default NIC.
pub fn host(id: &str, rack: &str) -> HostInfo {
    HostInfo {
        id: id.to_owned(),
        rack: rack.to_owned(),
        zone: "z".to_owned(),
        up: true,
        nic_bps: 0,
        mem_capacity: 512 * GIB,
        mem_free: 512 * GIB,
        disk_capacity: 4096 * GIB,
        disk_free: 4096 * GIB,
        gpus: 8,
        gpus_free: 8,
        holdings: Default::default(),
    }
}

/// `host` holding the model in the given tiers.
pub fn holder(id: &str, rack: &str, memory: bool, disk: bool) -> HostInfo {
    let mut h = host(id, rack);
    h.holdings.insert(
        KEY.to_owned(),
        Held {
            memory,
            disk,
            receiving: false,
        },
    );
    h
}

/// A model of `shards` shards of 1 GiB each, 4 MiB chunks.
pub fn model(shards: usize) -> ModelSpec {
    ModelSpec {
        key: KEY.to_owned(),
        shard_bytes: vec![GIB; shards],
        chunk_size: 4 << 20,
    }
}

pub fn rack_of<'a>(cluster: &'a [HostInfo], id: &str) -> &'a str {
    cluster
        .iter()
        .find(|h| h.id == id)
        .map(|h| h.rack.as_str())
        .unwrap_or("")
}
