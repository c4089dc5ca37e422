//! The memory registry: registrations, generation-checked ids, permissions,
//! aliases and deferred retirement.
//!
//! A registration is an `Arc<Registration>`. The registry's table holds one
//! reference; every prepared transfer and execution that names it holds
//! another (its range loan). Deregistration removes the table's reference
//! and fences the registration at once, so no new prepare or post can use
//! it, while the object itself, its backing owner and its charges live on
//! until the last borrower lets go. The owner is destroyed exactly once, by
//! `Drop`. Duplicate or overlapping ranges are separate registrations with
//! separate owners (aliases): removing one never touches another.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, MutexGuard};

use crate::charge::{Charge, Counter, Counters};
use crate::config::EngineConfig;
use crate::memory::{Backing, MemoryError, MemoryKind, MemoryRange};
use crate::types::RegistrationId;
use crate::types::{Permission, Resource};
use std::os::fd::AsFd;

/// One registered range and its owner.
pub(crate) struct Registration {
    pub id: RegistrationId,
    pub base: *mut u8,
    pub len: u64,
    pub permission: Permission,
    pub kind: MemoryKind,
    /// The registry version that added it (peers refresh from versions).
    pub added_at: u64,
    fenced: AtomicBool,
    fence_charge: Mutex<Option<Charge>>,
    /// Host memory: page-locked for the driver on the first device copy
    /// that names it, unpinned before the memory goes (feature `cuda`).
    pub pin: Option<Arc<crate::cuda::HostPin>>,
    /// Its memory region on each of the engine's RDMA NICs (or why not
    /// there): deregistered when the registration goes, so after its last
    /// borrower retired; peers' access through the rkeys ends then.
    pub rdma: crate::verbs::rails::Regions,
    backing: Backing,
    _charge: Charge,
}

// SAFETY: `base` is an address into memory the registration owns
// (`HostMemory`) or was promised valid by an `unsafe` borrow; the struct
// gives no unsynchronised access to the bytes itself.
unsafe impl Send for Registration {}
// SAFETY: as above; the mutable fields are an atomic and a mutex.
unsafe impl Sync for Registration {}

impl Registration {
    /// True once deregistered: no new prepare or post may use it.
    pub fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::Acquire)
    }

    /// True for host memory (private or shared), which routes copy with
    /// the CPU; false for device memory, which only driver copies reach.
    pub fn is_host(&self) -> bool {
        !matches!(self.kind, MemoryKind::Cuda { .. })
    }

    /// Whether peers see it: remotely readable memory (device memory
    /// marked as such: peers reach it only over tcp, staged here).
    pub fn is_exported(&self) -> bool {
        self.permission.remote_read()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Runs once: after deregistration and after the last range loan.
        // Never under an engine lock (callers drop loans after unlocking).
        // The driver lets go of the pages before they can go.
        if let Some(pin) = &self.pin {
            pin.release();
        }
        // The NICs let go of the pages before they can go.
        drop(std::mem::take(&mut self.rdma));
        let release = match &mut self.backing {
            Backing::Borrowed(release) => release.take(),
            Backing::Cuda { release, .. } => release.take(),
            Backing::Host(_) => None,
        };
        if let Some(release) = release {
            release();
        }
    }
}

struct Slot {
    generation: u32,
    registration: Option<Arc<Registration>>,
}

/// Deregistrations kept for peers' delta refreshes; a peer that is further
/// behind gets the whole list again.
const TOMBSTONES: usize = 16_384;

#[derive(Default)]
pub(crate) struct Table {
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Bumped by every registration and deregistration.
    version: u64,
    /// (version, raw id) of recent deregistrations, oldest first.
    tombstones: std::collections::VecDeque<(u64, u64)>,
    /// The version before which deregistrations may have been forgotten.
    forgotten_before: u64,
    /// Live registrations by the version that added them (slot index).
    by_version: std::collections::BTreeMap<u64, u32>,
}

