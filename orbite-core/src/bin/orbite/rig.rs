//! Benchmark rigs: the memory each route is measured on. The local rig
//! keeps both sides in one engine; the TCP rig runs the target side in a
//! child process (`orbite bench-target`) on loopback.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use orbite_core::codec::Reader;
use orbite_core::{
    EngineConfig, HostMemory, MemoryRange, Permission, RegistrationId, RemoteSegment, RoutePolicy, Target,
    TransferEngine,
};

use crate::error::{Doing, Error, HelperError, TARGET};
use crate::measure;

pub const MIB: u64 = 1 << 20;
/// W1 regions: 256 MiB per side.
pub const W1_REGION: u64 = 256 * MIB;
/// W3: 64 regions of 4 MiB per side.
pub const W3_REGIONS: u64 = 64;
pub const W3_REGION: u64 = 4 * MIB;

/// Which remote memory.
#[derive(Clone, Copy)]
pub enum Which {
    W1,
    W3,
}

/// A 64-bit digest of bytes (word-wise; both processes compute it).
pub fn digest(bytes: &[u8]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64 ^ bytes.len() as u64;
    let mut words = Reader::new(bytes);
    while let Ok(v) = words.u64() {
        h = (h ^ v).rotate_left(29).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    }
    for b in words.rest() {
        h = (h ^ *b as u64).wrapping_mul(0x94D0_49BB_1331_11EB);
    }
    h
}

/// Bytes `off..off + len` of an allocation filled by `measure::fill(seed)`.
pub fn pattern(seed: u64, off: u64, len: u64) -> Vec<u8> {
    let first = off / 8;
    let last = (off + len).div_ceil(8);
    let mut out = Vec::with_capacity(((last - first) * 8) as usize);
    for i in first..last {
        let w = if seed == 0 { 0 } else { i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed };
        out.extend_from_slice(&w.to_le_bytes());
    }
    let skip = (off - first * 8) as usize;
    out[skip..skip + len as usize].to_vec()
}

/// Local memory of every rig: W1 and W3 regions, and a scratch buffer for
/// the memcpy reference.
pub struct LocalSide {
    pub l: HostMemory,
    pub l_id: RegistrationId,
    pub l3: HostMemory,
    pub l3_ids: Vec<RegistrationId>,
}

fn register(engine: &TransferEngine, mem: &HostMemory, parts: u64, part: u64) -> Result<Vec<RegistrationId>, Error> {
    let ranges = (0..parts)
        .map(|i| MemoryRange::host(mem, (i * part) as usize, part as usize, Permission::RemoteReadWrite))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(engine.register_memory_ranges(ranges)?)
}

fn side(engine: &TransferEngine) -> Result<LocalSide, Error> {
    let l = engine.allocate_host_memory(W1_REGION as usize)?;
    let l3 = engine.allocate_host_memory((W3_REGIONS * W3_REGION) as usize)?;
    measure::fill(&l, 0x1111);
    measure::fill(&l3, 0x3333);
    let l_id = register(engine, &l, 1, W1_REGION)?[0];
    let l3_ids = register(engine, &l3, W3_REGIONS, W3_REGION)?;
    Ok(LocalSide { l, l_id, l3, l3_ids })
}

pub enum Remote {
    /// The same engine (self connection).
    Loopback { r: HostMemory, r3: HostMemory },
    /// A child process over TCP.
    Tcp { child: Child, stdin: ChildStdin, stdout: BufReader<ChildStdout>, segment: RemoteSegment },
}

pub struct Rig {
    pub route: &'static str,
    pub engine: TransferEngine,
    pub local: LocalSide,
    pub r_id: RegistrationId,
    pub r3_ids: Vec<RegistrationId>,
    pub remote: Remote,
}

