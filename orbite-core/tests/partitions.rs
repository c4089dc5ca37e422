//! Partitions: a peer that stops answering without closing its connections,
//! or answers slower than the configured minimum, is lost within
//! `peer_timeout_ms` of its last sign of life; admitted work fails after
//! local retirement with what really happened (a READ's exact prefix, a
//! WRITE's unknown effect); nothing is replayed; a new open works.
//!
//! The peer is a scripted fake speaking the wire protocol, so that each way
//! of going silent is exact: nothing sent, half a reply, a trickle.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use orbite_core::segment::{ExportedRegistration, SegmentDescriptor};
use orbite_core::wire::{self, Kind};
use orbite_core::*;

const REG_LEN: u64 = 8 << 20;
const EPOCH: u64 = 0x5eed_0001;

/// How the fake answers a READ or WRITE.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Answers at once.
    Normal,
    /// Takes the request and never answers.
    Silent,
    /// Sends the reply header and half a READ's bytes, then nothing.
    HalfReply,
    /// Sends a READ's bytes one at a time, `gap` apart.
    Trickle(Duration),
    /// Answers a Describe one byte at a time, `gap` apart.
    SlowDescribe(Duration),
}

struct FakePeer {
    endpoint: String,
    stop: Arc<AtomicBool>,
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect(&self.endpoint);
    }
}

fn descriptor(endpoint: &str) -> Vec<u8> {
    SegmentDescriptor {
        rdma_nics: 0,
        endpoint: endpoint.into(),
        epoch: EPOCH,
        registry_version: 1,
        pid: 1,
        boot_id: [0; 16], // never the same host
        inbox: String::new(),
        local_socket: String::new(),
        registrations: vec![ExportedRegistration {
            rkeys: Vec::new(),
            id: RegistrationId::from_raw(7),
            len: REG_LEN,
            permission: Permission::RemoteReadWrite,
            addr: 0x10_0000,
            shm: None,
            device: None,
        }],
    }
    .to_bytes()
}

fn frame(kind: Kind, body: &[u8], data: u64, request: u64) -> Vec<u8> {
    let mut out = wire::encode_header(&wire::header(kind, body.len(), data, request)).to_vec();
    out.extend_from_slice(body);
    out
}

fn serve(mut s: TcpStream, endpoint: String, how: Behaviour, stop: Arc<AtomicBool>) {
    let limits = wire::Limits { max_body: 1 << 20, max_data: 64 << 20 };
    let mut hb = [0u8; wire::HEADER_LEN];
    while !stop.load(Ordering::Acquire) && s.read_exact(&mut hb).is_ok() {
        let Ok(h) = wire::decode_header(&hb, limits) else { return };
        let mut body = vec![0u8; h.body_len as usize];
        let mut data = vec![0u8; h.data_len as usize];
        if s.read_exact(&mut body).is_err() || s.read_exact(&mut data).is_err() {
            return;
        }
        let reply = match (h.kind, how) {
            (Kind::Describe, Behaviour::SlowDescribe(gap)) => {
                for b in frame(Kind::DescribeReply, &descriptor(&endpoint), 0, h.request) {
                    if s.write_all(&[b]).is_err() || stop.load(Ordering::Acquire) {
                        return;
                    }
                    std::thread::sleep(gap);
                }
                continue;
            }
            (Kind::Describe, _) => frame(Kind::DescribeReply, &descriptor(&endpoint), 0, h.request),
            (Kind::Watch, _) => {
                // Subscribed: the first push says nothing changed; none follows.
                let (epoch, since, _) = common::watch_of(&body);
                let delta = orbite_core::segment::Delta { version: since, ..Default::default() };
                let mut changed = Vec::new();
                wire::encode_changed(&mut changed, epoch, since, &delta.to_bytes());
                frame(Kind::Changed, &changed, 0, h.request)
            }
            (Kind::Write, Behaviour::Normal) => frame(Kind::WriteAck, &[], 0, h.request),
            (Kind::Read, _) => {
                let req = wire::Request::decode(&body).unwrap();
                let total = req.total_len().unwrap();
                let bytes = vec![0x5Au8; total as usize];
                let head = frame(Kind::ReadReply, &[], total, h.request);
                match how {
                    Behaviour::Normal => [head, bytes].concat(),
                    Behaviour::HalfReply => [head, bytes[..bytes.len() / 2].to_vec()].concat(),
                    Behaviour::Trickle(gap) => {
                        let _ = s.write_all(&head);
                        for b in bytes {
                            if s.write_all(&[b]).is_err() || stop.load(Ordering::Acquire) {
                                return;
                            }
                            std::thread::sleep(gap);
                        }
                        continue;
                    }
                    _ => continue, // silent
                }
            }
            _ => continue, // silent: requests are taken, never answered
        };
        if s.write_all(&reply).is_err() {
            return;
        }
    }
}

