//! The wire codec between engines (sans-IO): frame headers and bodies.
//!
//! Every frame starts with a 24-byte header: magic, major and minor
//! version, kind, flags, body length, bulk-data length and a request id
//! (all little endian). Lengths are checked against limits before anything
//! is allocated; an unknown major version or kind is rejected. Bodies are
//! fixed layouts with exact lengths, so a decoder never guesses. Bulk data
//! (WRITE payloads, READ replies) follows the body and is never copied by
//! the codec: the I/O layer moves it straight between the socket and
//! registered memory.
//!
//! Input from the network is hostile: every function here returns a typed
//! error on bad input and never panics. Bytes are read with
//! [`crate::codec::Reader`].

use crate::codec::{self, Reader, Short};

/// `ORBT`.
pub const MAGIC: u32 = u32::from_be_bytes(*b"ORBT");
/// Major version: a peer with another major is refused.
pub const MAJOR: u8 = 1;
/// Minor version: additive changes (1: delta refresh and watch; 2: the
/// authentication hello names the responder, keepalives; 3: RDMA queue
/// pairs connected over the control connection).
pub const MINOR: u8 = 3;
/// Length of every frame header.
pub const HEADER_LEN: usize = 24;
/// Bytes of one remote descriptor in a request body.
pub const DESC_LEN: usize = 24;
/// Bytes before the descriptors of a READ or WRITE body.
pub const REQUEST_PREFIX_LEN: usize = 16;
/// Longest error detail carried in an error frame.
pub const MAX_ERROR_DETAIL: usize = 256;

/// Kind of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Initiator asks for the target's segment descriptor.
    Describe = 1,
    /// The segment descriptor.
    DescribeReply = 2,
    /// Write: descriptors in the body, payload as data.
    Write = 3,
    /// The payload landed and the target released its loans.
    WriteAck = 4,
    /// Read: descriptors in the body.
    Read = 5,
    /// The requested bytes as data.
    ReadReply = 6,
    /// A notification envelope.
    Notify = 7,
    /// The notification was queued at the target.
    NotifyAck = 8,
    /// A typed refusal of the request with the same id.
    Error = 9,
    /// Initiator of a one-sided route asks the target to keep registrations
    /// alive (fenced or not) until it returns them.
    Borrow = 10,
    /// The borrow is held.
    BorrowAck = 11,
    /// The initiator gives a borrow back.
    Return = 12,
    /// The borrow was dropped.
    ReturnAck = 13,
    /// Initiator asks what changed in the target's registrations after a
    /// registry version (a metadata refresh).
    DescribeSince = 14,
    /// One page of changes (`segment::Delta`).
    DescribeDelta = 15,
    /// Initiator asks to be told once the target's registry version passes
    /// the one given (on a connection of its own; answered when it does).
    Watch = 16,
    /// The target's registry version passed the watched one.
    Changed = 17,
    /// Authentication, first frame of a connection (initiator): its nonce
    /// and epoch.
    AuthHello = 18,
    /// The target's nonce and epoch, and its proof of the secret.
    AuthChallenge = 19,
    /// The initiator's proof of the secret.
    AuthProof = 20,
    /// The connection is authenticated.
    AuthOk = 21,
    /// Initiator, on the local socket only: hand over the shared
    /// allocations named (sealed memfds).
    ShareFds = 22,
    /// Per name whether its descriptor is attached (`SCM_RIGHTS`, with the
    /// reply's first byte, in the order of the names that have one).
    ShareFdsReply = 23,
    /// Initiator, on the local socket only: export the CUDA device
    /// registrations named as IPC handles (feature `cuda`).
    IpcHandles = 24,
    /// Per registration its IPC handle, or why not.
    IpcHandlesReply = 25,
    /// Initiator, on an idle connection (minor 2): it is alive. No body,
    /// no reply.
    Keepalive = 26,
    /// Initiator (minor 3): connect RDMA queue pairs, one per card, to
    /// the target's NICs.
    RdmaConnect = 27,
    /// The target's queue pair for each card, in order.
    RdmaAccept = 28,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Describe,
            2 => Kind::DescribeReply,
            3 => Kind::Write,
            4 => Kind::WriteAck,
            5 => Kind::Read,
            6 => Kind::ReadReply,
            7 => Kind::Notify,
            8 => Kind::NotifyAck,
            9 => Kind::Error,
            10 => Kind::Borrow,
            11 => Kind::BorrowAck,
            12 => Kind::Return,
            13 => Kind::ReturnAck,
            14 => Kind::DescribeSince,
            15 => Kind::DescribeDelta,
            16 => Kind::Watch,
            17 => Kind::Changed,
            18 => Kind::AuthHello,
            19 => Kind::AuthChallenge,
            20 => Kind::AuthProof,
            21 => Kind::AuthOk,
            22 => Kind::ShareFds,
            23 => Kind::ShareFdsReply,
            24 => Kind::IpcHandles,
            25 => Kind::IpcHandlesReply,
            26 => Kind::Keepalive,
            27 => Kind::RdmaConnect,
            28 => Kind::RdmaAccept,
            _ => return None,
        })
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Header {
    /// Frame kind.
    pub kind: Kind,
    /// Sender's minor version.
    pub minor: u8,
    /// Reserved flags (0).
    pub flags: u8,
    /// Bytes of body after the header.
    pub body_len: u32,
    /// Bytes of bulk data after the body.
    pub data_len: u32,
    /// Request id; replies echo it.
    pub request: u64,
}

/// Bounds applied before any allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest body.
    pub max_body: u32,
    /// Largest bulk data of one frame.
    pub max_data: u32,
}

/// Why a frame was refused. Any of these closes the connection it came on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not an OrbiTE frame.
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    /// A major version this build does not speak.
    #[error("unsupported major version {0}")]
    UnsupportedMajor(u8),
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A length beyond the limits.
    #[error("{what} of {len} bytes exceeds the limit of {limit}")]
    TooLong {
        /// Which length.
        what: &'static str,
        /// Its value.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// A body that does not have the layout its kind requires.
    #[error("malformed {0} body")]
    Malformed(&'static str),
    /// Bulk data after a frame of a kind that carries none.
    #[error("{len} bytes of data after a {kind:?} frame, which carries none")]
    UnexpectedData {
        /// The frame's kind.
        kind: Kind,
        /// The data length its header declared.
        len: u32,
    },
    /// A WRITE whose payload is not what its descriptors cover.
    #[error("a WRITE of {declared} payload bytes whose descriptors cover {described}")]
    PayloadMismatch {
        /// The data length its header declared.
        declared: u32,
        /// What its descriptors add up to.
        described: u64,
    },
    /// A frame of a kind that may not come here now (a reply sent to a
    /// server, a request in answer to one, a second handshake).
    #[error("a {0:?} frame is out of place here")]
    OutOfPlace(Kind),
    /// A reply answering another request than the one outstanding.
    #[error("reply to request {got} while {outstanding} was outstanding")]
    WrongRequest {
        /// The request id it echoes.
        got: u64,
        /// The one outstanding.
        outstanding: u64,
    },
    /// A reply listing another number of entries than were asked for.
    #[error("a {kind:?} with {answered} entries for {asked} asked")]
    CountMismatch {
        /// The reply's kind.
        kind: Kind,
        /// Entries asked for.
        asked: usize,
        /// Entries the reply has.
        answered: usize,
    },
}

/// Encodes a header.
pub fn encode_header(h: &Header) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[0..4].copy_from_slice(&MAGIC.to_be_bytes());
    b[4] = MAJOR;
    b[5] = h.minor;
    b[6] = h.kind as u8;
    b[7] = h.flags;
    b[8..12].copy_from_slice(&h.body_len.to_le_bytes());
    b[12..16].copy_from_slice(&h.data_len.to_le_bytes());
    b[16..24].copy_from_slice(&h.request.to_le_bytes());
    b
}

/// A header for `kind` with this build's minor version.
pub fn header(kind: Kind, body_len: usize, data_len: u64, request: u64) -> Header {
    Header { kind, minor: MINOR, flags: 0, body_len: body_len as u32, data_len: data_len as u32, request }
}

