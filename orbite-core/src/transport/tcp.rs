//! The TCP route: a target server that lands peers' requests in registered
//! memory, and per-peer links of a few connections on the initiator side.
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

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::segment::{ExportedRegistration, SegmentDescriptor};
use crate::transport::proto::client::{ClientConn, Done, unsent};
pub(crate) use crate::transport::proto::client::{ControlDone, ControlJob, PeerFailure, PeerJob};
use crate::transport::proto::server::{BorrowTable, Event, ServerConn, TargetSide};
use crate::transport::route::{PeerReach, Reach, RouteImpl, Runs, Serves};
use crate::transport::sock::{Patience, iov, read_exact_within, readv_within, writev_within};
use crate::transport::spin::{claim, poll};
use crate::transport::{CopyJob, CopyKind};
use crate::types::{Desc, Route};
use crate::wire::{self, Kind, Limits};

/// The tcp route.
pub(crate) struct Tcp;

impl RouteImpl for Tcp {
    fn route(&self) -> Route {
        Route::Tcp
    }

    fn serves(&self) -> Serves {
        Serves::Peer
    }

    fn reaches(&self, target: &Reach<'_>, _remote: &[Desc]) -> Result<(), String> {
        match target {
            Reach::Peer(_) => Ok(()),
            _ => Err("not a peer".into()),
        }
    }

    fn address(&self, _target: &PeerReach<'_>, r: &ExportedRegistration) -> Result<(u64, u64), String> {
        // Offsets in the peer's registration, named on the wire.
        Ok((0, r.id.to_raw()))
    }

    fn copy_kind(&self, _target: &Reach<'_>) -> CopyKind {
        CopyKind::Frames
    }

    fn runs(&self) -> Runs {
        Runs::PeerLink
    }
}

/// Initiators subscribed to this engine's registration changes, each on a
/// watch connection of its own: every change is pushed to each of them as
/// it happens, as what changed since the last push that went out.
pub(crate) struct Watchers {
    subs: Mutex<Vec<Arc<Subscriber>>>,
}

/// One subscribed watch connection.
struct Subscriber {
    conn: u64,
    epoch: u64,
    request: u64,
    /// Largest delta to push (what the watcher accepts, at most
    /// `PUSH_BUDGET`).
    budget: usize,
    /// A duplicate of the connection's socket: writing to it stays safe
    /// even after the serving thread closed its own.
    stream: TcpStream,
    /// The registry version pushed so far. Its lock also keeps two pushes
    /// to this socket from interleaving; a push never blocks (a full
    /// socket skips it, and the next change sends everything since).
    pushed: Mutex<u64>,
}

/// The changes after a registry version, in at most a budget of encoded
/// bytes (what the target side computes for a subscriber).
pub(crate) type ChangesSince<'a> = &'a dyn Fn(u64, usize) -> crate::segment::Delta;

