#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""ORBITE against UCX through NIXL's Python agent, two processes on one host,
DRAM to DRAM: the workloads of BENCH.md, with and without the agent's
progress thread; then ORBITE_FILE against POSIX (test/nixl/file_bench.py).

    agent_bench.py [--quick] [--json] [--rounds N] [--seconds S]
                   [--workload W1,W2,W3,file] [--ucx-threads N]

Each configuration (backend ORBITE or UCX, progress thread on or off) is a
fresh pair of processes, an initiator and a target, each with its own agent
created as vLLM's NixlConnector creates it:
  ORBITE  nixl_agent_config(backends=["ORBITE"], capture_telemetry=True):
          no backend parameters (ORBITE_CONFIG is removed from the
          environment unless --orbite-config gives one);
  UCX     nixl_agent_config(num_threads=N, capture_telemetry=True), vLLM's
          way for UCX alone, N = --ucx-threads (vLLM's default, 4);
both with enable_prog_thread on or off. Only the pair being measured is
alive: an idle agent's progress thread busy-polls a core, and this machine
may have two. A round runs every configuration once, the backends taking
turns (ORBITE first in odd rounds, UCX first in even ones).

Per pair, after registration and the metadata exchange (both ways), the
initiator prepares its descriptor lists once (prep_xfer_dlist, as vLLM does
at its handshake) and runs:
  W1-write, W1-read   64 MiB per transfer: 64 descriptors of 1 MiB, and
                      1 024 of 64 KiB (contiguous, never merged:
                      skip_desc_merge=True); one request reposted;
  W3-write, W3-read   vLLM's paged KV: 64 regions of 4 MiB registered on
                      each side, all 256 blocks of 16 KiB of every region,
                      block ids permuted at random on both sides (16 384
                      descriptors, 256 MiB); a new make_prepped_xfer per
                      transfer, timed apart (`prep_us`);
  W2-write, W2-read   one 4 KiB descriptor, post (transfer()) to DONE.
W1 and W3 poll check_xfer_state every 0.2 ms, as a serving engine's step
loop does (a busy loop would take the core a same-host copy needs); W2
polls without pause. Each W1/W3 row runs for --seconds per round (at least
3 transfers) after one untimed transfer; W2 runs 2 000 operations after
50 untimed ones.

Verification, every row: before the row the source is changed (every byte
+1) and the destination zeroed; after it, a digest of the destination
(blocks in the remote order) is compared with one of the source (blocks in
the local order).

Output: one JSON object per row on stdout, then a table (--json: JSON
only); a progress line per step on stderr. Rows:
  {"system": "nixl", "backend": "ORBITE"|"UCX", "workload": "W1-write",
   "block_bytes": 1048576, "descs": 64, "gbps": ..., "p50_us": ...,
   "p99_us": ..., "progress_thread": true, "verified": true, ...}
gbps is the median over rounds of (bytes moved / time spent) in a round;
p50_us and p99_us are per transfer (per operation for W2, which has no
gbps), over all rounds. ORBITE rows carry `x_ucx`: the median over rounds
of ORBITE's gbps over UCX's in the same round (for W2, UCX's p50 over
ORBITE's: above 1 means ORBITE is faster), and `bar` where BENCH.md sets
one. File rows (backend ORBITE_FILE or POSIX, workload file-write or
file-read, 1 MiB blocks) come from file_bench.py, ORBITE_FILE's with
`x_posix` and `x_limit` (against its plain io_uring loop).

Exit status 1 if any row failed or was not verified. Bars are reported,
never enforced. Environment: NIXL_PLUGIN_DIR (the folder with
libplugin_ORBITE.so; default target/meson-release/nixl-plugin, else
target/meson-plugin/nixl-plugin); run with the venv python of
scripts/nixl-tests, or through scripts/nixl-bench.
"""

import argparse
import gc
import hashlib
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

KIB, MIB = 1 << 10, 1 << 20
W1_BYTES = 64 * MIB
W1_SHAPES = [(MIB, 64), (64 * KIB, 1024)]  # (block, descriptors): 64 MiB each
W3_REGIONS, W3_REGION, W3_BLOCK = 64, 4 * MIB, 16 * KIB
W3_PER_REGION = W3_REGION // W3_BLOCK
W2_BYTES = 4 * KIB
POLL_S = 0.0002  # the initiator's pause between polls of a posted W1/W3 transfer
TICK_S = 0.001  # both sides' pause between get_new_notifs() calls while idle
STALL_S = 60.0  # a transfer still PROC this long after its post fails the row
# BENCH.md, "through NIXL's agent": (workload prefix, progress thread) -> bar on x_ucx
BARS = {("W3", True): 2.0, ("W3", False): 2.0, ("W1", True): 1.5, ("W1", False): 1.3}
BACKENDS = ["ORBITE", "UCX"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def w3_ids():
    """Local and remote descriptor indices of W3: region by region, the
    region's blocks in a random order of their own on each side."""
    local, remote = [], []
    for r in range(W3_REGIONS):
        a, b = list(range(W3_PER_REGION)), list(range(W3_PER_REGION))
        random.Random(11 + r).shuffle(a)
        random.Random(1000 + r).shuffle(b)
        local += [r * W3_PER_REGION + i for i in a]
        remote += [r * W3_PER_REGION + i for i in b]
    return local, remote


def percentile(sorted_xs, q):
    return sorted_xs[round((len(sorted_xs) - 1) * q)]


# ---------------------------------------------------------------------------
# one side of a pair (runs in its own process)
# ---------------------------------------------------------------------------


class Side:
    """One agent with one backend, its memory, and (on the initiator) the
    timed loops. Each public method is a command of the driver."""

    def __init__(self, name, backend, progress_thread, ucx_threads):
        import numpy as np

        from nixl._api import nixl_agent, nixl_agent_config

        self.np = np
        if backend == "UCX":
            config = nixl_agent_config(enable_prog_thread=progress_thread, num_threads=ucx_threads,
                                       capture_telemetry=True)
        else:
            config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend],
                                       capture_telemetry=True)
        self.agent = nixl_agent(name, config)
        if backend not in self.agent.backends:
            raise RuntimeError(f"the agent has no {backend} backend (plugins: {self.agent.get_plugin_list()})")
        self.regs, self.dlists, self.counts = [], {}, {}

    def _alloc(self, n, rng):
        buf = self.np.empty(n, dtype=self.np.uint8)
        buf[:] = self.np.frombuffer(rng.bytes(n), dtype=self.np.uint8)
        self.regs.append(self.agent.register_memory([(buf.ctypes.data, n, 0, "")], "DRAM"))
        return buf

    def setup(self, seed):
        """Registers W1's 64 MiB and W3's 64 regions; returns their addresses."""
        rng = self.np.random.default_rng(seed)
        self.w1 = self._alloc(W1_BYTES, rng)
        self.w3 = [self._alloc(W3_REGION, rng) for _ in range(W3_REGIONS)]
        return {"w1": self.w1.ctypes.data, "w3": [b.ctypes.data for b in self.w3]}

    def metadata(self):
        return self.agent.get_agent_metadata()

    def add_remote(self, md):
        name = self.agent.add_remote_agent(md)
        return name.decode() if isinstance(name, bytes) else name

    # --- the bytes of a row, and their digests
    def _bufs(self, area):
        if area == "w1":
            return [self.w1]
        if area == "w2":
            return [self.w1[:W2_BYTES]]
        return self.w3

    def change(self, area):
        """Every byte of the area +1 (a row's source)."""
        for b in self._bufs(area):
            self.np.add(b, 1, out=b)

    def zero(self, area):
        for b in self._bufs(area):
            b.fill(0)

    def digest(self, area, initiator):
        """sha256 of the area; for w3, of its blocks in the order of this
        side's descriptor indices (the initiator's local ones, or the remote
        ones for the target)."""
        h = hashlib.sha256()
        if area != "w3":
            h.update(memoryview(self._bufs(area)[0]))
            return h.hexdigest()
        views = [memoryview(b) for b in self.w3]
        for i in w3_ids()[0 if initiator else 1]:
            r, j = divmod(i, W3_PER_REGION)
            h.update(views[r][j * W3_BLOCK:(j + 1) * W3_BLOCK])
        return h.hexdigest()

    # --- the initiator
    def prep(self, remote, far):
        """Descriptor lists, prepared once (vLLM does it at its handshake)."""
        a = self.agent

        def pair(tag, local_descs, far_descs):
            self.dlists[tag] = (a.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, "DRAM"),
                                a.prep_xfer_dlist(remote, far_descs, "DRAM"))
            self.counts[tag] = len(local_descs)

        w1 = self.w1.ctypes.data
        for bs, n in W1_SHAPES:
            pair(f"w1-{bs}", [(w1 + i * bs, bs, 0) for i in range(n)], [(far["w1"] + i * bs, bs, 0) for i in range(n)])
        pair("w2", [(w1, W2_BYTES, 0)], [(far["w1"], W2_BYTES, 0)])
        blocks = lambda bases: [(base + j * W3_BLOCK, W3_BLOCK, 0) for base in bases for j in range(W3_PER_REGION)]
        pair("w3", blocks([b.ctypes.data for b in self.w3]), blocks(far["w3"]))
        return True

    def _ids(self, tag):
        np = self.np
        if tag == "w3":
            local, remote = w3_ids()
            return np.array(local, dtype=np.int32), np.array(remote, dtype=np.int32)
        ids = np.arange(self.counts[tag], dtype=np.int32)
        return ids, ids

    def _make(self, tag, op, ids):
        local, far = self.dlists[tag]
        return self.agent.make_prepped_xfer(op, local, ids[0], far, ids[1], skip_desc_merge=True)

    def _run(self, h, pause):
        a = self.agent
        t0 = time.perf_counter()
        s = a.transfer(h)
        polls = 0
        while s == "PROC":
            if pause:
                time.sleep(POLL_S)
            s = a.check_xfer_state(h)
            polls += 1
            if polls % 1024 == 0 and time.perf_counter() - t0 > STALL_S:
                raise RuntimeError(f"transfer still {s} {STALL_S:.0f} s after its post")
        t1 = time.perf_counter()
        if s != "DONE":
            raise RuntimeError(f"transfer ended {s}")
        return t1 - t0

    def bulk(self, tag, op, seconds, min_reps, remake):
        """Seconds per transfer (post to DONE) after one untimed transfer;
        with `remake`, a new request per transfer, its making timed apart."""
        ids = self._ids(tag)
        times, preps = [], []
        gc.disable()
        try:
            h = self._make(tag, op, ids)
            self._run(h, True)  # connections, caches
            deadline = time.monotonic() + seconds
            while len(times) < min_reps or (time.monotonic() < deadline and len(times) < 5000):
                if remake:
                    self.agent.release_xfer_handle(h)
                    t = time.perf_counter()
                    h = self._make(tag, op, ids)
                    preps.append(time.perf_counter() - t)
                times.append(self._run(h, True))
            self.agent.release_xfer_handle(h)
        finally:
            gc.enable()
        return {"times": times, "preps": preps}

    def latency(self, op, iters, warm):
        """Microseconds per 4 KiB operation, post to DONE, polled without pause."""
        ids = self._ids("w2")
        gc.disable()
        try:
            h = self._make("w2", op, ids)
            for _ in range(warm):
                self._run(h, False)
            out = [self._run(h, False) * 1e6 for _ in range(iters)]
            self.agent.release_xfer_handle(h)
        finally:
            gc.enable()
        return out

    def tick(self):
        """What a serving engine's step loop does between transfers: it asks
        for new notifications (which also progresses the backends; an agent
        without a progress thread depends on it)."""
        self.agent.get_new_notifs()

    def shutdown(self):
        for d in self.dlists.values():
            for x in d:
                self.agent.release_dlist_handle(x)
        self.dlists.clear()
        for r in self.regs:
            self.agent.deregister_memory(r)
        self.regs.clear()
        return True


