//! Protection domains, memory regions, completion queues and channels,
//! and RC queue pairs: the objects an engine makes, with rdma-core's
//! return conventions and the checks a NIC makes (keys, access flags,
//! bounds, state transitions). The data path between queue pairs is in
//! [`crate::fabric`].

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};

use crate::abi::*;
use crate::{Context, set_errno};

pub const ACCESS_LOCAL_WRITE: u32 = 1;
pub const ACCESS_REMOTE_WRITE: u32 = 2;
pub const ACCESS_REMOTE_READ: u32 = 4;
pub const ACCESS_REMOTE_ATOMIC: u32 = 8;

pub const QPS_RESET: i32 = 0;
pub const QPS_INIT: i32 = 1;
pub const QPS_RTR: i32 = 2;
pub const QPS_RTS: i32 = 3;
pub const QPS_ERR: i32 = 6;

const MASK_STATE: c_int = 1;
const MASK_ACCESS_FLAGS: c_int = 1 << 3;
const MASK_PKEY_INDEX: c_int = 1 << 4;
const MASK_PORT: c_int = 1 << 5;
const MASK_AV: c_int = 1 << 7;
const MASK_PATH_MTU: c_int = 1 << 8;
const MASK_TIMEOUT: c_int = 1 << 9;
const MASK_RETRY_CNT: c_int = 1 << 10;
const MASK_RNR_RETRY: c_int = 1 << 11;
const MASK_RQ_PSN: c_int = 1 << 12;
const MASK_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
const MASK_MIN_RNR_TIMER: c_int = 1 << 15;
const MASK_SQ_PSN: c_int = 1 << 16;
const MASK_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
const MASK_DEST_QPN: c_int = 1 << 20;

pub const WR_RDMA_WRITE: i32 = 0;
pub const WR_RDMA_WRITE_WITH_IMM: i32 = 1;
pub const WR_SEND: i32 = 2;
pub const WR_SEND_WITH_IMM: i32 = 3;
pub const WR_RDMA_READ: i32 = 4;
const SEND_SIGNALED: u32 = 2;

pub const WC_SEND: i32 = 0;
pub const WC_RDMA_WRITE: i32 = 1;
pub const WC_RDMA_READ: i32 = 2;
pub const WC_RECV: i32 = 128;
pub const WC_RECV_RDMA_WITH_IMM: i32 = 129;
pub const WC_WITH_IMM: u32 = 2;

/// `IBV_EVENT_CQ_ERR`.
const EVENT_CQ_ERR: i32 = 0;

pub const WC_SUCCESS: i32 = 0;
pub const WC_LOC_LEN_ERR: i32 = 1;
pub const WC_LOC_PROT_ERR: i32 = 4;
pub const WC_WR_FLUSH_ERR: i32 = 5;
pub const WC_REM_INV_REQ_ERR: i32 = 9;
pub const WC_REM_ACCESS_ERR: i32 = 10;
pub const WC_REM_OP_ERR: i32 = 11;
pub const WC_RETRY_EXC_ERR: i32 = 12;
pub const WC_RNR_RETRY_EXC_ERR: i32 = 13;

/// Counts of live objects, for [`crate::ShimStats`].
pub static PDS: AtomicI64 = AtomicI64::new(0);
pub static MRS: AtomicI64 = AtomicI64::new(0);
pub static CQS: AtomicI64 = AtomicI64::new(0);
pub static CHANNELS: AtomicI64 = AtomicI64::new(0);
pub static QPS: AtomicI64 = AtomicI64::new(0);

/// A registered region, as the keys find it.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    /// Its first address as requests name it (the iova).
    pub addr: u64,
    pub len: u64,
    pub access: u32,
    /// The protection domain (its address).
    pub pd: usize,
    /// Where its bytes are in this process: `addr` for memory registered
    /// by address, the shim's own mapping of a dma-buf otherwise.
    pub host: u64,
}

impl Region {
    /// The address in this process of `addr` (inside the region).
    pub fn at(&self, addr: u64) -> *mut u8 {
        (self.host + (addr - self.addr)) as *mut u8
    }
}

/// Every live region by key. Copies into or out of a region hold the read
/// lock while they touch its memory, so deregistration (the write lock)
/// waits for them: no access through a key outlives `ibv_dereg_mr`.
#[derive(Default)]
pub struct Regions {
    pub by_lkey: HashMap<u32, Region>,
    pub by_rkey: HashMap<u32, Region>,
}

pub fn regions() -> &'static RwLock<Regions> {
    static R: OnceLock<RwLock<Regions>> = OnceLock::new();
    R.get_or_init(Default::default)
}

impl Regions {
    /// The local range `[addr, addr + len)` of a scatter/gather entry
    /// under its lkey, in protection domain `pd`, writable if `write`.
    pub fn local(&self, sge: &IbvSge, pd: usize, write: bool) -> Option<Region> {
        let r = *self.by_lkey.get(&sge.lkey)?;
        let inside = sge.addr >= r.addr && sge.addr.checked_add(sge.length as u64)? <= r.addr + r.len;
        (inside && r.pd == pd && (!write || r.access & ACCESS_LOCAL_WRITE != 0)).then_some(r)
    }

