//! Engine configuration: every limit of the engine, with its default.
//!
//! Configuration arrives as JSON (the C ABI and the NIXL plugin pass one
//! explicit document). Unknown fields are rejected, never ignored, so a typo
//! cannot silently fall back to a default. Every field is optional; an absent
//! field takes the default documented on it (also listed in
//! `docs/configuration.md`).

use serde::{Deserialize, Serialize};
use std::time::Duration;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;

/// Peer authentication settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// A file holding the shared secret (at least 16 bytes; trailing
    /// white space is ignored). Keep it readable by the engine's user only.
    pub secret_file: String,
}

/// Limits and switches of one [`crate::TransferEngine`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Live registrations at once, aliases included. Default 65 536.
    pub max_registrations: u64,
    /// Bytes under live registrations (each alias counts). Default 1 TiB.
    pub max_registered_bytes: u64,
    /// Bytes of engine-allocated host memory alive at once. Default 64 GiB.
    pub max_host_memory_bytes: u64,
    /// Prepared transfers alive at once. Default 65 536.
    pub max_prepared_transfers: u64,
    /// Posted executions not yet retired. Default 4 096.
    pub max_executions: u64,
    /// Descriptors in one list of one transfer. Default 1 048 576.
    pub max_descriptors_per_transfer: u64,
    /// Bytes moved by one transfer. Default 1 TiB.
    pub max_transfer_bytes: u64,
    /// Bytes admitted to routes and not yet retired. Default 256 MiB.
    pub max_bytes_in_flight: u64,
    /// Route tasks admitted and not yet retired. Default 64.
    pub max_tasks_in_flight: u64,
    /// Largest route task in bytes; larger descriptors are split. Must not
    /// exceed `max_bytes_in_flight`. Default 1 MiB (one peer request).
    pub task_bytes: u64,
    /// Executions that may wait for admission; a post beyond it fails with
    /// `ResourceExhausted(AdmissionQueue)`. Default 1 024.
    pub admission_queue_len: u64,
    /// After this many admissions that bypass a waiting lower-intent class,
    /// that class is served next (anti-starvation). Default 16.
    pub anti_starvation_after: u32,
    /// Bytes of notification payloads queued at once (used by peer
    /// notifications). Default 16 MiB.
    pub notification_queue_bytes: u64,
    /// Notifications queued at once (each also charged to
    /// `notification_queue_bytes` with its sender endpoint and a fixed
    /// record size). Default 65 536.
    pub notification_queue_len: u64,
    /// Borrows one peer connection may hold at this target (a one-sided
    /// route's initiator holds one per prepared transfer). Default 4 096.
    pub max_borrows_per_connection: u64,
    /// Registrations one borrow may keep alive (each counted once).
    /// Default 1 024.
    pub max_registrations_per_borrow: u64,
    /// Borrows all peers together may hold on this engine's registrations
    /// (each counted in `borrows`); one more is refused
    /// `ResourceExhausted`. Default 65 536.
    pub max_borrows: u64,
    /// Bytes of the bookkeeping of those borrows (a pointer per
    /// registration a borrow keeps, plus 64 bytes a borrow; counted in
    /// `borrow_bytes`); a borrow beyond it is refused `ResourceExhausted`.
    /// Default 64 MiB.
    pub max_borrow_bytes: u64,
    /// Peers subscribed to this engine's registration changes, at once (a
    /// watch connection per opened peer; counted in `watchers`). One more
    /// is refused `ResourceExhausted`, and that peer asks for changes
    /// instead of being told. Default 1 024.
    pub max_watchers: u64,
    /// Watchers from one peer address (the local socket counts as one).
    /// Default 64.
    pub max_watchers_per_address: u64,
    /// Bytes of frame and reply buffers all of the listener's connections
    /// together may hold beyond the 4 KiB each keeps (a frame body or a
    /// reply such as a Describe of many registrations; counted in
    /// `frame_buffer_bytes`). A frame beyond it is read, dropped and
    /// refused `ResourceExhausted`; the process does not grow. Buffers go
    /// back when their exchange is over. Default 256 MiB.
    pub max_frame_buffer_bytes: u64,
    /// Peer connections this engine's listener holds at once; one more is
    /// closed at accept. Default 4 096.
    pub max_connections: u64,
    /// Peer connections from one address at once. Default 512.
    pub max_connections_per_address: u64,
    /// With `auth`: connections that have not finished their handshake, at
    /// once (they count in `max_connections` too). A new connection beyond
    /// it closes the oldest of them (counted in `connections_refused`), so
    /// connections that never authenticate cannot take the slots
    /// authenticated peers hold, and a genuine handshake (a round trip)
    /// gets through a flood of them. Default 256.
    pub max_unauthenticated_connections: u64,
    /// A request frame that started arriving must be in, and its reply
    /// taken, within this plus its bytes at `peer_min_bytes_per_s`, in
    /// milliseconds; with `auth`, a new connection's whole handshake, from
    /// accept to its end, within this (a late one counts in
    /// `auth_failures`). Else the connection is closed and what it held is
    /// given back. Default 10 000.
    pub server_frame_timeout_ms: u64,
    /// A peer connection with no exchange for this long is closed, in
    /// milliseconds; 0: never. Initiators keep their idle connections
    /// alive (`peer_keepalive_ms`), and a subscribed watch connection is
    /// never idle, so this closes connections that hold a slot and say
    /// nothing; keep it above the peers' `peer_keepalive_ms`. Default
    /// 60 000.
    pub server_idle_timeout_ms: u64,
    /// An idle connection to a peer sends it a keepalive (a header-only
    /// frame, no reply) after this many milliseconds without traffic, so
    /// that the peer's `server_idle_timeout_ms` does not close it; 0:
    /// never. Default 20 000.
    pub peer_keepalive_ms: u64,
    /// Run the optional progress worker, which drives admission and
    /// deadlines for callers that do not poll. Default false.
    pub progress_worker: bool,
    /// Longest sleep of the progress worker while work is queued, in
    /// microseconds (it sleeps without bound when nothing is queued).
    /// At least 50. Default 1 000.
    pub progress_interval_us: u64,
    /// Worker threads that copy for the self connection and the one-sided
    /// same-host routes (shm, cma); large transfers spread over them. 1 to
    /// 64, or 0 for one per available core (at most 8). Default 0.
    pub local_route_workers: u32,
    /// After its last event, a route worker (and a caller in `wait`) polls
    /// for up to this many microseconds before it sleeps, which saves a
    /// thread wake-up per small transfer. At most 1 000; 0 disables.
    /// An idle engine never polls longer than this. Default 50.
    pub spin_us: u64,
    /// A transfer of a single route task of at most this many bytes, on
    /// the self connection or a same-host route (shm, cma), is copied by
    /// the posting thread inside `post` when nothing is queued ahead of it:
    /// no hand-off to a worker. Its execution may then already be retired
    /// when `post` returns. At most 1 MiB; 0 disables. Default 16 384.
    pub inline_max_bytes: u64,
    /// Bytes of each page-locked host buffer CUDA device memory is bounced
    /// through on cma (feature `cuda`), taken from the staging pool: a
    /// task that fits one takes one (a worker keeps two such tasks in
    /// flight, so the device copy of one overlaps the CPU copy of the
    /// other); a larger task takes two and goes through them chunk by
    /// chunk. 4 KiB to 64 MiB. Default 1 MiB (the default `task_bytes`).
    pub staging_chunk_bytes: u64,
    /// Page-locked host memory all staging of CUDA device memory may hold
    /// at once (feature `cuda`): the staging pool cma and tcp tasks and
    /// peers' requests stage through (free buffers kept for reuse until
    /// close). A worker whose next cma task finds no room completes its
    /// oldest staged task first; a staged task that still finds none
    /// fails; a peer's request beyond it is answered `ResourceExhausted`.
    /// Default 1 GiB.
    pub max_staging_bytes: u64,
    /// CUDA IPC with same-host peers (feature `cuda`): this engine hands
    /// its device registrations' IPC handles to peers proven to run on
    /// this host as its own user, and opens theirs, so device memory moves
    /// device to device. `false`: neither, and same-host device memory is
    /// staged over tcp. Default true.
    pub cuda_ipc: bool,
    /// Host memory a device copy names (feature `cuda`): this engine's
    /// host registrations, and a same-host peer's shared allocations
    /// mapped here, are page-locked for the driver (`cuMemHostRegister`)
    /// on the first device copy that names them and unpinned when they go,
    /// so the copy engine reaches them without the driver's bounce
    /// through its own buffers. Memory the driver refuses (already pinned
    /// by its owner) stays as it is. `false`: never. Default true.
    pub cuda_pin_host: bool,
    /// Handles a binding (the C ABI) may hold on this engine's objects at
    /// once: registrations, transfers, peers, shared allocations. Default
    /// 65 536.
    pub max_binding_handles: u64,
    /// How long `close` waits for admitted work to drain, in milliseconds.
    /// Default 5 000.
    pub close_drain_timeout_ms: u64,
    /// TCP address to listen on for peers (`host:port`, port 0 picks one),
    /// or null for no listener (local transfers only). Default null
    /// (deployments such as the NIXL backend default to all interfaces,
    /// [`crate::endpoint::ALL_INTERFACES`]).
    pub listen: Option<String>,
    /// The host (or `host:port`) other hosts should dial to reach this
    /// engine, when it differs from what the engine finds itself (behind
    /// NAT, with several NICs). Without a port the listener's port is used.
    /// Default null: the bound address, or for a listener on all interfaces
    /// the source address of the default route (see
    /// [`crate::endpoint::advertise`]).
    pub advertise: Option<String>,
    /// Mutual authentication of every peer connection, both directions:
    /// `{"secret_file": PATH}`, a file of at least 16 bytes both engines
    /// share. Default null: no authentication (anyone who can reach the
    /// listener can read and write registered memory; the engine says so
    /// at start).
    pub auth: Option<AuthConfig>,
    /// Connections per opened peer segment (1 to 16), besides its watch
    /// connection. Default 4 (across hosts more parallel streams move
    /// more: measured with test/nixl/multihost.py --bench).
    pub connections_per_peer: u32,
    /// Receive window of each tcp data connection, in bytes (its
    /// `SO_RCVBUF`; the send buffer is twice it). 0 (the default): one
    /// route task, `task_bytes`, at least 1 MiB and at most 64 MiB. Raise
    /// it where one connection must cover a long round trip (its
    /// throughput is at most a window per round trip).
    pub tcp_window_bytes: u64,
    /// A peer that shows no sign of life for this many milliseconds while a
    /// request to it is outstanding (nothing received, nothing accepted
    /// for sending) is lost: its executions fail after local retirement.
    /// Also bounds control exchanges (metadata refresh). Default 10 000.
    pub peer_timeout_ms: u64,
    /// Slowest peer accepted, in bytes per second: a request moving `n`
    /// bytes must finish within `peer_timeout_ms` plus `n` at this rate,
    /// else the peer counts as not answering (a trickling peer is lost).
    /// 0 disables the rate bound. Default 1 048 576.
    pub peer_min_bytes_per_s: u64,
    /// Largest frame body accepted from a peer (descriptors, segment
    /// descriptors, notifications), in bytes. Default 1 MiB.
    pub max_frame_body: u64,
    /// Largest notification payload, in bytes. Default 64 KiB.
    pub max_notification_bytes: u64,
    /// Route policy for peer transfers: "auto" (same-host routes, then
    /// rdma, then tcp) or one route's name. Transfers may override it.
    /// Default "auto".
    pub route: crate::types::RoutePolicy,
    /// RDMA NICs the engine uses (feature `rdma`): null, every NIC with
    /// an active port; a list of NIC names (`["mlx5_0", "mlx5_1"]`), those;
    /// `[]`, none (RDMA off). Default null.
    pub rdma_devices: Option<Vec<String>>,
    /// Queue pairs to each opened peer per NIC (1 to 16). Default 2.
    pub rdma_qps_per_nic: u32,
    /// The GID index each NIC's port sends from. Default null: on RoCE a
    /// RoCE v2 GID over IPv4 first (then any routable one), on
    /// InfiniBand the first.
    pub rdma_gid_index: Option<u32>,
    /// Where to serve Prometheus/OpenMetrics text at `/metrics`
    /// (`host:port`; port 0 picks one). Default null: no endpoint.
    pub metrics_listen: Option<String>,
    /// The metadata store peers are found through (feature `etcd`):
    /// `"etcd://host:port[,host:port]"`. Default null: none.
    pub metadata: Option<String>,
    /// The name this engine publishes in `metadata`, with its endpoint,
    /// epoch and routes (1 to 128 bytes of letters, digits and `. _ - :
    /// /`; needs `metadata` and `listen`). Default null: not published.
    pub name: Option<String>,
    /// The TTL of the published name's lease: a dead engine's name is gone
    /// within it (1 s to 1 h, whole seconds). Default 10000.
    pub metadata_ttl_ms: u64,
    /// The bound on each call to the metadata store (connecting, publishing,
    /// resolving; 100 ms to 60 s). Default 5000.
    pub metadata_timeout_ms: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_registrations: 65_536,
            max_registered_bytes: 1024 * GIB,
            max_host_memory_bytes: 64 * GIB,
            max_prepared_transfers: 65_536,
            max_executions: 4_096,
            max_descriptors_per_transfer: 1 << 20,
            max_transfer_bytes: 1024 * GIB,
            max_bytes_in_flight: 256 * MIB,
            max_tasks_in_flight: 64,
            task_bytes: MIB,
            admission_queue_len: 1_024,
            anti_starvation_after: 16,
            notification_queue_bytes: 16 * MIB,
            notification_queue_len: 65_536,
            max_borrows_per_connection: 4_096,
            max_registrations_per_borrow: 1_024,
            max_borrows: 65_536,
            max_borrow_bytes: 64 * MIB,
            max_watchers: 1_024,
            max_watchers_per_address: 64,
            max_frame_buffer_bytes: 256 * MIB,
            max_connections: 4_096,
            max_connections_per_address: 512,
            max_unauthenticated_connections: 256,
            server_frame_timeout_ms: 10_000,
            server_idle_timeout_ms: 60_000,
            peer_keepalive_ms: 20_000,
            progress_worker: false,
            progress_interval_us: 1_000,
            local_route_workers: 0,
            spin_us: 50,
            inline_max_bytes: 16 * KIB,
            staging_chunk_bytes: MIB,
            max_staging_bytes: GIB,
            cuda_ipc: true,
            cuda_pin_host: true,
            max_binding_handles: 65_536,
            close_drain_timeout_ms: 5_000,
            listen: None,
            advertise: None,
            auth: None,
            connections_per_peer: 4,
            tcp_window_bytes: 0,
            peer_timeout_ms: 10_000,
            peer_min_bytes_per_s: MIB,
            max_frame_body: MIB,
            max_notification_bytes: 64 * KIB,
            route: crate::types::RoutePolicy::Auto,
            rdma_devices: None,
            rdma_qps_per_nic: 2,
            rdma_gid_index: None,
            metrics_listen: None,
            metadata: None,
            name: None,
            metadata_ttl_ms: 10_000,
            metadata_timeout_ms: 5_000,
        }
    }
}

