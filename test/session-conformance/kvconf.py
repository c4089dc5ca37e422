"""Helpers of the KV-session conformance suite: stub generation, a thin
client over the generated stubs, status checks (code + ErrorInfo), polling
and the processes the suite starts.

Everything here talks to the service only through gRPC: the suite is a
black box test of proto/orbite/kv/v1/kv_session.proto and docs/api.md.
"""

import atexit
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc

DOMAIN = "orbite.kv.v1"
RPC_TIMEOUT = 10.0
PROTO_REL = "orbite/kv/v1/kv_session.proto"
ID_RE = re.compile(r"^([0-9a-f]{16})-([1-9][0-9]*)$")


class Failure(Exception):
    """A case's expectation did not hold."""


def check(cond, msg):
    if not cond:
        raise Failure(msg)


def eq(got, want, what):
    if got != want:
        raise Failure(f"{what}: got {got!r}, want {want!r}")


# ---------------------------------------------------------------- stubs

pb = None        # kv_session_pb2
pb_grpc = None   # kv_session_pb2_grpc
status_pb2 = None
error_details_pb2 = None
rpc_status = None


def generate_stubs(proto_root, out_dir=None):
    """Compiles the proto with grpc_tools into out_dir (a new temporary
    directory when None) and imports the modules. Returns out_dir."""
    global pb, pb_grpc, status_pb2, error_details_pb2, rpc_status
    if out_dir is None:
        out_dir = tempfile.mkdtemp(prefix="kv-conformance-stubs-")
    os.makedirs(out_dir, exist_ok=True)
    if not os.path.exists(os.path.join(out_dir, "orbite/kv/v1/kv_session_pb2.py")):
        import grpc_tools
        wkt = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_root}", f"-I{wkt}",
               f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
               os.path.join(proto_root, PROTO_REL)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"protoc failed: {r.stderr.strip()}")
    if out_dir not in sys.path:
        sys.path.insert(0, out_dir)
    from orbite.kv.v1 import kv_session_pb2, kv_session_pb2_grpc  # noqa: E402
    from google.rpc import status_pb2 as sp, error_details_pb2 as ed  # noqa: E402
    from grpc_status import rpc_status as rs  # noqa: E402
    pb, pb_grpc, status_pb2, error_details_pb2, rpc_status = kv_session_pb2, kv_session_pb2_grpc, sp, ed, rs
    return out_dir


def state_name(v):
    return pb.KvSessionState.Name(v) if v in pb.KvSessionState.values() else f"state({v})"


def norm_state(text):
    """'Complete', 'COMPLETE', 'KV_SESSION_STATE_COMPLETE' -> 'complete'."""
    t = str(text).lower().replace("kv_session_state_", "").replace("_", "")
    return t


def ts_ms(ts):
    return ts.seconds * 1000 + ts.nanos / 1e6


def now_ms():
    return time.time() * 1000.0


# ---------------------------------------------------------------- errors

class Refusal:
    """A failed call: its code, message, the google.rpc.Status and its
    ErrorInfo (None when absent)."""

    def __init__(self, err):
        self.err = err
        self.code = err.code()
        self.details = err.details()
        self.status = None
        self.info = None
        self.problem = None
        try:
            self.status = rpc_status.from_call(err)
        except ValueError as e:
            self.problem = f"grpc-status-details-bin disagrees with the status: {e}"
        except Exception as e:  # undecodable trailer
            self.problem = f"grpc-status-details-bin does not decode: {e}"
        if self.status is not None:
            infos = []
            for d in self.status.details:
                if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    ei = error_details_pb2.ErrorInfo()
                    d.Unpack(ei)
                    infos.append(ei)
            if len(infos) == 1:
                self.info = infos[0]
            elif len(infos) > 1:
                self.problem = f"{len(infos)} ErrorInfo details, want one"
                self.info = infos[0]

    @property
    def reason(self):
        return self.info.reason if self.info is not None else None

    def describe(self):
        r = f"{self.code.name}"
        if self.info is not None:
            r += f" {self.info.reason} {dict(self.info.metadata)}"
        else:
            r += " (no ErrorInfo)"
        if self.details:
            r += f" {self.details!r}"
        return r


