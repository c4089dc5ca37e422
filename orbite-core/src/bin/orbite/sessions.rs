//! `orbite bench --workload sessions`: the KV session layer's costs.
//!
//! - S1: one session's whole life (allocate, mark ready with its KV pinned
//!   through the engine, attach, complete, release) on the real service and
//!   engine, per session.
//! - S2: the lease reaper with 100 000 live sessions and random renewals:
//!   per tick, the leases it looks at and the time it takes, against the
//!   sessions that expire in that tick; and the same tick cost with 1 000
//!   live sessions, to show it does not follow the live count.

use std::sync::Arc;
use std::time::Instant;

use orbite_core::session::{
    AllocateRequest, AttachOutcome, KvConnectorInfo, KvScheduleStyle, KvSessionService, KvTransferDisposition,
    KvTransferMeta, SessionId, SessionMachine, SystemClock,
};
use orbite_core::{Desc, EngineConfig, MemoryRange, Permission, TransferEngine};
use serde_json::{Value, json};

use crate::error::Error;
use crate::measure::{Rng, percentiles_us};

fn request(i: u64, meta: &KvTransferMeta, lease_ms: Option<i64>) -> AllocateRequest {
    AllocateRequest {
        request_id: format!("req-{i}"),
        model: "bench-model".into(),
        idempotency_key: format!("key-{i}"),
        style: KvScheduleStyle::ContextFirst,
        disposition: KvTransferDisposition::Required,
        lease_ms,
        meta: meta.clone(),
    }
}

fn meta() -> KvTransferMeta {
    KvTransferMeta { layout: "bench:16x128:bf16".into(), block_bytes: 4096, blocks: 4 }
}

/// S1: the whole life of one session, per session.
pub fn lifecycle(quick: bool) -> Result<Value, Error> {
    let n: u64 = if quick { 2_000 } else { 20_000 };
    let engine = TransferEngine::new(EngineConfig::default())?;
    let kv = engine.allocate_host_memory(1 << 20)?;
    let id = engine.register_memory_ranges(vec![MemoryRange::host(&kv, 0, 1 << 20, Permission::RemoteRead)?])?[0];
    let info = KvConnectorInfo { max_tombstones: 1024, ..KvConnectorInfo::default() };
    let service = KvSessionService::new(engine.clone(), info, Arc::new(SystemClock::default()));
    let meta = meta();
    let ranges = [Desc::new(id, 0, 16384)];
    let mut samples = Vec::with_capacity(n as usize);
    let mut ok = true;
    for i in 0..n + 200 {
        let start = Instant::now();
        let s = service.allocate(&request(i, &meta, None))?;
        service.mark_ready(s.session_id, &ranges, &meta)?;
        let attached = service.attach(s.session_id, &meta)?;
        service.complete(s.session_id)?;
        service.release(s.session_id)?;
        let took = start.elapsed().as_secs_f64();
        ok &= matches!(attached, AttachOutcome::Attached(_));
        if i >= 200 {
            samples.push(took);
        }
        if i % 1024 == 0 {
            service.poll(); // the timer: forgets old tombstones
        }
    }
    service.poll();
    let stats = engine.stats();
    ok &= stats.pinned_ranges == 0 && service.live_count() == 0;
    let mean = samples.iter().sum::<f64>() / samples.len() as f64 * 1e6;
    let (p50, p99) = percentiles_us(&mut samples);
    engine.deregister(id)?;
    Ok(json!({
        "system": "orbite", "route": "-", "workload": "S1-session-life", "sessions": n,
        "p50_us": (p50 * 100.0).round() / 100.0, "p99_us": (p99 * 100.0).round() / 100.0,
        "mean_us": (mean * 100.0).round() / 100.0, "verified": ok,
    }))
}

/// A service's limits for `live` sessions with leases of up to an hour.
fn info(live: u64) -> KvConnectorInfo {
    KvConnectorInfo {
        max_live_sessions: live * 2,
        max_lease_ms: 3_600_000,
        max_tombstones: live * 2,
        ..KvConnectorInfo::default()
    }
}