impl Subscriber {
    /// Pushes what changed since the last push, if the registry moved past
    /// it (`now`); the first push (`first`) goes out even if nothing did:
    /// it confirms the subscription.
    fn push(&self, now: u64, changes: ChangesSince<'_>, first: bool) {
        let mut pushed = self.pushed.lock();
        if *pushed >= now && !first {
            return;
        }
        let delta = changes(*pushed, self.budget);
        if delta.version <= *pushed && !first {
            return;
        }
        let mut body = Vec::new();
        wire::encode_changed(&mut body, self.epoch, *pushed, &delta.to_bytes());
        let mut frame = wire::encode_header(&wire::header(Kind::Changed, body.len(), 0, self.request)).to_vec();
        frame.extend_from_slice(&body);
        // SAFETY: a live buffer of `frame.len()` bytes.
        let n = unsafe {
            libc::send(
                self.stream.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n == frame.len() as isize {
            *pushed = delta.version;
        } else if n > 0 {
            // Half a frame would desynchronise the stream: the watcher
            // loses its connection (and falls back to asking).
            let _ = self.stream.shutdown(Shutdown::Both);
        }
        // n < 0: the socket is full (the watcher is not reading); the next
        // change pushes everything since `pushed`.
    }
}

impl Watchers {
    fn new() -> Self {
        Watchers { subs: Mutex::new(Vec::new()) }
    }

    /// Subscribes a watch connection and brings it up to date.
    fn subscribe(&self, sub: Subscriber, now: u64, changes: ChangesSince<'_>) {
        let sub = Arc::new(sub);
        {
            let mut subs = self.subs.lock();
            subs.retain(|x| x.conn != sub.conn);
            subs.push(sub.clone());
        }
        sub.push(now, changes, true);
    }

    /// The registry reached `version`: pushes what changed to every
    /// subscriber, with no lock of this table held while sending.
    pub fn changed(&self, version: u64, changes: ChangesSince<'_>) {
        let subs: Vec<Arc<Subscriber>> = self.subs.lock().clone();
        for sub in subs {
            sub.push(version, changes, false);
        }
    }

    fn forget(&self, conn: u64) {
        let gone: Vec<Arc<Subscriber>> = {
            let mut subs = self.subs.lock();
            let (gone, keep) = std::mem::take(&mut *subs).into_iter().partition(|x| x.conn == conn);
            *subs = keep;
            gone
        };
        drop(gone);
    }
}

/// The listening side: every accepted connection's [`ServerConn`], driven
/// by a fixed set of threads over one epoll set, so the thread count does
/// not grow with connections.
pub(crate) struct Server {
    addr: SocketAddr,
    shared: Arc<ServerShared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    watchers: Arc<Watchers>,
}

struct ServerShared {
    /// Bytes one connection may move per turn.
    turn: usize,
    epoll: OwnedFd,
    /// Written once at shutdown; level-triggered, so every thread sees it.
    stop: OwnedFd,
    listener: TcpListener,
    side: Weak<dyn TargetSide>,
    conns: Mutex<std::collections::HashMap<u64, Arc<ServedConn>>>,
    next_conn: AtomicU64,
    borrows: BorrowTable,
    watchers: Arc<Watchers>,
}

/// One accepted connection: its socket and its machine. Armed one-shot in
/// the epoll set, so one thread at a time serves it.
struct ServedConn {
    stream: TcpStream,
    machine: Mutex<ServerConn>,
}

/// epoll data of the listener and of the stop event (connections count from 1).
const LISTENER: u64 = u64::MAX;
const STOP: u64 = u64::MAX - 1;

/// Bytes one connection may move per turn before others get theirs.
const TURN_BYTES: usize = 8 << 20;

fn epoll_ctl(epoll: &OwnedFd, op: libc::c_int, fd: i32, events: u32, data: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: data };
    // SAFETY: a live epoll fd and a pointer to a live event for the call.
    if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), op, fd, &mut ev) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn owned(fd: libc::c_int) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor this function now owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Threads that serve connections: one per core, at most 4.
fn server_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4)
}

impl Server {
    /// Binds and starts serving. The server holds the target side weakly.
    pub fn start(bind: &str, side: Weak<dyn TargetSide>) -> io::Result<Server> {
        Self::start_with(bind, side, TURN_BYTES)
    }

