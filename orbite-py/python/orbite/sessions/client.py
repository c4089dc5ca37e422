# SPDX-License-Identifier: Apache-2.0
"""Clients of the KV session service `orbite.kv.v1.OpenEngineKv`
(proto/orbite/kv/v1/kv_session.proto, semantics in docs/api.md), as served
by `orbite serve` or any engine that embeds the service.

`SessionsClient` is synchronous (thread-safe: one channel, calls from any
thread); `AsyncSessionsClient` has the same methods as coroutines over
`grpc.aio`. Every method is one RPC: it takes the request's fields as
keyword arguments (the session id may be positional), returns the response
message (`KvSession` for most) and raises a `SessionError` subclass when the
service refuses (see `orbite.sessions.errors`). A refused call changed
nothing. Enumerations may be given as the enums below, their int values or
their names (`"context_first"`, `"CONCURRENT"`, `"ContextFirst"`).
"""

from __future__ import annotations

import enum
import re
import time
from typing import (
    Any,
    Callable,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
    Union,
    cast,
)

import grpc
import grpc.aio

from ._pb import kv_session_pb2 as pb
from ._pb import kv_session_pb2_grpc as pb_grpc
from .errors import from_rpc_error

# The generated stubs are untyped: their calls return the response messages.
_KvStub: Callable[[Any], Any] = pb_grpc.OpenEngineKvStub
_DiagStub: Callable[[Any], Any] = pb_grpc.OrbiteDiagnosticsStub

__all__ = [
    "SessionsClient",
    "AsyncSessionsClient",
    "ScheduleStyle",
    "TransferDisposition",
    "SessionState",
    "DEFAULT_TIMEOUT",
]

#: Seconds a call may take unless the client or the call says otherwise.
DEFAULT_TIMEOUT = 10.0


class ScheduleStyle(enum.IntEnum):
    """How producer and consumer start (`KvScheduleStyle`)."""

    #: The service's default (`KvConnectorInfo.default_style`).
    UNSPECIFIED = 0
    #: The producer computes first; the consumer attaches once ready.
    CONTEXT_FIRST = 1
    #: The consumer allocates and may queue; the producer fills later.
    GENERATION_FIRST = 2
    #: Both start at once on one session.
    CONCURRENT = 3


class TransferDisposition(enum.IntEnum):
    """Whether the consumer needs the producer's KV (`KvTransferDisposition`)."""

    #: Treated as REQUIRED.
    UNSPECIFIED = 0
    REQUIRED = 1
    #: The consumer may go on without it (conditional bypass).
    BYPASS = 2


class SessionState(enum.IntEnum):
    """Where a session stands (`KvSessionState`); COMPLETE and every later
    value are terminal."""

    UNSPECIFIED = 0
    ALLOCATED = 1
    READY = 2
    ATTACHED = 3
    COMPLETE = 4
    BYPASSED = 5
    REJECTED = 6
    CANCELLED = 7
    FAILED = 8
    RELEASED = 9
    EXPIRED = 10

    @property
    def is_terminal(self) -> bool:
        """The session has ended (COMPLETE or later)."""
        return self >= SessionState.COMPLETE


_E = TypeVar("_E", bound=enum.IntEnum)
_R = TypeVar("_R")

#: An enum value: the enum member, its int value, or its name.
StyleLike = Union[ScheduleStyle, int, str]
DispositionLike = Union[TransferDisposition, int, str]
#: `KvTransferMeta`, or a mapping of its fields (layout, block_bytes, blocks).
MetaLike = Union[pb.KvTransferMeta, Mapping[str, Any]]
#: `KvRange`, or a `(registration, offset, len)` tuple.
RangeLike = Union[pb.KvRange, Tuple[int, int, int]]
Metadata = Sequence[Tuple[str, Union[str, bytes]]]

_PREFIXES = {
    ScheduleStyle: "KV_SCHEDULE_STYLE_",
    TransferDisposition: "KV_TRANSFER_DISPOSITION_",
    SessionState: "KV_SESSION_STATE_",
}


