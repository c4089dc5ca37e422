#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Two-process tests of the NIXL backend ORBITE through NIXL's own Python agent
(the PyPI wheel nixl==1.5.1), run by scripts/nixl-tests.

Environment: NIXL_PLUGIN_DIR (the folder of libplugin_ORBITE.so),
ORBITE_NIXL_LIB (absolute path of the staged liborbite_nixl.so.1, built with
test hooks: the same library the plugin loads), NIXL_LOG_LEVEL (WARN).

    run_tests.py [-v] [TEST ...]

Each test runs in a fresh process (its own session, so a timeout kills the
test and every peer process it started); the test starts its second
processes with multiprocessing (spawn) and drives them over pipes. Prints
`PASS name` or `FAIL name: reason` per test (with the test's log on
failure, and always with -v), then `python tests: N passed, M failed`; exits
nonzero on any failure.

What NIXL 1.5.1's Python agent reports (the tests rely on it):
- check_xfer_state never returns "ERR" for a backend failure: the binding
  raises the status as an exception (nixlBackendError, nixlNotAllowedError,
  ...); `orbite_harness.state` folds that into ("ERR", exc).
- a refused release raises nixlRepostActiveError, and NIXL stores that
  status in its request: until the handle is posted again, check_xfer_state
  raises nixlRepostActiveError instead of asking the backend, so the
  engine's own state (stats) is what shows the execution still active.
