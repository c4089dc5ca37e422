//! The wire frame decoder: frame headers and every body decoder of
//! `orbite_core::wire` (and the segment codecs frames carry), over a stream
//! of frames as a connection reads them.
//!
//! Input: one byte choosing the limits, then frames (header, body, bulk
//! data) back to back. Each header is decoded under those limits; each
//! body goes to every body decoder, whatever its kind, and whatever one
//! accepts must encode back to what it decoded from.

use orbite_core::codec;
use orbite_core::segment::{Delta, SegmentDescriptor};
use orbite_core::wire::{self, DescribeSince, HEADER_LEN, Kind, Limits, Message, NotifyEnvelope, RemoteDesc, Request};

use crate::input::Input;

/// The limits a header is checked against: the engine's defaults, tight
/// ones, and none.
const LIMITS: [Limits; 3] = [
    Limits { max_body: 1 << 20, max_data: 1 << 20 },
    Limits { max_body: 64, max_data: 0 },
    Limits { max_body: u32::MAX, max_data: u32::MAX },
];

/// Largest segment descriptor accepted from a body.
const MAX_DESCRIPTOR: usize = 1 << 20;

pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let limits = LIMITS[input.u8() as usize % LIMITS.len()];
    while input.len() >= HEADER_LEN {
        let head: [u8; HEADER_LEN] = input.bytes(HEADER_LEN).try_into().expect("HEADER_LEN bytes");
        let Ok(h) = wire::decode_header(&head, limits) else {
            // A refused header ends the connection; the body decoders still
            // get the rest, as a body of unknown kind.
            bodies(input.rest());
            return;
        };
        assert_eq!(wire::encode_header(&h), head, "a decoded header encodes back to its bytes");
        assert!(h.body_len <= limits.max_body && h.data_len <= limits.max_data, "limits hold");
        let body = input.bytes(h.body_len as usize);
        bodies(body);
        input.bytes(h.data_len as usize);
    }
    bodies(input.rest());
}

/// Every kind of the protocol.
const KINDS: [Kind; 28] = [
    Kind::Describe,
    Kind::DescribeReply,
    Kind::Write,
    Kind::WriteAck,
    Kind::Read,
    Kind::ReadReply,
    Kind::Notify,
    Kind::NotifyAck,
    Kind::Error,
    Kind::Borrow,
    Kind::BorrowAck,
    Kind::Return,
    Kind::ReturnAck,
    Kind::DescribeSince,
    Kind::DescribeDelta,
    Kind::Watch,
    Kind::Changed,
    Kind::AuthHello,
    Kind::AuthChallenge,
    Kind::AuthProof,
    Kind::AuthOk,
    Kind::ShareFds,
    Kind::ShareFdsReply,
    Kind::IpcHandles,
    Kind::IpcHandlesReply,
    Kind::Keepalive,
    Kind::RdmaConnect,
    Kind::RdmaAccept,
];

/// `body` decoded as every kind of message, with a round trip for what
/// decodes: the message encodes back to the body, and decodes again to
/// itself.
pub fn bodies(body: &[u8]) {
    let mut out = Vec::new();
    for kind in KINDS {
        // A WRITE carries exactly what its descriptors cover.
        let data = match kind {
            Kind::Write => Request::decode(body).ok().and_then(|r| r.total_len()).filter(|t| *t <= u32::MAX as u64),
            _ => Some(0),
        };
        let flags: &[u8] = if kind == Kind::Borrow { &[0, 1, 2, 3, 4, 5, 6, 7] } else { &[0] };
        for &f in flags {
            let mut h = wire::header(kind, body.len(), data.unwrap_or(0), 1);
            h.flags = f;
            let Ok(m) = Message::decode(&h, body) else { continue };
            assert_eq!((m.kind(), m.flags()), (kind, f), "a message keeps its kind and flags");
            check_message(&m);
            m.encode(&mut out);
            match &m {
                // Unknown status codes decode as Other, and invalid UTF-8
                // is replaced on decode (which may lengthen it past the
                // bound encode cuts at): the bytes need not come back, the
                // status must, and a detail that was valid.
                Message::Error { detail, .. } => {
                    assert!(detail.len() <= 3 * wire::MAX_ERROR_DETAIL, "an error detail stays bounded");
                }
                // A request's four reserved bytes are not kept.
                Message::Write(_) | Message::Read(_) | Message::Borrow { .. } => {
                    assert_eq!(out.len(), body.len(), "{kind:?} round trip keeps the length")
                }
                _ => assert_eq!(out, body, "{kind:?} round trip"),
            }
            let h2 = wire::header(kind, out.len(), data.unwrap_or(0), 1);
            let mut h2 = h2;
            h2.flags = f;
            let again = Message::decode(&h2, &out).expect("a re-encoded message decodes");
            match (&m, &again) {
                (Message::Error { status, detail }, Message::Error { status: s2, detail: d2 }) => {
                    assert_eq!(s2, status, "error status round trip");
                    if std::str::from_utf8(&body[4..]).is_ok() {
                        assert_eq!(d2, detail, "error detail round trip");
                    }
                }
                _ => assert_eq!(again, m, "{kind:?} decodes to itself"),
            }
        }
        // Data after a kind that carries none, or flags where none belong,
        // are refused.
        if !matches!(kind, Kind::Write | Kind::ReadReply) {
            let h = wire::header(kind, body.len(), 1, 1);
            assert!(Message::decode(&h, body).is_err(), "{kind:?} with data");
        }
    }
    check_descriptor(body);
    check_delta(body);
}

