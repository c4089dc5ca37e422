# SPDX-License-Identifier: Apache-2.0
"""Memory as Python holds it: numpy arrays, DLPack tensors, objects shaped
like torch tensors, bare `(address, length, device)` ranges (checked), and
the engine's own shared allocations as numpy arrays; CUDA device memory
through the driver shim where the test script provides it."""

import ctypes
import mmap
import os

import numpy as np
import pytest

import orbite


def copy(e, a, b, n, op="write"):
    t = e.prepare(op, [(a, 0, n)], [(b, 0, n)])
    t.post()
    out = t.wait()
    t.release()
    return out


def through_device(e, memory, n, value):
    """Registers `memory` (n bytes of device memory), moves n bytes of
    `value` into it from host memory and back out, and checks them: its
    registration."""
    host = np.full(n, value, dtype=np.uint8)
    back = np.zeros_like(host)
    h, b, d = e.register(host), e.register(back), e.register(memory)
    assert copy(e, h, d, n).success and copy(e, b, d, n, op="read").success
    assert (back == value).all()
    return d


def test_numpy_arrays_of_any_dtype_register_and_move():
    e = orbite.Engine()
    src = np.arange(4096, dtype=np.float32)
    dst = np.zeros_like(src)
    a, b = e.register(src), e.register(dst)
    out = copy(e, a, b, src.nbytes)
    assert out.success and out["success"] and out.transferred_bytes == src.nbytes
    assert out.execution == 1 and out.tasks_never_started == 0
    assert np.array_equal(src, dst)
    with pytest.raises(orbite.MemoryError):
        e.register(src[::2])  # not contiguous
    ro = np.ones(16)
    ro.flags.writeable = False
    with pytest.raises(orbite.MemoryError):
        e.register(ro)
    e.close()


def test_dlpack_tensors_register_by_their_capsule():
    e = orbite.Engine()
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)

    class OnlyDLPack:  # what a framework without the buffer protocol gives
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    a, b = e.register(OnlyDLPack(src)), e.register(OnlyDLPack(dst))
    assert copy(e, a, b, src.nbytes).success
    assert np.array_equal(src, dst)
    with pytest.raises(orbite.MemoryError):
        e.register(OnlyDLPack(np.arange(64, dtype=np.uint8)[::2]))
    e.close()


class FakeTensor:
    """The part of torch.Tensor that `register` reads, over a numpy array."""

    def __init__(self, a, device="cpu", contiguous=True):
        self.a = a
        self.device = type("device", (), {"type": device.split(":")[0], "index": None})()
        self.contiguous = contiguous

    def data_ptr(self):
        return self.a.ctypes.data

    def is_contiguous(self):
        return self.contiguous

    def numel(self):
        return self.a.size

    def element_size(self):
        return self.a.itemsize


def test_tensors_register_through_data_ptr():
    e = orbite.Engine()
    src = np.arange(1024, dtype=np.int64)
    dst = np.zeros_like(src)
    a, b = e.register(FakeTensor(src)), e.register(FakeTensor(dst))
    assert copy(e, a, b, src.nbytes).success
    assert np.array_equal(src, dst)
    with pytest.raises(orbite.MemoryError):
        e.register(FakeTensor(src, contiguous=False))
    with pytest.raises(orbite.MemoryError):
        e.register(FakeTensor(src, device="mps"))
    e.close()


