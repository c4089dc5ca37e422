#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The NIXL backend ORBITE as real deployments drive it, through NIXL's own
Python agent on one host (scripts/nixl-tests runs this next to
run_tests.py; the two-host flows are in multihost.py).

- metadata loaded again after the peer registered more memory (NIXL's
  add_remote_agent is additive), partial metadata, deregistration and
  registration of the same memory again, remove_remote_agent then
  add_remote_agent: each followed by transfers whose bytes are checked,
  with every charge back to its baseline at the end;
- the backend created as vLLM creates it (no parameters), SGLang's way
  (name and parameters from its environment variables), and from
  ORBITE_CONFIG; vLLM's call pattern (heartbeats, a failed request
  released, remove_remote_agent of a dead peer).

    deploy_tests.py [-v] [TEST ...]   (prints `python deploy tests: N passed, M failed`)
"""

import json
import os
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import orbite_harness as H  # noqa: E402
from orbite_harness import (  # noqa: E402
    Hooks,
    Peers,
    check,
    conn_endpoint,
    drive,
    expect_raises,
    let_go,
    make_agent,
    post,
    run_to_done,
    state,
    wait_stats,
    wait_until,
    xfer,
)
from run_tests import engines_gone, marker_barrier, np, pattern, register, same_bytes  # noqa: E402

TEST_TIMEOUT_S = 90
NOTES = []


def note(msg):
    NOTES.append(msg)


def write_read_check(agent, peer, key, addr, n, seed, what):
    """WRITE a fresh pattern into the peer's `key`, READ it back, compare."""
    numpy = np()
    src = pattern(n, seed)
    back = numpy.zeros(n, dtype=numpy.uint8)
    r_src, r_back = register(agent, src), register(agent, back)
    h = xfer(agent, "WRITE", [(src.ctypes.data, n)], [(addr, n)], peer.name)
    run_to_done(agent, h, f"{what}: WRITE")
    same_bytes(peer.read(key, 0, n), src, f"{what}: the peer's bytes")
    agent.release_xfer_handle(h)
    h = xfer(agent, "READ", [(back.ctypes.data, n)], [(addr, n)], peer.name)
    run_to_done(agent, h, f"{what}: READ")
    same_bytes(back, src, f"{what}: the bytes read back")
    agent.release_xfer_handle(h)
    agent.deregister_memory(r_src)
    agent.deregister_memory(r_back)


def metadata_reload_flows():
    """Late registration, partial metadata, deregister and register again,
    deregistration alone, remove then add: all through the agent."""
    N = 256 << 10
    with Peers() as peers:
        t = peers.start("T")
        t_base = t.stats()
        a_addr = t.register("a", N, 0)
        agent = make_agent("I")
        hooks = Hooks()
        base = hooks.stats()
        agent.add_remote_agent(t.metadata())
        t.add_remote(agent.get_agent_metadata())
        write_read_check(agent, t, "a", a_addr, N, 1, "registered before the exchange")

        # 1. T registers more memory after the exchange; its metadata is
        #    loaded again (additive): the new range is found by refreshing.
        b_addr = t.register("b", N, 0)
        agent.add_remote_agent(t.metadata())
        write_read_check(agent, t, "b", b_addr, N, 2, "registered after the exchange, full metadata again")

        # 2. Partial metadata of a newer registration.
        c_addr = t.register("c", N, 0)
        agent.add_remote_agent(t.partial_metadata(["c"]))
        write_read_check(agent, t, "c", c_addr, N, 3, "partial metadata")

        # 3. T deregisters "a" and registers the same memory again: its
        #    metadata is byte-identical, NIXL keeps what it loaded, and a
        #    transfer reaches the new registration. A handle prepared
        #    before is refused (nothing replayed into a range given up).
        numpy = np()
        src = pattern(N, 4)
        r_src = register(agent, src)
        h_before = xfer(agent, "WRITE", [(src.ctypes.data, N)], [(a_addr, N)], "T")
        check(t.reregister("a") == a_addr, "same memory")
        agent.add_remote_agent(t.metadata())
        s, exc = post(agent, h_before)
        if s != "ERR":
            s, exc = drive(agent, h_before)
        check(s == "ERR", f"a handle prepared for the old registration ended {s}")
        agent.release_xfer_handle(h_before)
        write_read_check(agent, t, "a", a_addr, N, 5, "deregistered and registered again")

        # 4. Deregistration alone: NIXL still lists the range, the backend
        #    refuses it before admission.
        t.deregister("b")
        agent.add_remote_agent(t.metadata())
        exc = expect_raises(xfer, "a transfer to a deregistered range", agent, "WRITE",
                            [(src.ctypes.data, N)], [(b_addr, N)], "T")
        check(type(exc).__name__ in ("nixlNotFoundError", "nixlBackendError"), f"{exc!r}")

        # 5. remove_remote_agent, then the same agent again.
        agent.remove_remote_agent("T")
        name = agent.add_remote_agent(t.metadata())
        check(name in (b"T", "T"), f"add_remote_agent returned {name!r}")
        write_read_check(agent, t, "c", c_addr, N, 6, "after remove_remote_agent and add again")
        write_read_check(agent, t, "a", a_addr, N, 7, "the re-registered range after remove and add")

        agent.deregister_memory(r_src)
        del numpy
        agent.remove_remote_agent("T")
        wait_stats(hooks.stats, base, "initiator at the end")
        for key in ("a", "c"):
            t.deregister(key)
        t.remove_remote("I")
        wait_stats(t.stats, t_base, "target at the end")
        peers.close_all()
        del h_before, exc
        del agent
        engines_gone(hooks)


