//! A prepared transfer: its handle, its shared state and its route tasks.
//!
//! Lock order: the engine's admission lock, then a transfer's cell lock.
//! Range loans are dropped only after every lock is released, because
//! dropping the last loan of a deregistered borrowed range runs the
//! caller's owner-release callback.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::batch::TransferStatus;
use crate::batch::lifecycle::TransferLifecycle;
use crate::charge::{Charge, Counter};
use crate::engine::notify::Notification;
use crate::engine::plan::Plan;
use crate::engine::{EngineInner, QueuedExec};
use crate::error::{BatchError, Error, RegistryError};
use crate::registry::Registration;
use crate::transport::{CopyJob, CopyProgram};
use crate::types::Resource;
use crate::types::TaskReport;

/// A peer of this engine: its links carry route tasks.
pub(crate) type Peer = crate::engine::peer::Peer<RouteTask>;
/// A peer's loan of ranges to this engine's one-sided copies.
pub(crate) type RemoteLoan = crate::engine::peer::RemoteLoan<RouteTask>;

/// What a transfer owns apart from its program: refunded on release.
pub(crate) struct Owners {
    pub loans: Vec<Arc<Registration>>,
    /// For a one-sided route: what the peer keeps alive for us.
    pub remote_loan: Option<RemoteLoan>,
    pub _charge: Charge,
}

pub(crate) struct Cell {
    pub life: TransferLifecycle,
    pub exec_charge: Option<Charge>,
    pub owners: Option<Owners>,
    /// The handle was dropped while active: free owners at retirement.
    pub orphaned: bool,
    /// When the current execution was posted, until its first task is
    /// admitted (its admission wait, for `/metrics`).
    pub posted_at: Option<std::time::Instant>,
}

/// Whose memory the remote descriptors name, kept alive while the
/// transfer lives.
pub(crate) type PlanTarget = crate::types::TargetOf<Arc<Peer>, Arc<crate::file::Entry>>;

/// Shared between the handle, queue entries and route tasks.
pub(crate) struct TransferShared {
    pub id: u64,
    pub plan: Plan,
    pub target: PlanTarget,
    /// The route it takes.
    pub way: &'static dyn crate::transport::routes::RouteImpl,
    /// Which route, and why.
    pub route: crate::types::RouteChoice,
    /// Raw ids and lengths of the peer registrations the transfer names
    /// (one-sided routes borrow them).
    pub remote_ids: Vec<(u64, u64)>,
    pub cell: Mutex<Cell>,
    pub retired: Condvar,
    /// Retirements so far; lets `wait` poll briefly without the lock.
    pub retirements: AtomicU64,
}

/// What a retirement leaves to do once locks are released.
#[derive(Default)]
pub(crate) struct AfterRetire {
    owners: Option<Owners>,
    exec_charge: Option<Charge>,
    retired: bool,
    /// The execution's logical outcome.
    outcome: Option<crate::batch::OutcomeCode>,
}

impl Cell {
    /// Called under the cell lock when the current execution just retired.
    pub fn on_retired(&mut self) -> AfterRetire {
        let outcome = match self.life.status() {
            crate::batch::TransferStatus::Retired(r) => Some(r.outcome.code),
            _ => None,
        };
        if self.orphaned {
            // Nobody can observe this transfer's status: free its owners
            // before the execution charge, so that an idle engine means
            // every charge is back.
            AfterRetire { owners: self.owners.take(), exec_charge: self.exec_charge.take(), retired: true, outcome }
        } else {
            // Refund now, under the lock: a caller who sees `Retired` also
            // sees the execution charge gone.
            drop(self.exec_charge.take());
            AfterRetire { retired: true, outcome, ..AfterRetire::default() }
        }
    }
}

