//! Peers found by name through a real etcd server (feature `etcd`),
//! started here on loopback with a data directory of its own: publish and
//! resolve; a name withdrawn on close; an engine killed (its name gone
//! within the lease's TTL) and restarted (its new epoch published, the old
//! one fenced); etcd unreachable at start and mid-run (a clear error within
//! the bound, while open peers keep moving bytes), then back (the name
//! published again).
//!
//! Needs Debian's etcd-server (`etcd` on PATH, or `ORBITE_ETCD`); without
//! it each test prints SKIP, unless `ORBITE_ETCD_REQUIRED` is set.
#![cfg(feature = "etcd")]

mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use orbite_core::discovery::DiscoveryError;
use orbite_core::{Desc, Error, Op, Permission, RegistrationId, RemoteSegment, Target, TransferEngine, TransferSpec};

/// An etcd server on loopback; killed and its directory removed on drop.
struct Etcd {
    child: Option<Child>,
    dir: std::path::PathBuf,
    client: u16,
    peer: u16,
    bin: String,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Etcd {
    /// Starts one, or says SKIP (None) where there is no etcd.
    fn start(test: &str) -> Option<Etcd> {
        let bin = std::env::var("ORBITE_ETCD").unwrap_or_else(|_| "etcd".into());
        if Command::new(&bin).arg("--version").output().map_or(true, |o| !o.status.success()) {
            assert!(
                std::env::var_os("ORBITE_ETCD_REQUIRED").is_none(),
                "ORBITE_ETCD_REQUIRED, and no etcd ({bin}; apt-get install etcd-server)"
            );
            println!("SKIP {test}: no etcd server ({bin}; apt-get install etcd-server)");
            return None;
        }
        let dir = std::env::temp_dir().join(format!("orbite-etcd-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut e = Etcd { child: None, dir, client: free_port(), peer: free_port(), bin };
        e.run();
        Some(e)
    }

    /// Starts the server (again) on its ports and directory, and waits for
    /// it to answer.
    fn run(&mut self) {
        let (c, p) = (format!("http://127.0.0.1:{}", self.client), format!("http://127.0.0.1:{}", self.peer));
        let child = Command::new(&self.bin)
            .args(["--name", "orbite-test", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
            .args(["--listen-peer-urls", &p, "--initial-advertise-peer-urls", &p])
            .args(["--initial-cluster", &format!("orbite-test={p}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            // Ready when it answers its health endpoint.
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.client)) {
                use std::io::{Read, Write};
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let _ = s.write_all(b"GET /health HTTP/1.0\r\n\r\n");
                let mut out = String::new();
                let _ = s.read_to_string(&mut out);
                if out.contains("\"health\":\"true\"") {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "etcd did not become healthy");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn named(store: &str, name: &str, extra: &str) -> TransferEngine {
    engine(&format!(r#"{{"listen": "127.0.0.1:0", "metadata": "{store}", "name": "{name}"{extra}}}"#))
}

fn resolver(store: &str) -> TransferEngine {
    engine(&format!(
        r#"{{"listen": "127.0.0.1:0", "route": "tcp", "metadata": "{store}", "metadata_timeout_ms": 1000}}"#
    ))
}

/// Writes 1 MiB of `seed`'s bytes to the peer's registration `remote`.
fn write_to(init: &TransferEngine, seg: &RemoteSegment, remote: RegistrationId, seed: u64) -> Result<(), Error> {
    let src = region(init, 1 << 20, Permission::LocalOnly);
    fill(&src.mem, seed);
    let (l, r) = ([Desc::new(src.id, 0, 1 << 20)], [Desc::new(remote, 0, 1 << 20)]);
    let t = init.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(seg)))?;
    t.post()?;
    let res = wait_retired(&t);
    assert!(res.outcome.is_success(), "{res:?}");
    t.release().map_err(|r| r.error)?;
    init.deregister(src.id)?;
    Ok(())
}

#[test]
fn a_name_is_published_resolved_opened_and_withdrawn_on_close() {
    let Some(etcd) = Etcd::start("publish") else { return };
    let target = named(&etcd.url(), "prefill-0", "");
    let dst = region(&target, 1 << 20, Permission::RemoteReadWrite);
    let init = resolver(&etcd.url());

    let rec = init.resolve_name("prefill-0").unwrap();
    assert_eq!((rec.endpoint.clone(), rec.epoch), (target.endpoint().unwrap(), target.source_epoch()));
    assert!(rec.routes.iter().any(|r| r == "tcp"), "{rec:?}");
    let seg = init.open_segment_by_name("prefill-0", WAIT).unwrap();
    assert_eq!(seg.epoch(), target.source_epoch());
    write_to(&init, &seg, dst.id, 7).unwrap();
    let mut want = vec![0u8; 1 << 20];
    let probe = target.allocate_host_memory(1 << 20).unwrap();
    fill(&probe, 7);
    // SAFETY: both blocks are 1 MiB, and no transfer touches them now.
    unsafe { probe.read(0, &mut want) };
    assert_eq!(snapshot(&dst.mem), want);

    for (name, want) in [("decode-9", "NotFound"), ("a b", "InvalidName")] {
        let e = init.open_segment_by_name(name, WAIT).unwrap_err();
        assert!(format!("{e:?}").contains(want), "{name}: {e:?}");
    }
    // A resolver without a store, and a name without listen or store.
    let plain = engine("{}");
    assert!(matches!(
        plain.open_segment_by_name("prefill-0", WAIT),
        Err(Error::Discovery(DiscoveryError::NotConfigured))
    ));
    for bad in [
        r#"{"name": "x"}"#.to_owned(),
        format!(r#"{{"metadata": "{}", "name": "x"}}"#, etcd.url()),
        r#"{"metadata": "http://127.0.0.1:1"}"#.to_owned(),
        format!(r#"{{"metadata": "{}", "metadata_ttl_ms": 1500}}"#, etcd.url()),
    ] {
        assert!(matches!(TransferEngine::from_json(&bad), Err(Error::Config(_))), "{bad}");
    }

    // Closing withdraws the name at once; the resolver keeps its segment
    // (lost now) and its store.
    drop(seg);
    let _ = target.close();
    assert!(matches!(init.resolve_name("prefill-0"), Err(Error::Discovery(DiscoveryError::NotFound(_)))));
    assert_idle(&init);
}

/// The engine of a child process (`ORBITE_ETCD_CHILD`: its config): prints
/// `CHILD <endpoint> <epoch> <registration>` and lives until killed.
#[test]
fn child_engine() {
    let Ok(config) = std::env::var("ORBITE_ETCD_CHILD") else { return };
    let e = engine(&config);
    let r = region(&e, 1 << 20, Permission::RemoteReadWrite);
    println!("CHILD {} {} {}", e.endpoint().unwrap(), e.source_epoch(), r.id.to_raw());
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

struct ChildEngine {
    child: Child,
    epoch: u64,
    registration: RegistrationId,
    endpoint: String,
}

fn spawn_child(config: &str) -> ChildEngine {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["child_engine", "--exact", "--nocapture", "--test-threads", "1"])
        .env("ORBITE_ETCD_CHILD", config)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    for line in out.lines() {
        let line = line.unwrap();
        // The harness may have written "test child_engine ... " first.
        if let Some(rest) = line.split_once("CHILD ").map(|(_, r)| r) {
            let f: Vec<&str> = rest.split(' ').collect();
            return ChildEngine {
                child,
                endpoint: f[0].to_owned(),
                epoch: f[1].parse().unwrap(),
                registration: RegistrationId::from_raw(f[2].parse().unwrap()),
            };
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("the child engine did not start");
}

impl Drop for ChildEngine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_dead_engine_leaves_within_its_ttl_and_a_restarted_one_fences_the_old() {
    let Some(etcd) = Etcd::start("death") else { return };
    let port = free_port();
    let config = format!(
        r#"{{"listen": "127.0.0.1:{port}", "metadata": "{}", "name": "prefill-1", "metadata_ttl_ms": 2000}}"#,
        etcd.url()
    );
    let init = resolver(&etcd.url());
    let mut first = spawn_child(&config);
    let old = init.open_segment_by_name("prefill-1", WAIT).unwrap();
    assert_eq!((old.endpoint(), old.epoch()), (first.endpoint.as_str(), first.epoch));
    write_to(&init, &old, first.registration, 1).unwrap();

    // Killed: no withdrawal; the lease expires.
    let _ = first.child.kill();
    let _ = first.child.wait();
    let killed = Instant::now();
    loop {
        match init.resolve_name("prefill-1") {
            Err(Error::Discovery(DiscoveryError::NotFound(_))) => break,
            Ok(_) => {}
            Err(e) => panic!("{e:?}"),
        }
        // The TTL, plus etcd's expiry sweep (it checks leases every 500 ms).
        assert!(killed.elapsed() < Duration::from_millis(2000 + 1500), "the name outlived its TTL");
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("name gone {} ms after the kill (TTL 2000 ms)", killed.elapsed().as_millis());

    // Restarted on the same endpoint: a new epoch under the same name.
    let second = spawn_child(&config);
    assert_ne!(second.epoch, first.epoch);
    let rec = init.resolve_name("prefill-1").unwrap();
    assert_eq!((rec.endpoint.as_str(), rec.epoch), (second.endpoint.as_str(), second.epoch));
    let new = init.open_segment_by_name("prefill-1", WAIT).unwrap();
    assert_eq!(new.epoch(), second.epoch);
    // The old run's segment is fenced: refused, never sent to the new run.
    assert!(old.usable().is_err());
    let err = write_to(&init, &old, first.registration, 2).unwrap_err();
    assert!(matches!(err, Error::Peer(_)), "{err:?}");
    write_to(&init, &new, second.registration, 3).unwrap();
    drop((old, new));
    assert_idle(&init);
}

#[test]
fn an_unreachable_store_fails_within_the_bound_and_open_peers_keep_working() {
    // Nothing listens: the engine does not start, and says why, in time.
    let dead = format!("etcd://127.0.0.1:{}", free_port());
    let t0 = Instant::now();
    let e = TransferEngine::from_json(&format!(
        r#"{{"listen": "127.0.0.1:0", "metadata": "{dead}", "name": "x", "metadata_timeout_ms": 500}}"#
    ))
    .map(|_| ())
    .unwrap_err();
    assert!(matches!(e, Error::Discovery(DiscoveryError::Unreachable { .. })), "{e:?}");
    assert!(t0.elapsed() < Duration::from_millis(2500), "{:?}", t0.elapsed());
    assert!(e.to_string().contains(&dead), "{e}");

    let Some(mut etcd) = Etcd::start("unreachable") else { return };
    let target = named(&etcd.url(), "prefill-2", r#", "metadata_ttl_ms": 3000"#);
    let dst = region(&target, 1 << 20, Permission::RemoteReadWrite);
    let init = resolver(&etcd.url());
    let seg = init.open_segment_by_name("prefill-2", WAIT).unwrap();

    etcd.kill();
    let t0 = Instant::now();
    let e = init.open_segment_by_name("prefill-2", WAIT).unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(e, Error::Discovery(DiscoveryError::Unreachable { .. })), "{e:?}");
    assert!(took < Duration::from_millis(1000 + 1000), "{took:?} for a bound of 1000 ms");
    // The open peer does not need the store.
    for seed in 0..3 {
        write_to(&init, &seg, dst.id, seed).unwrap();
    }

    // Back, after longer than the TTL: the target's name is there again
    // (kept alive, or granted anew and published again).
    std::thread::sleep(Duration::from_millis(3500));
    etcd.run();
    let t0 = Instant::now();
    loop {
        match init.resolve_name("prefill-2") {
            Ok(rec) => {
                assert_eq!(rec.epoch, target.source_epoch());
                break;
            }
            Err(e) => assert!(t0.elapsed() < Duration::from_secs(10), "not published again: {e:?}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("published again {} ms after etcd came back", t0.elapsed().as_millis());
    write_to(&init, &seg, dst.id, 9).unwrap();
    drop(seg);
    assert_idle(&init);
}

/// A TCP relay to the store that can be cut: a partition between one
/// engine and the store, which stays up for everyone else.
struct Relay {
    port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    fn new(to: u16) -> Relay {
        use std::sync::atomic::Ordering;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let c = cut.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(a) = s else { continue };
                if c.load(Ordering::Acquire) {
                    continue; // dropped: refused
                }
                let Ok(b) = std::net::TcpStream::connect(("127.0.0.1", to)) else { continue };
                for (mut from, mut into) in [(a.try_clone().unwrap(), b.try_clone().unwrap()), (b, a)] {
                    let c = c.clone();
                    std::thread::spawn(move || {
                        use std::io::{Read, Write};
                        let _ = from.set_read_timeout(Some(Duration::from_millis(100)));
                        let mut buf = [0u8; 16384];
                        loop {
                            if c.load(Ordering::Acquire) {
                                break;
                            }
                            match from.read(&mut buf) {
                                Ok(0) => break,
                                Ok(n) if into.write_all(&buf[..n]).is_ok() => {}
                                Ok(_) => break,
                                Err(e)
                                    if e.kind() == std::io::ErrorKind::WouldBlock
                                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                                Err(_) => break,
                            }
                        }
                        let _ = from.shutdown(std::net::Shutdown::Both);
                        let _ = into.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Relay { port, cut }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.store(cut, std::sync::atomic::Ordering::Release);
    }
}

#[test]
fn a_partition_from_the_store_longer_than_the_ttl_heals_by_publishing_again() {
    let Some(etcd) = Etcd::start("partition") else { return };
    let relay = Relay::new(etcd.client);
    let target = named(
        &format!("etcd://127.0.0.1:{}", relay.port),
        "prefill-3",
        r#", "metadata_ttl_ms": 2000, "metadata_timeout_ms": 500"#,
    );
    let dst = region(&target, 1 << 20, Permission::RemoteReadWrite);
    let init = resolver(&etcd.url());
    let seg = init.open_segment_by_name("prefill-3", WAIT).unwrap();

    // Cut off from the store, the target cannot keep its lease: the store
    // forgets the name, while the peer already open keeps working.
    relay.set_cut(true);
    let t0 = Instant::now();
    while init.resolve_name("prefill-3").is_ok() {
        assert!(t0.elapsed() < Duration::from_secs(6), "the name outlived its lease");
        std::thread::sleep(Duration::from_millis(100));
    }
    write_to(&init, &seg, dst.id, 4).unwrap();

    // Healed: the target grants a new lease and publishes again.
    relay.set_cut(false);
    let t0 = Instant::now();
    let rec = loop {
        if let Ok(rec) = init.resolve_name("prefill-3") {
            break rec;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "not published again");
        std::thread::sleep(Duration::from_millis(100));
    };
    println!("published again {} ms after the partition healed", t0.elapsed().as_millis());
    assert_eq!((rec.endpoint, rec.epoch), (target.endpoint().unwrap(), target.source_epoch()));

    // Cut off again, and replaced meanwhile under the same name: healed,
    // the first engine does not take the name back from its replacement.
    relay.set_cut(true);
    let t0 = Instant::now();
    while init.resolve_name("prefill-3").is_ok() {
        assert!(t0.elapsed() < Duration::from_secs(6), "the name outlived its lease");
        std::thread::sleep(Duration::from_millis(100));
    }
    let replacement = named(&etcd.url(), "prefill-3", "");
    relay.set_cut(false);
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(init.resolve_name("prefill-3").unwrap().epoch, replacement.source_epoch());
    drop(seg);
    // Closing the first engine leaves the replacement's name alone.
    let _ = target.close();
    assert_eq!(init.resolve_name("prefill-3").unwrap().epoch, replacement.source_epoch());
    let _ = replacement.close();
    assert!(init.resolve_name("prefill-3").is_err(), "withdrawn on close");
}
