//! Test-only fault hooks (feature `fault-injection`): an implementation of
//! [`Hooks`] driven by a script.
//!
//! A script of directives is consumed one per task, in the order the local
//! route received the tasks; with `hold_all`, every task is held. A held
//! task has not touched any byte; it stays admitted (its execution cannot
//! retire) until the test releases it with a directive. This makes every
//! lifecycle rule testable deterministically: withheld completions, short
//! completions, failures with known or unknown effect. The same hooks can
//! hold a target's peer requests before their bytes move, and make CMA
//! probes report a denial.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

pub use crate::transport::hooks::FaultDirective;
use crate::transport::hooks::{Hooks, Requeue};

type Held<J> = (u64, J, Arc<dyn Requeue<J>>);

struct Inner<J> {
    script: VecDeque<FaultDirective>,
    hold_all: bool,
    held: Vec<Held<J>>,
    /// Tasks told to hold that have not reached `held` yet (a worker takes
    /// the directive under its queue lock and hands the job over after):
    /// `release_all` waits for them, so none is held after it returned.
    holding: usize,
    next_ticket: u64,
}

/// The scripted hooks of one engine.
pub(crate) struct FaultState<J> {
    inner: Mutex<Inner<J>>,
    changed: Condvar,
    /// Whether peer requests are held, and how many wait in the hold now.
    remote_hold: (Mutex<(bool, usize)>, Condvar),
    deny_cma: AtomicBool,
    withhold_pushes: AtomicBool,
    forge_ipc: Mutex<Option<IpcForgery>>,
}

/// How a target falsifies its answers to requests for CUDA IPC handles (a
/// hostile peer, for the importer's tests): each must be refused by the
/// importer, which then stages. The descriptor forgeries concern
/// shareable entries (VMM memory); the others apply to legacy entries
/// too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpcForgery {
    /// Every descriptor replaced by a memfd of the claimed size that is
    /// no CUDA allocation (named `orbite-forged-ipc`).
    ForeignDescriptor,
    /// Each allocation claimed twice its size.
    InflatedLength,
    /// Each allocation claimed one byte longer (no multiple of the
    /// granularity).
    UnalignedLength,
    /// Each allocation claimed 4 EiB long.
    HugeLength,
    /// Each registration placed 4 KiB before the end of its allocation,
    /// so that it runs past it.
    OffsetOutside,
    /// Each allocation placed on a device of another UUID.
    WrongDevice,
    /// The descriptors left out.
    MissingDescriptors,
    /// One descriptor more than the entries call for.
    ExtraDescriptor,
    /// Each entry a legacy handle of made-up bytes (the descriptors left
    /// out).
    MadeUpLegacyHandle,
}

impl IpcForgery {
    /// Every forgery, in a fixed order.
    pub const ALL: [IpcForgery; 9] = [
        IpcForgery::ForeignDescriptor,
        IpcForgery::InflatedLength,
        IpcForgery::UnalignedLength,
        IpcForgery::HugeLength,
        IpcForgery::OffsetOutside,
        IpcForgery::WrongDevice,
        IpcForgery::MissingDescriptors,
        IpcForgery::ExtraDescriptor,
        IpcForgery::MadeUpLegacyHandle,
    ];

    fn apply(self, entries: &mut [crate::wire::IpcEntry], fds: &mut Vec<std::os::fd::OwnedFd>) {
        use crate::wire::IpcEntry;
        for e in entries.iter_mut() {
            if let (IpcForgery::MadeUpLegacyHandle, IpcEntry::Shareable { uuid, offset, alloc_len, .. }) = (self, &e) {
                *e = IpcEntry::Exported { uuid: *uuid, handle: [0x5a; 64], offset: *offset, alloc_len: *alloc_len };
            }
            let (uuid, offset, alloc_len) = match e {
                IpcEntry::Shareable { uuid, offset, alloc_len, .. } => (uuid, offset, alloc_len),
                IpcEntry::Exported { uuid, handle, offset, alloc_len } => {
                    if self == IpcForgery::MadeUpLegacyHandle {
                        *handle = [0x5a; 64];
                    }
                    (uuid, offset, alloc_len)
                }
                IpcEntry::Refused(_) => continue,
            };
            match self {
                IpcForgery::InflatedLength => *alloc_len = alloc_len.saturating_mul(2),
                IpcForgery::UnalignedLength => *alloc_len = alloc_len.saturating_add(1),
                IpcForgery::HugeLength => *alloc_len = 1 << 62,
                IpcForgery::OffsetOutside => *offset = alloc_len.saturating_sub(4096),
                IpcForgery::WrongDevice => uuid.iter_mut().for_each(|b| *b = !*b),
                _ => {}
            }
        }
        match self {
            IpcForgery::ForeignDescriptor => {
                let lens: Vec<u64> = entries
                    .iter()
                    .filter_map(|e| match e {
                        IpcEntry::Shareable { alloc_len, .. } => Some(*alloc_len),
                        _ => None,
                    })
                    .collect();
                *fds = lens.into_iter().filter_map(forged_memfd).collect();
            }
            IpcForgery::MissingDescriptors | IpcForgery::MadeUpLegacyHandle => fds.clear(),
            IpcForgery::ExtraDescriptor => {
                if let Some(extra) = forged_memfd(4096) {
                    fds.push(extra);
                }
            }
            _ => {}
        }
    }
}

