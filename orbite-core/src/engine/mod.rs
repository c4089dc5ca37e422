//! `TransferEngine`: the one public entry of the core.
//!
//! It owns the configuration, charges, registry, admission queue, routes,
//! the optional progress worker and close/drain. It is `Send + Sync` and
//! cheap to clone; many threads may call it at once. No lock is held across
//! a copy, and no lock is held while an owner-release callback runs.

mod metrics;
mod notify;
mod peer;
mod peers;
pub(crate) mod plan;
mod serve;
mod spec;
mod transfer;

pub use metrics::{MetricFamily, MetricsSource};
pub use notify::Notification;
pub use spec::{Target, TransferSpec};
pub use transfer::{ReleaseRefused, Transfer};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::admission::AdmissionQueue;
use crate::batch::lifecycle::TransferLifecycle;
use crate::batch::{ExecutionPhase, TransferStatus};
use crate::charge::{Charge, Counter, Counters, Stats};
use crate::config::EngineConfig;
use crate::error::{Error, PeerError};
use crate::memory::{HostMemory, MemoryRange};
use crate::registry::Registry;
use crate::segment::{ExportedRegistration, SegmentDescriptor};
use crate::transport::hooks::Hooks;
use crate::transport::local::LocalRoute;
use crate::transport::proto::client::PeerJob;
use crate::transport::reactor::Reactor;
use crate::transport::routes::Reach;
use crate::transport::server::Server;
use crate::types::{RegistrationId, Resource};
use crate::wire::RemoteStatus;
use transfer::Peer;
use transfer::{Cell, Owners, PlanTarget, RouteTask, TransferShared};

/// An execution waiting (partly or wholly) for admission.
pub(crate) struct QueuedExec {
    transfer: Arc<TransferShared>,
    seq: u64,
    _queued: Charge,
}

/// Admission: the queue of executions, the events of task ends, and the
/// progress worker.
pub(crate) struct Admission {
    pub state: Mutex<AdmissionState>,
    /// Task ends that gave back budget while work was queued: bumped
    /// without the admission lock (see `task_freed`).
    pub freed: AtomicU64,
    /// The progress worker sleeps here, not on the admission lock, so that
    /// it can be woken without taking that lock.
    pub worker_wake: (Mutex<bool>, Condvar),
    pub worker: Mutex<Option<JoinHandle<()>>>,
}

/// The initiator side of peers: the segments this engine opened.
#[derive(Default)]
pub(crate) struct Peers {
    /// The latest opened peer per endpoint (the current epoch there).
    pub latest: Mutex<HashMap<String, Weak<Peer>>>,
    pub all: Mutex<Vec<Weak<Peer>>>,
    /// Borrow ids (mixed with the epoch).
    pub next_borrow: AtomicU64,
    /// The threads driving every link's connections (started with the
    /// first opened peer).
    pub initiators: Mutex<Option<Arc<crate::transport::link::Initiators<RouteTask>>>>,
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

/// Where an admitted task runs.
enum Where {
    /// Its peer's link (frames to the peer's server).
    PeerLink,
    /// The posting thread (a lone small task).
    Inline,
    /// The local route workers.
    Workers,
}

/// The engine, by what each part owns.
pub(crate) struct EngineInner {
    /// Its limits and settings.
    config: EngineConfig,
    /// Every budget's charge.
    counters: Arc<Counters>,
    /// This engine's registrations.
    registry: Registry,
    /// Admission: the queue, its events and the progress worker.
    admission: Admission,
    /// Where tasks run, and what they stage through.
    routes: Routes,
    /// The live transfers, and the engine's close.
    life: Lifecycle,
    /// This engine's identity for this run.
    epoch: u64,
    boot_id: [u8; 16],
    /// The target side: the listener, its server and its watchers.
    listener: serve::Listener,
    /// The initiator side: the peers this engine opened.
    peers: Peers,
    /// Received notifications and the same-host inbox.
    notifications: notify::Notifications,
    /// The event loop of the server, the initiators and liveness, started
    /// with the first of them.
    reactor: Mutex<Option<Arc<Reactor>>>,
    /// What the data path counts for `/metrics`.
    metrics: metrics::Metrics,
    /// The metadata store (`metadata`) and the name published there.
    discovery: crate::discovery::Link,
    /// The `/metrics` endpoint (`metrics_listen`), until close.
    metrics_server: Mutex<Option<metrics::MetricsServer>>,
    /// What layers above the engine add to `/metrics` (weakly).
    metrics_sources: Mutex<Vec<Weak<dyn metrics::MetricsSource>>>,
}

/// Where an engine's tasks run: its route workers, the buffers device and
/// direct-file tasks stage through, and the test hooks.
struct Routes {
    workers: LocalRoute<RouteTask>,
    /// Page-locked buffers of staged tcp tasks (feature `cuda`).
    staging_pool: Arc<crate::transport::routes::staging::StagingPool>,
    /// Aligned buffers for unaligned spans of `O_DIRECT` files, charged
    /// as staging within `max_staging_bytes`.
    bounce_pool: Arc<crate::file::BouncePool>,
    /// Test hooks (feature `fault-injection`); none in a shipped build.
    hooks: Option<Arc<dyn Hooks<RouteTask>>>,
    /// The RDMA NICs this engine uses (`rdma_devices`), or why none.
    rails: Arc<crate::verbs::rails::Rails>,
}

/// An engine's transfers and its close: the live transfers (weakly), the
/// close flags, and what a draining close waits on.
#[derive(Default)]
struct Lifecycle {
    active: Mutex<HashMap<u64, Weak<TransferShared>>>,
    next_transfer: AtomicU64,
    closed: AtomicBool,
    close_finished: AtomicBool,
    drain_lock: Mutex<()>,
    drain_cv: Condvar,
}

/// A lease on a peer's imported segment: transfers target it with
/// [`crate::Target::Peer`]. Prepared transfers keep it alive.
#[derive(Clone)]
pub struct RemoteSegment {
    pub(crate) peer: Arc<Peer>,
}

impl std::fmt::Debug for RemoteSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSegment").field("endpoint", &self.peer.endpoint).field("epoch", &self.peer.epoch).finish()
    }
}

