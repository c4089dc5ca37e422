#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""VRAM through the NIXL backend ORBITE and NIXL's own Python agent (the PyPI
wheel nixl==1.5.1), with the CUDA driver shim (orbite-cuda-shim) standing in
for libcuda: its device memory is PROT_NONE in the process, so a passing
test shows that only driver copies reached it.

Environment (as scripts/nixl-tests sets it): NIXL_PLUGIN_DIR, ORBITE_NIXL_LIB
(the staged liborbite_nixl.so.1, built with test hooks and feature cuda),
NIXL_LOG_LEVEL (WARN), and the shim's folder (`scripts/cuda-shim`) on
LD_LIBRARY_PATH. Where no shim is found the suite prints SKIP and why;
with ORBITE_CUDA_SHIM_REQUIRED=1 (scripts/nixl-tests) that is a failure.

    vram_tests.py [-v] [TEST ...]

Each test runs in a fresh process (orbite_harness.suite_main); device
memory is allocated with the driver (orbite_harness.Cuda), registered as
"VRAM" with devId = the CUDA ordinal, filled and read back with driver
copies. The shim has two devices unless ORBITE_CUDA_SHIM_DEVICES says
otherwise.

- v01_advertised: VRAM_SEG in the plugin's and the backend's memory types
  with the shim (ORBITE_FILE: DRAM_SEG + FILE_SEG + VRAM_SEG). In subprocesses
  with no device (ORBITE_CUDA_SHIM_DEVICES=0), a failing cuInit, and
  without the shim on the library path: DRAM_SEG only (ORBITE_FILE: DRAM_SEG + FILE_SEG), VRAM registration
  finds no backend (or, naming ORBITE, is refused with the engine's reason
  in the log), and DRAM still moves.