impl EngineConfig {
    /// Parses and validates a JSON document. Unknown fields are errors.
    pub fn from_json(json: &str) -> Result<Self, ConfigError> {
        // An object, and nothing else: serde would also take an array,
        // filling the fields by position with no names to check.
        let value: serde_json::Value = serde_json::from_str(json)?;
        if !value.is_object() {
            return Err(ConfigError::Invalid { field: "(document)", reason: "must be a JSON object".into() });
        }
        let config: EngineConfig = serde_json::from_value(value)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks relations between fields and value ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn invalid(field: &'static str, reason: &str) -> Result<(), ConfigError> {
            Err(ConfigError::Invalid { field, reason: reason.to_owned() })
        }
        let positive = [
            ("max_registrations", self.max_registrations),
            ("max_registered_bytes", self.max_registered_bytes),
            ("max_prepared_transfers", self.max_prepared_transfers),
            ("max_executions", self.max_executions),
            ("max_descriptors_per_transfer", self.max_descriptors_per_transfer),
            ("max_transfer_bytes", self.max_transfer_bytes),
            ("max_bytes_in_flight", self.max_bytes_in_flight),
            ("max_tasks_in_flight", self.max_tasks_in_flight),
            ("task_bytes", self.task_bytes),
            ("admission_queue_len", self.admission_queue_len),
            ("notification_queue_len", self.notification_queue_len),
            ("max_borrows_per_connection", self.max_borrows_per_connection),
            ("max_registrations_per_borrow", self.max_registrations_per_borrow),
            ("max_borrows", self.max_borrows),
            ("max_borrow_bytes", self.max_borrow_bytes),
            ("max_watchers", self.max_watchers),
            ("max_watchers_per_address", self.max_watchers_per_address),
            ("max_frame_buffer_bytes", self.max_frame_buffer_bytes),
            ("max_connections", self.max_connections),
            ("max_connections_per_address", self.max_connections_per_address),
            ("max_unauthenticated_connections", self.max_unauthenticated_connections),
            ("server_frame_timeout_ms", self.server_frame_timeout_ms),
        ];
        for (field, value) in positive {
            if value == 0 {
                return invalid(field, "must be at least 1");
            }
        }
        if self.max_descriptors_per_transfer > u32::MAX as u64 / 2 {
            return invalid("max_descriptors_per_transfer", "must be below 2^31");
        }
        if self.task_bytes > self.max_bytes_in_flight {
            return invalid("task_bytes", "must not exceed max_bytes_in_flight");
        }
        if self.anti_starvation_after == 0 {
            return invalid("anti_starvation_after", "must be at least 1");
        }
        if self.progress_interval_us < 50 {
            return invalid("progress_interval_us", "must be at least 50");
        }
        if self.spin_us > 1_000 {
            return invalid("spin_us", "must be at most 1000");
        }
        if self.max_binding_handles == 0 {
            return invalid("max_binding_handles", "must be at least 1");
        }
        if self.inline_max_bytes > MIB {
            return invalid("inline_max_bytes", "must be at most 1048576");
        }
        if !(4 * KIB..=64 * MIB).contains(&self.staging_chunk_bytes) {
            return invalid("staging_chunk_bytes", "must be 4096 to 67108864");
        }
        if self.max_staging_bytes < 2 * self.staging_chunk_bytes {
            return invalid("max_staging_bytes", "must hold two staging chunks (a task larger than one)");
        }
        if !(1..=16).contains(&self.rdma_qps_per_nic) {
            return invalid("rdma_qps_per_nic", "must be 1 to 16");
        }
        if self.rdma_devices.as_ref().is_some_and(|d| d.iter().any(|n| n.is_empty() || n.len() > 64)) {
            return invalid("rdma_devices", "NIC names must be 1 to 64 bytes");
        }
        if !(1..=16).contains(&self.connections_per_peer) {
            return invalid("connections_per_peer", "must be 1 to 16");
        }
        if self.tcp_window_bytes != 0 && !(4 * KIB..=GIB).contains(&self.tcp_window_bytes) {
            return invalid("tcp_window_bytes", "must be 0 (automatic) or 4 KiB to 1 GiB");
        }
        if self.peer_timeout_ms == 0 {
            return invalid("peer_timeout_ms", "must be at least 1");
        }
        if !(4096..=64 * MIB).contains(&self.max_frame_body) {
            return invalid("max_frame_body", "must be 4 KiB to 64 MiB");
        }
        if self.max_notification_bytes.saturating_add(512) > self.max_frame_body {
            return invalid("max_notification_bytes", "must leave 512 bytes of max_frame_body for the envelope");
        }
        if self.task_bytes > u32::MAX as u64 {
            return invalid("task_bytes", "must be below 4 GiB (one frame)");
        }
        if self.local_route_workers > 64 {
            return invalid("local_route_workers", "must be 0 (one per core) to 64");
        }
        for (field, value) in [
            ("server_frame_timeout_ms", self.server_frame_timeout_ms),
            ("server_idle_timeout_ms", self.server_idle_timeout_ms),
            ("peer_timeout_ms", self.peer_timeout_ms),
        ] {
            if value > 24 * 3_600_000 {
                return invalid(field, "must be at most one day");
            }
        }
        if let Some(m) = &self.metadata {
            crate::discovery::parse_store(m).map_err(|why| ConfigError::Invalid { field: "metadata", reason: why })?;
        }
        if let Some(n) = &self.name {
            crate::discovery::check_name(n)
                .map_err(|e| ConfigError::Invalid { field: "name", reason: e.to_string() })?;
            if self.metadata.is_none() || self.listen.is_none() {
                return invalid("name", "needs metadata (where to publish) and listen (what to publish)");
            }
        }
        if !(1_000..=3_600_000).contains(&self.metadata_ttl_ms) || self.metadata_ttl_ms % 1000 != 0 {
            return invalid("metadata_ttl_ms", "must be whole seconds from 1000 to 3600000");
        }
        if !(100..=60_000).contains(&self.metadata_timeout_ms) {
            return invalid("metadata_timeout_ms", "must be 100 to 60000");
        }
        if let Some(a) = &self.advertise {
            crate::endpoint::validate_advertise(a)
                .map_err(|e| ConfigError::Invalid { field: "advertise", reason: e.to_string() })?;
        }
        Ok(())
    }

