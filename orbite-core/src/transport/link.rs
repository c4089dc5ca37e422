//! The initiator side of the tcp route: a link per opened peer epoch (a few
//! data connections and a watch connection), each connection a source of
//! the engine's reactor ([`Initiators`]).
//!
//! A connection's [`ClientConn`] machine says what to send and where
//! replies land; its turn moves the bytes with non-blocking
//! `writev`/`readv` straight between the socket and registered memory,
//! delivers completions, and the machine's clock gives the reactor its
//! deadlines (no byte for the stall time, or slower than the minimum rate:
//! the peer is lost; idle: a keepalive).
//!
//! Jobs wait in their link's queue; a connection with room takes the next
//! one when it finishes something, and a connection that found the queue
//! empty is "hungry": the next submit kicks it (a command to its loop,
//! with an eventfd write only if that loop sleeps).

use std::collections::VecDeque;
use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::segment::{Delta, SegmentDescriptor};
use crate::transport::CopyJob;
use crate::transport::auth::{Dialed, Initiator, Secret};
use crate::transport::liveness::PeerLiveness;
pub(crate) use crate::transport::peer_errors::OpenError;
use crate::transport::peer_errors::{LocalError, ShareError};
use crate::transport::proto::FrameIn;
use crate::transport::proto::client::{Bounds, ClientConn, PeerJob, unsent};
use crate::transport::proto::open::{Exchange, Opened, Opening, changes_of};
use crate::transport::reactor::{After, Group, Reactor, Ready, Source, Token, on_loop};
use crate::transport::sock::{Patience, Stream, iov, read_exact_within, tune, writev_within};
use crate::transport::unix::Credentials;
use crate::wire::{self, Kind, Limits, Message};

/// Options of a link.
#[derive(Debug, Clone)]
pub(crate) struct LinkOptions {
    pub connections: u32,
    /// Longest silence of a peer while a request is outstanding.
    pub io_timeout: Duration,
    /// Slowest accepted peer, bytes per second (0: no rate bound).
    pub min_rate: u64,
    pub limits: Limits,
    pub max_descriptor: usize,
    /// Each data connection's receive window (`sock::tune`).
    pub window: u64,
    /// This machine's boot id: a peer that reports it is asked to prove
    /// itself over its local socket.
    pub boot_id: [u8; 16],
    /// This engine's own local socket (never a peer's).
    pub own_socket: Option<Arc<str>>,
    /// A data connection with nothing to send for this long sends a
    /// keepalive (`peer_keepalive_ms`; `None`: never, or a peer of wire
    /// minor 1, which does not know them).
    pub keepalive: Option<Duration>,
}

impl LinkOptions {
    /// The granularity of the bounds (of the blocking exchange at open).
    fn tick(&self) -> Duration {
        (self.io_timeout / 100).clamp(Duration::from_millis(1), Duration::from_millis(25))
    }

    /// Silence after which the peer is lost: two ticks short of the
    /// timeout, so that the loss is found, and work fails, within
    /// `peer_timeout_ms` of the peer's last sign of life.
    fn stall(&self) -> Duration {
        self.io_timeout.saturating_sub(2 * self.tick()).max(self.tick())
    }

    /// The bounds each connection's machine keeps.
    fn bounds(&self) -> Bounds {
        Bounds { stall: self.stall(), min_rate: self.min_rate, keepalive: self.keepalive }
    }
}

/// Runs one exchange at open ([`Opening`]) on a blocking connection,
/// bounded by `patience`; `io` says what a failed send or receive means.
fn exchange(
    fd: i32,
    mut m: Opening,
    patience: &Patience,
    io: impl Fn(io::Error) -> OpenError,
) -> Result<Opened, OpenError> {
    loop {
        let out = m.to_send();
        if !out.is_empty() {
            let n = out.len();
            let mut v = [iov(out.as_ptr() as u64, n as u64)];
            // SAFETY: the entry borrows the machine's buffer for the call.
            unsafe { writev_within(fd, &mut v, patience) }.map_err(&io)?;
            m.sent(n);
        }
        let want = m.want();
        let n = want.len();
        read_exact_within(fd, want, patience).map_err(&io)?;
        if let Some(done) = m.received(n)? {
            return Ok(done);
        }
    }
}

/// The authentication handshake on a fresh, blocking connection to the
/// endpoint it `dialed`, expecting the responder's epoch `expect` when it
/// knows it: the epoch the responder proved.
fn authenticate(
    fd: i32,
    secret: &Arc<Secret>,
    my_epoch: u64,
    expect: Option<u64>,
    dialed: &Dialed,
    patience: &Patience,
) -> Result<u64, OpenError> {
    let hs = Initiator::new(secret.clone(), my_epoch, expect, dialed, crate::transport::auth::nonce());
    let m = Opening::new(Exchange::Authenticate(hs), Limits { max_body: wire::AUTH_MAX_BODY, max_data: 0 });
    match exchange(fd, m, patience, |e| OpenError::Connect(e.to_string()))? {
        Opened::Proved(epoch) => Ok(epoch),
        other => Err(OpenError::Protocol(format!("{other:?} in answer to a handshake"))),
    }
}

