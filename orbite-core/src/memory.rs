//! Memory owners: the only objects that own backing bytes.
//!
//! [`HostMemory`] is page-aligned memory allocated by the engine; every
//! registration of a range inside it holds a reference, so the bytes are
//! freed exactly once, after the last registration and the last borrower
//! are gone. [`MemoryRange`] names what to register: a range of a
//! `HostMemory`, or a caller's own range (borrowed: the caller keeps it
//! alive until the owner-release callback runs or a retirement receipt
//! proves nothing uses it).

use std::ptr::NonNull;
use std::sync::Arc;

use crate::charge::{Charge, Counter, Counters};
pub use crate::types::Permission;
use crate::types::{Exhausted, Resource};

/// Memory could not be allocated or named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    /// A range was empty, null, wrapped the address space or fell outside
    /// its memory.
    #[error("invalid memory range: {0}")]
    InvalidRange(String),
    /// A budget (host memory, registrations, registered bytes) is full.
    #[error(transparent)]
    Exhausted(#[from] Exhausted),
    /// The operating system refused (allocation, shared file, mapping).
    #[error("system error: {0}")]
    System(String),
    /// This build or this machine cannot hold this kind of memory (VRAM
    /// without feature `cuda`, without a driver or without a device); the
    /// reason names what is missing.
    #[error("not supported: {0}")]
    NotSupported(String),
}

/// Alignment of engine-allocated host memory.
pub const PAGE_SIZE: usize = 4096;

/// Kind of memory behind a registration.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary host DRAM (engine-allocated or borrowed): private to this
    /// process; a same-host peer may reach it only through CMA.
    Host,
    /// A range of a shared allocation: a same-host peer proven over the
    /// local socket is handed the allocation (a sealed memfd) by `name`,
    /// maps it and copies at `offset` in it.
    Shm {
        /// The allocation's name (unique in this process).
        name: Arc<str>,
        /// Offset of the registration in that file.
        offset: u64,
    },
    /// CUDA device memory (feature `cuda`), validated with the driver: its
    /// base is a device address, which nothing in the engine dereferences;
    /// only driver copies reach it. Not offered to peers, and refused by
    /// every route, until a route that stages device memory takes it.
    Cuda {
        /// The CUDA ordinal.
        device: u32,
    },
}

struct HostAllocation {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes mapped at `ptr`.
    map_len: usize,
    /// Where the bytes come from. `None`: a private anonymous mapping
    /// (zero-filled by the kernel), on a huge-page boundary and offered
    /// transparent huge pages when it is at least one huge page long.
    /// Else the name and descriptor of a memfd mapped shared, so that a
    /// peer on the same host can map the same pages. Sealed against
    /// shrinking and growing: no one, this process included, can truncate
    /// it under a peer's mapping (which would fault the peer on its next
    /// access).
    shared: Option<(Arc<str>, std::os::fd::OwnedFd)>,
    _charge: Charge,
}

// SAFETY: the allocation is plain bytes owned by this value; access to the
// bytes goes through raw pointers whose users uphold the transfer contract.
unsafe impl Send for HostAllocation {}
// SAFETY: as above; the struct itself has no interior mutability.
unsafe impl Sync for HostAllocation {}

impl Drop for HostAllocation {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`map_len` are the mapping made in `map_private` or
        // `allocate_shared`, unmapped only here; Drop runs once, after the
        // last Arc reference. Peers that mapped a memfd keep their own
        // mapping of the same pages.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

/// Transparent huge page size (x86-64 and most aarch64 kernels): private
/// allocations at least this long start on such a boundary.
const HUGE_PAGE: usize = 2 << 20;

/// Maps `map_len` (a multiple of [`PAGE_SIZE`], nonzero) private, zeroed
/// bytes. At least [`HUGE_PAGE`] long, the mapping starts on a huge-page
/// boundary and is offered transparent huge pages (`MADV_HUGEPAGE`, which
/// a kernel with them set to `never` ignores): a copy then walks far
/// fewer pages, and the kernel's cross-memory copy (cma) pins one page
/// per 2 MiB instead of 512.
fn map_private(map_len: usize) -> Result<NonNull<u8>, MemoryError> {
    let huge = map_len >= HUGE_PAGE;
    let reserve = if huge { map_len + HUGE_PAGE } else { map_len };
    // SAFETY: a fresh private anonymous mapping; no existing memory is
    // touched.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        let e = std::io::Error::last_os_error();
        return Err(MemoryError::System(format!("allocation of {map_len} bytes failed: {e}")));
    }
    let mut start = raw as usize;
    if huge {
        let base = start;
        start = base.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (start - base, reserve - (start - base) - map_len);
        // SAFETY: the unused head and tail of the reservation just made,
        // outside [start, start + map_len); nothing refers to them.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((start + map_len) as *mut libc::c_void, tail);
            }
            libc::madvise(start as *mut libc::c_void, map_len, libc::MADV_HUGEPAGE);
        }
    }
    NonNull::new(start as *mut u8).ok_or_else(|| MemoryError::System("mmap returned null".into()))
}

