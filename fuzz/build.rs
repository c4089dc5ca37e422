//! Builds the NIXL plugin's own parsers (the C++ of nixl-plugin/) into the
//! fuzz targets when a NIXL source tree is there to compile them against
//! (`NIXL_SRC`, else /opt/nixl-src, as scripts/nixl-tests finds it). The
//! shim includes orbite_backend.cpp whole, so the parsers are the plugin's
//! own code, not copies. Without a tree the targets fuzz the Rust side only
//! and say so (cfg `orbite_fuzz_plugin` is then unset).
//!
//! Under cargo-fuzz (cfg `fuzzing`) and with clang++ on the machine, the C++
//! is instrumented for libFuzzer's coverage too; g++ cannot emit that kind
//! of coverage, so with g++ alone the parsers run but do not guide the
//! fuzzer.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(orbite_fuzz_plugin)");
    println!("cargo::rerun-if-env-changed=NIXL_SRC");
    println!("cargo::rerun-if-changed=cxx/plugin_shim.cpp");
    println!("cargo::rerun-if-changed=../nixl-plugin");
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let root = manifest.parent().expect("fuzz/ is inside the repository").to_path_buf();
    let nixl = PathBuf::from(std::env::var("NIXL_SRC").unwrap_or_else(|_| "/opt/nixl-src".into()));
    if !nixl.join("src/api/cpp/backend/backend_engine.h").is_file() {
        println!(
            "cargo::warning=no NIXL source tree at {} (set NIXL_SRC): the plugin's C++ parsers are not fuzzed",
            nixl.display()
        );
        return;
    }
    let mut build = cc::Build::new();
    build.cpp(true).std("c++20").file(manifest.join("cxx/plugin_shim.cpp"));
    // compat/ first: it stands in for NIXL's logging header, as in the
    // plugin's own build (nixl-plugin/meson.build).
    build.include(root.join("nixl-plugin/compat")).include(root.join("nixl-plugin")).include(root.join("include"));
    for dir in ["src/api/cpp", "src/api/cpp/backend", "src/core/telemetry", "src/utils"] {
        build.flag("-isystem").flag(nixl.join(dir).to_string_lossy().as_ref());
    }
    let fuzzing = std::env::var_os("CARGO_CFG_FUZZING").is_some();
    if fuzzing && let Some(clang) = find("clang++") {
        build.compiler(clang);
        build.flag("-fsanitize-coverage=inline-8bit-counters,pc-table,trace-cmp");
    } else if fuzzing {
        println!("cargo::warning=no clang++: the plugin's C++ parsers run uninstrumented (no coverage feedback)");
    }
    build.warnings(false).compile("orbite_fuzz_plugin");
    println!("cargo::rustc-cfg=orbite_fuzz_plugin");
}

/// A program on PATH.
fn find(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| Path::new(p).is_file())
}