/// The Describe exchange on a fresh, blocking connection (after its
/// handshake, if any): the target's descriptor, and the wire minor its
/// reply came with.
fn describe(
    fd: i32,
    my_epoch: u64,
    expected: Option<u64>,
    opts: &LinkOptions,
    patience: &Patience,
) -> Result<(SegmentDescriptor, u8), OpenError> {
    let m = Opening::new(Exchange::Describe { my_epoch, expected, max_descriptor: opts.max_descriptor }, opts.limits);
    match exchange(fd, m, patience, |e| OpenError::Connect(e.to_string()))? {
        Opened::Described(descriptor, minor) => Ok((descriptor, minor)),
        other => Err(OpenError::Protocol(format!("{other:?} in answer to describe"))),
    }
}

/// A peer proven to run on this host: the kernel's word on its process,
/// and what that process itself described.
pub(crate) struct LocalProof {
    /// The credentials of the process behind the peer's local socket (its
    /// pid as seen from this pid namespace: the one one-sided routes use).
    pub cred: Credentials,
    /// The control connection, over the local socket.
    stream: Stream,
    /// The descriptor that process gave over it.
    descriptor: SegmentDescriptor,
}

/// Connects to the local socket `name` and, with a secret, authenticates:
/// the connection and its listener's credentials.
fn connect_local(
    name: &str,
    epoch: u64,
    my_epoch: u64,
    secret: Option<&Arc<Secret>>,
    opts: &LinkOptions,
    patience: &Patience,
) -> Result<(Stream, Credentials), LocalError> {
    if opts.own_socket.as_deref() == Some(name) {
        return Err(LocalError::OwnSocket);
    }
    let (s, cred) = crate::transport::unix::connect(name, opts.tick())?;
    if let Some(secret) = secret {
        let dialed = Dialed { name: name.to_owned(), reached: None };
        authenticate(s.as_raw_fd(), secret, my_epoch, Some(epoch), &dialed, patience).map_err(LocalError::Handshake)?;
    }
    Ok((s.into(), cred))
}

/// Proves that the peer the network described (`claimed`) runs on this
/// host: its local socket is reachable from here (same network
/// namespace), a process of this user listens on it, and that process is
/// the engine of the claimed epoch (it describes itself over that socket).
/// `Err(why)` when any of it fails: the peer is then remote.
fn prove_local(
    claimed: &SegmentDescriptor,
    my_epoch: u64,
    secret: Option<&Arc<Secret>>,
    opts: &LinkOptions,
    patience: &Patience,
) -> Result<LocalProof, LocalError> {
    if !claimed.same_boot(&opts.boot_id) {
        return Err(LocalError::OtherBoot);
    }
    if claimed.local_socket.is_empty() {
        return Err(LocalError::NoSocket);
    }
    let (stream, cred) = connect_local(&claimed.local_socket, claimed.epoch, my_epoch, secret, opts, patience)?;
    // The engine behind the socket describes itself, under the claimed
    // epoch or not at all. It may be another engine of this very process
    // (two NIXL agents in one process): its registrations are its own.
    let (descriptor, _) =
        describe(stream.as_raw_fd(), my_epoch, Some(claimed.epoch), opts, patience).map_err(LocalError::Describe)?;
    Ok(LocalProof { cred, stream, descriptor })
}

/// Applies changes a peer pushed (`base`: the version they start after).
pub(crate) type ChangeSink = Box<dyn Fn(u64, Delta) -> bool + Send + Sync>;

/// `PeerLink::announced` once the watch connection is gone.
pub(crate) const ANNOUNCE_UNKNOWN: u64 = u64::MAX;

/// A connection: its place in the reactor.
type ConnRef = Token;

struct LinkQueue<J> {
    jobs: VecDeque<PeerJob<J>>,
    /// Borrows and returns: they go on the link's first data connection,
    /// since a target honours a return only from the borrowing connection.
    pinned: VecDeque<PeerJob<J>>,
    /// That connection.
    control: Option<ConnRef>,
    /// True when it is a same-host peer's local control connection: then
    /// every control job goes on it, and no data task.
    control_only: bool,
    lost: Option<String>,
    closing: bool,
    /// Connections that found no job while they had room for one.
    hungry: Vec<ConnRef>,
}

impl<J> LinkQueue<J> {
    /// A hungry connection that takes data tasks (the most recent one).
    fn pop_hungry(&mut self) -> Option<ConnRef> {
        let skip = self.control.filter(|_| self.control_only);
        let i = self.hungry.iter().rposition(|c| Some(*c) != skip)?;
        Some(self.hungry.remove(i))
    }
}

