//! Same-host routes with real processes: shm (one-sided copies into a
//! peer's shared allocation mapped here) and cma (cross-memory copies into
//! a peer's ordinary memory), the route policy, target-side borrows, and
//! peers dying mid-copy.

mod common;
mod peer;

use std::time::Duration;

use common::*;
use orbite_core::*;
use peer::{PeerProcess, REGION};

#[test]
fn peer_process_entry() {
    peer::entry();
}

fn initiator() -> TransferEngine {
    engine(r#"{"task_bytes": 262144, "peer_timeout_ms": 3000}"#)
}

fn spec<'a>(op: Op, l: &'a [Desc], r: &'a [Desc], seg: &'a RemoteSegment) -> TransferSpec<'a> {
    TransferSpec::new(op, l, r, Target::Peer(seg))
}

/// N01 (SHM part) and CMA: malloc memory never selects shm; an actual
/// shared allocation does; bytes and guards agree both ways; charges come
/// back to baseline only after drain.
#[test]
fn n01_shm_and_cma_fragmented_with_guards_and_charges() {
    let mut p = PeerProcess::spawn();
    let e = initiator();
    let base = e.stats();
    let seg = p.open(&e);
    let local = region(&e, REGION, Permission::RemoteReadWrite);
    let mut shm_bytes = PeerProcess::initial(0xEF);
    let mut plain_bytes = PeerProcess::initial(0xAB);
    // Ordinary memory of the peer cannot take the shm route.
    let probe = [Desc::new(local.id, 0, 4096)];
    let plain = [Desc::new(p.region, 0, 4096)];
    let mut forced = spec(Op::Write, &probe, &plain, &seg);
    forced.options.route = Some(RoutePolicy::Shm);
    assert!(matches!(e.prepare(&forced), Err(Error::Peer(PeerError::RouteUnavailable { route: Route::Shm, .. }))));
    for (round, op) in [Op::Write, Op::Read, Op::Write, Op::Read].into_iter().enumerate() {
        for (target, want_route) in [(p.shm, Route::Shm), (p.region, Route::Cma)] {
            let mut rng = Rng(round as u64 * 7 + want_route as u64);
            let (_, ll, rl) = paired_layouts(&mut rng, 200_000, 2_000_000, 100_000, REGION as u64);
            fill(&local.mem, 500 + round as u64);
            let before_local = snapshot(&local.mem);
            let (l, r) = (descs(local.id, &ll), descs(target, &rl));
            let t = e.prepare(&spec(op, &l, &r, &seg)).unwrap();
            assert_eq!(t.route().route, want_route, "{}", t.route().reason);
            t.post().unwrap();
            let res = wait_retired(&t);
            assert_eq!(res.outcome.code, OutcomeCode::Success, "{want_route:?} {op:?}: {res:?}");
            let remote = if want_route == Route::Shm { &mut shm_bytes } else { &mut plain_bytes };
            match op {
                Op::Write => *remote = expected(&before_local, &ll, remote, &rl),
                Op::Read => {
                    assert_eq!(snapshot(&local.mem), expected(remote, &rl, &before_local, &ll), "local bytes or guards")
                }
            }
            let got = if want_route == Route::Shm { p.shm_hash(0, REGION) } else { p.hash(0, REGION) };
            assert_eq!(got, fnv(remote), "{want_route:?} {op:?}: remote bytes or guards differ");
            assert_eq!(e.stats().executions, 0);
            t.release().unwrap();
        }
    }
    e.deregister(local.id).unwrap();
    drop(local);
    e.close_segment(&seg, WAIT).unwrap();
    drop(seg);
    assert_eq!(e.stats(), base);
}

#[test]
fn cma_denied_falls_back_to_tcp_and_forced_routes_fail_at_prepare() {
    let p = PeerProcess::spawn();
    let e = initiator();
    e.deny_cma_for_tests(true);
    let seg = p.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    fill(&local.mem, 9);
    let (l, r) = ([Desc::new(local.id, 0, 65536)], [Desc::new(p.region, 0, 65536)]);
    let t = e.prepare(&spec(Op::Write, &l, &r, &seg)).unwrap();
    assert_eq!(t.route().route, Route::Tcp);
    assert!(t.route().reason.contains("denied"), "the fallback is recorded: {}", t.route().reason);
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    let mut forced = spec(Op::Write, &l, &r, &seg);
    forced.options.route = Some(RoutePolicy::Cma);
    let err = e.prepare(&forced).unwrap_err();
    assert!(matches!(err, Error::Peer(PeerError::RouteUnavailable { route: Route::Cma, .. })), "{err}");
    // Shared memory still takes shm under auto.
    let rs = [Desc::new(p.shm, 0, 65536)];
    assert_eq!(e.prepare(&spec(Op::Write, &l, &rs, &seg)).unwrap().route().route, Route::Shm);
    // And tcp may always be forced.
    let mut tcp = spec(Op::Write, &l, &rs, &seg);
    tcp.options.route = Some(RoutePolicy::Tcp);
    assert_eq!(e.prepare(&tcp).unwrap().route().route, Route::Tcp);
}

