//! Fixed-width records shared with C. Every record begins with its size in
//! bytes and its version; the caller fills both, for input and for output
//! records alike. A record whose version or size this library does not
//! know is refused before anything else is read from it.

use std::ffi::{c_char, c_void};

/// Version of every record in this ABI minor.
pub const ORBITE_RECORD_VERSION: u32 = 1;

/// `OrbiteXferSpec::op`: read the peer's (remote) ranges into local ones.
pub const ORBITE_OP_READ: u32 = 1;
/// `OrbiteXferSpec::op`: write local ranges into the peer's ranges.
pub const ORBITE_OP_WRITE: u32 = 2;

/// `OrbiteXferSpec::intent`: ordinary work (zero, the default).
pub const ORBITE_INTENT_NORMAL: u32 = 0;
/// `OrbiteXferSpec::intent`: latency-critical decode work, admitted first.
pub const ORBITE_INTENT_DECODE_CRITICAL: u32 = 1;
/// `OrbiteXferSpec::intent`: prefetch, admitted last (never starved).
pub const ORBITE_INTENT_PREFETCH: u32 = 2;

/// `OrbiteXferSpec::route`: the engine's configured policy.
pub const ORBITE_ROUTE_DEFAULT: u32 = 0;
/// Prefer shm, then cma, then CUDA IPC, then tcp.
pub const ORBITE_ROUTE_AUTO: u32 = 1;
/// Force tcp.
pub const ORBITE_ROUTE_TCP: u32 = 2;
/// Force shm (fails at prepare if impossible).
pub const ORBITE_ROUTE_SHM: u32 = 3;
/// Force cma (fails at prepare if impossible).
pub const ORBITE_ROUTE_CMA: u32 = 4;
/// `OrbiteXferState::route`: the self connection.
pub const ORBITE_ROUTE_LOOPBACK: u32 = 5;
/// `OrbiteXferState::route`: a local file (io_uring).
pub const ORBITE_ROUTE_FILE: u32 = 6;
/// Force CUDA IPC to a same-host peer's device memory (fails at prepare if
/// impossible); also what `OrbiteXferState::route` reports for it (ABI 1.3).
pub const ORBITE_ROUTE_CUDA_IPC: u32 = 7;
/// A host's log sink (`orbite_log_install`): `(level, target, message,
/// ctx)`; both strings NUL-terminated, valid for the call only.
pub type OrbiteLogSink =
    Option<unsafe extern "C" fn(level: u32, target: *const c_char, message: *const c_char, ctx: *mut c_void)>;

/// `orbite_log_install`'s levels (ABI 1.6): no record.
pub const ORBITE_LOG_OFF: u32 = 0;
/// Errors.
pub const ORBITE_LOG_ERROR: u32 = 1;
/// Warnings (what `ORBITE_LOG` shows by default).
pub const ORBITE_LOG_WARN: u32 = 2;
/// What the engine does (NICs opened, peers lost).
pub const ORBITE_LOG_INFO: u32 = 3;
/// Details for debugging.
pub const ORBITE_LOG_DEBUG: u32 = 4;
/// Everything.
pub const ORBITE_LOG_TRACE: u32 = 5;

/// Force RDMA (fails at prepare if impossible); also what
/// `OrbiteXferState::route` reports for it (ABI 1.6).
pub const ORBITE_ROUTE_RDMA: u32 = 8;

/// `OrbiteXferSpec::flags`: deliver `notification` to the peer once every
/// byte landed (an empty payload is allowed).
pub const ORBITE_XFER_NOTIFY: u32 = 1;

/// `OrbiteEngineOptions::flags`: create the engine as a deployment does
/// (the NIXL backend): with no `listen` in the configuration it listens on
/// all interfaces (port 0) and advertises a routable address.
pub const ORBITE_ENGINE_DEPLOYMENT: u32 = 1;