/// The initiator's link to one peer epoch: a few connections, driven by
/// the engine's [`Initiators`], that take its queued jobs.
pub(crate) struct PeerLink<J> {
    /// The peer's description: for a peer proven local, the one its
    /// process gave over the local socket.
    pub descriptor: SegmentDescriptor,
    /// The kernel's word on a same-host peer's process, or why the peer
    /// is not one (then only the tcp route reaches it).
    pub local: Result<Credentials, LocalError>,
    queue: Mutex<LinkQueue<J>>,
    opts: LinkOptions,
    next_request: AtomicU64,
    lost_flag: AtomicBool,
    /// The newest registry version the peer announced on the watch
    /// connection; `u64::MAX` once that connection is gone (nothing is
    /// announced any more, so every lookup must ask).
    announced: AtomicU64,
    /// The peer refused a task for a registration it no longer has: the
    /// view may lack a change not announced yet (set by a data connection,
    /// cleared by the next refresh).
    lapsed: AtomicBool,
    /// The watch connection, until the reactor takes it.
    watch: Mutex<Option<Stream>>,
    /// This engine's epoch and secret (for later local connections).
    my_epoch: u64,
    secret: Option<Arc<Secret>>,
    /// Where pushed changes go (set by the engine once its view exists):
    /// applies them from a base version; false if they do not apply.
    sink: OnceLock<ChangeSink>,
    /// The subscription's first answer, until the engine applies it.
    first: Mutex<Option<(u64, Delta)>>,
    initiators: Arc<Initiators<J>>,
    /// The link's connections still on the reactor.
    conns: Mutex<Vec<ConnRef>>,
    gone: Condvar,
}

impl<J: CopyJob> PeerLink<J> {
    /// Connects, runs the authoritative Describe exchange, checks the
    /// epoch and hands the connections to `initiators`.
    pub fn open(
        initiators: &Arc<Initiators<J>>,
        endpoint: &str,
        expected_epoch: Option<u64>,
        timeout: Duration,
        my_epoch: u64,
        opts: LinkOptions,
        shared_secret: Option<Arc<Secret>>,
    ) -> Result<Arc<Self>, OpenError> {
        let secret = shared_secret.as_ref();
        let deadline = crate::time::deadline_after(timeout);
        let addr = endpoint
            .to_socket_addrs()
            .map_err(|e| OpenError::Connect(format!("{endpoint}: {e}")))?
            .next()
            .ok_or_else(|| OpenError::Connect(format!("{endpoint}: no address")))?;
        let tick = opts.tick();
        // The whole exchange is bounded by the caller's timeout, however
        // slowly the peer answers.
        let open_patience = Patience { stall: opts.stall().min(timeout), until: Some(deadline) };
        // The epoch the first connection's handshake proved: every later
        // connection must reach the same target.
        let proven = std::cell::Cell::new(None::<u64>);
        let connect = || -> Result<TcpStream, OpenError> {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            let s =
                TcpStream::connect_timeout(&addr, left).map_err(|e| OpenError::Connect(format!("{endpoint}: {e}")))?;
            tune(&s, opts.window);
            // The exchange at open blocks, waking every tick to check its
            // bounds; they are made non-blocking after.
            s.set_read_timeout(Some(tick)).map_err(|e| OpenError::Connect(e.to_string()))?;
            s.set_write_timeout(Some(tick)).map_err(|e| OpenError::Connect(e.to_string()))?;
            if let Some(secret) = secret {
                // The endpoint as named, and the address it reached: the
                // responder answers only a hello meant for it.
                let dialed = Dialed { name: endpoint.to_owned(), reached: s.peer_addr().ok() };
                let expect = expected_epoch.or(proven.get());
                let epoch = authenticate(s.as_raw_fd(), secret, my_epoch, expect, &dialed, &open_patience)?;
                match proven.get() {
                    Some(p) if p != epoch => {
                        return Err(OpenError::Protocol("the peer's connections proved different epochs".into()));
                    }
                    _ => proven.set(Some(epoch)),
                }
            }
            Ok(s)
        };
        let first = connect()?;
        let (claimed, minor) = describe(first.as_raw_fd(), my_epoch, expected_epoch, &opts, &open_patience)?;
        // A peer of minor 1 does not know keepalives (it would close).
        let keepalive = opts.keepalive.filter(|_| minor >= 2);
        if proven.get().is_some_and(|p| p != claimed.epoch) {
            return Err(OpenError::Protocol("the peer described another epoch than it proved".into()));
        }
        // Same host only on proof; then the view, the watch and every
        // control exchange (borrows included) go over the local socket, to
        // the process the kernel named.
        let (descriptor, local, control) = match prove_local(&claimed, my_epoch, secret, &opts, &open_patience) {
            Ok(p) => (p.descriptor, Ok(p.cred), Some(p.stream)),
            Err(why) => (claimed, Err(why), None),
        };
        let mut streams: Vec<Stream> = vec![first.into()];
        for _ in 1..opts.connections.max(1) {
            streams.push(connect()?.into());
        }
        // The watch connection: subscribed now, so that every change the
        // peer makes after this open returns is pushed. Its first answer
        // has what changed since the Describe.
        let watch: Stream = match &local {
            Ok(cred) => {
                let (s, again) =
                    connect_local(&descriptor.local_socket, descriptor.epoch, my_epoch, secret, &opts, &open_patience)
                        .map_err(|e| OpenError::Connect(e.to_string()))?;
                if again.pid != cred.pid {
                    return Err(OpenError::Protocol("the peer's local socket changed hands".into()));
                }
                s
            }
            Err(_) => connect()?.into(),
        };
        // A target whose watchers are full refuses: this link then asks for
        // changes instead of being told (every lookup of a range it does
        // not know refreshes).
        let subscribe = Exchange::Watch {
            epoch: descriptor.epoch,
            since: descriptor.registry_version,
            max_reply: opts.limits.max_body as u64,
        };
        let answer = exchange(watch.as_raw_fd(), Opening::new(subscribe, opts.limits), &open_patience, |e| {
            OpenError::Protocol(format!("no answer to the watch: {e}"))
        })?;
        let (first, watch) = match answer {
            Opened::Watching(base, delta) if base == descriptor.registry_version && delta.version >= base => {
                (Some((base, delta)), Some(watch))
            }
            Opened::WatchersFull => (None, None),
            _ => return Err(OpenError::Protocol("no answer to the watch".into())),
        };
        for s in streams.iter().chain(watch.as_ref()).chain(control.as_ref()) {
            s.set_nonblocking().map_err(|e| OpenError::Connect(e.to_string()))?;
        }
        let since = first.as_ref().map_or(ANNOUNCE_UNKNOWN, |f| f.1.version);
        let link = Arc::new(PeerLink {
            descriptor,
            local,
            my_epoch,
            secret: shared_secret.clone(),
            queue: Mutex::new(LinkQueue {
                jobs: VecDeque::new(),
                pinned: VecDeque::new(),
                control: None,
                control_only: false,
                lost: None,
                closing: false,
                hungry: Vec::new(),
            }),
            opts: LinkOptions { keepalive, ..opts },
            next_request: AtomicU64::new(2),
            lost_flag: AtomicBool::new(false),
            announced: AtomicU64::new(since),
            lapsed: AtomicBool::new(false),
            watch: Mutex::new(watch),
            sink: OnceLock::new(),
            first: Mutex::new(first),
            initiators: initiators.clone(),
            conns: Mutex::new(Vec::new()),
            gone: Condvar::new(),
        });
        if let Some(s) = control {
            // The local control connection takes control jobs only: data
            // tasks of the tcp route stay on TCP.
            let m = ClientConn::new(link.descriptor.epoch, link.opts.limits, link.opts.bounds(), Instant::now());
            let me = initiators.add(&link, s, Role::Data(Box::new(m)));
            let mut q = link.queue.lock();
            q.control = Some(me);
            q.control_only = true;
        }
        for s in streams {
            let m = ClientConn::new(link.descriptor.epoch, link.opts.limits, link.opts.bounds(), Instant::now());
            let me = initiators.add(&link, s, Role::Data(Box::new(m)));
            link.queue.lock().control.get_or_insert(me);
        }
        Ok(link)
    }

