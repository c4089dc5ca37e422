//! `orbite-verbs-shim`: a test-only stand-in for `libibverbs.so.1`, the
//! RDMA verbs library, so machines without RDMA NICs run the engine's
//! verbs code for real. `scripts/verbs-shim` builds it and makes a
//! directory holding a `libibverbs.so.1` link to it; the engine loads it
//! from there (`LD_LIBRARY_PATH`) or from `ORBITE_IBVERBS_LIB`.
//!
//! # What it models
//!
//! Devices, their ports and GID tables, from `ORBITE_VERBS_SHIM_DEVICES`
//! (read once, at the first `ibv_get_device_list`): a JSON array of
//! devices,
//!
//! ```json
//! [{"name": "mlx5_0", "guid": "0x0002c90300a1b2c3", "ports": [
//!     {"state": "active", "link_layer": "ethernet", "mtu": 4096,
//!      "gids": [{"gid": "fe80::1", "type": "roce-v1", "netdev": "lo"},
//!               {"gid": "::ffff:127.0.0.1", "type": "roce-v2", "netdev": "lo"}]}]}]
//! ```
//!
//! `state`: `down`, `init`, `armed` or `active`; `link_layer`: `ethernet`
//! or `infiniband`; `mtu`: 256 to 4096; a GID's `type`: `ib`, `roce-v1`
//! or `roce-v2`. Unset, there is one device, `shim0`, as in the example.
//! An empty array is a library with no device; a description that does
//! not parse is no device either, and says why on stderr.
//!
//! Protection domains, memory regions (distinct lkeys and rkeys, access
//! flags, bounds; no access through a key once `ibv_dereg_mr` returned),
//! completion queues with their channels (events, overrun), and RC queue
//! pairs through RESET, INIT, RTR, RTS and ERR with the attributes each
//! transition requires ([`verbs`]); RDMA WRITE, WRITE with immediate,
//! READ and SEND/RECV between queue pairs of any processes that reach
//! each other over IPv4, network namespaces included ([`fabric`]):
//! signaled and unsignaled requests, error completions even when
//! unsignaled, the queue pair to ERR and what follows flushed.
//!
//! Exports: the device, port and GID calls (`ibv_get_device_list`,
//! `ibv_free_device_list`, `ibv_get_device_name`, `ibv_get_device_guid`,
//! `ibv_open_device`, `ibv_close_device`, `ibv_query_device`,
//! `ibv_query_port`, `ibv_query_gid`, `_ibv_query_gid_ex`), the object
//! calls, and the context's `poll_cq`, `req_notify_cq`, `post_send` and
//! `post_recv` ops (every other op answers EOPNOTSUPP), with rdma-core's
//! signatures and return conventions (NULL and `errno` for the calls that
//! make objects, an errno value for queries and destroys, -1 for
//! `ibv_query_gid` and `ibv_get_cq_event`). `orbite_verbs_shim_stats`
//! counts what is open, so tests can check that the engine closes
//! everything it opens.
//!
//! Async events (`ibv_get_async_event` on the context's `async_fd`): a
//! queue pair gone fatal, a completion queue overrun, a port down or back.
//! Faults a test injects ([`faults`]): a queue pair to ERR, its next
//! request failing with retry exceeded or a remote access error, its
//! completions held or its requests delayed, a port taken down.
//!
//! dma-buf regions (`ibv_reg_dmabuf_mr`): the shim maps the dma-buf itself
//! from its file position (where `orbite-cuda-shim`'s export starts) plus
//! the offset, so RDMA reaches device memory the process cannot touch; a
//! device described with `"dmabuf": false` answers EOPNOTSUPP.
//!
//! # Safety
//!
//! The exports are `unsafe extern "C"`: callers pass pointers that are
//! null or valid as rdma-core documents for each parameter.

#![allow(clippy::missing_safety_doc)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod abi;
pub mod fabric;
pub mod faults;
pub mod verbs;

use std::ffi::{c_char, c_int};
use std::net::Ipv6Addr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, Ordering};

use abi::{IbvContext, IbvContextOps, IbvDevice, IbvDeviceAttr, IbvGidEntry, IbvPortAttrCompat};

/// One port of a described device.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PortDesc {
    state: String,
    #[serde(default = "ethernet")]
    link_layer: String,
    #[serde(default = "mtu_4096")]
    pub(crate) mtu: u32,
    #[serde(default)]
    pub(crate) gids: Vec<GidDesc>,
}

fn ethernet() -> String {
    "ethernet".into()
}

fn mtu_4096() -> u32 {
    4096
}