impl Rig {
    pub fn local(config: EngineConfig) -> Result<Rig, Error> {
        let engine = TransferEngine::new(config)?;
        let local = side(&engine)?;
        let r = engine.allocate_host_memory(W1_REGION as usize)?;
        let r3 = engine.allocate_host_memory((W3_REGIONS * W3_REGION) as usize)?;
        let r_id = register(&engine, &r, 1, W1_REGION)?[0];
        let r3_ids = register(&engine, &r3, W3_REGIONS, W3_REGION)?;
        let mut rig = Rig { route: "local", engine, local, r_id, r3_ids, remote: Remote::Loopback { r, r3 } };
        rig.fill_remote(0x2222)?;
        Ok(rig)
    }

    /// A target process on loopback reached by `policy`. Its memory is a
    /// shared allocation for the shm policy, ordinary memory otherwise.
    pub fn peer(config: EngineConfig, policy: RoutePolicy) -> Result<Rig, Error> {
        // The initiator listens too, so that the target can answer pings.
        let listening = EngineConfig { listen: Some("127.0.0.1:0".into()), route: policy, ..config.clone() };
        let engine = TransferEngine::new(listening)?;
        let local = side(&engine)?;
        let exe = std::env::current_exe().doing("find this executable")?;
        let config_json = serde_json::to_string(&config)?;
        let mut child = Command::new(exe)
            .arg("bench-target")
            .env("ORBITE_BENCH_TARGET_CONFIG", config_json)
            .env("ORBITE_BENCH_TARGET_SHM", if policy == RoutePolicy::Shm { "1" } else { "0" })
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|source| HelperError::Spawn { helper: TARGET, source })?;
        // The child is stopped if its READY line or its segment fails.
        let (stdin, stdout, segment, r_id, r3_ids) = match ready(&engine, &mut child) {
            Ok(ready) => ready,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        let mut rig = Rig {
            route: policy.name(),
            engine,
            local,
            r_id,
            r3_ids,
            remote: Remote::Tcp { child, stdin, stdout, segment },
        };
        rig.fill_remote(0x2222)?;
        Ok(rig)
    }

