//! `TransferEngine`: the one public entry of the core.
//!
//! It owns the configuration, charges, registry, admission queue, routes,
//! the optional progress worker and close/drain. It is `Send + Sync` and
//! cheap to clone; many threads may call it at once. No lock is held across
//! a copy, and no lock is held while an owner-release callback runs.

mod transfer;

pub use transfer::{ReleaseRefused, Transfer};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::admission::AdmissionQueue;
use crate::batch::lifecycle::TransferLifecycle;
use crate::batch::plan;
use crate::batch::{ExecutionPhase, TransferSpec, TransferStatus};
use crate::charge::{Charge, Counter, Counters, Stats};
use crate::config::EngineConfig;
use crate::error::{Error, Resource};
use crate::memory::{HostMemory, MemoryRange};
use crate::registry::{RegistrationId, Registry};
use crate::transport::local::LocalRoute;
use transfer::{Cell, Owners, RouteTask, TransferShared};

/// An execution waiting (partly or wholly) for admission.
pub(crate) struct QueuedExec {
    transfer: Arc<TransferShared>,
    seq: u64,
    _queued: Charge,
}

pub(crate) struct AdmissionState {
    queue: AdmissionQueue<QueuedExec, Instant>,
    /// Entries removed under the lock, dropped after it is released (the
    /// last reference to a transfer may be among them).
    graveyard: Vec<QueuedExec>,
    shutdown: bool,
}

impl AdmissionState {
    fn remove_execution(&mut self, transfer: &Arc<TransferShared>, seq: u64) {
        let grave = &mut self.graveyard;
        self.queue.remove_where(|q| q.seq == seq && Arc::ptr_eq(&q.transfer, transfer), |q| grave.push(q));
    }
}

pub(crate) struct EngineInner {
    config: EngineConfig,
    counters: Arc<Counters>,
    registry: Registry,
    admission: Mutex<AdmissionState>,
    progress_cv: Condvar,
    drain_lock: Mutex<()>,
    drain_cv: Condvar,
    route: LocalRoute<RouteTask>,
    active: Mutex<HashMap<u64, Weak<TransferShared>>>,
    closed: AtomicBool,
    close_finished: AtomicBool,
    next_transfer: AtomicU64,
    progress_thread: Mutex<Option<JoinHandle<()>>>,
}

impl EngineInner {
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn remember_active(&self, t: &Arc<TransferShared>) {
        self.active.lock().insert(t.id, Arc::downgrade(t));
    }

    fn forget_active(&self, id: u64) {
        self.active.lock().remove(&id);
    }

    fn notify_drain(&self) {
        let _g = self.drain_lock.lock();
        self.drain_cv.notify_all();
    }

    /// Expires queued work past its deadline, then admits tasks in intent
    /// order while the budgets allow. Called with the admission lock held.
    fn admit_pass(self: &Arc<Self>, a: &mut AdmissionState) {
        let AdmissionState { queue, graveyard, .. } = a;
        if queue.has_deadlines() {
            let now = Instant::now();
            let mut expired = Vec::new();
            queue.take_expired(now, |q| expired.push(q));
            for q in expired {
                let after = {
                    let mut cell = q.transfer.cell.lock();
                    let retired = cell.life.active_mut(q.seq).is_some_and(|m| m.expire());
                    retired.then(|| cell.on_retired())
                };
                if let Some(after) = after {
                    after.complete(self, &q.transfer);
                }
                graveyard.push(q);
            }
        }
        let max_tasks = self.config.max_tasks_in_flight;
        let max_bytes = self.config.max_bytes_in_flight;
        while let Some(class) = queue.next_class() {
            let Some(head) = queue.front(class) else { break };
            let transfer = head.transfer.clone();
            let seq = head.seq;
            let mut cell = transfer.cell.lock();
            let next = cell.life.active_mut(seq).and_then(|m| m.peek_next());
            let Some(task) = next else {
                drop(cell);
                graveyard.extend(queue.pop_front(class));
                continue;
            };
            let bytes = transfer.plan.program.tasks[task as usize].bytes;
            let tasks_now = self.counters.get(Counter::TasksInFlight);
            let bytes_now = self.counters.get(Counter::BytesInFlight);
            if tasks_now >= max_tasks || bytes_now + bytes > max_bytes {
                break; // strict order: nothing overtakes the head
            }
            let m = cell.life.active_mut(seq).expect("checked above");
            m.admit_next();
            let all_started = m.admissions_closed();
            drop(cell);
            let in_flight = Charge::try_new(
                &self.counters,
                [(Counter::BytesInFlight, bytes, None), (Counter::TasksInFlight, 1, None)],
            )
            .ok();
            queue.note_served(class);
            if all_started {
                graveyard.extend(queue.pop_front(class));
            }
            self.route.submit(RouteTask { engine: self.clone(), transfer, seq, task, in_flight });
        }
    }