/// Page-aligned, zero-initialised host memory allocated by the engine:
/// private heap memory ([`crate::TransferEngine::allocate_host_memory`]) or
/// a shared allocation a same-host peer can map
/// ([`crate::TransferEngine::allocate_shm_memory`]).
///
/// Cloning shares the same bytes. The bytes are freed when the last clone
/// and the last registration of a range inside it are gone.
#[derive(Clone)]
pub struct HostMemory {
    alloc: Arc<HostAllocation>,
}

static SHM_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemory").field("ptr", &self.alloc.ptr).field("len", &self.len()).finish()
    }
}

impl HostMemory {
    /// A shared allocation: a memfd sealed at its size, mapped shared.
    /// Nothing is left behind in any file system: the pages go with the
    /// last mapping and the last descriptor, also when the process dies.
    pub(crate) fn allocate_shared(
        counters: &Arc<Counters>,
        len: usize,
        limit: u64,
        tag: u64,
    ) -> Result<Self, MemoryError> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        if len == 0 {
            return Err(MemoryError::InvalidRange("shared memory of zero bytes".into()));
        }
        let map_len =
            len.checked_next_multiple_of(PAGE_SIZE).ok_or_else(|| MemoryError::InvalidRange(format!("{len} bytes")))?;
        let charge = Charge::try_new(
            counters,
            [
                (Counter::HostAllocations, 1, None),
                (Counter::HostMemoryBytes, len as u64, Some((Resource::HostMemoryBytes, limit))),
            ],
        )?;
        let seq = SHM_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name: Arc<str> = format!("orbite-{tag:x}-{seq}").into();
        let sys = |what: &str| {
            MemoryError::System(format!("{what} of shared memory {name}: {}", std::io::Error::last_os_error()))
        };
        let cname = std::ffi::CString::new(&*name).map_err(|_| MemoryError::InvalidRange(name.to_string()))?;
        // SAFETY: memfd_create with a valid C string.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(sys("memfd_create"));
        }
        // SAFETY: a fresh descriptor this function now owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain system calls on the descriptor just created.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), map_len as libc::off_t) } != 0 {
            return Err(sys("sizing"));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(sys("sealing"));
        }
        // SAFETY: a fresh shared mapping of a memfd of exactly this size; no
        // other mapping aliases it in this process.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(sys("mapping"));
        }
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| MemoryError::System("mmap returned null".into()))?;
        Ok(HostMemory {
            alloc: Arc::new(HostAllocation { ptr, len, map_len, shared: Some((name, fd)), _charge: charge }),
        })
    }

    /// The descriptor of a shared allocation (handed to proven same-host
    /// peers over the local socket).
    pub(crate) fn shared_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.alloc.shared.as_ref().map(|(_, fd)| fd.as_fd())
    }

    /// The name a shared allocation is known by to same-host peers.
    pub fn shared_name(&self) -> Option<&str> {
        self.alloc.shared.as_ref().map(|(name, _)| &**name)
    }

    pub(crate) fn shared_name_arc(&self) -> Option<Arc<str>> {
        self.alloc.shared.as_ref().map(|(name, _)| name.clone())
    }

    pub(crate) fn allocate(counters: &Arc<Counters>, len: usize, limit: u64) -> Result<Self, MemoryError> {
        if len == 0 {
            return Err(MemoryError::InvalidRange("host memory of zero bytes".into()));
        }
        let map_len = len
            .checked_next_multiple_of(PAGE_SIZE)
            .filter(|&n| n <= isize::MAX as usize - HUGE_PAGE)
            .ok_or_else(|| MemoryError::InvalidRange(format!("host memory of {len} bytes")))?;
        let charge = Charge::try_new(
            counters,
            [
                (Counter::HostAllocations, 1, None),
                (Counter::HostMemoryBytes, len as u64, Some((Resource::HostMemoryBytes, limit))),
            ],
        )?;
        let ptr = map_private(map_len)?;
        Ok(HostMemory { alloc: Arc::new(HostAllocation { ptr, len, map_len, shared: None, _charge: charge }) })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.alloc.len
    }

    /// Never true: zero-byte allocations are refused.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Base address (page aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.alloc.ptr.as_ptr()
    }

    /// Copies `data` into the memory at `offset`.
    ///
    /// # Safety
    /// No transfer may be accessing the written range concurrently (the
    /// same rule as for any memory a transfer engine or a NIC may touch).
    ///
    /// # Panics
    /// If the range is outside the allocation.
    pub unsafe fn write(&self, offset: usize, data: &[u8]) {
        let end = offset.checked_add(data.len()).expect("range overflows");
        assert!(end <= self.len(), "write outside host memory");
        // SAFETY: in bounds (checked above); no concurrent access per the
        // caller's contract; `data` cannot alias engine-owned memory
        // mutably because it is a shared borrow of caller memory.
        unsafe { std::ptr::copy(data.as_ptr(), self.as_ptr().add(offset), data.len()) }
    }

    /// Copies bytes at `offset` into `out`.
    ///
    /// # Safety
    /// No transfer may be writing the read range concurrently.
    ///
    /// # Panics
    /// If the range is outside the allocation.
    pub unsafe fn read(&self, offset: usize, out: &mut [u8]) {
        let end = offset.checked_add(out.len()).expect("range overflows");
        assert!(end <= self.len(), "read outside host memory");
        // SAFETY: in bounds; no concurrent writer per the caller's contract.
        unsafe { std::ptr::copy(self.as_ptr().add(offset), out.as_mut_ptr(), out.len()) }
    }

    /// Number of references to the allocation (clones and registrations).
    pub fn reference_count(&self) -> usize {
        Arc::strong_count(&self.alloc)
    }
}

