//! The target side of one peer connection, as a state machine: bytes in,
//! replies out, no sockets, threads or clocks.
//!
//! The driver asks where the next incoming bytes go ([`ServerConn::recv_buf`]:
//! the machine's own header and body buffers, or, for an accepted WRITE,
//! straight into the registered memory it names), reports how many arrived
//! ([`ServerConn::received`]), and sends what [`ServerConn::send_buf`] holds
//! (a reply, or a READ's bytes straight from registered memory) until
//! [`ServerConn::sent`] has seen all of it. One request is served at a time,
//! in order: the next is read only once the previous reply is out.
//!
//! The machine calls out to nothing that may block or act: it queries the
//! engine through [`TargetView`] (identity, limits, a registry lookup),
//! and what must be done beyond that (deliver a notification, hand over
//! descriptors or CUDA IPC handles, run a staged request's device copies,
//! hold a request at a test gate, subscribe a watch) it asks as an
//! [`Event`], taking and sending nothing until its driver answered.
//!
//! Every request is checked whole (epoch, ids, generations, bounds and
//! permissions, through [`TargetView::resolve`]) before any payload byte
//! moves. A refusal is a typed error frame; a refused WRITE's payload is
//! drained first, so the stream stays in sync. A malformed frame closes the
//! connection ([`Close`]); other connections are not affected.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::charge::{Charge, Counter, Counters};
use crate::transport::framebuf::{BufferBudget, FrameBuf};
use crate::types::Resource;

use crate::registry::Registration;
use crate::transport::auth::{Responder, ResponderSelf, Secret};
use crate::transport::proto::FrameIn;
use crate::transport::sock::{advance, iov};
use crate::wire::{
    self, DescribeSince, Header, Kind, Limits, Message, NotifyEnvelope, RemoteStatus, Request, WireError,
};

/// What the server machine may ask of the engine's target side: queries
/// that answer at once and never block (a registry lookup, the engine's
/// identity and limits). Everything else the machine needs done is an
/// [`Event`] its driver performs ([`TargetSide`]).
pub(crate) trait TargetView: Send + Sync + 'static {
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
    /// As `resolve`, for a WRITE or a READ, which may also name device
    /// memory the target stages through a host buffer: `landing` then
    /// receives the buffer and the device copies a driver runs
    /// ([`Event::Stage`]). `resolve` alone (borrows) never takes device
    /// memory.
    fn resolve_staged(
        &self,
        req: &Request<'_>,
        write: bool,
        iovs: &mut Vec<libc::iovec>,
        loans: &mut Vec<Arc<Registration>>,
        landing: &mut Option<Box<dyn Landing>>,
    ) -> Result<(), (RemoteStatus, String)> {
        let _ = landing;
        self.resolve(req, write, iovs, loans)
    }
    /// As `resolve` for a borrow of a peer that reaches device memory
    /// through CUDA IPC (on the local socket): loans on every named range,
    /// which must all be device memory; no I/O vectors.
    fn lend_device(
        &self,
        req: &Request<'_>,
        write: bool,
        loans: &mut Vec<Arc<Registration>>,
    ) -> Result<(), (RemoteStatus, String)> {
        let _ = (req, write, loans);
        Err((RemoteStatus::PermissionDenied, "this target lends no device memory".into()))
    }
    /// Connects this engine's RDMA queue pairs to the `cards` of the
    /// initiator at `from` (`None`: the local socket): a card per card
    /// asked, and what the connection keeps (the queue pairs, closed with
    /// it); or a refusal (no NIC, none left, the address holds its share).
    #[allow(clippy::type_complexity, reason = "the cards, and what the connection holds")]
    fn rdma_connect(
        &self,
        from: Option<std::net::IpAddr>,
        cards: &[crate::wire::QpCard],
    ) -> Result<(Vec<crate::wire::QpCard>, Box<dyn std::any::Any + Send>), (RemoteStatus, String)> {
        let _ = (from, cards);
        Err((RemoteStatus::Other, "this engine has no RDMA NIC".into()))
    }
    /// What changed in the exported registrations after registry version
    /// `since`, in at most `budget` encoded bytes.
    fn changes(&self, since: u64, budget: usize) -> crate::segment::Delta;
    /// The registry's current version.
    fn registry_version(&self) -> u64;
    /// Frame limits.
    fn limits(&self) -> Limits;
    /// What this engine answers to as a responder of the authentication
    /// handshake, on a connection whose end here is `at`.
    fn responder(&self, at: ConnEnd) -> ResponderSelf {
        ResponderSelf {
            epoch: self.epoch(),
            advertised: None,
            local_socket: None,
            reached_at: match at {
                ConnEnd::Tcp(a) => Some(a),
                ConnEnd::Local => None,
            },
        }
    }
    /// As `resolve` for a borrow of a peer that reaches the ranges with
    /// RDMA: loans on every named range, each of which must have a memory
    /// region (host or device memory); no I/O vectors.
    fn lend_rdma(
        &self,
        req: &Request<'_>,
        write: bool,
        loans: &mut Vec<Arc<Registration>>,
    ) -> Result<(), (RemoteStatus, String)> {
        let _ = (req, write, loans);
        Err((RemoteStatus::PermissionDenied, "this target lends nothing to RDMA".into()))
    }
    /// What borrowers may make this target hold.
    fn borrow_limits(&self) -> BorrowLimits {
        BorrowLimits { per_connection: 4096, registrations_per_borrow: 1024 }
    }
}

/// The engine's target side as the server's driver sees it: the machine's
/// queries, and what the driver does for the machine's [`Event`]s
/// (`transport::server::perform`) and for its own (accept caps, refused handshakes).
pub(crate) trait TargetSide: TargetView {
    /// The queries the machine may make.
    fn view(&self) -> &dyn TargetView;
    /// CUDA IPC handles of the device registrations `ids` (raw), for a
    /// same-host peer on the local socket, with the descriptors of the
    /// shareable ones in entry order (at most [`crate::wire::MAX_SHARED_FDS`]).
    fn ipc_export(&self, ids: &[u64]) -> (Vec<crate::wire::IpcEntry>, Vec<std::os::fd::OwnedFd>) {
        let refused = ids.iter().map(|_| crate::wire::IpcEntry::Refused("this target exports no IPC handles".into()));
        (refused.collect(), Vec::new())
    }
    /// Queues a notification, or refuses it.
    fn deliver(&self, env: &NotifyEnvelope<'_>) -> Result<(), (RemoteStatus, String)>;
    /// Test hook: blocks while remote requests are held (after their loans
    /// were taken, before any byte moves).
    fn remote_gate(&self) {}
    /// Test hook: true while registration changes are kept from watchers.
    fn pushes_withheld(&self) -> bool {
        false
    }
    /// A connection from `from` did not authenticate (it was refused:
    /// `why`).
    fn auth_failed(&self, _from: &str, _why: &str) {}
    /// A connection from `from` was closed at accept: it would exceed the
    /// cap `why` (a configuration field's name).
    fn connection_refused(&self, _from: &str, _why: &str) {}
    /// A connection from `from` was closed for a frame that broke the
    /// protocol (`why`).
    fn connection_broke(&self, _from: &str, _why: &str) {}
    /// A duplicate of the descriptor of shared allocation `name` (its
    /// notification inbox, or one a registration peers may target lies
    /// in), for a same-host peer on the local socket.
    fn shared_fd(&self, _name: &str) -> Option<std::os::fd::OwnedFd> {
        None
    }
}

/// The target's part of a request that names device memory: a host buffer
/// its bytes go through, and for a WRITE the device copies that run once
/// they are all in.
pub(crate) trait Landing: Send {
    /// The device copies: a READ's device bytes into the buffer (before its
    /// reply), a WRITE's bytes out of it once they are all in (the
    /// request's loans are still held). `Err`: why, answered to the peer.
    fn copy(&mut self) -> Result<(), crate::cuda::CudaError>;
}

/// Bounds on what borrowers may make a target hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BorrowLimits {
    /// Borrows one connection may hold (`max_borrows_per_connection`).
    pub per_connection: usize,
    /// Registrations one borrow may hold (`max_registrations_per_borrow`).
    pub registrations_per_borrow: usize,
}

