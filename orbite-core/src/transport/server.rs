//! The target server: every accepted connection of the tcp route (and of
//! the local socket) as a `proto::server` machine, driven by a fixed set of
//! threads over one epoll set; it lands peers' requests in registered
//! memory. The initiator side (per-peer links) is `transport::link`.
//!
//! Data path: a WRITE frame is a header, a body of remote descriptors and
//! the payload, sent with one `writev` straight from registered memory; the
//! target validates the whole body (epoch, ids, generations, bounds,
//! permissions) before it reads a payload byte, then receives the payload
//! straight into its registered memory. A READ reply is sent straight from
//! registered memory. Many descriptors travel in one frame (one route task,
//! up to `task_bytes` and 4096 spans); a peer's tasks spread over its
//! connections. A refusal is a typed error frame and the connection stays
//! usable; a malformed frame closes that connection only.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::charge::{Charge, Counter};
use crate::transport::auth::Secret;
use crate::transport::proto::server::{
    Close, ConnEnd, Deadlines, Event, Expired, ServerBudget, ServerConn, Subscribe, TargetSide,
};
use crate::transport::reactor::{After, Group, Interest, Reactor, Ready, Source};
use crate::transport::sock::{Stream, tune};
use crate::transport::watchers::{WatcherLimits, Watchers};
use crate::wire;

/// The listening side: its listeners, every accepted connection's
/// [`ServerConn`] and the watch pushes, as sources of the engine's reactor.
pub(crate) struct Server {
    addr: SocketAddr,
    local: Option<String>,
    reactor: Arc<Reactor>,
    group: Group,
    watchers: Arc<Watchers>,
    shared: Arc<ServerShared>,
}

/// What a server accepts, and how long it waits for a peer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServerLimits {
    /// Connections at once (`max_connections`).
    pub max_connections: usize,
    /// Connections at once from one peer address
    /// (`max_connections_per_address`).
    pub per_address: usize,
    /// A frame that started must be in, and its reply out, within this
    /// plus its bytes at `min_rate`; an authenticating connection's whole
    /// handshake, from accept to AuthOk, within this
    /// (`server_frame_timeout_ms`).
    pub frame_timeout: Duration,
    /// Connections that have not authenticated yet, at once
    /// (`max_unauthenticated_connections`; with a secret only).
    pub unauthenticated: usize,
    /// A connection with no exchange for this long is closed
    /// (`server_idle_timeout_ms`; `None`: never).
    pub idle_timeout: Option<Duration>,
    /// Slowest accepted peer, bytes per second (0: no rate bound).
    pub min_rate: u64,
    /// Each accepted connection's receive window (`sock::tune`).
    pub window: u64,
    /// Watch connections at once.
    pub watchers: WatcherLimits,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_connections: 4096,
            per_address: 512,
            frame_timeout: Duration::from_secs(10),
            unauthenticated: 256,
            idle_timeout: None,
            min_rate: 1 << 20,
            window: 1 << 20,
            watchers: WatcherLimits { total: 1024, per_address: 64 },
        }
    }
}

impl ServerLimits {
    /// The bounds each connection's machine keeps.
    fn deadlines(&self) -> Deadlines {
        Deadlines { frame_timeout: self.frame_timeout, idle_timeout: self.idle_timeout, min_rate: self.min_rate }
    }

    /// How often watchers that fell behind are tried again.
    fn resync_interval(&self) -> Duration {
        let shortest = self.idle_timeout.map_or(self.frame_timeout, |i| i.min(self.frame_timeout));
        (shortest / 10).clamp(Duration::from_millis(5), Duration::from_millis(250))
    }
}

/// How long a listener rests after accept ran out of descriptors (or
/// memory), instead of spinning on the connection it cannot take.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Bytes one connection may move per turn before others get theirs.
const TURN_BYTES: usize = 8 << 20;

/// An accepted connection's socket and peer address (`None`: the local
/// socket).
type Accepted = (Arc<Stream>, Option<IpAddr>);

