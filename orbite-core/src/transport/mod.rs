//! Routes: the workers that move bytes. A route knows spans and completions,
//! never policy: admission, lifecycle and accounting live above it.

pub(crate) mod auth;
pub(crate) mod cma;
pub(crate) mod file;
pub(crate) mod framebuf;
pub(crate) mod inbox;
pub(crate) mod ipc;
pub(crate) mod link;
pub(crate) mod liveness;
pub(crate) mod local;
pub(crate) mod loopback;
pub(crate) mod mapping;
pub(crate) mod policy;
pub(crate) mod proto;
pub(crate) mod reactor;
pub(crate) mod route;
pub(crate) mod shm;
pub(crate) mod sock;
pub(crate) mod spin;
#[cfg(feature = "cuda")]
pub(crate) mod staged;
pub(crate) mod tcp;
pub(crate) mod unix;
pub(crate) mod watchers;

#[cfg(feature = "fault-injection")]
pub mod fault;
pub(crate) mod hooks;

use std::sync::Arc;

use crate::transport::liveness::LivenessCheck;
use crate::types::{Op, RegistrationId, TaskEnd, TaskReport};

/// One contiguous piece of a transfer: `len` bytes at local address
/// `local` and at `remote` on the target side. For the self connection
/// `remote` is an address of this process; for a peer it is an offset in
/// the peer's registration `remote_reg` (its raw id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub local: u64,
    pub remote: u64,
    pub remote_reg: u64,
    pub len: u64,
}

/// A task's slice of a copy program.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TaskRange {
    pub first_span: u32,
    pub end_span: u32,
    pub bytes: u64,
}

/// The resolved spans of a prepared transfer, grouped into tasks.
///
/// Built once at prepare; routes read it without locks.
#[derive(Debug)]
pub(crate) struct CopyProgram {
    pub op: Op,
    /// How its spans are copied (and what `Span::remote` means).
    pub kind: CopyKind,
    pub spans: Vec<Span>,
    pub tasks: Vec<TaskRange>,
}

