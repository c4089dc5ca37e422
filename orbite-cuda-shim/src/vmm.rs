//! The virtual memory management (VMM) API: physical allocations
//! (cuMemCreate), address reservations (cuMemAddressReserve), mappings
//! (cuMemMap) with per-device access (cuMemSetAccess), and POSIX file
//! descriptors as shareable handles between processes
//! (cuMemExportToShareableHandle, cuMemImportFromShareableHandle).
//!
//! - A physical allocation ([`Physical`]) is a memfd of its size, sealed
//!   against shrinking and growing (so no mapping of it can ever reach past
//!   its end), named `orbite-cuda-shim-vmm-d<device>-<nonce>-<id>`: the name
//!   and the seals are how an importer, in any process, recognises one.
//!   Its handle is an opaque `u64` in a table, with a reference count.
//! - A reservation is a `PROT_NONE` anonymous mapping of the reserved
//!   addresses. cuMemMap leaves those addresses `PROT_NONE` (a CPU access
//!   faults, as for any device memory) and maps the memfd read-write at an
//!   alias of its own ([`VmmMapping`]) for the shim's copies, with a region
//!   in the memory table so that pointer queries and copies resolve it.
//!   A copy whose range runs across mappings that lie back to back gets an
//!   alias joining them for its duration ([`JoinedAlias`]).
//!
//! Physical memory goes when its last holder drops it: the handle table
//! (until the last cuMemRelease), each mapping (until cuMemUnmap), and each
//! copy in flight that names a mapping (its span keeps the alias).
//!
//! Locks: the VMM table (handles and reservations) may be held while
//! taking the memory table's lock, never the other way round.
//!
//! VMM calls need a successful cuInit but no current context: VMM memory
//! belongs to devices, not to contexts.

