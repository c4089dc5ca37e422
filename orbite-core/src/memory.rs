//! Memory owners: the only objects that own backing bytes.
//!
//! [`HostMemory`] is page-aligned memory allocated by the engine; every
//! registration of a range inside it holds a reference, so the bytes are
//! freed exactly once, after the last registration and the last borrower
//! are gone. [`MemoryRange`] names what to register: a range of a
//! `HostMemory`, or a caller's own range (borrowed: the caller keeps it
//! alive until the owner-release callback runs or a retirement receipt
//! proves nothing uses it).

use std::alloc::Layout;
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
}

/// Alignment of engine-allocated host memory.
pub const PAGE_SIZE: usize = 4096;

/// Kind of memory behind a registration.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary host DRAM (engine-allocated or borrowed): private to this
    /// process; a same-host peer may reach it only through CMA.
    Host,
    /// A range of a shared allocation: peers on the same boot can map the
    /// file `name` under /dev/shm and copy at `offset` in it.
    Shm {
        /// File name under /dev/shm.
        name: Arc<str>,
        /// Offset of the registration in that file.
        offset: u64,
    },
}

/// Where an allocation's bytes come from.
enum Source {
    /// The process heap.
    Heap(Layout),
    /// A file under /dev/shm mapped shared, so that a peer on the same
    /// host can map the same pages.
    Shm {
        map_len: usize,
        path: std::path::PathBuf,
        name: Arc<str>,
        /// Held open with a shared lock for the allocation's life: the
        /// owner's liveness proof, seen from any pid namespace.
        _lock: std::fs::File,
    },
}

struct HostAllocation {
    ptr: NonNull<u8>,
    len: usize,
    source: Source,
    _charge: Charge,
}

// SAFETY: the allocation is plain bytes owned by this value; access to the
// bytes goes through raw pointers whose users uphold the transfer contract.
unsafe impl Send for HostAllocation {}
// SAFETY: as above; the struct itself has no interior mutability.
unsafe impl Sync for HostAllocation {}

impl Drop for HostAllocation {
    fn drop(&mut self) {
        match &self.source {
            // SAFETY: `ptr` came from `alloc_zeroed(layout)` and is freed
            // only here; Drop runs once, after the last Arc reference.
            Source::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) },
            Source::Shm { map_len, path, .. } => {
                // SAFETY: `ptr`/`map_len` are the mapping made in
                // `allocate_shared`, unmapped only here. Peers that mapped
                // the file keep their own mapping of the same pages.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), *map_len) };
                let _ = std::fs::remove_file(path);
            }
        }
    }
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