impl AfterRetire {
    /// Finishes a retirement with no lock held.
    pub fn complete(self, engine: &EngineInner, transfer: &TransferShared) {
        if !self.retired {
            return;
        }
        drop(self.owners);
        drop(self.exec_charge);
        if let Some(outcome) = self.outcome {
            engine.metrics.transfer_retired(transfer.route.route, transfer.plan.program.op, outcome);
        }
        engine.life.active.lock().remove(&transfer.id);
        if let PlanTarget::Peer(p) = &transfer.target {
            p.execution_retired();
        }
        transfer.retirements.fetch_add(1, Ordering::Release);
        transfer.retired.notify_all();
        let _drain = engine.life.drain_lock.lock();
        engine.life.drain_cv.notify_all();
    }
}

/// A route task of one execution.
pub(crate) struct RouteTask {
    pub engine: Arc<EngineInner>,
    pub transfer: Arc<TransferShared>,
    pub seq: u64,
    pub task: u32,
    pub in_flight: Option<Charge>,
    /// When it was admitted (its duration, for `/metrics`).
    pub started: std::time::Instant,
    /// A tcp task staging CUDA device memory through a host buffer.
    pub stage: Option<Box<crate::transport::routes::staging::TcpStage>>,
}

impl CopyJob for RouteTask {
    fn program(&self) -> &CopyProgram {
        &self.transfer.plan.program
    }

    fn owner(&self) -> usize {
        Arc::as_ptr(&self.transfer) as usize
    }

    fn helpable(&self) -> bool {
        self.stage.is_none() && self.transfer.plan.program.mover.helpable()
    }

    fn task(&self) -> u32 {
        self.task
    }

    fn spans(&self) -> &[crate::transport::Span] {
        if let Some(spans) = self.stage.as_ref().and_then(|s| s.link_spans()) {
            return spans; // the link moves the buffer
        }
        self.program().task_spans(self.task)
    }

    fn copy_locally(&mut self, limit: u64) -> Option<(u64, Option<crate::types::TaskEnd>)> {
        let stage = self.stage.as_mut()?;
        let program = &self.transfer.plan.program;
        let spans = program.task_spans(self.task);
        let len = self.engine.config.task_bytes;
        stage.copy_locally(&self.engine.routes.staging_pool, len, program.op, spans, limit)
    }

    fn finish(mut self, report: TaskReport) {
        use crate::transport::routes::staging::Next;
        let Some(mut stage) = self.stage.take() else { return self.retire(report) };
        let next = stage.next(self.transfer.plan.program.op, report);
        self.stage = Some(stage);
        match (next, &self.transfer.target) {
            (Next::Done(last), _) => self.retire(last),
            (Next::Worker, _) => {
                let engine = self.engine.clone();
                engine.routes.workers.submit(self);
            }
            // Only a peer's frames stage (`Mover::Frames`).
            (Next::Link, PlanTarget::Peer(p)) => {
                let link = p.link.clone();
                link.submit(crate::transport::proto::client::PeerJob::Task(self));
            }
            (Next::Link, _) => {
                let planned = report.planned;
                self.retire(TaskReport {
                    planned,
                    done: 0,
                    end: crate::types::TaskEnd::Failed { effect_unknown: false },
                })
            }
        }
    }
}

impl RouteTask {
    /// The task's end: its report to the lifecycle, its budget back.
    fn retire(mut self, report: TaskReport) {
        let engine = self.engine.clone();
        let (route, op) = (self.transfer.route.route, self.transfer.plan.program.op);
        engine.metrics.task_ended(route, op, report.done, report.end, self.started.elapsed());
        drop(self.in_flight.take()); // give back the budget first
        let (after, stopped_early, notify) = {
            let mut cell = self.transfer.cell.lock();
            let Some(m) = cell.life.active_mut(self.seq) else {
                debug_assert!(false, "task ended for an execution that is not active");
                return;
            };
            let retired = m.task_ended(self.task, report).unwrap_or_else(|e| {
                debug_assert!(false, "route protocol violation: {e}");
                false
            });
            let stopped_early = m.stopped_early();
            let notify = m.take_notification();
            let after = if retired { cell.on_retired() } else { AfterRetire::default() };
            (after, stopped_early, notify)
        };
        if stopped_early {
            // A failure stopped the execution: its queue entry goes before
            // its retirement is seen (rare; this path takes the lock).
            let mut a = engine.lock_admission();
            a.remove_execution(&self.transfer, self.seq);
            drop(a);
        } else {
            engine.task_freed();
        }
        after.complete(&engine, &self.transfer);
        if notify {
            send_transfer_notification(&engine, &self.transfer, self.seq);
        }
    }
}

