//! `orbite bench --workload watchers`: what peers that subscribe to an
//! engine's registration changes and never read cost the engine's own
//! registration calls.
//!
//! An engine listening on loopback registers 2 000 ranges, one call each,
//! then deregisters them, one call each: first with no watcher, then with
//! 200 watch connections that subscribed (raw frames from this process)
//! and never read again, alternately, median of the rounds. The rows give
//! both times and their ratio (bar: 5), the bytes the engine left unsent
//! to each stalled watcher (its sockets' send queues), and whether a
//! stalled watcher that reads again is brought up to the engine's version.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use orbite_core::wire::{self, Kind};
use orbite_core::{EngineConfig, MemoryRange, Permission, TransferEngine};
use serde_json::{Value, json};

use crate::error::{Doing, Error};
use crate::measure::median;

const CALLS: usize = 2_000;
const STALLED: usize = 200;
const RANGE: usize = 4096;

/// Registers `CALLS` ranges one call each, then deregisters them one call
/// each: the two times.
fn cycle(e: &TransferEngine, mem: &orbite_core::HostMemory) -> Result<(Duration, Duration), Error> {
    let start = Instant::now();
    let mut ids = Vec::with_capacity(CALLS);
    for k in 0..CALLS {
        let r = MemoryRange::host(mem, k * RANGE, RANGE, Permission::RemoteRead)?;
        ids.push(e.register_memory_ranges(vec![r])?[0]);
    }
    let registered = start.elapsed();
    let start = Instant::now();
    for id in ids {
        e.deregister(id)?;
    }
    Ok((registered, start.elapsed()))
}

fn read_frame(s: &mut TcpStream) -> Result<(wire::Header, Vec<u8>), Error> {
    let mut h = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut h).doing("read a frame header from the engine")?;
    let h = wire::decode_header(&h, wire::Limits { max_body: 1 << 20, max_data: 0 })?;
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).doing("read a frame body from the engine")?;
    Ok((h, body))
}

/// The version a Changed frame brings.
fn pushed(h: &wire::Header, body: &[u8]) -> Result<u64, Error> {
    match wire::Message::decode(h, body)? {
        wire::Message::Changed { delta, .. } => Ok(orbite_core::segment::Delta::decode(delta)?.version),
        m => Err(Error::Wire(wire::WireError::OutOfPlace(m.kind()))),
    }
}

/// A watch connection that subscribed and read the first push.
fn subscribe(endpoint: &str, epoch: u64) -> Result<TcpStream, Error> {
    let mut s = TcpStream::connect(endpoint).doing("connect a watcher to the engine")?;
    s.set_read_timeout(Some(Duration::from_secs(20))).doing("set a watcher's read timeout")?;
    let mut body = Vec::new();
    wire::encode_watch(&mut body, epoch, 0, 1 << 20);
    let mut f = wire::encode_header(&wire::header(Kind::Watch, body.len(), 0, 1)).to_vec();
    f.extend_from_slice(&body);
    s.write_all(&f).doing("send a Watch")?;
    match read_frame(&mut s)? {
        (h, _) if h.kind == Kind::Changed => Ok(s),
        (h, _) => Err(Error::UnexpectedFrame(h.kind)),
    }
}

/// Bytes the kernel holds unsent on this host's TCP sockets whose local
/// port is `port` (the engine's side of its watch connections).
fn unsent_on(port: u16) -> u64 {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else { return 0 };
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local_port = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
            let tx = u64::from_str_radix(f.get(4)?.split(':').next()?, 16).ok()?;
            (local_port == port).then_some(tx)
        })
        .sum()
}

/// The `watchers` row.
pub fn run(quick: bool) -> Result<Value, Error> {
    let rounds = if quick { 1 } else { 3 };
    let config = EngineConfig {
        listen: Some("127.0.0.1:0".into()),
        max_watchers_per_address: STALLED as u64,
        ..EngineConfig::default()
    };
    let e = TransferEngine::new(config)?;
    let endpoint = e.endpoint().unwrap_or_default();
    let port = e.listen_addr().map_or(0, |a| a.port());
    let mem = e.allocate_host_memory(CALLS * RANGE)?;
    let (mut reg0, mut dereg0, mut reg1, mut dereg1) = (vec![], vec![], vec![], vec![]);
    let (mut unsent, mut verified) = (0u64, true);
    for _ in 0..rounds {
        let (r, d) = cycle(&e, &mem)?;
        reg0.push(r.as_secs_f64() * 1e3);
        dereg0.push(d.as_secs_f64() * 1e3);
        let mut stalled =
            (0..STALLED).map(|_| subscribe(&endpoint, e.source_epoch())).collect::<Result<Vec<_>, _>>()?;
        let (r, d) = cycle(&e, &mem)?;
        reg1.push(r.as_secs_f64() * 1e3);
        dereg1.push(d.as_secs_f64() * 1e3);
        // The push rounds run on the engine's server threads, after the
        // calls: what they left unsent, once they are done.
        std::thread::sleep(Duration::from_millis(300));
        unsent = unsent.max(unsent_on(port));
        // One reads again: it must be brought up to the engine's version.
        let want = e.segment_descriptor().registry_version;
        let s = &mut stalled[0];
        let mut seen = 0;
        let until = Instant::now() + Duration::from_secs(20);
        while seen < want && Instant::now() < until {
            let (h, body) = read_frame(s)?;
            if h.kind == Kind::Changed {
                seen = seen.max(pushed(&h, &body)?);
            }
        }
        verified &= seen == want;
        drop(stalled);
        std::thread::sleep(Duration::from_millis(100)); // the engine forgets them
    }
    let (r0, d0, r1, d1) = (median(&mut reg0), median(&mut dereg0), median(&mut reg1), median(&mut dereg1));
    e.close();
    let ratio = |a: f64, b: f64| ((a / b) * 100.0).round() / 100.0;
    let ms = |v: f64| (v * 100.0).round() / 100.0;
    Ok(json!({
        "system": "orbite", "route": "tcp", "workload": "watchers",
        "calls": CALLS, "stalled_watchers": STALLED, "rounds": rounds,
        "register_ms": ms(r1), "deregister_ms": ms(d1),
        "register_ms_no_watcher": ms(r0), "deregister_ms_no_watcher": ms(d0),
        "x_register": ratio(r1, r0), "x_deregister": ratio(d1, d0),
        "unsent_kib_per_watcher": ((unsent as f64 / STALLED as f64 / 1024.0) * 10.0).round() / 10.0,
        "limit": "the same calls with no watcher (bar: 5)",
        "verified": verified,
    }))
}
