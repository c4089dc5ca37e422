//! The routes, and the policy that picks one for a transfer: explicit, and
//! it says why.
//!
//! Adding a route is its file and one line in [`ROUTES`] (plus its names
//! in `types::Route` and, for a new way of copying, a `CopyKind`).

use crate::transport::route::{Reach, RouteImpl, Serves};
use crate::transport::{CopyKind, PeerError};
use crate::types::{Desc, Route, RouteChoice, RoutePolicy};

/// Every route. For peers, `auto` prefers them in this order.
pub(crate) static ROUTES: &[&dyn RouteImpl] = &[
    &crate::transport::loopback::Loopback,
    &crate::transport::shm::Shm,
    &crate::transport::cma::Cma,
    &crate::transport::ipc::CudaIpc,
    &crate::transport::tcp::Tcp,
    &crate::transport::file::File,
];

/// The route called `route`.
pub(crate) fn by_name(route: Route) -> &'static dyn RouteImpl {
    ROUTES.iter().copied().find(|r| r.route() == route).expect("every Route has an implementation in ROUTES")
}

/// The route policy: which route a transfer to `target` naming `remote`
/// takes under `policy` (peers only; the self connection and files have
/// one route each), and why.
pub(crate) fn choose(
    policy: RoutePolicy,
    target: &Reach<'_>,
    remote: &[Desc],
) -> Result<(&'static dyn RouteImpl, RouteChoice, CopyKind), PeerError> {
    let serves = match target {
        Reach::Loopback => Serves::Loopback,
        Reach::Peer(_) => Serves::Peer,
        Reach::File(..) => Serves::File,
    };
    let choice =
        |r: &'static dyn RouteImpl, kind, reason: String| Ok((r, RouteChoice { route: r.route(), reason }, kind));
    if serves != Serves::Peer {
        let r = ROUTES.iter().copied().find(|r| r.serves() == serves).expect("a route for every target");
        let reason = match serves {
            Serves::Loopback => "self connection",
            _ => "local file",
        };
        let kind = r
            .plan(target, remote)
            .map_err(|why| PeerError::RouteUnavailable { route: r.route(), reason: why.to_string() })?;
        return choice(r, kind, reason.into());
    }
    let forced = match policy {
        RoutePolicy::Auto => None,
        RoutePolicy::Tcp => Some(Route::Tcp),
        RoutePolicy::Shm => Some(Route::Shm),
        RoutePolicy::Cma => Some(Route::Cma),
        RoutePolicy::CudaIpc => Some(Route::CudaIpc),
    };
    if let Some(route) = forced {
        let r = by_name(route);
        return match r.plan(target, remote) {
            Ok(kind) => choice(r, kind, format!("policy {}", name(route))),
            Err(why) => Err(PeerError::RouteUnavailable { route, reason: why.to_string() }),
        };
    }
    // auto: the first peer route that reaches every range; the reason says
    // what ruled out the ones before it.
    let mut ruled_out = Vec::new();
    for r in ROUTES.iter().copied().filter(|r| r.serves() == Serves::Peer) {
        match r.plan(target, remote) {
            Ok(kind) => {
                let parts: Vec<String> = r.auto_reason().map(str::to_owned).into_iter().chain(ruled_out).collect();
                return choice(r, kind, format!("auto: {}", parts.join("; ")));
            }
            Err(why) => ruled_out.push(format!("not {}: {why}", name(r.route()))),
        }
    }
    Err(PeerError::RouteUnavailable { route: Route::Tcp, reason: ruled_out.join("; ") })
}

/// A route's name as policies and reasons spell it.
fn name(route: Route) -> &'static str {
    match route {
        Route::Loopback => "loopback",
        Route::Tcp => "tcp",
        Route::Shm => "shm",
        Route::Cma => "cma",
        Route::CudaIpc => "cuda-ipc",
        Route::File => "file",
    }
}
