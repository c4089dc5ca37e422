//! Primary contexts (one per device, refcounted) and each thread's stack of
//! current contexts.
//!
//! A context handle is the address of its device's slot in a static array:
//! opaque, non-null, stable for the life of the process.

use std::cell::RefCell;
use std::ffi::{c_int, c_uint};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::ffi::*;
use crate::init::{MAX_DEVICES, config, device};

struct Primary {
    retains: AtomicU32,
}

static PRIMARY: [Primary; MAX_DEVICES] = [const { Primary { retains: AtomicU32::new(0) } }; MAX_DEVICES];

thread_local! {
    static STACK: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// A context: the primary context of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ctx(pub u32);

impl Ctx {
    pub fn handle(self) -> CUcontext {
        std::ptr::from_ref(&PRIMARY[self.0 as usize]).cast_mut().cast()
    }

    /// The context a handle names; `CUDA_ERROR_INVALID_CONTEXT` for null or
    /// anything that is not one of the configured devices' contexts.
    pub fn from_handle(h: CUcontext) -> CuResult<Ctx> {
        let base = PRIMARY.as_ptr() as usize;
        let offset = (h as usize).wrapping_sub(base);
        let index = offset / size_of::<Primary>();
        if h.is_null() || offset % size_of::<Primary>() != 0 || index >= config()?.devices as usize {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        Ok(Ctx(index as u32))
    }

    pub fn device(self) -> u32 {
        self.0
    }

    /// Retained at least once: a context released to zero can be current
    /// but cannot be used.
    pub fn active(self) -> bool {
        PRIMARY[self.0 as usize].retains.load(Ordering::Acquire) > 0
    }
}

/// The calling thread's current context, if any (active or not).
pub fn current() -> Option<Ctx> {
    STACK.try_with(|s| s.borrow().last().copied().map(Ctx)).ok().flatten()
}

/// The current context, which must be active: what every call that acts
/// "in the current context" needs. `CUDA_ERROR_INVALID_CONTEXT` otherwise.
pub fn require_current() -> CuResult<Ctx> {
    config()?;
    match current() {
        Some(c) if c.active() => Ok(c),
        _ => Err(CUDA_ERROR_INVALID_CONTEXT),
    }
}

/// Primary context retains outstanding, summed over devices.
pub fn retains_outstanding() -> u64 {
    PRIMARY.iter().map(|p| u64::from(p.retains.load(Ordering::Relaxed))).sum()
}

fn with_stack<R>(f: impl FnOnce(&mut Vec<u32>) -> R) -> CuResult<R> {
    STACK.try_with(|s| f(&mut s.borrow_mut())).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(out: *mut CUcontext, dev: CUdevice) -> CUresult {
    entry(|| {
        let d = device(dev)?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        PRIMARY[d as usize].retains.fetch_add(1, Ordering::AcqRel);
        // SAFETY: non-null, writable (driver API contract).
        unsafe { write_out(out, Ctx(d).handle()) }
    })
}

/// A release without a retain is `CUDA_ERROR_INVALID_CONTEXT`. Releasing the
/// last retain makes the context inactive; unlike the driver, allocations
/// made in it stay (and stay counted), so a leak still shows in the stats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    entry(|| {
        let d = device(dev)?;
        PRIMARY[d as usize]
            .retains
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .map(|_| ())
            .map_err(|_| CUDA_ERROR_INVALID_CONTEXT)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CUresult {
    entry(|| {
        let d = device(dev)?;
        if flags.is_null() || active.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: both non-null and writable (driver API contract).
        unsafe {
            write_out(flags, 0)?;
            write_out(active, c_int::from(Ctx(d).active()))
        }
    })
}

/// Replaces the top of the thread's stack (pushes onto an empty one); null
/// pops it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    entry(|| {
        config()?;
        if ctx.is_null() {
            return with_stack(|s| {
                s.pop();
            });
        }
        let c = Ctx::from_handle(ctx)?;
        with_stack(|s| match s.last_mut() {
            Some(top) => *top = c.0,
            None => s.push(c.0),
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(out: *mut CUcontext) -> CUresult {
    entry(|| {
        config()?;
        let h = current().map_or(std::ptr::null_mut(), Ctx::handle);
        // SAFETY: `out` is null or writable (driver API contract).
        unsafe { write_out(out, h) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    entry(|| {
        config()?;
        if ctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let c = Ctx::from_handle(ctx)?;
        with_stack(|s| s.push(c.0))
    })
}

/// An empty stack is `CUDA_ERROR_INVALID_CONTEXT`; `out` may be null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(out: *mut CUcontext) -> CUresult {
    entry(|| {
        config()?;
        let popped = with_stack(|s| s.pop())?.ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !out.is_null() {
            // SAFETY: non-null, writable (driver API contract).
            unsafe { write_out(out, Ctx(popped).handle())? };
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(out: *mut CUdevice) -> CUresult {
    entry(|| {
        let c = require_current()?;
        // SAFETY: `out` is null or writable (driver API contract).
        unsafe { write_out(out, c.device() as CUdevice) }
    })
}

/// Waits for all work enqueued, before the call, on the current context's
/// streams.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    entry(|| {
        let c = require_current()?;
        crate::stream::synchronize_context(c, false);
        Ok(())
    })
}