    /// The progress worker's longest sleep while work is queued.
    pub fn progress_interval(&self) -> Duration {
        Duration::from_micros(self.progress_interval_us)
    }

    /// Route workers to start (`local_route_workers`, 0 = one per core).
    pub fn route_workers(&self) -> u32 {
        match self.local_route_workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get().min(8) as u32),
            n => n,
        }
    }

    /// How long workers and waiters poll before sleeping.
    pub fn spin(&self) -> Duration {
        Duration::from_micros(self.spin_us)
    }

    /// Each tcp data connection's receive window: `tcp_window_bytes`, or
    /// when 0 one route task (`task_bytes`) within 1 MiB to 64 MiB.
    pub fn tcp_window(&self) -> u64 {
        match self.tcp_window_bytes {
            0 => self.task_bytes.clamp(MIB, 64 * MIB),
            n => n,
        }
    }

    /// Bound on a peer's silence.
    pub fn peer_timeout(&self) -> Duration {
        Duration::from_millis(self.peer_timeout_ms)
    }

    /// The longest a request moving `bytes` may take before the peer counts
    /// as not answering: `peer_timeout_ms` plus `bytes` at
    /// `peer_min_bytes_per_s` (no rate bound when that is 0).
    pub fn request_deadline(&self, bytes: u64) -> Option<Duration> {
        match self.peer_min_bytes_per_s {
            0 => None,
            rate => Some(self.peer_timeout().saturating_add(crate::time::at_rate(bytes, rate))),
        }
    }

    /// How long `close` waits for admitted work to drain.
    pub fn close_drain_timeout(&self) -> Duration {
        Duration::from_millis(self.close_drain_timeout_ms)
    }
}