    /// The region of the remote range under `rkey` with `access`, in `pd`.
    pub fn remote(&self, rkey: u32, addr: u64, len: u64, access: u32, pd: usize) -> Option<Region> {
        let r = *self.by_rkey.get(&rkey)?;
        let inside = addr >= r.addr && addr.checked_add(len).is_some_and(|end| end <= r.addr + r.len);
        (inside && r.pd == pd && r.access & access == access).then_some(r)
    }
}

/// A protection domain as handed out.
#[repr(C)]
pub struct Pd {
    pub ibv: IbvPd,
    /// Regions and queue pairs made in it and not yet destroyed.
    pub users: AtomicI64,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_alloc_pd(ctx: *mut IbvContext) -> *mut IbvPd {
    if ctx.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    PDS.fetch_add(1, Ordering::Relaxed);
    Box::into_raw(Box::new(Pd { ibv: IbvPd { context: ctx, handle: next_handle() }, users: AtomicI64::new(0) }))
        as *mut IbvPd
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut IbvPd) -> c_int {
    // SAFETY: a live protection domain (the caller's contract).
    let Some(p) = (unsafe { (pd as *const Pd).as_ref() }) else { return libc::EINVAL };
    if p.users.load(Ordering::Acquire) != 0 {
        return libc::EBUSY;
    }
    // SAFETY: made by ibv_alloc_pd, freed once.
    drop(unsafe { Box::from_raw(pd as *mut Pd) });
    PDS.fetch_sub(1, Ordering::Relaxed);
    0
}

fn next_handle() -> u32 {
    static H: AtomicU32 = AtomicU32::new(1);
    H.fetch_add(1, Ordering::Relaxed)
}

/// Keys: distinct lkeys and rkeys, never reused in a process.
fn next_keys() -> (u32, u32) {
    static K: AtomicU32 = AtomicU32::new(0x100);
    let k = K.fetch_add(1, Ordering::Relaxed);
    (k << 8 | 0x11, k << 8 | 0x22)
}

/// A memory region as handed out, with the shim's mapping of a dma-buf.
#[repr(C)]
pub struct Mr {
    pub ibv: IbvMr,
    mapped: Option<(usize, usize)>,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_reg_mr(pd: *mut IbvPd, addr: *mut c_void, length: usize, access: c_int) -> *mut IbvMr {
    // SAFETY: the caller's arguments, passed on.
    unsafe { ibv_reg_mr_iova2(pd, addr, length, addr as u64, access as u32) }
}

/// `ibv_reg_mr_iova2`: the shim takes `iova` equal to `addr` only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> *mut IbvMr {
    // SAFETY: a live protection domain (the caller's contract).
    let Some(p) = (unsafe { (pd as *const Pd).as_ref() }) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    // Optional access bits (20 to 29) are accepted and ignored.
    let access = access & !0x3ff0_0000;
    let needs_local_write = access & (ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC) != 0;
    if addr.is_null() || length == 0 || iova != addr as u64 || (needs_local_write && access & ACCESS_LOCAL_WRITE == 0) {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // Memory the process cannot touch (the CUDA shim's device memory) is
    // registered as nvidia-peermem registers GPU memory, when it is
    // loaded; without it the kernel cannot pin the pages (EFAULT).
    if !accessible(addr as u64) {
        return match peermem_pages(addr as u64, length as u64) {
            Some((m, map_len, host)) => {
                let region = Region { addr: addr as u64, len: length as u64, access, pd: pd as usize, host };
                new_mr(p, pd, region, Some((m, map_len)))
            }
            None => {
                set_errno(libc::EFAULT);
                std::ptr::null_mut()
            }
        };
    }
    let region = Region { addr: addr as u64, len: length as u64, access, pd: pd as usize, host: addr as u64 };
    new_mr(p, pd, region, None)
}

/// Whether this process can read the byte at `addr`.
fn accessible(addr: u64) -> bool {
    let mut byte = 0u8;
    let local = libc::iovec { iov_base: (&mut byte as *mut u8).cast(), iov_len: 1 };
    let remote = libc::iovec { iov_base: addr as *mut c_void, iov_len: 1 };
    // SAFETY: one byte into a local; the kernel checks the remote address.
    unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) == 1 }
}

/// Whether nvidia-peermem (or nv_peer_mem) is loaded, as the engine reads
/// it: under `ORBITE_SYSFS_ROOT` (default `/sys`).
fn peermem_loaded() -> bool {
    let root = std::env::var_os("ORBITE_SYSFS_ROOT").map_or_else(|| "/sys".into(), std::path::PathBuf::from);
    root.join("module/nvidia_peermem").exists() || root.join("module/nv_peer_mem").exists()
}

