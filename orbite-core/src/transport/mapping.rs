//! A same-host peer's shared allocations (/dev/shm files), mapped into this
//! process once per peer and unmapped when the last user is gone.

use std::collections::HashMap;
use std::sync::Arc;

use crate::segment::ExportedRegistration;

/// A peer's shared allocation mapped into this process.
pub(crate) struct ShmMapping {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: a shared mapping owned by this value; transfers access it only
// through spans whose lifetimes are bounded by the owning peer.
unsafe impl Send for ShmMapping {}
// SAFETY: as above.
unsafe impl Sync for ShmMapping {}

impl Drop for ShmMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map_shared`, unmapped once, after the
        // last transfer holding its peer is gone.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A peer's shared allocations mapped here, by name (or why not).
pub(crate) type SharedMaps = HashMap<String, Result<Arc<ShmMapping>, String>>;

/// Maps a peer's shared allocation `/dev/shm/<name>`.
pub(crate) fn map_shared(name: &str) -> Result<ShmMapping, String> {
    use std::os::fd::AsRawFd;
    let path = std::path::Path::new("/dev/shm").join(name);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let len = file.metadata().map_err(|e| e.to_string())?.len() as usize;
    if len == 0 {
        return Err(format!("{} is empty", path.display()));
    }
    // SAFETY: a fresh shared mapping of the whole file; nothing in this
    // process aliases it yet.
    let raw = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), 0)
    };
    if raw == libc::MAP_FAILED {
        return Err(format!("cannot map {}: {}", path.display(), std::io::Error::last_os_error()));
    }
    Ok(ShmMapping { ptr: raw.cast(), len })
}

/// Maps every shared allocation `regs` name that `maps` lacks.
pub(crate) fn map_new_shared<'a>(maps: &mut SharedMaps, regs: impl IntoIterator<Item = &'a ExportedRegistration>) {
    for r in regs {
        if let Some((name, _)) = &r.shm {
            maps.entry(name.clone()).or_insert_with(|| map_shared(name).map(Arc::new));
        }
    }
}

/// Where a shared registration of the peer is mapped in this process.
pub(crate) fn mapped_base(maps: &SharedMaps, r: &ExportedRegistration) -> Option<u64> {
    let (name, offset) = r.shm.as_ref()?;
    let map = maps.get(name)?.as_ref().ok()?;
    (offset.checked_add(r.len)? <= map.len as u64).then(|| map.ptr as u64 + offset)
}
