//! Gives the library its SONAME (`liborbite_nixl.so.<ABI major>`) and
//! generates the C header from the Rust declarations with cbindgen, into
//! OUT_DIR. The checked-in copy is include/orbite/nixl.h; a test fails when
//! the two differ (`ORBITE_BLESS_HEADER=1 cargo test -p orbite-nixl-ffi`
//! rewrites it).

use std::path::PathBuf;

fn main() {
    let crate_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let lib = std::fs::read_to_string(crate_dir.join("src/lib.rs")).expect("src/lib.rs");
    let major = lib
        .lines()
        .find_map(|l| l.strip_prefix("pub const ORBITE_ABI_MAJOR: u32 = ")?.strip_suffix(';'))
        .expect("ORBITE_ABI_MAJOR in src/lib.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,liborbite_nixl.so.{major}");
    }
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it")).join("nixl.h");
    cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("header generation")
        .write_to_file(out);
}
