//! IPC memory handles between processes.
//!
//! A handle names the exporter's memfd by process and descriptor number;
//! the importer opens it through `/proc/<pid>/fd/<fd>` and maps it the same
//! two ways as an allocation. Handle layout (64 bytes, native endian):
//!
//! | bytes  | field                                             |
//! |--------|---------------------------------------------------|
//! | 0..8   | magic `ORBSHIM1`                                  |
//! | 8..12  | layout version (1)                                |
//! | 12..16 | exporter's pid (as the exporter sees it)          |
//! | 16..20 | the memfd's descriptor number in the exporter     |
//! | 20..24 | the exporter's device ordinal                     |
//! | 24..32 | the allocation's size                             |
//! | 32..40 | the allocation's buffer id in the exporter        |
//! | 40..48 | the exporter's random process nonce               |
//! | 48..64 | zero                                              |
//!
//! The memfd's name carries the nonce and buffer id, and the importer
//! checks it (before and after opening), so a descriptor number the
//! exporter has since closed and reused, or a pid that means another
//! process (another pid namespace), is refused instead of mapped.

use std::ffi::c_uint;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::context::require_current;
use crate::ffi::*;
use crate::memory::{
    Backing, DeviceMapping, Region, TABLE, find, memfd_name, next_buffer_id, process_nonce, round_to_pages,
};
use crate::stats::{self, Counter};

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpcMemHandle {
    pub reserved: [u8; 64],
}

const MAGIC: [u8; 8] = *b"ORBSHIM1";
const VERSION: u32 = 1;

struct Fields {
    pid: u32,
    fd: i32,
    device: u32,
    size: u64,
    buffer_id: u64,
    nonce: u64,
}

impl Fields {
    fn encode(&self) -> IpcMemHandle {
        let mut b = [0u8; 64];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_ne_bytes());
        b[12..16].copy_from_slice(&self.pid.to_ne_bytes());
        b[16..20].copy_from_slice(&self.fd.to_ne_bytes());
        b[20..24].copy_from_slice(&self.device.to_ne_bytes());
        b[24..32].copy_from_slice(&self.size.to_ne_bytes());
        b[32..40].copy_from_slice(&self.buffer_id.to_ne_bytes());
        b[40..48].copy_from_slice(&self.nonce.to_ne_bytes());
        IpcMemHandle { reserved: b }
    }

    fn decode(h: &IpcMemHandle) -> Option<Fields> {
        let b = &h.reserved;
        let u32_at = |i: usize| u32::from_ne_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_ne_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if b[0..8] != MAGIC || u32_at(8) != VERSION || b[48..].iter().any(|&x| x != 0) {
            return None;
        }
        let f = Fields {
            pid: u32_at(12),
            fd: u32_at(16) as i32,
            device: u32_at(20),
            size: u64_at(24),
            buffer_id: u64_at(32),
            nonce: u64_at(40),
        };
        (f.size > 0 && f.fd >= 0 && f.pid > 0).then_some(f)
    }
}

/// The driver's error for a failed look at the exporter's descriptor: gone
/// (process exited, buffer freed, another pid namespace) is
/// `CUDA_ERROR_INVALID_VALUE`, not allowed (another user, ptrace rules)
/// `CUDA_ERROR_NOT_PERMITTED`.
fn os_error(e: &std::io::Error) -> CUresult {
    match e.raw_os_error() {
        Some(libc::ENOENT | libc::ESRCH | libc::ENOTDIR | libc::ENXIO) => CUDA_ERROR_INVALID_VALUE,
        Some(libc::EACCES | libc::EPERM) => CUDA_ERROR_NOT_PERMITTED,
        Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM) => CUDA_ERROR_OUT_OF_MEMORY,
        _ => CUDA_ERROR_OPERATING_SYSTEM,
    }
}

/// Whether the descriptor behind `path` is the memfd named `name`.
fn check_link(path: &str, name: &str) -> CuResult<()> {
    let link = std::fs::read_link(path).map_err(|e| os_error(&e))?;
    let link = link.to_str().unwrap_or("");
    let expected = format!("/memfd:{name}");
    match link.strip_prefix(&expected) {
        Some("" | " (deleted)") => Ok(()),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// Exports the allocation holding `dptr` (any address in it; the handle
/// names the whole allocation and opens at its base). IPC imports cannot be
/// exported again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetMemHandle(out: *mut IpcMemHandle, dptr: CUdeviceptr) -> CUresult {
    entry(|| {
        require_current()?;
        let addr = usize::try_from(dptr).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let fields = {
            let table = lock(&TABLE);
            let region = find(&table, addr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let Backing::Alloc(m) = &region.backing else { return Err(CUDA_ERROR_INVALID_VALUE) };
            Fields {
                pid: std::process::id(),
                fd: std::os::fd::AsRawFd::as_raw_fd(&m.fd),
                device: region.ctx.device(),
                size: region.size as u64,
                buffer_id: region.buffer_id,
                nonce: process_nonce(),
            }
        };
        // SAFETY: `out` is null or points to a CUipcMemHandle.
        unsafe { write_out(out, fields.encode()) }
    })
}

fn open(handle: &IpcMemHandle) -> CuResult<usize> {
    let ctx = require_current()?;
    let f = Fields::decode(handle).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if f.pid == std::process::id() && f.nonce == process_nonce() {
        // The driver refuses to import into the exporting process.
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    let size = usize::try_from(f.size).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let len = round_to_pages(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let name = memfd_name(f.nonce, f.buffer_id);
    let path = format!("/proc/{}/fd/{}", f.pid, f.fd);
    check_link(&path, &name)?;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).map_err(|e| os_error(&e))?;
    let own = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file));
    check_link(&own, &name)?;
    let actual = file.metadata().map_err(|e| os_error(&e))?.len();
    if actual != len as u64 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mapping = Arc::new(DeviceMapping::map(OwnedFd::from(file), len).map_err(|_| CUDA_ERROR_MAP_FAILED)?);
    let base = mapping.device_addr;
    let region =
        Region { base, size, ctx, buffer_id: next_buffer_id(), sync_memops: false, backing: Backing::Import(mapping) };
    lock(&TABLE).insert(base, region);
    stats::add(Counter::IpcImports, 1);
    Ok(base)
}

/// Maps another process's exported allocation into the current context;
/// each open is a mapping of its own, closed with cuIpcCloseMemHandle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(out: *mut CUdeviceptr, handle: IpcMemHandle, flags: c_uint) -> CUresult {
    entry(|| {
        require_current()?;
        // 0 or CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
        if out.is_null() || flags & !1 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let base = open(&handle)?;
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(out, base as CUdeviceptr) }
    })
}

/// `dptr` must be the base of an import.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CUresult {
    entry(|| {
        require_current()?;
        let addr = usize::try_from(dptr).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let mut table = lock(&TABLE);
        match table.get(&addr) {
            Some(r) if matches!(r.backing, Backing::Import(_)) => {
                table.remove(&addr);
                stats::sub(Counter::IpcImports, 1);
                Ok(())
            }
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    })
}
