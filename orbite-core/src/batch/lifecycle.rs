//! The transfer lifecycle as a pure state machine (sans-IO).
//!
//! No threads, clocks or locks here: the engine feeds events (post, a task
//! admitted, a task ended, cancel, deadline passed, release) and reads the
//! status. This is where the lifecycle promises live:
//!
//! * a terminal status ([`TransferStatus::Retired`]) is reached only when
//!   every task that was started has ended, and no further task can start;
//! * the logical outcome (exact prefix, remote effect) is separate from the
//!   retirement receipt;
//! * cancel stops admissions; tasks already started drain and the execution
//!   reports what really happened;
//! * release is refused while an execution is active; only a retired success
//!   may be posted again.

use crate::batch::BatchError;
pub use crate::types::{TaskEnd, TaskReport};

/// What the destination of an execution experienced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RemoteEffect {
    /// Nothing was written by this execution.
    None,
    /// Exactly `transferred_bytes` landed (the prefix and any later task
    /// that finished); nothing else was touched.
    Known,
    /// Bytes beyond what is reported may have been written: a WRITE with
    /// this effect must not be assumed either done or undone.
    Unknown,
}

/// How an execution ended, logically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutcomeCode {
    /// Every byte moved.
    Success,
    /// Cancelled before all work started; started work drained.
    Cancelled,
    /// Its deadline passed before all work started; started work drained.
    TimedOut,
    /// A route completed fewer bytes than asked.
    ShortCompletion,
    /// A route reported failure.
    Failed,
    /// Every byte moved but the requested notification was not delivered
    /// (the transfer is never replayed).
    NotificationFailed,
}

/// The logical outcome of one execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LogicalOutcome {
    /// How it ended.
    pub code: OutcomeCode,
    /// Bytes known landed contiguously from the start of the transfer.
    pub transferred_prefix: u64,
    /// All bytes known landed (prefix plus later tasks that finished).
    pub transferred_bytes: u64,
    /// Bytes the transfer covers.
    pub total_bytes: u64,
    /// What the destination experienced.
    pub remote_effect: RemoteEffect,
}

impl LogicalOutcome {
    /// True for [`OutcomeCode::Success`].
    pub fn is_success(&self) -> bool {
        self.code == OutcomeCode::Success
    }
}

impl std::fmt::Display for LogicalOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} ({} of {} bytes as prefix, effect {:?})",
            self.code, self.transferred_prefix, self.total_bytes, self.remote_effect
        )
    }
}

/// Proof that an execution can no longer touch any buffer it named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RetirementReceipt {
    /// Sequence number of the execution (1 for the first post).
    pub execution: u64,
    /// Tasks that were started and have all ended.
    pub tasks_started: u32,
    /// Tasks that were never started and never will be.
    pub tasks_never_started: u32,
}

/// Logical outcome and retirement receipt of a retired execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TransferResult {
    /// What happened.
    pub outcome: LogicalOutcome,
    /// Proof of physical retirement.
    pub receipt: RetirementReceipt,
}

/// Where an active execution stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExecutionPhase {
    /// Waiting for admission; nothing started.
    Queued,
    /// Some work started; more may start.
    Running,
    /// No more work will start (finished, failed, cancelled or expired);
    /// started work is still draining.
    Draining,
}

/// Status of a transfer as a caller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferStatus {
    /// Prepared, never posted.
    NotPosted,
    /// An execution is active. Not terminal, even if failure is known.
    InProgress {
        /// Where it stands.
        phase: ExecutionPhase,
        /// Bytes known landed so far.
        transferred_bytes: u64,
    },
    /// The last execution retired: terminal.
    Retired(TransferResult),
}

impl TransferStatus {
    /// True only for a retired execution.
    pub fn is_terminal(&self) -> bool {
        matches!(self, TransferStatus::Retired(_))
    }
    /// The result, if retired.
    pub fn result(&self) -> Option<TransferResult> {
        match self {
            TransferStatus::Retired(r) => Some(*r),
            _ => None,
        }
    }
}

/// Misuse of the machine by its driver (a bug, never a peer's doing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolViolation {
    /// A report for a task that was not started.
    #[error("report for task {0} that was not started")]
    NotStarted(u32),
    /// A second report for the same task.
    #[error("second report for task {0}")]
    Duplicate(u32),
    /// A report with more bytes done than planned.
    #[error("task {0} reports more bytes than planned")]
    Overrun(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Cancelled,
    Expired,
    Failed(OutcomeCode),
}

/// One execution: tasks `0..task_count`, started in order.
#[derive(Debug, Clone)]
pub struct ExecutionMachine {
    seq: u64,
    task_count: u32,
    total_bytes: u64,
    admitted: u32,
    ended: u32,
    stop: Option<Stop>,
    effect_unknown: bool,
    transferred: u64,
    /// Per task: bytes done once ended (`None` while not ended).
    reports: Vec<Option<TaskReport>>,
    prefix_task: u32,
    prefix_bytes: u64,
    notify: Notify,
    result: Option<TransferResult>,
}

