//! KV sessions: the lifecycle of one prefill/decode handoff.
//!
//! A session ties a producer (prefill), which fills KV ranges and marks
//! them ready, to a consumer (decode), which attaches and reads them, under
//! a lease. [`SessionMachine`] is the state machine: sans-IO, every
//! operation takes the time, and it says what to do through [`Effect`]s.
//! [`KvSessionService`] runs it over a [`crate::TransferEngine`]: it owns
//! the clock, pins the producer's ranges through the engine, tracks the
//! session's transfers and frees a session's resources exactly once, after
//! the engine proved every transfer retired. docs/api.md describes the
//! contract; docs/mappings.md relates it to vLLM, SGLang and TensorRT-LLM.

#[cfg(feature = "grpc")]
pub mod grpc;
mod machine;
mod service;
pub mod status;

pub use machine::{AttachOutcome, Effect, SessionMachine};
pub use service::{Clock, KvServiceStats, KvSessionService, ManualClock, Reaper, SystemClock};

/// A session's identity: the service's incarnation (random, new at every
/// start) and a sequence number within it. A restarted service never
/// answers for an id of an earlier incarnation, so ids are never reused.
/// The text form, which the gRPC service uses, is 16 lowercase hex digits
/// of the incarnation, `-`, and the decimal sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct SessionId {
    /// The service incarnation that allocated it.
    pub incarnation: u64,
    /// From 1 within the incarnation.
    pub seq: u64,
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}-{}", self.incarnation, self.seq)
    }
}

impl std::str::FromStr for SessionId {
    type Err = KvError;

    /// Only the canonical form: exactly 16 lowercase hex digits, `-`, and
    /// a decimal sequence without sign or leading zero.
    fn from_str(s: &str) -> Result<Self, KvError> {
        let bad = || KvError::InvalidValue { field: "session_id", value: s.chars().take(64).collect() };
        let (inc, seq) = s.split_once('-').ok_or_else(bad)?;
        let hex = |c: u8| c.is_ascii_digit() || (b'a'..=b'f').contains(&c);
        if inc.len() != 16 || !inc.bytes().all(hex) {
            return Err(bad());
        }
        if seq.is_empty() || seq.len() > 20 || !seq.bytes().all(|c| c.is_ascii_digit()) || seq.starts_with('0') {
            return Err(bad());
        }
        let incarnation = u64::from_str_radix(inc, 16).map_err(|_| bad())?;
        let seq = seq.parse::<u64>().map_err(|_| bad())?;
        Ok(SessionId { incarnation, seq })
    }
}

/// How producer and consumer start (values fixed by the protocol).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum KvScheduleStyle {
    /// The caller asks for the service's default without claiming support.
    Unspecified = 0,
    /// The producer computes first; the consumer attaches once ready.
    ContextFirst = 1,
    /// The consumer allocates and may queue; the producer fills later.
    GenerationFirst = 2,
    /// Both start at once on one session.
    Concurrent = 3,
}

/// Whether the consumer needs the transfer (values fixed by the protocol).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum KvTransferDisposition {
    /// Treated as `Required`.
    Unspecified = 0,
    /// The consumer needs the producer's KV.
    Required = 1,
    /// The consumer may go on without it (conditional bypass).
    Bypass = 2,
}

/// Where a session stands (values fixed by the protocol).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum KvSessionState {
    /// Never a session's state; the protocol's zero value.
    Unspecified = 0,
    /// Allocated; the producer has not marked KV ready.
    Allocated = 1,
    /// The producer's KV is pinned and ready.
    Ready = 2,
    /// The consumer attached and may read.
    Attached = 3,
    /// The consumer finished: terminal.
    Complete = 4,
    /// The consumer went on without the transfer: terminal.
    Bypassed = 5,
    /// A participant refused the session: terminal.
    Rejected = 6,
    /// Aborted: terminal.
    Cancelled = 7,
    /// A transfer failed or a peer was lost: terminal.
    Failed = 8,
    /// Released before it ended otherwise: terminal.
    Released = 9,
    /// Its lease ran out: terminal.
    Expired = 10,
}

impl KvSessionState {
    /// Terminal states never change.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            KvSessionState::Complete
                | KvSessionState::Bypassed
                | KvSessionState::Rejected
                | KvSessionState::Cancelled
                | KvSessionState::Failed
                | KvSessionState::Released
                | KvSessionState::Expired
        )
    }
}

/// One pinned KV range, as a peer names it in a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KvRangeRef {
    /// Raw registration id in the producer's engine.
    pub registration: u64,
    /// Offset in it.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// What both participants use to find the session and its KV.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KvRendezvous {
    /// The producer engine's endpoint.
    pub endpoint: String,
    /// Its epoch (a restarted engine is another identity).
    pub epoch: u64,
    /// The session.
    pub session_id: SessionId,
    /// The pinned KV ranges (empty until ready).
    pub ranges: Vec<KvRangeRef>,
}

