//! Faults a test injects, through `orbite_verbs_shim_inject` and
//! `orbite_verbs_shim_port`: a queue pair moved to ERR (with its
//! `IBV_EVENT_QP_FATAL`), its next request failing with retry exceeded or
//! a remote access error, its completions held until released or each
//! request delayed, and a port taken down (its queue pairs' requests fail
//! as a link that is gone fails them, with `IBV_EVENT_PORT_ERR`) or
//! brought back (`IBV_EVENT_PORT_ACTIVE`).

use std::collections::HashSet;
use std::ffi::c_int;
use std::sync::{Mutex, OnceLock};

/// `orbite_verbs_shim_inject`'s faults.
pub const FAULT_QP_ERROR: c_int = 1;
pub const FAULT_RETRY_EXCEEDED: c_int = 2;
pub const FAULT_REMOTE_ACCESS: c_int = 3;
pub const FAULT_HOLD_COMPLETIONS: c_int = 4;
pub const FAULT_RELEASE_COMPLETIONS: c_int = 5;
pub const FAULT_DELAY_MS: c_int = 6;

/// `ibv_event_type` values the shim raises.
pub const EVENT_QP_FATAL: i32 = 1;
pub const EVENT_PORT_ACTIVE: i32 = 9;
pub const EVENT_PORT_ERR: i32 = 10;

/// What is injected on one queue pair.
#[derive(Default)]
pub struct QpFaults {
    /// The status the next request completes with, not sent.
    pub next_error: Option<i32>,
    /// Completions held (`Some`) instead of completed.
    pub held: Option<Vec<crate::abi::IbvWc>>,
    /// Each request waits this long first.
    pub delay_ms: u32,
}

fn down() -> &'static Mutex<HashSet<(usize, u8)>> {
    static D: OnceLock<Mutex<HashSet<(usize, u8)>>> = OnceLock::new();
    D.get_or_init(Default::default)
}

/// Whether port `port` of device `device` (its index) was taken down.
pub fn port_down(device: usize, port: u8) -> bool {
    down().lock().unwrap_or_else(|e| e.into_inner()).contains(&(device, port))
}

/// Injects `fault` on the queue pair `qpn` of this process (`arg`: the
/// delay in milliseconds for `FAULT_DELAY_MS`). 0, or EINVAL for an
/// unknown queue pair or fault.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_verbs_shim_inject(qpn: u32, fault: c_int, arg: u32) -> c_int {
    let Some(qp) = crate::fabric::lookup(qpn) else { return libc::EINVAL };
    let mut f = qp.faults.lock().unwrap_or_else(|e| e.into_inner());
    match fault {
        FAULT_QP_ERROR => {
            drop(f);
            let mut st = qp.st.lock().unwrap_or_else(|e| e.into_inner());
            qp.to_error(&mut st);
            drop(st);
            qp.event(EVENT_QP_FATAL);
        }
        FAULT_RETRY_EXCEEDED => f.next_error = Some(crate::verbs::WC_RETRY_EXC_ERR),
        FAULT_REMOTE_ACCESS => f.next_error = Some(crate::verbs::WC_REM_ACCESS_ERR),
        FAULT_HOLD_COMPLETIONS => f.held = Some(f.held.take().unwrap_or_default()),
        FAULT_RELEASE_COMPLETIONS => {
            let held = f.held.take().unwrap_or_default();
            drop(f);
            for wc in held {
                qp.send_cq().push(wc);
            }
        }
        FAULT_DELAY_MS => f.delay_ms = arg,
        _ => return libc::EINVAL,
    }
    0
}

/// Writes the numbers of this process's queue pairs (at most `cap`) to
/// `out`: how many there are (more than `cap` when they did not all fit),
/// so a test can inject faults on the queue pairs an engine made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_verbs_shim_qps(out: *mut u32, cap: usize) -> usize {
    let qps = crate::fabric::live();
    if !out.is_null() {
        for (i, q) in qps.iter().take(cap).enumerate() {
            // SAFETY: the caller's array of `cap` entries.
            unsafe { *out.add(i) = *q };
        }
    }
    qps.len()
}

/// The described device (its index) queue pair `qpn` of this process
/// belongs to, and how many requests it executed with success. 0, or
/// EINVAL for an unknown queue pair.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_verbs_shim_qp_info(qpn: u32, device: *mut u32, executed: *mut u64) -> c_int {
    let Some(qp) = crate::fabric::lookup(qpn) else { return libc::EINVAL };
    // SAFETY: the context outlives its queue pairs.
    let ctx = unsafe { &*(qp.ctx as *const crate::Context) };
    // SAFETY: the caller's out-values (null: not wanted).
    unsafe {
        if !device.is_null() {
            *device = ctx.device_index() as u32;
        }
        if !executed.is_null() {
            *executed = qp.executed.load(std::sync::atomic::Ordering::Relaxed);
        }
    }
    0
}

/// Takes port `port` of the described device `device` (its index) down
/// (`up` 0) or back up, raising the port event on every open context of
/// that device. A queue pair on a port that is down fails its requests
/// with retry exceeded and goes to ERR.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_verbs_shim_port(device: u32, port: u8, up: c_int) -> c_int {
    let key = (device as usize, port);
    let changed = {
        let mut d = down().lock().unwrap_or_else(|e| e.into_inner());
        if up != 0 { d.remove(&key) } else { d.insert(key) }
    };
    if changed {
        let event = if up != 0 { EVENT_PORT_ACTIVE } else { EVENT_PORT_ERR };
        for &c in crate::contexts().lock().unwrap_or_else(|e| e.into_inner()).iter() {
            // SAFETY: an open context (closing removes it under this lock).
            let c = unsafe { &*(c as *const crate::Context) };
            if c.device_index() == device as usize {
                c.post_event(event, port as usize);
            }
        }
    }
    0
}
