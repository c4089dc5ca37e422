//! What the engine says, through the `log` facade: a host installs the
//! logger (the command line's writes to stderr under `ORBITE_LOG`; the
//! NIXL backend's forwards to NIXL's logger, so `NIXL_LOG_LEVEL` governs
//! it; a Rust host uses its own). Nothing here prints by itself.
//!
//! Each layer logs under its own target ([`ENGINE`], [`PEER`], [`SERVER`],
//! [`AUTH`], [`RDMA`]), so a host can filter by layer. An event a peer can
//! repeat at will (a refused connection, a failed handshake) goes through
//! `Repeats`: logged at once the first time, then at most once per
//! window, each message saying how many events it stands for. Imports
//! nothing of the crate.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// The engine's life: start, listening, close.
pub const ENGINE: &str = "orbite::engine";
/// Peers this engine opened: lost, refused, reconnected.
pub const PEER: &str = "orbite::peer";
/// The target server: connections refused or closed for what they sent.
pub const SERVER: &str = "orbite::server";
/// Authentication of peer connections.
pub const AUTH: &str = "orbite::auth";
/// RDMA NICs and queue pairs.
pub const RDMA: &str = "orbite::rdma";

/// How often [`Repeats`] reports one key, at most (its default).
pub(crate) const WINDOW: Duration = Duration::from_secs(60);

/// Keys [`Repeats`] tells apart; events of further keys share one.
const MAX_KEYS: usize = 1024;

/// Events of one key since the last that was logged.
struct Seen {
    logged_at: Instant,
    since: u64,
}

/// Rate limits events a peer can repeat: per key (a peer's address, a
/// reason), the first is logged at once, then at most one per `window`,
/// standing for every event since the last one logged.
pub(crate) struct Repeats {
    window: Duration,
    keys: Mutex<HashMap<String, Seen>>,
}

impl Default for Repeats {
    /// One report a minute at most, per key.
    fn default() -> Self {
        Repeats::new(WINDOW)
    }
}

impl Repeats {
    pub fn new(window: Duration) -> Self {
        Repeats { window, keys: Mutex::new(HashMap::new()) }
    }

    /// An event of `key` at `now`: `Some(n)` when it is to be logged,
    /// standing for `n` events (this one and those not logged since the
    /// last that was); `None` when it is only counted.
    pub fn admit(&self, key: &str, now: Instant) -> Option<u64> {
        let mut keys = self.keys.lock();
        let key = if keys.len() >= MAX_KEYS && !keys.contains_key(key) { "(other keys)" } else { key };
        match keys.get_mut(key) {
            None => {
                keys.insert(key.to_owned(), Seen { logged_at: now, since: 0 });
                Some(1)
            }
            Some(seen) => {
                seen.since += 1;
                if now.saturating_duration_since(seen.logged_at) < self.window {
                    return None;
                }
                let n = seen.since;
                *seen = Seen { logged_at: now, since: 0 };
                Some(n)
            }
        }
    }
}

/// The level `ORBITE_LOG` names (`off`, `error`, `warn`, `info`, `debug`,
/// `trace`, any case), or `default` when it is unset or names none.
pub fn level_from_env(default: log::LevelFilter) -> log::LevelFilter {
    std::env::var("ORBITE_LOG").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

/// A logger that writes each record to stderr, one line: `orbite: LEVEL
/// target: message`. What the command line installs, and the C ABI
/// until its host installs a sink of its own.
pub struct Stderr;

impl log::Log for Stderr {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            eprintln!("orbite: {} {}: {}", record.level(), record.target(), record.args());
        }
    }

    fn flush(&self) {}
}

/// The words that say how many events a message stands for.
pub(crate) fn standing_for(n: u64, window: Duration) -> String {
    match n {
        1 => String::new(),
        n => format!(" ({n} such events since the last report, at most one report per {} s)", window.as_secs()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_log_the_first_then_one_per_window_counting_the_rest() {
        let r = Repeats::new(Duration::from_secs(60));
        let t0 = Instant::now();
        assert_eq!(r.admit("a", t0), Some(1), "the first at once");
        assert_eq!(r.admit("a", t0 + Duration::from_secs(1)), None);
        assert_eq!(r.admit("b", t0 + Duration::from_secs(1)), Some(1), "keys apart");
        for i in 0..10 {
            assert_eq!(r.admit("a", t0 + Duration::from_secs(2 + i)), None);
        }
        assert_eq!(r.admit("a", t0 + Duration::from_secs(61)), Some(12), "the rest, counted");
        assert_eq!(r.admit("a", t0 + Duration::from_secs(62)), None);
        // Past the bound, new keys share one: a flood of addresses cannot
        // grow the table or the log.
        for i in 0..2 * MAX_KEYS {
            r.admit(&format!("k{i}"), t0);
        }
        assert!(r.keys.lock().len() <= MAX_KEYS + 1);
        assert!(standing_for(12, Duration::from_secs(60)).contains("12 such events"));
        assert_eq!(standing_for(1, Duration::from_secs(60)), "");
    }
}
