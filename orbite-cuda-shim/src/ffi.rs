//! Driver API types and result codes (the values of CUDA's `cuda.h`), and
//! the helpers every export goes through.

use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Condvar, Mutex, MutexGuard};

pub type CUresult = i32;
pub type CUdevice = i32;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_MAP_FAILED: CUresult = 205;
pub const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: CUresult = 712;
pub const CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: CUresult = 713;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// What the shim reports as the driver version (CUDA 12.2).
pub const DRIVER_VERSION: i32 = 12020;

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`: with the null stream, the
/// stream handles that run in the caller.
pub const CU_STREAM_LEGACY: usize = 0x1;
pub const CU_STREAM_PER_THREAD: usize = 0x2;

/// A `Result` whose error is the `CUresult` an export returns.
pub type CuResult<T> = Result<T, CUresult>;

/// Runs an export's body: `Ok` is `CUDA_SUCCESS`, `Err(code)` is `code`,
/// a panic (never expected) is `CUDA_ERROR_UNKNOWN` instead of unwinding
/// into the caller.
pub fn entry(body: impl FnOnce() -> CuResult<()>) -> CUresult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// What every name of `symbols.txt` that the shim does not implement
/// returns: `CUDA_ERROR_NOT_INITIALIZED` before a successful `cuInit`
/// (like every call), `CUDA_ERROR_NOT_SUPPORTED` after. The stubs take no
/// arguments: on x86-64 and AArch64 the caller owns its arguments, so a
/// caller passing some to a function that reads none is harmless.
pub fn not_implemented() -> CUresult {
    match crate::init::config() {
        Ok(_) => CUDA_ERROR_NOT_SUPPORTED,
        Err(code) => code,
    }
}

/// Stores `value` through an out-parameter; a null one is
/// `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `out` is null or valid for a write of `T` (the caller's promise under
/// the driver API).
pub unsafe fn write_out<T>(out: *mut T, value: T) -> CuResult<()> {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for a write of T by this function's contract.
    unsafe { out.write_unaligned(value) };
    Ok(())
}

/// Locks a mutex, ignoring poisoning: the shim's critical sections leave
/// their data consistent at every point where they could panic.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `Condvar::wait`, ignoring poisoning like [`lock`].
pub fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(|e| e.into_inner())
}

/// The calling thread's `errno`.
pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}
