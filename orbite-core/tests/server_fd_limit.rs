//! Attack: at the file-descriptor limit the accept loop spun a core and
//! genuine peers timed out. Out of descriptors, the listener now rests
//! and retries; once descriptors are free again every waiting peer is
//! served. The target runs in a child process (this binary again) whose
//! descriptor limit the test lowers and raises with prlimit.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use orbite_core::wire::{self, Kind};

const CHILD_ENV: &str = "ORBITE_TEST_FD_TARGET";

/// The child: a listening engine that says its endpoint, then waits for
/// stdin to close.
#[test]
fn fd_target_entry() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let e = engine(r#"{"listen": "127.0.0.1:0"}"#);
    // Every descriptor number below the highest open one is taken, so a
    // limit just above it leaves exactly the room the test wants.
    let top = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .max()
        .unwrap_or(2);
    let mut fillers = Vec::new();
    loop {
        // SAFETY: dup of an open descriptor, kept open until exit.
        let fd = unsafe { libc::dup(0) };
        if fd < 0 || fd >= top {
            break;
        }
        fillers.push(fd);
    }
    println!("READY {}", e.endpoint().unwrap());
    let _ = std::io::stdout().flush();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    std::process::exit(0);
}

/// The child's highest open descriptor number.
fn top_fd(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
        .max()
        .unwrap_or(2)
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count() as u64
}

fn set_nofile(pid: u32, soft: u64) {
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: prlimit reading the child's limit into a live struct.
    assert_eq!(unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) }, 0);
    let new = libc::rlimit { rlim_cur: soft.min(old.rlim_max), rlim_max: old.rlim_max };
    // SAFETY: prlimit setting the child's limit from a live struct.
    assert_eq!(unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) }, 0);
}

/// CPU time of process `pid` so far, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

fn describe(s: &mut TcpStream, request: u64) -> bool {
    let mut b = Vec::new();
    wire::encode_describe(&mut b, 1, 0);
    let mut f = wire::encode_header(&wire::header(Kind::Describe, b.len(), 0, request)).to_vec();
    f.extend_from_slice(&b);
    if s.write_all(&f).is_err() {
        return false;
    }
    let mut h = [0u8; wire::HEADER_LEN];
    if s.read_exact(&mut h).is_err() {
        return false;
    }
    let Ok(h) = wire::decode_header(&h, wire::Limits { max_body: 1 << 20, max_data: 1 << 30 }) else { return false };
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).is_ok() && h.kind == Kind::DescribeReply
}

#[test]
fn out_of_descriptors_the_listener_rests_and_then_serves_every_peer() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "fd_target_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let endpoint = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "the target child ended");
        // libtest may have printed the test's name on the same line.
        if let Some(at) = line.find("READY ") {
            break line[at + 6..].trim().to_owned();
        }
    };
    // Every number below its top descriptor is taken: the limit leaves
    // room for one more connection, then accept fails.
    assert!(open_fds(pid) > 0);
    set_nofile(pid, top_fd(pid) + 2);
    let mut socks: Vec<TcpStream> = (0..16).map(|_| TcpStream::connect(&endpoint).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let hz = 100.0; // USER_HZ on Linux
    let (c0, t0) = (cpu_ticks(pid), Instant::now());
    std::thread::sleep(Duration::from_millis(1000));
    let busy = (cpu_ticks(pid) - c0) as f64 / hz / t0.elapsed().as_secs_f64();
    set_nofile(pid, 65_536);
    assert!(busy < 0.25, "the target used {:.0}% of a core while out of descriptors", busy * 100.0);
    for (i, s) in socks.iter_mut().enumerate() {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(describe(s, i as u64 + 1), "peer {i} was never served");
    }
    drop(socks);
    drop(child.stdin.take());
    let _ = child.wait();
}
