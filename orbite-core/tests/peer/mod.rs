//! A peer engine in a separate process: the test binary re-executes itself
//! with `ORBITE_TEST_PEER` set and runs only `peer_process_entry`, which
//! serves one region and obeys line commands on stdin.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use crate::common::*;
use orbite_core::*;

pub const PEER_ENV: &str = "ORBITE_TEST_PEER";
pub const REGION: usize = 8 << 20;
/// Where the alias registration starts in the region, and its length.
pub const ALIAS_OFFSET: usize = 1 << 20;
pub const ALIAS_LEN: usize = 2 << 20;

/// Runs the peer loop if this process is a peer; returns otherwise.
pub fn entry() {
    if std::env::var(PEER_ENV).is_err() {
        return;
    }
    let listen = std::env::var("ORBITE_TEST_LISTEN").unwrap_or_else(|_| "127.0.0.1:0".into());
    let e = engine(&format!(r#"{{"listen": "{listen}", "peer_timeout_ms": 3000}}"#));
    let r = region(&e, REGION, Permission::RemoteReadWrite);
    let ro = region(&e, 4096, Permission::RemoteRead);
    // An alias: a second registration over part of the region.
    let alias = e
        .register_memory_ranges(vec![
            MemoryRange::host(&r.mem, ALIAS_OFFSET, ALIAS_LEN, Permission::RemoteReadWrite).unwrap(),
        ])
        .unwrap()[0];
    let shm = e.allocate_shm_memory(REGION).unwrap();
    let shm_id = e
        .register_memory_ranges(vec![MemoryRange::host(&shm, 0, REGION, Permission::RemoteReadWrite).unwrap()])
        .unwrap()[0];
    fill(&r.mem, 0xAB);
    fill(&ro.mem, 0xCD);
    fill(&shm, 0xEF);
    let out = std::io::stdout();
    let say = |s: String| {
        let mut o = out.lock();
        let _ = writeln!(o, "{s}");
        let _ = o.flush();
    };
    say(format!(
        "READY {} {} {} {} {} {}",
        e.endpoint().unwrap(),
        e.source_epoch(),
        r.id.to_raw(),
        ro.id.to_raw(),
        alias.to_raw(),
        shm_id.to_raw()
    ));
    let mut shm = Some((shm, shm_id));
    let mut regions = Some(r);
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["hash", off, len] => {
                let bytes = snapshot(&regions.as_ref().unwrap().mem);
                let (o, l): (usize, usize) = (off.parse().unwrap(), len.parse().unwrap());
                say(format!("HASH {}", fnv(&bytes[o..o + l])));
            }
            ["shash", off, len] => {
                let bytes = snapshot(&shm.as_ref().unwrap().0);
                let (o, l): (usize, usize) = (off.parse().unwrap(), len.parse().unwrap());
                say(format!("HASH {}", fnv(&bytes[o..o + l])));
            }
            ["struncate"] => {
                // The owner tries to shrink its own shared allocation under
                // its peers' mappings (every memfd of this process).
                let mut tried = 0;
                let mut shrunk = 0;
                for f in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
                    let target = std::fs::read_link(f.path()).unwrap_or_default();
                    if target.to_string_lossy().starts_with("/memfd:orbite-") {
                        let fd: i32 = f.file_name().to_string_lossy().parse().unwrap();
                        tried += 1;
                        // SAFETY: ftruncate on a descriptor of this process.
                        if unsafe { libc::ftruncate(fd, 0) } == 0 {
                            shrunk += 1;
                        }
                    }
                }
                say(format!("OK {tried} {shrunk}"));
            }
            ["sdereg"] => {
                e.deregister(shm.as_ref().unwrap().1).unwrap();
                say("OK".into());
            }
            ["sdrop"] => {
                shm = None;
                say("OK".into());
            }
            ["fill", seed] => {
                fill(&regions.as_ref().unwrap().mem, seed.parse().unwrap());
                say("OK".into());
            }
            ["hold", on] => {
                e.hold_remote_requests(*on == "on");
                say("OK".into());
            }
            ["wait_held", n] => {
                let held = e.wait_remote_requests_held(n.parse().unwrap(), Duration::from_secs(30));
                say(if held { "OK".into() } else { "ERR not held".into() });
            }
            ["dereg"] => {
                let id = regions.as_ref().unwrap().id;
                e.deregister(id).unwrap();
                say("OK".into());
            }
            ["drop_region"] => {
                regions = None;
                say("OK".into());
            }
            ["stats"] => {
                let s = e.stats();
                say(format!(
                    "STATS {} {} {} {}",
                    s.registrations, s.fenced_registrations, s.host_allocations, s.notification_bytes
                ));
            }
            ["notifs"] => {
                let n = e.take_notifications();
                let hex: Vec<String> =
                    n.iter().map(|n| n.payload.iter().map(|b| format!("{b:02x}")).collect()).collect();
                say(format!("NOTIFS {} {}", n.len(), hex.join(",")));
            }
            ["quit"] => break,
            _ => say(format!("ERR unknown command {line}")),
        }
    }
    std::process::exit(0);
}

