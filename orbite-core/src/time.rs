//! Clock helpers for the I/O layer (the state machines take time as input).

use std::time::{Duration, Instant};

/// `now + d`, saturating: a caller's huge timeout means "no deadline in
/// practice", never a panic.
pub(crate) fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// How long `bytes` take at `rate` bytes per second (> 0), saturating at
/// `Duration::MAX`: a huge transfer at a tiny rate means no bound in
/// practice, never a panic.
pub(crate) fn at_rate(bytes: u64, rate: u64) -> Duration {
    Duration::try_from_secs_f64(bytes as f64 / rate.max(1) as f64).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_transfers_at_tiny_rates_saturate() {
        assert_eq!(at_rate(u64::MAX, 1), Duration::MAX);
        assert_eq!(at_rate(1000, 1000), Duration::from_secs(1));
    }

    #[test]
    fn huge_timeouts_saturate() {
        assert!(deadline_after(Duration::MAX) > Instant::now() + Duration::from_secs(3600));
    }
}
