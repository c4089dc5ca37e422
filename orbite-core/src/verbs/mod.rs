//! RDMA NICs: the verbs library (rdma-core's `libibverbs.so.1`), loaded
//! at run time (feature `rdma`). There is no link-time dependency: a
//! machine without rdma-core, or without a device, builds and runs, and
//! says why it has no NIC.
//!
//! The library is the one `ORBITE_IBVERBS_LIB` names (a path, for a test
//! library such as `orbite-verbs-shim`), else `libibverbs.so.1` from the
//! loader's search path; it is loaded once per process and never
//! unloaded. Symbols are taken with plain `dlsym`, which gives each one's
//! default version: the ones rdma-core's headers bind to. The few types
//! this module passes are a hand-checked `#[repr(C)]` subset of
//! `verbs.h` (x86_64 Linux layouts, asserted below).
//!
//! `ORBITE_SYSFS_ROOT` (default `/sys`) is where a NIC's NUMA node and
//! place in the PCI hierarchy, a GPU's place, and a GID's type when the
//! library does not say, are read (tests point it at a fake tree).

use std::net::Ipv6Addr;

/// Why there is no NIC to use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// This build has no RDMA support.
    #[error("RDMA is not built in (feature `rdma`)")]
    NotBuilt,
    /// The verbs library could not be loaded.
    #[error("the verbs library {library} cannot be loaded: {reason}")]
    NoLibrary {
        /// The library asked for.
        library: String,
        /// The loader's words.
        reason: String,
    },
    /// The library lacks a function the engine needs.
    #[error("the verbs library {library} has no {symbol}")]
    MissingSymbol {
        /// The library loaded.
        library: String,
        /// The function.
        symbol: &'static str,
    },
    /// A verbs call failed.
    #[error("{call} failed: {reason}")]
    Call {
        /// The call.
        call: &'static str,
        /// The system's words for its errno.
        reason: String,
    },
}

/// A port's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// No link.
    Down,
    /// Link up, not yet configured by the subnet manager.
    Init,
    /// Configured, not yet active.
    Armed,
    /// Ready for traffic.
    Active,
    /// Another value of `ibv_port_state`.
    Other(i32),
}

/// What a port's link runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand.
    InfiniBand,
    /// Ethernet (RoCE).
    Ethernet,
    /// Not said.
    Unspecified,
}

/// What a GID is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand (or RoCE v1, which the kernel reports alike).
    Ib,
    /// RoCE v1 (Ethernet frames).
    RoceV1,
    /// RoCE v2 (UDP over IP: routable).
    RoceV2,
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gid {
    /// Its index in the table.
    pub index: u32,
    /// The GID itself.
    pub gid: Ipv6Addr,
    /// What it is for.
    pub kind: GidType,
    /// The network device a RoCE GID belongs to, if known.
    pub netdev: Option<String>,
}

impl Gid {
    /// An IPv4 address mapped into the GID (RoCE over IPv4).
    pub fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        self.gid.to_ipv4_mapped()
    }
}

/// One port of a NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicPort {
    /// Its number (from 1).
    pub port: u8,
    /// Its state.
    pub state: PortState,
    /// What its link runs.
    pub link_layer: LinkLayer,
    /// The active MTU in bytes.
    pub active_mtu: u32,
    /// The GID table's valid entries.
    pub gids: Vec<Gid>,
}

impl NicPort {
    /// The GID a connection uses by default: on InfiniBand the first; on
    /// RoCE a RoCE v2 GID over IPv4 first (routable, what NCCL prefers),
    /// then RoCE v2, then any that is not link-local, lowest index first.
    pub fn default_gid(&self) -> Option<&Gid> {
        if self.link_layer == LinkLayer::InfiniBand {
            return self.gids.first();
        }
        let link_local = |g: &Gid| g.gid.segments()[0] & 0xffc0 == 0xfe80;
        let rank = |g: &Gid| match (g.kind, g.ipv4().is_some(), link_local(g)) {
            (GidType::RoceV2, true, _) => 0,
            (GidType::RoceV2, false, false) => 1,
            (_, _, false) => 2,
            _ => 3,
        };
        self.gids.iter().min_by_key(|g| (rank(g), g.index))
    }
}

