//! What a route is, in one interface, and the policy that picks one.
//!
//! Every route (the self connection, shm, cma, tcp, a local file; later
//! CUDA and RDMA) implements [`RouteImpl`]: its capability check at
//! prepare, how it addresses a target's ranges, the kind of copy program
//! it runs, whether the target must lend it the ranges, and where its
//! tasks run. `transport::policy` lists them and picks one.

use crate::segment::{ExportedRegistration, SegmentView};
use crate::transport::CopyKind;
use crate::transport::liveness::PeerLiveness;
use crate::transport::mapping::SharedMaps;
use crate::types::{Desc, Route};

/// Why a route does not reach a transfer's target, or cannot address one
/// of its ranges (reported as `PeerError::RouteUnavailable`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Unreachable {
    /// The target is not this engine.
    #[error("not this engine")]
    NotThisEngine,
    /// The target is not a peer (or the route addresses no peer ranges).
    #[error("not a peer")]
    NotPeer,
    /// The target is not a local file.
    #[error("not a file")]
    NotFile,
    /// The peer is not proven to run on this host: why the proof failed.
    #[error("{0}")]
    NotSameHost(String),
    /// The kernel refuses cross-memory copies into the peer: its words.
    #[error("{0}")]
    CmaDenied(String),
    /// CUDA IPC with this peer is off or impossible here: why.
    #[error("{0}")]
    IpcUnavailable(String),
    /// A target range is the peer's device memory (no CPU copy reaches it).
    #[error("a target range is CUDA device memory (device {0}) of the peer")]
    PeerDeviceMemory(u32),
    /// A target range is the peer's host memory (CUDA IPC takes device
    /// memory only).
    #[error("a target range is host memory")]
    PeerHostMemory,
    /// A descriptor names a registration the peer's view does not have.
    #[error("names an unknown registration")]
    UnknownRegistration,
    /// A target range is not in a shared allocation.
    #[error("not every target range is shared memory")]
    NotShared,
    /// A target range's shared allocation is not mapped here (yet).
    #[error("shared allocation not mapped")]
    NotMapped,
    /// A target range's shared allocation could not be mapped.
    #[error("shared allocation could not be mapped")]
    MapFailed,
    /// A registration says it lies outside its shared allocation.
    #[error("registration outside its shared allocation")]
    OutsideShared,
    /// The peer's device memory is not imported: why, if an import failed.
    #[error("the peer's device memory is not imported{}", .0.as_ref().map_or(" (yet)".to_owned(), |w| format!(": {w}")))]
    NotImported(Option<String>),
    /// This build lacks what the route needs.
    #[error(transparent)]
    NotBuilt(#[from] crate::cuda::CudaError),
}

/// What this engine learnt at open about a peer proven to run on this host.
pub(crate) struct SameHost {
    /// Whether the kernel lets this process use CMA on the peer.
    pub cma: Result<(), String>,
    /// The peer's pid in this pid namespace, as the kernel reported it
    /// (never the one the peer named).
    pub pid: i32,
    /// Whether this engine opens the peer's device memory through CUDA
    /// IPC (charging imports to these counters), or why not.
    pub ipc: Result<std::sync::Arc<crate::charge::Counters>, String>,
}

/// What a route sees of a peer at prepare.
pub(crate) struct PeerReach<'a> {
    /// The peer's registrations as this engine knows them.
    pub segment: &'a SegmentView,
    /// Its shared allocations mapped here.
    pub maps: &'a SharedMaps,
    /// `Err(why)` when the peer is not proven to run on this host.
    pub same_host: Result<&'a SameHost, &'a str>,
    /// For a same-host peer: whether its process still runs.
    pub alive: Option<&'a PeerLiveness>,
    /// For a same-host peer: its device registrations opened here.
    pub imports: &'a crate::transport::mapping::Imports,
}

/// A transfer's target, as routes see it.
pub(crate) enum Reach<'a> {
    /// This engine (the self connection).
    Loopback,
    /// A peer engine.
    Peer(PeerReach<'a>),
    /// A local file.
    File(&'a std::sync::Arc<crate::file::Entry>, &'a std::sync::Arc<crate::file::BouncePool>),
}

/// Which targets a route serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Serves {
    Loopback,
    Peer,
    File,
}

/// Where a route's tasks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Runs {
    /// On the local workers (or, for a lone small task, the posting
    /// thread): this process copies.
    Workers,
    /// On the peer's link: frames to the peer's server.
    PeerLink,
}

/// One route.
pub(crate) trait RouteImpl: Sync {
    /// Its name.
    fn route(&self) -> Route;

    /// The targets it serves.
    fn serves(&self) -> Serves;

    /// Prepare's capability check and copy program in one: the kind of
    /// copy that reaches every target range `remote` names, or why this
    /// route does not reach them.
    fn plan(&self, target: &Reach<'_>, remote: &[Desc]) -> Result<CopyKind, Unreachable>;

    /// What the `auto` policy says when it picks this route.
    fn auto_reason(&self) -> Option<&'static str> {
        None
    }

    /// Addressing of a peer registration: the base its spans' `remote`
    /// counts from, and the raw id spans carry (0: none).
    fn address(&self, target: &PeerReach<'_>, r: &ExportedRegistration) -> Result<(u64, u64), Unreachable> {
        let _ = (target, r);
        Err(Unreachable::NotPeer)
    }

    /// Leases: whether the target must lend the ranges while transfers may
    /// touch them (one-sided routes, which bypass the target's server).
    fn borrows(&self) -> bool {
        false
    }

    /// Whether the ranges it borrows are device memory (lent on the local
    /// socket only, through CUDA IPC).
    fn lends_device(&self) -> bool {
        false
    }

    /// Where its tasks run.
    fn runs(&self) -> Runs {
        Runs::Workers
    }

    /// Whether its tasks are frames the peer's link sends (else this
    /// process copies them).
    fn sends_frames(&self) -> bool {
        self.runs() == Runs::PeerLink
    }
}

#[cfg(test)]
mod tests {
    use super::Unreachable;

    #[test]
    fn refusals_say_why_in_the_words_the_reasons_used() {
        assert_eq!(Unreachable::NotImported(None).to_string(), "the peer's device memory is not imported (yet)");
        assert_eq!(
            Unreachable::NotImported(Some("cuIpcOpenMemHandle failed".into())).to_string(),
            "the peer's device memory is not imported: cuIpcOpenMemHandle failed"
        );
        assert_eq!(
            Unreachable::PeerDeviceMemory(3).to_string(),
            "a target range is CUDA device memory (device 3) of the peer"
        );
        assert_eq!(
            Unreachable::from(crate::cuda::CudaError::NotBuilt).to_string(),
            crate::cuda::CudaError::NotBuilt.to_string()
        );
    }
}