/// Decodes and bounds-checks a header.
pub fn decode_header(b: &[u8; HEADER_LEN], limits: Limits) -> Result<Header, WireError> {
    // The reads cover exactly HEADER_LEN bytes, so they cannot come up short.
    let (magic, [major, minor, kind, flags], body_len, data_len, request) =
        exact(b, "header", |r| Ok((r.array::<4>()?, r.array::<4>()?, r.u32()?, r.u32()?, r.u64()?)))?;
    let magic = u32::from_be_bytes(magic);
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    if major != MAJOR {
        return Err(WireError::UnsupportedMajor(major));
    }
    let kind = Kind::from_u8(kind).ok_or(WireError::UnknownKind(kind))?;
    if body_len > limits.max_body {
        return Err(WireError::TooLong { what: "body", len: body_len as u64, limit: limits.max_body as u64 });
    }
    if data_len > limits.max_data {
        return Err(WireError::TooLong { what: "data", len: data_len as u64, limit: limits.max_data as u64 });
    }
    Ok(Header { kind, minor, flags, body_len, data_len, request })
}

/// Reads all of `body` with `read`: any other length, or a check of `read`
/// that fails as [`Short`], is a malformed `what`.
pub(crate) fn exact<'a, T>(
    body: &'a [u8],
    what: &'static str,
    read: impl FnOnce(&mut Reader<'a>) -> Result<T, Short>,
) -> Result<T, WireError> {
    let mut r = Reader::new(body);
    match read(&mut r) {
        Ok(v) if r.is_empty() => Ok(v),
        _ => Err(WireError::Malformed(what)),
    }
}

/// Reads the front of `body` with `read` and returns what it left: too
/// short a body is a malformed `what`.
fn prefix<'a, T>(
    body: &'a [u8],
    what: &'static str,
    read: impl FnOnce(&mut Reader<'a>) -> Result<T, Short>,
) -> Result<(T, &'a [u8]), WireError> {
    let mut r = Reader::new(body);
    let v = read(&mut r).map_err(|_| WireError::Malformed(what))?;
    Ok((v, r.rest()))
}

/// One remote range named by a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteDesc {
    /// Raw registration id at the target (index and generation).
    pub registration: u64,
    /// Offset in that registration.
    pub offset: u64,
    /// Length.
    pub len: u64,
}

/// Writes a READ or WRITE body into `out` (cleared first). Returns the
/// total length the descriptors cover (saturating).
pub fn encode_request(out: &mut Vec<u8>, target_epoch: u64, descs: impl Iterator<Item = RemoteDesc>) -> u64 {
    out.clear();
    codec::put_u64(out, target_epoch);
    out.extend_from_slice(&[0u8; 8]); // count, patched below
    let mut n = 0u32;
    let mut total = 0u64;
    for d in descs {
        codec::put_u64(out, d.registration);
        codec::put_u64(out, d.offset);
        codec::put_u64(out, d.len);
        n += 1;
        total = total.saturating_add(d.len);
    }
    out[8..12].copy_from_slice(&n.to_le_bytes());
    total
}

/// A decoded READ or WRITE body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request<'a> {
    /// The epoch the initiator believes the target has.
    pub target_epoch: u64,
    descs: &'a [u8],
    /// The lengths' sum (`None` on overflow), summed once at decode.
    total: Option<u64>,
}

impl<'a> Request<'a> {
    /// Decodes a body; the layout must be exact.
    pub fn decode(body: &'a [u8]) -> Result<Self, WireError> {
        // Epoch, count, 4 reserved bytes: REQUEST_PREFIX_LEN.
        let ((target_epoch, count), descs) = prefix(body, "request", |r| {
            let v = (r.u64()?, r.u32()? as usize);
            r.take(4)?;
            Ok(v)
        })?;
        if count.checked_mul(DESC_LEN) != Some(descs.len()) || count == 0 {
            return Err(WireError::Malformed("request"));
        }
        let mut r = Request { target_epoch, descs, total: None };
        r.total = r.descs().try_fold(0u64, |acc, d| acc.checked_add(d.len));
        Ok(r)
    }

    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.descs.len() / DESC_LEN
    }

    /// Never true for a decoded request.
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }

    /// The descriptors.
    pub fn descs(&self) -> impl Iterator<Item = RemoteDesc> + 'a {
        // `descs` holds whole descriptors (checked by `decode`).
        let mut r = Reader::new(self.descs);
        std::iter::from_fn(move || {
            Some(RemoteDesc { registration: r.u64().ok()?, offset: r.u64().ok()?, len: r.u64().ok()? })
        })
    }

    /// Sum of the lengths, or `None` on overflow (summed at decode).
    pub fn total_len(&self) -> Option<u64> {
        self.total
    }
}

/// Flag of a Borrow frame: the borrower will write (not only read).
pub const BORROW_WRITE: u8 = 1;

/// Encodes a Borrow body: the borrow id, then a request body naming the
/// registrations (whole ranges) to keep.
pub fn encode_borrow(out: &mut Vec<u8>, borrow_id: u64, target_epoch: u64, descs: impl Iterator<Item = RemoteDesc>) {
    let mut req = Vec::new();
    encode_request(&mut req, target_epoch, descs);
    out.clear();
    codec::put_u64(out, borrow_id);
    out.extend_from_slice(&req);
}

/// Decodes a Borrow body.
fn decode_borrow(body: &[u8]) -> Result<(u64, Request<'_>), WireError> {
    let (borrow_id, request) = prefix(body, "borrow", Reader::u64)?;
    Ok((borrow_id, Request::decode(request)?))
}

/// Decodes a Return body (the borrow id).
fn decode_return(body: &[u8]) -> Result<u64, WireError> {
    exact(body, "return", Reader::u64)
}

/// Why a target refused a request (carried in an error frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum RemoteStatus {
    /// The request named another epoch of the target.
    EpochMismatch = 1,
    /// A registration id is not live at the target.
    UnknownRegistration = 2,
    /// A registration id is stale (generation mismatch).
    StaleRegistration = 3,
    /// A range is outside its registration.
    OutOfBounds = 4,
    /// A registration lacks the needed permission.
    PermissionDenied = 5,
    /// The request's lengths do not add up.
    BadLength = 6,
    /// A bounded resource at the target is exhausted.
    ResourceExhausted = 7,
    /// The notification is larger than the target accepts.
    NotificationTooLarge = 8,
    /// The target is closing.
    Closing = 9,
    /// The connection did not authenticate (or the target cannot).
    Unauthenticated = 10,
    /// Anything else.
    Other = 99,
}

impl RemoteStatus {
    /// Decodes a status code (unknown codes become `Other`).
    pub fn from_u16(v: u16) -> RemoteStatus {
        match v {
            1 => RemoteStatus::EpochMismatch,
            2 => RemoteStatus::UnknownRegistration,
            3 => RemoteStatus::StaleRegistration,
            4 => RemoteStatus::OutOfBounds,
            5 => RemoteStatus::PermissionDenied,
            6 => RemoteStatus::BadLength,
            7 => RemoteStatus::ResourceExhausted,
            8 => RemoteStatus::NotificationTooLarge,
            9 => RemoteStatus::Closing,
            10 => RemoteStatus::Unauthenticated,
            _ => RemoteStatus::Other,
        }
    }
}

/// Encodes an error body.
pub fn encode_error(out: &mut Vec<u8>, status: RemoteStatus, detail: &str) {
    let detail = &detail.as_bytes()[..detail.len().min(MAX_ERROR_DETAIL)];
    out.clear();
    codec::put_u16(out, status as u16);
    codec::put_u16(out, detail.len() as u16);
    out.extend_from_slice(detail);
}

/// Decodes an error body.
fn decode_error(body: &[u8]) -> Result<(RemoteStatus, String), WireError> {
    let ((status, n), detail) = prefix(body, "error", |r| Ok((r.u16()?, r.u16()? as usize)))?;
    if n > MAX_ERROR_DETAIL || detail.len() != n {
        return Err(WireError::Malformed("error"));
    }
    Ok((RemoteStatus::from_u16(status), String::from_utf8_lossy(detail).into_owned()))
}

/// Describe body: the initiator's identity and the target epoch it expects
/// (0: any).
pub fn encode_describe(out: &mut Vec<u8>, initiator_epoch: u64, expected_epoch: u64) {
    out.clear();
    codec::put_u64(out, initiator_epoch);
    codec::put_u64(out, expected_epoch);
}

