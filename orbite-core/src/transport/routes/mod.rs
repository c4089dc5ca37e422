//! The routes: one module each, and the interface they share.
//!
//! Every route (the self connection, shm, cma, cuda-ipc, rdma, tcp, a
//! local file) is one module here implementing [`RouteImpl`]: its
//! capability check and copy program at prepare ([`RouteImpl::plan`]),
//! how it addresses a target's ranges, whether the target must lend it
//! the ranges, and where its tasks run; its copies are the [`Copier`] it
//! plans, which lives in the same module. [`choose`] is the
//! policy: the route list, in the order `auto` prefers, and why one was
//! picked. The engine asks this interface and names no route.
//!
//! A route that keeps something per opened peer (mappings, imports; an
//! RDMA route's queue pairs and keys) opens it in
//! [`RouteImpl::open_peer`], as a [`PeerState`] the peer holds until it
//! is closed; prepare finds it in [`PeerReach::state`].
//!
//! Adding a route is its module, one line in [`ROUTES`], and its name in
//! `types::Route` (and in `RoutePolicy`, to force it); nothing else here
//! or in the engine names a route.

pub(crate) mod cma;
pub(crate) mod cuda_ipc;
pub(crate) mod device;
pub(crate) mod file;
pub(crate) mod loopback;
pub(crate) mod rdma;
pub(crate) mod shm;
pub(crate) mod staging;
pub(crate) mod tcp;

pub(crate) use shm::map_shared;

use std::sync::Arc;

use parking_lot::RwLock;

use crate::segment::{ExportedRegistration, SegmentDescriptor, SegmentView};
use crate::transport::liveness::PeerLiveness;
use crate::transport::peer_errors::{CmaRefused, ImportError, IpcOff, LocalError, ShareError};
use crate::transport::{PeerError, Span};
use crate::types::{Desc, Op, Route, RouteChoice, RoutePolicy, TaskEnd};

/// Why a route does not reach a transfer's target, or cannot address one
/// of its ranges (reported as `PeerError::RouteUnavailable`).
#[derive(Debug, Clone, thiserror::Error)]
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
    #[error(transparent)]
    NotSameHost(LocalError),
    /// The kernel refuses cross-memory copies into the peer.
    #[error(transparent)]
    CmaDenied(CmaRefused),
    /// CUDA IPC with this peer is off or impossible here: why.
    #[error(transparent)]
    IpcUnavailable(IpcOff),
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
    NotImported(Option<ImportError>),
    /// This build lacks what the route needs.
    #[error(transparent)]
    NotBuilt(#[from] crate::cuda::CudaError),
    /// RDMA does not reach the peer, or one of its ranges: why.
    #[error("{0}")]
    Rdma(String),
}

/// What this engine learnt at open about a peer proven to run on this host.
pub(crate) struct SameHost {
    /// Whether the kernel lets this process use CMA on the peer.
    pub cma: Result<(), CmaRefused>,
    /// The peer's pid in this pid namespace, as the kernel reported it
    /// (never the one the peer named).
    pub pid: i32,
    /// Whether this engine opens the peer's device memory through CUDA
    /// IPC (charging imports to these counters), or why not.
    pub ipc: Result<std::sync::Arc<crate::charge::Counters>, IpcOff>,
}

/// What each same-host route learns when a peer proven to run on this
/// host (as process `pid`, by the kernel's word) is opened: cma's probe,
/// and whether cuda-ipc may open its device memory (`ipc`: whether
/// `cuda_ipc` is on, and the counters its imports are charged to).
pub(crate) fn open_same_host(
    pid: i32,
    peer: &crate::segment::SegmentDescriptor,
    ipc: (bool, &Arc<crate::charge::Counters>),
) -> SameHost {
    SameHost { cma: cma::open_peer(pid, peer), pid, ipc: cuda_ipc::open_peer(ipc.0, ipc.1) }
}

/// What a same-host peer hands over its local socket: its shared
/// allocations' descriptors (per name, or why not), and its device
/// registrations' IPC handles.
pub(crate) trait LocalFetch {
    fn shared(&self, names: &[&str]) -> Result<Vec<Result<std::os::fd::OwnedFd, ShareError>>, LocalError>;
    #[allow(clippy::type_complexity, reason = "one use")]
    fn ipc(&self, ids: &[u64]) -> Result<Vec<(crate::wire::IpcEntry, Option<std::os::fd::OwnedFd>)>, LocalError>;
}