def _enum(value: Union[_E, int, str], cls: Type[_E]) -> int:
    """The wire value of an enum given as a member, an int (passed through,
    so that the service judges unknown values) or a name."""
    if isinstance(value, str):
        name = value.strip().replace("-", "_")
        if "_" not in name and name != name.upper():
            name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)  # ContextFirst
        name = name.upper()
        prefix = _PREFIXES.get(cls, "")
        if prefix and name.startswith(prefix):
            name = name[len(prefix):]
        try:
            return int(cls[name])
        except KeyError:
            names = ", ".join(m.name.lower() for m in cls)
            raise ValueError(f"unknown {cls.__name__} {value!r} (one of {names})") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{cls.__name__}: want a member, an int or a name, got {value!r}")
    return int(value)


def _meta(meta: Optional[MetaLike]) -> Optional[pb.KvTransferMeta]:
    if meta is None:
        return None
    if isinstance(meta, pb.KvTransferMeta):
        return meta
    if isinstance(meta, Mapping):
        return pb.KvTransferMeta(**meta)
    raise TypeError(f"meta: want a KvTransferMeta or a mapping, got {type(meta).__name__}")


def _range(r: RangeLike) -> pb.KvRange:
    if isinstance(r, pb.KvRange):
        return r
    registration, offset, length = r
    return pb.KvRange(registration=registration, offset=offset, len=length)


# ------------------------------------------------------------------ requests


def _allocate_req(
    request_id: str,
    model: str,
    idempotency_key: str,
    meta: Optional[MetaLike],
    style: StyleLike,
    disposition: DispositionLike,
    lease_ms: Optional[int],
) -> pb.AllocateKvSessionRequest:
    req = pb.AllocateKvSessionRequest(
        request_id=request_id,
        model=model,
        idempotency_key=idempotency_key,
        style=cast("pb.KvScheduleStyle", _enum(style, ScheduleStyle)),
        disposition=cast("pb.KvTransferDisposition", _enum(disposition, TransferDisposition)),
    )
    if lease_ms is not None:
        req.lease_ms = lease_ms
    m = _meta(meta)
    if m is not None:
        req.meta.CopyFrom(m)
    return req


def _renew_req(session_id: str, lease_ms: Optional[int]) -> pb.RenewKvSessionRequest:
    req = pb.RenewKvSessionRequest(session_id=session_id)
    if lease_ms is not None:
        req.lease_ms = lease_ms
    return req


def _ready_req(
    session_id: str, ranges: Iterable[RangeLike], meta: Optional[MetaLike]
) -> pb.MarkKvSessionReadyRequest:
    req = pb.MarkKvSessionReadyRequest(session_id=session_id)
    req.ranges.extend(_range(r) for r in ranges)
    m = _meta(meta)
    if m is not None:
        req.meta.CopyFrom(m)
    return req


def _attach_req(session_id: str, meta: Optional[MetaLike]) -> pb.AttachKvSessionRequest:
    req = pb.AttachKvSessionRequest(session_id=session_id)
    m = _meta(meta)
    if m is not None:
        req.meta.CopyFrom(m)
    return req


def _sessionless_req(disposition: DispositionLike) -> pb.CheckSessionlessDecodeRequest:
    value = _enum(disposition, TransferDisposition)
    return pb.CheckSessionlessDecodeRequest(disposition=cast("pb.KvTransferDisposition", value))


def _drain_req(timeout_ms: Optional[int], abort_remaining: bool) -> pb.DrainKvSessionsRequest:
    req = pb.DrainKvSessionsRequest(abort_remaining=abort_remaining)
    if timeout_ms is not None:
        req.timeout_ms = timeout_ms
    return req


def _passed(start: float, deadline: Optional[float]) -> bool:
    """The call that started at `start` (monotonic) ran out its deadline
    (within 1 %: the server's timer may fire a hair early)."""
    return deadline is not None and time.monotonic() - start >= deadline * 0.99


