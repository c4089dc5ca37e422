//! What each attack of a hostile peer costs the target in resident memory.
//!
//! The target is a separate process (the peer helper, default limits), so
//! its resident set (`VmRSS`) is its own. Each attack runs at the scale it
//! was reproduced at (or past the limit that now stops it); after each, the
//! target's resident memory has grown by at most the stated bound, a
//! legitimate peer is still served, and the target's charges are back to
//! baseline once the attacker is gone. Growth, not the level, is bounded:
//! the allocator may keep freed pages.

mod common;
mod peer;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use orbite_core::wire::{self, Kind, RemoteDesc, RemoteStatus};
use orbite_core::*;
use peer::PeerProcess;

#[test]
fn peer_process_entry() {
    peer::entry();
}

const MIB: u64 = 1 << 20;

fn rss(p: &PeerProcess) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", p.child.id())).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

fn frame(kind: Kind, body: &[u8], request: u64) -> Vec<u8> {
    let mut f = wire::encode_header(&wire::header(kind, body.len(), 0, request)).to_vec();
    f.extend_from_slice(body);
    f
}

/// Reads one reply: its header and body.
fn reply(s: &mut TcpStream) -> (wire::Header, Vec<u8>) {
    read_frame(s)
}

fn status_of(h: &wire::Header, body: &[u8]) -> Option<RemoteStatus> {
    (h.kind == Kind::Error).then(|| common::refusal(body).0)
}

fn connect(p: &PeerProcess) -> TcpStream {
    let s = TcpStream::connect(&p.endpoint).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// A legitimate peer is served: an engine opens the target and writes.
fn still_serves(p: &mut PeerProcess) {
    let e = engine(r#"{"route": "tcp"}"#);
    let seg = p.open(&e);
    let local = region(&e, 4096, Permission::RemoteReadWrite);
    fill(&local.mem, 9);
    let (l, r) = ([Desc::new(local.id, 0, 4096)], [Desc::new(p.region, 0, 4096)]);
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg))).unwrap();
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success(), "a legitimate peer is no longer served");
    assert_eq!(p.hash(0, 4096), fnv(&snapshot(&local.mem)));
}

fn grew(p: &PeerProcess, before: u64, bound: u64, what: &str) {
    let after = rss(p);
    let growth = after.saturating_sub(before);
    println!("{what}: resident memory +{:.1} MiB (bound {} MiB)", growth as f64 / MIB as f64, bound / MIB);
    assert!(growth <= bound, "{what}: the target grew by {growth} bytes, over {bound}");
}

/// Attack: 5000 notifications with empty payloads and 60 KB sender
/// endpoints grew the target by 294 MB, uncharged. Long endpoints are now
/// refused, and notifications are charged whole (payload, endpoint and a
/// 128-byte record) against `notification_queue_bytes` (16 MiB) and capped
/// in count (65 536): a flood of the longest allowed endpoints stops at
/// the byte budget. Bound: 16 MiB of queue plus 16 MiB of buffers.
#[test]
fn a_notification_flood_costs_at_most_the_queue_budget() {
    let mut p = PeerProcess::spawn();
    let before = rss(&p);
    let mut s = connect(&p);
    let notify = |endpoint: &str, request: u64| {
        let mut b = Vec::new();
        let env =
            wire::NotifyEnvelope { sender_endpoint: endpoint, sender_epoch: 9, target_epoch: p.epoch, payload: &[] };
        wire::encode_notify(&mut b, &env);
        frame(Kind::Notify, &b, request)
    };
    // The reproduction: refused at once, nothing kept.
    let long = "h".repeat(60_000);
    for i in 0..5000 {
        s.write_all(&notify(&long, i)).unwrap();
        let (h, body) = reply(&mut s);
        assert_eq!(status_of(&h, &body), Some(RemoteStatus::BadLength));
    }
    grew(&p, before, 16 * MIB, "5000 notifications with 60 KB endpoints");
    // The longest endpoint allowed, pipelined 1000 at a time, until refused.
    let endpoint = "e".repeat(255);
    let (mut accepted, mut refused) = (0u64, 0u64);
    let mut request = 10_000;
    while refused == 0 {
        let mut burst = Vec::new();
        for _ in 0..1000 {
            request += 1;
            burst.extend_from_slice(&notify(&endpoint, request));
        }
        s.write_all(&burst).unwrap();
        for _ in 0..1000 {
            let (h, body) = reply(&mut s);
            match status_of(&h, &body) {
                None => accepted += 1,
                Some(st) => {
                    assert_eq!(st, RemoteStatus::ResourceExhausted);
                    refused += 1;
                }
            }
        }
        assert!(accepted <= 65_536, "the queue is not capped");
    }
    assert!(accepted * (255 + 128) <= 16 * MIB, "charged whole: {accepted} accepted");
    grew(&p, before, 32 * MIB, &format!("{accepted} notifications with 255-byte endpoints"));
    still_serves(&mut p);
    assert!(p.ask("notifs").starts_with(&format!("NOTIFS {accepted}")));
    assert_eq!(p.ask("stats").split_whitespace().nth(4), Some("0"), "notification charges back to baseline");
}

