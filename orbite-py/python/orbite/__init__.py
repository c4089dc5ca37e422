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
writable memoryview), a torch tensor (CPU or CUDA), any object that speaks
DLPack, or a bare `(address, length, device)`: the engine holds it until
the last transfer that may touch it retired, after deregistration.
`Engine.allocate` gives memory that same-host peers map (a numpy array).
A posted transfer can be awaited under asyncio (`await transfer`).
"""

import ctypes

from orbite._orbite import (  # noqa: F401
    Closed,
    ConfigError,
    DiscoveryError,
    HostBuffer,
    MemoryError,
    OrbiteError,
    Outcome,
    Peer,
    PeerError,
    ResourceExhausted,
    Transfer,
    TransferError,
)
from orbite._orbite import Engine as _Engine

try:
    from importlib.metadata import version as _version

    __version__ = _version("orbite")
except Exception:  # noqa: BLE001 (not installed as a distribution)
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "Engine",
    "Peer",
    "Transfer",
    "Outcome",
    "OrbiteError",
    "ConfigError",
    "MemoryError",
    "TransferError",
    "PeerError",
    "ResourceExhausted",
    "Closed",
    "DiscoveryError",
]

# DLPack's device types (dlpack.h): host memory, CUDA device memory, and
# CUDA-pinned host memory (a host address).
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def _contiguous_bytes(shape, strides, itemsize):
    """The length in bytes of a C-contiguous layout, or None if the strides
    (in elements; None: C-contiguous) say it is not contiguous."""
    n = 1
    for d in shape:
        n *= d
    if strides is not None and n > 1:
        expect = 1
        for d, st in zip(reversed(shape), reversed(strides)):
            if d != 1 and st != expect:
                return None
            expect *= d
    return n * itemsize


def _from_dlpack(obj):
    """Address, length and device of an object that speaks DLPack; the
    capsule kept (unconsumed: its destructor lets go of the tensor)."""
    if hasattr(obj, "__dlpack_device__"):
        kind, _ = obj.__dlpack_device__()
        if kind not in (_DL_CPU, _DL_CUDA, _DL_CUDA_HOST):
            raise MemoryError(f"DLPack device type {kind} is not host or CUDA memory")
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    ptr = get(capsule, b"dltensor")
    if not ptr:
        raise MemoryError("not a DLPack tensor capsule")
    t = _DLTensor.from_address(ptr)
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = [t.strides[i] for i in range(t.ndim)] if t.strides else None
    itemsize = t.dtype.bits * t.dtype.lanes // 8
    n = _contiguous_bytes(shape, strides, itemsize)
    if n is None:
        raise MemoryError("the tensor must be C-contiguous")
    device = t.device.device_id if t.device.device_type == _DL_CUDA else None
    return (t.data or 0) + t.byte_offset, n, device, (capsule, obj)


def _from_torch(t):
    """Address, length and device of a torch tensor (CPU or CUDA)."""
    if not t.is_contiguous():
        raise MemoryError("the tensor must be contiguous")
    dev = t.device
    if dev.type not in ("cpu", "cuda"):
        raise MemoryError(f"tensors on {dev.type} are not host or CUDA memory")
    device = (dev.index or 0) if dev.type == "cuda" else None
    return t.data_ptr(), t.numel() * t.element_size(), device, t


def _from_buffer(buffer):
    """Address and length of a writable, C-contiguous buffer, and an object
    that keeps it exported (and so its memory in place)."""
    view = memoryview(buffer)
    if view.readonly:
        raise MemoryError("the buffer must be writable")
    if not view.c_contiguous:
        raise MemoryError("the buffer must be C-contiguous")
    n = view.nbytes
    if n == 0:
        raise MemoryError("the buffer is empty")
    holder = (ctypes.c_char * n).from_buffer(view.cast("B"))
    return ctypes.addressof(holder), n, None, (holder, view, buffer)


def _device_of(device):
    """A CUDA ordinal, or None for host memory."""
    if device is None or device == "cpu":
        return None
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        index = device[5:] or "0"
        if index.isdigit():
            return int(index)
    raise MemoryError(f"device is None, 'cpu', a CUDA ordinal or 'cuda:N', not {device!r}")


def _locate(obj):
    """Address, length, device (a CUDA ordinal or None) and keep-alive of
    anything `Engine.register` takes."""
    if isinstance(obj, tuple):
        if len(obj) == 2:
            address, length = obj
            device = None
        elif len(obj) == 3:
            address, length, device = obj
        else:
            raise MemoryError("a range is (address, length) or (address, length, device)")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (address, length)):
            raise MemoryError("address and length are integers")
        if address <= 0 or length <= 0:
            raise MemoryError("a null or empty range")
        return address, length, _device_of(device), None
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous") and hasattr(obj, "element_size"):
        return _from_torch(obj)
    try:
        return _from_buffer(obj)
    except TypeError:
        pass
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj)
    raise MemoryError(
        f"cannot register a {type(obj).__name__}: give a writable buffer, a numpy array, "
        "a torch tensor, a DLPack tensor, or (address, length, device)"
    )


def _allocation_of(obj):
    """The engine allocation an array from `Engine.allocate` lies in, if it
    does (numpy collapses base chains to the owner)."""
    for _ in range(4):
        buf = getattr(obj, "_orbite_buffer", None)
        if buf is not None:
            return buf
        nxt = obj.obj if isinstance(obj, memoryview) else getattr(obj, "base", None)
        if nxt is None or nxt is obj:
            return None
        obj = nxt
    return None


class Engine(_Engine):
    """A transfer engine. `config`: None, a dict or a JSON string
    (docs/configuration.md)."""

    def register(self, memory, remote="readwrite"):
        """Registers memory and returns its id: a writable, C-contiguous
        buffer (numpy array, bytearray, memoryview), a torch tensor (CPU or
        CUDA), a DLPack tensor, or `(address, length, device)` with device
        None, "cpu", a CUDA ordinal or "cuda:N" (checked: mapped and
        writable here, or one allocation of that device). `remote` says
        what peers may do with it: "none", "read" or "readwrite"."""
        address, length, device, keep = _locate(memory)
        if device is None and keep is not None:
            buf = _allocation_of(memory)
            if buf is not None and buf.address <= address and address + length <= buf.address + buf.nbytes:
                return self.register_host(buf, address - buf.address, length, remote)
        return self.register_address(address, length, keep, remote, device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        """Closes the engine (drains what runs, within its close timeout)."""
        self.close()
        return False

    def allocate(self, nbytes, shared=True):
        """Allocates `nbytes` of zeroed, page-aligned host memory charged to
        this engine and returns it as a numpy uint8 array (a memoryview
        without numpy). `shared`: same-host peers map it and copy into it
        one-sided. Register it (or slices of it) with `register`; the memory
        lives while an array over it or a registration of it does."""
        buf = self.allocate_host(nbytes, shared)
        holder = type("_Allocation", (ctypes.c_uint8 * buf.nbytes,), {}).from_address(buf.address)
        holder._orbite_buffer = buf
        try:
            import numpy
        except ImportError:
            return memoryview(holder).cast("B")
        return numpy.frombuffer(holder, dtype=numpy.uint8)