/// What a decoded message promises besides its round trip.
fn check_message(m: &Message<'_>) {
    match m {
        Message::Write(r) | Message::Read(r) | Message::Borrow { request: r, .. } => check_request(r),
        Message::Changed { delta, .. } => check_delta(delta),
        Message::IpcHandles { ids, .. } => assert!(ids.len() <= wire::MAX_IPC_HANDLES, "IPC requests stay bounded"),
        Message::IpcHandlesReply(entries) => {
            for e in entries {
                if let wire::IpcEntry::Exported { offset, alloc_len, .. } = e {
                    assert!(offset < alloc_len, "an exported offset lies inside its allocation");
                }
            }
        }
        Message::ShareFds(names) => assert!(names.len() <= wire::MAX_SHARED_FDS, "share requests stay bounded"),
        Message::RdmaConnect { cards, .. } | Message::RdmaAccept(cards) => {
            assert!(cards.len() <= wire::MAX_RDMA_CARDS, "queue pair cards stay bounded");
            for c in cards {
                assert!(c.qpn <= 0xff_ffff && c.psn <= 0xff_ffff, "24-bit queue pair numbers and PSNs");
                assert!([256, 512, 1024, 2048, 4096].contains(&c.mtu), "an MTU verbs knows");
            }
        }
        _ => {}
    }
}

fn check_request(r: &Request<'_>) {
    assert!(!r.is_empty(), "a decoded request names at least one range");
    assert_eq!(r.descs().count(), r.len(), "every descriptor is read");
    let sum = r.descs().try_fold(0u64, |acc, d| acc.checked_add(d.len));
    assert_eq!(r.total_len(), sum, "total_len is the checked sum");
}

/// A segment descriptor body (DescribeReply): decode, encode, decode.
pub fn check_descriptor(body: &[u8]) {
    if let Ok(d) = SegmentDescriptor::decode(body, MAX_DESCRIPTOR) {
        let bytes = d.to_bytes();
        let again = SegmentDescriptor::decode(&bytes, MAX_DESCRIPTOR).expect("a re-encoded descriptor decodes");
        assert_eq!(again, d, "descriptor round trip");
        assert!(bytes.len() <= body.len(), "an encoding is never longer than what it was decoded from");
    }
}

/// A delta body (DescribeDelta, a Changed's tail): decode, encode, decode.
pub fn check_delta(body: &[u8]) {
    if let Ok(d) = Delta::decode(body) {
        let bytes = d.to_bytes();
        assert_eq!(Delta::decode(&bytes).expect("a re-encoded delta decodes"), d, "delta round trip");
        assert_eq!(bytes.len(), body.len(), "a delta's layout is exact");
    }
}

/// One frame: header, body and bulk data.
pub fn frame(kind: Kind, body: &[u8], data: &[u8], request: u64) -> Vec<u8> {
    let mut out = wire::encode_header(&wire::header(kind, body.len(), data.len() as u64, request)).to_vec();
    out.extend_from_slice(body);
    out.extend_from_slice(data);
    out
}

