# SPDX-License-Identifier: Apache-2.0
"""A typed client of the OrbiTE KV session service (`orbite.kv.v1.OpenEngineKv`,
proto/orbite/kv/v1/kv_session.proto; semantics in docs/api.md): the
lifecycle of one prefill-to-decode KV handoff, as served by `orbite serve`.

Needs the `sessions` extra (`pip install 'orbite[sessions]'`: grpcio and
protobuf).

    from orbite.sessions import SessionsClient, ScheduleStyle

    meta = {"layout": "llama-8b/fp16/b16", "block_bytes": 4096, "blocks": 4}
    with SessionsClient("127.0.0.1:50051") as c:
        s = c.allocate(request_id="req-1", model="llama-8b", idempotency_key="req-1/a1",
                       style=ScheduleStyle.CONTEXT_FIRST, meta=meta)
        region = c.stats().kv_regions[0]
        c.mark_ready(s.session_id, ranges=[(region.registration, region.offset, 16384)],
                     meta=meta)                                  # producer
        a = c.attach(s.session_id, meta=meta)                    # consumer
        ...                                                      # read a.session.rendezvous
        c.complete(s.session_id)

`AsyncSessionsClient` has the same methods for asyncio. Responses are the
protobuf messages (`KvSession`, ...); refusals raise `SessionError`
subclasses that carry the gRPC code and the service's `ErrorInfo` reason.
"""

try:
    import google.protobuf  # noqa: F401
    import grpc  # noqa: F401
except ImportError as e:  # the extra is not installed
    raise ImportError(
        f"orbite.sessions needs grpcio and protobuf: pip install 'orbite[sessions]' ({e})"
    ) from e

from ._pb.kv_session_pb2 import (
    AttachKvSessionResponse,
    DrainKvSessionsResponse,
    KvConnectorInfo,
    KvLimits,
    KvRange,
    KvRendezvous,
    KvSession,
    KvSessionStats,
    KvTransferMeta,
    ReleaseKvSessionResponse,
)
from .client import (
    DEFAULT_TIMEOUT,
    AsyncSessionsClient,
    ScheduleStyle,
    SessionsClient,
    SessionState,
    TransferDisposition,
)
from .errors import (
    DOMAIN,
    AlreadyExists,
    DeadlineExceeded,
    ErrorInfo,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    SessionError,
    SessionsExhausted,
    Unavailable,
)

__all__ = [
    # clients
    "SessionsClient",
    "AsyncSessionsClient",
    "DEFAULT_TIMEOUT",
    # enums
    "ScheduleStyle",
    "TransferDisposition",
    "SessionState",
    # messages
    "KvSession",
    "KvTransferMeta",
    "KvRange",
    "KvRendezvous",
    "AttachKvSessionResponse",
    "ReleaseKvSessionResponse",
    "DrainKvSessionsResponse",
    "KvConnectorInfo",
    "KvLimits",
    "KvSessionStats",
    # errors
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
