//! Every lifecycle rule of the engine, made deterministic with the local
//! route's fault hooks (withheld, short and failed tasks).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use orbite_core::fault::FaultDirective;
use orbite_core::*;

fn phase(t: &Transfer) -> Option<ExecutionPhase> {
    match t.check() {
        TransferStatus::InProgress { phase, .. } => Some(phase),
        _ => None,
    }
}

fn counting_borrow(engine: &TransferEngine, buf: &mut [u8], counter: &Arc<AtomicUsize>) -> RegistrationId {
    let c = counter.clone();
    // SAFETY: every test keeps `buf` alive until the counter shows the
    // owner was released (or until the engine is gone).
    let range = unsafe { MemoryRange::borrowed(buf.as_mut_ptr(), buf.len(), Permission::RemoteReadWrite) }
        .with_owner_release(Box::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
        }));
    engine.register_memory_ranges(vec![range]).unwrap()[0]
}

#[test]
fn release_is_refused_while_active_and_keeps_every_owner() {
    let e = engine("{}");
    let base = e.stats();
    let a = region(&e, 8192, Permission::RemoteReadWrite);
    let b = region(&e, 8192, Permission::RemoteReadWrite);
    fill(&a.mem, 1);
    e.fault_hooks().hold_all(true);
    let t = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 0, 8192)], &[Desc::new(b.id, 0, 8192)])).unwrap();
    t.post().unwrap();
    assert!(e.fault_hooks().wait_held(1, WAIT));
    let refused = t.release().unwrap_err();
    assert!(matches!(refused.error, BatchError::ExecutionActive { .. }));
    let t = refused.transfer;
    assert_eq!(phase(&t), Some(ExecutionPhase::Draining), "still pollable, still in progress");
    let s = e.stats();
    assert_eq!((s.prepared_transfers, s.executions, s.tasks_in_flight, s.bytes_in_flight), (1, 1, 1, 8192));
    // A held task has touched nothing.
    assert!(snapshot(&b.mem).iter().all(|x| *x == 0));
    e.fault_hooks().release_all();
    let r = wait_retired(&t);
    assert!(r.outcome.is_success());
    assert_eq!(r.receipt, RetirementReceipt { execution: 1, tasks_started: 1, tasks_never_started: 0 });
    assert_eq!(snapshot(&b.mem), snapshot(&a.mem));
    t.release().unwrap();
    e.deregister(a.id).unwrap();
    e.deregister(b.id).unwrap();
    drop((a, b));
    assert_eq!(e.stats(), base);
}

#[test]
fn cancel_of_queued_work_proves_it_never_started() {
    let e = engine(r#"{"max_tasks_in_flight": 1}"#);
    let a = region(&e, 8192, Permission::RemoteReadWrite);
    let b = region(&e, 8192, Permission::RemoteReadWrite);
    fill(&a.mem, 2);
    e.fault_hooks().hold_all(true);
    let t1 = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 0, 4096)], &[Desc::new(b.id, 0, 4096)])).unwrap();
    let t2 = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 4096, 4096)], &[Desc::new(b.id, 4096, 4096)])).unwrap();
    t1.post().unwrap();
    t2.post().unwrap();
    assert_eq!(phase(&t2), Some(ExecutionPhase::Queued));
    assert_eq!(e.stats().queued_executions, 1);
    assert!(e.fault_hooks().wait_held(1, WAIT));
    let s = t2.cancel().unwrap();
    let r = s.result().expect("queued cancel retires at once");
    assert_eq!(r.outcome.code, OutcomeCode::Cancelled);
    assert_eq!(r.outcome.remote_effect, RemoteEffect::None);
    assert_eq!(r.receipt.tasks_started, 0);
    assert_eq!(e.stats().queued_executions, 0);
    e.fault_hooks().release_all();
    assert!(wait_retired(&t1).outcome.is_success());
    // Give a wrongly started t2 every chance to show up, then check bytes.
    assert_idle(&e);
    assert!(snapshot(&b.mem)[4096..].iter().all(|x| *x == 0), "cancelled work wrote bytes");
    assert_eq!(e.fault_hooks().held().len(), 0);
}

