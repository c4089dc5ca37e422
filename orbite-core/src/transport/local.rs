//! The copy workers: every task a route's copier runs in this process (the
//! self connection, shm, cma, cuda-ipc, files, staging) runs on these
//! threads; a small lone task may instead run on the posting thread
//! (`run_inline`), which saves the hand-off. A copier that posts work and
//! learns of its completion later has a few tasks posted per worker.
//!
//! Workers block on a condition variable when the queue is empty: an idle
//! engine spends no CPU here. A job is a route task: its spans stay valid
//! because the job holds the range loans (via its transfer).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::transport::CopyJob;
use crate::transport::hooks::{FaultDirective, Hooks, Requeue};
use crate::transport::spin::{claim, poll};
use crate::types::{TaskEnd, TaskReport};

/// A queued job, with the directive it starts under when the hooks already
/// decided it (a held job given back).
type Queued<J> = (J, Option<FaultDirective>);

struct Queue<J> {
    jobs: VecDeque<Queued<J>>,
    shutdown: bool,
}

pub(crate) struct RouteShared<J> {
    queue: Mutex<Queue<J>>,
    ready: Condvar,
    /// Jobs queued, readable without the lock (for the bounded poll).
    pending: AtomicUsize,
    /// Nanoseconds workers spent copying bytes, cumulative.
    busy_ns: AtomicU64,
    /// Set while one idle worker polls.
    spinner: AtomicBool,
    /// Callers copying a task of their own transfer right now.
    helpers: AtomicUsize,
    /// Threads copying a task right now (workers and helping callers).
    copying: AtomicUsize,
    /// The cores this process may run on.
    cores: usize,
    /// Tasks callers copied, cumulative.
    helped: AtomicU64,
    spin: Duration,
    hooks: Option<Arc<dyn Hooks<J>>>,
}