/// One GID table entry.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GidDesc {
    pub(crate) gid: Ipv6Addr,
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    netdev: Option<String>,
}

/// One described device.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceDesc {
    name: String,
    #[serde(default)]
    guid: Option<String>,
    ports: Vec<PortDesc>,
    /// Whether it takes dma-buf regions (GPUDirect without peermem).
    #[serde(default = "yes")]
    dmabuf: bool,
}

fn yes() -> bool {
    true
}

/// A device as handed out: its `ibv_device` first, so the pointer is both.
#[repr(C)]
struct Device {
    dev: IbvDevice,
    desc: DeviceDesc,
    guid: u64,
}

/// An opened device: its `ibv_context` first.
#[repr(C)]
pub(crate) struct Context {
    ctx: IbvContext,
    device: *const Device,
    /// Async events not yet taken; `async_fd` counts them.
    events: std::sync::Mutex<std::collections::VecDeque<abi::IbvAsyncEvent>>,
}

impl Context {
    /// Queues an async event (`element`: a QP or CQ pointer, or a port).
    pub(crate) fn post_event(&self, event_type: i32, element: usize) {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).push_back(abi::IbvAsyncEvent {
            element,
            event_type,
            _pad: 0,
        });
        let one = 1u64.to_ne_bytes();
        // SAFETY: 8 bytes into the context's eventfd.
        unsafe { libc::write(self.ctx.async_fd, one.as_ptr() as *const libc::c_void, 8) };
    }

    /// Whether its device takes dma-buf regions.
    pub(crate) fn dmabuf(&self) -> bool {
        // SAFETY: the device outlives every context.
        unsafe { &*self.device }.desc.dmabuf
    }

    /// The index of its device among the described ones.
    pub(crate) fn device_index(&self) -> usize {
        devices().iter().position(|d| std::ptr::eq(d, self.device)).unwrap_or(usize::MAX)
    }
}

/// Every open context, for events that concern a device (a port down).
pub(crate) fn contexts() -> &'static std::sync::Mutex<Vec<usize>> {
    static C: OnceLock<std::sync::Mutex<Vec<usize>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// What is open now (for tests).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ShimStats {
    /// Device lists handed out and not freed.
    pub device_lists: i64,
    /// Contexts opened and not closed.
    pub contexts: i64,
    /// Protection domains, memory regions, completion queues, completion
    /// channels and queue pairs not destroyed.
    pub pds: i64,
    pub mrs: i64,
    pub cqs: i64,
    pub channels: i64,
    pub qps: i64,
}

static LISTS: AtomicI64 = AtomicI64::new(0);
static CONTEXTS: AtomicI64 = AtomicI64::new(0);

/// The described devices, made once for the process's life (rdma-core's
/// devices live as long as the library).
fn devices() -> &'static [Device] {
    static DEVICES: OnceLock<Vec<Device>> = OnceLock::new();
    DEVICES.get_or_init(|| {
        let descs: Vec<DeviceDesc> = match std::env::var("ORBITE_VERBS_SHIM_DEVICES") {
            Err(_) => vec![DeviceDesc {
                name: "shim0".into(),
                guid: None,
                dmabuf: true,
                ports: vec![PortDesc {
                    state: "active".into(),
                    link_layer: ethernet(),
                    mtu: 4096,
                    gids: vec![
                        GidDesc {
                            gid: "fe80::1".parse().expect("a literal"),
                            kind: "roce-v1".into(),
                            netdev: Some("lo".into()),
                        },
                        GidDesc {
                            gid: Ipv6Addr::from([0, 0, 0, 0, 0, 0xffff, 0x7f00, 1]),
                            kind: "roce-v2".into(),
                            netdev: Some("lo".into()),
                        },
                    ],
                }],
            }],
            Ok(text) => match serde_json::from_str(&text) {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("orbite-verbs-shim: ORBITE_VERBS_SHIM_DEVICES does not parse ({e}): no devices");
                    Vec::new()
                }
            },
        };
        descs
            .into_iter()
            .enumerate()
            .map(|(i, desc)| {
                let guid = desc
                    .guid
                    .as_deref()
                    .and_then(|g| u64::from_str_radix(g.trim_start_matches("0x"), 16).ok())
                    .unwrap_or(0x0002_c903_0000_0000 + i as u64);
                let mut dev = IbvDevice {
                    ops: [0; 2],
                    node_type: 1,
                    transport_type: 0,
                    name: [0; 64],
                    dev_name: [0; 64],
                    dev_path: [0; 256],
                    ibdev_path: [0; 256],
                };
                fill(&mut dev.name, &desc.name);
                fill(&mut dev.dev_name, &format!("uverbs{i}"));
                fill(&mut dev.dev_path, &format!("/sys/class/infiniband_verbs/uverbs{i}"));
                fill(&mut dev.ibdev_path, &format!("/sys/class/infiniband/{}", desc.name));
                Device { dev, desc, guid }
            })
            .collect()
    })
}

