//! The virtual memory management API: physical allocations, reservations,
//! mappings and access; copies through mappings (and across mappings that
//! lie back to back); pointer queries; POSIX file descriptors as shareable
//! handles, passed to another process of this test binary over a socket
//! (`SCM_RIGHTS`), as the engine passes them; refusals of bad arguments
//! and of descriptors the shim did not export.
//!
//! The tests in this binary share the process's counters, so each runs
//! under [`begin`], which also checks that `orbite_cuda_shim_vmm_stats` is
//! zero at its start; each checks it is zero again at its end.

mod common;

use std::ffi::{CStr, c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::sync::{Mutex, MutexGuard};

use common::*;
use sys::CUpointer_attribute as PA;
use sys::CUresult as R;

/// The shim's granularity: 2 MiB.
const G: usize = 2 << 20;
const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
const RW: sys::CUmemAccess_flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
const READ: sys::CUmemAccess_flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ;
const NONE: sys::CUmemAccess_flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;

static SERIAL: Mutex<()> = Mutex::new(());

/// Runs the tests that read counters one at a time (a failed test poisons
/// the lock; the next one still runs), each from zero.
#[track_caller]
fn begin() -> MutexGuard<'static, ()> {
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    assert_eq!(vmm_stats(), OrbiteCudaShimVmmStats::default(), "an earlier test left VMM objects behind");
    serial
}

#[track_caller]
fn no_vmm_left() {
    assert_eq!(vmm_stats(), OrbiteCudaShimVmmStats::default(), "VMM counters back to zero");
}

fn location(device: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device }
}

fn prop(device: i32, shareable: bool) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all zeros is a valid value of each field.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = location(device);
    if shareable {
        p.requestedHandleTypes = POSIX_FD;
    }
    p
}

fn try_create(device: i32, size: usize, shareable: bool) -> Result<u64, R> {
    let mut h = 0;
    // SAFETY: out-pointer to a local; the prop is a local.
    let r = unsafe { sys::cuMemCreate(&mut h, size, &prop(device, shareable), 0) };
    if r == R::CUDA_SUCCESS { Ok(h) } else { Err(r) }
}

#[track_caller]
fn create(device: i32, size: usize, shareable: bool) -> u64 {
    try_create(device, size, shareable).expect("cuMemCreate")
}

#[track_caller]
fn reserve(size: usize) -> u64 {
    let mut va = 0;
    // SAFETY: out-pointer to a local.
    ok(unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) });
    assert_ne!(va, 0);
    assert_eq!(va % G as u64, 0, "aligned to the granularity");
    va
}

fn map(va: u64, size: usize, h: u64) -> R {
    // SAFETY: no pointer arguments.
    unsafe { sys::cuMemMap(va, size, 0, h, 0) }
}

fn access(va: u64, size: usize, device: i32, flags: sys::CUmemAccess_flags) -> R {
    let desc = sys::CUmemAccessDesc { location: location(device), flags };
    // SAFETY: one descriptor, a local.
    unsafe { sys::cuMemSetAccess(va, size, &desc, 1) }
}

fn get_access(va: u64, device: i32) -> Result<u64, R> {
    let mut flags = 99;
    // SAFETY: out-pointer and location are locals.
    let r = unsafe { sys::cuMemGetAccess(&mut flags, &location(device), va) };
    if r == R::CUDA_SUCCESS { Ok(flags) } else { Err(r) }
}

fn unmap(va: u64, size: usize) -> R {
    // SAFETY: no pointer arguments.
    unsafe { sys::cuMemUnmap(va, size) }
}

fn address_free(va: u64, size: usize) -> R {
    // SAFETY: no pointer arguments.
    unsafe { sys::cuMemAddressFree(va, size) }
}

fn release(h: u64) -> R {
    // SAFETY: no pointer arguments.
    unsafe { sys::cuMemRelease(h) }
}

/// Reserves `size` bytes, maps all of `h` there and grants `device`
/// read-write access.
#[track_caller]
fn map_all(h: u64, size: usize, device: i32) -> u64 {
    let va = reserve(size);
    ok(map(va, size, h));
    ok(access(va, size, device, RW));
    va
}

#[track_caller]
fn unmap_all(va: u64, size: usize, h: u64) {
    ok(unmap(va, size));
    ok(address_free(va, size));
    ok(release(h));
}

fn try_export(h: u64) -> Result<OwnedFd, R> {
    let mut fd: c_int = -1;
    // SAFETY: an int out-value, as the POSIX descriptor type asks.
    let r = unsafe { sys::cuMemExportToShareableHandle((&raw mut fd).cast(), h, POSIX_FD, 0) };
    if r != R::CUDA_SUCCESS {
        return Err(r);
    }
    assert!(fd >= 0);
    // SAFETY: a descriptor the shim just made for this process.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn import_raw(fd: RawFd) -> Result<u64, R> {
    let mut h = 0;
    // SAFETY: out-pointer to a local; the descriptor travels as a pointer
    // value, as the driver API has it.
    let r = unsafe { sys::cuMemImportFromShareableHandle(&mut h, fd as isize as *mut c_void, POSIX_FD) };
    if r == R::CUDA_SUCCESS { Ok(h) } else { Err(r) }
}

fn properties(h: u64) -> Result<sys::CUmemAllocationProp, R> {
    let mut p = prop(0, false);
    // SAFETY: out-pointer to a local.
    let r = unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut p, h) };
    if r == R::CUDA_SUCCESS { Ok(p) } else { Err(r) }
}

fn retain(addr: u64) -> Result<u64, R> {
    let mut h = 0;
    // SAFETY: out-pointer to a local; the address is only looked up.
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut h, addr as *mut c_void) };
    if r == R::CUDA_SUCCESS { Ok(h) } else { Err(r) }
}

fn attr<T: Copy>(a: PA, p: u64, init: T) -> Result<T, R> {
    let mut v = init;
    // SAFETY: `v` is the attribute's type (the caller's choice of T).
    let r = unsafe { sys::cuPointerGetAttribute((&raw mut v).cast(), a, p) };
    if r == R::CUDA_SUCCESS { Ok(v) } else { Err(r) }
}

fn address_range(p: u64) -> Result<(u64, usize), R> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: out-pointers to locals.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, p) };
    if r == R::CUDA_SUCCESS { Ok((base, size)) } else { Err(r) }
}

fn try_htod(dst: u64, src: &[u8]) -> R {
    // SAFETY: `src` is valid for its length.
    unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) }
}

fn try_dtoh(src: u64, n: usize) -> Result<Vec<u8>, R> {
    let mut v = vec![0u8; n];
    // SAFETY: `v` is valid for `n` bytes.
    let r = unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), src, n) };
    if r == R::CUDA_SUCCESS { Ok(v) } else { Err(r) }
}

fn mem_free_bytes() -> usize {
    let (mut free, mut total) = (0, 0);
    // SAFETY: out-pointers to locals.
    ok(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) });
    free
}