/// A peer being opened, as a route sees it when it opens its state.
pub(crate) struct PeerOpening<'a> {
    /// The peer's description.
    pub descriptor: &'a SegmentDescriptor,
    /// `Err(why)` when the peer is not proven to run on this host.
    pub same_host: Result<&'a SameHost, &'a LocalError>,
    /// Its local socket (a same-host peer only answers there).
    pub local: &'a dyn LocalFetch,
    /// This engine's RDMA NICs.
    pub rails: &'a crate::verbs::rails::Rails,
    /// `rdma_qps_per_nic`.
    pub qps_per_nic: u32,
    /// `peer_timeout_ms`: how long a task may wait for its completions.
    pub timeout: std::time::Duration,
    /// A control call to the peer on its authenticated connection: the
    /// reply's body, or why there is none.
    pub control: &'a dyn Fn(crate::wire::Kind, Vec<u8>) -> Result<Vec<u8>, String>,
    /// Asks the peer something on its control connection, without
    /// waiting: if the peer is gone, its link is lost (what a one-sided
    /// route does after its own requests went unanswered).
    pub probe: Arc<dyn Fn() + Send + Sync>,
}

/// A route's own state for one opened peer: opened with it
/// ([`RouteImpl::open_peer`]), kept in step with its registrations, and
/// closed (dropped) with it.
pub(crate) trait PeerState: Send + Sync + 'static {
    fn as_any(&self) -> &dyn std::any::Any;

    /// The peer's view took `added` and now is `view`. Called under the
    /// view's write lock: it notes what to open and lets go of what was
    /// opened for registrations gone; it asks the peer nothing.
    fn changed(&self, view: &SegmentView, added: &[ExportedRegistration]) {
        let _ = (view, added);
    }

    /// True while [`PeerState::catch_up`] has something to open.
    fn behind(&self) -> bool {
        false
    }

    /// Opens what [`PeerState::changed`] noted, on a caller's thread,
    /// asking the peer over `local` (never on the reactor). `view` is the
    /// peer's view, read-locked while what was opened is kept.
    fn catch_up(&self, view: &RwLock<SegmentView>, local: &dyn LocalFetch) {
        let _ = (view, local);
    }
}

/// Every route's state for one peer.
pub(crate) struct PeerStates(Vec<(Route, Box<dyn PeerState>)>);

impl PeerStates {
    /// What each route opens for `peer`.
    pub fn open(peer: &PeerOpening<'_>) -> PeerStates {
        PeerStates(ROUTES.iter().filter_map(|r| Some((r.route(), r.open_peer(peer)?))).collect())
    }

    /// [`PeerState::changed`], for every route.
    pub fn changed(&self, view: &SegmentView, added: &[ExportedRegistration]) {
        self.0.iter().for_each(|(_, s)| s.changed(view, added));
    }

    /// True while a route has something to open.
    pub fn behind(&self) -> bool {
        self.0.iter().any(|(_, s)| s.behind())
    }

    /// [`PeerState::catch_up`], for every route.
    pub fn catch_up(&self, view: &RwLock<SegmentView>, local: &dyn LocalFetch) {
        self.0.iter().for_each(|(_, s)| s.catch_up(view, local));
    }
}

/// What a route sees of a peer at prepare.
pub(crate) struct PeerReach<'a> {
    /// The peer's registrations as this engine knows them.
    pub segment: &'a SegmentView,
    /// `Err(why)` when the peer is not proven to run on this host.
    pub same_host: Result<&'a SameHost, &'a LocalError>,
    /// For a same-host peer: whether its process still runs.
    pub alive: Option<&'a PeerLiveness>,
    /// What each route keeps for this peer.
    pub states: &'a PeerStates,
}

impl PeerReach<'_> {
    /// `route`'s state for this peer (`T`: its type), if it opened one.
    pub(crate) fn state<T: 'static>(&self, route: Route) -> Option<&T> {
        self.states.0.iter().find(|(r, _)| *r == route)?.1.as_any().downcast_ref()
    }
}

