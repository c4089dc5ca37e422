#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Throughput of ORBITE_FILE against NIXL's POSIX plugin and a plain io_uring
reference loop, between DRAM and one local file, in one run.

    file_bench.py [--fs disk,tmpfs] [--total-mib 256] [--reps 3] [--qd 64]
                  [--buf-offset 0] [--no-fsync] [--direct] [--json-only]

Three systems move the same bytes between the same buffers and the same file:
  ORBITE_FILE  this repository's plugin, through NIXL's Python agent
               (backends=[], create_backend("ORBITE_FILE", {})): one request
               holding every block descriptor, posted with transfer() and
               polled with check_xfer_state() until DONE;
  POSIX        NIXL's own POSIX plugin from the same wheel, through its own
               agent in the same process, same descriptors, same polling, with
               use_uring=true when its parameters offer it (else its default);
  reference    a tiny C program (compiled here with gcc, raw io_uring
               syscalls; liburing-dev is not needed) doing what fio's io_uring
               engine does with buffered I/O: one IORING_OP_READ/WRITE per
               block, sequential offsets, at most --qd in flight, no SQPOLL,
               no registered buffers or files.
For each filesystem (the disk under /tmp first, then the tmpfs /dev/shm while
the time budget allows), operation (WRITE memory -> file, READ file ->
memory) and block size (1 MiB, 16 KiB) it runs every system --reps times,
interleaved, and reports the median (GB/s = 1e9 bytes/s). The timed part is
transfer() to DONE for the NIXL systems (initialize_xfer is not timed) and
the submit/complete loop for the reference.

Buffers: every memory buffer of the run, the reference's included, starts
--buf-offset bytes (default 0) past a page boundary, in anonymous memory of
the same kind (private mappings, no huge-page advice). The alignment must be
the same for all: the kernel copies between the page cache and user memory
with `rep movsb`, whose speed depends on the user address. Measured on an
AMD EPYC (FSRM): the reference loop READs into memory 16 bytes past a page
boundary (where numpy puts the data of a large array: malloc's header) at
0.38-0.43 x its page-aligned rate, and WRITEs from it at 0.9-1.0 x. Offset 0
is the usual case for KV buffers (page-aligned or pinned allocations); a
nonzero --buf-offset measures all three systems at that misalignment.

O_DIRECT (--direct): every system, the reference included, moves the bytes
through a descriptor opened with O_DIRECT, bypassing the page cache. With
--buf-offset 0 every block is aligned (memory, offset and length), so
ORBITE_FILE takes its straight path; a --buf-offset below the device's DMA
alignment (8, say) misaligns the memory: ORBITE_FILE then moves every block
through its bounce buffers, and POSIX and the reference fail (EINVAL), as
the kernel refuses them.

Page cache: nothing is dropped from the page cache (that needs root). All
three systems run against the page cache under the same conditions: the file
is fully allocated and cached before the first measurement, every WRITE is
an overwrite of cached pages, and after each WRITE (untimed) the file is
fsync'ed (unless --no-fsync) so that every measurement starts with clean
cached pages. Reads are therefore reads from the page cache.

Every measurement is verified: after a WRITE the file is read back and
compared with the source pattern; after a READ the destination is compared
with the pattern the file holds (the reference program compares its own
buffer). Patterns alternate between two seeds so that a WRITE always
changes every word of the file and a READ lands in a zeroed buffer.

Output: a table, one JSON line per row
({"system", "op", "block_bytes", "gbps", "verified", ...}), and the ratios
ORBITE_FILE/POSIX and ORBITE_FILE/reference per operation and block size.

Environment: NIXL_PLUGIN_DIR may point at the folder holding
libplugin_ORBITE_FILE.so (default: target/meson-plugin/nixl-plugin under the
repository); run it with the venv python of scripts/nixl-tests. The script
re-executes itself with NIXL_PLUGIN_DIR set to a temporary folder of links
to both plugins, and LD_LIBRARY_PATH set to the wheel's library folders
(POSIX needs them: its RPATH is relative to the wheel).
"""

import argparse
import gc
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CHILD_FLAG = "ORBITE_FILE_BENCH_CHILD"
FILESYSTEMS = {"disk": "/tmp", "tmpfs": "/dev/shm"}
BLOCKS = [1 << 20, 16 << 10]
OPS = ["WRITE", "READ"]
SYSTEMS = ["ORBITE_FILE", "POSIX", "reference"]

C_SOURCE = r"""
// fio-like buffered io_uring reference: one IORING_OP_READ/WRITE per block,
// sequential offsets, at most QD in flight, no SQPOLL, no registered buffers.
// usage: uring_ref FILE read|write BLOCK TOTAL QD SEED OFFSET
// Its buffer starts OFFSET bytes (a multiple of 8 below 4096) past a page boundary.
// write: fills its buffer with pattern(SEED) (untimed), then writes it.
// read: reads into a zeroed buffer, then (untimed) compares it with pattern(SEED).
// prints: gbps=<1e9 B/s> seconds=<s> bytes=<n> verified=<0|1>
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
};