/// The target deregisters and drops memory that a one-sided borrower still
/// uses: it stays alive until the borrower releases its transfer.
#[test]
fn target_keeps_memory_borrowed_by_one_sided_routes() {
    let mut p = PeerProcess::spawn();
    let e = initiator();
    let seg = p.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    // The plain region is also covered by the peer's alias registration, so
    // its memory outlives the deregistered registration.
    for (target, route, dereg, drop_cmd, freed) in
        [(p.shm, Route::Shm, "sdereg", "sdrop", 1), (p.region, Route::Cma, "dereg", "drop_region", 0)]
    {
        fill(&local.mem, 11);
        let (l, r) = ([Desc::new(local.id, 0, 65536)], [Desc::new(target, 0, 65536)]);
        let t = e.prepare(&spec(Op::Write, &l, &r, &seg)).unwrap();
        assert_eq!(t.route().route, route);
        t.post().unwrap(); // prepare borrowed
        assert!(wait_retired(&t).outcome.is_success());
        let before = p.ask("stats");
        assert_eq!(p.ask(dereg), "OK");
        assert_eq!(p.ask(drop_cmd), "OK");
        let during = p.ask("stats");
        // Registrations unchanged, one more fenced: nothing was freed.
        let fields = |s: &str| s.split_whitespace().skip(1).map(|x| x.parse::<u64>().unwrap()).collect::<Vec<_>>();
        let (b, d) = (fields(&before), fields(&during));
        assert_eq!((d[0], d[1], d[2]), (b[0], b[1] + 1, b[2]), "{before} -> {during}");
        // The deregistration fenced the range for this borrower too: a
        // repost asks the peer again and is refused, as it would be over
        // tcp; nothing is copied into a range its owner gave up.
        fill(&local.mem, 12);
        assert!(matches!(t.post(), Err(Error::Peer(PeerError::Refused { .. }))));
        assert!(matches!(t.status(), TransferStatus::Retired(r) if r.receipt.execution == 1), "nothing posted");
        // A new transfer cannot name a fenced registration either: the
        // peer announced the deregistration, so prepare refreshes its view
        // and refuses; had the announcement not arrived yet, the borrow is
        // refused by the peer.
        let err = e.prepare(&spec(Op::Write, &l, &r, &seg)).unwrap_err();
        assert!(
            matches!(err, Error::Peer(PeerError::Refused { .. } | PeerError::UnknownRemoteRegistration(_))),
            "{err}"
        );
        // The old loan still keeps the range alive.
        let still = fields(&p.ask("stats"));
        assert_eq!((still[0], still[1], still[2]), (d[0], d[1], d[2]));
        t.release().unwrap(); // returns the borrow
        let start = std::time::Instant::now();
        let want = (b[0] - 1, b[1], b[2] - freed);
        loop {
            let after = fields(&p.ask("stats"));
            if (after[0], after[1], after[2]) == want {
                break; // the owner was freed after the return
            }
            assert!(start.elapsed() < WAIT, "the borrow was never returned: {after:?}, want {want:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn peer_dies_mid_copy(route: Route, op: Op) {
    let mut p = PeerProcess::spawn();
    let e = initiator();
    let seg = p.open(&e);
    let local = region(&e, REGION, Permission::RemoteReadWrite);
    let target = if route == Route::Shm { p.shm } else { p.region };
    let (l, r) = ([Desc::new(local.id, 0, 1 << 20)], [Desc::new(target, 0, 1 << 20)]);
    let t = e.prepare(&spec(op, &l, &r, &seg)).unwrap();
    assert_eq!(t.route().route, route);
    e.fault_hooks().hold_all(true);
    t.post().unwrap();
    assert!(e.fault_hooks().wait_held(1, WAIT));
    p.kill(); // dead and reaped before the held task runs
    // The engine learns of the exit from a watcher asleep on the peer's
    // pidfd: give it a moment to wake up.
    std::thread::sleep(Duration::from_millis(50));
    e.fault_hooks().hold_all(false);
    e.fault_hooks().release_all();
    let res = wait_retired(&t);
    assert_eq!(res.outcome.code, OutcomeCode::Failed, "{route:?} {op:?}: {res:?}");
    if op == Op::Write {
        assert_eq!(res.outcome.remote_effect, RemoteEffect::Unknown);
    }
    assert!(matches!(t.post(), Err(Error::Batch(BatchError::RepostRefused { .. }))), "no replay");
    assert!(e.wait_idle(WAIT));
}

#[test]
fn peer_killed_during_shm_write() {
    peer_dies_mid_copy(Route::Shm, Op::Write);
}

#[test]
fn peer_killed_during_cma_write() {
    peer_dies_mid_copy(Route::Cma, Op::Write);
}

#[test]
fn peer_killed_during_cma_read() {
    peer_dies_mid_copy(Route::Cma, Op::Read);
}

/// Same-host notifications take the peer's shared-memory inbox: binary
/// payloads arrive exactly once, after their transfer's bytes.
#[test]
fn notifications_through_the_shared_memory_inbox() {
    let mut p = PeerProcess::spawn();
    let e = engine(r#"{"listen": "127.0.0.1:0"}"#);
    let seg = p.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    fill(&local.mem, 21);
    let (l, r) = ([Desc::new(local.id, 0, 4096)], [Desc::new(p.shm, 0, 4096)]);
    let mut want = Vec::new();
    for i in 0..20u8 {
        let note = [0, i, 0xFF, 0x80];
        let mut s = spec(Op::Write, &l, &r, &seg);
        s.notification = Some(&note);
        let t = e.prepare(&s).unwrap();
        assert_eq!(t.route().route, Route::Shm);
        t.post().unwrap();
        assert!(wait_retired(&t).outcome.is_success());
        want.push(format!("00{i:02x}ff80"));
    }
    e.notify(&seg, &[0, 0, 0]).unwrap();
    want.push("000000".into());
    assert_eq!(p.ask("notifs"), format!("NOTIFS 21 {}", want.join(",")));
    assert_eq!(p.shm_hash(0, 4096), fnv(&snapshot(&local.mem)[..4096]));
    assert_eq!(p.ask("notifs"), "NOTIFS 0", "exactly once");
}

/// Role of a re-executed test binary: an initiator that runs as an
/// unprivileged user, so the kernel itself denies it CMA on the peer.
const DENIED_ENV: &str = "ORBITE_TEST_DENIED_INITIATOR";

#[test]
fn denied_initiator_entry() {
    let Ok(args) = std::env::var(DENIED_ENV) else { return };
    let w: Vec<&str> = args.split_whitespace().collect();
    let (endpoint, epoch, target) =
        (w[0], w[1].parse::<u64>().unwrap(), RegistrationId::from_raw(w[2].parse().unwrap()));
    // Become nobody: no CAP_SYS_PTRACE, another uid than the peer.
    // SAFETY: plain system calls in a single-purpose child process.
    unsafe {
        assert_eq!(libc::setgroups(0, std::ptr::null()), 0);
        assert_eq!(libc::setgid(65534), 0);
        assert_eq!(libc::setuid(65534), 0);
    }
    let e = engine(r#"{"task_bytes": 262144}"#);
    let seg = e.open_segment(endpoint, Some(epoch), WAIT).unwrap();
    let local = region(&e, 1 << 16, Permission::RemoteReadWrite);
    fill(&local.mem, 5);
    let (l, r) = ([Desc::new(local.id, 0, 4096)], [Desc::new(target, 0, 4096)]);
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    t.post().unwrap();
    let ok = wait_retired(&t).outcome.is_success();
    let mut forced = TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg));
    forced.options.route = Some(RoutePolicy::Cma);
    let forced = match e.prepare(&forced) {
        Err(Error::Peer(PeerError::RouteUnavailable { route: Route::Cma, reason })) => reason,
        other => format!("unexpected: {other:?}"),
    };
    println!("DENIED {:?} ok={ok} reason={} forced={forced}", t.route().route, t.route().reason);
    std::process::exit(0);
}

/// The kernel denies CMA to an initiator of another user: auto falls back
/// to tcp and says why; a forced cma fails at prepare.
#[test]
fn real_cma_denial_falls_back_to_tcp() {
    // SAFETY: reads the effective uid.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIP real_cma_denial_falls_back_to_tcp: needs root to start an unprivileged initiator");
        return;
    }
    let p = PeerProcess::spawn();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["denied_initiator_entry", "--exact", "--nocapture", "--test-threads=1", "-q"])
        .env(DENIED_ENV, format!("{} {} {}", p.endpoint, p.epoch, p.region.to_raw()))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("DENIED "))
        .unwrap_or_else(|| panic!("no result: {text} {}", String::from_utf8_lossy(&out.stderr)));
    // The peer's local socket belongs to another user: not proven same
    // host, so neither one-sided route applies.
    assert!(line.starts_with("DENIED Tcp ok=true"), "{line}");
    assert!(line.contains("belongs to uid 0, not this user (65534)"), "the fallback says why: {line}");
    assert!(line.contains("forced=the local socket"), "{line}");
}

