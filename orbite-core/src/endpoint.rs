//! Where an engine listens, and the endpoint it advertises to peers.
//!
//! A listener bound to a specific address advertises that address. One
//! bound to all interfaces (`0.0.0.0` or `[::]`, the deployment default)
//! advertises an address other hosts can reach, found in this order: the
//! configured `advertise`; the source address of the route to the default
//! gateway; the first non-loopback address of an interface that is up;
//! else `127.0.0.1`, which only this host can reach (the engine says so in
//! [`Advertised::warning`]). Nothing here sends a packet: the route lookup
//! is a `connect` of a UDP socket.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

/// Listen address of deployments (the NIXL backend, `orbite info`) when the
/// configuration names none: every interface, a free port.
pub const ALL_INTERFACES: &str = "0.0.0.0:0";

/// How the advertised address was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdvertiseSource {
    /// From the configuration's `advertise`.
    Configured,
    /// The listener is bound to this specific address.
    Bound,
    /// The source address of the route to the default gateway.
    DefaultRoute {
        /// The gateway that route goes through (absent for a device route).
        gateway: Option<IpAddr>,
    },
    /// The first non-loopback address of an interface that is up.
    FirstUp {
        /// That interface.
        interface: String,
    },
    /// Nothing better was found: only this host can connect.
    LoopbackFallback,
}

impl std::fmt::Display for AdvertiseSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AdvertiseSource::Configured => f.write_str("configured (`advertise`)"),
            AdvertiseSource::Bound => f.write_str("the address the listener is bound to"),
            AdvertiseSource::DefaultRoute { gateway: Some(g) } => {
                write!(f, "source address of the route to the default gateway {g}")
            }
            AdvertiseSource::DefaultRoute { gateway: None } => f.write_str("source address of the default route"),
            AdvertiseSource::FirstUp { interface } => {
                write!(f, "first non-loopback address that is up (interface {interface})")
            }
            AdvertiseSource::LoopbackFallback => f.write_str("no routable address found"),
        }
    }
}

/// What a listening engine tells peers to dial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advertised {
    /// `host:port` (IPv6 hosts in brackets), dialable by peers.
    pub endpoint: String,
    /// How it was found.
    pub source: AdvertiseSource,
}

impl Advertised {
    /// A warning for operators when other hosts cannot connect.
    pub fn warning(&self) -> Option<String> {
        (self.source == AdvertiseSource::LoopbackFallback).then(|| {
            format!(
                "advertising {}: no routable address was found, so only processes on this host can connect \
                 (set `advertise` or `listen` in the configuration)",
                self.endpoint
            )
        })
    }
}

/// Why an `advertise` value is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AdvertiseError {
    #[error("`{0}` is not a port number")]
    BadPort(String),
    #[error("an opening `[` without `]`")]
    UnclosedBracket,
    #[error("`{0}` is not an IPv6 address")]
    BadIpv6(String),
    #[error("text after `]` that is not `:port`")]
    AfterBracket,
    #[error("`{0}` is not a host or host:port")]
    NotHost(String),
    #[error("port 0 cannot be dialled")]
    PortZero,
}

/// A configured `advertise` value, split: host (brackets removed) and an
/// optional port.
fn split_host_port(s: &str) -> Result<(String, Option<u16>), AdvertiseError> {
    let bad_port = |p: &str| AdvertiseError::BadPort(p.to_owned());
    if let Some(rest) = s.strip_prefix('[') {
        let (host, tail) = rest.split_once(']').ok_or(AdvertiseError::UnclosedBracket)?;
        host.parse::<Ipv6Addr>().map_err(|_| AdvertiseError::BadIpv6(host.to_owned()))?;
        return match tail {
            "" => Ok((host.to_owned(), None)),
            t => {
                let p = t.strip_prefix(':').ok_or(AdvertiseError::AfterBracket)?;
                Ok((host.to_owned(), Some(p.parse().map_err(|_| bad_port(p))?)))
            }
        };
    }
    if s.parse::<Ipv6Addr>().is_ok() {
        return Ok((s.to_owned(), None)); // a bare IPv6 address has no port
    }
    match s.rsplit_once(':') {
        Some((host, port)) => Ok((host.to_owned(), Some(port.parse().map_err(|_| bad_port(port))?))),
        None => Ok((s.to_owned(), None)),
    }
}

