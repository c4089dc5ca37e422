//! Status codes and the thread's last error message.

use std::cell::RefCell;

use orbite_core::file::FileError;
use orbite_core::wire::RemoteStatus;
use orbite_core::{BatchError, Error, PeerError, RegistryError};

/// What every entry point returns. Zero is success; every failure is
/// negative. A failed call changed nothing unless its documentation says so.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrbiteStatus {
    /// Done.
    Ok = 0,
    /// A null pointer, an unknown enumeration value, malformed bytes or a
    /// configuration the engine rejects.
    InvalidArgument = -1,
    /// The handle was released, or never issued.
    StaleHandle = -2,
    /// The handle is of another kind, or belongs to another engine.
    WrongHandle = -3,
    /// ABI major, record version or record size not understood.
    VersionMismatch = -4,
    /// The caller's output buffer is too small; the size needed was
    /// written and nothing else.
    BufferTooSmall = -5,
    /// A bounded resource is full; nothing was allocated or admitted.
    ResourceExhausted = -6,
    /// Refused while work is active: the handle stays valid and pollable.
    Active = -7,
    /// The lifecycle forbids it (a repost after a failure, a cancel of a
    /// transfer never posted).
    Refused = -8,
    /// No such registration (local or on the peer), or it was deregistered.
    NotFound = -9,
    /// The registration's permission does not allow the access.
    NotAllowed = -10,
    /// A feature, route or memory kind this build does not support.
    NotSupported = -11,
    /// The peer is unreachable, lost, closed or broke the protocol.
    RemoteDisconnect = -12,
    /// The peer is another incarnation than the one expected.
    EpochMismatch = -13,
    /// The engine is closed.
    Closed = -14,
    /// A range, length or count is out of bounds, or its arithmetic
    /// overflows.
    OutOfRange = -15,
    /// An operating-system failure.
    System = -16,
    /// A bug inside the library was caught at the boundary (a panic). The
    /// call did nothing further; the library stays usable.
    Internal = -17,
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

pub(crate) fn set_last_error(message: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = message);
}

pub(crate) fn clear_last_error() {
    LAST_ERROR.with(|e| e.borrow_mut().clear());
}

pub(crate) fn with_last_error<R>(f: impl FnOnce(&str) -> R) -> R {
    LAST_ERROR.with(|e| f(&e.borrow()))
}

/// A failure: its status and a message for `orbite_last_error`.
#[derive(Debug)]
pub(crate) struct Failure {
    pub status: OrbiteStatus,
    pub message: String,
}

impl Failure {
    pub fn new(status: OrbiteStatus, message: impl Into<String>) -> Self {
        Failure { status, message: message.into() }
    }
}

pub(crate) type Res<T = ()> = Result<T, Failure>;

pub(crate) fn fail<T>(status: OrbiteStatus, message: impl Into<String>) -> Res<T> {
    Err(Failure::new(status, message))
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::Config(_) => OrbiteStatus::InvalidArgument,
            Error::Registry(r) => match r {
                RegistryError::Unknown(_) | RegistryError::Deregistered(_) => OrbiteStatus::NotFound,
                RegistryError::Stale(_) => OrbiteStatus::StaleHandle,
                RegistryError::InvalidRange(_) => OrbiteStatus::OutOfRange,
            },
            Error::Batch(b) => match b {
                BatchError::InvalidDescriptor { .. } | BatchError::LengthMismatch { .. } => OrbiteStatus::OutOfRange,
                BatchError::PermissionDenied { .. } => OrbiteStatus::NotAllowed,
                BatchError::ExecutionActive { .. } => OrbiteStatus::Active,
                BatchError::RepostRefused { .. } | BatchError::NotPosted => OrbiteStatus::Refused,
            },
            Error::Peer(p) => match p {
                PeerError::NotListening | PeerError::RouteUnavailable { .. } => OrbiteStatus::NotSupported,
                PeerError::EpochMismatch { .. } => OrbiteStatus::EpochMismatch,
                PeerError::UnknownRemoteRegistration(_) | PeerError::RangeNotRegistered { .. } => {
                    OrbiteStatus::NotFound
                }
                PeerError::NotificationTooLarge { .. } => OrbiteStatus::OutOfRange,
                PeerError::OwnEngine { .. } => OrbiteStatus::InvalidArgument,
                // The peer answered: say what it refused, not that it is gone.
                PeerError::Refused { status, .. } => match status {
                    RemoteStatus::UnknownRegistration | RemoteStatus::StaleRegistration => OrbiteStatus::NotFound,
                    RemoteStatus::EpochMismatch => OrbiteStatus::EpochMismatch,
                    RemoteStatus::OutOfBounds | RemoteStatus::BadLength | RemoteStatus::NotificationTooLarge => {
                        OrbiteStatus::OutOfRange
                    }
                    RemoteStatus::PermissionDenied | RemoteStatus::Unauthenticated => OrbiteStatus::NotAllowed,
                    RemoteStatus::ResourceExhausted => OrbiteStatus::ResourceExhausted,
                    RemoteStatus::Closing | RemoteStatus::Other => OrbiteStatus::RemoteDisconnect,
                },
                PeerError::Unauthenticated(_) => OrbiteStatus::NotAllowed,
                PeerError::Connect(_)
                | PeerError::Timeout(_)
                | PeerError::Protocol(_)
                | PeerError::Lost(_)
                | PeerError::SegmentClosed
                | PeerError::CloseFailed(_) => OrbiteStatus::RemoteDisconnect,
            },
            Error::Discovery(d) => match d {
                orbite_core::discovery::DiscoveryError::NotFound(_) => OrbiteStatus::NotFound,
                orbite_core::discovery::DiscoveryError::NotConfigured
                | orbite_core::discovery::DiscoveryError::NotBuilt(_) => OrbiteStatus::NotSupported,
                orbite_core::discovery::DiscoveryError::InvalidName(_)
                | orbite_core::discovery::DiscoveryError::Malformed { .. } => OrbiteStatus::InvalidArgument,
                orbite_core::discovery::DiscoveryError::Unreachable { .. } => OrbiteStatus::RemoteDisconnect,
            },
            Error::File(f) => match f {
                FileError::InvalidPath(_) => OrbiteStatus::InvalidArgument,
                FileError::Unsupported(_) => OrbiteStatus::NotSupported,
                FileError::NotRegular | FileError::ModeMismatch(_) => OrbiteStatus::NotAllowed,
                FileError::Closed => OrbiteStatus::Closed,
                FileError::OutOfRange(_) => OrbiteStatus::OutOfRange,
                FileError::DrainTimeout | FileError::Os { .. } => OrbiteStatus::System,
                FileError::NoBounce { .. } => OrbiteStatus::ResourceExhausted,
            },
            Error::ResourceExhausted { .. } => OrbiteStatus::ResourceExhausted,
            Error::Closed => OrbiteStatus::Closed,
            Error::System(_) => OrbiteStatus::System,
            Error::NotSupported(_) => OrbiteStatus::NotSupported,
        };
        Failure { status, message: e.to_string() }
    }
}
