//! cudarc's loader finds the shim and resolves everything it expects;
//! every listed name is exported; stubs answer as documented.

mod common;

use std::ffi::CString;

use common::*;

/// The child-process entry point: does nothing in a normal run.
#[test]
fn child_entry() {
    match role().as_deref() {
        None => {}
        Some("stub-before-init") => {
            assert!(available());
            let f = stub("cuModuleLoad");
            // SAFETY: the stub takes no arguments.
            assert_eq!(unsafe { f() }, 3, "a stub before cuInit is NOT_INITIALIZED");
            println!("CHILD-OK");
        }
        Some(other) => panic!("unknown role {other}"),
    }
}

fn stub(name: &str) -> unsafe extern "C" fn() -> i32 {
    let sym = symbol(&CString::new(name).expect("name"));
    assert!(!sym.is_null(), "{name} is not exported");
    // SAFETY: the shim's stubs are `extern "C" fn() -> i32`.
    unsafe { std::mem::transmute::<*mut std::ffi::c_void, unsafe extern "C" fn() -> i32>(sym) }
}

#[test]
fn cudarc_loads_the_shim() {
    need_shim!();
    // SAFETY: plain loader calls.
    unsafe {
        assert!(sys::is_culib_present());
        let _lib = sys::culib();
    }
}

#[test]
fn every_listed_symbol_is_exported() {
    need_shim!();
    let list = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/symbols.txt")).expect("symbols.txt");
    let names: Vec<&str> = list.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    assert!(names.len() > 400, "symbols.txt lists {} names", names.len());
    let missing: Vec<&str> =
        names.iter().copied().filter(|n| symbol(&CString::new(*n).expect("name")).is_null()).collect();
    assert!(missing.is_empty(), "not exported: {missing:?}");
}

#[test]
fn stubs_are_not_supported_after_init() {
    need_shim!();
    init();
    for name in ["cuModuleLoad", "cuLaunchKernel", "cuMemAllocManaged", "cuGraphCreate", "cuStreamGetCtx"] {
        // SAFETY: the stubs take no arguments.
        assert_eq!(unsafe { stub(name)() }, 801, "{name}");
    }
}

#[test]
fn stubs_are_not_initialized_before_init() {
    need_shim!();
    let out = run_child("child_entry", "stub-before-init", &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("CHILD-OK"));
}