#[test]
fn cancel_of_running_work_drains_and_reports_the_real_prefix() {
    let e = engine(r#"{"task_bytes": 4096, "max_tasks_in_flight": 1}"#);
    let a = region(&e, 12288, Permission::RemoteReadWrite);
    let b = region(&e, 12288, Permission::RemoteReadWrite);
    fill(&a.mem, 3);
    e.fault_hooks().hold_all(true);
    let t = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 0, 12288)], &[Desc::new(b.id, 0, 12288)])).unwrap();
    assert_eq!(t.shape(), (3, 3));
    t.post().unwrap();
    assert!(e.fault_hooks().wait_held(1, WAIT));
    assert_eq!(phase(&t), Some(ExecutionPhase::Running));
    let s = t.cancel().unwrap();
    assert!(matches!(s, TransferStatus::InProgress { phase: ExecutionPhase::Draining, .. }), "{s:?}");
    assert!(!t.wait(Duration::from_millis(30)).is_terminal(), "running work must drain first");
    e.fault_hooks().release_all();
    let r = wait_retired(&t);
    assert_eq!(r.outcome.code, OutcomeCode::Cancelled);
    assert_eq!((r.outcome.transferred_prefix, r.outcome.remote_effect), (4096, RemoteEffect::Known));
    assert_eq!((r.receipt.tasks_started, r.receipt.tasks_never_started), (1, 2));
    let (sa, sb) = (snapshot(&a.mem), snapshot(&b.mem));
    assert_eq!(&sb[..4096], &sa[..4096]);
    assert!(sb[4096..].iter().all(|x| *x == 0));
    assert!(matches!(t.post(), Err(Error::Batch(BatchError::RepostRefused { .. }))));
    assert_idle(&e);
}

#[test]
fn cancel_after_everything_started_ends_in_success() {
    let e = engine("{}");
    let a = region(&e, 4096, Permission::RemoteReadWrite);
    let b = region(&e, 4096, Permission::RemoteReadWrite);
    e.fault_hooks().hold_all(true);
    let t = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 0, 4096)], &[Desc::new(b.id, 0, 4096)])).unwrap();
    assert!(matches!(t.cancel(), Err(Error::Batch(BatchError::NotPosted))));
    t.post().unwrap();
    assert!(e.fault_hooks().wait_held(1, WAIT));
    t.cancel().unwrap();
    e.fault_hooks().release_all();
    assert_eq!(wait_retired(&t).outcome.code, OutcomeCode::Success);
}

#[test]
fn deregistration_during_an_admitted_transfer_fences_then_frees_after_retirement() {
    let e = engine("{}");
    let base = e.stats();
    let released = Arc::new(AtomicUsize::new(0));
    let mut dst = vec![0u8; 65536];
    let a = region(&e, 65536, Permission::RemoteReadWrite);
    fill(&a.mem, 4);
    let d = counting_borrow(&e, &mut dst, &released);
    let l = [Desc::new(a.id, 0, 65536)];
    let r = [Desc::new(d, 0, 65536)];
    let t = e.prepare(&spec(Op::Write, &l, &r)).unwrap();
    let t_other = e.prepare(&spec(Op::Write, &l, &r)).unwrap();
    e.fault_hooks().hold_all(true);
    t.post().unwrap();
    assert!(e.fault_hooks().wait_held(1, WAIT));
    e.deregister(d).unwrap();
    // New work is fenced at once.
    assert!(matches!(t_other.post(), Err(Error::Registry(RegistryError::Deregistered(id))) if id == d));
    assert!(matches!(e.prepare(&spec(Op::Write, &l, &r)), Err(Error::Registry(RegistryError::Stale(_)))));
    assert!(matches!(e.deregister(d), Err(Error::Registry(RegistryError::Stale(_)))));
    // The owner stays while borrowers remain.
    assert_eq!(released.load(Ordering::SeqCst), 0);
    assert_eq!(e.stats().fenced_registrations, 1);
    e.fault_hooks().release_all();
    assert!(wait_retired(&t).outcome.is_success(), "the admitted transfer completes");
    assert_eq!(&dst[..], &snapshot(&a.mem)[..]);
    assert_eq!(released.load(Ordering::SeqCst), 0, "prepared transfers still borrow it");
    t.release().unwrap();
    assert_eq!(released.load(Ordering::SeqCst), 0, "t_other still borrows it");
    drop(t_other);
    assert_eq!(released.load(Ordering::SeqCst), 1, "freed after the last borrower, exactly once");
    assert_eq!(e.stats().fenced_registrations, 0);
    e.deregister(a.id).unwrap();
    drop(a);
    assert_eq!(e.stats(), base);
    drop(e);
    assert_eq!(released.load(Ordering::SeqCst), 1);
}

