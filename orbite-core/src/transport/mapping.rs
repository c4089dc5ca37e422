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
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    // The name comes from a peer: one plain file name of an engine's
    // shared allocation under /dev/shm, nothing else (no path, no
    // traversal, no link), owned by this user.
    let plain = name.starts_with("orbite-")
        && name.len() <= 255
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && !name.contains("..");
    if !plain {
        return Err(format!("{name:?} is not the name of a shared allocation"));
    }
    let path = std::path::Path::new("/dev/shm").join(name);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !meta.is_file() || meta.uid() != me {
        return Err(format!("{} is not a regular file of this user", path.display()));
    }
    let len = meta.len() as usize;
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

#[cfg(test)]
mod tests {
    use super::map_shared;

    #[test]
    fn only_plain_shared_allocation_files_of_this_user_are_mapped() {
        for bad in ["/etc/hosts", "../etc/hosts", "orbite-../../etc/hosts", "orbite-a/b", "hosts", "", "orbite-\u{0}"] {
            assert!(map_shared(bad).is_err(), "{bad:?} was mapped");
        }
        let dir = std::path::Path::new("/dev/shm");
        let id = std::process::id();
        // A link planted under an allocation's name.
        let link = format!("orbite-{id}-test-link");
        let _ = std::fs::remove_file(dir.join(&link));
        std::os::unix::fs::symlink("/etc/hosts", dir.join(&link)).unwrap();
        let linked = map_shared(&link);
        let _ = std::fs::remove_file(dir.join(&link));
        assert!(linked.is_err(), "a symbolic link was followed");
        // A file of another user.
        let foreign = format!("orbite-{id}-test-foreign");
        std::fs::write(dir.join(&foreign), [0u8; 4096]).unwrap();
        // SAFETY: chown of a file this test created (the tests run as root;
        // elsewhere the call fails and the check below is skipped).
        let path = std::ffi::CString::new(format!("/dev/shm/{foreign}")).unwrap();
        let chowned = unsafe { libc::chown(path.as_ptr(), 65534, 65534) } == 0;
        let mapped = map_shared(&foreign);
        let _ = std::fs::remove_file(dir.join(&foreign));
        if chowned {
            assert!(mapped.is_err(), "another user's file was mapped");
        }
        // A plain one of this user maps.
        let ok = format!("orbite-{id}-test-plain");
        std::fs::write(dir.join(&ok), [0u8; 4096]).unwrap();
        let mapped = map_shared(&ok);
        let _ = std::fs::remove_file(dir.join(&ok));
        assert!(mapped.is_ok(), "{:?}", mapped.err());
    }
}
