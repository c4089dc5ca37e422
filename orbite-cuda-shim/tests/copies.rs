//! Copies and memsets, synchronous and stream-ordered; streams and events;
//! copies caught in flight with ORBITE_CUDA_SHIM_COPY_DELAY_US; cudarc's
//! safe API on the shim.

mod common;

use std::ffi::c_void;
use std::time::{Duration, Instant};

use common::*;

fn stream(flags: u32) -> sys::CUstream {
    let mut s = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    ok(unsafe { sys::cuStreamCreate(&mut s, flags) });
    s
}

fn event(flags: u32) -> sys::CUevent {
    let mut e = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    ok(unsafe { sys::cuEventCreate(&mut e, flags) });
    e
}

/// The child-process entry point: does nothing in a normal run.
#[test]
fn child_entry() {
    let Some(role) = role() else { return };
    assert!(available());
    match role.as_str() {
        "delayed" => delayed_copies(),
        other => panic!("unknown role {other}"),
    }
    println!("CHILD-OK");
}

#[test]
fn synchronous_copies_and_memsets() {
    need_shim!();
    use_device(0);
    let n = 3 * 4096 + 17;
    let a = alloc(n);
    let b = alloc(n);
    let src = pattern(n, 5);
    htod(a, &src);
    same_bytes(&dtoh(a, n), &src, "htod");
    // SAFETY: device pointers from alloc, host buffers of the sizes given.
    unsafe {
        ok(sys::cuMemcpyDtoD_v2(b, a, n));
        same_bytes(&dtoh(b, n), &src, "dtod");
        // Overlapping DtoD within one allocation moves like memmove.
        ok(sys::cuMemcpyDtoD_v2(b + 1, b, 100));
        let moved = dtoh(b, 101);
        assert_eq!(moved[0], src[0]);
        assert_eq!(&moved[1..], &src[..100]);

        ok(sys::cuMemsetD8_v2(b + 10, 0x5a, 20));
        let v = dtoh(b, 40);
        assert!(v[10..30].iter().all(|&x| x == 0x5a));
        assert_ne!(v[30], 0x5a);

        // Unified cuMemcpy: host to device, device to host, host to host.
        let mut back = vec![0u8; 64];
        let host_src = pattern(64, 9);
        ok(sys::cuMemcpy(a, host_src.as_ptr() as u64, 64));
        ok(sys::cuMemcpy(back.as_mut_ptr() as u64, a, 64));
        assert_eq!(back, host_src);
        let mut hh = vec![0u8; 64];
        ok(sys::cuMemcpy(hh.as_mut_ptr() as u64, host_src.as_ptr() as u64, 64));
        assert_eq!(hh, host_src);

        // A range past the end of its allocation copies nothing.
        let ones = [1u8; 64];
        let before = dtoh(a, n);
        assert_eq!(
            sys::cuMemcpyHtoD_v2(a + n as u64 - 10, ones.as_ptr().cast(), 11),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), a + n as u64 - 10, 11),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(sys::cuMemcpyDtoD_v2(b, a + 1, n), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuMemsetD8_v2(a + n as u64 - 1, 0, 2), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuMemcpy(a + 8, b, n), CUresult::CUDA_ERROR_INVALID_VALUE);
        same_bytes(&dtoh(a, n), &before, "after failed copies");
        // Not device memory at all.
        assert_eq!(
            sys::cuMemcpyHtoD_v2(ones.as_ptr() as u64, ones.as_ptr().cast(), 4),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        // A "host" pointer that is device memory.
        assert_eq!(sys::cuMemcpyHtoD_v2(b, a as *const c_void, 4), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuMemcpyHtoD_v2(b, std::ptr::null(), 4), CUresult::CUDA_ERROR_INVALID_VALUE);
        // Zero bytes: nothing to check, nothing to do.
        ok(sys::cuMemcpyHtoD_v2(0x10, std::ptr::null(), 0));
    }
    free(a);
    free(b);
}