/// `orbite_config_document` origin: nothing given, every default.
pub const ORBITE_CONFIG_DEFAULTS: u32 = 0;
/// `orbite_config_document` origin: `ORBITE_CONFIG` holds the JSON object.
pub const ORBITE_CONFIG_ENVIRONMENT: u32 = 1;
/// `orbite_config_document` origin: `ORBITE_CONFIG` names a file (`@path`).
pub const ORBITE_CONFIG_ENVIRONMENT_FILE: u32 = 2;

/// `orbite_engine_advertise` source: the engine does not listen.
pub const ORBITE_ADVERTISE_NONE: u32 = 0;
/// Configured (`advertise`).
pub const ORBITE_ADVERTISE_CONFIGURED: u32 = 1;
/// The listener's own (specific) address.
pub const ORBITE_ADVERTISE_BOUND: u32 = 2;
/// The source address of the route to the default gateway.
pub const ORBITE_ADVERTISE_DEFAULT_ROUTE: u32 = 3;
/// The first non-loopback address of an interface that is up.
pub const ORBITE_ADVERTISE_FIRST_UP: u32 = 4;
/// Nothing routable was found: 127.0.0.1, only this host can connect.
pub const ORBITE_ADVERTISE_LOOPBACK_FALLBACK: u32 = 5;

/// `OrbiteXferSpec::flags`: the remote descriptors name ranges by address
/// in the peer (`offset` is the address, `registration` is ignored); each
/// resolves at prepare to a registration of the peer's current description
/// that covers it (refreshed if the peer announced changes or lacks it, or
/// if it refuses a registration so resolved as no longer live).
pub const ORBITE_XFER_REMOTE_BY_ADDRESS: u32 = 2;

/// `OrbiteMemRegion::kind`: host DRAM.
pub const ORBITE_MEM_DRAM: u32 = 0;
/// `OrbiteMemRegion::kind`: GPU memory (not supported by this build).
pub const ORBITE_MEM_VRAM: u32 = 1;

/// Permission: only the local side of this engine's own transfers.
pub const ORBITE_PERM_LOCAL_ONLY: u32 = 0;
/// Permission: peers may read it.
pub const ORBITE_PERM_REMOTE_READ: u32 = 1;
/// Permission: peers may read and write it.
pub const ORBITE_PERM_REMOTE_READ_WRITE: u32 = 2;

/// `OrbiteXferState::state`: prepared, never posted.
pub const ORBITE_STATE_NOT_POSTED: u32 = 0;
/// An execution is active: not terminal, even when failure is known.
pub const ORBITE_STATE_IN_PROGRESS: u32 = 1;
/// The execution retired: nothing of it touches any buffer any more.
pub const ORBITE_STATE_RETIRED: u32 = 2;

/// `OrbiteXferState::phase`: waiting for admission, nothing started.
pub const ORBITE_PHASE_QUEUED: u32 = 1;
/// Some work started, more may start.
pub const ORBITE_PHASE_RUNNING: u32 = 2;
/// No more work starts; started work drains.
pub const ORBITE_PHASE_DRAINING: u32 = 3;

/// `OrbiteXferState::code`: every byte moved.
pub const ORBITE_OUTCOME_SUCCESS: u32 = 0;
/// Cancelled before all work started; started work drained.
pub const ORBITE_OUTCOME_CANCELLED: u32 = 1;
/// The deadline passed before all work started.
pub const ORBITE_OUTCOME_TIMED_OUT: u32 = 2;
/// A route completed fewer bytes than asked.
pub const ORBITE_OUTCOME_SHORT: u32 = 3;
/// A route failed.
pub const ORBITE_OUTCOME_FAILED: u32 = 4;
/// Every byte moved, the notification was not delivered.
pub const ORBITE_OUTCOME_NOTIFICATION_FAILED: u32 = 5;

/// `OrbiteXferState::remote_effect`: nothing was written.
pub const ORBITE_EFFECT_NONE: u32 = 0;
/// Exactly the reported bytes landed.
pub const ORBITE_EFFECT_KNOWN: u32 = 1;
/// More than reported may have been written (a WRITE that failed).
pub const ORBITE_EFFECT_UNKNOWN: u32 = 2;

