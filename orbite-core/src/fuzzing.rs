//! Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`).
//!
//! Thin wrappers that reach the crate-private parts which read untrusted
//! bytes: the same-host notification inbox, whose ring other processes
//! write, and the target side of the peer protocol, which reads whatever a
//! peer sends. They are not an API: they change with the code they wrap,
//! and nothing but the fuzz targets should call them.

#![cfg(feature = "fuzzing")]

use std::cell::UnsafeCell;
use std::sync::Arc;

use crate::registry::Registration;
use crate::segment::Delta;
use crate::transport::auth::{Dialed, Initiator, Secret};
use crate::transport::inbox::{self, Envelope, Inbox};
use crate::transport::proto::server::{ConnEnd, ServerConn, TargetSide, TargetView};
use crate::transport::sock::iov;
use crate::wire::{self, Kind, Limits, NotifyEnvelope, RemoteStatus, Request};

/// Bytes of an inbox before its ring.
pub const INBOX_HEADER: usize = inbox::HEADER;

/// One envelope as the inbox carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxEnvelope {
    /// Sender's epoch.
    pub sender_epoch: u64,
    /// The epoch the sender addressed.
    pub target_epoch: u64,
    /// Sender's endpoint.
    pub sender_endpoint: String,
    /// Payload bytes.
    pub payload: Vec<u8>,
}

impl InboxEnvelope {
    fn to_envelope(&self) -> Envelope {
        Envelope {
            sender_epoch: self.sender_epoch,
            target_epoch: self.target_epoch,
            sender_endpoint: self.sender_endpoint.clone(),
            payload: self.payload.clone(),
        }
    }

    fn of(e: Envelope) -> Self {
        InboxEnvelope {
            sender_epoch: e.sender_epoch,
            target_epoch: e.target_epoch,
            sender_endpoint: e.sender_endpoint,
            payload: e.payload,
        }
    }
}

/// An inbox over a private buffer instead of a shared mapping: the fuzz
/// target plays every other process by writing the buffer's bytes.
pub struct InboxBuffer {
    /// The mapping's bytes (u64 words, so that the header's atomics are
    /// aligned), kept alive for `base`.
    _mem: Vec<u64>,
    /// The buffer's first byte, writable (taken once from `mem`).
    base: *mut u8,
    len: usize,
    owner: Inbox,
}

impl InboxBuffer {
    /// A fresh inbox with a ring of `ring` bytes (rounded to a multiple of
    /// 8 and clamped to 4 KiB ..= 1 MiB), initialised as its owner would.
    pub fn new(ring: usize, epoch: u64, max_payload: u64, budget: u64) -> Self {
        let ring = ring.clamp(4096, inbox::CAPACITY).next_multiple_of(8);
        let len = INBOX_HEADER + ring;
        let mut mem = vec![0u64; len / 8];
        let base = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: `mem` is a zeroed, writable buffer of `len` bytes that
        // this value owns and keeps at the same address (a Vec's heap
        // buffer does not move with the Vec) for as long as the view
        // lives. The header only needs 8-byte alignment (its widest fields
        // are AtomicU64), which a u64 buffer has; the crate's own inbox
        // tests rely on the same.
        let owner = unsafe { Inbox::create(base, len, epoch, max_payload, budget) };
        InboxBuffer { _mem: mem, base, len, owner }
    }

