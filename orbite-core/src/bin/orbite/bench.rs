//! `orbite bench`: the workloads of `docs/bench.md` (W1 bulk, W2 latency,
//! W3 paged-KV layout, idle CPU) on each route, beside in-run references,
//! with every destination byte verified. Output: one JSON object per line,
//! then (unless `--json`) a table of ratios.

use std::time::{Duration, Instant};

use clap::Parser;
use orbite_core::{Desc, EngineConfig, Op, RoutePolicy, Transfer, TransferSpec};
use serde_json::{Map, Value, json};

use crate::error::{Error, ValueError, comma_list};
use crate::limits;
use crate::measure::{self, Rng, memcpy_blocks, percentiles_us, post_and_wait, timed, timed_for};
use crate::rig::{MIB, Rig, W3_REGION, W3_REGIONS, Which, digest, pattern, read};

const KIB: u64 = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Local,
    Tcp,
    Shm,
    Cma,
    Rdma,
    Auto,
}

impl Route {
    /// Peer routes with their engine policy (the local route has none).
    fn policy(self) -> Option<RoutePolicy> {
        match self {
            Route::Local => None,
            Route::Tcp => Some(RoutePolicy::Tcp),
            Route::Shm => Some(RoutePolicy::Shm),
            Route::Cma => Some(RoutePolicy::Cma),
            Route::Rdma => Some(RoutePolicy::Rdma),
            Route::Auto => Some(RoutePolicy::Auto),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    W1,
    W2,
    W3,
    Idle,
    /// The KV session layer (not tied to a route).
    Sessions,
    /// Metadata refresh: importing registrations made after the exchange.
    Refresh,
    /// Registration calls with watchers that never read, against none.
    Watchers,
    /// 64 initiator processes writing into one target, against one.
    FanIn,
    /// The KV session service over gRPC against an echo RPC (feature grpc).
    Rpc,
    /// W1 at 1 MiB from and into CUDA device memory against the same from
    /// host memory (feature cuda, a driver or the test shim).
    Vram,
}

/// `orbite bench`'s flags.
#[derive(Debug, Parser)]
#[command(args_override_self = true)]
pub struct BenchArgs {
    /// Routes to measure, a comma list of local, shm, cma, tcp, rdma, auto
    /// or all (= local,shm,cma,tcp); peer routes spawn their target as a
    /// child process on loopback (rdma: through the NICs' loopback, or the
    /// verbs shim named by ORBITE_IBVERBS_LIB, where its rows carry no bar)
    #[arg(long = "route", value_name = "LIST", default_value = "all", value_parser = routes)]
    routes: Routes,
    /// Workloads to run, a comma list of W1, W2, W3, idle, sessions,
    /// refresh, watchers, fan-in, rpc, vram (default: all but rpc, which a
    /// build with --features grpc adds, and vram, which a CUDA device adds)
    #[arg(long = "workload", value_name = "LIST", value_parser = workloads)]
    workloads: Option<Workloads>,
    /// Short run (under 30 s)
    #[arg(long)]
    quick: bool,
    /// W1 descriptor sizes in bytes, a comma list, each dividing 64 MiB
    /// (default: 4 KiB, 16 KiB, 64 KiB, 1 MiB, 16 MiB; --quick: all but 16 KiB)
    #[arg(long, value_name = "LIST", value_parser = blocks)]
    blocks: Option<Blocks>,
    /// Directions of W1 and W3: write, read or write,read
    #[arg(long, value_name = "LIST", default_value = "write,read", value_parser = ops)]
    ops: Ops,
    /// Engine configuration fields to use on both sides, a JSON object
    /// (over the bench's own default: the progress worker on)
    #[arg(long, value_name = "JSON", value_parser = bench_config)]
    config: Option<EngineConfig>,
    /// Print only JSON lines on stdout
    #[arg(long)]
    json: bool,
    /// Also draw W1's GB/s against block size per route and direction,
    /// with each route's in-run limit dashed, into this SVG file
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<std::path::PathBuf>,
}

/// The values of `--route`, `--workload`, `--blocks` and `--ops` (a comma
/// list is one value of its flag: the last one given wins).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Routes(Vec<Route>);
#[derive(Debug, Clone, PartialEq, Eq)]
struct Workloads(Vec<Workload>);
#[derive(Debug, Clone, PartialEq, Eq)]
struct Blocks(Vec<u64>);
#[derive(Debug, Clone, PartialEq, Eq)]
struct Ops(Vec<Op>);

fn routes(v: &str) -> Result<Routes, ValueError> {
    let lists = comma_list(v, |r| match r {
        "local" => Ok(vec![Route::Local]),
        "tcp" => Ok(vec![Route::Tcp]),
        "shm" => Ok(vec![Route::Shm]),
        "cma" => Ok(vec![Route::Cma]),
        "rdma" => Ok(vec![Route::Rdma]),
        "auto" => Ok(vec![Route::Auto]),
        "all" => Ok(vec![Route::Local, Route::Shm, Route::Cma, Route::Tcp]),
        other => Err(ValueError::UnknownRoute(other.to_owned())),
    })?;
    Ok(Routes(lists.concat()))
}

fn workloads(v: &str) -> Result<Workloads, ValueError> {
    comma_list(v, |w| match w.to_ascii_lowercase().as_str() {
        "w1" => Ok(Workload::W1),
        "w2" => Ok(Workload::W2),
        "w3" => Ok(Workload::W3),
        "idle" => Ok(Workload::Idle),
        "sessions" => Ok(Workload::Sessions),
        "refresh" => Ok(Workload::Refresh),
        "watchers" => Ok(Workload::Watchers),
        "fan-in" | "fanin" => Ok(Workload::FanIn),
        "rpc" => Ok(Workload::Rpc),
        "vram" => Ok(Workload::Vram),
        _ => Err(ValueError::UnknownWorkload(w.to_owned())),
    })
    .map(Workloads)
}

fn blocks(v: &str) -> Result<Blocks, ValueError> {
    comma_list(v, |b| {
        let size = b.parse::<u64>().map_err(|source| ValueError::NotANumber { item: b.to_owned(), source })?;
        if size == 0 || (64 * MIB) % size != 0 {
            return Err(ValueError::BlockDoesNotDivide(size));
        }
        Ok(size)
    })
    .map(Blocks)
}

fn ops(v: &str) -> Result<Ops, ValueError> {
    comma_list(v, |o| match o {
        "write" => Ok(Op::Write),
        "read" => Ok(Op::Read),
        other => Err(ValueError::UnknownOp(other.to_owned())),
    })
    .map(Ops)
}

/// The bench's engine configuration without `--config`: the defaults with
/// the progress worker on.
fn default_config() -> EngineConfig {
    EngineConfig { progress_worker: true, ..EngineConfig::default() }
}

/// `--config`: the fields given over [`default_config`].
fn bench_config(v: &str) -> Result<EngineConfig, ValueError> {
    let Value::Object(patch) = serde_json::from_str(v).map_err(ValueError::NotJson)? else {
        return Err(ValueError::NotAnObject);
    };
    let mut fields = match serde_json::to_value(default_config()).map_err(ValueError::NotJson)? {
        Value::Object(fields) => fields,
        _ => Map::new(),
    };
    fields.extend(patch);
    Ok(EngineConfig::from_json(&Value::Object(fields).to_string())?)
}

/// What one `orbite bench` run measures: its flags with the defaults
/// resolved.
#[derive(Debug)]
pub struct Plan {
    config: EngineConfig,
    routes: Vec<Route>,
    workloads: Vec<Workload>,
    quick: bool,
    json: bool,
    /// W1 descriptor sizes (default: those of docs/bench.md).
    blocks: Option<Vec<u64>>,
    /// Directions of W1 and W3 (default both).
    ops: Vec<Op>,
    /// Where to draw W1's figures (SVG).
    plot: Option<std::path::PathBuf>,
}

impl From<BenchArgs> for Plan {
    fn from(args: BenchArgs) -> Self {
        Plan {
            config: args.config.unwrap_or_else(default_config),
            routes: args.routes.0,
            workloads: args.workloads.map_or_else(default_workloads, |w| w.0),
            quick: args.quick,
            json: args.json,
            blocks: args.blocks.map(|b| b.0),
            ops: args.ops.0,
            plot: args.plot,
        }
    }
}

/// Every workload this build and this machine can run.
fn default_workloads() -> Vec<Workload> {
    let mut workloads = vec![
        Workload::W1,
        Workload::W2,
        Workload::W3,
        Workload::Idle,
        Workload::Sessions,
        Workload::Refresh,
        Workload::Watchers,
        Workload::FanIn,
    ];
    if cfg!(feature = "grpc") {
        workloads.push(Workload::Rpc);
    }
    // Device memory where the build and the machine have it.
    if orbite_core::cuda::availability().is_ok() {
        workloads.push(Workload::Vram);
    }
    workloads
}

struct Report {
    json: bool,
    rows: Vec<Map<String, Value>>,
}

impl Report {
    fn emit(&mut self, row: Value) {
        let Value::Object(map) = row else { return };
        let line = Value::Object(map.clone()).to_string();
        match bar() {
            // Printed around the bar, which goes on below it.
            Some(b) => {
                b.suspend(|| println!("{line}"));
                b.inc(1);
            }
            None => println!("{line}"),
        }
        self.rows.push(map);
    }
}

/// The progress bar on stderr, when stderr is a terminal (else none: the
/// bench says nothing there but its errors).
fn bar() -> Option<&'static indicatif::ProgressBar> {
    use std::io::IsTerminal;
    static BAR: std::sync::OnceLock<Option<indicatif::ProgressBar>> = std::sync::OnceLock::new();
    BAR.get_or_init(|| {
        std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            let style =
                indicatif::ProgressStyle::with_template("{spinner} {elapsed:>4} orbite bench: {msg} ({pos} rows)");
            if let Ok(style) = style {
                b.set_style(style);
            }
            b.enable_steady_tick(Duration::from_millis(120));
            b
        })
    })
    .as_ref()
}

