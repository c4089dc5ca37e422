//! Staging (feature `cuda`): a task whose local side is CUDA device memory
//! on a same-host route that cannot reach it (cma: the peer's private
//! memory is not mapped here), bounced through page-locked host buffers.
//!
//! A task that fits one buffer (`staging_chunk_bytes`, the default with
//! `task_bytes` at its default) is pipelined across tasks: the worker
//! queues task k + 1's device copy into one buffer (WRITE) while it
//! copies task k out of another to the peer, or copies task k + 1 in
//! from the peer while the device takes task k (READ); two such tasks in
//! flight per worker ([`issue`], [`complete`], `local::work`). A larger task
//! is pipelined within itself through two buffers ([`copy`]): WRITE copies
//! chunk k + 1 from the device into one buffer while the CPU copies chunk
//! k out of the other; READ copies chunk k into one buffer while the
//! device takes chunk k - 1 from the other. Either way a task reports only
//! after its last device copy completed.
//!
//! Buffers come from the engine's staging pool ([`StagingPool`], which
//! tcp staging and peers' staged requests share): charged to
//! `staging_buffers`/`staging_bytes` within `max_staging_bytes` while
//! they exist, held by a task only while it runs, free ones kept for
//! reuse by any worker until the engine closes.

use std::cell::RefCell;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Copier, LocalSide, NoDeviceCopy, Posted};
use crate::charge::{Charge, Counter, Counters};
use crate::cuda::{PinnedBuffer, Stager, Ticket};
use crate::transport::Span;
use crate::types::{Op, TaskEnd, TaskReport};

thread_local! {
    /// This worker's stagers (a stream and two events), by device.
    static STAGERS: RefCell<Vec<(u32, Stager)>> = const { RefCell::new(Vec::new()) };
    /// A buffer this worker took from the pool for its next pipelined task
    /// ([`room`]), so that the task finds it.
    static RESERVED: RefCell<Option<Pooled>> = const { RefCell::new(None) };
}

/// Gives back this thread's stagers and reserved buffer (a route worker,
/// as it ends, after its last task completed).
pub(crate) fn release_thread_stagers() {
    drop(STAGERS.take());
    drop(RESERVED.take());
}

/// Whether this worker can have a staging buffer of `chunk` bytes for
/// `device` now: one is reserved, or the pool gives one (reserved for the
/// next [`issue`]). False when `max_staging_bytes` leaves no room or the
/// driver refuses the memory.
fn room(pool: &Arc<StagingPool>, device: u32, chunk: u64) -> bool {
    RESERVED.with(|cell| {
        let mut r = cell.borrow_mut();
        if r.as_ref().is_some_and(|b| b.device() == device && b.len() >= chunk) {
            return true;
        }
        *r = None;
        *r = pool.take(device, chunk).ok();
        r.is_some()
    })
}

/// The reserved buffer if it suits, else one from the pool.
fn take(pool: &Arc<StagingPool>, device: u32, chunk: u64) -> Option<Pooled> {
    match RESERVED.take() {
        Some(b) if b.device() == device && b.len() >= chunk => Some(b),
        _ => pool.take(device, chunk).ok(),
    }
}

/// A same-host route that cannot reach device memory (`inner`: cma, a
/// file) with CUDA device memory on the local side: each task is bounced
/// through page-locked buffers of `chunk` bytes from `pool`.
pub(crate) struct Staged {
    device: u32,
    /// `staging_chunk_bytes`.
    chunk: u64,
    pool: Arc<StagingPool>,
    inner: Arc<dyn Copier>,
    /// Why the inner route does not reach the device memory, where it
    /// could have (said in the route's reason).
    why: Option<String>,
}

