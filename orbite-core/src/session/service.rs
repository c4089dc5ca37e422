//! The runtime around [`SessionMachine`]: the clock, the engine's pins and
//! transfers, and the effects.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};

use super::machine::{AttachOutcome, Effect, SessionMachine};
use super::{
    AllocateRequest, KvConnectorInfo, KvError, KvRangeRef, KvSession, KvTransferDisposition, KvTransferMeta, SessionId,
};
use crate::{Desc, RangePin, Transfer, TransferEngine, TransferStatus};

/// The service's time, in milliseconds. Monotonic: leases never jump with
/// the wall clock.
pub trait Clock: Send + Sync {
    /// Now.
    fn now_ms(&self) -> u64;

    /// The wall-clock time (milliseconds since the Unix epoch) at which
    /// this clock read zero, to report expiries as absolute times.
    fn unix_anchor_ms(&self) -> i64 {
        0
    }
}

/// Monotonic time since the clock was made, anchored to the wall clock of
/// that moment.
#[derive(Debug)]
pub struct SystemClock {
    start: Instant,
    anchor_ms: i64,
}

impl Default for SystemClock {
    fn default() -> Self {
        let anchor_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        SystemClock { start: Instant::now(), anchor_ms }
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn unix_anchor_ms(&self) -> i64 {
        self.anchor_ms
    }
}

/// A clock tests move by hand.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    /// Moves the clock forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.now.fetch_add(ms, Ordering::AcqRel);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now.load(Ordering::Acquire)
    }
}

#[derive(Default)]
struct Resources {
    pin: Option<RangePin>,
    transfers: Vec<Arc<Transfer>>,
}

struct Inner {
    machine: SessionMachine,
    resources: HashMap<SessionId, Resources>,
    /// Sessions with tracked work not yet seen retired: all `poll` checks.
    active: BTreeSet<SessionId>,
    /// Tracked transfers not yet dropped.
    tracked: u64,
    /// Time spent expiring leases and forgetting tombstones in `poll`.
    tick_ns: u64,
}

/// What a service holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvServiceStats {
    /// The service's incarnation.
    pub incarnation: u64,
    /// New allocations are refused.
    pub draining: bool,
    /// Sessions not yet terminal.
    pub live_sessions: u64,
    /// Ended sessions kept (queryable, or waiting for cleanup).
    pub tombstones: u64,
    /// Ended sessions whose work has not retired yet.
    pub awaiting_cleanup: u64,
    /// Ranges pinned in the engine (`Stats::pinned_ranges`).
    pub pinned_ranges: u64,
    /// Tracked transfers not yet dropped.
    pub tracked_transfers: u64,
    /// The engine's executions not yet retired.
    pub engine_executions: u64,
    /// Sessions ended by lease expiry.
    pub sessions_expired: u64,
    /// Allocations answered with the session an identical earlier
    /// request (same idempotency key) created.
    pub idempotent_retries: u64,
    /// Runs of the built-in reaper.
    pub reaper_ticks: u64,
    /// CPU time the built-in reaper's thread spent in `poll`, in
    /// nanoseconds.
    pub reaper_busy_ns: u64,
    /// Time every `poll` spent in the lease scan itself (expiring due
    /// leases, forgetting old tombstones), in nanoseconds.
    pub tick_ns: u64,
}

/// KV sessions over an engine. Every method is short and never waits for
/// a transfer. The timer, [`Self::poll`], expires leases, notices retired
/// transfers and frees what ended sessions held: [`Self::start_reaper`]
/// runs it on a thread of the service's own, or a caller calls it.
pub struct KvSessionService {
    engine: TransferEngine,
    clock: Arc<dyn Clock>,
    inner: Mutex<Inner>,
    reaper_ticks: AtomicU64,
    reaper_busy_ns: AtomicU64,
}

