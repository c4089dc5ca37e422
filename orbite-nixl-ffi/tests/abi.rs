//! The C ABI driven from Rust through its extern "C" functions: flows,
//! lifecycle statuses, bad input (N10), the generated header and the
//! record layouts the C tests assert.
//!
//! The entry points over raw pointers are `unsafe`. Every `unsafe` block
//! here calls one with what its `# Safety` section asks: each pointer is a
//! reference to a live Rust value (records with their size and version
//! set), points into a live buffer of the length passed with it, or is null
//! where the call checks for null; nothing else touches that memory during
//! the call; registered buffers outlive their registrations and the
//! transfers naming them, and are not accessed while an execution is
//! active. Comments mark the calls that rely on more.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};

use orbite_nixl::*;

const OK: OrbiteStatus = OrbiteStatus::Ok;

fn last_error() -> String {
    let mut needed = 0usize;
    let _ = unsafe { orbite_last_error(std::ptr::null_mut(), 0, &mut needed) };
    let mut buf = vec![0u8; needed];
    assert_eq!(unsafe { orbite_last_error(buf.as_mut_ptr().cast(), buf.len(), &mut needed) }, OK);
    String::from_utf8_lossy(&buf[..needed - 1]).into_owned()
}

#[track_caller]
fn ok(s: OrbiteStatus) {
    assert_eq!(s, OK, "{}", last_error());
}

