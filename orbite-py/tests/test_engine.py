# SPDX-License-Identifier: Apache-2.0
"""The package against its own engines: registration of buffers, a local
WRITE and READ, two engines in one process over a peer route, notifications,
the error hierarchy, and buffers held until the engine lets go of them."""

import gc

import pytest

import orbite


def test_local_write_and_read_move_the_bytes():
    e = orbite.Engine()
    src = bytearray(bytes(range(256)) * 64)
    dst = bytearray(len(src))
    a, b = e.register(src), e.register(dst)
    t = e.prepare("write", [(a, 0, 8192), (a, 8192, 8192)], [(b, 8192, 8192), (b, 0, 8192)])
    assert t.route[0] == "loopback"
    t.post()
    out = t.wait()
    assert out["success"] and out["transferred_bytes"] == 16384
    assert dst[:8192] == src[8192:] and dst[8192:] == src[:8192]
    t.release()
    e.deregister(a)
    e.deregister(b)
    e.close()


def test_two_engines_over_a_peer_route_with_a_notification():
    target = orbite.Engine({"listen": "127.0.0.1:0"})
    init = orbite.Engine({"listen": "127.0.0.1:0", "route": "tcp"})
    src = bytearray(b"kv" * 32768)
    dst = bytearray(len(src))
    s = init.register(src)
    d = target.register(dst)
    peer = init.open_peer(target.endpoint, epoch=target.epoch)
    assert (peer.endpoint, peer.epoch) == (target.endpoint, target.epoch)
    t = init.prepare("write", [(s, 0, len(src))], [(d, 0, len(dst))], peer=peer, notification=b"\x00done\xff")
    t.post()
    assert t.wait()["success"]
    assert dst == src
    got = []
    for _ in range(200):
        got += target.notifications()
        if got:
            break
        import time

        time.sleep(0.01)
    assert [n[2] for n in got] == [b"\x00done\xff"]
    assert got[0][1] == init.epoch


def test_errors_are_typed():
    with pytest.raises(orbite.ConfigError):
        orbite.Engine({"no_such_field": 1})
    e = orbite.Engine()
    with pytest.raises(orbite.MemoryError):
        e.register(b"read-only bytes")
    buf = bytearray(4096)
    r = e.register(buf)
    with pytest.raises(orbite.TransferError):
        e.prepare("write", [(r, 0, 4096)], [(r, 4096, 4096)])
    with pytest.raises(orbite.TransferError):
        e.prepare("sideways", [(r, 0, 1)], [(r, 0, 1)])
    with pytest.raises(orbite.PeerError):
        e.open_peer("127.0.0.1:1", timeout=1.0)
    assert issubclass(orbite.PeerError, orbite.OrbiteError)


def test_a_registered_buffer_is_held_until_the_engine_lets_go():
    e = orbite.Engine()
    buf = bytearray(4096)
    r = e.register(buf)
    with pytest.raises(BufferError):
        buf.extend(b"x")  # exported: it cannot move while registered
    e.deregister(r)
    gc.collect()
    buf.extend(b"x")  # let go of


def test_the_examples_of_docs_python_md_run():
    import os
    import re

    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")
    blocks = re.findall(r"```python\n(.*?)```", open(doc).read(), re.S)
    assert blocks, "docs/python.md has examples"
    for code in blocks:
        exec(compile(code, "docs/python.md", "exec"), {})


def test_an_engine_is_a_context_manager():
    with orbite.Engine() as e:
        buf = bytearray(4096)
        e.register(buf)
    with pytest.raises(orbite.Closed):
        e.register(bytearray(4096))


def test_the_package_says_its_version():
    assert orbite.__version__ == "0.1.0"
