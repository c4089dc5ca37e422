//! The self connection: copies between registrations of this engine (what
//! NIXL uses for local transfers), on the local workers.

use crate::transport::CopyKind;
use crate::transport::route::{Reach, RouteImpl, Serves, Unreachable};
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

    fn plan(&self, target: &Reach<'_>, _remote: &[Desc]) -> Result<CopyKind, Unreachable> {
        match target {
            Reach::Loopback => Ok(CopyKind::Memory),
            _ => Err(Unreachable::NotThisEngine),
        }
    }
}