fn fake_peer(how: Behaviour) -> FakePeer {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let (ep, st) = (endpoint.clone(), stop.clone());
    std::thread::spawn(move || {
        for s in listener.incoming() {
            if st.load(Ordering::Acquire) {
                return;
            }
            let Ok(s) = s else { continue };
            let (ep, st) = (ep.clone(), st.clone());
            std::thread::spawn(move || serve(s, ep, how, st));
        }
    });
    FakePeer { endpoint, stop }
}

const TIMEOUT_MS: u64 = 400;

fn initiator(min_rate: u64) -> TransferEngine {
    engine(&format!(
        r#"{{"route": "tcp", "peer_timeout_ms": {TIMEOUT_MS}, "peer_min_bytes_per_s": {min_rate}, "task_bytes": 1048576}}"#
    ))
}

/// Posts `op` of `len` bytes and waits for retirement; returns the result
/// and how long after the post it retired.
fn run(e: &TransferEngine, seg: &RemoteSegment, op: Op, len: u64) -> (TransferResult, Duration) {
    let local = region(e, len as usize, Permission::LocalOnly);
    let l = [Desc::new(local.id, 0, len)];
    let r = [Desc::new(RegistrationId::from_raw(7), 0, len)];
    let t = e.prepare(&TransferSpec::new(op, &l, &r, Target::Peer(seg))).unwrap();
    let start = Instant::now();
    t.post().unwrap();
    let status = t.wait(Duration::from_secs(30));
    let took = start.elapsed();
    let res = status.result().expect("retired within 30 s");
    if !res.outcome.is_success() {
        assert!(t.post().is_err(), "a failed execution is never reposted");
    }
    t.release().unwrap();
    (res, took)
}

fn assert_within_bound(took: Duration, extra: Duration) {
    // Measured from the post: the peer's last sign of life was before it.
    let bound = Duration::from_millis(TIMEOUT_MS) + extra + Duration::from_millis(100);
    assert!(took >= Duration::from_millis(TIMEOUT_MS) / 2, "failed too early: {took:?}");
    assert!(took <= bound, "not lost within the bound: {took:?} > {bound:?}");
}

#[test]
fn a_silent_peer_fails_a_read_and_a_write_within_the_timeout() {
    let peer = fake_peer(Behaviour::Silent);
    let e = initiator(0);
    for op in [Op::Read, Op::Write] {
        let seg = e.open_segment(&peer.endpoint, Some(EPOCH), WAIT).unwrap();
        let (res, took) = run(&e, &seg, op, 4 << 20);
        assert!(!res.outcome.is_success(), "{res:?}");
        assert_within_bound(took, Duration::ZERO);
        assert!(seg.lost().is_some(), "the peer is lost");
        match op {
            Op::Read => assert_eq!(
                (res.outcome.transferred_prefix, res.outcome.remote_effect),
                (0, RemoteEffect::None),
                "nothing landed"
            ),
            Op::Write => assert_eq!(res.outcome.remote_effect, RemoteEffect::Unknown, "payload was sent"),
        }
        assert_eq!(e.stats().executions, 0);
    }
}

