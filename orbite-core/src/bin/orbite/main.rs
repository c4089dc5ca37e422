//! `orbite`: the OrbiTE command line.
//!
//! `orbite bench` measures the engine on this machine against in-run
//! references (see `docs/bench.md`); `orbite copy` runs one local transfer
//! and says what it moved and how fast; `orbite info` says what an engine
//! created for a deployment would listen on and advertise.

mod bench;
mod error;
mod fanin;
mod info;
mod limits;
mod measure;
mod plot;
mod refresh;
mod rig;
#[cfg(feature = "grpc")]
mod rpc;
#[cfg(feature = "grpc")]
mod serve;
mod sessions;
mod watchers;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::error::Error;

/// The OrbiTE transfer engine's command line.
#[derive(Debug, Parser)]
#[command(
    name = "orbite",
    about = "OrbiTE transfer engine: benchmark, one local copy, a host's deployment check, the KV session service",
    after_help = "Without a command, `orbite` runs `orbite bench` with its defaults."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the benchmark workloads against in-run references (docs/bench.md)
    Bench(Box<bench::BenchArgs>),
    /// Run one local transfer and print what moved and how fast
    Copy(CopyArgs),
    /// Say what an engine created as the NIXL backend creates it would
    /// listen on, advertise and offer on this host (it starts one)
    Info(info::InfoArgs),
    /// Run an engine and the KV session service over gRPC: OpenEngineKv of
    /// proto/orbite/kv/v1 (built with --features grpc)
    Serve(ServeArgs),
    /// The target process of a peer route's bench rig (`orbite bench`
    /// starts it): commands on stdin, answers on stdout
    #[command(hide = true)]
    BenchTarget,
    /// One initiator of the fan-in workload (`orbite bench` starts them)
    #[command(hide = true)]
    BenchFanin(fanin::InitiatorArgs),
}

impl Cli {
    /// The command to run: `orbite` alone is `orbite bench` with its
    /// defaults.
    fn into_command(self) -> Command {
        self.command.unwrap_or_else(|| Command::Bench(Box::new(bench::BenchArgs::parse_from(["orbite bench"]))))
    }
}

#[derive(Debug, Args)]
#[command(args_override_self = true)]
struct CopyArgs {
    /// Bytes to move
    #[arg(long, value_name = "N", default_value_t = 256 << 20)]
    bytes: u64,
    /// Descriptor size in bytes (--bytes must be a multiple of it)
    #[arg(long, value_name = "N", default_value_t = 1 << 20)]
    block: u64,
}

#[cfg(feature = "grpc")]
use serve::ServeArgs;

/// `orbite serve` in a build without the KV session service: whatever
/// follows is taken, and the command says how to build one.
#[cfg(not(feature = "grpc"))]
#[derive(Debug, Args)]
struct ServeArgs {
    #[arg(hide = true, trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    ignored: Vec<std::ffi::OsString>,
}

fn main() -> ExitCode {
    // What the engine says goes to stderr, warnings and worse unless
    // ORBITE_LOG says otherwise.
    if log::set_logger(&orbite_core::logs::Stderr).is_ok() {
        log::set_max_level(orbite_core::logs::level_from_env(log::LevelFilter::Warn));
    }
    let result = match Cli::parse().into_command() {
        Command::Bench(args) => bench::run((*args).into()),
        Command::Copy(args) => copy(args),
        Command::Info(args) => info::run(args),
        #[cfg(feature = "grpc")]
        Command::Serve(args) => serve::run(args).map_err(Error::from),
        #[cfg(not(feature = "grpc"))]
        Command::Serve(_) => Err(Error::NoGrpc),
        Command::BenchTarget => rig::serve_target(),
        Command::BenchFanin(args) => fanin::initiator(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("orbite: {e}");
            ExitCode::FAILURE
        }
    }
}

fn copy(CopyArgs { bytes, block }: CopyArgs) -> Result<(), Error> {
    if bytes == 0 || block == 0 || bytes % block != 0 {
        return Err(Error::CopyLayout);
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
    if r.verified { Ok(()) } else { Err(Error::CopyMismatch) }
}

/// `orbite ARGS...` as clap parses it, or clap's error.
#[cfg(test)]
fn parse(args: &[&str]) -> Result<Command, clap::Error> {
    Cli::try_parse_from(std::iter::once("orbite").chain(args.iter().copied())).map(Cli::into_command)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;
    use clap::error::ErrorKind;

    use super::{Cli, Command, CopyArgs, parse};

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn no_command_is_bench_with_its_defaults() {
        let (Ok(Command::Bench(alone)), Ok(Command::Bench(bench))) = (parse(&[]), parse(&["bench"])) else {
            panic!("not bench");
        };
        assert_eq!(format!("{alone:?}"), format!("{bench:?}"));
    }

    #[test]
    fn copy_takes_bytes_and_block() {
        let copy = |args: &[&str]| match parse(args) {
            Ok(Command::Copy(CopyArgs { bytes, block })) => (bytes, block),
            other => panic!("{other:?}"),
        };
        assert_eq!(copy(&["copy"]), (256 << 20, 1 << 20));
        assert_eq!(copy(&["copy", "--bytes", "4096", "--block", "1024"]), (4096, 1024));
        assert_eq!(copy(&["copy", "--block", "512", "--bytes", "8192", "--block", "2048"]), (8192, 2048));
        let e = parse(&["copy", "--bytes", "1k"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation);
        assert!(e.to_string().contains("--bytes"), "{e}");
        assert_eq!(parse(&["copy", "--block"]).unwrap_err().kind(), ErrorKind::InvalidValue);
    }

    #[test]
    fn unknown_flags_and_commands_are_refused() {
        for args in [&["bench", "--nope"][..], &["copy", "--bytes", "1", "extra"], &["--quick"], &["bench-target", "x"]]
        {
            let e = parse(args).unwrap_err();
            assert!(matches!(e.kind(), ErrorKind::UnknownArgument | ErrorKind::InvalidSubcommand), "{args:?}: {e}");
        }
        assert_eq!(parse(&["nope"]).unwrap_err().kind(), ErrorKind::InvalidSubcommand);
    }

    #[test]
    fn help_names_the_commands_and_hides_the_helpers() {
        let help = Cli::command().render_help().to_string();
        for c in ["bench", "copy", "info", "serve"] {
            assert!(help.contains(&format!("  {c} ")), "{c}: {help}");
        }
        assert!(!help.contains("bench-target") && !help.contains("bench-fanin"), "{help}");
        assert_eq!(parse(&["--help"]).unwrap_err().kind(), ErrorKind::DisplayHelp);
        assert_eq!(parse(&["help", "bench"]).unwrap_err().kind(), ErrorKind::DisplayHelp);
        assert!(matches!(parse(&["bench-target"]), Ok(Command::BenchTarget)));
    }

    #[cfg(not(feature = "grpc"))]
    #[test]
    fn serve_without_grpc_takes_anything_and_fails_at_run() {
        assert!(matches!(parse(&["serve", "--listen", "127.0.0.1:0", "--config", "{}"]), Ok(Command::Serve(_))));
    }
}