/// nvidia-peermem as the shim models it: the CUDA driver (the CUDA shim,
/// when this process loaded it) resolves `[addr, addr + len)` to its
/// allocation's pages, which the shim maps: the mapping, its length, and
/// where `addr` is in it.
fn peermem_pages(addr: u64, len: u64) -> Option<(usize, usize, u64)> {
    if !peermem_loaded() {
        return None;
    }
    type Range = unsafe extern "C" fn(*mut u64, *mut usize, u64) -> c_int;
    type Handle = unsafe extern "C" fn(*mut c_void, u64, usize, c_int, u64) -> c_int;
    // SAFETY: a NUL-terminated name; only an already loaded library.
    let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if lib.is_null() {
        return None;
    }
    // SAFETY: a live handle and NUL-terminated names.
    let (range, handle) = unsafe {
        (
            libc::dlsym(lib, c"cuMemGetAddressRange_v2".as_ptr()),
            libc::dlsym(lib, c"cuMemGetHandleForAddressRange".as_ptr()),
        )
    };
    if range.is_null() || handle.is_null() {
        return None;
    }
    // SAFETY: the driver API's signatures.
    let (range, handle) = unsafe {
        (std::mem::transmute::<*mut c_void, Range>(range), std::mem::transmute::<*mut c_void, Handle>(handle))
    };
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: two out-values.
    if unsafe { range(&mut base, &mut size, addr) } != 0 || addr.checked_add(len)? > base + size as u64 {
        return None;
    }
    let page = 4096u64;
    let mut fd: c_int = -1;
    // SAFETY: an int for the descriptor (1: a dma-buf).
    if unsafe {
        handle((&mut fd as *mut c_int).cast(), base, (size as u64).div_ceil(page) as usize * page as usize, 1, 0)
    } != 0
    {
        return None;
    }
    // SAFETY: the descriptor the driver gave; its position is where the
    // allocation starts.
    let start = unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) };
    let mapped = u64::try_from(start).ok().and_then(|s| map_pages(fd, s + (addr - base), len));
    // SAFETY: the descriptor the driver gave, closed once (a mapping keeps
    // the pages).
    unsafe { libc::close(fd) };
    mapped
}

/// Makes the region `region` of `p` (whose mapping `mapped` the shim
/// unmaps at deregistration).
fn new_mr(p: &Pd, pd: *mut IbvPd, region: Region, mapped: Option<(usize, usize)>) -> *mut IbvMr {
    let (lkey, rkey) = next_keys();
    {
        let mut r = regions().write().unwrap_or_else(|e| e.into_inner());
        r.by_lkey.insert(lkey, region);
        r.by_rkey.insert(rkey, region);
    }
    p.users.fetch_add(1, Ordering::AcqRel);
    MRS.fetch_add(1, Ordering::Relaxed);
    let ibv = IbvMr {
        context: p.ibv.context,
        pd,
        addr: region.addr as *mut c_void,
        length: region.len as usize,
        handle: next_handle(),
        lkey,
        rkey,
    };
    Box::into_raw(Box::new(Mr { ibv, mapped })) as *mut IbvMr
}

/// `ibv_reg_dmabuf_mr`: a region of a dma-buf (`fd`, from `offset`), named
/// by requests from `iova`. The shim maps the dma-buf itself, from its
/// file position (where the CUDA shim's export starts; 0 for a real one)
/// plus `offset`, so requests reach the memory without the process
/// touching it. `fd` -1 answers EBADF (the probe that dma-buf is
/// supported), or EOPNOTSUPP on a device described with `"dmabuf": false`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_reg_dmabuf_mr(
    pd: *mut IbvPd,
    offset: u64,
    length: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut IbvMr {
    let fail = |e| {
        set_errno(e);
        std::ptr::null_mut()
    };
    // SAFETY: a live protection domain (the caller's contract).
    let Some(p) = (unsafe { (pd as *const Pd).as_ref() }) else { return fail(libc::EINVAL) };
    // SAFETY: the domain's context is live while it is.
    let ctx = unsafe { &*(p.ibv.context as *const Context) };
    if !ctx.dmabuf() {
        return fail(libc::EOPNOTSUPP);
    }
    if fd < 0 {
        return fail(libc::EBADF);
    }
    let access = access as u32 & !0x3ff0_0000;
    let allowed = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ | ACCESS_REMOTE_ATOMIC;
    let needs_local_write = access & (ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC) != 0;
    let page = 4096u64;
    if length == 0
        || access & !allowed != 0
        || (needs_local_write && access & ACCESS_LOCAL_WRITE == 0)
        || iova % page != offset % page
    {
        return fail(libc::EINVAL);
    }
    // SAFETY: the caller's descriptor; position and size only.
    let (start, size) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        (libc::lseek(fd, 0, libc::SEEK_CUR), if libc::fstat(fd, &mut st) == 0 { st.st_size } else { -1 })
    };
    let Some(from) = u64::try_from(start).ok().and_then(|s| s.checked_add(offset)) else { return fail(libc::EINVAL) };
    if size < 0 || from.checked_add(length as u64).is_none_or(|end| end > size as u64) {
        return fail(libc::EINVAL);
    }
    let Some((m, map_len, host)) = map_pages(fd, from, length as u64) else { return fail(libc::EINVAL) };
    let region = Region { addr: iova, len: length as u64, access, pd: pd as usize, host };
    new_mr(p, pd, region, Some((m, map_len)))
}

/// Maps `len` bytes of the dma-buf `fd` from file offset `from` (whole
/// pages around them): the mapping, its length, and where `from` is in it.
fn map_pages(fd: c_int, from: u64, len: u64) -> Option<(usize, usize, u64)> {
    let page = 4096u64;
    let skew = from % page;
    let map_len = (skew + len).div_ceil(page) * page;
    // SAFETY: a new shared mapping of the descriptor, placed by the kernel.
    let m = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            (from - skew) as libc::off_t,
        )
    };
    (m != libc::MAP_FAILED).then(|| (m as usize, map_len as usize, m as u64 + skew))
}

