# SPDX-License-Identifier: Apache-2.0
"""Helpers of the two-process NIXL tests (test/nixl/run_tests.py).

- `Hooks`: the test-only entry points of the staged liborbite_nixl (built with
  test hooks), loaded with ctypes in the process whose engine a test controls.
  The plugin links the same library, so with one ORBITE backend in the
  process there is exactly one engine.
- `serve` / `Peer`: a second process with its own NIXL agent and ORBITE
  backend, driven by commands over a multiprocessing pipe (spawn start
  method). Every call has a timeout; a peer that does not answer is killed.
- `post` / `state` / `drive`: transfer(), check_xfer_state() and polling to a
  terminal state, with the exception NIXL's Python agent raises for a
  negative status folded into ("ERR", exc).
- `let_go`: ends hold_all and lets held tasks go until the work is done.
- `Cuda`: the CUDA driver API through ctypes (in the tests the driver shim,
  orbite-cuda-shim, found on LD_LIBRARY_PATH): device memory for VRAM
  registrations, filled and read back with driver copies only.
"""

import ctypes
import hashlib
import multiprocessing
import os
import sys
import time
import traceback

sys.dont_write_bytecode = True

ORBITE_TEST_RUN = 0
ORBITE_TEST_HOLD = 1
ORBITE_TEST_SHORT = 2
ORBITE_TEST_FAIL = 3

STAT_FIELDS = (
    "registrations registered_bytes fenced_registrations host_allocations "
    "host_memory_bytes prepared_transfers executions queued_executions "
    "bytes_in_flight tasks_in_flight unquiesced_owners notification_bytes "
    "binding_handles"
).split()


class TestFailure(Exception):
    """An expectation of a test did not hold."""


def check(cond, msg):
    if not cond:
        raise TestFailure(msg)


def wait_until(pred, timeout, what, interval=0.002):
    """Polls `pred` until it returns a true value; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TestFailure(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class _Engine(ctypes.Structure):
    _fields_ = [("raw", ctypes.c_uint64)]


class _Stats(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("version", ctypes.c_uint32)] + [
        (f, ctypes.c_uint64) for f in STAT_FIELDS
    ]


# OrbiteStats of ABI 1.3: the fields above, then these.
DEVICE_STAT_FIELDS = (
    "pinned_ranges auth_failures device_allocations device_memory_bytes "
    "staging_buffers staging_bytes cuda_imports"
).split()


class _StatsV13(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("version", ctypes.c_uint32)] + [
        (f, ctypes.c_uint64) for f in STAT_FIELDS + DEVICE_STAT_FIELDS
    ]


class Hooks:
    """The engine of this process's ORBITE backend, through the test hooks."""

    def __init__(self):
        path = os.environ.get("ORBITE_NIXL_LIB")
        if not path:
            raise TestFailure("ORBITE_NIXL_LIB is not set")
        self.lib = lib = ctypes.CDLL(path)
        u32, u64 = ctypes.c_uint32, ctypes.c_uint64
        lib.orbite_test_engines.argtypes = [
            ctypes.POINTER(_Engine),
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t),
        ]
        lib.orbite_engine_stats.argtypes = [_Engine, ctypes.POINTER(_Stats)]
        lib.orbite_test_hold_all.argtypes = [_Engine, u32]
        lib.orbite_test_hold_remote.argtypes = [_Engine, u32]
        lib.orbite_test_wait_held.argtypes = [_Engine, u64, u64, ctypes.POINTER(u64)]
        lib.orbite_test_release_held.argtypes = [_Engine, u32, u64, u32]
        lib.orbite_test_fault_push.argtypes = [_Engine, u32, u64, u32]
        for f in (
            "orbite_test_engines",
            "orbite_engine_stats",
            "orbite_test_hold_all",
            "orbite_test_hold_remote",
            "orbite_test_wait_held",
            "orbite_test_release_held",
            "orbite_test_fault_push",
        ):
            getattr(lib, f).restype = ctypes.c_int32
        engines = self.engines()
        if len(engines) != 1:
            raise TestFailure(f"expected exactly one live OrbiTE engine in this process, found {len(engines)}")
        self.engine = engines[0]

    def engines(self):
        cap = 16
        arr = (_Engine * cap)()
        n = ctypes.c_size_t(0)
        st = self.lib.orbite_test_engines(arr, cap, ctypes.byref(n))
        check(st == 0, f"orbite_test_engines returned {st}")
        return [_Engine(arr[i].raw) for i in range(min(n.value, cap))]

    def _ok(self, what, st):
        check(st == 0, f"{what} returned status {st}")

    def stats(self):
        s = _Stats()
        s.size = ctypes.sizeof(_Stats)
        s.version = 1
        self._ok("orbite_engine_stats", self.lib.orbite_engine_stats(self.engine, ctypes.byref(s)))
        return {f: getattr(s, f) for f in STAT_FIELDS}

    def all_stats(self):
        """Every counter of ABI 1.3 (the CUDA and staging ones included)."""
        s = _StatsV13()
        s.size = ctypes.sizeof(_StatsV13)
        s.version = 1
        out = ctypes.cast(ctypes.pointer(s), ctypes.POINTER(_Stats))  # the declared argument type
        self._ok("orbite_engine_stats", self.lib.orbite_engine_stats(self.engine, out))
        return {f: getattr(s, f) for f in STAT_FIELDS + DEVICE_STAT_FIELDS}

    def hold_all(self, on):
        self._ok("orbite_test_hold_all", self.lib.orbite_test_hold_all(self.engine, 1 if on else 0))

    def hold_remote(self, on):
        self._ok("orbite_test_hold_remote", self.lib.orbite_test_hold_remote(self.engine, 1 if on else 0))

    def wait_held(self, n, timeout_ms=10000):
        held = ctypes.c_uint64(0)
        st = self.lib.orbite_test_wait_held(self.engine, n, timeout_ms, ctypes.byref(held))
        return st, held.value

    def require_held(self, n, timeout_ms=10000):
        st, held = self.wait_held(n, timeout_ms)
        check(st == 0 and held >= n, f"orbite_test_wait_held({n}) returned status {st}, {held} held")
        return held

    def release_held(self, kind=ORBITE_TEST_RUN, nbytes=0, effect_unknown=0):
        self._ok(
            "orbite_test_release_held",
            self.lib.orbite_test_release_held(self.engine, kind, nbytes, effect_unknown),
        )

    def fault_push(self, kind, nbytes=0, effect_unknown=0):
        self._ok(
            "orbite_test_fault_push",
            self.lib.orbite_test_fault_push(self.engine, kind, nbytes, effect_unknown),
        )