    /// The bound of one exchange on the local socket: the peer timeout.
    fn local_patience(&self) -> Patience {
        Patience { stall: self.opts.stall(), until: Some(crate::time::deadline_after(self.opts.io_timeout)) }
    }

    /// Sends one `kind` frame with `body` over a fresh connection to the
    /// local socket of this peer, which must lead to the process the
    /// kernel named at open; the connection, for its answer.
    fn ask_local(&self, kind: Kind, body: &[u8], patience: &Patience) -> Result<Stream, LocalError> {
        let cred = self.local.as_ref().map_err(Clone::clone)?;
        let d = &self.descriptor;
        let (s, again) =
            connect_local(&d.local_socket, d.epoch, self.my_epoch, self.secret.as_ref(), &self.opts, patience)?;
        if again.pid != cred.pid {
            return Err(LocalError::ChangedHands);
        }
        let hb = wire::encode_header(&wire::header(kind, body.len(), 0, 1));
        let mut v = [iov(hb.as_ptr() as u64, hb.len() as u64), iov(body.as_ptr() as u64, body.len() as u64)];
        // SAFETY: both entries borrow live local buffers for the call.
        unsafe { writev_within(s.as_raw_fd(), &mut v, patience) }?;
        Ok(s)
    }

    /// The changes the peer pushed when the link subscribed (what changed
    /// between its Describe and the subscription): `(base, delta)`, once.
    pub fn take_first_changes(&self) -> Option<(u64, Delta)> {
        self.first.lock().take()
    }

    /// Hands the watch connection to the reactor: the peer's pushed changes
    /// go to `sink` from now on. Called once, after the first changes
    /// were applied.
    pub fn start_watch(self: &Arc<Self>, since: u64, sink: ChangeSink) -> io::Result<()> {
        let _ = self.sink.set(sink);
        if let Some(watch) = self.watch.lock().take() {
            self.initiators.add(
                self,
                watch,
                Role::Watch(Box::new(Watch { frame: FrameIn::new(), iovs: Vec::new(), since })),
            );
        }
        Ok(())
    }

    /// The newest registry version the peer announced
    /// ([`ANNOUNCE_UNKNOWN`] when it can no longer announce).
    pub fn announced(&self) -> u64 {
        self.announced.load(Ordering::Acquire)
    }

    /// Whether the peer refused a task for a registration it no longer
    /// has since the last [`Self::clear_lapsed`].
    pub fn lapsed(&self) -> bool {
        self.lapsed.load(Ordering::Acquire)
    }