#[test]
fn half_a_reply_then_silence_reports_the_exact_prefix() {
    let peer = fake_peer(Behaviour::HalfReply);
    let e = initiator(0);
    let seg = e.open_segment(&peer.endpoint, Some(EPOCH), WAIT).unwrap();
    // One task: the prefix is exactly what arrived.
    let (res, took) = run(&e, &seg, Op::Read, 1 << 20);
    assert_within_bound(took, Duration::ZERO);
    assert!(!res.outcome.is_success(), "{res:?}");
    assert_eq!(res.outcome.transferred_prefix, 512 << 10, "{res:?}");
}

#[test]
fn a_trickling_peer_counts_as_not_answering() {
    let peer = fake_peer(Behaviour::Trickle(Duration::from_millis(5)));
    // 64 KiB at the 1 MiB/s minimum may take 62 ms beyond the timeout; at
    // 200 B/s it would take minutes.
    let e = initiator(1 << 20);
    let seg = e.open_segment(&peer.endpoint, Some(EPOCH), WAIT).unwrap();
    let (res, took) = run(&e, &seg, Op::Read, 64 << 10);
    assert!(!res.outcome.is_success(), "{res:?}");
    assert_within_bound(took, Duration::from_millis(63));
    assert!(res.outcome.transferred_prefix < 64 << 10);
}

#[test]
fn opening_a_trickling_peer_is_bounded_by_the_callers_timeout() {
    let peer = fake_peer(Behaviour::SlowDescribe(Duration::from_millis(20)));
    let e = initiator(0);
    let start = Instant::now();
    let err = e.open_segment(&peer.endpoint, Some(EPOCH), Duration::from_millis(300)).unwrap_err();
    assert!(start.elapsed() < Duration::from_millis(1300), "{:?}", start.elapsed());
    assert!(matches!(err, Error::Peer(PeerError::Connect(_))), "{err}");
}

#[test]
fn after_a_loss_a_new_open_of_the_same_incarnation_works() {
    let silent = fake_peer(Behaviour::Silent);
    let e = initiator(0);
    let seg = e.open_segment(&silent.endpoint, Some(EPOCH), WAIT).unwrap();
    let (res, _) = run(&e, &seg, Op::Read, 1 << 20);
    assert!(!res.outcome.is_success());
    let err = e.prepare(&TransferSpec::new(Op::Read, &[], &[], Target::Peer(&seg))).unwrap_err();
    assert!(matches!(err, Error::Peer(PeerError::Lost(_))), "{err}");
    // The same incarnation answers again (here: a healthy peer with the
    // same epoch): a new open works, and transfers on it succeed.
    let healthy = fake_peer(Behaviour::Normal);
    let seg2 = e.open_segment(&healthy.endpoint, Some(EPOCH), WAIT).unwrap();
    let (res, _) = run(&e, &seg2, Op::Read, 2 << 20);
    assert!(res.outcome.is_success(), "{res:?}");
    let (res, _) = run(&e, &seg2, Op::Write, 2 << 20);
    assert!(res.outcome.is_success(), "{res:?}");
    assert_eq!(e.stats().executions, 0);
}

#[test]
fn an_idle_link_is_not_lost() {
    let peer = fake_peer(Behaviour::Normal);
    let e = initiator(0);
    let seg = e.open_segment(&peer.endpoint, Some(EPOCH), WAIT).unwrap();
    std::thread::sleep(Duration::from_millis(3 * TIMEOUT_MS));
    assert!(seg.lost().is_none(), "silence with nothing outstanding is not a loss");
    let (res, _) = run(&e, &seg, Op::Read, 1 << 20);
    assert!(res.outcome.is_success(), "{res:?}");
}
