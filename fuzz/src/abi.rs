//! C ABI call sequences: `orbite-nixl-ffi`'s entry points, called in
//! orders an input decides, with live, released, foreign and made-up
//! handles, random lengths and records of the wrong size.
//!
//! Input: how the engine is created, then operations (one byte each, then
//! their arguments). Memory is only ever registered inside buffers this
//! target owns, and arrays are always as long as the counts passed with
//! them (or the count is beyond every limit), so that every call keeps its
//! `# Safety` contract: what varies is everything the ABI promises to
//! check. Checks: every call returns (a status, never a crash); a released
//! handle never works again; each release callback runs exactly once; and
//! once every handle is released and every transfer retired, the engine's
//! charges are back to zero and the engine releases.
//!
//! Never dialled: peers are only this engine itself (the self connection)
//! or peer information with no endpoint; the engine never listens.

use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use orbite_nixl::fuzzing::{decode_peer_info, encode_peer_info};
use orbite_nixl::*;

use crate::input::{Input, Seed};

/// Bytes of each buffer registrations are made in.
const ARENA: usize = 1 << 14;
/// Shared allocations one input may make (each is a /dev/shm file).
const MAX_SHM: usize = 2;
/// How long teardown waits for a transfer to retire.
const RETIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// Engine configurations an input chooses from: plain, tight limits
/// (budgets run out), a progress worker. None listens.
const CONFIGS: [&str; 3] = [
    r#"{"local_route_workers": 1, "close_drain_timeout_ms": 200}"#,
    r#"{"local_route_workers": 1, "close_drain_timeout_ms": 200, "max_registrations": 3,
        "max_prepared_transfers": 2, "max_executions": 1, "max_binding_handles": 6,
        "max_tasks_in_flight": 1, "task_bytes": 4096, "max_bytes_in_flight": 8192,
        "admission_queue_len": 1, "notification_queue_len": 2, "notification_queue_bytes": 1024,
        "max_notification_bytes": 512, "max_descriptors_per_transfer": 4, "inline_max_bytes": 0}"#,
    r#"{"local_route_workers": 1, "close_drain_timeout_ms": 200, "progress_worker": true, "spin_us": 0}"#,
];

/// Options for `orbite_engine_create` over `json`.
pub fn engine_options(json: &str) -> OrbiteEngineOptions {
    OrbiteEngineOptions {
        size: size_of::<OrbiteEngineOptions>() as u32,
        version: ORBITE_RECORD_VERSION,
        abi_major: ORBITE_ABI_MAJOR,
        flags: 0,
        required_features: 0,
        config_json: json.as_ptr(),
        config_json_len: json.len() as u64,
    }
}

/// The size and version an output record starts with.
pub fn record_header<T>() -> (u32, u32) {
    (size_of::<T>() as u32, ORBITE_RECORD_VERSION)
}

/// Runs a byte-output call as a C caller does: asks for the size, then
/// calls again with a buffer of that size. `call` gets a buffer pointer
/// (null or live for the capacity), the capacity and a live `needed`.
pub fn buffer_out(mut call: impl FnMut(*mut u8, usize, *mut usize) -> OrbiteStatus) -> Result<Vec<u8>, OrbiteStatus> {
    let mut needed = 0usize;
    match call(std::ptr::null_mut(), 0, &mut needed) {
        OrbiteStatus::BufferTooSmall => {}
        OrbiteStatus::Ok => return Ok(Vec::new()),
        s => return Err(s),
    }
    let mut buf = vec![0u8; needed];
    match call(buf.as_mut_ptr(), buf.len(), &mut needed) {
        OrbiteStatus::Ok => {
            buf.truncate(needed);
            Ok(buf)
        }
        s => Err(s),
    }
}

/// A temporary file for file transfers, and a descriptor of it to adopt;
/// one per process.
fn scratch_file() -> &'static (String, std::fs::File) {
    static FILE: OnceLock<(String, std::fs::File)> = OnceLock::new();
    FILE.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("orbite-fuzz-abi-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("the temporary directory is writable");
        file.set_len(1 << 16).expect("the scratch file takes 64 KiB");
        (path.to_string_lossy().into_owned(), file)
    })
}

/// The release callback: counts its calls in the context's counter.
unsafe extern "C" fn on_release(context: *mut c_void) {
    // SAFETY: the context is an AtomicU32 in a Box the world keeps until
    // after the engine was released (and so after every callback ran).
    let counter = unsafe { &*context.cast::<AtomicU32>() };
    counter.fetch_add(1, Ordering::AcqRel);
}

/// A handle this input made, and whether it is still meant to work.
#[derive(Debug, Clone, Copy)]
struct Held {
    raw: u64,
    alive: bool,
}

/// How a handle argument was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Choice {
    /// One of ours, live.
    Live(usize),
    /// One of ours, released: it must never work again.
    Stale,
    /// Zero, a made-up number or a handle of another kind.
    Other,
}

