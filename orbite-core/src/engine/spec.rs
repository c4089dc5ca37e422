//! What to prepare: a [`TransferSpec`] names the direction, both descriptor
//! lists, the [`Target`] whose memory the remote list names, options and an
//! optional notification.

use std::sync::Arc;

use crate::batch::{Desc, TransferOptions};
use crate::engine::RemoteSegment;
use crate::file::Entry;
use crate::types::{Op, TargetOf};

/// Who the remote descriptors belong to: this engine
/// (`Target::Loopback`), a peer (`Target::Peer(&segment)`) or a local
/// file (`Target::File(&entry)`); see [`TargetOf`].
pub type Target<'a> = TargetOf<&'a RemoteSegment, &'a Arc<Entry>>;

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
