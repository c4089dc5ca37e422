//! The shm route: one-sided copies into a same-host peer's shared
//! allocations, mapped into this process once per peer. The peer spends no
//! CPU; it lends the ranges (a Borrow) for as long as transfers may touch
//! them.

use super::{
    Copier, LocalFetch, LocalSide, Mover, NoDeviceCopy, PeerOpening, PeerReach, PeerState, Reach, RouteImpl,
    Unreachable,
};
use crate::segment::{ExportedRegistration, SegmentView};
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, RwLock};

use crate::transport::Span;
use crate::transport::liveness::LivenessCheck;
use crate::transport::mapping::{SharedMaps, ShmMapping, map_fd, mapped_base, unmapped};
use crate::transport::peer_errors::{LocalError, ShareError};
use crate::types::{Desc, Op, Route, TaskEnd};

/// The shm route.
pub(crate) struct Shm;

/// A same-host peer's shared allocations mapped here (or why not), and
/// those it added since, mapped by the next catch-up.
pub(crate) struct ShmPeer {
    maps: RwLock<SharedMaps>,
    pending: Mutex<HashSet<String>>,
    behind: AtomicBool,
}

#[cfg(test)]
impl ShmPeer {
    pub(crate) fn maps_for_test(&self) -> parking_lot::RwLockReadGuard<'_, SharedMaps> {
        self.maps.read()
    }
}

impl PeerState for ShmPeer {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn changed(&self, _view: &SegmentView, added: &[ExportedRegistration]) {
        let fresh = unmapped(&self.maps.read(), added);
        if !fresh.is_empty() {
            self.pending.lock().extend(fresh);
            self.behind.store(true, Ordering::Release);
        }
    }

    fn behind(&self) -> bool {
        self.behind.load(Ordering::Acquire)
    }

    fn catch_up(&self, _view: &RwLock<SegmentView>, local: &dyn LocalFetch) {
        if !self.behind.swap(false, Ordering::AcqRel) {
            return;
        }
        let names: Vec<String> = self.pending.lock().drain().collect();
        let mapped = map_shared(&names, |n| local.shared(n));
        let mut maps = self.maps.write();
        for (name, m) in mapped {
            maps.entry(name).or_insert(m);
        }
    }
}

impl RouteImpl for Shm {
    fn route(&self) -> Route {
        Route::Shm
    }

    /// A proven same-host peer's shared allocations, mapped at open.
    fn open_peer(&self, peer: &PeerOpening<'_>) -> Option<Box<dyn PeerState>> {
        peer.same_host.ok()?;
        let names = unmapped(&SharedMaps::new(), &peer.descriptor.registrations);
        let maps = map_shared(&names, |n| peer.local.shared(n)).into_iter().collect();
        let (pending, behind) = (Mutex::new(HashSet::new()), AtomicBool::new(false));
        Some(Box::new(ShmPeer { maps: RwLock::new(maps), pending, behind }))
    }

    fn plan(&self, target: &Reach<'_>, remote: &[Desc]) -> Result<Mover, Unreachable> {
        let (p, _) = target.same_host_peer()?;
        let maps = p.state::<ShmPeer>(Route::Shm).ok_or(Unreachable::NotMapped)?.maps.read();
        // Each registration named is checked once (descriptors of one
        // registration usually follow one another); the shared allocations
        // they lie in are kept for a device copy to pin them.
        let mut pins: Vec<&Arc<ShmMapping>> = Vec::new();
        let mut last = None;
        for d in remote {
            let raw = d.registration.to_raw();
            if last == Some(raw) {
                continue;
            }
            last = Some(raw);
            let r = p.segment.get(raw).ok_or(Unreachable::UnknownRegistration)?;
            let (name, offset) = r.shm.as_ref().ok_or(Unreachable::NotShared)?;
            let map = maps.get(name).ok_or(Unreachable::NotMapped)?.as_ref().map_err(|_| Unreachable::MapFailed)?;
            if offset.checked_add(r.len).is_none_or(|end| end > map.len as u64) {
                return Err(Unreachable::OutsideShared);
            }
            pins.push(map);
        }
        pins.sort_unstable_by_key(|m| Arc::as_ptr(m));
        pins.dedup_by(|a, b| Arc::ptr_eq(a, b));
        let shared_pins = pins.iter().map(|m| m.pin.clone()).collect();
        Ok(Mover::Copy(Box::new(Mapped { peer_alive: p.alive.map(|l| l.handle()), shared_pins })))
    }

    fn auto_reason(&self) -> Option<&'static str> {
        Some("every target range is shared memory on this boot")
    }

    fn address(&self, target: &PeerReach<'_>, r: &ExportedRegistration) -> Result<(u64, u64), Unreachable> {
        // Addresses of its shared allocation mapped here.
        let maps = target.state::<ShmPeer>(Route::Shm).ok_or(Unreachable::NotMapped)?.maps.read();
        let base = mapped_base(&maps, r).ok_or(Unreachable::NotMapped)?;
        Ok((base, 0))
    }

    fn borrows(&self) -> bool {
        true
    }
}

/// Copies into (or out of) a same-host peer's shared allocations mapped
/// here; the peer process is checked after each task (bytes that went
/// into a dead peer's memory did not reach it).
pub(crate) struct Mapped {
    peer_alive: Option<LivenessCheck>,
    /// The target ranges' shared allocations, for a device copy to pin
    /// them for the driver (feature `cuda`).
    shared_pins: Vec<Arc<crate::cuda::HostPin>>,
}

impl Copier for Mapped {
    fn name(&self) -> &'static str {
        "copies into shared memory"
    }

    fn copy(&self, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>) {
        // SAFETY: the job retains the range loans (and mappings) of every
        // span, and the lifecycle admits each task once.
        let done = unsafe { super::loopback::copy_spans(op, spans, limit) };
        (done, crate::transport::liveness::after_one_sided(op, self.peer_alive.as_ref()))
    }

    /// Device memory on the local side: the same driver copies straight
    /// into or out of the mapping (the device reaches any host memory of
    /// this process), the mapping pinned too under `cuda_pin_host`.
    fn with_local(self: Box<Self>, local: &LocalSide<'_>) -> Result<Box<dyn Copier>, NoDeviceCopy> {
        let Some(device) = local.device else { return Ok(self) };
        let mut pins = local.pins();
        if local.pin_host {
            pins.extend(self.shared_pins);
        }
        Ok(Box::new(super::device::Device { device, pins, peer_alive: self.peer_alive }))
    }
}

/// Maps a proven same-host peer's shared allocations `names`, their
/// descriptors asked of the peer with `fetch` (over its local socket):
/// each mapping, or why not.
pub(crate) fn map_shared(
    names: &[String],
    fetch: impl FnOnce(&[&str]) -> Result<Vec<Result<std::os::fd::OwnedFd, ShareError>>, LocalError>,
) -> Vec<(String, Result<Arc<ShmMapping>, ShareError>)> {
    if names.is_empty() {
        return Vec::new();
    }
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    match fetch(&refs) {
        Ok(fds) => names
            .iter()
            .cloned()
            .zip(fds.into_iter().map(|fd| fd.and_then(|fd| Ok(map_fd(fd)?)).map(Arc::new)))
            .collect(),
        Err(why) => names.iter().map(|n| (n.clone(), Err(ShareError::Ask(why.clone())))).collect(),
    }
}