def serve(conn, name, backend, progress_thread, ucx_threads):
    """A side's process: stdout goes to stderr (UCX logs to stdout, and the
    driver's stdout carries the JSON lines)."""
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        side = Side(name, backend, progress_thread, ucx_threads)
        conn.send(("ok", os.getpid()))
    except BaseException as exc:  # why the side could not start
        conn.send(("err", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            while not conn.poll(TICK_S):
                side.tick()
            cmd, args = conn.recv()
        except EOFError:
            return
        if cmd == "quit":
            try:
                side.shutdown()
            finally:
                conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(side, cmd)(*args)))
        except BaseException as exc:
            conn.send(("err", f"{cmd}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class SideError(Exception):
    pass


class Proc:
    """The driver's handle on one side's process."""

    def __init__(self, name, backend, progress_thread, ucx_threads):
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, name, backend, progress_thread, ucx_threads), daemon=True)
        self.proc.start()
        child.close()
        self._answer(60, "start")

    def _answer(self, timeout, what):
        if not self.conn.poll(timeout):
            self.kill()
            raise SideError(f"{self.name}: no answer to {what} within {timeout} s")
        try:
            tag, val = self.conn.recv()
        except EOFError:
            self.kill()
            raise SideError(f"{self.name} exited during {what}") from None
        if tag != "ok":
            raise SideError(f"{self.name}: {val}")
        return val

    def call(self, cmd, *args, timeout=120):
        self.conn.send((cmd, args))
        return self._answer(timeout, cmd)

    def quit(self):
        if self.proc.is_alive():
            try:
                self.call("quit", timeout=30)
            except (SideError, OSError):
                pass
            self.proc.join(30)
        self.kill()

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