impl CopyProgram {
    /// Device copies within one engine whose source and destination
    /// overlap are cut into pieces (memmove semantics): the first span
    /// that would need more than [`MAX_OVERLAP_PIECES`] copies, and why.
    #[cfg(feature = "cuda")]
    pub(crate) fn device_overlaps(&self) -> Option<(usize, String)> {
        let p = self;
        if !matches!(p.kind, CopyKind::Device { .. }) {
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

/// Device memory with a copy kind that cannot take it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CUDA device memory (device {device}) with {kind}")]
pub(crate) struct NoDeviceCopy {
    pub device: u32,
    pub kind: String,
}

/// How a program's spans are copied: one kind per way of moving bytes.
#[derive(Debug)]
pub(crate) enum CopyKind {
    /// Both sides are addresses of this process (the self connection).
    Memory,
    /// `remote` are addresses of a peer's shared allocation mapped here;
    /// the peer process is checked after each task (bytes that went into
    /// a dead peer's memory did not reach it).
    Mapped {
        peer_alive: Option<LivenessCheck>,
        /// The target ranges' shared allocations, for a device copy to
        /// pin them for the driver (feature `cuda`).
        #[cfg(feature = "cuda")]
        shared_pins: Vec<Arc<crate::cuda::HostPin>>,
    },
    /// `remote` are addresses in process `pid` (cross-memory copies),
    /// checked after each task as for `Mapped`.
    Cma { pid: i32, peer_alive: Option<LivenessCheck> },
    /// `remote` are offsets in a local file; unaligned spans of a direct
    /// file bounce through the engine's pool.
    File(Arc<crate::file::Entry>, Arc<crate::file::BouncePool>),
    /// `remote` are offsets in the peer registration `remote_reg`, sent as
    /// frames by the peer's link (never copied by this process).
    Frames,
    /// The self connection with CUDA device memory on either side (or
    /// both): driver copies on the worker's own stream of `device`, waited
    /// for with an event before the task reports (feature `cuda`). Never
    /// run on the posting thread.
    /// A same-host peer's shared allocations mapped here (shm) with CUDA
    /// device memory on the local side: the same driver copies straight
    /// into or out of the mapping, no staging; checked after each task as
    /// for `Mapped`.
    ///
    /// The host memory named (`pins`: this engine's host registrations,
    /// or the peer's mappings) is page-locked for the driver on the first
    /// task, so the copy engine reaches it without a bounce.
    #[cfg(feature = "cuda")]
    Device {
        /// The CUDA ordinal of the first device registration named.
        device: u32,
        pins: Vec<Arc<crate::cuda::HostPin>>,
        peer_alive: Option<LivenessCheck>,
    },
    /// A same-host peer's device memory opened through CUDA IPC: `remote`
    /// are addresses of `mappings` (sorted by address, kept open while the
    /// program lives),
    /// copied by the driver on the worker's stream; checked after each
    /// task as for `Cma`.
    #[cfg(feature = "cuda")]
    Ipc {
        mappings: Vec<Arc<crate::cuda::IpcMapping>>,
        peer_alive: Option<LivenessCheck>,
        /// This engine's host registrations named, pinned as for `Device`.
        pins: Vec<Arc<crate::cuda::HostPin>>,
    },
    /// A same-host route that cannot reach device memory (`inner`: cma)
    /// with CUDA device memory on the local side: each task is bounced
    /// through page-locked buffers of `chunk` bytes from `pool`
    /// ([`staged`]).
    #[cfg(feature = "cuda")]
    Staged {
        device: u32,
        /// `staging_chunk_bytes`.
        chunk: u64,
        pool: Arc<staged::StagingPool>,
        inner: Box<CopyKind>,
    },
}

impl CopyKind {
    /// Copies `spans` (at most `limit` bytes) on the calling thread: the
    /// bytes moved and, on failure, how the task ended.
    pub(crate) fn copy(&self, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>) {
        match self {
            // SAFETY: the job retains the range loans of every span, and
            // the lifecycle admits each task once.
            CopyKind::Memory => (unsafe { copy_spans(op, spans, limit) }, None),
            CopyKind::Mapped { peer_alive, .. } => shm::copy(op, spans, limit, peer_alive.as_ref()),
            CopyKind::Cma { pid, peer_alive } => cma::copy_task(*pid, op, spans, limit, peer_alive.as_ref()),
            CopyKind::File(entry, bounce) => file::copy(entry, bounce, op, spans, limit),
            CopyKind::Frames => {
                debug_assert!(false, "frames are sent by the peer's link");
                (0, Some(TaskEnd::Failed { effect_unknown: false }))
            }
            #[cfg(feature = "cuda")]
            CopyKind::Device { .. } | CopyKind::Ipc { .. } => match self.issue(op, spans, limit) {
                Some(Ok(issued)) => self.complete(op, issued),
                Some(Err(ended)) => ended,
                None => unreachable!("device kinds issue"),
            },
            #[cfg(feature = "cuda")]
            CopyKind::Staged { device, chunk, pool, inner } => {
                staged::copy(pool, *device, *chunk, inner, op, spans, limit)
            }
        }
    }

    /// Device kinds (`Device`, `Ipc`): queues a task's driver copies on
    /// this thread's stream without waiting for them; [`complete`] on the
    /// same thread then waits and says how the task ended. A worker keeps
    /// a few tasks queued so the device never idles between them. `None`
    /// for every other kind; `Some(Err)`: the task already ended.
    ///
    /// [`complete`]: CopyKind::complete
    #[cfg(feature = "cuda")]
    pub(crate) fn issue(&self, op: Op, spans: &[Span], limit: u64) -> Option<Result<Issued, (u64, Option<TaskEnd>)>> {
        let (device, copies) = match self {
            CopyKind::Device { device, pins, .. } => {
                for p in pins {
                    p.ensure(*device);
                }
                (*device, device_copies(op, spans, limit))
            }
            CopyKind::Ipc { mappings, pins, .. } => match ipc::copies(mappings, op, spans, limit) {
                Ok(Some(c)) => {
                    for p in pins {
                        p.ensure(c.0);
                    }
                    c
                }
                Ok(None) => return Some(Err((0, None))),
                Err(end) => return Some(Err((0, Some(end)))),
            },
            CopyKind::Staged { device, chunk, pool, inner } => {
                return staged::issue(pool, *device, *chunk, inner, op, spans, limit)
                    .map(|r| r.map(|(ticket, bytes, task)| Issued { ticket, bytes, staged: Some(task) }));
            }
            _ => return None,
        };
        let bytes = copies.iter().map(|c| c.2).sum();
        Some(match crate::cuda::issue_on_stream(device, &copies) {
            Ok(ticket) => Ok(Issued { ticket, bytes, staged: None }),
            // The bytes of the copies before the failing one landed; whether
            // the failing one wrote anything is not known.
            Err((done, _why)) => Err((done, Some(TaskEnd::Failed { effect_unknown: true }))),
        })
    }

    /// Waits for a task [`issue`](CopyKind::issue) queued: the bytes moved
    /// and, on failure, how it ended (a same-host peer that died meanwhile
    /// fails it, as for a CPU copy into its memory).
    #[cfg(feature = "cuda")]
    pub(crate) fn complete(&self, op: Op, issued: Issued) -> (u64, Option<TaskEnd>) {
        let Issued { ticket, bytes, staged } = issued;
        let waited = crate::cuda::wait_ticket(ticket);
        if let (Some(task), CopyKind::Staged { inner, .. }) = (staged, self) {
            return staged::complete(waited, inner, bytes, task);
        }
        match waited {
            Ok(()) => {
                let peer_alive = match self {
                    CopyKind::Device { peer_alive, .. } | CopyKind::Ipc { peer_alive, .. } => peer_alive.as_ref(),
                    _ => None,
                };
                (bytes, liveness::after_one_sided(op, peer_alive))
            }
            Err(_why) => (0, Some(TaskEnd::Failed { effect_unknown: true })),
        }
    }

    /// Whether a task of `spans` is staged through one buffer, pipelined
    /// across tasks ([`staged::issue`]).
    #[cfg(feature = "cuda")]
    pub(crate) fn stages_in_one(&self, spans: &[Span]) -> bool {
        matches!(self, CopyKind::Staged { chunk, .. } if spans.iter().map(|s| s.len).sum::<u64>() <= *chunk)
    }

    /// Whether a staged task of `spans` that fits one buffer can have one
    /// now (it is then reserved for it); true for every other task.
    #[cfg(feature = "cuda")]
    pub(crate) fn staging_room(&self, spans: &[Span]) -> bool {
        match self {
            CopyKind::Staged { device, chunk, pool, .. } => {
                spans.iter().map(|s| s.len).sum::<u64>() > *chunk || staged::room(pool, *device, *chunk)
            }
            _ => true,
        }
    }

    /// Whether its tasks must stay off the posting thread (they wait for a
    /// device).
    pub(crate) fn waits_for_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        return matches!(self, CopyKind::Device { .. } | CopyKind::Staged { .. } | CopyKind::Ipc { .. });
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// The kind for the memory a transfer's local ranges are in (`loans`):
    /// with CUDA device memory among them, the self connection copies
    /// through the driver, straight into a same-host peer's mapping too;
    /// cma and files stage through the pool's page-locked buffers; tcp
    /// stages on its worker (the device it stages, the second value). No
    /// CPU copy is ever handed a device address: any other pairing is
    /// refused.
    pub(crate) fn for_memory(
        self,
        loans: &[Arc<crate::registry::Registration>],
        config: &crate::config::EngineConfig,
        #[cfg(feature = "cuda")] pool: &Arc<staged::StagingPool>,
        #[cfg(not(feature = "cuda"))] pool: (),
    ) -> Result<(CopyKind, Option<u32>), NoDeviceCopy> {
        #[cfg(feature = "cuda")]
        let host_pins = || -> Vec<Arc<crate::cuda::HostPin>> {
            if !config.cuda_pin_host {
                return Vec::new();
            }
            loans.iter().filter_map(|r| r.pin.clone()).collect()
        };
        // Driver copies already, whatever the local side is.
        #[cfg(feature = "cuda")]
        if let CopyKind::Ipc { mappings, peer_alive, .. } = self {
            return Ok((CopyKind::Ipc { mappings, peer_alive, pins: host_pins() }, None));
        }
        let Some(device) = loans.iter().find_map(|r| match r.kind {
            crate::memory::MemoryKind::Cuda { device } => Some(device),
            _ => None,
        }) else {
            return Ok((self, None));
        };
        let _ = (config, &pool);
        match self {
            #[cfg(feature = "cuda")]
            CopyKind::Memory => Ok((CopyKind::Device { device, pins: host_pins(), peer_alive: None }, None)),
            // Straight into the peer's mapping: the device reaches any host
            // memory of this process.
            #[cfg(feature = "cuda")]
            CopyKind::Mapped { peer_alive, shared_pins } => {
                let mut pins = host_pins();
                if config.cuda_pin_host {
                    pins.extend(shared_pins);
                }
                Ok((CopyKind::Device { device, pins, peer_alive }, None))
            }
            // Files take host memory only: the bytes bounce through the
            // staging pool's page-locked buffers, as for cma.
            #[cfg(feature = "cuda")]
            inner @ (CopyKind::Cma { .. } | CopyKind::File(..)) => Ok((
                CopyKind::Staged {
                    device,
                    chunk: config.staging_chunk_bytes,
                    pool: pool.clone(),
                    inner: Box::new(inner),
                },
                None,
            )),
            #[cfg(feature = "cuda")]
            CopyKind::Frames => Ok((CopyKind::Frames, Some(device))),
            #[allow(unreachable_patterns, reason = "without feature cuda no device registration exists")]
            other => Err(NoDeviceCopy { device, kind: format!("{other:?}") }),
        }
    }

    /// Whether a caller's thread may run its tasks (helping): not one that
    /// waits for a device, nor a direct file's, whose read-modify-write
    /// may wait for another task's write of the same file (a helping
    /// caller never waits on a copy).
    pub(crate) fn helpable(&self) -> bool {
        !self.waits_for_device() && !matches!(self, CopyKind::File(f, _) if f.dio_align().is_some())
    }

    /// Where its tasks are cut, given `task_bytes` (`configured`). A
    /// worker waits for all of one task's operations on a direct file, so
    /// those tasks are cut larger: their operations are what is in flight
    /// at the device.
    pub(crate) fn task_bytes(&self, configured: u64) -> u64 {
        match self {
            CopyKind::File(entry, _) if entry.dio_align().is_some() => configured.max(crate::file::DIRECT_TASK_BYTES),
            _ => configured,
        }
    }

    /// How device memory moves on this kind, for the route's reason
    /// (`staging`: the device a tcp program stages through).
    pub(crate) fn device_note(&self, staging: Option<u32>) -> Option<String> {
        #[cfg(feature = "cuda")]
        return match self {
            CopyKind::Device { device, peer_alive: None, .. } => {
                Some(format!("CUDA device memory (device {device}) by driver copies"))
            }
            CopyKind::Device { device, .. } => Some(format!(
                "CUDA device memory (device {device}) by driver copies straight into the peer's shared memory"
            )),
            CopyKind::Staged { device, chunk, .. } => Some(format!(
                "CUDA device memory (device {device}) staged through page-locked buffers of {chunk} bytes"
            )),
            _ => staging.map(|d| format!("CUDA device memory (device {d}) staged through the pinned pool")),
        };
        #[cfg(not(feature = "cuda"))]
        staging.map(|d| format!("CUDA device memory (device {d}) staged through the pinned pool"))
    }
}

/// The driver copies of a `Device` task: (destination, source, bytes).
#[cfg(feature = "cuda")]
fn device_copies(op: Op, spans: &[Span], limit: u64) -> Vec<(u64, u64, u64)> {
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
/// ([`CopyKind::issue`]), to be completed on the same thread.
#[cfg(feature = "cuda")]
pub(crate) struct Issued {
    ticket: crate::cuda::Ticket,
    bytes: u64,
    /// A staged task's buffer and what is left to do after the device.
    staged: Option<staged::StagedTask>,
}

#[cfg(feature = "cuda")]
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
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "device copies only with feature cuda"))]
pub(crate) const MAX_OVERLAP_PIECES: u64 = 1024;

/// Pieces of `n` bytes from `src` to `dst` with memmove semantics: the
/// driver's copies are undefined where source and destination overlap, so
/// an overlapping copy is cut into pieces no longer than the distance
/// between them, in the order that reads every byte before it is
/// overwritten (stream order runs them one after another). A copy onto
/// itself stays one copy: whatever the order, each byte gets its own value.
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "device copies only with feature cuda"))]
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
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "device copies only with feature cuda"))]
pub(crate) fn memmove_pieces(dst: u64, src: u64, n: u64) -> u64 {
    match dst.abs_diff(src) {
        d if d == 0 || d >= n => 1,
        d => n.div_ceil(d),
    }
}