// Feature bits are written in hex: cbindgen copies the literal, and a
// C `1 << 63` would shift an int.

/// Feature bit: TCP peers.
pub const ORBITE_FEATURE_TCP: u64 = 0x1;
/// Feature bit: same-host shared-memory route and shared allocations.
pub const ORBITE_FEATURE_SHM: u64 = 0x2;
/// Feature bit: same-host CMA route.
pub const ORBITE_FEATURE_CMA: u64 = 0x4;
/// Feature bit: notifications.
pub const ORBITE_FEATURE_NOTIFICATIONS: u64 = 0x8;
/// Feature bit: test-only entry points (`orbite_test_*`); never in a
/// shipped library.
pub const ORBITE_FEATURE_TEST_HOOKS: u64 = 0x8000000000000000;

/// An engine.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrbiteEngine {
    /// Opaque; zero is never valid.
    pub raw: u64,
}

/// A memory registration.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrbiteRegistration {
    /// Opaque; zero is never valid.
    pub raw: u64,
}

/// A shared allocation (`orbite_shm_alloc`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrbiteShm {
    /// Opaque; zero is never valid.
    pub raw: u64,
}

/// A peer: another engine, or this engine itself (the self connection).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrbitePeer {
    /// Opaque; zero is never valid.
    pub raw: u64,
}

/// A local file (`orbite_file_open`, `orbite_file_adopt`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrbiteFile {
    /// Opaque; zero is never valid.
    pub raw: u64,
}

/// `orbite_file_open` / `orbite_file_adopt` mode: reads only.
pub const ORBITE_FILE_READ_ONLY: u32 = 1;
/// Reads and writes.
pub const ORBITE_FILE_READ_WRITE: u32 = 2;
/// `orbite_file_open` flag: bypass the page cache (`O_DIRECT`, ABI 1.5;
/// refused before). Spans aligned to the file's direct-I/O alignment go
/// straight to the device, others through the engine's bounce buffers.
/// Also reported in `OrbiteFileInfo::flags`.
pub const ORBITE_FILE_DIRECT: u32 = 1;
/// `orbite_file_open` flag: every write durable, data and metadata, when
/// its task completes (`O_SYNC`, ABI 1.5; refused before).
pub const ORBITE_FILE_SYNC: u32 = 2;
/// `orbite_file_open` flag: every write's data durable when its task
/// completes (`O_DSYNC`, ABI 1.5). With `ORBITE_FILE_SYNC` it adds nothing.
pub const ORBITE_FILE_DSYNC: u32 = 4;
/// Feature bit: local files (`orbite_file_*`, `orbite_xfer_prepare_file`).
pub const ORBITE_FEATURE_FILES: u64 = 0x10;
/// Feature bit (ABI 1.3): `ORBITE_MEM_VRAM` registrations are taken here:
/// the library was built with feature `cuda` and the CUDA driver reports
/// at least one device. Transfers move them within one engine and to and
/// from peers' host memory (docs/gpu.md).
pub const ORBITE_FEATURE_VRAM: u64 = 0x20;

/// Output of `orbite_file_query`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct OrbiteFileInfo {
    /// `sizeof(OrbiteFileInfo)`.
    pub size: u32,
    /// `ORBITE_RECORD_VERSION`.
    pub version: u32,
    /// `ORBITE_FILE_READ_ONLY` or `ORBITE_FILE_READ_WRITE`.
    pub mode: u32,
    /// 1 once closed.
    pub closed: u32,
    /// Current size in bytes.
    pub len: u64,
    /// Device of the file.
    pub dev: u64,
    /// Inode of the file.
    pub ino: u64,
    /// (ABI 1.5) `st_mode` of the file: type and permission bits.
    pub st_mode: u32,
    /// (ABI 1.5) The flags the kernel applies to its I/O, whether opened
    /// here or adopted: `ORBITE_FILE_DIRECT`, `_SYNC`, `_DSYNC`.
    pub flags: u32,
    /// (ABI 1.5) Last modification, seconds since the epoch.
    pub mtime_sec: i64,
    /// (ABI 1.5) And its nanoseconds.
    pub mtime_nsec: u32,
    /// (ABI 1.5) With `ORBITE_FILE_DIRECT`: the memory alignment direct
    /// I/O needs (spans not aligned bounce); else 0.
    pub dio_mem_align: u32,
    /// (ABI 1.5) With `ORBITE_FILE_DIRECT`: the file offset and length
    /// alignment; else 0.
    pub dio_offset_align: u32,
    /// Zero.
    pub reserved: u32,
}

