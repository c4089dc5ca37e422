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

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::charge::{Charge, Counter};
use crate::transport::auth::Secret;
use crate::transport::proto::server::{
    Close, ConnEnd, Deadlines, Event, Expired, ServerBudget, ServerConn, Subscribe, TargetSide,
};
use crate::transport::reactor::{Events, Interest, Poller, Timer, Waker};
use crate::transport::sock::{Stream, tune};

/// A one-shot read interest: the thread that takes the event re-arms it.
const ONESHOT_IN: Interest = Interest::IN.union(Interest::ONESHOT);
use crate::transport::watchers::WatcherLimits;
use crate::transport::watchers::Watchers;
use crate::wire;

/// The listening side: every accepted connection's [`ServerConn`], driven
/// by a fixed set of threads over one epoll set, so the thread count does
/// not grow with connections.
pub(crate) struct Server {
    addr: SocketAddr,
    local: Option<String>,
    shared: Arc<ServerShared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    watchers: Arc<Watchers>,
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

    /// How often the deadlines are checked.
    fn sweep_interval(&self) -> Duration {
        let shortest = self.idle_timeout.map_or(self.frame_timeout, |i| i.min(self.frame_timeout));
        (shortest / 10).clamp(Duration::from_millis(5), Duration::from_millis(250))
    }
}

/// How long the listener rests after accept ran out of descriptors (or
/// memory), instead of spinning on the connection it cannot take.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

struct ServerShared {
    /// Bytes one connection may move per turn.
    turn: usize,
    limits: ServerLimits,
    /// With a secret, every connection authenticates first.
    secret: Option<Arc<Secret>>,
    poller: Poller,
    /// The deadline sweep's timer (armed while there is something to
    /// check: connections, or a resting listener).
    timer: Timer,
    timer_armed: Mutex<bool>,
    /// When a resting listener takes connections again.
    accept_resume: Mutex<Option<Instant>>,
    /// Connections per peer address.
    addresses: Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
    /// Connections that still owe their handshake, oldest first.
    unauthenticated: Mutex<std::collections::VecDeque<u64>>,
    /// Woken once at shutdown; level-triggered, so every thread sees it.
    stop: Waker,
    listener: TcpListener,
    /// The local socket (same-host peers prove who they reach over it).
    local: Option<UnixListener>,
    side: Weak<dyn TargetSide>,
    conns: Mutex<std::collections::HashMap<u64, Arc<ServedConn>>>,
    next_conn: AtomicU64,
    budget: ServerBudget,
    watchers: Arc<Watchers>,
}

/// One accepted connection: its socket and its machine. Armed one-shot in
/// the epoll set, so one thread at a time serves it.
struct ServedConn {
    stream: Arc<Stream>,
    /// The peer's address (`None`: the local socket, where only this
    /// user's processes are accepted).
    peer: Option<std::net::IpAddr>,
    machine: Mutex<Served>,
    /// Counted in `connections` while it lives.
    _counted: Charge,
}

/// A connection's machine (which keeps its clock).
struct Served {
    m: ServerConn,
    /// True while it is in the queue of connections that owe their
    /// handshake (the oldest is evicted first).
    queued: bool,
}

/// epoll data of the listener, the stop event and the deadline timer
/// (connections count from 1).
const LISTENER: u64 = u64::MAX;
const STOP: u64 = u64::MAX - 1;
const TIMER: u64 = u64::MAX - 2;
const LOCAL: u64 = u64::MAX - 3;
const WATCHERS: u64 = u64::MAX - 4;

/// Bytes one connection may move per turn before others get theirs.
const TURN_BYTES: usize = 8 << 20;

/// Threads that serve connections: one per core, at most 4.
fn server_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4)
}

impl Server {
    /// Binds and starts serving. The server holds the target side weakly.
    /// With `local`, it also serves on that local socket (an abstract
    /// Unix socket: see `transport::unix`); a local socket that cannot be
    /// bound is left out (`Server::local_socket` is then `None`).
    pub fn start(
        bind: &str,
        local: Option<&str>,
        side: Weak<dyn TargetSide>,
        limits: ServerLimits,
        budget: ServerBudget,
        secret: Option<Arc<Secret>>,
    ) -> io::Result<Server> {
        Self::start_with(bind, local, side, TURN_BYTES, limits, budget, secret)
    }

