//! The verbs objects against the test verbs library (`orbite-verbs-shim`,
//! found at `ORBITE_VERBS_SHIM`; SKIP without it unless
//! `ORBITE_VERBS_REQUIRED`): two queue pairs of its default NIC
//! connected to each other over its fabric move bytes with WRITE, READ
//! and SEND, refuse what a NIC refuses, flush after an error, and leave
//! nothing open.

use std::ffi::c_int;
use std::net::Ipv6Addr;
use std::sync::Arc;

use super::super::loader;
use super::*;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct ShimStats {
    device_lists: i64,
    contexts: i64,
    pds: i64,
    mrs: i64,
    cqs: i64,
    channels: i64,
    qps: i64,
}

/// Held by each test that makes shim objects in this process: the
/// counters and a port taken down are the process's.
static SHIM_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The shim's fault controls: `orbite_verbs_shim_inject(qpn, fault, arg)`
/// and `orbite_verbs_shim_port(device, port, up)`.
type Inject = unsafe extern "C" fn(u32, c_int, u32) -> c_int;
type PortState = unsafe extern "C" fn(u32, u8, c_int) -> c_int;

fn faults() -> (Inject, PortState) {
    let path = std::ffi::CString::new(std::env::var("ORBITE_VERBS_SHIM").unwrap()).unwrap();
    // SAFETY: a library this process loaded (never closed).
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    // SAFETY: a live handle and NUL-terminated names.
    let (inject, port) = unsafe {
        (
            libc::dlsym(handle, c"orbite_verbs_shim_inject".as_ptr()),
            libc::dlsym(handle, c"orbite_verbs_shim_port".as_ptr()),
        )
    };
    assert!(!inject.is_null() && !port.is_null());
    // SAFETY: the shim's exports of these signatures.
    unsafe {
        (
            std::mem::transmute::<*mut libc::c_void, Inject>(inject),
            std::mem::transmute::<*mut libc::c_void, PortState>(port),
        )
    }
}

/// The shim, loaded as the library of these tests, and its counters.
fn shim() -> Option<(&'static Library, impl Fn() -> ShimStats)> {
    let Some(path) = std::env::var_os("ORBITE_VERBS_SHIM") else {
        assert!(std::env::var_os("ORBITE_VERBS_REQUIRED").is_none(), "ORBITE_VERBS_REQUIRED without ORBITE_VERBS_SHIM");
        println!("SKIP: no ORBITE_VERBS_SHIM (scripts/verbs-shim builds the test verbs library)");
        return None;
    };
    let path = path.to_str().expect("a UTF-8 path").to_owned();
    let lib: &'static Library = Box::leak(Box::new(loader::load(&path).expect("the shim loads")));
    let c = std::ffi::CString::new(path).unwrap();
    // SAFETY: a NUL-terminated path of a library loaded above (never closed).
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    assert!(!handle.is_null());
    // SAFETY: a live handle and a NUL-terminated name.
    let f = unsafe { libc::dlsym(handle, c"orbite_verbs_shim_stats".as_ptr()) };
    assert!(!f.is_null());
    // SAFETY: the shim's export of this signature.
    let f: unsafe extern "C" fn(*mut ShimStats) -> c_int = unsafe { std::mem::transmute(f) };
    let stats = move || {
        let mut s = ShimStats::default();
        // SAFETY: a struct of the shim's layout.
        assert_eq!(unsafe { f(&mut s) }, 0);
        s
    };
    Some((lib, stats))
}

/// The shim's default NIC: port 1, GID 1 is `::ffff:127.0.0.1` (RoCE v2).
const PORT: u8 = 1;
const SGID: u8 = 1;

fn gid() -> Ipv6Addr {
    Ipv6Addr::from([0, 0, 0, 0, 0, 0xffff, 0x7f00, 1])
}

/// Two queue pairs connected to each other, each allowing remote reads
/// and writes.
fn pair(pd: &Arc<Pd>, cq: &Arc<Cq>) -> (Qp, Qp) {
    let all = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
    let (a, b) = (pd.create_qp(cq, 64).unwrap(), pd.create_qp(cq, 64).unwrap());
    for (q, other) in [(&a, b.qpn), (&b, a.qpn)] {
        q.to_init(PORT, all).unwrap();
        q.to_rtr(RemoteQp { gid: gid(), qpn: other, psn: 0 }, PORT, SGID, 4096).unwrap();
        q.to_rts(0).unwrap();
    }
    (a, b)
}