struct Reg {
    held: Held,
    addr: u64,
}

struct World {
    engine: Held,
    /// Two buffers registrations are made in (u64 words: aligned).
    arenas: Vec<Vec<u64>>,
    regs: Vec<Reg>,
    /// Release callbacks of successful registrations (must each run once)
    /// and of refused ones (at most once).
    callbacks: Vec<(Box<AtomicU32>, bool)>,
    shms: Vec<(Held, u64, u64)>,
    peers: Vec<Held>,
    xfers: Vec<Held>,
    files: Vec<Held>,
    blobs: Vec<Vec<u8>>,
    ranges: Vec<OrbiteRemoteRange>,
    /// The engine's own peer information.
    self_info: Vec<u8>,
    /// A close did not drain (or its report was not asked for): owners of
    /// work that was running then are kept for good, so charges need not
    /// return to zero.
    undrained_close: bool,
    /// The engine was closed.
    closed: bool,
}

impl World {
    fn pools(&self) -> [&[Held]; 4] {
        [&self.peers, &self.xfers, &self.files, std::slice::from_ref(&self.engine)]
    }

    /// A handle argument from `pool`, or zero, a made-up value, or one of
    /// another kind.
    fn pick(&self, input: &mut Input<'_>, pool: &[Held]) -> (u64, Choice) {
        let b = input.u8();
        match b {
            0..200 if !pool.is_empty() => {
                let i = b as usize % pool.len();
                let h = pool[i];
                (h.raw, if h.alive { Choice::Live(i) } else { Choice::Stale })
            }
            200..220 => (0, Choice::Other),
            220..240 => (input.u64(), Choice::Other),
            _ => {
                let pools = self.pools();
                let other = pools[b as usize % pools.len()];
                let raw = other.get(input.u8() as usize % other.len().max(1)).map_or(1, |h| h.raw);
                // A handle of another kind, unless it is one of `pool`'s.
                match pool.iter().position(|h| h.raw == raw) {
                    Some(i) if pool[i].alive => (raw, Choice::Live(i)),
                    Some(_) => (raw, Choice::Stale),
                    None => (raw, Choice::Other),
                }
            }
        }
    }

    fn pick_reg(&self, input: &mut Input<'_>) -> (u64, Choice) {
        let held: Vec<Held> = self.regs.iter().map(|r| r.held).collect();
        self.pick(input, &held)
    }

    fn pick_shm(&self, input: &mut Input<'_>) -> (u64, Choice) {
        let held: Vec<Held> = self.shms.iter().map(|s| s.0).collect();
        self.pick(input, &held)
    }

    fn arena(&mut self, i: usize) -> u64 {
        let a = &mut self.arenas[i % 2];
        a.as_mut_ptr() as u64
    }
}

/// A released handle must not work again.
#[track_caller]
fn not_stale(choice: Choice, s: OrbiteStatus, what: &str) {
    crate::trace(format_args!("{what} ({choice:?}) -> {s:?}"));
    assert!(!(choice == Choice::Stale && s == OrbiteStatus::Ok), "{what} worked on a released handle");
}

fn create(input: &mut Input<'_>) -> Held {
    let how = input.u8();
    let json = CONFIGS[how as usize % CONFIGS.len()];
    let mut options = engine_options(json);
    let bad_json = [0xffu8, 0xfe, b'{'];
    match how / 8 % 8 {
        1 => options.size -= 8,
        2 => options.version = 9,
        3 => options.abi_major += 1,
        4 => options.required_features = input.u64(),
        5 => options.config_json = std::ptr::null(),
        6 => {
            options.config_json = bad_json.as_ptr();
            options.config_json_len = bad_json.len() as u64;
        }
        7 => options.flags = 1 << (input.u8() % 31 + 1),
        _ => {}
    }
    let mut engine = OrbiteEngine::default();
    // SAFETY: `options` is a live local whose pointer names `json` (or
    // `bad_json`), both alive for the call, or null with its length
    // checked first; `engine` is a live local. No flag that is set here
    // makes the engine listen: ORBITE_ENGINE_DEPLOYMENT (bit 0) is never
    // among them.
    let s = unsafe { orbite_engine_create(&options, &mut engine) };
    Held { raw: engine.raw, alive: s == OrbiteStatus::Ok }
}

pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let engine = create(&mut input);
    let e = OrbiteEngine { raw: engine.raw };
    // SAFETY: buffer_out passes a live buffer of the length it gives.
    let self_info = buffer_out(|b, c, n| unsafe { orbite_engine_export_peer(e, b, c, n) }).unwrap_or_default();
    let mut w = World {
        engine,
        arenas: vec![vec![0u64; ARENA / 8]; 2],
        regs: Vec::new(),
        callbacks: Vec::new(),
        shms: Vec::new(),
        peers: Vec::new(),
        xfers: Vec::new(),
        files: Vec::new(),
        blobs: Vec::new(),
        ranges: Vec::new(),
        self_info,
        undrained_close: false,
        closed: false,
    };
    let mut steps = 0;
    while !input.is_empty() && steps < 64 {
        step(&mut w, &mut input);
        steps += 1;
    }
    teardown(&mut w);
}

