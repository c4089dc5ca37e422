//! Staging (feature `cuda`): a task whose local side is CUDA device memory
//! on a same-host route (shm, cma), bounced through two page-locked host
//! buffers of the route worker. WRITE copies chunk k + 1 from the device
//! into one buffer while the CPU copies chunk k out of the other; READ
//! copies chunk k into one buffer while the device takes chunk k - 1 from
//! the other. A task reports only after its last device copy completed.
//!
//! Each worker's buffers (two of `staging_chunk_bytes` per device it
//! staged for) are charged to `staging_buffers`/`staging_bytes` and given
//! back when the worker ends.

use std::cell::RefCell;
use std::sync::Arc;

use crate::charge::{Charge, Counter, Counters};
use crate::cuda::Stager;
use crate::transport::{CopyKind, Span};
use crate::types::{Op, TaskEnd};

thread_local! {
    /// This worker's stagers, by device and chunk size.
    static STAGERS: RefCell<Vec<(u32, Stager, Charge)>> = const { RefCell::new(Vec::new()) };
}

/// Gives back this thread's staging buffers (a route worker, as it ends).
pub(crate) fn release_thread_stagers() {
    let stagers = STAGERS.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
    drop(stagers);
}

/// One chunk: pieces of the task's spans, laid out back to back in a
/// staging buffer (`local` is the device side, `remote` the route's).
struct Chunk {
    pieces: Vec<Span>,
}

/// Cuts the first `limit` bytes of `spans` into chunks of at most `chunk`
/// bytes.
fn chunks(spans: &[Span], limit: u64, chunk: u64) -> Vec<Chunk> {
    let mut out = Vec::new();
    let mut cur = Chunk { pieces: Vec::new() };
    let (mut fill, mut left) = (0u64, limit);
    for s in spans {
        let mut at = 0u64;
        while at < s.len && left > 0 {
            let n = (s.len - at).min(chunk - fill).min(left);
            cur.pieces.push(Span { local: s.local + at, remote: s.remote + at, remote_reg: s.remote_reg, len: n });
            (at, fill, left) = (at + n, fill + n, left - n);
            if fill == chunk {
                out.push(std::mem::replace(&mut cur, Chunk { pieces: Vec::new() }));
                fill = 0;
            }
        }
    }
    if !cur.pieces.is_empty() {
        out.push(cur);
    }
    out
}

impl Chunk {
    fn bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// The chunk as the route sees it: local addresses in `buffer`.
    fn host_spans(&self, buffer: u64) -> Vec<Span> {
        let mut at = 0;
        self.pieces
            .iter()
            .map(|p| {
                let s = Span { local: buffer + at, remote: p.remote, remote_reg: p.remote_reg, len: p.len };
                at += p.len;
                s
            })
            .collect()
    }

    /// The device copies between the pieces' local ranges and `buffer`:
    /// into the buffer for a WRITE, out of it for a READ.
    fn device_copies(&self, op: Op, buffer: u64) -> Vec<(u64, u64, u64)> {
        let mut at = 0;
        self.pieces
            .iter()
            .map(|p| {
                let b = buffer + at;
                at += p.len;
                match op {
                    Op::Write => (b, p.local, p.len),
                    Op::Read => (p.local, b, p.len),
                }
            })
            .collect()
    }
}

/// Copies a task through this worker's stager of `device`: the bytes moved
/// (a prefix) and, on failure, how the task ended.
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy(
    device: u32,
    chunk: u64,
    bound: u64,
    counters: &Arc<Counters>,
    inner: &CopyKind,
    op: Op,
    spans: &[Span],
    limit: u64,
) -> (u64, Option<TaskEnd>) {
    STAGERS.with(|cell| {
        let mut stagers = cell.borrow_mut();
        let at = match stagers.iter().position(|(d, s, _)| *d == device && s.chunk() == chunk) {
            Some(i) => i,
            None => {
                let charge = Charge::try_new(
                    counters,
                    [
                        (Counter::StagingBuffers, 2, None),
                        (Counter::StagingBytes, 2 * chunk, Some((crate::types::Resource::StagingBytes, bound))),
                    ],
                );
                // Charged first: over the bound, nothing is allocated.
                let Ok(charge) = charge else { return (0, Some(TaskEnd::Failed { effect_unknown: false })) };
                match Stager::new(device, chunk) {
                    Ok(s) => {
                        stagers.push((device, s, charge));
                        stagers.len() - 1
                    }
                    Err(_) => return (0, Some(TaskEnd::Failed { effect_unknown: false })),
                }
            }
        };
        let st = &mut stagers[at].1;
        let chunks = chunks(spans, limit, chunk);
        let result = match op {
            Op::Write => write(st, inner, &chunks),
            Op::Read => read(st, inner, &chunks),
        };
        if result.1.is_some() {
            st.drain(); // nothing of this task may still run
        }
        result
    })
}