/// Completions until `n` have come (the shim completes on its threads).
fn wait(cq: &Cq, n: usize) -> Vec<Completion> {
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut buf = [Completion::default(); 16];
    while got.len() < n {
        let k = cq.poll(&mut buf).unwrap();
        got.extend_from_slice(&buf[..k]);
        assert!(std::time::Instant::now() < deadline, "completions: {got:?}");
        std::thread::yield_now();
    }
    got
}

fn sge(buf: &[u8], mr: &Mr) -> Sge {
    Sge { addr: buf.as_ptr() as u64, length: buf.len() as u32, lkey: mr.lkey }
}

#[test]
fn queue_pairs_move_bytes_refuse_bad_keys_flush_after_errors_and_close_everything() {
    let Some((lib, stats)) = shim() else { return };
    let _one = SHIM_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let before = stats();
    {
        let dev = Device::open_in(lib, "shim0").unwrap();
        assert_eq!(dev.name, "shim0");
        assert_eq!(
            Device::open_in(lib, "mlx5_9").err().map(|e| e.to_string()).as_deref(),
            Some("ibv_open_device failed: mlx5_9: no such NIC")
        );
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(256).unwrap();
        let src: Vec<u8> = (0..65536u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; 65536];
        let mut back = vec![0u8; 65536];
        let all = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
        // SAFETY (each): buffers of this test that outlive their regions.
        let src_mr = unsafe { pd.register(src.as_ptr() as u64, src.len() as u64, access::LOCAL_WRITE) }.unwrap();
        let dst_mr = unsafe { pd.register(dst.as_mut_ptr() as u64, dst.len() as u64, all) }.unwrap();
        let back_mr = unsafe { pd.register(back.as_mut_ptr() as u64, back.len() as u64, access::LOCAL_WRITE) }.unwrap();
        assert_ne!(dst_mr.lkey, dst_mr.rkey);
        let (a, b) = pair(&pd, &cq);

        // WRITE in two requests of one chain, one signaled; then READ back.
        let half = 32768;
        let write = |id, off: usize, signaled| WorkRequest {
            id,
            verb: Verb::Write { remote_addr: dst.as_ptr() as u64 + off as u64, rkey: dst_mr.rkey },
            local: sge(&src[off..off + half], &src_mr),
            signaled,
        };
        a.post(&[write(1, 0, false), write(2, half, true)]).unwrap();
        let done = wait(&cq, 1);
        assert_eq!((done[0].id, done[0].status, done[0].bytes), (2, status::SUCCESS, half as u32));
        assert_eq!(dst, src, "both requests landed (the unsignaled one before the signaled one)");
        let read = WorkRequest {
            id: 3,
            verb: Verb::Read { remote_addr: dst.as_ptr() as u64, rkey: dst_mr.rkey },
            local: sge(&back, &back_mr),
            signaled: true,
        };
        // Slept through: armed, the completion sends an event on the
        // channel, whose descriptor is readable then.
        cq.arm().unwrap();
        a.post(&[read]).unwrap();
        cq.wait().unwrap();
        let mut pfd = libc::pollfd { fd: cq.event_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd; no wait.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 0, "the one event was taken");
        assert_eq!(wait(&cq, 1)[0].status, status::SUCCESS);
        assert_eq!(back, src);

        // SEND with a receive posted, and WRITE with immediate.
        let mut inbox = vec![0u8; 64];
        // SAFETY: as above.
        let inbox_mr = unsafe { pd.register(inbox.as_mut_ptr() as u64, 64, access::LOCAL_WRITE) }.unwrap();
        b.post_recv(10, &[sge(&inbox, &inbox_mr)]).unwrap();
        b.post_recv(11, &[sge(&inbox, &inbox_mr)]).unwrap();
        a.post(&[WorkRequest { id: 4, verb: Verb::Send, local: sge(&src[..16], &src_mr), signaled: true }]).unwrap();
        let mut got = wait(&cq, 2);
        got.sort_by_key(|c| c.id);
        assert_eq!((got[0].id, got[1].id, got[1].opcode, got[1].bytes), (4, 10, 128, 16));
        assert_eq!(inbox[..16], src[..16]);
        let imm = WorkRequest {
            id: 5,
            verb: Verb::WriteImm { remote_addr: dst.as_ptr() as u64, rkey: dst_mr.rkey, imm: 0xfeed },
            local: sge(&src[..8], &src_mr),
            signaled: true,
        };
        a.post(&[imm]).unwrap();
        let mut got = wait(&cq, 2);
        got.sort_by_key(|c| c.id);
        assert_eq!((got[1].id, got[1].opcode, got[1].imm), (11, 129, Some(0xfeed)), "the immediate, in host order");

        // A bad rkey: remote access error, both ends to ERR, what follows
        // flushed, nothing written.
        let before_dst = dst.clone();
        let bad = |id, rkey| WorkRequest {
            id,
            verb: Verb::Write { remote_addr: dst.as_ptr() as u64, rkey },
            local: sge(&src[..64], &src_mr),
            signaled: false,
        };
        a.post(&[bad(6, dst_mr.lkey), bad(7, dst_mr.rkey)]).unwrap();
        let got = wait(&cq, 2);
        assert_eq!((got[0].id, got[0].status), (6, status::REM_ACCESS_ERR), "an error completes though unsignaled");
        assert_eq!((got[1].id, got[1].status), (7, status::WR_FLUSH_ERR));
        assert_eq!(dst, before_dst);
        // The responder went to ERR too: a receive posted there flushes.
        b.post_recv(12, &[sge(&inbox, &inbox_mr)]).unwrap();
        assert_eq!(wait(&cq, 1)[0].status, status::WR_FLUSH_ERR);
        drop((a, b));

        // Moved to ERR by its owner: outstanding receives flush.
        let (a, b) = pair(&pd, &cq);
        b.post_recv(13, &[sge(&inbox, &inbox_mr)]).unwrap();
        b.to_error().unwrap();
        assert_eq!((wait(&cq, 1)[0].id, cq.poll(&mut [Completion::default(); 1]).unwrap()), (13, 0));
        // A remote queue pair that does not exist: the transport gives up.
        let lone = pd.create_qp(&cq, 4).unwrap();
        lone.to_init(PORT, all).unwrap();
        lone.to_rtr(RemoteQp { gid: gid(), qpn: a.qpn ^ 0xff_0000, psn: 0 }, PORT, SGID, 4096).unwrap();
        lone.to_rts(0).unwrap();
        lone.post(&[bad(14, dst_mr.rkey)]).unwrap();
        assert_eq!(wait(&cq, 1)[0].status, status::RETRY_EXC_ERR);
        drop((a, b, lone));

        // Out of bounds, no remote read access, a deregistered region, a
        // bad lkey: each refused where a NIC refuses it.
        let past_end = WorkRequest {
            id: 20,
            verb: Verb::Write { remote_addr: dst.as_ptr() as u64 + 65530, rkey: dst_mr.rkey },
            local: sge(&src[..64], &src_mr),
            signaled: true,
        };
        let no_remote_read = WorkRequest {
            id: 21,
            verb: Verb::Read { remote_addr: src.as_ptr() as u64, rkey: src_mr.rkey },
            local: sge(&back[..64], &back_mr),
            signaled: true,
        };
        let bad_lkey = WorkRequest {
            id: 22,
            verb: Verb::Write { remote_addr: dst.as_ptr() as u64, rkey: dst_mr.rkey },
            local: Sge { addr: src.as_ptr() as u64, length: 64, lkey: 0xdead },
            signaled: true,
        };
        let cases = [
            ("past the region's end", past_end, status::REM_ACCESS_ERR),
            ("no remote read", no_remote_read, status::REM_ACCESS_ERR),
            ("a bad lkey", bad_lkey, status::LOC_PROT_ERR),
        ];
        for (what, wr, want) in cases {
            let (a, _b) = pair(&pd, &cq);
            a.post(&[wr]).unwrap();
            assert_eq!(wait(&cq, 1)[0].status, want, "{what}");
        }
        let (a, _b) = pair(&pd, &cq);
        let rkey = dst_mr.rkey;
        drop(dst_mr);
        a.post(&[bad(23, rkey)]).unwrap();
        assert_eq!(wait(&cq, 1)[0].status, status::REM_ACCESS_ERR, "no access through a deregistered region's key");

        // Transitions out of order are refused; posting before RTS too.
        let q = pd.create_qp(&cq, 4).unwrap();
        assert!(q.to_rtr(RemoteQp { gid: gid(), qpn: a.qpn, psn: 0 }, PORT, SGID, 4096).is_err(), "RESET to RTR");
        assert!(q.post(&[bad(24, rkey)]).is_err());
        q.to_init(PORT, 0).unwrap();
        assert!(
            q.to_rtr(RemoteQp { gid: "fe80::1".parse().unwrap(), qpn: a.qpn, psn: 0 }, PORT, SGID, 4096).is_err(),
            "a GID the fabric cannot route"
        );
        assert!(q.to_rtr(RemoteQp { gid: gid(), qpn: a.qpn, psn: 0 }, PORT, 9, 4096).is_err(), "no such source GID");
        assert!(cq.poll(&mut [Completion::default(); 16]).unwrap() == 0);
        drop((q, a, src_mr, back_mr, inbox_mr, cq, pd, dev));
    }
    assert_eq!(stats(), before, "every object the owners made is destroyed");
}