/// One valid frame of every kind that has a body, with the crate's
/// encoders; `epoch` is the target epoch they name.
pub fn sample_frames(epoch: u64) -> Vec<Vec<u8>> {
    let mut body = Vec::new();
    let mut frames = Vec::new();
    let descs = [RemoteDesc { registration: 1, offset: 0, len: 16 }, RemoteDesc { registration: 3, offset: 8, len: 8 }];
    wire::encode_describe(&mut body, 7, epoch);
    frames.push(frame(Kind::Describe, &body, &[], 1));
    let since = DescribeSince { initiator_epoch: 7, expected_epoch: epoch, since: 0, max_reply: 4096 };
    wire::encode_describe_since(&mut body, &since);
    frames.push(frame(Kind::DescribeSince, &body, &[], 2));
    wire::encode_watch(&mut body, epoch, 0, 4096);
    frames.push(frame(Kind::Watch, &body, &[], 3));
    wire::encode_request(&mut body, epoch, descs.iter().copied());
    frames.push(frame(Kind::Write, &body, &[0xab; 24], 4));
    frames.push(frame(Kind::Read, &body, &[], 5));
    wire::encode_borrow(&mut body, 42, epoch, descs.iter().copied());
    frames.push(frame(Kind::Borrow, &body, &[], 6));
    body.clear();
    codec::put_u64(&mut body, 42);
    frames.push(frame(Kind::Return, &body, &[], 7));
    let env = NotifyEnvelope { sender_endpoint: "127.0.0.1:9", sender_epoch: 7, target_epoch: epoch, payload: b"hi" };
    wire::encode_notify(&mut body, &env);
    frames.push(frame(Kind::Notify, &body, &[], 8));
    wire::encode_error(&mut body, wire::RemoteStatus::OutOfBounds, "1+2 outside reg#1.1");
    frames.push(frame(Kind::Error, &body, &[], 9));
    let delta = Delta { version: 3, removed: vec![5, 6], ..Delta::default() };
    wire::encode_changed(&mut body, epoch, 1, &delta.to_bytes());
    frames.push(frame(Kind::Changed, &body, &[], 10));
    frames.push(frame(Kind::DescribeDelta, &delta.to_bytes(), &[], 11));
    let hello = wire::AuthHello {
        nonce: [1; wire::AUTH_NONCE],
        initiator_epoch: 7,
        responder_epoch: epoch,
        dialed: "host:7000".into(),
        reached: "127.0.0.1:7000".into(),
    };
    hello.encode(&mut body);
    frames.push(frame(Kind::AuthHello, &body, &[], 12));
    let challenge =
        wire::AuthChallenge { nonce: [2; wire::AUTH_NONCE], responder_epoch: epoch, mac: [3; wire::AUTH_MAC] };
    challenge.encode(&mut body);
    frames.push(frame(Kind::AuthChallenge, &body, &[], 13));
    frames.push(frame(Kind::AuthProof, &[4; wire::AUTH_MAC], &[], 14));
    frames.push(frame(Kind::WriteAck, &[], &[], 15));
    let card = wire::QpCard { gid: [0xfe; 16], qpn: 0x12_0042, psn: 0x00_beef, mtu: 4096, nic: 0, peer_nic: 1 };
    wire::encode_rdma_connect(&mut body, epoch, &[card, wire::QpCard { nic: 1, peer_nic: 0, ..card }]);
    frames.push(frame(Kind::RdmaConnect, &body, &[], 16));
    wire::encode_rdma_accept(&mut body, &[card]);
    frames.push(frame(Kind::RdmaAccept, &body, &[], 17));
    let mut rdma_borrow = wire::header(Kind::Borrow, 0, 0, 18);
    wire::encode_borrow(&mut body, 43, epoch, descs.iter().copied());
    rdma_borrow.body_len = body.len() as u32;
    rdma_borrow.flags = wire::BORROW_WRITE | wire::BORROW_RDMA;
    let mut f = wire::encode_header(&rdma_borrow).to_vec();
    f.extend_from_slice(&body);
    frames.push(f);
    frames
}

/// Seeds: each sample frame alone, all of them in one stream, and a
/// segment descriptor reply.
pub fn seeds() -> Vec<Vec<u8>> {
    let frames = sample_frames(0x1234);
    let mut seeds: Vec<Vec<u8>> = frames.iter().map(|f| [&[0u8][..], f].concat()).collect();
    seeds.push([vec![2u8], frames.concat()].concat());
    if let Some(d) = crate::segment::sample_descriptor() {
        seeds.push([vec![0u8], frame(Kind::DescribeReply, &d, &[], 99)].concat());
    }
    seeds
}