/// Decodes a Describe body.
fn decode_describe(body: &[u8]) -> Result<(u64, u64), WireError> {
    exact(body, "describe", |r| Ok((r.u64()?, r.u64()?)))
}

/// A DescribeSince request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescribeSince {
    /// The initiator's epoch.
    pub initiator_epoch: u64,
    /// The target epoch the initiator expects.
    pub expected_epoch: u64,
    /// The registry version the initiator's view has.
    pub since: u64,
    /// Largest reply body the initiator accepts.
    pub max_reply: u64,
}

/// Encodes a DescribeSince body.
pub fn encode_describe_since(out: &mut Vec<u8>, d: &DescribeSince) {
    out.clear();
    for v in [d.initiator_epoch, d.expected_epoch, d.since, d.max_reply] {
        codec::put_u64(out, v);
    }
}

/// Decodes a DescribeSince body.
fn decode_describe_since(body: &[u8]) -> Result<DescribeSince, WireError> {
    exact(body, "describe-since", |r| {
        Ok(DescribeSince { initiator_epoch: r.u64()?, expected_epoch: r.u64()?, since: r.u64()?, max_reply: r.u64()? })
    })
}

/// A Watch body: the target epoch, the registry version the watcher's view
/// has, and the largest Changed body it accepts.
pub fn encode_watch(out: &mut Vec<u8>, target_epoch: u64, since: u64, max_reply: u64) {
    out.clear();
    for v in [target_epoch, since, max_reply] {
        codec::put_u64(out, v);
    }
}

/// Decodes a Watch body: (target epoch, since, largest reply).
fn decode_watch(body: &[u8]) -> Result<(u64, u64, u64), WireError> {
    exact(body, "watch", |r| Ok((r.u64()?, r.u64()?, r.u64()?)))
}

/// A Changed body: the target epoch, the registry version the changes are
/// computed from, then an encoded `segment::Delta` (what changed after
/// that version, as much as fits).
pub fn encode_changed(out: &mut Vec<u8>, target_epoch: u64, base: u64, delta: &[u8]) {
    out.clear();
    codec::put_u64(out, target_epoch);
    codec::put_u64(out, base);
    out.extend_from_slice(delta);
}

/// Decodes a Changed body: (target epoch, base version, delta bytes).
fn decode_changed(body: &[u8]) -> Result<(u64, u64, &[u8]), WireError> {
    let ((target_epoch, base), delta) = prefix(body, "changed", |r| Ok((r.u64()?, r.u64()?)))?;
    Ok((target_epoch, base, delta))
}

/// A notification envelope: sender identity, target epoch, payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotifyEnvelope<'a> {
    /// Sender's endpoint.
    pub sender_endpoint: &'a str,
    /// Sender's epoch.
    pub sender_epoch: u64,
    /// Epoch the sender believes the target has.
    pub target_epoch: u64,
    /// Arbitrary bytes.
    pub payload: &'a [u8],
}

/// Encodes a notification envelope body.
pub fn encode_notify(out: &mut Vec<u8>, env: &NotifyEnvelope<'_>) {
    out.clear();
    codec::put_u64(out, env.sender_epoch);
    codec::put_u64(out, env.target_epoch);
    let ep = env.sender_endpoint.as_bytes();
    codec::put_u16(out, ep.len() as u16);
    out.extend_from_slice(ep);
    out.extend_from_slice(env.payload);
}

/// Decodes a notification envelope body.
fn decode_notify(body: &[u8]) -> Result<NotifyEnvelope<'_>, WireError> {
    let ((sender_epoch, target_epoch, ep), payload) = prefix(body, "notify", |r| {
        let (sender_epoch, target_epoch) = (r.u64()?, r.u64()?);
        let n = r.u16()? as usize;
        Ok((sender_epoch, target_epoch, r.take(n)?))
    })?;
    let sender_endpoint = std::str::from_utf8(ep).map_err(|_| WireError::Malformed("notify"))?;
    Ok(NotifyEnvelope { sender_endpoint, sender_epoch, target_epoch, payload })
}

/// Bytes of an authentication nonce.
pub const AUTH_NONCE: usize = 32;
/// Bytes of an authentication proof (HMAC-SHA256).
pub const AUTH_MAC: usize = 32;
/// Longest endpoint name an AuthHello carries (a host name of 253 bytes,
/// `:` and a port; an IPv6 address in brackets; a local socket's name).
pub const MAX_AUTH_NAME: usize = 262;
/// Largest body a connection may send before it authenticated (the
/// longest AuthHello).
pub const AUTH_MAX_BODY: u32 = (AUTH_NONCE + 8 + 8 + 2 + MAX_AUTH_NAME + 2 + MAX_AUTH_NAME) as u32;

/// The initiator's first frame on a connection that authenticates: who it
/// is, and which responder it means (so that a proof made for one
/// responder authenticates no other connection).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AuthHello {
    /// The initiator's fresh nonce.
    pub nonce: [u8; AUTH_NONCE],
    /// The initiator's epoch.
    pub initiator_epoch: u64,
    /// The responder's epoch the initiator expects (0: not known yet).
    pub responder_epoch: u64,
    /// The endpoint the initiator dialed, as it was named: a tcp
    /// `host:port` (as the responder advertises it), or the local socket's
    /// name.
    pub dialed: String,
    /// The address the initiator's tcp connection reached, numeric
    /// (`ip:port`); empty on a local socket.
    pub reached: String,
}

impl AuthHello {
    /// Its body.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(&self.nonce);
        codec::put_u64(out, self.initiator_epoch);
        codec::put_u64(out, self.responder_epoch);
        for name in [&self.dialed, &self.reached] {
            let n = &name.as_bytes()[..name.len().min(MAX_AUTH_NAME)];
            codec::put_u16(out, n.len() as u16);
            out.extend_from_slice(n);
        }
    }

    /// Decodes an AuthHello body (names of at most [`MAX_AUTH_NAME`]
    /// bytes of UTF-8, nothing after them).
    pub fn decode(body: &[u8]) -> Result<AuthHello, WireError> {
        exact(body, "auth hello", |r| {
            let (nonce, initiator_epoch, responder_epoch) = (r.array()?, r.u64()?, r.u64()?);
            let mut name = || {
                let n = r.u16()? as usize;
                let b = if n > MAX_AUTH_NAME { Err(Short) } else { r.take(n) }?;
                String::from_utf8(b.to_vec()).map_err(|_| Short)
            };
            let (dialed, reached) = (name()?, name()?);
            Ok(AuthHello { nonce, initiator_epoch, responder_epoch, dialed, reached })
        })
    }
}

/// The responder's answer to an AuthHello: its nonce, its epoch and its
/// proof over the whole exchange so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AuthChallenge {
    /// The responder's fresh nonce.
    pub nonce: [u8; AUTH_NONCE],
    /// The responder's epoch.
    pub responder_epoch: u64,
    /// Its proof (`transport::auth`).
    pub mac: [u8; AUTH_MAC],
}

impl AuthChallenge {
    /// Its body.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(&self.nonce);
        codec::put_u64(out, self.responder_epoch);
        out.extend_from_slice(&self.mac);
    }

    /// Decodes an AuthChallenge body.
    pub fn decode(body: &[u8]) -> Result<AuthChallenge, WireError> {
        exact(body, "auth challenge", |r| {
            Ok(AuthChallenge { nonce: r.array()?, responder_epoch: r.u64()?, mac: r.array()? })
        })
    }
}

/// Decodes an AuthProof body.
fn decode_auth_proof(body: &[u8]) -> Result<[u8; AUTH_MAC], WireError> {
    body.try_into().map_err(|_| WireError::Malformed("auth proof"))
}

/// Most shared allocations one ShareFds names (under the kernel's
/// `SCM_MAX_FD` of 253 descriptors per message).
pub const MAX_SHARED_FDS: usize = 64;

/// Longest name of a shared allocation.
pub const MAX_SHARED_NAME: usize = 255;

/// ShareFds body: a count (2), then per name its length (2) and bytes.
pub fn encode_share_fds<'a>(out: &mut Vec<u8>, names: impl ExactSizeIterator<Item = &'a str>) {
    out.clear();
    codec::put_u16(out, names.len() as u16);
    for n in names {
        codec::put_u16(out, n.len() as u16);
        out.extend_from_slice(n.as_bytes());
    }
}