/// The built-in reaper: a thread that runs [`KvSessionService::poll`] at
/// least every period and at every lease's expiry. It holds the service
/// weakly and stops when the service is dropped or this handle is.
pub struct Reaper {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reaper").field("running", &self.thread.is_some()).finish()
    }
}

impl Reaper {
    /// Stops the thread and waits for it (as dropping the handle does).
    pub fn stop(self) {}
}

impl Drop for Reaper {
    fn drop(&mut self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
        if let Some(t) = self.thread.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// CPU time of the calling thread, in nanoseconds.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A fresh random, nonzero incarnation.
fn new_incarnation() -> u64 {
    let n = crate::transport::auth::nonce();
    u64::from_le_bytes(n[..8].try_into().expect("a nonce has 8 bytes")) | 1
}

impl std::fmt::Debug for KvSessionService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvSessionService").field("live", &self.live_count()).finish()
    }
}

/// What an operation leaves to do once the service's lock is released:
/// cancels to issue and resources to drop (dropping a pin or a transfer may
/// run a caller's owner-release callback).
#[derive(Default)]
struct After {
    cancel: Vec<Arc<Transfer>>,
    free: Vec<Resources>,
}

impl After {
    fn run(self) {
        for t in self.cancel {
            let _ = t.cancel(); // queued work never starts; running work drains
        }
        drop(self.free);
    }
}

impl KvSessionService {
    /// A service for sessions whose KV lives in `engine`.
    /// Its ids carry a fresh random incarnation.
    pub fn new(engine: TransferEngine, info: KvConnectorInfo, clock: Arc<dyn Clock>) -> Self {
        let machine =
            SessionMachine::new(info, engine.endpoint().unwrap_or_default(), engine.source_epoch(), new_incarnation());
        KvSessionService {
            engine,
            clock,
            inner: Mutex::new(Inner {
                machine,
                resources: HashMap::new(),
                active: BTreeSet::new(),
                tracked: 0,
                tick_ns: 0,
            }),
            reaper_ticks: AtomicU64::new(0),
            reaper_busy_ns: AtomicU64::new(0),
        }
    }

