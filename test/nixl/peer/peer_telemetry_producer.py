#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The producer for NIXL's examples/python/telemetry_reader.py (our own code;
peer_run.py runs it, NIXL has no producer of its own).

    peer_telemetry_producer.py BACKEND

Needs NIXL_TELEMETRY_ENABLE=y and NIXL_TELEMETRY_DIR (NIXL's buffer
exporter then writes each agent's events to NIXL_TELEMETRY_DIR/<agent>).
Makes agents `producer` (the one whose events are read) and `peer`, both
with BACKEND only, registers 64 KiB DRAM each, prints
`telemetry file: PATH`, waits for one line on stdin (the reader has opened
the file), then does WRITES writes and READS reads of SIZE bytes from
`producer` to `peer`, each waited for, checks the data read back, prints
what the reader must find (`expect: EVENT=SUM/COUNT ...`), and exits after
NIXL's periodic export has run.
"""

import os
import sys
import time

import nixl._utils as utils
from nixl._api import nixl_agent, nixl_agent_config

WRITES, READS, SIZE = 3, 2, 4096
REGION = 64 * 1024


def wait(agent, handle):
    deadline = time.monotonic() + 30
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state == "ERR" or time.monotonic() > deadline:
            sys.exit(f"producer: transfer ended in state {state}")


def main(argv):
    if len(argv) != 2:
        sys.exit("usage: peer_telemetry_producer.py BACKEND")
    backend = argv[1]
    conf = nixl_agent_config(enable_prog_thread=True, backends=[backend])
    producer = nixl_agent("producer", conf)
    peer = nixl_agent("peer", nixl_agent_config(enable_prog_thread=True, backends=[backend]))
    a, b = utils.malloc_passthru(REGION), utils.malloc_passthru(REGION)
    ctypes_fill(a, REGION, 0x5A)
    ctypes_fill(b, REGION, 0)
    producer.register_memory(producer.get_reg_descs([(a, REGION, 0, "")], "DRAM"))
    peer.register_memory(peer.get_reg_descs([(b, REGION, 0, "")], "DRAM"))
    producer.add_remote_agent(peer.get_agent_metadata())
    print("telemetry file:", os.path.join(os.environ["NIXL_TELEMETRY_DIR"], "producer"), flush=True)
    sys.stdin.readline()

    for i in range(WRITES + READS):
        op = "WRITE" if i < WRITES else "READ"
        off = i * SIZE
        if op == "READ":  # read back what the first writes put there
            off = (i - WRITES) * SIZE
        local = producer.get_xfer_descs([(a + off + (REGION // 2 if op == "READ" else 0), SIZE, 0)], "DRAM")
        remote = producer.get_xfer_descs([(b + off, SIZE, 0)], "DRAM")
        handle = producer.initialize_xfer(op, local, remote, "peer", f"t{i}".encode())
        if producer.transfer(handle) == "ERR":
            sys.exit(f"producer: posting {op} {i} failed")
        wait(producer, handle)
        producer.release_xfer_handle(handle)
    got = ctypes_bytes(a + REGION // 2, READS * SIZE)
    if got != bytes([0x5A]) * (READS * SIZE):
        sys.exit("producer: the data read back differs from the data written")
    # What the reader must print: EVENT=SUM/COUNT (SUM * when any will do).
    print(f"expect: agent_tx_bytes={WRITES * SIZE}/{WRITES} agent_rx_bytes={READS * SIZE}/{READS} "
          f"agent_memory_registered={REGION}/1 agent_xfer_time=*/{WRITES + READS}", flush=True)
    time.sleep(0.5)  # NIXL exports buffered events every 100 ms
    producer.remove_remote_agent("peer")
    del producer, peer
    utils.free_passthru(a)
    utils.free_passthru(b)
    print("producer: done", flush=True)


def ctypes_fill(addr, size, value):
    import ctypes

    ctypes.memset(addr, value, size)


def ctypes_bytes(addr, size):
    import ctypes

    return ctypes.string_at(addr, size)


if __name__ == "__main__":
    main(sys.argv)
