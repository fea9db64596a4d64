//! How much more of the host's memory the memory tier may take.
//!
//! A memory tier on tmpfs (or ramfs) is RAM: every byte written there is a byte no other
//! process on the host can have, and not one the kernel can reclaim without swap. The
//! file system's own size does not protect the host: tmpfs mounts are often larger than
//! the RAM left (a GPU host's `/dev/shm` is shared with NCCL and the inference engines,
//! and several tmpfs mounts share one RAM), and a tmpfs write past what the host has ends
//! in the OOM killer, not in `ENOSPC`. So admission into such a tier also requires the
//! host's available memory (`MemAvailable` in `/proc/meminfo`: free memory plus what the
//! kernel can reclaim, such as clean page cache) to cover the shard and what the tier's
//! open shards still have to write, with a headroom left over for everything else.

/// The host's memory as `/proc/meminfo` states it, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemory {
    /// `MemTotal`.
    pub total: u64,
    /// `MemAvailable`: what new allocations can have without swapping.
    pub available: u64,
}

impl HostMemory {
    /// Reads `/proc/meminfo`; `None` where it cannot be read or lacks `MemAvailable`
    /// (kernels before 3.14).
    pub fn read() -> Option<Self> {
        use procfs_core::FromRead;
        let m = procfs_core::Meminfo::from_file("/proc/meminfo").ok()?;
        Some(Self {
            total: m.mem_total,
            available: m.mem_available?,
        })
    }

    /// What the memory tier may still take: `MemAvailable` less `headroom`.
    pub fn room(&self, headroom: u64) -> u64 {
        self.available.saturating_sub(headroom)
    }
}

/// The headroom kept when none is configured: 5% of the host's memory, at least 256 MiB
/// and at most 4 GiB.
pub fn default_headroom(total: u64) -> u64 {
    (total / 20).clamp(256 << 20, 4 << 30)
}

/// Whether a file system type keeps its files in RAM (their bytes count against the
/// host's memory, not against a disk).
pub fn memory_backed(fs_type: &str) -> bool {
    matches!(fs_type, "tmpfs" | "ramfs")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_hosts_memory() {
        let m = HostMemory::read().expect("/proc/meminfo with MemAvailable");
        assert!(m.total > 0 && m.available <= m.total, "{m:?}");
    }

    #[test]
    fn room_is_what_is_available_less_the_headroom() {
        let m = HostMemory {
            total: 100 << 30,
            available: 10 << 30,
        };
        assert_eq!(m.room(1 << 30), 9 << 30);
        assert_eq!(m.room(20 << 30), 0);
        assert_eq!(default_headroom(100 << 30), 4 << 30);
        assert_eq!(default_headroom(24 << 30), (24u64 << 30) / 20);
        assert_eq!(default_headroom(1 << 30), 256 << 20);
        assert!(memory_backed("tmpfs") && memory_backed("ramfs") && !memory_backed("ext4"));
    }
}