/// A transfer's target, as routes see it: a peer with its view, a local
/// file with the engine's bounce pool.
pub(crate) type Reach<'a> = crate::types::TargetOf<PeerReach<'a>, FileReach<'a>>;

/// A local file, as the file route sees it.
pub(crate) type FileReach<'a> = (&'a Arc<crate::file::Entry>, &'a Arc<crate::file::BouncePool>);

impl<'a> crate::types::TargetOf<PeerReach<'a>, FileReach<'a>> {
    /// The peer a same-host route reaches, and what this engine learnt of
    /// it at open; or why it is not one (not a peer, or not proven to run
    /// on this host).
    pub(crate) fn same_host_peer(&self) -> Result<(&PeerReach<'a>, &'a SameHost), Unreachable> {
        let Reach::Peer(p) = self else { return Err(Unreachable::NotPeer) };
        let h = p.same_host.map_err(|why| Unreachable::NotSameHost(why.clone()))?;
        Ok((p, h))
    }
}

/// One route.
pub(crate) trait RouteImpl: Sync {
    /// Its name.
    fn route(&self) -> Route;

    /// Its state for a peer being opened, if it keeps one.
    fn open_peer(&self, peer: &PeerOpening<'_>) -> Option<Box<dyn PeerState>> {
        let _ = peer;
        None
    }

    /// Whether it serves this kind of target (a peer route, the default,
    /// serves every peer; whether it reaches one's ranges is
    /// [`RouteImpl::plan`]'s).
    fn serves(&self, target: &Reach<'_>) -> bool {
        matches!(target, Reach::Peer(_))
    }

    /// Prepare's capability check and copy program in one: how the tasks
    /// reaching every target range `remote` names move, or why this route
    /// does not reach them.
    fn plan(&self, target: &Reach<'_>, remote: &[Desc]) -> Result<Mover, Unreachable>;

    /// What the policy says when it picks this route (under `auto`, for a
    /// peer).
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

    /// How it reaches the ranges it borrows, as the Borrow's flags say:
    /// none for host memory by address; `wire::BORROW_DEVICE` for device
    /// memory through CUDA IPC (lent on the local socket only);
    /// `wire::BORROW_RDMA` for ranges with memory regions.
    fn borrow_flags(&self) -> u8 {
        0
    }
}

/// Lets go of what the routes made for the calling thread (a worker, as
/// it ends, after its last task completed): device streams, stagers.
pub(crate) fn release_thread() {
    crate::cuda::release_thread_streams();
    staging::release_thread_stagers();
}

/// The first `limit` bytes of `spans`: each span with its bytes that
/// count, until `limit` is spent (a span of no bytes before then counts,
/// with 0).
pub(crate) fn within(spans: &[Span], limit: u64) -> impl Iterator<Item = (&Span, u64)> {
    spans.iter().scan(limit, |left, s| {
        (*left > 0).then(|| {
            let n = s.len.min(*left);
            *left -= n;
            (s, n)
        })
    })
}

/// Every route. For peers, `auto` prefers them in this order.
pub(crate) static ROUTES: &[&dyn RouteImpl] =
    &[&loopback::Loopback, &shm::Shm, &cma::Cma, &cuda_ipc::CudaIpc, &rdma::Rdma, &tcp::Tcp, &file::File];

/// The route called `route`.
pub(crate) fn by_name(route: Route) -> &'static dyn RouteImpl {
    ROUTES.iter().copied().find(|r| r.route() == route).expect("every Route has an implementation in ROUTES")
}

