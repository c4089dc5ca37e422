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
mod loader {
    //! The library, its functions, and the calls that list NICs.

    use std::ffi::{CStr, CString, c_char, c_int, c_void};
    use std::net::Ipv6Addr;
    use std::sync::OnceLock;

    use super::{Gid, GidType, LinkLayer, Nic, NicPort, PortState, VerbsError};

    /// `struct ibv_device_attr` (232 bytes): the fields read here.
    #[repr(C)]
    struct DeviceAttr {
        fw_ver: [u8; 64],
        node_guid: u64,
        _middle: [u8; 152],
        /// From offset 224: `max_pkeys` (2 bytes), `local_ca_ack_delay`,
        /// `phys_port_cnt`, padding.
        tail: [u8; 8],
    }

    /// `struct ibv_port_attr` (56 bytes; the exported query writes its
    /// first 48).
    #[repr(C)]
    struct PortAttr {
        state: i32,
        max_mtu: i32,
        active_mtu: i32,
        gid_tbl_len: i32,
        _flags_to_phys_state: [u8; 30],
        link_layer: u8,
        flags: u8,
        _tail: [u8; 8],
    }

    /// `struct ibv_gid_entry`.
    #[repr(C)]
    struct GidEntry {
        gid: [u8; 16],
        gid_index: u32,
        port_num: u32,
        gid_type: u32,
        ndev_ifindex: u32,
    }

    const _: () = {
        assert!(size_of::<DeviceAttr>() == 232);
        assert!(std::mem::offset_of!(DeviceAttr, tail) == 224);
        assert!(size_of::<PortAttr>() == 56);
        assert!(std::mem::offset_of!(PortAttr, link_layer) == 46);
        assert!(size_of::<GidEntry>() == 32);
    };

    type Device = c_void;
    type Context = c_void;
    type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut Device;
    type FreeDeviceList = unsafe extern "C" fn(*mut *mut Device);
    type GetDeviceName = unsafe extern "C" fn(*mut Device) -> *const c_char;
    type GetDeviceGuid = unsafe extern "C" fn(*mut Device) -> u64;
    type OpenDevice = unsafe extern "C" fn(*mut Device) -> *mut Context;
    type CloseDevice = unsafe extern "C" fn(*mut Context) -> c_int;
    type QueryDevice = unsafe extern "C" fn(*mut Context, *mut DeviceAttr) -> c_int;
    type QueryPort = unsafe extern "C" fn(*mut Context, u8, *mut PortAttr) -> c_int;
    type QueryGid = unsafe extern "C" fn(*mut Context, u8, c_int, *mut [u8; 16]) -> c_int;
    type QueryGidEx = unsafe extern "C" fn(*mut Context, u32, u32, *mut GidEntry, u32, usize) -> c_int;

    /// The loaded library's functions.
    pub(super) struct Library {
        name: String,
        get_device_list: GetDeviceList,
        free_device_list: FreeDeviceList,
        get_device_name: GetDeviceName,
        get_device_guid: GetDeviceGuid,
        open_device: OpenDevice,
        close_device: CloseDevice,
        query_device: QueryDevice,
        query_port: QueryPort,
        query_gid: QueryGid,
        /// rdma-core 32 and later.
        query_gid_ex: Option<QueryGidEx>,
    }

