//! Streams and events.
//!
//! A created stream is a worker thread running a FIFO of operations
//! (copies, memsets, event records, event waits) one after another. The
//! null stream, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` run each
//! operation in the caller before the call returns; on the null and legacy
//! streams it first waits for the work already enqueued on the current
//! context's blocking streams (those created without
//! `CU_STREAM_NON_BLOCKING`), like the legacy default stream.
//!
//! Handles are the addresses of the shim's stream and event objects, looked
//! up in a table, so a stale or foreign handle is `CUDA_ERROR_INVALID_HANDLE`
//! rather than a crash.

use std::collections::{BTreeMap, VecDeque};
use std::ffi::{c_int, c_uint};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crate::context::{Ctx, require_current};
use crate::ffi::*;
use crate::memory::Span;
use crate::stats::{self, Counter};

/// One queued operation.
pub enum Op {
    /// `n` bytes from `src` to `dst` (which may overlap: DtoD within one
    /// allocation). Asynchronous copies wait `ORBITE_CUDA_SHIM_COPY_DELAY_US`
    /// first.
    Copy {
        dst: Span,
        src: Span,
        n: usize,
        asynchronous: bool,
    },
    Memset {
        dst: Span,
        value: u8,
        n: usize,
    },
    Record {
        event: Arc<Event>,
        generation: u64,
    },
    Wait {
        event: Arc<Event>,
        generation: u64,
    },
    /// A 0-byte copy or memset.
    Noop,
}

impl Op {
    pub fn run(self) {
        match self {
            Op::Copy { dst, src, n, asynchronous } => {
                if asynchronous {
                    if let Ok(config) = crate::init::config() {
                        if !config.copy_delay.is_zero() {
                            std::thread::sleep(config.copy_delay);
                        }
                    }
                }
                // SAFETY: both spans were checked to hold `n` bytes when the
                // operation was made and stay mapped while held (see Span).
                unsafe { std::ptr::copy(src.ptr, dst.ptr, n) };
                if asynchronous {
                    stats::add(Counter::AsyncCopies, 1);
                }
                stats::add(Counter::CopiedBytes, n as u64);
            }
            Op::Memset { dst, value, n } => {
                // SAFETY: as for Copy.
                unsafe { std::ptr::write_bytes(dst.ptr, value, n) };
            }
            Op::Record { event, generation } => event.complete(generation),
            Op::Wait { event, generation } => event.wait_for(generation),
            Op::Noop => {}
        }
    }
}

struct Queue {
    ops: VecDeque<Op>,
    /// Operations enqueued and completed, ever: work enqueued before a
    /// point is done once `completed` reaches `enqueued` as of that point.
    enqueued: u64,
    completed: u64,
    destroyed: bool,
}

pub struct Stream {
    ctx: Ctx,
    flags: c_uint,
    queue: Mutex<Queue>,
    work: Condvar,
    progress: Condvar,
}

const CU_STREAM_NON_BLOCKING: c_uint = 0x1;

impl Stream {
    fn blocking(&self) -> bool {
        self.flags & CU_STREAM_NON_BLOCKING == 0
    }

