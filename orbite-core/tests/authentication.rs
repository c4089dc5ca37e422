//! Mutual authentication of peer connections (`auth.secret_file`): peers
//! sharing the secret work as before; a peer without it, or with another,
//! is refused before any other frame, counted, and the engine keeps
//! serving; an unauthenticated peer costs the target one bounded frame.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use orbite_core::wire::{self, Kind, RemoteStatus};
use orbite_core::*;

fn secret_file(name: &str, content: &str) -> String {
    let dir = std::env::temp_dir().join(format!("orbite-auth-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    p.to_str().unwrap().to_owned()
}

fn target(secret: Option<&str>) -> TransferEngine {
    match secret {
        Some(f) => engine(&format!(r#"{{"listen": "127.0.0.1:0", "auth": {{"secret_file": "{f}"}}}}"#)),
        None => engine(r#"{"listen": "127.0.0.1:0"}"#),
    }
}

fn initiator(secret: Option<&str>) -> TransferEngine {
    match secret {
        Some(f) => engine(&format!(r#"{{"route": "tcp", "auth": {{"secret_file": "{f}"}}}}"#)),
        None => engine(r#"{"route": "tcp"}"#),
    }
}

#[test]
fn peers_sharing_the_secret_move_bytes_and_others_are_refused() {
    let good = secret_file("good", "a shared secret of enough bytes\n");
    let other = secret_file("other", "another secret, just as long");
    let t = target(Some(&good));
    let endpoint = t.endpoint().unwrap();
    let remote = region(&t, 65536, Permission::RemoteReadWrite);
    let base = t.stats();

    // Same secret: WRITE then READ back.
    let e = initiator(Some(&good));
    let local = region(&e, 65536, Permission::RemoteReadWrite);
    fill(&local.mem, 5);
    let seg = e.open_segment(&endpoint, Some(t.source_epoch()), WAIT).unwrap();
    let (l, r) = ([Desc::new(local.id, 0, 65536)], [Desc::new(remote.id, 0, 65536)]);
    for op in [Op::Write, Op::Read] {
        let x = e.prepare(&TransferSpec::new(op, &l, &r, Target::Peer(&seg))).unwrap();
        x.post().unwrap();
        assert!(wait_retired(&x).outcome.is_success(), "{op:?}");
    }
    assert_eq!(snapshot(&remote.mem), snapshot(&local.mem));
    assert_eq!((e.stats().auth_failures, t.stats().auth_failures), (0, 0));

    // No secret: refused at the first frame, with a clear error.
    let plain = initiator(None);
    let err = plain.open_segment(&endpoint, None, WAIT).unwrap_err();
    assert!(matches!(err, Error::Peer(PeerError::Unauthenticated(_))), "{err}");
    assert!(err.to_string().contains("requires authentication"), "{err}");
    // The refusal goes out before the target counts it.
    let start = std::time::Instant::now();
    while t.stats().auth_failures < 1 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(t.stats().auth_failures, 1);

    // Another secret: the initiator finds the target cannot prove its.
    let wrong = initiator(Some(&other));
    let err = wrong.open_segment(&endpoint, None, WAIT).unwrap_err();
    assert!(matches!(err, Error::Peer(PeerError::Unauthenticated(_))), "{err}");
    assert_eq!(wrong.stats().auth_failures, 1);

    // The authenticated peer is still served; the target's charges are
    // back at baseline but for the failures it counted.
    let x = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    x.post().unwrap();
    assert!(wait_retired(&x).outcome.is_success());
    drop(x);
    e.close_segment(&seg, WAIT).unwrap();
    // The target sees the link's connections go as they close.
    let start = std::time::Instant::now();
    while t.stats().connections > 0 && start.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(1));
    }
    let after = t.stats();
    assert!(after.auth_failures >= 1);
    assert_eq!(Stats { auth_failures: base.auth_failures, ..after }, base);
}

#[test]
fn an_initiator_with_a_secret_refuses_a_target_without_one() {
    let good = secret_file("good2", "a shared secret of enough bytes");
    let t = target(None);
    let e = initiator(Some(&good));
    let err = e.open_segment(&t.endpoint().unwrap(), None, WAIT).unwrap_err();
    assert!(matches!(err, Error::Peer(PeerError::Unauthenticated(_))), "{err}");
    assert_eq!(e.stats().auth_failures, 1);
}

fn frame(kind: Kind, body: &[u8], request: u64) -> Vec<u8> {
    let mut f = wire::encode_header(&wire::header(kind, body.len(), 0, request)).to_vec();
    f.extend_from_slice(body);
    f
}

#[test]
fn an_unauthenticated_connection_costs_one_bounded_frame() {
    let good = secret_file("good3", "a shared secret of enough bytes");
    let t = target(Some(&good));
    let connect = || {
        let s = TcpStream::connect(t.endpoint().unwrap()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    };
    // A request before authenticating: a typed refusal, then the close.
    let mut s = connect();
    let mut b = Vec::new();
    wire::encode_describe(&mut b, 1, 0);
    s.write_all(&frame(Kind::Describe, &b, 1)).unwrap();
    let mut h = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = wire::decode_header(&h, wire::Limits { max_body: 1 << 20, max_data: 0 }).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).unwrap();
    assert_eq!((h.kind, common::refusal(&body).0), (Kind::Error, RemoteStatus::Unauthenticated));
    let mut rest = [0u8; 1];
    assert!(matches!(s.read(&mut rest), Ok(0) | Err(_)), "closed after the refusal");
    // A header announcing a 1 MiB body before authenticating: closed at
    // the header, nothing of the body is read or buffered.
    let mut s = connect();
    s.write_all(&wire::encode_header(&wire::header(Kind::AuthHello, 1 << 20, 0, 1))).unwrap();
    assert!(matches!(s.read(&mut rest), Ok(0) | Err(_)), "a huge pre-auth frame is refused at its header");
    // A wrong proof: refused and closed.
    let mut s = connect();
    let mut b = Vec::new();
    let hello = wire::AuthHello {
        nonce: [7u8; wire::AUTH_NONCE],
        initiator_epoch: 42,
        responder_epoch: 0,
        dialed: t.endpoint().unwrap(),
        reached: s.peer_addr().unwrap().to_string(),
    };
    hello.encode(&mut b);
    s.write_all(&frame(Kind::AuthHello, &b, 1)).unwrap();
    let mut h = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = wire::decode_header(&h, wire::Limits { max_body: 1 << 20, max_data: 0 }).unwrap();
    assert_eq!(h.kind, Kind::AuthChallenge);
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).unwrap();
    s.write_all(&frame(Kind::AuthProof, &[0u8; wire::AUTH_MAC], 2)).unwrap();
    let mut h = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    assert_eq!(wire::decode_header(&h, wire::Limits { max_body: 1 << 20, max_data: 0 }).unwrap().kind, Kind::Error);
    // Counted as the server closes, just after the refusal went out.
    let start = std::time::Instant::now();
    while t.stats().auth_failures < 2 {
        assert!(start.elapsed() < Duration::from_secs(10), "failures counted: {}", t.stats().auth_failures);
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_connection_that_owes_its_handshake_is_closed_at_the_frame_deadline() {
    let good = secret_file("good4", "a shared secret of enough bytes");
    let t = engine(&format!(
        r#"{{"listen": "127.0.0.1:0", "server_frame_timeout_ms": 300, "auth": {{"secret_file": "{good}"}}}}"#
    ));
    let mut s = TcpStream::connect(t.endpoint().unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let start = std::time::Instant::now();
    let mut b = [0u8; 1];
    assert!(matches!(s.read(&mut b), Ok(0) | Err(_)));
    assert!(start.elapsed() < Duration::from_secs(3), "closed after {:?}", start.elapsed());
    // An authenticated link idle longer than that is kept.
    let e = initiator(Some(&good));
    let seg = e.open_segment(&t.endpoint().unwrap(), None, WAIT).unwrap();
    let remote = region(&t, 4096, Permission::RemoteReadWrite);
    let local = region(&e, 4096, Permission::RemoteReadWrite);
    std::thread::sleep(Duration::from_millis(900));
    let (l, r) = ([Desc::new(local.id, 0, 4096)], [Desc::new(remote.id, 0, 4096)]);
    let x = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    x.post().unwrap();
    assert!(wait_retired(&x).outcome.is_success());
}

#[test]
fn a_short_or_missing_secret_file_is_a_configuration_error() {
    let short = secret_file("short", "too short\n");
    let e = TransferEngine::from_json(&format!(r#"{{"auth": {{"secret_file": "{short}"}}}}"#));
    assert!(matches!(e, Err(Error::Config(_))), "{e:?}");
    let e = TransferEngine::from_json(r#"{"auth": {"secret_file": "/nonexistent/orbite-secret"}}"#);
    assert!(matches!(e, Err(Error::Config(_))), "{e:?}");
}
