//! `orbite bench --workload fan-in`: many initiator processes write into one
//! target at once.
//!
//! This process is the target: it listens on loopback with one region.
//! Initiators are child processes (`orbite bench-fanin`), each opening the
//! target over tcp and writing 4 MiB transfers of 16 KiB descriptors, each
//! from a local slice into a target slice of its own, as fast as it can,
//! for the same time. One initiator alone is the reference; 64 together
//! should move at least 0.9 of what it moves. Both phases touch the same
//! memory (64 slices of 4 MiB on each side: the lone initiator cycles
//! through all of them, each of the 64 has one), so neither gains from a
//! cache the other cannot use (the server serves every connection from a fixed set of threads,
//! so many connections must not cost throughput). The row's `x_limit` is
//! the 64 initiators' total over one initiator's; the target's thread count
//! is reported with one and with 64.
//!
//! The initiators stand in for other hosts: the target runs on the first
//! half of this machine's cores and the initiators on the other half, so
//! that in both phases the target has the same cores to itself (with one
//! core, everything shares it).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use orbite_core::{Desc, EngineConfig, MemoryRange, Op, Permission, Target, TransferEngine, TransferSpec};
use serde_json::{Value, json};

use crate::error::{Doing, Error, HelperError, INITIATOR, ValueError};
use crate::measure;
use crate::rig::{MIB, digest};

const BLOCK: u64 = 16 << 10;
const SLICE: u64 = 4 * MIB;
const INITIATORS: usize = 64;

/// This machine's cores, split in two halves: the target's and the
/// initiators'.
fn halves() -> Option<(Vec<usize>, Vec<usize>)> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set, filled by the call.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above, with its exact size.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return None;
    }
    // SAFETY: reads bits of a valid set.
    let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|c| unsafe { libc::CPU_ISSET(*c, &set) }).collect();
    if cpus.len() < 2 {
        return None;
    }
    let (a, b) = cpus.split_at(cpus.len() / 2);
    Some((a.to_vec(), b.to_vec()))
}

/// Runs the calling thread (and the threads it starts) on `cpus`.
fn pin(cpus: &[usize]) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: `c` is below CPU_SETSIZE (it came from such a set).
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: a valid set of its exact size.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
}

/// CPU seconds this process used so far.
fn cpu_seconds() -> f64 {
    // SAFETY: a zeroed rusage is valid and filled by the call.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

struct Initiator {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Initiator {
    fn spawn(endpoint: &str, epoch: u64, slices: (usize, usize), secs: f64, cpus: &[usize]) -> Result<Self, Error> {
        let exe = std::env::current_exe().doing("find this executable")?;
        let cpus: Vec<String> = cpus.iter().map(usize::to_string).collect();
        let (first, count) = (slices.0.to_string(), slices.1.to_string());
        let mut child = Command::new(exe)
            .args(["bench-fanin", endpoint, &epoch.to_string(), &first, &count, &secs.to_string()])
            .arg(cpus.join(","))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|source| HelperError::Spawn { helper: INITIATOR, source })?;
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(HelperError::NoPipes(INITIATOR).into());
        };
        Ok(Initiator { child, out: BufReader::new(stdout) })
    }

    fn line(&mut self) -> Result<String, HelperError> {
        let mut l = String::new();
        self.out.read_line(&mut l).map_err(|source| HelperError::Pipe { helper: INITIATOR, source })?;
        if l.is_empty() {
            return Err(HelperError::Exited(INITIATOR));
        }
        Ok(l.trim().to_owned())
    }

    fn go(&mut self) -> Result<(), HelperError> {
        let stdin = self.child.stdin.as_mut().ok_or(HelperError::NoPipes(INITIATOR))?;
        stdin
            .write_all(b"go\n")
            .and_then(|()| stdin.flush())
            .map_err(|source| HelperError::Pipe { helper: INITIATOR, source })
    }
}