/// A prepared transfer.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrbiteXfer {
    /// Opaque; zero is never valid.
    pub raw: u64,
}

/// What this library is (output of `orbite_abi_info`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct OrbiteAbiInfo {
    /// Set by the caller: `sizeof(OrbiteAbiInfo)`.
    pub size: u32,
    /// Set by the caller: `ORBITE_RECORD_VERSION`.
    pub version: u32,
    /// ABI major: a different one is a different library (and SONAME).
    pub abi_major: u32,
    /// ABI minor: additions only.
    pub abi_minor: u32,
    /// `ORBITE_FEATURE_*` bits this build supports.
    pub features: u64,
    /// Size this library expects of `OrbiteEngineOptions`.
    pub engine_options_size: u32,
    /// Size of `OrbiteMemRegion`.
    pub mem_region_size: u32,
    /// Size of `OrbiteDesc` (array element; no header).
    pub desc_size: u32,
    /// Size of `OrbiteXferSpec`.
    pub xfer_spec_size: u32,
    /// Size of `OrbiteXferState`.
    pub xfer_state_size: u32,
    /// Size of `OrbiteRemoteRange`.
    pub remote_range_size: u32,
    /// Size of `OrbiteCloseReport`.
    pub close_report_size: u32,
    /// Size of `OrbiteStats`.
    pub stats_size: u32,
    /// Size of `OrbiteDrainResult`.
    pub drain_result_size: u32,
    /// Size of `OrbiteNotifView`.
    pub notif_view_size: u32,
}

/// Input of `orbite_engine_create`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct OrbiteEngineOptions {
    /// `sizeof(OrbiteEngineOptions)`.
    pub size: u32,
    /// `ORBITE_RECORD_VERSION`.
    pub version: u32,
    /// `ORBITE_ABI_MAJOR` of the header the caller was compiled with.
    pub abi_major: u32,
    /// `ORBITE_ENGINE_*` bits; zero for none.
    pub flags: u32,
    /// `ORBITE_FEATURE_*` bits the caller needs; any missing fails the call.
    pub required_features: u64,
    /// The engine's JSON configuration (UTF-8, not NUL-terminated; may be
    /// null with length 0 for every default). Unknown fields are refused.
    pub config_json: *const u8,
    /// Its length in bytes.
    pub config_json_len: u64,
}

/// Input of `orbite_mem_register`: a range of the caller's memory.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct OrbiteMemRegion {
    /// `sizeof(OrbiteMemRegion)`.
    pub size: u32,
    /// `ORBITE_RECORD_VERSION`.
    pub version: u32,
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// `ORBITE_MEM_*`.
    pub kind: u32,
    /// Device id: 0 for DRAM.
    pub device: u32,
    /// `ORBITE_PERM_*`.
    pub permission: u32,
    /// Zero.
    pub reserved: u32,
    /// Called exactly once, with no lock of this library held, when the
    /// engine no longer touches the range: after deregistration and after
    /// every transfer that borrowed it retired. May be null.
    pub release: Option<unsafe extern "C" fn(context: *mut c_void)>,
    /// Passed to `release`.
    pub release_context: *mut c_void,
}