impl Staged {
    /// `inner` with the local side `local`: staged when that is device
    /// memory, saying `why` the inner route (RDMA) does not reach the
    /// device memory itself, if it could have.
    pub(crate) fn over(inner: Box<dyn Copier>, local: &LocalSide<'_>, why: Option<String>) -> Box<dyn Copier> {
        match local.device {
            None => inner,
            Some(device) => {
                let (chunk, pool) = (local.chunk, local.pool.clone());
                Box::new(Staged { device, chunk, pool, inner: Arc::from(inner), why })
            }
        }
    }

    fn fits_one(&self, spans: &[Span]) -> bool {
        spans.iter().map(|s| s.len).sum::<u64>() <= self.chunk
    }
}

impl Copier for Staged {
    fn name(&self) -> &'static str {
        "staged copies"
    }

    fn copy(&self, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>) {
        copy(&self.pool, self.device, self.chunk, &*self.inner, op, spans, limit)
    }

    fn post(&self, op: Op, spans: &[Span], limit: u64) -> Option<Result<Box<dyn Posted>, (u64, Option<TaskEnd>)>> {
        let issued = issue(&self.pool, self.device, self.chunk, &*self.inner, op, spans, limit)?;
        Some(issued.map(|(ticket, bytes, task)| {
            Box::new(StagedPosted { ticket, bytes, task, inner: self.inner.clone() }) as Box<dyn Posted>
        }))
    }

    fn with_local(self: Box<Self>, local: &LocalSide<'_>) -> Result<Box<dyn Copier>, NoDeviceCopy> {
        local.host_only(self)
    }

    fn waits(&self) -> bool {
        true
    }

    /// A task that fits one buffer is pipelined across tasks, holding it.
    fn holds_buffer(&self, spans: &[Span]) -> bool {
        self.fits_one(spans)
    }

    fn buffer_room(&self, spans: &[Span]) -> bool {
        !self.fits_one(spans) || room(&self.pool, self.device, self.chunk)
    }

    fn device_note(&self) -> Option<String> {
        let why = self.why.as_ref().map(|w| format!(" (no GPUDirect: {w})")).unwrap_or_default();
        Some(format!(
            "CUDA device memory (device {}) staged through page-locked buffers of {} bytes{why}",
            self.device, self.chunk
        ))
    }
}

/// A staged task [`Staged::post`] started: its device copy queued.
struct StagedPosted {
    ticket: Ticket,
    bytes: u64,
    task: StagedTask,
    inner: Arc<dyn Copier>,
}

impl Posted for StagedPosted {
    fn holds_buffer(&self) -> bool {
        true
    }

    fn await_done(&self) {
        crate::cuda::await_ticket(&self.ticket);
    }

    fn finish(self: Box<Self>) -> (u64, Option<TaskEnd>) {
        let StagedPosted { ticket, bytes, task, inner } = *self;
        complete(crate::cuda::wait_ticket(ticket), &*inner, bytes, task)
    }
}

/// A pipelined task in flight: its buffer (no device copy and no
/// CPU copy touches it once the task completed) and its spans with the
/// local side in the buffer.
struct StagedTask {
    /// Back in the pool when the task is dropped (after its device copy
    /// was waited for).
    _buffer: Pooled,
    op: Op,
    host: Vec<Span>,
    /// A READ whose route ended short (a file's end): the prefix that
    /// reached the buffer goes to the device, and the task ends short.
    short: bool,
}

