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
mod peer;

use common::*;
use orbite_core::*;

#[test]
fn peer_process_entry() {
    peer::entry();
}

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
    assert_eq!(why, cuda::CudaError::NotBuilt);
    assert!(why.to_string().contains("feature `cuda`"), "{why}");
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
    use orbite_core::fault::IpcForgery;
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

    /// The shim's VMM counters (`orbite_cuda_shim_vmm_stats`), in its order.
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct VmmStats {
        handles: u64,
        mappings: u64,
        reservations: u64,
        bytes: u64,
    }

    /// The shim's counters, if the loaded driver is the shim.
    fn shim() -> Option<ShimStats> {
        shim_call(c"orbite_cuda_shim_stats")
    }

    /// The shim's VMM counters, if the loaded driver is the shim.
    fn vmm_shim() -> Option<VmmStats> {
        shim_call(c"orbite_cuda_shim_vmm_stats")
    }

    /// Calls the shim's stats function `symbol`, which fills a `T`.
    fn shim_call<T: Default>(symbol: &std::ffi::CStr) -> Option<T> {
        type F<T> = unsafe extern "C" fn(*mut T) -> i32;
        for name in [c"libcuda.so", c"libcuda.so.1"] {
            // SAFETY: looks up an already loaded library (RTLD_NOLOAD) and
            // one of its symbols, whose C type fills a `T`; the handle's
            // reference is dropped again.
            unsafe {
                let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
                if h.is_null() {
                    continue;
                }
                let f = libc::dlsym(h, symbol.as_ptr());
                let mut s = T::default();
                let ok = !f.is_null() && std::mem::transmute::<*mut libc::c_void, F<T>>(f)(&mut s) == 0;
                libc::dlclose(h);
                if ok {
                    return Some(s);
                }
            }
        }
        None
    }

    /// The shim's counters are the process's: the tests that read them
    /// run one at a time (each takes this through `devices`).
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// The driver's devices (and this process's turn at it), or None after
    /// printing why the test skips.
    fn devices(test: &str) -> Option<(u32, std::sync::MutexGuard<'static, ()>)> {
        let turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        match cuda::availability() {
            Ok(info) => Some((info.devices, turn)),
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
        println!("KIND: {why:?}");
        let err = e.allocate_cuda_memory(0, 4096).unwrap_err();
        assert_eq!(not_supported(&err), format!("VRAM is not available: {why}"));
        // SAFETY: refused before the pointer is looked at.
        let r = unsafe { MemoryRange::cuda_borrowed(0, 0x1000, 4096, Permission::RemoteReadWrite) };
        assert!(memory_not_supported(&r.unwrap_err()).contains(&why.to_string()));
        assert_eq!(e.stats(), base, "nothing charged");
    }

    #[test]
    fn no_driver_no_device_or_a_failing_init_is_a_named_refusal() {
        if in_child() {
            return;
        }
        let Some((_, _turn)) = devices("no_driver_no_device_or_a_failing_init_is_a_named_refusal") else { return };
        if shim().is_none() {
            println!("SKIP: a real driver is loaded; the refusal cases need the test shim");
            return;
        }
        let none = child("with_the_feature::child_reports_the_refusal", &[("ORBITE_CUDA_SHIM_DEVICES", "0")]);
        assert!(none.contains("REFUSED: no CUDA device"), "{none}");
        assert!(none.contains("KIND: NoDevice"), "{none}");
        let init = child("with_the_feature::child_reports_the_refusal", &[("ORBITE_CUDA_SHIM_INIT_ERROR", "999")]);
        assert!(init.contains("REFUSED: cuInit failed"), "{init}");
        assert!(init.contains(r#"KIND: Call { call: "cuInit", code: 999"#), "{init}");
        let missing = child("with_the_feature::child_reports_the_refusal", &[("LD_LIBRARY_PATH", "/nonexistent")]);
        assert!(missing.contains("REFUSED: no CUDA driver"), "{missing}");
        assert!(missing.contains("KIND: NoDriver"), "{missing}");
    }

    #[test]
    fn engine_memory_registers_holds_its_context_and_is_freed_after_the_last_registration() {
        let Some((_, _turn)) = devices("engine_memory_registers") else { return };
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
        // Peers see it marked as device memory (reached over tcp only).
        let exported = e.exported_registration(id).expect("exported");
        assert_eq!((exported.device, exported.addr), (Some(0), m.device_ptr() + 4096));
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
        let Some((devices, _turn)) = devices("a_callers_device_range_is_checked") else { return };
        let e = engine("{}");
        let base = e.stats();
        let m = e.allocate_cuda_memory(0, 65536).unwrap();
        let with_m = e.stats();
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
        assert_eq!(e.stats(), with_m, "nothing charged by refusals");

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
        assert_eq!(e.stats().registrations, with_m.registrations + 1);
        e.deregister(id).unwrap();
        assert_eq!(released.load(std::sync::atomic::Ordering::SeqCst), 1, "owner released once");
        drop(m);
        assert_eq!(e.stats(), base, "charges back to baseline");
    }

    /// Device bytes as the driver reads them back.
    fn device_bytes(m: &CudaMemory) -> Vec<u8> {
        let mut out = vec![0u8; m.len()];
        // SAFETY: no transfer is running on it.
        unsafe { m.read(0, &mut out).unwrap() };
        out
    }

    fn device_fill(m: &CudaMemory, seed: u64) {
        let mut rng = Rng(seed);
        let bytes: Vec<u8> = (0..m.len()).map(|_| rng.next() as u8).collect();
        // SAFETY: no transfer is running on it.
        unsafe { m.write(0, &bytes).unwrap() };
    }

    /// Within one engine (the self connection), VRAM moves through driver
    /// copies on the workers' streams: host to device, device to device
    /// (across devices when there are two), device to host, fragmented,
    /// with every byte outside the ranges (the guards) unchanged.
    #[test]
    fn local_transfers_move_device_bytes_exactly_with_guards() {
        let Some((devices, _turn)) = devices("local_transfers_move_device_bytes_exactly_with_guards") else { return };
        let e = engine("{}");
        let base = e.stats();
        let len = 1 << 20;
        let rw = Permission::RemoteReadWrite;
        let a = e.allocate_cuda_memory(0, len).unwrap();
        let b = e.allocate_cuda_memory(devices.min(2) - 1, len).unwrap();
        let h = region(&e, len, rw);
        let ia = e.register_memory_ranges(vec![MemoryRange::cuda(&a, 0, len, rw).unwrap()]).unwrap()[0];
        let ib = e.register_memory_ranges(vec![MemoryRange::cuda(&b, 0, len, rw).unwrap()]).unwrap()[0];
        for round in 0..6u64 {
            fill(&h.mem, 10 + round);
            device_fill(&a, 20 + round);
            device_fill(&b, 30 + round);
            let mut rng = Rng(round + 1);
            let (_, ll, rl) = paired_layouts(&mut rng, 100_000, 600_000, 70_000, len as u64);
            // (op, local id, remote id, which is which)
            let (op, local, remote) = match round % 3 {
                0 => (Op::Write, h.id, ia), // host -> device
                1 => (Op::Write, ia, ib),   // device -> device
                _ => (Op::Read, h.id, ib),  // device -> host
            };
            let read_back = |id: RegistrationId| -> Vec<u8> {
                if id == h.id {
                    snapshot(&h.mem)
                } else if id == ia {
                    device_bytes(&a)
                } else {
                    device_bytes(&b)
                }
            };
            let (before_l, before_r) = (read_back(local), read_back(remote));
            let (l, r) = (descs(local, &ll), descs(remote, &rl));
            let t = e.prepare(&spec(op, &l, &r)).unwrap();
            t.post().unwrap();
            let res = wait_retired(&t);
            assert_eq!(res.outcome.code, OutcomeCode::Success, "round {round}: {res:?}");
            let (after_l, after_r) = (read_back(local), read_back(remote));
            match op {
                Op::Write => {
                    assert_eq!(after_r, expected(&before_l, &ll, &before_r, &rl), "round {round}: bytes or guards");
                    assert_eq!(after_l, before_l, "round {round}: source changed");
                }
                Op::Read => {
                    assert_eq!(after_l, expected(&before_r, &rl, &before_l, &ll), "round {round}: bytes or guards");
                    assert_eq!(after_r, before_r, "round {round}: source changed");
                }
            }
            t.release().unwrap();
        }
        e.deregister(ia).unwrap();
        e.deregister(ib).unwrap();
        e.deregister(h.id).unwrap();
        drop((a, b, h));
        assert_idle(&e);
        assert_eq!(e.stats(), base, "charges back to baseline");
    }

    /// Host memory a device copy names is page-locked for the driver by
    /// the worker of the first such task (the copy engine then reaches it
    /// without the driver's bounce) and unpinned with its registration; a
    /// second registration of the same pages is refused by the driver and
    /// stays pageable, and its bytes still move; `cuda_pin_host: false`
    /// never pins. Bytes checked each time, charges back to baseline.
    #[test]
    fn host_memory_is_pinned_for_device_copies_and_unpinned_with_its_registration() {
        let Some((_, _turn)) = devices("host_memory_is_pinned_for_device_copies") else { return };
        let Some(start) = shim() else {
            println!("SKIP: counting the driver's host registrations needs the test shim");
            return;
        };
        let pinned = || shim().unwrap().host_registrations - start.host_registrations;
        let len = 1 << 20;
        let rw = Permission::RemoteReadWrite;
        for pin in [true, false] {
            let e = engine(&format!(r#"{{"cuda_pin_host": {pin}}}"#));
            let base = e.stats();
            let m = e.allocate_cuda_memory(0, len).unwrap();
            let v = e.register_memory_ranges(vec![MemoryRange::cuda(&m, 0, len, rw).unwrap()]).unwrap()[0];
            let h = region(&e, len, rw);
            // The same pages again (the second half), as a second registration.
            let again =
                e.register_memory_ranges(vec![MemoryRange::host(&h.mem, len / 2, len / 2, rw).unwrap()]).unwrap()[0];
            let move_bytes = |op: Op, host: RegistrationId, at: u64, n: u64, seed: u64| {
                fill(&h.mem, seed);
                device_fill(&m, seed + 1);
                let (hb, db) = (snapshot(&h.mem), device_bytes(&m));
                let (l, r) = (descs(host, &[(0, n)]), descs(v, &[(at, n)]));
                let t = e.prepare(&spec(op, &l, &r)).unwrap();
                t.post().unwrap();
                let res = wait_retired(&t);
                assert_eq!(res.outcome.code, OutcomeCode::Success, "{res:?}");
                let host_at = if host == h.id { 0 } else { len as u64 / 2 };
                match op {
                    Op::Write => assert_eq!(device_bytes(&m), expected(&hb, &[(host_at, n)], &db, &[(at, n)])),
                    Op::Read => assert_eq!(snapshot(&h.mem), expected(&db, &[(at, n)], &hb, &[(host_at, n)])),
                }
                t.release().unwrap();
            };
            assert_eq!(pinned(), 0, "nothing is pinned before a device copy names it");
            move_bytes(Op::Write, h.id, 4096, 300_000, 1);
            assert_eq!(pinned(), u64::from(pin), "pinned by the first device copy (cuda_pin_host {pin})");
            move_bytes(Op::Read, h.id, 0, len as u64, 3);
            // Its pages are already the first registration's: the driver
            // refuses, the bytes still move.
            move_bytes(Op::Read, again, 1000, len as u64 / 2, 5);
            move_bytes(Op::Write, again, 0, 70_000, 7);
            assert_eq!(pinned(), u64::from(pin), "the second registration stays pageable");
            e.deregister(again).unwrap();
            e.deregister(h.id).unwrap();
            assert_idle(&e);
            assert_eq!(pinned(), 0, "unpinned with its registration");
            e.deregister(v).unwrap();
            drop((m, h));
            assert_eq!(e.stats(), base, "charges back to baseline");
        }
    }

    /// A caller's range of VMM memory may span physical allocations mapped
    /// back to back (PyTorch's expandable segments): it registers, and
    /// bytes move across the boundary both ways on the self connection,
    /// guards kept. A range running past the last mapping, or starting in
    /// ordinary device memory and running on, is still refused.
    #[test]
    fn vmm_memory_spanning_physical_allocations_registers_and_moves() {
        let Some((_, _turn)) = devices("vmm_memory_spanning_physical_allocations") else { return };
        let e = engine("{}");
        let base = e.stats();
        let rw = Permission::RemoteReadWrite;
        let chunk = 2 << 20;
        let m = VmmAlloc::chunked(chunk, 3, false);
        let mut rng = Rng(5);
        let mut dev: Vec<u8> = (0..m.len).map(|_| rng.next() as u8).collect();
        m.write(&dev);
        // SAFETY: the mappings outlive the registration (deregistered and
        // idle before `m` drops).
        let v = e
            .register_memory_ranges(vec![
                unsafe { MemoryRange::cuda_borrowed(0, m.ptr + 4096, m.len as u64 - 8192, rw) }.unwrap(),
            ])
            .unwrap()[0];
        let h = region(&e, 3 << 20, rw);
        for (round, op) in [Op::Write, Op::Read, Op::Write].into_iter().enumerate() {
            fill(&h.mem, 90 + round as u64);
            let host = snapshot(&h.mem);
            // Across the first boundary (2 MiB into the mapping) and the
            // second one (4 MiB), in pieces.
            let ll = [(1000, 1_500_000), (2_000_000, 1_000_000)];
            let dl = [(chunk as u64 - 700_000, 1_500_000), (2 * chunk as u64 - 600_000, 1_000_000)];
            let (l, r) = (descs(h.id, &ll), descs(v, &dl));
            let t = e.prepare(&spec(op, &l, &r)).unwrap();
            t.post().unwrap();
            assert_eq!(wait_retired(&t).outcome.code, OutcomeCode::Success, "round {round}");
            // Offsets in `dev` are the registration's plus 4096.
            let dl_abs: Vec<(u64, u64)> = dl.iter().map(|&(o, n)| (o + 4096, n)).collect();
            match op {
                Op::Write => {
                    dev = expected(&host, &ll, &dev, &dl_abs);
                    assert_eq!(m.read(), dev, "round {round}: device bytes or guards");
                }
                Op::Read => {
                    assert_eq!(snapshot(&h.mem), expected(&dev, &dl_abs, &host, &ll), "round {round}: host bytes");
                    assert_eq!(m.read(), dev, "round {round}: the source changed");
                }
            }
            t.release().unwrap();
        }
        e.deregister(v).unwrap();
        // Past the last mapping (the reservation ends there): refused.
        // SAFETY: refused before use.
        let past = unsafe { MemoryRange::cuda_borrowed(0, m.ptr + chunk as u64, 2 * chunk as u64 + 1, rw) };
        assert!(matches!(past, Err(MemoryError::InvalidRange(_))), "{:?}", past.err());
        // Ordinary device memory does not run on into anything.
        let a = e.allocate_cuda_memory(0, 1 << 20).unwrap();
        // SAFETY: refused before use.
        let over = unsafe { MemoryRange::cuda_borrowed(0, a.device_ptr(), (1 << 20) + 1, rw) };
        assert!(matches!(over, Err(MemoryError::InvalidRange(_))));
        drop(a);
        e.deregister(h.id).unwrap();
        drop(h);
        assert_idle(&e);
        assert_eq!(e.stats(), base, "charges back to baseline");
        drop(m);
    }

    /// Within one registration of device memory, source and destination
    /// may overlap: the bytes are those of a memmove (the driver's own
    /// copies are undefined there), forward and backward; an overlap that
    /// would need more than 1024 copies is refused at prepare.
    #[test]
    fn overlapping_device_ranges_move_as_memmove() {
        let Some((_, _turn)) = devices("overlapping_device_ranges_move_as_memmove") else { return };
        let e = engine("{}");
        let base = e.stats();
        let len = 1 << 20;
        let rw = Permission::RemoteReadWrite;
        let a = e.allocate_cuda_memory(0, len).unwrap();
        let ia = e.register_memory_ranges(vec![MemoryRange::cuda(&a, 0, len, rw).unwrap()]).unwrap()[0];
        for (round, (src, dst, n)) in
            [(1000u64, 5000u64, 300_000u64), (300_000, 4096, 250_000), (64, 64 + 4000, 4000 * 200), (7, 7, 1000)]
                .into_iter()
                .enumerate()
        {
            device_fill(&a, 70 + round as u64);
            let mut want = device_bytes(&a);
            want.copy_within(src as usize..(src + n) as usize, dst as usize);
            let (l, r) = (descs(ia, &[(src, n)]), descs(ia, &[(dst, n)]));
            let t = e.prepare(&spec(Op::Write, &l, &r)).unwrap();
            t.post().unwrap();
            assert_eq!(wait_retired(&t).outcome.code, OutcomeCode::Success, "round {round}");
            assert!(device_bytes(&a) == want, "round {round}: {src} -> {dst}, {n} bytes: not a memmove");
            t.release().unwrap();
        }
        let (l, r) = (descs(ia, &[(0, 600_000)]), descs(ia, &[(100, 600_000)]));
        match e.prepare(&spec(Op::Write, &l, &r)) {
            Err(Error::Batch(BatchError::InvalidDescriptor { reason, .. })) => {
                assert!(reason.contains("overlap"), "{reason}")
            }
            other => panic!("{:?}", other.map(|t| t.route().clone())),
        }
        e.deregister(ia).unwrap();
        drop(a);
        assert_idle(&e);
        assert_eq!(e.stats(), base, "charges back to baseline");
    }

    /// The workers' streams and events go with the engine; every context
    /// reference is given back.
    #[test]
    fn an_engine_gives_back_its_streams_and_contexts_at_close() {
        let Some((_, _turn)) = devices("an_engine_gives_back_its_streams") else { return };
        let Some(before) = shim() else {
            println!("SKIP: the driver's own counters are needed (test shim)");
            return;
        };
        let e = engine("{}");
        let rw = Permission::RemoteReadWrite;
        let a = e.allocate_cuda_memory(0, 65536).unwrap();
        let h = region(&e, 65536, rw);
        let ia = e.register_memory_ranges(vec![MemoryRange::cuda(&a, 0, 65536, rw).unwrap()]).unwrap()[0];
        for _ in 0..8 {
            let (l, r) = (descs(h.id, &[(0, 65536)]), descs(ia, &[(0, 65536)]));
            let t = e.prepare(&spec(Op::Write, &l, &r)).unwrap();
            t.post().unwrap();
            assert_eq!(wait_retired(&t).outcome.code, OutcomeCode::Success);
            t.release().unwrap();
        }
        let during = shim().unwrap();
        assert!(during.streams > before.streams && during.async_copies > before.async_copies, "{during:?}");
        e.deregister(ia).unwrap();
        e.deregister(h.id).unwrap();
        drop((a, h));
        e.close();
        drop(e);
        let after = shim().unwrap();
        assert_eq!(
            (after.streams, after.events, after.context_retains, after.device_allocations),
            (before.streams, before.events, before.context_retains, before.device_allocations),
            "{after:?}"
        );
    }

    /// A file for the device tests: `bytes` in a fresh file under the temp
    /// folder, opened with `flags`; removed with its folder on drop.
    struct DeviceFile {
        dir: std::path::PathBuf,
        path: std::path::PathBuf,
        entry: std::sync::Arc<file::Entry>,
    }

    impl DeviceFile {
        fn new(name: &str, bytes: &[u8], flags: file::OpenFlags) -> DeviceFile {
            let dir = std::env::temp_dir().join(format!("orbite-cuda-{}-{name}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("f");
            std::fs::write(&path, bytes).unwrap();
            let entry = std::sync::Arc::new(file::Entry::open(&path, file::FileMode::ReadWrite, flags).unwrap());
            DeviceFile { dir, path, entry }
        }

        fn bytes(&self) -> Vec<u8> {
            std::fs::read(&self.path).unwrap()
        }
    }

    impl Drop for DeviceFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// Device memory to and from a file: bounced through the staging
    /// pool's page-locked buffers (no CPU copy is handed a device
    /// address), tasks larger than a buffer and tasks that fit one, page
    /// cache and O_DIRECT, aligned and unaligned extents; bytes and guards
    /// on both sides; a READ across the end of the file lands exactly the
    /// bytes there and ends short; staging back to nothing at close.
    #[test]
    fn device_memory_moves_to_and_from_files_through_staging() {
        let Some((_, _turn)) = devices("device_memory_moves_to_and_from_files_through_staging") else { return };
        let direct = file::OpenFlags { direct: true, ..Default::default() };
        for (chunk, flags) in [
            (65536u64, file::OpenFlags::default()),
            (262144, file::OpenFlags::default()),
            (65536, direct),
            (262144, direct),
        ] {
            device_file_rounds(chunk, flags);
        }
    }

    fn device_file_rounds(chunk: u64, flags: file::OpenFlags) {
        const LEN: u64 = 1 << 20;
        let e = engine(&format!(r#"{{"staging_chunk_bytes": {chunk}, "task_bytes": 262144}}"#));
        let base = e.stats();
        let what = format!("chunk {chunk}, {flags:?}");
        let f = DeviceFile::new(&format!("rounds-{chunk}-{}", flags.direct), &vec![0x3Cu8; LEN as usize], flags);
        let rw = Permission::RemoteReadWrite;
        let m = e.allocate_cuda_memory(0, LEN as usize).unwrap();
        let v = e.register_memory_ranges(vec![MemoryRange::cuda(&m, 0, LEN as usize, rw).unwrap()]).unwrap()[0];
        let fext = |ranges: &[(u64, u64)]| descs(RegistrationId::from_raw(0), ranges);
        // Aligned extents (straight through on O_DIRECT) and unaligned
        // ones (bounced again there), in one transfer.
        let ll = [(0u64, 262_144u64), (300_001, 70_000), (400_000, 150_000)];
        let fl = [(4096u64, 262_144u64), (600_003, 70_000), (700_000, 150_000)];
        let mut on_file = f.bytes();
        for (round, op) in [Op::Write, Op::Read, Op::Write, Op::Read].into_iter().enumerate() {
            device_fill(&m, 700 + round as u64);
            let before = device_bytes(&m);
            let t = e.prepare(&TransferSpec::new(op, &descs(v, &ll), &fext(&fl), Target::File(&f.entry))).unwrap();
            assert!(t.route().reason.contains("page-locked buffers"), "{what}: {}", t.route().reason);
            t.post().unwrap();
            let res = wait_retired(&t);
            assert_eq!(res.outcome.code, OutcomeCode::Success, "{what} {op:?}: {res:?}");
            t.release().unwrap();
            match op {
                Op::Write => {
                    on_file = expected(&before, &ll, &on_file, &fl);
                    assert!(f.bytes() == on_file, "{what}: file bytes or guards after the WRITE");
                    assert_eq!(device_bytes(&m), before, "{what}: the device source changed");
                }
                Op::Read => {
                    assert!(
                        device_bytes(&m) == expected(&on_file, &fl, &before, &ll),
                        "{what}: device bytes or guards"
                    );
                }
            }
        }
        // A READ across the end of the file: the bytes before the end land,
        // nothing after them, and the transfer ends short with that prefix.
        let short = LEN - 10_000;
        std::fs::OpenOptions::new().write(true).open(&f.path).unwrap().set_len(short).unwrap();
        device_fill(&m, 799);
        let before = device_bytes(&m);
        let (l, r) = (descs(v, &[(5, 300_000)]), fext(&[(short - 200_003, 300_000)]));
        let t = e.prepare(&TransferSpec::new(Op::Read, &l, &r, Target::File(&f.entry))).unwrap();
        t.post().unwrap();
        let res = wait_retired(&t);
        assert_eq!(
            (res.outcome.code, res.outcome.transferred_prefix),
            (OutcomeCode::ShortCompletion, 200_003),
            "{what}"
        );
        t.release().unwrap();
        let mut want = before.clone();
        want[5..200_008].copy_from_slice(&on_file[(short - 200_003) as usize..short as usize]);
        assert!(device_bytes(&m) == want, "{what}: device bytes after a READ across the end");
        let s = e.stats();
        assert!(s.staging_buffers >= 1 && s.staging_bytes <= e.config().max_staging_bytes, "{what}: {s:?}");
        e.deregister(v).unwrap();
        drop(m);
        assert_idle(&e);
        e.close();
        let after = e.stats();
        assert_eq!((after.staging_buffers, after.staging_bytes), (0, 0), "{what}: staging given back at shutdown");
        assert_eq!(after, Stats { ..base }, "{what}: charges back to baseline");
        if let Some(sh) = shim() {
            assert_eq!(sh.host_allocations, 0, "{what}: pinned buffers freed: {sh:?}");
        }
    }

    /// Deregistering device memory while its staged copy to a file runs
    /// fences it at once; the bytes still reach the file, and the memory
    /// is freed after the transfer retired.
    #[test]
    fn child_deregisters_during_a_slow_staged_file_copy() {
        if !in_child() {
            return;
        }
        cuda::availability().unwrap();
        let e = engine(r#"{"staging_chunk_bytes": 262144, "task_bytes": 262144}"#);
        let base = e.stats();
        let before = shim().expect("the shim");
        let f = DeviceFile::new("slow", &vec![0u8; 1 << 20], file::OpenFlags { direct: true, ..Default::default() });
        let rw = Permission::RemoteReadWrite;
        let m = e.allocate_cuda_memory(0, 1 << 20).unwrap();
        device_fill(&m, 31);
        let want = device_bytes(&m);
        let v = e.register_memory_ranges(vec![MemoryRange::cuda(&m, 0, 1 << 20, rw).unwrap()]).unwrap()[0];
        let (l, r) = (descs(v, &[(0, 1 << 20)]), descs(RegistrationId::from_raw(0), &[(0, 1 << 20)]));
        let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::File(&f.entry))).unwrap();
        t.post().unwrap();
        // The shim holds each device copy 300 ms.
        drop(m);
        e.deregister(v).unwrap();
        assert!(matches!(t.check(), TransferStatus::InProgress { .. }), "the copy should still run");
        assert_eq!(e.stats().device_allocations, 1, "the in-flight transfer keeps the allocation");
        let res = wait_retired(&t);
        assert_eq!(res.outcome.code, OutcomeCode::Success);
        t.release().unwrap();
        assert!(f.bytes() == want, "the file has the device bytes");
        assert_idle(&e);
        e.close();
        assert_eq!(e.stats(), base, "charges back to baseline");
        assert_eq!(shim().unwrap().device_allocations, before.device_allocations, "freed after retirement");
        println!("FILE DEFERRED OK");
    }

    #[test]
    fn deregistration_during_a_staged_file_copy_defers_the_free() {
        if in_child() {
            return;
        }
        let Some((_, _turn)) = devices("deregistration_during_a_staged_file_copy_defers_the_free") else { return };
        if shim().is_none() {
            println!("SKIP: a slow copy needs the test shim");
            return;
        }
        let out = child(
            "with_the_feature::child_deregisters_during_a_slow_staged_file_copy",
            &[("ORBITE_CUDA_SHIM_COPY_DELAY_US", "300000")],
        );
        assert!(out.contains("FILE DEFERRED OK"), "{out}");
    }

    #[test]
    fn child_deregisters_during_a_slow_device_copy() {
        if !in_child() {
            return;
        }
        cuda::availability().unwrap();
        let e = engine("{}");
        let base = e.stats();
        let before = shim().expect("the shim");
        let rw = Permission::RemoteReadWrite;
        let m = e.allocate_cuda_memory(0, 1 << 20).unwrap();
        let h = region(&e, 1 << 20, rw);
        fill(&h.mem, 7);
        let v = e.register_memory_ranges(vec![MemoryRange::cuda(&m, 0, 1 << 20, rw).unwrap()]).unwrap()[0];
        let (l, r) = (descs(h.id, &[(0, 1 << 20)]), descs(v, &[(0, 1 << 20)]));
        let t = e.prepare(&spec(Op::Write, &l, &r)).unwrap();
        t.post().unwrap();
        // While the device copy runs (the shim holds each copy 300 ms):
        // deregistration fences at once, the allocation stays.
        let ptr = m.device_ptr();
        let probe = m.clone();
        drop(m);
        e.deregister(v).unwrap();
        assert!(matches!(t.check(), TransferStatus::InProgress { .. }), "the copy should still run");
        assert_eq!(e.stats().device_allocations, 1, "the in-flight transfer keeps the allocation");
        assert_eq!(shim().unwrap().device_allocations, before.device_allocations + 1);
        let res = wait_retired(&t);
        assert_eq!(res.outcome.code, OutcomeCode::Success);
        let mut back = vec![0u8; 1 << 20];
        // SAFETY: the transfer retired.
        unsafe { probe.read(0, &mut back).unwrap() };
        assert_eq!(back, snapshot(&h.mem), "bytes landed");
        t.release().unwrap();
        drop(probe);
        e.deregister(h.id).unwrap();
        drop(h);
        assert_idle(&e);
        assert_eq!(e.stats(), base, "charges back to baseline");
        let after = shim().unwrap();
        assert_eq!(after.device_allocations, before.device_allocations, "freed after retirement");
        // The freed address is no device memory any more.
        // SAFETY: refused before use.
        let r = unsafe { MemoryRange::cuda_borrowed(0, ptr, 4096, rw) };
        assert!(matches!(r, Err(MemoryError::InvalidRange(_))));
        println!("DEFERRED OK");
    }

    /// Deregistering device memory while a device copy into it runs fences
    /// it at once and frees it only after the transfer retired.
    #[test]
    fn deregistration_during_a_device_copy_defers_the_free() {
        if in_child() {
            return;
        }
        let Some((_, _turn)) = devices("deregistration_during_a_device_copy_defers_the_free") else { return };
        if shim().is_none() {
            println!("SKIP: a slow copy needs the test shim");
            return;
        }
        let out = child(
            "with_the_feature::child_deregisters_during_a_slow_device_copy",
            &[("ORBITE_CUDA_SHIM_COPY_DELAY_US", "300000")],
        );
        assert!(out.contains("DEFERRED OK"), "{out}");
    }

    /// VRAM to and from a same-host peer's memory: over shm (its shared
    /// allocation, mapped here) by driver copies straight into the mapping,
    /// which is page-locked for the driver on first use and unpinned when
    /// the segment closes; over cma (its ordinary memory) bounced through
    /// the worker's pinned buffers: with a small chunk, so every task
    /// pipelines several chunks, and with tasks that fit one buffer, which
    /// pipeline across tasks. Bytes and guards on both sides, both
    /// directions, and the staging buffers charged until the engine shuts
    /// down.
    #[test]
    fn device_memory_moves_to_and_from_a_same_host_peer_through_staging() {
        let Some((_, _turn)) = devices("device_memory_moves_to_and_from_a_same_host_peer") else { return };
        // Tasks larger than a staging buffer (chunk by chunk through two),
        // and tasks that fit one (pipelined across tasks through the
        // worker's ring).
        // With one worker and room for two buffers, the pipeline waits
        // for its oldest task's buffer rather than failing the next.
        for (chunk, more) in
            [(65536u64, ""), (262144, ""), (262144, r#", "local_route_workers": 1, "max_staging_bytes": 524288"#)]
        {
            staged_rounds_with_a_same_host_peer(chunk, more);
        }
    }

    fn staged_rounds_with_a_same_host_peer(chunk: u64, more: &str) {
        use peer::{PeerProcess, REGION};
        let mut p = PeerProcess::spawn();
        let e = engine(&format!(
            r#"{{"listen": "127.0.0.1:0", "peer_timeout_ms": 30000, "staging_chunk_bytes": {chunk}, "task_bytes": 262144{more}}}"#
        ));
        let base = e.stats();
        let seg = p.open(&e);
        let rw = Permission::RemoteReadWrite;
        let m = e.allocate_cuda_memory(0, REGION).unwrap();
        let v = e.register_memory_ranges(vec![MemoryRange::cuda(&m, 0, REGION, rw).unwrap()]).unwrap()[0];
        let mut shm_bytes = PeerProcess::initial(0xEF);
        let mut plain_bytes = PeerProcess::initial(0xAB);
        for (round, op) in [Op::Write, Op::Read, Op::Write, Op::Read].into_iter().enumerate() {
            for (target, want) in [(p.shm, Route::Shm), (p.region, Route::Cma)] {
                let mut rng = Rng(round as u64 * 13 + want as u64);
                let (_, ll, rl) = paired_layouts(&mut rng, 300_000, 1_500_000, 90_000, REGION as u64);
                device_fill(&m, 900 + round as u64);
                let before_local = device_bytes(&m);
                let (l, r) = (descs(v, &ll), descs(target, &rl));
                let t = e.prepare(&TransferSpec::new(op, &l, &r, Target::Peer(&seg))).unwrap();
                assert_eq!(t.route().route, want, "{}", t.route().reason);
                let how = match want {
                    Route::Shm => "straight into the peer's shared memory",
                    _ => &format!("page-locked buffers of {chunk} bytes"),
                };
                assert!(t.route().reason.contains(how), "{}", t.route().reason);
                t.post().unwrap();
                let res = wait_retired(&t);
                assert_eq!(res.outcome.code, OutcomeCode::Success, "{want:?} {op:?}: {res:?}");
                let remote = if want == Route::Shm { &mut shm_bytes } else { &mut plain_bytes };
                match op {
                    Op::Write => {
                        *remote = expected(&before_local, &ll, remote, &rl);
                        assert_eq!(device_bytes(&m), before_local, "the device source changed");
                    }
                    Op::Read => assert_eq!(
                        device_bytes(&m),
                        expected(remote, &rl, &before_local, &ll),
                        "{want:?}: device bytes or guards"
                    ),
                }
                let got = if want == Route::Shm { p.shm_hash(0, REGION) } else { p.hash(0, REGION) };
                assert_eq!(got, fnv(remote), "{want:?} {op:?}: the peer's bytes or guards");
                t.release().unwrap();
            }
        }
        let s = e.stats();
        assert!(s.staging_buffers >= 1 && s.staging_bytes == s.staging_buffers * chunk, "{s:?}");
        assert!(s.staging_bytes <= e.config().max_staging_bytes, "{s:?}");
        let pinned = shim().map(|sh| sh.host_registrations);
        e.deregister(v).unwrap();
        drop(m);
        e.close_segment(&seg, WAIT).unwrap();
        drop(seg);
        if let (Some(pinned), Some(sh)) = (pinned, shim()) {
            assert!(pinned >= 1, "the peer's mapping was pinned for the driver");
            assert_eq!(sh.host_registrations, 0, "unpinned with the segment: {sh:?}");
        }
        e.close();
        let after = e.stats();
        assert_eq!((after.staging_buffers, after.staging_bytes), (0, 0), "staging given back at shutdown");
        assert_eq!(after, Stats { ..base }, "charges back to baseline");
        if let Some(sh) = shim() {
            assert_eq!(sh.host_allocations, 0, "pinned buffers freed: {sh:?}");
        }
    }

    /// VRAM to and from a peer over tcp: each task is staged through a
    /// page-locked buffer of the engine's pool (a worker copies the device
    /// bytes in, the link sends them; or the link receives, a worker
    /// copies them to the device). Bytes and guards on both sides, both
    /// directions; the pool is charged and emptied at close.
    #[test]
    fn device_memory_moves_to_and_from_a_tcp_peer_through_staging() {
        let Some((_, _turn)) = devices("device_memory_moves_to_and_from_a_tcp_peer") else { return };
        use peer::{PeerProcess, REGION};
        let mut p = PeerProcess::spawn();
        let e = engine(r#"{"listen": "127.0.0.1:0", "peer_timeout_ms": 30000, "route": "tcp", "task_bytes": 262144}"#);
        let base = e.stats();
        let seg = p.open(&e);
        let rw = Permission::RemoteReadWrite;
        let m = e.allocate_cuda_memory(0, REGION).unwrap();
        let v = e.register_memory_ranges(vec![MemoryRange::cuda(&m, 0, REGION, rw).unwrap()]).unwrap()[0];
        let mut remote = PeerProcess::initial(0xAB);
        for (round, op) in [Op::Write, Op::Read, Op::Write, Op::Read].into_iter().enumerate() {
            let mut rng = Rng(round as u64 * 17 + 5);
            let (_, ll, rl) = paired_layouts(&mut rng, 300_000, 2_500_000, 120_000, REGION as u64);
            device_fill(&m, 700 + round as u64);
            let before_local = device_bytes(&m);
            let (l, r) = (descs(v, &ll), descs(p.region, &rl));
            let t = e.prepare(&TransferSpec::new(op, &l, &r, Target::Peer(&seg))).unwrap();
            assert_eq!(t.route().route, Route::Tcp, "{}", t.route().reason);
            assert!(t.route().reason.contains("staged through the pinned pool"), "{}", t.route().reason);
            t.post().unwrap();
            let res = wait_retired(&t);
            assert_eq!(res.outcome.code, OutcomeCode::Success, "{op:?}: {res:?}");
            match op {
                Op::Write => {
                    remote = expected(&before_local, &ll, &remote, &rl);
                    assert_eq!(device_bytes(&m), before_local, "the device source changed");
                }
                Op::Read => {
                    assert_eq!(device_bytes(&m), expected(&remote, &rl, &before_local, &ll), "device bytes or guards")
                }
            }
            assert_eq!(p.hash(0, REGION), fnv(&remote), "{op:?}: the peer's bytes or guards");
            t.release().unwrap();
        }
        let s = e.stats();
        assert!(s.staging_buffers >= 1 && s.staging_bytes == s.staging_buffers * 262144, "{s:?}");
        e.deregister(v).unwrap();
        drop(m);
        e.close_segment(&seg, WAIT).unwrap();
        drop(seg);
        e.close();
        assert_eq!(e.stats(), base, "charges back to baseline, the pool emptied");
        if let Some(sh) = shim() {
            assert_eq!(sh.host_allocations, 0, "pinned buffers freed: {sh:?}");
        }
    }

    #[test]
    fn child_loses_the_peer_during_staged_copies() {
        if !in_child() {
            return;
        }
        use peer::{PeerProcess, REGION};
        cuda::availability().unwrap();
        let rw = Permission::RemoteReadWrite;
        // tcp and cma stage; shm has the device copy straight into the
        // peer's mapping, several tasks queued on each worker's stream.
        for (route, shared) in [("tcp", false), ("auto", false), ("auto", true)] {
            for op in [Op::Write, Op::Read] {
                let mut p = PeerProcess::spawn();
                let e = engine(&format!(
                    r#"{{"listen": "127.0.0.1:0", "peer_timeout_ms": 2000, "route": "{route}", "task_bytes": 262144}}"#
                ));
                let base = e.stats();
                let seg = p.open(&e);
                let m = e.allocate_cuda_memory(0, REGION).unwrap();
                let v = e.register_memory_ranges(vec![MemoryRange::cuda(&m, 0, REGION, rw).unwrap()]).unwrap()[0];
                let target = if shared { p.shm } else { p.region };
                let (l, r) = (descs(v, &[(0, 4 << 20)]), descs(target, &[(0, 4 << 20)]));
                let t = e.prepare(&TransferSpec::new(op, &l, &r, Target::Peer(&seg))).unwrap();
                assert_eq!(t.route().route == Route::Shm, shared, "{}", t.route().reason);
                t.post().unwrap();
                // Every device copy takes 300 ms: the peer dies while tasks
                // are staged (or on the device).
                std::thread::sleep(std::time::Duration::from_millis(150));
                p.kill();
                let res = wait_retired(&t);
                if op == Op::Write {
                    // Some tasks were still on the device when it died.
                    assert!(!res.outcome.is_success(), "{route} {op:?}: the peer died: {res:?}");
                }
                t.release().unwrap();
                e.deregister(v).unwrap();
                drop(m);
                drop(seg);
                e.close();
                assert_eq!(e.stats(), base, "{route} {op:?}: charges back to baseline");
                let sh = shim().unwrap();
                assert_eq!(
                    (sh.host_allocations, sh.host_registrations, sh.device_allocations, sh.streams),
                    (0, 0, 0, 0),
                    "{route} {op:?}: {sh:?}"
                );
            }
        }
        println!("PEER LOSS OK");
    }

    /// A peer that dies while its tasks are being staged (slow device
    /// copies) fails the transfer; nothing the staging held leaks: buffers,
    /// pinned mappings, streams and charges back to baseline, over tcp,
    /// cma and shm.
    #[test]
    fn peer_loss_during_staged_copies_leaks_nothing() {
        if in_child() {
            return;
        }
        let Some((_, _turn)) = devices("peer_loss_during_staged_copies_leaks_nothing") else { return };
        if shim().is_none() {
            println!("SKIP: slow copies need the test shim");
            return;
        }
        let out = child(
            "with_the_feature::child_loses_the_peer_during_staged_copies",
            &[("ORBITE_CUDA_SHIM_COPY_DELAY_US", "300000")],
        );
        assert!(out.contains("PEER LOSS OK"), "{out}");
    }

    const PEER_VRAM: usize = 4 << 20;
    /// The device peer's second registration: these bytes of its allocation.
    const SUB_AT: usize = 65536 + 512;
    const SUB_LEN: usize = 200_000;

    /// Device memory made with the virtual memory management API, as
    /// PyTorch's expandable segments make it: `chunks` physical
    /// allocations of `chunk` bytes mapped back to back in one
    /// reservation and opened to device 0 (`shareable`: with POSIX file
    /// descriptors requested, so they can be exported). Undone on drop.
    struct VmmAlloc {
        ptr: u64,
        len: usize,
        chunk: usize,
        handles: Vec<u64>,
        device: cudarc::driver::sys::CUdevice,
        ctx: cudarc::driver::sys::CUcontext,
    }

    fn ok(r: cudarc::driver::sys::CUresult, what: &str) {
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS, "{what}");
    }

    impl VmmAlloc {
        fn new(len: usize, shareable: bool) -> VmmAlloc {
            Self::chunked(len, 1, shareable)
        }

        fn chunked(chunk: usize, chunks: usize, shareable: bool) -> VmmAlloc {
            use cudarc::driver::sys;
            let location = sys::CUmemLocation_st { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
            let len = chunk * chunks;
            // SAFETY: plain driver calls with valid in- and out-pointers; a
            // plain C struct starts as zeros.
            unsafe {
                let mut m = VmmAlloc { ptr: 0, len, chunk, handles: Vec::new(), device: 0, ctx: std::ptr::null_mut() };
                ok(sys::cuDeviceGet(&mut m.device, 0), "cuDeviceGet");
                ok(sys::cuDevicePrimaryCtxRetain(&mut m.ctx, m.device), "cuDevicePrimaryCtxRetain");
                ok(sys::cuCtxSetCurrent(m.ctx), "cuCtxSetCurrent");
                let mut prop: sys::CUmemAllocationProp_st = std::mem::zeroed();
                prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
                prop.location = location;
                if shareable {
                    prop.requestedHandleTypes =
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
                }
                ok(sys::cuMemAddressReserve(&mut m.ptr, len, 0, 0, 0), "cuMemAddressReserve");
                for i in 0..chunks {
                    let mut h = 0;
                    ok(sys::cuMemCreate(&mut h, chunk, &prop, 0), "cuMemCreate");
                    m.handles.push(h);
                    ok(sys::cuMemMap(m.ptr + (i * chunk) as u64, chunk, 0, h, 0), "cuMemMap");
                }
                let access = sys::CUmemAccessDesc_st {
                    location,
                    flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                };
                ok(sys::cuMemSetAccess(m.ptr, len, &access, 1), "cuMemSetAccess");
                m
            }
        }

        fn write(&self, bytes: &[u8]) {
            assert_eq!(bytes.len(), self.len);
            // SAFETY: the mappings, their length; a live source.
            unsafe {
                ok(cudarc::driver::sys::cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent");
                ok(cudarc::driver::sys::cuMemcpyHtoD_v2(self.ptr, bytes.as_ptr().cast(), self.len), "cuMemcpyHtoD");
            }
        }

        fn read(&self) -> Vec<u8> {
            let mut out = vec![0u8; self.len];
            // SAFETY: the mappings, their length; a live destination.
            unsafe {
                ok(cudarc::driver::sys::cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent");
                ok(cudarc::driver::sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr, self.len), "cuMemcpyDtoH");
            }
            out
        }
    }

    impl Drop for VmmAlloc {
        fn drop(&mut self) {
            use cudarc::driver::sys;
            // SAFETY: undoes `chunked`, once; nothing copies to it any more.
            unsafe {
                sys::cuCtxSetCurrent(self.ctx);
                for (i, h) in self.handles.iter().enumerate() {
                    sys::cuMemUnmap(self.ptr + (i * self.chunk) as u64, self.chunk);
                    sys::cuMemRelease(*h);
                }
                sys::cuMemAddressFree(self.ptr, self.len);
                sys::cuDevicePrimaryCtxRelease_v2(self.device);
            }
        }
    }

    /// The device peer's memory: the engine's (`cuMemAlloc`), or VMM
    /// memory the peer made itself and registered as a caller's range.
    enum PeerMem {
        Engine(CudaMemory),
        Vmm(VmmAlloc),
    }

    impl PeerMem {
        fn fill(&self, seed: u64) {
            match self {
                PeerMem::Engine(m) => device_fill(m, seed),
                PeerMem::Vmm(m) => {
                    let mut rng = Rng(seed);
                    m.write(&(0..m.len).map(|_| rng.next() as u8).collect::<Vec<u8>>());
                }
            }
        }

        fn bytes(&self) -> Vec<u8> {
            match self {
                PeerMem::Engine(m) => device_bytes(m),
                PeerMem::Vmm(m) => m.read(),
            }
        }
    }

    /// The device peer's side (a child): an engine with a device
    /// registration peers may read and write, on stdin commands. With
    /// `ORBITE_CUDA_PEER_VMM` (`shareable` or `private`) its memory is
    /// VMM memory it made itself.
    #[test]
    fn device_peer_entry() {
        if std::env::var_os("ORBITE_CUDA_PEER").is_none() {
            return;
        }
        use std::io::{BufRead, Write};
        cuda::availability().unwrap();
        let config = std::env::var("ORBITE_CUDA_PEER_CONFIG")
            .unwrap_or_else(|_| r#"{"listen": "127.0.0.1:0", "peer_timeout_ms": 30000}"#.into());
        let e = engine(&config);
        // A hostile peer: its answers for IPC handles are falsified.
        if let Ok(name) = std::env::var("ORBITE_CUDA_PEER_FORGE") {
            let forgery = IpcForgery::ALL.into_iter().find(|f| format!("{f:?}") == name).unwrap();
            e.forge_ipc_answers_for_tests(Some(forgery));
        }
        let rw = Permission::RemoteReadWrite;
        let (m, v, sub) = match std::env::var("ORBITE_CUDA_PEER_VMM").as_deref() {
            Ok(kind) => {
                let m = VmmAlloc::new(PEER_VRAM, kind == "shareable");
                // SAFETY: the mapping lives until this process ends (the
                // peer never drops it before exiting).
                let ranges = unsafe {
                    vec![
                        MemoryRange::cuda_borrowed(0, m.ptr, PEER_VRAM as u64, rw).unwrap(),
                        MemoryRange::cuda_borrowed(0, m.ptr + SUB_AT as u64, SUB_LEN as u64, rw).unwrap(),
                    ]
                };
                let ids = e.register_memory_ranges(ranges).unwrap();
                (PeerMem::Vmm(m), ids[0], ids[1])
            }
            Err(_) => {
                let m = e.allocate_cuda_memory(0, PEER_VRAM).unwrap();
                let v = e.register_memory_ranges(vec![MemoryRange::cuda(&m, 0, PEER_VRAM, rw).unwrap()]).unwrap()[0];
                // A second registration inside the same allocation, at an offset.
                let sub =
                    e.register_memory_ranges(vec![MemoryRange::cuda(&m, SUB_AT, SUB_LEN, rw).unwrap()]).unwrap()[0];
                (PeerMem::Engine(m), v, sub)
            }
        };
        m.fill(0xD1);
        // Host memory too: what a same-host initiator probes CMA with.
        let host = region(&e, 4096, Permission::RemoteReadWrite);
        let mut out = std::io::stdout();
        let (ep, epoch) = (e.endpoint().unwrap(), e.source_epoch());
        writeln!(out, "READY {ep} {epoch} {} {} {}", v.to_raw(), host.id.to_raw(), sub.to_raw()).unwrap();
        out.flush().unwrap();
        let mut m = Some(m);
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            match line.trim() {
                "hash" => writeln!(out, "HASH {}", m.as_ref().map_or(0, |m| fnv(&m.bytes()))).unwrap(),
                "reset" => {
                    if let Some(m) = &m {
                        m.fill(0xD1);
                    }
                    writeln!(out, "HASH reset").unwrap()
                }
                "staging" => writeln!(out, "STAGING {}", e.stats().staging_buffers).unwrap(),
                // Deregisters and drops its own handle on the engine's
                // memory: what keeps it alive after this is the initiator's
                // borrow (a caller's VMM memory stays until exit).
                "dereg" => {
                    let r = e.deregister(v).and(e.deregister(sub));
                    if matches!(m, Some(PeerMem::Engine(_))) {
                        drop(m.take());
                    }
                    writeln!(out, "DEREG {}", if r.is_ok() { "ok" } else { "failed" }).unwrap()
                }
                "shim" => writeln!(out, "SHIM {}", shim().map_or(0, |s| s.device_allocations)).unwrap(),
                _ => break,
            }
            out.flush().unwrap();
        }
        drop(e);
        drop(m.take());
        std::process::exit(0);
    }

    /// A device peer (`device_peer_entry`) in a child process, driven over
    /// its stdin and stdout.
    struct DevicePeer {
        child: std::process::Child,
        stdin: std::process::ChildStdin,
        stdout: std::io::BufReader<std::process::ChildStdout>,
        endpoint: String,
        epoch: u64,
        vram: RegistrationId,
        host: RegistrationId,
        sub: RegistrationId,
    }

    impl DevicePeer {
        fn spawn(config: Option<&str>) -> DevicePeer {
            Self::spawn_with(config, None)
        }

        /// `vmm`: the peer's memory is VMM memory (`shareable` or
        /// `private`).
        fn spawn_with(config: Option<&str>, vmm: Option<&str>) -> DevicePeer {
            Self::spawn_env(config, vmm, &[])
        }

        /// As [`Self::spawn_with`], with more of the child's environment.
        fn spawn_env(config: Option<&str>, vmm: Option<&str>, env: &[(&str, &str)]) -> DevicePeer {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.envs(env.iter().copied());
            if let Some(kind) = vmm {
                cmd.env("ORBITE_CUDA_PEER_VMM", kind);
            }
            cmd.args(["--exact", "with_the_feature::device_peer_entry", "--nocapture", "--test-threads", "1"])
                .env("ORBITE_CUDA_PEER", "1")
                .env_remove("ORBITE_CUDA_REQUIRED")
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped());
            if let Some(c) = config {
                cmd.env("ORBITE_CUDA_PEER_CONFIG", c);
            }
            let mut child = cmd.spawn().unwrap();
            let stdin = child.stdin.take().unwrap();
            let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
            let mut p = DevicePeer {
                child,
                stdin,
                stdout,
                endpoint: String::new(),
                epoch: 0,
                vram: RegistrationId::from_raw(0),
                host: RegistrationId::from_raw(0),
                sub: RegistrationId::from_raw(0),
            };
            let ready = p.ask(""); // no command: the READY line
            let words: Vec<String> = ready.split_whitespace().map(str::to_owned).collect();
            assert_eq!(words[0], "READY", "{ready}");
            p.endpoint = words[1].clone();
            p.epoch = words[2].parse().unwrap();
            p.vram = RegistrationId::from_raw(words[3].parse().unwrap());
            p.host = RegistrationId::from_raw(words[4].parse().unwrap());
            p.sub = RegistrationId::from_raw(words[5].parse().unwrap());
            p
        }

        fn ask(&mut self, cmd: &str) -> String {
            use std::io::{BufRead, Write};
            if !cmd.is_empty() {
                writeln!(self.stdin, "{cmd}").unwrap();
                self.stdin.flush().unwrap();
            }
            loop {
                let mut l = String::new();
                assert!(self.stdout.read_line(&mut l).unwrap() > 0, "the device peer ended");
                // libtest's "test ... " may precede the first line.
                if let Some(at) = ["HASH", "STAGING", "READY", "DEREG", "SHIM"].iter().find_map(|w| l.find(w)) {
                    return l[at..].trim().to_owned();
                }
            }
        }

        fn kill(mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }

        fn quit(mut self) {
            use std::io::Write;
            let _ = writeln!(self.stdin, "quit");
            let _ = self.child.wait();
        }
    }

    /// Every pairing with a peer's device memory, bytes and guards on both
    /// sides: host to peer VRAM, peer VRAM to host, local VRAM to and from
    /// peer VRAM; each transfer must take `route` (`policy` forces one).
    fn rounds_with_the_device_peer(
        e: &TransferEngine,
        seg: &RemoteSegment,
        p: &mut DevicePeer,
        policy: Option<RoutePolicy>,
        route: Route,
    ) {
        let rw = Permission::RemoteReadWrite;
        let h = region(e, PEER_VRAM, rw);
        let m = e.allocate_cuda_memory(0, PEER_VRAM).unwrap();
        let v = e.register_memory_ranges(vec![MemoryRange::cuda(&m, 0, PEER_VRAM, rw).unwrap()]).unwrap()[0];
        let mut remote = {
            let mut rng = Rng(0xD1);
            (0..PEER_VRAM).map(|_| rng.next() as u8).collect::<Vec<u8>>()
        };
        // The peer's bytes are its fill until a round writes them (another
        // test may have written them before: start from what is there).
        p.ask("reset");
        for (round, (op, local_is_device)) in
            [(Op::Write, false), (Op::Read, false), (Op::Write, true), (Op::Read, true)].into_iter().enumerate()
        {
            let mut rng = Rng(round as u64 + 40);
            let (_, ll, rl) = paired_layouts(&mut rng, 200_000, 1_200_000, 80_000, PEER_VRAM as u64);
            fill(&h.mem, 50 + round as u64);
            device_fill(&m, 60 + round as u64);
            let local_id = if local_is_device { v } else { h.id };
            let before_local = if local_is_device { device_bytes(&m) } else { snapshot(&h.mem) };
            let (l, r) = (descs(local_id, &ll), descs(p.vram, &rl));
            let mut spec = TransferSpec::new(op, &l, &r, Target::Peer(seg));
            spec.options.route = policy;
            let t = e.prepare(&spec).unwrap();
            assert_eq!(t.route().route, route, "{}", t.route().reason);
            t.post().unwrap();
            let res = wait_retired(&t);
            assert_eq!(res.outcome.code, OutcomeCode::Success, "round {round} {op:?}: {res:?}");
            let after_local = if local_is_device { device_bytes(&m) } else { snapshot(&h.mem) };
            match op {
                Op::Write => {
                    remote = expected(&before_local, &ll, &remote, &rl);
                    assert_eq!(after_local, before_local, "round {round}: the source changed");
                }
                Op::Read => {
                    assert_eq!(after_local, expected(&remote, &rl, &before_local, &ll), "round {round}: local bytes")
                }
            }
            let got = p.ask("hash");
            assert_eq!(got, format!("HASH {}", fnv(&remote)), "round {round} {op:?}: the peer's device bytes");
            t.release().unwrap();
        }
        e.deregister(v).unwrap();
        e.deregister(h.id).unwrap();
    }

    /// A peer's device memory as the target over tcp (forced; on one host
    /// `auto` takes CUDA IPC): the peer stages it through its own pool, and
    /// local VRAM is staged at both ends.
    #[test]
    fn a_peers_device_memory_is_reached_over_tcp_staged_at_the_peer() {
        if std::env::var_os("ORBITE_CUDA_PEER").is_some() || in_child() {
            return;
        }
        let Some((_, _turn)) = devices("a_peers_device_memory_is_reached_over_tcp") else { return };
        let mut p = DevicePeer::spawn(None);
        let e = engine(r#"{"listen": "127.0.0.1:0", "peer_timeout_ms": 30000, "task_bytes": 262144}"#);
        let base = e.stats();
        let seg = e.open_segment(&p.endpoint, Some(p.epoch), std::time::Duration::from_secs(10)).unwrap();
        rounds_with_the_device_peer(&e, &seg, &mut p, Some(RoutePolicy::Tcp), Route::Tcp);
        let staging = p.ask("staging");
        assert_ne!(staging, "STAGING 0", "the peer staged through its pool");
        e.close_segment(&seg, WAIT).unwrap();
        drop(seg);
        e.close();
        assert_eq!(e.stats(), base, "charges back to baseline");
        p.quit();
    }

    /// On one host, `auto` opens the peer's device memory through CUDA IPC:
    /// every pairing goes device to device (or host to device) with no
    /// staging at either end; the reason says why cma was ruled out; the
    /// import is opened once and closed with the segment.
    #[test]
    fn a_same_host_peers_device_memory_is_opened_through_cuda_ipc() {
        if std::env::var_os("ORBITE_CUDA_PEER").is_some() || in_child() {
            return;
        }
        let Some((_, _turn)) = devices("a_same_host_peers_device_memory_is_opened_through_cuda_ipc") else { return };
        let shim_before = shim();
        let mut p = DevicePeer::spawn(None);
        let e = engine(r#"{"listen": "127.0.0.1:0", "peer_timeout_ms": 30000, "task_bytes": 262144}"#);
        let base = e.stats();
        let seg = e.open_segment(&p.endpoint, Some(p.epoch), std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(e.stats().cuda_imports, 1, "the peer's allocation is opened at open, once");
        if let (Some(before), Some(now)) = (shim_before, shim()) {
            assert_eq!(now.ipc_imports, before.ipc_imports + 1);
        }
        rounds_with_the_device_peer(&e, &seg, &mut p, None, Route::CudaIpc);
        assert_eq!(p.ask("staging"), "STAGING 0", "nothing staged at the peer");
        // The registration at an offset of the same allocation: its bytes
        // land there, through the one import.
        p.ask("reset");
        let mut remote = {
            let mut rng = Rng(0xD1);
            (0..PEER_VRAM).map(|_| rng.next() as u8).collect::<Vec<u8>>()
        };
        let src = region(&e, SUB_LEN, Permission::RemoteReadWrite);
        fill(&src.mem, 77);
        let (l, r) = (descs(src.id, &[(0, SUB_LEN as u64)]), descs(p.sub, &[(0, SUB_LEN as u64)]));
        let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
        assert_eq!(t.route().route, Route::CudaIpc, "{}", t.route().reason);
        t.post().unwrap();
        assert_eq!(wait_retired(&t).outcome.code, OutcomeCode::Success);
        remote[SUB_AT..SUB_AT + SUB_LEN].copy_from_slice(&snapshot(&src.mem));
        assert_eq!(p.ask("hash"), format!("HASH {}", fnv(&remote)), "bytes at the registration's offset, guards kept");
        t.release().unwrap();
        e.deregister(src.id).unwrap();
        drop(src);
        assert_eq!(e.stats().staging_buffers, 0, "nothing staged here");
        assert_eq!(e.stats().cuda_imports, 1, "still one import");
        // The reason names the route and what ruled out the ones before it.
        let h = region(&e, 4096, Permission::RemoteReadWrite);
        let (l, r) = (descs(h.id, &[(0, 4096)]), descs(p.vram, &[(0, 4096)]));
        let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
        let reason = t.route().reason.clone();
        assert!(reason.contains("CUDA IPC") && reason.contains("CUDA device memory"), "{reason}");
        drop(t);
        // A forced cuda-ipc to host memory of the peer fails at prepare.
        let host_r = descs(p.host, &[(0, 4096)]);
        let mut spec = TransferSpec::new(Op::Write, &l, &host_r, Target::Peer(&seg));
        spec.options.route = Some(RoutePolicy::CudaIpc);
        match e.prepare(&spec) {
            Err(Error::Peer(PeerError::RouteUnavailable { route: Route::CudaIpc, reason })) => {
                assert!(reason.contains("host memory"), "{reason}")
            }
            other => panic!("{:?}", other.map(|t| t.route().clone())),
        }
        e.deregister(h.id).unwrap();
        drop(h);
        e.close_segment(&seg, WAIT).unwrap();
        drop(seg);
        e.close();
        assert_eq!(e.stats(), base, "charges back to baseline: the import is closed");
        if let (Some(before), Some(now)) = (shim_before, shim()) {
            assert_eq!(now.ipc_imports, before.ipc_imports, "the shim has no import left");
        }
        p.quit();
    }

    /// Memory of the virtual memory management API (PyTorch's expandable
    /// segments) has no legacy IPC handle. A same-host peer whose
    /// allocation allows POSIX descriptors hands one over its local socket;
    /// this engine imports and maps the allocation once (its own driver's
    /// extent is the proof), and every pairing goes device to device over
    /// `cuda-ipc`, a registration at an offset included; the import is
    /// undone with the segment. An allocation made without shareable
    /// handles is staged over tcp, and the reason says why.
    #[test]
    fn a_same_host_peers_vmm_memory_is_imported_through_a_shareable_handle() {
        if std::env::var_os("ORBITE_CUDA_PEER").is_some() || in_child() {
            return;
        }
        let Some((_, _turn)) = devices("a_same_host_peers_vmm_memory_is_imported") else { return };
        let vmm_before = vmm_shim();
        let config = r#"{"listen": "127.0.0.1:0", "peer_timeout_ms": 30000, "task_bytes": 262144}"#;
        let mut p = DevicePeer::spawn_with(None, Some("shareable"));
        let e = engine(config);
        let base = e.stats();
        let seg = e.open_segment(&p.endpoint, Some(p.epoch), std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(e.stats().cuda_imports, 1, "both registrations lie in one allocation, imported once");
        if let (Some(before), Some(now)) = (vmm_before, vmm_shim()) {
            assert_eq!((now.mappings, now.reservations), (before.mappings + 1, before.reservations + 1), "{now:?}");
        }
        rounds_with_the_device_peer(&e, &seg, &mut p, None, Route::CudaIpc);
        assert_eq!(p.ask("staging"), "STAGING 0", "nothing staged at the peer");
        p.ask("reset");
        let mut remote = {
            let mut rng = Rng(0xD1);
            (0..PEER_VRAM).map(|_| rng.next() as u8).collect::<Vec<u8>>()
        };
        let src = region(&e, SUB_LEN, Permission::RemoteReadWrite);
        fill(&src.mem, 78);
        let (l, r) = (descs(src.id, &[(0, SUB_LEN as u64)]), descs(p.sub, &[(0, SUB_LEN as u64)]));
        let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
        assert_eq!(t.route().route, Route::CudaIpc, "{}", t.route().reason);
        t.post().unwrap();
        assert_eq!(wait_retired(&t).outcome.code, OutcomeCode::Success);
        remote[SUB_AT..SUB_AT + SUB_LEN].copy_from_slice(&snapshot(&src.mem));
        assert_eq!(p.ask("hash"), format!("HASH {}", fnv(&remote)), "bytes at the registration's offset, guards kept");
        t.release().unwrap();
        e.deregister(src.id).unwrap();
        drop(src);
        assert_eq!(e.stats().cuda_imports, 1, "still one import");
        e.close_segment(&seg, WAIT).unwrap();
        drop(seg);
        e.close();
        assert_eq!(e.stats(), base, "charges back to baseline: the import is undone");
        if let (Some(before), Some(now)) = (vmm_before, vmm_shim()) {
            assert_eq!(
                (now.handles, now.mappings, now.reservations),
                (before.handles, before.mappings, before.reservations)
            );
        }
        p.quit();

        // Without shareable handles requested: staged over tcp, with why.
        let mut p = DevicePeer::spawn_with(None, Some("private"));
        let e = engine(config);
        let base = e.stats();
        let seg = e.open_segment(&p.endpoint, Some(p.epoch), std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(e.stats().cuda_imports, 0, "nothing to import");
        let h = region(&e, 65536, Permission::RemoteReadWrite);
        fill(&h.mem, 79);
        p.ask("reset");
        let mut remote = {
            let mut rng = Rng(0xD1);
            (0..PEER_VRAM).map(|_| rng.next() as u8).collect::<Vec<u8>>()
        };
        let (l, r) = (descs(h.id, &[(0, 65536)]), descs(p.vram, &[(4096, 65536)]));
        let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
        assert_eq!(t.route().route, Route::Tcp, "{}", t.route().reason);
        assert!(t.route().reason.contains("cuMemExportToShareableHandle"), "{}", t.route().reason);
        t.post().unwrap();
        assert_eq!(wait_retired(&t).outcome.code, OutcomeCode::Success);
        remote[4096..4096 + 65536].copy_from_slice(&snapshot(&h.mem));
        assert_eq!(p.ask("hash"), format!("HASH {}", fnv(&remote)));
        t.release().unwrap();
        e.deregister(h.id).unwrap();
        drop(h);
        e.close_segment(&seg, WAIT).unwrap();
        drop(seg);
        e.close();
        assert_eq!(e.stats(), base, "charges back to baseline");
        p.quit();
    }

    /// Descriptors in this process that lead to a forged memfd or to the
    /// shim's VMM memory.
    fn ipc_fds() -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|d| std::fs::read_link(d.ok()?.path()).ok())
            .filter(|l| {
                l.to_string_lossy().contains("orbite-forged-ipc")
                    || l.to_string_lossy().contains("orbite-cuda-shim-vmm")
            })
            .count()
    }

    /// A hostile same-host peer falsifies its answers for the CUDA IPC
    /// handles of its device memory, VMM memory (descriptors) and
    /// engine-allocated memory (legacy handles): a descriptor no driver
    /// made, lengths that are too long, unaligned or absurd, a
    /// registration outside its allocation, another device, descriptors
    /// missing or in excess, a made-up legacy handle. Each is refused
    /// before any copy, with the reason in the route; the transfer is
    /// staged over tcp and lands exactly; no descriptor, mapping,
    /// reservation, import or charge is left behind here.
    #[test]
    fn forged_ipc_answers_are_refused_and_the_transfer_staged() {
        if std::env::var_os("ORBITE_CUDA_PEER").is_some() || in_child() {
            return;
        }
        let Some((_, _turn)) = devices("forged_ipc_answers_are_refused") else { return };
        for forgery in IpcForgery::ALL {
            let why = match forgery {
                IpcForgery::ForeignDescriptor => "cuMemImportFromShareableHandle",
                IpcForgery::InflatedLength => "cuMemMap",
                IpcForgery::UnalignedLength => "granularity",
                IpcForgery::HugeLength => "cuMemAddressReserve",
                IpcForgery::OffsetOutside => "lies outside the peer's allocation",
                IpcForgery::WrongDevice => "not visible to this process",
                IpcForgery::MissingDescriptors => "does not match the descriptors",
                IpcForgery::ExtraDescriptor => "more descriptors than asked for",
                IpcForgery::MadeUpLegacyHandle => "cuIpcOpenMemHandle",
            };
            forged_ipc_round(forgery, Some("shareable"), why);
            // Legacy handles: no descriptor to forge or leave out; the
            // sizes are checked against what this driver opened.
            let legacy = match forgery {
                IpcForgery::ForeignDescriptor | IpcForgery::MissingDescriptors => continue,
                IpcForgery::InflatedLength | IpcForgery::UnalignedLength | IpcForgery::HugeLength => {
                    "the peer says its allocation has"
                }
                IpcForgery::ExtraDescriptor => "does not match the descriptors",
                _ => why,
            };
            forged_ipc_round(forgery, None, legacy);
        }
    }

    /// One peer forging its answers with `forgery` (`vmm`: its memory, as
    /// for [`DevicePeer::spawn_with`]); the route must say `why`.
    fn forged_ipc_round(forgery: IpcForgery, vmm: Option<&str>, why: &str) {
        let config = r#"{"listen": "127.0.0.1:0", "peer_timeout_ms": 30000, "task_bytes": 262144}"#;
        let (vmm_before, shim_before, fds_before) = (vmm_shim(), shim(), ipc_fds());
        let name = format!("{forgery:?} ({})", vmm.unwrap_or("legacy"));
        let mut p = DevicePeer::spawn_env(None, vmm, &[("ORBITE_CUDA_PEER_FORGE", &format!("{forgery:?}"))]);
        let e = engine(config);
        let base = e.stats();
        let seg = e.open_segment(&p.endpoint, Some(p.epoch), std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(e.stats().cuda_imports, 0, "{name}: nothing imported");
        if let (Some(before), Some(now)) = (vmm_before, vmm_shim()) {
            assert_eq!(
                (now.handles, now.mappings, now.reservations),
                (before.handles, before.mappings, before.reservations),
                "{name}: a refused import leaves nothing in the driver"
            );
        }
        if let (Some(before), Some(now)) = (shim_before, shim()) {
            assert_eq!(now.ipc_imports, before.ipc_imports, "{name}: no legacy handle left open");
        }
        assert_eq!(ipc_fds(), fds_before, "{name}: the peer's descriptors are closed");
        p.ask("reset");
        let mut remote = {
            let mut rng = Rng(0xD1);
            (0..PEER_VRAM).map(|_| rng.next() as u8).collect::<Vec<u8>>()
        };
        let h = region(&e, SUB_LEN, Permission::RemoteReadWrite);
        fill(&h.mem, 81);
        for (reg, at) in [(p.vram, 8192usize), (p.sub, 0)] {
            let (l, r) = (descs(h.id, &[(0, SUB_LEN as u64)]), descs(reg, &[(at as u64, SUB_LEN as u64)]));
            let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
            assert_eq!(t.route().route, Route::Tcp, "{name}: {}", t.route().reason);
            assert!(t.route().reason.contains(why), "{name}: {} (wanted {why:?})", t.route().reason);
            t.post().unwrap();
            assert_eq!(wait_retired(&t).outcome.code, OutcomeCode::Success, "{name}");
            let at = if reg == p.sub { SUB_AT } else { at };
            remote[at..at + SUB_LEN].copy_from_slice(&snapshot(&h.mem));
            t.release().unwrap();
        }
        assert_eq!(p.ask("hash"), format!("HASH {}", fnv(&remote)), "{name}: bytes and guards at the peer");
        e.deregister(h.id).unwrap();
        drop(h);
        e.close_segment(&seg, WAIT).unwrap();
        drop(seg);
        e.close();
        assert_eq!(e.stats(), base, "{name}: charges back to baseline");
        p.quit();
        assert_eq!(ipc_fds(), fds_before, "{name}: no descriptor left");
    }

    /// Where CUDA IPC cannot be had, the transfer is staged over tcp and
    /// its route says why: this engine turned it off, or the peer did.
    #[test]
    fn without_cuda_ipc_device_memory_falls_back_to_staging_with_the_reason() {
        if std::env::var_os("ORBITE_CUDA_PEER").is_some() || in_child() {
            return;
        }
        let Some((_, _turn)) = devices("without_cuda_ipc_device_memory_falls_back") else { return };
        let cases = [
            (
                None,
                r#"{"listen": "127.0.0.1:0", "peer_timeout_ms": 30000, "cuda_ipc": false}"#,
                "CUDA IPC is off (cuda_ipc)",
            ),
            (
                Some(r#"{"listen": "127.0.0.1:0", "peer_timeout_ms": 30000, "cuda_ipc": false}"#),
                r#"{"listen": "127.0.0.1:0", "peer_timeout_ms": 30000}"#,
                "the peer did not export it: CUDA IPC is off on this target",
            ),
        ];
        for (peer_config, config, why) in cases {
            let p = DevicePeer::spawn(peer_config);
            let e = engine(config);
            let base = e.stats();
            let seg = e.open_segment(&p.endpoint, Some(p.epoch), std::time::Duration::from_secs(10)).unwrap();
            assert_eq!(e.stats().cuda_imports, 0);
            let h = region(&e, 4096, Permission::RemoteReadWrite);
            fill(&h.mem, 3);
            let (l, r) = (descs(h.id, &[(0, 4096)]), descs(p.vram, &[(0, 4096)]));
            let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
            assert_eq!(t.route().route, Route::Tcp, "{}", t.route().reason);
            assert!(t.route().reason.contains(why), "{} (wanted {why:?})", t.route().reason);
            t.post().unwrap();
            assert_eq!(wait_retired(&t).outcome.code, OutcomeCode::Success);
            t.release().unwrap();
            e.deregister(h.id).unwrap();
            drop(h);
            e.close_segment(&seg, WAIT).unwrap();
            drop(seg);
            e.close();
            assert_eq!(e.stats(), base, "charges back to baseline");
            p.quit();
        }
    }

    /// The peer deregisters its device memory (and drops its own handle
    /// on it) while CUDA IPC copies into it run (slow shim copies, in a
    /// child): the initiator's borrow keeps the allocation alive until the
    /// transfer retired and was released; a repost is refused. Then a peer
    /// dies during IPC copies.
    #[test]
    fn child_peer_deregisters_during_ipc_copies() {
        if !in_child() {
            return;
        }
        let Some((_, _turn)) = devices("child_peer_deregisters_during_ipc_copies") else { return };
        let mut p = DevicePeer::spawn(None);
        let e = engine(r#"{"listen": "127.0.0.1:0", "peer_timeout_ms": 30000, "task_bytes": 65536}"#);
        let base = e.stats();
        let seg = e.open_segment(&p.endpoint, Some(p.epoch), std::time::Duration::from_secs(10)).unwrap();
        let h = region(&e, PEER_VRAM, Permission::RemoteReadWrite);
        fill(&h.mem, 9);
        let (l, r) = (descs(h.id, &[(0, PEER_VRAM as u64)]), descs(p.vram, &[(0, PEER_VRAM as u64)]));
        let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
        assert_eq!(t.route().route, Route::CudaIpc, "{}", t.route().reason);
        t.post().unwrap();
        assert_eq!(p.ask("dereg"), "DEREG ok");
        assert!(matches!(t.status(), TransferStatus::InProgress { .. }), "the slow copies still run");
        assert_eq!(p.ask("shim"), "SHIM 1", "the peer's allocation is alive while borrowed");
        let res = wait_retired(&t);
        assert_eq!(res.outcome.code, OutcomeCode::Success, "{res:?}");
        // The peer fenced it: a repost asks the peer again and is refused.
        assert!(matches!(t.post(), Err(Error::Peer(PeerError::Refused { .. }))));
        assert_eq!(p.ask("shim"), "SHIM 1", "still borrowed by the released-not-yet transfer");
        t.release().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while p.ask("shim") != "SHIM 0" {
            assert!(std::time::Instant::now() < deadline, "the peer never freed its device memory");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        e.deregister(h.id).unwrap();
        drop(h);
        e.close_segment(&seg, WAIT).unwrap();
        drop(seg);
        e.close();
        assert_eq!(e.stats(), base, "charges back to baseline");
        p.quit();

        // A peer that dies while IPC copies into its device memory run: the
        // WRITE fails (some tasks were still on the device), and nothing
        // leaks: the import is closed with the segment, streams and charges
        // back to baseline.
        let p = DevicePeer::spawn(None);
        let e = engine(r#"{"listen": "127.0.0.1:0", "peer_timeout_ms": 2000, "task_bytes": 262144}"#);
        let base = e.stats();
        let seg = e.open_segment(&p.endpoint, Some(p.epoch), std::time::Duration::from_secs(10)).unwrap();
        let m = e.allocate_cuda_memory(0, PEER_VRAM).unwrap();
        let rw = Permission::RemoteReadWrite;
        let v = e.register_memory_ranges(vec![MemoryRange::cuda(&m, 0, PEER_VRAM, rw).unwrap()]).unwrap()[0];
        let (l, r) = (descs(v, &[(0, PEER_VRAM as u64)]), descs(p.vram, &[(0, PEER_VRAM as u64)]));
        let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
        assert_eq!(t.route().route, Route::CudaIpc, "{}", t.route().reason);
        t.post().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
        p.kill();
        let res = wait_retired(&t);
        assert!(!res.outcome.is_success(), "the peer died during the WRITE: {res:?}");
        t.release().unwrap();
        e.deregister(v).unwrap();
        drop(m);
        drop(seg);
        e.close();
        assert_eq!(e.stats(), base, "charges back to baseline after the peer died");
        let sh = shim().unwrap();
        assert_eq!((sh.ipc_imports, sh.device_allocations, sh.streams), (0, 0, 0), "{sh:?}");
        println!("CHILD OK");
    }

    #[test]
    fn a_peer_deregistering_or_dying_during_ipc_copies_is_safe() {
        if in_child() || std::env::var_os("ORBITE_CUDA_PEER").is_some() {
            return;
        }
        let Some((_, _turn)) = devices("a_peer_deregistering_during_ipc_copies") else { return };
        if shim().is_none() {
            println!("SKIP: slow copies and the allocation counts need the test shim");
            return;
        }
        let out = child(
            "with_the_feature::child_peer_deregisters_during_ipc_copies",
            &[("ORBITE_CUDA_SHIM_COPY_DELAY_US", "20000")],
        );
        assert!(out.contains("CHILD OK"), "{out}");
    }
}
