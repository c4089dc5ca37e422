# SPDX-License-Identifier: Apache-2.0
"""Peers by name through a real etcd server on loopback: a peer process
publishes itself, this one opens it by name and moves bytes; the name is
gone within the TTL of a killed peer; a store that does not answer is a
clear error within the bound."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import pytest

import orbite

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd():
    exe = os.environ.get("ORBITE_ETCD", "etcd")
    if shutil.which(exe) is None:
        if os.environ.get("ORBITE_ETCD_REQUIRED"):
            pytest.fail(f"ORBITE_ETCD_REQUIRED, and no etcd ({exe})")
        pytest.skip(f"SKIP: no etcd server ({exe}; apt-get install etcd-server)")
    data = tempfile.mkdtemp(prefix="orbite-py-etcd-")
    client, peer = free_port(), free_port()
    c, p = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    proc = subprocess.Popen([exe, "--name", "t", "--data-dir", data, "--listen-client-urls", c,
                             "--advertise-client-urls", c, "--listen-peer-urls", p,
                             "--initial-advertise-peer-urls", p, "--initial-cluster", f"t={p}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if b'"health":"true"' in urllib.request.urlopen(c + "/health", timeout=1).read():
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "etcd did not become healthy"
            time.sleep(0.05)
        yield f"etcd://127.0.0.1:{client}"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)


def test_a_peer_process_is_opened_by_its_name_and_leaves_with_its_lease(etcd):
    config = {"metadata": etcd, "name": "prefill-py", "metadata_ttl_ms": 2000}
    child = subprocess.Popen([sys.executable, PEER, "127.0.0.1:0", str(1 << 20), json.dumps(config)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline())
        init = orbite.Engine({"listen": "127.0.0.1:0", "metadata": etcd, "route": "tcp"})
        rec = init.resolve_name("prefill-py")
        assert (rec["endpoint"], rec["epoch"]) == (info["endpoint"], info["epoch"])
        assert "tcp" in rec["routes"]
        peer = init.open_peer_by_name("prefill-py")
        assert peer.epoch == info["epoch"]
        src = np.full(1 << 20, 5, dtype=np.uint8)
        s = init.register(src)
        t = init.prepare("write", [(s, 0, 1 << 20)], [(info["registration"], 0, 1 << 20)], peer=peer)
        t.post()
        assert t.wait().success
        t.release()
        with pytest.raises(orbite.DiscoveryError, match="no engine is published"):
            init.open_peer_by_name("decode-none")
        with pytest.raises(orbite.DiscoveryError, match="invalid engine name"):
            init.open_peer_by_name("not a name")
        assert issubclass(orbite.DiscoveryError, orbite.PeerError)

        child.kill()
        child.wait()
        killed = time.monotonic()
        while True:
            try:
                init.resolve_name("prefill-py")
            except orbite.DiscoveryError:
                break
            assert time.monotonic() - killed < 3.5, "the name outlived its TTL"
            time.sleep(0.05)
        init.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_an_unreachable_store_is_a_clear_error_within_the_bound():
    dead = f"etcd://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(orbite.DiscoveryError, match="did not answer within 500 ms"):
        orbite.Engine({"listen": "127.0.0.1:0", "metadata": dead, "name": "x", "metadata_timeout_ms": 500})
    assert time.monotonic() - t0 < 2.5
    with pytest.raises(orbite.DiscoveryError, match="no metadata store"):
        orbite.Engine().open_peer_by_name("x")


def test_the_etcd_example_of_docs_python_md_runs(etcd):
    import re

    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")
    blocks = re.findall(r"```python etcd\n(.*?)```", open(doc).read(), re.S)
    assert len(blocks) == 1
    code = blocks[0].replace('"etcd://127.0.0.1:2379"', repr(etcd))
    exec(compile(code, "docs/python.md", "exec"), {})