#[test]
fn host_memory_is_freed_once_after_its_last_registration_and_borrower() {
    let e = engine("{}");
    let mem = e.allocate_host_memory(8192).unwrap();
    let b = region(&e, 8192, Permission::RemoteReadWrite);
    let id =
        e.register_memory_ranges(vec![MemoryRange::host(&mem, 0, 8192, Permission::LocalOnly).unwrap()]).unwrap()[0];
    let t = e.prepare(&spec(Op::Write, &[Desc::new(id, 0, 8192)], &[Desc::new(b.id, 0, 8192)])).unwrap();
    assert_eq!(e.stats().host_allocations, 2);
    e.fault_hooks().hold_all(true);
    t.post().unwrap();
    assert!(e.fault_hooks().wait_held(1, WAIT));
    drop(mem);
    e.deregister(id).unwrap();
    assert_eq!(e.stats().host_allocations, 2, "the transfer still holds the memory");
    e.fault_hooks().release_all();
    assert!(wait_retired(&t).outcome.is_success());
    assert_eq!(e.stats().host_allocations, 2, "the prepared transfer still holds the memory");
    t.release().unwrap();
    assert_eq!(e.stats().host_allocations, 1);
    assert_eq!(e.stats().host_memory_bytes, 8192);
}

#[test]
fn duplicate_aliases_have_their_own_owners() {
    let e = engine("{}");
    let base = e.stats();
    let (c1, c2) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut buf = vec![0u8; 4096];
    let id1 = counting_borrow(&e, &mut buf, &c1);
    let id2 = counting_borrow(&e, &mut buf, &c2);
    assert_ne!(id1, id2);
    assert_eq!(e.stats().registrations, 2);
    let src = region(&e, 4096, Permission::RemoteReadWrite);
    fill(&src.mem, 5);
    let t = e.prepare(&spec(Op::Write, &[Desc::new(src.id, 0, 4096)], &[Desc::new(id2, 0, 4096)])).unwrap();
    e.deregister(id1).unwrap();
    assert_eq!((c1.load(Ordering::SeqCst), c2.load(Ordering::SeqCst)), (1, 0), "only the first alias' owner goes");
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success(), "the other alias still works");
    assert_eq!(&buf[..], &snapshot(&src.mem)[..]);
    t.release().unwrap();
    e.deregister(id2).unwrap();
    e.deregister(src.id).unwrap();
    assert_eq!((c1.load(Ordering::SeqCst), c2.load(Ordering::SeqCst)), (1, 1));
    drop(src);
    assert_eq!(e.stats(), base);
}

#[test]
fn stale_and_unknown_ids_get_typed_errors() {
    let e = engine("{}");
    let a = region(&e, 4096, Permission::RemoteReadWrite);
    let b = region(&e, 4096, Permission::RemoteReadWrite);
    e.deregister(a.id).unwrap();
    let reused = region(&e, 4096, Permission::RemoteReadWrite);
    assert_ne!(reused.id, a.id, "a reused slot gets a new generation");
    let desc = |id| [Desc::new(id, 0, 16)];
    assert!(matches!(
        e.prepare(&spec(Op::Write, &desc(a.id), &desc(b.id))),
        Err(Error::Registry(RegistryError::Stale(id))) if id == a.id
    ));
    let unknown = RegistrationId::from_raw(0xFFFF_FFFF);
    assert!(matches!(e.deregister(unknown), Err(Error::Registry(RegistryError::Unknown(_)))));
    assert!(matches!(
        e.prepare(&spec(Op::Write, &desc(b.id), &desc(unknown))),
        Err(Error::Registry(RegistryError::Unknown(_)))
    ));
    assert_eq!(RegistrationId::from_raw(reused.id.to_raw()), reused.id);
}

