//! CUDA IPC with a same-host peer: its device registrations, exported by
//! the peer as IPC handles over its local socket, opened here once per
//! registration's allocation; copies then go device to device (or host to
//! device) through the driver, with no host staging. One-sided: the peer
//! lends the ranges (a borrow) while copies may touch them.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, RwLock};

use super::{
    Copier, LocalFetch, LocalSide, Mover, NoDeviceCopy, PeerOpening, PeerReach, PeerState, Posted, Reach, RouteImpl,
    Unreachable,
};
use crate::segment::{ExportedRegistration, SegmentView};
use crate::transport::Span;
use crate::transport::liveness::LivenessCheck;
use crate::transport::mapping::{Imported, Imports};
use crate::transport::peer_errors::ImportError;
use crate::types::{Desc, Op, Route, TaskEnd};

/// The cuda-ipc route.
pub(crate) struct CudaIpc;

/// Whether this engine opens a same-host peer's device memory through
/// CUDA IPC (`enabled`: `cuda_ipc`), charging its imports to `counters`;
/// or why not.
pub(crate) fn open_peer(
    enabled: bool,
    counters: &Arc<crate::charge::Counters>,
) -> Result<Arc<crate::charge::Counters>, crate::transport::peer_errors::IpcOff> {
    use crate::transport::peer_errors::IpcOff;
    if !enabled {
        return Err(IpcOff::Disabled);
    }
    crate::cuda::availability().map_err(IpcOff::NoCuda)?;
    Ok(counters.clone())
}

/// A same-host peer's device registrations opened here (or why not), and
/// those it added since, opened by the next catch-up (a fetch over its
/// local socket). Imports of registrations the peer gave up are let go;
/// transfers prepared meanwhile hold the mappings they name.
pub(crate) struct IpcPeer {
    /// Where imports are charged.
    counters: Arc<crate::charge::Counters>,
    imports: RwLock<Imports>,
    pending: Mutex<HashSet<u64>>,
    behind: AtomicBool,
}

impl IpcPeer {
    fn imported(&self, raw: u64) -> Result<Arc<Imported>, Unreachable> {
        match self.imports.read().get(&raw) {
            Some(Ok(i)) => Ok(i.clone()),
            Some(Err(why)) => Err(Unreachable::NotImported(Some(why.clone()))),
            None => Err(Unreachable::NotImported(None)),
        }
    }

    fn note(&self, ids: HashSet<u64>) {
        if !ids.is_empty() {
            self.pending.lock().extend(ids);
            self.behind.store(true, Ordering::Release);
        }
    }
}

impl PeerState for IpcPeer {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn changed(&self, view: &SegmentView, added: &[ExportedRegistration]) {
        self.note(importable(added.iter()));
        let mut imports = self.imports.write();
        if !imports.is_empty() {
            imports.retain(|raw, _| view.get(*raw).is_some());
        }
    }

    fn behind(&self) -> bool {
        self.behind.load(Ordering::Acquire)
    }

    fn catch_up(&self, view: &RwLock<SegmentView>, local: &dyn LocalFetch) {
        if !self.behind.swap(false, Ordering::AcqRel) {
            return;
        }
        let ids: Vec<u64> = self.pending.lock().drain().collect();
        let lens: Vec<Option<u64>> = {
            let v = view.read();
            ids.iter().map(|raw| v.get(*raw).map(|r| r.len)).collect()
        };
        let imported = import_device(&self.counters, &ids, &lens, local);
        // Only registrations still in the view (read-locked: a change that
        // drops one waits, then lets its import go).
        let v = view.read();
        let mut imports = self.imports.write();
        for (raw, i) in imported {
            if v.get(raw).is_some() {
                imports.entry(raw).or_insert(i);
            }
        }
    }
}

impl RouteImpl for CudaIpc {
    fn route(&self) -> Route {
        Route::CudaIpc
    }

    /// A proven same-host peer, with IPC on: its device registrations, to
    /// be opened by the first catch-up.
    fn open_peer(&self, peer: &PeerOpening<'_>) -> Option<Box<dyn PeerState>> {
        let counters = peer.same_host.ok()?.ipc.as_ref().ok()?.clone();
        let s = IpcPeer {
            counters,
            imports: RwLock::new(Imports::new()),
            pending: Mutex::new(HashSet::new()),
            behind: AtomicBool::new(false),
        };
        s.note(importable(peer.descriptor.registrations.iter()));
        Some(Box::new(s))
    }

