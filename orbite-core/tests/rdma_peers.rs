//! Two engines in two processes over the rdma route, through the test
//! verbs library (`orbite-verbs-shim`, at `ORBITE_VERBS_SHIM`; SKIP without
//! it unless `ORBITE_VERBS_REQUIRED`): queue pairs connected over the
//! control connection, fragmented WRITE and READ with guards, charges and
//! the shim's objects back to baseline.
//!
//! The engines load the library named by `ORBITE_IBVERBS_LIB`: a test
//! that finds it unset runs itself again in a child process with it set
//! (never changing this process's environment while threads run).

mod common;
mod peer;

use std::ffi::c_int;
use std::time::{Duration, Instant};

use common::*;
use orbite_core::*;
use peer::{PeerProcess, REGION};

#[test]
fn peer_process_entry() {
    peer::entry();
}

/// The shim's counters of live objects in this process.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct ShimStats {
    device_lists: i64,
    contexts: i64,
    pds: i64,
    mrs: i64,
    cqs: i64,
    channels: i64,
    qps: i64,
}

/// The shim's export `name` (the library the engine loaded).
fn shim_fn(name: &std::ffi::CStr) -> *mut libc::c_void {
    let path = std::ffi::CString::new(std::env::var("ORBITE_IBVERBS_LIB").unwrap()).unwrap();
    // SAFETY: a NUL-terminated path; the handle is never closed.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    assert!(!handle.is_null(), "the engine loaded the shim");
    // SAFETY: a live handle, a NUL-terminated name.
    let f = unsafe { libc::dlsym(handle, name.as_ptr()) };
    assert!(!f.is_null(), "{name:?}");
    f
}

fn shim_stats() -> ShimStats {
    // SAFETY: the shim's export of this signature.
    let f: unsafe extern "C" fn(*mut ShimStats) -> c_int =
        unsafe { std::mem::transmute(shim_fn(c"orbite_verbs_shim_stats")) };
    let mut s = ShimStats::default();
    // SAFETY: a struct of the shim's layout.
    assert_eq!(unsafe { f(&mut s) }, 0);
    s
}

/// The shim's faults (`orbite-verbs-shim/src/faults.rs`).
const QP_ERROR: c_int = 1;
const RETRY_EXCEEDED: c_int = 2;
const REMOTE_ACCESS: c_int = 3;
const HOLD_COMPLETIONS: c_int = 4;
const RELEASE_COMPLETIONS: c_int = 5;
const DELAY_MS: c_int = 6;

/// Injects `fault` on every queue pair of this process (the initiator's).
fn inject_all(fault: c_int, arg: u32) {
    // SAFETY: the shim's exports of these signatures.
    let (qps, inject) = unsafe {
        (
            std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(*mut u32, usize) -> usize>(shim_fn(
                c"orbite_verbs_shim_qps",
            )),
            std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(u32, c_int, u32) -> c_int>(shim_fn(
                c"orbite_verbs_shim_inject",
            )),
        )
    };
    let mut out = [0u32; 256];
    // SAFETY: room for 256 numbers.
    let n = unsafe { qps(out.as_mut_ptr(), out.len()) };
    assert!(n > 0, "the engine made queue pairs");
    for q in &out[..n.min(256)] {
        // SAFETY: a plain call.
        assert_eq!(unsafe { inject(*q, fault, arg) }, 0);
    }
}

/// Takes port 1 of the shim's first device down or up in this process.
fn port(up: bool) {
    port_of(0, up)
}

/// Takes port 1 of the shim's device `device` down or up in this process.
fn port_of(device: u32, up: bool) {
    // SAFETY: the shim's export of this signature.
    let f: unsafe extern "C" fn(u32, u8, c_int) -> c_int =
        unsafe { std::mem::transmute(shim_fn(c"orbite_verbs_shim_port")) };
    // SAFETY: a plain call.
    assert_eq!(unsafe { f(device, 1, up as c_int) }, 0);
}

/// Requests this process's queue pairs executed, per shim device.
fn executed_per_device() -> [u64; 2] {
    // SAFETY: the shim's exports of these signatures.
    let (qps, info) = unsafe {
        (
            std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(*mut u32, usize) -> usize>(shim_fn(
                c"orbite_verbs_shim_qps",
            )),
            std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(u32, *mut u32, *mut u64) -> c_int>(shim_fn(
                c"orbite_verbs_shim_qp_info",
            )),
        )
    };
    let mut out = [0u32; 256];
    // SAFETY: room for 256 numbers.
    let n = unsafe { qps(out.as_mut_ptr(), out.len()) };
    let mut per = [0u64; 2];
    for q in &out[..n.min(256)] {
        let (mut dev, mut done) = (0u32, 0u64);
        // SAFETY: two out-values.
        assert_eq!(unsafe { info(*q, &mut dev, &mut done) }, 0);
        per[dev as usize] += done;
    }
    per
}

