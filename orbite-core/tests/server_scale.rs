//! The target's server multiplexes its connections over a fixed set of
//! threads: 256 connected peers cost no more threads than one, and every
//! one of them is still served.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use orbite_core::wire::{self, Kind};

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
