//! Why an `orbite` command failed ([`Error`], printed after `orbite: `),
//! and why a flag's value was refused ([`ValueError`], which clap prints
//! with the flag's name).

use std::io;
use std::num::ParseIntError;
use std::path::PathBuf;

use orbite_core::session::KvError;
use orbite_core::wire::{Kind, WireError};
use orbite_core::{ConfigError, MemoryError, Op, TransferStatus};

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The engine refused: configuration, memory, registration, prepare,
    /// a peer.
    #[error(transparent)]
    Engine(#[from] orbite_core::Error),
    /// A memory range could not be described.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A configuration document was refused.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The KV session layer refused.
    #[error(transparent)]
    Session(#[from] KvError),
    /// A frame from an engine did not decode.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A watch connection was answered with another frame.
    #[error("a {0:?} frame in answer to a Watch")]
    UnexpectedFrame(Kind),
    /// A value could not be written as JSON.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A system call failed; `doing` says what it was for.
    #[error("cannot {doing}: {source}")]
    Io {
        /// What the call was for ("accept a loopback stream").
        doing: &'static str,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// A transfer did not retire successfully within its bound.
    #[error("transfer did not succeed: {0:?}")]
    Transfer(TransferStatus),
    /// `process_vm_writev` or `process_vm_readv` refused, or moved less
    /// than asked.
    #[error("process_vm_{op:?}: {moved} of {wanted} bytes: {source}")]
    ProcessVm {
        /// The direction.
        op: Op,
        /// What the call returned.
        moved: isize,
        /// The bytes asked for.
        wanted: u64,
        /// The system's error (meaningful when `moved` is negative).
        #[source]
        source: io::Error,
    },
    /// A thread of a reference measurement panicked.
    #[error("{0} panicked")]
    Panicked(&'static str),
    /// A helper process of the bench failed or broke its protocol.
    #[error(transparent)]
    Helper(#[from] HelperError),
    /// Device memory is not available, or the driver failed: the CUDA
    /// layer's reason.
    #[error("vram: {0}")]
    Vram(orbite_core::cuda::CudaError),
    /// Some destination bytes of a bench run did not verify.
    #[error("some destination bytes did not verify")]
    NotVerified,
    /// `--plot` with no W1 row to draw.
    #[error("--plot: no W1 row to draw (add W1 to --workload)")]
    NothingToPlot,
    /// `--plot`'s file could not be written.
    #[error("--plot {0}: {1}")]
    Plot(String, String),
    /// `orbite copy`'s destination bytes differ from its source.
    #[error("destination bytes differ from the source")]
    CopyMismatch,
    /// `orbite copy --bytes` is not a nonzero multiple of `--block`.
    #[error("--bytes must be a nonzero multiple of --block")]
    CopyLayout,
    /// `orbite serve` in a build without the KV session service.
    #[cfg(not(feature = "grpc"))]
    #[error(
        "this orbite was built without the KV session service: cargo build --release --features grpc (needs protoc)"
    )]
    NoGrpc,
    /// `orbite serve` failed.
    #[cfg(feature = "grpc")]
    #[error(transparent)]
    Serve(#[from] crate::serve::ServeError),
    /// A gRPC call of the rpc workload failed.
    #[cfg(feature = "grpc")]
    #[error("RPC failed: {0}")]
    Rpc(Box<tonic::Status>),
    /// A client of the rpc workload could not connect.
    #[cfg(feature = "grpc")]
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The server's address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// A task of the rpc workload panicked or was cancelled.
    #[cfg(feature = "grpc")]
    #[error("a client task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

#[cfg(feature = "grpc")]
impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        Error::Rpc(Box::new(s))
    }
}

/// Says what an I/O call was for: `listener.accept().doing("accept a
/// loopback stream")?`.
pub trait Doing<T> {
    /// The error as [`Error::Io`] with `doing`.
    fn doing(self, doing: &'static str) -> Result<T, Error>;
}

impl<T> Doing<T> for io::Result<T> {
    fn doing(self, doing: &'static str) -> Result<T, Error> {
        self.map_err(|source| Error::Io { doing, source })
    }
}

/// The bench's helper processes, as its messages name them: the target
/// of a peer rig (`orbite bench-target`) and a fan-in initiator
/// (`orbite bench-fanin`).
pub const TARGET: &str = "the target process";
pub const INITIATOR: &str = "an initiator";

/// The bench and its helper processes, talking over pipes, one line each
/// way at a time.
#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    /// The process could not be started.
    #[error("cannot start {helper}: {source}")]
    Spawn {
        /// Which.
        helper: &'static str,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// The process was started without the pipes asked for.
    #[error("no pipes to {0}")]
    NoPipes(&'static str),
    /// A pipe to or from the process failed.
    #[error("cannot talk to {helper}: {source}")]
    Pipe {
        /// Which.
        helper: &'static str,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// The process closed its output before answering.
    #[error("{0} exited")]
    Exited(&'static str),
    /// The process answered something other than what the protocol says
    /// (an `ERR ...` line included).
    #[error("unexpected answer from {helper}: {line}")]
    Unexpected {
        /// Which.
        helper: &'static str,
        /// The line, trimmed.
        line: String,
    },
    /// The local rig has no target process to ask.
    #[error("the local rig has no target process")]
    NoProcess,
    /// The initiator engine does not listen, so the target cannot answer
    /// its notifications.
    #[error("the initiator does not listen")]
    NotListening,
    /// A command to the target process has a field that does not parse.
    #[error("bad {field} in command `{line}`")]
    BadCommand {
        /// The field (`seed`, `off`, `len`, `epoch`, `count`).
        field: &'static str,
        /// The command line.
        line: String,
    },
    /// `vdigest` before any `vram`.
    #[error("no device memory (ask `vram` first)")]
    NoDeviceMemory,
    /// The fan-in target's segment has no registration to write into.
    #[error("the target exports nothing")]
    NothingExported,
    /// A fan-in initiator was given slices the target does not have.
    #[error("slices {first}..+{count} are outside the target region of {slices} slices")]
    SlicesOutside {
        /// The first slice.
        first: u64,
        /// How many.
        count: u64,
        /// How many the target has.
        slices: u64,
    },
}

/// Why the value of a flag (or of a helper's argument) was refused; clap
/// prints it after the flag's name and the value.
#[derive(Debug, thiserror::Error)]
pub enum ValueError {
    /// `--route`.
    #[error("unknown route `{0}` (local, shm, cma, tcp, auto, all)")]
    UnknownRoute(String),
    /// `--workload`.
    #[error("unknown workload `{0}` (W1, W2, W3, idle, sessions, refresh, watchers, fan-in, rpc, vram)")]
    UnknownWorkload(String),
    /// `--ops`.
    #[error("unknown op `{0}` (write, read)")]
    UnknownOp(String),
    /// An item of a comma list that is not a number.
    #[error("`{item}` is not a number: {source}")]
    NotANumber {
        /// The item.
        item: String,
        /// Why.
        #[source]
        source: ParseIntError,
    },
    /// `--blocks`: W1 moves 64 MiB in descriptors of each size.
    #[error("{0} does not divide 64 MiB (each size must)")]
    BlockDoesNotDivide(u64),
    /// A document that does not parse as JSON.
    #[error("not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    /// JSON that is not an object.
    #[error("needs a JSON object")]
    NotAnObject,
    /// An engine configuration the engine refuses.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `@FILE` that cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// The value of `--config JSON|@FILE`: the text given, or the file's.
pub fn config_document(value: &str) -> Result<String, ValueError> {
    match value.strip_prefix('@') {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|source| ValueError::Unreadable { path: PathBuf::from(path), source })
        }
        None => Ok(value.to_owned()),
    }
}

/// Each item of a comma list (trimmed) through `item`.
pub fn comma_list<T>(value: &str, item: impl FnMut(&str) -> Result<T, ValueError>) -> Result<Vec<T>, ValueError> {
    value.split(',').map(str::trim).map(item).collect()
}
