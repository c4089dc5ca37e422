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
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::registry::Registration;
use crate::segment::{ExportedRegistration, SegmentDescriptor};
use crate::transport::route::{PeerReach, Reach, RouteImpl, Runs, Serves};
use crate::transport::sock::{
    Patience, discard, iov, read_exact, read_exact_within, readv_all, readv_within, writev_all, writev_within,
};
use crate::transport::spin::{claim, poll};
use crate::transport::{CopyJob, CopyKind};
use crate::types::{Desc, Op, Route, TaskEnd, TaskReport};
use crate::wire::{self, Header, Kind, Limits, NotifyEnvelope, RemoteDesc, RemoteStatus, Request, WireError};

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

/// Borrows held for initiators of one-sided routes: id to (connection,
/// range loans). A connection's borrows end with it.
type BorrowTable = Mutex<std::collections::HashMap<u64, (u64, Vec<Arc<Registration>>)>>;

/// Most borrows one server holds at once.
const MAX_BORROWS: usize = 65_536;

/// What the target side of the engine provides to the server.
pub(crate) trait TargetSide: Send + Sync + 'static {
    /// This engine's epoch.
    fn epoch(&self) -> u64;
    /// The encoded segment descriptor.
    fn descriptor(&self) -> Vec<u8>;
    /// Resolves every descriptor of a request (live id and generation,
    /// bounds, permission) into I/O vectors and range loans, or refuses.
    fn resolve(
        &self,
        req: &Request<'_>,
        write: bool,
        iovs: &mut Vec<libc::iovec>,
        loans: &mut Vec<Arc<Registration>>,
    ) -> Result<(), (RemoteStatus, String)>;
    /// Queues a notification, or refuses it.
    fn deliver(&self, env: &NotifyEnvelope<'_>) -> Result<(), (RemoteStatus, String)>;
    /// What changed in the exported registrations after registry version
    /// `since`, in at most `budget` encoded bytes.
    fn changes(&self, since: u64, budget: usize) -> crate::segment::Delta;
    /// The registry's current version.
    fn registry_version(&self) -> u64;
    /// Frame limits.
    fn limits(&self) -> Limits;
    /// Test hook: blocks while remote requests are held (after their loans
    /// were taken, before any byte moves).
    fn remote_gate(&self) {}
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
    /// [`PUSH_BUDGET`]).
    budget: usize,
    /// A duplicate of the connection's socket: writing to it stays safe
    /// even after the serving thread closed its own.
    stream: TcpStream,
    /// The registry version pushed so far. Its lock also keeps two pushes
    /// to this socket from interleaving; a push never blocks (a full
    /// socket skips it, and the next change sends everything since).
    pushed: Mutex<u64>,
}

/// Most bytes of changes pushed at once; a watcher further behind gets the
/// first part and asks for the rest.
pub(crate) const PUSH_BUDGET: usize = 64 << 10;

/// Bytes of a Changed frame besides its delta.
const CHANGED_OVERHEAD: usize = 16;

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

/// The listening side.
pub(crate) struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<(u64, TcpStream)>>>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: Mutex<Option<JoinHandle<()>>>,
    watchers: Arc<Watchers>,
}

