//! C ABI of OrbiTE for the NIXL `ORBITE` backend.
//!
//! Placeholder crate: the ABI itself (generation-checked handles, versioned
//! records, panic barrier, cbindgen header) is tracked by its own issue. It
//! exists now so that the workspace layout is the final one and so that a
//! default build of `orbite-core` provably neither exports nor links it.

/// ABI major version this crate will export once the C ABI lands.
pub const ORBITE_NIXL_ABI_MAJOR: u32 = 0;
