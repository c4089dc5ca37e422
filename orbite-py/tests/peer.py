# SPDX-License-Identifier: Apache-2.0
"""A peer engine in a process of its own, for the two-process tests:

    python peer.py LISTEN NBYTES [CONFIG_JSON]

Registers NBYTES of a known pattern, prints one JSON line (endpoint, epoch,
registration, address), then answers commands on stdin, one per line:
`sha` (the sha256 of its buffer), `notes` (the notifications received
within 10 s, hex) and `quit`."""

import ctypes
import hashlib
import json
import sys
import time

import orbite


def main():
    listen, nbytes = sys.argv[1], int(sys.argv[2])
    config = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    engine = orbite.Engine({"listen": listen, **config})
    buf = bytearray(bytes(range(251)) * (nbytes // 251 + 1))[:nbytes]
    reg = engine.register(buf)
    address = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(buf))
    print(json.dumps({"endpoint": engine.endpoint, "epoch": engine.epoch, "registration": reg, "address": address}),
          flush=True)
    notes = []
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "sha":
            print(hashlib.sha256(buf).hexdigest(), flush=True)
        elif cmd == "notes":
            deadline = time.monotonic() + 10
            while not notes and time.monotonic() < deadline:
                notes += [n[2].hex() for n in engine.notifications()]
                time.sleep(0.01)
            print(json.dumps(notes), flush=True)
        elif cmd == "quit":
            break
    engine.close()


if __name__ == "__main__":
    main()