/// `ibv_dereg_mr`: once it returns, no access through the keys runs or
/// starts.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut IbvMr) -> c_int {
    if mr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: made by ibv_reg_mr, freed once.
    let m = unsafe { Box::from_raw(mr as *mut Mr) };
    {
        let mut r = regions().write().unwrap_or_else(|e| e.into_inner());
        r.by_lkey.remove(&m.ibv.lkey);
        r.by_rkey.remove(&m.ibv.rkey);
    }
    if let Some((at, len)) = m.mapped {
        // SAFETY: the shim's own mapping; no access through the keys runs
        // now (they are gone, under the write lock).
        unsafe { libc::munmap(at as *mut c_void, len) };
    }
    // SAFETY: the protection domain outlives its regions (dealloc refuses).
    unsafe { &*(m.ibv.pd as *const Pd) }.users.fetch_sub(1, Ordering::AcqRel);
    MRS.fetch_sub(1, Ordering::Relaxed);
    0
}

/// A completion channel as handed out: `fd` is the read end of a pipe
/// that carries the address of each CQ that has an event.
#[repr(C)]
pub struct Channel {
    pub ibv: IbvCompChannel,
    write_fd: c_int,
    pub cqs: AtomicI64,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_comp_channel(ctx: *mut IbvContext) -> *mut IbvCompChannel {
    let mut fds = [0 as c_int; 2];
    // SAFETY: two ints for the pipe.
    if ctx.is_null() || unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    CHANNELS.fetch_add(1, Ordering::Relaxed);
    let ibv = IbvCompChannel { context: ctx, fd: fds[0], refcnt: 0 };
    Box::into_raw(Box::new(Channel { ibv, write_fd: fds[1], cqs: AtomicI64::new(0) })) as *mut IbvCompChannel
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut IbvCompChannel) -> c_int {
    // SAFETY: a live channel (the caller's contract).
    let Some(c) = (unsafe { (ch as *const Channel).as_ref() }) else { return libc::EINVAL };
    if c.cqs.load(Ordering::Acquire) != 0 {
        return libc::EBUSY;
    }
    // SAFETY: made by ibv_create_comp_channel, freed once; its pipe.
    let c = unsafe { Box::from_raw(ch as *mut Channel) };
    // SAFETY: the channel's own descriptors.
    unsafe {
        libc::close(c.ibv.fd);
        libc::close(c.write_fd);
    }
    CHANNELS.fetch_sub(1, Ordering::Relaxed);
    0
}

/// What a completion queue holds.
pub struct CqState {
    pub entries: VecDeque<IbvWc>,
    /// Armed by `req_notify_cq`: the next completion sends an event.
    armed: bool,
    /// More completions came than it holds: it is unusable.
    pub overrun: bool,
}

/// A completion queue as handed out.
#[repr(C)]
pub struct Cq {
    pub ibv: IbvCq,
    pub state: Mutex<CqState>,
    pub capacity: usize,
    /// Queue pairs that complete into it.
    pub qps: AtomicI64,
}

impl Cq {
    /// Adds a completion; an event goes to the channel if armed.
    pub fn push(&self, wc: IbvWc) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.entries.len() >= self.capacity {
            if !s.overrun {
                s.overrun = true;
                // SAFETY: the context outlives its CQs.
                let ctx = unsafe { &*(self.ibv.context as *const Context) };
                ctx.post_event(EVENT_CQ_ERR, self as *const Cq as usize);
            }
            return;
        }
        s.entries.push_back(wc);
        if s.armed && !self.ibv.channel.is_null() {
            s.armed = false;
            // SAFETY: the channel outlives its CQs (destroy refuses).
            let ch = unsafe { &*(self.ibv.channel as *const Channel) };
            let me = (self as *const Cq as usize).to_ne_bytes();
            // SAFETY: 8 bytes into the channel's pipe.
            unsafe { libc::write(ch.write_fd, me.as_ptr() as *const c_void, 8) };
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_cq(
    ctx: *mut IbvContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut IbvCompChannel,
    _comp_vector: c_int,
) -> *mut IbvCq {
    if ctx.is_null() || !(1..=1 << 22).contains(&cqe) {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    if !channel.is_null() {
        // SAFETY: a live channel (the caller's contract).
        unsafe { &*(channel as *const Channel) }.cqs.fetch_add(1, Ordering::AcqRel);
    }
    CQS.fetch_add(1, Ordering::Relaxed);
    let ibv = IbvCq {
        context: ctx,
        channel,
        cq_context,
        handle: next_handle(),
        cqe,
        mutex: libc::PTHREAD_MUTEX_INITIALIZER,
        cond: libc::PTHREAD_COND_INITIALIZER,
        comp_events_completed: 0,
        async_events_completed: 0,
    };
    let state = Mutex::new(CqState { entries: VecDeque::new(), armed: false, overrun: false });
    Box::into_raw(Box::new(Cq { ibv, state, capacity: cqe as usize, qps: AtomicI64::new(0) })) as *mut IbvCq
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut IbvCq) -> c_int {
    // SAFETY: a live CQ (the caller's contract).
    let Some(c) = (unsafe { (cq as *const Cq).as_ref() }) else { return libc::EINVAL };
    if c.qps.load(Ordering::Acquire) != 0 {
        return libc::EBUSY;
    }
    // SAFETY: made by ibv_create_cq, freed once.
    let c = unsafe { Box::from_raw(cq as *mut Cq) };
    if !c.ibv.channel.is_null() {
        // SAFETY: the channel outlives its CQs.
        unsafe { &*(c.ibv.channel as *const Channel) }.cqs.fetch_sub(1, Ordering::AcqRel);
    }
    CQS.fetch_sub(1, Ordering::Relaxed);
    0
}

/// `ibv_get_cq_event`: waits for an event on the channel (a non-blocking
/// descriptor gives -1 with EAGAIN when there is none).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_cq_event(
    ch: *mut IbvCompChannel,
    cq: *mut *mut IbvCq,
    cq_context: *mut *mut c_void,
) -> c_int {
    // SAFETY: a live channel (the caller's contract).
    let Some(c) = (unsafe { (ch as *const Channel).as_ref() }) else { return -1 };
    let mut b = [0u8; 8];
    // SAFETY: 8 bytes from the channel's pipe.
    if unsafe { libc::read(c.ibv.fd, b.as_mut_ptr() as *mut c_void, 8) } != 8 {
        return -1;
    }
    let got = usize::from_ne_bytes(b) as *mut Cq;
    // SAFETY: the caller's out-pointers; the CQ is live until its events
    // are acknowledged (a caller destroys it after that).
    unsafe {
        *cq = got as *mut IbvCq;
        *cq_context = (*got).ibv.cq_context;
    }
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut IbvCq, nevents: u32) {
    // SAFETY: a live CQ (the caller's contract).
    if let Some(c) = unsafe { cq.as_mut() } {
        c.comp_events_completed = c.comp_events_completed.wrapping_add(nevents);
    }
}

/// `ops.poll_cq`: up to `n` completions, oldest first; -1 once the queue
/// overran.
pub unsafe extern "C" fn poll_cq(cq: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int {
    // SAFETY: a live CQ (the caller's contract).
    let Some(c) = (unsafe { (cq as *const Cq).as_ref() }) else { return -1 };
    let mut s = c.state.lock().unwrap_or_else(|e| e.into_inner());
    if s.overrun {
        return -1;
    }
    let mut got = 0;
    while got < n.max(0) {
        let Some(e) = s.entries.pop_front() else { break };
        // SAFETY: the caller's array of n entries.
        unsafe { wc.add(got as usize).write(e) };
        got += 1;
    }
    got
}

/// `ops.req_notify_cq`.
pub unsafe extern "C" fn req_notify_cq(cq: *mut IbvCq, _solicited_only: c_int) -> c_int {
    // SAFETY: a live CQ (the caller's contract).
    let Some(c) = (unsafe { (cq as *const Cq).as_ref() }) else { return libc::EINVAL };
    c.state.lock().unwrap_or_else(|e| e.into_inner()).armed = true;
    0
}

/// One posted send work request, copied at post.
#[derive(Clone)]
pub struct SendWr {
    pub wr_id: u64,
    pub opcode: i32,
    pub signaled: bool,
    pub sges: Vec<IbvSge>,
    pub remote_addr: u64,
    pub rkey: u32,
    pub imm: u32,
}

/// One posted receive.
pub struct RecvWr {
    pub wr_id: u64,
    pub sges: Vec<IbvSge>,
}

/// Where a queue pair stands and what it holds.
pub struct QpState {
    pub state: i32,
    pub port: u8,
    pub access: u32,
    /// The remote queue pair: its IPv4 address (from the GID) and number.
    pub dest: Option<(std::net::Ipv4Addr, u32)>,
    /// How long a request waits for its answer before it fails with retry
    /// exceeded: the transport timeout (4.096 us x 2^timeout) times the
    /// tries (retry_cnt + 1), set at RTS; `None` (timeout 0): for ever.
    pub ack_timeout: Option<std::time::Duration>,
    pub sends: VecDeque<SendWr>,
    pub recvs: VecDeque<RecvWr>,
    pub destroyed: bool,
}

/// A queue pair's shared part: the posting threads, the requester thread
/// and the responder threads all reach it.
pub struct QpShared {
    pub qpn: u32,
    pub pd: usize,
    pub send_cq: usize,
    pub recv_cq: usize,
    pub sq_sig_all: bool,
    pub cap: IbvQpCap,
    pub st: Mutex<QpState>,
    pub work: Condvar,
    /// The requester thread, and the responder streams and threads.
    pub threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    pub streams: Mutex<Vec<std::net::TcpStream>>,
    /// What a test injected.
    pub faults: Mutex<crate::faults::QpFaults>,
    /// Requests it executed with success (for tests: which NIC moved a
    /// transfer's bytes).
    pub executed: std::sync::atomic::AtomicU64,
    /// Its context, and the `ibv_qp` handed out (for async events).
    pub ctx: usize,
    pub ibv: std::sync::atomic::AtomicUsize,
}

impl QpShared {
    pub fn send_cq(&self) -> &Cq {
        // SAFETY: a CQ outlives the queue pairs that complete into it.
        unsafe { &*(self.send_cq as *const Cq) }
    }

    pub fn recv_cq(&self) -> &Cq {
        // SAFETY: as above.
        unsafe { &*(self.recv_cq as *const Cq) }
    }

    /// Raises `event_type` about this queue pair on its context.
    pub fn event(&self, event_type: i32) {
        // SAFETY: the context outlives its queue pairs.
        let ctx = unsafe { &*(self.ctx as *const Context) };
        ctx.post_event(event_type, self.ibv.load(Ordering::Acquire));
    }

    /// Completes a send request: to the send CQ, or held (a fault).
    pub fn complete_send(&self, wc: IbvWc) {
        let mut f = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        match f.held.as_mut() {
            Some(held) => held.push(wc),
            None => {
                drop(f);
                self.send_cq().push(wc);
            }
        }
    }

    /// Whether its port is down.
    pub fn port_down(&self, port: u8) -> bool {
        // SAFETY: the context outlives its queue pairs.
        let ctx = unsafe { &*(self.ctx as *const Context) };
        crate::faults::port_down(ctx.device_index(), port)
    }

    /// Moves to ERR: every posted receive is flushed (sends are flushed
    /// by the requester thread, in order), and completions a fault held
    /// are flushed too: a request whose answer never came completes,
    /// flushed, once its queue pair is in ERR, as on a NIC.
    pub fn to_error(&self, st: &mut QpState) {
        st.state = QPS_ERR;
        let held = self.faults.lock().unwrap_or_else(|e| e.into_inner()).held.take();
        for wc in held.unwrap_or_default() {
            self.send_cq().push(IbvWc { status: WC_WR_FLUSH_ERR, byte_len: 0, ..wc });
        }
        for r in st.recvs.drain(..) {
            self.recv_cq().push(IbvWc {
                wr_id: r.wr_id,
                status: WC_WR_FLUSH_ERR,
                opcode: WC_RECV,
                qp_num: self.qpn,
                ..Default::default()
            });
        }
        self.work.notify_all();
    }
}

/// A queue pair as handed out.
#[repr(C)]
pub struct Qp {
    pub ibv: IbvQp,
    pub shared: Arc<QpShared>,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_qp(pd: *mut IbvPd, attr: *mut IbvQpInitAttr) -> *mut IbvQp {
    // SAFETY: the caller's live objects.
    let (Some(p), Some(a)) = (unsafe { (pd as *const Pd).as_ref() }, unsafe { attr.as_mut() }) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    // RC only; both CQs; caps within the device's.
    if a.qp_type != 2
        || a.send_cq.is_null()
        || a.recv_cq.is_null()
        || a.cap.max_send_wr > 16384
        || a.cap.max_recv_wr > 16384
        || a.cap.max_send_sge > 30
        || a.cap.max_recv_sge > 30
    {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let Some(qpn) = crate::fabric::new_qpn() else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    let shared = Arc::new(QpShared {
        qpn,
        pd: pd as usize,
        send_cq: a.send_cq as usize,
        recv_cq: a.recv_cq as usize,
        sq_sig_all: a.sq_sig_all != 0,
        cap: a.cap,
        st: Mutex::new(QpState {
            state: QPS_RESET,
            port: 0,
            access: 0,
            dest: None,
            ack_timeout: None,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            destroyed: false,
        }),
        work: Condvar::new(),
        threads: Mutex::new(Vec::new()),
        streams: Mutex::new(Vec::new()),
        faults: Mutex::default(),
        executed: std::sync::atomic::AtomicU64::new(0),
        ctx: p.ibv.context as usize,
        ibv: std::sync::atomic::AtomicUsize::new(0),
    });
    crate::fabric::register(&shared);
    p.users.fetch_add(1, Ordering::AcqRel);
    for cq in [a.send_cq, a.recv_cq] {
        // SAFETY: live CQs (the caller's contract).
        unsafe { &*(cq as *const Cq) }.qps.fetch_add(1, Ordering::AcqRel);
    }
    QPS.fetch_add(1, Ordering::Relaxed);
    let ibv = IbvQp {
        context: p.ibv.context,
        qp_context: a.qp_context,
        pd,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: std::ptr::null_mut(),
        handle: next_handle(),
        qp_num: qpn,
        state: QPS_RESET,
        qp_type: 2,
        mutex: libc::PTHREAD_MUTEX_INITIALIZER,
        cond: libc::PTHREAD_COND_INITIALIZER,
        events_completed: 0,
    };
    let shared2 = shared.clone();
    let raw = Box::into_raw(Box::new(Qp { ibv, shared }));
    shared2.ibv.store(raw as usize, Ordering::Release);
    raw as *mut IbvQp
}

/// `ibv_modify_qp`: the RC transitions with the attributes each requires.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_modify_qp(qp: *mut IbvQp, attr: *mut IbvQpAttr, mask: c_int) -> c_int {
    // SAFETY: the caller's live objects.
    let (Some(q), Some(a)) = (unsafe { (qp as *mut Qp).as_mut() }, unsafe { attr.as_ref() }) else {
        return libc::EINVAL;
    };
    if mask & MASK_STATE == 0 {
        return libc::EINVAL;
    }
    let s = &q.shared;
    let mut st = s.st.lock().unwrap_or_else(|e| e.into_inner());
    let needs = |bits: c_int| mask & bits == bits;
    let to = a.qp_state;
    let mut start = false;
    match (st.state, to) {
        (_, QPS_RESET) => {
            st.state = QPS_RESET;
            st.sends.clear();
            st.recvs.clear();
            st.dest = None;
        }
        (_, QPS_ERR) => s.to_error(&mut st),
        (QPS_RESET | QPS_INIT, QPS_INIT) => {
            if st.state == QPS_RESET && !needs(MASK_PKEY_INDEX | MASK_PORT | MASK_ACCESS_FLAGS) {
                return libc::EINVAL;
            }
            if mask & MASK_PORT != 0 {
                // SAFETY: the QP's context is live while it is.
                let ctx = unsafe { &*(q.ibv.context as *const Context) };
                if crate::port(ctx, a.port_num).is_none() {
                    return libc::EINVAL;
                }
                st.port = a.port_num;
            }
            if mask & MASK_ACCESS_FLAGS != 0 {
                st.access = a.qp_access_flags;
            }
            st.state = QPS_INIT;
        }
        (QPS_INIT, QPS_RTR) => {
            let required =
                MASK_AV | MASK_PATH_MTU | MASK_DEST_QPN | MASK_RQ_PSN | MASK_MAX_DEST_RD_ATOMIC | MASK_MIN_RNR_TIMER;
            if !needs(required) || a.max_dest_rd_atomic > 16 || a.ah_attr.is_global == 0 {
                return libc::EINVAL;
            }
            // SAFETY: the QP's context is live while it is.
            let ctx = unsafe { &*(q.ibv.context as *const Context) };
            let Some(port) = crate::port(ctx, st.port) else { return libc::EINVAL };
            let sgid_ok = port.gids.get(a.ah_attr.grh.sgid_index as usize).is_some_and(|g| !g.gid.is_unspecified());
            let mtu_ok = (1..=5).contains(&a.path_mtu) && 128u32 << a.path_mtu <= port.mtu;
            let words = a.ah_attr.grh.dgid;
            let mut raw = [0u8; 16];
            raw[..8].copy_from_slice(&words[0].to_ne_bytes());
            raw[8..].copy_from_slice(&words[1].to_ne_bytes());
            // The shim routes RoCE v2 over IPv4 only.
            let Some(ip) = std::net::Ipv6Addr::from(raw).to_ipv4_mapped() else { return libc::EINVAL };
            if !sgid_ok || !mtu_ok {
                return libc::EINVAL;
            }
            st.dest = Some((ip, a.dest_qp_num & 0xff_ffff));
            st.state = QPS_RTR;
        }
        (QPS_RTR | QPS_RTS, QPS_RTS) => {
            let required = MASK_SQ_PSN | MASK_TIMEOUT | MASK_RETRY_CNT | MASK_RNR_RETRY | MASK_MAX_QP_RD_ATOMIC;
            if st.state == QPS_RTR && (!needs(required) || a.max_rd_atomic > 16) {
                return libc::EINVAL;
            }
            start = st.state == QPS_RTR;
            if start {
                st.ack_timeout = (a.timeout > 0).then(|| {
                    let one = std::time::Duration::from_nanos(4096u64 << a.timeout.min(31));
                    one * (u32::from(a.retry_cnt.min(7)) + 1)
                });
            }
            st.state = QPS_RTS;
        }
        _ => return libc::EINVAL,
    }
    q.ibv.state = st.state;
    drop(st);
    // Outside the state lock (the fabric takes the threads lock first).
    if start {
        crate::fabric::start_requester(s);
    }
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut IbvQp,
    attr: *mut IbvQpAttr,
    _mask: c_int,
    init: *mut IbvQpInitAttr,
) -> c_int {
    // SAFETY: the caller's live objects.
    let (Some(q), Some(a)) = (unsafe { (qp as *const Qp).as_ref() }, unsafe { attr.as_mut() }) else {
        return libc::EINVAL;
    };
    let st = q.shared.st.lock().unwrap_or_else(|e| e.into_inner());
    *a = IbvQpAttr {
        qp_state: st.state,
        cur_qp_state: st.state,
        dest_qp_num: st.dest.map_or(0, |d| d.1),
        qp_access_flags: st.access,
        cap: q.shared.cap,
        port_num: st.port,
        ..Default::default()
    };
    // SAFETY: the caller's struct, if any.
    if let Some(i) = unsafe { init.as_mut() } {
        i.cap = q.shared.cap;
        i.qp_type = 2;
        i.send_cq = q.ibv.send_cq;
        i.recv_cq = q.ibv.recv_cq;
        i.sq_sig_all = q.shared.sq_sig_all as i32;
    }
    0
}

/// `ibv_destroy_qp`: its threads are stopped and joined first, so nothing
/// of it runs once it returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut IbvQp) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: made by ibv_create_qp, freed once.
    let q = unsafe { Box::from_raw(qp as *mut Qp) };
    let s = &q.shared;
    crate::fabric::unregister(s.qpn);
    {
        let mut st = s.st.lock().unwrap_or_else(|e| e.into_inner());
        st.destroyed = true;
        s.work.notify_all();
    }
    for stream in s.streams.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
    let threads: Vec<_> = s.threads.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect();
    for t in threads {
        let _ = t.join();
    }
    for cq in [s.send_cq, s.recv_cq] {
        // SAFETY: the CQs outlive the QP.
        unsafe { &*(cq as *const Cq) }.qps.fetch_sub(1, Ordering::AcqRel);
    }
    // SAFETY: the protection domain outlives its QPs.
    unsafe { &*(s.pd as *const Pd) }.users.fetch_sub(1, Ordering::AcqRel);
    QPS.fetch_sub(1, Ordering::Relaxed);
    0
}

/// Copies a caller's scatter/gather list.
///
/// # Safety
/// `sg` points to `n` entries (or `n` is 0).
unsafe fn sges(sg: *const IbvSge, n: i32) -> Vec<IbvSge> {
    if n <= 0 || sg.is_null() {
        return Vec::new();
    }
    // SAFETY: per the contract.
    unsafe { std::slice::from_raw_parts(sg, n as usize) }.to_vec()
}

/// `ops.post_send`: each request of the chain is queued for the
/// requester thread (RTS or ERR; in ERR it is flushed).
pub unsafe extern "C" fn post_send(qp: *mut IbvQp, wr: *mut IbvSendWr, bad: *mut *mut IbvSendWr) -> c_int {
    // SAFETY: a live QP (the caller's contract).
    let Some(q) = (unsafe { (qp as *const Qp).as_ref() }) else { return libc::EINVAL };
    let s = &q.shared;
    let mut st = s.st.lock().unwrap_or_else(|e| e.into_inner());
    let mut w = wr;
    while !w.is_null() {
        // SAFETY: the caller's chain.
        let r = unsafe { &*w };
        let fail = |e: c_int| {
            // SAFETY: the caller's out-pointer.
            unsafe { *bad = w };
            e
        };
        if !matches!(st.state, QPS_RTS | QPS_ERR) {
            return fail(libc::EINVAL);
        }
        if r.num_sge < 0 || r.num_sge as u32 > s.cap.max_send_sge || !(0..=4).contains(&r.opcode) {
            return fail(libc::EINVAL);
        }
        if st.sends.len() >= s.cap.max_send_wr as usize {
            return fail(libc::ENOMEM);
        }
        st.sends.push_back(SendWr {
            wr_id: r.wr_id,
            opcode: r.opcode,
            signaled: s.sq_sig_all || r.send_flags & SEND_SIGNALED != 0,
            // SAFETY: the request's own list.
            sges: unsafe { sges(r.sg_list, r.num_sge) },
            remote_addr: r.remote_addr,
            rkey: r.rkey,
            imm: r.imm_data,
        });
        w = r.next;
    }
    s.work.notify_all();
    0
}

/// `ops.post_recv`: INIT and later.
pub unsafe extern "C" fn post_recv(qp: *mut IbvQp, wr: *mut IbvRecvWr, bad: *mut *mut IbvRecvWr) -> c_int {
    // SAFETY: a live QP (the caller's contract).
    let Some(q) = (unsafe { (qp as *const Qp).as_ref() }) else { return libc::EINVAL };
    let s = &q.shared;
    let mut st = s.st.lock().unwrap_or_else(|e| e.into_inner());
    let mut w = wr;
    while !w.is_null() {
        // SAFETY: the caller's chain.
        let r = unsafe { &*w };
        if st.state == QPS_RESET
            || r.num_sge < 0
            || r.num_sge as u32 > s.cap.max_recv_sge
            || st.recvs.len() >= s.cap.max_recv_wr as usize
        {
            // SAFETY: the caller's out-pointer.
            unsafe { *bad = w };
            return libc::EINVAL;
        }
        // SAFETY: the request's own list.
        let sges = unsafe { sges(r.sg_list, r.num_sge) };
        if st.state == QPS_ERR {
            s.recv_cq().push(IbvWc {
                wr_id: r.wr_id,
                status: WC_WR_FLUSH_ERR,
                opcode: WC_RECV,
                qp_num: s.qpn,
                ..Default::default()
            });
        } else {
            st.recvs.push_back(RecvWr { wr_id: r.wr_id, sges });
        }
        w = r.next;
    }
    0
}

/// `ibv_wc_status_str`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    let s: &'static std::ffi::CStr = match status {
        WC_SUCCESS => c"success",
        WC_LOC_LEN_ERR => c"local length error",
        WC_LOC_PROT_ERR => c"local protection error",
        WC_WR_FLUSH_ERR => c"Work Request Flushed Error",
        WC_REM_INV_REQ_ERR => c"remote invalid request error",
        WC_REM_ACCESS_ERR => c"remote access error",
        WC_REM_OP_ERR => c"remote operation error",
        WC_RETRY_EXC_ERR => c"transport retry counter exceeded",
        WC_RNR_RETRY_EXC_ERR => c"RNR retry counter exceeded",
        _ => c"unknown",
    };
    s.as_ptr()
}
