//! What handles refer to.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use orbite_core::{BindingCharge, HostMemory, RegistrationId, RemoteSegment, Transfer, TransferEngine};
use parking_lot::Mutex;

use crate::handles::Kind;
use crate::status::Res;

#[derive(Clone)]
pub(crate) enum Object {
    Engine(Arc<EngineObj>),
    Registration(Arc<RegObj>),
    SharedMemory(Arc<ShmObj>),
    Peer(Arc<PeerObj>),
    Transfer(Arc<XferObj>),
    File(Arc<FileObj>),
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self {
            Object::Engine(_) => Kind::Engine,
            Object::Registration(_) => Kind::Registration,
            Object::SharedMemory(_) => Kind::SharedMemory,
            Object::Peer(_) => Kind::Peer,
            Object::Transfer(_) => Kind::Transfer,
            Object::File(_) => Kind::File,
        }
    }
}

pub(crate) struct EngineObj {
    pub engine: TransferEngine,
    /// Live handles of objects of this engine.
    pub children: AtomicU64,
    /// Live shared allocations: a registration inside one of them is a
    /// shared range (it may take the shm route).
    pub shared: Mutex<Vec<HostMemory>>,
}

/// Held by every object of an engine: keeps the engine alive, counts
/// against its handle budget and its live-children count.
pub(crate) struct Child {
    pub engine: Arc<EngineObj>,
    _charge: BindingCharge,
}

impl Child {
    pub fn new(engine: &Arc<EngineObj>) -> Res<Child> {
        let charge = engine.engine.charge_binding_handles(1)?;
        engine.children.fetch_add(1, Ordering::AcqRel);
        Ok(Child { engine: engine.clone(), _charge: charge })
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.engine.children.fetch_sub(1, Ordering::AcqRel);
    }
}

pub(crate) struct RegObj {
    pub child: Child,
    pub id: RegistrationId,
}

pub(crate) struct ShmObj {
    pub child: Child,
    pub memory: HostMemory,
}

pub(crate) struct PeerObj {
    pub child: Child,
    /// `None`: the engine itself (the self connection).
    pub segment: Option<RemoteSegment>,
}

pub(crate) struct FileObj {
    pub child: Child,
    pub entry: Arc<orbite_core::file::Entry>,
}

pub(crate) struct XferObj {
    /// Keeps the engine alive and counts the handle.
    pub _child: Child,
    pub transfer: Transfer,
}
