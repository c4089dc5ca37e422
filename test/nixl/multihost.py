#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Two hosts on one machine, and the NIXL backend ORBITE between them.

Each "host" is a network namespace joined to the other by a veth pair; its
agent runs in its own mount namespace (a private /dev/shm, its own boot id
bound over /proc/sys/kernel/random/boot_id) and pid namespace, so no
same-host route applies: bytes cross the veth over TCP. Only the
addresses of namespaces this script created are used, and everything it
made is removed at the end (also on failure).

    multihost.py [-v] [TEST ...]     the tests (`python multihost tests: N passed, M failed`)
    multihost.py --rdma [-v] [TEST ...]
                                     the same over the rdma route: each host's NIC is the
                                     verbs shim (MH_VERBS_SHIM, its libibverbs.so.1) with its
                                     namespace's address as GID; then checks that RDMA
                                     requests carried the bytes
    multihost.py --bench [--quick]   ORBITE against UCX and one raw TCP stream on this harness
    multihost.py --agent ROLE        (internal) the agent of one host, driven over stdin/stdout

Agents are created exactly as vLLM creates them: nixl_agent(name,
nixl_agent_config(backends=[BACKEND])) with no backend parameters and no
ORBITE_CONFIG. Needs root, iproute2 and util-linux (unshare); without them
it prints SKIP and why.
"""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
PREFIX = "@@ "
BLOCK = 16 << 10
BLOCKS = 4096
POLL_S = float(os.environ.get("MH_POLL_S", "0.0002"))


# ---------------------------------------------------------------------------
# the agent of one host (runs inside its namespaces)
# ---------------------------------------------------------------------------


def become_host(role):
    """Private /dev/shm and boot id for this mount namespace."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", "/dev/shm"], check=True)
    boot = {"A": "0a0a0a0a-0000-4000-8000-00000000000a", "B": "0b0b0b0b-0000-4000-8000-00000000000b"}[role]
    with open("/dev/shm/.boot_id", "w") as f:
        f.write(boot + "\n")
    subprocess.run(["mount", "--bind", "/dev/shm/.boot_id", "/proc/sys/kernel/random/boot_id"], check=True)
    with open("/proc/sys/kernel/random/boot_id") as f:
        if f.read().strip() != boot:
            raise RuntimeError("the boot id bind mount did not take")