#[test]
fn prepare_validates_everything_before_any_work() {
    let e = engine(r#"{"max_descriptors_per_transfer": 4, "max_transfer_bytes": 10000}"#);
    let base_prepared = e.stats().prepared_transfers;
    let a = region(&e, 8192, Permission::RemoteReadWrite);
    let ro = region(&e, 8192, Permission::RemoteRead);
    let lo = region(&e, 8192, Permission::LocalOnly);
    let d = |id, o, l| Desc::new(id, o, l);
    let cases: Vec<(Op, Vec<Desc>, Vec<Desc>, &str)> = vec![
        (Op::Write, vec![d(a.id, 0, 100)], vec![d(a.id, 0, 99)], "length mismatch"),
        (Op::Write, vec![d(a.id, 0, 0)], vec![d(ro.id, 0, 0)], "zero length"),
        (Op::Write, vec![d(a.id, 8000, 193)], vec![d(a.id, 0, 193)], "out of bounds"),
        (Op::Write, vec![d(a.id, u64::MAX, 2)], vec![d(a.id, 0, 2)], "overflow"),
        (Op::Write, vec![], vec![], "empty"),
        (Op::Write, vec![d(a.id, 0, 10)], vec![d(ro.id, 0, 10)], "write into read-only"),
        (Op::Read, vec![d(a.id, 0, 10)], vec![d(lo.id, 0, 10)], "read from local-only"),
        (Op::Write, vec![d(a.id, 0, 1); 5], vec![d(a.id, 0, 5)], "too many descriptors"),
        (
            Op::Write,
            vec![d(a.id, 0, 8000), d(lo.id, 0, 8000)],
            vec![d(a.id, 0, 8000), d(a.id, 0, 8000)],
            "too many bytes",
        ),
    ];
    for (op, l, r, what) in cases {
        let err = e.prepare(&spec(op, &l, &r)).expect_err(what);
        let ok = match what {
            "length mismatch" => matches!(err, Error::Batch(BatchError::LengthMismatch { local: 100, remote: 99 })),
            "write into read-only" | "read from local-only" => {
                matches!(err, Error::Batch(BatchError::PermissionDenied { .. }))
            }
            "too many descriptors" => {
                matches!(err, Error::ResourceExhausted { resource: Resource::DescriptorsPerTransfer, .. })
            }
            "too many bytes" => matches!(err, Error::ResourceExhausted { resource: Resource::TransferBytes, .. }),
            _ => matches!(err, Error::Batch(BatchError::InvalidDescriptor { .. })),
        };
        assert!(ok, "{what}: {err}");
        assert_eq!(e.stats().prepared_transfers, base_prepared, "{what}: a failed prepare keeps nothing");
    }
    // Reading from a RemoteRead target is allowed; a local-only local side is fine.
    assert!(e.prepare(&spec(Op::Read, &[d(lo.id, 0, 10)], &[d(ro.id, 0, 10)])).is_ok());
}

#[test]
fn short_completion_and_unknown_effect_end_in_error_only_after_retirement() {
    let e = engine(r#"{"task_bytes": 4096, "local_route_workers": 2}"#);
    let a = region(&e, 8192, Permission::RemoteReadWrite);
    let b = region(&e, 8192, Permission::RemoteReadWrite);
    fill(&a.mem, 6);
    // Short completion: 100 bytes land, nothing beyond them.
    e.fault_hooks().push(FaultDirective::Short { bytes: 100 });
    let t = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 0, 4096)], &[Desc::new(b.id, 0, 4096)])).unwrap();
    t.post().unwrap();
    let r = wait_retired(&t);
    assert_eq!(r.outcome.code, OutcomeCode::ShortCompletion);
    assert_eq!((r.outcome.transferred_prefix, r.outcome.remote_effect), (100, RemoteEffect::Known));
    let (sa, sb) = (snapshot(&a.mem), snapshot(&b.mem));
    assert_eq!(&sb[..100], &sa[..100]);
    assert!(sb[100..].iter().all(|x| *x == 0), "bytes beyond the short prefix were written");
    assert!(matches!(t.post(), Err(Error::Batch(BatchError::RepostRefused { .. }))), "no replay");
    drop(t);

    // Two tasks: the second fails with unknown effect while the first is
    // withheld. The failure is known but the status stays in progress.
    e.fault_hooks().push(FaultDirective::Hold);
    e.fault_hooks().push(FaultDirective::Fail { bytes: 10, effect_unknown: true });
    let t = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 0, 8192)], &[Desc::new(b.id, 0, 8192)])).unwrap();
    t.post().unwrap();
    assert!(e.fault_hooks().wait_held(1, WAIT));
    // Another request completing cannot retire this one.
    let other = e.prepare(&spec(Op::Read, &[Desc::new(a.id, 0, 16)], &[Desc::new(b.id, 0, 16)])).unwrap();
    other.post().unwrap();
    assert!(wait_retired(&other).outcome.is_success());
    std::thread::sleep(Duration::from_millis(20));
    assert!(matches!(t.check(), TransferStatus::InProgress { phase: ExecutionPhase::Draining, .. }));
    let t = t.release().unwrap_err().transfer;
    e.fault_hooks().release_all();
    let r = wait_retired(&t);
    assert_eq!(r.outcome.code, OutcomeCode::Failed);
    assert_eq!(r.outcome.remote_effect, RemoteEffect::Unknown);
    assert_eq!(r.outcome.transferred_prefix, 4096 + 10);
    assert!(matches!(t.post(), Err(Error::Batch(BatchError::RepostRefused { .. }))));
    assert_idle(&e);
}

