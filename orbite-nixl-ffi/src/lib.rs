//! C ABI of OrbiTE, the boundary the NIXL `ORBITE` backend calls.
//!
//! Opt-in: a default build of `orbite-core` neither exports nor links this
//! crate. The header `include/orbite/nixl.h` is generated from these
//! declarations by cbindgen (see `build.rs`); docs/c-abi.md explains the
//! rules in prose.
//!
//! Every entry point:
//! * catches panics at the boundary and returns [`OrbiteStatus::Internal`];
//! * returns a typed [`OrbiteStatus`], with a message for
//!   [`orbite_last_error`] on failure;
//! * checks handles (kind, generation, engine), record sizes and versions,
//!   array lengths against the engine's limits and all arithmetic before
//!   anything is allocated, charged or admitted;
//! * writes outputs only on success, into storage the caller owns.
//!
//! No lock of this library is held while the engine runs (and so while a
//! caller's release callback may run).
//!
//! Every entry point that takes a raw pointer (directly, or inside a record
//! it reads) is an `unsafe extern "C" fn` whose `# Safety` section says what
//! the caller guarantees beyond the checks above: which memory is readable
//! or writable, for how long, and that no other thread writes it during the
//! call. Entry points that take only handles and integers are safe. Rust
//! callers of the rlib call the unsafe ones in `unsafe` blocks and uphold
//! those sections; each `unsafe` block inside this crate says which
//! invariant it relies on.

#![warn(missing_docs)]

mod api;
#[doc(hidden)]
pub mod fuzzing;
mod handles;
mod logging;
mod objects;
mod records;
mod status;
mod wire;

pub use api::*;
pub use records::*;
pub use status::OrbiteStatus;

/// ABI major. A breaking change takes a new major and a new SONAME
/// (`liborbite_nixl.so.<major>`).
pub const ORBITE_ABI_MAJOR: u32 = 1;
/// ABI minor: additive changes (new entry points, new feature bits, new
/// record versions negotiated by size).
pub const ORBITE_ABI_MINOR: u32 = 6;