fn step(w: &mut World, input: &mut Input<'_>) {
    let engine = OrbiteEngine { raw: w.engine.raw };
    let n = input.u8() % 25;
    crate::trace(format_args!("op {n}"));
    match n {
        0 => register(w, input, false),
        1 => register(w, input, true),
        2 => {
            let len = input.u16() as u64 * 16;
            if w.shms.iter().filter(|s| s.0.alive).count() >= MAX_SHM {
                return;
            }
            let mut shm = OrbiteShm::default();
            let mut addr: *mut c_void = std::ptr::null_mut();
            // SAFETY: both outputs are live locals.
            let s = unsafe { orbite_shm_alloc(engine, len, &mut shm, &mut addr) };
            crate::trace(format_args!("orbite_shm_alloc {len} -> {s:?}"));
            if s == OrbiteStatus::Ok {
                w.shms.push((Held { raw: shm.raw, alive: true }, addr as u64, len));
            }
        }
        3 => {
            let (raw, c) = w.pick_shm(input);
            let s = orbite_shm_release(OrbiteShm { raw });
            not_stale(c, s, "orbite_shm_release");
            if let (Choice::Live(i), OrbiteStatus::Ok) = (c, s) {
                w.shms[i].0.alive = false;
            }
        }
        4 => {
            let (raw, c) = w.pick_reg(input);
            let s = orbite_mem_deregister(OrbiteRegistration { raw });
            not_stale(c, s, "orbite_mem_deregister");
            if let (Choice::Live(i), OrbiteStatus::Ok) = (c, s) {
                w.regs[i].held.alive = false;
            }
        }
        5 => {
            let (raw, c) = w.pick_reg(input);
            let cap = input.u8() as usize;
            let mut buf = vec![0u8; cap];
            let mut needed = 0usize;
            // SAFETY: `buf` is live for `cap` bytes, `needed` a live local.
            let s = unsafe { orbite_mem_export(OrbiteRegistration { raw }, buf.as_mut_ptr(), cap, &mut needed) };
            not_stale(c, s, "orbite_mem_export");
            if s == OrbiteStatus::Ok {
                assert!(needed <= cap, "an export fits where it was written");
                buf.truncate(needed);
                w.blobs.push(buf);
            } else if s == OrbiteStatus::BufferTooSmall {
                assert!(needed > cap, "too small means more is needed");
            }
        }
        6 => {
            let (raw, c) = w.pick_reg(input);
            let mut out = remote_range();
            // SAFETY: `out` is a live local with its size and version set.
            let s = unsafe { orbite_mem_remote_range(OrbiteRegistration { raw }, &mut out) };
            not_stale(c, s, "orbite_mem_remote_range");
            if s == OrbiteStatus::Ok {
                w.ranges.push(out);
            }
        }
        7 => peer_open(w, input),
        8 => {
            let (raw, c) = w.pick(input, &w.peers);
            let mut blob = w.blobs.get(input.u8() as usize % w.blobs.len().max(1)).cloned().unwrap_or_default();
            let flip = input.u8() as usize;
            if flip < blob.len() {
                blob[flip] ^= input.u8() | 1;
            }
            let mut out = remote_range();
            // SAFETY: `blob` is readable for its length, `out` a live local
            // with its size and version set.
            let s = unsafe { orbite_peer_import_range(OrbitePeer { raw }, blob.as_ptr(), blob.len(), &mut out) };
            not_stale(c, s, "orbite_peer_import_range");
            if s == OrbiteStatus::Ok {
                w.ranges.push(out);
            }
        }
        9 => {
            let (raw, c) = w.pick(input, &w.peers);
            not_stale(c, orbite_peer_check(OrbitePeer { raw }), "orbite_peer_check");
        }
        10 => {
            let (raw, c) = w.pick(input, &w.peers);
            let s = orbite_peer_close(OrbitePeer { raw }, input.u8() as u64 % 4);
            not_stale(c, s, "orbite_peer_close");
            // Released even when closing fails.
            if let Choice::Live(i) = c {
                w.peers[i].alive = false;
            }
        }
        11 => prepare(w, input, false),
        12 => prepare(w, input, true),
        13 => {
            let (raw, c) = w.pick(input, &w.xfers);
            not_stale(c, orbite_xfer_post(OrbiteXfer { raw }), "orbite_xfer_post");
        }
        14 => {
            let (raw, c) = w.pick(input, &w.xfers);
            not_stale(c, orbite_xfer_cancel(OrbiteXfer { raw }), "orbite_xfer_cancel");
        }
        15 => {
            let (raw, c) = w.pick(input, &w.xfers);
            let mut st = xfer_state();
            if input.u8() == 0 {
                st.size += 4;
            }
            // SAFETY: `st` is a live local, at least as long as its size
            // says (a size 4 bytes too large is refused before the write).
            let s = unsafe { orbite_xfer_query(OrbiteXfer { raw }, &mut st) };
            not_stale(c, s, "orbite_xfer_query");
            if s == OrbiteStatus::Ok {
                check_state(&st);
            }
        }
        16 => {
            let (raw, c) = w.pick(input, &w.xfers);
            let s = orbite_xfer_release(OrbiteXfer { raw });
            not_stale(c, s, "orbite_xfer_release");
            if let (Choice::Live(i), OrbiteStatus::Ok) = (c, s) {
                w.xfers[i].alive = false;
            }
        }
        17 => {
            let (raw, c) = w.pick(input, &w.peers);
            let n = input.u16() as usize % 2048;
            let mut payload = input.bytes(n).to_vec();
            payload.resize(n, 0x42);
            // SAFETY: `payload` is readable for its length.
            let s = unsafe { orbite_notify(OrbitePeer { raw }, payload.as_ptr(), payload.len()) };
            not_stale(c, s, "orbite_notify");
        }
        18 => {
            let cap = input.u16() as usize % 4096;
            let mut buf = vec![0u8; cap];
            let mut out = drain_result();
            // SAFETY: `buf` is live for `cap` bytes (a null pointer when
            // empty is a valid "no room"), `out` a live local with its size
            // and version set.
            let s = unsafe { orbite_notifs_drain(engine, buf.as_mut_ptr(), cap, &mut out) };
            if s == OrbiteStatus::Ok {
                assert!(out.written as usize <= cap, "a drain writes within its buffer");
                crate::notify::walk(&buf[..out.written as usize]);
            } else if s == OrbiteStatus::BufferTooSmall {
                assert!(out.next_needed as usize > cap || out.count > 0);
            }
        }
        19 => file_open(w, input),
        20 => {
            let (raw, c) = w.pick(input, &w.files);
            let mut info = OrbiteFileInfo::default();
            (info.size, info.version) = record_header::<OrbiteFileInfo>();
            // SAFETY: `info` is a live local with its size and version set.
            let s = unsafe { orbite_file_query(OrbiteFile { raw }, &mut info) };
            not_stale(c, s, "orbite_file_query");
        }
        21 => {
            let (raw, c) = w.pick(input, &w.files);
            let s = orbite_file_close(OrbiteFile { raw }, input.u8() as u64 % 4);
            not_stale(c, s, "orbite_file_close");
            // Released even when the wait times out.
            if let Choice::Live(i) = c {
                w.files[i].alive = false;
            }
        }
        22 => misc(w, input),
        23 => {
            let (raw, c) = w.pick(input, &[w.engine]);
            if input.bool() {
                let mut report = OrbiteCloseReport::default();
                (report.size, report.version) = record_header::<OrbiteCloseReport>();
                let report_ptr = if input.bool() { std::ptr::null_mut() } else { &mut report as *mut _ };
                // SAFETY: the report is null or a live local with its size
                // and version set.
                let s = unsafe { orbite_engine_close(OrbiteEngine { raw }, input.u8() as u64 % 4, report_ptr) };
                not_stale(c, s, "orbite_engine_close");
                if s == OrbiteStatus::Ok {
                    w.closed = true;
                    w.undrained_close |= report_ptr.is_null() || report.drained == 0;
                }
            } else {
                let s = orbite_engine_release(OrbiteEngine { raw });
                not_stale(c, s, "orbite_engine_release");
                if let (Choice::Live(_), OrbiteStatus::Ok) = (c, s) {
                    w.engine.alive = false;
                }
            }
        }
        _ => hooks(engine, input),
    }
}

