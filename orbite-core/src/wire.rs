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
//! error on bad input and never panics.

/// `ORBT`.
pub const MAGIC: u32 = u32::from_be_bytes(*b"ORBT");
/// Major version: a peer with another major is refused.
pub const MAJOR: u8 = 1;
/// Minor version: additive changes (1: delta refresh and watch).
pub const MINOR: u8 = 1;
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
    let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    if b[4] != MAJOR {
        return Err(WireError::UnsupportedMajor(b[4]));
    }
    let kind = Kind::from_u8(b[6]).ok_or(WireError::UnknownKind(b[6]))?;
    let body_len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    let data_len = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
    let request = u64::from_le_bytes([b[16], b[17], b[18], b[19], b[20], b[21], b[22], b[23]]);
    if body_len > limits.max_body {
        return Err(WireError::TooLong { what: "body", len: body_len as u64, limit: limits.max_body as u64 });
    }
    if data_len > limits.max_data {
        return Err(WireError::TooLong { what: "data", len: data_len as u64, limit: limits.max_data as u64 });
    }
    Ok(Header { kind, minor: b[5], flags: b[7], body_len, data_len, request })
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
    out.extend_from_slice(&target_epoch.to_le_bytes());
    out.extend_from_slice(&[0u8; 8]); // count, patched below
    let mut n = 0u32;
    let mut total = 0u64;
    for d in descs {
        out.extend_from_slice(&d.registration.to_le_bytes());
        out.extend_from_slice(&d.offset.to_le_bytes());
        out.extend_from_slice(&d.len.to_le_bytes());
        n += 1;
        total = total.saturating_add(d.len);
    }
    out[8..12].copy_from_slice(&n.to_le_bytes());
    total
}

/// A decoded READ or WRITE body.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The epoch the initiator believes the target has.
    pub target_epoch: u64,
    descs: &'a [u8],
}

impl<'a> Request<'a> {
    /// Decodes a body; the layout must be exact.
    pub fn decode(body: &'a [u8]) -> Result<Self, WireError> {
        if body.len() < REQUEST_PREFIX_LEN {
            return Err(WireError::Malformed("request"));
        }
        let target_epoch = u64_at(body, 0);
        let count = u32::from_le_bytes([body[8], body[9], body[10], body[11]]) as usize;
        let descs = &body[REQUEST_PREFIX_LEN..];
        if count.checked_mul(DESC_LEN) != Some(descs.len()) || count == 0 {
            return Err(WireError::Malformed("request"));
        }
        Ok(Request { target_epoch, descs })
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
        self.descs.chunks_exact(DESC_LEN).map(|c| RemoteDesc {
            registration: u64_at(c, 0),
            offset: u64_at(c, 8),
            len: u64_at(c, 16),
        })
    }

    /// Sum of the lengths, or `None` on overflow.
    pub fn total_len(&self) -> Option<u64> {
        self.descs().try_fold(0u64, |acc, d| acc.checked_add(d.len))
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Flag of a Borrow frame: the borrower will write (not only read).
pub const BORROW_WRITE: u8 = 1;

/// Encodes a Borrow body: the borrow id, then a request body naming the
/// registrations (whole ranges) to keep.
pub fn encode_borrow(out: &mut Vec<u8>, borrow_id: u64, target_epoch: u64, descs: impl Iterator<Item = RemoteDesc>) {
    let mut req = Vec::new();
    encode_request(&mut req, target_epoch, descs);
    out.clear();
    out.extend_from_slice(&borrow_id.to_le_bytes());
    out.extend_from_slice(&req);
}

/// Decodes a Borrow body.
pub fn decode_borrow(body: &[u8]) -> Result<(u64, Request<'_>), WireError> {
    if body.len() < 8 {
        return Err(WireError::Malformed("borrow"));
    }
    Ok((u64_at(body, 0), Request::decode(&body[8..])?))
}

/// Decodes a Return body (the borrow id).
pub fn decode_return(body: &[u8]) -> Result<u64, WireError> {
    if body.len() != 8 {
        return Err(WireError::Malformed("return"));
    }
    Ok(u64_at(body, 0))
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
            _ => RemoteStatus::Other,
        }
    }
}

/// Encodes an error body.
pub fn encode_error(out: &mut Vec<u8>, status: RemoteStatus, detail: &str) {
    let detail = &detail.as_bytes()[..detail.len().min(MAX_ERROR_DETAIL)];
    out.clear();
    out.extend_from_slice(&(status as u16).to_le_bytes());
    out.extend_from_slice(&(detail.len() as u16).to_le_bytes());
    out.extend_from_slice(detail);
}

