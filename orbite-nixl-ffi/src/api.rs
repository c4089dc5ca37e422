//! The entry points.

use std::ffi::{c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use orbite_core::{
    Desc, ExecutionPhase, Intent, MemoryRange, Op, OutcomeCode, Permission, RegistrationId, RemoteEffect, Route,
    RoutePolicy, Stats, Target, TransferEngine, TransferOptions, TransferSpec, TransferStatus,
};
use parking_lot::Mutex;

use crate::handles::{self, Kind};
use crate::objects::{Child, EngineObj, FileObj, Object, PeerObj, RegObj, ShmObj, XferObj};
use crate::records::*;
use crate::status::{Failure, OrbiteStatus, Res, clear_last_error, fail, set_last_error, with_last_error};
use crate::wire::{PeerInfo, RangeInfo};
use crate::{ORBITE_ABI_MAJOR, ORBITE_ABI_MINOR};

/// Longest JSON configuration accepted.
const MAX_CONFIG_BYTES: usize = 1 << 20;
/// Longest metadata blob accepted.
const MAX_METADATA_BYTES: usize = 64 << 10;
/// Header of a drained notification: epoch, sender length, payload length.
const NOTIF_HEADER: usize = 16;

#[cfg(feature = "test-hooks")]
static INJECT_PANIC: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn features() -> u64 {
    let base = ORBITE_FEATURE_TCP
        | ORBITE_FEATURE_SHM
        | ORBITE_FEATURE_CMA
        | ORBITE_FEATURE_NOTIFICATIONS
        | ORBITE_FEATURE_FILES;
    let base = if orbite_core::cuda::availability().is_ok() { base | ORBITE_FEATURE_VRAM } else { base };
    if cfg!(feature = "test-hooks") { base | ORBITE_FEATURE_TEST_HOOKS } else { base }
}

/// The panic barrier: runs `f`, records its failure for
/// `orbite_last_error`, and turns a panic into `Internal`.
fn entry(name: &str, f: impl FnOnce() -> Res) -> OrbiteStatus {
    let r = catch_unwind(AssertUnwindSafe(|| {
        #[cfg(feature = "test-hooks")]
        if INJECT_PANIC.swap(false, std::sync::atomic::Ordering::AcqRel) {
            panic!("injected panic in {name}");
        }
        f()
    }));
    match r {
        Ok(Ok(())) => {
            clear_last_error();
            OrbiteStatus::Ok
        }
        Ok(Err(Failure { status, message })) => {
            set_last_error(format!("{name}: {message}"));
            status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set_last_error(format!("{name}: internal error (panic): {what}"));
            OrbiteStatus::Internal
        }
    }
}

fn check_header<T: Record>(size: u32, version: u32) -> Res {
    if version != ORBITE_RECORD_VERSION {
        return fail(
            OrbiteStatus::VersionMismatch,
            format!("{} version {version} (this library knows {ORBITE_RECORD_VERSION})", T::NAME),
        );
    }
    if size as usize != size_of::<T>() {
        return fail(
            OrbiteStatus::VersionMismatch,
            format!("{} of {size} bytes (version {version} has {})", T::NAME, size_of::<T>()),
        );
    }
    Ok(())
}

fn check_pointer<T>(p: *const T, what: &str) -> Res {
    if p.is_null() {
        return fail(OrbiteStatus::InvalidArgument, format!("{what} is null"));
    }
    if (p as usize) % align_of::<T>() != 0 {
        return fail(OrbiteStatus::InvalidArgument, format!("{what} is misaligned"));
    }
    Ok(())
}

/// An input record, after its size and version were checked.
///
/// # Safety
/// `p` is null or points to a readable record that starts with the two
/// `u32` header fields and is as long as its `size` field says.
unsafe fn input<'a, T: Record>(p: *const T) -> Res<&'a T> {
    check_pointer(p, T::NAME)?;
    // SAFETY: non-null and aligned (checked); every record starts with two
    // u32 fields, which the caller's contract makes readable.
    let [size, version] = unsafe { std::ptr::read(p.cast::<[u32; 2]>()) };
    check_header::<T>(size, version)?;
    // SAFETY: the record is `size` bytes long, which equals size_of::<T>()
    // (checked), and stays valid for the call.
    Ok(unsafe { &*p })
}

/// Checks an output record's header before any work is done.
///
/// # Safety
/// As for [`input`], and the record is writable.
unsafe fn output_check<T: Record>(p: *mut T) -> Res {
    check_pointer(p, T::NAME)?;
    // SAFETY: as in `input`.
    let [size, version] = unsafe { std::ptr::read(p.cast::<[u32; 2]>()) };
    check_header::<T>(size, version)
}

/// Writes a checked output record.
///
/// # Safety
/// `p` passed [`output_check`].
unsafe fn put<T: Record>(p: *mut T, value: T) {
    // SAFETY: checked: non-null, aligned, writable, size_of::<T>() bytes.
    unsafe { std::ptr::write(p, value) }
}

/// Writes `value` as the record the caller's `header` ([size, version])
/// asks for: whole when it is this library's, or the prefix of an older
/// version whose size is in `older` (the same fields, in the same places),
/// with the caller's size in it.
///
/// # Safety
/// `p` passed [`check_pointer`] and is writable for the size its header
/// declares (the caller's contract).
unsafe fn put_versioned<T: Record>(p: *mut T, header: [u32; 2], value: T, older: &[usize]) -> Res {
    let [size, version] = header;
    if version == ORBITE_RECORD_VERSION && older.contains(&(size as usize)) {
        // SAFETY: `size` bytes writable (# Safety), fewer than `T` has.
        unsafe {
            std::ptr::copy_nonoverlapping((&value as *const T).cast::<u8>(), p.cast::<u8>(), size as usize);
            std::ptr::write(p.cast::<u32>(), size);
        }
        return Ok(());
    }
    check_header::<T>(size, version)?;
    // SAFETY: checked: non-null, aligned, and the whole record writable.
    unsafe { put(p, value) };
    Ok(())
}

/// Writes `code` to an optional output (`p` may be null).
///
/// # Safety
/// `p` is null or valid for writing a `u32`.
unsafe fn put_code(p: *mut u32, what: &str, code: u32) -> Res {
    if !p.is_null() {
        check_pointer(p, what)?;
        // SAFETY: non-null and aligned (checked), writable by contract.
        unsafe { *p = code };
    }
    Ok(())
}

/// A caller's array of `count` elements, checked against `max` before it is
/// touched.
///
/// # Safety
/// `p` is null with `count == 0`, or points to `count` readable elements
/// that stay valid and unchanged for the call.
unsafe fn array<'a, T>(p: *const T, count: u64, max: u64, what: &str) -> Res<&'a [T]> {
    if count > max {
        return fail(OrbiteStatus::ResourceExhausted, format!("{what}: {count} elements (limit {max})"));
    }
    if count == 0 {
        return Ok(&[]);
    }
    check_pointer(p, what)?;
    let count = usize::try_from(count).map_err(|_| Failure::new(OrbiteStatus::OutOfRange, "count overflows"))?;
    if count.checked_mul(size_of::<T>()).is_none_or(|b| b > isize::MAX as usize) {
        return fail(OrbiteStatus::OutOfRange, format!("{what}: size overflows"));
    }
    // SAFETY: non-null, aligned, `count` elements readable (caller's
    // contract); the byte size fits in isize (checked).
    Ok(unsafe { std::slice::from_raw_parts(p, count) })
}

/// Copies `bytes` into a caller's buffer, or reports the size needed.
///
/// # Safety
/// `buf` is null or writable for `cap` bytes; `needed` is null or writable.
unsafe fn write_bytes(bytes: &[u8], buf: *mut u8, cap: usize, needed: *mut usize) -> Res {
    check_pointer(needed, "needed")?;
    // SAFETY: non-null and aligned (checked), writable by contract.
    unsafe { *needed = bytes.len() };
    if buf.is_null() || cap < bytes.len() {
        return fail(OrbiteStatus::BufferTooSmall, format!("{} bytes needed, {cap} given", bytes.len()));
    }
    // SAFETY: `buf` is writable for `cap >= bytes.len()` bytes and cannot
    // overlap our own vector.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
    Ok(())
}

fn engine_of(h: OrbiteEngine) -> Res<Arc<EngineObj>> {
    match handles::get(h.raw, Kind::Engine)? {
        Object::Engine(e) => Ok(e),
        _ => unreachable!("kind checked"),
    }
}

fn peer_of(h: OrbitePeer) -> Res<Arc<PeerObj>> {
    match handles::get(h.raw, Kind::Peer)? {
        Object::Peer(p) => Ok(p),
        _ => unreachable!("kind checked"),
    }
}

fn xfer_of(h: OrbiteXfer) -> Res<Arc<XferObj>> {
    match handles::get(h.raw, Kind::Transfer)? {
        Object::Transfer(x) => Ok(x),
        _ => unreachable!("kind checked"),
    }
}

fn reg_of(h: OrbiteRegistration) -> Res<Arc<RegObj>> {
    match handles::get(h.raw, Kind::Registration)? {
        Object::Registration(r) => Ok(r),
        _ => unreachable!("kind checked"),
    }
}

fn permission(p: u32) -> Res<Permission> {
    Ok(match p {
        ORBITE_PERM_LOCAL_ONLY => Permission::LocalOnly,
        ORBITE_PERM_REMOTE_READ => Permission::RemoteRead,
        ORBITE_PERM_REMOTE_READ_WRITE => Permission::RemoteReadWrite,
        _ => return fail(OrbiteStatus::InvalidArgument, format!("unknown permission {p}")),
    })
}

fn permission_code(p: Permission) -> u32 {
    match p {
        Permission::LocalOnly => ORBITE_PERM_LOCAL_ONLY,
        Permission::RemoteRead => ORBITE_PERM_REMOTE_READ,
        Permission::RemoteReadWrite => ORBITE_PERM_REMOTE_READ_WRITE,
    }
}

/// The record of `Stats`: every counter, by name, in the order of
/// `Stats::FIELDS` (checked by the test below and by
/// `tests/layout.rs`).
fn stats_record(s: Stats) -> OrbiteStats {
    OrbiteStats {
        size: size_of::<OrbiteStats>() as u32,
        version: ORBITE_RECORD_VERSION,
        registrations: s.registrations,
        registered_bytes: s.registered_bytes,
        fenced_registrations: s.fenced_registrations,
        host_allocations: s.host_allocations,
        host_memory_bytes: s.host_memory_bytes,
        prepared_transfers: s.prepared_transfers,
        executions: s.executions,
        queued_executions: s.queued_executions,
        bytes_in_flight: s.bytes_in_flight,
        tasks_in_flight: s.tasks_in_flight,
        unquiesced_owners: s.unquiesced_owners,
        notification_bytes: s.notification_bytes,
        binding_handles: s.binding_handles,
        pinned_ranges: s.pinned_ranges,
        auth_failures: s.auth_failures,
        device_allocations: s.device_allocations,
        device_memory_bytes: s.device_memory_bytes,
        staging_buffers: s.staging_buffers,
        staging_bytes: s.staging_bytes,
        cuda_imports: s.cuda_imports,
        connections: s.connections,
        connections_refused: s.connections_refused,
        frame_buffer_bytes: s.frame_buffer_bytes,
        borrows: s.borrows,
        borrow_bytes: s.borrow_bytes,
        watchers: s.watchers,
    }
}

/// Sends the engine's log records to `sink` (ABI 1.6), each with its level
/// (`ORBITE_LOG_ERROR` 1 to `ORBITE_LOG_TRACE` 5), its target (the layer:
/// `orbite::engine`, `orbite::peer`, `orbite::server`, `orbite::auth`,
/// `orbite::rdma`) and its message, both NUL-terminated and valid for the
/// call only; records above `max_level` are not made (`ORBITE_LOG_OFF`:
/// none). The sink is called from any thread, also while the caller is in
/// another call of this library; it must not call back into it. A null
/// `sink` sends records to stderr again, as before any install (under
/// `ORBITE_LOG`, warnings and worse by default). Callable before anything
/// else, with no engine; the last install wins, for the whole process.
///
/// # Safety
/// `sink` is null or a function of this signature that stays callable
/// with `ctx` until it is replaced.
///
/// Checked: `max_level` above `ORBITE_LOG_TRACE`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_log_install(
    sink: OrbiteLogSink,
    ctx: *mut std::ffi::c_void,
    max_level: u32,
) -> OrbiteStatus {
    entry("orbite_log_install", || {
        if max_level > ORBITE_LOG_TRACE {
            return fail(OrbiteStatus::InvalidArgument, format!("log level {max_level} is above ORBITE_LOG_TRACE"));
        }
        crate::logging::install(sink, ctx, max_level);
        Ok(())
    })
}