use std::collections::BTreeMap;
use std::ffi::{CString, c_int, c_uint, c_ulonglong, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::context::Ctx;
use crate::ffi::*;
use crate::init::{MAX_DEVICES, config, device};
use crate::memory::{Backing, DeviceCharge, Region, TABLE, Usage, find, next_buffer_id, process_nonce};
use crate::stats::{self, Counter};

/// What cuMemGetAllocationGranularity reports, minimum and recommended
/// alike (a GPU's large page). Sizes, mapped addresses and alignments are
/// multiples of it.
pub const GRANULARITY: usize = 2 << 20;

/// `CUmemAllocationHandleType`.
const HANDLE_TYPE_NONE: c_uint = 0;
const HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_uint = 1;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
const ALLOCATION_TYPE_PINNED: c_uint = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_TYPE_DEVICE: c_uint = 1;
/// `CUmemAllocationGranularity_flags`: MINIMUM, RECOMMENDED.
const GRANULARITY_RECOMMENDED: c_uint = 1;
/// `CUmemAccess_flags`.
const ACCESS_PROT_NONE: c_uint = 0;
const ACCESS_PROT_READ: c_uint = 1;
const ACCESS_PROT_READWRITE: c_uint = 3;

/// The name of every memfd behind a cuMemCreate allocation starts so;
/// the device ordinal follows.
const MEMFD_PREFIX: &str = "orbite-cuda-shim-vmm-d";
/// Handle values carry this in their high bits, so that a device pointer
/// or a small integer passed as a handle is never taken for one.
const HANDLE_TAG: u64 = 0x0b17_e000_0000_0000;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemLocation {
    pub type_: c_uint,
    pub id: c_int,
}

/// `CUmemAllocationProp::allocFlags`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AllocFlags {
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp`. Read with `read_unaligned` from whatever the
/// caller passes: every field is plain data, any bit pattern is a value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AllocationProp {
    pub type_: c_uint,
    pub requested_handle_types: c_uint,
    pub location: MemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: AllocFlags,
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AccessDesc {
    pub location: MemLocation,
    pub flags: c_uint,
}

const _: () = assert!(size_of::<AllocationProp>() == 32 && size_of::<AccessDesc>() == 12);

/// What an allocation was asked to be, from a checked `CUmemAllocationProp`.
struct Wanted {
    device: u32,
    handle_types: c_uint,
    alloc_flags: AllocFlags,
}

/// Checks a `CUmemAllocationProp`: pinned memory on a configured device;
/// no handle types but POSIX file descriptors (`CUDA_ERROR_NOT_SUPPORTED`
/// for Win32 and fabric handles). Compression is not modelled: the
/// allocation is never compressible, as its properties then say.
///
/// # Safety
/// `prop` is null or points to a `CUmemAllocationProp` (any alignment).
unsafe fn wanted(prop: *const AllocationProp) -> CuResult<Wanted> {
    if prop.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, readable (this function's contract); plain data.
    let p = unsafe { prop.read_unaligned() };
    if p.type_ != ALLOCATION_TYPE_PINNED || p.location.type_ != LOCATION_TYPE_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let device = device(p.location.id)?;
    if p.requested_handle_types & !HANDLE_TYPE_POSIX_FILE_DESCRIPTOR != 0 {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    Ok(Wanted {
        device,
        handle_types: p.requested_handle_types,
        alloc_flags: AllocFlags { compression_type: 0, ..p.alloc_flags },
    })
}

/// A shareable handle type the shim exports and imports: POSIX file
/// descriptors only. `CU_MEM_HANDLE_TYPE_NONE` names no type
/// (`CUDA_ERROR_INVALID_VALUE`); Win32, fabric and anything else are
/// `CUDA_ERROR_NOT_SUPPORTED`.
fn shareable_type(handle_type: c_uint) -> CuResult<()> {
    match handle_type {
        HANDLE_TYPE_POSIX_FILE_DESCRIPTOR => Ok(()),
        HANDLE_TYPE_NONE => Err(CUDA_ERROR_INVALID_VALUE),
        _ => Err(CUDA_ERROR_NOT_SUPPORTED),
    }
}

/// A physical allocation: a sealed memfd of `size` bytes. Counted in
/// `vmm_bytes` while it lives; one made by cuMemCreate also counts against
/// its device's memory (an import does not, like an IPC import).
pub struct Physical {
    handle: u64,
    fd: OwnedFd,
    size: usize,
    device: u32,
    handle_types: c_uint,
    alloc_flags: AllocFlags,
    _charge: Option<DeviceCharge>,
}

impl Physical {
    fn new(
        fd: OwnedFd,
        size: usize,
        device: u32,
        handle_types: c_uint,
        alloc_flags: AllocFlags,
        charge: Option<DeviceCharge>,
    ) -> Physical {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let handle = HANDLE_TAG | NEXT.fetch_add(1, Ordering::Relaxed);
        stats::add(Counter::VmmBytes, size as u64);
        Physical { handle, fd, size, device, handle_types, alloc_flags, _charge: charge }
    }

    /// The handle types it was made to be exported as
    /// (`CUmemAllocationHandleType` bits).
    pub fn handle_types(&self) -> c_uint {
        self.handle_types
    }
}

impl Drop for Physical {
    fn drop(&mut self) {
        stats::sub(Counter::VmmBytes, self.size as u64);
    }
}

/// A memfd of `size` zero bytes named `name`, sealed so that its size never
/// changes (and no other seal can be added: a peer holding an exported
/// descriptor cannot make the shim's writable mappings fail).
fn sealed_memfd(name: &str, size: usize) -> CuResult<OwnedFd> {
    let name = CString::new(name).map_err(|_| CUDA_ERROR_UNKNOWN)?;
    // SAFETY: `name` is NUL-terminated.
    let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: a descriptor just created and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len = libc::off_t::try_from(size).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    // SAFETY: `fd` is a valid memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: `fd` is a valid memfd made with MFD_ALLOW_SEALING.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(CUDA_ERROR_OPERATING_SYSTEM);
    }
    Ok(fd)
}

/// The device ordinal in the name of a memfd the shim made for
/// cuMemCreate (in any process), given the target of its
/// `/proc/self/fd/N` link; `None` for anything else.
fn shim_memfd_device(link: &str) -> Option<u32> {
    let name = link.strip_prefix("/memfd:")?;
    let name = name.strip_suffix(" (deleted)").unwrap_or(name);
    let mut parts = name.strip_prefix(MEMFD_PREFIX)?.split('-');
    let (device, nonce, id) = (parts.next()?, parts.next()?, parts.next()?);
    let decimal = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    let shaped = parts.next().is_none()
        && decimal(device)
        && decimal(id)
        && nonce.len() == 16
        && nonce.bytes().all(|b| b.is_ascii_hexdigit());
    if shaped { device.parse().ok() } else { None }
}

/// A handle's physical allocation and its outstanding references.
struct Held {
    physical: Arc<Physical>,
    refs: u64,
}

/// A reserved address range: a `PROT_NONE` mapping, unmapped on drop.
struct Reservation {
    base: usize,
    size: usize,
}

impl Reservation {
    /// `size` bytes at an address aligned to `align` (a power of two, at
    /// least a page).
    fn new(size: usize, align: usize) -> CuResult<Reservation> {
        let total = size.checked_add(align).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: a fresh mapping chosen by the kernel; nothing is replaced.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let start = raw as usize;
        // `start + total` is mapped, so nothing here overflows.
        let base = (start + align - 1) & !(align - 1);
        let (head, tail) = (base - start, start + total - (base + size));
        // SAFETY: both are the unused ends of the mapping made above.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((base + size) as *mut c_void, tail);
            }
        }
        stats::add(Counter::VmmReservations, 1);
        Ok(Reservation { base, size })
    }

    fn end(&self) -> usize {
        self.base + self.size
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: the mapping of `size` bytes this value owns; nothing is
        // mapped in it (cuMemAddressFree checks) and no copy uses it (copies
        // go through aliases).
        unsafe { libc::munmap(self.base as *mut c_void, self.size) };
        stats::sub(Counter::VmmReservations, 1);
    }
}

/// Handles and reservations.
struct Vmm {
    handles: BTreeMap<u64, Held>,
    reservations: BTreeMap<usize, Reservation>,
}

impl Vmm {
    fn physical(&self, handle: u64) -> CuResult<Arc<Physical>> {
        self.handles.get(&handle).map(|h| Arc::clone(&h.physical)).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// One more reference to `physical`'s handle (back in the table if it
    /// was released while mapped).
    fn hold(&mut self, physical: &Arc<Physical>) -> u64 {
        let held = self.handles.entry(physical.handle).or_insert_with(|| {
            stats::add(Counter::VmmHandles, 1);
            Held { physical: Arc::clone(physical), refs: 0 }
        });
        held.refs += 1;
        physical.handle
    }

    /// Whether `[base, end)` lies inside one reservation.
    fn reserved(&self, base: usize, end: usize) -> bool {
        self.reservations.range(..=base).next_back().is_some_and(|(_, r)| end <= r.end())
    }
}

static VMM: Mutex<Vmm> = Mutex::new(Vmm { handles: BTreeMap::new(), reservations: BTreeMap::new() });

/// Whether `[addr, addr + n)` touches reserved address space (mapped or
/// not): memory a host access would fault on.
pub fn touches_reservation(addr: usize, n: usize) -> bool {
    let end = addr.saturating_add(n.max(1));
    lock(&VMM).reservations.range(..end).next_back().is_some_and(|(_, r)| r.end() > addr)
}

/// One cuMemMap mapping: the allocation's first `len` bytes mapped
/// read-write at an alias only the shim's copies use. Unmapped when the
/// last holder drops it: the memory table (until cuMemUnmap) and copies in
/// flight.
pub struct VmmMapping {
    alias: usize,
    len: usize,
    physical: Arc<Physical>,
}

impl VmmMapping {
    fn new(physical: Arc<Physical>, len: usize) -> CuResult<VmmMapping> {
        // SAFETY: a fresh mapping chosen by the kernel. The memfd holds at
        // least `len` bytes (checked by the caller) and is sealed against
        // shrinking, so the mapping never reaches past its end.
        let alias = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                physical.fd.as_raw_fd(),
                0,
            )
        };
        if alias == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        Ok(VmmMapping { alias: alias as usize, len, physical })
    }

    pub fn alias(&self) -> usize {
        self.alias
    }

    pub fn physical(&self) -> &Physical {
        &self.physical
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping of `len` bytes this value owns; its last
        // holder is dropping it.
        unsafe { libc::munmap(self.alias as *mut c_void, self.len) };
    }
}

/// VMM mappings that lie back to back in device addresses, mapped again,
/// contiguously, at an alias of their own: what a copy across them uses.
/// Unmapped on drop (when the copy is done).
pub struct JoinedAlias {
    addr: usize,
    len: usize,
    _parts: Vec<Arc<VmmMapping>>,
}

impl JoinedAlias {
    /// Joins `parts`, given as (device address, mapping), in address
    /// order and back to back.
    pub fn join(parts: Vec<(usize, Arc<VmmMapping>)>) -> CuResult<JoinedAlias> {
        let (Some((start, _)), Some((last, last_mapping))) = (parts.first(), parts.last()) else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        let len = (last + last_mapping.len).checked_sub(*start).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let start = *start;
        // SAFETY: a fresh mapping chosen by the kernel; nothing is replaced.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let addr = raw as usize;
        let mut joined = JoinedAlias { addr, len, _parts: Vec::with_capacity(parts.len()) };
        for (base, mapping) in parts {
            let offset = base.checked_sub(start).filter(|o| o + mapping.len <= len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            // SAFETY: replaces part of the `PROT_NONE` mapping made above,
            // which this value owns; the memfd holds at least `mapping.len`
            // bytes and is sealed against shrinking.
            let piece = unsafe {
                libc::mmap(
                    (addr + offset) as *mut c_void,
                    mapping.len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    mapping.physical.fd.as_raw_fd(),
                    0,
                )
            };
            if piece == libc::MAP_FAILED {
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            }
            joined._parts.push(mapping);
        }
        Ok(joined)
    }

    pub fn addr(&self) -> usize {
        self.addr
    }
}

impl Drop for JoinedAlias {
    fn drop(&mut self) {
        // SAFETY: the `len` bytes at `addr` are this value's mappings; the
        // copy that used them is done.
        unsafe { libc::munmap(self.addr as *mut c_void, self.len) };
    }
}

/// Which devices may read and write a mapping (bit `d` for device `d`),
/// as cuMemSetAccess granted.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceAccess {
    read: u64,
    write: u64,
}

impl DeviceAccess {
    /// Whether some device may do what `usage` needs. The shim's copies
    /// run on no particular device, so any device's access will do.
    pub fn allows(self, usage: Usage) -> bool {
        match usage {
            Usage::Read => self.read != 0,
            Usage::Write => self.write != 0,
        }
    }

    fn set(&mut self, device: u32, flags: c_uint) {
        let bit = 1u64 << device;
        let (read, write) = match flags {
            ACCESS_PROT_READWRITE => (true, true),
            ACCESS_PROT_READ => (true, false),
            _ => (false, false),
        };
        self.read = if read { self.read | bit } else { self.read & !bit };
        self.write = if write { self.write | bit } else { self.write & !bit };
    }

    /// `CUmemAccess_flags` of `device`.
    fn flags(self, device: u32) -> c_uint {
        let bit = 1u64 << device;
        match (self.read & bit != 0, self.write & bit != 0) {
            (true, true) => ACCESS_PROT_READWRITE,
            (true, false) => ACCESS_PROT_READ,
            _ => ACCESS_PROT_NONE,
        }
    }
}

/// `CUdeviceptr` as an address; one that is none is `CUDA_ERROR_INVALID_VALUE`.
fn address(ptr: CUdeviceptr) -> CuResult<usize> {
    usize::try_from(ptr).map_err(|_| CUDA_ERROR_INVALID_VALUE)
}

/// A non-zero multiple of the granularity.
fn granular(n: usize) -> CuResult<()> {
    if n == 0 || n % GRANULARITY != 0 { Err(CUDA_ERROR_INVALID_VALUE) } else { Ok(()) }
}

/// The bases of the VMM mappings that exactly cover `[start, end)`: the
/// first starts at `start`, each next one where the previous ends, the
/// last ends at `end`. Anything else is `CUDA_ERROR_INVALID_VALUE`.
fn whole_mappings(table: &BTreeMap<usize, Region>, start: usize, end: usize) -> CuResult<Vec<usize>> {
    let mut bases = Vec::with_capacity(1);
    let mut at = start;
    while at < end {
        match table.get(&at) {
            Some(r) if matches!(r.backing, Backing::Vmm { .. }) && r.end() <= end => {
                bases.push(at);
                at = r.end();
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
    if bases.is_empty() { Err(CUDA_ERROR_INVALID_VALUE) } else { Ok(bases) }
}

/// [`GRANULARITY`] for a valid `prop` (pinned memory on a configured
/// device), MINIMUM and RECOMMENDED alike.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const AllocationProp,
    option: c_uint,
) -> CUresult {
    entry(|| {
        config()?;
        if granularity.is_null() || option > GRANULARITY_RECOMMENDED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: null or a CUmemAllocationProp (driver API contract).
        unsafe { wanted(prop) }?;
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(granularity, GRANULARITY) }
    })
}

/// Physical memory of `size` bytes (a multiple of the granularity), zeroed,
/// counted against the device's memory. `flags` must be 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const AllocationProp,
    flags: c_ulonglong,
) -> CUresult {
    entry(|| {
        config()?;
        if handle.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: null or a CUmemAllocationProp (driver API contract).
        let wanted = unsafe { wanted(prop) }?;
        granular(size)?;
        let charge = DeviceCharge::take(wanted.device, size as u64)?;
        static NEXT_MEMFD: AtomicU64 = AtomicU64::new(1);
        let name = format!(
            "{MEMFD_PREFIX}{}-{:016x}-{}",
            wanted.device,
            process_nonce(),
            NEXT_MEMFD.fetch_add(1, Ordering::Relaxed)
        );
        let fd = sealed_memfd(&name, size)?;
        let physical =
            Arc::new(Physical::new(fd, size, wanted.device, wanted.handle_types, wanted.alloc_flags, Some(charge)));
        let id = lock(&VMM).hold(&physical);
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(handle, id) }
    })
}

/// Drops one reference to the handle; the last one takes it out of the
/// table (a later use is `CUDA_ERROR_INVALID_VALUE`). The memory stays
/// while a mapping of it does.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    entry(|| {
        config()?;
        let gone = {
            let mut vmm = lock(&VMM);
            let held = vmm.handles.get_mut(&handle).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            held.refs -= 1;
            if held.refs > 0 {
                return Ok(());
            }
            stats::sub(Counter::VmmHandles, 1);
            vmm.handles.remove(&handle)
        };
        drop(gone);
        Ok(())
    })
}

/// `size` bytes (a multiple of the granularity) of address space aligned
/// to `alignment` (0 or a power of two; at least the granularity). The
/// address hint `addr` is ignored; `flags` must be 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    _addr: CUdeviceptr,
    flags: c_ulonglong,
) -> CUresult {
    entry(|| {
        config()?;
        if ptr.is_null() || flags != 0 || (alignment != 0 && !alignment.is_power_of_two()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        granular(size)?;
        let reservation = Reservation::new(size, alignment.max(GRANULARITY))?;
        let base = reservation.base;
        lock(&VMM).reservations.insert(base, reservation);
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(ptr, base as CUdeviceptr) }
    })
}

/// Exactly a reservation (its base and size) with nothing mapped in it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    entry(|| {
        config()?;
        let base = address(ptr)?;
        let gone = {
            let mut vmm = lock(&VMM);
            match vmm.reservations.get(&base) {
                Some(r) if r.size == size => {}
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
            if lock(&TABLE).range(base..base + size).next().is_some() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            vmm.reservations.remove(&base)
        };
        drop(gone);
        Ok(())
    })
}

/// Maps the first `size` bytes of the handle's allocation at
/// `[ptr, ptr + size)`: granularity-aligned, inside one reservation, over
/// no other mapping. `offset` and `flags` must be 0 (as in CUDA). The
/// mapping is not accessible until cuMemSetAccess grants access.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: u64,
    flags: c_ulonglong,
) -> CUresult {
    entry(|| {
        config()?;
        if offset != 0 || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        granular(size)?;
        let base = address(ptr)?;
        let end = base.checked_add(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if base % GRANULARITY != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let physical = lock(&VMM).physical(handle)?;
        if size > physical.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ctx = Ctx(physical.device);
        // The alias is made, and on failure dropped, outside the locks.
        let mapping = Arc::new(VmmMapping::new(physical, size)?);
        let region = Region {
            base,
            size,
            ctx,
            buffer_id: next_buffer_id(),
            sync_memops: false,
            backing: Backing::Vmm { mapping, access: DeviceAccess::default() },
        };
        let vmm = lock(&VMM);
        if !vmm.reserved(base, end) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut table = lock(&TABLE);
        let overlaps = table.range(..end).next_back().is_some_and(|(_, r)| r.end() > base);
        if overlaps {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        table.insert(base, region);
        stats::add(Counter::VmmMappings, 1);
        Ok(())
    })
}

/// Unmaps whole mappings: `[ptr, ptr + size)` must start at a mapping and
/// end where a mapping ends, with mappings back to back in between. Their
/// memory stays while a handle (or a copy in flight) holds it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    entry(|| {
        config()?;
        let base = address(ptr)?;
        let end = base.checked_add(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let gone: Vec<Region> = {
            let mut table = lock(&TABLE);
            let bases = whole_mappings(&table, base, end)?;
            bases.iter().filter_map(|b| table.remove(b)).collect()
        };
        stats::sub(Counter::VmmMappings, gone.len() as u64);
        drop(gone);
        Ok(())
    })
}

/// Sets each described device's access to whole mappings covering
/// `[ptr, ptr + size)` (as for cuMemUnmap): `PROT_READWRITE` grants
/// reads and writes, `PROT_READ` reads only, `PROT_NONE` revokes. Every
/// descriptor is checked before any is applied.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const AccessDesc,
    count: usize,
) -> CUresult {
    entry(|| {
        config()?;
        if desc.is_null() || count == 0 || count > MAX_DEVICES {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut grants = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: the caller passes `count` descriptors (driver API
            // contract); `i < count`; plain data, any alignment.
            let d = unsafe { desc.add(i).read_unaligned() };
            if d.location.type_ != LOCATION_TYPE_DEVICE
                || !matches!(d.flags, ACCESS_PROT_NONE | ACCESS_PROT_READ | ACCESS_PROT_READWRITE)
            {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            grants.push((device(d.location.id)?, d.flags));
        }
        let base = address(ptr)?;
        let end = base.checked_add(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut table = lock(&TABLE);
        for b in whole_mappings(&table, base, end)? {
            if let Some(Region { backing: Backing::Vmm { access, .. }, .. }) = table.get_mut(&b) {
                for &(device, flags) in &grants {
                    access.set(device, flags);
                }
            }
        }
        Ok(())
    })
}

/// The access `location` (a device) has to the mapping holding `ptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAccess(
    flags: *mut c_ulonglong,
    location: *const MemLocation,
    ptr: CUdeviceptr,
) -> CUresult {
    entry(|| {
        config()?;
        if flags.is_null() || location.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null, a CUmemLocation (driver API contract); plain data.
        let location = unsafe { location.read_unaligned() };
        if location.type_ != LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = device(location.id)?;
        let addr = address(ptr)?;
        let granted = match find(&lock(&TABLE), addr) {
            Some(Region { backing: Backing::Vmm { access, .. }, .. }) => access.flags(dev),
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(flags, c_ulonglong::from(granted)) }
    })
}

/// The handle of the allocation mapped at `addr` (any address in a
/// mapping), with one more reference for the caller to release. The same
/// handle value as cuMemCreate or the import gave, even if that was
/// released meanwhile.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void) -> CUresult {
    entry(|| {
        config()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = {
            let mut vmm = lock(&VMM);
            let physical = match find(&lock(&TABLE), addr as usize) {
                Some(Region { backing: Backing::Vmm { mapping, .. }, .. }) => Arc::clone(&mapping.physical),
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            };
            vmm.hold(&physical)
        };
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(handle, id) }
    })
}

