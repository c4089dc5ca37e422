//! OrbiTE core: a transfer engine for KV-cache bytes.
//!
//! The engine moves bytes between registered memories and never loses
//! track of who may still touch a buffer:
//!
//! * a terminal status ([`TransferStatus::Retired`]) means physical
//!   retirement: nothing of that execution can touch any buffer any more;
//! * the logical outcome ([`LogicalOutcome`]: exact prefix,
//!   [`RemoteEffect`]) is reported apart from the [`RetirementReceipt`];
//! * cancel is explicit and separate from release; release of active work
//!   is refused; dropping a handle never frees what a transfer may use;
//! * deregistration fences at once and defers cleanup to the last borrower;
//! * every object is charged to a bounded budget ([`Stats`]) and refunded
//!   only when it is destroyed;
//! * nothing is replayed; idle workers block.
//!
//! Start with [`TransferEngine`]:
//!
//! ```
//! use orbite_core::*;
//! use std::time::Duration;
//!
//! let engine = TransferEngine::from_json(r#"{"max_bytes_in_flight": 268435456}"#)?;
//! let src = engine.allocate_host_memory(1 << 20)?;
//! let dst = engine.allocate_host_memory(1 << 20)?;
//! let ids = engine.register_memory_ranges(vec![
//!     MemoryRange::host(&src, 0, 1 << 20, Permission::LocalOnly)?,
//!     MemoryRange::host(&dst, 0, 1 << 20, Permission::RemoteReadWrite)?,
//! ])?;
//! let local = [Desc::new(ids[0], 0, 4096)];
//! let remote = [Desc::new(ids[1], 8192, 4096)];
//! let transfer = engine.prepare(&TransferSpec::new(Op::Write, &local, &remote, Target::Loopback))?;
//! transfer.post()?;
//! let result = transfer.wait(Duration::from_secs(1)).result().expect("retired");
//! assert!(result.outcome.is_success());
//! assert_eq!(result.outcome.transferred_prefix, 4096);
//! transfer.release().expect("retired, so release is allowed");
//! assert_eq!(engine.stats().executions, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]

pub mod admission;
pub mod batch;
mod charge;
pub mod codec;
pub mod config;
pub mod cuda;
pub mod discovery;
pub mod endpoint;
mod engine;
pub mod error;
pub mod file;
#[doc(hidden)]
pub mod fuzzing;
pub mod logs;
pub mod memory;
mod registry;
pub mod segment;
pub mod session;
mod time;
mod transport;
pub mod types;
pub mod verbs;
pub mod wire;

pub use batch::{
    BatchError, Desc, ExecutionPhase, LogicalOutcome, OutcomeCode, RemoteEffect, RetirementReceipt, TransferOptions,
    TransferResult, TransferStatus,
};
pub use charge::Stats;
pub use config::{AuthConfig, ConfigError, EngineConfig};
pub use engine::{
    BindingCharge, CloseReport, MetricFamily, MetricsSource, Notification, RangePin, ReleaseRefused, RemoteSegment,
    Target, Transfer, TransferEngine, TransferSpec, UnquiescedExecution,
};
pub use error::Error;
pub use memory::{CudaMemory, HostMemory, MemoryError, MemoryRange, OwnerRelease};
pub use registry::RegistryError;
pub use transport::PeerError;
pub use types::{
    Exhausted, Intent, Op, Permission, RegistrationId, Resource, Route, RouteChoice, RoutePolicy, TargetOf,
};

/// Test-only fault hooks (feature `fault-injection`).
#[cfg(feature = "fault-injection")]
pub mod fault {
    pub use crate::transport::fault::{FaultDirective, FaultHooks, IpcForgery};
}