/// Describes this library: ABI version, feature bits and the size of
/// every record. Callable before anything else, with no engine.
///
/// # Safety
/// `out` is null or points to an `OrbiteAbiInfo` whose `size` and `version`
/// the caller set, readable for those two fields and, when they match this
/// library's, writable for the whole record.
///
/// Checked: a null or misaligned `out`, its size and version.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_abi_info(out: *mut OrbiteAbiInfo) -> OrbiteStatus {
    entry("orbite_abi_info", || {
        // SAFETY: caller's contract: `out` is a writable OrbiteAbiInfo.
        unsafe { output_check(out)? };
        let s = |n: usize| n as u32;
        let info = OrbiteAbiInfo {
            size: s(size_of::<OrbiteAbiInfo>()),
            version: ORBITE_RECORD_VERSION,
            abi_major: ORBITE_ABI_MAJOR,
            abi_minor: ORBITE_ABI_MINOR,
            features: features(),
            engine_options_size: s(size_of::<OrbiteEngineOptions>()),
            mem_region_size: s(size_of::<OrbiteMemRegion>()),
            desc_size: s(size_of::<OrbiteDesc>()),
            xfer_spec_size: s(size_of::<OrbiteXferSpec>()),
            xfer_state_size: s(size_of::<OrbiteXferState>()),
            remote_range_size: s(size_of::<OrbiteRemoteRange>()),
            close_report_size: s(size_of::<OrbiteCloseReport>()),
            stats_size: s(size_of::<OrbiteStats>()),
            drain_result_size: s(size_of::<OrbiteDrainResult>()),
            notif_view_size: s(size_of::<OrbiteNotifView>()),
        };
        // SAFETY: checked above.
        unsafe { put(out, info) };
        Ok(())
    })
}

/// Copies this thread's last failure message (NUL-terminated) into `buf`.
/// `*needed` receives the size with the NUL; if `cap` is smaller, nothing
/// is copied and `ORBITE_STATUS_BUFFER_TOO_SMALL` is returned. An empty
/// message means the last call on this thread succeeded.
///
/// # Safety
/// `buf` is null or valid for writing `cap` bytes; `needed` is null or valid
/// for writing a `size_t`.
///
/// Checked: a null or misaligned `needed` (refused); a null `buf` counts as
/// no room.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_last_error(buf: *mut c_char, cap: usize, needed: *mut usize) -> OrbiteStatus {
    let r = catch_unwind(AssertUnwindSafe(|| {
        with_last_error(|m| {
            let mut bytes = m.as_bytes().to_vec();
            bytes.push(0);
            // SAFETY: caller's contract: `buf` writable for `cap` bytes,
            // `needed` writable.
            unsafe { write_bytes(&bytes, buf.cast(), cap, needed) }
        })
    }));
    match r {
        Ok(Ok(())) => OrbiteStatus::Ok,
        Ok(Err(f)) => f.status,
        Err(_) => OrbiteStatus::Internal,
    }
}

/// Creates an engine from an explicit JSON configuration. Refused, before
/// anything is created, when `abi_major` differs from this library's, when
/// a required feature is missing, or when the configuration is invalid.
///
/// # Safety
/// `options` is null or points to an `OrbiteEngineOptions` whose `size` and
/// `version` the caller set, readable for those two fields and, when they
/// match this library's, for the whole record; its `config_json` is null or
/// valid for reading `config_json_len` bytes. `out` is null or valid for
/// writing one `OrbiteEngine`. No other thread writes this memory during the
/// call.
///
/// Checked: null and misaligned pointers, a null `config_json` with a nonzero
/// length, the record's size and version, and `config_json_len` against its
/// limit before the bytes are read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_engine_create(
    options: *const OrbiteEngineOptions,
    out: *mut OrbiteEngine,
) -> OrbiteStatus {
    entry("orbite_engine_create", || {
        // SAFETY: caller's contract: a readable OrbiteEngineOptions.
        let o = unsafe { input(options)? };
        check_pointer(out, "out")?;
        if o.abi_major != ORBITE_ABI_MAJOR {
            return fail(
                OrbiteStatus::VersionMismatch,
                format!("caller built for ABI {}, library is ABI {ORBITE_ABI_MAJOR}", o.abi_major),
            );
        }
        if o.flags & !ORBITE_ENGINE_DEPLOYMENT != 0 {
            return fail(OrbiteStatus::InvalidArgument, format!("unknown engine flags {:#x}", o.flags));
        }
        let missing = o.required_features & !features();
        if missing != 0 {
            return fail(OrbiteStatus::NotSupported, format!("features {missing:#x} are not in this build"));
        }
        // SAFETY: caller's contract: `config_json_len` readable bytes.
        let json = unsafe { array(o.config_json, o.config_json_len, MAX_CONFIG_BYTES as u64, "config_json")? };
        let json = std::str::from_utf8(json)
            .map_err(|_| Failure::new(OrbiteStatus::InvalidArgument, "config_json is not UTF-8"))?;
        let mut config = orbite_core::EngineConfig::from_json(if json.is_empty() { "{}" } else { json })
            .map_err(orbite_core::Error::from)?;
        if o.flags & ORBITE_ENGINE_DEPLOYMENT != 0 && config.listen.is_none() {
            config.listen = Some(orbite_core::endpoint::ALL_INTERFACES.into());
        }
        crate::logging::ensure();
        let engine = TransferEngine::new(config)?;
        let obj = Arc::new(EngineObj { engine, children: AtomicU64::new(0), shared: Mutex::new(Vec::new()) });
        let raw = handles::insert(Object::Engine(obj))?;
        // SAFETY: non-null and aligned (checked), writable by contract.
        unsafe { *out = OrbiteEngine { raw } };
        Ok(())
    })
}

/// Writes the configuration document a deployment uses when it is given
/// none: the JSON object in `ORBITE_CONFIG`, or the file it names
/// (`@/path/to/file.json`), checked to be a valid configuration; `{}` when
/// the variable is unset or blank. `*origin` (may be null) receives an
/// `ORBITE_CONFIG_*` value. An unreadable or invalid document fails with
/// `ORBITE_STATUS_INVALID_ARGUMENT` and a message that names the variable.
///
/// # Safety
/// `origin` is null or valid for writing a `uint32_t`; `buf` is null or valid
/// for writing `cap` bytes; `needed` is null or valid for writing a `size_t`;
/// none of them overlap.
///
/// Checked: a null or misaligned `needed` (refused); a null `buf` counts as
/// no room; a null `origin` is skipped and a misaligned one refused.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_config_document(
    origin: *mut u32,
    buf: *mut u8,
    cap: usize,
    needed: *mut usize,
) -> OrbiteStatus {
    entry("orbite_config_document", || {
        use orbite_core::config::{ConfigDocument, ConfigOrigin};
        // Every output is checked before any is written.
        if !origin.is_null() {
            check_pointer(origin, "origin")?;
        }
        let doc = ConfigDocument::resolve(None).map_err(orbite_core::Error::from)?;
        // SAFETY: caller's contract: `buf` writable for `cap`, `needed` writable.
        unsafe { write_bytes(doc.json.as_bytes(), buf, cap, needed)? };
        let code = match doc.origin {
            ConfigOrigin::Environment => ORBITE_CONFIG_ENVIRONMENT,
            ConfigOrigin::EnvironmentFile(_) => ORBITE_CONFIG_ENVIRONMENT_FILE,
            ConfigOrigin::Defaults | ConfigOrigin::Explicit => ORBITE_CONFIG_DEFAULTS,
        };
        // SAFETY: caller's contract: `origin` is null or writable.
        unsafe { put_code(origin, "origin", code) }
    })
}

