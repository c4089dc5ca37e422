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
use crate::error::{Error, RegistryError, Resource};
use crate::memory::{Backing, MemoryKind, MemoryRange, Permission};

/// Generation-checked id of a registration.
///
/// An id stays unique for the engine's life in practice: a slot's
/// generation advances each time its registration is removed, so an old id
/// never resolves to a newer registration in the same slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegistrationId {
    index: u32,
    generation: u32,
}

impl RegistrationId {
    /// Packs the id into 64 bits (for foreign handles and wire formats).
    pub fn to_raw(self) -> u64 {
        ((self.generation as u64) << 32) | self.index as u64
    }
    /// Unpacks an id from [`RegistrationId::to_raw`]; any value is accepted
    /// and checked on use.
    pub fn from_raw(raw: u64) -> Self {
        RegistrationId { index: raw as u32, generation: (raw >> 32) as u32 }
    }
}

impl std::fmt::Display for RegistrationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "reg#{}.{}", self.index, self.generation)
    }
}

/// One registered range and its owner.
pub(crate) struct Registration {
    pub id: RegistrationId,
    pub base: *mut u8,
    pub len: u64,
    pub permission: Permission,
    pub kind: MemoryKind,
    fenced: AtomicBool,
    fence_charge: Mutex<Option<Charge>>,
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
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Runs once: after deregistration and after the last range loan.
        // Never under an engine lock (callers drop loans after unlocking).
        if let Backing::Borrowed(release) = &mut self.backing {
            if let Some(release) = release.take() {
                release();
            }
        }
    }
}

struct Slot {
    generation: u32,
    registration: Option<Arc<Registration>>,
}

#[derive(Default)]
pub(crate) struct Table {
    slots: Vec<Slot>,
    free: Vec<u32>,
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

    /// Registers all ranges or none.
    pub fn register(
        &self,
        ranges: Vec<MemoryRange>,
        counters: &Arc<Counters>,
        config: &EngineConfig,
    ) -> Result<Vec<RegistrationId>, Error> {
        let mut pending = Vec::with_capacity(ranges.len());
        for (i, r) in ranges.into_iter().enumerate() {
            if r.ptr.is_null() || r.len == 0 {
                return Err(RegistryError::InvalidRange(format!("range {i} is null or empty")).into());
            }
            if (r.ptr as u64).checked_add(r.len).is_none() || r.len > isize::MAX as u64 {
                return Err(RegistryError::InvalidRange(format!("range {i} wraps the address space")).into());
            }
            let charge = Charge::try_new(
                counters,
                [
                    (Counter::Registrations, 1, Some((Resource::Registrations, config.max_registrations))),
                    (Counter::RegisteredBytes, r.len, Some((Resource::RegisteredBytes, config.max_registered_bytes))),
                ],
            )?;
            pending.push((r, charge));
        }
        let mut table = self.table.lock();
        let mut ids = Vec::with_capacity(pending.len());
        for (r, charge) in pending {
            let index = match table.free.pop() {
                Some(i) => i,
                None => {
                    table.slots.push(Slot { generation: 0, registration: None });
                    (table.slots.len() - 1) as u32
                }
            };
            let slot = &mut table.slots[index as usize];
            let id = RegistrationId { index, generation: slot.generation };
            let kind = match &r.backing {
                Backing::Host(m) => match m.shared_name_arc() {
                    Some(name) => MemoryKind::Shm { name, offset: r.ptr as u64 - m.as_ptr() as u64 },
                    None => MemoryKind::Host,
                },
                Backing::Borrowed(_) => MemoryKind::Host,
            };
            slot.registration = Some(Arc::new(Registration {
                id,
                base: r.ptr,
                len: r.len,
                permission: r.permission,
                kind,
                fenced: AtomicBool::new(false),
                fence_charge: Mutex::new(None),
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
            slot.generation = slot.generation.wrapping_add(1);
            table.free.push(id.index);
            reg
        };
        if let Some(reg) = removed {
            reg.fenced.store(true, Ordering::Release);
            *reg.fence_charge.lock() = Some(Charge::unlimited(counters, Counter::FencedRegistrations, 1));
            drop(reg); // may run the owner's release, with no lock held
        }
        Ok(())
    }

    /// Every live registration, as exported to peers.
    pub fn exported(&self) -> Vec<crate::segment::ExportedRegistration> {
        let table = self.table.lock();
        table
            .slots
            .iter()
            .filter_map(|s| s.registration.as_ref())
            .map(|r| crate::segment::ExportedRegistration {
                id: r.id,
                len: r.len,
                permission: r.permission,
                addr: r.base as u64,
                shm: match &r.kind {
                    MemoryKind::Shm { name, offset } => Some((name.to_string(), *offset)),
                    MemoryKind::Host => None,
                },
            })
            .collect()
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