/// Starts a task that fits one staging buffer (`chunk` bytes): WRITE
/// queues its device copy into the buffer on this worker's stream; READ
/// copies it in from the route (`inner`) and queues the device copy out
/// of the buffer. `None` when the task does not fit one buffer (the caller
/// copies it through [`copy`]); `Err` when it already ended (no buffer to
/// be had fails it, as for [`copy`]).
#[allow(clippy::type_complexity, reason = "the shape of Copier::post")]
fn issue(
    pool: &Arc<StagingPool>,
    device: u32,
    chunk: u64,
    inner: &dyn Copier,
    op: Op,
    spans: &[Span],
    limit: u64,
) -> Option<Result<(Ticket, u64, StagedTask), (u64, Option<TaskEnd>)>> {
    let total = spans.iter().map(|s| s.len).sum::<u64>().min(limit);
    if total == 0 || total > chunk {
        return None;
    }
    let Some(buffer) = take(pool, device, chunk) else {
        return Some(Err((0, Some(TaskEnd::Failed { effect_unknown: false }))));
    };
    let mut c = chunks(spans, limit, chunk);
    let c = c.pop()?;
    let addr = buffer.addr();
    let mut task = StagedTask { _buffer: buffer, op, host: host_spans(&c.pieces, addr), short: false };
    let (mut c, mut total) = (c, total);
    if op == Op::Read {
        match inner.copy(Op::Read, &task.host, u64::MAX) {
            (_, None) => {}
            // The end of a file: the prefix that reached the buffer goes
            // on to the device.
            (n, Some(TaskEnd::Short)) if n > 0 => (c, total, task.short) = (c.truncated(n), n, true),
            // What reached the buffer never reached the device.
            (_, Some(end)) => return Some(Err((0, Some(end)))),
        }
    }
    Some(match crate::cuda::issue_on_stream(device, &c.device_copies(op, addr)) {
        Ok(ticket) => Ok((ticket, total, task)),
        // WRITE: nothing was sent. READ: the copies before the failing one
        // reached the device; whether it wrote anything is not known.
        Err((done, _)) => Err(match op {
            Op::Write => (0, Some(TaskEnd::Failed { effect_unknown: false })),
            Op::Read => (done, Some(TaskEnd::Failed { effect_unknown: true })),
        }),
    })
}

/// Ends a task [`issue`] started, once its device copy was waited for
/// (`device`: how that ended): WRITE copies the buffer out through the
/// route; READ is done.
fn complete(
    device: Result<(), crate::cuda::CudaError>,
    inner: &dyn Copier,
    bytes: u64,
    task: StagedTask,
) -> (u64, Option<TaskEnd>) {
    match (task.op, device) {
        (Op::Write, Ok(())) => inner.copy(Op::Write, &task.host, u64::MAX),
        // Nothing was sent.
        (Op::Write, Err(_)) => (0, Some(TaskEnd::Failed { effect_unknown: false })),
        (Op::Read, Ok(())) => (bytes, task.short.then_some(TaskEnd::Short)),
        (Op::Read, Err(_)) => (0, Some(TaskEnd::Failed { effect_unknown: true })),
    }
}

/// One chunk: pieces of the task's spans, laid out back to back in a
/// staging buffer (`local` is the device side, `remote` the route's).
struct Chunk {
    pieces: Vec<Span>,
}

/// `spans` as the route sees them: local addresses back to back in
/// `buffer`.
fn host_spans(spans: &[Span], buffer: u64) -> Vec<Span> {
    let mut at = 0;
    spans
        .iter()
        .map(|p| {
            let s = Span { local: buffer + at, ..*p };
            at += p.len;
            s
        })
        .collect()
}

/// Cuts the first `limit` bytes of `spans` into chunks of at most `chunk`
/// bytes.
fn chunks(spans: &[Span], limit: u64, chunk: u64) -> Vec<Chunk> {
    let mut out = Vec::new();
    let mut cur = Chunk { pieces: Vec::new() };
    let (mut fill, mut left) = (0u64, limit);
    for s in spans {
        let mut at = 0u64;
        while at < s.len && left > 0 {
            let n = (s.len - at).min(chunk - fill).min(left);
            cur.pieces.push(Span { local: s.local + at, remote: s.remote + at, remote_reg: s.remote_reg, len: n });
            (at, fill, left) = (at + n, fill + n, left - n);
            if fill == chunk {
                out.push(std::mem::replace(&mut cur, Chunk { pieces: Vec::new() }));
                fill = 0;
            }
        }
    }
    if !cur.pieces.is_empty() {
        out.push(cur);
    }
    out
}

