//! Host-side work of a load placed near its GPU: the NUMA node the GPU's PCIe link hangs
//! off, read from sysfs (`/sys/bus/pci/devices/<bus id>/numa_node`), and that node's CPUs
//! (`/sys/devices/system/node/node<N>/cpulist`).
//!
//! On a host with several NUMA nodes a copy from a buffer on the far node crosses the
//! inter-socket link twice (the CPU's fill, then the GPU's DMA read), which costs bandwidth
//! that the PCIe link would otherwise get. The loader therefore runs its fillers, and
//! allocates its pinned staging buffers, on threads whose CPU affinity is narrowed to the
//! GPU's node ([`Pinned`]): with the kernel's default memory policy (allocate on the node of
//! the CPU that first touches a page), the buffers' pages then come from that node, as
//! NCCL places its host buffers. Only the affinity is changed, through rustix's safe
//! `sched_setaffinity`; no memory policy syscall is needed.
//!
//! When the node is unknown (a simulated device without one, `numa_node` of -1 on
//! single-node hosts and VMs, sysfs not mounted) or none of its CPUs is allowed to this
//! process (a cgroup cpuset elsewhere), nothing is changed and the load report says so.

use std::path::{Path, PathBuf};

use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

/// Why a GPU's NUMA node, or its CPUs, could not be found or used.
#[derive(Debug, thiserror::Error)]
pub enum NumaError {
    /// The bus id is not a PCI address.
    #[error("{0:?} is not a PCI address (domain:bus:device.function)")]
    NotPciAddress(String),
    /// A sysfs file could not be read.
    #[error("{}: {source}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `numa_node` does not hold a number.
    #[error("{}: not a node number: {text:?}", .path.display())]
    NotANode {
        /// The file.
        path: PathBuf,
        /// What it holds.
        text: String,
    },
    /// A node's `cpulist` does not parse.
    #[error("{}: {reason}", .path.display())]
    BadCpuList {
        /// The file.
        path: PathBuf,
        /// What [`parse_cpulist`] refused.
        reason: String,
    },
    /// The GPU's NUMA node is not known.
    #[error("the GPU's NUMA node is not known")]
    UnknownNode,
    /// The node lists no CPUs.
    #[error("NUMA node {0} has no CPUs")]
    NoCpus(u32),
    /// None of the node's CPUs (this many) is in the process's affinity.
    #[error("none of the node's CPUs ({0}) is allowed to this process")]
    NoneAllowed(usize),
    /// The kernel refused to tell the thread's affinity.
    #[error("reading the CPU affinity: {0}")]
    GetAffinity(rustix::io::Errno),
    /// The kernel refused to change the thread's affinity.
    #[error("setting the CPU affinity: {0}")]
    SetAffinity(rustix::io::Errno),
}