#[test]
fn a_task_that_fails_at_once_does_not_cut_the_siblings_admitted_with_it() {
    // Every task fits the budget, so post admits all four in one pass; the
    // first one fails at once on a worker. Its siblings were admitted with
    // it and start: the outcome (which bytes moved) must not depend on how
    // fast a worker wakes. Many rounds, to give the race its chances.
    let e = engine(r#"{"task_bytes": 4096, "local_route_workers": 2}"#);
    let a = region(&e, 16384, Permission::RemoteReadWrite);
    let b = region(&e, 16384, Permission::RemoteReadWrite);
    fill(&a.mem, 9);
    for round in 0..200 {
        e.fault_hooks().hold_all(true);
        e.fault_hooks().push(FaultDirective::Short { bytes: 100 });
        let t = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 0, 16384)], &[Desc::new(b.id, 0, 16384)])).unwrap();
        t.post().unwrap();
        assert!(e.fault_hooks().wait_held(3, WAIT), "round {round}: the three siblings were not started");
        assert!(!t.check().is_terminal(), "round {round}: retired with three tasks held");
        e.fault_hooks().hold_all(false);
        e.fault_hooks().release_all();
        let r = wait_retired(&t);
        assert_eq!(r.outcome.code, OutcomeCode::ShortCompletion, "round {round}");
        assert_eq!(r.receipt.tasks_started, 4, "round {round}");
        drop(t);
    }
    assert_idle(&e);
}

#[test]
fn deadline_expires_queued_work_but_never_cuts_running_work() {
    let e = engine(r#"{"max_tasks_in_flight": 1}"#);
    let a = region(&e, 8192, Permission::RemoteReadWrite);
    let b = region(&e, 8192, Permission::RemoteReadWrite);
    fill(&a.mem, 7);
    e.fault_hooks().hold_all(true);
    let mut s = spec(Op::Write, &[], &[]);
    let (l1, r1) = ([Desc::new(a.id, 0, 4096)], [Desc::new(b.id, 0, 4096)]);
    let (l2, r2) = ([Desc::new(a.id, 4096, 4096)], [Desc::new(b.id, 4096, 4096)]);
    s.options.deadline = Some(Duration::from_millis(20));
    let t1 = e.prepare(&TransferSpec { local: &l1, remote: &r1, ..s }).unwrap();
    let t2 = e.prepare(&TransferSpec { local: &l2, remote: &r2, ..s }).unwrap();
    t1.post().unwrap(); // admitted and held: running
    t2.post().unwrap(); // queued behind it
    assert!(e.fault_hooks().wait_held(1, WAIT));
    std::thread::sleep(Duration::from_millis(40));
    let r2 = t2.check().result().expect("expired while queued");
    assert_eq!((r2.outcome.code, r2.outcome.remote_effect), (OutcomeCode::TimedOut, RemoteEffect::None));
    assert!(!t1.check().is_terminal(), "running work is not cut by its deadline");
    e.fault_hooks().release_all();
    assert_eq!(wait_retired(&t1).outcome.code, OutcomeCode::Success);
    assert_idle(&e);
    assert!(snapshot(&b.mem)[4096..].iter().all(|x| *x == 0));
    assert!(matches!(t2.post(), Err(Error::Batch(BatchError::RepostRefused { .. }))));
}

#[test]
fn progress_worker_expires_deadlines_for_callers_that_do_not_poll() {
    let e = engine(r#"{"max_tasks_in_flight": 1, "progress_worker": true, "progress_interval_us": 500}"#);
    let a = region(&e, 8192, Permission::RemoteReadWrite);
    let b = region(&e, 8192, Permission::RemoteReadWrite);
    e.fault_hooks().hold_all(true);
    let t1 = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 0, 4096)], &[Desc::new(b.id, 0, 4096)])).unwrap();
    let (l2, r2) = ([Desc::new(a.id, 4096, 4096)], [Desc::new(b.id, 4096, 4096)]);
    let mut s2 = spec(Op::Write, &l2, &r2);
    s2.options.deadline = Some(Duration::from_millis(10));
    let t2 = e.prepare(&s2).unwrap();
    t1.post().unwrap();
    t2.post().unwrap();
    // `status()` drives nothing; only the progress worker can expire t2.
    let start = std::time::Instant::now();
    while !t2.status().is_terminal() {
        assert!(start.elapsed() < WAIT, "progress worker did not expire the deadline");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(t2.status().result().unwrap().outcome.code, OutcomeCode::TimedOut);
    // t1's task may reach the worker late (slow machines, valgrind).
    assert!(e.fault_hooks().wait_held(1, WAIT));
    e.fault_hooks().hold_all(false);
    e.fault_hooks().release_all();
    assert!(wait_retired(&t1).outcome.is_success());
}