impl Chunk {
    fn bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// Its first `n` bytes.
    fn truncated(&self, n: u64) -> Chunk {
        let mut left = n;
        let pieces = self
            .pieces
            .iter()
            .map_while(|p| {
                let len = p.len.min(left);
                left -= len;
                (len > 0).then_some(Span { len, ..*p })
            })
            .collect();
        Chunk { pieces }
    }

    /// The device copies between the pieces' local ranges and `buffer`:
    /// into the buffer for a WRITE, out of it for a READ.
    fn device_copies(&self, op: Op, buffer: u64) -> Vec<(u64, u64, u64)> {
        let mut at = 0;
        self.pieces
            .iter()
            .map(|p| {
                let b = buffer + at;
                at += p.len;
                match op {
                    Op::Write => (b, p.local, p.len),
                    Op::Read => (p.local, b, p.len),
                }
            })
            .collect()
    }
}

/// Copies a task larger than one buffer through two buffers of `chunk`
/// bytes from the pool and this worker's stager of `device`: the bytes
/// moved (a prefix) and, on failure, how the task ended. No buffer to be
/// had within `max_staging_bytes` fails the task (nothing moved).
fn copy(
    pool: &Arc<StagingPool>,
    device: u32,
    chunk: u64,
    inner: &dyn Copier,
    op: Op,
    spans: &[Span],
    limit: u64,
) -> (u64, Option<TaskEnd>) {
    let failed = (0, Some(TaskEnd::Failed { effect_unknown: false }));
    let (Some(b0), Some(b1)) = (take(pool, device, chunk), pool.take(device, chunk).ok()) else { return failed };
    STAGERS.with(|cell| {
        let mut stagers = cell.borrow_mut();
        let at = match stagers.iter().position(|(d, _)| *d == device) {
            Some(i) => i,
            None => match Stager::new(device) {
                Ok(s) => {
                    stagers.push((device, s));
                    stagers.len() - 1
                }
                Err(_) => return failed,
            },
        };
        let st = &mut stagers[at].1;
        let chunks = chunks(spans, limit, chunk);
        let buffers = [b0.addr(), b1.addr()];
        let result = match op {
            Op::Write => write(st, &buffers, inner, &chunks),
            Op::Read => read(st, &buffers, inner, &chunks),
        };
        if result.1.is_some() {
            st.drain(); // nothing of this task may still run
        }
        // Only now may the buffers go back to the pool.
        drop((b0, b1));
        result
    })
}

/// Device to buffer (chunk k + 1) while the route copies chunk k out.
fn write(st: &mut Stager, buffers: &[u64; 2], inner: &dyn Copier, chunks: &[Chunk]) -> (u64, Option<TaskEnd>) {
    let device_failed = Some(TaskEnd::Failed { effect_unknown: false });
    if let Some(first) = chunks.first() {
        if st.enqueue(0, &first.device_copies(Op::Write, buffers[0])).is_err() {
            return (0, device_failed);
        }
    }
    let mut done = 0u64;
    for (k, c) in chunks.iter().enumerate() {
        let slot = k % 2;
        if st.wait(slot).is_err() {
            return (done, device_failed);
        }
        if let Some(next) = chunks.get(k + 1) {
            let other = (k + 1) % 2;
            if st.enqueue(other, &next.device_copies(Op::Write, buffers[other])).is_err() {
                return (done, device_failed);
            }
        }
        let (n, end) = inner.copy(Op::Write, &host_spans(&c.pieces, buffers[slot]), u64::MAX);
        done += n;
        if end.is_some() {
            return (done, end);
        }
    }
    (done, None)
}