/// Writes one line for operators: where the engine listens, what it
/// advertises and how that was found (UTF-8, not NUL-terminated).
/// `*source` (may be null) receives an `ORBITE_ADVERTISE_*` value;
/// `ORBITE_ADVERTISE_LOOPBACK_FALLBACK` means only this host can connect,
/// which the line says.
///
/// # Safety
/// `source` is null or valid for writing a `uint32_t`; `buf` is null or valid
/// for writing `cap` bytes; `needed` is null or valid for writing a `size_t`;
/// none of them overlap.
///
/// Checked: a null or misaligned `needed` (refused); a null `buf` counts as
/// no room; a null `source` is skipped and a misaligned one refused; the
/// handle may be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_engine_advertise(
    engine: OrbiteEngine,
    source: *mut u32,
    buf: *mut u8,
    cap: usize,
    needed: *mut usize,
) -> OrbiteStatus {
    entry("orbite_engine_advertise", || {
        use orbite_core::endpoint::AdvertiseSource;
        // Every output is checked before any is written.
        if !source.is_null() {
            check_pointer(source, "source")?;
        }
        let e = engine_of(engine)?;
        let (code, line) = match (e.engine.advertised(), e.engine.listen_addr()) {
            (Some(a), Some(bound)) => {
                let code = match a.source {
                    AdvertiseSource::Configured => ORBITE_ADVERTISE_CONFIGURED,
                    AdvertiseSource::Bound => ORBITE_ADVERTISE_BOUND,
                    AdvertiseSource::DefaultRoute { .. } => ORBITE_ADVERTISE_DEFAULT_ROUTE,
                    AdvertiseSource::FirstUp { .. } => ORBITE_ADVERTISE_FIRST_UP,
                    AdvertiseSource::LoopbackFallback => ORBITE_ADVERTISE_LOOPBACK_FALLBACK,
                };
                let line = match a.warning() {
                    Some(w) => format!("listening on {bound}; {w}"),
                    None => format!("listening on {bound}, advertising {} ({})", a.endpoint, a.source),
                };
                (code, line)
            }
            _ => (ORBITE_ADVERTISE_NONE, "not listening: local transfers only".to_owned()),
        };
        // SAFETY: caller's contract: `buf` writable for `cap`, `needed` writable.
        unsafe { write_bytes(line.as_bytes(), buf, cap, needed)? };
        // SAFETY: caller's contract: `source` is null or writable.
        unsafe { put_code(source, "source", code) }
    })
}

/// Closes an engine: fences new work, waits up to `timeout_ms` for admitted
/// work to retire, and reports whether it drained. Executions that did not
/// retire keep their owners. The handle stays valid (for stats and
/// release). `report` may be null.
///
/// # Safety
/// `report` is null (no report) or points to an `OrbiteCloseReport` whose
/// `size` and `version` the caller set, readable for those two fields and,
/// when they match this library's, writable for the whole record.
///
/// Checked: a misaligned `report`, its size and version; the handle may be
/// any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_engine_close(
    engine: OrbiteEngine,
    timeout_ms: u64,
    report: *mut OrbiteCloseReport,
) -> OrbiteStatus {
    entry("orbite_engine_close", || {
        let e = engine_of(engine)?;
        if !report.is_null() {
            // SAFETY: caller's contract: a writable OrbiteCloseReport.
            unsafe { output_check(report)? };
        }
        let r = e.engine.close_with_timeout(Duration::from_millis(timeout_ms));
        if !report.is_null() {
            let value = OrbiteCloseReport {
                size: size_of::<OrbiteCloseReport>() as u32,
                version: ORBITE_RECORD_VERSION,
                drained: u32::from(r.drained),
                reserved: 0,
                unquiesced: r.unquiesced.len() as u64,
            };
            // SAFETY: checked above.
            unsafe { put(report, value) };
        }
        Ok(())
    })
}

/// Releases an engine handle. Refused (`ORBITE_STATUS_ACTIVE`) while any
/// registration, shared allocation, peer or transfer handle of the engine
/// is alive. The engine closes (draining within its configured bound) when
/// released.
#[unsafe(no_mangle)]
pub extern "C" fn orbite_engine_release(engine: OrbiteEngine) -> OrbiteStatus {
    entry("orbite_engine_release", || {
        let obj = handles::remove_if(engine.raw, Kind::Engine, |o| {
            let Object::Engine(e) = o else { unreachable!("kind checked") };
            match e.children.load(std::sync::atomic::Ordering::Acquire) {
                0 => Ok(()),
                n => fail(OrbiteStatus::Active, format!("{n} handles of this engine are still alive")),
            }
        })?;
        drop(obj); // no lock held: closing may wait for work to drain
        Ok(())
    })
}

/// Every charge of the engine (they return to their baseline once work
/// drained and handles were released).
///
/// # Safety
/// `out` is null or points to an `OrbiteStats` whose `size` and `version` the
/// caller set, readable for those two fields and, when they match this
/// library's, writable for the whole record.
///
/// A caller built against ABI 1.1 passes the record of that version (112
/// bytes, without `pinned_ranges` and `auth_failures`), one built against
/// 1.2 the record of 1.2 (128 bytes, without the CUDA counters), one built
/// against 1.3 the record of 1.3 (168 bytes, without the listener's
/// counters): each gets its prefix.
///
/// Checked: a null or misaligned `out`, its size and version; the handle may
/// be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_engine_stats(engine: OrbiteEngine, out: *mut OrbiteStats) -> OrbiteStatus {
    entry("orbite_engine_stats", || {
        let e = engine_of(engine)?;
        check_pointer(out, OrbiteStats::NAME)?;
        // SAFETY: caller's contract: `out` is readable for its header.
        let [size, version] = unsafe { std::ptr::read(out.cast::<[u32; 2]>()) };
        let older = [STATS_1_1_SIZE, STATS_1_2_SIZE, STATS_1_3_SIZE];
        // SAFETY: checked pointer; the caller's contract covers the size
        // its header declares.
        unsafe { put_versioned(out, [size, version], stats_record(e.engine.stats()), &older) }
    })
}

/// `sizeof(OrbiteStats)` in ABI 1.1 (before `pinned_ranges`).
const STATS_1_1_SIZE: usize = std::mem::offset_of!(OrbiteStats, pinned_ranges);
/// `sizeof(OrbiteStats)` in ABI 1.2 (before the CUDA counters).
const STATS_1_2_SIZE: usize = std::mem::offset_of!(OrbiteStats, device_allocations);
/// `sizeof(OrbiteStats)` in ABI 1.3 (before the listener's counters).
const STATS_1_3_SIZE: usize = std::mem::offset_of!(OrbiteStats, connections);
/// `OrbiteFileInfo` of ABI 1.4 and older: up to `ino`.
const FILE_INFO_1_4_SIZE: usize = std::mem::offset_of!(OrbiteFileInfo, st_mode);

/// Writes the engine's peer information (endpoint and epoch) for another
/// process's `orbite_peer_open`, or for this engine's own self peer.
///
/// # Safety
/// `buf` is null or valid for writing `cap` bytes; `needed` is null or valid
/// for writing a `size_t`; they do not overlap.
///
/// Checked: a null or misaligned `needed` (refused); a null `buf` counts as
/// no room; the handle may be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_engine_export_peer(
    engine: OrbiteEngine,
    buf: *mut u8,
    cap: usize,
    needed: *mut usize,
) -> OrbiteStatus {
    entry("orbite_engine_export_peer", || {
        let e = engine_of(engine)?;
        let info = PeerInfo { epoch: e.engine.source_epoch(), endpoint: e.engine.endpoint().unwrap_or_default() };
        // SAFETY: caller's contract: `buf` writable for `cap`, `needed` writable.
        unsafe { write_bytes(&info.encode(), buf, cap, needed) }
    })
}

/// Allocates `len` bytes of memory peers on this host can map (a sealed
/// memfd, handed to proven same-host peers over the local socket). Ranges of it registered with `orbite_mem_register` may take
/// the shm route. The memory lives until the handle is released and every
/// registration inside it is gone.
///
/// # Safety
/// `out` is null or valid for writing one `OrbiteShm`; `out_addr` is null or
/// valid for writing one `void *`; they do not overlap.
///
/// Checked: null and misaligned pointers, `len`; the handle may be any value:
/// it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_shm_alloc(
    engine: OrbiteEngine,
    len: u64,
    out: *mut OrbiteShm,
    out_addr: *mut *mut c_void,
) -> OrbiteStatus {
    entry("orbite_shm_alloc", || {
        let e = engine_of(engine)?;
        check_pointer(out, "out")?;
        check_pointer(out_addr, "out_addr")?;
        let len = usize::try_from(len).map_err(|_| Failure::new(OrbiteStatus::OutOfRange, "len overflows"))?;
        let child = Child::new(&e)?;
        let memory = e.engine.allocate_shm_memory(len)?;
        let addr = memory.as_ptr();
        let raw = handles::insert(Object::SharedMemory(Arc::new(ShmObj { child, memory: memory.clone() })))?;
        e.shared.lock().push(memory);
        // SAFETY: both non-null and aligned (checked), writable by contract.
        unsafe {
            *out = OrbiteShm { raw };
            *out_addr = addr.cast();
        }
        Ok(())
    })
}

/// Releases a shared allocation handle. Registrations inside it keep the
/// memory alive until they are gone.
#[unsafe(no_mangle)]
pub extern "C" fn orbite_shm_release(shm: OrbiteShm) -> OrbiteStatus {
    entry("orbite_shm_release", || {
        let Object::SharedMemory(s) = handles::remove(shm.raw, Kind::SharedMemory)? else { unreachable!() };
        s.child.engine.shared.lock().retain(|m| m.as_ptr() != s.memory.as_ptr());
        Ok(())
    })
}

