//! Whether a same-host peer's process still runs: checked after every
//! one-sided task (shm, cma), since bytes copied into a dead peer's memory
//! never reached it.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use crate::transport::reactor::{After, Group, Interest, Reactor, Ready, Source, Token, pidfd};
use crate::types::{Op, TaskEnd};

/// True while process `pid` exists (signal 0 checks without sending).
pub(crate) fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 performs only the existence and permission check.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Whether a same-host peer process still runs, readable with one atomic
/// load: the peer's pidfd is a source of the engine's reactor, which
/// clears the flag when the process exits; where pidfds are unavailable,
/// each check asks the kernel (`kill(pid, 0)`).
pub(crate) struct PeerLiveness {
    pid: i32,
    alive: Arc<AtomicBool>,
    /// The pidfd's place in the reactor, while watched.
    watch: Option<(Weak<Reactor>, Token)>,
}

/// A peer process's pidfd on the reactor: readable once it exits.
struct Exit {
    pidfd: OwnedFd,
    alive: Arc<AtomicBool>,
    exited: bool,
}

impl Source for Exit {
    fn fd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    fn interest(&self) -> Interest {
        Interest::IN
    }

    fn ready(&mut self, ready: Ready) {
        self.exited |= ready.readable();
    }

    fn turn(&mut self) -> After {
        if !self.exited {
            return After::Wait;
        }
        self.alive.store(false, Ordering::Release);
        After::Close
    }
}

impl PeerLiveness {
    /// Watches process `pid` on `reactor`, in `group`.
    pub fn watch(reactor: &Arc<Reactor>, group: &Group, pid: i32) -> PeerLiveness {
        let alive = Arc::new(AtomicBool::new(true));
        let watch = pidfd(pid).ok().map(|pidfd| {
            let flag = alive.clone();
            let t = reactor.add(group, move |_| Box::new(Exit { pidfd, alive: flag, exited: false }));
            (Arc::downgrade(reactor), t)
        });
        PeerLiveness { pid, watch, alive }
    }

    /// A cheap handle for route tasks.
    pub fn handle(&self) -> LivenessCheck {
        LivenessCheck { pid: self.pid, alive: self.alive.clone(), watched: self.watch.is_some() }
    }
}

impl Drop for PeerLiveness {
    fn drop(&mut self) {
        if let Some((r, t)) = self.watch.take().and_then(|(reactor, t)| Some((reactor.upgrade()?, t))) {
            r.remove(t, "the peer is closed");
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
    peer_alive.is_some_and(|check| !check.alive()).then_some(TaskEnd::Failed { effect_unknown: op == Op::Write })
}
