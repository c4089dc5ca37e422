//! Shared by the shim's integration tests: finding the shim (through
//! cudarc's dynamic loader, as the engine does), child processes, and a
//! few helpers over `cudarc::driver::sys`.
//!
//! The tests need `LD_LIBRARY_PATH=$(scripts/cuda-shim | tail -1)`. Without
//! it each test prints `SKIP: ...` and passes, unless
//! `ORBITE_CUDA_SHIM_REQUIRED=1`, which makes that a failure (for CI).

#![allow(dead_code)]

use std::ffi::{CStr, c_void};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

pub use cudarc::driver::sys;
pub use cudarc::driver::sys::CUresult;

/// The test-only counters (`orbite_cuda_shim_stats`), declared as the
/// shim documents them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OrbiteCudaShimStats {
    pub device_allocations: u64,
    pub device_bytes: u64,
    pub host_allocations: u64,
    pub host_registrations: u64,
    pub ipc_imports: u64,
    pub streams: u64,
    pub events: u64,
    pub context_retains: u64,
    pub async_copies: u64,
    pub copied_bytes: u64,
}

type StatsFn = unsafe extern "C" fn(*mut OrbiteCudaShimStats) -> i32;

/// The virtual memory management API's counters
/// (`orbite_cuda_shim_vmm_stats`), declared as the shim documents them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OrbiteCudaShimVmmStats {
    pub vmm_handles: u64,
    pub vmm_mappings: u64,
    pub vmm_reservations: u64,
    pub vmm_bytes: u64,
}

type VmmStatsFn = unsafe extern "C" fn(*mut OrbiteCudaShimVmmStats) -> i32;

struct Shim {
    /// dlopen handle of the libcuda.so the loader finds.
    handle: usize,
}

fn find_shim() -> Result<Shim, String> {
    // cudarc's first candidates are libcuda.so, then libcuda.so.1. Look at
    // what they resolve to before cudarc does: its loader `expect`s every
    // symbol, so a foreign libcuda would panic it, and a real driver must
    // not be mistaken for the shim.
    for name in [c"libcuda.so", c"libcuda.so.1"] {
        // SAFETY: dlopen with a NUL-terminated name; the handle is kept
        // open for the life of the process.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            continue;
        }
        // SAFETY: `h` is a live handle; the name is NUL-terminated.
        let sym = unsafe { libc::dlsym(h, c"orbite_cuda_shim_stats".as_ptr()) };
        if sym.is_null() {
            return Err(format!("{} is not the OrbiTE CUDA shim", name.to_string_lossy()));
        }
        return Ok(Shim { handle: h as usize });
    }
    Err("libcuda.so is not on the library path".into())
}

fn shim() -> Option<&'static Shim> {
    static SHIM: OnceLock<Result<Shim, String>> = OnceLock::new();
    match SHIM.get_or_init(find_shim) {
        Ok(s) => Some(s),
        Err(why) => {
            let msg = format!("{why} (run with LD_LIBRARY_PATH=$(scripts/cuda-shim | tail -1))");
            assert!(std::env::var_os("ORBITE_CUDA_SHIM_REQUIRED").is_none_or(|v| v != "1"), "shim required: {msg}");
            println!("SKIP: {msg}");
            None
        }
    }
}

/// Whether the shim is loaded: checks that cudarc finds it and resolves
/// every symbol it expects (`culib()` panics otherwise). Tests return early
/// when this is false.
pub fn available() -> bool {
    if shim().is_none() {
        return false;
    }
    // SAFETY: loading the library through cudarc, as the engine does.
    unsafe {
        assert!(sys::is_culib_present(), "cudarc does not find the shim");
        let _ = sys::culib();
    }
    true
}

/// Skips the test (prints why) when the shim is not loaded.
#[macro_export]
macro_rules! need_shim {
    () => {
        if !common::available() {
            return;
        }
    };
}

/// Asserts a call succeeded, naming the code otherwise.
#[track_caller]
pub fn ok(r: CUresult) {
    assert_eq!(r, CUresult::CUDA_SUCCESS, "expected CUDA_SUCCESS");
}

#[track_caller]
pub fn init() {
    // SAFETY: no pointer arguments.
    ok(unsafe { sys::cuInit(0) });
}

/// Retains device `dev`'s primary context and makes it current on this
/// thread.
#[track_caller]
pub fn use_device(dev: i32) -> sys::CUcontext {
    init();
    let mut ctx = std::ptr::null_mut();
    // SAFETY: out-pointers to locals.
    unsafe {
        ok(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev));
        ok(sys::cuCtxSetCurrent(ctx));
    }
    ctx
}

/// Releases what `use_device` retained and clears the current context.
#[track_caller]
pub fn release_device(dev: i32) {
    // SAFETY: no pointer arguments.
    unsafe {
        ok(sys::cuCtxSetCurrent(std::ptr::null_mut()));
        ok(sys::cuDevicePrimaryCtxRelease_v2(dev));
    }
}

