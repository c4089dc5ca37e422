//! Runs a target's body over inputs without libFuzzer (a plain build, with
//! ordinary panics and backtraces): `cargo run --manifest-path
//! fuzz/Cargo.toml --example replay TARGET FILE_OR_DIR...`.

fn main() {
    let mut args = std::env::args().skip(1);
    let target = args.next().expect("usage: replay TARGET FILE_OR_DIR...");
    let run: fn(&[u8]) = match target.as_str() {
        "wire" => orbite_fuzz::wire::run,
        "server" => orbite_fuzz::server::run,
        "segment" => orbite_fuzz::segment::run,
        "notify" => orbite_fuzz::notify::run,
        "inbox" => orbite_fuzz::inbox::run,
        "config" => orbite_fuzz::config::run,
        "metadata" => orbite_fuzz::metadata::run,
        "abi" => orbite_fuzz::abi::run,
        t => panic!("no target {t}"),
    };
    let mut n = 0;
    for arg in args {
        let path = std::path::PathBuf::from(arg);
        let files: Vec<_> = if path.is_dir() {
            let mut v: Vec<_> = std::fs::read_dir(&path).expect("readable").flatten().map(|e| e.path()).collect();
            v.sort();
            v
        } else {
            vec![path]
        };
        for f in files {
            eprintln!("{target}: {}", f.display());
            run(&std::fs::read(&f).expect("readable"));
            n += 1;
        }
    }
    println!("{target}: {n} inputs ran");
}
