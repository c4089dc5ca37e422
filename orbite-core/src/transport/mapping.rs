//! A same-host peer's shared allocations (sealed memfds it handed over its
//! local socket), mapped into this process once per peer and unmapped when
//! the last user is gone.

use std::collections::HashMap;
use std::sync::Arc;

use crate::segment::ExportedRegistration;
use crate::transport::peer_errors::MapError;

/// A peer's shared allocation mapped into this process.
pub(crate) struct ShmMapping {
    pub ptr: *mut u8,
    pub len: usize,
    /// Page-locked for the driver on the first device copy into or out of
    /// it (feature `cuda`), unpinned before it is unmapped.
    pub pin: Arc<crate::cuda::HostPin>,
}

// SAFETY: a shared mapping owned by this value; transfers access it only
// through spans whose lifetimes are bounded by the owning peer.
unsafe impl Send for ShmMapping {}
// SAFETY: as above.
unsafe impl Sync for ShmMapping {}

impl Drop for ShmMapping {
    fn drop(&mut self) {
        self.pin.release();
        // SAFETY: the mapping made in `map_shared`, unmapped once, after the
        // last transfer holding its peer is gone.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A peer's shared allocations mapped here, by name (or why not).
pub(crate) type SharedMaps = HashMap<String, Result<Arc<ShmMapping>, crate::transport::peer_errors::ShareError>>;

/// Maps a shared allocation a same-host peer handed over (a descriptor
/// received over its local socket). It must be sealed against shrinking:
/// then nobody, its owner included, can truncate it under this mapping,
/// which would fault this process on its next access.
pub(crate) fn map_fd(fd: std::os::fd::OwnedFd) -> Result<ShmMapping, MapError> {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a descriptor this function owns.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(MapError::NotSealed);
    }
    // SAFETY: stat is plain data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on an owned descriptor into a live stat.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(MapError::NotMemoryFile);
    }
    // Huge pages fault (SIGBUS) when the pool runs dry: only ordinary
    // shared memory is mapped.
    // SAFETY: statfs is plain data; fstatfs fills it.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs on an owned descriptor into a live statfs.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) } != 0 || fs.f_type == libc::HUGETLBFS_MAGIC {
        return Err(MapError::NotOrdinary);
    }
    let len = usize::try_from(st.st_size).unwrap_or(0);
    if len == 0 {
        return Err(MapError::Empty);
    }
    // SAFETY: a fresh shared mapping of the whole (sealed) file; nothing in
    // this process aliases it yet.
    let raw = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0)
    };
    if raw == libc::MAP_FAILED {
        return Err(MapError::Mmap(std::io::Error::last_os_error().to_string()));
    }
    Ok(ShmMapping { ptr: raw.cast(), len, pin: Arc::new(crate::cuda::HostPin::new(raw as u64, len as u64)) })
}

/// The names of the shared allocations `regs` lie in that `maps` lacks,
/// once each.
pub(crate) fn unmapped<'a>(maps: &SharedMaps, regs: impl IntoIterator<Item = &'a ExportedRegistration>) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for r in regs {
        if let Some((name, _)) = &r.shm {
            if !maps.contains_key(name) && seen.insert(name.as_str()) {
                out.push(name.clone());
            }
        }
    }
    out
}

/// Where a shared registration of the peer is mapped in this process.
pub(crate) fn mapped_base(maps: &SharedMaps, r: &ExportedRegistration) -> Option<u64> {
    let (name, offset) = r.shm.as_ref()?;
    let map = maps.get(name)?.as_ref().ok()?;
    (offset.checked_add(r.len)? <= map.len as u64).then(|| map.ptr as u64 + offset)
}

#[cfg(test)]
mod tests {
    use super::map_fd;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    fn memfd(seal: bool) -> OwnedFd {
        // SAFETY: memfd_create with a valid C string.
        let fd = unsafe { libc::memfd_create(c"orbite-test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor this test owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain system calls on it.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), 8192), 0);
            if seal {
                assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
            }
        }
        fd
    }

    #[test]
    fn only_memory_sealed_against_shrinking_is_mapped() {
        let m = map_fd(memfd(true)).unwrap();
        assert_eq!(m.len, 8192);
        assert_eq!(map_fd(memfd(false)).err(), Some(super::MapError::NotSealed));
        let file: OwnedFd = std::fs::File::open("/proc/self/stat").unwrap().into();
        assert!(map_fd(file).is_err(), "a file that is not a sealed memfd");
        let dir: OwnedFd = std::fs::File::open("/").unwrap().into();
        assert!(map_fd(dir).is_err());
    }
}

/// A same-host peer's device registration opened here through CUDA IPC
/// (the `ipc` route).
#[derive(Debug)]
pub(crate) struct Imported {
    /// The allocation holding it, mapped in this process.
    pub mapping: Arc<crate::cuda::IpcMapping>,
    /// Where the registration starts in the mapping.
    pub offset: u64,
}

/// A peer's device registrations by raw id: opened, or why not.
pub(crate) type Imports = HashMap<u64, Result<Arc<Imported>, crate::transport::peer_errors::ImportError>>;