impl Server {
    /// Binds and starts accepting. The server holds the target side weakly.
    pub fn start(bind: &str, side: Weak<dyn TargetSide>) -> io::Result<Server> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<(u64, TcpStream)>>> = Arc::new(Mutex::new(Vec::new()));
        let borrows: Arc<BorrowTable> = Arc::new(Mutex::new(std::collections::HashMap::new()));
        let threads: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::new(Mutex::new(Vec::new()));
        let watchers = Arc::new(Watchers::new());
        let accept = {
            let (stop, conns, threads, watchers) = (stop.clone(), conns.clone(), threads.clone(), watchers.clone());
            std::thread::Builder::new().name("orbite-accept".into()).spawn(move || {
                let mut next = 0u64;
                for stream in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    let Ok(stream) = stream else { continue };
                    tune(&stream);
                    let Ok(clone) = stream.try_clone() else { continue };
                    next += 1;
                    let id = next;
                    conns.lock().push((id, clone));
                    let (side, conns2, borrows) = (side.clone(), conns.clone(), borrows.clone());
                    let watchers = watchers.clone();
                    let spawned = std::thread::Builder::new().name("orbite-serve".into()).spawn(move || {
                        serve_connection(stream, &side, id, &borrows, &watchers);
                        watchers.forget(id);
                        conns2.lock().retain(|(i, _)| *i != id);
                        // The borrower is gone with its connection: give back
                        // its loans (dropped outside the lock).
                        let mut ended = Vec::new();
                        borrows.lock().retain(|_, (conn, loans)| {
                            if *conn == id {
                                ended.push(std::mem::take(loans));
                            }
                            *conn != id
                        });
                        drop(ended);
                    });
                    match spawned {
                        Ok(h) => {
                            let mut t = threads.lock();
                            t.retain(|h| !h.is_finished());
                            t.push(h);
                        }
                        Err(_) => conns.lock().retain(|(i, _)| *i != id),
                    }
                }
            })?
        };
        Ok(Server { addr, stop, conns, threads, accept: Mutex::new(Some(accept)), watchers })
    }

    /// Initiators watching this engine's registrations.
    pub fn watchers(&self) -> Arc<Watchers> {
        self.watchers.clone()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, closes every connection and joins the threads.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)); // wakes accept
        if let Some(h) = self.accept.lock().take() {
            let _ = h.join();
        }
        for (_, s) in self.conns.lock().iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            let _ = t.join();
        }
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

/// Reusable per-connection buffers: no allocation per request once warm.
#[derive(Default)]
struct Scratch {
    body: Vec<u8>,
    out: Vec<u8>,
    iovs: Vec<libc::iovec>,
    loans: Vec<Arc<Registration>>,
    discard: Vec<u8>,
}

fn serve_connection(
    stream: TcpStream,
    side: &Weak<dyn TargetSide>,
    conn: u64,
    borrows: &BorrowTable,
    watchers: &Watchers,
) {
    let fd = stream.as_raw_fd();
    let mut s = Scratch { discard: vec![0u8; 64 * 1024], ..Scratch::default() };
    loop {
        let mut hb = [0u8; wire::HEADER_LEN];
        if read_exact(fd, &mut hb).is_err() {
            return;
        }
        let Some(side) = side.upgrade() else { return };
        let Ok(h) = wire::decode_header(&hb, side.limits()) else { return };
        s.body.resize(h.body_len as usize, 0);
        if read_exact(fd, &mut s.body).is_err() {
            return;
        }
        let served = match h.kind {
            Kind::Watch => serve_watch(fd, &h, side.as_ref(), &mut s, conn, watchers, &stream),
            _ => serve_request(fd, &h, side.as_ref(), &mut s, conn, borrows),
        };
        if served.is_err() {
            return; // malformed frame or broken connection: close this one only
        }
        s.loans.clear(); // range loans end after the bytes moved
    }
}

/// Why a connection must close.
enum Close {
    Io,
    Malformed,
}

impl From<io::Error> for Close {
    fn from(_: io::Error) -> Self {
        Close::Io
    }
}
impl From<WireError> for Close {
    fn from(_: WireError) -> Self {
        Close::Malformed
    }
}

fn send_frame(fd: i32, kind: Kind, request: u64, body: &[u8]) -> io::Result<()> {
    let hb = wire::encode_header(&wire::header(kind, body.len(), 0, request));
    let mut v = [iov(hb.as_ptr() as u64, hb.len() as u64), iov(body.as_ptr() as u64, body.len() as u64)];
    // SAFETY: both entries borrow live local buffers for the call.
    unsafe { writev_all(fd, &mut v) }
}

fn send_error(fd: i32, request: u64, out: &mut Vec<u8>, status: RemoteStatus, detail: &str) -> io::Result<()> {
    wire::encode_error(out, status, detail);
    send_frame(fd, Kind::Error, request, out)
}