fn remote_range() -> OrbiteRemoteRange {
    let mut r = OrbiteRemoteRange::default();
    (r.size, r.version) = record_header::<OrbiteRemoteRange>();
    r
}

fn xfer_state() -> OrbiteXferState {
    let mut s = OrbiteXferState::default();
    (s.size, s.version) = record_header::<OrbiteXferState>();
    s
}

fn drain_result() -> OrbiteDrainResult {
    let mut r = OrbiteDrainResult::default();
    (r.size, r.version) = record_header::<OrbiteDrainResult>();
    r
}

fn check_state(st: &OrbiteXferState) {
    match st.state {
        ORBITE_STATE_NOT_POSTED => assert_eq!(st.drained, 0),
        ORBITE_STATE_IN_PROGRESS => assert!(st.drained == 0 && (1..=3).contains(&st.phase), "{st:?}"),
        ORBITE_STATE_RETIRED => {
            assert_eq!(st.drained, 1, "retired means drained");
            assert!(st.transferred_prefix <= st.transferred_bytes && st.transferred_bytes <= st.total_bytes, "{st:?}");
            if st.code == ORBITE_OUTCOME_SUCCESS {
                assert_eq!(st.transferred_prefix, st.total_bytes, "success moves every byte");
            }
        }
        s => panic!("unknown transfer state {s}"),
    }
}