# ---------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------


def row_plan(workloads):
    """(key, kind, tag, op, block_bytes, descs, bytes): every row a pair runs."""
    rows = []
    for op in ("WRITE", "READ"):
        if "W1" in workloads:
            for bs, n in W1_SHAPES:
                rows.append((f"W1-{op.lower()}", "bulk", f"w1-{bs}", op, bs, n, bs * n))
        if "W3" in workloads:
            rows.append((f"W3-{op.lower()}", "bulk", "w3", op, W3_BLOCK, W3_REGIONS * W3_PER_REGION,
                         W3_REGIONS * W3_REGION))
    for op in ("WRITE", "READ"):
        if "W2" in workloads:
            rows.append((f"W2-{op.lower()}", "latency", "w2", op, W2_BYTES, 1, W2_BYTES))
    return rows


def new_result():
    return {"rounds": [], "times": [], "preps": [], "verified": [], "errors": []}


def run_pair(args, backend, pt, plan, results, clock):
    """One configuration's pair: every row once, adding this round's samples
    to results[(backend, pt, workload, block)]. A failed row ends the pair;
    it and the rows not run yet record the error."""
    label = f"{backend} progress thread {'on' if pt else 'off'}"
    tgt = ini = None
    left = list(plan)
    try:
        tgt = Proc("target", backend, pt, args.ucx_threads)
        ini = Proc("initiator", backend, pt, args.ucx_threads)
        far = tgt.call("setup", 2)
        ini.call("setup", 1)
        remote = ini.call("add_remote", tgt.call("metadata"))
        tgt.call("add_remote", ini.call("metadata"))
        ini.call("prep", remote, far)
        log(f"{clock()} {label}: agents up, 320 MiB registered per side, metadata exchanged")
        while left:
            workload, kind, tag, op, bs, n, nbytes = left[0]
            res = results.setdefault((backend, pt, workload, bs), new_result())
            area = "w3" if tag == "w3" else ("w2" if tag == "w2" else "w1")
            src, dst = (ini, tgt) if op == "WRITE" else (tgt, ini)
            src.call("change", area)
            dst.call("zero", area)
            if kind == "bulk":
                got = ini.call("bulk", tag, op, args.seconds, args.min_reps, tag == "w3",
                               timeout=STALL_S * 4 + args.seconds)
                times = got["times"]
                res["preps"] += got["preps"]
                res["rounds"].append(nbytes * len(times) / sum(times) / 1e9)
                what = f"{res['rounds'][-1]:.2f} GB/s ({len(times)} transfers)"
            else:
                times = ini.call("latency", op, args.w2_iters, 50, timeout=STALL_S * 4)
                res["rounds"].append(statistics.median(times))
                what = f"p50 {res['rounds'][-1]:.1f} us ({len(times)} operations)"
            res["times"] += times
            # W3's blocks are compared in the order each side lists them
            ok = src.call("digest", area, src is ini) == dst.call("digest", area, dst is ini)
            res["verified"].append(ok)
            log(f"{clock()} {label}: {workload} {blk(bs)} x {n}: {what}, "
                f"{'verified' if ok else 'DESTINATION DIFFERS'}")
            left.pop(0)
    except SideError as e:
        why = str(e).splitlines()[0]
        log(f"{clock()} {label}: failed: {e}")
        for workload, _, _, _, bs, _, _ in left:
            results.setdefault((backend, pt, workload, bs), new_result())["errors"].append(why)
    finally:
        for p in (ini, tgt):
            if p is not None:
                p.quit()