class _Base:
    """What both clients share: the target, the default timeout, the
    metadata sent with every call."""

    _target: str
    _timeout: Optional[float]
    _metadata: Optional[Tuple[Tuple[str, Union[str, bytes]], ...]]

    def _setup(self, target: Any, timeout: Optional[float], metadata: Optional[Metadata]) -> None:
        self._target = target if isinstance(target, str) else repr(target)
        self._timeout = timeout
        self._metadata = tuple((k, v) for k, v in metadata) if metadata else None

    @property
    def target(self) -> str:
        """The address this client talks to (`host:port` or a gRPC URI)."""
        return self._target

    @property
    def timeout(self) -> Optional[float]:
        """The default per-call timeout in seconds (None: no deadline)."""
        return self._timeout

    def _deadline(self, timeout: Optional[float]) -> Optional[float]:
        return self._timeout if timeout is None else timeout

    def _drain_deadline(
        self, timeout: Optional[float], timeout_ms: Optional[int], abort_remaining: bool
    ) -> Optional[float]:
        # The service waits up to timeout_ms, and as long again for aborted
        # work to retire: the call's deadline must outlast that.
        if timeout is not None or self._timeout is None:
            return self._deadline(timeout)
        wait = max(timeout_ms or 0, 0) / 1000.0
        return self._timeout + wait * (2 if abort_remaining else 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._target!r})"


def _channel_options(options: Optional[Sequence[Tuple[str, Any]]]) -> List[Tuple[str, Any]]:
    return list(options) if options else []