    pub fn target(&self) -> Target<'_> {
        match &self.remote {
            Remote::Loopback { .. } => Target::Loopback,
            Remote::Tcp { segment, .. } => Target::Peer(segment),
        }
    }

    fn ask(&mut self, cmd: &str) -> Result<String, HelperError> {
        let Remote::Tcp { stdin, stdout, .. } = &mut self.remote else { return Err(HelperError::NoProcess) };
        let pipe = |source| HelperError::Pipe { helper: TARGET, source };
        writeln!(stdin, "{cmd}").and_then(|()| stdin.flush()).map_err(pipe)?;
        let mut line = String::new();
        if stdout.read_line(&mut line).map_err(pipe)? == 0 {
            return Err(HelperError::Exited(TARGET));
        }
        Ok(line.trim().to_owned())
    }

    /// Asks `cmd`; the answer must be `OK`.
    fn ask_ok(&mut self, cmd: &str) -> Result<(), Error> {
        let a = self.ask(cmd)?;
        if a == "OK" { Ok(()) } else { Err(unexpected(&a)) }
    }

    /// Asks `cmd`; the answer must be `prefix` and a number.
    fn ask_num<T: std::str::FromStr>(&mut self, cmd: &str, prefix: &str) -> Result<T, Error> {
        let a = self.ask(cmd)?;
        a.strip_prefix(prefix).and_then(|v| v.parse().ok()).ok_or_else(|| unexpected(&a))
    }

    /// Fills both remote memories with the pattern of `seed`.
    pub fn fill_remote(&mut self, seed: u64) -> Result<(), Error> {
        match &self.remote {
            Remote::Loopback { r, r3 } => {
                measure::fill(r, seed);
                measure::fill(r3, seed);
                Ok(())
            }
            Remote::Tcp { .. } => self.ask_ok(&format!("fill {seed}")),
        }
    }

    /// Digest of remote bytes.
    pub fn remote_digest(&mut self, which: Which, off: u64, len: u64) -> Result<u64, Error> {
        match &self.remote {
            Remote::Loopback { r, r3 } => {
                let mem = match which {
                    Which::W1 => r,
                    Which::W3 => r3,
                };
                Ok(digest(&read(mem, off, len)))
            }
            Remote::Tcp { .. } => {
                let w = match which {
                    Which::W1 => 1,
                    Which::W3 => 3,
                };
                self.ask_num(&format!("digest {w} {off} {len}"), "DIGEST ")
            }
        }
    }

    /// Counts (and drops) the notifications the target side received.
    pub fn take_remote_notifications(&mut self) -> Result<u64, Error> {
        match &self.remote {
            Remote::Loopback { .. } => Ok(self.engine.take_notifications().len() as u64),
            Remote::Tcp { .. } => self.ask_num("notifs", "NOTIFS "),
        }
    }

    /// Makes the target answer each of the next `n` notifications with
    /// `pong` (the initiator must listen).
    pub fn start_pong(&mut self, n: usize) -> Result<(), Error> {
        let endpoint = self.engine.endpoint().ok_or(HelperError::NotListening)?;
        self.ask_ok(&format!("pong {endpoint} {} {n}", self.engine.source_epoch()))
    }

    /// Sends one notification to the target.
    pub fn ping(&self, payload: &[u8]) -> Result<(), Error> {
        match &self.remote {
            Remote::Loopback { .. } => self.engine.notify_self(payload)?,
            Remote::Tcp { segment, .. } => self.engine.notify(segment, payload)?,
        }
        Ok(())
    }

    /// The target process's pid (peer routes).
    pub fn remote_pid(&self) -> Option<i32> {
        match &self.remote {
            Remote::Loopback { .. } => None,
            Remote::Tcp { child, .. } => i32::try_from(child.id()).ok(),
        }
    }

    /// The opened segment of the target (peer routes).
    pub fn segment(&self) -> Option<&RemoteSegment> {
        match &self.remote {
            Remote::Loopback { .. } => None,
            Remote::Tcp { segment, .. } => Some(segment),
        }
    }

    /// Peak resident memory of the target process in bytes (none for the
    /// self connection: one process).
    pub fn remote_peak_rss(&mut self) -> Result<Option<u64>, Error> {
        match &self.remote {
            Remote::Loopback { .. } => Ok(None),
            Remote::Tcp { .. } => self.ask_num("peak", "PEAK ").map(Some),
        }
    }

    /// Starts a new peak in the target process; false if its kernel
    /// refused (true for the self connection).
    pub fn reset_remote_peak_rss(&mut self) -> Result<bool, Error> {
        match &self.remote {
            Remote::Loopback { .. } => Ok(true),
            Remote::Tcp { .. } => Ok(self.ask("reset_peak")? == "OK"),
        }
    }

    /// Device memory of `len` bytes in the target process, registered for
    /// peers (feature `cuda`): its registration.
    pub fn remote_vram(&mut self, len: u64) -> Result<RegistrationId, Error> {
        self.ask_num(&format!("vram {len}"), "VRAM ").map(RegistrationId::from_raw)
    }

    /// Digest of the target's device memory bytes `off..off + len`.
    pub fn remote_vram_digest(&mut self, off: u64, len: u64) -> Result<u64, Error> {
        self.ask_num(&format!("vdigest {off} {len}"), "DIGEST ")
    }

    /// CPU time of the remote process (0 for the self connection).
    pub fn remote_cpu_ns(&mut self) -> Result<u64, Error> {
        match &self.remote {
            Remote::Loopback { .. } => Ok(0),
            Remote::Tcp { .. } => self.ask_num("cpu", "CPU "),
        }
    }
}

/// The target's pipes, its opened segment, and its W1 and W3 registrations.
type Ready = (ChildStdin, BufReader<ChildStdout>, RemoteSegment, RegistrationId, Vec<RegistrationId>);

