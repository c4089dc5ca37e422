//! Where the engine's log records go through the C ABI: to the host's
//! sink once it installs one with `orbite_log_install` (the NIXL backend
//! forwards them to NIXL's logger), else to stderr under `ORBITE_LOG`
//! (warnings and worse by default). One logger per process, set the first
//! time an engine is made or a sink installed, unless the process already
//! has one of its own (a Rust host), which is then left alone.

use std::ffi::{CString, c_char, c_void};

use parking_lot::RwLock;

/// A host's sink, set (`OrbiteLogSink` without its `Option`).
type Sink = unsafe extern "C" fn(u32, *const c_char, *const c_char, *mut c_void);

/// The sink and its context, if the host installed one.
static SINK: RwLock<Option<(Sink, usize)>> = RwLock::new(None);

struct Forward;

static FORWARD: Forward = Forward;

impl log::Log for Forward {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let sink = *SINK.read();
        let Some((sink, ctx)) = sink else {
            return log::Log::log(&orbite_core::logs::Stderr, record);
        };
        // A NUL in a message would cut it: say it as the escape instead.
        let text = record.args().to_string().replace('\0', "\\0");
        let (Ok(target), Ok(text)) = (CString::new(record.target()), CString::new(text)) else { return };
        // SAFETY: the host's sink, with the context it gave and two
        // NUL-terminated strings alive for the call.
        unsafe { sink(record.level() as u32, target.as_ptr(), text.as_ptr(), ctx as *mut c_void) };
    }

    fn flush(&self) {}
}

/// Sets this library's logger for the process, once (not over a host's
/// own): stderr under `ORBITE_LOG` until a sink is installed.
pub(crate) fn ensure() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if log::set_logger(&FORWARD).is_ok() {
            log::set_max_level(orbite_core::logs::level_from_env(log::LevelFilter::Warn));
        }
    });
}

/// Installs `sink` (null: back to stderr) for records up to `max_level`
/// (0 off, 1 error to 5 trace).
pub(crate) fn install(sink: crate::records::OrbiteLogSink, ctx: *mut c_void, max_level: u32) {
    ensure();
    *SINK.write() = sink.map(|s| (s, ctx as usize));
    let level = match max_level {
        0 => log::LevelFilter::Off,
        1 => log::LevelFilter::Error,
        2 => log::LevelFilter::Warn,
        3 => log::LevelFilter::Info,
        4 => log::LevelFilter::Debug,
        _ => log::LevelFilter::Trace,
    };
    log::set_max_level(level);
}
