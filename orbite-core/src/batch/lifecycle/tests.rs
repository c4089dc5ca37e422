//! Unit and property tests of the lifecycle machine against a reference model.

use super::*;
use proptest::prelude::*;

fn complete(planned: u64) -> TaskReport {
    TaskReport { planned, done: planned, end: TaskEnd::Complete }
}

#[test]
fn success_retires_only_after_every_task_ended() {
    let mut m = ExecutionMachine::new(1, 2, 20);
    assert_eq!(m.status(), TransferStatus::InProgress { phase: ExecutionPhase::Queued, transferred_bytes: 0 });
    assert_eq!(m.admit_next(), Some(0));
    assert_eq!(m.admit_next(), Some(1));
    assert_eq!(m.admit_next(), None);
    assert!(!m.task_ended(1, complete(10)).unwrap());
    assert_eq!(m.status(), TransferStatus::InProgress { phase: ExecutionPhase::Draining, transferred_bytes: 10 });
    assert!(m.task_ended(0, complete(10)).unwrap());
    let r = m.result().unwrap();
    assert_eq!(r.outcome.code, OutcomeCode::Success);
    assert_eq!(r.outcome.transferred_prefix, 20);
    assert_eq!(r.outcome.remote_effect, RemoteEffect::Known);
    assert_eq!(r.receipt, RetirementReceipt { execution: 1, tasks_started: 2, tasks_never_started: 0 });
}

#[test]
fn cancel_of_queued_work_proves_nothing_started() {
    let mut m = ExecutionMachine::new(1, 3, 30);
    assert!(m.cancel());
    let r = m.result().unwrap();
    assert_eq!(r.outcome.code, OutcomeCode::Cancelled);
    assert_eq!(r.outcome.remote_effect, RemoteEffect::None);
    assert_eq!(r.receipt.tasks_never_started, 3);
    assert_eq!(m.admit_next(), None);
}

#[test]
fn cancel_of_running_work_drains_then_reports_the_real_outcome() {
    let mut m = ExecutionMachine::new(1, 3, 30);
    m.admit_next();
    assert!(!m.cancel(), "a running task must drain first");
    assert_eq!(m.admit_next(), None);
    assert!(m.task_ended(0, complete(10)).unwrap());
    let o = m.result().unwrap().outcome;
    assert_eq!((o.code, o.transferred_prefix, o.remote_effect), (OutcomeCode::Cancelled, 10, RemoteEffect::Known));
    // Cancel after everything started changes nothing: success stays success.
    let mut m = ExecutionMachine::new(2, 1, 10);
    m.admit_next();
    assert!(!m.cancel());
    assert!(m.task_ended(0, complete(10)).unwrap());
    assert_eq!(m.result().unwrap().outcome.code, OutcomeCode::Success);
}

#[test]
fn failure_stays_in_progress_until_drained_and_keeps_unknown_effect() {
    let mut m = ExecutionMachine::new(1, 3, 30);
    m.admit_next();
    m.admit_next();
    assert!(
        !m.task_ended(1, TaskReport { planned: 10, done: 4, end: TaskEnd::Failed { effect_unknown: true } }).unwrap()
    );
    assert!(matches!(m.status(), TransferStatus::InProgress { phase: ExecutionPhase::Draining, .. }));
    assert_eq!(m.admit_next(), None, "no task starts after a failure");
    assert!(m.task_ended(0, complete(10)).unwrap());
    let r = m.result().unwrap();
    assert_eq!(r.outcome.code, OutcomeCode::Failed);
    assert_eq!(r.outcome.transferred_prefix, 14);
    assert_eq!(r.outcome.remote_effect, RemoteEffect::Unknown);
    assert_eq!(r.receipt.tasks_never_started, 1);
}

#[test]
fn short_completion_reports_the_exact_prefix() {
    let mut m = ExecutionMachine::new(1, 2, 20);
    m.admit_next();
    assert!(m.task_ended(0, TaskReport { planned: 10, done: 3, end: TaskEnd::Short }).unwrap());
    let o = m.result().unwrap().outcome;
    assert_eq!((o.code, o.transferred_prefix, o.remote_effect), (OutcomeCode::ShortCompletion, 3, RemoteEffect::Known));
}

