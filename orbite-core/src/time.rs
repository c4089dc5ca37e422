//! Clock helpers for the I/O layer (the state machines take time as input).

use std::time::{Duration, Instant};

/// `now + d`, saturating: a caller's huge timeout means "no deadline in
/// practice", never a panic.
pub(crate) fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_timeouts_saturate() {
        assert!(deadline_after(Duration::MAX) > Instant::now() + Duration::from_secs(3600));
    }
}
