//! The target side of the peer protocol: the machine the engine's TCP
//! server drives for every connection (`ServerConn`, through
//! `orbite_core::fuzzing::Server` in front of a fake target with three small
//! registrations, one of them read-only).
//!
//! Input: a mode byte (no secret; a secret and raw bytes from the start; a
//! secret and a valid handshake first), three bytes that size the pieces
//! bytes move in, then the byte stream a peer sends. Checks: every reply
//! is a well-formed frame, a read-only registration is never written, and
//! (without a secret, where nothing is random) the replies, the closing and
//! the memory do not depend on how the stream was cut.

use orbite_core::fuzzing::{SERVER_EPOCH, SERVER_LIMITS, Server};
use orbite_core::segment::Delta;
use orbite_core::wire::{self, HEADER_LEN, Kind, Limits};

use crate::input::{Input, Seed};

const SECRET: &[u8] = b"orbite fuzz secret of 32 bytes!!";

pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let mode = input.u8() % 3;
    let cuts: Vec<usize> = input.bytes(3).iter().map(|&c| usize::from(c % 97) + 1).collect();
    let stream = input.rest();
    let mut server = Server::new((mode != 0).then_some(SECRET));
    if mode == 2 {
        assert!(server.handshake(7), "a peer that knows the secret authenticates");
    }
    let cut = server.run(stream, &cuts);
    check_replies(&cut.replies);
    assert!(server.read_only_intact(), "no byte landed in a read-only registration");
    if mode == 0 {
        let mut whole = Server::new(None);
        let all = whole.run(stream, &[usize::MAX]);
        assert_eq!(cut.closed, all.closed, "closing does not depend on how the stream was cut");
        assert!(cut.replies == all.replies, "replies do not depend on how the stream was cut");
        assert_eq!(cut.frames, all.frames, "frames read do not depend on how the stream was cut");
        assert_eq!(cut.subscriptions, all.subscriptions);
        assert_eq!(server.is_idle(), whole.is_idle());
    }
}

/// Every reply is a header the initiator accepts, with its body and data.
fn check_replies(mut bytes: &[u8]) {
    let limits = Limits { max_body: SERVER_LIMITS.max_body.max(1 << 20), max_data: SERVER_LIMITS.max_data };
    while !bytes.is_empty() {
        let head: &[u8; HEADER_LEN] = bytes
            .get(..HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .unwrap_or_else(|| panic!("a reply shorter than a header ({} bytes)", bytes.len()));
        let h = wire::decode_header(head, limits).expect("replies have valid headers");
        let body_end = HEADER_LEN + h.body_len as usize;
        let end = body_end + h.data_len as usize;
        assert!(end <= bytes.len(), "a reply's body and data are all sent");
        let body = &bytes[HEADER_LEN..body_end];
        let reply = wire::Message::decode(&h, body).expect("replies decode");
        match reply {
            wire::Message::DescribeDelta(delta) => {
                Delta::decode(delta).expect("delta replies decode");
            }
            wire::Message::Error { .. }
            | wire::Message::AuthChallenge(_)
            | wire::Message::ReadReply
            | wire::Message::DescribeReply(_)
            | wire::Message::WriteAck
            | wire::Message::NotifyAck
            | wire::Message::BorrowAck
            | wire::Message::ReturnAck
            | wire::Message::AuthOk => {}
            m => panic!("a server never replies with {:?}", m.kind()),
        }
        bytes = &bytes[end..];
    }
}

pub fn seeds() -> Vec<Vec<u8>> {
    let frames = crate::wire::sample_frames(SERVER_EPOCH);
    let requests: Vec<Vec<u8>> = frames
        .iter()
        .filter(|f| {
            let h: &[u8; HEADER_LEN] = f[..HEADER_LEN].try_into().expect("a whole header");
            let kind = wire::decode_header(h, Limits { max_body: u32::MAX, max_data: u32::MAX }).map(|h| h.kind);
            matches!(
                kind,
                Ok(Kind::Describe
                    | Kind::DescribeSince
                    | Kind::Watch
                    | Kind::Write
                    | Kind::Read
                    | Kind::Borrow
                    | Kind::Return
                    | Kind::Notify)
            )
        })
        .cloned()
        .collect();
    let mut seeds = Vec::new();
    for mode in [0u8, 2] {
        seeds.push(Seed::new().u8(mode).bytes(&[96, 5, 17]).bytes(&requests.concat()).done());
    }
    for r in &requests {
        seeds.push(Seed::new().u8(0).bytes(&[1, 2, 3]).bytes(r).done());
    }
    // Raw bytes to an authenticating server: a hello, then a bad proof.
    let hello = frames.iter().find(|f| f[6] == Kind::AuthHello as u8).cloned().unwrap_or_default();
    let proof = frames.iter().find(|f| f[6] == Kind::AuthProof as u8).cloned().unwrap_or_default();
    seeds.push(Seed::new().u8(1).bytes(&[96, 96, 96]).bytes(&hello).bytes(&proof).done());
    seeds
}