#[test]
fn notification_is_sent_once_after_the_bytes_and_decides_success() {
    let mut m = ExecutionMachine::with_notification(1, 2, 20, true);
    m.admit_next();
    m.admit_next();
    assert!(!m.take_notification(), "not before the bytes landed");
    assert!(!m.task_ended(0, complete(10)).unwrap());
    assert!(!m.task_ended(1, complete(10)).unwrap(), "bytes landed but the notification is due");
    assert!(matches!(m.status(), TransferStatus::InProgress { phase: ExecutionPhase::Draining, .. }));
    assert!(m.take_notification());
    assert!(!m.take_notification(), "exactly once");
    assert!(m.notification_ended(true));
    assert_eq!(m.result().unwrap().outcome.code, OutcomeCode::Success);

    let mut m = ExecutionMachine::with_notification(1, 1, 10, true);
    m.admit_next();
    m.task_ended(0, complete(10)).unwrap();
    assert!(m.take_notification());
    assert!(m.notification_ended(false));
    let o = m.result().unwrap().outcome;
    assert_eq!(
        (o.code, o.transferred_prefix, o.remote_effect),
        (OutcomeCode::NotificationFailed, 10, RemoteEffect::Known)
    );

    // A failed transfer never sends its notification.
    let mut m = ExecutionMachine::with_notification(1, 1, 10, true);
    m.admit_next();
    assert!(
        m.task_ended(0, TaskReport { planned: 10, done: 0, end: TaskEnd::Failed { effect_unknown: false } }).unwrap()
    );
    assert!(!m.take_notification());
    assert_eq!(m.result().unwrap().outcome.code, OutcomeCode::Failed);
}

#[test]
fn protocol_violations_are_refused() {
    let mut m = ExecutionMachine::new(1, 2, 20);
    assert_eq!(m.task_ended(0, complete(10)), Err(ProtocolViolation::NotStarted(0)));
    m.admit_next();
    assert_eq!(
        m.task_ended(0, TaskReport { planned: 10, done: 11, end: TaskEnd::Short }),
        Err(ProtocolViolation::Overrun(0))
    );
    m.task_ended(0, complete(10)).unwrap();
    assert_eq!(m.task_ended(0, complete(10)), Err(ProtocolViolation::Duplicate(0)));
}

#[test]
fn repost_and_release_rules() {
    let mut t = TransferLifecycle::NotPosted;
    assert!(t.check_release().is_ok());
    assert_eq!(t.check_post(), Ok(1));
    t.post(1, 1, 10);
    assert!(matches!(t.check_post(), Err(BatchError::ExecutionActive { .. })));
    assert!(matches!(t.check_release(), Err(BatchError::ExecutionActive { .. })));
    let m = t.active_mut(1).unwrap();
    m.admit_next();
    m.task_ended(0, complete(10)).unwrap();
    assert_eq!(t.check_post(), Ok(2), "a drained success may run again");
    t.post(2, 1, 10);
    assert!(t.active_mut(1).is_none(), "old execution is gone");
    t.active_mut(2).unwrap().cancel();
    assert!(matches!(t.check_post(), Err(BatchError::RepostRefused { .. })));
    assert!(t.check_release().is_ok());
}

// ---- property test against a reference model ----

#[derive(Debug, Clone)]
enum Op {
    Post,
    Admit,
    /// End the k-th running task (mod the number running).
    End {
        k: usize,
        done_pct: u8,
        kind: u8,
    },
    Cancel,
    Expire,
    Release,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => Just(Op::Post),
        4 => Just(Op::Admit),
        4 => (any::<usize>(), 0u8..=100, 0u8..6).prop_map(|(k, done_pct, kind)| Op::End { k, done_pct, kind }),
        1 => Just(Op::Cancel),
        1 => Just(Op::Expire),
        1 => Just(Op::Release),
    ]
}

#[derive(Debug, Clone, PartialEq)]
enum RefTask {
    NotStarted,
    Running,
    Ended(TaskReport),
}

#[derive(Debug, Clone)]
struct RefExec {
    seq: u64,
    tasks: Vec<RefTask>,
    planned: Vec<u64>,
    stopped: Option<OutcomeCode>,
    first_failure: Option<OutcomeCode>,
}