fn register(w: &mut World, input: &mut Input<'_>, in_shm: bool) {
    let engine = OrbiteEngine { raw: w.engine.raw };
    let (base, room) = if in_shm {
        let live: Vec<(u64, u64)> = w.shms.iter().filter(|s| s.0.alive).map(|s| (s.1, s.2)).collect();
        match live.get(input.u8() as usize % live.len().max(1)) {
            Some(&s) => s,
            None => return,
        }
    } else {
        let i = input.u8() as usize;
        (w.arena(i), ARENA as u64)
    };
    let offset = input.u16() as u64 % room.max(1);
    let len = (input.u16() as u64).min(room - offset);
    let permission = input.u8() as u32 % 4;
    let flags = input.u8();
    let counter = Box::new(AtomicU32::new(0));
    let mut region = OrbiteMemRegion {
        size: size_of::<OrbiteMemRegion>() as u32,
        version: ORBITE_RECORD_VERSION,
        addr: base + offset,
        len,
        kind: ORBITE_MEM_DRAM,
        device: 0,
        permission,
        reserved: 0,
        release: None,
        release_context: std::ptr::null_mut(),
    };
    if flags & 1 != 0 {
        region.release = Some(on_release);
        region.release_context = (&*counter as *const AtomicU32).cast_mut().cast();
    }
    match flags >> 1 & 7 {
        1 => region.size -= 8,
        2 => region.kind = ORBITE_MEM_VRAM,
        3 => region.kind = 7,
        4 => region.device = 1,
        5 => region.reserved = 1,
        6 => region.addr = 0,
        _ => {}
    }
    let mut reg = OrbiteRegistration::default();
    // SAFETY: `region` is a live local (a size 8 bytes short is refused
    // before the rest is read); the range it names lies inside one of this
    // world's arenas or a live shared allocation, which outlive the engine
    // (and so every transfer and the release callback); the callback's
    // context is a counter the world keeps as long.
    let s = unsafe { orbite_mem_register(engine, &region, &mut reg) };
    crate::trace(format_args!("orbite_mem_register {region:?} -> {s:?} {:#x}", reg.raw));
    let ok = s == OrbiteStatus::Ok;
    if ok {
        w.regs.push(Reg { held: Held { raw: reg.raw, alive: true }, addr: region.addr });
    }
    if flags & 1 != 0 {
        w.callbacks.push((counter, ok));
    }
}

fn peer_open(w: &mut World, input: &mut Input<'_>) {
    let engine = OrbiteEngine { raw: w.engine.raw };
    let info = match input.u8() % 4 {
        0 => w.self_info.clone(),
        // Another epoch with no endpoint: refused, nothing to dial.
        1 => encode_peer_info(input.u64(), ""),
        2 => {
            let n = input.u8() as usize;
            w.self_info[..n.min(w.self_info.len())].to_vec()
        }
        _ => w.blobs.first().cloned().unwrap_or_default(),
    };
    // Whatever the info, nothing with an endpoint and a foreign epoch is
    // passed on: this target never dials.
    if let Ok((epoch, endpoint)) = decode_peer_info(&info) {
        let own = decode_peer_info(&w.self_info).map(|p| p.0).ok();
        if !endpoint.is_empty() && Some(epoch) != own {
            return;
        }
    }
    let mut peer = OrbitePeer::default();
    // SAFETY: `info` is readable for its length, `peer` is a live local.
    let s = unsafe { orbite_peer_open(engine, info.as_ptr(), info.len(), input.u8() as u64, &mut peer) };
    crate::trace(format_args!("orbite_peer_open -> {s:?}"));
    if s == OrbiteStatus::Ok {
        w.peers.push(Held { raw: peer.raw, alive: true });
    }
}

