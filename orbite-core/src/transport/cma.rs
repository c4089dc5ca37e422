//! Cross-memory attach: one-sided copies into and out of a same-host peer's
//! ordinary memory with `process_vm_writev` / `process_vm_readv`. The peer
//! spends no CPU; the kernel checks that this process may access the peer
//! (same user, or ptrace permission).

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::transport::Span;
use crate::types::Op;

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

/// Whether a same-host peer process still runs, readable with one atomic
/// load. A watcher thread sleeps on the process's pidfd and clears the
/// flag when it exits; where pidfds are unavailable, each check asks the
/// kernel (`kill(pid, 0)`).
pub(crate) struct PeerLiveness {
    pid: i32,
    alive: Arc<AtomicBool>,
    watcher: Option<(std::os::fd::OwnedFd, std::thread::JoinHandle<()>)>,
}

impl PeerLiveness {
    pub fn watch(pid: i32) -> PeerLiveness {
        let alive = Arc::new(AtomicBool::new(true));
        PeerLiveness { pid, watcher: Self::spawn(pid, &alive), alive }
    }

    fn spawn(pid: i32, alive: &Arc<AtomicBool>) -> Option<(std::os::fd::OwnedFd, std::thread::JoinHandle<()>)> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        // SAFETY: plain system calls; the returned descriptors are owned below.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if pidfd < 0 {
            return None;
        }
        // SAFETY: `pidfd` is a fresh descriptor owned from here on.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
        // SAFETY: a fresh eventfd, owned from here on.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if wake < 0 {
            return None;
        }
        // SAFETY: as above.
        let wake = unsafe { OwnedFd::from_raw_fd(wake) };
        let wake_fd = wake.as_raw_fd();
        let flag = alive.clone();
        let thread = std::thread::Builder::new()
            .name("orbite-peer-watch".into())
            .spawn(move || {
                let mut fds = [
                    libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                    libc::pollfd { fd: wake_fd, events: libc::POLLIN, revents: 0 },
                ];
                loop {
                    // SAFETY: two valid pollfds; blocks without a timeout.
                    let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
                    if r < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    if fds[0].revents != 0 {
                        flag.store(false, Ordering::Release);
                    }
                    return;
                }
            })
            .ok()?;
        Some((wake, thread))
    }

    /// A cheap handle for route tasks.
    pub fn handle(&self) -> LivenessCheck {
        LivenessCheck { pid: self.pid, alive: self.alive.clone(), watched: self.watcher.is_some() }
    }
}

impl Drop for PeerLiveness {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        if let Some((wake, thread)) = self.watcher.take() {
            let one = 1u64;
            // SAFETY: writes 8 bytes of a live local to our own eventfd.
            unsafe { libc::write(wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

/// Checks a peer's liveness from a route task.
#[derive(Debug, Clone)]
pub(crate) struct LivenessCheck {
    pid: i32,
    alive: Arc<AtomicBool>,
    watched: bool,
}

impl LivenessCheck {
    pub fn alive(&self) -> bool {
        if self.watched { self.alive.load(Ordering::Acquire) } else { alive(self.pid) }
    }
}

/// Copies the spans in order (at most `limit` bytes) between this process
/// (`span.local`) and `pid` (`span.remote`, an address there). Returns the
/// bytes moved, or the bytes moved before an error and the error.
///
/// # Safety
/// Every local span must address memory of this process valid for its
/// length and retained for the whole call.
pub(crate) unsafe fn copy(pid: i32, op: Op, spans: &[Span], limit: u64) -> Result<u64, (u64, io::Error)> {
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