- v02_local: transfers within one agent (the engine's self connection):
  every pairing of DRAM, VRAM on device 0 and VRAM on device 1, READ and
  WRITE, two fragments each, one larger than a staging chunk; bytes and
  the guard bytes around every source and target range checked.
- v03_peer_write, v03_peer_read: the same pairings with a second process
  (local DRAM/VRAM x remote DRAM/VRAM); both sides checked.
- v05_slow_copies: v03's pairings, both ops, with every asynchronous
  device copy delayed (ORBITE_CUDA_SHIM_COPY_DELAY_US) in both processes.
- v04_bad_registration: VRAM registrations of host memory, a freed device
  pointer, a range past its allocation, the wrong ordinal and an ordinal
  with no device are refused (nixlBackendError: the agent's "registration
  failed for all potential backends") and change no charge; the engine then
  still registers and moves VRAM.

- v06_files: VRAM to and from files through ORBITE_FILE (the engine's
  staging buffers), with the page cache and with O_DIRECT, aligned and
  unaligned extents; file and device bytes and guards checked.

Every test ends with the engine's charges at baseline after deregistration
and, once the agent is gone, the shim's counters (allocations, contexts,
streams, events, pinned buffers) at what the test itself still holds.
"""

import gc
import json
import os
import random
import subprocess
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import orbite_harness as H  # noqa: E402
from orbite_harness import Cuda, Hooks, Peers, TestFailure, check, make_agent  # noqa: E402

NOTES = []
GUARD = 4096
CHUNK = 1 << 20  # the engine's default staging chunk
SIZE = 2 * GUARD + 3 * CHUNK + 8192


def note(msg):
    NOTES.append(msg)
    print(f"note: {msg}")


def np():
    import numpy

    return numpy


def pattern(n, seed):
    return random.Random(seed).randbytes(n)


def fragments():
    """Two target/source fragments inside the guards: one over a staging
    chunk (odd offset and length), one small, with a gap between them."""
    a = (GUARD + 1, 2 * CHUNK + 3)
    b = (a[0] + a[1] + 100, 64 * 1024 + 7)
    check(b[0] + b[1] <= SIZE - GUARD, "fragments run into the trailing guard")
    return [a, b]


def first_diff(got, want):
    for i, (x, y) in enumerate(zip(got, want)):
        if x != y:
            return i
    return min(len(got), len(want)) if len(got) != len(want) else -1


def same(got, want, what):
    at = first_diff(got, want)
    check(at < 0, f"{what}: bytes differ first at offset {at} (of {len(want)})")


# --- memory on either side ----------------------------------------------------


class LocalMem:
    """A buffer of this process: DRAM (numpy) or VRAM (driver memory)."""

    def __init__(self, agent, cuda, kind, device, size, name):
        self.agent, self.cuda, self.kind, self.size, self.name = agent, cuda, kind, size, name
        self.dev = device if kind == "VRAM" else 0
        if kind == "DRAM":
            self.buf = np().zeros(size, dtype=np().uint8)
            self.addr = self.buf.ctypes.data
        else:
            self.addr = cuda.alloc(device, size)
        self.reg = agent.register_memory([(self.addr, size, self.dev, "")], kind)

    def fill(self, data):
        if self.kind == "DRAM":
            self.buf[:] = np().frombuffer(data, dtype=np().uint8)
        else:
            self.cuda.write(self.addr, data)

    def bytes(self):
        return bytes(self.buf) if self.kind == "DRAM" else self.cuda.read(self.addr, self.size)

    def release(self):
        self.agent.deregister_memory(self.reg)
        self.reg = None
        self.agent = None  # so that the agent can go


class PeerMem:
    """A buffer of the peer process, reached through its commands."""

    def __init__(self, peer, kind, device, size, name):
        self.peer, self.kind, self.size, self.name = peer, kind, size, name
        self.dev = device if kind == "VRAM" else 0
        if kind == "DRAM":
            self.addr = peer.register(name, size)
        else:
            peer.vram_alloc(name, size, device)
            self.addr = peer.vram_register(name)

    def fill(self, data):
        if self.kind == "DRAM":
            self.peer.write(self.name, 0, data)
        else:
            self.peer.vram_write(self.name, 0, data)

    def bytes(self):
        if self.kind == "DRAM":
            return self.peer.read(self.name)
        return self.peer.vram_read(self.name)


def label(m):
    return "DRAM" if m.kind == "DRAM" else f"VRAM{m.dev}"


def move(agent, op, local, remote, remote_name, seed, what):
    """One transfer of fragments() between `local` and `remote` (NIXL's op:
    READ moves remote -> local, WRITE local -> remote); checks the target's
    bytes, its guards and gaps, and that the source is unchanged."""
    src, dst = (local, remote) if op == "WRITE" else (remote, local)
    src_bytes, dst_bytes = pattern(SIZE, seed), pattern(SIZE, seed + 1)
    src.fill(src_bytes)
    dst.fill(dst_bytes)
    frags = fragments()
    ldescs = agent.get_xfer_descs([(local.addr + o, n, local.dev) for o, n in frags], local.kind)
    rdescs = agent.get_xfer_descs([(remote.addr + o, n, remote.dev) for o, n in frags], remote.kind)
    handle = agent.initialize_xfer(op, ldescs, rdescs, remote_name)
    try:
        H.run_to_done(agent, handle, what, timeout=60.0)
    finally:
        agent.release_xfer_handle(handle)
    want = bytearray(dst_bytes)
    for o, n in frags:
        want[o : o + n] = src_bytes[o : o + n]
    same(dst.bytes(), bytes(want), f"{what}: the target (guards and gaps included)")
    same(src.bytes(), src_bytes, f"{what}: the source")


def devices(cuda):
    n = cuda.device_count()
    check(n >= 1, "the shim reports no device")
    return [0, 1] if n >= 2 else [0]


def settle(hooks, base, what):
    """The engine's charges back at `base` (staging buffers excepted: they
    are kept for reuse until the engine closes, bounded by max_staging_bytes)."""
    fields = H.STAT_FIELDS + ["device_allocations", "device_memory_bytes"]
    last = {}

    def ok():
        last["s"] = hooks.all_stats()
        return all(last["s"][f] == base[f] for f in fields)

    try:
        H.wait_until(ok, 10.0, what, interval=0.005)
    except TestFailure:
        bad = [f"{f}={last['s'][f]} (want {base[f]})" for f in fields if last["s"][f] != base[f]]
        raise TestFailure(f"{what}: engine stats did not settle: " + ", ".join(bad)) from None
    s = last["s"]
    note(f"{what}: staging {s['staging_buffers']} buffers, {s['staging_bytes']} bytes (kept until close)")
    check(s["staging_bytes"] <= 1 << 30, f"{what}: staging over the default bound")


def shim_clean(cuda, what, allocations, bytes_held):
    """The shim's counters once the agent is gone: only what the test holds."""
    s = cuda.shim_stats()
    want = {
        "device_allocations": allocations,
        "device_bytes": bytes_held,
        "host_allocations": 0,
        "host_registrations": 0,
        "ipc_imports": 0,
        "streams": 0,
        "events": 0,
        "context_retains": len(cuda.contexts),
    }
    bad = [f"{k}={s[k]} (want {v})" for k, v in want.items() if s[k] != v]
    check(not bad, f"{what}: shim counters: " + ", ".join(bad))
    note(f"{what}: shim copied {s['copied_bytes']} bytes in {s['async_copies']} asynchronous copies")