/// What the bench measures now, on the progress bar.
fn progress(msg: &str) {
    if let Some(b) = bar() {
        b.set_message(msg.to_owned());
    }
}

pub fn run(args: Plan) -> Result<(), Error> {
    let mut report = Report { json: args.json, rows: Vec::new() };
    let started = Instant::now();
    let route_work = args.workloads.iter().any(|w| {
        !matches!(w, Workload::Sessions | Workload::Refresh | Workload::Watchers | Workload::FanIn | Workload::Rpc)
    });
    for &route in args.routes.iter().filter(|_| route_work) {
        let config = args.config.clone();
        let mut rig = match route.policy() {
            None => Rig::local(config)?,
            Some(policy) => Rig::peer(config, policy)?,
        };
        progress(&format!("{} route: ready", rig.route));
        let mut limits = Limits::default();
        if route == Route::Tcp && args.workloads.iter().any(|w| matches!(w, Workload::W1 | Workload::W3)) {
            // The regions W1 and W3 move: 64 MiB, and 64 x 4 MiB.
            let mut regions = Vec::new();
            if args.workloads.contains(&Workload::W1) {
                regions.push(64 * MIB);
            }
            if args.workloads.contains(&Workload::W3) {
                regions.push(W3_REGIONS * W3_REGION);
            }
            let n = rig.engine.config().connections_per_peer;
            limits.streams = Some(stream_references(args.quick, n, &regions, &mut limits.regions, &mut report)?);
        }
        let rss = if args.workloads.contains(&Workload::W1) { Some(rss_probe(&mut rig)?) } else { None };
        for &w in &args.workloads {
            match w {
                Workload::W1 => {
                    for &op in &args.ops {
                        w1(&mut rig, op, &args, &limits, &mut report)?;
                    }
                }
                Workload::W2 => w2(&mut rig, args.quick, &mut report)?,
                Workload::W3 => {
                    for &op in &args.ops {
                        w3(&mut rig, op, args.quick, &limits, &mut report)?;
                    }
                }
                Workload::Idle => idle(&mut rig, args.quick, &mut report)?,
                Workload::Vram => vram_w1(&mut rig, &args.ops, args.quick, &mut report)?,
                Workload::Sessions | Workload::Refresh | Workload::Watchers | Workload::FanIn | Workload::Rpc => {}
            }
        }
        if let Some(probe) = rss {
            rss_row(&mut rig, probe, &mut report)?;
        }
    }
    if args.workloads.contains(&Workload::Sessions) {
        progress("sessions: S1 session life, S2 reaper with 100 000 and 1 000 live sessions");
        report.emit(crate::sessions::lifecycle(args.quick)?);
        for row in crate::sessions::reaper_scaling(args.quick)? {
            report.emit(row);
        }
        progress("sessions: S3 the built-in reaper thread with 100 000 and 1 000 live sessions");
        for row in crate::sessions::reaper_threads(args.quick)? {
            report.emit(row);
        }
    }
    if args.workloads.contains(&Workload::Rpc) {
        #[cfg(feature = "grpc")]
        {
            progress("rpc: KV session lives over gRPC against an echo RPC, one client and 16");
            for row in crate::rpc::run(args.quick)? {
                report.emit(row);
            }
        }
        #[cfg(not(feature = "grpc"))]
        progress("rpc: SKIP (this orbite was built without the grpc feature: cargo run --release --features grpc)");
    }
    if args.workloads.contains(&Workload::Refresh) {
        progress("refresh: importing 1 000 registrations made after the exchange, 10 000 at open");
        report.emit(crate::refresh::run(args.quick)?);
    }
    if args.workloads.contains(&Workload::Watchers) {
        progress("watchers: 2 000 registrations and deregistrations with 200 watchers that never read, and none");
        report.emit(crate::watchers::run(args.quick)?);
    }
    if args.workloads.contains(&Workload::FanIn) {
        progress("fan-in: 64 initiator processes writing 16 KiB blocks into one target, and one alone");
        report.emit(crate::fanin::run(args.quick, &args.config)?);
    }
    progress(&format!("done in {:.1} s", started.elapsed().as_secs_f64()));
    if let Some(b) = bar() {
        b.finish_and_clear();
    }
    if !report.json {
        print_table(&report.rows);
    }
    if let Some(path) = &args.plot {
        let title = format!("orbite bench: W1 GB/s by block size ({})", if args.quick { "--quick" } else { "full" });
        let svg = crate::plot::svg(&report.rows, &title).ok_or(Error::NothingToPlot)?;
        std::fs::write(path, svg).map_err(|e| Error::Plot(path.display().to_string(), e.to_string()))?;
    }
    let failed = report.rows.iter().any(|r| r.get("verified") == Some(&Value::Bool(false)));
    if failed { Err(Error::NotVerified) } else { Ok(()) }
}