static int ring_init(struct ring *r, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0) return -errno;
    size_t sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && cq_len > sq_len) sq_len = cq_len;
    char *sq = mmap(NULL, sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED) return -errno;
    char *cq = sq;
    if (!single) {
        cq = mmap(NULL, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
        if (cq == MAP_FAILED) return -errno;
    }
    r->sqes = mmap(NULL, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) return -errno;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
}

// splitmix64 of (seed << 40) + word index: the pattern (file_bench.py makes the same)
static uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 8 && !(argc == 9 && strcmp(argv[8], "direct") == 0)) {
        fprintf(stderr, "usage: %s FILE read|write BLOCK TOTAL QD SEED OFFSET [direct]\n", argv[0]);
        return 2;
    }
    int write_op = strcmp(argv[2], "write") == 0;
    uint64_t bs = strtoull(argv[3], NULL, 0), total = strtoull(argv[4], NULL, 0);
    unsigned qd = (unsigned)strtoul(argv[5], NULL, 0);
    uint64_t seed = strtoull(argv[6], NULL, 0), offset = strtoull(argv[7], NULL, 0);
    if (bs == 0 || bs > (1u << 30) || total % bs != 0 || total % 8 != 0 || qd == 0) return 2;
    if (offset % 8 != 0 || offset >= 4096) return 2;
    int fd = open(argv[1], (write_op ? O_WRONLY : O_RDONLY) | (argc == 9 ? O_DIRECT : 0));
    if (fd < 0) { perror("open"); return 1; }
    char *mem = mmap(NULL, total + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return 1;
    uint64_t *buf = (uint64_t *)(mem + offset);
    uint64_t words = total / 8;
    for (uint64_t i = 0; i < words; i++) buf[i] = write_op ? mix((seed << 40) + i) : 0; // touches every page
    struct ring r;
    memset(&r, 0, sizeof r);
    int e = ring_init(&r, qd);
    if (e) { fprintf(stderr, "io_uring_setup: %s\n", strerror(-e)); return 1; }

    uint64_t nblocks = total / bs, next = 0, done_bytes = 0;
    uint64_t *left = malloc(nblocks * sizeof *left); // per block: bytes still to move
    uint64_t *retry = malloc(qd * sizeof *retry);    // blocks with a short completion
    if (!left || !retry) return 1;
    for (uint64_t i = 0; i < nblocks; i++) left[i] = bs;
    unsigned nretry = 0, inflight = 0;
    double t0 = now();
    while (done_bytes < total) {
        unsigned tail = *r.sq_tail, queued = 0;
        while (inflight + queued < qd && (nretry > 0 || next < nblocks)) {
            uint64_t b = nretry > 0 ? retry[--nretry] : next++;
            uint64_t moved = bs - left[b];
            unsigned idx = tail & *r.sq_mask;
            struct io_uring_sqe *sqe = &r.sqes[idx];
            memset(sqe, 0, sizeof *sqe);
            sqe->opcode = write_op ? IORING_OP_WRITE : IORING_OP_READ;
            sqe->fd = fd;
            sqe->addr = (uint64_t)(uintptr_t)((char *)buf + b * bs + moved);
            sqe->len = (unsigned)left[b];
            sqe->off = b * bs + moved;
            sqe->user_data = b;
            r.sq_array[idx] = idx;
            tail++;
            queued++;
        }
        __atomic_store_n(r.sq_tail, tail, __ATOMIC_RELEASE);
        int ret;
        do {
            ret = (int)syscall(__NR_io_uring_enter, r.fd, queued, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        } while (ret < 0 && errno == EINTR);
        if (ret < 0) { perror("io_uring_enter"); return 1; }
        inflight += queued;
        unsigned head = *r.cq_head;
        while (head != __atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE)) {
            struct io_uring_cqe *cqe = &r.cqes[head & *r.cq_mask];
            uint64_t b = cqe->user_data;
            if (cqe->res <= 0) {
                fprintf(stderr, "block %llu: %s\n", (unsigned long long)b,
                        cqe->res ? strerror(-cqe->res) : "end of file");
                return 1;
            }
            left[b] -= (uint64_t)cqe->res;
            done_bytes += (uint64_t)cqe->res;
            if (left[b] > 0) retry[nretry++] = b;
            inflight--;
            head++;
        }
        __atomic_store_n(r.cq_head, head, __ATOMIC_RELEASE);
    }
    double t1 = now();
    int verified = 1;
    if (!write_op) {
        for (uint64_t i = 0; i < words; i++) {
            if (buf[i] != mix((seed << 40) + i)) { verified = 0; break; }
        }
    }
    printf("gbps=%.4f seconds=%.6f bytes=%llu verified=%d\n", total / (t1 - t0) / 1e9, t1 - t0,
           (unsigned long long)total, verified);
    return 0;
}
"""


# ---------------------------------------------------------------------------
# the parent: a plugin folder with both plugins, then re-exec
# ---------------------------------------------------------------------------


def wheel_dirs():
    spec = importlib.util.find_spec("nixl_cu12")
    if spec is None or not spec.origin:
        sys.exit("file_bench: the nixl_cu12 wheel is not importable (use target/nixl-venv/bin/python)")
    site = os.path.dirname(os.path.dirname(spec.origin))
    return (os.path.join(site, ".nixl_cu12.mesonpy.libs", "plugins"),
            os.path.join(site, ".nixl_cu12.mesonpy.libs"),
            os.path.join(site, "nixl_cu12.libs"))


def parent(argv):
    orbite_dir = os.environ.get("NIXL_PLUGIN_DIR") or os.path.join(REPO, "target", "meson-plugin", "nixl-plugin")
    orbite_so = os.path.join(orbite_dir, "libplugin_ORBITE_FILE.so")
    if not os.path.exists(orbite_so):
        sys.exit(f"file_bench: {orbite_so} not found (run scripts/nixl-tests first, or set NIXL_PLUGIN_DIR)")
    plugins, mesonlibs, libs = wheel_dirs()
    tmp = tempfile.mkdtemp(prefix="orbite-file-bench-")
    try:
        pdir = os.path.join(tmp, "plugins")
        os.mkdir(pdir)
        os.symlink(os.path.realpath(orbite_so), os.path.join(pdir, "libplugin_ORBITE_FILE.so"))
        posix_so = os.path.join(plugins, "libplugin_POSIX.so")
        if os.path.exists(posix_so):
            os.symlink(posix_so, os.path.join(pdir, "libplugin_POSIX.so"))
        env = dict(os.environ)
        env["NIXL_PLUGIN_DIR"] = pdir
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        env["LD_LIBRARY_PATH"] = ":".join(
            [mesonlibs, libs] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
        env[CHILD_FLAG] = tmp
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return subprocess.call([sys.executable, os.path.abspath(__file__)] + argv[1:], env=env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def buffer(np, nbytes, offset):
    """nbytes of anonymous memory starting `offset` bytes past a page boundary
    (as the reference program's buffer), as uint8; it lives as long as the array."""
    import mmap

    m = mmap.mmap(-1, nbytes + mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    out = np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=offset)
    assert out.ctypes.data % mmap.PAGESIZE == offset
    return out


def pattern(np, seed, nbytes, out=None):
    """splitmix64((seed << 40) + i) per 64-bit word i, as uint8 (the C program's
    pattern); into `out` (uint8, nbytes) when given."""
    words = nbytes // 8
    out = np.empty(words, dtype=np.uint64) if out is None else out.view(np.uint64)
    step = 1 << 20
    c1, c2, c3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)
    for at in range(0, words, step):
        z = np.arange(at, min(at + step, words), dtype=np.uint64)
        z += np.uint64((seed << 40) & 0xFFFFFFFFFFFFFFFF)
        z += c1
        z ^= z >> s30
        z *= c2
        z ^= z >> s27
        z *= c3
        z ^= z >> s31
        out[at : at + z.size] = z
    return out.view(np.uint8)