impl RemoteSegment {
    /// The peer's endpoint.
    pub fn endpoint(&self) -> &str {
        &self.peer.endpoint
    }
    /// The peer's epoch.
    pub fn epoch(&self) -> u64 {
        self.peer.epoch
    }
    /// The descriptor the peer described itself with when it was opened
    /// (its registrations then; [`Self::registrations`] has the current
    /// view).
    pub fn descriptor(&self) -> &SegmentDescriptor {
        &self.peer.link.descriptor
    }

    /// The peer's registrations as this engine currently knows them, and
    /// the peer's registry version that view reflects.
    pub fn registrations(&self) -> (Vec<ExportedRegistration>, u64) {
        let v = self.peer.view();
        (v.registrations().values().cloned().collect(), v.version)
    }
    /// Why the peer is lost, if it is.
    pub fn lost(&self) -> Option<String> {
        self.peer.link.lost()
    }

    /// Whether new work may start: `Err` if the peer is lost, the segment
    /// closed, or a newer epoch of the peer was opened.
    pub fn usable(&self) -> Result<(), PeerError> {
        self.peer.refusal().map_or(Ok(()), Err)
    }
}

/// What `slot` holds, or else what `start` makes (then kept there); the
/// slot stays locked meanwhile.
fn get_or_start<T: Clone>(slot: &Mutex<Option<T>>, start: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    let mut g = slot.lock();
    if let Some(v) = g.as_ref() {
        return Ok(v.clone());
    }
    let v = start()?;
    *g = Some(v.clone());
    Ok(v)
}

/// A random, nonzero 64-bit epoch.
fn new_epoch() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish() | 1
}

impl EngineInner {
    /// The frame limits of this engine's peer protocol.
    pub(crate) fn frame_limits(&self) -> crate::wire::Limits {
        crate::wire::Limits { max_body: self.config.max_frame_body as u32, max_data: self.config.task_bytes as u32 }
    }

    fn is_closed(&self) -> bool {
        self.life.closed.load(Ordering::Acquire)
    }

    /// Refuses with [`Error::Closed`] once the engine is closed.
    fn check_open(&self) -> Result<(), Error> {
        if self.is_closed() { Err(Error::Closed) } else { Ok(()) }
    }

    /// Tells watching peers the registry changed: a server thread pushes
    /// each what changed since its view (this call only wakes it).
    fn announce_registry(&self) {
        if let Some(w) = self.listener.watchers.get() {
            w.changed();
        }
    }