    /// Clears [`Self::lapsed`]: a refresh is starting.
    pub fn clear_lapsed(&self) {
        self.lapsed.store(false, Ordering::Release);
    }

    /// Queues a control-plane job ahead of queued data tasks (a refresh, a
    /// borrow): it waits for at most one task per connection.
    pub fn submit_first(&self, job: PeerJob<J>) {
        self.push(job, true);
    }

    /// Queues a job. Never runs it inline (callers may hold engine locks).
    pub fn submit(&self, job: PeerJob<J>) {
        self.push(job, false);
    }

    fn push(&self, job: PeerJob<J>, first: bool) {
        let kick = {
            let mut q = self.queue.lock();
            let pinned = match &job {
                PeerJob::Control(c) => q.control_only || matches!(c.kind, Kind::Borrow | Kind::Return),
                _ => false,
            };
            if pinned {
                q.pinned.push_back(job);
                let control = q.control;
                q.hungry.retain(|c| Some(*c) != control);
                control
            } else {
                if first {
                    q.jobs.push_front(job);
                } else {
                    q.jobs.push_back(job);
                }
                q.pop_hungry()
            }
        };
        if let Some(c) = kick {
            self.initiators.reactor.kick(c);
        }
    }

    /// The next queued job for connection `me`; with none, `me` is noted
    /// as hungry (kicked by the next submit). Another hungry connection is
    /// kicked when more jobs wait.
    fn take(&self, me: ConnRef) -> Option<PeerJob<J>> {
        let (job, kick) = {
            let mut q = self.queue.lock();
            let is_control = q.control == Some(me);
            let pinned = if is_control { q.pinned.pop_front() } else { None };
            let job = match pinned {
                Some(j) => Some(j),
                None if is_control && q.control_only => None,
                None => q.jobs.pop_front(),
            };
            match job {
                Some(job) => {
                    q.hungry.retain(|c| *c != me);
                    let kick = if !q.jobs.is_empty() {
                        q.pop_hungry().into_iter().collect()
                    } else if q.closing && q.pinned.is_empty() {
                        // The last job of a closing link: the idle
                        // connections can close now.
                        std::mem::take(&mut q.hungry)
                    } else {
                        Vec::new()
                    };
                    (Some(job), kick)
                }
                None => {
                    if !q.closing && !q.hungry.contains(&me) {
                        q.hungry.push(me);
                    }
                    (None, Vec::new())
                }
            }
        };
        for c in kick {
            self.initiators.reactor.kick(c);
        }
        job
    }

    /// True once the link closes and no job waits.
    fn drained(&self) -> bool {
        let q = self.queue.lock();
        q.closing && q.jobs.is_empty() && q.pinned.is_empty()
    }

    /// True once the link closes.
    fn closing(&self) -> bool {
        self.queue.lock().closing
    }

    /// Why the peer is lost, if it is.
    pub fn lost(&self) -> Option<String> {
        self.queue.lock().lost.clone()
    }

    /// True once the peer is lost (one atomic load).
    pub fn is_lost(&self) -> bool {
        self.lost_flag.load(Ordering::Acquire)
    }

    /// The peer is lost: every connection of the link ends what it has
    /// outstanding, and queued jobs fail unsent.
    fn mark_lost(&self, why: &str) {
        {
            let mut q = self.queue.lock();
            if q.lost.is_none() {
                let d = &self.descriptor;
                log::warn!(target: crate::logs::PEER, "peer {} (epoch {:#x}) is lost: {why}", d.endpoint, d.epoch);
                q.lost = Some(why.to_owned());
            }
            self.lost_flag.store(true, Ordering::Release);
        }
        self.kick_all();
    }

    fn kick_all(&self) {
        let conns = self.conns.lock().clone();
        for c in conns {
            self.initiators.reactor.kick(c);
        }
    }

    /// Closes the connections once the queue is empty, and waits for them
    /// (except on a reactor thread: the last owner of a link may be one of
    /// its own jobs' completions, and the connections end on their own).
    pub fn close(&self) {
        self.queue.lock().closing = true;
        self.kick_all();
        if on_loop() {
            return;
        }
        let mut conns = self.conns.lock();
        while !conns.is_empty() {
            self.gone.wait(&mut conns);
        }
    }

    fn forget(&self, me: ConnRef) {
        let mut conns = self.conns.lock();
        conns.retain(|c| *c != me);
        if conns.is_empty() {
            self.gone.notify_all();
        }
        drop(conns);
        self.queue.lock().hungry.retain(|c| *c != me);
    }
}

