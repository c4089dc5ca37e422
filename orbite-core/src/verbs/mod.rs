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
//! `ORBITE_SYSFS_ROOT` (default `/sys`) is where a NIC's NUMA node and a
//! GID's type are read when the library does not say (tests point it at a
//! fake tree).

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
    /// Its ports, in order.
    pub ports: Vec<NicPort>,
}

/// The library a process loads: `ORBITE_IBVERBS_LIB`, else rdma-core's.
pub fn library() -> String {
    std::env::var("ORBITE_IBVERBS_LIB").unwrap_or_else(|_| "libibverbs.so.1".to_owned())
}

/// Every RDMA NIC of this machine with its ports and GIDs, or why there
/// is none to ask. A library with no device gives an empty list.
pub fn nics() -> Result<Vec<Nic>, VerbsError> {
    #[cfg(feature = "rdma")]
    {
        let lib = loader::get()?;
        loader::nics(lib)
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(VerbsError::NotBuilt)
    }
}

/// Where sysfs is read (`ORBITE_SYSFS_ROOT`, default `/sys`).
#[cfg_attr(not(feature = "rdma"), allow(dead_code, reason = "read by the loader"))]
fn sysfs_root() -> std::path::PathBuf {
    std::env::var_os("ORBITE_SYSFS_ROOT").map_or_else(|| "/sys".into(), Into::into)
}

/// The NUMA node sysfs gives the NIC `name` (none: -1 or unreadable).
#[cfg_attr(not(feature = "rdma"), allow(dead_code, reason = "read by the loader"))]
fn numa_node(name: &str) -> Option<u32> {
    let path = sysfs_root().join("class/infiniband").join(name).join("device/numa_node");
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The type sysfs gives GID `index` of `port` of `name`.
#[cfg_attr(not(feature = "rdma"), allow(dead_code, reason = "read by the loader"))]
fn sysfs_gid_type(name: &str, port: u8, index: u32) -> GidType {
    let path = sysfs_root().join(format!("class/infiniband/{name}/ports/{port}/gid_attrs/types/{index}"));
    match std::fs::read_to_string(path).map(|s| s.trim().to_owned()).as_deref() {
        Ok("RoCE v2") => GidType::RoceV2,
        Ok("IB/RoCE v1") | Ok("RoCE v1") => GidType::RoceV1,
        _ => GidType::Ib,
    }
}

#[cfg(feature = "rdma")]
mod loader;
#[cfg(feature = "rdma")]
pub(crate) mod objects;
#[cfg(feature = "rdma")]
mod sys;