fn name(op: Op, base: &str) -> String {
    format!("{base}-{}", if op == Op::Write { "write" } else { "read" })
}

/// The limits a route's bulk rows are compared with, measured in the run.
#[derive(Default)]
struct Limits {
    /// GB/s of one loopback stream and of N in parallel (tcp), each
    /// reusing one cache-hot buffer.
    streams: Option<(f64, f64)>,
    /// GB/s of N streams cycling through a region of distinct memory the
    /// size of a workload's, by the region's size (tcp).
    regions: Vec<(u64, f64)>,
}

/// GB/s of `samples` (seconds) each moving `bytes`.
fn gbps(bytes: u64, samples: &[f64]) -> f64 {
    let secs: f64 = samples.iter().sum();
    if secs > 0.0 { bytes as f64 * samples.len() as f64 / secs / 1e9 } else { 0.0 }
}

/// The process_vm reference of a cma measurement: the target's pid, the
/// direction, the local memory and the blocks (`(local_off, remote_addr,
/// len)`, addresses in the target).
struct CmaRef<'a> {
    pid: i32,
    op: Op,
    local: &'a orbite_core::HostMemory,
    blocks: &'a [(u64, u64, u64)],
}

/// `blocks` (`(local_off, remote_off, len)`) with remote offsets made
/// addresses from `base`: built once per measurement, not per sample.
fn at_base(blocks: &[(u64, u64, u64)], base: u64) -> Vec<(u64, u64, u64)> {
    blocks.iter().map(|&(l, r, n)| (l, base + r, n)).collect()
}

/// The copy references of one bulk measurement: one thread (`memcpy`),
/// as many threads as the route has workers (`memcpy-mt`, the copy
/// limit), and on cma one `process_vm_writev` loop (`process_vm`).
#[derive(Default)]
struct CopyRefs {
    one: Vec<f64>,
    mt: Vec<f64>,
    cma: Vec<f64>,
    cma_mt: Vec<f64>,
}

impl CopyRefs {
    /// Runs each reference once over `blocks` (`(local_off, remote_off,
    /// len)` of the local scratch copy `src` -> `dst`, and of the cma
    /// target's memory at `cma` = (pid, remote base)).
    fn sample(
        &mut self,
        src: &orbite_core::HostMemory,
        dst: &orbite_core::HostMemory,
        blocks: &[(u64, u64, u64)],
        threads: usize,
        cma: Option<CmaRef<'_>>,
    ) -> Result<(), Error> {
        let r0 = Instant::now();
        memcpy_blocks(src, dst, blocks);
        self.one.push(r0.elapsed().as_secs_f64());
        self.mt.push(limits::memcpy_threads(src, dst, blocks, threads));
        if let Some(c) = cma {
            self.cma.push(limits::cma_loop(c.pid, c.op, c.local, c.blocks)?);
            self.cma_mt.push(limits::cma_threads(c.pid, c.op, c.local, c.blocks, threads)?);
        }
        Ok(())
    }

    /// Emits the reference rows and returns the limit fields of the data
    /// row: its limit (the copy limit, or N streams on tcp), its GB/s and
    /// the row's ratio to it, and the ratio to one stream on tcp.
    #[allow(clippy::too_many_arguments)]
    fn emit(
        &mut self,
        report: &mut Report,
        route: &str,
        workload: &str,
        block: u64,
        n: u64,
        total: u64,
        threads: usize,
        limits: &Limits,
        ours: &[f64],
    ) -> Value {
        let mut reference = |route: &str, samples: &mut [f64], extra: Option<Value>| {
            emit_bulk(report, "reference", route, workload, block, n, total, samples, true, extra);
        };
        reference("memcpy", &mut self.one, None);
        let mt = gbps(total, &self.mt);
        reference("memcpy-mt", &mut self.mt, Some(json!({ "threads": threads })));
        let mut cma_mt = None;
        if !self.cma.is_empty() {
            reference("process_vm", &mut self.cma, None);
            cma_mt = Some(gbps(total, &self.cma_mt));
            reference("process_vm-mt", &mut self.cma_mt, Some(json!({ "threads": threads })));
        }
        let got = gbps(total, ours);
        match (route, limits.streams) {
            ("tcp", Some((one, par))) => {
                let mut v = json!({
                    "limit": "socket-par", "limit_gbps": round(par, 3), "x_limit": ratio(got, par),
                    "x_stream": ratio(got, one),
                });
                // The same streams moving distinct memory as large as this
                // workload's, which is what the route moves.
                if let Some(&(_, region)) = limits.regions.iter().find(|(size, _)| *size == total) {
                    extend(&mut v, json!({ "x_socket_par_region": ratio(got, region) }));
                }
                v
            }
            _ => {
                let mut v = json!({ "limit": "memcpy-mt", "limit_gbps": round(mt, 3), "x_limit": ratio(got, mt) });
                if let Some(k) = cma_mt {
                    // The kernel's own cross-memory copy with the same
                    // threads: what any cma copy can reach here.
                    extend(&mut v, json!({ "x_process_vm_mt": ratio(got, k) }));
                }
                v
            }
        }
    }
}

fn ratio(a: f64, b: f64) -> Value {
    if b > 0.0 { json!(round(a / b, 3)) } else { Value::Null }
}

/// The cma target's process and the address of its W1 (`Which::W1`) or
/// first W3 region, for the process_vm reference (cma route only).
fn cma_target(rig: &Rig, which: Which) -> Option<(i32, u64)> {
    if rig.route != "cma" {
        return None;
    }
    let pid = rig.remote_pid()?;
    let (regs, _) = rig.segment()?.registrations();
    let id = match which {
        Which::W1 => rig.r_id,
        Which::W3 => rig.r3_ids[0],
    };
    regs.iter().find(|r| r.id == id).map(|r| (pid, r.addr))
}

/// W1: 64 MiB in descriptors of B bytes, repeated; interleaved with the
/// copy references over the same blocks (between two local buffers, and
/// on cma into the target process).
fn w1(rig: &mut Rig, op: Op, args: &Plan, limits: &Limits, report: &mut Report) -> Result<(), Error> {
    let quick = args.quick;
    let total = 64 * MIB;
    let per_size = if quick { Duration::from_millis(60) } else { Duration::from_secs(2) };
    let threads = rig.engine.config().route_workers() as usize;
    // --quick keeps the sizes of docs/bench.md's bars (4 KiB is the
    // descriptor-count extreme, 64 KiB and up carry the bars).
    let sizes: &[u64] = match &args.blocks {
        Some(b) => b,
        None if quick => &[4 * KIB, 64 * KIB, MIB, 16 * MIB],
        None => &[4 * KIB, 16 * KIB, 64 * KIB, MIB, 16 * MIB],
    };
    let cma = cma_target(rig, Which::W1);
    for &block in sizes {
        progress(&format!("{} {} block {} KiB", rig.route, name(op, "W1"), block / KIB));
        let n = total / block;
        let local: Vec<Desc> = (0..n).map(|i| Desc::new(rig.local.l_id, i * block, block)).collect();
        let remote: Vec<Desc> = (0..n).map(|i| Desc::new(rig.r_id, i * block, block)).collect();
        let blocks: Vec<(u64, u64, u64)> = (0..n).map(|i| (i * block, i * block, block)).collect();
        let t = rig.engine.prepare(&TransferSpec::new(op, &local, &remote, rig.target()))?;
        let mut refs = CopyRefs::default();
        let cma_blocks = cma.map(|(pid, base)| (pid, at_base(&blocks, base)));
        let mut ours = timed_for(per_size, || {
            let cma = cma_blocks.as_ref().map(|(pid, b)| CmaRef { pid: *pid, op, local: &rig.local.l, blocks: b });
            refs.sample(&rig.local.l, &rig.local.l3, &blocks, threads, cma)?;
            post_and_wait(&t)
        })?;
        // Verify one more execution from a known state.
        let verified = verify_w1(rig, op, &t, total)?;
        drop(t);
        let w = name(op, "W1");
        let extra = refs.emit(report, rig.route, &w, block, n, total, threads, limits, &ours);
        emit_bulk(report, "orbite", rig.route, &w, block, n, total, &mut ours, verified, Some(extra));
    }
    Ok(())
}

