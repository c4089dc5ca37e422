//! Driver copies (feature `cuda`): the self connection, and shm into a
//! same-host peer's mapping, with CUDA device memory on the local side
//! ([`Device`]); cuda-ipc's copies run the same way. A task's copies are
//! queued on the worker's stream ([`Issued`]) and waited for with an
//! event. Copies whose source and destination overlap are cut
//! into pieces in memmove order.

use std::sync::Arc;

use super::{Copier, LocalSide, NoDeviceCopy, Posted};
use crate::transport::Span;
use crate::transport::liveness::LivenessCheck;
use crate::types::{Op, TaskEnd};

/// Driver copies on the worker's own stream of `device`, waited for with
/// an event before the task reports (feature `cuda`); never run on the
/// posting thread. Remote addresses are this process's: its own memory
/// (the self connection), or a same-host peer's shared allocations mapped
/// here (shm, checked after each task as for shm's CPU copies).
///
/// The host memory named (`pins`: this engine's host registrations, or
/// the peer's mappings) is page-locked for the driver on the first task,
/// so the copy engine reaches it without a bounce.
pub(crate) struct Device {
    /// The CUDA ordinal of the first device registration named.
    pub(super) device: u32,
    pub(super) pins: Vec<Arc<crate::cuda::HostPin>>,
    pub(super) peer_alive: Option<LivenessCheck>,
}

impl Copier for Device {
    fn name(&self) -> &'static str {
        "driver copies"
    }

    fn copy(&self, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>) {
        post_and_finish(self, op, spans, limit)
    }

    fn post(&self, op: Op, spans: &[Span], limit: u64) -> Option<Result<Box<dyn Posted>, (u64, Option<TaskEnd>)>> {
        for p in &self.pins {
            p.ensure(self.device);
        }
        Some(issue(self.device, &copies(op, spans, limit), self.peer_alive.clone(), op))
    }

    fn with_local(self: Box<Self>, local: &LocalSide<'_>) -> Result<Box<dyn Copier>, NoDeviceCopy> {
        local.host_only(self)
    }

    fn waits(&self) -> bool {
        true
    }

    /// Copies within one engine whose source and destination overlap are
    /// cut into pieces (memmove semantics): the first span that would
    /// need more than [`MAX_OVERLAP_PIECES`] copies, and why.
    fn refuse(&self, op: Op, spans: &[Span]) -> Option<(usize, String)> {
        spans.iter().enumerate().find_map(|(index, s)| {
            let (src, dst) = match op {
                Op::Write => (s.local, s.remote),
                Op::Read => (s.remote, s.local),
            };
            (memmove_pieces(dst, src, s.len) > MAX_OVERLAP_PIECES).then(|| {
                let reason = format!(
                    "span {index}: source and destination of {} bytes of device memory overlap {} bytes apart: more than {} copies",
                    s.len,
                    dst.abs_diff(src),
                    MAX_OVERLAP_PIECES
                );
                (index, reason)
            })
        })
    }

    fn device_note(&self) -> Option<String> {
        let d = self.device;
        Some(match self.peer_alive {
            None => format!("CUDA device memory (device {d}) by driver copies"),
            Some(_) => {
                format!("CUDA device memory (device {d}) by driver copies straight into the peer's shared memory")
            }
        })
    }
}

/// A posting copier's task run to its end on the calling thread.
pub(super) fn post_and_finish(c: &dyn Copier, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>) {
    match c.post(op, spans, limit) {
        Some(Ok(posted)) => posted.finish(),
        Some(Err(ended)) => ended,
        None => (0, Some(TaskEnd::Failed { effect_unknown: false })),
    }
}

/// Queues `copies` on this thread's stream of `device`.
pub(super) fn issue(
    device: u32,
    copies: &[(u64, u64, u64)],
    peer_alive: Option<LivenessCheck>,
    op: Op,
) -> Result<Box<dyn Posted>, (u64, Option<TaskEnd>)> {
    let bytes = copies.iter().map(|c| c.2).sum();
    match crate::cuda::issue_on_stream(device, copies) {
        Ok(ticket) => Ok(Box::new(Issued { ticket, bytes, peer_alive, op })),
        // The bytes of the copies before the failing one landed; whether
        // the failing one wrote anything is not known.
        Err((done, _why)) => Err((done, Some(TaskEnd::Failed { effect_unknown: true }))),
    }
}