/// The route policy: which route a transfer to `target` naming `remote`
/// takes under `policy` (peers only; the self connection and files have
/// one route each), and why.
pub(crate) fn choose(
    policy: RoutePolicy,
    target: &Reach<'_>,
    remote: &[Desc],
) -> Result<(&'static dyn RouteImpl, RouteChoice, Mover), PeerError> {
    let choice =
        |r: &'static dyn RouteImpl, kind, reason: String| Ok((r, RouteChoice { route: r.route(), reason }, kind));
    let mut serving = ROUTES.iter().copied().filter(|r| r.serves(target));
    if !matches!(target, Reach::Peer(_)) {
        // The self connection and files have one route each.
        let r = serving.next().expect("a route for every target");
        let kind = r
            .plan(target, remote)
            .map_err(|why| PeerError::RouteUnavailable { route: r.route(), reason: why.to_string() })?;
        return choice(r, kind, r.auto_reason().unwrap_or_default().into());
    }
    let forced = policy.forced();
    if let Some(route) = forced {
        let r = by_name(route);
        return match r.plan(target, remote) {
            Ok(kind) => choice(r, kind, format!("policy {}", route.name())),
            Err(why) => Err(PeerError::RouteUnavailable { route, reason: why.to_string() }),
        };
    }
    // auto: the first peer route that reaches every range; the reason says
    // what ruled out the ones before it.
    let mut ruled_out = Vec::new();
    for r in serving {
        match r.plan(target, remote) {
            Ok(kind) => {
                let parts: Vec<String> = r.auto_reason().map(str::to_owned).into_iter().chain(ruled_out).collect();
                return choice(r, kind, format!("auto: {}", parts.join("; ")));
            }
            Err(why) => ruled_out.push(format!("not {}: {why}", r.route().name())),
        }
    }
    Err(PeerError::RouteUnavailable { route: Route::Tcp, reason: ruled_out.join("; ") })
}

/// Device memory with a copier that cannot take it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CUDA device memory (device {device}) with {kind}")]
pub(crate) struct NoDeviceCopy {
    pub device: u32,
    pub kind: &'static str,
}

/// A transfer's local side, as a copier adapts to it at prepare
/// ([`Copier::with_local`]).
pub(crate) struct LocalSide<'a> {
    /// The CUDA device of the first device registration named, if any.
    pub device: Option<u32>,
    /// The registrations the transfer names.
    pub loans: &'a [Arc<crate::registry::Registration>],
    /// `cuda_pin_host`.
    pub pin_host: bool,
    /// `staging_chunk_bytes`.
    pub chunk: u64,
    pub pool: &'a Arc<staging::StagingPool>,
}

impl LocalSide<'_> {
    /// This engine's host registrations named, to be page-locked for the
    /// driver (none unless `cuda_pin_host`). Collected only by a copier
    /// that drives the device: host-only prepares pay nothing for it.
    pub(crate) fn pins(&self) -> Vec<Arc<crate::cuda::HostPin>> {
        match self.pin_host {
            true => self.loans.iter().filter_map(|r| r.pin.clone()).collect(),
            false => Vec::new(),
        }
    }

    /// The refusal for a copier that takes no device memory (none with
    /// host memory only).
    pub(crate) fn host_only(&self, copier: Box<dyn Copier>) -> Result<Box<dyn Copier>, NoDeviceCopy> {
        match self.device {
            None => Ok(copier),
            Some(device) => Err(NoDeviceCopy { device, kind: copier.name() }),
        }
    }
}

/// How a route's tasks are copied by this process: what its
/// [`RouteImpl::plan`] returns, run by the local workers (or a helping
/// caller). Each route's copier lives in its module; a route that posts
/// work and is told of its completion later (a device's stream, an RDMA
/// queue pair) implements [`Copier::post`].
pub(crate) trait Copier: Send + Sync + 'static {
    /// Its name, for refusals.
    fn name(&self) -> &'static str;

    /// Copies `spans` (at most `limit` bytes) on the calling thread: the
    /// bytes moved and, on failure, how the task ended.
    fn copy(&self, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>);

    /// Starts a task without waiting for it, to be ended by
    /// [`Posted::finish`] on the same thread: a worker keeps a few posted
    /// so the device never idles between them. `None`: this copier does
    /// not post (the worker runs [`Copier::copy`]); `Some(Err)`: the task
    /// already ended.
    #[allow(clippy::type_complexity, reason = "posted, or how it ended")]
    fn post(&self, op: Op, spans: &[Span], limit: u64) -> Option<Result<Box<dyn Posted>, (u64, Option<TaskEnd>)>> {
        let _ = (op, spans, limit);
        None
    }

    /// How it copies with the transfer's local side `local`: itself, a
    /// copier that reaches device memory, or why none does.
    fn with_local(self: Box<Self>, local: &LocalSide<'_>) -> Result<Box<dyn Copier>, NoDeviceCopy>;

    /// Whether its tasks must stay off the posting thread (they wait for a
    /// device).
    fn waits(&self) -> bool {
        false
    }

    /// Whether a caller's thread may run its tasks (a helping caller never
    /// waits on a device or on another task).
    fn helpable(&self) -> bool {
        !self.waits()
    }

    /// Where its tasks are cut, given `task_bytes` (`configured`).
    fn task_bytes(&self, configured: u64) -> u64 {
        configured
    }

    /// Whether a posted task of `spans` holds one of the worker's staging
    /// buffers until it is finished.
    fn holds_buffer(&self, spans: &[Span]) -> bool {
        let _ = spans;
        false
    }

    /// For such a task: whether a buffer can be had now (then reserved for
    /// it).
    fn buffer_room(&self, spans: &[Span]) -> bool {
        let _ = spans;
        true
    }

    /// A span it cannot copy, found at prepare: its index and why.
    fn refuse(&self, op: Op, spans: &[Span]) -> Option<(usize, String)> {
        let _ = (op, spans);
        None
    }

    /// How device memory moves, for the route's reason.
    fn device_note(&self) -> Option<String> {
        None
    }
}

