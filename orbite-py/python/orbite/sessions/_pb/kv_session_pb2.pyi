from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvScheduleStyle(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_SCHEDULE_STYLE_UNSPECIFIED: _ClassVar[KvScheduleStyle]
    KV_SCHEDULE_STYLE_CONTEXT_FIRST: _ClassVar[KvScheduleStyle]
    KV_SCHEDULE_STYLE_GENERATION_FIRST: _ClassVar[KvScheduleStyle]
    KV_SCHEDULE_STYLE_CONCURRENT: _ClassVar[KvScheduleStyle]

class KvTransferDisposition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSFER_DISPOSITION_UNSPECIFIED: _ClassVar[KvTransferDisposition]
    KV_TRANSFER_DISPOSITION_REQUIRED: _ClassVar[KvTransferDisposition]
    KV_TRANSFER_DISPOSITION_BYPASS: _ClassVar[KvTransferDisposition]

class KvSessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_SESSION_STATE_UNSPECIFIED: _ClassVar[KvSessionState]
    KV_SESSION_STATE_ALLOCATED: _ClassVar[KvSessionState]
    KV_SESSION_STATE_READY: _ClassVar[KvSessionState]
    KV_SESSION_STATE_ATTACHED: _ClassVar[KvSessionState]
    KV_SESSION_STATE_COMPLETE: _ClassVar[KvSessionState]
    KV_SESSION_STATE_BYPASSED: _ClassVar[KvSessionState]
    KV_SESSION_STATE_REJECTED: _ClassVar[KvSessionState]
    KV_SESSION_STATE_CANCELLED: _ClassVar[KvSessionState]
    KV_SESSION_STATE_FAILED: _ClassVar[KvSessionState]
    KV_SESSION_STATE_RELEASED: _ClassVar[KvSessionState]
    KV_SESSION_STATE_EXPIRED: _ClassVar[KvSessionState]
KV_SCHEDULE_STYLE_UNSPECIFIED: KvScheduleStyle
KV_SCHEDULE_STYLE_CONTEXT_FIRST: KvScheduleStyle
KV_SCHEDULE_STYLE_GENERATION_FIRST: KvScheduleStyle
KV_SCHEDULE_STYLE_CONCURRENT: KvScheduleStyle
KV_TRANSFER_DISPOSITION_UNSPECIFIED: KvTransferDisposition
KV_TRANSFER_DISPOSITION_REQUIRED: KvTransferDisposition
KV_TRANSFER_DISPOSITION_BYPASS: KvTransferDisposition
KV_SESSION_STATE_UNSPECIFIED: KvSessionState
KV_SESSION_STATE_ALLOCATED: KvSessionState
KV_SESSION_STATE_READY: KvSessionState
KV_SESSION_STATE_ATTACHED: KvSessionState
KV_SESSION_STATE_COMPLETE: KvSessionState
KV_SESSION_STATE_BYPASSED: KvSessionState
KV_SESSION_STATE_REJECTED: KvSessionState
KV_SESSION_STATE_CANCELLED: KvSessionState
KV_SESSION_STATE_FAILED: KvSessionState
KV_SESSION_STATE_RELEASED: KvSessionState
KV_SESSION_STATE_EXPIRED: KvSessionState

class KvTransferMeta(_message.Message):
    __slots__ = ("layout", "block_bytes", "blocks")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    layout: str
    block_bytes: int
    blocks: int
    def __init__(self, layout: _Optional[str] = ..., block_bytes: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class KvRange(_message.Message):
    __slots__ = ("registration", "offset", "len")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEN_FIELD_NUMBER: _ClassVar[int]
    registration: int
    offset: int
    len: int
    def __init__(self, registration: _Optional[int] = ..., offset: _Optional[int] = ..., len: _Optional[int] = ...) -> None: ...

class KvRendezvous(_message.Message):
    __slots__ = ("endpoint", "epoch", "session_id", "ranges")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    epoch: int
    session_id: str
    ranges: _containers.RepeatedCompositeFieldContainer[KvRange]
    def __init__(self, endpoint: _Optional[str] = ..., epoch: _Optional[int] = ..., session_id: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[KvRange, _Mapping]]] = ...) -> None: ...