/// Registers a range of memory. A range inside a live `orbite_shm_alloc`
/// allocation of the same engine becomes a shared range; any other range is
/// borrowed from the caller, never copied, and must stay valid until its
/// `release` callback runs (or, without one, until it is deregistered and
/// every transfer naming it is released).
///
/// # Safety
/// `region` is null or points to an `OrbiteMemRegion` whose `size` and
/// `version` the caller set, readable for those two fields and, when they
/// match this library's, for the whole record, which no other thread writes
/// during the call. `out` is null or valid for writing one
/// `OrbiteRegistration`.
///
/// Unless the range lies inside a live `orbite_shm_alloc` allocation of this
/// engine (which the engine owns), the `len` bytes at `addr` stay valid for
/// reads and writes, from any thread, until the engine gives them up: until
/// `release` runs, or, with no `release`, until the registration is
/// deregistered and every transfer naming it retired and was released. While
/// an execution that names bytes of the range has not retired, the caller
/// neither writes those bytes nor reads those the execution writes.
///
/// `release`, if not null, is a function of that signature that may be called
/// once, with `release_context`, on any thread.
///
/// `ORBITE_MEM_VRAM` names CUDA device memory of device `device` (the CUDA
/// ordinal): a library built with feature `cuda`, on a machine whose driver
/// reports that device, checks with the driver that the range is device
/// memory of that device inside one allocation, and holds the device's
/// primary context as long as the range may be used. Otherwise it answers
/// `ORBITE_STATUS_NOT_SUPPORTED`, the message naming what is missing. The
/// caller finishes producing the bytes (synchronises its streams) before
/// posting; the engine never synchronises a caller's stream.
///
/// Checked: null and misaligned pointers, the record's size and version, the
/// memory kind, permission and reserved fields, a null, empty or overflowing
/// range, a `release` on a range of a shared allocation, a device range the
/// driver does not vouch for; the handle may be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_mem_register(
    engine: OrbiteEngine,
    region: *const OrbiteMemRegion,
    out: *mut OrbiteRegistration,
) -> OrbiteStatus {
    entry("orbite_mem_register", || {
        let e = engine_of(engine)?;
        // SAFETY: caller's contract: a readable OrbiteMemRegion.
        let r = unsafe { input(region)? };
        check_pointer(out, "out")?;
        match r.kind {
            ORBITE_MEM_DRAM | ORBITE_MEM_VRAM => {}
            k => return fail(OrbiteStatus::InvalidArgument, format!("unknown memory kind {k}")),
        }
        if r.reserved != 0 || (r.kind == ORBITE_MEM_DRAM && r.device != 0) {
            return fail(OrbiteStatus::InvalidArgument, "reserved must be 0, and device 0 for DRAM");
        }
        let perm = permission(r.permission)?;
        if r.kind == ORBITE_MEM_VRAM {
            // SAFETY: the caller vouches (documented contract of this entry
            // point) that the device range and its context stay valid until
            // the engine gives them up; the core checks with the driver
            // that it is device memory of that device, inside one
            // allocation, before anything else happens.
            let range = unsafe { MemoryRange::cuda_borrowed(r.device, r.addr, r.len, perm) }
                .map_err(orbite_core::Error::from)?;
            let range = with_release(range, r);
            let child = Child::new(&e)?;
            let id = e.engine.register_memory_ranges(vec![range])?[0];
            return register_handle(child, id, out);
        }
        let end = r.addr.checked_add(r.len);
        if r.addr == 0 || r.len == 0 || end.is_none_or(|end| end > isize::MAX as u64) {
            return fail(
                OrbiteStatus::OutOfRange,
                format!("range {:#x}+{} is empty, null or overflows", r.addr, r.len),
            );
        }
        let shared = e.shared.lock().iter().find_map(|m| {
            let base = m.as_ptr() as u64;
            (r.addr >= base && r.addr + r.len <= base + m.len() as u64).then(|| (m.clone(), (r.addr - base) as usize))
        });
        let range = match shared {
            Some(_) if r.release.is_some() => {
                return fail(
                    OrbiteStatus::InvalidArgument,
                    "a range of a shared allocation is owned by the engine: release must be null",
                );
            }
            Some((memory, offset)) => {
                MemoryRange::host(&memory, offset, r.len as usize, perm).map_err(orbite_core::Error::from)?
            }
            None => {
                // SAFETY: the caller vouches (documented contract of this
                // entry point) that the range stays valid until the engine
                // gives it up, which `release` reports.
                let range = unsafe { MemoryRange::borrowed(r.addr as *mut u8, r.len as usize, perm) };
                with_release(range, r)
            }
        };
        let child = Child::new(&e)?;
        let id = e.engine.register_memory_ranges(vec![range])?[0];
        register_handle(child, id, out)
    })
}

/// A caller's range with the caller's `release` callback, if any, as its
/// owner release.
fn with_release(range: MemoryRange, r: &OrbiteMemRegion) -> MemoryRange {
    let Some(callback) = r.release else { return range };
    let context = SendPtr(r.release_context);
    range.with_owner_release(Box::new(move || {
        let context = context;
        // SAFETY: the caller's callback with the caller's context, called
        // exactly once by the core's owner release, with no lock of this
        // library held (none is held around engine calls) and none of the
        // core's.
        unsafe { callback(context.0) }
    }))
}

/// Hands out the handle of a new registration (deregistering it again if
/// no handle can be had). `out` was checked non-null and aligned.
fn register_handle(child: Child, id: orbite_core::RegistrationId, out: *mut OrbiteRegistration) -> Result<(), Failure> {
    let engine = child.engine.engine.clone();
    match handles::insert(Object::Registration(Arc::new(RegObj { child, id }))) {
        Ok(raw) => {
            // SAFETY: non-null and aligned (checked by the caller), writable.
            unsafe { *out = OrbiteRegistration { raw } };
            Ok(())
        }
        Err(f) => {
            let _ = engine.deregister(id);
            Err(f)
        }
    }
}

/// A caller's context pointer, moved to whichever thread releases the
/// range last.
struct SendPtr(*mut c_void);
// SAFETY: the pointer is only handed back to the caller's callback; the C
// contract says the callback may run on any thread.
unsafe impl Send for SendPtr {}

/// Deregisters: new transfers and posts naming it are refused at once; the
/// engine gives the range up after the last transfer using it retired. The
/// handle is released.
#[unsafe(no_mangle)]
pub extern "C" fn orbite_mem_deregister(registration: OrbiteRegistration) -> OrbiteStatus {
    entry("orbite_mem_deregister", || {
        let r = reg_of(registration)?;
        match r.child.engine.engine.deregister(r.id) {
            Ok(()) => {}
            // Only this library deregisters what it registered: a
            // registration the core no longer has went with the engine's
            // close. The handle names nothing any more and goes too (kept,
            // it would keep the engine handle from being released).
            Err(orbite_core::Error::Registry(_)) => {}
            Err(e) => return Err(e.into()),
        }
        let _ = handles::remove(registration.raw, Kind::Registration);
        Ok(())
    })
}

/// Writes a registration's range metadata for a peer's
/// `orbite_peer_import_range` (or this engine's own self peer).
///
/// # Safety
/// `buf` is null or valid for writing `cap` bytes; `needed` is null or valid
/// for writing a `size_t`; they do not overlap.
///
/// Checked: a null or misaligned `needed` (refused); a null `buf` counts as
/// no room; the handle may be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_mem_export(
    registration: OrbiteRegistration,
    buf: *mut u8,
    cap: usize,
    needed: *mut usize,
) -> OrbiteStatus {
    entry("orbite_mem_export", || {
        let r = reg_of(registration)?;
        let engine = &r.child.engine.engine;
        let Some(x) = engine.exported_registration(r.id) else {
            return fail(OrbiteStatus::NotFound, "registration is deregistered");
        };
        let info = RangeInfo {
            epoch: engine.source_epoch(),
            addr: x.addr,
            len: x.len,
            permission: permission_code(x.permission),
            shared: x.shm.is_some(),
        };
        // SAFETY: caller's contract: `buf` writable for `cap`, `needed` writable.
        unsafe { write_bytes(&info.encode(), buf, cap, needed) }
    })
}

fn remote_range(x: &orbite_core::segment::ExportedRegistration) -> OrbiteRemoteRange {
    OrbiteRemoteRange {
        size: size_of::<OrbiteRemoteRange>() as u32,
        version: ORBITE_RECORD_VERSION,
        remote_registration: x.id.to_raw(),
        addr: x.addr,
        len: x.len,
        permission: permission_code(x.permission),
        shared: u32::from(x.shm.is_some()),
    }
}

/// Writes the values a transfer on this engine's own self peer puts in
/// remote descriptors for `registration` (what `orbite_peer_import_range`
/// gives for its range metadata, without parsing it).
///
/// # Safety
/// `out` is null or points to an `OrbiteRemoteRange` whose `size` and
/// `version` the caller set, readable for those two fields and, when they
/// match this library's, writable for the whole record.
///
/// Checked: a null or misaligned `out`, its size and version; the handle may
/// be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_mem_remote_range(
    registration: OrbiteRegistration,
    out: *mut OrbiteRemoteRange,
) -> OrbiteStatus {
    entry("orbite_mem_remote_range", || {
        let r = reg_of(registration)?;
        // SAFETY: caller's contract: a writable OrbiteRemoteRange.
        unsafe { output_check(out)? };
        let Some(x) = r.child.engine.engine.exported_registration(r.id) else {
            return fail(OrbiteStatus::NotFound, "registration is deregistered or local only");
        };
        // SAFETY: checked above.
        unsafe { put(out, remote_range(&x)) };
        Ok(())
    })
}

/// Opens a peer from its exported information. Information naming this
/// engine itself opens the self connection (local transfers); any other
/// peer is connected over TCP within `timeout_ms` and must still be the
/// same incarnation (epoch).
///
/// # Safety
/// `info` is null or valid for reading `len` bytes, which no other thread
/// writes during the call; `out` is null or valid for writing one
/// `OrbitePeer`.
///
/// Checked: null and misaligned pointers, a null `info` with a nonzero `len`,
/// `len` against its limit before the bytes are read, and the bytes
/// themselves; the handle may be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_peer_open(
    engine: OrbiteEngine,
    info: *const u8,
    len: usize,
    timeout_ms: u64,
    out: *mut OrbitePeer,
) -> OrbiteStatus {
    entry("orbite_peer_open", || {
        let e = engine_of(engine)?;
        check_pointer(out, "out")?;
        // SAFETY: caller's contract: `len` readable bytes.
        let bytes = unsafe { array(info, len as u64, MAX_METADATA_BYTES as u64, "info")? };
        let info = PeerInfo::decode(bytes)?;
        let child = Child::new(&e)?;
        let segment = if info.epoch == e.engine.source_epoch() {
            None
        } else if info.endpoint.is_empty() {
            return fail(OrbiteStatus::NotSupported, "the peer has no listener");
        } else {
            Some(e.engine.open_segment(&info.endpoint, Some(info.epoch), Duration::from_millis(timeout_ms))?)
        };
        let raw = handles::insert(Object::Peer(Arc::new(PeerObj { child, segment })))?;
        // SAFETY: non-null and aligned (checked), writable.
        unsafe { *out = OrbitePeer { raw } };
        Ok(())
    })
}