def test_bare_ranges_are_checked_against_this_process():
    e = orbite.Engine()
    src = np.arange(4096, dtype=np.uint8)
    r = e.register((src.ctypes.data, src.nbytes, None))
    e.deregister(r)
    # Unmapped, read-only, null, wrapping, and malformed ranges: typed
    # refusals, and the engine keeps serving.
    bad = [
        (8, 4096),
        (0, 16),
        (2**64 - 8, 16),
        (src.ctypes.data, 0),
        (src.ctypes.data, 1 << 40),
        (src.ctypes.data, 16, "tpu"),
        (src.ctypes.data, 16, -1),
        ("x", 16),
        (1, 2, 3, 4),
    ]
    for b in bad:
        with pytest.raises(orbite.MemoryError):
            e.register(b)
    # A read-only mapping: the engine writes into what it registers.
    before = _mappings()
    m = mmap.mmap(-1, 4 * mmap.PAGESIZE, prot=mmap.PROT_READ)
    new = [lo for lo, hi, perms in _mappings() - before if perms.startswith("r--") and hi - lo >= len(m)]
    assert new, "the read-only mapping is listed"
    with pytest.raises(orbite.MemoryError, match="not readable and writable|r--"):
        e.register((new[0], mmap.PAGESIZE))
    m.close()
    with pytest.raises(orbite.MemoryError):
        e.register(object())
    dst = np.zeros_like(src)
    a, b = e.register(src), e.register(dst)
    assert copy(e, a, b, src.nbytes).success
    e.close()


def _mappings():
    """This process's mappings: (start, end, permissions) each."""
    out = set()
    for line in open("/proc/self/maps"):
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        out.add((lo, hi, perms))
    return out


def test_allocate_gives_a_numpy_array_of_engine_memory():
    e = orbite.Engine()
    a = e.allocate(1 << 20)
    assert isinstance(a, np.ndarray) and a.dtype == np.uint8 and a.size == 1 << 20
    assert a.ctypes.data % 4096 == 0 and not a.any()
    a[:] = 7
    whole = e.register(a)
    half = e.register(a[1 << 19:])  # a slice: a range of the same allocation
    dst = np.zeros(1 << 19, dtype=np.uint8)
    d = e.register(dst)
    t = e.prepare("write", [(half, 0, 1 << 19)], [(d, 0, 1 << 19)])
    t.post()
    assert t.wait().success and (dst == 7).all()
    t.release()
    for r in (whole, half, d):
        e.deregister(r)
    private = e.allocate(8192, shared=False)
    assert private.size == 8192
    e.close()