/// Runs `ticks` ticks of 1 ms over `live` sessions with `renewals` random
/// renewals per tick; returns (ns per tick with nothing expiring, expired,
/// visits, ns per expired lease on ticks that expired some).
fn reaper(live: u64, ticks: u64, renewals: u64) -> Result<(f64, u64, u64, f64), Error> {
    let mut m = SessionMachine::new(info(live), String::new(), 1, 1);
    let meta = meta();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    // Leases spread over 100 s; the run covers the first `ticks` ms.
    for i in 0..live {
        let lease = 1 + (rng.next() % 100_000) as i64;
        m.allocate(&request(i, &meta, Some(lease)), 0)?;
    }
    let (mut idle_ns, mut idle_ticks, mut busy_ns, mut expired) = (0u128, 0u64, 0u128, 0u64);
    let visits_before = m.reaper_visits();
    for t in 1..=ticks {
        for _ in 0..renewals {
            let id = SessionId { incarnation: 1, seq: 1 + rng.next() % live };
            let _ = m.renew(id, Some(1 + (rng.next() % 100_000) as i64), t); // ended ones refuse
        }
        let live_before = m.live_count();
        let start = Instant::now();
        m.tick(t);
        let ns = start.elapsed().as_nanos();
        let n = live_before - m.live_count();
        m.take_effects();
        if n == 0 {
            idle_ns += ns;
            idle_ticks += 1;
        } else {
            busy_ns += ns;
            expired += n;
        }
    }
    let visits = m.reaper_visits() - visits_before;
    let per_idle = if idle_ticks == 0 { 0.0 } else { idle_ns as f64 / idle_ticks as f64 };
    let per_expired = if expired == 0 { 0.0 } else { busy_ns as f64 / expired as f64 };
    Ok((per_idle, expired, visits, per_expired))
}

/// S2: reaper work against expirations, at 100 000 and 1 000 live sessions.
pub fn reaper_scaling(quick: bool) -> Result<Vec<Value>, Error> {
    let ticks = if quick { 500 } else { 2_000 };
    let mut rows = Vec::new();
    for live in [100_000u64, 1_000] {
        let (idle_ns, expired, visits, per_expired) = reaper(live, ticks, 1_000)?;
        rows.push(json!({
            "system": "orbite", "route": "-", "workload": "S2-reaper", "live_sessions": live, "ticks": ticks,
            "renewals_per_tick": 1000, "expired": expired, "leases_visited": visits,
            "tick_ns_none_expiring": idle_ns.round(), "tick_ns_per_expired": per_expired.round(),
            "verified": visits == expired,
        }));
    }
    Ok(rows)
}

/// S3: the built-in reaper thread of a real service (monotonic clock, its
/// own thread, period 5 ms) with 100 000 and with 1 000 live sessions whose
/// leases run past the run, while this thread renews 1 000 random sessions
/// every millisecond: the reaper's CPU time per run (its thread's clock:
/// the wake-up, the contended lock and a cold cache included) and its share
/// of one core.
pub fn reaper_threads(quick: bool) -> Result<Vec<Value>, Error> {
    [100_000, 1_000].into_iter().map(|live| reaper_thread(live, quick)).collect()
}

fn reaper_thread(live: u64, quick: bool) -> Result<Value, Error> {
    let secs = if quick { 0.5 } else { 2.0 };
    let engine = TransferEngine::new(EngineConfig::default())?;
    let service = Arc::new(KvSessionService::new(engine.clone(), info(live), Arc::new(SystemClock::default())));
    let meta = meta();
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut ids = Vec::with_capacity(live as usize);
    for i in 0..live {
        let lease = 600_000 + (rng.next() % 100_000) as i64;
        ids.push(service.allocate(&request(i, &meta, Some(lease)))?.session_id);
    }
    let reaper = service.start_reaper(std::time::Duration::from_millis(5))?;
    let before = service.stats();
    let start = Instant::now();
    let mut renewed = 0u64;
    while start.elapsed().as_secs_f64() < secs {
        let tick = Instant::now();
        for _ in 0..1_000 {
            let id = ids[(rng.next() % live) as usize];
            service.renew(id, Some(600_000 + (rng.next() % 100_000) as i64))?;
            renewed += 1;
        }
        if let Some(rest) = std::time::Duration::from_millis(1).checked_sub(tick.elapsed()) {
            std::thread::sleep(rest);
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let after = service.stats();
    reaper.stop();
    let runs = after.reaper_ticks - before.reaper_ticks;
    let busy = after.reaper_busy_ns - before.reaper_busy_ns;
    let per_run = if runs == 0 { 0.0 } else { busy as f64 / runs as f64 };
    let scan = if runs == 0 { 0.0 } else { (after.tick_ns - before.tick_ns) as f64 / runs as f64 };
    for id in ids {
        let _ = service.release(id);
    }
    service.poll();
    let ok = service.live_count() == 0 && after.sessions_expired == 0 && runs > 0;
    Ok(json!({
        "system": "orbite", "route": "-", "workload": "S3-reaper-thread", "live_sessions": live,
        "seconds": (wall * 100.0).round() / 100.0, "renewals": renewed, "reaper_runs": runs,
        "run_ns": per_run.round(), "scan_ns": scan.round(), "reaper_cpu_pct": (busy as f64 / (wall * 1e9) * 100.0 * 1000.0).round() / 1000.0,
        "verified": ok,
        "summary": format!(
            "{live} live, 1000 renewals/ms: built-in reaper {runs} runs, lease scan {:.0} ns per run (S2's tick), \
             {:.0} ns CPU per run with wake-up and lock, {:.3}% of a core",
            scan,
            per_run,
            busy as f64 / (wall * 1e9) * 100.0
        ),
    }))
}