#[test]
fn budgets_fail_fast_with_typed_errors_and_leave_charges_unchanged() {
    let e = engine(
        r#"{"max_executions": 2, "admission_queue_len": 1, "max_tasks_in_flight": 1, "max_prepared_transfers": 4}"#,
    );
    let a = region(&e, 16384, Permission::RemoteReadWrite);
    let b = region(&e, 16384, Permission::RemoteReadWrite);
    e.fault_hooks().hold_all(true);
    let mk =
        |i: u64| e.prepare(&spec(Op::Write, &[Desc::new(a.id, i * 4096, 4096)], &[Desc::new(b.id, i * 4096, 4096)]));
    let (t1, t2, t3) = (mk(0).unwrap(), mk(1).unwrap(), mk(2).unwrap());
    let t4 = mk(3).unwrap();
    assert!(matches!(mk(0), Err(Error::ResourceExhausted { resource: Resource::PreparedTransfers, limit: 4, .. })));
    t1.post().unwrap(); // running (held)
    t2.post().unwrap(); // queued: the queue is now full
    assert!(e.fault_hooks().wait_held(1, WAIT));
    let before = e.stats();
    let err = t3.post().unwrap_err();
    assert!(matches!(err, Error::ResourceExhausted { resource: Resource::Executions, .. }), "{err}");
    assert_eq!(e.stats(), before, "a refused post admits and charges nothing");
    assert_eq!(t3.status(), TransferStatus::NotPosted);
    drop(t3);
    let e2 = engine(r#"{"admission_queue_len": 1, "max_tasks_in_flight": 1}"#);
    let c = region(&e2, 16384, Permission::RemoteReadWrite);
    e2.fault_hooks().hold_all(true);
    let mk2 = |i: u64| {
        e2.prepare(&spec(Op::Write, &[Desc::new(c.id, i * 4096, 4096)], &[Desc::new(c.id, 8192 + i * 4096, 4096)]))
    };
    let (u1, u2, u3) = (mk2(0).unwrap(), mk2(1).unwrap(), mk2(0).unwrap());
    u1.post().unwrap();
    u2.post().unwrap();
    assert!(e2.fault_hooks().wait_held(1, WAIT));
    let before = e2.stats();
    assert!(matches!(u3.post(), Err(Error::ResourceExhausted { resource: Resource::AdmissionQueue, limit: 1, .. })));
    assert_eq!(e2.stats(), before);
    e2.fault_hooks().hold_all(false);
    e2.fault_hooks().release_all();
    for u in [&u1, &u2] {
        assert!(wait_retired(u).outcome.is_success());
    }
    e.fault_hooks().hold_all(false);
    e.fault_hooks().release_all();
    for t in [&t1, &t2] {
        assert!(wait_retired(t).outcome.is_success());
    }
    drop(t4);
    // Registration and memory budgets.
    let e3 = engine(r#"{"max_registrations": 2, "max_registered_bytes": 10000, "max_host_memory_bytes": 65536}"#);
    let m = e3.allocate_host_memory(65536).unwrap();
    assert!(matches!(
        e3.allocate_host_memory(1),
        Err(Error::ResourceExhausted { resource: Resource::HostMemoryBytes, .. })
    ));
    let r = |o, l| MemoryRange::host(&m, o, l, Permission::LocalOnly).unwrap();
    let before = e3.stats();
    assert!(matches!(
        e3.register_memory_ranges(vec![r(0, 4000), r(0, 7000)]),
        Err(Error::ResourceExhausted { resource: Resource::RegisteredBytes, .. })
    ));
    assert!(matches!(
        e3.register_memory_ranges(vec![r(0, 1), r(0, 1), r(0, 1)]),
        Err(Error::ResourceExhausted { resource: Resource::Registrations, .. })
    ));
    assert_eq!(e3.stats(), before, "all or nothing");
    assert_eq!(e3.register_memory_ranges(vec![r(0, 4000), r(4000, 6000)]).unwrap().len(), 2);
}

#[test]
fn dropping_an_active_handle_retains_owners_until_retirement() {
    let e = engine("{}");
    let base = e.stats();
    let released = Arc::new(AtomicUsize::new(0));
    let mut dst = vec![0u8; 4096];
    let d = counting_borrow(&e, &mut dst, &released);
    let a = region(&e, 4096, Permission::RemoteReadWrite);
    fill(&a.mem, 8);
    e.fault_hooks().hold_all(true);
    let t = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 0, 4096)], &[Desc::new(d, 0, 4096)])).unwrap();
    t.post().unwrap();
    assert!(e.fault_hooks().wait_held(1, WAIT));
    e.deregister(d).unwrap();
    drop(t);
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(released.load(Ordering::SeqCst), 0, "dropping the handle freed memory in use");
    let s = e.stats();
    assert_eq!((s.prepared_transfers, s.executions, s.fenced_registrations), (1, 1, 1));
    e.fault_hooks().release_all();
    assert!(e.wait_idle(WAIT));
    assert_eq!(released.load(Ordering::SeqCst), 1);
    assert_eq!(&dst[..], &snapshot(&a.mem)[..], "the orphaned transfer still completed");
    e.deregister(a.id).unwrap();
    drop(a);
    assert_eq!(e.stats(), base);
}