def refusal_of(fn):
    """Runs fn; returns the Refusal, or None when it succeeded."""
    try:
        fn()
    except grpc.RpcError as e:
        return Refusal(e)
    return None


def expect_err(fn, code, reason, meta=None, what=""):
    """fn must fail with `code` (a grpc.StatusCode, or a tuple of them) and
    one ErrorInfo in domain orbite.kv.v1 with `reason` (a string, a tuple,
    or None to not check) whose metadata has every key of `meta`; a value
    that is not None must match exactly (a callable value is a predicate).
    Returns the Refusal."""
    label = f"{what}: " if what else ""
    try:
        got = fn()
    except grpc.RpcError as e:
        r = Refusal(e)
    else:
        raise Failure(f"{label}expected {getattr(code, 'name', code)} {reason}, got OK: "
                      f"{_short(got)}")
    codes = code if isinstance(code, tuple) else (code,)
    check(r.code in codes, f"{label}expected {'/'.join(c.name for c in codes)} {reason}, "
                           f"got {r.describe()}")
    if reason is None:
        return r
    check(r.problem is None, f"{label}{r.problem}")
    check(r.info is not None, f"{label}{r.code.name} without a google.rpc.ErrorInfo detail "
                              f"(want reason {reason}); message {r.details!r}")
    check(r.info.domain == DOMAIN, f"{label}ErrorInfo domain {r.info.domain!r}, want {DOMAIN!r}")
    reasons = reason if isinstance(reason, tuple) else (reason,)
    check(r.info.reason in reasons, f"{label}reason {r.info.reason!r}, want {'/'.join(reasons)} "
                                    f"({r.describe()})")
    for k, v in (meta or {}).items():
        check(k in r.info.metadata, f"{label}ErrorInfo {r.info.reason} lacks metadata {k!r}: "
                                    f"{dict(r.info.metadata)}")
        if v is None:
            continue
        got = r.info.metadata[k]
        if callable(v):
            check(v(got), f"{label}ErrorInfo metadata {k}={got!r} unexpected")
        else:
            check(got == str(v), f"{label}ErrorInfo metadata {k}={got!r}, want {str(v)!r}")
    return r


def _short(msg):
    s = str(msg).replace("\n", " ")
    return s if len(s) < 300 else s[:300] + "..."


def short(msg):
    return _short(msg)


# ---------------------------------------------------------------- polling