def expected_advertised_host():
    """This host's address other hosts reach, found independently of the
    engine: the source address of the route to the default gateway, else
    the first non-loopback IPv4 address that is up, else 127.0.0.1."""
    import socket
    import struct

    try:
        with open("/proc/net/route") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                flags = int(fields[3], 16)
                if fields[1] == "00000000" and fields[7] == "00000000" and flags & 1:
                    gw = socket.inet_ntoa(struct.pack("<I", int(fields[2], 16)))
                    if not flags & 2:
                        gw = "198.51.100.1"
                    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    try:
                        s.connect((gw, 9))
                        return s.getsockname()[0]
                    finally:
                        s.close()
    except OSError:
        pass
    import subprocess

    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "up"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        ip = parts[3].split("/")[0]
        if not ip.startswith("127."):
            return ip
    return "127.0.0.1"


def vllm_call_pattern():
    """Created as vLLM creates backends (no parameters, no ORBITE_CONFIG):
    listens on all interfaces and advertises a routable address; the
    handshake, block READs with a notification, telemetry, standalone
    heartbeats, a failed request released, and remove_remote_agent of a
    peer that died; the agent stays healthy."""
    BLOCKS, B = 32, 16 << 10
    numpy = np()
    os.environ.pop("ORBITE_CONFIG", None)
    with Peers() as peers:
        prefill = peers.start("prefill", style="vllm")
        spare = peers.start("spare", style="vllm")
        decode = make_agent("decode", style="vllm")
        hooks = Hooks()
        base = hooks.stats()
        md = decode.get_agent_metadata()
        host = conn_endpoint(md).rsplit(":", 1)[0]
        want = expected_advertised_host()
        check(host == want, f"advertised {host}, want {want} (listen on all interfaces, routable address)")
        note(f"vllm: advertised {conn_endpoint(md)}")
        p_addr = prefill.register("kv", BLOCKS * B, 0)
        s_addr = spare.register("kv", B, 0)
        kv = numpy.zeros(BLOCKS * B, dtype=numpy.uint8)
        r_kv = register(decode, kv)
        decode.add_remote_agent(prefill.metadata())
        decode.add_remote_agent(spare.metadata())
        prefill.add_remote(md)
        spare.add_remote(md)
        local = decode.prep_xfer_dlist("NIXL_INIT_AGENT", [(kv.ctypes.data + i * B, B, 0) for i in range(BLOCKS)],
                                       "DRAM")
        remote = decode.prep_xfer_dlist("prefill", [(p_addr + i * B, B, 0) for i in range(BLOCKS)], "DRAM")
        for b in range(BLOCKS):
            prefill.write("kv", b * B, pattern(B, 500 + b).tobytes())
        r_ids, l_ids = [5, 1, 30, 2], [0, 9, 3, 31]
        h = decode.make_prepped_xfer("READ", local, l_ids, remote, r_ids, notif_msg=b"req-1:4")
        run_to_done(decode, h, "vLLM READ")
        tel = decode.get_xfer_telemetry(h)
        check(tel.totalBytes == len(r_ids) * B, f"telemetry says {tel.totalBytes} bytes")
        for lb, rb in zip(l_ids, r_ids):
            same_bytes(kv[lb * B:(lb + 1) * B], pattern(B, 500 + rb), f"block {rb} -> {lb}")
        decode.release_xfer_handle(h)
        check(prefill.wait_for("decode", b"req-1:4") == [b"req-1:4"], "the request's notification")
        # heartbeats: standalone notifications, each delivered once
        for k in range(5):
            decode.send_notif("prefill", b"HB:req-1,req-2" + bytes([k]))
        got = prefill.wait_notifs("decode", 5)
        check(got == [b"HB:req-1,req-2" + bytes([k]) for k in range(5)], f"heartbeats: {got!r}")

        # a request in flight when prefill dies: it fails (after local
        # retirement), its handle is released, and prefill is removed
        h = decode.make_prepped_xfer("READ", local, [4, 5], remote, [6, 7], notif_msg=b"req-2:2")
        hooks.hold_all(True)
        check(post(decode, h)[0] == "PROC", "post returned PROC")
        hooks.require_held(1)
        prefill.exit()
        let_go(hooks, lambda: state(decode, h)[0] != "PROC")
        s, exc = drive(decode, h)
        check(s == "ERR", f"the request to a dead peer ended {s}")
        decode.release_xfer_handle(h)
        start = time.monotonic()
        decode.remove_remote_agent("prefill")
        took = time.monotonic() - start
        check(took < 2.0, f"remove_remote_agent of a dead peer took {took:.1f} s")
        remote.release()
        # the agent is healthy: the other peer still works, notifications too
        src = pattern(B, 77)
        r_src = register(decode, src)
        h = xfer(decode, "WRITE", [(src.ctypes.data, B)], [(s_addr, B)], "spare", b"to-spare")
        run_to_done(decode, h, "WRITE to the other peer")
        same_bytes(spare.read("kv"), src, "the other peer's bytes")
        decode.release_xfer_handle(h)
        check(spare.wait_for("decode", b"to-spare") == [b"to-spare"], "the other peer's notification")
        decode.deregister_memory(r_src)
        local.release()
        decode.deregister_memory(r_kv)
        decode.remove_remote_agent("spare")
        wait_stats(hooks.stats, base, "decode at the end")
        spare.quit()
        del h, local, remote
        del decode
        engines_gone(hooks)