/// Called exactly once when a borrowed registration's owner is destroyed,
/// which is after deregistration and after the last borrower retired.
pub type OwnerRelease = Box<dyn FnOnce() + Send + 'static>;

pub(crate) enum Backing {
    /// Holds a reference: the allocation outlives the registration.
    Host(#[allow(dead_code)] HostMemory),
    Borrowed(Option<OwnerRelease>),
    /// Device memory: the context lease (and, for engine-allocated memory,
    /// the allocation) lives as long as the registration, so until its
    /// last borrower retired; a caller's own range may carry an owner
    /// release as a borrowed one does.
    Cuda {
        #[allow(dead_code, reason = "held for its drop: the context stays alive as long as the range")]
        lease: Arc<crate::cuda::ContextLease>,
        #[allow(dead_code, reason = "held for its drop")]
        memory: Option<CudaMemory>,
        release: Option<OwnerRelease>,
    },
}

/// CUDA device memory allocated by the engine
/// ([`crate::TransferEngine::allocate_cuda_memory`], feature `cuda`), in
/// the device's primary context. Cloning shares the allocation; it is freed
/// after the last clone and the last registration of a range inside it.
#[derive(Clone)]
pub struct CudaMemory {
    alloc: Arc<CudaAllocation>,
}

struct CudaAllocation {
    device: crate::cuda::DeviceAllocation,
    lease: Arc<crate::cuda::ContextLease>,
    _charge: Charge,
}

impl std::fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaMemory")
            .field("device", &self.device())
            .field("ptr", &format_args!("{:#x}", self.device_ptr()))
            .field("len", &self.len())
            .finish()
    }
}

impl CudaMemory {
    pub(crate) fn allocate(counters: &Arc<Counters>, device: u32, len: usize) -> Result<Self, MemoryError> {
        crate::cuda::availability()
            .map_err(|why| MemoryError::NotSupported(format!("VRAM is not available: {why}")))?;
        if len == 0 {
            return Err(MemoryError::InvalidRange("device memory of zero bytes".into()));
        }
        let charge = Charge::try_new(
            counters,
            [(Counter::DeviceAllocations, 1, None), (Counter::DeviceMemoryBytes, len as u64, None)],
        )?;
        let device =
            crate::cuda::DeviceAllocation::new(device, len as u64).map_err(|e| MemoryError::System(e.to_string()))?;
        let lease =
            Arc::new(crate::cuda::ContextLease::retain(device.device).map_err(|e| MemoryError::System(e.to_string()))?);
        Ok(CudaMemory { alloc: Arc::new(CudaAllocation { device, lease, _charge: charge }) })
    }

