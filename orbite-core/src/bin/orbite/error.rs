//! Why a flag's value was refused ([`ValueError`], which clap prints with
//! the flag's name).

use std::io;
use std::num::ParseIntError;
use std::path::PathBuf;

use orbite_core::ConfigError;

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