/// The local route and its workers.
pub(crate) struct LocalRoute<J: CopyJob> {
    shared: Arc<RouteShared<J>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl<J: CopyJob> LocalRoute<J> {
    /// Starts `workers` threads that poll for up to `spin` before sleeping;
    /// `hooks` (tests) see every task as it starts.
    pub fn start(workers: u32, spin: Duration, hooks: Option<Arc<dyn Hooks<J>>>) -> std::io::Result<Self> {
        let shared = Arc::new(RouteShared {
            queue: Mutex::new(Queue { jobs: VecDeque::new(), shutdown: false }),
            ready: Condvar::new(),
            pending: AtomicUsize::new(0),
            busy_ns: AtomicU64::new(0),
            spinner: AtomicBool::new(false),
            helpers: AtomicUsize::new(0),
            copying: AtomicUsize::new(0),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            helped: AtomicU64::new(0),
            spin,
            hooks,
        });
        let route = LocalRoute { shared, threads: Mutex::new(Vec::new()) };
        for i in 0..workers {
            let shared = route.shared.clone();
            let handle =
                std::thread::Builder::new().name(format!("orbite-local-{i}")).spawn(move || worker(&shared))?;
            route.threads.lock().push(handle);
        }
        Ok(route)
    }

    /// Hands a task to the workers.
    pub fn submit(&self, job: J) {
        // Count under the queue lock: a worker pops (and decrements) only
        // under it, so the count never runs below zero.
        let pending = {
            let mut q = self.shared.queue.lock();
            q.jobs.push_back((job, None));
            self.shared.pending.fetch_add(1, Ordering::AcqRel) + 1
        };
        // A polling worker sees a lone job (and re-checks the queue before it
        // sleeps): waking a sleeping one too would only cost a system call.
        if pending > 1 || !self.shared.spinner.load(Ordering::Acquire) {
            self.shared.ready.notify_one();
        }
    }

    /// Hands tasks to the workers in order, under one lock.
    pub fn submit_all(&self, jobs: Vec<J>) {
        let n = jobs.len();
        if n <= 1 {
            return jobs.into_iter().for_each(|j| self.submit(j));
        }
        {
            let mut q = self.shared.queue.lock();
            q.jobs.extend(jobs.into_iter().map(|j| (j, None)));
            self.shared.pending.fetch_add(n, Ordering::AcqRel);
        }
        // One worker now; it wakes a second when it sees more queued.
        self.shared.ready.notify_one();
    }

    /// Runs a task on the calling thread when no task is queued ahead of
    /// it (so tasks still start in the order the route received them);
    /// otherwise queues it for the workers. The caller holds no lock: the
    /// job's `finish` takes the engine's locks.
    pub fn run_inline(&self, job: J) {
        let q = self.shared.queue.lock();
        if !q.jobs.is_empty() {
            drop(q);
            return self.submit(job);
        }
        // Directives are taken under the queue lock, as a worker does.
        let directive = self.shared.directive(None);
        drop(q);
        start(&self.shared, job, directive);
    }

    /// A caller of transfer `owner` (see [`CopyJob::owner`]) lends its
    /// thread: if the next task queued on the route is one of that
    /// transfer's and the caller may copy it ([`CopyJob::helpable`]), it
    /// runs here, now. At most one task; never waits for anything but the
    /// queue lock, which no copy holds; tasks still start in the order the
    /// route received them (a task of another transfer queued ahead is
    /// left to the workers: intents were applied at admission). True if it
    /// ran one.
    pub fn help(&self, owner: usize) -> bool {
        self.help_with(owner, false)
    }

    /// [`LocalRoute::help`] for a caller that would otherwise sleep
    /// (`wait`): only while fewer threads copy than this process has
    /// cores, so that helping never takes a core from a worker.
    pub fn help_on_a_free_core(&self, owner: usize) -> bool {
        self.help_with(owner, true)
    }

    fn help_with(&self, owner: usize, free_core_only: bool) -> bool {
        // A caller polling in a loop with nothing queued takes no lock.
        if self.shared.pending.load(Ordering::Acquire) == 0 {
            return false;
        }
        if free_core_only && self.shared.copying.load(Ordering::Acquire) >= self.shared.cores {
            return false;
        }
        let mut q = self.shared.queue.lock();
        if !q.jobs.front().is_some_and(|(j, _)| j.owner() == owner && j.helpable()) {
            return false;
        }
        let Some((job, forced)) = q.jobs.pop_front() else { return false };
        self.shared.pending.fetch_sub(1, Ordering::AcqRel);
        let directive = self.shared.directive(forced);
        drop(q);
        self.shared.helpers.fetch_add(1, Ordering::AcqRel);
        start(&self.shared, job, directive);
        self.shared.helpers.fetch_sub(1, Ordering::AcqRel);
        self.shared.helped.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Tasks callers copied ([`LocalRoute::help`]), cumulative.
    pub fn helped(&self) -> u64 {
        self.shared.helped.load(Ordering::Relaxed)
    }

    /// Cumulative time workers spent copying bytes.
    pub fn busy(&self) -> Duration {
        Duration::from_nanos(self.shared.busy_ns.load(Ordering::Relaxed))
    }

    /// Stops the workers once the queue is empty and joins them.
    pub fn shutdown(&self) {
        self.shared.queue.lock().shutdown = true;
        self.shared.ready.notify_all();
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            let _ = t.join();
        }
    }
}

impl<J: CopyJob> RouteShared<J> {
    /// What a task starts under: the directive it was given back with, or
    /// the hooks' next one (taken under the queue lock, so directives
    /// apply in the order the route received its tasks).
    fn directive(&self, forced: Option<FaultDirective>) -> Option<FaultDirective> {
        forced.or_else(|| self.hooks.as_ref().map(|h| h.task_directive()))
    }
}

impl<J: CopyJob> Requeue<J> for RouteShared<J> {
    fn requeue(&self, job: J, directive: FaultDirective) {
        {
            let mut q = self.queue.lock();
            q.jobs.push_back((job, Some(directive)));
            self.pending.fetch_add(1, Ordering::AcqRel);
        }
        self.ready.notify_one();
    }
}

/// Starts a task: copies it (within what the directive allows) and reports
/// how it ended, or hands it to the hooks to hold.
fn start<J: CopyJob>(shared: &Arc<RouteShared<J>>, mut job: J, directive: Option<FaultDirective>) {
    let planned = job.planned();
    let (limit, end) = match directive {
        None | Some(FaultDirective::Run) => (u64::MAX, TaskEnd::Complete),
        Some(FaultDirective::Hold) => {
            let back: Arc<dyn Requeue<J>> = shared.clone();
            match shared.hooks.as_ref() {
                Some(h) => match h.hold(job, back) {
                    Some(job) => return start(shared, job, None),
                    None => return,
                },
                None => return start(shared, job, None),
            }
        }
        Some(FaultDirective::Short { bytes }) => (bytes.min(planned), TaskEnd::Short),
        Some(FaultDirective::Fail { bytes, effect_unknown }) => {
            (bytes.min(planned), TaskEnd::Failed { effect_unknown })
        }
    };
    shared.copying.fetch_add(1, Ordering::AcqRel);
    let (done, failed) = copy(&mut job, limit, &shared.busy_ns);
    shared.copying.fetch_sub(1, Ordering::AcqRel);
    job.finish(TaskReport { planned, done, end: failed.unwrap_or(end) });
}

fn worker<J: CopyJob>(shared: &Arc<RouteShared<J>>) {
    work(shared);
    // What the routes made for this thread (streams, stagers) goes with it.
    crate::transport::routes::release_thread();
}

/// Posted tasks (driver copies on the self connection, shm or CUDA IPC,
/// and staged cma or file tasks) a worker keeps at once: while the device
/// runs task k, the worker has k + 1 .. queued behind it, so the copy
/// engine never idles waiting for the worker to wake up and queue the
/// next (and a staged task's CPU copy overlaps the next one's device
/// copy).
const POSTED_DEPTH: usize = 8;

/// Staged tasks (cma with device memory, one buffer each) a worker keeps
/// in flight: two overlap one task's device copy with the other's CPU
/// copy, and the buffers they cycle through stay in cache.
const STAGED_DEPTH: usize = 2;

/// A task posted by this worker.
struct InFlight<J> {
    job: J,
    planned: u64,
    issued: Box<dyn crate::transport::routes::Posted>,
}

fn work<J: CopyJob>(shared: &Arc<RouteShared<J>>) {
    let mut in_flight: VecDeque<InFlight<J>> = VecDeque::new();
    loop {
        if !in_flight.is_empty() {
            // More only while there is room and a job is queued now;
            // otherwise the oldest is waited for and reported.
            // A full queue is waited for in halves: one wake-up reports
            // POSTED_DEPTH / 2 tasks while the other half keeps the
            // device busy.
            let next = if in_flight.len() < POSTED_DEPTH { pop_now(shared, &mut shared.queue.lock()) } else { None };
            match next {
                Some((job, forced)) => {
                    // A staged task takes a buffer: at most STAGED_DEPTH
                    // at once per worker (the same few, still in cache
                    // for its CPU copies), and only one the staging bound
                    // has room for; until then the oldest task in flight
                    // completes and gives its buffer back.
                    let kind = job.program().mover.copies();
                    if kind.is_some_and(|k| k.holds_buffer(job.spans())) {
                        while !in_flight.is_empty()
                            && (in_flight.iter().filter(|f| f.issued.holds_buffer()).count() >= STAGED_DEPTH
                                || !kind.is_some_and(|k| k.buffer_room(job.spans())))
                        {
                            if let Some(f) = in_flight.pop_front() {
                                complete(shared, f);
                            }
                        }
                    }
                    dispatch(shared, job, forced, &mut in_flight)
                }
                None => {
                    let batch = if in_flight.len() == POSTED_DEPTH { POSTED_DEPTH / 2 } else { 1 };
                    if let Some(last) = in_flight.get(batch - 1) {
                        last.issued.await_done();
                    }
                    for f in in_flight.drain(..batch) {
                        complete(shared, f);
                    }
                }
            }
            continue;
        }
        let Some((job, forced)) = pop(shared) else { return };
        dispatch(shared, job, forced, &mut in_flight);
    }
}

/// The next job and its directive, waiting for one; `None` at shutdown
/// (once the queue is empty).
fn pop<J: CopyJob>(shared: &Arc<RouteShared<J>>) -> Option<(J, Option<FaultDirective>)> {
    let mut polled = false;
    let mut q = shared.queue.lock();
    loop {
        if let Some(next) = pop_now(shared, &mut q) {
            return Some(next);
        }
        if q.shutdown {
            return None;
        }
        if !polled && !shared.spin.is_zero() && claim(&shared.spinner) {
            // Poll once, unlocked, then look at the queue (and the
            // shutdown flag) again before sleeping. One worker polls at a
            // time; the others sleep at once.
            polled = true;
            parking_lot::MutexGuard::unlocked(&mut q, || poll(&shared.pending, shared.spin));
            shared.spinner.store(false, Ordering::Release);
            continue;
        }
        shared.ready.wait(&mut q);
    }
}

/// The next job and its directive if one is queued now (`q`: the queue,
/// locked).
fn pop_now<J: CopyJob>(shared: &RouteShared<J>, q: &mut Queue<J>) -> Option<(J, Option<FaultDirective>)> {
    let (job, forced) = q.jobs.pop_front()?;
    shared.pending.fetch_sub(1, Ordering::AcqRel);
    if !q.jobs.is_empty() {
        shared.ready.notify_one(); // more work: a second pair of hands
    }
    Some((job, shared.directive(forced)))
}

/// Starts a job: a task of a posting copier, running free of fault
/// directives, is posted (`in_flight`); anything else runs to its end now.
fn dispatch<J: CopyJob>(
    shared: &Arc<RouteShared<J>>,
    job: J,
    directive: Option<FaultDirective>,
    in_flight: &mut VecDeque<InFlight<J>>,
) {
    if !matches!(directive, None | Some(FaultDirective::Run)) {
        return start(shared, job, directive);
    }
    let began = Instant::now();
    let p = job.program();
    let issued = p.mover.copies().and_then(|k| k.post(p.op, job.spans(), u64::MAX));
    shared.busy_ns.fetch_add(began.elapsed().as_nanos() as u64, Ordering::Relaxed);
    match issued {
        None => start(shared, job, directive),
        Some(Ok(issued)) => in_flight.push_back(InFlight { planned: job.planned(), job, issued }),
        Some(Err((done, failed))) => {
            let planned = job.planned();
            job.finish(TaskReport { planned, done, end: failed.unwrap_or(TaskEnd::Complete) });
        }
    }
}

/// Waits for a posted task and reports it.
fn complete<J: CopyJob>(shared: &Arc<RouteShared<J>>, f: InFlight<J>) {
    let began = Instant::now();
    let (done, failed) = f.issued.finish();
    shared.busy_ns.fetch_add(began.elapsed().as_nanos() as u64, Ordering::Relaxed);
    f.job.finish(TaskReport { planned: f.planned, done, end: failed.unwrap_or(TaskEnd::Complete) });
}

/// Copies a task (at most `limit` bytes) by its program's kind. Returns
/// the bytes moved and, on failure, how the task ended.
fn copy<J: CopyJob>(job: &mut J, limit: u64, busy_ns: &AtomicU64) -> (u64, Option<TaskEnd>) {
    let start = Instant::now();
    let result = job.copy_locally(limit).unwrap_or_else(|| {
        let p = job.program();
        match p.mover.copies() {
            Some(kind) => kind.copy(p.op, job.spans(), limit),
            // Frames go to the peer's link (a staged task's after its
            // worker phase, `copy_locally`), never to a copy here.
            None => (0, Some(TaskEnd::Failed { effect_unknown: false })),
        }
    });
    busy_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::routes::{Mover, loopback::Memory};
    use crate::transport::{CopyProgram, Span, TaskRange};
    use crate::types::Op;

    /// One task of 8 bytes from `src` to `dst` (this process), of transfer
    /// `owner`; it records who ran it.
    struct Job {
        program: CopyProgram,
        owner: usize,
        helpable: bool,
        ran: Arc<Mutex<Vec<usize>>>,
    }

    impl CopyJob for Job {
        fn program(&self) -> &CopyProgram {
            &self.program
        }
        fn task(&self) -> u32 {
            0
        }
        fn finish(self, report: TaskReport) {
            assert_eq!(report.done, 8);
            self.ran.lock().push(self.owner);
        }
        fn owner(&self) -> usize {
            self.owner
        }
        fn helpable(&self) -> bool {
            self.helpable
        }
    }

    #[test]
    fn a_caller_helps_only_its_own_transfer_and_only_when_its_task_is_next() {
        // No worker: only callers run tasks.
        let route: LocalRoute<Job> = LocalRoute::start(0, Duration::ZERO, None).unwrap();
        let src = [7u8; 8];
        let dst: Vec<Box<[u8; 8]>> = (0..5).map(|_| Box::new([0u8; 8])).collect();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let job = |owner: usize, helpable: bool, k: usize| Job {
            program: CopyProgram {
                op: Op::Write,
                mover: Mover::Copy(Box::new(Memory)),
                spans: vec![Span { local: src.as_ptr() as u64, remote: dst[k].as_ptr() as u64, remote_reg: 0, len: 8 }],
                tasks: vec![TaskRange { first_span: 0, end_span: 1, bytes: 8 }],
            },
            owner,
            helpable,
            ran: ran.clone(),
        };
        // Queued in this order: A, A, B, A, then a task of A that only a
        // worker may run (a device copy, say).
        let (a, b) = (1, 2);
        route.submit_all(vec![job(a, true, 0), job(a, true, 1), job(b, true, 2), job(a, true, 3), job(a, false, 4)]);
        assert!(route.help(a) && route.help(a), "A's two tasks are next");
        assert!(!route.help(a), "B's task is next: A's caller leaves it");
        assert!(route.help_on_a_free_core(b), "no thread copies: B's waiter helps");
        assert!(route.help(a));
        assert!(!route.help(a), "a task a caller may not copy is left to the workers");
        assert_eq!(*ran.lock(), vec![a, a, b, a]);
        assert_eq!(route.helped(), 4);
        assert!(dst[..4].iter().all(|d| **d == src) && *dst[4] == [0u8; 8]);
        // The worker a route gets later takes what was left.
        route.shared.queue.lock().jobs.clear();
        route.shared.pending.store(0, Ordering::Release);
        route.shutdown();
    }
}
