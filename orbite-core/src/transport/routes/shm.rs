//! The shm route: one-sided copies into a same-host peer's shared
//! allocations, mapped into this process once per peer. The peer spends no
//! CPU; it lends the ranges (a Borrow) for as long as transfers may touch
//! them.

use super::{CopyKind, Mover, PeerReach, Reach, RouteImpl, Unreachable};
use crate::segment::ExportedRegistration;
use std::sync::Arc;

use crate::transport::mapping::{ShmMapping, map_fd, mapped_base};
use crate::transport::peer_errors::{LocalError, ShareError};
use crate::types::{Desc, Route};

/// The shm route.
pub(crate) struct Shm;

impl RouteImpl for Shm {
    fn route(&self) -> Route {
        Route::Shm
    }

    fn serves(&self, target: &Reach<'_>) -> bool {
        matches!(target, Reach::Peer(_))
    }

    fn plan(&self, target: &Reach<'_>, remote: &[Desc]) -> Result<Mover, Unreachable> {
        let Reach::Peer(p) = target else { return Err(Unreachable::NotPeer) };
        p.same_host.map_err(|why| Unreachable::NotSameHost(why.clone()))?;
        remote.iter().try_for_each(|d| {
            let r = p.segment.get(d.registration.to_raw()).ok_or(Unreachable::UnknownRegistration)?;
            let (name, offset) = r.shm.as_ref().ok_or(Unreachable::NotShared)?;
            let map = p.maps.get(name).ok_or(Unreachable::NotMapped)?.as_ref().map_err(|_| Unreachable::MapFailed)?;
            match offset.checked_add(r.len) {
                Some(end) if end <= map.len as u64 => Ok(()),
                _ => Err(Unreachable::OutsideShared),
            }
        })?;
        // The shared allocations the target ranges lie in (a device copy
        // into them pins them for the driver).
        let shared_pins = {
            let mut names: Vec<&str> = remote
                .iter()
                .filter_map(|d| p.segment.get(d.registration.to_raw())?.shm.as_ref().map(|(n, _)| n.as_str()))
                .collect();
            names.sort_unstable();
            names.dedup();
            names.iter().filter_map(|n| p.maps.get(*n)?.as_ref().ok().map(|m| m.pin.clone())).collect()
        };
        Ok(Mover::Copy(CopyKind::Mapped { peer_alive: p.alive.map(|l| l.handle()), shared_pins }))
    }

    fn auto_reason(&self) -> Option<&'static str> {
        Some("every target range is shared memory on this boot")
    }

    fn address(&self, target: &PeerReach<'_>, r: &ExportedRegistration) -> Result<(u64, u64), Unreachable> {
        // Addresses of its shared allocation mapped here.
        let base = mapped_base(target.maps, r).ok_or(Unreachable::NotMapped)?;
        Ok((base, 0))
    }

    fn borrows(&self) -> bool {
        true
    }
}

/// Copies a task into (or out of) the mapped allocation, then checks that
/// the peer still runs: bytes copied into a dead peer's memory never
/// reached it.
pub(crate) fn copy(
    op: crate::types::Op,
    spans: &[crate::transport::Span],
    limit: u64,
    peer_alive: Option<&crate::transport::liveness::LivenessCheck>,
) -> (u64, Option<crate::types::TaskEnd>) {
    // SAFETY: the job retains the range loans (and mappings) of every
    // span, and the lifecycle admits each task once.
    let done = unsafe { super::loopback::copy_spans(op, spans, limit) };
    (done, crate::transport::liveness::after_one_sided(op, peer_alive))
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
