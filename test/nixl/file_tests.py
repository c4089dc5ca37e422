#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tests of the local-only NIXL backend ORBITE_FILE through NIXL's own Python
agent (the PyPI wheel nixl==1.5.1), on the machine's real filesystems: every
test runs once on a tmpfs (/dev/shm) and once on the disk under /tmp.

Environment (as scripts/nixl-tests sets it): NIXL_PLUGIN_DIR (the folder of
libplugin_ORBITE_FILE.so), ORBITE_NIXL_LIB (the staged liborbite_nixl.so.1
with test hooks: the library the plugin loads), NIXL_LOG_LEVEL (WARN).

    file_tests.py [-v] [TEST[tmpfs|disk] ...]

Each test runs in a fresh process (its own session, killed on timeout) with
one agent created with backends=[] and create_backend("ORBITE_FILE", {}), so
the only OrbiTE engine in the process is the file backend's (reached through
orbite_harness.Hooks). It works in a fresh folder on the filesystem under
test, removed afterwards. Prints `PASS name[fs]` or `FAIL name[fs]: reason`
(with the test's log on failure, always with -v), then
`python file tests: N passed, M failed`; exits nonzero on any failure.

NIXL's file convention: a FILE descriptor is (file offset, length, fd); the
registration (0, length, fd, path) covers [0, length) of the file. NIXL's
READ moves the remote list's bytes into the local list, WRITE the reverse;
the "remote" agent of these local transfers is the agent itself.

The tests (each ends with the engine's stats back at its baseline):
- n09_positions: FILE on the remote and on the local list x READ and WRITE,
  fragments at odd offsets; file, memory and guard bytes; reposts.
- n09_fragmented: ~2300 descriptors over 3 files and 2 buffers, adjacent
  runs (one of 1500 extents, beyond IOV_MAX), gaps, one extent > a task.
- n09_eof: READs that meet the end of a short file: an error, the prefix
  landed, nothing beyond it written, no replay.
- n09_fd_reuse: the caller's fd closed and its number reused by another
  file: reads and writes still reach the registered (adopted) file.
- n09_close_during_io: deregister_memory of the file while its transfer is
  held (test hooks) or running, from another thread: it returns, the work
  drains with an outcome, no byte moves after the fence, later requests on
  the file are refused.
- n09_repost_one_file_closed, n09_multi_file_budget: a request over two
  files whose post cannot go through for one of them (one file
  deregistered; max_executions 1) must move no bytes and must not report
  an error while part of it still runs (tasks held to see it).
- n09_release_while_active: NIXL's second release of a held request must
  not leak the engine's transfer (nor keep the engine alive).
- n09_refused: unsupported requests refused before any I/O.
- n09_query_memory: size, mode and mtime from stat, None for missing paths;
  a registered descriptor answers from the engine.
- n09_direct: O_DIRECT and O_DSYNC files, aligned and bounced spans, the
  query's direct-I/O keys, a refusal's reason in NIXL's log.
- n09_poll_yields: a poll of a request in progress yields the processor
  once (sched_yield, counted by a shim preloaded into that test's process
  only), a poll of a finished one never.

What NIXL 1.5.1 does before the backend is asked (the tests accept it):
- a notification on a backend without supportsNotif is refused by the agent
  (nixlBackendError), at initialize_xfer and at transfer(handle, notif);
- a remote agent it has no metadata for, or no common backend with, is
  refused by the agent (nixlNotFoundError); an agent whose only backend is
  ORBITE_FILE has no metadata to give (getLocalMD: no remote backends);
- VRAM (and BLOCK, OBJ) registration finds no backend for the memory type
  (nixlNotFoundError), or, with backends=["ORBITE_FILE"], fails as
  nixlBackendError ("registration failed for all potential backends").
- check_xfer_state raises the status of a failed transfer
  (nixlBackendError) instead of returning "ERR".
"""

import gc
import os
import random
import shutil
import sys
import tempfile
import threading
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import orbite_harness as H  # noqa: E402
from orbite_harness import (  # noqa: E402
    Hooks,
    TestFailure,
    check,
    drive,
    expect_raises,
    expect_stats,
    is_nixl_error,
    let_go,
    post,
    state,
    wait_stats,
    wait_until,
)

TEST_TIMEOUT_S = 30
FILESYSTEMS = [("tmpfs", "/dev/shm"), ("disk", "/tmp")]
NOTES = []
AGENT = "F"


def note(msg):
    """A remark shown with -v (what NIXL did instead of the backend, and so on)."""
    NOTES.append(msg)


def np():
    import numpy

    return numpy


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def pattern(n, seed, avoid=None):
    """n deterministic pseudo-random bytes; `avoid` (a guard value) never occurs."""
    numpy = np()
    rng = numpy.random.default_rng(seed)
    if avoid is None:
        return rng.integers(0, 256, n, dtype=numpy.uint8)
    v = rng.integers(0, 255, n, dtype=numpy.uint8)
    v[v >= avoid] += 1
    return v


def first_diff(a, b):
    numpy = np()
    a = numpy.asarray(a, dtype=numpy.uint8)
    b = numpy.asarray(b, dtype=numpy.uint8)
    if a.shape != b.shape:
        return f"sizes {a.size} and {b.size}"
    idx = numpy.nonzero(a != b)[0]
    if idx.size == 0:
        return None
    i = int(idx[0])
    return f"{idx.size} bytes differ, first at {i}: {a[i]:#04x} != {b[i]:#04x}"


def same_bytes(got, want, what):
    d = first_diff(got, want)
    check(d is None, f"{what}: {d}")


def expect_error(exc, names, what):
    check(exc is not None and type(exc).__name__ in names,
          f"{what}: expected {' or '.join(names)}, got {exc!r}")


def make_file(folder, name, content, mode=0o600):
    """Creates folder/name holding `content` (a uint8 array); returns (path, fd) with fd O_RDWR."""
    path = os.path.join(folder, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    data = memoryview(content).cast("B")
    at = 0
    while at < len(data):
        at += os.pwrite(fd, data[at:], at)
    return path, fd


def file_bytes(path):
    numpy = np()
    return numpy.fromfile(path, dtype=numpy.uint8)


def make_agent(config=None):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(AGENT, nixl_agent_config(backends=[]))
    agent.create_backend("ORBITE_FILE", {} if config is None else {"config": config})
    return agent


def reg_dram(agent, buf):
    return agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")


def reg_file(agent, fd, path, length):
    """Registers [0, length) of the file behind `fd` (NIXL: addr = offset, devId = fd)."""
    return agent.register_memory([(0, length, fd, path)], "FILE")


def D(agent, frags):
    """[(addr, len)] -> DRAM xfer descriptors."""
    return agent.get_xfer_descs([(int(a), int(n), 0) for a, n in frags], "DRAM")


def F(agent, frags):
    """[(offset, len, fd)] -> FILE xfer descriptors."""
    return agent.get_xfer_descs([(int(o), int(n), int(fd)) for o, n, fd in frags], "FILE")


def file_xfer(agent, to_file, mem, files, file_local, notif=b""):
    """A transfer between memory fragments [(addr, len)] and file extents
    [(offset, len, fd)], pairwise. `to_file`: memory -> file. `file_local`:
    the FILE list is NIXL's local list (then READ moves memory into the
    file, WRITE the file into memory)."""
    if file_local:
        op = "READ" if to_file else "WRITE"
        return agent.initialize_xfer(op, F(agent, files), D(agent, mem), AGENT, notif)
    op = "WRITE" if to_file else "READ"
    return agent.initialize_xfer(op, D(agent, mem), F(agent, files), AGENT, notif)


def run_done(agent, h, what, timeout=20.0):
    s, exc = post(agent, h)
    check(s in ("DONE", "PROC"), f"{what}: post returned {s} {exc!r}")
    s, exc = drive(agent, h, timeout)
    check(s == "DONE", f"{what}: ended {s} {exc!r}")


def refused(fn, what, *args, **kwargs):
    """fn must raise a NIXL error; returns it."""
    return expect_raises(fn, what, *args, **kwargs)


def fs_type(path):
    """The filesystem type of the mount holding `path` (from mountinfo)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                mnt = parts[4]
                sep = parts.index("-")
                t = parts[sep + 1]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, t
    except OSError:
        pass
    return kind


class Env:
    """What every test has: the agent, its engine's hooks and baseline, a folder."""

    def __init__(self, folder, config=None):
        self.folder = folder
        self.agent = make_agent(config)
        self.hooks = Hooks()
        self.base = self.hooks.stats()
        self.fds = []
        note(f"folder {folder} on {fs_type(folder)}")

    def file(self, name, content, mode=0o600):
        path, fd = make_file(self.folder, name, content, mode)
        self.fds.append(fd)
        return path, fd

    def close_fd(self, fd):
        if fd in self.fds:
            self.fds.remove(fd)
        os.close(fd)

    def at_baseline(self, what):
        wait_stats(self.hooks.stats, self.base, what)

    def finish(self, what="at the end"):
        # A test that destroyed its agent checked that the engine is gone
        # (and its charges with it) itself.
        if self.agent is not None:
            self.at_baseline(what)
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


# ---------------------------------------------------------------------------
# n09_positions: FILE on either list x READ and WRITE
# ---------------------------------------------------------------------------


def n09_positions(folder):
    numpy = np()
    env = Env(folder)
    agent = env.agent
    FS = 1 << 20
    MS = 1 << 20
    GM = 0xA5
    mem = numpy.full(MS, GM, dtype=numpy.uint8)
    r_mem = reg_dram(agent, mem)
    path, fd = env.file("data", pattern(FS, 1))
    r_file = reg_file(agent, fd, path, FS)
    ref = env.hooks.stats()
    base_addr = mem.ctypes.data

    # (memory offset, file offset, length): odd, out of order, one crossing
    # a page boundary on both sides, one of a single byte
    frags = [(4093, 333333, 8195), (1, 7, 1), (200001, 4090, 65537), (777, 900001, 12345)]
    for k, (file_local, to_file) in enumerate([(False, True), (False, False), (True, True), (True, False)]):
        name = f"FILE on the {'local' if file_local else 'remote'} list, " + \
               ("memory -> file" if to_file else "file -> memory")
        op = ("READ" if to_file else "WRITE") if file_local else ("WRITE" if to_file else "READ")
        name = f"{op} with {name}"
        # fresh bytes on both sides for every combination
        mem[:] = GM
        src_mem = pattern(MS, 10 + k, avoid=GM)
        if to_file:
            mem[:] = src_mem
        file_before = pattern(FS, 20 + k)
        os.pwrite(fd, file_before.tobytes(), 0)
        mem_before = mem.copy()
        want_file = file_before.copy()
        want_mem = mem_before.copy()
        for mo, fo, n in frags:
            if to_file:
                want_file[fo : fo + n] = mem_before[mo : mo + n]
            else:
                want_mem[mo : mo + n] = file_before[fo : fo + n]
        h = file_xfer(agent, to_file,
                      [(base_addr + mo, n) for mo, fo, n in frags],
                      [(fo, n, fd) for mo, fo, n in frags], file_local)
        run_done(agent, h, name)
        same_bytes(file_bytes(path), want_file, f"{name}: the file (fragments and guards)")
        same_bytes(mem, want_mem, f"{name}: memory (fragments and guards)")
        # a drained success may be posted again: the same bytes again
        if to_file:
            mem[:] = pattern(MS, 30 + k, avoid=GM)
            want_file = file_before.copy()
            for mo, fo, n in frags:
                want_file[fo : fo + n] = mem[mo : mo + n]
        else:
            os.pwrite(fd, pattern(FS, 40 + k).tobytes(), 0)
            fb = file_bytes(path)
            want_mem = mem.copy()
            for mo, fo, n in frags:
                want_mem[mo : mo + n] = fb[fo : fo + n]
            want_file = fb
        mem_snapshot = mem.copy()
        run_done(agent, h, f"{name} (reposted)")
        same_bytes(file_bytes(path), want_file, f"{name} (reposted): the file")
        same_bytes(mem, want_mem if not to_file else mem_snapshot, f"{name} (reposted): memory")
        check(os.fstat(fd).st_size == FS, f"{name}: the file's size changed to {os.fstat(fd).st_size}")
        agent.release_xfer_handle(h)
        expect_stats(ref, env.hooks.stats(), f"{name}: after release")

    agent.deregister_memory(r_file)
    agent.deregister_memory(r_mem)
    env.finish()


# ---------------------------------------------------------------------------
# n09_fragmented: many descriptors, odd sizes and offsets, several files
# ---------------------------------------------------------------------------


def _fragment_plan(rng, nfiles, file_size):
    """Units (lists of fragments (file, file offset, len)) whose file extents
    never overlap: runs of adjacent extents (kept in order inside a unit, so
    they become vectored operations), extents with gaps, a run of 1500
    seven-byte extents (beyond IOV_MAX), and one extent larger than a task."""
    sizes = [1, 2, 3, 7, 17, 31, 61, 127, 255, 511, 1021, 2039, 4093, 4095, 4096,
             4097, 8191, 12289, 16385, 40001, 65537, 131071]
    units = []
    for f in range(nfiles):
        at = rng.randrange(0, 5000)
        if f == 0:
            run = []
            for _ in range(1500):
                run.append((f, at, 7))
                at += 7
            units.append(run)
            at += 13
        if f == 1:
            units.append([(f, at, (3 << 20) + 5)])
            at += (3 << 20) + 5 + 1
        while True:
            unit = []
            for _ in range(rng.choice([1, 1, 1, 2, 3, 5])):
                n = rng.choice(sizes)
                if at + n > file_size:
                    break
                unit.append((f, at, n))
                at += n
            if not unit:
                break
            units.append(unit)
            at += rng.choice([0, 1, 3, 4096, 5000, 12345]) if rng.random() < 0.7 else 0
            if len(units) > 120 * (f + 1) + 2:
                break
    rng.shuffle(units)
    return units


def _mem_layout(rng, units, nbufs, buf_size):
    """Memory (buffer, offset) per fragment: units placed in another order,
    with gaps, over `nbufs` buffers; fragments never overlap."""
    order = list(range(len(units)))
    rng.shuffle(order)
    at = [rng.randrange(1, 64) for _ in range(nbufs)]
    place = {}
    for i in order:
        b = rng.randrange(nbufs)
        for j, (_, _, n) in enumerate(units[i]):
            place[(i, j)] = (b, at[b])
            at[b] += n + (0 if rng.random() < 0.3 else rng.choice([1, 5, 63, 4099]))
    check(max(at) <= buf_size, f"memory layout does not fit: {max(at)} > {buf_size}")
    return place


def n09_fragmented(folder):
    numpy = np()
    env = Env(folder)
    agent = env.agent
    NF, FSZ = 3, 6 << 20
    NB, BSZ = 2, 12 << 20
    GM = 0x3C
    files = [env.file(f"f{i}", pattern(FSZ, 100 + i)) for i in range(NF)]
    r_files = [reg_file(agent, fd, p, FSZ) for p, fd in files]
    bufs = [numpy.full(BSZ, GM, dtype=numpy.uint8) for _ in range(NB)]
    r_bufs = [reg_dram(agent, b) for b in bufs]
    ref = env.hooks.stats()

    for rnd, file_local in enumerate([False, True]):
        where = "local" if file_local else "remote"
        rng = random.Random(1000 + rnd)
        units = _fragment_plan(rng, NF, FSZ)
        frags = [fr for u in units for fr in u]
        check(len({f for f, _, _ in frags}) == NF, "every file takes part")

        # memory -> files
        place = _mem_layout(rng, units, NB, BSZ)
        for b in range(NB):
            bufs[b][:] = pattern(BSZ, 200 + 10 * rnd + b, avoid=GM)
        want = [file_bytes(p) for p, _ in files]
        mem_list, file_list = [], []
        for i, u in enumerate(units):
            for j, (f, fo, n) in enumerate(u):
                b, mo = place[(i, j)]
                mem_list.append((bufs[b].ctypes.data + mo, n))
                file_list.append((fo, n, files[f][1]))
                want[f][fo : fo + n] = bufs[b][mo : mo + n]
        mem_before = [b.copy() for b in bufs]
        h = file_xfer(agent, True, mem_list, file_list, file_local)
        run_done(agent, h, f"{len(frags)} fragments memory -> {NF} files (FILE {where})")
        for f in range(NF):
            same_bytes(file_bytes(files[f][0]), want[f], f"round {rnd}: file {f} after the write")
            check(os.fstat(files[f][1]).st_size == FSZ, f"round {rnd}: file {f} changed size")
        for b in range(NB):
            same_bytes(bufs[b], mem_before[b], f"round {rnd}: source buffer {b} changed")
        agent.release_xfer_handle(h)

        # files -> memory, into another layout over guard-filled buffers
        place = _mem_layout(rng, units, NB, BSZ)
        for b in bufs:
            b[:] = GM
        want_mem = [b.copy() for b in bufs]
        mem_list, file_list = [], []
        for i, u in enumerate(units):
            for j, (f, fo, n) in enumerate(u):
                b, mo = place[(i, j)]
                mem_list.append((bufs[b].ctypes.data + mo, n))
                file_list.append((fo, n, files[f][1]))
                want_mem[b][mo : mo + n] = want[f][fo : fo + n]
        h = file_xfer(agent, False, mem_list, file_list, file_local)
        run_done(agent, h, f"{len(frags)} fragments {NF} files -> memory (FILE {where})")
        for b in range(NB):
            same_bytes(bufs[b], want_mem[b], f"round {rnd}: buffer {b} after the read")
        for f in range(NF):
            same_bytes(file_bytes(files[f][0]), want[f], f"round {rnd}: file {f} changed by the read")
        agent.release_xfer_handle(h)
        expect_stats(ref, env.hooks.stats(), f"round {rnd}: after release")
        note(f"round {rnd}: {len(frags)} descriptors over {NF} files, FILE on the {where} list")

    for r in r_files + r_bufs:
        agent.deregister_memory(r)
    env.finish()


# ---------------------------------------------------------------------------
# n09_eof: a READ that meets the end of the file
# ---------------------------------------------------------------------------


def n09_eof(folder):
    numpy = np()
    env = Env(folder)
    agent = env.agent
    SIZE = 5000
    GM = 0x77
    content = pattern(SIZE, 300)
    path, fd = env.file("short", content)
    r_file = reg_file(agent, fd, path, 1 << 20)  # registered far beyond the end
    mem = numpy.full(1 << 16, GM, dtype=numpy.uint8)
    r_mem = reg_dram(agent, mem)
    ref = env.hooks.stats()
    a = mem.ctypes.data

    cases = [
        # (what, [(mem offset, file offset, len)], [(mem offset, bytes that must land)])
        ("one fragment across the end",
         [(100, 4000, 3000)], [(100, 1000)]),
        ("fragments before, across and beyond the end",
         [(10, 0, 1000), (2000, 4500, 2000), (9000, 8000, 1000)],
         [(10, 1000), (2000, 500), (9000, 0)]),
        ("adjacent extents (one vectored read) across the end",
         [(20000, 3000, 1500), (30000, 4500, 1500), (40000, 6000, 100)],
         [(20000, 1500), (30000, 500), (40000, 0)]),
    ]
    for file_local in (False, True):
        for what, frags, lands in cases:
            what = f"{what} (FILE {'local' if file_local else 'remote'})"
            mem[:] = GM
            h = file_xfer(agent, False, [(a + mo, n) for mo, fo, n in frags],
                          [(fo, n, fd) for mo, fo, n in frags], file_local)
            s, exc = post(agent, h)
            check(s in ("PROC", "ERR"), f"{what}: post returned {s} {exc!r}")
            if s == "PROC":
                s, exc = drive(agent, h)
            check(s == "ERR", f"{what}: ended {s} {exc!r} (want an error)")
            expect_error(exc, ["nixlBackendError"], f"{what}: the error")
            # check_xfer_state keeps reporting the error
            s2, exc2 = state(agent, h)
            check(s2 == "ERR", f"{what}: state after the error: {s2} {exc2!r}")
            want = numpy.full(mem.size, GM, dtype=numpy.uint8)
            for (mo, fo, n), (lo, landed) in zip(frags, lands):
                want[lo : lo + landed] = content[fo : fo + landed]
            same_bytes(mem, want, f"{what}: memory (landed prefix, untouched beyond the end)")
            check(os.fstat(fd).st_size == SIZE, f"{what}: the file's size changed")
            # a failed execution is not replayed
            s, exc = post(agent, h)
            check(s == "ERR", f"{what}: repost of a failed READ returned {s}")
            expect_error(exc, ["nixlNotAllowedError"], f"{what}: repost")
            same_bytes(mem, want, f"{what}: memory after the refused repost")
            agent.release_xfer_handle(h)
            expect_stats(ref, env.hooks.stats(), f"{what}: after release")
    same_bytes(file_bytes(path), content, "the file after the reads")

    # a read that ends exactly at the end of the file succeeds
    mem[:] = GM
    h = file_xfer(agent, False, [(a, 1000)], [(SIZE - 1000, 1000, fd)], False)
    run_done(agent, h, "a read ending exactly at the end of the file")
    same_bytes(mem[:1000], content[SIZE - 1000 :], "the last 1000 bytes")
    check((mem[1000:] == GM).all(), "bytes beyond the read were written")
    agent.release_xfer_handle(h)

    agent.deregister_memory(r_file)
    agent.deregister_memory(r_mem)
    env.finish()


# ---------------------------------------------------------------------------
# n09_fd_reuse: the caller's fd closed and its number reused
# ---------------------------------------------------------------------------


def n09_fd_reuse(folder):
    env = Env(folder)
    agent = env.agent
    N = 1 << 20
    a_content = pattern(N, 400)
    b_content = pattern(N, 401)
    path_a, fd_a = env.file("original", a_content)
    r_a = reg_file(agent, fd_a, path_a, N)
    env.close_fd(fd_a)  # the caller's own descriptor is gone
    path_b = os.path.join(folder, "newcomer")
    fd_b = os.open(path_b, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    if fd_b != fd_a:
        note(f"os.open returned {fd_b}, not {fd_a}: moved it onto the old number with dup2")
        os.dup2(fd_b, fd_a)
        os.close(fd_b)
        fd_b = fd_a
    env.fds.append(fd_b)
    os.pwrite(fd_b, b_content.tobytes(), 0)
    check(os.fstat(fd_b).st_ino == os.stat(path_b).st_ino, "fd now names the new file")
    mem = pattern(N, 402)
    r_mem = reg_dram(agent, mem)
    a = mem.ctypes.data
    frags = [(0, 0, 4096), (5000, 100000, 70001), (200000, N - 3, 3)]

    # read through the registered descriptors: the ORIGINAL file's bytes
    for file_local in (False, True):
        mem[:] = 0
        h = file_xfer(agent, False, [(a + mo, n) for mo, fo, n in frags],
                      [(fo, n, fd_a) for mo, fo, n in frags], file_local)
        run_done(agent, h, f"read after fd reuse (FILE {'local' if file_local else 'remote'})")
        for mo, fo, n in frags:
            same_bytes(mem[mo : mo + n], a_content[fo : fo + n], f"read at file offset {fo}: bytes of the original")
        agent.release_xfer_handle(h)

    # write through them: the original changes, the newcomer does not
    want_a = a_content.copy()
    for k, file_local in enumerate((False, True)):
        mem[:] = pattern(N, 410 + k)
        for mo, fo, n in frags:
            want_a[fo : fo + n] = mem[mo : mo + n]
        h = file_xfer(agent, True, [(a + mo, n) for mo, fo, n in frags],
                      [(fo, n, fd_a) for mo, fo, n in frags], file_local)
        run_done(agent, h, f"write after fd reuse (FILE {'local' if file_local else 'remote'})")
        agent.release_xfer_handle(h)
        same_bytes(file_bytes(path_a), want_a, "the original file after the write")
        same_bytes(file_bytes(path_b), b_content, "the file that reused the fd number")

    agent.deregister_memory(r_a)
    agent.deregister_memory(r_mem)
    same_bytes(file_bytes(path_b), b_content, "the newcomer after deregistration")
    check(os.fstat(fd_b).st_ino == os.stat(path_b).st_ino, "the reused fd still names the newcomer")
    os.pwrite(fd_b, b"ok", 0)  # and is still open and usable
    env.finish()


# ---------------------------------------------------------------------------
# n09_close_during_io: deregistering a file while its transfer is held or runs
# ---------------------------------------------------------------------------


def _dereg_thread(agent, reg):
    """deregister_memory on another thread; returns (thread, result dict)."""
    res = {}

    def run():
        t0 = time.monotonic()
        try:
            agent.deregister_memory(reg)
            res["ok"] = True
        except Exception as exc:  # reported, checked by the caller
            res["exc"] = exc if not is_nixl_error(exc) else H._bare(exc)
        res["took"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, res


def _later_refused(env, h, fd, path, n, mem, what):
    """After deregistration: a repost of the handle and a new request on the
    file are refused, and the file does not change."""
    agent = env.agent
    before = file_bytes(path)
    s, exc = post(agent, h)
    check(s == "ERR", f"{what}: repost after deregistration returned {s}")
    note(f"{what}: repost after deregistration: {exc!r}")
    exc = refused(file_xfer, f"{what}: a new request on the deregistered file",
                  agent, True, [(mem.ctypes.data, n)], [(0, n, fd)], False)
    note(f"{what}: new request on the deregistered file: {exc!r}")
    check(env.hooks.stats()["executions"] == 0, f"{what}: a refused request started an execution")
    same_bytes(file_bytes(path), before, f"{what}: the file after the refused requests")


def n09_close_during_io(folder):
    env = Env(folder)
    agent = env.agent
    hooks = env.hooks
    N = 16 << 20
    old = pattern(N, 500)
    new = pattern(N, 501)
    path, fd = env.file("busy", old)
    mem = new.copy()
    r_mem = reg_dram(agent, mem)
    ref = hooks.stats()

    # (a) every task held: deregister on another thread; the held work then
    # drains with an outcome, and nothing reaches the closed file
    r_file = reg_file(agent, fd, path, N)
    h = file_xfer(agent, True, [(mem.ctypes.data, N)], [(0, N, fd)], False)
    hooks.hold_all(True)
    s, exc = post(agent, h)
    check(s == "PROC", f"(a) post returned {s} {exc!r}")
    hooks.require_held(1)
    t, res = _dereg_thread(agent, r_file)
    t.join(3.0)
    blocked = t.is_alive()
    note(f"(a) deregister_memory with every task held: {'still blocked' if blocked else 'returned'} "
         f"after {res.get('took', 3.0):.3f} s")
    # only the hooks are called while the other thread may be inside the agent
    let_go(hooks, lambda: hooks.stats()["executions"] == 0)
    t.join(10.0)
    check(not t.is_alive(), "(a) deregister_memory did not return after the held work was let go")
    check(res.get("ok"), f"(a) deregister_memory raised {res.get('exc')!r}")
    s, exc = drive(agent, h)
    check(s in ("DONE", "ERR"), f"(a) ended {s} {exc!r}")
    note(f"(a) outcome of the held WRITE after deregistration: {s} {exc!r}")
    wait_until(lambda: hooks.stats()["executions"] == 0, 10, "(a) the execution to retire")
    if not blocked:
        # fenced at once: no held task may reach the file afterwards
        check(s == "ERR", f"(a) the held WRITE ended {s} although its file was closed before it ran")
        same_bytes(file_bytes(path), old, "(a) the file (closed before any task ran)")
    _later_refused(env, h, fd, path, N, mem, "(a)")
    agent.release_xfer_handle(h)
    expect_stats(ref, hooks.stats(), "(a) after release")

    # (b) the first task held, then let go: deregister from another thread
    # while the WRITE runs; admitted I/O drains, every file byte is old or new
    os.pwrite(fd, old.tobytes(), 0)
    r_file = reg_file(agent, fd, path, N)
    h = file_xfer(agent, True, [(mem.ctypes.data + i * (1 << 20), 1 << 20) for i in range(16)],
                  [(i * (1 << 20), 1 << 20, fd) for i in range(16)], True)
    hooks.hold_all(True)
    check(post(agent, h)[0] == "PROC", "(b) post did not return PROC")
    hooks.require_held(1)
    hooks.hold_all(False)
    hooks.release_held()
    t, res = _dereg_thread(agent, r_file)
    let_go(hooks, lambda: hooks.stats()["executions"] == 0)
    t.join(10.0)
    check(not t.is_alive(), "(b) deregister_memory did not return")
    check(res.get("ok"), f"(b) deregister_memory raised {res.get('exc')!r}")
    s, exc = drive(agent, h)
    check(s in ("DONE", "ERR"), f"(b) ended {s} {exc!r}")
    wait_until(lambda: hooks.stats()["executions"] == 0, 10, "(b) the execution to retire")
    got = file_bytes(path)
    check(((got == old) | (got == new)).all(), "(b) file bytes that are neither old nor new")
    written = int((got != old).sum())
    note(f"(b) WRITE racing deregistration: {s} {exc!r}, about {written} of {N} bytes changed, "
         f"deregister took {res.get('took', 0):.3f} s")
    if s == "DONE":
        same_bytes(got, new, "(b) a WRITE reported DONE")
    time.sleep(0.05)
    same_bytes(file_bytes(path), got, "(b) the file changed after the outcome was reported")
    _later_refused(env, h, fd, path, N, mem, "(b)")
    agent.release_xfer_handle(h)
    expect_stats(ref, hooks.stats(), "(b) after release")

    # (c) a READ racing deregistration (no hold): memory bytes are guard or
    # file bytes, and stable once the outcome is reported
    GM = 0x5A
    content = pattern(N, 502, avoid=GM)
    os.pwrite(fd, content.tobytes(), 0)
    r_file = reg_file(agent, fd, path, N)
    mem[:] = GM
    h = file_xfer(agent, False, [(mem.ctypes.data + i * (1 << 20), 1 << 20) for i in range(16)],
                  [(i * (1 << 20), 1 << 20, fd) for i in range(16)], False)
    s0, exc0 = post(agent, h)
    check(s0 in ("PROC", "DONE", "ERR"), f"(c) post returned {s0} {exc0!r}")
    t, res = _dereg_thread(agent, r_file)
    t.join(10.0)
    check(not t.is_alive(), "(c) deregister_memory did not return")
    check(res.get("ok"), f"(c) deregister_memory raised {res.get('exc')!r}")
    s, exc = (s0, exc0) if s0 != "PROC" else drive(agent, h)
    check(s in ("DONE", "ERR"), f"(c) ended {s} {exc!r}")
    wait_until(lambda: hooks.stats()["executions"] == 0, 10, "(c) the execution to retire")
    snap = mem.copy()
    check(((snap == GM) | (snap == content)).all(), "(c) memory bytes that are neither guard nor file bytes")
    if s == "DONE":
        same_bytes(snap, content, "(c) a READ reported DONE")
    time.sleep(0.05)
    same_bytes(mem, snap, "(c) memory changed after the outcome was reported")
    note(f"(c) READ racing deregistration: {s} {exc!r}, {int((snap != GM).sum())} of {N} bytes landed")
    _later_refused(env, h, fd, path, N, mem, "(c)")
    agent.release_xfer_handle(h)

    agent.deregister_memory(r_mem)
    env.finish()


# ---------------------------------------------------------------------------
# n09_repost_one_file_closed: a request over two files, one deregistered
# ---------------------------------------------------------------------------


def _post_two_files_held(env, h):
    """Posts `h` with every task held; returns (status, exc, executions still
    active when the post returned, file outcome after letting go)."""
    hooks = env.hooks
    hooks.hold_all(True)
    s, exc = post(env.agent, h)
    # Only a post that itself answers ERR may not leave work running.
    active = hooks.stats()["executions"] if s == "ERR" else 0
    env.posted = s
    if s == "ERR" and active:
        # a terminal answer while work is held: ask once more before letting go
        s2, exc2 = state(env.agent, h)
        note(f"check_xfer_state while the post's work is held: {s2} {exc2!r}")
    let_go(hooks, lambda: hooks.stats()["executions"] == 0)
    if s == "PROC":
        s, exc = drive(env.agent, h)
    return s, exc, active


def _two_file_verdict(what, s, exc, active, before, after, mem, N):
    """DONE with both files written, or an error with neither changed and
    nothing left active when it was reported."""
    changed = [first_diff(after[i], before[i]) is not None for i in range(2)]
    note(f"{what}: {s} {exc!r}; executions active when the post returned: {active}; files changed: {changed}")
    if s == "DONE":
        same_bytes(after[0], mem[:N], f"{what}: file 0")
        same_bytes(after[1], mem[N:], f"{what}: file 1")
        return
    problems = []
    if active:
        problems.append(f"the post returned {s} ({exc!r}) while {active} engine execution(s) of the request "
                        "were still active (a terminal status must mean retirement)")
    # A post refused outright moves nothing. A post that was accepted (PROC)
    # and then could not start every part (a budget filled up) is a failed
    # transfer: it may have written the parts that started, and it reports
    # the error only after they retired (checked by `active` above and by
    # drive()).
    accepted = getattr(_two_file_verdict, "accepted", False)
    if any(changed) and not accepted:
        problems.append(f"it ended {s} but changed file(s) {[i for i in range(2) if changed[i]]} "
                        "(a refused post must move no bytes)")
    check(not problems, f"{what}: " + "; ".join(problems))


def n09_repost_one_file_closed(folder):
    """A request naming two files drained once; then one file is
    deregistered and the handle reposted. The repost must be refused before
    any I/O (the file still registered must not change either) and not
    report ERR while part of it still runs."""
    env = Env(folder)
    agent = env.agent
    N = 4 << 20
    for closed in (0, 1):
        paths = [env.file(f"pair{closed}{i}", pattern(N, 600 + i)) for i in range(2)]
        regs = [reg_file(agent, fd, p, N) for p, fd in paths]
        mem = pattern(2 * N, 610)
        r_mem = reg_dram(agent, mem)
        h = file_xfer(agent, True, [(mem.ctypes.data, N), (mem.ctypes.data + N, N)],
                      [(0, N, paths[0][1]), (0, N, paths[1][1])], False)
        run_done(agent, h, "the two-file WRITE")
        same_bytes(file_bytes(paths[0][0]), mem[:N], "file 0")
        same_bytes(file_bytes(paths[1][0]), mem[N:], "file 1")
        agent.deregister_memory(regs[closed])
        mem[:] = pattern(2 * N, 611)
        before = [file_bytes(p) for p, _ in paths]
        s, exc, active = _post_two_files_held(env, h)
        after = [file_bytes(p) for p, _ in paths]
        check(s == "ERR", f"repost with file {closed} deregistered returned {s} {exc!r}")
        same_bytes(after[closed], before[closed], f"the deregistered file {closed}")
        _two_file_verdict(f"repost with file {closed} deregistered", s, exc, active, before, after, mem, N)
        agent.release_xfer_handle(h)
        agent.deregister_memory(regs[1 - closed])
        agent.deregister_memory(r_mem)
        env.at_baseline(f"file {closed} deregistered: after release")
    env.finish()


def n09_multi_file_budget(folder):
    """A request over two files with max_executions 1 (one engine transfer
    per file): it either completes or is refused with neither file changed
    and nothing running; an ERR must not hide a file being written."""
    env = Env(folder, '{"max_executions": 1}')
    agent = env.agent
    N = 1 << 20
    paths = [env.file(f"budget{i}", pattern(N, 650 + i)) for i in range(2)]
    regs = [reg_file(agent, fd, p, N) for p, fd in paths]
    mem = pattern(2 * N, 660)
    r_mem = reg_dram(agent, mem)
    before = [file_bytes(p) for p, _ in paths]
    h = file_xfer(agent, True, [(mem.ctypes.data, N), (mem.ctypes.data + N, N)],
                  [(0, N, paths[0][1]), (0, N, paths[1][1])], False)
    s, exc, active = _post_two_files_held(env, h)
    after = [file_bytes(p) for p, _ in paths]
    _two_file_verdict.accepted = env.posted != "ERR"
    try:
        _two_file_verdict("two-file WRITE with max_executions 1", s, exc, active, before, after, mem, N)
    finally:
        _two_file_verdict.accepted = False
    check(s in ("DONE", "ERR"), f"the budget case ended {s}")
    if s == "ERR":
        check(exc is not None and "NOT_POSTED" not in repr(exc), f"the failure is reported as a failure: {exc!r}")
    agent.release_xfer_handle(h)
    for r in regs + [r_mem]:
        agent.deregister_memory(r)
    env.finish()


# ---------------------------------------------------------------------------
# n09_release_while_active: NIXL's second release of an active request
# ---------------------------------------------------------------------------


def n09_release_while_active(folder):
    """release_xfer_handle while the transfer is held is refused
    (nixlRepostActiveError, nothing cancelled). NIXL 1.5.1 deletes its
    request on a second release without a successful releaseReqH (see
    docs/nixl-plugin.md); the engine's transfer must still be released once
    it retired (ORBITE does it on its next call), at the latest with the
    backend: no transfer, registration or engine may be left behind."""
    env = Env(folder)
    agent = env.agent
    hooks = env.hooks
    N = 4 << 20
    path, fd = env.file("active", pattern(N, 670))
    r_file = reg_file(agent, fd, path, N)
    mem = pattern(N, 671)
    r_mem = reg_dram(agent, mem)
    h = file_xfer(agent, True, [(mem.ctypes.data, N)], [(0, N, fd)], False)
    hooks.hold_all(True)
    check(post(agent, h)[0] == "PROC", "post did not return PROC")
    hooks.require_held(1)
    exc = refused(agent.release_xfer_handle, "release while held", h)
    expect_error(exc, ["nixlRepostActiveError"], "release while held")
    check(hooks.stats()["executions"] == 1, "the refused release changed the execution")
    second = "refused"
    try:
        agent.release_xfer_handle(h)
        second = "accepted by NIXL"
    except Exception as e:
        if not is_nixl_error(e):
            raise
        second = f"refused: {H._bare(e)!r}"
    note(f"a second release while held: {second}")
    let_go(hooks, lambda: hooks.stats()["executions"] == 0)
    same_bytes(file_bytes(path), mem, "the file after the held WRITE drained")
    # later calls into the backend: a transfer, deregistrations
    h2 = file_xfer(agent, False, [(mem.ctypes.data, 4096)], [(0, 4096, fd)], False)
    run_done(agent, h2, "a later READ")
    agent.release_xfer_handle(h2)
    if second != "accepted by NIXL":
        agent.release_xfer_handle(h)
    agent.deregister_memory(r_file)
    agent.deregister_memory(r_mem)
    problems = []
    try:
        wait_stats(hooks.stats, env.base, "after the drained request and deregistration", timeout=2.0)
    except TestFailure as e:
        problems.append(str(e))
    del h, h2, agent
    env.agent = None
    gc.collect()
    alive = len(hooks.engines())
    if alive:
        problems.append(f"{alive} OrbiTE engine(s) still alive after the agent was destroyed")
    check(not problems, "; ".join(problems))
    env.finish()


# ---------------------------------------------------------------------------
# n09_refused: unsupported requests fail before any I/O
# ---------------------------------------------------------------------------


def n09_refused(folder):
    numpy = np()
    from nixl._api import nixl_agent, nixl_agent_config

    env = Env(folder)
    agent = env.agent
    hooks = env.hooks
    N = 64 << 10
    mem = pattern(N, 700)
    mem2 = numpy.zeros(N, dtype=numpy.uint8)
    r_mem = agent.register_memory([(mem.ctypes.data, N, 0, ""), (mem2.ctypes.data, N, 0, "")], "DRAM")
    c1, c2 = pattern(N, 701), pattern(N, 702)
    p1, fd1 = env.file("one", c1)
    p2, fd2 = env.file("two", c2)
    r_files = agent.register_memory([(0, N, fd1, p1), (0, N, fd2, p2)], "FILE")
    ref = hooks.stats()
    a = mem.ctypes.data

    def unchanged(what):
        same_bytes(file_bytes(p1), c1, f"{what}: file one")
        same_bytes(file_bytes(p2), c2, f"{what}: file two")
        check(not mem2.any(), f"{what}: memory written")
        expect_stats(ref, hooks.stats(), f"{what}: engine state")

    # file to file, both operations
    for op in ("WRITE", "READ"):
        exc = refused(agent.initialize_xfer, f"file-to-file {op}", op,
                      F(agent, [(0, 4096, fd1)]), F(agent, [(8192, 4096, fd2)]), AGENT)
        expect_error(exc, ["nixlNotSupportedError"], f"file-to-file {op}")
        unchanged(f"file-to-file {op}")
    # memory to memory (ORBITE_FILE moves files only)
    exc = refused(agent.initialize_xfer, "memory-to-memory", "WRITE",
                  D(agent, [(a, 4096)]), D(agent, [(mem2.ctypes.data, 4096)]), AGENT)
    expect_error(exc, ["nixlNotSupportedError"], "memory-to-memory")
    unchanged("memory-to-memory")

    # a notification, at initialize_xfer (both list positions) and at transfer()
    for file_local in (False, True):
        exc = refused(file_xfer, "a notification at initialize_xfer", agent, True, [(a, 4096)],
                      [(0, 4096, fd1)], file_local, b"note")
        expect_error(exc, ["nixlBackendError", "nixlNotSupportedError"], "notification")
        unchanged(f"notification (FILE {'local' if file_local else 'remote'})")
    note(f"a notification at initialize_xfer: {exc!r} (NIXL refuses it: supportsNotif is false)")
    h = file_xfer(agent, True, [(a, 4096)], [(0, 4096, fd1)], False)
    s, exc = post(agent, h, b"late note")
    check(s == "ERR", f"transfer(handle, notif) returned {s}")
    note(f"a notification at transfer(): {exc!r}")
    s, exc = state(agent, h)
    check(s == "ERR", f"state of a handle never posted: {s} {exc!r}")
    agent.release_xfer_handle(h)
    unchanged("notification at transfer()")

    # another agent as the remote: unknown name, then an agent whose metadata is loaded
    exc = refused(file_xfer_to, "a request naming an unknown agent", agent, "OTHER", [(a, 4096)], [(0, 4096, fd1)])
    note(f"a request naming an unknown agent: {exc!r}")
    unchanged("a request naming an unknown agent")
    other = nixl_agent("OTHER", nixl_agent_config(backends=[]))
    other.create_backend("ORBITE_FILE", {})
    try:
        md = other.get_agent_metadata()
        agent.add_remote_agent(md)
        exc = refused(file_xfer_to, "a request naming a loaded agent", agent, "OTHER", [(a, 4096)], [(0, 4096, fd1)])
        note(f"a request naming a loaded agent: {exc!r}")
        agent.remove_remote_agent("OTHER")
    except Exception as e:
        if not is_nixl_error(e):
            raise
        note(f"an ORBITE_FILE-only agent has no metadata to load: {H._bare(e)!r}")
    del other
    gc.collect()
    unchanged("a request naming another agent")

    # VRAM, BLOCK and OBJ registration
    for kind, backends in (("VRAM", []), ("VRAM", ["ORBITE_FILE"]), ("BLOCK", []), ("OBJ", [])):
        exc = refused(agent.register_memory, f"{kind} registration", [(a, 4096, 0, "")], kind, backends)
        expect_error(exc, ["nixlNotSupportedError", "nixlNotFoundError", "nixlBackendError"],
                     f"{kind} registration")
        note(f"{kind} registration (backends={backends}): {exc!r}")
        unchanged(f"{kind} registration")

    # descriptors that cannot be adopted: write-only, a directory, a pipe, a closed fd
    wo_path = os.path.join(folder, "wo")
    fd_wo = os.open(wo_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    env.fds.append(fd_wo)
    fd_dir = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    env.fds.append(fd_dir)
    pr, pw = os.pipe()
    env.fds += [pr, pw]
    spare = os.open(wo_path, os.O_RDONLY | os.O_CLOEXEC)
    os.close(spare)
    for what, fd in (("a write-only fd", fd_wo), ("a directory", fd_dir), ("a pipe", pr), ("a closed fd", spare)):
        exc = refused(agent.register_memory, f"registering {what}", [(0, 4096, fd, "")], "FILE")
        note(f"registering {what}: {exc!r}")
        unchanged(f"registering {what}")

    # a read-only fd: reads work, a WRITE into it fails before any I/O
    ro_content = pattern(N, 703)
    ro_path = os.path.join(folder, "ro")
    with open(ro_path, "wb") as f:
        f.write(ro_content.tobytes())
    fd_ro = os.open(ro_path, os.O_RDONLY | os.O_CLOEXEC)
    env.fds.append(fd_ro)
    r_ro = reg_file(agent, fd_ro, ro_path, N)
    ref = hooks.stats()
    for file_local in (False, True):
        exc = refused(file_xfer, "a WRITE into a read-only file", agent, True, [(a, 4096)],
                      [(100, 4096, fd_ro)], file_local)
        expect_error(exc, ["nixlNotAllowedError"], "a WRITE into a read-only file")
        same_bytes(file_bytes(ro_path), ro_content, "the read-only file")
        unchanged(f"a WRITE into a read-only file (FILE {'local' if file_local else 'remote'})")
        # the registration stays usable for reads
        h = file_xfer(agent, False, [(mem2.ctypes.data, 4096)], [(100, 4096, fd_ro)], file_local)
        run_done(agent, h, "a READ from the read-only file")
        same_bytes(mem2[:4096], ro_content[100:4196], "bytes read from the read-only file")
        agent.release_xfer_handle(h)
        mem2[:] = 0
    # a request over a writable file and the read-only one: nothing happens to either
    exc = refused(file_xfer, "a WRITE into a writable and a read-only file", agent, True,
                  [(a, 4096), (a + 4096, 4096)], [(0, 4096, fd1), (0, 4096, fd_ro)], False)
    expect_error(exc, ["nixlNotAllowedError"], "a WRITE into a writable and a read-only file")
    same_bytes(file_bytes(ro_path), ro_content, "the read-only file")
    unchanged("a WRITE into a writable and a read-only file")

    # lengths that differ, a descriptor beyond the registered range
    exc = refused(agent.initialize_xfer, "differing lengths", "WRITE", D(agent, [(a, 4096)]),
                  F(agent, [(0, 4095, fd1)]), AGENT)
    note(f"differing lengths: {exc!r}")
    exc = refused(agent.initialize_xfer, "an extent beyond the registered range", "WRITE", D(agent, [(a, 4096)]),
                  F(agent, [(N - 100, 4096, fd1)]), AGENT)
    note(f"an extent beyond the registered range: {exc!r}")
    unchanged("invalid lengths")

    agent.deregister_memory(r_ro)
    agent.deregister_memory(r_files)
    agent.deregister_memory(r_mem)
    env.finish()


def file_xfer_to(agent, remote, mem, files):
    """A memory -> file WRITE that names another agent as the remote."""
    return agent.initialize_xfer("WRITE", D(agent, mem), F(agent, files), remote)


# ---------------------------------------------------------------------------
# n09_poll_yields: polls of work in progress give the processor away
# ---------------------------------------------------------------------------

# Preloaded (LD_PRELOAD) into the process of the tests in PRELOADED only:
# counts the calling thread's sched_yield calls, then yields.
YIELD_COUNTER_C = r"""
#define _GNU_SOURCE
#include <sys/syscall.h>
#include <unistd.h>
static __thread unsigned long yields;
int sched_yield(void) { yields++; return (int)syscall(SYS_sched_yield); }
unsigned long orbite_test_thread_yields(void) { return yields; }
"""
PRELOADED = {"n09_poll_yields"}


def build_yield_counter(workdir):
    """Compiles the sched_yield counter; returns its path, or raises TestFailure."""
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise TestFailure("no C compiler for the sched_yield counter")
    src, lib = os.path.join(workdir, "yields.c"), os.path.join(workdir, "libyields.so")
    with open(src, "w") as f:
        f.write(YIELD_COUNTER_C)
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, src], capture_output=True, text=True)
    if r.returncode != 0:
        raise TestFailure(f"compiling the sched_yield counter failed: {r.stderr.strip()[:300]}")
    return lib


_SHIM_DIR = []


def shim_dir():
    """A folder for the counter under the default temporary folder, removed at exit."""
    if not _SHIM_DIR:
        import atexit

        d = tempfile.mkdtemp(prefix="orbite-file-shim-")
        atexit.register(shutil.rmtree, d, True)
        _SHIM_DIR.append(d)
    return _SHIM_DIR[0]


def thread_yields():
    """sched_yield calls of this thread so far (the preloaded counter)."""
    import ctypes

    try:
        f = ctypes.CDLL(None).orbite_test_thread_yields
    except AttributeError:
        raise TestFailure("the sched_yield counter is not preloaded (run the test through file_tests.py)")
    f.restype = ctypes.c_ulong
    return f()


def n09_poll_yields(folder):
    """NIXL's Python agent polls check_xfer_state in a tight loop; on a busy
    host that loop shares a processor with the threads doing the transfer.
    Every poll that answers PROC yields once (the thread calling
    check_xfer_state is the one that yields); polls of a finished request do
    not. The held request then completes with its bytes, and the charges go
    back to baseline."""
    numpy = np()
    env = Env(folder)
    agent, hooks = env.agent, env.hooks
    N = 1 << 20
    content = pattern(N, 680)
    path, fd = env.file("poll", content)
    r_file = reg_file(agent, fd, path, N)
    mem = numpy.zeros(N, dtype=numpy.uint8)
    r_mem = reg_dram(agent, mem)
    h = file_xfer(agent, False, [(mem.ctypes.data, N)], [(0, N, fd)], False)
    hooks.hold_all(True)
    check(post(agent, h)[0] == "PROC", "post did not return PROC")
    hooks.require_held(1)
    polls = 200
    before = thread_yields()
    for i in range(polls):
        s, exc = state(agent, h)
        check(s == "PROC", f"poll {i} of the held request: {s} {exc!r}")
    yielded = thread_yields() - before
    check(yielded == polls, f"{polls} polls of a request in progress yielded {yielded} times")
    let_go(hooks, lambda: hooks.stats()["executions"] == 0)
    s, exc = drive(agent, h)
    check(s == "DONE", f"the released READ ended {s} {exc!r}")
    before = thread_yields()
    for i in range(20):
        s, exc = state(agent, h)
        check(s == "DONE", f"poll {i} of the finished request: {s} {exc!r}")
    check(thread_yields() == before, f"polls of a finished request yielded {thread_yields() - before} times")
    same_bytes(mem, content, "the READ after its tasks were let go")
    agent.release_xfer_handle(h)
    agent.deregister_memory(r_file)
    agent.deregister_memory(r_mem)
    env.finish()


# ---------------------------------------------------------------------------
# n09_query_memory
# ---------------------------------------------------------------------------


def n09_query_memory(folder):
    numpy = np()
    env = Env(folder)
    agent = env.agent
    sizes = {"empty": 0, "one": 1, "odd": 12345, "mib": 1 << 20}
    paths = {}
    for name, n in sizes.items():
        p, fd = env.file(name, pattern(n, 800) if n else numpy.zeros(0, dtype=numpy.uint8))
        paths[name] = (p, fd)
    missing = os.path.join(folder, "missing")
    q = [(0, 0, 0, paths[n][0]) for n in sizes] + [(0, 0, 0, missing), (0, 4096, 0, "")]
    got = agent.query_memory(q, "ORBITE_FILE", "FILE")
    check(len(got) == len(q), f"query_memory returned {len(got)} answers for {len(q)} descriptors")
    for (name, n), ans in zip(sizes.items(), got):
        check(ans is not None and ans.get("size") == str(n), f"query of {name} ({n} bytes): {ans!r}")
    check(got[len(sizes)] is None, f"query of a missing file: {got[len(sizes)]!r}")
    check(got[len(sizes) + 1] is None, f"query of a descriptor without a path: {got[len(sizes) + 1]!r}")

    # after a WRITE that extends a registered file, the new size
    p, fd = paths["odd"]
    mem = pattern(8192, 801)
    r_mem = reg_dram(agent, mem)
    r_file = reg_file(agent, fd, p, 1 << 20)
    h = file_xfer(agent, True, [(mem.ctypes.data, 8192)], [(20000, 8192, fd)], False)
    run_done(agent, h, "a WRITE beyond the end")
    agent.release_xfer_handle(h)
    got = agent.query_memory([(0, 0, fd, p)], "ORBITE_FILE", "FILE")
    st = os.stat(p)
    want = {"size": str(20000 + 8192), "mode": str(st.st_mode), "mtime": str(int(st.st_mtime)),
            "direct": "0", "sync": "none"}
    check(got == [want], f"query after extending the file: {got!r}, want {want!r}")
    # the registered descriptor alone (no path) answers from the engine
    got = agent.query_memory([(0, 0, fd, "")], "ORBITE_FILE", "FILE")
    check(got == [want], f"query of the registered descriptor: {got!r}")
    fb = file_bytes(p)
    check(fb.size == 28192 and not fb[12345:20000].any(), "the hole before the extension is not zeros")
    same_bytes(fb[20000:], mem, "the bytes written beyond the old end")
    # a file removed after it was registered: the path no longer answers
    os.unlink(p)
    got = agent.query_memory([(0, 0, fd, p)], "ORBITE_FILE", "FILE")
    check(got == [None], f"query of an unlinked path: {got!r}")
    # other memory types are not answered
    exc = refused(agent.query_memory, "query_memory on DRAM", [(mem.ctypes.data, 8192, 0, "")], "ORBITE_FILE", "DRAM")
    expect_error(exc, ["nixlNotSupportedError"], "query_memory on DRAM")
    agent.deregister_memory(r_file)
    agent.deregister_memory(r_mem)
    env.finish()


# ---------------------------------------------------------------------------
# n09_direct
# ---------------------------------------------------------------------------


def _stderr_of(fn):
    """Runs fn() with this process's stderr (fd 2) sent to a file; returns
    (fn's result or exception, what was written)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as out:
        os.dup2(out.fileno(), 2)
        try:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - returned to the caller
                result = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        return result, out.read().decode(errors="replace")


def n09_direct(folder):
    """Files opened O_DIRECT (as NIXL's storage example and NVMe offload
    open them) and O_DSYNC register; unaligned memory and extents move
    through the bounce pool, aligned ones straight; query_memory says what
    the registration gives; a refused registration says why in NIXL's log."""
    numpy = np()
    env = Env(folder)
    agent = env.agent
    n = 1 << 20
    original = pattern(n, 900)
    path, plain = env.file("direct", original)
    env.close_fd(plain)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_DSYNC | os.O_CLOEXEC)
    except OSError as e:
        note(f"SKIP n09_direct: {fs_type(folder)} refuses O_DIRECT ({e})")
        env.finish()
        return
    env.fds.append(fd)
    r_file = reg_file(agent, fd, path, n)
    got = agent.query_memory([(0, 0, fd, path)], "ORBITE_FILE", "FILE")[0]
    st = os.stat(path)
    check(got is not None and got.get("size") == str(n) and got.get("mode") == str(st.st_mode)
          and got.get("mtime") == str(int(st.st_mtime)), f"query of a direct file: {got!r}")
    check(got.get("direct") == "1" and got.get("sync") == "O_DSYNC", f"direct and durability in the query: {got!r}")
    align = int(got.get("dio_offset_align", "0"))
    check(align > 0 and align & (align - 1) == 0, f"the direct-I/O alignment: {got!r}")
    # memory: one page-aligned buffer and one off by 3
    raw = numpy.zeros(3 * n + 8192, dtype=numpy.uint8)
    at = (-raw.ctypes.data) % 4096
    mem = raw[at:at + 3 * n]
    r_mem = reg_dram(agent, mem)
    base = mem.ctypes.data
    src = pattern(n, 901)
    mem[:n] = src
    mem[n + 3:2 * n + 3] = src
    # WRITE: aligned (memory and file), then unaligned (memory off by 3,
    # file extent inside blocks at both ends)
    h = file_xfer(agent, True, [(base, 65536), (base + n + 3 + 100, 5000)], [(4096, 65536, fd), (200_001, 5000, fd)],
                  False)
    run_done(agent, h, "a WRITE into a direct file")
    agent.release_xfer_handle(h)
    want = original.copy()
    want[4096:4096 + 65536] = src[:65536]
    want[200_001:205_001] = src[100:5100]
    same_bytes(file_bytes(path), want, "the direct file after the WRITE")
    # READ both back into zeroed memory
    mem[:] = 0
    h = file_xfer(agent, False, [(base, 65536), (base + n + 3 + 100, 5000)], [(4096, 65536, fd), (200_001, 5000, fd)],
                  False)
    run_done(agent, h, "a READ from a direct file")
    agent.release_xfer_handle(h)
    same_bytes(mem[:65536], src[:65536], "the aligned READ")
    same_bytes(mem[n + 103:n + 5103], src[100:5100], "the unaligned READ")
    check(not mem[65536:n + 103].any() and not mem[n + 5103:].any(), "guard bytes around the READs")
    # (bounce buffers stay in the pool for reuse until the engine closes)
    stats = env.hooks.all_stats()
    check(stats["staging_buffers"] >= 1, f"the unaligned spans bounced: {stats!r}")
    # a refused registration says why through NIXL's logger
    d = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        res, log = _stderr_of(lambda: reg_file(agent, d, folder, 4096))
    finally:
        os.close(d)
    check(isinstance(res, Exception), f"a directory registered as a FILE: {res!r}")
    check("ORBITE_FILE" in log and "refused" in log and "not a regular file" in log,
          f"the refusal in NIXL's log: {log!r}")
    agent.deregister_memory(r_file)
    agent.deregister_memory(r_mem)
    env.finish()


TESTS = [
    ("n09_positions", n09_positions),
    ("n09_fragmented", n09_fragmented),
    ("n09_eof", n09_eof),
    ("n09_fd_reuse", n09_fd_reuse),
    ("n09_close_during_io", n09_close_during_io),
    ("n09_repost_one_file_closed", n09_repost_one_file_closed),
    ("n09_multi_file_budget", n09_multi_file_budget),
    ("n09_release_while_active", n09_release_while_active),
    ("n09_refused", n09_refused),
    ("n09_query_memory", n09_query_memory),
    ("n09_direct", n09_direct),
    ("n09_poll_yields", n09_poll_yields),
]


# ---------------------------------------------------------------------------
# the runner
# ---------------------------------------------------------------------------


def child(name, folder, result_path):
    """Runs one test in this (fresh) process and writes its result."""
    fn = dict(TESTS)[name]
    H.child_main(lambda: fn(folder), result_path, NOTES)


def run_one(name, fs, root, verbose):
    folder = tempfile.mkdtemp(prefix="orbite-file-test-", dir=root)
    saved = os.environ.get("LD_PRELOAD")
    try:
        if name in PRELOADED:
            try:
                # not in `folder`: a tmpfs may be mounted noexec
                lib = build_yield_counter(shim_dir())
            except TestFailure as e:
                print(f"FAIL {name}[{fs}]: {e}")
                return False
            os.environ["LD_PRELOAD"] = lib + (f":{saved}" if saved else "")
        return H.run_child(__file__, f"{name}[{fs}]", [name, folder], TEST_TIMEOUT_S, verbose, tail=40)
    finally:
        if saved is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = saved
        shutil.rmtree(folder, ignore_errors=True)


def main(argv):
    if len(argv) == 5 and argv[1] == "--child":
        child(argv[2], argv[3], argv[4])
        return 0
    verbose = "-v" in argv[1:]
    wanted = [a for a in argv[1:] if a != "-v"]
    known = dict(TESTS)
    fs_names = [f for f, _ in FILESYSTEMS]
    selected = []
    for name, _ in TESTS:
        for fs, root in FILESYSTEMS:
            if not wanted or name in wanted or f"{name}[{fs}]" in wanted:
                selected.append((name, fs, root))
    unknown = [w for w in wanted if w not in known and not any(w == f"{n}[{f}]" for n in known for f in fs_names)]
    if unknown:
        print(f"unknown test(s): {', '.join(unknown)}; known: {', '.join(known)} (optionally [tmpfs] or [disk])")
        print("python file tests: 0 passed, 1 failed")
        return 1
    missing = [v for v in ("NIXL_PLUGIN_DIR", "ORBITE_NIXL_LIB") if not os.environ.get(v)]
    if missing:
        print(f"FAIL environment: {', '.join(missing)} not set (see scripts/nixl-tests)")
        print("python file tests: 0 passed, 1 failed")
        return 1
    passed = failed = 0
    for fs, root in FILESYSTEMS:
        if not (os.path.isdir(root) and os.access(root, os.W_OK)):
            print(f"FAIL filesystem {fs}: {root} is not a writable folder")
            failed += 1
    for name, fs, root in selected:
        if not (os.path.isdir(root) and os.access(root, os.W_OK)):
            continue
        if run_one(name, fs, root, verbose):
            passed += 1
        else:
            failed += 1
    print(f"python file tests: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
