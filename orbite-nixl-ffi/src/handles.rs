//! Generation-checked opaque handles.
//!
//! A handle is a `u64`: the object kind in the top byte, a 24-bit
//! generation, then a 32-bit slot index. Releasing a handle empties its
//! slot and advances the slot's generation, so a stale copy, a double
//! release or a handle of another kind is recognised and answered with a
//! typed status, never dereferenced. Zero is never a valid handle. A slot
//! whose generation would wrap is retired, and freed slots are reused
//! first in, first out: a handle never resolves to another object.
//!
//! Objects are immutable and reference-counted: a call clones the object
//! out of the table and releases the table lock before it touches the
//! engine, so no engine call (and no foreign callback it may trigger) runs
//! under this lock.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::objects::Object;
use crate::status::{OrbiteStatus, Res, fail};

/// Kinds of handle; the value is the handle's top byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Engine = 1,
    Registration = 2,
    SharedMemory = 3,
    Peer = 4,
    Transfer = 5,
    File = 6,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Engine => "engine",
            Kind::Registration => "registration",
            Kind::SharedMemory => "shared memory",
            Kind::Peer => "peer",
            Kind::Transfer => "transfer",
            Kind::File => "file",
        }
    }
    fn from_tag(tag: u64) -> Option<Kind> {
        Some(match tag {
            1 => Kind::Engine,
            2 => Kind::Registration,
            3 => Kind::SharedMemory,
            4 => Kind::Peer,
            5 => Kind::Transfer,
            6 => Kind::File,
            _ => return None,
        })
    }
}

const GENERATION_MASK: u32 = 0x00FF_FFFF;
/// Slots in the table, all kinds and engines together. Each engine also
/// bounds its own share (`max_binding_handles`).
const MAX_SLOTS: usize = 1 << 24;

struct Slot<T> {
    generation: u32,
    object: Option<T>,
}

/// Slots and the free list. A released slot's generation advances; a slot
/// whose generation would wrap is retired (never used again), so a handle
/// never resolves to an object other than the one it was made for. Freed
/// slots are reused first in, first out: a slot is reused as late as the
/// table allows.
struct Table<T> {
    slots: Vec<Slot<T>>,
    free: VecDeque<u32>,
    /// The last generation a slot may have (a handle's 24 bits).
    last_generation: u32,
    max_slots: usize,
}

static TABLE: Mutex<Table<Object>> = Mutex::new(Table::new(GENERATION_MASK, MAX_SLOTS));

fn encode(kind: Kind, generation: u32, index: u32) -> u64 {
    ((kind as u64) << 56) | (u64::from(generation & GENERATION_MASK) << 32) | u64::from(index)
}

fn decode(handle: u64) -> (Option<Kind>, u32, u32) {
    (Kind::from_tag(handle >> 56), ((handle >> 32) as u32) & GENERATION_MASK, handle as u32)
}

impl<T> Table<T> {
    const fn new(last_generation: u32, max_slots: usize) -> Self {
        Table { slots: Vec::new(), free: VecDeque::new(), last_generation, max_slots }
    }

    fn insert(&mut self, kind: Kind, object: T) -> Res<u64> {
        let index = match self.free.pop_front() {
            Some(i) => i,
            None if self.slots.len() < self.max_slots => {
                self.slots.push(Slot { generation: 1, object: None });
                (self.slots.len() - 1) as u32
            }
            None => return fail(OrbiteStatus::ResourceExhausted, "the handle table is full"),
        };
        let slot = &mut self.slots[index as usize];
        slot.object = Some(object);
        Ok(encode(kind, slot.generation, index))
    }

    fn check(&mut self, handle: u64, kind: Kind) -> Res<&mut Slot<T>> {
        let (tag, generation, index) = decode(handle);
        match tag {
            Some(k) if k == kind => {}
            Some(k) => {
                return fail(
                    OrbiteStatus::WrongHandle,
                    format!("a {} handle where a {} handle is needed", k.name(), kind.name()),
                );
            }
            None if handle == 0 => return fail(OrbiteStatus::StaleHandle, format!("null {} handle", kind.name())),
            None => return fail(OrbiteStatus::WrongHandle, format!("{handle:#x} is not a handle of this library")),
        }
        match self.slots.get_mut(index as usize) {
            Some(slot) if slot.generation == generation && slot.object.is_some() => Ok(slot),
            _ => fail(OrbiteStatus::StaleHandle, format!("{} handle {handle:#x} was released", kind.name())),
        }
    }

