//! Whether a same-host peer's process still runs: checked after every
//! one-sided task (shm, cma), since bytes copied into a dead peer's memory
//! never reached it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::types::{Op, TaskEnd};

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

/// After a one-sided task that copied without error: bytes that went into
/// a dead peer's memory never reached it, so the task fails (a WRITE's
/// effect unknown).
pub(crate) fn after_one_sided(op: Op, peer_alive: Option<&LivenessCheck>) -> Option<TaskEnd> {
    match peer_alive {
        Some(check) if !check.alive() => Some(TaskEnd::Failed { effect_unknown: op == Op::Write }),
        _ => None,
    }
}