/// What the server's sources share.
struct ServerShared {
    /// Bytes one connection may move per turn.
    turn: usize,
    limits: ServerLimits,
    /// With a secret, every connection authenticates first.
    secret: Option<Arc<Secret>>,
    reactor: Weak<Reactor>,
    group: Group,
    /// Connections per peer address.
    addresses: Mutex<HashMap<IpAddr, usize>>,
    /// Connections that still owe their handshake, oldest first.
    unauthenticated: Mutex<VecDeque<u64>>,
    side: Weak<dyn TargetSide>,
    /// Every accepted connection: its socket and peer address.
    conns: Mutex<HashMap<u64, Accepted>>,
    budget: ServerBudget,
    watchers: Arc<Watchers>,
}

impl Server {
    /// Binds and starts serving on `reactor`. The server holds the target
    /// side weakly. With `local`, it also serves on that local socket (an
    /// abstract Unix socket: see `transport::unix`); a local socket that
    /// cannot be bound is left out (`Server::local_socket` is then `None`).
    pub fn start(
        reactor: &Arc<Reactor>,
        bind: &str,
        local: Option<&str>,
        side: Weak<dyn TargetSide>,
        limits: ServerLimits,
        budget: ServerBudget,
        secret: Option<Arc<Secret>>,
    ) -> io::Result<Server> {
        Self::start_with(reactor, bind, local, side, TURN_BYTES, limits, budget, secret)
    }

    /// [`Server::start`] with connections taking turns of `turn` bytes.
    #[allow(clippy::too_many_arguments)]
    fn start_with(
        reactor: &Arc<Reactor>,
        bind: &str,
        local: Option<&str>,
        side: Weak<dyn TargetSide>,
        turn: usize,
        limits: ServerLimits,
        budget: ServerBudget,
        secret: Option<Arc<Secret>>,
    ) -> io::Result<Server> {
        let listener = TcpListener::bind(bind)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let local = local.and_then(|n| crate::transport::unix::bind(n).ok().map(|l| (l, n.to_owned())));
        let watchers = Arc::new(Watchers::new(limits.watchers, budget.counters.clone())?);
        let group = Group::default();
        let shared = Arc::new(ServerShared {
            turn: turn.max(1),
            limits,
            secret,
            reactor: Arc::downgrade(reactor),
            group: group.clone(),
            addresses: Mutex::new(HashMap::new()),
            unauthenticated: Mutex::new(VecDeque::new()),
            side,
            conns: Mutex::new(HashMap::new()),
            budget,
            watchers: watchers.clone(),
        });
        let listening = |socket| {
            let shared = shared.clone();
            move |_| Box::new(Listening { shared, socket, resume: None }) as Box<dyn Source>
        };
        reactor.add(&group, listening(Listener::Tcp(listener)));
        let local_name = local.map(|(l, name)| {
            reactor.add(&group, listening(Listener::Local(l)));
            name
        });
        let pushes = Pushes { shared: shared.clone(), last: Instant::now() };
        reactor.add(&group, move |_| Box::new(pushes));
        Ok(Server { addr, local: local_name, reactor: reactor.clone(), group, watchers, shared })
    }

    /// Initiators watching this engine's registrations.
    pub fn watchers(&self) -> Arc<Watchers> {
        self.watchers.clone()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections that have not authenticated yet.
    pub fn unauthenticated(&self) -> usize {
        self.shared.unauthenticated.lock().len()
    }

    /// The local socket's name, if it serves one.
    pub fn local_socket(&self) -> Option<&str> {
        self.local.as_deref()
    }

    /// Stops serving: closes the listeners and every connection, and waits
    /// until none is served any more.
    pub fn shutdown(&self) {
        self.group.stop(&self.reactor, "the server stopped");
    }
}

/// A listening socket.
enum Listener {
    Tcp(TcpListener),
    Local(UnixListener),
}

/// A listener as a source: accepts within the caps.
struct Listening {
    shared: Arc<ServerShared>,
    socket: Listener,
    /// When a resting listener takes connections again.
    resume: Option<Instant>,
}

impl Source for Listening {
    fn fd(&self) -> BorrowedFd<'_> {
        match &self.socket {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Local(l) => l.as_fd(),
        }
    }

    fn interest(&self) -> Interest {
        Interest::IN | Interest::ET
    }

