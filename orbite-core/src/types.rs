//! The shared vocabulary of the core: ids and descriptors, directions, permissions,
//! routes and their policy, budgeted resources and what a route reports
//! about a task.
//!
//! This module imports nothing of the crate; every layer may use it.

/// Whose memory a transfer's remote descriptors name. One enum, held as
/// each layer needs it: by reference in a caller's spec
/// ([`Target`](crate::Target)), kept alive by the engine while a prepared
/// transfer lives, and seen by routes at prepare with the peer's view.
#[derive(Debug, Clone, Copy)]
pub enum TargetOf<P, F> {
    /// This engine itself (the self connection NIXL uses for local
    /// transfers): remote descriptors name this engine's registrations.
    Loopback,
    /// A peer engine: remote descriptors name registrations of its
    /// segment (ids as in its descriptor).
    Peer(P),
    /// A local file: remote descriptors are file extents (`offset`, `len`;
    /// their `registration` is ignored). READ moves file bytes into the
    /// local memory, WRITE the reverse.
    File(F),
}

impl<P, F> TargetOf<P, F> {
    /// The peer, if the target is one.
    pub fn peer(&self) -> Option<&P> {
        match self {
            TargetOf::Peer(p) => Some(p),
            _ => None,
        }
    }
}

/// Generation-checked id of a registration.
///
/// An id stays unique for the engine's life in practice: a slot's
/// generation advances each time its registration is removed, so an old id
/// never resolves to a newer registration in the same slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegistrationId {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

impl RegistrationId {
    /// Packs the id into 64 bits (for foreign handles and wire formats).
    pub fn to_raw(self) -> u64 {
        ((self.generation as u64) << 32) | self.index as u64
    }
    /// Unpacks an id from [`RegistrationId::to_raw`]; any value is accepted
    /// and checked on use.
    pub fn from_raw(raw: u64) -> Self {
        RegistrationId { index: raw as u32, generation: (raw >> 32) as u32 }
    }
}

impl std::fmt::Display for RegistrationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "reg#{}.{}", self.index, self.generation)
    }
}

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

/// What a registration may be used for by the other side of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Permission {
    /// Only as the local side of this engine's own transfers.
    LocalOnly,
    /// Also readable as the target of a READ.
    RemoteRead,
    /// Also readable and writable as a target (READ and WRITE).
    RemoteReadWrite,
}

impl Permission {
    /// May a peer read this range?
    pub fn remote_read(self) -> bool {
        matches!(self, Permission::RemoteRead | Permission::RemoteReadWrite)
    }
    /// May a peer write this range?
    pub fn remote_write(self) -> bool {
        matches!(self, Permission::RemoteReadWrite)
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
    /// Device copies into a same-host peer's CUDA device memory, opened
    /// here through CUDA IPC (feature `cuda`).
    #[serde(rename = "cuda-ipc")]
    CudaIpc,
    /// One-sided RDMA READ and WRITE over the NICs' reliable-connected
    /// queue pairs (feature `rdma`).
    Rdma,
}

/// Which route a transfer to a peer may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoutePolicy {
    /// shm if every target range is a shared allocation on this boot, else
    /// cma if the peer is on this boot and the kernel permits it, else
    /// CUDA IPC if every target range is the peer's device memory opened
    /// here, else rdma if both engines have NICs connected to each other
    /// and every range is registered on them, else tcp.
    #[default]
    Auto,
    /// Only tcp.
    Tcp,
    /// Only shm; a transfer that cannot use it fails at prepare.
    Shm,
    /// Only cma; a transfer that cannot use it fails at prepare.
    Cma,
    /// Only CUDA IPC; a transfer that cannot use it fails at prepare.
    #[serde(rename = "cuda-ipc")]
    CudaIpc,
    /// Only rdma; a transfer that cannot use it fails at prepare.
    Rdma,
}

impl Route {
    /// Every route.
    pub const fn all() -> [Route; 7] {
        [Route::Loopback, Route::Tcp, Route::Shm, Route::Cma, Route::File, Route::CudaIpc, Route::Rdma]
    }