/// The environment variable a deployment reads its configuration from when
/// it is given none: a JSON object, or `@/path/to/file.json`.
pub const CONFIG_ENV: &str = "ORBITE_CONFIG";

/// Largest configuration document accepted, inline or from a file.
pub const MAX_CONFIG_DOCUMENT: usize = 1 << 20;

/// Where a deployment's configuration came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigOrigin {
    /// Given explicitly (the NIXL backend's `config` parameter, a flag).
    Explicit,
    /// [`CONFIG_ENV`] holds the JSON object itself.
    Environment,
    /// [`CONFIG_ENV`] names a file (`@path`).
    EnvironmentFile(std::path::PathBuf),
    /// Nothing was given: every default.
    Defaults,
}

impl std::fmt::Display for ConfigOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigOrigin::Explicit => f.write_str("explicit parameters"),
            ConfigOrigin::Environment => write!(f, "{CONFIG_ENV}"),
            ConfigOrigin::EnvironmentFile(p) => write!(f, "{CONFIG_ENV}=@{}", p.display()),
            ConfigOrigin::Defaults => write!(f, "defaults (no parameters, {CONFIG_ENV} unset)"),
        }
    }
}

/// A configuration document as a deployment found it: explicit parameters
/// win; without them [`CONFIG_ENV`] is read (unset or blank: defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigDocument {
    /// The JSON object text, checked to parse as an [`EngineConfig`].
    pub json: String,
    /// Where it came from.
    pub origin: ConfigOrigin,
}