/// Reads the target's `READY endpoint epoch w1_id w3_ids` line from its
/// stdout and opens its segment.
fn ready(engine: &TransferEngine, child: &mut Child) -> Result<Ready, Error> {
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return Err(HelperError::NoPipes(TARGET).into());
    };
    let mut stdout = BufReader::new(stdout);
    let mut line = String::new();
    if stdout.read_line(&mut line).map_err(|source| HelperError::Pipe { helper: TARGET, source })? == 0 {
        return Err(HelperError::Exited(TARGET).into());
    }
    let w: Vec<&str> = line.split_whitespace().collect();
    let parsed = (|| -> Option<(String, u64, RegistrationId, Vec<RegistrationId>)> {
        if w.first() != Some(&"READY") || w.len() != 5 {
            return None;
        }
        let r3 = w[4].split(',').map(|x| x.parse().ok().map(RegistrationId::from_raw)).collect::<Option<Vec<_>>>()?;
        Some((w[1].to_owned(), w[2].parse().ok()?, RegistrationId::from_raw(w[3].parse().ok()?), r3))
    })();
    let Some((endpoint, epoch, r_id, r3_ids)) = parsed else { return Err(unexpected(&line)) };
    let segment = engine.open_segment(&endpoint, Some(epoch), Duration::from_secs(10))?;
    Ok((stdin, stdout, segment, r_id, r3_ids))
}

/// An answer of the target process that the protocol does not allow here
/// (an `ERR ...` line included).
fn unexpected(line: &str) -> Error {
    HelperError::Unexpected { helper: TARGET, line: line.trim().to_owned() }.into()
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Remote::Tcp { child, stdin, .. } = &mut self.remote {
            let _ = writeln!(stdin, "quit");
            let _ = stdin.flush();
            let _ = child.wait();
        }
    }
}

/// Copies bytes out of host memory.
pub fn read(mem: &HostMemory, off: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    // SAFETY: in bounds by construction of the workloads; no transfer is
    // active on this memory while the bench verifies it.
    unsafe { mem.read(off as usize, &mut out) };
    out
}

