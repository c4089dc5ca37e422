//! Device memory, pinned and registered host memory, the table of known
//! ranges, and pointer attributes.
//!
//! A device allocation is a memfd mapped twice: `PROT_NONE` at the address
//! handed out as the `CUdeviceptr` (so any direct access by the process
//! faults, and system calls given it fail with `EFAULT`), and read-write at
//! an alias only the shim's copies use. The table maps every known range
//! (device allocations, IPC imports, VMM mappings, pinned host allocations,
//! host registrations; never overlapping) to what it is.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::context::{Ctx, require_current};
use crate::ffi::*;
use crate::init::{DEVICE_MEMORY, MAX_DEVICES, config};
use crate::stats::{self, Counter};
use crate::vmm::{DeviceAccess, JoinedAlias, VmmMapping};

pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    *PAGE.get_or_init(|| usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1))
}

pub fn round_to_pages(n: usize) -> Option<usize> {
    let p = page_size();
    n.checked_add(p - 1).map(|v| v / p * p)
}

/// A memfd mapped at a `PROT_NONE` device address and at a read-write
/// alias. Unmapped (both) when the last holder drops it: the table, and any
/// queued operation that uses it, so a free racing a copy never unmaps
/// memory under the copy.
pub struct DeviceMapping {
    pub device_addr: usize,
    pub alias: usize,
    pub len: usize,
    pub fd: OwnedFd,
}

impl DeviceMapping {
    /// Maps `fd` (at least `len` bytes, page-rounded) both ways.
    pub fn map(fd: OwnedFd, len: usize) -> CuResult<DeviceMapping> {
        // SAFETY: a fresh mapping chosen by the kernel; nothing is replaced.
        let device =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if device == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        // SAFETY: as above.
        let alias = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if alias == libc::MAP_FAILED {
            // SAFETY: `device` is the mapping of `len` bytes made above.
            unsafe { libc::munmap(device, len) };
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(DeviceMapping { device_addr: device as usize, alias: alias as usize, len, fd })
    }
}

impl Drop for DeviceMapping {
    fn drop(&mut self) {
        // SAFETY: both are mappings of `len` bytes this value owns; the last
        // holder is dropping it, so nothing uses them any more.
        unsafe {
            libc::munmap(self.alias as *mut c_void, self.len);
            libc::munmap(self.device_addr as *mut c_void, self.len);
        }
    }
}

/// Pinned host memory: an anonymous read-write mapping.
pub struct HostMapping {
    pub addr: usize,
    pub len: usize,
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        // SAFETY: a mapping of `len` bytes this value owns; the last holder
        // is dropping it.
        unsafe { libc::munmap(self.addr as *mut c_void, self.len) };
    }
}

#[derive(Clone)]
pub enum Backing {
    /// cuMemAlloc.
    Alloc(Arc<DeviceMapping>),
    /// cuIpcOpenMemHandle.
    Import(Arc<DeviceMapping>),
    /// cuMemHostAlloc / cuMemAllocHost.
    Pinned(Arc<HostMapping>),
    /// cuMemHostRegister: the caller's memory.
    Registered,
    /// cuMemMap: one mapping of a VMM allocation, and which devices
    /// cuMemSetAccess let read or write it (copies check that).
    Vmm { mapping: Arc<VmmMapping>, access: DeviceAccess },
}

#[derive(Clone)]
pub struct Region {
    pub base: usize,
    pub size: usize,
    pub ctx: Ctx,
    pub buffer_id: u64,
    pub sync_memops: bool,
    pub backing: Backing,
}

impl Region {
    pub fn end(&self) -> usize {
        self.base + self.size
    }

    pub fn is_device(&self) -> bool {
        matches!(self.backing, Backing::Alloc(_) | Backing::Import(_) | Backing::Vmm { .. })
    }

    /// The context the memory belongs to, as CU_POINTER_ATTRIBUTE_CONTEXT
    /// reports it: none (null) for VMM memory, which belongs to no
    /// context in CUDA.
    pub fn context(&self) -> CUcontext {
        match self.backing {
            Backing::Vmm { .. } => std::ptr::null_mut(),
            _ => self.ctx.handle(),
        }
    }

