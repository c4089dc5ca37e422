# SPDX-License-Identifier: Apache-2.0
"""The binding's overhead: W1 at 1 MiB descriptors (one WRITE of 64 MiB in
64 descriptors, posted and waited for again and again for about 2 s)
driven from Python through `orbite`, against the same transfer driven
from Rust by `orbite bench`, alternating, in one run.

    python w1_overhead.py --orbite target/release/orbite [--routes tcp,cma] [--runs 3]

with the package from a release wheel (`maturin build --release`): the
wheel `scripts/python-tests` builds is unoptimised.

Both sides use the same target process (`orbite bench-target`, 256 MiB
registered) and the bench's engine configuration (the progress worker on).
GB/s is bytes moved over the summed time of the executions, as
`orbite bench` computes it. Prints one JSON line per measurement, then per
route the median of each and their ratio (bar: Python >= 0.9 x Rust).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import orbite

MIB = 1 << 20
TOTAL = 64 * MIB
BLOCK = MIB
CONFIG = {"progress_worker": True}


def rust(orbite_bin, route, secs):
    out = subprocess.run([orbite_bin, "bench", "--route", route, "--workload", "W1", "--blocks", str(BLOCK),
                          "--ops", "write", "--json"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        row = json.loads(line)
        if row.get("system") == "orbite" and row.get("workload") == "W1-write" and row.get("block_bytes") == BLOCK:
            return row["gbps"]
    raise RuntimeError(f"no W1-write 1 MiB row from orbite bench:\n{out}")


def python(orbite_bin, route, secs):
    env = dict(os.environ, ORBITE_BENCH_TARGET_CONFIG=json.dumps(CONFIG))
    target = subprocess.Popen([orbite_bin, "bench-target"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        ready = target.stdout.readline().split()
        assert ready and ready[0] == "READY", ready
        endpoint, epoch, r_id = ready[1], int(ready[2]), int(ready[3])
        e = orbite.Engine({**CONFIG, "route": route})
        src = e.allocate(256 * MIB, shared=False)
        src[:] = 0x11
        s = e.register(src)
        peer = e.open_peer(endpoint, epoch=epoch)
        n = TOTAL // BLOCK
        t = e.prepare("write", [(s, i * BLOCK, BLOCK) for i in range(n)], [(r_id, i * BLOCK, BLOCK) for i in range(n)],
                      peer=peer)
        assert t.route[0] == route, t.route
        times = []
        start = time.perf_counter()
        while time.perf_counter() - start < secs or len(times) < 3:
            t0 = time.perf_counter()
            t.post()
            out = t.wait(60.0)
            times.append(time.perf_counter() - t0)
            assert out is not None and out.success, out
        t.release()
        e.close()
        return TOTAL * len(times) / sum(times) / 1e9
    finally:
        try:
            target.stdin.write("quit\n")
            target.stdin.flush()
            target.wait(timeout=10)
        except Exception:  # noqa: BLE001
            target.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--orbite", default="target/release/orbite")
    ap.add_argument("--routes", default="tcp,cma")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--secs", type=float, default=2.0)
    a = ap.parse_args()
    result = {}
    for route in a.routes.split(","):
        got = {"rust": [], "python": []}
        for run in range(a.runs):
            for side, f in (("rust", rust), ("python", python)):
                gbps = f(a.orbite, route, a.secs)
                got[side].append(gbps)
                print(json.dumps({"route": route, "run": run, "driver": side, "workload": "W1-write",
                                  "block_bytes": BLOCK, "gbps": round(gbps, 3)}), flush=True)
        r, p = statistics.median(got["rust"]), statistics.median(got["python"])
        result[route] = p / r
        print(json.dumps({"route": route, "rust_gbps_median": round(r, 3), "python_gbps_median": round(p, 3),
                          "python_over_rust": round(p / r, 3)}), flush=True)
    return 0 if all(x >= 0.9 for x in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