class SessionsClient(_Base):
    """A synchronous client of the KV session service.

        with SessionsClient("127.0.0.1:50051") as c:
            s = c.allocate(request_id="r1", model="m", idempotency_key="k1",
                           meta={"layout": "m/fp16", "block_bytes": 4096, "blocks": 4})
            c.release(s.session_id)

    Args:
        target: `host:port` (or any gRPC target URI), or a `grpc.Channel`
            to use (the client then does not close it).
        timeout: seconds each call may take unless the call says otherwise;
            None for no deadline.
        metadata: `(key, value)` pairs sent with every call (e.g. auth).
        credentials: TLS credentials (`grpc.ssl_channel_credentials()`);
            None for a plaintext channel.
        options: gRPC channel options, e.g.
            `[("grpc.max_receive_message_length", 16 << 20)]`.

    Every method raises a `SessionError` subclass when the call fails.
    """

    def __init__(
        self,
        target: Union[str, grpc.Channel],
        timeout: Optional[float] = DEFAULT_TIMEOUT,
        metadata: Optional[Metadata] = None,
        *,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Optional[Sequence[Tuple[str, Any]]] = None,
    ) -> None:
        self._setup(target, timeout, metadata)
        if isinstance(target, str):
            opts = _channel_options(options)
            if credentials is None:
                self._channel = grpc.insecure_channel(target, options=opts)
            else:
                self._channel = grpc.secure_channel(target, credentials, options=opts)
            self._owned = True
        else:
            self._channel = target
            self._owned = False
        self._kv = _KvStub(self._channel)
        self._diag = _DiagStub(self._channel)

    # -- plumbing
    @property
    def channel(self) -> grpc.Channel:
        """The underlying gRPC channel."""
        return self._channel

    def close(self) -> None:
        """Closes the channel (unless it was handed in); idempotent."""
        if self._owned:
            self._channel.close()

    def __enter__(self) -> "SessionsClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(
        self, method: str, request: Any, response: Type[_R], timeout: Optional[float]
    ) -> _R:
        """Calls `method` (of OpenEngineKv, or Echo) with the client's
        metadata, `timeout` or the client's; maps a failure to its
        SessionError."""
        stub = self._diag if method == "Echo" else self._kv
        deadline = self._deadline(timeout)
        start = time.monotonic()
        try:
            out = getattr(stub, method)(request, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, _passed(start, deadline)) from None
        assert isinstance(out, response)
        return out

    # -- lifecycle
    def allocate(
        self,
        *,
        request_id: str,
        model: str,
        idempotency_key: str,
        meta: MetaLike,
        style: StyleLike = ScheduleStyle.UNSPECIFIED,
        disposition: DispositionLike = TransferDisposition.REQUIRED,
        lease_ms: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> pb.KvSession:
        """Allocates a session (`AllocateKvSession`), state ALLOCATED.

        Retrying with the same `idempotency_key` and identical fields
        returns the same session, in whatever state it is now (also after
        it ended, while its tombstone is kept): retry with the same key
        after a timeout or a lost connection. The same key with other
        fields raises `AlreadyExists` (`IDEMPOTENCY_CONFLICT`).

        Args:
            request_id: the inference request this session serves.
            model: the model name.
            idempotency_key: unique per intended allocation (e.g. a UUID).
            meta: the KV's shape (`layout`, `block_bytes`, `blocks`); both
                participants must give the same.
            style: the schedule style; UNSPECIFIED takes the service's
                default (see `KvSession.effective_style`).
            disposition: REQUIRED, or BYPASS if the consumer may go on
                without the KV.
            lease_ms: the lease; None for the service's default.
            timeout: this call's timeout in seconds (None: the client's).

        Raises:
            InvalidArgument, AlreadyExists, FailedPrecondition (unsupported
            style, bypass or capability), Unavailable (`DRAINING`),
            SessionsExhausted (`TOO_MANY_SESSIONS`).
        """
        req = _allocate_req(request_id, model, idempotency_key, meta, style, disposition, lease_ms)
        return self._call("AllocateKvSession", req, pb.KvSession, timeout)

    def get(self, session_id: str, *, timeout: Optional[float] = None) -> pb.KvSession:
        """The session (`GetKvSession`): live, or a tombstone within its
        retention. Raises `NotFound` for an unknown or forgotten id."""
        req = pb.GetKvSessionRequest(session_id=session_id)
        return self._call("GetKvSession", req, pb.KvSession, timeout)

    def renew(
        self, session_id: str, *, lease_ms: Optional[int] = None, timeout: Optional[float] = None
    ) -> pb.KvSession:
        """Sets a live session's expiry to now + `lease_ms` (None: the
        default lease) (`RenewKvSession`); it may shorten the lease. Raises
        `FailedPrecondition` (`SESSION_ENDED`) once the session ended."""
        req = _renew_req(session_id, lease_ms)
        return self._call("RenewKvSession", req, pb.KvSession, timeout)

    def release(
        self, session_id: str, *, timeout: Optional[float] = None
    ) -> pb.ReleaseKvSessionResponse:
        """Relinquishes the session's transfer resources
        (`ReleaseKvSession`): RELEASED if it was live. Idempotent: on an
        ended session it returns its final state with `released_now`
        false."""
        req = pb.ReleaseKvSessionRequest(session_id=session_id)
        return self._call("ReleaseKvSession", req, pb.ReleaseKvSessionResponse, timeout)

    def abort(self, session_id: str, *, timeout: Optional[float] = None) -> pb.KvSession:
        """Stops the session's work (`AbortKvSession`): CANCELLED if it was
        live; an ended session is returned unchanged."""
        req = pb.AbortKvSessionRequest(session_id=session_id)
        return self._call("AbortKvSession", req, pb.KvSession, timeout)

    # -- participants
    def mark_ready(
        self,
        session_id: str,
        *,
        ranges: Iterable[RangeLike],
        meta: MetaLike,
        timeout: Optional[float] = None,
    ) -> pb.KvSession:
        """The producer's KV is ready (`MarkKvSessionReady`): the service
        pins `ranges` (of registrations in its engine; together exactly
        `block_bytes * blocks` bytes) and the session becomes READY, its
        `rendezvous.ranges` set.

        Args:
            ranges: `KvRange`s or `(registration, offset, len)` tuples.
            meta: must equal the session's.

        Raises:
            InvalidArgument (`INCOMPATIBLE_METADATA`, `TOO_MANY_RANGES`),
            FailedPrecondition (`WRONG_STATE`, `SESSION_ENDED`,
            `ENGINE_REFUSED`).
        """
        req = _ready_req(session_id, ranges, meta)
        return self._call("MarkKvSessionReady", req, pb.KvSession, timeout)

    def attach(
        self, session_id: str, *, meta: MetaLike, timeout: Optional[float] = None
    ) -> pb.AttachKvSessionResponse:
        """The consumer attaches (`AttachKvSession`): `.session` ATTACHED
        with the ranges to read, or, before the KV is ready in a
        generation-first or concurrent session, `.queued` true (not a
        failure: renew meanwhile and attach again once ready).

        Raises:
            Unavailable (`NOT_READY`): context-first before READY; retry.
            InvalidArgument (`INCOMPATIBLE_METADATA`), FailedPrecondition
            (`SESSION_ENDED`).
        """
        req = _attach_req(session_id, meta)
        return self._call("AttachKvSession", req, pb.AttachKvSessionResponse, timeout)

    def complete(self, session_id: str, *, timeout: Optional[float] = None) -> pb.KvSession:
        """The consumer has what it needs (`CompleteKvSession`): COMPLETE.
        Raises `FailedPrecondition` (`WRONG_STATE`) before ATTACHED."""
        req = pb.CompleteKvSessionRequest(session_id=session_id)
        return self._call("CompleteKvSession", req, pb.KvSession, timeout)

    def bypass(self, session_id: str, *, timeout: Optional[float] = None) -> pb.KvSession:
        """The consumer goes on without the KV (`BypassKvSession`):
        BYPASSED. Needs disposition BYPASS, else `FailedPrecondition`
        (`WRONG_STATE`)."""
        req = pb.BypassKvSessionRequest(session_id=session_id)
        return self._call("BypassKvSession", req, pb.KvSession, timeout)

    def reject(
        self, session_id: str, *, reason: str = "", timeout: Optional[float] = None
    ) -> pb.KvSession:
        """Either participant refuses the session (`RejectKvSession`):
        REJECTED, with `reason` (empty: none)."""
        req = pb.RejectKvSessionRequest(session_id=session_id, reason=reason)
        return self._call("RejectKvSession", req, pb.KvSession, timeout)

    def fail(
        self, session_id: str, *, reason: str = "", timeout: Optional[float] = None
    ) -> pb.KvSession:
        """A transfer failed or a peer was lost (`FailKvSession`): FAILED,
        with `reason` (empty: none)."""
        req = pb.FailKvSessionRequest(session_id=session_id, reason=reason)
        return self._call("FailKvSession", req, pb.KvSession, timeout)

    def check_sessionless_decode(
        self,
        *,
        disposition: DispositionLike = TransferDisposition.REQUIRED,
        timeout: Optional[float] = None,
    ) -> None:
        """Returns if a decode may run without any session
        (`CheckSessionlessDecode`): disposition BYPASS where conditional
        bypass is advertised, or a service with local prefill. Otherwise
        raises `FailedPrecondition` (`SESSION_REQUIRED`)."""
        req = _sessionless_req(disposition)
        self._call("CheckSessionlessDecode", req, pb.CheckSessionlessDecodeResponse, timeout)

    # -- operator
    def drain(
        self,
        *,
        timeout_ms: Optional[int] = None,
        abort_remaining: bool = False,
        timeout: Optional[float] = None,
    ) -> pb.DrainKvSessionsResponse:
        """Stops new allocations for good (`DrainKvSessions`); with
        `timeout_ms` waits that long for live sessions to end, with
        `abort_remaining` then aborts the rest and waits as long again for
        their work to retire. `.drained` says whether nothing is left (no
        live session, nothing pinned or tracked, every ended session
        cleaned up). Without `timeout`, the call's deadline is the client's
        timeout plus those waits."""
        req = _drain_req(timeout_ms, abort_remaining)
        deadline = self._drain_deadline(timeout, timeout_ms, abort_remaining)
        return self._call("DrainKvSessions", req, pb.DrainKvSessionsResponse, deadline)

    def connector_info(self, *, timeout: Optional[float] = None) -> pb.KvConnectorInfo:
        """What the service supports (`GetKvConnectorInfo`): styles,
        capabilities, limits, schema version, incarnation, engine endpoint
        and epoch. Check it before sending traffic."""
        req = pb.GetKvConnectorInfoRequest()
        return self._call("GetKvConnectorInfo", req, pb.KvConnectorInfo, timeout)

    def stats(self, *, timeout: Optional[float] = None) -> pb.KvSessionStats:
        """What the service holds now (`GetKvSessionStats`): live sessions,
        tombstones, pinned ranges, tracked transfers, and `kv_regions`, the
        memory producers may mark ready."""
        req = pb.GetKvSessionStatsRequest()
        return self._call("GetKvSessionStats", req, pb.KvSessionStats, timeout)

    def echo(self, payload: bytes = b"", *, timeout: Optional[float] = None) -> bytes:
        """`OrbiteDiagnostics.Echo`: the payload back (a liveness probe)."""
        req = pb.EchoRequest(payload=payload)
        return self._call("Echo", req, pb.EchoResponse, timeout).payload


class AsyncSessionsClient(_Base):
    """The asyncio client of the KV session service (`grpc.aio`): the
    methods of `SessionsClient`, as coroutines.

        async with AsyncSessionsClient("127.0.0.1:50051") as c:
            info = await c.connector_info()

    The channel opens at the first call (so in the running event loop);
    `await close()` (or leaving `async with`) closes it. The arguments are
    those of `SessionsClient`; `target` may be a `grpc.aio.Channel`.
    """

    def __init__(
        self,
        target: Union[str, grpc.aio.Channel],
        timeout: Optional[float] = DEFAULT_TIMEOUT,
        metadata: Optional[Metadata] = None,
        *,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Optional[Sequence[Tuple[str, Any]]] = None,
    ) -> None:
        self._setup(target, timeout, metadata)
        self._credentials = credentials
        self._options = _channel_options(options)
        self._channel: Optional[grpc.aio.Channel] = None
        self._owned = isinstance(target, str)
        self._kv: Any = None
        self._diag: Any = None
        if not isinstance(target, str):
            self._open(target)

    def _open(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self._kv = _KvStub(channel)
        self._diag = _DiagStub(channel)

    def _ensure(self) -> None:
        if self._channel is None:
            if self._credentials is None:
                ch = grpc.aio.insecure_channel(self._target, options=self._options)
            else:
                ch = grpc.aio.secure_channel(self._target, self._credentials, options=self._options)
            self._open(ch)

    @property
    def channel(self) -> grpc.aio.Channel:
        """The underlying `grpc.aio` channel (opened now if need be)."""
        self._ensure()
        assert self._channel is not None
        return self._channel

    async def close(self) -> None:
        """Closes the channel (unless it was handed in); idempotent. A
        later call opens a new one."""
        if self._owned and self._channel is not None:
            ch, self._channel = self._channel, None
            self._kv = self._diag = None
            await ch.close()

    async def __aenter__(self) -> "AsyncSessionsClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _call(
        self, method: str, request: Any, response: Type[_R], timeout: Optional[float]
    ) -> _R:
        """Awaits `method` (of OpenEngineKv, or Echo); see
        `SessionsClient._call`."""
        self._ensure()
        stub = self._diag if method == "Echo" else self._kv
        deadline = self._deadline(timeout)
        start = time.monotonic()
        try:
            out = await getattr(stub, method)(request, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, _passed(start, deadline)) from None
        assert isinstance(out, response)
        return out

    # -- lifecycle
    async def allocate(
        self,
        *,
        request_id: str,
        model: str,
        idempotency_key: str,
        meta: MetaLike,
        style: StyleLike = ScheduleStyle.UNSPECIFIED,
        disposition: DispositionLike = TransferDisposition.REQUIRED,
        lease_ms: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> pb.KvSession:
        """Allocates a session; see `SessionsClient.allocate`."""
        req = _allocate_req(request_id, model, idempotency_key, meta, style, disposition, lease_ms)
        return await self._call("AllocateKvSession", req, pb.KvSession, timeout)

    async def get(self, session_id: str, *, timeout: Optional[float] = None) -> pb.KvSession:
        """The session, live or a tombstone; see `SessionsClient.get`."""
        req = pb.GetKvSessionRequest(session_id=session_id)
        return await self._call("GetKvSession", req, pb.KvSession, timeout)

    async def renew(
        self, session_id: str, *, lease_ms: Optional[int] = None, timeout: Optional[float] = None
    ) -> pb.KvSession:
        """Renews the lease; see `SessionsClient.renew`."""
        req = _renew_req(session_id, lease_ms)
        return await self._call("RenewKvSession", req, pb.KvSession, timeout)

    async def release(
        self, session_id: str, *, timeout: Optional[float] = None
    ) -> pb.ReleaseKvSessionResponse:
        """Releases the session (idempotent); see `SessionsClient.release`."""
        req = pb.ReleaseKvSessionRequest(session_id=session_id)
        return await self._call("ReleaseKvSession", req, pb.ReleaseKvSessionResponse, timeout)

    async def abort(self, session_id: str, *, timeout: Optional[float] = None) -> pb.KvSession:
        """Aborts the session; see `SessionsClient.abort`."""
        req = pb.AbortKvSessionRequest(session_id=session_id)
        return await self._call("AbortKvSession", req, pb.KvSession, timeout)

    # -- participants
    async def mark_ready(
        self,
        session_id: str,
        *,
        ranges: Iterable[RangeLike],
        meta: MetaLike,
        timeout: Optional[float] = None,
    ) -> pb.KvSession:
        """Pins the producer's ranges; see `SessionsClient.mark_ready`."""
        req = _ready_req(session_id, ranges, meta)
        return await self._call("MarkKvSessionReady", req, pb.KvSession, timeout)

    async def attach(
        self, session_id: str, *, meta: MetaLike, timeout: Optional[float] = None
    ) -> pb.AttachKvSessionResponse:
        """Attaches the consumer (or queues it); see `SessionsClient.attach`."""
        req = _attach_req(session_id, meta)
        return await self._call("AttachKvSession", req, pb.AttachKvSessionResponse, timeout)

    async def complete(self, session_id: str, *, timeout: Optional[float] = None) -> pb.KvSession:
        """COMPLETE; see `SessionsClient.complete`."""
        req = pb.CompleteKvSessionRequest(session_id=session_id)
        return await self._call("CompleteKvSession", req, pb.KvSession, timeout)

    async def bypass(self, session_id: str, *, timeout: Optional[float] = None) -> pb.KvSession:
        """BYPASSED; see `SessionsClient.bypass`."""
        req = pb.BypassKvSessionRequest(session_id=session_id)
        return await self._call("BypassKvSession", req, pb.KvSession, timeout)

    async def reject(
        self, session_id: str, *, reason: str = "", timeout: Optional[float] = None
    ) -> pb.KvSession:
        """REJECTED; see `SessionsClient.reject`."""
        req = pb.RejectKvSessionRequest(session_id=session_id, reason=reason)
        return await self._call("RejectKvSession", req, pb.KvSession, timeout)

    async def fail(
        self, session_id: str, *, reason: str = "", timeout: Optional[float] = None
    ) -> pb.KvSession:
        """FAILED; see `SessionsClient.fail`."""
        req = pb.FailKvSessionRequest(session_id=session_id, reason=reason)
        return await self._call("FailKvSession", req, pb.KvSession, timeout)

    async def check_sessionless_decode(
        self,
        *,
        disposition: DispositionLike = TransferDisposition.REQUIRED,
        timeout: Optional[float] = None,
    ) -> None:
        """Whether a decode may run without a session; see
        `SessionsClient.check_sessionless_decode`."""
        req = _sessionless_req(disposition)
        await self._call("CheckSessionlessDecode", req, pb.CheckSessionlessDecodeResponse, timeout)

    # -- operator
    async def drain(
        self,
        *,
        timeout_ms: Optional[int] = None,
        abort_remaining: bool = False,
        timeout: Optional[float] = None,
    ) -> pb.DrainKvSessionsResponse:
        """Drains the service; see `SessionsClient.drain`."""
        req = _drain_req(timeout_ms, abort_remaining)
        deadline = self._drain_deadline(timeout, timeout_ms, abort_remaining)
        return await self._call("DrainKvSessions", req, pb.DrainKvSessionsResponse, deadline)

    async def connector_info(self, *, timeout: Optional[float] = None) -> pb.KvConnectorInfo:
        """Capabilities and limits; see `SessionsClient.connector_info`."""
        req = pb.GetKvConnectorInfoRequest()
        return await self._call("GetKvConnectorInfo", req, pb.KvConnectorInfo, timeout)

    async def stats(self, *, timeout: Optional[float] = None) -> pb.KvSessionStats:
        """What the service holds; see `SessionsClient.stats`."""
        req = pb.GetKvSessionStatsRequest()
        return await self._call("GetKvSessionStats", req, pb.KvSessionStats, timeout)

    async def echo(self, payload: bytes = b"", *, timeout: Optional[float] = None) -> bytes:
        """`OrbiteDiagnostics.Echo`; see `SessionsClient.echo`."""
        req = pb.EchoRequest(payload=payload)
        resp = await self._call("Echo", req, pb.EchoResponse, timeout)
        return resp.payload