def blk(bs):
    return f"{bs // MIB} MiB" if bs >= MIB else f"{bs // KIB} KiB"


def data_rows(args, plan, results):
    rows = []
    for pt in (True, False):
        for workload, kind, _, _, bs, n, nbytes in plan:
            per = {}
            for backend in BACKENDS:
                res = results.get((backend, pt, workload, bs))
                if res is None:
                    continue
                row = {"system": "nixl", "backend": backend, "workload": workload, "block_bytes": bs, "descs": n,
                       "progress_thread": pt}
                ok = bool(res["verified"]) and all(res["verified"]) and not res["errors"] and bool(res["times"])
                if res["times"]:
                    ts = sorted(res["times"])
                    scale = 1.0 if kind == "latency" else 1e6
                    if kind == "bulk":
                        row["gbps"] = round(statistics.median(res["rounds"]), 3)
                        row["runs_gbps"] = [round(g, 3) for g in res["rounds"]]
                    row["p50_us"] = round(percentile(ts, 0.5) * scale, 2)
                    row["p99_us"] = round(percentile(ts, 0.99) * scale, 2)
                    row["transfers" if kind == "bulk" else "operations"] = len(ts)
                    if res["preps"]:
                        row["prep_us"] = round(statistics.median(res["preps"]) * 1e6, 1)
                row["bytes"] = nbytes
                if backend == "UCX":
                    row["ucx_threads"] = args.ucx_threads
                row["verified"] = ok
                if res["errors"]:
                    row["error"] = res["errors"][0]
                per[backend] = (row, res)
                rows.append(row)
            if "ORBITE" in per and "UCX" in per:
                (orow, ores), (_, ures) = per["ORBITE"], per["UCX"]
                pairs = list(zip(ores["rounds"], ures["rounds"]))
                if pairs and len(ores["rounds"]) == len(ures["rounds"]):
                    ratios = [(o / u if kind == "bulk" else u / o) for o, u in pairs if o > 0 and u > 0]
                    if ratios:
                        orow["x_ucx"] = round(statistics.median(ratios), 2)
                        orow["runs_x_ucx"] = [round(r, 2) for r in ratios]
                bar = BARS.get((workload[:2], pt))
                if bar is not None:
                    orow["bar"] = bar
                    if "x_ucx" in orow:
                        orow["meets_bar"] = orow["x_ucx"] >= bar
    return rows