#[test]
fn close_cancels_queued_work_and_reports_unquiesced_owners_instead_of_freeing_them() {
    let e = engine(r#"{"max_tasks_in_flight": 1}"#);
    let released = Arc::new(AtomicUsize::new(0));
    let mut dst = vec![0u8; 8192];
    let d = counting_borrow(&e, &mut dst, &released);
    let a = region(&e, 8192, Permission::RemoteReadWrite);
    e.fault_hooks().hold_all(true);
    let t1 = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 0, 4096)], &[Desc::new(d, 0, 4096)])).unwrap();
    let t2 = e.prepare(&spec(Op::Write, &[Desc::new(a.id, 4096, 4096)], &[Desc::new(d, 4096, 4096)])).unwrap();
    t1.post().unwrap();
    t2.post().unwrap();
    assert!(e.fault_hooks().wait_held(1, WAIT));
    let report = e.close_with_timeout(Duration::from_millis(50));
    assert!(!report.drained);
    assert_eq!(report.unquiesced.len(), 1);
    assert_eq!(report.unquiesced[0].transfer, t1.id());
    assert_eq!(t2.status().result().unwrap().outcome.code, OutcomeCode::Cancelled);
    assert_eq!(e.stats().unquiesced_owners, 1);
    // Fenced: nothing new is accepted.
    assert!(matches!(t2.post(), Err(Error::Closed)));
    assert!(matches!(e.prepare(&spec(Op::Write, &[Desc::new(a.id, 0, 1)], &[Desc::new(d, 0, 1)])), Err(Error::Closed)));
    assert!(matches!(e.allocate_host_memory(4096), Err(Error::Closed)));
    drop((t1, t2));
    assert_eq!(released.load(Ordering::SeqCst), 0, "unquiesced owners are retained, not freed");
    // If the withheld work finally ends, the owners go.
    e.fault_hooks().release_all();
    assert!(e.wait_idle(WAIT));
    assert_eq!(e.stats().unquiesced_owners, 0);
    assert_eq!(released.load(Ordering::SeqCst), 1);
}