fn stream() -> sys::CUstream {
    let mut s = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    ok(unsafe { sys::cuStreamCreate(&mut s, 0) });
    s
}

fn fd_size(fd: &OwnedFd) -> u64 {
    std::fs::File::from(fd.try_clone().expect("dup")).metadata().expect("fstat").len()
}

/// `CUmemAllocationProp` with every field a plain integer, for values the
/// typed enums cannot hold.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawProp {
    type_: u32,
    handle_types: u32,
    location_type: u32,
    location_id: i32,
    win32: *mut c_void,
    flags: [u8; 8],
}

impl RawProp {
    fn valid() -> RawProp {
        RawProp {
            type_: 1,
            handle_types: 0,
            location_type: 1,
            location_id: 0,
            win32: std::ptr::null_mut(),
            flags: [0; 8],
        }
    }
}

/// `CUmemAccessDesc` with plain integers.
#[repr(C)]
struct RawAccess {
    location_type: u32,
    location_id: i32,
    flags: u32,
}

type CreateFn = unsafe extern "C" fn(*mut u64, usize, *const RawProp, u64) -> i32;
type GranularityFn = unsafe extern "C" fn(*mut usize, *const RawProp, u32) -> i32;
type ExportFn = unsafe extern "C" fn(*mut c_void, u64, u32, u64) -> i32;
type ImportFn = unsafe extern "C" fn(*mut u64, *mut c_void, u32) -> i32;
type SetAccessFn = unsafe extern "C" fn(u64, usize, *const RawAccess, usize) -> i32;

/// The shim's export `name` as a function of type `F` (the C signature,
/// with integers for enums).
fn raw_fn<F: Copy>(name: &CStr) -> F {
    let sym = symbol(name);
    assert!(!sym.is_null(), "{name:?} is not exported");
    assert_eq!(size_of::<F>(), size_of::<*mut c_void>());
    // SAFETY: `F` is a function pointer type matching the export's C
    // signature (the caller's choice), the size of a pointer.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&sym) }
}

