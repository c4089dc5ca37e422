//! Device, pinned and registered memory; pointer attributes; device memory
//! that the process itself cannot touch.

mod common;

use std::ffi::c_void;
use std::os::unix::process::ExitStatusExt;

use common::*;
use sys::CUpointer_attribute as PA;

fn attr_u32(a: PA, p: u64) -> Result<u32, CUresult> {
    let mut v = 0xdead_beef_u32;
    // SAFETY: `v` is the attribute's type (unsigned int).
    let r = unsafe { sys::cuPointerGetAttribute((&raw mut v).cast(), a, p) };
    if r == CUresult::CUDA_SUCCESS { Ok(v) } else { Err(r) }
}

fn attr_u64(a: PA, p: u64) -> Result<u64, CUresult> {
    let mut v = 0xdead_beef_u64;
    // SAFETY: `v` is the attribute's 8-byte type (pointer, size_t, u64).
    let r = unsafe { sys::cuPointerGetAttribute((&raw mut v).cast(), a, p) };
    if r == CUresult::CUDA_SUCCESS { Ok(v) } else { Err(r) }
}

fn attr_i32(a: PA, p: u64) -> Result<i32, CUresult> {
    let mut v = -7;
    // SAFETY: `v` is the attribute's type (int).
    let r = unsafe { sys::cuPointerGetAttribute((&raw mut v).cast(), a, p) };
    if r == CUresult::CUDA_SUCCESS { Ok(v) } else { Err(r) }
}

/// The child-process entry point: does nothing in a normal run.
#[test]
fn child_entry() {
    let Some(role) = role() else { return };
    assert!(available());
    match role.as_str() {
        "touch" => {
            use_device(0);
            let p = alloc(4096);
            htod(p, &[1, 2, 3]);
            // No core file for the expected crash.
            let none = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: a valid rlimit.
            unsafe { libc::setrlimit(libc::RLIMIT_CORE, &none) };
            println!("TOUCHING");
            use std::io::Write as _;
            std::io::stdout().flush().unwrap();
            // SAFETY: deliberately not: the shim maps device memory
            // PROT_NONE, so this read must kill the process with SIGSEGV.
            let v = unsafe { std::ptr::read_volatile(p as *const u8) };
            println!("READ {v}");
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn reading_device_memory_directly_faults() {
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
fn system_calls_on_device_memory_fail_with_efault() {
    need_shim!();
    use_device(0);
    let p = alloc(8192);
    htod(p, &[9; 8192]);
    // SAFETY: the iovecs point at a local buffer and at the device pointer;
    // the kernel checks the latter and must refuse it.
    unsafe {
        let mut buf = [0u8; 64];
        let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        let remote = libc::iovec { iov_base: p as *mut c_void, iov_len: buf.len() };
        let n = libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0);
        assert_eq!(n, -1);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EFAULT));

        let mut fds = [0; 2];
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        let n = libc::write(fds[1], p as *const c_void, 64);
        assert_eq!(n, -1);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EFAULT));
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    same_bytes(&dtoh(p, 8192), &[9; 8192], "the shim's own copies still see the bytes");
    free(p);
}

