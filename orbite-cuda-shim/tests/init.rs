//! cuInit and its environment, devices, primary contexts and the
//! thread-local current context, error strings.

mod common;

use std::ffi::{CStr, c_char};

use common::*;
use sys::CUdevice_attribute as Attr;

fn count() -> i32 {
    let mut n = -1;
    // SAFETY: out-pointer to a local.
    ok(unsafe { sys::cuDeviceGetCount(&mut n) });
    n
}

/// The child-process entry point: does nothing in a normal run.
#[test]
fn child_entry() {
    let Some(role) = role() else { return };
    assert!(available());
    // SAFETY: driver calls with out-pointers to locals.
    unsafe {
        match role.as_str() {
            "before-init" => {
                let mut n = 0;
                let mut ctx = std::ptr::null_mut();
                let mut p = 0;
                assert_eq!(sys::cuDeviceGetCount(&mut n), CUresult::CUDA_ERROR_NOT_INITIALIZED);
                assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut ctx, 0), CUresult::CUDA_ERROR_NOT_INITIALIZED);
                assert_eq!(sys::cuCtxGetCurrent(&mut ctx), CUresult::CUDA_ERROR_NOT_INITIALIZED);
                assert_eq!(sys::cuMemAlloc_v2(&mut p, 16), CUresult::CUDA_ERROR_NOT_INITIALIZED);
                assert_eq!(sys::cuStreamSynchronize(std::ptr::null_mut()), CUresult::CUDA_ERROR_NOT_INITIALIZED);
                let mut v = 0;
                ok(sys::cuDriverGetVersion(&mut v));
                assert_eq!(v, 12020);
                assert_eq!(error_name(CUresult::CUDA_ERROR_NOT_INITIALIZED), "CUDA_ERROR_NOT_INITIALIZED");
                assert_eq!(sys::cuInit(1), CUresult::CUDA_ERROR_INVALID_VALUE);
                init();
                assert_eq!(count(), 2);
            }
            "devices-0" => {
                init();
                assert_eq!(count(), 0);
                let mut d = 0;
                assert_eq!(sys::cuDeviceGet(&mut d, 0), CUresult::CUDA_ERROR_INVALID_DEVICE);
            }
            "devices-5" => {
                init();
                assert_eq!(count(), 5);
                let mut d = 0;
                ok(sys::cuDeviceGet(&mut d, 4));
                assert_eq!(d, 4);
                assert_eq!(sys::cuDeviceGet(&mut d, 5), CUresult::CUDA_ERROR_INVALID_DEVICE);
            }
            "init-error" => {
                assert_eq!(sys::cuInit(0), CUresult::CUDA_ERROR_NO_DEVICE);
                assert_eq!(sys::cuInit(0), CUresult::CUDA_ERROR_NO_DEVICE, "the first result sticks");
                let mut n = 0;
                assert_eq!(sys::cuDeviceGetCount(&mut n), CUresult::CUDA_ERROR_NOT_INITIALIZED);
            }
            "bad-devices" => {
                assert_eq!(sys::cuInit(0), CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            other => panic!("unknown role {other}"),
        }
    }
    println!("CHILD-OK");
}

#[track_caller]
fn child_ok(role: &str, env: &[(&str, &str)]) {
    let out = run_child("child_entry", role, env);
    assert!(String::from_utf8_lossy(&out.stdout).contains("CHILD-OK"), "child {role} did not run");
}

#[test]
fn every_call_before_init_is_not_initialized() {
    need_shim!();
    child_ok("before-init", &[]);
}

#[test]
fn device_count_from_the_environment() {
    need_shim!();
    child_ok("devices-0", &[("ORBITE_CUDA_SHIM_DEVICES", "0")]);
    child_ok("devices-5", &[("ORBITE_CUDA_SHIM_DEVICES", "5")]);
    child_ok("bad-devices", &[("ORBITE_CUDA_SHIM_DEVICES", "lots")]);
    child_ok("bad-devices", &[("ORBITE_CUDA_SHIM_DEVICES", "65")]);
}