    /// Accepts every waiting connection; out of descriptors (or memory),
    /// the listener rests for [`ACCEPT_BACKOFF`] instead of spinning on
    /// what it cannot take.
    fn turn(&mut self) -> After {
        if self.resume.is_some() {
            return After::Wait;
        }
        loop {
            let accepted = match &self.socket {
                Listener::Tcp(l) => l.accept().map(|(s, from)| self.shared.take_tcp(s, from.ip())),
                Listener::Local(l) => l.accept().map(|(s, _)| self.shared.take_local(s)),
            };
            match accepted {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return After::Wait,
                Err(_) => {
                    // EMFILE, ENFILE, ENOBUFS, ENOMEM: rest, then retry.
                    self.resume = Instant::now().checked_add(ACCEPT_BACKOFF);
                    return After::Wait;
                }
            }
        }
    }

    fn deadline(&self) -> Option<Instant> {
        self.resume
    }

    fn expire(&mut self, now: Instant) -> After {
        if self.resume.is_some_and(|at| now >= at) {
            self.resume = None;
            return After::Again;
        }
        After::Wait
    }
}

/// The watch pushes as a source: a push round when the registry changed,
/// and watchers that fell behind tried again now and then.
struct Pushes {
    shared: Arc<ServerShared>,
    last: Instant,
}

impl Source for Pushes {
    fn fd(&self) -> BorrowedFd<'_> {
        self.shared.watchers.wake_fd().as_fd()
    }

    fn interest(&self) -> Interest {
        Interest::IN | Interest::ET
    }

    fn turn(&mut self) -> After {
        if let Some(side) = self.shared.side.upgrade() {
            if side.pushes_withheld() {
                // A test keeps the changes back: they go once it stops.
                return After::Again;
            }
            self.shared.watchers.push_round(&|| side.registry_version(), &|since, budget| side.changes(since, budget));
        }
        After::Wait
    }

    fn deadline(&self) -> Option<Instant> {
        (self.shared.watchers.count() > 0).then(|| self.last + self.shared.limits.resync_interval())
    }

    fn expire(&mut self, now: Instant) -> After {
        if self.deadline().is_some_and(|at| now >= at) {
            self.last = now;
            // Watchers that were behind get what they missed, if they read now.
            if let Some(side) = self.shared.side.upgrade() {
                self.shared.watchers.resync(side.registry_version(), &|since, budget| side.changes(since, budget));
            }
        }
        After::Wait
    }
}

impl ServerShared {
    /// A connection from `ip` accepted: served if within the caps (checked
    /// before any buffer or machine is spent), else closed at once.
    fn take_tcp(self: &Arc<Self>, stream: std::net::TcpStream, ip: IpAddr) {
        if self.conns.lock().len() >= self.limits.max_connections {
            return self.refused(&ip.to_string(), "max_connections");
        }
        {
            let mut a = self.addresses.lock();
            let n = a.entry(ip).or_insert(0);
            if *n >= self.limits.per_address {
                drop(a);
                return self.refused(&ip.to_string(), "max_connections_per_address");
            }
            *n += 1;
        }
        tune(&stream, self.limits.window);
        let Ok(here) = stream.local_addr() else { return self.forget_address(ip) };
        self.admit(stream.into(), Some(ip), ConnEnd::Tcp(here));
    }

    /// [`Self::take_tcp`] for the local socket: only processes of this
    /// user are served (the kernel says who connected); the others are
    /// closed at once.
    fn take_local(self: &Arc<Self>, stream: std::os::unix::net::UnixStream) {
        let mine = crate::transport::unix::peer_credentials(stream.as_raw_fd())
            .is_ok_and(|c| c.uid == crate::transport::unix::my_uid());
        if !mine {
            return;
        }
        if self.conns.lock().len() >= self.limits.max_connections {
            return self.refused("the local socket", "max_connections");
        }
        self.admit(stream.into(), None, ConnEnd::Local);
    }

    /// Makes room for one more connection that owes its handshake
    /// (`max_unauthenticated_connections`, with a secret): the oldest such
    /// connection is shut down and counted. Connections that never
    /// authenticate so never take the slots authenticated peers hold, and
    /// a genuine handshake, done within a round trip, outlives a flood of
    /// them unless the cap's worth of connections arrives meanwhile.
    fn evict_an_unauthenticated(&self) {
        let oldest = {
            let mut pending = self.unauthenticated.lock();
            if pending.len() < self.limits.unauthenticated {
                return;
            }
            pending.pop_front()
        };
        let Some(id) = oldest else { return };
        // Its loop closes it once it sees the shutdown.
        let Some((stream, peer)) = self.conns.lock().get(&id).cloned() else { return };
        stream.shutdown();
        self.refused(&from(peer), "max_unauthenticated_connections (its oldest handshake was closed)");
    }