    pub fn contains(&self, addr: usize) -> bool {
        self.base <= addr && addr < self.end()
    }
}

/// Every known range, by base address.
pub static TABLE: Mutex<BTreeMap<usize, Region>> = Mutex::new(BTreeMap::new());
/// Bytes allocated on each device.
static USED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

/// Counts `bytes` against `device`'s memory: `CUDA_ERROR_OUT_OF_MEMORY`
/// past [`DEVICE_MEMORY`].
fn charge(device: u32, bytes: u64) -> CuResult<()> {
    USED[device as usize]
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| u.checked_add(bytes).filter(|&v| v <= DEVICE_MEMORY))
        .map(drop)
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)
}

fn uncharge(device: u32, bytes: u64) {
    USED[device as usize].fetch_sub(bytes, Ordering::AcqRel);
}

/// Bytes counted against a device's memory (what cuMemGetInfo reports
/// as used) until dropped.
pub struct DeviceCharge {
    device: u32,
    bytes: u64,
}

impl DeviceCharge {
    /// `device` must be a configured device's ordinal.
    pub fn take(device: u32, bytes: u64) -> CuResult<DeviceCharge> {
        charge(device, bytes)?;
        Ok(DeviceCharge { device, bytes })
    }
}

impl Drop for DeviceCharge {
    fn drop(&mut self) {
        uncharge(self.device, self.bytes);
    }
}

pub fn next_buffer_id() -> u64 {
    NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed)
}

/// The region holding `addr`.
pub fn find(table: &BTreeMap<usize, Region>, addr: usize) -> Option<&Region> {
    table.range(..=addr).next_back().map(|(_, r)| r).filter(|r| r.contains(addr))
}

/// Memory the shim's own copies read or write: a pointer, and what keeps it
/// mapped until the copy is done.
pub struct Span {
    pub ptr: *mut u8,
    /// Host memory that is neither pinned nor registered, which makes an
    /// asynchronous copy (partly) synchronous, as in CUDA.
    pub pageable: bool,
    _keep: Keep,
}

/// Held, never read: dropping it is what may unmap the memory.
#[allow(dead_code)]
enum Keep {
    /// The caller's memory: valid as long as the caller keeps it, as the
    /// driver API requires.
    Caller,
    Device(Arc<DeviceMapping>),
    Host(Arc<HostMapping>),
    /// One VMM mapping's alias (cuMemUnmap and cuMemRelease leave it to
    /// the copy).
    Vmm(Arc<VmmMapping>),
    /// VMM mappings back to back, joined in one alias for this copy.
    Joined(JoinedAlias),
    /// A copy of pageable host memory taken when the operation was made.
    Staged(Vec<u8>),
}

// SAFETY: the pointer is only dereferenced by the operation that owns the
// Span, on whichever thread runs it; the memory stays mapped while `_keep`
// lives (shim mappings, staged bytes) or while the caller keeps it (the
// CUDA contract for host memory given to a copy).
unsafe impl Send for Span {}

impl Span {
    /// The `n` bytes at a pageable host span, copied now: what an
    /// asynchronous copy from pageable memory does in CUDA (the caller may
    /// reuse the buffer once the call returns).
    ///
    /// # Safety
    /// The span holds `n` readable bytes (it was made for them).
    pub unsafe fn staged(self, n: usize) -> Span {
        let mut copy = vec![0u8; n];
        // SAFETY: the span holds `n` bytes (this function's contract); the
        // vector is a fresh buffer of `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, copy.as_mut_ptr(), n) };
        // Moving the vector into the span does not move its heap buffer.
        Span { ptr: copy.as_mut_ptr(), pageable: false, _keep: Keep::Staged(copy) }
    }
}

/// The span at `addr` in a host region (pinned or registered memory), or
/// in a device allocation or IPC import. VMM mappings go through
/// [`vmm_span`], which checks their access.
fn span_in(region: &Region, addr: usize) -> Span {
    let offset = addr - region.base;
    match &region.backing {
        Backing::Alloc(m) | Backing::Import(m) => {
            Span { ptr: (m.alias + offset) as *mut u8, pageable: false, _keep: Keep::Device(Arc::clone(m)) }
        }
        Backing::Pinned(h) => Span { ptr: addr as *mut u8, pageable: false, _keep: Keep::Host(Arc::clone(h)) },
        Backing::Registered => Span { ptr: addr as *mut u8, pageable: false, _keep: Keep::Caller },
        Backing::Vmm { mapping, .. } => {
            Span { ptr: (mapping.alias() + offset) as *mut u8, pageable: false, _keep: Keep::Vmm(Arc::clone(mapping)) }
        }
    }
}