/// Removes the /dev/shm files of engines whose process is provably gone (a
/// crash or a kill leaves them behind). Proof is the owner's lock: every
/// engine holds a shared `flock` on its files for as long as they live,
/// and the kernel drops it when the process ends, in whatever pid
/// namespace it ran. A file is removed only if nobody holds that lock and
/// the pid its name carries does not exist here either. A file already
/// mapped elsewhere stays valid for that mapping. Files this user may not
/// open or remove, and symbolic links, are left alone.
fn sweep_orphaned_shared_files() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("orbite-")).and_then(|n| n.split('-').next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<i32>() else { continue };
        // SAFETY: kill with signal 0 only checks whether the process exists.
        let gone_here = pid > 0
            && unsafe { libc::kill(pid, 0) } == -1
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if !gone_here {
            continue;
        }
        let Ok(file) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(entry.path())
        else {
            continue;
        };
        // SAFETY: flock on a descriptor this function owns.
        let unlocked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
        if unlocked && file.metadata().is_ok_and(|m| m.is_file()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

impl HostMemory {
    /// A shared allocation: a new file under /dev/shm, mapped shared. Only
    /// this process creates it (exclusive create, mode 0600); it is
    /// unlinked when the allocation is freed.
    pub(crate) fn allocate_shared(
        counters: &Arc<Counters>,
        len: usize,
        limit: u64,
        tag: u64,
    ) -> Result<Self, MemoryError> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
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
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(sweep_orphaned_shared_files);
        let seq = SHM_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name: Arc<str> = format!("orbite-{}-{tag:x}-{seq}", std::process::id()).into();
        let path = std::path::Path::new("/dev/shm").join(&*name);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| MemoryError::System(format!("cannot create {}: {e}", path.display())))?;
        let cleanup = |e: String| {
            let _ = std::fs::remove_file(&path);
            MemoryError::System(e)
        };
        file.set_len(map_len as u64).map_err(|e| cleanup(format!("cannot size {}: {e}", path.display())))?;
        // The liveness proof the sweep of other processes honours.
        // SAFETY: flock on the descriptor of the file just created.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } != 0 {
            return Err(cleanup(format!("cannot lock {}: {}", path.display(), std::io::Error::last_os_error())));
        }
        // SAFETY: a fresh shared mapping of a file we just sized; no other
        // mapping aliases it in this process.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(cleanup(format!("cannot map {}: {}", path.display(), std::io::Error::last_os_error())));
        }
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| cleanup("mmap returned null".into()))?;
        Ok(HostMemory {
            alloc: Arc::new(HostAllocation {
                ptr,
                len,
                source: Source::Shm { map_len, path, name, _lock: file },
                _charge: charge,
            }),
        })
    }

    /// The name peers open under /dev/shm, for a shared allocation.
    pub fn shared_name(&self) -> Option<&str> {
        match &self.alloc.source {
            Source::Shm { name, .. } => Some(name),
            Source::Heap(_) => None,
        }
    }

    pub(crate) fn shared_name_arc(&self) -> Option<Arc<str>> {
        match &self.alloc.source {
            Source::Shm { name, .. } => Some(name.clone()),
            Source::Heap(_) => None,
        }
    }

    pub(crate) fn allocate(counters: &Arc<Counters>, len: usize, limit: u64) -> Result<Self, MemoryError> {
        if len == 0 {
            return Err(MemoryError::InvalidRange("host memory of zero bytes".into()));
        }
        let layout = Layout::from_size_align(len, PAGE_SIZE)
            .map_err(|_| MemoryError::InvalidRange(format!("host memory of {len} bytes")))?;
        let charge = Charge::try_new(
            counters,
            [
                (Counter::HostAllocations, 1, None),
                (Counter::HostMemoryBytes, len as u64, Some((Resource::HostMemoryBytes, limit))),
            ],
        )?;
        // SAFETY: layout has nonzero size (checked above).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| MemoryError::System(format!("allocation of {len} bytes failed")))?;
        Ok(HostMemory { alloc: Arc::new(HostAllocation { ptr, len, source: Source::Heap(layout), _charge: charge }) })
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
        let end = offset.checked_add(len).ok_or_else(|| MemoryError::InvalidRange("offset + len overflows".into()))?;
        if len == 0 || end > memory.len() {
            return Err(MemoryError::InvalidRange(format!("{offset}..{end} of host memory of {} bytes", memory.len())));
        }
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

    /// Runs `release` exactly once when the engine no longer uses a
    /// borrowed range (an allocator lease handed to the engine).
    /// Has no effect on host-memory ranges, which the engine owns already.
    pub fn with_owner_release(mut self, release: OwnerRelease) -> Self {
        if let Backing::Borrowed(slot) = &mut self.backing {
            *slot = Some(release);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn orphaned_shared_files_of_dead_processes_are_removed() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        use std::os::fd::AsRawFd;
        let ours = format!("/dev/shm/orbite-{}-5eeb-test", std::process::id());
        let theirs = format!("/dev/shm/orbite-{dead}-5eeb-test");
        let other = format!("/dev/shm/not-orbite-{dead}-5eeb-test");
        // A process of another pid namespace: its pid does not exist here,
        // but it holds the lock on its file.
        let hidden = format!("/dev/shm/orbite-{dead}-5eeb-hidden");
        for p in [&ours, &theirs, &other, &hidden] {
            std::fs::write(p, b"x").unwrap();
        }
        let held = std::fs::File::open(&hidden).unwrap();
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_SH) }, 0);
        super::sweep_orphaned_shared_files();
        let exists = |p: &str| std::path::Path::new(p).exists();
        let kept = [exists(&ours), exists(&theirs), exists(&other), exists(&hidden)];
        for p in [&ours, &theirs, &other, &hidden] {
            let _ = std::fs::remove_file(p);
        }
        assert!(kept[0], "a live process's file is kept");
        assert!(!kept[1], "a dead process's file is removed");
        assert!(kept[2], "other files are not touched");
        assert!(kept[3], "a file whose owner holds its lock is kept, whatever its pid says");
    }
}
