//! Metadata refresh: registrations a peer makes (or removes) after this
//! engine opened it are found (or fenced) by asking the peer what changed,
//! on the existing connection; a re-registration of the same range is
//! reached by address; prepared transfers keep what they resolved.

mod common;

use std::time::{Duration, Instant};

use common::*;
use orbite_core::*;

fn target() -> TransferEngine {
    engine(r#"{"listen": "127.0.0.1:0", "route": "tcp"}"#)
}

fn initiator() -> TransferEngine {
    engine(r#"{"route": "tcp", "peer_timeout_ms": 10000}"#)
}

fn open(i: &TransferEngine, t: &TransferEngine) -> RemoteSegment {
    i.open_segment(&t.endpoint().unwrap(), Some(t.source_epoch()), WAIT).unwrap()
}

/// One registration over all of `mem`, which peers may read and write.
fn register_all(t: &TransferEngine, mem: &HostMemory) -> RegistrationId {
    t.register_memory_ranges(vec![MemoryRange::host(mem, 0, mem.len(), Permission::RemoteReadWrite).unwrap()]).unwrap()
        [0]
}

fn write(i: &TransferEngine, seg: &RemoteSegment, local: RegistrationId, remote: Desc) -> TransferResult {
    let l = [Desc::new(local, 0, remote.len)];
    let r = [remote];
    let t = i.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(seg))).unwrap();
    t.post().unwrap();
    let res = t.wait(WAIT).result().expect("retired");
    t.release().unwrap();
    res
}

#[test]
fn a_registration_made_after_open_is_found_and_written() {
    let (t, i) = (target(), initiator());
    let seg = open(&i, &t);
    let late = region(&t, 1 << 20, Permission::RemoteReadWrite);
    let src = region(&i, 1 << 20, Permission::LocalOnly);
    fill(&src.mem, 3);
    let addr = late.mem.as_ptr() as u64;
    let found = i.find_remote_registration(&seg, addr + 4096, 8192, |_| true).unwrap();
    assert_eq!((found.id, found.addr, found.len), (late.id, addr, 1 << 20));
    let res = write(&i, &seg, src.id, Desc::new(late.id, 0, 1 << 20));
    assert!(res.outcome.is_success(), "{res:?}");
    assert_eq!(snapshot(&late.mem), snapshot(&src.mem));
    // Prepare also asks the peer about an id its view lacks.
    let later = region(&t, 4096, Permission::RemoteReadWrite);
    let res = write(&i, &seg, src.id, Desc::new(later.id, 0, 4096));
    assert!(res.outcome.is_success(), "{res:?}");
    assert_eq!(snapshot(&later.mem)[..], snapshot(&src.mem)[..4096]);
    assert_eq!(i.stats().executions, 0);
    assert_eq!(i.stats().prepared_transfers, 0);
}

#[test]
fn a_range_the_peer_does_not_confirm_is_refused_before_admission() {
    let (t, i) = (target(), initiator());
    let seg = open(&i, &t);
    let base = i.stats();
    let err = i.find_remote_registration(&seg, 0x1000, 4096, |_| true).unwrap_err();
    assert!(matches!(err, Error::Peer(PeerError::RangeNotRegistered { .. })), "{err}");
    let local_only = region(&t, 4096, Permission::LocalOnly);
    let err = i.find_remote_registration(&seg, local_only.mem.as_ptr() as u64, 4096, |_| true).unwrap_err();
    assert!(matches!(err, Error::Peer(PeerError::RangeNotRegistered { .. })), "local-only is not exported: {err}");
    let src = region(&i, 4096, Permission::LocalOnly);
    let l = [Desc::new(src.id, 0, 4096)];
    let r = [Desc::new(RegistrationId::from_raw(777), 0, 4096)];
    let err = i.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap_err();
    assert!(matches!(err, Error::Peer(PeerError::UnknownRemoteRegistration(_))), "{err}");
    let mut after = i.stats();
    after.registrations -= 1;
    after.registered_bytes -= 4096;
    after.host_allocations -= 1;
    after.host_memory_bytes -= 4096;
    assert_eq!(after, base, "nothing admitted or kept");
}