/// Attack: 600 Borrow frames of 43,690 descriptors alternating between two
/// registrations cost the target about 350 KB each (209 MB) and kept
/// deregistered registrations alive. A borrow now keeps each registration
/// once (two loans here), borrows per connection are capped (4 096) and a
/// closed connection gives them back. Bound: 16 MiB (the frame buffers).
#[test]
fn a_borrow_flood_costs_a_loan_per_registration() {
    let mut p = PeerProcess::spawn();
    let before = rss(&p);
    let mut s = connect(&p);
    let rw = RemoteDesc { registration: p.region.to_raw(), offset: 0, len: 16 };
    let ro = RemoteDesc { registration: p.read_only.to_raw(), offset: 0, len: 16 };
    // As many descriptors as a default frame (1 MiB) takes.
    let descs: Vec<RemoteDesc> = (0..43_000).map(|i| if i % 2 == 0 { rw } else { ro }).collect();
    for id in 1..=600u64 {
        let mut b = Vec::new();
        wire::encode_borrow(&mut b, id, p.epoch, descs.iter().copied());
        s.write_all(&frame(Kind::Borrow, &b, id)).unwrap();
        let (h, body) = reply(&mut s);
        assert_eq!(h.kind, Kind::BorrowAck, "borrow {id}: {:?}", status_of(&h, &body));
    }
    grew(&p, before, 16 * MIB, "600 borrows of 43,000 descriptors");
    // The borrows keep the deregistered region fenced until the borrower
    // goes.
    assert_eq!(p.ask("dereg"), "OK");
    assert_eq!(p.ask("stats").split_whitespace().nth(2), Some("1"), "fenced while borrowed");
    drop(s);
    let start = std::time::Instant::now();
    while p.ask("stats").split_whitespace().nth(2) != Some("0") {
        assert!(start.elapsed() < WAIT, "a closed connection kept its borrows");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut again = connect(&p);
    let mut b = Vec::new();
    wire::encode_describe(&mut b, 1, 0);
    again.write_all(&frame(Kind::Describe, &b, 7)).unwrap();
    assert_eq!(reply(&mut again).0.kind, Kind::DescribeReply);
}

/// Attack: 450 idle or half-sent connections made 455 threads. The server
/// now multiplexes connections on a fixed set of threads and caps them in
/// total (4 096) and per address (512). Bound: 16 MiB for 450 connections
/// (a connection's machine and its header buffer, a few KiB).
#[test]
fn idle_and_half_sent_connections_cost_little() {
    let mut p = PeerProcess::spawn();
    let before = rss(&p);
    let threads = |p: &PeerProcess| std::fs::read_dir(format!("/proc/{}/task", p.child.id())).unwrap().count();
    let threads_before = threads(&p);
    let mut conns = Vec::new();
    for i in 0..450 {
        let mut s = connect(&p);
        if i % 2 == 0 {
            // Half a header.
            s.write_all(&wire::encode_header(&wire::header(Kind::Describe, 16, 0, 1))[..10]).unwrap();
        }
        conns.push(s);
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(threads(&p) <= threads_before, "connections added threads");
    grew(&p, before, 16 * MIB, "450 idle and half-sent connections");
    still_serves(&mut p);
    drop(conns);
}
