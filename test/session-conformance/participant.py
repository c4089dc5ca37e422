"""A producer process that the suite kills mid-flow: it allocates a session
with a short lease, marks it ready (the server pins its KV), prints
`session <id>` and then sleeps until it is killed.

    participant.py ADDR STUB_DIR KEY LEASE_MS REGISTRATION OFFSET BLOCK_BYTES BLOCKS
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvconf  # noqa: E402


def main():
    addr, stub_dir, key, lease_ms, reg, off, block_bytes, blocks = sys.argv[1:9]
    kvconf.generate_stubs(None, stub_dir)
    kvconf.set_default_meta(int(block_bytes), int(blocks))
    c = kvconf.Client(addr)
    s = c.allocate(key, lease_ms=int(lease_ms))
    size = kvconf.kv_size()
    r = c.ready(s.session_id, [kvconf.pb.KvRange(registration=int(reg), offset=int(off), len=size)])
    print(f"session {s.session_id} {kvconf.state_name(r.state)}", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
