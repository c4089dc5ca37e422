//! Whether a same-host peer's process still runs: checked after every
//! one-sided task (shm, cma), since bytes copied into a dead peer's memory
//! never reached it.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::transport::reactor::{Events, Interest, Poller, pidfd};

use crate::types::{Op, TaskEnd};

/// True while process `pid` exists (signal 0 checks without sending).
pub(crate) fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 performs only the existence and permission check.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Whether a same-host peer process still runs, readable with one atomic
/// load. One watcher thread per process waits on the pidfds of every
/// watched peer (epoll) and clears a peer's flag when its process exits;
/// where pidfds are unavailable, each check asks the kernel
/// (`kill(pid, 0)`).
pub(crate) struct PeerLiveness {
    pid: i32,
    alive: Arc<AtomicBool>,
    /// The watch's id and pidfd, while watched.
    watch: Option<(u64, OwnedFd)>,
}

/// The process's pidfd watcher: one epoll set, one thread.
struct Watcher {
    poller: Poller,
    flags: Mutex<HashMap<u64, Arc<AtomicBool>>>,
    next: AtomicU64,
}

fn watcher() -> Option<&'static Watcher> {
    static WATCHER: OnceLock<Option<Watcher>> = OnceLock::new();
    WATCHER
        .get_or_init(|| {
            let poller = Poller::new().ok()?;
            std::thread::Builder::new().name("orbite-peer-watch".into()).spawn(watch_loop).ok()?;
            Some(Watcher { poller, flags: Mutex::new(HashMap::new()), next: AtomicU64::new(1) })
        })
        .as_ref()
}

fn watch_loop() {
    // The watcher is set once this thread runs (it waits for the static).
    let Some(w) = watcher() else { return };
    let mut ready = Events::with_capacity(32);
    loop {
        if w.poller.wait(&mut ready, None).is_err() {
            continue;
        }
        let flags = w.flags.lock();
        for r in ready.iter() {
            // One shot: the pidfd stays readable after the exit.
            if let Some(flag) = flags.get(&r.token) {
                flag.store(false, Ordering::Release);
            }
        }
    }
}

impl PeerLiveness {
    pub fn watch(pid: i32) -> PeerLiveness {
        let alive = Arc::new(AtomicBool::new(true));
        PeerLiveness { pid, watch: Self::register(pid, &alive), alive }
    }

    fn register(pid: i32, alive: &Arc<AtomicBool>) -> Option<(u64, OwnedFd)> {
        let w = watcher()?;
        let pidfd = pidfd(pid).ok()?;
        let id = w.next.fetch_add(1, Ordering::Relaxed);
        w.flags.lock().insert(id, alive.clone());
        if w.poller.add(&pidfd, id, Interest::IN | Interest::ONESHOT).is_err() {
            w.flags.lock().remove(&id);
            return None;
        }
        Some((id, pidfd))
    }

    /// A cheap handle for route tasks.
    pub fn handle(&self) -> LivenessCheck {
        LivenessCheck { pid: self.pid, alive: self.alive.clone(), watched: self.watch.is_some() }
    }
}

impl Drop for PeerLiveness {
    fn drop(&mut self) {
        if let (Some((id, pidfd)), Some(w)) = (self.watch.take(), watcher()) {
            let _ = w.poller.delete(&pidfd);
            w.flags.lock().remove(&id);
            drop(pidfd);
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
