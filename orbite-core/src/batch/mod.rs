//! Transfers as data: descriptors, per-transfer options, the lifecycle
//! state machine of executions (`lifecycle`) and the errors of preparing,
//! posting and releasing.

pub mod lifecycle;

pub use crate::types::{Desc, Intent, Op, Route, RouteChoice, RoutePolicy, TaskEnd, TaskReport};
pub use lifecycle::{
    ExecutionPhase, LogicalOutcome, OutcomeCode, RemoteEffect, RetirementReceipt, TransferResult, TransferStatus,
};

use std::time::Duration;

use crate::types::RegistrationId;

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
