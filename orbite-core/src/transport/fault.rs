//! Test-only fault hooks of the local route (feature `fault-injection`).
//!
//! A script of directives is consumed one per task, in the order the
//! route received the tasks; with `hold_all`, every task is held. A held task has
//! not touched any byte; it stays admitted (its execution cannot retire)
//! until the test releases it with a directive. This makes every lifecycle
//! rule testable deterministically: withheld completions, short
//! completions, failures with known or unknown effect.

use std::collections::VecDeque;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// What a worker does with the next task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultDirective {
    /// Copy normally.
    Run,
    /// Do not start it; keep it until released.
    Hold,
    /// Copy at most `bytes`, then report a short completion.
    Short {
        /// Bytes copied before stopping.
        bytes: u64,
    },
    /// Copy at most `bytes`, then report failure.
    Fail {
        /// Bytes copied before failing.
        bytes: u64,
        /// Whether to report that more may have been written.
        effect_unknown: bool,
    },
}

struct Inner<J> {
    script: VecDeque<FaultDirective>,
    hold_all: bool,
    held: Vec<(u64, J)>,
    next_ticket: u64,
}

pub(crate) struct FaultState<J> {
    inner: Mutex<Inner<J>>,
    changed: Condvar,
}

impl<J> Default for FaultState<J> {
    fn default() -> Self {
        FaultState {
            inner: Mutex::new(Inner { script: VecDeque::new(), hold_all: false, held: Vec::new(), next_ticket: 1 }),
            changed: Condvar::new(),
        }
    }
}

impl<J> FaultState<J> {
    pub(crate) fn next_directive(&self) -> FaultDirective {
        let mut g = self.inner.lock();
        match g.script.pop_front() {
            Some(d) => d,
            None if g.hold_all => FaultDirective::Hold,
            None => FaultDirective::Run,
        }
    }

    pub(crate) fn hold(&self, job: J) {
        let mut g = self.inner.lock();
        let ticket = g.next_ticket;
        g.next_ticket += 1;
        g.held.push((ticket, job));
        self.changed.notify_all();
    }

    fn take(&self, ticket: u64) -> Option<J> {
        let mut g = self.inner.lock();
        let i = g.held.iter().position(|(t, _)| *t == ticket)?;
        Some(g.held.remove(i).1)
    }
}

/// Control of the fault hooks, object-safe so the public handle is not
/// generic over the route's job type.
pub(crate) trait FaultControl: Send + Sync {
    fn push(&self, d: FaultDirective);
    fn set_hold_all(&self, on: bool);
    fn held(&self) -> Vec<u64>;
    fn release(&self, ticket: u64, d: FaultDirective) -> bool;
    fn wait_held(&self, n: usize, timeout: Duration) -> bool;
}

impl<J: crate::transport::CopyJob> FaultControl for crate::transport::local::RouteShared<J> {
    fn push(&self, d: FaultDirective) {
        self.faults.inner.lock().script.push_back(d);
    }
    fn set_hold_all(&self, on: bool) {
        self.faults.inner.lock().hold_all = on;
    }
    fn held(&self) -> Vec<u64> {
        self.faults.inner.lock().held.iter().map(|(t, _)| *t).collect()
    }
    fn release(&self, ticket: u64, d: FaultDirective) -> bool {
        match self.faults.take(ticket) {
            Some(job) => {
                self.requeue(job, d);
                true
            }
            None => false,
        }
    }
    fn wait_held(&self, n: usize, timeout: Duration) -> bool {
        let deadline = crate::time::deadline_after(timeout);
        let mut g = self.faults.inner.lock();
        while g.held.len() < n {
            if self.faults.changed.wait_until(&mut g, deadline).timed_out() {
                return g.held.len() >= n;
            }
        }
        true
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
    /// Releases every held task to run normally.
    pub fn release_all(&self) {
        for t in self.held() {
            self.release(t, FaultDirective::Run);
        }
    }
    /// Waits until at least `n` tasks are held.
    pub fn wait_held(&self, n: usize, timeout: Duration) -> bool {
        self.ctl.wait_held(n, timeout)
    }
}