class Agent:
    def __init__(self, name, backend):
        import numpy

        from nixl._api import nixl_agent, nixl_agent_config

        self.np = numpy
        self.name = name
        self.backend = backend
        # exactly vLLM's NixlConnector: the backend by name, no parameters;
        # with UCX alone vLLM also asks for its worker threads (4 by default)
        if backend == "UCX":
            threads = int(os.environ.get("MH_UCX_THREADS", "4"))
            config = nixl_agent_config(num_threads=threads, capture_telemetry=True)
        else:
            config = nixl_agent_config(backends=[backend], capture_telemetry=True)
        self.agent = nixl_agent(name, config)
        self.bufs, self.regs, self.dlists, self.handles, self.received = {}, {}, {}, {}, {}
        self.hooks = None
        if backend == "ORBITE" and os.environ.get("ORBITE_NIXL_LIB"):
            sys.path.insert(0, HERE)
            import orbite_harness

            self.hooks = orbite_harness.Hooks()

    def register(self, key, size, seed):
        buf = self.np.random.default_rng(seed).integers(0, 256, size, dtype=self.np.uint8)
        self.bufs[key] = buf
        self.regs[key] = self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        return buf.ctypes.data

    def fill(self, key, seed):
        self.bufs[key][:] = self.np.random.default_rng(seed).integers(0, 256, self.bufs[key].nbytes,
                                                                       dtype=self.np.uint8)

    def digest_blocks(self, key, ids, block):
        h = hashlib.sha256()
        mv = memoryview(self.bufs[key])
        for i in ids:
            h.update(mv[i * block:(i + 1) * block])
        return h.hexdigest()

    def metadata(self):
        return self.agent.get_agent_metadata().hex()

    def endpoint(self):
        md = self.agent.get_agent_metadata()
        at = md.find(b"ORBP")
        n = int.from_bytes(md[at + 6:at + 8], "little")
        return md[at + 16:at + 16 + n].decode()

    def add_remote(self, md):
        n = self.agent.add_remote_agent(bytes.fromhex(md))
        return n.decode() if isinstance(n, bytes) else n

    def remove_remote(self, name):
        self.agent.remove_remote_agent(name)

    def prep(self, tag, key, remote, remote_addr, block, count):
        """Local and remote descriptor lists of `count` blocks (vLLM's prep_xfer_dlist)."""
        base = self.bufs[key].ctypes.data
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base + i * block, block, 0) for i in range(count)],
                                           "DRAM")
        far = self.agent.prep_xfer_dlist(remote, [(remote_addr + i * block, block, 0) for i in range(count)], "DRAM")
        old = self.dlists.pop(tag, None)
        if old:
            old[0].release()
            old[1].release()
        self.dlists[tag] = (local, far)

    def post(self, hid, tag, op, l_ids, r_ids, notif=""):
        local, far = self.dlists[tag]
        h = self.agent.make_prepped_xfer(op, local, l_ids, far, r_ids, notif_msg=bytes.fromhex(notif),
                                         skip_desc_merge=True)
        self.handles[hid] = (h, time.monotonic())
        return self._state(self.agent.transfer, h)

    def _state(self, call, h):
        try:
            return call(h)
        except Exception as exc:  # NIXL raises for a negative status
            return f"ERR {type(exc).__name__}"

    def wait(self, hid, timeout):
        start = time.monotonic()
        while True:
            s = self._state(self.agent.check_xfer_state, self.handles[hid][0])
            if s != "PROC" or time.monotonic() - start > timeout:
                return {"state": s, "since_post": time.monotonic() - self.handles[hid][1]}
            time.sleep(0.0005)

    def release(self, hid):
        h = self.handles.pop(hid)[0]
        self.agent.release_xfer_handle(h)

    def timed(self, tag, op, l_ids, r_ids, reps, seconds):
        """Posts the same prepared request repeatedly; seconds per transfer, each retired."""
        local, far = self.dlists[tag]
        h = self.agent.make_prepped_xfer(op, local, l_ids, far, r_ids, skip_desc_merge=True)
        out = []
        deadline = time.monotonic() + seconds
        while len(out) < reps or (time.monotonic() < deadline and len(out) < 50):
            t0 = time.monotonic()
            s = self.agent.transfer(h)
            while s == "PROC":
                # A caller that polls now and then, as a serving engine's
                # step loop does (the same for every backend): a busy loop
                # would take a core from the network stack.
                time.sleep(POLL_S)
                s = self.agent.check_xfer_state(h)
            if s != "DONE":
                raise RuntimeError(f"transfer ended {s}")
            out.append(time.monotonic() - t0)
        self.agent.release_xfer_handle(h)
        return out

    def send_notif(self, to, payload):
        self.agent.send_notif(to, bytes.fromhex(payload))

    def notifs(self, sender, want, timeout):
        """Everything received from `sender`, once `want` (hex) arrived or the timeout passed."""
        deadline = time.monotonic() + timeout
        while True:
            for k, v in self.agent.get_new_notifs().items():
                k = k.decode() if isinstance(k, bytes) else k
                self.received.setdefault(k, []).extend(x.hex() for x in v)
            got = self.received.get(sender, [])
            if want in got or time.monotonic() > deadline:
                return got
            time.sleep(0.001)

    def stats(self):
        return self.hooks.stats() if self.hooks else {}

    def rdma_requests(self):
        """Requests this process's queue pairs executed (the verbs shim's
        counters; 0 without the shim)."""
        import ctypes

        path = os.environ.get("ORBITE_IBVERBS_LIB")
        if not path:
            return 0
        lib = ctypes.CDLL(path)
        qps = (ctypes.c_uint32 * 256)()
        n = lib.orbite_verbs_shim_qps(qps, ctypes.c_size_t(256))
        total = 0
        for q in qps[: min(n, 256)]:
            dev, done = ctypes.c_uint32(), ctypes.c_uint64()
            if lib.orbite_verbs_shim_qp_info(ctypes.c_uint32(q), ctypes.byref(dev), ctypes.byref(done)) == 0:
                total += done.value
        return total

    def deregister(self, key):
        self.agent.deregister_memory(self.regs.pop(key))