impl CopyProgram {
    /// Spans of task `task`.
    pub fn task_spans(&self, task: u32) -> &[Span] {
        let t = &self.tasks[task as usize];
        &self.spans[t.first_span as usize..t.end_span as usize]
    }
}

/// A unit of work for a route: one task of an execution.
pub(crate) trait CopyJob: Send + 'static {
    /// The program the task belongs to. Its addresses stay valid while the
    /// job lives (the job retains the range loans).
    fn program(&self) -> &CopyProgram;
    /// Which task.
    fn task(&self) -> u32;
    /// Called once, after the route's last access to any byte of the task.
    fn finish(self, report: TaskReport);

    /// Spans of this task.
    fn spans(&self) -> &[Span] {
        self.program().task_spans(self.task())
    }
    /// A copy the job makes itself on a route worker instead of its
    /// program's kind (a staging phase), at most `limit` bytes; `None`:
    /// the kind's.
    fn copy_locally(&mut self, limit: u64) -> Option<(u64, Option<TaskEnd>)> {
        let _ = limit;
        None
    }
    /// Bytes the task should move.
    fn planned(&self) -> u64 {
        self.program().tasks[self.task() as usize].bytes
    }
    /// Which transfer the task belongs to (an identity, for a caller that
    /// helps move its own transfer; 0: none).
    fn owner(&self) -> usize {
        0
    }
    /// Whether the calling thread of its transfer may copy it (a copy of
    /// this process that waits for nothing: no device, no staging).
    fn helpable(&self) -> bool {
        false
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

/// Errors of peers and segments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    /// The engine has no listener (`listen` is not configured).
    #[error("engine is not listening for peers")]
    NotListening,
    /// Could not connect or exchange the descriptor.
    #[error("cannot reach peer: {0}")]
    Connect(String),
    /// The peer broke the protocol.
    #[error("peer protocol violation: {0}")]
    Protocol(String),
    /// The peer has another epoch than expected: a restarted engine is a
    /// new identity, and work prepared for the old one cannot run.
    #[error("peer epoch mismatch: expected {expected:#x}, peer has {found:#x}")]
    EpochMismatch {
        /// The epoch the caller (or a prepared transfer) expected.
        expected: u64,
        /// The epoch the peer has now.
        found: u64,
    },
    /// The peer was lost (connection broken or timed out).
    #[error("peer lost: {0}")]
    Lost(String),
    /// The segment was closed: fenced for new work.
    #[error("segment is closed")]
    SegmentClosed,
    /// Closing the segment failed; the failure is sticky.
    #[error("closing the segment failed: {0}")]
    CloseFailed(String),
    /// The peer's descriptor has no such registration.
    #[error("peer has no registration {0}")]
    UnknownRemoteRegistration(RegistrationId),
    /// No registration of the peer covers this range (after asking the
    /// peer for its current registrations).
    #[error("peer has no registration covering {len} bytes at {addr:#x}")]
    RangeNotRegistered {
        /// First byte, an address in the peer.
        addr: u64,
        /// Bytes.
        len: u64,
    },
    /// The connection did not authenticate: the peer requires a secret
    /// this engine does not have (or another one), or this engine requires
    /// one the peer cannot prove.
    #[error("authentication failed: {0}")]
    Unauthenticated(String),
    /// The peer is this very engine: it describes (or proves) this
    /// engine's own epoch. Transfers within one engine use
    /// `Target::Loopback`.
    #[error("the peer is this engine itself (epoch {epoch:#x}): use Target::Loopback within one engine")]
    OwnEngine {
        /// This engine's epoch.
        epoch: u64,
    },
    /// A control exchange with the peer got no answer in time.
    #[error("peer did not answer: {0}")]
    Timeout(String),
    /// The peer refused the request.
    #[error("peer refused: {status:?}: {detail}")]
    Refused {
        /// The peer's typed status.
        status: crate::wire::RemoteStatus,
        /// Its detail text.
        detail: String,
    },
    /// A forced route cannot reach these ranges of this peer.
    #[error("route {route:?} is not available: {reason}")]
    RouteUnavailable {
        /// The forced route.
        route: crate::types::Route,
        /// Why not.
        reason: String,
    },
    /// A notification larger than `max_notification_bytes`.
    #[error("notification of {len} bytes exceeds the limit of {limit}")]
    NotificationTooLarge {
        /// Its size.
        len: u64,
        /// The limit.
        limit: u64,
    },
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
