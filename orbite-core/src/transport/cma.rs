//! Cross-memory attach: one-sided copies into and out of a same-host peer's
//! ordinary memory with `process_vm_writev` / `process_vm_readv`. The peer
//! spends no CPU; the kernel checks that this process may access the peer
//! (same user, or ptrace permission).

use std::io;

use crate::batch::Op;
use crate::transport::Span;

/// Spans per system call (the kernel's `IOV_MAX`).
const BATCH: usize = 1024;

/// Checks that the kernel lets this process read `pid`'s memory at `addr`.
pub(crate) fn probe(pid: i32, addr: u64) -> Result<(), String> {
    let mut byte = 0u8;
    let local = libc::iovec { iov_base: (&mut byte as *mut u8).cast(), iov_len: 1 };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: 1 };
    // SAFETY: the local iovec covers one byte of a live local; the remote
    // one is only read by the kernel, which checks access itself.
    let r = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    if r == 1 { Ok(()) } else { Err(format!("process_vm_readv denied: {}", io::Error::last_os_error())) }
}

/// True while process `pid` exists (signal 0 checks without sending).
pub(crate) fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 performs only the existence and permission check.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Copies the spans in order (at most `limit` bytes) between this process
/// (`span.local`) and `pid` (`span.remote`, an address there). Returns the
/// bytes moved, or the bytes moved before an error and the error.
///
/// # Safety
/// Every local span must address memory of this process valid for its
/// length and retained for the whole call.
pub(crate) unsafe fn copy(pid: i32, op: Op, spans: &[Span], limit: u64) -> Result<u64, (u64, io::Error)> {
    let mut done = 0u64;
    let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
    let mut local = [empty; BATCH];
    let mut remote = [empty; BATCH];
    let mut i = 0;
    while i < spans.len() && done < limit {
        let mut n = 0;
        let mut batch_bytes = 0u64;
        while n < BATCH && i + n < spans.len() && done + batch_bytes < limit {
            let s = &spans[i + n];
            let len = s.len.min(limit - done - batch_bytes);
            local[n] = libc::iovec { iov_base: s.local as *mut libc::c_void, iov_len: len as usize };
            remote[n] = libc::iovec { iov_base: s.remote as *mut libc::c_void, iov_len: len as usize };
            batch_bytes += len;
            n += 1;
        }
        // SAFETY: local iovecs are valid per the function contract; remote
        // ones are checked by the kernel against the peer's mappings.
        let r = unsafe {
            match op {
                Op::Write => libc::process_vm_writev(pid, local.as_ptr(), n as u64, remote.as_ptr(), n as u64, 0),
                Op::Read => libc::process_vm_readv(pid, local.as_ptr(), n as u64, remote.as_ptr(), n as u64, 0),
            }
        };
        if r < 0 {
            return Err((done, io::Error::last_os_error()));
        }
        done += r as u64;
        if (r as u64) < batch_bytes {
            // The kernel stops at the first range it cannot access.
            return Err((done, io::Error::new(io::ErrorKind::UnexpectedEof, "partial cross-memory copy")));
        }
        i += n;
    }
    Ok(done)
}
