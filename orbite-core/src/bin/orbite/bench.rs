//! `orbite bench`: the workloads of `docs/bench.md` (W1 bulk, W2 latency,
//! W3 paged-KV layout, idle CPU) on each route, beside in-run references,
//! with every destination byte verified. Output: one JSON object per line,
//! then (unless `--json`) a table of ratios.

use std::time::{Duration, Instant};

use orbite_core::{Desc, EngineConfig, MemoryRange, Op, Permission};
use serde_json::{Map, Value, json};

use crate::measure::{self, Pair, memcpy_blocks, percentiles_us, post_and_wait, same, spec};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Local,
}

impl Route {
    fn name(self) -> &'static str {
        match self {
            Route::Local => "local",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    W1,
    W2,
    W3,
    Idle,
}

/// Parsed `orbite bench` options.
pub struct BenchArgs {
    routes: Vec<Route>,
    workloads: Vec<Workload>,
    quick: bool,
    json: bool,
}

impl BenchArgs {
    pub fn parse(args: &[String]) -> Result<Self, String> {
        let mut out = BenchArgs {
            routes: vec![Route::Local],
            workloads: vec![Workload::W1, Workload::W2, Workload::W3, Workload::Idle],
            quick: false,
            json: false,
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--quick" => out.quick = true,
                "--json" => out.json = true,
                "--route" => {
                    let v = it.next().ok_or("--route needs a value")?;
                    out.routes = match v.as_str() {
                        "local" | "all" => vec![Route::Local],
                        other => return Err(format!("unknown route `{other}` (this build has: local, all)")),
                    };
                }
                "--workload" => {
                    let v = it.next().ok_or("--workload needs a value")?;
                    out.workloads = v
                        .split(',')
                        .map(|w| match w.trim().to_ascii_lowercase().as_str() {
                            "w1" => Ok(Workload::W1),
                            "w2" => Ok(Workload::W2),
                            "w3" => Ok(Workload::W3),
                            "idle" => Ok(Workload::Idle),
                            other => Err(format!("unknown workload `{other}` (W1, W2, W3, idle)")),
                        })
                        .collect::<Result<_, _>>()?;
                }
                other => return Err(format!("unknown option `{other}`")),
            }
        }
        Ok(out)
    }
}

struct Report {
    json: bool,
    rows: Vec<Map<String, Value>>,
}

impl Report {
    fn emit(&mut self, row: Value) {
        let Value::Object(map) = row else { return };
        println!("{}", Value::Object(map.clone()));
        self.rows.push(map);
    }
}

fn progress(msg: &str) {
    eprintln!("orbite bench: {msg}");
}

pub fn run(args: BenchArgs) -> Result<(), String> {
    let mut report = Report { json: args.json, rows: Vec::new() };
    let started = Instant::now();
    for &route in &args.routes {
        for &w in &args.workloads {
            match w {
                Workload::W1 => {
                    w1(route, Op::Write, args.quick, &mut report)?;
                    w1(route, Op::Read, args.quick, &mut report)?;
                }
                Workload::W2 => w2(route, args.quick, &mut report)?,
                Workload::W3 => {
                    w3(route, Op::Write, args.quick, &mut report)?;
                    w3(route, Op::Read, args.quick, &mut report)?;
                }
                Workload::Idle => idle(route, args.quick, &mut report)?,
            }
        }
    }
    progress(&format!("done in {:.1} s", started.elapsed().as_secs_f64()));
    if !report.json {
        print_table(&report.rows);
    }
    let failed = report.rows.iter().any(|r| r.get("verified") == Some(&Value::Bool(false)));
    if failed { Err("some destination bytes did not verify".into()) } else { Ok(()) }
}

fn local_engine() -> Result<orbite_core::TransferEngine, String> {
    measure::engine(EngineConfig::default())
}

fn name(op: Op, base: &str) -> String {
    format!("{base}-{}", if op == Op::Write { "write" } else { "read" })
}