impl<J: CopyJob> crate::transport::routes::LocalFetch for PeerLink<J> {
    /// Asks a peer proven local for the descriptors of its shared
    /// allocations `names` (sealed memfds, over a fresh connection to its
    /// local socket, which must lead to the same process): per name, the
    /// descriptor or why not. Bounded by the peer timeout.
    fn shared(&self, names: &[&str]) -> Result<Vec<Result<OwnedFd, ShareError>>, LocalError> {
        let patience = self.local_patience();
        let mut out = Vec::with_capacity(names.len());
        let mut body = Vec::new();
        for chunk in names.chunks(wire::MAX_SHARED_FDS) {
            wire::encode_share_fds(&mut body, chunk.iter().copied());
            let s = self.ask_local(Kind::ShareFds, &body, &patience)?;
            let fd = s.as_raw_fd();
            let (hb, fds) = header_with_fds(fd, chunk.len(), &patience, "its shared memory")?;
            let limits = Limits { max_body: (2 + wire::MAX_SHARED_FDS) as u32, max_data: 0 };
            let h = wire::decode_header(&hb, limits)?;
            let mut body = vec![0u8; h.body_len as usize];
            read_exact_within(fd, &mut body, &patience)?;
            let attached = match Message::decode(&h, &body)? {
                Message::ShareFdsReply(attached) => attached,
                m => return Err(LocalError::Unexpected { kind: m.kind(), what: "shared memory" }),
            };
            wire::expect_count(Kind::ShareFdsReply, chunk.len(), attached.len())?;
            if attached.iter().filter(|a| **a).count() != fds.len() {
                return Err(LocalError::DescriptorsMismatch("shared memory"));
            }
            let mut fds = fds.into_iter();
            for (name, has) in chunk.iter().zip(attached) {
                out.push(match has {
                    true => fds.next().ok_or(ShareError::MissingDescriptor),
                    false => Err(ShareError::Unknown((*name).to_owned())),
                });
            }
        }
        Ok(out)
    }

    /// Asks a peer proven local for CUDA IPC handles of its device
    /// registrations `ids` (raw), over a fresh connection to its local
    /// socket, which must lead to the same process: per id, what it
    /// answered. Bounded by the peer timeout.
    /// A shareable entry comes with its descriptor (the peer attaches one
    /// per such entry; an answer whose descriptors do not match its
    /// entries is refused whole).
    fn ipc(&self, ids: &[u64]) -> Result<Vec<(wire::IpcEntry, Option<OwnedFd>)>, LocalError> {
        let patience = self.local_patience();
        let mut out = Vec::with_capacity(ids.len());
        let mut body = Vec::new();
        // Every answer could carry a descriptor per entry.
        for chunk in ids.chunks(wire::MAX_IPC_HANDLES.min(wire::MAX_SHARED_FDS)) {
            wire::encode_ipc_handles(&mut body, self.descriptor.epoch, chunk);
            let s = self.ask_local(Kind::IpcHandles, &body, &patience)?;
            let fd = s.as_raw_fd();
            let (hb, fds) = header_with_fds(fd, chunk.len(), &patience, "IPC handles")?;
            // The longest answer: every entry refused with the longest
            // reason (an exported entry is shorter), or an error frame.
            let max_body = (2 + chunk.len() * wire::IPC_ENTRY_MAX).max(4 + wire::MAX_ERROR_DETAIL);
            let limits = Limits { max_body: max_body as u32, max_data: 0 };
            let h = wire::decode_header(&hb, limits)?;
            let mut body = vec![0u8; h.body_len as usize];
            read_exact_within(fd, &mut body, &patience)?;
            match Message::decode(&h, &body)? {
                Message::IpcHandlesReply(entries) => {
                    wire::expect_count(Kind::IpcHandlesReply, chunk.len(), entries.len())?;
                    if entries.iter().filter(|e| e.has_fd()).count() != fds.len() {
                        return Err(LocalError::DescriptorsMismatch("IPC handles"));
                    }
                    let mut fds = fds.into_iter();
                    out.extend(entries.into_iter().map(|e| {
                        let fd = if e.has_fd() { fds.next() } else { None };
                        (e, fd)
                    }));
                }
                Message::Error { status, detail } => {
                    return Err(LocalError::Refused { what: "IPC handles", status, detail });
                }
                m => return Err(LocalError::Unexpected { kind: m.kind(), what: "IPC handles" }),
            }
        }
        Ok(out)
    }
}

// --- the connections on the reactor ------------------------------------------

/// Bytes one connection may move per turn before the others of its loop
/// get theirs.
const TURN_BYTES: usize = 8 << 20;

/// What a connection carries.
enum Role<J> {
    /// Requests and their replies.
    Data(Box<ClientConn<J>>),
    /// The peer's pushed registry changes.
    Watch(Box<Watch>),
}

/// The watch connection's reading state.
struct Watch {
    frame: FrameIn,
    iovs: Vec<libc::iovec>,
    /// The version the last applied push brought.
    since: u64,
}

// SAFETY: the iovecs point into the frame's own buffers; only the loop
// thread that holds the connection uses them.
unsafe impl Send for Watch {}

struct Conn<J> {
    link: Arc<PeerLink<J>>,
    stream: Stream,
    role: Role<J>,
    me: ConnRef,
    /// False once the socket is shut down (the peer is lost): the
    /// connection then only fails the link's queued jobs, until it closes.
    open: bool,
    /// False after a read found the socket empty, until epoll reports it
    /// readable again (edge-triggered: new bytes always raise an event):
    /// a request just sent does not cost a read that can only fail.
    readable: bool,
}

/// The engine's initiator connections: every link's, as sources of the
/// engine's reactor.
pub(crate) struct Initiators<J> {
    reactor: Arc<Reactor>,
    group: Group,
    _jobs: std::marker::PhantomData<fn(J)>,
}

