//! Measurement helpers: memory set-up, reference loops, CPU time, stats.

use std::time::{Duration, Instant};

use orbite_core::{
    Desc, EngineConfig, HostMemory, MemoryRange, Op, Permission, Target, TransferEngine, TransferSpec, TransferStatus,
};

use crate::error::Error;

/// Writes a position-dependent pattern (and touches every page).
pub fn fill(mem: &HostMemory, seed: u64) {
    // SAFETY: called only while no transfer uses `mem`; the slice covers
    // exactly the allocation.
    let words = unsafe { std::slice::from_raw_parts_mut(mem.as_ptr() as *mut u64, mem.len() / 8) };
    for (i, w) in words.iter_mut().enumerate() {
        *w = if seed == 0 { 0 } else { (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed };
    }
}

/// Copies each `(src_off, dst_off, len)` block with one `memcpy` per block:
/// the in-run physical reference.
pub fn memcpy_blocks(src: &HostMemory, dst: &HostMemory, blocks: &[(u64, u64, u64)]) {
    for &(s, d, l) in blocks {
        // SAFETY: in bounds (built from validated layouts); distinct
        // allocations never overlap; no transfer is active meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(s as usize), dst.as_ptr().add(d as usize), l as usize) }
    }
}

/// Posts a prepared transfer and waits for its retirement; returns seconds.
pub fn post_and_wait(t: &orbite_core::Transfer) -> Result<f64, Error> {
    let start = Instant::now();
    t.post()?;
    match t.wait(Duration::from_secs(60)) {
        TransferStatus::Retired(r) if r.outcome.is_success() => Ok(start.elapsed().as_secs_f64()),
        other => Err(Error::Transfer(other)),
    }
}

/// Runs `f` 50 times to warm up, then `iters` times: the seconds `f`
/// returned for those.
pub fn timed(iters: usize, mut f: impl FnMut() -> Result<f64, Error>) -> Result<Vec<f64>, Error> {
    for _ in 0..50 {
        f()?;
    }
    (0..iters).map(|_| f()).collect()
}

/// Runs `f` until `per` has passed and it ran at least 3 times: the
/// seconds `f` returned.
pub fn timed_for(per: Duration, mut f: impl FnMut() -> Result<f64, Error>) -> Result<Vec<f64>, Error> {
    let (start, mut samples) = (Instant::now(), Vec::new());
    while start.elapsed() < per || samples.len() < 3 {
        samples.push(f()?);
    }
    Ok(samples)
}

/// CPU time of this process so far (all threads), in nanoseconds.
pub fn process_cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
        .sum()
}

/// Median and 99th percentile of samples (seconds), in microseconds.
pub fn percentiles_us(samples: &mut [f64]) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize] * 1e6;
    (at(0.5), at(0.99))
}

/// The median of samples (the upper one of an even count).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A xorshift generator: deterministic pseudo-random numbers.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

pub struct CopyResult {
    pub seconds: f64,
    pub prep_us: f64,
    pub verified: bool,
}

/// One local transfer of `bytes` in `block`-sized descriptors.
pub fn one_local_copy(bytes: u64, block: u64) -> Result<CopyResult, Error> {
    let engine = TransferEngine::new(EngineConfig::default())?;
    let len = bytes as usize;
    let (src, dst) = (engine.allocate_host_memory(len)?, engine.allocate_host_memory(len)?);
    let ranges = vec![
        MemoryRange::host(&src, 0, len, Permission::RemoteReadWrite)?,
        MemoryRange::host(&dst, 0, len, Permission::RemoteReadWrite)?,
    ];
    let ids = engine.register_memory_ranges(ranges)?;
    fill(&src, 0x5EED);
    fill(&dst, 0);
    let n = bytes / block;
    let local: Vec<Desc> = (0..n).map(|i| Desc::new(ids[0], i * block, block)).collect();
    let remote: Vec<Desc> = (0..n).map(|i| Desc::new(ids[1], i * block, block)).collect();
    let start = Instant::now();
    let t = engine.prepare(&TransferSpec::new(Op::Write, &local, &remote, Target::Loopback))?;
    let prep_us = start.elapsed().as_secs_f64() * 1e6;
    let seconds = post_and_wait(&t)?;
    // SAFETY: both allocations are `len` bytes long and the transfer has
    // retired.
    let verified =
        unsafe { std::slice::from_raw_parts(src.as_ptr(), len) == std::slice::from_raw_parts(dst.as_ptr(), len) };
    Ok(CopyResult { seconds, prep_us, verified })
}