    /// [`Server::start`] with connections taking turns of `turn` bytes.
    fn start_with(bind: &str, side: Weak<dyn TargetSide>, turn: usize) -> io::Result<Server> {
        let listener = TcpListener::bind(bind)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        // SAFETY: plain system calls creating descriptors.
        let epoll = owned(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: as above.
        let stop = owned(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        epoll_ctl(&epoll, libc::EPOLL_CTL_ADD, stop.as_raw_fd(), libc::EPOLLIN as u32, STOP)?;
        let oneshot = (libc::EPOLLIN | libc::EPOLLONESHOT) as u32;
        epoll_ctl(&epoll, libc::EPOLL_CTL_ADD, listener.as_raw_fd(), oneshot, LISTENER)?;
        let watchers = Arc::new(Watchers::new());
        let shared = Arc::new(ServerShared {
            turn: turn.max(1),
            epoll,
            stop,
            listener,
            side,
            conns: Mutex::new(std::collections::HashMap::new()),
            next_conn: AtomicU64::new(1),
            borrows: Mutex::new(std::collections::HashMap::new()),
            watchers: watchers.clone(),
        });
        let server = Server { addr, shared: shared.clone(), threads: Mutex::new(Vec::new()), watchers };
        for i in 0..server_threads() {
            let shared = shared.clone();
            let spawned = std::thread::Builder::new().name(format!("orbite-serve-{i}")).spawn(move || shared.run());
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

    /// Stops serving, closes every connection and joins the threads.
    pub fn shutdown(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes of a live local to our own eventfd.
        unsafe { libc::write(self.shared.stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
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
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        loop {
            // SAFETY: a live epoll fd and a buffer of `events.len()` entries.
            let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), events.len() as i32, -1) };
            if n < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return;
            }
            for ev in &events[..n as usize] {
                match ev.u64 {
                    STOP => return,
                    LISTENER => self.accept(),
                    id => self.serve(id),
                }
            }
        }
    }

    /// Accepts every waiting connection, then re-arms the listener.
    fn accept(&self) {
        loop {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break, // none waiting (or out of descriptors: try again on the next wake-up)
            };
            tune(&stream);
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
            let fd = stream.as_raw_fd();
            let conn = Arc::new(ServedConn { stream, machine: Mutex::new(ServerConn::new(id)) });
            self.conns.lock().insert(id, conn);
            let oneshot = (libc::EPOLLIN | libc::EPOLLONESHOT) as u32;
            if epoll_ctl(&self.epoll, libc::EPOLL_CTL_ADD, fd, oneshot, id).is_err() {
                self.conns.lock().remove(&id);
            }
        }
        let oneshot = (libc::EPOLLIN | libc::EPOLLONESHOT) as u32;
        let _ = epoll_ctl(&self.epoll, libc::EPOLL_CTL_MOD, self.listener.as_raw_fd(), oneshot, LISTENER);
    }

    /// Serves connection `id` until its socket would block (then re-arms
    /// it for what it waits for), its turn is used up, or it closes.
    fn serve(&self, id: u64) {
        let Some(conn) = self.conns.lock().get(&id).cloned() else { return };
        let fd = conn.stream.as_raw_fd();
        let mut m = conn.machine.lock();
        let mut moved = 0usize;
        let wait = loop {
            if moved >= self.turn {
                // Others' turn. Wake again for what this one waits for: a
                // reply half sent needs the socket writable, not readable.
                break if m.send_buf().is_some() { libc::EPOLLOUT } else { libc::EPOLLIN };
            }
            if let Some(out) = m.send_buf() {
                // SAFETY: the machine's iovecs address its own buffers or
                // registered memory its loans keep alive.
                let r = unsafe { libc::writev(fd, out.as_ptr(), out.len().min(1024) as i32) };
                if r >= 0 {
                    m.sent(r as usize);
                    moved += r as usize;
                    continue;
                }
                match io::Error::last_os_error().kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock => break libc::EPOLLOUT,
                    _ => break 0,
                }
            }
            let Some(side) = self.side.upgrade() else { break 0 };
            let Some(into) = m.recv_buf() else { continue };
            // SAFETY: the machine's iovecs address its own buffers or
            // registered memory its loans keep alive, which no Rust
            // reference aliases while the kernel writes them.
            let r = unsafe { libc::readv(fd, into.as_ptr(), into.len().min(1024) as i32) };
            if r == 0 {
                break 0; // the peer closed
            }
            if r < 0 {
                match io::Error::last_os_error().kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock => break libc::EPOLLIN,
                    _ => break 0,
                }
            }
            moved += r as usize;
            match m.received(r as usize, side.as_ref(), &self.borrows) {
                Ok(None) => {}
                Ok(Some(Event::Subscribe { epoch, request, budget, since })) => {
                    let Ok(stream) = conn.stream.try_clone() else { break 0 };
                    let sub = Subscriber { conn: id, epoch, request, budget, stream, pushed: Mutex::new(since) };
                    self.watchers.subscribe(sub, side.registry_version(), &|since, budget| side.changes(since, budget));
                }
                Err(_) => break 0, // malformed: close this connection only
            }
        };
        drop(m);
        if wait == 0 {
            self.close(id);
            return;
        }
        let events = (wait | libc::EPOLLONESHOT) as u32;
        if epoll_ctl(&self.epoll, libc::EPOLL_CTL_MOD, fd, events, id).is_err() {
            self.close(id);
        }
    }

    /// Closes connection `id`: its machine (and the loans of a request in
    /// progress), its subscription and its borrows end.
    fn close(&self, id: u64) {
        let Some(conn) = self.conns.lock().remove(&id) else { return };
        let _ = epoll_ctl(&self.epoll, libc::EPOLL_CTL_DEL, conn.stream.as_raw_fd(), 0, id);
        let _ = conn.stream.shutdown(Shutdown::Both);
        self.watchers.forget(id);
        // The borrower is gone with its connection: give back its loans
        // (dropped outside the lock).
        let mut ended = Vec::new();
        self.borrows.lock().retain(|_, (c, loans)| {
            if *c == id {
                ended.push(std::mem::take(loans));
            }
            *c != id
        });
        drop(ended);
        drop(conn);
    }
}