impl<J: CopyJob> Initiators<J> {
    /// The initiators of the engine whose reactor is `reactor`.
    pub fn new(reactor: Arc<Reactor>) -> Arc<Self> {
        Arc::new(Initiators { reactor, group: Group::default(), _jobs: std::marker::PhantomData })
    }

    /// Watches same-host peer process `pid` on the same reactor.
    pub fn watch_process(&self, pid: i32) -> PeerLiveness {
        PeerLiveness::watch(&self.reactor, &self.group, pid)
    }

    /// Gives `stream` (non-blocking) to the reactor, as a connection of
    /// `link`.
    fn add(&self, link: &Arc<PeerLink<J>>, stream: Stream, role: Role<J>) -> ConnRef {
        self.reactor.add(&self.group, |me| {
            link.conns.lock().push(me);
            Box::new(Conn { link: link.clone(), stream, role, me, open: true, readable: true })
        })
    }

    /// Stops every connection: what one still has outstanding fails as
    /// with a lost peer. Waits for them (unless called on the reactor).
    pub fn shutdown(&self) {
        self.group.stop(&self.reactor, "connection lost: the engine closed");
    }
}

impl<J: CopyJob> Source for Conn<J> {
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.stream.as_fd()
    }

    fn ready(&mut self, ready: Ready) {
        if ready.readable() {
            self.readable = true;
        }
    }

    fn turn(&mut self) -> After {
        self.work()
    }

    fn outstanding(&self) -> bool {
        matches!(&self.role, Role::Data(m) if self.open && m.in_flight() > 0)
    }

    /// A data connection's jobs come from callers' submits.
    fn polls(&self) -> bool {
        matches!(self.role, Role::Data(_))
    }

    /// When this connection's peer is lost if nothing moves, or else when
    /// this idle data connection sends its next keepalive.
    fn deadline(&self) -> Option<Instant> {
        match &self.role {
            Role::Data(m) if self.open => m.deadline().or(m.keepalive_at()),
            _ => None,
        }
    }

    /// A peer gone silent or too slow is lost; an idle connection sends
    /// its keepalive.
    fn expire(&mut self, now: Instant) -> After {
        let Role::Data(m) = &mut self.role else { return After::Wait };
        if !self.open {
            return After::Wait;
        }
        if let Some(why) = m.expired(now) {
            self.lose(&why.to_string());
            return After::Again;
        }
        if m.keep_alive(now) { After::Again } else { After::Wait }
    }

    /// The engine stops: the connection ends as with a lost peer.
    fn stop(&mut self, why: &str) {
        self.lose(why);
        self.fail_queued();
    }

    fn close(&mut self) {
        self.stream.shutdown();
        self.link.forget(self.me);
        if let Role::Watch(_) = self.role {
            // Nothing more will be announced: lookups must ask the peer.
            self.link.announced.store(ANNOUNCE_UNKNOWN, Ordering::Release);
        }
    }
}

impl<J: CopyJob> Conn<J> {
    /// The connection failed (`why`): the peer is lost, what this
    /// connection has outstanding ends, and its socket shuts down.
    fn lose(&mut self, why: &str) {
        self.link.mark_lost(why);
        if let Role::Data(m) = &mut self.role {
            for d in m.fail_all(why) {
                d.deliver();
            }
        }
        if self.open {
            self.open = false;
            self.stream.shutdown();
        }
    }

    /// Fails every queued job of the link unsent.
    fn fail_queued(&self) {
        let why = self.link.lost().unwrap_or_else(|| "connection lost".into());
        while let Some(job) = self.link.take(self.me) {
            unsent(job, why.clone()).deliver();
        }
    }

    /// One turn: moves bytes until the socket would block, the turn is
    /// used up, or there is nothing to do.
    fn work(&mut self) -> After {
        if !self.open || self.link.is_lost() {
            if self.open {
                let why = self.link.lost().unwrap_or_default();
                self.lose(&why);
            }
            if let Role::Data(_) = self.role {
                self.fail_queued();
            }
            return if self.link.drained() || matches!(self.role, Role::Watch(_)) { After::Close } else { After::Wait };
        }
        let after = match self.role {
            Role::Data(_) => self.data_turn(),
            Role::Watch(_) => self.watch_turn(),
        };
        if let After::Wait = after {
            let done = match &self.role {
                Role::Data(m) => m.in_flight() == 0 && self.link.drained(),
                Role::Watch(_) => self.link.closing(),
            };
            if done {
                return After::Close;
            }
        }
        after
    }