/// Has the peer confirm a range's metadata (same incarnation; a
/// registration of exactly that range, permission and kind in this
/// engine's view of the peer, which follows the peer's pushed changes and
/// asks the peer once when it lacks the range) and returns the values to
/// put in remote descriptors.
///
/// # Safety
/// `metadata` is null or valid for reading `len` bytes, which no other thread
/// writes during the call; `out` is null or points to an `OrbiteRemoteRange`
/// whose `size` and `version` the caller set, readable for those two fields
/// and, when they match this library's, writable for the whole record; they
/// do not overlap.
///
/// Checked: null and misaligned pointers, a null `metadata` with a nonzero
/// `len`, `len` against its limit before the bytes are read, the bytes
/// themselves, and `out`'s size and version; the handle may be any value: it
/// is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_peer_import_range(
    peer: OrbitePeer,
    metadata: *const u8,
    len: usize,
    out: *mut OrbiteRemoteRange,
) -> OrbiteStatus {
    entry("orbite_peer_import_range", || {
        let p = peer_of(peer)?;
        // SAFETY: caller's contract: a writable OrbiteRemoteRange.
        unsafe { output_check(out)? };
        // SAFETY: caller's contract: `len` readable bytes.
        let bytes = unsafe { array(metadata, len as u64, MAX_METADATA_BYTES as u64, "metadata")? };
        let info = RangeInfo::decode(bytes)?;
        let engine = &p.child.engine.engine;
        let epoch = p.segment.as_ref().map_or(engine.source_epoch(), |s| s.epoch());
        if info.epoch != epoch {
            return fail(OrbiteStatus::EpochMismatch, format!("range of epoch {:#x}, peer has {epoch:#x}", info.epoch));
        }
        let same = |x: &orbite_core::segment::ExportedRegistration| {
            (x.addr, x.len, permission_code(x.permission), x.shm.is_some())
                == (info.addr, info.len, info.permission, info.shared)
        };
        let x = match &p.segment {
            // The peer confirms the range: from its view, refreshed when it
            // announced changes, and asked once more if the view lacks it.
            Some(s) => engine.find_remote_registration(s, info.addr, info.len, same)?,
            None => engine.segment_descriptor().registrations.into_iter().find(same).ok_or_else(|| {
                Failure::new(
                    OrbiteStatus::NotFound,
                    format!("no registration of {} bytes at {:#x}", info.len, info.addr),
                )
            })?,
        };
        // SAFETY: checked above.
        unsafe { put(out, remote_range(&x)) };
        Ok(())
    })
}

/// Says whether new work may start on a peer: `ORBITE_STATUS_OK`, or
/// `ORBITE_STATUS_REMOTE_DISCONNECT` (lost: connections broke, the peer
/// stopped answering; or closed), or `ORBITE_STATUS_EPOCH_MISMATCH` (a newer
/// incarnation was opened on its endpoint), with the reason for
/// `orbite_last_error`. A lost peer is not reconnected: open it again.
#[unsafe(no_mangle)]
pub extern "C" fn orbite_peer_check(peer: OrbitePeer) -> OrbiteStatus {
    entry("orbite_peer_check", || {
        let p = peer_of(peer)?;
        match &p.segment {
            Some(s) => Ok(s.usable().map_err(orbite_core::Error::from)?),
            None => Ok(()),
        }
    })
}

/// Retires a peer: fences new posts to it, waits up to `timeout_ms` for
/// admitted work to retire, closes its connections. The handle is released
/// even when closing fails (the status says so); transfers prepared for it
/// stay pollable and keep what they use.
#[unsafe(no_mangle)]
pub extern "C" fn orbite_peer_close(peer: OrbitePeer, timeout_ms: u64) -> OrbiteStatus {
    entry("orbite_peer_close", || {
        let Object::Peer(p) = handles::remove(peer.raw, Kind::Peer)? else { unreachable!() };
        if let Some(s) = &p.segment {
            p.child.engine.engine.close_segment(s, Duration::from_millis(timeout_ms))?;
        }
        Ok(())
    })
}

/// Prepares a transfer: validates both lists (bounds, permissions, equal
/// totals, limits) with no I/O. Counts beyond the engine's descriptor limit
/// are refused before the arrays are read.
///
/// # Safety
/// `spec` is null or points to an `OrbiteXferSpec` whose `size` and `version`
/// the caller set, readable for those two fields and, when they match this
/// library's, for the whole record. In it, `local` is null or valid for
/// reading `local_count` `OrbiteDesc`s and `remote` for reading
/// `remote_count`; with `ORBITE_XFER_NOTIFY` in `flags`, `notification` is
/// null or valid for reading `notification_len` bytes. No other thread writes
/// any of this during the call. `out` is null or valid for writing one
/// `OrbiteXfer`.
///
/// Checked: null and misaligned pointers, a null array with a nonzero count,
/// the record's size and version, every count against the engine's limits
/// before its array is read, every field and descriptor; the handles (the
/// engine, `spec->peer`, the registrations the descriptors name) may be any
/// value: they are checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_xfer_prepare(
    engine: OrbiteEngine,
    spec: *const OrbiteXferSpec,
    out: *mut OrbiteXfer,
) -> OrbiteStatus {
    entry("orbite_xfer_prepare", || {
        // SAFETY: this function's contract (# Safety) is `prepare`'s.
        unsafe { prepare(engine, spec, None, out) }
    })
}

/// Prepares a transfer between registered memory and a local file: the
/// remote list holds file extents (`offset`, `len`; `registration` is
/// ignored), `spec->peer` must be zero and notifications are refused. READ
/// moves file bytes into memory, WRITE the reverse. A READ that meets the
/// end of the file ends `SHORT` with the exact prefix.
///
/// # Safety
/// As for `orbite_xfer_prepare`: `spec` is null or points to an
/// `OrbiteXferSpec` whose `size` and `version` the caller set, readable for
/// those two fields and, when they match this library's, for the whole
/// record. In it, `local` is null or valid for reading `local_count`
/// `OrbiteDesc`s and `remote` for reading `remote_count`; with
/// `ORBITE_XFER_NOTIFY` in `flags`, `notification` is null or valid for
/// reading `notification_len` bytes (read before the flag is refused). No
/// other thread writes any of this during the call. `out` is null or valid
/// for writing one `OrbiteXfer`.
///
/// Checked: as for `orbite_xfer_prepare`; `file` may be any value too: it is
/// checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_xfer_prepare_file(
    engine: OrbiteEngine,
    spec: *const OrbiteXferSpec,
    file: OrbiteFile,
    out: *mut OrbiteXfer,
) -> OrbiteStatus {
    entry("orbite_xfer_prepare_file", || {
        // SAFETY: this function's contract (# Safety) is `prepare`'s.
        unsafe { prepare(engine, spec, Some(file), out) }
    })
}

/// Both prepare entry points.
///
/// # Safety
/// `spec` is null or a readable `OrbiteXferSpec` as [`input`] takes it,
/// whose `local`, `remote` and (with `ORBITE_XFER_NOTIFY`) `notification`
/// are null or readable for their counts, unchanged for the call; `out` is
/// null or writable for one `OrbiteXfer`.
unsafe fn prepare(
    engine: OrbiteEngine,
    spec: *const OrbiteXferSpec,
    file: Option<OrbiteFile>,
    out: *mut OrbiteXfer,
) -> Res {
    let e = engine_of(engine)?;
    // SAFETY: caller's contract: a readable OrbiteXferSpec.
    let s = unsafe { input(spec)? };
    check_pointer(out, "out")?;
    let op = match s.op {
        ORBITE_OP_READ => Op::Read,
        ORBITE_OP_WRITE => Op::Write,
        v => return fail(OrbiteStatus::InvalidArgument, format!("unknown op {v}")),
    };
    let intent = match s.intent {
        ORBITE_INTENT_NORMAL => Intent::Normal,
        ORBITE_INTENT_DECODE_CRITICAL => Intent::DecodeCritical,
        ORBITE_INTENT_PREFETCH => Intent::Prefetch,
        v => return fail(OrbiteStatus::InvalidArgument, format!("unknown intent {v}")),
    };
    let route = match s.route {
        ORBITE_ROUTE_DEFAULT => None,
        ORBITE_ROUTE_AUTO => Some(RoutePolicy::Auto),
        ORBITE_ROUTE_TCP => Some(RoutePolicy::Tcp),
        ORBITE_ROUTE_SHM => Some(RoutePolicy::Shm),
        ORBITE_ROUTE_CMA => Some(RoutePolicy::Cma),
        ORBITE_ROUTE_CUDA_IPC => Some(RoutePolicy::CudaIpc),
        ORBITE_ROUTE_RDMA => Some(RoutePolicy::Rdma),
        v => return fail(OrbiteStatus::InvalidArgument, format!("unknown route {v}")),
    };
    if s.flags & !(ORBITE_XFER_NOTIFY | ORBITE_XFER_REMOTE_BY_ADDRESS) != 0 {
        return fail(OrbiteStatus::InvalidArgument, format!("unknown flags {:#x}", s.flags));
    }
    let (p, f) = match file {
        None => (Some(peer_of(s.peer)?), None),
        Some(_) if s.peer.raw != 0 => return fail(OrbiteStatus::InvalidArgument, "a file transfer names no peer"),
        Some(f) => (None, Some(file_of(f)?)),
    };
    let owner = p.as_ref().map(|p| &p.child.engine).or(f.as_ref().map(|f| &f.child.engine)).expect("one of them");
    if !Arc::ptr_eq(owner, &e) {
        return fail(OrbiteStatus::WrongHandle, "peer or file of another engine");
    }
    let config = e.engine.config();
    let max = config.max_descriptors_per_transfer;
    // SAFETY: caller's contract: the arrays hold their counts.
    let local = unsafe { array(s.local, s.local_count, max, "local")? };
    // SAFETY: as above.
    let remote = unsafe { array(s.remote, s.remote_count, max, "remote")? };
    let notification = if s.flags & ORBITE_XFER_NOTIFY != 0 {
        // SAFETY: caller's contract: `notification_len` readable bytes.
        Some(unsafe { array(s.notification, s.notification_len, config.max_notification_bytes, "notification")? })
    } else {
        None
    };
    let local: Vec<Desc> = handles::registrations(&e, local.iter().map(|d| d.registration), |i, id| {
        Desc::new(id, local[i].offset, local[i].len)
    })?;
    // A peer's ranges by address resolve at prepare (`ranges`); the rest
    // name their registrations.
    let by_address = s.flags & ORBITE_XFER_REMOTE_BY_ADDRESS != 0;
    let ranges: Vec<(u64, u64)> = remote.iter().map(|d| (d.offset, d.len)).collect();
    let remote: Vec<Desc> = match (by_address, &p) {
        (false, _) => {
            remote.iter().map(|d| Desc::new(RegistrationId::from_raw(d.registration), d.offset, d.len)).collect()
        }
        (true, Some(p)) => match &p.segment {
            Some(_) => Vec::new(),
            None => resolve_own(&e.engine, op, &ranges)?,
        },
        (true, None) => return fail(OrbiteStatus::InvalidArgument, "file extents are not addresses"),
    };
    let target = match (&p, &f) {
        (Some(p), _) => match &p.segment {
            Some(seg) => Target::Peer(seg),
            None => Target::Loopback,
        },
        (None, Some(f)) => Target::File(&f.entry),
        (None, None) => unreachable!("one of them"),
    };
    let deadline = (s.deadline_us != 0).then(|| Duration::from_micros(s.deadline_us));
    let spec = TransferSpec {
        op,
        local: &local,
        remote: &remote,
        target,
        options: TransferOptions { intent, deadline, route },
        notification,
    };
    let child = Child::new(&e)?;
    let transfer = match target {
        Target::Peer(_) if by_address => e.engine.prepare_by_address(&spec, &ranges)?,
        _ => e.engine.prepare(&spec)?,
    };
    let raw = handles::insert(Object::Transfer(Arc::new(XferObj { _child: child, transfer })))?;
    // SAFETY: non-null and aligned (checked), writable.
    unsafe { *out = OrbiteXfer { raw } };
    Ok(())
}

