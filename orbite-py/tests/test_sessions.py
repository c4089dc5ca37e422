# SPDX-License-Identifier: Apache-2.0
"""orbite.sessions against a real `orbite serve`: the sync and asyncio
clients through the session flows, idempotent retries, the error classes
each refusal maps to (with the service's ErrorInfo), limits and drain.

The server binary is $ORBITE_BIN, else target/debug/orbite of this
repository (`cargo build --features grpc --bin orbite`); the tests skip
without it, and without grpcio/protobuf (the `sessions` extra).
"""

import asyncio
import atexit
import json
import os
import pickle
import queue
import re
import signal
import subprocess
import threading
import time
import uuid

import pytest


def _skip(why):
    """Skips, or fails where the test script requires these tests
    (ORBITE_SESSIONS_REQUIRED)."""
    if os.environ.get("ORBITE_SESSIONS_REQUIRED"):
        pytest.fail(f"ORBITE_SESSIONS_REQUIRED: {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)


try:
    import google.protobuf  # noqa: F401
    import grpc
except ImportError:
    _skip("orbite[sessions] (grpcio, protobuf) is not installed")

import orbite  # noqa: E402
from orbite import sessions  # noqa: E402
from orbite.sessions import (  # noqa: E402
    AlreadyExists,
    AsyncSessionsClient,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvRange,
    KvTransferMeta,
    NotFound,
    ScheduleStyle,
    SessionError,
    SessionsClient,
    SessionsExhausted,
    SessionState,
    TransferDisposition,
    Unavailable,
)
from orbite.sessions._pb import kv_session_pb2 as pb  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORBITE_BIN = os.environ.get("ORBITE_BIN") or os.path.join(REPO, "target", "debug", "orbite")
LISTEN_RE = re.compile(r"OpenEngineKv listening on (\S+:\d+)")
META = {"layout": "pytest/fp16/b16", "block_bytes": 4096, "blocks": 4}
KV_BYTES = META["block_bytes"] * META["blocks"]


class Server:
    """An `orbite serve` on 127.0.0.1:0; its output is drained by a thread."""

    def __init__(self, config=None):
        if not os.access(ORBITE_BIN, os.X_OK):
            _skip(f"no orbite binary at {ORBITE_BIN} (set ORBITE_BIN or run "
                  "`cargo build --features grpc --bin orbite`)")
        cfg = {"engine": {"listen": "127.0.0.1:0"}, "drain_timeout_ms": 1000}
        cfg.update(config or {})
        self.proc = subprocess.Popen(
            [ORBITE_BIN, "serve", "--listen", "127.0.0.1:0", "--config", json.dumps(cfg)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.lines = []
        q = queue.Queue()

        def read():
            for raw in iter(self.proc.stdout.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                self.lines.append(line)
                q.put(line)
            q.put(None)
        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        atexit.register(self.kill)  # whatever happens to the tests
        deadline = time.monotonic() + 20
        self.addr = None
        while self.addr is None:
            try:
                line = q.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                line = None
            if line is None:
                self.kill()
                out = "\n".join(self.lines)
                if "without the KV session service" in out:
                    _skip(f"{ORBITE_BIN} was built without feature grpc")
                pytest.fail(f"orbite serve printed no 'listening on': {out[-800:]!r}")
            m = LISTEN_RE.search(line)
            if m:
                self.addr = m.group(1)

    def stop(self, timeout=15):
        """SIGTERM (the server drains, aborts what is left, exits); returns
        the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self._close_output()
        atexit.unregister(self.kill)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._close_output()
        atexit.unregister(self.kill)

    def _close_output(self):
        self._reader.join(timeout=2)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def server():
    s = Server()
    try:
        yield s
    finally:
        rc = s.stop()
    assert rc == 0, f"orbite serve exited {rc} at SIGTERM: {s.lines[-3:]}"


@pytest.fixture
def client(server):
    with SessionsClient(server.addr, timeout=5.0) as c:
        yield c


def key(tag="k"):
    return f"pytest-{tag}-{uuid.uuid4().hex[:12]}"


def region(c):
    regs = list(c.stats().kv_regions)
    assert regs, "the server lists no kv_regions"
    return max(regs, key=lambda r: r.len)


def ranges(c, slot=0):
    r = region(c)
    return [KvRange(registration=r.registration, offset=r.offset + slot * KV_BYTES, len=KV_BYTES)]


def wait_unpinned(c, base=0, timeout=3.0):
    """Cleanup follows the end of a session: poll until the pins are gone."""
    deadline = time.monotonic() + timeout
    while c.stats().pinned_ranges > base and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.stats().pinned_ranges == base


def refused(exc_class, reason, fn):
    """fn raises exc_class with the ErrorInfo reason; returns the error."""
    with pytest.raises(exc_class) as ei:
        fn()
    e = ei.value
    assert isinstance(e, SessionError) and isinstance(e, orbite.OrbiteError)
    assert e.reason == reason, str(e)
    assert e.domain == sessions.DOMAIN
    assert e.code.name in str(e) and reason in str(e)
    return e


# ------------------------------------------------------------------ sync


def test_enums_match_the_proto():
    for ours, theirs in [(ScheduleStyle, pb.KvScheduleStyle),
                         (TransferDisposition, pb.KvTransferDisposition),
                         (SessionState, pb.KvSessionState)]:
        prefix = {ScheduleStyle: "KV_SCHEDULE_STYLE_",
                  TransferDisposition: "KV_TRANSFER_DISPOSITION_",
                  SessionState: "KV_SESSION_STATE_"}[ours]
        assert {prefix + m.name: int(m) for m in ours} == dict(theirs.items())
    assert [s for s in SessionState if s.is_terminal] == list(SessionState)[4:]


def test_error_mapping_without_a_server():
    from orbite.sessions.errors import from_rpc_error

    class Fake(grpc.RpcError):
        def __init__(self, code, details, trailers=()):
            self._c, self._d, self._t = code, details, trailers

        def code(self):
            return self._c

        def details(self):
            return self._d

        def trailing_metadata(self):
            return self._t

    # tonic answers CANCELLED "Timeout expired" when the deadline it was sent
    # runs out first: once the client's deadline passed, that is a deadline.
    e = from_rpc_error(Fake(grpc.StatusCode.CANCELLED, "Timeout expired"), deadline_passed=True)
    assert type(e) is DeadlineExceeded and e.code == grpc.StatusCode.DEADLINE_EXCEEDED
    e = from_rpc_error(Fake(grpc.StatusCode.CANCELLED, "cancelled"))
    assert type(e) is SessionError and e.code == grpc.StatusCode.CANCELLED
    # Undecodable status details: the error still maps, without ErrorInfo.
    e = from_rpc_error(Fake(grpc.StatusCode.NOT_FOUND, "gone",
                            (("grpc-status-details-bin", b"\x1a\xff\x01"),)))
    assert type(e) is NotFound and e.error_info is None and e.metadata == {}
    assert str(e) == "gone [NOT_FOUND]"


def test_connector_info_stats_and_echo(client):
    info = client.connector_info()
    assert info.schema_version == 1
    assert re.fullmatch(r"[0-9a-f]{16}", info.incarnation)
    assert ScheduleStyle.CONTEXT_FIRST in info.supported_styles
    assert info.limits.max_live_sessions > 0 and info.limits.default_lease_ms > 0
    st = client.stats()
    assert st.incarnation == info.incarnation and not st.draining
    assert region(client).len >= KV_BYTES
    assert client.echo(b"\x00ping") == b"\x00ping"


def test_context_first_flow(client):
    base = client.stats().pinned_ranges
    t0 = time.time()
    s = client.allocate(request_id="req-cf", model="m", idempotency_key=key(), meta=META,
                        style=ScheduleStyle.CONTEXT_FIRST, lease_ms=5000)
    sid = s.session_id
    assert sid.startswith(client.connector_info().incarnation + "-")
    assert s.state == SessionState.ALLOCATED and s.effective_style == ScheduleStyle.CONTEXT_FIRST
    assert s.meta == KvTransferMeta(**META) and not s.rendezvous.ranges
    assert s.lease_expires_at.ToMilliseconds() >= t0 * 1000 + 4000
    assert client.get(sid) == s
    r = client.renew(sid, lease_ms=8000)
    assert r.state == SessionState.ALLOCATED
    assert r.lease_expires_at.ToMilliseconds() > s.lease_expires_at.ToMilliseconds()
    # The consumer is early: NOT_READY, retry once ready.
    e = refused(Unavailable, "NOT_READY", lambda: client.attach(sid, meta=META))
    assert e.metadata == {"session_id": sid}
    rg = ranges(client)
    tuples = [(x.registration, x.offset, x.len) for x in rg]
    ready = client.mark_ready(sid, ranges=tuples, meta=META)
    assert ready.state == SessionState.READY and list(ready.rendezvous.ranges) == rg
    assert client.stats().pinned_ranges == base + 1
    refused(FailedPrecondition, "WRONG_STATE", lambda: client.mark_ready(sid, ranges=rg, meta=META))
    refused(FailedPrecondition, "WRONG_STATE", lambda: client.complete(sid))
    a = client.attach(sid, meta=META)
    assert not a.queued and a.session.state == SessionState.ATTACHED
    assert list(a.session.rendezvous.ranges) == rg
    done = client.complete(sid)
    assert done.state == SessionState.COMPLETE and not done.HasField("reason")
    wait_unpinned(client, base)
    rel = client.release(sid)
    assert (rel.session_id, rel.state, rel.released_now) == (sid, SessionState.COMPLETE, False)
    assert SessionState(client.get(sid).state).is_terminal


def test_generation_first_queued_consumer_and_bypass(client):
    # Enum names work as well as members.
    s = client.allocate(request_id="req-gf", model="m", idempotency_key=key(), meta=META,
                        style="generation_first", disposition="BYPASS")
    sid = s.session_id
    assert s.style == ScheduleStyle.GENERATION_FIRST
    assert s.disposition == TransferDisposition.BYPASS
    a = client.attach(sid, meta=META)
    assert a.queued and a.session.state == SessionState.ALLOCATED and a.session.consumer_queued
    assert client.renew(sid, lease_ms=2000).consumer_queued
    b = client.bypass(sid)
    assert b.state == SessionState.BYPASSED and not b.consumer_queued
    refused(FailedPrecondition, "SESSION_ENDED", lambda: client.renew(sid))
    client.check_sessionless_decode(disposition=TransferDisposition.BYPASS)
    if not client.connector_info().local_prefill:
        refused(FailedPrecondition, "SESSION_REQUIRED", lambda: client.check_sessionless_decode())


def test_reject_fail_abort(client):
    base = client.stats().pinned_ranges
    s = client.allocate(request_id="req-rj", model="m", idempotency_key=key(), meta=META)
    client.mark_ready(s.session_id, ranges=ranges(client), meta=META)
    rj = client.reject(s.session_id, reason="no room")
    assert rj.state == SessionState.REJECTED and rj.reason == "no room"
    wait_unpinned(client, base)
    f = client.allocate(request_id="req-fl", model="m", idempotency_key=key(), meta=META)
    ff = client.fail(f.session_id, reason="peer lost")
    assert (ff.state, ff.reason) == (SessionState.FAILED, "peer lost")
    ab = client.allocate(request_id="req-ab", model="m", idempotency_key=key(), meta=META)
    assert client.abort(ab.session_id).state == SessionState.CANCELLED
    assert client.abort(ab.session_id).state == SessionState.CANCELLED  # unchanged
    rel = client.release(ab.session_id)
    assert (rel.state, rel.released_now) == (SessionState.CANCELLED, False)


def test_idempotent_retry_returns_the_same_session(client):
    k = key("idem")
    kw = dict(request_id="req-idem", model="m", idempotency_key=k, meta=META, lease_ms=4000)
    s1 = client.allocate(**kw)
    s2 = client.allocate(**kw)
    assert s2.session_id == s1.session_id
    e = refused(AlreadyExists, "IDEMPOTENCY_CONFLICT",
                lambda: client.allocate(**dict(kw, model="other")))
    assert e.metadata["session_id"] == s1.session_id and e.code == grpc.StatusCode.ALREADY_EXISTS
    rel = client.release(s1.session_id)
    assert (rel.state, rel.released_now) == (SessionState.RELEASED, True)
    assert client.release(s1.session_id).released_now is False
    # A retry after the end still answers with the session (its tombstone).
    s3 = client.allocate(**kw)
    assert (s3.session_id, s3.state) == (s1.session_id, SessionState.RELEASED)


def test_refusals_map_to_exception_classes(client, server):
    inc = client.connector_info().incarnation
    e = refused(NotFound, "SESSION_NOT_FOUND", lambda: client.get(f"{inc}-987654321"))
    assert e.code == grpc.StatusCode.NOT_FOUND and e.details
    assert e.metadata == {"session_id": f"{inc}-987654321"}
    # Exceptions survive pickling (multiprocessing, logging handlers).
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is NotFound and e2.reason == e.reason and e2.metadata == e.metadata
    other = "0123456789abcdef" if inc != "0123456789abcdef" else "fedcba9876543210"
    refused(NotFound, "OTHER_INCARNATION", lambda: client.get(f"{other}-1"))
    refused(InvalidArgument, "INVALID_VALUE", lambda: client.get("not-an-id"))
    refused(InvalidArgument, "MISSING_FIELD", lambda: client.allocate(
        request_id="r", model="m", idempotency_key=key(), meta={}))
    refused(InvalidArgument, "INVALID_LEASE", lambda: client.allocate(
        request_id="r", model="m", idempotency_key=key(), meta=META, lease_ms=0))
    refused(InvalidArgument, "INVALID_VALUE", lambda: client.allocate(
        request_id="r", model="m", idempotency_key=key(), meta=META, style=42))
    s = client.allocate(request_id="r-meta", model="m", idempotency_key=key(), meta=META)
    refused(InvalidArgument, "INCOMPATIBLE_METADATA", lambda: client.mark_ready(
        s.session_id, ranges=ranges(client), meta=dict(META, blocks=8)))
    refused(FailedPrecondition, "ENGINE_REFUSED", lambda: client.mark_ready(
        s.session_id, ranges=[(12345, 0, KV_BYTES)], meta=META))
    refused(FailedPrecondition, "WRONG_STATE", lambda: client.bypass(s.session_id))
    client.release(s.session_id)
    with pytest.raises(ValueError):
        client.allocate(request_id="r", model="m", idempotency_key="k", meta=META, style="sideways")
    # Nothing listens there: UNAVAILABLE from the transport, without ErrorInfo.
    with SessionsClient("127.0.0.1:1", timeout=2.0) as dead:
        with pytest.raises(Unavailable) as ei:
            dead.stats()
    assert ei.value.reason is None and ei.value.error_info is None


def test_metadata_and_shared_channel(server):
    ch = grpc.insecure_channel(server.addr)
    try:
        c = SessionsClient(ch, metadata=[("x-orbite-test", "1")])
        assert c.connector_info().schema_version == 1
        c.close()  # the channel was handed in: still open
        assert SessionsClient(ch).echo(b"x") == b"x"
    finally:
        ch.close()


# ------------------------------------------------------------------ asyncio


def test_async_client_concurrent_flow(server):
    async def main():
        async with AsyncSessionsClient(server.addr, timeout=5.0) as c:
            info = await c.connector_info()
            assert ScheduleStyle.CONCURRENT in info.supported_styles
            rg = list((await c.stats()).kv_regions)[0]
            base = (await c.stats()).pinned_ranges
            s = await c.allocate(request_id="req-conc", model="m", idempotency_key=key(),
                                 meta=KvTransferMeta(**META), style=ScheduleStyle.CONCURRENT,
                                 lease_ms=3000)
            sid = s.session_id
            a = await c.attach(sid, meta=META)
            assert a.queued

            async def producer():
                await asyncio.sleep(0.05)
                return await c.mark_ready(sid, ranges=[(rg.registration, rg.offset, KV_BYTES)],
                                          meta=META)

            task = asyncio.ensure_future(producer())
            for _ in range(200):
                a = await c.attach(sid, meta=META)
                if not a.queued:
                    break
                await c.renew(sid, lease_ms=3000)
                await asyncio.sleep(0.01)
            assert (await task).state == SessionState.READY
            assert a.session.state == SessionState.ATTACHED and not a.session.consumer_queued
            assert (await c.complete(sid)).state == SessionState.COMPLETE
            rel = await c.release(sid)
            assert rel.state == SessionState.COMPLETE and not rel.released_now
            # Errors map as in the sync client.
            with pytest.raises(NotFound) as ei:
                await c.get(f"{info.incarnation}-99999999")
            assert ei.value.reason == "SESSION_NOT_FOUND"
            with pytest.raises(FailedPrecondition):
                await c.check_sessionless_decode(disposition=TransferDisposition.REQUIRED)
            # Many calls in flight on one channel; identical retries agree.
            k = key("async")
            got = await asyncio.gather(*[
                c.allocate(request_id="req-many", model="m", idempotency_key=k, meta=META)
                for _ in range(8)])
            assert len({x.session_id for x in got}) == 1
            await c.abort(got[0].session_id)
            for _ in range(300):
                if (await c.stats()).pinned_ranges == base:
                    break
                await asyncio.sleep(0.01)
            assert (await c.echo(b"done")) == b"done"
        assert c._channel is None  # closed by `async with`

    asyncio.run(main())


# ------------------------------------------------------------------ limits and drain


def test_limits_deadline_and_drain():
    srv = Server({"sessions": {"max_live_sessions": 2}})
    try:
        with SessionsClient(srv.addr, timeout=5.0) as c:
            kw = dict(model="m", meta=META)
            s1 = c.allocate(request_id="a", idempotency_key=key(), **kw)
            s2 = c.allocate(request_id="b", idempotency_key=key(), **kw)
            e = refused(SessionsExhausted, "TOO_MANY_SESSIONS",
                        lambda: c.allocate(request_id="c", idempotency_key=key(), **kw))
            assert isinstance(e, orbite.ResourceExhausted)
            assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Draining waits for the live sessions: a short deadline runs out.
            with pytest.raises(DeadlineExceeded) as ei:
                c.drain(timeout_ms=2000, timeout=0.2)
            assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and ei.value.reason is None
            assert c.stats().draining
            refused(Unavailable, "DRAINING",
                    lambda: c.allocate(request_id="d", idempotency_key=key(), **kw))
            # An identical retry is still answered while draining.
            assert c.allocate(request_id="a", idempotency_key=s1.idempotency_key,
                              **kw).session_id == s1.session_id
            d = c.drain(timeout_ms=100, abort_remaining=True)
            assert d.drained and d.aborted == 2 and d.live_sessions == 0
            assert c.get(s2.session_id).state == SessionState.CANCELLED
    finally:
        rc = srv.stop()
    assert rc == 0, srv.lines[-3:]


def test_the_sessions_example_of_docs_python_md_runs(server):
    doc = os.path.join(REPO, "docs", "python.md")
    blocks = re.findall(r"```python sessions\n(.*?)```", open(doc).read(), re.S)
    assert len(blocks) == 1
    import sys

    argv = sys.argv
    sys.argv = ["example.py", server.addr]
    try:
        exec(compile(blocks[0], "docs/python.md", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = argv