/// Route into a buffer (chunk k) while the device takes chunk k - 1.
fn read(st: &mut Stager, buffers: &[u64; 2], inner: &dyn Copier, chunks: &[Chunk]) -> (u64, Option<TaskEnd>) {
    // A failed device copy into local memory: what it wrote is not known.
    let device_failed = Some(TaskEnd::Failed { effect_unknown: true });
    let (mut landed, mut pending) = (0u64, [0u64; 2]);
    for (k, c) in chunks.iter().enumerate() {
        let slot = k % 2;
        // The buffer's previous chunk must be on the device before reuse.
        if st.wait(slot).is_err() {
            return (landed, device_failed);
        }
        landed += std::mem::take(&mut pending[slot]);
        let (n, end) = inner.copy(Op::Read, &host_spans(&c.pieces, buffers[slot]), u64::MAX);
        if let (Some(TaskEnd::Short), true) = (end, n > 0) {
            // The end of a file: its prefix in the buffer goes on to the
            // device after the chunks before it, and the task ends short.
            if st.enqueue(slot, &c.truncated(n).device_copies(Op::Read, buffers[slot])).is_err() {
                return (landed, device_failed);
            }
            pending[slot] = n;
            for slot in [(k + 1) % 2, slot] {
                if st.wait(slot).is_err() {
                    return (landed, device_failed);
                }
                landed += std::mem::take(&mut pending[slot]);
            }
            return (landed, Some(TaskEnd::Short));
        }
        if let Some(end) = end {
            // What reached the buffer never reached the device; the chunks
            // before it land first.
            let other = (k + 1) % 2;
            if st.wait(other).is_err() {
                return (landed, device_failed);
            }
            landed += pending[other];
            return (landed, Some(end));
        }
        if st.enqueue(slot, &c.device_copies(Op::Read, buffers[slot])).is_err() {
            return (landed, device_failed);
        }
        pending[slot] = c.bytes();
    }
    for slot in [chunks.len() % 2, (chunks.len() + 1) % 2] {
        if st.wait(slot).is_err() {
            return (landed, device_failed);
        }
        landed += std::mem::take(&mut pending[slot]);
    }
    (landed, None)
}

/// Page-locked buffers for staging (cma and tcp tasks, peers' requests),
/// kept for reuse by every worker.
pub(crate) struct StagingPool {
    free: Mutex<Vec<Item>>,
    counters: Arc<Counters>,
    /// `max_staging_bytes`.
    limit: u64,
    /// The engine's RDMA NICs: every buffer is a memory region on each,
    /// so an RDMA task can be staged through it.
    rails: Arc<crate::verbs::rails::Rails>,
    /// Every live buffer's lkeys per NIC, by address.
    keys: Arc<Keys>,
}

/// Live buffers' lkeys per NIC, by address: `(len, lkeys)`.
type Keys = Mutex<std::collections::BTreeMap<u64, (u64, Vec<Option<u32>>)>>;

struct Item {
    /// Before the buffer: the NICs let go of it first.
    regions: crate::verbs::rails::Regions,
    keys: Arc<Keys>,
    device: u32,
    buffer: PinnedBuffer,
    _charge: Charge,
}

impl Drop for Item {
    fn drop(&mut self) {
        self.keys.lock().remove(&self.buffer.addr());
        drop(std::mem::take(&mut self.regions));
    }
}

impl std::fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingPool").field("free", &self.free.lock().len()).field("limit", &self.limit).finish()
    }
}

/// Why the staging pool gave no buffer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StagingError {
    /// `max_staging_bytes` is reached, even with the free buffers released.
    #[error(transparent)]
    Exhausted(crate::types::Exhausted),
    /// The driver refused the page-locked allocation.
    #[error(transparent)]
    Driver(crate::cuda::CudaError),
}

impl StagingPool {
    pub fn new(counters: Arc<Counters>, limit: u64, rails: Arc<crate::verbs::rails::Rails>) -> Self {
        StagingPool { free: Mutex::new(Vec::new()), counters, limit, rails, keys: Arc::default() }
    }