/// One phase: `n` initiators at once; returns (bytes per second in all,
/// every slice verified, the target's busy cores).
fn phase(
    target: &TransferEngine,
    mem: &orbite_core::HostMemory,
    n: usize,
    secs: f64,
    cpus: &[usize],
) -> Result<(f64, bool, f64), Error> {
    let endpoint = target.endpoint().unwrap_or_default();
    let per = INITIATORS / n;
    let mut kids = Vec::with_capacity(n);
    for i in 0..n {
        kids.push(Initiator::spawn(&endpoint, target.source_epoch(), (i * per, per), secs, cpus)?);
    }
    for k in &mut kids {
        let l = k.line()?;
        if l != "ready" {
            return Err(unexpected(l));
        }
    }
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    for k in &mut kids {
        k.go()?;
    }
    // Each initiator's rate over its own window, summed: what they moved
    // together while all of them ran.
    let (mut rate, mut verified) = (0f64, true);
    let mut busy = None;
    for (i, k) in kids.iter_mut().enumerate() {
        let l = k.line()?;
        // The target's cores while every initiator still ran.
        busy.get_or_insert_with(|| (cpu_seconds() - cpu0) / t0.elapsed().as_secs_f64());
        let Some((bytes, secs, digests)) = done(&l) else {
            return Err(unexpected(l));
        };
        rate += bytes as f64 / secs.max(1e-9);
        // The last write into each slice is a pattern of its own.
        for (j, d) in digests.into_iter().enumerate() {
            let off = ((i * per + j) as u64 * SLICE) as usize;
            // SAFETY: reads the target region after every initiator finished.
            let slice = unsafe { std::slice::from_raw_parts(mem.as_ptr().add(off), SLICE as usize) };
            verified &= d == digest(slice);
        }
        let _ = k.child.wait();
    }
    Ok((rate, verified, busy.unwrap_or(0.0)))
}

/// An initiator's last line, `done BYTES SECONDS DIGEST...`: the bytes it
/// moved in how long, and the digest of each of its slices.
fn done(line: &str) -> Option<(u64, f64, Vec<u64>)> {
    let mut f = line.split_whitespace();
    let (Some("done"), Some(bytes), Some(secs)) = (f.next(), f.next(), f.next()) else { return None };
    let digests = f.map(|d| d.parse().ok()).collect::<Option<_>>()?;
    Some((bytes.parse().ok()?, secs.parse().ok()?, digests))
}

fn unexpected(line: String) -> Error {
    HelperError::Unexpected { helper: INITIATOR, line }.into()
}

/// The `fan-in` row.
pub fn run(quick: bool, config: &EngineConfig) -> Result<Value, Error> {
    let secs = if quick { 0.5 } else { 3.0 };
    let (mine, theirs) = halves().unwrap_or_default();
    // The target's threads start from this one (and so inherit its cores);
    // it gets them back afterwards.
    let all: Vec<usize> = mine.iter().chain(&theirs).copied().collect();
    if !mine.is_empty() {
        pin(&mine);
    }
    let row = run_pinned(quick, secs, config, &theirs);
    if !all.is_empty() {
        pin(&all);
    }
    row
}

fn run_pinned(quick: bool, secs: f64, config: &EngineConfig, theirs: &[usize]) -> Result<Value, Error> {
    let _ = quick;
    let mut cfg = config.clone();
    cfg.listen = Some("127.0.0.1:0".into());
    let target = TransferEngine::new(cfg)?;
    let mem = target.allocate_host_memory((INITIATORS as u64 * SLICE) as usize)?;
    target.register_memory_ranges(vec![MemoryRange::host(&mem, 0, mem.len(), Permission::RemoteReadWrite)?])?;
    let idle_threads = threads();
    let (one, v1, cpu1) = phase(&target, &mem, 1, secs, theirs)?;
    let (many, v64, cpu64) = phase(&target, &mem, INITIATORS, secs, theirs)?;
    let served_threads = threads();
    target.close();
    let gbps = |b: f64| (b / 1e9 * 100.0).round() / 100.0;
    Ok(json!({
        "system": "orbite", "route": "tcp", "workload": "fan-in", "block_bytes": BLOCK,
        "initiators": INITIATORS, "one_initiator_gbps": gbps(one), "gbps": gbps(many),
        "x_limit": ((many / one) * 100.0).round() / 100.0,
        "limit": "one initiator's throughput (bar: 0.9)",
        "target_threads": [idle_threads, served_threads], "seconds": secs,
        "target_cores_busy": [(cpu1 * 100.0).round() / 100.0, (cpu64 * 100.0).round() / 100.0],
        "verified": v1 && v64,
    }))
}

/// `orbite bench-fanin ENDPOINT EPOCH FIRST COUNT SECONDS CPUS`: one
/// initiator, writing target slices FIRST..FIRST+COUNT.
#[derive(Debug, clap::Args)]
pub struct InitiatorArgs {
    /// The target's endpoint (host:port)
    endpoint: String,
    /// The target's source epoch
    epoch: u64,
    /// The first target slice to write
    first: u64,
    /// How many slices to write
    count: u64,
    /// How long to write, in seconds
    secs: f64,
    /// The cores to run on, a comma list (empty: any)
    #[arg(value_parser = cores)]
    cpus: Cores,
}

/// The value of CPUS.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cores(Vec<usize>);

fn cores(v: &str) -> Result<Cores, ValueError> {
    v.split(',')
        .filter(|c| !c.is_empty())
        .map(|c| c.parse().map_err(|source| ValueError::NotANumber { item: c.to_owned(), source }))
        .collect::<Result<_, _>>()
        .map(Cores)
}