    /// Expires queued work past its deadline, then admits tasks in intent
    /// order while the budgets allow. Called with the admission lock held.
    /// The task of `inline.0`, if admitted now and small enough to copy on
    /// the posting thread, is left in `inline.1` instead of going to a
    /// route.
    fn admit(
        self: &Arc<Self>,
        a: &mut AdmissionState,
        mut inline: Option<(&Arc<TransferShared>, &mut Option<RouteTask>)>,
    ) {
        self.expire_due(a);
        let AdmissionState { queue, graveyard, .. } = a;
        // Tasks admitted by this pass start after it: a task that fails at
        // once must not stop the admission of its siblings half-way through
        // the pass (what one pass admits, starts, so an outcome does not
        // depend on how fast a worker wakes).
        let mut local: Vec<RouteTask> = Vec::new();
        let mut remote: Vec<RouteTask> = Vec::new();
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
            let Some(in_flight) = self.within_budgets(bytes) else {
                break; // strict order: nothing overtakes the head
            };
            let m = cell.life.active_mut(seq).expect("checked above");
            m.admit_next();
            let all_started = m.admissions_closed();
            let started = Instant::now();
            if let Some(posted) = cell.posted_at.take() {
                self.metrics.admitted_after(started.saturating_duration_since(posted));
            }
            drop(cell);
            queue.note_served(class);
            if all_started {
                graveyard.extend(queue.pop_front(class));
            }
            let job = RouteTask {
                engine: self.clone(),
                transfer: transfer.clone(),
                seq,
                task,
                in_flight,
                started,
                stage: transfer
                    .plan
                    .program
                    .mover
                    .staging()
                    .map(|d| Box::new(crate::transport::routes::staging::TcpStage::new(d))),
            };
            match self.runs_where(&job, bytes, inline.as_ref().map(|(t, slot)| (*t, slot.is_none()))) {
                Where::PeerLink => remote.push(job),
                Where::Inline => {
                    if let Some((_, slot)) = inline.as_mut() {
                        **slot = Some(job);
                    }
                }
                Where::Workers => local.push(job),
            }
        }
        self.routes.workers.submit_all(local);
        for job in remote {
            if let PlanTarget::Peer(p) = &job.transfer.target {
                let link = p.link.clone();
                link.submit(PeerJob::Task(job));
            }
        }
    }

    /// Expires queued executions past their deadline (their transfers
    /// retire them); the queue's entries go to the graveyard.
    fn expire_due(self: &Arc<Self>, a: &mut AdmissionState) {
        let AdmissionState { queue, graveyard, .. } = a;
        if !queue.has_deadlines() {
            return;
        }
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

    /// The in-flight charge of one more task of `bytes`, if the task and
    /// byte budgets take it (`None`: the head waits).
    fn within_budgets(&self, bytes: u64) -> Option<Option<Charge>> {
        let tasks_now = self.counters.get(Counter::TasksInFlight);
        let bytes_now = self.counters.get(Counter::BytesInFlight);
        if tasks_now >= self.config.max_tasks_in_flight || bytes_now + bytes > self.config.max_bytes_in_flight {
            return None;
        }
        Some(
            Charge::try_new(&self.counters, [(Counter::BytesInFlight, bytes, None), (Counter::TasksInFlight, 1, None)])
                .ok(),
        )
    }

    /// Where an admitted task runs: on its peer's link (a two-sided route),
    /// on the posting thread (`inline`: the transfer it posts, and whether
    /// its slot is free; the inline rule), or on the local workers (the
    /// self connection and the one-sided routes: the peer spends no CPU).
    fn runs_where(&self, job: &RouteTask, bytes: u64, inline: Option<(&Arc<TransferShared>, bool)>) -> Where {
        let transfer = &job.transfer;
        let staged = job.stage.is_some();
        // A staged task is taken by a worker first (its buffer).
        if matches!(transfer.target, PlanTarget::Peer(_)) && transfer.plan.program.mover.sends_frames() && !staged {
            return Where::PeerLink;
        }
        let inline_ok = inline.is_some_and(|(t, free)| {
            free && Arc::ptr_eq(t, transfer)
                && transfer.plan.program.tasks.len() == 1
                && bytes <= self.config.inline_max_bytes
                && !transfer.plan.program.mover.waits_for_device()
                && !staged
        });
        if inline_ok { Where::Inline } else { Where::Workers }
    }

    /// One bounded progress step for a caller that polls. Nothing queued:
    /// one atomic load, no lock (a caller polling in a loop must not
    /// contend with the routes finishing tasks).
    fn progress_step(self: &Arc<Self>) {
        if self.counters.get(Counter::QueuedExecutions) == 0 {
            return;
        }
        // The guard's release runs the pass.
        drop(self.lock_admission());
    }

    /// Takes the admission lock. Releasing it runs admission passes until
    /// none was missed: a task end that gave back budget meanwhile (and
    /// could not take the lock itself) is served before the lock goes.
    fn lock_admission(self: &Arc<Self>) -> AdmissionGuard<'_> {
        AdmissionGuard { engine: self, a: Some(self.admission.state.lock()) }
    }

    /// Admission passes while holding `a`, until no task end gave back
    /// budget during the last one; returns the count that pass saw.
    fn drive(self: &Arc<Self>, a: &mut AdmissionState) -> u64 {
        loop {
            let seen = self.admission.freed.load(Ordering::SeqCst);
            self.admit(a, None);
            if self.admission.freed.load(Ordering::SeqCst) == seen {
                return seen;
            }
        }
    }

    /// A task ended and gave back its budget: work waiting for admission
    /// may start. The completion is an event (`freed`); this thread never
    /// waits for the admission lock. If the lock is free it serves the
    /// event itself (the cheapest way to keep a route busy); if not, the
    /// holder serves it before letting go (`AdmissionGuard::release`).
    fn task_freed(self: &Arc<Self>) {
        if self.counters.get(Counter::QueuedExecutions) == 0 {
            return;
        }
        self.admission.freed.fetch_add(1, Ordering::SeqCst);
        if let Some(a) = self.admission.state.try_lock() {
            drop(AdmissionGuard { engine: self, a: Some(a) });
        }
    }

    /// Wakes the progress worker (if there is one).
    fn wake_worker(&self) {
        let (flag, cv) = &self.admission.worker_wake;
        *flag.lock() = true;
        cv.notify_one();
    }

    fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = crate::time::deadline_after(timeout);
        let mut g = self.life.drain_lock.lock();
        while self.counters.get(Counter::Executions) > 0 {
            if self.life.drain_cv.wait_until(&mut g, deadline).timed_out() {
                return self.counters.get(Counter::Executions) == 0;
            }
        }
        true
    }

    fn close(self: &Arc<Self>, timeout: Duration) -> CloseReport {
        self.life.closed.store(true, Ordering::Release);
        // No one finds this engine by name any more.
        self.discovery.close();
        // Queued work never starts: cancel it (proven not started).
        let (afters, grave) = {
            let mut a = self.admission.state.lock();
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
            (afters, entries)
        };
        drop(grave);
        self.wake_worker();
        for (after, t) in afters {
            after.complete(self, &t);
        }
        let drained = self.wait_idle(timeout);
        let unquiesced = self.unquiesced();
        if let Some(server) = self.listener.server.lock().take() {
            server.shutdown();
        }
        // The metrics endpoint goes with the engine (its thread joined).
        drop(self.metrics_server.lock().take());
        if drained {
            self.close_all_peers(Duration::ZERO);
            if let Some(i) = self.peers.initiators.lock().take() {
                i.shutdown();
            }
            if let Some(r) = self.reactor.lock().take() {
                r.shutdown();
            }
        }
        self.notifications.queue.lock().clear();
        if let Some(t) = self.admission.worker.lock().take() {
            let _ = t.join();
        }
        if drained {
            self.routes.workers.shutdown();
            self.routes.staging_pool.clear();
            self.routes.bounce_pool.clear();
        }
        self.registry.deregister_all(&self.counters);
        self.life.close_finished.store(true, Ordering::Release);
        CloseReport { drained, unquiesced }
    }

    /// The engine's event loop, started on first use.
    fn reactor(&self) -> std::io::Result<Arc<Reactor>> {
        get_or_start(&self.reactor, || Reactor::start("io", self.config.spin()))
    }

    fn unquiesced(&self) -> Vec<UnquiescedExecution> {
        let live: Vec<Arc<TransferShared>> = self.life.active.lock().values().filter_map(Weak::upgrade).collect();
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
    loop {
        let (grave, sleep) = {
            let mut a = engine.admission.state.lock();
            if a.shutdown {
                return;
            }
            let seen = engine.drive(&mut a);
            // Idle means idle: with nothing queued, sleep until woken.
            let sleep = (!a.queue.is_empty()).then(|| {
                let until = Instant::now() + interval;
                a.queue.earliest_deadline().map_or(until, |d| until.min(d))
            });
            (AdmissionGuard::release(&engine, a, seen), sleep)
        };
        if !grave.is_empty() {
            drop(grave);
            continue;
        }
        let (flag, cv) = &engine.admission.worker_wake;
        let mut woken = flag.lock();
        if !*woken {
            match sleep {
                None => cv.wait(&mut woken),
                Some(until) => {
                    cv.wait_until(&mut woken, until);
                }
            }
        }
        *woken = false;
    }
}