    /// The lkey of NIC `rail`'s region of the buffer holding
    /// `[addr, addr + len)`.
    pub(crate) fn lkey(&self, rail: u8, addr: u64, len: u64) -> Option<u32> {
        let keys = self.keys.lock();
        let (base, (size, lkeys)) = keys.range(..=addr).next_back()?;
        (addr + len <= base + size).then(|| lkeys.get(rail as usize).copied().flatten()).flatten()
    }

    /// A buffer of device `device` of at least `len` bytes: a free one, or
    /// a new one (outside the pool's lock: allocation is slow).
    pub(crate) fn take(self: &Arc<Self>, device: u32, len: u64) -> Result<Pooled, StagingError> {
        let found = {
            let mut free = self.free.lock();
            // The most recently freed first: its bytes may still be in the
            // cache the next CPU copy runs in.
            free.iter().rposition(|i| i.device == device && i.buffer.len() >= len).map(|at| free.remove(at))
        };
        let item = match found {
            Some(i) => i,
            None => {
                let bound = Some((crate::types::Resource::StagingBytes, self.limit));
                let charge = || {
                    Charge::try_new(
                        &self.counters,
                        [(Counter::StagingBuffers, 1, None), (Counter::StagingBytes, len, bound)],
                    )
                };
                let charge = charge().or_else(|e| {
                    // Free buffers of other sizes or devices make room.
                    self.clear();
                    charge().map_err(|_| StagingError::Exhausted(e))
                })?;
                let buffer = PinnedBuffer::new(device, len).map_err(StagingError::Driver)?;
                let (addr, size) = (buffer.addr(), buffer.len());
                // SAFETY: page-locked host memory the item owns; its regions
                // are dropped before it.
                let regions = unsafe { self.rails.register(addr, size, crate::verbs::rails::Remote::None) };
                if regions.any() {
                    self.keys.lock().insert(addr, (size, regions.lkeys()));
                }
                Item { regions, keys: self.keys.clone(), device, buffer, _charge: charge }
            }
        };
        Ok(Pooled { pool: self.clone(), item: Some(item) })
    }

    /// Frees every buffer not in use (at close, after the workers ended).
    pub fn clear(&self) {
        let items = std::mem::take(&mut *self.free.lock());
        drop(items);
    }
}

/// A buffer taken from the pool; back in it on drop.
pub(crate) struct Pooled {
    pool: Arc<StagingPool>,
    item: Option<Item>,
}

impl Pooled {
    pub(crate) fn addr(&self) -> u64 {
        self.item.as_ref().map_or(0, |i| i.buffer.addr())
    }

    fn device(&self) -> u32 {
        self.item.as_ref().map_or(u32::MAX, |i| i.device)
    }

    fn len(&self) -> u64 {
        self.item.as_ref().map_or(0, |i| i.buffer.len())
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            self.pool.free.lock().push(item);
        }
    }
}

// The tcp route's staging: the initiator stages a task's device bytes
// through a pool buffer around its link (`TcpStage`); the target stages a
// peer's request that names its device memory (`ServerStage`).

/// Where a staged task goes next.
pub(crate) enum Next {
    /// To the peer's link, with the buffer as its local side.
    Link,
    /// To a route worker (the buffer to the device).
    Worker,
    /// Nowhere: it ended so.
    Done(TaskReport),
}

/// Where a staged task is.
enum Phase {
    /// At a route worker: take a buffer (and fill it, for a WRITE).
    In,
    /// At the peer link, with the buffer as its local side.
    Link,
    /// At a route worker again (READ): the buffer to the device.
    Out,
}

pub(crate) struct TcpStage {
    device: u32,
    phase: Phase,
    buffer: Option<Pooled>,
    /// The task's spans with their local side in the buffer.
    spans: Vec<Span>,
    /// What the link reported (READ: applied after the device copy).
    link_report: Option<TaskReport>,
}

impl TcpStage {
    pub fn new(device: u32) -> Self {
        TcpStage { device, phase: Phase::In, buffer: None, spans: Vec::new(), link_report: None }
    }