/// Socket buffer size asked of the kernel on every connection: room for a
/// few route tasks in flight each way.
const SOCKET_BUFFER: libc::c_int = 4 << 20;

fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: setsockopt with a pointer to a live c_int of the right size.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&SOCKET_BUFFER as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

struct LinkQueue<J> {
    jobs: VecDeque<PeerJob<J>>,
    lost: Option<String>,
    closing: bool,
}

/// Options of a link.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LinkOptions {
    pub connections: u32,
    /// Longest silence of a peer while a request is outstanding.
    pub io_timeout: Duration,
    /// Slowest accepted peer, bytes per second (0: no rate bound).
    pub min_rate: u64,
    pub spin: Duration,
    pub limits: Limits,
    pub max_descriptor: usize,
}

impl LinkOptions {
    /// How often a blocked system call wakes up to check its bounds (only
    /// while a reply is awaited: an idle link never wakes).
    fn tick(&self) -> Duration {
        (self.io_timeout / 100).clamp(Duration::from_millis(1), Duration::from_millis(25))
    }

    /// Silence after which the peer is lost: two ticks short of the
    /// timeout, so that the loss is found, and work fails, within
    /// `peer_timeout_ms` of the peer's last sign of life.
    fn stall(&self) -> Duration {
        self.io_timeout.saturating_sub(2 * self.tick()).max(self.tick())
    }

    /// The bounds of an I/O that moves `bytes`, starting now.
    fn patience(&self, bytes: u64) -> Patience {
        let until = match self.min_rate {
            0 => None,
            rate => Instant::now().checked_add(self.stall() + Duration::from_secs_f64(bytes as f64 / rate as f64)),
        };
        Patience { stall: self.stall(), until }
    }
}

/// Errors of opening a link.
#[derive(Debug)]
pub(crate) enum OpenError {
    Connect(String),
    Protocol(String),
    EpochMismatch { expected: u64, found: u64 },
}

/// The initiator's link to one peer epoch: a few connections, each with a
/// worker that sends tasks and waits for their replies.
pub(crate) struct PeerLink<J> {
    pub descriptor: SegmentDescriptor,
    queue: Mutex<LinkQueue<J>>,
    ready: Condvar,
    pending: AtomicUsize,
    streams: Mutex<Vec<TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    opts: LinkOptions,
    next_request: AtomicU64,
    spinner: AtomicBool,
    lost_flag: AtomicBool,
    /// The newest registry version the peer announced on the watch
    /// connection; `u64::MAX` once that connection is gone (nothing is
    /// announced any more, so every lookup must ask).
    announced: AtomicU64,
    /// The watch connection (shut down to stop its worker).
    watch: Mutex<Option<TcpStream>>,
    /// Where pushed changes go (set by the engine once its view exists):
    /// applies them from a base version; false if they do not apply.
    sink: std::sync::OnceLock<ChangeSink>,
    /// The subscription's first answer, until the engine applies it.
    first: Mutex<Option<(u64, crate::segment::Delta)>>,
}

/// Applies changes a peer pushed (`base`: the version they start after).
pub(crate) type ChangeSink = Box<dyn Fn(u64, crate::segment::Delta) -> bool + Send + Sync>;

/// `PeerLink::announced` once the watch connection is gone.
pub(crate) const ANNOUNCE_UNKNOWN: u64 = u64::MAX;