/// Attack: a peer truncated the shared file this engine had mapped, and the
/// next notification or one-sided copy faulted (SIGBUS). Shared memory is
/// now a memfd sealed against shrinking, handed over the local socket:
/// its owner itself cannot shrink it, and copies and notifications go on.
#[test]
fn a_peer_cannot_shrink_shared_memory_under_its_mappers() {
    let mut p = PeerProcess::spawn();
    let e = initiator();
    let seg = p.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    let (l, r) = ([Desc::new(local.id, 0, 65536)], [Desc::new(p.shm, 0, 65536)]);
    let t = e.prepare(&spec(Op::Write, &l, &r, &seg)).unwrap();
    assert_eq!(t.route().route, Route::Shm, "{}", t.route().reason);
    fill(&local.mem, 31);
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    let answer = p.ask("struncate");
    let w: Vec<usize> = answer.split_whitespace().skip(1).map(|n| n.parse().unwrap()).collect();
    assert!(w[0] >= 2, "the inbox and the shared allocation are memfds: {answer}");
    assert_eq!(w[1], 0, "a shared allocation was shrunk: {answer}");
    fill(&local.mem, 32);
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    assert_eq!(p.shm_hash(0, 65536), fnv(&snapshot(&local.mem)[..65536]));
    e.notify(&seg, b"still here").unwrap();
    assert_eq!(
        p.ask("notifs"),
        format!("NOTIFS 1 {}", b"still here".iter().map(|b| format!("{b:02x}")).collect::<String>())
    );
    t.release().unwrap();
}