"""

import gc
import os
import random
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import orbite_harness as H  # noqa: E402
from orbite_harness import (  # noqa: E402
    ORBITE_TEST_FAIL,
    ORBITE_TEST_RUN,
    ORBITE_TEST_SHORT,
    Hooks,
    let_go,
    Peers,
    TestFailure,
    check,
    descs,
    digest,
    xfer,
    drive,
    expect_raises,
    expect_stats,
    make_agent,
    post,
    run_to_done,
    state,
    wait_stats,
    wait_until,
)

TEST_TIMEOUT_S = 60
NOTES = []


def note(msg):
    """A remark shown with -v (what a test could not check, and why)."""
    NOTES.append(msg)


def np():
    import numpy

    return numpy


def pattern(n, seed, avoid=None):
    """n deterministic pseudo-random bytes; `avoid` (a guard value) never occurs."""
    numpy = np()
    rng = numpy.random.default_rng(seed)
    if avoid is None:
        return rng.integers(0, 256, n, dtype=numpy.uint8)
    v = rng.integers(0, 255, n, dtype=numpy.uint8)
    v[v >= avoid] += 1
    return v


def register(agent, buf):
    return agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")


def first_diff(a, b):
    numpy = np()
    a = numpy.frombuffer(bytes(a), dtype=numpy.uint8) if not isinstance(a, numpy.ndarray) else a
    b = numpy.frombuffer(bytes(b), dtype=numpy.uint8) if not isinstance(b, numpy.ndarray) else b
    if a.shape != b.shape:
        return f"sizes {a.nbytes} and {b.nbytes}"
    idx = numpy.nonzero(a != b)[0]
    if idx.size == 0:
        return None
    i = int(idx[0])
    return f"{idx.size} bytes differ, first at {i}: {a[i]:#04x} != {b[i]:#04x}"


def same_bytes(got, want, what):
    d = first_diff(got, want)
    check(d is None, f"{what}: {d}")


def expect_error(exc, names, what):
    check(type(exc).__name__ in names, f"{what}: expected {' or '.join(names)}, got {exc!r}")


def engines_gone(hooks):
    """After the caller dropped every reference to its agent (handles hold
    one too): the engine must have been released with the agent."""
    gc.collect()
    n = len(hooks.engines())
    check(n == 0, f"{n} OrbiTE engine(s) still alive after the agent was destroyed")


def marker_barrier(sender_agent, sender_name, peer, tag, expect=0):
    """Waits until `peer` has `expect` notifications from the sender, then
    sends a marker and waits for it, so that every notification sent before
    had its chance to arrive (duplicates included). Returns all notifications
    from the sender received by `peer` (which forgets them), marker removed."""
    if expect:
        peer.wait_notifs(sender_name, expect)
    marker = b"__marker__" + tag
    sender_agent.send_notif(peer.name, marker)
    got = peer.wait_for(sender_name, marker)
    check(marker in got, f"marker notification did not reach {peer.name}")
    got = list(got)
    got.remove(marker)
    return got


# ---------------------------------------------------------------------------
# n01: fragmented WRITE and READ between two processes, cma and tcp
# ---------------------------------------------------------------------------


def _layout(sizes, order, start, gaps):
    """Offsets for `sizes` laid out in `order` with the given gaps."""
    offs = [0] * len(sizes)
    at = start
    for k, i in enumerate(order):
        offs[i] = at
        at += sizes[i] + gaps[k % len(gaps)]
    return offs, at


def _n01_route(route):
    numpy = np()
    TB = 1 << 20  # target buffer
    GUARD_T, GUARD_D = 0xAB, 0xCD
    cfg = '{"task_bytes": 65536}' if route == "auto" else '{"route": "tcp", "task_bytes": 65536}'
    with Peers() as peers:
        t = peers.start("T")
        t_base = t.stats()
        t_addr = t.register("buf", TB, GUARD_T)

        agent = make_agent("I", cfg)
        hooks = Hooks()
        base = hooks.stats()
        src = pattern(1 << 20, 1, avoid=GUARD_T)
        dst = numpy.full(1 << 20, GUARD_D, dtype=numpy.uint8)
        r_src, r_dst = register(agent, src), register(agent, dst)
        check(agent.add_remote_agent(t.metadata()) in (b"T", "T"), "add_remote_agent did not return T")

        # WRITE: 24 fragments of odd sizes; remote places them at odd offsets
        # with guard gaps, in another order than the descriptor list; the
        # local side uses yet another order, and fragment 9 aliases inside
        # fragment 8 (overlapping sources).
        sizes = [1, 3, 7, 17, 31, 61, 127, 255, 4093, 1021, 2039, 509,
                 8191, 12289, 65537, 3, 1, 777, 333, 4095, 16385, 40001, 131071, 150007]
        n = len(sizes)
        rng = random.Random(7)
        r_order = list(range(n))
        rng.shuffle(r_order)
        r_offs, r_end = _layout(sizes, r_order, 5, [13, 1, 257, 4099, 2])
        l_offs, l_end = _layout(sizes, list(reversed(range(n))), 3, [1, 31, 0, 9])
        l_offs[9] = l_offs[8] + 1001  # 2039 bytes inside fragment 8 (4093 bytes)
        check(r_end < TB and l_end < src.nbytes, "fragment layout does not fit")
        expect_t = numpy.full(TB, GUARD_T, dtype=numpy.uint8)
        for i in range(n):
            expect_t[r_offs[i] : r_offs[i] + sizes[i]] = src[l_offs[i] : l_offs[i] + sizes[i]]
        notif = b"n01\x00\xff" + route.encode()
        hw = agent.initialize_xfer(
            "WRITE",
            descs(agent, [(src.ctypes.data + l_offs[i], sizes[i]) for i in range(n)]),
            descs(agent, [(t_addr + r_offs[i], sizes[i]) for i in range(n)]),
            "T",
            notif,
        )
        hooks.hold_all(True)
        s, exc = post(agent, hw)
        if route == "auto":
            check(s == "PROC", f"WRITE post returned {s} {exc!r}")
            # the same-host route holds at the initiator's hook: cma (or shm)
            hooks.require_held(1)
            check(t.digest("buf") == digest(numpy.full(TB, GUARD_T, dtype=numpy.uint8)),
                  "target bytes changed while every task was held")
            let_go(hooks, lambda: state(agent, hw)[0] != "PROC")
            s, exc = drive(agent, hw)
        else:
            # tcp is not held by the initiator's hook: it completes regardless,
            # on a fast machine even before post returns
            check(s in ("PROC", "DONE"), f"WRITE post returned {s} {exc!r}")
            s, exc = drive(agent, hw)
            st, held = hooks.wait_held(1, 0)
            check(held == 0, f"{held} tcp tasks held by the initiator's local hook")
            hooks.hold_all(False)
        check(s == "DONE", f"WRITE ended {s} {exc!r}")
        same_bytes(t.read("buf"), expect_t, f"target buffer after the {route} WRITE")
        got = marker_barrier(agent, "I", t, b"n01w", expect=1)
        check(got == [notif], f"target notifications after the WRITE: {got!r}")

        # READ back 20 other fragments (remote: odd offsets anywhere, guards
        # included; local: distinct places in dst), through prepped lists
        # with skip_desc_merge; fragments 3..5 are adjacent on both sides.
        rs = [5, 1, 999, 3, 7, 11, 65536 + 7, 123, 40000, 17, 1, 2, 4097,
              33333, 255, 1023, 9, 150001, 77, 8191]
        m = len(rs)
        rr = random.Random(11)
        rd_r = [rr.randrange(0, TB - 300000) | 1 for _ in rs]
        rd_r[4] = rd_r[3] + rs[3]  # 3, 4, 5 adjacent on the remote side
        rd_r[5] = rd_r[4] + rs[4]
        units = [[i] for i in range(m) if i not in (3, 4, 5)] + [[3, 4, 5]]
        rr.shuffle(units)
        rd_l, at = [0] * m, 1
        for k, unit in enumerate(units):
            for i in unit:  # adjacent on the local side too
                rd_l[i] = at
                at += rs[i]
            at += (k % 3) * 5 + 2
        check(at < dst.nbytes, "READ layout does not fit")
        expect_d = numpy.full(dst.nbytes, GUARD_D, dtype=numpy.uint8)
        for i in range(m):
            expect_d[rd_l[i] : rd_l[i] + rs[i]] = expect_t[rd_r[i] : rd_r[i] + rs[i]]
        lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.ctypes.data + rd_l[i], rs[i], 0) for i in range(m)], "DRAM")
        rp = agent.prep_xfer_dlist("T", [(t_addr + rd_r[i], rs[i], 0) for i in range(m)], "DRAM")
        hr = agent.make_prepped_xfer("READ", lp, list(range(m)), rp, list(range(m)), skip_desc_merge=True)
        run_to_done(agent, hr, f"{route} READ")
        same_bytes(dst, expect_d, f"initiator buffer after the {route} READ")
        same_bytes(t.read("buf"), expect_t, "target buffer after the READ")

        for h in (hw, hr):
            agent.release_xfer_handle(h)
        lp.release()
        rp.release()
        agent.deregister_memory(r_src)
        agent.deregister_memory(r_dst)
        agent.remove_remote_agent("T")
        wait_stats(hooks.stats, base, f"initiator ({route}) after release")
        t.deregister("buf")
        wait_stats(t.stats, t_base, f"target ({route}) after release")
        peers.close_all()
        del agent, hw, hr, lp, rp, h
        engines_gone(hooks)


def n01_dram_fragmented():
    _n01_route("auto")
    gc.collect()
    _n01_route("tcp")


# ---------------------------------------------------------------------------
# n02: release refused while active (tcp held at the target; self connection)
# ---------------------------------------------------------------------------


def n02_active_release():
    numpy = np()
    N = 4 << 20
    with Peers() as peers:
        t = peers.start("T")
        t_base = t.stats()
        t_addr = t.register("buf", N, 0)
        zeros = digest(numpy.zeros(N, dtype=numpy.uint8))

        agent = make_agent("I", '{"route": "tcp"}')
        hooks = Hooks()
        base = hooks.stats()
        src = pattern(N, 2)
        r_src = register(agent, src)
        agent.add_remote_agent(t.metadata())
        ref = hooks.stats()  # the peer connection is open now

        # 1. tcp, the target's server holds the request: release refused.
        h = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(t_addr, N)], "T", b"n02")
        t.hold_remote(True)
        s, exc = post(agent, h)
        check(s == "PROC", f"post returned {s} {exc!r}")
        for _ in range(50):
            s, exc = state(agent, h)
            check(s == "PROC", f"state while the target holds the request: {s} {exc!r}")
        active = hooks.stats()
        check(active["executions"] == 1, f"executions {active['executions']} while active, want 1")
        exc = expect_raises(agent.release_xfer_handle, "release while active", h)
        expect_error(exc, ["nixlRepostActiveError"], "release while active")
        expect_stats(active, hooks.stats(), "after the refused release")
        # NIXL 1.5.1 stores the refused release's status in its request, so the
        # agent answers from that instead of polling the backend (see above).
        s, exc = state(agent, h)
        check(s == "PROC" or (exc is not None and type(exc).__name__ == "nixlRepostActiveError"),
              f"state after the refused release: {s} {exc!r}")
        if s != "PROC":
            note("n02: after a refused release NIXL 1.5.1 answers check_xfer_state with the cached "
                 "nixlRepostActiveError; the engine's stats show the execution still active")
        # a repost while active is refused by the backend as well
        s2, exc2 = post(agent, h)
        check(s2 == "ERR" and type(exc2).__name__ == "nixlRepostActiveError",
              f"repost while active: {s2} {exc2!r}")
        check(hooks.stats()["executions"] == 1, "the refused calls changed the execution")
        check(t.digest("buf") == zeros, "target bytes changed while its server held the request")
        t.hold_remote(False)
        wait_stats(hooks.stats, ref, "initiator after the target let the request go",
                   prepared_transfers=1, binding_handles=ref["binding_handles"] + 1)
        same_bytes(t.read("buf"), src, "target buffer")
        got = marker_barrier(agent, "I", t, b"n02a", expect=1)
        check(got == [b"n02"], f"target notifications: {got!r} (want exactly one)")
        agent.release_xfer_handle(h)  # retired now: succeeds
        expect_stats(ref, hooks.stats(), "after the release")

        # 2. the same, polled through to DONE without an early release
        src[:] = pattern(N, 3)
        h = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(t_addr, N)], "T")
        t.hold_remote(True)
        s, exc = post(agent, h)
        check(s == "PROC", f"post returned {s} {exc!r}")
        for _ in range(50):
            s, exc = state(agent, h)
            check(s == "PROC", f"state while held: {s} {exc!r}")
        t.hold_remote(False)
        s, exc = drive(agent, h)
        check(s == "DONE", f"ended {s} {exc!r}")
        same_bytes(t.read("buf"), src, "target buffer (second transfer)")
        agent.release_xfer_handle(h)
        got = marker_barrier(agent, "I", t, b"n02b")
        check(got == [], f"notifications of a transfer that asked for none: {got!r}")
        expect_stats(ref, hooks.stats(), "after the second transfer")

        # 3. the self connection: hold_all, release refused, then retirement.
        dst = numpy.zeros(N, dtype=numpy.uint8)
        r_dst = register(agent, dst)
        h = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(dst.ctypes.data, N)], "I")
        hooks.hold_all(True)
        s, exc = post(agent, h)
        check(s == "PROC", f"local post returned {s} {exc!r}")
        hooks.require_held(1)
        active = hooks.stats()
        check(active["executions"] == 1, f"local executions {active['executions']}, want 1")
        exc = expect_raises(agent.release_xfer_handle, "local release while active", h)
        expect_error(exc, ["nixlRepostActiveError"], "local release while active")
        expect_stats(active, hooks.stats(), "after the refused local release")
        check(not dst.any(), "local destination written while held")
        let_go(hooks, lambda: hooks.stats()["executions"] == 0)
        wait_until(lambda: hooks.stats()["executions"] == 0, 10, "the local execution to retire")
        same_bytes(dst, src, "local destination")
        agent.release_xfer_handle(h)
        note("n02: explicit cancel is not reachable through NIXL's Python agent (the C++ test covers it)")

        agent.deregister_memory(r_src)
        agent.deregister_memory(r_dst)
        agent.remove_remote_agent("T")
        wait_stats(hooks.stats, base, "initiator at the end")
        t.deregister("buf")
        wait_stats(t.stats, t_base, "target at the end")
        peers.close_all()
        del h
        del agent
        engines_gone(hooks)


# ---------------------------------------------------------------------------
# n03: the fault hooks on the self connection
# ---------------------------------------------------------------------------


def n03_fault_hooks():
    numpy = np()
    N = 1 << 20
    TASK = 262144
    G = 0xEE
    agent = make_agent("A", '{"task_bytes": %d}' % TASK)
    hooks = Hooks()
    base = hooks.stats()
    src = pattern(N, 4, avoid=G)
    dst = numpy.full(N, G, dtype=numpy.uint8)
    r1, r2 = register(agent, src), register(agent, dst)
    ref = hooks.stats()

    def write(n, notif=b""):
        return xfer(agent, "WRITE", [(src.ctypes.data, n)], [(dst.ctypes.data, n)], "A", notif)

    # (a) every task withheld: PROC across many checks, then RUN -> DONE
    h = write(N)
    hooks.hold_all(True)
    check(post(agent, h)[0] == "PROC", "post did not return PROC")
    hooks.require_held(N // TASK)
    for _ in range(500):
        s, exc = state(agent, h)
        check(s == "PROC", f"state while every task is held: {s} {exc!r}")
    check((dst == G).all(), "bytes moved while every task was held")
    let_go(hooks, lambda: state(agent, h)[0] != "PROC")
    s, exc = drive(agent, h)
    check(s == "DONE", f"(a) ended {s} {exc!r}")
    same_bytes(dst, src, "(a) destination")
    agent.release_xfer_handle(h)
    expect_stats(ref, hooks.stats(), "(a) after release")

    # (b) SHORT 1000 on a single-task transfer: ERR (never DONE), repost
    # refused, nothing beyond the first 1000 bytes written
    dst[:] = G
    h = write(TASK, b"short")
    hooks.fault_push(ORBITE_TEST_SHORT, 1000)
    s, exc = post(agent, h)
    check(s in ("PROC", "ERR"), f"(b) post returned {s} {exc!r}")
    s, exc = drive(agent, h)
    check(s == "ERR", f"(b) ended {s} (want ERR)")
    expect_error(exc, ["nixlBackendError"], "(b) state")
    same_bytes(dst[:1000], src[:1000], "(b) the first 1000 bytes")
    check((dst[1000:] == G).all(), "(b) bytes beyond the first 1000 were written")
    s, exc = post(agent, h)
    check(s == "ERR", f"(b) repost of a short transfer returned {s}")
    expect_error(exc, ["nixlNotAllowedError"], "(b) repost")
    check((dst[1000:] == G).all(), "(b) the refused repost wrote bytes")
    check(hooks.stats()["executions"] == 0, "(b) the refused repost started an execution")
    agent.release_xfer_handle(h)
    expect_stats(ref, hooks.stats(), "(b) after release")

    # (b') a logical failure known before retirement: 4 tasks, the first
    # short, the other 3 held: PROC until they are let go, then ERR
    dst[:] = G
    h = write(N, b"short4")
    hooks.hold_all(True)
    hooks.fault_push(ORBITE_TEST_SHORT, 1000)
    check(post(agent, h)[0] == "PROC", "(b') post did not return PROC")
    hooks.require_held(3)
    for _ in range(300):
        s, exc = state(agent, h)
        check(s == "PROC", f"(b') state with a failed task and 3 held: {s} {exc!r}")
    check(hooks.stats()["executions"] == 1, "(b') execution not active")
    let_go(hooks, lambda: state(agent, h)[0] != "PROC")
    s, exc = drive(agent, h)
    check(s == "ERR", f"(b') ended {s} (want ERR)")
    changed = dst != G
    counts = [int(changed[c * TASK : (c + 1) * TASK].sum()) for c in range(N // TASK)]
    check(sorted(counts) == [1000] + [TASK] * 3, f"(b') bytes written per task: {counts}")
    check((dst[changed] == src[changed]).all(), "(b') written bytes differ from the source")
    check(post(agent, h)[0] == "ERR", "(b') repost accepted")
    agent.release_xfer_handle(h)

    # (c) FAIL with the effect unknown: ERR, no replay, no notification
    dst[:] = G
    h = write(N, b"never-delivered")
    hooks.fault_push(ORBITE_TEST_FAIL, 500, 1)
    s, exc = post(agent, h)
    check(s in ("PROC", "ERR"), f"(c) post returned {s} {exc!r}")
    s, exc = drive(agent, h)
    check(s == "ERR", f"(c) ended {s} (want ERR)")
    for notif in (None, b"other"):
        s, exc = post(agent, h, notif)
        check(s == "ERR", f"(c) repost ({notif!r}) of an uncertain WRITE returned {s}")
        expect_error(exc, ["nixlNotAllowedError"], "(c) repost")
    check(hooks.stats()["executions"] == 0, "(c) a refused repost started an execution")
    agent.send_notif("A", b"__marker__c")
    got = []
    wait_until(lambda: got.extend(agent.get_new_notifs().get("A", [])) or b"__marker__c" in got, 10, "the marker")
    check(got == [b"__marker__c"], f"(c) notifications: {got!r} (the failed WRITE's must not arrive)")
    agent.release_xfer_handle(h)

    # (d) a held task let go with FAIL (effect unknown) -> ERR
    h = write(TASK)
    hooks.hold_all(True)
    check(post(agent, h)[0] == "PROC", "(d) post did not return PROC")
    hooks.require_held(1)
    let_go(hooks, lambda: state(agent, h)[0] != "PROC", ORBITE_TEST_FAIL, 0, 1)
    s, exc = drive(agent, h)
    check(s == "ERR", f"(d) ended {s} (want ERR)")
    agent.release_xfer_handle(h)

    agent.deregister_memory(r1)
    agent.deregister_memory(r2)
    expect_stats(base, hooks.stats(), "at the end")
    del h
    del agent
    engines_gone(hooks)


# ---------------------------------------------------------------------------
# n04: deregistration while a transfer borrows the memory
# ---------------------------------------------------------------------------


def n04_deregister_with_borrowers():
    numpy = np()
    N = 1 << 20
    with Peers() as peers:
        t = peers.start("T")
        t_base = t.stats()
        t_a = t.register("a", N, 0)
        t_b = t.register("b", N, 0)
        t_c = t.register("c", N, 0)
        t.write("c", 0, pattern(N, 5).tobytes())
        t_ref = t.stats()

        agent = make_agent("I")
        hooks = Hooks()
        base = hooks.stats()
        agent.add_remote_agent(t.metadata())
        ref = hooks.stats()

        # 1. the initiator deregisters its source while its WRITE is held
        src = pattern(N, 6)
        r_src = register(agent, src)
        h = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(t_a, N)], "T")
        hooks.hold_all(True)
        check(post(agent, h)[0] == "PROC", "post did not return PROC")
        hooks.require_held(1)
        agent.deregister_memory(r_src)  # NIXL: success
        s = hooks.stats()
        check(s["fenced_registrations"] == 1 and s["registrations"] == 1,
              f"after deregistering the borrowed source: registrations {s['registrations']}, "
              f"fenced {s['fenced_registrations']} (want 1 and 1)")
        let_go(hooks, lambda: state(agent, h)[0] != "PROC")
        st, exc = drive(agent, h)
        check(st == "DONE", f"WRITE from a deregistered source ended {st} {exc!r}")
        same_bytes(t.read("a"), src, "target buffer a")
        agent.release_xfer_handle(h)
        wait_stats(hooks.stats, ref, "initiator after the borrowed source retired")

        # 2. the target deregisters its buffer while the initiator's WRITE
        # into it is held: the target keeps the registration (fenced) until
        # that transfer retired and was released
        src2 = pattern(N, 7)
        r_src2 = register(agent, src2)
        h = xfer(agent, "WRITE", [(src2.ctypes.data, N)], [(t_b, N)], "T")
        hooks.hold_all(True)
        check(post(agent, h)[0] == "PROC", "post did not return PROC")
        hooks.require_held(1)
        t.deregister("b")
        ts = t.stats()
        check(ts["fenced_registrations"] == 1 and ts["registrations"] == t_ref["registrations"],
              f"target after deregistering a borrowed buffer: registrations {ts['registrations']}, "
              f"fenced {ts['fenced_registrations']} (want {t_ref['registrations']} and 1)")
        let_go(hooks, lambda: state(agent, h)[0] != "PROC")
        st, exc = drive(agent, h)
        check(st == "DONE", f"WRITE into a deregistered (borrowed) target buffer ended {st} {exc!r}")
        same_bytes(t.read("b"), src2, "target buffer b")
        agent.release_xfer_handle(h)
        wait_stats(t.stats, t_ref, "target after the borrower released",
                   registrations=t_ref["registrations"] - 1,
                   registered_bytes=t_ref["registered_bytes"] - N,
                   binding_handles=t_ref["binding_handles"] - 1)

        # 3. the same remote range twice in one READ list
        dst = numpy.zeros(3 * 65536, dtype=numpy.uint8)
        r_dst = register(agent, dst)
        want = numpy.frombuffer(t.read("c", 1001, 65536), dtype=numpy.uint8)
        frag = [(dst.ctypes.data, 65536), (dst.ctypes.data + 2 * 65536, 65536)]
        h = agent.initialize_xfer("READ", descs(agent, frag), descs(agent, [(t_c + 1001, 65536)] * 2), "T")
        run_to_done(agent, h, "READ of a duplicated remote range")
        same_bytes(dst[:65536], want, "first copy")
        same_bytes(dst[2 * 65536 :], want, "second copy")
        check(not dst[65536 : 2 * 65536].any(), "bytes between the two copies were written")
        agent.release_xfer_handle(h)

        agent.deregister_memory(r_src2)
        agent.deregister_memory(r_dst)
        agent.remove_remote_agent("T")
        wait_stats(hooks.stats, base, "initiator at the end")
        t.deregister("a")
        t.deregister("c")
        wait_stats(t.stats, t_base, "target at the end")
        peers.close_all()
        del h
        del agent
        engines_gone(hooks)


# ---------------------------------------------------------------------------
# n05: a target restarts under the same agent name
# ---------------------------------------------------------------------------


def n05_metadata_unload_restart():
    numpy = np()
    N = 256 << 10
    with Peers() as peers:
        t1 = peers.start("T")
        u = peers.start("U")
        t1_addr = t1.register("buf", N, 0)
        u_addr = u.register("buf", N, 0)

        agent = make_agent("I")
        hooks = Hooks()
        base = hooks.stats()
        src = pattern(N, 8)
        r_src = register(agent, src)
        agent.add_remote_agent(t1.metadata())
        agent.add_remote_agent(u.metadata())
        u_sent = []

        def to_u(h, tag):
            src[:] = pattern(N, tag)
            run_to_done(agent, h, f"transfer to U ({tag})")
            u_sent.append(b"u")
            same_bytes(u.read("buf"), src, f"U's buffer ({tag})")

        h_old = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(t1_addr, N)], "T", b"old")
        h_u = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(u_addr, N)], "U", b"u")
        run_to_done(agent, h_old, "transfer to T (first incarnation)")
        same_bytes(t1.read("buf"), src, "T's buffer")
        to_u(h_u, 100)

        # a transfer in flight when T exits: ends ERR (no hang), no replay
        h_fly = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(t1_addr, N)], "T")
        hooks.hold_all(True)
        check(post(agent, h_fly)[0] == "PROC", "post did not return PROC")
        hooks.require_held(1)
        t1.exit()  # abrupt: no NIXL or engine teardown
        check(not t1.proc.is_alive(), "T did not exit")
        let_go(hooks, lambda: state(agent, h_fly)[0] != "PROC")
        s, exc = drive(agent, h_fly)
        check(s == "ERR", f"transfer to an exited process ended {s} {exc!r}")
        s, exc = post(agent, h_fly)
        check(s == "ERR", f"repost of a failed transfer to an exited process returned {s}")
        agent.release_xfer_handle(h_fly)
        to_u(h_u, 101)  # the other peer is unaffected

        # a new process under the same name (a new engine epoch)
        t2 = peers.start("T")
        t2_addr = t2.register("buf", N, 0)
        md2 = t2.metadata()
        # the new T's notification, before this agent knows the new T: the
        # backend drops it when drained (a stale incarnation of a known
        # agent). U's notification, sent after it, is the barrier: both go
        # through this engine's same-host inbox, a FIFO ring.
        my_md = agent.get_agent_metadata()
        t2.add_remote(my_md)
        u.add_remote(my_md)
        t2.send_notif("I", b"early")
        u.send_notif("I", b"probe")
        mine = {}

        def probe_seen():
            for k, v in agent.get_new_notifs().items():
                mine.setdefault(k, []).extend(v)
            return b"probe" in mine.get("U", [])

        wait_until(probe_seen, 10, "U's probe notification")
        check(mine == {"U": [b"probe"]},
              f"notifications before the new T's metadata was loaded: {mine!r} (the new T's must be dropped)")
        exc = expect_raises(agent.add_remote_agent, "loading a new T over the old one", md2)
        note(f"n05: add_remote_agent of a restarted agent without remove_remote_agent: {exc!r} "
             "(NIXL refuses changed connection info itself; the backend is not asked)")
        agent.remove_remote_agent("T")
        name = agent.add_remote_agent(md2)
        check(name in (b"T", "T"), f"add_remote_agent returned {name!r}")
        # the handle prepared against the first incarnation cannot be reposted
        s, exc = post(agent, h_old)
        check(s == "ERR", f"repost of a handle of the old incarnation returned {s}")
        note(f"n05: repost of a handle of the old incarnation: {exc!r}")
        check(t2.digest("buf") == digest(numpy.zeros(N, dtype=numpy.uint8)),
              "the refused repost wrote into the new T")
        agent.release_xfer_handle(h_old)
        to_u(h_u, 102)
        # the new T's notifications are accepted now, under its name
        t2.send_notif("I", b"late")
        mine = []
        wait_until(lambda: mine.extend(agent.get_new_notifs().get("T", [])) or mine, 10, "the new T's notification")
        check(mine == [b"late"], f"notifications from the new T: {mine!r} (b'early' must have been dropped)")

        # a new handle reaches the new incarnation
        src[:] = pattern(N, 103)
        h_new = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(t2_addr, N)], "T", b"new")
        run_to_done(agent, h_new, "transfer to the new T")
        same_bytes(t2.read("buf"), src, "the new T's buffer")
        got = marker_barrier(agent, "I", t2, b"t2", expect=1)
        check(got == [b"new"], f"the new T's notifications: {got!r} (want only b'new')")
        agent.release_xfer_handle(h_new)

        # unloading U's metadata: its handle cannot be posted; after reloading, a new one works
        agent.remove_remote_agent("U")
        s, exc = post(agent, h_u)
        check(s == "ERR", f"post after remove_remote_agent returned {s}")
        agent.release_xfer_handle(h_u)
        agent.add_remote_agent(u.metadata())
        h_u = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(u_addr, N)], "U", b"u")
        to_u(h_u, 104)
        agent.release_xfer_handle(h_u)
        got = marker_barrier(agent, "I", u, b"u", expect=len(u_sent))
        check(got == u_sent, f"U's notifications: {len(got)} (want {len(u_sent)})")

        agent.deregister_memory(r_src)
        agent.remove_remote_agent("T")
        agent.remove_remote_agent("U")
        wait_stats(hooks.stats, base, "initiator at the end")
        peers.close_all()
        del h_old, h_fly, h_new, h_u
        del agent
        engines_gone(hooks)


# ---------------------------------------------------------------------------
# n07: reposts and the engine's bounds
# ---------------------------------------------------------------------------


def n07_repost_and_bounds():
    numpy = np()
    N = 1 << 20
    with Peers() as peers:
        t = peers.start("T")
        t_addr = t.register("buf", N, 0)
        agent = make_agent("I")
        hooks = Hooks()
        base = hooks.stats()
        src = numpy.zeros(N, dtype=numpy.uint8)
        r_src = register(agent, src)
        agent.add_remote_agent(t.metadata())

        # a drained success is reposted 3 times, with fresh bytes each time
        h = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(t_addr, N)], "T", b"rep")
        for k in range(4):
            src[:] = pattern(N, 20 + k)
            run_to_done(agent, h, f"post {k}")
            check(t.digest("buf") == digest(src), f"post {k}: the target does not hold this post's bytes")
        # a repost while active is refused; the handle stays pollable
        hooks.hold_all(True)
        check(post(agent, h)[0] == "PROC", "post did not return PROC")
        hooks.require_held(1)
        s, exc = post(agent, h)
        check(s == "ERR", f"repost while active returned {s}")
        expect_error(exc, ["nixlRepostActiveError"], "repost while active")
        for _ in range(50):
            s, exc = state(agent, h)
            check(s == "PROC", f"state after a refused repost: {s} {exc!r}")
        check(hooks.stats()["executions"] == 1, "refused repost changed the executions")
        let_go(hooks, lambda: state(agent, h)[0] != "PROC")
        s, exc = drive(agent, h)
        check(s == "DONE", f"ended {s} {exc!r}")
        got = marker_barrier(agent, "I", t, b"rep", expect=5)
        check(got == [b"rep"] * 5, f"{len(got)} notifications for 5 posts")
        agent.release_xfer_handle(h)
        agent.deregister_memory(r_src)
        agent.remove_remote_agent("T")
        wait_stats(hooks.stats, base, "after the reposts")
        peers.close_all()
        del h
        del agent
        engines_gone(hooks)

    # descriptor bound (8) and execution bound (1) on the self connection
    agent = make_agent("B", '{"max_descriptors_per_transfer": 8, "max_executions": 1}')
    hooks = Hooks()
    base = hooks.stats()
    src = pattern(N, 30)
    dst = numpy.zeros(N, dtype=numpy.uint8)
    r1, r2 = register(agent, src), register(agent, dst)
    ref = hooks.stats()
    frag = [(i * 4096 + 1, 1000) for i in range(9)]
    exc = expect_raises(
        agent.initialize_xfer, "initialize_xfer with 9 descriptors (bound 8)", "WRITE",
        descs(agent, [(src.ctypes.data + o, n) for o, n in frag]),
        descs(agent, [(dst.ctypes.data + o, n) for o, n in frag]), "B")
    expect_error(exc, ["nixlBackendError"], "9 descriptors")
    expect_stats(ref, hooks.stats(), "after the refused 9-descriptor transfer")
    lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data + i * 1000, 1000, 0) for i in range(9)], "DRAM")
    rp = agent.prep_xfer_dlist("B", [(dst.ctypes.data + i * 1000, 1000, 0) for i in range(9)], "DRAM")
    exc = expect_raises(agent.make_prepped_xfer, "9 prepped descriptors, not merged", "WRITE", lp, list(range(9)), rp,
                        list(range(9)), skip_desc_merge=True)
    expect_error(exc, ["nixlBackendError"], "9 prepped descriptors")
    expect_stats(ref, hooks.stats(), "after the refused prepped transfer")
    # NIXL merges the 9 adjacent descriptors into one by default: allowed
    h = agent.make_prepped_xfer("WRITE", lp, list(range(9)), rp, list(range(9)))
    run_to_done(agent, h, "9 merged descriptors")
    same_bytes(dst[:9000], src[:9000], "merged transfer")
    agent.release_xfer_handle(h)
    lp.release()
    rp.release()
    dst[:] = 0
    h8 = agent.initialize_xfer("WRITE", descs(agent, [(src.ctypes.data + o, n) for o, n in frag[:8]]),
                               descs(agent, [(dst.ctypes.data + o, n) for o, n in frag[:8]]), "B")
    run_to_done(agent, h8, "8 descriptors")
    for o, n in frag[:8]:
        same_bytes(dst[o : o + n], src[o : o + n], f"8-descriptor transfer at {o}")
    agent.release_xfer_handle(h8)

    # max_executions 1: a second post while the first is held fails cleanly
    dst[:] = 0
    half = N // 2
    h1 = xfer(agent, "WRITE", [(src.ctypes.data, half)], [(dst.ctypes.data, half)], "B")
    h2 = agent.initialize_xfer("WRITE", descs(agent, [(src.ctypes.data + half, half)]),
                               descs(agent, [(dst.ctypes.data + half, half)]), "B")
    hooks.hold_all(True)
    check(post(agent, h1)[0] == "PROC", "first post did not return PROC")
    hooks.require_held(1)
    before = hooks.stats()
    s, exc = post(agent, h2)
    check(s == "ERR", f"second post beyond max_executions returned {s}")
    expect_error(exc, ["nixlBackendError"], "second post")
    expect_stats(before, hooks.stats(), "after the refused second post")
    check(not dst[half:].any(), "the refused post wrote bytes")
    let_go(hooks, lambda: state(agent, h1)[0] != "PROC")
    s, exc = drive(agent, h1)
    check(s == "DONE", f"first transfer ended {s} {exc!r}")
    # the refused post admitted nothing: the handle can be posted now
    run_to_done(agent, h2, "the second handle after the first retired")
    same_bytes(dst, src, "both halves")
    agent.release_xfer_handle(h1)
    agent.release_xfer_handle(h2)
    agent.deregister_memory(r1)
    agent.deregister_memory(r2)
    expect_stats(base, hooks.stats(), "bounds agent at the end")
    del h, h8, h1, h2, lp, rp
    del agent
    engines_gone(hooks)

    # bytes-in-flight budget (work waits) and the admission queue (fails fast)
    agent = make_agent("C", '{"max_bytes_in_flight": 65536, "task_bytes": 65536, "admission_queue_len": 1}')
    hooks = Hooks()
    base = hooks.stats()
    src = pattern(N, 31)
    dst = numpy.zeros(N, dtype=numpy.uint8)
    r1, r2 = register(agent, src), register(agent, dst)
    K = 65536
    hs = [agent.initialize_xfer("WRITE", descs(agent, [(src.ctypes.data + i * K, K)]),
                                descs(agent, [(dst.ctypes.data + i * K, K)]), "C") for i in range(3)]
    hooks.hold_all(True)
    check(post(agent, hs[0])[0] == "PROC", "first post did not return PROC")
    hooks.require_held(1)
    check(post(agent, hs[1])[0] == "PROC", "second post (queued) did not return PROC")
    s = hooks.stats()
    check(s["queued_executions"] == 1 and s["bytes_in_flight"] == K,
          f"queued {s['queued_executions']}, in flight {s['bytes_in_flight']} (want 1 and {K})")
    st, exc = post(agent, hs[2])
    check(st == "ERR", f"post beyond the admission queue returned {st}")
    expect_stats(s, hooks.stats(), "after the post refused by the full admission queue")
    let_go(hooks, lambda: hooks.stats()["executions"] == 0)
    for i in (0, 1):
        st, exc = drive(agent, hs[i])
        check(st == "DONE", f"transfer {i} ended {st} {exc!r}")
    run_to_done(agent, hs[2], "the refused handle, posted again")
    same_bytes(dst[: 3 * K], src[: 3 * K], "three transfers")
    for h in hs:
        agent.release_xfer_handle(h)
    # a 1 MiB transfer goes through the 64 KiB budget one task at a time
    dst[:] = 0
    h = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(dst.ctypes.data, N)], "C")
    hooks.hold_all(True)
    check(post(agent, h)[0] == "PROC", "budget post did not return PROC")
    released = 0
    for _ in range(N // K):
        hooks.require_held(1)  # one task at a time: the budget admits no second
        s = hooks.stats()
        check(s["bytes_in_flight"] <= K and s["tasks_in_flight"] <= 1,
              f"budget exceeded: {s['bytes_in_flight']} bytes, {s['tasks_in_flight']} tasks in flight")
        hooks.release_held(ORBITE_TEST_RUN)
        released += 1
    hooks.hold_all(False)
    s, exc = drive(agent, h)
    check(s == "DONE" and released == N // K, f"budget transfer ended {s} after {released} tasks")
    same_bytes(dst, src, "budget transfer")
    agent.release_xfer_handle(h)
    agent.deregister_memory(r1)
    agent.deregister_memory(r2)
    expect_stats(base, hooks.stats(), "budget agent at the end")
    del h, hs
    del agent
    engines_gone(hooks)


# ---------------------------------------------------------------------------
# n08: notifications
# ---------------------------------------------------------------------------


def n08_notifications():
    numpy = np()
    binary = b"\x00\xff\x00bin\xfe\x80\xc3\x28\xa0\xa1" + bytes(range(256)) + b"\x00"
    with Peers() as peers:
        t = peers.start("T")
        t_addr = t.register("buf", 65536, 0)
        agent = make_agent("I")
        hooks = Hooks()
        base = hooks.stats()
        agent.add_remote_agent(t.metadata())
        src = pattern(65536, 40)
        r_src = register(agent, src)

        # standalone, binary payloads (and an empty one)
        for p in (binary, b"", bytes([0xFF]) * 60000):
            agent.send_notif("T", p)
        got = marker_barrier(agent, "I", t, b"a", expect=3)
        check(got == [binary, b"", bytes([0xFF]) * 60000],
              f"standalone notifications: {[len(g) for g in got]} bytes")

        # transfer notifications: exactly one per post, 20 posts
        sent = []
        h = xfer(agent, "WRITE", [(src.ctypes.data, 4096)], [(t_addr, 4096)], "T", binary)
        for k in range(20):
            if k % 4 == 3:  # a fresh handle now and then
                agent.release_xfer_handle(h)
                h = agent.initialize_xfer("WRITE", descs(agent, [(src.ctypes.data, 4096)]),
                                          descs(agent, [(t_addr, 4096)]), "T", binary)
                notif = binary
                run_to_done(agent, h, f"post {k}")
            elif k % 2:
                notif = binary + bytes([k]) + b"\xff\x00"
                st, exc = post(agent, h, notif)
                check(st in ("DONE", "PROC"), f"post {k} returned {st} {exc!r}")
                st, exc = drive(agent, h)
                check(st == "DONE", f"post {k} ended {st} {exc!r}")
            else:
                notif = binary if k == 0 else sent[-1]
                run_to_done(agent, h, f"post {k}")
            sent.append(notif)
        agent.release_xfer_handle(h)
        got = marker_barrier(agent, "I", t, b"b", expect=len(sent))
        check(sorted(got) == sorted(sent), f"{len(got)} transfer notifications for {len(sent)} posts")

        # to itself
        agent.send_notif("I", binary)
        mine = []
        wait_until(lambda: mine.extend(agent.get_new_notifs().get("I", [])) or mine, 10, "the self notification")
        check(mine == [binary], f"self notification: {mine!r}")
        exc = expect_raises(agent.add_remote_agent, "loading the agent's own metadata", agent.get_agent_metadata())
        note(f"n08: NIXL refuses loading an agent's own metadata ({exc!r}); the self notification needs none")

        # oversized: refused, nothing delivered
        big = b"\x00" * (64 * 1024 + 1)
        exc = expect_raises(agent.send_notif, "an oversized notification", "T", big)
        expect_error(exc, ["nixlBackendError"], "oversized send_notif")
        exc = expect_raises(agent.initialize_xfer, "a transfer with an oversized notification", "WRITE",
                            descs(agent, [(src.ctypes.data, 4096)]), descs(agent, [(t_addr, 4096)]), "T", big)
        h = xfer(agent, "WRITE", [(src.ctypes.data, 4096)], [(t_addr, 4096)], "T")
        st, exc = post(agent, h, big)
        check(st == "ERR", f"post with an oversized notification returned {st}")
        check(hooks.stats()["executions"] == 0, "a post with an oversized notification started")
        agent.release_xfer_handle(h)
        got = marker_barrier(agent, "I", t, b"c")
        check(got == [], f"after the oversized ones: {[len(g) for g in got]}")

        # unreachable targets: a process that exited (connected before, or never)
        u1 = peers.start("U1")
        u1.register("buf", 4096, 0)  # its metadata carries memory: the peer is opened at load
        u2 = peers.start("U2")  # no memory: not connected before the first notification
        agent.add_remote_agent(u1.metadata())
        agent.add_remote_agent(u2.metadata())
        agent.send_notif("U1", b"alive")
        check(u1.wait_for("I", b"alive") == [b"alive"], "U1 did not get its notification")
        for p in (u1, u2):
            p.exit()
            t0 = time.monotonic()
            silent = 0
            while True:
                try:
                    agent.send_notif(p.name, b"anyone?")
                    silent += 1
                except Exception as e:
                    if not H.is_nixl_error(e):
                        raise
                    break
                check(time.monotonic() - t0 < 10, f"notifications to the exited {p.name} kept succeeding")
                time.sleep(0.01)
            took = time.monotonic() - t0
            check(took < 15, f"the notification to the exited {p.name} took {took:.1f} s to fail")
            if silent:
                note(f"n08: {silent} notification(s) to the exited {p.name} returned success before the loss was seen")
            agent.remove_remote_agent(p.name)

        agent.deregister_memory(r_src)
        agent.remove_remote_agent("T")
        wait_stats(hooks.stats, base, "initiator at the end")
        peers.close_all()
        del h
        del agent
        engines_gone(hooks)
        check(numpy is not None, "")


# ---------------------------------------------------------------------------
# vLLM's NixlConnector flow: decode READs prefill's blocks, then notifies
# ---------------------------------------------------------------------------


def vllm_style_flow():
    numpy = np()
    BLOCKS, B = 64, 16 << 10
    with Peers() as peers:
        prefill = peers.start("prefill")
        p_base = prefill.stats()
        p_addr = prefill.register("kv", BLOCKS * B, 0)

        decode = make_agent("decode")
        hooks = Hooks()
        base = hooks.stats()
        kv = numpy.zeros(BLOCKS * B, dtype=numpy.uint8)
        r_kv = register(decode, kv)
        # the handshake: both sides load each other's metadata
        check(decode.add_remote_agent(prefill.metadata()) in (b"prefill", "prefill"), "add prefill")
        prefill.add_remote(decode.get_agent_metadata())
        p_ref = prefill.stats()

        local = decode.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(kv.ctypes.data + i * B, B, 0) for i in range(BLOCKS)], "DRAM")
        remote = decode.prep_xfer_dlist("prefill", [(p_addr + i * B, B, 0) for i in range(BLOCKS)], "DRAM")

        requests = [
            (b"req-42", [3, 7, 8, 9, 20, 41, 63], [10, 2, 3, 4, 60, 33, 0]),
            (b"req-43", [0, 1, 2, 5, 30, 31], [5, 6, 7, 8, 40, 41]),
            (b"req-44", [62, 12, 50, 13], [1, 11, 12, 61]),
        ]
        for n, (tag, r_ids, l_ids) in enumerate(requests):
            # prefill computes the request's blocks
            for b in r_ids:
                prefill.write("kv", b * B, pattern(B, 1000 * n + b).tobytes())
            h = decode.make_prepped_xfer("READ", local, l_ids, remote, r_ids, notif_msg=tag)
            run_to_done(decode, h, f"{tag!r}")
            for lb, rb in zip(l_ids, r_ids):
                same_bytes(kv[lb * B : (lb + 1) * B], pattern(B, 1000 * n + rb), f"{tag!r} block {rb} -> {lb}")
            decode.release_xfer_handle(h)
            # prefill frees the blocks once decode's notification arrived
            got = prefill.wait_for("decode", tag)
            check(got == [tag], f"prefill's notifications for {tag!r}: {got!r}")
            for b in r_ids:
                prefill.write("kv", b * B, b"\xee" * B)  # reused for another request
            for lb, rb in zip(l_ids, r_ids):
                same_bytes(kv[lb * B : (lb + 1) * B], pattern(B, 1000 * n + rb), f"{tag!r} block {lb} after reuse")
        decode.send_notif("prefill", b"__marker__end")
        got = prefill.wait_for("decode", b"__marker__end")
        check(got == [b"__marker__end"], f"prefill's further notifications: {got!r}")
        expect_stats(p_ref, prefill.stats(), "prefill after the requests")
        # decode released its requests: prefill's deregistration is released
        # once that reached prefill (the release of a lease is asynchronous)
        prefill.deregister("kv")
        wait_stats(prefill.stats, p_ref, "prefill after deregistration",
                   registrations=p_base["registrations"], registered_bytes=p_base["registered_bytes"],
                   binding_handles=p_ref["binding_handles"] - 1)
        prefill.remove_remote("decode")
        wait_stats(prefill.stats, p_base, "prefill after unloading decode")

        local.release()
        remote.release()
        decode.deregister_memory(r_kv)
        decode.remove_remote_agent("prefill")
        wait_stats(hooks.stats, base, "decode at the end")
        peers.close_all()
        del h, local, remote
        del decode
        engines_gone(hooks)


LOG_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import orbite_harness as H
agent = H.make_agent("logs", style="vllm")
del agent
"""