    fn plan(&self, target: &Reach<'_>, remote: &[Desc]) -> Result<Mover, Unreachable> {
        let (p, h) = target.same_host_peer()?;
        h.ipc.as_ref().map_err(|why| Unreachable::IpcUnavailable(why.clone()))?;
        let state = p.state::<IpcPeer>(Route::CudaIpc).ok_or(Unreachable::NotImported(None))?;
        let mut last = None;
        for d in remote {
            let raw = d.registration.to_raw();
            if last == Some(raw) {
                continue;
            }
            last = Some(raw);
            match p.segment.get(raw) {
                Some(r) if r.device.is_none() => return Err(Unreachable::PeerHostMemory),
                // Unknown ids are refused by prepare, with their own error.
                None => continue,
                Some(_) => {}
            }
            state.imported(raw)?;
        }
        // Every import the program may name, kept open while it lives.
        // Sorted by address, each once (registrations share them).
        let mut mappings: Vec<Arc<crate::cuda::IpcMapping>> =
            state.imports.read().values().filter_map(|i| i.as_ref().ok()).map(|i| i.mapping.clone()).collect();
        mappings.sort_unstable_by_key(|m| m.ptr);
        mappings.dedup_by_key(|m| m.ptr);
        Ok(Mover::Copy(Box::new(Ipc { mappings, peer_alive: p.alive.map(|l| l.handle()), pins: Vec::new() })))
    }

    fn auto_reason(&self) -> Option<&'static str> {
        Some("same host, the peer's device memory opened through CUDA IPC")
    }

    fn address(&self, target: &PeerReach<'_>, r: &ExportedRegistration) -> Result<(u64, u64), Unreachable> {
        let state = target.state::<IpcPeer>(Route::CudaIpc).ok_or(Unreachable::NotImported(None))?;
        let i = state.imported(r.id.to_raw())?;
        // The registration lies inside the mapping (checked at import);
        // spans carry addresses of this process.
        Ok((i.mapping.ptr + i.offset, 0))
    }

    fn borrows(&self) -> bool {
        true
    }

    fn borrow_flags(&self) -> u8 {
        crate::wire::BORROW_DEVICE
    }
}

/// Copies into (or out of) a same-host peer's device memory opened
/// through CUDA IPC: `remote` are addresses of `mappings` (sorted by
/// address, kept open while the program lives), copied by the driver on
/// the worker's stream; checked after each task as for shm.
pub(crate) struct Ipc {
    mappings: Vec<Arc<crate::cuda::IpcMapping>>,
    peer_alive: Option<LivenessCheck>,
    /// This engine's host registrations named, pinned as for the driver
    /// copies of the self connection.
    pins: Vec<Arc<crate::cuda::HostPin>>,
}

impl Copier for Ipc {
    fn name(&self) -> &'static str {
        "CUDA IPC copies"
    }

    fn copy(&self, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>) {
        super::device::post_and_finish(self, op, spans, limit)
    }

    fn post(&self, op: Op, spans: &[Span], limit: u64) -> Option<Result<Box<dyn Posted>, (u64, Option<TaskEnd>)>> {
        Some(match copies(&self.mappings, op, spans, limit) {
            Ok(Some((device, copies))) => {
                for p in &self.pins {
                    p.ensure(device);
                }
                super::device::issue(device, &copies, self.peer_alive.clone(), op)
            }
            Ok(None) => Err((0, None)),
            Err(end) => Err((0, Some(end))),
        })
    }

    /// The driver copies already, whatever the local side is; its host
    /// registrations are pinned for it.
    fn with_local(self: Box<Self>, local: &LocalSide<'_>) -> Result<Box<dyn Copier>, NoDeviceCopy> {
        Ok(Box::new(Ipc { pins: local.pins(), ..*self }))
    }

    fn waits(&self) -> bool {
        true
    }
}

/// The driver copies of an IPC task, for this thread's stream of the
/// device the first span's mapping is on: `(device, copies)`, `None` for
/// nothing to copy. Every span's peer range must lie inside one of
/// `mappings` (sorted by address; a local check, whatever prepare
/// resolved), or the task fails before any copy.
#[allow(clippy::type_complexity, reason = "one use")]
fn copies(
    mappings: &[Arc<crate::cuda::IpcMapping>],
    op: Op,
    spans: &[Span],
    limit: u64,
) -> Result<Option<(u32, Vec<(u64, u64, u64)>)>, TaskEnd> {
    // `mappings` are sorted by address and do not overlap.
    let inside = |addr: u64, len: u64| {
        let at = mappings.partition_point(|m| m.ptr <= addr).checked_sub(1)?;
        let m = &mappings[at];
        addr.checked_add(len).is_some_and(|end| end <= m.ptr + m.len).then_some(m)
    };
    let mut copies = Vec::with_capacity(spans.len());
    let mut device = None;
    for (s, n) in super::within(spans, limit) {
        let Some(m) = inside(s.remote, n) else {
            return Err(TaskEnd::Failed { effect_unknown: false });
        };
        device.get_or_insert(m.device);
        copies.push(match op {
            Op::Write => (s.remote, s.local, n),
            Op::Read => (s.local, s.remote, n),
        });
    }
    Ok(device.map(|d| (d, copies)))
}