SHIM_STAT_FIELDS = (
    "device_allocations device_bytes host_allocations host_registrations ipc_imports "
    "streams events context_retains async_copies copied_bytes"
).split()


class _ShimStats(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in SHIM_STAT_FIELDS]


class Cuda:
    """The CUDA driver through ctypes: each device's primary context
    (retained on first use, made current on the calling thread before each
    call), allocations, and synchronous copies in and out. With the shim,
    device memory cannot be touched by the CPU; only these copies reach it."""

    def __init__(self, path="libcuda.so.1"):
        self.lib = lib = ctypes.CDLL(path)
        c_int, c_uint, c_size, c_ptr, c_u64 = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint64
        sigs = {
            "cuInit": [c_uint],
            "cuDeviceGetCount": [ctypes.POINTER(c_int)],
            "cuDeviceGet": [ctypes.POINTER(c_int), c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(c_ptr), c_int],
            "cuDevicePrimaryCtxRelease_v2": [c_int],
            "cuCtxSetCurrent": [c_ptr],
            "cuMemAlloc_v2": [ctypes.POINTER(c_u64), c_size],
            "cuMemFree_v2": [c_u64],
            "cuMemcpyHtoD_v2": [c_u64, c_ptr, c_size],
            "cuMemcpyDtoH_v2": [c_ptr, c_u64, c_size],
        }
        for name, args in sigs.items():
            f = getattr(lib, name)
            f.argtypes = args
            f.restype = c_int
        self._ok("cuInit", lib.cuInit(0))
        self.contexts = {}  # ordinal -> (CUdevice, CUcontext)
        self.allocs = {}  # pointer -> (ordinal, bytes)

    def _ok(self, what, rc):
        check(rc == 0, f"{what} returned CUresult {rc}")

    def is_shim(self):
        return hasattr(self.lib, "orbite_cuda_shim_stats")

    def device_count(self):
        n = ctypes.c_int(0)
        self._ok("cuDeviceGetCount", self.lib.cuDeviceGetCount(ctypes.byref(n)))
        return n.value

    def use(self, device):
        """Makes `device`'s primary context current on this thread."""
        if device not in self.contexts:
            dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
            self._ok("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), device))
            self._ok("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
            self.contexts[device] = (dev.value, ctx)
        self._ok("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self.contexts[device][1]))

    def alloc(self, device, size):
        self.use(device)
        p = ctypes.c_uint64(0)
        self._ok("cuMemAlloc_v2", self.lib.cuMemAlloc_v2(ctypes.byref(p), size))
        self.allocs[p.value] = (device, size)
        return p.value

    def free(self, ptr):
        device, _ = self.allocs.pop(ptr)
        self.use(device)
        self._ok("cuMemFree_v2", self.lib.cuMemFree_v2(ptr))

    def write(self, ptr, data, offset=0):
        """Copies `data` (bytes-like) to device memory at ptr + offset."""
        device = self._device_of(ptr)
        self.use(device)
        src = ctypes.create_string_buffer(bytes(data), len(data))
        self._ok("cuMemcpyHtoD_v2", self.lib.cuMemcpyHtoD_v2(ptr + offset, src, len(data)))

    def read(self, ptr, length, offset=0):
        device = self._device_of(ptr)
        self.use(device)
        dst = ctypes.create_string_buffer(length)
        self._ok("cuMemcpyDtoH_v2", self.lib.cuMemcpyDtoH_v2(dst, ptr + offset, length))
        return dst.raw

    def _device_of(self, ptr):
        for base, (device, size) in self.allocs.items():
            if base <= ptr < base + size:
                return device
        return 0

    def shim_stats(self):
        """orbite_cuda_shim_stats: what the whole process holds of the shim."""
        f = self.lib.orbite_cuda_shim_stats
        f.argtypes = [ctypes.POINTER(_ShimStats)]
        f.restype = ctypes.c_int32
        s = _ShimStats()
        self._ok("orbite_cuda_shim_stats", f(ctypes.byref(s)))
        return {k: getattr(s, k) for k in SHIM_STAT_FIELDS}

    def close(self):
        """Frees what is still allocated and releases the contexts."""
        for ptr in list(self.allocs):
            self.free(ptr)
        for device, (dev, _) in list(self.contexts.items()):
            self._ok("cuDevicePrimaryCtxRelease_v2", self.lib.cuDevicePrimaryCtxRelease_v2(dev))
            del self.contexts[device]


def expect_stats(base, now, what, **overrides):
    """`now` equals `base` except the fields given, which must equal the given values."""
    want = dict(base)
    want.update(overrides)
    bad = [f"{f}={now[f]} (want {want[f]})" for f in STAT_FIELDS if want[f] != now[f]]
    check(not bad, f"{what}: stats differ: " + ", ".join(bad))


def wait_stats(hooks_stats, base, what, timeout=10.0, **overrides):
    """Waits until stats (a callable) match `base` with `overrides`."""
    want = dict(base)
    want.update(overrides)
    last = {}

    def ok():
        last["s"] = hooks_stats()
        return all(last["s"][f] == want[f] for f in STAT_FIELDS)

    try:
        wait_until(ok, timeout, what, interval=0.005)
    except TestFailure:
        bad = [f"{f}={last['s'][f]} (want {want[f]})" for f in STAT_FIELDS if last["s"][f] != want[f]]
        raise TestFailure(f"{what}: stats did not settle: " + ", ".join(bad)) from None
    return last["s"]


def let_go(hooks, done, kind=ORBITE_TEST_RUN, nbytes=0, effect_unknown=0, timeout=20.0):
    """Ends hold_all and lets every held task go with the directive until
    `done()`: a task that took its hold directive before hold_all was turned
    off may only show up as held after an earlier release."""
    hooks.hold_all(False)
    deadline = time.monotonic() + timeout
    while True:
        hooks.release_held(kind, nbytes, effect_unknown)
        if done():
            return
        if time.monotonic() > deadline:
            raise TestFailure(f"work not done {timeout} s after its held tasks were let go")
        hooks.wait_held(1, 20)


# --- NIXL agent helpers -----------------------------------------------------


def _bare(exc):
    """The exception without its traceback (whose frames would keep the agent alive)."""
    exc.__traceback__ = None
    return exc


def is_nixl_error(exc):
    return type(exc).__module__.endswith("_bindings") and type(exc).__name__.startswith("nixl")


def make_agent(name, config=None, style="params"):
    """A NIXL agent with an ORBITE backend, created as a framework would:
    - "params": `create_backend("ORBITE", {"config": config})` (no config: no parameters);
    - "vllm": vLLM's NixlConnector, `nixl_agent_config(backends=["ORBITE"], capture_telemetry=True)`,
      no parameters;
    - "sglang": SGLang's NIXL transfer backend: the backend name and its parameters (a JSON
      object of strings) from SGLANG_DISAGGREGATION_NIXL_BACKEND(_PARAMS)."""
    import json

    from nixl._api import nixl_agent, nixl_agent_config

    if style == "vllm":
        return nixl_agent(name, nixl_agent_config(backends=["ORBITE"], capture_telemetry=True))
    if style == "sglang":
        backend = os.environ.get("SGLANG_DISAGGREGATION_NIXL_BACKEND", "UCX")
        params = json.loads(os.environ.get("SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS", "{}"))
        if not isinstance(params, dict) or not all(isinstance(v, str) for v in params.values()):
            raise ValueError("SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS must be a JSON object of strings")
        agent = nixl_agent(name, nixl_agent_config(backends=[], num_threads=0))
        agent.create_backend(backend, params)
        if backend not in agent.get_plugin_list():
            raise RuntimeError(f"NIXL backend {backend} is not available")
        return agent
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    params = {} if config is None else {"config": config}
    agent.create_backend("ORBITE", params)
    return agent


def conn_endpoint(metadata):
    """The endpoint ORBITE advertises, read from the peer information
    ("ORBP", u16 version, u16 length, u64 epoch, endpoint) inside an agent's
    metadata."""
    import struct

    at = metadata.find(b"ORBP")
    check(at >= 0, "no ORBITE connection info in the agent metadata")
    _, n, _ = struct.unpack_from("<HHQ", metadata, at + 4)
    return metadata[at + 16 : at + 16 + n].decode()


def state(agent, handle):
    """check_xfer_state, with a NIXL exception folded into ('ERR', exc)."""
    try:
        return agent.check_xfer_state(handle), None
    except Exception as exc:  # NIXL's Python agent raises for a negative status
        if not is_nixl_error(exc):
            raise
        return "ERR", _bare(exc)


def drive(agent, handle, timeout=20.0):
    """Polls a posted handle until it leaves PROC. Returns (state, exc)."""
    deadline = time.monotonic() + timeout
    while True:
        s, exc = state(agent, handle)
        if s != "PROC":
            return s, exc
        if time.monotonic() > deadline:
            raise TestFailure(f"transfer still PROC after {timeout} s")
        time.sleep(0.001)


def post(agent, handle, notif=None):
    """transfer(); returns ('DONE'|'PROC'|'ERR', exc)."""
    try:
        if notif is None:
            return agent.transfer(handle), None
        return agent.transfer(handle, notif), None
    except Exception as exc:
        if not is_nixl_error(exc):
            raise
        return "ERR", _bare(exc)


def run_to_done(agent, handle, what, timeout=20.0):
    s, exc = post(agent, handle)
    check(s in ("DONE", "PROC"), f"{what}: post returned {s} {exc!r}")
    s, exc = drive(agent, handle, timeout)
    check(s == "DONE", f"{what}: ended {s} {exc!r}")


def expect_raises(fn, what, *args, **kwargs):
    """Calls fn; it must raise a NIXL error, which is returned."""
    try:
        r = fn(*args, **kwargs)
    except Exception as exc:
        if is_nixl_error(exc):
            return _bare(exc)
        raise
    raise TestFailure(f"{what}: expected a NIXL error, got {r!r}")


def descs(agent, frags):
    """[(addr, len)] -> nixlXferDList of DRAM descriptors (never merged)."""
    return agent.get_xfer_descs([(int(a), int(n), 0) for a, n in frags], "DRAM")


def xfer(agent, op, local, remote, remote_name, notif=b""):
    """initialize_xfer over [(addr, len)] lists (NIXL does not merge them)."""
    return agent.initialize_xfer(op, descs(agent, local), descs(agent, remote), remote_name, notif)


def digest(buf):
    return hashlib.sha256(memoryview(buf).cast("B")).hexdigest()


# --- the second process -------------------------------------------------------


class _Server:
    """State of a peer process; each public method is a command."""

    def __init__(self, name, config, style="params", env=None):
        import numpy as np

        os.environ.update(env or {})
        self.np = np
        self.name = name
        self.agent = make_agent(name, config, style)
        self.hooks = Hooks()
        self.bufs = {}  # key -> numpy array
        self.vbufs = {}  # key -> (device pointer, bytes, CUDA ordinal)
        self.cuda = None  # Cuda, on the first VRAM command
        self.regs = {}  # key -> nixlRegDList
        self.notifs = {}  # sender -> [bytes], everything received so far

    # memory
    def alloc(self, key, size, fill=0):
        buf = self.np.full(size, fill, dtype=self.np.uint8)
        self.bufs[key] = buf
        return buf.ctypes.data

    def register(self, key, size, fill=0):
        addr = self.alloc(key, size, fill)
        self.regs[key] = self.agent.register_memory([(addr, size, 0, "")], "DRAM")
        return addr

    def deregister(self, key):
        self.agent.deregister_memory(self.regs.pop(key))

    # device memory (the CUDA driver: the shim in the tests)
    def _driver(self):
        if self.cuda is None:
            self.cuda = Cuda()
        return self.cuda

    def vram_alloc(self, key, size, device=0, fill=0):
        cuda = self._driver()
        ptr = cuda.alloc(device, size)
        cuda.write(ptr, bytes([fill]) * size)
        self.vbufs[key] = (ptr, size, device)
        return ptr

    def vram_register(self, key, size=None, device=None, offset=0):
        """Registers [ptr + offset, + size) of `key` as VRAM of `device`
        (default: the allocation's own range and ordinal)."""
        ptr, n, dev = self.vbufs[key]
        size = n if size is None else size
        device = dev if device is None else device
        self.regs[key] = self.agent.register_memory([(ptr + offset, size, device, "")], "VRAM")
        return ptr

    def vram_write(self, key, offset, data):
        self.cuda.write(self.vbufs[key][0], data, offset)

    def vram_read(self, key, offset=0, length=None):
        ptr, n, _ = self.vbufs[key]
        return self.cuda.read(ptr, n - offset if length is None else length, offset)

    def vram_free(self, key):
        ptr, _, _ = self.vbufs.pop(key)
        self.cuda.free(ptr)

    def shim_stats(self):
        return self._driver().shim_stats()

    def all_stats(self):
        return self.hooks.all_stats()

    def drop_agent(self):
        """Deregisters everything and destroys the agent (its backend and
        engine); returns the shim's counters afterwards."""
        import gc

        for key in list(self.regs):
            self.deregister(key)
        self.agent = None
        self.hooks = None
        gc.collect()
        return self.shim_stats()

    def reregister(self, key):
        """Deregisters the buffer and registers the same memory again."""
        self.deregister(key)
        buf = self.bufs[key]
        self.regs[key] = self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        return buf.ctypes.data

    def partial_metadata(self, keys, inc_conn_info=False):
        """The agent's partial metadata for the registrations `keys`."""
        descs = self.agent.get_reg_descs(
            [(self.bufs[k].ctypes.data, self.bufs[k].nbytes, 0, "") for k in keys], "DRAM")
        return self.agent.get_partial_agent_metadata(descs, inc_conn_info, ["ORBITE"])

    def write(self, key, offset, data):
        self.bufs[key][offset : offset + len(data)] = self.np.frombuffer(data, dtype=self.np.uint8)

    def read(self, key, offset=0, length=None):
        buf = self.bufs[key]
        end = buf.nbytes if length is None else offset + length
        return bytes(buf[offset:end])

    def digest(self, key):
        return digest(self.bufs[key])

    # agent metadata
    def metadata(self):
        return self.agent.get_agent_metadata()

    def add_remote(self, md):
        name = self.agent.add_remote_agent(md)
        return name.decode() if isinstance(name, bytes) else name

    def remove_remote(self, name):
        self.agent.remove_remote_agent(name)

    # engine hooks
    def stats(self):
        return self.hooks.stats()

    def hold_remote(self, on):
        self.hooks.hold_remote(on)

    def hold_all(self, on):
        self.hooks.hold_all(on)

    def wait_held(self, n, timeout_ms=10000):
        return self.hooks.wait_held(n, timeout_ms)

    def release_held(self, kind=ORBITE_TEST_RUN, nbytes=0, effect_unknown=0):
        self.hooks.release_held(kind, nbytes, effect_unknown)

    # notifications
    def poll_notifs(self):
        for sender, msgs in self.agent.get_new_notifs().items():
            self.notifs.setdefault(sender, []).extend(msgs)
        return {k: list(v) for k, v in self.notifs.items()}

    def wait_notifs(self, sender, count, timeout=10.0):
        """Waits until `count` notifications from `sender` arrived; returns them all."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.poll_notifs().get(sender, [])
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.001)

    def wait_for(self, sender, payload, timeout=10.0):
        """Waits until `payload` arrived from `sender`; returns everything from
        `sender` so far (and forgets it)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.poll_notifs().get(sender, [])
            if payload in got or time.monotonic() > deadline:
                self.notifs.pop(sender, None)
                return got
            time.sleep(0.001)

    def send_notif(self, to, msg):
        self.agent.send_notif(to, msg)
        return True

    def shutdown(self):
        if self.agent is not None:
            for key in list(self.regs):
                self.deregister(key)
        return True


def serve(conn, name, config, style="params", env=None):
    """Entry point of a peer process (multiprocessing target)."""
    try:
        server = _Server(name, config, style, env)
        conn.send(("ok", os.getpid()))
    except BaseException as exc:  # report why the peer could not start
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        cmd, args, kwargs = msg
        if cmd == "quit":
            # an orderly end: the agent, its backend and engine are destroyed
            try:
                server.shutdown()
                del server
                import gc

                gc.collect()
                conn.send(("ok", None))
            except BaseException as exc:
                conn.send(("exc", (type(exc).__name__, str(exc), traceback.format_exc())))
            conn.close()
            return
        if cmd == "exit":
            conn.send(("ok", None))
            conn.close()
            os._exit(0)  # no teardown at all: as a crashed process would
        try:
            conn.send(("ok", getattr(server, cmd)(*args, **kwargs)))
        except BaseException as exc:
            conn.send(("exc", (type(exc).__name__, str(exc), traceback.format_exc())))


class PeerError(Exception):
    """A command raised in the peer; `kind` is the exception's type name."""

    def __init__(self, kind, msg, tb):
        super().__init__(f"{kind}: {msg}")
        self.kind = kind
        self.tb = tb


class Peer:
    """A second process with its own NIXL agent named `name`."""

    def __init__(self, name, config=None, start_timeout=30.0, style="params", env=None):
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, name, config, style, env), daemon=True)
        self.proc.start()
        child.close()
        tag, val = self._recv(start_timeout, "start")
        if tag != "ok":
            self.kill()
            raise TestFailure(f"peer {name} failed to start: {val}")
        self.pid = val

    def _recv(self, timeout, what):
        if not self.conn.poll(timeout):
            self.kill()
            raise TestFailure(f"peer {self.name}: no answer to {what} within {timeout} s")
        try:
            return self.conn.recv()
        except EOFError:
            self.kill()
            raise TestFailure(f"peer {self.name} died during {what}") from None

    def call(self, cmd, *args, timeout=30.0, **kwargs):
        self.conn.send((cmd, args, kwargs))
        tag, val = self._recv(timeout, cmd)
        if tag == "exc":
            raise PeerError(*val)
        return val

    def __getattr__(self, cmd):
        if cmd.startswith("_"):
            raise AttributeError(cmd)
        return lambda *a, **k: self.call(cmd, *a, **k)

    def exit(self, timeout=10.0):
        """Ends the process abruptly (os._exit: no NIXL or engine teardown)."""
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=timeout)
            except (TestFailure, OSError, BrokenPipeError):
                pass
        self.proc.join(timeout)
        self.kill()

    def quit(self, timeout=20.0):
        """Ends the process in order; it must exit with status 0."""
        if not self.proc.is_alive():
            return
        self.call("quit", timeout=timeout)
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
            raise TestFailure(f"peer {self.name} did not exit within {timeout} s of an orderly quit")
        check(self.proc.exitcode == 0, f"peer {self.name} exited with status {self.proc.exitcode} after quit")

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        try:
            self.conn.close()
        except OSError:
            pass