def compile_reference(workdir):
    exe = os.path.join(workdir, "uring_ref")
    src = exe + ".c"
    with open(src, "w") as f:
        f.write(C_SOURCE)
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        return None, "no C compiler"
    r = subprocess.run([gcc, "-O2", "-Wall", "-o", exe, src], capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"gcc failed: {r.stderr.strip()[:500]}"
    have = subprocess.run(["dpkg", "-s", "liburing-dev"], capture_output=True).returncode == 0 \
        if shutil.which("dpkg") else False
    how = "raw io_uring syscalls" + (" (liburing-dev is installed but not needed)" if have
                                     else " (liburing-dev is not installed)")
    return exe, how


def write_all(fd, buf, total):
    view = memoryview(buf)
    at = 0
    while at < total:
        at += os.pwrite(fd, view[at:], at)


class NixlSystem:
    """One agent with one backend; the buffers and the file registered with it."""

    def __init__(self, name, backend, params, bufs, fd, path, total):
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.agent = nixl_agent(name, nixl_agent_config(backends=[]))
        self.agent.create_backend(backend, params)
        self.regs = [self.agent.register_memory([(b.ctypes.data, b.nbytes, 0, "")], "DRAM") for b in bufs]
        self.regs.append(self.agent.register_memory([(0, total, fd, path)], "FILE"))
        self.fd = fd

    def run(self, np, op, buf, bs, total):
        """One request with every block; returns seconds from transfer() to DONE."""
        n = total // bs
        idx = np.arange(n, dtype=np.uint64) * np.uint64(bs)
        mem = np.stack([idx + np.uint64(buf.ctypes.data), np.full(n, bs, dtype=np.uint64),
                        np.zeros(n, dtype=np.uint64)], axis=1)
        fil = np.stack([idx, np.full(n, bs, dtype=np.uint64), np.full(n, self.fd, dtype=np.uint64)], axis=1)
        a = self.agent
        h = a.initialize_xfer(op, a.get_xfer_descs(mem, "DRAM"), a.get_xfer_descs(fil, "FILE"), self.name)
        try:
            t0 = time.perf_counter()
            s = a.transfer(h)
            while s == "PROC":
                s = a.check_xfer_state(h)
            t1 = time.perf_counter()
            if s != "DONE":
                raise RuntimeError(f"{self.name} {op}: ended {s}")
        finally:
            a.release_xfer_handle(h)
        return t1 - t0

    def close(self):
        for r in self.regs:
            self.agent.deregister_memory(r)
        self.regs = []


def bench(args):
    import numpy as np

    workdir = os.environ[CHILD_FLAG]
    total = args.total_mib << 20
    t_start = time.monotonic()
    exe, how = compile_reference(workdir)
    log(f"reference: {how if exe else 'unavailable: ' + how}")

    from nixl._api import nixl_agent, nixl_agent_config

    probe = nixl_agent("probe", nixl_agent_config(backends=[]))
    plugins = probe.get_plugin_list()
    posix_params = {}
    posix_note = "unavailable"
    if "POSIX" in plugins:
        offered = probe.get_plugin_params("POSIX")
        if "use_uring" in offered:
            posix_params = {"use_uring": "true"}
            posix_note = f"use_uring=true (offered parameters: {offered})"
        else:
            posix_note = f"default parameters (offered: {offered})"
    del probe
    log(f"POSIX: {posix_note}")

    log("making the patterns ...")
    off = args.buf_offset
    pats = {seed: pattern(np, seed, total, buffer(np, total, off)) for seed in (1, 2)}
    dst = buffer(np, total, off)
    dst.fill(0)
    check_buf = np.empty(total, dtype=np.uint8)

    rows = []  # dicts
    fs_list = [f for f in args.fs.split(",") if f]
    for fs_i, fs in enumerate(fs_list):
        if fs_i > 0 and time.monotonic() - t_start > args.budget_s:
            log(f"skipping {fs}: {time.monotonic() - t_start:.0f} s spent (budget {args.budget_s} s)")
            continue
        root = FILESYSTEMS[fs]
        path = os.path.join(root, f"orbite-file-bench-{os.getpid()}.dat")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        # --direct: the systems get a descriptor of their own opened
        # O_DIRECT, as storage code that bypasses the page cache opens it;
        # setting up and checking the file goes through `fd`.
        xfd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT) if args.direct else fd
        try:
            # the file fully allocated and cached, holding pattern 1
            write_all(fd, pats[1], total)
            os.fsync(fd)
            state = {"seed": 1}
            systems = {}
            systems["ORBITE_FILE"] = NixlSystem("bench_orbite", "ORBITE_FILE",
                                                json.loads(os.environ.get("ORBITE_FILE_PARAMS", "{}")),
                                                [pats[1], pats[2], dst], xfd, path, total)
            if "POSIX" in plugins:
                try:
                    systems["POSIX"] = NixlSystem("bench_posix", "POSIX", posix_params, [pats[1], pats[2], dst],
                                                  xfd, path, total)
                except Exception as e:
                    log(f"POSIX: create/register failed: {e!r}")
            if exe:
                systems["reference"] = None
            results = {}  # (op, bs, system) -> [(gbps, verified)]

            def file_matches(seed):
                f_at = 0
                while f_at < total:
                    got = os.preadv(fd, [memoryview(check_buf)[f_at:]], f_at)
                    if got <= 0:
                        return False
                    f_at += got
                return np.array_equal(check_buf, pats[seed])

            def measure(system, op, bs):
                new_seed = 3 - state["seed"]
                if system == "reference":
                    seed = new_seed if op == "WRITE" else state["seed"]
                    r = subprocess.run([exe, path, op.lower(), str(bs), str(total), str(args.qd), str(seed),
                                        str(off)] + (["direct"] if args.direct else []),
                                       capture_output=True, text=True, timeout=60)
                    if r.returncode != 0:
                        raise RuntimeError(f"reference {op} {bs}: {r.stderr.strip()}")
                    fields = dict(kv.split("=") for kv in r.stdout.split())
                    gbps = float(fields["gbps"])
                    ok = fields["verified"] == "1"
                else:
                    sysobj = systems[system]
                    if op == "WRITE":
                        buf = pats[new_seed]
                    else:
                        dst.fill(0)
                        buf = dst
                    gc.disable()
                    try:
                        secs = sysobj.run(np, op, buf, bs, total)
                    finally:
                        gc.enable()
                    gbps = total / secs / 1e9
                    ok = None
                    if op == "READ":
                        ok = bool(np.array_equal(dst, pats[state["seed"]]))
                if op == "WRITE":
                    ok = file_matches(new_seed)
                    state["seed"] = new_seed if ok else 0  # 0: unknown contents
                    if not ok:  # restore a known pattern for what follows
                        write_all(fd, pats[1], total)
                        state["seed"] = 1
                    if not args.no_fsync:
                        os.fsync(fd)
                return gbps, ok

            order = [s for s in SYSTEMS if s in systems]
            for rep in range(args.reps):
                rot = order[rep % len(order):] + order[: rep % len(order)]
                for op in OPS:
                    for bs in BLOCKS:
                        for system in rot:
                            try:
                                g, ok = measure(system, op, bs)
                            except Exception as e:
                                log(f"{fs} {system} {op} {bs}: failed: {e!r}")
                                g, ok = 0.0, False
                            results.setdefault((op, bs, system), []).append((g, ok))
                log(f"{fs}: repetition {rep + 1}/{args.reps} done ({time.monotonic() - t_start:.0f} s)")
            for sysobj in systems.values():
                if sysobj is not None:
                    sysobj.close()
            systems.clear()
            gc.collect()
            for (op, bs, system), runs in results.items():
                rows.append({
                    "system": system, "op": op, "block_bytes": bs,
                    "gbps": round(statistics.median(g for g, _ in runs), 3),
                    "verified": all(ok for _, ok in runs),
                    "fs": fs, "fs_path": root, "runs_gbps": [round(g, 3) for g, _ in runs],
                    "total_bytes": total, "qd": args.qd if system == "reference" else None,
                    "buf_offset": off, "direct": args.direct,
                })
        finally:
            os.close(fd)
            if xfd != fd:
                os.close(xfd)
            try:
                os.unlink(path)
            except OSError:
                pass

    # report
    key = {s: i for i, s in enumerate(SYSTEMS)}
    rows.sort(key=lambda r: (fs_list.index(r["fs"]), OPS.index(r["op"]), -r["block_bytes"], key[r["system"]]))
    if not args.json_only:
        print(f"{args.total_mib} MiB per measurement, median of {args.reps} interleaved runs, GB/s = 1e9 B/s; "
              f"page cache not dropped (same conditions for all three)")
        print(f"POSIX: {posix_note}; reference: {how if exe else 'unavailable'}, qd {args.qd}; "
              f"every buffer {off} bytes past a page boundary" + ("; O_DIRECT" if args.direct else ""))
        print(f"{'fs':6} {'op':5} {'block':>7} {'system':12} {'GB/s':>8}  {'runs':26} verified")
        for r in rows:
            blk = f"{r['block_bytes'] >> 10} KiB" if r["block_bytes"] < (1 << 20) else f"{r['block_bytes'] >> 20} MiB"
            runs = ", ".join(f"{g:.2f}" for g in r["runs_gbps"])
            print(f"{r['fs']:6} {r['op']:5} {blk:>7} {r['system']:12} {r['gbps']:8.3f}  {runs:26} {r['verified']}")
    for r in rows:
        print(json.dumps(r))
    by = {(r["fs"], r["op"], r["block_bytes"], r["system"]): r["gbps"] for r in rows}
    print("ratios (median GB/s):")
    for fs in fs_list:
        for op in OPS:
            for bs in BLOCKS:
                o = by.get((fs, op, bs, "ORBITE_FILE"))
                if o is None:
                    continue
                p = by.get((fs, op, bs, "POSIX"))
                ref = by.get((fs, op, bs, "reference"))
                rp = f"{o / p:.2f}" if p else "n/a"
                rr = f"{o / ref:.2f}" if ref else "n/a"
                blk = f"{bs >> 10} KiB" if bs < (1 << 20) else f"{bs >> 20} MiB"
                print(f"  {fs:6} {op:5} {blk:>7}: ORBITE_FILE/POSIX {rp:>5}  ORBITE_FILE/reference {rr:>5}")
    print(f"total time {time.monotonic() - t_start:.1f} s")
    return 0 if rows and all(r["verified"] for r in rows) else 1


def main(argv):
    if os.environ.get(CHILD_FLAG) is None:
        return parent(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fs", default="disk,tmpfs", help="comma list of disk (/tmp) and tmpfs (/dev/shm)")
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--qd", type=int, default=64, help="the reference's queue depth")
    ap.add_argument("--budget-s", type=int, default=75, help="start a further filesystem only before this")
    ap.add_argument("--buf-offset", type=int, default=0,
                    help="every buffer starts this many bytes past a page boundary (a multiple of 8 below 4096)")
    ap.add_argument("--no-fsync", action="store_true", help="do not fsync after each WRITE")
    ap.add_argument("--direct", action="store_true",
                    help="every system moves the bytes through a descriptor opened O_DIRECT")
    ap.add_argument("--json-only", action="store_true")
    args = ap.parse_args(argv[1:])
    if args.buf_offset % 8 != 0 or not 0 <= args.buf_offset < 4096:
        ap.error("--buf-offset must be a multiple of 8 below 4096")
    bad = [f for f in args.fs.split(",") if f and f not in FILESYSTEMS]
    if bad:
        ap.error(f"unknown filesystem(s) {bad}; known: {list(FILESYSTEMS)}")
    return bench(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
