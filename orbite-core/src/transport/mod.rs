//! Routes: the workers that move bytes. A route knows spans and completions,
//! never policy: admission, lifecycle and accounting live above it.

pub(crate) mod auth;
pub(crate) mod framebuf;
pub(crate) mod inbox;
pub(crate) mod link;
pub(crate) mod liveness;
pub(crate) mod local;
pub(crate) mod mapping;
pub(crate) mod peer_errors;
pub(crate) mod proto;
pub(crate) mod reactor;
pub(crate) mod routes;
pub(crate) mod server;
pub(crate) mod sock;
pub(crate) mod spin;
pub(crate) mod unix;
pub(crate) mod watchers;

#[cfg(feature = "fault-injection")]
pub mod fault;
pub(crate) mod hooks;

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
    /// How its tasks move (and what `Span::remote` means).
    pub mover: crate::transport::routes::Mover,
    pub spans: Vec<Span>,
    pub tasks: Vec<TaskRange>,
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