impl<J: CopyJob> PeerLink<J> {
    /// Connects, runs the authoritative Describe exchange, checks the epoch
    /// and starts the connection workers.
    pub fn open(
        endpoint: &str,
        expected_epoch: Option<u64>,
        timeout: Duration,
        my_epoch: u64,
        opts: LinkOptions,
    ) -> Result<Arc<Self>, OpenError> {
        let deadline = crate::time::deadline_after(timeout);
        let addr = endpoint
            .to_socket_addrs()
            .map_err(|e| OpenError::Connect(format!("{endpoint}: {e}")))?
            .next()
            .ok_or_else(|| OpenError::Connect(format!("{endpoint}: no address")))?;
        let tick = opts.tick();
        let connect = || -> Result<TcpStream, OpenError> {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            let s =
                TcpStream::connect_timeout(&addr, left).map_err(|e| OpenError::Connect(format!("{endpoint}: {e}")))?;
            tune(&s);
            // System calls wake up every tick to check their bounds: a
            // silent or trickling peer is found however it stalls.
            s.set_read_timeout(Some(tick)).map_err(|e| OpenError::Connect(e.to_string()))?;
            s.set_write_timeout(Some(tick)).map_err(|e| OpenError::Connect(e.to_string()))?;
            Ok(s)
        };
        // The whole exchange is bounded by the caller's timeout, however
        // slowly the peer answers.
        let open_patience = Patience { stall: opts.stall().min(timeout), until: Some(deadline) };
        let first = connect()?;
        let fd = first.as_raw_fd();
        let mut body = Vec::new();
        wire::encode_describe(&mut body, my_epoch, expected_epoch.unwrap_or(0));
        let hb = wire::encode_header(&wire::header(Kind::Describe, body.len(), 0, 1));
        let mut v = [iov(hb.as_ptr() as u64, hb.len() as u64), iov(body.as_ptr() as u64, body.len() as u64)];
        // SAFETY: both entries borrow live local buffers for the call.
        unsafe { writev_within(fd, &mut v, Some(&open_patience)) }.map_err(|e| OpenError::Connect(e.to_string()))?;
        let mut hb = [0u8; wire::HEADER_LEN];
        read_exact_within(fd, &mut hb, Some(&open_patience)).map_err(|e| OpenError::Connect(e.to_string()))?;
        let h = wire::decode_header(&hb, opts.limits).map_err(|e| OpenError::Protocol(e.to_string()))?;
        if h.kind != Kind::DescribeReply || h.data_len != 0 || h.request != 1 {
            return Err(OpenError::Protocol(format!("unexpected {:?} reply to describe", h.kind)));
        }
        body.resize(h.body_len as usize, 0);
        read_exact_within(fd, &mut body, Some(&open_patience)).map_err(|e| OpenError::Connect(e.to_string()))?;
        let descriptor =
            SegmentDescriptor::decode(&body, opts.max_descriptor).map_err(|e| OpenError::Protocol(e.to_string()))?;
        if let Some(expected) = expected_epoch {
            if expected != descriptor.epoch {
                return Err(OpenError::EpochMismatch { expected, found: descriptor.epoch });
            }
        }
        let mut streams = vec![first];
        for _ in 1..opts.connections.max(1) {
            streams.push(connect()?);
        }
        // The watch connection: subscribed now, so that every change the
        // peer makes after this open returns is pushed. Its first answer
        // has what changed since the Describe.
        let watch = connect()?;
        wire::encode_watch(&mut body, descriptor.epoch, descriptor.registry_version, opts.limits.max_body as u64);
        let hb = wire::encode_header(&wire::header(Kind::Watch, body.len(), 0, 1));
        let mut v = [iov(hb.as_ptr() as u64, hb.len() as u64), iov(body.as_ptr() as u64, body.len() as u64)];
        let wfd = watch.as_raw_fd();
        // SAFETY: both entries borrow live local buffers for the call.
        unsafe { writev_within(wfd, &mut v, Some(&open_patience)) }.map_err(|e| OpenError::Connect(e.to_string()))?;
        let first = read_changed(wfd, &opts.limits, descriptor.epoch, Some(&open_patience))
            .map_err(OpenError::Protocol)?
            .filter(|(base, d)| *base == descriptor.registry_version && d.version >= *base)
            .ok_or_else(|| OpenError::Protocol("no answer to the watch".into()))?;
        // From now on it waits for pushes without a bound: idle means idle.
        // Losing the peer shuts it down.
        watch.set_read_timeout(None).map_err(|e| OpenError::Connect(e.to_string()))?;
        let since = first.1.version;
        let link = Arc::new(PeerLink {
            descriptor,
            queue: Mutex::new(LinkQueue { jobs: VecDeque::new(), lost: None, closing: false }),
            ready: Condvar::new(),
            pending: AtomicUsize::new(0),
            streams: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
            opts,
            next_request: AtomicU64::new(2),
            spinner: AtomicBool::new(false),
            lost_flag: AtomicBool::new(false),
            announced: AtomicU64::new(since),
            watch: Mutex::new(Some(watch)),
            sink: std::sync::OnceLock::new(),
            first: Mutex::new(Some(first)),
        });
        for (i, s) in streams.into_iter().enumerate() {
            let clone = s.try_clone().map_err(|e| OpenError::Connect(e.to_string()))?;
            link.streams.lock().push(clone);
            let l = link.clone();
            let h = std::thread::Builder::new()
                .name(format!("orbite-tcp-{i}"))
                .spawn(move || connection_worker(&l, s))
                .map_err(|e| OpenError::Connect(e.to_string()))?;
            link.threads.lock().push(h);
        }
        Ok(link)
    }

