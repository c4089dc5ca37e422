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
use crate::transport::mapping::ShmMapping;
use crate::transport::peer_errors::LocalError;
use crate::transport::proto::client::{ControlJob, PeerJob};
use crate::transport::routes::{PeerReach, PeerStates, SameHost};
use crate::wire::Kind;

/// One opened peer epoch.
pub(crate) struct Peer<J: CopyJob> {
    pub link: Arc<PeerLink<J>>,
    pub endpoint: String,
    pub epoch: u64,
    /// The peer's registrations as this engine knows them: its
    /// description at open, brought up to date by refreshes. Prepare holds
    /// the read lock while it resolves descriptors; a refresh takes the
    /// write lock only to apply what the peer sent.
    view: RwLock<SegmentView>,
    /// What each route keeps for this peer (mappings, imports), closed
    /// with it.
    routes: PeerStates,
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
    /// One route catch-up at a time ([`Peer::map_pending`]).
    map_lock: Mutex<()>,
    /// What `close` ended with (sticky).
    closed: Mutex<Option<Result<(), PeerError>>>,
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
        view: SegmentView,
        routes: PeerStates,
        same_host: Result<SameHost, LocalError>,
        liveness: Option<crate::transport::liveness::PeerLiveness>,
        inbox: Option<(Arc<ShmMapping>, crate::transport::inbox::Inbox)>,
    ) -> Self {
        Peer {
            routes,
            liveness,
            inbox,
            endpoint: endpoint.to_owned(),
            epoch: link.descriptor.epoch,
            same_host,
            link,
            view: RwLock::new(view),
            map_lock: Mutex::new(()),
            refresh_lock: Mutex::new(0),
            closed: Mutex::new(None),
            fenced: std::sync::atomic::AtomicBool::new(false),
            superseded_by: AtomicU64::new(0),
            active: AtomicU64::new(0),
            drain_lock: Mutex::new(()),
            drained: Condvar::new(),
        }
    }

    /// The peer's deregistration count, read from its mapped inbox.
    pub fn fences(&self) -> Option<u64> {
        self.inbox.as_ref().map(|(_, i)| i.fences())
    }

    /// Why new work may not start on this peer, if it may not.
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
            let closed = self.closed.lock();
            if let Some(result) = &*closed {
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
        *self.closed.lock() = Some(result.clone());
        result
    }

    /// What routes see of this peer, through `view` (a read guard of its
    /// view, held while a prepare resolves descriptors).
    pub fn reach<'a>(&'a self, view: &'a SegmentView) -> PeerReach<'a> {
        PeerReach {
            segment: view,
            same_host: self.same_host.as_ref(),
            alive: self.liveness.as_ref(),
            states: &self.routes,
        }
    }

    /// The current view of the peer's registrations.
    pub fn view(&self) -> RwLockReadGuard<'_, SegmentView> {
        self.view.read()
    }

    /// Applies changes computed after registry version `base` to the view;
    /// false if they leave a gap or are malformed. The routes note what
    /// they bring (shared allocations, device registrations), opened by
    /// the next [`Peer::map_pending`].
    pub fn apply(&self, base: u64, delta: Delta) -> bool {
        // Old news (a pull already brought the view past it) takes no
        // write lock.
        if !delta.reset && delta.version <= self.view().version {
            return true;
        }
        let mut v = self.view.write();
        let added = delta.added.clone();
        let applied = v.apply_from(base, delta).is_ok();
        if applied {
            self.routes.changed(&v, &added);
        }
        applied
    }

    /// Opens what the routes noted since the last call (on the caller's
    /// thread: they ask the peer over its local socket, within the peer
    /// timeout). Concurrent callers wait for one another.
    pub fn map_pending(&self) {
        if !self.routes.behind() {
            return;
        }
        let _one = self.map_lock.lock();
        self.routes.catch_up(&self.view, &*self.link);
    }

    /// True when the peer announced registry changes this view has not
    /// seen (or can no longer announce them), or refused a task for a
    /// registration it no longer has.
    pub fn view_is_behind(&self) -> bool {
        let announced = self.link.announced();
        announced == ANNOUNCE_UNKNOWN || announced > self.view.read().version || self.link.lapsed()
    }
}

impl<J: CopyJob> Drop for Peer<J> {
    fn drop(&mut self) {
        // Nothing references this peer any more: no execution can be active.
        if self.closed.lock().is_none() {
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