impl std::fmt::Debug for dyn Copier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A task [`Copier::post`] started.
pub(crate) trait Posted {
    /// Whether it holds a staging buffer until it is finished.
    fn holds_buffer(&self) -> bool {
        false
    }

    /// Sleeps until it (and what was posted before it on this thread) is
    /// done.
    fn await_done(&self);

    /// Waits for it and says how it ended: the bytes moved and, on
    /// failure, how.
    fn finish(self: Box<Self>) -> (u64, Option<TaskEnd>);
}

/// How a planned program's tasks move: copies this process makes, or
/// frames the peer's link sends.
#[derive(Debug)]
pub(crate) enum Mover {
    /// This process copies them, on the local workers (or the posting
    /// thread).
    Copy(Box<dyn Copier>),
    /// The peer's link sends them as frames and the peer's server copies.
    /// `staging`: the device whose memory this side stages through the
    /// pool's page-locked buffers first (feature `cuda`).
    Frames { staging: Option<u32> },
}

impl Mover {
    /// The copies this process makes (`None`: frames).
    pub(crate) fn copies(&self) -> Option<&dyn Copier> {
        match self {
            Mover::Copy(copier) => Some(&**copier),
            Mover::Frames { .. } => None,
        }
    }

    /// Whether its tasks go to the peer's link (once staged, if staging).
    pub(crate) fn sends_frames(&self) -> bool {
        matches!(self, Mover::Frames { .. })
    }

    /// The device a frames program stages through the pool.
    pub(crate) fn staging(&self) -> Option<u32> {
        match self {
            Mover::Frames { staging } => *staging,
            Mover::Copy(_) => None,
        }
    }

    /// How it moves the memory a transfer's local ranges are in (`loans`):
    /// each copier says how it takes CUDA device memory (or that it does
    /// not); tcp stages on a worker before its link sends. No CPU copy is
    /// ever handed a device address.
    pub(crate) fn for_memory(
        self,
        loans: &[Arc<crate::registry::Registration>],
        config: &crate::config::EngineConfig,
        pool: &Arc<staging::StagingPool>,
    ) -> Result<Mover, NoDeviceCopy> {
        let device = loans.iter().find_map(|r| match r.kind {
            crate::memory::MemoryKind::Cuda { device } => Some(device),
            _ => None,
        });
        match self {
            Mover::Frames { staging } => Ok(Mover::Frames { staging: device.or(staging) }),
            Mover::Copy(copier) => {
                let local = LocalSide {
                    device,
                    loans,
                    pin_host: config.cuda_pin_host,
                    chunk: config.staging_chunk_bytes,
                    pool,
                };
                Ok(Mover::Copy(copier.with_local(&local)?))
            }
        }
    }

    /// Whether a caller's thread may run its tasks (helping): copies only.
    pub(crate) fn helpable(&self) -> bool {
        self.copies().is_some_and(Copier::helpable)
    }

    /// Whether its tasks must stay off the posting thread.
    pub(crate) fn waits_for_device(&self) -> bool {
        self.staging().is_some() || self.copies().is_some_and(Copier::waits)
    }