/// A Watch subscribes its connection to the registry's changes
/// ([`Watchers::changed`]); what changed since the version it names is
/// pushed at once.
fn serve_watch(
    fd: i32,
    h: &Header,
    side: &dyn TargetSide,
    s: &mut Scratch,
    conn: u64,
    watchers: &Watchers,
    stream: &TcpStream,
) -> Result<(), Close> {
    let (epoch, since, max_reply) = wire::decode_watch(&s.body)?;
    if h.data_len != 0 {
        return Err(Close::Malformed);
    }
    if epoch != side.epoch() {
        let detail = format!("target epoch is {:#x}", side.epoch());
        return Ok(send_error(fd, h.request, &mut s.out, RemoteStatus::EpochMismatch, &detail)?);
    }
    let budget = (max_reply.min(side.limits().max_body as u64) as usize)
        .min(PUSH_BUDGET)
        .saturating_sub(CHANGED_OVERHEAD + crate::segment::DELTA_HEADER);
    if budget < 1024 {
        return Ok(send_error(fd, h.request, &mut s.out, RemoteStatus::BadLength, "replies must allow 1 KiB")?);
    }
    let sub =
        Subscriber { conn, epoch, request: h.request, budget, stream: stream.try_clone()?, pushed: Mutex::new(since) };
    watchers.subscribe(sub, side.registry_version(), &|since, budget| side.changes(since, budget));
    Ok(())
}

fn serve_request(
    fd: i32,
    h: &Header,
    side: &dyn TargetSide,
    s: &mut Scratch,
    conn: u64,
    borrows: &BorrowTable,
) -> Result<(), Close> {
    match h.kind {
        Kind::Borrow => {
            let (borrow_id, req) = wire::decode_borrow(&s.body)?;
            if h.data_len != 0 {
                return Err(Close::Malformed);
            }
            let write = h.flags & wire::BORROW_WRITE != 0;
            let refusal = if req.target_epoch != side.epoch() {
                Some((RemoteStatus::EpochMismatch, format!("target epoch is {:#x}", side.epoch())))
            } else {
                s.iovs.clear();
                side.resolve(&req, write, &mut s.iovs, &mut s.loans).err()
            };
            let refusal = refusal.or_else(|| {
                let mut table = borrows.lock();
                if table.len() >= MAX_BORROWS {
                    Some((RemoteStatus::ResourceExhausted, "too many borrows".to_owned()))
                } else {
                    match table.entry(borrow_id) {
                        std::collections::hash_map::Entry::Occupied(_) => {
                            Some((RemoteStatus::Other, "borrow id in use".to_owned()))
                        }
                        std::collections::hash_map::Entry::Vacant(v) => {
                            v.insert((conn, std::mem::take(&mut s.loans)));
                            None
                        }
                    }
                }
            });
            s.loans.clear();
            match refusal {
                Some((status, detail)) => send_error(fd, h.request, &mut s.out, status, &detail)?,
                None => send_frame(fd, Kind::BorrowAck, h.request, &[])?,
            }
        }
        Kind::Return => {
            let borrow_id = wire::decode_return(&s.body)?;
            let ended = borrows.lock().remove(&borrow_id);
            drop(ended);
            send_frame(fd, Kind::ReturnAck, h.request, &[])?;
        }
        Kind::DescribeSince => {
            let d = wire::decode_describe_since(&s.body)?;
            if h.data_len != 0 {
                return Err(Close::Malformed);
            }
            let budget =
                (d.max_reply.min(side.limits().max_body as u64) as usize).saturating_sub(crate::segment::DELTA_HEADER);
            if d.expected_epoch != 0 && d.expected_epoch != side.epoch() {
                let detail = format!("target epoch is {:#x}", side.epoch());
                send_error(fd, h.request, &mut s.out, RemoteStatus::EpochMismatch, &detail)?;
            } else if budget < 1024 {
                send_error(fd, h.request, &mut s.out, RemoteStatus::BadLength, "replies must allow 1 KiB")?;
            } else {
                let delta = side.changes(d.since, budget).to_bytes();
                send_frame(fd, Kind::DescribeDelta, h.request, &delta)?;
            }
        }
        Kind::Describe => {
            wire::decode_describe(&s.body)?;
            if h.data_len != 0 {
                return Err(Close::Malformed);
            }
            let d = side.descriptor();
            send_frame(fd, Kind::DescribeReply, h.request, &d)?;
        }
        Kind::Write | Kind::Read => {
            let write = h.kind == Kind::Write;
            let req = Request::decode(&s.body)?;
            let total = req.total_len().ok_or(Close::Malformed)?;
            // A WRITE's payload length must match its descriptors, or the
            // stream cannot be kept in sync: close. A READ carries none.
            if (write && total != h.data_len as u64) || (!write && h.data_len != 0) {
                return Err(Close::Malformed);
            }
            let refusal = if req.target_epoch != side.epoch() {
                Some((RemoteStatus::EpochMismatch, format!("target epoch is {:#x}", side.epoch())))
            } else if !write && total > side.limits().max_data as u64 {
                Some((RemoteStatus::BadLength, "read larger than one frame".to_owned()))
            } else {
                s.iovs.clear();
                side.resolve(&req, write, &mut s.iovs, &mut s.loans).err()
            };
            if let Some((status, detail)) = refusal {
                s.loans.clear();
                if write {
                    discard(fd, h.data_len as u64, &mut s.discard)?;
                }
                send_error(fd, h.request, &mut s.out, status, &detail)?;
                return Ok(());
            }
            side.remote_gate();
            if write {
                let mut done = 0;
                // SAFETY: `resolve` checked every range against a live
                // registration and `s.loans` keeps those registrations (and
                // their backing) alive until after this call.
                unsafe { readv_all(fd, &mut s.iovs, &mut done)? };
                s.loans.clear(); // landed: release the loans, then ack
                send_frame(fd, Kind::WriteAck, h.request, &[])?;
            } else {
                let hb = wire::encode_header(&wire::header(Kind::ReadReply, 0, total, h.request));
                s.iovs.insert(0, iov(hb.as_ptr() as u64, hb.len() as u64));
                // SAFETY: as above, for reads; the header is a live local.
                unsafe { writev_all(fd, &mut s.iovs)? };
            }
        }
        Kind::Notify => {
            let env = wire::decode_notify(&s.body)?;
            if h.data_len != 0 {
                return Err(Close::Malformed);
            }
            let result = if env.target_epoch != side.epoch() {
                Err((RemoteStatus::EpochMismatch, format!("target epoch is {:#x}", side.epoch())))
            } else {
                side.deliver(&env)
            };
            match result {
                Ok(()) => send_frame(fd, Kind::NotifyAck, h.request, &[])?,
                Err((status, detail)) => send_error(fd, h.request, &mut s.out, status, &detail)?,
            }
        }
        Kind::DescribeReply
        | Kind::WriteAck
        | Kind::ReadReply
        | Kind::NotifyAck
        | Kind::Error
        | Kind::BorrowAck
        | Kind::ReturnAck
        | Kind::DescribeDelta
        | Kind::Changed
        | Kind::Watch => {
            return Err(Close::Malformed);
        }
    }
    Ok(())
}