fn prepare(w: &mut World, input: &mut Input<'_>, file: bool) {
    let engine = OrbiteEngine { raw: w.engine.raw };
    let op = [ORBITE_OP_READ, ORBITE_OP_WRITE, 7][input.u8() as usize % 3];
    let intent = input.u8() as u32 % 4;
    let route = input.u8() as u32 % 8;
    let flags_byte = input.u8();
    let flags = (flags_byte as u32 & 3) | if flags_byte & 0x80 != 0 { 0x100 } else { 0 };
    let deadline_us = [0, 0, 1, 50, 10_000][input.u8() as usize % 5];
    let (peer, peer_choice) =
        if file && !input.u8().is_multiple_of(4) { (0, Choice::Other) } else { w.pick(input, &w.peers) };
    let (file_raw, file_choice) = if file { w.pick(input, &w.files) } else { (0, Choice::Other) };
    let local: Vec<OrbiteDesc> = (0..input.u8() % 5)
        .map(|_| {
            let (registration, _) = w.pick_reg(input);
            OrbiteDesc { registration, offset: input.u16() as u64 % 8192, len: input.u16() as u64 % 8192 }
        })
        .collect();
    let remote: Vec<OrbiteDesc> = (0..input.u8() % 5)
        .map(|_| {
            let how = input.u8();
            let (offset, len) = (input.u16() as u64 % 8192, input.u16() as u64 % 8192);
            match how % 3 {
                0 => {
                    let r = w.ranges.get(how as usize / 3 % w.ranges.len().max(1));
                    OrbiteDesc { registration: r.map_or(0, |r| r.remote_registration), offset, len }
                }
                1 => {
                    // By address: inside a registration of ours.
                    let r = w.regs.get(how as usize / 3 % w.regs.len().max(1)).map_or(0, |r| r.addr);
                    OrbiteDesc { registration: 0, offset: r + offset, len }
                }
                _ => OrbiteDesc { registration: input.u64(), offset: input.u64(), len },
            }
        })
        .collect();
    let n = input.u8() as usize * 4;
    let mut notification = input.bytes(n).to_vec();
    notification.resize(n, 1);
    let mut spec = OrbiteXferSpec {
        size: size_of::<OrbiteXferSpec>() as u32,
        version: ORBITE_RECORD_VERSION,
        op,
        intent,
        route,
        flags,
        deadline_us,
        peer: OrbitePeer { raw: peer },
        local: local.as_ptr(),
        local_count: local.len() as u64,
        remote: remote.as_ptr(),
        remote_count: remote.len() as u64,
        notification: notification.as_ptr(),
        notification_len: notification.len() as u64,
    };
    // Counts beyond every limit are refused before an array is read.
    match input.u8() % 16 {
        1 => spec.size += 8,
        2 => spec.version = 2,
        3 => spec.local_count = u64::MAX,
        4 => spec.remote_count = u64::MAX,
        5 => spec.notification_len = u64::MAX,
        6 => {
            spec.local = std::ptr::null();
            spec.local_count = spec.local_count.max(1);
        }
        _ => {}
    }
    let mut xfer = OrbiteXfer::default();
    // SAFETY: `spec` is a live local (a size 8 bytes too large is refused
    // before the rest is read); its arrays are live locals as long as their
    // counts, or null with a count that is refused, or a count beyond every
    // limit (refused before the array is read); `xfer` is a live local.
    let s = unsafe {
        if file {
            orbite_xfer_prepare_file(engine, &spec, OrbiteFile { raw: file_raw }, &mut xfer)
        } else {
            orbite_xfer_prepare(engine, &spec, &mut xfer)
        }
    };
    crate::trace(format_args!("prepare (file {file}) -> {s:?}"));
    if s == OrbiteStatus::Ok {
        assert!(peer_choice != Choice::Stale && file_choice != Choice::Stale, "prepare with a released handle");
        w.xfers.push(Held { raw: xfer.raw, alive: true });
    }
}

fn file_open(w: &mut World, input: &mut Input<'_>) {
    let engine = OrbiteEngine { raw: w.engine.raw };
    let (path, file) = scratch_file();
    let mode = input.u8() as u32 % 4;
    let flags = input.u8() as u32 % 4;
    let mut out = OrbiteFile::default();
    let s = if input.bool() {
        use std::os::fd::AsRawFd;
        let fd = [file.as_raw_fd(), -1, 1 << 20][input.u8() as usize % 3];
        // SAFETY: `out` is a live local; `fd` is the scratch file's open
        // descriptor (kept open by this process), or not a descriptor.
        unsafe { orbite_file_adopt(engine, fd, mode, &mut out) }
    } else {
        let p: &[u8] = match input.u8() % 4 {
            0 | 1 => path.as_bytes(),
            2 => b"relative/path",
            _ => b"/nonexistent/orbite-fuzz",
        };
        // SAFETY: `p` is readable for its length, `out` a live local.
        unsafe { orbite_file_open(engine, p.as_ptr(), p.len(), mode, flags, &mut out) }
    };
    crate::trace(format_args!("file open or adopt -> {s:?}"));
    if s == OrbiteStatus::Ok {
        w.files.push(Held { raw: out.raw, alive: true });
    }
}