    /// The CUDA ordinal.
    pub fn device(&self) -> u32 {
        self.alloc.device.device
    }

    /// The device address of the first byte (never dereference it on the
    /// host).
    pub fn device_ptr(&self) -> u64 {
        self.alloc.device.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.alloc.device.len as usize
    }

    /// Never true: zero-byte allocations are refused.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Copies `data` to the device at `offset` (a synchronous driver copy).
    ///
    /// # Safety
    /// No transfer may be accessing the written range concurrently.
    pub unsafe fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemoryError> {
        self.alloc.device.write(offset as u64, data).map_err(|e| MemoryError::InvalidRange(e.to_string()))
    }

    /// Copies device bytes at `offset` into `out` (a synchronous driver
    /// copy).
    ///
    /// # Safety
    /// No transfer may be writing the read range concurrently.
    pub unsafe fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), MemoryError> {
        self.alloc.device.read(offset as u64, out).map_err(|e| MemoryError::InvalidRange(e.to_string()))
    }

    /// Number of references to the allocation (clones and registrations).
    pub fn reference_count(&self) -> usize {
        Arc::strong_count(&self.alloc)
    }
}

/// Checks that `ptr..ptr + len` is mapped in this process, readable, and
/// writable when `writable`, as `/proc/self/maps` lists it now: for
/// callers that name memory by a bare address (a Python caller's
/// `(ptr, length)`) before [`MemoryRange::borrowed`]. It proves only that
/// the range is mapped now: keeping it so is still the caller's promise.
pub fn check_mapped(ptr: u64, len: u64, writable: bool) -> Result<(), MemoryError> {
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| MemoryError::System(format!("reading /proc/self/maps: {e}")))?;
    check_mapped_in(&maps, ptr, len, writable)
}

/// [`check_mapped`] against a maps listing.
fn check_mapped_in(maps: &str, ptr: u64, len: u64, writable: bool) -> Result<(), MemoryError> {
    if ptr == 0 || len == 0 {
        return Err(MemoryError::InvalidRange("a null or empty range".into()));
    }
    let end = ptr.checked_add(len).ok_or_else(|| MemoryError::InvalidRange(format!("{ptr:#x}+{len} wraps")))?;
    // The mappings are listed in address order: walk those that overlap,
    // and require them to cover the range with no gap.
    let mut at = ptr;
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(span), Some(perms)) = (fields.next(), fields.next()) else { continue };
        let Some((lo, hi)) = span.split_once('-') else { continue };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else { continue };
        if hi <= at {
            continue;
        }
        if lo > at {
            break;
        }
        let p = perms.as_bytes();
        if p.first() != Some(&b'r') || (writable && p.get(1) != Some(&b'w')) {
            return Err(MemoryError::InvalidRange(format!(
                "{ptr:#x}+{len}: the mapping at {lo:#x} is {perms}, not {}",
                if writable { "readable and writable" } else { "readable" }
            )));
        }
        at = hi;
        if at >= end {
            return Ok(());
        }
    }
    Err(MemoryError::InvalidRange(format!("{ptr:#x}+{len}: {at:#x} is not mapped in this process")))
}

/// Checks that `offset..offset + len` is a non-empty range of `size` bytes
/// of `what` memory.
fn in_bounds(offset: usize, len: usize, size: usize, what: &str) -> Result<(), MemoryError> {
    let end = offset.checked_add(len).ok_or_else(|| MemoryError::InvalidRange("offset + len overflows".into()))?;
    if len == 0 || end > size {
        return Err(MemoryError::InvalidRange(format!("{offset}..{end} of {what} memory of {size} bytes")));
    }
    Ok(())
}

/// A range to register.
pub struct MemoryRange {
    pub(crate) ptr: *mut u8,
    pub(crate) len: u64,
    pub(crate) permission: Permission,
    pub(crate) backing: Backing,
}

// SAFETY: the raw pointer is only an address here; whoever built the range
// vouched for it (safe for `HostMemory`, `unsafe fn borrowed` otherwise).
unsafe impl Send for MemoryRange {}