    /// Starts the built-in reaper: `poll` on a thread of its own, at least
    /// every `period` and as soon as the next lease runs out. Nobody needs
    /// to call `poll` while it runs. Dropping the handle stops it.
    pub fn start_reaper(self: &Arc<Self>, period: Duration) -> Result<Reaper, KvError> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let weak: Weak<Self> = Arc::downgrade(self);
        let flag = stop.clone();
        let period = period.max(Duration::from_millis(1));
        let thread = std::thread::Builder::new()
            .name("orbite-reaper".into())
            .spawn(move || {
                loop {
                    let Some(service) = weak.upgrade() else { return };
                    let started = thread_cpu_ns();
                    let (_, next, now) = service.poll_inner();
                    service.reaper_busy_ns.fetch_add(thread_cpu_ns().saturating_sub(started), Ordering::Relaxed);
                    service.reaper_ticks.fetch_add(1, Ordering::Relaxed);
                    // Until the next lease runs out, at most `period`.
                    let wait = next.map_or(period, |t| period.min(Duration::from_millis(t.saturating_sub(now))));
                    drop(service);
                    let mut stopped = flag.0.lock();
                    if !*stopped {
                        flag.1.wait_for(&mut stopped, wait);
                    }
                    if *stopped {
                        return;
                    }
                }
            })
            .map_err(|e| KvError::Engine(format!("cannot start the reaper thread: {e}")))?;
        Ok(Reaper { stop, thread: Some(thread) })
    }

    /// This service's incarnation: the first part of every id it hands out.
    pub fn incarnation(&self) -> u64 {
        self.inner.lock().machine.incarnation()
    }

    /// Wall-clock milliseconds since the Unix epoch of a time on the
    /// service's clock (such as `KvSession::lease_expires_at_ms`).
    pub fn unix_ms(&self, clock_ms: u64) -> i64 {
        self.clock.unix_anchor_ms().saturating_add(clock_ms.min(i64::MAX as u64) as i64)
    }

    /// What the service holds now.
    pub fn stats(&self) -> KvServiceStats {
        let (mut s, kept) = {
            let inner = self.inner.lock();
            let m = &inner.machine;
            let s = KvServiceStats {
                incarnation: m.incarnation(),
                draining: m.is_draining(),
                live_sessions: m.live_count(),
                awaiting_cleanup: m.awaiting_cleanup(),
                tracked_transfers: inner.tracked,
                sessions_expired: m.expired_count(),
                idempotent_retries: m.retried_count(),
                tick_ns: inner.tick_ns,
                ..KvServiceStats::default()
            };
            (s, m.kept() as u64)
        };
        s.tombstones = kept - s.live_sessions;
        let e = self.engine.stats();
        s.pinned_ranges = e.pinned_ranges;
        s.engine_executions = e.executions;
        s.reaper_ticks = self.reaper_ticks.load(Ordering::Relaxed);
        s.reaper_busy_ns = self.reaper_busy_ns.load(Ordering::Relaxed);
        s
    }

    /// Aborts every live session (drain's last step); returns how many.
    pub fn abort_live(&self) -> u64 {
        let ids = self.inner.lock().machine.live_ids();
        ids.into_iter().filter(|&id| self.abort(id).is_ok_and(|s| s.state == super::KvSessionState::Cancelled)).count()
            as u64
    }

    /// What this service supports.
    pub fn info(&self) -> KvConnectorInfo {
        self.inner.lock().machine.info().clone()
    }

    /// The engine.
    pub fn engine(&self) -> &TransferEngine {
        &self.engine
    }

    fn run<R>(&self, f: impl FnOnce(&mut SessionMachine, u64) -> Result<R, KvError>) -> Result<R, KvError> {
        let now = self.clock.now_ms();
        self.locked(|inner| f(&mut inner.machine, now))
    }

    /// Runs `f` under the lock, then what its effects leave to do, after
    /// the lock is released.
    fn locked<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let (result, after) = {
            let mut inner = self.inner.lock();
            let result = f(&mut inner);
            (result, Self::effects(&mut inner))
        };
        after.run();
        result
    }

    fn effects(inner: &mut Inner) -> After {
        let mut after = After::default();
        for effect in inner.machine.take_effects() {
            match effect {
                Effect::StopWork(id) => {
                    if let Some(r) = inner.resources.get(&id) {
                        after.cancel.extend(r.transfers.iter().cloned());
                    }
                }
                Effect::Cleanup(id) => {
                    inner.active.remove(&id);
                    if let Some(r) = inner.resources.remove(&id) {
                        inner.tracked -= r.transfers.len() as u64;
                        after.free.push(r);
                    }
                }
            }
        }
        after
    }

    /// Allocates a session (or returns the one of an identical retry).
    pub fn allocate(&self, req: &AllocateRequest) -> Result<KvSession, KvError> {
        self.run(|m, now| m.allocate(req, now))
    }

    /// The first checks of `allocate` (required text fields present and
    /// within `max_field_bytes`), for a front end that converts the rest.
    pub fn check_allocate_fields(
        &self,
        request_id: &str,
        model: &str,
        idempotency_key: &str,
        layout: &str,
    ) -> Result<(), KvError> {
        self.inner.lock().machine.check_allocate_fields(request_id, model, idempotency_key, layout)
    }

    /// A session or its tombstone.
    pub fn get(&self, id: SessionId) -> Result<KvSession, KvError> {
        self.run(|m, now| m.get(id, now))
    }

    /// Extends a live session's lease from now.
    pub fn renew(&self, id: SessionId, lease_ms: Option<i64>) -> Result<KvSession, KvError> {
        self.run(|m, now| m.renew(id, lease_ms, now))
    }

    /// Relinquishes the session (idempotent).
    pub fn release(&self, id: SessionId) -> Result<KvSession, KvError> {
        self.run(|m, now| m.release(id, now))
    }

    /// [`Self::release`], also saying whether this call ended the session.
    pub fn release_reporting(&self, id: SessionId) -> Result<(KvSession, bool), KvError> {
        self.run(|m, now| m.release_reporting(id, now))
    }

    /// Stops the session's work (idempotent on an ended session).
    pub fn abort(&self, id: SessionId) -> Result<KvSession, KvError> {
        self.run(|m, now| m.abort(id, now))
    }

    /// The producer's KV is filled: pins `ranges` (registrations of this
    /// engine) and marks the session ready. Nothing is pinned if the
    /// session refuses.
    pub fn mark_ready(&self, id: SessionId, ranges: &[Desc], meta: &KvTransferMeta) -> Result<KvSession, KvError> {
        let refs: Vec<KvRangeRef> = ranges
            .iter()
            .map(|d| KvRangeRef { registration: d.registration.to_raw(), offset: d.offset, len: d.len })
            .collect();
        self.run(|m, now| m.check_ready(id, &refs, meta, now))?;
        let pin = self.engine.pin_ranges(ranges).map_err(|e| KvError::Engine(e.to_string()))?;
        let mut pin = Some(pin);
        let result = self.run(|m, now| m.mark_ready(id, &refs, meta, now));
        if result.is_ok() {
            let mut inner = self.inner.lock();
            // Still live (checked under this lock): keep the pin with it.
            if inner.machine.session(id, self.clock.now_ms()).is_ok_and(|s| !s.state.is_terminal()) {
                inner.resources.entry(id).or_default().pin = pin.take();
            }
        }
        drop(pin); // refused, or ended meanwhile: nothing stays pinned
        result
    }

    /// The consumer attaches (or queues, see [`AttachOutcome`]).
    pub fn attach(&self, id: SessionId, meta: &KvTransferMeta) -> Result<AttachOutcome, KvError> {
        self.run(|m, now| m.attach(id, meta, now))
    }

    /// The consumer is done.
    pub fn complete(&self, id: SessionId) -> Result<KvSession, KvError> {
        self.run(|m, now| m.complete(id, now))
    }

    /// The consumer goes on without the transfer.
    pub fn bypass(&self, id: SessionId) -> Result<KvSession, KvError> {
        self.run(|m, now| m.bypass(id, now))
    }

    /// A participant refuses the session.
    pub fn reject(&self, id: SessionId, reason: &str) -> Result<KvSession, KvError> {
        self.run(|m, now| m.reject(id, reason, now))
    }

    /// A transfer failed or a peer was lost.
    pub fn fail(&self, id: SessionId, reason: &str) -> Result<KvSession, KvError> {
        self.run(|m, now| m.fail(id, reason, now))
    }

    /// Makes a transfer part of a live session: the session's cleanup waits
    /// for it to retire, and ending the session cancels it if still queued.
    /// A transfer that retires with a failure fails the session. Refused
    /// for an ended session (the transfer is handed back). Returns a shared
    /// handle to the transfer, to poll or wait on and to read its receipt.
    pub fn track_transfer(&self, id: SessionId, transfer: Transfer) -> Result<Arc<Transfer>, (Transfer, KvError)> {
        let now = self.clock.now_ms();
        self.locked(|inner| match inner.machine.work_started(id, now) {
            Ok(()) => {
                let shared = Arc::new(transfer);
                inner.resources.entry(id).or_default().transfers.push(shared.clone());
                inner.active.insert(id);
                inner.tracked += 1;
                Ok(shared)
            }
            Err(e) => Err((transfer, e)),
        })
    }

    /// The timer: expires leases, notices sessions whose transfers all
    /// retired (a failed one fails its session), and frees what ended
    /// sessions held. Returns the live count.
    pub fn poll(&self) -> u64 {
        self.poll_inner().0
    }

    /// `poll`, also returning the next lease expiry and the time it ran
    /// at (the reaper's next wake-up, read under the same lock).
    fn poll_inner(&self) -> (u64, Option<u64>, u64) {
        let now = self.clock.now_ms();
        let (live, next) = self.locked(|inner| {
            let Inner { machine, resources, active, tick_ns, .. } = inner;
            let started = Instant::now();
            machine.tick(now);
            *tick_ns += started.elapsed().as_nanos() as u64;
            // Only sessions with tracked work, in session order, so that
            // sessions ending in one poll end (and age as tombstones) in a
            // deterministic order.
            let ids: Vec<SessionId> = active.iter().copied().collect();
            for id in ids {
                let Some(r) = resources.get(&id) else {
                    active.remove(&id);
                    continue;
                };
                let statuses: Vec<TransferStatus> = r.transfers.iter().map(|t| t.check()).collect();
                if statuses.iter().any(|s| matches!(s, TransferStatus::InProgress { .. })) {
                    continue;
                }
                let failed = statuses.iter().find_map(|s| match s {
                    TransferStatus::Retired(r) if !r.outcome.is_success() => Some(r.outcome),
                    _ => None,
                });
                if let Some(o) = failed {
                    let _ = machine.fail(
                        id,
                        &format!("transfer ended {:?} after {} bytes", o.code, o.transferred_bytes),
                        now,
                    );
                }
                active.remove(&id);
                machine.work_retired(id);
            }
            (machine.live_count(), machine.next_expiry())
        });
        (live, next, now)
    }

    /// Stops new allocations.
    pub fn start_drain(&self) {
        self.inner.lock().machine.start_drain();
    }

    /// Live sessions.
    pub fn live_count(&self) -> u64 {
        self.inner.lock().machine.live_count()
    }

    /// Draining and nothing left: no live session, nothing pinned.
    pub fn is_drained(&self) -> bool {
        let inner = self.inner.lock();
        inner.machine.is_drained() && inner.resources.is_empty()
    }

    /// Whether a decode may run without a session.
    pub fn check_sessionless_decode(&self, disposition: KvTransferDisposition) -> Result<(), KvError> {
        self.inner.lock().machine.check_sessionless_decode(disposition)
    }
}