/// One end of [`queue_pairs_of_two_processes_and_two_network_namespaces`],
/// run as a child process of this test binary (nothing without
/// `ORBITE_VERBS_FABRIC_ROLE`). It speaks lines on stdin and stdout:
/// `READY qpn addr rkey`, then it reads `PEER gid qpn addr rkey`, connects
/// and says `CONNECTED`; a `requester` on `GO` writes 1 MiB of a pattern
/// into the peer and reads it back (`DONE ok|bad`); a `responder` on
/// `CHECK` compares its buffer with the pattern (`CHECKED ok|bad`); on
/// `EXIT` both destroy everything and say `BYE` with whether every shim
/// counter is back to zero.
#[test]
fn fabric_child() {
    use std::io::BufRead;
    let Ok(role) = std::env::var("ORBITE_VERBS_FABRIC_ROLE") else { return };
    let (lib, stats) = shim().expect("the shim");
    let mut lines = std::io::stdin().lock().lines().map_while(Result::ok);
    let mut expect = |word: &str| {
        let l = lines.next().unwrap_or_default();
        assert!(l.starts_with(word), "wanted {word}, got {l:?}");
        l.split_whitespace().skip(1).map(str::to_owned).collect::<Vec<_>>()
    };
    let say = |s: String| {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{s}").unwrap();
        out.flush().unwrap();
    };
    const LEN: usize = 1 << 20;
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 31 % 251) as u8).collect();
    {
        let dev = Device::open_in(lib, "shim0").unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(64).unwrap();
        let mut buf = vec![0u8; LEN];
        let mut back = vec![0u8; LEN];
        let all = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
        // SAFETY (both): buffers of this function that outlive their regions.
        let mr = unsafe { pd.register(buf.as_mut_ptr() as u64, LEN as u64, all) }.unwrap();
        let back_mr = unsafe { pd.register(back.as_mut_ptr() as u64, LEN as u64, access::LOCAL_WRITE) }.unwrap();
        let qp = pd.create_qp(&cq, 16).unwrap();
        qp.to_init(PORT, all).unwrap();
        say(format!("READY {} {} {}", qp.qpn, buf.as_ptr() as u64, mr.rkey));
        let peer = expect("PEER");
        let (gid, qpn): (Ipv6Addr, u32) = (peer[0].parse().unwrap(), peer[1].parse().unwrap());
        let (addr, rkey): (u64, u32) = (peer[2].parse().unwrap(), peer[3].parse().unwrap());
        qp.to_rtr(RemoteQp { gid, qpn, psn: 0 }, PORT, 0, 4096).unwrap();
        qp.to_rts(0).unwrap();
        say("CONNECTED".into());
        if role == "requester" {
            expect("GO");
            buf.copy_from_slice(&pattern);
            let write = WorkRequest {
                id: 1,
                verb: Verb::Write { remote_addr: addr, rkey },
                local: sge(&buf, &mr),
                signaled: true,
            };
            let read = WorkRequest {
                id: 2,
                verb: Verb::Read { remote_addr: addr, rkey },
                local: sge(&back, &back_mr),
                signaled: true,
            };
            qp.post(&[write, read]).unwrap();
            let done = wait(&cq, 2);
            let ok = done.iter().all(|c| c.status == status::SUCCESS) && back == pattern;
            say(format!("DONE {}", if ok { "ok" } else { "bad" }));
        } else {
            expect("CHECK");
            say(format!("CHECKED {}", if buf == pattern { "ok" } else { "bad" }));
        }
        expect("EXIT");
        drop((qp, mr, back_mr, cq, pd, dev));
    }
    say(format!("BYE {}", stats() == ShimStats::default()));
}