/// What the listener's connections may make this engine hold, all of them
/// together, and where it is counted: frame and reply buffers, borrows and
/// their bookkeeping. (Each connection holds its own borrows, keyed by id:
/// only the borrower returns a borrow, and a connection's borrows end with
/// it.)
#[derive(Debug, Clone)]
pub(crate) struct ServerBudget {
    pub counters: Arc<Counters>,
    /// `max_frame_buffer_bytes`.
    pub frame_buffer_bytes: u64,
    /// `max_borrows`.
    pub borrows: u64,
    /// `max_borrow_bytes`.
    pub borrow_bytes: u64,
}

impl Default for ServerBudget {
    fn default() -> Self {
        ServerBudget {
            counters: Arc::default(),
            frame_buffer_bytes: 256 << 20,
            borrows: 65_536,
            borrow_bytes: 64 << 20,
        }
    }
}

impl ServerBudget {
    fn buffers(&self) -> BufferBudget {
        BufferBudget { counters: self.counters.clone(), limit: self.frame_buffer_bytes }
    }
}

/// Bytes a borrow's bookkeeping costs besides a pointer per registration
/// (its entry in the connection's table, its vector).
pub(crate) const BORROW_OVERHEAD: u64 = 64;

/// I/O vectors a connection keeps between exchanges.
const RESTING_IOVS: usize = 256;

/// Most bytes of changes pushed at once; a watcher further behind gets the
/// first part and asks for the rest.
pub(crate) const PUSH_BUDGET: usize = 64 << 10;

/// Bytes of a Changed frame besides its delta.
pub(crate) const CHANGED_OVERHEAD: usize = 16;

/// Where a connection came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnEnd {
    /// Over tcp, at this local address (`getsockname`).
    Tcp(std::net::SocketAddr),
    /// Over the local socket (only this user's processes reach it).
    Local,
}

/// Why a connection must close.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Close {
    /// The peer broke the protocol: how.
    Malformed(WireError),
    /// The peer did not authenticate: an error reply is queued (the driver
    /// sends what it can at once), then the connection closes.
    Unauthenticated,
}

/// Where a connection stands with authentication.
enum Auth {
    /// This engine has no secret: no authentication.
    Open,
    /// The first frame must be an AuthHello.
    Hello(Arc<Secret>),
    /// The challenge went out; the next frame must be the AuthProof.
    Proof(Box<Responder>),
    /// Authenticated.
    Done,
    /// The handshake was refused: the connection closes.
    Refused,
}

impl From<WireError> for Close {
    fn from(e: WireError) -> Self {
        Close::Malformed(e)
    }
}

/// A subscription the driver must make (a Watch): push what changed after
/// `since` at once, then every change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Subscribe {
    pub epoch: u64,
    pub request: u64,
    pub budget: usize,
    pub since: u64,
}

/// A notification the driver delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Delivery {
    pub sender_endpoint: String,
    pub sender_epoch: u64,
    pub target_epoch: u64,
    pub payload: Vec<u8>,
}

/// Something the driver must do for the machine (`transport::server::perform`). Until it
/// answers (the method each variant names), the machine takes no byte
/// and has none to send.
pub(crate) enum Event {
    /// Subscribe this connection to the registry's changes; no answer
    /// (or [`ServerConn::refuse_request`]).
    Subscribe(Subscribe),
    /// Deliver a notification: [`ServerConn::delivered`].
    Deliver(Delivery),
    /// Duplicate the descriptors of these shared allocations (local socket
    /// only): [`ServerConn::shared`].
    ShareFds(Vec<String>),
    /// Export CUDA IPC handles of these device registrations (local socket
    /// only): [`ServerConn::exported`].
    ExportIpc(Vec<u64>),
    /// A WRITE's or READ's ranges are resolved and lent, and no byte moved
    /// yet (a test may hold it here): [`ServerConn::proceed`].
    Resolved,
    /// Run a staged request's device copies: [`ServerConn::staged`].
    Stage(Box<dyn Landing>),
}

/// What the machine waits for (an [`Event`]'s answer).
enum Awaiting {
    Delivered(u64),
    Shared(u64),
    Exported(u64),
    /// The gate, for a WRITE or READ resolved into these vectors.
    Proceed {
        h: Header,
        write: bool,
        iovs: Vec<libc::iovec>,
    },
    /// A READ's device bytes into its staging buffer, then its reply.
    Filled {
        h: Header,
        iovs: Vec<libc::iovec>,
    },
    /// A WRITE's bytes out of its staging buffer, then its ack.
    Landed(u64),
}

/// What incoming bytes are for.
enum Input {
    /// A request frame (header and body).
    Frame,
    /// An accepted WRITE's payload, landing in registered memory through
    /// `iovs` (from `first`); `loans` keep those registrations alive.
    Payload { h: Header, first: usize },
    /// A refused WRITE's payload, `left` bytes still to drop; the error
    /// reply goes out once it is drained.
    Discard { h: Header, left: u64, status: RemoteStatus, detail: String },
}

/// How long a connection may take, as its server bounds it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadlines {
    /// A frame that started must be in, and its reply out, within this
    /// plus its bytes at `min_rate`; an authenticating connection's whole
    /// handshake, from accept to AuthOk, within this.
    pub frame_timeout: std::time::Duration,
    /// A connection with no exchange for this long is closed (`None`:
    /// never).
    pub idle_timeout: Option<std::time::Duration>,
    /// Slowest accepted peer, bytes per second (0: no rate bound).
    pub min_rate: u64,
}

impl Deadlines {
    /// How long an exchange moving `bytes` may take.
    pub fn allowance(&self, bytes: u64) -> std::time::Duration {
        match self.min_rate {
            0 => self.frame_timeout,
            rate => self.frame_timeout.saturating_add(crate::time::at_rate(bytes, rate)),
        }
    }
}

/// Why a connection ran out of time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expired {
    /// It did not finish its handshake within the frame bound.
    Handshake,
    /// An exchange took longer than its allowance (a stalled or
    /// trickling peer).
    Stalled,
    /// No exchange for the idle bound.
    Idle,
}

/// A connection's clock, as the driver's `now`s told it.
struct Clock {
    /// When it was accepted.
    accepted: Instant,
    /// When the exchange in progress started (a new connection that owes
    /// its handshake counts from its accept); `None` between exchanges.
    busy_since: Option<Instant>,
    /// Frames seen at the last tick.
    frames_seen: u64,
    /// When bytes last moved.
    last: Instant,
    /// A subscribed watch connection: the initiator only listens on it,
    /// so it is never idle (watchers have caps of their own).
    watching: bool,
}