    /// Total bytes (header and ring).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: an inbox has at least a header.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The raw bytes, header and ring, for the caller to corrupt as a
    /// hostile sender would.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        // SAFETY: `base` addresses `len` initialised bytes; the exclusive borrow
        // of `self` means no view reads or writes them while the slice
        // lives.
        unsafe { std::slice::from_raw_parts_mut(self.base, len) }
    }

    /// Initialises the header again, as an owner that recreates its inbox
    /// over a fresh (zeroed) file does; the ring's bytes stay as they are.
    pub fn reinit(&mut self, epoch: u64, max_payload: u64, budget: u64) {
        // `create` expects a zeroed header (the lock and futex words are
        // not written by it).
        self.bytes_mut()[..INBOX_HEADER].fill(0);
        // SAFETY: as in `new`; the exclusive borrow means no other view is
        // in use while the header is rewritten.
        self.owner = unsafe { Inbox::create(self.base, self.len, epoch, max_payload, budget) };
    }

    /// Appends as a sender that already holds a view (the owner's own
    /// geometry): `false` when the inbox refuses (full, busy, too large).
    pub fn append(&self, env: &InboxEnvelope) -> bool {
        self.owner.append(&env.to_envelope()).is_ok()
    }

    /// Opens the inbox as a sender of epoch `epoch` would (checking the
    /// header it finds) and appends through that view: `None` when the
    /// header is refused, else whether the append happened.
    pub fn open_and_append(&self, epoch: u64, env: &InboxEnvelope) -> Option<bool> {
        // SAFETY: the same buffer as the owner's view, alive for this call;
        // `open` bounds the view by the header's capacity, checked against
        // `len`.
        let sender = unsafe { Inbox::open(self.base, self.len, epoch) }?;
        Some(sender.append(&env.to_envelope()).is_ok())
    }

    /// True if the owner sees an envelope waiting.
    pub fn has_entries(&self) -> bool {
        self.owner.has_entries()
    }

    /// Drains as the owner does: envelopes in order, each at most
    /// `max_payload` bytes of payload, until `take` declines one.
    pub fn drain(&self, max_payload: usize, mut take: impl FnMut(InboxEnvelope) -> bool) {
        self.owner.drain(max_payload, |e| take(InboxEnvelope::of(e)));
    }
}

/// The epoch of the fake target behind [`Server`].
pub const SERVER_EPOCH: u64 = 0x0bad_cafe;
/// Frame limits of the fake target.
pub const SERVER_LIMITS: Limits = Limits { max_body: 64 << 10, max_data: 1 << 20 };
/// Registrations of the fake target: raw id, bytes, writable by peers.
pub const SERVER_REGISTRATIONS: [(u64, usize, bool); 3] = [(1, 256, true), (2, 256, false), (3, 4096, true)];
/// Largest notification payload the fake target accepts.
pub const SERVER_MAX_NOTIFICATION: usize = 64;
/// The byte every read-only registration is filled with.
const READ_ONLY_FILL: u8 = 0x5a;

/// The memory behind the fake target's registrations.
struct FakeTarget {
    /// One buffer per registration, never resized (resolve hands out
    /// pointers into them, which the machine writes through).
    mem: Vec<Box<[UnsafeCell<u8>]>>,
    notifications: std::sync::atomic::AtomicUsize,
}

// SAFETY: the fuzz target drives one machine from one thread; the raw
// pointers resolve hands out point into `mem`, which lives as long as the
// machine that uses them.
unsafe impl Sync for FakeTarget {}

impl TargetView for FakeTarget {
    fn epoch(&self) -> u64 {
        SERVER_EPOCH
    }

    fn descriptor(&self) -> Vec<u8> {
        b"fake segment descriptor".to_vec()
    }

    /// One NIC: a card per card asked on it, kept by the connection; a
    /// card for another NIC is refused.
    fn rdma_connect(
        &self,
        _from: Option<std::net::IpAddr>,
        cards: &[crate::wire::QpCard],
    ) -> Result<(Vec<crate::wire::QpCard>, Box<dyn std::any::Any + Send>), (RemoteStatus, String)> {
        if cards.iter().any(|c| c.peer_nic != 0) {
            return Err((RemoteStatus::ResourceExhausted, "one NIC".into()));
        }
        let mine = cards.iter().map(|c| crate::wire::QpCard { nic: 0, peer_nic: c.nic, ..*c }).collect();
        Ok((mine, Box::new(cards.len())))
    }

    fn resolve(
        &self,
        req: &Request<'_>,
        write: bool,
        iovs: &mut Vec<libc::iovec>,
        _loans: &mut Vec<Arc<Registration>>,
    ) -> Result<(), (RemoteStatus, String)> {
        for d in req.descs() {
            let Some(i) = SERVER_REGISTRATIONS.iter().position(|r| r.0 == d.registration) else {
                return Err((RemoteStatus::UnknownRegistration, String::new()));
            };
            let (_, len, writable) = SERVER_REGISTRATIONS[i];
            if write && !writable {
                return Err((RemoteStatus::PermissionDenied, String::new()));
            }
            match d.offset.checked_add(d.len) {
                Some(end) if end <= len as u64 && d.len > 0 => {}
                _ => return Err((RemoteStatus::OutOfBounds, String::new())),
            }
            let base = UnsafeCell::raw_get(self.mem[i].as_ptr()) as u64 + d.offset;
            iovs.push(iov(base, d.len));
        }
        Ok(())
    }

