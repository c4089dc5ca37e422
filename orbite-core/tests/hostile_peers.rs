//! Hostile peers, round two (#27), with engines in processes of their own
//! on loopback and the attacker in this process, speaking raw frames:
//! - a relayed handshake (to a third engine, or back to the initiator's own
//!   listener) authenticates nothing, and every refusal is counted;
//! - connections that send a hello and never the proof expire at the
//!   handshake deadline, and cannot keep a genuine peer out;
//! - an engine never peers with itself, whatever a peer describes.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use common::*;
use orbite_core::segment::{ExportedRegistration, SegmentDescriptor};
use orbite_core::wire::{self, Kind, RemoteDesc, RemoteStatus};
use orbite_core::*;

const CHILD_ENV: &str = "ORBITE_HOSTILE_CHILD";
const CONFIG_ENV: &str = "ORBITE_HOSTILE_CONFIG";
/// The region each child engine registers (remote read-write).
const REGION: usize = 1 << 20;

/// The child engine: registers one region filled with a seed, says READY,
/// then obeys line commands on stdin (see [`Engine`]).
#[test]
fn engine_process_entry() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let config = std::env::var(CONFIG_ENV).unwrap();
    let e = engine(&config);
    let r = region(&e, REGION, Permission::RemoteReadWrite);
    fill(&r.mem, e.source_epoch());
    let out = std::sync::Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let say = {
        let out = out.clone();
        move |s: String| {
            let mut o = out.lock().unwrap();
            let _ = writeln!(o, "{s}");
            let _ = o.flush();
        }
    };
    let d = e.segment_descriptor();
    let endpoint = e.endpoint().unwrap_or_else(|| "-".into());
    let socket = if d.local_socket.is_empty() { "-".to_owned() } else { d.local_socket.clone() };
    say(format!("READY {endpoint} {} {socket} {}", e.source_epoch(), r.id.to_raw()));
    let segments: std::sync::Arc<std::sync::Mutex<HashMap<String, RemoteSegment>>> = Default::default();
    let mut extra = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["open", tag, endpoint, epoch] => {
                // In the background: the attacker answers it meanwhile.
                let (e, say, segments) = (e.clone(), say.clone(), segments.clone());
                let (tag, endpoint) = (tag.to_string(), endpoint.to_string());
                let epoch = (*epoch != "-").then(|| epoch.parse::<u64>().unwrap());
                std::thread::spawn(move || match e.open_segment(&endpoint, epoch, Duration::from_secs(20)) {
                    Ok(seg) => {
                        segments.lock().unwrap().insert(tag.clone(), seg);
                        say(format!("DONE {tag} OK"));
                    }
                    Err(err) => say(format!("DONE {tag} ERR {err}")),
                });
            }
            ["write", tag] => {
                let segs = segments.lock().unwrap();
                let seg = &segs[*tag];
                let remote = seg.descriptor().registrations[0].id;
                let (l, rr) = ([Desc::new(r.id, 0, 65536)], [Desc::new(remote, 0, 65536)]);
                let x = e.prepare(&TransferSpec::new(Op::Write, &l, &rr, Target::Peer(seg))).unwrap();
                x.post().unwrap();
                let res = wait_retired(&x);
                say(format!("WROTE {:?} {:?}", x.route().route, res.outcome.is_success()));
                x.release().unwrap();
            }
            ["hash"] => say(format!("HASH {}", fnv(&snapshot(&r.mem)))),
            ["register", n] => {
                // `n` more registrations of 64 bytes each, in a block of
                // their own (a long Describe).
                let n: usize = n.parse().unwrap();
                let block = e.allocate_host_memory(n * 64).unwrap();
                let ranges = (0..n).map(|i| MemoryRange::host(&block, i * 64, 64, Permission::RemoteRead).unwrap());
                let ids = e.register_memory_ranges(ranges.collect()).unwrap();
                extra.push((block, ids));
                say("OK".into());
            }
            ["cycle", n] => {
                // Registers and deregisters one range `n` times.
                for _ in 0..n.parse::<usize>().unwrap() {
                    let id = e
                        .register_memory_ranges(vec![
                            MemoryRange::host(&r.mem, 0, 4096, Permission::RemoteRead).unwrap(),
                        ])
                        .unwrap()[0];
                    e.deregister(id).unwrap();
                }
                say("OK".into());
            }
            ["stats"] => {
                let s = e.stats();
                let fields: Vec<String> = s.fields().iter().map(|(n, v)| format!("{n}={v}")).collect();
                say(format!("STATS {}", fields.join(" ")));
            }
            ["quit"] => break,
            _ => say(format!("ERR unknown command {line}")),
        }
    }
    std::process::exit(0);
}