/// Remote descriptors by address on the self peer: against this engine's
/// own registrations.
fn resolve_own(engine: &TransferEngine, op: Op, ranges: &[(u64, u64)]) -> Res<Vec<Desc>> {
    let view = orbite_core::segment::SegmentView::of(&engine.segment_descriptor());
    let allowed = |r: &orbite_core::segment::ExportedRegistration| match op {
        Op::Write => r.permission.remote_write(),
        Op::Read => r.permission.remote_read(),
    };
    ranges
        .iter()
        .map(|&(addr, len)| match view.find_range(addr, len, allowed) {
            Some(r) => Ok(Desc::new(r.id, addr - r.addr, len)),
            None => fail(OrbiteStatus::NotFound, format!("no registration covers {len} bytes at {addr:#x}")),
        })
        .collect()
}

fn file_of(h: OrbiteFile) -> Res<Arc<FileObj>> {
    match handles::get(h.raw, Kind::File)? {
        Object::File(f) => Ok(f),
        _ => unreachable!("kind checked"),
    }
}

fn file_mode(mode: u32) -> Res<orbite_core::file::FileMode> {
    Ok(match mode {
        ORBITE_FILE_READ_ONLY => orbite_core::file::FileMode::ReadOnly,
        ORBITE_FILE_READ_WRITE => orbite_core::file::FileMode::ReadWrite,
        m => return fail(OrbiteStatus::InvalidArgument, format!("unknown file mode {m}")),
    })
}

/// Hands out a handle for `entry`.
///
/// # Safety
/// `out` passed [`check_pointer`] and is writable for one `OrbiteFile`.
unsafe fn insert_file(e: &Arc<EngineObj>, entry: orbite_core::file::Entry, out: *mut OrbiteFile) -> Res {
    let child = Child::new(e)?;
    let raw = handles::insert(Object::File(Arc::new(FileObj { child, entry: Arc::new(entry) })))?;
    // SAFETY: non-null and aligned (checked by the caller), writable
    // (this function's contract).
    unsafe { *out = OrbiteFile { raw } };
    Ok(())
}

/// Opens a local file by absolute path (UTF-8 or not, not NUL-terminated)
/// in `mode` (`ORBITE_FILE_READ_ONLY` or `_READ_WRITE`) with `flags`
/// (`ORBITE_FILE_DIRECT`, `_SYNC`, `_DSYNC`; unknown bits are refused). A
/// file system that refuses direct I/O fails the open with the kernel's
/// reason.
///
/// # Safety
/// `path` is null or valid for reading `path_len` bytes, which no other
/// thread writes during the call; `out` is null or valid for writing one
/// `OrbiteFile`.
///
/// Checked: null and misaligned pointers, a null `path` with a nonzero
/// `path_len`, `path_len` against its limit (4096) before the bytes are read,
/// `mode` and `flags`; the handle may be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_file_open(
    engine: OrbiteEngine,
    path: *const u8,
    path_len: usize,
    mode: u32,
    flags: u32,
    out: *mut OrbiteFile,
) -> OrbiteStatus {
    entry("orbite_file_open", || {
        let e = engine_of(engine)?;
        check_pointer(out, "out")?;
        let mode = file_mode(mode)?;
        if flags & !(ORBITE_FILE_DIRECT | ORBITE_FILE_SYNC | ORBITE_FILE_DSYNC) != 0 {
            return fail(OrbiteStatus::InvalidArgument, format!("unknown file flags {flags:#x}"));
        }
        let flags = orbite_core::file::OpenFlags {
            direct: flags & ORBITE_FILE_DIRECT != 0,
            sync: flags & ORBITE_FILE_SYNC != 0,
            dsync: flags & ORBITE_FILE_DSYNC != 0,
        };
        // SAFETY: caller's contract: `path_len` readable bytes.
        let bytes = unsafe { array(path, path_len as u64, 4096, "path")? };
        use std::os::unix::ffi::OsStrExt;
        let path = std::path::Path::new(std::ffi::OsStr::from_bytes(bytes));
        let entry = orbite_core::file::Entry::open(path, mode, flags).map_err(orbite_core::Error::from)?;
        // SAFETY: `out` was checked above and is writable (# Safety).
        unsafe { insert_file(&e, entry, out) }
    })
}

/// Adopts a caller's open descriptor by duplicating it after checking it
/// is a regular file open for `mode`; the caller keeps (and may close) its
/// own descriptor, and a later reuse of that number never reaches this
/// file. Its `O_DIRECT`, `O_SYNC` and `O_DSYNC` apply as for
/// `orbite_file_open` (`OrbiteFileInfo::flags` reports them).
///
/// # Safety
/// `out` is null or valid for writing one `OrbiteFile`. If `fd` is an open
/// descriptor, no other thread closes it during the call.
///
/// Checked: a null or misaligned `out`, `mode`, a negative or unopened `fd`,
/// what the descriptor is; the handle may be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_file_adopt(
    engine: OrbiteEngine,
    fd: i32,
    mode: u32,
    out: *mut OrbiteFile,
) -> OrbiteStatus {
    entry("orbite_file_adopt", || {
        let e = engine_of(engine)?;
        check_pointer(out, "out")?;
        let mode = file_mode(mode)?;
        if fd < 0 {
            return fail(OrbiteStatus::InvalidArgument, "negative descriptor");
        }
        // SAFETY: F_GETFD on a plain number: the kernel says whether it
        // names an open descriptor of this process.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return fail(OrbiteStatus::InvalidArgument, format!("descriptor {fd} is not open"));
        }
        // SAFETY: open (checked above), and the caller does not close it
        // during the call (# Safety); borrowed only for the checks and the
        // dup below.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let entry = orbite_core::file::Entry::adopt(borrowed, mode).map_err(orbite_core::Error::from)?;
        // SAFETY: `out` was checked above and is writable (# Safety).
        unsafe { insert_file(&e, entry, out) }
    })
}

/// What is known about a file.
///
/// # Safety
/// `out` is null or points to an `OrbiteFileInfo` whose `size` and `version`
/// the caller set, readable for those two fields and, when they match this
/// library's, writable for the whole record.
///
/// A caller built against ABI 1.4 or older passes the record of then (40
/// bytes, up to `ino`) and gets that prefix.
///
/// Checked: a null or misaligned `out`, its size and version; the handle may
/// be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_file_query(file: OrbiteFile, out: *mut OrbiteFileInfo) -> OrbiteStatus {
    entry("orbite_file_query", || {
        let f = file_of(file)?;
        check_pointer(out, OrbiteFileInfo::NAME)?;
        // SAFETY: caller's contract: `out` is readable for its header.
        let header = unsafe { std::ptr::read(out.cast::<[u32; 2]>()) };
        let (dev, ino) = f.entry.identity();
        let facts = f.entry.facts().map_err(orbite_core::Error::from)?;
        let of = f.entry.flags();
        let dio = f.entry.dio_align();
        let value = OrbiteFileInfo {
            size: size_of::<OrbiteFileInfo>() as u32,
            version: ORBITE_RECORD_VERSION,
            mode: match f.entry.mode() {
                orbite_core::file::FileMode::ReadOnly => ORBITE_FILE_READ_ONLY,
                orbite_core::file::FileMode::ReadWrite => ORBITE_FILE_READ_WRITE,
            },
            closed: u32::from(f.entry.is_closed()),
            len: facts.size,
            dev,
            ino,
            st_mode: facts.mode,
            flags: (if of.direct { ORBITE_FILE_DIRECT } else { 0 })
                | (if of.sync { ORBITE_FILE_SYNC } else { 0 })
                | (if of.dsync { ORBITE_FILE_DSYNC } else { 0 }),
            mtime_sec: facts.mtime_sec,
            mtime_nsec: facts.mtime_nsec,
            dio_mem_align: dio.map_or(0, |d| d.mem),
            dio_offset_align: dio.map_or(0, |d| d.offset),
            reserved: 0,
        };
        // SAFETY: checked pointer (above); the caller's contract covers the
        // size its header declares.
        unsafe { put_versioned(out, header, value, &[FILE_INFO_1_4_SIZE]) }
    })
}

/// Closes a file: fences new transfers at once and waits up to
/// `timeout_ms` for admitted I/O to drain. The handle is released even when
/// the wait times out (the status says so); transfers prepared on the file
/// stay pollable and fail if they reach it.
#[unsafe(no_mangle)]
pub extern "C" fn orbite_file_close(file: OrbiteFile, timeout_ms: u64) -> OrbiteStatus {
    entry("orbite_file_close", || {
        let Object::File(f) = handles::remove(file.raw, Kind::File)? else { unreachable!() };
        f.entry.close(Duration::from_millis(timeout_ms)).map_err(orbite_core::Error::from)?;
        Ok(())
    })
}