fn misc(w: &mut World, input: &mut Input<'_>) {
    let engine = OrbiteEngine { raw: w.engine.raw };
    let cap = input.u8() as usize;
    let mut buf = vec![0u8; cap];
    let mut needed = 0usize;
    match input.u8() % 6 {
        0 => {
            let mut info = OrbiteAbiInfo::default();
            (info.size, info.version) = record_header::<OrbiteAbiInfo>();
            if input.bool() {
                info.size -= 4;
            }
            // SAFETY: `info` is a live local, at least as long as its size.
            let _ = unsafe { orbite_abi_info(&mut info) };
        }
        1 => {
            // SAFETY: `buf` is live for `cap` bytes, `needed` a live local.
            let s = unsafe { orbite_last_error(buf.as_mut_ptr().cast(), cap, &mut needed) };
            if s == OrbiteStatus::Ok {
                assert!(needed >= 1 && needed <= cap && buf[needed - 1] == 0, "a NUL-terminated message");
            }
        }
        2 => {
            let mut origin = 0u32;
            // SAFETY: all three outputs are live locals or live for `cap`.
            let _ = unsafe { orbite_config_document(&mut origin, buf.as_mut_ptr(), cap, &mut needed) };
        }
        3 => {
            let mut st = OrbiteStats::default();
            (st.size, st.version) = record_header::<OrbiteStats>();
            // SAFETY: `st` is a live local with its size and version set.
            let s = unsafe { orbite_engine_stats(engine, &mut st) };
            assert!(w.engine.alive || s != OrbiteStatus::Ok, "stats of a released engine");
        }
        4 => {
            // SAFETY: `buf` is live for `cap` bytes, `needed` a live local.
            let s = unsafe { orbite_engine_export_peer(engine, buf.as_mut_ptr(), cap, &mut needed) };
            if s == OrbiteStatus::Ok {
                let info = &buf[..needed];
                assert!(decode_peer_info(info).is_ok(), "an engine's own peer information decodes");
            }
        }
        _ => {
            let mut source = 0u32;
            // SAFETY: all three outputs are live locals or live for `cap`.
            let _ = unsafe { orbite_engine_advertise(engine, &mut source, buf.as_mut_ptr(), cap, &mut needed) };
        }
    }
}

fn hooks(engine: OrbiteEngine, input: &mut Input<'_>) {
    let kind = input.u8() as u32 % 5;
    let bytes = input.u16() as u64;
    let effect = input.u8() as u32 % 3;
    match input.u8() % 4 {
        0 => {
            let _ = orbite_test_fault_push(engine, kind, bytes, effect);
        }
        1 => {
            let _ = orbite_test_hold_all(engine, effect);
        }
        2 => {
            let _ = orbite_test_release_held(engine, kind, bytes, effect);
        }
        _ => {
            let mut held = 0u64;
            // SAFETY: `held` is a live local.
            let _ = unsafe { orbite_test_wait_held(engine, bytes % 3, 0, &mut held) };
        }
    }
}

/// Releases everything this input made, then checks the engine is back to
/// zero and every release callback ran exactly once.
fn teardown(w: &mut World) {
    let engine = OrbiteEngine { raw: w.engine.raw };
    if w.engine.alive {
        // Nothing held by the test hooks stays held.
        let _ = orbite_test_hold_all(engine, 0);
        let _ = orbite_test_release_held(engine, ORBITE_TEST_RUN, 0, 0);
    }
    for x in w.xfers.iter_mut().filter(|x| x.alive) {
        let h = OrbiteXfer { raw: x.raw };
        let _ = orbite_xfer_cancel(h);
        let start = Instant::now();
        loop {
            let mut st = xfer_state();
            // SAFETY: `st` is a live local with its size and version set.
            let s = unsafe { orbite_xfer_query(h, &mut st) };
            assert_eq!(s, OrbiteStatus::Ok, "a live transfer answers");
            check_state(&st);
            if st.state != ORBITE_STATE_IN_PROGRESS {
                break;
            }
            assert!(start.elapsed() < RETIRE_TIMEOUT, "a cancelled transfer did not retire: {st:?}");
            let _ = orbite_test_release_held(engine, ORBITE_TEST_RUN, 0, 0);
            std::thread::sleep(Duration::from_micros(200));
        }
        assert_eq!(orbite_xfer_release(h), OrbiteStatus::Ok, "a retired transfer releases");
        x.alive = false;
    }
    for p in w.peers.iter_mut().filter(|p| p.alive) {
        assert_eq!(orbite_peer_close(OrbitePeer { raw: p.raw }, 100), OrbiteStatus::Ok, "a self peer closes");
        p.alive = false;
    }
    for f in w.files.iter_mut().filter(|f| f.alive) {
        assert_eq!(orbite_file_close(OrbiteFile { raw: f.raw }, 1000), OrbiteStatus::Ok, "an idle file closes");
        f.alive = false;
    }
    for r in w.regs.iter_mut().filter(|r| r.held.alive) {
        let s = orbite_mem_deregister(OrbiteRegistration { raw: r.held.raw });
        assert_eq!(s, OrbiteStatus::Ok, "a live registration deregisters (also after close)");
        r.held.alive = false;
    }
    for s in w.shms.iter_mut().filter(|s| s.0.alive) {
        assert_eq!(orbite_shm_release(OrbiteShm { raw: s.0.raw }), OrbiteStatus::Ok, "a shared allocation releases");
        s.0.alive = false;
    }
    if w.engine.alive {
        let mut st = OrbiteStats::default();
        (st.size, st.version) = record_header::<OrbiteStats>();
        // SAFETY: `st` is a live local with its size and version set.
        assert_eq!(unsafe { orbite_engine_stats(engine, &mut st) }, OrbiteStatus::Ok);
        let charged = [
            ("registrations", st.registrations),
            ("registered_bytes", st.registered_bytes),
            ("fenced_registrations", st.fenced_registrations),
            ("host_allocations", st.host_allocations),
            ("host_memory_bytes", st.host_memory_bytes),
            ("prepared_transfers", st.prepared_transfers),
            ("executions", st.executions),
            ("queued_executions", st.queued_executions),
            ("bytes_in_flight", st.bytes_in_flight),
            ("tasks_in_flight", st.tasks_in_flight),
            ("unquiesced_owners", st.unquiesced_owners),
            ("binding_handles", st.binding_handles),
        ];
        assert_eq!(st.binding_handles, 0, "binding handles left once every handle was released: {st:?}");
        for (what, n) in charged {
            assert!(w.undrained_close || n == 0, "{what} left charged once every handle was released: {st:?}");
        }
        assert_eq!(orbite_engine_release(engine), OrbiteStatus::Ok, "an engine with no handles releases");
        w.engine.alive = false;
    }
    for (counter, registered) in &w.callbacks {
        let n = counter.load(Ordering::Acquire);
        if *registered && !w.undrained_close {
            assert_eq!(n, 1, "a registration's release callback runs exactly once");
        } else {
            assert!(n <= 1, "a release callback runs at most once");
        }
    }
}