/// A memfd of `len` bytes that no driver made.
fn forged_memfd(len: u64) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: a NUL-terminated name; a fresh descriptor on success.
    let fd = unsafe { libc::memfd_create(c"orbite-forged-ipc".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: just made, owned by nobody else.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: a descriptor owned here.
    (unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), len as libc::off_t) } == 0).then_some(fd)
}

impl<J> Default for FaultState<J> {
    fn default() -> Self {
        FaultState {
            inner: Mutex::new(Inner {
                script: VecDeque::new(),
                hold_all: false,
                held: Vec::new(),
                holding: 0,
                next_ticket: 1,
            }),
            changed: Condvar::new(),
            remote_hold: (Mutex::new((false, 0)), Condvar::new()),
            deny_cma: AtomicBool::new(false),
            withhold_pushes: AtomicBool::new(false),
            forge_ipc: Mutex::new(None),
        }
    }
}

impl<J: Send + 'static> Hooks<J> for FaultState<J> {
    fn task_directive(&self) -> FaultDirective {
        let mut g = self.inner.lock();
        let d = match g.script.pop_front() {
            Some(d) => d,
            None if g.hold_all => FaultDirective::Hold,
            None => FaultDirective::Run,
        };
        if d == FaultDirective::Hold {
            g.holding += 1;
        }
        d
    }

    fn hold(&self, job: J, back: Arc<dyn Requeue<J>>) -> Option<J> {
        let mut g = self.inner.lock();
        let ticket = g.next_ticket;
        g.next_ticket += 1;
        g.holding = g.holding.saturating_sub(1);
        g.held.push((ticket, job, back));
        self.changed.notify_all();
        None
    }

    fn before_remote_bytes(&self) {
        let (m, cv) = &self.remote_hold;
        let mut held = m.lock();
        if !held.0 {
            return;
        }
        held.1 += 1;
        cv.notify_all();
        while held.0 {
            cv.wait(&mut held);
        }
        held.1 -= 1;
    }

    fn pushes_withheld(&self) -> bool {
        self.withhold_pushes.load(Ordering::Acquire)
    }

    fn cma_probe(
        &self,
        probe: Result<(), crate::transport::peer_errors::CmaRefused>,
    ) -> Result<(), crate::transport::peer_errors::CmaRefused> {
        if self.deny_cma.load(Ordering::Acquire) {
            return Err(crate::transport::peer_errors::CmaRefused::Injected);
        }
        probe
    }

    fn ipc_answer(&self, entries: &mut Vec<crate::wire::IpcEntry>, fds: &mut Vec<std::os::fd::OwnedFd>) {
        if let Some(f) = *self.forge_ipc.lock() {
            f.apply(entries, fds);
        }
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// Control of the fault hooks, object-safe so the public handle is not
/// generic over the route's job type.
pub(crate) trait FaultControl: Send + Sync {
    fn push(&self, d: FaultDirective);
    fn set_hold_all(&self, on: bool);
    fn held(&self) -> Vec<u64>;
    fn release_all(&self, timeout: Duration) -> bool;
    fn release(&self, ticket: u64, d: FaultDirective) -> bool;
    fn wait_held(&self, n: usize, timeout: Duration) -> bool;
    fn hold_remote(&self, on: bool);
    fn wait_remote_held(&self, n: usize, timeout: Duration) -> bool;
    fn deny_cma(&self, on: bool);
    fn withhold_pushes(&self, on: bool);
    fn forge_ipc(&self, f: Option<IpcForgery>);
}

impl<J: Send + 'static> FaultControl for FaultState<J> {
    fn push(&self, d: FaultDirective) {
        self.inner.lock().script.push_back(d);
    }
    fn set_hold_all(&self, on: bool) {
        self.inner.lock().hold_all = on;
    }
    fn held(&self) -> Vec<u64> {
        self.inner.lock().held.iter().map(|(t, _, _)| *t).collect()
    }
    fn release_all(&self, timeout: Duration) -> bool {
        let deadline = crate::time::deadline_after(timeout);
        loop {
            let (taken, holding) = {
                let mut g = self.inner.lock();
                (std::mem::take(&mut g.held), g.holding)
            };
            let none = taken.is_empty();
            for (_, job, back) in taken {
                back.requeue(job, FaultDirective::Run);
            }
            if holding == 0 && none {
                return true;
            }
            let mut g = self.inner.lock();
            if g.held.is_empty() && g.holding > 0 && self.changed.wait_until(&mut g, deadline).timed_out() {
                return false;
            }
        }
    }
    fn release(&self, ticket: u64, d: FaultDirective) -> bool {
        let taken = {
            let mut g = self.inner.lock();
            let taken = g.held.iter().position(|(t, _, _)| *t == ticket).map(|i| g.held.remove(i));
            if taken.is_some() && d == FaultDirective::Hold {
                g.holding += 1; // it comes back into the hold
            }
            taken
        };
        match taken {
            Some((_, job, back)) => {
                back.requeue(job, d);
                true
            }
            None => false,
        }
    }
    fn wait_held(&self, n: usize, timeout: Duration) -> bool {
        let deadline = crate::time::deadline_after(timeout);
        let mut g = self.inner.lock();
        while g.held.len() < n {
            if self.changed.wait_until(&mut g, deadline).timed_out() {
                return g.held.len() >= n;
            }
        }
        true
    }
    fn hold_remote(&self, on: bool) {
        let (m, cv) = &self.remote_hold;
        m.lock().0 = on;
        cv.notify_all();
    }
    fn wait_remote_held(&self, n: usize, timeout: Duration) -> bool {
        let deadline = crate::time::deadline_after(timeout);
        let (m, cv) = &self.remote_hold;
        let mut held = m.lock();
        while held.1 < n {
            if cv.wait_until(&mut held, deadline).timed_out() {
                return held.1 >= n;
            }
        }
        true
    }
    fn deny_cma(&self, on: bool) {
        self.deny_cma.store(on, Ordering::Release);
    }
    fn withhold_pushes(&self, on: bool) {
        self.withhold_pushes.store(on, Ordering::Release);
    }
    fn forge_ipc(&self, f: Option<IpcForgery>) {
        *self.forge_ipc.lock() = f;
    }
}

/// Test handle on the engine's fault hooks.
pub struct FaultHooks<'a> {
    pub(crate) ctl: &'a dyn FaultControl,
}

impl FaultHooks<'_> {
    /// Appends a directive for a future task (consumed in task order).
    pub fn push(&self, d: FaultDirective) {
        self.ctl.push(d);
    }
    /// Holds every task with no scripted directive.
    pub fn hold_all(&self, on: bool) {
        self.ctl.set_hold_all(on);
    }
    /// Tickets of the held tasks, oldest first.
    pub fn held(&self) -> Vec<u64> {
        self.ctl.held()
    }
    /// Lets a held task go with a directive; false if no such ticket.
    pub fn release(&self, ticket: u64, d: FaultDirective) -> bool {
        self.ctl.release(ticket, d)
    }
    /// Releases every held task to run normally, including tasks already
    /// told to hold that were still on their way into the hold (waiting
    /// up to 10 s for those).
    pub fn release_all(&self) {
        assert!(self.ctl.release_all(Duration::from_secs(10)), "a task told to hold never reached the hold");
    }
    /// Waits until at least `n` tasks are held.
    pub fn wait_held(&self, n: usize, timeout: Duration) -> bool {
        self.ctl.wait_held(n, timeout)
    }
}
