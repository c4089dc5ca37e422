//! `orbite_cuda_shim_stats`: every live count goes up with what is made and
//! back to zero when it is released. One test in its own binary, so nothing
//! else in the process moves the counters.

mod common;

use std::ffi::c_void;
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;

use common::*;

#[test]
fn child_entry() {
    let Some(role) = role() else { return };
    assert!(available());
    assert_eq!(role, "exporter");
    use_device(0);
    let d = alloc(4096);
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: out-pointer to a local.
    ok(unsafe { sys::cuIpcGetMemHandle(&mut h, d) });
    println!("HANDLE {}", to_hex(&h.reserved.map(|c| c as u8)));
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    free(d);
}

#[test]
fn counters_return_to_zero() {
    need_shim!();
    if role().is_some() {
        return;
    }
    assert_eq!(stats(), OrbiteCudaShimStats::default(), "a fresh process");
    let ctx = use_device(0);
    assert!(!ctx.is_null());
    let mut c1 = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    ok(unsafe { sys::cuDevicePrimaryCtxRetain(&mut c1, 1) });
    assert_eq!(stats().context_retains, 2);

    let a = alloc(100);
    let b = alloc(5000);
    let s = stats();
    assert_eq!((s.device_allocations, s.device_bytes), (2, 5100));

    let mut pinned: *mut c_void = std::ptr::null_mut();
    let mut buf = vec![0u8; 8192];
    let (mut st, mut ev) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: out-pointers to locals; buffers outlive their copies.
    unsafe {
        ok(sys::cuMemHostAlloc(&mut pinned, 1000, 0));
        ok(sys::cuMemHostRegister_v2(buf.as_mut_ptr().cast(), buf.len(), 0));
        ok(sys::cuStreamCreate(&mut st, 0));
        ok(sys::cuEventCreate(&mut ev, 2));
        let s = stats();
        assert_eq!((s.host_allocations, s.host_registrations, s.streams, s.events), (1, 1, 1, 1));

        ok(sys::cuMemcpyHtoDAsync_v2(a, buf.as_ptr().cast(), 100, st));
        ok(sys::cuMemcpyDtoHAsync_v2(pinned, a, 100, st));
        ok(sys::cuEventRecord(ev, st));
        ok(sys::cuEventSynchronize(ev));
        ok(sys::cuMemcpyDtoD_v2(b, a, 50));
        let s = stats();
        assert_eq!((s.async_copies, s.copied_bytes), (2, 250));
    }

    // An import, from a child exporting a buffer.
    let mut child = child("child_entry", "exporter", &[]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines().map(|l| l.unwrap());
    let hex = lines.by_ref().find_map(|l| l.find("HANDLE ").map(|at| l[at + 7..].trim().to_owned())).expect("handle");
    let bytes = from_hex(&hex);
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    for (d, s) in h.reserved.iter_mut().zip(bytes) {
        *d = s as _;
    }
    let mut imported = 0;
    // SAFETY: out-pointer to a local; the handle by value.
    ok(unsafe { sys::cuIpcOpenMemHandle_v2(&mut imported, h, 1) });
    let s = stats();
    assert_eq!((s.ipc_imports, s.device_allocations), (1, 2), "an import is not an allocation");
    // SAFETY: no pointer arguments.
    ok(unsafe { sys::cuIpcCloseMemHandle(imported) });
    writeln!(stdin, "DONE").unwrap();
    lines.for_each(drop);
    assert!(child.wait().unwrap().success());

    // SAFETY: releasing what was made above.
    unsafe {
        ok(sys::cuStreamDestroy_v2(st));
        ok(sys::cuEventDestroy_v2(ev));
        ok(sys::cuMemFreeHost(pinned));
        ok(sys::cuMemHostUnregister(buf.as_mut_ptr().cast()));
        ok(sys::cuDevicePrimaryCtxRelease_v2(1));
    }
    free(a);
    free(b);
    release_device(0);
    let s = stats();
    assert_eq!(
        OrbiteCudaShimStats { async_copies: 0, copied_bytes: 0, ..s },
        OrbiteCudaShimStats::default(),
        "everything released: {s:?}"
    );
    assert_eq!((s.async_copies, s.copied_bytes), (2, 250), "the totals stay");
}