/// What a copy does to the device side of its span: VMM memory allows
/// each only where cuMemSetAccess granted it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    Read,
    Write,
}

/// `[addr, addr + n)` as the device side of a copy: inside one device
/// allocation (or import), inside VMM mappings that lie back to back (as
/// the device sees one range across them) and grant the access `usage`
/// needs, or inside pinned or registered host memory (the device pointer
/// of mapped host memory is its host address). Anything else, including a
/// range that runs past its allocation or into unmapped or inaccessible
/// VMM memory, is `CUDA_ERROR_INVALID_VALUE`.
pub fn device_span(addr: CUdeviceptr, n: usize, usage: Usage) -> CuResult<Span> {
    let addr = usize::try_from(addr).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let end = addr.checked_add(n).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let parts = {
        let table = lock(&TABLE);
        let region = find(&table, addr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !matches!(region.backing, Backing::Vmm { .. }) {
            if end > region.end() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            return Ok(span_in(region, addr));
        }
        vmm_parts(&table, region, end, usage)?
    };
    vmm_span(parts, addr)
}

/// The VMM mappings `[first.base, end)` runs through, each with its base:
/// back to back, each granting `usage`.
fn vmm_parts(
    table: &BTreeMap<usize, Region>,
    first: &Region,
    end: usize,
    usage: Usage,
) -> CuResult<Vec<(usize, Arc<VmmMapping>)>> {
    let mut parts = Vec::with_capacity(1);
    let mut region = first;
    loop {
        let Backing::Vmm { mapping, access } = &region.backing else { return Err(CUDA_ERROR_INVALID_VALUE) };
        if !access.allows(usage) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        parts.push((region.base, Arc::clone(mapping)));
        if end <= region.end() {
            return Ok(parts);
        }
        region = table.get(&region.end()).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    }
}

/// The span at `addr` in VMM mappings found by [`vmm_parts`]: through the
/// mapping's own alias when there is one, through an alias made for the
/// copy that joins them otherwise (made here, outside the table's lock).
fn vmm_span(parts: Vec<(usize, Arc<VmmMapping>)>, addr: usize) -> CuResult<Span> {
    match <[_; 1]>::try_from(parts) {
        Ok([(base, mapping)]) => {
            Ok(Span { ptr: (mapping.alias() + (addr - base)) as *mut u8, pageable: false, _keep: Keep::Vmm(mapping) })
        }
        Err(parts) => {
            let first = parts.first().map_or(addr, |p| p.0);
            let joined = JoinedAlias::join(parts)?;
            Ok(Span { ptr: (joined.addr() + (addr - first)) as *mut u8, pageable: false, _keep: Keep::Joined(joined) })
        }
    }
}

/// `[ptr, ptr + n)` as the host side of a copy: used as it is, except that
/// null, or a range touching device memory or reserved VMM address space
/// (which a host access would fault on), is `CUDA_ERROR_INVALID_VALUE`.
/// Pinned or registered when `ptr` is in such a range, pageable otherwise.
pub fn host_span(ptr: usize, n: usize) -> CuResult<Span> {
    if ptr == 0 || ptr.checked_add(n).is_none() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if crate::vmm::touches_reservation(ptr, n) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let table = lock(&TABLE);
    let end = ptr + n;
    let mut span = Span { ptr: ptr as *mut u8, pageable: true, _keep: Keep::Caller };
    for (_, r) in table.range(..end).rev().take_while(|(_, r)| r.end() > ptr) {
        if r.is_device() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if r.contains(ptr) {
            span = span_in(r, ptr);
        }
    }
    Ok(span)
}

/// One side of a unified-addressing copy (`cuMemcpy`): device memory when
/// `ptr` is in a device allocation, host memory otherwise.
pub fn unified_span(ptr: CUdeviceptr, n: usize, usage: Usage) -> CuResult<Span> {
    let addr = usize::try_from(ptr).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let is_device = find(&lock(&TABLE), addr).is_some_and(Region::is_device);
    if is_device { device_span(ptr, n, usage) } else { host_span(addr, n) }
}

/// A memfd's name: the process's nonce and the buffer id, which an importer
/// checks so that a reused descriptor number is never taken for the
/// exported buffer.
pub fn memfd_name(nonce: u64, buffer_id: u64) -> String {
    format!("orbite-cuda-shim-{nonce:016x}-{buffer_id}")
}

/// This process's nonce: random, so two processes (or pid namespaces)
/// never share one.
pub fn process_nonce() -> u64 {
    static NONCE: OnceLock<u64> = OnceLock::new();
    *NONCE.get_or_init(|| {
        let mut bytes = [0u8; 8];
        // SAFETY: writes at most 8 bytes into `bytes`.
        let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
        if got == 8 {
            u64::from_ne_bytes(bytes)
        } else {
            let t =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
            t ^ (u64::from(std::process::id()) << 32)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(out: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    entry(|| {
        let ctx = require_current()?;
        if out.is_null() || bytesize == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let len = round_to_pages(bytesize).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        charge(ctx.device(), bytesize as u64)?;
        let made = alloc_device(ctx, bytesize, len);
        match made {
            Ok(ptr) => {
                // SAFETY: non-null, writable (driver API contract).
                unsafe { write_out(out, ptr as CUdeviceptr) }
            }
            Err(e) => {
                uncharge(ctx.device(), bytesize as u64);
                Err(e)
            }
        }
    })
}

fn alloc_device(ctx: Ctx, size: usize, len: usize) -> CuResult<usize> {
    let buffer_id = next_buffer_id();
    let name = std::ffi::CString::new(memfd_name(process_nonce(), buffer_id)).map_err(|_| CUDA_ERROR_UNKNOWN)?;
    // SAFETY: `name` is NUL-terminated.
    let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: `raw` is a descriptor just created and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: `fd` is a valid memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let mapping = Arc::new(DeviceMapping::map(fd, len)?);
    let base = mapping.device_addr;
    let region = Region { base, size, ctx, buffer_id, sync_memops: false, backing: Backing::Alloc(mapping) };
    lock(&TABLE).insert(base, region);
    stats::add(Counter::DeviceAllocations, 1);
    stats::add(Counter::DeviceBytes, size as u64);
    Ok(base)
}

/// `dptr` must be the base of a live allocation (not an IPC import:
/// those are closed with cuIpcCloseMemHandle). A queued copy that uses it
/// still completes: its mapping goes when the copy is done.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    entry(|| {
        require_current()?;
        let addr = usize::try_from(dptr).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let region = {
            let mut table = lock(&TABLE);
            match table.get(&addr) {
                Some(r) if matches!(r.backing, Backing::Alloc(_)) => table.remove(&addr),
                _ => None,
            }
        }
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        uncharge(region.ctx.device(), region.size as u64);
        stats::sub(Counter::DeviceAllocations, 1);
        stats::sub(Counter::DeviceBytes, region.size as u64);
        Ok(())
    })
}

/// Base and size of the device allocation (or import, or VMM mapping)
/// holding `dptr`; either out-parameter may be null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    base: *mut CUdeviceptr,
    size: *mut usize,
    dptr: CUdeviceptr,
) -> CUresult {
    entry(|| {
        config()?;
        let addr = usize::try_from(dptr).map_err(|_| CUDA_ERROR_NOT_FOUND)?;
        let (b, s) = {
            let table = lock(&TABLE);
            let r = find(&table, addr).filter(|r| r.is_device()).ok_or(CUDA_ERROR_NOT_FOUND)?;
            (r.base, r.size)
        };
        // SAFETY: each is null or writable (driver API contract).
        unsafe {
            if !base.is_null() {
                write_out(base, b as CUdeviceptr)?;
            }
            if !size.is_null() {
                write_out(size, s)?;
            }
        }
        Ok(())
    })
}

/// Free and total memory of the current context's device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    entry(|| {
        let ctx = require_current()?;
        if free.is_null() || total.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let used = USED[ctx.device() as usize].load(Ordering::Acquire);
        // SAFETY: both non-null, writable (driver API contract).
        unsafe {
            write_out(free, DEVICE_MEMORY.saturating_sub(used) as usize)?;
            write_out(total, DEVICE_MEMORY as usize)
        }
    })
}

