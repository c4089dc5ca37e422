//! Peers: segments opened on other engines, the target side this engine
//! offers them, and notifications.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard};

use crate::error::PeerError;
use crate::segment::{Delta, SegmentView};
use crate::transport::CopyJob;
use crate::transport::link::{ANNOUNCE_UNKNOWN, PeerLink};
use crate::transport::mapping::{SharedMaps, ShmMapping, unmapped};
use crate::transport::peer_errors::{ImportError, LocalError};
use crate::transport::proto::client::{ControlJob, PeerJob};
use crate::transport::routes::{PeerReach, SameHost};
use crate::wire::Kind;

pub(crate) struct PeerState {
    close: Option<Result<(), PeerError>>,
}

/// This engine's current picture of one peer's registrations: its
/// description at open, brought up to date by refreshes.
pub(crate) struct PeerView {
    pub segment: SegmentView,
    /// For a same-host peer: its shared allocations mapped here (or why not).
    pub maps: SharedMaps,
    /// For a same-host peer: its device registrations opened here through
    /// CUDA IPC (or why not).
    pub imports: crate::transport::mapping::Imports,
}

/// One opened peer epoch.
pub(crate) struct Peer<J: CopyJob> {
    pub link: Arc<PeerLink<J>>,
    pub endpoint: String,
    pub epoch: u64,
    /// The peer's registrations as this engine knows them. Prepare holds
    /// the read lock while it resolves descriptors; a refresh takes the
    /// write lock only to apply what the peer sent.
    view: RwLock<PeerView>,
    /// Serialises refreshes (never taken by posts or polls); counts the
    /// refreshes done, so that callers who waited for one can look again
    /// before asking once more.
    pub(crate) refresh_lock: Mutex<u64>,
    /// `Err(why)` when the peer is not proven to run on this host.
    pub same_host: Result<SameHost, LocalError>,
    /// For a same-host peer: whether its process still runs.
    pub liveness: Option<crate::transport::liveness::PeerLiveness>,
    /// For a same-host peer: its notification inbox, mapped here.
    pub inbox: Option<(Arc<ShmMapping>, crate::transport::inbox::Inbox)>,
    /// Shared allocations the peer added that are not mapped yet (mapped
    /// on a caller's thread, by [`Peer::map_pending`]: never on a driver).
    pending: Mutex<std::collections::HashSet<String>>,
    /// Device registrations the peer added that are not imported yet
    /// (imported with the pending mappings).
    pending_ipc: Mutex<std::collections::HashSet<u64>>,
    has_pending: std::sync::atomic::AtomicBool,
    map_lock: Mutex<()>,
    state: Mutex<PeerState>,
    /// Set by `close_segment`: no new work.
    fenced: std::sync::atomic::AtomicBool,
    /// The epoch of a newer peer opened on the same endpoint (0: none).
    pub(crate) superseded_by: AtomicU64,
    active: AtomicU64,
    drain_lock: Mutex<()>,
    drained: Condvar,
}

impl<J: CopyJob> Peer<J> {
    /// A peer just opened over `link`, with its first view.
    pub fn new(
        link: Arc<PeerLink<J>>,
        endpoint: &str,
        view: PeerView,
        same_host: Result<SameHost, LocalError>,
        liveness: Option<crate::transport::liveness::PeerLiveness>,
        inbox: Option<(Arc<ShmMapping>, crate::transport::inbox::Inbox)>,
    ) -> Self {
        let ipc: std::collections::HashSet<u64> =
            crate::transport::routes::importable(&same_host, view.segment.registrations().values());
        let has_pending = !ipc.is_empty();
        Peer {
            pending_ipc: Mutex::new(ipc),
            liveness,
            inbox,
            endpoint: endpoint.to_owned(),
            epoch: link.descriptor.epoch,
            same_host,
            link,
            view: RwLock::new(view),
            pending: Mutex::new(std::collections::HashSet::new()),
            has_pending: std::sync::atomic::AtomicBool::new(has_pending),
            map_lock: Mutex::new(()),
            refresh_lock: Mutex::new(0),
            state: Mutex::new(PeerState { close: None }),
            fenced: std::sync::atomic::AtomicBool::new(false),
            superseded_by: AtomicU64::new(0),
            active: AtomicU64::new(0),
            drain_lock: Mutex::new(()),
            drained: Condvar::new(),
        }
    }

    /// Why new work may not start on this peer, if it may not.
    /// The peer's deregistration count, read from its mapped inbox.
    pub fn fences(&self) -> Option<u64> {
        self.inbox.as_ref().map(|(_, i)| i.fences())
    }

    pub fn refusal(&self) -> Option<PeerError> {
        // Atomics only: this runs on every post.
        if self.fenced.load(Ordering::Acquire) {
            return Some(PeerError::SegmentClosed);
        }
        if self.link.is_lost() {
            return Some(PeerError::Lost(self.link.lost().unwrap_or_default()));
        }
        match self.superseded_by.load(Ordering::Acquire) {
            0 => None,
            found => Some(PeerError::EpochMismatch { expected: self.epoch, found }),
        }
    }

    pub fn execution_started(&self) {
        self.active.fetch_add(1, Ordering::AcqRel);
    }

    pub fn execution_retired(&self) {
        self.active.fetch_sub(1, Ordering::AcqRel);
        let _g = self.drain_lock.lock();
        self.drained.notify_all();
    }

