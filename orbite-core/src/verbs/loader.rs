//! The verbs library, its functions, and the calls that list NICs.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::net::Ipv6Addr;

use super::sys::{DeviceAttr, GidEntry, PortAttr};
use super::{Gid, GidType, LinkLayer, Nic, NicPort, PortState, VerbsError, sys};

pub(super) type Device = c_void;
pub(super) type Context = c_void;
type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut Device;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut Device);
type GetDeviceName = unsafe extern "C" fn(*mut Device) -> *const c_char;
type GetDeviceGuid = unsafe extern "C" fn(*mut Device) -> u64;
type OpenDevice = unsafe extern "C" fn(*mut Device) -> *mut Context;
type CloseDevice = unsafe extern "C" fn(*mut Context) -> c_int;
type QueryDevice = unsafe extern "C" fn(*mut Context, *mut DeviceAttr) -> c_int;
type QueryPort = unsafe extern "C" fn(*mut Context, u8, *mut PortAttr) -> c_int;
type QueryGid = unsafe extern "C" fn(*mut Context, u8, c_int, *mut [u8; 16]) -> c_int;
type AllocPd = unsafe extern "C" fn(*mut Context) -> *mut c_void;
type DeallocPd = unsafe extern "C" fn(*mut c_void) -> c_int;
type RegMr = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut sys::IbvMr;
type DeregMr = unsafe extern "C" fn(*mut sys::IbvMr) -> c_int;
type CreateCompChannel = unsafe extern "C" fn(*mut Context) -> *mut sys::IbvCompChannel;
type DestroyCompChannel = unsafe extern "C" fn(*mut sys::IbvCompChannel) -> c_int;
type CreateCq = unsafe extern "C" fn(*mut Context, c_int, *mut c_void, *mut sys::IbvCompChannel, c_int) -> *mut c_void;
type DestroyCq = unsafe extern "C" fn(*mut c_void) -> c_int;
type GetCqEvent = unsafe extern "C" fn(*mut sys::IbvCompChannel, *mut *mut c_void, *mut *mut c_void) -> c_int;
type AckCqEvents = unsafe extern "C" fn(*mut c_void, u32);
type CreateQp = unsafe extern "C" fn(*mut c_void, *mut sys::IbvQpInitAttr) -> *mut sys::IbvQp;
type ModifyQp = unsafe extern "C" fn(*mut sys::IbvQp, *mut sys::IbvQpAttr, c_int) -> c_int;
type DestroyQp = unsafe extern "C" fn(*mut sys::IbvQp) -> c_int;
type RegDmabufMr = unsafe extern "C" fn(*mut c_void, u64, usize, u64, c_int, c_int) -> *mut sys::IbvMr;
type GetAsyncEvent = unsafe extern "C" fn(*mut Context, *mut sys::IbvAsyncEvent) -> c_int;
type AckAsyncEvent = unsafe extern "C" fn(*mut sys::IbvAsyncEvent);
type QueryGidEx = unsafe extern "C" fn(*mut Context, u32, u32, *mut GidEntry, u32, usize) -> c_int;

/// The loaded library's functions.
pub(super) struct Library {
    name: String,
    pub(super) get_device_list: GetDeviceList,
    pub(super) free_device_list: FreeDeviceList,
    pub(super) get_device_name: GetDeviceName,
    get_device_guid: GetDeviceGuid,
    pub(super) open_device: OpenDevice,
    pub(super) close_device: CloseDevice,
    query_device: QueryDevice,
    query_port: QueryPort,
    query_gid: QueryGid,
    /// rdma-core 32 and later.
    query_gid_ex: Option<QueryGidEx>,
    pub(super) alloc_pd: AllocPd,
    pub(super) dealloc_pd: DeallocPd,
    pub(super) reg_mr: RegMr,
    pub(super) dereg_mr: DeregMr,
    pub(super) create_comp_channel: CreateCompChannel,
    pub(super) destroy_comp_channel: DestroyCompChannel,
    pub(super) create_cq: CreateCq,
    pub(super) destroy_cq: DestroyCq,
    pub(super) get_cq_event: GetCqEvent,
    pub(super) ack_cq_events: AckCqEvents,
    pub(super) create_qp: CreateQp,
    pub(super) modify_qp: ModifyQp,
    pub(super) destroy_qp: DestroyQp,
    /// rdma-core 34 and later.
    pub(super) reg_dmabuf_mr: Option<RegDmabufMr>,
    pub(super) get_async_event: GetAsyncEvent,
    pub(super) ack_async_event: AckAsyncEvent,
}

/// The library, loaded by the first call.
/// The process's library (feature `rdma`; without it, `NotBuilt`: the
/// rest of this module is built either way and never reached).
pub(super) fn get() -> Result<&'static Library, VerbsError> {
    #[cfg(feature = "rdma")]
    {
        static LIB: std::sync::OnceLock<Result<Library, VerbsError>> = std::sync::OnceLock::new();
        LIB.get_or_init(|| load(&super::library())).as_ref().map_err(Clone::clone)
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(VerbsError::NotBuilt)
    }
}

#[cfg_attr(not(feature = "rdma"), allow(dead_code, reason = "loads only with the feature"))]
pub(super) fn load(name: &str) -> Result<Library, VerbsError> {
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
            alloc_pd: std::mem::transmute::<*mut c_void, AllocPd>(need(c"ibv_alloc_pd")?),
            dealloc_pd: std::mem::transmute::<*mut c_void, DeallocPd>(need(c"ibv_dealloc_pd")?),
            reg_mr: std::mem::transmute::<*mut c_void, RegMr>(need(c"ibv_reg_mr")?),
            dereg_mr: std::mem::transmute::<*mut c_void, DeregMr>(need(c"ibv_dereg_mr")?),
            create_comp_channel: std::mem::transmute::<*mut c_void, CreateCompChannel>(need(
                c"ibv_create_comp_channel",
            )?),
            destroy_comp_channel: std::mem::transmute::<*mut c_void, DestroyCompChannel>(need(
                c"ibv_destroy_comp_channel",
            )?),
            create_cq: std::mem::transmute::<*mut c_void, CreateCq>(need(c"ibv_create_cq")?),
            destroy_cq: std::mem::transmute::<*mut c_void, DestroyCq>(need(c"ibv_destroy_cq")?),
            get_cq_event: std::mem::transmute::<*mut c_void, GetCqEvent>(need(c"ibv_get_cq_event")?),
            ack_cq_events: std::mem::transmute::<*mut c_void, AckCqEvents>(need(c"ibv_ack_cq_events")?),
            create_qp: std::mem::transmute::<*mut c_void, CreateQp>(need(c"ibv_create_qp")?),
            modify_qp: std::mem::transmute::<*mut c_void, ModifyQp>(need(c"ibv_modify_qp")?),
            destroy_qp: std::mem::transmute::<*mut c_void, DestroyQp>(need(c"ibv_destroy_qp")?),
            reg_dmabuf_mr: sym(c"ibv_reg_dmabuf_mr").map(|p| std::mem::transmute::<*mut c_void, RegDmabufMr>(p)),
            get_async_event: std::mem::transmute::<*mut c_void, GetAsyncEvent>(need(c"ibv_get_async_event")?),
            ack_async_event: std::mem::transmute::<*mut c_void, AckAsyncEvent>(need(c"ibv_ack_async_event")?),
        })
    }
}

pub(super) fn failed(call: &'static str, errno: c_int) -> VerbsError {
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
    Ok(Nic { numa_node: super::numa_node(&name), pci_path: super::pci_path(&name), name, guid, firmware, ports })
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