const CU_MEMHOSTALLOC_ALL: c_uint = 0x1 | 0x2 | 0x4; // PORTABLE | DEVICEMAP | WRITECOMBINED
const CU_MEMHOSTREGISTER_ALL: c_uint = 0x1 | 0x2 | 0x4 | 0x8; // PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(out: *mut *mut c_void, bytesize: usize, flags: c_uint) -> CUresult {
    entry(|| {
        let ctx = require_current()?;
        if out.is_null() || bytesize == 0 || flags & !CU_MEMHOSTALLOC_ALL != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let len = round_to_pages(bytesize).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: a fresh anonymous mapping chosen by the kernel.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let mapping = Arc::new(HostMapping { addr: addr as usize, len });
        let base = addr as usize;
        let region = Region {
            base,
            size: bytesize,
            ctx,
            buffer_id: next_buffer_id(),
            sync_memops: false,
            backing: Backing::Pinned(mapping),
        };
        lock(&TABLE).insert(base, region);
        stats::add(Counter::HostAllocations, 1);
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(out, addr) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost_v2(out: *mut *mut c_void, bytesize: usize) -> CUresult {
    // SAFETY: same contract as cuMemHostAlloc.
    unsafe { cuMemHostAlloc(out, bytesize, 0) }
}

/// `p` must be the base of a pinned allocation.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    entry(|| {
        require_current()?;
        let addr = p as usize;
        let mut table = lock(&TABLE);
        match table.get(&addr) {
            Some(r) if matches!(r.backing, Backing::Pinned(_)) => {
                table.remove(&addr);
                stats::sub(Counter::HostAllocations, 1);
                Ok(())
            }
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    })
}