/// The admission lock, held: dropping it runs the passes no completion may
/// miss (see `EngineInner::lock_admission`), then drops what the passes
/// retired from the queue, after the lock is released.
pub(crate) struct AdmissionGuard<'a> {
    engine: &'a Arc<EngineInner>,
    a: Option<parking_lot::MutexGuard<'a, AdmissionState>>,
}

impl AdmissionGuard<'_> {
    /// Releases `a` (after passes up to `seen`) and runs further passes
    /// while task ends that found the lock taken are unserved; returns the
    /// queue entries to drop with no lock held.
    fn release(
        engine: &Arc<EngineInner>,
        mut a: parking_lot::MutexGuard<'_, AdmissionState>,
        mut seen: u64,
    ) -> Vec<QueuedExec> {
        let mut grave = std::mem::take(&mut a.graveyard);
        drop(a);
        while engine.admission.freed.load(Ordering::SeqCst) != seen {
            // Someone else holds it: they serve it before they let go.
            let Some(mut a) = engine.admission.state.try_lock() else { break };
            seen = engine.drive(&mut a);
            grave.append(&mut a.graveyard);
        }
        grave
    }
}

impl std::ops::Deref for AdmissionGuard<'_> {
    type Target = AdmissionState;
    fn deref(&self) -> &AdmissionState {
        self.a.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for AdmissionGuard<'_> {
    fn deref_mut(&mut self) -> &mut AdmissionState {
        self.a.as_mut().expect("held until drop")
    }
}

impl Drop for AdmissionGuard<'_> {
    fn drop(&mut self) {
        let Some(mut a) = self.a.take() else { return };
        let seen = self.engine.drive(&mut a);
        drop(Self::release(self.engine, a, seen));
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

/// Range loans on registrations, held for as long as this value lives
/// (a KV session pins the ranges it hands over). Deregistering a pinned
/// registration fences it at once; its owner is released only after the
/// last pin and transfer using it are gone. Drop it with no lock held: the
/// last loan of a deregistered borrowed range runs its owner release.
pub struct RangePin {
    _loans: Vec<Arc<crate::registry::Registration>>,
    _charge: Charge,
}

impl std::fmt::Debug for RangePin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RangePin").field("ranges", &self._loans.len()).finish()
    }
}