    /// Where its tasks are cut, given `task_bytes` (`configured`).
    pub(crate) fn task_bytes(&self, configured: u64) -> u64 {
        self.copies().map_or(configured, |c| c.task_bytes(configured))
    }

    /// How device memory moves, for the route's reason.
    pub(crate) fn device_note(&self) -> Option<String> {
        match self {
            Mover::Copy(copier) => copier.device_note(),
            Mover::Frames { staging: Some(d) } => {
                Some(format!("CUDA device memory (device {d}) staged through the pinned pool"))
            }
            Mover::Frames { staging: None } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Unreachable;

    #[test]
    fn refusals_say_why_in_the_words_the_reasons_used() {
        assert_eq!(Unreachable::NotImported(None).to_string(), "the peer's device memory is not imported (yet)");
        assert_eq!(
            Unreachable::NotImported(Some(crate::transport::peer_errors::ImportError::Gone)).to_string(),
            "the peer's device memory is not imported: the peer no longer has it"
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

    /// `within` yields each span with its counted bytes until the limit
    /// is spent: a span of no bytes before then counts (with 0), none
    /// after it.
    #[test]
    fn within_counts_spans_until_the_limit_is_spent() {
        let s = |len| crate::transport::Span { local: 0, remote: 0, remote_reg: 0, len };
        let spans = [s(4), s(0), s(3), s(0), s(5)];
        let got = |limit| super::within(&spans, limit).map(|(s, n)| (s.len, n)).collect::<Vec<_>>();
        assert_eq!(got(u64::MAX), [(4, 4), (0, 0), (3, 3), (0, 0), (5, 5)]);
        assert_eq!(got(7), [(4, 4), (0, 0), (3, 3)]);
        assert_eq!(got(5), [(4, 4), (0, 0), (3, 1)]);
        assert_eq!(got(4), [(4, 4)]);
        assert!(got(0).is_empty());
    }

    use super::{LocalFetch, PeerOpening, PeerReach, PeerStates, SameHost};
    use crate::segment::{ExportedRegistration, SegmentDescriptor, SegmentView};
    use crate::transport::peer_errors::{IpcOff, LocalError, ShareError};
    use crate::types::{Permission, RegistrationId, Route};
    use parking_lot::{Mutex, RwLock};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::Arc;

    /// A same-host peer's local socket: sealed memfds for shared
    /// allocations (the names asked are noted), no IPC handles.
    #[derive(Default)]
    struct Socket {
        asked: Mutex<Vec<Vec<String>>>,
    }

    impl LocalFetch for Socket {
        fn shared(&self, names: &[&str]) -> Result<Vec<Result<OwnedFd, ShareError>>, LocalError> {
            self.asked.lock().push(names.iter().map(|n| n.to_string()).collect());
            Ok(names.iter().map(|_| Ok(sealed_memfd())).collect())
        }

        fn ipc(&self, _ids: &[u64]) -> Result<Vec<(crate::wire::IpcEntry, Option<OwnedFd>)>, LocalError> {
            Err(LocalError::NoSocket)
        }
    }

    fn sealed_memfd() -> OwnedFd {
        // SAFETY: memfd_create with a valid C string.
        let fd = unsafe { libc::memfd_create(c"orbite-test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor this test owns; plain calls on it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: as above.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), 8192), 0);
            assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
        }
        fd
    }

    fn reg(raw: u64, shm: Option<&str>, device: Option<u32>) -> ExportedRegistration {
        ExportedRegistration {
            rkeys: Vec::new(),
            id: RegistrationId::from_raw(raw),
            len: 4096,
            permission: Permission::RemoteReadWrite,
            addr: 0,
            shm: shm.map(|n| (n.to_owned(), 0)),
            device,
        }
    }

    /// Each route's state for a peer is opened with it, follows its
    /// registrations, and goes with it: shm maps every shared allocation
    /// once at open and what the peer adds at the next catch-up (never
    /// while the view is locked); cuda-ipc notes device registrations and
    /// keeps why an import failed; a peer not proven local gets neither.
    #[test]
    fn route_states_open_with_a_peer_follow_its_registrations_and_close_with_it() {
        let desc = SegmentDescriptor {
            rdma_nics: 0,
            endpoint: "peer".into(),
            epoch: 7,
            registry_version: 1,
            pid: 1,
            boot_id: [1; 16],
            inbox: String::new(),
            local_socket: String::new(),
            registrations: vec![reg(1, Some("a"), None), reg(2, Some("a"), None), reg(3, None, Some(0))],
        };
        let counters = Arc::new(crate::charge::Counters::default());
        let rails = crate::verbs::rails::Rails::none("test");
        let no_control = |_: crate::wire::Kind, _: Vec<u8>| -> Result<Vec<u8>, String> { Err("no link".into()) };
        let host = SameHost { cma: Ok(()), pid: 1, ipc: Ok(counters) };
        let socket = Socket::default();
        let states = PeerStates::open(&PeerOpening {
            descriptor: &desc,
            same_host: Ok(&host),
            local: &socket,
            rails: &rails,
            qps_per_nic: 2,
            timeout: std::time::Duration::from_secs(1),
            control: &no_control,
            probe: Arc::new(|| {}),
        });
        assert_eq!(*socket.asked.lock(), [["a"]], "one fetch at open, each allocation once");
        let view = RwLock::new(SegmentView::bounded(&desc, 0).unwrap());
        let mapping = {
            let v = view.read();
            let reach = PeerReach { segment: &v, same_host: Ok(&host), alive: None, states: &states };
            let shm = reach.state::<super::shm::ShmPeer>(Route::Shm).expect("shm opened its state");
            assert!(reach.state::<super::shm::ShmPeer>(Route::CudaIpc).is_none(), "each route finds its own");
            let maps = shm.maps_for_test();
            maps.get("a").unwrap().as_ref().unwrap().clone()
        };
        assert!(states.behind(), "the device registration waits for its import");
        // A change: noted under the view's lock, opened by the catch-up.
        {
            let mut v = view.write();
            let added = vec![reg(4, Some("b"), None)];
            let delta = crate::segment::Delta { version: 2, added: added.clone(), ..Default::default() };
            assert!(v.apply_from(1, delta).unwrap());
            states.changed(&v, &added);
        }
        assert_eq!(socket.asked.lock().len(), 1, "nothing asked while the view is locked");
        states.catch_up(&view, &socket);
        assert!(!states.behind());
        assert_eq!(socket.asked.lock()[1], ["b"]);
        {
            let v = view.read();
            let reach = PeerReach { segment: &v, same_host: Ok(&host), alive: None, states: &states };
            assert!(reach.state::<super::shm::ShmPeer>(Route::Shm).unwrap().maps_for_test().contains_key("b"));
            let refused = super::by_name(Route::CudaIpc)
                .plan(&super::Reach::Peer(reach), &[crate::types::Desc::new(RegistrationId::from_raw(3), 0, 16)]);
            assert!(
                matches!(refused, Err(super::Unreachable::NotImported(Some(_)))),
                "the import's failure is kept and said"
            );
        }
        // Not proven local: no route state.
        let why = LocalError::NoSocket;
        let none = PeerStates::open(&PeerOpening {
            descriptor: &desc,
            same_host: Err(&why),
            local: &socket,
            rails: &rails,
            qps_per_nic: 2,
            timeout: std::time::Duration::from_secs(1),
            control: &no_control,
            probe: Arc::new(|| {}),
        });
        assert!(!none.behind());
        assert_eq!(socket.asked.lock().len(), 2);
        let host_off = SameHost { cma: Ok(()), pid: 1, ipc: Err(IpcOff::Disabled) };
        let no_ipc = PeerStates::open(&PeerOpening {
            descriptor: &desc,
            same_host: Ok(&host_off),
            local: &socket,
            rails: &rails,
            qps_per_nic: 2,
            timeout: std::time::Duration::from_secs(1),
            control: &no_control,
            probe: Arc::new(|| {}),
        });
        assert!(!no_ipc.behind(), "IPC off: nothing to import");
        // Closed with the peer: a mapping goes with its last user.
        let weak = Arc::downgrade(&mapping);
        drop((states, no_ipc));
        assert!(weak.upgrade().is_some(), "its last user (here the test, elsewhere a prepared transfer) keeps it");
        drop(mapping);
        assert!(weak.upgrade().is_none(), "then it is unmapped");
    }
}
