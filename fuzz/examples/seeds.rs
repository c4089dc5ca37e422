//! Writes the seed corpora, corpus/<target>/seed-<n>, from the crates' own
//! encoders (run it again after a format change; files the fuzzer found
//! stay beside them). `cargo run --manifest-path fuzz/Cargo.toml --example
//! seeds [DIR]`; DIR defaults to fuzz/corpus.

use std::path::PathBuf;

/// A target's name and its seeds.
type Target = (&'static str, fn() -> Vec<Vec<u8>>);

fn main() {
    let dir = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus"));
    let targets: [Target; 8] = [
        ("wire", orbite_fuzz::wire::seeds),
        ("server", orbite_fuzz::server::seeds),
        ("segment", orbite_fuzz::segment::seeds),
        ("notify", orbite_fuzz::notify::seeds),
        ("inbox", orbite_fuzz::inbox::seeds),
        ("config", orbite_fuzz::config::seeds),
        ("metadata", orbite_fuzz::metadata::seeds),
        ("abi", orbite_fuzz::abi::seeds),
    ];
    for (name, seeds) in targets {
        let target = dir.join(name);
        std::fs::create_dir_all(&target).expect("the corpus directory is writable");
        // Seeds written before are replaced; what the fuzzer added stays.
        for entry in std::fs::read_dir(&target).expect("readable").flatten() {
            if entry.file_name().to_string_lossy().starts_with("seed-") {
                std::fs::remove_file(entry.path()).expect("removable");
            }
        }
        let seeds = seeds();
        for (i, s) in seeds.iter().enumerate() {
            std::fs::write(target.join(format!("seed-{i:02}")), s).expect("writable");
        }
        println!("{name}: {} seeds", seeds.len());
    }
}
