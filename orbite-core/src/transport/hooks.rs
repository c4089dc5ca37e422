//! The one hook interface of the engine: where a test may interfere with
//! a task, a peer request or a same-host probe. Every method defaults to
//! doing nothing; an engine built without the `fault-injection` feature
//! has no hooks at all, and its routes skip the single call point.

// Only the test build implements the hooks.
#![cfg_attr(not(feature = "fault-injection"), allow(dead_code))]

use std::sync::Arc;

/// What the local route does with a task it is about to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultDirective {
    /// Copy normally.
    Run,
    /// Do not start it; keep it until released.
    Hold,
    /// Copy at most `bytes`, then report a short completion.
    Short {
        /// Bytes copied before stopping.
        bytes: u64,
    },
    /// Copy at most `bytes`, then report failure.
    Fail {
        /// Bytes copied before failing.
        bytes: u64,
        /// Whether to report that more may have been written.
        effect_unknown: bool,
    },
}

/// Gives a held task back to the route that held it, with the directive
/// to apply when it starts.
pub(crate) trait Requeue<J>: Send + Sync {
    fn requeue(&self, job: J, directive: FaultDirective);
}

/// The hooks. `J` is the route's job type.
pub(crate) trait Hooks<J>: Send + Sync {
    /// The directive for the next task the local route starts; called in
    /// the order the route received its tasks.
    fn task_directive(&self) -> FaultDirective {
        FaultDirective::Run
    }

    /// Keeps a task its directive held (it has touched no byte), to be
    /// given back through `back`; or returns it, to run now.
    fn hold(&self, job: J, back: Arc<dyn Requeue<J>>) -> Option<J> {
        let _ = back;
        Some(job)
    }

    /// Runs on a target after a peer request was validated (its range
    /// loans taken) and before any of its bytes move.
    fn before_remote_bytes(&self) {}

    /// True while a target keeps its registration changes from its
    /// watchers (they go out once it stops).
    fn pushes_withheld(&self) -> bool {
        false
    }

    /// Sees the CMA probe of a same-host peer and may replace its result.
    fn cma_probe(
        &self,
        probe: Result<(), crate::transport::peer_errors::CmaRefused>,
    ) -> Result<(), crate::transport::peer_errors::CmaRefused> {
        probe
    }

    /// May rewrite this engine's answer to a peer's request for CUDA IPC
    /// handles (entries and the descriptors that go with them) before it
    /// is sent: a hostile target, for tests of the importer.
    fn ipc_answer(&self, entries: &mut Vec<crate::wire::IpcEntry>, fds: &mut Vec<std::os::fd::OwnedFd>) {
        let _ = (entries, fds);
    }

    /// The hooks as `Any`, for the test handle.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}