/// An engine in a child process.
struct Engine {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    endpoint: String,
    epoch: u64,
    local_socket: String,
    /// The raw id of its region.
    region: u64,
}

impl Engine {
    #[allow(clippy::zombie_processes, reason = "waited for by Drop")]
    fn spawn(config: &str) -> Engine {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["engine_process_entry", "--exact", "--nocapture", "--test-threads=1", "-q"])
            .env(CHILD_ENV, "1")
            .env(CONFIG_ENV, config)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut e =
            Engine { child, stdin, lines, endpoint: String::new(), epoch: 0, local_socket: String::new(), region: 0 };
        let ready = e.expect("READY ");
        let w: Vec<&str> = ready.split_whitespace().collect();
        (e.endpoint, e.epoch, e.local_socket) = (w[0].to_owned(), w[1].parse().unwrap(), w[2].to_owned());
        e.region = w[3].parse().unwrap();
        e
    }

    fn send(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The rest of the next line that starts with `prefix`.
    fn expect(&mut self, prefix: &str) -> String {
        let until = Instant::now() + WAIT;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).unwrap_or_else(|_| panic!("no `{prefix}` line in time"));
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.to_owned();
            }
        }
    }

    fn ask(&mut self, cmd: &str, prefix: &str) -> String {
        self.send(cmd);
        self.expect(prefix)
    }

    fn stats(&mut self) -> HashMap<String, u64> {
        let line = self.ask("stats", "STATS ");
        line.split_whitespace()
            .map(|f| {
                let (n, v) = f.split_once('=').unwrap();
                (n.to_owned(), v.parse().unwrap())
            })
            .collect()
    }

    /// Waits until stat `name` is `want` (counts come as connections
    /// close, charges go as exchanges end), then checks it stays there.
    fn stat_reaches(&mut self, name: &str, want: u64) {
        let until = Instant::now() + WAIT;
        while self.stats()[name] != want {
            assert!(Instant::now() < until, "{name} is {}, want {want}", self.stats()[name]);
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(self.stats()[name], want, "{name} moved on");
    }

    /// The child's resident memory, in bytes.
    fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .unwrap()
            .trim()
            .trim_end_matches(" kB")
            .parse()
            .unwrap();
        kb * 1024
    }

    fn hash(&mut self) -> u64 {
        self.ask("hash", "HASH ").parse().unwrap()
    }

    fn open(&mut self, tag: &str, endpoint: &str, epoch: Option<u64>) {
        let epoch = epoch.map_or("-".to_owned(), |e| e.to_string());
        self.send(&format!("open {tag} {endpoint} {epoch}"));
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn secret_file() -> String {
    let p = std::env::temp_dir().join(format!("orbite-hostile-peers-{}", std::process::id()));
    std::fs::write(&p, "the deployment's shared secret, long enough").unwrap();
    p.to_str().unwrap().to_owned()
}

fn with_auth(extra: &str) -> String {
    format!(r#"{{"listen": "127.0.0.1:0", "route": "tcp", "auth": {{"secret_file": "{}"}}{extra}}}"#, secret_file())
}

fn frame(kind: Kind, body: &[u8], request: u64) -> Vec<u8> {
    let mut f = wire::encode_header(&wire::header(kind, body.len(), 0, request)).to_vec();
    f.extend_from_slice(body);
    f
}

fn connect(endpoint: &str) -> TcpStream {
    let s = TcpStream::connect(endpoint).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s
}

/// Sends a hello on a fresh connection to `endpoint`: the challenge, or
/// the refusal's text.
fn hello_to(endpoint: &str, hello: &wire::AuthHello) -> (TcpStream, Result<wire::AuthChallenge, String>) {
    let mut s = connect(endpoint);
    let mut b = Vec::new();
    hello.encode(&mut b);
    s.write_all(&frame(Kind::AuthHello, &b, 1)).unwrap();
    let (h, body) = read_frame(&mut s);
    let answer = match h.kind {
        Kind::AuthChallenge => Ok(wire::AuthChallenge::decode(&body).unwrap()),
        Kind::Error => {
            let (status, detail) = common::refusal(&body);
            assert_eq!(status, RemoteStatus::Unauthenticated);
            Err(detail)
        }
        k => panic!("{k:?} in answer to a hello"),
    };
    (s, answer)
}

/// The hello an engine sends when it dials the attacker.
fn take_hello(attacker: &TcpListener) -> (TcpStream, wire::AuthHello) {
    let (mut s, _) = attacker.accept().unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let (h, body) = read_frame(&mut s);
    assert_eq!(h.kind, Kind::AuthHello);
    (s, wire::AuthHello::decode(&body).unwrap())
}

/// The relay of issue #27: engine V dials the attacker (as after loading
/// its metadata); the attacker forwards V's hello to engine W (and to V's
/// own listener), the challenge back to V, and would forward V's proof.
/// Every variant is refused, by the side that can tell, and counted.
#[test]
fn a_relayed_handshake_authenticates_nothing_and_every_refusal_is_counted() {
    let mut w = Engine::spawn(&with_auth(""));
    let mut v = Engine::spawn(&with_auth(""));
    let (w_hash, v_hash) = (w.hash(), v.hash());
    let attacker = TcpListener::bind("127.0.0.1:0").unwrap();
    let a_ep = attacker.local_addr().unwrap().to_string();
    let w_addr = w.endpoint.clone();
    let (mut w_refusals, mut v_refusals) = (0, 0);
    // What V may have been told the attacker's epoch is: nothing, W's
    // (the attacker claims to be W), or one of its own.
    for (tag, claimed) in [("none", None), ("as-w", Some(w.epoch)), ("own", Some(0x5eed_a77a))] {
        v.open(tag, &a_ep, claimed);
        let (mut to_v, hello) = take_hello(&attacker);
        assert_eq!((hello.initiator_epoch, hello.responder_epoch), (v.epoch, claimed.unwrap_or(0)));
        assert_eq!(hello.dialed, a_ep, "V names the endpoint it dialed");
        // 1. Verbatim to W: meant for another endpoint.
        let (_, answer) = hello_to(&w_addr, &hello);
        let why = answer.expect_err("W answered a hello meant for the attacker");
        assert!(why.contains("not this engine") || why.contains("meant for epoch"), "{why}");
        w_refusals += 1;
        // 2. Verbatim back to V's own listener: V's own epoch.
        let (_, answer) = hello_to(&v.endpoint, &hello);
        let why = answer.expect_err("V answered its own hello");
        assert!(why.contains("own epoch"), "{why}");
        v_refusals += 1;
        // 3. Rewritten to name W (its endpoint, its address, its epoch):
        // W answers, but its proof is over the rewritten hello, and V's
        // check covers the endpoint V dialed.
        let rewritten =
            wire::AuthHello { dialed: w_addr.clone(), reached: w_addr.clone(), responder_epoch: w.epoch, ..hello };
        let (mut to_w, answer) = hello_to(&w_addr, &rewritten);
        let challenge = answer.expect("W answers a hello meant for it");
        let mut b = Vec::new();
        challenge.encode(&mut b);
        to_v.write_all(&frame(Kind::AuthChallenge, &b, 1)).unwrap();
        let done = v.expect(&format!("DONE {tag} "));
        let expected = match claimed {
            Some(e) if e != w.epoch => "proved epoch",
            _ => "does not match this engine's secret",
        };
        assert!(done.starts_with("ERR") && done.contains(expected), "V: {done}");
        v_refusals += 1;
        // V never sent a proof: the attacker has none for W.
        let mut rest = [0u8; 64];
        assert!(matches!(to_v.read(&mut rest), Ok(0) | Err(_)), "V closed the connection");
        to_w.write_all(&frame(Kind::AuthProof, &[0u8; wire::AUTH_MAC], 2)).unwrap();
        let (h, _) = read_frame(&mut to_w);
        assert_eq!(h.kind, Kind::Error, "W refuses a proof it did not get");
        w_refusals += 1;
    }
    w.stat_reaches("auth_failures", w_refusals);
    v.stat_reaches("auth_failures", v_refusals);
    assert_eq!((w.hash(), v.hash()), (w_hash, v_hash), "no byte changed on either engine");
    // Both keep serving: V and W, genuinely, move bytes.
    let w_ep = w.endpoint.clone();
    v.open("genuine", &w_ep, Some(w.epoch));
    assert_eq!(v.expect("DONE genuine "), "OK");
    assert_eq!(v.ask("write genuine", "WROTE "), "Tcp true");
    assert_ne!(w.hash(), w_hash, "the genuine WRITE landed");
    assert_eq!((w.stats()["auth_failures"], v.stats()["auth_failures"]), (w_refusals, v_refusals));
}

/// Connections that send a hello and never the proof: each is closed at
/// the handshake deadline (counted as an authentication failure), and
/// beyond `max_unauthenticated_connections` the oldest is closed at once
/// (counted as refused), so a genuine peer gets in meanwhile.
#[test]
fn hello_only_connections_expire_and_cannot_keep_a_genuine_peer_out() {
    const CAP: u64 = 8;
    const SQUATTERS: u64 = 40;
    let mut t = Engine::spawn(&with_auth(&format!(
        r#", "server_frame_timeout_ms": 1500, "max_unauthenticated_connections": {CAP}, "max_connections": 64"#
    )));
    let t_hash = t.hash();
    let hello = |s: &TcpStream| wire::AuthHello {
        nonce: [9; wire::AUTH_NONCE],
        initiator_epoch: 77,
        responder_epoch: 0,
        dialed: t.endpoint.clone(),
        reached: s.peer_addr().unwrap().to_string(),
    };
    let start = Instant::now();
    let mut squatters = Vec::new();
    for _ in 0..SQUATTERS {
        let mut s = connect(&t.endpoint);
        let mut b = Vec::new();
        hello(&s).encode(&mut b);
        s.write_all(&frame(Kind::AuthHello, &b, 1)).unwrap();
        squatters.push(s);
    }
    // The oldest were closed as newer ones came: only CAP still wait.
    t.stat_reaches("connections_refused", SQUATTERS - CAP);
    assert_eq!(t.stats()["connections"], CAP);
    // A genuine peer gets in while the squatters fill the cap.
    let mut v = Engine::spawn(&with_auth(""));
    let t_ep = t.endpoint.clone();
    v.open("genuine", &t_ep, Some(t.epoch));
    assert_eq!(v.expect("DONE genuine "), "OK");
    assert_eq!(v.ask("write genuine", "WROTE "), "Tcp true");
    assert_ne!(t.hash(), t_hash);
    // Every squatter is closed by the deadline (from accept, whatever it
    // sent): none is left after it.
    for mut s in squatters {
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {} // the challenge
            }
        }
    }
    assert!(start.elapsed() < Duration::from_millis(1500 + 5000), "closed after {:?}", start.elapsed());
    let genuine = t.stats()["connections"];
    assert!((1..=8).contains(&genuine), "only the genuine peer's connections remain: {genuine}");
    // The squatters the genuine peer's handshakes evicted are counted
    // too; every other squatter missed the deadline.
    let refused = t.stats()["connections_refused"];
    assert!((SQUATTERS - CAP..=SQUATTERS - CAP + 6).contains(&refused), "{refused}");
    t.stat_reaches("auth_failures", SQUATTERS - refused);
}