/// Posts a fresh execution. Refused while one is active, after a failed,
/// cancelled or uncertain one, when a named registration was deregistered,
/// and when a budget or the admission queue is full; a refused post admits
/// nothing. A small transfer may already be retired when this returns.
#[unsafe(no_mangle)]
pub extern "C" fn orbite_xfer_post(xfer: OrbiteXfer) -> OrbiteStatus {
    entry("orbite_xfer_post", || Ok(xfer_of(xfer)?.transfer.post()?))
}

/// Asks the active execution to stop: queued work never starts, started
/// work drains. Poll with `orbite_xfer_query` until it is retired.
#[unsafe(no_mangle)]
pub extern "C" fn orbite_xfer_cancel(xfer: OrbiteXfer) -> OrbiteStatus {
    entry("orbite_xfer_cancel", || {
        xfer_of(xfer)?.transfer.cancel()?;
        Ok(())
    })
}

/// Makes one bounded, non-blocking progress step and reports where the
/// transfer stands.
///
/// # Safety
/// `out` is null or points to an `OrbiteXferState` whose `size` and `version`
/// the caller set, readable for those two fields and, when they match this
/// library's, writable for the whole record.
///
/// Checked: a null or misaligned `out`, its size and version; the handle may
/// be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_xfer_query(xfer: OrbiteXfer, out: *mut OrbiteXferState) -> OrbiteStatus {
    entry("orbite_xfer_query", || {
        let x = xfer_of(xfer)?;
        // SAFETY: caller's contract: a writable OrbiteXferState.
        unsafe { output_check(out)? };
        let route = match x.transfer.route().route {
            Route::Loopback => ORBITE_ROUTE_LOOPBACK,
            Route::Tcp => ORBITE_ROUTE_TCP,
            Route::Shm => ORBITE_ROUTE_SHM,
            Route::Cma => ORBITE_ROUTE_CMA,
            Route::File => ORBITE_ROUTE_FILE,
            Route::CudaIpc => ORBITE_ROUTE_CUDA_IPC,
            Route::Rdma => ORBITE_ROUTE_RDMA,
        };
        let mut v = OrbiteXferState {
            size: size_of::<OrbiteXferState>() as u32,
            version: ORBITE_RECORD_VERSION,
            route,
            total_bytes: x.transfer.total_bytes(),
            ..OrbiteXferState::default()
        };
        match x.transfer.check() {
            TransferStatus::NotPosted => v.state = ORBITE_STATE_NOT_POSTED,
            TransferStatus::InProgress { phase, transferred_bytes } => {
                v.state = ORBITE_STATE_IN_PROGRESS;
                v.phase = match phase {
                    ExecutionPhase::Queued => ORBITE_PHASE_QUEUED,
                    ExecutionPhase::Running => ORBITE_PHASE_RUNNING,
                    ExecutionPhase::Draining => ORBITE_PHASE_DRAINING,
                };
                v.transferred_bytes = transferred_bytes;
            }
            TransferStatus::Retired(r) => {
                let o = r.outcome;
                v.state = ORBITE_STATE_RETIRED;
                v.drained = 1;
                v.code = match o.code {
                    OutcomeCode::Success => ORBITE_OUTCOME_SUCCESS,
                    OutcomeCode::Cancelled => ORBITE_OUTCOME_CANCELLED,
                    OutcomeCode::TimedOut => ORBITE_OUTCOME_TIMED_OUT,
                    OutcomeCode::ShortCompletion => ORBITE_OUTCOME_SHORT,
                    OutcomeCode::Failed => ORBITE_OUTCOME_FAILED,
                    OutcomeCode::NotificationFailed => ORBITE_OUTCOME_NOTIFICATION_FAILED,
                };
                v.remote_effect = match o.remote_effect {
                    RemoteEffect::None => ORBITE_EFFECT_NONE,
                    RemoteEffect::Known => ORBITE_EFFECT_KNOWN,
                    RemoteEffect::Unknown => ORBITE_EFFECT_UNKNOWN,
                };
                v.transferred_bytes = o.transferred_bytes;
                v.transferred_prefix = o.transferred_prefix;
                v.total_bytes = o.total_bytes;
                v.execution = r.receipt.execution;
                v.tasks_started = r.receipt.tasks_started;
                v.tasks_never_started = r.receipt.tasks_never_started;
            }
        }
        // SAFETY: checked above.
        unsafe { put(out, v) };
        Ok(())
    })
}

/// Releases a transfer. Refused with `ORBITE_STATUS_ACTIVE` while an
/// execution is active: the handle stays valid and pollable, and nothing is
/// cancelled.
#[unsafe(no_mangle)]
pub extern "C" fn orbite_xfer_release(xfer: OrbiteXfer) -> OrbiteStatus {
    entry("orbite_xfer_release", || {
        let obj = handles::remove_if(xfer.raw, Kind::Transfer, |o| {
            let Object::Transfer(x) = o else { unreachable!("kind checked") };
            match x.transfer.status() {
                TransferStatus::InProgress { phase, .. } => {
                    fail(OrbiteStatus::Active, format!("the transfer has an active execution ({phase:?})"))
                }
                _ => Ok(()),
            }
        })?;
        // With no lock held: dropping the last reference releases the
        // transfer's owners (an owner's release callback may run).
        drop(obj);
        Ok(())
    })
}

/// Sends a binary notification to a peer (to this engine itself for a self
/// peer) and returns once it is queued there. Nothing is ever replayed.
///
/// # Safety
/// `payload` is null or valid for reading `len` bytes, which no other thread
/// writes during the call.
///
/// Checked: a null `payload` with a nonzero `len`, and `len` against
/// `max_notification_bytes` before the bytes are read; the handle may be any
/// value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_notify(peer: OrbitePeer, payload: *const u8, len: usize) -> OrbiteStatus {
    entry("orbite_notify", || {
        let p = peer_of(peer)?;
        let engine = &p.child.engine.engine;
        let max = engine.config().max_notification_bytes;
        // SAFETY: caller's contract: `len` readable bytes.
        let payload = unsafe { array(payload, len as u64, max, "payload")? };
        match &p.segment {
            Some(s) => engine.notify(s, payload)?,
            None => engine.notify_self(payload)?,
        }
        Ok(())
    })
}

/// Moves received notifications, oldest first, into `buf` while they fit.
/// Each is written as: sender epoch (u64), sender length (u32), payload
/// length (u32), sender bytes, payload bytes, in native byte order and
/// unpadded; read them with `orbite_notif_next`. If not even the first
/// fits, nothing is taken and `ORBITE_STATUS_BUFFER_TOO_SMALL` is returned
/// with `next_needed` set.
///
/// # Safety
/// `buf` is null (no room) or valid for writing `cap` bytes; `out` is null or
/// points to an `OrbiteDrainResult` whose `size` and `version` the caller
/// set, readable for those two fields and, when they match this library's,
/// writable for the whole record; they do not overlap.
///
/// Checked: a null or misaligned `out`, its size and version; the handle may
/// be any value: it is checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_notifs_drain(
    engine: OrbiteEngine,
    buf: *mut u8,
    cap: usize,
    out: *mut OrbiteDrainResult,
) -> OrbiteStatus {
    entry("orbite_notifs_drain", || {
        let e = engine_of(engine)?;
        // SAFETY: caller's contract: a writable OrbiteDrainResult.
        unsafe { output_check(out)? };
        let cap = if buf.is_null() { 0 } else { cap };
        let (mut used, mut next_needed) = (0usize, 0u64);
        let taken = e.engine.take_notifications_while(|n| {
            let need = NOTIF_HEADER + n.sender_endpoint.len() + n.payload.len();
            if cap - used >= need {
                used += need;
                true
            } else {
                next_needed = need as u64;
                false
            }
        });
        let mut at = 0usize;
        for n in &taken {
            let (epoch, sender_len, payload_len) = (
                n.sender_epoch.to_ne_bytes(),
                (n.sender_endpoint.len() as u32).to_ne_bytes(),
                (n.payload.len() as u32).to_ne_bytes(),
            );
            for part in [&epoch[..], &sender_len, &payload_len, n.sender_endpoint.as_bytes(), &n.payload] {
                // SAFETY: `buf` is writable for `cap` bytes (contract) and
                // the parts of the taken notifications add up to `used`
                // <= `cap` (checked when they were taken).
                unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), buf.add(at), part.len()) };
                at += part.len();
            }
        }
        let value = OrbiteDrainResult {
            size: size_of::<OrbiteDrainResult>() as u32,
            version: ORBITE_RECORD_VERSION,
            count: taken.len() as u64,
            written: at as u64,
            next_needed,
        };
        // SAFETY: checked above.
        unsafe { put(out, value) };
        if taken.is_empty() && next_needed > 0 {
            return fail(OrbiteStatus::BufferTooSmall, format!("the next notification needs {next_needed} bytes"));
        }
        Ok(())
    })
}