    /// The changes the peer pushed when the link subscribed (what changed
    /// between its Describe and the subscription): `(base, delta)`, once.
    pub fn take_first_changes(&self) -> Option<(u64, crate::segment::Delta)> {
        self.first.lock().take()
    }

    /// Starts the watch worker: the peer's pushed changes go to `sink`
    /// from now on. Called once, after the first changes were applied.
    pub fn start_watch(self: &Arc<Self>, since: u64, sink: ChangeSink) -> io::Result<()> {
        let _ = self.sink.set(sink);
        let Some(watch) = self.watch.lock().as_ref().map(TcpStream::try_clone).transpose()? else {
            return Ok(()); // closed meanwhile
        };
        let l = self.clone();
        let h =
            std::thread::Builder::new().name("orbite-watch".into()).spawn(move || watch_worker(&l, watch, since))?;
        self.threads.lock().push(h);
        Ok(())
    }

    /// The newest registry version the peer announced
    /// ([`ANNOUNCE_UNKNOWN`] when it can no longer announce).
    pub fn announced(&self) -> u64 {
        self.announced.load(Ordering::Acquire)
    }

    /// Queues a control-plane job ahead of queued data tasks (a refresh, a
    /// borrow): it waits for at most one task per connection.
    pub fn submit_first(&self, job: PeerJob<J>) {
        {
            let mut q = self.queue.lock();
            q.jobs.push_front(job);
            self.pending.fetch_add(1, Ordering::AcqRel);
        }
        self.ready.notify_one();
    }

    /// Queues a job. Never runs it inline (callers may hold engine locks).
    pub fn submit(&self, job: PeerJob<J>) {
        // Count under the queue lock: a worker pops (and decrements) only
        // under it, so the count never runs below zero.
        let pending = {
            let mut q = self.queue.lock();
            q.jobs.push_back(job);
            self.pending.fetch_add(1, Ordering::AcqRel) + 1
        };
        // A polling worker sees a lone job and re-checks the queue before it
        // sleeps: no need to wake a sleeping one too.
        if pending > 1 || !self.spinner.load(Ordering::Acquire) {
            self.ready.notify_one();
        }
    }

    /// Why the peer is lost, if it is.
    pub fn lost(&self) -> Option<String> {
        self.queue.lock().lost.clone()
    }

    /// True once the peer is lost (one atomic load).
    pub fn is_lost(&self) -> bool {
        self.lost_flag.load(Ordering::Acquire)
    }

    fn mark_lost(&self, why: String) {
        let mut q = self.queue.lock();
        if q.lost.is_none() {
            q.lost = Some(why);
        }
        self.lost_flag.store(true, Ordering::Release);
        drop(q);
        self.ready.notify_all();
        // Wake workers blocked in I/O on the other connections.
        for s in self.streams.lock().iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(w) = self.watch.lock().as_ref() {
            let _ = w.shutdown(Shutdown::Both);
        }
    }