def log_forwarding():
    """The engine's log records reach NIXL's logger at matching levels, so
    NIXL_LOG_LEVEL governs them: the engine's warning that it listens
    without authentication shows under WARN and INFO (INFO also shows its
    RDMA line), and nothing of it under ERROR."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    seen = {}
    for level in ("ERROR", "WARN", "INFO"):
        env = dict(os.environ, NIXL_LOG_LEVEL=level)
        env.pop("ORBITE_LOG", None)
        r = subprocess.run([sys.executable, "-c", LOG_CHILD, here], env=env, capture_output=True, text=True,
                           timeout=60)
        check(r.returncode == 0, f"an agent under NIXL_LOG_LEVEL={level}: {r.stderr[-2000:]}")
        seen[level] = r.stderr
    warn = "orbite::engine: engine 0x"
    check(warn in seen["WARN"] and "without authentication" in seen["WARN"],
          f"the engine's warning under WARN: {seen['WARN'][-2000:]!r}")
    check(warn in seen["INFO"] and "orbite::rdma" in seen["INFO"], f"INFO: {seen['INFO'][-2000:]!r}")
    check("orbite::rdma" not in seen["WARN"], "an info record under WARN")
    check(warn not in seen["ERROR"], f"a warning under ERROR: {seen['ERROR'][-2000:]!r}")
    check("orbite: WARN" not in "".join(seen.values()), "a record went to the engine's own stderr logger")


TESTS = [
    ("n01_dram_fragmented", n01_dram_fragmented),
    ("n02_active_release", n02_active_release),
    ("n03_fault_hooks", n03_fault_hooks),
    ("n04_deregister_with_borrowers", n04_deregister_with_borrowers),
    ("n05_metadata_unload_restart", n05_metadata_unload_restart),
    ("n07_repost_and_bounds", n07_repost_and_bounds),
    ("n08_notifications", n08_notifications),
    ("vllm_style_flow", vllm_style_flow),
    ("log_forwarding", log_forwarding),
]


# ---------------------------------------------------------------------------
# the runner
# ---------------------------------------------------------------------------


def main(argv):
    return H.suite_main(argv, __file__, TESTS, NOTES, "python tests", TEST_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