    fn data_turn(&mut self) -> After {
        let fd = self.stream.as_raw_fd();
        let mut moved = 0usize;
        loop {
            let Role::Data(m) = &mut self.role else { return After::Wait };
            // Fill the pipeline from the link's queue.
            while m.can_start() {
                let Some(job) = self.link.take(self.me) else { break };
                let id = self.link.next_request.fetch_add(1, Ordering::Relaxed);
                m.start(job, id, Instant::now());
            }
            let mut progressed = false;
            if let Some(out) = m.send_buf() {
                // SAFETY: the machine's iovecs address its own buffers or the
                // job's spans, kept valid by its range loans (CopyJob contract).
                let r = unsafe { libc::writev(fd, out.as_ptr(), out.len().min(1024) as i32) };
                if r > 0 {
                    m.sent(r as usize, Instant::now());
                    moved += r as usize;
                    progressed = true;
                } else {
                    match failure() {
                        Failed::Retry => progressed = true,
                        Failed::Block => {}
                        Failed::Lost(why) => {
                            self.lose(&why);
                            return self.work();
                        }
                    }
                }
            }
            let Role::Data(m) = &mut self.role else { return After::Wait };
            if let Some(into) = m.recv_buf().filter(|_| self.readable) {
                // SAFETY: the machine's iovecs address its own buffers or the
                // READ's local spans, valid and retained (CopyJob contract),
                // which nothing else writes during the task.
                let r = unsafe { libc::readv(fd, into.as_ptr(), into.len().min(1024) as i32) };
                if r > 0 {
                    moved += r as usize;
                    progressed = true;
                    let mut done = None;
                    let result = m.received(r as usize, &mut done, Instant::now());
                    if std::mem::take(&mut m.lapsed) {
                        self.link.lapsed.store(true, Ordering::Release);
                    }
                    if let Err(violation) = result {
                        let why = violation.to_string();
                        self.link.mark_lost(&why);
                        if let Some(d) = done {
                            d.deliver();
                        }
                        self.lose(&why);
                        return self.work();
                    }
                    if let Some(d) = done {
                        d.deliver();
                    }
                } else if r == 0 {
                    self.lose("connection lost: peer closed the connection");
                    return self.work();
                } else {
                    match failure() {
                        Failed::Retry => progressed = true,
                        Failed::Block => self.readable = false,
                        Failed::Lost(why) => {
                            self.lose(&why);
                            return self.work();
                        }
                    }
                }
            }
            if !progressed {
                return After::Wait;
            }
            if moved >= TURN_BYTES {
                return After::Again;
            }
        }
    }

    fn watch_turn(&mut self) -> After {
        let fd = self.stream.as_raw_fd();
        let limits = self.link.opts.limits;
        let epoch = self.link.descriptor.epoch;
        let mut moved = 0usize;
        let Role::Watch(w) = &mut self.role else { return After::Wait };
        loop {
            w.frame.target(&mut w.iovs);
            // SAFETY: the iovec addresses the frame's own buffer.
            let r = unsafe { libc::readv(fd, w.iovs.as_ptr(), w.iovs.len() as i32) };
            if r == 0 {
                return After::Close;
            }
            if r < 0 {
                match failure() {
                    Failed::Retry => continue,
                    Failed::Block => return After::Wait,
                    Failed::Lost(_) => return After::Close,
                }
            }
            moved += r as usize;
            let h = match w.frame.received(r as usize, limits) {
                Ok(Some(h)) => h,
                Ok(None) => continue,
                Err(_) => return After::Close,
            };
            let Ok((base, delta)) = changes_of(&h, w.frame.body(), epoch) else { return After::Close };
            if delta.version <= base {
                return After::Close; // a push that moves nothing is not one this subscription sends
            }
            let (version, more) = (delta.version, delta.more);
            // Pushes continue each other; one that does not (or does not
            // apply) leaves the view behind, and lookups ask for the rest.
            let applied = base == w.since && self.link.sink.get().is_some_and(|sink| sink(base, delta));
            let announce = if applied && !more { version } else { version.saturating_add(1) };
            self.link.announced.fetch_max(announce, Ordering::AcqRel);
            w.since = version;
            if moved >= TURN_BYTES {
                return After::Again;
            }
        }
    }
}

/// What a `readv`/`writev` that returned `r` < 0 means.
enum Failed {
    /// Interrupted: call again.
    Retry,
    /// The socket would block: wait for its edge.
    Block,
    /// The connection failed.
    Lost(String),
}

fn failure() -> Failed {
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::Interrupted => Failed::Retry,
        io::ErrorKind::WouldBlock => Failed::Block,
        _ => Failed::Lost(format!("connection lost: {e}")),
    }
}

/// Reads a reply's header from the local socket `fd`, taking the
/// descriptors that come with its first byte (at most `max_fds`), within
/// the peer timeout.
fn header_with_fds(
    fd: std::os::fd::RawFd,
    max_fds: usize,
    patience: &Patience,
    what: &'static str,
) -> Result<([u8; wire::HEADER_LEN], Vec<OwnedFd>), LocalError> {
    let mut fds = Vec::new();
    let mut hb = [0u8; wire::HEADER_LEN];
    let mut got = 0;
    while got < hb.len() {
        match crate::transport::unix::recv_with_fds(fd, &mut hb[got..], max_fds, &mut fds) {
            Ok(0) => return Err(LocalError::Closed),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted) => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                if Instant::now() >= patience.until.unwrap_or_else(Instant::now) {
                    return Err(LocalError::TimedOut(what));
                }
            }
            Err(e) => return Err(LocalError::Receive(what, Arc::new(e))),
        }
    }
    Ok((hb, fds))
}