/// Why a peer operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PeerFailure {
    /// The connection broke or timed out; the peer is lost.
    Lost(String),
    /// The target refused with a typed status.
    Refused(RemoteStatus, String),
}

/// What a control request hears back: the reply's body (empty for an
/// acknowledgement), or why there is none.
pub(crate) type ControlDone = Box<dyn FnOnce(Result<&[u8], PeerFailure>) + Send>;

/// A control request for a peer (a notification, a borrow or a return, a
/// refresh): one frame with an encoded body, answered by one reply.
pub(crate) struct ControlJob {
    pub kind: Kind,
    pub flags: u8,
    pub body: Vec<u8>,
    pub done: ControlDone,
}

impl ControlJob {
    fn expected_reply(&self) -> Kind {
        match self.kind {
            Kind::Borrow => Kind::BorrowAck,
            Kind::Return => Kind::ReturnAck,
            Kind::DescribeSince => Kind::DescribeDelta,
            _ => Kind::NotifyAck,
        }
    }
}

pub(crate) enum PeerJob<J> {
    Task(J),
    Control(ControlJob),
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

/// Requests a connection keeps outstanding: the next request is on the
/// wire while the previous reply is still coming, so neither side idles
/// for a round trip between tasks.
const PIPELINE_DEPTH: usize = 2;

/// A request on the wire, waiting for its reply.
enum Sent<J> {
    Task(J, u64),
    Control(ControlJob, u64),
}

fn connection_worker<J: CopyJob>(link: &PeerLink<J>, stream: TcpStream) {
    let fd = stream.as_raw_fd();
    let mut s = Scratch::default();
    let mut inflight: VecDeque<Sent<J>> = VecDeque::with_capacity(PIPELINE_DEPTH);
    loop {
        // Fill the pipeline; block for work only when nothing is outstanding.
        while inflight.len() < PIPELINE_DEPTH {
            let next = if inflight.is_empty() { link.next_job() } else { link.try_next_job() };
            let Some((job, lost)) = next else { break };
            if let Some(why) = lost {
                fail_unsent(job, why);
                continue;
            }
            let id = link.next_request.fetch_add(1, Ordering::Relaxed);
            let sent = match job {
                PeerJob::Task(j) => match send_task(fd, link, &j, id, &mut s) {
                    Ok(()) => Sent::Task(j, id),
                    Err(why) => {
                        link.mark_lost(why.clone());
                        let planned = j.planned();
                        let unknown = j.program().op == Op::Write;
                        j.finish(TaskReport { planned, done: 0, end: TaskEnd::Failed { effect_unknown: unknown } });
                        continue;
                    }
                },
                PeerJob::Control(n) => match send_control(fd, link, &n, id) {
                    Ok(()) => Sent::Control(n, id),
                    Err(why) => {
                        link.mark_lost(why.clone());
                        (n.done)(Err(PeerFailure::Lost(why)));
                        continue;
                    }
                },
            };
            inflight.push_back(sent);
        }
        let Some(sent) = inflight.pop_front() else { break };
        match sent {
            Sent::Task(j, id) => {
                let (report, broken) = complete_task(fd, link, &j, id, &mut s);
                if let Some(why) = broken {
                    link.mark_lost(why);
                }
                j.finish(report);
            }
            Sent::Control(n, id) => {
                let result = complete_control(fd, link, n.expected_reply(), id, &mut s);
                if let Err(PeerFailure::Lost(why)) = &result {
                    link.mark_lost(why.clone());
                }
                (n.done)(result.map(|()| &s.body[..]));
            }
        }
    }
    drop(stream);
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

/// A job that was never put on the wire: nothing moved, effect known.
fn fail_unsent<J: CopyJob>(job: PeerJob<J>, why: String) {
    match job {
        PeerJob::Task(j) => {
            let planned = j.planned();
            j.finish(TaskReport { planned, done: 0, end: TaskEnd::Failed { effect_unknown: false } });
        }
        PeerJob::Control(n) => (n.done)(Err(PeerFailure::Lost(why))),
    }
}

/// Reads a reply header and body within `patience`; protocol violations
/// count as a lost peer.
fn read_reply(
    fd: i32,
    link: &PeerLink<impl CopyJob>,
    id: u64,
    s: &mut Scratch,
    patience: &Patience,
) -> Result<Header, String> {
    let mut hb = [0u8; wire::HEADER_LEN];
    read_exact_within(fd, &mut hb, Some(patience)).map_err(|e| format!("connection lost: {e}"))?;
    let h = wire::decode_header(&hb, link.opts.limits).map_err(|e| format!("protocol violation: {e}"))?;
    if h.request != id {
        return Err(format!("reply to request {} while {id} was outstanding", h.request));
    }
    s.body.resize(h.body_len as usize, 0);
    read_exact_within(fd, &mut s.body, Some(patience)).map_err(|e| format!("connection lost: {e}"))?;
    Ok(h)
}

/// Puts a task's request (and a WRITE's payload) on the wire.
fn send_task<J: CopyJob>(fd: i32, link: &PeerLink<J>, j: &J, id: u64, s: &mut Scratch) -> Result<(), String> {
    let planned = j.planned();
    let op = j.program().op;
    let spans = j.spans();
    wire::encode_request(
        &mut s.out,
        link.descriptor.epoch,
        spans.iter().map(|sp| RemoteDesc { registration: sp.remote_reg, offset: sp.remote, len: sp.len }),
    );
    let (kind, data) = if op == Op::Write { (Kind::Write, planned) } else { (Kind::Read, 0) };
    let hb = wire::encode_header(&wire::header(kind, s.out.len(), data, id));
    s.iovs.clear();
    s.iovs.push(iov(hb.as_ptr() as u64, hb.len() as u64));
    s.iovs.push(iov(s.out.as_ptr() as u64, s.out.len() as u64));
    if op == Op::Write {
        s.iovs.extend(spans.iter().map(|sp| iov(sp.local, sp.len)));
    }
    let patience = link.opts.patience(data + s.out.len() as u64);
    // SAFETY: header and body are live locals; span addresses are kept
    // valid by the job's range loans (CopyJob contract).
    unsafe { writev_within(fd, &mut s.iovs, Some(&patience)) }.map_err(|e| format!("connection lost: {e}"))
}

/// Reads the reply of a sent task and lands a READ's bytes.
fn complete_task<J: CopyJob>(
    fd: i32,
    link: &PeerLink<J>,
    j: &J,
    id: u64,
    s: &mut Scratch,
) -> (TaskReport, Option<String>) {
    let planned = j.planned();
    let op = j.program().op;
    let spans = j.spans();
    let unknown = |why: String| {
        // Some payload may have landed: the effect cannot be known.
        (TaskReport { planned, done: 0, end: TaskEnd::Failed { effect_unknown: op == Op::Write } }, Some(why))
    };
    // The reply starts now (an earlier reply on this connection is done):
    // it must come within the peer timeout and at the minimum rate.
    let patience = link.opts.patience(if op == Op::Read { planned } else { 0 });
    let h = match read_reply(fd, link, id, s, &patience) {
        Ok(h) => h,
        Err(why) => return unknown(why),
    };
    match (op, h.kind) {
        (_, Kind::Error) => match wire::decode_error(&s.body) {
            // The target validates everything before any byte moves.
            Ok(_) => (TaskReport { planned, done: 0, end: TaskEnd::Failed { effect_unknown: false } }, None),
            Err(e) => unknown(format!("protocol violation: {e}")),
        },
        (Op::Write, Kind::WriteAck) if h.data_len == 0 => {
            (TaskReport { planned, done: planned, end: TaskEnd::Complete }, None)
        }
        (Op::Read, Kind::ReadReply) if h.data_len as u64 == planned && h.body_len == 0 => {
            s.iovs.clear();
            s.iovs.extend(spans.iter().map(|sp| iov(sp.local, sp.len)));
            let mut done = 0;
            // SAFETY: local span addresses are valid and retained (CopyJob
            // contract); nothing else writes them during the task.
            match unsafe { readv_within(fd, &mut s.iovs, &mut done, Some(&patience)) } {
                Ok(()) => (TaskReport { planned, done, end: TaskEnd::Complete }, None),
                // Exactly `done` bytes landed locally; a READ has no remote effect.
                Err(e) => (
                    TaskReport { planned, done, end: TaskEnd::Failed { effect_unknown: false } },
                    Some(format!("connection lost: {e}")),
                ),
            }
        }
        (_, k) => unknown(format!("protocol violation: unexpected {k:?} reply")),
    }
}

fn send_control<J: CopyJob>(fd: i32, link: &PeerLink<J>, n: &ControlJob, id: u64) -> Result<(), String> {
    let mut h = wire::header(n.kind, n.body.len(), 0, id);
    h.flags = n.flags;
    let hb = wire::encode_header(&h);
    let mut v = [iov(hb.as_ptr() as u64, hb.len() as u64), iov(n.body.as_ptr() as u64, n.body.len() as u64)];
    let patience = link.opts.patience(n.body.len() as u64);
    // SAFETY: both entries borrow live buffers for the call.
    unsafe { writev_within(fd, &mut v, Some(&patience)) }.map_err(|e| format!("connection lost: {e}"))
}

fn complete_control<J: CopyJob>(
    fd: i32,
    link: &PeerLink<J>,
    expected: Kind,
    id: u64,
    s: &mut Scratch,
) -> Result<(), PeerFailure> {
    let patience = link.opts.patience(link.opts.limits.max_body as u64);
    let h = read_reply(fd, link, id, s, &patience).map_err(PeerFailure::Lost)?;
    match h.kind {
        k if k == expected && h.data_len == 0 => Ok(()),
        Kind::Error => match wire::decode_error(&s.body) {
            Ok((status, detail)) => Err(PeerFailure::Refused(status, detail)),
            Err(e) => Err(PeerFailure::Lost(format!("protocol violation: {e}"))),
        },
        k => Err(PeerFailure::Lost(format!("protocol violation: unexpected {k:?} reply"))),
    }
}
