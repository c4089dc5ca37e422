//! The local route: copies between registrations of one engine (the self
//! connection) and into same-host peers (mapped shared memory, CMA), on
//! worker threads; a small lone task may instead run on the posting
//! thread (`run_inline`), which saves the hand-off.
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

use crate::transport::{CopyJob, copy_spans};
use crate::types::{TaskEnd, TaskReport};

#[cfg(feature = "fault-injection")]
use crate::transport::fault::{FaultDirective, FaultState};

#[cfg(feature = "fault-injection")]
type Forced = Option<FaultDirective>;
#[cfg(not(feature = "fault-injection"))]
type Forced = ();

struct Queue<J> {
    jobs: VecDeque<(J, Forced)>,
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
    spin: Duration,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: FaultState<J>,
}

/// The local route and its workers.
pub(crate) struct LocalRoute<J: CopyJob> {
    shared: Arc<RouteShared<J>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl<J: CopyJob> LocalRoute<J> {
    /// Starts `workers` threads that poll for up to `spin` before sleeping.
    pub fn start(workers: u32, spin: Duration) -> std::io::Result<Self> {
        let shared = Arc::new(RouteShared {
            queue: Mutex::new(Queue { jobs: VecDeque::new(), shutdown: false }),
            ready: Condvar::new(),
            pending: AtomicUsize::new(0),
            busy_ns: AtomicU64::new(0),
            spinner: AtomicBool::new(false),
            spin,
            #[cfg(feature = "fault-injection")]
            faults: FaultState::default(),
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
        #[cfg(feature = "fault-injection")]
        let forced = None;
        #[cfg(not(feature = "fault-injection"))]
        let forced = ();
        // Count under the queue lock: a worker pops (and decrements) only
        // under it, so the count never runs below zero.
        let pending = {
            let mut q = self.shared.queue.lock();
            q.jobs.push_back((job, forced));
            self.shared.pending.fetch_add(1, Ordering::AcqRel) + 1
        };
        // A polling worker sees a lone job (and re-checks the queue before it
        // sleeps): waking a sleeping one too would only cost a system call.
        if pending > 1 || !self.shared.spinner.load(Ordering::Acquire) {
            self.shared.ready.notify_one();
        }
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
        #[cfg(feature = "fault-injection")]
        let directive = self.shared.faults.next_directive();
        drop(q);
        #[cfg(feature = "fault-injection")]
        match directive {
            FaultDirective::Hold => self.shared.faults.hold(job),
            other => run_faulty(job, other, &self.shared.busy_ns),
        }
        #[cfg(not(feature = "fault-injection"))]
        run(job, &self.shared.busy_ns);
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

    #[cfg(feature = "fault-injection")]
    pub(crate) fn shared(&self) -> &Arc<RouteShared<J>> {
        &self.shared
    }
}

#[cfg(feature = "fault-injection")]
impl<J: CopyJob> RouteShared<J> {
    /// Re-queues a held job with a directive.
    pub(crate) fn requeue(&self, job: J, directive: FaultDirective) {
        {
            let mut q = self.queue.lock();
            q.jobs.push_back((job, Some(directive)));
            self.pending.fetch_add(1, Ordering::AcqRel);
        }
        self.ready.notify_one();
    }
}

fn worker<J: CopyJob>(shared: &RouteShared<J>) {
    loop {
        let (job, forced) = {
            let mut polled = false;
            let mut q = shared.queue.lock();
            loop {
                if let Some((job, forced)) = q.jobs.pop_front() {
                    shared.pending.fetch_sub(1, Ordering::AcqRel);
                    if !q.jobs.is_empty() {
                        shared.ready.notify_one(); // more work: a second pair of hands
                    }
                    // Directives are taken under the queue lock, so they
                    // apply to tasks in the order the route received them.
                    #[cfg(feature = "fault-injection")]
                    let forced = forced.unwrap_or_else(|| shared.faults.next_directive());
                    break (job, forced);
                }
                if q.shutdown {
                    return;
                }
                if !polled && !shared.spin.is_zero() && claim(&shared.spinner) {
                    // Poll once, unlocked, then look at the queue (and the
                    // shutdown flag) again before sleeping. One worker
                    // polls at a time; the others sleep at once.
                    polled = true;
                    parking_lot::MutexGuard::unlocked(&mut q, || poll(&shared.pending, shared.spin));
                    shared.spinner.store(false, Ordering::Release);
                    continue;
                }
                shared.ready.wait(&mut q);
            }
        };
        #[cfg(feature = "fault-injection")]
        {
            match forced {
                FaultDirective::Hold => shared.faults.hold(job),
                other => run_faulty(job, other, &shared.busy_ns),
            }
        }
        #[cfg(not(feature = "fault-injection"))]
        {
            let () = forced;
            run(job, &shared.busy_ns);
        }
    }
}

/// Claims the right to poll; false if another thread holds it.
pub(crate) fn claim(flag: &AtomicBool) -> bool {
    flag.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_ok()
}

/// Polls `pending` for up to `spin`; true if work arrived.
pub(crate) fn poll(pending: &AtomicUsize, spin: Duration) -> bool {
    let start = Instant::now();
    loop {
        for _ in 0..64 {
            if pending.load(Ordering::Acquire) > 0 {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= spin {
            return false;
        }
    }
}

#[cfg_attr(feature = "fault-injection", allow(dead_code))]
fn run<J: CopyJob>(job: J, busy_ns: &AtomicU64) {
    let (done, end) = copy(&job, u64::MAX, busy_ns);
    let planned = job.planned();
    job.finish(TaskReport { planned, done, end: end.unwrap_or(TaskEnd::Complete) });
}

/// Copies a task (at most `limit` bytes) by the program's means: memory of
/// this process (self connection, mapped shared memory) or CMA. Returns
/// the bytes moved and, on failure, how the task ended.
fn copy<J: CopyJob>(job: &J, limit: u64, busy_ns: &AtomicU64) -> (u64, Option<TaskEnd>) {
    let start = Instant::now();
    let p = job.program();
    if let Some(entry) = &p.file {
        let result = copy_file(entry, p.op, job.spans(), limit);
        busy_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        return result;
    }
    let result = match p.cma_pid {
        // SAFETY: the job retains the range loans of every local span
        // (CopyJob contract); remote addresses are checked by the kernel.
        Some(pid) => match unsafe { crate::transport::cma::copy(pid, p.op, job.spans(), limit) } {
            Ok(done) => (done, None),
            // A WRITE into a peer that failed (or died) mid-copy may have
            // landed more than we can prove.
            Err((done, _)) => (done, Some(TaskEnd::Failed { effect_unknown: p.op == crate::batch::Op::Write })),
        },
        // SAFETY: the job retains the range loans (and mappings) of every
        // span, and the lifecycle admits each task once.
        None => (unsafe { copy_spans(p.op, job.spans(), limit) }, None),
    };
    busy_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    match &p.peer_alive {
        Some(check) if result.1.is_none() && !check.alive() => {
            (result.0, Some(TaskEnd::Failed { effect_unknown: p.op == crate::batch::Op::Write }))
        }
        _ => result,
    }
}

thread_local! {
    /// Each worker's io_uring ring, made on its first file task.
    static RING: std::cell::RefCell<Option<crate::file::FileIo>> = const { std::cell::RefCell::new(None) };
}

/// A file task: the spans' `remote` are file offsets. Bytes landed are
/// exact (a READ that meets the end of the file is short); an I/O error is
/// a failure, a WRITE's effect then unknown.
fn copy_file(
    entry: &crate::file::Entry,
    op: crate::types::Op,
    spans: &[crate::transport::Span],
    limit: u64,
) -> (u64, Option<TaskEnd>) {
    use crate::file::{FileIo, FileOp, FileSpan};
    let write = op == crate::batch::Op::Write;
    let mut left = limit;
    let file_spans: Vec<FileSpan> = spans
        .iter()
        .map_while(|s| {
            let len = s.len.min(left);
            left -= len;
            (len > 0).then_some(FileSpan { mem: s.local as *mut u8, len, file_offset: s.remote })
        })
        .collect();
    let planned: u64 = file_spans.iter().map(|s| s.len).sum();
    let outcome = RING.with(|ring| {
        let mut ring = ring.borrow_mut();
        if ring.is_none() {
            *ring = Some(FileIo::new(64)?);
        }
        let io = ring.as_ref().expect("made above");
        let op = if write { FileOp::Write } else { FileOp::Read };
        // SAFETY: the job retains the range loans of every local span, and
        // the lifecycle admits each task once.
        unsafe { io.run(entry, op, &file_spans) }
    });
    match outcome {
        Ok(o) if o.error.is_some() => (o.prefix, Some(TaskEnd::Failed { effect_unknown: write })),
        Ok(o) if o.prefix < planned => (o.prefix, Some(TaskEnd::Short)),
        Ok(o) => (o.prefix, None),
        // Refused before any I/O (the file was closed, say).
        Err(_) => (0, Some(TaskEnd::Failed { effect_unknown: false })),
    }
}

#[cfg(feature = "fault-injection")]
fn run_faulty<J: CopyJob>(job: J, directive: FaultDirective, busy_ns: &AtomicU64) {
    let planned = job.planned();
    let (limit, end) = match directive {
        FaultDirective::Run | FaultDirective::Hold => return run(job, busy_ns),
        FaultDirective::Short { bytes } => (bytes.min(planned), TaskEnd::Short),
        FaultDirective::Fail { bytes, effect_unknown } => (bytes.min(planned), TaskEnd::Failed { effect_unknown }),
    };
    let (done, failed) = copy(&job, limit, busy_ns);
    job.finish(TaskReport { planned, done, end: failed.unwrap_or(end) });
}
