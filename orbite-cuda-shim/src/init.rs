//! `cuInit`, the environment it reads, and the device queries.

use std::ffi::{c_char, c_int, c_uint};
use std::io::Write as _;
use std::sync::OnceLock;
use std::time::Duration;

use crate::ffi::*;

/// The most devices `ORBITE_CUDA_SHIM_DEVICES` may ask for.
pub const MAX_DEVICES: usize = 64;
/// Each device's memory, as `cuDeviceTotalMem` and `cuMemGetInfo` report it
/// and `cuMemAlloc` enforces it (the backing is sparse, so only bytes
/// written cost host memory).
pub const DEVICE_MEMORY: u64 = 16 << 30;

/// The configuration `cuInit` read from the environment.
#[derive(Debug)]
pub struct Config {
    /// `ORBITE_CUDA_SHIM_DEVICES` (default 2).
    pub devices: u32,
    /// `ORBITE_CUDA_SHIM_COPY_DELAY_US`: how long each asynchronous copy
    /// waits, on its stream, before it copies.
    pub copy_delay: Duration,
}

static INIT: OnceLock<CuResult<Config>> = OnceLock::new();

/// The configuration, or `CUDA_ERROR_NOT_INITIALIZED` before a successful
/// `cuInit`.
pub fn config() -> CuResult<&'static Config> {
    match INIT.get() {
        Some(Ok(config)) => Ok(config),
        _ => Err(CUDA_ERROR_NOT_INITIALIZED),
    }
}

/// The device with ordinal `dev`, checked against the configured count.
pub fn device(dev: CUdevice) -> CuResult<u32> {
    let config = config()?;
    match u32::try_from(dev) {
        Ok(d) if d < config.devices => Ok(d),
        _ => Err(CUDA_ERROR_INVALID_DEVICE),
    }
}

fn complain(what: &str) {
    // A misconfigured test should say why cuInit failed; stderr may be
    // closed, which is no reason to fail differently.
    let _ = writeln!(std::io::stderr(), "orbite-cuda-shim: {what}");
}

fn read_config() -> CuResult<Config> {
    if let Some(v) = std::env::var_os("ORBITE_CUDA_SHIM_INIT_ERROR") {
        match v.to_str().and_then(|s| s.trim().parse::<i32>().ok()) {
            Some(0) => {}
            Some(code) => return Err(code),
            None => {
                complain("ORBITE_CUDA_SHIM_INIT_ERROR is not an integer");
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        }
    }
    let devices = match std::env::var_os("ORBITE_CUDA_SHIM_DEVICES") {
        None => 2,
        Some(v) => match v.to_str().and_then(|s| s.trim().parse::<u32>().ok()) {
            Some(n) if n as usize <= MAX_DEVICES => n,
            _ => {
                complain(&format!("ORBITE_CUDA_SHIM_DEVICES must be a number from 0 to {MAX_DEVICES}"));
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        },
    };
    let copy_delay = match std::env::var_os("ORBITE_CUDA_SHIM_COPY_DELAY_US") {
        None => Duration::ZERO,
        Some(v) => match v.to_str().and_then(|s| s.trim().parse::<u64>().ok()) {
            Some(us) => Duration::from_micros(us),
            None => {
                complain("ORBITE_CUDA_SHIM_COPY_DELAY_US is not a number of microseconds");
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        },
    };
    Ok(Config { devices, copy_delay })
}

/// Reads the environment on the first call; every later call returns the
/// first call's result.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    entry(|| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match INIT.get_or_init(read_config) {
            Ok(_) => Ok(()),
            Err(code) => Err(*code),
        }
    })
}

/// Works before `cuInit`, as the driver's does.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    // SAFETY: `version` is null or writable (driver API contract).
    entry(|| unsafe { write_out(version, DRIVER_VERSION) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    entry(|| {
        let n = config()?.devices as c_int;
        // SAFETY: `count` is null or writable (driver API contract).
        unsafe { write_out(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(out: *mut CUdevice, ordinal: c_int) -> CUresult {
    entry(|| {
        let d = device(ordinal)?;
        // SAFETY: `out` is null or writable (driver API contract).
        unsafe { write_out(out, d as CUdevice) }
    })
}

/// "OrbiTE CUDA shim device N", cut to `len - 1` bytes and NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    entry(|| {
        let d = device(dev)?;
        if name.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let text = format!("OrbiTE CUDA shim device {d}");
        let n = text.len().min(len as usize - 1);
        // SAFETY: the caller's buffer holds `len` bytes (driver API
        // contract) and `n + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    entry(|| {
        device(dev)?;
        // SAFETY: `bytes` is null or writable (driver API contract).
        unsafe { write_out(bytes, DEVICE_MEMORY as usize) }
    })
}

const ATTR_PCI_BUS_ID: c_int = 33;
const ATTR_PCI_DEVICE_ID: c_int = 34;
const ATTR_UNIFIED_ADDRESSING: c_int = 41;
const ATTR_PCI_DOMAIN_ID: c_int = 50;
const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;
/// `CU_DEVICE_ATTRIBUTE_MAX` of CUDA 12.2.
const ATTR_MAX: c_int = 120;

/// PCI domain 0, bus `ordinal + 1`, device 0; unified addressing; compute
/// capability 9.0; every other attribute 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(value: *mut c_int, attrib: c_int, dev: CUdevice) -> CUresult {
    entry(|| {
        let d = device(dev)?;
        let v = match attrib {
            ATTR_PCI_BUS_ID => d as c_int + 1,
            ATTR_PCI_DEVICE_ID | ATTR_PCI_DOMAIN_ID => 0,
            ATTR_UNIFIED_ADDRESSING => 1,
            ATTR_COMPUTE_CAPABILITY_MAJOR => 9,
            ATTR_COMPUTE_CAPABILITY_MINOR => 0,
            1..ATTR_MAX => 0,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        // SAFETY: `value` is null or writable (driver API contract).
        unsafe { write_out(value, v) }
    })
}

/// A UUID that depends only on the ordinal.
fn uuid(d: u32) -> [u8; 16] {
    let mut u = *b"OrbiTE-shim-\0\0\0\0";
    u[12..].copy_from_slice(&d.to_be_bytes());
    u
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(out: *mut [u8; 16], dev: CUdevice) -> CUresult {
    entry(|| {
        let d = device(dev)?;
        // SAFETY: `out` is null or points to a CUuuid (16 bytes).
        unsafe { write_out(out, uuid(d)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(out: *mut [u8; 16], dev: CUdevice) -> CUresult {
    // SAFETY: same contract as cuDeviceGetUuid.
    unsafe { cuDeviceGetUuid(out, dev) }
}