/// W1: 64 MiB in descriptors of B bytes, repeated; interleaved with the
/// memcpy reference over the same blocks.
fn w1(route: Route, op: Op, quick: bool, report: &mut Report) -> Result<(), String> {
    let total = 64 * MIB;
    let p = measure::pair(local_engine()?, (256 * MIB) as usize)?;
    let per_size = if quick { Duration::from_millis(300) } else { Duration::from_secs(2) };
    for block in [4 * KIB, 16 * KIB, 64 * KIB, MIB, 16 * MIB] {
        progress(&format!("{} {} W1 block {} KiB", route.name(), name(op, "W1"), block / KIB));
        let n = total / block;
        let src_descs: Vec<Desc> = (0..n).map(|i| Desc::new(p.src_id, i * block, block)).collect();
        let dst_descs: Vec<Desc> = (0..n).map(|i| Desc::new(p.dst_id, i * block, block)).collect();
        let (local, remote) = match op {
            Op::Write => (&src_descs, &dst_descs),
            Op::Read => (&dst_descs, &src_descs),
        };
        let blocks: Vec<(u64, u64, u64)> = (0..n).map(|i| (i * block, i * block, block)).collect();
        measure::fill(&p.dst, 0);
        let t = p.engine.prepare(&spec(op, local, remote)).map_err(|e| e.to_string())?;
        let (mut ours, mut refs) = (Vec::new(), Vec::new());
        let start = Instant::now();
        while start.elapsed() < per_size || ours.len() < 3 {
            let r0 = Instant::now();
            memcpy_blocks(&p.src, &p.dst, &blocks);
            refs.push(r0.elapsed().as_secs_f64());
            ours.push(post_and_wait(&t)?);
        }
        measure::fill(&p.dst, 0);
        post_and_wait(&t)?;
        let verified = same(&p.src, 0, &p.dst, 0, total);
        drop(t);
        emit_bulk(report, "reference", "memcpy", &name(op, "W1"), block, n, total, &mut refs, true, None);
        emit_bulk(report, "orbite", route.name(), &name(op, "W1"), block, n, total, &mut ours, verified, None);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn emit_bulk(
    report: &mut Report,
    system: &str,
    route: &str,
    workload: &str,
    block: u64,
    descs: u64,
    bytes: u64,
    samples: &mut [f64],
    verified: bool,
    extra: Option<Value>,
) {
    let secs: f64 = samples.iter().sum();
    let (p50, p99) = percentiles_us(samples);
    let mut row = json!({
        "system": system, "route": route, "workload": workload, "block_bytes": block, "descs": descs,
        "gbps": round(bytes as f64 * samples.len() as f64 / secs / 1e9, 3),
        "p50_us": round(p50, 1), "p99_us": round(p99, 1), "verified": verified,
    });
    if let (Value::Object(m), Some(Value::Object(x))) = (&mut row, extra) {
        m.extend(x);
    }
    report.emit(row);
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// W2: one 4 KiB transfer from post to retirement, many times.
fn w2(route: Route, quick: bool, report: &mut Report) -> Result<(), String> {
    let p: Pair = measure::pair(local_engine()?, (MIB) as usize)?;
    let iters = if quick { 500 } else { 2000 };
    for op in [Op::Write, Op::Read] {
        progress(&format!("{} {} 4 KiB x {iters}", route.name(), name(op, "W2")));
        let (s, d) = ([Desc::new(p.src_id, 0, 4096)], [Desc::new(p.dst_id, 0, 4096)]);
        let (local, remote) = if op == Op::Write { (&s, &d) } else { (&d, &s) };
        let t = p.engine.prepare(&spec(op, local, remote)).map_err(|e| e.to_string())?;
        for _ in 0..50 {
            post_and_wait(&t)?; // warm-up
        }
        let mut samples: Vec<f64> = (0..iters).map(|_| post_and_wait(&t)).collect::<Result<_, _>>()?;
        let verified = same(&p.src, 0, &p.dst, 0, 4096);
        let (p50, p99) = percentiles_us(&mut samples);
        report.emit(json!({
            "system": "orbite", "route": route.name(), "workload": name(op, "W2"), "block_bytes": 4096, "descs": 1,
            "p50_us": round(p50, 2), "p99_us": round(p99, 2), "verified": verified,
        }));
    }
    Ok(())
}

/// Deterministic permutation of 0..n.
fn permutation(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = seed;
    for i in (1..n as usize).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// W3: vLLM-style paged KV: 64 regions of 4 MiB per side, every 16 KiB
/// block moved, block ids permuted on both sides (16384 descriptors).
fn w3(route: Route, op: Op, quick: bool, report: &mut Report) -> Result<(), String> {
    const REGIONS: u64 = 64;
    const REGION: u64 = 4 * MIB;
    const BLOCK: u64 = 16 * KIB;
    let per_region = REGION / BLOCK;
    let engine = local_engine()?;
    let src = engine.allocate_host_memory((REGIONS * REGION) as usize).map_err(|e| e.to_string())?;
    let dst = engine.allocate_host_memory((REGIONS * REGION) as usize).map_err(|e| e.to_string())?;
    measure::fill(&src, 0x3333);
    measure::fill(&dst, 0);
    let mut ranges = Vec::new();
    for mem in [&src, &dst] {
        for r in 0..REGIONS {
            ranges.push(
                MemoryRange::host(mem, (r * REGION) as usize, REGION as usize, Permission::RemoteReadWrite)
                    .map_err(|e| e.to_string())?,
            );
        }
    }
    let ids = engine.register_memory_ranges(ranges).map_err(|e| e.to_string())?;
    let (src_ids, dst_ids) = ids.split_at(REGIONS as usize);
    let (mut src_descs, mut dst_descs, mut blocks) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..REGIONS {
        let (ps, pd) = (permutation(per_region, 11 + r), permutation(per_region, 1000 + r));
        for k in 0..per_region as usize {
            src_descs.push(Desc::new(src_ids[r as usize], ps[k] * BLOCK, BLOCK));
            dst_descs.push(Desc::new(dst_ids[r as usize], pd[k] * BLOCK, BLOCK));
            blocks.push((r * REGION + ps[k] * BLOCK, r * REGION + pd[k] * BLOCK, BLOCK));
        }
    }
    let (local, remote) = match op {
        Op::Write => (&src_descs, &dst_descs),
        Op::Read => (&dst_descs, &src_descs),
    };
    let rounds = if quick { 4 } else { 16 };
    progress(&format!("{} {} 16384 x 16 KiB, {rounds} rounds", route.name(), name(op, "W3")));
    let (mut prep, mut run, mut whole, mut refs, mut lifecycle) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut verified = true;
    for i in 0..rounds + 1 {
        // Both sides start from the same state: destination rewritten.
        measure::fill(&dst, 0);
        let r0 = Instant::now();
        memcpy_blocks(&src, &dst, &blocks);
        let r = r0.elapsed().as_secs_f64();
        measure::fill(&dst, 0);
        let busy0 = engine.route_busy();
        let p0 = Instant::now();
        let t = engine.prepare(&spec(op, local, remote)).map_err(|e| e.to_string())?;
        let pr = p0.elapsed().as_secs_f64();
        let secs = post_and_wait(&t)?;
        let w = p0.elapsed().as_secs_f64();
        let copy = (engine.route_busy() - busy0).as_secs_f64();
        drop(t);
        verified &= blocks.iter().all(|&(s, d, l)| same(&src, s, &dst, d, l));
        if i > 0 {
            // round 0 warms caches and page tables
            prep.push(pr);
            run.push(secs);
            whole.push(w);
            refs.push(r);
            lifecycle.push((w - copy) / copy);
        }
    }
    let total = REGIONS * REGION;
    let n = src_descs.len() as u64;
    let (prep_us, _) = percentiles_us(&mut prep);
    let (whole_us, _) = percentiles_us(&mut whole);
    let (ref_us, _) = percentiles_us(&mut refs.clone());
    let (lifecycle_med, _) = percentiles_us(&mut lifecycle);
    // lifecycle_overhead_pct: prepare + post + completion time that is not
    // the copy itself, relative to the copy (median of rounds);
    // vs_memcpy_pct: the whole (prepare included) against the reference.
    let overhead = json!({
        "prep_us": round(prep_us, 1),
        "lifecycle_overhead_pct": round(lifecycle_med / 1e6 * 100.0, 2),
        "vs_memcpy_pct": round((whole_us / ref_us - 1.0) * 100.0, 2),
    });
    emit_bulk(report, "reference", "memcpy", &name(op, "W3"), BLOCK, n, total, &mut refs, true, None);
    emit_bulk(report, "orbite", route.name(), &name(op, "W3"), BLOCK, n, total, &mut run, verified, Some(overhead));
    Ok(())
}

/// Idle: CPU used by an engine with its progress worker on and nothing in
/// flight.
fn idle(route: Route, quick: bool, report: &mut Report) -> Result<(), String> {
    let secs = if quick { 0.5 } else { 2.0 };
    progress(&format!("{} idle for {secs} s", route.name()));
    let config = EngineConfig { progress_worker: true, ..EngineConfig::default() };
    let p = measure::pair(measure::engine(config)?, MIB as usize)?;
    let t = p
        .engine
        .prepare(&spec(Op::Write, &[Desc::new(p.src_id, 0, 4096)], &[Desc::new(p.dst_id, 0, 4096)]))
        .map_err(|e| e.to_string())?;
    post_and_wait(&t)?;
    std::thread::sleep(Duration::from_millis(50));
    let c0 = measure::process_cpu_ns();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let used = measure::process_cpu_ns().saturating_sub(c0);
    report.emit(json!({
        "system": "orbite", "route": route.name(), "workload": "idle", "seconds": secs,
        "cpu_pct": round(used as f64 / (secs * 1e9) * 100.0, 3),
    }));
    Ok(())
}

fn print_table(rows: &[Map<String, Value>]) {
    let get = |r: &Map<String, Value>, k: &str| r.get(k).cloned().unwrap_or(Value::Null);
    let s = |v: Value| match v {
        Value::String(s) => s,
        Value::Null => "-".into(),
        v => v.to_string(),
    };
    println!();
    println!(
        "{:<7} {:<12} {:>9} {:>10} {:>10} {:>8} {:>10} {:>10} {:>9}",
        "route", "workload", "block", "GB/s", "ref GB/s", "ratio", "p50 us", "p99 us", "verified"
    );
    for r in rows.iter().filter(|r| get(r, "system") == json!("orbite")) {
        let workload = s(get(r, "workload"));
        if workload == "idle" {
            println!(
                "{:<7} {:<12} {:>9} cpu {}% of one core over {} s",
                s(get(r, "route")),
                workload,
                "-",
                s(get(r, "cpu_pct")),
                s(get(r, "seconds"))
            );
            continue;
        }
        let reference = rows.iter().find(|x| {
            get(x, "system") == json!("reference")
                && get(x, "workload") == get(r, "workload")
                && get(x, "block_bytes") == get(r, "block_bytes")
        });
        let gbps = get(r, "gbps").as_f64();
        let ref_gbps = reference.and_then(|x| get(x, "gbps").as_f64());
        let ratio = match (gbps, ref_gbps) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
            _ => "-".into(),
        };
        let block = get(r, "block_bytes")
            .as_u64()
            .map_or("-".into(), |b| if b >= MIB { format!("{} MiB", b / MIB) } else { format!("{} KiB", b / KIB) });
        println!(
            "{:<7} {:<12} {:>9} {:>10} {:>10} {:>8} {:>10} {:>10} {:>9}",
            s(get(r, "route")),
            workload,
            block,
            gbps.map_or("-".into(), |g| format!("{g:.2}")),
            ref_gbps.map_or("-".into(), |g| format!("{g:.2}")),
            ratio,
            s(get(r, "p50_us")),
            s(get(r, "p99_us")),
            s(get(r, "verified")),
        );
        if let Some(o) = r.get("lifecycle_overhead_pct") {
            println!(
                "{:<7} {:<12} prepare {} us; lifecycle (prepare + post + completion, copy excluded) {}% of the copy; \
                 whole transfer {}% over memcpy",
                "",
                "",
                s(get(r, "prep_us")),
                o,
                s(get(r, "vs_memcpy_pct"))
            );
        }
    }
}
