//! The tcp route: frames to the peer's server, which copies
//! (`transport::server`); this process sends them on its per-peer links
//! (`transport::link`). It reaches any peer, on any host.

use super::{Mover, PeerReach, Reach, RouteImpl, Unreachable};
use crate::segment::ExportedRegistration;
use crate::types::{Desc, Route};

/// The tcp route.
pub(crate) struct Tcp;

impl RouteImpl for Tcp {
    fn route(&self) -> Route {
        Route::Tcp
    }

    fn plan(&self, target: &Reach<'_>, _remote: &[Desc]) -> Result<Mover, Unreachable> {
        match target {
            // Frames to the peer's server, which copies.
            Reach::Peer(_) => Ok(Mover::Frames { staging: None }),
            _ => Err(Unreachable::NotPeer),
        }
    }

    fn address(&self, _target: &PeerReach<'_>, r: &ExportedRegistration) -> Result<(u64, u64), Unreachable> {
        // Offsets in the peer's registration, named on the wire.
        Ok((0, r.id.to_raw()))
    }
}