def sglang_way():
    """SGLang's way: the backend's name and parameters come from
    SGLANG_DISAGGREGATION_NIXL_BACKEND(_PARAMS); KV goes by WRITE with a
    notification (make_prepped_xfer), small state by initialize_xfer, and
    standalone notifications."""
    N, B = 64 << 10, 4 << 10
    env = {
        "SGLANG_DISAGGREGATION_NIXL_BACKEND": "ORBITE",
        "SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS": json.dumps(
            {"config": json.dumps({"peer_timeout_ms": 5000, "connections_per_peer": 3})}),
    }
    os.environ.update(env)
    with Peers() as peers:
        dec = peers.start("decode", style="sglang", env=env)
        d_addr = dec.register("kv", N, 0)
        pre = make_agent("prefill", style="sglang")
        hooks = Hooks()
        base = hooks.stats()
        kv = pattern(N, 31)
        r_kv = register(pre, kv)
        pre.add_remote_agent(dec.metadata())
        dec.add_remote(pre.get_agent_metadata())
        local = pre.prep_xfer_dlist("", [(kv.ctypes.data + i * B, B, 0) for i in range(N // B)], "DRAM")
        remote = pre.prep_xfer_dlist("decode", [(d_addr + i * B, B, 0) for i in range(N // B)], "DRAM")
        ids = list(range(N // B))
        h = pre.make_prepped_xfer("WRITE", local, ids, remote, list(reversed(ids)), b"room-1")
        run_to_done(pre, h, "SGLang KV WRITE")
        got = dec.read("kv")
        for i in ids:
            j = len(ids) - 1 - i
            same_bytes(got[j * B:(j + 1) * B], kv[i * B:(i + 1) * B], f"block {i} -> {j}")
        pre.release_xfer_handle(h)
        check(dec.wait_for("prefill", b"room-1") == [b"room-1"], "the KV notification")
        pre.send_notif("decode", b"0_0")
        check(dec.wait_for("prefill", b"0_0") == [b"0_0"], "the standalone notification")
        local.release()
        remote.release()
        pre.deregister_memory(r_kv)
        pre.remove_remote_agent("decode")
        wait_stats(hooks.stats, base, "prefill at the end")
        peers.close_all()
        del h, local, remote
        del pre
        engines_gone(hooks)
    # Parameters ORBITE does not know fail the creation, before anything.
    os.environ["SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS"] = json.dumps({"listen": "0.0.0.0:0"})
    expect_raises(make_agent, "unknown SGLang parameters", "bad", style="sglang")


def capture_stderr(fn):
    """Runs fn with file descriptor 2 redirected; returns (result or exception, text)."""
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 (returned to the caller)
                result = H._bare(exc)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        return result, f.read().decode("utf-8", "replace")


def orbite_config_from_environment():
    """No backend parameters: ORBITE_CONFIG (a JSON object, or @file) is
    the configuration; explicit parameters win over it; an invalid one
    fails the creation with an error that names the variable."""
    from nixl._api import nixl_agent, nixl_agent_config

    os.environ["ORBITE_CONFIG"] = json.dumps({"listen": "127.0.0.1:0", "advertise": "127.0.0.1"})
    a = make_agent("env-inline", style="vllm")
    check(conn_endpoint(a.get_agent_metadata()).startswith("127.0.0.1:"), "ORBITE_CONFIG's listen/advertise")
    del a
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"advertise": "node-7.example:7000"}, f)
        path = f.name
    try:
        os.environ["ORBITE_CONFIG"] = "@" + path
        a = make_agent("env-file", style="vllm")
        check(conn_endpoint(a.get_agent_metadata()) == "node-7.example:7000", "ORBITE_CONFIG=@file")
        del a
    finally:
        os.unlink(path)
    # the advertised defaults passed back (as nixlbench passes every
    # parameter getPluginParams returns) are no parameters: ORBITE_CONFIG
    os.environ["ORBITE_CONFIG"] = json.dumps({"advertise": "node-8.example:7000"})
    probe = nixl_agent("defaults-probe", nixl_agent_config(backends=[]))
    defaults = dict(probe.get_plugin_params("ORBITE"))
    del probe
    check(defaults == {"config": "{}"}, f"advertised defaults: {defaults!r}")
    a = make_agent("passed-back", config=defaults["config"])
    check(conn_endpoint(a.get_agent_metadata()) == "node-8.example:7000", "ORBITE_CONFIG under advertised defaults")
    del a
    # explicit parameters win over ORBITE_CONFIG, even an invalid one
    os.environ["ORBITE_CONFIG"] = '{"no_such_field": 1}'
    a = make_agent("explicit", config='{"listen": "127.0.0.1:0"}')
    check(conn_endpoint(a.get_agent_metadata()).startswith("127.0.0.1:"), "explicit config")
    del a

    def create():
        agent = nixl_agent("env-bad", nixl_agent_config(backends=[]))
        agent.create_backend("ORBITE", {})
        return agent

    for bad in ('{"no_such_field": 1}', "[1, 2]", "{", "@/nonexistent/orbite.json"):
        os.environ["ORBITE_CONFIG"] = bad
        result, err = capture_stderr(create)
        check(isinstance(result, Exception), f"ORBITE_CONFIG={bad!r}: the backend was created")
        check("ORBITE_CONFIG" in err, f"ORBITE_CONFIG={bad!r}: the error does not name the variable: {err!r}")
    del os.environ["ORBITE_CONFIG"]
    import gc

    gc.collect()
    check(live_engines() == 0, "no engine left behind")


def live_engines():
    """How many OrbiTE engines this process holds (the test hooks; Hooks() wants exactly one)."""
    import ctypes

    lib = ctypes.CDLL(os.environ["ORBITE_NIXL_LIB"])
    n = ctypes.c_size_t(0)
    lib.orbite_test_engines(None, 0, ctypes.byref(n))
    return n.value


TESTS = [
    ("metadata_reload_flows", metadata_reload_flows),
    ("vllm_call_pattern", vllm_call_pattern),
    ("sglang_way", sglang_way),
    ("orbite_config_from_environment", orbite_config_from_environment),
]


def main(argv):
    return H.suite_main(argv, __file__, TESTS, NOTES, "python deploy tests", TEST_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
