//! Driver copies (feature `cuda`): the self connection, and shm into a
//! same-host peer's mapping, with CUDA device memory on the local side
//! (`CopyKind::Device`); cuda-ipc's copies run the same way. A task's
//! copies are queued on the worker's stream ([`Issued`]) and waited for
//! with an event. Copies whose source and destination overlap are cut
//! into pieces in memmove order.

use super::CopyKind;
use crate::transport::{CopyProgram, Span};
use crate::types::Op;

impl CopyProgram {
    /// Device copies within one engine whose source and destination
    /// overlap are cut into pieces (memmove semantics): the first span
    /// that would need more than [`MAX_OVERLAP_PIECES`] copies, and why.
    pub(crate) fn device_overlaps(&self) -> Option<(usize, String)> {
        let p = self;
        if !matches!(p.mover.copies(), Some(CopyKind::Device { .. })) {
            return None;
        }
        p.spans.iter().enumerate().find_map(|(index, s)| {
            let (src, dst) = match p.op {
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
}

/// The driver copies of a `Device` task: (destination, source, bytes).
pub(super) fn copies(op: Op, spans: &[Span], limit: u64) -> Vec<(u64, u64, u64)> {
    let mut copies = Vec::with_capacity(spans.len());
    let mut left = limit;
    for s in spans {
        if left == 0 {
            break;
        }
        let n = s.len.min(left);
        let (src, dst) = match op {
            Op::Write => (s.local, s.remote),
            Op::Read => (s.remote, s.local),
        };
        push_memmove(&mut copies, dst, src, n);
        left -= n;
    }
    copies
}

/// A task's driver copies queued on the worker's stream
/// ([`CopyKind::issue`](super::CopyKind::issue)), to be completed on the same thread.
pub(crate) struct Issued {
    pub(super) ticket: crate::cuda::Ticket,
    pub(super) bytes: u64,
    /// A staged task's buffer and what is left to do after the device.
    pub(super) staged: Option<super::staging::StagedTask>,
}

impl Issued {
    /// Whether a staging buffer is held until it completes.
    pub(crate) fn is_staged(&self) -> bool {
        self.staged.is_some()
    }

    /// Sleeps until these copies (and those queued before them on the
    /// same stream) are done.
    pub(crate) fn await_done(&self) {
        crate::cuda::await_ticket(&self.ticket);
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