#[test]
fn stream_ordered_copies_and_events() {
    need_shim!();
    use_device(0);
    let n = 1 << 20;
    let d = alloc(n);
    let s1 = stream(0);
    let s2 = stream(1);
    let e = event(0);
    let src = pattern(n, 1);
    let mut out = vec![0u8; n];
    // SAFETY: the host buffers outlive the copies (synchronized below).
    unsafe {
        ok(sys::cuMemsetD8Async(d, 0, n, s1));
        ok(sys::cuMemcpyHtoDAsync_v2(d, src.as_ptr().cast(), n, s1));
        ok(sys::cuEventRecord(e, s1));
        // s2 reads only after s1's copy.
        ok(sys::cuStreamWaitEvent(s2, e, 0));
        ok(sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), d, n, s2));
        ok(sys::cuStreamSynchronize(s2));
        same_bytes(&out, &src, "read after the event");
        ok(sys::cuEventSynchronize(e));
        ok(sys::cuEventQuery(e));
        ok(sys::cuStreamQuery(s1));

        // DtoD and unified async copies on a stream.
        let d2 = alloc(n);
        ok(sys::cuMemcpyDtoDAsync_v2(d2, d, n, s1));
        let mut back = vec![0u8; 128];
        ok(sys::cuMemcpyAsync(back.as_mut_ptr() as u64, d2 + 1000, 128, s1));
        ok(sys::cuStreamSynchronize(s1));
        assert_eq!(back, src[1000..1128]);

        // The null stream runs in the caller.
        let mut first = vec![0u8; 16];
        ok(sys::cuMemcpyDtoHAsync_v2(first.as_mut_ptr().cast(), d, 16, std::ptr::null_mut()));
        assert_eq!(first, src[..16]);
        ok(sys::cuEventRecord(e, std::ptr::null_mut()));
        ok(sys::cuEventQuery(e));

        // Elapsed time between two timed records.
        let (t0, t1) = (event(0), event(0));
        ok(sys::cuEventRecord(t0, s1));
        ok(sys::cuMemsetD8Async(d2, 3, n, s1));
        ok(sys::cuEventRecord(t1, s1));
        ok(sys::cuEventSynchronize(t1));
        let mut ms = -1.0f32;
        ok(sys::cuEventElapsedTime(&mut ms, t0, t1));
        assert!(ms >= 0.0);
        let untimed = event(2);
        ok(sys::cuEventRecord(untimed, s1));
        ok(sys::cuStreamSynchronize(s1));
        assert_eq!(sys::cuEventElapsedTime(&mut ms, t0, untimed), CUresult::CUDA_ERROR_INVALID_HANDLE);

        // A failed async call queued nothing; a bad handle is refused.
        assert_eq!(
            sys::cuMemcpyHtoDAsync_v2(d + n as u64 - 1, src.as_ptr().cast(), 2, s1),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        let mut x = 0u64;
        assert_eq!(sys::cuStreamQuery((&raw mut x).cast()), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(sys::cuEventQuery((&raw mut x).cast()), CUresult::CUDA_ERROR_INVALID_HANDLE);

        for ev in [e, t0, t1, untimed] {
            ok(sys::cuEventDestroy_v2(ev));
        }
        assert_eq!(sys::cuEventDestroy_v2(e), CUresult::CUDA_ERROR_INVALID_HANDLE);
        ok(sys::cuStreamDestroy_v2(s1));
        ok(sys::cuStreamDestroy_v2(s2));
        assert_eq!(sys::cuStreamDestroy_v2(s1), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(sys::cuStreamSynchronize(s1), CUresult::CUDA_ERROR_INVALID_HANDLE);
        free(d2);
    }
    free(d);
}

/// Run in a child with ORBITE_CUDA_SHIM_COPY_DELAY_US=500000.
fn delayed_copies() {
    const DELAY: Duration = Duration::from_millis(500);
    use_device(0);
    let n = 4096;
    let d = alloc(n);
    let src = pattern(n, 3);
    let s = stream(0);
    let before = event(0);
    let after = event(0);
    // SAFETY: the host buffers outlive the copies (synchronized below).
    unsafe {
        ok(sys::cuEventRecord(before, s));
        let started = Instant::now();
        ok(sys::cuMemcpyHtoDAsync_v2(d, src.as_ptr().cast(), n, s));
        ok(sys::cuEventRecord(after, s));
        assert!(started.elapsed() < DELAY / 2, "the async call waited for its copy");
        // In flight: the record after the copy is not done, the stream is
        // busy, the one before is done (soon).
        assert_eq!(sys::cuEventQuery(after), CUresult::CUDA_ERROR_NOT_READY);
        assert_eq!(sys::cuStreamQuery(s), CUresult::CUDA_ERROR_NOT_READY);
        ok(sys::cuEventSynchronize(before));
        assert_eq!(sys::cuEventQuery(after), CUresult::CUDA_ERROR_NOT_READY);
        ok(sys::cuEventSynchronize(after));
        assert!(started.elapsed() >= DELAY, "the copy did not wait {DELAY:?}");
        ok(sys::cuStreamQuery(s));
        same_bytes(&dtoh(d, n), &src, "delayed htod");

        // From pageable memory the bytes are taken at the call: the buffer
        // may change at once. To pageable memory the call returns with the
        // copy done.
        let mut changing = pattern(n, 8);
        ok(sys::cuMemcpyHtoDAsync_v2(d, changing.as_ptr().cast(), n, s));
        changing.fill(0);
        let mut out = vec![0u8; n];
        let t = Instant::now();
        ok(sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), d, n, s));
        assert!(t.elapsed() >= 2 * DELAY, "a copy to pageable memory returned before it ran");
        same_bytes(&out, &pattern(n, 8), "staged pageable source");
        htod(d, &src);

        // Destroying a stream with work pending lets the work finish.
        let s2 = stream(0);
        let out = pinned(n);
        ok(sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), d, n, s2));
        let done = event(0);
        ok(sys::cuEventRecord(done, s2));
        ok(sys::cuStreamDestroy_v2(s2));
        assert_eq!(sys::cuEventQuery(done), CUresult::CUDA_ERROR_NOT_READY);
        ok(sys::cuEventSynchronize(done));
        same_bytes(out, &src, "copy finished after cuStreamDestroy");
        free_pinned(out);

        // A free while a copy from the allocation is in flight: the copy
        // still reads the bytes it was given (into registered memory).
        let s3 = stream(0);
        let mut late = vec![0u8; n];
        ok(sys::cuMemHostRegister_v2(late.as_mut_ptr().cast(), n, 0));
        ok(sys::cuMemcpyDtoHAsync_v2(late.as_mut_ptr().cast(), d, n, s3));
        free(d);
        ok(sys::cuStreamSynchronize(s3));
        same_bytes(&late, &src, "copy from a freed allocation");
        ok(sys::cuMemHostUnregister(late.as_mut_ptr().cast()));

        // The legacy null stream waits for blocking streams, not for
        // non-blocking ones.
        let blocking = stream(0);
        let d2 = alloc(n);
        let t = Instant::now();
        ok(sys::cuMemcpyHtoDAsync_v2(d2, src.as_ptr().cast(), n, blocking));
        let probe = dtoh(d2, n);
        assert!(t.elapsed() >= DELAY, "the synchronous copy did not wait for the blocking stream");
        same_bytes(&probe, &src, "after the blocking stream");
        let nonblocking = stream(1);
        let zeros = vec![0u8; n];
        ok(sys::cuMemcpyHtoDAsync_v2(d2, zeros.as_ptr().cast(), n, nonblocking));
        let t = Instant::now();
        let _ = dtoh(d2, 16);
        assert!(t.elapsed() < DELAY / 2, "the synchronous copy waited for a non-blocking stream");
        ok(sys::cuCtxSynchronize());
        same_bytes(&dtoh(d2, n), &zeros, "after cuCtxSynchronize");

        for st in [s, s3, blocking, nonblocking] {
            ok(sys::cuStreamDestroy_v2(st));
        }
        for ev in [before, after, done] {
            ok(sys::cuEventDestroy_v2(ev));
        }
        free(d2);
    }
}

