//! The storage tiers, once for every crate: [`Tier`] is where a copy of a model lives (host
//! memory, disk, or a GPU slot), and [`DataTier`] the tiers that hold bytes in a host's
//! store (memory and disk): what a chain session writes into, what a holding is in, what
//! an eviction frees. A `Gpu` request is served on the data plane by a memory-tier copy,
//! hence [`DataTier::serving`].
//!
//! The wire forms are converted at the edges: the frames' one-byte code in
//! [`crate::frame`], the gRPC enums (`agent::Tier`, `controller::Tier`) in [`crate::api`].

use crate::named_enum;

named_enum! {
    /// Where a copy lives. `Gpu` requests are satisfied on the data plane by a memory-tier
    /// copy, but capacity checks count GPUs.
    Tier {
        /// The host-memory tier (tmpfs-backed shard store).
        Memory = "memory",
        /// The disk tier.
        Disk = "disk",
        /// One GPU slot; the model must be in the host's memory tier.
        Gpu = "gpu",
    }
}

named_enum! {
    /// A tier that holds bytes in a host's store (the GPU tier is GPU slots, not a store).
    DataTier {
        /// Host memory (tmpfs or hugepages), mappable by inference processes on the host.
        Memory = "memory",
        /// The local disk.
        Disk = "disk",
    }
}

impl DataTier {
    /// The store tier that serves a request for `tier`: a GPU load reads the memory tier.
    pub fn serving(tier: Tier) -> Self {
        match tier {
            Tier::Disk => Self::Disk,
            Tier::Memory | Tier::Gpu => Self::Memory,
        }
    }
}

impl From<DataTier> for Tier {
    fn from(t: DataTier) -> Self {
        match t {
            DataTier::Memory => Self::Memory,
            DataTier::Disk => Self::Disk,
        }
    }
}

/// `Gpu` is not a tier that holds bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the gpu tier holds no bytes in the store")]
pub struct NotADataTier;

impl TryFrom<Tier> for DataTier {
    type Error = NotADataTier;

    fn try_from(t: Tier) -> Result<Self, NotADataTier> {
        match t {
            Tier::Memory => Ok(Self::Memory),
            Tier::Disk => Ok(Self::Disk),
            Tier::Gpu => Err(NotADataTier),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_conversions() {
        for t in Tier::ALL {
            assert_eq!(t.to_string().parse::<Tier>(), Ok(*t));
            assert_eq!(crate::controller::Tier::from(*t).label(), t.as_str());
            assert_eq!(Tier::from(crate::agent::Tier::from(*t)), *t);
            assert_eq!(crate::controller::Tier::from(*t).domain(), Some(*t));
        }
        for d in DataTier::ALL {
            assert_eq!(Tier::from(*d).as_str(), d.as_str());
            assert_eq!(DataTier::try_from(Tier::from(*d)), Ok(*d));
        }
        assert_eq!(DataTier::try_from(Tier::Gpu), Err(NotADataTier));
        assert_eq!(DataTier::serving(Tier::Gpu), DataTier::Memory);
        assert_eq!(
            "ssd".parse::<Tier>().unwrap_err().to_string(),
            "unknown Tier \"ssd\" (known: memory, disk, gpu)"
        );
        assert_eq!(serde_json::to_string(&DataTier::Disk).unwrap(), "\"disk\"");
        assert_eq!(serde_json::from_str::<Tier>("\"gpu\"").unwrap(), Tier::Gpu);
    }
}
