//! `orbite bench --workload refresh`: the cost of metadata refresh.
//!
//! A peer has 10 000 registrations when this engine opens it, then makes
//! 1 000 more, one call each (each announced on the watch connection).
//! Importing 1 000 ranges that existed at open (lookups in the view) is the
//! reference; importing the 1 000 made after the exchange asks the peer for
//! what changed (one round trip and the bytes of the changes, not of the
//! 10 000). The row's `x_limit` is the second time over the first; the bar
//! is 2. Both engines are in this process, over loopback TCP.

use std::time::{Duration, Instant};

use orbite_core::segment::ExportedRegistration;
use orbite_core::{EngineConfig, HostMemory, MemoryRange, Permission, RegistrationId, TransferEngine};
use serde_json::{Value, json};

use crate::error::Error;
use crate::measure::{Rng, median};

const AT_OPEN: usize = 10_000;
const LATER: usize = 1_000;
const RANGE: usize = 4096;

/// Imports every range (exact address, length and permission, as the C
/// ABI's import does); true if each resolved to the expected registration.
fn import_all(
    initiator: &TransferEngine,
    seg: &orbite_core::RemoteSegment,
    ranges: &[(u64, RegistrationId)],
) -> Result<(Duration, bool), Error> {
    let start = Instant::now();
    let mut ok = true;
    for &(addr, id) in ranges {
        let exact = |r: &ExportedRegistration| r.addr == addr && r.len == RANGE as u64;
        let r = initiator.find_remote_registration(seg, addr, RANGE as u64, exact)?;
        ok &= r.id == id;
    }
    Ok((start.elapsed(), ok))
}

/// The `refresh` row.
pub fn run(quick: bool) -> Result<Value, Error> {
    let rounds = if quick { 3 } else { 7 };
    let target = TransferEngine::new(EngineConfig { listen: Some("127.0.0.1:0".into()), ..EngineConfig::default() })?;
    let initiator = TransferEngine::new(EngineConfig::default())?;
    let total = AT_OPEN + rounds * LATER;
    let mem: HostMemory = target.allocate_host_memory(total * RANGE)?;
    let range = |k: usize| MemoryRange::host(&mem, k * RANGE, RANGE, Permission::RemoteReadWrite);
    let first: Vec<MemoryRange> = (0..AT_OPEN).map(range).collect::<Result<_, _>>()?;
    let first_ids = target.register_memory_ranges(first)?;
    let seg = initiator.open_segment(
        &target.endpoint().unwrap_or_default(),
        Some(target.source_epoch()),
        Duration::from_secs(10),
    )?;
    let addr = |k: usize| mem.as_ptr() as u64 + (k * RANGE) as u64;
    let mut old_us = Vec::new();
    let mut new_us = Vec::new();
    let mut verified = true;
    let mut pick = Rng(0x9E37_79B9_7F4A_7C15);
    for round in 0..rounds {
        // 1 000 that existed at open, in a scattered order.
        let old: Vec<(u64, RegistrationId)> = (0..LATER)
            .map(|_| {
                let k = (pick.next() % AT_OPEN as u64) as usize;
                (addr(k), first_ids[k])
            })
            .collect();
        let (t_old, ok_old) = import_all(&initiator, &seg, &old)?;
        // 1 000 made after the exchange, one registration call each.
        let base = AT_OPEN + round * LATER;
        let mut new = Vec::with_capacity(LATER);
        for k in base..base + LATER {
            let id = target.register_memory_ranges(vec![range(k)?])?[0];
            new.push((addr(k), id));
        }
        let (t_new, ok_new) = import_all(&initiator, &seg, &new)?;
        verified &= ok_old && ok_new;
        old_us.push(t_old.as_secs_f64() * 1e6);
        new_us.push(t_new.as_secs_f64() * 1e6);
    }
    let (old, new) = (median(&mut old_us), median(&mut new_us));
    initiator.close();
    target.close();
    Ok(json!({
        "system": "orbite", "route": "tcp", "workload": "refresh",
        "registrations_at_open": AT_OPEN, "imported": LATER, "rounds": rounds,
        "existing_import_us": (old * 10.0).round() / 10.0, "late_import_us": (new * 10.0).round() / 10.0,
        "x_limit": ((new / old) * 100.0).round() / 100.0,
        "limit": "importing as many registrations that existed at open (bar: 2)",
        "verified": verified,
    }))
}