/// A fake peer whose Describe answers with `descriptor` (then answers a
/// Watch and acknowledges WRITEs without touching anything).
fn fake_peer(descriptor: Vec<u8>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let descriptor = descriptor.clone();
            std::thread::spawn(move || {
                let limits = wire::Limits { max_body: 1 << 20, max_data: 64 << 20 };
                let mut hb = [0u8; wire::HEADER_LEN];
                while s.read_exact(&mut hb).is_ok() {
                    let Ok(h) = wire::decode_header(&hb, limits) else { return };
                    let mut body = vec![0u8; (h.body_len + h.data_len) as usize];
                    if s.read_exact(&mut body).is_err() {
                        return;
                    }
                    let reply = match h.kind {
                        Kind::Describe => frame(Kind::DescribeReply, &descriptor, h.request),
                        Kind::Watch => {
                            let (epoch, since, _) = common::watch_of(&body[..h.body_len as usize]);
                            let delta = orbite_core::segment::Delta { version: since, ..Default::default() };
                            let mut changed = Vec::new();
                            wire::encode_changed(&mut changed, epoch, since, &delta.to_bytes());
                            frame(Kind::Changed, &changed, h.request)
                        }
                        Kind::Write => frame(Kind::WriteAck, &[], h.request),
                        _ => continue,
                    };
                    if s.write_all(&reply).is_err() {
                        return;
                    }
                }
            });
        }
    });
    endpoint
}

