//! The self connection: copies between registrations of this engine (what
//! NIXL uses for local transfers), on the local workers.

use crate::segment::ExportedRegistration;
use crate::transport::CopyKind;
use crate::transport::route::{PeerReach, Reach, RouteImpl, Serves};
use crate::types::{Desc, Route};

/// The self-connection route.
pub(crate) struct Loopback;

impl RouteImpl for Loopback {
    fn route(&self) -> Route {
        Route::Loopback
    }

    fn serves(&self) -> Serves {
        Serves::Loopback
    }

    fn plan(&self, target: &Reach<'_>, _remote: &[Desc]) -> Result<CopyKind, String> {
        match target {
            Reach::Loopback => Ok(CopyKind::Memory),
            _ => Err("not this engine".into()),
        }
    }

    fn address(&self, _target: &PeerReach<'_>, _r: &ExportedRegistration) -> Result<(u64, u64), String> {
        Err("the self connection addresses this engine's registrations".into())
    }
}