/// Handles a binding holds on an engine, charged to `max_binding_handles`
/// and refunded when this value is dropped.
#[derive(Debug)]
pub struct BindingCharge(#[allow(dead_code)] Charge);

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

/// The route choice, with how device memory moves when the plan names some
/// (the reason a caller reads in `Transfer::route()`).
fn staging_noted(mut route: crate::RouteChoice, plan: &plan::Plan) -> crate::RouteChoice {
    if let Some(how) = plan.program.mover.device_note() {
        route.reason = format!("{}; {how}", route.reason);
    }
    route
}

impl TransferEngine {
    /// Starts an engine (its route workers and, if configured, the
    /// progress worker).
    pub fn new(config: EngineConfig) -> Result<Self, Error> {
        config.validate()?;
        let secret = match &config.auth {
            Some(a) => Some(Arc::new(crate::transport::auth::Secret::load(&a.secret_file).map_err(|e| {
                Error::Config(crate::config::ConfigError::Invalid { field: "auth.secret_file", reason: e.to_string() })
            })?)),
            None => None,
        };
        let hooks = hooks();
        let rails = Arc::new(crate::verbs::rails::Rails::open(&crate::verbs::rails::RailChoice {
            devices: config.rdma_devices.clone(),
            gid_index: config.rdma_gid_index,
            spin: config.spin(),
        }));
        let names: Vec<&str> = rails.rails().iter().map(|r| r.name.as_str()).collect();
        match (names.is_empty(), rails.why()) {
            (false, None) => log::info!(target: crate::logs::RDMA, "RDMA NICs: {}", names.join(", ")),
            (false, Some(why)) => {
                log::warn!(target: crate::logs::RDMA, "RDMA NICs: {}; not used: {why}", names.join(", "))
            }
            (true, why) => log::info!(target: crate::logs::RDMA, "no RDMA: {}", why.unwrap_or("no NIC")),
        }
        let route = LocalRoute::start(config.route_workers(), config.spin(), hooks.clone())
            .map_err(|e| Error::System(e.to_string()))?;
        let counters = Arc::new(Counters::default());
        let inner = Arc::new(EngineInner {
            admission: Admission {
                state: Mutex::new(AdmissionState {
                    queue: AdmissionQueue::new(config.admission_queue_len as usize, config.anti_starvation_after),
                    graveyard: Vec::new(),
                    shutdown: false,
                }),
                freed: AtomicU64::new(0),
                worker_wake: (Mutex::new(false), Condvar::new()),
                worker: Mutex::new(None),
            },
            routes: Routes {
                workers: route,
                staging_pool: Arc::new(crate::transport::routes::staging::StagingPool::new(
                    counters.clone(),
                    config.max_staging_bytes,
                    rails.clone(),
                )),
                bounce_pool: crate::file::BouncePool::charged(counters.clone(), config.max_staging_bytes),
                hooks,
                rails,
            },
            life: Lifecycle { next_transfer: AtomicU64::new(1), ..Lifecycle::default() },
            counters,
            registry: Registry::default(),
            epoch: new_epoch(),
            boot_id: crate::segment::local_boot_id(),
            listener: serve::Listener { secret, ..serve::Listener::default() },
            peers: Peers { next_borrow: AtomicU64::new(1), ..Peers::default() },
            notifications: notify::Notifications::default(),
            reactor: Mutex::new(None),
            metrics: metrics::Metrics::default(),
            metrics_server: Mutex::new(None),
            metrics_sources: Mutex::new(Vec::new()),
            discovery: crate::discovery::Link::default(),
            config,
        });
        if let Some(bind) = inner.config.metrics_listen.clone() {
            let server = metrics::MetricsServer::start(&bind, Arc::downgrade(&inner))
                .map_err(|e| Error::System(format!("cannot serve metrics on {bind}: {e}")))?;
            log::info!(target: crate::logs::ENGINE, "engine {:#x} serves metrics at http://{}/metrics", inner.epoch, server.addr);
            *inner.metrics_server.lock() = Some(server);
        }
        if let Some(bind) = inner.config.listen.clone() {
            let side: Weak<dyn crate::transport::proto::server::TargetSide> = Arc::downgrade(&inner) as _;
            let local = crate::transport::unix::socket_name(inner.epoch);
            let budget = inner.server_budget();
            let server = inner
                .reactor()
                .and_then(|r| {
                    Server::start(
                        &r,
                        &bind,
                        Some(&local),
                        side,
                        inner.server_limits(),
                        budget,
                        inner.listener.secret.clone(),
                    )
                })
                .map_err(|e| Error::System(format!("cannot listen on {bind}: {e}")))?;
            let bound = server.local_addr();
            if inner.listener.secret.is_none() {
                log::warn!(
                    target: crate::logs::ENGINE,
                    "engine {:#x} listens on {bound} without authentication: anyone who can reach it can read and \
                     write registered memory (set auth.secret_file)",
                    inner.epoch
                );
            }
            let _ = inner.listener.watchers.set(server.watchers());
            let _ = inner.listener.bound.set(bound);
            if let Some(name) = server.local_socket() {
                let _ = inner.listener.local_socket.set(name.to_owned());
            }
            let _ = inner.listener.endpoint.set(crate::endpoint::advertise(bound, inner.config.advertise.as_deref()));
            *inner.listener.server.lock() = Some(server);
            use crate::transport::inbox::{CAPACITY, HEADER, Inbox};
            let mem =
                HostMemory::allocate_shared(&inner.counters, HEADER + CAPACITY, u64::MAX, inner.epoch ^ 0x1_b0c5)?;
            // SAFETY: a fresh, page-aligned shared mapping of exactly this
            // length, kept alive next to the view.
            let c = &inner.config;
            let inbox = unsafe {
                Inbox::create(
                    mem.as_ptr(),
                    mem.len(),
                    inner.epoch,
                    c.max_notification_bytes,
                    c.notification_queue_bytes,
                )
            };
            let _ = inner.notifications.inbox.set((mem, inbox));
        }
        if inner.config.progress_worker {
            let e = inner.clone();
            let t = std::thread::Builder::new()
                .name("orbite-progress".into())
                .spawn(move || progress_worker(e))
                .map_err(|e| Error::System(e.to_string()))?;
            *inner.admission.worker.lock() = Some(t);
        }
        let engine = TransferEngine { handle: Arc::new(EngineHandle { inner }) };
        // Published last, once the engine serves; a failure closes it (on
        // drop) before the error is returned.
        let inner = engine.inner();
        let record = engine.endpoint().map(|endpoint| crate::discovery::Record {
            endpoint,
            epoch: inner.epoch,
            routes: crate::discovery::served_routes(!inner.routes.rails.rails().is_empty()),
        });
        let c = &inner.config;
        inner.discovery.start(
            c.metadata.as_deref(),
            c.name.as_deref(),
            record,
            Duration::from_millis(c.metadata_ttl_ms),
            Duration::from_millis(c.metadata_timeout_ms),
        )?;
        Ok(engine)
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

    /// Allocates page-aligned, zeroed host memory charged to this engine: a
    /// private mapping of its own, which from 2 MiB on starts on a
    /// huge-page boundary and is offered transparent huge pages
    /// (`MADV_HUGEPAGE`; the kernel decides), so that copies, and cma's
    /// page pinning above all, walk 2 MiB pages.
    pub fn allocate_host_memory(&self, len: usize) -> Result<HostMemory, Error> {
        let inner = self.inner();
        inner.check_open()?;
        Ok(HostMemory::allocate(&inner.counters, len, inner.config.max_host_memory_bytes)?)
    }

    /// Allocates page-aligned, zeroed memory that same-host peers can map
    /// (a memfd sealed at its size: nothing is left in any file system, and
    /// no one can shrink it under a peer's mapping). Register ranges of it
    /// like host memory; peers proven to run on this host are handed it
    /// over the local socket and copy into it one-sided over the shm route.
    pub fn allocate_shm_memory(&self, len: usize) -> Result<HostMemory, Error> {
        let inner = self.inner();
        inner.check_open()?;
        Ok(HostMemory::allocate_shared(&inner.counters, len, inner.config.max_host_memory_bytes, inner.epoch)?)
    }

    /// Allocates `len` bytes of device memory on CUDA device `device` (in
    /// its primary context), charged to `device_allocations` and
    /// `device_memory_bytes` until freed: after the last clone and the last
    /// registration of a range inside it. Register ranges of it with
    /// [`MemoryRange::cuda`]. Refused with [`Error::NotSupported`] without
    /// feature `cuda`, a driver or a device (see [`crate::cuda::availability`]).
    pub fn allocate_cuda_memory(&self, device: u32, len: usize) -> Result<crate::CudaMemory, Error> {
        let inner = self.inner();
        inner.check_open()?;
        Ok(crate::CudaMemory::allocate(&inner.counters, device, len)?)
    }

    /// Registers ranges, all or none. Each range becomes its own
    /// registration, even if it duplicates or overlaps another.
    pub fn register_memory_ranges(&self, ranges: Vec<MemoryRange>) -> Result<Vec<RegistrationId>, Error> {
        let inner = self.inner();
        inner.check_open()?;
        let ids = inner.registry.register(ranges, &inner.counters, &inner.config, &inner.routes.rails)?;
        inner.announce_registry();
        Ok(ids)
    }

    /// Deregisters: fences new prepares and posts at once; the owner and
    /// its charges stay until the last prepared transfer or execution
    /// naming it retires and is released.
    pub fn deregister(&self, id: RegistrationId) -> Result<(), Error> {
        let inner = self.inner();
        inner.registry.deregister(id, &inner.counters)?;
        // Peers watching our registrations hear of it before this returns,
        // so before any metadata the caller sends afterwards.
        inner.announce_registry();
        // Same-host borrowers copy without asking us: tell them to ask again
        // (their next post re-borrows, which a fenced range refuses).
        if let Some((_, inbox)) = inner.notifications.inbox.get() {
            inbox.announce_fence();
        }
        Ok(())
    }

    /// Pins ranges of live registrations of this engine (bounds checked,
    /// fenced registrations refused): see [`RangePin`].
    pub fn pin_ranges(&self, ranges: &[crate::Desc]) -> Result<RangePin, Error> {
        let inner = self.inner();
        inner.check_open()?;
        let loans = {
            let table = inner.registry.lock();
            ranges
                .iter()
                .enumerate()
                .map(|(index, d)| {
                    let r = table.get(d.registration)?;
                    if d.len == 0 || d.offset.checked_add(d.len).is_none_or(|end| end > r.len) {
                        return Err(crate::BatchError::InvalidDescriptor {
                            side: "pinned",
                            index,
                            reason: format!("{}+{} outside a registration of {} bytes", d.offset, d.len, r.len),
                        }
                        .into());
                    }
                    Ok(r.clone())
                })
                .collect::<Result<Vec<_>, Error>>()?
        };
        let charge = Charge::unlimited(&inner.counters, Counter::PinnedRanges, loans.len() as u64);
        Ok(RangePin { _loans: loans, _charge: charge })
    }

    /// Validates and prepares a transfer (no I/O). It retains every
    /// registration it names.
    pub fn prepare(&self, spec: &TransferSpec<'_>) -> Result<Transfer, Error> {
        let inner = self.inner();
        inner.check_open()?;
        let charge = Charge::limited(
            &inner.counters,
            Counter::PreparedTransfers,
            1,
            Resource::PreparedTransfers,
            inner.config.max_prepared_transfers,
        )?;
        let target = match spec.target {
            crate::Target::Loopback => PlanTarget::Loopback,
            crate::Target::Peer(seg) => {
                if let Some(e) = seg.peer.refusal() {
                    return Err(e.into());
                }
                // A registration the view lacks may have been made after
                // the peer was opened: ask the peer once before refusing.
                let unknown = {
                    let v = seg.peer.view();
                    spec.remote.iter().any(|d| v.get(d.registration.to_raw()).is_none())
                };
                if unknown || seg.peer.view_is_behind() {
                    let _ = inner.refresh(&seg.peer);
                }
                // Shared allocations the peer added are mapped here, on the
                // caller's thread.
                seg.peer.map_pending();
                PlanTarget::Peer(seg.peer.clone())
            }
            crate::Target::File(entry) => {
                if entry.is_closed() {
                    return Err(crate::file::FileError::Closed.into());
                }
                if spec.notification.is_some() {
                    return Err(crate::file::FileError::Unsupported("a notification to a local file").into());
                }
                if spec.op == crate::Op::Write && entry.mode() == crate::file::FileMode::ReadOnly {
                    return Err(crate::file::FileError::ModeMismatch("writing").into());
                }
                PlanTarget::File(entry.clone())
            }
        };
        let view = match &target {
            PlanTarget::Peer(p) => Some(p.view()),
            PlanTarget::Loopback | PlanTarget::File(_) => None,
        };
        let (plan, loans, way, route) = {
            let reach = match (&target, &view) {
                (PlanTarget::Peer(p), Some(v)) => Reach::Peer(p.reach(v)),
                (PlanTarget::File(f), _) => Reach::File((f, &inner.routes.bounce_pool)),
                _ => Reach::Loopback,
            };
            let policy = spec.options.route.unwrap_or(inner.config.route);
            let (way, route, mover) = crate::transport::routes::choose(policy, &reach, spec.remote)?;
            let table = inner.registry.lock();
            let pool = &inner.routes.staging_pool;
            let (plan, loans) = plan::build(spec, &reach, way, mover, &table, &inner.config, pool)?;
            let route = staging_noted(route, &plan);
            (plan, loans, way, route)
        };
        let mut remote_ids: Vec<(u64, u64)> = match &view {
            Some(v) => spec
                .remote
                .iter()
                .filter_map(|d| v.get(d.registration.to_raw()).map(|r| (r.id.to_raw(), r.len)))
                .collect(),
            None => Vec::new(),
        };
        drop(view);
        remote_ids.sort_unstable();
        remote_ids.dedup();
        if plan.program.tasks.len() > u32::MAX as usize {
            return Err(Error::ResourceExhausted {
                resource: Resource::DescriptorsPerTransfer,
                limit: u32::MAX as u64,
                requested: plan.program.tasks.len() as u64,
            });
        }
        let shared = Arc::new(TransferShared {
            id: inner.life.next_transfer.fetch_add(1, Ordering::Relaxed),
            plan,
            target,
            way,
            route,
            remote_ids,
            cell: Mutex::new(Cell {
                life: TransferLifecycle::NotPosted,
                exec_charge: None,
                owners: Some(Owners { loans, remote_loan: None, _charge: charge }),
                orphaned: false,
                posted_at: None,
            }),
            retired: Condvar::new(),
            retirements: AtomicU64::new(0),
        });
        let transfer = Transfer { shared, engine: inner.clone() };
        // One-sided routes borrow the peer's ranges now (bounded control
        // work), so that a post does not wait for the peer.
        transfer.borrow_remote()?;
        Ok(transfer)
    }

    /// Current charges.
    pub fn stats(&self) -> Stats {
        let inner = self.inner();
        let mut s = inner.counters.snapshot();
        if inner.life.close_finished.load(Ordering::Acquire) {
            s.unquiesced_owners = s.executions;
        }
        s
    }

    /// Cumulative time route workers spent moving bytes (excludes queueing,
    /// admission and completion): what the copies themselves cost.
    pub fn route_busy(&self) -> Duration {
        self.inner().routes.workers.busy()
    }

    /// Route tasks the callers' own threads copied while they posted,
    /// polled or waited (`Transfer::post`, `check`, `wait`), cumulative.
    pub fn route_helped(&self) -> u64 {
        self.inner().routes.workers.helped()
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

    /// Where this engine serves its metrics (`metrics_listen`), if it does:
    /// `http://ADDRESS/metrics`.
    pub fn metrics_address(&self) -> Option<std::net::SocketAddr> {
        self.inner().metrics_server.lock().as_ref().map(|m| m.addr)
    }

    /// Adds what `source` exports to this engine's `/metrics`, read at
    /// each scrape for as long as the source lives (held weakly).
    pub fn add_metrics(&self, source: Weak<dyn MetricsSource>) {
        let mut s = self.inner().metrics_sources.lock();
        s.retain(|w| w.strong_count() > 0);
        s.push(source);
    }

    /// The endpoint peers connect to (the advertised one), if the engine
    /// listens.
    pub fn endpoint(&self) -> Option<String> {
        self.inner().listener.endpoint.get().map(|a| a.endpoint.clone())
    }

    /// The advertised endpoint and how it was found, if the engine listens.
    pub fn advertised(&self) -> Option<&crate::endpoint::Advertised> {
        self.inner().listener.endpoint.get()
    }

    /// The address the listener is bound to, if the engine listens.
    pub fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        self.inner().listener.bound.get().copied()
    }

    /// This engine's epoch: its identity for this run. A restarted engine
    /// has a new one.
    pub fn source_epoch(&self) -> u64 {
        self.inner().epoch
    }

    /// What this engine exposes to peers (endpoint, epoch and every
    /// registration a peer may read or write). `to_bytes` gives the
    /// bounded, versioned form to exchange out of band; it carries no
    /// RDMA key (an authenticated peer's Describe gets those).
    pub fn segment_descriptor(&self) -> SegmentDescriptor {
        self.inner().segment_descriptor().without_keys()
    }

    /// Connects to a peer and imports its segment. The peer's own Describe
    /// answer is authoritative: if `expected_epoch` is given and differs,
    /// this fails with `PeerError::EpochMismatch`.
    pub fn open_segment(
        &self,
        endpoint: &str,
        expected_epoch: Option<u64>,
        timeout: Duration,
    ) -> Result<RemoteSegment, Error> {
        self.inner().open_segment(endpoint, expected_epoch, timeout)
    }

    /// Opens the peer published under `name` in the metadata store
    /// (config `metadata`): resolves its endpoint and epoch there (bounded
    /// by `metadata_timeout_ms`), then opens it as [`Self::open_segment`]
    /// does, expecting that epoch. A peer that restarted is published
    /// with its new epoch, so opening by name again reaches the new run
    /// (and fences segments of the old one).
    pub fn open_segment_by_name(&self, name: &str, timeout: Duration) -> Result<RemoteSegment, Error> {
        let inner = self.inner();
        inner.check_open()?;
        let record = inner.discovery.resolve(name)?;
        inner.open_segment(&record.endpoint, Some(record.epoch), timeout)
    }

    /// What is published under `name` in the metadata store: the peer's
    /// claim of its endpoint, epoch and routes (checked only when opened).
    pub fn resolve_name(&self, name: &str) -> Result<crate::discovery::Record, Error> {
        Ok(self.inner().discovery.resolve(name)?)
    }

    /// Asks the peer what changed in its registrations since this engine's
    /// view of it (one round trip per frame of changes, bounded by
    /// `peer_timeout_ms`) and applies it: registrations it made since are
    /// found, ones it removed are gone from the view. Prepared transfers
    /// keep what they resolved. Prepare and the lookups below refresh on
    /// their own when needed.
    pub fn refresh_segment(&self, segment: &RemoteSegment) -> Result<(), Error> {
        self.inner().refresh(&segment.peer)
    }

    /// The peer's registration covering `len` bytes at `addr` (an address
    /// in the peer) that `accept`s. The view is refreshed first if the peer
    /// announced changes, and once more if nothing covers the range; then
    /// the range is refused with `PeerError::RangeNotRegistered`.
    pub fn find_remote_registration(
        &self,
        segment: &RemoteSegment,
        addr: u64,
        len: u64,
        accept: impl Fn(&crate::segment::ExportedRegistration) -> bool,
    ) -> Result<crate::segment::ExportedRegistration, Error> {
        self.inner().find_remote(&segment.peer, addr, len, &accept)
    }

    /// Remote descriptors for `(address, len)` ranges of the peer: each
    /// names a registration covering it that permits `op`, resolved as in
    /// [`Self::find_remote_registration`] (at most one more refresh for the
    /// whole list).
    pub fn resolve_remote_ranges(
        &self,
        segment: &RemoteSegment,
        op: crate::Op,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<crate::Desc>, Error> {
        self.inner().resolve_remote(&segment.peer, op, ranges)
    }

    /// [`Self::prepare`] for a peer's ranges named by their address in it
    /// (`spec.remote` is not read): each resolves as in
    /// [`Self::resolve_remote_ranges`]. A peer that refuses a registration
    /// so resolved as no longer live (it deregistered it, and the view had
    /// not heard yet) gets the view refreshed and the ranges resolved once
    /// more: a range registered again is reached, a range given up is
    /// refused with `PeerError::RangeNotRegistered`.
    pub fn prepare_by_address(&self, spec: &TransferSpec<'_>, ranges: &[(u64, u64)]) -> Result<Transfer, Error> {
        let Target::Peer(segment) = spec.target else {
            return Err(Error::NotSupported("ranges by address name a peer's memory".into()));
        };
        let inner = self.inner();
        let mut refreshed = false;
        loop {
            let remote = inner.resolve_remote(&segment.peer, spec.op, ranges)?;
            match self.prepare(&TransferSpec { remote: &remote, ..*spec }) {
                Err(Error::Peer(PeerError::Refused { status, .. }))
                    if !refreshed
                        && matches!(status, RemoteStatus::StaleRegistration | RemoteStatus::UnknownRegistration) =>
                {
                    inner.refresh(&segment.peer)?;
                    refreshed = true;
                }
                done => return done,
            }
        }
    }

    /// How a live registration of this engine is exported to peers (`None`
    /// for a stale id or one peers may not target).
    pub fn exported_registration(&self, id: RegistrationId) -> Option<crate::segment::ExportedRegistration> {
        self.inner().registry.lock().export_one(id, crate::segment::ExportedRegistration::of)
    }

    /// Fences new posts to the peer, waits up to `timeout` for admitted
    /// executions to retire, then closes its connections. A failed close is
    /// sticky: later calls return the same error and never retry.
    pub fn close_segment(&self, segment: &RemoteSegment, timeout: Duration) -> Result<(), Error> {
        Ok(segment.peer.close(timeout)?)
    }

    /// Sends a notification to a peer and waits for it to be queued there.
    /// Never replays anything on failure.
    pub fn notify(&self, segment: &RemoteSegment, payload: &[u8]) -> Result<(), Error> {
        self.inner().notify(segment, payload)
    }

    /// Charges `count` handles held by a binding (the C ABI) against
    /// `max_binding_handles`; refunded when the returned value is dropped.
    pub fn charge_binding_handles(&self, count: u64) -> Result<BindingCharge, Error> {
        let inner = self.inner();
        let limit = inner.config.max_binding_handles;
        Charge::limited(&inner.counters, Counter::BindingHandles, count, Resource::BindingHandles, limit)
            .map(BindingCharge)
            .map_err(Error::from)
    }
}

/// The test interface (feature `fault-injection`).
#[cfg(feature = "fault-injection")]
impl TransferEngine {
    fn fault_control(&self) -> &dyn crate::transport::fault::FaultControl {
        let hooks = self.inner().routes.hooks.as_ref().and_then(|h| h.as_any());
        hooks
            .and_then(|a| a.downcast_ref::<crate::transport::fault::FaultState<RouteTask>>())
            .expect("an engine built with fault-injection has fault hooks")
    }

    /// Test-only: holds incoming peer requests after validation (their
    /// range loans taken) and before any byte moves, until set to false.
    pub fn hold_remote_requests(&self, on: bool) {
        self.fault_control().hold_remote(on);
    }

    /// Test-only: waits until `n` peer requests wait in the hold of
    /// [`Self::hold_remote_requests`]; false if `timeout` passed first.
    pub fn wait_remote_requests_held(&self, n: usize, timeout: Duration) -> bool {
        self.fault_control().wait_remote_held(n, timeout)
    }

    /// Test-only: the CMA probe of segments opened from now on reports a
    /// denial, as a kernel that forbids cross-memory access would.
    pub fn deny_cma_for_tests(&self, on: bool) {
        self.fault_control().deny_cma(on);
    }

    /// Test-only: while on, this engine's registration changes are kept
    /// from the peers that watch them (as if the pushes were slow); they go
    /// out once it is off.
    pub fn withhold_watch_pushes_for_tests(&self, on: bool) {
        self.fault_control().withhold_pushes(on);
    }

    /// Test-only: this engine's answers to peers' requests for CUDA IPC
    /// handles of VMM memory are falsified as `forgery` says (`None`:
    /// honest again), as a hostile target's would be.
    pub fn forge_ipc_answers_for_tests(&self, forgery: Option<crate::transport::fault::IpcForgery>) {
        self.fault_control().forge_ipc(forgery);
    }

    /// Test-only fault hooks of the local route.
    pub fn fault_hooks(&self) -> crate::transport::fault::FaultHooks<'_> {
        crate::transport::fault::FaultHooks { ctl: self.fault_control() }
    }
}

/// The engine's hooks: scripted faults in a test build, none otherwise.
fn hooks() -> Option<Arc<dyn Hooks<RouteTask>>> {
    #[cfg(feature = "fault-injection")]
    let hooks: Option<Arc<dyn Hooks<RouteTask>>> = Some(Arc::new(crate::transport::fault::FaultState::default()));
    #[cfg(not(feature = "fault-injection"))]
    let hooks = None;
    hooks
}