    /// [`Server::start`] with connections taking turns of `turn` bytes.
    fn start_with(
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
        let poller = Poller::new()?;
        let stop = Waker::new()?;
        poller.add(&stop, STOP, Interest::IN)?;
        poller.add(&listener, LISTENER, ONESHOT_IN)?;
        let (local, local_name) = match local.and_then(|n| crate::transport::unix::bind(n).ok().map(|l| (l, n))) {
            Some((l, n)) => {
                poller.add(&l, LOCAL, ONESHOT_IN)?;
                (Some(l), Some(n.to_owned()))
            }
            None => (None, None),
        };
        let timer = Timer::new()?;
        poller.add(&timer, TIMER, ONESHOT_IN)?;
        let watchers = Arc::new(Watchers::new(limits.watchers, budget.counters.clone())?);
        poller.add(watchers.wake_fd(), WATCHERS, ONESHOT_IN)?;
        let shared = Arc::new(ServerShared {
            turn: turn.max(1),
            limits,
            secret,
            timer,
            timer_armed: Mutex::new(false),
            accept_resume: Mutex::new(None),
            addresses: Mutex::new(std::collections::HashMap::new()),
            unauthenticated: Mutex::new(std::collections::VecDeque::new()),
            poller,
            stop,
            listener,
            local,
            side,
            conns: Mutex::new(std::collections::HashMap::new()),
            next_conn: AtomicU64::new(1),
            budget,
            watchers: watchers.clone(),
        });
        let server =
            Server { addr, local: local_name, shared: shared.clone(), threads: Mutex::new(Vec::new()), watchers };
        for i in 0..server_threads() {
            let shared = shared.clone();
            let spawned = std::thread::Builder::new().name(format!("orbite-serve-{i}")).spawn(move || {
                shared.run();
                // The streams its target staging made (ServerStage) go with
                // it, in plain code: in a thread-local destructor the
                // driver's per-thread state may be gone already, and they
                // would leak.
                crate::cuda::release_thread_streams();
            });
            match spawned {
                Ok(h) => server.threads.lock().push(h),
                Err(e) => {
                    server.shutdown();
                    return Err(e);
                }
            }
        }
        Ok(server)
    }

    /// Initiators watching this engine's registrations.
    pub fn watchers(&self) -> Arc<Watchers> {
        self.watchers.clone()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The local socket's name, if it serves one.
    pub fn local_socket(&self) -> Option<&str> {
        self.local.as_deref()
    }

    /// Stops serving, closes every connection and joins the threads.
    pub fn shutdown(&self) {
        self.shared.stop.wake();
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            let _ = t.join();
        }
        let conns: Vec<u64> = self.shared.conns.lock().keys().copied().collect();
        for id in conns {
            self.shared.close(id);
        }
    }
}

impl ServerShared {
    fn run(&self) {
        let mut ready = Events::with_capacity(64);
        loop {
            if self.poller.wait(&mut ready, None).is_err() {
                return;
            }
            for r in ready.iter() {
                match r.token {
                    STOP => return,
                    LISTENER => self.accept(),
                    LOCAL => self.accept_local(),
                    TIMER => self.sweep(),
                    WATCHERS => self.push_round(),
                    id => self.serve(id),
                }
            }
        }
    }

    /// A push round to the watchers, then re-arms their wake-up.
    fn push_round(&self) {
        if let Some(side) = self.side.upgrade() {
            self.watchers.push_round(&|| side.registry_version(), &|since, budget| side.changes(since, budget));
        }
        let _ = self.poller.modify(self.watchers.wake_fd(), WATCHERS, ONESHOT_IN);
    }