/// Decodes an error body.
pub fn decode_error(body: &[u8]) -> Result<(RemoteStatus, String), WireError> {
    if body.len() < 4 {
        return Err(WireError::Malformed("error"));
    }
    let status = RemoteStatus::from_u16(u16::from_le_bytes([body[0], body[1]]));
    let n = u16::from_le_bytes([body[2], body[3]]) as usize;
    if n > MAX_ERROR_DETAIL || body.len() != 4 + n {
        return Err(WireError::Malformed("error"));
    }
    Ok((status, String::from_utf8_lossy(&body[4..]).into_owned()))
}

/// Describe body: the initiator's identity and the target epoch it expects
/// (0: any).
pub fn encode_describe(out: &mut Vec<u8>, initiator_epoch: u64, expected_epoch: u64) {
    out.clear();
    out.extend_from_slice(&initiator_epoch.to_le_bytes());
    out.extend_from_slice(&expected_epoch.to_le_bytes());
}

/// Decodes a Describe body.
pub fn decode_describe(body: &[u8]) -> Result<(u64, u64), WireError> {
    if body.len() != 16 {
        return Err(WireError::Malformed("describe"));
    }
    Ok((u64_at(body, 0), u64_at(body, 8)))
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
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Decodes a DescribeSince body.
pub fn decode_describe_since(body: &[u8]) -> Result<DescribeSince, WireError> {
    if body.len() != 32 {
        return Err(WireError::Malformed("describe-since"));
    }
    Ok(DescribeSince {
        initiator_epoch: u64_at(body, 0),
        expected_epoch: u64_at(body, 8),
        since: u64_at(body, 16),
        max_reply: u64_at(body, 24),
    })
}

/// A Watch body: the target epoch, the registry version the watcher's view
/// has, and the largest Changed body it accepts.
pub fn encode_watch(out: &mut Vec<u8>, target_epoch: u64, since: u64, max_reply: u64) {
    out.clear();
    for v in [target_epoch, since, max_reply] {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Decodes a Watch body: (target epoch, since, largest reply).
pub fn decode_watch(body: &[u8]) -> Result<(u64, u64, u64), WireError> {
    if body.len() != 24 {
        return Err(WireError::Malformed("watch"));
    }
    Ok((u64_at(body, 0), u64_at(body, 8), u64_at(body, 16)))
}

/// A Changed body: the target epoch, the registry version the changes are
/// computed from, then an encoded `segment::Delta` (what changed after
/// that version, as much as fits).
pub fn encode_changed(out: &mut Vec<u8>, target_epoch: u64, base: u64, delta: &[u8]) {
    out.clear();
    out.extend_from_slice(&target_epoch.to_le_bytes());
    out.extend_from_slice(&base.to_le_bytes());
    out.extend_from_slice(delta);
}

/// Decodes a Changed body: (target epoch, base version, delta bytes).
pub fn decode_changed(body: &[u8]) -> Result<(u64, u64, &[u8]), WireError> {
    if body.len() < 16 {
        return Err(WireError::Malformed("changed"));
    }
    Ok((u64_at(body, 0), u64_at(body, 8), &body[16..]))
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
    out.extend_from_slice(&env.sender_epoch.to_le_bytes());
    out.extend_from_slice(&env.target_epoch.to_le_bytes());
    let ep = env.sender_endpoint.as_bytes();
    out.extend_from_slice(&(ep.len() as u16).to_le_bytes());
    out.extend_from_slice(ep);
    out.extend_from_slice(env.payload);
}

/// Decodes a notification envelope body.
pub fn decode_notify(body: &[u8]) -> Result<NotifyEnvelope<'_>, WireError> {
    if body.len() < 18 {
        return Err(WireError::Malformed("notify"));
    }
    let n = u16::from_le_bytes([body[16], body[17]]) as usize;
    let ep = body.get(18..18 + n).ok_or(WireError::Malformed("notify"))?;
    let sender_endpoint = std::str::from_utf8(ep).map_err(|_| WireError::Malformed("notify"))?;
    Ok(NotifyEnvelope {
        sender_endpoint,
        sender_epoch: u64_at(body, 0),
        target_epoch: u64_at(body, 8),
        payload: &body[18 + n..],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
        }
    }
}