def file_rows(args, plugin_dir, clock):
    """ORBITE_FILE and POSIX at 1 MiB, READ and WRITE, from file_bench.py
    (which also runs its io_uring reference and 16 KiB blocks)."""
    cmd = [sys.executable, os.path.join(HERE, "file_bench.py"), "--json-only", "--fs", args.file_fs]
    cmd += ["--total-mib", "32", "--reps", "1"] if args.quick else ["--total-mib", "256", "--reps", "3"]
    log(f"{clock()} file: {' '.join(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in cmd[1:])}")
    env = dict(os.environ, NIXL_PLUGIN_DIR=plugin_dir)
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=1200)
        got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        status = f"exit status {r.returncode}"
    except subprocess.TimeoutExpired:
        got, status = [], "timed out after 1200 s"
    by = {(g["system"], g["op"]): g for g in got if g.get("block_bytes") == MIB}
    rows = []
    for system in ("ORBITE_FILE", "POSIX"):
        for op in ("WRITE", "READ"):
            g = by.get((system, op))
            if g is None:
                rows.append({"system": "nixl", "backend": system, "workload": f"file-{op.lower()}",
                             "block_bytes": MIB, "verified": False, "error": f"file_bench.py gave no row ({status})"})
                continue
            row = {"system": "nixl", "backend": system, "workload": f"file-{op.lower()}", "block_bytes": MIB,
                   "descs": g["total_bytes"] // MIB, "gbps": g["gbps"], "runs_gbps": g["runs_gbps"], "fs": g["fs"],
                   "fs_path": g["fs_path"], "bytes": g["total_bytes"], "verified": g["verified"]}
            if system == "ORBITE_FILE":
                row["bar_x_posix"], row["bar_x_limit"] = 1.0, 0.9  # BENCH.md, "files"
                posix, ref = by.get(("POSIX", op)), by.get(("reference", op))
                if posix and posix["gbps"] > 0:
                    row["x_posix"] = round(g["gbps"] / posix["gbps"], 2)
                if ref and ref["gbps"] > 0:
                    row["x_limit"] = round(g["gbps"] / ref["gbps"], 2)
                    row["limit"] = "io_uring loop"
                    row["limit_gbps"] = ref["gbps"]
            rows.append(row)
    log(f"{clock()} file: done (file_bench.py {status})")
    return rows