    /// Accepts every waiting connection within the caps, then re-arms the
    /// listener; out of descriptors (or memory), the listener rests for
    /// [`ACCEPT_BACKOFF`] instead of spinning on what it cannot take.
    fn accept(&self) {
        loop {
            let (stream, from) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    // EMFILE, ENFILE, ENOBUFS, ENOMEM: rest, then retry.
                    *self.accept_resume.lock() = Instant::now().checked_add(ACCEPT_BACKOFF);
                    self.arm_timer();
                    return;
                }
            };
            // The caps come before any buffer or machine is spent: a
            // connection beyond them is closed at once.
            if self.conns.lock().len() >= self.limits.max_connections {
                self.refused(&from.ip().to_string(), "max_connections");
                continue;
            }
            let peer = Some(from.ip());
            {
                let mut a = self.addresses.lock();
                let n = a.entry(from.ip()).or_insert(0);
                if *n >= self.limits.per_address {
                    drop(a);
                    self.refused(&from.ip().to_string(), "max_connections_per_address");
                    continue;
                }
                *n += 1;
            }
            tune(&stream, self.limits.window);
            let Ok(here) = stream.local_addr() else {
                self.forget_address(from.ip());
                continue;
            };
            self.admit(stream.into(), peer, ConnEnd::Tcp(here));
        }
        let _ = self.poller.modify(&self.listener, LISTENER, ONESHOT_IN);
    }

    /// [`Self::accept`] for the local socket: only processes of this user
    /// are served (the kernel says who connected); the others are closed
    /// at once.
    fn accept_local(&self) {
        let Some(local) = &self.local else { return };
        loop {
            let stream = match local.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    *self.accept_resume.lock() = Instant::now().checked_add(ACCEPT_BACKOFF);
                    self.arm_timer();
                    return;
                }
            };
            let mine = crate::transport::unix::peer_credentials(stream.as_raw_fd())
                .is_ok_and(|c| c.uid == crate::transport::unix::my_uid());
            if !mine {
                continue;
            }
            if self.conns.lock().len() >= self.limits.max_connections {
                self.refused("the local socket", "max_connections");
                continue;
            }
            self.admit(stream.into(), None, ConnEnd::Local);
        }
        let _ = self.poller.modify(local, LOCAL, ONESHOT_IN);
    }

    /// Makes room for one more connection that owes its handshake
    /// (`max_unauthenticated_connections`, with a secret): the oldest such
    /// connection is closed and counted. Connections that never
    /// authenticate so never take the slots authenticated peers hold, and
    /// a genuine handshake, done within a round trip, outlives a flood of
    /// them unless the cap's worth of connections arrives meanwhile.
    fn evict_an_unauthenticated(&self) {
        let oldest = {
            let pending = self.unauthenticated.lock();
            if pending.len() < self.limits.unauthenticated {
                return;
            }
            pending.front().copied()
        };
        let Some(id) = oldest else { return };
        let from = self.conns.lock().get(&id).map(|c| c.peer);
        self.close(id);
        if let Some(peer) = from {
            let from = peer.map_or_else(|| "the local socket".to_owned(), |ip| ip.to_string());
            self.refused(&from, "max_unauthenticated_connections (its oldest handshake was closed)");
        }
    }

    /// A connection from `from` was closed at accept: over the cap `why`.
    fn refused(&self, from: &str, why: &str) {
        if let Some(side) = self.side.upgrade() {
            side.connection_refused(from, why);
        }
    }

    /// Serves an accepted connection (within the caps, already counted).
    fn admit(&self, stream: Stream, peer: Option<std::net::IpAddr>, at: ConnEnd) {
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let m = ServerConn::new(self.budget.clone(), self.secret.clone(), at, Instant::now());
        let queued = m.owes_handshake();
        if queued {
            self.evict_an_unauthenticated();
            self.unauthenticated.lock().push_back(id);
        }
        let served = Served { m, queued };
        let counted = Charge::unlimited(&self.budget.counters, Counter::Connections, 1);
        let conn =
            Arc::new(ServedConn { stream: Arc::new(stream), peer, machine: Mutex::new(served), _counted: counted });
        self.conns.lock().insert(id, conn.clone());
        if conn.stream.set_nonblocking().is_err() || self.poller.add(&*conn.stream, id, ONESHOT_IN).is_err() {
            self.close(id);
            return;
        }
        self.arm_timer();
    }

    /// Arms the deadline sweep (periodic) if it is not armed.
    fn arm_timer(&self) {
        let mut armed = self.timer_armed.lock();
        if !*armed {
            *armed = true;
            self.set_timer(Some(self.limits.sweep_interval()));
        }
    }

    fn set_timer(&self, every: Option<Duration>) {
        self.timer.set_periodic(every);
    }

    /// The deadline sweep: closes connections whose exchange took longer
    /// than the frame bound allows (a stalled or trickling peer, or a
    /// connection that owes its handshake), or idle past the idle bound;
    /// wakes a resting listener. A connection being served right now is
    /// moving bytes: it is not checked.
    fn sweep(&self) {
        self.timer.drain();
        let now = Instant::now();
        let conns: Vec<(u64, Arc<ServedConn>)> = self.conns.lock().iter().map(|(i, c)| (*i, c.clone())).collect();
        let mut expired = Vec::new();
        let mut handshakes = Vec::new();
        let deadlines = self.limits.deadlines();
        for (id, conn) in &conns {
            let Some(g) = conn.machine.try_lock() else { continue };
            match g.m.expired(now, &deadlines) {
                None => continue,
                Some(Expired::Handshake) => handshakes.push(conn.peer),
                Some(Expired::Stalled | Expired::Idle) => {}
            }
            expired.push(*id);
        }
        drop(conns);
        for id in expired {
            self.close(id);
        }
        // Watchers that were behind get what they missed, if they read now.
        if let Some(side) = self.side.upgrade() {
            self.watchers.resync(side.registry_version(), &|since, budget| side.changes(since, budget));
        }
        if let Some(side) = self.side.upgrade() {
            for peer in handshakes {
                let from = peer.map_or_else(|| "the local socket".to_owned(), |ip| ip.to_string());
                side.auth_failed(&from, "did not finish its handshake within server_frame_timeout_ms");
            }
        }
        let resume = {
            let mut r = self.accept_resume.lock();
            let due = r.is_some_and(|at| now >= at);
            if due {
                *r = None;
            }
            due
        };
        if resume {
            let _ = self.poller.modify(&self.listener, LISTENER, ONESHOT_IN);
        }
        {
            // Nothing left to watch: the timer stops (idle means idle).
            let mut armed = self.timer_armed.lock();
            if self.conns.lock().is_empty() && self.accept_resume.lock().is_none() {
                *armed = false;
                self.set_timer(None);
            }
        }
        let _ = self.poller.modify(&self.timer, TIMER, ONESHOT_IN);
    }

    /// Serves connection `id` until its socket would block (then re-arms
    /// it for what it waits for), its turn is used up, or it closes.
    fn serve(&self, id: u64) {
        let Some(conn) = self.conns.lock().get(&id).cloned() else { return };
        let fd = conn.stream.as_raw_fd();
        let mut g = conn.machine.lock();
        let served = &mut *g;
        let m = &mut served.m;
        let mut moved = 0usize;
        // A read that filled less than it asked found the socket drained:
        // the next would most likely fail with EAGAIN. Once the reply is
        // out, re-arm instead (the interest is level-triggered, so bytes
        // that came meanwhile wake this connection at once): one system
        // call less per request.
        let mut drained = false;
        let wait = loop {
            if moved >= self.turn {
                // Others' turn. Wake again for what this one waits for: a
                // reply half sent needs the socket writable, not readable.
                break if m.send_buf().is_some() { Interest::OUT } else { Interest::IN };
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
                    io::ErrorKind::WouldBlock => break Interest::OUT,
                    _ => break Interest::empty(),
                }
            }
            if drained {
                break Interest::IN;
            }
            let Some(side) = self.side.upgrade() else { break Interest::empty() };
            let Some(into) = m.recv_buf() else { continue };
            let asked: usize = into[..into.len().min(1024)].iter().map(|v| v.iov_len).sum();
            // SAFETY: the machine's iovecs address its own buffers or
            // registered memory its loans keep alive, which no Rust
            // reference aliases while the kernel writes them.
            let r = unsafe { libc::readv(fd, into.as_ptr(), into.len().min(1024) as i32) };
            if r == 0 {
                break Interest::empty(); // the peer closed
            }
            if r < 0 {
                match io::Error::last_os_error().kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock => break Interest::IN,
                    _ => break Interest::empty(),
                }
            }
            moved += r as usize;
            drained = (r as usize) < asked;
            match m.received(r as usize, side.view()) {
                Ok(event) => {
                    if let Some(Subscribe { epoch, request, budget, since }) = perform(m, side.as_ref(), event) {
                        let socket = conn.stream.clone();
                        let now = side.registry_version();
                        let changes = |since, budget| side.changes(since, budget);
                        let sub = (epoch, request, budget, since);
                        match self.watchers.subscribe(id, conn.peer, sub, socket, now, &changes) {
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
                    let from = conn.peer.map_or_else(|| "the local socket".to_owned(), |ip| ip.to_string());
                    side.auth_failed(&from, m.refusal().unwrap_or("refused"));
                    break Interest::empty();
                }
                Err(Close::Malformed(_)) => break Interest::empty(), // malformed: close this connection only
            }
        };
        served.m.tick(Instant::now(), moved > 0);
        if served.queued && !served.m.owes_handshake() {
            served.queued = false;
            self.unauthenticated.lock().retain(|c| *c != id);
        }
        drop(g);
        if wait.is_empty() {
            self.close(id);
            return;
        }
        if self.poller.modify(&*conn.stream, id, wait | Interest::ONESHOT).is_err() {
            self.close(id);
        }
    }

    /// One connection from `ip` less.
    fn forget_address(&self, ip: std::net::IpAddr) {
        let mut a = self.addresses.lock();
        if let Some(n) = a.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                a.remove(&ip);
            }
        }
    }

    /// Closes connection `id`: its machine (and the loans of a request in
    /// progress), its subscription and its borrows end.
    fn close(&self, id: u64) {
        let Some(conn) = self.conns.lock().remove(&id) else { return };
        if let Some(ip) = conn.peer {
            self.forget_address(ip);
        }
        {
            let mut g = conn.machine.lock();
            if std::mem::take(&mut g.queued) {
                self.unauthenticated.lock().retain(|c| *c != id);
            }
        }
        let _ = self.poller.delete(&*conn.stream);
        conn.stream.shutdown();
        self.watchers.forget(id);
        // The borrower is gone with its connection: its machine, and with
        // it its borrows, go with the last reference.
        drop(conn);
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
        let server = Server::start_with(
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
    }
}
