//! The bounded poll that idle workers do before sleeping: one thread at a
//! time polls, for at most `spin_us`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Claims the right to poll; false if another thread holds it.
pub(crate) fn claim(flag: &AtomicBool) -> bool {
    flag.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_ok()
}

/// Polls `pending` for up to `spin`; true if work arrived.
pub(crate) fn poll(pending: &AtomicUsize, spin: Duration) -> bool {
    let start = Instant::now();
    loop {
        for _ in 0..64 {
            if pending.load(Ordering::Acquire) > 0 {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= spin {
            return false;
        }
    }
}