/// What changed in the exported registrations after a version: the answer
/// to a peer's delta refresh.
pub(crate) struct Changes<T> {
    /// The whole list follows (the peer was too far behind).
    pub reset: bool,
    /// Registrations added after the version and still live, as exported.
    pub added: Vec<T>,
    /// Raw ids deregistered after the version.
    pub removed: Vec<u64>,
    /// The version this answer brings the peer to.
    pub version: u64,
    /// Not everything fitted: ask again from `version`.
    pub more: bool,
}

impl Table {
    /// Resolves a live registration.
    pub fn get(&self, id: RegistrationId) -> Result<&Arc<Registration>, RegistryError> {
        let slot = self.slots.get(id.index as usize).ok_or(RegistryError::Unknown(id))?;
        match &slot.registration {
            Some(r) if slot.generation == id.generation => Ok(r),
            _ => Err(RegistryError::Stale(id)),
        }
    }

    /// The current registry version.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// One live registration, exported by `export`, if peers may target it.
    pub fn export_one<T>(&self, id: RegistrationId, export: impl Fn(&Registration) -> T) -> Option<T> {
        self.get(id).ok().filter(|r| r.is_exported()).map(|r| export(r))
    }

    /// A duplicate of the descriptor of the shared allocation `name`, if a
    /// registration peers may target lies in it (nothing else is handed
    /// out).
    pub fn shared_fd(&self, name: &str) -> Option<std::os::fd::OwnedFd> {
        self.slots.iter().filter_map(|s| s.registration.as_deref()).filter(|r| r.is_exported()).find_map(|r| {
            match &r.backing {
                Backing::Host(m) if m.shared_name() == Some(name) => m.shared_fd()?.try_clone_to_owned().ok(),
                _ => None,
            }
        })
    }

    /// Registrations peers may target (remote-readable), exported by
    /// `export`, with the version.
    pub fn exported<T>(&self, export: impl Fn(&Registration) -> T) -> (Vec<T>, u64) {
        let regs = self
            .slots
            .iter()
            .filter_map(|s| s.registration.as_deref())
            .filter(|r| r.is_exported())
            .map(export)
            .collect();
        (regs, self.version)
    }

    /// What changed after `since`, in version order, in at most `budget`
    /// encoded bytes (`export` makes an added registration's entry and
    /// `entry_bytes` prices it; a removal costs 8 bytes).
    pub fn changes_since<T>(
        &self,
        since: u64,
        budget: usize,
        export: impl Fn(&Registration) -> T,
        entry_bytes: impl Fn(&T) -> usize,
    ) -> Changes<T> {
        let reset = since > self.version || since < self.forgotten_before;
        let since = if reset { 0 } else { since };
        let live = self
            .by_version
            .range(since + 1..)
            .filter_map(|(_, index)| self.slots[*index as usize].registration.as_deref())
            .filter(|r| r.is_exported());
        let dead = self.tombstones.iter().filter(|(v, _)| *v > since && !reset);
        let (mut added, mut removed, mut used) = (Vec::new(), Vec::new(), 0usize);
        let mut dead = dead.peekable();
        let mut live = live.peekable();
        let mut reached = since;
        loop {
            // Every change has its own version: a removal and an addition
            // never share one.
            let take_dead = match (dead.peek(), live.peek()) {
                (None, None) => break,
                (Some((d, _)), Some(l)) => *d < l.added_at,
                (Some(_), None) => true,
                (None, Some(_)) => false,
            };
            let (version, cost, item) = if take_dead {
                let (v, raw) = *dead.next().expect("peeked");
                (v, 8, Err(raw))
            } else {
                let r = live.next().expect("peeked");
                let e = export(r);
                (r.added_at, entry_bytes(&e), Ok(e))
            };
            if used + cost > budget && reached > since {
                return Changes { reset, added, removed, version: reached, more: true };
            }
            used += cost;
            reached = version;
            match item {
                Ok(r) => added.push(r),
                Err(raw) => removed.push(raw),
            }
        }
        Changes { reset, added, removed, version: self.version, more: false }
    }

    fn bump(&mut self) -> u64 {
        self.version += 1;
        self.version
    }
}