    /// Appends the operation `make` builds, unless the stream is destroyed.
    /// `make` runs under the queue's lock, so that what it does (bump an
    /// event's generation) happens only for an operation that is queued.
    /// Returns the operation's mark: it has run once `completed` reaches it.
    fn enqueue(&self, make: impl FnOnce() -> Op) -> CuResult<u64> {
        let mut q = lock(&self.queue);
        if q.destroyed {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        q.ops.push_back(make());
        q.enqueued += 1;
        self.work.notify_one();
        Ok(q.enqueued)
    }

    fn mark(&self) -> u64 {
        lock(&self.queue).enqueued
    }

    fn wait_until(&self, mark: u64) {
        let mut q = lock(&self.queue);
        while q.completed < mark {
            q = wait(&self.progress, q);
        }
    }

    fn idle(&self) -> bool {
        let q = lock(&self.queue);
        q.completed == q.enqueued
    }

    fn worker(self: Arc<Self>) {
        loop {
            let op = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(op) = q.ops.pop_front() {
                        break Some(op);
                    }
                    if q.destroyed {
                        break None;
                    }
                    q = wait(&self.work, q);
                }
            };
            match op {
                None => break,
                // A record completes its event and counts as done in one
                // step under the queue's lock: whoever sees the event
                // complete then sees the stream idle (if nothing follows),
                // and whoever saw the stream synchronize sees the event
                // complete.
                Some(Op::Record { event, generation }) => {
                    let mut q = lock(&self.queue);
                    event.complete(generation);
                    q.completed += 1;
                }
                Some(op) => {
                    // An operation cannot panic short of a bug; if one did,
                    // the stream must still move on, or its waiters would
                    // hang.
                    let _ = catch_unwind(AssertUnwindSafe(|| op.run()));
                    lock(&self.queue).completed += 1;
                }
            }
            self.progress.notify_all();
        }
        lock(&STREAMS).remove(&(Arc::as_ptr(&self) as usize));
    }
}

/// Live streams, and destroyed ones whose worker is still draining (so
/// that cuCtxSynchronize waits for them too); by handle.
static STREAMS: Mutex<BTreeMap<usize, Arc<Stream>>> = Mutex::new(BTreeMap::new());

/// Where an operation on a stream handle runs.
enum Target {
    /// In the caller; `legacy` means after the blocking streams' work.
    Caller {
        ctx: Ctx,
        legacy: bool,
    },
    Worker(Arc<Stream>),
}

fn target(h: CUstream) -> CuResult<Target> {
    crate::init::config()?;
    match h as usize {
        0 | CU_STREAM_LEGACY => Ok(Target::Caller { ctx: require_current()?, legacy: true }),
        CU_STREAM_PER_THREAD => Ok(Target::Caller { ctx: require_current()?, legacy: false }),
        key => match lock(&STREAMS).get(&key) {
            Some(s) if !lock(&s.queue).destroyed => Ok(Target::Worker(Arc::clone(s))),
            _ => Err(CUDA_ERROR_INVALID_HANDLE),
        },
    }
}

/// `CUDA_SUCCESS` if operations can go to stream `h` (a live stream, or a
/// null stream with a current context).
pub fn check_stream(h: CUstream) -> CuResult<()> {
    target(h).map(drop)
}

/// Waits for the work enqueued so far on `ctx`'s streams: only the
/// blocking ones if `blocking_only`.
pub fn synchronize_context(ctx: Ctx, blocking_only: bool) {
    let marks: Vec<(Arc<Stream>, u64)> = lock(&STREAMS)
        .values()
        .filter(|s| s.ctx == ctx && (!blocking_only || s.blocking()))
        .map(|s| (Arc::clone(s), s.mark()))
        .collect();
    for (s, mark) in marks {
        s.wait_until(mark);
    }
}

/// Runs `op` on stream `h`: queued on a created stream, in the caller on the
/// null and per-thread streams. With `wait`, returns only once it has run.
pub fn submit(h: CUstream, op: Op, wait: bool) -> CuResult<()> {
    match target(h)? {
        Target::Caller { ctx, legacy } => {
            if legacy {
                synchronize_context(ctx, true);
            }
            op.run();
        }
        Target::Worker(s) => {
            let mark = s.enqueue(|| op)?;
            if wait {
                s.wait_until(mark);
            }
        }
    }
    Ok(())
}

/// Runs a synchronous copy or memset: on the legacy stream of the current
/// context, which must exist.
pub fn run_sync(op: Op) -> CuResult<()> {
    let ctx = require_current()?;
    synchronize_context(ctx, true);
    op.run();
    Ok(())
}

