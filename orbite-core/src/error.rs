//! Error types of the core, one enum per layer, joined in [`Error`].
//!
//! Every error a caller can provoke is typed here: nothing reachable from a
//! caller, a peer or the C ABI panics. Boundaries (the C ABI, the NIXL
//! plugin) map these once to their own status codes.

use crate::batch::{ExecutionPhase, LogicalOutcome};
use crate::registry::RegistrationId;

/// A budgeted resource of the engine (see [`crate::EngineConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Resource {
    /// Live registrations (`max_registrations`).
    Registrations,
    /// Bytes under live registrations (`max_registered_bytes`).
    RegisteredBytes,
    /// Engine-allocated host memory (`max_host_memory_bytes`).
    HostMemoryBytes,
    /// Prepared transfers (`max_prepared_transfers`).
    PreparedTransfers,
    /// Posted, not yet retired executions (`max_executions`).
    Executions,
    /// Executions waiting for admission (`admission_queue_len`).
    AdmissionQueue,
    /// Descriptors in one transfer (`max_descriptors_per_transfer`).
    DescriptorsPerTransfer,
    /// Bytes in one transfer (`max_transfer_bytes`).
    TransferBytes,
    /// Queued notification bytes (`notification_queue_bytes`).
    NotificationBytes,
    /// Handles held by a binding such as the C ABI (`max_binding_handles`).
    BindingHandles,
}

impl std::fmt::Display for Resource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Resource::Registrations => "registrations",
            Resource::RegisteredBytes => "registered bytes",
            Resource::HostMemoryBytes => "host memory bytes",
            Resource::PreparedTransfers => "prepared transfers",
            Resource::Executions => "executions",
            Resource::AdmissionQueue => "admission queue",
            Resource::DescriptorsPerTransfer => "descriptors per transfer",
            Resource::TransferBytes => "bytes per transfer",
            Resource::NotificationBytes => "notification queue bytes",
            Resource::BindingHandles => "binding handles",
        };
        f.write_str(name)
    }
}

/// Configuration could not be accepted.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The JSON was malformed, had a wrong type, or named an unknown field
    /// (serde's message names the field).
    #[error("invalid engine configuration: {0}")]
    Json(#[from] serde_json::Error),
    /// A field parsed but its value is not usable.
    #[error("invalid engine configuration: `{field}` {reason}")]
    Invalid {
        /// Name of the offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The configuration named by an environment variable is unusable.
    #[error("{variable}: {reason}")]
    Environment {
        /// The variable (`ORBITE_CONFIG`).
        variable: &'static str,
        /// What is wrong: unreadable file, not an object, invalid field.
        reason: String,
    },
}

/// Errors of the memory registry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// No registration ever had this index.
    #[error("unknown registration {0}")]
    Unknown(RegistrationId),
    /// The slot exists but belongs to another (older or newer) registration.
    #[error("stale registration {0} (generation mismatch)")]
    Stale(RegistrationId),
    /// The registration was deregistered: it is fenced for new work.
    #[error("registration {0} is deregistered")]
    Deregistered(RegistrationId),
    /// A range to register was empty, null or out of its memory's bounds.
    #[error("invalid memory range: {0}")]
    InvalidRange(String),
}

/// Errors of preparing, posting and releasing transfers.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BatchError {
    /// A descriptor is malformed or outside its registration.
    #[error("invalid descriptor {index} of the {side} list: {reason}")]
    InvalidDescriptor {
        /// `local` or `remote`.
        side: &'static str,
        /// Position in its list.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// The two descriptor lists do not cover the same number of bytes.
    #[error("descriptor lists differ in length: local {local} bytes, remote {remote} bytes")]
    LengthMismatch {
        /// Total bytes of the local list.
        local: u64,
        /// Total bytes of the remote list.
        remote: u64,
    },
    /// A registration lacks the permission the operation needs.
    #[error("registration {id} does not permit {needed}")]
    PermissionDenied {
        /// The registration.
        id: RegistrationId,
        /// The access that was needed.
        needed: &'static str,
    },
    /// The transfer has an execution that is not retired.
    #[error("transfer has an active execution ({phase:?})")]
    ExecutionActive {
        /// Where the execution stands.
        phase: ExecutionPhase,
    },
    /// Only a retired, successful execution may be posted again.
    #[error("transfer may not be reposted after {outcome}")]
    RepostRefused {
        /// The outcome of the previous execution.
        outcome: LogicalOutcome,
    },
    /// The transfer was never posted (nothing to cancel or wait for).
    #[error("transfer is not posted")]
    NotPosted,
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
        route: crate::batch::Route,
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

/// Any error of the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Registry error.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// Transfer lifecycle error.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// Peer or segment error.
    #[error(transparent)]
    Peer(#[from] PeerError),
    /// A bounded resource is exhausted; nothing was allocated or admitted.
    #[error("resource exhausted: {resource} (limit {limit}, requested {requested})")]
    ResourceExhausted {
        /// Which budget.
        resource: Resource,
        /// Its configured limit.
        limit: u64,
        /// What the refused request would have brought the charge to.
        requested: u64,
    },
    /// A local file refused the operation.
    #[error(transparent)]
    File(#[from] crate::file::FileError),
    /// The engine is closing or closed; it takes no new work.
    #[error("engine is closed")]
    Closed,
    /// Operating system error (thread spawn, allocation).
    #[error("system error: {0}")]
    System(String),
}

/// Result alias of the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;