def table(rows):
    out = [f"{'backend':11} {'thread':6} {'workload':10} {'block':>7} {'descs':>6} {'GB/s':>7} {'p50 us':>9} "
           f"{'p99 us':>9} {'ratio':>6} {'bar':>4} {'meets':>5}  verified"]
    for r in rows:
        pt = "" if "progress_thread" not in r else ("on" if r["progress_thread"] else "off")
        ratio = r.get("x_ucx", r.get("x_posix"))
        bar = r.get("bar", r.get("bar_x_posix"))
        meets = "-" if bar is None or ratio is None else ("yes" if ratio >= bar else "no")
        f = lambda k, spec: format(r[k], spec) if isinstance(r.get(k), (int, float)) else "-"
        out.append(f"{r['backend']:11} {pt:6} {r['workload']:10} {blk(r['block_bytes']):>7} {r.get('descs', '-'):>6} "
                   f"{f('gbps', '7.2f'):>7} {f('p50_us', '9.1f'):>9} {f('p99_us', '9.1f'):>9} "
                   f"{(format(ratio, '.2f') if ratio is not None else '-'):>6} "
                   f"{(format(bar, '.1f') if bar is not None else '-'):>4} {meets:>5}  {r['verified']}")
    return "\n".join(out)


def resolve_plugin_dir():
    for d in (os.environ.get("NIXL_PLUGIN_DIR"), os.path.join(REPO, "target", "meson-release", "nixl-plugin"),
              os.path.join(REPO, "target", "meson-plugin", "nixl-plugin")):
        if d and os.path.exists(os.path.join(d, "libplugin_ORBITE.so")):
            return os.path.abspath(d)
    sys.exit("agent_bench: libplugin_ORBITE.so not found (run scripts/nixl-bench or scripts/nixl-tests, "
             "or set NIXL_PLUGIN_DIR)")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="everything short: a check of function and format")
    ap.add_argument("--json", action="store_true", help="JSON lines only on stdout")
    ap.add_argument("--rounds", type=int, help="rounds of every configuration (default 3, quick 1)")
    ap.add_argument("--seconds", type=float, help="per W1/W3 row and round (default 1.0, quick 0.1)")
    ap.add_argument("--workload", default="W1,W2,W3,file", help="comma list of W1, W2, W3, file")
    ap.add_argument("--ucx-threads", type=int, default=4, help="UCX's num_threads (vLLM's default: 4)")
    ap.add_argument("--progress-thread", default="on,off", help="on, off or on,off")
    ap.add_argument("--file-fs", default="disk", help="file_bench.py's --fs for the file rows (disk or tmpfs)")
    ap.add_argument("--orbite-config", help="ORBITE_CONFIG for the ORBITE agents (default: none, as vLLM)")
    args = ap.parse_args(argv[1:])
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.seconds = args.seconds if args.seconds is not None else (0.1 if args.quick else 1.0)
    args.min_reps = 2 if args.quick else 3
    args.w2_iters = 200 if args.quick else 2000
    workloads = {w.strip().upper() for w in args.workload.split(",") if w.strip()}
    bad = workloads - {"W1", "W2", "W3", "FILE"}
    if bad:
        ap.error(f"unknown workload(s) {sorted(bad)}")
    pts = [{"on": True, "off": False}[p.strip()] for p in args.progress_thread.split(",") if p.strip()]

    t_start = time.monotonic()
    clock = lambda: f"nixl-bench [{time.monotonic() - t_start:5.0f} s]"
    plugin_dir = resolve_plugin_dir()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.pop("ORBITE_CONFIG", None)  # as vLLM creates the backend
    if args.orbite_config:
        os.environ["ORBITE_CONFIG"] = args.orbite_config
    sys.path.insert(0, HERE)
    import multihost  # its mixed plugin folder: ORBITE beside the wheel's UCX

    rows = []
    plan = row_plan(workloads)
    with tempfile.TemporaryDirectory(prefix="orbite-agent-bench-") as tmp:
        if plan:
            os.environ["NIXL_PLUGIN_DIR"] = plugin_dir
            multihost.mixed_plugin_dir(tmp)
            log(f"{clock()} {args.rounds} round(s); ORBITE with no parameters, UCX with num_threads="
                f"{args.ucx_threads}; plugin {plugin_dir}")
            results = {}
            for rnd in range(args.rounds):
                order = BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]
                for pt in pts:
                    for backend in order:
                        log(f"{clock()} round {rnd + 1}/{args.rounds}: {backend}, progress thread "
                            f"{'on' if pt else 'off'}")
                        run_pair(args, backend, pt, plan, results, clock)
            rows += data_rows(args, plan, results)
    if "FILE" in workloads:
        os.environ["NIXL_PLUGIN_DIR"] = plugin_dir
        rows += file_rows(args, plugin_dir, clock)
    for r in rows:
        print(json.dumps(r), flush=True)
    if not args.json:
        print()
        print(table(rows))
        print(f"\nGB/s = 1e9 B/s, median over {args.rounds} round(s). ratio: on ORBITE rows x_ucx, ORBITE's GB/s "
              f"over UCX's in the same round (W2: UCX's p50 over ORBITE's), median over rounds; on ORBITE_FILE "
              f"rows x_posix. bar: BENCH.md's.")
        print("Two processes on one host (same-host routes). Shared machines move absolute figures by up to "
              "2 x: compare the ratios.")
        print(f"total time {time.monotonic() - t_start:.1f} s")
    return 0 if rows and all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