def agent_main(role):
    become_host(role)
    out = sys.stdout
    agent = None
    for line in sys.stdin:
        msg = json.loads(line)
        cmd, args = msg["cmd"], msg.get("args", [])
        try:
            if cmd == "init":
                agent = Agent(*args)
                result = os.getpid()
            elif cmd == "quit":
                out.write(PREFIX + json.dumps({"ok": True}) + "\n")
                out.flush()
                return
            else:
                result = getattr(agent, cmd)(*args)
            out.write(PREFIX + json.dumps({"ok": True, "result": result}) + "\n")
        except Exception as exc:  # reported to the driver
            out.write(PREFIX + json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()


# ---------------------------------------------------------------------------
# the driver (root namespaces)
# ---------------------------------------------------------------------------


class Failure(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Failure(msg)


def sh(*cmd, check_rc=True):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check_rc and r.returncode != 0:
        raise Failure(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


def missing_facilities():
    if os.geteuid() != 0:
        return "not root: network, mount and pid namespaces need it"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"orbite-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Host:
    """One agent process inside its namespaces."""

    def __init__(self, hosts, role, backend):
        self.role = role
        self.name = role
        env = dict(os.environ, NIXL_LOG_LEVEL="WARN", PYTHONUNBUFFERED="1")
        env.pop("ORBITE_CONFIG", None)  # exactly as vLLM creates the backend
        if os.environ.get("MH_ORBITE_CONFIG"):
            env["ORBITE_CONFIG"] = os.environ["MH_ORBITE_CONFIG"]
        if hosts.rdma:
            # The host's NIC: the verbs shim, reached at its namespace's
            # address (RoCE v2 over IPv4).
            gid = "::ffff:" + hosts.addr[role]
            env["ORBITE_IBVERBS_LIB"] = hosts.rdma
            env["ORBITE_VERBS_SHIM_DEVICES"] = json.dumps(
                [{"name": f"mlx5_{role.lower()}", "ports": [{"state": "active", "gids": [{"gid": gid, "type": "roce-v2"}]}]}])
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", hosts.ns[role], "unshare", "--mount", "--pid", "--fork", "--mount-proc",
             "--propagation", "private", sys.executable, os.path.abspath(__file__), "--agent", role],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=hosts.log, text=True, env=env)
        self.pid = self.call("init", role, backend, timeout=60)

    def call(self, cmd, *args, timeout=120):
        self.proc.stdin.write(json.dumps({"cmd": cmd, "args": list(args)}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise Failure(f"agent {self.role} exited during {cmd}")
            if line.startswith(PREFIX):
                r = json.loads(line[len(PREFIX):])
                if not r["ok"]:
                    raise Failure(f"agent {self.role}: {cmd}: {r['error']}")
                return r.get("result")
            if time.monotonic() > deadline:
                raise Failure(f"agent {self.role}: no answer to {cmd}")

    def __getattr__(self, cmd):
        if cmd.startswith("_"):
            raise AttributeError(cmd)
        return lambda *a, **k: self.call(cmd, *a, **k)

    def stop(self):
        if self.proc.poll() is None:
            try:
                self.call("quit", timeout=20)
                self.proc.wait(20)
            except (Failure, OSError, subprocess.TimeoutExpired, ValueError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Hosts:
    """Two network namespaces joined by a veth pair; cleaned up on exit."""

    def __init__(self, log, rdma=None):
        tag = os.getpid() % 200 + 20
        self.rdma = rdma
        self.log = log
        self.ns = {"A": f"orbite-mh{os.getpid()}-a", "B": f"orbite-mh{os.getpid()}-b"}
        self.dev = {"A": f"om{os.getpid() % 100000}a", "B": f"om{os.getpid() % 100000}b"}
        self.addr = {"A": f"10.250.{tag}.1", "B": f"10.250.{tag}.2"}
        self.hosts = []

    def __enter__(self):
        try:
            for r in "AB":
                sh("ip", "netns", "add", self.ns[r])
            sh("ip", "link", "add", self.dev["A"], "type", "veth", "peer", "name", self.dev["B"])
            for r in "AB":
                sh("ip", "link", "set", self.dev[r], "netns", self.ns[r])
                sh("ip", "-n", self.ns[r], "addr", "add", self.addr[r] + "/24", "dev", self.dev[r])
                sh("ip", "-n", self.ns[r], "link", "set", self.dev[r], "up")
                sh("ip", "-n", self.ns[r], "link", "set", "lo", "up")
            # Host A also has a default route (through B): its advertised
            # address is that route's source; host B has none, so it
            # advertises its first address that is up.
            sh("ip", "-n", self.ns["A"], "route", "add", "default", "via", self.addr["B"])
        except BaseException:
            self.__exit__()
            raise
        return self

    def start(self, role, backend="ORBITE"):
        h = Host(self, role, backend)
        self.hosts.append(h)
        return h

    def link(self, up):
        for r in "AB":
            sh("ip", "-n", self.ns[r], "link", "set", self.dev[r], "up" if up else "down")

    def shape(self, rate):
        """Limits both directions to `rate` (tbf), or removes the limit."""
        for r in "AB":
            sh("tc", "-n", self.ns[r], "qdisc", "del", "dev", self.dev[r], "root", check_rc=False)
            if rate:
                sh("tc", "-n", self.ns[r], "qdisc", "add", "dev", self.dev[r], "root", "tbf", "rate", rate,
                   "burst", "1mb", "latency", "100ms")

    def __exit__(self, *exc):
        for h in self.hosts:
            try:
                h.stop()
            except Exception:  # noqa: BLE001 (cleanup goes on)
                pass
        for r in "AB":
            subprocess.run(["ip", "netns", "del", self.ns[r]], capture_output=True)
        return False


def perm(n, seed):
    ids = list(range(n))
    random.Random(seed).shuffle(ids)
    return ids


def exchange(a, b):
    a.add_remote(b.metadata())
    b.add_remote(a.metadata())


def flow_exchange_and_addresses(hosts, a, b):
    """vLLM-created agents listen on all interfaces and advertise an address
    of their own namespace (A: its default route's source, B: its first
    address up); metadata is exchanged after registration."""
    for h, want in ((a, hosts.addr["A"]), (b, hosts.addr["B"])):
        ep = h.endpoint()
        check(ep.rsplit(":", 1)[0] == want, f"host {h.role} advertises {ep}, want {want}:<port>")
    exchange(a, b)


def flow_blocks(hosts, a, b, state):
    """READ and WRITE of 4096 randomly permuted 16 KiB blocks
    (make_prepped_xfer, skip_desc_merge), bytes checked on both sides."""
    l_ids, r_ids = perm(BLOCKS, 1), perm(BLOCKS, 2)
    a.prep("kv", "kv", "B", state["b_kv"], BLOCK, BLOCKS)
    for op, seed in (("WRITE", 11), ("READ", 12)):
        (a if op == "WRITE" else b).fill("kv", seed)
        a.post(op, "kv", op, l_ids, r_ids)
        r = a.wait(op, 60)
        check(r["state"] == "DONE", f"{op} of {BLOCKS} blocks ended {r['state']}")
        a.release(op)
        check(a.digest_blocks("kv", l_ids, BLOCK) == b.digest_blocks("kv", r_ids, BLOCK),
              f"{op}: the blocks differ between the hosts")


def flow_notification(hosts, a, b, state):
    """A WRITE with a binary notification: delivered exactly once, with the
    right sender."""
    payload = bytes([0, 255, 0x80, 0]) + b"kv-ready\x00\n"
    a.post("n", "kv", "WRITE", [0, 1, 2], [9, 8, 7], payload.hex())
    r = a.wait("n", 30)
    check(r["state"] == "DONE", f"WRITE with a notification ended {r['state']}")
    a.release("n")
    marker = b"__marker__"
    a.send_notif("B", marker.hex())
    got = b.notifs("A", marker.hex(), 10)
    check(got.count(payload.hex()) == 1, f"the notification arrived {got.count(payload.hex())} times")
    check(got[-1] == marker.hex(), "the marker arrived last")
    check(a.digest_blocks("kv", [0, 1, 2], BLOCK) == b.digest_blocks("kv", [9, 8, 7], BLOCK), "notified bytes")


PEER_TIMEOUT_S = 10.0  # the engine's default peer_timeout_ms: no configuration was given


def flow_link_down(hosts, a, b, state):
    """The link goes down during a 256 MiB READ: a terminal error within the
    peer timeout of the link going down, the agent healthy, and after the
    link comes back the same metadata again gives working transfers."""
    a_base = a.stats()
    n = (256 << 20) // BLOCK
    a.prep("big", "big", "B", state["b_big"], BLOCK, n)
    hosts.shape("400mbit")  # about 50 MB/s: the READ takes seconds
    try:
        a.post("big", "big", "READ", list(range(n)), list(range(n)))
        time.sleep(0.5)
        r = a.wait("big", 0)
        check(r["state"] == "PROC", f"the READ ended {r['state']} before the link went down")
        down = time.monotonic()
        hosts.link(False)
        r = a.wait("big", PEER_TIMEOUT_S + 20)
        after = time.monotonic() - down
        check(r["state"].startswith("ERR"), f"the READ over a dead link ended {r['state']}")
        bound = PEER_TIMEOUT_S + 0.25  # the link went down just after the last bytes arrived
        check(after <= bound, f"terminal {after:.1f} s after the link went down (bound {bound:.1f} s)")
        state["notes"].append(f"link down: terminal error {after:.2f} s after the link went down")
        a.release("big")
    finally:
        hosts.link(True)
        hosts.shape(None)
    # healthy: charges back to baseline, notifications work locally
    deadline = time.monotonic() + 10
    while a.stats() != a_base and time.monotonic() < deadline:
        time.sleep(0.05)
    check(a.stats() == a_base, f"initiator charges after the failure: {a.stats()} (want {a_base})")
    # recovery: the same metadata again (NIXL keeps what it had); the next
    # request reconnects to the same incarnation
    a.add_remote(b.metadata())
    b.fill("kv", 21)
    ids = perm(64, 5)
    deadline = time.monotonic() + 30
    while True:
        a.post("rec", "kv", "READ", ids, ids)
        r = a.wait("rec", 30)
        a.release("rec")
        if r["state"] == "DONE" or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # the link's neighbour entries may take a moment
    check(r["state"] == "DONE", f"READ after the link came back ended {r['state']}")
    check(a.digest_blocks("kv", ids, BLOCK) == b.digest_blocks("kv", ids, BLOCK), "bytes after recovery")
    a.send_notif("B", b"back".hex())
    check(b"back".hex() in b.notifs("A", b"back".hex(), 10), "notification after recovery")


FLOWS = [
    ("exchange_and_addresses", flow_exchange_and_addresses),
    ("blocks_read_write", flow_blocks),
    ("write_with_notification", flow_notification),
    ("link_down_during_read", flow_link_down),
]


def run_tests(names, verbose, rdma=None):
    why = missing_facilities()
    if rdma is not None and not os.path.exists(rdma or ""):
        why = why or f"no verbs shim at {rdma!r} (MH_VERBS_SHIM; scripts/verbs-shim builds it)"
    if why:
        print(f"SKIP: multi-host tests: {why}")
        print("python multihost tests: 0 passed, 0 failed")
        return 0
    passed = failed = 0
    import tempfile

    with tempfile.TemporaryFile("w+") as log:
        try:
            with Hosts(log, rdma) as hosts:
                a, b = hosts.start("A"), hosts.start("B")
                state = {"notes": []}
                state["b_kv"] = b.register("kv", BLOCKS * BLOCK, 2)
                state["b_big"] = b.register("big", 256 << 20, 3)
                a.register("kv", BLOCKS * BLOCK, 1)
                a.register("big", 256 << 20, 4)
                b_base = None
                for name, fn in FLOWS:
                    if names and name not in names and name != "exchange_and_addresses":
                        continue
                    t0 = time.monotonic()
                    try:
                        if fn is flow_exchange_and_addresses:
                            fn(hosts, a, b)
                            b_base = b.stats()
                        else:
                            fn(hosts, a, b, state)
                        print(f"PASS {name} ({time.monotonic() - t0:.1f} s)")
                        passed += 1
                    except Failure as e:
                        print(f"FAIL {name}: {e}")
                        failed += 1
                        if name == "exchange_and_addresses":
                            break
                if rdma and failed == 0:
                    n = a.rdma_requests()
                    if n > 0:
                        print(f"PASS rdma_carried_the_bytes ({n} requests)")
                        passed += 1
                    else:
                        print("FAIL rdma_carried_the_bytes: no RDMA request ran")
                        failed += 1
                if b_base is not None and failed == 0:
                    # the target lets go of everything the dead connections held
                    deadline = time.monotonic() + 60
                    while b.stats() != b_base and time.monotonic() < deadline:
                        time.sleep(0.2)
                    if b.stats() == b_base:
                        print("PASS target_charges_back_to_baseline")
                        passed += 1
                    else:
                        print(f"FAIL target_charges_back_to_baseline: {b.stats()} (want {b_base})")
                        failed += 1
                for n in state["notes"]:
                    print(f"    note: {n}")
        except Failure as e:
            print(f"FAIL harness: {e}")
            failed += 1
        if verbose or failed:
            log.seek(0)
            for line in log.read().splitlines()[-80:]:
                print(f"    | {line}")
    print(f"python multihost tests: {passed} passed, {failed} failed")
    return 1 if failed else 0


# ---------------------------------------------------------------------------
# the benchmark: ORBITE against UCX and one raw TCP stream, same harness
# ---------------------------------------------------------------------------

STREAM_SRC = r"""
import socket, sys, time
mode, addr, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
buf = bytearray(1 << 20)
if mode == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 5999)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); mv = memoryview(buf); n = 0; t0 = None
    while True:
        k = c.recv_into(mv)
        if not k: break
        if t0 is None: t0 = time.monotonic()
        n += k
    print(f"{n / (time.monotonic() - t0) / 1e9:.4f}", flush=True)
else:
    c = socket.create_connection((addr, 5999)); end = time.monotonic() + secs
    while time.monotonic() < end: c.sendall(buf)
    c.close()
"""


def raw_stream(hosts, secs):
    """GB/s of one TCP stream from A to B across the veth (1 MiB writes)."""
    recv = subprocess.Popen(["ip", "netns", "exec", hosts.ns["B"], sys.executable, "-c", STREAM_SRC, "recv",
                             hosts.addr["B"], str(secs)], stdout=subprocess.PIPE, text=True)
    check(recv.stdout.readline().strip() == "ready", "stream receiver did not start")
    sh("ip", "netns", "exec", hosts.ns["A"], sys.executable, "-c", STREAM_SRC, "send", hosts.addr["B"], str(secs))
    return float(recv.stdout.readline())


def bench_backend(hosts, backend, quick):
    a, b = hosts.start("A", backend), hosts.start("B", backend)
    try:
        w1_n = 64  # 64 descriptors of 1 MiB: 64 MiB per transfer
        b_w1 = b.register("w1", w1_n << 20, 2)
        a.register("w1", w1_n << 20, 1)
        b_w3 = b.register("w3", BLOCKS * 4 * BLOCK, 3)  # 256 MiB: 16384 blocks
        a.register("w3", BLOCKS * 4 * BLOCK, 4)
        exchange(a, b)
        a.prep("w1", "w1", "B", b_w1, 1 << 20, w1_n)
        a.prep("w3", "w3", "B", b_w3, BLOCK, BLOCKS * 4)
        reps, secs = (2, 0.5) if quick else (3, 2.0)
        out = {}
        for op in ("WRITE", "READ"):
            ids = list(range(w1_n))
            times = a.timed("w1", op, ids, ids, reps, secs)
            out[f"W1-{op.lower()}"] = (w1_n << 20) / sorted(times)[len(times) // 2] / 1e9
            l_ids, r_ids = perm(BLOCKS * 4, 7), perm(BLOCKS * 4, 8)
            times = a.timed("w3", op, l_ids, r_ids, reps, secs)
            out[f"W3-{op.lower()}"] = (BLOCKS * 4 * BLOCK) / sorted(times)[len(times) // 2] / 1e9
        return out
    finally:
        for h in (a, b):
            h.stop()
        hosts.hosts.clear()


def mixed_plugin_dir(tmp):
    """A plugin folder with ORBITE (from NIXL_PLUGIN_DIR) and the wheel's
    UCX; the wheel's own libraries are found through LD_LIBRARY_PATH."""
    import importlib.util

    site = os.path.dirname(os.path.dirname(importlib.util.find_spec("nixl_cu12").origin))
    wheel_plugins = os.path.join(site, ".nixl_cu12.mesonpy.libs", "plugins")
    for src in (os.path.join(os.environ["NIXL_PLUGIN_DIR"], "libplugin_ORBITE.so"),
                os.path.join(wheel_plugins, "libplugin_UCX.so")):
        check(os.path.exists(src), f"{src} is missing")
        os.symlink(src, os.path.join(tmp, os.path.basename(src)))
    os.environ["NIXL_PLUGIN_DIR"] = tmp
    libs = os.path.join(site, "nixl_cu12.libs")
    os.environ["LD_LIBRARY_PATH"] = libs + (":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get(
        "LD_LIBRARY_PATH") else "")


def run_bench(quick):
    why = missing_facilities()
    if why:
        print(f"SKIP: multi-host bench: {why}")
        return 0
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as log, Hosts(log) as hosts:
        mixed_plugin_dir(tmp)
        stream = raw_stream(hosts, 1.0 if quick else 3.0)
        orbite = bench_backend(hosts, "ORBITE", quick)
        ucx = bench_backend(hosts, "UCX", quick) if not os.environ.get("MH_NO_UCX") else dict.fromkeys(orbite, 1.0)
        rows = []
        for w in ("W1-write", "W1-read", "W3-write", "W3-read"):
            row = {"system": "orbite", "harness": "two-namespaces", "workload": w,
                   "block_bytes": (1 << 20) if w.startswith("W1") else BLOCK,
                   "gbps": round(orbite[w], 3), "ucx_gbps": round(ucx[w], 3),
                   "x_ucx": round(orbite[w] / ucx[w], 2), "x_stream": round(orbite[w] / stream, 2),
                   "stream_gbps": round(stream, 3)}
            rows.append(row)
            print(json.dumps(row))
        print(f"\n{'workload':10} {'ORBITE GB/s':>12} {'UCX GB/s':>10} {'x UCX':>7} {'x stream':>9}")
        for r in rows:
            print(f"{r['workload']:10} {r['gbps']:12.3f} {r['ucx_gbps']:10.3f} {r['x_ucx']:7.2f} {r['x_stream']:9.2f}")
        print(f"one raw TCP stream across the veth: {stream:.3f} GB/s")
    return 0


def main(argv):
    if len(argv) >= 3 and argv[1] == "--agent":
        agent_main(argv[2])
        return 0
    if "--bench" in argv:
        return run_bench("--quick" in argv)
    verbose = "-v" in argv[1:]
    names = [a for a in argv[1:] if not a.startswith("-")]
    rdma = os.environ.get("MH_VERBS_SHIM", "") if "--rdma" in argv[1:] else None
    return run_tests(names, verbose, rdma)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