# --- tests --------------------------------------------------------------------

PROBE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import numpy
import orbite_harness as H
from nixl._api import nixl_agent, nixl_agent_config
out = {}
a = nixl_agent("P", nixl_agent_config(backends=[]))
out["plugin"] = a.get_plugin_mem_types("ORBITE")
out["file_plugin"] = a.get_plugin_mem_types("ORBITE_FILE")
a.create_backend("ORBITE", {})
out["backend"] = a.get_backend_mem_types("ORBITE")
buf = numpy.zeros(8192, dtype=numpy.uint8)
for key, backends in (("vram_any", []), ("vram_orbite", ["ORBITE"])):
    try:
        a.register_memory([(buf.ctypes.data, 4096, 0, "")], "VRAM", backends)
        out[key] = "registered"
    except Exception as e:
        out[key] = type(e).__name__
src, dst = numpy.full(4096, 7, dtype=numpy.uint8), numpy.zeros(4096, dtype=numpy.uint8)
r1 = a.register_memory([(src.ctypes.data, 4096, 0, "")], "DRAM")
r2 = a.register_memory([(dst.ctypes.data, 4096, 0, "")], "DRAM")
h = a.initialize_xfer("WRITE", H.descs(a, [(src.ctypes.data, 4096)]), H.descs(a, [(dst.ctypes.data, 4096)]), "P")
H.run_to_done(a, h, "a DRAM write")
a.release_xfer_handle(h)
out["dram_moved"] = bool((dst == 7).all())
a.deregister_memory(r1)
a.deregister_memory(r2)
print("PROBE " + json.dumps(out))
"""


def probe(env_change, drop_shim=False):
    env = dict(os.environ)
    env.update(env_change)
    if drop_shim:
        paths = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
        env["LD_LIBRARY_PATH"] = ":".join(d for d in paths if not os.path.exists(os.path.join(d, "libcuda.so.1")))
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", PROBE, here], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in p.stdout.splitlines() if line.startswith("PROBE ")]
    check(p.returncode == 0 and lines, f"probe {env_change} exited {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(lines[-1][6:]), p.stderr


def v01_advertised():
    agent = make_agent("A")
    plugin = agent.get_plugin_mem_types("ORBITE")
    backend = agent.get_backend_mem_types("ORBITE")
    note(f"with the shim: plugin {plugin}, backend {backend}")
    check(sorted(plugin) == ["DRAM_SEG", "VRAM_SEG"], f"the plugin advertises {plugin}")
    check(sorted(backend) == ["DRAM_SEG", "VRAM_SEG"], f"the backend advertises {backend}")
    file_mems = agent.get_plugin_mem_types("ORBITE_FILE")
    check(sorted(file_mems) == ["DRAM_SEG", "FILE_SEG", "VRAM_SEG"], f"ORBITE_FILE advertises {file_mems}")
    del agent
    gc.collect()

    for what, change, drop, reason in (
        ("no device", {"ORBITE_CUDA_SHIM_DEVICES": "0"}, False, "no CUDA device"),
        ("cuInit failing", {"ORBITE_CUDA_SHIM_INIT_ERROR": "100"}, False, "cuInit failed"),
        ("no driver", {}, True, "no CUDA driver"),
    ):
        if drop:
            # A real driver elsewhere on the library path would be found.
            env_paths = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
            kept = [d for d in env_paths if not os.path.exists(os.path.join(d, "libcuda.so.1"))]
            code = "import ctypes, sys\ntry:\n    ctypes.CDLL('libcuda.so.1')\nexcept OSError:\n    sys.exit(3)"
            rc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, LD_LIBRARY_PATH=":".join(kept)),
                                timeout=30).returncode
            if rc != 3:
                note(f"SKIP {what}: a libcuda.so.1 is found without the shim (a real driver); not probed")
                continue
        out, err = probe(change, drop)
        note(f"{what}: {out}")
        check(out["plugin"] == ["DRAM_SEG"], f"{what}: the plugin advertises {out['plugin']}")
        check(out["backend"] == ["DRAM_SEG"], f"{what}: the backend advertises {out['backend']}")
        check(sorted(out["file_plugin"]) == ["DRAM_SEG", "FILE_SEG"], f"{what}: ORBITE_FILE {out['file_plugin']}")
        check(out["vram_any"] == "nixlNotFoundError", f"{what}: VRAM registration: {out['vram_any']}")
        check(out["vram_orbite"] == "nixlBackendError", f"{what}: VRAM registration on ORBITE: {out['vram_orbite']}")
        check(reason in err, f"{what}: the refusal does not say {reason!r}: {err[-1500:]}")
        check(out["dram_moved"], f"{what}: DRAM did not move")


def v02_local():
    cuda = Cuda()
    devs = devices(cuda)
    agent = make_agent("A")
    hooks = Hooks()
    base = hooks.all_stats()
    mems = [LocalMem(agent, cuda, "DRAM", 0, SIZE, "d")] + [
        LocalMem(agent, cuda, "VRAM", d, SIZE, f"v{d}") for d in devs
    ]
    others = [LocalMem(agent, cuda, "DRAM", 0, SIZE, "d2")] + [
        LocalMem(agent, cuda, "VRAM", d, SIZE, f"w{d}") for d in devs
    ]
    seed = 1
    for op in ("WRITE", "READ"):
        for local in mems:
            for remote in others:
                seed += 2
                move(agent, op, local, remote, "A", seed, f"self {op} local {label(local)} remote {label(remote)}")
    note(f"{seed // 2} local transfers over {len(devs)} devices")
    for m in mems + others:
        m.release()
    settle(hooks, base, "after deregistration")
    held = len(cuda.allocs)
    del agent, hooks, mems, others
    gc.collect()
    shim_clean(cuda, "agent gone", held, held * SIZE)
    cuda.close()
    s = cuda.shim_stats()
    check(s["device_allocations"] == 0 and s["context_retains"] == 0, f"after freeing: {s}")


def peer_pairings(op):
    cuda = Cuda()
    devs = devices(cuda)
    with Peers() as peers:
        t = peers.start("T")
        agent = make_agent("A")
        hooks = Hooks()
        base = hooks.all_stats()
        t_base = t.all_stats()
        mine = [LocalMem(agent, cuda, "DRAM", 0, SIZE, "d")] + [
            LocalMem(agent, cuda, "VRAM", d, SIZE, f"v{d}") for d in devs
        ]
        theirs = [PeerMem(t, "DRAM", 0, SIZE, "d")] + [PeerMem(t, "VRAM", d, SIZE, f"v{d}") for d in devs]
        check(agent.add_remote_agent(t.metadata()) in (b"T", "T"), "add_remote_agent did not return T")
        t.add_remote(agent.get_agent_metadata())
        seed = 100
        for local in mine:
            for remote in theirs:
                seed += 2
                move(agent, op, local, remote, "T", seed, f"{op} local {label(local)} peer {label(remote)}")
        # Same host: the peer's device memory was opened here through CUDA
        # IPC, once per allocation, and the peer staged nothing.
        now = hooks.all_stats()
        check(now["cuda_imports"] == base["cuda_imports"] + len(devs),
              f"CUDA IPC imports {now['cuda_imports']} (want {base['cuda_imports'] + len(devs)})")
        t_mid = t.all_stats()
        check(t_mid["staging_buffers"] == t_base["staging_buffers"],
              f"the peer staged ({t_mid['staging_buffers']} buffers): its VRAM should be reached through CUDA IPC")
        for m in mine:
            m.release()
        # the peer's handle goes with remove_remote_agent
        agent.remove_remote_agent("T")
        settle(hooks, base, "local, after deregistration and remove_remote_agent")
        for m in theirs:
            t.deregister(m.name)
        t_now = t.all_stats()
        note(f"peer: staging {t_now['staging_buffers']} buffers, {t_now['staging_bytes']} bytes")
        for f in ("registrations", "registered_bytes", "executions", "bytes_in_flight", "device_allocations"):
            check(t_now[f] == t_base[f], f"peer: {f}={t_now[f]} (want {t_base[f]})")
        held = len(cuda.allocs)
        del agent, hooks, mine
        gc.collect()
        shim_clean(cuda, "local agent gone", held, held * SIZE)
        s = t.drop_agent()
        want = {"device_allocations": len(devs), "device_bytes": len(devs) * SIZE, "host_allocations": 0,
                "ipc_imports": 0, "streams": 0, "events": 0, "context_retains": len(devs)}
        bad = [f"{k}={s[k]} (want {v})" for k, v in want.items() if s[k] != v]
        check(not bad, "peer, agent gone: shim counters: " + ", ".join(bad))
        for m in theirs:
            if m.kind == "VRAM":
                t.vram_free(m.name)
        peers.close_all()
    cuda.close()


def v03_peer_write():
    peer_pairings("WRITE")


def v03_peer_read():
    peer_pairings("READ")


def v05_slow_copies():
    # Read by each process's first cuInit: this test's and the peer's
    # (spawned with this environment). Every asynchronous copy waits on its
    # stream first, so a status or a byte check that came before the
    # engine's device copies retired would see old bytes.
    os.environ["ORBITE_CUDA_SHIM_COPY_DELAY_US"] = "2000"
    peer_pairings("WRITE")
    peer_pairings("READ")


def v04_bad_registration():
    cuda = Cuda()
    devs = devices(cuda)
    agent = make_agent("A")
    hooks = Hooks()
    base = hooks.all_stats()
    host = np().zeros(8192, dtype=np().uint8)
    live = cuda.alloc(0, 8192)
    freed = cuda.alloc(0, 8192)
    cuda.free(freed)
    cases = [
        ("host memory", host.ctypes.data, 4096, 0),
        ("a freed device pointer", freed, 4096, 0),
        ("a range past its allocation", live + 4096, 8192, 0),
        ("an ordinal with no device", live, 4096, 64),
    ]
    if len(devs) > 1:
        cases.append(("the wrong ordinal", live, 4096, 1))
    for what, addr, n, dev in cases:
        for backends in ([], ["ORBITE"]):
            exc = H.expect_raises(agent.register_memory, what, [(addr, n, dev, "")], "VRAM", backends)
            check(type(exc).__name__ == "nixlBackendError", f"{what}: {exc!r}")
            now = hooks.all_stats()
            check(now == base, f"{what}: charges changed: {now} (was {base})")
        note(f"{what}: {exc!r}")
    # still serving: the good range registers and moves
    good = LocalMem(agent, cuda, "VRAM", 0, SIZE, "v")
    dram = LocalMem(agent, cuda, "DRAM", 0, SIZE, "d")
    move(agent, "WRITE", dram, good, "A", 7, "DRAM -> VRAM after the refusals")
    move(agent, "READ", dram, good, "A", 9, "VRAM -> DRAM after the refusals")
    good.release()
    dram.release()
    settle(hooks, base, "after deregistration")
    held = len(cuda.allocs)
    del agent, hooks, good, dram
    gc.collect()
    shim_clean(cuda, "agent gone", held, 8192 + SIZE)
    cuda.close()


def v06_files():
    import tempfile
    import time

    from nixl._api import nixl_agent, nixl_agent_config

    cuda = Cuda()
    agent = nixl_agent("F", nixl_agent_config(backends=[]))
    agent.create_backend("ORBITE_FILE")
    check("VRAM_SEG" in agent.get_backend_mem_types("ORBITE_FILE"), "ORBITE_FILE takes VRAM")
    size = 1 << 20
    ptr = cuda.alloc(0, size)
    vram = agent.register_memory([(ptr, size, 0, "")], "VRAM")
    rng = random.Random(6)
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        for direct in (False, True):
            path = os.path.join(folder, f"f{int(direct)}")
            on_file = bytearray(rng.randbytes(size))
            with open(path, "wb") as f:
                f.write(on_file)
            fd = os.open(path, os.O_RDWR | (os.O_DIRECT if direct else 0))
            reg = agent.register_memory([(0, size, fd, path)], "FILE")
            # (device offset, file offset, length): aligned, and unaligned
            pairs = [(0, 4096, 262144), (300_001, 600_003, 70_000)]
            for op in ("WRITE", "READ"):
                dev = bytearray(rng.randbytes(size))
                cuda.write(ptr, dev)
                local = agent.get_xfer_descs([(ptr + d, n, 0) for d, _, n in pairs], "VRAM")
                remote = agent.get_xfer_descs([(o, n, fd) for _, o, n in pairs], "FILE")
                h = agent.initialize_xfer(op, local, remote, "F")
                state = agent.transfer(h)
                deadline = time.time() + 20
                while state not in ("DONE", "ERR") and time.time() < deadline:
                    state = agent.check_xfer_state(h)
                check(state == "DONE", f"direct={direct} {op}: {state}")
                agent.release_xfer_handle(h)
                if op == "WRITE":
                    for d, o, n in pairs:
                        on_file[o:o + n] = dev[d:d + n]
                    with open(path, "rb") as f:
                        check(f.read() == bytes(on_file), f"direct={direct}: file bytes or guards after the WRITE")
                    check(cuda.read(ptr, size) == bytes(dev), f"direct={direct}: the device source changed")
                else:
                    want = bytearray(dev)
                    for d, o, n in pairs:
                        want[d:d + n] = on_file[o:o + n]
                    check(cuda.read(ptr, size) == bytes(want), f"direct={direct}: device bytes or guards after the READ")
            agent.deregister_memory(reg)
            os.close(fd)
    agent.deregister_memory(vram)
    del agent
    gc.collect()
    cuda.free(ptr)
    cuda.close()
    note("VRAM to and from files, page cache and O_DIRECT: ok")


TESTS = [
    ("v01_advertised", v01_advertised),
    ("v02_local", v02_local),
    ("v03_peer_write", v03_peer_write),
    ("v03_peer_read", v03_peer_read),
    ("v04_bad_registration", v04_bad_registration),
    ("v05_slow_copies", v05_slow_copies),
    ("v06_files", v06_files),
]

LABEL = "python vram tests"


def shim_missing():
    """Why the suite cannot run here, or None."""
    try:
        cuda = Cuda()
    except OSError as e:
        return f"no libcuda.so.1 on the library path ({e}); put `scripts/cuda-shim` on LD_LIBRARY_PATH"
    except TestFailure as e:
        return f"the driver does not start: {e}"
    if not cuda.is_shim():
        return "the libcuda.so.1 found is not the shim (these tests need its PROT_NONE memory and counters)"
    return None


def main(argv):
    if not (len(argv) == 4 and argv[1] == "--child"):
        why = shim_missing()
        if why is not None:
            if os.environ.get("ORBITE_CUDA_SHIM_REQUIRED") == "1":
                print(f"FAIL vram tests: {why} (ORBITE_CUDA_SHIM_REQUIRED=1)")
                print(f"{LABEL}: 0 passed, 1 failed")
                return 1
            print(f"SKIP: vram tests: {why}")
            print(f"{LABEL}: 0 passed, 0 failed")
            return 0
    return H.suite_main(argv, __file__, TESTS, NOTES, LABEL, timeout=300)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