#[test]
fn copies_can_be_caught_in_flight() {
    need_shim!();
    let out = run_child("child_entry", "delayed", &[("ORBITE_CUDA_SHIM_COPY_DELAY_US", "500000")]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("CHILD-OK"));
}

#[test]
fn many_threads_share_the_table() {
    need_shim!();
    init();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                use_device(t % 2);
                let s = stream(1);
                for i in 0..50 {
                    let n = 1000 + i * 37;
                    let d = alloc(n);
                    let src = pattern(n, (t as usize * 50 + i) as u8);
                    let mut out = vec![0u8; n];
                    // SAFETY: buffers outlive the copies (synchronized).
                    unsafe {
                        ok(sys::cuMemcpyHtoDAsync_v2(d, src.as_ptr().cast(), n, s));
                        ok(sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), d, n, s));
                        ok(sys::cuStreamSynchronize(s));
                    }
                    same_bytes(&out, &src, "round trip");
                    free(d);
                }
                // SAFETY: a stream this thread created.
                ok(unsafe { sys::cuStreamDestroy_v2(s) });
                release_device(t % 2);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn cudarc_safe_api_on_the_shim() {
    need_shim!();
    use cudarc::driver::CudaContext;
    let ctx = CudaContext::new(0).expect("context");
    assert_eq!(ctx.name().unwrap(), "OrbiTE CUDA shim device 0");
    let stream = ctx.new_stream().expect("stream");
    let src = pattern(10_000, 7);
    let dev = stream.clone_htod(&src).expect("htod");
    let back = stream.clone_dtoh(&dev).expect("dtoh");
    same_bytes(&back, &src, "cudarc round trip");
    let zeros = stream.alloc_zeros::<u8>(4096).expect("alloc_zeros");
    same_bytes(&stream.clone_dtoh(&zeros).unwrap(), &[0u8; 4096], "alloc_zeros");
    stream.synchronize().unwrap();
    drop((dev, zeros));
    ctx.default_stream().synchronize().unwrap();
}