class Peers:
    """Context manager that kills every peer it started, on any exit."""

    def __init__(self):
        self.peers = []

    def start(self, name, config=None, style="params", env=None):
        p = Peer(name, config, style=style, env=env)
        self.peers.append(p)
        return p

    def close_all(self):
        """Orderly end of every peer still running (checked)."""
        for p in self.peers:
            p.quit()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.peers:
            try:
                p.kill()
            except Exception:
                pass
        return False


# ---------------------------------------------------------------------------
# The runner both suites share: one test per fresh process
# ---------------------------------------------------------------------------


def child_main(fn, result_path, notes):
    """In the child: runs `fn` and writes its result for `run_child`."""
    import json

    result = {"ok": False, "reason": "", "notes": []}
    try:
        fn()
        result["ok"] = True
    except TestFailure as e:
        result["reason"] = str(e)
        traceback.print_exc()
    except PeerError as e:
        result["reason"] = f"a peer command raised {e}"
        print(e.tb, file=sys.stderr)
        traceback.print_exc()
    except Exception as e:
        result["reason"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    result["notes"] = notes
    with open(result_path, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # a normal exit follows: agents and engines are destroyed, which must not crash


def run_child(script, label, args, timeout, verbose, tail):
    """Runs `script --child *args RESULT` in its own session (killed with
    every process it started when it ends or times out), then prints
    `PASS label` or `FAIL label: reason` with its notes and the last `tail`
    lines of its output. True if it passed."""
    import json
    import signal
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="orbite-nixl-") as tmp:
        res_path = os.path.join(tmp, "result.json")
        log_path = os.path.join(tmp, "log")
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(script), "--child", *args, res_path],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )
            reason = None
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None
                reason = f"timed out after {timeout} s"
            finally:
                # the test's session: the test process and every peer it started
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        took = time.monotonic() - t0
        result = None
        if os.path.exists(res_path):
            with open(res_path) as f:
                result = json.load(f)
        if reason is None:
            if result is None:
                reason = f"exited with status {rc} before reporting a result"
            elif not result["ok"]:
                reason = result["reason"]
            elif rc != 0:
                reason = f"passed, then the process exited with status {rc} (teardown)"
        with open(log_path, "rb") as f:
            log_text = f.read().decode("utf-8", "replace")
    print(f"PASS {label}" if reason is None else f"FAIL {label}: {reason}")
    if verbose or reason is not None:
        print(f"    ({took:.1f} s)")
        for n in (result or {}).get("notes", []):
            print(f"    note: {n}")
        lines = log_text.rstrip().splitlines()
        for line in lines if verbose else lines[-tail:]:
            print(f"    | {line}")
    sys.stdout.flush()
    return reason is None