/// The notification an execution must deliver after its bytes landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Notify {
    NotRequested,
    Pending,
    InFlight,
    Done(bool),
}

impl ExecutionMachine {
    /// A fresh execution of `task_count` tasks covering `total_bytes`.
    pub fn new(seq: u64, task_count: u32, total_bytes: u64) -> Self {
        Self::with_notification(seq, task_count, total_bytes, false)
    }

    /// A fresh execution that, if every byte lands, must also deliver one
    /// notification before it may report success.
    pub fn with_notification(seq: u64, task_count: u32, total_bytes: u64, notify: bool) -> Self {
        ExecutionMachine {
            seq,
            task_count,
            total_bytes,
            admitted: 0,
            ended: 0,
            stop: None,
            effect_unknown: false,
            transferred: 0,
            reports: vec![None; task_count as usize],
            prefix_task: 0,
            prefix_bytes: 0,
            notify: if notify { Notify::Pending } else { Notify::NotRequested },
            result: None,
        }
    }

    fn data_succeeded(&self) -> bool {
        self.stop.is_none() && self.admitted == self.task_count && self.ended == self.admitted
    }

    /// If every byte landed and a notification is due, marks it in flight
    /// and returns true: the caller must send it exactly once and report
    /// with [`Self::notification_ended`].
    pub fn take_notification(&mut self) -> bool {
        if self.notify == Notify::Pending && self.data_succeeded() {
            self.notify = Notify::InFlight;
            return true;
        }
        false
    }

    /// The notification was delivered (or not). Returns true if this
    /// retired the execution.
    pub fn notification_ended(&mut self, delivered: bool) -> bool {
        if self.notify == Notify::InFlight {
            self.notify = Notify::Done(delivered);
        }
        self.try_retire()
    }

    /// Sequence number of this execution.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The next task that may start, without starting it.
    pub fn peek_next(&self) -> Option<u32> {
        (self.stop.is_none() && self.admitted < self.task_count).then_some(self.admitted)
    }

    /// Starts the next task, if any may start.
    pub fn admit_next(&mut self) -> Option<u32> {
        let next = self.peek_next()?;
        self.admitted += 1;
        Some(next)
    }

    /// Tasks started so far.
    pub fn admitted(&self) -> u32 {
        self.admitted
    }

    /// True once no further task can start.
    pub fn admissions_closed(&self) -> bool {
        self.stop.is_some() || self.admitted == self.task_count
    }

    /// True if admissions stopped before every task started (cancel,
    /// deadline or failure).
    pub fn stopped_early(&self) -> bool {
        self.stop.is_some() && self.admitted < self.task_count
    }

    /// Records the end of a started task. Returns true if this retired the
    /// execution.
    pub fn task_ended(&mut self, task: u32, report: TaskReport) -> Result<bool, ProtocolViolation> {
        if task >= self.admitted {
            return Err(ProtocolViolation::NotStarted(task));
        }
        if report.done > report.planned || (report.end == TaskEnd::Complete && report.done != report.planned) {
            return Err(ProtocolViolation::Overrun(task));
        }
        let slot = &mut self.reports[task as usize];
        if slot.is_some() {
            return Err(ProtocolViolation::Duplicate(task));
        }
        *slot = Some(report);
        self.ended += 1;
        self.transferred += report.done;
        match report.end {
            TaskEnd::Complete => {}
            TaskEnd::Short => self.fail(OutcomeCode::ShortCompletion),
            TaskEnd::Failed { effect_unknown } => {
                self.effect_unknown |= effect_unknown;
                self.fail(OutcomeCode::Failed);
            }
        }
        while let Some(Some(r)) = self.reports.get(self.prefix_task as usize) {
            if r.end != TaskEnd::Complete {
                break;
            }
            self.prefix_bytes += r.done;
            self.prefix_task += 1;
        }
        Ok(self.try_retire())
    }

    fn fail(&mut self, code: OutcomeCode) {
        // The first failure decides; a cancel or expiry before it still
        // loses to a real failure of started work.
        if !matches!(self.stop, Some(Stop::Failed(_))) {
            self.stop = Some(Stop::Failed(code));
        }
    }

    /// Requests cancellation: no further task starts. Returns true if this
    /// retired the execution (nothing was still running).
    pub fn cancel(&mut self) -> bool {
        if self.stop.is_none() && self.admitted < self.task_count {
            self.stop = Some(Stop::Cancelled);
        }
        self.try_retire()
    }