/// Checks an `advertise` value: a host name or address, with or without a
/// port (`host`, `host:port`, `[v6]`, `[v6]:port`, bare `v6`).
pub(crate) fn validate_advertise(s: &str) -> Result<(), AdvertiseError> {
    let (host, port) = split_host_port(s)?;
    let name_ok = !host.is_empty()
        && host.len() <= 253
        && host.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':'));
    if !name_ok {
        return Err(AdvertiseError::NotHost(s.to_owned()));
    }
    if port == Some(0) {
        return Err(AdvertiseError::PortZero);
    }
    Ok(())
}

fn join(host: &str, port: u16) -> String {
    if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

/// The endpoint to advertise for a listener bound to `bound`.
pub fn advertise(bound: SocketAddr, configured: Option<&str>) -> Advertised {
    if let Some(c) = configured {
        // Validated with the configuration; a value that no longer splits
        // is advertised as given.
        let endpoint = match split_host_port(c) {
            Ok((host, port)) => join(&host, port.unwrap_or(bound.port())),
            Err(_) => c.to_owned(),
        };
        return Advertised { endpoint, source: AdvertiseSource::Configured };
    }
    if !bound.ip().is_unspecified() {
        return Advertised { endpoint: bound.to_string(), source: AdvertiseSource::Bound };
    }
    let v6_ok = bound.is_ipv6();
    let with_port = |ip: IpAddr| SocketAddr::new(ip, bound.port()).to_string();
    if let Some((ip, gateway)) = default_route_source(v6_ok) {
        return Advertised { endpoint: with_port(ip), source: AdvertiseSource::DefaultRoute { gateway } };
    }
    if let Some((ip, interface)) = first_up_address(v6_ok) {
        return Advertised { endpoint: with_port(ip), source: AdvertiseSource::FirstUp { interface } };
    }
    Advertised { endpoint: with_port(IpAddr::V4(Ipv4Addr::LOCALHOST)), source: AdvertiseSource::LoopbackFallback }
}

/// The IPv4 default gateway from `/proc/net/route` (`None` for a default
/// route without a gateway, `Err` when there is no default route).
fn default_gateway_v4() -> Result<Option<Ipv4Addr>, ()> {
    const RTF_UP: u32 = 0x1;
    const RTF_GATEWAY: u32 = 0x2;
    let table = std::fs::read_to_string("/proc/net/route").map_err(|_| ())?;
    let mut best: Option<(u32, Option<Ipv4Addr>)> = None;
    for line in table.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 {
            continue;
        }
        let hex = |s: &str| u32::from_str_radix(s, 16).ok();
        let (Some(dest), Some(gw), Some(flags), Some(mask), Ok(metric)) =
            (hex(f[1]), hex(f[2]), hex(f[3]), hex(f[7]), f[6].parse::<u32>())
        else {
            continue;
        };
        if dest != 0 || mask != 0 || flags & RTF_UP == 0 {
            continue;
        }
        // The table holds addresses in network byte order, printed as a
        // host-order hex number.
        let gateway = (flags & RTF_GATEWAY != 0).then(|| Ipv4Addr::from(u32::from_be(gw)));
        if best.is_none_or(|(m, _)| metric < m) {
            best = Some((metric, gateway));
        }
    }
    best.map(|(_, g)| g).ok_or(())
}

/// The local address the kernel would send from to reach `to` (no packet
/// is sent: a UDP `connect` only looks up the route).
fn source_address_for(to: IpAddr) -> Option<IpAddr> {
    let local: SocketAddr = match to {
        IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let s = UdpSocket::bind(local).ok()?;
    s.connect(SocketAddr::new(to, 9)).ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_unspecified() && !ip.is_loopback()).then_some(ip)
}

fn default_route_source(v6_ok: bool) -> Option<(IpAddr, Option<IpAddr>)> {
    if let Ok(gateway) = default_gateway_v4() {
        // A device route has no gateway: an address outside the local
        // networks takes it (198.51.100.1 is reserved for documentation).
        let probe = gateway.map_or(IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1)), IpAddr::V4);
        if let Some(ip) = source_address_for(probe) {
            return Some((ip, gateway.map(IpAddr::V4)));
        }
    }
    if v6_ok {
        // 2001:db8::1 is reserved for documentation: only a default route
        // reaches it.
        let probe = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1));
        if let Some(ip) = source_address_for(probe) {
            return Some((ip, None));
        }
    }
    None
}