/// Decodes a ShareFds body: at most [`MAX_SHARED_FDS`] names, each
/// non-empty UTF-8 of at most [`MAX_SHARED_NAME`] bytes.
fn decode_share_fds(body: &[u8]) -> Result<Vec<&str>, WireError> {
    let (count, names) = prefix(body, "share fds", |r| r.u16())?;
    if count as usize > MAX_SHARED_FDS {
        return Err(WireError::TooLong {
            what: "shared allocations named",
            len: count as u64,
            limit: MAX_SHARED_FDS as u64,
        });
    }
    exact(names, "share fds", |r| {
        (0..count)
            .map(|_| match r.u16()? as usize {
                len @ 1..=MAX_SHARED_NAME => std::str::from_utf8(r.take(len)?).map_err(|_| Short),
                _ => Err(Short),
            })
            .collect()
    })
}

/// ShareFdsReply body: a count (2), then per name asked 1 if its
/// descriptor is attached, 0 if not.
pub fn encode_share_fds_reply(out: &mut Vec<u8>, attached: impl ExactSizeIterator<Item = bool>) {
    out.clear();
    codec::put_u16(out, attached.len() as u16);
    out.extend(attached.map(u8::from));
}

/// Decodes a ShareFdsReply body: per name asked whether its descriptor is
/// attached (at most [`MAX_SHARED_FDS`]).
fn decode_share_fds_reply(body: &[u8]) -> Result<Vec<bool>, WireError> {
    let (count, flags) = prefix(body, "share fds reply", |r| r.u16())?;
    let count = count as usize;
    if count > MAX_SHARED_FDS || flags.len() != count || flags.iter().any(|b| *b > 1) {
        return Err(WireError::Malformed("share fds reply"));
    }
    Ok(flags.iter().map(|b| *b == 1).collect())
}

/// Most registrations one IpcHandles names.
pub const MAX_IPC_HANDLES: usize = 1024;

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_LEN: usize = 64;

/// Longest encoding of one IpcHandlesReply entry: a refusal with the
/// longest reason (status, length, reason); an exported entry (status,
/// UUID, handle, offset, length) is shorter.
pub const IPC_ENTRY_MAX: usize = 1 + 2 + MAX_ERROR_DETAIL;
const _: () = assert!(1 + 16 + IPC_HANDLE_LEN + 16 <= IPC_ENTRY_MAX, "an exported entry fits the bound");

/// Flag of a Borrow frame: the borrower reaches CUDA device memory of the
/// target through an IPC mapping (asked on the local socket only).
pub const BORROW_DEVICE: u8 = 2;
/// Flag of a Borrow frame (minor 3): the borrower reaches the ranges with
/// RDMA through the target's memory regions (host or device memory, each
/// with a region).
pub const BORROW_RDMA: u8 = 4;

/// One registration's answer in an IpcHandlesReply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpcEntry {
    /// Exported: the allocation holding the registration, as an IPC
    /// handle, the device's UUID, and where the registration starts in the
    /// allocation.
    Exported {
        /// The UUID of the device the allocation is on (ordinals differ
        /// between processes).
        uuid: [u8; 16],
        /// The `CUipcMemHandle`.
        handle: [u8; IPC_HANDLE_LEN],
        /// Offset of the registration's first byte in the allocation.
        offset: u64,
        /// Bytes of the allocation (the importer checks its mapping
        /// against it, and the registration against both).
        alloc_len: u64,
    },
    /// Exported as a shareable handle of the virtual memory management
    /// API (memory made with `cuMemCreate`, which has no legacy handle): a
    /// POSIX file descriptor attached to the reply (`SCM_RIGHTS`, with its
    /// first byte, one per such entry, in entry order).
    Shareable {
        /// The UUID of the device the allocation is on.
        uuid: [u8; 16],
        /// Where the allocation is mapped in the exporter: entries with the
        /// same value name one allocation (the importer maps it once).
        alloc_base: u64,
        /// Offset of the registration's first byte in the allocation.
        offset: u64,
        /// Bytes of the allocation (the importer maps that many and checks
        /// the registration against its own mapping).
        alloc_len: u64,
    },
    /// Not exported, and why.
    Refused(String),
}

impl IpcEntry {
    /// Whether a descriptor comes with it.
    pub fn has_fd(&self) -> bool {
        matches!(self, IpcEntry::Shareable { .. })
    }
}

/// Most queue pairs one RdmaConnect asks for.
pub const MAX_RDMA_CARDS: usize = 64;
/// Bytes of one queue pair's card.
pub const CARD_LEN: usize = 32;

/// What one end of an RDMA queue pair tells the other: where the queue
/// pair is (GID and number), the first packet sequence number it sends,
/// its port's MTU, and which NICs of both engines it joins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCard {
    /// The GID its NIC's port sends from.
    pub gid: [u8; 16],
    /// The queue pair number (24 bits).
    pub qpn: u32,
    /// Its first packet sequence number (24 bits).
    pub psn: u32,
    /// Its port's MTU in bytes: 256, 512, 1024, 2048 or 4096.
    pub mtu: u32,
    /// The sender's NIC (its index among the sender's NICs).
    pub nic: u8,
    /// The receiver's NIC it connects to.
    pub peer_nic: u8,
}

/// Appends a count (2), 6 zero bytes, then the cards.
fn put_cards(out: &mut Vec<u8>, cards: &[QpCard]) {
    codec::put_u16(out, cards.len() as u16);
    out.extend_from_slice(&[0; 6]);
    for c in cards {
        out.extend_from_slice(&c.gid);
        codec::put_u32(out, c.qpn);
        codec::put_u32(out, c.psn);
        codec::put_u32(out, c.mtu);
        out.extend_from_slice(&[c.nic, c.peer_nic, 0, 0]);
    }
}

/// Reads what [`put_cards`] wrote: a short or nonzero count and padding is
/// a malformed `what`, a bad card a malformed card.
fn read_cards(body: &[u8], what: &'static str) -> Result<Vec<QpCard>, WireError> {
    let (count, cards) = prefix(body, what, |r| match (r.u16()?, r.array::<6>()?) {
        (count, pad) if pad == [0; 6] => Ok(count as usize),
        _ => Err(Short),
    })?;
    if count > MAX_RDMA_CARDS {
        return Err(WireError::TooLong { what: "rdma queue pairs", len: count as u64, limit: MAX_RDMA_CARDS as u64 });
    }
    exact(cards, "rdma queue pair card", |r| {
        (0..count)
            .map(|_| {
                let (gid, qpn, psn, mtu, [nic, peer_nic, p0, p1]) =
                    (r.array()?, r.u32()?, r.u32()?, r.u32()?, r.array()?);
                if qpn > 0xff_ffff
                    || psn > 0xff_ffff
                    || ![256, 512, 1024, 2048, 4096].contains(&mtu)
                    || (p0, p1) != (0, 0)
                {
                    return Err(Short);
                }
                Ok(QpCard { gid, qpn, psn, mtu, nic, peer_nic })
            })
            .collect()
    })
}

/// RdmaConnect body: the target epoch (8), a count (2), 6 zero bytes, then
/// the cards ([`CARD_LEN`] each).
pub fn encode_rdma_connect(out: &mut Vec<u8>, target_epoch: u64, cards: &[QpCard]) {
    out.clear();
    codec::put_u64(out, target_epoch);
    put_cards(out, cards);
}

fn decode_rdma_connect(body: &[u8]) -> Result<(u64, Vec<QpCard>), WireError> {
    let (epoch, cards) = prefix(body, "rdma connect", |r| r.u64())?;
    Ok((epoch, read_cards(cards, "rdma connect")?))
}

/// RdmaAccept body: a count (2), 6 zero bytes, then a card per card asked.
pub fn encode_rdma_accept(out: &mut Vec<u8>, cards: &[QpCard]) {
    out.clear();
    put_cards(out, cards);
}

/// Decodes an RdmaAccept body.
pub fn decode_rdma_accept(body: &[u8]) -> Result<Vec<QpCard>, WireError> {
    read_cards(body, "rdma accept")
}

