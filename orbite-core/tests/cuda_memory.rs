//! VRAM registration: the refusals of a build or a machine without CUDA,
//! and, with feature `cuda` and a driver (the test shim of
//! `orbite-cuda-shim` in CI, found through `LD_LIBRARY_PATH`, see
//! `scripts/cuda-shim`; or a real one), the driver's checks of a caller's
//! device range, the context lease, engine-allocated device memory, that
//! no route and no peer is handed device memory, and charges back to
//! baseline.
//!
//! A process loads the driver once, so the cases that need another driver
//! state (no device, a failing `cuInit`) run this test binary again as a
//! child with the shim's environment.

mod common;

use common::*;
use orbite_core::*;

fn not_supported(e: &Error) -> &str {
    match e {
        Error::NotSupported(why) => why,
        other => panic!("expected NotSupported, got {other:?}"),
    }
}

fn memory_not_supported(e: &MemoryError) -> &str {
    match e {
        MemoryError::NotSupported(why) => why,
        other => panic!("expected NotSupported, got {other:?}"),
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn without_the_feature_vram_is_refused_naming_the_feature() {
    let e = engine("{}");
    let base = e.stats();
    let why = cuda::availability().unwrap_err();
    assert!(why.contains("feature `cuda`"), "{why}");
    // SAFETY: refused before the pointer is looked at.
    let r = unsafe { MemoryRange::cuda_borrowed(0, 0x1000, 4096, Permission::RemoteReadWrite) };
    assert!(memory_not_supported(&r.unwrap_err()).contains("feature `cuda`"));
    let err = e.allocate_cuda_memory(0, 4096).unwrap_err();
    assert!(not_supported(&err).contains("feature `cuda`"));
    assert_eq!(e.stats(), base, "nothing charged");
}

#[cfg(feature = "cuda")]
mod with_the_feature {
    use super::*;
    use std::process::Command;

    /// The shim's counters (`orbite_cuda_shim_stats`), in its order.
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct ShimStats {
        device_allocations: u64,
        device_bytes: u64,
        host_allocations: u64,
        host_registrations: u64,
        ipc_imports: u64,
        streams: u64,
        events: u64,
        context_retains: u64,
        async_copies: u64,
        copied_bytes: u64,
    }

    /// The shim's counters, if the loaded driver is the shim.
    fn shim() -> Option<ShimStats> {
        type F = unsafe extern "C" fn(*mut ShimStats) -> i32;
        for name in [c"libcuda.so", c"libcuda.so.1"] {
            // SAFETY: looks up an already loaded library (RTLD_NOLOAD) and
            // one of its symbols; the handle's reference is dropped again.
            unsafe {
                let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
                if h.is_null() {
                    continue;
                }
                let f = libc::dlsym(h, c"orbite_cuda_shim_stats".as_ptr());
                let mut s = ShimStats::default();
                let ok = !f.is_null() && std::mem::transmute::<*mut libc::c_void, F>(f)(&mut s) == 0;
                libc::dlclose(h);
                if ok {
                    return Some(s);
                }
            }
        }
        None
    }

    /// The driver's devices, or None after printing why the test skips.
    fn devices(test: &str) -> Option<u32> {
        match cuda::availability() {
            Ok(info) => Some(info.devices),
            Err(why) => {
                // scripts/test and scripts/device-tests set it: there a
                // missing driver is a failure, not a skip.
                assert!(std::env::var_os("ORBITE_CUDA_REQUIRED").is_none(), "{test}: {why}");
                println!(
                    "SKIP {test}: {why} (scripts/cuda-shim builds the test driver; put its directory on LD_LIBRARY_PATH)"
                );
                None
            }
        }
    }

    /// Runs this test binary's test `name` in a child with `env` (another
    /// driver state needs another process) and returns its output.
    fn child(name: &str, env: &[(&str, &str)]) -> String {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads", "1"])
            .env("ORBITE_CUDA_TEST_CHILD", "1")
            .env_remove("ORBITE_CUDA_REQUIRED")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "child {name} failed:\n{text}");
        text
    }

    fn in_child() -> bool {
        std::env::var_os("ORBITE_CUDA_TEST_CHILD").is_some()
    }

    #[test]
    fn child_reports_the_refusal() {
        if !in_child() {
            return;
        }
        let why = cuda::availability().unwrap_err();
        let e = engine("{}");
        let base = e.stats();
        println!("REFUSED: {why}");
        let err = e.allocate_cuda_memory(0, 4096).unwrap_err();
        assert_eq!(not_supported(&err), format!("VRAM is not available: {why}"));
        // SAFETY: refused before the pointer is looked at.
        let r = unsafe { MemoryRange::cuda_borrowed(0, 0x1000, 4096, Permission::RemoteReadWrite) };
        assert!(memory_not_supported(&r.unwrap_err()).contains(&why));
        assert_eq!(e.stats(), base, "nothing charged");
    }

    #[test]
    fn no_driver_no_device_or_a_failing_init_is_a_named_refusal() {
        if in_child() || devices("no_driver_no_device_or_a_failing_init_is_a_named_refusal").is_none() {
            return;
        }
        if shim().is_none() {
            println!("SKIP: a real driver is loaded; the refusal cases need the test shim");
            return;
        }
        let none = child("with_the_feature::child_reports_the_refusal", &[("ORBITE_CUDA_SHIM_DEVICES", "0")]);
        assert!(none.contains("REFUSED: no CUDA device"), "{none}");
        let init = child("with_the_feature::child_reports_the_refusal", &[("ORBITE_CUDA_SHIM_INIT_ERROR", "999")]);
        assert!(init.contains("REFUSED: cuInit failed"), "{init}");
        let missing = child("with_the_feature::child_reports_the_refusal", &[("LD_LIBRARY_PATH", "/nonexistent")]);
        assert!(missing.contains("REFUSED: no CUDA driver"), "{missing}");
    }

    #[test]
    fn engine_memory_registers_holds_its_context_and_is_freed_after_the_last_registration() {
        let Some(_) = devices("engine_memory_registers") else { return };
        let e = engine("{}");
        let base = e.stats();
        let shim_base = shim();
        let m = e.allocate_cuda_memory(0, 1 << 20).unwrap();
        assert_eq!((m.device(), m.len()), (0, 1 << 20));
        let s = e.stats();
        assert_eq!((s.device_allocations, s.device_memory_bytes), (1, 1 << 20));
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        // SAFETY: nothing else uses the memory.
        unsafe { m.write(8192, &data).unwrap() };
        let mut back = vec![0u8; 4096];
        // SAFETY: as above.
        unsafe { m.read(8192, &mut back).unwrap() };
        assert_eq!(back, data, "bytes through the driver");
        // SAFETY: as above.
        assert!(matches!(unsafe { m.read((1 << 20) - 10, &mut back) }, Err(MemoryError::InvalidRange(_))));
        let id = e
            .register_memory_ranges(vec![MemoryRange::cuda(&m, 4096, 65536, Permission::RemoteReadWrite).unwrap()])
            .unwrap()[0];
        assert!(
            MemoryRange::cuda(&m, (1 << 20) - 4095, 4096, Permission::LocalOnly).is_err(),
            "outside the allocation"
        );
        assert!(MemoryRange::cuda(&m, usize::MAX, 2, Permission::LocalOnly).is_err(), "overflow");
        // Peers are not offered device memory.
        assert!(e.exported_registration(id).is_none(), "VRAM is not exported");
        assert!(e.segment_descriptor().registrations.iter().all(|r| r.addr != m.device_ptr() + 4096));
        drop(m);
        assert_eq!(e.stats().device_allocations, 1, "the registration keeps the allocation");
        e.deregister(id).unwrap();
        assert_eq!(e.stats(), base, "charges back to baseline");
        if let (Some(before), Some(after)) = (shim_base, shim()) {
            assert_eq!(after.device_allocations, before.device_allocations, "freed");
            assert_eq!(after.context_retains, before.context_retains, "context leases released");
        }
    }

    #[test]
    fn a_callers_device_range_is_checked_with_the_driver_before_registration() {
        let Some(devices) = devices("a_callers_device_range_is_checked") else { return };
        let e = engine("{}");
        let base = e.stats();
        let m = e.allocate_cuda_memory(0, 65536).unwrap();
        let p = m.device_ptr();
        let rw = Permission::RemoteReadWrite;
        // SAFETY (all calls below): the allocation outlives the registrations.
        let refuse = |dev: u32, ptr: u64, len: u64, what: &str| {
            let r = unsafe { MemoryRange::cuda_borrowed(dev, ptr, len, rw) };
            match r {
                Err(MemoryError::InvalidRange(why)) => assert!(why.contains(what), "{why} should say {what}"),
                other => panic!("expected InvalidRange({what}), got {other:?}"),
            }
        };
        refuse(0, p + 65536 - 100, 200, "crosses its allocation");
        refuse(0, p, u64::MAX, "wraps");
        refuse(0, p, 0, "null or empty");
        let host = vec![0u8; 4096];
        refuse(0, host.as_ptr() as u64, 4096, "not CUDA device memory");
        if devices > 1 {
            refuse(1, p, 4096, "not of device 1");
        }
        let freed = e.allocate_cuda_memory(0, 4096).unwrap();
        let gone = freed.device_ptr();
        drop(freed);
        refuse(0, gone, 4096, "not CUDA device memory");
        assert_eq!(e.stats(), base, "nothing charged by refusals");

        // An accepted range: its owner release runs once, after the last
        // borrower.
        let released = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let r2 = released.clone();
        let range = unsafe { MemoryRange::cuda_borrowed(0, p + 4096, 8192, rw) }.unwrap().with_owner_release(Box::new(
            move || {
                r2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            },
        ));
        let id = e.register_memory_ranges(vec![range]).unwrap()[0];
        assert_eq!(e.stats().registrations, base.registrations + 1);
        e.deregister(id).unwrap();
        assert_eq!(released.load(std::sync::atomic::Ordering::SeqCst), 1, "owner released once");
        drop(m);
        assert_eq!(e.stats(), base, "charges back to baseline");
    }

    #[test]
    fn no_route_is_handed_device_memory() {
        let Some(_) = devices("no_route_is_handed_device_memory") else { return };
        let e = engine("{}");
        let base = e.stats();
        let m = e.allocate_cuda_memory(0, 65536).unwrap();
        let v = e
            .register_memory_ranges(vec![MemoryRange::cuda(&m, 0, 65536, Permission::RemoteReadWrite).unwrap()])
            .unwrap()[0];
        let h = region(&e, 65536, Permission::RemoteReadWrite);
        for (op, local, remote) in
            [(Op::Write, v, h.id), (Op::Read, v, h.id), (Op::Write, h.id, v), (Op::Read, h.id, v)]
        {
            let (l, r) = (descs(local, &[(0, 4096)]), descs(remote, &[(0, 4096)]));
            let Err(err) = e.prepare(&spec(op, &l, &r)) else { panic!("{op:?} prepared with device memory") };
            assert!(not_supported(&err).contains("CUDA device memory"), "{err}");
        }
        e.deregister(v).unwrap();
        e.deregister(h.id).unwrap();
        drop((m, h));
        assert_idle(&e);
        assert_eq!(e.stats(), base, "charges back to baseline");
    }
}