/// Delivers a transfer's notification (its bytes all landed), exactly once,
/// then lets the execution retire with the outcome of that delivery.
fn send_transfer_notification(engine: &Arc<EngineInner>, transfer: &Arc<TransferShared>, seq: u64) {
    let payload = transfer.plan.notification.clone().unwrap_or_default();
    match &transfer.target {
        PlanTarget::Loopback => {
            let n = Notification {
                sender_endpoint: engine.own_endpoint(),
                sender_epoch: engine.epoch,
                payload: payload.into(),
            };
            let ok = engine.enqueue_notification(n).is_ok();
            notification_ended(engine, transfer, seq, ok);
        }
        PlanTarget::Peer(p) if engine.notify_fast(p, &payload) => notification_ended(engine, transfer, seq, true),
        // Prepare refuses notifications to a file.
        PlanTarget::File(_) => notification_ended(engine, transfer, seq, false),
        PlanTarget::Peer(p) => {
            let (e, t) = (engine.clone(), transfer.clone());
            let done = Box::new(move |r: Result<&[u8], _>| notification_ended(&e, &t, seq, r.is_ok()));
            p.link.submit(engine.notification_job(p, &payload, done));
        }
    }
}

fn notification_ended(engine: &EngineInner, transfer: &TransferShared, seq: u64, delivered: bool) {
    let after = {
        let mut cell = transfer.cell.lock();
        let retired = cell.life.active_mut(seq).is_some_and(|m| m.notification_ended(delivered));
        if retired { cell.on_retired() } else { AfterRetire::default() }
    };
    after.complete(engine, transfer);
}

/// A prepared transfer. Post it, poll or wait for it, cancel it, release it.
///
/// Dropping a handle while its execution is active does not cancel it or
/// free anything: the engine keeps every owner until the execution retires,
/// then frees them.
pub struct Transfer {
    pub(crate) shared: Arc<TransferShared>,
    pub(crate) engine: Arc<EngineInner>,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer").field("id", &self.shared.id).field("bytes", &self.shared.plan.total_bytes).finish()
    }
}

/// A refused release: the transfer is handed back, still pollable.
#[derive(Debug, thiserror::Error)]
#[error("release refused: {error}")]
pub struct ReleaseRefused {
    /// The transfer, unchanged.
    pub transfer: Transfer,
    /// Why.
    pub error: BatchError,
}

impl Transfer {
    /// Engine-unique id of this transfer.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// The route the transfer takes, and why it was chosen.
    pub fn route(&self) -> &crate::types::RouteChoice {
        &self.shared.route
    }

    /// Bytes the transfer moves.
    pub fn total_bytes(&self) -> u64 {
        self.shared.plan.total_bytes
    }

    /// Descriptors after merging and splitting (spans) and route tasks.
    pub fn shape(&self) -> (usize, usize) {
        let p = &self.shared.plan.program;
        (p.spans.len(), p.tasks.len())
    }