    pub fn close(&self, timeout: Duration) -> Result<(), PeerError> {
        {
            let st = self.state.lock();
            if let Some(result) = &st.close {
                return result.clone(); // sticky: never retried
            }
            self.fenced.store(true, Ordering::Release);
        }
        let deadline = crate::time::deadline_after(timeout);
        let mut g = self.drain_lock.lock();
        while self.active.load(Ordering::Acquire) > 0 {
            if self.drained.wait_until(&mut g, deadline).timed_out() {
                break;
            }
        }
        drop(g);
        let left = self.active.load(Ordering::Acquire);
        let result = if left == 0 {
            self.link.close();
            Ok(())
        } else {
            Err(PeerError::CloseFailed(format!("{left} admitted executions did not retire in time")))
        };
        self.state.lock().close = Some(result.clone());
        result
    }
}

impl<J: CopyJob> Peer<J> {
    /// What routes see of this peer, through `view` (a read guard of its
    /// view, held while a prepare resolves descriptors).
    pub fn reach<'a>(&'a self, view: &'a PeerView) -> PeerReach<'a> {
        PeerReach {
            segment: &view.segment,
            maps: &view.maps,
            same_host: self.same_host.as_ref(),
            alive: self.liveness.as_ref(),
            imports: &view.imports,
        }
    }

    /// The current view of the peer's registrations.
    pub fn view(&self) -> RwLockReadGuard<'_, PeerView> {
        self.view.read()
    }

    /// Applies changes computed after registry version `base` to the view;
    /// false if they leave a gap or are malformed. Shared allocations they
    /// bring are noted, and mapped by the next [`Peer::map_pending`].
    pub fn apply(&self, base: u64, delta: Delta) -> bool {
        // Old news (a pull already brought the view past it) takes no
        // write lock.
        if !delta.reset && delta.version <= self.view().segment.version {
            return true;
        }
        let fresh = if self.same_host.is_ok() { unmapped(&self.view().maps, &delta.added) } else { Vec::new() };
        let fresh_ipc = crate::transport::routes::importable(&self.same_host, delta.added.iter());
        let applied = {
            let mut v = self.view.write();
            let applied = v.segment.apply_from(base, delta).is_ok();
            // Imports of registrations the peer gave up are closed once the
            // last program naming them is gone (they hold the mapping).
            if applied && !v.imports.is_empty() {
                let PeerView { segment, imports, .. } = &mut *v;
                imports.retain(|raw, _| segment.get(*raw).is_some());
            }
            applied
        };
        // Only what the view took is mapped (and imported) later.
        if applied && !fresh.is_empty() {
            self.pending.lock().extend(fresh);
            self.has_pending.store(true, Ordering::Release);
        }
        if applied && !fresh_ipc.is_empty() {
            self.pending_ipc.lock().extend(fresh_ipc);
            self.has_pending.store(true, Ordering::Release);
        }
        applied
    }

    /// Maps the shared allocations the peer added since the last call (on
    /// the caller's thread: it asks the peer over its local socket, within
    /// the peer timeout). Concurrent callers wait for one another.
    pub fn map_pending(&self) {
        if !self.has_pending.load(Ordering::Acquire) {
            return;
        }
        let _one = self.map_lock.lock();
        if !self.has_pending.swap(false, Ordering::AcqRel) {
            return;
        }
        let names: Vec<String> = self.pending.lock().drain().collect();
        let mapped = crate::transport::routes::map_shared(&names, |names| self.link.fetch_shared(names));
        let ids: Vec<u64> = self.pending_ipc.lock().drain().collect();
        let imported = self.import_device(&ids);
        let mut v = self.view.write();
        for (name, m) in mapped {
            v.maps.entry(name).or_insert(m);
        }
        for (raw, i) in imported {
            // Only registrations still in the view.
            if v.segment.get(raw).is_some() {
                v.imports.entry(raw).or_insert(i);
            }
        }
    }

    /// Opens the peer's device registrations `ids` through CUDA IPC
    /// (`routes::import_device`), at their lengths in the current view.
    fn import_device(&self, ids: &[u64]) -> Vec<(u64, Result<Arc<crate::transport::mapping::Imported>, ImportError>)> {
        let lens: Vec<Option<u64>> = {
            let v = self.view();
            ids.iter().map(|raw| v.segment.get(*raw).map(|r| r.len)).collect()
        };
        crate::transport::routes::import_device(&self.same_host, ids, &lens, |ids| self.link.fetch_ipc(ids))
    }

    /// True when the peer announced registry changes this view has not
    /// seen (or can no longer announce them).
    pub fn view_is_behind(&self) -> bool {
        let announced = self.link.announced();
        announced == ANNOUNCE_UNKNOWN || announced > self.view.read().segment.version
    }
}

impl<J: CopyJob> Drop for Peer<J> {
    fn drop(&mut self) {
        // Nothing references this peer any more: no execution can be active.
        if self.state.lock().close.is_none() {
            self.link.close();
        }
    }
}

/// Registrations a same-host peer keeps alive for this engine's one-sided
/// copies; given back (asynchronously) when dropped.
pub(crate) struct RemoteLoan<J: CopyJob> {
    pub(crate) peer: Arc<Peer<J>>,
    pub(crate) id: u64,
    /// The peer's deregistration count when the loan was granted (`None`:
    /// the peer's inbox is not mapped, so every post asks again).
    pub(crate) fences: Option<u64>,
}

impl<J: CopyJob> RemoteLoan<J> {
    /// True while the peer has deregistered nothing since the loan.
    pub fn current(&self) -> bool {
        self.fences.is_some() && self.fences == self.peer.fences()
    }
}

impl<J: CopyJob> Drop for RemoteLoan<J> {
    fn drop(&mut self) {
        self.peer.link.submit(PeerJob::Control(ControlJob {
            kind: Kind::Return,
            flags: 0,
            body: self.id.to_le_bytes().to_vec(),
            done: Box::new(|_| {}),
        }));
    }
}