    /// One bounded progress step for a caller that polls.
    fn progress_step(self: &Arc<Self>) {
        let grave = {
            let mut a = self.admission.lock();
            if a.queue.is_empty() {
                return;
            }
            self.admit_pass(&mut a);
            std::mem::take(&mut a.graveyard)
        };
        drop(grave);
    }

    fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = crate::time::deadline_after(timeout);
        let mut g = self.drain_lock.lock();
        while self.counters.get(Counter::Executions) > 0 {
            if self.drain_cv.wait_until(&mut g, deadline).timed_out() {
                return self.counters.get(Counter::Executions) == 0;
            }
        }
        true
    }

    fn close(self: &Arc<Self>, timeout: Duration) -> CloseReport {
        self.closed.store(true, Ordering::Release);
        // Queued work never starts: cancel it (proven not started).
        let (afters, grave) = {
            let mut a = self.admission.lock();
            let mut entries = Vec::new();
            a.queue.drain_all(|q| entries.push(q));
            let mut afters = Vec::new();
            for q in &entries {
                let mut cell = q.transfer.cell.lock();
                if let Some(m) = cell.life.active_mut(q.seq) {
                    if m.cancel() {
                        afters.push((cell.on_retired(), q.transfer.clone()));
                    }
                }
            }
            a.shutdown = true;
            self.progress_cv.notify_all();
            (afters, entries)
        };
        drop(grave);
        for (after, t) in afters {
            after.complete(self, &t);
        }
        let drained = self.wait_idle(timeout);
        let unquiesced = self.unquiesced();
        if let Some(t) = self.progress_thread.lock().take() {
            let _ = t.join();
        }
        if drained {
            self.route.shutdown();
        }
        self.registry.deregister_all(&self.counters);
        self.close_finished.store(true, Ordering::Release);
        CloseReport { drained, unquiesced }
    }

    fn unquiesced(&self) -> Vec<UnquiescedExecution> {
        let live: Vec<Arc<TransferShared>> = self.active.lock().values().filter_map(Weak::upgrade).collect();
        live.iter()
            .filter_map(|t| {
                let cell = t.cell.lock();
                match (&cell.life, cell.life.status()) {
                    (TransferLifecycle::Posted(m), TransferStatus::InProgress { phase, .. }) => {
                        Some(UnquiescedExecution {
                            transfer: t.id,
                            execution: m.seq(),
                            phase,
                            tasks_outstanding: m.admitted(),
                        })
                    }
                    _ => None,
                }
            })
            .collect()
    }
}

fn progress_worker(engine: Arc<EngineInner>) {
    let interval = engine.config.progress_interval();
    let mut a = engine.admission.lock();
    loop {
        if a.shutdown {
            return;
        }
        engine.admit_pass(&mut a);
        let grave = std::mem::take(&mut a.graveyard);
        if !grave.is_empty() {
            parking_lot::MutexGuard::unlocked(&mut a, || drop(grave));
            continue;
        }
        if a.queue.is_empty() {
            // Idle means idle: sleep until a post queues something.
            engine.progress_cv.wait(&mut a);
        } else {
            let mut until = Instant::now() + interval;
            if let Some(d) = a.queue.earliest_deadline() {
                until = until.min(d);
            }
            engine.progress_cv.wait_until(&mut a, until);
        }
    }
}

/// An execution that `close` could not retire. Its owners, charges and
/// memory are kept, not freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnquiescedExecution {
    /// Transfer id.
    pub transfer: u64,
    /// Execution sequence number.
    pub execution: u64,
    /// Where it stood.
    pub phase: ExecutionPhase,
    /// Tasks it had started.
    pub tasks_outstanding: u32,
}

/// What `close` achieved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloseReport {
    /// Every admitted execution retired within the bound.
    pub drained: bool,
    /// Executions still not retired; their owners are retained.
    pub unquiesced: Vec<UnquiescedExecution>,
}

struct EngineHandle {
    inner: Arc<EngineInner>,
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        if !self.inner.is_closed() {
            let _ = self.inner.close(self.inner.config.close_drain_timeout());
        }
    }
}

/// The transfer engine. Clones share one engine; the engine closes when the
/// last clone is dropped (or on [`TransferEngine::close`]).
#[derive(Clone)]
pub struct TransferEngine {
    handle: Arc<EngineHandle>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine").field("stats", &self.stats()).finish()
    }
}

impl TransferEngine {
    /// Starts an engine (its route workers and, if configured, the
    /// progress worker).
    pub fn new(config: EngineConfig) -> Result<Self, Error> {
        config.validate()?;
        let route =
            LocalRoute::start(config.local_route_workers, config.spin()).map_err(|e| Error::System(e.to_string()))?;
        let inner = Arc::new(EngineInner {
            admission: Mutex::new(AdmissionState {
                queue: AdmissionQueue::new(config.admission_queue_len as usize, config.anti_starvation_after),
                graveyard: Vec::new(),
                shutdown: false,
            }),
            counters: Arc::new(Counters::default()),
            registry: Registry::default(),
            progress_cv: Condvar::new(),
            drain_lock: Mutex::new(()),
            drain_cv: Condvar::new(),
            route,
            active: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            close_finished: AtomicBool::new(false),
            next_transfer: AtomicU64::new(1),
            progress_thread: Mutex::new(None),
            config,
        });
        if inner.config.progress_worker {
            let e = inner.clone();
            let t = std::thread::Builder::new()
                .name("orbite-progress".into())
                .spawn(move || progress_worker(e))
                .map_err(|e| Error::System(e.to_string()))?;
            *inner.progress_thread.lock() = Some(t);
        }
        Ok(TransferEngine { handle: Arc::new(EngineHandle { inner }) })
    }