/// Whether every page of `[addr, addr + len)` is mapped in this process.
fn is_mapped(addr: usize, len: usize) -> bool {
    let page = page_size();
    let start = addr / page * page;
    let Some(end) = addr.checked_add(len).and_then(round_to_pages) else { return false };
    let mut vec = vec![0u8; 4096];
    let mut at = start;
    while at < end {
        let chunk = (end - at).min(vec.len() * page);
        // SAFETY: `vec` holds one byte for each of the chunk's pages (at
        // most vec.len()); mincore only reads the page tables.
        if unsafe { libc::mincore(at as *mut c_void, chunk, vec.as_mut_ptr()) } != 0 {
            return false;
        }
        at += chunk;
    }
    true
}

/// Records `[p, p + bytesize)` as registered host memory (no copy, no
/// pinning). Overlapping a registration or pinned allocation is
/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`; device memory, reserved VMM
/// address space, unmapped pages, null or size 0 are
/// `CUDA_ERROR_INVALID_VALUE`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostRegister_v2(p: *mut c_void, bytesize: usize, flags: c_uint) -> CUresult {
    entry(|| {
        let ctx = require_current()?;
        let addr = p as usize;
        if p.is_null() || bytesize == 0 || flags & !CU_MEMHOSTREGISTER_ALL != 0 || addr.checked_add(bytesize).is_none()
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if crate::vmm::touches_reservation(addr, bytesize) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut table = lock(&TABLE);
        let end = addr + bytesize;
        let mut host_overlap = false;
        for (_, r) in table.range(..end).rev().take_while(|(_, r)| r.end() > addr) {
            if r.is_device() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            host_overlap = true;
        }
        if host_overlap {
            return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
        }
        if !is_mapped(addr, bytesize) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let region = Region {
            base: addr,
            size: bytesize,
            ctx,
            buffer_id: next_buffer_id(),
            sync_memops: false,
            backing: Backing::Registered,
        };
        table.insert(addr, region);
        stats::add(Counter::HostRegistrations, 1);
        Ok(())
    })
}

/// `p` must be the base of a registration.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    entry(|| {
        require_current()?;
        let addr = p as usize;
        let mut table = lock(&TABLE);
        match table.get(&addr) {
            Some(r) if matches!(r.backing, Backing::Registered) => {
                table.remove(&addr);
                stats::sub(Counter::HostRegistrations, 1);
                Ok(())
            }
            _ => Err(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED),
        }
    })
}

/// The device pointer of pinned or registered host memory: its host
/// address (unified addressing).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    out: *mut CUdeviceptr,
    p: *mut c_void,
    flags: c_uint,
) -> CUresult {
    entry(|| {
        config()?;
        if out.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let known = find(&lock(&TABLE), p as usize).is_some_and(|r| !r.is_device());
        if !known {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(out, p as CUdeviceptr) }
    })
}

const CU_MEMORYTYPE_HOST: c_uint = 1;
const CU_MEMORYTYPE_DEVICE: c_uint = 2;

const ATTR_CONTEXT: c_int = 1;
const ATTR_MEMORY_TYPE: c_int = 2;
const ATTR_DEVICE_POINTER: c_int = 3;
const ATTR_HOST_POINTER: c_int = 4;
const ATTR_SYNC_MEMOPS: c_int = 6;
const ATTR_BUFFER_ID: c_int = 7;
const ATTR_IS_MANAGED: c_int = 8;
const ATTR_DEVICE_ORDINAL: c_int = 9;
const ATTR_IS_LEGACY_CUDA_IPC_CAPABLE: c_int = 10;
const ATTR_RANGE_START_ADDR: c_int = 11;
const ATTR_RANGE_SIZE: c_int = 12;
const ATTR_MAPPED: c_int = 13;
const ATTR_ALLOWED_HANDLE_TYPES: c_int = 14;

/// One attribute's value, in the C type the driver writes for it.
enum Value {
    Ptr(*mut c_void),
    U64(u64),
    U32(c_uint),
    I32(c_int),
    Size(usize),
}

impl Value {
    /// Writes the value, in its C type's size, to `data`.
    ///
    /// # Safety
    /// `data` is valid for a write of that type (the caller's promise).
    unsafe fn store(self, data: *mut c_void) -> CuResult<()> {
        // SAFETY: this function's contract.
        unsafe {
            match self {
                Value::Ptr(v) => write_out(data.cast(), v),
                Value::U64(v) => write_out(data.cast(), v),
                Value::U32(v) => write_out(data.cast(), v),
                Value::I32(v) => write_out(data.cast(), v),
                Value::Size(v) => write_out(data.cast(), v),
            }
        }
    }

    /// The "not applicable" value cuPointerGetAttributes gives an unknown
    /// pointer: zero, in the same type.
    fn zero(attribute: c_int) -> CuResult<Value> {
        Ok(match attribute {
            ATTR_CONTEXT | ATTR_HOST_POINTER => Value::Ptr(std::ptr::null_mut()),
            ATTR_DEVICE_POINTER | ATTR_RANGE_START_ADDR | ATTR_BUFFER_ID | ATTR_ALLOWED_HANDLE_TYPES => Value::U64(0),
            ATTR_MEMORY_TYPE | ATTR_SYNC_MEMOPS | ATTR_IS_MANAGED | ATTR_IS_LEGACY_CUDA_IPC_CAPABLE | ATTR_MAPPED => {
                Value::U32(0)
            }
            ATTR_DEVICE_ORDINAL => Value::I32(0),
            ATTR_RANGE_SIZE => Value::Size(0),
            _ => return Err(CUDA_ERROR_NOT_SUPPORTED),
        })
    }
}

/// The value of `attribute` for `addr` in `region`. `Ok(None)`: the
/// attribute does not apply (host pointer of device memory), which
/// cuPointerGetAttribute reports as `CUDA_ERROR_INVALID_VALUE` and
/// cuPointerGetAttributes as zero. Booleans are written as `unsigned int`
/// (4 bytes), like the driver. A VMM mapping is its own range (RANGE_*,
/// BUFFER_ID) and belongs to no context (null CONTEXT).
fn attribute_value(region: &Region, addr: usize, attribute: c_int) -> CuResult<Option<Value>> {
    let device = region.is_device();
    Ok(Some(match attribute {
        ATTR_CONTEXT => Value::Ptr(region.context()),
        ATTR_MEMORY_TYPE => Value::U32(if device { CU_MEMORYTYPE_DEVICE } else { CU_MEMORYTYPE_HOST }),
        ATTR_DEVICE_POINTER => Value::U64(addr as u64),
        ATTR_HOST_POINTER if device => return Ok(None),
        ATTR_HOST_POINTER => Value::Ptr(addr as *mut c_void),
        ATTR_SYNC_MEMOPS => Value::U32(c_uint::from(region.sync_memops)),
        ATTR_BUFFER_ID => Value::U64(region.buffer_id),
        ATTR_IS_MANAGED => Value::U32(0),
        ATTR_DEVICE_ORDINAL => Value::I32(region.ctx.device() as c_int),
        ATTR_IS_LEGACY_CUDA_IPC_CAPABLE => Value::U32(c_uint::from(matches!(region.backing, Backing::Alloc(_)))),
        ATTR_RANGE_START_ADDR => Value::U64(region.base as u64),
        ATTR_RANGE_SIZE => Value::Size(region.size),
        ATTR_MAPPED => Value::U32(1),
        ATTR_ALLOWED_HANDLE_TYPES => Value::U64(match &region.backing {
            Backing::Vmm { mapping, .. } => u64::from(mapping.physical().handle_types()),
            _ => 0,
        }),
        _ => return Err(CUDA_ERROR_NOT_SUPPORTED),
    }))
}

/// A pointer in no known range, or an attribute that does not apply to it,
/// is `CUDA_ERROR_INVALID_VALUE`; attributes the shim does not model
/// (P2P tokens, access flags, memory pools, ...) are
/// `CUDA_ERROR_NOT_SUPPORTED`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(data: *mut c_void, attribute: c_int, ptr: CUdeviceptr) -> CUresult {
    entry(|| {
        config()?;
        if data.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Value::zero(attribute)?;
        let addr = usize::try_from(ptr).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let value = {
            let table = lock(&TABLE);
            let region = find(&table, addr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            attribute_value(region, addr, attribute)?.ok_or(CUDA_ERROR_INVALID_VALUE)?
        };
        // SAFETY: `data` points to the attribute's type (driver API contract).
        unsafe { value.store(data) }
    })
}

/// Never fails for an unknown pointer: every attribute is then zero or
/// null, as the driver documents. Null entries of `data` are skipped.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttributes(
    count: c_uint,
    attributes: *const c_int,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> CUresult {
    entry(|| {
        config()?;
        if count == 0 || attributes.is_null() || data.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes `count` attributes and `count` data
        // pointers (driver API contract).
        let (attributes, data) = unsafe {
            (std::slice::from_raw_parts(attributes, count as usize), std::slice::from_raw_parts(data, count as usize))
        };
        let addr = usize::try_from(ptr).unwrap_or(0);
        let mut values = Vec::with_capacity(attributes.len());
        {
            let table = lock(&TABLE);
            let region = find(&table, addr);
            for &attribute in attributes {
                let value = match region {
                    Some(r) => attribute_value(r, addr, attribute)?,
                    None => None,
                };
                values.push(match value {
                    Some(v) => v,
                    None => Value::zero(attribute)?,
                });
            }
        }
        for (value, &out) in values.into_iter().zip(data) {
            if !out.is_null() {
                // SAFETY: each non-null entry points to its attribute's type
                // (driver API contract).
                unsafe { value.store(out)? };
            }
        }
        Ok(())
    })
}

/// Only `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` (an `unsigned int`, on device
/// memory), which the shim records and reports back; copies are ordered
/// the same either way.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerSetAttribute(value: *const c_void, attribute: c_int, ptr: CUdeviceptr) -> CUresult {
    entry(|| {
        config()?;
        if attribute != ATTR_SYNC_MEMOPS {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a pointer to an unsigned int for this
        // attribute (driver API contract).
        let on = unsafe { value.cast::<c_uint>().read_unaligned() } != 0;
        let addr = usize::try_from(ptr).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let mut table = lock(&TABLE);
        let base = find(&table, addr).filter(|r| r.is_device()).map(|r| r.base).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some(r) = table.get_mut(&base) {
            r.sync_memops = on;
        }
        Ok(())
    })
}