/// A child of this test binary running [`fabric_child`] as `role`, in
/// network namespace `netns` if given, its shim NIC's GID the IPv4
/// address `ip`.
struct Child {
    proc: std::process::Child,
    out: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl Child {
    fn start(role: &str, netns: Option<&str>, ip: &str) -> Child {
        use std::io::BufRead;
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = std::process::Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
            None => std::process::Command::new(&exe),
        };
        let devices = format!(
            r#"[{{"name": "shim0", "ports": [{{"state": "active", "gids": [{{"gid": "::ffff:{ip}", "type": "roce-v2"}}]}}]}}]"#
        );
        cmd.args(["--exact", "verbs::objects::tests::fabric_child", "--nocapture", "--test-threads=1"])
            .env("ORBITE_VERBS_FABRIC_ROLE", role)
            .env("ORBITE_VERBS_SHIM_DEVICES", devices)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        let mut proc = cmd.spawn().unwrap();
        let out = std::io::BufReader::new(proc.stdout.take().unwrap()).lines();
        Child { proc, out }
    }

    /// The words after `word` on the next line that has it (libtest's
    /// own lines are skipped; its `test ... ` may start the first one).
    fn read(&mut self, word: &str) -> Vec<String> {
        for l in self.out.by_ref().map_while(Result::ok) {
            if let Some(at) = l.find(word) {
                return l[at + word.len()..].split_whitespace().map(str::to_owned).collect();
            }
        }
        panic!("the child ended before {word}");
    }

