//! Generation-checked opaque handles.
//!
//! A handle is a `u64`: the object kind in the top byte, a 24-bit
//! generation, then a 32-bit slot index. Releasing a handle empties its
//! slot and advances the slot's generation, so a stale copy, a double
//! release or a handle of another kind is recognised and answered with a
//! typed status, never dereferenced. Zero is never a valid handle.
//!
//! Objects are immutable and reference-counted: a call clones the object
//! out of the table and releases the table lock before it touches the
//! engine, so no engine call (and no foreign callback it may trigger) runs
//! under this lock.

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

struct Slot {
    generation: u32,
    object: Option<Object>,
}

struct Table {
    slots: Vec<Slot>,
    free: Vec<u32>,
}

static TABLE: Mutex<Table> = Mutex::new(Table { slots: Vec::new(), free: Vec::new() });

fn encode(kind: Kind, generation: u32, index: u32) -> u64 {
    ((kind as u64) << 56) | (u64::from(generation & GENERATION_MASK) << 32) | u64::from(index)
}

fn decode(handle: u64) -> (Option<Kind>, u32, u32) {
    (Kind::from_tag(handle >> 56), ((handle >> 32) as u32) & GENERATION_MASK, handle as u32)
}

/// Stores an object; returns its handle.
pub(crate) fn insert(object: Object) -> Res<u64> {
    let kind = object.kind();
    let mut t = TABLE.lock();
    let index = match t.free.pop() {
        Some(i) => i,
        None if t.slots.len() < MAX_SLOTS => {
            t.slots.push(Slot { generation: 1, object: None });
            (t.slots.len() - 1) as u32
        }
        None => return fail(OrbiteStatus::ResourceExhausted, "the handle table is full"),
    };
    let slot = &mut t.slots[index as usize];
    slot.object = Some(object);
    Ok(encode(kind, slot.generation, index))
}

fn check(t: &mut Table, handle: u64, kind: Kind) -> Res<&mut Slot> {
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
    match t.slots.get_mut(index as usize) {
        Some(slot) if slot.generation == generation && slot.object.is_some() => Ok(slot),
        _ => fail(OrbiteStatus::StaleHandle, format!("{} handle {handle:#x} was released", kind.name())),
    }
}

/// The object behind a handle of `kind`.
pub(crate) fn get(handle: u64, kind: Kind) -> Res<Object> {
    let mut t = TABLE.lock();
    Ok(check(&mut t, handle, kind)?.object.clone().expect("checked"))
}

/// Removes a handle if `allow` accepts its object (checked under the table
/// lock, so no other release can interleave); returns the object, to be
/// dropped by the caller with no lock held.
pub(crate) fn remove_if(handle: u64, kind: Kind, allow: impl FnOnce(&Object) -> Res) -> Res<Object> {
    let mut t = TABLE.lock();
    let slot = check(&mut t, handle, kind)?;
    allow(slot.object.as_ref().expect("checked"))?;
    let object = slot.object.take().expect("checked");
    slot.generation = match (slot.generation + 1) & GENERATION_MASK {
        0 => 1,
        g => g,
    };
    let (_, _, index) = decode(handle);
    t.free.push(index);
    Ok(object)
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
        let slot = check(&mut t, h, Kind::Registration).map_err(|mut f| {
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