/// Device to buffer (chunk k + 1) while the route copies chunk k out.
fn write(st: &mut Stager, inner: &CopyKind, chunks: &[Chunk]) -> (u64, Option<TaskEnd>) {
    let device_failed = Some(TaskEnd::Failed { effect_unknown: false });
    if let Some(first) = chunks.first() {
        if st.enqueue(0, &first.device_copies(Op::Write, st.buffer(0))).is_err() {
            return (0, device_failed);
        }
    }
    let mut done = 0u64;
    for (k, c) in chunks.iter().enumerate() {
        let slot = k % 2;
        if st.wait(slot).is_err() {
            return (done, device_failed);
        }
        if let Some(next) = chunks.get(k + 1) {
            let other = (k + 1) % 2;
            if st.enqueue(other, &next.device_copies(Op::Write, st.buffer(other))).is_err() {
                return (done, device_failed);
            }
        }
        let (n, end) = inner.copy(Op::Write, &c.host_spans(st.buffer(slot)), u64::MAX);
        done += n;
        if end.is_some() {
            return (done, end);
        }
    }
    (done, None)
}

/// Route into a buffer (chunk k) while the device takes chunk k - 1.
fn read(st: &mut Stager, inner: &CopyKind, chunks: &[Chunk]) -> (u64, Option<TaskEnd>) {
    // A failed device copy into local memory: what it wrote is not known.
    let device_failed = Some(TaskEnd::Failed { effect_unknown: true });
    let (mut landed, mut pending) = (0u64, [0u64; 2]);
    for (k, c) in chunks.iter().enumerate() {
        let slot = k % 2;
        // The buffer's previous chunk must be on the device before reuse.
        if st.wait(slot).is_err() {
            return (landed, device_failed);
        }
        landed += std::mem::take(&mut pending[slot]);
        let (_, end) = inner.copy(Op::Read, &c.host_spans(st.buffer(slot)), u64::MAX);
        if let Some(end) = end {
            // What reached the buffer never reached the device; the chunks
            // before it land first.
            let other = (k + 1) % 2;
            if st.wait(other).is_err() {
                return (landed, device_failed);
            }
            landed += pending[other];
            return (landed, Some(end));
        }
        if st.enqueue(slot, &c.device_copies(Op::Read, st.buffer(slot))).is_err() {
            return (landed, device_failed);
        }
        pending[slot] = c.bytes();
    }
    for slot in [chunks.len() % 2, (chunks.len() + 1) % 2] {
        if st.wait(slot).is_err() {
            return (landed, device_failed);
        }
        landed += std::mem::take(&mut pending[slot]);
    }
    (landed, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(local: u64, remote: u64, len: u64) -> Span {
        Span { local, remote, remote_reg: 1, len }
    }

    #[test]
    fn chunks_cover_the_spans_in_order_and_respect_the_limit() {
        let spans = [span(1000, 5000, 10), span(2000, 9000, 7)];
        let c = chunks(&spans, u64::MAX, 4);
        let sizes: Vec<u64> = c.iter().map(Chunk::bytes).collect();
        assert_eq!(sizes, vec![4, 4, 4, 4, 1]);
        // The third chunk straddles the two spans.
        assert_eq!(c[2].pieces.len(), 2);
        assert_eq!((c[2].pieces[0].local, c[2].pieces[0].len), (1008, 2));
        assert_eq!((c[2].pieces[1].local, c[2].pieces[1].remote, c[2].pieces[1].len), (2000, 9000, 2));
        let host = c[2].host_spans(100);
        assert_eq!((host[0].local, host[1].local, host[1].remote), (100, 102, 9000));
        assert_eq!(c[2].device_copies(Op::Write, 100), vec![(100, 1008, 2), (102, 2000, 2)]);
        assert_eq!(c[2].device_copies(Op::Read, 100), vec![(1008, 100, 2), (2000, 102, 2)]);
        let limited = chunks(&spans, 9, 4);
        assert_eq!(limited.iter().map(Chunk::bytes).sum::<u64>(), 9);
        assert!(chunks(&spans, 0, 4).is_empty());
    }
}