    fn send(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.proc.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

/// A requester and a responder in two processes whose NICs have the GIDs
/// of `ips`, optionally in two network namespaces.
fn two_processes(netns: [Option<&str>; 2], ips: [&str; 2]) {
    let mut req = Child::start("requester", netns[0], ips[0]);
    let mut resp = Child::start("responder", netns[1], ips[1]);
    let (r, s) = (req.read("READY "), resp.read("READY "));
    req.send(&format!("PEER ::ffff:{} {} {} {}", ips[1], s[0], s[1], s[2]));
    resp.send(&format!("PEER ::ffff:{} {} {} {}", ips[0], r[0], r[1], r[2]));
    req.read("CONNECTED");
    resp.read("CONNECTED");
    req.send("GO");
    assert_eq!(req.read("DONE "), ["ok"], "1 MiB written and read back across the processes");
    resp.send("CHECK");
    assert_eq!(resp.read("CHECKED "), ["ok"], "the responder's memory holds what was written");
    for c in [&mut req, &mut resp] {
        c.send("EXIT");
        assert_eq!(c.read("BYE "), ["true"], "every shim object destroyed");
    }
}

#[test]
fn queue_pairs_of_two_processes_and_two_network_namespaces() {
    if shim().is_none() {
        return;
    }
    two_processes([None, None], ["127.0.0.1", "127.0.0.1"]);
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let ip = std::process::Command::new("ip").arg("-V").output().is_ok_and(|o| o.status.success());
    if !root || !ip {
        println!("SKIP: two network namespaces need root and iproute2 (root: {root}, ip: {ip})");
        return;
    }
    let run = |args: &[&str]| {
        let out = std::process::Command::new("ip").args(args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let pid = std::process::id();
    let id = pid % 200 + 20;
    let (a, b) = (format!("orbite-vf-{pid}-a"), format!("orbite-vf-{pid}-b"));
    struct Gone<'a>(&'a str, &'a str);
    impl Drop for Gone<'_> {
        fn drop(&mut self) {
            for ns in [self.0, self.1] {
                let _ = std::process::Command::new("ip").args(["netns", "del", ns]).output();
            }
        }
    }
    run(&["netns", "add", &a]);
    let _gone = Gone(&a, &b);
    run(&["netns", "add", &b]);
    let (va, vb) = (format!("ovf{id}a"), format!("ovf{id}b"));
    run(&["link", "add", &va, "netns", &a, "type", "veth", "peer", "name", &vb, "netns", &b]);
    let (ipa, ipb) = (format!("10.214.{id}.1"), format!("10.214.{id}.2"));
    for (ns, dev, ip) in [(&a, &va, &ipa), (&b, &vb, &ipb)] {
        run(&["-n", ns, "addr", "add", &format!("{ip}/24"), "dev", dev]);
        run(&["-n", ns, "link", "set", dev, "up"]);
    }
    two_processes([Some(&a), Some(&b)], [&ipa, &ipb]);
}

/// Faults injected into the shim fail requests as a NIC fails them, with
/// the events a NIC raises: retry exceeded and remote access errors (the
/// queue pair then in ERR, what follows flushed), completions held and
/// released, a queue pair gone fatal, a port down and back.
#[test]
fn injected_faults_fail_requests_as_a_nic_does_and_raise_events() {
    const QP_ERROR: c_int = 1;
    const RETRY_EXCEEDED: c_int = 2;
    const REMOTE_ACCESS: c_int = 3;
    const HOLD: c_int = 4;
    const RELEASE: c_int = 5;
    let Some((lib, stats)) = shim() else { return };
    let _one = SHIM_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (inject, port) = faults();
    let before = stats();
    {
        let dev = Device::open_in(lib, "shim0").unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq(64).unwrap();
        let src = vec![5u8; 4096];
        let mut dst = vec![0u8; 4096];
        let all = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
        // SAFETY (both): buffers of this test that outlive their regions.
        let src_mr = unsafe { pd.register(src.as_ptr() as u64, 4096, access::LOCAL_WRITE) }.unwrap();
        let dst_mr = unsafe { pd.register(dst.as_mut_ptr() as u64, 4096, all) }.unwrap();
        let write = |id| WorkRequest {
            id,
            verb: Verb::Write { remote_addr: dst.as_ptr() as u64, rkey: dst_mr.rkey },
            local: sge(&src, &src_mr),
            signaled: true,
        };
        for (fault, want) in [(RETRY_EXCEEDED, status::RETRY_EXC_ERR), (REMOTE_ACCESS, status::REM_ACCESS_ERR)] {
            let (a, _b) = pair(&pd, &cq);
            // SAFETY: the shim's call on a queue pair of this process.
            assert_eq!(unsafe { inject(a.qpn, fault, 0) }, 0);
            a.post(&[write(1), write(2)]).unwrap();
            let got = wait(&cq, 2);
            assert_eq!((got[0].status, got[1].status), (want, status::WR_FLUSH_ERR), "fault {fault}");
        }
        // SAFETY: as above; an unknown queue pair is refused.
        assert_eq!(unsafe { inject(0xff_ffff, RETRY_EXCEEDED, 0) }, libc::EINVAL);

        // Held: the bytes land, the completion waits for the release.
        let (a, b) = pair(&pd, &cq);
        // SAFETY: as above.
        assert_eq!(unsafe { inject(a.qpn, HOLD, 0) }, 0);
        a.post(&[write(3)]).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // The shim's thread writes `dst`: read it as the device's memory.
        // SAFETY: reads within the buffer.
        let landed = || (0..dst.len()).all(|i| unsafe { std::ptr::read_volatile(dst.as_ptr().add(i)) } == 5);
        while !landed() {
            assert!(std::time::Instant::now() < deadline, "the write landed");
            std::thread::yield_now();
        }
        assert!(cq.poll(&mut [Completion::default(); 4]).unwrap() == 0, "held");
        // SAFETY: as above.
        assert_eq!(unsafe { inject(a.qpn, RELEASE, 0) }, 0);
        assert_eq!(wait(&cq, 1)[0].id, 3);

        // Fatal: the queue pair to ERR by itself, an event says which.
        let mut inbox = vec![0u8; 64];
        // SAFETY: as above.
        let inbox_mr = unsafe { pd.register(inbox.as_mut_ptr() as u64, 64, access::LOCAL_WRITE) }.unwrap();
        b.post_recv(4, &[sge(&inbox, &inbox_mr)]).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { inject(b.qpn, QP_ERROR, 0) }, 0);
        assert_eq!(dev.async_event().unwrap(), AsyncEvent::QpFatal(b.qpn));
        assert_eq!(
            (wait(&cq, 1)[0].id, cq.poll(&mut [Completion::default(); 1]).unwrap()),
            (4, 0),
            "its receive flushed"
        );
        drop((a, b));

        // A port down: events on the device, requests lost until it is up.
        let (a, _b) = pair(&pd, &cq);
        // SAFETY: the shim's call for its first device.
        assert_eq!(unsafe { port(0, PORT, 0) }, 0);
        assert_eq!(dev.async_event().unwrap(), AsyncEvent::PortDown(PORT));
        a.post(&[write(5)]).unwrap();
        assert_eq!(wait(&cq, 1)[0].status, status::RETRY_EXC_ERR);
        // SAFETY: as above.
        assert_eq!(unsafe { port(0, PORT, 1) }, 0);
        assert_eq!(dev.async_event().unwrap(), AsyncEvent::PortActive(PORT));
        let mut pfd = libc::pollfd { fd: dev.async_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd; no wait.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 0) }, 0, "no event left");
        let (a, _b) = pair(&pd, &cq);
        a.post(&[write(6)]).unwrap();
        assert_eq!(wait(&cq, 1)[0].status, status::SUCCESS, "a new queue pair works again");
        drop(a);

        // A completion queue that overruns is unusable, and says so.
        let small = dev.create_cq(2).unwrap();
        let (a, _b) = pair(&pd, &small);
        a.post(&[write(7), write(8), write(9)]).unwrap();
        assert_eq!(dev.async_event().unwrap(), AsyncEvent::CqError);
        assert!(small.poll(&mut [Completion::default(); 4]).is_err(), "an overrun queue polls as an error");
        drop((a, _b, small, src_mr, dst_mr, inbox_mr, cq, pd, dev));
    }
    assert_eq!(stats(), before, "every object destroyed");
}