/// One RDMA NIC (an rdma-core device).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// Its name (`mlx5_0`).
    pub name: String,
    /// Its node GUID.
    pub guid: u64,
    /// Its firmware version.
    pub firmware: String,
    /// The NUMA node it is attached to, if known.
    pub numa_node: Option<u32>,
    /// Its place in the PCI hierarchy (the resolved sysfs path of its
    /// device), if known.
    pub pci_path: Option<std::path::PathBuf>,
    /// Its ports, in order.
    pub ports: Vec<NicPort>,
}

impl Nic {
    /// Whether a port of it is active.
    pub fn active(&self) -> bool {
        self.ports.iter().any(|p| p.state == PortState::Active)
    }
}

/// Where a buffer's memory is, for choosing the NIC closest to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Near {
    /// CUDA device `ordinal`'s memory.
    Gpu(u32),
    /// Host memory of this NUMA node.
    Numa(u32),
}

/// A NIC, as close to a buffer as [`closest`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closeness<'a> {
    /// The NIC.
    pub nic: &'a Nic,
    /// PCI hops between the buffer's device and the NIC (through their
    /// nearest common bridge), for device memory whose place is known.
    pub pci_hops: Option<u32>,
    /// Whether the NIC is on the buffer's NUMA node.
    pub same_numa: bool,
}

/// The NICs with an active port, closest to memory `near` first: fewest
/// PCI hops from a GPU (through the nearest common bridge of their sysfs
/// paths), then on the same NUMA node, then by name.
pub fn closest(nics: &[Nic], near: Near) -> Vec<Closeness<'_>> {
    let place = Place::of(near);
    let mut out: Vec<Closeness<'_>> = nics
        .iter()
        .filter(|n| n.active())
        .map(|nic| {
            let (pci_hops, same_numa) = place.distance(nic.numa_node, nic.pci_path.as_deref());
            Closeness { nic, pci_hops, same_numa }
        })
        .collect();
    out.sort_by(|a, b| {
        let key = |c: &Closeness<'_>| (c.pci_hops.unwrap_or(u32::MAX), !c.same_numa);
        key(a).cmp(&key(b)).then_with(|| a.nic.name.cmp(&b.nic.name))
    });
    out
}

/// Where memory is: its device's place in the PCI hierarchy (for device
/// memory whose place sysfs gives) and its NUMA node.
pub(crate) struct Place {
    path: Option<std::path::PathBuf>,
    numa: Option<u32>,
}

impl Place {
    /// The place of memory `near`.
    pub(crate) fn of(near: Near) -> Place {
        match near {
            Near::Numa(n) => Place { path: None, numa: Some(n) },
            Near::Gpu(ordinal) => {
                let path = crate::cuda::pci_bus_id(ordinal)
                    .ok()
                    .and_then(|bdf| std::fs::canonicalize(sysfs_root().join("bus/pci/devices").join(bdf)).ok());
                let numa =
                    path.as_ref().and_then(|p| std::fs::read_to_string(p.join("numa_node")).ok()?.trim().parse().ok());
                Place { path, numa }
            }
        }
    }

    /// How far a NIC on NUMA node `numa_node` at `pci_path` is: PCI hops
    /// (when both places are known), and whether it is on the same node.
    pub(crate) fn distance(&self, numa_node: Option<u32>, pci_path: Option<&std::path::Path>) -> (Option<u32>, bool) {
        let hops = self.path.as_deref().zip(pci_path).map(|(a, b)| hops(a, b));
        (hops, self.numa.is_some() && numa_node == self.numa)
    }
}

/// Whether nvidia-peermem (or its predecessor nv_peer_mem) is loaded:
/// NICs then take CUDA device memory by address (`ibv_reg_mr`).
pub(crate) fn peermem_loaded() -> bool {
    let root = sysfs_root();
    root.join("module/nvidia_peermem").exists() || root.join("module/nv_peer_mem").exists()
}

/// The NUMA node of the page at `addr` of this process, if the kernel
/// says.
pub(crate) fn numa_node_of(addr: u64) -> Option<u32> {
    let mut node: libc::c_int = -1;
    // MPOL_F_NODE | MPOL_F_ADDR: the node of the page at that address.
    // SAFETY: get_mempolicy writes one int; the address is only looked up.
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<u64>(),
            0u64,
            addr,
            3u64,
        )
    };
    (r == 0 && node >= 0).then_some(node as u32)
}