/// One address of an interface, as `getifaddrs` lists it.
struct InterfaceAddress {
    interface: String,
    ip: IpAddr,
    up: bool,
    loopback: bool,
}

fn interface_addresses() -> Vec<InterfaceAddress> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list it allocated into `head`, freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned, alive until
        // freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a NUL-terminated name owned by the list.
        let interface = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: `ifa_addr` points to a sockaddr whose family says which
        // struct it is; both reads match that family.
        let ip = unsafe {
            match (*ifa.ifa_addr).sa_family as i32 {
                libc::AF_INET => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let a = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(Ipv6Addr::from(a.sin6_addr.s6_addr))
                }
                _ => continue,
            }
        };
        let flags = ifa.ifa_flags;
        out.push(InterfaceAddress {
            interface,
            ip,
            up: flags & libc::IFF_UP as u32 != 0,
            loopback: flags & libc::IFF_LOOPBACK as u32 != 0,
        });
    }
    // SAFETY: the list from getifaddrs above, freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

fn first_up_address(v6_ok: bool) -> Option<(IpAddr, String)> {
    let all = interface_addresses();
    let usable = |a: &&InterfaceAddress| a.up && !a.loopback && !a.ip.is_loopback() && !a.ip.is_unspecified();
    // IPv4 first; IPv6 only when the listener takes it, and never
    // link-local (it needs a scope id to dial).
    let v4 = all.iter().filter(usable).find(|a| a.ip.is_ipv4());
    let v6 = || {
        all.iter().filter(usable).find(|a| match a.ip {
            IpAddr::V6(ip) => v6_ok && (ip.segments()[0] & 0xffc0) != 0xfe80,
            IpAddr::V4(_) => false,
        })
    };
    v4.or_else(v6).map(|a| (a.ip, a.interface.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertise_values_are_checked() {
        for ok in ["10.0.0.5", "10.0.0.5:7000", "node-3.example", "node-3:7000", "[fe80::1]:7000", "[::1]", "fe80::1"] {
            validate_advertise(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in ["", ":7000", "host:", "host:x", "host:70000", "[::1", "[nope]:1", "a b", "host:0", "h/x"] {
            let e = crate::EngineConfig::from_json(&format!(r#"{{"listen": "0.0.0.0:0", "advertise": {bad:?}}}"#))
                .expect_err(bad);
            assert!(e.to_string().contains("advertise"), "{bad}: {e}");
        }
    }

    #[test]
    fn configured_advertise_takes_the_bound_port_when_it_has_none() {
        let bound: SocketAddr = "0.0.0.0:4321".parse().unwrap();
        assert_eq!(advertise(bound, Some("10.1.2.3")).endpoint, "10.1.2.3:4321");
        assert_eq!(advertise(bound, Some("10.1.2.3:99")).endpoint, "10.1.2.3:99");
        assert_eq!(advertise(bound, Some("fe80::1")).endpoint, "[fe80::1]:4321");
        assert_eq!(advertise(bound, Some("[fe80::1]:5")).endpoint, "[fe80::1]:5");
        assert_eq!(advertise(bound, Some("host")).source, AdvertiseSource::Configured);
    }

    #[test]
    fn a_specific_bind_is_advertised_as_is_and_all_interfaces_are_never_advertised() {
        let bound: SocketAddr = "127.0.0.1:4321".parse().unwrap();
        let a = advertise(bound, None);
        assert_eq!((a.endpoint.as_str(), &a.source), ("127.0.0.1:4321", &AdvertiseSource::Bound));
        assert!(a.warning().is_none());
        let a = advertise("0.0.0.0:4321".parse().unwrap(), None);
        let ip: SocketAddr = a.endpoint.parse().unwrap();
        assert!(!ip.ip().is_unspecified(), "{a:?}");
        assert_eq!(ip.port(), 4321);
        assert_eq!(a.warning().is_some(), a.source == AdvertiseSource::LoopbackFallback);
    }
}