/// One peer connection's target side.
pub(crate) struct ServerConn {
    input: Input,
    frame: FrameIn,
    discard: Vec<u8>,
    /// Incoming: the iovecs of the buffer or memory bytes go to.
    in_iovs: Vec<libc::iovec>,
    /// Range loans of the request being served (landing or sending).
    loans: Vec<Arc<Registration>>,
    /// Outgoing: the reply's header and body.
    out: FrameBuf,
    /// Outgoing: what remains to send (into `out`, or registered memory).
    out_iovs: Vec<libc::iovec>,
    out_first: usize,
    /// A READ reply holds its loans until every byte is out.
    out_loans: Vec<Arc<Registration>>,
    /// Device memory of the request being served, staged (`Landing`).
    landing: Option<Box<dyn Landing>>,
    /// A READ reply's staging buffer, until every byte is out.
    out_landing: Option<Box<dyn Landing>>,
    scratch: Vec<u8>,
    /// Borrows this connection holds: id to the registrations it keeps,
    /// and what they are charged.
    borrows: HashMap<u64, (Vec<Arc<Registration>>, Charge)>,
    /// The RDMA queue pairs connected for the initiator (once per
    /// connection), closed with it.
    rdma: Option<Box<dyn std::any::Any + Send>>,
    /// Frames received whole so far.
    frames: u64,
    /// Payload or reply bytes the exchange in progress moves.
    work: u64,
    auth: Auth,
    /// What all connections together may hold.
    budget: ServerBudget,
    /// Its part for frame and reply buffers (made once: replies are a hot
    /// path).
    buffers: BufferBudget,
    /// Where the connection came in.
    at: ConnEnd,
    /// The peer's address (`None`: the local socket, or not known).
    peer: Option<std::net::IpAddr>,
    /// Why the handshake was refused, once it was.
    refused: Option<String>,
    /// Descriptors to attach to the reply's first byte (`SCM_RIGHTS`).
    out_fds: Vec<std::os::fd::OwnedFd>,
    /// The answer to an [`Event`] the machine waits for.
    awaiting: Option<Awaiting>,
    clock: Clock,
}

// SAFETY: the raw pointers in the iovecs point into buffers this value owns
// or into registered memory kept alive by its loans; they are only used by
// the thread that holds the machine.
unsafe impl Send for ServerConn {}

/// Largest piece of a refused payload dropped per read.
const DISCARD_CHUNK: usize = 64 * 1024;

/// Why a frame or reply the buffer budget cannot take is refused.
const BUFFERS_FULL: &str = "this engine's frame buffers are full (max_frame_buffer_bytes): try again";

impl ServerConn {
    /// The peer's address, as the listener accepted it.
    pub fn set_peer(&mut self, peer: Option<std::net::IpAddr>) {
        self.peer = peer;
    }