/// GPUDirect RDMA through dma-buf: device memory exported by the CUDA
/// driver (the driver shim, feature `cuda`) and registered with the NIC
/// takes a WRITE and answers a READ, its bytes moved by the NIC (the shim
/// maps the dma-buf itself; the device address is never touched by the
/// CPU: the driver shim keeps it inaccessible). SKIP without a driver
/// unless `ORBITE_CUDA_REQUIRED`.
#[test]
fn device_memory_registered_through_dma_buf_takes_writes_and_reads() {
    let Some((lib, stats)) = shim() else { return };
    let alloc = match crate::cuda::DeviceAllocation::new(0, 1 << 20) {
        Ok(a) => a,
        Err(e) => {
            assert!(std::env::var_os("ORBITE_CUDA_REQUIRED").is_none(), "ORBITE_CUDA_REQUIRED: {e}");
            println!("SKIP: no CUDA device ({e})");
            return;
        }
    };
    let _one = SHIM_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let before = stats();
    {
        let dev = Device::open_in(lib, "shim0").unwrap();
        let pd = dev.alloc_pd().unwrap();
        assert!(pd.dmabuf_supported());
        let cq = dev.create_cq(16).unwrap();
        // The second half of the allocation, exported on its own.
        let half = 1u64 << 19;
        let fd = alloc.dmabuf(half, half).unwrap();
        let all = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
        let iova = alloc.ptr + half;
        // SAFETY: the allocation outlives the region (dropped below first).
        let vram = unsafe { pd.register_dmabuf(std::os::fd::AsFd::as_fd(&fd), 0, half, iova, all) }.unwrap();
        drop(fd);
        let src: Vec<u8> = (0..half as usize).map(|i| (i % 253) as u8).collect();
        let mut back = vec![0u8; half as usize];
        // SAFETY (both): buffers of this test that outlive their regions.
        let src_mr = unsafe { pd.register(src.as_ptr() as u64, half, access::LOCAL_WRITE) }.unwrap();
        let back_mr = unsafe { pd.register(back.as_mut_ptr() as u64, half, access::LOCAL_WRITE) }.unwrap();
        let (a, _b) = pair(&pd, &cq);
        let write = WorkRequest {
            id: 1,
            verb: Verb::Write { remote_addr: iova, rkey: vram.rkey },
            local: sge(&src, &src_mr),
            signaled: true,
        };
        let read = WorkRequest {
            id: 2,
            verb: Verb::Read { remote_addr: iova, rkey: vram.rkey },
            local: sge(&back, &back_mr),
            signaled: true,
        };
        a.post(&[write, read]).unwrap();
        assert!(wait(&cq, 2).iter().all(|c| c.status == status::SUCCESS));
        assert_eq!(back, src, "read back from device memory");
        let mut seen = vec![0u8; half as usize];
        alloc.read(half, &mut seen).unwrap();
        assert_eq!(seen, src, "the driver sees what the NIC wrote");
        let mut first = vec![1u8; 16];
        alloc.read(0, &mut first).unwrap();
        assert_eq!(first, [0u8; 16], "nothing before the exported range was touched");
        drop((a, _b, vram, src_mr, back_mr, cq, pd, dev));
    }
    assert_eq!(stats(), before, "every object destroyed");
}