    /// Starts a fresh execution. Refused while one is active, after a
    /// failed, cancelled or timed-out one, when a named registration was
    /// deregistered, when the engine is closed, and when a budget or the
    /// admission queue is full. A refused post admits nothing.
    ///
    /// A lone small task (`inline_max_bytes`) on the self connection or a
    /// same-host route is copied on this thread before `post` returns.
    pub fn post(&self) -> Result<(), Error> {
        let engine = &self.engine;
        engine.check_open()?;
        self.borrow_remote()?;
        let config = &engine.config;
        let exec_charge =
            Charge::limited(&engine.counters, Counter::Executions, 1, Resource::Executions, config.max_executions)?;
        let deadline = self.shared.plan.options.deadline.map(crate::time::deadline_after);
        let mut inline = None;
        let waiting = {
            let mut a = engine.lock_admission();
            {
                let mut cell = self.shared.cell.lock();
                let seq = cell.life.check_post()?;
                match &self.shared.target {
                    PlanTarget::Peer(p) => {
                        if let Some(e) = p.refusal() {
                            return Err(e.into());
                        }
                    }
                    PlanTarget::File(f) if f.is_closed() => return Err(crate::file::FileError::Closed.into()),
                    _ => {}
                }
                let loans = cell.owners.as_ref().map_or(&[][..], |o| &o.loans[..]);
                if let Some(id) = loans.iter().find(|r| r.is_fenced()).map(|r| r.id) {
                    return Err(RegistryError::Deregistered(id).into());
                }
                let entry = QueuedExec {
                    transfer: self.shared.clone(),
                    seq,
                    _queued: Charge::unlimited(&engine.counters, Counter::QueuedExecutions, 1),
                };
                if a.queue.push(self.shared.plan.options.intent, entry, deadline).is_err() {
                    return Err(Error::ResourceExhausted {
                        resource: Resource::AdmissionQueue,
                        limit: config.admission_queue_len,
                        requested: config.admission_queue_len + 1,
                    });
                }
                let p = &self.shared.plan;
                cell.life.post_with_notification(
                    seq,
                    p.program.tasks.len() as u32,
                    p.total_bytes,
                    p.notification.is_some(),
                );
                cell.exec_charge = Some(exec_charge);
                cell.posted_at = Some(std::time::Instant::now());
                if let PlanTarget::Peer(p) = &self.shared.target {
                    p.execution_started();
                }
            }
            engine.life.active.lock().insert(self.shared.id, Arc::downgrade(&self.shared));
            engine.admit(&mut a, Some((&self.shared, &mut inline)));
            !a.queue.is_empty()
        };
        if waiting && engine.config.progress_worker {
            engine.wake_worker();
        }
        if let Some(job) = inline {
            engine.routes.workers.run_inline(job);
        } else {
            // A caller that posts lends its thread for one task of its own.
            engine.routes.workers.help(self.owner());
        }
        Ok(())
    }

    /// This transfer's identity on the routes ([`CopyJob::owner`]).
    fn owner(&self) -> usize {
        Arc::as_ptr(&self.shared) as usize
    }

    /// On a one-sided route, makes sure the peer keeps the target ranges
    /// alive: one round trip at prepare, and again only when the peer has
    /// deregistered something since (a deregistered range is then refused:
    /// nothing is copied into a range its owner gave up).
    pub(crate) fn borrow_remote(&self) -> Result<(), Error> {
        let PlanTarget::Peer(p) = &self.shared.target else { return Ok(()) };
        if !self.shared.way.borrows() {
            return Ok(());
        }
        if self.shared.cell.lock().owners.as_ref().is_some_and(|o| o.remote_loan.as_ref().is_some_and(|l| l.current()))
        {
            return Ok(());
        }
        if let Some(e) = p.refusal() {
            return Err(e.into());
        }
        let write = self.shared.plan.program.op == crate::batch::Op::Write;
        let flags = self.shared.way.borrow_flags();
        let loan = self.engine.borrow(p, &self.shared.remote_ids, write, flags)?;
        // The previous loan (if any) is given back once the lock is released.
        let _previous = {
            let mut cell = self.shared.cell.lock();
            cell.owners.as_mut().and_then(|o| o.remote_loan.replace(loan))
        };
        Ok(())
    }