/// Checks that the shim's objects of this process are all gone.
fn assert_shim_idle() {
    let left = shim_stats();
    assert_eq!((left.qps, left.mrs, left.pds, left.cqs, left.contexts), (0, 0, 0, 0, 0), "{left:?}");
}

/// Whether this process runs `test`'s body: yes with the library set;
/// else the test runs in a child that has it (and this checks the child
/// passed), or is skipped without a shim.
fn in_shim_process(test: &str) -> bool {
    in_shim_process_with(test, &[])
}

/// As [`in_shim_process`], the child also given `env`.
fn in_shim_process_with(test: &str, env: &[(&str, &str)]) -> bool {
    if std::env::var_os("ORBITE_IBVERBS_LIB").is_some() {
        return true;
    }
    let Some(shim) = std::env::var_os("ORBITE_VERBS_SHIM") else {
        assert!(std::env::var_os("ORBITE_VERBS_REQUIRED").is_none(), "ORBITE_VERBS_REQUIRED without ORBITE_VERBS_SHIM");
        println!("SKIP: no verbs shim (ORBITE_VERBS_SHIM; scripts/verbs-shim builds it)");
        return false;
    };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .env("ORBITE_IBVERBS_LIB", &shim)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("1 passed"), "{test} in a child with the shim:\n{text}");
    false
}

fn initiator(extra: &str) -> TransferEngine {
    // The route is forced: peers here are on one host, where auto picks a
    // same-host route.
    engine(&format!(
        r#"{{"listen": "127.0.0.1:0", "task_bytes": 262144, "peer_timeout_ms": 30000, "route": "rdma"{extra}}}"#
    ))
}

/// Fragmented lists both ways over rdma, guards around every range; the
/// transfer says it took rdma; charges and the shim's objects back to
/// baseline once everything is closed.
#[test]
fn fragmented_write_and_read_over_rdma_with_guards_and_charges() {
    if !in_shim_process("fragmented_write_and_read_over_rdma_with_guards_and_charges") {
        return;
    }
    let mut p = PeerProcess::spawn();
    let e = initiator("");
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
        assert_eq!(t.route().route, Route::Rdma, "{:?}", t.route());
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
        t.release().unwrap();
    }
    assert_idle(&e);
    // Idle means idle: the NIC's poller sleeps on its completion channel
    // once nothing is in flight.
    let cpu = || -> u64 {
        let mut ticks = 0;
        for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            if comm.starts_with("orbite-rdma") {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                let fields: Vec<&str> = stat.rsplit(") ").next().unwrap_or("").split(' ').collect();
                ticks += fields.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                ticks += fields.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            }
        }
        ticks
    };
    std::thread::sleep(Duration::from_millis(200));
    let before = cpu();
    std::thread::sleep(Duration::from_secs(1));
    assert!(cpu() - before <= 2, "the idle poller used {} ticks in a second", cpu() - before);
    drop(seg);
    e.deregister(local.id).unwrap();
    drop(local);
    let s = e.stats();
    assert_eq!((s.registrations, s.registered_bytes), (base.registrations, base.registered_bytes));
    e.close();
    drop(e);
    assert_shim_idle();
    p.kill();
}

/// Each transfer's notification arrives exactly once, after its bytes,
/// binary payloads intact; standalone notifications too.
#[test]
fn notifications_follow_every_completion_exactly_once() {
    if !in_shim_process("notifications_follow_every_completion_exactly_once") {
        return;
    }
    let mut p = PeerProcess::spawn();
    let e = initiator("");
    let seg = p.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    fill(&local.mem, 8);
    // Several tasks per transfer, so a notification could overtake them.
    let (l, r) = ([Desc::new(local.id, 0, 1 << 20)], [Desc::new(p.region, 0, 1 << 20)]);
    let mut want = Vec::new();
    for i in 0..20u8 {
        let note = [i, 0, 0xFE, b'\n'];
        let mut s = TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg));
        s.notification = Some(&note);
        let t = e.prepare(&s).unwrap();
        t.post().unwrap();
        assert!(wait_retired(&t).outcome.is_success());
        assert_eq!(p.hash(0, 1 << 20), fnv(&snapshot(&local.mem)), "bytes before the notification");
        want.push(format!("{i:02x}00fe0a"));
    }
    assert_eq!(p.ask("notifs"), format!("NOTIFS 20 {}", want.join(",")));
    e.notify(&seg, &[0, 0xFF]).unwrap();
    assert_eq!(p.ask("notifs"), "NOTIFS 1 00ff");
    drop(seg);
    drop(local);
    e.close();
    drop(e);
    assert_shim_idle();
    p.kill();
}