    /// A connection from `from` was closed at accept: over the cap `why`.
    fn refused(&self, from: &str, why: &str) {
        if let Some(side) = self.side.upgrade() {
            side.connection_refused(from, why);
        }
    }

    /// Serves an accepted connection (within the caps, already counted).
    fn admit(self: &Arc<Self>, stream: Stream, peer: Option<IpAddr>, at: ConnEnd) {
        let Some(reactor) = self.reactor.upgrade() else { return };
        if stream.set_nonblocking().is_err() {
            return peer.into_iter().for_each(|ip| self.forget_address(ip));
        }
        let mut m = ServerConn::new(self.budget.clone(), self.secret.clone(), at, Instant::now());
        m.set_peer(peer);
        let queued = m.owes_handshake();
        if queued {
            self.evict_an_unauthenticated();
        }
        let stream = Arc::new(stream);
        reactor.add(&self.group, |t| {
            if queued {
                self.unauthenticated.lock().push_back(t.id);
            }
            self.conns.lock().insert(t.id, (stream.clone(), peer));
            let counted = Charge::unlimited(&self.budget.counters, Counter::Connections, 1);
            Box::new(Served {
                shared: self.clone(),
                id: t.id,
                stream,
                peer,
                m,
                queued,
                readable: true,
                _counted: counted,
            })
        });
    }

    /// One connection from `ip` less.
    fn forget_address(&self, ip: IpAddr) {
        let mut a = self.addresses.lock();
        if let Some(n) = a.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                a.remove(&ip);
            }
        }
    }
}

/// One accepted connection as a source: its socket and its machine (which
/// keeps its clock).
struct Served {
    shared: Arc<ServerShared>,
    id: u64,
    stream: Arc<Stream>,
    /// The peer's address (`None`: the local socket, where only this
    /// user's processes are accepted).
    peer: Option<IpAddr>,
    m: ServerConn,
    /// True while it is in the queue of connections that owe their
    /// handshake (the oldest is evicted first).
    queued: bool,
    /// False once a read found the socket drained, until epoll reports it
    /// readable again: an edge that only says the socket is writable
    /// costs no read.
    readable: bool,
    /// Counted in `connections` while it lives.
    _counted: Charge,
}

/// Who a connection is from, as the engine's log says it.
fn from(peer: Option<IpAddr>) -> String {
    peer.map_or_else(|| "the local socket".to_owned(), |ip| ip.to_string())
}