#[test]
fn init_error_from_the_environment() {
    need_shim!();
    child_ok("init-error", &[("ORBITE_CUDA_SHIM_INIT_ERROR", "100")]);
}

#[test]
fn devices_and_attributes() {
    need_shim!();
    init();
    assert_eq!(count(), 2);
    // SAFETY: out-pointers to locals and a buffer of the length passed.
    unsafe {
        let mut d = -1;
        ok(sys::cuDeviceGet(&mut d, 1));
        assert_eq!(d, 1);
        assert_eq!(sys::cuDeviceGet(&mut d, 2), CUresult::CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(sys::cuDeviceGet(&mut d, -1), CUresult::CUDA_ERROR_INVALID_DEVICE);

        let mut name = [0 as c_char; 64];
        ok(sys::cuDeviceGetName(name.as_mut_ptr(), 64, 1));
        assert_eq!(CStr::from_ptr(name.as_ptr()).to_str().unwrap(), "OrbiTE CUDA shim device 1");
        let mut short = [0x7f as c_char; 8];
        ok(sys::cuDeviceGetName(short.as_mut_ptr(), 7, 0));
        assert_eq!(CStr::from_ptr(short.as_ptr()).to_str().unwrap(), "OrbiTE");
        assert_eq!(short[7], 0x7f, "nothing written past len");

        let mut total = 0;
        ok(sys::cuDeviceTotalMem_v2(&mut total, 0));
        assert!(total >= 1 << 30);

        let attr = |a: Attr, dev: i32| {
            let mut v = -1;
            ok(sys::cuDeviceGetAttribute(&mut v, a, dev));
            v
        };
        assert_eq!(attr(Attr::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 0), 1);
        assert_eq!(attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0), 9);
        assert_eq!(attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0), 0);
        assert_eq!(attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, 1), 0);
        assert_ne!(attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0), attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 1));
        assert_eq!(attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, 1), 0);
        assert_eq!(attr(Attr::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 0), 0);

        let uuid = |dev: i32, v2: bool| {
            let mut u = sys::CUuuid { bytes: [0; 16] };
            ok(if v2 { sys::cuDeviceGetUuid_v2(&mut u, dev) } else { sys::cuDeviceGetUuid(&mut u, dev) });
            u.bytes
        };
        assert_eq!(uuid(0, false), uuid(0, true));
        assert_eq!(uuid(1, false), uuid(1, false));
        assert_ne!(uuid(0, false), uuid(1, false));
        assert_eq!(sys::cuDeviceGetUuid(&mut sys::CUuuid { bytes: [0; 16] }, 2), CUresult::CUDA_ERROR_INVALID_DEVICE);
    }
}

