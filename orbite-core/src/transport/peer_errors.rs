//! The initiator's typed errors: why a link did not open, why a peer is
//! not proven to run on this host, and why what a proven peer hands over
//! its local socket (shared memory, CUDA IPC handles) could not be had; so
//! a route's refusal keeps its reason to the end (`Unreachable`,
//! `Transfer::route()`).

use std::sync::Arc;

use crate::transport::unix::LocalConnectError;
use crate::wire::{Kind, RemoteStatus, WireError};

/// Errors of opening a link.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum OpenError {
    #[error("{0}")]
    Connect(String),
    #[error("{0}")]
    Protocol(String),
    #[error("epoch {found:#x} where {expected:#x} was expected")]
    EpochMismatch { expected: u64, found: u64 },
    /// The handshake failed: the peer refused this engine's proof (or
    /// wants one it does not have), or could not prove the secret.
    #[error("{0}")]
    Unauthenticated(String),
    /// The peer is this engine itself (it describes or proves this
    /// engine's own epoch).
    #[error("the peer is this engine itself")]
    OwnEngine,
}

/// Why a peer is not proven to run on this host (then only tcp reaches
/// it), or why an exchange over its local socket failed.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum LocalError {
    /// Its descriptor names another boot.
    #[error("peer is not on this boot")]
    OtherBoot,
    /// Its descriptor names no local socket.
    #[error("the peer offers no local socket to prove it runs on this host")]
    NoSocket,
    /// Its descriptor names this engine's own local socket.
    #[error("the peer names this engine's own local socket")]
    OwnSocket,
    /// The local socket did not lead to a process of this user.
    #[error(transparent)]
    Connect(#[from] LocalConnectError),
    /// The handshake over the local socket failed.
    #[error("{0}")]
    Handshake(OpenError),
    /// The process behind the socket did not describe the claimed engine.
    #[error("the process behind the local socket: {0}")]
    Describe(OpenError),
    /// Another process listens on the socket than at open.
    #[error("the peer's local socket changed hands")]
    ChangedHands,
    /// The socket failed mid-exchange.
    #[error("{0}")]
    Io(Arc<std::io::Error>),
    /// The peer closed its local socket before answering.
    #[error("the peer closed its local socket")]
    Closed,
    /// No answer about `what` within the peer timeout.
    #[error("the peer did not hand over {0} in time")]
    TimedOut(&'static str),
    /// Receiving the answer about `what` failed.
    #[error("{0}: {1}")]
    Receive(&'static str, Arc<std::io::Error>),
    /// The answer broke the protocol.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// An answer of another kind.
    #[error("unexpected {kind:?} reply to a request for {what}")]
    Unexpected { kind: Kind, what: &'static str },
    /// Its entries and the descriptors attached to them disagree.
    #[error("the peer's answer about {0} does not match the descriptors it sent")]
    DescriptorsMismatch(&'static str),
    /// The peer refused the request.
    #[error("the peer refused {what}: {status:?}: {detail}")]
    Refused { what: &'static str, status: RemoteStatus, detail: String },
}

impl From<std::io::Error> for LocalError {
    fn from(e: std::io::Error) -> Self {
        LocalError::Io(Arc::new(e))
    }
}

/// Why a peer's shared allocation is not mapped here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum MapError {
    #[error("the peer's shared memory is not sealed against shrinking")]
    NotSealed,
    #[error("the peer's shared memory is not a memory file")]
    NotMemoryFile,
    #[error("the peer's shared memory is not ordinary shared memory")]
    NotOrdinary,
    #[error("the peer's shared memory is empty")]
    Empty,
    #[error("cannot map the peer's shared memory: {0}")]
    Mmap(String),
}

/// Why one of a proven peer's shared allocations is not mapped here.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum ShareError {
    /// The request for its descriptor failed.
    #[error(transparent)]
    Ask(#[from] LocalError),
    /// The answer said it is attached but no descriptor came.
    #[error("missing descriptor")]
    MissingDescriptor,
    /// The peer has no such allocation.
    #[error("the peer has no shared allocation {0:?} to hand over")]
    Unknown(String),
    /// Its descriptor could not be mapped.
    #[error(transparent)]
    Map(#[from] MapError),
}

/// Why the kernel does not let this process copy into a proven peer.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum CmaRefused {
    /// Nothing of the peer to probe.
    #[error("the peer exports no readable registration to probe")]
    NothingToProbe,
    /// `process_vm_readv` of the probe failed.
    #[error("process_vm_readv denied: {0}")]
    Denied(Arc<std::io::Error>),
    /// A test hook said no.
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code, reason = "made by the fault hooks only"))]
    #[error("process_vm_readv denied (injected by a test)")]
    Injected,
}

/// Why this engine does not open same-host peers' device memory.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum IpcOff {
    /// `cuda_ipc` is false.
    #[error("CUDA IPC is off (cuda_ipc)")]
    Disabled,
    /// No driver here.
    #[error("no CUDA here: {0}")]
    NoCuda(crate::cuda::CudaError),
}

/// Why a peer's device registration is not opened here (CUDA IPC).
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum ImportError {
    /// The peer is not proven to run on this host.
    #[error(transparent)]
    NotLocal(#[from] LocalError),
    /// This engine does not import device memory.
    #[error(transparent)]
    Off(#[from] IpcOff),
    /// The peer refused to export it: its words.
    #[error("the peer did not export it: {0}")]
    NotExported(String),
    /// The peer deregistered it meanwhile.
    #[error("the peer no longer has it")]
    Gone,
    /// A shareable handle came without its descriptor.
    #[error("the peer sent no descriptor for it")]
    NoDescriptor,
    /// The driver would not open it.
    #[error(transparent)]
    Driver(#[from] crate::cuda::CudaError),
    /// The peer's size of the allocation is not the mapping's.
    #[error("the peer says its allocation has {said} bytes, the mapping has {mapped}")]
    SizeMismatch { said: u64, mapped: u64 },
    /// The registration lies outside the allocation opened.
    #[error("{offset}+{len} lies outside the peer's allocation of {alloc} bytes")]
    Outside { offset: u64, len: u64, alloc: u64 },
}

#[cfg(test)]
mod tests {
    use super::{LocalError, OpenError};

    /// How a link's opening failed, in the words peers' errors carry.
    #[test]
    fn open_errors_say_what_went_wrong() {
        assert_eq!(OpenError::Connect("c".into()).to_string(), "c");
        assert_eq!(OpenError::Protocol("p".into()).to_string(), "p");
        assert_eq!(OpenError::Unauthenticated("u".into()).to_string(), "u");
        assert_eq!(
            OpenError::EpochMismatch { expected: 0x1f, found: 0xa }.to_string(),
            "epoch 0xa where 0x1f was expected"
        );
        assert_eq!(OpenError::OwnEngine.to_string(), "the peer is this engine itself");
        assert_eq!(LocalError::Handshake(OpenError::OwnEngine).to_string(), "the peer is this engine itself");
        assert_eq!(
            LocalError::Describe(OpenError::Protocol("p".into())).to_string(),
            "the process behind the local socket: p"
        );
    }
}