pub struct PeerProcess {
    pub child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub endpoint: String,
    pub epoch: u64,
    pub region: RegistrationId,
    pub read_only: RegistrationId,
    pub alias: RegistrationId,
    pub shm: RegistrationId,
}

impl PeerProcess {
    pub fn spawn() -> PeerProcess {
        Self::spawn_on("127.0.0.1:0")
    }

    // The child is waited for by `PeerProcess::drop` (and before the panic
    // below); clippy cannot see through the struct.
    #[allow(clippy::zombie_processes)]
    pub fn spawn_on(listen: &str) -> PeerProcess {
        Self::spawn_wrapped(&[], listen)
    }

    /// [`Self::spawn_on`] under a wrapper command (`wrapper` then the test
    /// binary and its arguments): `ip netns exec NS`, `unshare --pid`.
    #[allow(clippy::zombie_processes)]
    pub fn spawn_wrapped(wrapper: &[&str], listen: &str) -> PeerProcess {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let mut child = cmd
            .args(["peer_process_entry", "--exact", "--nocapture", "--test-threads=1", "-q"])
            .env(PEER_ENV, "1")
            .env("ORBITE_TEST_LISTEN", listen)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        loop {
            let mut line = String::new();
            if stdout.read_line(&mut line).unwrap_or(0) == 0 {
                let _ = child.kill();
                let _ = child.wait();
                panic!("peer exited before READY");
            }
            if let Some(rest) = line.strip_prefix("READY ") {
                let w: Vec<&str> = rest.split_whitespace().collect();
                return PeerProcess {
                    child,
                    stdin,
                    stdout,
                    endpoint: w[0].to_owned(),
                    epoch: w[1].parse().unwrap(),
                    region: RegistrationId::from_raw(w[2].parse().unwrap()),
                    read_only: RegistrationId::from_raw(w[3].parse().unwrap()),
                    alias: RegistrationId::from_raw(w[4].parse().unwrap()),
                    shm: RegistrationId::from_raw(w[5].parse().unwrap()),
                };
            }
        }
    }

    pub fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        loop {
            let mut line = String::new();
            assert!(self.stdout.read_line(&mut line).unwrap() > 0, "peer exited on `{cmd}`");
            let line = line.trim().to_owned();
            if line.starts_with("OK")
                || line.starts_with("HASH")
                || line.starts_with("STATS")
                || line.starts_with("NOTIFS")
                || line.starts_with("ERR")
            {
                return line;
            }
        }
    }

    pub fn shm_hash(&mut self, off: usize, len: usize) -> u64 {
        self.ask(&format!("shash {off} {len}")).trim_start_matches("HASH ").parse().unwrap()
    }

    pub fn hash(&mut self, off: usize, len: usize) -> u64 {
        self.ask(&format!("hash {off} {len}")).trim_start_matches("HASH ").parse().unwrap()
    }

    /// The region's bytes as the peer filled them with `seed`.
    pub fn initial(seed: u64) -> Vec<u8> {
        let mut rng = Rng(seed);
        let mut bytes = vec![0u8; REGION];
        for chunk in bytes.chunks_mut(8) {
            let v = rng.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
        bytes
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn open(&self, e: &TransferEngine) -> RemoteSegment {
        e.open_segment(&self.endpoint, Some(self.epoch), Duration::from_secs(10)).unwrap()
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        std::thread::sleep(Duration::from_millis(5));
        self.kill();
    }
}