def poll_until(fn, timeout=3.0, interval=0.02):
    """Calls fn until it returns a truthy value or the time is up; returns
    the last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


# ---------------------------------------------------------------- client

ABSENT = object()


class Client:
    """One participant: its own channel and stubs."""

    def __init__(self, addr, tracker=None):
        self.addr = addr
        self.channel = grpc.insecure_channel(addr, options=[
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
            ("grpc.enable_retries", 0),
        ])
        self.kv = pb_grpc.OpenEngineKvStub(self.channel)
        self.diag = pb_grpc.OrbiteDiagnosticsStub(self.channel)
        self.tracker = tracker
        self.style = 1  # what allocate_req asks for unless told

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def raw(self, method, payload, service="OpenEngineKv", timeout=RPC_TIMEOUT):
        """A unary call with raw request bytes; returns the raw response."""
        call = self.channel.unary_unary(f"/orbite.kv.v1.{service}/{method}",
                                        request_serializer=None, response_deserializer=None)
        return call(payload, timeout=timeout)

    # -- requests
    def allocate_req(self, key, request_id=None, model="conformance-model", style=None,
                     disposition=1, lease_ms=ABSENT, meta=None, no_meta=False):
        req = pb.AllocateKvSessionRequest(
            request_id=request_id if request_id is not None else f"req-{key}",
            model=model, idempotency_key=key, style=self.style if style is None else style,
            disposition=disposition)
        if lease_ms is not ABSENT:
            req.lease_ms = lease_ms
        if not no_meta:
            req.meta.CopyFrom(meta if meta is not None else default_meta())
        return req

    def allocate(self, key=None, req=None, **kw):
        if req is None:
            req = self.allocate_req(key, **kw)
        s = self.kv.AllocateKvSession(req, timeout=RPC_TIMEOUT)
        if self.tracker is not None:
            self.tracker.add(s.session_id)
        return s

    def get(self, sid):
        return self.kv.GetKvSession(pb.GetKvSessionRequest(session_id=sid), timeout=RPC_TIMEOUT)

    def renew(self, sid, lease_ms=ABSENT):
        req = pb.RenewKvSessionRequest(session_id=sid)
        if lease_ms is not ABSENT:
            req.lease_ms = lease_ms
        return self.kv.RenewKvSession(req, timeout=RPC_TIMEOUT)

    def release(self, sid):
        return self.kv.ReleaseKvSession(pb.ReleaseKvSessionRequest(session_id=sid), timeout=RPC_TIMEOUT)

    def abort(self, sid):
        return self.kv.AbortKvSession(pb.AbortKvSessionRequest(session_id=sid), timeout=RPC_TIMEOUT)

    def ready(self, sid, ranges, meta=ABSENT):
        req = pb.MarkKvSessionReadyRequest(session_id=sid)
        req.ranges.extend(ranges)
        if meta is ABSENT:
            meta = default_meta()
        if meta is not None:
            req.meta.CopyFrom(meta)
        return self.kv.MarkKvSessionReady(req, timeout=RPC_TIMEOUT)

    def attach(self, sid, meta=ABSENT):
        req = pb.AttachKvSessionRequest(session_id=sid)
        if meta is ABSENT:
            meta = default_meta()
        if meta is not None:
            req.meta.CopyFrom(meta)
        return self.kv.AttachKvSession(req, timeout=RPC_TIMEOUT)

    def complete(self, sid):
        return self.kv.CompleteKvSession(pb.CompleteKvSessionRequest(session_id=sid), timeout=RPC_TIMEOUT)

    def bypass(self, sid):
        return self.kv.BypassKvSession(pb.BypassKvSessionRequest(session_id=sid), timeout=RPC_TIMEOUT)

    def reject(self, sid, reason="conformance reject"):
        return self.kv.RejectKvSession(pb.RejectKvSessionRequest(session_id=sid, reason=reason),
                                       timeout=RPC_TIMEOUT)

    def fail(self, sid, reason="conformance fail"):
        return self.kv.FailKvSession(pb.FailKvSessionRequest(session_id=sid, reason=reason),
                                     timeout=RPC_TIMEOUT)

    def sessionless(self, disposition):
        return self.kv.CheckSessionlessDecode(pb.CheckSessionlessDecodeRequest(disposition=disposition),
                                              timeout=RPC_TIMEOUT)

    def drain(self, timeout_ms=ABSENT, abort_remaining=False, rpc_timeout=RPC_TIMEOUT):
        req = pb.DrainKvSessionsRequest(abort_remaining=abort_remaining)
        if timeout_ms is not ABSENT:
            req.timeout_ms = timeout_ms
        return self.kv.DrainKvSessions(req, timeout=rpc_timeout)

    def info(self, timeout=RPC_TIMEOUT):
        return self.kv.GetKvConnectorInfo(pb.GetKvConnectorInfoRequest(), timeout=timeout)

    def stats(self):
        return self.kv.GetKvSessionStats(pb.GetKvSessionStatsRequest(), timeout=RPC_TIMEOUT)

    def echo(self, payload):
        return self.diag.Echo(pb.EchoRequest(payload=payload), timeout=RPC_TIMEOUT)


# The KV shape every case uses unless it says otherwise; set by the runner
# once it knows the server's KV regions.
_DEFAULT_META = {"layout": "conformance/fp16/l4/h8/b16", "block_bytes": 4096, "blocks": 4}


def set_default_meta(block_bytes, blocks):
    _DEFAULT_META["block_bytes"] = block_bytes
    _DEFAULT_META["blocks"] = blocks


def default_meta(**over):
    d = dict(_DEFAULT_META)
    d.update(over)
    return pb.KvTransferMeta(**d)


def kv_size():
    return _DEFAULT_META["block_bytes"] * _DEFAULT_META["blocks"]


# ---------------------------------------------------------------- processes

_children = []
_children_lock = threading.Lock()


def _kill_children():
    with _children_lock:
        procs = list(_children)
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except Exception:
            pass


atexit.register(_kill_children)


def install_signal_cleanup():
    def handler(signum, frame):
        _kill_children()
        sys.stdout.flush()
        os._exit(128 + signum)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)


def spawn(cmd, **kw):
    """Starts a child whose stdout (and stderr, merged) is a pipe; the
    suite kills it at exit whatever happens."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, **kw)
    with _children_lock:
        _children.append(p)
    return p