/// The shape of the KV both sides must agree on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KvTransferMeta {
    /// Layout name (model, dtype, block geometry), compared exactly.
    pub layout: String,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Blocks in the session.
    pub blocks: u64,
}

/// A session as the service reports it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KvSession {
    /// Unique across every incarnation of the service.
    pub session_id: SessionId,
    /// The serving system's request.
    pub request_id: String,
    /// The model.
    pub model: String,
    /// The caller's idempotency key.
    pub idempotency_key: String,
    /// As requested (`Unspecified` stays so: no support is claimed).
    pub style: KvScheduleStyle,
    /// The style the service applies.
    pub effective_style: KvScheduleStyle,
    /// As requested.
    pub disposition: KvTransferDisposition,
    /// Where it stands.
    pub state: KvSessionState,
    /// Absolute lease expiry on the service clock (milliseconds).
    pub lease_expires_at_ms: u64,
    /// A consumer attached before the KV was ready and waits.
    pub consumer_queued: bool,
    /// How to reach the KV.
    pub rendezvous: KvRendezvous,
    /// The KV's shape.
    pub meta: KvTransferMeta,
    /// Why it ended (terminal states), if a reason was given.
    pub reason: Option<String>,
}

/// What a service supports, so that clients reject incompatible
/// deployments before traffic.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvConnectorInfo {
    /// Styles a caller may ask for explicitly.
    pub supported_styles: Vec<KvScheduleStyle>,
    /// The style `Unspecified` gets.
    pub default_style: KvScheduleStyle,
    /// Callers may allocate sessions (before either participant starts).
    pub caller_allocation: bool,
    /// Leases can be renewed.
    pub renewable_leases: bool,
    /// Release is an explicit operation.
    pub explicit_release: bool,
    /// A consumer may bypass the transfer (disposition `Bypass`).
    pub conditional_bypass: bool,
    /// Sessions (and tombstones) can be looked up.
    pub session_lookup: bool,
    /// A decode request may run without a session (local prefill).
    pub local_prefill: bool,
    /// Live (non-terminal) sessions at most.
    pub max_live_sessions: u64,
    /// Lease given when none is asked for.
    pub default_lease_ms: u64,
    /// Longest lease.
    pub max_lease_ms: u64,
    /// How long terminal sessions stay queryable.
    pub tombstone_retention_ms: u64,
    /// Terminal sessions kept at most.
    pub max_tombstones: u64,
    /// Longest `request_id`, `model`, `idempotency_key`, `meta.layout` or
    /// reason, in bytes.
    pub max_field_bytes: u64,
    /// Most ranges one session may pin.
    pub max_ranges: u64,
}

impl Default for KvConnectorInfo {
    fn default() -> Self {
        KvConnectorInfo {
            supported_styles: vec![
                KvScheduleStyle::ContextFirst,
                KvScheduleStyle::GenerationFirst,
                KvScheduleStyle::Concurrent,
            ],
            default_style: KvScheduleStyle::ContextFirst,
            caller_allocation: true,
            renewable_leases: true,
            explicit_release: true,
            conditional_bypass: true,
            session_lookup: true,
            local_prefill: false,
            max_live_sessions: 65_536,
            default_lease_ms: 30_000,
            max_lease_ms: 600_000,
            tombstone_retention_ms: 60_000,
            max_tombstones: 65_536,
            max_field_bytes: 1024,
            max_ranges: 4096,
        }
    }
}

impl KvConnectorInfo {
    /// Whether the advertised values make sense together: an explicit
    /// default style that is supported, positive leases with the default
    /// within the maximum, positive limits.
    pub fn validate(&self) -> Result<(), ConnectorInfoError> {
        if self.default_style == KvScheduleStyle::Unspecified || !self.supported_styles.contains(&self.default_style) {
            return Err(ConnectorInfoError::DefaultStyle(self.default_style));
        }
        if self.supported_styles.contains(&KvScheduleStyle::Unspecified) {
            return Err(ConnectorInfoError::UnspecifiedStyle);
        }
        if self.default_lease_ms == 0
            || self.default_lease_ms > self.max_lease_ms
            || self.max_lease_ms > i64::MAX as u64
        {
            return Err(ConnectorInfoError::Leases { default_ms: self.default_lease_ms, max_ms: self.max_lease_ms });
        }
        for (name, v) in [
            ("max_live_sessions", self.max_live_sessions),
            ("max_field_bytes", self.max_field_bytes),
            ("max_ranges", self.max_ranges),
        ] {
            if v == 0 {
                return Err(ConnectorInfoError::ZeroLimit(name));
            }
        }
        Ok(())
    }
}