#[test]
fn deregistered_ranges_are_fenced_in_the_refreshed_view_while_prepared_transfers_keep_theirs() {
    let (t, i) = (target(), initiator());
    let r1 = region(&t, 65536, Permission::RemoteReadWrite);
    let seg = open(&i, &t);
    let src = region(&i, 65536, Permission::LocalOnly);
    let l = [Desc::new(src.id, 0, 65536)];
    let rd = [Desc::new(r1.id, 0, 65536)];
    let prepared = i.prepare(&TransferSpec::new(Op::Write, &l, &rd, Target::Peer(&seg))).unwrap();
    t.deregister(r1.id).unwrap();
    i.refresh_segment(&seg).unwrap();
    let (regs, _) = seg.registrations();
    assert!(regs.iter().all(|r| r.id != r1.id), "fenced in the view");
    let err = i.prepare(&TransferSpec::new(Op::Write, &l, &rd, Target::Peer(&seg))).unwrap_err();
    assert!(matches!(err, Error::Peer(PeerError::UnknownRemoteRegistration(_))), "{err}");
    // The transfer prepared before keeps what it resolved: the peer itself
    // refuses it, before any byte moves.
    prepared.post().unwrap();
    let res = prepared.wait(WAIT).result().expect("retired");
    assert!(!res.outcome.is_success());
    assert_eq!(res.outcome.remote_effect, RemoteEffect::None, "{res:?}");
    prepared.release().unwrap();
    assert_eq!(i.stats().executions, 0);
}

#[test]
fn the_same_range_registered_again_is_reached_by_address_without_an_explicit_refresh() {
    let (t, i) = (target(), initiator());
    let mem = t.allocate_host_memory(1 << 20).unwrap();
    let reg = |t: &TransferEngine| register_all(t, &mem);
    let first = reg(&t);
    let seg = open(&i, &t);
    let addr = mem.as_ptr() as u64;
    let by_addr = |i: &TransferEngine| i.resolve_remote_ranges(&seg, Op::Write, &[(addr + 100, 1000)]).unwrap();
    assert_eq!(by_addr(&i)[0], Desc::new(first, 100, 1000));
    t.deregister(first).unwrap();
    let second = reg(&t);
    assert_ne!(first, second);
    // The peer announces its changes on the watch connection: the next
    // lookup refreshes and finds the new registration of that range.
    let deadline = Instant::now() + Duration::from_secs(5);
    while by_addr(&i)[0].registration != second {
        assert!(Instant::now() < deadline, "the re-registration was never seen");
        std::thread::sleep(Duration::from_millis(1));
    }
    let src = region(&i, 1000, Permission::LocalOnly);
    fill(&src.mem, 9);
    let res = write(&i, &seg, src.id, by_addr(&i)[0]);
    assert!(res.outcome.is_success(), "{res:?}");
    assert_eq!(snapshot(&mem)[100..1100], snapshot(&src.mem)[..]);
    t.deregister(second).unwrap();
}