/// Any deregistration on the target makes a one-sided borrower ask again
/// before its next post; a range that is still registered is lent again.
#[test]
fn one_sided_repost_after_an_unrelated_deregistration_asks_again_and_lands() {
    let mut p = PeerProcess::spawn();
    let e = initiator();
    let seg = p.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    let (l, r) = ([Desc::new(local.id, 0, 65536)], [Desc::new(p.region, 0, 65536)]);
    let t = e.prepare(&spec(Op::Write, &l, &r, &seg)).unwrap();
    assert_eq!(t.route().route, Route::Cma);
    fill(&local.mem, 21);
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    assert_eq!(p.ask("sdereg"), "OK"); // another registration
    fill(&local.mem, 22);
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    assert_eq!(p.hash(0, 65536), fnv(&snapshot(&local.mem)[..65536]), "the repost landed");
    t.release().unwrap();
}

/// Attack: a fake peer describes itself with another process's epoch and
/// local socket, and "registrations" at addresses of its choosing in that
/// process. The proof reaches the true process, whose own description is
/// the one used: the bytes land in its registered range, nothing else of
/// it changes, and the fake's addresses are never touched.
#[test]
fn a_peer_naming_another_process_reaches_only_that_process_registered_ranges() {
    use orbite_core::segment::SegmentDescriptor;
    use orbite_core::wire::{self, Kind};
    use std::io::{Read, Write};
    let mut victim = PeerProcess::spawn();
    let e = initiator();
    let honest = victim.open(&e).descriptor().clone();
    let real = honest.registrations.iter().find(|r| r.id == victim.region).unwrap().clone();
    // The same id, but 1 MiB further into the victim's address space.
    let mut fake = SegmentDescriptor { rdma_nics: 0, endpoint: String::new(), ..honest.clone() };
    for r in &mut fake.registrations {
        r.addr += 1 << 20;
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    fake.endpoint = addr.clone();
    let frame = |kind: Kind, body: &[u8], request: u64| {
        let mut f = wire::encode_header(&wire::header(kind, body.len(), 0, request)).to_vec();
        f.extend_from_slice(body);
        f
    };
    let server = std::thread::spawn(move || {
        // Answers the Describe, then holds the connection (the watch and the
        // control exchanges go to the process it named).
        let Ok((mut s, _)) = l.accept() else { return };
        let mut h = [0u8; wire::HEADER_LEN];
        s.read_exact(&mut h).unwrap();
        let h = wire::decode_header(&h, wire::Limits { max_body: 1 << 20, max_data: 0 }).unwrap();
        let mut body = vec![0u8; h.body_len as usize];
        s.read_exact(&mut body).unwrap();
        s.write_all(&frame(Kind::DescribeReply, &fake.to_bytes(), h.request)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut b = [0u8; 4096];
        while matches!(s.read(&mut b), Ok(n) if n > 0) {}
    });
    let e2 = engine(r#"{"connections_per_peer": 1, "peer_timeout_ms": 3000}"#);
    let seg = e2.open_segment(&addr, None, WAIT).unwrap();
    assert_eq!(seg.descriptor().registrations.iter().find(|r| r.id == victim.region).unwrap().addr, real.addr);
    let len = 65536;
    let local = region(&e2, len, Permission::RemoteReadWrite);
    fill(&local.mem, 41);
    let guard = victim.hash(len, REGION - len);
    let (l, r) = ([Desc::new(local.id, 0, len as u64)], [Desc::new(victim.region, 0, len as u64)]);
    let t = e2.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    assert_eq!(t.route().route, Route::Cma, "{:?}", t.route());
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    assert_eq!(victim.hash(0, len), fnv(&snapshot(&local.mem)), "the bytes are in the registered range");
    assert_eq!(victim.hash(len, REGION - len), guard, "nothing after it changed (the fake's addresses lie there)");
    drop(t);
    drop(seg);
    drop(e2);
    drop(e);
    let _ = server.join();
}

/// Two engines in one process (two NIXL agents of one framework process):
/// the local socket proves the other engine, whose registrations are its
/// own, so shm and cma apply between them, and the bytes land.
#[test]
fn two_engines_of_one_process_are_same_host() {
    let b = engine(r#"{"listen": "127.0.0.1:0"}"#);
    let plain = region(&b, 1 << 20, Permission::RemoteReadWrite);
    let shared = b.allocate_shm_memory(1 << 20).unwrap();
    let shared_id = b
        .register_memory_ranges(vec![MemoryRange::host(&shared, 0, 1 << 20, Permission::RemoteReadWrite).unwrap()])
        .unwrap()[0];
    let a = initiator();
    let seg = a.open_segment(&b.endpoint().unwrap(), Some(b.source_epoch()), WAIT).unwrap();
    let local = region(&a, 1 << 16, Permission::RemoteReadWrite);
    fill(&local.mem, 51);
    for (target, mem, want) in [(plain.id, &plain.mem, Route::Cma), (shared_id, &shared, Route::Shm)] {
        let (l, r) = ([Desc::new(local.id, 0, 1 << 16)], [Desc::new(target, 0, 1 << 16)]);
        let t = a.prepare(&spec(Op::Write, &l, &r, &seg)).unwrap();
        assert_eq!(t.route().route, want, "{:?}", t.route());
        t.post().unwrap();
        assert!(wait_retired(&t).outcome.is_success());
        assert_eq!(&snapshot(mem)[..1 << 16], &snapshot(&local.mem)[..]);
    }
    // A shared allocation registered after the open is handed over and
    // mapped at the next prepare.
    let later = b.allocate_shm_memory(1 << 16).unwrap();
    let later_id = b
        .register_memory_ranges(vec![MemoryRange::host(&later, 0, 1 << 16, Permission::RemoteReadWrite).unwrap()])
        .unwrap()[0];
    let (l, r) = ([Desc::new(local.id, 0, 1 << 16)], [Desc::new(later_id, 0, 1 << 16)]);
    let t = a.prepare(&spec(Op::Write, &l, &r, &seg)).unwrap();
    assert_eq!(t.route().route, Route::Shm, "{:?}", t.route());
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    assert_eq!(snapshot(&later), snapshot(&local.mem));
}
