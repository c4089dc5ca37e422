//! Staging on the tcp route (feature `cuda`): a task whose local side is
//! CUDA device memory goes to a route worker first, which takes a
//! page-locked buffer from the engine's pool (and, for a WRITE, copies the
//! task's device bytes into it on its stream, waiting for the event); the
//! peer link then sends from, or receives into, that buffer; for a READ a
//! route worker then copies the buffer to the device. The task reports only
//! after its last device copy completed. Tasks are independent, so while
//! the link sends task k a worker stages task k + 1.
//!
//! The pool keeps buffers of `task_bytes` for reuse, charged to
//! `staging_buffers`/`staging_bytes` while they exist; it holds at most
//! as many as tasks were staged at once, and is emptied at close.

use std::sync::Arc;

use crate::transport::Span;
use crate::transport::staged::Pooled;
pub(crate) use crate::transport::staged::StagingPool;
use crate::types::{Op, TaskEnd, TaskReport};

/// Where a staged task is.
pub(crate) enum Phase {
    /// At a route worker: take a buffer (and fill it, for a WRITE).
    In,
    /// At the peer link, with the buffer as its local side.
    Link,
    /// At a route worker again (READ): the buffer to the device.
    Out,
}

pub(crate) struct TcpStage {
    pub device: u32,
    pub phase: Phase,
    buffer: Option<Pooled>,
    /// The task's spans with their local side in the buffer.
    pub spans: Vec<Span>,
    /// What the link reported (READ: applied after the device copy).
    link_report: Option<TaskReport>,
}

impl TcpStage {
    pub fn new(device: u32) -> Self {
        TcpStage { device, phase: Phase::In, buffer: None, spans: Vec::new(), link_report: None }
    }

    /// The worker's part: phase `In` (take a buffer, and for a WRITE copy
    /// the device bytes into it, at most `limit`) or `Out` (READ: copy the
    /// bytes the link landed to the device).
    pub fn copy_locally(
        &mut self,
        pool: &Arc<StagingPool>,
        buffer_len: u64,
        op: Op,
        spans: &[Span],
        limit: u64,
    ) -> (u64, Option<TaskEnd>) {
        match self.phase {
            Phase::In => {
                let buf = match pool.take(self.device, buffer_len) {
                    Ok(b) => b,
                    Err(_) => return (0, Some(TaskEnd::Failed { effect_unknown: false })),
                };
                let base = buf.addr();
                let mut at = 0;
                self.spans = spans
                    .iter()
                    .map(|s| {
                        let m = Span { local: base + at, remote: s.remote, remote_reg: s.remote_reg, len: s.len };
                        at += s.len;
                        m
                    })
                    .collect();
                self.buffer = Some(buf);
                match op {
                    Op::Read => (spans.iter().map(|s| s.len).sum(), None),
                    Op::Write => {
                        let copies = pairs(spans, &self.spans, limit, |dev, host| (host, dev));
                        let (done, err) = crate::cuda::copy_on_stream(self.device, &copies);
                        (done, err.map(|_| TaskEnd::Failed { effect_unknown: false }))
                    }
                }
            }
            Phase::Out => {
                let landed = self.link_report.map_or(0, |r| r.done);
                let copies = pairs(spans, &self.spans, landed.min(limit), |dev, host| (dev, host));
                let (done, err) = crate::cuda::copy_on_stream(self.device, &copies);
                (done, err.map(|_| TaskEnd::Failed { effect_unknown: true }))
            }
            Phase::Link => {
                debug_assert!(false, "the link's phase never runs on a worker");
                (0, Some(TaskEnd::Failed { effect_unknown: false }))
            }
        }
    }

    /// After the worker's phase `In`: whether the task goes on to the link;
    /// if not, the report it ends with (for a WRITE nothing was sent).
    pub fn after_in(&mut self, report: TaskReport) -> Result<(), TaskReport> {
        if report.end == TaskEnd::Complete && report.done == report.planned {
            self.phase = Phase::Link;
            return Ok(());
        }
        self.buffer = None;
        let end = match report.end {
            TaskEnd::Complete => TaskEnd::Short,
            e => e,
        };
        Err(TaskReport { planned: report.planned, done: 0, end })
    }

    /// After the link: READ goes on to phase `Out` (`Ok`); a WRITE ends with
    /// the link's report (`Err`), its buffer back in the pool.
    pub fn after_link(&mut self, op: Op, report: TaskReport) -> Result<(), TaskReport> {
        match op {
            Op::Read => {
                self.link_report = Some(report);
                self.phase = Phase::Out;
                Ok(())
            }
            Op::Write => {
                self.buffer = None;
                Err(report)
            }
        }
    }

    /// After phase `Out`: the task's report (the link's, unless the device
    /// copy failed).
    pub fn after_out(&mut self, report: TaskReport) -> TaskReport {
        self.buffer = None;
        let link = self.link_report.take().unwrap_or(report);
        match report.end {
            TaskEnd::Complete => link,
            failed => TaskReport { planned: link.planned, done: report.done.min(link.done), end: failed },
        }
    }
}

/// Device/host address pairs of the first `limit` bytes of `dev` (the
/// task's spans) and `host` (the same spans in the buffer), as
/// (destination, source, bytes) by `order(device, host)`.
fn pairs(dev: &[Span], host: &[Span], limit: u64, order: impl Fn(u64, u64) -> (u64, u64)) -> Vec<(u64, u64, u64)> {
    let mut left = limit;
    let mut out = Vec::with_capacity(dev.len());
    for (d, h) in dev.iter().zip(host) {
        if left == 0 {
            break;
        }
        let n = d.len.min(left);
        let (dst, src) = order(d.local, h.local);
        out.push((dst, src, n));
        left -= n;
    }
    out
}

/// The target's staging of a peer's WRITE or READ that names its device
/// memory (tcp): a buffer of the pool the request's device ranges go
/// through; a READ's device bytes are copied into it before the reply is
/// sent, a WRITE's are copied out of it once the payload is in
/// ([`Landing::land`](crate::transport::proto::server::Landing::land)).
/// The server thread waits for those copies.
pub(crate) struct ServerStage {
    pub(super) device: u32,
    pub(super) buffer: Pooled,
    /// (device address, buffer address, bytes).
    pub(super) copies: Vec<(u64, u64, u64)>,
    pub(super) write: bool,
}

impl crate::transport::proto::server::Landing for ServerStage {
    fn land(&mut self) -> Result<(), crate::cuda::CudaError> {
        if !self.write {
            return Ok(());
        }
        // (device, buffer, bytes) is already (destination, source, bytes).
        match crate::cuda::copy_on_stream(self.device, &self.copies) {
            (_, None) => Ok(()),
            (_, Some(why)) => Err(why),
        }
    }
}

impl ServerStage {
    /// A READ's device bytes into the buffer, now (before the reply).
    pub(super) fn fill(&self) -> Result<(), crate::cuda::CudaError> {
        let copies: Vec<_> = self.copies.iter().map(|&(dev, buf, n)| (buf, dev, n)).collect();
        match crate::cuda::copy_on_stream(self.device, &copies) {
            (_, None) => Ok(()),
            (_, Some(why)) => Err(why),
        }
    }

    pub(super) fn buffer_addr(&self) -> u64 {
        self.buffer.addr()
    }
}