impl RefExec {
    fn running(&self) -> Vec<usize> {
        (0..self.tasks.len()).filter(|&i| self.tasks[i] == RefTask::Running).collect()
    }
    fn any_not_started(&self) -> bool {
        self.tasks.contains(&RefTask::NotStarted)
    }
    fn retired(&self) -> bool {
        (self.stopped.is_some() || self.first_failure.is_some() || !self.any_not_started()) && self.running().is_empty()
    }
    fn outcome(&self) -> LogicalOutcome {
        let code =
            self.first_failure.or(self.stopped.filter(|_| self.any_not_started())).unwrap_or(OutcomeCode::Success);
        let mut prefix = 0;
        for t in &self.tasks {
            match t {
                RefTask::Ended(r) if r.end == TaskEnd::Complete => prefix += r.done,
                RefTask::Ended(r) => {
                    prefix += r.done;
                    break;
                }
                _ => break,
            }
        }
        let reports: Vec<TaskReport> =
            self.tasks.iter().filter_map(|t| if let RefTask::Ended(r) = t { Some(*r) } else { None }).collect();
        let transferred: u64 = reports.iter().map(|r| r.done).sum();
        let unknown = reports.iter().any(|r| r.end == TaskEnd::Failed { effect_unknown: true });
        LogicalOutcome {
            code,
            transferred_prefix: prefix,
            transferred_bytes: transferred,
            total_bytes: self.planned.iter().sum(),
            remote_effect: if unknown {
                RemoteEffect::Unknown
            } else if transferred == 0 {
                RemoteEffect::None
            } else {
                RemoteEffect::Known
            },
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn machine_matches_reference_model(planned in prop::collection::vec(1u64..1000, 1..6), ops in prop::collection::vec(op(), 1..60)) {
        let total: u64 = planned.iter().sum();
        let n = planned.len() as u32;
        let mut sut = TransferLifecycle::NotPosted;
        let mut model: Option<RefExec> = None;
        let mut released = false;
        for op in ops {
            if released { break; }
            let model_active = model.as_ref().is_some_and(|m| !m.retired());
            match op {
                Op::Post => {
                    let allowed = match &model {
                        None => Ok(1),
                        Some(m) if !m.retired() => Err(()),
                        Some(m) if m.outcome().code == OutcomeCode::Success => Ok(m.seq + 1),
                        Some(_) => Err(()),
                    };
                    let got = sut.check_post();
                    prop_assert_eq!(got.is_ok(), allowed.is_ok());
                    if let Ok(seq) = got {
                        prop_assert_eq!(Ok(seq), allowed);
                        sut.post(seq, n, total);
                        model = Some(RefExec { seq, tasks: vec![RefTask::NotStarted; n as usize], planned: planned.clone(), stopped: None, first_failure: None });
                    }
                }
                Op::Admit => {
                    if let Some(m) = model.as_mut() {
                        let expect = if m.stopped.is_none() && m.first_failure.is_none() {
                            m.tasks.iter().position(|t| *t == RefTask::NotStarted)
                        } else { None };
                        let got = sut.active_mut(m.seq).and_then(|e| e.admit_next());
                        prop_assert_eq!(got.map(|i| i as usize), expect);
                        if let Some(i) = expect { m.tasks[i] = RefTask::Running; }
                    }
                }
                Op::End { k, done_pct, kind } => {
                    if let Some(m) = model.as_mut() {
                        let running = m.running();
                        if running.is_empty() { continue; }
                        let i = running[k % running.len()];
                        let p = m.planned[i];
                        let (done, end) = match kind {
                            0..=2 => (p, TaskEnd::Complete),
                            3 => ((p * done_pct as u64 / 100).min(p.saturating_sub(1)), TaskEnd::Short),
                            4 => (p * done_pct as u64 / 100, TaskEnd::Failed { effect_unknown: false }),
                            _ => (p * done_pct as u64 / 100, TaskEnd::Failed { effect_unknown: true }),
                        };
                        let report = TaskReport { planned: p, done, end };
                        m.tasks[i] = RefTask::Ended(report);
                        if end != TaskEnd::Complete && m.first_failure.is_none() {
                            m.first_failure = Some(if end == TaskEnd::Short { OutcomeCode::ShortCompletion } else { OutcomeCode::Failed });
                        }
                        let e = sut.active_mut(m.seq).expect("running task implies active execution");
                        let retired = e.task_ended(i as u32, report).unwrap();
                        prop_assert_eq!(retired, m.retired());
                    }
                }
                Op::Cancel | Op::Expire => {
                    if let Some(m) = model.as_mut() {
                        if m.retired() { continue; }
                        if m.stopped.is_none() && m.first_failure.is_none() && m.any_not_started() {
                            m.stopped = Some(if matches!(op, Op::Cancel) { OutcomeCode::Cancelled } else { OutcomeCode::TimedOut });
                        }
                        let e = sut.active_mut(m.seq).unwrap();
                        let retired = if matches!(op, Op::Cancel) { e.cancel() } else { e.expire() };
                        prop_assert_eq!(retired, m.retired());
                    }
                }
                Op::Release => {
                    let got = sut.check_release();
                    prop_assert_eq!(got.is_ok(), !model_active);
                    released = got.is_ok();
                }
            }
            // Invariants after every step.
            match (&model, sut.status()) {
                (None, s) => prop_assert_eq!(s, TransferStatus::NotPosted),
                (Some(m), TransferStatus::Retired(r)) => {
                    prop_assert!(m.retired(), "terminal only after retirement");
                    prop_assert_eq!(r.outcome, m.outcome());
                    let started = m.tasks.iter().filter(|t| **t != RefTask::NotStarted).count() as u32;
                    prop_assert_eq!(r.receipt.tasks_started, started);
                    prop_assert_eq!(r.receipt.tasks_never_started, n - started);
                }
                (Some(m), TransferStatus::InProgress { transferred_bytes, .. }) => {
                    prop_assert!(!m.retired());
                    let done: u64 = m.tasks.iter().map(|t| if let RefTask::Ended(r) = t { r.done } else { 0 }).sum();
                    prop_assert_eq!(transferred_bytes, done);
                }
                (Some(_), TransferStatus::NotPosted) => prop_assert!(false, "posted transfer reported NotPosted"),
            }
        }
    }
}