#[test]
fn close_of_an_idle_engine_drains_and_frees_everything() {
    let e = engine("{}");
    let released = Arc::new(AtomicUsize::new(0));
    let mut buf = vec![0u8; 4096];
    let _id = counting_borrow(&e, &mut buf, &released);
    let report = e.close();
    assert!(report.drained && report.unquiesced.is_empty());
    assert_eq!(released.load(Ordering::SeqCst), 1, "close deregisters");
    assert_eq!(e.stats(), Stats::default());
}

fn admitted(ts: &[(&str, &Transfer)]) -> Vec<String> {
    ts.iter().filter(|(_, t)| phase(t) != Some(ExecutionPhase::Queued)).map(|(n, _)| n.to_string()).collect()
}

#[test]
fn admission_serves_intents_in_priority_order_without_starving_prefetch() {
    let e = engine(r#"{"max_tasks_in_flight": 1, "anti_starvation_after": 2}"#);
    let a = region(&e, 1 << 16, Permission::RemoteReadWrite);
    e.fault_hooks().hold_all(true);
    let mk = |i: u64, intent| {
        let mut s = spec(Op::Write, &[], &[]);
        s.options.intent = intent;
        let l = [Desc::new(a.id, i * 64, 64)];
        let r = [Desc::new(a.id, 32768 + i * 64, 64)];
        e.prepare(&TransferSpec { local: &l, remote: &r, ..s }).unwrap()
    };
    let first = mk(0, Intent::Normal);
    first.post().unwrap();
    assert!(e.fault_hooks().wait_held(1, WAIT));
    let p = mk(1, Intent::Prefetch);
    let n = mk(2, Intent::Normal);
    let c: Vec<Transfer> = (3..7).map(|i| mk(i, Intent::DecodeCritical)).collect();
    p.post().unwrap();
    n.post().unwrap();
    for t in &c {
        t.post().unwrap();
    }
    let named: Vec<(&str, &Transfer)> =
        vec![("p", &p), ("n", &n), ("c0", &c[0]), ("c1", &c[1]), ("c2", &c[2]), ("c3", &c[3])];
    let mut order = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    for _ in 0..6 {
        let held = e.fault_hooks().held();
        assert_eq!(held.len(), 1);
        e.fault_hooks().release(held[0], FaultDirective::Run);
        assert!(e.fault_hooks().wait_held(1, WAIT) || order.len() == 5);
        let now = admitted(&named);
        for x in &now {
            if !seen.contains(x) {
                order.push(x.clone());
            }
        }
        seen = now;
    }
    // Decode-critical first; after two bypasses both lower classes are
    // starving: the lowest goes first on a tie, then the other, then the
    // remaining decode-critical work.
    assert_eq!(order, vec!["c0", "c1", "p", "n", "c2", "c3"], "admission order");
    e.fault_hooks().release_all();
    assert_idle(&e);
}

#[test]
fn bounded_notification_drain_keeps_what_it_does_not_take() {
    let e = engine("{}");
    let base = e.stats();
    for p in [&b"one"[..], b"a longer payload", b"x"] {
        e.notify_self(p).unwrap();
    }
    let mut budget = 10usize;
    let first = e.take_notifications_while(|n| {
        let fits = n.payload.len() <= budget;
        budget = budget.saturating_sub(n.payload.len());
        fits
    });
    assert_eq!(first.iter().map(|n| &n.payload[..]).collect::<Vec<_>>(), [&b"one"[..]]);
    assert!(e.take_notifications_while(|_| false).is_empty());
    let rest = e.take_notifications();
    assert_eq!(rest.iter().map(|n| &n.payload[..]).collect::<Vec<_>>(), [&b"a longer payload"[..], b"x"]);
    assert_eq!(e.stats(), base);
}

#[test]
fn binding_handles_are_bounded_and_refunded() {
    let e = engine(r#"{"max_binding_handles": 3}"#);
    let base = e.stats();
    let a = e.charge_binding_handles(2).unwrap();
    assert_eq!(e.stats().binding_handles, 2);
    let err = e.charge_binding_handles(2).unwrap_err();
    assert!(matches!(err, Error::ResourceExhausted { resource: Resource::BindingHandles, limit: 3, .. }));
    assert_eq!(e.stats().binding_handles, 2, "a refused charge takes nothing");
    drop(a);
    assert_eq!(e.stats(), base);
}