/// A target that deregisters a range under an RDMA WRITE in flight keeps
/// it (and its region) until the borrower returns it; the WRITE lands;
/// the next transfer to the range is refused.
#[test]
fn target_deregistration_waits_for_remote_borrowers() {
    if !in_shim_process("target_deregistration_waits_for_remote_borrowers") {
        return;
    }
    let mut p = PeerProcess::spawn();
    let e = initiator("");
    let seg = p.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    fill(&local.mem, 3);
    let (l, r) = ([Desc::new(local.id, 0, 65536)], [Desc::new(p.region, 0, 65536)]);
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    let t2 = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    // The WRITE waits in its queue pair while the target deregisters.
    inject_all(DELAY_MS, 500);
    t.post().unwrap();
    assert_eq!(p.ask("dereg"), "OK");
    assert_eq!(p.ask("drop_region"), "OK");
    // Fenced (1), still registered (4: read-only, alias, shared, the fenced
    // region), memory alive (4, the inbox included).
    assert_eq!(p.ask("stats"), "STATS 4 1 4 0");
    assert!(!t.check().is_terminal(), "the WRITE is still in flight");
    assert!(wait_retired(&t).outcome.is_success());
    inject_all(DELAY_MS, 0);
    t.release().unwrap();
    // `t2` borrowed the range too, at prepare: the target still keeps it.
    assert_eq!(p.ask("stats"), "STATS 4 1 4 0");
    // Posting it asks again, and the target refuses the range it gave up:
    // nothing moves.
    match t2.post() {
        Err(Error::Peer(PeerError::Refused { .. })) => {}
        Ok(()) => {
            let r2 = wait_retired(&t2);
            assert_eq!((r2.outcome.code, r2.outcome.remote_effect), (OutcomeCode::Failed, RemoteEffect::None));
        }
        Err(other) => panic!("{other:?}"),
    }
    // Every borrow returned: the fenced registration (and its region) goes.
    drop(t2);
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.ask("stats") != "STATS 3 0 4 0" {
        assert!(Instant::now() < deadline, "the fenced registration stayed: {}", p.ask("stats"));
        std::thread::sleep(Duration::from_millis(10));
    }
    drop((seg, local));
    e.close();
    drop(e);
    assert_shim_idle();
    p.kill();
}