fn options(json: &str) -> OrbiteEngineOptions {
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

fn engine(json: &str) -> OrbiteEngine {
    let mut e = OrbiteEngine::default();
    ok(unsafe { orbite_engine_create(&options(json), &mut e) });
    e
}

fn stats(e: OrbiteEngine) -> OrbiteStats {
    let mut s = OrbiteStats { size: size_of::<OrbiteStats>() as u32, version: 1, ..Default::default() };
    ok(unsafe { orbite_engine_stats(e, &mut s) });
    s
}

fn region(buf: &mut [u8], permission: u32) -> OrbiteMemRegion {
    OrbiteMemRegion {
        size: size_of::<OrbiteMemRegion>() as u32,
        version: ORBITE_RECORD_VERSION,
        addr: buf.as_mut_ptr() as u64,
        len: buf.len() as u64,
        kind: ORBITE_MEM_DRAM,
        device: 0,
        permission,
        reserved: 0,
        release: None,
        release_context: std::ptr::null_mut(),
    }
}

fn register(e: OrbiteEngine, buf: &mut [u8]) -> OrbiteRegistration {
    let mut r = OrbiteRegistration::default();
    ok(unsafe { orbite_mem_register(e, &region(buf, ORBITE_PERM_REMOTE_READ_WRITE), &mut r) });
    r
}

/// Runs a byte-output call twice: with no buffer for the size, then with a
/// buffer of that size. `f` gets what those calls' `# Safety` asks: a buffer
/// (or null) with its capacity and a writable `needed`.
fn blob(mut f: impl FnMut(*mut u8, usize, *mut usize) -> OrbiteStatus) -> Vec<u8> {
    let mut needed = 0usize;
    assert_eq!(f(std::ptr::null_mut(), 0, &mut needed), OrbiteStatus::BufferTooSmall);
    let mut b = vec![0u8; needed];
    ok(f(b.as_mut_ptr(), b.len(), &mut needed));
    b
}

fn self_peer(e: OrbiteEngine) -> OrbitePeer {
    let info = blob(|b, c, n| unsafe { orbite_engine_export_peer(e, b, c, n) });
    let mut p = OrbitePeer::default();
    ok(unsafe { orbite_peer_open(e, info.as_ptr(), info.len(), 1000, &mut p) });
    p
}

fn import(p: OrbitePeer, r: OrbiteRegistration) -> OrbiteRemoteRange {
    let meta = blob(|b, c, n| unsafe { orbite_mem_export(r, b, c, n) });
    let mut out = OrbiteRemoteRange { size: size_of::<OrbiteRemoteRange>() as u32, version: 1, ..Default::default() };
    ok(unsafe { orbite_peer_import_range(p, meta.as_ptr(), meta.len(), &mut out) });
    out
}

fn spec(op: u32, peer: OrbitePeer, local: &[OrbiteDesc], remote: &[OrbiteDesc]) -> OrbiteXferSpec {
    OrbiteXferSpec {
        size: size_of::<OrbiteXferSpec>() as u32,
        version: ORBITE_RECORD_VERSION,
        op,
        intent: ORBITE_INTENT_NORMAL,
        route: ORBITE_ROUTE_DEFAULT,
        flags: 0,
        deadline_us: 0,
        peer,
        local: local.as_ptr(),
        local_count: local.len() as u64,
        remote: remote.as_ptr(),
        remote_count: remote.len() as u64,
        notification: std::ptr::null(),
        notification_len: 0,
    }
}

fn query(x: OrbiteXfer) -> OrbiteXferState {
    let mut s = OrbiteXferState { size: size_of::<OrbiteXferState>() as u32, version: 1, ..Default::default() };
    ok(unsafe { orbite_xfer_query(x, &mut s) });
    s
}

fn wait_retired(x: OrbiteXfer) -> OrbiteXferState {
    let start = std::time::Instant::now();
    loop {
        let s = query(x);
        if s.state == ORBITE_STATE_RETIRED {
            return s;
        }
        assert!(start.elapsed().as_secs() < 20, "transfer did not retire");
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

fn zero_stats() -> OrbiteStats {
    OrbiteStats { size: size_of::<OrbiteStats>() as u32, version: 1, ..Default::default() }
}

fn close_and_release(e: OrbiteEngine) {
    let mut r = OrbiteCloseReport { size: size_of::<OrbiteCloseReport>() as u32, version: 1, ..Default::default() };
    ok(unsafe { orbite_engine_close(e, 5000, &mut r) });
    assert_eq!((r.drained, r.unquiesced), (1, 0));
    ok(orbite_engine_release(e));
}

#[test]
fn local_transfer_with_notification_and_charges_back_to_baseline() {
    let e = engine("{}");
    let mut src = vec![0u8; 1 << 16];
    let mut dst = vec![0xEEu8; 1 << 16];
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let (rs, rd) = (register(e, &mut src), register(e, &mut dst));
    let p = self_peer(e);
    let remote = import(p, rd);
    let local = [
        OrbiteDesc { registration: rs.raw, offset: 1, len: 1000 },
        OrbiteDesc { registration: rs.raw, offset: 5000, len: 3000 },
    ];
    let remote_d = [
        OrbiteDesc { registration: remote.remote_registration, offset: 10, len: 2500 },
        OrbiteDesc { registration: remote.remote_registration, offset: 20000, len: 1500 },
    ];
    let payload = b"blocks 1-2 free\0\xff\xfe";
    let mut sp = spec(ORBITE_OP_WRITE, p, &local, &remote_d);
    sp.flags = ORBITE_XFER_NOTIFY;
    sp.notification = payload.as_ptr();
    sp.notification_len = payload.len() as u64;
    let mut x = OrbiteXfer::default();
    ok(unsafe { orbite_xfer_prepare(e, &sp, &mut x) });
    assert_eq!(query(x).state, ORBITE_STATE_NOT_POSTED);
    ok(orbite_xfer_post(x));
    let s = wait_retired(x);
    assert_eq!((s.code, s.drained, s.remote_effect), (ORBITE_OUTCOME_SUCCESS, 1, ORBITE_EFFECT_KNOWN));
    assert_eq!((s.transferred_prefix, s.total_bytes, s.route), (4000, 4000, ORBITE_ROUTE_LOOPBACK));
    let sent: Vec<u8> = [&src[1..1001], &src[5000..8000]].concat();
    assert_eq!(&dst[10..2510], &sent[..2500]);
    assert_eq!(&dst[20000..21500], &sent[2500..]);
    assert!(dst[..10].iter().chain(&dst[2510..20000]).chain(&dst[21500..]).all(|b| *b == 0xEE), "guard bytes");

    // Too small a buffer takes nothing; a big one takes it, byte for byte.
    let mut small = [0u8; 8];
    let mut d = OrbiteDrainResult { size: size_of::<OrbiteDrainResult>() as u32, version: 1, ..Default::default() };
    assert_eq!(
        unsafe { orbite_notifs_drain(e, small.as_mut_ptr(), small.len(), &mut d) },
        OrbiteStatus::BufferTooSmall
    );
    assert_eq!(d.count, 0);
    assert!(d.next_needed > 8);
    let mut big = vec![0u8; d.next_needed as usize];
    ok(unsafe { orbite_notifs_drain(e, big.as_mut_ptr(), big.len(), &mut d) });
    assert_eq!((d.count, d.written, d.next_needed), (1, big.len() as u64, 0));
    let mut at = 0u64;
    let mut v = OrbiteNotifView {
        size: size_of::<OrbiteNotifView>() as u32,
        version: 1,
        sender_epoch: 0,
        sender: std::ptr::null(),
        sender_len: 0,
        payload: std::ptr::null(),
        payload_len: 0,
    };
    ok(unsafe { orbite_notif_next(big.as_ptr(), big.len(), &mut at, &mut v) });
    // SAFETY: the view points into `big`.
    let got = unsafe { std::slice::from_raw_parts(v.payload, v.payload_len as usize) };
    assert_eq!(got, payload);
    assert_eq!(unsafe { orbite_notif_next(big.as_ptr(), big.len(), &mut at, &mut v) }, OrbiteStatus::NotFound);

    // A drained success may be posted again.
    ok(orbite_xfer_post(x));
    assert_eq!(wait_retired(x).execution, 2);
    ok(orbite_xfer_release(x));
    assert_eq!(orbite_xfer_release(x), OrbiteStatus::StaleHandle, "double release");
    ok(orbite_mem_deregister(rs));
    ok(orbite_mem_deregister(rd));
    ok(orbite_peer_close(p, 1000));
    let mut left = stats(e);
    left.notification_bytes = 0; // the second execution's notification
    assert_eq!(left, zero_stats());
    close_and_release(e);
}

#[test]
fn shared_allocation_is_exported_as_shared_and_plain_memory_is_not() {
    let e = engine("{}");
    let (mut shm, mut addr) = (OrbiteShm::default(), std::ptr::null_mut::<c_void>());
    ok(unsafe { orbite_shm_alloc(e, 1 << 20, &mut shm, &mut addr) });
    let mut r = OrbiteRegistration::default();
    // SAFETY: `addr` is 1 MiB the engine allocated; 4 KiB in it.
    let inside = unsafe { std::slice::from_raw_parts_mut(addr.cast::<u8>().add(4096), 4096) };
    ok(unsafe { orbite_mem_register(e, &region(inside, ORBITE_PERM_REMOTE_READ_WRITE), &mut r) });
    let mut plain = vec![0u8; 4096];
    let rp = register(e, &mut plain);
    let p = self_peer(e);
    assert_eq!(import(p, r).shared, 1);
    assert_eq!(import(p, rp).shared, 0);
    ok(orbite_shm_release(shm)); // the registration keeps the memory
    ok(orbite_mem_deregister(r));
    ok(orbite_mem_deregister(rp));
    ok(orbite_peer_close(p, 1000));
    assert_eq!(stats(e), zero_stats());
    close_and_release(e);
}

static RELEASED: AtomicU32 = AtomicU32::new(0);
static CALLBACK_ENGINE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

unsafe extern "C" fn on_release(context: *mut c_void) {
    assert_eq!(context as usize, 0xC0FFEE);
    // Calling back into the library would deadlock if any of its locks
    // were held around the callback.
    let mut s = zero_stats();
    let e = OrbiteEngine { raw: CALLBACK_ENGINE.load(Ordering::SeqCst) };
    assert_eq!(unsafe { orbite_engine_stats(e, &mut s) }, OK);
    RELEASED.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn active_release_is_refused_and_the_owner_is_released_only_after_retirement() {
    let e = engine(r#"{"local_route_workers": 1}"#);
    CALLBACK_ENGINE.store(e.raw, Ordering::SeqCst);
    let mut src = vec![7u8; 8192];
    let mut dst = vec![0u8; 8192];
    let rs = register(e, &mut src);
    let mut rg = region(&mut dst, ORBITE_PERM_REMOTE_READ_WRITE);
    rg.release = Some(on_release);
    rg.release_context = 0xC0FFEE as *mut c_void;
    let mut rd = OrbiteRegistration::default();
    // `on_release` may run once, on any thread, with that context.
    ok(unsafe { orbite_mem_register(e, &rg, &mut rd) });
    let p = self_peer(e);
    let remote = import(p, rd);
    let local = [OrbiteDesc { registration: rs.raw, offset: 0, len: 8192 }];
    let remote_d = [OrbiteDesc { registration: remote.remote_registration, offset: 0, len: 8192 }];
    let mut x = OrbiteXfer::default();
    ok(unsafe { orbite_xfer_prepare(e, &spec(ORBITE_OP_WRITE, p, &local, &remote_d), &mut x) });
    ok(orbite_test_hold_all(e, 1));
    ok(orbite_xfer_post(x));
    let mut held = 0;
    ok(unsafe { orbite_test_wait_held(e, 1, 10_000, &mut held) });
    assert_eq!(held, 1);
    assert_eq!(orbite_xfer_release(x), OrbiteStatus::Active);
    assert!(last_error().contains("active"));
    let s = query(x);
    assert_eq!((s.state, s.drained), (ORBITE_STATE_IN_PROGRESS, 0), "still pollable, not drained");
    // Deregistration fences at once but the owner waits for the borrower.
    ok(orbite_mem_deregister(rd));
    assert_eq!(RELEASED.load(Ordering::SeqCst), 0);
    assert_eq!(orbite_xfer_post(x), OrbiteStatus::Active, "one execution at a time");
    ok(orbite_test_hold_all(e, 0));
    ok(orbite_test_release_held(e, ORBITE_TEST_FAIL, 100, 1));
    let s = wait_retired(x);
    assert_eq!((s.code, s.remote_effect, s.transferred_prefix), (ORBITE_OUTCOME_FAILED, ORBITE_EFFECT_UNKNOWN, 100));
    assert_eq!(RELEASED.load(Ordering::SeqCst), 0, "the transfer still holds the range");
    assert_eq!(orbite_xfer_post(x), OrbiteStatus::Refused, "no repost after an uncertain failure");
    ok(orbite_xfer_release(x));
    assert_eq!(RELEASED.load(Ordering::SeqCst), 1, "released exactly once, after the last borrower");
    ok(orbite_mem_deregister(rs));
    ok(orbite_peer_close(p, 1000));
    assert_eq!(stats(e), zero_stats());
    close_and_release(e);
    assert_eq!(RELEASED.load(Ordering::SeqCst), 1);
}

#[test]
fn n10_bad_input_is_refused_and_changes_nothing() {
    // Engine creation: ABI, record version and size, features, config.
    let mut e = OrbiteEngine::default();
    let mut o = options("{}");
    o.abi_major += 1;
    assert_eq!(unsafe { orbite_engine_create(&o, &mut e) }, OrbiteStatus::VersionMismatch);
    let mut o = options("{}");
    o.size -= 8;
    assert_eq!(unsafe { orbite_engine_create(&o, &mut e) }, OrbiteStatus::VersionMismatch);
    let mut o = options("{}");
    o.version = 2;
    assert_eq!(unsafe { orbite_engine_create(&o, &mut e) }, OrbiteStatus::VersionMismatch);
    let mut o = options("{}");
    o.required_features = 1 << 40;
    assert_eq!(unsafe { orbite_engine_create(&o, &mut e) }, OrbiteStatus::NotSupported);
    assert_eq!(
        unsafe { orbite_engine_create(&options(r#"{"no_such_field": 1}"#), &mut e) },
        OrbiteStatus::InvalidArgument
    );
    assert!(last_error().contains("no_such_field"));
    assert_eq!(unsafe { orbite_engine_create(std::ptr::null(), &mut e) }, OrbiteStatus::InvalidArgument);
    assert_eq!(e, OrbiteEngine::default(), "nothing written on failure");

    let e = engine(r#"{"max_descriptors_per_transfer": 64}"#);
    let other = engine("{}");
    let mut a = vec![1u8; 4096];
    let mut b = vec![0u8; 4096];
    let mut c = vec![0u8; 4096];
    let (ra, rb) = (register(e, &mut a), register(e, &mut b));
    let rc = register(other, &mut c);
    let p = self_peer(e);
    let remote = import(p, rb);
    let base = stats(e);
    let rdesc = [OrbiteDesc { registration: remote.remote_registration, offset: 0, len: 16 }];
    let prepare = |local: &[OrbiteDesc], remote: &[OrbiteDesc]| {
        let mut x = OrbiteXfer::default();
        let s = unsafe { orbite_xfer_prepare(e, &spec(ORBITE_OP_WRITE, p, local, remote), &mut x) };
        assert_eq!(x, OrbiteXfer::default(), "nothing written on failure");
        s
    };
    let d = |registration: u64, offset: u64, len: u64| [OrbiteDesc { registration, offset, len }];
    // Stale, foreign and garbage handles.
    let mut gone = vec![0u8; 64];
    let rg = register(e, &mut gone);
    ok(orbite_mem_deregister(rg));
    let base_after = stats(e);
    assert_eq!(base_after, base);
    assert_eq!(prepare(&d(rg.raw, 0, 16), &rdesc), OrbiteStatus::StaleHandle);
    assert_eq!(orbite_mem_deregister(rg), OrbiteStatus::StaleHandle, "double deregistration");
    assert_eq!(prepare(&d(p.raw, 0, 16), &rdesc), OrbiteStatus::WrongHandle, "a peer handle as a registration");
    assert_eq!(prepare(&d(rc.raw, 0, 16), &rdesc), OrbiteStatus::WrongHandle, "another engine's registration");
    assert_eq!(prepare(&d(0, 0, 16), &rdesc), OrbiteStatus::StaleHandle);
    assert_eq!(prepare(&d(0x1_2345_6789, 0, 16), &rdesc), OrbiteStatus::WrongHandle);
    assert_eq!(orbite_xfer_post(OrbiteXfer { raw: ra.raw }), OrbiteStatus::WrongHandle);
    assert_eq!(orbite_engine_release(OrbiteEngine { raw: p.raw }), OrbiteStatus::WrongHandle);
    // Oversized arrays are refused before they are read (the pointer is null).
    let mut sp = spec(ORBITE_OP_WRITE, p, &[], &rdesc);
    sp.local_count = 1 << 40;
    let mut x = OrbiteXfer::default();
    // The count is wrong for the array, but beyond the engine's limit, which
    // `orbite_xfer_prepare` checks before it reads the array.
    assert_eq!(unsafe { orbite_xfer_prepare(e, &sp, &mut x) }, OrbiteStatus::ResourceExhausted);
    sp.local_count = 65;
    assert_eq!(unsafe { orbite_xfer_prepare(e, &sp, &mut x) }, OrbiteStatus::ResourceExhausted);
    // Arithmetic overflow and bounds.
    assert_eq!(prepare(&d(ra.raw, u64::MAX - 4, 16), &rdesc), OrbiteStatus::OutOfRange);
    assert_eq!(prepare(&d(ra.raw, 4090, 16), &rdesc), OrbiteStatus::OutOfRange);
    assert_eq!(prepare(&d(ra.raw, 0, 32), &rdesc), OrbiteStatus::OutOfRange, "lists differ in length");
    let mut rg = region(&mut gone, ORBITE_PERM_LOCAL_ONLY);
    rg.addr = u64::MAX - 10;
    let mut r = OrbiteRegistration::default();
    assert_eq!(unsafe { orbite_mem_register(e, &rg, &mut r) }, OrbiteStatus::OutOfRange);
    let mut rg = region(&mut gone, ORBITE_PERM_LOCAL_ONLY);
    rg.kind = ORBITE_MEM_VRAM;
    assert_eq!(unsafe { orbite_mem_register(e, &rg, &mut r) }, OrbiteStatus::NotSupported);
    rg.kind = 9;
    assert_eq!(unsafe { orbite_mem_register(e, &rg, &mut r) }, OrbiteStatus::InvalidArgument);
    // Unknown enumeration values and flags.
    let mut sp = spec(7, p, &d(ra.raw, 0, 16), &rdesc);
    assert_eq!(unsafe { orbite_xfer_prepare(e, &sp, &mut x) }, OrbiteStatus::InvalidArgument);
    sp.op = ORBITE_OP_WRITE;
    sp.flags = 0x80;
    assert_eq!(unsafe { orbite_xfer_prepare(e, &sp, &mut x) }, OrbiteStatus::InvalidArgument);
    // Output records of an unknown size or version.
    let mut st = zero_stats();
    st.size += 8;
    assert_eq!(unsafe { orbite_engine_stats(e, &mut st) }, OrbiteStatus::VersionMismatch);
    // Malformed metadata.
    let mut rr = OrbiteRemoteRange { size: size_of::<OrbiteRemoteRange>() as u32, version: 1, ..Default::default() };
    assert_eq!(
        unsafe { orbite_peer_import_range(p, b"ORBR\x02\x00\x07".as_ptr(), 7, &mut rr) },
        OrbiteStatus::InvalidArgument
    );
    assert_eq!(
        unsafe { orbite_peer_import_range(p, b"ORBR\x01\x00\x07".as_ptr(), 7, &mut rr) },
        OrbiteStatus::VersionMismatch
    );
    let mut peer = OrbitePeer::default();
    assert_eq!(unsafe { orbite_peer_open(e, b"junk".as_ptr(), 4, 100, &mut peer) }, OrbiteStatus::InvalidArgument);
    // A live child refuses the engine's release.
    assert_eq!(orbite_engine_release(e), OrbiteStatus::Active);
    // An injected panic comes back as a status; the library keeps serving.
    ok(orbite_test_inject_panic());
    let mut st = zero_stats();
    assert_eq!(unsafe { orbite_engine_stats(e, &mut st) }, OrbiteStatus::Internal);
    assert!(last_error().contains("panic"), "{}", last_error());
    assert_eq!(stats(e), base, "no failed call allocated or admitted anything");

    ok(orbite_mem_deregister(ra));
    ok(orbite_mem_deregister(rb));
    ok(orbite_mem_deregister(rc));
    ok(orbite_peer_close(p, 1000));
    assert_eq!(stats(e), zero_stats());
    close_and_release(e);
    close_and_release(other);
    assert_eq!(unsafe { orbite_engine_stats(e, &mut st) }, OrbiteStatus::StaleHandle, "released engine");
}

#[test]
fn handle_budget_is_charged_and_refusal_leaves_nothing() {
    let e = engine(r#"{"max_binding_handles": 2}"#);
    let mut a = vec![0u8; 64];
    let mut b = vec![0u8; 64];
    let mut c = vec![0u8; 64];
    let ra = register(e, &mut a);
    let rb = register(e, &mut b);
    let before = stats(e);
    assert_eq!(before.binding_handles, 2);
    let mut r = OrbiteRegistration::default();
    assert_eq!(
        unsafe { orbite_mem_register(e, &region(&mut c, ORBITE_PERM_LOCAL_ONLY), &mut r) },
        OrbiteStatus::ResourceExhausted
    );
    assert_eq!(stats(e), before, "the refused registration registered nothing");
    ok(orbite_mem_deregister(ra));
    ok(orbite_mem_deregister(rb));
    assert_eq!(stats(e), zero_stats());
    close_and_release(e);
}

#[test]
fn abi_info_reports_sizes_and_features() {
    let mut i = OrbiteAbiInfo { size: size_of::<OrbiteAbiInfo>() as u32, version: 1, ..Default::default() };
    ok(unsafe { orbite_abi_info(&mut i) });
    assert_eq!((i.abi_major, i.abi_minor), (ORBITE_ABI_MAJOR, ORBITE_ABI_MINOR));
    assert_eq!(i.xfer_spec_size as usize, size_of::<OrbiteXferSpec>());
    assert_eq!(i.features & ORBITE_FEATURE_TEST_HOOKS, ORBITE_FEATURE_TEST_HOOKS, "tests build the hooks");
    let mut small = OrbiteAbiInfo { size: 8, version: 1, ..Default::default() };
    assert_eq!(unsafe { orbite_abi_info(&mut small) }, OrbiteStatus::VersionMismatch);
}

#[test]
fn checked_in_header_is_the_generated_one() {
    let generated = std::fs::read_to_string(concat!(env!("OUT_DIR"), "/nixl.h")).unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../include/orbite/nixl.h");
    if std::env::var_os("ORBITE_BLESS_HEADER").is_some() {
        std::fs::write(path, &generated).unwrap();
    }
    let checked_in = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "include/orbite/nixl.h differs from the declarations; run ORBITE_BLESS_HEADER=1 cargo test -p orbite-nixl-ffi"
    );
}

#[test]
fn tcp_peer_write_and_read_back_with_binary_notification() {
    let target = engine(r#"{"listen": "127.0.0.1:0"}"#);
    let initiator = engine(r#"{"peer_timeout_ms": 30000}"#);
    let mut theirs = vec![0x55u8; 1 << 20];
    let rt = register(target, &mut theirs);
    let info = blob(|b, c, n| unsafe { orbite_engine_export_peer(target, b, c, n) });
    let meta = blob(|b, c, n| unsafe { orbite_mem_export(rt, b, c, n) });
    let mut p = OrbitePeer::default();
    ok(unsafe { orbite_peer_open(initiator, info.as_ptr(), info.len(), 10_000, &mut p) });
    let mut remote =
        OrbiteRemoteRange { size: size_of::<OrbiteRemoteRange>() as u32, version: 1, ..Default::default() };
    ok(unsafe { orbite_peer_import_range(p, meta.as_ptr(), meta.len(), &mut remote) });
    let mut mine: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
    let mut back = vec![0u8; 1 << 20];
    let (rm, rb) = (register(initiator, &mut mine), register(initiator, &mut back));
    let local = [
        OrbiteDesc { registration: rm.raw, offset: 3, len: 300_000 },
        OrbiteDesc { registration: rm.raw, offset: 500_000, len: 200_001 },
    ];
    let rr = remote.remote_registration;
    let far = [OrbiteDesc { registration: rr, offset: 17, len: 500_001 }];
    let payload = [0u8, 1, 0xFF, 0, 0x80];
    let mut sp = spec(ORBITE_OP_WRITE, p, &local, &far);
    sp.route = ORBITE_ROUTE_TCP;
    sp.flags = ORBITE_XFER_NOTIFY;
    sp.notification = payload.as_ptr();
    sp.notification_len = payload.len() as u64;
    let mut x = OrbiteXfer::default();
    ok(unsafe { orbite_xfer_prepare(initiator, &sp, &mut x) });
    ok(orbite_xfer_post(x));
    let s = wait_retired(x);
    assert_eq!((s.code, s.route, s.transferred_prefix), (ORBITE_OUTCOME_SUCCESS, ORBITE_ROUTE_TCP, 500_001));
    ok(orbite_xfer_release(x));
    let sent: Vec<u8> = [&mine[3..300_003], &mine[500_000..700_001]].concat();
    assert_eq!(&theirs[17..500_018], &sent[..]);
    assert!(theirs[..17].iter().chain(&theirs[500_018..]).all(|b| *b == 0x55), "guard bytes");
    let mut buf = vec![0u8; 4096];
    let mut d = OrbiteDrainResult { size: size_of::<OrbiteDrainResult>() as u32, version: 1, ..Default::default() };
    ok(unsafe { orbite_notifs_drain(target, buf.as_mut_ptr(), buf.len(), &mut d) });
    assert_eq!(d.count, 1);
    assert_eq!(&buf[16 + (d.written as usize - 16 - payload.len())..d.written as usize], &payload);

    // Bound here: the spec keeps a pointer to the descriptors.
    let into = [OrbiteDesc { registration: rb.raw, offset: 0, len: 500_001 }];
    let mut sp = spec(ORBITE_OP_READ, p, &into, &far);
    sp.route = ORBITE_ROUTE_TCP;
    ok(unsafe { orbite_xfer_prepare(initiator, &sp, &mut x) });
    ok(orbite_xfer_post(x));
    assert_eq!(wait_retired(x).code, ORBITE_OUTCOME_SUCCESS);
    ok(orbite_xfer_release(x));
    assert_eq!(&back[..500_001], &sent[..]);

    ok(orbite_peer_close(p, 5000));
    for r in [rm, rb] {
        ok(orbite_mem_deregister(r));
    }
    ok(orbite_mem_deregister(rt));
    assert_eq!(stats(initiator), zero_stats());
    close_and_release(initiator);
    close_and_release(target);
}

#[test]
fn local_file_open_transfer_both_ways_eof_close_and_adopt() {
    let e = engine(r#"{"task_bytes": 65536}"#);
    let path = format!("/tmp/orbite-abi-file-{}", std::process::id());
    std::fs::write(&path, vec![0x11u8; 100_000]).unwrap();
    let mut f = OrbiteFile::default();
    // Unknown flags and modes are refused before opening.
    for (mode, flags, want) in
        [(7, 0, OrbiteStatus::InvalidArgument), (ORBITE_FILE_READ_WRITE, 0x100, OrbiteStatus::InvalidArgument)]
    {
        assert_eq!(unsafe { orbite_file_open(e, path.as_ptr(), path.len(), mode, flags, &mut f) }, want);
    }
    assert_eq!(f, OrbiteFile::default());
    // O_DIRECT and the durability flags open, and the record says so.
    for flags in [ORBITE_FILE_DIRECT, ORBITE_FILE_SYNC, ORBITE_FILE_DSYNC, ORBITE_FILE_DIRECT | ORBITE_FILE_DSYNC] {
        let mut g = OrbiteFile::default();
        ok(unsafe { orbite_file_open(e, path.as_ptr(), path.len(), ORBITE_FILE_READ_WRITE, flags, &mut g) });
        let mut info = OrbiteFileInfo { size: size_of::<OrbiteFileInfo>() as u32, version: 1, ..Default::default() };
        ok(unsafe { orbite_file_query(g, &mut info) });
        // O_SYNC carries O_DSYNC's bit.
        let want = if flags & ORBITE_FILE_SYNC != 0 { flags | ORBITE_FILE_DSYNC } else { flags };
        assert_eq!(info.flags, want, "flags {flags:#x}");
        let direct = flags & ORBITE_FILE_DIRECT != 0;
        assert_eq!(info.dio_offset_align != 0 && info.dio_mem_align != 0, direct, "{info:?}");
        assert_eq!(info.st_mode & libc::S_IFMT, libc::S_IFREG);
        // A caller of ABI 1.4 gets the record of then, and nothing past it.
        let mut old = [0xABu8; size_of::<OrbiteFileInfo>()];
        old[..8].copy_from_slice(&[40u32.to_ne_bytes(), 1u32.to_ne_bytes()].concat());
        ok(unsafe { orbite_file_query(g, old.as_mut_ptr().cast()) });
        assert_eq!(u64::from_ne_bytes(old[16..24].try_into().unwrap()), 100_000, "len in the prefix");
        assert!(old[40..].iter().all(|b| *b == 0xAB), "nothing written past 40 bytes");
        ok(orbite_file_close(g, 1000));
    }
    ok(unsafe { orbite_file_open(e, path.as_ptr(), path.len(), ORBITE_FILE_READ_WRITE, 0, &mut f) });
    let mut info = OrbiteFileInfo { size: size_of::<OrbiteFileInfo>() as u32, version: 1, ..Default::default() };
    ok(unsafe { orbite_file_query(f, &mut info) });
    assert_eq!((info.len, info.mode, info.closed), (100_000, ORBITE_FILE_READ_WRITE, 0));
    let mut mem = vec![0u8; 200_000];
    for (i, b) in mem.iter_mut().enumerate() {
        *b = (i % 253) as u8;
    }
    let r = register(e, &mut mem);
    let local = [OrbiteDesc { registration: r.raw, offset: 0, len: 150_000 }];
    let extents = [OrbiteDesc { registration: 0, offset: 10, len: 150_000 }];
    let mut sp = spec(ORBITE_OP_WRITE, OrbitePeer::default(), &local, &extents);
    let mut x = OrbiteXfer::default();
    ok(unsafe { orbite_xfer_prepare_file(e, &sp, f, &mut x) });
    ok(orbite_xfer_post(x));
    let s = wait_retired(x);
    assert_eq!((s.code, s.route, s.transferred_prefix), (ORBITE_OUTCOME_SUCCESS, ORBITE_ROUTE_FILE, 150_000));
    ok(orbite_xfer_release(x));
    let file = std::fs::read(&path).unwrap();
    assert_eq!(file.len(), 150_010);
    assert!(file[..10].iter().all(|b| *b == 0x11));
    assert_eq!(&file[10..], &mem[..150_000]);
    // READ past the end: SHORT with the exact prefix; nothing beyond lands.
    let back = [OrbiteDesc { registration: r.raw, offset: 150_000, len: 50_000 }];
    let tail = [OrbiteDesc { registration: 0, offset: 120_000, len: 50_000 }];
    mem[150_000..].fill(0xEE);
    sp = spec(ORBITE_OP_READ, OrbitePeer::default(), &back, &tail);
    ok(unsafe { orbite_xfer_prepare_file(e, &sp, f, &mut x) });
    ok(orbite_xfer_post(x));
    let s = wait_retired(x);
    assert_eq!((s.code, s.transferred_prefix), (ORBITE_OUTCOME_SHORT, 30_010));
    assert_eq!(&mem[150_000..180_010], &file[120_000..150_010]);
    assert!(mem[180_010..].iter().all(|b| *b == 0xEE));
    ok(orbite_xfer_release(x));
    // A peer named with a file, or a notification, is refused.
    sp.peer = OrbitePeer { raw: 1 };
    assert_eq!(unsafe { orbite_xfer_prepare_file(e, &sp, f, &mut x) }, OrbiteStatus::InvalidArgument);
    sp.peer = OrbitePeer::default();
    sp.flags = ORBITE_XFER_NOTIFY;
    assert_eq!(unsafe { orbite_xfer_prepare_file(e, &sp, f, &mut x) }, OrbiteStatus::NotSupported);
    sp.flags = 0;
    // Adoption duplicates the descriptor: closing and reusing the caller's
    // number never reaches the adopted file.
    let other = format!("{path}-other");
    std::fs::write(&other, b"other").unwrap();
    let theirs = std::fs::File::open(&path).unwrap();
    let mut adopted = OrbiteFile::default();
    // `theirs` stays open during both calls.
    assert_eq!(
        unsafe { orbite_file_adopt(e, std::os::fd::AsRawFd::as_raw_fd(&theirs), ORBITE_FILE_READ_WRITE, &mut adopted) },
        OrbiteStatus::NotAllowed,
        "a read-only descriptor cannot be adopted for writing"
    );
    ok(unsafe { orbite_file_adopt(e, std::os::fd::AsRawFd::as_raw_fd(&theirs), ORBITE_FILE_READ_ONLY, &mut adopted) });
    drop(theirs);
    let _reuse = std::fs::File::open(&other).unwrap();
    let mut ai = OrbiteFileInfo { size: size_of::<OrbiteFileInfo>() as u32, version: 1, ..Default::default() };
    ok(unsafe { orbite_file_query(adopted, &mut ai) });
    assert_eq!((ai.dev, ai.ino, ai.len), (info.dev, info.ino, 150_010));
    assert_eq!(
        unsafe { orbite_file_adopt(e, -1, ORBITE_FILE_READ_ONLY, &mut adopted.clone()) },
        OrbiteStatus::InvalidArgument
    );
    // A number that names no open descriptor is refused before anything
    // treats it as one.
    assert_eq!(
        unsafe { orbite_file_adopt(e, 1 << 20, ORBITE_FILE_READ_ONLY, &mut adopted.clone()) },
        OrbiteStatus::InvalidArgument
    );
    ok(orbite_file_close(adopted, 1000));
    // Close fences: a transfer prepared before it cannot post after it.
    ok(unsafe { orbite_xfer_prepare_file(e, &sp, f, &mut x) });
    ok(orbite_file_close(f, 1000));
    assert_eq!(orbite_xfer_post(x), OrbiteStatus::Closed);
    assert_eq!(unsafe { orbite_file_query(f, &mut info) }, OrbiteStatus::StaleHandle);
    ok(orbite_xfer_release(x));
    ok(orbite_mem_deregister(r));
    assert_eq!(stats(e), zero_stats());
    close_and_release(e);
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&other);
}

#[test]
fn late_registrations_import_after_a_refresh_and_remote_ranges_resolve_by_address() {
    let target = engine(r#"{"listen": "127.0.0.1:0", "route": "tcp"}"#);
    let initiator = engine(r#"{"route": "tcp"}"#);
    let info = blob(|b, c, n| unsafe { orbite_engine_export_peer(target, b, c, n) });
    let mut p = OrbitePeer::default();
    ok(unsafe { orbite_peer_open(initiator, info.as_ptr(), info.len(), 10_000, &mut p) });
    ok(orbite_peer_check(p));
    // Registered after the peer was opened: the import finds it.
    let mut theirs = vec![0x11u8; 256 << 10];
    let rt = register(target, &mut theirs);
    let remote = import(p, rt);
    assert_eq!((remote.addr, remote.len), (theirs.as_ptr() as u64, 256 << 10));
    // The same range registered again gives byte-identical metadata.
    let meta = blob(|b, c, n| unsafe { orbite_mem_export(rt, b, c, n) });
    ok(orbite_mem_deregister(rt));
    let rt2 = register(target, &mut theirs);
    assert_eq!(
        blob(|b, c, n| unsafe { orbite_mem_export(rt2, b, c, n) }),
        meta,
        "metadata names the range, not the id"
    );
    // The peer pushed both changes before its calls returned; this process
    // is its own side channel, so wait until they were applied (a real
    // peer's metadata takes longer to arrive than its pushes).
    let start = std::time::Instant::now();
    while import(p, rt2).remote_registration == remote.remote_registration {
        assert!(start.elapsed().as_secs() < 5, "the re-registration never reached the view");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let mut mine: Vec<u8> = (0..256u32 << 10).map(|i| (i % 253) as u8).collect();
    let rm = register(initiator, &mut mine);
    // By address: `offset` is an address in the peer; it resolves to the
    // current registration of that range (the deregistered one is gone).
    let base = theirs.as_ptr() as u64;
    let far = [OrbiteDesc { registration: 0, offset: base + 1000, len: 100_000 }];
    let local = [OrbiteDesc { registration: rm.raw, offset: 0, len: 100_000 }];
    let mut sp = spec(ORBITE_OP_WRITE, p, &local, &far);
    sp.flags = ORBITE_XFER_REMOTE_BY_ADDRESS;
    let mut x = OrbiteXfer::default();
    ok(unsafe { orbite_xfer_prepare(initiator, &sp, &mut x) });
    ok(orbite_xfer_post(x));
    assert_eq!(wait_retired(x).code, ORBITE_OUTCOME_SUCCESS);
    ok(orbite_xfer_release(x));
    assert_eq!(&theirs[1000..101_000], &mine[..100_000]);
    assert!(theirs[..1000].iter().all(|b| *b == 0x11), "guard bytes");
    // An address no registration covers is refused at prepare.
    let far = [OrbiteDesc { registration: 0, offset: base + (256 << 10) - 10, len: 100 }];
    let local = [OrbiteDesc { registration: rm.raw, offset: 0, len: 100 }];
    let mut sp = spec(ORBITE_OP_WRITE, p, &local, &far);
    sp.flags = ORBITE_XFER_REMOTE_BY_ADDRESS;
    assert_eq!(unsafe { orbite_xfer_prepare(initiator, &sp, &mut x) }, OrbiteStatus::NotFound);
    // Our own registration, for the self peer.
    let mut own = OrbiteRemoteRange { size: size_of::<OrbiteRemoteRange>() as u32, version: 1, ..Default::default() };
    ok(unsafe { orbite_mem_remote_range(rm, &mut own) });
    assert_eq!((own.addr, own.len), (mine.as_ptr() as u64, 256 << 10));
    let me = self_peer(initiator);
    assert_eq!(own.remote_registration, import(me, rm).remote_registration);
    ok(orbite_peer_close(me, 1000));
    ok(orbite_mem_deregister(rt2));
    ok(orbite_mem_deregister(rm));
    ok(orbite_peer_close(p, 5000));
    assert_eq!(stats(initiator), zero_stats());
    close_and_release(initiator);
    close_and_release(target);
}

#[test]
fn deployment_engines_listen_on_all_interfaces_and_say_what_they_advertise() {
    let mut o = options("{}");
    o.flags = ORBITE_ENGINE_DEPLOYMENT;
    let mut e = OrbiteEngine::default();
    ok(unsafe { orbite_engine_create(&o, &mut e) });
    let mut source = 0u32;
    let line = blob(|b, c, n| unsafe { orbite_engine_advertise(e, &mut source, b, c, n) });
    let line = String::from_utf8(line).unwrap();
    assert!(line.starts_with("listening on 0.0.0.0:"), "{line}");
    assert!((ORBITE_ADVERTISE_DEFAULT_ROUTE..=ORBITE_ADVERTISE_LOOPBACK_FALLBACK).contains(&source), "{source}");
    assert_eq!(source == ORBITE_ADVERTISE_LOOPBACK_FALLBACK, line.contains("only processes on this host"));
    close_and_release(e);
    // Without the flag and without `listen`: no listener.
    let e = engine("{}");
    let line = blob(|b, c, n| unsafe { orbite_engine_advertise(e, &mut source, b, c, n) });
    assert_eq!(
        (source, String::from_utf8(line).unwrap().as_str()),
        (ORBITE_ADVERTISE_NONE, "not listening: local transfers only")
    );
    close_and_release(e);
    // An explicit listen wins; unknown flags are refused.
    let mut o = options(r#"{"listen": "127.0.0.1:0"}"#);
    o.flags = ORBITE_ENGINE_DEPLOYMENT;
    let mut e = OrbiteEngine::default();
    ok(unsafe { orbite_engine_create(&o, &mut e) });
    let _ = blob(|b, c, n| unsafe { orbite_engine_advertise(e, &mut source, b, c, n) });
    assert_eq!(source, ORBITE_ADVERTISE_BOUND);
    close_and_release(e);
    o.flags = 0x100;
    assert_eq!(unsafe { orbite_engine_create(&o, &mut e) }, OrbiteStatus::InvalidArgument);
}

/// A caller built against ABI 1.1 passes the 112-byte stats record of that
/// version: it gets the fields it knows, and nothing after them is written.
#[test]
fn a_stats_record_of_an_older_abi_gets_its_prefix() {
    let e = engine("{}");
    let mut raw = [0xEEu8; 128];
    raw[..4].copy_from_slice(&112u32.to_le_bytes());
    raw[4..8].copy_from_slice(&1u32.to_le_bytes());
    let mut aligned = [0u64; 16];
    // SAFETY: both are 128 plain bytes.
    unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr(), aligned.as_mut_ptr().cast::<u8>(), 128) };
    ok(unsafe { orbite_engine_stats(e, aligned.as_mut_ptr().cast::<OrbiteStats>()) });
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(aligned.as_ptr().cast::<u8>(), raw.as_mut_ptr(), 128) };
    assert_eq!(u32::from_le_bytes(raw[..4].try_into().unwrap()), 112);
    assert!(raw[112..].iter().all(|b| *b == 0xEE), "written past the caller's record");
    let full = stats(e);
    assert_eq!(u64::from_le_bytes(raw[8..16].try_into().unwrap()), full.registrations);
    // A caller of ABI 1.2: 128 bytes, without the CUDA counters.
    let mut raw2 = [0xEEu64; 21];
    raw2[0] = 128 | (1 << 32);
    ok(unsafe { orbite_engine_stats(e, raw2.as_mut_ptr().cast::<OrbiteStats>()) });
    assert_eq!(raw2[0] as u32, 128);
    assert_eq!(raw2[1], full.registrations);
    assert!(raw2[16..].iter().all(|w| *w == 0xEE), "written past the caller's 1.2 record");
    // A caller of ABI 1.3: 168 bytes, without the listener's counters.
    let mut raw3 = [0xEEu64; 27];
    raw3[0] = 168 | (1 << 32);
    ok(unsafe { orbite_engine_stats(e, raw3.as_mut_ptr().cast::<OrbiteStats>()) });
    assert_eq!(raw3[0] as u32, 168);
    assert_eq!(raw3[1], full.registrations);
    assert!(raw3[21..].iter().all(|w| *w == 0xEE), "written past the caller's 1.3 record");
    let mut odd = OrbiteStats { size: 120, version: 1, ..Default::default() };
    assert_eq!(unsafe { orbite_engine_stats(e, &mut odd) }, OrbiteStatus::VersionMismatch);
    close_and_release(e);
}

/// Found by the `abi` fuzz target: after `orbite_engine_close`, deregistering
/// a registration answered STALE_HANDLE and kept its handle, so the engine
/// handle could never be released. The handle now goes with it.
#[test]
fn deregistering_after_close_lets_the_engine_be_released() {
    let e = engine("{}");
    let mut buf = vec![0u8; 23];
    let r = register(e, &mut buf);
    let mut report =
        OrbiteCloseReport { size: size_of::<OrbiteCloseReport>() as u32, version: 1, ..Default::default() };
    ok(unsafe { orbite_engine_close(e, 5000, &mut report) });
    ok(orbite_mem_deregister(r));
    assert_eq!(orbite_mem_deregister(r), OrbiteStatus::StaleHandle, "a second time: the handle is gone");
    ok(orbite_engine_release(e));
}