def suite_main(argv, script, tests, notes, label, timeout):
    """The command line of a suite: `script [-v] [TEST ...]` runs the tests
    (each in a fresh process, `run_child`) and ends with `{label}: N
    passed, M failed`; `script --child NAME RESULT` runs one test."""
    if len(argv) == 4 and argv[1] == "--child":
        child_main(dict(tests)[argv[2]], argv[3], notes)
        return 0
    verbose = "-v" in argv[1:]
    names = [a for a in argv[1:] if a != "-v"]
    known = dict(tests)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"unknown test(s): {', '.join(unknown)}; known: {', '.join(known)}")
        print(f"{label}: 0 passed, 1 failed")
        return 1
    missing = [v for v in ("NIXL_PLUGIN_DIR", "ORBITE_NIXL_LIB") if not os.environ.get(v)]
    if missing:
        print(f"FAIL environment: {', '.join(missing)} not set (run scripts/nixl-tests)")
        print(f"{label}: 0 passed, 1 failed")
        return 1
    passed = failed = 0
    for name, _ in tests:
        if names and name not in names:
            continue
        if run_child(script, name, [name], timeout, verbose, tail=60):
            passed += 1
        else:
            failed += 1
    print(f"{label}: {passed} passed, {failed} failed")
    return 1 if failed else 0