    /// Closes the connections once the queue is empty and joins workers.
    pub fn close(&self) {
        self.queue.lock().closing = true;
        self.ready.notify_all();
        // The watch worker blocks in a read without a bound: end it first.
        if let Some(w) = self.watch.lock().take() {
            let _ = w.shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *self.threads.lock());
        let me = std::thread::current().id();
        for t in threads {
            // The last owner of a link may be one of its own workers (it
            // finished the last task): that one exits on its own.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        for s in self.streams.lock().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// The next job if one is queued, without waiting.
    fn try_next_job(&self) -> Option<(PeerJob<J>, Option<String>)> {
        let mut q = self.queue.lock();
        let job = q.jobs.pop_front()?;
        self.pending.fetch_sub(1, Ordering::AcqRel);
        Some((job, q.lost.clone()))
    }

    fn next_job(&self) -> Option<(PeerJob<J>, Option<String>)> {
        let mut polled = false;
        let mut q = self.queue.lock();
        loop {
            if let Some(job) = q.jobs.pop_front() {
                self.pending.fetch_sub(1, Ordering::AcqRel);
                if !q.jobs.is_empty() {
                    self.ready.notify_one(); // more work for another connection
                }
                return Some((job, q.lost.clone()));
            }
            if q.closing {
                return None;
            }
            // One idle worker per link polls; the others sleep at once, so
            // idle connections never compete with the threads doing work.
            if !polled && !self.opts.spin.is_zero() && claim(&self.spinner) {
                polled = true;
                parking_lot::MutexGuard::unlocked(&mut q, || poll(&self.pending, self.opts.spin));
                self.spinner.store(false, Ordering::Release);
                continue;
            }
            self.ready.wait(&mut q);
        }
    }
}

fn connection_worker<J: CopyJob>(link: &PeerLink<J>, stream: TcpStream) {
    let fd = stream.as_raw_fd();
    let mut m = ClientConn::new(link.descriptor.epoch, link.opts.limits);
    // The blocking helpers advance the iovecs they are given: they get a
    // copy, and the machine advances its own by what moved.
    let mut v: Vec<libc::iovec> = Vec::new();
    loop {
        // Fill the pipeline; block for work only when nothing is outstanding.
        while m.can_start() {
            let next = if m.in_flight() == 0 { link.next_job() } else { link.try_next_job() };
            let Some((job, lost)) = next else { break };
            if let Some(why) = lost {
                unsent(job, why).deliver();
                continue;
            }
            m.start(job, link.next_request.fetch_add(1, Ordering::Relaxed));
            let total = m.send_len();
            let patience = link.opts.patience(total);
            let Some(out) = m.send_buf() else { continue };
            v.clear();
            v.extend_from_slice(out);
            // SAFETY: the machine's iovecs address its own buffers or the
            // job's spans, kept valid by its range loans (CopyJob contract).
            match unsafe { writev_within(fd, &mut v, Some(&patience)) } {
                Ok(()) => m.sent(total as usize),
                Err(e) => lose(link, &mut m, format!("connection lost: {e}"), None),
            }
        }
        if m.in_flight() == 0 {
            break;
        }
        // The reply starts now (an earlier reply on this connection is
        // done): it must come within the peer timeout and at the minimum
        // rate.
        let patience = link.opts.patience(m.reply_bytes());
        let mut done = None;
        let failed = loop {
            let Some(into) = m.recv_buf() else { break None };
            v.clear();
            v.extend_from_slice(into);
            let mut got = 0;
            // SAFETY: the machine's iovecs address its own buffers or the
            // READ's local spans, valid and retained (CopyJob contract), which
            // nothing else writes during the task.
            let r = unsafe { readv_within(fd, &mut v, &mut got, Some(&patience)) };
            if got > 0 {
                if let Err(why) = m.received(got as usize, &mut done) {
                    break Some(why);
                }
            }
            if let Err(e) = r {
                break Some(format!("connection lost: {e}"));
            }
            if done.is_some() {
                break None;
            }
        };
        match failed {
            Some(why) => lose(link, &mut m, why, done),
            None => {
                if let Some(d) = done {
                    d.deliver();
                }
            }
        }
    }
    drop(stream);
}

/// The connection failed: the peer is lost, and every job outstanding on
/// it ends (`first`: the one whose reply broke the protocol).
fn lose<J: CopyJob>(link: &PeerLink<J>, m: &mut ClientConn<J>, why: String, first: Option<Done<J>>) {
    link.mark_lost(why.clone());
    if let Some(d) = first {
        d.deliver();
    }
    for d in m.fail_all(&why) {
        d.deliver();
    }
}

/// The watch connection (subscribed at open): the peer pushes
/// what changed in its registrations as it happens (as much as fits a
/// frame). The changes go to the link's sink (the engine's view of the
/// peer) before the version is recorded, so a lookup that finds the view
/// behind what was announced asks the peer for the rest. It never decides
/// that the peer is lost (the data connections do), and blocks without a
/// bound while nothing changes.
fn watch_worker<J: CopyJob>(link: &PeerLink<J>, stream: TcpStream, mut since: u64) {
    let epoch = link.descriptor.epoch;
    // Buffered: a burst of pushes is read with a few system calls.
    let mut reader = std::io::BufReader::with_capacity(64 << 10, &stream);
    while let Ok(Some((base, delta))) = read_changed(&mut reader, &link.opts.limits, epoch, None) {
        if delta.version <= base {
            break; // a push that moves nothing is not one this subscription sends
        }
        let (version, more) = (delta.version, delta.more);
        // Pushes continue each other; one that does not (or does not
        // apply) leaves the view behind, and lookups ask for the rest.
        let applied = base == since && link.sink.get().is_some_and(|sink| sink(base, delta));
        let announce = if applied && !more { version } else { version.saturating_add(1) };
        link.announced.fetch_max(announce, Ordering::AcqRel);
        since = version;
    }
    // Nothing more will be announced: lookups must ask the peer.
    link.announced.store(ANNOUNCE_UNKNOWN, Ordering::Release);
}

/// Where a watch connection's frames are read from: the socket (within a
/// bound, at open) or a buffer over it (the worker).
trait FrameSource {
    fn read_all(&mut self, buf: &mut [u8], patience: Option<&Patience>) -> io::Result<()>;
}

impl FrameSource for i32 {
    fn read_all(&mut self, buf: &mut [u8], patience: Option<&Patience>) -> io::Result<()> {
        read_exact_within(*self, buf, patience)
    }
}

impl FrameSource for &mut std::io::BufReader<&TcpStream> {
    fn read_all(&mut self, buf: &mut [u8], _: Option<&Patience>) -> io::Result<()> {
        std::io::Read::read_exact(*self, buf)
    }
}

/// Reads one Changed frame of the subscription (request 1) for `epoch`:
/// `Ok(None)` when the connection ended, `Err` for anything else.
fn read_changed(
    mut from: impl FrameSource,
    limits: &Limits,
    epoch: u64,
    patience: Option<&Patience>,
) -> Result<Option<(u64, crate::segment::Delta)>, String> {
    let mut hb = [0u8; wire::HEADER_LEN];
    if from.read_all(&mut hb, patience).is_err() {
        return Ok(None);
    }
    let h = wire::decode_header(&hb, *limits).map_err(|e| e.to_string())?;
    if h.request != 1 || h.kind != Kind::Changed || h.data_len != 0 {
        return Err(format!("unexpected {:?} on the watch connection", h.kind));
    }
    let mut body = vec![0u8; h.body_len as usize];
    from.read_all(&mut body, patience).map_err(|e| e.to_string())?;
    let (e, base, delta) = wire::decode_changed(&body).map_err(|e| e.to_string())?;
    let delta = crate::segment::Delta::decode(delta).map_err(|e| e.to_string())?;
    if e != epoch {
        return Err("changes of another epoch".into());
    }
    Ok(Some((base, delta)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Registration;
    use crate::wire::{NotifyEnvelope, RemoteDesc, RemoteStatus, Request};
    use std::io::{Read, Write};

    const EPOCH: u64 = 0x5e;
    const LEN: usize = 1 << 20;

    /// One read-write registration (id 1) of 1 MiB.
    struct Side {
        base: usize,
    }

    impl TargetSide for Side {
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
        fn deliver(&self, _env: &NotifyEnvelope<'_>) -> Result<(), (RemoteStatus, String)> {
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
        let server = Server::start_with("127.0.0.1:0", Arc::downgrade(&side), 1).unwrap();
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