/// What a registration's RDMA regions let peers do.
fn remote_access(p: Permission) -> crate::verbs::rails::Remote {
    use crate::verbs::rails::Remote;
    match p {
        Permission::LocalOnly => Remote::None,
        Permission::RemoteRead => Remote::Read,
        Permission::RemoteReadWrite => Remote::ReadWrite,
    }
}

/// The registry of one engine.
#[derive(Default)]
pub(crate) struct Registry {
    table: Mutex<Table>,
}

impl Registry {
    /// Locks the table for a batch of lookups (one lock per prepare).
    pub fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock()
    }

    /// Registers all ranges or none, each with a memory region on every
    /// NIC of `rails` (made before the table is locked: a large region
    /// takes the NIC a while).
    pub fn register(
        &self,
        ranges: Vec<MemoryRange>,
        counters: &Arc<Counters>,
        config: &EngineConfig,
        rails: &crate::verbs::rails::Rails,
    ) -> Result<Vec<RegistrationId>, MemoryError> {
        let mut pending = Vec::with_capacity(ranges.len());
        for (i, r) in ranges.into_iter().enumerate() {
            if r.ptr.is_null() || r.len == 0 {
                return Err(MemoryError::InvalidRange(format!("range {i} is null or empty")));
            }
            if (r.ptr as u64).checked_add(r.len).is_none() || r.len > isize::MAX as u64 {
                return Err(MemoryError::InvalidRange(format!("range {i} wraps the address space")));
            }
            let charge = Charge::try_new(
                counters,
                [
                    (Counter::Registrations, 1, Some((Resource::Registrations, config.max_registrations))),
                    (Counter::RegisteredBytes, r.len, Some((Resource::RegisteredBytes, config.max_registered_bytes))),
                ],
            )?;
            let regions = match &r.backing {
                _ if rails.rails().is_empty() => crate::verbs::rails::Regions::default(),
                // Device memory: its dma-buf export, else by address where
                // nvidia-peermem is loaded (docs/rdma.md).
                Backing::Cuda { lease, .. } => {
                    let dmabuf = crate::cuda::dmabuf_of(lease.device(), r.ptr as u64, r.len);
                    let fd = dmabuf.as_ref().map(|(fd, offset)| (fd.as_fd(), *offset)).map_err(|e| e.to_string());
                    // SAFETY: device memory the registration keeps (its
                    // lease and allocation, or the caller's promise) until
                    // it is dropped, and the regions go first.
                    unsafe { rails.register_device(r.ptr as u64, r.len, remote_access(r.permission), fd) }
                }
                // SAFETY: host memory the registration keeps valid (its
                // backing, or the caller's promise for a borrowed range)
                // until it is dropped, and the regions go first.
                _ => unsafe { rails.register(r.ptr as u64, r.len, remote_access(r.permission)) },
            };
            pending.push((r, charge, regions));
        }
        let mut table = self.table.lock();
        // Slots retire once every 2^32 registrations of one slot; an index
        // space used up is refused (before anything is registered), never
        // reused.
        let fresh = pending.len().saturating_sub(table.free.len());
        if (table.slots.len() as u64).saturating_add(fresh as u64) > 1 << 32 {
            return Err(MemoryError::System("every registration slot has retired".into()));
        }
        let mut ids = Vec::with_capacity(pending.len());
        for (r, charge, rdma) in pending {
            let added_at = table.bump();
            let index = match table.free.pop() {
                Some(i) => i,
                None => {
                    table.slots.push(Slot { generation: 0, registration: None });
                    (table.slots.len() - 1) as u32
                }
            };
            table.by_version.insert(added_at, index);
            let slot = &mut table.slots[index as usize];
            let id = RegistrationId { index, generation: slot.generation };
            let kind = match &r.backing {
                Backing::Host(m) => match m.shared_name_arc() {
                    Some(name) => MemoryKind::Shm { name, offset: r.ptr as u64 - m.as_ptr() as u64 },
                    None => MemoryKind::Host,
                },
                Backing::Borrowed(_) => MemoryKind::Host,
                Backing::Cuda { lease, .. } => MemoryKind::Cuda { device: lease.device() },
            };
            let pin = (!matches!(kind, MemoryKind::Cuda { .. }))
                .then(|| Arc::new(crate::cuda::HostPin::new(r.ptr as u64, r.len)));
            slot.registration = Some(Arc::new(Registration {
                id,
                base: r.ptr,
                len: r.len,
                permission: r.permission,
                kind,
                added_at,
                fenced: AtomicBool::new(false),
                fence_charge: Mutex::new(None),
                pin,
                rdma,
                backing: r.backing,
                _charge: charge,
            }));
            ids.push(id);
        }
        Ok(ids)
    }

    /// Fences and unlinks a registration. Its owner is destroyed when the
    /// last borrower drops its loan, possibly right here (outside the lock).
    pub fn deregister(&self, id: RegistrationId, counters: &Arc<Counters>) -> Result<(), RegistryError> {
        let removed = {
            let mut table = self.table.lock();
            table.get(id)?;
            let slot = &mut table.slots[id.index as usize];
            let reg = slot.registration.take();
            // A slot whose generation would wrap retires: its next id
            // would name what an old id named (peers may still hold it).
            // It stays empty, so every id of it is stale from now on.
            if slot.generation != u32::MAX {
                slot.generation += 1;
                table.free.push(id.index);
            }
            if let Some(r) = &reg {
                table.by_version.remove(&r.added_at);
            }
            let version = table.bump();
            if reg.as_ref().is_some_and(|r| r.is_exported()) {
                if table.tombstones.len() == TOMBSTONES {
                    if let Some((v, _)) = table.tombstones.pop_front() {
                        table.forgotten_before = v;
                    }
                }
                table.tombstones.push_back((version, id.to_raw()));
            }
            reg
        };
        if let Some(reg) = removed {
            reg.fenced.store(true, Ordering::Release);
            *reg.fence_charge.lock() = Some(Charge::unlimited(counters, Counter::FencedRegistrations, 1));
            drop(reg); // may run the owner's release, with no lock held
        }
        Ok(())
    }

    /// Removes every registration (engine close). Owners are destroyed as
    /// their last borrowers retire.
    pub fn deregister_all(&self, counters: &Arc<Counters>) {
        let ids: Vec<RegistrationId> = {
            let table = self.table.lock();
            table.slots.iter().filter_map(|s| s.registration.as_ref().map(|r| r.id)).collect()
        };
        for id in ids {
            let _ = self.deregister(id, counters);
        }
    }
}