#[test]
fn allocations_need_a_current_context() {
    need_shim!();
    init();
    std::thread::spawn(|| {
        let mut p = 0;
        let mut h = std::ptr::null_mut();
        // SAFETY: out-pointers to locals.
        unsafe {
            assert_eq!(sys::cuMemAlloc_v2(&mut p, 64), CUresult::CUDA_ERROR_INVALID_CONTEXT);
            assert_eq!(sys::cuMemHostAlloc(&mut h, 64, 0), CUresult::CUDA_ERROR_INVALID_CONTEXT);
            let b = [0u8; 4];
            assert_eq!(sys::cuMemcpyHtoD_v2(0x1000, b.as_ptr().cast(), 4), CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
    })
    .join()
    .unwrap();
}

#[test]
fn device_allocation_attributes() {
    need_shim!();
    let ctx = use_device(1);
    let n = 10_000;
    let p = alloc(n);
    let q = alloc(100);
    assert_ne!(p, q);
    let mid = p + 1234;
    assert_eq!(attr_u32(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, mid), Ok(2));
    assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_CONTEXT, mid), Ok(ctx as u64));
    assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_DEVICE_POINTER, mid), Ok(mid));
    assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_HOST_POINTER, mid), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
    assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, mid), Ok(p));
    assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_RANGE_SIZE, mid), Ok(n as u64));
    assert_eq!(attr_i32(PA::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, mid), Ok(1));
    assert_eq!(attr_u32(PA::CU_POINTER_ATTRIBUTE_IS_MANAGED, mid), Ok(0));
    assert_eq!(attr_u32(PA::CU_POINTER_ATTRIBUTE_MAPPED, mid), Ok(1));
    assert_eq!(attr_u32(PA::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, mid), Ok(0));
    let id_p = attr_u64(PA::CU_POINTER_ATTRIBUTE_BUFFER_ID, p).unwrap();
    let id_q = attr_u64(PA::CU_POINTER_ATTRIBUTE_BUFFER_ID, q).unwrap();
    assert_ne!(id_p, id_q);
    assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_BUFFER_ID, p + n as u64 - 1), Ok(id_p));
    // One past the end is not in the allocation.
    assert_eq!(
        attr_u64(PA::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p + n as u64),
        Err(CUresult::CUDA_ERROR_INVALID_VALUE)
    );
    assert_eq!(
        attr_u64(PA::CU_POINTER_ATTRIBUTE_P2P_TOKENS, p).err(),
        Some(CUresult::CUDA_ERROR_NOT_SUPPORTED),
        "attributes the shim does not model"
    );

    // SYNC_MEMOPS is recorded.
    let one = 1u32;
    // SAFETY: the attribute's value is an unsigned int.
    ok(unsafe { sys::cuPointerSetAttribute((&raw const one).cast(), PA::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, mid) });
    assert_eq!(attr_u32(PA::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, p), Ok(1));

    // cuMemGetAddressRange.
    let (mut base, mut size) = (0, 0);
    // SAFETY: out-pointers to locals.
    unsafe {
        ok(sys::cuMemGetAddressRange_v2(&mut base, &mut size, mid));
        assert_eq!((base, size), (p, n));
        ok(sys::cuMemGetAddressRange_v2(std::ptr::null_mut(), &mut size, q));
        assert_eq!(size, 100);
        let local = 0u8;
        assert_eq!(
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, (&raw const local) as u64),
            CUresult::CUDA_ERROR_NOT_FOUND
        );
    }

    // All at once.
    let mut ty = 0u32;
    let mut dctx: sys::CUcontext = std::ptr::null_mut();
    let mut ordinal = -1i32;
    let mut start = 0u64;
    let mut host: *mut c_void = std::ptr::dangling_mut();
    let mut attrs = [
        PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        PA::CU_POINTER_ATTRIBUTE_CONTEXT,
        PA::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        PA::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        PA::CU_POINTER_ATTRIBUTE_HOST_POINTER,
    ];
    let mut data: [*mut c_void; 5] = [
        (&raw mut ty).cast(),
        (&raw mut dctx).cast(),
        (&raw mut ordinal).cast(),
        (&raw mut start).cast(),
        (&raw mut host).cast(),
    ];
    // SAFETY: each data pointer points to its attribute's type.
    ok(unsafe { sys::cuPointerGetAttributes(5, attrs.as_mut_ptr(), data.as_mut_ptr(), mid) });
    assert_eq!((ty, dctx, ordinal, start, host), (2, ctx, 1, p, std::ptr::null_mut()));

    // Freed: unknown.
    free(p);
    assert_eq!(attr_u32(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, mid), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
    // SAFETY: as above.
    ok(unsafe { sys::cuPointerGetAttributes(5, attrs.as_mut_ptr(), data.as_mut_ptr(), mid) });
    assert_eq!((ty, dctx, ordinal, start, host), (0, std::ptr::null_mut(), 0, 0, std::ptr::null_mut()));
    // SAFETY: no pointer arguments.
    unsafe {
        assert_eq!(sys::cuMemFree_v2(p), CUresult::CUDA_ERROR_INVALID_VALUE, "double free");
        assert_eq!(sys::cuMemFree_v2(q + 1), CUresult::CUDA_ERROR_INVALID_VALUE, "not the base");
        let mut z = 0;
        assert_eq!(sys::cuMemAlloc_v2(&mut z, 0), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    free(q);
}

#[test]
fn unknown_pointers() {
    need_shim!();
    init();
    let local = [0u8; 16];
    let p = local.as_ptr() as u64;
    assert_eq!(attr_u32(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
    assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_CONTEXT, 0), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
    let mut ty = 9u32;
    let mut managed = 9u32;
    let mut id = 9u64;
    let mut attrs =
        [PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, PA::CU_POINTER_ATTRIBUTE_IS_MANAGED, PA::CU_POINTER_ATTRIBUTE_BUFFER_ID];
    let mut data: [*mut c_void; 3] = [(&raw mut ty).cast(), (&raw mut managed).cast(), (&raw mut id).cast()];
    // SAFETY: each data pointer points to its attribute's type.
    ok(unsafe { sys::cuPointerGetAttributes(3, attrs.as_mut_ptr(), data.as_mut_ptr(), p) });
    assert_eq!((ty, managed, id), (0, 0, 0));
}

#[test]
fn pinned_and_registered_host_memory() {
    need_shim!();
    let ctx = use_device(0);
    // SAFETY: out-pointers to locals; the host memory is used within its
    // bounds.
    unsafe {
        let mut h: *mut c_void = std::ptr::null_mut();
        ok(sys::cuMemHostAlloc(&mut h, 5000, 0x2));
        let hp = h as u64;
        std::ptr::write_bytes(h.cast::<u8>(), 0xab, 5000);
        assert_eq!(attr_u32(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, hp + 10), Ok(1));
        assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_HOST_POINTER, hp + 10), Ok(hp + 10));
        assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_DEVICE_POINTER, hp + 10), Ok(hp + 10));
        assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_CONTEXT, hp), Ok(ctx as u64));
        assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_RANGE_SIZE, hp), Ok(5000));
        assert_eq!(attr_u32(PA::CU_POINTER_ATTRIBUTE_MAPPED, hp), Ok(1));
        let mut dp = 0;
        ok(sys::cuMemHostGetDevicePointer_v2(&mut dp, h.cast::<u8>().add(7).cast(), 0));
        assert_eq!(dp, hp + 7);

        // The device pointer of pinned memory works as the device side of
        // a copy.
        let d = alloc(5000);
        ok(sys::cuMemcpyDtoD_v2(d, dp, 100));
        assert_eq!(dtoh(d, 100), vec![0xab; 100]);

        let mut h2: *mut c_void = std::ptr::null_mut();
        ok(sys::cuMemAllocHost_v2(&mut h2, 64));
        ok(sys::cuMemFreeHost(h2));
        assert_eq!(sys::cuMemFreeHost(h2), CUresult::CUDA_ERROR_INVALID_VALUE);

        // Registered: a caller range.
        let mut buf = vec![0u8; 3 * 4096];
        let bp = buf.as_mut_ptr();
        ok(sys::cuMemHostRegister_v2(bp.add(100).cast(), 5000, 0));
        assert_eq!(attr_u32(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, bp as u64 + 100), Ok(1));
        assert_eq!(attr_u64(PA::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, bp as u64 + 4000), Ok(bp as u64 + 100));
        assert_eq!(
            attr_u32(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, bp as u64 + 99),
            Err(CUresult::CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(
            sys::cuMemHostRegister_v2(bp.add(200).cast(), 10, 0),
            CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        );
        assert_eq!(sys::cuMemHostRegister_v2(h, 10, 0), CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
        assert_eq!(sys::cuMemHostRegister_v2(d as *mut c_void, 10, 0), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuMemHostUnregister(bp.add(101).cast()), CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
        ok(sys::cuMemHostUnregister(bp.add(100).cast()));
        assert_eq!(
            attr_u32(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, bp as u64 + 100),
            Err(CUresult::CUDA_ERROR_INVALID_VALUE)
        );
        let mut dp2 = 0;
        assert_eq!(sys::cuMemHostGetDevicePointer_v2(&mut dp2, bp.cast(), 0), CUresult::CUDA_ERROR_INVALID_VALUE);

        ok(sys::cuMemFreeHost(h));
        assert_eq!(attr_u32(PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, hp), Err(CUresult::CUDA_ERROR_INVALID_VALUE));
        free(d);
    }
}

#[test]
fn memory_info_tracks_allocations() {
    need_shim!();
    // Device 1 is shared with device_allocation_attributes, so compare
    // against a bound rather than exact values.
    use_device(1);
    let (mut free0, mut total) = (0, 0);
    // SAFETY: out-pointers to locals.
    unsafe {
        ok(sys::cuMemGetInfo_v2(&mut free0, &mut total));
        assert!(free0 <= total);
        let mut p = 0;
        assert_eq!(sys::cuMemAlloc_v2(&mut p, total + 1), CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
}