/// The driver copies of a [`Device`] task: (destination, source, bytes).
fn copies(op: Op, spans: &[Span], limit: u64) -> Vec<(u64, u64, u64)> {
    let mut copies = Vec::with_capacity(spans.len());
    for (s, n) in super::within(spans, limit) {
        let (src, dst) = match op {
            Op::Write => (s.local, s.remote),
            Op::Read => (s.remote, s.local),
        };
        push_memmove(&mut copies, dst, src, n);
    }
    copies
}

/// A task's driver copies queued on the worker's stream, to be finished
/// on the same thread.
struct Issued {
    ticket: crate::cuda::Ticket,
    bytes: u64,
    /// A same-host peer whose memory the copies reach: checked after them.
    peer_alive: Option<LivenessCheck>,
    op: Op,
}

impl Posted for Issued {
    fn await_done(&self) {
        crate::cuda::await_ticket(&self.ticket);
    }

    /// A same-host peer that died meanwhile fails the task, as for a CPU
    /// copy into its memory.
    fn finish(self: Box<Self>) -> (u64, Option<TaskEnd>) {
        match crate::cuda::wait_ticket(self.ticket) {
            Ok(()) => (self.bytes, crate::transport::liveness::after_one_sided(self.op, self.peer_alive.as_ref())),
            Err(_why) => (0, Some(TaskEnd::Failed { effect_unknown: true })),
        }
    }
}

/// Most pieces one span of a device copy is cut into where its source and
/// destination overlap (a span that would need more is refused at prepare).
pub(crate) const MAX_OVERLAP_PIECES: u64 = 1024;

/// Pieces of `n` bytes from `src` to `dst` with memmove semantics: the
/// driver's copies are undefined where source and destination overlap, so
/// an overlapping copy is cut into pieces no longer than the distance
/// between them, in the order that reads every byte before it is
/// overwritten (stream order runs them one after another). A copy onto
/// itself stays one copy: whatever the order, each byte gets its own value.
pub(crate) fn push_memmove(out: &mut Vec<(u64, u64, u64)>, dst: u64, src: u64, n: u64) {
    let d = dst.abs_diff(src);
    if d == 0 || d >= n {
        out.push((dst, src, n));
        return;
    }
    let pieces = n.div_ceil(d);
    let piece = |i: u64| {
        let off = i * d;
        (dst + off, src + off, d.min(n - off))
    };
    if dst < src {
        out.extend((0..pieces).map(piece));
    } else {
        out.extend((0..pieces).rev().map(piece));
    }
}

/// Pieces [`push_memmove`] cuts a span of `n` bytes from `src` to `dst`
/// into.
pub(crate) fn memmove_pieces(dst: u64, src: u64, n: u64) -> u64 {
    match dst.abs_diff(src) {
        d if d == 0 || d >= n => 1,
        d => n.div_ceil(d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `push_memmove`'s pieces, run in order on a byte array, give what
    /// `copy_within` (memmove) gives, for every distance and direction.
    #[test]
    fn overlapping_device_copies_are_cut_into_memmove_order() {
        for n in [1u64, 2, 7, 64, 100] {
            for src in 0..20u64 {
                for dst in 0..20u64 {
                    let mut want: Vec<u8> = (0..140u8).collect();
                    let mut got = want.clone();
                    want.copy_within(src as usize..(src + n) as usize, dst as usize);
                    let mut pieces = Vec::new();
                    push_memmove(&mut pieces, dst, src, n);
                    assert_eq!(pieces.len() as u64, memmove_pieces(dst, src, n));
                    let mut bytes = 0;
                    for (d, s, len) in pieces {
                        assert!(d == s || d.abs_diff(s) >= len, "a piece overlaps itself");
                        let tmp = got[s as usize..(s + len) as usize].to_vec();
                        got[d as usize..(d + len) as usize].copy_from_slice(&tmp);
                        bytes += len;
                    }
                    assert_eq!(got, want, "n {n} src {src} dst {dst}");
                    assert_eq!(bytes, n, "every byte is counted");
                }
            }
        }
    }
}