    fn remove_if(&mut self, handle: u64, kind: Kind, allow: impl FnOnce(&T) -> Res) -> Res<T> {
        let last = self.last_generation;
        let slot = self.check(handle, kind)?;
        allow(slot.object.as_ref().expect("checked"))?;
        let object = slot.object.take().expect("checked");
        let (_, _, index) = decode(handle);
        if slot.generation < last {
            slot.generation += 1;
            self.free.push_back(index);
        }
        // Otherwise the slot retires: its next generation would wrap.
        Ok(object)
    }
}

/// Stores an object; returns its handle.
pub(crate) fn insert(object: Object) -> Res<u64> {
    let kind = object.kind();
    TABLE.lock().insert(kind, object)
}

/// The object behind a handle of `kind`.
pub(crate) fn get(handle: u64, kind: Kind) -> Res<Object> {
    let mut t = TABLE.lock();
    Ok(t.check(handle, kind)?.object.clone().expect("checked"))
}

/// Removes a handle if `allow` accepts its object (checked under the table
/// lock, so no other release can interleave); returns the object, to be
/// dropped by the caller with no lock held.
pub(crate) fn remove_if(handle: u64, kind: Kind, allow: impl FnOnce(&Object) -> Res) -> Res<Object> {
    TABLE.lock().remove_if(handle, kind, allow)
}

/// Removes a handle unconditionally.
pub(crate) fn remove(handle: u64, kind: Kind) -> Res<Object> {
    remove_if(handle, kind, |_| Ok(()))
}

/// Every live handle of `kind` (test hooks).
#[cfg(feature = "test-hooks")]
pub(crate) fn all(kind: Kind) -> Vec<u64> {
    let t = TABLE.lock();
    t.slots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.object.as_ref().is_some_and(|o| o.kind() == kind))
        .map(|(i, s)| encode(kind, s.generation, i as u32))
        .collect()
}

/// Resolves many registration handles of one engine under a single lock.
pub(crate) fn registrations<R>(
    engine: &Arc<crate::objects::EngineObj>,
    handles: impl Iterator<Item = u64>,
    mut each: impl FnMut(usize, orbite_core::RegistrationId) -> R,
) -> Res<Vec<R>> {
    let mut t = TABLE.lock();
    let mut out = Vec::with_capacity(handles.size_hint().0);
    for (i, h) in handles.enumerate() {
        let slot = t.check(h, Kind::Registration).map_err(|mut f| {
            f.message = format!("local descriptor {i}: {}", f.message);
            f
        })?;
        let Some(Object::Registration(r)) = &slot.object else { unreachable!("kind checked") };
        if !Arc::ptr_eq(&r.child.engine, engine) {
            return fail(OrbiteStatus::WrongHandle, format!("local descriptor {i}: registration of another engine"));
        }
        out.push(each(i, r.id));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_whose_generation_would_wrap_retires() {
        // Four generations per slot, so wrapping is reached at once.
        let mut t: Table<u32> = Table::new(4, 8);
        let mut old = Vec::new();
        for i in 0..4 {
            let h = t.insert(Kind::Peer, i).unwrap();
            assert_eq!(h as u32, 0, "one slot, reused while its generations last");
            old.push(h);
            t.remove_if(h, Kind::Peer, |_| Ok(())).unwrap();
        }
        // The slot retired: the next object gets a fresh slot, and no
        // earlier handle resolves to it.
        let h = t.insert(Kind::Peer, 99).unwrap();
        assert_eq!(h as u32, 1);
        for o in &old {
            assert!(t.check(*o, Kind::Peer).is_err(), "a released handle resolved again");
        }
        assert_eq!(t.check(h, Kind::Peer).unwrap().object, Some(99));
    }

    #[test]
    fn freed_slots_are_reused_first_in_first_out() {
        let mut t: Table<u32> = Table::new(GENERATION_MASK, 8);
        let hs: Vec<u64> = (0..3).map(|i| t.insert(Kind::Transfer, i).unwrap()).collect();
        for h in &hs {
            t.remove_if(*h, Kind::Transfer, |_| Ok(())).unwrap();
        }
        let again: Vec<u32> = (0..3).map(|i| t.insert(Kind::Transfer, i).unwrap() as u32).collect();
        assert_eq!(again, vec![0, 1, 2], "the oldest freed slot first");
        for h in &hs {
            assert!(t.check(*h, Kind::Transfer).is_err());
        }
    }

    #[test]
    fn the_table_refuses_when_full() {
        let mut t: Table<u32> = Table::new(2, 2);
        let a = t.insert(Kind::File, 1).unwrap();
        t.insert(Kind::File, 2).unwrap();
        assert!(t.insert(Kind::File, 3).is_err());
        t.remove_if(a, Kind::File, |_| Ok(())).unwrap();
        let b = t.insert(Kind::File, 4).unwrap();
        assert_ne!(a, b);
        assert!(t.check(a, Kind::File).is_err());
    }
}