/// IpcHandles body: the target epoch (8), a count (2), then the raw
/// registration ids (8 each).
pub fn encode_ipc_handles(out: &mut Vec<u8>, target_epoch: u64, ids: &[u64]) {
    out.clear();
    codec::put_u64(out, target_epoch);
    codec::put_u16(out, ids.len() as u16);
    for id in ids {
        codec::put_u64(out, *id);
    }
}

/// Decodes an IpcHandles body: at most [`MAX_IPC_HANDLES`] ids.
fn decode_ipc_handles(body: &[u8]) -> Result<(u64, Vec<u64>), WireError> {
    let ((epoch, count), ids) = prefix(body, "ipc handles", |r| Ok((r.u64()?, r.u16()? as usize)))?;
    if count > MAX_IPC_HANDLES {
        return Err(WireError::TooLong {
            what: "registrations named",
            len: count as u64,
            limit: MAX_IPC_HANDLES as u64,
        });
    }
    Ok((epoch, exact(ids, "ipc handles", |r| (0..count).map(|_| r.u64()).collect())?))
}

/// IpcHandlesReply body: a count (2), then per registration a status (1:
/// 0 exported, 1 refused, 2 shareable) and, if exported, the device UUID
/// (16), the handle (64), the offset (8) and the allocation's length (8);
/// if refused, a reason length (2, at most [`MAX_ERROR_DETAIL`]) and the
/// reason (UTF-8); if shareable, the device UUID (16), the allocation's
/// address in the exporter (8), the offset (8) and the allocation's length
/// (8), its descriptor attached to the reply. At most
/// [`MAX_SHARED_FDS`] entries are shareable.
pub fn encode_ipc_handles_reply(out: &mut Vec<u8>, entries: &[IpcEntry]) {
    out.clear();
    codec::put_u16(out, entries.len() as u16);
    for e in entries {
        match e {
            IpcEntry::Exported { uuid, handle, offset, alloc_len } => {
                out.push(0);
                out.extend_from_slice(uuid);
                out.extend_from_slice(handle);
                codec::put_u64(out, *offset);
                codec::put_u64(out, *alloc_len);
            }
            IpcEntry::Shareable { uuid, alloc_base, offset, alloc_len } => {
                out.push(2);
                out.extend_from_slice(uuid);
                codec::put_u64(out, *alloc_base);
                codec::put_u64(out, *offset);
                codec::put_u64(out, *alloc_len);
            }
            IpcEntry::Refused(why) => {
                let why = truncate_detail(why);
                out.push(1);
                codec::put_u16(out, why.len() as u16);
                out.extend_from_slice(why.as_bytes());
            }
        }
    }
}