/// One fan-in initiator (`orbite bench-fanin`).
pub fn initiator(args: InitiatorArgs) -> Result<(), Error> {
    let InitiatorArgs { endpoint, epoch, first, count, secs, cpus: Cores(cpus) } = args;
    if !cpus.is_empty() {
        pin(&cpus);
    }
    if count == 0 || first.checked_add(count).is_none_or(|end| end > INITIATORS as u64) {
        return Err(HelperError::SlicesOutside { first, count, slices: INITIATORS as u64 }.into());
    }
    let e = TransferEngine::from_json(r#"{"route": "tcp"}"#)?;
    let mem = e.allocate_host_memory((count * SLICE) as usize)?;
    let id = e.register_memory_ranges(vec![MemoryRange::host(&mem, 0, mem.len(), Permission::LocalOnly)?])?[0];
    let seg = e.open_segment(&endpoint, Some(epoch), Duration::from_secs(30))?;
    let remote_id = seg.descriptor().registrations.first().ok_or(HelperError::NothingExported)?.id;
    let n = SLICE / BLOCK;
    let transfers = (0..count)
        .map(|s| {
            let local: Vec<Desc> = (0..n).map(|i| Desc::new(id, s * SLICE + i * BLOCK, BLOCK)).collect();
            let remote: Vec<Desc> =
                (0..n).map(|i| Desc::new(remote_id, (first + s) * SLICE + i * BLOCK, BLOCK)).collect();
            e.prepare(&TransferSpec::new(Op::Write, &local, &remote, Target::Peer(&seg)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    measure::fill(&mem, 0x3333 + first);
    let mut stdout = std::io::stdout();
    writeln!(stdout, "ready").doing("tell the bench it is ready")?;
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).doing("read the bench's go")?;
    let run = |t: &orbite_core::Transfer| measure::post_and_wait(t).map(drop);
    let start = Instant::now();
    let mut bytes = 0u64;
    // count >= 1: the cycle ends only at the deadline.
    for t in transfers.iter().cycle() {
        if start.elapsed().as_secs_f64() >= secs {
            break;
        }
        run(t)?;
        bytes += SLICE;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut line = format!("done {bytes} {elapsed}");
    for (s, t) in transfers.iter().enumerate() {
        run(t)?;
        // SAFETY: the local region, read after the transfer from it retired.
        let local = unsafe { std::slice::from_raw_parts(mem.as_ptr().add(s * SLICE as usize), SLICE as usize) };
        line.push_str(&format!(" {}", digest(local)));
    }
    writeln!(stdout, "{line}").doing("tell the bench what moved")?;
    drop(transfers);
    let _ = e.close_segment(&seg, Duration::from_secs(5));
    e.close();
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;

    use super::{Cores, InitiatorArgs, done};
    use crate::{Command, parse};

    /// The arguments `Initiator::spawn` passes.
    fn initiator(args: &[&str]) -> InitiatorArgs {
        match parse(&[&["bench-fanin"], args].concat()) {
            Ok(Command::BenchFanin(a)) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn positional_arguments_as_spawned() {
        let a = initiator(&["127.0.0.1:4000", "77", "8", "4", "0.5", "2,3"]);
        assert_eq!((a.endpoint.as_str(), a.epoch, a.first, a.count, a.secs), ("127.0.0.1:4000", 77, 8, 4, 0.5));
        assert_eq!(a.cpus, Cores(vec![2, 3]));
        // One core or none: the list is empty.
        assert_eq!(initiator(&["127.0.0.1:4000", "77", "0", "64", "3", ""]).cpus, Cores(vec![]));
        for bad in [&["127.0.0.1:4000", "77", "0", "1", "0.5"][..], &["127.0.0.1:4000", "x", "0", "1", "0.5", ""]] {
            assert!(parse(&[&["bench-fanin"], bad].concat()).is_err(), "{bad:?}");
        }
        let e = parse(&["bench-fanin", "127.0.0.1:4000", "77", "0", "1", "0.5", "1,a"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation);
        assert!(e.to_string().contains("CPUS") && e.to_string().contains("`a` is not a number"), "{e}");
    }

    #[test]
    fn an_initiators_last_line() {
        assert_eq!(done("done 4194304 0.5 17 18"), Some((4 << 20, 0.5, vec![17, 18])));
        assert_eq!(done("done 0 0.5"), Some((0, 0.5, vec![])));
        for bad in ["ready", "done 1", "done x 0.5", "done 1 0.5 d1", "orbite: transfer did not succeed"] {
            assert_eq!(done(bad), None, "{bad}");
        }
    }
}