/// One descriptor: `len` bytes at `offset` in a registration. In a local
/// list `registration` is an `OrbiteRegistration`'s raw value; in a remote
/// list it is `OrbiteRemoteRange::remote_registration`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrbiteDesc {
    /// Which registration.
    pub registration: u64,
    /// Offset from its start.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Input of `orbite_xfer_prepare`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct OrbiteXferSpec {
    /// `sizeof(OrbiteXferSpec)`.
    pub size: u32,
    /// `ORBITE_RECORD_VERSION`.
    pub version: u32,
    /// `ORBITE_OP_READ` or `ORBITE_OP_WRITE`.
    pub op: u32,
    /// `ORBITE_INTENT_*`.
    pub intent: u32,
    /// `ORBITE_ROUTE_DEFAULT`, `_AUTO`, `_TCP`, `_SHM`, `_CMA`,
    /// `_CUDA_IPC` or `_RDMA`.
    pub route: u32,
    /// `ORBITE_XFER_*` bits.
    pub flags: u32,
    /// Queued work not started this many microseconds after a post ends
    /// `TIMED_OUT`; 0 for none.
    pub deadline_us: u64,
    /// The peer whose ranges the remote list names (a self peer for local
    /// transfers).
    pub peer: OrbitePeer,
    /// Local descriptors.
    pub local: *const OrbiteDesc,
    /// How many.
    pub local_count: u64,
    /// Remote descriptors (same total length as the local list).
    pub remote: *const OrbiteDesc,
    /// How many.
    pub remote_count: u64,
    /// Notification payload (binary), copied at prepare.
    pub notification: *const u8,
    /// Its length.
    pub notification_len: u64,
}

/// Output of `orbite_xfer_query`. The logical outcome (`code`, prefix,
/// effect) is valid only when `state` is `ORBITE_STATE_RETIRED`; `drained`
/// is the physical retirement receipt and is 1 only then.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct OrbiteXferState {
    /// `sizeof(OrbiteXferState)`.
    pub size: u32,
    /// `ORBITE_RECORD_VERSION`.
    pub version: u32,
    /// `ORBITE_STATE_*`.
    pub state: u32,
    /// `ORBITE_PHASE_*` while in progress, else 0.
    pub phase: u32,
    /// `ORBITE_OUTCOME_*` once retired.
    pub code: u32,
    /// `ORBITE_EFFECT_*` once retired.
    pub remote_effect: u32,
    /// 1 once every task of the execution ended and nothing of it can
    /// touch a buffer; 0 before.
    pub drained: u32,
    /// `ORBITE_ROUTE_*` the transfer takes.
    pub route: u32,
    /// Bytes known landed so far (in progress) or in all (retired).
    pub transferred_bytes: u64,
    /// Bytes landed contiguously from the start (retired).
    pub transferred_prefix: u64,
    /// Bytes the transfer covers.
    pub total_bytes: u64,
    /// Sequence number of the execution (1 for the first post).
    pub execution: u64,
    /// Tasks started and ended (retired).
    pub tasks_started: u32,
    /// Tasks never started and never to start (retired).
    pub tasks_never_started: u32,
}

/// Output of `orbite_peer_import_range`: a peer's registered range, checked
/// against what the peer described itself with.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct OrbiteRemoteRange {
    /// `sizeof(OrbiteRemoteRange)`.
    pub size: u32,
    /// `ORBITE_RECORD_VERSION`.
    pub version: u32,
    /// Put this in `OrbiteDesc::registration` of a remote list.
    pub remote_registration: u64,
    /// Address of its first byte in the peer.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// `ORBITE_PERM_*`.
    pub permission: u32,
    /// 1 if it is a shared allocation on this host (the shm route).
    pub shared: u32,
}

/// Output of `orbite_engine_close`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct OrbiteCloseReport {
    /// `sizeof(OrbiteCloseReport)`.
    pub size: u32,
    /// `ORBITE_RECORD_VERSION`.
    pub version: u32,
    /// 1 if every execution retired within the bound.
    pub drained: u32,
    /// Zero.
    pub reserved: u32,
    /// Executions still not retired; their owners are kept.
    pub unquiesced: u64,
}