/// The longest prefix of `s` of at most [`MAX_ERROR_DETAIL`] bytes that
/// ends on a character boundary.
fn truncate_detail(s: &str) -> &str {
    let mut end = s.len().min(MAX_ERROR_DETAIL);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Decodes an IpcHandlesReply (at most [`MAX_IPC_HANDLES`] entries). An
/// exported or shareable entry whose offset lies outside its allocation is
/// malformed, and so are more than [`MAX_SHARED_FDS`] shareable entries.
fn decode_ipc_handles_reply(body: &[u8]) -> Result<Vec<IpcEntry>, WireError> {
    exact(body, "ipc handles reply", |r| {
        let asked = r.u16()? as usize;
        if asked > MAX_IPC_HANDLES {
            return Err(Short);
        }
        let mut out = Vec::with_capacity(asked);
        let mut shareable = 0;
        for _ in 0..asked {
            match r.u8()? {
                0 => {
                    let (uuid, handle, offset, alloc_len) = (r.array()?, r.array()?, r.u64()?, r.u64()?);
                    if offset >= alloc_len {
                        return Err(Short);
                    }
                    out.push(IpcEntry::Exported { uuid, handle, offset, alloc_len });
                }
                2 => {
                    let (uuid, alloc_base, offset, alloc_len) = (r.array()?, r.u64()?, r.u64()?, r.u64()?);
                    if offset >= alloc_len || shareable == MAX_SHARED_FDS {
                        return Err(Short);
                    }
                    shareable += 1;
                    out.push(IpcEntry::Shareable { uuid, alloc_base, offset, alloc_len });
                }
                1 => {
                    let n = r.u16()? as usize;
                    let why = if n > MAX_ERROR_DETAIL { Err(Short) } else { r.take(n) }?;
                    out.push(IpcEntry::Refused(std::str::from_utf8(why).map_err(|_| Short)?.to_owned()));
                }
                _ => return Err(Short),
            }
        }
        Ok(out)
    })
}

/// One frame's body, decoded by the kind its header names: every message
/// of the protocol, each with its fields. [`Message::decode`] is the one
/// decoder of frame bodies (segment descriptors and deltas, which travel in
/// DescribeReply, DescribeDelta and Changed, are left to
/// `crate::segment`); [`Message::encode`] writes the body back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message<'a> {
    /// The initiator asks for the segment descriptor.
    Describe {
        /// The initiator's epoch.
        initiator_epoch: u64,
        /// The target epoch it expects (0: any).
        expected_epoch: u64,
    },
    /// An encoded segment descriptor.
    DescribeReply(&'a [u8]),
    /// A WRITE: its payload (as long as the descriptors cover) follows.
    Write(Request<'a>),
    /// The WRITE's payload landed.
    WriteAck,
    /// A READ.
    Read(Request<'a>),
    /// The READ's bytes follow as the frame's data.
    ReadReply,
    /// A notification.
    Notify(NotifyEnvelope<'a>),
    /// The notification was queued.
    NotifyAck,
    /// A typed refusal of the request with the same id.
    Error {
        /// Why.
        status: RemoteStatus,
        /// The target's words (lossy UTF-8, at most [`MAX_ERROR_DETAIL`]
        /// bytes as sent).
        detail: String,
    },
    /// Keep registrations alive until returned.
    Borrow {
        /// The borrower's id for it.
        id: u64,
        /// The registrations (whole ranges).
        request: Request<'a>,
        /// The borrower will write ([`BORROW_WRITE`]).
        write: bool,
        /// Device memory through CUDA IPC ([`BORROW_DEVICE`]).
        device: bool,
        /// Ranges reached with RDMA ([`BORROW_RDMA`]).
        rdma: bool,
    },
    /// The borrow is held.
    BorrowAck,
    /// The borrow is given back.
    Return {
        /// The borrower's id for it.
        id: u64,
    },
    /// The borrow was dropped.
    ReturnAck,
    /// What changed after a registry version.
    DescribeSince(DescribeSince),
    /// One page of changes (an encoded `segment::Delta`).
    DescribeDelta(&'a [u8]),
    /// Tell once the registry passes a version.
    Watch {
        /// The target epoch.
        target_epoch: u64,
        /// The registry version the watcher's view has.
        since: u64,
        /// The largest Changed body it accepts.
        max_reply: u64,
    },
    /// The registry passed the watched version.
    Changed {
        /// The target epoch.
        target_epoch: u64,
        /// The version the changes start after.
        base: u64,
        /// An encoded `segment::Delta`.
        delta: &'a [u8],
    },
    /// Authentication: the initiator's hello.
    AuthHello(AuthHello),
    /// Authentication: the responder's challenge and proof.
    AuthChallenge(AuthChallenge),
    /// Authentication: the initiator's proof.
    AuthProof([u8; AUTH_MAC]),
    /// Authenticated.
    AuthOk,
    /// Hand over the shared allocations named.
    ShareFds(Vec<&'a str>),
    /// Per name asked, whether its descriptor is attached.
    ShareFdsReply(Vec<bool>),
    /// Export the device registrations named as IPC handles.
    IpcHandles {
        /// The target epoch.
        target_epoch: u64,
        /// Raw registration ids.
        ids: Vec<u64>,
    },
    /// Per registration asked, its handle or why not.
    IpcHandlesReply(Vec<IpcEntry>),
    /// The initiator is alive.
    Keepalive,
    /// Connect RDMA queue pairs.
    RdmaConnect {
        /// The target epoch.
        target_epoch: u64,
        /// The initiator's queue pairs.
        cards: Vec<QpCard>,
    },
    /// The target's queue pairs, one per card asked.
    RdmaAccept(Vec<QpCard>),
}

impl<'a> Message<'a> {
    /// Decodes the body of the frame `h` heads, and checks what the header
    /// says besides: only a WRITE (exactly what its descriptors cover) and
    /// a ReadReply (with an empty body) carry data, and only a Borrow has
    /// flags. The layout of every body is exact.
    pub fn decode(h: &Header, body: &'a [u8]) -> Result<Message<'a>, WireError> {
        let empty = |what: &'static str| if body.is_empty() { Ok(()) } else { Err(WireError::Malformed(what)) };
        if h.flags & !(BORROW_WRITE | BORROW_DEVICE | BORROW_RDMA) != 0 || (h.flags != 0 && h.kind != Kind::Borrow) {
            let what = if h.kind == Kind::Borrow { "borrow flags" } else { "flags" };
            return Err(WireError::Malformed(what));
        }
        let m = match h.kind {
            Kind::Describe => {
                let (initiator_epoch, expected_epoch) = decode_describe(body)?;
                Message::Describe { initiator_epoch, expected_epoch }
            }
            Kind::DescribeReply => Message::DescribeReply(body),
            Kind::Write => {
                let request = Request::decode(body)?;
                let described = request.total_len().ok_or(WireError::Malformed("request"))?;
                if described != h.data_len as u64 {
                    return Err(WireError::PayloadMismatch { declared: h.data_len, described });
                }
                return Ok(Message::Write(request));
            }
            Kind::WriteAck => empty("write ack").map(|()| Message::WriteAck)?,
            Kind::Read => {
                let request = Request::decode(body)?;
                request.total_len().ok_or(WireError::Malformed("request"))?;
                Message::Read(request)
            }
            Kind::ReadReply => {
                empty("read reply")?;
                return Ok(Message::ReadReply);
            }
            Kind::Notify => Message::Notify(decode_notify(body)?),
            Kind::NotifyAck => empty("notify ack").map(|()| Message::NotifyAck)?,
            Kind::Error => {
                let (status, detail) = decode_error(body)?;
                Message::Error { status, detail }
            }
            Kind::Borrow => {
                let (id, request) = decode_borrow(body)?;
                let (write, device) = (h.flags & BORROW_WRITE != 0, h.flags & BORROW_DEVICE != 0);
                Message::Borrow { id, request, write, device, rdma: h.flags & BORROW_RDMA != 0 }
            }
            Kind::BorrowAck => empty("borrow ack").map(|()| Message::BorrowAck)?,
            Kind::Return => Message::Return { id: decode_return(body)? },
            Kind::ReturnAck => empty("return ack").map(|()| Message::ReturnAck)?,
            Kind::DescribeSince => Message::DescribeSince(decode_describe_since(body)?),
            Kind::DescribeDelta => Message::DescribeDelta(body),
            Kind::Watch => {
                let (target_epoch, since, max_reply) = decode_watch(body)?;
                Message::Watch { target_epoch, since, max_reply }
            }
            Kind::Changed => {
                let (target_epoch, base, delta) = decode_changed(body)?;
                Message::Changed { target_epoch, base, delta }
            }
            Kind::AuthHello => Message::AuthHello(AuthHello::decode(body)?),
            Kind::AuthChallenge => Message::AuthChallenge(AuthChallenge::decode(body)?),
            Kind::AuthProof => Message::AuthProof(decode_auth_proof(body)?),
            Kind::AuthOk => empty("auth ok").map(|()| Message::AuthOk)?,
            Kind::ShareFds => Message::ShareFds(decode_share_fds(body)?),
            Kind::ShareFdsReply => Message::ShareFdsReply(decode_share_fds_reply(body)?),
            Kind::IpcHandles => {
                let (target_epoch, ids) = decode_ipc_handles(body)?;
                Message::IpcHandles { target_epoch, ids }
            }
            Kind::IpcHandlesReply => Message::IpcHandlesReply(decode_ipc_handles_reply(body)?),
            Kind::Keepalive => empty("keepalive").map(|()| Message::Keepalive)?,
            Kind::RdmaConnect => {
                let (target_epoch, cards) = decode_rdma_connect(body)?;
                Message::RdmaConnect { target_epoch, cards }
            }
            Kind::RdmaAccept => Message::RdmaAccept(decode_rdma_accept(body)?),
        };
        if h.data_len != 0 {
            return Err(WireError::UnexpectedData { kind: h.kind, len: h.data_len });
        }
        Ok(m)
    }

    /// Its kind.
    pub fn kind(&self) -> Kind {
        match self {
            Message::Describe { .. } => Kind::Describe,
            Message::DescribeReply(_) => Kind::DescribeReply,
            Message::Write(_) => Kind::Write,
            Message::WriteAck => Kind::WriteAck,
            Message::Read(_) => Kind::Read,
            Message::ReadReply => Kind::ReadReply,
            Message::Notify(_) => Kind::Notify,
            Message::NotifyAck => Kind::NotifyAck,
            Message::Error { .. } => Kind::Error,
            Message::Borrow { .. } => Kind::Borrow,
            Message::BorrowAck => Kind::BorrowAck,
            Message::Return { .. } => Kind::Return,
            Message::ReturnAck => Kind::ReturnAck,
            Message::DescribeSince(_) => Kind::DescribeSince,
            Message::DescribeDelta(_) => Kind::DescribeDelta,
            Message::Watch { .. } => Kind::Watch,
            Message::Changed { .. } => Kind::Changed,
            Message::AuthHello(_) => Kind::AuthHello,
            Message::AuthChallenge(_) => Kind::AuthChallenge,
            Message::AuthProof(_) => Kind::AuthProof,
            Message::AuthOk => Kind::AuthOk,
            Message::ShareFds(_) => Kind::ShareFds,
            Message::ShareFdsReply(_) => Kind::ShareFdsReply,
            Message::IpcHandles { .. } => Kind::IpcHandles,
            Message::IpcHandlesReply(_) => Kind::IpcHandlesReply,
            Message::Keepalive => Kind::Keepalive,
            Message::RdmaConnect { .. } => Kind::RdmaConnect,
            Message::RdmaAccept(_) => Kind::RdmaAccept,
        }
    }

    /// The flags its header carries.
    pub fn flags(&self) -> u8 {
        match self {
            Message::Borrow { write, device, rdma, .. } => {
                (if *write { BORROW_WRITE } else { 0 })
                    | (if *device { BORROW_DEVICE } else { 0 })
                    | (if *rdma { BORROW_RDMA } else { 0 })
            }
            _ => 0,
        }
    }

    /// Writes its body into `out` (cleared first).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        match self {
            Message::Describe { initiator_epoch, expected_epoch } => {
                encode_describe(out, *initiator_epoch, *expected_epoch)
            }
            Message::DescribeReply(b) | Message::DescribeDelta(b) => out.extend_from_slice(b),
            Message::Write(r) | Message::Read(r) => {
                encode_request(out, r.target_epoch, r.descs());
            }
            Message::WriteAck
            | Message::ReadReply
            | Message::NotifyAck
            | Message::BorrowAck
            | Message::ReturnAck
            | Message::AuthOk
            | Message::Keepalive => {}
            Message::Notify(env) => encode_notify(out, env),
            Message::Error { status, detail } => encode_error(out, *status, detail),
            Message::Borrow { id, request, .. } => encode_borrow(out, *id, request.target_epoch, request.descs()),
            Message::Return { id } => codec::put_u64(out, *id),
            Message::DescribeSince(d) => encode_describe_since(out, d),
            Message::Watch { target_epoch, since, max_reply } => encode_watch(out, *target_epoch, *since, *max_reply),
            Message::Changed { target_epoch, base, delta } => encode_changed(out, *target_epoch, *base, delta),
            Message::AuthHello(hello) => hello.encode(out),
            Message::AuthChallenge(c) => c.encode(out),
            Message::AuthProof(mac) => out.extend_from_slice(mac),
            Message::ShareFds(names) => encode_share_fds(out, names.iter().copied()),
            Message::ShareFdsReply(attached) => encode_share_fds_reply(out, attached.iter().copied()),
            Message::IpcHandles { target_epoch, ids } => encode_ipc_handles(out, *target_epoch, ids),
            Message::IpcHandlesReply(entries) => encode_ipc_handles_reply(out, entries),
            Message::RdmaConnect { target_epoch, cards } => encode_rdma_connect(out, *target_epoch, cards),
            Message::RdmaAccept(cards) => encode_rdma_accept(out, cards),
        }
    }
}

/// Checks that a reply of `kind` answers as many entries as were `asked`.
pub fn expect_count(kind: Kind, asked: usize, answered: usize) -> Result<(), WireError> {
    if asked == answered { Ok(()) } else { Err(WireError::CountMismatch { kind, asked, answered }) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ShareFdsReply body answering `asked` names.
    fn share_reply(body: &[u8], asked: usize) -> Result<Vec<bool>, WireError> {
        let v = decode_share_fds_reply(body)?;
        expect_count(Kind::ShareFdsReply, asked, v.len())?;
        Ok(v)
    }

    /// An IpcHandlesReply body answering `asked` registrations.
    fn ipc_reply(body: &[u8], asked: usize) -> Result<Vec<IpcEntry>, WireError> {
        let v = decode_ipc_handles_reply(body)?;
        expect_count(Kind::IpcHandlesReply, asked, v.len())?;
        Ok(v)
    }
    use proptest::prelude::*;

    #[test]
    fn share_fds_round_trip_and_bounds() {
        let mut b = Vec::new();
        encode_share_fds(&mut b, ["orbite-1-0", "orbite-1-1"].into_iter());
        assert_eq!(decode_share_fds(&b).unwrap(), vec!["orbite-1-0", "orbite-1-1"]);
        assert!(decode_share_fds(&b[..b.len() - 1]).is_err());
        let mut long = b.clone();
        long.push(0);
        assert!(decode_share_fds(&long).is_err());
        let many: Vec<String> = (0..=MAX_SHARED_FDS).map(|i| format!("n{i}")).collect();
        encode_share_fds(&mut b, many.iter().map(String::as_str));
        assert!(decode_share_fds(&b).is_err());
        assert!(decode_share_fds(&[1, 0, 0, 0]).is_err(), "an empty name");
        encode_share_fds_reply(&mut b, [true, false].into_iter());
        assert_eq!(share_reply(&b, 2).unwrap(), vec![true, false]);
        assert!(share_reply(&b, 3).is_err(), "an answer for other names");
        assert!(share_reply(&[1, 0, 2], 1).is_err());
    }

    /// One message of every kind.
    fn samples() -> Vec<Message<'static>> {
        let req: &'static [u8] = Box::leak({
            let mut b = Vec::new();
            encode_request(&mut b, 9, [RemoteDesc { registration: 1, offset: 2, len: 3 }].into_iter());
            b.into_boxed_slice()
        });
        let request = Request::decode(req).unwrap();
        vec![
            Message::Describe { initiator_epoch: 1, expected_epoch: 2 },
            Message::DescribeReply(b"descriptor"),
            Message::Write(request),
            Message::WriteAck,
            Message::Read(request),
            Message::ReadReply,
            Message::Notify(NotifyEnvelope { sender_endpoint: "h:1", sender_epoch: 1, target_epoch: 2, payload: b"x" }),
            Message::NotifyAck,
            Message::Error { status: RemoteStatus::OutOfBounds, detail: "far".into() },
            Message::Borrow { id: 4, request, write: true, device: false, rdma: false },
            Message::Borrow { id: 4, request, write: false, device: true, rdma: false },
            Message::Borrow { id: 4, request, write: true, device: false, rdma: true },
            Message::BorrowAck,
            Message::Return { id: 4 },
            Message::ReturnAck,
            Message::DescribeSince(DescribeSince { initiator_epoch: 1, expected_epoch: 2, since: 3, max_reply: 4 }),
            Message::DescribeDelta(b"delta"),
            Message::Watch { target_epoch: 1, since: 2, max_reply: 3 },
            Message::Changed { target_epoch: 1, base: 2, delta: b"delta" },
            Message::AuthHello(AuthHello {
                nonce: [1; AUTH_NONCE],
                initiator_epoch: 1,
                responder_epoch: 2,
                dialed: "h:1".into(),
                reached: "127.0.0.1:1".into(),
            }),
            Message::AuthChallenge(AuthChallenge { nonce: [2; AUTH_NONCE], responder_epoch: 2, mac: [3; AUTH_MAC] }),
            Message::AuthProof([4; AUTH_MAC]),
            Message::AuthOk,
            Message::ShareFds(vec!["a", "bc"]),
            Message::ShareFdsReply(vec![true, false]),
            Message::IpcHandles { target_epoch: 1, ids: vec![5, 6] },
            Message::IpcHandlesReply(vec![IpcEntry::Refused("no".into())]),
            Message::Keepalive,
            Message::RdmaConnect { target_epoch: 7, cards: vec![card(), QpCard { nic: 1, ..card() }] },
            Message::RdmaAccept(vec![card()]),
        ]
    }

    fn card() -> QpCard {
        QpCard { gid: [9; 16], qpn: 0x12_3456, psn: 0xab_cdef, mtu: 4096, nic: 0, peer_nic: 1 }
    }

    /// A queue pair's card is checked field by field: 24-bit numbers, an
    /// MTU verbs knows, zero padding; and a peer asks for at most
    /// `MAX_RDMA_CARDS` queue pairs.
    #[test]
    fn rdma_cards_are_checked_and_bounded() {
        let mut body = Vec::new();
        encode_rdma_connect(&mut body, 7, &[card()]);
        assert_eq!(decode_rdma_connect(&body), Ok((7, vec![card()])));
        let bad_cards = [
            QpCard { qpn: 1 << 24, ..card() },
            QpCard { psn: 1 << 24, ..card() },
            QpCard { mtu: 1500, ..card() },
            QpCard { mtu: 8192, ..card() },
        ];
        for c in bad_cards {
            encode_rdma_connect(&mut body, 7, &[c]);
            assert!(decode_rdma_connect(&body).is_err(), "{c:?}");
            encode_rdma_accept(&mut body, &[c]);
            assert!(decode_rdma_accept(&body).is_err(), "{c:?}");
        }
        encode_rdma_accept(&mut body, &[card()]);
        let mut padded = body.clone();
        *padded.last_mut().unwrap() = 1;
        assert!(decode_rdma_accept(&padded).is_err(), "card padding");
        let mut header_pad = body.clone();
        header_pad[3] = 1;
        assert!(decode_rdma_accept(&header_pad).is_err(), "header padding");
        assert!(decode_rdma_accept(&body[..body.len() - 1]).is_err(), "short");
        let many = vec![card(); MAX_RDMA_CARDS + 1];
        encode_rdma_connect(&mut body, 7, &many);
        assert!(matches!(decode_rdma_connect(&body), Err(WireError::TooLong { .. })));
        encode_rdma_connect(&mut body, 7, &many[..MAX_RDMA_CARDS]);
        assert_eq!(decode_rdma_connect(&body).unwrap().1.len(), MAX_RDMA_CARDS);
    }

    #[test]
    fn every_message_decodes_to_what_was_encoded_and_data_goes_only_where_it_belongs() {
        let mut kinds = std::collections::HashSet::new();
        let mut body = Vec::new();
        for m in samples() {
            m.encode(&mut body);
            let data = match &m {
                Message::Write(r) => r.total_len().unwrap(),
                _ => 0,
            };
            let mut h = header(m.kind(), body.len(), data, 1);
            h.flags = m.flags();
            assert_eq!(Message::decode(&h, &body), Ok(m.clone()), "{:?}", m.kind());
            kinds.insert(m.kind() as u8);
            if !matches!(m, Message::Write(_) | Message::ReadReply) {
                let with_data = Header { data_len: 1, ..h };
                assert_eq!(
                    Message::decode(&with_data, &body),
                    Err(WireError::UnexpectedData { kind: m.kind(), len: 1 }),
                    "{:?}",
                    m.kind()
                );
            }
            if !matches!(m, Message::Borrow { .. }) {
                assert_eq!(Message::decode(&Header { flags: 1, ..h }, &body), Err(WireError::Malformed("flags")));
            }
            let mut longer = body.clone();
            longer.push(0);
            let longer_h = Header { body_len: longer.len() as u32, ..h };
            // Bodies whose tail is opaque bytes (a payload, a delta, a
            // descriptor) take any length; every other layout is exact.
            let open_tail = matches!(
                m,
                Message::DescribeReply(_) | Message::DescribeDelta(_) | Message::Changed { .. } | Message::Notify(_)
            );
            if !open_tail {
                assert!(Message::decode(&longer_h, &longer).is_err(), "{:?} with a byte more", m.kind());
            }
        }
        assert_eq!(kinds.len(), 28, "every kind has a sample");
        let mut body = Vec::new();
        Message::Write(
            Request::decode(&{
                let mut b = Vec::new();
                encode_request(&mut b, 9, [RemoteDesc { registration: 1, offset: 0, len: 16 }].into_iter());
                b
            })
            .unwrap(),
        )
        .encode(&mut body);
        assert_eq!(
            Message::decode(&header(Kind::Write, body.len(), 15, 1), &body),
            Err(WireError::PayloadMismatch { declared: 15, described: 16 })
        );
        assert_eq!(
            expect_count(Kind::ShareFdsReply, 2, 1),
            Err(WireError::CountMismatch { kind: Kind::ShareFdsReply, asked: 2, answered: 1 })
        );
    }

    const LIMITS: Limits = Limits { max_body: 1 << 20, max_data: 16 << 20 };

    #[test]
    fn header_round_trip_and_rejections() {
        let h = header(Kind::Write, 40, 4096, 77);
        assert_eq!(decode_header(&encode_header(&h), LIMITS), Ok(h));
        let mut b = encode_header(&h);
        b[0] = b'X';
        assert!(matches!(decode_header(&b, LIMITS), Err(WireError::BadMagic(_))));
        let mut b = encode_header(&h);
        b[4] = 2;
        assert_eq!(decode_header(&b, LIMITS), Err(WireError::UnsupportedMajor(2)));
        let mut b = encode_header(&h);
        b[6] = 200;
        assert_eq!(decode_header(&b, LIMITS), Err(WireError::UnknownKind(200)));
        let big = header(Kind::Write, 40, u32::MAX as u64, 1);
        assert!(matches!(decode_header(&encode_header(&big), LIMITS), Err(WireError::TooLong { what: "data", .. })));
        let big = header(Kind::Notify, u32::MAX as usize, 0, 1);
        assert!(matches!(decode_header(&encode_header(&big), LIMITS), Err(WireError::TooLong { what: "body", .. })));
    }

    #[test]
    fn request_round_trip() {
        let descs = [
            RemoteDesc { registration: 5, offset: 1, len: 2 },
            RemoteDesc { registration: 1 << 40, offset: u64::MAX, len: 3 },
        ];
        let mut out = Vec::new();
        assert_eq!(encode_request(&mut out, 9, descs.iter().copied()), 5);
        let r = Request::decode(&out).unwrap();
        assert_eq!(r.target_epoch, 9);
        assert_eq!(r.descs().collect::<Vec<_>>(), descs);
        assert_eq!(r.total_len(), Some(5));
        assert!(Request::decode(&out[..out.len() - 1]).is_err());
        let mut overflow = Vec::new();
        encode_request(
            &mut overflow,
            1,
            [u64::MAX, 1].map(|len| RemoteDesc { registration: 0, offset: 0, len }).into_iter(),
        );
        assert_eq!(Request::decode(&overflow).unwrap().total_len(), None);
    }

    #[test]
    fn ipc_handles_round_trip_and_bad_replies_are_refused() {
        let mut out = Vec::new();
        encode_ipc_handles(&mut out, 7, &[1, 2, 3]);
        assert_eq!(decode_ipc_handles(&out).unwrap(), (7, vec![1, 2, 3]));
        assert!(decode_ipc_handles(&out[..out.len() - 1]).is_err(), "short");
        let entries = vec![
            IpcEntry::Exported { uuid: [3; 16], handle: [9; IPC_HANDLE_LEN], offset: 4096, alloc_len: 8192 },
            IpcEntry::Refused("not device memory".into()),
        ];
        encode_ipc_handles_reply(&mut out, &entries);
        assert_eq!(ipc_reply(&out, 2).unwrap(), entries);
        assert!(ipc_reply(&out, 1).is_err(), "another count");
        let mut extra = out.clone();
        extra.push(0);
        assert!(ipc_reply(&extra, 2).is_err(), "trailing bytes");
        let outside =
            [IpcEntry::Exported { uuid: [0; 16], handle: [0; IPC_HANDLE_LEN], offset: 8192, alloc_len: 8192 }];
        encode_ipc_handles_reply(&mut out, &outside);
        assert!(ipc_reply(&out, 1).is_err(), "an offset outside its allocation");
        let shareable = vec![
            IpcEntry::Shareable { uuid: [4; 16], alloc_base: 1 << 40, offset: 12, alloc_len: 2 << 20 },
            IpcEntry::Refused("no handle".into()),
            IpcEntry::Exported { uuid: [3; 16], handle: [9; IPC_HANDLE_LEN], offset: 0, alloc_len: 8192 },
        ];
        encode_ipc_handles_reply(&mut out, &shareable);
        assert_eq!(ipc_reply(&out, 3).unwrap(), shareable);
        assert_eq!(shareable.iter().filter(|e| e.has_fd()).count(), 1);
        let outside = [IpcEntry::Shareable { uuid: [0; 16], alloc_base: 0, offset: 4096, alloc_len: 4096 }];
        encode_ipc_handles_reply(&mut out, &outside);
        assert!(ipc_reply(&out, 1).is_err(), "a shareable offset outside its allocation");
        let many =
            vec![IpcEntry::Shareable { uuid: [0; 16], alloc_base: 0, offset: 0, alloc_len: 1 }; MAX_SHARED_FDS + 1];
        encode_ipc_handles_reply(&mut out, &many);
        assert!(ipc_reply(&out, many.len()).is_err(), "more descriptors than one reply carries");
        encode_ipc_handles_reply(&mut out, &many[..MAX_SHARED_FDS]);
        assert_eq!(ipc_reply(&out, MAX_SHARED_FDS).unwrap().len(), MAX_SHARED_FDS);
        let long = IpcEntry::Refused("\u{e9}".repeat(200));
        encode_ipc_handles_reply(&mut out, &[long]);
        assert!(out.len() <= 2 + IPC_ENTRY_MAX);
        let IpcEntry::Refused(why) = &ipc_reply(&out, 1).unwrap()[0] else { panic!() };
        assert!(why.len() <= MAX_ERROR_DETAIL && why.chars().all(|c| c == '\u{e9}'));
    }

    #[test]
    fn notify_and_error_round_trip_with_binary_payloads() {
        let payload = [0u8, 255, 0, 0xC3, 0x28, b'\n'];
        let env =
            NotifyEnvelope { sender_endpoint: "127.0.0.1:5", sender_epoch: 3, target_epoch: 4, payload: &payload };
        let mut out = Vec::new();
        encode_notify(&mut out, &env);
        assert_eq!(decode_notify(&out).unwrap(), env);
        encode_error(&mut out, RemoteStatus::StaleRegistration, "reg#1.2");
        assert_eq!(decode_error(&out).unwrap(), (RemoteStatus::StaleRegistration, "reg#1.2".into()));
    }

    proptest! {
        #[test]
        fn decoders_never_panic_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            let mut h = [0u8; HEADER_LEN];
            let n = bytes.len().min(HEADER_LEN);
            h[..n].copy_from_slice(&bytes[..n]);
            let _ = decode_header(&h, LIMITS);
            let _ = Request::decode(&bytes).map(|r| (r.total_len(), r.descs().count()));
            let _ = decode_notify(&bytes);
            let _ = decode_error(&bytes);
            let _ = decode_describe(&bytes);
            let _ = decode_borrow(&bytes).map(|(id, r)| (id, r.total_len()));
            let _ = decode_return(&bytes);
            let _ = crate::segment::SegmentDescriptor::decode(&bytes, 1 << 20);
            let _ = crate::segment::Delta::decode(&bytes);
            let _ = decode_describe_since(&bytes);
            let _ = decode_watch(&bytes);
            let _ = decode_changed(&bytes).map(|(_, _, d)| crate::segment::Delta::decode(d));
            let _ = decode_ipc_handles(&bytes);
            let _ = ipc_reply(&bytes, bytes.first().copied().unwrap_or(0) as usize);
        }
    }
}