    /// A machine for connection `conn` (an id unique in the server).
    /// With a `secret`, the connection must authenticate before anything
    /// else (and until it has, its frames are bounded to a few bytes).
    /// `at`: where the connection came in.
    pub fn new(budget: ServerBudget, secret: Option<Arc<Secret>>, at: ConnEnd, now: Instant) -> Self {
        // A connection that must authenticate owes its handshake at once
        // (the initiator sends it on connect); without a secret a fresh
        // connection is just idle (a link's data connections stay silent
        // until they have work).
        let owes = secret.is_some();
        ServerConn {
            clock: Clock { accepted: now, busy_since: owes.then_some(now), frames_seen: 0, last: now, watching: false },
            at,
            peer: None,
            refused: None,
            out_fds: Vec::new(),
            awaiting: None,
            auth: secret.map_or(Auth::Open, Auth::Hello),
            borrows: HashMap::new(),
            rdma: None,
            frames: 0,
            work: 0,
            input: Input::Frame,
            frame: FrameIn::with_budget(Some(budget.buffers())),
            buffers: budget.buffers(),
            budget,
            discard: Vec::new(),
            in_iovs: Vec::new(),
            loans: Vec::new(),
            landing: None,
            out_landing: None,
            out: FrameBuf::default(),
            out_iovs: Vec::new(),
            out_first: 0,
            out_loans: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// True between exchanges: no frame partly in, no reply partly out.
    pub fn is_idle(&self) -> bool {
        matches!(self.input, Input::Frame)
            && self.frame.is_empty()
            && self.out_first >= self.out_iovs.len()
            && self.awaiting.is_none()
    }

    /// The driver served the connection until `now` (`moved`: bytes went
    /// either way): an exchange starts when a frame completes (or, for a
    /// new connection, at accept) and ends when the machine is idle.
    pub fn tick(&mut self, now: Instant, moved: bool) {
        let c = &mut self.clock;
        if moved {
            c.last = now;
        }
        if self.frames != c.frames_seen {
            c.frames_seen = self.frames;
            c.busy_since = Some(now);
        }
        let idle = self.is_idle() && !self.owes_handshake();
        let c = &mut self.clock;
        if idle {
            c.busy_since = None;
        } else if c.busy_since.is_none() {
            c.busy_since = Some(now);
        }
    }

    /// The connection is a subscribed watch: never idle.
    pub fn subscribed(&mut self) {
        self.clock.watching = true;
    }

    /// Whether the connection has run out of time at `now`, and how.
    pub fn expired(&self, now: Instant, d: &Deadlines) -> Option<Expired> {
        let c = &self.clock;
        if self.owes_handshake() {
            // The whole handshake, from accept, within the frame bound.
            return (now.duration_since(c.accepted) > d.frame_timeout).then_some(Expired::Handshake);
        }
        match c.busy_since {
            Some(since) => (now.duration_since(since) > d.allowance(self.work)).then_some(Expired::Stalled),
            None => {
                (!c.watching && d.idle_timeout.is_some_and(|t| now.duration_since(c.last) > t)).then_some(Expired::Idle)
            }
        }
    }

    /// When [`Self::expired`] first says so, as things stand (`None`:
    /// never).
    pub fn deadline(&self, d: &Deadlines) -> Option<Instant> {
        let c = &self.clock;
        let past = |at: Instant, bound: Duration| at.checked_add(bound)?.checked_add(Duration::from_nanos(1));
        if self.owes_handshake() {
            return past(c.accepted, d.frame_timeout);
        }
        match c.busy_since {
            Some(since) => past(since, d.allowance(self.work)),
            None if c.watching => None,
            None => past(c.last, d.idle_timeout?),
        }
    }

    /// True while the connection owes its handshake.
    pub fn owes_handshake(&self) -> bool {
        matches!(self.auth, Auth::Hello(_) | Auth::Proof(_))
    }

    /// Why the handshake was refused (after [`Close::Unauthenticated`]).
    pub fn refusal(&self) -> Option<&str> {
        self.refused.as_deref()
    }

    /// True on the local socket.
    fn local(&self) -> bool {
        self.at == ConnEnd::Local
    }

    /// Frames received whole so far.
    #[cfg(feature = "fuzzing")]
    pub fn frames(&self) -> u64 {
        self.frames
    }

    /// Where the next incoming bytes go; `None` while a reply waits to be
    /// sent (requests are served one at a time, in order).
    pub fn recv_buf(&mut self) -> Option<&mut [libc::iovec]> {
        if self.out_first < self.out_iovs.len() || self.awaiting.is_some() {
            return None;
        }
        match &self.input {
            Input::Frame => self.frame.target(&mut self.in_iovs),
            Input::Payload { first, .. } => return Some(&mut self.in_iovs[*first..]),
            Input::Discard { left, .. } => {
                let n = (*left as usize).min(DISCARD_CHUNK);
                self.discard.resize(DISCARD_CHUNK, 0);
                self.in_iovs.clear();
                self.in_iovs.push(iov(self.discard.as_mut_ptr() as u64, n as u64));
            }
        }
        Some(&mut self.in_iovs[..])
    }

    /// `n` (> 0) bytes arrived into what [`ServerConn::recv_buf`] gave.
    /// Returns what the driver must do, or why the connection closes.
    pub fn received(&mut self, n: usize, side: &dyn TargetView) -> Result<Option<Event>, Close> {
        match &mut self.input {
            Input::Frame => match self.frame.received(n, self.frame_limits(side))? {
                Some(h) => {
                    // The body is read in place: the frame buffer is set
                    // aside while its message is served.
                    let frame = std::mem::replace(&mut self.frame, FrameIn::new());
                    let event = self.on_frame(h, &frame, side);
                    self.frame = frame;
                    self.frame.release(); // the body was used
                    event
                }
                None => Ok(None),
            },
            Input::Payload { h, first } => {
                let h = *h;
                advance(&mut self.in_iovs, first, n);
                if *first < self.in_iovs.len() {
                    return Ok(None);
                }
                self.input = Input::Frame;
                Ok(self.landed(h.request))
            }
            Input::Discard { h, left, status, detail } => {
                *left -= n as u64;
                if *left > 0 {
                    return Ok(None);
                }
                let (request, status, detail) = (h.request, *status, std::mem::take(detail));
                self.input = Input::Frame;
                self.error(request, status, &detail);
                Ok(None)
            }
        }
    }

    /// What to send next (advanced by [`ServerConn::sent`]); `None`: nothing.
    pub fn send_buf(&mut self) -> Option<&mut [libc::iovec]> {
        (self.out_first < self.out_iovs.len()).then(|| &mut self.out_iovs[self.out_first..])
    }

    /// Descriptors the next send must attach (with its first byte).
    pub fn send_fds(&self) -> &[std::os::fd::OwnedFd] {
        &self.out_fds
    }

    /// `n` bytes of [`ServerConn::send_buf`] went out.
    pub fn sent(&mut self, n: usize) {
        if n > 0 {
            self.out_fds.clear(); // they went with the first byte
        }
        advance(&mut self.out_iovs, &mut self.out_first, n);
        if self.out_first >= self.out_iovs.len() {
            self.out_landing = None; // its staging buffer goes back
            self.out_loans.clear(); // a READ's bytes are out: its loans end
            self.rest();
        }
    }

    /// The exchange is over: buffers go back to their resting size (what
    /// an idle connection holds is a few KiB, whatever it carried).
    fn rest(&mut self) {
        self.out.release();
        for v in [&mut self.in_iovs, &mut self.out_iovs] {
            if v.capacity() > RESTING_IOVS {
                *v = Vec::new();
            }
        }
        self.out_iovs.clear();
        self.out_first = 0;
        if !matches!(self.input, Input::Discard { .. }) {
            self.discard = Vec::new();
        }
    }

    fn reply(&mut self, kind: Kind, request: u64, body: &[u8]) {
        let h = wire::encode_header(&wire::header(kind, body.len(), 0, request));
        if self.out.set(&[&h, body], Some(&self.buffers)).is_err() {
            // A reply the buffer budget cannot take: a short refusal instead.
            return self.error(request, RemoteStatus::ResourceExhausted, BUFFERS_FULL);
        }
        self.out_iovs.clear();
        let out = self.out.as_slice();
        self.out_iovs.push(iov(out.as_ptr() as u64, out.len() as u64));
        self.out_first = 0;
    }

    fn error(&mut self, request: u64, status: RemoteStatus, detail: &str) {
        let mut body = std::mem::take(&mut self.scratch);
        wire::encode_error(&mut body, status, detail);
        self.reply(Kind::Error, request, &body);
        self.scratch = body;
    }

    /// Replies with `msg` (encoded into the scratch buffer).
    fn reply_with(&mut self, request: u64, msg: &Message<'_>) {
        let mut body = std::mem::take(&mut self.scratch);
        msg.encode(&mut body);
        self.reply(msg.kind(), request, &body);
        self.scratch = body;
    }

    /// Refuses request `request` (the driver could not do what the
    /// machine asked for it, such as a subscription beyond a cap): a typed
    /// error reply.
    pub fn refuse_request(&mut self, request: u64, status: RemoteStatus, detail: &str) {
        self.error(request, status, detail);
    }

    /// Refuses the request of frame `h` with a typed error reply: at once,
    /// or, when it carries a `payload` (`h.data_len` bytes), once that is
    /// dropped, so the stream stays in sync.
    fn refuse_frame(&mut self, h: Header, payload: bool, status: RemoteStatus, detail: String) {
        if payload && h.data_len > 0 {
            self.input = Input::Discard { h, left: h.data_len as u64, status, detail };
        } else {
            self.error(h.request, status, &detail);
        }
    }

    fn epoch_mismatch(&mut self, request: u64, side: &dyn TargetView) {
        let detail = format!("target epoch is {:#x}", side.epoch());
        self.error(request, RemoteStatus::EpochMismatch, &detail);
    }

    /// A whole frame (header and body) arrived.
    /// Keeps the loans a Borrow resolved (in `self.loans`) as borrow `id`,
    /// each registration once, within the limits; or says why not.
    fn keep_borrow(&mut self, id: u64, limits: BorrowLimits) -> Option<(RemoteStatus, String)> {
        let mut loans = std::mem::take(&mut self.loans);
        loans.sort_unstable_by_key(|r| Arc::as_ptr(r) as usize);
        loans.dedup_by(|a, b| Arc::ptr_eq(a, b));
        if loans.len() > limits.registrations_per_borrow {
            return Some((
                RemoteStatus::ResourceExhausted,
                format!("a borrow may hold {} registrations", limits.registrations_per_borrow),
            ));
        }
        if self.borrows.contains_key(&id) {
            return Some((RemoteStatus::Other, "borrow id in use".to_owned()));
        }
        if self.borrows.len() >= limits.per_connection {
            return Some((
                RemoteStatus::ResourceExhausted,
                format!("a connection may hold {} borrows", limits.per_connection),
            ));
        }
        // Charged, count and bookkeeping bytes, to what all borrowers of
        // this engine may hold together.
        let bytes = (loans.len() * size_of::<Arc<Registration>>()) as u64 + BORROW_OVERHEAD;
        let b = &self.budget;
        let charge = Charge::try_new(
            &b.counters,
            [
                (Counter::Borrows, 1, Some((Resource::Borrows, b.borrows))),
                (Counter::BorrowBytes, bytes, Some((Resource::BorrowBytes, b.borrow_bytes))),
            ],
        );
        let charge = match charge {
            Ok(c) => c,
            Err(e) => return Some((RemoteStatus::ResourceExhausted, e.to_string())),
        };
        loans.shrink_to_fit();
        self.borrows.insert(id, (loans, charge));
        None
    }

    /// What a frame may carry: a few bytes until the connection
    /// authenticated, so an unauthenticated peer costs one bounded frame.
    fn frame_limits(&self, side: &dyn TargetView) -> Limits {
        match self.auth {
            Auth::Hello(_) | Auth::Proof(..) | Auth::Refused => Limits { max_body: wire::AUTH_MAX_BODY, max_data: 0 },
            Auth::Open | Auth::Done => side.limits(),
        }
    }

    /// The authentication exchange: `Ok(true)` when the frame was part of
    /// it (answered), `Ok(false)` when the connection is authenticated (or
    /// needs none) and the frame is a request. Before the handshake is
    /// done, a frame that does not decode is refused as unauthenticated.
    fn authenticate(
        &mut self,
        h: Header,
        msg: &Result<Message<'_>, WireError>,
        side: &dyn TargetView,
    ) -> Result<bool, Close> {
        match std::mem::replace(&mut self.auth, Auth::Done) {
            Auth::Open => {
                self.auth = Auth::Open;
                if h.kind == Kind::AuthHello {
                    self.error(h.request, RemoteStatus::Unauthenticated, "this engine has no secret");
                    return Ok(true);
                }
                Ok(false)
            }
            Auth::Done => Ok(false),
            Auth::Refused => {
                self.auth = Auth::Refused;
                Err(Close::Unauthenticated)
            }
            Auth::Hello(secret) => {
                let Ok(Message::AuthHello(hello)) = msg else {
                    let why = match h.kind {
                        Kind::AuthHello => "authenticate first: a hello of authentication v2 (wire minor 2)",
                        _ => "authenticate first",
                    };
                    return self.refuse(h.request, why.to_owned());
                };
                let me = side.responder(self.at);
                match Responder::on_hello(secret, &me, hello.clone(), crate::transport::auth::nonce()) {
                    Ok((responder, challenge)) => {
                        self.reply_with(h.request, &Message::AuthChallenge(challenge));
                        self.auth = Auth::Proof(Box::new(responder));
                        Ok(true)
                    }
                    Err(why) => self.refuse(h.request, why.to_string()),
                }
            }
            Auth::Proof(responder) => {
                let proven = match msg {
                    Ok(Message::AuthProof(mac)) => responder.on_proof(mac).map_err(|e| e.to_string()),
                    _ => Err("the proof does not match this engine's secret".to_owned()),
                };
                match proven {
                    Ok(_) => {
                        self.reply(Kind::AuthOk, h.request, &[]);
                        Ok(true)
                    }
                    Err(why) => self.refuse(h.request, why),
                }
            }
        }
    }

    /// Refuses the handshake: an error frame saying `why`, then the
    /// connection closes.
    fn refuse(&mut self, request: u64, why: String) -> Result<bool, Close> {
        self.error(request, RemoteStatus::Unauthenticated, &why);
        self.refused = Some(why);
        self.auth = Auth::Refused;
        Err(Close::Unauthenticated)
    }

    /// A whole frame (header and body) arrived: it is decoded once, and
    /// its message served.
    fn on_frame(&mut self, h: Header, frame: &FrameIn, side: &dyn TargetView) -> Result<Option<Event>, Close> {
        self.input = Input::Frame;
        self.frames += 1;
        self.work = h.data_len as u64;
        if frame.over_budget() {
            // Its body was dropped: refused, and a WRITE's payload dropped
            // too, so the stream stays in sync.
            self.refuse_frame(h, true, RemoteStatus::ResourceExhausted, BUFFERS_FULL.to_owned());
            return Ok(None);
        }
        let msg = Message::decode(&h, frame.body());
        if self.authenticate(h, &msg, side)? {
            return Ok(None);
        }
        let request = h.request;
        match msg? {
            Message::Watch { target_epoch, since, max_reply } => {
                return Ok(self.on_watch(request, target_epoch, since, max_reply, side));
            }
            Message::ShareFds(names) => return Ok(self.on_share_fds(request, &names)),
            Message::IpcHandles { target_epoch, ids } => {
                return Ok(self.on_ipc_handles(request, target_epoch, &ids, side));
            }
            Message::Write(req) => return Ok(self.on_transfer(h, &req, true, side)),
            Message::Read(req) => return Ok(self.on_transfer(h, &req, false, side)),
            Message::Notify(env) => {
                if env.target_epoch != side.epoch() {
                    self.epoch_mismatch(request, side);
                    return Ok(None);
                }
                self.awaiting = Some(Awaiting::Delivered(request));
                return Ok(Some(Event::Deliver(Delivery {
                    sender_endpoint: env.sender_endpoint.to_owned(),
                    sender_epoch: env.sender_epoch,
                    target_epoch: env.target_epoch,
                    payload: env.payload.to_vec(),
                })));
            }
            Message::Borrow { id, request: req, write, device, rdma } => {
                self.on_borrow(request, id, &req, write, (device, rdma), side)
            }
            Message::Return { id } => {
                // Only this connection's own borrows: another connection
                // cannot end them.
                self.borrows.remove(&id); // its charge ends with it
                self.reply(Kind::ReturnAck, request, &[]);
            }
            Message::DescribeSince(d) => self.on_describe_since(request, &d, side),
            Message::RdmaConnect { target_epoch, cards } => {
                if target_epoch != side.epoch() {
                    self.epoch_mismatch(request, side);
                } else if self.rdma.is_some() {
                    self.error(request, RemoteStatus::Other, "this connection's queue pairs are connected already");
                } else {
                    match side.rdma_connect(self.peer, &cards) {
                        Ok((mine, keep)) => {
                            self.rdma = Some(keep);
                            let mut body = Vec::new();
                            crate::wire::encode_rdma_accept(&mut body, &mine);
                            self.reply(Kind::RdmaAccept, request, &body);
                        }
                        Err((status, detail)) => self.error(request, status, &detail),
                    }
                }
            }
            // The peer is alive (the driver's clock saw the bytes).
            Message::Keepalive => {}
            Message::Describe { .. } => {
                let d = side.descriptor();
                self.reply(Kind::DescribeReply, request, &d);
            }
            // Replies, and (authenticated already, or no secret) a second
            // handshake: not part of the protocol toward a target.
            m @ (Message::DescribeReply(_)
            | Message::WriteAck
            | Message::ReadReply
            | Message::NotifyAck
            | Message::Error { .. }
            | Message::BorrowAck
            | Message::ReturnAck
            | Message::DescribeDelta(_)
            | Message::Changed { .. }
            | Message::AuthChallenge(_)
            | Message::AuthOk
            | Message::ShareFdsReply(_)
            | Message::IpcHandlesReply(_)
            | Message::RdmaAccept(_)
            | Message::AuthHello(_)
            | Message::AuthProof(_)) => return Err(Close::Malformed(WireError::OutOfPlace(m.kind()))),
        }
        Ok(None)
    }

    /// A Watch: the driver subscribes the connection (or it is refused).
    fn on_watch(
        &mut self,
        request: u64,
        epoch: u64,
        since: u64,
        max_reply: u64,
        side: &dyn TargetView,
    ) -> Option<Event> {
        if epoch != side.epoch() {
            self.epoch_mismatch(request, side);
            return None;
        }
        let budget = (max_reply.min(side.limits().max_body as u64) as usize)
            .min(PUSH_BUDGET)
            .saturating_sub(CHANGED_OVERHEAD + crate::segment::DELTA_HEADER);
        if budget < 1024 {
            self.error(request, RemoteStatus::BadLength, "replies must allow 1 KiB");
            return None;
        }
        Some(Event::Subscribe(Subscribe { epoch, request, budget, since }))
    }

    /// A Borrow: loans kept under the borrower's id, or a refusal.
    fn on_borrow(
        &mut self,
        request: u64,
        borrow_id: u64,
        req: &Request<'_>,
        write: bool,
        (device, rdma): (bool, bool),
        side: &dyn TargetView,
    ) {
        let mut iovs = Vec::new();
        let refusal = if req.target_epoch != side.epoch() {
            Some((RemoteStatus::EpochMismatch, format!("target epoch is {:#x}", side.epoch())))
        } else if device && rdma {
            Some((RemoteStatus::Other, "a borrow is for CUDA IPC or for RDMA, not both".into()))
        } else if rdma {
            side.lend_rdma(req, write, &mut self.loans).err()
        } else if device && !self.local() {
            Some((RemoteStatus::PermissionDenied, "device memory is lent on the local socket only".into()))
        } else if device {
            side.lend_device(req, write, &mut self.loans).err()
        } else {
            side.resolve(req, write, &mut iovs, &mut self.loans).err()
        };
        let refusal = refusal.or_else(|| self.keep_borrow(borrow_id, side.borrow_limits()));
        self.loans.clear();
        match refusal {
            Some((status, detail)) => self.error(request, status, &detail),
            None => self.reply(Kind::BorrowAck, request, &[]),
        }
    }

    /// A DescribeSince: one page of changes.
    fn on_describe_since(&mut self, request: u64, d: &DescribeSince, side: &dyn TargetView) {
        let budget =
            (d.max_reply.min(side.limits().max_body as u64) as usize).saturating_sub(crate::segment::DELTA_HEADER);
        if d.expected_epoch != 0 && d.expected_epoch != side.epoch() {
            self.epoch_mismatch(request, side);
        } else if budget < 1024 {
            self.error(request, RemoteStatus::BadLength, "replies must allow 1 KiB");
        } else {
            let delta = side.changes(d.since, budget).to_bytes();
            self.reply(Kind::DescribeDelta, request, &delta);
        }
    }

    /// A ShareFds (local socket only): the driver duplicates the
    /// descriptors this side has.
    fn on_share_fds(&mut self, request: u64, names: &[&str]) -> Option<Event> {
        if !self.local() {
            self.error(request, RemoteStatus::Other, "shared memory is handed over on the local socket only");
            return None;
        }
        self.awaiting = Some(Awaiting::Shared(request));
        Some(Event::ShareFds(names.iter().map(|n| (*n).to_owned()).collect()))
    }

    /// An IpcHandles (local socket only): the driver exports the handles,
    /// or says why not.
    fn on_ipc_handles(&mut self, request: u64, epoch: u64, ids: &[u64], side: &dyn TargetView) -> Option<Event> {
        if !self.local() {
            self.error(request, RemoteStatus::PermissionDenied, "IPC handles go to the local socket only");
            return None;
        }
        if epoch != side.epoch() {
            self.epoch_mismatch(request, side);
            return None;
        }
        self.awaiting = Some(Awaiting::Exported(request));
        Some(Event::ExportIpc(ids.to_vec()))
    }

    /// A WRITE or a READ (its lengths already checked by the decoder):
    /// resolved whole before any byte moves; once the driver lets it
    /// proceed, the payload lands or the reply goes out straight from
    /// registered memory.
    fn on_transfer(&mut self, h: Header, req: &Request<'_>, write: bool, side: &dyn TargetView) -> Option<Event> {
        // Checked by Message::decode.
        let total = req.total_len().unwrap_or(0);
        self.work = total;
        let mut iovs = std::mem::take(&mut self.in_iovs);
        iovs.clear();
        let refusal = if req.target_epoch != side.epoch() {
            Some((RemoteStatus::EpochMismatch, format!("target epoch is {:#x}", side.epoch())))
        } else if !write && total > side.limits().max_data as u64 {
            Some((RemoteStatus::BadLength, "read larger than one frame".to_owned()))
        } else {
            side.resolve_staged(req, write, &mut iovs, &mut self.loans, &mut self.landing).err()
        };
        if let Some((status, detail)) = refusal {
            self.landing = None;
            self.loans.clear();
            self.in_iovs = iovs;
            self.refuse_frame(h, write, status, detail);
            return None;
        }
        self.awaiting = Some(Awaiting::Proceed { h, write, iovs });
        Some(Event::Resolved)
    }

    /// The answer to [`Event::Resolved`]: the request goes on.
    pub fn proceed(&mut self) -> Option<Event> {
        let Some(Awaiting::Proceed { h, write, iovs }) = self.awaiting.take() else {
            return None;
        };
        if write {
            self.in_iovs = iovs;
            self.in_iovs.retain(|v| v.iov_len > 0);
            if self.in_iovs.is_empty() {
                return self.landed(h.request);
            }
            self.input = Input::Payload { h, first: 0 };
            return None;
        }
        match self.landing.take() {
            Some(landing) => {
                self.awaiting = Some(Awaiting::Filled { h, iovs });
                Some(Event::Stage(landing))
            }
            None => {
                self.read_reply(h, iovs);
                None
            }
        }
    }

    /// A READ's reply: its header, then its bytes straight from registered
    /// memory (`iovs`), its loans held until every byte is out.
    fn read_reply(&mut self, h: Header, iovs: Vec<libc::iovec>) {
        let total: u64 = iovs.iter().map(|v| v.iov_len as u64).sum();
        let head = wire::encode_header(&wire::header(Kind::ReadReply, 0, total, h.request));
        let _ = self.out.set(&[&head], None); // a header: never charged
        self.out_iovs.clear();
        let out = self.out.as_slice();
        self.out_iovs.push(iov(out.as_ptr() as u64, out.len() as u64));
        self.out_iovs.extend(iovs.iter().copied());
        self.out_first = 0;
        self.out_loans.clear();
        self.out_loans.append(&mut self.loans);
        self.in_iovs = iovs;
    }

    /// A WRITE's bytes are all in: staged device memory lands (an
    /// [`Event::Stage`]) while the loans still hold it; then the loans
    /// end and the ack goes.
    fn landed(&mut self, request: u64) -> Option<Event> {
        if let Some(landing) = self.landing.take() {
            self.awaiting = Some(Awaiting::Landed(request));
            return Some(Event::Stage(landing));
        }
        self.loans.clear();
        self.reply(Kind::WriteAck, request, &[]);
        None
    }

    /// The answer to [`Event::Stage`]: how the device copies went.
    pub fn staged(&mut self, landing: Box<dyn Landing>, result: Result<(), crate::cuda::CudaError>) -> Option<Event> {
        let failed = |why: crate::cuda::CudaError| format!("the target's device copy failed: {why}");
        match self.awaiting.take() {
            Some(Awaiting::Filled { h, iovs }) => match result {
                Ok(()) => {
                    self.out_landing = Some(landing);
                    self.read_reply(h, iovs);
                }
                Err(why) => {
                    drop(landing);
                    self.loans.clear();
                    self.in_iovs = iovs;
                    self.error(h.request, RemoteStatus::Other, &failed(why));
                }
            },
            Some(Awaiting::Landed(request)) => {
                drop(landing);
                self.loans.clear();
                match result {
                    Ok(()) => self.reply(Kind::WriteAck, request, &[]),
                    Err(why) => self.error(request, RemoteStatus::Other, &failed(why)),
                }
            }
            other => self.awaiting = other,
        }
        None
    }

    /// The answer to [`Event::Deliver`].
    pub fn delivered(&mut self, result: Result<(), (RemoteStatus, String)>) -> Option<Event> {
        match self.awaiting.take() {
            Some(Awaiting::Delivered(request)) => match result {
                Ok(()) => self.reply(Kind::NotifyAck, request, &[]),
                Err((status, detail)) => self.error(request, status, &detail),
            },
            other => self.awaiting = other,
        }
        None
    }

    /// The answer to [`Event::ShareFds`]: per name, its descriptor or none.
    pub fn shared(&mut self, fds: Vec<Option<std::os::fd::OwnedFd>>) -> Option<Event> {
        match self.awaiting.take() {
            Some(Awaiting::Shared(request)) => {
                self.reply_with(request, &Message::ShareFdsReply(fds.iter().map(Option::is_some).collect()));
                self.out_fds = fds.into_iter().flatten().collect();
            }
            other => self.awaiting = other,
        }
        None
    }

    /// The answer to [`Event::ExportIpc`]: the entries, and the
    /// descriptors of the shareable ones in entry order.
    pub fn exported(&mut self, entries: Vec<crate::wire::IpcEntry>, fds: Vec<std::os::fd::OwnedFd>) -> Option<Event> {
        match self.awaiting.take() {
            Some(Awaiting::Exported(request)) => {
                self.reply_with(request, &Message::IpcHandlesReply(entries));
                self.out_fds = fds;
            }
            other => self.awaiting = other,
        }
        None
    }
}

#[cfg(test)]
mod tests {
    //! The machine against a reference model: random request streams
    //! (valid, refused and malformed frames), cut into random pieces on the
    //! way in and out, give the replies, bytes and memory the model says.

    use super::*;
    use crate::wire::{NotifyEnvelope, RemoteDesc};
    use proptest::prelude::*;
    use std::cell::UnsafeCell;

    const EPOCH: u64 = 0xfeed;
    const LIMITS: Limits = Limits { max_body: 4096, max_data: 1 << 16 };

    /// Two registrations: 1 read-write, 2 read-only, 256 bytes each.
    struct FakeSide {
        mem: UnsafeCell<[[u8; 256]; 2]>,
    }

    // SAFETY: the tests use one thread.
    unsafe impl Sync for FakeSide {}

    impl TargetView for FakeSide {
        fn epoch(&self) -> u64 {
            EPOCH
        }

        fn descriptor(&self) -> Vec<u8> {
            b"descriptor".to_vec()
        }

        fn resolve(
            &self,
            req: &Request<'_>,
            write: bool,
            iovs: &mut Vec<libc::iovec>,
            _loans: &mut Vec<Arc<Registration>>,
        ) -> Result<(), (RemoteStatus, String)> {
            for d in req.descs() {
                let Some(i) = d.registration.checked_sub(1).filter(|i| *i < 2) else {
                    return Err((RemoteStatus::UnknownRegistration, String::new()));
                };
                if write && i == 1 {
                    return Err((RemoteStatus::PermissionDenied, String::new()));
                }
                if d.offset.checked_add(d.len).is_none_or(|end| end > 256) {
                    return Err((RemoteStatus::OutOfBounds, String::new()));
                }
                // SAFETY: in bounds of the fake's memory (checked above).
                let base = unsafe { (*self.mem.get())[i as usize].as_mut_ptr().add(d.offset as usize) };
                iovs.push(iov(base as u64, d.len));
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
            LIMITS
        }
    }

    impl TargetSide for FakeSide {
        fn view(&self) -> &dyn TargetView {
            self
        }

        fn deliver(&self, env: &NotifyEnvelope<'_>) -> Result<(), (RemoteStatus, String)> {
            if env.payload.len() > 8 { Err((RemoteStatus::NotificationTooLarge, String::new())) } else { Ok(()) }
        }
    }

    #[derive(Debug, Clone)]
    enum Frame {
        Write {
            reg: u64,
            offset: u64,
            data: Vec<u8>,
            epoch_ok: bool,
        },
        Read {
            reg: u64,
            offset: u64,
            len: u64,
        },
        Notify {
            payload: Vec<u8>,
        },
        Describe,
        /// A WRITE whose payload length disagrees with its descriptors.
        BadLength,
        /// A reply kind sent to a server.
        WrongKind,
    }

    fn frame() -> impl Strategy<Value = Frame> {
        prop_oneof![
            4 => (0u64..4, 0u64..300, prop::collection::vec(any::<u8>(), 1..64), prop::bool::weighted(0.9))
                .prop_map(|(reg, offset, data, epoch_ok)| Frame::Write { reg, offset, data, epoch_ok }),
            3 => (0u64..4, 0u64..300, 1u64..64).prop_map(|(reg, offset, len)| Frame::Read { reg, offset, len }),
            1 => prop::collection::vec(any::<u8>(), 0..12).prop_map(|payload| Frame::Notify { payload }),
            1 => Just(Frame::Describe),
            1 => Just(Frame::BadLength),
            1 => Just(Frame::WrongKind),
        ]
    }

    fn encode(f: &Frame, request: u64) -> Vec<u8> {
        let mut body = Vec::new();
        let (kind, data): (Kind, &[u8]) = match f {
            Frame::Write { reg, offset, data, epoch_ok } => {
                let epoch = if *epoch_ok { EPOCH } else { EPOCH + 1 };
                let d = RemoteDesc { registration: *reg, offset: *offset, len: data.len() as u64 };
                wire::encode_request(&mut body, epoch, [d].into_iter());
                (Kind::Write, data)
            }
            Frame::Read { reg, offset, len } => {
                let d = RemoteDesc { registration: *reg, offset: *offset, len: *len };
                wire::encode_request(&mut body, EPOCH, [d].into_iter());
                (Kind::Read, &[])
            }
            Frame::Notify { payload } => {
                let env = NotifyEnvelope { sender_endpoint: "x:1", sender_epoch: 3, target_epoch: EPOCH, payload };
                wire::encode_notify(&mut body, &env);
                (Kind::Notify, &[])
            }
            Frame::Describe => {
                wire::encode_describe(&mut body, 3, 0);
                (Kind::Describe, &[])
            }
            Frame::BadLength => {
                let d = RemoteDesc { registration: 1, offset: 0, len: 8 };
                wire::encode_request(&mut body, EPOCH, [d].into_iter());
                (Kind::Write, &[0u8; 4])
            }
            Frame::WrongKind => (Kind::WriteAck, &[]),
        };
        let mut out = wire::encode_header(&wire::header(kind, body.len(), data.len() as u64, request)).to_vec();
        out.extend_from_slice(&body);
        out.extend_from_slice(data);
        out
    }

    /// What the model expects of one frame: a reply (kind, status of an
    /// error, READ bytes), or the connection closing.
    #[derive(Debug, PartialEq)]
    enum Expect {
        Reply(Kind, Option<RemoteStatus>, Vec<u8>),
        Close,
    }

    fn model(frames: &[Frame], mem: &mut [[u8; 256]; 2]) -> Vec<Expect> {
        let mut out = Vec::new();
        let check = |reg: u64, offset: u64, len: u64, write: bool| -> Result<usize, RemoteStatus> {
            let i = reg.checked_sub(1).filter(|i| *i < 2).ok_or(RemoteStatus::UnknownRegistration)? as usize;
            if write && i == 1 {
                return Err(RemoteStatus::PermissionDenied);
            }
            if offset + len > 256 {
                return Err(RemoteStatus::OutOfBounds);
            }
            Ok(i)
        };
        for f in frames {
            let e = match f {
                Frame::Write { epoch_ok: false, .. } => {
                    Expect::Reply(Kind::Error, Some(RemoteStatus::EpochMismatch), vec![])
                }
                Frame::Write { reg, offset, data, .. } => match check(*reg, *offset, data.len() as u64, true) {
                    Ok(i) => {
                        mem[i][*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
                        Expect::Reply(Kind::WriteAck, None, vec![])
                    }
                    Err(s) => Expect::Reply(Kind::Error, Some(s), vec![]),
                },
                Frame::Read { reg, offset, len } => match check(*reg, *offset, *len, false) {
                    Ok(i) => Expect::Reply(
                        Kind::ReadReply,
                        None,
                        mem[i][*offset as usize..(*offset + *len) as usize].to_vec(),
                    ),
                    Err(s) => Expect::Reply(Kind::Error, Some(s), vec![]),
                },
                Frame::Notify { payload } if payload.len() > 8 => {
                    Expect::Reply(Kind::Error, Some(RemoteStatus::NotificationTooLarge), vec![])
                }
                Frame::Notify { .. } => Expect::Reply(Kind::NotifyAck, None, vec![]),
                Frame::Describe => Expect::Reply(Kind::DescribeReply, None, b"descriptor".to_vec()),
                Frame::BadLength | Frame::WrongKind => Expect::Close,
            };
            let close = e == Expect::Close;
            out.push(e);
            if close {
                break;
            }
        }
        out
    }

    /// Copies `src` into the iovecs, in order; returns the bytes copied.
    fn fill(iovs: &[libc::iovec], src: &[u8]) -> usize {
        let mut done = 0;
        for v in iovs {
            let n = v.iov_len.min(src.len() - done);
            // SAFETY: the machine's iovecs address writable memory of at
            // least `iov_len` bytes.
            unsafe { std::ptr::copy_nonoverlapping(src[done..].as_ptr(), v.iov_base.cast(), n) };
            done += n;
            if done == src.len() {
                break;
            }
        }
        done
    }

    fn drain(iovs: &[libc::iovec], max: usize, out: &mut Vec<u8>) -> usize {
        let mut done = 0;
        for v in iovs {
            let n = v.iov_len.min(max - done);
            // SAFETY: the machine's iovecs address readable memory of at
            // least `iov_len` bytes.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), n) });
            done += n;
            if done == max {
                break;
            }
        }
        done
    }

    /// Runs the stream through a machine, `cuts` sizing each piece moved.
    fn run(frames: &[Frame], cuts: &[usize]) -> (Vec<Expect>, [[u8; 256]; 2]) {
        let side = FakeSide { mem: UnsafeCell::new([[0u8; 256]; 2]) };
        let input: Vec<u8> = frames.iter().enumerate().flat_map(|(i, f)| encode(f, i as u64 + 1)).collect();
        let mut m = ServerConn::new(Default::default(), None, ConnEnd::Local, std::time::Instant::now());
        let (mut pos, mut out, mut closed) = (0usize, Vec::new(), false);
        let mut cut = cuts.iter().cycle();
        loop {
            while let Some(iovs) = m.send_buf() {
                let n = drain(iovs, *cut.next().unwrap(), &mut out);
                m.sent(n);
            }
            if pos == input.len() {
                break;
            }
            let Some(iovs) = m.recv_buf() else { continue };
            let end = (pos + *cut.next().unwrap()).min(input.len());
            let n = fill(iovs, &input[pos..end]);
            pos += n;
            match m.received(n, &side) {
                Ok(event) => drop(crate::transport::server::perform(&mut m, &side, event)),
                Err(_) => {
                    closed = true;
                    break;
                }
            }
        }
        // Parse the replies.
        let mut got = Vec::new();
        let mut at = 0;
        while at < out.len() {
            let h: [u8; wire::HEADER_LEN] = out[at..at + wire::HEADER_LEN].try_into().unwrap();
            let h = wire::decode_header(&h, LIMITS).unwrap();
            at += wire::HEADER_LEN;
            let body = out[at..at + h.body_len as usize].to_vec();
            at += h.body_len as usize;
            let data = out[at..at + h.data_len as usize].to_vec();
            at += h.data_len as usize;
            assert_eq!(h.request, got.len() as u64 + 1, "replies come in request order");
            got.push(match h.kind {
                Kind::Error => Expect::Reply(
                    Kind::Error,
                    Some(match Message::decode(&wire::header(Kind::Error, body.len(), 0, 0), &body) {
                        Ok(Message::Error { status, .. }) => status,
                        other => panic!("not an error body: {other:?}"),
                    }),
                    vec![],
                ),
                Kind::DescribeReply => Expect::Reply(h.kind, None, body),
                k => Expect::Reply(k, None, data),
            });
        }
        if closed {
            got.push(Expect::Close);
        }
        (got, side.mem.into_inner())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
        #[test]
        fn matches_the_model(
            frames in prop::collection::vec(frame(), 1..24),
            cuts in prop::collection::vec(1usize..80, 1..8),
        ) {
            let mut mem = [[0u8; 256]; 2];
            let expected = model(&frames, &mut mem);
            let (got, landed) = run(&frames, &cuts);
            prop_assert_eq!(got, expected);
            prop_assert_eq!(landed, mem, "bytes land exactly where the model puts them");
        }
    }

    /// Feeds `bytes` to a fresh machine at once: why it closed, if it did.
    fn close_of(bytes: &[u8]) -> Option<Close> {
        let side = FakeSide { mem: UnsafeCell::new([[0u8; 256]; 2]) };
        let mut m = ServerConn::new(Default::default(), None, ConnEnd::Local, std::time::Instant::now());
        let mut pos = 0;
        while pos < bytes.len() {
            while let Some(iovs) = m.send_buf() {
                let n = drain(iovs, usize::MAX, &mut Vec::new());
                m.sent(n);
            }
            let iovs = m.recv_buf()?;
            let n = fill(iovs, &bytes[pos..]);
            pos += n;
            match m.received(n, &side) {
                Ok(event) => drop(crate::transport::server::perform(&mut m, &side, event)),
                Err(close) => return Some(close),
            }
        }
        None
    }

    fn raw(kind: Kind, flags: u8, body: &[u8], data_len: u64) -> Vec<u8> {
        let mut h = wire::header(kind, body.len(), data_len, 1);
        h.flags = flags;
        let mut out = wire::encode_header(&h).to_vec();
        out.extend_from_slice(body);
        out.extend(std::iter::repeat_n(0u8, data_len as usize));
        out
    }

    #[test]
    fn malformed_frames_close_with_their_typed_reason() {
        let mut req = Vec::new();
        wire::encode_request(&mut req, EPOCH, [RemoteDesc { registration: 1, offset: 0, len: 16 }].into_iter());
        let mut describe = Vec::new();
        wire::encode_describe(&mut describe, 7, EPOCH);
        let mut ret = Vec::new();
        Message::Return { id: 5 }.encode(&mut ret);
        let mut borrow = Vec::new();
        wire::encode_borrow(&mut borrow, 5, EPOCH, [RemoteDesc { registration: 1, offset: 0, len: 16 }].into_iter());
        let cases = [
            (raw(Kind::Keepalive, 0, &[1], 0), WireError::Malformed("keepalive")),
            (raw(Kind::WriteAck, 0, &[], 0), WireError::OutOfPlace(Kind::WriteAck)),
            (raw(Kind::Write, 0, &req, 10), WireError::PayloadMismatch { declared: 10, described: 16 }),
            (raw(Kind::Describe, 0, &describe, 4), WireError::UnexpectedData { kind: Kind::Describe, len: 4 }),
            (raw(Kind::Return, 1, &ret, 0), WireError::Malformed("flags")),
            (raw(Kind::Borrow, 8, &borrow, 0), WireError::Malformed("borrow flags")),
            (raw(Kind::Describe, 0, &describe[..8], 0), WireError::Malformed("describe")),
        ];
        for (bytes, why) in cases {
            assert_eq!(close_of(&bytes), Some(Close::Malformed(why.clone())), "{why}");
        }
        // Well-formed, they are served.
        assert_eq!(close_of(&raw(Kind::Keepalive, 0, &[], 0)), None);
        assert_eq!(close_of(&raw(Kind::Return, 0, &ret, 0)), None);
        assert_eq!(close_of(&raw(Kind::Borrow, wire::BORROW_WRITE, &borrow, 0)), None);
    }

    #[test]
    fn refused_write_payload_is_drained_before_the_error() {
        let frames = [
            Frame::Write { reg: 2, offset: 0, data: vec![9; 40], epoch_ok: true },
            Frame::Read { reg: 2, offset: 0, len: 4 },
        ];
        let (got, mem) = run(&frames, &[7]);
        assert_eq!(got[0], Expect::Reply(Kind::Error, Some(RemoteStatus::PermissionDenied), vec![]));
        assert_eq!(got[1], Expect::Reply(Kind::ReadReply, None, vec![0; 4]), "the stream stayed in sync");
        assert_eq!(mem[1], [0u8; 256], "nothing landed in a read-only registration");
    }
}