/// Output of `orbite_engine_stats`: every charge of the engine.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrbiteStats {
    /// `sizeof(OrbiteStats)`.
    pub size: u32,
    /// `ORBITE_RECORD_VERSION`.
    pub version: u32,
    /// Live registrations.
    pub registrations: u64,
    /// Bytes under them.
    pub registered_bytes: u64,
    /// Deregistered ones still borrowed.
    pub fenced_registrations: u64,
    /// Engine-allocated blocks (shared allocations included).
    pub host_allocations: u64,
    /// Their bytes.
    pub host_memory_bytes: u64,
    /// Prepared transfers alive.
    pub prepared_transfers: u64,
    /// Executions not yet retired.
    pub executions: u64,
    /// Executions waiting for admission.
    pub queued_executions: u64,
    /// Bytes admitted to routes.
    pub bytes_in_flight: u64,
    /// Tasks admitted to routes.
    pub tasks_in_flight: u64,
    /// Owners kept by a close that could not drain.
    pub unquiesced_owners: u64,
    /// Bytes of received notifications not yet drained.
    pub notification_bytes: u64,
    /// Handles of this library on the engine's objects.
    pub binding_handles: u64,
    /// Ranges held by range pins (KV sessions pin their KV).
    pub pinned_ranges: u64,
    /// Peer connections that failed authentication, either way (a count:
    /// the one field that only grows).
    pub auth_failures: u64,
    /// Engine-allocated CUDA device memory blocks (ABI 1.3).
    pub device_allocations: u64,
    /// Their bytes.
    pub device_memory_bytes: u64,
    /// Pinned host buffers of the staging pools.
    pub staging_buffers: u64,
    /// Their bytes.
    pub staging_bytes: u64,
    /// Peers' CUDA IPC allocations imported.
    pub cuda_imports: u64,
    /// Peer connections the listener holds (ABI 1.4).
    pub connections: u64,
    /// Connections closed at accept by a cap (a count: it only grows).
    pub connections_refused: u64,
    /// Bytes of frame and reply buffers held by the listener's connections.
    pub frame_buffer_bytes: u64,
    /// Borrows peers hold on this engine's registrations.
    pub borrows: u64,
    /// Bytes of their bookkeeping.
    pub borrow_bytes: u64,
    /// Peers subscribed to this engine's registration changes.
    pub watchers: u64,
}

/// Output of `orbite_notifs_drain`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct OrbiteDrainResult {
    /// `sizeof(OrbiteDrainResult)`.
    pub size: u32,
    /// `ORBITE_RECORD_VERSION`.
    pub version: u32,
    /// Notifications written.
    pub count: u64,
    /// Bytes written.
    pub written: u64,
    /// Bytes the next queued notification needs (0: none left).
    pub next_needed: u64,
}

/// One notification inside a drained buffer (`orbite_notif_next`). The
/// pointers point into that buffer.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct OrbiteNotifView {
    /// `sizeof(OrbiteNotifView)`.
    pub size: u32,
    /// `ORBITE_RECORD_VERSION`.
    pub version: u32,
    /// Sender's epoch.
    pub sender_epoch: u64,
    /// Sender's endpoint (not NUL-terminated; empty for a sender with no
    /// listener).
    pub sender: *const u8,
    /// Its length.
    pub sender_len: u64,
    /// Payload bytes.
    pub payload: *const u8,
    /// Its length.
    pub payload_len: u64,
}

/// Records the caller hands in or out: they start with size and version.
pub(crate) trait Record: Sized {
    const NAME: &'static str;
}

macro_rules! records {
    ($($t:ident),*) => { $(impl Record for $t { const NAME: &'static str = stringify!($t); })* };
}
records!(
    OrbiteAbiInfo,
    OrbiteEngineOptions,
    OrbiteMemRegion,
    OrbiteXferSpec,
    OrbiteXferState,
    OrbiteRemoteRange,
    OrbiteCloseReport,
    OrbiteStats,
    OrbiteDrainResult,
    OrbiteNotifView,
    OrbiteFileInfo
);
