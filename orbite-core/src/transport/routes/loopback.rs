//! The self connection: copies between registrations of this engine (what
//! NIXL uses for local transfers), on the local workers.

use super::{Copier, LocalSide, Mover, NoDeviceCopy, Reach, RouteImpl, Unreachable};
use crate::transport::Span;
use crate::types::{Desc, Op, Route, TaskEnd};

/// The self-connection route.
pub(crate) struct Loopback;

impl RouteImpl for Loopback {
    fn route(&self) -> Route {
        Route::Loopback
    }

    fn serves(&self, target: &Reach<'_>) -> bool {
        matches!(target, Reach::Loopback)
    }

    fn auto_reason(&self) -> Option<&'static str> {
        Some("self connection")
    }

    fn plan(&self, target: &Reach<'_>, _remote: &[Desc]) -> Result<Mover, Unreachable> {
        match target {
            Reach::Loopback => Ok(Mover::Copy(Box::new(Memory))),
            _ => Err(Unreachable::NotThisEngine),
        }
    }
}

/// Copies between addresses of this process (the self connection).
#[derive(Debug)]
pub(crate) struct Memory;

impl Copier for Memory {
    fn name(&self) -> &'static str {
        "memory copies"
    }

    fn copy(&self, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>) {
        // SAFETY: the job retains the range loans of every span, and the
        // lifecycle admits each task once.
        (unsafe { copy_spans(op, spans, limit) }, None)
    }

    /// Device memory on the local side: driver copies.
    fn with_local(self: Box<Self>, local: &LocalSide<'_>) -> Result<Box<dyn Copier>, NoDeviceCopy> {
        let Some(device) = local.device else { return Ok(self) };
        Ok(Box::new(super::device::Device { device, pins: local.pins(), peer_alive: None }))
    }
}

/// Copies the spans of a self-connection program in order, at most `limit`
/// bytes; returns bytes copied.
///
/// # Safety
/// Every span must address memory of this process valid for its length
/// (kept alive by the caller's range loans), and no other thread may write
/// those bytes meanwhile.
pub(crate) unsafe fn copy_spans(op: Op, spans: &[Span], limit: u64) -> u64 {
    let mut done = 0u64;
    for s in spans {
        let left = limit - done;
        if left == 0 {
            break;
        }
        let n = s.len.min(left) as usize;
        let (src, dst) = match op {
            Op::Write => (s.local, s.remote),
            Op::Read => (s.remote, s.local),
        };
        // SAFETY: valid per the function contract; `copy` (memmove) because
        // a local transfer may name overlapping ranges of one registration.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
        done += n as u64;
    }
    done
}