/// Runs `t`, over the first `len` bytes of the W1 regions, once more from
/// a known state: whether the destination bytes are the source's.
fn verify_w1(rig: &mut Rig, op: Op, t: &Transfer, len: u64) -> Result<bool, Error> {
    rig.fill_remote(0x2222)?;
    measure::fill(&rig.local.l, if op == Op::Write { 0x1111 } else { 0 });
    post_and_wait(t)?;
    let verified = match op {
        Op::Write => rig.remote_digest(Which::W1, 0, len)? == digest(&read(&rig.local.l, 0, len)),
        Op::Read => read(&rig.local.l, 0, len) == pattern(0x2222, 0, len),
    };
    measure::fill(&rig.local.l, 0x1111);
    Ok(verified)
}

/// `vram-W1-*`: W1 at 1 MiB blocks (64 MiB) with the local side in CUDA
/// device memory, interleaved with the same transfer from host memory:
/// the cost of the driver copies (self connection) or of staging (peer
/// routes) on top of the host route, `staging_overhead_pct` (bar 10 with
/// the shim, whose copies are memcpy).
fn vram_w1(rig: &mut Rig, ops: &[Op], quick: bool, report: &mut Report) -> Result<(), Error> {
    use orbite_core::{MemoryRange, Permission};
    orbite_core::cuda::availability().map_err(Error::Vram)?;
    let (total, block) = (64 * MIB, MIB);
    let n = total / block;
    let per = if quick { Duration::from_millis(60) } else { Duration::from_secs(2) };
    let m = rig.engine.allocate_cuda_memory(0, total as usize)?;
    let range = MemoryRange::cuda(&m, 0, total as usize, Permission::RemoteReadWrite)?;
    let v = rig.engine.register_memory_ranges(vec![range])?[0];
    // The driver's own 1 MiB copy bandwidth with page-locked host memory,
    // the direction of the device side (a row of its own).
    use orbite_core::cuda::{CopyDirection, reference_copy_gbps};
    let iters = if quick { 16 } else { 256 };
    let mut limit = std::collections::HashMap::new();
    for (op, dir) in [(Op::Write, CopyDirection::DeviceToHost), (Op::Read, CopyDirection::HostToDevice)] {
        if !ops.contains(&op) {
            continue;
        }
        let g = reference_copy_gbps(m.device(), dir, block, total, iters).map_err(Error::Vram)?;
        limit.insert(op, g);
        report.emit(json!({
            "system": "reference", "route": "cuda-pinned", "workload": format!("vram-{}", name(op, "W1")),
            "block_bytes": block, "gbps": round(g, 3), "direction": format!("{dir:?}"), "verified": true,
        }));
    }
    for &op in ops {
        let w = format!("vram-{}", name(op, "W1"));
        progress(&format!("{} {w} block 1024 KiB", rig.route));
        let remote: Vec<Desc> = (0..n).map(|i| Desc::new(rig.r_id, i * block, block)).collect();
        let dev: Vec<Desc> = (0..n).map(|i| Desc::new(v, i * block, block)).collect();
        let host: Vec<Desc> = (0..n).map(|i| Desc::new(rig.local.l_id, i * block, block)).collect();
        let td = rig.engine.prepare(&TransferSpec::new(op, &dev, &remote, rig.target()))?;
        let staged = td.route().reason.contains("staged");
        let th = rig.engine.prepare(&TransferSpec::new(op, &host, &remote, rig.target()))?;
        let mut hs = Vec::new();
        let mut ds = timed_for(per, || {
            hs.push(post_and_wait(&th)?);
            post_and_wait(&td)
        })?;
        let verified = match op {
            Op::Write => {
                let data = pattern(0x3333, 0, total);
                // SAFETY: no transfer runs on the device memory now.
                unsafe { m.write(0, &data) }?;
                post_and_wait(&td)?;
                rig.remote_digest(Which::W1, 0, total)? == digest(&data)
            }
            Op::Read => {
                rig.fill_remote(0x2222)?;
                post_and_wait(&td)?;
                let mut back = vec![0u8; total as usize];
                // SAFETY: as above.
                unsafe { m.read(0, &mut back) }?;
                back == pattern(0x2222, 0, total)
            }
        };
        drop((td, th));
        let (hg, dg) = (gbps(total, &hs), gbps(total, &ds));
        let extra = json!({
            "host_gbps": round(hg, 3),
            "staging_overhead_pct": round((hg / dg - 1.0) * 100.0, 1),
            "limit": "cuda-pinned",
            "limit_gbps": round(limit[&op], 3),
            "x_limit": round(dg / limit[&op], 3),
            "staged": staged,
            "device": m.device(),
        });
        emit_bulk(report, "orbite", rig.route, &w, block, n, total, &mut ds, verified, Some(extra));
    }
    // Device to device with a same-host peer (once, on the cma rig):
    // CUDA IPC against the driver's own device-to-device copies.
    if rig.route == "cma" {
        vram_ipc(rig, ops, quick, &m, v, report)?;
    }
    rig.engine.deregister(v)?;
    Ok(())
}