impl std::fmt::Debug for MemoryRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRange")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("permission", &self.permission)
            .finish()
    }
}

impl MemoryRange {
    /// A range `offset..offset + len` of engine-allocated host memory.
    pub fn host(memory: &HostMemory, offset: usize, len: usize, permission: Permission) -> Result<Self, MemoryError> {
        in_bounds(offset, len, memory.len(), "host")?;
        Ok(MemoryRange {
            // SAFETY (of the arithmetic): offset <= len of the allocation.
            ptr: memory.as_ptr().wrapping_add(offset),
            len: len as u64,
            permission,
            backing: Backing::Host(memory.clone()),
        })
    }

    /// A caller-owned range `ptr..ptr + len`.
    ///
    /// # Safety
    /// The bytes must stay valid for reads and writes until the engine
    /// gives them up: until `on_release` runs (see
    /// [`MemoryRange::with_owner_release`]), or, without it, until the
    /// range is deregistered and every transfer naming it has a retirement
    /// receipt and is released.
    pub unsafe fn borrowed(ptr: *mut u8, len: usize, permission: Permission) -> Self {
        MemoryRange { ptr, len: len as u64, permission, backing: Backing::Borrowed(None) }
    }

    /// A range `offset..offset + len` of engine-allocated device memory.
    pub fn cuda(memory: &CudaMemory, offset: usize, len: usize, permission: Permission) -> Result<Self, MemoryError> {
        in_bounds(offset, len, memory.len(), "device")?;
        Ok(MemoryRange {
            ptr: (memory.device_ptr() + offset as u64) as *mut u8,
            len: len as u64,
            permission,
            backing: Backing::Cuda { lease: memory.alloc.lease.clone(), memory: Some(memory.clone()), release: None },
        })
    }

    /// A caller's CUDA device range `ptr..ptr + len` on device `device`
    /// (the CUDA ordinal), checked with the driver now: it must be device
    /// memory of that device, inside one allocation. The engine then holds
    /// a reference on the device's primary context for as long as any
    /// borrower may copy from or to the range, and reaches the bytes only
    /// through driver copies.
    ///
    /// Refused with [`MemoryError::NotSupported`] in a build without
    /// feature `cuda`, or where the driver or the device is missing.
    ///
    /// # Safety
    /// The allocation (and its context, if it is not the primary one) must
    /// stay alive until the engine gives the range up, as for
    /// [`MemoryRange::borrowed`]; and the caller has finished producing the
    /// bytes (its streams synchronised) before posting a transfer that
    /// reads them: the engine never synchronises a caller's stream.
    pub unsafe fn cuda_borrowed(device: u32, ptr: u64, len: u64, permission: Permission) -> Result<Self, MemoryError> {
        crate::cuda::availability()
            .map_err(|why| MemoryError::NotSupported(format!("VRAM is not available: {why}")))?;
        if len > isize::MAX as u64 {
            return Err(MemoryError::InvalidRange(format!("{ptr:#x}+{len} wraps the address space")));
        }
        let range = crate::cuda::validate(device, ptr, len).map_err(|e| MemoryError::InvalidRange(e.to_string()))?;
        let lease =
            Arc::new(crate::cuda::ContextLease::retain(range.device).map_err(|e| MemoryError::System(e.to_string()))?);
        Ok(MemoryRange {
            ptr: ptr as *mut u8,
            len,
            permission,
            backing: Backing::Cuda { lease, memory: None, release: None },
        })
    }

