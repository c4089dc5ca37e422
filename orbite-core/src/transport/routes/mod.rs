//! The routes: one module each, and the interface they share.
//!
//! Every route (the self connection, shm, cma, cuda-ipc, tcp, a local
//! file; RDMA next) is one module here implementing [`RouteImpl`]: its
//! capability check and copy program at prepare ([`RouteImpl::plan`]),
//! how it addresses a target's ranges, whether the target must lend it
//! the ranges, and where its tasks run; its copies are the [`CopyKind`]
//! it plans, whose execution lives in the same module. [`choose`] is the
//! policy: the route list, in the order `auto` prefers, and why one was
//! picked. The engine asks this interface and names no route.
//!
//! A route that keeps something per opened peer (mappings, imports; an
//! RDMA route's queue pairs and keys) opens it in
//! [`RouteImpl::open_peer`], as a [`PeerState`] the peer holds until it
//! is closed; prepare finds it in [`PeerReach::state`].
//!
//! Adding a route is its module, one line in [`ROUTES`], and its name in
//! `types::Route`.

pub(crate) mod cma;
pub(crate) mod cuda_ipc;
pub(crate) mod device;
pub(crate) mod file;
pub(crate) mod loopback;
pub(crate) mod shm;
pub(crate) mod staging;
pub(crate) mod tcp;

pub(crate) use shm::map_shared;

use std::sync::Arc;

use parking_lot::RwLock;

use crate::segment::{ExportedRegistration, SegmentDescriptor, SegmentView};
use crate::transport::liveness::{LivenessCheck, PeerLiveness};
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

    /// `route`'s state, if it opened one.
    fn get<T: 'static>(&self, route: Route) -> Option<&T> {
        self.0.iter().find(|(r, _)| *r == route)?.1.as_any().downcast_ref()
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
        self.states.get(route)
    }
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

impl<'a> Reach<'a> {
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

    /// Whether it serves this kind of target (a peer route serves every
    /// peer; whether it reaches one's ranges is [`RouteImpl::plan`]'s).
    fn serves(&self, target: &Reach<'_>) -> bool;

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

    /// Whether the ranges it borrows are device memory (lent on the local
    /// socket only, through CUDA IPC).
    fn lends_device(&self) -> bool {
        false
    }
}

/// Every route. For peers, `auto` prefers them in this order.
pub(crate) static ROUTES: &[&dyn RouteImpl] =
    &[&loopback::Loopback, &shm::Shm, &cma::Cma, &cuda_ipc::CudaIpc, &tcp::Tcp, &file::File];

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
    let forced = match policy {
        RoutePolicy::Auto => None,
        RoutePolicy::Tcp => Some(Route::Tcp),
        RoutePolicy::Shm => Some(Route::Shm),
        RoutePolicy::Cma => Some(Route::Cma),
        RoutePolicy::CudaIpc => Some(Route::CudaIpc),
    };
    if let Some(route) = forced {
        let r = by_name(route);
        return match r.plan(target, remote) {
            Ok(kind) => choice(r, kind, format!("policy {}", name(route))),
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
            Err(why) => ruled_out.push(format!("not {}: {why}", name(r.route()))),
        }
    }
    Err(PeerError::RouteUnavailable { route: Route::Tcp, reason: ruled_out.join("; ") })
}

