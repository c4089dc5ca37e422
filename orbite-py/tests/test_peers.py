# SPDX-License-Identifier: Apache-2.0
"""Two processes: a peer engine in a child process on this host, then in a
"host" of its own (network, mount and pid namespaces joined by a veth
pair). The initiator READs the peer's pattern, addressing it both by
registration and by the peer's own address, then WRITEs with a
notification and checks the peer's bytes and what it received."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import orbite

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer.py")
N = 3 << 20


class Child:
    def __init__(self, argv):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        assert line, "the peer process started"
        self.info = json.loads(line)

    def ask(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self):
        try:
            self.ask("quit")
            self.p.wait(timeout=10)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
        assert self.p.returncode == 0


def exchange(init, child, routes):
    info = child.info
    peer = init.open_peer(info["endpoint"], epoch=info["epoch"], timeout=10)
    pattern = (bytes(range(251)) * (N // 251 + 1))[:N]
    got = np.zeros(N, dtype=np.uint8)
    g = init.register(got)
    # By registration, then by the peer's address.
    by_addr = peer.range_at(info["address"] + 4096, N - 4096)
    assert by_addr == (info["registration"], 4096, N - 4096)
    t = init.prepare("read", [(g, 0, N - 4096)], [by_addr], peer=peer)
    assert t.route[0] in routes, t.route
    t.post()
    assert t.wait().success
    t.release()
    assert got[: N - 4096].tobytes() == pattern[4096:]
    src = np.frombuffer(os.urandom(N), dtype=np.uint8).copy()
    s = init.register(src)
    t = init.prepare("write", [(s, 0, N)], [(info["registration"], 0, N)], peer=peer, notification=b"kv-ready")
    t.post()
    assert t.wait().success
    t.release()
    assert child.ask("sha") == hashlib.sha256(src.tobytes()).hexdigest()
    assert json.loads(child.ask("notes")) == [b"kv-ready".hex()]


@pytest.mark.parametrize("route", ["auto", "tcp"])
def test_a_peer_process_on_this_host(route):
    init = orbite.Engine({"listen": "127.0.0.1:0", "route": route})
    child = Child([sys.executable, PEER, "127.0.0.1:0", str(N)])
    try:
        exchange(init, child, ("shm", "cma") if route == "auto" else ("tcp",))
    finally:
        child.close()
        init.close()


def _netns_usable():
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


def sh(*argv):
    subprocess.run(argv, check=True, capture_output=True)


def test_a_peer_on_another_host_built_from_namespaces():
    why = _netns_usable()
    if why:
        pytest.skip(f"SKIP two namespaces: {why}")
    tag = os.getpid() % 200 + 20
    ns = {r: f"orbite-py{os.getpid()}-{r}" for r in "ab"}
    dev = {r: f"op{os.getpid() % 100000}{r}" for r in "ab"}
    addr = {"a": f"10.251.{tag}.1", "b": f"10.251.{tag}.2"}
    child = None
    try:
        for r in "ab":
            sh("ip", "netns", "add", ns[r])
        sh("ip", "link", "add", dev["a"], "type", "veth", "peer", "name", dev["b"])
        for r in "ab":
            sh("ip", "link", "set", dev[r], "netns", ns[r])
            sh("ip", "-n", ns[r], "addr", "add", addr[r] + "/24", "dev", dev[r])
            sh("ip", "-n", ns[r], "link", "set", dev[r], "up")
            sh("ip", "-n", ns[r], "link", "set", "lo", "up")
        # Host b is the peer process, in its own net, mount and pid
        # namespaces; host a is this process, which joins namespace a.
        child = Child(["ip", "netns", "exec", ns["b"], "unshare", "--mount", "--pid", "--fork", "--mount-proc",
                       sys.executable, PEER, addr["b"] + ":0", str(N)])
        # The initiator runs in namespace a, in a process of its own.
        r = subprocess.run(["ip", "netns", "exec", ns["a"], sys.executable, __file__, "--initiator",
                            addr["a"], json.dumps(child.info)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads(r.stdout.strip().splitlines()[-1])
        assert report["route"] == "tcp" and report["read"] and report["write"]
        assert child.ask("sha") == report["sha"]
        assert json.loads(child.ask("notes")) == [b"kv-ready".hex()]
    finally:
        if child is not None:
            child.close()
        for r in "ab":
            subprocess.run(["ip", "netns", "del", ns[r]], capture_output=True)


def initiator(listen, info):
    """Host a's side of the namespace test: READ, then WRITE with a
    notification; prints what happened as one JSON line."""
    init = orbite.Engine({"listen": listen})
    peer = init.open_peer(info["endpoint"], epoch=info["epoch"], timeout=10)
    got = np.zeros(N, dtype=np.uint8)
    g = init.register(got)
    t = init.prepare("read", [(g, 0, N)], [peer.range_at(info["address"], N)], peer=peer)
    route = t.route[0]
    t.post()
    pattern = (bytes(range(251)) * (N // 251 + 1))[:N]
    read = t.wait().success and got.tobytes() == pattern
    t.release()
    src = np.frombuffer(os.urandom(N), dtype=np.uint8).copy()
    s = init.register(src)
    t = init.prepare("write", [(s, 0, N)], [(info["registration"], 0, N)], peer=peer, notification=b"kv-ready")
    t.post()
    write = t.wait().success
    t.release()
    init.close()
    print(json.dumps({"route": route, "read": read, "write": write, "sha": hashlib.sha256(src.tobytes()).hexdigest()}))


if __name__ == "__main__" and sys.argv[1:2] == ["--initiator"]:
    initiator(sys.argv[2] + ":0", json.loads(sys.argv[3]))
