//! Transfers: descriptor lists, their validation into a copy program
//! (`plan`), and the lifecycle state machine of their executions
//! (`lifecycle`).

pub mod lifecycle;
pub(crate) mod plan;

pub use lifecycle::{
    ExecutionPhase, LogicalOutcome, OutcomeCode, RemoteEffect, RetirementReceipt, TaskEnd, TaskReport, TransferResult,
    TransferStatus,
};

use std::time::Duration;

use crate::registry::RegistrationId;

/// One contiguous range of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Desc {
    /// The registration the range lies in.
    pub registration: RegistrationId,
    /// Offset from the registration's start.
    pub offset: u64,
    /// Length in bytes (at least 1).
    pub len: u64,
}

impl Desc {
    /// A descriptor.
    pub fn new(registration: RegistrationId, offset: u64, len: u64) -> Self {
        Desc { registration, offset, len }
    }
}

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Remote (target) bytes into local memory.
    Read,
    /// Local bytes into remote (target) memory.
    Write,
}

/// Priority class of a transfer at admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Intent {
    /// On the decode critical path: served first.
    DecodeCritical = 0,
    /// Ordinary transfers.
    Normal = 1,
    /// Background prefetch and offload: served last, never starved.
    Prefetch = 2,
}

impl Intent {
    /// All classes, highest priority first.
    pub const ALL: [Intent; 3] = [Intent::DecodeCritical, Intent::Normal, Intent::Prefetch];
}

/// Who the remote descriptors belong to.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// This engine itself (the self connection NIXL uses for local
    /// transfers): remote descriptors name this engine's registrations.
    Loopback,
    /// A peer engine: remote descriptors name registrations of its
    /// segment (ids as in its descriptor).
    Peer(&'a crate::RemoteSegment),
    /// A local file: remote descriptors are file extents (`offset`, `len`;
    /// their `registration` is ignored). READ moves file bytes into the
    /// local memory, WRITE the reverse.
    File(&'a std::sync::Arc<crate::file::Entry>),
}

/// How bytes reach a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Route {
    /// Copies inside this engine (the self connection).
    Loopback,
    /// Frames over TCP; the peer's CPU lands the bytes.
    Tcp,
    /// One-sided copies into a peer's shared allocation mapped here.
    Shm,
    /// One-sided cross-memory copies into a same-host peer's memory.
    Cma,
    /// io_uring reads and writes of a local file.
    File,
}

/// Which route a transfer to a peer may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoutePolicy {
    /// shm if every target range is a shared allocation on this boot, else
    /// cma if the peer is on this boot and the kernel permits it, else tcp.
    #[default]
    Auto,
    /// Only tcp.
    Tcp,
    /// Only shm; a transfer that cannot use it fails at prepare.
    Shm,
    /// Only cma; a transfer that cannot use it fails at prepare.
    Cma,
}

/// The route a transfer takes, and why.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RouteChoice {
    /// The route.
    pub route: Route,
    /// Why it was chosen (the policy and what ruled the others out).
    pub reason: String,
}

/// Per-transfer options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TransferOptions {
    /// Admission priority.
    pub intent: Intent,
    /// Measured from each post: work not started by then never starts.
    pub deadline: Option<Duration>,
    /// Route policy for a peer transfer (default: the engine's `route`).
    pub route: Option<RoutePolicy>,
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions { intent: Intent::Normal, deadline: None, route: None }
    }
}

/// What to prepare.
#[derive(Debug, Clone, Copy)]
pub struct TransferSpec<'a> {
    /// Direction.
    pub op: Op,
    /// Local descriptors (source of a WRITE, destination of a READ).
    pub local: &'a [Desc],
    /// Target descriptors; together they cover as many bytes as `local`.
    pub remote: &'a [Desc],
    /// Whose memory `remote` names.
    pub target: Target<'a>,
    /// Options.
    pub options: TransferOptions,
    /// A notification delivered to the target exactly once, after every
    /// byte landed; success requires its delivery.
    pub notification: Option<&'a [u8]>,
}

impl<'a> TransferSpec<'a> {
    /// A spec with default options and no notification.
    pub fn new(op: Op, local: &'a [Desc], remote: &'a [Desc], target: Target<'a>) -> Self {
        TransferSpec { op, local, remote, target, options: TransferOptions::default(), notification: None }
    }
}