    /// The library, loaded by the first call.
    pub(super) fn get() -> Result<&'static Library, VerbsError> {
        static LIB: OnceLock<Result<Library, VerbsError>> = OnceLock::new();
        LIB.get_or_init(|| load(&super::library())).as_ref().map_err(Clone::clone)
    }

    fn load(name: &str) -> Result<Library, VerbsError> {
        let no_library = |reason: String| VerbsError::NoLibrary { library: name.to_owned(), reason };
        let c_name = CString::new(name).map_err(|_| no_library("a NUL in its name".into()))?;
        // SAFETY: a NUL-terminated name; the handle is kept for the
        // process's life (never closed), so its functions stay valid.
        let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror's message, copied at once.
            let why = unsafe { libc::dlerror() };
            let why = if why.is_null() {
                "unknown".into()
            } else {
                unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned()
            };
            return Err(no_library(why));
        }
        let sym = |symbol: &'static CStr| -> Option<*mut c_void> {
            // SAFETY: a live handle and a NUL-terminated name.
            let p = unsafe { libc::dlsym(handle, symbol.as_ptr()) };
            (!p.is_null()).then_some(p)
        };
        let need = |symbol: &'static CStr| {
            sym(symbol).ok_or_else(|| VerbsError::MissingSymbol {
                library: name.to_owned(),
                symbol: symbol.to_str().unwrap_or("?"),
            })
        };
        // SAFETY (every transmute below): each symbol is rdma-core's
        // exported function of that name, whose C signature the target
        // type spells.
        unsafe {
            Ok(Library {
                name: name.to_owned(),
                get_device_list: std::mem::transmute::<*mut c_void, GetDeviceList>(need(c"ibv_get_device_list")?),
                free_device_list: std::mem::transmute::<*mut c_void, FreeDeviceList>(need(c"ibv_free_device_list")?),
                get_device_name: std::mem::transmute::<*mut c_void, GetDeviceName>(need(c"ibv_get_device_name")?),
                get_device_guid: std::mem::transmute::<*mut c_void, GetDeviceGuid>(need(c"ibv_get_device_guid")?),
                open_device: std::mem::transmute::<*mut c_void, OpenDevice>(need(c"ibv_open_device")?),
                close_device: std::mem::transmute::<*mut c_void, CloseDevice>(need(c"ibv_close_device")?),
                query_device: std::mem::transmute::<*mut c_void, QueryDevice>(need(c"ibv_query_device")?),
                query_port: std::mem::transmute::<*mut c_void, QueryPort>(need(c"ibv_query_port")?),
                query_gid: std::mem::transmute::<*mut c_void, QueryGid>(need(c"ibv_query_gid")?),
                query_gid_ex: sym(c"_ibv_query_gid_ex").map(|p| std::mem::transmute::<*mut c_void, QueryGidEx>(p)),
            })
        }
    }

    fn failed(call: &'static str, errno: c_int) -> VerbsError {
        VerbsError::Call { call, reason: std::io::Error::from_raw_os_error(errno).to_string() }
    }

    /// Most GID entries read per port (tables hold 16 to 256).
    const MAX_GIDS: i32 = 1024;

    /// Every device, opened in turn and closed again.
    pub(super) fn nics(lib: &Library) -> Result<Vec<Nic>, VerbsError> {
        let mut n: c_int = 0;
        // SAFETY: the library's call, with an int to fill.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(failed("ibv_get_device_list", std::io::Error::last_os_error().raw_os_error().unwrap_or(0)));
        }
        let mut out = Vec::new();
        let mut result = Ok(());
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: the list has n entries before its NULL.
            let dev = unsafe { *list.add(i) };
            if dev.is_null() {
                break;
            }
            match nic(lib, dev) {
                Ok(nic) => out.push(nic),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        // SAFETY: the list the library gave, freed once.
        unsafe { (lib.free_device_list)(list) };
        result.map(|()| out)
    }

    /// One device: opened, asked, closed.
    fn nic(lib: &Library, dev: *mut Device) -> Result<Nic, VerbsError> {
        // SAFETY: a device of the live list.
        let name = unsafe { (lib.get_device_name)(dev) };
        let name =
            if name.is_null() { String::new() } else { unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned() };
        // SAFETY: as above.
        let guid = u64::from_be(unsafe { (lib.get_device_guid)(dev) });
        // SAFETY: as above.
        let ctx = unsafe { (lib.open_device)(dev) };
        if ctx.is_null() {
            return Err(failed("ibv_open_device", std::io::Error::last_os_error().raw_os_error().unwrap_or(0)));
        }
        let asked = ask(lib, ctx, &name);
        // SAFETY: the context opened above, closed once.
        unsafe { (lib.close_device)(ctx) };
        let (firmware, ports) = asked?;
        Ok(Nic { numa_node: super::numa_node(&name), name, guid, firmware, ports })
    }

    /// A device's firmware and ports, through its open context.
    fn ask(lib: &Library, ctx: *mut Context, name: &str) -> Result<(String, Vec<NicPort>), VerbsError> {
        // SAFETY: zero is a valid value of every field.
        let mut attr: DeviceAttr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a struct of the library's size.
        let rc = unsafe { (lib.query_device)(ctx, &mut attr) };
        if rc != 0 {
            return Err(failed("ibv_query_device", rc));
        }
        let firmware =
            CStr::from_bytes_until_nul(&attr.fw_ver).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let ports = attr.tail[3];
        let mut out = Vec::with_capacity(ports as usize);
        for port in 1..=ports {
            // SAFETY: zero is a valid value of every field.
            let mut pa: PortAttr = unsafe { std::mem::zeroed() };
            // SAFETY: a live context and a struct of at least the 48 bytes
            // the exported call writes.
            let rc = unsafe { (lib.query_port)(ctx, port, &mut pa) };
            if rc != 0 {
                return Err(failed("ibv_query_port", rc));
            }
            let state = match pa.state {
                1 => PortState::Down,
                2 => PortState::Init,
                3 => PortState::Armed,
                4 => PortState::Active,
                s => PortState::Other(s),
            };
            let link_layer = match pa.link_layer {
                1 => LinkLayer::InfiniBand,
                2 => LinkLayer::Ethernet,
                _ => LinkLayer::Unspecified,
            };
            let active_mtu = match pa.active_mtu {
                1..=5 => 128u32 << pa.active_mtu,
                _ => 0,
            };
            let gids = (0..pa.gid_tbl_len.clamp(0, MAX_GIDS)).filter_map(|i| gid(lib, ctx, name, port, i)).collect();
            out.push(NicPort { port, state, link_layer, active_mtu, gids });
        }
        Ok((firmware, out))
    }

    /// GID `index` of `port`, if the entry is valid.
    fn gid(lib: &Library, ctx: *mut Context, name: &str, port: u8, index: i32) -> Option<Gid> {
        if let Some(query_gid_ex) = lib.query_gid_ex {
            // SAFETY: zero is a valid value of every field.
            let mut e: GidEntry = unsafe { std::mem::zeroed() };
            // SAFETY: a live context and an entry of the size passed.
            let rc = unsafe { query_gid_ex(ctx, port as u32, index as u32, &mut e, 0, size_of::<GidEntry>()) };
            if rc != 0 || e.gid == [0; 16] {
                return None;
            }
            let kind = match e.gid_type {
                1 => GidType::RoceV1,
                2 => GidType::RoceV2,
                _ => GidType::Ib,
            };
            let netdev = (e.ndev_ifindex != 0).then(|| ifname(e.ndev_ifindex)).flatten();
            return Some(Gid { index: index as u32, gid: Ipv6Addr::from(e.gid), kind, netdev });
        }
        let mut raw = [0u8; 16];
        // SAFETY: a live context and 16 bytes.
        if unsafe { (lib.query_gid)(ctx, port, index, &mut raw) } != 0 || raw == [0; 16] {
            return None;
        }
        let kind = super::sysfs_gid_type(name, port, index as u32);
        Some(Gid { index: index as u32, gid: Ipv6Addr::from(raw), kind, netdev: None })
    }

    /// The name of network interface `index`.
    fn ifname(index: u32) -> Option<String> {
        let mut buf = [0 as c_char; libc::IF_NAMESIZE];
        // SAFETY: a buffer of IF_NAMESIZE bytes.
        let p = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
        // SAFETY: on success, a NUL-terminated name in `buf`.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    impl std::fmt::Debug for Library {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Library").field("name", &self.name).finish()
        }
    }
}