/// Why advertised connector values do not make sense together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectorInfoError {
    /// The default style is unspecified or not supported.
    #[error("default_style {0:?} must be one of supported_styles")]
    DefaultStyle(KvScheduleStyle),
    /// The supported styles list the unspecified one.
    #[error("supported_styles lists explicit styles only")]
    UnspecifiedStyle,
    /// The leases do not fit together.
    #[error("default_lease_ms ({default_ms}) must be positive and at most max_lease_ms ({max_ms})")]
    Leases {
        /// The default lease.
        default_ms: u64,
        /// The longest lease.
        max_ms: u64,
    },
    /// A limit of 0.
    #[error("{0} must be at least 1")]
    ZeroLimit(&'static str),
}

/// A request to allocate a session.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AllocateRequest {
    /// Required.
    pub request_id: String,
    /// Required.
    pub model: String,
    /// Required; a retry with the same key and fields returns the session.
    pub idempotency_key: String,
    /// `Unspecified` for the default.
    pub style: KvScheduleStyle,
    /// `Unspecified` means required.
    pub disposition: KvTransferDisposition,
    /// Lease in milliseconds; `None` for the default. Zero or negative is
    /// invalid.
    pub lease_ms: Option<i64>,
    /// The KV's shape.
    pub meta: KvTransferMeta,
}

/// Why an operation was refused. A refused operation changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// A required field is empty.
    #[error("missing required field `{0}`")]
    MissingField(&'static str),
    /// A text field above `max_field_bytes`.
    #[error("field `{field}` has {len} bytes, more than the limit of {max}")]
    FieldTooLong {
        /// The field.
        field: &'static str,
        /// Its length.
        len: u64,
        /// The advertised limit.
        max: u64,
    },
    /// A value that names nothing: an unknown enumeration value, a session
    /// id not in the canonical form.
    #[error("field `{field}` has no meaning for {value:?}")]
    InvalidValue {
        /// The field.
        field: &'static str,
        /// The value (at most 64 characters of it).
        value: String,
    },
    /// More ranges than `max_ranges`.
    #[error("{count} ranges, more than the limit of {max}")]
    TooManyRanges {
        /// Given.
        count: u64,
        /// The advertised limit.
        max: u64,
    },
    /// The same idempotency key with different fields.
    #[error("idempotency key {key:?} is in use by session {session} with other fields")]
    IdempotencyConflict {
        /// The key.
        key: String,
        /// The session holding it.
        session: SessionId,
    },
    /// An explicit style this service does not support.
    #[error("schedule style {0:?} is not supported")]
    UnsupportedStyle(KvScheduleStyle),
    /// Disposition `Bypass` where conditional bypass is not advertised.
    #[error("conditional bypass is not supported")]
    BypassNotSupported,
    /// An operation whose capability this service advertises as off
    /// (`caller_allocation`, `explicit_release`, `session_lookup`): it is
    /// refused before anything is looked at, and nothing changes.
    #[error("{0} is switched off on this service (see GetKvConnectorInfo)")]
    CapabilityOff(&'static str),
    /// A lease of zero or less.
    #[error("lease of {0} ms is invalid (must be positive)")]
    InvalidLease(i64),
    /// A lease above the advertised maximum.
    #[error("lease of {requested} ms exceeds the maximum of {max} ms")]
    LeaseTooLong {
        /// Asked for.
        requested: i64,
        /// Advertised maximum.
        max: u64,
    },
    /// No such session (never existed, or its tombstone expired).
    #[error("no session {0}")]
    NotFound(SessionId),
    /// A session id of another incarnation: the service restarted since
    /// (or the id belongs to another service). Never another session.
    #[error("session {session} belongs to another incarnation of the service (this one is {incarnation:016x})")]
    OtherIncarnation {
        /// The id as given.
        session: String,
        /// This service's incarnation.
        incarnation: u64,
    },
    /// The session ended; terminal states never change.
    #[error("session {session} is {state:?}")]
    Terminal {
        /// The session.
        session: SessionId,
        /// Its terminal state.
        state: KvSessionState,
    },
    /// The operation does not apply in this state.
    #[error("session {session}: {op} is not allowed in state {state:?}")]
    WrongState {
        /// The session.
        session: SessionId,
        /// Its state.
        state: KvSessionState,
        /// The operation.
        op: &'static str,
    },
    /// The KV is not ready yet and this style does not queue: retry.
    #[error("session {0} is not ready")]
    NotReady(SessionId),
    /// Transfer metadata that does not match the session's.
    #[error("incompatible transfer metadata: {0}")]
    IncompatibleMetadata(String),
    /// The service is draining: no new sessions.
    #[error("the session service is draining")]
    Draining,
    /// Too many live sessions.
    #[error("too many live sessions (limit {limit})")]
    TooManySessions {
        /// The advertised limit.
        limit: u64,
    },
    /// A decode without a session needs explicit bypass or local prefill.
    #[error("a decode without a session needs disposition Bypass or an advertised local-prefill mode")]
    SessionRequired,
    /// The engine refused (pinning ranges, tracking a transfer).
    #[error("engine: {0}")]
    Engine(String),
}