    /// Starts an engine from a JSON configuration (unknown fields rejected).
    pub fn from_json(json: &str) -> Result<Self, Error> {
        Self::new(EngineConfig::from_json(json)?)
    }

    fn inner(&self) -> &Arc<EngineInner> {
        &self.handle.inner
    }

    /// The configuration in force.
    pub fn config(&self) -> &EngineConfig {
        &self.inner().config
    }

    /// Allocates page-aligned, zeroed host memory charged to this engine.
    pub fn allocate_host_memory(&self, len: usize) -> Result<HostMemory, Error> {
        let inner = self.inner();
        if inner.is_closed() {
            return Err(Error::Closed);
        }
        HostMemory::allocate(&inner.counters, len, inner.config.max_host_memory_bytes)
    }

    /// Registers ranges, all or none. Each range becomes its own
    /// registration, even if it duplicates or overlaps another.
    pub fn register_memory_ranges(&self, ranges: Vec<MemoryRange>) -> Result<Vec<RegistrationId>, Error> {
        let inner = self.inner();
        if inner.is_closed() {
            return Err(Error::Closed);
        }
        inner.registry.register(ranges, &inner.counters, &inner.config)
    }

    /// Deregisters: fences new prepares and posts at once; the owner and
    /// its charges stay until the last prepared transfer or execution
    /// naming it retires and is released.
    pub fn deregister(&self, id: RegistrationId) -> Result<(), Error> {
        let inner = self.inner();
        Ok(inner.registry.deregister(id, &inner.counters)?)
    }

    /// Validates and prepares a transfer (no I/O). It retains every
    /// registration it names.
    pub fn prepare(&self, spec: &TransferSpec<'_>) -> Result<Transfer, Error> {
        let inner = self.inner();
        if inner.is_closed() {
            return Err(Error::Closed);
        }
        let charge = Charge::limited(
            &inner.counters,
            Counter::PreparedTransfers,
            1,
            Resource::PreparedTransfers,
            inner.config.max_prepared_transfers,
        )?;
        let (plan, loans) = {
            let table = inner.registry.lock();
            plan::build(spec, &table, &inner.config)?
        };
        if plan.program.tasks.len() > u32::MAX as usize {
            return Err(Error::ResourceExhausted {
                resource: Resource::DescriptorsPerTransfer,
                limit: u32::MAX as u64,
                requested: plan.program.tasks.len() as u64,
            });
        }
        let shared = Arc::new(TransferShared {
            id: inner.next_transfer.fetch_add(1, Ordering::Relaxed),
            plan,
            cell: Mutex::new(Cell {
                life: TransferLifecycle::NotPosted,
                exec_charge: None,
                owners: Some(Owners { loans, _charge: charge }),
                orphaned: false,
            }),
            retired: Condvar::new(),
            retirements: AtomicU64::new(0),
        });
        Ok(Transfer { shared, engine: inner.clone() })
    }

    /// Current charges.
    pub fn stats(&self) -> Stats {
        let inner = self.inner();
        let mut s = inner.counters.snapshot();
        if inner.close_finished.load(Ordering::Acquire) {
            s.unquiesced_owners = s.executions;
        }
        s
    }

    /// Cumulative time route workers spent moving bytes (excludes queueing,
    /// admission and completion): what the copies themselves cost.
    pub fn route_busy(&self) -> Duration {
        self.inner().route.busy()
    }

    /// Blocks until no execution is active, or `timeout` passes.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        self.inner().wait_idle(timeout)
    }

    /// Closes with the configured drain bound (`close_drain_timeout_ms`).
    pub fn close(&self) -> CloseReport {
        self.close_with_timeout(self.config().close_drain_timeout())
    }

    /// Fences everything (no new registration, prepare or post), cancels
    /// queued work, waits up to `timeout` for running work to drain, then
    /// stops the workers. Work that did not drain is reported as
    /// unquiesced and its owners are kept, never freed.
    pub fn close_with_timeout(&self, timeout: Duration) -> CloseReport {
        self.inner().close(timeout)
    }

    /// Test-only fault hooks of the local route.
    #[cfg(feature = "fault-injection")]
    pub fn fault_hooks(&self) -> crate::transport::fault::FaultHooks<'_> {
        crate::transport::fault::FaultHooks { ctl: self.inner().route.shared().as_ref() }
    }
}