/// What the allocation was made as: pinned, on its device, with the handle
/// types requested (an import: POSIX file descriptors).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle(prop: *mut AllocationProp, handle: u64) -> CUresult {
    entry(|| {
        config()?;
        if prop.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let physical = lock(&VMM).physical(handle)?;
        let value = AllocationProp {
            type_: ALLOCATION_TYPE_PINNED,
            requested_handle_types: physical.handle_types,
            location: MemLocation { type_: LOCATION_TYPE_DEVICE, id: physical.device as c_int },
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: physical.alloc_flags,
        };
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(prop, value) }
    })
}

/// For `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, writes an `int` to
/// `*shareable`: a new descriptor (close-on-exec) of the allocation's
/// memfd, the caller's to close. An allocation made without that type
/// requested is `CUDA_ERROR_INVALID_VALUE`. `flags` must be 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: u64,
    handle_type: c_uint,
    flags: c_ulonglong,
) -> CUresult {
    entry(|| {
        config()?;
        if shareable.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        shareable_type(handle_type)?;
        let physical = lock(&VMM).physical(handle)?;
        if physical.handle_types & HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: duplicates a descriptor this value owns.
        let fd = unsafe { libc::fcntl(physical.fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(match errno() {
                libc::EMFILE | libc::ENFILE => CUDA_ERROR_OUT_OF_MEMORY,
                _ => CUDA_ERROR_OPERATING_SYSTEM,
            });
        }
        // SAFETY: non-null, an int for this handle type (driver API contract).
        unsafe { write_out(shareable.cast::<c_int>(), fd) }
    })
}

/// The allocation behind a descriptor the shim exported (from this process
/// or another), as a new physical allocation of this process holding its
/// own duplicate of the descriptor. Anything else is
/// `CUDA_ERROR_INVALID_VALUE`: a number that is no open descriptor, or one
/// that is not a memfd named as cuMemCreate names them, sealed against
/// resizing, open for reading and writing, of a non-zero multiple of the
/// granularity. Its device is the one in the memfd's name (which must
/// exist here: `CUDA_ERROR_INVALID_DEVICE` otherwise).
fn import(os_handle: usize) -> CuResult<Arc<Physical>> {
    let raw = c_int::try_from(os_handle).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    // SAFETY: F_DUPFD_CLOEXEC on any number: EBADF for one that is no
    // descriptor, else a new descriptor this process owns. Checking the
    // duplicate, not the caller's number, keeps what is checked and what
    // is kept the same file.
    let dup = unsafe { libc::fcntl(raw, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(match errno() {
            libc::EMFILE | libc::ENFILE => CUDA_ERROR_OUT_OF_MEMORY,
            _ => CUDA_ERROR_INVALID_VALUE,
        });
    }
    // SAFETY: just made, owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(dup) };
    let link = std::fs::read_link(format!("/proc/self/fd/{dup}")).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let named = link.to_str().and_then(shim_memfd_device).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let sealed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    // SAFETY: queries of a descriptor this function owns.
    let (seals, mode) =
        unsafe { (libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS), libc::fcntl(fd.as_raw_fd(), libc::F_GETFL)) };
    if seals < 0 || seals & sealed != sealed || mode < 0 || mode & libc::O_ACCMODE != libc::O_RDWR {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: an all-zero stat is a valid value; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a descriptor this function owns; `st` is writable.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let size = usize::try_from(st.st_size).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    granular(size)?;
    let dev = device(c_int::try_from(named).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?)?;
    Ok(Arc::new(Physical::new(fd, size, dev, HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, AllocFlags::default(), None)))
}

/// For `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, `os_handle` is the
/// descriptor itself, cast to a pointer; the caller keeps it (the shim
/// keeps a duplicate). Each import is a handle of its own, which maps,
/// exports and releases like a created one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut u64,
    os_handle: *mut c_void,
    handle_type: c_uint,
) -> CUresult {
    entry(|| {
        config()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        shareable_type(handle_type)?;
        let physical = import(os_handle as usize)?;
        let id = lock(&VMM).hold(&physical);
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(handle, id) }
    })
}