class KvSession(_message.Message):
    __slots__ = ("session_id", "request_id", "model", "idempotency_key", "style", "effective_style", "disposition", "state", "lease_expires_at", "consumer_queued", "rendezvous", "meta", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    STYLE_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_STYLE_FIELD_NUMBER: _ClassVar[int]
    DISPOSITION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_QUEUED_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request_id: str
    model: str
    idempotency_key: str
    style: KvScheduleStyle
    effective_style: KvScheduleStyle
    disposition: KvTransferDisposition
    state: KvSessionState
    lease_expires_at: _timestamp_pb2.Timestamp
    consumer_queued: bool
    rendezvous: KvRendezvous
    meta: KvTransferMeta
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., model: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., style: _Optional[_Union[KvScheduleStyle, str]] = ..., effective_style: _Optional[_Union[KvScheduleStyle, str]] = ..., disposition: _Optional[_Union[KvTransferDisposition, str]] = ..., state: _Optional[_Union[KvSessionState, str]] = ..., lease_expires_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., consumer_queued: bool = ..., rendezvous: _Optional[_Union[KvRendezvous, _Mapping]] = ..., meta: _Optional[_Union[KvTransferMeta, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class AllocateKvSessionRequest(_message.Message):
    __slots__ = ("request_id", "model", "idempotency_key", "style", "disposition", "lease_ms", "meta")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    STYLE_FIELD_NUMBER: _ClassVar[int]
    DISPOSITION_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    idempotency_key: str
    style: KvScheduleStyle
    disposition: KvTransferDisposition
    lease_ms: int
    meta: KvTransferMeta
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., style: _Optional[_Union[KvScheduleStyle, str]] = ..., disposition: _Optional[_Union[KvTransferDisposition, str]] = ..., lease_ms: _Optional[int] = ..., meta: _Optional[_Union[KvTransferMeta, _Mapping]] = ...) -> None: ...

class GetKvSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class RenewKvSessionRequest(_message.Message):
    __slots__ = ("session_id", "lease_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_ms: int
    def __init__(self, session_id: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ReleaseKvSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseKvSessionResponse(_message.Message):
    __slots__ = ("session_id", "state", "released_now", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_NOW_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    state: KvSessionState
    released_now: bool
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., state: _Optional[_Union[KvSessionState, str]] = ..., released_now: bool = ..., reason: _Optional[str] = ...) -> None: ...

class AbortKvSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class MarkKvSessionReadyRequest(_message.Message):
    __slots__ = ("session_id", "ranges", "meta")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ranges: _containers.RepeatedCompositeFieldContainer[KvRange]
    meta: KvTransferMeta
    def __init__(self, session_id: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[KvRange, _Mapping]]] = ..., meta: _Optional[_Union[KvTransferMeta, _Mapping]] = ...) -> None: ...

class AttachKvSessionRequest(_message.Message):
    __slots__ = ("session_id", "meta")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    meta: KvTransferMeta
    def __init__(self, session_id: _Optional[str] = ..., meta: _Optional[_Union[KvTransferMeta, _Mapping]] = ...) -> None: ...

class AttachKvSessionResponse(_message.Message):
    __slots__ = ("session", "queued")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    session: KvSession
    queued: bool
    def __init__(self, session: _Optional[_Union[KvSession, _Mapping]] = ..., queued: bool = ...) -> None: ...

class CompleteKvSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class BypassKvSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class RejectKvSessionRequest(_message.Message):
    __slots__ = ("session_id", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class FailKvSessionRequest(_message.Message):
    __slots__ = ("session_id", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CheckSessionlessDecodeRequest(_message.Message):
    __slots__ = ("disposition",)
    DISPOSITION_FIELD_NUMBER: _ClassVar[int]
    disposition: KvTransferDisposition
    def __init__(self, disposition: _Optional[_Union[KvTransferDisposition, str]] = ...) -> None: ...

class CheckSessionlessDecodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainKvSessionsRequest(_message.Message):
    __slots__ = ("timeout_ms", "abort_remaining")
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ABORT_REMAINING_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    abort_remaining: bool
    def __init__(self, timeout_ms: _Optional[int] = ..., abort_remaining: bool = ...) -> None: ...

class DrainKvSessionsResponse(_message.Message):
    __slots__ = ("drained", "live_sessions", "pinned_ranges", "tracked_transfers", "awaiting_cleanup", "aborted")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PINNED_RANGES_FIELD_NUMBER: _ClassVar[int]
    TRACKED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    AWAITING_CLEANUP_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    live_sessions: int
    pinned_ranges: int
    tracked_transfers: int
    awaiting_cleanup: int
    aborted: int
    def __init__(self, drained: bool = ..., live_sessions: _Optional[int] = ..., pinned_ranges: _Optional[int] = ..., tracked_transfers: _Optional[int] = ..., awaiting_cleanup: _Optional[int] = ..., aborted: _Optional[int] = ...) -> None: ...

class GetKvConnectorInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvLimits(_message.Message):
    __slots__ = ("max_live_sessions", "default_lease_ms", "max_lease_ms", "tombstone_retention_ms", "max_tombstones", "max_field_bytes", "max_ranges", "max_message_bytes")
    MAX_LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONE_RETENTION_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_RANGES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_live_sessions: int
    default_lease_ms: int
    max_lease_ms: int
    tombstone_retention_ms: int
    max_tombstones: int
    max_field_bytes: int
    max_ranges: int
    max_message_bytes: int
    def __init__(self, max_live_sessions: _Optional[int] = ..., default_lease_ms: _Optional[int] = ..., max_lease_ms: _Optional[int] = ..., tombstone_retention_ms: _Optional[int] = ..., max_tombstones: _Optional[int] = ..., max_field_bytes: _Optional[int] = ..., max_ranges: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class KvConnectorInfo(_message.Message):
    __slots__ = ("supported_styles", "default_style", "caller_allocation", "renewable_leases", "explicit_release", "conditional_bypass", "session_lookup", "local_prefill", "limits", "schema_version", "incarnation", "endpoint", "epoch")
    SUPPORTED_STYLES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STYLE_FIELD_NUMBER: _ClassVar[int]
    CALLER_ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    RENEWABLE_LEASES_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_RELEASE_FIELD_NUMBER: _ClassVar[int]
    CONDITIONAL_BYPASS_FIELD_NUMBER: _ClassVar[int]
    SESSION_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    supported_styles: _containers.RepeatedScalarFieldContainer[KvScheduleStyle]
    default_style: KvScheduleStyle
    caller_allocation: bool
    renewable_leases: bool
    explicit_release: bool
    conditional_bypass: bool
    session_lookup: bool
    local_prefill: bool
    limits: KvLimits
    schema_version: int
    incarnation: str
    endpoint: str
    epoch: int
    def __init__(self, supported_styles: _Optional[_Iterable[_Union[KvScheduleStyle, str]]] = ..., default_style: _Optional[_Union[KvScheduleStyle, str]] = ..., caller_allocation: bool = ..., renewable_leases: bool = ..., explicit_release: bool = ..., conditional_bypass: bool = ..., session_lookup: bool = ..., local_prefill: bool = ..., limits: _Optional[_Union[KvLimits, _Mapping]] = ..., schema_version: _Optional[int] = ..., incarnation: _Optional[str] = ..., endpoint: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class GetKvSessionStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvSessionStats(_message.Message):
    __slots__ = ("incarnation", "draining", "live_sessions", "tombstones", "awaiting_cleanup", "pinned_ranges", "tracked_transfers", "engine_executions", "sessions_expired", "reaper_ticks", "kv_regions")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    AWAITING_CLEANUP_FIELD_NUMBER: _ClassVar[int]
    PINNED_RANGES_FIELD_NUMBER: _ClassVar[int]
    TRACKED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    REAPER_TICKS_FIELD_NUMBER: _ClassVar[int]
    KV_REGIONS_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    draining: bool
    live_sessions: int
    tombstones: int
    awaiting_cleanup: int
    pinned_ranges: int
    tracked_transfers: int
    engine_executions: int
    sessions_expired: int
    reaper_ticks: int
    kv_regions: _containers.RepeatedCompositeFieldContainer[KvRange]
    def __init__(self, incarnation: _Optional[str] = ..., draining: bool = ..., live_sessions: _Optional[int] = ..., tombstones: _Optional[int] = ..., awaiting_cleanup: _Optional[int] = ..., pinned_ranges: _Optional[int] = ..., tracked_transfers: _Optional[int] = ..., engine_executions: _Optional[int] = ..., sessions_expired: _Optional[int] = ..., reaper_ticks: _Optional[int] = ..., kv_regions: _Optional[_Iterable[_Union[KvRange, _Mapping]]] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class EchoResponse(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...