/// Copies `s` into a NUL-terminated C array, cut to fit.
fn fill(out: &mut [u8], s: &str) {
    let n = s.len().min(out.len() - 1);
    out[..n].copy_from_slice(&s.as_bytes()[..n]);
    out[n] = 0;
}

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = e };
}

/// `ibv_get_device_list`: a NULL-terminated array of every device (still
/// an array, with `*num` 0, when there is none).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut IbvDevice {
    let devs = devices();
    let mut list: Vec<*mut IbvDevice> = devs.iter().map(|d| d as *const Device as *mut IbvDevice).collect();
    list.push(std::ptr::null_mut());
    if !num.is_null() {
        // SAFETY: the caller's int.
        unsafe { *num = devs.len() as c_int };
    }
    LISTS.fetch_add(1, Ordering::Relaxed);
    Box::into_raw(list.into_boxed_slice()) as *mut *mut IbvDevice
}

/// `ibv_free_device_list`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut IbvDevice) {
    if list.is_null() {
        return;
    }
    let n = devices().len() + 1;
    // SAFETY: made by ibv_get_device_list as a boxed slice of n entries.
    drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(list, n)) });
    LISTS.fetch_sub(1, Ordering::Relaxed);
}

/// The shim's device behind `dev`, if it is one of them.
fn device(dev: *const IbvDevice) -> Option<&'static Device> {
    devices().iter().find(|d| std::ptr::eq(&d.dev, dev))
}

/// `ibv_get_device_name`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_device_name(dev: *mut IbvDevice) -> *const c_char {
    match device(dev) {
        Some(d) => d.dev.name.as_ptr() as *const c_char,
        None => {
            set_errno(libc::EINVAL);
            std::ptr::null()
        }
    }
}

/// `ibv_get_device_guid`: big endian, 0 for an unknown device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_device_guid(dev: *mut IbvDevice) -> u64 {
    device(dev).map_or(0, |d| d.guid.to_be())
}

/// Every context op the shim does not implement yet.
unsafe extern "C" fn not_supported() -> c_int {
    libc::EOPNOTSUPP
}

/// `ibv_open_device`: a context with a pollable async event descriptor.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_open_device(dev: *mut IbvDevice) -> *mut IbvContext {
    let Some(d) = device(dev) else {
        set_errno(libc::ENODEV);
        return std::ptr::null_mut();
    };
    // SAFETY: plain calls; the descriptors are the context's.
    let (cmd_fd, async_fd) = unsafe {
        (
            libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK),
            // Blocking, as rdma-core's: one read takes one event.
            libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE),
        )
    };
    if cmd_fd < 0 || async_fd < 0 {
        // SAFETY: closing what was made, if it was.
        unsafe {
            libc::close(cmd_fd);
            libc::close(async_fd);
        }
        set_errno(libc::EMFILE);
        return std::ptr::null_mut();
    }
    let stub: unsafe extern "C" fn() -> c_int = not_supported;
    // SAFETY: every slot is called, if ever, through a pointer of its own
    // C signature; the stub takes nothing and returns an int, which every
    // caller of an op reads as EOPNOTSUPP.
    let stub: unsafe extern "C" fn() = unsafe { std::mem::transmute(stub) };
    let mut slots = [Some(stub); 32];
    // SAFETY: each op has its own C signature, as verbs.h calls it.
    unsafe {
        slots[11] =
            Some(std::mem::transmute::<unsafe extern "C" fn(_, _, _) -> c_int, unsafe extern "C" fn()>(verbs::poll_cq));
        slots[12] = Some(std::mem::transmute::<unsafe extern "C" fn(_, _) -> c_int, unsafe extern "C" fn()>(
            verbs::req_notify_cq,
        ));
        slots[25] = Some(std::mem::transmute::<unsafe extern "C" fn(_, _, _) -> c_int, unsafe extern "C" fn()>(
            verbs::post_send,
        ));
        slots[26] = Some(std::mem::transmute::<unsafe extern "C" fn(_, _, _) -> c_int, unsafe extern "C" fn()>(
            verbs::post_recv,
        ));
    }
    let ctx = Box::new(Context {
        ctx: IbvContext {
            device: dev,
            ops: IbvContextOps { slots },
            cmd_fd,
            async_fd,
            num_comp_vectors: 1,
            _pad: 0,
            mutex: libc::PTHREAD_MUTEX_INITIALIZER,
            abi_compat: std::ptr::null_mut(),
        },
        device: d,
        events: Default::default(),
    });
    CONTEXTS.fetch_add(1, Ordering::Relaxed);
    let raw = Box::into_raw(ctx);
    contexts().lock().unwrap_or_else(|e| e.into_inner()).push(raw as usize);
    raw as *mut IbvContext
}

