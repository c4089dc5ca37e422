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
use orbite_core::wire::{self, DescribeSince, HEADER_LEN, Kind, Limits, NotifyEnvelope, RemoteDesc, Request};

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

/// Every body decoder on `body`, with a round trip for what it accepts.
pub fn bodies(body: &[u8]) {
    let mut out = Vec::new();
    if let Ok((initiator, expected)) = wire::decode_describe(body) {
        wire::encode_describe(&mut out, initiator, expected);
        assert_eq!(out, body, "describe round trip");
    }
    if let Ok(d) = wire::decode_describe_since(body) {
        wire::encode_describe_since(&mut out, &d);
        assert_eq!(out, body, "describe-since round trip");
    }
    if let Ok((epoch, since, max)) = wire::decode_watch(body) {
        wire::encode_watch(&mut out, epoch, since, max);
        assert_eq!(out, body, "watch round trip");
    }
    if let Ok(r) = Request::decode(body) {
        check_request(&r);
        let total = wire::encode_request(&mut out, r.target_epoch, r.descs());
        let again = Request::decode(&out).expect("a re-encoded request decodes");
        assert_eq!(again.target_epoch, r.target_epoch);
        assert!(again.descs().eq(r.descs()), "request round trip");
        assert_eq!(r.total_len().unwrap_or(u64::MAX), total, "encode_request's total saturates");
    }
    if let Ok((id, r)) = wire::decode_borrow(body) {
        check_request(&r);
        wire::encode_borrow(&mut out, id, r.target_epoch, r.descs());
        let (id2, again) = wire::decode_borrow(&out).expect("a re-encoded borrow decodes");
        assert_eq!(id2, id);
        assert!(again.descs().eq(r.descs()), "borrow round trip");
    }
    if let Ok(id) = wire::decode_return(body) {
        out.clear();
        codec::put_u64(&mut out, id);
        assert_eq!(out, body, "return round trip");
    }
    if let Ok(env) = wire::decode_notify(body) {
        wire::encode_notify(&mut out, &env);
        assert_eq!(out, body, "notify round trip");
    }
    if let Ok((status, detail)) = wire::decode_error(body) {
        assert!(detail.len() <= 3 * wire::MAX_ERROR_DETAIL, "an error detail stays bounded");
        wire::encode_error(&mut out, status, &detail);
        let (status2, detail2) = wire::decode_error(&out).expect("a re-encoded error decodes");
        assert_eq!(status2, status, "error status round trip");
        // Invalid UTF-8 is replaced on decode, which may lengthen it past
        // the bound encode cuts at: compare only details that were valid.
        if std::str::from_utf8(&body[4..]).is_ok() {
            assert_eq!(detail2, detail, "error detail round trip");
        }
    }
    if let Ok((epoch, base, delta)) = wire::decode_changed(body) {
        wire::encode_changed(&mut out, epoch, base, delta);
        assert_eq!(out, body, "changed round trip");
        check_delta(delta);
    }
    if let Ok(hello) = wire::AuthHello::decode(body) {
        hello.encode(&mut out);
        assert_eq!(out, body, "auth hello round trip");
    }
    if let Ok(challenge) = wire::AuthChallenge::decode(body) {
        challenge.encode(&mut out);
        assert_eq!(out, body, "auth challenge round trip");
    }
    if let Ok(mac) = wire::decode_auth_proof(body) {
        assert_eq!(&mac[..], body, "auth proof round trip");
    }
    if let Ok((epoch, ids)) = wire::decode_ipc_handles(body) {
        assert!(ids.len() <= wire::MAX_IPC_HANDLES, "IPC handle requests stay bounded");
        wire::encode_ipc_handles(&mut out, epoch, &ids);
        assert_eq!(out, body, "ipc handles round trip");
    }
    if let Some(&asked) = body.first() {
        if let Ok(entries) = wire::decode_ipc_handles_reply(body, asked as usize) {
            for e in &entries {
                if let wire::IpcEntry::Exported { offset, alloc_len, .. } = e {
                    assert!(offset < alloc_len, "an exported offset lies inside its allocation");
                }
            }
            wire::encode_ipc_handles_reply(&mut out, &entries);
            assert_eq!(out, body, "ipc handles reply round trip");
        }
    }
    check_descriptor(body);
    check_delta(body);
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
    let challenge = wire::AuthChallenge { nonce: [2; wire::AUTH_NONCE], responder_epoch: epoch, mac: [3; wire::AUTH_MAC] };
    challenge.encode(&mut body);
    frames.push(frame(Kind::AuthChallenge, &body, &[], 13));
    frames.push(frame(Kind::AuthProof, &[4; wire::AUTH_MAC], &[], 14));
    frames.push(frame(Kind::WriteAck, &[], &[], 15));
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