/// Components of `a` and `b` below their longest common prefix.
fn hops(a: &std::path::Path, b: &std::path::Path) -> u32 {
    let (a, b): (Vec<_>, Vec<_>) = (a.components().collect(), b.components().collect());
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    (a.len() - common + b.len() - common) as u32
}

/// The library a process loads: `ORBITE_IBVERBS_LIB`, else rdma-core's.
pub fn library() -> String {
    std::env::var("ORBITE_IBVERBS_LIB").unwrap_or_else(|_| "libibverbs.so.1".to_owned())
}

/// Every RDMA NIC of this machine with its ports and GIDs, or why there
/// is none to ask. A library with no device gives an empty list.
pub fn nics() -> Result<Vec<Nic>, VerbsError> {
    loader::nics(loader::get()?)
}

/// Where sysfs is read (`ORBITE_SYSFS_ROOT`, default `/sys`).
fn sysfs_root() -> std::path::PathBuf {
    std::env::var_os("ORBITE_SYSFS_ROOT").map_or_else(|| "/sys".into(), Into::into)
}

/// The NUMA node sysfs gives the NIC `name` (none: -1 or unreadable).
fn numa_node(name: &str) -> Option<u32> {
    let path = sysfs_root().join("class/infiniband").join(name).join("device/numa_node");
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The resolved sysfs path of the NIC `name`'s PCI device.
fn pci_path(name: &str) -> Option<std::path::PathBuf> {
    std::fs::canonicalize(sysfs_root().join("class/infiniband").join(name).join("device")).ok()
}

/// The type sysfs gives GID `index` of `port` of `name`.
fn sysfs_gid_type(name: &str, port: u8, index: u32) -> GidType {
    let path = sysfs_root().join(format!("class/infiniband/{name}/ports/{port}/gid_attrs/types/{index}"));
    match std::fs::read_to_string(path).map(|s| s.trim().to_owned()).as_deref() {
        Ok("RoCE v2") => GidType::RoceV2,
        Ok("IB/RoCE v1") | Ok("RoCE v1") => GidType::RoceV1,
        _ => GidType::Ib,
    }
}

mod loader;
pub(crate) mod objects;
pub(crate) mod rails;
mod sys;

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn nic(name: &str, numa: Option<u32>, pci: Option<&str>, state: PortState) -> Nic {
        let port = NicPort { port: 1, state, link_layer: LinkLayer::Ethernet, active_mtu: 4096, gids: Vec::new() };
        Nic {
            name: name.into(),
            guid: 0,
            firmware: String::new(),
            numa_node: numa,
            pci_path: pci.map(Into::into),
            ports: vec![port],
        }
    }

    #[test]
    fn pci_hops_count_the_path_below_the_nearest_common_bridge() {
        let root = "/sys/devices/pci0000:00";
        let gpu = Path::new("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0");
        assert_eq!(hops(gpu, Path::new(&format!("{root}/0000:00:01.0/0000:10:00.0"))), 2, "behind one bridge");
        assert_eq!(hops(gpu, Path::new(&format!("{root}/0000:00:02.0/0000:11:00.0"))), 4, "across the root complex");
        assert_eq!(hops(gpu, Path::new("/sys/devices/pci0000:80/0000:80:01.0/0000:90:00.0")), 6, "another root");
        assert_eq!(hops(gpu, Path::new("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.1")), 2);
    }

    #[test]
    fn host_memory_prefers_nics_of_its_numa_node_and_skips_nics_with_no_active_port() {
        let nics = [
            nic("mlx5_0", Some(0), None, PortState::Active),
            nic("mlx5_1", Some(1), None, PortState::Active),
            nic("mlx5_2", Some(1), None, PortState::Down),
            nic("mlx5_3", None, None, PortState::Active),
        ];
        let names = |near| closest(&nics, near).iter().map(|c| c.nic.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(Near::Numa(1)), ["mlx5_1", "mlx5_0", "mlx5_3"]);
        assert_eq!(names(Near::Numa(0)), ["mlx5_0", "mlx5_1", "mlx5_3"]);
        assert!(closest(&nics, Near::Numa(1)).iter().all(|c| c.pci_hops.is_none()));
    }
}
