//! `orbite`: the OrbiTE command line.
//!
//! `orbite bench` measures the engine on this machine against in-run
//! references (see `docs/bench.md`); `orbite copy` runs one local transfer
//! and says what it moved and how fast; `orbite info` says what an engine
//! created for a deployment would listen on and advertise.

mod bench;
mod fanin;
mod info;
mod limits;
mod measure;
mod refresh;
mod rig;
#[cfg(feature = "grpc")]
mod rpc;
#[cfg(feature = "grpc")]
mod serve;
mod sessions;
mod watchers;

use std::process::ExitCode;

const USAGE: &str = "\
usage: orbite <command> [options]

commands:
  bench   run the benchmark workloads against in-run references
          --route LIST          local, shm, cma, tcp, auto or all (default all =
                                local,shm,cma,tcp); peer routes spawn their
                                target as a child process on loopback
          --workload LIST       comma list of W1,W2,W3,idle,sessions,refresh,
                                watchers,fan-in,rpc (default: all; rpc needs
                                a build with --features grpc)
          --quick               short run (under 30 s)
          --blocks LIST         W1 descriptor sizes in bytes, comma list
                                (default 4 KiB, 16 KiB, 64 KiB, 1 MiB, 16 MiB)
          --ops LIST            write, read or write,read (default) for W1, W3
          --config JSON         engine configuration fields to use (both sides)
          --json                print only JSON lines on stdout
  info    what an engine created as the NIXL backend creates it would
          listen on, advertise and offer on this host (it starts one)
          --config JSON|@FILE   the configuration (default: $ORBITE_CONFIG,
                                a JSON object or @file; unset: defaults)
          --json                one JSON object instead of text
  serve   run an engine and the KV session service over gRPC (built with
          --features grpc): OpenEngineKv of proto/orbite/kv/v1
          --listen HOST:PORT    where the gRPC service listens (port 0 picks one)
          --config JSON|@FILE   {\"engine\": {..}, \"sessions\": {..}, \"kv_pool_bytes\",
                                \"reaper_period_ms\", \"drain_timeout_ms\",
                                \"max_message_bytes\"} (docs/api.md)
  copy    run one local transfer and print what moved and how fast
          --bytes N             bytes to move (default 268435456)
          --block N             descriptor size in bytes (default 1048576)
  help    print this text
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        None | Some("bench") => bench::BenchArgs::parse(args.get(1..).unwrap_or(&[])).and_then(bench::run),
        Some("copy") => copy(&args[1..]),
        Some("info") => info::InfoArgs::parse(&args[1..]).and_then(info::run),
        Some("bench-target") => rig::serve_target(),
        #[cfg(feature = "grpc")]
        Some("serve") => serve::ServeArgs::parse(&args[1..]).and_then(serve::run),
        #[cfg(not(feature = "grpc"))]
        Some("serve") => Err("this orbite was built without the KV session service: \
                              cargo build --release --features grpc (needs protoc)"
            .into()),
        Some("bench-fanin") => fanin::initiator(&args[1..]),
        Some("help" | "-h" | "--help") => {
            print!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(format!("unknown command `{other}`\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("orbite: {e}");
            ExitCode::FAILURE
        }
    }
}

fn copy(args: &[String]) -> Result<(), String> {
    let mut bytes: u64 = 256 << 20;
    let mut block: u64 = 1 << 20;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value =
            || it.next().ok_or(format!("{a} needs a value"))?.parse::<u64>().map_err(|e| format!("{a}: {e}"));
        match a.as_str() {
            "--bytes" => bytes = value()?,
            "--block" => block = value()?,
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    if bytes == 0 || block == 0 || bytes % block != 0 {
        return Err("--bytes must be a nonzero multiple of --block".into());
    }
    let r = measure::one_local_copy(bytes, block)?;
    println!(
        "moved {} bytes in {} descriptors of {} bytes, local route: {:.3} ms ({:.2} GB/s), prepare {:.1} us, bytes verified: {}",
        bytes,
        bytes / block,
        block,
        r.seconds * 1e3,
        bytes as f64 / r.seconds / 1e9,
        r.prep_us,
        r.verified
    );
    if r.verified { Ok(()) } else { Err("destination bytes differ from the source".into()) }
}
