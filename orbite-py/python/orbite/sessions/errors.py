# SPDX-License-Identifier: Apache-2.0
"""Errors of the KV session client: one class per gRPC status code that the
service answers, all under `SessionError` (itself an `orbite.OrbiteError`).

The service sends every refusal with one `google.rpc.ErrorInfo` in the
status details (domain `orbite.kv.v1`, a reason such as `SESSION_NOT_FOUND`
or `NOT_READY`, metadata naming the session, state or field; docs/api.md
has the table). The error carries it as `reason`, `domain` and `metadata`,
decoded here without needing googleapis-common-protos; `status_details` is
the raw `google.rpc.Status` for whoever wants the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type

import grpc

from orbite import OrbiteError, ResourceExhausted

__all__ = [
    "SessionError",
    "InvalidArgument",
    "NotFound",
    "AlreadyExists",
    "FailedPrecondition",
    "SessionsExhausted",
    "Unavailable",
    "DeadlineExceeded",
    "ErrorInfo",
    "DOMAIN",
]

#: The `ErrorInfo.domain` of every refusal of the session service.
DOMAIN = "orbite.kv.v1"

_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_ERROR_INFO_TYPE = "type.googleapis.com/google.rpc.ErrorInfo"


@dataclass(frozen=True)
class ErrorInfo:
    """A `google.rpc.ErrorInfo` status detail: why the call was refused."""

    #: The refusal, e.g. `SESSION_NOT_FOUND`, `WRONG_STATE`, `NOT_READY`.
    reason: str
    #: `orbite.kv.v1` for the session service.
    domain: str
    #: What the refusal names, e.g. `{"session_id": ..., "state": ...}`.
    metadata: Dict[str, str] = field(default_factory=dict)


class SessionError(OrbiteError):
    """A call of the KV session service failed.

    Attributes:
        code: the gRPC status code (`grpc.StatusCode`).
        details: the status message (the service's error text).
        reason: the `ErrorInfo` reason (e.g. `SESSION_NOT_FOUND`), or None
            when the status carried none (transport errors, deadlines).
        domain: the `ErrorInfo` domain (`orbite.kv.v1`), or None.
        metadata: the `ErrorInfo` metadata (empty when there is none).
        error_info: the `ErrorInfo` as a whole, or None.
        status_details: the raw `grpc-status-details-bin` trailer (a
            serialized `google.rpc.Status`), or None.

    The service changed nothing for a refused call (docs/api.md).
    """

    code: grpc.StatusCode
    details: str
    error_info: Optional[ErrorInfo]
    status_details: Optional[bytes]

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str = "",
        error_info: Optional[ErrorInfo] = None,
        status_details: Optional[bytes] = None,
    ) -> None:
        self.code = code
        self.details = details
        self.error_info = error_info
        self.status_details = status_details
        super().__init__(_message(code, details, error_info))

    @property
    def reason(self) -> Optional[str]:
        """The `ErrorInfo` reason, or None."""
        return self.error_info.reason if self.error_info is not None else None

    @property
    def domain(self) -> Optional[str]:
        """The `ErrorInfo` domain, or None."""
        return self.error_info.domain if self.error_info is not None else None

    @property
    def metadata(self) -> Dict[str, str]:
        """The `ErrorInfo` metadata (a copy; empty without an ErrorInfo)."""
        return dict(self.error_info.metadata) if self.error_info is not None else {}

    def __reduce__(self) -> Tuple[Any, ...]:
        return (type(self), (self.code, self.details, self.error_info, self.status_details))


class InvalidArgument(SessionError):
    """INVALID_ARGUMENT: the request is wrong (a missing or too long field,
    an unknown enum value, a bad lease, metadata that differs from the
    session's, too many ranges, an undecodable message). Fix the request."""


class NotFound(SessionError):
    """NOT_FOUND: no such session (`SESSION_NOT_FOUND`: never existed or its
    tombstone was forgotten), or an id of another incarnation of the service
    (`OTHER_INCARNATION`: it restarted since)."""


class AlreadyExists(SessionError):
    """ALREADY_EXISTS: the idempotency key belongs to a session allocated
    with other fields (`IDEMPOTENCY_CONFLICT`)."""


class FailedPrecondition(SessionError):
    """FAILED_PRECONDITION: the operation does not apply now or here: the
    session ended (`SESSION_ENDED`), the wrong state (`WRONG_STATE`), an
    unsupported style or capability, a sessionless decode refused
    (`SESSION_REQUIRED`), the engine refused the ranges (`ENGINE_REFUSED`)."""


class SessionsExhausted(SessionError, ResourceExhausted):
    """RESOURCE_EXHAUSTED: `max_live_sessions` sessions are live
    (`TOO_MANY_SESSIONS`); retry later. Also an `orbite.ResourceExhausted`."""


class Unavailable(SessionError):
    """UNAVAILABLE: the service is unreachable (no `reason`), draining
    (`DRAINING`: allocate elsewhere), or the KV is not ready yet for a
    context-first attach (`NOT_READY`: retry once ready, renew meanwhile)."""


class DeadlineExceeded(SessionError):
    """DEADLINE_EXCEEDED: no answer within the call's timeout. The call may
    still have taken effect: retry it (allocate with the same idempotency
    key)."""


_BY_CODE: Dict[grpc.StatusCode, Type[SessionError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: SessionsExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def _message(code: grpc.StatusCode, details: str, info: Optional[ErrorInfo]) -> str:
    text = details or code.name
    tag = code.name if info is None else f"{code.name} {info.reason}"
    if info is not None and info.metadata:
        tag += " " + ", ".join(f"{k}={v}" for k, v in sorted(info.metadata.items()))
    return f"{text} [{tag}]"


def from_rpc_error(err: grpc.RpcError, deadline_passed: bool = False) -> SessionError:
    """The `SessionError` subclass for a failed call (a `grpc.RpcError` of a
    sync call or a `grpc.aio.AioRpcError`), with its ErrorInfo if sent.

    `deadline_passed`: the call's deadline has run out. A tonic server
    answers CANCELLED ("Timeout expired") when the deadline it was sent runs
    out before the client's own timer fires; that is DeadlineExceeded."""
    code = _call(err, "code") or grpc.StatusCode.UNKNOWN
    if code == grpc.StatusCode.CANCELLED and deadline_passed:
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    details = _call(err, "details") or ""
    raw = None
    for key, value in _call(err, "trailing_metadata") or ():
        if key == _STATUS_DETAILS_KEY and isinstance(value, bytes):
            raw = value
    info = _error_info(raw) if raw is not None else None
    cls = _BY_CODE.get(code, SessionError)
    return cls(code, details, info, raw)


def _call(err: Any, name: str) -> Any:
    fn = getattr(err, name, None)
    if fn is None:
        return None
    try:
        return fn()
    except Exception:  # a half-formed error object: no such field
        return None


# ------------------------------------------------------------------------
# A minimal reader of the protobuf wire format, for google.rpc.Status
# { int32 code = 1; string message = 2; repeated google.protobuf.Any
# details = 3; } and google.rpc.ErrorInfo { string reason = 1; string
# domain = 2; map<string, string> metadata = 3; }: enough to read the
# ErrorInfo without depending on googleapis-common-protos.


def _varint(buf: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[Tuple[int, Any]]:
    """(field number, value) pairs: ints for varints, bytes for
    length-delimited fields; fixed-width fields are skipped."""
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        num, wire = tag >> 3, tag & 7
        if wire == 0:
            v, pos = _varint(buf, pos)
            yield num, v
        elif wire == 2:
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                raise ValueError("truncated field")
            yield num, buf[pos:pos + n]
            pos += n
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if pos != len(buf):
        raise ValueError("truncated field")


def _error_info(status: bytes) -> Optional[ErrorInfo]:
    """The first ErrorInfo in a serialized google.rpc.Status, or None (also
    when it does not decode)."""
    try:
        for num, any_bytes in _fields(status):
            if num != 3 or not isinstance(any_bytes, bytes):
                continue
            type_url, value = "", b""
            for n, v in _fields(any_bytes):
                if n == 1 and isinstance(v, bytes):
                    type_url = v.decode("utf-8")
                elif n == 2 and isinstance(v, bytes):
                    value = v
            if type_url != _ERROR_INFO_TYPE:
                continue
            reason, domain, meta = "", "", {}
            for n, v in _fields(value):
                if not isinstance(v, bytes):
                    continue
                if n == 1:
                    reason = v.decode("utf-8")
                elif n == 2:
                    domain = v.decode("utf-8")
                elif n == 3:
                    entry: List[str] = ["", ""]
                    for en, ev in _fields(v):
                        if en in (1, 2) and isinstance(ev, bytes):
                            entry[en - 1] = ev.decode("utf-8")
                    meta[entry[0]] = entry[1]
            return ErrorInfo(reason, domain, meta)
    except (ValueError, UnicodeDecodeError):
        return None
    return None
