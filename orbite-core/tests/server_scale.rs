//! The target's server multiplexes its connections over a fixed set of
//! threads: 256 connected peers cost no more threads than one, and every
//! one of them is still served.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use orbite_core::wire::{self, Kind};

/// The tests count the process's threads: one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

fn describe(s: &mut TcpStream, request: u64) -> wire::Header {
    let mut body = Vec::new();
    wire::encode_describe(&mut body, 7, 0);
    let mut f = wire::encode_header(&wire::header(Kind::Describe, body.len(), 0, request)).to_vec();
    f.extend_from_slice(&body);
    s.write_all(&f).unwrap();
    let mut h = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = wire::decode_header(&h, wire::Limits { max_body: 1 << 20, max_data: 1 << 30 }).unwrap();
    let mut reply = vec![0u8; h.body_len as usize];
    s.read_exact(&mut reply).unwrap();
    h
}

#[test]
fn connected_peers_do_not_add_threads() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let e = engine(r#"{"listen": "127.0.0.1:0"}"#);
    let endpoint = e.endpoint().unwrap();
    let connect = || {
        let s = TcpStream::connect(&endpoint).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    };
    let mut first = connect();
    assert_eq!(describe(&mut first, 1).kind, Kind::DescribeReply);
    let with_one = threads();
    let mut peers = vec![first];
    for i in 1..256 {
        let mut s = connect();
        assert_eq!(describe(&mut s, i + 1).kind, Kind::DescribeReply);
        peers.push(s);
    }
    let with_256 = threads();
    assert_eq!(with_256, with_one, "256 connected peers use the threads one does");
    // Every connection is still served, in any order.
    for (i, s) in peers.iter_mut().enumerate().rev() {
        assert_eq!(describe(s, 1000 + i as u64).request, 1000 + i as u64);
    }
    drop(peers);
    e.close();
}

/// The initiator side too: an engine with 256 opened peers (each a link of
/// data connections and a watch connection) has the threads it has with
/// one, and every link still moves bytes and fails over to nothing.
#[test]
fn opened_peers_do_not_add_threads() {
    use orbite_core::*;
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    // Every link comes from 127.0.0.1: allow them all.
    let target = engine(r#"{"listen": "127.0.0.1:0", "max_connections_per_address": 4096}"#);
    let endpoint = target.endpoint().unwrap();
    let remote = region(&target, 1 << 16, Permission::RemoteReadWrite);
    let e = engine(r#"{"route": "tcp", "connections_per_peer": 2}"#);
    let local = region(&e, 1 << 16, Permission::RemoteReadWrite);
    fill(&local.mem, 3);
    let first = e.open_segment(&endpoint, None, WAIT).unwrap();
    let write = |seg: &RemoteSegment, at: u64| {
        let (l, r) = ([Desc::new(local.id, at, 256)], [Desc::new(remote.id, at, 256)]);
        let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(seg))).unwrap();
        t.post().unwrap();
        assert!(wait_retired(&t).outcome.is_success());
    };
    write(&first, 0);
    let with_one = threads();
    let mut segs = vec![first];
    for _ in 1..256 {
        segs.push(e.open_segment(&endpoint, None, WAIT).unwrap());
    }
    assert_eq!(threads(), with_one, "256 opened peers use the threads one does");
    for (i, seg) in segs.iter().enumerate().rev() {
        write(seg, (i as u64 * 256) % (1 << 16));
    }
    assert_eq!(snapshot(&remote.mem), snapshot(&local.mem));
    for seg in &segs {
        e.close_segment(seg, WAIT).unwrap();
    }
    drop(segs);
    assert_eq!(threads(), with_one);
    e.close();
    target.close();
}