impl Served {
    /// Moves bytes until the socket would block (`Wait`), the turn is used
    /// up (`Again`), or the connection ends (`Close`).
    fn serve(&mut self) -> After {
        let shared = &*self.shared;
        let fd = self.stream.as_raw_fd();
        let m = &mut self.m;
        let mut moved = 0usize;
        let after = loop {
            if moved >= shared.turn {
                break After::Again; // others' turn
            }
            let fds: Vec<i32> = m.send_fds().iter().map(AsRawFd::as_raw_fd).collect();
            if let Some(out) = m.send_buf() {
                let r = if fds.is_empty() {
                    // SAFETY: the machine's iovecs address its own buffers or
                    // registered memory its loans keep alive.
                    unsafe { libc::writev(fd, out.as_ptr(), out.len().min(1024) as i32) }
                } else {
                    // SAFETY: as above; the descriptors are live (the
                    // machine owns them until they are sent).
                    unsafe { crate::transport::unix::send_with_fds(fd, out, &fds) }
                };
                if r >= 0 {
                    m.sent(r as usize);
                    moved += r as usize;
                    continue;
                }
                match io::Error::last_os_error().kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock => break After::Wait,
                    _ => break After::Close,
                }
            }
            if !self.readable {
                break After::Wait;
            }
            let Some(side) = shared.side.upgrade() else { break After::Close };
            let Some(into) = m.recv_buf() else { continue };
            let asked: usize = into[..into.len().min(1024)].iter().map(|v| v.iov_len).sum();
            // SAFETY: the machine's iovecs address its own buffers or
            // registered memory its loans keep alive, which no Rust
            // reference aliases while the kernel writes them.
            let r = unsafe { libc::readv(fd, into.as_ptr(), into.len().min(1024) as i32) };
            if r == 0 {
                break After::Close; // the peer closed
            }
            if r < 0 {
                match io::Error::last_os_error().kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock => {
                        self.readable = false;
                        break After::Wait;
                    }
                    _ => break After::Close,
                }
            }
            moved += r as usize;
            // A read that filled less than it asked found the socket
            // drained: the next would most likely fail with EAGAIN. Once
            // the reply is out, wait for the next edge instead (bytes that
            // came meanwhile raised one): one system call less per request.
            if (r as usize) < asked {
                self.readable = false;
            }
            match m.received(r as usize, side.view()) {
                Ok(event) => {
                    if let Some(Subscribe { epoch, request, budget, since }) = perform(m, side.as_ref(), event) {
                        let socket = self.stream.clone();
                        let now = side.registry_version();
                        let changes = |since, budget| side.changes(since, budget);
                        let sub = (epoch, request, budget, since);
                        match shared.watchers.subscribe(self.id, self.peer, sub, socket, now, &changes) {
                            Ok(()) => m.subscribed(),
                            Err(why) => {
                                m.refuse_request(request, wire::RemoteStatus::ResourceExhausted, &why.to_string())
                            }
                        }
                    }
                }
                Err(Close::Unauthenticated) => {
                    // Say why (what fits the socket now), then close.
                    if let Some(out) = m.send_buf() {
                        // SAFETY: the machine's iovecs address its own buffers.
                        unsafe { libc::writev(fd, out.as_ptr(), out.len().min(1024) as i32) };
                    }
                    side.auth_failed(&from(self.peer), m.refusal().unwrap_or("refused"));
                    break After::Close;
                }
                Err(Close::Malformed(why)) => {
                    // Malformed: close this connection only, and say so.
                    side.connection_broke(&from(self.peer), &why.to_string());
                    break After::Close;
                }
            }
        };
        self.m.tick(Instant::now(), moved > 0);
        if self.queued && !self.m.owes_handshake() {
            self.queued = false;
            self.shared.unauthenticated.lock().retain(|c| *c != self.id);
        }
        after
    }
}

impl Source for Served {
    fn fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }

    fn ready(&mut self, ready: Ready) {
        if ready.readable() {
            self.readable = true;
        }
    }

    fn turn(&mut self) -> After {
        self.serve()
    }

    fn deadline(&self) -> Option<Instant> {
        self.m.deadline(&self.shared.limits.deadlines())
    }

    /// A connection whose exchange took longer than the frame bound allows
    /// (a stalled or trickling peer, or one that owes its handshake), or
    /// idle past the idle bound, is closed.
    fn expire(&mut self, now: Instant) -> After {
        match self.m.expired(now, &self.shared.limits.deadlines()) {
            None => After::Wait,
            Some(Expired::Handshake) => {
                if let Some(side) = self.shared.side.upgrade() {
                    side.auth_failed(&from(self.peer), "did not finish its handshake within server_frame_timeout_ms");
                }
                After::Close
            }
            Some(Expired::Stalled | Expired::Idle) => After::Close,
        }
    }

    /// Its machine (and the loans of a request in progress), its
    /// subscription and its borrows end with it.
    fn close(&mut self) {
        let shared = &self.shared;
        shared.conns.lock().remove(&self.id);
        if let Some(ip) = self.peer {
            shared.forget_address(ip);
        }
        if std::mem::take(&mut self.queued) {
            shared.unauthenticated.lock().retain(|c| *c != self.id);
        }
        self.stream.shutdown();
        shared.watchers.forget(self.id);
    }
}