    /// The worker's part: phase `In` (take a buffer, and for a WRITE copy
    /// the device bytes into it, at most `limit`) or `Out` (READ: copy the
    /// bytes the link landed to the device); `None` in phase `Link`, which
    /// is the link's.
    pub fn copy_locally(
        &mut self,
        pool: &Arc<StagingPool>,
        buffer_len: u64,
        op: Op,
        spans: &[Span],
        limit: u64,
    ) -> Option<(u64, Option<TaskEnd>)> {
        Some(match self.phase {
            Phase::In => {
                let buf = match pool.take(self.device, buffer_len) {
                    Ok(b) => b,
                    Err(_) => return Some((0, Some(TaskEnd::Failed { effect_unknown: false }))),
                };
                self.spans = host_spans(spans, buf.addr());
                self.buffer = Some(buf);
                match op {
                    Op::Read => (spans.iter().map(|s| s.len).sum(), None),
                    Op::Write => {
                        let copies = pairs(spans, &self.spans, limit, |dev, host| (host, dev));
                        let (done, err) = crate::cuda::copy_on_stream(self.device, &copies);
                        (done, err.map(|_| TaskEnd::Failed { effect_unknown: false }))
                    }
                }
            }
            Phase::Out => {
                let landed = self.link_report.map_or(0, |r| r.done);
                let copies = pairs(spans, &self.spans, landed.min(limit), |dev, host| (dev, host));
                let (done, err) = crate::cuda::copy_on_stream(self.device, &copies);
                (done, err.map(|_| TaskEnd::Failed { effect_unknown: true }))
            }
            Phase::Link => return None,
        })
    }

    /// Where the task goes after a phase ended with `report`.
    pub fn next(&mut self, op: Op, report: TaskReport) -> Next {
        match (&self.phase, op) {
            // After the worker's phase `In`: the task goes on to the link...
            (Phase::In, _) if report.end == TaskEnd::Complete && report.done == report.planned => {
                self.phase = Phase::Link;
                Next::Link
            }
            // ...or ends (for a WRITE nothing was sent).
            (Phase::In, _) => {
                self.buffer = None;
                let end = match report.end {
                    TaskEnd::Complete => TaskEnd::Short,
                    e => e,
                };
                Next::Done(TaskReport { planned: report.planned, done: 0, end })
            }
            // After the link: READ goes on to phase `Out`; a WRITE ends with
            // the link's report, its buffer back in the pool.
            (Phase::Link, Op::Read) => {
                self.link_report = Some(report);
                self.phase = Phase::Out;
                Next::Worker
            }
            (Phase::Link, Op::Write) => {
                self.buffer = None;
                Next::Done(report)
            }
            // After phase `Out`: the task's report (the link's, unless the
            // device copy failed).
            (Phase::Out, _) => {
                self.buffer = None;
                let link = self.link_report.take().unwrap_or(report);
                Next::Done(match report.end {
                    TaskEnd::Complete => link,
                    failed => TaskReport { planned: link.planned, done: report.done.min(link.done), end: failed },
                })
            }
        }
    }

    /// The spans the link moves (the task's, with their local side in the
    /// buffer), while the task is the link's.
    pub fn link_spans(&self) -> Option<&[Span]> {
        matches!(self.phase, Phase::Link).then_some(&self.spans[..])
    }
}

/// Device/host address pairs of the first `limit` bytes of `dev` (the
/// task's spans) and `host` (the same spans in the buffer), as
/// (destination, source, bytes) by `order(device, host)`.
fn pairs(dev: &[Span], host: &[Span], limit: u64, order: impl Fn(u64, u64) -> (u64, u64)) -> Vec<(u64, u64, u64)> {
    super::within(dev, limit)
        .zip(host)
        .map(|((d, n), h)| {
            let (dst, src) = order(d.local, h.local);
            (dst, src, n)
        })
        .collect()
}