/// Reads the notification at `*offset` of a drained buffer of `len` bytes
/// into `view` and advances `*offset`. Returns `ORBITE_STATUS_NOT_FOUND` at
/// the end of the buffer and `ORBITE_STATUS_INVALID_ARGUMENT` for bytes
/// that are not a drained notification.
///
/// # Safety
/// `buf` is null or valid for reading `len` bytes, which no other thread
/// writes during the call; `offset` is null or valid for reading and writing
/// a `uint64_t`; `view` is null or points to an `OrbiteNotifView` whose
/// `size` and `version` the caller set, readable for those two fields and,
/// when they match this library's, writable for the whole record; none of
/// them overlap. The pointers written into `view` point into `buf`: they are
/// valid as long as it is.
///
/// Checked: null and misaligned pointers, a null `buf` with a nonzero `len`,
/// `view`'s size and version, `*offset` against `len`, and the bytes
/// themselves.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_notif_next(
    buf: *const u8,
    len: usize,
    offset: *mut u64,
    view: *mut OrbiteNotifView,
) -> OrbiteStatus {
    entry("orbite_notif_next", || {
        check_pointer(offset, "offset")?;
        // SAFETY: caller's contract: a writable OrbiteNotifView.
        unsafe { output_check(view)? };
        // SAFETY: caller's contract: `len` readable bytes.
        let bytes = unsafe { array(buf, len as u64, u64::MAX, "buf")? };
        // SAFETY: non-null and aligned (checked), readable and writable.
        let at = unsafe { *offset };
        let at = usize::try_from(at).ok().filter(|a| *a <= bytes.len());
        let Some(at) = at else { return fail(OrbiteStatus::OutOfRange, "offset beyond the buffer") };
        let rest = &bytes[at..];
        if rest.is_empty() {
            return fail(OrbiteStatus::NotFound, "no more notifications");
        }
        if rest.len() < NOTIF_HEADER {
            return fail(OrbiteStatus::InvalidArgument, "truncated notification header");
        }
        let epoch = u64::from_ne_bytes(rest[0..8].try_into().expect("8 bytes"));
        let sender_len = u32::from_ne_bytes(rest[8..12].try_into().expect("4 bytes")) as usize;
        let payload_len = u32::from_ne_bytes(rest[12..16].try_into().expect("4 bytes")) as usize;
        let total = NOTIF_HEADER as u64 + sender_len as u64 + payload_len as u64;
        if total > rest.len() as u64 {
            return fail(OrbiteStatus::InvalidArgument, "truncated notification");
        }
        let sender = &rest[NOTIF_HEADER..NOTIF_HEADER + sender_len];
        let payload = &rest[NOTIF_HEADER + sender_len..total as usize];
        let v = OrbiteNotifView {
            size: size_of::<OrbiteNotifView>() as u32,
            version: ORBITE_RECORD_VERSION,
            sender_epoch: epoch,
            sender: sender.as_ptr(),
            sender_len: sender_len as u64,
            payload: payload.as_ptr(),
            payload_len: payload_len as u64,
        };
        // SAFETY: checked above; `offset` checked non-null and aligned.
        unsafe {
            put(view, v);
            *offset = (at as u64) + total;
        }
        Ok(())
    })
}

/// Test-only (`ORBITE_FEATURE_TEST_HOOKS`): the next entry point called
/// panics inside its barrier, which must turn the panic into
/// `ORBITE_STATUS_INTERNAL`.
#[cfg(feature = "test-hooks")]
#[unsafe(no_mangle)]
pub extern "C" fn orbite_test_inject_panic() -> OrbiteStatus {
    INJECT_PANIC.store(true, std::sync::atomic::Ordering::Release);
    OrbiteStatus::Ok
}

#[cfg(feature = "test-hooks")]
fn directive(kind: u32, bytes: u64, effect_unknown: u32) -> Res<orbite_core::fault::FaultDirective> {
    use orbite_core::fault::FaultDirective as D;
    Ok(match kind {
        ORBITE_TEST_RUN => D::Run,
        ORBITE_TEST_HOLD => D::Hold,
        ORBITE_TEST_SHORT => D::Short { bytes },
        ORBITE_TEST_FAIL => D::Fail { bytes, effect_unknown: effect_unknown != 0 },
        k => return fail(OrbiteStatus::InvalidArgument, format!("unknown directive {k}")),
    })
}

/// Test-only directive: copy normally.
#[cfg(feature = "test-hooks")]
pub const ORBITE_TEST_RUN: u32 = 0;
/// Test-only directive: hold the task (nothing copied) until released.
#[cfg(feature = "test-hooks")]
pub const ORBITE_TEST_HOLD: u32 = 1;
/// Test-only directive: copy `bytes`, then report a short completion.
#[cfg(feature = "test-hooks")]
pub const ORBITE_TEST_SHORT: u32 = 2;
/// Test-only directive: copy `bytes`, then report failure.
#[cfg(feature = "test-hooks")]
pub const ORBITE_TEST_FAIL: u32 = 3;

/// Test-only: the engine's fault hooks for tasks of the self connection and
/// the same-host routes. Queues a directive for the next task.
#[cfg(feature = "test-hooks")]
#[unsafe(no_mangle)]
pub extern "C" fn orbite_test_fault_push(
    engine: OrbiteEngine,
    kind: u32,
    bytes: u64,
    effect_unknown: u32,
) -> OrbiteStatus {
    entry("orbite_test_fault_push", || {
        let d = directive(kind, bytes, effect_unknown)?;
        engine_of(engine)?.engine.fault_hooks().push(d);
        Ok(())
    })
}

/// Test-only: holds every task with no queued directive while `on` is 1.
#[cfg(feature = "test-hooks")]
#[unsafe(no_mangle)]
pub extern "C" fn orbite_test_hold_all(engine: OrbiteEngine, on: u32) -> OrbiteStatus {
    entry("orbite_test_hold_all", || {
        engine_of(engine)?.engine.fault_hooks().hold_all(on != 0);
        Ok(())
    })
}

/// Test-only: waits up to `timeout_ms` until at least `n` tasks are held;
/// writes how many are.
///
/// # Safety
/// `held` is null or valid for writing a `uint64_t`.
///
/// Checked: a null or misaligned `held`; the handle may be any value: it is
/// checked.
#[cfg(feature = "test-hooks")]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_test_wait_held(
    engine: OrbiteEngine,
    n: u64,
    timeout_ms: u64,
    held: *mut u64,
) -> OrbiteStatus {
    entry("orbite_test_wait_held", || {
        check_pointer(held, "held")?;
        let e = engine_of(engine)?;
        let hooks = e.engine.fault_hooks();
        hooks.wait_held(n as usize, Duration::from_millis(timeout_ms));
        // SAFETY: non-null and aligned (checked), writable.
        unsafe { *held = hooks.held().len() as u64 };
        Ok(())
    })
}

/// Test-only: lets every held task go with a directive.
#[cfg(feature = "test-hooks")]
#[unsafe(no_mangle)]
pub extern "C" fn orbite_test_release_held(
    engine: OrbiteEngine,
    kind: u32,
    bytes: u64,
    effect_unknown: u32,
) -> OrbiteStatus {
    entry("orbite_test_release_held", || {
        let d = directive(kind, bytes, effect_unknown)?;
        let e = engine_of(engine)?;
        let hooks = e.engine.fault_hooks();
        for t in hooks.held() {
            hooks.release(t, d);
        }
        Ok(())
    })
}

/// Test-only: writes up to `cap` live engine handles into `out` and their
/// total into `*count` (for tests that reach an engine created inside
/// another component, such as the NIXL plugin).
///
/// # Safety
/// `out` is null or valid for writing `cap` `OrbiteEngine`s; `count` is null
/// or valid for writing a `size_t`; they do not overlap.
///
/// Checked: a null or misaligned `count`, and a null or misaligned `out` when
/// `cap` is not 0 and there is an engine to write.
#[cfg(feature = "test-hooks")]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn orbite_test_engines(out: *mut OrbiteEngine, cap: usize, count: *mut usize) -> OrbiteStatus {
    entry("orbite_test_engines", || {
        check_pointer(count, "count")?;
        let all = handles::all(Kind::Engine);
        if !all.is_empty() && cap > 0 {
            check_pointer(out, "out")?;
        }
        for (i, raw) in all.iter().take(cap).enumerate() {
            // SAFETY: `out` holds `cap` writable handles (contract), i < cap.
            unsafe { *out.add(i) = OrbiteEngine { raw: *raw } };
        }
        // SAFETY: non-null and aligned (checked), writable.
        unsafe { *count = all.len() };
        Ok(())
    })
}

/// Test-only: while `on` is 1, the engine's server holds peers' requests
/// after validating them and before any byte moves.
#[cfg(feature = "test-hooks")]
#[unsafe(no_mangle)]
pub extern "C" fn orbite_test_hold_remote(engine: OrbiteEngine, on: u32) -> OrbiteStatus {
    entry("orbite_test_hold_remote", || {
        engine_of(engine)?.engine.hold_remote_requests(on != 0);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counters of `Stats` the C record does not carry: adding one changes
    /// the C ABI (a new record version).
    const NOT_IN_THE_RECORD: &[&str] = &[];

    /// Every field of a record and its value, in declaration order (read
    /// from its `Debug`: `OrbiteStats { size: 120, version: 1, .. }`).
    fn record_fields(r: &OrbiteStats) -> Vec<(String, u64)> {
        let text = format!("{r:?}");
        let inner = text.strip_prefix("OrbiteStats { ").and_then(|t| t.strip_suffix(" }")).expect("Debug of a struct");
        inner
            .split(", ")
            .map(|f| {
                let (name, value) = f.split_once(": ").expect("name: value");
                (name.to_owned(), value.parse().expect("a number"))
            })
            .collect()
    }

    #[test]
    fn the_stats_record_carries_each_counter_of_stats_under_its_name_in_its_order() {
        // Distinct values, so that a counter copied into another field shows.
        let s = Stats {
            registrations: 1,
            registered_bytes: 2,
            fenced_registrations: 3,
            host_allocations: 4,
            host_memory_bytes: 5,
            prepared_transfers: 6,
            executions: 7,
            queued_executions: 8,
            bytes_in_flight: 9,
            tasks_in_flight: 10,
            unquiesced_owners: 11,
            notification_bytes: 12,
            binding_handles: 13,
            pinned_ranges: 14,
            auth_failures: 15,
            device_allocations: 16,
            device_memory_bytes: 17,
            staging_buffers: 18,
            staging_bytes: 19,
            cuda_imports: 20,
            connections: 21,
            connections_refused: 22,
            frame_buffer_bytes: 23,
            borrows: 24,
            borrow_bytes: 25,
            watchers: 26,
        };
        let values: Vec<u64> = s.fields().iter().map(|&(_, v)| v).collect();
        assert_eq!(values, (1..=Stats::FIELDS.len() as u64).collect::<Vec<_>>(), "distinct values");
        let want: Vec<(String, u64)> = s
            .fields()
            .into_iter()
            .filter(|(name, _)| !NOT_IN_THE_RECORD.contains(name))
            .map(|(name, v)| (name.to_owned(), v))
            .collect();
        let got = record_fields(&stats_record(s));
        assert_eq!(
            got[..2],
            [
                ("size".to_owned(), size_of::<OrbiteStats>() as u64),
                ("version".to_owned(), ORBITE_RECORD_VERSION as u64)
            ]
        );
        assert_eq!(got[2..], want);
    }
}