fn create(out: *mut CUstream, flags: c_uint) -> CuResult<()> {
    let ctx = require_current()?;
    if out.is_null() || flags & !CU_STREAM_NON_BLOCKING != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let stream = Arc::new(Stream {
        ctx,
        flags,
        queue: Mutex::new(Queue { ops: VecDeque::new(), enqueued: 0, completed: 0, destroyed: false }),
        work: Condvar::new(),
        progress: Condvar::new(),
    });
    let key = Arc::as_ptr(&stream) as usize;
    let worker = Arc::clone(&stream);
    lock(&STREAMS).insert(key, Arc::clone(&stream));
    let spawned = std::thread::Builder::new().name("cuda-shim-stream".into()).spawn(move || worker.worker());
    if spawned.is_err() {
        lock(&STREAMS).remove(&key);
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    stats::add(Counter::Streams, 1);
    // SAFETY: non-null, writable (driver API contract).
    unsafe { write_out(out, key as CUstream) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(out: *mut CUstream, flags: c_uint) -> CUresult {
    entry(|| create(out, flags))
}

/// The priority is accepted and ignored.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(out: *mut CUstream, flags: c_uint, _priority: c_int) -> CUresult {
    entry(|| create(out, flags))
}

/// Returns at once; work already enqueued still runs, then the worker
/// thread ends.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(h: CUstream) -> CUresult {
    entry(|| {
        let Target::Worker(s) = target(h)? else { return Err(CUDA_ERROR_INVALID_HANDLE) };
        {
            let mut q = lock(&s.queue);
            if q.destroyed {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
            q.destroyed = true;
        }
        s.work.notify_all();
        stats::sub(Counter::Streams, 1);
        Ok(())
    })
}

/// The null and per-thread streams have nothing pending (their work runs in
/// the caller), so they synchronize at once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(h: CUstream) -> CUresult {
    entry(|| {
        if let Target::Worker(s) = target(h)? {
            s.wait_until(s.mark());
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamQuery(h: CUstream) -> CUresult {
    entry(|| match target(h)? {
        Target::Worker(s) if !s.idle() => Err(CUDA_ERROR_NOT_READY),
        _ => Ok(()),
    })
}

/// Later work on the stream waits for the event's latest record (as of this
/// call); an event never recorded is no wait.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent(h: CUstream, ev: CUevent, flags: c_uint) -> CUresult {
    entry(|| {
        let event = Event::lookup(ev)?;
        if flags & !1 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match target(h)? {
            Target::Caller { .. } => {
                event.wait_for(event.recorded());
                Ok(())
            }
            Target::Worker(s) => {
                let generation = event.recorded();
                if generation == 0 {
                    return Ok(());
                }
                s.enqueue(|| Op::Wait { event, generation }).map(drop)
            }
        }
    })
}

struct EventState {
    /// Records issued, ever (the latest is the event's current record).
    recorded: u64,
    /// The highest record executed, and when.
    done: u64,
    time: Option<Instant>,
}

pub struct Event {
    flags: c_uint,
    state: Mutex<EventState>,
    done: Condvar,
}

const CU_EVENT_BLOCKING_SYNC: c_uint = 0x1;
const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;
const CU_EVENT_INTERPROCESS: c_uint = 0x4;

static EVENTS: Mutex<BTreeMap<usize, Arc<Event>>> = Mutex::new(BTreeMap::new());

impl Event {
    fn lookup(h: CUevent) -> CuResult<Arc<Event>> {
        crate::init::config()?;
        lock(&EVENTS).get(&(h as usize)).cloned().ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    fn recorded(&self) -> u64 {
        lock(&self.state).recorded
    }

    /// Issues a new record; its generation.
    fn begin_record(&self) -> u64 {
        let mut s = lock(&self.state);
        s.recorded += 1;
        s.recorded
    }

    fn complete(&self, generation: u64) {
        let mut s = lock(&self.state);
        if generation > s.done {
            s.done = generation;
            s.time = Some(Instant::now());
        }
        self.done.notify_all();
    }

    fn is_done(&self) -> bool {
        let s = lock(&self.state);
        s.done >= s.recorded
    }

    fn wait_for(&self, generation: u64) {
        let mut s = lock(&self.state);
        while s.done < generation {
            s = wait(&self.done, s);
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(out: *mut CUevent, flags: c_uint) -> CUresult {
    entry(|| {
        require_current()?;
        let known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
        let interprocess_needs = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
        if out.is_null()
            || flags & !known != 0
            || (flags & CU_EVENT_INTERPROCESS != 0 && flags & interprocess_needs != interprocess_needs)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let event = Arc::new(Event {
            flags,
            state: Mutex::new(EventState { recorded: 0, done: 0, time: None }),
            done: Condvar::new(),
        });
        let key = Arc::as_ptr(&event) as usize;
        lock(&EVENTS).insert(key, event);
        stats::add(Counter::Events, 1);
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(out, key as CUevent) }
    })
}

fn record(ev: CUevent, h: CUstream) -> CuResult<()> {
    let event = Event::lookup(ev)?;
    match target(h)? {
        Target::Caller { ctx, legacy } => {
            if legacy {
                synchronize_context(ctx, true);
            }
            let generation = event.begin_record();
            event.complete(generation);
            Ok(())
        }
        Target::Worker(s) => {
            let e = Arc::clone(&event);
            s.enqueue(move || Op::Record { generation: e.begin_record(), event: e }).map(drop)
        }
    }
}

/// Complete once every operation enqueued on the stream before it has run.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(ev: CUevent, h: CUstream) -> CUresult {
    entry(|| record(ev, h))
}

/// `CU_EVENT_RECORD_DEFAULT` or `CU_EVENT_RECORD_EXTERNAL` (treated alike).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecordWithFlags(ev: CUevent, h: CUstream, flags: c_uint) -> CUresult {
    entry(|| {
        if flags & !1 != 0 {
            crate::init::config()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        record(ev, h)
    })
}

/// `CUDA_SUCCESS` once the latest record has run (or if never recorded),
/// `CUDA_ERROR_NOT_READY` before.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(ev: CUevent) -> CUresult {
    entry(|| if Event::lookup(ev)?.is_done() { Ok(()) } else { Err(CUDA_ERROR_NOT_READY) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(ev: CUevent) -> CUresult {
    entry(|| {
        let event = Event::lookup(ev)?;
        event.wait_for(event.recorded());
        Ok(())
    })
}

/// A pending record still completes (and still releases its waiters).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(ev: CUevent) -> CUresult {
    entry(|| {
        crate::init::config()?;
        lock(&EVENTS).remove(&(ev as usize)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        stats::sub(Counter::Events, 1);
        Ok(())
    })
}

fn elapsed(ms: *mut f32, start: CUevent, end: CUevent) -> CuResult<()> {
    let (a, b) = (Event::lookup(start)?, Event::lookup(end)?);
    if ms.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if (a.flags | b.flags) & CU_EVENT_DISABLE_TIMING != 0 || a.recorded() == 0 || b.recorded() == 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if !a.is_done() || !b.is_done() {
        return Err(CUDA_ERROR_NOT_READY);
    }
    let (ta, tb) = (lock(&a.state).time, lock(&b.state).time);
    let (Some(ta), Some(tb)) = (ta, tb) else { return Err(CUDA_ERROR_NOT_READY) };
    let millis =
        if tb >= ta { tb.duration_since(ta).as_secs_f32() } else { -ta.duration_since(tb).as_secs_f32() } * 1000.0;
    // SAFETY: non-null, writable (driver API contract).
    unsafe { write_out(ms, millis) }
}

/// Milliseconds between the two records' execution in the shim.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) -> CUresult {
    entry(|| elapsed(ms, start, end))
}

/// As cuEventElapsedTime.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, start: CUevent, end: CUevent) -> CUresult {
    entry(|| elapsed(ms, start, end))
}