    /// The deadline passed: tasks not yet started never will. Running work
    /// is not cut. Returns true if this retired the execution.
    pub fn expire(&mut self) -> bool {
        if self.stop.is_none() && self.admitted < self.task_count {
            self.stop = Some(Stop::Expired);
        }
        self.try_retire()
    }

    fn try_retire(&mut self) -> bool {
        if self.result.is_some() || !self.admissions_closed() || self.ended < self.admitted {
            return false;
        }
        if self.data_succeeded() && matches!(self.notify, Notify::Pending | Notify::InFlight) {
            return false; // the notification is still due
        }
        let code = match self.stop {
            Some(Stop::Failed(code)) => code,
            Some(Stop::Cancelled) => OutcomeCode::Cancelled,
            Some(Stop::Expired) => OutcomeCode::TimedOut,
            None if self.notify == Notify::Done(false) => OutcomeCode::NotificationFailed,
            None => OutcomeCode::Success,
        };
        let partial = self.reports.get(self.prefix_task as usize).and_then(|r| r.map(|r| r.done)).unwrap_or(0);
        let remote_effect = if self.effect_unknown {
            RemoteEffect::Unknown
        } else if self.transferred == 0 {
            RemoteEffect::None
        } else {
            RemoteEffect::Known
        };
        self.result = Some(TransferResult {
            outcome: LogicalOutcome {
                code,
                transferred_prefix: self.prefix_bytes + partial,
                transferred_bytes: self.transferred,
                total_bytes: self.total_bytes,
                remote_effect,
            },
            receipt: RetirementReceipt {
                execution: self.seq,
                tasks_started: self.admitted,
                tasks_never_started: self.task_count - self.admitted,
            },
        });
        true
    }

    /// The result once retired.
    pub fn result(&self) -> Option<TransferResult> {
        self.result
    }

    /// Status as a caller sees it.
    pub fn status(&self) -> TransferStatus {
        if let Some(r) = self.result {
            return TransferStatus::Retired(r);
        }
        let phase = if self.admissions_closed() {
            ExecutionPhase::Draining
        } else if self.admitted == 0 {
            ExecutionPhase::Queued
        } else {
            ExecutionPhase::Running
        };
        TransferStatus::InProgress { phase, transferred_bytes: self.transferred }
    }
}

/// The prepared transfer around its executions.
#[derive(Debug, Clone)]
pub enum TransferLifecycle {
    /// Never posted.
    NotPosted,
    /// The current execution (active or retired).
    Posted(ExecutionMachine),
}

impl TransferLifecycle {
    /// May a new execution start? Refuses active, failed, cancelled and
    /// uncertain executions; a retired success may run again.
    pub fn check_post(&self) -> Result<u64, BatchError> {
        match self {
            TransferLifecycle::NotPosted => Ok(1),
            TransferLifecycle::Posted(m) => match (m.status(), m.result()) {
                (_, Some(r)) if r.outcome.is_success() => Ok(m.seq() + 1),
                (_, Some(r)) => Err(BatchError::RepostRefused { outcome: r.outcome }),
                (TransferStatus::InProgress { phase, .. }, None) => Err(BatchError::ExecutionActive { phase }),
                _ => Err(BatchError::ExecutionActive { phase: ExecutionPhase::Running }),
            },
        }
    }

    /// Starts execution `seq` (after [`Self::check_post`] allowed it).
    pub fn post(&mut self, seq: u64, task_count: u32, total_bytes: u64) {
        self.post_with_notification(seq, task_count, total_bytes, false);
    }

    /// Starts execution `seq` that must also deliver a notification.
    pub fn post_with_notification(&mut self, seq: u64, task_count: u32, total_bytes: u64, notify: bool) {
        *self = TransferLifecycle::Posted(ExecutionMachine::with_notification(seq, task_count, total_bytes, notify));
    }

    /// May the transfer be released? Refused while an execution is active.
    pub fn check_release(&self) -> Result<(), BatchError> {
        match self.status() {
            TransferStatus::InProgress { phase, .. } => Err(BatchError::ExecutionActive { phase }),
            _ => Ok(()),
        }
    }

    /// The current execution, if it is active.
    pub fn active_mut(&mut self, seq: u64) -> Option<&mut ExecutionMachine> {
        match self {
            TransferLifecycle::Posted(m) if m.seq() == seq && m.result().is_none() => Some(m),
            _ => None,
        }
    }

    /// True while an execution is active.
    pub fn is_active(&self) -> bool {
        matches!(self.status(), TransferStatus::InProgress { .. })
    }

    /// Status as a caller sees it.
    pub fn status(&self) -> TransferStatus {
        match self {
            TransferLifecycle::NotPosted => TransferStatus::NotPosted,
            TransferLifecycle::Posted(m) => m.status(),
        }
    }
}

#[cfg(test)]
mod tests;