#[test]
fn primary_context_refcount_and_current_context() {
    need_shim!();
    init();
    // SAFETY: out-pointers to locals.
    unsafe {
        // Device 1 is used only by this test in this binary.
        let state = || {
            let (mut flags, mut active) = (7, -1);
            ok(sys::cuDevicePrimaryCtxGetState(1, &mut flags, &mut active));
            active
        };
        assert_eq!(state(), 0);
        let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
        ok(sys::cuDevicePrimaryCtxRetain(&mut a, 1));
        ok(sys::cuDevicePrimaryCtxRetain(&mut b, 1));
        assert!(!a.is_null());
        assert_eq!(a, b, "one primary context per device");
        assert_eq!(state(), 1);

        let mut cur = a;
        ok(sys::cuCtxGetCurrent(&mut cur));
        assert!(cur.is_null(), "no current context on a new thread");
        let mut dev = -1;
        assert_eq!(sys::cuCtxGetDevice(&mut dev), CUresult::CUDA_ERROR_INVALID_CONTEXT);

        ok(sys::cuCtxSetCurrent(a));
        ok(sys::cuCtxGetDevice(&mut dev));
        assert_eq!(dev, 1);
        ok(sys::cuCtxSynchronize());

        // The current context is per thread.
        std::thread::spawn(|| {
            let mut cur: sys::CUcontext = std::ptr::dangling_mut();
            ok(sys::cuCtxGetCurrent(&mut cur));
            assert!(cur.is_null());
            assert_eq!(sys::cuCtxSynchronize(), CUresult::CUDA_ERROR_INVALID_CONTEXT);
        })
        .join()
        .unwrap();

        // Push and pop.
        let mut other = std::ptr::null_mut();
        ok(sys::cuDevicePrimaryCtxRetain(&mut other, 0));
        assert_ne!(other, a);
        ok(sys::cuCtxPushCurrent_v2(other));
        ok(sys::cuCtxGetDevice(&mut dev));
        assert_eq!(dev, 0);
        let mut popped = std::ptr::null_mut();
        ok(sys::cuCtxPopCurrent_v2(&mut popped));
        assert_eq!(popped, other);
        ok(sys::cuCtxGetCurrent(&mut cur));
        assert_eq!(cur, a);
        ok(sys::cuCtxPopCurrent_v2(std::ptr::null_mut()));
        assert_eq!(sys::cuCtxPopCurrent_v2(&mut popped), CUresult::CUDA_ERROR_INVALID_CONTEXT);
        ok(sys::cuDevicePrimaryCtxRelease_v2(0));

        // Not a context.
        let mut x = 0u64;
        assert_eq!(sys::cuCtxSetCurrent((&raw mut x).cast()), CUresult::CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(sys::cuCtxPushCurrent_v2(std::ptr::null_mut()), CUresult::CUDA_ERROR_INVALID_VALUE);

        // Set null pops; released to zero, the context is inactive.
        ok(sys::cuCtxSetCurrent(a));
        ok(sys::cuDevicePrimaryCtxRelease_v2(1));
        assert_eq!(state(), 1);
        ok(sys::cuDevicePrimaryCtxRelease_v2(1));
        assert_eq!(state(), 0);
        let mut p = 0;
        assert_eq!(sys::cuMemAlloc_v2(&mut p, 16), CUresult::CUDA_ERROR_INVALID_CONTEXT, "inactive context");
        assert_eq!(sys::cuDevicePrimaryCtxRelease_v2(1), CUresult::CUDA_ERROR_INVALID_CONTEXT);
        ok(sys::cuCtxSetCurrent(std::ptr::null_mut()));
        ok(sys::cuCtxGetCurrent(&mut cur));
        assert!(cur.is_null());
    }
}

#[test]
fn error_names_and_strings() {
    need_shim!();
    // SAFETY: out-pointers to locals; the strings are static.
    unsafe {
        for code in [
            CUresult::CUDA_SUCCESS,
            CUresult::CUDA_ERROR_INVALID_VALUE,
            CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            CUresult::CUDA_ERROR_NOT_INITIALIZED,
            CUresult::CUDA_ERROR_NO_DEVICE,
            CUresult::CUDA_ERROR_INVALID_DEVICE,
            CUresult::CUDA_ERROR_INVALID_CONTEXT,
            CUresult::CUDA_ERROR_MAP_FAILED,
            CUresult::CUDA_ERROR_OPERATING_SYSTEM,
            CUresult::CUDA_ERROR_INVALID_HANDLE,
            CUresult::CUDA_ERROR_NOT_FOUND,
            CUresult::CUDA_ERROR_NOT_READY,
            CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
            CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
            CUresult::CUDA_ERROR_NOT_PERMITTED,
            CUresult::CUDA_ERROR_NOT_SUPPORTED,
            CUresult::CUDA_ERROR_UNKNOWN,
        ] {
            assert_eq!(error_name(code), format!("{code:?}"));
            let mut s = std::ptr::null();
            ok(sys::cuGetErrorString(code, &mut s));
            assert!(!CStr::from_ptr(s).to_bytes().is_empty());
        }
    }
}