/// Writes an operation byte.
fn op(s: &mut Seed, n: u8) -> &mut Seed {
    s.u8(n)
}

pub fn seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    // Register two ranges, open the self peer, write between them, post,
    // query, release.
    let mut s = Seed::new();
    s.u8(0);
    op(&mut s, 0).u8(0).u16(0).u16(4096).u8(2).u8(1);
    op(&mut s, 0).u8(1).u16(0).u16(4096).u8(2).u8(0);
    op(&mut s, 6).u8(1);
    op(&mut s, 7).u8(0).u8(10);
    // Prepare: WRITE, normal, default route, no flags, no deadline, peer 0,
    // one local desc (reg 0), one remote desc (range 0), no notification.
    op(&mut s, 11).u8(1).u8(0).u8(0).u8(0).u8(0).u8(0);
    s.u8(1).u8(0).u16(0).u16(1024);
    s.u8(1).u8(0).u16(0).u16(1024);
    s.u8(0).u8(0);
    op(&mut s, 13).u8(0);
    op(&mut s, 15).u8(0).u8(1);
    op(&mut s, 16).u8(0);
    op(&mut s, 4).u8(0);
    op(&mut s, 4).u8(0);
    seeds.push(s.done());
    // Notifications to the self peer, with a notifying transfer, drained.
    let mut s = Seed::new();
    s.u8(2);
    op(&mut s, 0).u8(0).u16(0).u16(8192).u8(2).u8(0);
    op(&mut s, 6).u8(0);
    op(&mut s, 7).u8(0).u8(0);
    op(&mut s, 17).u8(0).u16(5).bytes(b"hello");
    op(&mut s, 11).u8(0).u8(1).u8(0).u8(1).u8(0).u8(0);
    s.u8(1).u8(0).u16(0).u16(64);
    s.u8(1).u8(0).u16(4096).u16(64);
    s.u8(3).bytes(b"notification");
    s.u8(0);
    op(&mut s, 13).u8(0);
    op(&mut s, 18).u16(512);
    op(&mut s, 22).u8(32).u8(1);
    seeds.push(s.done());
    // Tight limits, a shared allocation, a file, held tasks, closing.
    let mut s = Seed::new();
    s.u8(1);
    op(&mut s, 2).u16(256);
    op(&mut s, 1).u8(0).u16(0).u16(2048).u8(2).u8(0);
    op(&mut s, 19).u8(2).u8(0).u8(0).u8(0);
    op(&mut s, 24).u8(0).u16(0).u8(1).u8(1);
    // WRITE into the file: no peer, file 0.
    op(&mut s, 12).u8(1).u8(0).u8(0).u8(0).u8(0).u8(1).u8(0);
    s.u8(1).u8(0).u16(0).u16(1024);
    s.u8(1).u8(0).u16(0).u16(1024);
    s.u8(0).u8(0);
    op(&mut s, 13).u8(0);
    op(&mut s, 16).u8(0);
    // Close (with a report, 0 ms), then try to release.
    op(&mut s, 23).u8(0).u8(1).u8(0).u8(0);
    op(&mut s, 23).u8(0).u8(0);
    seeds.push(s.done());
    // Broken records and made-up handles.
    let mut s = Seed::new();
    s.u8(8 * 2);
    op(&mut s, 4).u8(230).u64(0x0200_0001_0000_0000);
    op(&mut s, 22).u8(0).u8(0).u8(1);
    seeds.push(s.done());
    seeds
}