/// The shim's context behind `ctx`.
///
/// # Safety
/// `ctx` is null or was returned by [`ibv_open_device`] and not closed.
unsafe fn context<'a>(ctx: *mut IbvContext) -> Option<&'a Context> {
    // SAFETY: per the contract, a live Context (its ibv_context first).
    unsafe { (ctx as *const Context).as_ref() }
}

/// `ibv_close_device`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_close_device(ctx: *mut IbvContext) -> c_int {
    if ctx.is_null() {
        return libc::EINVAL;
    }
    contexts().lock().unwrap_or_else(|e| e.into_inner()).retain(|&c| c != ctx as usize);
    // SAFETY: made by ibv_open_device, closed once (the caller's contract).
    let c = unsafe { Box::from_raw(ctx as *mut Context) };
    // SAFETY: the context's own descriptors.
    unsafe {
        libc::close(c.ctx.cmd_fd);
        libc::close(c.ctx.async_fd);
    }
    CONTEXTS.fetch_sub(1, Ordering::Relaxed);
    0
}

/// `ibv_query_device`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_device(ctx: *mut IbvContext, attr: *mut IbvDeviceAttr) -> c_int {
    // SAFETY: the caller's context.
    let Some(c) = (unsafe { context(ctx) }) else { return libc::EINVAL };
    if attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the device outlives every context.
    let d = unsafe { &*c.device };
    // SAFETY: zero is a valid value of every field.
    let mut a: IbvDeviceAttr = unsafe { std::mem::zeroed() };
    fill(&mut a.fw_ver, "orbite-verbs-shim 1");
    a.node_guid = d.guid.to_be();
    a.sys_image_guid = d.guid.to_be();
    a.max_mr_size = u64::MAX;
    a.page_size_cap = 0xffff_f000;
    a.max_qp = 4096;
    a.max_qp_wr = 16384;
    a.max_sge = 30;
    a.max_sge_rd = 30;
    a.max_cq = 4096;
    a.max_cqe = 1 << 22;
    a.max_mr = 1 << 20;
    a.max_pd = 1024;
    a.max_qp_rd_atom = 16;
    a.max_res_rd_atom = 1 << 16;
    a.max_qp_init_rd_atom = 16;
    a.max_pkeys = 128;
    a.local_ca_ack_delay = 16;
    a.phys_port_cnt = d.desc.ports.len().min(255) as u8;
    // SAFETY: the caller's struct.
    unsafe { attr.write(a) };
    0
}

/// The described port `port_num` (1-based) of a context's device.
pub(crate) fn port(c: &Context, port_num: u8) -> Option<&'static PortDesc> {
    // SAFETY: the device outlives every context.
    let d: &'static Device = unsafe { &*c.device };
    d.desc.ports.get((port_num as usize).checked_sub(1)?)
}

/// `ibv_query_port`: writes the 48 bytes every caller's struct has.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_port(ctx: *mut IbvContext, port_num: u8, attr: *mut IbvPortAttrCompat) -> c_int {
    // SAFETY: the caller's context.
    let Some(c) = (unsafe { context(ctx) }) else { return libc::EINVAL };
    let Some(p) = port(c, port_num) else { return libc::EINVAL };
    if attr.is_null() {
        return libc::EINVAL;
    }
    let down = crate::faults::port_down(c.device_index(), port_num);
    let state = match p.state.as_str() {
        _ if down => 1,
        "down" => 1,
        "init" => 2,
        "armed" => 3,
        "active" => 4,
        _ => 0,
    };
    let mtu = match p.mtu {
        256 => 1,
        512 => 2,
        1024 => 3,
        2048 => 4,
        _ => 5,
    };
    // SAFETY: zero is a valid value of every field.
    let mut a: IbvPortAttrCompat = unsafe { std::mem::zeroed() };
    a.state = state;
    a.max_mtu = 5;
    a.active_mtu = mtu;
    a.gid_tbl_len = p.gids.len().max(1) as i32;
    a.max_msg_sz = 1 << 30;
    a.pkey_tbl_len = 1;
    a.active_width = 2; // 4x
    a.active_speed = 128; // HDR
    a.phys_state = if state == 4 { 5 } else { 3 }; // link up, or disabled
    a.link_layer = if p.link_layer == "infiniband" { 1 } else { 2 };
    // SAFETY: the caller's struct, of at least these 48 bytes.
    unsafe { attr.write(a) };
    0
}