/// The service's part of its engine's `/metrics` (`orbite serve` adds it
/// with `TransferEngine::add_metrics`).
impl crate::MetricsSource for KvSessionService {
    fn families(&self) -> Vec<crate::MetricFamily> {
        let s = self.stats();
        let family = |name, help, counter, samples| crate::MetricFamily { name, help, counter, samples };
        vec![
            family(
                "orbite_kv_sessions",
                "KV sessions: not yet terminal (live), and ended ones kept",
                false,
                vec![(vec![("state", "live")], s.live_sessions), (vec![("state", "ended")], s.tombstones)],
            ),
            family(
                "orbite_kv_sessions_awaiting_cleanup",
                "Ended KV sessions whose transfers have not retired yet",
                false,
                vec![(vec![], s.awaiting_cleanup)],
            ),
            family(
                "orbite_kv_session_expiries",
                "KV sessions ended by lease expiry",
                true,
                vec![(vec![], s.sessions_expired)],
            ),
            family(
                "orbite_kv_idempotent_retries",
                "Allocations answered with an identical earlier request's session",
                true,
                vec![(vec![], s.idempotent_retries)],
            ),
            family(
                "orbite_kv_draining",
                "1 while the service drains (refuses new sessions)",
                false,
                vec![(vec![], u64::from(s.draining))],
            ),
            family(
                "orbite_kv_pinned_ranges",
                "Ranges KV sessions pin in the engine",
                false,
                vec![(vec![], s.pinned_ranges)],
            ),
        ]
    }
}