/// Errors of the memory registry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// No registration ever had this index.
    #[error("unknown registration {0}")]
    Unknown(RegistrationId),
    /// The slot exists but belongs to another (older or newer) registration.
    #[error("stale registration {0} (generation mismatch)")]
    Stale(RegistrationId),
    /// The registration was deregistered: it is fenced for new work.
    #[error("registration {0} is deregistered")]
    Deregistered(RegistrationId),
    /// A range to register was empty, null or out of its memory's bounds.
    #[error("invalid memory range: {0}")]
    InvalidRange(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostMemory;

    fn setup(n: usize) -> (Registry, Arc<Counters>, HostMemory, Vec<RegistrationId>) {
        let counters = Arc::new(Counters::default());
        let config = EngineConfig::default();
        let mem = HostMemory::allocate(&counters, n * 4096, u64::MAX).unwrap();
        let reg = Registry::default();
        let ranges = (0..n).map(|k| MemoryRange::host(&mem, k * 4096, 4096, Permission::RemoteRead).unwrap()).collect();
        let ids = reg.register(ranges, &counters, &config, &crate::verbs::rails::Rails::none("test")).unwrap();
        (reg, counters, mem, ids)
    }

    #[test]
    fn changes_come_in_version_order_and_pages_never_lose_one() {
        let (reg, counters, _mem, ids) = setup(10);
        let all = reg.lock().changes_since(0, usize::MAX, crate::segment::ExportedRegistration::of, |_| 40);
        assert_eq!((all.added.len(), all.removed.len(), all.more, all.reset), (10, 0, false, false));
        let v = all.version;
        reg.deregister(ids[3], &counters).unwrap();
        let local = MemoryRange::host(&_mem, 0, 4096, Permission::LocalOnly).unwrap();
        reg.register(vec![local], &counters, &EngineConfig::default(), &crate::verbs::rails::Rails::none("test"))
            .unwrap();
        let d = reg.lock().changes_since(v, usize::MAX, crate::segment::ExportedRegistration::of, |_| 40);
        assert_eq!(d.removed, vec![ids[3].to_raw()]);
        assert!(d.added.is_empty(), "local-only registrations are not exported");
        assert_eq!(d.version, v + 2);
        // Pages of at most 100 bytes (two entries) cover everything once.
        let (mut since, mut seen) = (0, Vec::new());
        loop {
            let p = reg.lock().changes_since(since, 100, crate::segment::ExportedRegistration::of, |_| 40);
            assert!(p.added.len() <= 2);
            seen.extend(p.added.iter().map(|r| r.id));
            since = p.version;
            if !p.more {
                break;
            }
        }
        let mut want: Vec<_> = ids.iter().copied().filter(|id| *id != ids[3]).collect();
        want.sort();
        seen.sort();
        assert_eq!(seen, want);
    }

    #[test]
    fn a_slot_whose_generation_would_wrap_retires() {
        let (reg, counters, mem, ids) = setup(1);
        let config = EngineConfig::default();
        let range = || vec![MemoryRange::host(&mem, 0, 4096, Permission::RemoteRead).unwrap()];
        reg.deregister(ids[0], &counters).unwrap();
        // Fast-forward the slot to its last generations (4 billion
        // register/deregister cycles would take minutes).
        reg.lock().slots[0].generation = u32::MAX - 1;
        let before_last =
            reg.register(range(), &counters, &config, &crate::verbs::rails::Rails::none("test")).unwrap()[0];
        assert_eq!((before_last.index, before_last.generation), (0, u32::MAX - 1));
        reg.deregister(before_last, &counters).unwrap();
        let last = reg.register(range(), &counters, &config, &crate::verbs::rails::Rails::none("test")).unwrap()[0];
        assert_eq!((last.index, last.generation), (0, u32::MAX), "the last generation is still used");
        reg.deregister(last, &counters).unwrap();
        // The slot retired: the next registration takes a new slot, and no
        // id of the old one (the wrapped generation included) resolves.
        let next = reg.register(range(), &counters, &config, &crate::verbs::rails::Rails::none("test")).unwrap()[0];
        assert_eq!(next.index, 1, "a retired slot is never reused");
        for generation in [0, 1, u32::MAX - 1, u32::MAX] {
            let old = RegistrationId { index: 0, generation };
            assert_eq!(reg.lock().get(old).err(), Some(RegistryError::Stale(old)));
        }
        assert!(reg.lock().free.is_empty());
        reg.deregister(next, &counters).unwrap();
        assert_eq!(reg.lock().free, vec![1]);
        assert_eq!(counters.get(Counter::Registrations), 0, "charges back to baseline");
    }

    #[test]
    fn a_peer_too_far_behind_gets_the_whole_list() {
        let n = TOMBSTONES + 2;
        let (reg, counters, _mem, ids) = setup(n);
        let keep = ids[n - 1];
        let v = reg.lock().version();
        for id in &ids[..n - 1] {
            reg.deregister(*id, &counters).unwrap();
        }
        let d = reg.lock().changes_since(v, usize::MAX, crate::segment::ExportedRegistration::of, |_| 40);
        assert!(d.reset, "more deregistrations than are remembered");
        assert_eq!(d.added.iter().map(|r| r.id).collect::<Vec<_>>(), vec![keep]);
        let now = reg.lock().version();
        let recent = reg.lock().changes_since(now - 1, usize::MAX, crate::segment::ExportedRegistration::of, |_| 40);
        assert!(!recent.reset && recent.removed.len() == 1);
        let future = reg.lock().changes_since(u64::MAX, usize::MAX, crate::segment::ExportedRegistration::of, |_| 40);
        assert!(future.reset, "a version this registry never had");
    }
}