/// Does what `event` asks of the driver, answering the machine, until
/// the machine asks nothing more or asks for a subscription (returned:
/// the driver's watchers take it).
pub(crate) fn perform(m: &mut ServerConn, side: &dyn TargetSide, event: Option<Event>) -> Option<Subscribe> {
    let mut event = event;
    while let Some(e) = event.take() {
        event = match e {
            Event::Subscribe(s) => return Some(s),
            Event::Deliver(n) => {
                let env = wire::NotifyEnvelope {
                    sender_endpoint: &n.sender_endpoint,
                    sender_epoch: n.sender_epoch,
                    target_epoch: n.target_epoch,
                    payload: &n.payload,
                };
                m.delivered(side.deliver(&env))
            }
            Event::ShareFds(names) => m.shared(names.iter().map(|n| side.shared_fd(n)).collect()),
            Event::ExportIpc(ids) => {
                let (entries, fds) = side.ipc_export(&ids);
                m.exported(entries, fds)
            }
            Event::Resolved => {
                side.remote_gate();
                m.proceed()
            }
            Event::Stage(mut landing) => {
                let result = landing.copy();
                m.staged(landing, result)
            }
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Registration;
    use crate::transport::proto::server::TargetView;
    use crate::transport::sock::iov;
    use crate::wire::{Kind, Limits, NotifyEnvelope, RemoteDesc, RemoteStatus, Request};
    use std::io::{Read, Write};
    use std::net::TcpStream;

    const EPOCH: u64 = 0x5e;
    const LEN: usize = 1 << 20;

    /// One read-write registration (id 1) of 1 MiB.
    struct Side {
        base: usize,
    }

    impl TargetView for Side {
        fn epoch(&self) -> u64 {
            EPOCH
        }

        fn descriptor(&self) -> Vec<u8> {
            Vec::new()
        }

        fn resolve(
            &self,
            req: &Request<'_>,
            _write: bool,
            iovs: &mut Vec<libc::iovec>,
            _loans: &mut Vec<Arc<Registration>>,
        ) -> Result<(), (RemoteStatus, String)> {
            for d in req.descs() {
                if d.registration != 1 || d.offset.checked_add(d.len).is_none_or(|e| e > LEN as u64) {
                    return Err((RemoteStatus::OutOfBounds, String::new()));
                }
                iovs.push(iov(self.base as u64 + d.offset, d.len));
            }
            Ok(())
        }

        fn changes(&self, _since: u64, _budget: usize) -> crate::segment::Delta {
            crate::segment::Delta::default()
        }

        fn registry_version(&self) -> u64 {
            0
        }

        fn limits(&self) -> Limits {
            Limits { max_body: 1 << 16, max_data: LEN as u32 }
        }
    }

    impl TargetSide for Side {
        fn view(&self) -> &dyn TargetView {
            self
        }

        fn deliver(&self, _env: &NotifyEnvelope<'_>) -> Result<(), (RemoteStatus, String)> {
            Ok(())
        }
    }

    fn request(s: &mut TcpStream, kind: Kind, len: u64, id: u64, payload: &[u8]) -> wire::Header {
        let mut body = Vec::new();
        wire::encode_request(&mut body, EPOCH, [RemoteDesc { registration: 1, offset: 0, len }].into_iter());
        let mut f = wire::encode_header(&wire::header(kind, body.len(), payload.len() as u64, id)).to_vec();
        f.extend_from_slice(&body);
        f.extend_from_slice(payload);
        s.write_all(&f).unwrap();
        let mut h = [0u8; wire::HEADER_LEN];
        s.read_exact(&mut h).expect("the reply arrives");
        let h = wire::decode_header(&h, Limits { max_body: 1 << 16, max_data: LEN as u32 }).unwrap();
        let mut rest = vec![0u8; (h.body_len + h.data_len) as usize];
        s.read_exact(&mut rest).unwrap();
        h
    }

    /// With turns of one byte, every turn ends with something left: a
    /// reply half sent must still go out (the connection waits to be
    /// writable, not readable, while its peer waits for that reply).
    #[test]
    fn a_turn_that_ends_with_a_reply_pending_still_sends_it() {
        let mem: &'static mut [u8] = Box::leak(vec![0u8; LEN].into_boxed_slice());
        let side: Arc<dyn TargetSide> = Arc::new(Side { base: mem.as_mut_ptr() as usize });
        let reactor = Reactor::start("test", Duration::ZERO).unwrap();
        let server = Server::start_with(
            &reactor,
            "127.0.0.1:0",
            None,
            Arc::downgrade(&side),
            1,
            ServerLimits::default(),
            ServerBudget::default(),
            None,
        )
        .unwrap();
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let payload = vec![7u8; 256 << 10];
        for id in 1..=8 {
            assert_eq!(request(&mut s, Kind::Write, payload.len() as u64, id, &payload).kind, Kind::WriteAck);
            let h = request(&mut s, Kind::Read, payload.len() as u64, 100 + id, &[]);
            assert_eq!((h.kind, h.data_len as usize), (Kind::ReadReply, payload.len()));
        }
        server.shutdown();
        reactor.shutdown();
    }
}