/// `orbite bench-target`: the target side of the TCP rig.
pub fn serve_target() -> Result<(), Error> {
    // The initiator's configuration (same limits), listening on loopback.
    let base = match std::env::var("ORBITE_BENCH_TARGET_CONFIG") {
        Ok(json) => EngineConfig::from_json(&json)?,
        Err(_) => EngineConfig::default(),
    };
    let config = EngineConfig { listen: Some("127.0.0.1:0".into()), ..base };
    let engine = TransferEngine::new(config)?;
    let shared = std::env::var("ORBITE_BENCH_TARGET_SHM").is_ok_and(|v| v == "1");
    let alloc = |len: u64| {
        if shared { engine.allocate_shm_memory(len as usize) } else { engine.allocate_host_memory(len as usize) }
    };
    let r = alloc(W1_REGION)?;
    let r3 = alloc(W3_REGIONS * W3_REGION)?;
    let r_id = register(&engine, &r, 1, W1_REGION)?[0];
    let r3_ids = register(&engine, &r3, W3_REGIONS, W3_REGION)?;
    let ids: Vec<String> = r3_ids.iter().map(|i| i.to_raw().to_string()).collect();
    let mut out = std::io::stdout().lock();
    let endpoint = engine.endpoint().unwrap_or_default();
    writeln!(out, "READY {endpoint} {} {} {}", engine.source_epoch(), r_id.to_raw(), ids.join(","))
        .and_then(|()| out.flush())
        .doing("answer the initiator")?;
    let mut vram = None;
    for line in std::io::stdin().lock().lines() {
        let line = line.doing("read the initiator's command")?;
        let bad = |field| HelperError::BadCommand { field, line: line.clone() };
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = match w.as_slice() {
            ["fill", seed] => {
                let seed = seed.parse().map_err(|_| bad("seed"))?;
                measure::fill(&r, seed);
                measure::fill(&r3, seed);
                "OK".to_owned()
            }
            ["digest", which, off, len] => {
                let mem = if *which == "3" { &r3 } else { &r };
                let (off, len): (u64, u64) =
                    (off.parse().map_err(|_| bad("off"))?, len.parse().map_err(|_| bad("len"))?);
                if off.checked_add(len).is_none_or(|end| end > mem.len() as u64) {
                    "ERR out of range".to_owned()
                } else {
                    format!("DIGEST {}", digest(&read(mem, off, len)))
                }
            }
            // Device memory peers reach through CUDA IPC (feature cuda).
            ["vram", len] => {
                let len: usize = len.parse().map_err(|_| bad("len"))?;
                match target_vram(&engine, len) {
                    Ok((m, id)) => {
                        let raw = id.to_raw();
                        vram = Some(m);
                        format!("VRAM {raw}")
                    }
                    Err(e) => format!("ERR {e}"),
                }
            }
            ["vdigest", off, len] => {
                let (off, len): (u64, u64) =
                    (off.parse().map_err(|_| bad("off"))?, len.parse().map_err(|_| bad("len"))?);
                match vram_digest(vram.as_ref(), off, len) {
                    Ok(d) => format!("DIGEST {d}"),
                    Err(e) => format!("ERR {e}"),
                }
            }
            ["cpu"] => format!("CPU {}", measure::process_cpu_ns()),
            ["peak"] => format!("PEAK {}", crate::limits::peak_rss()),
            ["reset_peak"] => {
                (if crate::limits::reset_peak_rss() { "OK" } else { "ERR clear_refs refused" }).to_owned()
            }
            ["notifs"] => format!("NOTIFS {}", engine.take_notifications().len()),
            ["pong", endpoint, epoch, n] => {
                let epoch = epoch.parse().map_err(|_| bad("epoch"))?;
                let n: usize = n.parse().map_err(|_| bad("count"))?;
                match engine.open_segment(endpoint, Some(epoch), Duration::from_secs(10)) {
                    Ok(back) => {
                        let e = engine.clone();
                        std::thread::spawn(move || {
                            let mut answered = 0;
                            while answered < n {
                                for _ in e.wait_notifications(Duration::from_secs(10)) {
                                    if e.notify(&back, b"pong").is_err() {
                                        return;
                                    }
                                    answered += 1;
                                }
                            }
                        });
                        "OK".to_owned()
                    }
                    Err(e) => format!("ERR {e}"),
                }
            }
            ["quit"] => break,
            _ => format!("ERR unknown command {line}"),
        };
        writeln!(out, "{reply}").and_then(|()| out.flush()).doing("answer the initiator")?;
    }
    Ok(())
}

type TargetVram = orbite_core::CudaMemory;

/// Device memory of `len` bytes on device 0, registered for peers.
fn target_vram(engine: &TransferEngine, len: usize) -> Result<(TargetVram, RegistrationId), Error> {
    orbite_core::cuda::availability().map_err(Error::Vram)?;
    let m = engine.allocate_cuda_memory(0, len)?;
    let range = MemoryRange::cuda(&m, 0, len, Permission::RemoteReadWrite)?;
    let id = engine.register_memory_ranges(vec![range])?[0];
    Ok((m, id))
}

/// Digest of bytes of the target's device memory.
fn vram_digest(m: Option<&TargetVram>, off: u64, len: u64) -> Result<u64, Error> {
    let m = m.ok_or(HelperError::NoDeviceMemory)?;
    let len = usize::try_from(len)
        .map_err(|_| HelperError::BadCommand { field: "len", line: format!("vdigest {off} {len}") })?;
    let mut back = vec![0u8; len];
    // SAFETY: no transfer touches the device memory while the initiator
    // asks for its digest.
    unsafe { m.read(off as usize, &mut back) }?;
    Ok(digest(&back))
}
