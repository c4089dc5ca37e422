//! Containers on one node: processes that share a kernel (the same boot
//! id) but not a pid namespace, or not a network namespace either. Built
//! from namespaces this test creates (root only; otherwise it prints SKIP
//! and why), with addresses only inside them, removed at the end.
//!
//! Same host is proven over the peer's local socket, never taken from what
//! the peer says: a peer in another network namespace cannot be reached
//! there, so it is remote and TCP carries the bytes; a peer in another pid
//! namespace is reached by the pid the kernel reports, not the one it
//! names (its own namespace's).

mod common;
mod peer;

use std::process::Command;

use common::*;
use orbite_core::*;
use peer::{PeerProcess, REGION};

#[test]
fn peer_process_entry() {
    peer::entry();
}

/// Why these tests cannot run here, if they cannot.
fn missing() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (namespaces need CAP_SYS_ADMIN)".into());
    }
    for tool in ["ip", "unshare"] {
        let flag = if tool == "ip" { "-V" } else { "--version" };
        let found = Command::new(tool).arg(flag).output().is_ok_and(|o| o.status.success());
        if !found {
            return Some(format!("`{tool}` is not installed"));
        }
    }
    None
}

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Two network namespaces joined by a veth pair, removed when dropped.
struct Hosts {
    a: String,
    b: String,
    addr_b: String,
}

impl Hosts {
    fn new() -> Hosts {
        let id = std::process::id() % 200 + 20;
        let (a, b) = (format!("orbite-ct-{}-a", std::process::id()), format!("orbite-ct-{}-b", std::process::id()));
        let (va, vb) = (format!("oct{id}a"), format!("oct{id}b"));
        let hosts = Hosts { a: a.clone(), b: b.clone(), addr_b: format!("10.213.{id}.2") };
        sh(&["ip", "netns", "add", &a]);
        sh(&["ip", "netns", "add", &b]);
        sh(&["ip", "link", "add", &va, "netns", &a, "type", "veth", "peer", "name", &vb, "netns", &b]);
        for (ns, dev, ip) in [(&a, &va, format!("10.213.{id}.1/24")), (&b, &vb, format!("10.213.{id}.2/24"))] {
            sh(&["ip", "-n", ns, "addr", "add", &ip, "dev", dev]);
            sh(&["ip", "-n", ns, "link", "set", dev, "up"]);
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        hosts
    }

    /// Moves the calling thread (and the threads it starts from now on)
    /// into namespace `a`.
    fn enter_a(&self) {
        let f = std::fs::File::open(format!("/var/run/netns/{}", self.a)).unwrap();
        // SAFETY: setns on a descriptor of a network namespace file; it
        // changes only this thread's namespace.
        let r = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&f), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// Writes the first `len` bytes of the peer's region from `local` and reads
/// them back into another range, over the route the policy picks; checks
/// the peer's bytes and the guard bytes after them.
fn round_trip(e: &TransferEngine, p: &mut PeerProcess, seg: &RemoteSegment, want: Route, why: &str) {
    let len = 1 << 20;
    let local = region(e, 2 * len, Permission::RemoteReadWrite);
    fill(&local.mem, 77);
    let sent = snapshot(&local.mem)[..len].to_vec();
    let guard = p.hash(len, REGION - len);
    let (l, r) = ([Desc::new(local.id, 0, len as u64)], [Desc::new(p.region, 0, len as u64)]);
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Peer(seg))).unwrap();
    let choice = t.route();
    assert_eq!(choice.route, want, "{choice:?}");
    assert!(choice.reason.contains(why), "the reason says why ({why}): {choice:?}");
    t.post().unwrap();
    assert_eq!(wait_retired(&t).outcome.code, OutcomeCode::Success);
    assert_eq!(p.hash(0, len), fnv(&sent), "the peer's bytes");
    assert_eq!(p.hash(len, REGION - len), guard, "bytes after the written range");
    let back = [Desc::new(local.id, len as u64, len as u64)];
    let t = e.prepare(&TransferSpec::new(Op::Read, &back, &r, Target::Peer(seg))).unwrap();
    assert_eq!(t.route().route, want);
    t.post().unwrap();
    assert_eq!(wait_retired(&t).outcome.code, OutcomeCode::Success);
    assert_eq!(&snapshot(&local.mem)[len..], &sent[..], "read back");
}

/// Containers with their own network and pid namespaces on one node: the
/// same boot id, but the peer's local socket lives in its own network
/// namespace. Same-host routes are refused (asked for, they fail at
/// prepare), TCP carries correct bytes, and nothing outside the written
/// range of the true peer changes.
#[test]
fn a_peer_in_other_network_and_pid_namespaces_is_remote() {
    if let Some(why) = missing() {
        println!("SKIP: {why}");
        return;
    }
    let hosts = Hosts::new();
    let listen = format!("{}:0", hosts.addr_b);
    let mut p = PeerProcess::spawn_wrapped(
        &["ip", "netns", "exec", &hosts.b, "unshare", "--pid", "--fork", "--kill-child"],
        &listen,
    );
    hosts.enter_a();
    let e = engine(r#"{"peer_timeout_ms": 3000}"#);
    let seg = p.open(&e);
    assert_eq!(seg.descriptor().boot_id, segment::local_boot_id(), "one kernel: the same boot id");
    assert_ne!(seg.descriptor().pid, p.child.id(), "the peer names its own namespace's pid");
    for policy in [RoutePolicy::Cma, RoutePolicy::Shm] {
        let local = region(&e, 4096, Permission::RemoteReadWrite);
        let (l, r) = ([Desc::new(local.id, 0, 4096)], [Desc::new(p.region, 0, 4096)]);
        let mut s = TransferSpec::new(Op::Write, &l, &r, Target::Peer(&seg));
        s.options.route = Some(policy);
        let refused = e.prepare(&s);
        assert!(matches!(refused, Err(Error::Peer(PeerError::RouteUnavailable { .. }))), "{policy:?}: {refused:?}");
    }
    round_trip(&e, &mut p, &seg, Route::Tcp, "nothing listens on the local socket");
    drop(seg);
    drop(e);
    drop(p);
}

/// Containers sharing the node's network but each with its own pid
/// namespace (host networking): the peer's local socket is reachable and
/// proves it; CMA goes to the pid the kernel reports for it here, not the
/// one it names in its namespace, and the bytes land in the true peer.
#[test]
fn a_peer_in_another_pid_namespace_is_reached_by_its_real_pid() {
    if let Some(why) = missing() {
        println!("SKIP: {why}");
        return;
    }
    let mut p = PeerProcess::spawn_wrapped(&["unshare", "--pid", "--fork", "--kill-child"], "127.0.0.1:0");
    let e = engine(r#"{"peer_timeout_ms": 3000}"#);
    let seg = p.open(&e);
    let named = seg.descriptor().pid;
    assert!(named <= 3, "inside its namespace the peer is pid {named}");
    round_trip(&e, &mut p, &seg, Route::Cma, "CMA");
    drop(seg);
    drop(e);
    drop(p);
}
