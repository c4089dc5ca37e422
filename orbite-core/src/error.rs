//! The error of the engine: each layer owns its error enum, and [`Error`]
//! joins them.
//!
//! Every error a caller can provoke is typed: nothing reachable from a
//! caller, a peer or the C ABI panics. Boundaries (the C ABI, the NIXL
//! plugin) map these once to their own status codes.

pub use crate::batch::BatchError;
pub use crate::config::ConfigError;
pub use crate::file::FileError;
pub use crate::memory::MemoryError;
pub use crate::registry::RegistryError;
pub use crate::transport::PeerError;
pub use crate::types::{Exhausted, Resource};

/// Any error of the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Registry error.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// Transfer lifecycle error.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// Peer or segment error.
    #[error(transparent)]
    Peer(#[from] PeerError),
    /// A bounded resource is exhausted; nothing was allocated or admitted.
    #[error("resource exhausted: {resource} (limit {limit}, requested {requested})")]
    ResourceExhausted {
        /// Which budget.
        resource: Resource,
        /// Its configured limit.
        limit: u64,
        /// What the refused request would have brought the charge to.
        requested: u64,
    },
    /// A local file refused the operation.
    #[error(transparent)]
    File(#[from] FileError),
    /// The engine is closing or closed; it takes no new work.
    #[error("engine is closed")]
    Closed,
    /// Operating system error (thread spawn, allocation).
    #[error("system error: {0}")]
    System(String),
    /// Finding a peer by name, or publishing this engine's, failed.
    #[error(transparent)]
    Discovery(#[from] crate::discovery::DiscoveryError),
    /// Not supported by this build or on this machine (VRAM without
    /// feature `cuda`, a driver or a device; a transfer no route can
    /// serve); the reason names what is missing. Nothing changed.
    #[error("not supported: {0}")]
    NotSupported(String),
}

impl From<Exhausted> for Error {
    fn from(e: Exhausted) -> Self {
        Error::ResourceExhausted { resource: e.resource, limit: e.limit, requested: e.requested }
    }
}

impl From<MemoryError> for Error {
    fn from(e: MemoryError) -> Self {
        match e {
            MemoryError::InvalidRange(reason) => Error::Registry(RegistryError::InvalidRange(reason)),
            MemoryError::Exhausted(x) => x.into(),
            MemoryError::System(reason) => Error::System(reason),
            MemoryError::NotSupported(reason) => Error::NotSupported(reason),
        }
    }
}

/// Result alias of the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;