/// Each injected fault fails the transfer as the rules say: a WRITE's
/// effect unknown, a READ's exact prefix with nothing beyond it touched;
/// nothing replayed; a broken queue pair is left for the others, and once
/// all are broken rdma says so until the peer is opened again, which
/// makes new ones.
#[test]
fn injected_faults_fail_transfers_by_the_rules() {
    if !in_shim_process("injected_faults_fail_transfers_by_the_rules") {
        return;
    }
    let mut p = PeerProcess::spawn();
    let e = initiator(r#", "rdma_qps_per_nic": 1"#);
    let base = e.stats();
    let local = region(&e, REGION, Permission::RemoteReadWrite);
    let faults =
        [(RETRY_EXCEEDED, Op::Write), (REMOTE_ACCESS, Op::Read), (RETRY_EXCEEDED, Op::Read), (QP_ERROR, Op::Write)];
    for (fault, op) in faults {
        let seg = p.open(&e);
        fill(&local.mem, fault as u64);
        let before = snapshot(&local.mem);
        let (l, r) = ([Desc::new(local.id, 0, REGION as u64)], [Desc::new(p.region, 0, REGION as u64)]);
        let t = e.prepare(&TransferSpec::new(op, &l, &r, Target::Peer(&seg))).unwrap();
        inject_all(fault, 0);
        t.post().unwrap();
        let res = wait_retired(&t);
        assert_eq!(res.outcome.code, OutcomeCode::Failed, "{fault} {op:?}: {res:?}");
        match op {
            // A queue pair already in ERR (its event seen) takes nothing:
            // nothing was sent. Otherwise a WRITE's effect is unknown.
            Op::Write if fault == QP_ERROR => {
                assert_ne!(res.outcome.remote_effect, RemoteEffect::Known, "{res:?}");
                assert_eq!(res.outcome.transferred_prefix, 0, "{res:?}");
            }
            Op::Write => assert_eq!(res.outcome.remote_effect, RemoteEffect::Unknown, "{res:?}"),
            Op::Read => {
                assert_ne!(res.outcome.remote_effect, RemoteEffect::Unknown);
                let n = res.outcome.transferred_prefix as usize;
                assert_eq!(&snapshot(&local.mem)[n..], &before[n..], "bytes beyond the prefix were written");
            }
        }
        assert!(matches!(t.post(), Err(Error::Batch(BatchError::RepostRefused { .. }))), "no replay");
        // Its one queue pair is broken: rdma says so, and says why.
        let again = e.prepare(&TransferSpec::new(op, &l, &r, Target::Peer(&seg)));
        match again {
            Err(Error::Peer(PeerError::RouteUnavailable { route: Route::Rdma, reason })) => {
                assert!(reason.contains("queue pair"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        drop(t);
        e.close_segment(&seg, WAIT).unwrap();
    }
    // Opened again: new queue pairs, and the bytes move.
    let seg = p.open(&e);
    let (l, r) = ([Desc::new(local.id, 0, 65536)], [Desc::new(p.region, 0, 65536)]);
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    assert_eq!(p.hash(0, 65536), fnv(&snapshot(&local.mem)[..65536]));
    drop(t);
    e.close_segment(&seg, WAIT).unwrap();
    drop(seg);
    e.deregister(local.id).unwrap();
    drop(local);
    assert_eq!(e.stats(), base);
    e.close();
    drop(e);
    assert_shim_idle();
    p.kill();
}

/// Completions that never come: the task fails within `peer_timeout_ms`
/// (its queue pair moved to ERR), the WRITE's effect unknown.
#[test]
fn held_completions_fail_within_the_peer_timeout() {
    if !in_shim_process("held_completions_fail_within_the_peer_timeout") {
        return;
    }
    let p = PeerProcess::spawn();
    let e = engine(r#"{"listen": "127.0.0.1:0", "task_bytes": 262144, "peer_timeout_ms": 1000, "route": "rdma"}"#);
    let seg = p.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    let (l, r) = ([Desc::new(local.id, 0, 4096)], [Desc::new(p.region, 0, 4096)]);
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    inject_all(HOLD_COMPLETIONS, 0);
    let start = Instant::now();
    t.post().unwrap();
    let res = wait_retired(&t);
    let took = start.elapsed();
    assert_eq!((res.outcome.code, res.outcome.remote_effect), (OutcomeCode::Failed, RemoteEffect::Unknown));
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(10), "took {took:?}");
    inject_all(RELEASE_COMPLETIONS, 0);
    drop((t, seg, local));
    e.close();
    drop(e);
    assert_shim_idle();
}

/// A NIC whose port goes down takes no new transfers (rdma says why)
/// until it is back.
#[test]
fn a_port_down_takes_the_nic_out_until_it_is_back() {
    if !in_shim_process("a_port_down_takes_the_nic_out_until_it_is_back") {
        return;
    }
    let mut p = PeerProcess::spawn();
    let e = initiator("");
    let seg = p.open(&e);
    let local = region(&e, 1 << 20, Permission::RemoteReadWrite);
    fill(&local.mem, 9);
    let (l, r) = ([Desc::new(local.id, 0, 65536)], [Desc::new(p.region, 0, 65536)]);
    port(false);
    let deadline = Instant::now() + Duration::from_secs(10);
    let refused = loop {
        match e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))) {
            Err(Error::Peer(PeerError::RouteUnavailable { reason, .. })) => break reason,
            Ok(_) => assert!(Instant::now() < deadline, "the port event never came"),
            Err(other) => panic!("{other:?}"),
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(refused.contains("down"), "{refused}");
    port(true);
    let t = loop {
        match e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))) {
            Ok(t) => break t,
            Err(_) => assert!(Instant::now() < deadline, "the NIC never came back"),
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    assert_eq!(p.hash(0, 65536), fnv(&snapshot(&local.mem)[..65536]));
    drop((t, seg, local));
    e.close();
    drop(e);
    assert_shim_idle();
    p.kill();
}

/// The peer dies while RDMA requests are in flight: the transfer fails
/// within a bound (a WRITE's effect unknown; a READ's exact prefix with
/// nothing beyond it touched), the peer is lost, nothing is replayed, and
/// another peer is unaffected.
fn kill_mid_transfer(op: Op) {
    let mut p = PeerProcess::spawn();
    let other = PeerProcess::spawn();
    let e = initiator("");
    let base = e.stats();
    let seg = p.open(&e);
    let seg_other = other.open(&e);
    let local = region(&e, REGION, Permission::RemoteReadWrite);
    fill(&local.mem, 6);
    let before = snapshot(&local.mem);
    let (l, r) = ([Desc::new(local.id, 0, REGION as u64)], [Desc::new(p.region, 0, REGION as u64)]);
    let t = e.prepare(&TransferSpec::new(op, &l, &r, Target::Peer(&seg))).unwrap();
    // Requests wait in their queue pairs, so the peer dies mid-transfer.
    inject_all(DELAY_MS, 100);
    t.post().unwrap();
    std::thread::sleep(Duration::from_millis(150));
    let killed = Instant::now();
    p.kill();
    let res = wait_retired(&t);
    assert!(killed.elapsed() < Duration::from_secs(5), "failure took {:?}", killed.elapsed());
    inject_all(DELAY_MS, 0);
    assert_eq!(res.outcome.code, OutcomeCode::Failed, "{res:?}");
    match op {
        Op::Write => assert_eq!(res.outcome.remote_effect, RemoteEffect::Unknown, "{res:?}"),
        Op::Read => {
            assert_ne!(res.outcome.remote_effect, RemoteEffect::Unknown);
            // Tasks run on several queue pairs at once: beyond the prefix,
            // only tasks that finished (counted in transferred_bytes)
            // wrote here.
            let n = res.outcome.transferred_prefix as usize;
            let after = snapshot(&local.mem);
            let changed = after[n..].iter().zip(&before[n..]).filter(|(a, b)| a != b).count() as u64;
            assert!(changed <= res.outcome.transferred_bytes - res.outcome.transferred_prefix, "{changed} {res:?}");
        }
    }
    assert!(res.outcome.transferred_prefix < REGION as u64);
    assert!(matches!(t.post(), Err(Error::Batch(BatchError::RepostRefused { .. }))), "no replay");
    let deadline = Instant::now() + Duration::from_secs(10);
    while seg.lost().is_none() {
        assert!(Instant::now() < deadline, "the peer was never lost");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Another peer is unaffected (queue pairs of its own).
    let ro = [Desc::new(other.region, 0, 4096)];
    let lo = [Desc::new(local.id, 0, 4096)];
    let t2 = e.prepare(&TransferSpec::new(Op::Write, &lo, &ro, Target::Peer(&seg_other))).unwrap();
    t2.post().unwrap();
    assert!(wait_retired(&t2).outcome.is_success());
    drop((t, t2));
    e.deregister(local.id).unwrap();
    drop(local);
    let _ = e.close_segment(&seg, WAIT);
    e.close_segment(&seg_other, WAIT).unwrap();
    drop((seg, seg_other));
    assert_eq!(e.stats(), base);
    e.close();
    drop(e);
    assert_shim_idle();
}

#[test]
fn peer_killed_mid_write() {
    if in_shim_process("peer_killed_mid_write") {
        kill_mid_transfer(Op::Write);
    }
}

#[test]
fn peer_killed_mid_read() {
    if in_shim_process("peer_killed_mid_read") {
        kill_mid_transfer(Op::Read);
    }
}

/// GPUDirect RDMA through both shims (feature `cuda`, the CUDA shim on
/// `LD_LIBRARY_PATH`): device memory as a NIC's region through its
/// dma-buf, or by address where nvidia-peermem is loaded, else staged
/// through the pinned pool; `Transfer::route()` says which and why.
#[cfg(feature = "cuda")]
mod gpudirect {
    use super::*;

    /// Whether this process has a CUDA driver (SKIP without one, unless
    /// `ORBITE_CUDA_REQUIRED`).
    fn driver(test: &str) -> bool {
        match cuda::availability() {
            Ok(_) => true,
            Err(why) => {
                assert!(std::env::var_os("ORBITE_CUDA_REQUIRED").is_none(), "{test}: {why}");
                println!("SKIP {test}: {why} (scripts/cuda-shim builds the test driver)");
                false
            }
        }
    }

    /// Waits until a target's peers are gone (their connections closed,
    /// their borrows returned).
    fn settled(target: &TransferEngine) {
        let deadline = Instant::now() + WAIT;
        while target.stats().borrows > 0 || target.stats().connections > 0 {
            assert!(Instant::now() < deadline, "{:?}", target.stats());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A fake sysfs root, with nvidia-peermem loaded or not.
    fn sysfs(peermem: bool) -> std::path::PathBuf {
        let root = std::env::temp_dir().join(format!("orbite-sysfs-{}-{peermem}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("module")).unwrap();
        if peermem {
            std::fs::create_dir_all(root.join("module/nvidia_peermem")).unwrap();
        }
        root
    }

    const NO_DMABUF: &str = r#"[{"name": "shim0", "dmabuf": false, "ports": [{"state": "active",
        "gids": [{"gid": "::ffff:127.0.0.1", "type": "roce-v2"}]}]}]"#;

    /// WRITE from this engine's device memory into the peer's, then READ
    /// it back into another device range, both engines in this process,
    /// over rdma; the reason names `via`.
    fn device_to_device(via: &str) {
        let a = engine(r#"{"listen": "127.0.0.1:0", "route": "rdma", "task_bytes": 262144}"#);
        let b = engine(r#"{"listen": "127.0.0.1:0"}"#);
        let base = (a.stats(), b.stats());
        let len = 1 << 20;
        let (ma, mb) = (a.allocate_cuda_memory(0, 2 * len).unwrap(), b.allocate_cuda_memory(0, len).unwrap());
        let ia = a
            .register_memory_ranges(vec![MemoryRange::cuda(&ma, 0, 2 * len, Permission::LocalOnly).unwrap()])
            .unwrap()[0];
        let ib = b
            .register_memory_ranges(vec![MemoryRange::cuda(&mb, 0, len, Permission::RemoteReadWrite).unwrap()])
            .unwrap()[0];
        let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        // SAFETY: no transfer uses the memory yet.
        unsafe { ma.write(0, &data).unwrap() };
        let seg = a.open_segment(&b.endpoint().unwrap(), Some(b.source_epoch()), WAIT).unwrap();
        let (l, r) = ([Desc::new(ia, 0, len as u64)], [Desc::new(ib, 0, len as u64)]);
        let t = a.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
        assert_eq!(t.route().route, Route::Rdma);
        assert!(t.route().reason.contains(via), "{:?}", t.route());
        t.post().unwrap();
        assert!(wait_retired(&t).outcome.is_success());
        let mut back = vec![0u8; len];
        // SAFETY: the transfer retired.
        unsafe { mb.read(0, &mut back).unwrap() };
        assert!(back == data, "the peer's device memory has the bytes");
        let l2 = [Desc::new(ia, len as u64, len as u64)];
        let t2 = a.prepare(&TransferSpec::new(Op::Read, &l2, &r, Target::Peer(&seg))).unwrap();
        t2.post().unwrap();
        assert!(wait_retired(&t2).outcome.is_success());
        // SAFETY: as above.
        unsafe { ma.read(len, &mut back).unwrap() };
        assert!(back == data, "read back into device memory");
        drop((t, t2));
        a.close_segment(&seg, WAIT).unwrap();
        drop(seg);
        settled(&b);
        a.deregister(ia).unwrap();
        b.deregister(ib).unwrap();
        drop((ma, mb));
        // A worker lets go of its last task's loans just after the task
        // retired.
        let deadline = Instant::now() + WAIT;
        while (a.stats(), b.stats()) != base && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!((a.stats(), b.stats()), base, "charges back to baseline");
        a.close();
        b.close();
        drop((a, b));
        assert_shim_idle();
    }

    #[test]
    fn device_memory_through_dma_buf() {
        if in_shim_process("gpudirect::device_memory_through_dma_buf") && driver("dma-buf") {
            device_to_device("dma-buf");
        }
    }

    #[test]
    fn device_memory_through_nvidia_peermem() {
        let root = sysfs(true);
        let env = [("ORBITE_VERBS_SHIM_DEVICES", NO_DMABUF), ("ORBITE_SYSFS_ROOT", root.to_str().unwrap())];
        if in_shim_process_with("gpudirect::device_memory_through_nvidia_peermem", &env) && driver("peermem") {
            device_to_device("nvidia-peermem");
        }
    }

    /// Neither: this engine's device memory is staged through the pool
    /// (the reason says why), and the peer's cannot be reached by rdma.
    #[test]
    fn device_memory_without_gpudirect_is_staged() {
        let root = sysfs(false);
        let env = [("ORBITE_VERBS_SHIM_DEVICES", NO_DMABUF), ("ORBITE_SYSFS_ROOT", root.to_str().unwrap())];
        if !in_shim_process_with("gpudirect::device_memory_without_gpudirect_is_staged", &env) || !driver("staged") {
            return;
        }
        let a = engine(r#"{"listen": "127.0.0.1:0", "route": "rdma", "task_bytes": 262144}"#);
        let b = engine(r#"{"listen": "127.0.0.1:0"}"#);
        let base = (a.stats(), b.stats());
        let len = 1 << 20;
        let ma = a.allocate_cuda_memory(0, 2 * len).unwrap();
        let ia = a
            .register_memory_ranges(vec![MemoryRange::cuda(&ma, 0, 2 * len, Permission::LocalOnly).unwrap()])
            .unwrap()[0];
        let host = region(&b, len, Permission::RemoteReadWrite);
        let mb = b.allocate_cuda_memory(0, len).unwrap();
        let ib = b
            .register_memory_ranges(vec![MemoryRange::cuda(&mb, 0, len, Permission::RemoteReadWrite).unwrap()])
            .unwrap()[0];
        let data: Vec<u8> = (0..len).map(|i| (i * 13 % 241) as u8).collect();
        // SAFETY: no transfer uses the memory yet.
        unsafe { ma.write(0, &data).unwrap() };
        let seg = a.open_segment(&b.endpoint().unwrap(), Some(b.source_epoch()), WAIT).unwrap();
        let (l, r) = ([Desc::new(ia, 0, len as u64)], [Desc::new(host.id, 0, len as u64)]);
        let t = a.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
        assert_eq!(t.route().route, Route::Rdma);
        let reason = &t.route().reason;
        assert!(reason.contains("staged") && reason.contains("no GPUDirect"), "{reason}");
        t.post().unwrap();
        assert!(wait_retired(&t).outcome.is_success());
        assert!(snapshot(&host.mem) == data, "staged WRITE landed");
        let l2 = [Desc::new(ia, len as u64, len as u64)];
        let t2 = a.prepare(&TransferSpec::new(Op::Read, &l2, &r, Target::Peer(&seg))).unwrap();
        t2.post().unwrap();
        assert!(wait_retired(&t2).outcome.is_success());
        let mut back = vec![0u8; len];
        // SAFETY: the transfer retired.
        unsafe { ma.read(len, &mut back).unwrap() };
        assert!(back == data, "staged READ landed in device memory");
        // The peer's device memory has no region: rdma cannot reach it.
        let rv = [Desc::new(ib, 0, len as u64)];
        match a.prepare(&TransferSpec::new(Op::Write, &l, &rv, Target::Peer(&seg))) {
            Err(Error::Peer(PeerError::RouteUnavailable { route: Route::Rdma, reason })) => {
                assert!(reason.contains("device memory"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        drop((t, t2));
        a.close_segment(&seg, WAIT).unwrap();
        drop(seg);
        settled(&b);
        a.deregister(ia).unwrap();
        b.deregister(ib).unwrap();
        b.deregister(host.id).unwrap();
        drop((ma, mb, host));
        a.close();
        b.close();
        assert_eq!((a.stats().registrations, b.stats().registrations), (base.0.registrations, base.1.registrations));
        drop((a, b));
        assert_shim_idle();
    }
}

/// Two NICs: a fake sysfs root puts them on NUMA nodes `numa`, and the
/// shim describes both (on the one fabric).
fn two_nics(numa: [u32; 2]) -> (String, std::path::PathBuf) {
    let root = std::env::temp_dir().join(format!("orbite-sysfs-nics-{}-{}{}", std::process::id(), numa[0], numa[1]));
    let _ = std::fs::remove_dir_all(&root);
    for (i, n) in numa.iter().enumerate() {
        let dir = root.join(format!("class/infiniband/shim{i}/device"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("numa_node"), format!("{n}\n")).unwrap();
    }
    let nic = |name: &str| {
        format!(
            r#"{{"name": "{name}", "ports": [{{"state": "active", "gids": [{{"gid": "::ffff:127.0.0.1", "type": "roce-v2"}}]}}]}}"#
        )
    };
    (format!("[{}, {}]", nic("shim0"), nic("shim1")), root)
}

/// WRITEs `len` bytes to the peer over rdma and checks they landed.
fn write_through(e: &TransferEngine, p: &mut PeerProcess, seg: &RemoteSegment, local: &Region, len: u64) {
    let (l, r) = ([Desc::new(local.id, 0, len)], [Desc::new(p.region, 0, len)]);
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(seg))).unwrap();
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    assert_eq!(p.hash(0, len as usize), fnv(&snapshot(&local.mem)[..len as usize]));
}

/// Two NICs equally close to the memory: a transfer's tasks go to both in
/// turn; a NIC whose port is down takes no new task, the other carries
/// the transfer, and it takes tasks again once back.
#[test]
fn two_nics_stripe_and_a_failed_nic_takes_no_new_tasks() {
    let (devices, root) = two_nics([0, 0]);
    let env = [("ORBITE_VERBS_SHIM_DEVICES", devices.as_str()), ("ORBITE_SYSFS_ROOT", root.to_str().unwrap())];
    if !in_shim_process_with("two_nics_stripe_and_a_failed_nic_takes_no_new_tasks", &env) {
        return;
    }
    let mut p = PeerProcess::spawn();
    let e = initiator("");
    let seg = p.open(&e);
    let local = region(&e, REGION, Permission::RemoteReadWrite);
    fill(&local.mem, 11);
    write_through(&e, &mut p, &seg, &local, 4 << 20);
    let striped = executed_per_device();
    assert!(striped[0] > 0 && striped[1] > 0, "both NICs took tasks: {striped:?}");
    port_of(1, false);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        fill(&local.mem, 12);
        let before = executed_per_device();
        write_through(&e, &mut p, &seg, &local, 4 << 20);
        let after = executed_per_device();
        if after[1] == before[1] {
            assert!(after[0] > before[0], "the working NIC carried it");
            break;
        }
        // The port event is asynchronous: until it lands, the down NIC's
        // tasks fail and the transfer with them; wait for it.
        assert!(Instant::now() < deadline, "the NIC that is down still takes tasks");
        std::thread::sleep(Duration::from_millis(20));
    }
    port_of(1, true);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let before = executed_per_device();
        write_through(&e, &mut p, &seg, &local, 4 << 20);
        if executed_per_device()[1] > before[1] {
            break;
        }
        assert!(Instant::now() < deadline, "the NIC never took tasks again");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop((seg, local));
    e.close();
    drop(e);
    assert_shim_idle();
    p.kill();
}

/// NICs on different NUMA nodes: host memory's tasks go to the NIC on
/// its node only.
#[test]
fn host_memory_uses_the_nic_on_its_numa_node() {
    let (devices, root) = two_nics([0, 1]);
    let env = [("ORBITE_VERBS_SHIM_DEVICES", devices.as_str()), ("ORBITE_SYSFS_ROOT", root.to_str().unwrap())];
    if !in_shim_process_with("host_memory_uses_the_nic_on_its_numa_node", &env) {
        return;
    }
    let mut p = PeerProcess::spawn();
    let e = initiator("");
    let seg = p.open(&e);
    let local = region(&e, REGION, Permission::RemoteReadWrite);
    fill(&local.mem, 13);
    write_through(&e, &mut p, &seg, &local, 4 << 20);
    // The memory is on node 0 or 1 (wherever the kernel put it): one NIC.
    let per = executed_per_device();
    assert!((per[0] > 0) != (per[1] > 0), "only the NIC on the memory's node: {per:?}");
    drop((seg, local));
    e.close();
    drop(e);
    assert_shim_idle();
    p.kill();
}

/// Sends one RdmaConnect on `s` asking for `cards`: the reply's header
/// kind and body.
fn rdma_connect(s: &mut std::net::TcpStream, epoch: u64, cards: &[wire::QpCard]) -> (wire::Kind, Vec<u8>) {
    use std::io::Write;
    let mut body = Vec::new();
    wire::encode_rdma_connect(&mut body, epoch, cards);
    let mut frame = wire::encode_header(&wire::header(wire::Kind::RdmaConnect, body.len(), 0, 1)).to_vec();
    frame.extend_from_slice(&body);
    s.write_all(&frame).unwrap();
    let (h, body) = read_frame(s);
    (h.kind, body)
}

/// What a hostile peer can ask of the RdmaConnect exchange, refused with a
/// typed error while the engine keeps serving: a second connect on one
/// connection, a NIC the target does not have, more queue pairs than an
/// address's share, a malformed card (the connection closes); and the
/// queue pairs go with their connection.
#[test]
fn hostile_rdma_connects_are_refused_and_bounded() {
    if !in_shim_process("hostile_rdma_connects_are_refused_and_bounded") {
        return;
    }
    let mut p = PeerProcess::spawn();
    let card = |nic: u8, peer_nic: u8| wire::QpCard {
        gid: std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped().octets(),
        qpn: 0x01_0001,
        psn: 7,
        mtu: 4096,
        nic,
        peer_nic,
    };
    let connect = || {
        let s = std::net::TcpStream::connect(&p.endpoint).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    };
    // 64 queue pairs on one connection: granted, one card each.
    let mut a = connect();
    let (kind, body) = rdma_connect(&mut a, p.epoch, &vec![card(0, 0); 64]);
    assert_eq!(kind, wire::Kind::RdmaAccept, "{:?}", refusal(&body));
    assert_eq!(wire::decode_rdma_accept(&body).unwrap().len(), 64);
    // A second connect on that connection: refused.
    let (kind, body) = rdma_connect(&mut a, p.epoch, &[card(0, 0)]);
    assert_eq!(kind, wire::Kind::Error);
    assert!(refusal(&body).1.contains("connected already"), "{:?}", refusal(&body));
    // A NIC the target does not have.
    let mut b = connect();
    let (kind, body) = rdma_connect(&mut b, p.epoch, &[card(0, 7)]);
    assert_eq!(kind, wire::Kind::Error);
    assert!(refusal(&body).1.contains("no RDMA NIC 7"), "{:?}", refusal(&body));
    // The address's share: 64 more fit, then no more.
    let mut c = connect();
    let (kind, _) = rdma_connect(&mut c, p.epoch, &vec![card(0, 0); 64]);
    assert_eq!(kind, wire::Kind::RdmaAccept);
    let mut d = connect();
    let (kind, body) = rdma_connect(&mut d, p.epoch, &[card(0, 0)]);
    assert_eq!(kind, wire::Kind::Error);
    let (status, detail) = refusal(&body);
    assert_eq!(status, wire::RemoteStatus::ResourceExhausted);
    assert!(detail.contains("share"), "{detail}");
    // Closing a connection gives its queue pairs back.
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (kind, _) = rdma_connect(&mut connect(), p.epoch, &[card(0, 0)]);
        if kind == wire::Kind::RdmaAccept {
            break;
        }
        assert!(Instant::now() < deadline, "the closed connection's queue pairs were never given back");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A malformed card closes that connection only.
    let mut bad = card(0, 0);
    bad.mtu = 1500;
    let mut body = Vec::new();
    wire::encode_rdma_connect(&mut body, p.epoch, &[bad]);
    let mut frame = wire::encode_header(&wire::header(wire::Kind::RdmaConnect, body.len(), 0, 1)).to_vec();
    frame.extend_from_slice(&body);
    let mut e = connect();
    std::io::Write::write_all(&mut e, &frame).unwrap();
    let mut sink = [0u8; 64];
    assert!(matches!(std::io::Read::read(&mut e, &mut sink), Ok(0) | Err(_)), "closed");
    // The engine keeps serving: a real peer moves bytes over rdma.
    drop((b, c, d));
    let en = initiator("");
    let seg = p.open(&en);
    let local = region(&en, 1 << 20, Permission::RemoteReadWrite);
    fill(&local.mem, 21);
    write_through(&en, &mut p, &seg, &local, 1 << 20);
    drop((seg, local));
    en.close();
    drop(en);
    assert_shim_idle();
    p.kill();
}