/// `vram-W1-*` rows of route `cuda-ipc`: local device memory to and from
/// the target process's device memory, opened here through CUDA IPC, in
/// 1 MiB blocks, against the `cuda-dtod` reference row (`cuMemcpyDtoD`
/// bandwidth of 1 MiB copies on one device, measured in the same run).
fn vram_ipc(
    rig: &mut Rig,
    ops: &[Op],
    quick: bool,
    m: &orbite_core::CudaMemory,
    v: orbite_core::RegistrationId,
    report: &mut Report,
) -> Result<(), Error> {
    use orbite_core::RoutePolicy;
    use orbite_core::cuda::{CopyDirection, reference_copy_gbps};
    let (total, block) = (64 * MIB, MIB);
    let n = total / block;
    let per = if quick { Duration::from_millis(60) } else { Duration::from_secs(2) };
    let iters = if quick { 16 } else { 256 };
    let dtod =
        reference_copy_gbps(m.device(), CopyDirection::DeviceToDevice, block, total, iters).map_err(Error::Vram)?;
    report.emit(json!({
        "system": "reference", "route": "cuda-dtod", "workload": "vram-W1",
        "block_bytes": block, "gbps": round(dtod, 3), "direction": "DeviceToDevice", "verified": true,
    }));
    let rv = rig.remote_vram(total)?;
    for &op in ops {
        let w = format!("vram-{}", name(op, "W1"));
        progress(&format!("cuda-ipc {w} block 1024 KiB"));
        let remote: Vec<Desc> = (0..n).map(|i| Desc::new(rv, i * block, block)).collect();
        let dev: Vec<Desc> = (0..n).map(|i| Desc::new(v, i * block, block)).collect();
        let mut spec = TransferSpec::new(op, &dev, &remote, rig.target());
        spec.options.route = Some(RoutePolicy::CudaIpc);
        let t = rig.engine.prepare(&spec)?;
        let mut ds = timed_for(per, || post_and_wait(&t))?;
        let data = pattern(0x4444 + op as u64, 0, total);
        let verified = match op {
            Op::Write => {
                // SAFETY: no transfer runs on the device memory now.
                unsafe { m.write(0, &data) }?;
                post_and_wait(&t)?;
                rig.remote_vram_digest(0, total)? == digest(&data)
            }
            Op::Read => {
                // The remote bytes are the last WRITE's (or zero): read them
                // back and compare digests.
                post_and_wait(&t)?;
                let mut back = vec![0u8; total as usize];
                // SAFETY: as above.
                unsafe { m.read(0, &mut back) }?;
                rig.remote_vram_digest(0, total)? == digest(&back)
            }
        };
        drop(t);
        let g = gbps(total, &ds);
        let extra = json!({
            "limit": "cuda-dtod",
            "limit_gbps": round(dtod, 3),
            "x_limit": round(g / dtod, 3),
            "staged": false,
            "device": m.device(),
        });
        emit_bulk(report, "orbite", "cuda-ipc", &w, block, n, total, &mut ds, verified, Some(extra));
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

/// Adds the fields of `more` (an object) to `row` (an object).
fn extend(row: &mut Value, more: Value) {
    if let (Value::Object(m), Value::Object(x)) = (row, more) {
        m.extend(x);
    }
}

pub fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// One loopback TCP stream and `n` in parallel (the connections a peer
/// gets), 1 MiB writes from one cache-hot buffer, plain blocking I/O; then
/// the `n` streams through each of `regions` (bytes of distinct memory on
/// each side), pushed onto `measured`. Returns the first two in GB/s.
fn stream_references(
    quick: bool,
    n: u32,
    regions: &[u64],
    measured: &mut Vec<(u64, f64)>,
    report: &mut Report,
) -> Result<(f64, f64), Error> {
    progress(&format!("socket references: one loopback TCP stream and {n} in parallel, 1 MiB writes"));
    let dur = if quick { Duration::from_millis(200) } else { Duration::from_secs(2) };
    let (one, ok1) = limits::tcp_streams(1, dur, 0)?;
    let (par, okn) = limits::tcp_streams(n as usize, dur, 0)?;
    // BBR paces a single loopback stream far below what CUBIC moves: the
    // rows say which one this run had.
    let congestion = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .map_or_else(|_| "unknown".to_owned(), |s| s.trim().to_owned());
    for (route, streams, bps, ok) in [("socket", 1, one, ok1), ("socket-par", n, par, okn)] {
        report.emit(json!({
            "system": "reference", "route": route, "workload": "W1-write", "block_bytes": MIB, "streams": streams,
            "gbps": round(bps / 1e9, 3), "verified": ok, "congestion_control": congestion,
        }));
    }
    for &region in regions {
        progress(&format!("socket reference: {n} streams through {} MiB of distinct memory", region / MIB));
        let (bps, ok) = limits::tcp_streams(n as usize, dur, region)?;
        let workload = if region == 64 * MIB { "W1-write" } else { "W3-write" };
        report.emit(json!({
            "system": "reference", "route": "socket-par-region", "workload": workload, "block_bytes": MIB,
            "streams": n, "region_bytes": region, "gbps": round(bps / 1e9, 3), "verified": ok,
            "congestion_control": congestion,
        }));
        measured.push((region, bps / 1e9));
    }
    Ok((one / 1e9, par / 1e9))
}

/// The raw TCP round trip (4 KiB answered by 16 bytes, TCP_NODELAY):
/// emits its row and returns its p50 and p99 in microseconds.
fn round_trip_reference(iters: usize, report: &mut Report) -> Result<(f64, f64), Error> {
    let mut samples = limits::round_trips(iters)?;
    let (p50, p99) = percentiles_us(&mut samples);
    report.emit(json!({
        "system": "reference", "route": "rtt", "workload": "W2-write", "block_bytes": 4096, "descs": 1,
        "p50_us": round(p50, 2), "p99_us": round(p99, 2), "verified": true,
    }));
    Ok((p50, p99))
}

/// The limit fields of a latency row: the round trip's p50, and the row's
/// p50 and p99 against it.
fn latency_limit(p50: f64, p99: f64, rtt: (f64, f64)) -> Value {
    json!({ "limit": "rtt", "limit_us": round(rtt.0, 2), "x_limit": ratio(p50, rtt.0), "x_limit_p99": ratio(p99, rtt.0) })
}

/// Peak resident memory of both processes while W1 moves 64 MiB and then
/// 1 GiB in all (1 MiB descriptors): the engine's memory must not grow
/// with the bytes moved.
struct RssProbe {
    after_64mib: (u64, Option<u64>),
    after_1gib: (u64, Option<u64>),
    reset: bool,
}

fn rss_probe(rig: &mut Rig) -> Result<RssProbe, Error> {
    progress(&format!("{} peak RSS while W1 moves 64 MiB, then 1 GiB", rig.route));
    let reset = limits::reset_peak_rss() & rig.reset_remote_peak_rss()?;
    let n = 64;
    let local: Vec<Desc> = (0..n).map(|i| Desc::new(rig.local.l_id, i * MIB, MIB)).collect();
    let remote: Vec<Desc> = (0..n).map(|i| Desc::new(rig.r_id, i * MIB, MIB)).collect();
    let t = rig.engine.prepare(&TransferSpec::new(Op::Write, &local, &remote, rig.target()))?;
    post_and_wait(&t)?;
    let after_64mib = (limits::peak_rss(), rig.remote_peak_rss()?);
    for _ in 1..16 {
        post_and_wait(&t)?;
    }
    let after_1gib = (limits::peak_rss(), rig.remote_peak_rss()?);
    Ok(RssProbe { after_64mib, after_1gib, reset })
}

/// The route's peak RSS row: both processes over the whole route, and the
/// probe's peaks after 64 MiB and 1 GiB moved.
fn rss_row(rig: &mut Rig, probe: RssProbe, report: &mut Report) -> Result<(), Error> {
    let mib = |b: u64| round(b as f64 / MIB as f64, 1);
    let opt = |b: Option<u64>| b.map_or(Value::Null, |b| json!(mib(b)));
    let growth = |a: (u64, Option<u64>), b: (u64, Option<u64>)| {
        b.0.saturating_sub(a.0).max(b.1.unwrap_or(0).saturating_sub(a.1.unwrap_or(0)))
    };
    let grew = growth(probe.after_64mib, probe.after_1gib);
    // Registered memory per side: the W1 region and the W3 regions.
    let registered = W3_REGIONS * W3_REGION + crate::rig::W1_REGION;
    report.emit(json!({
        "system": "orbite", "route": rig.route, "workload": "rss",
        "initiator_peak_mib": mib(limits::peak_rss()), "target_peak_mib": opt(rig.remote_peak_rss()?),
        "registered_mib_per_side": mib(registered),
        "initiator_peak_mib_64mib": mib(probe.after_64mib.0), "initiator_peak_mib_1gib": mib(probe.after_1gib.0),
        "target_peak_mib_64mib": opt(probe.after_64mib.1), "target_peak_mib_1gib": opt(probe.after_1gib.1),
        "growth_mib_64mib_to_1gib": mib(grew),
        // Independent of the bytes moved: moving 16 x more grew neither
        // peak by more than 1 MiB (page-table and allocator noise).
        "verified": probe.reset && grew <= MIB,
    }));
    Ok(())
}

/// W2: one 4 KiB transfer from post to retirement, many times.
fn w2(rig: &mut Rig, quick: bool, report: &mut Report) -> Result<(), Error> {
    let iters = if quick { 200 } else { 2000 };
    progress(&format!("{} round-trip reference: 4 KiB answered by 16 bytes over loopback TCP x {iters}", rig.route));
    let rtt = round_trip_reference(iters, report)?;
    // On cma, the kernel's own floor: one 4 KiB process_vm_writev (or
    // readv) into the target, timed alone.
    let cma = cma_target(rig, Which::W1);
    for op in [Op::Write, Op::Read] {
        let floor = match cma {
            Some((pid, base)) => {
                let mut s = timed(iters, || limits::cma_loop(pid, op, &rig.local.l, &[(0, base, 4096)]))?;
                let (p50, p99) = percentiles_us(&mut s);
                report.emit(json!({
                    "system": "reference", "route": "process_vm", "workload": name(op, "W2"), "block_bytes": 4096,
                    "descs": 1, "p50_us": round(p50, 2), "p99_us": round(p99, 2), "verified": true,
                }));
                Some(p50)
            }
            None => None,
        };
        progress(&format!("{} {} 4 KiB x {iters}", rig.route, name(op, "W2")));
        let (l, r) = ([Desc::new(rig.local.l_id, 0, 4096)], [Desc::new(rig.r_id, 0, 4096)]);
        let t = rig.engine.prepare(&TransferSpec::new(op, &l, &r, rig.target()))?;
        let mut samples = timed(iters, || post_and_wait(&t))?;
        let verified = verify_w1(rig, op, &t, 4096)?;
        let (p50, p99) = percentiles_us(&mut samples);
        let mut row = json!({
            "system": "orbite", "route": rig.route, "workload": name(op, "W2"), "block_bytes": 4096, "descs": 1,
            "p50_us": round(p50, 2), "p99_us": round(p99, 2), "verified": verified,
        });
        extend(&mut row, latency_limit(p50, p99, rtt));
        if let Some(f) = floor {
            extend(&mut row, json!({ "x_process_vm": ratio(p50, f) }));
        }
        report.emit(row);
    }
    w2_notifications(rig, iters, rtt, report)
}

/// W2 with notifications: a 4 KiB WRITE carrying a notification (post to
/// retirement, which includes the notification's delivery), and a
/// notification ping-pong between the two engines.
fn w2_notifications(rig: &mut Rig, iters: usize, rtt: (f64, f64), report: &mut Report) -> Result<(), Error> {
    progress(&format!("{} W2-write-notif 4 KiB x {iters}", rig.route));
    let (l, r) = ([Desc::new(rig.local.l_id, 0, 4096)], [Desc::new(rig.r_id, 0, 4096)]);
    let note = b"kv-ready\0\xff";
    let mut spec = TransferSpec::new(Op::Write, &l, &r, rig.target());
    spec.notification = Some(note);
    let t = rig.engine.prepare(&spec)?;
    let mut samples = timed(iters, || post_and_wait(&t))?;
    drop(t);
    let delivered = rig.take_remote_notifications()?;
    let verified = delivered == (iters + 50) as u64;
    let (p50, p99) = percentiles_us(&mut samples);
    let mut row = json!({
        "system": "orbite", "route": rig.route, "workload": "W2-write-notif", "block_bytes": 4096, "descs": 1,
        "p50_us": round(p50, 2), "p99_us": round(p99, 2), "verified": verified,
    });
    extend(&mut row, latency_limit(p50, p99, rtt));
    report.emit(row);
    if rig.route == "local" {
        return Ok(()); // a ping-pong needs two engines
    }
    progress(&format!("{} W2-notif-pingpong x {iters}", rig.route));
    rig.start_pong(iters + 50)?;
    let mut ok = true;
    let mut samples = timed(iters, || {
        let start = Instant::now();
        rig.ping(b"ping")?;
        let got = rig.engine.wait_notifications(Duration::from_secs(10));
        ok &= got.len() == 1 && got[0].payload == b"pong";
        Ok(start.elapsed().as_secs_f64())
    })?;
    let (p50, p99) = percentiles_us(&mut samples);
    let mut row = json!({
        "system": "orbite", "route": rig.route, "workload": "W2-notif-pingpong", "p50_us": round(p50, 2),
        "p99_us": round(p99, 2), "verified": ok,
    });
    extend(&mut row, latency_limit(p50, p99, rtt));
    report.emit(row);
    Ok(())
}

/// Deterministic permutation of 0..n.
fn permutation(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = Rng(seed);
    for i in (1..n as usize).rev() {
        v.swap(i, (x.next() % (i as u64 + 1)) as usize);
    }
    v
}

/// W3: vLLM-style paged KV: 64 regions of 4 MiB per side, every 16 KiB
/// block moved, block ids permuted on both sides (16384 descriptors).
fn w3(rig: &mut Rig, op: Op, quick: bool, limits: &Limits, report: &mut Report) -> Result<(), Error> {
    const BLOCK: u64 = 16 * KIB;
    let per_region = W3_REGION / BLOCK;
    let perms: Vec<(Vec<u64>, Vec<u64>)> =
        (0..W3_REGIONS).map(|r| (permutation(per_region, 11 + r), permutation(per_region, 1000 + r))).collect();
    let (mut local, mut remote, mut blocks) = (Vec::new(), Vec::new(), Vec::new());
    for (r, (a, b)) in perms.iter().enumerate() {
        for k in 0..per_region as usize {
            local.push(Desc::new(rig.local.l3_ids[r], a[k] * BLOCK, BLOCK));
            remote.push(Desc::new(rig.r3_ids[r], b[k] * BLOCK, BLOCK));
            blocks.push((r as u64 * W3_REGION + a[k] * BLOCK, r as u64 * W3_REGION + b[k] * BLOCK, BLOCK));
        }
    }
    let threads = rig.engine.config().route_workers() as usize;
    // The target's W3 regions are one allocation: offsets from the first
    // region's address are addresses there.
    let cma_blocks = cma_target(rig, Which::W3).map(|(pid, base)| (pid, at_base(&blocks, base)));
    let rounds = if quick { 2 } else { 16 };
    progress(&format!("{} {} 16384 x 16 KiB, {rounds} rounds", rig.route, name(op, "W3")));
    let (mut prep, mut run, mut whole, mut lifecycle) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut refs = CopyRefs::default();
    for i in 0..rounds + 1 {
        measure::fill(&rig.local.l, 0);
        if i == 1 {
            refs = CopyRefs::default(); // round 0 warms caches and page tables
        }
        let cma = cma_blocks.as_ref().map(|(pid, b)| CmaRef { pid: *pid, op, local: &rig.local.l3, blocks: b });
        refs.sample(&rig.local.l3, &rig.local.l, &blocks, threads, cma)?;
        let busy0 = rig.engine.route_busy();
        let p0 = Instant::now();
        let t = rig.engine.prepare(&TransferSpec::new(op, &local, &remote, rig.target()))?;
        let pr = p0.elapsed().as_secs_f64();
        let secs = post_and_wait(&t)?;
        let w = p0.elapsed().as_secs_f64();
        let copy = (rig.engine.route_busy() - busy0).as_secs_f64();
        drop(t);
        if i > 0 {
            // round 0 warms caches and page tables
            prep.push(pr);
            run.push(secs);
            whole.push(w);
            // With one worker the route's busy time is the copy's wall
            // time; with several it is a sum and says nothing about overhead.
            if copy > 0.0 && rig.engine.config().route_workers() == 1 {
                lifecycle.push((w - copy) / copy);
            }
        }
    }
    // Verify one more execution from a known state.
    rig.fill_remote(0x4444)?;
    if op == Op::Read {
        measure::fill(&rig.local.l3, 0);
    }
    let t = rig.engine.prepare(&TransferSpec::new(op, &local, &remote, rig.target()))?;
    post_and_wait(&t)?;
    drop(t);
    let mut verified = true;
    for (r, (a, b)) in perms.iter().enumerate() {
        let base = r as u64 * W3_REGION;
        let mut want = vec![0u8; W3_REGION as usize];
        for k in 0..per_region as usize {
            let (dst, src) = if op == Op::Write { (b[k], a[k]) } else { (a[k], b[k]) };
            let bytes = match op {
                Op::Write => read(&rig.local.l3, base + src * BLOCK, BLOCK),
                Op::Read => pattern(0x4444, base + src * BLOCK, BLOCK),
            };
            want[(dst * BLOCK) as usize..((dst + 1) * BLOCK) as usize].copy_from_slice(&bytes);
        }
        verified &= match op {
            Op::Write => rig.remote_digest(Which::W3, base, W3_REGION)? == digest(&want),
            Op::Read => read(&rig.local.l3, base, W3_REGION) == want,
        };
    }
    measure::fill(&rig.local.l3, 0x3333);
    let total = W3_REGIONS * W3_REGION;
    let n = local.len() as u64;
    let (prep_us, _) = percentiles_us(&mut prep);
    let (whole_us, _) = percentiles_us(&mut whole);
    let (ref_us, _) = percentiles_us(&mut refs.one.clone());
    let mut extra = json!({ "prep_us": round(prep_us, 1) });
    if let Value::Object(m) = &mut extra {
        if rig.route != "tcp" {
            // vs_memcpy_pct: the whole transfer (prepare included) against
            // the reference.
            m.insert("vs_memcpy_pct".into(), json!(round((whole_us / ref_us - 1.0) * 100.0, 2)));
        }
        if !lifecycle.is_empty() {
            // lifecycle_overhead_pct: prepare + post + completion time that
            // is not the copy itself, relative to the copy (median of rounds).
            let (lifecycle_med, _) = percentiles_us(&mut lifecycle);
            m.insert("lifecycle_overhead_pct".into(), json!(round(lifecycle_med / 1e6 * 100.0, 2)));
        }
    }
    let w = name(op, "W3");
    extend(&mut extra, refs.emit(report, rig.route, &w, BLOCK, n, total, threads, limits, &run));
    emit_bulk(report, "orbite", rig.route, &w, BLOCK, n, total, &mut run, verified, Some(extra));
    Ok(())
}

/// Idle: CPU used by the engines (both processes for a peer route) with
/// the progress worker on, peers connected and nothing in flight.
fn idle(rig: &mut Rig, quick: bool, report: &mut Report) -> Result<(), Error> {
    let secs = if quick { 0.25 } else { 2.0 };
    progress(&format!("{} idle for {secs} s", rig.route));
    std::thread::sleep(Duration::from_millis(50));
    let (c0, r0) = (measure::process_cpu_ns(), rig.remote_cpu_ns()?);
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (c1, r1) = (measure::process_cpu_ns(), rig.remote_cpu_ns()?);
    let used = c1.saturating_sub(c0) + r1.saturating_sub(r0);
    report.emit(json!({
        "system": "orbite", "route": rig.route, "workload": "idle", "seconds": secs,
        "cpu_pct": round(used as f64 / (secs * 1e9) * 100.0, 3),
    }));
    Ok(())
}

/// The table's line of each workload that has one of its own (after its
/// route and name): the text, and the fields that fill its `{}`.
const SENTENCES: [(&str, &str, &str); 4] = [
    (
        "S2-reaper",
        "{} live, {} renewals/tick: {} expired, {} leases visited; tick {} ns with none expiring, {} ns per expired \
         lease",
        "live_sessions renewals_per_tick expired leases_visited tick_ns_none_expiring tick_ns_per_expired",
    ),
    (
        "refresh",
        "importing {} made after the exchange: {} us; {} that existed at open: {} us ({}x, bar 2x)",
        "imported late_import_us imported existing_import_us x_limit",
    ),
    (
        "rss",
        "peak RSS initiator {} MiB, target {} MiB ({} MiB registered per side); after W1 moved 64 MiB / 1 GiB: \
         initiator {} / {} MiB, target {} / {} MiB",
        "initiator_peak_mib target_peak_mib registered_mib_per_side initiator_peak_mib_64mib \
         initiator_peak_mib_1gib target_peak_mib_64mib target_peak_mib_1gib",
    ),
    ("idle", "        - cpu {}% of one core over {} s", "cpu_pct seconds"),
];

fn print_table(rows: &[Map<String, Value>]) {
    let get = |r: &Map<String, Value>, k: &str| r.get(k).cloned().unwrap_or(Value::Null);
    let s = |v: Value| match v {
        Value::String(s) => s,
        Value::Null => "-".into(),
        v => v.to_string(),
    };
    println!();
    println!(
        "route   workload               block       GB/s   ref GB/s    ratio      limit        limit  x_limit     \
         p50 us     p99 us  verified"
    );
    println!(
        "(ref: one loopback TCP stream for tcp, one-thread memcpy of the same blocks for every other route; limit: \
         N streams (socket-par) for tcp, memcpy with the route's worker count (memcpy-mt) otherwise, the raw \
         4 KiB TCP round trip (rtt) for latency rows, whose x_limit is p50 over the round trip's p50)"
    );
    for r in rows.iter().filter(|r| get(r, "system") == json!("orbite")) {
        let workload = s(get(r, "workload"));
        if let Some(Value::String(line)) = r.get("summary") {
            println!("{:<7} {:<18} {line}", s(get(r, "route")), workload);
            continue;
        }
        // Rows that read as a sentence: the fields named after it fill its
        // `{}` in turn.
        if let Some((_, text, keys)) = SENTENCES.iter().find(|(w, ..)| *w == workload) {
            let mut parts = text.split("{}");
            let mut line = format!("{:<7} {:<18} {}", s(get(r, "route")), workload, parts.next().unwrap_or(""));
            for (key, part) in keys.split_whitespace().zip(parts) {
                line += &s(get(r, key));
                line += part;
            }
            println!("{line}");
            continue;
        }
        // tcp is compared with the socket; the self connection and the
        // same-host routes with memcpy of the same blocks, measured in the
        // same loop (the latest such reference row before this one).
        let at = rows.iter().position(|x| std::ptr::eq(x, r)).unwrap_or(0);
        let reference = rows[..at].iter().rev().find(|x| {
            get(x, "system") == json!("reference")
                && if get(r, "route") == json!("tcp") {
                    get(x, "route") == json!("socket")
                } else {
                    get(x, "route") == json!("memcpy")
                        && get(x, "workload") == get(r, "workload")
                        && get(x, "block_bytes") == get(r, "block_bytes")
                }
        });
        let gbps = get(r, "gbps").as_f64();
        let ref_gbps = reference.and_then(|x| get(x, "gbps").as_f64()).filter(|_| gbps.is_some());
        let ratio = match (gbps, ref_gbps) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
            _ => "-".into(),
        };
        let block = get(r, "block_bytes")
            .as_u64()
            .map_or("-".into(), |b| if b >= MIB { format!("{} MiB", b / MIB) } else { format!("{} KiB", b / KIB) });
        let limit_value = match (r.get("limit_gbps"), r.get("limit_us")) {
            (Some(g), _) => format!("{} GB/s", s(g.clone())),
            (None, Some(u)) => format!("{} us", s(u.clone())),
            _ => "-".into(),
        };
        println!(
            "{:<7} {:<18} {:>9} {:>10} {:>10} {:>8} {:>10} {:>12} {:>8} {:>10} {:>10} {:>9}",
            s(get(r, "route")),
            workload,
            block,
            gbps.map_or("-".into(), |g| format!("{g:.2}")),
            ref_gbps.map_or("-".into(), |g| format!("{g:.2}")),
            ratio,
            s(get(r, "limit")),
            limit_value,
            s(get(r, "x_limit")),
            s(get(r, "p50_us")),
            s(get(r, "p99_us")),
            s(get(r, "verified")),
        );
        if r.get("lifecycle_overhead_pct").is_none() && r.get("prep_us").is_some() {
            let vs = r.get("vs_memcpy_pct").map(|v| format!("; whole transfer {v}% over memcpy")).unwrap_or_default();
            println!("{:<7} {:<18} prepare {} us{vs}", "", "", s(get(r, "prep_us")));
        }
        if let Some(o) = r.get("lifecycle_overhead_pct") {
            println!(
                "{:<7} {:<18} prepare {} us; lifecycle (prepare + post + completion, copy excluded) {}% of the copy; \
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

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use orbite_core::{EngineConfig, Op};

    use super::{Plan, Route, Workload, default_config, default_workloads};
    use crate::{Command, parse};

    fn plan(args: &[&str]) -> Plan {
        match parse(&[&["bench"], args].concat()) {
            Ok(Command::Bench(args)) => (*args).into(),
            other => panic!("{other:?}"),
        }
    }

    /// clap's message for a refused value: it names the flag.
    fn refused(args: &[&str]) -> String {
        let e = parse(&[&["bench"], args].concat()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation, "{args:?}: {e}");
        e.to_string()
    }

    #[test]
    fn each_table_sentence_has_a_field_per_placeholder() {
        for (workload, text, fields) in super::SENTENCES {
            assert_eq!(text.matches("{}").count(), fields.split_whitespace().count(), "{workload}");
        }
    }

    #[test]
    fn defaults() {
        let p = plan(&[]);
        assert_eq!(p.routes, [Route::Local, Route::Shm, Route::Cma, Route::Tcp]);
        assert_eq!(p.workloads, default_workloads());
        assert_eq!(
            &p.workloads[..8],
            [
                Workload::W1,
                Workload::W2,
                Workload::W3,
                Workload::Idle,
                Workload::Sessions,
                Workload::Refresh,
                Workload::Watchers,
                Workload::FanIn
            ]
        );
        assert_eq!(p.workloads.contains(&Workload::Rpc), cfg!(feature = "grpc"));
        assert_eq!((p.quick, p.json, p.blocks, p.ops), (false, false, None, vec![Op::Write, Op::Read]));
        assert_eq!(p.config, EngineConfig { progress_worker: true, ..EngineConfig::default() });
        assert_eq!(p.config, default_config());
    }

    #[test]
    fn lists_take_commas_and_spaces() {
        let p = plan(&["--route", "tcp,shm", "--workload", "W1,w3, idle,FANIN,fan-in,Sessions,vram,rpc"]);
        assert_eq!(p.routes, [Route::Tcp, Route::Shm]);
        use Workload::*;
        assert_eq!(p.workloads, [W1, W3, Idle, FanIn, FanIn, Sessions, Vram, Rpc]);
        let p = plan(&["--route", "auto,all", "--workload", "refresh,watchers,W2"]);
        assert_eq!(p.routes, [Route::Auto, Route::Local, Route::Shm, Route::Cma, Route::Tcp]);
        assert_eq!(p.workloads, [Refresh, Watchers, W2]);
        let p = plan(&["--blocks", "1048576,16384", "--ops", "read", "--quick", "--json"]);
        assert_eq!((p.blocks, p.ops, p.quick, p.json), (Some(vec![1 << 20, 16384]), vec![Op::Read], true, true));
        assert_eq!(plan(&["--ops", "read, write"]).ops, [Op::Read, Op::Write]);
    }

    #[test]
    fn the_last_of_a_repeated_flag_wins() {
        let p =
            plan(&["--route", "tcp", "--route", "cma", "--quick", "--quick", "--blocks", "4096", "--blocks", "65536"]);
        assert_eq!((p.routes, p.blocks, p.quick), (vec![Route::Cma], Some(vec![65536]), true));
    }

    #[test]
    fn config_fields_override_the_bench_defaults() {
        let p = plan(&["--config", r#"{"connections_per_peer": 2}"#]);
        assert_eq!(p.config, EngineConfig { connections_per_peer: 2, ..default_config() });
        let p = plan(&["--config", r#"{"progress_worker": false, "local_route_workers": 1}"#]);
        assert_eq!(p.config, EngineConfig { progress_worker: false, local_route_workers: 1, ..default_config() });
    }

    #[test]
    fn refused_values_name_the_flag_and_why() {
        for (args, flag, why) in [
            (&["--route", "tcp,udp"][..], "--route", "unknown route `udp`"),
            (&["--route", "tcp,"], "--route", "unknown route ``"),
            (&["--workload", "W1,W9"], "--workload", "unknown workload `W9`"),
            (&["--ops", "write,both"], "--ops", "unknown op `both`"),
            (&["--blocks", "4096,1k"], "--blocks", "`1k` is not a number"),
            (&["--blocks", "3"], "--blocks", "3 does not divide 64 MiB"),
            (&["--blocks", "0"], "--blocks", "0 does not divide 64 MiB"),
            (&["--config", "{"], "--config", "not JSON"),
            (&["--config", "[]"], "--config", "needs a JSON object"),
            (&["--config", r#"{"connections_per_peers": 2}"#], "--config", "unknown field `connections_per_peers`"),
        ] {
            let e = refused(args);
            assert!(e.contains(flag) && e.contains(why), "{args:?}: {e}");
        }
    }
}