impl ConfigDocument {
    /// `explicit` if given, else the environment's document. A document
    /// from the environment that is unreadable, not a JSON object, or not
    /// a valid configuration fails with [`ConfigError::Environment`],
    /// which names the variable.
    pub fn resolve(explicit: Option<&str>) -> Result<Self, ConfigError> {
        if let Some(json) = explicit {
            return Ok(ConfigDocument { json: json.to_owned(), origin: ConfigOrigin::Explicit });
        }
        Self::from_env_value(std::env::var_os(CONFIG_ENV))
    }

    fn from_env_value(value: Option<std::ffi::OsString>) -> Result<Self, ConfigError> {
        let env = |reason: String| ConfigError::Environment { variable: CONFIG_ENV, reason };
        let Some(value) = value else {
            return Ok(ConfigDocument { json: "{}".into(), origin: ConfigOrigin::Defaults });
        };
        let value = value.into_string().map_err(|_| env("is not UTF-8".into()))?;
        let value = value.trim();
        if value.is_empty() {
            return Ok(ConfigDocument { json: "{}".into(), origin: ConfigOrigin::Defaults });
        }
        let (json, origin) = match value.strip_prefix('@') {
            Some(path) => {
                let path = std::path::PathBuf::from(path);
                let mut text = String::new();
                use std::io::Read;
                std::fs::File::open(&path)
                    .and_then(|f| f.take(MAX_CONFIG_DOCUMENT as u64 + 1).read_to_string(&mut text))
                    .map_err(|e| env(format!("cannot read {}: {e}", path.display())))?;
                (text, ConfigOrigin::EnvironmentFile(path))
            }
            None => (value.to_owned(), ConfigOrigin::Environment),
        };
        if json.len() > MAX_CONFIG_DOCUMENT {
            return Err(env(format!("the document exceeds {MAX_CONFIG_DOCUMENT} bytes")));
        }
        match serde_json::from_str::<serde_json::Value>(&json) {
            Ok(serde_json::Value::Object(_)) => {}
            Ok(_) => return Err(env("is not a JSON object".into())),
            Err(e) => return Err(env(format!("is not JSON: {e}"))),
        }
        EngineConfig::from_json(&json).map_err(|e| env(e.to_string()))?;
        Ok(ConfigDocument { json, origin })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `config` fuzz target: an array filled the fields by
    /// position; a valid configuration made `request_deadline` panic.
    #[test]
    fn only_objects_configure_and_huge_deadlines_saturate() {
        assert!(EngineConfig::from_json("[1, 2]").is_err());
        assert!(EngineConfig::from_json("7").is_err());
        let c = EngineConfig::from_json(r#"{"max_transfer_bytes": 18446744073709551615, "peer_min_bytes_per_s": 1}"#)
            .unwrap();
        assert_eq!(c.request_deadline(u64::MAX), Some(Duration::MAX));
    }

    #[test]
    fn empty_document_gives_defaults() {
        assert_eq!(EngineConfig::from_json("{}").unwrap(), EngineConfig::default());
    }

    #[test]
    fn unknown_field_is_rejected_by_name() {
        let err = EngineConfig::from_json(r#"{"max_executions": 4, "max_executons": 5}"#).unwrap_err();
        assert!(err.to_string().contains("max_executons"), "{err}");
    }

    #[test]
    fn fields_override_defaults() {
        let c = EngineConfig::from_json(r#"{"max_tasks_in_flight": 3, "progress_worker": true}"#).unwrap();
        assert_eq!(c.max_tasks_in_flight, 3);
        assert!(c.progress_worker);
        assert_eq!(c.task_bytes, EngineConfig::default().task_bytes);
    }

    #[test]
    fn environment_documents_inline_file_and_errors_name_the_variable() {
        let os = |s: &str| Some(std::ffi::OsString::from(s));
        let d = ConfigDocument::from_env_value(None).unwrap();
        assert_eq!((d.json.as_str(), d.origin), ("{}", ConfigOrigin::Defaults));
        assert_eq!(ConfigDocument::from_env_value(os("  ")).unwrap().origin, ConfigOrigin::Defaults);
        let d = ConfigDocument::from_env_value(os(r#"{"peer_timeout_ms": 5}"#)).unwrap();
        assert_eq!(d.origin, ConfigOrigin::Environment);
        assert_eq!(EngineConfig::from_json(&d.json).unwrap().peer_timeout_ms, 5);
        let dir = std::env::temp_dir().join(format!("orbite-config-{}", std::process::id()));
        std::fs::write(&dir, r#"{"advertise": "10.0.0.7"}"#).unwrap();
        let d = ConfigDocument::from_env_value(os(&format!("@{}", dir.display()))).unwrap();
        assert_eq!(d.origin, ConfigOrigin::EnvironmentFile(dir.clone()));
        std::fs::remove_file(&dir).unwrap();
        for bad in ["[1]", "{", r#"{"max_executons": 1}"#, r#"{"advertise": "a b"}"#, "@/nonexistent/orbite.json"] {
            let e = ConfigDocument::from_env_value(os(bad)).unwrap_err();
            assert!(e.to_string().starts_with("ORBITE_CONFIG: "), "{bad}: {e}");
        }
        let d = ConfigDocument::resolve(Some("{}")).unwrap();
        assert_eq!(d.origin, ConfigOrigin::Explicit);
    }

    #[test]
    fn the_tcp_window_follows_the_task_size_unless_set() {
        let window = |json: &str| EngineConfig::from_json(json).unwrap().tcp_window();
        assert_eq!(window("{}"), MIB);
        assert_eq!(window(r#"{"task_bytes": 65536}"#), MIB, "at least 1 MiB");
        assert_eq!(window(r#"{"task_bytes": 4194304}"#), 4 * MIB);
        assert_eq!(window(r#"{"task_bytes": 1073741824, "max_bytes_in_flight": 1073741824}"#), 64 * MIB);
        assert_eq!(window(r#"{"tcp_window_bytes": 8192, "task_bytes": 4194304}"#), 8192);
    }

    #[test]
    fn invalid_values_name_their_field() {
        for (json, field) in [
            (r#"{"max_executions": 0}"#, "max_executions"),
            (r#"{"task_bytes": 2048, "max_bytes_in_flight": 1024}"#, "task_bytes"),
            (r#"{"progress_interval_us": 1}"#, "progress_interval_us"),
            (r#"{"local_route_workers": 65}"#, "local_route_workers"),
            (r#"{"inline_max_bytes": 1048577}"#, "inline_max_bytes"),
            (r#"{"staging_chunk_bytes": 4095}"#, "staging_chunk_bytes"),
            (r#"{"tcp_window_bytes": 4095}"#, "tcp_window_bytes"),
            (r#"{"tcp_window_bytes": 1073741825}"#, "tcp_window_bytes"),
            (r#"{"staging_chunk_bytes": 67108865}"#, "staging_chunk_bytes"),
            (r#"{"max_staging_bytes": 1048576}"#, "max_staging_bytes"),
            (r#"{"max_notification_bytes": 18446744073709551615}"#, "max_notification_bytes"),
            (r#"{"advertise": ""}"#, "advertise"),
        ] {
            let err = EngineConfig::from_json(json).unwrap_err();
            assert!(err.to_string().contains(field), "{json}: {err}");
        }
        assert!(EngineConfig::from_json(r#"{"max_executions": -1}"#).is_err());
        assert!(EngineConfig::from_json(r#"{"max_executions": "4"}"#).is_err());
    }
}