    /// Status without driving progress.
    pub fn status(&self) -> TransferStatus {
        self.shared.cell.lock().life.status()
    }

    /// One bounded, non-blocking progress step, then the status. A task of
    /// this transfer queued next on a route of this process is copied by
    /// the calling thread first (at most one, of at most `task_bytes`), so
    /// a caller that polls in a loop moves its transfer instead of taking
    /// a core from the workers that do.
    pub fn check(&self) -> TransferStatus {
        self.engine.progress_step();
        self.engine.routes.workers.help(self.owner());
        self.status()
    }

    /// Blocks until the execution retires or `timeout` passes; returns the
    /// status then. Returns at once if nothing is active.
    pub fn wait(&self, timeout: Duration) -> TransferStatus {
        let deadline = crate::time::deadline_after(timeout);
        // Retirement always notifies; only a deadline of this transfer's own
        // queued work needs someone to look at the clock, so only then does
        // the waiter wake up between notifications.
        let slice = match self.shared.plan.options.deadline {
            Some(_) => self.engine.config.progress_interval(),
            None => timeout,
        };
        let mut spin = self.engine.config.spin();
        loop {
            self.engine.progress_step();
            // The waiting thread copies this transfer's tasks queued next,
            // on a core no worker is copying on.
            while self.engine.routes.workers.help_on_a_free_core(self.owner()) {}
            let seen = self.shared.retirements.load(Ordering::Acquire);
            let mut cell = self.shared.cell.lock();
            let status = cell.life.status();
            let now = Instant::now();
            if !matches!(status, TransferStatus::InProgress { .. }) || now >= deadline {
                return status;
            }
            if !spin.is_zero() {
                // Small transfers retire within microseconds: poll briefly
                // (once per wait) before paying for a sleep and a wake-up.
                drop(cell);
                let start = Instant::now();
                while self.shared.retirements.load(Ordering::Acquire) == seen && start.elapsed() < spin {
                    std::hint::spin_loop();
                }
                spin = Duration::ZERO;
                continue;
            }
            self.shared.retired.wait_until(&mut cell, deadline.min(now.checked_add(slice).unwrap_or(deadline)));
        }
    }

    /// Asks the current execution to stop: work not yet started never
    /// starts; started work drains and the execution reports what really
    /// happened (`Success` if everything had started and finished).
    /// Returns the status after the request.
    pub fn cancel(&self) -> Result<TransferStatus, Error> {
        let engine = &self.engine;
        let (after, status) = {
            let mut a = engine.lock_admission();
            let (after, status, seq) = {
                let mut cell = self.shared.cell.lock();
                let seq = match &cell.life {
                    TransferLifecycle::NotPosted => return Err(BatchError::NotPosted.into()),
                    TransferLifecycle::Posted(m) => m.seq(),
                };
                let retired = cell.life.active_mut(seq).is_some_and(|m| m.cancel());
                let after = if retired { cell.on_retired() } else { AfterRetire::default() };
                (after, cell.life.status(), seq)
            };
            a.remove_execution(&self.shared, seq);
            (after, status)
        };
        after.complete(engine, &self.shared);
        Ok(status)
    }

    /// Releases the transfer and its range loans. Refused while an
    /// execution is active: the transfer comes back, still pollable, and
    /// keeps every owner.
    pub fn release(self) -> Result<(), ReleaseRefused> {
        let refused = self.shared.cell.lock().life.check_release();
        match refused {
            Ok(()) => Ok(()), // Drop does the rest
            Err(error) => Err(ReleaseRefused { transfer: self, error }),
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        let owners = {
            let mut cell = self.shared.cell.lock();
            if cell.life.is_active() {
                cell.orphaned = true;
                None
            } else {
                cell.owners.take()
            }
        };
        drop(owners);
    }
}