/// A `SOCK_SEQPACKET` pair (message boundaries kept, descriptors passed
/// with `SCM_RIGHTS`), close-on-exec.
fn socket_pair() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` holds two ints.
    let r = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) };
    assert_eq!(r, 0, "socketpair");
    // SAFETY: two new descriptors owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// One message: a tag of up to 8 bytes, a number, and maybe a descriptor.
fn send(sock: &OwnedFd, tag: &str, value: u64, fd: Option<&OwnedFd>) {
    let mut payload = [0u8; 16];
    payload[..tag.len()].copy_from_slice(tag.as_bytes());
    payload[8..].copy_from_slice(&value.to_ne_bytes());
    let mut control = [0u64; 4];
    // SAFETY: the iovec and control buffer are locals that outlive the
    // call; the control message is built in a buffer big (and aligned)
    // enough for one descriptor.
    unsafe {
        let mut iov = libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() };
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(fd) = fd {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(size_of::<c_int>() as u32) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(size_of::<c_int>() as u32) as _;
            libc::CMSG_DATA(c).cast::<c_int>().write_unaligned(fd.as_raw_fd());
        }
        assert_eq!(libc::sendmsg(sock.as_raw_fd(), &msg, 0), 16, "sendmsg");
    }
}

/// The next message; panics if the peer is gone.
fn recv(sock: &OwnedFd) -> (String, u64, Option<OwnedFd>) {
    let mut payload = [0u8; 16];
    let mut control = [0u64; 4];
    // SAFETY: as in `send`; a received descriptor is new and ours.
    unsafe {
        let mut iov = libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() };
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of_val(&control) as _;
        let n = libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        assert_eq!(n, 16, "recvmsg: the peer is gone ({})", std::io::Error::last_os_error());
        let c = libc::CMSG_FIRSTHDR(&msg);
        let fd = (!c.is_null() && (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS)
            .then(|| OwnedFd::from_raw_fd(libc::CMSG_DATA(c).cast::<c_int>().read_unaligned()));
        let tag = String::from_utf8_lossy(&payload[..8]).trim_end_matches('\0').to_owned();
        (tag, u64::from_ne_bytes(payload[8..].try_into().unwrap()), fd)
    }
}

#[track_caller]
fn expect(sock: &OwnedFd, tag: &str) -> (u64, Option<OwnedFd>) {
    let (got, value, fd) = recv(sock);
    assert_eq!(got, tag, "message");
    (value, fd)
}

/// The descriptor number a "peer" child finds its socket at.
const PEER_SOCKET_FD: RawFd = 100;

/// The child-process entry point: does nothing in a normal run.
#[test]
fn child_entry() {
    let Some(role) = role() else { return };
    assert!(available());
    match role.as_str() {
        "peer" => peer(),
        "delayed" => copies_in_flight(),
        "touch" => {
            use_device(0);
            let h = create(0, G, false);
            let va = map_all(h, G, 0);
            ok(try_htod(va, &[1, 2, 3]));
            // No core file for the expected crash.
            let none = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: a valid rlimit.
            unsafe { libc::setrlimit(libc::RLIMIT_CORE, &none) };
            println!("TOUCHING");
            use std::io::Write as _;
            std::io::stdout().flush().unwrap();
            // SAFETY: deliberately not: the mapped addresses stay
            // PROT_NONE, so this read must kill the process with SIGSEGV.
            let v = unsafe { std::ptr::read_volatile(va as *const u8) };
            println!("READ {v}");
        }
        "before-init" => {
            let mut h = 0;
            let mut va = 0;
            // SAFETY: out-pointers to locals.
            unsafe {
                assert_eq!(sys::cuMemCreate(&mut h, G, &prop(0, true), 0), R::CUDA_ERROR_NOT_INITIALIZED);
                assert_eq!(sys::cuMemAddressReserve(&mut va, G, 0, 0, 0), R::CUDA_ERROR_NOT_INITIALIZED);
                assert_eq!(sys::cuMemRelease(1), R::CUDA_ERROR_NOT_INITIALIZED);
            }
            assert_eq!(import_raw(0), Err(R::CUDA_ERROR_NOT_INITIALIZED));
            no_vmm_left();
        }
        other => panic!("unknown role {other}"),
    }
    println!("CHILD-OK");
}

#[test]
fn create_map_copy_unmap_release() {
    need_shim!();
    let _serial = begin();
    use_device(1);
    let free0 = mem_free_bytes();

    let mut g = 0;
    for option in [
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
    ] {
        // SAFETY: out-pointer and prop are locals.
        ok(unsafe { sys::cuMemGetAllocationGranularity(&mut g, &prop(1, true), option) });
        assert_eq!(g, G);
    }

    let size = 2 * G;
    let h = create(1, size, true);
    assert_eq!(vmm_stats(), OrbiteCudaShimVmmStats { vmm_handles: 1, vmm_bytes: size as u64, ..Default::default() });
    assert_eq!(mem_free_bytes(), free0 - size, "counted against the device's memory");
    let p = properties(h).unwrap();
    assert_eq!(p.type_, sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED);
    assert_eq!((p.location.type_, p.location.id), (location(1).type_, 1));
    assert_eq!(p.requestedHandleTypes, POSIX_FD);

    let va = reserve(2 * size);
    assert_eq!(vmm_stats().vmm_reservations, 1);
    ok(map(va, size, h));
    assert_eq!(vmm_stats().vmm_mappings, 1);
    ok(access(va, size, 1, RW));
    assert_eq!(get_access(va + 77, 1), Ok(RW as u64));
    assert_eq!(get_access(va, 0), Ok(NONE as u64), "access is per device");

    // Fresh memory is zero; bytes go in and come back. `model` is what
    // the allocation should hold.
    let mut model = vec![0u8; size];
    same_bytes(&dtoh(va, size), &model, "fresh memory");
    let n = 3 * G / 2;
    model[100..100 + n].copy_from_slice(&pattern(n, 7));
    htod(va + 100, &model[100..100 + n]);
    same_bytes(&dtoh(va, size), &model, "htod");

    // On a stream, with pinned host memory.
    let st = stream();
    let src = pinned(n);
    let dst = pinned(n);
    src.copy_from_slice(&pattern(n, 8));
    let at = G / 2;
    // SAFETY: device range inside the mapping; pinned buffers of `n` bytes
    // that live until freed below, after the stream synchronized.
    unsafe {
        ok(sys::cuMemcpyHtoDAsync_v2(va + at as u64, src.as_ptr().cast(), n, st));
        ok(sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), va + at as u64, n, st));
        ok(sys::cuStreamSynchronize(st));
    }
    model[at..at + n].copy_from_slice(src);
    same_bytes(dst, src, "async htod then dtoh");

    // Memset, DtoD both ways with cuMemAlloc memory, unified cuMemcpy.
    let d = alloc(4096);
    let mut host = vec![0u8; 64];
    // SAFETY: device ranges inside their allocations; host buffers of the
    // sizes given.
    unsafe {
        ok(sys::cuMemsetD8_v2(va + 10, 0xab, 20));
        model[10..30].fill(0xab);
        ok(sys::cuMemcpyDtoD_v2(d, va, 4096));
        same_bytes(&dtoh(d, 4096), &model[..4096], "dtod from the mapping");
        ok(sys::cuMemcpyDtoD_v2(va + 2 * G as u64 - 4096, d, 4096));
        model.copy_within(..4096, size - 4096);
        ok(sys::cuMemcpy(host.as_mut_ptr() as u64, va + 10, 64));
    }
    same_bytes(&host, &model[10..74], "cuMemcpy");
    same_bytes(&dtoh(va, size), &model, "after every kind of copy");
    free(d);

    // What the pointer queries say: the mapping is the range, of the
    // allocation's device, in no context.
    let mid = va + 12345;
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, mid, 0u32), Ok(2));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, mid, -1i32), Ok(1));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, mid, 0u64), Ok(va));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_RANGE_SIZE, mid, 0usize), Ok(size));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_CONTEXT, mid, 1usize), Ok(0), "VMM memory has no context");
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_DEVICE_POINTER, mid, 0u64), Ok(mid));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_HOST_POINTER, mid, 0u64), Err(R::CUDA_ERROR_INVALID_VALUE));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, mid, 9u32), Ok(0));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_MAPPED, mid, 9u32), Ok(1));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_IS_MANAGED, mid, 9u32), Ok(0));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, mid, 9u64), Ok(POSIX_FD as u64));
    let id = attr(PA::CU_POINTER_ATTRIBUTE_BUFFER_ID, mid, 0u64).unwrap();
    assert_ne!(id, 0);
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_BUFFER_ID, va + size as u64 - 1, 0u64), Ok(id));
    assert_eq!(address_range(mid), Ok((va, size)));
    let (mut ty, mut ordinal, mut start) = (0u32, -1i32, 0u64);
    let mut attrs = [
        PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        PA::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        PA::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
    ];
    let mut data: [*mut c_void; 3] = [(&raw mut ty).cast(), (&raw mut ordinal).cast(), (&raw mut start).cast()];
    // SAFETY: each data pointer points to its attribute's type.
    ok(unsafe { sys::cuPointerGetAttributes(3, attrs.as_mut_ptr(), data.as_mut_ptr(), mid) });
    assert_eq!((ty, ordinal, start), (2, 1, va));

    // The reserved addresses past the mapping are no device memory.
    let beyond = va + size as u64 + 10;
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, beyond, 0u32), Err(R::CUDA_ERROR_INVALID_VALUE));
    assert_eq!(address_range(beyond), Err(R::CUDA_ERROR_NOT_FOUND));
    assert_eq!(try_htod(beyond, &[1]), R::CUDA_ERROR_INVALID_VALUE);

    // Unmapped: the memory stays with the handle, the address is gone.
    ok(unmap(va, size));
    assert_eq!(
        vmm_stats(),
        OrbiteCudaShimVmmStats { vmm_handles: 1, vmm_mappings: 0, vmm_reservations: 1, vmm_bytes: size as u64 }
    );
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, mid, 0u32), Err(R::CUDA_ERROR_INVALID_VALUE));
    // SAFETY: as above.
    ok(unsafe { sys::cuPointerGetAttributes(3, attrs.as_mut_ptr(), data.as_mut_ptr(), mid) });
    assert_eq!((ty, ordinal, start), (0, 0, 0), "unknown to cuPointerGetAttributes");
    assert_eq!(address_range(mid), Err(R::CUDA_ERROR_NOT_FOUND));
    assert_eq!(try_dtoh(mid, 1), Err(R::CUDA_ERROR_INVALID_VALUE));

    // Mapped again, elsewhere: the bytes were kept.
    ok(map(va + size as u64, size, h));
    ok(access(va + size as u64, size, 0, RW));
    same_bytes(&dtoh(va + size as u64, size), &model, "kept across unmap");
    ok(unmap(va + size as u64, size));

    ok(address_free(va, 2 * size));
    assert_eq!(vmm_stats().vmm_reservations, 0);
    ok(release(h));
    assert_eq!(release(h), R::CUDA_ERROR_INVALID_VALUE, "released already");
    assert_eq!(mem_free_bytes(), free0, "the device's memory is back");
    // SAFETY: the stream is idle; the buffers are not used again.
    ok(unsafe { sys::cuStreamDestroy_v2(st) });
    free_pinned(src);
    free_pinned(dst);
    no_vmm_left();
    release_device(1);
}

#[test]
fn copies_need_access() {
    need_shim!();
    let _serial = begin();
    use_device(0);
    let h = create(0, G, false);
    let va = reserve(G);
    ok(map(va, G, h));
    let d = alloc(64);
    let st = stream();
    let buf = [5u8; 64];
    let inaccessible = |what: &str| {
        let mut host = [0u8; 64];
        // SAFETY: device ranges inside their allocations; host buffers of
        // 64 bytes; the stream is live.
        unsafe {
            assert_eq!(try_htod(va, &buf), R::CUDA_ERROR_INVALID_VALUE, "{what}: htod");
            assert_eq!(try_dtoh(va, 64), Err(R::CUDA_ERROR_INVALID_VALUE), "{what}: dtoh");
            assert_eq!(sys::cuMemsetD8_v2(va, 1, 64), R::CUDA_ERROR_INVALID_VALUE, "{what}: memset");
            assert_eq!(sys::cuMemcpyDtoD_v2(d, va, 64), R::CUDA_ERROR_INVALID_VALUE, "{what}: dtod from");
            assert_eq!(sys::cuMemcpyDtoD_v2(va, d, 64), R::CUDA_ERROR_INVALID_VALUE, "{what}: dtod to");
            assert_eq!(
                sys::cuMemcpyHtoDAsync_v2(va, buf.as_ptr().cast(), 64, st),
                R::CUDA_ERROR_INVALID_VALUE,
                "{what}: async htod"
            );
            assert_eq!(
                sys::cuMemcpy(host.as_mut_ptr() as u64, va, 64),
                R::CUDA_ERROR_INVALID_VALUE,
                "{what}: cuMemcpy"
            );
        }
    };
    inaccessible("before cuMemSetAccess");

    // Read-only access: reads, no writes.
    ok(access(va, G, 0, READ));
    assert_eq!(get_access(va, 0), Ok(READ as u64));
    same_bytes(&try_dtoh(va, 64).unwrap(), &[0; 64], "readable");
    assert_eq!(try_htod(va, &buf), R::CUDA_ERROR_INVALID_VALUE, "not writable");
    // SAFETY: a device range inside its mapping.
    assert_eq!(unsafe { sys::cuMemsetD8_v2(va, 1, 64) }, R::CUDA_ERROR_INVALID_VALUE);

    // Both devices at once (any device's access lets the shim copy).
    let both = [
        sys::CUmemAccessDesc { location: location(0), flags: RW },
        sys::CUmemAccessDesc { location: location(1), flags: RW },
    ];
    // SAFETY: two descriptors, a local array.
    ok(unsafe { sys::cuMemSetAccess(va, G, both.as_ptr(), 2) });
    assert_eq!((get_access(va, 0), get_access(va, 1)), (Ok(RW as u64), Ok(RW as u64)));
    ok(try_htod(va, &buf));
    ok(access(va, G, 0, NONE));
    ok(try_htod(va, &buf));
    assert_eq!(get_access(va, 0), Ok(NONE as u64));
    ok(access(va, G, 1, NONE));
    inaccessible("revoked");
    ok(access(va, G, 1, RW));
    same_bytes(&dtoh(va, 64), &buf, "granted again");

    // After unmap the address is no device memory, and no host memory a
    // copy could read either.
    ok(unmap(va, G));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va, 0u32), Err(R::CUDA_ERROR_INVALID_VALUE));
    assert_eq!(try_htod(va, &buf), R::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(get_access(va, 0), Err(R::CUDA_ERROR_INVALID_VALUE));
    // SAFETY: the "host" pointer is reserved address space, which the
    // shim must refuse rather than read; the device pointer is `d`.
    unsafe {
        assert_eq!(sys::cuMemcpyHtoD_v2(d, va as *const c_void, 64), R::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuMemcpy(d, va + 8, 64), R::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuMemHostRegister_v2(va as *mut c_void, 4096, 0), R::CUDA_ERROR_INVALID_VALUE);
    }
    ok(address_free(va, G));
    ok(release(h));
    free(d);
    // SAFETY: the stream is idle.
    ok(unsafe { sys::cuStreamDestroy_v2(st) });
    no_vmm_left();
    release_device(0);
}

#[test]
fn mappings_side_by_side_have_their_own_ranges() {
    need_shim!();
    let _serial = begin();
    use_device(0);
    let h1 = create(0, G, false);
    let h2 = create(0, 2 * G, false);
    let va = reserve(4 * G);
    let second = va + G as u64;
    ok(map(va, G, h1));
    ok(map(second, 2 * G, h2));
    // One cuMemSetAccess over both mappings.
    ok(access(va, 3 * G, 0, RW));
    assert_eq!(vmm_stats().vmm_mappings, 2);

    // Each mapping is its own range; the first never covers the second.
    assert_eq!(address_range(second - 1), Ok((va, G)));
    assert_eq!(address_range(second), Ok((second, 2 * G)));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_RANGE_SIZE, va, 0usize), Ok(G));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, second + 5, 0u64), Ok(second));
    let id1 = attr(PA::CU_POINTER_ATTRIBUTE_BUFFER_ID, va, 0u64).unwrap();
    let id2 = attr(PA::CU_POINTER_ATTRIBUTE_BUFFER_ID, second, 0u64).unwrap();
    assert_ne!(id1, id2, "a buffer id per mapping");
    assert_eq!(retain(second - 1), Ok(h1));
    assert_eq!(retain(second), Ok(h2));
    ok(release(h1));
    ok(release(h2));

    // A copy across the boundary reaches both (the device sees one range).
    let n = 2 * 4096 + 123;
    let across = second - 4096;
    let mut data = pattern(n, 3);
    htod(across, &data);
    same_bytes(&dtoh(across, n), &data, "across the boundary");
    same_bytes(&dtoh(second, n - 4096), &data[4096..], "the second mapping's part");
    // SAFETY: device ranges inside the mappings.
    unsafe {
        ok(sys::cuMemsetD8_v2(second - 10, 0x77, 20));
        ok(sys::cuMemcpyDtoD_v2(va, second - 10, 20));
    }
    data[4096 - 10..4096 + 10].fill(0x77);
    assert_eq!(dtoh(va, 20), vec![0x77; 20]);
    same_bytes(&dtoh(across, n), &data, "after the memset across the boundary");
    // Not into the unmapped rest of the reservation.
    assert_eq!(try_htod(va + 3 * G as u64 - 10, &[0; 20]), R::CUDA_ERROR_INVALID_VALUE);
    // Not through a mapping without access.
    ok(access(va, G, 0, NONE));
    assert_eq!(try_dtoh(across, n), Err(R::CUDA_ERROR_INVALID_VALUE));
    same_bytes(&dtoh(second, n - 4096), &data[4096..], "the second mapping alone");

    // Only one mapping unmapped: the other's range and bytes stay.
    ok(unmap(va, G));
    assert_eq!(address_range(second), Ok((second, 2 * G)));
    assert_eq!(address_range(second - 1), Err(R::CUDA_ERROR_NOT_FOUND));
    ok(unmap(second, 2 * G));

    // Part of an allocation mapped: the mapping is the range.
    ok(map(va + 2 * G as u64, G, h2));
    ok(access(va + 2 * G as u64, G, 0, RW));
    assert_eq!(address_range(va + 2 * G as u64 + 1), Ok((va + 2 * G as u64, G)));
    same_bytes(&dtoh(va + 2 * G as u64, 100), &data[4096..4196], "the allocation's first bytes");
    ok(unmap(va + 2 * G as u64, G));

    ok(address_free(va, 4 * G));
    ok(release(h1));
    ok(release(h2));
    no_vmm_left();
    release_device(0);
}

#[test]
fn a_retained_handle_exports_and_keeps_the_allocation() {
    need_shim!();
    let _serial = begin();
    use_device(0);
    let h = create(0, G, true);
    let va = map_all(h, G, 0);
    htod(va, &pattern(4096, 1));

    // From an interior address: the same handle, one more reference.
    let r = retain(va + 12345).unwrap();
    assert_eq!(r, h);
    assert_eq!(vmm_stats().vmm_handles, 1);
    let fd = try_export(r).unwrap();
    assert_eq!(fd_size(&fd), G as u64);
    // SAFETY: F_GETFD on a descriptor we own.
    assert_ne!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) } & libc::FD_CLOEXEC, 0, "close-on-exec");
    let again = try_export(r).unwrap();
    assert_ne!(again.as_raw_fd(), fd.as_raw_fd(), "a new descriptor per export");

    // No legacy IPC handle for VMM memory.
    let mut ipc = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: out-pointer to a local.
    assert_eq!(unsafe { sys::cuIpcGetMemHandle(&mut ipc, va) }, R::CUDA_ERROR_INVALID_VALUE);
    // Nor is it freed like cuMemAlloc memory.
    // SAFETY: no pointer arguments.
    assert_eq!(unsafe { sys::cuMemFree_v2(va) }, R::CUDA_ERROR_INVALID_VALUE);

    // Released twice (create and retain): the handle is gone, the mapping
    // keeps the memory.
    ok(release(h));
    assert_eq!(vmm_stats().vmm_handles, 1);
    ok(release(r));
    assert_eq!(
        vmm_stats(),
        OrbiteCudaShimVmmStats { vmm_handles: 0, vmm_mappings: 1, vmm_reservations: 1, vmm_bytes: G as u64 }
    );
    for (what, got) in [
        ("release", release(h)),
        ("map", map(va, G, h)),
        ("properties", properties(h).map(drop).err().unwrap_or(R::CUDA_SUCCESS)),
        ("export", try_export(h).map(drop).err().unwrap_or(R::CUDA_SUCCESS)),
    ] {
        assert_eq!(got, R::CUDA_ERROR_INVALID_VALUE, "{what} of a released handle");
    }
    same_bytes(&dtoh(va, 4096), &pattern(4096, 1), "the mapping still reads");
    // The exported descriptor still names the memory: import it.
    let imported = import_raw(fd.as_raw_fd()).unwrap();
    assert_ne!(imported, h);
    // Retained again from the address: the same handle value comes back.
    assert_eq!(retain(va), Ok(h));
    assert_eq!(vmm_stats().vmm_handles, 2);

    ok(unmap(va, G));
    ok(address_free(va, G));
    assert_eq!(vmm_stats().vmm_bytes, 2 * G as u64, "the handle and the import keep it");
    ok(release(h));
    assert_eq!(vmm_stats().vmm_bytes, G as u64);
    let va2 = map_all(imported, G, 0);
    same_bytes(&dtoh(va2, 4096), &pattern(4096, 1), "through the import");
    unmap_all(va2, G, imported);
    drop((fd, again));
    no_vmm_left();
    release_device(0);
}

/// The other process: imports the parent's allocation (device 1), reads
/// and writes it; exports one of its own (device 0) and reads what the
/// parent wrote there.
fn peer() {
    use_device(0);
    let raw: RawFd = std::env::var("PEER_SOCKET").expect("PEER_SOCKET").parse().expect("a descriptor number");
    // SAFETY: the parent passed this descriptor to us alone.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    let (size, fd) = expect(&sock, "ALLOC");
    let size = size as usize;
    let fd = fd.expect("a descriptor");
    let h = import_raw(fd.as_raw_fd()).unwrap();
    drop(fd);
    let p = properties(h).unwrap();
    assert_eq!((p.location.id, p.requestedHandleTypes), (1, POSIX_FD), "the exporter's device");
    let va = reserve(size);
    ok(map(va, size, h));
    assert_eq!(try_dtoh(va, 1), Err(R::CUDA_ERROR_INVALID_VALUE), "no access yet");
    ok(access(va, size, 1, RW));
    assert_eq!(attr(PA::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, va, -1i32), Ok(1));
    same_bytes(&dtoh(va, size), &pattern(size, 1), "the parent's bytes");
    htod(va, &pattern(size, 2));
    // An import exports again.
    assert_eq!(fd_size(&try_export(h).unwrap()), size as u64);
    ok(unmap(va, size));
    ok(address_free(va, size));
    ok(release(h));

    let own = create(0, G, true);
    let vb = map_all(own, G, 0);
    htod(vb, &pattern(G, 3));
    send(&sock, "MINE", G as u64, Some(&try_export(own).unwrap()));
    expect(&sock, "WROTE");
    same_bytes(&dtoh(vb, G), &pattern(G, 4), "the parent's bytes in ours");
    unmap_all(vb, G, own);
    no_vmm_left();
    send(&sock, "DONE", 0, None);
}

#[test]
fn shareable_handles_cross_processes() {
    need_shim!();
    let _serial = begin();
    use_device(0);
    let size = 2 * G;
    let a = create(1, size, true);
    let va = map_all(a, size, 1);
    htod(va, &pattern(size, 1));

    let (ours, theirs) = socket_pair();
    let mut cmd = child("child_entry", "peer", &[("PEER_SOCKET", &PEER_SOCKET_FD.to_string())]);
    let passed = theirs.as_raw_fd();
    // SAFETY: only dup2 / fcntl, async-signal-safe, run between fork and
    // exec: the child gets the socket at PEER_SOCKET_FD without
    // close-on-exec (every other process started meanwhile does not).
    unsafe {
        cmd.pre_exec(move || {
            let r = if passed == PEER_SOCKET_FD {
                libc::fcntl(passed, libc::F_SETFD, 0)
            } else {
                libc::dup2(passed, PEER_SOCKET_FD)
            };
            if r < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
        });
    }
    let peer = cmd.stdout(std::process::Stdio::piped()).spawn().expect("spawn the peer");
    drop(theirs);

    let fd = try_export(a).unwrap();
    send(&ours, "ALLOC", size as u64, Some(&fd));
    drop(fd);
    let (their_size, their_fd) = expect(&ours, "MINE");
    same_bytes(&dtoh(va, size), &pattern(size, 2), "the peer's bytes in ours");

    let their_fd = their_fd.expect("a descriptor");
    let b = import_raw(their_fd.as_raw_fd()).unwrap();
    drop(their_fd);
    assert_eq!(properties(b).unwrap().location.id, 0);
    let their_size = their_size as usize;
    let vb = map_all(b, their_size, 0);
    same_bytes(&dtoh(vb, their_size), &pattern(their_size, 3), "the peer's allocation");
    htod(vb, &pattern(their_size, 4));
    send(&ours, "WROTE", 0, None);
    expect(&ours, "DONE");

    // The peer unmapped and released its import of ours, then exited:
    // ours is intact; its allocation lives on in our import.
    same_bytes(&dtoh(va, size), &pattern(size, 2), "ours after the peer released its import");
    let out = peer.wait_with_output().expect("wait for the peer");
    assert!(out.status.success(), "peer: {}", out.status);
    assert!(String::from_utf8_lossy(&out.stdout).contains("CHILD-OK"));
    same_bytes(&dtoh(vb, their_size), &pattern(their_size, 4), "the peer's allocation after it exited");
    assert_eq!(vmm_stats().vmm_bytes, (size + their_size) as u64);
    unmap_all(vb, their_size, b);
    unmap_all(va, size, a);
    no_vmm_left();
    release_device(0);
}

/// A memfd named `name` of `size` bytes, sealed against resizing if `seal`.
fn memfd(name: &CStr, size: u64, seal: bool) -> OwnedFd {
    // SAFETY: a NUL-terminated name; the new descriptor is ours.
    let fd = unsafe {
        let raw = libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
        assert!(raw >= 0, "memfd_create");
        OwnedFd::from_raw_fd(raw)
    };
    std::fs::File::from(fd.try_clone().unwrap()).set_len(size).unwrap();
    if seal {
        // SAFETY: a memfd made with MFD_ALLOW_SEALING.
        assert_eq!(
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) },
            0
        );
    }
    fd
}

#[test]
fn imports_refuse_what_the_shim_did_not_export() {
    need_shim!();
    let _serial = begin();
    use_device(0);
    let invalid = Err(R::CUDA_ERROR_INVALID_VALUE);

    let path = std::env::temp_dir().join(format!("orbite-cuda-shim-vmm-{}", std::process::id()));
    let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    file.set_len(G as u64).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(import_raw(file.as_raw_fd()), invalid, "a regular file");
    let null = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null").unwrap();
    assert_eq!(import_raw(null.as_raw_fd()), invalid, "a character device");
    let mut pipe = [0; 2];
    // SAFETY: `pipe` holds two ints.
    assert_eq!(unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: two new descriptors, ours.
    let pipe = unsafe { [OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])] };
    assert_eq!(import_raw(pipe[0].as_raw_fd()), invalid, "a pipe");
    assert_eq!(import_raw(pipe[1].as_raw_fd()), invalid, "a pipe");
    let (s1, _s2) = socket_pair();
    assert_eq!(import_raw(s1.as_raw_fd()), invalid, "a socket");
    assert_eq!(import_raw(memfd(c"plain", G as u64, true).as_raw_fd()), invalid, "a memfd of another name");
    let forged = c"orbite-cuda-shim-vmm-d0-0123456789abcdef-1";
    assert_eq!(import_raw(memfd(forged, G as u64, false).as_raw_fd()), invalid, "not sealed");
    assert_eq!(import_raw(memfd(forged, G as u64 + 4096, true).as_raw_fd()), invalid, "no multiple of the granularity");
    assert_eq!(import_raw(memfd(forged, 0, true).as_raw_fd()), invalid, "empty");
    let elsewhere = c"orbite-cuda-shim-vmm-d7-0123456789abcdef-1";
    assert_eq!(
        import_raw(memfd(elsewhere, G as u64, true).as_raw_fd()),
        Err(R::CUDA_ERROR_INVALID_DEVICE),
        "a device this process does not have"
    );
    assert_eq!(import_raw(-1), invalid, "-1");
    assert_eq!(import_raw(i32::MAX), invalid, "no such descriptor");
    let closed = pipe[1].as_raw_fd();
    drop(pipe);
    assert_eq!(import_raw(closed), invalid, "a closed descriptor");
    let import: ImportFn = raw_fn(c"cuMemImportFromShareableHandle");
    let mut h = 0;
    // SAFETY: the shim's import with integer arguments; out-pointer to a local.
    unsafe {
        assert_eq!(import(&mut h, (1usize << 40) as *mut c_void, 1), R::CUDA_ERROR_INVALID_VALUE as i32);
        assert_eq!(import(std::ptr::null_mut(), s1.as_raw_fd() as usize as *mut c_void, 1), 1, "null out");
        assert_eq!(import(&mut h, file.as_raw_fd() as usize as *mut c_void, 0), 1, "handle type NONE");
        assert_eq!(import(&mut h, file.as_raw_fd() as usize as *mut c_void, 2), 801, "Win32");
        assert_eq!(import(&mut h, file.as_raw_fd() as usize as *mut c_void, 8), 801, "fabric");
    }
    assert_eq!(vmm_stats(), OrbiteCudaShimVmmStats::default(), "nothing was imported");

    // Exports: only of allocations made to be shared, as POSIX descriptors.
    let private = create(0, G, false);
    assert_eq!(
        try_export(private).err(),
        Some(R::CUDA_ERROR_INVALID_VALUE),
        "made without POSIX descriptors requested"
    );
    assert_eq!(properties(private).unwrap().requestedHandleTypes as u32, 0);
    ok(release(private));
    let shared = create(0, G, true);
    let export: ExportFn = raw_fn(c"cuMemExportToShareableHandle");
    let mut out: c_int = -1;
    // SAFETY: the shim's export with integer arguments; out-pointer to a local int.
    unsafe {
        let out = (&raw mut out).cast::<c_void>();
        assert_eq!(export(out, shared, 0, 0), 1, "handle type NONE");
        assert_eq!(export(out, shared, 2, 0), 801, "Win32");
        assert_eq!(export(out, shared, 8, 0), 801, "fabric");
        assert_eq!(export(out, shared, 1, 1), 1, "flags");
        assert_eq!(export(std::ptr::null_mut(), shared, 1, 0), 1, "null");
        assert_eq!(export(out, 0x1234, 1, 0), 1, "no such handle");
    }
    assert_eq!(out, -1, "nothing written");

    // A read-only reopening of an exported descriptor is refused; the
    // descriptor itself imports, also in the exporting process, as a
    // handle of its own.
    let fd = try_export(shared).unwrap();
    let reopened = std::fs::File::open(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    assert_eq!(import_raw(reopened.as_raw_fd()), invalid, "read-only");
    let again = import_raw(fd.as_raw_fd()).unwrap();
    assert_ne!(again, shared);
    drop(fd);
    assert_eq!(vmm_stats().vmm_handles, 2);
    let va = map_all(shared, G, 0);
    let vb = map_all(again, G, 0);
    htod(va + 5, &pattern(1000, 9));
    same_bytes(&dtoh(vb + 5, 1000), &pattern(1000, 9), "one memory, two handles");
    unmap_all(va, G, shared);
    same_bytes(&dtoh(vb + 5, 1000), &pattern(1000, 9), "the import outlives the original");
    unmap_all(vb, G, again);
    no_vmm_left();
    release_device(0);
}

#[test]
fn invalid_arguments_are_refused() {
    need_shim!();
    let _serial = begin();
    use_device(0);
    let inval = R::CUDA_ERROR_INVALID_VALUE;
    let err = |r: Result<u64, R>| r.err().unwrap_or(R::CUDA_SUCCESS);

    // Granularity.
    let granularity: GranularityFn = raw_fn(c"cuMemGetAllocationGranularity");
    let mut g = 0usize;
    // SAFETY: the shim's export with integer arguments; locals.
    unsafe {
        let valid = RawProp::valid();
        assert_eq!(granularity(&mut g, &valid, 0), 0);
        assert_eq!(g, G);
        assert_eq!(granularity(std::ptr::null_mut(), &valid, 0), 1, "null out");
        assert_eq!(granularity(&mut g, std::ptr::null(), 0), 1, "null prop");
        assert_eq!(granularity(&mut g, &valid, 2), 1, "option");
        assert_eq!(granularity(&mut g, &RawProp { type_: 0, ..valid }, 0), 1, "type INVALID");
        assert_eq!(granularity(&mut g, &RawProp { type_: 2, ..valid }, 0), 1, "type MANAGED");
        assert_eq!(granularity(&mut g, &RawProp { location_type: 2, ..valid }, 0), 1, "host location");
        assert_eq!(granularity(&mut g, &RawProp { location_id: 2, ..valid }, 0), 101, "device 2 of 2");
        assert_eq!(granularity(&mut g, &RawProp { location_id: -1, ..valid }, 0), 101, "device -1");
        assert_eq!(granularity(&mut g, &RawProp { handle_types: 3, ..valid }, 0), 801, "Win32 handles");
    }

    // cuMemCreate.
    let create_raw: CreateFn = raw_fn(c"cuMemCreate");
    let mut h = 0u64;
    // SAFETY: as above.
    unsafe {
        let valid = RawProp::valid();
        assert_eq!(create_raw(std::ptr::null_mut(), G, &valid, 0), 1, "null handle");
        assert_eq!(create_raw(&mut h, G, std::ptr::null(), 0), 1, "null prop");
        assert_eq!(create_raw(&mut h, G, &valid, 1), 1, "flags");
        assert_eq!(create_raw(&mut h, G, &RawProp { handle_types: 8, ..valid }, 0), 801, "fabric handles");
        assert_eq!(create_raw(&mut h, G, &RawProp { handle_types: 2, ..valid }, 0), 801, "Win32 handles");
        assert_eq!(create_raw(&mut h, G, &RawProp { location_id: 9, ..valid }, 0), 101, "device 9");
        assert_eq!(create_raw(&mut h, G, &RawProp { type_: 0, ..valid }, 0), 1, "type INVALID");
    }
    for size in [0, 4096, G / 2, G + 1, G + 4096] {
        assert_eq!(try_create(0, size, true), Err(inval), "size {size}");
    }
    assert_eq!(try_create(0, (16 << 30) + G, false), Err(R::CUDA_ERROR_OUT_OF_MEMORY), "past the device's memory");
    assert_eq!(vmm_stats(), OrbiteCudaShimVmmStats::default(), "nothing was made");

    // cuMemAddressReserve.
    let mut va = 0u64;
    // SAFETY: out-pointer to a local.
    unsafe {
        assert_eq!(sys::cuMemAddressReserve(std::ptr::null_mut(), G, 0, 0, 0), inval, "null");
        for size in [0, 4096, G + 4096] {
            assert_eq!(sys::cuMemAddressReserve(&mut va, size, 0, 0, 0), inval, "size {size}");
        }
        assert_eq!(sys::cuMemAddressReserve(&mut va, G, 3 * G, 0, 0), inval, "alignment not a power of two");
        assert_eq!(sys::cuMemAddressReserve(&mut va, G, 0, 0, 1), inval, "flags");
        // A larger power of two is honoured; a smaller one means the
        // granularity; the address hint is only a hint.
        ok(sys::cuMemAddressReserve(&mut va, G, 8 * G, 0, 0));
        assert_eq!(va % (8 * G) as u64, 0);
        ok(sys::cuMemAddressFree(va, G));
        ok(sys::cuMemAddressReserve(&mut va, G, 4096, 0x1234_0000_0000, 0));
        assert_eq!(va % G as u64, 0);
        ok(sys::cuMemAddressFree(va, G));
    }
    assert_eq!(vmm_stats().vmm_reservations, 0);

    // cuMemMap.
    let h = create(0, 2 * G, false);
    let other = create(0, G, false);
    let va = reserve(4 * G);
    // SAFETY: no pointer arguments.
    unsafe {
        assert_eq!(sys::cuMemMap(va, G, G, h, 0), inval, "offset");
        assert_eq!(sys::cuMemMap(va, G, 4096, h, 0), inval, "offset");
        assert_eq!(sys::cuMemMap(va, G, 0, h, 1), inval, "flags");
    }
    assert_eq!(map(va, 0, h), inval, "size 0");
    assert_eq!(map(va, G / 2, h), inval, "size not a multiple");
    assert_eq!(map(va, 3 * G, h), inval, "larger than the allocation");
    assert_eq!(map(va + 4096, G, h), inval, "misaligned address");
    assert_eq!(map(va + 3 * G as u64, 2 * G, h), inval, "past the reservation's end");
    assert_eq!(map(va - G as u64, 2 * G, h), inval, "before the reservation");
    assert_eq!(map(0x4000_0000_0000, G, h), inval, "no reservation");
    let d = alloc(4096);
    assert_eq!(map(d & !(G as u64 - 1), G, h), inval, "cuMemAlloc memory is no reservation");
    assert_eq!(map(va, G, 0), inval, "handle 0");
    assert_eq!(map(va, G, 0x1234), inval, "no such handle");
    assert_eq!(map(va, G, va), inval, "an address is no handle");
    assert_eq!(map(u64::MAX - G as u64 + 1, G, h), inval, "at the end of the address space");
    ok(map(va + G as u64, 2 * G, h));
    assert_eq!(map(va, 2 * G, other), inval, "overlapping the mapping's start");
    assert_eq!(map(va + 2 * G as u64, G, other), inval, "inside the mapping");
    assert_eq!(map(va + G as u64, G, other), inval, "at the mapping");
    ok(map(va, G, other));
    assert_eq!(vmm_stats().vmm_mappings, 2);

    // cuMemSetAccess.
    let set_access: SetAccessFn = raw_fn(c"cuMemSetAccess");
    // SAFETY: the shim's export with integer arguments; local descriptors.
    unsafe {
        let desc = |location_type, location_id, flags| RawAccess { location_type, location_id, flags };
        assert_eq!(set_access(va, 3 * G, std::ptr::null(), 1), 1, "null desc");
        assert_eq!(set_access(va, 3 * G, &desc(1, 0, 3), 0), 1, "count 0");
        assert_eq!(set_access(va, 3 * G, &desc(1, 0, 3), 65), 1, "count past the devices");
        assert_eq!(set_access(va, 3 * G, &desc(0, 0, 3), 1), 1, "location INVALID");
        assert_eq!(set_access(va, 3 * G, &desc(2, 0, 3), 1), 1, "host location");
        assert_eq!(set_access(va, 3 * G, &desc(1, 5, 3), 1), 101, "device 5");
        assert_eq!(set_access(va, 3 * G, &desc(1, 0, 2), 1), 1, "flags 2");
        let mixed = [desc(1, 0, 3), desc(1, 1, 7)];
        assert_eq!(set_access(va, 3 * G, mixed.as_ptr(), 2), 1, "one bad descriptor of two");
    }
    assert_eq!(get_access(va, 0), Ok(0), "nothing applied");
    assert_eq!(access(va, 0, 0, RW), inval, "size 0");
    assert_eq!(access(va, G / 2, 0, RW), inval, "part of a mapping");
    assert_eq!(access(va, 2 * G, 0, RW), inval, "part of the second mapping");
    assert_eq!(access(va + G as u64, G, 0, RW), inval, "part of the second mapping");
    assert_eq!(access(va, 4 * G, 0, RW), inval, "past the mappings");
    assert_eq!(access(va + 3 * G as u64, G, 0, RW), inval, "reserved, not mapped");
    assert_eq!(access(d, 4096, 0, RW), inval, "cuMemAlloc memory");
    assert_eq!(get_access(va, 0), Ok(0), "nothing applied");
    // SAFETY: null out-pointer / location, refused before use.
    unsafe {
        assert_eq!(sys::cuMemGetAccess(std::ptr::null_mut(), &location(0), va), inval);
        let mut f = 0;
        assert_eq!(sys::cuMemGetAccess(&mut f, std::ptr::null(), va), inval);
        assert_eq!(sys::cuMemGetAccess(&mut f, &location(7), va), R::CUDA_ERROR_INVALID_DEVICE);
    }
    assert_eq!(get_access(d, 0), Err(inval), "cuMemAlloc memory");

    // cuMemUnmap.
    assert_eq!(unmap(va, 0), inval, "size 0");
    assert_eq!(unmap(va, G / 2), inval, "part of a mapping");
    assert_eq!(unmap(va, 2 * G), inval, "a mapping and part of the next");
    assert_eq!(unmap(va + G as u64, G), inval, "the first half of a mapping");
    assert_eq!(unmap(va + 2 * G as u64, G), inval, "the second half of a mapping");
    assert_eq!(unmap(va, 4 * G), inval, "past the mappings");
    assert_eq!(unmap(va + 3 * G as u64, G), inval, "reserved, not mapped");
    assert_eq!(unmap(d, 4096), inval, "cuMemAlloc memory");
    assert_eq!(unmap(u64::MAX - 10, 4096), inval, "wrapping");

    // cuMemAddressFree.
    assert_eq!(address_free(va, 4 * G), inval, "mappings inside");
    assert_eq!(address_free(va, 2 * G), inval, "not the reservation's size");
    assert_eq!(address_free(va + G as u64, 3 * G), inval, "not the reservation's start");
    assert_eq!(address_free(0x4000_0000_0000, G), inval, "no reservation");

    // cuMemRetainAllocationHandle and properties.
    let local = 0u8;
    assert_eq!(err(retain((&raw const local) as u64)), inval, "host memory");
    assert_eq!(err(retain(d)), inval, "cuMemAlloc memory");
    assert_eq!(err(retain(va + 3 * G as u64)), inval, "reserved, not mapped");
    // SAFETY: null out-pointers, refused before use.
    unsafe {
        assert_eq!(sys::cuMemRetainAllocationHandle(std::ptr::null_mut(), va as *mut c_void), inval);
        assert_eq!(sys::cuMemGetAllocationPropertiesFromHandle(std::ptr::null_mut(), h), inval);
    }
    assert_eq!(err(properties(0x1234).map(|_| 0)), inval, "no such handle");

    // Undo it all: unmapping both mappings at once, then stale handles.
    ok(unmap(va, 3 * G));
    ok(address_free(va, 4 * G));
    assert_eq!(address_free(va, 4 * G), inval, "freed already");
    ok(release(h));
    ok(release(other));
    assert_eq!(map(va, G, h), inval, "a released handle");
    assert_eq!(release(other), inval, "released already");
    assert_eq!(release(0), inval, "handle 0");
    free(d);
    no_vmm_left();
    release_device(0);
}

/// With every asynchronous copy delayed, unmapping and releasing while
/// copies are queued leaves them their memory.
fn copies_in_flight() {
    use_device(0);
    let h1 = create(0, G, false);
    let h2 = create(0, G, false);
    let va = reserve(2 * G);
    ok(map(va, G, h1));
    ok(map(va + G as u64, G, h2));
    ok(access(va, 2 * G, 0, RW));
    let n = 8192;
    let across = va + G as u64 - 4096;
    htod(across, &pattern(n, 5));
    let st = stream();
    let one = pinned(n);
    let joined = pinned(n);
    let src = pinned(n);
    src.copy_from_slice(&pattern(n, 6));
    // SAFETY: device ranges inside the mappings; pinned buffers that stay
    // until freed below, after the stream synchronized.
    unsafe {
        ok(sys::cuMemcpyDtoHAsync_v2(one.as_mut_ptr().cast(), va + G as u64, n, st));
        ok(sys::cuMemcpyDtoHAsync_v2(joined.as_mut_ptr().cast(), across, n, st));
        ok(sys::cuMemcpyHtoDAsync_v2(va, src.as_ptr().cast(), n, st));
        assert_eq!(sys::cuStreamQuery(st), R::CUDA_ERROR_NOT_READY, "the copies are queued");
    }
    ok(unmap(va, 2 * G));
    ok(address_free(va, 2 * G));
    ok(release(h1));
    ok(release(h2));
    assert_eq!(
        vmm_stats(),
        OrbiteCudaShimVmmStats { vmm_bytes: 2 * G as u64, ..Default::default() },
        "the queued copies hold the memory"
    );
    // SAFETY: the stream is live.
    ok(unsafe { sys::cuStreamSynchronize(st) });
    same_bytes(one, &pattern(n, 5)[4096..].iter().chain(&[0; 4096]).copied().collect::<Vec<u8>>(), "one mapping");
    same_bytes(joined, &pattern(n, 5), "across two mappings");
    no_vmm_left();
    // SAFETY: the stream is idle; the buffers are not used again.
    ok(unsafe { sys::cuStreamDestroy_v2(st) });
    free_pinned(one);
    free_pinned(joined);
    free_pinned(src);
}

#[test]
fn queued_copies_survive_unmap_and_release() {
    need_shim!();
    let out = run_child("child_entry", "delayed", &[("ORBITE_CUDA_SHIM_COPY_DELAY_US", "200000")]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("CHILD-OK"));
}

#[test]
fn mapped_addresses_fault_on_direct_access() {
    need_shim!();
    let out = child("child_entry", "touch", &[]).output().expect("spawn");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("TOUCHING"),
        "child did not reach the read: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stdout.contains("READ"), "the read succeeded");
    assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "child: {}", out.status);
}

#[test]
fn vmm_calls_need_cuinit() {
    need_shim!();
    let out = run_child("child_entry", "before-init", &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("CHILD-OK"));
}
