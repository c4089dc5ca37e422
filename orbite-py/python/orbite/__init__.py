# SPDX-License-Identifier: Apache-2.0
"""OrbiTE for Python: the transfer engine that moves KV-cache bytes between
inference engines.

    import orbite
    e = orbite.Engine({"listen": "127.0.0.1:0"})
    src, dst = bytearray(b"x" * 4096), bytearray(4096)
    a, b = e.register(src), e.register(dst)
    t = e.prepare("write", [(a, 0, 4096)], [(b, 0, 4096)])
    t.post()
    assert t.wait()["success"] and dst == src

Memory is any writable, C-contiguous buffer (bytearray, numpy array,
writable memoryview): the engine holds it until the last transfer that may
touch it retired, after deregistration.
"""

import ctypes

from orbite._orbite import (  # noqa: F401
    Closed,
    ConfigError,
    MemoryError,
    OrbiteError,
    Peer,
    PeerError,
    ResourceExhausted,
    Transfer,
    TransferError,
)
from orbite._orbite import Engine as _Engine

__all__ = [
    "Engine",
    "Peer",
    "Transfer",
    "OrbiteError",
    "ConfigError",
    "MemoryError",
    "TransferError",
    "PeerError",
    "ResourceExhausted",
    "Closed",
]


def _address(buffer):
    """The address and length of a writable, C-contiguous buffer, and an
    object that keeps it exported (and so its memory in place)."""
    view = memoryview(buffer)
    if view.readonly:
        raise MemoryError("the buffer must be writable")
    if not view.c_contiguous:
        raise MemoryError("the buffer must be C-contiguous")
    n = view.nbytes
    if n == 0:
        raise MemoryError("the buffer is empty")
    holder = (ctypes.c_char * n).from_buffer(view.cast("B"))
    return ctypes.addressof(holder), n, (holder, view, buffer)


class Engine(_Engine):
    """A transfer engine. `config`: None, a dict or a JSON string
    (docs/configuration.md)."""

    def register(self, buffer, remote="readwrite"):
        """Registers a writable, C-contiguous buffer; `remote` says what
        peers may do with it ("none", "read", "readwrite"). Returns its id."""
        address, length, keep = _address(buffer)
        return self.register_address(address, length, keep, remote)