/// The raw ids of device registrations in `regs` a same-host peer's state
/// imports: remotely reachable ones.
fn importable<'a>(regs: impl Iterator<Item = &'a ExportedRegistration>) -> HashSet<u64> {
    regs.filter(|r| r.device.is_some() && (r.permission.remote_read() || r.permission.remote_write()))
        .map(|r| r.id.to_raw())
        .collect()
}

/// An allocation opened from a peer's answer, by what names it there: a
/// legacy handle, or (a shareable handle) the allocation's address in the
/// peer.
#[derive(PartialEq, Eq)]
enum Opened {
    Legacy([u8; 64]),
    Shareable(u64),
}

/// One registration's IPC handle opened (an allocation opened once per
/// answer: `opened` holds those opened so far), checked against what this
/// process's driver says of the mapping.
fn open_entry(
    entry: crate::wire::IpcEntry,
    fd: Option<std::os::fd::OwnedFd>,
    len: Option<u64>,
    counters: &Arc<crate::charge::Counters>,
    opened: &mut Vec<(Opened, Arc<crate::cuda::IpcMapping>)>,
) -> Result<crate::transport::mapping::Imported, ImportError> {
    use crate::cuda::IpcMapping;
    use crate::wire::IpcEntry;
    let (key, uuid, offset, alloc_len) = match &entry {
        IpcEntry::Exported { uuid, handle, offset, alloc_len } => (Opened::Legacy(*handle), uuid, *offset, *alloc_len),
        IpcEntry::Shareable { uuid, alloc_base, offset, alloc_len } => {
            (Opened::Shareable(*alloc_base), uuid, *offset, *alloc_len)
        }
        IpcEntry::Refused(why) => return Err(ImportError::NotExported(why.clone())),
    };
    let len = len.ok_or(ImportError::Gone)?;
    let mapping = match opened.iter().find(|(k, _)| *k == key) {
        Some((_, m)) => m.clone(),
        None => {
            let m = match (&key, fd) {
                (Opened::Legacy(handle), _) => IpcMapping::open(handle, uuid, counters)?,
                (Opened::Shareable(_), Some(fd)) => IpcMapping::import_shareable(fd, uuid, alloc_len, counters)?,
                (Opened::Shareable(_), None) => return Err(ImportError::NoDescriptor),
            };
            let m = Arc::new(m);
            opened.push((key, m.clone()));
            m
        }
    };
    if mapping.len != alloc_len {
        return Err(ImportError::SizeMismatch { said: alloc_len, mapped: mapping.len });
    }
    match offset.checked_add(len) {
        Some(end) if end <= mapping.len => Ok(crate::transport::mapping::Imported { mapping, offset }),
        _ => Err(ImportError::Outside { offset, len, alloc: mapping.len }),
    }
}

/// Opens a same-host peer's device registrations `ids` (of lengths
/// `lens` in this engine's view; `None`: gone) through CUDA IPC, charging
/// `counters`: asks the peer for their handles (`local`, its local
/// socket) and opens each allocation once. A registration must lie inside
/// its mapping, as this process's driver reports it.
fn import_device(
    counters: &Arc<crate::charge::Counters>,
    ids: &[u64],
    lens: &[Option<u64>],
    local: &dyn LocalFetch,
) -> Vec<(u64, Result<Arc<Imported>, ImportError>)> {
    if ids.is_empty() {
        return Vec::new();
    }
    let entries = match local.ipc(ids) {
        Ok(entries) => entries,
        Err(why) => return ids.iter().map(|id| (*id, Err(ImportError::NotLocal(why.clone())))).collect(),
    };
    let mut opened = Vec::new();
    ids.iter()
        .zip(entries)
        .zip(lens)
        .map(|((raw, (entry, fd)), len)| (*raw, open_entry(entry, fd, *len, counters, &mut opened).map(Arc::new)))
        .collect()
}
