//! The verbs loader in this process against the test verbs library: every
//! device list it takes is freed and every device it opens is closed
//! (the shim's counters back to zero), listing twice gives the same NICs.
//!
//! One test in this binary: it sets the library's variables before any
//! thread reads the environment.

use std::ffi::c_int;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct ShimStats {
    device_lists: i64,
    contexts: i64,
}

#[test]
fn listing_nics_closes_what_it_opens() {
    let path = std::env::var_os("ORBITE_VERBS_SHIM").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/liborbite_verbs_shim.so")
    });
    if !path.exists() {
        assert!(std::env::var_os("ORBITE_VERBS_REQUIRED").is_none(), "no verbs shim at {}", path.display());
        println!("SKIP: no verbs shim at {} (scripts/verbs-shim builds it)", path.display());
        return;
    }
    let devices = r#"[{"name": "a", "ports": [{"state": "active"}]}, {"name": "b", "ports": [{"state": "init"}]}]"#;
    // SAFETY: the only test of this binary, before any other thread runs.
    unsafe {
        std::env::set_var("ORBITE_IBVERBS_LIB", &path);
        std::env::set_var("ORBITE_VERBS_SHIM_DEVICES", devices);
    }
    let first = orbite_core::verbs::nics().expect("the shim's NICs");
    assert_eq!(first.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(orbite_core::verbs::nics().unwrap(), first, "the same NICs each time");
    // The loader's handle and this one are the same library.
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path; the handle is never closed.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    assert!(!handle.is_null(), "the loader loaded the shim");
    // SAFETY: a live handle, a NUL-terminated name.
    let stats = unsafe { libc::dlsym(handle, c"orbite_verbs_shim_stats".as_ptr()) };
    assert!(!stats.is_null());
    // SAFETY: the shim's export of this signature.
    let stats: unsafe extern "C" fn(*mut ShimStats) -> c_int = unsafe { std::mem::transmute(stats) };
    let mut s = ShimStats { device_lists: -1, contexts: -1 };
    // SAFETY: a struct of the shim's layout.
    assert_eq!(unsafe { stats(&mut s) }, 0);
    assert_eq!(s, ShimStats::default(), "every list freed, every device closed");
}
