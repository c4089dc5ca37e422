//! Two engines in two processes over TCP: bytes, guards, charges, peer
//! loss, epochs, segment close and notifications.

mod common;
mod peer;

use std::time::{Duration, Instant};

use common::*;
use orbite_core::*;
use peer::{PeerProcess, REGION};

#[test]
fn peer_process_entry() {
    peer::entry();
}

fn initiator() -> TransferEngine {
    // The TCP route is forced: peers here are on the same host, where auto
    // would pick a one-sided route.
    // A generous peer timeout: tests hold requests at the target, and CI runs
    // this binary under valgrind, where everything is much slower.
    engine(r#"{"listen": "127.0.0.1:0", "task_bytes": 262144, "peer_timeout_ms": 30000, "route": "tcp"}"#)
}

/// N01 (TCP): fragmented lists both ways, guards around every range,
/// charges back to baseline only after drain.
#[test]
fn n01_fragmented_write_and_read_with_guards_and_charges() {
    let mut p = PeerProcess::spawn();
    let e = initiator();
    let base = e.stats();
    let seg = p.open(&e);
    let local = region(&e, REGION, Permission::RemoteReadWrite);
    let mut remote_bytes = PeerProcess::initial(0xAB);
    for (round, op) in [Op::Write, Op::Read, Op::Write, Op::Read].into_iter().enumerate() {
        let mut rng = Rng(round as u64 + 1);
        let (total, ll, rl) = paired_layouts(&mut rng, 300_000, 3_000_000, 200_000, REGION as u64);
        fill(&local.mem, 100 + round as u64);
        let before_local = snapshot(&local.mem);
        let (l, r) = (descs(local.id, &ll), descs(p.region, &rl));
        let t = e.prepare(&TransferSpec::new(op, &l, &r, Target::Peer(&seg))).unwrap();
        t.post().unwrap();
        let res = wait_retired(&t);
        assert_eq!(res.outcome.code, OutcomeCode::Success, "{op:?}: {res:?}");
        assert_eq!(res.outcome.transferred_prefix, total);
        match op {
            Op::Write => {
                remote_bytes = expected(&before_local, &ll, &remote_bytes, &rl);
                assert_eq!(p.hash(0, REGION), fnv(&remote_bytes), "remote bytes or guards differ after WRITE");
                assert_eq!(snapshot(&local.mem), before_local);
            }
            Op::Read => {
                let want = expected(&remote_bytes, &rl, &before_local, &ll);
                assert_eq!(snapshot(&local.mem), want, "local bytes or guards differ after READ");
                assert_eq!(p.hash(0, REGION), fnv(&remote_bytes));
            }
        }
        assert_eq!(e.stats().executions, 0);
        t.release().unwrap();
    }
    // Merged aliases: one list names the region and an alias of it; the
    // bytes land where the alias maps them.
    fill(&local.mem, 77);
    let l = [Desc::new(local.id, 0, 3000), Desc::new(local.id, 3000, 5000)];
    let r = [Desc::new(p.alias, 10, 3000), Desc::new(p.region, peer::ALIAS_OFFSET as u64 + 3010, 5000)];
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    let at = peer::ALIAS_OFFSET + 10;
    remote_bytes[at..at + 8000].copy_from_slice(&snapshot(&local.mem)[..8000]);
    assert_eq!(p.hash(0, REGION), fnv(&remote_bytes), "alias bytes or guards differ");
    t.release().unwrap();
    e.deregister(local.id).unwrap();
    drop(local);
    e.close_segment(&seg, WAIT).unwrap();
    drop(seg);
    assert_eq!(e.stats(), base);
    // The target's loans are gone too: only its four registrations remain
    // (region, read-only, alias, shared) over four allocations (those and
    // its notification inbox).
    assert_eq!(p.ask("stats"), "STATS 4 0 4 0");
}

/// The target fences a deregistered range at once but frees it only after
/// an in-flight remote WRITE that borrows it has landed.
#[test]
fn target_deregistration_waits_for_remote_borrowers() {
    let mut p = PeerProcess::spawn();
    let e = initiator();
    let seg = p.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    fill(&local.mem, 3);
    // One task (below task_bytes): one request, held at the target.
    let (l, r) = ([Desc::new(local.id, 0, 65536)], [Desc::new(p.region, 0, 65536)]);
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    let t2 = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    assert_eq!(p.ask("hold on"), "OK");
    t.post().unwrap();
    assert_eq!(p.ask("wait_held 1"), "OK"); // the request reaches the target and is held
    assert_eq!(p.ask("dereg"), "OK");
    assert_eq!(p.ask("drop_region"), "OK");
    // Fenced (1), still registered (4: read-only, alias, shared, the fenced
    // region), memory alive (4, the inbox included).
    assert_eq!(p.ask("stats"), "STATS 4 1 4 0");
    assert!(!t.check().is_terminal());
    assert_eq!(p.ask("hold off"), "OK");
    assert!(wait_retired(&t).outcome.is_success());
    // Loans released after landing: the fenced registration is gone; the
    // memory stays for the alias that still covers it.
    assert_eq!(p.ask("stats"), "STATS 3 0 4 0");
    // New requests against the deregistered range are refused by the target.
    t2.post().unwrap();
    let r2 = wait_retired(&t2);
    assert_eq!((r2.outcome.code, r2.outcome.remote_effect), (OutcomeCode::Failed, RemoteEffect::None));
}

/// N05: close a segment during an admitted copy; restart the peer with a
/// new epoch; another peer is unaffected.
#[test]
fn n05_segment_close_and_peer_restart() {
    let mut a = PeerProcess::spawn();
    let b = PeerProcess::spawn();
    let e = initiator();
    let seg_a = a.open(&e);
    let seg_a2 = a.open(&e);
    let seg_b = b.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    fill(&local.mem, 4);
    let l = [Desc::new(local.id, 0, 65536)];
    let ra = [Desc::new(a.region, 0, 65536)];
    let rb = [Desc::new(b.region, 0, 65536)];
    let t1 = e.prepare(&TransferSpec::new(Op::Write, &l, &ra, Target::Peer(&seg_a))).unwrap();
    let t2 = e.prepare(&TransferSpec::new(Op::Write, &l, &ra, Target::Peer(&seg_a))).unwrap();
    let t3 = e.prepare(&TransferSpec::new(Op::Write, &l, &ra, Target::Peer(&seg_a2))).unwrap();
    let tb = e.prepare(&TransferSpec::new(Op::Write, &l, &rb, Target::Peer(&seg_b))).unwrap();
    assert_eq!(a.ask("hold on"), "OK");
    t1.post().unwrap();
    let closed = e.close_segment(&seg_a, Duration::from_millis(100));
    assert!(matches!(closed, Err(Error::Peer(PeerError::CloseFailed(_)))), "{closed:?}");
    assert!(matches!(t2.post(), Err(Error::Peer(PeerError::SegmentClosed))));
    assert!(!t1.check().is_terminal(), "the admitted copy stays pollable");
    tb.post().unwrap();
    assert!(wait_retired(&tb).outcome.is_success(), "another peer is unaffected");
    assert_eq!(a.ask("hold off"), "OK");
    assert!(wait_retired(&t1).outcome.is_success(), "the admitted copy finishes");
    let again = e.close_segment(&seg_a, WAIT);
    assert_eq!(format!("{again:?}"), format!("{closed:?}"), "a failed close is sticky, never retried");
    // Restart the peer on the same endpoint: a new epoch, a new identity.
    let endpoint = a.endpoint.clone();
    let old_epoch = a.epoch;
    a.kill();
    let a2 = PeerProcess::spawn_on(&endpoint);
    assert_ne!(a2.epoch, old_epoch);
    assert!(matches!(
        e.open_segment(&endpoint, Some(old_epoch), WAIT),
        Err(Error::Peer(PeerError::EpochMismatch { .. }))
    ));
    let seg_new = a2.open(&e);
    assert!(
        matches!(t3.post(), Err(Error::Peer(PeerError::EpochMismatch { expected, found })) if expected == old_epoch && found == a2.epoch),
        "work prepared for the old epoch cannot run"
    );
    let ra2 = [Desc::new(a2.region, 0, 65536)];
    let t4 = e.prepare(&TransferSpec::new(Op::Write, &l, &ra2, Target::Peer(&seg_new))).unwrap();
    t4.post().unwrap();
    assert!(wait_retired(&t4).outcome.is_success(), "the new epoch works");
    drop(b);
}

fn kill_mid_transfer(op: Op) {
    let mut p = PeerProcess::spawn();
    let other = PeerProcess::spawn();
    let e = initiator();
    let base = e.stats();
    let seg = p.open(&e);
    let seg_other = other.open(&e);
    let local = region(&e, REGION, Permission::RemoteReadWrite);
    fill(&local.mem, 6);
    let before = snapshot(&local.mem);
    let (l, r) = ([Desc::new(local.id, 0, REGION as u64)], [Desc::new(p.region, 0, REGION as u64)]);
    let t = e.prepare(&TransferSpec::new(op, &l, &r, Target::Peer(&seg))).unwrap();
    assert_eq!(p.ask("hold on"), "OK");
    t.post().unwrap();
    assert_eq!(p.ask("wait_held 1"), "OK");
    let killed = Instant::now();
    p.kill();
    let res = wait_retired(&t);
    assert!(killed.elapsed() < Duration::from_secs(5), "failure took {:?}", killed.elapsed());
    assert_eq!(res.outcome.code, OutcomeCode::Failed);
    match op {
        Op::Write => assert_eq!(res.outcome.remote_effect, RemoteEffect::Unknown, "{res:?}"),
        Op::Read => {
            assert_ne!(res.outcome.remote_effect, RemoteEffect::Unknown);
            let n = res.outcome.transferred_prefix as usize;
            assert_eq!(&snapshot(&local.mem)[n..], &before[n..], "bytes beyond the prefix were written");
        }
    }
    assert!(res.outcome.transferred_prefix < REGION as u64);
    assert!(matches!(t.post(), Err(Error::Batch(BatchError::RepostRefused { .. }))), "no replay");
    assert!(seg.lost().is_some());
    let t_new = e.prepare(&TransferSpec::new(op, &l, &r, Target::Peer(&seg)));
    assert!(matches!(t_new, Err(Error::Peer(PeerError::Lost(_)))));
    // Another peer is unaffected.
    let ro = [Desc::new(other.region, 0, 4096)];
    let lo = [Desc::new(local.id, 0, 4096)];
    let t2 = e.prepare(&TransferSpec::new(Op::Write, &lo, &ro, Target::Peer(&seg_other))).unwrap();
    t2.post().unwrap();
    assert!(wait_retired(&t2).outcome.is_success());
    drop((t, t2));
    e.deregister(local.id).unwrap();
    drop(local);
    e.close_segment(&seg, WAIT).unwrap();
    e.close_segment(&seg_other, WAIT).unwrap();
    drop((seg, seg_other));
    assert_eq!(e.stats(), base);
}

#[test]
fn peer_killed_mid_write() {
    kill_mid_transfer(Op::Write);
}

#[test]
fn peer_killed_mid_read() {
    kill_mid_transfer(Op::Read);
}

/// A peer that stops answering (not dead) is lost after `peer_timeout_ms`.
#[test]
fn hung_peer_fails_within_the_configured_bound() {
    let p = PeerProcess::spawn();
    let e = engine(r#"{"task_bytes": 262144, "peer_timeout_ms": 2000, "route": "tcp"}"#);
    let seg = p.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    let (l, r) = ([Desc::new(local.id, 0, 4096)], [Desc::new(p.region, 0, 4096)]);
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    // SAFETY: sending SIGSTOP to our own child process.
    unsafe { libc_kill(p.child.id() as i32, 19) };
    // Group stop is asynchronous: wait until every thread of the peer is stopped.
    let stat = format!("/proc/{}/task", p.child.id());
    let stopped = || {
        std::fs::read_dir(&stat).unwrap().flatten().all(|t| {
            let s = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
            s.rsplit(") ").next().is_some_and(|rest| rest.starts_with('T') || rest.starts_with('t'))
        })
    };
    let t0 = Instant::now();
    while !stopped() {
        assert!(t0.elapsed() < Duration::from_secs(5), "peer did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
    let start = Instant::now();
    t.post().unwrap();
    let res = wait_retired(&t);
    let took = start.elapsed();
    // SAFETY: SIGCONT to our own child.
    unsafe { libc_kill(p.child.id() as i32, 18) };
    assert_eq!((res.outcome.code, res.outcome.remote_effect), (OutcomeCode::Failed, RemoteEffect::Unknown));
    assert!(took >= Duration::from_millis(1500) && took < Duration::from_secs(8), "took {took:?}");
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// N08: binary payloads, self notification, oversized, unreachable target,
/// exactly-once delivery with transfers.
#[test]
fn n08_notifications() {
    let mut p = PeerProcess::spawn();
    let e = initiator();
    let seg = p.open(&e);
    let payload: Vec<u8> = vec![0, 0xFF, 0xC3, 0x28, 0, b'\n', 0x80];
    e.notify(&seg, &payload).unwrap();
    assert_eq!(p.ask("notifs"), "NOTIFS 1 00ffc328000a80");
    e.notify_self(&payload).unwrap();
    let mine = e.take_notifications();
    assert_eq!(mine.len(), 1);
    assert_eq!((mine[0].payload.clone(), mine[0].sender_epoch), (payload.clone(), e.source_epoch()));
    assert_eq!(e.stats().notification_bytes, 0, "taking refunds the charge");
    let big = vec![7u8; 64 * 1024 + 1];
    assert!(matches!(e.notify(&seg, &big), Err(Error::Peer(PeerError::NotificationTooLarge { .. }))));
    assert!(matches!(e.notify_self(&big), Err(Error::Peer(PeerError::NotificationTooLarge { .. }))));
    // Each transfer's notification arrives exactly once, after its bytes.
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    fill(&local.mem, 8);
    let (l, r) = ([Desc::new(local.id, 0, 8192)], [Desc::new(p.region, 0, 8192)]);
    let mut want = Vec::new();
    for i in 0..50u8 {
        let note = [i, 0, 0xFE];
        let mut s = TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg));
        s.notification = Some(&note);
        let t = e.prepare(&s).unwrap();
        t.post().unwrap();
        assert!(wait_retired(&t).outcome.is_success());
        want.push(format!("{i:02x}00fe"));
    }
    assert_eq!(p.ask("notifs"), format!("NOTIFS 50 {}", want.join(",")));
    assert_eq!(p.hash(0, 8192), fnv(&snapshot(&local.mem)[..8192]));
    // Unreachable target: a port nobody listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    assert!(matches!(e.open_segment(&dead, None, Duration::from_secs(2)), Err(Error::Peer(PeerError::Connect(_)))));
    // A lost peer: notifications fail, nothing is replayed.
    p.kill();
    std::thread::sleep(Duration::from_millis(50)); // the pidfd watcher notices the exit
    let lost = e.notify(&seg, b"x");
    assert!(matches!(lost, Err(Error::Peer(PeerError::Lost(_)))), "{lost:?}");
}