/// A peer that presents the victim's own epoch (and local socket) is
/// refused; one that presents only its local socket is not believed to be
/// on this host, and the victim's memory is never the target.
#[test]
fn an_engine_never_peers_with_itself() {
    let mut v = Engine::spawn(r#"{"listen": "127.0.0.1:0", "route": "auto"}"#);
    let v_hash = v.hash();
    let described = |epoch: u64, v: &Engine| {
        SegmentDescriptor {
            rdma_nics: 0,
            endpoint: "127.0.0.1:1".into(),
            epoch,
            registry_version: 1,
            pid: v.child.id(),
            boot_id: orbite_core::segment::local_boot_id(),
            inbox: String::new(),
            local_socket: v.local_socket.clone(),
            registrations: vec![ExportedRegistration {
                rkeys: Vec::new(),
                id: RegistrationId::from_raw(1),
                len: REGION as u64,
                permission: Permission::RemoteReadWrite,
                addr: 0x10_0000,
                shm: None,
                device: None,
            }],
        }
        .to_bytes()
    };
    // Its own epoch, described by a fake: refused.
    let fake = fake_peer(described(v.epoch, &v));
    v.open("own", &fake, None);
    let done = v.expect("DONE own ");
    assert!(done.starts_with("ERR") && done.contains("this engine itself"), "{done}");
    // Its own epoch, expected by the caller: refused before connecting.
    v.open("own2", &fake, Some(v.epoch));
    let done = v.expect("DONE own2 ");
    assert!(done.starts_with("ERR") && done.contains("this engine itself"), "{done}");
    // Another epoch with this engine's own local socket (and pid): the
    // socket is not a proof of a peer on this host; the peer is reached
    // over tcp only, and this engine's memory is untouched.
    let fake = fake_peer(described(0x0123_4567, &v));
    v.open("socket", &fake, None);
    assert_eq!(v.expect("DONE socket "), "OK");
    assert_eq!(v.ask("write socket", "WROTE "), "Tcp true");
    assert_eq!(v.hash(), v_hash, "no byte of the victim changed");
}

/// Reads one frame's header and body (the body up to 64 MiB).
fn reply(s: &mut TcpStream) -> (wire::Header, Vec<u8>) {
    read_frame(s)
}

/// A Notify whose body is `len` bytes (its payload too long for any
/// engine: refused NotificationTooLarge once the body is in).
fn big_notify(epoch: u64, len: usize) -> Vec<u8> {
    let payload = vec![0x11u8; len - 64];
    let env = wire::NotifyEnvelope { sender_endpoint: "x:1", sender_epoch: 9, target_epoch: epoch, payload: &payload };
    let mut b = Vec::new();
    wire::encode_notify(&mut b, &env);
    assert!(b.len() <= len);
    frame(Kind::Notify, &b, 7)
}

/// Idle connections cost a few KiB whatever they carried: 600 of them
/// that each sent a maximal frame, then 600 that each read a Describe of
/// 800 KB, leave the target's memory as it was (before, each kept its
/// largest buffer: +600 MiB). The buffers in use are charged, and beyond
/// `max_frame_buffer_bytes` a frame is refused, never buffered.
#[test]
fn idle_connections_keep_no_buffer_and_buffers_in_use_are_capped() {
    const CONNS: usize = 600;
    let mut t = Engine::spawn(r#"{"listen": "127.0.0.1:0", "max_connections_per_address": 2048}"#);
    let max = 1 << 20; // max_frame_body
    // Warm up (one of each exchange), then the baseline.
    for _ in 0..2 {
        let mut s = connect(&t.endpoint);
        s.write_all(&big_notify(t.epoch, max)).unwrap();
        assert_eq!(reply(&mut s).0.kind, Kind::Error);
    }
    let before = t.rss();
    let mut held = Vec::new();
    for _ in 0..CONNS {
        let mut s = connect(&t.endpoint);
        s.write_all(&big_notify(t.epoch, max)).unwrap();
        let (h, body) = reply(&mut s);
        assert_eq!((h.kind, common::refusal(&body).0), (Kind::Error, RemoteStatus::NotificationTooLarge));
        held.push(s);
    }
    let grown = t.rss().saturating_sub(before);
    assert_eq!(t.stats()["connections"], CONNS as u64);
    assert!(grown < 48 << 20, "{CONNS} idle connections after a maximal frame each: +{} MiB", grown >> 20);
    println!("idle connections after one maximal frame each: +{} KiB for {CONNS}", grown >> 10);
    // A Describe of 800 KB to each of 600 more.
    assert_eq!(t.ask("register 20000", ""), "OK");
    let before = t.rss();
    for _ in 0..CONNS {
        let mut s = connect(&t.endpoint);
        let mut b = Vec::new();
        wire::encode_describe(&mut b, 9, 0);
        s.write_all(&frame(Kind::Describe, &b, 1)).unwrap();
        let (h, body) = reply(&mut s);
        assert_eq!(h.kind, Kind::DescribeReply);
        assert!(body.len() > 700_000, "{}", body.len());
        held.push(s);
    }
    let grown = t.rss().saturating_sub(before);
    assert!(grown < 48 << 20, "{CONNS} idle connections after a long Describe each: +{} MiB", grown >> 20);
    // Nothing is charged between exchanges (the last reply's charge goes
    // once the server saw it out).
    t.stat_reaches("frame_buffer_bytes", 0);
    drop(held);
    t.stat_reaches("connections", 0);

    // The budget: 4 MiB of buffers. Four connections each start a frame
    // of 1 MiB and stop half way: they are charged and wait. Four more
    // send whole frames meanwhile: read, dropped and refused.
    let mut t = Engine::spawn(r#"{"listen": "127.0.0.1:0", "max_frame_buffer_bytes": 4194304}"#);
    let before = t.rss();
    let frames: Vec<Vec<u8>> = (0..8).map(|_| big_notify(t.epoch, max)).collect();
    let mut conns: Vec<TcpStream> = frames.iter().map(|_| connect(&t.endpoint)).collect();
    for (s, f) in conns[..4].iter_mut().zip(&frames) {
        s.write_all(&f[..f.len() / 2]).unwrap();
    }
    let until = Instant::now() + WAIT;
    while t.stats()["frame_buffer_bytes"] < 4 * max as u64 - 4 * 128 {
        assert!(Instant::now() < until, "charged: {}", t.stats()["frame_buffer_bytes"]);
        std::thread::sleep(Duration::from_millis(5));
    }
    let answer = |s: &mut TcpStream| {
        let (h, body) = reply(s);
        assert_eq!(h.kind, Kind::Error);
        common::refusal(&body).0
    };
    for (s, f) in conns[4..].iter_mut().zip(&frames[4..]) {
        s.write_all(f).unwrap();
        assert_eq!(answer(s), RemoteStatus::ResourceExhausted, "a frame beyond the budget");
    }
    assert!(t.stats()["frame_buffer_bytes"] <= 4 << 20, "beyond the budget");
    for (s, f) in conns[..4].iter_mut().zip(&frames) {
        s.write_all(&f[f.len() / 2..]).unwrap();
        assert_eq!(answer(s), RemoteStatus::NotificationTooLarge, "a frame within the budget");
    }
    assert!(t.rss().saturating_sub(before) < 24 << 20, "the dropped frames were not buffered");
    // The connections are still in sync, and the buffers went back.
    for s in &mut conns {
        let mut b = Vec::new();
        wire::encode_describe(&mut b, 9, 0);
        s.write_all(&frame(Kind::Describe, &b, 2)).unwrap();
        assert_eq!(reply(s).0.kind, Kind::DescribeReply);
    }
    t.stat_reaches("frame_buffer_bytes", 0);
}

/// Without authentication, a connection that holds a slot and says
/// nothing is closed after `server_idle_timeout_ms`; an initiator's idle
/// link sends keepalives and stays.
#[test]
fn silent_connections_are_closed_and_idle_links_stay() {
    let t = Engine::spawn(r#"{"listen": "127.0.0.1:0", "server_idle_timeout_ms": 800}"#);
    let mut v = Engine::spawn(r#"{"route": "tcp", "peer_keepalive_ms": 200}"#);
    let mut mute = Engine::spawn(r#"{"route": "tcp", "peer_keepalive_ms": 0}"#);
    let t_ep = t.endpoint.clone();
    v.open("kept", &t_ep, Some(t.epoch));
    assert_eq!(v.expect("DONE kept "), "OK");
    mute.open("mute", &t_ep, Some(t.epoch));
    assert_eq!(mute.expect("DONE mute "), "OK");
    let squatters: Vec<TcpStream> = (0..20).map(|_| connect(&t.endpoint)).collect();
    std::thread::sleep(Duration::from_millis(2500));
    for mut s in squatters {
        let mut b = [0u8; 1];
        assert!(matches!(s.read(&mut b), Ok(0) | Err(_)), "a silent connection was kept");
    }
    // The keepalive link is whole; the one that sent none lost its data
    // connections (its watch connection is never idle).
    assert_eq!(v.ask("write kept", "WROTE "), "Tcp true");
    assert_eq!(mute.ask("write mute", "WROTE "), "Tcp false");
}

/// Subscribes to `t`'s registration changes on a fresh connection and
/// reads the first push: the connection and the version it brought.
fn watch(t: &Engine) -> Result<(TcpStream, u64), String> {
    let mut s = connect(&t.endpoint);
    let mut b = Vec::new();
    wire::encode_watch(&mut b, t.epoch, 0, 1 << 20);
    s.write_all(&frame(Kind::Watch, &b, 1)).unwrap();
    let (h, body) = reply(&mut s);
    match h.kind {
        Kind::Changed => Ok((s, pushed_version(&body))),
        Kind::Error => Err(common::refusal(&body).1),
        k => panic!("{k:?} in answer to a Watch"),
    }
}

fn pushed_version(changed: &[u8]) -> u64 {
    let (_, _, delta) = common::changed_of(changed);
    orbite_core::segment::Delta::decode(delta).unwrap().version
}

/// Watchers that never read: registrations go on (each such watcher is
/// skipped once its socket is full), a watcher that reads again is brought
/// up to date, and watchers are capped in total and per address.
#[test]
fn stalled_watchers_cost_registrations_nothing_and_catch_up_later() {
    const STALLED: usize = 200;
    let mut t = Engine::spawn(r#"{"listen": "127.0.0.1:0", "max_watchers_per_address": 1024}"#);
    let mut stalled = Vec::new();
    for _ in 0..STALLED {
        stalled.push(watch(&t).unwrap());
    }
    assert_eq!(t.stats()["watchers"], STALLED as u64);
    let (_, v0) = stalled[0];
    // 2,000 registrations and 2,000 deregistrations; nobody reads.
    assert_eq!(t.ask("cycle 2000", ""), "OK");
    // One watcher reads again: pushes resume (the server's sweep finds
    // room) until it has the registry's version.
    let (s, _) = &mut stalled[0];
    let mut seen = v0;
    let until = Instant::now() + WAIT;
    while seen < v0 + 4000 {
        assert!(Instant::now() < until, "the watcher stayed at version {seen}");
        let (h, body) = reply(s);
        assert_eq!(h.kind, Kind::Changed);
        seen = seen.max(pushed_version(&body));
    }
    assert_eq!(seen, v0 + 4000);
    drop(stalled);
    t.stat_reaches("watchers", 0);

    // Caps: in total, then per address.
    let t = Engine::spawn(r#"{"listen": "127.0.0.1:0", "max_watchers": 6}"#);
    let six: Vec<_> = (0..6).map(|_| watch(&t).unwrap()).collect();
    let why = watch(&t).unwrap_err();
    assert!(why.contains("max_watchers"), "{why}");
    drop(six);
    let t = Engine::spawn(r#"{"listen": "127.0.0.1:0", "max_watchers_per_address": 3}"#);
    let three: Vec<_> = (0..3).map(|_| watch(&t).unwrap()).collect();
    let why = watch(&t).unwrap_err();
    assert!(why.contains("max_watchers_per_address"), "{why}");
    drop(three);
    // A peer refused a watch opens all the same, and asks instead.
    let mut full = Engine::spawn(r#"{"listen": "127.0.0.1:0", "max_watchers": 1}"#);
    let _one = watch(&full).unwrap();
    let mut v = Engine::spawn(r#"{"route": "tcp"}"#);
    let ep = full.endpoint.clone();
    v.open("unwatched", &ep, Some(full.epoch));
    assert_eq!(v.expect("DONE unwatched "), "OK");
    assert_eq!(v.ask("write unwatched", "WROTE "), "Tcp true");
    assert_eq!(full.stats()["watchers"], 1);
}

/// Borrows show in Stats and are charged, count and bytes; beyond either
/// budget a borrow is refused, and they all end with the connection.
#[test]
fn borrows_are_counted_and_charged() {
    let borrow = |s: &mut TcpStream, t: &Engine, id: u64| -> (Kind, Option<RemoteStatus>) {
        let mut b = Vec::new();
        let d = RemoteDesc { registration: t.region, offset: 0, len: 4096 };
        wire::encode_borrow(&mut b, id, t.epoch, [d].into_iter());
        s.write_all(&frame(Kind::Borrow, &b, id)).unwrap();
        let (h, body) = reply(s);
        (h.kind, (h.kind == Kind::Error).then(|| common::refusal(&body).0))
    };
    // A borrow of one registration costs a pointer and 64 bytes.
    let per = 8 + 64;
    for (config, held) in [(r#""max_borrows": 20"#, 20u64), (r#""max_borrow_bytes": 360"#, 5)] {
        let mut t = Engine::spawn(&format!(r#"{{"listen": "127.0.0.1:0", {config}}}"#));
        let mut s = connect(&t.endpoint);
        for id in 1..=held {
            assert_eq!(borrow(&mut s, &t, id), (Kind::BorrowAck, None), "borrow {id} ({config})");
        }
        let st = t.stats();
        assert_eq!((st["borrows"], st["borrow_bytes"]), (held, held * per));
        let refused = borrow(&mut s, &t, held + 1);
        assert_eq!(refused, (Kind::Error, Some(RemoteStatus::ResourceExhausted)), "{config}");
        drop(s);
        t.stat_reaches("borrows", 0);
        assert_eq!(t.stats()["borrow_bytes"], 0);
    }
}