def forget(p):
    with _children_lock:
        if p in _children:
            _children.remove(p)


class OutputReader:
    """Collects a child's output lines in a thread."""

    def __init__(self, proc):
        self.proc = proc
        self.lines = []
        self.cond = threading.Condition()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        for raw in iter(self.proc.stdout.readline, b""):
            with self.cond:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, pred, timeout):
        """Waits for a line matching pred; returns it or None."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                while seen < len(self.lines):
                    line = self.lines[seen]
                    seen += 1
                    if pred(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and seen >= len(self.lines)
                                 and not self.t.is_alive()):
                    return None
                self.cond.wait(min(left, 0.05))

    def text(self):
        with self.cond:
            return "\n".join(self.lines)


LISTEN_RE = re.compile(r"listening on (\S+:\d+)")


class Server:
    """An `orbite serve` this suite started."""

    def __init__(self, binary, listen="127.0.0.1:0", config=None, startup=20.0):
        import json
        cmd = [binary, "serve", "--listen", listen]
        if config is not None:
            cmd += ["--config", json.dumps(config)]
        self.cmd = cmd
        self.proc = spawn(cmd)
        self.out = OutputReader(self.proc)
        self.addrs = []
        first = self.out.wait_for(lambda l: LISTEN_RE.search(l) is not None, startup)
        if first is None:
            self.kill()
            raise Failure(f"{' '.join(cmd)} printed no 'listening on HOST:PORT' within {startup}s "
                          f"(exit {self.proc.poll()}); output: {self.out.text()[-800:]!r}")
        # Further services print their lines right after the first.
        time.sleep(0.2)
        lines = self.out.text().splitlines()
        self.startup_lines = list(lines)
        # The gRPC service's line first (a line that names it), then the rest.
        lines.sort(key=lambda l: 0 if re.search(r"grpc|kv|session", l, re.I) else 1)
        for line in lines:
            m = LISTEN_RE.search(line)
            if m and m.group(1) not in self.addrs:
                self.addrs.append(m.group(1))
        self.addr = self._kv_addr()

    def _kv_addr(self):
        for a in self.addrs:
            c = Client(a)
            try:
                c.info(timeout=3)
                return a
            except grpc.RpcError:
                pass
            finally:
                c.close()
        self.kill()
        raise Failure(f"no listed address {self.addrs} answers GetKvConnectorInfo")

    def port(self):
        return int(self.addr.rsplit(":", 1)[1])

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        forget(self.proc)

    def terminate_and_wait(self, timeout):
        """SIGTERM, then waits; returns (exit code or None if it did not
        exit in time, seconds)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        dt = time.monotonic() - t0
        if rc is None:
            self.kill()
        else:
            forget(self.proc)
        self.out.t.join(timeout=2)
        return rc, dt