#[track_caller]
pub fn alloc(n: usize) -> sys::CUdeviceptr {
    let mut p = 0;
    // SAFETY: out-pointer to a local.
    ok(unsafe { sys::cuMemAlloc_v2(&mut p, n) });
    assert_ne!(p, 0);
    p
}

#[track_caller]
pub fn free(p: sys::CUdeviceptr) {
    // SAFETY: no pointer arguments beyond the device pointer.
    ok(unsafe { sys::cuMemFree_v2(p) });
}

#[track_caller]
pub fn htod(dst: sys::CUdeviceptr, src: &[u8]) {
    // SAFETY: `src` is valid for its length.
    ok(unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) });
}

#[track_caller]
pub fn dtoh(src: sys::CUdeviceptr, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    // SAFETY: `v` is valid for `n` bytes.
    ok(unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), src, n) });
    v
}

pub fn stats() -> OrbiteCudaShimStats {
    let shim = shim().expect("shim loaded");
    // SAFETY: the handle is live; the symbol has the documented signature.
    let f: StatsFn = unsafe {
        let sym = libc::dlsym(shim.handle as *mut c_void, c"orbite_cuda_shim_stats".as_ptr());
        assert!(!sym.is_null());
        std::mem::transmute::<*mut c_void, StatsFn>(sym)
    };
    let mut s = OrbiteCudaShimStats::default();
    // SAFETY: out-pointer to a local of the documented layout.
    assert_eq!(unsafe { f(&mut s) }, 0);
    s
}

pub fn vmm_stats() -> OrbiteCudaShimVmmStats {
    let sym = symbol(c"orbite_cuda_shim_vmm_stats");
    assert!(!sym.is_null());
    // SAFETY: the symbol has the documented signature.
    let f = unsafe { std::mem::transmute::<*mut c_void, VmmStatsFn>(sym) };
    let mut s = OrbiteCudaShimVmmStats::default();
    // SAFETY: out-pointer to a local of the documented layout.
    assert_eq!(unsafe { f(&mut s) }, 0);
    s
}

/// Resolves `name` in the shim (what dlsym finds), or null.
pub fn symbol(name: &CStr) -> *mut c_void {
    let shim = shim().expect("shim loaded");
    // SAFETY: the handle is live; the name is NUL-terminated.
    unsafe { libc::dlsym(shim.handle as *mut c_void, name.as_ptr()) }
}

pub fn error_name(r: CUresult) -> String {
    let mut s = std::ptr::null();
    // SAFETY: out-pointer to a local; the shim stores a static string.
    unsafe {
        ok(sys::cuGetErrorName(r, &mut s));
        CStr::from_ptr(s).to_string_lossy().into_owned()
    }
}

/// The environment variable naming the role a child process plays.
pub const ROLE: &str = "ORBITE_CUDA_SHIM_TEST_ROLE";

/// This process's role, when it was started by [`child`].
pub fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// A command running test `test` of this same test binary alone, as
/// `role`, with `env` added (the shim's variables are cleared first, so
/// the child reads only what the test gives it).
pub fn child(test: &str, role: &str, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args([test, "--exact", "--nocapture", "--test-threads", "1"]);
    for var in ["ORBITE_CUDA_SHIM_DEVICES", "ORBITE_CUDA_SHIM_INIT_ERROR", "ORBITE_CUDA_SHIM_COPY_DELAY_US"] {
        cmd.env_remove(var);
    }
    cmd.env(ROLE, role).envs(env.iter().copied()).stdin(Stdio::null());
    cmd
}

/// Runs [`child`] to completion; panics with its output unless it exited 0.
#[track_caller]
pub fn run_child(test: &str, role: &str, env: &[(&str, &str)]) -> Output {
    let out = child(test, role, env).output().expect("spawn child");
    assert!(
        out.status.success(),
        "child {role} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn from_hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

/// Asserts two byte strings are equal, reporting the first difference
/// rather than both strings.
#[track_caller]
pub fn same_bytes(actual: &[u8], expected: &[u8], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    if let Some(i) = actual.iter().zip(expected).position(|(a, b)| a != b) {
        panic!("{what}: first difference at byte {i} of {}: {} != {}", actual.len(), actual[i], expected[i]);
    }
}

/// Pinned host memory (cuMemHostAlloc) of `n` bytes, as a slice that lives
/// until `free_pinned`.
#[track_caller]
pub fn pinned(n: usize) -> &'static mut [u8] {
    let mut p = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; the mapping holds `n` bytes until
    // freed, which the caller does only after its last use.
    unsafe {
        ok(sys::cuMemHostAlloc(&mut p, n, 0));
        std::slice::from_raw_parts_mut(p.cast::<u8>(), n)
    }
}

#[track_caller]
pub fn free_pinned(b: &mut [u8]) {
    // SAFETY: a buffer from `pinned`, not used after this.
    ok(unsafe { sys::cuMemFreeHost(b.as_mut_ptr().cast()) });
}

/// A deterministic byte pattern.
pub fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}