fn read(path: &Path) -> Result<String, NumaError> {
    std::fs::read_to_string(path).map_err(|source| NumaError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Where sysfs is mounted.
const SYS: &str = "/sys";

/// The NUMA node of the PCI device `bus_id` (as CUDA writes it, `0000:3B:00.0`), from
/// sysfs; `None` when the kernel does not know one (`-1`) or sysfs does not have it.
pub fn node_of_pci(bus_id: &str) -> Option<u32> {
    node_of_pci_in(Path::new(SYS), bus_id).ok().flatten()
}

/// [`node_of_pci`] under the sysfs root `sys`: `Err` when the file is missing or malformed.
pub fn node_of_pci_in(sys: &Path, bus_id: &str) -> Result<Option<u32>, NumaError> {
    let id = sysfs_pci_id(bus_id)?;
    let path = sys.join("bus/pci/devices").join(&id).join("numa_node");
    let text = read(&path)?;
    let n: i64 = text
        .trim()
        .parse()
        .map_err(|_| NumaError::NotANode { path, text })?;
    Ok(u32::try_from(n).ok())
}

/// A PCI address in sysfs' form: lowercase, a 4-digit domain (CUDA may write 8 digits).
fn sysfs_pci_id(bus_id: &str) -> Result<String, NumaError> {
    let bad = || NumaError::NotPciAddress(bus_id.to_string());
    let mut parts = bus_id.trim().splitn(3, ':');
    let (Some(domain), Some(bus), Some(rest)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad());
    };
    let domain = u32::from_str_radix(domain, 16).map_err(|_| bad())?;
    let (dev, func) = rest.split_once('.').ok_or_else(bad)?;
    let hex = |s: &str, max: u32| {
        u32::from_str_radix(s, 16)
            .ok()
            .filter(|v| *v <= max)
            .ok_or_else(bad)
    };
    Ok(format!(
        "{domain:04x}:{:02x}:{:02x}.{:x}",
        hex(bus, 0xff)?,
        hex(dev, 0x1f)?,
        hex(func, 7)?
    ))
}

/// The CPUs of NUMA node `node`, from sysfs.
pub fn cpus_of_node(node: u32) -> Result<Vec<usize>, NumaError> {
    cpus_of_node_in(Path::new(SYS), node)
}

/// [`cpus_of_node`] under the sysfs root `sys`.
pub fn cpus_of_node_in(sys: &Path, node: u32) -> Result<Vec<usize>, NumaError> {
    let path = sys.join(format!("devices/system/node/node{node}/cpulist"));
    let text = read(&path)?;
    parse_cpulist(&text).map_err(|reason| NumaError::BadCpuList { path, reason })
}

/// Parses a kernel CPU list (`0-3,8-11`, `5`, or empty), sorted and without repeats. A
/// text parser: its error is the message.
pub fn parse_cpulist(text: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let num = |s: &str| {
            s.trim()
                .parse::<usize>()
                .ok()
                .filter(|&c| c < CpuSet::MAX_CPU)
                .ok_or_else(|| format!("{s:?} is not a CPU number below {}", CpuSet::MAX_CPU))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(format!("CPU range {part:?} runs backwards"));
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(num(part)?),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// The calling thread's CPU affinity narrowed to some CPUs until dropped, when the
/// previous affinity is restored.
#[derive(Debug)]
pub struct Pinned {
    before: CpuSet,
    cpus: usize,
}

impl Pinned {
    /// How many CPUs the thread may run on now.
    pub fn cpus(&self) -> usize {
        self.cpus
    }
}

/// Narrows the calling thread's CPU affinity to those of `cpus` it is allowed now; `Err`
/// (and nothing changed) when none of them is, or the kernel refuses.
pub fn pin_current_thread(cpus: &[usize]) -> Result<Pinned, NumaError> {
    let before = sched_getaffinity(None).map_err(NumaError::GetAffinity)?;
    let mut narrowed = CpuSet::new();
    for &c in cpus.iter().filter(|&&c| c < CpuSet::MAX_CPU) {
        if before.is_set(c) {
            narrowed.set(c);
        }
    }
    let n = narrowed.count() as usize;
    if n == 0 {
        return Err(NumaError::NoneAllowed(cpus.len()));
    }
    sched_setaffinity(None, &narrowed).map_err(NumaError::SetAffinity)?;
    Ok(Pinned { before, cpus: n })
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Err(e) = sched_setaffinity(None, &self.before) {
            tracing::warn!("restoring a thread's CPU affinity: {e}");
        }
    }
}

/// A GPU's NUMA node and its CPUs, for placing a load's host-side work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Near {
    /// The node.
    pub node: u32,
    /// Its CPUs.
    pub cpus: Vec<usize>,
}

impl Near {
    /// The node `node` (a device's [`crate::device::DeviceInfo::numa_node`]) with its CPUs,
    /// or why the load cannot be placed on it.
    pub fn of(node: Option<u32>) -> Result<Self, NumaError> {
        let node = node.ok_or(NumaError::UnknownNode)?;
        let cpus = cpus_of_node(node)?;
        if cpus.is_empty() {
            return Err(NumaError::NoCpus(node));
        }
        Ok(Self { node, cpus })
    }

    /// Pins the calling thread to this node's CPUs until the result drops.
    pub fn pin(&self) -> Result<Pinned, NumaError> {
        pin_current_thread(&self.cpus)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(
            parse_cpulist("0-3,8-11\n").unwrap(),
            vec![0, 1, 2, 3, 8, 9, 10, 11]
        );
        assert_eq!(parse_cpulist("5").unwrap(), vec![5]);
        assert_eq!(parse_cpulist("\n").unwrap(), Vec::<usize>::new());
        assert_eq!(parse_cpulist("3,1-2,2").unwrap(), vec![1, 2, 3]);
        for bad in ["3-1", "a", "1-", "-", "99999999"] {
            assert!(parse_cpulist(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn pci_addresses_are_normalised_to_sysfs_names() {
        assert_eq!(sysfs_pci_id("0000:3B:00.0").unwrap(), "0000:3b:00.0");
        assert_eq!(sysfs_pci_id("00000000:C1:1F.7").unwrap(), "0000:c1:1f.7");
        for bad in [
            "",
            "3b:00.0",
            "0000:3b:00",
            "0000:3b:20.0",
            "0000:3b:00.8",
            "x:3b:00.0",
        ] {
            assert!(sysfs_pci_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_node_of_a_device_and_its_cpus_come_from_sysfs() {
        let sys = tempfile::tempdir().unwrap();
        let dev = sys.path().join("bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        let gone = sys.path().join("bus/pci/devices/0000:5e:00.0");
        std::fs::create_dir_all(&gone).unwrap();
        std::fs::write(gone.join("numa_node"), "-1\n").unwrap();
        let node = sys.path().join("devices/system/node/node1");
        std::fs::create_dir_all(&node).unwrap();
        std::fs::write(node.join("cpulist"), "16-31,48-63\n").unwrap();
        assert_eq!(node_of_pci_in(sys.path(), "0000:3B:00.0").unwrap(), Some(1));
        // -1: the kernel knows no node (single-node hosts, many VMs).
        assert_eq!(node_of_pci_in(sys.path(), "0000:5E:00.0").unwrap(), None);
        let e = node_of_pci_in(sys.path(), "0000:99:00.0").unwrap_err();
        assert!(matches!(e, NumaError::Read { .. }), "{e}");
        assert!(matches!(
            node_of_pci_in(sys.path(), "3b:00.0"),
            Err(NumaError::NotPciAddress(_))
        ));
        std::fs::write(gone.join("numa_node"), "x\n").unwrap();
        let e = node_of_pci_in(sys.path(), "0000:5E:00.0").unwrap_err();
        assert!(matches!(e, NumaError::NotANode { .. }), "{e}");
        assert!(
            e.to_string()
                .ends_with("numa_node: not a node number: \"x\\n\""),
            "{e}"
        );
        let cpus = cpus_of_node_in(sys.path(), 1).unwrap();
        assert_eq!((cpus.len(), cpus[0], cpus[31]), (32, 16, 63));
        assert!(cpus_of_node_in(sys.path(), 2).is_err());
    }

    /// This host's own node 0 (every Linux host with sysfs has one): the thread is pinned
    /// to its CPUs that it may use, and the old affinity comes back on drop.
    #[test]
    fn a_thread_is_pinned_to_a_node_and_unpinned() {
        let Ok(near) = Near::of(Some(0)) else {
            eprintln!("SKIPPED: no /sys/devices/system/node/node0/cpulist on this host");
            return;
        };
        std::thread::spawn(move || {
            let before = sched_getaffinity(None).unwrap();
            let p = near.pin().unwrap();
            let now = sched_getaffinity(None).unwrap();
            assert_eq!(now.count() as usize, p.cpus());
            assert!((0..CpuSet::MAX_CPU).all(|c| !now.is_set(c) || near.cpus.contains(&c)));
            // A thread may be narrowed to one CPU and widened back.
            let one = pin_current_thread(&near.cpus[..1]).unwrap();
            assert_eq!(sched_getaffinity(None).unwrap().count(), 1);
            drop(one);
            assert_eq!(sched_getaffinity(None).unwrap(), now);
            drop(p);
            assert_eq!(sched_getaffinity(None).unwrap(), before);
            // CPUs this process may not use: refused, nothing changed.
            let e = pin_current_thread(&[CpuSet::MAX_CPU - 1]).unwrap_err();
            assert!(matches!(e, NumaError::NoneAllowed(1)), "{e}");
            assert!(e.to_string().contains("none of the node's CPUs"), "{e}");
            assert_eq!(sched_getaffinity(None).unwrap(), before);
        })
        .join()
        .unwrap();
    }
}