def test_a_same_host_peer_copies_into_a_shared_allocation():
    target = orbite.Engine({"listen": "127.0.0.1:0"})
    init = orbite.Engine({"listen": "127.0.0.1:0"})
    dst = target.allocate(1 << 20)
    d = target.register(dst)
    src = init.allocate(1 << 20)
    src[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
    s = init.register(src)
    peer = init.open_peer(target.endpoint, epoch=target.epoch)
    rng = peer.range_at(dst.ctypes.data + 4096, 65536)
    assert rng == (d, 4096, 65536)
    assert peer.range_at(dst.ctypes.data, 2 << 20) is None
    t = init.prepare("write", [(s, 0, 1 << 20)], [(d, 0, 1 << 20)], peer=peer)
    assert t.route[0] in ("shm", "cma"), t.route
    t.post()
    assert t.wait().success and np.array_equal(src, dst)
    t.release()
    init.close()
    target.close()


def _driver():
    """The CUDA driver (the shim in CI), with a context current, or None."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if cu.cuInit(0) != 0:
        return None
    ctx = ctypes.c_void_p()
    if cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) != 0 or cu.cuCtxSetCurrent(ctx) != 0:
        return None
    return cu


def _cuda():
    """The CUDA driver; the test fails without it where the test script
    requires it (ORBITE_CUDA_REQUIRED), else skips."""
    cu = _driver()
    if cu is None:
        if os.environ.get("ORBITE_CUDA_REQUIRED") == "1":
            pytest.fail("no CUDA driver (ORBITE_CUDA_REQUIRED=1)")
        pytest.skip("no CUDA driver (the test script puts the shim on LD_LIBRARY_PATH)")
    return cu


def test_device_memory_registers_by_address_and_device():
    cu = _cuda()
    n = 1 << 20
    dptr = ctypes.c_uint64()
    assert cu.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(n)) == 0
    e = orbite.Engine()
    host = np.arange(n, dtype=np.uint64).astype(np.uint8)
    back = np.zeros_like(host)
    h, b = e.register(host), e.register(back)
    dev = e.register((dptr.value, n, "cuda:0"))
    assert copy(e, h, dev, n).success  # host to device
    assert copy(e, b, dev, n, op="read").success  # device to host
    assert np.array_equal(host, back)
    with pytest.raises(orbite.MemoryError):
        e.register((dptr.value + n - 16, 4096, 0))  # past the allocation
    with pytest.raises(orbite.MemoryError):
        e.register((host.ctypes.data, n, 0))  # host memory named as device
    e.deregister(dev)
    e.close()
    assert cu.cuMemFree_v2(dptr) == 0


def test_what_a_python_caller_can_send_is_checked():
    e = orbite.Engine()
    host = e.allocate_host(4096)
    refusals = [
        (orbite.MemoryError, lambda: e.allocate(0)),
        (orbite.ResourceExhausted, lambda: e.allocate(1 << 62)),
        (OverflowError, lambda: e.allocate(-1)),
        (orbite.MemoryError, lambda: e.register_host(host, 4000, 200)),
        (orbite.MemoryError, lambda: e.register_address(1 << 47, 4096, None)),
        (orbite.MemoryError, lambda: e.register_address(0x1000, (1 << 64) - 1, None)),
        (orbite.MemoryError, lambda: e.register_address(8, 8, None, "superuser")),
        (orbite.MemoryError, lambda: e.prepare("write", [((1 << 64) - 1, 0, 1)], [(0, 0, 1)])),
        (orbite.MemoryError, lambda: e.deregister(12345)),
        (orbite.PeerError, lambda: e.open_peer("x" * 10000, timeout=0.5)),
        (orbite.PeerError, lambda: e.open_peer("127.0.0.1:1", timeout=float("inf"))),
        (orbite.DiscoveryError, lambda: e.resolve_name("x")),
    ]
    for exc, f in refusals:
        with pytest.raises(exc):
            f()
    assert orbite.PeerError.__name__ == "PeerError"
    # The engine kept serving, and holds nothing of the refused calls.
    src, dst = np.ones(1 << 16, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
    a, b = e.register(src), e.register(dst)
    assert copy(e, a, b, 1 << 16).success and (dst == 1).all()
    e.close()


def test_a_cuda_tensor_registers_as_device_memory():
    cu = _cuda()
    n = 1 << 16
    dptr = ctypes.c_uint64()
    assert cu.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(n)) == 0

    class CudaTensor(FakeTensor):  # torch.cuda tensor's view of itself
        def __init__(self):
            super().__init__(np.zeros(n, dtype=np.uint8), device="cuda")
            self.device.index = 0

        def data_ptr(self):
            return dptr.value

    e = orbite.Engine()
    e.deregister(through_device(e, CudaTensor(), n, 9))
    e.close()
    assert cu.cuMemFree_v2(dptr) == 0


def test_a_cuda_dlpack_tensor_registers_as_device_memory():
    """A producer like CuPy or JAX: a `dltensor` capsule of CUDA memory
    (kDLCUDA), built here over driver-shim memory."""
    cu = _cuda()
    import orbite as pkg

    n = 1 << 16
    dptr = ctypes.c_uint64()
    assert cu.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(n)) == 0

    class Managed(ctypes.Structure):
        _fields_ = [("dl_tensor", pkg._DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]

    shape = (ctypes.c_int64 * 1)(n // 4)
    managed = Managed()
    managed.dl_tensor.data = dptr.value
    managed.dl_tensor.device = pkg._DLDevice(2, 0)  # kDLCUDA, device 0
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = pkg._DLDataType(2, 32, 1)  # float32
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None
    managed.dl_tensor.byte_offset = 0
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

    class CudaArray:
        def __dlpack__(self, **kw):
            return new(ctypes.addressof(managed), b"dltensor", None)

        def __dlpack_device__(self):
            return (2, 0)

    e = orbite.Engine()
    d = through_device(e, CudaArray(), n, 4)

    class Metal(CudaArray):
        def __dlpack_device__(self):
            return (8, 0)  # kDLMetal: neither host nor CUDA

    with pytest.raises(orbite.MemoryError, match="not host or CUDA"):
        e.register(Metal())
    e.deregister(d)
    e.close()
    assert cu.cuMemFree_v2(dptr) == 0
