//! Cross-memory attach: one-sided copies into and out of a same-host peer's
//! ordinary memory with `process_vm_writev` / `process_vm_readv`. The peer
//! spends no CPU; the kernel checks that this process may access the peer
//! (same user, or ptrace permission).

use std::io;

use super::{Copier, LocalSide, Mover, NoDeviceCopy, PeerReach, Reach, RouteImpl, Unreachable};
use crate::segment::ExportedRegistration;
use crate::transport::Span;
use crate::transport::liveness::LivenessCheck;
use crate::transport::peer_errors::CmaRefused;
use crate::types::{Desc, Op, Route, TaskEnd};

/// The cma route.
pub(crate) struct Cma;

impl RouteImpl for Cma {
    fn route(&self) -> Route {
        Route::Cma
    }

    fn plan(&self, target: &Reach<'_>, remote: &[Desc]) -> Result<Mover, Unreachable> {
        let (p, h) = target.same_host_peer()?;
        h.cma.clone().map_err(Unreachable::CmaDenied)?;
        // A device address of the peer is no memory the kernel can copy.
        if let Some(device) = remote.iter().find_map(|d| p.segment.get(d.registration.to_raw()).and_then(|r| r.device))
        {
            return Err(Unreachable::PeerDeviceMemory(device));
        }
        // The pid the kernel reported for the proven peer.
        Ok(Mover::Copy(Box::new(Attach { pid: h.pid, peer_alive: p.alive.map(|l| l.handle()) })))
    }

    fn auto_reason(&self) -> Option<&'static str> {
        Some("same boot, CMA permitted")
    }

    fn address(&self, _target: &PeerReach<'_>, r: &ExportedRegistration) -> Result<(u64, u64), Unreachable> {
        // Addresses in the peer's process.
        Ok((r.addr, 0))
    }

    fn borrows(&self) -> bool {
        true
    }
}

/// Cross-memory copies into process `pid` (remote addresses are the
/// peer's), checked after each task as for shm.
pub(crate) struct Attach {
    pid: i32,
    peer_alive: Option<LivenessCheck>,
}

impl Copier for Attach {
    fn name(&self) -> &'static str {
        "cross-memory copies"
    }

    /// Copies, then checks that the peer still runs.
    fn copy(&self, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>) {
        // SAFETY: the job retains the range loans of every local span
        // (CopyJob contract); remote addresses are checked by the kernel.
        match unsafe { copy(self.pid, op, spans, limit) } {
            Ok(done) => (done, crate::transport::liveness::after_one_sided(op, self.peer_alive.as_ref())),
            // A WRITE into a peer that failed (or died) mid-copy may have
            // landed more than we can prove.
            Err((done, _)) => (done, Some(TaskEnd::Failed { effect_unknown: op == Op::Write })),
        }
    }

    /// Device memory on the local side: staged through page-locked
    /// buffers (the peer's private memory is not mapped here).
    fn with_local(self: Box<Self>, local: &LocalSide<'_>) -> Result<Box<dyn Copier>, NoDeviceCopy> {
        Ok(super::staging::Staged::over(self, local, None))
    }
}

/// Whether the kernel lets this process copy into the same-host peer
/// `pid` that describes itself as `peer`: probed by reading one byte of
/// one of its readable host registrations.
pub(crate) fn open_peer(pid: i32, peer: &crate::segment::SegmentDescriptor) -> Result<(), CmaRefused> {
    let probe_at = peer.registrations.iter().find(|r| r.permission.remote_read() && r.len > 0 && r.device.is_none());
    let addr = probe_at.ok_or(CmaRefused::NothingToProbe)?.addr;
    let mut byte = 0u8;
    let local = libc::iovec { iov_base: (&mut byte as *mut u8).cast(), iov_len: 1 };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: 1 };
    // SAFETY: the local iovec covers one byte of a live local; the remote
    // one is only read by the kernel, which checks access itself.
    match unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) } {
        1 => Ok(()),
        _ => Err(CmaRefused::Denied(std::sync::Arc::new(io::Error::last_os_error()))),
    }
}

/// Spans per system call (the kernel's `IOV_MAX`).
const BATCH: usize = 1024;

/// Copies the spans in order (at most `limit` bytes) between this process
/// (`span.local`) and `pid` (`span.remote`, an address there). Returns the
/// bytes moved, or the bytes moved before an error and the error.
///
/// # Safety
/// Every local span must address memory of this process valid for its
/// length and retained for the whole call.
unsafe fn copy(pid: i32, op: Op, spans: &[Span], limit: u64) -> Result<u64, (u64, io::Error)> {
    use std::mem::MaybeUninit;
    let mut done = 0u64;
    // Left uninitialised: zeroing 32 KiB of iovecs per call would cost more
    // than a small copy (and evict the cache it runs in); each call writes
    // only the `n` entries it passes.
    let mut local = [const { MaybeUninit::<libc::iovec>::uninit() }; BATCH];
    let mut remote = [const { MaybeUninit::<libc::iovec>::uninit() }; BATCH];
    let mut i = 0;
    while i < spans.len() && done < limit {
        let mut n = 0;
        let mut batch_bytes = 0u64;
        while n < BATCH && i + n < spans.len() && done + batch_bytes < limit {
            let s = &spans[i + n];
            let len = s.len.min(limit - done - batch_bytes);
            local[n].write(libc::iovec { iov_base: s.local as *mut libc::c_void, iov_len: len as usize });
            remote[n].write(libc::iovec { iov_base: s.remote as *mut libc::c_void, iov_len: len as usize });
            batch_bytes += len;
            n += 1;
        }
        let (l, r) = (local.as_ptr().cast::<libc::iovec>(), remote.as_ptr().cast::<libc::iovec>());
        // SAFETY: the first `n` entries of both arrays were written above;
        // local iovecs are valid per the function contract; remote ones are
        // checked by the kernel against the peer's mappings.
        let r = unsafe {
            match op {
                Op::Write => libc::process_vm_writev(pid, l, n as u64, r, n as u64, 0),
                Op::Read => libc::process_vm_readv(pid, l, n as u64, r, n as u64, 0),
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
