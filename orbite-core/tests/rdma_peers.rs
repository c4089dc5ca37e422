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

fn shim_stats() -> ShimStats {
    let path = std::ffi::CString::new(std::env::var("ORBITE_IBVERBS_LIB").unwrap()).unwrap();
    // SAFETY: a NUL-terminated path; the handle is never closed.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    assert!(!handle.is_null(), "the engine loaded the shim");
    // SAFETY: a live handle, a NUL-terminated name.
    let f = unsafe { libc::dlsym(handle, c"orbite_verbs_shim_stats".as_ptr()) };
    assert!(!f.is_null());
    // SAFETY: the shim's export of this signature.
    let f: unsafe extern "C" fn(*mut ShimStats) -> c_int = unsafe { std::mem::transmute(f) };
    let mut s = ShimStats::default();
    // SAFETY: a struct of the shim's layout.
    assert_eq!(unsafe { f(&mut s) }, 0);
    s
}

/// Whether this process runs `test`'s body: yes with the library set;
/// else the test runs in a child that has it (and this checks the child
/// passed), or is skipped without a shim.
fn in_shim_process(test: &str) -> bool {
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
    drop(seg);
    e.deregister(local.id).unwrap();
    drop(local);
    let s = e.stats();
    assert_eq!((s.registrations, s.registered_bytes), (base.registrations, base.registered_bytes));
    e.close();
    drop(e);
    let left = shim_stats();
    assert_eq!((left.qps, left.mrs, left.pds, left.cqs, left.contexts), (0, 0, 0, 0, 0), "{left:?}");
    p.kill();
}
