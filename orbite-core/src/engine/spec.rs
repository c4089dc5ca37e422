//! What to prepare: a [`TransferSpec`] names the direction, both descriptor
//! lists, the [`Target`] whose memory the remote list names, options and an
//! optional notification.

use std::sync::Arc;

use crate::batch::{Desc, TransferOptions};
use crate::engine::RemoteSegment;
use crate::file::Entry;
use crate::types::Op;

/// Who the remote descriptors belong to.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// This engine itself (the self connection NIXL uses for local
    /// transfers): remote descriptors name this engine's registrations.
    Loopback,
    /// A peer engine: remote descriptors name registrations of its
    /// segment (ids as in its descriptor).
    Peer(&'a RemoteSegment),
    /// A local file: remote descriptors are file extents (`offset`, `len`;
    /// their `registration` is ignored). READ moves file bytes into the
    /// local memory, WRITE the reverse.
    File(&'a Arc<Entry>),
}

/// What to prepare.
#[derive(Debug, Clone, Copy)]
pub struct TransferSpec<'a> {
    /// Direction.
    pub op: Op,
    /// Local descriptors (source of a WRITE, destination of a READ).
    pub local: &'a [Desc],
    /// Target descriptors; together they cover as many bytes as `local`.
    pub remote: &'a [Desc],
    /// Whose memory `remote` names.
    pub target: Target<'a>,
    /// Options.
    pub options: TransferOptions,
    /// A notification delivered to the target exactly once, after every
    /// byte landed; success requires its delivery.
    pub notification: Option<&'a [u8]>,
}

impl<'a> TransferSpec<'a> {
    /// A spec with default options and no notification.
    pub fn new(op: Op, local: &'a [Desc], remote: &'a [Desc], target: Target<'a>) -> Self {
        TransferSpec { op, local, remote, target, options: TransferOptions::default(), notification: None }
    }
}