#[test]
fn a_range_registered_again_before_the_peer_announced_it_is_reached_by_address() {
    // A same-host peer: its one-sided routes borrow the ranges at prepare,
    // so a registration the view still names but the peer gave up is
    // refused there.
    let t = engine(r#"{"listen": "127.0.0.1:0"}"#);
    let i = engine(r#"{"peer_timeout_ms": 10000}"#);
    let mem = t.allocate_host_memory(1 << 20).unwrap();
    let reg = |t: &TransferEngine| register_all(t, &mem);
    let first = reg(&t);
    let seg = open(&i, &t);
    let ranges = [(mem.as_ptr() as u64 + 100, 1000)];
    let resolved = |i: &TransferEngine| i.resolve_remote_ranges(&seg, Op::Write, &ranges).unwrap()[0].registration;
    assert_eq!(resolved(&i), first);
    let src = region(&i, 1000, Permission::LocalOnly);
    fill(&src.mem, 11);
    let local = [Desc::new(src.id, 0, 1000)];
    let spec = TransferSpec::new(Op::Write, &local, &[], Target::Peer(&seg));

    // The peer deregisters the range and registers it again, and its
    // announcement has not arrived: the view still names the first
    // registration.
    t.withhold_watch_pushes_for_tests(true);
    t.deregister(first).unwrap();
    let second = reg(&t);
    assert_eq!(resolved(&i), first);
    // The peer refuses it at prepare; the view is refreshed and the range
    // resolved again, to the registration that now covers it.
    let x = i.prepare_by_address(&spec, &ranges).unwrap();
    assert!(matches!(x.route().route, Route::Cma | Route::Shm), "{:?}", x.route());
    x.post().unwrap();
    let res = x.wait(WAIT).result().expect("retired");
    assert!(res.outcome.is_success(), "{res:?}");
    x.release().unwrap();
    assert_eq!(snapshot(&mem)[100..1100], snapshot(&src.mem)[..]);
    assert_eq!(resolved(&i), second);

    // A range given up without a new registration is refused after the
    // one refresh, with the range named.
    t.deregister(second).unwrap();
    match i.prepare_by_address(&spec, &ranges) {
        Err(Error::Peer(PeerError::RangeNotRegistered { addr, len })) => assert_eq!((addr, len), ranges[0]),
        other => panic!("{:?}", other.map(|_| ())),
    }
    // Only a peer's memory is named by address.
    let own = TransferSpec::new(Op::Write, &local, &[], Target::Loopback);
    assert!(matches!(i.prepare_by_address(&own, &ranges), Err(Error::NotSupported(_))));
    t.withhold_watch_pushes_for_tests(false);
    assert_eq!((i.stats().executions, i.stats().prepared_transfers), (0, 0));
}

#[test]
fn a_tcp_request_refused_for_a_lapsed_registration_makes_the_next_lookup_refresh() {
    // tcp borrows nothing at prepare: a registration the view still names
    // but the peer gave up is refused when the request runs.
    let (t, i) = (target(), initiator());
    let mem = t.allocate_host_memory(1 << 20).unwrap();
    let reg = |t: &TransferEngine| register_all(t, &mem);
    let first = reg(&t);
    let seg = open(&i, &t);
    let ranges = [(mem.as_ptr() as u64 + 100, 1000)];
    let resolved = |i: &TransferEngine| i.resolve_remote_ranges(&seg, Op::Write, &ranges).unwrap()[0].registration;
    let src = region(&i, 1000, Permission::LocalOnly);
    fill(&src.mem, 12);
    let local = [Desc::new(src.id, 0, 1000)];
    let spec = TransferSpec::new(Op::Write, &local, &[], Target::Peer(&seg));
    t.withhold_watch_pushes_for_tests(true);
    t.deregister(first).unwrap();
    let second = reg(&t);
    let run = |x: Transfer| {
        assert_eq!(x.route().route, Route::Tcp);
        x.post().unwrap();
        let res = x.wait(WAIT).result().expect("retired");
        x.release().unwrap();
        res
    };
    // Resolved from the view that lags: refused, nothing written.
    let res = run(i.prepare_by_address(&spec, &ranges).unwrap());
    assert!(!res.outcome.is_success(), "{res:?}");
    assert_eq!(res.outcome.remote_effect, RemoteEffect::None, "{res:?}");
    assert!(snapshot(&mem)[100..1100].iter().all(|&b| b == 0));
    // The refusal says the view lags: the next lookup asks the peer, with
    // no push yet.
    assert_eq!(resolved(&i), second);
    let res = run(i.prepare_by_address(&spec, &ranges).unwrap());
    assert!(res.outcome.is_success(), "{res:?}");
    assert_eq!(snapshot(&mem)[100..1100], snapshot(&src.mem)[..]);
    t.withhold_watch_pushes_for_tests(false);
    assert_eq!((i.stats().executions, i.stats().prepared_transfers), (0, 0));
}

#[test]
fn large_changes_arrive_in_pages_that_fit_the_frame_limit() {
    let t = target();
    // Small frames on the initiator: 300 new registrations take several
    // pages (about 40 bytes each in 4 KiB replies).
    let i = engine(r#"{"route": "tcp", "max_frame_body": 4096, "max_notification_bytes": 1024}"#);
    let seg = open(&i, &t);
    let mem = t.allocate_host_memory(300 * 4096).unwrap();
    let ranges = (0..300).map(|k| MemoryRange::host(&mem, k * 4096, 4096, Permission::RemoteRead).unwrap()).collect();
    let ids = t.register_memory_ranges(ranges).unwrap();
    i.refresh_segment(&seg).unwrap();
    let (regs, version) = seg.registrations();
    assert_eq!(regs.len(), 300);
    assert!(ids.iter().all(|id| regs.iter().any(|r| r.id == *id)));
    // Deregistering half of them: the view follows.
    for id in &ids[..150] {
        t.deregister(*id).unwrap();
    }
    i.refresh_segment(&seg).unwrap();
    let (regs, later) = seg.registrations();
    assert_eq!(regs.len(), 150);
    assert!(later > version);
}

#[test]
fn a_restarted_peer_on_the_same_endpoint_is_a_new_identity() {
    let t = target();
    let i = initiator();
    let seg = open(&i, &t);
    let endpoint = t.endpoint().unwrap();
    t.close();
    drop(t);
    // The old segment's refresh fails: its peer is gone.
    let err = i.refresh_segment(&seg).unwrap_err();
    assert!(matches!(err, Error::Peer(_)), "{err}");
    let t2 = engine(&format!(r#"{{"listen": "{endpoint}"}}"#));
    let err = i.open_segment(&endpoint, Some(seg.epoch()), WAIT).unwrap_err();
    assert!(matches!(err, Error::Peer(PeerError::EpochMismatch { .. })), "{err}");
    assert!(i.open_segment(&endpoint, Some(t2.source_epoch()), WAIT).is_ok());
}
