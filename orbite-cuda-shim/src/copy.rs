//! Copies and memsets. Device pointers go through the table (a range that
//! runs past its allocation, or VMM memory without the access the copy
//! needs, is `CUDA_ERROR_INVALID_VALUE` and nothing is copied); host
//! pointers are used as they are. Everything is checked
//! before anything is queued, so an asynchronous call that fails queued
//! nothing. A copy of 0 bytes does nothing and succeeds.
//!
//! Asynchronous copies follow CUDA's synchronization rules for pageable
//! host memory (neither pinned nor registered): from pageable memory, the
//! bytes are taken (staged) before the call returns, so the caller may
//! reuse its buffer at once; to pageable memory, the call returns once the
//! copy has run, in stream order. With pinned or registered host memory and
//! between device buffers, the call returns at once and the copy runs on
//! the stream.

use std::ffi::c_void;

use crate::context::require_current;
use crate::ffi::*;
use crate::memory::{Span, Usage, device_span, host_span, unified_span};
use crate::stream::{Op, check_stream, run_sync, submit};

fn copy(dst: Span, src: Span, n: usize, stream: Option<CUstream>) -> CuResult<()> {
    match stream {
        None => run_sync(Op::Copy { dst, src, n, asynchronous: false }),
        Some(h) => {
            let wait = dst.pageable;
            // SAFETY: `src` was made for `n` bytes.
            let src = if src.pageable { unsafe { src.staged(n) } } else { src };
            submit(h, Op::Copy { dst, src, n, asynchronous: true }, wait)
        }
    }
}

/// The context (synchronous, null stream) or the stream is checked first,
/// as by the driver, then the pointers.
fn check_target(stream: Option<CUstream>) -> CuResult<()> {
    match stream {
        None => require_current().map(drop),
        Some(h) => check_stream(h),
    }
}

fn checked(n: usize, stream: Option<CUstream>, spans: impl FnOnce() -> CuResult<(Span, Span)>) -> CuResult<()> {
    check_target(stream)?;
    if n == 0 {
        return match stream {
            None => run_sync(Op::Noop),
            Some(h) => submit(h, Op::Noop, false),
        };
    }
    let (dst, src) = spans()?;
    copy(dst, src, n, stream)
}

/// Unified addressing: each pointer is device memory if it is in a device
/// allocation, host memory otherwise.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    entry(|| checked(n, None, || Ok((unified_span(dst, n, Usage::Write)?, unified_span(src, n, Usage::Read)?))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream) -> CUresult {
    entry(|| checked(n, Some(stream), || Ok((unified_span(dst, n, Usage::Write)?, unified_span(src, n, Usage::Read)?))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    entry(|| checked(n, None, || Ok((device_span(dst, n, Usage::Write)?, host_span(src as usize, n)?))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    stream: CUstream,
) -> CUresult {
    entry(|| checked(n, Some(stream), || Ok((device_span(dst, n, Usage::Write)?, host_span(src as usize, n)?))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    entry(|| checked(n, None, || Ok((host_span(dst as usize, n)?, device_span(src, n, Usage::Read)?))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> CUresult {
    entry(|| checked(n, Some(stream), || Ok((host_span(dst as usize, n)?, device_span(src, n, Usage::Read)?))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    entry(|| checked(n, None, || Ok((device_span(dst, n, Usage::Write)?, device_span(src, n, Usage::Read)?))))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> CUresult {
    entry(|| checked(n, Some(stream), || Ok((device_span(dst, n, Usage::Write)?, device_span(src, n, Usage::Read)?))))
}

fn memset(dst: CUdeviceptr, value: u8, n: usize, stream: Option<CUstream>) -> CuResult<()> {
    check_target(stream)?;
    let op = if n == 0 { Op::Noop } else { Op::Memset { dst: device_span(dst, n, Usage::Write)?, value, n } };
    match stream {
        None => run_sync(op),
        Some(h) => submit(h, op, false),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, value: u8, n: usize) -> CUresult {
    entry(|| memset(dst, value, n, None))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8Async(dst: CUdeviceptr, value: u8, n: usize, stream: CUstream) -> CUresult {
    entry(|| memset(dst, value, n, Some(stream)))
}