/// The GID entry `index` of `port_num`, or why not (an errno value).
fn gid(c: &Context, port_num: u8, index: c_int) -> Result<Option<&'static GidDesc>, c_int> {
    let p = port(c, port_num).ok_or(libc::EINVAL)?;
    let i = usize::try_from(index).map_err(|_| libc::EINVAL)?;
    if i >= p.gids.len().max(1) {
        return Err(libc::EINVAL);
    }
    Ok(p.gids.get(i))
}

/// `ibv_query_gid`: an empty entry reads as all zeros.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_gid(ctx: *mut IbvContext, port_num: u8, index: c_int, out: *mut [u8; 16]) -> c_int {
    // SAFETY: the caller's context.
    let Some(c) = (unsafe { context(ctx) }) else { return -1 };
    match gid(c, port_num, index) {
        Ok(g) if !out.is_null() => {
            // SAFETY: the caller's 16 bytes.
            unsafe { out.write(g.map_or([0; 16], |g| g.gid.octets())) };
            0
        }
        Ok(_) => -1,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

/// `_ibv_query_gid_ex` (what the inline `ibv_query_gid_ex` calls): the
/// entry with its type and network device; ENODATA for an empty one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    ctx: *mut IbvContext,
    port_num: u32,
    index: u32,
    entry: *mut IbvGidEntry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    // SAFETY: the caller's context.
    let Some(c) = (unsafe { context(ctx) }) else { return libc::EINVAL };
    if flags != 0 || entry.is_null() || entry_size < size_of::<IbvGidEntry>() {
        return libc::EINVAL;
    }
    let Ok(port_num) = u8::try_from(port_num) else { return libc::EINVAL };
    let g = match gid(c, port_num, index.min(i32::MAX as u32) as c_int) {
        Ok(Some(g)) => g,
        Ok(None) => return libc::ENODATA,
        Err(e) => return e,
    };
    let gid_type = match g.kind.as_str() {
        "roce-v1" => 1,
        "roce-v2" => 2,
        _ => 0,
    };
    let ndev_ifindex = g.netdev.as_deref().map_or(0, |n| {
        let name = std::ffi::CString::new(n).unwrap_or_default();
        // SAFETY: a NUL-terminated name.
        unsafe { libc::if_nametoindex(name.as_ptr()) }
    });
    // SAFETY: the caller's entry, of at least this size.
    unsafe {
        entry.write(IbvGidEntry {
            gid: g.gid.octets(),
            gid_index: index,
            port_num: port_num as u32,
            gid_type,
            ndev_ifindex,
        })
    };
    0
}

/// `ibv_get_async_event`: waits for the next async event of the context
/// (as rdma-core's, blocking unless `async_fd` was made non-blocking).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_async_event(ctx: *mut IbvContext, event: *mut abi::IbvAsyncEvent) -> c_int {
    // SAFETY: the caller's context.
    let Some(c) = (unsafe { context(ctx) }) else { return -1 };
    let mut n = [0u8; 8];
    // SAFETY: 8 bytes from the context's eventfd (a semaphore: one event).
    if event.is_null() || unsafe { libc::read(c.ctx.async_fd, n.as_mut_ptr() as *mut libc::c_void, 8) } != 8 {
        return -1;
    }
    let Some(e) = c.events.lock().unwrap_or_else(|e| e.into_inner()).pop_front() else { return -1 };
    // SAFETY: the caller's struct.
    unsafe { event.write(e) };
    0
}

/// `ibv_ack_async_event`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_ack_async_event(_event: *mut abi::IbvAsyncEvent) {}

/// The shim's counters of what is open now.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_verbs_shim_stats(out: *mut ShimStats) -> c_int {
    if out.is_null() {
        return libc::EINVAL;
    }
    let s = ShimStats {
        device_lists: LISTS.load(Ordering::Relaxed),
        contexts: CONTEXTS.load(Ordering::Relaxed),
        pds: verbs::PDS.load(Ordering::Relaxed),
        mrs: verbs::MRS.load(Ordering::Relaxed),
        cqs: verbs::CQS.load(Ordering::Relaxed),
        channels: verbs::CHANNELS.load(Ordering::Relaxed),
        qps: verbs::QPS.load(Ordering::Relaxed),
    };
    // SAFETY: the caller's struct.
    unsafe { out.write(s) };
    0
}