    /// Its name, as policies, reasons and configuration spell it.
    pub fn name(self) -> &'static str {
        match self {
            Route::Loopback => "loopback",
            Route::Tcp => "tcp",
            Route::Shm => "shm",
            Route::Cma => "cma",
            Route::File => "file",
            Route::CudaIpc => "cuda-ipc",
            Route::Rdma => "rdma",
        }
    }
}

impl RoutePolicy {
    /// The one route it allows (`None`: `auto`).
    pub fn forced(self) -> Option<Route> {
        match self {
            RoutePolicy::Auto => None,
            RoutePolicy::Tcp => Some(Route::Tcp),
            RoutePolicy::Shm => Some(Route::Shm),
            RoutePolicy::Cma => Some(Route::Cma),
            RoutePolicy::CudaIpc => Some(Route::CudaIpc),
            RoutePolicy::Rdma => Some(Route::Rdma),
        }
    }

    /// Its name, as configuration spells it.
    pub fn name(self) -> &'static str {
        self.forced().map_or("auto", Route::name)
    }
}

/// The route a transfer takes, and why.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RouteChoice {
    /// The route.
    pub route: Route,
    /// Why it was chosen (the policy and what ruled the others out).
    pub reason: String,
}

impl Intent {
    /// All classes, highest priority first.
    pub const ALL: [Intent; 3] = [Intent::DecodeCritical, Intent::Normal, Intent::Prefetch];
}

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
    /// Queued notifications (`notification_queue_len`).
    NotificationQueue,
    /// Handles held by a binding such as the C ABI (`max_binding_handles`).
    BindingHandles,
    /// Page-locked staging buffers for CUDA device memory
    /// (`max_staging_bytes`).
    StagingBytes,
    /// Frame and reply buffers of the listener's connections
    /// (`max_frame_buffer_bytes`).
    FrameBufferBytes,
    /// Borrows peers hold on this engine's registrations (`max_borrows`).
    Borrows,
    /// Bytes of the bookkeeping of those borrows (`max_borrow_bytes`).
    BorrowBytes,
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
            Resource::NotificationQueue => "queued notifications",
            Resource::BindingHandles => "binding handles",
            Resource::StagingBytes => "staging bytes",
            Resource::FrameBufferBytes => "frame buffer bytes",
            Resource::Borrows => "borrows",
            Resource::BorrowBytes => "borrow bytes",
        };
        f.write_str(name)
    }
}

/// How a route task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskEnd {
    /// All planned bytes landed.
    Complete,
    /// Fewer bytes than planned landed, and nothing beyond them.
    Short,
    /// The task failed after `bytes` landed; `effect_unknown` if bytes
    /// beyond them may have been written.
    Failed {
        /// Whether more than `bytes` may have been written.
        effect_unknown: bool,
    },
}

/// A route's report of one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TaskReport {
    /// Bytes the task was asked to move.
    pub planned: u64,
    /// Bytes known landed (a prefix of the task).
    pub done: u64,
    /// How it ended.
    pub end: TaskEnd,
}

/// A bounded resource was exhausted: nothing was allocated or admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[error("resource exhausted: {resource} (limit {limit}, requested {requested})")]
pub struct Exhausted {
    /// Which budget.
    pub resource: Resource,
    /// Its configured limit.
    pub limit: u64,
    /// What the refused request would have brought the charge to.
    pub requested: u64,
}

#[cfg(test)]
mod tests {
    use super::{Route, RoutePolicy};

    /// The names reasons and the command line print are the names a
    /// configuration takes, and each forced policy allows its own route.
    #[test]
    fn route_and_policy_names_are_their_configuration_names() {
        for r in Route::all() {
            assert_eq!(serde_json::to_string(&r).unwrap(), format!("\"{}\"", r.name()));
        }
        let policies = [
            RoutePolicy::Auto,
            RoutePolicy::Tcp,
            RoutePolicy::Shm,
            RoutePolicy::Cma,
            RoutePolicy::CudaIpc,
            RoutePolicy::Rdma,
        ];
        for p in policies {
            assert_eq!(serde_json::to_string(&p).unwrap(), format!("\"{}\"", p.name()));
            if let Some(r) = p.forced() {
                assert_eq!(r.name(), p.name());
            }
        }
        assert_eq!(RoutePolicy::Auto.forced(), None);
    }
}