    /// Runs `release` exactly once when the engine no longer uses a
    /// borrowed range (an allocator lease handed to the engine).
    /// Has no effect on ranges of memory the engine allocated (host or
    /// device), which it owns already.
    pub fn with_owner_release(mut self, release: OwnerRelease) -> Self {
        match &mut self.backing {
            Backing::Borrowed(slot) => *slot = Some(release),
            Backing::Cuda { memory: None, release: slot, .. } => *slot = Some(release),
            _ => {}
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_mapped_walks_the_maps() {
        let maps = "1000-3000 rw-p 0 00:00 0\n3000-4000 r--p 0 00:00 0\n5000-6000 rw-p 0 00:00 0 [heap]\n";
        assert!(check_mapped_in(maps, 0x1000, 0x2000, true).is_ok());
        assert!(check_mapped_in(maps, 0x2000, 0x2000, false).is_ok());
        assert!(check_mapped_in(maps, 0x2000, 0x2000, true).is_err(), "read-only page");
        assert!(check_mapped_in(maps, 0x3800, 0x1000, false).is_err(), "a gap");
        assert!(check_mapped_in(maps, 0x6000, 1, false).is_err(), "past the end");
        assert!(check_mapped_in(maps, 0, 1, false).is_err());
        assert!(check_mapped_in(maps, u64::MAX, 2, false).is_err());
        let v = vec![7u8; 10000];
        assert!(check_mapped(v.as_ptr() as u64, 10000, true).is_ok());
        assert!(check_mapped(8, 8, false).is_err());
    }
    use crate::charge::Stats;

    /// The `/proc/self/smaps` entry of the mapping that holds `addr`.
    fn smaps_entry(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut entry = String::new();
        let mut inside = false;
        for line in smaps.lines() {
            let head = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = head.split_once('-').filter(|(lo, _)| !lo.contains(':')) {
                let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) else { continue };
                if inside {
                    break;
                }
                inside = (lo..hi).contains(&addr);
            }
            if inside {
                entry.push_str(line);
                entry.push('\n');
            }
        }
        entry
    }

    #[test]
    fn private_memory_is_zeroed_aligned_and_charged_until_dropped() {
        let counters = Arc::new(Counters::default());
        for len in [1, PAGE_SIZE, PAGE_SIZE + 1, HUGE_PAGE - 1, HUGE_PAGE, 2 * HUGE_PAGE + 3 * PAGE_SIZE + 5] {
            let m = HostMemory::allocate(&counters, len, u64::MAX).expect("allocate");
            assert_eq!(m.len(), len);
            let addr = m.as_ptr() as usize;
            let align = if len.next_multiple_of(PAGE_SIZE) >= HUGE_PAGE { HUGE_PAGE } else { PAGE_SIZE };
            assert_eq!(addr % align, 0, "{len} bytes at {addr:#x}");
            assert_eq!(counters.get(Counter::HostMemoryBytes), len as u64);
            assert_eq!(counters.get(Counter::HostAllocations), 1);
            // SAFETY: the whole allocation is ours, and nothing else uses it.
            let bytes = unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), len) };
            assert!(bytes.iter().all(|&b| b == 0), "{len} bytes zeroed");
            bytes[0] = 1;
            bytes[len - 1] = 2;
            drop(m);
            assert_eq!(counters.get(Counter::HostMemoryBytes), 0);
            assert_eq!(counters.get(Counter::HostAllocations), 0);
        }
    }

    #[test]
    fn a_refused_allocation_maps_nothing_and_charges_nothing() {
        let counters = Arc::new(Counters::default());
        assert!(matches!(HostMemory::allocate(&counters, 0, u64::MAX), Err(MemoryError::InvalidRange(_))));
        assert!(matches!(
            HostMemory::allocate(&counters, usize::MAX - 10, u64::MAX),
            Err(MemoryError::InvalidRange(_))
        ));
        assert!(HostMemory::allocate(&counters, HUGE_PAGE, HUGE_PAGE as u64 - 1).is_err(), "over the budget");
        assert_eq!(counters.snapshot(), Stats::default());
    }

    #[test]
    fn large_private_memory_is_offered_transparent_huge_pages() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if !mode.contains('[') || mode.contains("[never]") {
            eprintln!("SKIP: transparent huge pages are off on this kernel ({})", mode.trim());
            return;
        }
        let counters = Arc::new(Counters::default());
        let m = HostMemory::allocate(&counters, 4 * HUGE_PAGE, u64::MAX).expect("allocate");
        let entry = smaps_entry(m.as_ptr() as usize);
        let eligible = entry.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["THPeligible:", "1"]);
        assert!(eligible, "the mapping is eligible for huge pages:\n{entry}");
        assert!(entry.lines().any(|l| l.starts_with("VmFlags:") && l.contains(" hg")), "MADV_HUGEPAGE:\n{entry}");
        let small = HostMemory::allocate(&counters, HUGE_PAGE / 2, u64::MAX).expect("allocate");
        let entry = smaps_entry(small.as_ptr() as usize);
        assert!(!entry.lines().any(|l| l.starts_with("VmFlags:") && l.contains(" hg")), "small stays 4 KiB:\n{entry}");
    }
}
