//! The runtime around [`SessionMachine`]: the clock, the engine's pins and
//! transfers, and the effects.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use super::machine::{AttachOutcome, Effect, SessionMachine};
use super::{AllocateRequest, KvConnectorInfo, KvError, KvRangeRef, KvSession, KvTransferDisposition, KvTransferMeta};
use crate::{Desc, RangePin, Transfer, TransferEngine, TransferStatus};

/// The service's time, in milliseconds.
pub trait Clock: Send + Sync {
    /// Now.
    fn now_ms(&self) -> u64;
}

/// Monotonic time since the clock was made.
#[derive(Debug)]
pub struct SystemClock {
    start: Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock { start: Instant::now() }
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
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
    resources: HashMap<u64, Resources>,
}

/// KV sessions over an engine. Every method is short and never waits for
/// a transfer; call [`Self::poll`] periodically (the timer): it expires
/// leases, notices retired transfers and frees what ended sessions held.
pub struct KvSessionService {
    engine: TransferEngine,
    clock: Arc<dyn Clock>,
    inner: Mutex<Inner>,
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
    pub fn new(engine: TransferEngine, info: KvConnectorInfo, clock: Arc<dyn Clock>) -> Self {
        let machine = SessionMachine::new(info, engine.endpoint().unwrap_or_default(), engine.source_epoch());
        KvSessionService { engine, clock, inner: Mutex::new(Inner { machine, resources: HashMap::new() }) }
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
        let (result, after) = {
            let mut inner = self.inner.lock();
            let result = f(&mut inner.machine, now);
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
                Effect::Cleanup(id) => after.free.extend(inner.resources.remove(&id)),
            }
        }
        after
    }

    /// Allocates a session (or returns the one of an identical retry).
    pub fn allocate(&self, req: &AllocateRequest) -> Result<KvSession, KvError> {
        self.run(|m, now| m.allocate(req, now))
    }

    /// A session or its tombstone.
    pub fn get(&self, id: u64) -> Result<KvSession, KvError> {
        self.run(|m, now| m.get(id, now))
    }

    /// Extends a live session's lease from now.
    pub fn renew(&self, id: u64, lease_ms: Option<i64>) -> Result<KvSession, KvError> {
        self.run(|m, now| m.renew(id, lease_ms, now))
    }

    /// Relinquishes the session (idempotent).
    pub fn release(&self, id: u64) -> Result<KvSession, KvError> {
        self.run(|m, now| m.release(id, now))
    }

    /// Stops the session's work (idempotent on an ended session).
    pub fn abort(&self, id: u64) -> Result<KvSession, KvError> {
        self.run(|m, now| m.abort(id, now))
    }

    /// The producer's KV is filled: pins `ranges` (registrations of this
    /// engine) and marks the session ready. Nothing is pinned if the
    /// session refuses.
    pub fn mark_ready(&self, id: u64, ranges: &[Desc], meta: &KvTransferMeta) -> Result<KvSession, KvError> {
        let refs: Vec<KvRangeRef> = ranges
            .iter()
            .map(|d| KvRangeRef { registration: d.registration.to_raw(), offset: d.offset, len: d.len })
            .collect();
        self.run(|m, now| m.check_ready(id, &refs, meta, now))?;
        let pin = self.engine.pin_ranges(ranges).map_err(|e| KvError::Engine(e.to_string()))?;
        let mut pin = Some(pin);
        let result = self.run(|m, now| {
            let s = m.mark_ready(id, &refs, meta, now)?;
            Ok(s)
        });
        if result.is_ok() {
            let mut inner = self.inner.lock();
            // Still live (checked under this lock): keep the pin with it.
            if inner.machine.get(id, self.clock.now_ms()).is_ok_and(|s| !s.state.is_terminal()) {
                inner.resources.entry(id).or_default().pin = pin.take();
            }
        }
        drop(pin); // refused, or ended meanwhile: nothing stays pinned
        result
    }

    /// The consumer attaches (or queues, see [`AttachOutcome`]).
    pub fn attach(&self, id: u64, meta: &KvTransferMeta) -> Result<AttachOutcome, KvError> {
        self.run(|m, now| m.attach(id, meta, now))
    }

    /// The consumer is done.
    pub fn complete(&self, id: u64) -> Result<KvSession, KvError> {
        self.run(|m, now| m.complete(id, now))
    }

    /// The consumer goes on without the transfer.
    pub fn bypass(&self, id: u64) -> Result<KvSession, KvError> {
        self.run(|m, now| m.bypass(id, now))
    }

    /// A participant refuses the session.
    pub fn reject(&self, id: u64, reason: &str) -> Result<KvSession, KvError> {
        self.run(|m, now| m.reject(id, reason, now))
    }

    /// A transfer failed or a peer was lost.
    pub fn fail(&self, id: u64, reason: &str) -> Result<KvSession, KvError> {
        self.run(|m, now| m.fail(id, reason, now))
    }

    /// Makes a transfer part of a live session: the session's cleanup waits
    /// for it to retire, and ending the session cancels it if still queued.
    /// A transfer that retires with a failure fails the session. Refused
    /// for an ended session (the transfer is handed back). Returns a shared
    /// handle to the transfer, to poll or wait on and to read its receipt.
    pub fn track_transfer(&self, id: u64, transfer: Transfer) -> Result<Arc<Transfer>, (Transfer, KvError)> {
        let now = self.clock.now_ms();
        let (result, after) = {
            let mut inner = self.inner.lock();
            let result = match inner.machine.work_started(id, now) {
                Ok(()) => {
                    let shared = Arc::new(transfer);
                    inner.resources.entry(id).or_default().transfers.push(shared.clone());
                    Ok(shared)
                }
                Err(e) => Err((transfer, e)),
            };
            (result, Self::effects(&mut inner))
        };
        after.run();
        result
    }

    /// The timer: expires leases, notices sessions whose transfers all
    /// retired (a failed one fails its session), and frees what ended
    /// sessions held. Returns the live count.
    pub fn poll(&self) -> u64 {
        let now = self.clock.now_ms();
        let (live, after) = {
            let mut inner = self.inner.lock();
            let Inner { machine, resources } = &mut *inner;
            machine.tick(now);
            // In session order, so that sessions ending in one poll end (and
            // age as tombstones) in a deterministic order.
            let mut ids: Vec<u64> = resources.keys().copied().filter(|id| machine.work_active(*id)).collect();
            ids.sort_unstable();
            for id in ids {
                let r = &resources[&id];
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
                machine.work_retired(id);
            }
            (machine.live_count(), Self::effects(&mut inner))
        };
        after.run();
        live
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