/// The target's staging of a peer's WRITE or READ that names its device
/// memory (tcp): a buffer of the pool the request's device ranges go
/// through; a READ's device bytes are copied into it before the reply is
/// sent, a WRITE's are copied out of it once the payload is in
/// ([`Landing::copy`](crate::transport::proto::server::Landing::copy),
/// which the server's driver runs for the machine's `Event::Stage`).
pub(crate) struct ServerStage {
    device: u32,
    buffer: Pooled,
    /// (device address, buffer address, bytes).
    copies: Vec<(u64, u64, u64)>,
    write: bool,
}

impl crate::transport::proto::server::Landing for ServerStage {
    fn copy(&mut self) -> Result<(), crate::cuda::CudaError> {
        // (device, buffer, bytes): a WRITE's (destination, source, bytes),
        // and reversed for a READ.
        let reads: Vec<(u64, u64, u64)>;
        let copies = match self.write {
            true => &self.copies,
            false => {
                reads = self.copies.iter().map(|&(dev, buf, n)| (buf, dev, n)).collect();
                &reads
            }
        };
        crate::cuda::copy_on_stream(self.device, copies).1.map_or(Ok(()), Err)
    }
}

impl ServerStage {
    /// Points a request's device ranges (`ranges`: iovec index, device
    /// address, bytes, device; the first one's device for all) into one
    /// buffer of `pool` of at least `min_len` bytes: what the target's
    /// driver copies through (`Landing::copy`). `None`: no device range.
    pub(crate) fn stage(
        pool: &Arc<StagingPool>,
        write: bool,
        iovs: &mut [libc::iovec],
        ranges: &[(usize, u64, u64, u32)],
        min_len: u64,
    ) -> Result<Option<Box<dyn crate::transport::proto::server::Landing>>, StagingError> {
        let Some(&(_, _, _, device)) = ranges.first() else { return Ok(None) };
        let total: u64 = ranges.iter().map(|r| r.2).sum();
        let buffer = pool.take(device, total.max(min_len))?;
        let mut stage = ServerStage { device, buffer, copies: Vec::with_capacity(ranges.len()), write };
        let base = stage.buffer.addr();
        let mut at = 0u64;
        for &(i, dev, n, _) in ranges {
            iovs[i] = crate::transport::sock::iov(base + at, n);
            stage.copies.push((dev, base + at, n));
            at += n;
        }
        Ok(Some(Box::new(stage)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(local: u64, remote: u64, len: u64) -> Span {
        Span { local, remote, remote_reg: 1, len }
    }

    #[test]
    fn chunks_cover_the_spans_in_order_and_respect_the_limit() {
        let spans = [span(1000, 5000, 10), span(2000, 9000, 7)];
        let c = chunks(&spans, u64::MAX, 4);
        let sizes: Vec<u64> = c.iter().map(Chunk::bytes).collect();
        assert_eq!(sizes, vec![4, 4, 4, 4, 1]);
        // The third chunk straddles the two spans.
        assert_eq!(c[2].pieces.len(), 2);
        assert_eq!((c[2].pieces[0].local, c[2].pieces[0].len), (1008, 2));
        assert_eq!((c[2].pieces[1].local, c[2].pieces[1].remote, c[2].pieces[1].len), (2000, 9000, 2));
        let host = host_spans(&c[2].pieces, 100);
        assert_eq!((host[0].local, host[1].local, host[1].remote), (100, 102, 9000));
        assert_eq!(c[2].device_copies(Op::Write, 100), vec![(100, 1008, 2), (102, 2000, 2)]);
        assert_eq!(c[2].device_copies(Op::Read, 100), vec![(1008, 100, 2), (2000, 102, 2)]);
        let limited = chunks(&spans, 9, 4);
        assert_eq!(limited.iter().map(Chunk::bytes).sum::<u64>(), 9);
        assert!(chunks(&spans, 0, 4).is_empty());
    }
}