/// A route's name as policies and reasons spell it.
fn name(route: Route) -> &'static str {
    match route {
        Route::Loopback => "loopback",
        Route::Tcp => "tcp",
        Route::Shm => "shm",
        Route::Cma => "cma",
        Route::CudaIpc => "cuda-ipc",
        Route::File => "file",
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
        shared_pins: Vec<Arc<crate::cuda::HostPin>>,
    },
    /// `remote` are addresses in process `pid` (cross-memory copies),
    /// checked after each task as for `Mapped`.
    Cma { pid: i32, peer_alive: Option<LivenessCheck> },
    /// `remote` are offsets in a local file; unaligned spans of a direct
    /// file bounce through the engine's pool.
    File(Arc<crate::file::Entry>, Arc<crate::file::BouncePool>),
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
    Staged {
        device: u32,
        /// `staging_chunk_bytes`.
        chunk: u64,
        pool: Arc<staging::StagingPool>,
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
            CopyKind::Memory => (unsafe { loopback::copy_spans(op, spans, limit) }, None),
            CopyKind::Mapped { peer_alive, .. } => shm::copy(op, spans, limit, peer_alive.as_ref()),
            CopyKind::Cma { pid, peer_alive } => cma::copy_task(*pid, op, spans, limit, peer_alive.as_ref()),
            CopyKind::File(entry, bounce) => file::copy(entry, bounce, op, spans, limit),
            CopyKind::Device { .. } | CopyKind::Ipc { .. } => match self.issue(op, spans, limit) {
                Some(Ok(issued)) => self.complete(op, issued),
                Some(Err(ended)) => ended,
                None => unreachable!("device kinds issue"),
            },
            CopyKind::Staged { device, chunk, pool, inner } => {
                staging::copy(pool, *device, *chunk, inner, op, spans, limit)
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
    pub(crate) fn issue(
        &self,
        op: Op,
        spans: &[Span],
        limit: u64,
    ) -> Option<Result<device::Issued, (u64, Option<TaskEnd>)>> {
        let (device, copies) = match self {
            CopyKind::Device { device, pins, .. } => {
                for p in pins {
                    p.ensure(*device);
                }
                (*device, device::copies(op, spans, limit))
            }
            CopyKind::Ipc { mappings, pins, .. } => match cuda_ipc::copies(mappings, op, spans, limit) {
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
                return staging::issue(pool, *device, *chunk, inner, op, spans, limit)
                    .map(|r| r.map(|(ticket, bytes, task)| device::Issued { ticket, bytes, staged: Some(task) }));
            }
            _ => return None,
        };
        let bytes = copies.iter().map(|c| c.2).sum();
        Some(match crate::cuda::issue_on_stream(device, &copies) {
            Ok(ticket) => Ok(device::Issued { ticket, bytes, staged: None }),
            // The bytes of the copies before the failing one landed; whether
            // the failing one wrote anything is not known.
            Err((done, _why)) => Err((done, Some(TaskEnd::Failed { effect_unknown: true }))),
        })
    }

    /// Waits for a task [`issue`](CopyKind::issue) queued: the bytes moved
    /// and, on failure, how it ended (a same-host peer that died meanwhile
    /// fails it, as for a CPU copy into its memory).
    pub(crate) fn complete(&self, op: Op, issued: device::Issued) -> (u64, Option<TaskEnd>) {
        let device::Issued { ticket, bytes, staged } = issued;
        let waited = crate::cuda::wait_ticket(ticket);
        if let (Some(task), CopyKind::Staged { inner, .. }) = (staged, self) {
            return staging::complete(waited, inner, bytes, task);
        }
        match waited {
            Ok(()) => {
                let peer_alive = match self {
                    CopyKind::Device { peer_alive, .. } | CopyKind::Ipc { peer_alive, .. } => peer_alive.as_ref(),
                    _ => None,
                };
                (bytes, crate::transport::liveness::after_one_sided(op, peer_alive))
            }
            Err(_why) => (0, Some(TaskEnd::Failed { effect_unknown: true })),
        }
    }

    /// Whether a task of `spans` is staged through one buffer, pipelined
    /// across tasks ([`staging::issue`]).
    pub(crate) fn stages_in_one(&self, spans: &[Span]) -> bool {
        matches!(self, CopyKind::Staged { chunk, .. } if spans.iter().map(|s| s.len).sum::<u64>() <= *chunk)
    }

    /// Whether a staged task of `spans` that fits one buffer can have one
    /// now (it is then reserved for it); true for every other task.
    pub(crate) fn staging_room(&self, spans: &[Span]) -> bool {
        match self {
            CopyKind::Staged { device, chunk, pool, .. } => {
                spans.iter().map(|s| s.len).sum::<u64>() > *chunk || staging::room(pool, *device, *chunk)
            }
            _ => true,
        }
    }

    /// Whether its tasks must stay off the posting thread (they wait for a
    /// device).
    pub(crate) fn waits_for_device(&self) -> bool {
        matches!(self, CopyKind::Device { .. } | CopyKind::Staged { .. } | CopyKind::Ipc { .. })
    }
}

/// How a planned program's tasks move: copies this process makes, or
/// frames the peer's link sends.
#[derive(Debug)]
pub(crate) enum Mover {
    /// This process copies them, on the local workers (or the posting
    /// thread).
    Copy(CopyKind),
    /// The peer's link sends them as frames and the peer's server copies.
    /// `staging`: the device whose memory this side stages through the
    /// pool's page-locked buffers first (feature `cuda`).
    Frames { staging: Option<u32> },
}

impl Mover {
    /// The copies this process makes (`None`: frames).
    pub(crate) fn copies(&self) -> Option<&CopyKind> {
        match self {
            Mover::Copy(kind) => Some(kind),
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
    /// with CUDA device memory among them, the self connection copies
    /// through the driver, straight into a same-host peer's mapping too;
    /// cma and files stage through the pool's page-locked buffers; tcp
    /// stages on a worker before its link sends. No CPU copy is ever
    /// handed a device address: any other pairing is refused.
    pub(crate) fn for_memory(
        self,
        loans: &[Arc<crate::registry::Registration>],
        config: &crate::config::EngineConfig,
        pool: &Arc<staging::StagingPool>,
    ) -> Result<Mover, NoDeviceCopy> {
        let host_pins = || -> Vec<Arc<crate::cuda::HostPin>> {
            if !config.cuda_pin_host {
                return Vec::new();
            }
            loans.iter().filter_map(|r| r.pin.clone()).collect()
        };
        // Driver copies already, whatever the local side is.
        if let Mover::Copy(CopyKind::Ipc { mappings, peer_alive, .. }) = self {
            return Ok(Mover::Copy(CopyKind::Ipc { mappings, peer_alive, pins: host_pins() }));
        }
        let Some(device) = loans.iter().find_map(|r| match r.kind {
            crate::memory::MemoryKind::Cuda { device } => Some(device),
            _ => None,
        }) else {
            return Ok(self);
        };
        let kind = match self {
            Mover::Frames { .. } => return Ok(Mover::Frames { staging: Some(device) }),
            Mover::Copy(kind) => kind,
        };
        match kind {
            CopyKind::Memory => Ok(Mover::Copy(CopyKind::Device { device, pins: host_pins(), peer_alive: None })),
            // Straight into the peer's mapping: the device reaches any host
            // memory of this process.
            CopyKind::Mapped { peer_alive, shared_pins } => {
                let mut pins = host_pins();
                if config.cuda_pin_host {
                    pins.extend(shared_pins);
                }
                Ok(Mover::Copy(CopyKind::Device { device, pins, peer_alive }))
            }
            // Files take host memory only: the bytes bounce through the
            // staging pool's page-locked buffers, as for cma.
            inner @ (CopyKind::Cma { .. } | CopyKind::File(..)) => Ok(Mover::Copy(CopyKind::Staged {
                device,
                chunk: config.staging_chunk_bytes,
                pool: pool.clone(),
                inner: Box::new(inner),
            })),
            // A device kind already.
            other => Err(NoDeviceCopy { device, kind: format!("{other:?}") }),
        }
    }

    /// Whether a caller's thread may run its tasks (helping): copies only,
    /// and not one that waits for a device, nor a direct file's, whose
    /// read-modify-write may wait for another task's write of the same
    /// file (a helping caller never waits on a copy).
    pub(crate) fn helpable(&self) -> bool {
        self.copies()
            .is_some_and(|k| !k.waits_for_device() && !matches!(k, CopyKind::File(f, _) if f.dio_align().is_some()))
    }

    /// Whether its tasks must stay off the posting thread.
    pub(crate) fn waits_for_device(&self) -> bool {
        self.staging().is_some() || self.copies().is_some_and(CopyKind::waits_for_device)
    }

    /// Where its tasks are cut, given `task_bytes` (`configured`). A
    /// worker waits for all of one task's operations on a direct file, so
    /// those tasks are cut larger: their operations are what is in flight
    /// at the device.
    pub(crate) fn task_bytes(&self, configured: u64) -> u64 {
        match self {
            Mover::Copy(CopyKind::File(entry, _)) if entry.dio_align().is_some() => {
                configured.max(crate::file::DIRECT_TASK_BYTES)
            }
            _ => configured,
        }
    }

    /// How device memory moves, for the route's reason.
    pub(crate) fn device_note(&self) -> Option<String> {
        match self {
            Mover::Copy(CopyKind::Device { device, peer_alive: None, .. }) => {
                Some(format!("CUDA device memory (device {device}) by driver copies"))
            }
            Mover::Copy(CopyKind::Device { device, .. }) => Some(format!(
                "CUDA device memory (device {device}) by driver copies straight into the peer's shared memory"
            )),
            Mover::Copy(CopyKind::Staged { device, chunk, .. }) => Some(format!(
                "CUDA device memory (device {device}) staged through page-locked buffers of {chunk} bytes"
            )),
            Mover::Frames { staging: Some(d) } => {
                Some(format!("CUDA device memory (device {d}) staged through the pinned pool"))
            }
            _ => None,
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
        let host = SameHost { cma: Ok(()), pid: 1, ipc: Ok(counters) };
        let socket = Socket::default();
        let states = PeerStates::open(&PeerOpening { descriptor: &desc, same_host: Ok(&host), local: &socket });
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
        let none = PeerStates::open(&PeerOpening { descriptor: &desc, same_host: Err(&why), local: &socket });
        assert!(!none.behind());
        assert_eq!(socket.asked.lock().len(), 2);
        let host_off = SameHost { cma: Ok(()), pid: 1, ipc: Err(IpcOff::Disabled) };
        let no_ipc = PeerStates::open(&PeerOpening { descriptor: &desc, same_host: Ok(&host_off), local: &socket });
        assert!(!no_ipc.behind(), "IPC off: nothing to import");
        // Closed with the peer: a mapping goes with its last user.
        let weak = Arc::downgrade(&mapping);
        drop((states, no_ipc));
        assert!(weak.upgrade().is_some(), "its last user (here the test, elsewhere a prepared transfer) keeps it");
        drop(mapping);
        assert!(weak.upgrade().is_none(), "then it is unmapped");
    }
}