    fn changes(&self, since: u64, budget: usize) -> Delta {
        // Removed ids cost 8 bytes each; stay within the budget as the
        // engine's registry does.
        let n = (budget / 8).min(4) as u64;
        let removed = (0..n).map(|i| since.wrapping_add(i)).collect();
        Delta { version: since.saturating_add(1), reset: since == 0, removed, ..Delta::default() }
    }

    fn registry_version(&self) -> u64 {
        1
    }

    fn limits(&self) -> Limits {
        SERVER_LIMITS
    }
}

impl TargetSide for FakeTarget {
    fn view(&self) -> &dyn TargetView {
        self
    }

    fn deliver(&self, env: &NotifyEnvelope<'_>) -> Result<(), (RemoteStatus, String)> {
        if env.payload.len() > SERVER_MAX_NOTIFICATION {
            return Err((RemoteStatus::NotificationTooLarge, String::new()));
        }
        self.notifications.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// What a run of the server machine produced.
#[derive(Debug, Default)]
pub struct ServerRun {
    /// Every byte the machine sent back, in order.
    pub replies: Vec<u8>,
    /// Why the connection closed, if it did.
    pub closed: Option<String>,
    /// Watch subscriptions the machine asked the driver for.
    pub subscriptions: usize,
    /// Whole frames the machine read.
    pub frames: u64,
}

/// The target side of one peer connection (the protocol machine the
/// engine's TCP server drives) in front of a fake target with three small
/// registrations.
pub struct Server {
    conn: ServerConn,
    side: FakeTarget,
    secret: Option<Arc<Secret>>,
}

impl Server {
    /// A machine with no secret, or one that demands a handshake proving
    /// `secret` (at least 16 bytes) before anything else.
    pub fn new(secret: Option<&[u8]>) -> Server {
        let secret = secret.map(|s| Arc::new(load_secret(s)));
        let mem = SERVER_REGISTRATIONS
            .iter()
            .map(|&(_, len, writable)| {
                let fill = if writable { 0 } else { READ_ONLY_FILL };
                (0..len).map(|_| UnsafeCell::new(fill)).collect()
            })
            .collect();
        Server {
            conn: ServerConn::new(
                Default::default(),
                secret.clone(),
                ConnEnd::Tcp(SERVER_ADDRESS.parse().expect("an address")),
                std::time::Instant::now(),
            ),
            side: FakeTarget { mem, notifications: Default::default() },
            secret,
        }
    }

    /// Authenticates the connection as an initiator that knows the secret
    /// would: true once the machine answered AuthOk. The replies of the
    /// handshake are consumed.
    pub fn handshake(&mut self, epoch_i: u64) -> bool {
        let Some(secret) = self.secret.clone() else { return false };
        let dialed = Dialed { name: SERVER_ADDRESS.into(), reached: SERVER_ADDRESS.parse().ok() };
        let handshake = Initiator::new(secret, epoch_i, None, &dialed, [7u8; wire::AUTH_NONCE]);
        let mut body = Vec::new();
        handshake.hello().encode(&mut body);
        let run = self.run(&frame(Kind::AuthHello, &body, 1), &[usize::MAX]);
        let Some((Kind::AuthChallenge, challenge)) = first_reply(&run.replies) else { return false };
        let Ok(challenge) = wire::AuthChallenge::decode(&challenge) else { return false };
        let Ok(proof) = handshake.on_challenge(&challenge) else { return false };
        let run = self.run(&frame(Kind::AuthProof, &proof, 2), &[usize::MAX]);
        matches!(first_reply(&run.replies), Some((Kind::AuthOk, _)))
    }

    /// Feeds `input` to the machine in pieces sized by `cuts` (cycled; a
    /// zero counts as one), taking its replies in pieces of the same sizes,
    /// until the input is used up or the connection closes.
    pub fn run(&mut self, input: &[u8], cuts: &[usize]) -> ServerRun {
        let mut cut = cuts.iter().map(|&c| c.max(1)).cycle();
        let mut next = || cut.next().unwrap_or(usize::MAX);
        let mut run = ServerRun::default();
        let mut pos = 0usize;
        loop {
            while let Some(iovs) = self.conn.send_buf() {
                let n = take_out(iovs, next(), &mut run.replies);
                self.conn.sent(n);
            }
            if pos == input.len() {
                break;
            }
            // Nothing waits to be sent (the loop above sent it all), so the
            // machine always has somewhere for the next bytes.
            let Some(iovs) = self.conn.recv_buf() else { break };
            let end = pos.saturating_add(next()).min(input.len());
            let n = put_in(iovs, &input[pos..end]);
            if n == 0 {
                break;
            }
            pos += n;
            match self.conn.received(n, &self.side) {
                Ok(event) => {
                    if crate::transport::server::perform(&mut self.conn, &self.side, event).is_some() {
                        run.subscriptions += 1;
                    }
                }
                Err(close) => {
                    // A refusal that closes the connection may still have
                    // queued a reply (an authentication error): send it.
                    while let Some(iovs) = self.conn.send_buf() {
                        let n = take_out(iovs, usize::MAX, &mut run.replies);
                        self.conn.sent(n);
                    }
                    run.closed = Some(format!("{close:?}"));
                    break;
                }
            }
        }
        run.frames = self.conn.frames();
        run
    }

    /// True while every byte of every read-only registration is as it was
    /// filled: no WRITE landed where peers may only read.
    pub fn read_only_intact(&self) -> bool {
        SERVER_REGISTRATIONS
            .iter()
            .zip(&self.side.mem)
            // SAFETY: no machine call runs during this one, so nothing
            // writes the cells while they are read.
            .all(|(r, m)| r.2 || m.iter().all(|b| unsafe { *b.get() } == READ_ONLY_FILL))
    }

    /// True between exchanges.
    pub fn is_idle(&self) -> bool {
        self.conn.is_idle()
    }
}

/// A header and body, as a peer would send them.
fn frame(kind: Kind, body: &[u8], request: u64) -> Vec<u8> {
    let mut out = wire::encode_header(&wire::header(kind, body.len(), 0, request)).to_vec();
    out.extend_from_slice(body);
    out
}

/// The kind and body of the first frame in `bytes`.
fn first_reply(bytes: &[u8]) -> Option<(Kind, Vec<u8>)> {
    let head: &[u8; wire::HEADER_LEN] = bytes.get(..wire::HEADER_LEN)?.try_into().ok()?;
    let h = wire::decode_header(head, Limits { max_body: u32::MAX, max_data: u32::MAX }).ok()?;
    let body = bytes.get(wire::HEADER_LEN..wire::HEADER_LEN + h.body_len as usize)?;
    Some((h.kind, body.to_vec()))
}

/// The address the fuzzed server's connection came in at (what an
/// initiator names in its hello).
pub const SERVER_ADDRESS: &str = "127.0.0.1:7000";

/// A secret as the engine loads it: from a file, which is removed again.
fn load_secret(bytes: &[u8]) -> Secret {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "orbite-fuzz-secret-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&path, bytes).expect("the temporary directory is writable");
    let secret = Secret::load(&path.to_string_lossy());
    let _ = std::fs::remove_file(&path);
    secret.expect("a secret of at least 16 bytes")
}

/// Copies `src` into the iovecs, in order; returns the bytes copied.
fn put_in(iovs: &[libc::iovec], src: &[u8]) -> usize {
    let mut done = 0;
    for v in iovs {
        let n = v.iov_len.min(src.len() - done);
        // SAFETY: the machine's receive iovecs address writable memory of
        // at least `iov_len` bytes (its own buffers, or the fake target's
        // memory that resolve checked).
        unsafe { std::ptr::copy_nonoverlapping(src[done..].as_ptr(), v.iov_base.cast::<u8>(), n) };
        done += n;
        if done == src.len() {
            break;
        }
    }
    done
}

/// Appends up to `max` bytes the iovecs address to `out`; returns how many.
fn take_out(iovs: &[libc::iovec], max: usize, out: &mut Vec<u8>) -> usize {
    let mut done = 0;
    for v in iovs {
        let n = v.iov_len.min(max - done);
        // SAFETY: the machine's send iovecs address readable memory of at
        // least `iov_len` bytes (its reply buffer, or the fake target's
        // memory that resolve checked).
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), n) });
        done += n;
        if done == max {
            break;
        }
    }
    done
}
